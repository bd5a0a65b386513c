// sdpa::Linear, PyTorch's nn.Linear: y = x W^T + b with W stored (out_features, in_features) row-major as in
// PyTorch, so a state_dict copies in without transposition. The product runs on the caller's memory,
// optionally split by rows over a thread pool. A float layer may keep its weights as bfloat16 or float16
// (set_weight_storage: half the bytes; the bias stays float): the products convert them while they pack
// or read them and compute in float, so the layer computes exactly what a float layer with the rounded
// weights computes.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>
#include <cstddef>
#include <limits>
#include <type_traits>

#include <vector>

#include "sdpa/error.hpp"
#include "sdpa/kernels/projection.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/storage.hpp"

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
      : weight_(checked_features(in_features, out_features), in_features), bias_(out_features), in_(in_features),
        out_(out_features) {
    weight_.setZero();
    bias_.setZero();
  }

  Index in_features() const noexcept { return in_; }
  Index out_features() const noexcept { return out_; }

  // The weights as Scalar. A layer whose weights are stored narrower (set_weight_storage) has none:
  // std::invalid_argument (weight_values() gives a widened copy).
  Weight& weight() {
    check_scalar_weights("Linear::weight");
    return weight_;
  }
  const Weight& weight() const {
    check_scalar_weights("Linear::weight");
    return weight_;
  }
  Bias& bias() noexcept { return bias_; }
  const Bias& bias() const noexcept { return bias_; }

  // How the weights are stored: native_storage<Scalar>() (kFloat32 or kFloat64), or, for a float layer,
  // kBFloat16 or kFloat16.
  Storage weight_storage() const noexcept { return storage_; }

  // Converts the weights to `storage` (rounded to nearest, ties to even; back to Scalar: exactly), freeing
  // the other copy. A float layer takes kFloat32, kBFloat16 and kFloat16; a double one kFloat64 only.
  void set_weight_storage(Storage storage) {
    const char* where = "Linear::set_weight_storage";
    const bool is_float = std::is_same<Scalar, float>::value;
    if (is_float ? !(storage == Storage::kFloat32 || storage == Storage::kBFloat16 || storage == Storage::kFloat16)
                 : storage != Storage::kFloat64)
      detail::throw_invalid(where, "storage",
                            is_float ? "kFloat32, kBFloat16 or kFloat16 for float weights (kInt8 weights are not built)"
                                     : "kFloat64 for double weights (narrow weights need a float layer)",
                            storage_name(storage));
    if (storage == storage_) return;
    if (storage == native_storage<Scalar>()) {
      weight_ = weight_values();
      narrow_ = std::vector<std::uint16_t>();
    } else {
      const Weight w = weight_values();
      std::vector<std::uint16_t> bits(static_cast<std::size_t>(w.size()));
      for (std::size_t i = 0; i < bits.size(); ++i) {
        const float x = static_cast<float>(w.data()[i]);
        bits[i] = storage == Storage::kBFloat16 ? to_bfloat16(x).bits : to_float16(x).bits;
      }
      narrow_ = std::move(bits);
      weight_ = Weight(out_, 0);  // no Scalar copy
    }
    storage_ = storage;
  }

  // The weights as stored: (out, in) elements of weight_storage() (bfloat16 / float16 bits, or Scalar).
  const void* stored_weight() const noexcept {
    return storage_ == native_storage<Scalar>() ? static_cast<const void*>(weight_.data()) : narrow_.data();
  }

  // A copy of the weights as Scalar (narrow ones widened exactly).
  Weight weight_values() const {
    if (storage_ == native_storage<Scalar>()) return weight_;
    Weight w(out_, in_);
    for (std::size_t i = 0; i < narrow_.size(); ++i)
      w.data()[i] = static_cast<Scalar>(storage_ == Storage::kBFloat16 ? bfloat16_to_float(narrow_[i]) : half_to_float(narrow_[i]));
    return w;
  }

  // Replaces the weights (out_features, in_features), rounding them to the layer's storage.
  void set_weight_values(const Weight& w) {
    if (w.dimension(0) != out_ || w.dimension(1) != in_)
      detail::throw_invalid("Linear::set_weight_values", "the weights' shape",
                            detail::shape_string(std::array<Index, 2>{out_, in_}), detail::shape_string(w.dimensions()));
    const Storage s = storage_;
    if (s != native_storage<Scalar>()) set_weight_storage(native_storage<Scalar>());
    weight_ = w;
    set_weight_storage(s);
  }

  // This layer's share of a projection pass (kernels/projection.hpp), writing to y (row stride ldy).
  kernels::ProjectionTarget<Scalar> target(Scalar* y, Index ldy) const noexcept {
    kernels::ProjectionTarget<Scalar> t{storage_ == native_storage<Scalar>() ? weight_.data() : nullptr, bias_.data(), out_, y, ldy};
    t.weight_storage = storage_;
    t.weight_stored = storage_ == native_storage<Scalar>() ? nullptr : narrow_.data();
    return t;
  }

  // y[rows, out] = x[rows, in] W^T + b, on raw row-major memory with leading dimensions ldx and ldy
  // (elements between consecutive rows), so that callers can write into a slice of a wider buffer.
  void forward_rows(const Scalar* x, Index rows, Index ldx, Scalar* y, Index ldy,
                    const Eigen::ThreadPoolDevice* device = nullptr) const {
    if (storage_ != native_storage<Scalar>()) {
      const kernels::ProjectionTarget<Scalar> t = target(y, ldy);
      kernels::project_rows<Scalar>(x, rows, in_, ldx, &t, 1, device);
      return;
    }
    kernels::gemm_bias_rows({rows, out_features(), in_features()}, {x, ldx}, weight_.data(), bias_.data(), {y, ldy},
                            device);
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

  void check_scalar_weights(const char* where) const {
    if (storage_ != native_storage<Scalar>())
      detail::throw_invalid(where, "the layer's weight storage",
                            detail::concat(storage_name(native_storage<Scalar>()),
                                           " (weights stored narrower have no Scalar copy: weight_values() widens one, "
                                           "set_weight_storage(", storage_name(native_storage<Scalar>()), ") converts back)"),
                            storage_name(storage_));
  }

  Weight weight_;  // (out, in); empty when the weights are stored narrower
  Bias bias_;
  Index in_, out_;
  Storage storage_ = native_storage<Scalar>();
  std::vector<std::uint16_t> narrow_;  // bfloat16 or float16 bits, (out, in), when storage_ is one of them
};

SDPA_NAMESPACE_END
