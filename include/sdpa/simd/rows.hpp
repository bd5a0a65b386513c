// The row views the row kernels take (simd/generic_rows.inc, simd/generic_int8.inc, simd/portable.hpp and
// their dispatch in simd/dispatch.hpp) instead of a pointer and its strides per argument:
//   Rows<T>          keys or values as they are stored (T: the compute type, or BFloat16, Float16, int8 with
//                    one float scale per (row, head)): the storage is the view's type, not another kernel
//   Queries<Scalar>  the queries a chunk of scores is taken against, grouped onto key heads
//   Scores<Scalar>   where those scores go, and the factor they are scaled by
//   HeadSums<Scalar> the accumulators and weights of a weighted sum of rows over several heads
// Views hold pointers the caller owns; they are passed by value and never outlive the call.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

SDPA_NAMESPACE_BEGIN
namespace simd {

// Row j of head g at data + j * row + g * head. An int8 row's values are its entries times
// scales[j * scale_row + g] (scales is null for every other T).
template <typename T>
struct Rows {
  const T* data = nullptr;
  Eigen::Index row = 0;
  Eigen::Index head = 0;
  const float* scales = nullptr;
  Eigen::Index scale_row = 0;

  // The same rows from row j of head g on, as rows 0 of head 0.
  Rows at(Eigen::Index j, Eigen::Index g = 0) const noexcept {
    return {data + j * row + g * head, row, head, scales != nullptr ? scales + j * scale_row + g : nullptr, scale_row};
  }
};

// Query i of query head h at data + h * head + i * row, for h < heads and i < count, d features each;
// query head h reads key head h / group.
template <typename Scalar>
struct Queries {
  const Scalar* data = nullptr;
  Eigen::Index head = 0;
  Eigen::Index row = 0;
  Eigen::Index heads = 1;
  Eigen::Index group = 1;
  Eigen::Index count = 1;
  Eigen::Index d = 0;
};

// The score of key j against query i of head h goes to data[(h * count + i) * ld + j], times scale.
template <typename Scalar>
struct Scores {
  Scalar* data = nullptr;
  Eigen::Index ld = 0;
  Scalar scale = Scalar(1);
};

// Query head h < heads adds sum_j w[h * w_head + j] * row j of value head h / group into acc + h * acc_head.
template <typename Scalar>
struct HeadSums {
  Scalar* acc = nullptr;
  Eigen::Index acc_head = 0;
  const Scalar* w = nullptr;
  Eigen::Index w_head = 0;
  Eigen::Index heads = 1;
  Eigen::Index group = 1;
};

}  // namespace simd
SDPA_NAMESPACE_END
