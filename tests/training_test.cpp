// Tests of the module's training path (forward with a ForwardState, backward): every input, parameter,
// weights and bias gradient against PyTorch autograd (fixtures by scripts/fixtures/make_grad_fixtures.py: masks,
// weights, bias, causal with nq != nk, windows, key lengths, ALiBi, cross-attention, d_k != d_v, h = 1, both
// masked-row policies; float64 to 1e-10 and float32 to 1e-4), on both kernels and 2 threads; bit-identical
// gradients on 1 and 2 threads and from a reused state; training-mode dropout against central finite
// differences (the same masks drawn again through manual_seed) and between the kernels; q = k = v, whose
// input gradient is the sum of the three; training under Compute::kBf16 within bfloat16's rounding of the
// same fixtures; and the refusal of a wrong grad_output, a state of another module and an empty state, with
// nothing changed.
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "support/fixture.hpp"
#include "support/reference.hpp"

namespace training_test {

using Index = Eigen::Index;
using sdpa_test::Fixture;
using sdpa_test::Rng;

std::string grad_fixture(const std::string& name) { return std::string(SDPA_FIXTURE_DIR) + "/grad/" + name + ".sdpafix"; }

std::vector<std::string> grad_cases() {
  std::vector<std::string> out;
  for (const char* c : {"plain_self", "cross_dk_ne_dv", "mask_and_weights", "bias_alibi_causal_more_keys",
                        "bias_broadcast_b11k", "causal_more_queries_zero", "causal_more_queries_nan", "windows",
                        "key_lengths", "single_head", "all_options"})
    for (const char* bits : {"_f32", "_f64"}) out.push_back(std::string(c) + bits);
  return out;
}

// |got - want| <= tol * max |want| over the entry, NaN exactly where want has NaN.
// floor: the smallest scale errors are measured against (for a gradient that is zero in exact arithmetic).
template <typename T, int Rank>
::testing::AssertionResult close(const Eigen::Tensor<T, Rank, Eigen::RowMajor>& got, const sdpa_test::Array& want,
                                 double tol, const std::string& what, double floor = 1e-30) {
  if (static_cast<std::size_t>(got.size()) != want.f64.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " elements, want " << want.f64.size();
  double scale = floor, err = 0;
  for (std::size_t i = 0; i < want.f64.size(); ++i)
    if (!std::isnan(want.f64[i])) scale = std::max(scale, std::abs(want.f64[i]));
  for (std::size_t i = 0; i < want.f64.size(); ++i) {
    const double g = static_cast<double>(got.data()[i]), w = want.f64[i];
    if (std::isnan(w) != std::isnan(g))
      return ::testing::AssertionFailure() << what << "[" << i << "]: got " << g << ", want " << w;
    if (!std::isnan(w)) err = std::max(err, std::abs(g - w));
  }
  if (err > tol * std::max(scale, 1e-30))
    return ::testing::AssertionFailure() << what << ": relative error " << err / std::max(scale, 1e-30) << " > " << tol;
  return ::testing::AssertionSuccess();
}

// A gradient fixture's module, inputs, options and the tensors the options point to.
template <typename T>
struct GradCase {
  using Module = sdpa::ScaledDotProductAttention<T>;
  using Tensor3 = typename Module::Tensor3;
  Module m;
  bool self = false;
  Tensor3 q, k, v, go;
  sdpa::AttentionOptions<T> o;
  std::unique_ptr<sdpa::Mask> mask;
  std::unique_ptr<Eigen::Tensor<T, 4, Eigen::RowMajor>> weights, bias;

  explicit GradCase(const Fixture& f)
      : m(f.integer("d_model"), f.integer("d_k"), f.integer("d_v"), f.integer("h"), T(0)),
        self(f.integer("self_attention") == 1),
        q(sdpa_test::to_tensor<T, 3>(f, "queries")),
        k(sdpa_test::to_tensor<T, 3>(f, "keys")),
        v(sdpa_test::to_tensor<T, 3>(f, "values")),
        go(sdpa_test::to_tensor<T, 3>(f, "grad_output")) {
    m.eval();
    m.set_masked_rows(f.integer("masked_rows") == 1 ? sdpa::MaskedRows::kNaN : sdpa::MaskedRows::kZero);
    sdpa_test::load_parameters(m, f);
    o.causal = f.integer("causal") != 0;
    o.window_left = f.integer("window_left");
    o.window_right = f.integer("window_right");
    if (f.has("key_lengths"))
      for (std::int64_t l : f.get("key_lengths").i64) o.key_lengths.push_back(static_cast<Index>(l));
    if (f.has("alibi_slopes"))
      for (double a : f.real("alibi_slopes", 1).f64) o.alibi_slopes.push_back(static_cast<T>(a));
    if (f.has("attention_mask")) {
      mask = std::make_unique<sdpa::Mask>(sdpa_test::to_mask(f, "attention_mask"));
      o.attention_mask = mask.get();
    }
    if (f.has("attention_weights")) {
      weights = std::make_unique<Eigen::Tensor<T, 4, Eigen::RowMajor>>(sdpa_test::to_tensor<T, 4>(f, "attention_weights"));
      o.attention_weights = weights.get();
    }
    if (f.has("attention_bias")) {
      bias = std::make_unique<Eigen::Tensor<T, 4, Eigen::RowMajor>>(sdpa_test::to_tensor<T, 4>(f, "attention_bias"));
      o.attention_bias = bias.get();
    }
  }
  Tensor3 forward(sdpa::ForwardState<T>& state) const { return self ? m.forward(q, q, q, o, state) : m.forward(q, k, v, o, state); }
};

template <typename T>
void run_grad_fixture(const Fixture& f, double tol) {
  using Tensor3 = typename GradCase<T>::Tensor3;
  GradCase<T> c(f);
  auto& m = c.m;
  auto& o = c.o;
  const bool weights = c.weights != nullptr, bias = c.bias != nullptr;
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kReference})
    for (const Eigen::ThreadPoolDevice* d : {static_cast<const Eigen::ThreadPoolDevice*>(nullptr),
                                             static_cast<const Eigen::ThreadPoolDevice*>(&device)}) {
      SCOPED_TRACE(::testing::Message() << (kernel == sdpa::Kernel::kAuto ? "tiled" : "reference") << (d ? ", 2 threads" : ""));
      m.set_kernel(kernel);
      o.device = d;
      sdpa::ForwardState<T> state;
      const Tensor3 y = c.forward(state);
      EXPECT_TRUE(close(y, f.real("output", 3), tol, "output"));
      auto g = m.backward(c.go, state);
      EXPECT_TRUE(close(g.queries, f.real("grad.queries", 3), tol, "queries"));
      EXPECT_TRUE(close(g.keys, f.real("grad.keys", 3), tol, "keys"));
      EXPECT_TRUE(close(g.values, f.real("grad.values", 3), tol, "values"));
      // fc_k's bias moves every key of a row's scores alike, which the softmax ignores: its gradient is zero
      // in exact arithmetic and rounding noise in both, so it is measured against fc_k.weight's scale.
      double key_scale = 0;
      for (double x : f.get("grad.fc_k.weight").f64) key_scale = std::max(key_scale, std::abs(x));
      for (const auto& p : g.named_parameters()) {
        const sdpa_test::Array& want = f.get("grad." + p.name);
        Eigen::TensorMap<const Eigen::Tensor<T, 1, Eigen::RowMajor>> flat(p.data, p.size());
        EXPECT_TRUE(close(Eigen::Tensor<T, 1, Eigen::RowMajor>(flat), want, tol, p.name,
                          p.name == "fc_k.bias" ? key_scale : 1e-30));
      }
      if (weights) {
        EXPECT_TRUE(close(g.attention_weights, f.real("grad.attention_weights", 4), tol, "attention_weights"));
      } else {
        EXPECT_EQ(g.attention_weights.size(), 0);
      }
      if (bias) {
        EXPECT_TRUE(close(g.attention_bias, f.real("grad.attention_bias", 4), tol, "attention_bias"));
      } else {
        EXPECT_EQ(g.attention_bias.size(), 0);
      }
    }
}

class GradParity : public ::testing::TestWithParam<std::string> {};

TEST_P(GradParity, MatchesPyTorchAutograd) {
  Fixture f;
  ASSERT_NO_THROW(f = Fixture::load(grad_fixture(GetParam())));
  if (f.integer("scalar_bits") == 32)
    run_grad_fixture<float>(f, 1e-4);
  else
    run_grad_fixture<double>(f, 1e-10);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GradParity, ::testing::ValuesIn(grad_cases()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// The largest errors of a module's output and input gradients (first) and of its parameters' gradients
// (second) against a fixture's, each relative to the largest magnitude of its tensor (fc_k's bias to
// fc_k.weight's: see run_grad_fixture).
std::pair<double, double> worst_errors(const Fixture& f, const Eigen::Tensor<float, 3, Eigen::RowMajor>& y,
                                       sdpa::Gradients<float>& g) {
  const auto error = [&](const float* got, Index n, const sdpa_test::Array& want, double floor) {
    double scale = floor, err = 0;
    for (double w : want.f64)
      if (!std::isnan(w)) scale = std::max(scale, std::abs(w));
    for (Index i = 0; i < n; ++i) {
      const double w = want.f64[static_cast<std::size_t>(i)];
      if (!std::isnan(w)) err = std::max(err, std::abs(static_cast<double>(got[i]) - w));
    }
    return err / scale;
  };
  double inputs = error(y.data(), y.size(), f.real("output", 3), 1e-30);
  inputs = std::max(inputs, error(g.queries.data(), g.queries.size(), f.real("grad.queries", 3), 1e-30));
  inputs = std::max(inputs, error(g.keys.data(), g.keys.size(), f.real("grad.keys", 3), 1e-30));
  inputs = std::max(inputs, error(g.values.data(), g.values.size(), f.real("grad.values", 3), 1e-30));
  double key_scale = 0, parameters = 0;
  for (double x : f.get("grad.fc_k.weight").f64) key_scale = std::max(key_scale, std::abs(x));
  for (const auto& p : g.named_parameters())
    parameters = std::max(parameters, error(p.data, p.size(), f.get("grad." + p.name), p.name == "fc_k.bias" ? key_scale : 1e-30));
  return {inputs, parameters};
}

// Training under Compute::kBf16 (set_compute: the projections and the core's products on bfloat16 operands
// in the forward, the core's four gradient products in the backward): the output and the input gradients
// within 1.25e-2 of PyTorch's float64 autograd (relative to each tensor's largest entry: a few units of
// bfloat16's 2^-9 compounded; a backward that does not round its operands as the forward did lands at
// 1.5-3e-2 on four of these fixtures), the parameters' within 6e-2 (fc_q's bias, a sum over rows that
// mostly cancels, is the loosest), further from it than the float module (the rounding happened), and the
// same bits on 1 and 2 threads; on every bfloat16 path this CPU runs.
TEST(TrainingBf16, FollowsPyTorchsGradientsWithinBf16Rounding) {
  std::vector<sdpa::Bf16Path> paths{sdpa::Bf16Path::kEmulated};
  if (sdpa::active_isa() == sdpa::Isa::kAvx512)
    for (sdpa::Bf16Path p : {sdpa::Bf16Path::kAvx512Bf16, sdpa::Bf16Path::kAmx})
      if (p <= sdpa::best_bf16_path()) paths.push_back(p);
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  for (const char* name : {"plain_self_f32", "cross_dk_ne_dv_f32", "mask_and_weights_f32", "bias_alibi_causal_more_keys_f32",
                           "windows_f32", "key_lengths_f32"}) {
    SCOPED_TRACE(name);
    Fixture f;
    ASSERT_NO_THROW(f = Fixture::load(grad_fixture(name)));
    GradCase<float> c(f);
    sdpa::ForwardState<float> state;
    Eigen::Tensor<float, 3, Eigen::RowMajor> y = c.forward(state);
    sdpa::Gradients<float> g = c.m.backward(c.go, state);
    const std::pair<double, double> float_error = worst_errors(f, y, g);
    c.m.set_compute(sdpa::Compute::kBf16);
    for (sdpa::Bf16Path p : paths) {
      sdpa::set_bf16_compute_path(p);
      SCOPED_TRACE(sdpa::bf16_path_name(p));
      c.o.device = nullptr;
      y = c.forward(state);
      g = c.m.backward(c.go, state);
      const std::pair<double, double> error = worst_errors(f, y, g);
      std::cout << "[ bf16 path ] " << name << " " << sdpa::bf16_path_name(p) << ": error " << error.first << " (inputs), "
                << error.second << " (parameters); float " << float_error.first << ", " << float_error.second << "\n";
      EXPECT_LT(error.first, 1.25e-2);
      EXPECT_LT(error.second, 6e-2);
      EXPECT_GT(error.first, 4 * float_error.first);
      c.o.device = &device;
      sdpa::ForwardState<float> state2;
      const Eigen::Tensor<float, 3, Eigen::RowMajor> y2 = c.forward(state2);
      sdpa::Gradients<float> g2 = c.m.backward(c.go, state2);
      for (Index i = 0; i < y.size(); ++i) ASSERT_EQ(y.data()[i], y2.data()[i]) << "output " << i;
      auto pa = g.named_parameters(), pb = g2.named_parameters();
      for (std::size_t j = 0; j < pa.size(); ++j)
        for (Index i = 0; i < pa[j].size(); ++i) ASSERT_EQ(pa[j].data[i], pb[j].data[i]) << pa[j].name << " " << i;
      for (Index i = 0; i < g.queries.size(); ++i) ASSERT_EQ(g.queries.data()[i], g2.queries.data()[i]) << "queries " << i;
    }
    sdpa::set_bf16_compute_path("auto");
  }
}

template <typename T>
class TrainingTest : public ::testing::Test {
 protected:
  using Module = sdpa::ScaledDotProductAttention<T>;
  using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;
  static Tensor3 random3(Rng& rng, Index a, Index b, Index c) {
    Tensor3 t(a, b, c);
    rng.fill_normal(t);
    return t;
  }
  template <typename A, typename B>
  static void expect_bits(const A& a, const B& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (Index i = 0; i < a.size(); ++i) {
      const T x = a.data()[i], y = b.data()[i];
      if (std::isnan(x) && std::isnan(y)) continue;
      ASSERT_EQ(x, y) << what << " element " << i;
    }
  }
  static void expect_same(sdpa::Gradients<T>& a, sdpa::Gradients<T>& b) {
    expect_bits(a.queries, b.queries, "queries");
    expect_bits(a.keys, b.keys, "keys");
    expect_bits(a.values, b.values, "values");
    auto pa = a.named_parameters(), pb = b.named_parameters();
    for (std::size_t i = 0; i < pa.size(); ++i)
      expect_bits(Eigen::TensorMap<Eigen::Tensor<T, 1, Eigen::RowMajor>>(pa[i].data, pa[i].size()),
                  Eigen::TensorMap<Eigen::Tensor<T, 1, Eigen::RowMajor>>(pb[i].data, pb[i].size()), pa[i].name);
  }
};
using ScalarTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(TrainingTest, ScalarTypes);

// The same gradients, bit for bit, on 1 and 2 threads, with every option and dropout, and from one state
// used twice.
TYPED_TEST(TrainingTest, GradientsAreDeterministic) {
  using T = TypeParam;
  Rng rng(1);
  typename TestFixture::Module m(64, 16, 8, 4, T(0.2));
  sdpa_test::randomize_module(m, rng, 0.2);
  const auto x = TestFixture::random3(rng, 2, 300, 64), go = TestFixture::random3(rng, 2, 300, 64);
  Eigen::Tensor<T, 4, Eigen::RowMajor> bias(1, 4, 300, 300);
  bias.setRandom();
  sdpa::AttentionOptions<T> o;
  o.causal = true;
  o.window_left = 100;
  o.alibi_slopes = sdpa::alibi_slopes<T>(4);
  o.attention_bias = &bias;
  o.key_lengths = {300, 211};
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  m.manual_seed(5);
  sdpa::ForwardState<T> one;
  const auto y1 = m.forward(x, x, x, o, one);
  auto g1 = m.backward(go, one);
  auto g1_again = m.backward(go, one);  // a state can be used again
  m.manual_seed(5);
  o.device = &device;
  sdpa::ForwardState<T> two;
  const auto y2 = m.forward(x, x, x, o, two);
  auto g2 = m.backward(go, two);
  TestFixture::expect_bits(y1, y2, "output");
  TestFixture::expect_same(g1, g2);
  TestFixture::expect_same(g1, g1_again);
  TestFixture::expect_bits(g1.attention_bias, g2.attention_bias, "attention_bias");
}

// Training-mode dropout: the backward replays the forward's masks. Central finite differences draw the same
// masks by reseeding before every forward; the two kernels agree.
TEST(TrainingDropout, GradientsMatchFiniteDifferencesAndTheReferenceKernel) {
  Rng rng(2);
  sdpa::ScaledDotProductAttention<double> m(8, 3, 4, 2, 0.4);
  sdpa_test::randomize_module(m, rng, 0.5);
  Eigen::Tensor<double, 3, Eigen::RowMajor> q(2, 4, 8), k(2, 5, 8), go(2, 4, 8);
  rng.fill_normal(q);
  rng.fill_normal(k);
  rng.fill_normal(go);
  sdpa::AttentionOptions<double> o;
  o.alibi_slopes = {0.3, 0.1};
  auto loss = [&]() {
    m.manual_seed(7);
    const auto y = m.forward(q, k, k, o);
    double s = 0;
    for (Index i = 0; i < y.size(); ++i) s += y.data()[i] * go.data()[i];
    return s;
  };
  m.manual_seed(7);
  sdpa::ForwardState<double> state;
  (void)m.forward(q, k, k, o, state);
  const auto g = m.backward(go, state);
  double worst = 0;
  auto check = [&](double* x, Index n, const double* grad) {
    for (Index i = 0; i < n; ++i) {
      const double saved = x[i], h = 1e-6;
      x[i] = saved + h;
      const double up = loss();
      x[i] = saved - h;
      const double down = loss();
      x[i] = saved;
      const double fd = (up - down) / (2 * h);
      worst = std::max(worst, std::abs(fd - grad[i]) / std::max(1.0, std::abs(fd)));
    }
  };
  check(q.data(), q.size(), g.queries.data());
  check(m.fc_v().weight().data(), m.fc_v().weight().size(), g.fc_v.weight.data());
  check(m.fc_q().bias().data(), m.fc_q().bias().size(), g.fc_q.bias.data());
  EXPECT_LT(worst, 1e-6);
  // keys = values: their gradients are the parts of each role.
  Eigen::Tensor<double, 3, Eigen::RowMajor> kv_grad = g.keys + g.values;
  check(k.data(), k.size(), kv_grad.data());
  EXPECT_LT(worst, 1e-6);
  m.set_kernel(sdpa::Kernel::kReference);
  m.manual_seed(7);
  sdpa::ForwardState<double> ref_state;
  (void)m.forward(q, k, k, o, ref_state);
  const auto gr = m.backward(go, ref_state);
  double diff = 0;
  for (Index i = 0; i < g.queries.size(); ++i) diff = std::max(diff, std::abs(g.queries.data()[i] - gr.queries.data()[i]));
  for (Index i = 0; i < g.fc_k.weight.size(); ++i) diff = std::max(diff, std::abs(g.fc_k.weight.data()[i] - gr.fc_k.weight.data()[i]));
  EXPECT_LT(diff, 1e-12);
}

// q = k = v through one tensor x: d loss / dx is the sum of the three roles' gradients.
TEST(TrainingSelfAttention, InputGradientIsTheSumOfTheThreeRoles) {
  Rng rng(3);
  sdpa::ScaledDotProductAttention<double> m(8, 4, 4, 2, 0.0);
  sdpa_test::randomize_module(m, rng, 0.5);
  Eigen::Tensor<double, 3, Eigen::RowMajor> x(2, 5, 8), go(2, 5, 8);
  rng.fill_normal(x);
  rng.fill_normal(go);
  sdpa::AttentionOptions<double> o;
  o.causal = true;
  sdpa::ForwardState<double> state;
  (void)m.forward(x, x, x, o, state);
  const auto g = m.backward(go, state);
  const Eigen::Tensor<double, 3, Eigen::RowMajor> dx = g.queries + g.keys + g.values;
  for (Index i = 0; i < x.size(); ++i) {
    const double saved = x.data()[i], h = 1e-6;
    auto loss = [&] {
      const auto y = m.forward(x, x, x, o);
      double s = 0;
      for (Index j = 0; j < y.size(); ++j) s += y.data()[j] * go.data()[j];
      return s;
    };
    x.data()[i] = saved + h;
    const double up = loss();
    x.data()[i] = saved - h;
    const double down = loss();
    x.data()[i] = saved;
    EXPECT_NEAR(dx.data()[i], (up - down) / (2 * h), 1e-6 * std::max(1.0, std::abs(dx.data()[i]))) << i;
  }
}

TEST(TrainingErrors, BadGradOutputStateOfAnotherModuleAndEmptyState) {
  Rng rng(4);
  sdpa::ScaledDotProductAttention<float> m(8, 4, 4, 2, 0.0f), other(8, 4, 4, 2, 0.0f);
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(2, 3, 8);
  rng.fill_normal(x);
  sdpa::ForwardState<float> state;
  EXPECT_TRUE(state.empty());
  EXPECT_THROW(m.backward(x, state), std::logic_error);
  (void)m.forward(x, x, x, {}, state);
  EXPECT_FALSE(state.empty());
  EXPECT_EQ(state.nq(), 3);
  sdpa_test::expect_invalid([&] { m.backward(Eigen::Tensor<float, 3, Eigen::RowMajor>(2, 4, 8), state); },
                            {"grad_output", "(2, 3, 8)", "(2, 4, 8)"});
  sdpa_test::expect_invalid([&] { other.backward(x, state); }, {"state", "another module"});
  const sdpa::ScaledDotProductAttention<float> copy(m);  // a copy is another module
  sdpa_test::expect_invalid([&] { copy.backward(x, state); }, {"state", "another module"});
  // The state still works after the refusals; a moved module keeps its states.
  EXPECT_NO_THROW(m.backward(x, state));
  sdpa::ScaledDotProductAttention<float> moved(std::move(m));
  EXPECT_NO_THROW(moved.backward(x, state));
}

}  // namespace training_test
