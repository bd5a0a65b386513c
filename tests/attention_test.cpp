// Tests of sdpa/attention.hpp (the functional core, sdpa::attention and attention_backward) and of today's
// decoder options through the module (grouped-query heads, rotary embeddings, softcap, sinks, a scale),
// float and double:
//   - against float64 PyTorch autograd (tests/fixtures/core/, scripts/fixtures/make_core_fixtures.py): outputs,
//     probabilities and every gradient (q, k, v, weights, bias, sinks; the module's inputs and
//     parameters), on the tiled and the reference kernels, in both layouts, on 1 and 2 threads (the
//     same bits);
//   - the module's step() in chunks equals its causal forward with GQA and rotary (and sinks, softcap);
//     its cache holds kv_heads heads;
//   - every new argument refused with the field named.
#include "sdpa/attention.hpp"
#include "sdpa/kv_cache.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "support/fixture.hpp"
#include "support/reference.hpp"

namespace attention_test {

using Index = Eigen::Index;
using sdpa_test::Fixture;
using sdpa_test::expect_invalid;

template <typename T>
using T4 = Eigen::Tensor<T, 4, Eigen::RowMajor>;
template <typename T>
using T3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;

std::vector<std::string> fixture_files(int kind) {
  std::vector<std::string> out;
  const std::filesystem::path dir = std::filesystem::path(SDPA_FIXTURE_DIR) / "core";
  if (!std::filesystem::exists(dir)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".sdpafix" && Fixture::load(e.path().string()).integer("kind") == kind)
      out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The fixture's options (the tensors they point to live in `holder`).
template <typename T>
struct Options {
  sdpa::AttentionOptions<T> o;
  Eigen::Tensor<bool, 4, Eigen::RowMajor> mask;
  T4<T> weights, bias;
  sdpa::Rotary rotary;
  bool has_rotary = false;
};

template <typename T>
std::unique_ptr<Options<T>> options_of(const Fixture& f) {
  auto h = std::make_unique<Options<T>>();
  sdpa::AttentionOptions<T>& o = h->o;
  o.causal = f.integer("causal") != 0;
  o.window_left = f.integer("window_left");
  o.window_right = f.integer("window_right");
  o.masked_rows = f.integer("masked_rows") == 0 ? sdpa::MaskedRows::kZero : sdpa::MaskedRows::kNaN;
  o.scale = static_cast<T>(f.real("scale", 0).f64[0]);
  o.softcap = static_cast<T>(f.real("softcap", 0).f64[0]);
  if (f.has("key_lengths"))
    for (std::int64_t v : f.get("key_lengths").i64) o.key_lengths.push_back(static_cast<Index>(v));
  if (f.has("alibi_slopes")) o.alibi_slopes = sdpa_test::to_vector<T>(f, "alibi_slopes");
  if (f.has("sinks")) o.sinks = sdpa_test::to_vector<T>(f, "sinks");
  if (f.has("attention_mask")) {
    h->mask = sdpa_test::to_mask(f, "attention_mask");
    o.attention_mask = &h->mask;
  }
  if (f.has("attention_weights")) {
    h->weights = sdpa_test::to_tensor<T, 4>(f, "attention_weights");
    o.attention_weights = &h->weights;
  }
  if (f.has("attention_bias")) {
    h->bias = sdpa_test::to_tensor<T, 4>(f, "attention_bias");
    o.attention_bias = &h->bias;
  }
  if (f.has("rotary.dim")) {
    h->has_rotary = true;
    h->rotary.dim = static_cast<Index>(f.integer("rotary.dim"));
    h->rotary.interleaved = f.integer("rotary.interleaved") != 0;
    h->rotary.inv_freq = f.get("rotary.inv_freq").f64;
    h->rotary.attention_factor = f.real("rotary.attention_factor", 0).f64[0];
  }
  return h;
}

template <typename T>
double tolerance() {
  return std::is_same<T, float>::value ? 2e-5 : 1e-10;
}

// got (Scalar data) against want (f64): the same NaN positions; |got - want| <= tol * (1 + max |want|).
template <typename T>
::testing::AssertionResult close(const T* got, std::size_t n, const std::vector<double>& want, double tol) {
  if (n != want.size()) return ::testing::AssertionFailure() << "sizes differ: " << n << " vs " << want.size();
  double scale = 1;
  for (double w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  for (std::size_t i = 0; i < n; ++i) {
    const double g = double(got[i]), w = want[i];
    if (std::isnan(w) != std::isnan(g)) return ::testing::AssertionFailure() << "element " << i << ": " << g << " vs " << w;
    if (std::isnan(w)) continue;
    if (!(std::abs(g - w) <= tol * scale))
      return ::testing::AssertionFailure() << "element " << i << ": " << g << " vs " << w << " (scale " << scale << ")";
  }
  return ::testing::AssertionSuccess();
}

template <typename T, int R>
::testing::AssertionResult close(const Eigen::Tensor<T, R, Eigen::RowMajor>& got, const Fixture& f, const std::string& name,
                                 double tol) {
  const auto& a = f.get(name);
  for (int i = 0; i < R; ++i)
    if (got.dimension(i) != a.dims[static_cast<std::size_t>(i)])
      return ::testing::AssertionFailure() << name << ": shape differs in dimension " << i;
  return close(got.data(), static_cast<std::size_t>(got.size()), a.f64, tol) << " (" << name << ")";
}

// (b, h, n, d) -> (b, n, h, d) and back.
template <typename T>
T4<T> swap12(const T4<T>& x) {
  return x.shuffle(Eigen::array<int, 4>{0, 2, 1, 3});
}

template <typename T>
class AttentionTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(AttentionTest, Scalars);

TYPED_TEST(AttentionTest, MatchesPyTorchAutogradOnEveryFixture) {
  using T = TypeParam;
  const auto files = fixture_files(0);
  if (files.empty()) GTEST_SKIP() << "no fixtures in " << SDPA_FIXTURE_DIR << "/core (scripts/fixtures/make_core_fixtures.py writes them)";
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice two(&pool, 2);
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    const Fixture f = Fixture::load(path);
    auto opt = options_of<T>(f);
    if (opt->has_rotary) opt->o.rotary = &opt->rotary;
    const T4<T> q = sdpa_test::to_tensor<T, 4>(f, "q"), k = sdpa_test::to_tensor<T, 4>(f, "k"),
                v = sdpa_test::to_tensor<T, 4>(f, "v"), dout = sdpa_test::to_tensor<T, 4>(f, "grad_output");
    for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kTiled, sdpa::Kernel::kReference}) {
      SCOPED_TRACE(kernel == sdpa::Kernel::kReference ? "reference" : kernel == sdpa::Kernel::kTiled ? "tiled" : "auto");
      sdpa::AttentionOptions<T> o = opt->o;
      o.kernel = kernel;
      T4<T> p;
      o.probabilities = &p;
      sdpa::AttentionState<T> state;
      const T4<T> out = sdpa::attention(q, k, v, o, state);
      EXPECT_TRUE(close(out, f, "output", tolerance<T>()));
      EXPECT_TRUE(close(p, f, "probabilities", tolerance<T>()));
      const sdpa::AttentionGradients<T> g = sdpa::attention_backward(dout, state);
      EXPECT_TRUE(close(g.q, f, "grad.q", 5 * tolerance<T>()));
      EXPECT_TRUE(close(g.k, f, "grad.k", 5 * tolerance<T>()));
      EXPECT_TRUE(close(g.v, f, "grad.v", 5 * tolerance<T>()));
      if (f.has("grad.sinks")) {
        ASSERT_EQ(g.sinks.size(), f.get("grad.sinks").f64.size());
        EXPECT_TRUE(close(g.sinks.data(), g.sinks.size(), f.get("grad.sinks").f64, 5 * tolerance<T>()) << " (grad.sinks)");
      } else {
        EXPECT_TRUE(g.sinks.empty());
      }
      if (f.has("grad.attention_weights")) {
        EXPECT_TRUE(close(g.attention_weights, f, "grad.attention_weights", 5 * tolerance<T>()));
      }
      if (f.has("grad.attention_bias")) {
        EXPECT_TRUE(close(g.attention_bias, f, "grad.attention_bias", 5 * tolerance<T>()));
      }

      // Two threads: the same bits, forward and backward.
      sdpa::AttentionOptions<T> o2 = o;
      o2.device = &two;
      T4<T> p2;
      o2.probabilities = &p2;
      sdpa::AttentionState<T> state2;
      const T4<T> out2 = sdpa::attention(q, k, v, o2, state2);
      EXPECT_EQ(std::memcmp(out.data(), out2.data(), sizeof(T) * std::size_t(out.size())), 0) << "two threads";
      const sdpa::AttentionGradients<T> g2 = sdpa::attention_backward(dout, state2);
      EXPECT_EQ(std::memcmp(g.k.data(), g2.k.data(), sizeof(T) * std::size_t(g.k.size())), 0) << "two threads: grad.k";
      EXPECT_EQ(std::memcmp(g.v.data(), g2.v.data(), sizeof(T) * std::size_t(g.v.size())), 0) << "two threads: grad.v";
      EXPECT_EQ(g.sinks, g2.sinks) << "two threads: grad.sinks";
    }
    // FlashAttention's layout (b, n, h, d): the same result in that layout.
    sdpa::AttentionOptions<T> o = opt->o;
    o.layout = sdpa::Layout::kBNHD;
    sdpa::AttentionState<T> state;
    const T4<T> out = sdpa::attention(swap12(q), swap12(k), swap12(v), o, state);
    EXPECT_TRUE(close(T4<T>(swap12(out)), f, "output", tolerance<T>())) << "layout kBNHD";
    const sdpa::AttentionGradients<T> g = sdpa::attention_backward(T4<T>(swap12(dout)), state);
    EXPECT_TRUE(close(T4<T>(swap12(g.q)), f, "grad.q", 5 * tolerance<T>())) << "layout kBNHD";
    EXPECT_TRUE(close(T4<T>(swap12(g.k)), f, "grad.k", 5 * tolerance<T>())) << "layout kBNHD";
  }
}

// The module with kv_heads and a rotary, through forward and backward, against the fixture's autograd.
TYPED_TEST(AttentionTest, ModuleWithGroupedHeadsAndRotaryMatchesPyTorchAutograd) {
  using T = TypeParam;
  const auto files = fixture_files(1);
  if (files.empty()) GTEST_SKIP() << "no module fixtures in " << SDPA_FIXTURE_DIR << "/core";
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    const Fixture f = Fixture::load(path);
    sdpa::ScaledDotProductAttention<T> m(f.integer("d_model"), f.integer("d_k"), f.integer("d_v"), f.integer("h"), T(0),
                                         f.integer("kv_heads"));
    sdpa_test::load_parameters(m, f);
    auto opt = options_of<T>(f);
    if (opt->has_rotary) m.set_rotary(opt->rotary);
    m.set_masked_rows(opt->o.masked_rows);
    opt->o.masked_rows = sdpa::MaskedRows::kZero;  // the module's, not an option of a module call
    const T3<T> x = sdpa_test::to_tensor<T, 3>(f, "queries"), xk = sdpa_test::to_tensor<T, 3>(f, "keys"),
                xv = sdpa_test::to_tensor<T, 3>(f, "values"), dy = sdpa_test::to_tensor<T, 3>(f, "grad_output");
    const bool self = f.integer("self_attention") != 0;
    m.train();  // dropout 0: the state records nothing random
    sdpa::ForwardState<T> state;
    const T3<T> y = self ? m.forward(x, x, x, opt->o, state) : m.forward(x, xk, xv, opt->o, state);
    EXPECT_TRUE(close(y, f, "output", tolerance<T>()));
    const sdpa::Gradients<T> g = m.backward(dy, state);
    if (self) {
      EXPECT_TRUE(close(T3<T>(g.queries + g.keys + g.values), f, "grad.queries", 5 * tolerance<T>()));
    } else {
      EXPECT_TRUE(close(g.queries, f, "grad.queries", 5 * tolerance<T>()));
      EXPECT_TRUE(close(g.keys, f, "grad.keys", 5 * tolerance<T>()));
      EXPECT_TRUE(close(g.values, f, "grad.values", 5 * tolerance<T>()));
    }
    const char* layers[4] = {"fc_q", "fc_k", "fc_v", "fc_o"};
    const sdpa::LinearGradients<T>* lg[4] = {&g.fc_q, &g.fc_k, &g.fc_v, &g.fc_o};
    for (int i = 0; i < 4; ++i) {
      EXPECT_TRUE(close(lg[i]->weight, f, std::string("grad.") + layers[i] + ".weight", 5 * tolerance<T>()));
      EXPECT_TRUE(close(lg[i]->bias, f, std::string("grad.") + layers[i] + ".bias", 5 * tolerance<T>()));
    }
    if (f.has("grad.sinks")) {
      EXPECT_TRUE(close(g.sinks.data(), g.sinks.size(), f.get("grad.sinks").f64, 5 * tolerance<T>()) << " (grad.sinks)");
    }
  }
}

// ONNX Runtime's com.microsoft.GroupQueryAttention on the same inputs (tests/fixtures/ort_gqa/,
// scripts/fixtures/make_ort_gqa_fixtures.py): causal prompts with GQA/MQA, both rotary layouts and partial rotary, a
// local window (ORT's local_window_size w: w keys, the query's own included; sdpa's window_left = w - 1),
// softcap and a scale. The op's packed (b, s, heads * d) inputs are (b, s, heads, d) tensors: Layout::kBNHD.
TYPED_TEST(AttentionTest, MatchesOnnxRuntimeGroupQueryAttention) {
  using T = TypeParam;
  const std::filesystem::path dir = std::filesystem::path(SDPA_FIXTURE_DIR) / "ort_gqa";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "no fixtures in " << dir << " (scripts/fixtures/make_ort_gqa_fixtures.py)";
  int checked = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".sdpafix") continue;
    SCOPED_TRACE(e.path().string());
    const Fixture f = Fixture::load(e.path().string());
    sdpa::AttentionOptions<T> o;
    o.layout = sdpa::Layout::kBNHD;
    o.causal = true;
    const Index w = f.integer("local_window_size");
    o.window_left = w < 0 ? -1 : w - 1;
    o.scale = static_cast<T>(f.real("scale", 0).f64[0]);
    o.softcap = static_cast<T>(f.real("softcap", 0).f64[0]);
    sdpa::Rotary r;
    if (f.integer("rotary_dim") > 0) {
      r.dim = f.integer("rotary_dim");
      r.interleaved = f.integer("interleaved") != 0;
      r.inv_freq = f.get("inv_freq").f64;
      o.rotary = &r;
    }
    const T4<T> out = sdpa::attention(sdpa_test::to_tensor<T, 4>(f, "q"), sdpa_test::to_tensor<T, 4>(f, "k"),
                                      sdpa_test::to_tensor<T, 4>(f, "v"), o);
    // ORT computes in float32: agreement to float precision, in double too.
    EXPECT_TRUE(close(out, f, "output", 2e-5));
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

// A module with random weights big enough to make the softmax far from uniform.
template <typename T>
sdpa::ScaledDotProductAttention<T> decoder(Index d_model, Index d_k, Index h, Index kv_heads) {
  sdpa::ScaledDotProductAttention<T> m(d_model, d_k, d_k, h, T(0), kv_heads);
  sdpa_test::Rng rng(7);
  sdpa_test::randomize_module(m, rng);
  m.eval();
  return m;
}

// step() in chunks of any sizes gives the rows of the causal forward, with GQA and a rotary, sinks, a
// softcap and a sliding window; the cache holds kv_heads heads.
TYPED_TEST(AttentionTest, StepInChunksEqualsTheCausalForwardWithGroupedHeadsAndRotary) {
  using T = TypeParam;
  for (const Index kv : {Index(1), Index(2), Index(4)}) {
    auto m = decoder<T>(16, 4, 4, kv);
    m.set_rotary(sdpa::rope_llama3(4, 10000, 8, 1, 4, 16));
    sdpa_test::Rng rng(3);
    T3<T> x(2, 23, 16);
    rng.fill_normal(x);
    for (int variant = 0; variant < 3; ++variant) {
      sdpa::AttentionOptions<T> o;
      if (variant >= 1) {
        o.sinks = {T(0.5), T(-1), T(0), T(2)};
        o.softcap = T(3);
      }
      if (variant == 2) o.window_left = 5;
      sdpa::AttentionOptions<T> causal = o;
      causal.causal = true;
      const T3<T> full = m(x, x, x, causal);
      sdpa::KVCache<T> cache(m, 2);
      EXPECT_EQ(cache.kv_heads(), kv);
      Index at = 0;
      for (Index n : {Index(1), Index(3), Index(7), Index(1), Index(11)}) {
        const T3<T> chunk = x.slice(Eigen::array<Index, 3>{0, at, 0}, Eigen::array<Index, 3>{2, n, 16});
        const T3<T> y = m.step(chunk, cache, o);
        for (Index b = 0; b < 2; ++b)
          for (Index i = 0; i < n; ++i)
            for (Index d = 0; d < 16; ++d)
              ASSERT_NEAR(double(y(b, i, d)), double(full(b, at + i, d)), 50 * tolerance<T>() * (1 + std::abs(double(full(b, at + i, d)))))
                  << "kv " << kv << " variant " << variant << " at " << at + i;
        at += n;
      }
      if (variant == 0) {
        EXPECT_EQ(cache.keys().dimension(2), kv * 4) << "the cache holds kv_heads heads";
      }
    }
  }
}

TEST(AttentionErrors, RefusesEveryBadArgumentNamingIt) {
  using T = float;
  T4<T> q(1, 4, 3, 8), k(1, 2, 5, 8), v(1, 2, 5, 6);
  q.setZero();
  k.setZero();
  v.setZero();
  sdpa::AttentionOptions<T> o;
  EXPECT_EQ(sdpa::attention(q, k, v, o).dimension(3), 6);
  T4<T> k3(1, 3, 5, 8), v3(1, 3, 5, 6);
  k3.setZero();
  v3.setZero();
  expect_invalid([&] { sdpa::attention(q, k3, v3); }, {"sdpa::attention", "key/value heads", "divisor", "4", "3"});
  T4<T> v_short(1, 2, 4, 6);
  v_short.setZero();
  expect_invalid([&] { sdpa::attention(q, k, v_short); }, {"sdpa::attention", "keys", "5", "4"});
  T4<T> k_dk(1, 2, 5, 7);
  k_dk.setZero();
  expect_invalid([&] { sdpa::attention(q, k_dk, v); }, {"d_k", "8", "7"});
  {
    sdpa::AttentionOptions<T> bad;
    bad.sinks = {1, 2};
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"sinks", "one logit per query head (4)", "2 logits"});
    bad.sinks = {1, 2, NAN, 4};
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"sinks[2]", "finite"});
  }
  {
    sdpa::AttentionOptions<T> bad;
    bad.softcap = -1;
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"softcap", "finite positive", "-1"});
    bad.softcap = INFINITY;
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"softcap"});
    bad.softcap = 0;
    bad.scale = -0.5f;
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"scale", "-0.5"});
    bad.scale = NAN;
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"scale"});
  }
  {
    sdpa::Rotary r;
    r.dim = 5;
    sdpa::AttentionOptions<T> bad;
    bad.rotary = &r;
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"rotary.dim", "even", "5"});
    r.dim = 10;
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"rotary.dim", "at most d_k = 8", "10"});
    r.dim = 8;
    r.inv_freq = {1, 2, 3};
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"rotary.inv_freq", "dim / 2 = 4", "3 frequencies"});
  }
  {
    sdpa::AttentionOptions<T> bad;
    bad.dropout = 1.5f;
    expect_invalid([&] { sdpa::attention(q, k, v, bad); }, {"dropout", "[0, 1]", "1.5"});
  }
  // The module: kv_heads, its rotary, the options that belong to sdpa::attention, a cache of another shape.
  expect_invalid([] { sdpa::ScaledDotProductAttention<T>(16, 4, 4, 4, 0.0f, 3); }, {"kv_heads", "divisor of h = 4", "3"});
  expect_invalid([] { sdpa::ScaledDotProductAttention<T>(16, 4, 4, 4, 0.0f, 8); }, {"kv_heads", "divisor of h = 4", "8"});
  sdpa::ScaledDotProductAttention<T> m(16, 4, 4, 4, 0.0f, 2);
  m.eval();
  sdpa::Rotary odd;
  odd.dim = 3;
  expect_invalid([&] { m.set_rotary(odd); }, {"set_rotary", "rotary.dim", "3"});
  T3<T> x(1, 3, 16);
  x.setZero();
  sdpa::AttentionOptions<T> own;
  own.kernel = sdpa::Kernel::kReference;
  expect_invalid([&] { m(x, x, x, own); }, {"ScaledDotProductAttention::forward", "kernel", "set_kernel"});
  own = {};
  own.sinks = {1, 2, 3};
  expect_invalid([&] { m(x, x, x, own); }, {"ScaledDotProductAttention::forward", "sinks", "(4)"});
  sdpa::KVCache<T> cache(m, 1);
  expect_invalid([&] { m.step(x, cache, own); }, {"ScaledDotProductAttention::step", "sinks"});
  expect_invalid([&] { m.attend(x, cache, own); }, {"ScaledDotProductAttention::attend", "sinks"});
  EXPECT_EQ(cache.size(), 0) << "a refused step appended";
  sdpa::ScaledDotProductAttention<T> mha(16, 4, 4, 4, 0.0f);
  sdpa::KVCache<T> other(mha, 1);
  expect_invalid([&] { m.step(x, other); }, {"ScaledDotProductAttention::step", "cache", "kv_heads 2", "kv_heads 4"});
}

}  // namespace attention_test
