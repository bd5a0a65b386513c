// AVX2 + FMA micro-kernels: one register tile of C, Rows x 16 floats or Rows x 8 doubles (two ymm vectors
// per row), accumulated over one k block of packed A (6 values per k step, each broadcast into a register:
// AVX2 has no broadcast operand) and packed B (two aligned loads per k step), then stored through the
// epilogue. Six rows give 12 accumulators, more than the 8 chains two FMA pipes of latency 4 need, and
// 12 + 2 B vectors + 1 broadcast fill 15 of the 16 ymm registers. A ragged right edge uses maskload and
// maskstore with the same arithmetic as full vectors.
#pragma once

#include "sdpa/gemm/isa.hpp"

#if defined(SDPA_GEMM_ISA_AVX2)

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
struct Avx2Vec;

template <>
struct Avx2Vec<float> {
  using Reg = __m256;
  using Mask = __m256i;
  static constexpr Eigen::Index width = 8;
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
  static Reg fmadd(Reg a, Reg b, Reg c) noexcept { return _mm256_fmadd_ps(a, b, c); }
  static Reg mul(Reg a, Reg b) noexcept { return _mm256_mul_ps(a, b); }
  static Reg add(Reg a, Reg b) noexcept { return _mm256_add_ps(a, b); }
  // Lanes below n, n in [0, width].
  static Mask mask(Eigen::Index n) noexcept {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // r[i][j] becomes r[j][i]: 4 x 4 blocks inside 128-bit lanes, then the lanes.
  static void transpose(Reg (&r)[8]) noexcept {
    Reg t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int x = 0; x < 4; ++x) {
      r[x] = _mm256_permute2f128_ps(u[x], u[x + 4], 0x20);
      r[x + 4] = _mm256_permute2f128_ps(u[x], u[x + 4], 0x31);
    }
  }
};

template <>
struct Avx2Vec<double> {
  using Reg = __m256d;
  using Mask = __m256i;
  static constexpr Eigen::Index width = 4;
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
  static Mask mask(Eigen::Index n) noexcept {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(static_cast<long long>(n)), _mm256_setr_epi64x(0, 1, 2, 3));
  }
  static void transpose(Reg (&r)[4]) noexcept {
    const Reg t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
    const Reg t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
    r[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
    r[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
    r[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
    r[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
  }
};

template <typename Scalar>
struct Avx2Kernel {
  using Index = Eigen::Index;
  using V = Avx2Vec<Scalar>;
  using Reg = typename V::Reg;
  static constexpr Index vectors = 2;
  static constexpr Index mr = 6;
  static constexpr Index nr = vectors * V::width;

  template <Index W>
  static void pack_rows(Index count, Index depth, const Scalar* src, Index ld, Scalar* dst) noexcept {
    pack_rows_simd<W, V>(count, depth, src, ld, dst);
  }
  template <Index W>
  static void pack_cols(Index count, Index depth, const Scalar* src, Index ld, Scalar* dst) noexcept {
    pack_cols_simd<W, V>(count, depth, src, ld, dst);
  }

  // C[0:Rows, 0:cols] (leading dimension ldc) from kc steps of packed A (mr values per step) and packed B
  // (nr values per step, zero past cols); columns past cols are computed and not stored. next_a names
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
        const Reg ar = V::broadcast(a.ptr(r));
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

#endif  // SDPA_GEMM_ISA_AVX2
