// Dropout of sdpa::ScaledDotProductAttention in training mode (float and double): the documented
// counter-based mask (checked against the plain reference with a mask rebuilt from random.hpp's
// specification), independence from the thread count, fresh masks on every call, unbiasedness
// (the mean of many training outputs converges to the eval output), p = 0 and p = 1, manual_seed, eval().
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "support/reference.hpp"

namespace dropout_test {

using Index = Eigen::Index;
using sdpa::MaskedRows;
using sdpa_test::max_relative_error;
using sdpa_test::Rng;
using Mask = Eigen::Tensor<bool, 4, Eigen::RowMajor>;

template <typename T>
class DropoutTest : public ::testing::Test {
 protected:
  using Module = sdpa::ScaledDotProductAttention<T>;
  using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;
  static constexpr bool kFloat = std::is_same<T, float>::value;
  static double tol() { return kFloat ? 2e-5 : 1e-10; }

  static Tensor3 random3(Rng& rng, Index a, Index b, Index c) {
    Tensor3 t(a, b, c);
    rng.fill_normal(t);
    return t;
  }

  static bool identical(const Tensor3& a, const Tensor3& b) {
    for (int i = 0; i < 3; ++i)
      if (a.dimension(i) != b.dimension(i)) return false;
    for (Index i = 0; i < a.size(); ++i) {
      const T x = a.data()[i], y = b.data()[i];
      if (!(x == y || (std::isnan(x) && std::isnan(y)))) return false;
    }
    return true;
  }

  static void copy_parameters(const Module& from, Module& to) {
    for (const auto& p : from.named_parameters()) {
      auto q = to.parameter(p.name);
      ASSERT_EQ(p.shape, q.shape);
      for (Index i = 0; i < p.size(); ++i) q.data[i] = p.data[i];
    }
  }

  // The mask as random.hpp specifies it: element (b, h, q, k) of call `call` is dropped when word k % 4 of
  // philox4x32_10(counter = (k / 4, q, b * heads + h, call), key = seed) is below round(p * 2^32).
  static sdpa_test::DropoutFactor documented_mask(std::uint64_t seed, std::uint64_t call, T p_scalar, Index heads) {
    const double p = static_cast<double>(p_scalar);
    const std::uint64_t threshold =
        p >= 1.0 ? (std::uint64_t{1} << 32) : static_cast<std::uint64_t>(std::llround(p * 4294967296.0));
    const double keep = p >= 1.0 ? 0.0 : 1.0 / (1.0 - p);
    return [=](Index b, Index h, Index q, Index k) {
      const sdpa::PhiloxCounter ctr{static_cast<std::uint32_t>(k / 4), static_cast<std::uint32_t>(q),
                                    static_cast<std::uint32_t>(b * heads + h), static_cast<std::uint32_t>(call)};
      const sdpa::PhiloxKey key{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
      const std::uint32_t bits = sdpa::philox4x32_10(ctr, key)[static_cast<std::size_t>(k % 4)];
      return bits < threshold ? 0.0 : keep;
    };
  }
};

using ScalarTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(DropoutTest, ScalarTypes);

TYPED_TEST(DropoutTest, TrainingOutputMatchesReferenceWithDocumentedMask) {
  using T = TypeParam;
  Rng rng(31);
  typename TestFixture::Module m(10, 3, 4, 3, T(0.3));
  sdpa_test::randomize_module(m, rng);
  m.manual_seed(2024);
  const auto q = TestFixture::random3(rng, 2, 5, 10), k = TestFixture::random3(rng, 2, 9, 10),
             v = TestFixture::random3(rng, 2, 9, 10);
  const Mask pad = sdpa::key_padding_mask({6, 0}, 9);  // batch 1 fully masked
  for (std::uint64_t call = 0; call < 3; ++call) {
    SCOPED_TRACE(call);
    const bool with_mask = call == 2;
    const Mask* mask = with_mask ? &pad : nullptr;
    const auto out = m.forward(q, k, v, mask);
    const auto factor = TestFixture::documented_mask(2024, call, m.dropout(), 3);
    const Eigen::Tensor<T, 4, Eigen::RowMajor>* no_weights = nullptr;
    const auto ref = sdpa_test::reference_forward(m, q, k, v, mask, no_weights, false, &factor);
    EXPECT_LT(max_relative_error(out, ref), TestFixture::tol());
    // And it is not the no-dropout result.
    const auto plain = sdpa_test::reference_forward(m, q, k, v, mask);
    EXPECT_GT(max_relative_error(out, plain), 1e-3);
    if (with_mask) {
      for (Index i = 0; i < 5; ++i)
        for (Index d = 0; d < 10; ++d) EXPECT_EQ(out(1, i, d), m.fc_o().bias()(d));
    }
  }
}

TYPED_TEST(DropoutTest, SameSeedSameOutputsOnOneAndTwoThreads) {
  using T = TypeParam;
  using Module = typename TestFixture::Module;
  Rng rng(32);
  // d_model = h * d_v and fc_o = identity with zero bias: output segment (b, q, head) is exactly zero iff
  // dropout removed every key of that (b, head, q), whatever the rounding of the projections.
  const Index h = 4, d_v = 2, d_model = 8, nk = 2, batch = 2, nq = 80;  // 160 rows: projections split too
  Module a(d_model, 3, d_v, h, T(0.5));
  sdpa_test::randomize_module(a, rng);
  a.fc_o().weight().setZero();
  for (Index i = 0; i < d_model; ++i) a.fc_o().weight()(i, i) = T(1);
  a.fc_o().bias().setZero();
  a.manual_seed(99);
  Module b(a);
  b.manual_seed(99);  // a copy takes a seed of its own
  const auto q = TestFixture::random3(rng, batch, nq, d_model), k = TestFixture::random3(rng, batch, nk, d_model),
             v = TestFixture::random3(rng, batch, nk, d_model);
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  Index zero_segments = 0, total_segments = 0;
  for (int call = 0; call < 3; ++call) {
    SCOPED_TRACE(call);
    const auto serial = a.forward(q, k, v);
    const auto threaded = b.forward(q, k, v, nullptr, nullptr, &device);
    EXPECT_LT(max_relative_error(threaded, sdpa_test::to_array3(serial)), TestFixture::kFloat ? 1e-6 : 1e-12);
    for (Index bi = 0; bi < batch; ++bi)
      for (Index i = 0; i < nq; ++i)
        for (Index hh = 0; hh < h; ++hh) {
          bool serial_zero = true, threaded_zero = true;
          for (Index d = 0; d < d_v; ++d) {
            serial_zero &= serial(bi, i, hh * d_v + d) == T(0);
            threaded_zero &= threaded(bi, i, hh * d_v + d) == T(0);
          }
          ASSERT_EQ(serial_zero, threaded_zero) << "b=" << bi << " q=" << i << " head=" << hh;
          zero_segments += serial_zero;
          ++total_segments;
        }
  }
  // With nk = 2 and p = 0.5 about a quarter of the segments lose both keys.
  EXPECT_GT(zero_segments, total_segments / 8);
  EXPECT_LT(zero_segments, total_segments / 2);
}

TYPED_TEST(DropoutTest, SuccessiveCallsDrawNewMasks) {
  using T = TypeParam;
  Rng rng(33);
  typename TestFixture::Module m(8, 4, 4, 2, T(0.2));
  sdpa_test::randomize_module(m, rng);
  const auto q = TestFixture::random3(rng, 2, 4, 8), k = TestFixture::random3(rng, 2, 5, 8);
  const auto o1 = m.forward(q, k, k), o2 = m.forward(q, k, k), o3 = m.forward(q, k, k);
  EXPECT_FALSE(TestFixture::identical(o1, o2));
  EXPECT_FALSE(TestFixture::identical(o2, o3));
  EXPECT_FALSE(TestFixture::identical(o1, o3));
  m.eval();
  const auto e = m.forward(q, k, k);
  EXPECT_FALSE(TestFixture::identical(o1, e));
}

TYPED_TEST(DropoutTest, MeanOfTrainingOutputsConvergesToEval) {
  using T = TypeParam;
  Rng rng(34);
  typename TestFixture::Module m(4, 2, 2, 2, T(0.3));
  sdpa_test::randomize_module(m, rng, 0.8);
  const auto q = TestFixture::random3(rng, 1, 2, 4), k = TestFixture::random3(rng, 1, 3, 4);
  const int n = 2000;
  const Index size = 1 * 2 * 4;
  std::vector<double> sum(static_cast<std::size_t>(size), 0.0), sq(static_cast<std::size_t>(size), 0.0);
  for (int c = 0; c < n; ++c) {
    const auto o = m.forward(q, k, k);
    for (Index i = 0; i < size; ++i) {
      sum[static_cast<std::size_t>(i)] += static_cast<double>(o.data()[i]);
      sq[static_cast<std::size_t>(i)] += static_cast<double>(o.data()[i]) * static_cast<double>(o.data()[i]);
    }
  }
  m.eval();
  const auto e = m.forward(q, k, k);
  const auto r = sdpa_test::reference_forward(m, q, k, k);
  for (Index i = 0; i < size; ++i) {
    const double mean = sum[static_cast<std::size_t>(i)] / n;
    const double var = (sq[static_cast<std::size_t>(i)] - n * mean * mean) / (n - 1);
    const double se = std::sqrt(std::max(var, 0.0) / n);
    EXPECT_GT(se, 1e-4) << "element " << i << ": dropout had no effect";
    EXPECT_NEAR(mean, static_cast<double>(e.data()[i]), 5 * se + 1e-6) << "element " << i;
    EXPECT_NEAR(static_cast<double>(e.data()[i]), r.v[static_cast<std::size_t>(i)], 1e-5);
  }
}

TYPED_TEST(DropoutTest, ZeroProbabilityInTrainingEqualsEvalExactly) {
  using T = TypeParam;
  Rng rng(35);
  typename TestFixture::Module m(8, 4, 4, 2, T(0));
  sdpa_test::randomize_module(m, rng);
  ASSERT_TRUE(m.is_training());
  const auto q = TestFixture::random3(rng, 2, 4, 8), k = TestFixture::random3(rng, 2, 5, 8);
  const auto t1 = m.forward(q, k, k), t2 = m.forward(q, k, k);
  m.eval();
  const auto e = m.forward(q, k, k);
  EXPECT_TRUE(TestFixture::identical(t1, e));
  EXPECT_TRUE(TestFixture::identical(t2, e));
  m.train();
  m.set_dropout(T(0.5));
  EXPECT_FALSE(TestFixture::identical(m.forward(q, k, k), e));
  m.set_dropout(T(0));
  EXPECT_TRUE(TestFixture::identical(m.forward(q, k, k), e));
}

TYPED_TEST(DropoutTest, ProbabilityOneLeavesOnlyTheOutputBias) {
  using T = TypeParam;
  Rng rng(36);
  typename TestFixture::Module m(6, 3, 2, 3, T(1));
  sdpa_test::randomize_module(m, rng);
  const auto q = TestFixture::random3(rng, 2, 4, 6), k = TestFixture::random3(rng, 2, 5, 6);
  for (int call = 0; call < 2; ++call) {
    const auto o = m.forward(q, k, k);
    for (Index b = 0; b < 2; ++b)
      for (Index i = 0; i < 4; ++i)
        for (Index d = 0; d < 6; ++d) ASSERT_EQ(o(b, i, d), m.fc_o().bias()(d)) << b << "," << i << "," << d;
  }
  m.eval();
  const auto e = m.forward(q, k, k);
  EXPECT_NE(e(0, 0, 0), m.fc_o().bias()(0));
}

TYPED_TEST(DropoutTest, ManualSeedRestartsTheSequence) {
  using T = TypeParam;
  using Module = typename TestFixture::Module;
  Rng rng(37);
  Module a(8, 4, 4, 2, T(0.4));
  sdpa_test::randomize_module(a, rng);
  const auto q = TestFixture::random3(rng, 2, 4, 8), k = TestFixture::random3(rng, 2, 5, 8);
  a.manual_seed(5);
  const auto o1 = a.forward(q, k, k), o2 = a.forward(q, k, k);
  ASSERT_FALSE(TestFixture::identical(o1, o2));
  a.manual_seed(5);
  EXPECT_TRUE(TestFixture::identical(a.forward(q, k, k), o1));
  EXPECT_TRUE(TestFixture::identical(a.forward(q, k, k), o2));

  Module fresh(8, 4, 4, 2, T(0.4));
  TestFixture::copy_parameters(a, fresh);
  fresh.manual_seed(5);
  EXPECT_TRUE(TestFixture::identical(fresh.forward(q, k, k), o1));
  EXPECT_TRUE(TestFixture::identical(fresh.forward(q, k, k), o2));

  Module other(8, 4, 4, 2, T(0.4));
  TestFixture::copy_parameters(a, other);
  other.manual_seed(6);
  EXPECT_FALSE(TestFixture::identical(other.forward(q, k, k), o1));
}

TYPED_TEST(DropoutTest, EvalIgnoresDropoutAndDoesNotAdvanceTheStream) {
  using T = TypeParam;
  using Module = typename TestFixture::Module;
  Rng rng(38);
  Module a(8, 4, 4, 2, T(0.6));
  sdpa_test::randomize_module(a, rng);
  const auto q = TestFixture::random3(rng, 2, 4, 8), k = TestFixture::random3(rng, 2, 5, 8);
  Module b(a);
  a.manual_seed(9);
  b.manual_seed(9);
  a.eval();
  const auto e1 = a.forward(q, k, k), e2 = a.forward(q, k, k), e3 = a.forward(q, k, k);
  EXPECT_TRUE(TestFixture::identical(e1, e2));
  EXPECT_TRUE(TestFixture::identical(e1, e3));
  EXPECT_LT(max_relative_error(e1, sdpa_test::reference_forward(a, q, k, k)), TestFixture::tol());
  a.train();
  EXPECT_TRUE(TestFixture::identical(a.forward(q, k, k), b.forward(q, k, k)));
}

}  // namespace dropout_test
