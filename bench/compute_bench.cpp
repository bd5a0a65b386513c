// compute_bench: Compute::kBf16 (sdpa/compute.hpp) against kFloat on the same calls, on every bfloat16 path
// this CPU runs, beside the machine's peaks measured in the same run (bench/run.py --suite compute
// adds PyTorch's bf16 SDPA and module from pip and writes bench/results/compute.md):
//   peak/fma/<isa>                 independent float FMA chains (fma_peak.hpp)
//   peak/bf16/avx512_bf16          independent vdpbf16ps chains (64 FLOP per instruction)
//   peak/bf16/amx                  tdpbf16ps on four resident C tiles (16 x 16 x 32 x 2 FLOP each)
//   peak/int8/vpdpbusd, peak/int16/vpdpwssd   independent AVX512_VNNI chains (128 / 64 integer ops per
//                                  instruction: u8 x s8 quadruples, int16 pairs); int8 keys' scores run
//                                  vpdpwssd (simd/vnni.hpp)
//   attention/N:4096/causal:C/compute:P/threads:T   sdpa::attention on (1, 8, 4096, 64) tensors
//   backward/N:4096/compute:P/threads:T   sdpa::attention_backward of the (1, 8, 4096, 64) forward
//   demo/compute:P/threads:T       the module's eval forward on the (50, 49, 512) demo, h 8, d_k 64
//   floor/softmax/N:4096           the (1, 8, 4096, 64) forward's softmax alone, one thread: each of its
//                                  8 x 4096 x 4096 scores through simd::row_max and simd::exp_shifted_sum
//                                  (as SoftmaxRow::fold takes them without lag) on a row that stays in L1;
//                                  the time no product, however fast, takes away from a forward
// P is float (kFloat) or the kBf16 path (emulated, avx512_bf16, amx); FLOPS counts 4 h N^2 d for the
// attention (half of it when causal), 10 h N^2 d for the backward and the demo's projections plus its core.
#include <benchmark/benchmark.h>

#include <sdpa/sdpa.hpp>

#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "fma_peak.hpp"

namespace {

using Index = Eigen::Index;
using T4 = Eigen::Tensor<float, 4, Eigen::RowMajor>;

__attribute__((target("avx512f,avx512bf16"))) float bf16_chains(long iterations) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j) * 1e-3f);
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = (__m512bh)_mm512_set1_epi32(0x33D633D6);  // 1, 1e-7
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
  __m512 sum = acc[0];
  for (int j = 1; j < kChains; ++j) sum = _mm512_add_ps(sum, acc[j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}

__attribute__((target("amx-tile,amx-bf16"))) float amx_chains(long iterations) {
  static const sdpa::amx::TileConfig config{};
  alignas(64) static sdpa::BFloat16 operand[16 * 32];
  alignas(64) static float c[16 * 16];
  for (auto& x : operand) x.bits = 0x3380;  // small: the sums stay finite
  _tile_loadconfig(&config);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0];
}

// Independent chains of vpdpbusd (bytes) or vpdpwssd (words), 16 accumulators.
template <bool Bytes>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int vnni_chains(long iterations) {
  constexpr int kChains = 16;
  __m512i acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_epi32(j);
  const __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x00010001);
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChains; ++j) acc[j] = Bytes ? _mm512_dpbusd_epi32(acc[j], a, b) : _mm512_dpwssd_epi32(acc[j], a, b);
  }
  __m512i sum = acc[0];
  for (int j = 1; j < kChains; ++j) sum = _mm512_add_epi32(sum, acc[j]);
  return _mm512_reduce_add_epi32(sum);
}

template <bool Bytes>
void vnni_peak(benchmark::State& state) {
  constexpr long kIterations = 1 << 16;
  for (auto _ : state) {
    long iterations = kIterations;
    benchmark::DoNotOptimize(iterations);
    benchmark::DoNotOptimize(vnni_chains<Bytes>(iterations));
  }
  // Multiplies and adds per instruction: 64 u8 x s8 products or 32 int16 products, and as many additions.
  const double per_iteration = 16.0 * (Bytes ? 128 : 64);
  state.counters["FLOPS"] = benchmark::Counter(per_iteration * kIterations, benchmark::Counter::kIsIterationInvariantRate);
}

void bf16_peak(benchmark::State& state, bool amx) {
  constexpr long kIterations = 1 << 16;
  for (auto _ : state) {
    long iterations = kIterations;
    benchmark::DoNotOptimize(iterations);
    benchmark::DoNotOptimize(amx ? amx_chains(iterations) : bf16_chains(iterations));
  }
  const double per_iteration = amx ? 4.0 * 16 * 16 * 32 * 2 : 16.0 * 16 * 2 * 2;
  state.counters["FLOPS"] =
      benchmark::Counter(per_iteration * kIterations, benchmark::Counter::kIsIterationInvariantRate);
}

// floor/softmax/N:4096 (see the header comment): rows of 512 scores, as many as the forward folds. Each pass
// takes the exponentials of the last one's output (all finite, at most 1), which costs what scores do.
void softmax_floor(benchmark::State& state) {
  constexpr Index kRow = 512, kRows = Index(8) * 4096 * (4096 / kRow);
  std::vector<float> row(static_cast<std::size_t>(kRow));
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (float& x : row) x = u(gen);
  const sdpa::Isa isa = sdpa::active_isa();
  for (auto _ : state) {
    float total = 0.0f;
    for (Index r = 0; r < kRows; ++r) {
      const float m = sdpa::simd::row_max(isa, row.data(), kRow);
      total += sdpa::simd::exp_shifted_sum(isa, row.data(), kRow, m);
    }
    benchmark::DoNotOptimize(total);
  }
  state.counters["exps"] =
      benchmark::Counter(static_cast<double>(kRow * kRows), benchmark::Counter::kIsIterationInvariantRate);
}

// Sets the compute type and path a case runs ("float" = kFloat); false when this CPU lacks the path.
bool choose(const std::string& path, sdpa::Compute& compute) {
  if (path == "float") {
    compute = sdpa::Compute::kFloat;
    return true;
  }
  compute = sdpa::Compute::kBf16;
  try {
    sdpa::set_bf16_compute_path(path);
  } catch (const std::invalid_argument&) {
    return false;
  }
  return true;
}

void attention_case(benchmark::State& state, const std::string& path, bool causal, int threads) {
  constexpr Index kHeads = 8, kN = 4096, kD = 64;
  sdpa::AttentionOptions<float> o;
  if (!choose(path, o.compute)) {
    state.SkipWithError("this CPU does not run the path");
    return;
  }
  T4 q(1, kHeads, kN, kD), k(1, kHeads, kN, kD), v(1, kHeads, kN, kD);
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (T4* t : {&q, &k, &v})
    for (Index i = 0; i < t->size(); ++i) t->data()[i] = u(gen);
  o.causal = causal;
  o.device = sdpa_bench::device_for(threads);
  T4 out = sdpa::attention(q, k, v, o);
  for (auto _ : state) {
    out = sdpa::attention(q, k, v, o);
    benchmark::DoNotOptimize(out.data());
  }
  const double flops = 4.0 * kHeads * static_cast<double>(kN) * kN * kD * (causal ? 0.5 : 1.0);
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

void backward_case(benchmark::State& state, const std::string& path, int threads) {
  constexpr Index kHeads = 8, kN = 4096, kD = 64;
  sdpa::AttentionOptions<float> o;
  if (!choose(path, o.compute)) {
    state.SkipWithError("this CPU does not run the path");
    return;
  }
  T4 q(1, kHeads, kN, kD), k(1, kHeads, kN, kD), v(1, kHeads, kN, kD), d_out(1, kHeads, kN, kD);
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (T4* t : {&q, &k, &v, &d_out})
    for (Index i = 0; i < t->size(); ++i) t->data()[i] = u(gen);
  o.device = sdpa_bench::device_for(threads);
  sdpa::AttentionState<float> saved;
  sdpa::attention(q, k, v, o, saved);
  for (auto _ : state) {
    sdpa::AttentionGradients<float> g = sdpa::attention_backward(d_out, saved);
    benchmark::DoNotOptimize(g.q.data());
  }
  // The backward's products: the scores again, dP, dV, dQ, dK (5 of 2 h N^2 d each).
  const double flops = 10.0 * kHeads * static_cast<double>(kN) * kN * kD;
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

void demo_case(benchmark::State& state, const std::string& path, int threads) {
  constexpr Index kBatch = 50, kN = 49, kModel = 512, kHeads = 8, kD = 64;
  sdpa::Compute compute;
  if (!choose(path, compute)) {
    state.SkipWithError("this CPU does not run the path");
    return;
  }
  sdpa::ScaledDotProductAttention<float> m(kModel, kD, kD, kHeads);
  m.eval();
  m.set_compute(compute);
  sdpa_bench::Tensor3 x(kBatch, kN, kModel);
  std::mt19937 gen(2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = nd(gen);
  const Eigen::ThreadPoolDevice* device = sdpa_bench::device_for(threads);
  sdpa_bench::Tensor3 y = m.forward(x, x, x, nullptr, nullptr, device);
  for (auto _ : state) {
    y = m.forward(x, x, x, nullptr, nullptr, device);
    benchmark::DoNotOptimize(y.data());
  }
  const double rows = static_cast<double>(kBatch * kN);
  const double flops = 2.0 * rows * kModel * (4.0 * kHeads * kD) + 4.0 * kBatch * kHeads * static_cast<double>(kN) * kN * kD;
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::RegisterBenchmark((std::string("peak/fma/") + sdpa_bench::kPeakIsa).c_str(), sdpa_bench::fma_peak)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  if (sdpa::best_bf16_path() >= sdpa::Bf16Path::kAvx512Bf16)
    benchmark::RegisterBenchmark("peak/bf16/avx512_bf16", [](benchmark::State& s) { bf16_peak(s, false); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  if (sdpa::best_bf16_path() >= sdpa::Bf16Path::kAmx)
    benchmark::RegisterBenchmark("peak/bf16/amx", [](benchmark::State& s) { bf16_peak(s, true); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  if (sdpa::cpu_features().avx512vnni) {
    benchmark::RegisterBenchmark("peak/int8/vpdpbusd", vnni_peak<true>)->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("peak/int16/vpdpwssd", vnni_peak<false>)->UseRealTime()->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("floor/softmax/N:4096", softmax_floor)->UseRealTime()->Unit(benchmark::kMillisecond);
  for (const std::string path : {"float", "emulated", "avx512_bf16", "amx"})
    for (int threads : {1, 2}) {
      for (bool causal : {false, true}) {
        const std::string name = "attention/N:4096/causal:" + std::to_string(causal) + "/compute:" + path +
                                 "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), [path, causal, threads](benchmark::State& s) {
          attention_case(s, path, causal, threads);
        })->UseRealTime()->Unit(benchmark::kMillisecond);
      }
      const std::string backward = "backward/N:4096/compute:" + path + "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(backward.c_str(), [path, threads](benchmark::State& s) {
        backward_case(s, path, threads);
      })->UseRealTime()->Unit(benchmark::kMillisecond);
      const std::string name = "demo/compute:" + path + "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(name.c_str(), [path, threads](benchmark::State& s) { demo_case(s, path, threads); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
