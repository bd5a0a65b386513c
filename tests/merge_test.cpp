// Tests of partial attention (AttentionOptions::log_sum_exp) and its merge (sdpa/merge.hpp), float and
// double:
//   - each row's log-sum-exp against a plain double reference (sinks, scale, fully masked rows: -inf, or the
//     sink), on the tiled, decoding and reference kernels, in both layouts;
//   - the merge of the attention over disjoint key sets equals one call over their union (to rounding), with
//     sinks given to one part, masks whose rows are hidden in one part or in all (under both MaskedRows
//     policies), two parts in place and as new tensors, three parts, one query (the decoding kernel);
//   - the module's step returns the log-sum-exp its causal forward gives the same rows;
//   - refusals: shapes that disagree, no parts, log_sum_exp with packed sequences or a PagedKVCache step.
#include "sdpa/attention.hpp"
#include "sdpa/cache/kv_cache.hpp"
#include "sdpa/cache/paged_kv_cache.hpp"
#include "sdpa/merge.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "support/reference.hpp"

namespace merge_test {

using Index = Eigen::Index;
using sdpa::Layout;
using sdpa::MaskedRows;
using sdpa_test::expect_invalid;
using sdpa_test::Rng;

template <typename T>
using T4 = Eigen::Tensor<T, 4, Eigen::RowMajor>;
template <typename T>
using T3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;
using Mask = Eigen::Tensor<bool, 4, Eigen::RowMajor>;

constexpr double kInf = std::numeric_limits<double>::infinity();

template <typename T>
double tolerance() {
  return std::is_same<T, float>::value ? 3e-5 : 1e-12;
}

// q (b, h, nq, d) and k, v (b, h, nk, d) in kBHND, or their kBNHD transposes; a mask (b, h, nq, nk) with a
// share of hidden keys, some rows hidden whole.
template <typename T>
struct Problem {
  Index b = 2, h = 3, nq = 9, nk = 70, d = 8;
  Layout layout = Layout::kBHND;
  T4<T> q, k, v;
  Mask mask;
  std::vector<T> sinks;

  Problem(Rng& rng, Index nq_, Index nk_, Layout layout_, bool with_sinks) : nq(nq_), nk(nk_), layout(layout_) {
    q = make(nq);
    k = make(nk);
    v = make(nk);
    rng.fill_normal(q);
    rng.fill_normal(k);
    rng.fill_normal(v);
    mask = Mask(b, h, nq, nk);
    for (Index i = 0; i < mask.size(); ++i) mask.data()[i] = rng.bernoulli(0.3);
    // Row 0 of (0, 0) hidden whole; row 1 of (0, 0) hidden in the first 40 keys only.
    for (Index j = 0; j < nk; ++j) mask(0, 0, 0, j) = true;
    if (nq > 1)
      for (Index j = 0; j < std::min<Index>(40, nk); ++j) mask(0, 0, 1, j) = true;
    if (with_sinks)
      for (Index i = 0; i < h; ++i) sinks.push_back(T(rng.normal()));
  }
  T4<T> make(Index n) const { return layout == Layout::kBHND ? T4<T>(b, h, n, d) : T4<T>(b, n, h, d); }
  T& at(T4<T>& x, Index bi, Index hi, Index i, Index c) const {
    return layout == Layout::kBHND ? x(bi, hi, i, c) : x(bi, i, hi, c);
  }
  // Keys [k0, k1) of k and v and the mask's columns for them.
  void slice(Index k0, Index k1, T4<T>& ks, T4<T>& vs, Mask& ms) {
    ks = make(k1 - k0);
    vs = make(k1 - k0);
    ms = Mask(b, h, nq, k1 - k0);
    for (Index bi = 0; bi < b; ++bi)
      for (Index hi = 0; hi < h; ++hi) {
        for (Index j = k0; j < k1; ++j)
          for (Index c = 0; c < d; ++c) {
            at(ks, bi, hi, j - k0, c) = at(k, bi, hi, j, c);
            at(vs, bi, hi, j - k0, c) = at(v, bi, hi, j, c);
          }
        for (Index i = 0; i < nq; ++i)
          for (Index j = k0; j < k1; ++j) ms(bi, hi, i, j - k0) = mask(bi, hi, i, j);
      }
  }
  // The log-sum-exp of row (bi, hi, i) in double: over its visible keys of [k0, k1), and the sink.
  double lse(Index bi, Index hi, Index i, bool sink) {
    std::vector<double> s;
    for (Index j = 0; j < nk; ++j) {
      if (mask(bi, hi, i, j)) continue;
      double x = 0;
      for (Index c = 0; c < d; ++c) x += double(at(q, bi, hi, i, c)) * double(at(k, bi, hi, j, c));
      s.push_back(x / std::sqrt(double(d)));
    }
    if (sink && !sinks.empty()) s.push_back(double(sinks[static_cast<std::size_t>(hi)]));
    if (s.empty()) return -kInf;
    const double m = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (double x : s) sum += std::exp(x - m);
    return m + std::log(sum);
  }
};

template <typename T>
sdpa::AttentionOptions<T> options_of(const Problem<T>& p, const Mask* mask, bool sinks, MaskedRows policy) {
  sdpa::AttentionOptions<T> o;
  o.layout = p.layout;
  o.attention_mask = mask;
  o.masked_rows = policy;
  if (sinks) o.sinks = p.sinks;
  return o;
}

// Same NaN positions, equal infinities, elsewhere within tol * (1 + |want|) (sdpa_test::close_elements).
template <typename T, int N>
::testing::AssertionResult close(const Eigen::Tensor<T, N, Eigen::RowMajor>& got,
                                 const Eigen::Tensor<T, N, Eigen::RowMajor>& want, double tol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  return sdpa_test::close_elements(got.data(), want.data(), static_cast<std::size_t>(got.size()), tol);
}

template <typename T>
class MergeTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MergeTest, Scalars);

TYPED_TEST(MergeTest, LogSumExpMatchesADoubleReference) {
  using T = TypeParam;
  Rng rng(5);
  for (Layout layout : {Layout::kBHND, Layout::kBNHD})
    for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kTiled, sdpa::Kernel::kReference})
      for (Index nq : {Index(1), Index(9)})
        for (bool sinks : {false, true}) {
          Problem<T> p(rng, nq, 70, layout, sinks);
          sdpa::AttentionOptions<T> o = options_of(p, &p.mask, sinks, MaskedRows::kZero);
          o.kernel = kernel;
          T3<T> lse;
          o.log_sum_exp = &lse;
          sdpa::attention(p.q, p.k, p.v, o);
          ASSERT_EQ(lse.dimension(0), p.b);
          ASSERT_EQ(lse.dimension(1), p.h);
          ASSERT_EQ(lse.dimension(2), nq);
          T3<T> want(p.b, p.h, nq);
          for (Index bi = 0; bi < p.b; ++bi)
            for (Index hi = 0; hi < p.h; ++hi)
              for (Index i = 0; i < nq; ++i) want(bi, hi, i) = T(p.lse(bi, hi, i, sinks));
          EXPECT_TRUE(close(lse, want, tolerance<T>())) << "nq " << nq << " sinks " << sinks;
          // Row 0 of (0, 0) sees no key: -inf, or its sink.
          EXPECT_EQ(lse(0, 0, 0), sinks ? p.sinks[0] : T(-kInf));
          // The state-keeping call gives the same.
          sdpa::AttentionState<T> state;
          T3<T> kept;
          o.log_sum_exp = &kept;
          sdpa::attention(p.q, p.k, p.v, o, state);
          EXPECT_TRUE(close(kept, lse, 0.0));
        }
}

// Keys split in [0, 25), [25, 70) (and [25, 40), [40, 70)): the parts merged equal one call over all keys.
TYPED_TEST(MergeTest, PartsOverDisjointKeysMergeIntoOneCall) {
  using T = TypeParam;
  Rng rng(9);
  for (Layout layout : {Layout::kBHND, Layout::kBNHD})
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN})
      for (Index nq : {Index(1), Index(9)})
        for (bool sinks : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << "layout " << int(layout) << " policy " << int(policy) << " nq " << nq << " sinks " << sinks);
          Problem<T> p(rng, nq, 70, layout, sinks);
          T3<T> want_lse;
          sdpa::AttentionOptions<T> whole = options_of(p, &p.mask, sinks, policy);
          whole.log_sum_exp = &want_lse;
          const T4<T> want = sdpa::attention(p.q, p.k, p.v, whole);
          const auto part = [&](Index k0, Index k1, bool with_sinks) {
            T4<T> ks, vs;
            Mask ms;
            p.slice(k0, k1, ks, vs, ms);
            sdpa::AttentionPart<T> r;
            sdpa::AttentionOptions<T> o = options_of(p, &ms, with_sinks, policy);
            o.log_sum_exp = &r.lse;
            r.out = sdpa::attention(p.q, ks, vs, o);
            return r;
          };
          const sdpa::MergeOptions mo{layout, policy, nullptr};
          // Two parts, the sinks in the second, into new tensors.
          const sdpa::AttentionPart<T> a = part(0, 25, false), b = part(25, 70, sinks);
          const sdpa::AttentionPart<T> ab = sdpa::merge_attention_states(a, b, mo);
          EXPECT_TRUE(close(ab.out, want, tolerance<T>()));
          EXPECT_TRUE(close(ab.lse, want_lse, tolerance<T>()));
          // In place, the sinks in the first.
          sdpa::AttentionPart<T> first = part(0, 25, sinks);
          const sdpa::AttentionPart<T> second = part(25, 70, false);
          sdpa::merge_attention_states(first.out, first.lse, second.out, second.lse, mo);
          EXPECT_TRUE(close(first.out, want, tolerance<T>()));
          EXPECT_TRUE(close(first.lse, want_lse, tolerance<T>()));
          // Three parts.
          const sdpa::AttentionPart<T> three = sdpa::merge_attention_states(
              std::vector<sdpa::AttentionPart<T>>{part(0, 25, false), part(25, 40, false), part(40, 70, sinks)}, mo);
          EXPECT_TRUE(close(three.out, want, tolerance<T>()));
          EXPECT_TRUE(close(three.lse, want_lse, tolerance<T>()));
          // Row 0 of (0, 0): no part saw a key; the policy's output (0 with a sink), as the one call gives.
          const T expect0 = !sinks && policy == MaskedRows::kNaN ? std::numeric_limits<T>::quiet_NaN() : T(0);
          const T got0 = ab.out(0, 0, 0, 0);  // (row 0 of head 0 of batch 0 in either layout)
          if (std::isnan(expect0))
            EXPECT_TRUE(std::isnan(got0));
          else
            EXPECT_EQ(got0, expect0);
        }
}

// The module's step over a cache returns each new row's log-sum-exp, as its causal forward gives it.
TEST(MergeModule, StepLogSumExpIsTheCausalForwards) {
  Rng rng(3);
  sdpa::ScaledDotProductAttention<double> att(16, 4, 4, 4, 0.0, 2);
  sdpa_test::randomize_module(att, rng);
  Eigen::Tensor<double, 3, Eigen::RowMajor> x(2, 11, 16);
  rng.fill_normal(x);
  sdpa::AttentionOptions<double> causal;
  causal.causal = true;
  T3<double> want;
  causal.log_sum_exp = &want;
  att.forward(x, x, x, causal);
  sdpa::KVCache<double> cache(att, 2, 16);
  const Eigen::array<Index, 3> first{{2, 8, 16}}, rest{{2, 3, 16}};
  att.step(Eigen::Tensor<double, 3, Eigen::RowMajor>(x.slice(Eigen::array<Index, 3>{{0, 0, 0}}, first)), cache);
  sdpa::AttentionOptions<double> o;
  T3<double> got;
  o.log_sum_exp = &got;
  att.step(Eigen::Tensor<double, 3, Eigen::RowMajor>(x.slice(Eigen::array<Index, 3>{{0, 8, 0}}, rest)), cache, o);
  ASSERT_EQ(got.dimension(0), 2);
  ASSERT_EQ(got.dimension(1), 4);
  ASSERT_EQ(got.dimension(2), 3);
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 4; ++h)
      for (Index i = 0; i < 3; ++i) EXPECT_NEAR(got(b, h, i), want(b, h, 8 + i), 1e-12) << b << " " << h << " " << i;
}

TEST(MergeRefusals, NameTheArgument) {
  T4<float> out(1, 2, 3, 4), other(1, 2, 3, 5);
  T3<float> lse(1, 2, 3), bad(1, 3, 2);
  out.setZero();
  other.setZero();
  lse.setZero();
  bad.setZero();
  expect_invalid([&] { sdpa::merge_attention_states(out, lse, other, lse); },
                 {"part 1's output shape", "(1, 2, 3, 4)", "(1, 2, 3, 5)"});
  expect_invalid([&] { sdpa::merge_attention_states(out, bad, out, lse); },
                 {"part 0's lse shape", "(1, 2, 3)", "(1, 3, 2)"});
  expect_invalid([&] { sdpa::merge_attention_states(std::vector<sdpa::AttentionPart<float>>{}); },
                 {"parts", "at least one"});
  // kBNHD reads (batch, nq, heads, d): lse must be (1, 3, 2) for out (1, 2, 3, 4).
  expect_invalid([&] { sdpa::merge_attention_states(out, lse, out, lse, sdpa::MergeOptions{Layout::kBNHD}); },
                 {"lse shape", "(1, 3, 2)", "kBNHD"});

  // log_sum_exp where it has no form: packed sequences, a PagedKVCache step.
  T4<float> q(1, 2, 6, 4), k(1, 2, 6, 4);
  q.setZero();
  k.setZero();
  T3<float> l;
  sdpa::AttentionOptions<float> packed;
  packed.cu_seqlens_q = {0, 6};
  packed.cu_seqlens_k = {0, 6};
  packed.log_sum_exp = &l;
  Eigen::Tensor<float, 3, Eigen::RowMajor> qv(6, 2, 4), kv(6, 2, 4);
  qv.setZero();
  kv.setZero();
  expect_invalid([&] { sdpa::attention_varlen(qv, kv, kv, packed); }, {"log_sum_exp", "packed"});
  sdpa::ScaledDotProductAttention<float> att(8, 2, 2, 2);
  sdpa::PagedKVCache<float> paged(att, 16, 8);
  const auto id = paged.add_sequence();
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(1, 1, 8);
  x.setZero();
  sdpa::AttentionOptions<float> o;
  o.log_sum_exp = &l;
  expect_invalid([&] { att.step(x, paged, {id}, o); }, {"log_sum_exp", "PagedKVCache"});
}

}  // namespace merge_test
