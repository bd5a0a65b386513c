// sdpa::Linear, PyTorch's nn.Linear: y = x W^T + b with W stored (out_features, in_features) row-major as in
// PyTorch, so a state_dict copies in without transposition. The product runs on the caller's memory
// through Eigen::Map, optionally split by rows over a thread pool.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>
#include <cstddef>
#include <limits>
#include <type_traits>

#include "sdpa/error.hpp"
#include "sdpa/kernels/projection.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class Linear {
  static_assert(std::is_floating_point<Scalar>::value, "sdpa::Linear needs a floating-point Scalar");

 public:
  using Index = Eigen::Index;
  using Weight = Eigen::Tensor<Scalar, 2, Eigen::RowMajor>;
  using Bias = Eigen::Tensor<Scalar, 1, Eigen::RowMajor>;

  // Parameters start at zero; apply an init policy (sdpa/init.hpp) to give them values.
  Linear(Index in_features, Index out_features)
      : weight_(checked_features(in_features, out_features), in_features), bias_(out_features) {
    weight_.setZero();
    bias_.setZero();
  }

  Index in_features() const noexcept { return weight_.dimension(1); }
  Index out_features() const noexcept { return weight_.dimension(0); }

  Weight& weight() noexcept { return weight_; }
  const Weight& weight() const noexcept { return weight_; }
  Bias& bias() noexcept { return bias_; }
  const Bias& bias() const noexcept { return bias_; }

  // y[rows, out] = x[rows, in] W^T + b, on raw row-major memory with leading dimensions ldx and ldy
  // (elements between consecutive rows), so that callers can write into a slice of a wider buffer.
  void forward_rows(const Scalar* x, Index rows, Index ldx, Scalar* y, Index ldy,
                    const Eigen::ThreadPoolDevice* device = nullptr) const {
    kernels::gemm_bias_rows(x, rows, in_features(), ldx, weight_.data(), out_features(), bias_.data(), y, ldy, device);
  }

  // Applies the layer to the last dimension of a row-major tensor of any rank (PyTorch's broadcasting
  // over leading dimensions).
  template <typename TensorT>
  Eigen::Tensor<Scalar, TensorT::NumDimensions, Eigen::RowMajor> operator()(
      const TensorT& x, const Eigen::ThreadPoolDevice* device = nullptr) const {
    constexpr int kRank = TensorT::NumDimensions;
    static_assert(kRank >= 1, "sdpa::Linear needs a tensor of rank >= 1");
    static_assert(static_cast<int>(TensorT::Layout) == static_cast<int>(Eigen::RowMajor),
                  "sdpa::Linear needs a RowMajor tensor (PyTorch memory order)");
    static_assert(std::is_same<std::remove_const_t<typename TensorT::Scalar>, Scalar>::value,
                  "sdpa::Linear: the tensor's scalar type must be the layer's");
    if (x.dimension(static_cast<std::size_t>(kRank - 1)) != in_features()) {
      detail::throw_invalid("Linear::operator()", "the input's last dimension", in_features(),
                            concat_shape(x.dimensions()));
    }
    std::array<Index, static_cast<std::size_t>(kRank)> dims;
    for (std::size_t i = 0; i < static_cast<std::size_t>(kRank); ++i) dims[i] = x.dimension(i);
    dims[static_cast<std::size_t>(kRank - 1)] = out_features();
    Eigen::Tensor<Scalar, kRank, Eigen::RowMajor> y(dims);
    const Index rows = in_features() == 0 ? 0 : x.size() / in_features();
    forward_rows(x.data(), rows, in_features(), y.data(), out_features(), device);
    return y;
  }

 private:
  // Runs before any allocation: sizes must be positive and their product representable.
  static Index checked_features(Index in_features, Index out_features) {
    if (in_features <= 0) detail::throw_invalid("Linear", "in_features", "positive", in_features);
    if (out_features <= 0) detail::throw_invalid("Linear", "out_features", "positive", out_features);
    if (in_features > std::numeric_limits<Index>::max() / out_features)
      detail::throw_invalid("Linear", "in_features * out_features", "representable as Eigen::Index",
                            detail::concat(in_features, " * ", out_features));
    return out_features;
  }

  template <typename Dims>
  static std::string concat_shape(const Dims& dims) {
    return detail::concat(dims[dims.size() - 1], " (input shape ", detail::shape_string(dims), ")");
  }

  Weight weight_;
  Bias bias_;
};

SDPA_NAMESPACE_END
