// AVX-512 micro-kernels: one register tile of C, Rows x 32 floats or Rows x 16 doubles (two zmm vectors
// per row), accumulated over one k block of packed A (12 values per k step, broadcast from memory) and
// packed B (two aligned vector loads per k step), then stored through the epilogue. Twelve rows give 24
// accumulators: with two FMA pipes of latency 4 at least 8 independent chains are needed, and 24 leaves
// the loads and broadcasts room between them, while 24 + 2 B vectors stay within the 32 zmm registers.
// The k loop reads 2 vectors and 12 scalars per 24 FMAs; the 12 x kc A sliver stays in L1 while B
// slivers stream from L2 (blocking.hpp sizes kc and nc for that).
#pragma once

#include "sdpa/gemm/isa.hpp"

#if defined(SDPA_GEMM_ISA_AVX512)

#include "sdpa/detail/intrinsics.hpp"

#include "sdpa/detail/eigen.hpp"

#include <cstddef>

#include "sdpa/gemm/epilogue.hpp"
#include "sdpa/gemm/pack.hpp"

namespace sdpa {
namespace gemm {
inline namespace SDPA_GEMM_ABI_NAMESPACE {
namespace detail {

template <typename Scalar>
struct Avx512Vec;

template <>
struct Avx512Vec<float> {
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr Eigen::Index width = 16;
  static void prefetch(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static void prefetch_l2(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
  static Reg zero() noexcept { return _mm512_setzero_ps(); }
  static Reg set1(float x) noexcept { return _mm512_set1_ps(x); }
  static Reg load(const float* p) noexcept { return _mm512_load_ps(p); }
  static Reg loadu(const float* p) noexcept { return _mm512_loadu_ps(p); }
  static Reg loadu(const float* p, Mask m) noexcept { return _mm512_maskz_loadu_ps(m, p); }
  static void storeu(float* p, Reg x) noexcept { _mm512_storeu_ps(p, x); }
  static void storeu(float* p, Mask m, Reg x) noexcept { _mm512_mask_storeu_ps(p, m, x); }
  static Reg fmadd(Reg a, Reg b, Reg c) noexcept { return _mm512_fmadd_ps(a, b, c); }
  static Reg mul(Reg a, Reg b) noexcept { return _mm512_mul_ps(a, b); }
  static Reg add(Reg a, Reg b) noexcept { return _mm512_add_ps(a, b); }
  // The first n lanes, n in [0, width].
  static Mask mask(Eigen::Index n) noexcept { return static_cast<Mask>((1u << static_cast<unsigned>(n)) - 1u); }
  // r[i][j] becomes r[j][i]: 4 x 4 blocks inside 128-bit lanes, then the lanes. The zero-masking forms
  // with a full mask are the same instructions; the plain forms pass GCC 12 an undefined vector that its
  // -Wmaybe-uninitialized reports inside avx512fintrin.h.
  static void transpose(Reg (&r)[16]) noexcept {
    constexpr Mask kAll = 0xFFFF;
    Reg t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_maskz_unpacklo_ps(kAll, r[i], r[i + 1]);
      t[i + 1] = _mm512_maskz_unpackhi_ps(kAll, r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      u[i] = _mm512_maskz_shuffle_ps(kAll, t[i], t[i + 2], 0x44);
      u[i + 1] = _mm512_maskz_shuffle_ps(kAll, t[i], t[i + 2], 0xEE);
      u[i + 2] = _mm512_maskz_shuffle_ps(kAll, t[i + 1], t[i + 3], 0x44);
      u[i + 3] = _mm512_maskz_shuffle_ps(kAll, t[i + 1], t[i + 3], 0xEE);
    }
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
};

template <>
struct Avx512Vec<double> {
  using Reg = __m512d;
  using Mask = __mmask8;
  static constexpr Eigen::Index width = 8;
  static void prefetch(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static void prefetch_l2(const void* p) noexcept { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
  static Reg zero() noexcept { return _mm512_setzero_pd(); }
  static Reg set1(double x) noexcept { return _mm512_set1_pd(x); }
  static Reg load(const double* p) noexcept { return _mm512_load_pd(p); }
  static Reg loadu(const double* p) noexcept { return _mm512_loadu_pd(p); }
  static Reg loadu(const double* p, Mask m) noexcept { return _mm512_maskz_loadu_pd(m, p); }
  static void storeu(double* p, Reg x) noexcept { _mm512_storeu_pd(p, x); }
  static void storeu(double* p, Mask m, Reg x) noexcept { _mm512_mask_storeu_pd(p, m, x); }
  static Reg fmadd(Reg a, Reg b, Reg c) noexcept { return _mm512_fmadd_pd(a, b, c); }
  static Reg mul(Reg a, Reg b) noexcept { return _mm512_mul_pd(a, b); }
  static Reg add(Reg a, Reg b) noexcept { return _mm512_add_pd(a, b); }
  static Mask mask(Eigen::Index n) noexcept { return static_cast<Mask>((1u << static_cast<unsigned>(n)) - 1u); }
  static void transpose(Reg (&r)[8]) noexcept {
    constexpr Mask kAll = 0xFF;
    Reg t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm512_maskz_unpacklo_pd(kAll, r[i], r[i + 1]);
      t[i + 1] = _mm512_maskz_unpackhi_pd(kAll, r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm512_maskz_shuffle_f64x2(kAll, t[i], t[i + 2], 0x88);
      u[i + 1] = _mm512_maskz_shuffle_f64x2(kAll, t[i + 1], t[i + 3], 0x88);
      u[i + 2] = _mm512_maskz_shuffle_f64x2(kAll, t[i], t[i + 2], 0xDD);
      u[i + 3] = _mm512_maskz_shuffle_f64x2(kAll, t[i + 1], t[i + 3], 0xDD);
    }
    for (int x = 0; x < 4; ++x) {
      r[x] = _mm512_maskz_shuffle_f64x2(kAll, u[x], u[x + 4], 0x88);
      r[x + 4] = _mm512_maskz_shuffle_f64x2(kAll, u[x], u[x + 4], 0xDD);
    }
  }
};

template <typename Scalar>
struct Avx512Kernel {
  using Index = Eigen::Index;
  using V = Avx512Vec<Scalar>;
  using Reg = typename V::Reg;
  static constexpr Index vectors = 2;
  static constexpr Index mr = 12;
  static constexpr Index nr = vectors * V::width;

  template <Index W>
  static void pack_rows(Index count, Index depth, const Scalar* src, Index ld, Scalar* dst) noexcept {
    pack_rows_simd<W, V>(count, depth, src, ld, dst);
  }
  template <Index W>
  static void pack_cols(Index count, Index depth, const Scalar* src, Index ld, Scalar* dst) noexcept {
    pack_cols_simd<W, V>(count, depth, src, ld, dst);
  }

  // C[0:Rows, 0:cols] (leading dimension ldc) from kc steps of packed A (mr values per step, rows past
  // Rows are padding) and packed B (nr values per step, zero past cols). Columns past cols are computed
  // and dropped: masked stores, so that a ragged right edge costs no separate code path. next_a names
  // the lines of A that the next row of tiles will read.
  template <int Rows, typename ASource, typename Prefetch>
  static void tile(Index kc, ASource a, const Scalar* b, Scalar* c, Index ldc, Index cols, const Epilogue<Scalar>& ep,
                   Prefetch next_a) noexcept {
    Reg acc[static_cast<std::size_t>(Rows)][static_cast<std::size_t>(vectors)];
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < vectors; ++v) acc[r][v] = V::zero();
    }
    // The tile's rows of C, which a projection finds in L3 or memory: fetched now, they are in L1 when
    // the k loop ends (4% on fc_o, whose 8 k blocks each read and write C).
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      V::prefetch(c + r * ldc);
      V::prefetch(c + r * ldc + cols - 1);
    }
    for (Index p = 0; p < kc; ++p) {
      Reg bv[static_cast<std::size_t>(vectors)];
#pragma GCC unroll 4
      for (int v = 0; v < vectors; ++v) bv[v] = V::load(b + v * V::width);
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const Reg ar = V::set1(*a.ptr(r));
#pragma GCC unroll 4
        for (int v = 0; v < vectors; ++v) acc[r][v] = V::fmadd(ar, bv[v], acc[r][v]);
      }
      // The next A sliver comes from L3 or memory, and the hardware prefetcher does not fetch it early
      // enough: brought to L2 during this tile, it saves 7% of a projection (AVX-512).
      if (const void* line = next_a.next()) V::prefetch_l2(line);
      a.step();
      b += nr;
    }
    store<Rows>(acc, c, ldc, cols, ep);
  }

  template <int Rows>
  SDPA_GEMM_ALWAYS_INLINE static void store(Reg (&acc)[static_cast<std::size_t>(Rows)][static_cast<std::size_t>(vectors)], Scalar* c, Index ldc,
                    Index cols, const Epilogue<Scalar>& ep) noexcept {
    const Reg alpha = V::set1(ep.alpha);
    const Reg beta = V::set1(ep.beta);
    const bool read_c = !ep.first || ep.beta != Scalar(0);
    const bool bias = ep.first && ep.bias != nullptr;
    // One rule for full and masked vectors, so that an element's value does not depend on the tile it is in.
    auto combine = [&](Reg x, Reg cv, Reg bv) noexcept {
      if (!ep.first) return V::fmadd(alpha, x, cv);
      x = V::mul(alpha, x);
      if (ep.beta != Scalar(0)) x = V::fmadd(beta, cv, x);
      if (bias) x = V::add(x, bv);
      return x;
    };
    if (cols == nr) {
      Reg bv[static_cast<std::size_t>(vectors)];
#pragma GCC unroll 4
      for (int v = 0; v < vectors; ++v) bv[v] = bias ? V::loadu(ep.bias + v * V::width) : V::zero();
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        Scalar* cr = c + r * ldc;
#pragma GCC unroll 4
        for (int v = 0; v < vectors; ++v) {
          const Reg cv = read_c ? V::loadu(cr + v * V::width) : V::zero();
          V::storeu(cr + v * V::width, combine(acc[r][v], cv, bv[v]));
        }
      }
      return;
    }
    typename V::Mask m[static_cast<std::size_t>(vectors)];
    Reg bv[static_cast<std::size_t>(vectors)];
#pragma GCC unroll 4
    for (int v = 0; v < vectors; ++v) {
      const Index lanes = cols - v * V::width;
      m[v] = V::mask(lanes <= 0 ? 0 : lanes >= V::width ? V::width : lanes);
      bv[v] = bias ? V::loadu(ep.bias + v * V::width, m[v]) : V::zero();
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      Scalar* cr = c + r * ldc;
#pragma GCC unroll 4
      for (int v = 0; v < vectors; ++v) {
        const Reg cv = read_c ? V::loadu(cr + v * V::width, m[v]) : V::zero();
        V::storeu(cr + v * V::width, m[v], combine(acc[r][v], cv, bv[v]));
      }
    }
  }
};

}  // namespace detail
}  // namespace SDPA_GEMM_ABI_NAMESPACE
}  // namespace gemm
}  // namespace sdpa

#endif  // SDPA_GEMM_ISA_AVX512
