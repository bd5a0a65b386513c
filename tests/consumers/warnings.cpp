// An application of one's own that uses sdpa the way the README shows, compiled by the consumer test with
// -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion -Werror and EIGEN_USE_THREADS defined
// on the command line (as the README tells users to): any warning from sdpa's headers fails the build.
#include <sdpa/sdpa.hpp>
#ifdef SDPA_CONSUMER_IO
#include <sdpa/io/hf.hpp>
#include <sdpa/io/safetensors.hpp>
#endif
#ifdef SDPA_CONSUMER_MPI
#include <sdpa/distributed/head_parallel.hpp>
#include <sdpa/distributed/ring_attention.hpp>
#ifdef SDPA_CONSUMER_IO
#include <sdpa/distributed/head_parallel_io.hpp>
#endif
#endif

#include <cmath>
#include <iostream>
#include <type_traits>

namespace {

template <typename Scalar>
int exercise() {
  // The README's headline snippet, in eval mode for inference.
  sdpa::ScaledDotProductAttention<Scalar> att(/*d_model=*/32, /*d_k=*/8, /*d_v=*/8, /*h=*/4, /*dropout=*/Scalar(0.1));
  att.eval();
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> x(2, 9, 32);
  x.setRandom();
  auto y = att(x, x, x);

  // Masks, weights, a thread pool, an expression argument, a TensorMap.
  const auto causal = sdpa::causal_mask(9, 9);
  const auto padding = sdpa::key_padding_mask({9, 4}, 9);
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor> weights(1, 4, 9, 9);
  weights.setConstant(Scalar(1));
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  auto y_masked = att(x, x, x, &causal, &weights, &device);
  auto y_padded = att.forward(x * Scalar(2), x, x, &padding);
  Eigen::TensorMap<const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>> map(x.data(), 2, 9, 32);
  auto y_map = att(map, map, map);

  // Training mode with dropout, seeds, the masked-row policy, the reference kernel.
  att.train();
  att.manual_seed(3);
  att.set_masked_rows(sdpa::MaskedRows::kNaN);
  auto y_train = att(x, x, x);
  att.set_kernel(sdpa::Kernel::kReference);
  auto y_ref = att(x, x, x, &causal);

  // A layer and init strategies on their own.
  sdpa::Linear<Scalar> layer(32, 16);
  sdpa::Philox gen(42);
  sdpa::init::XavierUniform{1.0}(layer.weight(), gen);
  sdpa::init::KaimingNormal{0.0, sdpa::FanMode::kFanIn, sdpa::Nonlinearity::kRelu}(layer.weight(), gen);
  auto z = layer(x);
  att.init_weights(sdpa::init::PyTorchDefaultPolicy{});
  for (auto p : att.named_parameters()) (void)p.size();

  // Today's decoders: grouped-query heads with a rotary embedding, decoding through a cache, the options
  // of the functional core, and the core itself with its backward pass.
  sdpa::ScaledDotProductAttention<Scalar> gqa(32, 8, 8, 4, Scalar(0), /*kv_heads=*/2);
  gqa.eval();
  gqa.set_rotary(sdpa::rope_llama3(8, 500000.0, 8.0, 1.0, 4.0, 8192));
  sdpa::AttentionOptions<Scalar> decoder;
  decoder.causal = true;
  decoder.window_left = 4;
  decoder.softcap = Scalar(50);
  decoder.scale = Scalar(0.25);
  decoder.sinks = {Scalar(0.5), Scalar(-1), Scalar(0), Scalar(2)};
  auto y_gqa = gqa(x, x, x, decoder);
  sdpa::KVCache<Scalar> cache(gqa, 2, 16);
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> token(2, 1, 32);
  token.setRandom();
  sdpa::AttentionOptions<Scalar> step_options;
  step_options.sinks = decoder.sinks;
  auto y_step = gqa.step(token, cache, step_options);
  y_step = gqa.step(token, cache, step_options);

  // Narrow storage (float only): bf16 / f16 / int8 caches, bf16 weights, saved in their own dtypes.
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> y_narrow(2, 1, 32);
  y_narrow.setZero();
  if constexpr (std::is_same<Scalar, float>::value) {
    sdpa::ScaledDotProductAttention<Scalar> narrow = gqa;
    narrow.set_weight_storage(sdpa::Storage::kBFloat16);
    for (sdpa::Storage s : {sdpa::Storage::kBFloat16, sdpa::Storage::kFloat16, sdpa::Storage::kInt8}) {
      sdpa::KVCache<Scalar> c(narrow, 2, 32, s);
      (void)narrow.step(x, c, step_options);  // the tiled kernel
      y_narrow = narrow.step(token, c, step_options);  // the decoding kernel
      c.reorder({1, 0});
      c.truncate(3);
      if (c.bytes() == 0) return 1;
#ifdef SDPA_CONSUMER_IO
      const auto cache_bytes = sdpa::save_kv_cache_to_memory(c);
      sdpa::load_kv_cache_from_memory(c, cache_bytes.data(), cache_bytes.size());
#endif
    }
    (void)narrow(x, x, x, decoder);
#ifdef SDPA_CONSUMER_IO
    const auto weight_bytes = sdpa::save_safetensors_to_memory(narrow);
    sdpa::LoadOptions keep;
    keep.keep_dtype = true;
    sdpa::load_safetensors_from_memory(narrow, weight_bytes.data(), weight_bytes.size(), "memory", "", keep);
#endif
  }

  // Serving: packed sequences (the module and attention_varlen), a paged cache stepped as a ragged batch.
  sdpa::AttentionOptions<Scalar> packed;
  packed.causal = true;
  packed.cu_seqlens_q = packed.cu_seqlens_k = {0, 3, 3, 9};
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> one(1, 9, 32);
  one.setRandom();
  auto y_packed = gqa(one, one, one, packed);
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> q3(9, 4, 8), k3(9, 2, 8), v3(9, 2, 8);
  q3.setRandom();
  k3.setRandom();
  v3.setRandom();
  sdpa::AttentionState<Scalar> varlen_state;
  const auto o3 = sdpa::attention_varlen(q3, k3, v3, packed, varlen_state);
  const auto g3 = sdpa::attention_varlen_backward(o3, varlen_state);
  sdpa::PagedKVCache<Scalar> paged(gqa, 16, 8);
  const auto first = paged.add_sequence(), second = paged.add_sequence();
  (void)gqa.step(token, paged, {first, second});
  const auto forked = paged.fork(first);
  y_step = gqa.step(token, paged, {first, forked});
  // Speculative decoding: a draft tree on both caches, one path accepted; the cascade's levels.
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> drafts(2, 3, 32);
  drafts.setRandom();
  (void)gqa.step_tree(drafts, paged, {first, forked}, {-1, 0, 0});
  paged.accept(first, {0, 1});
  (void)gqa.step_tree(drafts, cache, {-1, 0, -1});
  cache.accept({2});
  if (!paged.shared_blocks({first, forked}).empty() && paged.drafts(forked) != 3) return 1;
  paged.truncate(forked, 1);
  paged.remove_sequence(second);
  if (paged.blocks_used() == 0 || g3.q.size() == 0) return 1;

  Eigen::Tensor<Scalar, 4, Eigen::RowMajor> q(2, 4, 9, 8), k(2, 2, 9, 8), v(2, 2, 9, 8);
  q.setRandom();
  k.setRandom();
  v.setRandom();
  const sdpa::Rotary rope = sdpa::rope_yarn(8, 150000.0, 32.0, 4096, 32.0, 1.0, false);
  sdpa::AttentionOptions<Scalar> core = decoder;
  core.rotary = &rope;
  sdpa::AttentionState<Scalar> state;
  const auto o = sdpa::attention(q, k, v, core, state);
  const auto grads = sdpa::attention_backward(o, state);
  for (const auto* t : {&o, &grads.q, &grads.k, &grads.v})
    for (Eigen::Index i = 0; i < t->size(); ++i) (void)t->data()[i];

  // Partial attention and its merge.
  sdpa::AttentionPart<Scalar> part_a, part_b;
  sdpa::AttentionOptions<Scalar> with_lse = decoder;
  with_lse.log_sum_exp = &part_a.lse;
  part_a.out = sdpa::attention(q, k, v, with_lse);
  with_lse.log_sum_exp = &part_b.lse;
  with_lse.sinks.clear();
  part_b.out = sdpa::attention(q, k, v, with_lse);
  const sdpa::AttentionPart<Scalar> merged = sdpa::merge_attention_states(part_a, part_b);
  sdpa::merge_attention_states(part_a.out, part_a.lse, part_b.out, part_b.lse, sdpa::MergeOptions{});
  if (merged.lse.size() != part_a.lse.size()) return 1;

  // Programmable attention: built-in and lambda functions, a plan, a table's gradient.
  sdpa::flex::ScoreTable<Scalar> buckets(4, 8);
  const auto mask = sdpa::flex::and_masks(sdpa::flex::document({0, 0, 0, 1, 1, 1, 1, 2, 2}), sdpa::flex::causal{});
  const sdpa::BlockMask plan = mask.plan(2, 4, 9, 9, 4, 4);
  const auto flexed = sdpa::attention(q, k, v, {}, sdpa::flex::t5_buckets<Scalar>{&buckets, true, 8, 16}, mask, &plan, state);
  const auto flex_grads = sdpa::attention_backward(flexed, state);
  const auto gated = [](auto s, Eigen::Index, Eigen::Index, Eigen::Index qi, Eigen::Index ki) {
    return s - sdpa::flex::sigmoid(s) * static_cast<Scalar>(qi - ki);
  };
  const auto exact = sdpa::block_mask_from([](Eigen::Index, Eigen::Index, Eigen::Index qi, Eigen::Index ki) { return ki % 3 != 1 || ki == qi; },
                                           1, 1, 9, 9, 4, 4);
  const auto gated_out = sdpa::attention(q, k, v, {}, gated, sdpa::flex::all_visible{}, nullptr, state);
  if (flex_grads.tables.size() != 1 || gated_out.size() == 0 || exact.count(sdpa::BlockState::kNone) < 0) return 1;

  // Today's open models: QK-norm, gate, temperature, LongRoPE, MRoPE positions; latent attention.
  sdpa::ScaledDotProductAttention<Scalar> qwen(32, 8, 8, 4, Scalar(0), 2);
  qwen.eval();
  sdpa::QkNorm<Scalar> norm;
  norm.kind = sdpa::QkNormKind::kHead;
  norm.q_weight.assign(8, Scalar(1));
  norm.k_weight.assign(8, Scalar(1));
  qwen.set_qk_norm(norm);
  qwen.set_output_gate(true);
  qwen.set_query_temperature({4.0, 0.1});
  sdpa::Rotary mrope = sdpa::rope_longrope(8, 10000, {1, 1, 1, 1}, {2, 2, 2, 2}, 4, 8.0);
  mrope.mrope_section = {2, 1, 1};
  qwen.set_rotary(mrope);
  sdpa::AttentionOptions<Scalar> vl;
  vl.causal = true;
  vl.rotary_positions.assign(3 * 2 * 9, 1);
  sdpa::ForwardState<Scalar> qwen_state;
  const auto y_qwen = qwen.forward(x, x, x, vl, qwen_state);
  const auto qwen_grads = qwen.backward(y_qwen, qwen_state);
  sdpa::LatentConfig lc;
  lc.d_model = 32;
  lc.heads = 4;
  lc.kv_lora_rank = 8;
  lc.qk_nope_head_dim = 4;
  lc.qk_rope_head_dim = 4;
  lc.v_head_dim = 4;
  sdpa::LatentAttention<Scalar> mla(lc);
  sdpa::LatentCache<Scalar> latent(mla, 2);
  sdpa::LatentState<Scalar> mla_state;
  sdpa::AttentionOptions<Scalar> mla_options;
  mla_options.causal = true;
  const auto y_mla = mla.forward(x, mla_options, mla_state);
  const auto mla_grads = mla.backward(y_mla, mla_state);
  const auto y_latent = mla.step(x, latent);
  if (qwen_grads.q_norm.size() != 8 || mla_grads.input.size() != x.size() || y_latent.size() != x.size()) return 1;

#ifdef SDPA_CONSUMER_IO
  // A Hugging Face block from files that are not there: a clear exception, nothing loaded.
  try {
    (void)sdpa::load_hf_attention(gqa, "/nonexistent/model.safetensors", "model.layers.0.self_attn.",
                                  sdpa::HfLayout::kLlama);
    return 1;
  } catch (const std::exception&) {
  }
  const auto bytes = sdpa::save_safetensors_to_memory(att, "layer.");
  sdpa::load_safetensors_from_memory(att, bytes.data(), bytes.size(), "memory", "layer.");
#endif

  double sum = 0;
  for (const auto* t : {&y, &y_masked, &y_padded, &y_map, &y_train, &y_ref, &y_gqa, &y_step, &y_narrow, &y_packed})
    for (Eigen::Index i = 0; i < t->size(); ++i) sum += static_cast<double>(t->data()[i]);
  for (Eigen::Index i = 0; i < z.size(); ++i) sum += static_cast<double>(z.data()[i]);
  if (!std::isfinite(sum)) {
    std::cerr << "non-finite output\n";
    return 1;
  }
  return 0;
}

}  // namespace

#ifdef SDPA_CONSUMER_MPI
// The distributed layers as the README shows them: compiled (every template instantiated), not run (this
// program is not started by mpiexec).
template <typename Scalar>
[[maybe_unused]] void distributed_usage() {
  sdpa::Tensor4<Scalar> q(1, 2, 8, 4);
  q.setConstant(Scalar(1));
  sdpa::AttentionOptions<Scalar> o;
  o.causal = true;
  sdpa::RingOptions ring;
  ring.layout = sdpa::RingLayout::kZigZag;
  sdpa::RingState<Scalar> state;
  const auto local = sdpa::ring_shard(q, ring.layout, 0, 2);
  auto out = sdpa::ring_attention(local, local, local, o, MPI_COMM_WORLD, ring, state);
  auto grads = sdpa::ring_attention_backward(out, state, MPI_COMM_WORLD);
  auto plain = sdpa::ring_attention(local, local, local, o, MPI_COMM_WORLD);
  sdpa::ScaledDotProductAttention<Scalar> whole(8, 4, 4, 2, Scalar(0));
  auto hp = sdpa::HeadParallelAttention<Scalar>::slice_of(whole, MPI_COMM_WORLD);
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> x(1, 3, 8);
  x.setConstant(Scalar(1));
  sdpa::ForwardState<Scalar> fs;
  auto y = hp.forward(x, x, x, sdpa::AttentionOptions<Scalar>{}, fs);
  auto g = hp.backward(y, fs);
#ifdef SDPA_CONSUMER_IO
  sdpa::load_safetensors_slice(hp, "whole.safetensors");
#endif
  (void)grads;
  (void)plain;
  (void)g;
}
template void distributed_usage<float>();
template void distributed_usage<double>();
#endif

int main() {
  const int rc = exercise<float>() + exercise<double>();
  if (rc == 0) std::cout << "consumer ok\n";
  return rc;
}
