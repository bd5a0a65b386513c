// Weight initialisation, usable on any Eigen::Tensor or Eigen::TensorMap without the attention module:
// the fan computation and gains of torch.nn.init, the strategies themselves (constant, normal, uniform,
// Xavier/Glorot, Kaiming/He, and PyTorch's default nn.Linear / nn.Conv rule) as small value types in
// sdpa::init, and two named policies that say how to initialise a whole layer. Tensors are read in
// PyTorch's dimension order (out, in, kh, kw, ...) whatever their Eigen layout, and elements are drawn in
// PyTorch's row-major order, so a seed gives the same logical tensor for RowMajor and ColMajor storage.
// Random numbers come only from the generator the caller passes (e.g. sdpa::Philox); there is no global
// generator, and all arithmetic is in double before the cast to the tensor's scalar.
#pragma once

#include "sdpa/config.hpp"

#include <array>
#include <cmath>
#include <cstddef>
#include <type_traits>

#include "sdpa/detail/eigen.hpp"
#include "sdpa/error.hpp"
#include "sdpa/random.hpp"

SDPA_NAMESPACE_BEGIN

// fan_in and fan_out as torch.nn.init._calculate_fan_in_and_fan_out computes them.
struct Fans {
  Eigen::Index fan_in;
  Eigen::Index fan_out;
};

namespace detail {

inline Fans compute_fans_for(const char* where, const Eigen::Index* dims, int rank) {
  if (rank < 2)
    throw_invalid(where, "tensor rank", "at least 2 (fans need dimensions (out, in, ...))", rank);
  if (dims == nullptr) throw_invalid(where, "dims", "non-null", "null");
  Eigen::Index receptive = 1;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 0)
      throw_invalid(where, "every dimension", "non-negative", shape_string(dims, static_cast<std::size_t>(rank)));
    if (i >= 2) receptive *= dims[i];
  }
  return {dims[1] * receptive, dims[0] * receptive};
}

template <typename TensorT>
Fans compute_fans_for(const char* where, const TensorT& t) {
  constexpr std::size_t kRank = TensorT::NumIndices;
  // One spare slot so that rank 0 still has an array to point at; it is refused before it is read.
  std::array<Eigen::Index, kRank + 1> dims{};
  for (std::size_t i = 0; i < kRank; ++i) dims[i] = static_cast<Eigen::Index>(t.dimension(i));
  return compute_fans_for(where, dims.data(), static_cast<int>(kRank));
}

// uniform_double builds 53 bits from two 32-bit words; a wider generator would overflow that.
template <typename Gen>
constexpr void check_generator() {
  static_assert(Gen::min() == 0 && Gen::max() == 0xFFFFFFFFu,
                "sdpa::init: the generator must produce 32 random bits per call (e.g. sdpa::Philox, std::mt19937)");
}

template <typename TensorT>
constexpr void check_target() {
  static_assert(std::is_floating_point<typename TensorT::Scalar>::value,
                "sdpa::init: the tensor's scalar must be a floating-point type");
}

// Calls fn(element) for every element in PyTorch's row-major order, so that the k-th draw from the
// generator lands on the same logical element whatever the storage layout.
template <typename TensorT, typename Fn>
void for_each_row_major(TensorT& t, Fn&& fn) {
  constexpr std::size_t kRank = TensorT::NumIndices;
  const Eigen::Index n = static_cast<Eigen::Index>(t.size());
  if (n == 0) return;
  auto* data = t.data();
  if constexpr (kRank <= 1 || static_cast<int>(TensorT::Layout) == static_cast<int>(Eigen::RowMajor)) {
    for (Eigen::Index i = 0; i < n; ++i) fn(data[i]);
  } else {
    std::array<Eigen::Index, kRank> extent{}, stride{}, index{};
    Eigen::Index step = 1;
    for (std::size_t k = 0; k < kRank; ++k) {
      extent[k] = static_cast<Eigen::Index>(t.dimension(k));
      stride[k] = step;
      step *= extent[k];
    }
    Eigen::Index offset = 0;
    for (Eigen::Index i = 0; i < n; ++i) {
      fn(data[offset]);
      for (std::size_t k = kRank; k-- > 0;) {
        if (++index[k] < extent[k]) {
          offset += stride[k];
          break;
        }
        index[k] = 0;
        offset -= (extent[k] - 1) * stride[k];
      }
    }
  }
}

template <typename TensorT>
void fill_value(TensorT& t, double value) {
  using Scalar = typename TensorT::Scalar;
  const Scalar v = static_cast<Scalar>(value);
  for_each_row_major(t, [v](Scalar& x) { x = v; });
}

template <typename TensorT, typename Gen>
void fill_uniform(TensorT& t, Gen& gen, double lo, double hi) {
  using Scalar = typename TensorT::Scalar;
  const double width = hi - lo;
  for_each_row_major(t, [&](Scalar& x) { x = static_cast<Scalar>(lo + width * uniform_double(gen)); });
}

template <typename TensorT, typename Gen>
void fill_normal(TensorT& t, Gen& gen, double mean, double stddev) {
  using Scalar = typename TensorT::Scalar;
  for_each_row_major(t, [&](Scalar& x) { x = static_cast<Scalar>(mean + stddev * normal_double(gen)); });
}

inline void check_finite(const char* where, const char* argument, double value) {
  if (!std::isfinite(value)) throw_invalid(where, argument, "finite", value);
}

inline void check_range(const char* where, double a, double b) {
  check_finite(where, "a", a);
  check_finite(where, "b", b);
  if (b < a) throw_invalid(where, "b", concat("at least a = ", a), b);
  if (!std::isfinite(b - a)) throw_invalid(where, "b - a", "finite", b - a);
}

}  // namespace detail

// Throws std::invalid_argument when rank < 2: a vector has no (out, in) pair, and PyTorch refuses it too.
inline Fans compute_fans(const Eigen::Index* dims, int rank) {
  return detail::compute_fans_for("compute_fans", dims, rank);
}

template <typename TensorT>
Fans compute_fans(const TensorT& t) {
  return detail::compute_fans_for("compute_fans", t);
}

enum class Nonlinearity {
  kLinear,
  kConv1d,
  kConv2d,
  kConv3d,
  kConvTranspose1d,
  kConvTranspose2d,
  kConvTranspose3d,
  kSigmoid,
  kTanh,
  kRelu,
  kLeakyRelu,
  kSelu
};

// torch.nn.init.calculate_gain; `param` is the negative slope and only matters for kLeakyRelu.
inline double calculate_gain(Nonlinearity nonlinearity, double param = 0.01) {
  switch (nonlinearity) {
    case Nonlinearity::kLinear:
    case Nonlinearity::kConv1d:
    case Nonlinearity::kConv2d:
    case Nonlinearity::kConv3d:
    case Nonlinearity::kConvTranspose1d:
    case Nonlinearity::kConvTranspose2d:
    case Nonlinearity::kConvTranspose3d:
    case Nonlinearity::kSigmoid:
      return 1.0;
    case Nonlinearity::kTanh:
      return 5.0 / 3.0;
    case Nonlinearity::kRelu:
      return std::sqrt(2.0);
    case Nonlinearity::kLeakyRelu:
      detail::check_finite("calculate_gain", "param (negative slope)", param);
      return std::sqrt(2.0 / (1.0 + param * param));
    case Nonlinearity::kSelu:
      return 3.0 / 4.0;  // Not the self-normalising 1: PyTorch picked 3/4 for a stable forward pass.
  }
  detail::throw_invalid("calculate_gain", "nonlinearity", "a Nonlinearity enumerator",
                        static_cast<int>(nonlinearity));
}

enum class FanMode { kFanIn, kFanOut };

namespace detail {

inline Eigen::Index select_fan(const char* where, const Fans& fans, FanMode mode) {
  switch (mode) {
    case FanMode::kFanIn:
      return fans.fan_in;
    case FanMode::kFanOut:
      return fans.fan_out;
  }
  throw_invalid(where, "mode", "FanMode::kFanIn or FanMode::kFanOut", static_cast<int>(mode));
}

// gain * sqrt(2 / (fan_in + fan_out)) of the Xavier strategies, after checking their parameters and the tensor.
template <typename Gen, typename TensorT>
double xavier_std(const char* where, const TensorT& t, double gain) {
  check_target<TensorT>();
  check_generator<Gen>();
  check_finite(where, "gain", gain);
  if (gain < 0.0) throw_invalid(where, "gain", "non-negative", gain);
  const Fans fans = compute_fans_for(where, t);
  return gain * std::sqrt(2.0 / static_cast<double>(fans.fan_in + fans.fan_out));
}

// gain / sqrt(fan) of the Kaiming strategies, after checking their parameters and the tensor.
template <typename Gen, typename TensorT>
double kaiming_std(const char* where, const TensorT& t, double a, FanMode mode, Nonlinearity nonlinearity) {
  check_target<TensorT>();
  check_generator<Gen>();
  check_finite(where, "a", a);
  const double gain = calculate_gain(nonlinearity, a);
  const Eigen::Index fan = select_fan(where, compute_fans_for(where, t), mode);
  return gain / std::sqrt(static_cast<double>(fan));
}

}  // namespace detail

namespace init {

// Every strategy: `s(tensor, gen)` fills every element of an Eigen::Tensor / TensorMap of float or double,
// drawing from `gen` (a 32-bit UniformRandomBitGenerator), and refuses bad parameters with
// std::invalid_argument before touching the tensor. Fields are public so that {..} names the parameters.

struct Constant {
  double value = 0.0;  // Not checked for finiteness: torch's constant_ accepts inf and nan, and so do masks.

  template <typename TensorT>
  void operator()(TensorT& t) const {
    detail::check_target<TensorT>();
    detail::fill_value(t, value);
  }
  template <typename TensorT, typename Gen>
  void operator()(TensorT& t, Gen& /*gen*/) const {
    (*this)(t);
  }
};

// Constant fills with a fixed value; as named strategies they read better in a policy.
struct Zeros : Constant {
  Zeros() noexcept : Constant{0.0} {}
};

struct Ones : Constant {
  Ones() noexcept : Constant{1.0} {}
};

struct Normal {
  double mean = 0.0;
  double std = 1.0;

  template <typename TensorT, typename Gen>
  void operator()(TensorT& t, Gen& gen) const {
    detail::check_target<TensorT>();
    detail::check_generator<Gen>();
    detail::check_finite("init::Normal", "mean", mean);
    detail::check_finite("init::Normal", "std", std);
    if (std < 0.0) detail::throw_invalid("init::Normal", "std", "non-negative", std);
    detail::fill_normal(t, gen, mean, std);
  }
};

// U[a, b): a + (b - a) * u, as torch's uniform_. After rounding to float the value may equal b.
struct Uniform {
  double a = 0.0;
  double b = 1.0;

  template <typename TensorT, typename Gen>
  void operator()(TensorT& t, Gen& gen) const {
    detail::check_target<TensorT>();
    detail::check_generator<Gen>();
    detail::check_range("init::Uniform", a, b);
    detail::fill_uniform(t, gen, a, b);
  }
};

// The bounds and deviations below are computed in the same order as torch.nn.init so that they agree
// with PyTorch to the last bit, not only mathematically. Zero-element tensors are left alone, as in
// PyTorch's kaiming_* (its xavier_* would divide by zero instead).

struct XavierUniform {
  double gain = 1.0;

  template <typename TensorT, typename Gen>
  void operator()(TensorT& t, Gen& gen) const {
    const double stddev = detail::xavier_std<Gen>("init::XavierUniform", t, gain);
    if (t.size() == 0) return;
    const double bound = std::sqrt(3.0) * stddev;
    detail::fill_uniform(t, gen, -bound, bound);
  }
};

struct XavierNormal {
  double gain = 1.0;

  template <typename TensorT, typename Gen>
  void operator()(TensorT& t, Gen& gen) const {
    const double stddev = detail::xavier_std<Gen>("init::XavierNormal", t, gain);
    if (t.size() == 0) return;
    detail::fill_normal(t, gen, 0.0, stddev);
  }
};

struct KaimingUniform {
  double a = 0.0;  // negative slope of the leaky ReLU that follows; ignored by other nonlinearities
  FanMode mode = FanMode::kFanIn;
  Nonlinearity nonlinearity = Nonlinearity::kLeakyRelu;

  template <typename TensorT, typename Gen>
  void operator()(TensorT& t, Gen& gen) const {
    const double stddev = detail::kaiming_std<Gen>("init::KaimingUniform", t, a, mode, nonlinearity);
    if (t.size() == 0) return;
    const double bound = std::sqrt(3.0) * stddev;
    detail::fill_uniform(t, gen, -bound, bound);
  }
};

struct KaimingNormal {
  double a = 0.0;
  FanMode mode = FanMode::kFanIn;
  Nonlinearity nonlinearity = Nonlinearity::kLeakyRelu;

  template <typename TensorT, typename Gen>
  void operator()(TensorT& t, Gen& gen) const {
    const double stddev = detail::kaiming_std<Gen>("init::KaimingNormal", t, a, mode, nonlinearity);
    if (t.size() == 0) return;
    detail::fill_normal(t, gen, 0.0, stddev);
  }
};

// nn.Linear / nn.Conv*d reset_parameters(): kaiming_uniform_(a = sqrt(5)), which works out to
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)); PyTorch keeps the roundabout form for backward compatibility.
struct LinearDefaultWeight {
  template <typename TensorT, typename Gen>
  void operator()(TensorT& t, Gen& gen) const {
    KaimingUniform{std::sqrt(5.0), FanMode::kFanIn, Nonlinearity::kLeakyRelu}(t, gen);
  }
};

// The matching bias rule; fan_in is the weight's (compute_fans(weight).fan_in), which the bias alone
// cannot know.
struct LinearDefaultBias {
  Eigen::Index fan_in = 0;

  template <typename TensorT, typename Gen>
  void operator()(TensorT& t, Gen& gen) const {
    detail::check_target<TensorT>();
    detail::check_generator<Gen>();
    if (fan_in < 0) detail::throw_invalid("init::LinearDefaultBias", "fan_in", "non-negative", fan_in);
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    detail::fill_uniform(t, gen, -bound, bound);
  }
};

template <class Strategy, class TensorT, class Gen>
void apply(const Strategy& s, TensorT& t, Gen& gen) {
  s(t, gen);
}

namespace detail {

// A layer's bias may be a tensor, a pointer to one (null for a layer without bias) or nullptr itself.
template <typename B, typename Fn>
void on_bias(B& bias, Fn&& fn) {
  if constexpr (std::is_null_pointer<B>::value) {
    (void)bias;
    (void)fn;
  } else if constexpr (std::is_pointer<B>::value) {
    if (bias != nullptr) fn(*bias);
  } else {
    fn(bias);
  }
}

}  // namespace detail

// The seed project's init_weights (the External Attention reference code): Linear ~ N(0, 0.001) with
// zero bias, Conv kaiming_normal_(mode='fan_out') with zero bias, BatchNorm 1 / 0. Its tiny linear
// weights make a freshly built module close to a zero map, which is what that project's results assume.
struct ExternalAttentionPolicy {
  template <class W, class B, class Gen>
  void linear(W& weight, B& bias, Gen& gen) const {
    linear_layer(weight, bias, gen);
  }
  template <class W, class B, class Gen>
  void linear(W& weight, B* bias, Gen& gen) const {
    linear_layer(weight, bias, gen);
  }
  template <class W, class Gen>
  void linear(W& weight, std::nullptr_t, Gen& gen) const {
    Normal{0.0, 0.001}(weight, gen);
  }

  template <class W, class B, class Gen>
  void conv(W& weight, B& bias, Gen& gen) const {
    conv_layer(weight, bias, gen);
  }
  template <class W, class B, class Gen>
  void conv(W& weight, B* bias, Gen& gen) const {
    conv_layer(weight, bias, gen);
  }
  template <class W, class Gen>
  void conv(W& weight, std::nullptr_t, Gen& gen) const {
    KaimingNormal{0.0, FanMode::kFanOut, Nonlinearity::kLeakyRelu}(weight, gen);
  }

  template <class W, class B>
  void batch_norm(W& weight, B& bias) const {
    Ones{}(weight);
    Zeros{}(bias);
  }

 private:
  template <class W, class B, class Gen>
  void linear_layer(W& weight, B& bias, Gen& gen) const {
    Normal{0.0, 0.001}(weight, gen);
    detail::on_bias(bias, [](auto& b) { Zeros{}(b); });
  }
  // kaiming_normal_(mode='fan_out') with its default leaky_relu, a = 0: the ReLU gain sqrt(2).
  template <class W, class B, class Gen>
  void conv_layer(W& weight, B& bias, Gen& gen) const {
    KaimingNormal{0.0, FanMode::kFanOut, Nonlinearity::kLeakyRelu}(weight, gen);
    detail::on_bias(bias, [](auto& b) { Zeros{}(b); });
  }
};

// What a freshly constructed torch.nn.Linear / Conv*d / BatchNorm*d holds: LinearDefaultWeight and
// LinearDefaultBias with the weight's fan_in for both linear and conv layers, BatchNorm 1 / 0.
struct PyTorchDefaultPolicy {
  template <class W, class B, class Gen>
  void linear(W& weight, B& bias, Gen& gen) const {
    layer(weight, bias, gen);
  }
  template <class W, class B, class Gen>
  void linear(W& weight, B* bias, Gen& gen) const {
    layer(weight, bias, gen);
  }
  template <class W, class Gen>
  void linear(W& weight, std::nullptr_t, Gen& gen) const {
    LinearDefaultWeight{}(weight, gen);
  }

  template <class W, class B, class Gen>
  void conv(W& weight, B& bias, Gen& gen) const {
    layer(weight, bias, gen);
  }
  template <class W, class B, class Gen>
  void conv(W& weight, B* bias, Gen& gen) const {
    layer(weight, bias, gen);
  }
  template <class W, class Gen>
  void conv(W& weight, std::nullptr_t, Gen& gen) const {
    LinearDefaultWeight{}(weight, gen);
  }

  template <class W, class B>
  void batch_norm(W& weight, B& bias) const {
    Ones{}(weight);
    Zeros{}(bias);
  }

 private:
  // Weight first, then bias, from the same generator: the order PyTorch's reset_parameters() uses.
  template <class W, class B, class Gen>
  void layer(W& weight, B& bias, Gen& gen) const {
    LinearDefaultWeight{}(weight, gen);
    const Eigen::Index fan_in = compute_fans(weight).fan_in;
    detail::on_bias(bias, [&](auto& b) { LinearDefaultBias{fan_in}(b, gen); });
  }
};

}  // namespace init
SDPA_NAMESPACE_END
