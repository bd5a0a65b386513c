// What a score function (sdpa/flex.hpp) computes with: its score argument is a Scalar in the forward pass
// and a flex::Dual in the backward pass, which carries, beside the value, its derivatives with respect to the
// score and to each ScoreTable entry the function read (forward-mode differentiation with a few tangents).
// A score function written generically (`auto s` or a template over S) and built from the operators and the
// functions of namespace sdpa::flex below (exp, log, tanh, sigmoid, abs, sqrt, min, max) serves both.
//
// ScoreTable is a learnable tensor a score function reads (T5's relative-position buckets, per-head
// biases): `table.at(s, i, j)` gives entry (i, j) as the type of s; in the backward pass the read is
// recorded, so that attention_backward returns the table's gradient.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "sdpa/error.hpp"

SDPA_NAMESPACE_BEGIN
namespace flex {

// A value and its derivatives: d[0] with respect to the score the function was given, d[1 ..] with respect
// to the table entries it read, in the order it read them (at most kTangents - 1 reads per score).
template <typename Scalar>
struct Dual {
  static constexpr int kTangents = 4;
  Scalar v = Scalar(0);
  std::array<Scalar, kTangents> d{};

  Dual() = default;
  Dual(Scalar value) : v(value) {}  // a constant (implicit: s + 1.5 reads as in plain arithmetic)
  static Dual variable(Scalar value, int tangent) {
    Dual x(value);
    x.d[static_cast<std::size_t>(tangent)] = Scalar(1);
    return x;
  }
  Scalar value() const noexcept { return v; }

  // f(x) with f'(x) = slope: the chain rule on every tangent.
  Dual apply(Scalar value, Scalar slope) const noexcept {
    Dual r(value);
    for (std::size_t i = 0; i < d.size(); ++i) r.d[i] = slope * d[i];
    return r;
  }

  Dual& operator+=(const Dual& o) noexcept { return *this = *this + o; }
  Dual& operator-=(const Dual& o) noexcept { return *this = *this - o; }
  Dual& operator*=(const Dual& o) noexcept { return *this = *this * o; }
  Dual& operator/=(const Dual& o) noexcept { return *this = *this / o; }

  friend Dual operator+(const Dual& a) noexcept { return a; }
  friend Dual operator-(const Dual& a) noexcept { return a.apply(-a.v, Scalar(-1)); }
  friend Dual operator+(const Dual& a, const Dual& b) noexcept {
    Dual r(a.v + b.v);
    for (std::size_t i = 0; i < r.d.size(); ++i) r.d[i] = a.d[i] + b.d[i];
    return r;
  }
  friend Dual operator-(const Dual& a, const Dual& b) noexcept {
    Dual r(a.v - b.v);
    for (std::size_t i = 0; i < r.d.size(); ++i) r.d[i] = a.d[i] - b.d[i];
    return r;
  }
  friend Dual operator*(const Dual& a, const Dual& b) noexcept {
    Dual r(a.v * b.v);
    for (std::size_t i = 0; i < r.d.size(); ++i) r.d[i] = a.d[i] * b.v + a.v * b.d[i];
    return r;
  }
  friend Dual operator/(const Dual& a, const Dual& b) noexcept {
    Dual r(a.v / b.v);
    const Scalar inv = Scalar(1) / b.v;
    for (std::size_t i = 0; i < r.d.size(); ++i) r.d[i] = (a.d[i] - r.v * b.d[i]) * inv;
    return r;
  }
  // Comparisons read the values (a branch in a score function picks a piece; its derivative is that
  // piece's).
  friend bool operator<(const Dual& a, const Dual& b) noexcept { return a.v < b.v; }
  friend bool operator>(const Dual& a, const Dual& b) noexcept { return a.v > b.v; }
  friend bool operator<=(const Dual& a, const Dual& b) noexcept { return a.v <= b.v; }
  friend bool operator>=(const Dual& a, const Dual& b) noexcept { return a.v >= b.v; }
  friend bool operator==(const Dual& a, const Dual& b) noexcept { return a.v == b.v; }
  friend bool operator!=(const Dual& a, const Dual& b) noexcept { return a.v != b.v; }
};

// Mixed arithmetic with plain numbers of any arithmetic type (a double literal beside a float Dual).
#define SDPA_FLEX_DUAL_MIXED(OP)                                                                              \
  template <typename Scalar, typename T, typename = std::enable_if_t<std::is_arithmetic<T>::value>>          \
  auto operator OP(const Dual<Scalar>& a, T b) noexcept {                                                     \
    return a OP Dual<Scalar>(static_cast<Scalar>(b));                                                         \
  }                                                                                                           \
  template <typename Scalar, typename T, typename = std::enable_if_t<std::is_arithmetic<T>::value>>          \
  auto operator OP(T a, const Dual<Scalar>& b) noexcept {                                                     \
    return Dual<Scalar>(static_cast<Scalar>(a)) OP b;                                                         \
  }
SDPA_FLEX_DUAL_MIXED(+)
SDPA_FLEX_DUAL_MIXED(-)
SDPA_FLEX_DUAL_MIXED(*)
SDPA_FLEX_DUAL_MIXED(/)
SDPA_FLEX_DUAL_MIXED(<)
SDPA_FLEX_DUAL_MIXED(>)
SDPA_FLEX_DUAL_MIXED(<=)
SDPA_FLEX_DUAL_MIXED(>=)
SDPA_FLEX_DUAL_MIXED(==)
SDPA_FLEX_DUAL_MIXED(!=)
#undef SDPA_FLEX_DUAL_MIXED

template <typename T>
struct is_dual : std::false_type {};
template <typename Scalar>
struct is_dual<Dual<Scalar>> : std::true_type {};

// The functions a score function may call, for plain numbers and duals alike.
template <typename T>
T exp(const T& x) {
  if constexpr (is_dual<T>::value) {
    const auto e = std::exp(x.v);
    return x.apply(e, e);
  } else {
    return std::exp(x);
  }
}
template <typename T>
T log(const T& x) {
  if constexpr (is_dual<T>::value) return x.apply(std::log(x.v), 1 / x.v);
  else return std::log(x);
}
template <typename T>
T tanh(const T& x) {
  if constexpr (is_dual<T>::value) {
    const auto t = std::tanh(x.v);
    return x.apply(t, 1 - t * t);
  } else {
    return std::tanh(x);
  }
}
template <typename T>
T sigmoid(const T& x) {
  if constexpr (is_dual<T>::value) {
    const auto s = 1 / (1 + std::exp(-x.v));
    return x.apply(s, s * (1 - s));
  } else {
    return 1 / (1 + std::exp(-x));
  }
}
template <typename T>
T abs(const T& x) {
  if constexpr (is_dual<T>::value) return x.v < 0 ? -x : x;
  else return std::abs(x);
}
template <typename T>
T sqrt(const T& x) {
  if constexpr (is_dual<T>::value) {
    const auto r = std::sqrt(x.v);
    return x.apply(r, 1 / (2 * r));
  } else {
    return std::sqrt(x);
  }
}
template <typename T>
T min(const T& a, const T& b) {
  return b < a ? b : a;
}
template <typename T>
T max(const T& a, const T& b) {
  return a < b ? b : a;
}

namespace detail {

// The reads of ScoreTable entries during one evaluation of a score function in the backward pass (per
// thread): which table, which entry, and which tangent of the result holds its derivative.
struct TableTape {
  static constexpr int kReads = Dual<float>::kTangents - 1;
  bool recording = false;
  int reads = 0;
  bool overflow = false;  // more reads than tangents: the backward refuses the function
  std::array<const void*, kReads> table{};
  std::array<Eigen::Index, kReads> index{};

  void start() noexcept {
    recording = true;
    reads = 0;
  }
};

inline TableTape& table_tape() noexcept {
  static thread_local TableTape tape;
  return tape;
}

}  // namespace detail

// A learnable (rows, cols) table a score function reads; row-major. Reads outside it give NaN (the row of
// the score that asked becomes NaN: visible, never a read out of bounds).
template <typename Scalar>
class ScoreTable {
 public:
  using Index = Eigen::Index;
  using Values = Eigen::Tensor<Scalar, 2, Eigen::RowMajor>;

  ScoreTable() = default;
  ScoreTable(Index rows, Index cols, Scalar fill = Scalar(0)) : values_(checked(rows, "rows"), checked(cols, "cols")) {
    values_.setConstant(fill);
  }
  explicit ScoreTable(const Values& values) : values_(values) {}

  Index rows() const noexcept { return values_.dimension(0); }
  Index cols() const noexcept { return values_.dimension(1); }
  Index size() const noexcept { return values_.size(); }
  Values& values() noexcept { return values_; }
  const Values& values() const noexcept { return values_; }
  Scalar& operator()(Index i, Index j) noexcept { return values_(i, j); }
  Scalar operator()(Index i, Index j) const noexcept { return values_(i, j); }

  // Entry (i, j) as the type of `like` (the score): a plain number in the forward pass; in the backward
  // pass a dual whose tangent for this read is 1, and the read recorded for the table's gradient.
  template <typename S>
  S at(const S& like, Index i, Index j) const noexcept {
    (void)like;
    const bool inside = i >= 0 && i < rows() && j >= 0 && j < cols();
    const Scalar x = inside ? values_(i, j) : std::numeric_limits<Scalar>::quiet_NaN();
    if constexpr (is_dual<S>::value) {
      detail::TableTape& tape = detail::table_tape();
      if (!tape.recording || !inside) return S(x);
      if (tape.reads == detail::TableTape::kReads) {
        tape.overflow = true;
        return S(x);
      }
      const int slot = tape.reads++;
      tape.table[static_cast<std::size_t>(slot)] = this;
      tape.index[static_cast<std::size_t>(slot)] = i * cols() + j;
      return S::variable(x, slot + 1);
    } else {
      return static_cast<S>(x);
    }
  }

 private:
  static Index checked(Index n, const char* what) {
    if (n < 0) sdpa::detail::throw_invalid("ScoreTable", what, "non-negative", n);
    return n;
  }
  Values values_;
};

}  // namespace flex
SDPA_NAMESPACE_END
