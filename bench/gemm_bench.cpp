// sdpa::gemm against the machine: the FMA peak of the ISA this build targets, sdpa::gemm, Eigen's product
// and (with SDPA_BENCH_WITH_SGEMM) oneDNN's dnnl_sgemm on the projection shapes of the demo (fused QKV
// and fc_o at d_model 512) and of the d_k = 64 configuration, plus the attention tiles through the
// packed API, on 1 and 2 threads. Counters: GFLOPs (rate, 2 m n k per iteration) and pct_peak (the same
// rate as a share of this run's fma_peak for that thread count; the peak cases are registered first).
// Run with --benchmark_repetitions=5 --benchmark_report_aggregates_only=true on a quiet machine; besides
// mean/median/stddev every case reports min and max over the repetitions (for GFLOPs the max is the best
// run, the figure least disturbed by other processes on a shared machine).
#include <sdpa/detail/buffer.hpp>
#include <sdpa/gemm/gemm.hpp>

#include "fma_peak.hpp"

#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#define EIGEN_USE_THREADS
#include <unsupported/Eigen/CXX11/Tensor>

#ifdef SDPA_BENCH_WITH_SGEMM
#include <dnnl.h>
// From the OpenMP runtime oneDNN runs on (declared here so that this file needs no -fopenmp).
extern "C" int omp_get_max_threads(void);
extern "C" void omp_set_num_threads(int);
#endif

namespace {

using Index = Eigen::Index;
using sdpa_bench::fma_peak;
using sdpa_bench::g_peak;
using sdpa_bench::kPeakIsa;


const Eigen::ThreadPoolDevice* device_for(int threads) {
  if (threads <= 1) return nullptr;  // the calling thread alone
  static Eigen::ThreadPool pool(2);
  static Eigen::ThreadPoolDevice device(&pool, 2);
  return &device;
}

// Operands live where sdpa keeps its activations: sdpa::detail::Buffer, 64-byte aligned and, from 2 MiB
// on, on transparent huge pages (as the projections' outputs are), for every implementation alike.
using Storage = sdpa::detail::Buffer<float>;

Storage random_matrix(Index rows, Index cols, unsigned seed) {
  Storage m(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < m.size(); ++i) {
    seed = seed * 1664525u + 1013904223u;
    m.data()[i] = static_cast<float>(seed >> 8) / 16777216.0f - 0.5f;
  }
  return m;
}

// Times `run` (one product of 2 m n k FLOPs per call) and sets the counters.
void time_product(benchmark::State& state, double flops, int threads, const std::function<void()>& run) {
  run();  // first-touch of C and any one-time setup stay out of the timing
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    run();
    benchmark::ClobberMemory();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double rate = flops * static_cast<double>(state.iterations()) / seconds;
  state.counters["GFLOPs"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["nthreads"] = threads;
  if (g_peak[threads] > 0) state.counters["pct_peak"] = 100.0 * rate / g_peak[threads];
}

enum class Op { kNT, kNN };

struct Shape {
  const char* name;
  Index m, k, n;
  Op op;
};

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Operands of one shape: a[m, k], b[n, k] (nt) or b[k, n] (nn), c[m, n].
struct Operands {
  Storage a, b, c;
  explicit Operands(const Shape& s)
      : a(random_matrix(s.m, s.k, 1)), b(random_matrix(s.k, s.n, 2)), c(static_cast<std::size_t>(s.m * s.n)) {}
  Index ldb(const Shape& s) const { return s.op == Op::kNT ? s.k : s.n; }
};

// With a Workspace kept across calls, as a layer's projections would (sdpa_<isa>), or with the scratch
// each call allocates (sdpa_<isa>_no_workspace).
void ours(benchmark::State& state, Shape s, int threads, bool keep_workspace) {
  Operands x(s);
  const auto* device = device_for(threads);
  sdpa::gemm::Workspace<float> workspace;
  sdpa::gemm::Workspace<float>* ws = keep_workspace ? &workspace : nullptr;
  time_product(state, 2.0 * s.m * s.n * s.k, threads, [&]() {
    if (s.op == Op::kNT) {
      sdpa::gemm::gemm_nt<float>({s.m, s.n, s.k}, 1.0f, {x.a.data(), s.k}, {x.b.data(), s.k}, 0.0f, {x.c.data(), s.n},
                                 {device, ws});
    } else {
      sdpa::gemm::gemm_nn<float>({s.m, s.n, s.k}, 1.0f, {x.a.data(), s.k}, {x.b.data(), s.n}, 0.0f, {x.c.data(), s.n},
                                 {device, ws});
    }
  });
}

// The attention tiles through the packed API: B packed once outside the loop (a key or value block shared
// by the query blocks of a group); A packed once too (a query block), packed again for every product, or
// read in place (a probability block, used once).
enum class AUse { kPackedOnce, kPackedEachCall, kInPlace };

void ours_packed(benchmark::State& state, Shape s, AUse a_use) {
  Operands x(s);
  sdpa::gemm::PackedA<float> pa;
  sdpa::gemm::PackedB<float> pb;
  if (s.op == Op::kNT) {
    pb.pack_nt(s.n, s.k, x.b.data(), s.k);
  } else {
    pb.pack_nn(s.k, s.n, x.b.data(), s.n);
  }
  pa.pack(s.m, s.k, x.a.data(), s.k);
  time_product(state, 2.0 * s.m * s.n * s.k, 1, [&]() {
    if (a_use == AUse::kInPlace) {
      sdpa::gemm::multiply(s.m, {x.a.data(), s.k}, pb, 1.0f, 0.0f, {x.c.data(), s.n});
      return;
    }
    if (a_use == AUse::kPackedEachCall) pa.pack(s.m, s.k, x.a.data(), s.k);
    sdpa::gemm::multiply(pa, pb, 1.0f, 0.0f, x.c.data(), s.n);
  });
}

// Eigen's product: on the calling thread, or with 2 threads through a tensor contraction on the device.
void eigen(benchmark::State& state, Shape s, int threads) {
  Operands x(s);
  using Stride = Eigen::OuterStride<>;
  const Eigen::Map<const RowMatrix> a(x.a.data(), s.m, s.k);
  const Eigen::Map<const RowMatrix> b(x.b.data(), s.op == Op::kNT ? s.n : s.k, s.op == Op::kNT ? s.k : s.n);
  Eigen::Map<RowMatrix, Eigen::Unaligned, Stride> c(x.c.data(), s.m, s.n, Stride(s.n));
  using Tensor2 = Eigen::TensorMap<Eigen::Tensor<const float, 2, Eigen::RowMajor>>;
  const Tensor2 ta(x.a.data(), s.m, s.k), tb(x.b.data(), b.rows(), b.cols());
  Eigen::TensorMap<Eigen::Tensor<float, 2, Eigen::RowMajor>> tc(x.c.data(), s.m, s.n);
  const Eigen::array<Eigen::IndexPair<int>, 1> dims{Eigen::IndexPair<int>(1, s.op == Op::kNT ? 1 : 0)};
  time_product(state, 2.0 * s.m * s.n * s.k, threads, [&]() {
    if (threads > 1) {
      tc.device(*device_for(threads)) = ta.contract(tb, dims);
    } else if (s.op == Op::kNT) {
      c.noalias() = a * b.transpose();
    } else {
      c.noalias() = a * b;
    }
  });
}

#ifdef SDPA_BENCH_WITH_SGEMM
void dnnl(benchmark::State& state, Shape s, int threads) {
  Operands x(s);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  time_product(state, 2.0 * s.m * s.n * s.k, threads, [&]() {
    const dnnl_status_t st = dnnl_sgemm('N', s.op == Op::kNT ? 'T' : 'N', s.m, s.n, s.k, 1.0f, x.a.data(), s.k,
                                        x.b.data(), x.ldb(s), 0.0f, x.c.data(), s.n);
    if (st != dnnl_success) {
      std::fprintf(stderr, "dnnl_sgemm failed with status %d\n", static_cast<int>(st));
      std::abort();
    }
  });
  omp_set_num_threads(saved);
}
#endif

// Adds min and max to the repetition aggregates (applied to times and counters alike).
benchmark::internal::Benchmark* with_extremes(benchmark::internal::Benchmark* b) {
  return b->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); })
      ->ComputeStatistics("max", [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); });
}

void register_all() {
  for (int threads : {1, 2}) {
    with_extremes(benchmark::RegisterBenchmark((std::string("fma_peak/") + kPeakIsa).c_str(), fma_peak))
        ->Threads(threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  const Shape shapes[] = {
      {"qkv/M:2450/K:512/N:12288", 2450, 512, 12288, Op::kNT},
      {"fc_o/M:2450/K:4096/N:512", 2450, 4096, 512, Op::kNT},
      {"dk64_qkv/M:4096/K:512/N:1536", 4096, 512, 1536, Op::kNT},
      {"dk64_o/M:4096/K:512/N:512", 4096, 512, 512, Op::kNT},
      {"tile_qk/M:128/K:64/N:256", 128, 64, 256, Op::kNT},
      {"tile_pv/M:128/K:256/N:64", 128, 256, 64, Op::kNN},
  };
  const std::string isa = sdpa::cpu_isa();
  for (const Shape& s : shapes) {
    const bool tile = s.m <= 128;
    for (int threads : {1, 2}) {
      if (tile && threads > 1) continue;  // a tile is one worker's unit of work
      const std::string suffix = "/threads:" + std::to_string(threads);
      auto reg = [&](const std::string& impl, auto fn) {
        with_extremes(benchmark::RegisterBenchmark((std::string(s.name) + "/" + impl + suffix).c_str(), fn))
            ->UseRealTime()
            ->Unit(tile ? benchmark::kMicrosecond : benchmark::kMillisecond);
      };
      reg("sdpa_" + isa, [s, threads](benchmark::State& st) { ours(st, s, threads, true); });
      reg("sdpa_" + isa + "_no_workspace", [s, threads](benchmark::State& st) { ours(st, s, threads, false); });
      if (tile) {
        reg("sdpa_" + isa + "_packed", [s](benchmark::State& st) { ours_packed(st, s, AUse::kPackedOnce); });
        reg("sdpa_" + isa + "_packed_pack_a", [s](benchmark::State& st) { ours_packed(st, s, AUse::kPackedEachCall); });
        reg("sdpa_" + isa + "_packed_b_a_in_place", [s](benchmark::State& st) { ours_packed(st, s, AUse::kInPlace); });
      }
      reg("eigen", [s, threads](benchmark::State& st) { eigen(st, s, threads); });
#ifdef SDPA_BENCH_WITH_SGEMM
      reg("dnnl_sgemm", [s, threads](benchmark::State& st) { dnnl(st, s, threads); });
#endif
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
