// The built-in score functions of programmable attention (sdpa/flex.hpp): T5's relative position buckets,
// a learnable distance bias, ALiBi and the logit softcap, each with a row form for the forward pass.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdpa/error.hpp"
#include "sdpa/flex/block_mask.hpp"
#include "sdpa/flex/dual.hpp"
#include "sdpa/flex/score_program.hpp"
#include "sdpa/flex/traits.hpp"

SDPA_NAMESPACE_BEGIN
namespace flex {

// ---- Score functions ----
// row(y, m, b, h, q, k0) (optional): y[j] = f(y[j], b, h, q, k0 + j) for j < m, bit for bit as the function
// gives them, a row at a time (the forward pass uses it; the backward pass calls the function per score).

// T5's relative position buckets (transformers' T5Attention._relative_position_bucket of k - q, float32
// logarithms as it computes them): s + table(h, bucket). The table is (heads, num_buckets) and learnable.
// The buckets of every distance up to max_distance are computed once, when the function is made (beyond
// it the bucket is the last one, max_distance > the exact buckets being required).
template <typename Scalar>
struct t5_buckets {
  const ScoreTable<Scalar>* table = nullptr;
  bool bidirectional = true;
  Index num_buckets = 32, max_distance = 128;
  std::shared_ptr<const std::vector<std::int32_t>> lookup;  // bucket of distance r at r + max_distance
  const std::int32_t* buckets = nullptr;                      // lookup->data()

  t5_buckets() = default;
  t5_buckets(const ScoreTable<Scalar>* table_, bool bidirectional_, Index num_buckets_, Index max_distance_)
      : table(table_), bidirectional(bidirectional_), num_buckets(num_buckets_), max_distance(max_distance_) {
    const char* where = "flex::t5_buckets";
    if (num_buckets < 2 || (bidirectional && num_buckets < 4))
      sdpa::detail::throw_invalid(where, "num_buckets", bidirectional ? "at least 4" : "at least 2", num_buckets);
    const Index exact = (bidirectional ? num_buckets / 2 : num_buckets) / 2;
    if (max_distance <= exact)
      sdpa::detail::throw_invalid(where, "max_distance", sdpa::detail::concat("more than the exact buckets, ", exact), max_distance);
    auto l = std::make_shared<std::vector<std::int32_t>>(static_cast<std::size_t>(2 * max_distance + 1));
    for (Index r = -max_distance; r <= max_distance; ++r) (*l)[static_cast<std::size_t>(r + max_distance)] = static_cast<std::int32_t>(bucket(r));
    lookup = std::move(l);
    buckets = lookup->data();
  }

  // The bucket of relative position k - q, by transformers' formula.
  Index bucket(Index relative) const noexcept {
    Index half = num_buckets, result = 0;
    if (bidirectional) {
      half /= 2;
      if (relative > 0) result += half;
      relative = relative < 0 ? -relative : relative;
    } else {
      relative = relative < 0 ? -relative : 0;
    }
    const Index exact = half / 2;
    if (relative < exact) return result + relative;
    const float scaled = std::log(static_cast<float>(relative) / static_cast<float>(exact)) /
                         static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(exact))) *
                         static_cast<float>(half - exact);
    return result + std::min<Index>(exact + static_cast<Index>(scaled), half - 1);
  }
  template <typename S>
  S operator()(S s, Index, Index h, Index q, Index k) const noexcept {
    const Index r = std::clamp(k - q, -max_distance, max_distance);
    return s + table->at(s, h, buckets[r + max_distance]);
  }
  // Keys at max_distance or more on either side share the last bucket: two constant runs and the buckets
  // between them.
  void row(Scalar* y, Index m, Index b, Index h, Index q, Index k0) const noexcept {
    if (h < 0 || h >= table->rows() || table->cols() < num_buckets) {
      for (Index j = 0; j < m; ++j) y[j] = (*this)(y[j], b, h, q, k0 + j);
      return;
    }
    const Scalar* t = table->values().data() + h * table->cols();
    const std::int32_t* at = buckets + max_distance;  // the bucket of distance r at at[r]
    detail::distance_runs(y, m, k0 - q, max_distance, t[at[-max_distance]], t[at[max_distance]],
                          [t, at](Index r) { return t[at[r]]; });
  }
  std::vector<const ScoreTable<Scalar>*> tables() const { return {table}; }
  void check(const char* where, Index, Index heads, Index, Index) const {
    if (table == nullptr || buckets == nullptr) sdpa::detail::throw_invalid(where, "flex::t5_buckets::table", "a ScoreTable", "null");
    if (table->rows() != heads || table->cols() != num_buckets)
      sdpa::detail::throw_invalid(where, "flex::t5_buckets' table", sdpa::detail::concat("of shape (heads, num_buckets) = (", heads, ", ", num_buckets, ")"),
                                  sdpa::detail::concat("(", table->rows(), ", ", table->cols(), ")"));
  }
};

// A learned bias per (head, distance): s + table(h, clamp(k - q, -radius, radius) + radius), the table
// (heads, 2 radius + 1).
template <typename Scalar>
struct distance_bias {
  const ScoreTable<Scalar>* table = nullptr;
  Index radius = 0;

  template <typename S>
  S operator()(S s, Index, Index h, Index q, Index k) const noexcept {
    return s + table->at(s, h, std::clamp(k - q, -radius, radius) + radius);
  }
  void row(Scalar* y, Index m, Index b, Index h, Index q, Index k0) const noexcept {
    if (h < 0 || h >= table->rows() || radius < 0 || table->cols() < 2 * radius + 1) {
      for (Index j = 0; j < m; ++j) y[j] = (*this)(y[j], b, h, q, k0 + j);
      return;
    }
    const Scalar* t = table->values().data() + h * table->cols() + radius;  // distance r at t[r]
    detail::distance_runs(y, m, k0 - q, radius, t[-radius], t[radius], [t](Index r) { return t[r]; });
  }
  std::vector<const ScoreTable<Scalar>*> tables() const { return {table}; }
  void check(const char* where, Index, Index heads, Index, Index) const {
    if (table == nullptr) sdpa::detail::throw_invalid(where, "flex::distance_bias::table", "a ScoreTable", "null");
    if (table->rows() != heads || table->cols() != 2 * radius + 1)
      sdpa::detail::throw_invalid(where, "flex::distance_bias' table",
                                  sdpa::detail::concat("of shape (heads, 2 radius + 1) = (", heads, ", ", 2 * radius + 1, ")"),
                                  sdpa::detail::concat("(", table->rows(), ", ", table->cols(), ")"));
  }
};

// ALiBi as a score function: s - slopes[h] |q - k| (AttentionOptions::alibi_slopes' twin).
template <typename Scalar>
struct alibi {
  std::shared_ptr<const std::vector<Scalar>> slopes;

  alibi() = default;
  explicit alibi(std::vector<Scalar> s) : slopes(std::make_shared<const std::vector<Scalar>>(std::move(s))) {}
  template <typename S>
  S operator()(S s, Index, Index h, Index q, Index k) const noexcept {
    const Index d = q - k;
    return s - (*slopes)[static_cast<std::size_t>(h)] * static_cast<Scalar>(d < 0 ? -d : d);
  }
  void check(const char* where, Index, Index heads, Index, Index) const {
    const Index n = slopes ? static_cast<Index>(slopes->size()) : 0;
    if (n != heads) sdpa::detail::throw_invalid(where, "flex::alibi's slopes", sdpa::detail::concat("one per query head (", heads, ")"), n);
  }
};

// The softcap as a score function: cap tanh(s / cap) (AttentionOptions::softcap's twin).
template <typename Scalar>
struct softcap {
  Scalar cap = Scalar(1);
  template <typename S>
  S operator()(S s, Index, Index, Index, Index) const noexcept {
    return cap * flex::tanh(s / cap);
  }
  void check(const char* where, Index, Index, Index, Index) const {
    if (!(std::isfinite(cap) && cap > Scalar(0))) sdpa::detail::throw_invalid(where, "flex::softcap::cap", "finite and positive", cap);
  }
};

}  // namespace flex
SDPA_NAMESPACE_END
