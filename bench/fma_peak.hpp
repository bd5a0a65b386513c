// The FMA peak of the ISA a benchmark is built for: independent FMA chains and nothing else, registered
// as fma_peak/<isa> by the benchmarks that report "% of the FMA peak", so that the peak is measured in the
// same process and, with --benchmark_enable_random_interleaving, over the same stretch of time as the
// products it is compared with (this shared VM's clock moves by 10% and more from one minute to the next).
#pragma once

#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>

namespace sdpa_bench {

// The best fma_peak rate of this run per thread count, in FLOP/s.
inline double g_peak[3] = {0, 0, 0};

// Independent FMA chains: enough accumulators to cover latency x throughput (4 cycles x 2 pipes = 8 on
// Zen 5; 16 leaves margin) and nothing else in the loop but the counter.
#if defined(__AVX512F__)
inline constexpr int kPeakWidth = 16;
inline constexpr int kPeakChains = 16;
inline float fma_chains(long iterations) {
  __m512 acc[kPeakChains];
  for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j) * 1e-3f);
  const __m512 scale = _mm512_set1_ps(0.9999999f), shift = _mm512_set1_ps(1e-7f);
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], scale, shift);
  }
  __m512 sum = acc[0];
  for (int j = 1; j < kPeakChains; ++j) sum = _mm512_add_ps(sum, acc[j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);  // not _mm512_reduce_add_ps, which GCC 12 reports as reading undefined lanes
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}
inline const char* const kPeakIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr int kPeakWidth = 8;
inline constexpr int kPeakChains = 12;  // of 16 ymm registers, with the two constants
inline float fma_chains(long iterations) {
  __m256 acc[kPeakChains];
  for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm256_set1_ps(static_cast<float>(j) * 1e-3f);
  const __m256 scale = _mm256_set1_ps(0.9999999f), shift = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], scale, shift);
  }
  __m256 sum = acc[0];
  for (int j = 1; j < kPeakChains; ++j) sum = _mm256_add_ps(sum, acc[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}
inline const char* const kPeakIsa = "avx2";
#else
inline constexpr int kPeakWidth = 1;
inline constexpr int kPeakChains = 8;
inline float fma_chains(long iterations) {
  float acc[kPeakChains];
  for (int j = 0; j < kPeakChains; ++j) acc[j] = static_cast<float>(j) * 1e-3f;
  for (long i = 0; i < iterations; ++i) {
    for (int j = 0; j < kPeakChains; ++j) acc[j] = acc[j] * 0.9999999f + 1e-7f;
  }
  float total = 0;
  for (float x : acc) total += x;
  return total;
}
inline const char* const kPeakIsa = "scalar";
#endif

inline void fma_peak(benchmark::State& state) {
  constexpr long kIterations = 1 << 20;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    long iterations = kIterations;
    benchmark::DoNotOptimize(iterations);  // or the compiler hoists the whole loop out of the timing
    benchmark::DoNotOptimize(fma_chains(iterations));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double flops = 2.0 * kPeakWidth * kPeakChains * static_cast<double>(kIterations);
  // Each thread reports its own rate and the framework sums the threads' counters; the peak of t threads
  // is taken as t times thread 0's rate.
  const double rate = flops * static_cast<double>(state.iterations()) / seconds;
  state.counters["GFLOPs"] = rate / 1e9;
  if (state.thread_index() == 0) {
    const int t = std::min(state.threads(), 2);
    g_peak[t] = std::max(g_peak[t], rate * state.threads());
  }
}

}  // namespace sdpa_bench
