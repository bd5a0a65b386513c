// Tests of sdpa/options.hpp through the module (float and double): every AttentionOptions field and pairs
// of them against the plain double reference of tests/support/reference.hpp (which applies each option by
// its definition, score by score), in both kernels, both masked-row policies, on 1 and 2 threads; causal
// with nq < nk and nq > nk; windows left only, right only, both, and 0; key lengths with 0 and nk; every
// broadcast form of attention_bias; ALiBi; probabilities (rows sum to 1, hidden keys exactly 0, equal to
// the reference softmax, the policy in fully hidden rows); dropout with options (the same elements as the
// reference kernel); key_lengths against the equivalent key_padding_mask; causal against causal_mask when
// nq == nk; the refusal of every bad option by its field name before any work; and alibi_slopes against the
// ALiBi paper's definition.
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "support/reference.hpp"

namespace options_test {

using Index = Eigen::Index;
using sdpa::MaskedRows;
using sdpa_test::Array3;
using sdpa_test::expect_invalid;
using sdpa_test::max_relative_error;
using sdpa_test::Rng;
using Mask = Eigen::Tensor<bool, 4, Eigen::RowMajor>;

template <typename T>
class OptionsTest : public ::testing::Test {
 protected:
  using Module = sdpa::ScaledDotProductAttention<T>;
  using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;
  using Tensor4 = Eigen::Tensor<T, 4, Eigen::RowMajor>;
  using Options = sdpa::AttentionOptions<T>;
  static constexpr bool kFloat = std::is_same<T, float>::value;
  static double tol() { return kFloat ? 2e-5 : 1e-10; }

  static Tensor3 random3(Rng& rng, Index a, Index b, Index c) {
    Tensor3 t(a, b, c);
    rng.fill_normal(t);
    return t;
  }
  static Tensor4 random4(Rng& rng, const std::array<Index, 4>& d, double lo, double hi) {
    Tensor4 t(d[0], d[1], d[2], d[3]);
    for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(rng.uniform(lo, hi));
    return t;
  }
  static Module make_module(Rng& rng, Index d_model, Index d_k, Index d_v, Index h) {
    Module m(d_model, d_k, d_v, h);
    m.eval();
    sdpa_test::randomize_module(m, rng, 0.3);
    return m;
  }

  // The module (both kernels, 1 and 2 threads, with and without probabilities) against the reference.
  static void check(Module& m, const Tensor3& q, const Tensor3& k, const Tensor3& v, Options o, const std::string& what) {
    SCOPED_TRACE(what);
    std::vector<double> want_probs;
    const Array3 want = sdpa_test::reference_forward_with(m, q, k, v, o, &want_probs);
    Eigen::ThreadPool pool(2);
    Eigen::ThreadPoolDevice device(&pool, 2);
    for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kReference}) {
      m.set_kernel(kernel);
      const Eigen::ThreadPoolDevice* devices[2] = {nullptr, &device};
      for (const Eigen::ThreadPoolDevice* d : devices) {
        SCOPED_TRACE(::testing::Message() << (kernel == sdpa::Kernel::kAuto ? "tiled" : "reference")
                                          << (d ? ", 2 threads" : ", 1 thread"));
        o.device = d;
        o.probabilities = nullptr;
        const Tensor3 out = m.forward(q, k, v, o);
        EXPECT_LT(max_relative_error(out, want), tol());
        Tensor4 probs;
        o.probabilities = &probs;
        const Tensor3 out2 = m.forward(q, k, v, o);
        EXPECT_LT(max_relative_error(out2, want), tol());
        ASSERT_EQ(probs.dimension(0), q.dimension(0));
        ASSERT_EQ(probs.dimension(1), m.h());
        ASSERT_EQ(probs.dimension(2), q.dimension(1));
        ASSERT_EQ(probs.dimension(3), k.dimension(1));
        expect_probabilities(probs, want_probs, m.masked_rows());
      }
    }
    m.set_kernel(sdpa::Kernel::kAuto);
  }

  // Equal to the reference softmax; rows sum to 1 or are all 0 (kZero) / all NaN (kNaN) when fully hidden;
  // hidden keys exactly 0.
  static void expect_probabilities(const Tensor4& got, const std::vector<double>& want, MaskedRows policy) {
    ASSERT_EQ(static_cast<std::size_t>(got.size()), want.size());
    const Index nk = got.dimension(3), rows = got.size() / std::max<Index>(nk, 1);
    for (Index r = 0; r < rows; ++r) {
      double sum = 0;
      bool any_nan = false;
      for (Index j = 0; j < nk; ++j) {
        const double g = static_cast<double>(got.data()[r * nk + j]), w = want[static_cast<std::size_t>(r * nk + j)];
        if (std::isnan(w)) {
          ASSERT_TRUE(std::isnan(g)) << "row " << r << " key " << j;
          any_nan = true;
          continue;
        }
        if (w == 0.0) {
          ASSERT_EQ(g, 0.0) << "row " << r << " key " << j << ": a hidden key must be exactly 0";
        }
        ASSERT_NEAR(g, w, kFloat ? 2e-6 : 1e-12) << "row " << r << " key " << j;
        sum += g;
      }
      if (any_nan) {
        EXPECT_EQ(policy, MaskedRows::kNaN) << "row " << r;
      } else if (sum != 0.0) {
        EXPECT_NEAR(sum, 1.0, kFloat ? 1e-5 : 1e-12) << "row " << r;
      }
    }
  }
};

using ScalarTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(OptionsTest, ScalarTypes);

TYPED_TEST(OptionsTest, CausalWithEveryRatioOfQueriesToKeys) {
  Rng rng(1);
  auto m = TestFixture::make_module(rng, 16, 4, 3, 2);
  // nq == nk, nq < nk (a cache: the last query sees every key), nq > nk (the first queries see no key).
  for (const std::array<Index, 2> n : {std::array<Index, 2>{9, 9}, {4, 11}, {11, 4}, {1, 7}, {7, 1}}) {
    const auto q = TestFixture::random3(rng, 2, n[0], 16), k = TestFixture::random3(rng, 2, n[1], 16);
    typename TestFixture::Options o;
    o.causal = true;
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
      m.set_masked_rows(policy);
      TestFixture::check(m, q, k, k, o, "causal nq " + std::to_string(n[0]) + " nk " + std::to_string(n[1]));
    }
  }
}

TYPED_TEST(OptionsTest, WindowsLeftRightBothAndZero) {
  Rng rng(2);
  auto m = TestFixture::make_module(rng, 16, 4, 3, 2);
  const auto x = TestFixture::random3(rng, 2, 13, 16), kv = TestFixture::random3(rng, 2, 17, 16);
  const std::array<Index, 3> cases[] = {{3, -1, 0}, {-1, 2, 0}, {2, 3, 0}, {0, 0, 0}, {0, -1, 1}, {4, -1, 1},
                                        {-1, 0, 0}, {100, 100, 0}, {5, 1, 1}};
  for (const auto& c : cases) {
    typename TestFixture::Options o;
    o.window_left = c[0];
    o.window_right = c[1];
    o.causal = c[2] != 0;
    const std::string what = "window " + std::to_string(c[0]) + "/" + std::to_string(c[1]) + (c[2] ? " causal" : "");
    TestFixture::check(m, x, x, x, o, what + " self");
    TestFixture::check(m, x, kv, kv, o, what + " nq < nk");
  }
}

TYPED_TEST(OptionsTest, KeyLengthsIncludingZeroAndFull) {
  Rng rng(3);
  auto m = TestFixture::make_module(rng, 16, 4, 3, 2);
  const auto q = TestFixture::random3(rng, 4, 6, 16), k = TestFixture::random3(rng, 4, 10, 16);
  typename TestFixture::Options o;
  o.key_lengths = {10, 0, 3, 7};
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
    m.set_masked_rows(policy);
    TestFixture::check(m, q, k, k, o, "key lengths");
  }
  // The same output as the equivalent key_padding_mask tensor.
  m.set_masked_rows(MaskedRows::kZero);
  const Mask pad = sdpa::key_padding_mask(o.key_lengths, 10);
  const auto by_lengths = m.forward(q, k, k, o);
  const auto by_mask = m.forward(q, k, k, &pad);
  EXPECT_LT(max_relative_error(by_lengths, sdpa_test::to_array3(by_mask)), TestFixture::kFloat ? 1e-6 : 1e-14);
}

// Keys past a batch entry's length are neither projected nor read: NaN in their inputs changes nothing (for
// queries whose own input is finite), in the fused self-attention pass and in the separate key/value ones.
TYPED_TEST(OptionsTest, KeysPastTheirLengthAreNotRead) {
  using T = TypeParam;
  Rng rng(11);
  auto m = TestFixture::make_module(rng, 16, 4, 3, 2);
  const Index n = 12;
  const std::vector<Index> lengths{12, 5, 0};
  auto x = TestFixture::random3(rng, 3, n, 16);
  const auto q = TestFixture::random3(rng, 3, 4, 16);
  typename TestFixture::Options o;
  o.key_lengths = lengths;
  const auto clean_self = m.forward(x, x, x, o), clean_cross = m.forward(q, x, x, o);
  for (Index b = 0; b < 3; ++b)
    for (Index j = lengths[static_cast<std::size_t>(b)]; j < n; ++j)
      for (Index d = 0; d < 16; ++d) x(b, j, d) = std::numeric_limits<T>::quiet_NaN();
  const auto self = m.forward(x, x, x, o), cross = m.forward(q, x, x, o);
  for (Index i = 0; i < cross.size(); ++i) ASSERT_EQ(cross.data()[i], clean_cross.data()[i]) << i;
  for (Index b = 0; b < 3; ++b)
    for (Index i = 0; i < lengths[static_cast<std::size_t>(b)]; ++i)
      for (Index d = 0; d < 16; ++d) ASSERT_EQ(self(b, i, d), clean_self(b, i, d)) << b << " " << i << " " << d;
}

TYPED_TEST(OptionsTest, EveryBiasBroadcastForm) {
  Rng rng(4);
  auto m = TestFixture::make_module(rng, 12, 3, 4, 3);
  const auto q = TestFixture::random3(rng, 2, 5, 12), k = TestFixture::random3(rng, 2, 7, 12);
  const std::array<Index, 4> full{2, 3, 5, 7};
  for (int form = 0; form < 16; ++form) {
    std::array<Index, 4> d{};
    for (std::size_t i = 0; i < 4; ++i) d[i] = ((form >> (3 - i)) & 1) ? full[i] : 1;
    const auto bias = TestFixture::random4(rng, d, -3.0, 3.0);
    typename TestFixture::Options o;
    o.attention_bias = &bias;
    TestFixture::check(m, q, k, k, o, "bias form " + std::to_string(form));
  }
}

TYPED_TEST(OptionsTest, AlibiAgainstTheFormula) {
  Rng rng(5);
  auto m = TestFixture::make_module(rng, 16, 4, 4, 4);
  const auto x = TestFixture::random3(rng, 2, 11, 16), kv = TestFixture::random3(rng, 2, 15, 16);
  typename TestFixture::Options o;
  o.alibi_slopes = sdpa::alibi_slopes<TypeParam>(4);
  TestFixture::check(m, x, x, x, o, "alibi");
  TestFixture::check(m, x, kv, kv, o, "alibi nq < nk");
  o.causal = true;
  TestFixture::check(m, x, x, x, o, "alibi causal");
  // ALiBi changes the output (the slopes are large enough to matter here).
  typename TestFixture::Options plain;
  plain.causal = true;
  EXPECT_GT(max_relative_error(m.forward(x, x, x, o), sdpa_test::to_array3(m.forward(x, x, x, plain))), 1e-3);
}

// Pairs of options, and every option at once, with a mask and weights too, in both policies.
TYPED_TEST(OptionsTest, CombinationsOfOptions) {
  Rng rng(6);
  auto m = TestFixture::make_module(rng, 16, 4, 3, 4);
  const Index nq = 9, nk = 14;
  const auto q = TestFixture::random3(rng, 3, nq, 16), k = TestFixture::random3(rng, 3, nk, 16);
  Mask mask(3, 1, nq, nk);
  for (Index i = 0; i < mask.size(); ++i) mask.data()[i] = rng.bernoulli(0.2);
  for (Index j = 0; j < nk; ++j) mask(1, 0, 2, j) = true;  // a row the mask hides entirely
  const auto weights = TestFixture::random4(rng, {1, 4, nq, nk}, 0.2, 2.0);
  const auto bias = TestFixture::random4(rng, {3, 4, 1, nk}, -2.0, 2.0);
  const auto slopes = sdpa::alibi_slopes<TypeParam>(4);
  for (int combo = 0; combo < 64; ++combo) {
    typename TestFixture::Options o;
    std::string what = "combo";
    if (combo & 1) { o.causal = true; what += " causal"; }
    if (combo & 2) { o.window_left = 3; what += " left"; }
    if (combo & 4) { o.window_right = 2; what += " right"; }
    if (combo & 8) { o.key_lengths = {14, 5, 0}; what += " lengths"; }
    if (combo & 16) { o.attention_bias = &bias; o.alibi_slopes = slopes; what += " bias+alibi"; }
    if (combo & 32) { o.attention_mask = &mask; o.attention_weights = &weights; what += " mask+weights"; }
    if (__builtin_popcount(static_cast<unsigned>(combo)) > 2 && combo != 63) continue;  // pairs, and all
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
      m.set_masked_rows(policy);
      TestFixture::check(m, q, k, k, o, what);
    }
  }
}

// The options' rules at block boundaries of the tiled kernel: lengths around its key and query blocks.
TYPED_TEST(OptionsTest, BlockBoundaryLengths) {
  Rng rng(7);
  auto m = TestFixture::make_module(rng, 8, 8, 8, 1);
  const sdpa::kernels::TileConfig c = sdpa::kernels::TileConfig::for_problem<TypeParam>(8, 8);
  for (Index n : {c.block_k - 1, c.block_k, c.block_k + 1, c.block_q + 1}) {
    const auto x = TestFixture::random3(rng, 1, n, 8);
    typename TestFixture::Options o;
    o.causal = true;
    o.window_left = c.block_k / 2;
    o.alibi_slopes = {TypeParam(0.25)};
    TestFixture::check(m, x, x, x, o, "n " + std::to_string(n));
  }
}

// Training-mode dropout with options drops the same elements in both kernels (the reference kernel asks
// the same counter-based sampler for every element).
TYPED_TEST(OptionsTest, DropoutWithOptionsDropsTheSameElementsInBothKernels) {
  using T = TypeParam;
  Rng rng(8);
  typename TestFixture::Module m(16, 4, 3, 2, T(0.4));
  sdpa_test::randomize_module(m, rng, 0.3);
  const auto x = TestFixture::random3(rng, 2, 21, 16);
  typename TestFixture::Options o;
  o.causal = true;
  o.window_left = 6;
  o.alibi_slopes = sdpa::alibi_slopes<T>(2);
  o.key_lengths = {21, 15};
  typename TestFixture::Tensor4 p_tiled, p_ref;
  m.manual_seed(4);
  o.probabilities = &p_tiled;
  const auto tiled = m.forward(x, x, x, o);
  m.manual_seed(4);
  m.set_kernel(sdpa::Kernel::kReference);
  o.probabilities = &p_ref;
  const auto ref = m.forward(x, x, x, o);
  EXPECT_LT(max_relative_error(tiled, sdpa_test::to_array3(ref)), TestFixture::tol());
  // Probabilities are before dropout: the same with and without it.
  for (Index i = 0; i < p_tiled.size(); ++i) ASSERT_NEAR(p_tiled.data()[i], p_ref.data()[i], 1e-5) << i;
  m.eval();
  typename TestFixture::Tensor4 p_eval;
  o.probabilities = &p_eval;
  (void)m.forward(x, x, x, o);
  for (Index i = 0; i < p_eval.size(); ++i) ASSERT_NEAR(p_eval.data()[i], p_ref.data()[i], 1e-5) << i;
}

// causal = true equals causal_mask(n, n) when nq == nk (both top-left and lower-right then).
TYPED_TEST(OptionsTest, CausalEqualsCausalMaskForSquareProblems) {
  Rng rng(9);
  auto m = TestFixture::make_module(rng, 16, 8, 8, 2);
  const auto x = TestFixture::random3(rng, 2, 40, 16);
  typename TestFixture::Options o;
  o.causal = true;
  const Mask mask = sdpa::causal_mask(40, 40);
  EXPECT_LT(max_relative_error(m.forward(x, x, x, o), sdpa_test::to_array3(m.forward(x, x, x, &mask))),
            TestFixture::kFloat ? 1e-6 : 1e-14);
}

// Each bad option is refused with std::invalid_argument naming the field, before any work: probabilities
// is neither resized nor written, and no dropout draw is taken.
TYPED_TEST(OptionsTest, BadOptionsAreRefusedByName) {
  using T = TypeParam;
  Rng rng(10);
  typename TestFixture::Module m(8, 4, 4, 2, T(0.5));
  m.manual_seed(3);
  typename TestFixture::Module twin(m);
  twin.manual_seed(3);
  const auto q = TestFixture::random3(rng, 2, 3, 8), k = TestFixture::random3(rng, 2, 5, 8);
  typename TestFixture::Tensor4 probs(1, 1, 1, 1);
  probs.setConstant(T(42));
  auto refused = [&](typename TestFixture::Options o, std::vector<std::string> phrases) {
    o.probabilities = &probs;
    expect_invalid([&] { m.forward(q, k, k, o); }, phrases);
    EXPECT_EQ(probs.dimension(0), 1);
    EXPECT_EQ(probs(0, 0, 0, 0), T(42));
  };
  typename TestFixture::Options o;
  o.window_left = -2;
  refused(o, {"window_left", "-2"});
  o = {};
  o.window_right = -5;
  refused(o, {"window_right", "-5"});
  o = {};
  o.key_lengths = {5};
  refused(o, {"key_lengths", "2", "1 lengths"});
  o.key_lengths = {5, 6};
  refused(o, {"key_lengths[1]", "[0, 5]", "6"});
  o.key_lengths = {-1, 2};
  refused(o, {"key_lengths[0]", "-1"});
  o = {};
  o.alibi_slopes = {T(1)};
  refused(o, {"alibi_slopes", "2", "1 slopes"});
  o.alibi_slopes = {T(1), std::numeric_limits<T>::quiet_NaN()};
  refused(o, {"alibi_slopes[1]", "finite"});
  o.alibi_slopes = {std::numeric_limits<T>::infinity(), T(1)};
  refused(o, {"alibi_slopes[0]", "finite"});
  o = {};
  const typename TestFixture::Tensor4 bad_bias(2, 2, 3, 4);
  o.attention_bias = &bad_bias;
  refused(o, {"attention_bias", "dimension 3", "1 or 5", "(2, 2, 3, 4)"});
  const typename TestFixture::Tensor4 bad_bias2(1, 3, 1, 1);
  o.attention_bias = &bad_bias2;
  refused(o, {"attention_bias", "dimension 1", "1 or 2"});
  // Nothing was drawn: the next call matches the twin's first.
  const auto a = m.forward(q, k, k), b = twin.forward(q, k, k);
  for (Index i = 0; i < a.size(); ++i) ASSERT_EQ(a.data()[i], b.data()[i]) << i;
}

// The ALiBi paper's get_slopes: for 8 heads 2^-1 .. 2^-8; for 12 heads, the 8-head slopes followed by the
// 16-head slopes 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (every other one, the first 12 - 8 of them).
TEST(AlibiSlopes, MatchThePaper) {
  const std::vector<double> eight = sdpa::alibi_slopes<double>(8);
  ASSERT_EQ(eight.size(), 8u);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(eight[i], std::pow(2.0, -static_cast<double>(i + 1)));
  const std::vector<double> twelve = sdpa::alibi_slopes<double>(12);
  ASSERT_EQ(twelve.size(), 12u);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(twelve[i], eight[i]);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(twelve[8 + i], std::pow(2.0, -0.5 - static_cast<double>(i)));
  EXPECT_EQ(sdpa::alibi_slopes<float>(1), std::vector<float>{0.00390625f});  // 2^-8
  const auto three = sdpa::alibi_slopes<double>(3);  // 2 heads (2^-4, 2^-8), then 4-head slope 2^-2
  ASSERT_EQ(three.size(), 3u);
  EXPECT_DOUBLE_EQ(three[0], 1.0 / 16);
  EXPECT_DOUBLE_EQ(three[1], 1.0 / 256);
  EXPECT_DOUBLE_EQ(three[2], 0.25);
  expect_invalid([] { sdpa::alibi_slopes<float>(0); }, {"heads", "positive", "0"});
}

}  // namespace options_test
