// decoder_bench: the options of today's decoders, against the same call without them, one thread, float,
// eval, d_model 512, h 8, d_k = d_v = 64 (bench/run.py --suite decoder runs it and writes the
// page bench/results/decoder.md):
//   decoder/step/kv:<kv>/rotary:<0|1>/cache:4095      one decoding step (one token) against 4095 cached
//                                                     entries, kv_heads 8 (multi-head) or 2; the cache is
//                                                     truncated back after each step
//   decoder/forward/kv:<kv>/rotary:<0|1>/N:4096        the causal forward of 1 x 4096 tokens
//   decoder/forward/<plain|softcap|sinks>/N:4096       the non-causal forward of 1 x 4096, with softcap 30 or
//                                                     one sink logit per head
//   decoder/backward/kv:2/rotary:1/N:4096              the backward of the causal forward with GQA and rotary
//                                                     (decoder/forward_state/... is its forward keeping state)
// Counters: bytes (what a step reads: its cache entries and the four weight matrices).
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench_common.hpp"

namespace sdpa_bench {
namespace {

Module make_module(Index kv, bool rotary) {
  Module m(512, 64, 64, 8, 0.0f, kv);
  m.init_weights(sdpa::init::PyTorchDefaultPolicy{});
  m.eval();
  if (rotary) m.set_rotary(sdpa::rope_llama3(64, 500000, 8, 1, 4, 8192));
  return m;
}

Tensor3 tokens(Index n, std::uint64_t stream) {
  Tensor3 x(1, n, 512);
  sdpa::Philox gen(0xdec0de, stream);
  sdpa::init::Uniform{-1.0, 1.0}(x, gen);
  return x;
}

void step_case(benchmark::State& state, Index kv, bool rotary) {
  const Index n = 4095;
  const Module m = make_module(kv, rotary);
  sdpa::KVCache<float> cache(m, 1, n + 1);
  m.append(tokens(n, 1), tokens(n, 1), cache);
  const Tensor3 token = tokens(1, 3);
  Tensor3 out(1, 1, 512);
  Eigen::TensorMap<Tensor3> out_map(out.data(), 1, 1, 512);
  for (auto _ : state) {
    m.step(token, cache, {}, out_map);
    cache.truncate(n);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["bytes"] = 4.0 * (2.0 * static_cast<double>(n) * static_cast<double>(kv) * 64 +
                                   (512.0 * 512 * 2 + 2.0 * 512 * static_cast<double>(kv) * 64));
}

void forward_case(benchmark::State& state, Index kv, bool rotary, bool causal, const sdpa::AttentionOptions<float>& extra) {
  const Module m = make_module(kv, rotary);
  const Tensor3 x = tokens(4096, 1);
  sdpa::AttentionOptions<float> o = extra;
  o.causal = causal;
  benchmark::DoNotOptimize(m(x, x, x, o).data());  // the module's scratch exists from here on
  for (auto _ : state) {
    auto y = m(x, x, x, o);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
}

void training_case(benchmark::State& state, bool backward) {
  Module m = make_module(2, true);
  m.train();
  const Tensor3 x = tokens(4096, 1);
  sdpa::AttentionOptions<float> o;
  o.causal = true;
  Tensor3 dy(1, 4096, 512);
  sdpa::Philox gen(0xdec0de, 9);
  sdpa::init::Uniform{-1.0, 1.0}(dy, gen);
  sdpa::ForwardState<float> s;
  benchmark::DoNotOptimize(m.forward(x, x, x, o, s).data());
  for (auto _ : state) {
    if (backward) {
      auto g = m.backward(dy, s);
      benchmark::DoNotOptimize(g.queries.data());
    } else {
      auto y = m.forward(x, x, x, o, s);
      benchmark::DoNotOptimize(y.data());
    }
    benchmark::ClobberMemory();
  }
}

}  // namespace
}  // namespace sdpa_bench

int main(int argc, char** argv) {
  using namespace sdpa_bench;
  for (const Index kv : {Index(8), Index(2)})
    for (const bool rotary : {false, true}) {
      const std::string tag = "kv:" + std::to_string(kv) + "/rotary:" + (rotary ? "1" : "0");
      benchmark::RegisterBenchmark(("decoder/step/" + tag + "/cache:4095").c_str(),
                                   [=](benchmark::State& s) { step_case(s, kv, rotary); })
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("decoder/forward/" + tag + "/N:4096").c_str(),
                                   [=](benchmark::State& s) { forward_case(s, kv, rotary, true, {}); })
          ->Unit(benchmark::kMillisecond);
    }
  sdpa::AttentionOptions<float> softcap, sinks;
  softcap.softcap = 30;
  sinks.sinks.assign(8, 0.5f);
  const std::pair<const char*, sdpa::AttentionOptions<float>> extras[] = {{"plain", {}}, {"softcap", softcap}, {"sinks", sinks}};
  for (const auto& [name, o] : extras)
    benchmark::RegisterBenchmark((std::string("decoder/forward/") + name + "/N:4096").c_str(),
                                 [o = o](benchmark::State& s) { forward_case(s, 8, false, false, o); })
        ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("decoder/forward_state/kv:2/rotary:1/N:4096",
                               [](benchmark::State& s) { training_case(s, false); })
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("decoder/backward/kv:2/rotary:1/N:4096", [](benchmark::State& s) { training_case(s, true); })
      ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
