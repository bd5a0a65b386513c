// training_bench: the training path (forward with a ForwardState, backward) on the benchmark configurations
// (d_model 512, h 8, float, training mode without dropout), beside PyTorch autograd in LibTorch ops on the
// same module, weights and inputs:
//   train/<config>/forward/threads:<t>            forward(q, k, v, options, state)
//   train/<config>/backward/threads:<t>           backward(grad_output, state) of that forward
//   train/<config>/forward_backward/threads:<t>   both
//   train/<config>/torch/threads:1                LibTorch: forward and backward(grad_output) (autograd)
// configs: demo (50 x 49, d_k 512), long/N:4096 (1 x 4096, d_k 64), causal/N:4096 (the same, causal).
//   training_bench --peak_rss N     one forward + backward at 1 x N (d_k 64), prints {"N", "vm_hwm_mib"}
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "bench_common.hpp"

#ifdef SDPA_BENCH_WITH_TORCH
#include "torch_peer.hpp"
#endif

namespace sdpa_bench {
namespace {

struct TrainingCase {
  Fixture f;
  Tensor3 grad;
  sdpa::AttentionOptions<float> options;
  explicit TrainingCase(const Config& c) : f(c) {
    f.module.set_dropout(0.0f);
    f.module.train();
    grad = Tensor3(c.batch, c.nq, c.d_model);
    sdpa::Philox gen(0x9a4d, 3);
    sdpa::init::Uniform{-1.0, 1.0}(grad, gen);
    options.causal = c.causal;
  }
};

std::unique_ptr<TrainingCase>& current(const Config& c) {
  static std::unique_ptr<TrainingCase> cur;
  static std::string name;
  if (name != c.name) {
    cur.reset();
    cur = std::make_unique<TrainingCase>(c);
    name = c.name;
  }
  return cur;
}

void counters(benchmark::State& state, const Config& c, double factor) {
  // Useful FLOPs: the forward's, and twice them for a backward (dX and dW per product).
  const double flops = useful_flops(c) * factor;
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

void run_case(benchmark::State& state, const Config& c, const std::string& what, int threads) {
  TrainingCase& t = *current(c);
  t.options.device = device_for(threads);
  const Tensor3& x = t.f.x;
  sdpa::ForwardState<float> fs;
  if (what == "backward") (void)t.f.module.forward(x, x, x, t.options, fs);
  for (auto _ : state) {
    if (what == "forward") {
      auto y = t.f.module.forward(x, x, x, t.options, fs);
      benchmark::DoNotOptimize(y.data());
    } else if (what == "backward") {
      auto g = t.f.module.backward(t.grad, fs);
      benchmark::DoNotOptimize(g.queries.data());
    } else {
      sdpa::ForwardState<float> s;
      auto y = t.f.module.forward(x, x, x, t.options, s);
      auto g = t.f.module.backward(t.grad, s);
      benchmark::DoNotOptimize(g.queries.data());
    }
    benchmark::ClobberMemory();
  }
  counters(state, c, what == "forward" ? 1.0 : what == "backward" ? 2.0 : 3.0);
}

#ifdef SDPA_BENCH_WITH_TORCH
void torch_case(benchmark::State& state, const Config& c) {
  TrainingCase& t = *current(c);
  TorchPeer::set_num_threads(1);
  auto p = [](const sdpa::Linear<float>& l) { return TorchLinearParams{l.weight().data(), l.bias().data()}; };
  const sdpa::ScaledDotProductAttention<float>& m = t.f.module;
  TorchTrainer torch(TorchShape{c.batch, c.nq, c.nk, c.d_model, c.d_k, c.d_v, c.h}, p(m.fc_q()), p(m.fc_k()),
                     p(m.fc_v()), p(m.fc_o()));
  torch.set_inputs(t.f.x.data(), t.grad.data(), c.causal);
  // Both compute the same input gradient (queries + keys + values for q = k = v).
  torch.forward_backward();
  t.options.device = nullptr;
  sdpa::ForwardState<float> s;
  (void)t.f.module.forward(t.f.x, t.f.x, t.f.x, t.options, s);
  const auto g = t.f.module.backward(t.grad, s);
  float err = 0, ref = 0;
  for (Index i = 0; i < g.queries.size(); ++i) {
    const float mine = g.queries.data()[i] + g.keys.data()[i] + g.values.data()[i];
    err = std::max(err, std::abs(mine - torch.input_grad()[i]));
    ref = std::max(ref, std::abs(mine));
  }
  if (!(err <= 1e-3f * std::max(ref, 1e-6f))) {
    state.SkipWithError(("sdpa and LibTorch gradients disagree: " + std::to_string(err / ref)).c_str());
    return;
  }
  for (auto _ : state) torch.forward_backward();
  counters(state, c, 3.0);
}
#endif

}  // namespace
}  // namespace sdpa_bench

int main(int argc, char** argv) {
  using namespace sdpa_bench;
  if (argc == 3 && std::strcmp(argv[1], "--peak_rss") == 0) {
    const Index n = std::atol(argv[2]);
    TrainingCase t(long_config(n, false));
    const double before = vm_hwm_mib();
    sdpa::ForwardState<float> s;
    auto y = t.f.module.forward(t.f.x, t.f.x, t.f.x, t.options, s);
    auto g = t.f.module.backward(t.grad, s);
    std::printf("{\"N\": %ld, \"vm_hwm_mib\": %.1f, \"before_mib\": %.1f, \"checksum\": %.6g}\n", static_cast<long>(n),
                vm_hwm_mib(), before, static_cast<double>(y(0, 0, 0) + g.queries(0, 0, 0)));
    return 0;
  }
  const Config configs[] = {demo_config(), long_config(4096, false), long_config(4096, true)};
  for (const Config& c : configs) {
    for (int threads : {1, 2})
      for (const char* what : {"forward", "backward", "forward_backward"}) {
        const std::string name = "train/" + c.name + "/" + what + "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), [c, what, threads](benchmark::State& s) { run_case(s, c, what, threads); })
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
#ifdef SDPA_BENCH_WITH_TORCH
    const std::string name = "train/" + c.name + "/torch/threads:1";
    benchmark::RegisterBenchmark(name.c_str(), [c](benchmark::State& s) { torch_case(s, c); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
#endif
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
