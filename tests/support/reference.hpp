// A plain, independent double-precision implementation of External-Attention-pytorch's
// ScaledDotProductAttention forward, written from the module's semantics with loops only. It never calls
// sdpa's kernels, Linear or mask helpers: it reads the module's parameters through fc_q().weight() and
// friends, converts everything to double, and recomputes
//
//     q = queries W_q^T + b_q, k = keys W_k^T + b_k, v = values W_v^T + b_v      (feature = head * d + i)
//     att = q k^T / sqrt(d_k)  [* attention_weights]  [masked (true) -> -inf]
//     att = softmax over keys  [* dropout factor]
//     out = (att v, heads merged head-major) W_o^T + b_o
//
// Fully masked rows give a zero attention output (MaskedRows::kZero) or NaN (kNaN); nk == 0 gives a zero
// attention output. Masks and weights broadcast: each dimension is 1 or full.
//
// The core is non-template (double vectors) so that it compiles once per test file.
#pragma once

#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace sdpa_test {

using Index = std::int64_t;

// A dense row-major rank-3 array of doubles.
struct Array3 {
  std::array<Index, 3> dims{0, 0, 0};
  std::vector<double> v;

  Array3() = default;
  Array3(Index d0, Index d1, Index d2, double fill = 0.0)
      : dims{d0, d1, d2}, v(static_cast<std::size_t>(d0 * d1 * d2), fill) {}
  double& operator()(Index i, Index j, Index k) { return v[static_cast<std::size_t>((i * dims[1] + j) * dims[2] + k)]; }
  double operator()(Index i, Index j, Index k) const {
    return v[static_cast<std::size_t>((i * dims[1] + j) * dims[2] + k)];
  }
  Index size() const { return dims[0] * dims[1] * dims[2]; }
};

// A dense row-major rank-4 array of doubles, read with broadcasting (a dimension of 1 repeats).
struct Array4 {
  std::array<Index, 4> dims{0, 0, 0, 0};
  std::vector<double> v;

  double at(Index b, Index h, Index q, Index k) const {
    const Index i[4] = {dims[0] == 1 ? 0 : b, dims[1] == 1 ? 0 : h, dims[2] == 1 ? 0 : q, dims[3] == 1 ? 0 : k};
    return v[static_cast<std::size_t>(((i[0] * dims[1] + i[1]) * dims[2] + i[2]) * dims[3] + i[3])];
  }
};

// One linear layer: w is (out, in) row-major, as PyTorch stores it.
struct LinearParams {
  Index in = 0, out = 0;
  std::vector<double> w, b;
};

struct ModuleParams {
  Index d_model = 0, d_k = 0, d_v = 0, h = 0;
  LinearParams q, k, v, o;
};

// Reads a Linear's parameters element by element (no assumption on storage order beyond operator()).
template <typename LinearT>
LinearParams linear_params_of(const LinearT& layer) {
  LinearParams p;
  const auto& w = layer.weight();
  const auto& b = layer.bias();
  p.out = static_cast<Index>(w.dimension(0));
  p.in = static_cast<Index>(w.dimension(1));
  if (static_cast<Index>(b.dimension(0)) != p.out) throw std::logic_error("reference: bias size != out features");
  for (Index o = 0; o < p.out; ++o)
    for (Index i = 0; i < p.in; ++i) p.w.push_back(static_cast<double>(w(o, i)));
  for (Index o = 0; o < p.out; ++o) p.b.push_back(static_cast<double>(b(o)));
  return p;
}

template <typename Module>
ModuleParams params_of(const Module& m) {
  ModuleParams p;
  p.d_model = m.d_model();
  p.d_k = m.d_k();
  p.d_v = m.d_v();
  p.h = m.h();
  p.q = linear_params_of(m.fc_q());
  p.k = linear_params_of(m.fc_k());
  p.v = linear_params_of(m.fc_v());
  p.o = linear_params_of(m.fc_o());
  return p;
}

// Any rank-3 Eigen tensor or map -> Array3 (element access only).
template <typename T>
Array3 to_array3(const T& t) {
  Array3 a(t.dimension(0), t.dimension(1), t.dimension(2));
  for (Index i = 0; i < a.dims[0]; ++i)
    for (Index j = 0; j < a.dims[1]; ++j)
      for (Index k = 0; k < a.dims[2]; ++k) a(i, j, k) = static_cast<double>(t(i, j, k));
  return a;
}

// Any rank-4 Eigen tensor (bool or floating) -> Array4.
template <typename T>
Array4 to_array4(const T& t) {
  Array4 a;
  for (int i = 0; i < 4; ++i) a.dims[static_cast<std::size_t>(i)] = t.dimension(i);
  for (Index b = 0; b < a.dims[0]; ++b)
    for (Index h = 0; h < a.dims[1]; ++h)
      for (Index q = 0; q < a.dims[2]; ++q)
        for (Index k = 0; k < a.dims[3]; ++k) a.v.push_back(static_cast<double>(t(b, h, q, k)));
  return a;
}

// y[r, o] = sum_i x[r, i] w[o, i] + b[o] over rows of a row-major matrix (rows x in).
inline std::vector<double> reference_linear_rows(const LinearParams& p, const std::vector<double>& x, Index rows) {
  std::vector<double> y(static_cast<std::size_t>(rows * p.out));
  for (Index r = 0; r < rows; ++r)
    for (Index o = 0; o < p.out; ++o) {
      double s = p.b[static_cast<std::size_t>(o)];
      for (Index i = 0; i < p.in; ++i)
        s += x[static_cast<std::size_t>(r * p.in + i)] * p.w[static_cast<std::size_t>(o * p.in + i)];
      y[static_cast<std::size_t>(r * p.out + o)] = s;
    }
  return y;
}

// Multiplies the softmax probability of (batch, head, query, key); e.g. 0 or 1 / (1 - p) for dropout.
using DropoutFactor = std::function<double(Index b, Index h, Index q, Index k)>;

// Everything that masks, modifies or hides the scores, by the definitions of sdpa::AttentionOptions, with
// q' = q + (NK - NQ): s = q.k / sqrt(d_k); s *= weights; s += bias; s -= alibi[h] * |q' - k|; hidden (mask
// true, causal k > q', window_left k < q' - wl, window_right k > q' + wr, k >= key_lengths[b]) -> -inf.
struct ReferenceOptions {
  const Array4* mask = nullptr;  // 1.0 = masked (true)
  const Array4* weights = nullptr;
  const Array4* bias = nullptr;
  bool causal = false;
  Index window_left = -1, window_right = -1;
  std::vector<Index> key_lengths;
  std::vector<double> alibi;
  bool nan_rows = false;  // the kNaN policy
  const DropoutFactor* dropout = nullptr;
  std::vector<double>* probabilities = nullptr;  // when set: (B, H, NQ, NK), the softmax before dropout
};

inline Array3 reference_forward(const ModuleParams& p, const Array3& queries, const Array3& keys,
                                const Array3& values, const ReferenceOptions& o);

// The whole forward in double. mask: 1.0 = masked (true). nan_rows: the kNaN policy.
inline Array3 reference_forward(const ModuleParams& p, const Array3& queries, const Array3& keys,
                                const Array3& values, const Array4* mask = nullptr, const Array4* weights = nullptr,
                                bool nan_rows = false, const DropoutFactor* dropout = nullptr) {
  ReferenceOptions o;
  o.mask = mask;
  o.weights = weights;
  o.nan_rows = nan_rows;
  o.dropout = dropout;
  return reference_forward(p, queries, keys, values, o);
}

inline Array3 reference_forward(const ModuleParams& p, const Array3& queries, const Array3& keys,
                                const Array3& values, const ReferenceOptions& o) {
  const Array4* mask = o.mask;
  const Array4* weights = o.weights;
  const bool nan_rows = o.nan_rows;
  const DropoutFactor* dropout = o.dropout;
  const Index B = queries.dims[0], NQ = queries.dims[1], NK = keys.dims[1], D = p.d_model, H = p.h;
  const Index DK = p.d_k, DV = p.d_v;
  if (queries.dims[2] != D || keys.dims[2] != D || values.dims[2] != D || keys.dims[0] != B ||
      values.dims[0] != B || values.dims[1] != NK)
    throw std::logic_error("reference_forward: inconsistent shapes");
  const std::vector<double> q = reference_linear_rows(p.q, queries.v, B * NQ);  // (B*NQ, H*DK)
  const std::vector<double> k = reference_linear_rows(p.k, keys.v, B * NK);     // (B*NK, H*DK)
  const std::vector<double> v = reference_linear_rows(p.v, values.v, B * NK);   // (B*NK, H*DV)
  std::vector<double> att(static_cast<std::size_t>(B * NQ * H * DV), 0.0);      // (B*NQ, H*DV)
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> s(static_cast<std::size_t>(NK));
  std::vector<bool> hidden(static_cast<std::size_t>(NK));
  if (o.probabilities) o.probabilities->assign(static_cast<std::size_t>(B * H * NQ * NK), 0.0);
  auto is_hidden = [&](Index b, Index h, Index i, Index j) {
    const Index pos = i + (NK - NQ);
    if (mask && mask->at(b, h, i, j) != 0.0) return true;
    if (o.causal && j > pos) return true;
    if (o.window_left >= 0 && j < pos - o.window_left) return true;
    if (o.window_right >= 0 && j > pos + o.window_right) return true;
    if (!o.key_lengths.empty() && j >= o.key_lengths[static_cast<std::size_t>(b)]) return true;
    return false;
  };
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < NQ; ++i) {
        const std::size_t qrow = static_cast<std::size_t>((b * NQ + i) * H * DK + h * DK);
        for (Index j = 0; j < NK; ++j) {
          const std::size_t krow = static_cast<std::size_t>((b * NK + j) * H * DK + h * DK);
          double dot = 0.0;
          for (Index d = 0; d < DK; ++d) dot += q[qrow + static_cast<std::size_t>(d)] * k[krow + static_cast<std::size_t>(d)];
          double x = dot / std::sqrt(static_cast<double>(DK));
          if (weights) x *= weights->at(b, h, i, j);
          if (o.bias) x += o.bias->at(b, h, i, j);
          if (!o.alibi.empty())
            x -= o.alibi[static_cast<std::size_t>(h)] * std::abs(static_cast<double>(i + (NK - NQ) - j));
          hidden[static_cast<std::size_t>(j)] = is_hidden(b, h, i, j);
          if (hidden[static_cast<std::size_t>(j)]) x = -inf;
          s[static_cast<std::size_t>(j)] = x;
        }
        double* out = &att[static_cast<std::size_t>((b * NQ + i) * H * DV + h * DV)];
        if (NK == 0) continue;
        // Only a row whose every key is hidden gets the masked-row policy; a NaN score makes the row NaN
        // and visible scores that are all -inf give exp(-inf + inf) = NaN, as PyTorch's softmax does.
        bool any_visible = false;
        double mx = -inf;
        for (Index j = 0; j < NK; ++j) {
          if (hidden[static_cast<std::size_t>(j)]) continue;
          any_visible = true;
          const double x = s[static_cast<std::size_t>(j)];
          if (std::isnan(x) || std::isnan(mx)) mx = std::numeric_limits<double>::quiet_NaN();
          else mx = std::max(mx, x);
        }
        double* prob_row = o.probabilities ? &(*o.probabilities)[static_cast<std::size_t>(((b * H + h) * NQ + i) * NK)] : nullptr;
        if (!any_visible) {
          if (nan_rows)
            for (Index d = 0; d < DV; ++d) out[d] = std::numeric_limits<double>::quiet_NaN();
          if (prob_row && nan_rows) std::fill(prob_row, prob_row + NK, std::numeric_limits<double>::quiet_NaN());
          continue;
        }
        double sum = 0.0;
        for (Index j = 0; j < NK; ++j)
          if (!hidden[static_cast<std::size_t>(j)]) sum += std::exp(s[static_cast<std::size_t>(j)] - mx);
        for (Index j = 0; j < NK; ++j) {
          // A hidden key contributes nothing, not even a NaN in its value row (sdpa's one intended
          // difference from PyTorch, where 0 * NaN reaches the output).
          if (hidden[static_cast<std::size_t>(j)]) continue;
          double prob = std::exp(s[static_cast<std::size_t>(j)] - mx) / sum;
          if (prob_row) prob_row[j] = prob;
          if (dropout) prob *= (*dropout)(b, h, i, j);
          const std::size_t vrow = static_cast<std::size_t>((b * NK + j) * H * DV + h * DV);
          for (Index d = 0; d < DV; ++d) out[d] += prob * v[vrow + static_cast<std::size_t>(d)];
        }
      }
  Array3 result(B, NQ, D);
  result.v = reference_linear_rows(p.o, att, B * NQ);
  return result;
}

// Convenience: straight from a module and Eigen tensors (mask: bool rank-4, weights: floating rank-4).
template <typename Module, typename Q, typename K, typename V, typename MaskT = Eigen::Tensor<bool, 4, Eigen::RowMajor>,
          typename WeightsT = Eigen::Tensor<double, 4, Eigen::RowMajor>>
Array3 reference_forward(const Module& m, const Q& queries, const K& keys, const V& values,
                         const MaskT* mask = nullptr, const WeightsT* weights = nullptr, bool nan_rows = false,
                         const DropoutFactor* dropout = nullptr) {
  Array4 mask4, weights4;
  if (mask) mask4 = to_array4(*mask);
  if (weights) weights4 = to_array4(*weights);
  return reference_forward(params_of(m), to_array3(queries), to_array3(keys), to_array3(values),
                           mask ? &mask4 : nullptr, weights ? &weights4 : nullptr, nan_rows, dropout);
}

// From a module, Eigen tensors and an sdpa::AttentionOptions (its mask, weights, bias, causal, windows,
// key lengths and ALiBi slopes are read; the rest is ignored).
template <typename Module, typename Q, typename K, typename V, typename Options>
Array3 reference_forward_with(const Module& m, const Q& queries, const K& keys, const V& values, const Options& opts,
                              std::vector<double>* probabilities = nullptr, const DropoutFactor* dropout = nullptr) {
  Array4 mask4, weights4, bias4;
  ReferenceOptions o;
  if (opts.attention_mask) {
    mask4 = to_array4(*opts.attention_mask);
    o.mask = &mask4;
  }
  if (opts.attention_weights) {
    weights4 = to_array4(*opts.attention_weights);
    o.weights = &weights4;
  }
  if (opts.attention_bias) {
    bias4 = to_array4(*opts.attention_bias);
    o.bias = &bias4;
  }
  o.causal = opts.causal;
  o.window_left = static_cast<Index>(opts.window_left);
  o.window_right = static_cast<Index>(opts.window_right);
  for (auto l : opts.key_lengths) o.key_lengths.push_back(static_cast<Index>(l));
  for (auto a : opts.alibi_slopes) o.alibi.push_back(static_cast<double>(a));
  o.nan_rows = m.masked_rows() == decltype(m.masked_rows())::kNaN;
  o.dropout = dropout;
  o.probabilities = probabilities;
  return reference_forward(params_of(m), to_array3(queries), to_array3(keys), to_array3(values), o);
}

// max |a - r| / max(max |r|, floor), NaN in the same places required (else +inf). Shapes must match.
template <typename T>
double max_relative_error(const T& actual, const Array3& ref, double floor = 1e-30) {
  for (int i = 0; i < 3; ++i)
    if (static_cast<Index>(actual.dimension(i)) != ref.dims[static_cast<std::size_t>(i)])
      return std::numeric_limits<double>::infinity();
  double max_ref = 0.0, max_err = 0.0;
  for (Index i = 0; i < ref.dims[0]; ++i)
    for (Index j = 0; j < ref.dims[1]; ++j)
      for (Index k = 0; k < ref.dims[2]; ++k) {
        const double a = static_cast<double>(actual(i, j, k)), r = ref(i, j, k);
        if (std::isnan(r) != std::isnan(a)) return std::numeric_limits<double>::infinity();
        if (std::isnan(r)) continue;
        if (!std::isfinite(a)) return std::numeric_limits<double>::infinity();
        max_ref = std::max(max_ref, std::abs(r));
        max_err = std::max(max_err, std::abs(a - r));
      }
  return max_err / std::max(max_ref, floor);
}

// Deterministic random numbers for the tests.
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(std::uint64_t seed) : gen(seed) {}
  double normal(double stddev = 1.0) { return std::normal_distribution<double>(0.0, stddev)(gen); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen); }
  bool bernoulli(double p) { return std::bernoulli_distribution(p)(gen); }

  template <typename TensorT>
  void fill_normal(TensorT& t, double stddev = 1.0) {
    using S = std::remove_reference_t<decltype(*t.data())>;
    for (Index i = 0; i < static_cast<Index>(t.size()); ++i) t.data()[i] = static_cast<S>(normal(stddev));
  }
};

// Every parameter of the module ~ N(0, stddev), so that attention is far from uniform.
template <typename Module>
void randomize_module(Module& m, Rng& rng, double stddev = 0.3) {
  for (auto* layer : {&m.fc_q(), &m.fc_k(), &m.fc_v(), &m.fc_o()}) {
    rng.fill_normal(layer->weight(), stddev);
    rng.fill_normal(layer->bias(), stddev);
  }
}

}  // namespace sdpa_test

// ---- GoogleTest helpers shared by the test files ----
#include <gtest/gtest.h>

#include <cstring>
#include <sstream>
#include <typeinfo>

namespace sdpa_test {

// The bits of a float, for tests that expect the same bits.
inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Results computed in another order: the same NaN positions, equal infinities, elsewhere |got - want| <=
// tol (1 + |want|), element by element over n (the first one off named, after `what`).
template <typename G, typename W>
::testing::AssertionResult close_elements(const G* got, const W* want, std::size_t n, double tol,
                                          const char* what = "element") {
  for (std::size_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    if (std::isnan(g) != std::isnan(w) || (std::isinf(w) && g != w) ||
        (std::isfinite(w) && !(std::fabs(g - w) <= tol * (1 + std::fabs(w)))))
      return ::testing::AssertionFailure() << what << " " << i << ": " << g << " against " << w;
  }
  return ::testing::AssertionSuccess();
}

// Runs f and expects std::invalid_argument whose message contains every phrase.
inline void expect_invalid(const std::function<void()>& f, const std::vector<std::string>& phrases) {
  std::ostringstream wanted;
  for (const auto& p : phrases) wanted << " [" << p << "]";
  try {
    f();
    ADD_FAILURE() << "no exception thrown; expected std::invalid_argument containing" << wanted.str();
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    for (const auto& p : phrases)
      EXPECT_NE(msg.find(p), std::string::npos) << "message \"" << msg << "\" lacks \"" << p << "\"";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected std::invalid_argument containing" << wanted.str() << ", got another exception ("
                  << typeid(e).name() << "): " << e.what();
  } catch (...) {
    ADD_FAILURE() << "expected std::invalid_argument containing" << wanted.str() << ", got a non-std exception";
  }
}

}  // namespace sdpa_test
