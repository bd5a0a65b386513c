// The kernel tests' one problem builder: a Spec says what a test problem looks like (shape, layout, the
// options that reach the kernels), make_problem turns it into buffers and a kernels::AttentionProblem over
// them, and, with Spec::backward, into the forward's output and log-sum-exp, a random dL/dO and a
// kernels::BackwardProblem. Shared by tiled_test.cpp, backward_test.cpp and decode_test.cpp. Values are
// drawn from the seed in a fixed order (q, k, v; mask; weights; bias; ALiBi slopes; dL/dO), so a spec always
// gives the same problem.
#pragma once

#include "sdpa/kernels/backward.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/tiled.hpp"
#include "sdpa/mask.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace sdpa_test {

struct Spec {
  using Index = Eigen::Index;
  Index batch = 2, heads = 2, nq = 5, nk = 7, d_k = 8, d_v = 6;
  Index kv_heads = 0;  // key/value heads (grouped-query attention); 0: heads
  // q, k and v in one (batch, n, ...) buffer per row, as a fused QKV projection leaves them (needs nq == nk),
  // and the gradients likewise; otherwise three buffers whose rows carry `pad` (gradients: grad_pad) unused
  // elements.
  bool fused = false;
  Index pad = 0;
  Index grad_pad = 0;
  bool has_mask = false;
  std::array<bool, 4> mask_full{{true, true, true, true}};  // false: that dimension is 1 (broadcast)
  double mask_rate = 0.3;
  double fully_masked_rate = 0.0;  // share of mask rows whose every key is masked
  bool has_weights = false;
  std::array<bool, 4> weights_full{{true, true, true, true}};
  bool has_bias = false;
  std::array<bool, 4> bias_full{{true, true, true, true}};
  bool causal = false;
  Index window_left = -1, window_right = -1;
  std::vector<Index> key_lengths;  // empty or one per batch entry
  bool alibi = false;
  sdpa::MaskedRows policy = sdpa::MaskedRows::kZero;
  double dropout = 0.0;
  double q_magnitude = 1.0;
  bool integer_values = false;  // q, k in small integers and weights 1, so that logits are exact
  bool backward = false;        // also the forward's output, a dL/dO and the backward problem
  std::uint32_t seed = 1;

  Index key_heads() const { return kv_heads > 0 ? kv_heads : heads; }
};

inline std::string describe(const Spec& s) {
  const auto flags = [](const std::array<bool, 4>& f) {
    return std::to_string(f[0]) + std::to_string(f[1]) + std::to_string(f[2]) + std::to_string(f[3]);
  };
  std::string d = "batch " + std::to_string(s.batch) + " heads " + std::to_string(s.heads) + " nq " +
                  std::to_string(s.nq) + " nk " + std::to_string(s.nk) + " d_k " + std::to_string(s.d_k) + " d_v " +
                  std::to_string(s.d_v) + " seed " + std::to_string(s.seed);
  if (s.key_heads() != s.heads) d += " kv_heads " + std::to_string(s.key_heads());
  if (s.fused) d += " fused";
  if (s.pad || s.grad_pad) d += " padded";
  if (s.has_mask) d += " mask " + flags(s.mask_full);
  if (s.has_weights) d += " weights " + flags(s.weights_full);
  if (s.has_bias) d += " bias " + flags(s.bias_full);
  if (s.causal) d += " causal";
  if (s.window_left >= 0) d += " window_left " + std::to_string(s.window_left);
  if (s.window_right >= 0) d += " window_right " + std::to_string(s.window_right);
  if (!s.key_lengths.empty()) d += " key_lengths";
  if (s.alibi) d += " alibi";
  if (s.policy == sdpa::MaskedRows::kNaN) d += " kNaN";
  if (s.dropout > 0) d += " dropout " + std::to_string(s.dropout);
  return d;
}

template <typename T>
struct TestProblem {
  using Index = Eigen::Index;
  Spec spec;
  std::vector<T> qkv;             // q, k, v storage (fused or three regions one after another)
  std::vector<T> out, lse, dout;  // backward: the forward's O and log-sum-exp, and dL/dO
  std::vector<T> grads;           // backward: dq, dk, dv storage (padding included)
  std::vector<T> d_weights, d_bias;
  sdpa::Mask mask;
  Eigen::Tensor<T, 4, Eigen::RowMajor> weights, bias;
  std::vector<T> alibi;
  std::vector<Index> key_lengths;
  std::array<Index, 4> weights_dims{}, bias_dims{};
  sdpa::kernels::AttentionProblem<T> p;
  sdpa::kernels::BackwardProblem<T> bp;

  Index out_size() const { return p.batch * p.nq * p.heads * p.d_v; }
};

inline std::array<Eigen::Index, 4> dims_of(const std::array<bool, 4>& full, const std::array<Eigen::Index, 4>& sizes) {
  std::array<Eigen::Index, 4> d{};
  for (std::size_t i = 0; i < 4; ++i) d[i] = full[i] ? sizes[i] : 1;
  return d;
}

template <typename T>
std::unique_ptr<TestProblem<T>> make_problem(const Spec& s) {
  using Index = Eigen::Index;
  auto t = std::make_unique<TestProblem<T>>();
  t->spec = s;
  std::mt19937 gen(s.seed);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  std::uniform_int_distribution<int> integer(-100, 100);
  std::bernoulli_distribution masked(s.mask_rate), fully(s.fully_masked_rate);

  sdpa::kernels::AttentionProblem<T>& p = t->p;
  sdpa::kernels::BackwardProblem<T>& bp = t->bp;
  const Index kvh = s.key_heads();
  p.batch = s.batch;
  p.heads = s.heads;
  p.kv_group = s.heads / kvh;
  p.nq = s.nq;
  p.nk = s.nk;
  p.d_k = s.d_k;
  p.d_v = s.d_v;
  p.scale = T(1) / std::sqrt(T(s.d_k));
  if (s.fused) {
    const Index n = s.nq, row = s.heads * s.d_k + kvh * (s.d_k + s.d_v);
    t->qkv.resize(static_cast<std::size_t>(s.batch * n * row));
    p.q = {t->qkv.data(), n * row, row, s.d_k};
    p.k = {t->qkv.data() + s.heads * s.d_k, n * row, row, s.d_k};
    p.v = {t->qkv.data() + s.heads * s.d_k + kvh * s.d_k, n * row, row, s.d_v};
    if (s.backward) {
      t->grads.resize(t->qkv.size());
      bp.d_q = {t->grads.data(), n * row, row, s.d_k};
      bp.d_k = {t->grads.data() + s.heads * s.d_k, n * row, row, s.d_k};
      bp.d_v = {t->grads.data() + s.heads * s.d_k + kvh * s.d_k, n * row, row, s.d_v};
    }
  } else {
    const auto layout = [&](Index pad, std::vector<T>& buf, auto& q, auto& k, auto& v) {
      const Index rq = s.heads * s.d_k + pad, rk = kvh * s.d_k + pad, rv = kvh * s.d_v + pad;
      const Index nq_size = s.batch * s.nq * rq, nk_size = s.batch * s.nk * rk, nv_size = s.batch * s.nk * rv;
      buf.resize(static_cast<std::size_t>(nq_size + nk_size + nv_size + 1));
      T* base = buf.data();
      q = {base, s.nq * rq, rq, s.d_k};
      k = {base + nq_size, s.nk * rk, rk, s.d_k};
      v = {base + nq_size + nk_size, s.nk * rv, rv, s.d_v};
    };
    layout(s.pad, t->qkv, p.q, p.k, p.v);
    if (s.backward) layout(s.grad_pad, t->grads, bp.d_q, bp.d_k, bp.d_v);
  }
  // Every element, padding too: it must never matter.
  for (T& x : t->qkv) x = s.integer_values ? T(integer(gen)) : T(uniform(gen));
  if (s.q_magnitude != 1.0)
    for (Index b = 0; b < s.batch; ++b)
      for (Index i = 0; i < s.nq; ++i)
        for (Index h = 0; h < s.heads; ++h) {
          T* q = const_cast<T*>(p.q.row(b, h, i));
          for (Index d = 0; d < s.d_k; ++d) q[d] *= T(s.q_magnitude);
        }

  const std::array<Index, 4> full{{s.batch, s.heads, s.nq, s.nk}};
  if (s.has_mask) {
    const std::array<Index, 4> dims = dims_of(s.mask_full, full);
    t->mask.resize(dims);
    for (Index b = 0; b < dims[0]; ++b)
      for (Index h = 0; h < dims[1]; ++h)
        for (Index i = 0; i < dims[2]; ++i) {
          const bool all = fully(gen);
          for (Index j = 0; j < dims[3]; ++j) t->mask(b, h, i, j) = all || masked(gen);
        }
    p.mask = sdpa::make_broadcast_view<bool>(&t->mask, full, "sdpa_test", "mask");
  }
  if (s.has_weights) {
    t->weights_dims = dims_of(s.weights_full, full);
    t->weights.resize(t->weights_dims);
    std::uniform_real_distribution<double> w(0.25, 2.0);
    for (Index i = 0; i < t->weights.size(); ++i) t->weights.data()[i] = s.integer_values ? T(1) : T(w(gen));
    p.weights = sdpa::make_broadcast_view<T>(&t->weights, full, "sdpa_test", "weights");
    if (s.backward) {
      t->d_weights.resize(static_cast<std::size_t>(t->weights.size()));
      bp.d_weights = t->d_weights.data();
      bp.weights_dims = t->weights_dims;
    }
  }
  if (s.has_bias) {
    t->bias_dims = dims_of(s.bias_full, full);
    t->bias.resize(t->bias_dims);
    std::uniform_real_distribution<double> w(-2.0, 2.0);
    for (Index i = 0; i < t->bias.size(); ++i) t->bias.data()[i] = T(w(gen));
    p.bias = sdpa::make_broadcast_view<T>(&t->bias, full, "sdpa_test", "bias");
    if (s.backward) {
      t->d_bias.resize(static_cast<std::size_t>(t->bias.size()));
      bp.d_bias = t->d_bias.data();
      bp.bias_dims = t->bias_dims;
    }
  }
  if (s.alibi) {
    std::uniform_real_distribution<double> slope(0.05, 0.8);
    for (Index h = 0; h < s.heads; ++h) t->alibi.push_back(T(slope(gen)));
    p.alibi = t->alibi.data();
  }
  t->key_lengths = s.key_lengths;
  p.key_lengths = t->key_lengths.empty() ? nullptr : t->key_lengths.data();
  p.causal = s.causal;
  p.window_left = s.window_left;
  p.window_right = s.window_right;
  p.query_offset = s.nk - s.nq;
  p.masked_rows = s.policy;
  if (s.dropout > 0.0) {
    p.dropout = true;
    p.sampler = sdpa::DropoutSampler(s.seed * 7919u + 13u, 3, s.dropout);
    p.keep_scale = s.dropout >= 1.0 ? T(0) : T(1.0 / (1.0 - s.dropout));
  }
  if (!s.backward) return t;

  // The forward as it ran before the backward: O and the rows' log-sum-exp; then a random dL/dO.
  t->out.assign(static_cast<std::size_t>(s.batch * s.nq * s.heads * s.d_v), T(0));
  t->lse.assign(static_cast<std::size_t>(s.batch * s.heads * s.nq), T(0));
  p.out = {t->out.data(), s.nq * s.heads * s.d_v, s.heads * s.d_v, s.d_v};
  p.lse = t->lse.data();
  sdpa::kernels::tiled_attention(p);
  t->dout.resize(t->out.size());
  for (T& x : t->dout) x = T(uniform(gen));
  bp.forward = &t->p;
  bp.d_out = {t->dout.data(), s.nq * s.heads * s.d_v, s.heads * s.d_v, s.d_v};
  return t;
}

}  // namespace sdpa_test
