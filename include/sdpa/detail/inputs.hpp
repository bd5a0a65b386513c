// How the module takes its (batch, seq, d_model) inputs: an Eigen::Tensor or TensorMap of the module's
// Scalar in row-major order is read in place; any other rank-3 row-major tensor expression of that Scalar
// (x * 2.0f, a slice, a TensorRef) is evaluated once into a temporary. The checks are compile-time traits
// so that a wrong argument stops at one static_assert that says what is wrong, before anything else of
// the call is instantiated.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>
#include <type_traits>

SDPA_NAMESPACE_BEGIN
namespace detail {

template <typename T, typename = void>
struct InputTraits {
  static constexpr bool kIsTensor = false;
  static constexpr int kRank = 0;
  static constexpr bool kRowMajor = false;
  using Scalar = void;
};

template <typename T>
struct InputTraits<T, std::enable_if_t<std::is_base_of<Eigen::TensorBase<T, Eigen::ReadOnlyAccessors>, T>::value>> {
  using Traits = Eigen::internal::traits<T>;
  static constexpr bool kIsTensor = true;
  static constexpr int kRank = Traits::NumDimensions;
  static constexpr bool kRowMajor = static_cast<int>(Traits::Layout) == static_cast<int>(Eigen::RowMajor);
  using Scalar = std::remove_const_t<typename Traits::Scalar>;
};

// Tensors whose memory is a plain row-major (batch, seq, d_model) array: read where they lie.
template <typename T>
struct IsInPlace : std::false_type {};
template <typename S, int Options, typename I>
struct IsInPlace<Eigen::Tensor<S, 3, Options, I>> : std::integral_constant<bool, (Options & Eigen::RowMajor) != 0> {};
template <typename S, int Options, typename I, int MapOptions, template <class> class MakePointer>
struct IsInPlace<Eigen::TensorMap<Eigen::Tensor<S, 3, Options, I>, MapOptions, MakePointer>>
    : std::integral_constant<bool, (Options & Eigen::RowMajor) != 0> {};

template <typename T, typename Scalar>
constexpr bool is_valid_input() {
  using Tr = InputTraits<T>;
  return Tr::kIsTensor && Tr::kRank == 3 && Tr::kRowMajor && std::is_same<typename Tr::Scalar, Scalar>::value;
}

// The checks, one message each; `what` is not available to static_assert, so the messages say
// "queries, keys and values" and the compiler's note names the argument's type.
#define SDPA_DETAIL_CHECK_INPUT(T, Scalar)                                                                     \
  static_assert(::sdpa::detail::InputTraits<T>::kIsTensor,                                                     \
                "sdpa: queries, keys and values must be Eigen tensors (Eigen::Tensor, Eigen::TensorMap or a "  \
                "tensor expression) of shape (batch, seq, d_model)");                                           \
  static_assert(!::sdpa::detail::InputTraits<T>::kIsTensor || ::sdpa::detail::InputTraits<T>::kRank == 3,       \
                "sdpa: queries, keys and values must be rank-3 tensors (batch, seq, d_model)");                \
  static_assert(!::sdpa::detail::InputTraits<T>::kIsTensor ||                                                   \
                    std::is_same<typename ::sdpa::detail::InputTraits<T>::Scalar, Scalar>::value,               \
                "sdpa: the inputs' scalar type must be the module's (convert with .template cast<Scalar>())");  \
  static_assert(!::sdpa::detail::InputTraits<T>::kIsTensor || ::sdpa::detail::InputTraits<T>::kRowMajor,       \
                "sdpa: inputs must be RowMajor (PyTorch memory order): pass a ColMajor tensor t of dims "      \
                "(batch, seq, d_model) as t.swap_layout().shuffle(Eigen::array<int, 3>{2, 1, 0})")

// One input as the module reads it: data and dims, owning the evaluated copy of an expression.
template <typename Scalar>
class InputView {
 public:
  using Index = Eigen::Index;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;

  InputView() = default;
  template <typename T>
  explicit InputView(const T& t) {
    assign(t);
  }
  InputView(const InputView&) = delete;
  InputView& operator=(const InputView&) = delete;

  // Views `t` (or evaluates it into the owned copy).
  template <typename T>
  void assign(const T& t) {
    if constexpr (IsInPlace<T>::value) {
      data_ = t.data();
      dims_ = {t.dimension(0), t.dimension(1), t.dimension(2)};
    } else {
      owned_ = t;  // evaluated once, here
      data_ = owned_.data();
      dims_ = {owned_.dimension(0), owned_.dimension(1), owned_.dimension(2)};
    }
  }

  const Scalar* data() const noexcept { return data_; }
  const std::array<Index, 3>& dims() const noexcept { return dims_; }

 private:
  Tensor3 owned_;
  const Scalar* data_ = nullptr;
  std::array<Index, 3> dims_{};
};

// The three inputs; an expression passed as several of them (the same object) is evaluated once, so that
// q = k = v still takes the fused projection.
template <typename Scalar>
class Inputs {
 public:
  template <typename Q, typename K, typename V>
  Inputs(const Q& q, const K& k, const V& v) : q_(q) {
    k_ = shared(k, q, q_);
    if (k_ == nullptr) {
      k_own_.assign(k);
      k_ = &k_own_;
    }
    v_ = shared(v, q, q_);
    if (v_ == nullptr) v_ = shared(v, k, *k_);
    if (v_ == nullptr) {
      v_own_.assign(v);
      v_ = &v_own_;
    }
  }

  const InputView<Scalar>& q() const noexcept { return q_; }
  const InputView<Scalar>& k() const noexcept { return *k_; }
  const InputView<Scalar>& v() const noexcept { return *v_; }

 private:
  // The view of an earlier argument when `x` is that very expression object; otherwise none. (Tensors read
  // in place need no sharing: their views point at the same memory anyway.)
  template <typename X, typename Earlier>
  static const InputView<Scalar>* shared(const X& x, const Earlier& earlier, const InputView<Scalar>& view) noexcept {
    if constexpr (!IsInPlace<X>::value && std::is_same<X, Earlier>::value) {
      if (&x == &earlier) return &view;
    }
    return nullptr;
  }

  InputView<Scalar> q_;
  // Plain members rather than std::optional: GCC 12 at -O3 reports a false -Wmaybe-uninitialized through
  // optional<InputView>::emplace. An unused view holds an empty tensor, which allocates nothing.
  InputView<Scalar> k_own_, v_own_;
  const InputView<Scalar>* k_ = nullptr;
  const InputView<Scalar>* v_ = nullptr;
};

}  // namespace detail
SDPA_NAMESPACE_END
