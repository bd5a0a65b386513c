// Tests of sdpa/optim.hpp: SGD (momentum, dampening, Nesterov, weight decay), Adam and AdamW (with and
// without AMSGrad) against PyTorch's torch.optim over five steps (tests/fixtures/optim/, written by
// scripts/fixtures/make_optim_fixtures.py), on a small stand-in module and on ScaledDotProductAttention itself, in
// float and double; refusals of a parameter name or shape that differs (before anything changes) and of
// bad hyperparameters, with messages that name them; the state kept per name, zero_state and set_lr.
#include "sdpa/optim.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <sstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdpa/scaled_dot_product_attention.hpp"
#include "support/fixture.hpp"

namespace optim_test {

using Index = Eigen::Index;
using sdpa_test::Fixture;
using sdpa_test::kParameterNames;

// The module of the fixtures: ScaledDotProductAttention(d_model 3, d_k 2, d_v 2, h 2).
constexpr Index kDModel = 3, kDk = 2, kDv = 2, kHeads = 2;

std::vector<Index> shape_of(const std::string& name) {
  const bool weight = name.find(".weight") != std::string::npos;
  if (name.rfind("fc_o", 0) == 0) return weight ? std::vector<Index>{kDModel, kHeads * kDv} : std::vector<Index>{kDModel};
  const Index out = name.rfind("fc_v", 0) == 0 ? kHeads * kDv : kHeads * kDk;
  return weight ? std::vector<Index>{out, kDModel} : std::vector<Index>{out};
}

// A stand-in for a module: named tensors in a given order, whatever their names and shapes.
template <typename Scalar>
struct FakeModule {
  std::vector<std::string> names;
  std::vector<std::vector<Index>> shapes;
  std::vector<std::vector<Scalar>> data;

  void add(const std::string& name, std::vector<Index> shape, Scalar fill = Scalar(0)) {
    Index n = 1;
    for (Index d : shape) n *= d;
    names.push_back(name);
    shapes.push_back(std::move(shape));
    data.emplace_back(static_cast<std::size_t>(n), fill);
  }

  std::vector<sdpa::ParameterRef<Scalar>> named_parameters() {
    std::vector<sdpa::ParameterRef<Scalar>> out;
    for (std::size_t i = 0; i < names.size(); ++i) out.push_back({names[i], data[i].data(), shapes[i]});
    return out;
  }
};

// The eight parameters of the fixtures' module, each filled with `fill`.
template <typename Scalar>
FakeModule<Scalar> attention_like(Scalar fill = Scalar(0.5)) {
  FakeModule<Scalar> m;
  for (const char* name : kParameterNames) m.add(name, shape_of(name), fill);
  return m;
}

// Gradients of the eight parameters, each element `fill` (or from a fixture).
template <typename Scalar>
sdpa::Gradients<Scalar> gradients(Scalar fill = Scalar(0.25)) {
  sdpa::Gradients<Scalar> g;
  sdpa::LinearGradients<Scalar>* layers[4] = {&g.fc_q, &g.fc_k, &g.fc_v, &g.fc_o};
  const char* names[4] = {"fc_q", "fc_k", "fc_v", "fc_o"};
  for (std::size_t i = 0; i < 4; ++i) {
    const std::vector<Index> w = shape_of(std::string(names[i]) + ".weight");
    layers[i]->weight.resize(w[0], w[1]);
    layers[i]->bias.resize(w[0]);
    layers[i]->weight.setConstant(fill);
    layers[i]->bias.setConstant(fill);
  }
  return g;
}

template <typename Scalar>
sdpa::Gradients<Scalar> fixture_gradients(const Fixture& f, int step) {
  sdpa::Gradients<Scalar> g = gradients<Scalar>();
  for (auto& p : g.named_parameters()) {
    const std::vector<double>& v = f.get("grad/" + std::to_string(step) + "/" + p.name).f64;
    EXPECT_EQ(static_cast<Index>(v.size()), p.size()) << p.name;
    for (std::size_t i = 0; i < v.size(); ++i) p.data[i] = static_cast<Scalar>(v[i]);
  }
  return g;
}

double scalar(const Fixture& f, const std::string& name) { return f.real(name, 0).f64[0]; }

// Copies the fixture's initial parameters into any module by name.
template <typename Scalar, typename Module>
void load_initial(Module& module, const Fixture& f) {
  for (auto& p : module.named_parameters()) {
    const std::vector<double>& v = f.get("initial/" + p.name).f64;
    ASSERT_EQ(static_cast<Index>(v.size()), p.size()) << p.name;
    for (std::size_t i = 0; i < v.size(); ++i) p.data[i] = static_cast<Scalar>(v[i]);
  }
}

template <typename Scalar>
double tolerance() {
  return std::is_same<Scalar, float>::value ? 1e-6 : 1e-14;
}

// Runs the fixture's optimizer for its steps on `module`, comparing every parameter after every step.
template <typename Scalar, typename Optimizer, typename Module>
void expect_steps_match(Optimizer& opt, Module& module, const Fixture& f) {
  load_initial<Scalar>(module, f);
  const std::string run = std::is_same<Scalar, float>::value ? "f32/" : "f64/";
  const auto steps = static_cast<int>(f.integer("steps"));
  double worst = 0;
  for (int t = 0; t < steps; ++t) {
    sdpa::Gradients<Scalar> g = fixture_gradients<Scalar>(f, t);
    opt.step(module, g);
    for (auto& p : module.named_parameters()) {
      const std::vector<double>& want = f.get(run + std::to_string(t) + "/" + p.name).f64;
      ASSERT_EQ(static_cast<Index>(want.size()), p.size());
      for (std::size_t i = 0; i < want.size(); ++i) {
        const double err = std::abs(double(p.data[i]) - want[i]) / std::max(1.0, std::abs(want[i]));
        worst = std::max(worst, err);
        ASSERT_LE(err, tolerance<Scalar>()) << f.path() << " step " << t << " " << p.name << "[" << i << "]: got "
                                            << p.data[i] << ", PyTorch " << want[i];
      }
    }
  }
  // The largest error per fixture, in the test's XML report (--gtest_output=xml).
  std::ostringstream os;
  os << std::scientific << worst;
  ::testing::Test::RecordProperty(std::filesystem::path(f.path()).stem().string() + "_worst_relative_error", os.str());
}

// The fixture's optimizer with its hyperparameters, handed to `use`.
template <typename Scalar, typename Use>
void with_fixture_optimizer(const Fixture& f, Use&& use) {
  const double lr = scalar(f, "lr"), wd = scalar(f, "weight_decay"), eps = scalar(f, "eps");
  const std::pair<double, double> betas{scalar(f, "beta1"), scalar(f, "beta2")};
  const bool amsgrad = f.integer("amsgrad") != 0;
  switch (f.integer("optimizer")) {
    case 0: {
      sdpa::optim::SGD<Scalar> opt(lr, scalar(f, "momentum"), wd, scalar(f, "dampening"), f.integer("nesterov") != 0);
      use(opt);
      break;
    }
    case 1: {
      sdpa::optim::Adam<Scalar> opt(lr, betas, eps, wd, amsgrad);
      use(opt);
      break;
    }
    case 2: {
      sdpa::optim::AdamW<Scalar> opt(lr, betas, eps, wd, amsgrad);
      use(opt);
      break;
    }
    default:
      FAIL() << f.path() << ": unknown optimizer";
  }
}

std::vector<std::string> fixture_files() {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(SDPA_FIXTURE_DIR) + "/optim"))
    if (entry.path().extension() == ".sdpafix") files.push_back(entry.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

template <typename T>
class OptimTest : public ::testing::Test {};
using ScalarTypes = ::testing::Types<float, double>;
struct ScalarName {
  template <typename T>
  static std::string GetName(int) {
    return std::is_same<T, float>::value ? "float" : "double";
  }
};
TYPED_TEST_SUITE(OptimTest, ScalarTypes, ScalarName);

// -------------------------------------------------------------------------------------------- PyTorch

TYPED_TEST(OptimTest, MatchesTorchOptimOnAStandInModule) {
  using Scalar = TypeParam;
  const std::vector<std::string> files = fixture_files();
  ASSERT_EQ(files.size(), 8u) << "fixtures in " << SDPA_FIXTURE_DIR << "/optim";
  for (const std::string& file : files) {
    SCOPED_TRACE(file);
    const Fixture f = Fixture::load(file);
    with_fixture_optimizer<Scalar>(f, [&](auto& opt) {
      FakeModule<Scalar> module = attention_like<Scalar>();
      expect_steps_match<Scalar>(opt, module, f);
    });
  }
}

TYPED_TEST(OptimTest, MatchesTorchOptimOnTheModule) {
  using Scalar = TypeParam;
  for (const std::string& file : fixture_files()) {
    SCOPED_TRACE(file);
    const Fixture f = Fixture::load(file);
    with_fixture_optimizer<Scalar>(f, [&](auto& opt) {
      sdpa::ScaledDotProductAttention<Scalar> module(kDModel, kDk, kDv, kHeads);
      expect_steps_match<Scalar>(opt, module, f);
    });
  }
}

// --------------------------------------------------------------------------------------------- refusals

// Each optimizer, freshly made, with state after one good step.
template <typename Scalar>
std::vector<std::pair<std::string, std::function<void(FakeModule<Scalar>&, sdpa::Gradients<Scalar>&)>>> stepped_optimizers() {
  auto sgd = std::make_shared<sdpa::optim::SGD<Scalar>>(0.1, 0.9, 0.01);
  auto adam = std::make_shared<sdpa::optim::Adam<Scalar>>(1e-2, std::pair<double, double>{0.9, 0.99}, 1e-8, 0.1, true);
  auto adamw = std::make_shared<sdpa::optim::AdamW<Scalar>>();
  return {{"optim::SGD::step", [sgd](FakeModule<Scalar>& m, sdpa::Gradients<Scalar>& g) { sgd->step(m, g); }},
          {"optim::Adam::step", [adam](FakeModule<Scalar>& m, sdpa::Gradients<Scalar>& g) { adam->step(m, g); }},
          {"optim::AdamW::step", [adamw](FakeModule<Scalar>& m, sdpa::Gradients<Scalar>& g) { adamw->step(m, g); }}};
}

// step must throw std::invalid_argument whose message holds every one of `parts`.
template <typename F>
void expect_refusal(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one mentioning " << parts.front();
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    for (const std::string& part : parts) EXPECT_NE(what.find(part), std::string::npos) << what << "\nlacks: " << part;
  }
}

TYPED_TEST(OptimTest, RefusesANameOrShapeThatDiffersBeforeChangingAnything) {
  using Scalar = TypeParam;
  for (auto& entry : stepped_optimizers<Scalar>()) {
    const std::string& where = entry.first;
    auto& step = entry.second;
    SCOPED_TRACE(where);
    // One good step first, so that there is state to keep.
    FakeModule<Scalar> module = attention_like<Scalar>();
    sdpa::Gradients<Scalar> g = gradients<Scalar>();
    step(module, g);
    FakeModule<Scalar> after_one = module;

    // Reference: a second good step from here.
    auto reference_steps = stepped_optimizers<Scalar>();
    FakeModule<Scalar> expected = attention_like<Scalar>();
    for (auto& other : reference_steps)
      if (other.first == where) {
        other.second(expected, g);
        other.second(expected, g);
      }

    // A wrong shape in the middle of the list: fc_q's parameters come before it and must stay untouched.
    {
      FakeModule<Scalar> wrong = module;
      wrong.shapes[4] = {kDModel, kHeads * kDv};  // fc_v.weight transposed
      expect_refusal([&] { step(wrong, g); }, {"sdpa::" + where, "\"fc_v.weight\"", "shape", "(3, 4)", "(4, 3)"});
      EXPECT_EQ(wrong.data, after_one.data);
    }
    // The module lacks a parameter the gradients have.
    {
      FakeModule<Scalar> fewer = module;
      fewer.names.pop_back();
      fewer.shapes.pop_back();
      fewer.data.pop_back();
      expect_refusal([&] { step(fewer, g); }, {"sdpa::" + where, "\"fc_o.bias\"", "the module does not have"});
      EXPECT_EQ(fewer.data, std::vector<std::vector<Scalar>>(after_one.data.begin(), after_one.data.end() - 1));
    }
    // The module has a parameter the gradients lack.
    {
      FakeModule<Scalar> more = module;
      more.add("norm.weight", {3}, Scalar(1));
      expect_refusal([&] { step(more, g); }, {"sdpa::" + where, "\"norm.weight\"", "missing", "fc_q.weight"});
      EXPECT_EQ(std::vector<std::vector<Scalar>>(more.data.begin(), more.data.end() - 1), after_one.data);
    }
    // Renamed.
    {
      FakeModule<Scalar> renamed = module;
      renamed.names[2] = "fc_key.weight";
      expect_refusal([&] { step(renamed, g); }, {"\"fc_key.weight\""});
      EXPECT_EQ(renamed.data, after_one.data);
    }
    // A gradient of another shape than the parameter's.
    {
      sdpa::Gradients<Scalar> bad = gradients<Scalar>();
      bad.fc_o.bias.resize(5);
      bad.fc_o.bias.setZero();
      FakeModule<Scalar> same = module;
      expect_refusal([&] { step(same, bad); }, {"\"fc_o.bias\"", "(3,)", "(5,)"});
      EXPECT_EQ(same.data, after_one.data);
    }
    // The state was not touched either: the next good step is the second step.
    step(module, g);
    EXPECT_EQ(module.data, expected.data);
  }
}

TYPED_TEST(OptimTest, RefusesParametersWhoseShapeChangedUnderTheSameName) {
  using Scalar = TypeParam;
  sdpa::optim::Adam<Scalar> adam;
  // The second module's fc_q.weight has another shape of the same size; its gradient follows it.
  FakeModule<Scalar> first = attention_like<Scalar>();
  sdpa::Gradients<Scalar> g1 = gradients<Scalar>();
  adam.step(first, g1);
  FakeModule<Scalar> second = attention_like<Scalar>();
  second.shapes[0] = {2, 6};  // 12 elements, as before
  sdpa::Gradients<Scalar> g2 = gradients<Scalar>();
  g2.fc_q.weight.resize(2, 6);
  g2.fc_q.weight.setConstant(Scalar(0.25));
  expect_refusal([&] { adam.step(second, g2); }, {"\"fc_q.weight\"", "(4, 3)", "(2, 6)", "zero_state"});
  EXPECT_EQ(second.data, attention_like<Scalar>().data);
  adam.zero_state();
  adam.step(second, g2);
  ASSERT_NE(adam.state("fc_q.weight"), nullptr);
  EXPECT_EQ(adam.state("fc_q.weight")->step, 1);
}

TEST(Optim, RefusesBadHyperparametersNamingThem) {
  using sdpa::optim::Adam;
  using sdpa::optim::AdamW;
  using sdpa::optim::SGD;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  expect_refusal([] { SGD<float>(-0.1); }, {"sdpa::optim::SGD", "lr", ">= 0", "-0.1"});
  expect_refusal([&] { (void)SGD<float>(nan); }, {"lr", "nan"});
  expect_refusal([] { SGD<float>(0.1, -0.5); }, {"momentum", ">= 0", "-0.5"});
  expect_refusal([] { SGD<float>(0.1, 0.9, -1.0); }, {"weight_decay", ">= 0", "-1"});
  expect_refusal([] { SGD<float>(0.1, 0.9, 0.0, std::numeric_limits<double>::infinity()); }, {"dampening", "finite"});
  expect_refusal([] { SGD<double>(0.1, 0.0, 0.0, 0.0, true); }, {"nesterov", "momentum > 0", "momentum 0"});
  expect_refusal([] { SGD<double>(0.1, 0.9, 0.0, 0.1, true); }, {"nesterov", "dampening == 0", "dampening 0.1"});
  expect_refusal([] { Adam<float>(-1.0); }, {"sdpa::optim::Adam", "lr", "-1"});
  expect_refusal([] { Adam<float>(1e-3, {1.0, 0.999}); }, {"sdpa::optim::Adam", "beta1", "[0, 1)", "1"});
  expect_refusal([] { Adam<float>(1e-3, {0.9, -0.1}); }, {"beta2", "[0, 1)", "-0.1"});
  expect_refusal([] { Adam<double>(1e-3, {0.9, 0.999}, -1e-8); }, {"eps", ">= 0", "-1e-08"});
  expect_refusal([] { Adam<double>(1e-3, {0.9, 0.999}, 1e-8, -0.01); }, {"weight_decay", "-0.01"});
  expect_refusal([] { AdamW<float>(1e-3, {0.9, 1.5}); }, {"sdpa::optim::AdamW", "beta2", "1.5"});
  expect_refusal([] { AdamW<float>(1e-3, {0.9, 0.999}, 1e-8, -1.0); }, {"sdpa::optim::AdamW", "weight_decay", "-1"});
  SGD<float> sgd(0.1);
  expect_refusal([&] { sgd.set_lr(-2.0); }, {"lr", "-2"});
  EXPECT_EQ(sgd.lr(), 0.1);
  // Edge values PyTorch accepts.
  EXPECT_NO_THROW(SGD<float>(0.0));
  EXPECT_NO_THROW(Adam<float>(0.0, {0.0, 0.0}, 0.0, 0.0));
  EXPECT_NO_THROW(SGD<float>(0.1, 0.9, 0.0, 0.0, true));
}

// --------------------------------------------------------------------------------------------- defaults

TEST(Optim, DefaultsAreTorchs) {
  const sdpa::optim::SGD<float> sgd(0.5);
  EXPECT_EQ(sgd.momentum(), 0.0);
  EXPECT_EQ(sgd.weight_decay(), 0.0);
  EXPECT_EQ(sgd.dampening(), 0.0);
  EXPECT_FALSE(sgd.nesterov());
  const sdpa::optim::Adam<float> adam;
  EXPECT_EQ(adam.lr(), 1e-3);
  EXPECT_EQ(adam.betas(), (std::pair<double, double>{0.9, 0.999}));
  EXPECT_EQ(adam.eps(), 1e-8);
  EXPECT_EQ(adam.weight_decay(), 0.0);
  EXPECT_FALSE(adam.amsgrad());
  const sdpa::optim::AdamW<float> adamw;
  EXPECT_EQ(adamw.lr(), 1e-3);
  EXPECT_EQ(adamw.weight_decay(), 1e-2);
  EXPECT_FALSE(adamw.amsgrad());
}

// ------------------------------------------------------------------------------------------------ state

TYPED_TEST(OptimTest, StateIsKeptPerNameAndZeroStateStartsAfresh) {
  using Scalar = TypeParam;
  sdpa::Gradients<Scalar> g = gradients<Scalar>(Scalar(0.25));
  // SGD: no buffer without momentum; with it, one per name holding the first gradient (plus decay).
  {
    sdpa::optim::SGD<Scalar> plain(0.5);
    FakeModule<Scalar> m = attention_like<Scalar>();
    plain.step(m, g);
    EXPECT_EQ(plain.state("fc_q.weight"), nullptr);
    EXPECT_EQ(m.data[0][0], Scalar(0.375));  // 0.5 - 0.5 * 0.25
    sdpa::optim::SGD<Scalar> momentum(0.1, 0.9);
    momentum.step(m, g);
    for (const char* name : kParameterNames) {
      const auto* s = momentum.state(name);
      ASSERT_NE(s, nullptr) << name;
      EXPECT_EQ(s->shape, shape_of(name));
      EXPECT_EQ(s->momentum_buffer, std::vector<Scalar>(s->momentum_buffer.size(), Scalar(0.25)));
    }
    EXPECT_EQ(momentum.state("nope"), nullptr);
  }
  // Adam: step counts per name; zero_state makes the next step a first step.
  sdpa::optim::Adam<Scalar> adam(1e-2);
  FakeModule<Scalar> m = attention_like<Scalar>();
  for (int t = 0; t < 3; ++t) adam.step(m, g);
  for (const char* name : kParameterNames) EXPECT_EQ(adam.state(name)->step, 3) << name;
  const FakeModule<Scalar> before = m;
  adam.zero_state();
  EXPECT_EQ(adam.state("fc_q.weight"), nullptr);
  adam.step(m, g);
  FakeModule<Scalar> fresh_module = before;
  sdpa::optim::Adam<Scalar> fresh(1e-2);
  fresh.step(fresh_module, g);
  EXPECT_EQ(m.data, fresh_module.data);
  EXPECT_EQ(adam.state("fc_o.bias")->step, 1);
  // Adam's first step moves every parameter by lr (the bias-corrected m / sqrt(v) is 1).
  for (std::size_t i = 0; i < m.data.size(); ++i)
    for (std::size_t j = 0; j < m.data[i].size(); ++j)
      EXPECT_NEAR(double(m.data[i][j]), double(before.data[i][j]) - 1e-2, 1e-6);
}

TYPED_TEST(OptimTest, SetLrTakesEffectAtTheNextStep) {
  using Scalar = TypeParam;
  sdpa::Gradients<Scalar> g = gradients<Scalar>(Scalar(1));
  sdpa::optim::SGD<Scalar> sgd(0.5);
  FakeModule<Scalar> m = attention_like<Scalar>(Scalar(2));
  sgd.step(m, g);
  EXPECT_EQ(m.data[3][0], Scalar(1.5));
  sgd.set_lr(0.25);
  sgd.step(m, g);
  EXPECT_EQ(m.data[3][0], Scalar(1.25));
  sdpa::optim::AdamW<Scalar> adamw(0.1, {0.9, 0.999}, 1e-8, 0.0);
  adamw.set_lr(0.0);
  const FakeModule<Scalar> before = m;
  adamw.step(m, g);
  EXPECT_EQ(m.data, before.data);
}

}  // namespace optim_test
