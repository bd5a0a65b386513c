// Packing of A and B into the layout the micro-kernels read: an operand is cut into slivers of W rows of
// the micro-tile's broadcast side (W = mr, from A) or W columns of its vector side (W = nr, from B), and
// each sliver is stored k step by k step, W contiguous values per step, zero-padded past the operand's
// edge. A micro-kernel then reads both operands with unit stride and aligned loads, and padded rows and
// columns only produce values that are never stored.
//   pack_rows: the sliver's W lines are rows of a row-major source src[count, depth] (A; B of gemm_nt,
//              given as b[n, k]): a transpose. The vector version transposes width x width register
//              blocks (16 x 16 floats with AVX-512): a scalar transpose took 6% of a projection's time.
//   pack_cols: the sliver's W lines are columns of src[depth, count] (B of gemm_nn, given as b[k, n]):
//              W contiguous values copied per step.
// The vector versions take the ISA's vector traits V (microkernel_*.hpp): Reg, width, zero, masked
// loadu/storeu, mask(n) and transpose(Reg (&)[width]).
#pragma once

#include "sdpa/detail/eigen.hpp"

#include <algorithm>

#include "sdpa/gemm/isa.hpp"

namespace sdpa {
namespace gemm {
inline namespace SDPA_GEMM_ABI_NAMESPACE {
namespace detail {

// dst[s][p][w] = src[(s * W + w) * ld + p], or 0 past count; s < ceil(count / W), p < depth.
template <Eigen::Index W, typename Scalar>
void pack_rows(Eigen::Index count, Eigen::Index depth, const Scalar* src, Eigen::Index ld, Scalar* dst) noexcept {
  using Index = Eigen::Index;
  for (Index s = 0; s < count; s += W) {
    const Index lines = std::min(W, count - s);
    for (Index w = 0; w < lines; ++w) {
      const Scalar* line = src + (s + w) * ld;
      for (Index p = 0; p < depth; ++p) dst[p * W + w] = line[p];
    }
    for (Index w = lines; w < W; ++w) {
      for (Index p = 0; p < depth; ++p) dst[p * W + w] = Scalar(0);
    }
    dst += depth * W;
  }
}

// dst[s][p][w] = src[p * ld + s * W + w], or 0 past count.
template <Eigen::Index W, typename Scalar>
void pack_cols(Eigen::Index count, Eigen::Index depth, const Scalar* src, Eigen::Index ld, Scalar* dst) noexcept {
  using Index = Eigen::Index;
  for (Index s = 0; s < count; s += W) {
    const Index lines = std::min(W, count - s);
    for (Index p = 0; p < depth; ++p) {
      const Scalar* step = src + p * ld + s;
      Scalar* out = dst + p * W;
      for (Index w = 0; w < lines; ++w) out[w] = step[w];
      for (Index w = lines; w < W; ++w) out[w] = Scalar(0);
    }
    dst += depth * W;
  }
}

// How far ahead of the values being transposed pack_rows_group prefetches its source rows: 512 bytes,
// some ten groups' time, about a memory latency.
constexpr Eigen::Index kPackPrefetchBytes = 512;

// One group of a sliver's lines for pack_rows_simd: lines [G, G + lanes) of the sliver at src (leading
// dimension ld, `lines` of them real), all steps, into dst (the sliver's packed start). The common case (all
// lanes real, whole width steps) has constant trip counts, so the width registers of the transpose stay
// in registers; the edges (past count, past depth) take the general loop.
template <Eigen::Index W, typename V, Eigen::Index G, typename Scalar>
void pack_rows_group(Eigen::Index lines, Eigen::Index depth, const Scalar* src, Eigen::Index ld, Scalar* dst) noexcept {
  using Index = Eigen::Index;
  using Reg = typename V::Reg;
  constexpr Index width = V::width;
  constexpr Index lanes = std::min(width, W - G);
  const auto lane_mask = V::mask(lanes);
  const Index group_lines = std::clamp<Index>(lines - G, 0, lanes);
  const Scalar* group = src + (group_lines > 0 ? G * ld : 0);
  for (Index p0 = 0; p0 < depth; p0 += width) {
    const Index steps = std::min(width, depth - p0);
    Scalar* out = dst + p0 * W + G;
    if (group_lines == lanes && steps == width) {
      // Its own array: the edge loop's variable indices would keep a shared one in memory.
      Reg r[static_cast<std::size_t>(width)];
      // The source lines a few groups ahead: `lanes` rows read side by side, each a strided stream of its
      // own, are more than the hardware prefetcher follows, and a projection's weights come from memory
      // (the packing of the demo's weights went from 8% to 2% of its forward).
      constexpr Index ahead = kPackPrefetchBytes / static_cast<Index>(sizeof(Scalar));
      if (p0 + ahead < depth) {
#pragma GCC unroll 16
        for (Index i = 0; i < lanes; ++i) V::prefetch(group + i * ld + p0 + ahead);
      }
#pragma GCC unroll 16
      for (Index i = 0; i < lanes; ++i) r[i] = V::loadu(group + i * ld + p0);
#pragma GCC unroll 16
      for (Index i = lanes; i < width; ++i) r[i] = V::zero();
      V::transpose(r);
      if constexpr (lanes == width) {
#pragma GCC unroll 16
        for (Index q = 0; q < width; ++q) V::storeu(out + q * W, r[q]);
      } else if constexpr (W < width) {
        // A sliver narrower than a vector (12 floats in 16 lanes): whole-vector stores in step order, the
        // extra lanes landing on the next step's values, which the next store writes again. Masked stores
        // cost more where they miss in cache; only the last one stays masked.
#pragma GCC unroll 16
        for (Index q = 0; q + 1 < width; ++q) V::storeu(out + q * W, r[q]);
        V::storeu(out + (width - 1) * W, lane_mask, r[width - 1]);
      } else {
#pragma GCC unroll 16
        for (Index q = 0; q < width; ++q) V::storeu(out + q * W, lane_mask, r[q]);
      }
      continue;
    }
    // Lines past count are zeros, and no pointer to them is formed.
    Reg r[static_cast<std::size_t>(width)];
    const auto step_mask = V::mask(steps);
    for (Index i = 0; i < group_lines; ++i) r[i] = V::loadu(group + i * ld + p0, step_mask);
    for (Index i = group_lines; i < width; ++i) r[i] = V::zero();
    V::transpose(r);
    for (Index q = 0; q < steps; ++q) V::storeu(out + q * W, lane_mask, r[q]);
  }
  if constexpr (G + width < W) pack_rows_group<W, V, G + width>(lines, depth, src, ld, dst);
}

// pack_rows with width x width register transposes: each group of `width` lines of a sliver is loaded
// `width` steps at a time (masked past depth, zero past count), transposed, and stored as `width` steps of
// min(width, W - group) values.
template <Eigen::Index W, typename V, typename Scalar>
void pack_rows_simd(Eigen::Index count, Eigen::Index depth, const Scalar* src, Eigen::Index ld, Scalar* dst) noexcept {
  for (Eigen::Index s = 0; s < count; s += W) {
    pack_rows_group<W, V, 0>(std::min(W, count - s), depth, src + s * ld, ld, dst);
    dst += depth * W;
  }
}

// pack_cols with vector copies; W is a multiple of V::width.
template <Eigen::Index W, typename V, typename Scalar>
void pack_cols_simd(Eigen::Index count, Eigen::Index depth, const Scalar* src, Eigen::Index ld, Scalar* dst) noexcept {
  using Index = Eigen::Index;
  constexpr Index width = V::width;
  static_assert(W % width == 0, "pack_cols_simd: W must be a multiple of the vector width");
  for (Index s = 0; s < count; s += W) {
    const Index lines = std::min(W, count - s);
    if (lines == W) {
      for (Index p = 0; p < depth; ++p) {
#pragma GCC unroll 8
        for (Index v = 0; v < W; v += width) V::storeu(dst + p * W + v, V::loadu(src + p * ld + s + v));
      }
    } else {
      for (Index p = 0; p < depth; ++p) {
        for (Index v = 0; v < W; v += width) {
          const Index lanes = std::clamp<Index>(lines - v, 0, width);
          V::storeu(dst + p * W + v, lanes == 0 ? V::zero() : V::loadu(src + p * ld + s + v, V::mask(lanes)));
        }
      }
    }
    dst += depth * W;
  }
}

}  // namespace detail
}  // namespace SDPA_GEMM_ABI_NAMESPACE
}  // namespace gemm
}  // namespace sdpa
