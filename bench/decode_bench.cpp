// decode_bench: autoregressive decoding with a KVCache (d_model 512, h 8, d_k = d_v = 64, float, eval):
//   decode/step/cache:<n>/batch:<b>/threads:<t>   one step of one token per sequence against n cached
//                                                 entries (the cache is truncated back after each step)
//   decode/storage/kv:<s>/weights:<w>/cache:<n>/batch:<b>/threads:1
//                                                 the same step with the cache stored as s (f32, bf16, f16,
//                                                 int8) and the weights as w (f32, bf16): sdpa/storage.hpp
//   decode/read/storage/kv:<s>/weights:<w>/cache:<n>/batch:<b>/bytes:<B>/threads:1
//                                                 the read bound of that step: a sum over its B bytes
//   decode/limit/widen_fma/kv:<s>/cache:<n>/threads:1
//                                                 the arithmetic of that step's attention over its n cached
//                                                 keys and values (2 x n x 512 entries) at the streaming
//                                                 widen + FMA rate, entries in L1 (widen_floor.hpp): a lower
//                                                 bound on its compute time (AVX2 + FMA machines)
//   decode/projections/rows:<r>/weights:<w>/threads:1
//                                                 a step's four projections alone (kernels::project_few_rows:
//                                                 four 512 x 512 weights stored as w, f32 or bf16, against r
//                                                 input rows, one per sequence of a batch)
//   decode/recompute/N:<n>/threads:1              forward(x, x, x, {causal}) over all n + 1 tokens: what a
//                                                 step replaces
//   decode/read/bytes:<B>/threads:<t>             a STREAM-like sum over B bytes, B = what the batch-1 step
//                                                 at that cache reads (its keys and values + the four weight
//                                                 matrices): the machine's read-bandwidth bound, same run
//                                                 (on 2 threads each sums one half)
//   decode/torch/cache:<n>/batch:1/threads:1      the same step as Hugging Face's loop in LibTorch ops (cat of
//                                                 past keys and values, attention, fc_o), same weights
//   decode/generate/N:4096/threads:1              4096 tokens one by one from an empty cache (one iteration)
//   decode_bench --peak_rss_generate N            generates N tokens, prints {"N", "vm_hwm_mib",
//                                                 "cache_mib", "weights_mib"} as JSON (fresh process)
//   decode_bench --storage_error                  a 256-token decode after a 64-token prompt with each narrow
//                                                 cache against the float cache, on the benchmark's module
//                                                 and on peaked attention (its queries' weights x 8, x 32): the
//                                                 relative max-norm error of the outputs and the bytes, JSON
// Counters: bytes (what a step reads), GBps (those bytes per second).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "widen_floor.hpp"

#ifdef SDPA_BENCH_WITH_TORCH
#include "torch_peer.hpp"
#endif

namespace sdpa_bench {
namespace {

using Cache = sdpa::KVCache<float>;

// The module and tokens every case uses (PyTorch's default init, deterministic inputs); module_bf16 is the
// same module with its weights stored as bfloat16.
struct Decoding {
  Config cfg = long_config(1, false);
  Module module{512, 64, 64, 8, 0.0f};
  Module module_bf16{512, 64, 64, 8, 0.0f};
  Decoding() {
    module.init_weights(sdpa::init::PyTorchDefaultPolicy{});
    module.eval();
    module_bf16 = module;
    module_bf16.set_weight_storage(sdpa::Storage::kBFloat16);
  }
  Tensor3 tokens(Index batch, Index n, std::uint64_t stream) const {
    Tensor3 x(batch, n, 512);
    sdpa::Philox gen(0xdec0de, stream);
    sdpa::init::Uniform{-1.0, 1.0}(x, gen);
    return x;
  }
  // Bytes a batch-1 step reads: the cache's keys and values for n entries, and the four weight matrices.
  static double step_bytes(Index n, Index batch) {
    return 4.0 * (static_cast<double>(batch) * 2.0 * static_cast<double>(n) * 512.0 + 4.0 * 512.0 * 512.0);
  }
  // The same with the cache stored as kv and the weights as w (int8: one float scale per token and head).
  static double step_bytes(Index n, Index batch, sdpa::Storage kv, sdpa::Storage w) {
    const double entries = static_cast<double>(batch) * static_cast<double>(n);
    double cache = entries * 2.0 * 512.0 * static_cast<double>(sdpa::storage_bytes(kv));
    if (kv == sdpa::Storage::kInt8) cache += entries * 2.0 * 8.0 * 4.0;
    return cache + 4.0 * 512.0 * 512.0 * static_cast<double>(sdpa::storage_bytes(w));
  }
};

const Decoding& decoding() {
  static const Decoding d;
  return d;
}

void step_case(benchmark::State& state, Index n, Index batch, int threads, sdpa::Storage kv = sdpa::Storage::kFloat32,
               sdpa::Storage weights = sdpa::Storage::kFloat32) {
  const Decoding& d = decoding();
  const Module& module = weights == sdpa::Storage::kFloat32 ? d.module : d.module_bf16;
  Cache cache(module, batch, n + 1, kv);
  module.append(d.tokens(batch, n, 1), d.tokens(batch, n, 2), cache);
  const Tensor3 token = d.tokens(batch, 1, 3);
  Tensor3 out(batch, 1, 512);
  sdpa::AttentionOptions<float> o;
  o.device = device_for(threads);
  Eigen::TensorMap<Tensor3> out_map(out.data(), batch, 1, 512);
  for (auto _ : state) {
    module.step(token, cache, o, out_map);
    cache.truncate(n);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double bytes = Decoding::step_bytes(n, batch, kv, weights);
  state.counters["bytes"] = bytes;
  state.counters["GBps"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["nthreads"] = threads;
}

void widen_fma_case(benchmark::State& state, sdpa::Storage storage, Index n) {
  const std::vector<std::uint8_t> buffer = widen_floor_buffer();
  // Keys and values, in whole groups of every storage's loop (bfloat16's, 128 entries, is the largest).
  const long long entries = 2LL * n * 512 / 128 * 128;
  for (auto _ : state) {
    float sum = widen_fma_avx2(storage, buffer.data(), buffer.size(), entries);
    benchmark::DoNotOptimize(sum);
  }
  state.counters["entries"] = static_cast<double>(entries);
}

void projections_case(benchmark::State& state, Index rows, sdpa::Storage weights) {
  constexpr Index kIn = 512, kOut = 512, kTargets = 4;
  std::vector<float> w(static_cast<std::size_t>(kTargets * kOut * kIn)), x(static_cast<std::size_t>(rows * kIn));
  std::vector<float> bias(static_cast<std::size_t>(kOut), 0.0f), y(static_cast<std::size_t>(kTargets * rows * kOut));
  std::vector<sdpa::BFloat16> wb(w.size());
  sdpa::Philox rng(7);
  for (float& v : w) v = static_cast<float>(sdpa::uniform_double(rng)) - 0.5f;
  for (float& v : x) v = static_cast<float>(sdpa::uniform_double(rng)) - 0.5f;
  for (std::size_t i = 0; i < w.size(); ++i) wb[i] = sdpa::to_bfloat16(w[i]);
  std::vector<sdpa::kernels::ProjectionTarget<float>> targets(static_cast<std::size_t>(kTargets));
  for (Index t = 0; t < kTargets; ++t) {
    auto& tg = targets[static_cast<std::size_t>(t)];
    const std::size_t offset = static_cast<std::size_t>(t * kOut * kIn);
    tg.weight = weights == sdpa::Storage::kFloat32 ? w.data() + offset : nullptr;
    tg.bias = bias.data();
    tg.out = kOut;
    tg.y = y.data() + t * rows * kOut;
    tg.ldy = kOut;
    if (weights != sdpa::Storage::kFloat32) {
      tg.weight_storage = weights;
      tg.weight_stored = wb.data() + offset;
    }
  }
  for (auto _ : state) {
    sdpa::kernels::project_few_rows(x.data(), rows, kIn, kIn, targets.data(), targets.size(), nullptr);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
}

void recompute_case(benchmark::State& state, Index n) {
  const Decoding& d = decoding();
  const Tensor3 x = d.tokens(1, n, 4);
  sdpa::AttentionOptions<float> o;
  o.causal = true;
  for (auto _ : state) {
    auto y = d.module(x, x, x, o);
    benchmark::DoNotOptimize(y.data());
  }
}

void read_case(benchmark::State& state, double bytes, int threads) {
  std::vector<float> buf(static_cast<std::size_t>(bytes / 4));
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i % 7);
  const Eigen::ThreadPoolDevice* device = device_for(threads);
  const Index n = static_cast<Index>(buf.size()), parts = threads;
  std::vector<float> sums(static_cast<std::size_t>(parts));
  for (auto _ : state) {
    // Eigen's vectorised sum (several packet accumulators), so that the additions keep up with the loads; on
    // two threads each sums one half.
    sdpa::parallel_for(device, parts, 1, [&](Index p0, Index p1) {
      for (Index part = p0; part < p1; ++part) {
        const Index lo = n * part / parts, hi = n * (part + 1) / parts;
        sums[static_cast<std::size_t>(part)] = Eigen::Map<const Eigen::ArrayXf>(buf.data() + lo, hi - lo).sum();
      }
    });
    benchmark::DoNotOptimize(sums.data());
    benchmark::ClobberMemory();
  }
  state.counters["bytes"] = bytes;
  state.counters["GBps"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void generate_case(benchmark::State& state, Index n) {
  const Decoding& d = decoding();
  const Tensor3 tokens = d.tokens(1, n, 5);
  for (auto _ : state) {
    Cache cache(d.module, 1);
    Tensor3 out(1, 1, 512);
    Eigen::TensorMap<Tensor3> out_map(out.data(), 1, 1, 512);
    for (Index t = 0; t < n; ++t) {
      const Eigen::TensorMap<const Tensor3> token(tokens.data() + t * 512, 1, 1, 512);
      d.module.step(token, cache, {}, out_map);
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}

#ifdef SDPA_BENCH_WITH_TORCH
void torch_case(benchmark::State& state, Index n) {
  const Decoding& d = decoding();
  TorchPeer::set_num_threads(1);
  auto p = [](const sdpa::Linear<float>& l) { return TorchLinearParams{l.weight().data(), l.bias().data()}; };
  TorchDecoder torch(TorchShape{1, 1, n, 512, 64, 64, 8}, p(d.module.fc_q()), p(d.module.fc_k()), p(d.module.fc_v()),
                     p(d.module.fc_o()));
  const Tensor3 keys = d.tokens(1, n, 1), token = d.tokens(1, 1, 3);
  torch.set_past(keys.data(), n);
  // The two agree on the step's output (past = keys of the same prefix as sdpa's cache, values too).
  Cache cache(d.module, 1, n + 1);
  d.module.append(keys, keys, cache);
  const Tensor3 mine = d.module.step(token, cache);
  torch.step(token.data());
  float err = 0, ref = 0;
  for (Index i = 0; i < 512; ++i) {
    err = std::max(err, std::abs(mine.data()[i] - torch.output()[i]));
    ref = std::max(ref, std::abs(mine.data()[i]));
  }
  if (!(err <= 1e-4f * std::max(ref, 1e-6f))) {
    state.SkipWithError(("sdpa and LibTorch disagree: " + std::to_string(err)).c_str());
    return;
  }
  for (auto _ : state) {
    torch.step(token.data());
    benchmark::DoNotOptimize(torch.output());
  }
}
#endif

template <typename F>
void add(const std::string& name, F f) {
  benchmark::RegisterBenchmark(name.c_str(), f)->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace
}  // namespace sdpa_bench

// decode_bench --storage_error (see the header).
int storage_error() {
  using namespace sdpa_bench;
  const Decoding& d = decoding();
  for (double q_scale : {1.0, 8.0, 32.0}) {
    Module m = d.module;
    for (Index i = 0; i < m.fc_q().weight().size(); ++i) m.fc_q().weight().data()[i] *= static_cast<float>(q_scale);
    for (sdpa::Storage s : {sdpa::Storage::kBFloat16, sdpa::Storage::kFloat16, sdpa::Storage::kInt8}) {
      Cache f(m, 1, 320), n(m, 1, 320, s);
      const Tensor3 prompt = d.tokens(1, 64, 7), steps = d.tokens(1, 256, 8);
      (void)m.step(prompt, f);
      (void)m.step(prompt, n);
      double err = 0, norm = 0;
      for (Index t = 0; t < 256; ++t) {
        const Eigen::TensorMap<const Tensor3> x(steps.data() + t * 512, 1, 1, 512);
        const Tensor3 a = m.step(x, f), b = m.step(x, n);
        for (Index i = 0; i < 512; ++i) {
          err = std::max(err, static_cast<double>(std::abs(a.data()[i] - b.data()[i])));
          norm = std::max(norm, static_cast<double>(std::abs(a.data()[i])));
        }
      }
      std::printf("{\"storage\": \"%s\", \"q_scale\": %g, \"error\": %.4g, \"bytes\": %zu, \"float_bytes\": %zu}\n",
                  sdpa::storage_name(s), q_scale, err / norm, n.bytes(), f.bytes());
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  using namespace sdpa_bench;
  if (argc == 2 && std::strcmp(argv[1], "--storage_error") == 0) return storage_error();
  if (argc == 3 && std::strcmp(argv[1], "--peak_rss_generate") == 0) {
    const Index n = std::atol(argv[2]);
    const Decoding& d = decoding();
    const Tensor3 tokens = d.tokens(1, n, 5);
    const double before = vm_hwm_mib();
    Cache cache(d.module, 1);
    Tensor3 out(1, 1, 512);
    Eigen::TensorMap<Tensor3> out_map(out.data(), 1, 1, 512);
    for (Index t = 0; t < n; ++t)
      d.module.step(Eigen::TensorMap<const Tensor3>(tokens.data() + t * 512, 1, 1, 512), cache, {}, out_map);
    std::printf("{\"N\": %ld, \"vm_hwm_mib\": %.1f, \"before_mib\": %.1f, \"cache_mib\": %.1f, \"weights_mib\": %.1f, "
                "\"tokens_mib\": %.1f, \"checksum\": %.6g}\n",
                static_cast<long>(n), vm_hwm_mib(), before,
                2.0 * static_cast<double>(cache.capacity()) * 512 * 4 / (1 << 20), 4.0 * 512 * 512 * 4 / (1 << 20),
                static_cast<double>(n) * 512 * 4 / (1 << 20), static_cast<double>(out(0, 0, 0)));
    return 0;
  }
  for (Index n : {Index(128), Index(1024), Index(2048), Index(4095), Index(16383)})
    for (int threads : {1, 2})
      add("decode/step/cache:" + std::to_string(n) + "/batch:1/threads:" + std::to_string(threads),
          [n, threads](benchmark::State& s) { step_case(s, n, 1, threads); });
  for (int threads : {1, 2})
    add("decode/step/cache:2048/batch:8/threads:" + std::to_string(threads),
        [threads](benchmark::State& s) { step_case(s, 2048, 8, threads); });
  add("decode/recompute/N:4096/threads:1", [](benchmark::State& s) { recompute_case(s, 4096); });
  for (Index n : {Index(128), Index(1024), Index(2048), Index(4095), Index(16383)}) {
    const double bytes = Decoding::step_bytes(n, 1);
    for (int threads : {1, 2})
      add("decode/read/cache:" + std::to_string(n) + "/bytes:" + std::to_string(static_cast<long long>(bytes)) +
              "/threads:" + std::to_string(threads),
          [bytes, threads](benchmark::State& s) { read_case(s, bytes, threads); });
  }
  {
    const double bytes = Decoding::step_bytes(2048, 8);  // the batch-8 step's bytes: its floor
    add("decode/read/cache:2048/batch:8/bytes:" + std::to_string(static_cast<long long>(bytes)) + "/threads:1",
        [bytes](benchmark::State& s) { read_case(s, bytes, 1); });
  }
  // Storage types: each step beside the read bound of its own bytes.
  {
    using sdpa::Storage;
    struct Case {
      const char* kv_name;
      Storage kv;
      const char* w_name;
      Storage w;
      Index n, batch;
    };
    const Case cases[] = {{"f32", Storage::kFloat32, "f32", Storage::kFloat32, 4095, 1},
                          {"bf16", Storage::kBFloat16, "f32", Storage::kFloat32, 4095, 1},
                          {"f16", Storage::kFloat16, "f32", Storage::kFloat32, 4095, 1},
                          {"int8", Storage::kInt8, "f32", Storage::kFloat32, 4095, 1},
                          {"bf16", Storage::kBFloat16, "bf16", Storage::kBFloat16, 4095, 1},
                          {"f32", Storage::kFloat32, "f32", Storage::kFloat32, 2048, 1},
                          {"f32", Storage::kFloat32, "f32", Storage::kFloat32, 2048, 8},
                          {"bf16", Storage::kBFloat16, "f32", Storage::kFloat32, 2048, 8},
                          {"bf16", Storage::kBFloat16, "bf16", Storage::kBFloat16, 2048, 8},
                          {"int8", Storage::kInt8, "f32", Storage::kFloat32, 4095, 8},  // issue 49's int8 step
                          {"bf16", Storage::kBFloat16, "f32", Storage::kFloat32, 4095, 8}};
    for (const Case& c : cases) {
      const std::string tag = std::string("kv:") + c.kv_name + "/weights:" + c.w_name + "/cache:" + std::to_string(c.n) +
                              "/batch:" + std::to_string(c.batch);
      add("decode/storage/" + tag + "/threads:1", [c](benchmark::State& s) { step_case(s, c.n, c.batch, 1, c.kv, c.w); });
      const double bytes = Decoding::step_bytes(c.n, c.batch, c.kv, c.w);
      add("decode/read/storage/" + tag + "/bytes:" + std::to_string(static_cast<long long>(bytes)) + "/threads:1",
          [bytes](benchmark::State& s) { read_case(s, bytes, 1); });
    }
    for (const auto& kind : {std::make_pair("f32", Storage::kFloat32), std::make_pair("bf16", Storage::kBFloat16)})
      for (Index rows : {Index(1), Index(2), Index(4), Index(8), Index(16)}) {
        const Storage st = kind.second;
        add("decode/projections/rows:" + std::to_string(rows) + "/weights:" + kind.first + "/threads:1",
            [rows, st](benchmark::State& s) { projections_case(s, rows, st); });
      }
    const sdpa::CpuFeatures& cpu = sdpa::cpu_features();
    if (cpu.avx2 && cpu.fma && cpu.f16c) {
      const std::pair<const char*, Storage> kinds[] = {
          {"f32", Storage::kFloat32}, {"bf16", Storage::kBFloat16}, {"f16", Storage::kFloat16}, {"int8", Storage::kInt8}};
      for (const auto& kind : kinds) {
        const Storage st = kind.second;
        add(std::string("decode/limit/widen_fma/kv:") + kind.first + "/cache:4095/threads:1",
            [st](benchmark::State& s) { widen_fma_case(s, st, 4095); });
      }
    }
  }
#ifdef SDPA_BENCH_WITH_TORCH
  for (Index n : {Index(128), Index(1024), Index(4096)})
    add("decode/torch/cache:" + std::to_string(n) + "/batch:1/threads:1", [n](benchmark::State& s) { torch_case(s, n); });
#endif
  benchmark::RegisterBenchmark("decode/generate/N:4096/threads:1", [](benchmark::State& s) { generate_case(s, 4096); })
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
