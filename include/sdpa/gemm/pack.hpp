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

#include <Eigen/Core>

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

// pack_rows with width x width register transposes: each group of `width` lines of a sliver is loaded
// `width` steps at a time (masked past depth, zero past count), transposed, and stored as `width` steps of
// min(width, W - group) values.
template <Eigen::Index W, typename V, typename Scalar>
void pack_rows_simd(Eigen::Index count, Eigen::Index depth, const Scalar* src, Eigen::Index ld, Scalar* dst) noexcept {
  using Index = Eigen::Index;
  constexpr Index width = V::width;
  using Reg = typename V::Reg;
  for (Index s = 0; s < count; s += W) {
    const Index lines = std::min(W, count - s);
    for (Index g = 0; g < W; g += width) {
      const Index group_lines = std::clamp<Index>(lines - g, 0, width);
      const Index lanes = std::min(width, W - g);
      const auto lane_mask = V::mask(lanes);
      for (Index p0 = 0; p0 < depth; p0 += width) {
        const Index steps = std::min(width, depth - p0);
        const auto step_mask = V::mask(steps);
        Reg r[static_cast<std::size_t>(width)];
        // Lines past count are zeros, and no pointer to them is formed.
        const Scalar* first = src + p0;
        if (steps == width) {
          for (Index i = 0; i < group_lines; ++i) r[i] = V::loadu(first + (s + g + i) * ld);
        } else {
          for (Index i = 0; i < group_lines; ++i) r[i] = V::loadu(first + (s + g + i) * ld, step_mask);
        }
        for (Index i = group_lines; i < width; ++i) r[i] = V::zero();
        V::transpose(r);
        Scalar* out = dst + p0 * W + g;
        if (lanes == width) {
          for (Index q = 0; q < steps; ++q) V::storeu(out + q * W, r[q]);
        } else {
          for (Index q = 0; q < steps; ++q) V::storeu(out + q * W, lane_mask, r[q]);
        }
      }
    }
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
