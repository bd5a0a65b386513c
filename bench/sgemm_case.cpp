// The machine's limit for the demo's projection: oneDNN's dnnl_sgemm on the shape of one of its
// projections, C[M, N] = A[M, K] B[N, K]^T with M = 50 * 49 = 2450 rows, K = d_model = 512,
// N = h * d_k = 4096, on 1 and 2 OpenMP threads. sdpa's GFLOP/s are reported as a share of this.
#include "sgemm_case.hpp"

#include <benchmark/benchmark.h>
#include <dnnl.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

// From the OpenMP runtime oneDNN runs on (declared here so that this file needs no -fopenmp).
extern "C" int omp_get_max_threads(void);
extern "C" void omp_set_num_threads(int);

namespace sdpa_bench {

void register_sgemm_cases() {
  constexpr long M = 2450, K = 512, N = 4096;
  for (int threads : {1, 2}) {
    const std::string name = "sgemm/dnnl/M:" + std::to_string(M) + "/K:" + std::to_string(K) +
                             "/N:" + std::to_string(N) + "/threads:" + std::to_string(threads);
    auto* b = benchmark::RegisterBenchmark(name.c_str(), [threads](benchmark::State& state) {
      std::vector<float> a(static_cast<std::size_t>(M * K)), w(static_cast<std::size_t>(N * K)),
          c(static_cast<std::size_t>(M * N));
      unsigned seed = 12345;
      auto next = [&seed]() {
        seed = seed * 1664525u + 1013904223u;
        return static_cast<float>(seed >> 8) / 16777216.0f - 0.5f;
      };
      for (float& x : a) x = next();
      for (float& x : w) x = next();
      const int saved = omp_get_max_threads();
      omp_set_num_threads(threads);
      auto gemm = [&]() {
        const dnnl_status_t st =
            dnnl_sgemm('N', 'T', M, N, K, 1.0f, a.data(), K, w.data(), K, 0.0f, c.data(), N);
        if (st != dnnl_success) {
          std::fprintf(stderr, "dnnl_sgemm failed with status %d\n", static_cast<int>(st));
          std::abort();
        }
      };
      gemm();  // oneDNN's first call generates its kernels: keep it out of the timing
      for (auto _ : state) {
        gemm();
        benchmark::DoNotOptimize(c.data());
        benchmark::ClobberMemory();
      }
      omp_set_num_threads(saved);
      const double flops = 2.0 * M * N * K;
      state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
      state.counters["GFLOP"] = flops / 1e9;
      state.counters["nthreads"] = threads;
    });
    b->UseRealTime()->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
  }
}

}  // namespace sdpa_bench
