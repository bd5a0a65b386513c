// ring_bench: ring attention over MPI (sdpa/distributed/ring_attention.hpp) against sdpa::attention in one
// process, for one causal self-attention sequence (batch 1, h 8, d_k = d_v 64, float, 1 thread per rank).
// Run by bench/run.py --suite ring:
//   mpiexec -np 1 ring_bench --benchmark_filter=single ...   the whole sequence in one process
//   mpiexec -np P ring_bench --benchmark_filter=ring ...     the sequence split over P ranks
//   mpiexec -np P ring_bench --memory ring|single N         peak RSS (VmHWM) of one call, per rank, as JSON
// Every rank runs the same fixed schedule (Iterations(1), the repetitions the command gives), so that the
// collectives match; a ring run's time is the slowest rank's (MPI_MAX), and its counters are the ranks'
// largest time waiting on MPI (wait_s), the messages one rank sent and their size. Only rank 0 reports.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <sdpa/sdpa.hpp>
#include <sdpa/distributed/ring_attention.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

using Index = Eigen::Index;
using T4 = sdpa::Tensor4<float>;
constexpr Index kHeads = 8, kDim = 64;
Index g_block_rows = 0;  // --block_rows=N: RingOptions::block_rows (0: the default)

int rank_of() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int ranks_of() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

// This rank's rows of q, k, v (the whole sequence when ranks == 1), drawn row by row from the global
// position so that every split holds the same values.
void fill_rows(T4& t, sdpa::RingLayout layout, int rank, int ranks, unsigned salt) {
  const Index n = t.dimension(2);
  for (Index h = 0; h < t.dimension(1); ++h)
    for (Index i = 0; i < n; ++i) {
      const Index g = sdpa::ring_position(layout, rank, ranks, n, i);
      std::mt19937 gen(static_cast<unsigned>(g * 131 + h * 7 + salt));
      std::normal_distribution<float> normal;
      float* row = t.data() + (h * n + i) * kDim;
      for (Index d = 0; d < kDim; ++d) row[d] = normal(gen);
    }
}

long vm_hwm_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

void single(benchmark::State& state) {
  const Index n = state.range(0);
  T4 q(1, kHeads, n, kDim), k(1, kHeads, n, kDim), v(1, kHeads, n, kDim);
  fill_rows(q, sdpa::RingLayout::kContiguous, 0, 1, 1);
  fill_rows(k, sdpa::RingLayout::kContiguous, 0, 1, 2);
  fill_rows(v, sdpa::RingLayout::kContiguous, 0, 1, 3);
  sdpa::AttentionOptions<float> o;
  o.causal = true;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    T4 out = sdpa::attention(q, k, v, o);
    benchmark::DoNotOptimize(out.data());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

void ring(benchmark::State& state, sdpa::RingLayout layout) {
  const int rank = rank_of(), ranks = ranks_of();
  const Index n = state.range(0) / ranks;
  T4 q(1, kHeads, n, kDim), k(1, kHeads, n, kDim), v(1, kHeads, n, kDim);
  fill_rows(q, layout, rank, ranks, 1);
  fill_rows(k, layout, rank, ranks, 2);
  fill_rows(v, layout, rank, ranks, 3);
  sdpa::AttentionOptions<float> o;
  o.causal = true;
  sdpa::RingOptions ro;
  ro.layout = layout;
  ro.block_rows = g_block_rows;
  sdpa::RingStats stats;
  ro.stats = &stats;
  double wait = 0;
  for (auto _ : state) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    T4 out = sdpa::ring_attention(q, k, v, o, MPI_COMM_WORLD, ro);
    benchmark::DoNotOptimize(out.data());
    double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), slowest = 0, waited = 0;
    MPI_Allreduce(&took, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&stats.wait_seconds, &waited, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    wait = waited;
    state.SetIterationTime(slowest);
  }
  state.counters["wait_s"] = wait;
  state.counters["messages"] = static_cast<double>(stats.messages);
  state.counters["message_bytes"] = stats.messages > 0 ? static_cast<double>(stats.bytes / stats.messages) : 0.0;
  state.counters["ranks"] = ranks;
}

// One call of the long configuration: peak RSS per rank, printed by rank 0 as JSON.
int memory(const std::string& mode, Index whole) {
  const int rank = rank_of(), ranks = ranks_of();
  sdpa::AttentionOptions<float> o;
  o.causal = true;
  const long before = vm_hwm_kib();
  if (mode == "single") {
    T4 q(1, kHeads, whole, kDim), k(1, kHeads, whole, kDim), v(1, kHeads, whole, kDim);
    fill_rows(q, sdpa::RingLayout::kContiguous, 0, 1, 1);
    fill_rows(k, sdpa::RingLayout::kContiguous, 0, 1, 2);
    fill_rows(v, sdpa::RingLayout::kContiguous, 0, 1, 3);
    T4 out = sdpa::attention(q, k, v, o);
    benchmark::DoNotOptimize(out.data());
  } else {
    const Index n = whole / ranks;
    T4 q(1, kHeads, n, kDim), k(1, kHeads, n, kDim), v(1, kHeads, n, kDim);
    fill_rows(q, sdpa::RingLayout::kZigZag, rank, ranks, 1);
    fill_rows(k, sdpa::RingLayout::kZigZag, rank, ranks, 2);
    fill_rows(v, sdpa::RingLayout::kZigZag, rank, ranks, 3);
    sdpa::RingOptions ro;
    ro.layout = sdpa::RingLayout::kZigZag;
    T4 out = sdpa::ring_attention(q, k, v, o, MPI_COMM_WORLD, ro);
    benchmark::DoNotOptimize(out.data());
  }
  long peak = vm_hwm_kib();
  std::vector<long> all(static_cast<std::size_t>(ranks));
  MPI_Gather(&peak, 1, MPI_LONG, all.data(), 1, MPI_LONG, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("{\"mode\": \"%s\", \"tokens\": %ld, \"ranks\": %d, \"before_kib\": %ld, \"vmhwm_kib\": [", mode.c_str(),
                static_cast<long>(whole), ranks, before);
    for (int r = 0; r < ranks; ++r) std::printf("%s%ld", r ? ", " : "", all[static_cast<std::size_t>(r)]);
    std::printf("]}\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (argc >= 4 && std::strcmp(argv[1], "--memory") == 0) {
    const int rc = memory(argv[2], std::stol(argv[3]));
    MPI_Finalize();
    return rc;
  }
  // Rank 0 reports; the others run the same schedule silently.
  std::vector<char*> args(argv, argv + argc);
  for (auto it = args.begin() + 1; it != args.end(); ++it)
    if (std::strncmp(*it, "--block_rows=", 13) == 0) {
      g_block_rows = std::stol(*it + 13);
      args.erase(it);
      break;
    }
  if (rank_of() != 0) {
    args.erase(std::remove_if(args.begin() + 1, args.end(), [](char* a) { return std::strncmp(a, "--benchmark_out", 15) == 0; }),
               args.end());
    if (std::freopen("/dev/null", "w", stdout) == nullptr) return 1;
  }
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  for (Index n : {Index{4096}, Index{16384}}) {
    if (ranks_of() == 1)
      benchmark::RegisterBenchmark("single/causal", single)->Arg(n)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("ring/causal/zigzag", ring, sdpa::RingLayout::kZigZag)
        ->Arg(n)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("ring/causal/contiguous", ring, sdpa::RingLayout::kContiguous)
        ->Arg(n)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
