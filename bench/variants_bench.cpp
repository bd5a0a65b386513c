// variants_bench: the attention variants of AttentionOptions against plain attention on the same module and
// inputs (d_model 512, h 8, d_k = d_v = 64, eval, float), to measure what each option costs or saves:
//   variants/<case>/N:<n>/threads:<t>
//   plain, causal (the option), causal_mask (the same through a (1, 1, N, N) bool tensor), window (causal
//   with window_left = 255), bias ((1, h, N, N) float tensor), alibi (alibi_slopes(8)): batch 1, N tokens;
//   padded/unpadded, padded/key_lengths, padded/key_padding_mask: batch 8 x 1024 tokens, the lengths spread
//   evenly over 64 .. 1024 (padded) or all 1024 (unpadded).
// Counters: FLOPS (useful multiply-add FLOPs over the visible pairs, see bench_common.hpp), GFLOP, pairs.
//
//   variants_bench --peak_rss CASE N       one forward, then prints {"case", "N", "vm_hwm_mib"} as JSON
//                                          (VmHWM, the address space's high-water mark; run it in a fresh
//                                          process per measurement)
// bench/run.py --suite variants runs both and writes bench/results/variants.md.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace sdpa_bench {
namespace {

// Keys visible to each query under the case's options (for the FLOP count), per batch entry.
double visible_pairs(const std::string& variant, Index n, const std::vector<Index>& lengths) {
  if (variant == "causal" || variant == "causal_mask") return static_cast<double>(n) * static_cast<double>(n + 1) / 2;
  if (variant == "window") {
    double pairs = 0;
    for (Index q = 0; q < n; ++q) pairs += static_cast<double>(std::min<Index>(q + 1, 256));
    return pairs;
  }
  if (variant == "key_lengths" || variant == "key_padding_mask") {
    double pairs = 0;
    for (Index l : lengths) pairs += static_cast<double>(n) * static_cast<double>(l);
    return pairs / static_cast<double>(lengths.size());
  }
  return static_cast<double>(n) * static_cast<double>(n);
}

std::vector<Index> padded_lengths(Index batch, Index n) {
  std::vector<Index> lengths;
  for (Index b = 0; b < batch; ++b) lengths.push_back(64 + (n - 64) * b / (batch - 1));
  return lengths;
}

// One case: its fixture, the options (and the tensors they point to).
struct VariantCase {
  std::string variant;
  Index batch = 1, n = 0;
  std::unique_ptr<Fixture> fixture;
  sdpa::AttentionOptions<float> options;
  sdpa::Mask mask;
  Eigen::Tensor<float, 4, Eigen::RowMajor> bias;
  std::vector<Index> lengths;

  VariantCase(const std::string& v, Index b, Index len) : variant(v), batch(b), n(len) {
    Config c = long_config(n, false);
    c.batch = batch;
    fixture = std::make_unique<Fixture>(c);
    if (batch > 1) lengths = variant == "unpadded" ? std::vector<Index>(static_cast<std::size_t>(batch), n)
                                                  : padded_lengths(batch, n);
    if (variant == "causal") options.causal = true;
    if (variant == "causal_mask") {
      mask = sdpa::causal_mask(n, n);
      options.attention_mask = &mask;
    }
    if (variant == "window") {
      options.causal = true;
      options.window_left = 255;
    }
    if (variant == "bias") {
      bias = Eigen::Tensor<float, 4, Eigen::RowMajor>(1, c.h, n, n);
      sdpa::Philox gen(11);
      sdpa::init::Uniform{-1.0, 1.0}(bias, gen);
      options.attention_bias = &bias;
    }
    if (variant == "alibi") options.alibi_slopes = sdpa::alibi_slopes<float>(c.h);
    if (variant == "key_lengths") options.key_lengths = lengths;
    if (variant == "key_padding_mask") {
      mask = sdpa::key_padding_mask(lengths, n);
      options.attention_mask = &mask;
    }
  }

  Tensor3 run(const Eigen::ThreadPoolDevice* device) {
    options.device = device;
    return fixture->module(fixture->x, fixture->x, fixture->x, options);
  }

  double flops() const {
    const Config& c = fixture->cfg;
    const double b = static_cast<double>(batch), nn = static_cast<double>(n), dm = static_cast<double>(c.d_model);
    const double hk = static_cast<double>(c.h * c.d_k), hv = static_cast<double>(c.h * c.d_v);
    const double projections = 2 * b * nn * dm * (2 * hk + hv) + 2 * b * nn * hv * dm;
    return projections + 2 * b * static_cast<double>(c.h) * visible_pairs(variant, n, lengths) *
                             static_cast<double>(c.d_k + c.d_v);
  }
};

void register_case(const std::string& group, const std::string& variant, Index batch, Index n, int threads) {
  const std::string name = "variants/" + group + "/" + variant + "/N:" + std::to_string(n) +
                           (batch > 1 ? "/batch:" + std::to_string(batch) : "") + "/threads:" + std::to_string(threads);
  benchmark::RegisterBenchmark(name.c_str(), [variant, batch, n, threads](benchmark::State& state) {
    VariantCase vc(variant, batch, n);  // built outside the timed loop, once per repetition
    const Eigen::ThreadPoolDevice* device = device_for(threads);
    for (auto _ : state) {
      auto y = vc.run(device);
      benchmark::DoNotOptimize(y.data());
      benchmark::ClobberMemory();
    }
    state.counters["FLOPS"] = benchmark::Counter(vc.flops(), benchmark::Counter::kIsIterationInvariantRate);
    state.counters["GFLOP"] = vc.flops() / 1e9;
    state.counters["nthreads"] = threads;
  })->UseRealTime()->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
}

}  // namespace
}  // namespace sdpa_bench

int main(int argc, char** argv) {
  using namespace sdpa_bench;
  if (argc == 4 && std::strcmp(argv[1], "--peak_rss") == 0) {
    const std::string variant = argv[2];
    const Index n = std::atol(argv[3]);
    VariantCase vc(variant, 1, n);
    const Tensor3 y = vc.run(nullptr);
    std::printf("{\"case\": \"%s\", \"N\": %ld, \"vm_hwm_mib\": %.1f, \"checksum\": %.6g}\n", variant.c_str(),
                static_cast<long>(n), vm_hwm_mib(), static_cast<double>(y(0, n - 1, 0)));
    return 0;
  }
  for (int threads : {1, 2}) {
    for (const char* v : {"plain", "causal", "causal_mask", "bias", "alibi"}) register_case("long", v, 1, 4096, threads);
    for (Index n : {Index(4096), Index(8192), Index(16384), Index(32768), Index(65536)})
      register_case("window", "window", 1, n, threads);
    for (Index n : {Index(4096), Index(8192), Index(16384)}) register_case("window", "plain", 1, n, threads);
    for (const char* v : {"unpadded", "key_lengths", "key_padding_mask"}) register_case("padded", v, 8, 1024, threads);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
