// Tests of sdpa/kernels/backward.hpp. Two oracles: a plain double-precision backward written here from the
// definitions (loops over each full row of probabilities, PyTorch's autograd of the original module for
// rows whose softmax is NaN), and central finite differences of the forward (double, small shapes). Both
// kernels (tiled_backward, reference_backward) are checked against them for every option: every broadcast
// form of mask, weights and bias (with the weights' and bias' gradients), causal with nq <, = and > nk,
// windows, key lengths (0 included), ALiBi, both masked-row policies, training-mode dropout, d_k != d_v,
// one head, odd sizes on forced tiny and default tiles, strided and fused layouts. Also: the same bits on
// 1 and 2 threads and in repeated calls, non-finite values behind hidden keys, empty problems, and no
// allocation of size nq * nk.
#include "support/alloc_tracking.hpp"

#include "sdpa/kernels/backward.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "sdpa/kernels/reference.hpp"
#include "sdpa/kernels/tiled.hpp"
#include "sdpa/mask.hpp"
#include "support/problem.hpp"


namespace backward_test {

using Index = Eigen::Index;
using sdpa::MaskedRows;

// Bit-identical contents (memcmp is not called on the null data() of an empty vector).
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}
using sdpa::kernels::AttentionProblem;
using sdpa::kernels::BackwardProblem;
using sdpa::kernels::Heads;
using sdpa::kernels::TileConfig;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// The problems: tests/support/problem.hpp, here with the backward's buffers and smaller heads by default.
struct Spec : sdpa_test::Spec {
  Spec() {
    d_k = 4;
    d_v = 3;
    backward = true;
  }
};
using sdpa_test::describe;
using sdpa_test::make_problem;
using sdpa_test::TestProblem;

std::string describe(const TileConfig& c) {
  return "blocks " + std::to_string(c.block_q) + "x" + std::to_string(c.block_k) + " group " + std::to_string(c.group);
}

// Gradients as dense arrays: dq (batch, nq, heads, d_k), dk (batch, nk, heads, d_k), dv (batch, nk, heads,
// d_v), d_weights and d_bias in their tensors' shapes.
template <typename U>
struct Grads {
  std::vector<U> dq, dk, dv, dw, db;
};

template <typename T>
std::vector<T> gather(const Heads<T>& x, Index batch, Index heads, Index n, Index d) {
  std::vector<T> out;
  for (Index b = 0; b < batch; ++b)
    for (Index i = 0; i < n; ++i)
      for (Index h = 0; h < heads; ++h) out.insert(out.end(), x.row(b, h, i), x.row(b, h, i) + d);
  return out;
}

enum class Kernel { kTiled, kReference };

// Runs a backward kernel over garbage-filled outputs and checks that it left every padding element alone.
template <typename T>
Grads<T> run_backward(TestProblem<T>& t, Kernel kernel = Kernel::kTiled, const Eigen::ThreadPoolDevice* device = nullptr,
                      TileConfig config = TileConfig{}) {
  constexpr T kGarbage = T(-7.25);
  std::fill(t.grads.begin(), t.grads.end(), kGarbage);
  std::fill(t.d_weights.begin(), t.d_weights.end(), kGarbage);
  std::fill(t.d_bias.begin(), t.d_bias.end(), kGarbage);
  if (kernel == Kernel::kTiled) sdpa::kernels::tiled_backward(t.bp, device, config);
  else sdpa::kernels::reference_backward(t.bp, device);
  const AttentionProblem<T>& p = t.p;
  Grads<T> g;
  g.dq = gather(t.bp.d_q, p.batch, p.heads, p.nq, p.d_k);
  g.dk = gather(t.bp.d_k, p.batch, p.heads, p.nk, p.d_k);
  g.dv = gather(t.bp.d_v, p.batch, p.heads, p.nk, p.d_v);
  g.dw = t.d_weights;
  g.db = t.d_bias;
  // Padding: everything the gradients' layouts do not address keeps its garbage.
  std::vector<char> addressed(t.grads.size(), 0);
  auto mark = [&](const Heads<T>& x, Index n, Index d) {
    for (Index b = 0; b < p.batch; ++b)
      for (Index h = 0; h < p.heads; ++h)
        for (Index i = 0; i < n; ++i)
          for (Index e = 0; e < d; ++e) addressed[static_cast<std::size_t>(x.row(b, h, i) + e - t.grads.data())] = 1;
  };
  mark(t.bp.d_q, p.nq, p.d_k);
  mark(t.bp.d_k, p.nk, p.d_k);
  mark(t.bp.d_v, p.nk, p.d_v);
  for (std::size_t i = 0; i < t.grads.size(); ++i) {
    if (!addressed[i]) {
      EXPECT_EQ(t.grads[i], kGarbage) << "padding element " << i << " written";
    }
  }
  return g;
}

// ------------------------------------------------------------------------- the double-precision oracle

// Whether key j is hidden from query i of (b, h), straight from the options' definitions.
template <typename T>
bool hidden(const TestProblem<T>& t, Index b, Index h, Index i, Index j) {
  const AttentionProblem<T>& p = t.p;
  const Index pos = i + p.query_offset;
  if (p.mask && p.mask(b, h, i, j)) return true;
  if (p.causal && j > pos) return true;
  if (p.window_left >= 0 && j < pos - p.window_left) return true;
  if (p.window_right >= 0 && j > pos + p.window_right) return true;
  if (p.key_lengths != nullptr && j >= p.key_lengths[b]) return true;
  return false;
}

// The gradients of L = sum(dO o O) in double, one full row of probabilities at a time. A row's softmax is
// taken as PyTorch takes it over the masked scores (hidden keys -inf): exp(-inf - max) / sum is 0 unless
// the row is NaN, when every probability of the row is NaN; a row with no visible key is all NaN under
// kNaN (the original module) and all 0 under kZero. The masked_fill's gradient is zero at hidden keys.
template <typename T>
Grads<double> oracle(const TestProblem<T>& t) {
  const AttentionProblem<T>& p = t.p;
  const Index B = p.batch, H = p.heads, NQ = p.nq, NK = p.nk, DK = p.d_k, DV = p.d_v;
  Grads<double> g;
  g.dq.assign(static_cast<std::size_t>(B * NQ * H * DK), 0.0);
  g.dk.assign(static_cast<std::size_t>(B * NK * H * DK), 0.0);
  g.dv.assign(static_cast<std::size_t>(B * NK * H * DV), 0.0);
  g.dw.assign(t.d_weights.size(), 0.0);
  g.db.assign(t.d_bias.size(), 0.0);
  auto qi = [&](Index b, Index h, Index i, Index d) { return double(p.q.row(b, h, i)[d]); };
  auto kj = [&](Index b, Index h, Index j, Index d) { return double(p.k.row(b, h, j)[d]); };
  auto vj = [&](Index b, Index h, Index j, Index d) { return double(p.v.row(b, h, j)[d]); };
  auto dOi = [&](Index b, Index h, Index i, Index d) { return double(t.bp.d_out.row(b, h, i)[d]); };
  auto dense = [](const std::array<Index, 4>& dims, Index b, Index h, Index i, Index j) {
    const Index c[4] = {dims[0] == 1 ? 0 : b, dims[1] == 1 ? 0 : h, dims[2] == 1 ? 0 : i, dims[3] == 1 ? 0 : j};
    return static_cast<std::size_t>(((c[0] * dims[1] + c[1]) * dims[2] + c[2]) * dims[3] + c[3]);
  };
  const double scale = double(p.scale), keep = double(p.keep_scale);
  std::vector<double> u(static_cast<std::size_t>(NK)), s(u.size()), prob(u.size()), z(u.size()), dp(u.size());
  std::vector<char> hid(u.size());
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < NQ; ++i) {
        const Index pos = i + p.query_offset;
        bool seen = false;
        double max = -kInf;
        for (Index j = 0; j < NK; ++j) {
          const std::size_t sj = static_cast<std::size_t>(j);
          hid[sj] = hidden(t, b, h, i, j);
          z[sj] = !p.dropout ? 1.0 : p.sampler.dropped(b * H + h, i, j) ? 0.0 : keep;
          if (hid[sj]) {
            s[sj] = -kInf;
            continue;
          }
          seen = true;
          double dot = 0;
          for (Index d = 0; d < DK; ++d) dot += qi(b, h, i, d) * kj(b, h, j, d);
          u[sj] = scale * dot;
          double x = u[sj];
          if (p.weights) x *= double(p.weights(b, h, i, j));
          if (p.bias) x += double(p.bias(b, h, i, j));
          if (p.alibi) x -= double(p.alibi[h]) * double(std::abs(pos - j));
          s[sj] = x;
          max = std::isnan(max) || std::isnan(x) ? kNaN : std::max(max, x);
        }
        double sum = 0;
        for (Index j = 0; j < NK; ++j) sum += std::exp(s[static_cast<std::size_t>(j)] - max);
        for (Index j = 0; j < NK; ++j) {
          const std::size_t sj = static_cast<std::size_t>(j);
          prob[sj] = seen ? std::exp(s[sj] - max) / sum : p.masked_rows == MaskedRows::kNaN ? kNaN : 0.0;
        }
        double delta = 0;  // dO . O
        for (Index j = 0; j < NK; ++j) {
          const std::size_t sj = static_cast<std::size_t>(j);
          if (hid[sj]) continue;
          double dot = 0;
          for (Index d = 0; d < DV; ++d) dot += dOi(b, h, i, d) * vj(b, h, j, d);
          dp[sj] = dot * z[sj];
          delta += prob[sj] * dp[sj];
        }
        for (Index j = 0; j < NK; ++j) {
          const std::size_t sj = static_cast<std::size_t>(j);
          for (Index d = 0; d < DV; ++d)
            g.dv[static_cast<std::size_t>(((b * NK + j) * H + h) * DV + d)] += prob[sj] * z[sj] * dOi(b, h, i, d);
          if (hid[sj]) continue;
          const double ds = prob[sj] * (dp[sj] - delta);
          if (p.bias) g.db[dense(t.bias_dims, b, h, i, j)] += ds;
          if (p.weights) g.dw[dense(t.weights_dims, b, h, i, j)] += ds * u[sj];
          const double du = (p.weights ? ds * double(p.weights(b, h, i, j)) : ds) * scale;
          for (Index d = 0; d < DK; ++d) {
            g.dq[static_cast<std::size_t>(((b * NQ + i) * H + h) * DK + d)] += du * kj(b, h, j, d);
            g.dk[static_cast<std::size_t>(((b * NK + j) * H + h) * DK + d)] += du * qi(b, h, i, d);
          }
        }
      }
  return g;
}

template <typename T>
double tolerance() {
  return std::is_same<T, float>::value ? 1e-4 : 1e-10;
}

// The largest finite |x| of a gradient tensor.
template <typename U>
double largest(const std::vector<U>& x) {
  double m = 0;
  for (U v : x)
    if (std::isfinite(double(v))) m = std::max(m, std::abs(double(v)));
  return m;
}

// Same NaN positions; elsewhere |got - want| <= tol * max(|want|, floor). The floor is the largest gradient
// of the call (of any tensor): a gradient whose terms cancel is as exact as its terms, not as its sum (a
// bias broadcast over the keys gets sum_j dS_j = 0 up to rounding, as the softmax ignores a shift of its
// row).
template <typename T, typename U>
::testing::AssertionResult close(const char* name, const std::vector<T>& got, const std::vector<U>& want, double tol,
                                 double floor) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << name << ": " << got.size() << " elements, want " << want.size();
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double a = double(got[i]), b = double(want[i]);
    if (std::isnan(a) != std::isnan(b))
      return ::testing::AssertionFailure() << name << "[" << i << "]: got " << a << ", want " << b;
    if (std::isnan(b) || a == b) continue;
    if (!(std::abs(a - b) <= tol * std::max(std::abs(b), floor)))
      return ::testing::AssertionFailure() << name << "[" << i << "]: got " << a << ", want " << b << " (floor " << floor
                                           << ")";
  }
  return ::testing::AssertionSuccess();
}

template <typename T, typename U>
void expect_close(const Grads<T>& got, const Grads<U>& want, double tol) {
  const double floor = std::max({largest(want.dq), largest(want.dk), largest(want.dv), largest(want.dw),
                                 largest(want.db), 1e-300});
  EXPECT_TRUE(close("dq", got.dq, want.dq, tol, floor));
  EXPECT_TRUE(close("dk", got.dk, want.dk, tol, floor));
  EXPECT_TRUE(close("dv", got.dv, want.dv, tol, floor));
  EXPECT_TRUE(close("d_weights", got.dw, want.dw, tol, floor));
  EXPECT_TRUE(close("d_bias", got.db, want.db, tol, floor));
}

const TileConfig kTiny{4, 8, 1};
const TileConfig kTinyGroups{4, 8, 3};  // three query blocks take turns on each key block

// Both kernels against the oracle, the tiled one on each of `configs`.
template <typename T>
void check_against_oracle(const Spec& s, std::initializer_list<TileConfig> configs = {kTiny, kTinyGroups, TileConfig{}}) {
  SCOPED_TRACE(describe(s));
  auto t = make_problem<T>(s);
  const Grads<double> want = oracle(*t);
  {
    SCOPED_TRACE("reference_backward");
    expect_close(run_backward(*t, Kernel::kReference), want, tolerance<T>());
  }
  for (const TileConfig& c : configs) {
    SCOPED_TRACE(describe(c));
    expect_close(run_backward(*t, Kernel::kTiled, nullptr, c), want, tolerance<T>());
  }
}

template <typename T>
class BackwardTest : public ::testing::Test {};
using ScalarTypes = ::testing::Types<float, double>;
struct ScalarName {
  template <typename T>
  static std::string GetName(int) {
    return std::is_same<T, float>::value ? "float" : "double";
  }
};
TYPED_TEST_SUITE(BackwardTest, ScalarTypes, ScalarName);

// ------------------------------------------------------------------------------------- against the oracle

TYPED_TEST(BackwardTest, ShapesAroundTinyBlockBoundaries) {
  using T = TypeParam;
  std::uint32_t seed = 1;
  for (Index nq : {1, 3, 4, 5, 9, 13})
    for (Index nk : {1, 2, 7, 8, 9, 17}) {
      Spec s;
      s.nq = nq;
      s.nk = nk;
      s.seed = seed++;
      check_against_oracle<T>(s, {kTiny, kTinyGroups, TileConfig{1, 1, 1}, TileConfig{3, 5, 2}});
    }
}

TYPED_TEST(BackwardTest, ShapesAroundDefaultBlockBoundaries) {
  using T = TypeParam;
  const TileConfig c = TileConfig::for_problem<T>(16, 16);
  for (Index nq : {c.block_q - 1, c.block_q + 1, Index(2) * c.block_q + 3})
    for (Index nk : {c.block_k, c.block_k + 1, Index(97)}) {
      Spec s;
      s.batch = 1;
      s.heads = 2;
      s.d_k = 16;
      s.d_v = 16;
      s.nq = nq;
      s.nk = nk;
      s.seed = static_cast<std::uint32_t>(nq * 1000 + nk);
      s.has_mask = true;
      s.mask_full = {{false, true, true, true}};
      s.mask_rate = 0.2;
      s.fully_masked_rate = 0.05;
      check_against_oracle<T>(s, {TileConfig{}});
    }
}

TYPED_TEST(BackwardTest, HeadDimsOneHeadAndOddBlocks) {
  using T = TypeParam;
  std::uint32_t seed = 100;
  for (Index heads : {1, 3})
    for (Index d_k : {1, 5, 17})
      for (Index d_v : {1, 4, 9}) {
        Spec s;
        s.heads = heads;
        s.nq = 11;
        s.nk = 13;
        s.d_k = d_k;
        s.d_v = d_v;
        s.has_mask = true;
        s.has_weights = true;
        s.seed = seed++;
        check_against_oracle<T>(s, {kTiny, TileConfig{5, 3, 2}, TileConfig{7, 13, 1}});
      }
}

TYPED_TEST(BackwardTest, EveryMaskBroadcastFormUnderBothPolicies) {
  using T = TypeParam;
  std::uint32_t seed = 200;
  for (int form = 0; form < 16; ++form)
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
      Spec s;
      s.heads = 3;
      s.nq = 9;
      s.nk = 11;
      s.has_mask = true;
      s.mask_full = {{(form & 1) != 0, (form & 2) != 0, (form & 4) != 0, (form & 8) != 0}};
      s.mask_rate = 0.4;
      s.fully_masked_rate = 0.2;
      s.policy = policy;
      s.seed = seed++;
      check_against_oracle<T>(s);
    }
}

TYPED_TEST(BackwardTest, EveryWeightsAndBiasBroadcastFormWithTheirGradients) {
  using T = TypeParam;
  std::uint32_t seed = 300;
  for (int form = 0; form < 16; ++form) {
    Spec s;
    s.heads = 3;
    s.nq = 9;
    s.nk = 11;
    s.has_weights = true;
    s.weights_full = {{(form & 1) != 0, (form & 2) != 0, (form & 4) != 0, (form & 8) != 0}};
    s.has_bias = true;
    s.bias_full = {{(form & 8) != 0, (form & 4) != 0, (form & 2) != 0, (form & 1) != 0}};
    s.seed = seed++;
    check_against_oracle<T>(s);
    s.has_mask = true;  // hidden scores pass no gradient to weights or bias
    s.mask_full = {{(form & 2) != 0, (form & 1) != 0, (form & 8) != 0, (form & 4) != 0}};
    s.fully_masked_rate = 0.2;
    s.policy = form % 2 ? MaskedRows::kNaN : MaskedRows::kZero;
    check_against_oracle<T>(s);
    // Only one of them: the other gradient pointer is left null.
    s.has_weights = form % 3 == 0;
    s.has_bias = !s.has_weights;
    check_against_oracle<T>(s);
  }
}

TYPED_TEST(BackwardTest, CausalWithFewerEqualAndMoreQueriesThanKeys) {
  using T = TypeParam;
  std::uint32_t seed = 400;
  for (const auto& n : {std::array<Index, 2>{{9, 23}}, std::array<Index, 2>{{17, 17}}, std::array<Index, 2>{{23, 9}}})
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
      Spec s;
      s.nq = n[0];
      s.nk = n[1];
      s.causal = true;  // with nq > nk the first queries see no key
      s.policy = policy;
      s.seed = seed++;
      check_against_oracle<T>(s);
    }
}

TYPED_TEST(BackwardTest, WindowsKeyLengthsAndAlibi) {
  using T = TypeParam;
  std::uint32_t seed = 500;
  for (const auto& n : {std::array<Index, 2>{{19, 19}}, std::array<Index, 2>{{8, 25}}, std::array<Index, 2>{{25, 8}}})
    for (int variant = 0; variant < 8; ++variant) {
      Spec s;
      s.batch = 3;
      s.nq = n[0];
      s.nk = n[1];
      s.seed = seed++;
      s.causal = variant == 0 || variant == 3 || variant == 7;
      if (variant == 1 || variant == 3 || variant == 7) s.window_left = 4;
      if (variant == 2 || variant == 3) s.window_right = 1;
      if (variant == 4 || variant == 7) s.key_lengths = {n[1], 0, n[1] / 2 + 1};
      if (variant == 5 || variant == 7) s.alibi = true;
      if (variant == 6 || variant == 7) {
        s.has_mask = true;
        s.has_bias = true;
        s.bias_full = {{false, true, true, true}};
        s.has_weights = true;
        s.weights_full = {{true, false, true, true}};
      }
      for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
        s.policy = policy;
        check_against_oracle<T>(s, {kTiny, kTinyGroups, TileConfig{5, 3, 2}, TileConfig{}});
      }
    }
}

TYPED_TEST(BackwardTest, TrainingModeDropout) {
  using T = TypeParam;
  std::uint32_t seed = 600;
  for (double rate : {0.1, 0.5, 1.0}) {
    Spec s;
    s.nq = 13;
    s.nk = 21;
    s.dropout = rate;
    s.seed = seed++;
    check_against_oracle<T>(s);
    s.has_mask = true;
    s.fully_masked_rate = 0.2;
    s.has_weights = true;
    s.has_bias = true;
    s.bias_full = {{false, false, true, true}};
    s.causal = true;
    s.alibi = true;
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
      s.policy = policy;
      check_against_oracle<T>(s, {kTiny, TileConfig{3, 5, 2}, TileConfig{}});
    }
  }
}

TYPED_TEST(BackwardTest, StridedPaddedAndFusedLayouts) {
  using T = TypeParam;
  Spec s;
  s.nq = 10;
  s.nk = 10;
  s.heads = 3;
  s.has_mask = true;
  s.pad = 3;
  s.grad_pad = 5;
  s.seed = 700;
  check_against_oracle<T>(s);
  s.pad = 0;
  s.grad_pad = 0;
  s.fused = true;
  s.d_v = 5;
  s.causal = true;
  check_against_oracle<T>(s);
}

// The kNaN policy as the original module's autograd has it, by hand: a query that sees no key gets no
// gradient and sends none to k, while every dv row of its (batch, head) becomes NaN.
TYPED_TEST(BackwardTest, NaNPolicySpreadsToTheValuesOfItsHeadOnly) {
  using T = TypeParam;
  Spec s;
  s.batch = 2;
  s.heads = 2;
  s.nq = 6;
  s.nk = 7;
  s.key_lengths = {0, 7};  // batch 0: no query sees a key
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
    s.policy = policy;
    auto t = make_problem<T>(s);
    for (const Kernel kernel : {Kernel::kTiled, Kernel::kReference}) {
      const Grads<T> g = run_backward(*t, kernel, nullptr, kTiny);
      const std::size_t half_q = g.dq.size() / 2, half_k = g.dk.size() / 2, half_v = g.dv.size() / 2;
      for (std::size_t i = 0; i < half_q; ++i) EXPECT_EQ(g.dq[i], T(0));
      for (std::size_t i = 0; i < half_k; ++i) EXPECT_EQ(g.dk[i], T(0));
      for (std::size_t i = 0; i < half_v; ++i) {
        if (policy == MaskedRows::kNaN) {
          EXPECT_TRUE(std::isnan(g.dv[i])) << i;
        } else {
          EXPECT_EQ(g.dv[i], T(0)) << i;
        }
      }
      for (std::size_t i = half_q; i < g.dq.size(); ++i) EXPECT_TRUE(std::isfinite(g.dq[i]));
      for (std::size_t i = half_v; i < g.dv.size(); ++i) EXPECT_TRUE(std::isfinite(g.dv[i]));
    }
    expect_close(run_backward(*t, Kernel::kTiled, nullptr, kTiny), oracle(*t), tolerance<T>());
  }
}

// A NaN score makes its row's softmax NaN whatever the policy: dv of the whole (batch, head) and the row's
// dq are NaN, other heads stay finite.
TYPED_TEST(BackwardTest, NaNScoresPropagate) {
  using T = TypeParam;
  Spec s;
  s.batch = 1;
  s.heads = 2;
  s.nq = 6;
  s.nk = 9;
  s.has_bias = true;
  auto t = make_problem<T>(s);
  t->bias(0, 0, 2, 4) = std::numeric_limits<T>::quiet_NaN();
  sdpa::kernels::tiled_attention(t->p);  // O and log-sum-exp again
  const Grads<double> want = oracle(*t);
  for (const TileConfig& c : {kTiny, TileConfig{}}) {
    const Grads<T> g = run_backward(*t, Kernel::kTiled, nullptr, c);
    expect_close(g, want, tolerance<T>());
    EXPECT_TRUE(std::isnan(g.dq[static_cast<std::size_t>((2 * s.heads + 0) * s.d_k)]));
    EXPECT_TRUE(std::isfinite(g.dq[static_cast<std::size_t>((2 * s.heads + 1) * s.d_k)]));
  }
  expect_close(run_backward(*t, Kernel::kReference), want, tolerance<T>());
}

// Keys hidden from every query may hold NaN and infinity (the module does not project keys past a key
// length): no gradient is touched by them.
TYPED_TEST(BackwardTest, NonFiniteValuesBehindHiddenKeysPassNothing) {
  using T = TypeParam;
  Spec s;
  s.batch = 1;
  s.heads = 2;
  s.nq = 9;
  s.nk = 12;
  s.has_mask = true;
  s.mask_full = {{false, false, false, true}};
  s.mask_rate = 0.0;
  auto t = make_problem<T>(s);
  for (Index j : {3, 8}) t->mask(0, 0, 0, j) = true;
  sdpa::kernels::tiled_attention(t->p);
  const Grads<double> want = oracle(*t);
  for (Index h = 0; h < s.heads; ++h)
    for (Index j : {3, 8}) {
      std::fill_n(const_cast<T*>(t->p.k.row(0, h, j)), s.d_k, std::numeric_limits<T>::quiet_NaN());
      std::fill_n(const_cast<T*>(t->p.v.row(0, h, j)), s.d_v, std::numeric_limits<T>::infinity());
    }
  for (const TileConfig& c : {kTiny, TileConfig{}}) {
    SCOPED_TRACE(describe(c));
    const Grads<T> g = run_backward(*t, Kernel::kTiled, nullptr, c);
    expect_close(g, want, tolerance<T>());
    for (T x : g.dq) EXPECT_TRUE(std::isfinite(x));
  }
  expect_close(run_backward(*t, Kernel::kReference), want, tolerance<T>());
}

TYPED_TEST(BackwardTest, EmptyProblems) {
  using T = TypeParam;
  for (const auto& n : {std::array<Index, 2>{{0, 5}}, std::array<Index, 2>{{4, 0}}})
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
      Spec s;
      s.nq = n[0];
      s.nk = n[1];
      s.policy = policy;
      s.has_bias = true;
      s.bias_full = {{true, true, true, false}};
      auto t = make_problem<T>(s);
      for (const Kernel kernel : {Kernel::kTiled, Kernel::kReference}) {
        const Grads<T> g = run_backward(*t, kernel);
        for (const auto* v : {&g.dq, &g.dk, &g.dv, &g.db})
          for (T x : *v) EXPECT_EQ(x, T(0));
      }
    }
}

// ------------------------------------------------------------------------------------ finite differences

// L = sum(dO o O) by the reference forward, in double.
double loss(TestProblem<double>& t) {
  std::vector<double> out(t.out.size());
  AttentionProblem<double> p = t.p;
  p.out = {out.data(), p.nq * p.heads * p.d_v, p.heads * p.d_v, p.d_v};
  p.lse = nullptr;
  sdpa::kernels::reference_attention(p);
  double sum = 0;
  for (std::size_t i = 0; i < out.size(); ++i) sum += out[i] * t.dout[i];
  return sum;
}

// Central differences of L with respect to every element the gradients cover.
Grads<double> finite_differences(TestProblem<double>& t) {
  const double step = 1e-5;
  auto diff = [&](double* x) {
    const double x0 = *x;
    *x = x0 + step;
    const double up = loss(t);
    *x = x0 - step;
    const double down = loss(t);
    *x = x0;
    return (up - down) / (2 * step);
  };
  const AttentionProblem<double>& p = t.p;
  auto heads = [&](const Heads<const double>& x, Index n, Index d) {
    std::vector<double> g;
    for (Index b = 0; b < p.batch; ++b)
      for (Index i = 0; i < n; ++i)
        for (Index h = 0; h < p.heads; ++h)
          for (Index e = 0; e < d; ++e) g.push_back(diff(const_cast<double*>(x.row(b, h, i)) + e));
    return g;
  };
  Grads<double> g;
  g.dq = heads(p.q, p.nq, p.d_k);
  g.dk = heads(p.k, p.nk, p.d_k);
  g.dv = heads(p.v, p.nk, p.d_v);
  for (Index i = 0; i < t.weights.size(); ++i) g.dw.push_back(diff(t.weights.data() + i));
  for (Index i = 0; i < t.bias.size(); ++i) g.db.push_back(diff(t.bias.data() + i));
  return g;
}

void check_finite_differences(const Spec& s) {
  SCOPED_TRACE(describe(s));
  auto t = make_problem<double>(s);
  const Grads<double> fd = finite_differences(*t);
  for (const TileConfig& c : {kTiny, TileConfig{3, 5, 2}, TileConfig{}}) {
    SCOPED_TRACE(describe(c));
    expect_close(run_backward(*t, Kernel::kTiled, nullptr, c), fd, 1e-7);
  }
  expect_close(run_backward(*t, Kernel::kReference), fd, 1e-7);
}

TEST(BackwardFiniteDifferences, EveryOption) {
  std::uint32_t seed = 800;
  for (int variant = 0; variant < 11; ++variant) {
    Spec s;
    s.batch = 2;
    s.heads = 2;
    s.nq = variant == 3 ? 9 : 6;
    s.nk = variant == 3 ? 5 : 8;
    s.d_k = 3;
    s.d_v = 2;
    s.seed = seed++;
    switch (variant) {
      case 0: break;
      case 1:
        s.has_mask = true;
        s.mask_full = {{true, false, true, true}};
        s.fully_masked_rate = 0.2;  // kZero: such rows pass nothing
        break;
      case 2:
        s.has_weights = true;
        s.weights_full = {{false, true, true, false}};
        s.has_bias = true;
        s.bias_full = {{true, false, false, true}};
        break;
      case 3:
        s.causal = true;  // nq > nk
        break;
      case 4:
        s.causal = true;
        s.window_left = 2;
        break;
      case 5:
        s.window_left = 1;
        s.window_right = 2;
        break;
      case 6:
        s.key_lengths = {3, 0};
        break;
      case 7:
        s.alibi = true;
        s.has_bias = true;
        break;
      case 8:
        s.dropout = 0.3;  // the mask is fixed: the sampler draws the same one for every evaluation
        break;
      case 9:
        s.dropout = 0.4;
        s.has_weights = true;
        s.has_mask = true;
        s.causal = true;
        break;
      case 10:
        s.heads = 1;
        s.d_k = 5;
        s.d_v = 1;
        s.has_weights = true;
        s.weights_full = {{false, false, false, false}};
        s.has_bias = true;
        s.bias_full = {{false, false, false, false}};
        break;
    }
    check_finite_differences(s);
  }
}

// ------------------------------------------------------------------------------------------ determinism

TYPED_TEST(BackwardTest, SameBitsOnOneAndTwoThreadsAndInRepeatedCalls) {
  using T = TypeParam;
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  std::uint32_t seed = 900;
  for (int variant = 0; variant < 4; ++variant) {
    Spec s;
    s.batch = 3;
    s.heads = 4;
    s.nq = 37;
    s.nk = 45;
    s.d_k = 8;
    s.d_v = 8;
    s.seed = seed++;
    s.has_mask = variant != 0;
    s.fully_masked_rate = 0.1;
    s.policy = variant == 2 ? MaskedRows::kNaN : MaskedRows::kZero;
    s.dropout = variant == 3 ? 0.25 : 0.0;
    // Broadcast gradients: over batch (units of one head), over heads (units of one batch entry), both.
    s.has_weights = variant >= 1;
    s.weights_full = {{false, true, true, true}};
    s.has_bias = variant >= 2;
    s.bias_full = variant == 2 ? std::array<bool, 4>{{true, false, true, false}} : std::array<bool, 4>{{false, false, true, true}};
    SCOPED_TRACE(describe(s));
    auto t = make_problem<T>(s);
    for (const TileConfig& c : {kTiny, kTinyGroups, TileConfig{}}) {
      SCOPED_TRACE(describe(c));
      const Grads<T> one = run_backward(*t, Kernel::kTiled, nullptr, c);
      const std::vector<T> one_raw = t->grads;
      for (int repeat = 0; repeat < 3; ++repeat) {
        run_backward(*t, Kernel::kTiled, repeat == 0 ? nullptr : &device, c);
        EXPECT_TRUE(same_bits(one_raw, t->grads)) << "repeat " << repeat;
        EXPECT_TRUE(same_bits(one.dw, t->d_weights)) << "repeat " << repeat;
        EXPECT_TRUE(same_bits(one.db, t->d_bias)) << "repeat " << repeat;
      }
    }
    // The reference kernel on two threads too.
    const Grads<T> ref = run_backward(*t, Kernel::kReference);
    const Grads<T> ref2 = run_backward(*t, Kernel::kReference, &device);
    EXPECT_TRUE(same_bits(ref.dq, ref2.dq));
    EXPECT_TRUE(same_bits(ref.dk, ref2.dk));
    EXPECT_TRUE(same_bits(ref.dw, ref2.dw));
    expect_close(run_backward(*t, Kernel::kTiled, &device), oracle(*t), tolerance<T>());
  }
}

TYPED_TEST(BackwardTest, ReferenceAndTiledKernelsAgree) {
  using T = TypeParam;
  Spec s;
  s.batch = 2;
  s.heads = 3;
  s.nq = 40;
  s.nk = 52;
  s.d_k = 16;
  s.d_v = 12;
  s.has_mask = true;
  s.has_weights = true;
  s.has_bias = true;
  s.bias_full = {{false, true, true, true}};
  s.causal = true;
  s.window_left = 20;
  s.alibi = true;
  s.dropout = 0.2;
  s.seed = 1000;
  auto t = make_problem<T>(s);
  const Grads<T> ref = run_backward(*t, Kernel::kReference);
  for (const TileConfig& c : {kTiny, TileConfig{16, 16, 2}, TileConfig{}}) {
    SCOPED_TRACE(describe(c));
    expect_close(run_backward(*t, Kernel::kTiled, nullptr, c), ref, std::is_same<T, float>::value ? 1e-4 : 1e-11);
  }
}

// ------------------------------------------------------------------------------------------------ memory

// O(N) memory: a long sequence allocates scratch per worker, never anything of nq * nk size.
TEST(BackwardMemory, LongSequenceAllocatesNoScoreMatrix) {
  Spec s;
  s.batch = 1;
  s.heads = 1;
  s.nq = 4096;
  s.nk = 4096;
  s.d_k = 4;
  s.d_v = 4;
  s.key_lengths = {s.nk - 5};
  auto t = make_problem<float>(s);
  std::size_t largest = 0;
  {
    sdpa_test::alloc::Scope allocations;  // operator new and the library's aligned_alloc
    sdpa::kernels::tiled_backward(t->bp);
    largest = allocations.largest();
  }
  const std::size_t scores = static_cast<std::size_t>(s.nq) * static_cast<std::size_t>(s.nk) * sizeof(float);
  EXPECT_LT(largest, scores / 64) << "largest allocation " << largest;
  for (float x : t->grads) ASSERT_TRUE(std::isfinite(x));
}

}  // namespace backward_test
