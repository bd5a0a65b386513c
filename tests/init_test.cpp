// Tests for sdpa/init.hpp: fans and gains against numbers printed by PyTorch 1.13 (Debian's
// /usr/bin/python3), every strategy and both policies checked statistically on large tensors, exact
// fills, reproducibility under a Philox seed, layout independence, and the refusal of bad parameters.
// Statistics are computed by non-template helpers on std::vector<double> to keep compilation quick.
#include "sdpa/init.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace init_test {

using sdpa::Fans;
using sdpa::FanMode;
using sdpa::Nonlinearity;
using sdpa::Philox;
namespace init = sdpa::init;

template <typename T>
using Matrix = Eigen::Tensor<T, 2, Eigen::RowMajor>;
template <typename T>
using Vector = Eigen::Tensor<T, 1, Eigen::RowMajor>;
template <typename T>
using Conv = Eigen::Tensor<T, 4, Eigen::RowMajor>;

struct Stats {
  double mean = 0.0;
  double std = 0.0;
  double min = 0.0;
  double max = 0.0;
  std::size_t n = 0;
};

Stats stats_of(const std::vector<double>& v) {
  Stats s;
  s.n = v.size();
  if (v.empty()) return s;
  double sum = 0.0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(s.n);
  double sq = 0.0;
  for (double x : v) sq += (x - s.mean) * (x - s.mean);
  s.std = std::sqrt(sq / static_cast<double>(s.n - 1));
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  return s;
}

template <typename TensorT>
std::vector<double> values_of(const TensorT& t) {
  return std::vector<double>(t.data(), t.data() + t.size());
}

template <typename TensorT>
Stats stats_of_tensor(const TensorT& t) {
  return stats_of(values_of(t));
}

// Mean within 5 standard errors, sample std within 2% of the theoretical one.
void expect_moments(const Stats& s, double mean, double std, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_GT(s.n, 1000u);
  EXPECT_NEAR(s.mean, mean, 5.0 * std / std::sqrt(static_cast<double>(s.n)));
  EXPECT_NEAR(s.std / std, 1.0, 0.02) << "sample std " << s.std << ", expected " << std;
}

// U[lo, hi]: never outside (lo and hi as the tensor's scalar represents them), close to both ends,
// and the moments of a uniform distribution.
void expect_uniform(const Stats& s, double lo, double hi, double lo_scalar, double hi_scalar, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_GE(s.min, lo_scalar);
  EXPECT_LE(s.max, hi_scalar);
  EXPECT_LT(s.min, lo + 0.01 * (hi - lo));
  EXPECT_GT(s.max, hi - 0.01 * (hi - lo));
  expect_moments(s, 0.5 * (lo + hi), (hi - lo) / std::sqrt(12.0), what);
}

template <typename T>
void expect_uniform_t(const Stats& s, double lo, double hi, const std::string& what) {
  expect_uniform(s, lo, hi, static_cast<double>(static_cast<T>(lo)), static_cast<double>(static_cast<T>(hi)), what);
}

void expect_all_equal(const std::vector<double>& v, double value) {
  ASSERT_FALSE(v.empty());
  std::size_t wrong = 0;
  for (double x : v) wrong += (x != value);
  EXPECT_EQ(wrong, 0u) << "elements not equal to " << value;
}

void expect_invalid(const std::function<void()>& fn, const std::vector<std::string>& message_parts) {
  try {
    fn();
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    for (const std::string& part : message_parts)
      EXPECT_NE(message.find(part), std::string::npos) << "message \"" << message << "\" lacks \"" << part << "\"";
  } catch (...) {
    ADD_FAILURE() << "expected std::invalid_argument, got another exception";
  }
}

// ---------------------------------------------------------------------------------------------------
// compute_fans and calculate_gain: expected values printed by PyTorch, not derived from the header.

struct FanCase {
  std::vector<Eigen::Index> dims;
  Eigen::Index fan_in;
  Eigen::Index fan_out;
};

TEST(ComputeFans, MatchesPyTorchForRanksTwoToFive) {
  // /usr/bin/python3 -c "import torch; f = torch.nn.init._calculate_fan_in_and_fan_out;
  //   [print(s, f(torch.empty(*s))) for s in [(64,3,7,5),(256,512),(10,20),(1,1),(8,6,5),(3,4,0),
  //   (16,8,3,3),(2,3,4,5,6)]]"
  // (torch 1.13.0a0) printed:
  const std::vector<FanCase> cases = {
      {{64, 3, 7, 5}, 105, 2240}, {{256, 512}, 512, 256},   {{10, 20}, 20, 10},         {{1, 1}, 1, 1},
      {{8, 6, 5}, 30, 40},        {{3, 4, 0}, 0, 0},        {{16, 8, 3, 3}, 72, 144},   {{2, 3, 4, 5, 6}, 360, 240},
  };
  for (const FanCase& c : cases) {
    const Fans fans = sdpa::compute_fans(c.dims.data(), static_cast<int>(c.dims.size()));
    EXPECT_EQ(fans.fan_in, c.fan_in) << sdpa::detail::shape_string(c.dims);
    EXPECT_EQ(fans.fan_out, c.fan_out) << sdpa::detail::shape_string(c.dims);
  }
}

TEST(ComputeFans, RefusesRankBelowTwoNamingTheRank) {
  // PyTorch: "Fan in and fan out can not be computed for tensor with fewer than 2 dimensions".
  const Eigen::Index dims[] = {64};
  expect_invalid([&] { sdpa::compute_fans(dims, 1); }, {"compute_fans", "rank", "but is 1"});
  expect_invalid([&] { sdpa::compute_fans(dims, 0); }, {"compute_fans", "rank", "but is 0"});
  expect_invalid([&] { sdpa::compute_fans(Eigen::Tensor<float, 1>(64)); }, {"rank", "but is 1"});
  expect_invalid([&] { sdpa::compute_fans(Eigen::Tensor<double, 0>()); }, {"rank", "but is 0"});
  expect_invalid([] { sdpa::compute_fans(nullptr, 2); }, {"dims"});
  const Eigen::Index negative[] = {4, -1};
  expect_invalid([&] { sdpa::compute_fans(negative, 2); }, {"dimension", "(4, -1)"});
}

TEST(CalculateGain, MatchesPyTorch) {
  // /usr/bin/python3 -c "import torch, math; g = torch.nn.init.calculate_gain;
  //   [print(n, repr(g(n))) for n in ['linear','conv1d','conv2d','conv3d','conv_transpose1d',
  //   'conv_transpose2d','conv_transpose3d','sigmoid','tanh','relu','selu']];
  //   [print(a, repr(g('leaky_relu', a))) for a in [None, 0, 0.01, 0.2, math.sqrt(5), -1.5]]"
  for (Nonlinearity n : {Nonlinearity::kLinear, Nonlinearity::kConv1d, Nonlinearity::kConv2d, Nonlinearity::kConv3d,
                         Nonlinearity::kConvTranspose1d, Nonlinearity::kConvTranspose2d,
                         Nonlinearity::kConvTranspose3d, Nonlinearity::kSigmoid})
    EXPECT_EQ(sdpa::calculate_gain(n), 1.0) << static_cast<int>(n);
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kTanh), 1.6666666666666667);
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kRelu), 1.4142135623730951);
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kSelu), 0.75);
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kLeakyRelu), 1.4141428569978354);  // param None -> 0.01
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kLeakyRelu, 0.0), 1.4142135623730951);
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kLeakyRelu, 0.01), 1.4141428569978354);
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kLeakyRelu, 0.2), 1.3867504905630728);
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kLeakyRelu, std::sqrt(5.0)), 0.5773502691896257);
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kLeakyRelu, -1.5), 0.7844645405527362);
  // The slope only matters for leaky ReLU.
  EXPECT_DOUBLE_EQ(sdpa::calculate_gain(Nonlinearity::kTanh, 0.2), 1.6666666666666667);
}

TEST(CalculateGain, RefusesNonFiniteSlopeAndUnknownNonlinearity) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  expect_invalid([&] { sdpa::calculate_gain(Nonlinearity::kLeakyRelu, nan); }, {"calculate_gain", "param"});
  expect_invalid([&] { sdpa::calculate_gain(Nonlinearity::kLeakyRelu, inf); }, {"calculate_gain", "inf"});
  expect_invalid([] { sdpa::calculate_gain(static_cast<Nonlinearity>(99)); }, {"nonlinearity", "99"});
}

// ---------------------------------------------------------------------------------------------------
// Strategies, typed over the scalar.

template <typename T>
class InitTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(InitTest, Scalars);

TYPED_TEST(InitTest, ComputeFansReadsPyTorchOrderWhateverTheLayout) {
  using T = TypeParam;
  // Same PyTorch command as MatchesPyTorchForRanksTwoToFive: (64,3,7,5) -> (105, 2240), (8,6,5) -> (30, 40).
  const Eigen::Tensor<T, 4, Eigen::RowMajor> row(64, 3, 7, 5);
  const Eigen::Tensor<T, 4, Eigen::ColMajor> col(64, 3, 7, 5);
  for (const Fans& f : {sdpa::compute_fans(row), sdpa::compute_fans(col)}) {
    EXPECT_EQ(f.fan_in, 105);
    EXPECT_EQ(f.fan_out, 2240);
  }
  std::vector<T> storage(8 * 6 * 5);
  const Eigen::TensorMap<Eigen::Tensor<T, 3, Eigen::RowMajor>> map(storage.data(), 8, 6, 5);
  EXPECT_EQ(sdpa::compute_fans(map).fan_in, 30);
  EXPECT_EQ(sdpa::compute_fans(map).fan_out, 40);
  const Matrix<T> m(256, 512);
  EXPECT_EQ(sdpa::compute_fans(m).fan_in, 512);
  EXPECT_EQ(sdpa::compute_fans(m).fan_out, 256);
}

TYPED_TEST(InitTest, ConstantZerosOnesAreExact) {
  using T = TypeParam;
  Philox gen(1);
  Eigen::Tensor<T, 3, Eigen::ColMajor> t(3, 4, 5);
  t.setConstant(T(9));
  init::Constant{-2.5}(t, gen);
  expect_all_equal(values_of(t), -2.5);
  init::Constant{0.375}(t);  // without a generator
  expect_all_equal(values_of(t), 0.375);
  init::Zeros{}(t, gen);
  expect_all_equal(values_of(t), 0.0);
  init::Ones{}(t, gen);
  expect_all_equal(values_of(t), 1.0);
  init::Zeros{}(t);
  expect_all_equal(values_of(t), 0.0);
  init::Ones{}(t);
  expect_all_equal(values_of(t), 1.0);
  init::apply(init::Constant{4.0}, t, gen);
  expect_all_equal(values_of(t), 4.0);
  // Constant draws nothing, so the generator is where it started.
  EXPECT_EQ(gen(), Philox(1)());
  Eigen::Tensor<T, 0> scalar;
  init::Constant{7.0}(scalar);
  EXPECT_EQ(scalar(), T(7));
}

TYPED_TEST(InitTest, NormalHasTheRequestedMoments) {
  using T = TypeParam;
  Philox gen(11);
  Matrix<T> t(256, 512);
  init::Normal{}(t, gen);
  expect_moments(stats_of_tensor(t), 0.0, 1.0, "Normal{}");
  init::Normal{0.5, 2.0}(t, gen);
  expect_moments(stats_of_tensor(t), 0.5, 2.0, "Normal{0.5, 2}");
  init::Normal{-3.0, 0.0}(t, gen);
  expect_all_equal(values_of(t), -3.0);
}

TYPED_TEST(InitTest, UniformStaysInRangeAndReachesBothEnds) {
  using T = TypeParam;
  Philox gen(12);
  Matrix<T> t(256, 512);
  init::Uniform{}(t, gen);
  expect_uniform_t<T>(stats_of_tensor(t), 0.0, 1.0, "Uniform{}");
  init::Uniform{-3.0, 5.0}(t, gen);
  expect_uniform_t<T>(stats_of_tensor(t), -3.0, 5.0, "Uniform{-3, 5}");
  init::Uniform{2.0, 2.0}(t, gen);
  expect_all_equal(values_of(t), 2.0);
}

TYPED_TEST(InitTest, XavierUsesBothFans) {
  using T = TypeParam;
  Philox gen(13);
  Matrix<T> t(256, 512);  // fan_in 512, fan_out 256
  init::XavierUniform{}(t, gen);
  const double bound = std::sqrt(6.0 / (512 + 256));
  expect_uniform_t<T>(stats_of_tensor(t), -bound, bound, "XavierUniform{}");
  init::XavierUniform{2.0}(t, gen);
  expect_uniform_t<T>(stats_of_tensor(t), -2.0 * bound, 2.0 * bound, "XavierUniform{2}");

  init::XavierNormal{}(t, gen);
  expect_moments(stats_of_tensor(t), 0.0, std::sqrt(2.0 / (512 + 256)), "XavierNormal{}");
  Conv<T> w(128, 64, 3, 3);  // fan_in 576, fan_out 1152
  init::XavierNormal{1.5}(w, gen);
  expect_moments(stats_of_tensor(w), 0.0, 1.5 * std::sqrt(2.0 / (576 + 1152)), "XavierNormal{1.5} conv");
}

TYPED_TEST(InitTest, KaimingUniformFollowsModeAndGain) {
  using T = TypeParam;
  Philox gen(14);
  Matrix<T> t(256, 512);
  init::KaimingUniform{}(t, gen);  // leaky_relu a = 0 -> gain sqrt(2), fan_in 512
  double bound = std::sqrt(2.0) * std::sqrt(3.0 / 512);
  expect_uniform_t<T>(stats_of_tensor(t), -bound, bound, "KaimingUniform{}");

  init::KaimingUniform{0.0, FanMode::kFanOut, Nonlinearity::kTanh}(t, gen);  // fan_out 256
  bound = (5.0 / 3.0) * std::sqrt(3.0 / 256);
  expect_uniform_t<T>(stats_of_tensor(t), -bound, bound, "KaimingUniform fan_out tanh");

  Conv<T> w(128, 64, 3, 3);
  init::KaimingUniform{0.2, FanMode::kFanIn, Nonlinearity::kLeakyRelu}(w, gen);  // fan_in 576
  bound = std::sqrt(2.0 / 1.04) * std::sqrt(3.0 / 576);
  expect_uniform_t<T>(stats_of_tensor(w), -bound, bound, "KaimingUniform a=0.2 conv");
}

TYPED_TEST(InitTest, KaimingNormalFollowsModeAndGain) {
  using T = TypeParam;
  Philox gen(15);
  Matrix<T> t(256, 512);
  init::KaimingNormal{}(t, gen);
  expect_moments(stats_of_tensor(t), 0.0, std::sqrt(2.0) / std::sqrt(512.0), "KaimingNormal{}");
  init::KaimingNormal{0.0, FanMode::kFanOut}(t, gen);
  expect_moments(stats_of_tensor(t), 0.0, std::sqrt(2.0) / std::sqrt(256.0), "KaimingNormal fan_out");
  Conv<T> w(128, 64, 3, 3);
  init::KaimingNormal{0.0, FanMode::kFanOut, Nonlinearity::kLinear}(w, gen);  // fan_out 1152
  expect_moments(stats_of_tensor(w), 0.0, 1.0 / std::sqrt(1152.0), "KaimingNormal fan_out linear conv");
}

TYPED_TEST(InitTest, LinearDefaultIsUniformOverOneOverSqrtFanIn) {
  using T = TypeParam;
  Philox gen(16);
  Matrix<T> w(256, 512);
  init::LinearDefaultWeight{}(w, gen);
  const double bound = 1.0 / std::sqrt(512.0);
  expect_uniform_t<T>(stats_of_tensor(w), -bound, bound, "LinearDefaultWeight");

  Vector<T> b(100000);
  init::LinearDefaultBias{512}(b, gen);
  expect_uniform_t<T>(stats_of_tensor(b), -bound, bound, "LinearDefaultBias{512}");
  init::LinearDefaultBias{0}(b, gen);  // PyTorch: bound 0 when fan_in is 0
  expect_all_equal(values_of(b), 0.0);
}

TYPED_TEST(InitTest, ExternalAttentionPolicy) {
  using T = TypeParam;
  const init::ExternalAttentionPolicy policy;
  Philox gen(17);
  Matrix<T> w(1024, 128);
  Vector<T> b(1024);
  b.setConstant(T(7));
  policy.linear(w, b, gen);
  expect_moments(stats_of_tensor(w), 0.0, 0.001, "linear weight");
  expect_all_equal(values_of(b), 0.0);
  b.setConstant(T(7));
  policy.linear(w, &b, gen);
  expect_all_equal(values_of(b), 0.0);
  policy.linear(w, nullptr, gen);
  expect_moments(stats_of_tensor(w), 0.0, 0.001, "linear weight without bias");

  Conv<T> c(128, 64, 3, 3);  // kaiming_normal_(mode='fan_out'): std sqrt(2 / (128 * 9))
  Vector<T> cb(128);
  cb.setConstant(T(7));
  policy.conv(c, &cb, gen);
  expect_moments(stats_of_tensor(c), 0.0, std::sqrt(2.0 / 1152.0), "conv weight");
  expect_all_equal(values_of(cb), 0.0);
  cb.setConstant(T(7));
  policy.conv(c, cb, gen);
  expect_all_equal(values_of(cb), 0.0);
  Vector<T>* no_bias = nullptr;
  policy.conv(c, no_bias, gen);
  policy.conv(c, nullptr, gen);
  expect_moments(stats_of_tensor(c), 0.0, std::sqrt(2.0 / 1152.0), "conv weight without bias");

  Vector<T> gamma(32), beta(32);
  gamma.setConstant(T(3));
  beta.setConstant(T(3));
  policy.batch_norm(gamma, beta);
  expect_all_equal(values_of(gamma), 1.0);
  expect_all_equal(values_of(beta), 0.0);
}

TYPED_TEST(InitTest, PyTorchDefaultPolicy) {
  using T = TypeParam;
  const init::PyTorchDefaultPolicy policy;
  Philox gen(18);
  Matrix<T> w(1024, 128);  // nn.Linear(128, 1024): everything in U(-1/sqrt(128), 1/sqrt(128))
  Vector<T> b(1024);
  policy.linear(w, b, gen);
  double bound = 1.0 / std::sqrt(128.0);
  expect_uniform_t<T>(stats_of_tensor(w), -bound, bound, "linear weight");
  const Stats bias = stats_of_tensor(b);
  EXPECT_GE(bias.min, static_cast<double>(static_cast<T>(-bound)));
  EXPECT_LE(bias.max, static_cast<double>(static_cast<T>(bound)));
  EXPECT_NEAR(bias.std, bound / std::sqrt(3.0), 0.1 * bound / std::sqrt(3.0));  // 1024 samples: ~3.5 SE
  policy.linear(w, nullptr, gen);
  expect_uniform_t<T>(stats_of_tensor(w), -bound, bound, "linear weight without bias");

  Conv<T> c(1024, 16, 3, 3);  // nn.Conv2d(16, 1024, 3): fan_in 144, fan_out 9216
  Vector<T> cb(1024);
  cb.setZero();
  policy.conv(c, &cb, gen);
  bound = 1.0 / std::sqrt(144.0);
  expect_uniform_t<T>(stats_of_tensor(c), -bound, bound, "conv weight");
  const Stats conv_bias = stats_of_tensor(cb);
  EXPECT_GE(conv_bias.min, static_cast<double>(static_cast<T>(-bound)));
  EXPECT_LE(conv_bias.max, static_cast<double>(static_cast<T>(bound)));
  EXPECT_NEAR(conv_bias.std, bound / std::sqrt(3.0), 0.1 * bound / std::sqrt(3.0));
  Vector<T>* no_bias = nullptr;
  policy.conv(c, no_bias, gen);
  policy.conv(c, nullptr, gen);
  expect_uniform_t<T>(stats_of_tensor(c), -bound, bound, "conv weight without bias");

  Vector<T> gamma(32), beta(32);
  gamma.setConstant(T(3));
  beta.setConstant(T(3));
  policy.batch_norm(gamma, beta);
  expect_all_equal(values_of(gamma), 1.0);
  expect_all_equal(values_of(beta), 0.0);
}

TYPED_TEST(InitTest, SameSeedSameTensorOtherSeedOrStreamDiffers) {
  using T = TypeParam;
  auto draw = [](Philox gen) {
    Matrix<T> t(64, 48);
    init::KaimingUniform{}(t, gen);
    return values_of(t);
  };
  const std::vector<double> a = draw(Philox(42));
  EXPECT_EQ(a, draw(Philox(42)));
  EXPECT_NE(a, draw(Philox(43)));
  EXPECT_NE(a, draw(Philox(42, 1)));

  // Consecutive calls continue the stream rather than repeat it.
  Philox gen(42);
  Matrix<T> first(64, 48), second(64, 48);
  init::Normal{}(first, gen);
  init::Normal{}(second, gen);
  EXPECT_NE(values_of(first), values_of(second));
}

TYPED_TEST(InitTest, LayoutAndMapDoNotChangeTheLogicalTensor) {
  using T = TypeParam;
  Eigen::Tensor<T, 3, Eigen::RowMajor> row(4, 5, 6);
  Eigen::Tensor<T, 3, Eigen::ColMajor> col(4, 5, 6);
  std::vector<T> storage(4 * 5 * 6);
  Eigen::TensorMap<Eigen::Tensor<T, 3, Eigen::ColMajor>> map(storage.data(), 4, 5, 6);
  Philox g1(5), g2(5), g3(5);
  init::Normal{}(row, g1);
  init::Normal{}(col, g2);
  init::Normal{}(map, g3);
  int mismatches = 0;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 5; ++j)
      for (int k = 0; k < 6; ++k) mismatches += (row(i, j, k) != col(i, j, k)) + (row(i, j, k) != map(i, j, k));
  EXPECT_EQ(mismatches, 0);
  // And the first draw is element (0, 0, 0), the second (0, 0, 1): PyTorch's row-major order.
  Philox g4(5);
  EXPECT_EQ(col(0, 0, 0), static_cast<T>(sdpa::normal_double(g4)));
  EXPECT_EQ(col(0, 0, 1), static_cast<T>(sdpa::normal_double(g4)));
}

TYPED_TEST(InitTest, ZeroElementTensorsAreLeftAlone) {
  using T = TypeParam;
  Philox gen(3);
  Matrix<T> empty(0, 16);
  Conv<T> none(0, 0, 3, 3);
  init::KaimingNormal{}(none, gen);
  init::XavierUniform{}(none, gen);
  init::XavierUniform{}(empty, gen);
  init::XavierNormal{}(empty, gen);
  init::KaimingUniform{}(empty, gen);
  init::KaimingNormal{}(empty, gen);
  init::Normal{}(empty, gen);
  init::Uniform{}(empty, gen);
  EXPECT_EQ(gen(), Philox(3)());  // nothing drawn
}

TYPED_TEST(InitTest, BadParametersThrowAndLeaveTheTensorAlone) {
  using T = TypeParam;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  Philox gen(4);
  Matrix<T> t(3, 4);
  t.setConstant(T(9));
  expect_invalid([&] { init::Normal{0.0, -1.0}(t, gen); }, {"init::Normal", "std", "non-negative", "-1"});
  expect_invalid([&] { init::Normal{nan, 1.0}(t, gen); }, {"init::Normal", "mean", "finite"});
  expect_invalid([&] { init::Normal{0.0, inf}(t, gen); }, {"init::Normal", "std", "finite"});
  expect_invalid([&] { init::Uniform{1.0, 0.0}(t, gen); }, {"init::Uniform", "b", "at least a"});
  expect_invalid([&] { init::Uniform{nan, 1.0}(t, gen); }, {"init::Uniform", "a", "finite"});
  expect_invalid([&] { init::Uniform{0.0, inf}(t, gen); }, {"init::Uniform", "b", "finite"});
  const double huge = std::numeric_limits<double>::max();
  expect_invalid([&] { init::Uniform{-huge, huge}(t, gen); }, {"init::Uniform", "b - a"});
  expect_invalid([&] { init::XavierUniform{-1.0}(t, gen); }, {"init::XavierUniform", "gain", "non-negative"});
  expect_invalid([&] { init::XavierNormal{nan}(t, gen); }, {"init::XavierNormal", "gain", "finite"});
  expect_invalid([&] { init::KaimingUniform{nan}(t, gen); }, {"init::KaimingUniform", "a", "finite"});
  expect_invalid([&] { init::KaimingNormal{0.0, static_cast<FanMode>(7)}(t, gen); },
                 {"init::KaimingNormal", "mode", "7"});
  expect_invalid([&] { init::LinearDefaultBias{-1}(t, gen); }, {"init::LinearDefaultBias", "fan_in"});
  expect_all_equal(values_of(t), 9.0);

  // Fan-based strategies need a matrix or more, like PyTorch.
  Vector<T> v(10);
  v.setConstant(T(9));
  expect_invalid([&] { init::XavierUniform{}(v, gen); }, {"init::XavierUniform", "rank", "but is 1"});
  expect_invalid([&] { init::XavierNormal{}(v, gen); }, {"init::XavierNormal", "rank", "but is 1"});
  expect_invalid([&] { init::KaimingUniform{}(v, gen); }, {"init::KaimingUniform", "rank", "but is 1"});
  expect_invalid([&] { init::KaimingNormal{}(v, gen); }, {"init::KaimingNormal", "rank", "but is 1"});
  expect_invalid([&] { init::LinearDefaultWeight{}(v, gen); }, {"rank", "but is 1"});
  expect_all_equal(values_of(v), 9.0);
  EXPECT_EQ(gen(), Philox(4)());  // refusals draw nothing
}

}  // namespace init_test
