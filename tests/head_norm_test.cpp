// Tests of the module's QK-norm, query temperature and output gate (sdpa/head_norm.hpp,
// ScaledDotProductAttention::set_qk_norm / set_query_temperature / set_output_gate): the forward against a
// plain double-precision reference written here from the definitions (per-head and whole-projection RMS
// norms with weights, Llama 4's weightless norm after the rotary, the temperature at absolute positions, the
// sigmoid gate), every decoding path (step in chunks, attend, a paged step, a bf16 cache, packed sequences)
// against the forward, the gradients against central differences of the forward in double (inputs,
// projections, the norms' weights, fc_g), the parameters by name, and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "sdpa/kv_cache.hpp"
#include "sdpa/latent_attention.hpp"
#include "sdpa/paged_kv_cache.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

namespace head_norm_test {

using Index = Eigen::Index;
template <typename T>
using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;

constexpr Index kModel = 16, kDk = 8, kHeads = 4, kKvHeads = 2;

// The variants under test: a name and what it sets on a module.
struct Variant {
  const char* name;
  sdpa::QkNormKind kind;
  bool after_rotary, weights, temperature, gate, rotary;
};

const Variant kVariants[] = {
    {"per-head norm (Qwen3)", sdpa::QkNormKind::kHead, false, true, false, false, true},
    {"projection norm (OLMo 2)", sdpa::QkNormKind::kProjection, false, true, false, false, true},
    {"weightless norm after the rotary (Llama 4)", sdpa::QkNormKind::kHead, true, false, false, false, true},
    {"temperature without rotary (Llama 4 NoPE)", sdpa::QkNormKind::kNone, false, false, true, false, false},
    {"gate with per-head norm (Qwen3-Next)", sdpa::QkNormKind::kHead, false, true, false, true, true},
    {"all at once", sdpa::QkNormKind::kHead, true, false, true, true, true},
};

template <typename T>
std::vector<T> random_values(std::mt19937& gen, std::size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(u(gen));
  return v;
}

// A module with the variant's settings and random weights of a scale that keeps the scores lively.
template <typename T>
sdpa::ScaledDotProductAttention<T> make_module(const Variant& v, unsigned seed) {
  sdpa::ScaledDotProductAttention<T> m(kModel, kDk, kDk, kHeads, T(0), kKvHeads);
  m.eval();
  m.set_output_gate(v.gate);
  std::mt19937 gen(seed);
  for (auto& p : m.named_parameters())
    for (Index i = 0; i < p.size(); ++i) p.data[i] = static_cast<T>(std::uniform_real_distribution<double>(-0.5, 0.5)(gen));
  if (v.rotary) {
    sdpa::Rotary r;
    r.theta = 100;
    m.set_rotary(r);
  }
  if (v.kind != sdpa::QkNormKind::kNone) {
    sdpa::QkNorm<T> n;
    n.kind = v.kind;
    n.eps = 1e-5;
    n.after_rotary = v.after_rotary;
    if (v.weights) {
      const std::size_t wq = v.kind == sdpa::QkNormKind::kHead ? kDk : kHeads * kDk;
      const std::size_t wk = v.kind == sdpa::QkNormKind::kHead ? kDk : kKvHeads * kDk;
      n.q_weight = random_values<T>(gen, wq, 0.5, 1.5);
      n.k_weight = random_values<T>(gen, wk, 0.5, 1.5);
    }
    m.set_qk_norm(n);
  }
  if (v.temperature) m.set_query_temperature({2.0, 0.3});
  return m;
}

// ---- the reference, in double, from the definitions ----

struct Linear64 {
  std::vector<double> w, b;  // (out, in), (out)
  Index in = 0, out = 0;
  std::vector<double> operator()(const std::vector<double>& x) const {  // one row
    std::vector<double> y(static_cast<std::size_t>(out));
    for (Index o = 0; o < out; ++o) {
      double s = b[static_cast<std::size_t>(o)];
      for (Index i = 0; i < in; ++i) s += w[static_cast<std::size_t>(o * in + i)] * x[static_cast<std::size_t>(i)];
      y[static_cast<std::size_t>(o)] = s;
    }
    return y;
  }
};

template <typename T>
Linear64 linear64(const sdpa::Linear<T>& l) {
  Linear64 r;
  r.in = l.in_features();
  r.out = l.out_features();
  r.w.assign(l.weight().data(), l.weight().data() + l.weight().size());
  r.b.assign(l.bias().data(), l.bias().data() + l.bias().size());
  return r;
}

// RMS norm of groups of `width` values of x in place, times w (empty: none).
void norm64(std::vector<double>& x, Index width, const std::vector<double>& w, double eps) {
  for (std::size_t g = 0; g < x.size(); g += static_cast<std::size_t>(width)) {
    double ms = 0;
    for (Index i = 0; i < width; ++i) ms += x[g + static_cast<std::size_t>(i)] * x[g + static_cast<std::size_t>(i)];
    const double inv = 1 / std::sqrt(ms / static_cast<double>(width) + eps);
    for (Index i = 0; i < width; ++i)
      x[g + static_cast<std::size_t>(i)] *= inv * (w.empty() ? 1.0 : w[static_cast<std::size_t>(i)]);
  }
}

// Half-split rotation of every head of d_k features at `pos`, theta 100.
void rotate64(std::vector<double>& x, Index pos) {
  for (std::size_t h = 0; h < x.size(); h += kDk)
    for (Index m = 0; m < kDk / 2; ++m) {
      const double angle = static_cast<double>(pos) * std::pow(100.0, -2.0 * static_cast<double>(m) / kDk);
      const double c = std::cos(angle), s = std::sin(angle);
      double& a = x[h + static_cast<std::size_t>(m)];
      double& b = x[h + static_cast<std::size_t>(m + kDk / 2)];
      const double a0 = a, b0 = b;
      a = a0 * c - b0 * s;
      b = b0 * c + a0 * s;
    }
}

// The module's output for x (batch, n, d_model), causal self-attention, from its parameters.
template <typename T>
Tensor3<double> reference(const sdpa::ScaledDotProductAttention<T>& m, const Variant& v, const Tensor3<T>& x) {
  const Index batch = x.dimension(0), n = x.dimension(1);
  const Linear64 fq = linear64(m.fc_q()), fk = linear64(m.fc_k()), fv = linear64(m.fc_v()), fo = linear64(m.fc_o());
  const Linear64 fg = v.gate ? linear64(m.fc_g()) : Linear64();
  std::vector<double> wq, wk;
  if (m.qk_norm() != nullptr) {
    wq.assign(m.qk_norm()->q_weight.begin(), m.qk_norm()->q_weight.end());
    wk.assign(m.qk_norm()->k_weight.begin(), m.qk_norm()->k_weight.end());
  }
  const Index width_q = v.kind == sdpa::QkNormKind::kProjection ? kHeads * kDk : kDk;
  const Index width_k = v.kind == sdpa::QkNormKind::kProjection ? kKvHeads * kDk : kDk;
  Tensor3<double> y(batch, n, kModel);
  for (Index b = 0; b < batch; ++b) {
    std::vector<std::vector<double>> q(static_cast<std::size_t>(n)), k(q.size()), val(q.size()), gate(q.size());
    for (Index t = 0; t < n; ++t) {
      std::vector<double> row(static_cast<std::size_t>(kModel));
      for (Index c = 0; c < kModel; ++c) row[static_cast<std::size_t>(c)] = static_cast<double>(x(b, t, c));
      auto& qt = q[static_cast<std::size_t>(t)];
      auto& kt = k[static_cast<std::size_t>(t)];
      qt = fq(row);
      kt = fk(row);
      val[static_cast<std::size_t>(t)] = fv(row);
      if (v.gate) gate[static_cast<std::size_t>(t)] = fg(row);
      const double eps = 1e-5;
      if (v.kind != sdpa::QkNormKind::kNone && !v.after_rotary) {
        norm64(qt, width_q, wq, eps);
        norm64(kt, width_k, wk, eps);
      }
      if (v.rotary) {
        rotate64(qt, t);
        rotate64(kt, t);
      }
      if (v.kind != sdpa::QkNormKind::kNone && v.after_rotary) {
        norm64(qt, width_q, wq, eps);
        norm64(kt, width_k, wk, eps);
      }
      if (v.temperature) {
        const double f = std::log(std::floor((static_cast<double>(t) + 1) / 2.0) + 1) * 0.3 + 1;
        for (double& e : qt) e *= f;
      }
    }
    for (Index t = 0; t < n; ++t) {
      std::vector<double> att(static_cast<std::size_t>(kHeads * kDk), 0.0);
      for (Index h = 0; h < kHeads; ++h) {
        const Index j = h / (kHeads / kKvHeads);
        std::vector<double> s(static_cast<std::size_t>(t + 1));
        double mx = -1e300, sum = 0;
        for (Index u = 0; u <= t; ++u) {
          double dot = 0;
          for (Index c = 0; c < kDk; ++c)
            dot += q[static_cast<std::size_t>(t)][static_cast<std::size_t>(h * kDk + c)] *
                   k[static_cast<std::size_t>(u)][static_cast<std::size_t>(j * kDk + c)];
          s[static_cast<std::size_t>(u)] = dot / std::sqrt(static_cast<double>(kDk));
          mx = std::max(mx, s[static_cast<std::size_t>(u)]);
        }
        for (double& e : s) sum += (e = std::exp(e - mx));
        for (Index u = 0; u <= t; ++u)
          for (Index c = 0; c < kDk; ++c)
            att[static_cast<std::size_t>(h * kDk + c)] +=
                s[static_cast<std::size_t>(u)] / sum * val[static_cast<std::size_t>(u)][static_cast<std::size_t>(j * kDk + c)];
      }
      if (v.gate)
        for (std::size_t i = 0; i < att.size(); ++i) att[i] *= 1 / (1 + std::exp(-gate[static_cast<std::size_t>(t)][i]));
      const std::vector<double> out = fo(att);
      for (Index c = 0; c < kModel; ++c) y(b, t, c) = out[static_cast<std::size_t>(c)];
    }
  }
  return y;
}

template <typename T, typename U>
double max_error(const Tensor3<T>& a, const Tensor3<U>& b) {
  EXPECT_EQ(a.dimensions(), b.dimensions());
  double e = 0;
  for (Index i = 0; i < a.size(); ++i) e = std::max(e, std::abs(static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i])));
  return e;
}

template <typename T>
Tensor3<T> random_input(Index batch, Index n, unsigned seed) {
  std::mt19937 gen(seed);
  Tensor3<T> x(batch, n, kModel);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<T>(std::uniform_real_distribution<double>(-1, 1)(gen));
  return x;
}

template <typename T>
class HeadNormTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(HeadNormTest, Scalars);

TYPED_TEST(HeadNormTest, ForwardMatchesAPlainDoubleReference) {
  using T = TypeParam;
  const double tol = std::is_same<T, float>::value ? 2e-5 : 1e-12;
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    const auto m = make_module<T>(v, 3);
    const Tensor3<T> x = random_input<T>(2, 300, 4);  // more rows than one elementwise task
    sdpa::AttentionOptions<T> o;
    o.causal = true;
    const Tensor3<double> want = reference(m, v, x);
    EXPECT_LT(max_error(m(x, x, x, o), want), tol);
    Eigen::ThreadPool pool(2);
    Eigen::ThreadPoolDevice device(&pool, 2);
    sdpa::AttentionOptions<T> threaded = o;
    threaded.device = &device;
    const Tensor3<T> y2 = m(x, x, x, threaded);
    EXPECT_LT(max_error(y2, want), tol) << "2 threads";
    // Without the option the output differs (the reference is not blind to it).
    const Tensor3<double> plain = reference(m, Variant{"none", sdpa::QkNormKind::kNone, false, false, false, v.gate, v.rotary}, x);
    EXPECT_GT(max_error(want, plain), 1e-3);
  }
}

// Every decoding path stores keys after the transforms and gates its output: each equals the forward.
TYPED_TEST(HeadNormTest, DecodingPathsEqualTheForward) {
  using T = TypeParam;
  const double tol = std::is_same<T, float>::value ? 2e-5 : 1e-12;
  const Index batch = 2, n = 21;
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    const auto m = make_module<T>(v, 5);
    const Tensor3<T> x = random_input<T>(batch, n, 6);
    sdpa::AttentionOptions<T> causal;
    causal.causal = true;
    const Tensor3<T> full = m(x, x, x, causal);
    const auto rows = [&](const Tensor3<T>& t, Index b0, Index b1, Index r0, Index r1) {
      Tensor3<T> out(b1 - b0, r1 - r0, kModel);
      for (Index b = b0; b < b1; ++b)
        for (Index r = r0; r < r1; ++r)
          for (Index c = 0; c < kModel; ++c) out(b - b0, r - r0, c) = t(b, r, c);
      return out;
    };
    // KVCache steps in chunks of 1, 3, then the rest (more than 16 rows: the tiled path).
    sdpa::KVCache<T> cache(m, batch);
    Index at = 0;
    for (const Index chunk : {Index(1), Index(3), n - 4}) {
      const Tensor3<T> part = rows(x, 0, batch, at, at + chunk);
      EXPECT_LT(max_error(m.step(part, cache), rows(full, 0, batch, at, at + chunk)), tol) << "step at " << at;
      at += chunk;
    }
    // attend: the last two queries again, against the whole cache.
    sdpa::AttentionOptions<T> attend_causal;
    attend_causal.causal = true;
    EXPECT_LT(max_error(m.attend(rows(x, 0, batch, n - 2, n), cache, attend_causal), rows(full, 0, batch, n - 2, n)), tol)
        << "attend";
    // A paged step of the two sequences, two tokens at a time.
    sdpa::PagedKVCache<T> paged(m, 16, 8);
    const std::vector<std::int64_t> ids{paged.add_sequence(), paged.add_sequence()};
    for (Index t = 0; t < 6; t += 2)
      EXPECT_LT(max_error(m.step(rows(x, 0, batch, t, t + 2), paged, ids), rows(full, 0, batch, t, t + 2)), tol)
          << "paged step at " << t;
    // Packed sequences: entry 0's first 7 rows and entry 1's 11 rows, one after the other.
    Tensor3<T> packed(1, 18, kModel);
    packed.slice(std::array<Index, 3>{0, 0, 0}, std::array<Index, 3>{1, 7, kModel}) = rows(x, 0, 1, 0, 7);
    packed.slice(std::array<Index, 3>{0, 7, 0}, std::array<Index, 3>{1, 11, kModel}) = rows(x, 1, 2, 0, 11);
    sdpa::AttentionOptions<T> po;
    po.causal = true;
    po.cu_seqlens_q = po.cu_seqlens_k = {0, 7, 18};
    const Tensor3<T> y = m(packed, packed, packed, po);
    EXPECT_LT(max_error(rows(y, 0, 1, 0, 7), rows(full, 0, 1, 0, 7)), tol) << "packed 0";
    EXPECT_LT(max_error(rows(y, 0, 1, 7, 18), rows(full, 1, 2, 0, 11)), tol) << "packed 1";
    if constexpr (std::is_same<T, float>::value) {
      // A bf16 cache holds the transformed keys rounded: within bf16's rounding of the forward.
      sdpa::KVCache<T> narrow(m, batch, 0, sdpa::Storage::kBFloat16);
      m.step(rows(x, 0, batch, 0, n - 1), narrow);
      EXPECT_LT(max_error(m.step(rows(x, 0, batch, n - 1, n), narrow), rows(full, 0, batch, n - 1, n)), 2e-2) << "bf16 cache";
    }
  }
}

// d sum(out * R) by central differences of the double forward, against backward, for inputs and every
// parameter the options add.
TEST(HeadNorm, GradientsMatchCentralDifferences) {
  using T = double;
  const Index batch = 2, n = 6;
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    auto m = make_module<T>(v, 7);
    m.train();
    Tensor3<T> x = random_input<T>(batch, n, 8);
    const Tensor3<T> r = random_input<T>(batch, n, 9);
    sdpa::AttentionOptions<T> o;
    o.causal = true;
    sdpa::ForwardState<T> state;
    m.forward(x, x, x, o, state);
    sdpa::Gradients<T> g = m.backward(r, state);
    const auto loss = [&]() {
      const Tensor3<T> y = m(x, x, x, o);
      double s = 0;
      for (Index i = 0; i < y.size(); ++i) s += y.data()[i] * r.data()[i];
      return s;
    };
    const auto numeric = [&](T* p) {
      const T keep = *p, h = 1e-6;
      *p = keep + h;
      const double up = loss();
      *p = keep - h;
      const double down = loss();
      *p = keep;
      return (up - down) / (2 * h);
    };
    // The input (queries = keys = values: one tensor).
    for (const Index i : {Index(0), Index(37), Index(150)}) {
      const double want = numeric(x.data() + i);
      EXPECT_NEAR(g.queries.data()[i] + g.keys.data()[i] + g.values.data()[i], want, 1e-7 * std::max(1.0, std::abs(want)))
          << "input " << i;
    }
    // Every parameter, a few entries each (module and gradients list the same names in the same order).
    std::vector<sdpa::ParameterRef<T>> params = m.named_parameters(), grads = g.named_parameters();
    ASSERT_EQ(params.size(), grads.size());
    for (std::size_t p = 0; p < params.size(); ++p) {
      ASSERT_EQ(params[p].name, grads[p].name);
      ASSERT_EQ(params[p].size(), grads[p].size()) << params[p].name;
      for (const Index i : {Index(0), params[p].size() / 2, params[p].size() - 1}) {
        const double want = numeric(params[p].data + i);
        EXPECT_NEAR(grads[p].data[i], want, 1e-7 * std::max(1.0, std::abs(want))) << params[p].name << "[" << i << "]";
      }
    }
  }
}

// MRoPE (Qwen2-VL): text tokens (three equal positions) turn as implicit positions do; an image's (t, h, w)
// turn each section by its stream, against a plain double rotation; the step takes the positions of its
// tokens; the gradients hold through the explicit positions; wrong counts are refused.
TEST(HeadNorm, MultimodalRotaryPositions) {
  using T = double;
  auto m = make_module<T>(Variant{"plain", sdpa::QkNormKind::kNone, false, false, false, false, false}, 13);
  sdpa::Rotary r;
  r.theta = 100;
  r.mrope_section = {1, 1, 2};  // frequency 0: t, 1: h, 2 and 3: w
  m.set_rotary(r);
  const Index batch = 2, n = 6;
  const Tensor3<T> x = random_input<T>(batch, n, 11);
  sdpa::AttentionOptions<T> o;
  o.causal = true;
  const Tensor3<T> implicit = m(x, x, x, o);
  for (Index st = 0; st < 3; ++st)
    for (Index b = 0; b < batch; ++b)
      for (Index t = 0; t < n; ++t) o.rotary_positions.push_back(t);
  EXPECT_LT(max_error(m(x, x, x, o), implicit), 1e-14) << "text positions";
  // Entry 0: tokens 1..4 an image (t = 1; h, w in {1, 2}); then text at 3. Entry 1: text.
  const Index t_h_w[3][6] = {{0, 1, 1, 1, 1, 3}, {0, 1, 1, 2, 2, 3}, {0, 1, 2, 1, 2, 3}};
  o.rotary_positions.clear();
  for (Index st = 0; st < 3; ++st)
    for (Index b = 0; b < batch; ++b)
      for (Index t = 0; t < n; ++t) o.rotary_positions.push_back(b == 0 ? t_h_w[st][t] : t);
  const Tensor3<T> y = m(x, x, x, o);
  // The reference: q and k of entry 0 rotated per frequency by its stream's position.
  const auto project = [&](const sdpa::Linear<T>& l, Index t) {
    std::vector<double> row(static_cast<std::size_t>(kModel));
    for (Index c = 0; c < kModel; ++c) row[static_cast<std::size_t>(c)] = x(0, t, c);
    return linear64(l)(row);
  };
  const auto turn = [&](std::vector<double> v, Index t) {
    const Index stream_of[4] = {0, 1, 2, 2};
    for (std::size_t h = 0; h < v.size(); h += kDk)
      for (Index f = 0; f < kDk / 2; ++f) {
        const double angle = static_cast<double>(t_h_w[stream_of[f]][t]) * std::pow(100.0, -2.0 * static_cast<double>(f) / kDk);
        double& a = v[h + static_cast<std::size_t>(f)];
        double& b = v[h + static_cast<std::size_t>(f + kDk / 2)];
        const double a0 = a, b0 = b;
        a = a0 * std::cos(angle) - b0 * std::sin(angle);
        b = b0 * std::cos(angle) + a0 * std::sin(angle);
      }
    return v;
  };
  const Index t = n - 1;  // the last query of entry 0 sees every key
  std::vector<double> att(static_cast<std::size_t>(kHeads * kDk), 0.0);
  const std::vector<double> q = turn(project(m.fc_q(), t), t);
  for (Index h = 0; h < kHeads; ++h) {
    const Index j = h / (kHeads / kKvHeads);
    std::vector<double> s;
    double mx = -1e300, sum = 0;
    for (Index u = 0; u <= t; ++u) {
      const std::vector<double> k = turn(project(m.fc_k(), u), u);
      double dot = 0;
      for (Index c = 0; c < kDk; ++c) dot += q[static_cast<std::size_t>(h * kDk + c)] * k[static_cast<std::size_t>(j * kDk + c)];
      s.push_back(dot / std::sqrt(double(kDk)));
      mx = std::max(mx, s.back());
    }
    for (double& e : s) sum += (e = std::exp(e - mx));
    for (Index u = 0; u <= t; ++u) {
      const std::vector<double> v = project(m.fc_v(), u);
      for (Index c = 0; c < kDk; ++c)
        att[static_cast<std::size_t>(h * kDk + c)] += s[static_cast<std::size_t>(u)] / sum * v[static_cast<std::size_t>(j * kDk + c)];
    }
  }
  const std::vector<double> want = linear64(m.fc_o())(att);
  for (Index c = 0; c < kModel; ++c) EXPECT_NEAR(y(0, t, c), want[static_cast<std::size_t>(c)], 1e-12) << c;
  EXPECT_GT(max_error(y, implicit), 1e-4);  // the image's positions matter
  // Steps: the prompt of 4, then single tokens, each with its own positions.
  sdpa::KVCache<T> cache(m, batch);
  Index at = 0;
  for (const Index chunk : {Index(4), Index(1), Index(1)}) {
    sdpa::AttentionOptions<T> so;
    for (Index st = 0; st < 3; ++st)
      for (Index b = 0; b < batch; ++b)
        for (Index i = at; i < at + chunk; ++i) so.rotary_positions.push_back(b == 0 ? t_h_w[st][i] : i);
    Tensor3<T> part(batch, chunk, kModel), expected(batch, chunk, kModel);
    for (Index b = 0; b < batch; ++b)
      for (Index i = 0; i < chunk; ++i)
        for (Index c = 0; c < kModel; ++c) {
          part(b, i, c) = x(b, at + i, c);
          expected(b, i, c) = y(b, at + i, c);
        }
    EXPECT_LT(max_error(m.step(part, cache, so), expected), 1e-12) << "step at " << at;
    at += chunk;
  }
  // Gradients through the explicit positions, against central differences.
  m.train();
  const Tensor3<T> rr = random_input<T>(batch, n, 12);
  Tensor3<T> xx = x;
  sdpa::ForwardState<T> state;
  m.forward(xx, xx, xx, o, state);
  const sdpa::Gradients<T> g = m.backward(rr, state);
  for (const Index i : {Index(3), Index(40), Index(90)}) {
    const T keep = xx.data()[i];
    const auto loss = [&] {
      const Tensor3<T> out = m(xx, xx, xx, o);
      double sum = 0;
      for (Index e = 0; e < out.size(); ++e) sum += out.data()[e] * rr.data()[e];
      return sum;
    };
    xx.data()[i] = keep + 1e-6;
    const double up = loss();
    xx.data()[i] = keep - 1e-6;
    const double down = loss();
    xx.data()[i] = keep;
    EXPECT_NEAR(g.queries.data()[i] + g.keys.data()[i] + g.values.data()[i], (up - down) / 2e-6, 1e-7) << i;
  }
  // Refusals.
  sdpa::AttentionOptions<T> bad;
  bad.rotary_positions.assign(5, 0);
  try {
    m(x, x, x, bad);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rotary_positions must be 36 values (3 streams x batch 2 x 6 rows)"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(m.attend(x, cache, o), std::invalid_argument);
}

TEST(HeadNorm, ParametersAreNamedAsTransformersNamesThem) {
  const auto m = make_module<float>(kVariants[4], 1);  // gate and per-head norm weights
  std::vector<std::string> names;
  for (const auto& p : m.named_parameters()) names.push_back(p.name);
  const std::vector<std::string> want{"fc_q.weight", "fc_q.bias", "fc_k.weight", "fc_k.bias", "fc_v.weight", "fc_v.bias",
                                      "fc_o.weight", "fc_o.bias", "fc_g.weight", "fc_g.bias", "q_norm.weight", "k_norm.weight"};
  EXPECT_EQ(names, want);
  auto copy = m;  // a copy keeps the options
  EXPECT_TRUE(copy.output_gate());
  ASSERT_NE(copy.qk_norm(), nullptr);
  EXPECT_EQ(copy.qk_norm()->q_weight, m.qk_norm()->q_weight);
  copy.set_output_gate(false);
  copy.clear_qk_norm();
  EXPECT_EQ(copy.named_parameters().size(), 8u);
}

TEST(HeadNorm, RefusesWhatDoesNotFitNamingIt) {
  sdpa::ScaledDotProductAttention<float> m(kModel, kDk, kDk, kHeads, 0.0f, kKvHeads);
  const auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no std::invalid_argument";
  };
  sdpa::QkNorm<float> n;
  n.kind = sdpa::QkNormKind::kHead;
  n.q_weight.assign(kDk + 1, 1.0f);
  EXPECT_NE(message([&] { m.set_qk_norm(n); }).find("qk_norm.q_weight must be empty (no weight) or 8 values"), std::string::npos);
  n.kind = sdpa::QkNormKind::kProjection;
  n.q_weight.assign(kHeads * kDk, 1.0f);
  n.k_weight.assign(kDk, 1.0f);
  EXPECT_NE(message([&] { m.set_qk_norm(n); }).find("qk_norm.k_weight must be empty (no weight) or 16 values"), std::string::npos);
  n.k_weight.clear();
  n.eps = 0;
  EXPECT_NE(message([&] { m.set_qk_norm(n); }).find("qk_norm.eps must be finite and positive"), std::string::npos);
  n.eps = 1e-6;
  n.after_rotary = true;
  EXPECT_NE(message([&] { m.set_qk_norm(n); }).find("no weights with after_rotary"), std::string::npos);
  EXPECT_NE(message([&] { m.set_query_temperature({0.0, 0.1}); }).find("temperature.floor_scale must be finite and positive"),
            std::string::npos);
  EXPECT_EQ(m.qk_norm(), nullptr);  // refused: nothing changed
  EXPECT_EQ(m.query_temperature(), nullptr);
}

// Latent attention with more heads than the decoding kernel's rows: the absorbed form runs the heads as the
// rows of one tiled product (one block of rows per worker); it equals the expanded forward, on one thread
// and two, from a Scalar cache and (float) a bf16 one.
template <typename T>
void latent_heads_as_rows() {
  sdpa::LatentConfig c;
  c.d_model = 32;
  c.heads = 24;
  c.kv_lora_rank = 16;
  c.qk_nope_head_dim = 8;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 6;
  sdpa::LatentAttention<T> m(c, 3);
  std::mt19937 gen(4);
  for (auto& p : m.named_parameters())
    for (Index i = 0; i < p.size(); ++i) p.data[i] = static_cast<T>(std::uniform_real_distribution<double>(-0.5, 0.5)(gen));
  Tensor3<T> x(2, 9, 32);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<T>(std::uniform_real_distribution<double>(-1, 1)(gen));
  sdpa::AttentionOptions<T> causal;
  causal.causal = true;
  const Tensor3<T> y = m.forward(x, causal);
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice two(&pool, 2);
  std::vector<sdpa::Storage> storages{sdpa::native_storage<T>()};
  if (std::is_same<T, float>::value) storages.push_back(sdpa::Storage::kBFloat16);
  for (const sdpa::Storage storage : storages)
    for (const Eigen::ThreadPoolDevice* device : {static_cast<const Eigen::ThreadPoolDevice*>(nullptr),
                                                  static_cast<const Eigen::ThreadPoolDevice*>(&two)}) {
      SCOPED_TRACE(std::string(sdpa::storage_name(storage)) + (device != nullptr ? ", 2 threads" : ", 1 thread"));
      const double tol = storage != sdpa::native_storage<T>() ? 3e-2 : std::is_same<T, float>::value ? 2e-5 : 1e-12;
      sdpa::LatentCache<T> cache(m, 2, 0, storage);
      Index at = 0;
      for (const Index chunk : {Index(3), Index(1), Index(5)}) {
        const Tensor3<T> part = x.slice(std::array<Index, 3>{0, at, 0}, std::array<Index, 3>{2, chunk, 32});
        const Tensor3<T> want = y.slice(std::array<Index, 3>{0, at, 0}, std::array<Index, 3>{2, chunk, 32});
        EXPECT_LT(max_error(m.step(part, cache, device), want), tol) << "step at " << at;
        at += chunk;
      }
    }
}

TEST(LatentAttention, HeadsAsRowsOfOneProductEqualTheForward) {
  latent_heads_as_rows<float>();
  latent_heads_as_rows<double>();
}

}  // namespace head_norm_test
