// The FMA peak of the instruction-set path sdpa runs (sdpa::cpu_isa()): independent FMA chains and nothing else, registered
// as fma_peak/<isa> by the benchmarks that report "% of the FMA peak", so that the peak is measured in the
// same process and, with --benchmark_enable_random_interleaving, over the same stretch of time as the
// products it is compared with (this shared VM's clock moves by 10% and more from one minute to the next).
#pragma once

#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <sdpa/cpu.hpp>

#include <algorithm>
#include <chrono>

namespace sdpa_bench {

// The best fma_peak rate of this run per thread count, in FLOP/s.
inline double g_peak[3] = {0, 0, 0};

// Independent FMA chains: enough accumulators to cover latency x throughput (4 cycles x 2 pipes = 8 on
// Zen; 16 leaves margin) and nothing else in the loop but the counter, for the path sdpa runs now
// (sdpa::cpu_isa(): SDPA_ISA=avx2 measures the AVX2 peak on an AVX-512 machine), each compiled through a
// target attribute like sdpa's own kernels.
__attribute__((target("avx512f"))) inline float fma_chains_avx512(long iterations) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j) * 1e-3f);
  const __m512 scale = _mm512_set1_ps(0.9999999f), shift = _mm512_set1_ps(1e-7f);
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], scale, shift);
  }
  __m512 sum = acc[0];
  for (int j = 1; j < kChains; ++j) sum = _mm512_add_ps(sum, acc[j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);  // not _mm512_reduce_add_ps, which GCC 12 reports as reading undefined lanes
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}

__attribute__((target("avx2,fma"))) inline float fma_chains_avx2(long iterations) {
  constexpr int kChains = 12;  // of 16 ymm registers, with the two constants
  __m256 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm256_set1_ps(static_cast<float>(j) * 1e-3f);
  const __m256 scale = _mm256_set1_ps(0.9999999f), shift = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], scale, shift);
  }
  __m256 sum = acc[0];
  for (int j = 1; j < kChains; ++j) sum = _mm256_add_ps(sum, acc[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}

inline float fma_chains_scalar(long iterations) {
  constexpr int kChains = 8;
  float acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = static_cast<float>(j) * 1e-3f;
  for (long i = 0; i < iterations; ++i) {
    for (int j = 0; j < kChains; ++j) acc[j] = acc[j] * 0.9999999f + 1e-7f;
  }
  float total = 0;
  for (float x : acc) total += x;
  return total;
}

// The path's FLOPs per iteration of its chains (2 per lane per chain) and its name in fma_peak/<isa>.
inline double chain_flops() {
  const sdpa::Isa isa = sdpa::active_isa();
  return isa == sdpa::Isa::kAvx512 ? 2.0 * 16 * 16 : isa == sdpa::Isa::kAvx2 ? 2.0 * 8 * 12 : 2.0 * 8;
}
inline float fma_chains(long iterations) {
  const sdpa::Isa isa = sdpa::active_isa();
  if (isa == sdpa::Isa::kAvx512) return fma_chains_avx512(iterations);
  if (isa == sdpa::Isa::kAvx2) return fma_chains_avx2(iterations);
  return fma_chains_scalar(iterations);
}
inline const char* const kPeakIsa = sdpa::cpu_isa();

inline void fma_peak(benchmark::State& state) {
  constexpr long kIterations = 1 << 20;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    long iterations = kIterations;
    benchmark::DoNotOptimize(iterations);  // or the compiler hoists the whole loop out of the timing
    benchmark::DoNotOptimize(fma_chains(iterations));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double flops = chain_flops() * static_cast<double>(kIterations);
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
