// Tests of sdpa::ScaledDotProductAttention (float and double) against the plain double reference of
// tests/support/reference.hpp: shapes, every mask / weights broadcast form, fully masked rows in both
// policies, large logits, TensorMap inputs, aliasing, a thread pool, empty sequences, default state,
// init_weights, parameters by name, copy / move, and the refusal of every bad argument.
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/reference.hpp"

namespace module_test {

using sdpa::MaskedRows;
using sdpa_test::Array3;
using sdpa_test::expect_invalid;
using sdpa_test::max_relative_error;
using sdpa_test::Rng;
using Index = Eigen::Index;
using Mask = Eigen::Tensor<bool, 4, Eigen::RowMajor>;

std::string shape_str(const std::array<Index, 4>& d) {
  std::ostringstream os;
  os << "(" << d[0] << ", " << d[1] << ", " << d[2] << ", " << d[3] << ")";
  return os.str();
}

Mask random_mask(Rng& rng, const std::array<Index, 4>& dims, double p_true) {
  Mask m(dims[0], dims[1], dims[2], dims[3]);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = rng.bernoulli(p_true);
  return m;
}

// Dimension i of the broadcast form `form` (bit 3 - i set: full, else 1).
std::array<Index, 4> form_dims(int form, const std::array<Index, 4>& full) {
  std::array<Index, 4> d{};
  for (int i = 0; i < 4; ++i) d[static_cast<std::size_t>(i)] = ((form >> (3 - i)) & 1) ? full[static_cast<std::size_t>(i)] : 1;
  return d;
}

struct Shape {
  Index batch, nq, nk, d_model, d_k, d_v, h;
  bool self;
};

std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "batch=" << s.batch << " nq=" << s.nq << " nk=" << s.nk << " d_model=" << s.d_model
            << " d_k=" << s.d_k << " d_v=" << s.d_v << " h=" << s.h << (s.self ? " self" : "");
}

template <typename T>
class ModuleTest : public ::testing::Test {
 protected:
  using Module = sdpa::ScaledDotProductAttention<T>;
  using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;
  using Weights = Eigen::Tensor<T, 4, Eigen::RowMajor>;

  static constexpr bool kFloat = std::is_same<T, float>::value;
  static double tol() { return kFloat ? 2e-5 : 1e-10; }

  static Tensor3 random3(Rng& rng, Index a, Index b, Index c, double stddev = 1.0) {
    Tensor3 t(a, b, c);
    rng.fill_normal(t, stddev);
    return t;
  }

  static Weights random_weights(Rng& rng, const std::array<Index, 4>& d) {
    Weights w(d[0], d[1], d[2], d[3]);
    for (Index i = 0; i < w.size(); ++i) w.data()[i] = static_cast<T>(rng.uniform(-1.0, 2.0));
    return w;
  }

  static Module make_module(Rng& rng, Index d_model, Index d_k, Index d_v, Index h) {
    Module m(d_model, d_k, d_v, h);
    m.eval();
    sdpa_test::randomize_module(m, rng, 0.3);
    return m;
  }

  static Array3 ref(const Module& m, const Tensor3& q, const Tensor3& k, const Tensor3& v, const Mask* mask = nullptr,
                    const Weights* w = nullptr) {
    return sdpa_test::reference_forward(m, q, k, v, mask, w, m.masked_rows() == MaskedRows::kNaN);
  }

  // Elementwise identity (NaN == NaN), shapes included.
  template <typename A, typename B>
  static void expect_identical(const A& a, const B& b) {
    for (int i = 0; i < 3; ++i) ASSERT_EQ(a.dimension(i), b.dimension(i)) << "dimension " << i;
    for (Index i = 0; i < a.size(); ++i) {
      const T x = a.data()[i], y = b.data()[i];
      if (std::isnan(x) && std::isnan(y)) continue;
      ASSERT_EQ(x, y) << "element " << i;
    }
  }

  // Every row (b, q) of out equals fc_o's bias exactly.
  static void expect_rows_are_bias(const Tensor3& out, const Module& m, Index b, Index q) {
    for (Index d = 0; d < m.d_model(); ++d) EXPECT_EQ(out(b, q, d), m.fc_o().bias()(d)) << "b=" << b << " q=" << q << " d=" << d;
  }
};

using ScalarTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(ModuleTest, ScalarTypes);

// ------------------------------------------------------------------------------------------------ numerics

TYPED_TEST(ModuleTest, ForwardMatchesReferenceOverShapes) {
  const Shape shapes[] = {
      {2, 5, 5, 16, 4, 4, 4, true},     // self-attention, h * d_k == d_model
      {3, 4, 7, 12, 5, 3, 2, false},    // cross-attention nq != nk, d_k != d_v, h*d_k != d_model
      {2, 6, 3, 10, 7, 2, 3, false},    // h*d_k > d_model, h*d_v < d_model
      {2, 5, 6, 8, 8, 8, 1, false},     // h = 1
      {1, 9, 4, 16, 4, 6, 4, false},    // batch = 1
      {2, 1, 1, 8, 2, 2, 4, false},     // nq = nk = 1
      {1, 1, 5, 6, 3, 3, 2, false},     // nq = 1
      {2, 3, 1, 6, 3, 3, 2, false},     // nk = 1
      {1, 1, 1, 1, 1, 1, 1, true},      // everything 1
      {2, 33, 17, 32, 8, 8, 4, false},  // larger
      {2, 7, 7, 9, 3, 5, 3, true},
  };
  Rng rng(1);
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << s);
    auto m = TestFixture::make_module(rng, s.d_model, s.d_k, s.d_v, s.h);
    const auto q = TestFixture::random3(rng, s.batch, s.nq, s.d_model);
    const auto k = s.self ? q : TestFixture::random3(rng, s.batch, s.nk, s.d_model);
    const auto v = s.self ? q : TestFixture::random3(rng, s.batch, s.nk, s.d_model);
    const Array3 expected = TestFixture::ref(m, q, k, v);
    for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kReference}) {
      SCOPED_TRACE(kernel == sdpa::Kernel::kAuto ? "kAuto" : "kReference");
      m.set_kernel(kernel);
      EXPECT_EQ(m.kernel(), kernel);
      const auto out = s.self ? m.forward(q, q, q) : m.forward(q, k, v);
      ASSERT_EQ(out.dimension(0), s.batch);
      ASSERT_EQ(out.dimension(1), s.nq);
      ASSERT_EQ(out.dimension(2), s.d_model);
      EXPECT_LT(max_relative_error(out, expected), TestFixture::tol());
      // operator() is forward.
      TestFixture::expect_identical(s.self ? m(q, q, q) : m(q, k, v), out);
    }
  }
}

TYPED_TEST(ModuleTest, AttentionIsNotUniformWithTheseWeights) {
  // Guards the other tests: with N(0, 0.3) weights the result must differ clearly from uniform attention
  // (attention_weights = 0 makes every score 0, i.e. uniform softmax).
  Rng rng(2);
  auto m = TestFixture::make_module(rng, 16, 4, 4, 4);
  const auto q = TestFixture::random3(rng, 2, 5, 16), k = TestFixture::random3(rng, 2, 6, 16);
  typename TestFixture::Weights zero(1, 1, 1, 1);
  zero.setZero();
  const auto uniform = m.forward(q, k, k, nullptr, &zero);
  const auto out = m.forward(q, k, k);
  EXPECT_GT(max_relative_error(out, sdpa_test::to_array3(uniform)), 0.05);
}

TYPED_TEST(ModuleTest, EveryMaskBroadcastFormInBothPolicies) {
  const std::array<Index, 4> full{2, 3, 4, 5};
  Rng rng(3);
  auto m = TestFixture::make_module(rng, 12, 4, 3, 3);
  const auto q = TestFixture::random3(rng, 2, 4, 12), k = TestFixture::random3(rng, 2, 5, 12),
             v = TestFixture::random3(rng, 2, 5, 12);
  for (int form = 0; form < 16; ++form) {
    const auto dims = form_dims(form, full);
    const Mask mask = random_mask(rng, dims, form == 0 ? 0.0 : 0.35);
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
      m.set_masked_rows(policy);
      const Array3 expected = TestFixture::ref(m, q, k, v, &mask);
      for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kReference}) {
        SCOPED_TRACE(::testing::Message() << "mask " << shape_str(dims) << " policy "
                                          << (policy == MaskedRows::kNaN ? "kNaN" : "kZero") << " kernel "
                                          << (kernel == sdpa::Kernel::kAuto ? "kAuto" : "kReference"));
        m.set_kernel(kernel);
        const auto out = m.forward(q, k, v, &mask);
        EXPECT_LT(max_relative_error(out, expected), TestFixture::tol());
      }
    }
    m.set_kernel(sdpa::Kernel::kAuto);
  }
  // A (1, 1, 1, 1) true mask hides everything: kZero gives fc_o's bias, kNaN gives NaN everywhere.
  Mask all(1, 1, 1, 1);
  all.setConstant(true);
  m.set_masked_rows(MaskedRows::kZero);
  const auto zero = m.forward(q, k, v, &all);
  for (Index b = 0; b < 2; ++b)
    for (Index i = 0; i < 4; ++i) TestFixture::expect_rows_are_bias(zero, m, b, i);
  m.set_masked_rows(MaskedRows::kNaN);
  const auto nan = m.forward(q, k, v, &all);
  for (Index i = 0; i < nan.size(); ++i) ASSERT_TRUE(std::isnan(nan.data()[i])) << i;
}

TYPED_TEST(ModuleTest, EveryWeightsBroadcastForm) {
  const std::array<Index, 4> full{2, 3, 4, 5};
  Rng rng(4);
  auto m = TestFixture::make_module(rng, 12, 4, 3, 3);
  const auto q = TestFixture::random3(rng, 2, 4, 12), k = TestFixture::random3(rng, 2, 5, 12),
             v = TestFixture::random3(rng, 2, 5, 12);
  const auto plain = m.forward(q, k, v);
  for (int form = 0; form < 16; ++form) {
    const auto dims = form_dims(form, full);
    SCOPED_TRACE(::testing::Message() << "weights " << shape_str(dims));
    const auto w = TestFixture::random_weights(rng, dims);
    const auto out = m.forward(q, k, v, nullptr, &w);
    EXPECT_LT(max_relative_error(out, TestFixture::ref(m, q, k, v, nullptr, &w)), TestFixture::tol());
    EXPECT_GT(max_relative_error(out, sdpa_test::to_array3(plain)), 1e-3) << "weights had no effect";
  }
}

TYPED_TEST(ModuleTest, MaskAndWeightsTogether) {
  const std::array<Index, 4> full{2, 3, 4, 5};
  Rng rng(5);
  auto m = TestFixture::make_module(rng, 12, 4, 3, 3);
  const auto q = TestFixture::random3(rng, 2, 4, 12), k = TestFixture::random3(rng, 2, 5, 12),
             v = TestFixture::random3(rng, 2, 5, 12);
  const std::pair<int, int> forms[] = {{15, 15}, {9, 6}, {6, 9}, {1, 14}, {12, 3}, {0, 15}, {15, 0}};
  for (const auto& f : forms) {
    const auto md = form_dims(f.first, full), wd = form_dims(f.second, full);
    SCOPED_TRACE(::testing::Message() << "mask " << shape_str(md) << " weights " << shape_str(wd));
    const Mask mask = random_mask(rng, md, f.first == 0 ? 0.0 : 0.3);
    const auto w = TestFixture::random_weights(rng, wd);
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
      m.set_masked_rows(policy);
      EXPECT_LT(max_relative_error(m.forward(q, k, v, &mask, &w), TestFixture::ref(m, q, k, v, &mask, &w)),
                TestFixture::tol());
    }
  }
}

TYPED_TEST(ModuleTest, CausalMask) {
  Rng rng(6);
  auto m = TestFixture::make_module(rng, 12, 4, 5, 3);
  const std::pair<Index, Index> sizes[] = {{6, 6}, {4, 7}, {7, 4}, {1, 3}};
  for (const auto& s : sizes) {
    SCOPED_TRACE(::testing::Message() << "nq=" << s.first << " nk=" << s.second);
    const auto q = TestFixture::random3(rng, 2, s.first, 12), k = TestFixture::random3(rng, 2, s.second, 12),
               v = TestFixture::random3(rng, 2, s.second, 12);
    const Mask causal = sdpa::causal_mask(s.first, s.second);
    const auto out = m.forward(q, k, v, &causal);
    EXPECT_LT(max_relative_error(out, TestFixture::ref(m, q, k, v, &causal)), TestFixture::tol());
    // Query 0 sees only key 0: its output does not depend on the other keys.
    auto k2 = k;
    auto v2 = v;
    for (Index j = 1; j < s.second; ++j)
      for (Index d = 0; d < 12; ++d) {
        k2(0, j, d) += TypeParam(1);
        v2(0, j, d) -= TypeParam(2);
      }
    const auto out2 = m.forward(q, k2, v2, &causal);
    for (Index d = 0; d < 12; ++d) EXPECT_EQ(out2(0, 0, d), out(0, 0, d));
  }
}

TYPED_TEST(ModuleTest, KeyPaddingMaskInBothPolicies) {
  Rng rng(7);
  auto m = TestFixture::make_module(rng, 10, 3, 4, 2);
  const auto q = TestFixture::random3(rng, 3, 4, 10), k = TestFixture::random3(rng, 3, 5, 10),
             v = TestFixture::random3(rng, 3, 5, 10);
  const Mask pad = sdpa::key_padding_mask({3, 0, 5}, 5);  // batch 1 sees no key at all
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
    m.set_masked_rows(policy);
    const auto out = m.forward(q, k, v, &pad);
    EXPECT_LT(max_relative_error(out, TestFixture::ref(m, q, k, v, &pad)), TestFixture::tol());
    for (Index i = 0; i < 4; ++i) {
      if (policy == MaskedRows::kZero) {
        TestFixture::expect_rows_are_bias(out, m, 1, i);
      } else {
        for (Index d = 0; d < 10; ++d) EXPECT_TRUE(std::isnan(out(1, i, d)));
      }
      for (Index d = 0; d < 10; ++d) {
        EXPECT_TRUE(std::isfinite(out(0, i, d)));
        EXPECT_TRUE(std::isfinite(out(2, i, d)));
      }
    }
  }
}

TYPED_TEST(ModuleTest, FullyMaskedRowsInBothPolicies) {
  Rng rng(8);
  auto m = TestFixture::make_module(rng, 8, 3, 2, 3);
  const auto q = TestFixture::random3(rng, 2, 4, 8), k = TestFixture::random3(rng, 2, 5, 8),
             v = TestFixture::random3(rng, 2, 5, 8);
  Mask mask(2, 3, 4, 5);
  mask.setConstant(false);
  for (Index j = 0; j < 5; ++j) {
    mask(0, 1, 2, j) = true;                             // one head of row (0, 2)
    for (Index h = 0; h < 3; ++h) mask(1, h, 0, j) = true;  // every head of row (1, 0)
  }
  mask(0, 0, 0, 3) = true;  // a partly masked row
  m.set_masked_rows(MaskedRows::kZero);
  const auto zero = m.forward(q, k, v, &mask);
  EXPECT_LT(max_relative_error(zero, TestFixture::ref(m, q, k, v, &mask)), TestFixture::tol());
  TestFixture::expect_rows_are_bias(zero, m, 1, 0);
  for (Index i = 0; i < zero.size(); ++i) EXPECT_TRUE(std::isfinite(zero.data()[i]));

  m.set_masked_rows(MaskedRows::kNaN);
  const auto nan = m.forward(q, k, v, &mask);
  EXPECT_LT(max_relative_error(nan, TestFixture::ref(m, q, k, v, &mask)), TestFixture::tol());
  for (Index b = 0; b < 2; ++b)
    for (Index i = 0; i < 4; ++i)
      for (Index d = 0; d < 8; ++d) {
        const bool hit = (b == 0 && i == 2) || (b == 1 && i == 0);
        EXPECT_EQ(std::isnan(nan(b, i, d)), hit) << b << "," << i << "," << d;
        if (!hit) {
          EXPECT_EQ(nan(b, i, d), zero(b, i, d));
        }
      }
}

TYPED_TEST(ModuleTest, LogitsAround1e4StayFinite) {
  Rng rng(9);
  auto m = TestFixture::make_module(rng, 8, 4, 4, 2);
  rng.fill_normal(m.fc_q().weight(), 30.0);
  rng.fill_normal(m.fc_k().weight(), 30.0);
  const auto q = TestFixture::random3(rng, 2, 5, 8), k = TestFixture::random3(rng, 2, 6, 8),
             v = TestFixture::random3(rng, 2, 6, 8);
  // Check the logits really are that large, from the reference projections.
  const auto p = sdpa_test::params_of(m);
  const auto qa = sdpa_test::to_array3(q), ka = sdpa_test::to_array3(k);
  const auto qp = sdpa_test::reference_linear_rows(p.q, qa.v, 10), kp = sdpa_test::reference_linear_rows(p.k, ka.v, 12);
  double max_logit = 0.0;
  for (Index b = 0; b < 2; ++b)
    for (Index i = 0; i < 5; ++i)
      for (Index j = 0; j < 6; ++j) {
        double dot = 0.0;
        for (Index d = 0; d < 4; ++d) dot += qp[static_cast<std::size_t>((b * 5 + i) * 8 + d)] * kp[static_cast<std::size_t>((b * 6 + j) * 8 + d)];
        max_logit = std::max(max_logit, std::abs(dot) / 2.0);
      }
  ASSERT_GT(max_logit, 5e3);
  ASSERT_LT(max_logit, 1e6);

  const auto out = m.forward(q, k, v);
  for (Index i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out.data()[i])) << i;
  EXPECT_LT(max_relative_error(out, TestFixture::ref(m, q, k, v)), TestFixture::tol());
  // With a causal mask as well (rows with a single key).
  const Mask causal = sdpa::causal_mask(5, 6);
  const auto outc = m.forward(q, k, v, &causal);
  for (Index i = 0; i < outc.size(); ++i) ASSERT_TRUE(std::isfinite(outc.data()[i])) << i;
  EXPECT_LT(max_relative_error(outc, TestFixture::ref(m, q, k, v, &causal)), TestFixture::tol());
}

// ------------------------------------------------------------------------------------------ input kinds

// ------------------------------------------------------------------------------------- non-finite inputs

// A NaN or infinity in the inputs propagates as in PyTorch: NaN in one query gives NaN in that query's
// output only; the masked-row policy is for rows whose every key is hidden, never for NaN scores.
TYPED_TEST(ModuleTest, NaNInOneQueryGivesNaNForThatQueryOnly) {
  Rng rng(41);
  auto m = TestFixture::make_module(rng, 8, 4, 3, 2);
  auto q = TestFixture::random3(rng, 2, 5, 8);
  const auto k = TestFixture::random3(rng, 2, 40, 8);
  q(1, 3, 2) = std::numeric_limits<TypeParam>::quiet_NaN();
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN})
    for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kReference}) {
      SCOPED_TRACE(::testing::Message() << "policy " << static_cast<int>(policy) << " kernel " << static_cast<int>(kernel));
      m.set_masked_rows(policy);
      m.set_kernel(kernel);
      const auto out = m.forward(q, k, k);
      for (Index b = 0; b < 2; ++b)
        for (Index i = 0; i < 5; ++i)
          for (Index d = 0; d < 8; ++d)
            ASSERT_EQ(std::isnan(out(b, i, d)), b == 1 && i == 3) << b << " " << i << " " << d;
      EXPECT_LT(max_relative_error(out, TestFixture::ref(m, q, k, k)), TestFixture::tol());
    }
}

// Weights with +-inf and NaN entries under a random mask: every score kind (NaN, +inf, -inf, all visible
// scores -inf) against the double reference, in both policies and both kernels, NaN exactly where it has NaN.
TYPED_TEST(ModuleTest, NonFiniteScoresMatchReference) {
  Rng rng(42);
  auto m = TestFixture::make_module(rng, 8, 4, 3, 2);
  const Index nq = 6, nk = 37;
  const auto q = TestFixture::random3(rng, 2, nq, 8), k = TestFixture::random3(rng, 2, nk, 8);
  typename TestFixture::Weights w = TestFixture::random_weights(rng, {2, 2, nq, nk});
  const TypeParam inf = std::numeric_limits<TypeParam>::infinity();
  w(0, 0, 1, 5) = std::numeric_limits<TypeParam>::quiet_NaN();  // NaN score: the row is NaN
  w(0, 1, 2, 7) = inf;                                            // +-inf score
  w(1, 0, 4, 30) = -inf;
  for (Index j = 0; j < nk; ++j) w(1, 1, 0, j) = TypeParam(0);    // one row's scores all exactly 0 ...
  Mask mask = random_mask(rng, {2, 1, nq, nk}, 0.3);
  for (Index j = 0; j < nk; ++j) mask(1, 0, 5, j) = true;          // ... and a fully hidden row
  mask(0, 0, 1, 5) = true;  // the NaN weight of row (0, 0, 1) is hidden: that row stays finite
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN})
    for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kReference}) {
      SCOPED_TRACE(::testing::Message() << "policy " << static_cast<int>(policy) << " kernel " << static_cast<int>(kernel));
      m.set_masked_rows(policy);
      m.set_kernel(kernel);
      const auto out = m.forward(q, k, k, &mask, &w);
      const Array3 expected = TestFixture::ref(m, q, k, k, &mask, &w);
      EXPECT_LT(max_relative_error(out, expected), TestFixture::tol());
      Index nan_rows = 0;
      for (Index b = 0; b < 2; ++b)
        for (Index i = 0; i < nq; ++i) nan_rows += std::isnan(expected(b, i, 0)) ? 1 : 0;
      EXPECT_GE(nan_rows, 1);  // the +-inf scores made some rows NaN
      EXPECT_LT(nan_rows, 2 * nq);
    }
}

// The one intended difference from PyTorch: a key the mask hides contributes nothing, so a NaN in its
// input (hence in its projected key and value) does not reach the output. (PyTorch's 0 * NaN does.) The
// hidden key sits inside tiles that other queries see, so the tiled kernel's products would meet it.
TYPED_TEST(ModuleTest, NaNInAHiddenKeyDoesNotReachTheOutput) {
  Rng rng(43);
  auto m = TestFixture::make_module(rng, 8, 4, 3, 2);
  const Index n = 40;
  auto x = TestFixture::random3(rng, 2, n, 8);
  auto clean = x;
  for (Index d = 0; d < 8; ++d) {
    x(0, 17, d) = std::numeric_limits<TypeParam>::quiet_NaN();
    clean(0, 17, d) = TypeParam(123);
  }
  Mask mask(1, 1, n, n);  // key 17 hidden from every query; a causal pattern elsewhere
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < n; ++j) mask(0, 0, i, j) = j == 17 || j > i;
  const auto q = TestFixture::random3(rng, 2, n, 8);
  for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kReference}) {
    m.set_kernel(kernel);
    const auto out = m.forward(q, x, x, &mask);
    for (Index i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out.data()[i])) << i;
    // The output is the one with any other value there.
    EXPECT_LT(max_relative_error(out, TestFixture::ref(m, q, clean, clean, &mask)), TestFixture::tol());
  }
}

// Any rank-3 row-major tensor expression of the module's Scalar is accepted and evaluated once: a scaled
// tensor, a slice, a ColMajor tensor through swap_layout().shuffle(); the same expression object as q, k
// and v still takes the fused projection (same result, bit for bit, as the evaluated tensor three times).
TYPED_TEST(ModuleTest, TensorExpressionsAsInputs) {
  using T = TypeParam;
  using Tensor3 = typename TestFixture::Tensor3;
  Rng rng(44);
  auto m = TestFixture::make_module(rng, 8, 4, 3, 2);
  const auto x = TestFixture::random3(rng, 2, 5, 8), kv = TestFixture::random3(rng, 2, 6, 8);
  const Tensor3 doubled = x * T(2);
  TestFixture::expect_identical(m(x * T(2), kv, kv), m(doubled, kv, kv));
  const auto expr = x * T(2);
  TestFixture::expect_identical(m(expr, expr, expr), m(doubled, doubled, doubled));
  // A slice of a longer sequence.
  const auto longer = TestFixture::random3(rng, 2, 9, 8);
  const Eigen::array<Index, 3> offsets{0, 2, 0}, extents{2, 5, 8};
  const Tensor3 sliced = longer.slice(offsets, extents);
  TestFixture::expect_identical(m(longer.slice(offsets, extents), kv, kv), m(sliced, kv, kv));
  // A ColMajor tensor of the same logical (batch, seq, d_model) values.
  Eigen::Tensor<T, 3> col(2, 5, 8);
  for (Index b = 0; b < 2; ++b)
    for (Index i = 0; i < 5; ++i)
      for (Index d = 0; d < 8; ++d) col(b, i, d) = x(b, i, d);
  TestFixture::expect_identical(m(col.swap_layout().shuffle(Eigen::array<int, 3>{2, 1, 0}), kv, kv), m(x, kv, kv));
}

TYPED_TEST(ModuleTest, TensorMapInputsAreReadInPlace) {
  using T = TypeParam;
  using Tensor3 = typename TestFixture::Tensor3;
  Rng rng(10);
  auto m = TestFixture::make_module(rng, 8, 4, 3, 2);
  const auto q = TestFixture::random3(rng, 2, 3, 8), k = TestFixture::random3(rng, 2, 4, 8),
             v = TestFixture::random3(rng, 2, 4, 8);
  // Each input sits at an offset inside a std::vector padded with NaN: reading outside the window or
  // from a copy with another layout would show.
  const T nan = std::numeric_limits<T>::quiet_NaN();
  auto embed = [&](const Tensor3& t) {
    std::vector<T> buf(static_cast<std::size_t>(t.size()) + 10, nan);
    std::memcpy(buf.data() + 3, t.data(), sizeof(T) * static_cast<std::size_t>(t.size()));
    return buf;
  };
  std::vector<T> bq = embed(q), bk = embed(k), bv = embed(v);
  Eigen::TensorMap<const Tensor3> cq(bq.data() + 3, 2, 3, 8), ck(bk.data() + 3, 2, 4, 8), cv(bv.data() + 3, 2, 4, 8);
  Eigen::TensorMap<Tensor3> mq(bq.data() + 3, 2, 3, 8), mk(bk.data() + 3, 2, 4, 8), mv(bv.data() + 3, 2, 4, 8);

  const auto expected = m.forward(q, k, v);
  EXPECT_LT(max_relative_error(expected, TestFixture::ref(m, q, k, v)), TestFixture::tol());
  TestFixture::expect_identical(m.forward(cq, ck, cv), expected);
  TestFixture::expect_identical(m.forward(mq, mk, mv), expected);
  TestFixture::expect_identical(m.forward(cq, k, mv), expected);

  // The maps read the vector's current contents.
  for (Index i = 0; i < 8; ++i) bq[static_cast<std::size_t>(3 + i)] += T(0.5);
  Tensor3 q2 = q;
  for (Index i = 0; i < 8; ++i) q2(0, 0, i) += T(0.5);
  const auto changed = m.forward(cq, ck, cv);
  TestFixture::expect_identical(changed, m.forward(q2, k, v));
  EXPECT_NE(changed(0, 0, 0), expected(0, 0, 0));
  // The padding was never written.
  for (std::size_t i : {std::size_t{0}, std::size_t{1}, std::size_t{2}, bq.size() - 1}) EXPECT_TRUE(std::isnan(bq[i]));
}

TYPED_TEST(ModuleTest, SameTensorAsQueriesKeysAndValues) {
  using T = TypeParam;
  using Tensor3 = typename TestFixture::Tensor3;
  Rng rng(11);
  auto m = TestFixture::make_module(rng, 12, 4, 4, 3);
  const auto x = TestFixture::random3(rng, 2, 6, 12);
  const Tensor3 a = x, b = x, c = x;
  const double close = TestFixture::kFloat ? 1e-6 : 1e-13;  // same values, possibly another projection pass
  // q = k = v: one tensor.
  const auto aliased = m.forward(x, x, x);
  const auto separate = m.forward(a, b, c);
  EXPECT_LT(max_relative_error(aliased, sdpa_test::to_array3(separate)), close);
  EXPECT_LT(max_relative_error(aliased, TestFixture::ref(m, a, b, c)), TestFixture::tol());
  TestFixture::expect_identical(x, a);  // the input is not modified
  // k = v, q another tensor; and q = k with another v.
  const auto q = TestFixture::random3(rng, 2, 4, 12), v = TestFixture::random3(rng, 2, 6, 12);
  EXPECT_LT(max_relative_error(m.forward(q, x, x), sdpa_test::to_array3(m.forward(q, b, c))), close);
  EXPECT_LT(max_relative_error(m.forward(q, x, x), TestFixture::ref(m, q, b, c)), TestFixture::tol());
  EXPECT_LT(max_relative_error(m.forward(x, x, v), TestFixture::ref(m, a, b, v)), TestFixture::tol());
  EXPECT_LT(max_relative_error(m.forward(x, v, x), TestFixture::ref(m, a, v, c)), TestFixture::tol());
  // Maps over one buffer with different extents are different tensors: queries are the whole buffer
  // (2 x 6 rows), keys and values its first 2 x 3 rows read as (2, 3, d_model), or as (1, 6, d_model).
  std::vector<T> buf(x.data(), x.data() + x.size());
  Eigen::TensorMap<const Tensor3> all(buf.data(), 2, 6, 12), head(buf.data(), 2, 3, 12), one(buf.data(), 1, 6, 12);
  Tensor3 head_copy = head, all_copy = all, one_copy = one;
  EXPECT_LT(max_relative_error(m.forward(all, head, head), TestFixture::ref(m, all_copy, head_copy, head_copy)),
            TestFixture::tol());
  EXPECT_LT(max_relative_error(m.forward(head, all, all), TestFixture::ref(m, head_copy, all_copy, all_copy)),
            TestFixture::tol());
  EXPECT_LT(max_relative_error(m.forward(head, head, head), TestFixture::ref(m, head_copy, head_copy, head_copy)),
            TestFixture::tol());
  EXPECT_LT(max_relative_error(m.forward(one, one, one), TestFixture::ref(m, one_copy, one_copy, one_copy)),
            TestFixture::tol());
}

TYPED_TEST(ModuleTest, ThreadPoolDeviceMatchesSerial) {
  Rng rng(12);
  auto m = TestFixture::make_module(rng, 32, 8, 6, 4);
  // batch * nq = 210 rows, so the projections are split over the pool as well.
  const auto q = TestFixture::random3(rng, 3, 70, 32), k = TestFixture::random3(rng, 3, 50, 32),
             v = TestFixture::random3(rng, 3, 50, 32);
  const Mask pad = sdpa::key_padding_mask({50, 17, 1}, 50);
  const auto w = TestFixture::random_weights(rng, {1, 4, 70, 50});
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  const double close = TestFixture::kFloat ? 1e-5 : 1e-12;
  for (int variant = 0; variant < 2; ++variant) {
    const Mask* mk = variant ? &pad : nullptr;
    const typename TestFixture::Weights* wk = variant ? &w : nullptr;
    const auto serial = m.forward(q, k, v, mk, wk);
    const auto threaded = m.forward(q, k, v, mk, wk, &device);
    EXPECT_LT(max_relative_error(threaded, sdpa_test::to_array3(serial)), close);
    EXPECT_LT(max_relative_error(threaded, TestFixture::ref(m, q, k, v, mk, wk)), TestFixture::tol());
    // Same device again: deterministic.
    TestFixture::expect_identical(m.forward(q, k, v, mk, wk, &device), threaded);
  }
}

TYPED_TEST(ModuleTest, ZeroLengthSequences) {
  Rng rng(13);
  auto m = TestFixture::make_module(rng, 6, 2, 3, 2);
  {  // nq = 0
    const auto q = TestFixture::random3(rng, 2, 0, 6), k = TestFixture::random3(rng, 2, 3, 6);
    const auto out = m.forward(q, k, k);
    EXPECT_EQ(out.dimension(0), 2);
    EXPECT_EQ(out.dimension(1), 0);
    EXPECT_EQ(out.dimension(2), 6);
  }
  {  // batch = 0
    const auto q = TestFixture::random3(rng, 0, 3, 6), k = TestFixture::random3(rng, 0, 4, 6);
    const auto out = m.forward(q, k, k);
    EXPECT_EQ(out.dimension(0), 0);
    EXPECT_EQ(out.dimension(1), 3);
    EXPECT_EQ(out.dimension(2), 6);
  }
  {  // nq = nk = 0
    const auto q = TestFixture::random3(rng, 2, 0, 6), k = TestFixture::random3(rng, 2, 0, 6);
    const auto out = m.forward(q, k, k);
    EXPECT_EQ(out.dimension(0), 2);
    EXPECT_EQ(out.dimension(1), 0);
    EXPECT_EQ(out.dimension(2), 6);
  }
  // nk = 0: zero attention output, so every row is fc_o's bias; in both policies, with or without a mask.
  const auto q = TestFixture::random3(rng, 2, 3, 6), k = TestFixture::random3(rng, 2, 0, 6);
  const Mask pad = sdpa::key_padding_mask({0, 0}, 0);
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
    m.set_masked_rows(policy);
    for (const Mask* mask : {static_cast<const Mask*>(nullptr), &pad}) {
      const auto out = m.forward(q, k, k, mask);
      ASSERT_EQ(out.dimension(0), 2);
      ASSERT_EQ(out.dimension(1), 3);
      ASSERT_EQ(out.dimension(2), 6);
      for (Index b = 0; b < 2; ++b)
        for (Index i = 0; i < 3; ++i) TestFixture::expect_rows_are_bias(out, m, b, i);
      EXPECT_LT(max_relative_error(out, TestFixture::ref(m, q, k, k, mask)), TestFixture::tol());
    }
  }
  // Empty inputs are still validated.
  const auto bad = TestFixture::random3(rng, 2, 0, 5);
  expect_invalid([&] { m.forward(bad, k, k); }, {"queries", "d_model", "6", "(2, 0, 5)"});
}

TYPED_TEST(ModuleTest, DemoShape) {
  typename TestFixture::Module sa(512, 512, 512, 8);
  Rng rng(14);
  const auto input = TestFixture::random3(rng, 2, 49, 512);
  const auto out = sa(input, input, input);
  EXPECT_EQ(out.dimension(0), 2);
  EXPECT_EQ(out.dimension(1), 49);
  EXPECT_EQ(out.dimension(2), 512);
  for (Index i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out.data()[i])) << i;
}

// forward keeps its scratch between calls; a later call reuses buffers that hold an earlier call's values
// (here NaN from a NaN input, and a larger shape), and must give exactly what a module without kept
// scratch gives: nothing may read what the call itself did not write (hidden keys' rows included).
TYPED_TEST(ModuleTest, ScratchKeptBetweenCallsDoesNotChangeResults) {
  using T = TypeParam;
  using Tensor3 = typename TestFixture::Tensor3;
  Rng rng(15);
  auto m = TestFixture::make_module(rng, 16, 4, 6, 3);
  EXPECT_EQ(m.scratch_bytes(), 0u);
  const Tensor3 big = TestFixture::random3(rng, 3, 40, 16);
  Tensor3 poisoned = big;
  for (Index i = 0; i < poisoned.size(); ++i) poisoned.data()[i] = std::numeric_limits<T>::quiet_NaN();
  const Tensor3 q = TestFixture::random3(rng, 2, 9, 16), kv = TestFixture::random3(rng, 2, 13, 16);
  sdpa::AttentionOptions<T> lengths;
  lengths.key_lengths = {5, 13};
  // What each call gives on a module that keeps nothing.
  auto fresh = [&](const Tensor3& a, const Tensor3& b, const sdpa::AttentionOptions<T>& o) {
    m.release_scratch();
    EXPECT_EQ(m.scratch_bytes(), 0u);
    return Tensor3(m.forward(a, b, b, o));
  };
  const Tensor3 self_expected = fresh(big, big, {}), cross_expected = fresh(q, kv, lengths),
               self_q_expected = fresh(q, q, {});
  const Mask padding = sdpa::key_padding_mask({5, 13}, 13);
  EXPECT_LT(max_relative_error(cross_expected, TestFixture::ref(m, q, kv, kv, &padding)), TestFixture::tol());
  m.release_scratch();
  const Tensor3 nan_out = m.forward(poisoned, poisoned, poisoned);
  EXPECT_TRUE(std::isnan(nan_out(0, 0, 0)));
  EXPECT_GE(m.scratch_bytes(), static_cast<std::size_t>(3 * 40 * (2 * 3 * 4 + 3 * 6)) * sizeof(T));  // q|k|v at least
  std::size_t held = 0;
  for (int round = 0; round < 3; ++round) {
    TestFixture::expect_identical(m.forward(q, kv, kv, lengths), cross_expected);
    TestFixture::expect_identical(m.forward(q, q, q), self_q_expected);
    TestFixture::expect_identical(m.forward(big, big, big), self_expected);
    m.forward(poisoned, poisoned, poisoned);
    if (round == 1) held = m.scratch_bytes();
  }
  EXPECT_EQ(m.scratch_bytes(), held);  // the same calls again: nothing new kept
  EXPECT_LE(held, sdpa::detail::ScratchPool<T>::kSlots * static_cast<std::size_t>(3 * 40 * (2 * 3 * 4 + 3 * 6)) * sizeof(T));
  // A copy keeps nothing of the original's; a move takes it along.
  const auto copy = m;
  EXPECT_EQ(copy.scratch_bytes(), 0u);
  EXPECT_GT(m.scratch_bytes(), 0u);
  const auto moved = std::move(m);
  EXPECT_EQ(moved.scratch_bytes(), held);
  moved.release_scratch();
  EXPECT_EQ(moved.scratch_bytes(), 0u);
}

// ------------------------------------------------------------------------------------------ state

TYPED_TEST(ModuleTest, DefaultConstructionState) {
  typename TestFixture::Module m(8, 4, 3, 2);
  EXPECT_TRUE(m.is_training());
  EXPECT_EQ(m.dropout(), TypeParam(0.1));
  EXPECT_EQ(m.masked_rows(), MaskedRows::kZero);
  EXPECT_EQ(m.d_model(), 8);
  EXPECT_EQ(m.d_k(), 4);
  EXPECT_EQ(m.d_v(), 3);
  EXPECT_EQ(m.h(), 2);
  m.eval();
  EXPECT_FALSE(m.is_training());
  m.train();
  EXPECT_TRUE(m.is_training());
  m.train(false);
  EXPECT_FALSE(m.is_training());
  typename TestFixture::Module p(8, 4, 3, 2, TypeParam(0.25));
  EXPECT_EQ(p.dropout(), TypeParam(0.25));
  p.set_dropout(TypeParam(0));
  EXPECT_EQ(p.dropout(), TypeParam(0));
  p.set_dropout(TypeParam(1));
  EXPECT_EQ(p.dropout(), TypeParam(1));
}

namespace detail_stats {
struct Stats {
  double mean, std, within_one_std;
};
template <typename TensorT>
Stats stats(const TensorT& t) {
  const auto n = static_cast<double>(t.size());
  double sum = 0;
  for (Index i = 0; i < t.size(); ++i) sum += static_cast<double>(t.data()[i]);
  const double mean = sum / n;
  double sq = 0, inside = 0;
  for (Index i = 0; i < t.size(); ++i) sq += (t.data()[i] - mean) * (t.data()[i] - mean);
  const double sd = std::sqrt(sq / (n - 1));
  for (Index i = 0; i < t.size(); ++i) inside += std::abs(t.data()[i] - mean) <= sd ? 1 : 0;
  return {mean, sd, inside / n};
}
}  // namespace detail_stats

TYPED_TEST(ModuleTest, InitWeightsStatistics) {
  typename TestFixture::Module m(512, 64, 64, 8);
  for (auto* layer : {&m.fc_q(), &m.fc_k(), &m.fc_v(), &m.fc_o()}) {
    ASSERT_EQ(layer->weight().size(), 512 * 512);
    const auto s = detail_stats::stats(layer->weight());
    const double n = 512.0 * 512.0;
    EXPECT_LT(std::abs(s.mean), 6 * 0.001 / std::sqrt(n)) << "mean " << s.mean;
    EXPECT_NEAR(s.std, 0.001, 0.001 * 6 / std::sqrt(2 * n)) << "std";
    EXPECT_NEAR(s.within_one_std, 0.6827, 0.005) << "not normal-looking";
    for (Index i = 0; i < layer->bias().size(); ++i) ASSERT_EQ(layer->bias()(i), TypeParam(0));
  }
  // The four layers are different draws.
  bool differ = false;
  for (Index i = 0; i < 100; ++i) differ |= m.fc_q().weight().data()[i] != m.fc_k().weight().data()[i];
  EXPECT_TRUE(differ);
}

TYPED_TEST(ModuleTest, InitWeightsReproducibleUnderSeed) {
  using Module = typename TestFixture::Module;
  auto same = [](Module& a, Module& b) {
    for (auto pa : a.named_parameters()) {
      auto pb = b.parameter(pa.name);
      if (pa.size() != pb.size()) return false;
      for (Index i = 0; i < pa.size(); ++i)
        if (pa.data[i] != pb.data[i]) return false;
    }
    return true;
  };
  // Two modules get different seeds from the process-wide sequence, hence different weights; after
  // sdpa::manual_seed the sequence repeats, so a program is reproducible.
  sdpa::manual_seed(2024);
  Module a(16, 8, 4, 2), b(16, 8, 4, 2);
  EXPECT_FALSE(same(a, b));
  EXPECT_NE(a.seed(), b.seed());
  sdpa::manual_seed(2024);
  Module a2(16, 8, 4, 2), b2(16, 8, 4, 2);
  EXPECT_TRUE(same(a, a2));
  EXPECT_TRUE(same(b, b2));
  Rng rng(15);
  sdpa_test::randomize_module(b, rng);
  EXPECT_FALSE(same(b, b2));
  b.init_weights();
  EXPECT_TRUE(same(b, b2));  // re-init restores the module's own draw, biases included

  a.manual_seed(1234);
  a.init_weights();
  EXPECT_FALSE(same(a, b));  // another seed, other weights
  b.manual_seed(1234);
  b.init_weights();
  EXPECT_TRUE(same(a, b));
  b.manual_seed(1235);
  b.init_weights();
  EXPECT_FALSE(same(a, b));
  EXPECT_EQ(b.seed(), 1235u);
}

TYPED_TEST(ModuleTest, NamedParametersOrderAndShapes) {
  using Module = typename TestFixture::Module;
  Module m(7, 3, 5, 2);
  const std::vector<std::pair<std::string, std::vector<Index>>> expected = {
      {"fc_q.weight", {6, 7}},  {"fc_q.bias", {6}}, {"fc_k.weight", {6, 7}},  {"fc_k.bias", {6}},
      {"fc_v.weight", {10, 7}}, {"fc_v.bias", {10}}, {"fc_o.weight", {7, 10}}, {"fc_o.bias", {7}}};
  const auto params = m.named_parameters();
  ASSERT_EQ(params.size(), expected.size());
  const TypeParam* data[8] = {m.fc_q().weight().data(), m.fc_q().bias().data(), m.fc_k().weight().data(),
                              m.fc_k().bias().data(),   m.fc_v().weight().data(), m.fc_v().bias().data(),
                              m.fc_o().weight().data(), m.fc_o().bias().data()};
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(params[i].name, expected[i].first);
    EXPECT_EQ(params[i].shape, expected[i].second) << params[i].name;
    EXPECT_EQ(params[i].data, data[i]) << params[i].name;
    Index n = 1;
    for (Index d : expected[i].second) n *= d;
    EXPECT_EQ(params[i].size(), n);
  }
  const Module& cm = m;
  const auto cparams = cm.named_parameters();
  ASSERT_EQ(cparams.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(cparams[i].name, expected[i].first);
    EXPECT_EQ(cparams[i].data, data[i]);
    EXPECT_EQ(cparams[i].shape, expected[i].second);
  }
}

TYPED_TEST(ModuleTest, ParameterByNameWritesThrough) {
  using Module = typename TestFixture::Module;
  Rng rng(16);
  auto m = TestFixture::make_module(rng, 6, 2, 3, 2);
  const auto q = TestFixture::random3(rng, 1, 2, 6), k = TestFixture::random3(rng, 1, 3, 6);
  const auto before = m.forward(q, k, k);
  auto p = m.parameter("fc_v.bias");
  EXPECT_EQ(p.name, "fc_v.bias");
  ASSERT_EQ(p.shape, std::vector<Index>{6});
  for (Index i = 0; i < 6; ++i) p.data[i] = TypeParam(0.25 * static_cast<double>(i + 1));
  for (Index i = 0; i < 6; ++i) EXPECT_EQ(m.fc_v().bias()(i), TypeParam(0.25 * static_cast<double>(i + 1)));
  const auto after = m.forward(q, k, k);
  EXPECT_GT(max_relative_error(after, sdpa_test::to_array3(before)), 1e-3);
  EXPECT_LT(max_relative_error(after, TestFixture::ref(m, q, k, k)), TestFixture::tol());
  auto w = m.parameter("fc_o.weight");
  EXPECT_EQ(w.shape, (std::vector<Index>{6, 6}));
  w.data[1 * 6 + 2] = TypeParam(3);  // (out 1, in 2), PyTorch order
  EXPECT_EQ(m.fc_o().weight()(1, 2), TypeParam(3));
  const Module& cm = m;
  EXPECT_EQ(cm.parameter("fc_o.weight").data, m.fc_o().weight().data());
}

TYPED_TEST(ModuleTest, UnknownParameterNameThrows) {
  typename TestFixture::Module m(6, 2, 3, 2);
  const std::vector<std::string> phrases = {"name",      "\"nope\"",    "fc_q.weight", "fc_q.bias", "fc_k.weight",
                                            "fc_k.bias", "fc_v.weight", "fc_v.bias",   "fc_o.weight", "fc_o.bias"};
  expect_invalid([&] { m.parameter("nope"); }, phrases);
  const auto& cm = m;
  expect_invalid([&] { cm.parameter("nope"); }, phrases);
  expect_invalid([&] { m.parameter("fc_q"); }, {"fc_q"});
}

TYPED_TEST(ModuleTest, CopyAndMoveKeepWeightsAndState) {
  using Module = typename TestFixture::Module;
  Rng rng(17);
  Module m(8, 3, 2, 2, TypeParam(0.3));
  sdpa_test::randomize_module(m, rng);
  m.set_masked_rows(MaskedRows::kNaN);
  m.manual_seed(77);
  const auto q = TestFixture::random3(rng, 2, 3, 8), k = TestFixture::random3(rng, 2, 4, 8);
  const Mask pad = sdpa::key_padding_mask({4, 0}, 4);
  (void)m.forward(q, k, k);  // one training call: the dropout stream has advanced

  // Same parameters (in storage of its own) and settings; the dropout stream is compared by the callers.
  auto check_parameters_and_settings = [&](Module& a, const Module& b, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(a.d_model(), b.d_model());
    EXPECT_EQ(a.d_k(), b.d_k());
    EXPECT_EQ(a.d_v(), b.d_v());
    EXPECT_EQ(a.h(), b.h());
    EXPECT_EQ(a.dropout(), b.dropout());
    EXPECT_EQ(a.is_training(), b.is_training());
    EXPECT_EQ(a.masked_rows(), b.masked_rows());
    for (auto pa : a.named_parameters()) {
      auto pb = b.parameter(pa.name);
      ASSERT_EQ(pa.shape, pb.shape) << pa.name;
      EXPECT_NE(static_cast<const void*>(pa.data), static_cast<const void*>(pb.data)) << pa.name << " shares storage";
      for (Index i = 0; i < pa.size(); ++i) ASSERT_EQ(pa.data[i], pb.data[i]) << pa.name << " " << i;
    }
  };
  auto eval_output = [&](Module& a) {
    a.eval();
    auto y = a.forward(q, k, k, &pad);
    a.train();
    return y;
  };
  auto differs = [](const typename TestFixture::Tensor3& a, const typename TestFixture::Tensor3& b) {
    for (Index i = 0; i < a.size(); ++i)
      if (!(a.data()[i] == b.data()[i]) && !(std::isnan(a.data()[i]) && std::isnan(b.data()[i]))) return true;
    return false;
  };
  const auto m_eval = eval_output(m);

  // A copy has a seed of its own: it computes what the original computes, but does not replay its
  // dropout masks (a stack of copied layers would otherwise drop the same elements in every layer).
  {
    Module copy(m);
    check_parameters_and_settings(copy, m, "copy construction");
    EXPECT_NE(copy.seed(), m.seed());
    EXPECT_EQ(m.seed(), 77u);
    TestFixture::expect_identical(eval_output(copy), m_eval);
    EXPECT_TRUE(differs(copy.forward(q, k, k, &pad), m.forward(q, k, k, &pad)));
    copy.fc_q().weight()(0, 0) += TypeParam(1);  // the copy is deep
    EXPECT_NE(copy.fc_q().weight()(0, 0), m.fc_q().weight()(0, 0));
  }
  {
    Module assigned(3, 1, 1, 1);
    assigned = m;
    check_parameters_and_settings(assigned, m, "copy assignment");
    EXPECT_NE(assigned.seed(), m.seed());
    TestFixture::expect_identical(eval_output(assigned), m_eval);
  }
  // A move is the same module in another place: its seed and dropout call count come along, so its next
  // training output is the one the source would have given (compared with a twin reseeded alike).
  auto twin_output = [&](std::uint64_t seed) {
    Module twin(m);
    twin.manual_seed(seed);
    (void)twin.forward(q, k, k);
    return twin.forward(q, k, k, &pad);
  };
  {
    Module source(m);
    source.manual_seed(5);
    (void)source.forward(q, k, k);
    Module moved(std::move(source));
    check_parameters_and_settings(moved, m, "move construction");
    EXPECT_EQ(moved.seed(), 5u);
    TestFixture::expect_identical(moved.forward(q, k, k, &pad), twin_output(5));
  }
  {
    Module source(m);
    source.manual_seed(6);
    (void)source.forward(q, k, k);
    Module moved(5, 1, 2, 3);
    moved = std::move(source);
    check_parameters_and_settings(moved, m, "move assignment");
    EXPECT_EQ(moved.seed(), 6u);
    TestFixture::expect_identical(moved.forward(q, k, k, &pad), twin_output(6));
  }
  {
    Module self(m);
    self.manual_seed(8);
    (void)self.forward(q, k, k);
    const Module& alias = self;
    self = alias;  // self-assignment keeps everything, the dropout stream included
    check_parameters_and_settings(self, m, "self assignment");
    EXPECT_EQ(self.seed(), 8u);
    TestFixture::expect_identical(self.forward(q, k, k, &pad), twin_output(8));
  }
  // Moving draws nothing from the process-wide seed sequence.
  sdpa::manual_seed(31);
  Module first(4, 2, 2, 2);
  sdpa::manual_seed(31);
  {
    Module source(3, 1, 1, 1);  // takes the first seed of the sequence
    Module moved(std::move(source));
    EXPECT_EQ(moved.seed(), first.seed());
  }
  Module second(4, 2, 2, 2);
  sdpa::manual_seed(31);
  Module a(4, 2, 2, 2), b(4, 2, 2, 2);
  EXPECT_EQ(second.seed(), b.seed());
  EXPECT_NE(a.seed(), b.seed());
}

// ------------------------------------------------------------------------------------------ bad arguments

TYPED_TEST(ModuleTest, ConstructorRefusesBadSizes) {
  using Module = typename TestFixture::Module;
  for (Index bad : {Index{0}, Index{-2}}) {
    const std::string v = std::to_string(bad);
    expect_invalid([&] { Module(bad, 4, 4, 2); }, {"d_model", "positive", v});
    expect_invalid([&] { Module(8, bad, 4, 2); }, {"d_k", "positive", v});
    expect_invalid([&] { Module(8, 4, bad, 2); }, {"d_v", "positive", v});
    expect_invalid([&] { Module(8, 4, 4, bad); }, {"h", "positive", v});
  }
}

// Sizes whose weight element counts (d_model * h * d_k, ...) overflow Eigen::Index must be refused with
// std::invalid_argument before any layer is built (today Linear's Eigen tensor computes the count with a
// signed overflow, undefined behaviour, and the constructor ends in std::bad_alloc).
TYPED_TEST(ModuleTest, ConstructorRefusesSizesWhoseWeightCountOverflows) {
  using Module = typename TestFixture::Module;
  const Index huge = Index{1} << 62;
  expect_invalid([&] { Module(huge, 1, 1, 4); }, {"d_model", std::to_string(huge)});
  expect_invalid([&] { Module(4, huge, 1, 1); }, {"d_k", std::to_string(huge)});
  // h * d_k itself overflowing is already refused by name.
  expect_invalid([&] { Module(4, huge, 1, 8); }, {"h * d_k", "representable"});
  expect_invalid([&] { Module(4, 1, huge, 8); }, {"h * d_v", "representable"});
}

TYPED_TEST(ModuleTest, ConstructorAndSetDropoutRefuseBadProbabilities) {
  using T = TypeParam;
  using Module = typename TestFixture::Module;
  const std::pair<T, const char*> bad[] = {{T(-0.1), "-0.1"},
                                           {T(1.5), "1.5"},
                                           {std::numeric_limits<T>::quiet_NaN(), "nan"},
                                           {std::numeric_limits<T>::infinity(), "inf"},
                                           {-std::numeric_limits<T>::infinity(), "-inf"}};
  Module m(8, 4, 4, 2, T(0.2));
  for (const auto& b : bad) {
    SCOPED_TRACE(b.second);
    expect_invalid([&] { Module(8, 4, 4, 2, b.first); }, {"dropout", "[0, 1]", b.second});
    expect_invalid([&] { m.set_dropout(b.first); }, {"dropout", "[0, 1]", b.second});
    EXPECT_EQ(m.dropout(), T(0.2));
  }
}

TYPED_TEST(ModuleTest, ForwardRefusesBadInputsWithoutComputing) {
  using Module = typename TestFixture::Module;
  using Weights = typename TestFixture::Weights;
  Rng rng(18);
  Module m(8, 4, 3, 2, TypeParam(0.5));  // training, so a computed call would consume a dropout draw
  sdpa_test::randomize_module(m, rng);
  m.manual_seed(18);
  Module twin(m);
  twin.manual_seed(18);  // a copy takes a seed of its own; the same seed gives the same dropout stream
  const auto q = TestFixture::random3(rng, 2, 3, 8), k = TestFixture::random3(rng, 2, 4, 8),
             v = TestFixture::random3(rng, 2, 4, 8);

  expect_invalid([&] { m.forward(TestFixture::random3(rng, 2, 3, 7), k, v); }, {"queries", "d_model", "8", "(2, 3, 7)"});
  expect_invalid([&] { m.forward(q, TestFixture::random3(rng, 2, 4, 9), v); }, {"keys", "d_model", "8", "(2, 4, 9)"});
  expect_invalid([&] { m.forward(q, k, TestFixture::random3(rng, 2, 4, 5)); }, {"values", "d_model", "8", "(2, 4, 5)"});
  expect_invalid([&] { m.forward(q, k, TestFixture::random3(rng, 2, 5, 8)); },
                 {"values", "length", "4", "(2, 5, 8)"});
  expect_invalid([&] { m.forward(q, k, TestFixture::random3(rng, 2, 3, 8)); },
                 {"values", "length", "4", "(2, 3, 8)"});
  {
    const auto k3 = TestFixture::random3(rng, 3, 4, 8);
    expect_invalid([&] { m.forward(q, k3, k3); }, {"keys", "batch", "2", "(3, 4, 8)"});
  }
  expect_invalid([&] { m.forward(q, k, TestFixture::random3(rng, 1, 4, 8)); }, {"values", "batch", "2", "(1, 4, 8)"});

  const std::array<Index, 4> full{2, 2, 3, 4};
  for (int dim = 0; dim < 4; ++dim) {
    for (Index wrong : {full[static_cast<std::size_t>(dim)] + 1, Index{0}}) {
      std::array<Index, 4> d = full;
      d[static_cast<std::size_t>(dim)] = wrong;
      SCOPED_TRACE(::testing::Message() << "shape " << shape_str(d));
      const std::string dim_phrase = "dimension " + std::to_string(dim);
      const std::string expected = "1 or " + std::to_string(full[static_cast<std::size_t>(dim)]);
      const Mask mask = random_mask(rng, d, 0.2);
      expect_invalid([&] { m.forward(q, k, v, &mask); }, {"attention_mask", dim_phrase, expected, shape_str(d)});
      const Weights w = TestFixture::random_weights(rng, d);
      expect_invalid([&] { m.forward(q, k, v, nullptr, &w); },
                     {"attention_weights", dim_phrase, expected, shape_str(d)});
      // A good mask does not excuse bad weights, nor the other way round.
      const Mask good_mask = random_mask(rng, full, 0.2);
      expect_invalid([&] { m.forward(q, k, v, &good_mask, &w); }, {"attention_weights", dim_phrase});
      const Weights good_w = TestFixture::random_weights(rng, full);
      expect_invalid([&] { m.forward(q, k, v, &mask, &good_w); }, {"attention_mask", dim_phrase});
    }
  }
  // None of the refused calls drew a dropout mask: the next call matches a twin's first call.
  TestFixture::expect_identical(m.forward(q, k, v), twin.forward(q, k, v));
}

}  // namespace module_test
