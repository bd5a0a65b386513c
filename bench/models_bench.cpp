// models_bench: the attention blocks of today's open models (issue 48), beside the FMA peak measured in the
// same run (bench/run.py --suite models writes bench/results/models.md). float, 1 thread and 2:
//   peak/fma/<isa>/threads:T                    independent FMA chains (fma_peak.hpp)
//   mla/absorbed/cache:4096/threads:T           DeepSeek V3's attention shapes (128 heads, kv_lora 512, rope 64,
//                                               nope 128, v 128), batch 1, one token: LatentAttention::attend
//                                               over a LatentCache of 4096 latents (absorb W_UK, multi-query
//                                               attention with d_k 576 / d_v 512, W_UV); counters: FLOPS, the
//                                               cache's bytes
//   mla/expanded/cache:4096/threads:T           the same token's attention over the expanded cache of the same
//                                               block: sdpa::attention, 128 heads of keys 192 and values 128
//   mla/core/cache:4096/threads:T               the absorbed form's multi-query attention alone (128 rows of
//                                               576 against 4096 latents, values 512): the 1.1 GFLOP
//   mla/kv_b_token/threads:T                    kv_b_proj of one token: the weights both forms read per step
//   prefill/<variant>/N:4096/threads:T          a causal prefill of 1 x 4096 through a module (d_model 1024,
//                                               16 heads of 64, 8 key heads, rotary): plain; qk_norm (per head,
//                                               Qwen3); temperature (Llama 4's NoPE layers, no rotary: against
//                                               plain_nope); gate (Qwen3-Next's output gate), beside
//                                               prefill/gate_projection: fc_g's projection alone
//   decode/<model>/cache:4096/threads:T         one decoding step of batch 1 after 4096 cached tokens (d_model
//                                               2048, 16 heads of 128, 4 key heads): llama (rotary), qwen3
//                                               (+ per-head QK-norm), gemma3 (+ 1 + w norm weights, its scale),
//                                               llama4 (interleaved rotary, chunks of 8192 as a score program,
//                                               the L2 norm after the rotary)
#include <benchmark/benchmark.h>

#include <sdpa/flex.hpp>
#include <sdpa/latent_attention.hpp>
#include <sdpa/sdpa.hpp>

#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "fma_peak.hpp"

namespace {

using Index = Eigen::Index;
using T3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using T4 = Eigen::Tensor<float, 4, Eigen::RowMajor>;

template <typename T>
void fill_random(T& t, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = nd(gen);
}

// ---- MLA ----

constexpr Index kCache = 4096;

sdpa::LatentConfig v3_shape() {
  sdpa::LatentConfig c;
  c.d_model = 7168;
  c.heads = 128;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  return c;
}

// One module for every MLA case (its weights are 750 MB).
const sdpa::LatentAttention<float>& v3_module() {
  static const sdpa::LatentAttention<float> m(v3_shape(), 1);
  return m;
}

void mla_absorbed(benchmark::State& state, int threads) {
  const auto& m = v3_module();
  sdpa::LatentCache<float> cache(m, 1, kCache);
  T3 lat(1, kCache, m.latent_width());
  fill_random(lat, 1);
  cache.append(lat);
  T3 q(1, 1, m.heads() * m.qk());
  fill_random(q, 2);
  const Eigen::ThreadPoolDevice* device = sdpa_bench::device_for(threads);
  for (auto _ : state) {
    T3 att = m.attend(q, cache, device);
    benchmark::DoNotOptimize(att.data());
  }
  const double flops = 2.0 * 128 * kCache * (576 + 512) + 2.0 * 2 * 128 * 128 * 512;
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["cache_bytes"] = static_cast<double>(cache.bytes());
}

// The multi-query attention at the heart of the absorbed form alone, as LatentAttention::attend runs it: 128
// query rows (the heads) of 576 against 4096 latents whose first 512 are the values, on the tiled kernel with
// key blocks of kLatentBlockK.
void mla_core(benchmark::State& state, int threads) {
  std::vector<float> q(128 * 576), kv(kCache * 576), out(128 * 512);
  std::mt19937 gen(2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& x : q) x = nd(gen);
  for (float& x : kv) x = nd(gen);
  sdpa::detail::CallShape shape;
  shape.batch = shape.heads = shape.kv_heads = 1;
  shape.nq = 128;
  shape.nk = kCache;
  shape.d_k = 576;
  shape.d_v = 512;
  auto p = sdpa::detail::problem_of(shape, sdpa::AttentionOptions<float>{}, sdpa::MaskedRows::kZero, false, 0);
  p.q = {q.data(), 128 * 576, 576, 576};
  p.k = {kv.data(), kCache * 576, 576, 576};
  p.v = {kv.data(), kCache * 576, 576, 512};
  p.out = {out.data(), 128 * 512, 512, 512};
  sdpa::kernels::TileConfig tiles;
  tiles.block_k = sdpa::kLatentBlockK;
  tiles.block_q = 128 / threads;
  for (auto _ : state) {
    sdpa::kernels::tiled_attention(p, sdpa_bench::device_for(threads), tiles);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["FLOPS"] = benchmark::Counter(2.0 * 128 * kCache * (576 + 512), benchmark::Counter::kIsIterationInvariantRate);
}

// kv_b_proj of one token: the weights both forms read every step (the expanded form to append the token's
// keys and values, the absorbed one as W_UK and W_UV).
void mla_kv_b_token(benchmark::State& state, int threads) {
  const auto& m = v3_module();
  T3 c(1, 1, 512), out(1, 1, 128 * 256);
  fill_random(c, 4);
  for (auto _ : state) {
    m.kv_b_proj().forward_rows(c.data(), 1, 512, out.data(), 128 * 256, sdpa_bench::device_for(threads));
    benchmark::DoNotOptimize(out.data());
  }
}

void mla_expanded(benchmark::State& state, int threads) {
  const auto& m = v3_module();
  const Index h = 128;
  T4 k(1, kCache, h, 192), v(1, kCache, h, 128), q(1, 1, h, 192);
  fill_random(k, 1);
  fill_random(v, 3);
  fill_random(q, 2);
  sdpa::AttentionOptions<float> o;
  o.layout = sdpa::Layout::kBNHD;
  o.causal = true;
  o.scale = m.scale();
  o.device = sdpa_bench::device_for(threads);
  for (auto _ : state) {
    T4 att = sdpa::attention(q, k, v, o);
    benchmark::DoNotOptimize(att.data());
  }
  const double flops = 2.0 * h * kCache * (192 + 128);
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["cache_bytes"] = static_cast<double>((k.size() + v.size()) * sizeof(float));
}

// ---- Prefill with QK-norm, temperature, gate ----

sdpa::ScaledDotProductAttention<float> prefill_module(const std::string& variant) {
  sdpa::ScaledDotProductAttention<float> m(1024, 64, 64, 16, 0.0f, 8);
  m.eval();
  if (variant != "temperature" && variant != "plain_nope") m.set_rotary(sdpa::Rotary{});
  if (variant == "qk_norm") {
    sdpa::QkNorm<float> n;
    n.kind = sdpa::QkNormKind::kHead;
    n.q_weight.assign(64, 1.1f);
    n.k_weight.assign(64, 0.9f);
    m.set_qk_norm(n);
  }
  if (variant == "temperature") m.set_query_temperature({8192.0, 0.1});
  if (variant == "gate") m.set_output_gate(true);
  return m;
}

void prefill(benchmark::State& state, const std::string& variant, int threads) {
  const Index n = 4096;
  const auto m = prefill_module(variant);
  T3 x(1, n, 1024);
  fill_random(x, 5);
  sdpa::AttentionOptions<float> o;
  o.causal = true;
  o.device = sdpa_bench::device_for(threads);
  for (auto _ : state) {
    T3 y = m(x, x, x, o);
    benchmark::DoNotOptimize(y.data());
  }
}

void gate_projection(benchmark::State& state, int threads) {
  const Index n = 4096;
  const auto m = prefill_module("gate");
  T3 x(1, n, 1024), g(1, n, 1024);
  fill_random(x, 5);
  for (auto _ : state) {
    m.fc_g().forward_rows(x.data(), n, 1024, g.data(), 1024, sdpa_bench::device_for(threads));
    benchmark::DoNotOptimize(g.data());
  }
}

// ---- Decoding steps of the models' blocks ----

struct DecodeCase {
  sdpa::ScaledDotProductAttention<float> module;
  sdpa::AttentionOptions<float> options;
};

DecodeCase decode_case(const std::string& model) {
  DecodeCase c{sdpa::ScaledDotProductAttention<float>(2048, 128, 128, 16, 0.0f, 4), {}};
  c.module.eval();
  sdpa::Rotary r;
  r.theta = model == "gemma3" ? 1e6 : 5e5;
  r.interleaved = model == "llama4";
  c.module.set_rotary(r);
  if (model == "qwen3" || model == "gemma3" || model == "llama4") {
    sdpa::QkNorm<float> n;
    n.kind = sdpa::QkNormKind::kHead;
    if (model == "llama4") {
      n.after_rotary = true;
    } else {
      n.q_weight.assign(128, model == "gemma3" ? 1.25f : 1.0f);
      n.k_weight.assign(128, model == "gemma3" ? 0.75f : 1.0f);
    }
    c.module.set_qk_norm(n);
  }
  if (model == "gemma3") c.options.scale = 1.0f / std::sqrt(256.0f);
  if (model == "llama4") c.options.program = sdpa::flex::program<float>(sdpa::flex::noop_score{}, sdpa::flex::chunked{8192});
  return c;
}

void decode(benchmark::State& state, const std::string& model, int threads) {
  DecodeCase c = decode_case(model);
  c.options.device = sdpa_bench::device_for(threads);
  T3 prompt(1, kCache, 2048), x(1, 1, 2048);
  fill_random(prompt, 7);
  fill_random(x, 8);
  sdpa::KVCache<float> cache(c.module, 1, kCache + 1);
  c.module.step(prompt, cache, c.options);
  for (auto _ : state) {
    T3 y = c.module.step(x, cache, c.options);
    benchmark::DoNotOptimize(y.data());
    cache.truncate(kCache);  // every step appends to the same 4096 (dropping the newest entry: O(1))
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int threads : {1, 2}) {
    const std::string th = "/threads:" + std::to_string(threads);
    benchmark::RegisterBenchmark((std::string("peak/fma/") + sdpa_bench::kPeakIsa + th).c_str(), sdpa_bench::fma_peak)
        ->Threads(threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("mla/absorbed/cache:4096" + th).c_str(), [threads](benchmark::State& s) { mla_absorbed(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("mla/expanded/cache:4096" + th).c_str(), [threads](benchmark::State& s) { mla_expanded(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("mla/core/cache:4096" + th).c_str(), [threads](benchmark::State& s) { mla_core(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("mla/kv_b_token" + th).c_str(), [threads](benchmark::State& s) { mla_kv_b_token(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    for (const std::string variant : {"plain", "qk_norm", "plain_nope", "temperature", "gate"})
      benchmark::RegisterBenchmark(("prefill/" + variant + "/N:4096" + th).c_str(),
                                   [variant, threads](benchmark::State& s) { prefill(s, variant, threads); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("prefill/gate_projection/N:4096" + th).c_str(), [threads](benchmark::State& s) { gate_projection(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    for (const std::string model : {"llama", "qwen3", "gemma3", "llama4"})
      benchmark::RegisterBenchmark(("decode/" + model + "/cache:4096" + th).c_str(),
                                   [model, threads](benchmark::State& s) { decode(s, model, threads); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
