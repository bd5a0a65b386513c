// The AVX-512 kernels (namespace sdpa::avx512), compiled in a target region whatever the translation unit's
// -march and run only where sdpa/cpu.hpp finds AVX-512 F, BW, DQ and VL: the vector traits below, and the
// generic kernels of sdpa/simd/*.inc instantiated over them (the GEMM micro-kernels and packing, the softmax
// row passes, Philox, the row products of the decoding step and the few-row projections), plus the
// softmax exponent, which uses instructions AVX2 lacks.
//
// GEMM register tile: 6 rows x 4 zmm vectors (64 floats or 32 doubles). With two FMA pipes of latency 4 at
// least 8 independent chains are needed, and 24 accumulators leave the loads and broadcasts room between
// them, while 24 + 4 B vectors + 1 broadcast stay within the 32 zmm registers. The k loop reads 4 vectors
// and 6 scalars per 24 FMAs (a 12 x 2 tile reads 2 and 12: 14 loads against 10, which held the products
// further from the FMA peak; bench/RESULTS.md, "A 6 x 64 register tile on AVX-512"); the 6 x kc A sliver
// stays in L1 while B slivers stream from L2 (gemm/blocking.hpp). 64 columns also fit the tiled kernels'
// operands (d = 64, key blocks of 256) without a ragged tile.
//
// Every loop over a fixed number of registers below is unrolled by pragma: at -O2 (how distributions build)
// GCC otherwise kept sum_lanes' partial sums in a stack array, slowing a stored key's score (bench/RESULTS.md).
#pragma once

#include "sdpa/config.hpp"

#if SDPA_DISPATCH

#include "sdpa/detail/intrinsics.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "sdpa/gemm/blocking.hpp"
#include "sdpa/gemm/epilogue.hpp"
#include "sdpa/gemm/operands.hpp"
#include "sdpa/simd/rows.hpp"
#include "sdpa/simd/avx2.hpp"
#include "sdpa/storage.hpp"

#include "sdpa/simd/target_avx512_begin.hpp"

SDPA_NAMESPACE_BEGIN
namespace avx512 {

#include "sdpa/simd/avx512_tile.hpp"

template <typename Scalar>
struct Vec;

template <>
struct Vec<float> {
  using Scalar = float;
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr Eigen::Index width = 16;
  static constexpr Eigen::Index kGemmRows = 6;
  static constexpr Eigen::Index kGemmVectors = 4;
  // The full tile's k loop in assembly (sdpa/simd/avx512_tile.hpp).
  static constexpr bool kHasTileKLoop = true;
  static constexpr Eigen::Index kTileMinDepth = 384;
  using TileLoopArgs = gemm::detail::TileLoopArgs;
  template <std::int64_t StepBytes>
  SDPA_ALWAYS_INLINE static void tile_k_loop(const TileLoopArgs& args, Reg (&acc)[6][4]) noexcept {
    gemm_tile_k_loop<float, StepBytes>(args, acc);
  }
  static void prefetch(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static void prefetch_l2(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
  // Integer products of int8 keys with int16 queries (generic_int8.inc's int8_chunk_scores), as
  // Vec<float> of simd/avx2.hpp over 32 features a step (vpmovsxbw, vpmaddwd); simd/vnni.hpp fuses the
  // product and the sum (vpdpwssd) where the CPU has AVX512_VNNI. Exact while the sums stay under 2^31
  // (storage.hpp's kInt16QueryMaxLength).
  static constexpr bool kInt8Products = true;
  static constexpr Eigen::Index kInt8Step = 32;
  using IReg = __m512i;
  static IReg izero() noexcept { return _mm512_setzero_si512(); }
  static IReg iadd(IReg a, IReg b) noexcept { return _mm512_add_epi32(a, b); }
  static IReg iloadu(const std::int32_t* p) noexcept { return _mm512_loadu_si512(p); }
  static __m512i widen_keys(const std::int8_t* k) noexcept {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k)));
  }
  static IReg int8_accumulate(IReg acc, const std::int8_t* k, const std::int16_t* q) noexcept {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(widen_keys(k), _mm512_loadu_si512(q)));
  }
  // Lane t of the result is the sum of r[t]'s lanes, in the float sum_lanes' tree (exact in integers).
  static IReg sum_lanes(const IReg (&r)[16]) noexcept {
    constexpr Mask kAll = 0xFFFF;
    const auto in = [&](int s) -> const IReg& { return r[4 * (s % 4) + s / 4]; };
    const auto shuffle128 = [](IReg a, IReg b, auto imm) SDPA_ALWAYS_INLINE_LAMBDA {
      return _mm512_maskz_shuffle_i32x4(kAll, a, b, decltype(imm)::value);
    };
    const auto shuffle32 = [](IReg a, IReg b, auto imm) SDPA_ALWAYS_INLINE_LAMBDA {
      return _mm512_castps_si512(
          _mm512_maskz_shuffle_ps(kAll, _mm512_castsi512_ps(a), _mm512_castsi512_ps(b), decltype(imm)::value));
    };
    using I44 = std::integral_constant<int, 0x44>;
    using IEE = std::integral_constant<int, 0xEE>;
    using I88 = std::integral_constant<int, 0x88>;
    using IDD = std::integral_constant<int, 0xDD>;
    IReg t[8], u[4], v[2];
#pragma GCC unroll 16
    for (int i = 0; i < 8; ++i)
      t[i] = _mm512_add_epi32(shuffle128(in(2 * i), in(2 * i + 1), I44{}), shuffle128(in(2 * i), in(2 * i + 1), IEE{}));
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i)
      u[i] = _mm512_add_epi32(shuffle128(t[2 * i], t[2 * i + 1], I88{}), shuffle128(t[2 * i], t[2 * i + 1], IDD{}));
#pragma GCC unroll 16
    for (int i = 0; i < 2; ++i)
      v[i] = _mm512_add_epi32(shuffle32(u[2 * i], u[2 * i + 1], I44{}), shuffle32(u[2 * i], u[2 * i + 1], IEE{}));
    return _mm512_add_epi32(shuffle32(v[0], v[1], I88{}), shuffle32(v[0], v[1], IDD{}));
  }
  static Reg to_float(IReg x) noexcept { return _mm512_cvtepi32_ps(x); }
  // Lane t is p[t * stride], lane by lane (as simd/avx2.hpp's: a vector load of scalars just stored to the
  // stack would wait for them).
  static Reg strided(const float* p, Eigen::Index stride) noexcept {
    return _mm512_setr_ps(p[0], p[stride], p[2 * stride], p[3 * stride], p[4 * stride], p[5 * stride], p[6 * stride],
                          p[7 * stride], p[8 * stride], p[9 * stride], p[10 * stride], p[11 * stride], p[12 * stride],
                          p[13 * stride], p[14 * stride], p[15 * stride]);
  }
  // simd/avx2.hpp's quantize_query itself (once per query and call; its 256-bit code also keeps GCC's -O0
  // intrinsic macros, whose masked AVX-512 forms warn under -Wsign-conversion, out of this path).
  static bool quantize_query(const float* x, Eigen::Index n, std::int16_t* q, double& factor) noexcept {
    return avx2::Vec<float>::quantize_query(x, n, q, factor);
  }
  static Reg zero() noexcept { return _mm512_setzero_ps(); }
  static Reg set1(float x) noexcept { return _mm512_set1_ps(x); }
  static Reg broadcast(const float* p) noexcept { return _mm512_set1_ps(*p); }  // an FMA's memory operand
  static Reg load(const float* p) noexcept { return _mm512_load_ps(p); }
  static Reg loadu(const float* p) noexcept { return _mm512_loadu_ps(p); }
  static Reg loadu(const float* p, Mask m) noexcept { return _mm512_maskz_loadu_ps(m, p); }
  static void storeu(float* p, Reg x) noexcept { _mm512_storeu_ps(p, x); }
  static void storeu(float* p, Mask m, Reg x) noexcept { _mm512_mask_storeu_ps(p, m, x); }
  // `width` stored elements widened to float (sdpa/storage.hpp), exactly.
  static Reg widen(const BFloat16* p) noexcept {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Reg widen(const Float16* p) noexcept {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // 2 * width bfloat16 values as two float vectors, without a shuffle: lane l of `even` is value 2l, of
  // `odd` value 2l + 1 (a bfloat16 pair fills a 32-bit lane; the high half is the odd one's float, the low
  // half shifted up the even one's).
  static void widen_pairs(const BFloat16* p, Reg& even, Reg& odd) noexcept {
    const __m512i x = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // The values 2l (even) and 2l + 1 (odd) of the 2 * width floats a, b; interleave is its inverse.
  static void deinterleave(Reg a, Reg b, Reg& even, Reg& odd) noexcept {
    const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    even = _mm512_permutex2var_ps(a, e, b);
    odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(e, _mm512_set1_epi32(1)), b);
  }
  static void interleave(Reg even, Reg odd, Reg& a, Reg& b) noexcept {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    a = _mm512_permutex2var_ps(even, lo, odd);
    b = _mm512_permutex2var_ps(even, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), odd);
  }
  static Reg widen(const std::int8_t* p) noexcept {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static Reg fmadd(Reg a, Reg b, Reg c) noexcept { return _mm512_fmadd_ps(a, b, c); }
  static Reg mul(Reg a, Reg b) noexcept { return _mm512_mul_ps(a, b); }
  static Reg add(Reg a, Reg b) noexcept { return _mm512_add_ps(a, b); }
  static Reg max(Reg a, Reg b) noexcept { return _mm512_max_ps(a, b); }
  static float reduce_add(Reg a) noexcept { return _mm512_reduce_add_ps(a); }
  static float reduce_max(Reg a) noexcept { return _mm512_reduce_max_ps(a); }
  // The first n lanes, n in [0, width].
  static Mask mask(Eigen::Index n) noexcept { return static_cast<Mask>((1u << static_cast<unsigned>(n)) - 1u); }
  // Masked-off lanes of x replaced by `fill`.
  static Reg select(Mask m, Reg x, Reg fill) noexcept { return _mm512_mask_blend_ps(m, fill, x); }
  // r[i][j] becomes r[j][i]: 4 x 4 blocks inside 128-bit lanes, then the lanes. The zero-masking forms
  // with a full mask are the same instructions; the plain forms pass GCC 12 an undefined vector that its
  // -Wmaybe-uninitialized reports inside avx512fintrin.h.
  static void transpose(Reg (&r)[16]) noexcept {
    constexpr Mask kAll = 0xFFFF;
    Reg t[16], u[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_maskz_unpacklo_ps(kAll, r[i], r[i + 1]);
      t[i + 1] = _mm512_maskz_unpackhi_ps(kAll, r[i], r[i + 1]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; i += 4) {
      u[i] = _mm512_maskz_shuffle_ps(kAll, t[i], t[i + 2], 0x44);
      u[i + 1] = _mm512_maskz_shuffle_ps(kAll, t[i], t[i + 2], 0xEE);
      u[i + 2] = _mm512_maskz_shuffle_ps(kAll, t[i + 1], t[i + 3], 0x44);
      u[i + 3] = _mm512_maskz_shuffle_ps(kAll, t[i + 1], t[i + 3], 0xEE);
    }
#pragma GCC unroll 16
    for (int x = 0; x < 4; ++x) {
      const Reg a = _mm512_maskz_shuffle_f32x4(kAll, u[x], u[x + 4], 0x88),
                b = _mm512_maskz_shuffle_f32x4(kAll, u[x + 8], u[x + 12], 0x88);
      const Reg c = _mm512_maskz_shuffle_f32x4(kAll, u[x], u[x + 4], 0xDD),
                d = _mm512_maskz_shuffle_f32x4(kAll, u[x + 8], u[x + 12], 0xDD);
      r[x] = _mm512_maskz_shuffle_f32x4(kAll, a, b, 0x88);
      r[x + 8] = _mm512_maskz_shuffle_f32x4(kAll, a, b, 0xDD);
      r[x + 4] = _mm512_maskz_shuffle_f32x4(kAll, c, d, 0x88);
      r[x + 12] = _mm512_maskz_shuffle_f32x4(kAll, c, d, 0xDD);
    }
  }
  // Lane t of the result is the sum of r[t]'s lanes (sixteen inner products finished at once): halves
  // folded onto halves in a tree, 30 shuffles and 15 adds, the inputs taken in the order that leaves the
  // sums in lane order. Each lane's sum runs in the same order whatever t.
  static Reg sum_lanes(const Reg (&r)[16]) noexcept {
    constexpr Mask kAll = 0xFFFF;
    const auto in = [&](int s) -> const Reg& { return r[4 * (s % 4) + s / 4]; };
    Reg t[8], u[4], v[2];
#pragma GCC unroll 16
    for (int i = 0; i < 8; ++i)  // 512 -> 256 bits per input: t[i] holds inputs 2i, 2i + 1
      t[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, in(2 * i), in(2 * i + 1), 0x44),
                           _mm512_maskz_shuffle_f32x4(kAll, in(2 * i), in(2 * i + 1), 0xEE));
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i)  // 256 -> 128: u[i] holds inputs 4i .. 4i + 3, one per 128-bit lane
      u[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, t[2 * i], t[2 * i + 1], 0x88),
                           _mm512_maskz_shuffle_f32x4(kAll, t[2 * i], t[2 * i + 1], 0xDD));
#pragma GCC unroll 16
    for (int i = 0; i < 2; ++i)  // 128 -> 64 inside each 128-bit lane
      v[i] = _mm512_add_ps(_mm512_maskz_shuffle_ps(kAll, u[2 * i], u[2 * i + 1], 0x44),
                           _mm512_maskz_shuffle_ps(kAll, u[2 * i], u[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_maskz_shuffle_ps(kAll, v[0], v[1], 0x88), _mm512_maskz_shuffle_ps(kAll, v[0], v[1], 0xDD));
  }
};

template <>
struct Vec<double> {
  using Scalar = double;
  using Reg = __m512d;
  using Mask = __mmask8;
  static constexpr Eigen::Index width = 8;
  static constexpr Eigen::Index kGemmRows = 6;
  static constexpr Eigen::Index kGemmVectors = 4;
  // The full tile's k loop in assembly (sdpa/simd/avx512_tile.hpp).
  static constexpr bool kHasTileKLoop = true;
  static constexpr Eigen::Index kTileMinDepth = 384;
  using TileLoopArgs = gemm::detail::TileLoopArgs;
  template <std::int64_t StepBytes>
  SDPA_ALWAYS_INLINE static void tile_k_loop(const TileLoopArgs& args, Reg (&acc)[6][4]) noexcept {
    gemm_tile_k_loop<double, StepBytes>(args, acc);
  }
  static void prefetch(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static void prefetch_l2(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
  static Reg zero() noexcept { return _mm512_setzero_pd(); }
  static Reg set1(double x) noexcept { return _mm512_set1_pd(x); }
  static Reg broadcast(const double* p) noexcept { return _mm512_set1_pd(*p); }
  static Reg load(const double* p) noexcept { return _mm512_load_pd(p); }
  static Reg loadu(const double* p) noexcept { return _mm512_loadu_pd(p); }
  static Reg loadu(const double* p, Mask m) noexcept { return _mm512_maskz_loadu_pd(m, p); }
  static void storeu(double* p, Reg x) noexcept { _mm512_storeu_pd(p, x); }
  static void storeu(double* p, Mask m, Reg x) noexcept { _mm512_mask_storeu_pd(p, m, x); }
  static Reg fmadd(Reg a, Reg b, Reg c) noexcept { return _mm512_fmadd_pd(a, b, c); }
  static Reg mul(Reg a, Reg b) noexcept { return _mm512_mul_pd(a, b); }
  static Reg add(Reg a, Reg b) noexcept { return _mm512_add_pd(a, b); }
  static Reg max(Reg a, Reg b) noexcept { return _mm512_max_pd(a, b); }
  static double reduce_add(Reg a) noexcept { return _mm512_reduce_add_pd(a); }
  static double reduce_max(Reg a) noexcept { return _mm512_reduce_max_pd(a); }
  static Mask mask(Eigen::Index n) noexcept { return static_cast<Mask>((1u << static_cast<unsigned>(n)) - 1u); }
  static Reg select(Mask m, Reg x, Reg fill) noexcept { return _mm512_mask_blend_pd(m, fill, x); }
  static void transpose(Reg (&r)[8]) noexcept {
    constexpr Mask kAll = 0xFF;
    Reg t[8], u[8];
#pragma GCC unroll 16
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm512_maskz_unpacklo_pd(kAll, r[i], r[i + 1]);
      t[i + 1] = _mm512_maskz_unpackhi_pd(kAll, r[i], r[i + 1]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm512_maskz_shuffle_f64x2(kAll, t[i], t[i + 2], 0x88);
      u[i + 1] = _mm512_maskz_shuffle_f64x2(kAll, t[i + 1], t[i + 3], 0x88);
      u[i + 2] = _mm512_maskz_shuffle_f64x2(kAll, t[i], t[i + 2], 0xDD);
      u[i + 3] = _mm512_maskz_shuffle_f64x2(kAll, t[i + 1], t[i + 3], 0xDD);
    }
#pragma GCC unroll 16
    for (int x = 0; x < 4; ++x) {
      r[x] = _mm512_maskz_shuffle_f64x2(kAll, u[x], u[x + 4], 0x88);
      r[x + 4] = _mm512_maskz_shuffle_f64x2(kAll, u[x], u[x + 4], 0xDD);
    }
  }
  // Lane t of the result is the sum of r[t]'s lanes (as Vec<float>::sum_lanes).
  static Reg sum_lanes(const Reg (&r)[8]) noexcept {
    constexpr Mask kAll = 0xFF;
    const auto in = [&](int s) -> const Reg& { return r[2 * (s % 4) + s / 4]; };
    Reg t[4], u[2];
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i)
      t[i] = _mm512_add_pd(_mm512_maskz_shuffle_f64x2(kAll, in(2 * i), in(2 * i + 1), 0x44),
                           _mm512_maskz_shuffle_f64x2(kAll, in(2 * i), in(2 * i + 1), 0xEE));
#pragma GCC unroll 16
    for (int i = 0; i < 2; ++i)
      u[i] = _mm512_add_pd(_mm512_maskz_shuffle_f64x2(kAll, t[2 * i], t[2 * i + 1], 0x88),
                           _mm512_maskz_shuffle_f64x2(kAll, t[2 * i], t[2 * i + 1], 0xDD));
    return _mm512_add_pd(_mm512_maskz_unpacklo_pd(kAll, u[0], u[1]), _mm512_maskz_unpackhi_pd(kAll, u[0], u[1]));
  }
};

// 16 lanes of 32-bit words, for Philox.
struct Words {
  using Reg = __m512i;
  static constexpr int width = 16;
  static Reg iota() noexcept { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static Reg set1(std::uint32_t x) noexcept { return _mm512_set1_epi32(static_cast<int>(x)); }
  static Reg add(Reg a, Reg b) noexcept { return _mm512_add_epi32(a, b); }
  static Reg bxor(Reg a, Reg b) noexcept { return _mm512_xor_si512(a, b); }
  static Reg mullo(Reg a, Reg b) noexcept { return _mm512_mullo_epi32(a, b); }
  // High 32 bits of the 32x32-bit products of each lane.
  static Reg mulhi(Reg a, Reg b) noexcept {
    const __m512i even = _mm512_srli_epi64(_mm512_mul_epu32(a, b), 32);
    const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), _mm512_srli_epi64(b, 32));
    return _mm512_mask_blend_epi32(0xAAAA, even, odd);
  }
  static void store(std::uint32_t* p, Reg x) noexcept { _mm512_storeu_si512(p, x); }
};

// x[j] = exp(x[j] - shift) for j < n, returning their sum; exactly 0 for arguments below -87.33 (the
// -inf of hidden keys included), NaN for NaN. exp(t) = 2^(k / 32) exp(r) with k the integer nearest
// t * 32 / ln 2 and |r| <= ln 2 / 64, 2^(k / 32) = 2^floor(k / 32) 2^((k mod 32) / 32) from a table of 32
// powers read by one vpermt2ps, and exp(r) by its series up to r^3 (the first term left out, r^4 / 24, is
// below 6e-10 of it): 13 vector operations, 8 of them on the multiply units, where Cephes' polynomial over
// |r| <= ln 2 / 2 (which Eigen uses) takes 15 and 11; at most 1.01 ulp from exp (tests/simd_test.cpp).
// kClamp false: for arguments known to be at most 88.8 (or NaN), without the clamp that keeps larger ones
// exact.
template <bool kClamp = true>
inline __m512 exp_shifted(__m512 v, __m512 shift, __mmask16 lanes) noexcept {
  // Arguments above 88.8 give +inf (exp overflows from 88.73); keeping them there keeps k exact below.
  // (vminps returns its second operand when either is NaN: a NaN argument stays NaN.)
  __m512 t = _mm512_sub_ps(v, shift);
  if constexpr (kClamp) t = _mm512_min_ps(_mm512_set1_ps(88.8f), t);
  // Zero below -87.33, where exp falls under FLT_MIN; -inf (masked) included, whose NaN from the
  // reduction below is dropped here. (The unmasked compare and an AND: at -O0 GCC's macro for the masked
  // compare trips -Wsign-conversion.)
  lanes = static_cast<__mmask16>(lanes & _mm512_cmp_ps_mask(t, _mm512_set1_ps(-87.33f), _CMP_NLT_UQ));
  // k in the low bits of 1.5 * 2^23 + k (|k| <= 4100 < 2^22), rounded to nearest by the fused add.
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 kk = _mm512_fmadd_ps(t, _mm512_set1_ps(46.1662413f), magic);
  // k / 32 from kk in one exact fused operation (kk / 32 - magic / 32; every term is a float).
  const __m512 k32 = _mm512_fmadd_ps(kk, _mm512_set1_ps(1.0f / 32), _mm512_set1_ps(-12582912.0f / 32));
  // r = t - (k / 32) ln 2 in two steps (Cephes' split of ln 2): k / 32 times the first part is exact.
  __m512 r = _mm512_fnmadd_ps(k32, _mm512_set1_ps(0.693359375f), t);
  r = _mm512_fnmadd_ps(k32, _mm512_set1_ps(-2.12194440e-4f), r);
  // 2^(i / 32) rounded to float; vpermt2ps reads the index from the low five bits of kk: k mod 32.
  const __m512 pow_lo = _mm512_setr_ps(1.0f, 1.0218972f, 1.04427373f, 1.06714046f, 1.09050775f, 1.1143868f,
                                       1.13878858f, 1.1637249f, 1.18920708f, 1.21524739f, 1.24185777f, 1.26905096f,
                                       1.29683959f, 1.32523668f, 1.35425556f, 1.38390994f);
  const __m512 pow_hi = _mm512_setr_ps(1.41421354f, 1.44518077f, 1.47682619f, 1.50916445f, 1.54221082f, 1.5759809f,
                                       1.61049032f, 1.64575553f, 1.68179286f, 1.71861935f, 1.75625217f, 1.79470909f,
                                       1.8340081f, 1.87416768f, 1.91520655f, 1.95714414f);
  const __m512 pow = _mm512_permutex2var_ps(pow_lo, _mm512_castps_si512(kk), pow_hi);
  // pow (1 + r (1 + r / 2 + r^2 / 6)), the last addition rounding once.
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 6), r, _mm512_set1_ps(0.5f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(pow, r), q, pow);
  // vscalefps multiplies by 2^floor of its second operand: 2^floor(k / 32).
  return _mm512_maskz_scalef_ps(lanes, y, k32);
}

// exp_shifted_sum, and with kBounded its bounded form (simd::exp_shifted_sum_below): the row is taken 32
// scores at a time (then 16), and the pass stops before the first group holding a score above `limit`,
// setting *done to where it stopped (n when it did not). Below the limit the arguments are at most
// limit - shift (a few units) and need no clamp, which pays for the check. (vmaxps keeps its second operand
// where either is NaN, so a score beside a NaN of the other half may pass the check; its row's sum is NaN
// whatever it gives.)
template <bool kBounded>
inline float exp_shifted_sum_of(float* x, Eigen::Index n, float shift, float limit, Eigen::Index* done) noexcept {
  const __m512 vshift = _mm512_set1_ps(shift), vlimit = _mm512_set1_ps(limit);
  // Two sums so that consecutive packets do not wait on one another's addition.
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  Eigen::Index j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + j), x1 = _mm512_loadu_ps(x + j + 16);
    if constexpr (kBounded) {
      if (_mm512_cmp_ps_mask(_mm512_max_ps(x0, x1), vlimit, _CMP_GT_OQ) != 0) {
        *done = j;
        return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
      }
    }
    const __m512 y0 = exp_shifted<!kBounded>(x0, vshift, __mmask16(0xFFFF));
    const __m512 y1 = exp_shifted<!kBounded>(x1, vshift, __mmask16(0xFFFF));
    _mm512_storeu_ps(x + j, y0);
    _mm512_storeu_ps(x + j + 16, y1);
    sum0 = _mm512_add_ps(sum0, y0);
    sum1 = _mm512_add_ps(sum1, y1);
  }
  for (; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(lanes, x + j);
    if constexpr (kBounded) {
      if (_mm512_mask_cmp_ps_mask(lanes, v, vlimit, _CMP_GT_OQ) != 0) {
        *done = j;
        return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
      }
    }
    const __m512 y = exp_shifted<!kBounded>(v, vshift, lanes);
    _mm512_mask_storeu_ps(x + j, lanes, y);
    sum0 = _mm512_add_ps(sum0, y);
  }
  if constexpr (kBounded) *done = n;
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

inline float exp_shifted_sum(float* x, Eigen::Index n, float shift) noexcept {
  return exp_shifted_sum_of<false>(x, n, shift, 0.0f, nullptr);
}

inline float exp_shifted_sum_below(float* x, Eigen::Index n, float shift, float limit, Eigen::Index* done) noexcept {
  return exp_shifted_sum_of<true>(x, n, shift, limit, done);
}

// x[j] = cap * tanh(x[j] / cap) for j < n (logit softcapping). tanh(y) = sign(y) (1 - e) / (1 + e) with
// e = exp(-2 |y|) in (0, 1], and for |y| < 1/4, where 1 - e would cancel, its odd series to y^11 (the next
// term is below 2e-10 of it). NaN stays NaN; +-inf gives +-cap.
inline void softcap_row(float* x, Eigen::Index n, float cap) noexcept {
  const __m512 inv = _mm512_set1_ps(1.0f / cap), c = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.0f);
  const __m512 zero = _mm512_setzero_ps(), minus_two = _mm512_set1_ps(-2.0f), quarter = _mm512_set1_ps(0.25f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (Eigen::Index j = 0; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + j), inv);
    const __m512i ybits = _mm512_castps_si512(y);
    const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, ybits));
    const __m512 e = exp_shifted(_mm512_mul_ps(minus_two, a), zero, __mmask16(0xFFFF));
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 a2 = _mm512_mul_ps(a, a);
    __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(-1382.0f / 155925.0f), a2, _mm512_set1_ps(62.0f / 2835.0f));
    q = _mm512_fmadd_ps(q, a2, _mm512_set1_ps(-17.0f / 315.0f));
    q = _mm512_fmadd_ps(q, a2, _mm512_set1_ps(2.0f / 15.0f));
    q = _mm512_fmadd_ps(q, a2, _mm512_set1_ps(-1.0f / 3.0f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(a, a2), q, a);
    const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, quarter, _CMP_LT_OQ), big, small);
    const __m512 signed_t = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(t), _mm512_and_si512(sign, ybits)));
    _mm512_mask_storeu_ps(x + j, lanes, _mm512_mul_ps(signed_t, c));
  }
}

// Whether the row kernels over stored (narrow) keys and values prefetch the rows they read next: yes since
// int8 keys take integer products here (a batch's step, whose cache leaves L2, waited on its rows).
constexpr bool kPrefetchStoredRows = true;

#include "sdpa/simd/generic_gemm.inc"
#include "sdpa/simd/generic_rows.inc"

}  // namespace avx512
SDPA_NAMESPACE_END

#include "sdpa/simd/target_end.hpp"

#endif  // SDPA_DISPATCH
