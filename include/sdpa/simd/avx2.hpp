// The AVX2 + FMA kernels (namespace sdpa::avx2), compiled in a target region whatever the translation
// unit's -march and run where sdpa/cpu.hpp finds AVX2, FMA and F16C: the vector traits below, the generic
// kernels of sdpa/simd/*.inc instantiated over them, and the softmax exponent.
//
// GEMM register tile: 6 rows x 2 ymm vectors (16 floats or 8 doubles), A values broadcast into a register
// (AVX2 has no broadcast operand). Six rows give 12 accumulators, more than the 8 chains two FMA pipes of
// latency 4 need (Zen 2/3/4, Haswell to Raptor Lake), and 12 + 2 B vectors + 1 broadcast fill 15 of the 16
// ymm registers. Loops over a fixed number of registers are unrolled by pragma, as in simd/avx512.hpp.
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
#include "sdpa/storage.hpp"

#include "sdpa/simd/target_avx2_begin.hpp"

SDPA_NAMESPACE_BEGIN
namespace avx2 {

#include "sdpa/simd/avx2_tile.hpp"

template <typename Scalar>
struct Vec;

template <>
struct Vec<float> {
  using Scalar = float;
  using Reg = __m256;
  using Mask = __m256i;
  static constexpr Eigen::Index width = 8;
  static constexpr Eigen::Index kGemmRows = 6;
  static constexpr Eigen::Index kGemmVectors = 2;
  // The full tile's k loop in assembly (sdpa/simd/avx2_tile.hpp), from kTileMinDepth steps.
  static constexpr bool kHasTileKLoop = true;
  static constexpr Eigen::Index kTileMinDepth = 1;
  using TileLoopArgs = gemm::detail::TileLoopArgs;
  template <std::int64_t StepBytes>
  SDPA_ALWAYS_INLINE static void tile_k_loop(const TileLoopArgs& args, Reg (&acc)[6][2]) noexcept {
    gemm_tile_k_loop<float, StepBytes>(args, acc);
  }
  static void prefetch(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static void prefetch_l2(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
  static Reg zero() noexcept { return _mm256_setzero_ps(); }
  static Reg set1(float x) noexcept { return _mm256_set1_ps(x); }
  static Reg broadcast(const float* p) noexcept { return _mm256_broadcast_ss(p); }
  static Reg load(const float* p) noexcept { return _mm256_load_ps(p); }
  static Reg loadu(const float* p) noexcept { return _mm256_loadu_ps(p); }
  static Reg loadu(const float* p, Mask m) noexcept { return _mm256_maskload_ps(p, m); }
  static void storeu(float* p, Reg x) noexcept { _mm256_storeu_ps(p, x); }
  static void storeu(float* p, Mask m, Reg x) noexcept { _mm256_maskstore_ps(p, m, x); }
  // `width` stored elements widened to float (sdpa/storage.hpp), exactly (float16 through F16C).
  static Reg widen(const BFloat16* p) noexcept {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Reg widen(const Float16* p) noexcept { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // As Vec<float> of avx512.hpp: lane l of `even` / `odd` is bfloat16 value 2l / 2l + 1 of the 16 at p.
  static void widen_pairs(const BFloat16* p, Reg& even, Reg& odd) noexcept {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void deinterleave(Reg a, Reg b, Reg& even, Reg& odd) noexcept {
    // shuffle_ps works within 128-bit halves: [a0 a2 b0 b2 | a4 a6 b4 b6], then the 64-bit quarters reordered.
    even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
  }
  static void interleave(Reg even, Reg odd, Reg& a, Reg& b) noexcept {
    const Reg lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);  // [e0 o0 e1 o1 | e4 o4 e5 o5]
    a = _mm256_permute2f128_ps(lo, hi, 0x20);
    b = _mm256_permute2f128_ps(lo, hi, 0x31);
  }
  static Reg widen(const std::int8_t* p) noexcept {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // Integer products of int8 keys with int16 queries (generic_int8.inc's int8_chunk_scores): lane l of
  // int8_products is k[2l] q[2l] + k[2l + 1] q[2l + 1] over kInt8Step features (sign extension, vpmaddwd),
  // exact, as are the sums below while they stay under 2^31 (storage.hpp's kInt16QueryMaxLength).
  static constexpr bool kInt8Products = true;
  static constexpr Eigen::Index kInt8Step = 16;
  using IReg = __m256i;
  static IReg izero() noexcept { return _mm256_setzero_si256(); }
  static IReg iadd(IReg a, IReg b) noexcept { return _mm256_add_epi32(a, b); }
  static IReg iloadu(const std::int32_t* p) noexcept { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static IReg int8_products(const std::int8_t* k, const std::int16_t* q) noexcept {
    const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k)));
    return _mm256_madd_epi16(wide, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  }
  static IReg int8_accumulate(IReg acc, const std::int8_t* k, const std::int16_t* q) noexcept {
    return iadd(acc, int8_products(k, q));
  }
  // Lane t of the result is the sum of r[t]'s lanes: 128-bit halves folded, then 32- and 64-bit pairs.
  static IReg sum_lanes(const IReg (&r)[8]) noexcept {
    IReg t[4], v[2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)  // lanes 0-3: r[i]'s halves added; lanes 4-7: r[i + 4]'s
      t[i] = _mm256_add_epi32(_mm256_permute2x128_si256(r[i], r[i + 4], 0x20), _mm256_permute2x128_si256(r[i], r[i + 4], 0x31));
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i)  // per half: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of t[2i] = a, t[2i + 1] = b
      v[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(t[2 * i], t[2 * i + 1]), _mm256_unpackhi_epi32(t[2 * i], t[2 * i + 1]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(v[0], v[1]), _mm256_unpackhi_epi64(v[0], v[1]));
  }
  static Reg to_float(IReg x) noexcept { return _mm256_cvtepi32_ps(x); }
  // Lane t is p[t * stride] (lane by lane: a vector load of scalars just stored would wait for them).
  static Reg strided(const float* p, Eigen::Index stride) noexcept {
    return _mm256_setr_ps(p[0], p[stride], p[2 * stride], p[3 * stride], p[4 * stride], p[5 * stride], p[6 * stride], p[7 * stride]);
  }
  // A query of n floats (0 < n <= kInt16QueryMaxLength) rounded to int16 for int8_products: q[i] = x[i] *
  // (32767 / a) rounded to nearest, ties to even, in double (so |q[i]| <= 32767), a = max |x|; factor =
  // a / 32767 (double), so x[i] ~ factor * q[i] within factor / 2. An all-zero query gives q = 0 and factor
  // 0. Returns false, writing nothing, when a value is not finite.
  static bool quantize_query(const float* x, Eigen::Index n, std::int16_t* q, double& factor) noexcept {
    const auto part = [&](Eigen::Index i) SDPA_ALWAYS_INLINE_LAMBDA {
      return i + width <= n ? loadu(x + i) : loadu(x + i, mask(n - i));  // the lanes past n read as 0
    };
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (Eigen::Index i = 0; i < n; i += width) {
      const __m256 v = part(i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
      nan = _mm256_add_ps(nan, _mm256_sub_ps(v, v));  // v - v: 0, or NaN where v is not finite
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(nan, nan, _CMP_UNORD_Q)) != 0) return false;
    const float a = reduce_max(amax);
    if (a == 0.0f) {
      std::fill_n(q, n, std::int16_t{0});
      factor = 0.0;
      return true;
    }
    const __m256d scale = _mm256_set1_pd(32767.0 / static_cast<double>(a));
    const __m256d hi = _mm256_set1_pd(32767.0), lo = _mm256_set1_pd(-32767.0);
    const auto round = [&](__m128 v) SDPA_ALWAYS_INLINE_LAMBDA {
      const __m256d r = _mm256_round_pd(_mm256_mul_pd(_mm256_cvtps_pd(v), scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm256_cvtpd_epi32(_mm256_min_pd(hi, _mm256_max_pd(lo, r)));
    };
    for (Eigen::Index i = 0; i < n; i += width) {
      const __m256 v = part(i);
      const __m128i words = _mm_packs_epi32(round(_mm256_castps256_ps128(v)), round(_mm256_extractf128_ps(v, 1)));
      if (i + width <= n) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), words);
      } else {
        alignas(16) std::int16_t last[width];
        _mm_store_si128(reinterpret_cast<__m128i*>(last), words);
        std::copy_n(last, n - i, q + i);
      }
    }
    factor = static_cast<double>(a) / 32767.0;
    return true;
  }
  static Reg fmadd(Reg a, Reg b, Reg c) noexcept { return _mm256_fmadd_ps(a, b, c); }
  static Reg mul(Reg a, Reg b) noexcept { return _mm256_mul_ps(a, b); }
  static Reg add(Reg a, Reg b) noexcept { return _mm256_add_ps(a, b); }
  static Reg max(Reg a, Reg b) noexcept { return _mm256_max_ps(a, b); }
  static float reduce_add(Reg a) noexcept {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(Reg a) noexcept {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Lanes below n, n in [0, width].
  static Mask mask(Eigen::Index n) noexcept {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Reg select(Mask m, Reg x, Reg fill) noexcept { return _mm256_blendv_ps(fill, x, _mm256_castsi256_ps(m)); }
  // r[i][j] becomes r[j][i]: 4 x 4 blocks inside 128-bit lanes, then the lanes.
  static void transpose(Reg (&r)[8]) noexcept {
    Reg t[8], u[8];
#pragma GCC unroll 16
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
#pragma GCC unroll 16
    for (int x = 0; x < 4; ++x) {
      r[x] = _mm256_permute2f128_ps(u[x], u[x + 4], 0x20);
      r[x + 4] = _mm256_permute2f128_ps(u[x], u[x + 4], 0x31);
    }
  }
  // Lane t of the result is the sum of r[t]'s lanes (eight inner products finished at once): halves folded
  // onto halves in a tree, the inputs taken in the order that leaves the sums in lane order.
  static Reg sum_lanes(const Reg (&r)[8]) noexcept {
    const auto in = [&](int s) -> const Reg& { return r[4 * (s % 2) + s / 2]; };
    Reg t[4], v[2];
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i)
      t[i] = _mm256_add_ps(_mm256_permute2f128_ps(in(2 * i), in(2 * i + 1), 0x20),
                           _mm256_permute2f128_ps(in(2 * i), in(2 * i + 1), 0x31));
#pragma GCC unroll 16
    for (int i = 0; i < 2; ++i)
      v[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(v[0], v[1], 0x88), _mm256_shuffle_ps(v[0], v[1], 0xDD));
  }
};

template <>
struct Vec<double> {
  using Scalar = double;
  using Reg = __m256d;
  using Mask = __m256i;
  static constexpr Eigen::Index width = 4;
  static constexpr Eigen::Index kGemmRows = 6;
  static constexpr Eigen::Index kGemmVectors = 2;
  // The full tile's k loop in assembly (sdpa/simd/avx2_tile.hpp), from kTileMinDepth steps.
  static constexpr bool kHasTileKLoop = true;
  static constexpr Eigen::Index kTileMinDepth = 1;
  using TileLoopArgs = gemm::detail::TileLoopArgs;
  template <std::int64_t StepBytes>
  SDPA_ALWAYS_INLINE static void tile_k_loop(const TileLoopArgs& args, Reg (&acc)[6][2]) noexcept {
    gemm_tile_k_loop<double, StepBytes>(args, acc);
  }
  static void prefetch(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static void prefetch_l2(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
  static Reg zero() noexcept { return _mm256_setzero_pd(); }
  static Reg set1(double x) noexcept { return _mm256_set1_pd(x); }
  static Reg broadcast(const double* p) noexcept { return _mm256_broadcast_sd(p); }
  static Reg load(const double* p) noexcept { return _mm256_load_pd(p); }
  static Reg loadu(const double* p) noexcept { return _mm256_loadu_pd(p); }
  static Reg loadu(const double* p, Mask m) noexcept { return _mm256_maskload_pd(p, m); }
  static void storeu(double* p, Reg x) noexcept { _mm256_storeu_pd(p, x); }
  static void storeu(double* p, Mask m, Reg x) noexcept { _mm256_maskstore_pd(p, m, x); }
  static Reg fmadd(Reg a, Reg b, Reg c) noexcept { return _mm256_fmadd_pd(a, b, c); }
  static Reg mul(Reg a, Reg b) noexcept { return _mm256_mul_pd(a, b); }
  static Reg add(Reg a, Reg b) noexcept { return _mm256_add_pd(a, b); }
  static Reg max(Reg a, Reg b) noexcept { return _mm256_max_pd(a, b); }
  static double reduce_add(Reg a) noexcept {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
  }
  static double reduce_max(Reg a) noexcept {
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    s = _mm_max_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
  }
  static Mask mask(Eigen::Index n) noexcept {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(static_cast<long long>(n)), _mm256_setr_epi64x(0, 1, 2, 3));
  }
  static Reg select(Mask m, Reg x, Reg fill) noexcept { return _mm256_blendv_pd(fill, x, _mm256_castsi256_pd(m)); }
  static void transpose(Reg (&r)[4]) noexcept {
    const Reg t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
    const Reg t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
    r[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
    r[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
    r[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
    r[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
  }
  // Lane t of the result is the sum of r[t]'s lanes (as Vec<float>::sum_lanes).
  static Reg sum_lanes(const Reg (&r)[4]) noexcept {
    const Reg t0 = _mm256_add_pd(_mm256_permute2f128_pd(r[0], r[2], 0x20), _mm256_permute2f128_pd(r[0], r[2], 0x31));
    const Reg t1 = _mm256_add_pd(_mm256_permute2f128_pd(r[1], r[3], 0x20), _mm256_permute2f128_pd(r[1], r[3], 0x31));
    return _mm256_add_pd(_mm256_unpacklo_pd(t0, t1), _mm256_unpackhi_pd(t0, t1));
  }
};

// 8 lanes of 32-bit words, for Philox.
struct Words {
  using Reg = __m256i;
  static constexpr int width = 8;
  static Reg iota() noexcept { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static Reg set1(std::uint32_t x) noexcept { return _mm256_set1_epi32(static_cast<int>(x)); }
  static Reg add(Reg a, Reg b) noexcept { return _mm256_add_epi32(a, b); }
  static Reg bxor(Reg a, Reg b) noexcept { return _mm256_xor_si256(a, b); }
  static Reg mullo(Reg a, Reg b) noexcept { return _mm256_mullo_epi32(a, b); }
  static Reg mulhi(Reg a, Reg b) noexcept {
    const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(a, b), 32);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), _mm256_srli_epi64(b, 32));
    return _mm256_blend_epi32(even, odd, 0xAA);
  }
  static void store(std::uint32_t* p, Reg x) noexcept { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
};

// exp(v - shift) in 8 lanes: exactly 0 below -87.33 (the -inf of hidden keys included), +inf above 88.72,
// NaN for NaN. exp(t) = 2^(k / 8) exp(r) with k the integer nearest t * 8 / ln 2 and |r| <= ln 2 / 16:
// 2^(k / 8) = 2^floor(k / 8) 2^((k mod 8) / 8), the second from a table of 8 powers read by one vpermps
// (AVX2 has no two-table permute for AVX-512's 32 entries), exp(r) by its series up to r^4 (the first term
// left out, r^5 / 120, is below 1.3e-9 of it), and the power of two built in the exponent field in two
// halves (2^floor(k / 8) reaches 2^128, past float's largest exponent, where the product overflows to inf
// as exp does); at most 2 ulp from exp (tests/simd_test.cpp).
// kClamp false: for arguments known to be at most 88.8 (or NaN), without the clamp that keeps larger ones
// in the exponent field's range.
template <bool kClamp = true>
inline __m256 exp_shifted(__m256 v, __m256 shift) noexcept {
  // (vminps returns its second operand when either is NaN: a NaN argument stays NaN.)
  __m256 t = _mm256_sub_ps(v, shift);
  if constexpr (kClamp) t = _mm256_min_ps(_mm256_set1_ps(88.8f), t);
  const __m256 keep = _mm256_cmp_ps(t, _mm256_set1_ps(-87.33f), _CMP_NLT_UQ);
  // k in the low bits of 1.5 * 2^23 + k (|k| <= 1025 < 2^22), rounded to nearest by the fused add; the
  // magic number is a multiple of 8, so its bits' low three are k mod 8 (vpermps reads no more).
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 kk = _mm256_fmadd_ps(t, _mm256_set1_ps(11.5415602f), magic);
  const __m256 k = _mm256_sub_ps(kk, magic);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f / 8), t);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f / 8), r);
  const __m256 table = _mm256_setr_ps(1.0f, 1.09050775f, 1.18920708f, 1.29683959f, 1.41421354f, 1.54221082f,
                                      1.68179286f, 1.8340081f);
  const __m256i kbits = _mm256_castps_si256(kk);
  const __m256 pow = _mm256_permutevar8x32_ps(table, kbits);
  __m256 q = _mm256_fmadd_ps(_mm256_set1_ps(1.0f / 24), r, _mm256_set1_ps(1.0f / 6));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.5f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f));
  const __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(pow, r), q, pow);
  // n = floor(k / 8) in [-126, 128] for the lanes kept, as n1 + n2 with both in [-63, 64].
  const __m256i n = _mm256_srai_epi32(_mm256_sub_epi32(kbits, _mm256_castps_si256(magic)), 3);
  const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_and_ps(keep, _mm256_mul_ps(_mm256_mul_ps(y, s1), s2));
}

// exp_shifted_sum, and with kBounded its bounded form (as sdpa::avx512::exp_shifted_sum_of, 16 scores at a
// time, then 8).
template <bool kBounded>
inline float exp_shifted_sum_of(float* x, Eigen::Index n, float shift, float limit, Eigen::Index* done) noexcept {
  const __m256 vshift = _mm256_set1_ps(shift), vlimit = _mm256_set1_ps(limit);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  Eigen::Index j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
    if constexpr (kBounded) {
      if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_max_ps(x0, x1), vlimit, _CMP_GT_OQ)) != 0) {
        *done = j;
        return Vec<float>::reduce_add(_mm256_add_ps(sum0, sum1));
      }
    }
    const __m256 y0 = exp_shifted<!kBounded>(x0, vshift);
    const __m256 y1 = exp_shifted<!kBounded>(x1, vshift);
    _mm256_storeu_ps(x + j, y0);
    _mm256_storeu_ps(x + j + 8, y1);
    sum0 = _mm256_add_ps(sum0, y0);
    sum1 = _mm256_add_ps(sum1, y1);
  }
  for (; j < n; j += 8) {
    const __m256i m = Vec<float>::mask(std::min<Eigen::Index>(8, n - j));
    // Lanes past n read as 0 and give exp(-shift), which the mask removes from the check, the sum and the
    // store.
    const __m256 v = _mm256_maskload_ps(x + j, m);
    if constexpr (kBounded) {
      if (_mm256_movemask_ps(_mm256_and_ps(_mm256_castsi256_ps(m), _mm256_cmp_ps(v, vlimit, _CMP_GT_OQ))) != 0) {
        *done = j;
        return Vec<float>::reduce_add(_mm256_add_ps(sum0, sum1));
      }
    }
    const __m256 y = _mm256_and_ps(_mm256_castsi256_ps(m), exp_shifted<!kBounded>(v, vshift));
    _mm256_maskstore_ps(x + j, m, y);
    sum0 = _mm256_add_ps(sum0, y);
  }
  if constexpr (kBounded) *done = n;
  return Vec<float>::reduce_add(_mm256_add_ps(sum0, sum1));
}

inline float exp_shifted_sum(float* x, Eigen::Index n, float shift) noexcept {
  return exp_shifted_sum_of<false>(x, n, shift, 0.0f, nullptr);
}

inline float exp_shifted_sum_below(float* x, Eigen::Index n, float shift, float limit, Eigen::Index* done) noexcept {
  return exp_shifted_sum_of<true>(x, n, shift, limit, done);
}

// x[j] = cap * tanh(x[j] / cap) for j < n (logit softcapping), as sdpa::avx512::softcap_row computes it.
inline void softcap_row(float* x, Eigen::Index n, float cap) noexcept {
  const __m256 inv = _mm256_set1_ps(1.0f / cap), c = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f);
  const __m256 zero = _mm256_setzero_ps(), minus_two = _mm256_set1_ps(-2.0f), quarter = _mm256_set1_ps(0.25f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  for (Eigen::Index j = 0; j < n; j += 8) {
    const __m256i m = Vec<float>::mask(std::min<Eigen::Index>(8, n - j));
    const __m256 y = _mm256_mul_ps(_mm256_maskload_ps(x + j, m), inv);
    const __m256 a = _mm256_andnot_ps(sign, y);
    const __m256 e = exp_shifted(_mm256_mul_ps(minus_two, a), zero);
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 a2 = _mm256_mul_ps(a, a);
    __m256 q = _mm256_fmadd_ps(_mm256_set1_ps(-1382.0f / 155925.0f), a2, _mm256_set1_ps(62.0f / 2835.0f));
    q = _mm256_fmadd_ps(q, a2, _mm256_set1_ps(-17.0f / 315.0f));
    q = _mm256_fmadd_ps(q, a2, _mm256_set1_ps(2.0f / 15.0f));
    q = _mm256_fmadd_ps(q, a2, _mm256_set1_ps(-1.0f / 3.0f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(a, a2), q, a);
    const __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, quarter, _CMP_LT_OQ));
    const __m256 signed_t = _mm256_xor_ps(t, _mm256_and_ps(sign, y));
    _mm256_maskstore_ps(x + j, m, _mm256_mul_ps(signed_t, c));
  }
}

// Whether the row kernels over stored (narrow) keys and values prefetch the rows they read next: without
// it, the narrow kernels' arithmetic and memory time added up where measured (bench/RESULTS.md).
constexpr bool kPrefetchStoredRows = true;

#include "sdpa/simd/generic_gemm.inc"
#include "sdpa/simd/generic_rows.inc"

}  // namespace avx2
SDPA_NAMESPACE_END

#include "sdpa/simd/target_end.hpp"

#endif  // SDPA_DISPATCH
