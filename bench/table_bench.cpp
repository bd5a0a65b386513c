// table_bench: sdpa on the configurations ../shared/peers/ times PyTorch 2.6 and ONNX Runtime 1.21 on, with
// the same FLOP count (peer_perf.py: the four projections and 2 * B * h * pairs * (d_k + d_v)), so that the
// peers table of bench/results/peers.md compares like with like. d_model 512, h 8, float, eval, self-attention:
//   table/demo (50 x 49, d_k 512), table/std (50 x 49, d_k 64), table/long (1 x 4096, d_k 64),
//   table/long_causal (the same with causal = true), table/long8k (1 x 8192, d_k 64); 1 and 2 threads.
// fma_peak/<isa> (bench/fma_peak.hpp) is registered too: bench/run.py --suite peers runs the cases with
// their repetitions interleaved, so that "% of the FMA peak" compares rates measured over the same minutes,
// beside gemm_bench (the peak again, dnnl_sgemm) and the peers. Each case times calls after a first one.
#include <benchmark/benchmark.h>

#include <memory>
#include <string>

#include "bench_common.hpp"
#include "fma_peak.hpp"

namespace {

using namespace sdpa_bench;

struct TableConfig {
  const char* name;
  Index batch, n, d_k;
  bool causal;
};

double peer_flops(const TableConfig& c) {
  const double rows = static_cast<double>(c.batch * c.n), hk = 8.0 * static_cast<double>(c.d_k);
  const double proj = 2.0 * rows * 512 * hk * 2 + 2.0 * rows * 512 * hk + 2.0 * rows * hk * 512;
  const double n = static_cast<double>(c.n);
  const double pairs = c.causal ? n * (n + 1) / 2 : n * n;
  return proj + 2.0 * static_cast<double>(c.batch) * 8 * pairs * 2 * static_cast<double>(c.d_k);
}

void run(benchmark::State& state, const TableConfig& tc, int threads) {
  Config c = long_config(tc.n, false);
  c.batch = tc.batch;
  c.d_k = c.d_v = tc.d_k;
  Fixture f(c);
  sdpa::AttentionOptions<float> o;
  o.causal = tc.causal;
  o.device = device_for(threads);
  // One call before timing, as the peers are timed after a first run: the module's scratch (kept between
  // calls) and the GEMM workspaces exist from then on, so the figures are a deployed layer's steady state.
  benchmark::DoNotOptimize(f.module(f.x, f.x, f.x, o).data());
  for (auto _ : state) {
    auto y = f.module(f.x, f.x, f.x, o);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = benchmark::Counter(peer_flops(tc), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP"] = peer_flops(tc) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const TableConfig configs[] = {{"demo", 50, 49, 512, false},
                                 {"std", 50, 49, 64, false},
                                 {"long", 1, 4096, 64, false},
                                 {"long_causal", 1, 4096, 64, true},
                                 {"long8k", 1, 8192, 64, false}};
  // The peak first, so that a filtered run can still compute "% of the FMA peak" from its own figures.
  for (int threads : {1, 2}) {
    benchmark::RegisterBenchmark((std::string("fma_peak/") + sdpa_bench::kPeakIsa).c_str(), sdpa_bench::fma_peak)
        ->Threads(threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const TableConfig& c : configs)
    for (int threads : {1, 2}) {
      const std::string name = std::string("table/") + c.name + "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(name.c_str(), [c, threads](benchmark::State& s) { run(s, c, threads); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
