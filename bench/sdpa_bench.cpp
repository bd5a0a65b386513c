// sdpa_bench / sdpa_bench_onednn: sdpa's ScaledDotProductAttention on the benchmark configurations, side by
// side with the same module in LibTorch (SDPA_BENCH_WITH_TORCH) and with oneDNN's sgemm as the machine's
// limit (SDPA_BENCH_WITH_SGEMM). Built once against sdpa::sdpa (Eigen products) and once against
// sdpa::onednn (SDPA_USE_ONEDNN: float projections through dnnl_sgemm).
//
// Case names: <config>/<impl>/threads:<t>, impl = sdpa | sdpa_onednn | torch. Counters: FLOPS (the
// module's useful multiply-add FLOPs per real second, see bench_common.hpp), GFLOP per forward, threads, nq.
// Every sdpa / LibTorch pair is checked to agree once, before the LibTorch case is first timed.
//
// Without --benchmark_min_time every case runs for at least 0.5 s (a case whose single forward takes
// longer runs once per repetition). Flags besides Google Benchmark's:
//   --sdpa_max_n=N             longest sequence of the long/causal cases (default 16384)
//   --sdpa_torch_max_n=N       longest sequence for the LibTorch long/causal cases, 1 thread (default 4096:
//                              Debian's LibTorch on the netlib reference BLAS needs over a minute per
//                              forward at 8192; its scores alone are 32 N^2 bytes, 8 GiB at 16384)
//   --sdpa_torch_max_n_2t=N    the same for 2 threads (default 1024: that BLAS is single-threaded, so
//                              LibTorch's 2-thread times barely differ from its 1-thread ones)
//   --sdpa_torch_repetitions=K repetitions of the LibTorch cases (default: --benchmark_repetitions)
//   --sdpa_no_torch            register no LibTorch cases
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "bench_common.hpp"

#ifdef SDPA_BENCH_WITH_TORCH
#include "torch_peer.hpp"
#endif
#ifdef SDPA_BENCH_WITH_SGEMM
#include "sgemm_case.hpp"
#endif

namespace sdpa_bench {
namespace {

#ifdef SDPA_USE_ONEDNN
constexpr const char* kImpl = "sdpa_onednn";
#else
constexpr const char* kImpl = "sdpa";
#endif

struct Options {
  Index max_n = 16384;
  Index torch_max_n = 4096;
  Index torch_max_n_2t = 1024;
  int torch_repetitions = 0;  // 0: as --benchmark_repetitions
  bool torch = true;
};

bool take_flag(const char* arg, const char* name, std::string* value) {
  const std::size_t len = std::strlen(name);
  if (std::strncmp(arg, name, len) != 0) return false;
  if (arg[len] == '\0') {
    *value = "";
    return true;
  }
  if (arg[len] != '=') return false;
  *value = arg + len + 1;
  return true;
}

constexpr const char* kDefaultMinTime = "--benchmark_min_time=0.5";

// Removes sdpa's own flags from argv before Google Benchmark sees it, and adds kDefaultMinTime unless
// --benchmark_min_time is given (argv has room: main passes a copy with a spare slot).
Options parse_options(int* argc, char** argv) {
  Options opt;
  bool has_min_time = false;
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    std::string v;
    const char* a = argv[i];
    if (take_flag(a, "--sdpa_max_n", &v)) {
      opt.max_n = std::atol(v.c_str());
    } else if (take_flag(a, "--sdpa_torch_max_n_2t", &v)) {
      opt.torch_max_n_2t = std::atol(v.c_str());
    } else if (take_flag(a, "--sdpa_torch_max_n", &v)) {
      opt.torch_max_n = std::atol(v.c_str());
    } else if (take_flag(a, "--sdpa_torch_repetitions", &v)) {
      opt.torch_repetitions = std::atoi(v.c_str());
    } else if (take_flag(a, "--sdpa_no_torch", &v)) {
      opt.torch = false;
    } else {
      if (std::strncmp(a, "--benchmark_min_time", 20) == 0) has_min_time = true;
      argv[out++] = argv[i];
    }
  }
  if (!has_min_time) argv[out++] = const_cast<char*>(kDefaultMinTime);
  *argc = out;
  argv[out] = nullptr;
  return opt;
}

// The case being run: one configuration's fixture (and LibTorch peer) at a time, since the cases of a
// configuration are registered next to each other; the long cases' inputs and masks do not pile up.
struct Current {
  std::string name;
  std::shared_ptr<Fixture> fixture;
#ifdef SDPA_BENCH_WITH_TORCH
  std::unique_ptr<TorchPeer> peer;  // borrows the fixture's inputs and copies its weights
#endif
};

Current& current(const Config& c) {
  static Current cur;
  if (cur.name != c.name) {
#ifdef SDPA_BENCH_WITH_TORCH
    cur.peer.reset();
#endif
    cur.fixture.reset();
    cur.fixture = std::make_shared<Fixture>(c);
    cur.name = c.name;
  }
  return cur;
}

void set_counters(benchmark::State& state, const Config& c, int threads) {
  const double flops = useful_flops(c);
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP"] = flops / 1e9;
  state.counters["nthreads"] = threads;
  state.counters["nq"] = static_cast<double>(c.nq);
}

void sdpa_case(benchmark::State& state, const Config& c, int threads) {
  const auto f = current(c).fixture;
  const Eigen::ThreadPoolDevice* device = device_for(threads);
  for (auto _ : state) {
    auto y = f->run(device);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, c, threads);
}

#ifdef SDPA_BENCH_WITH_TORCH
TorchLinearParams params_of(const sdpa::Linear<float>& l) { return {l.weight().data(), l.bias().data()}; }

// Aborts unless sdpa and LibTorch give the same output on this configuration's inputs and weights:
// max |sdpa - torch| <= 1e-4 * max |torch| (and everything finite), so that no case ever times two
// different computations against each other.
void verify(const Fixture& f, TorchPeer& peer) {
  const Tensor3 ref = f.run(device_for(2));
  peer.forward();
  const float* t = peer.output();
  double max_diff = 0, max_torch = 0;
  bool finite = true;
  for (Index i = 0; i < ref.size(); ++i) {
    const double a = ref.data()[i], b = t[i];
    finite = finite && std::isfinite(a) && std::isfinite(b);
    max_diff = std::max(max_diff, std::abs(a - b));
    max_torch = std::max(max_torch, std::abs(b));
  }
  peer.drop_output();
  const double rel = max_diff / std::max(max_torch, 1e-30);
  if (!finite || !(rel <= 1e-4)) {
    std::fprintf(stderr,
                 "sdpa_bench: sdpa and LibTorch disagree on %s: max|sdpa - torch| = %.3g, max|torch| = %.3g, "
                 "relative %.3g > 1e-4%s. Refusing to benchmark different computations.\n",
                 f.cfg.name.c_str(), max_diff, max_torch, rel, finite ? "" : " (non-finite values)");
    std::abort();
  }
  std::fprintf(stderr, "sdpa_bench: %s: sdpa and LibTorch agree (max relative difference %.2e)\n",
               f.cfg.name.c_str(), rel);
}

TorchPeer& torch_peer_for(const Config& c) {
  static std::set<std::string> verified;
  Current& cur = current(c);
  if (!cur.peer) {
    const Fixture& f = *cur.fixture;
    const Module& m = f.module;
    cur.peer = std::make_unique<TorchPeer>(TorchShape{c.batch, c.nq, c.nk, c.d_model, c.d_k, c.d_v, c.h},
                                           params_of(m.fc_q()), params_of(m.fc_k()), params_of(m.fc_v()),
                                           params_of(m.fc_o()));
    cur.peer->set_inputs(f.queries().data(), f.keys().data(), f.values().data(), c.causal);
  }
  if (verified.insert(c.name).second) verify(*cur.fixture, *cur.peer);
  return *cur.peer;
}

void torch_case(benchmark::State& state, const Config& c, int threads) {
  TorchPeer::set_num_threads(threads);
  TorchPeer& peer = torch_peer_for(c);
  for (auto _ : state) {
    peer.forward();
    benchmark::DoNotOptimize(peer.output());
    benchmark::ClobberMemory();
  }
  peer.drop_output();
  set_counters(state, c, threads);
}
#endif

void register_config(const Options& opt, const Config& c, bool with_torch_1t, bool with_torch_2t) {
  (void)opt;
  (void)with_torch_1t;
  (void)with_torch_2t;
  for (int threads : {1, 2}) {
    auto add = [&](const char* impl, void (*fn)(benchmark::State&, const Config&, int), int repetitions) {
      const std::string name = c.name + "/" + impl + "/threads:" + std::to_string(threads);
      auto* b = benchmark::RegisterBenchmark(name.c_str(), [c, threads, fn](benchmark::State& st) {
        fn(st, c, threads);
      });
      b->UseRealTime()->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
      if (repetitions > 0) b->Repetitions(repetitions);
    };
    add(kImpl, &sdpa_case, 0);
#ifdef SDPA_BENCH_WITH_TORCH
    if (opt.torch && (threads == 1 ? with_torch_1t : with_torch_2t)) add("torch", &torch_case, opt.torch_repetitions);
#endif
  }
}

void register_all(const Options& opt) {
#ifdef SDPA_BENCH_WITH_SGEMM
  register_sgemm_cases();
#endif
  register_config(opt, demo_config(), true, true);
  register_config(opt, standard_config(), true, true);
  for (bool causal : {false, true}) {
    for (Index n : long_lengths()) {
      if (n > opt.max_n) continue;
      register_config(opt, long_config(n, causal), n <= opt.torch_max_n, n <= opt.torch_max_n_2t);
    }
  }
  register_config(opt, cross_config(), true, true);
}

}  // namespace
}  // namespace sdpa_bench

int main(int argc, char** argv) {
  using namespace sdpa_bench;
  std::vector<char*> args(argv, argv + argc);
  args.resize(static_cast<std::size_t>(argc) + 2, nullptr);  // room for kDefaultMinTime and the final null
  const Options opt = parse_options(&argc, args.data());
  benchmark::Initialize(&argc, args.data());
  if (benchmark::ReportUnrecognizedArguments(argc, args.data())) return 1;
  benchmark::AddCustomContext("sdpa_impl", kImpl);
  benchmark::AddCustomContext("sdpa_version", std::to_string(SDPA_VERSION_MAJOR) + "." +
                                                  std::to_string(SDPA_VERSION_MINOR) + "." +
                                                  std::to_string(SDPA_VERSION_PATCH));
  benchmark::AddCustomContext("compiler", __VERSION__);
#ifdef __AVX512F__
  benchmark::AddCustomContext("sdpa_isa", "AVX-512 (-march=native)");
#elif defined(__AVX2__)
  benchmark::AddCustomContext("sdpa_isa", "AVX2");
#endif
#ifdef SDPA_BENCH_WITH_TORCH
  benchmark::AddCustomContext("torch", TorchPeer::describe());
#endif
  register_all(opt);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
