// core_bench: the tiled attention core alone (sdpa::kernels::tiled_attention), without the projections,
// on q, k and v laid out as the module's fused projection leaves them (one row of 3 * h * d per token),
// beside the FMA peak measured in the same run. d = 64, h = 8, float, no mask:
//   core/B:1/N:4096 (one long sequence: four query groups of 1024 per head) and core/B:4/N:1024 (one
//   group per (batch, head)), 1 and 2 threads; GFLOP/s over 4 * B * h * N^2 * d.
// It isolates what the module's end-to-end figures mix with the projections: the tile products, the
// online softmax and the work split over the threads.
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "fma_peak.hpp"
#include "sdpa/kernels/tiled.hpp"

namespace {

using Index = Eigen::Index;

void core_case(benchmark::State& state, Index batch, Index n, int threads) {
  constexpr Index kHeads = 8, kD = 64, kRow = 3 * kHeads * kD;
  std::vector<float> qkv(static_cast<std::size_t>(batch * n * kRow)), out(static_cast<std::size_t>(batch * n * kHeads * kD));
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : qkv) x = u(gen);
  sdpa::kernels::AttentionProblem<float> p;
  p.batch = batch;
  p.heads = kHeads;
  p.nq = p.nk = n;
  p.d_k = p.d_v = kD;
  p.scale = 0.125f;
  p.q = {qkv.data(), n * kRow, kRow, kD};
  p.k = {qkv.data() + kHeads * kD, n * kRow, kRow, kD};
  p.v = {qkv.data() + 2 * kHeads * kD, n * kRow, kRow, kD};
  p.out = {out.data(), n * kHeads * kD, kHeads * kD, kD};
  const Eigen::ThreadPoolDevice* device = sdpa_bench::device_for(threads);
  sdpa::kernels::tiled_attention(p, device);  // a first call, as the other benchmarks time
  for (auto _ : state) {
    sdpa::kernels::tiled_attention(p, device);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double flops = 4.0 * static_cast<double>(batch * kHeads) * static_cast<double>(n) * static_cast<double>(n) * kD;
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  for (int threads : {1, 2}) {
    benchmark::RegisterBenchmark((std::string("fma_peak/") + sdpa_bench::kPeakIsa).c_str(), sdpa_bench::fma_peak)
        ->Threads(threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  const Index shapes[][2] = {{1, 4096}, {4, 1024}};
  for (const auto& s : shapes)
    for (int threads : {1, 2}) {
      const std::string name = "core/B:" + std::to_string(s[0]) + "/N:" + std::to_string(s[1]) +
                               "/threads:" + std::to_string(threads);
      const Index batch = s[0], n = s[1];
      benchmark::RegisterBenchmark(name.c_str(), [batch, n, threads](benchmark::State& st) {
        core_case(st, batch, n, threads);
      })->UseRealTime()->Unit(benchmark::kMillisecond);
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
