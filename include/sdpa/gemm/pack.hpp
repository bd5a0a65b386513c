// Packing of A and B into the layout the micro-kernels read: an operand is cut into slivers of W rows of
// the micro-tile's broadcast side (W = mr, from A) or W columns of its vector side (W = nr, from B), and
// each sliver is stored k step by k step, W contiguous values per step, zero-padded past the operand's
// edge. A micro-kernel then reads both operands with unit stride and aligned loads, and padded rows and
// columns only produce values that are never stored.
//   pack_rows: the sliver's W lines are rows of a row-major source src[count, depth] (A; B of gemm_nt,
//              given as b[n, k]): a transpose. The vector version transposes width x width register
//              blocks (16 x 16 floats with AVX-512): a scalar transpose was a visible share of a projection.
//   pack_cols: the sliver's W lines are columns of src[depth, count] (B of gemm_nn, given as b[k, n]):
//              W contiguous values copied per step.
// These are the portable versions; the AVX2 and AVX-512 kernels pack with register transposes
// (simd/generic_gemm.inc).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <type_traits>

#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN
namespace gemm {
namespace detail {

// A source value as Scalar: itself, or a stored one (bfloat16, float16) widened exactly.
template <typename Scalar, typename T>
Scalar source_value(T x) noexcept {
  if constexpr (std::is_same<T, Scalar>::value) return x;
  else return static_cast<Scalar>(to_float(x));
}

// dst[s][p][w] = src[(s * W + w) * ld + p], or 0 past count; s < ceil(count / W), p < depth. T is Scalar or
// a stored type.
template <Eigen::Index W, typename T, typename Scalar>
void pack_rows(Eigen::Index count, Eigen::Index depth, const T* src, Eigen::Index ld, Scalar* dst) noexcept {
  using Index = Eigen::Index;
  for (Index s = 0; s < count; s += W) {
    const Index lines = std::min(W, count - s);
    for (Index w = 0; w < lines; ++w) {
      const T* line = src + (s + w) * ld;
      for (Index p = 0; p < depth; ++p) dst[p * W + w] = source_value<Scalar>(line[p]);
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

}  // namespace detail
}  // namespace gemm
SDPA_NAMESPACE_END
