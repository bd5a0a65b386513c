// minilm_bench: the six self-attention blocks of all-MiniLM-L6-v2 (d_model 384, 12 heads of 32, q/k/v/o
// projections with biases) on a batch of 32 sentences padded to 128 tokens, each sentence's keys stopping at
// its length (key_lengths: 128 - (53 b mod 113), 16 to 128 tokens, what bench/peers/minilm_peer.py gives
// transformers as its padding mask), float, eval, 1 and 2 threads:
//   minilm/attention/threads:<t>      six module calls, one per layer (each layer's own weights), on the
//                                     padded (32, 128, 384) batch: every padding row is projected and
//                                     attends, as transformers computes it
//   minilm/packed/threads:<t>         the same 32 sentences packed without padding, (1, 2329, 384) with
//                                     cu_seqlens: the sentences' own rows only (the bits of each sentence
//                                     alone, which are its real rows of the padded call)
// The weights are PyTorch-default random ones of the trained model's shapes: the time does not depend on
// their values. bench/run.py --suite minilm runs it beside transformers' eager and SDPA attention.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench_common.hpp"

namespace sdpa_bench {
namespace {

constexpr Index kBatch = 32, kTokens = 128, kModel = 384, kHeads = 12, kLayers = 6;

std::vector<Index> lengths() {
  std::vector<Index> l;
  for (Index b = 0; b < kBatch; ++b) l.push_back(kTokens - (53 * b) % 113);
  return l;
}

// The six layers, each with its own PyTorch-default random weights, in eval mode.
std::vector<Module> make_layers() {
  std::vector<Module> layers;
  for (Index l = 0; l < kLayers; ++l) {
    layers.emplace_back(kModel, kModel / kHeads, kModel / kHeads, kHeads, 0.0f);
    sdpa::Philox gen(0x3141, static_cast<std::uint64_t>(l));
    layers.back().init_weights(sdpa::init::PyTorchDefaultPolicy{}, gen);
    layers.back().eval();
  }
  return layers;
}

// Times the six layers' calls on x (rows x 384 per batch entry) with options o.
void time_layers(benchmark::State& state, const Tensor3& x, const sdpa::AttentionOptions<float>& o) {
  std::vector<Module> layers = make_layers();
  std::vector<Tensor3> out(static_cast<std::size_t>(kLayers));
  const auto run = [&] {
    for (Index l = 0; l < kLayers; ++l) out[static_cast<std::size_t>(l)] = layers[static_cast<std::size_t>(l)](x, x, x, o);
  };
  run();  // the modules' scratch exists from here on
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(out.back().data());
    benchmark::ClobberMemory();
  }
}

// A (batch, rows, 384) input, uniform in [-1, 1).
Tensor3 random_input(Index batch, Index rows) {
  Tensor3 x(batch, rows, kModel);
  sdpa::Philox gen(0x3142, 0);
  sdpa::init::Uniform{-1.0, 1.0}(x, gen);
  return x;
}

void attention_case(benchmark::State& state, int threads) {
  const Tensor3 x = random_input(kBatch, kTokens);
  sdpa::AttentionOptions<float> o;
  o.key_lengths = lengths();
  o.device = device_for(threads);
  time_layers(state, x, o);
}

void packed_case(benchmark::State& state, int threads) {
  std::vector<Index> cu{0};
  for (Index n : lengths()) cu.push_back(cu.back() + n);
  const Tensor3 x = random_input(1, cu.back());
  sdpa::AttentionOptions<float> o;
  o.cu_seqlens_q = o.cu_seqlens_k = cu;
  o.device = device_for(threads);
  time_layers(state, x, o);
}

const bool registered = [] {
  for (int threads : {1, 2}) {
    benchmark::RegisterBenchmark(("minilm/attention/threads:" + std::to_string(threads)).c_str(),
                                 [threads](benchmark::State& s) { attention_case(s, threads); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("minilm/packed/threads:" + std::to_string(threads)).c_str(),
                                 [threads](benchmark::State& s) { packed_case(s, threads); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  return true;
}();

}  // namespace
}  // namespace sdpa_bench

BENCHMARK_MAIN();
