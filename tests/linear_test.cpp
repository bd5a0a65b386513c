// Tests of sdpa::Linear (float and double): operator() on tensors of rank 1 to 4 against a plain loop,
// forward_rows with leading dimensions (padding neither read nor written), a thread pool, and the
// refusal of bad sizes and inputs.
#include "sdpa/linear.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "support/reference.hpp"

namespace linear_test {

using Index = Eigen::Index;
using sdpa_test::expect_invalid;
using sdpa_test::Rng;

template <typename T>
class LinearTest : public ::testing::Test {
 protected:
  static constexpr bool kFloat = std::is_same<T, float>::value;
  static double tol() { return kFloat ? 2e-6 : 1e-13; }

  static sdpa::Linear<T> make(Rng& rng, Index in, Index out) {
    sdpa::Linear<T> l(in, out);
    rng.fill_normal(l.weight(), 0.5);
    rng.fill_normal(l.bias(), 0.5);
    return l;
  }

  // Compares y (rows x out, row-major, leading dimension ldy) with the plain loop on x (rows x in, ldx).
  static void expect_matches_loop(const sdpa::Linear<T>& l, const T* x, Index ldx, const T* y, Index ldy, Index rows) {
    const auto p = sdpa_test::linear_params_of(l);
    for (Index r = 0; r < rows; ++r)
      for (Index o = 0; o < p.out; ++o) {
        double s = p.b[static_cast<std::size_t>(o)], mag = std::abs(s);
        for (Index i = 0; i < p.in; ++i) {
          const double t = static_cast<double>(x[r * ldx + i]) * p.w[static_cast<std::size_t>(o * p.in + i)];
          s += t;
          mag += std::abs(t);
        }
        ASSERT_NEAR(static_cast<double>(y[r * ldy + o]), s, tol() * std::max(1.0, mag)) << "row " << r << " out " << o;
      }
  }
};

using ScalarTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(LinearTest, ScalarTypes);

TYPED_TEST(LinearTest, StartsAtZeroWithPyTorchShapes) {
  sdpa::Linear<TypeParam> l(5, 3);
  EXPECT_EQ(l.in_features(), 5);
  EXPECT_EQ(l.out_features(), 3);
  ASSERT_EQ(l.weight().dimension(0), 3);  // (out, in)
  ASSERT_EQ(l.weight().dimension(1), 5);
  ASSERT_EQ(l.bias().dimension(0), 3);
  for (Index i = 0; i < l.weight().size(); ++i) EXPECT_EQ(l.weight().data()[i], TypeParam(0));
  for (Index i = 0; i < l.bias().size(); ++i) EXPECT_EQ(l.bias().data()[i], TypeParam(0));
}

TYPED_TEST(LinearTest, WeightIsOutByInRowMajor) {
  // y_o = sum_i W(o, i) x_i + b_o with W(o, i) as PyTorch indexes it.
  sdpa::Linear<TypeParam> l(2, 3);
  l.weight()(0, 0) = 1;
  l.weight()(0, 1) = 2;
  l.weight()(1, 0) = 3;
  l.weight()(1, 1) = 4;
  l.weight()(2, 0) = 5;
  l.weight()(2, 1) = 6;
  l.bias()(0) = 10;
  l.bias()(1) = 20;
  l.bias()(2) = 30;
  Eigen::Tensor<TypeParam, 1, Eigen::RowMajor> x(2);
  x(0) = 1;
  x(1) = -1;
  const auto y = l(x);
  ASSERT_EQ(y.dimension(0), 3);
  EXPECT_EQ(y(0), TypeParam(9));
  EXPECT_EQ(y(1), TypeParam(19));
  EXPECT_EQ(y(2), TypeParam(29));
}

TYPED_TEST(LinearTest, RankOneToFourAgainstLoop) {
  using T = TypeParam;
  Rng rng(21);
  const auto l = TestFixture::make(rng, 5, 3);
  {
    Eigen::Tensor<T, 1, Eigen::RowMajor> x(5);
    rng.fill_normal(x);
    const auto y = l(x);
    ASSERT_EQ(y.dimension(0), 3);
    TestFixture::expect_matches_loop(l, x.data(), 5, y.data(), 3, 1);
  }
  {
    Eigen::Tensor<T, 2, Eigen::RowMajor> x(4, 5);
    rng.fill_normal(x);
    const auto y = l(x);
    ASSERT_EQ(y.dimension(0), 4);
    ASSERT_EQ(y.dimension(1), 3);
    TestFixture::expect_matches_loop(l, x.data(), 5, y.data(), 3, 4);
  }
  {
    Eigen::Tensor<T, 3, Eigen::RowMajor> x(2, 3, 5);
    rng.fill_normal(x);
    const auto y = l(x);
    ASSERT_EQ(y.dimension(0), 2);
    ASSERT_EQ(y.dimension(1), 3);
    ASSERT_EQ(y.dimension(2), 3);
    TestFixture::expect_matches_loop(l, x.data(), 5, y.data(), 3, 6);
    // Element access agrees with the flat layout (row-major (2, 3, 3)).
    const auto p = sdpa_test::linear_params_of(l);
    double s = p.b[1];
    for (Index i = 0; i < 5; ++i) s += static_cast<double>(x(1, 2, i)) * p.w[static_cast<std::size_t>(5 + i)];
    EXPECT_NEAR(static_cast<double>(y(1, 2, 1)), s, 1e-5);
  }
  {
    Eigen::Tensor<T, 4, Eigen::RowMajor> x(2, 1, 3, 5);
    rng.fill_normal(x);
    const auto y = l(x);
    ASSERT_EQ(y.dimension(0), 2);
    ASSERT_EQ(y.dimension(1), 1);
    ASSERT_EQ(y.dimension(2), 3);
    ASSERT_EQ(y.dimension(3), 3);
    TestFixture::expect_matches_loop(l, x.data(), 5, y.data(), 3, 6);
  }
  {  // a TensorMap over a const buffer
    std::vector<T> buf(3 * 5);
    for (auto& b : buf) b = static_cast<T>(rng.normal());
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(buf.data(), 3, 5);
    const auto y = l(x);
    ASSERT_EQ(y.dimension(0), 3);
    ASSERT_EQ(y.dimension(1), 3);
    TestFixture::expect_matches_loop(l, buf.data(), 5, y.data(), 3, 3);
  }
  {  // empty leading dimension
    Eigen::Tensor<T, 3, Eigen::RowMajor> x(2, 0, 5);
    const auto y = l(x);
    EXPECT_EQ(y.dimension(0), 2);
    EXPECT_EQ(y.dimension(1), 0);
    EXPECT_EQ(y.dimension(2), 3);
  }
}

TYPED_TEST(LinearTest, LargerLayerAgainstLoop) {
  using T = TypeParam;
  Rng rng(22);
  const auto l = TestFixture::make(rng, 67, 45);
  Eigen::Tensor<T, 3, Eigen::RowMajor> x(3, 41, 67);
  rng.fill_normal(x);
  const auto y = l(x);
  TestFixture::expect_matches_loop(l, x.data(), 67, y.data(), 45, 123);
}

TYPED_TEST(LinearTest, ForwardRowsWithLeadingDimensions) {
  using T = TypeParam;
  Rng rng(23);
  const Index in = 6, out = 4, rows = 150, ldx = 9, ldy = 11, offset = 2;
  const auto l = TestFixture::make(rng, in, out);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  // x: padding columns are NaN, so reading them would poison the result.
  std::vector<T> x(static_cast<std::size_t>(rows * ldx), nan);
  for (Index r = 0; r < rows; ++r)
    for (Index i = 0; i < in; ++i) x[static_cast<std::size_t>(r * ldx + i)] = static_cast<T>(rng.normal());
  const T sentinel = T(-12345.5);
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  const Eigen::ThreadPoolDevice* devices[] = {nullptr, &device};
  for (const Eigen::ThreadPoolDevice* dev : devices) {
    SCOPED_TRACE(dev ? "2-thread device" : "no device");
    // y: the output is written at column `offset` of a wider buffer, with a spare row after the end.
    std::vector<T> y(static_cast<std::size_t>((rows + 1) * ldy), sentinel);
    l.forward_rows(x.data(), rows, ldx, y.data() + offset, ldy, dev);
    TestFixture::expect_matches_loop(l, x.data(), ldx, y.data() + offset, ldy, rows);
    for (Index r = 0; r <= rows; ++r)
      for (Index c = 0; c < ldy; ++c) {
        const bool written = r < rows && c >= offset && c < offset + out;
        if (!written) {
          ASSERT_EQ(y[static_cast<std::size_t>(r * ldy + c)], sentinel) << "row " << r << " col " << c;
        }
      }
  }
  // rows = 0 writes nothing.
  std::vector<T> y(8, sentinel);
  l.forward_rows(x.data(), 0, ldx, y.data(), ldy, &device);
  for (T v : y) EXPECT_EQ(v, sentinel);
}

TYPED_TEST(LinearTest, ThreadDeviceMatchesSerial) {
  using T = TypeParam;
  Rng rng(24);
  const auto l = TestFixture::make(rng, 33, 17);
  Eigen::Tensor<T, 2, Eigen::RowMajor> x(1000, 33);  // many chunks of >= 64 rows
  rng.fill_normal(x);
  const auto serial = l(x);
  for (int threads : {1, 2, 4}) {
    SCOPED_TRACE(threads);
    Eigen::ThreadPool pool(threads);
    Eigen::ThreadPoolDevice device(&pool, threads);
    const auto y = l(x, &device);
    ASSERT_EQ(y.dimension(0), 1000);
    ASSERT_EQ(y.dimension(1), 17);
    TestFixture::expect_matches_loop(l, x.data(), 33, y.data(), 17, 1000);
    double max_diff = 0.0;
    for (Index i = 0; i < y.size(); ++i)
      max_diff = std::max(max_diff, std::abs(static_cast<double>(y.data()[i]) - static_cast<double>(serial.data()[i])));
    EXPECT_LT(max_diff, TestFixture::kFloat ? 1e-5 : 1e-13);
  }
}

TYPED_TEST(LinearTest, RefusesNonPositiveFeatures) {
  using L = sdpa::Linear<TypeParam>;
  expect_invalid([] { L(0, 3); }, {"in_features", "positive", "0"});
  expect_invalid([] { L(3, 0); }, {"out_features", "positive", "0"});
  expect_invalid([] { L(0, 0); }, {"in_features", "positive"});
}

// Negative sizes must be refused like zero ones, with std::invalid_argument naming the argument, not
// fail inside Eigen's allocation.
TYPED_TEST(LinearTest, RefusesNegativeFeatures) {
  using L = sdpa::Linear<TypeParam>;
  expect_invalid([] { L(-1, 3); }, {"in_features", "positive", "-1"});
  expect_invalid([] { L(3, -2); }, {"out_features", "positive", "-2"});
  expect_invalid([] { L(-4, -4); }, {"in_features", "positive", "-4"});
}

// in_features * out_features must fit in Eigen::Index. Today Eigen computes the element count with a
// signed overflow (undefined behaviour; UBSan: "4611686018427387904 * 4 cannot be represented") and the
// constructor happens to end in std::bad_alloc; the layer should refuse the sizes itself, as the module
// does for h * d_k, before anything is computed.
TYPED_TEST(LinearTest, RefusesSizesWhoseProductOverflows) {
  using L = sdpa::Linear<TypeParam>;
  const Index huge = Index{1} << 62;
  expect_invalid([&] { L(huge, 4); }, {"in_features", "out_features", std::to_string(huge)});
  expect_invalid([&] { L(4, huge); }, {"in_features", "out_features", std::to_string(huge)});
}

TYPED_TEST(LinearTest, RefusesWrongInputLastDimension) {
  using T = TypeParam;
  sdpa::Linear<T> l(5, 3);
  Eigen::Tensor<T, 2, Eigen::RowMajor> x2(2, 4);
  x2.setZero();
  expect_invalid([&] { l(x2); }, {"last dimension", "5", "4", "(2, 4)"});
  Eigen::Tensor<T, 1, Eigen::RowMajor> x1(6);
  x1.setZero();
  expect_invalid([&] { l(x1); }, {"last dimension", "5", "6", "(6,)"});
  Eigen::Tensor<T, 4, Eigen::RowMajor> x4(1, 2, 5, 3);
  x4.setZero();
  expect_invalid([&] { l(x4); }, {"last dimension", "5", "(1, 2, 5, 3)"});
  Eigen::Tensor<T, 3, Eigen::RowMajor> x0(2, 0, 4);  // empty, still the wrong width
  expect_invalid([&] { l(x0); }, {"last dimension", "5", "(2, 0, 4)"});
}

// Which product backend the layer runs: with sdpa::onednn linked, float goes through oneDNN's sgemm exactly
// when the test binary is registered for it (SDPA_TEST_BACKEND=onednn, support/test_main.cpp); otherwise
// through sdpa's own products (this suite's default registrations cover those).
TEST(LinearTestBackend, FollowsTheRegistration) {
#ifdef SDPA_USE_ONEDNN
  const char* backend = std::getenv("SDPA_TEST_BACKEND");
  EXPECT_EQ(sdpa::onednn_projections(), backend != nullptr && std::string(backend) == "onednn");
#else
  GTEST_SKIP() << "built without sdpa::onednn";
#endif
}

}  // namespace linear_test
