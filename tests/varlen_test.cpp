// Tests of packed variable-length sequences (AttentionOptions::cu_seqlens_q / cu_seqlens_k): sdpa::
// attention_varlen and its backward, and the module's forward / backward on (1, total, d_model) inputs,
// float and double:
//   - each sequence gets exactly what sdpa::attention (the module) gives it alone (the same bits), with
//     grouped heads, rotary (positions from 0 in each sequence, queries at nk_s - nq_s + i), causal,
//     windows, ALiBi, softcap, sinks and a scale; empty sequences and sequences without keys included; the
//     sinks' gradient is the sum over the sequences;
//   - with dropout, a packed batch of sequences of one length equals the padded batch (sequence s draws as
//     batch entry s);
//   - 1 and 2 threads give the same bits;
//   - every malformed boundary list and every option without a packed form is refused, naming the field.
#include "sdpa/attention.hpp"
#include "sdpa/kv_cache.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "support/reference.hpp"

namespace varlen_test {

using Index = Eigen::Index;
using sdpa_test::expect_invalid;
using sdpa_test::Rng;

template <typename T>
using T4 = Eigen::Tensor<T, 4, Eigen::RowMajor>;
template <typename T>
using T3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;

template <typename T>
class VarlenTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(VarlenTest, Scalars);

std::vector<Index> bounds(const std::vector<Index>& lengths) {
  std::vector<Index> cu{0};
  for (Index l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

template <typename T>
T3<T> random3(Rng& rng, Index a, Index b, Index c) {
  T3<T> t(a, b, c);
  rng.fill_normal(t);
  return t;
}

// Rows [r0, r0 + n) of a (total, heads, dim) tensor as a (1, n, heads, dim) one.
template <typename T>
T4<T> rows4(const T3<T>& t, Index r0, Index n) {
  T4<T> out(1, n, t.dimension(1), t.dimension(2));
  if (out.size() > 0) std::copy_n(t.data() + r0 * t.dimension(1) * t.dimension(2), out.size(), out.data());
  return out;
}

template <typename T>
void expect_rows_equal(const T3<T>& packed, Index r0, const T4<T>& alone, const char* what, Index s) {
  const Index width = packed.dimension(1) * packed.dimension(2);
  for (Index i = 0; i < alone.size(); ++i)
    ASSERT_EQ(packed.data()[r0 * width + i], alone.data()[i]) << what << ", sequence " << s << ", element " << i;
}

// Every option that applies per sequence: sdpa::attention_varlen against sdpa::attention on each sequence
// alone (the same bits), forward and backward.
TYPED_TEST(VarlenTest, EachSequenceGetsWhatItGetsAlone) {
  using T = TypeParam;
  Rng rng(1);
  const std::vector<Index> lq{5, 0, 17, 3, 40, 2}, lk{9, 4, 17, 0, 40, 7};
  const std::vector<Index> cu_q = bounds(lq), cu_k = bounds(lk);
  const Index h = 4, kv = 2, d_k = 8, d_v = 6;
  const T3<T> q = random3<T>(rng, cu_q.back(), h, d_k), k = random3<T>(rng, cu_k.back(), kv, d_k),
              v = random3<T>(rng, cu_k.back(), kv, d_v), grad = random3<T>(rng, cu_q.back(), h, d_v);
  const sdpa::Rotary rope = sdpa::rope_llama3(6, 10000, 8, 1, 4, 32);
  for (int variant = 0; variant < 4; ++variant) {
    sdpa::AttentionOptions<T> o;
    o.cu_seqlens_q = cu_q;
    o.cu_seqlens_k = cu_k;
    o.causal = variant != 1;
    if (variant == 1) o.window_left = 3, o.window_right = 2;
    if (variant == 2) o.alibi_slopes = sdpa::alibi_slopes<T>(h), o.softcap = T(5), o.scale = T(0.3);
    if (variant >= 2) o.sinks = {T(0.5), T(-1), T(0), T(2)}, o.rotary = &rope;
    if (variant == 3) o.masked_rows = sdpa::MaskedRows::kNaN;
    sdpa::AttentionState<T> state;
    const T3<T> out = sdpa::attention_varlen(q, k, v, o, state);
    ASSERT_EQ(out.dimension(0), cu_q.back());
    const sdpa::VarlenGradients<T> g = sdpa::attention_varlen_backward(grad, state);
    std::vector<T> sinks(o.sinks.size(), T(0));
    for (std::size_t s = 0; s < lq.size(); ++s) {
      sdpa::AttentionOptions<T> one = o;
      one.cu_seqlens_q.clear();
      one.cu_seqlens_k.clear();
      one.layout = sdpa::Layout::kBNHD;
      const Index q0 = cu_q[s], k0 = cu_k[s];
      sdpa::AttentionState<T> alone_state;
      const T4<T> alone = sdpa::attention(rows4(q, q0, lq[s]), rows4(k, k0, lk[s]), rows4(v, k0, lk[s]), one, alone_state);
      expect_rows_equal(out, q0, alone, "output", static_cast<Index>(s));
      if (lq[s] == 0) continue;
      const sdpa::AttentionGradients<T> ga = sdpa::attention_backward(rows4(grad, q0, lq[s]), alone_state);
      expect_rows_equal(g.q, q0, ga.q, "d q", static_cast<Index>(s));
      expect_rows_equal(g.k, k0, ga.k, "d k", static_cast<Index>(s));
      expect_rows_equal(g.v, k0, ga.v, "d v", static_cast<Index>(s));
      for (std::size_t i = 0; i < sinks.size(); ++i) sinks[i] += ga.sinks[i];
    }
    // Keys of a sequence without queries get no gradient.
    for (Index r = cu_k[1]; r < cu_k[2]; ++r)
      for (Index i = 0; i < kv * d_k; ++i) ASSERT_EQ(g.k.data()[r * kv * d_k + i], T(0));
    for (std::size_t i = 0; i < sinks.size(); ++i)
      EXPECT_NEAR(g.sinks[i], sinks[i], (std::is_same<T, float>::value ? 1e-5 : 1e-12) * (1 + std::abs(sinks[i])));
  }
}

// Dropout: a packed batch of sequences of one length draws what the padded batch draws.
TYPED_TEST(VarlenTest, DropoutDrawsAsThePaddedBatch) {
  using T = TypeParam;
  Rng rng(2);
  const Index s = 3, n = 11, h = 2, d = 8;
  const T3<T> q = random3<T>(rng, s * n, h, d), k = random3<T>(rng, s * n, h, d), v = random3<T>(rng, s * n, h, d);
  sdpa::AttentionOptions<T> o;
  o.causal = true;
  o.dropout = T(0.3);
  o.dropout_seed = 77;
  o.layout = sdpa::Layout::kBNHD;
  const auto as4 = [&](const T3<T>& t) {
    T4<T> out(s, n, h, d);
    std::copy_n(t.data(), out.size(), out.data());
    return out;
  };
  const T4<T> padded = sdpa::attention(as4(q), as4(k), as4(v), o);
  o.layout = sdpa::Layout::kBHND;
  o.cu_seqlens_q = o.cu_seqlens_k = bounds({n, n, n});
  const T3<T> packed = sdpa::attention_varlen(q, k, v, o);
  for (Index i = 0; i < packed.size(); ++i) ASSERT_EQ(packed.data()[i], padded.data()[i]) << i;
}

// The module on (1, total, d_model) inputs: each sequence's rows as its own forward gives them, and the
// backward's input and parameter gradients as the sum of the sequences' (inputs: their rows); 1 and 2
// threads the same bits.
TYPED_TEST(VarlenTest, ModuleForwardAndBackward) {
  using T = TypeParam;
  Rng rng(3);
  sdpa::ScaledDotProductAttention<T> m(24, 8, 6, 4, T(0), 2);
  sdpa_test::randomize_module(m, rng, 0.3);
  m.set_rotary(sdpa::Rotary{});
  const std::vector<Index> lengths{7, 1, 0, 33, 12};
  const std::vector<Index> cu = bounds(lengths);
  const T3<T> x = random3<T>(rng, 1, cu.back(), 24), grad = random3<T>(rng, 1, cu.back(), 24);
  sdpa::AttentionOptions<T> o;
  o.causal = true;
  o.window_left = 9;
  o.alibi_slopes = sdpa::alibi_slopes<T>(4);
  o.cu_seqlens_q = o.cu_seqlens_k = cu;
  sdpa::ForwardState<T> state;
  const T3<T> y = m.forward(x, x, x, o, state);
  const sdpa::Gradients<T> g = m.backward(grad, state);
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  sdpa::AttentionOptions<T> threaded = o;
  threaded.device = &device;
  const T3<T> y2 = m.forward(x, x, x, threaded);
  for (Index i = 0; i < y.size(); ++i) ASSERT_EQ(y.data()[i], y2.data()[i]);
  double fc_k_sum = 0, fc_k_packed = 0;
  for (Index i = 0; i < g.fc_k.weight.size(); ++i) fc_k_packed += static_cast<double>(g.fc_k.weight.data()[i]);
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    if (lengths[s] == 0) continue;
    T3<T> xs(1, lengths[s], 24), gs(1, lengths[s], 24);
    std::copy_n(x.data() + cu[s] * 24, xs.size(), xs.data());
    std::copy_n(grad.data() + cu[s] * 24, gs.size(), gs.data());
    sdpa::AttentionOptions<T> one = o;
    one.cu_seqlens_q.clear();
    one.cu_seqlens_k.clear();
    sdpa::ForwardState<T> st;
    const T3<T> ys = m.forward(xs, xs, xs, one, st);
    // The projections over all rows at once round as over one sequence's on the vector paths (the
    // micro-kernels' arithmetic does not depend on the tile); Eigen's products (portable path) may not.
    const double tol = sdpa::active_isa() != sdpa::Isa::kPortable ? 0.0 : std::is_same<T, float>::value ? 1e-5 : 1e-12;
    for (Index i = 0; i < ys.size(); ++i)
      ASSERT_NEAR(y.data()[cu[s] * 24 + i], ys.data()[i], tol * (1 + std::abs(ys.data()[i]))) << "sequence " << s;
    const sdpa::Gradients<T> gs_ = m.backward(gs, st);
    for (Index i = 0; i < gs_.queries.size(); ++i)
      ASSERT_NEAR(g.queries.data()[cu[s] * 24 + i], gs_.queries.data()[i], tol * (1 + std::abs(gs_.queries.data()[i])))
          << "sequence " << s;
    for (Index i = 0; i < gs_.fc_k.weight.size(); ++i) fc_k_sum += static_cast<double>(gs_.fc_k.weight.data()[i]);
  }
  EXPECT_NEAR(fc_k_packed, fc_k_sum, (std::is_same<T, float>::value ? 1e-4 : 1e-10) * (1 + std::abs(fc_k_sum)));
}

TEST(VarlenErrors, RefusedNamingTheField) {
  Rng rng(4);
  const T3<float> q = random3<float>(rng, 10, 2, 4), k = random3<float>(rng, 12, 1, 4), v = random3<float>(rng, 12, 1, 4);
  sdpa::AttentionOptions<float> o;
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v, o); }, {"attention_varlen", "cu_seqlens_q and cu_seqlens_k"});
  o.cu_seqlens_q = {0, 4, 10};
  o.cu_seqlens_k = {0, 12};
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v, o); }, {"cu_seqlens_k", "as many entries as cu_seqlens_q (3)", "2"});
  o.cu_seqlens_k = {1, 5, 12};
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v, o); }, {"cu_seqlens_k[0]", "0", "1"});
  o.cu_seqlens_k = {0, 5, 3};
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v, o); }, {"cu_seqlens_k[2]", "at least cu_seqlens_k[1] = 5", "3"});
  o.cu_seqlens_k = {0, 5, 11};
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v, o); }, {"cu_seqlens_k[2] (the last)", "12", "11"});
  o.cu_seqlens_q = {0, 4, 9};
  o.cu_seqlens_k = {0, 5, 12};
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v, o); }, {"cu_seqlens_q[2] (the last)", "10", "9"});
  o.cu_seqlens_q = {0, 4, 10};
  o.key_lengths = {3, 4};
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v, o); }, {"key_lengths", "packed"});
  o.key_lengths.clear();
  Eigen::Tensor<float, 4, Eigen::RowMajor> probabilities;
  o.probabilities = &probabilities;
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v, o); }, {"probabilities", "packed"});
  o.probabilities = nullptr;
  o.layout = sdpa::Layout::kBNHD;
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v, o); }, {"layout"});
  o.layout = sdpa::Layout::kBHND;
  const T3<float> k3 = random3<float>(rng, 12, 3, 4);
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k3, k3, o); }, {"k dimension 1 (key/value heads)", "divisor", "3"});
  const T3<float> v2 = random3<float>(rng, 11, 1, 4);
  expect_invalid([&] { (void)sdpa::attention_varlen(q, k, v2, o); }, {"v dimensions 0 and 1", "(12, 1)", "(11, 1)"});
  // The module: a batch of one, and no KVCache step with packed sequences.
  sdpa::ScaledDotProductAttention<float> m(8, 4, 4, 2, 0.0f);
  const T3<float> x2 = random3<float>(rng, 2, 5, 8);
  sdpa::AttentionOptions<float> mo;
  mo.cu_seqlens_q = mo.cu_seqlens_k = {0, 5};
  expect_invalid([&] { (void)m.forward(x2, x2, x2, mo); }, {"ScaledDotProductAttention::forward", "the batch", "1", "2"});
  sdpa::KVCache<float> cache(m, 1);
  const T3<float> x1 = random3<float>(rng, 1, 5, 8);
  expect_invalid([&] { (void)m.step(x1, cache, mo); }, {"ScaledDotProductAttention::step", "cu_seqlens_q", "KVCache"});
  EXPECT_EQ(cache.size(), 0);
  // A state of attention_varlen goes to attention_varlen_backward only, and the other way round.
  sdpa::AttentionState<float> vs, fs;
  o.cu_seqlens_q = {0, 10};
  o.cu_seqlens_k = {0, 12};
  (void)sdpa::attention_varlen(q, k, v, o, vs);
  EXPECT_THROW((void)sdpa::attention_backward(Eigen::Tensor<float, 4, Eigen::RowMajor>(1, 10, 2, 4), vs), std::logic_error);
  const Eigen::Tensor<float, 4, Eigen::RowMajor> q4(1, 2, 3, 4), k4(1, 2, 3, 4);
  sdpa::AttentionOptions<float> plain;
  (void)sdpa::attention(q4, k4, k4, plain, fs);
  EXPECT_THROW((void)sdpa::attention_varlen_backward(T3<float>(10, 2, 4), fs), std::logic_error);
}

}  // namespace varlen_test
