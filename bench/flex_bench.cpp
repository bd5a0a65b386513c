// flex_bench: programmable attention (sdpa/flex.hpp) against the fixed options and separate calls that do
// the same work, on sdpa::attention over (1, 8, N, 64) float tensors (d_model 512's heads), 1 thread and 2
// (bench/run.py --suite flex adds PyTorch's flex_attention from pip and writes bench/results/flex.md):
//   flex/causal/<how>/N:8192/<pass>/threads:T       how: fixed (options.causal), builtin (flex::causal with
//                                                   its analytic plan), lambda (a generic lambda with the plan
//                                                   block_mask_from builds from it); pass: fwd, bwd (the
//                                                   backward alone, from a saved state)
//   flex/document/<how>/N:8192/fwd/threads:T        8 documents of 1024 in one sequence: builtin
//                                                   (document & causal, analytic plan), separate (8 causal
//                                                   calls of 1024), dense_causal (causal over all 8192)
//   flex/t5/<how>/N:4096/<pass>/threads:T           T5 buckets (32, max distance 128): score (flex::t5_buckets),
//                                                   dense_bias (the same values as a (1, 8, N, N) bias tensor)
//   flex/plan/<mask>/N:32768/threads:T              block_mask_from over a generic lambda (causal; document of
//                                                   1024 & causal), beside flex/plan_forward/<mask>/N:32768:
//                                                   one forward with that plan
//   flex/peer/<case>/N:4096/threads:T               the cases bench/peers/flex_peer.py runs in PyTorch:
//                                                   causal, document (4 of 1024), sliding (causal window 256),
//                                                   prefix_lm (prefix 1024), t5 (bidirectional, no mask)
//   flex/tree/<how>/N:4096/threads:T                a decoding step over 4096 keys: tree (16 draft tokens,
//                                                   flex::tree, one call), single (1 query, the decoding kernel)
// FLOPS counts 4 d per visible pair forward (10 d backward).
#include <benchmark/benchmark.h>

#include <sdpa/sdpa.hpp>

#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using Index = Eigen::Index;
using T4 = Eigen::Tensor<float, 4, Eigen::RowMajor>;
namespace flex = sdpa::flex;
constexpr Index kHeads = 8, kD = 64;

T4 random_heads(Index n, std::uint32_t seed, Index heads = kHeads) {
  T4 t(1, heads, n, kD);
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = nd(gen);
  return t;
}

struct Inputs {
  T4 q, k, v, d_out;
  explicit Inputs(Index n) : q(random_heads(n, 1)), k(random_heads(n, 2)), v(random_heads(n, 3)), d_out(random_heads(n, 4)) {}
};

void set_flops(benchmark::State& state, double pairs, bool backward) {
  const double flops = (backward ? 10.0 : 4.0) * kHeads * kD * pairs;
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

double causal_pairs(Index n) { return static_cast<double>(n) * static_cast<double>(n + 1) / 2; }

// fwd: time attention(options); bwd: time attention_backward from one saved state.
void run(benchmark::State& state, const Inputs& in, const sdpa::AttentionOptions<float>& o, bool backward) {
  if (!backward) {
    for (auto _ : state) {
      T4 out = sdpa::attention(in.q, in.k, in.v, o);
      benchmark::DoNotOptimize(out.data());
    }
    return;
  }
  sdpa::AttentionState<float> saved;
  sdpa::attention(in.q, in.k, in.v, o, saved);
  for (auto _ : state) {
    sdpa::AttentionGradients<float> g = sdpa::attention_backward(in.d_out, saved);
    benchmark::DoNotOptimize(g.q.data());
  }
}

void causal_case(benchmark::State& state, const std::string& how, bool backward, int threads) {
  const Index n = 8192;
  const Inputs in(n);
  sdpa::AttentionOptions<float> o;
  o.device = sdpa_bench::device_for(threads);
  if (how == "fixed") {
    o.causal = true;
  } else if (how == "builtin") {
    o.program = flex::program<float>(flex::noop_score{}, flex::causal{}, flex::causal{}.plan(1, 1, n, n));
  } else {
    const auto lambda = [](Index, Index, Index q, Index k) { return k <= q; };
    o.program = flex::program<float>(flex::noop_score{}, lambda, sdpa::block_mask_from(lambda, 1, 1, n, n));
  }
  run(state, in, o, backward);
  set_flops(state, causal_pairs(n), backward);
}

void document_case(benchmark::State& state, const std::string& how, int threads) {
  const Index n = 8192, docs = 8, len = n / docs;
  const Eigen::ThreadPoolDevice* device = sdpa_bench::device_for(threads);
  if (how == "separate") {
    // Each document its own tensors, as the one sequence holds them (one set reused would stay in cache).
    const std::vector<Inputs> in(static_cast<std::size_t>(docs), Inputs(len));
    sdpa::AttentionOptions<float> o;
    o.causal = true;
    o.device = device;
    for (auto _ : state)
      for (Index d = 0; d < docs; ++d) {
        const Inputs& doc = in[static_cast<std::size_t>(d)];
        T4 out = sdpa::attention(doc.q, doc.k, doc.v, o);
        benchmark::DoNotOptimize(out.data());
      }
    set_flops(state, static_cast<double>(docs) * causal_pairs(len), false);
    return;
  }
  const Inputs in(n);
  sdpa::AttentionOptions<float> o;
  o.device = device;
  if (how == "dense_causal") {
    o.causal = true;
  } else {
    std::vector<Index> ids(static_cast<std::size_t>(n));
    for (Index i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = i / len;
    const auto mask = flex::and_masks(flex::document(ids), flex::causal{});
    o.program = flex::program<float>(flex::noop_score{}, mask, mask.plan(1, 1, n, n));
  }
  run(state, in, o, false);
  set_flops(state, how == "dense_causal" ? causal_pairs(n) : static_cast<double>(docs) * causal_pairs(len), false);
}

void t5_case(benchmark::State& state, const std::string& how, bool backward, int threads) {
  const Index n = 4096;
  const Inputs in(n);
  flex::ScoreTable<float> table(kHeads, 32);
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (Index i = 0; i < table.size(); ++i) table.values().data()[i] = nd(gen);
  const flex::t5_buckets<float> t5{&table, true, 32, 128};
  sdpa::AttentionOptions<float> o;
  o.device = sdpa_bench::device_for(threads);
  T4 bias;
  if (how == "score") {
    o.program = flex::program<float>(t5);
  } else {
    bias = T4(1, kHeads, n, n);
    for (Index h = 0; h < kHeads; ++h)
      for (Index q = 0; q < n; ++q)
        for (Index k = 0; k < n; ++k) bias(0, h, q, k) = table(h, t5.bucket(k - q));
    o.attention_bias = &bias;
  }
  run(state, in, o, backward);
  set_flops(state, static_cast<double>(n) * static_cast<double>(n), backward);
}

// A generic mask: causal, or documents of 1024 and causal, as a lambda the plan builder must evaluate.
auto generic_mask(const std::string& mask) {
  const bool document = mask == "document";
  return [document](Index, Index, Index q, Index k) { return k <= q && (!document || q / 1024 == k / 1024); };
}

void plan_case(benchmark::State& state, const std::string& mask, bool forward, int threads) {
  const Index n = 32768;
  const Eigen::ThreadPoolDevice* device = sdpa_bench::device_for(threads);
  const auto visible = generic_mask(mask);
  if (!forward) {
    for (auto _ : state) {
      sdpa::BlockMask plan = sdpa::block_mask_from(visible, 1, 1, n, n, 128, 128, device);
      benchmark::DoNotOptimize(&plan);
    }
    state.counters["pairs/s"] = benchmark::Counter(static_cast<double>(n) * n, benchmark::Counter::kIsIterationInvariantRate);
    return;
  }
  const Inputs in(n);
  sdpa::AttentionOptions<float> o;
  o.device = device;
  o.program = flex::program<float>(flex::noop_score{}, visible, sdpa::block_mask_from(visible, 1, 1, n, n, 128, 128, device));
  run(state, in, o, false);
  set_flops(state, mask == "document" ? static_cast<double>(n / 1024) * causal_pairs(1024) : causal_pairs(n), false);
}

void peer_case(benchmark::State& state, const std::string& pattern, int threads) {
  const Index n = 4096;
  const Inputs in(n);
  sdpa::AttentionOptions<float> o;
  o.device = sdpa_bench::device_for(threads);
  double pairs = causal_pairs(n);
  flex::ScoreTable<float> table(kHeads, 32);
  if (pattern == "causal") {
    o.program = flex::program<float>(flex::noop_score{}, flex::causal{}, flex::causal{}.plan(1, 1, n, n));
  } else if (pattern == "document") {
    std::vector<Index> ids(static_cast<std::size_t>(n));
    for (Index i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = i / (n / 4);
    const auto mask = flex::and_masks(flex::document(ids), flex::causal{});
    o.program = flex::program<float>(flex::noop_score{}, mask, mask.plan(1, 1, n, n));
    pairs = 4 * causal_pairs(n / 4);
  } else if (pattern == "sliding") {
    const flex::sliding_window w{255, 0};
    o.program = flex::program<float>(flex::noop_score{}, w, w.plan(1, 1, n, n));
    pairs = 0;
    for (Index q = 0; q < n; ++q) pairs += static_cast<double>(std::min<Index>(q + 1, 256));
  } else if (pattern == "prefix_lm") {
    const flex::prefix_lm m({n / 4});
    o.program = flex::program<float>(flex::noop_score{}, m, m.plan(1, 1, n, n));
    pairs = causal_pairs(n) + static_cast<double>(n / 4) * static_cast<double>(n / 4 - 1) / 2;
  } else {
    std::mt19937 gen(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (Index i = 0; i < table.size(); ++i) table.values().data()[i] = nd(gen);
    o.program = flex::program<float>(flex::t5_buckets<float>{&table, true, 32, 128});
    pairs = static_cast<double>(n) * n;
  }
  run(state, in, o, false);
  set_flops(state, pairs, false);
}

void tree_case(benchmark::State& state, const std::string& how, int threads) {
  const Index cache = 4096, drafts = 16;
  const Index nq = how == "tree" ? drafts : 1, nk = how == "tree" ? cache + drafts : cache;
  const T4 q = random_heads(nq, 1), k = random_heads(nk, 2), v = random_heads(nk, 3);
  sdpa::AttentionOptions<float> o;
  o.device = sdpa_bench::device_for(threads);
  if (how == "tree") {
    std::vector<Index> parents(static_cast<std::size_t>(drafts));
    for (Index i = 0; i < drafts; ++i) parents[static_cast<std::size_t>(i)] = i == 0 ? -1 : (i - 1) / 2;  // a binary tree
    const flex::tree t(parents, cache);
    o.program = flex::program<float>(flex::noop_score{}, t, t.plan(1, 1, nq, nk, 16, 128));
  }
  for (auto _ : state) {
    T4 out = sdpa::attention(q, k, v, o);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["keys"] = static_cast<double>(nk);
}

void add(const std::string& name, std::function<void(benchmark::State&)> f, int iterations = 0) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), std::move(f))->UseRealTime()->Unit(benchmark::kMillisecond);
  if (iterations > 0) b->Iterations(iterations);
}

}  // namespace

int main(int argc, char** argv) {
  for (int t : {1, 2}) {
    const std::string threads = "/threads:" + std::to_string(t);
    for (const std::string how : {"fixed", "builtin", "lambda"})
      for (bool bwd : {false, true})
        add("flex/causal/" + how + "/N:8192/" + (bwd ? "bwd" : "fwd") + threads,
            [how, bwd, t](benchmark::State& s) { causal_case(s, how, bwd, t); });
    for (const std::string how : {"builtin", "separate", "dense_causal"})
      add("flex/document/" + how + "/N:8192/fwd" + threads, [how, t](benchmark::State& s) { document_case(s, how, t); });
    for (const std::string how : {"score", "dense_bias"})
      for (bool bwd : {false, true})
        add("flex/t5/" + how + "/N:4096/" + (bwd ? "bwd" : "fwd") + threads,
            [how, bwd, t](benchmark::State& s) { t5_case(s, how, bwd, t); });
    for (const std::string mask : {"causal", "document"}) {
      add("flex/plan/" + mask + "/N:32768" + threads, [mask, t](benchmark::State& s) { plan_case(s, mask, false, t); });
      add("flex/plan_forward/" + mask + "/N:32768" + threads, [mask, t](benchmark::State& s) { plan_case(s, mask, true, t); },
          1);
    }
    for (const std::string pattern : {"causal", "document", "sliding", "prefix_lm", "t5"})
      add("flex/peer/" + pattern + "/N:4096" + threads, [pattern, t](benchmark::State& s) { peer_case(s, pattern, t); });
    for (const std::string how : {"tree", "single"})
      add("flex/tree/" + how + "/N:4096" + threads, [how, t](benchmark::State& s) { tree_case(s, how, t); });
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
