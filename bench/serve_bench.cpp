// serve_bench: serving many sequences at once (d_model 512, h 8, d_k = d_v = 64, float, eval, 1 thread):
//   serve/ragged_step        one PagedKVCache step of 8 sequences of 100..4000 cached tokens, one token each
//                            (the sequences are truncated back after each step)
//   serve/separate_steps     the same 8 sequences as 8 KVCaches, one step each: the sum the ragged step
//                            replaces
//   serve/read/bytes:<B>     a sum over the ragged step's bytes (the 8 sequences' keys and values and the
//                            four weight matrices): its read bound, same run
//   serve/packed_prefill     8 prompts of 64..1024 tokens packed in one causal forward (cu_seqlens)
//   serve/separate_prefill   the 8 prompts as 8 causal forwards
//   serve/padded_prefill     the 8 prompts padded to 1024 in one batch, key_lengths hiding the padding
//   serve/merge/one_call     sdpa::attention of 1 x 4096 queries over 4096 keys (h 8, d 64)
//   serve/merge/two_halves   the same as two calls over keys [0, 2048) and [2048, 4096), each returning its
//                            log-sum-exp, and merge_attention_states of the two (issue 51: within 1.1x)
//   serve/cascade/step       64 sequences forked from one 4096-token prefix, 64 own tokens each, one token
//                            each per step (blocks of 64): the shared prefix attended once (issue 51)
//   serve/cascade/ragged_step  the same step with PagedKVCache::set_cascade(false): the prefix read per
//                            sequence
//   serve/cascade/read/bytes:<B>  a sum over the cascade step's bytes (the prefix once, the 64 sequences'
//                            own entries, the four weight matrices): its read bound
//   serve/fma_peak/<isa>     independent float FMA chains (fma_peak.hpp): with the cascade step's FLOPs
//                            (serve/cascade/step's counter), its compute floor
//   (the cascade cases on 1 and 2 threads)
//   serve/tree/step          a tree of 16 draft tokens (4 under the last token, 3 under each) verified in one
//                            step_tree on a KVCache of 4096 entries (issue 51)
//   serve/tree/single_step   one token's step on the same cache
//   serve/tree/16_steps      16 single-token steps, one after the other
//   serve_bench --fork_memory   16 forks of a 2000-token prompt each decoding 100 tokens: prints the
//                            blocks used against the entries held and against 16 copies (JSON)
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "fma_peak.hpp"

namespace sdpa_bench {
namespace {

using Paged = sdpa::PagedKVCache<float>;
using Cache = sdpa::KVCache<float>;
const std::vector<Index> kCached{100, 600, 1100, 1600, 2100, 2600, 3100, 4000};
const std::vector<Index> kPrompts{64, 200, 330, 460, 600, 730, 860, 1024};

struct Model {
  Module module{512, 64, 64, 8, 0.0f};
  Model() {
    module.init_weights(sdpa::init::PyTorchDefaultPolicy{});
    module.eval();
  }
  Tensor3 tokens(Index batch, Index n, std::uint64_t stream) const {
    Tensor3 x(batch, n, 512);
    sdpa::Philox gen(0x5e7e, stream);
    sdpa::init::Uniform{-1.0, 1.0}(x, gen);
    return x;
  }
};

const Model& model() {
  static const Model m;
  return m;
}

double ragged_bytes() {
  double entries = 0;
  for (Index n : kCached) entries += static_cast<double>(n);
  return 4.0 * (entries * 2.0 * 512.0 + 4.0 * 512.0 * 512.0);
}

void ragged_step(benchmark::State& state) {
  const Model& m = model();
  Paged paged(m.module, 64, 600);
  std::vector<Paged::SequenceId> ids;
  for (std::size_t i = 0; i < kCached.size(); ++i) {
    ids.push_back(paged.add_sequence());
    (void)m.module.step(m.tokens(1, kCached[i], i), paged, {ids.back()});
  }
  const Tensor3 x = m.tokens(static_cast<Index>(ids.size()), 1, 99);
  for (auto _ : state) {
    Tensor3 y = m.module.step(x, paged, ids);
    benchmark::DoNotOptimize(y.data());
    for (std::size_t i = 0; i < ids.size(); ++i) paged.truncate(ids[i], kCached[i]);
  }
  state.counters["bytes"] = ragged_bytes();
}

void separate_steps(benchmark::State& state) {
  const Model& m = model();
  std::vector<std::unique_ptr<Cache>> caches;
  for (std::size_t i = 0; i < kCached.size(); ++i) {
    caches.push_back(std::make_unique<Cache>(m.module, 1, kCached[i] + 1));
    (void)m.module.step(m.tokens(1, kCached[i], i), *caches.back());
  }
  const Tensor3 x = m.tokens(1, 1, 99);
  Tensor3 out(1, 1, 512);
  Eigen::TensorMap<Tensor3> out_map(out.data(), 1, 1, 512);
  for (auto _ : state) {
    for (std::size_t i = 0; i < caches.size(); ++i) {
      m.module.step(x, *caches[i], {}, out_map);
      caches[i]->truncate(kCached[i]);
    }
    benchmark::DoNotOptimize(out.data());
  }
}

void read_bound(benchmark::State& state, double bytes) {
  std::vector<float> buf(static_cast<std::size_t>(bytes / 4));
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i % 7);
  float sum = 0;
  for (auto _ : state) {
    sum += Eigen::Map<const Eigen::ArrayXf>(buf.data(), static_cast<Index>(buf.size())).sum();
    benchmark::DoNotOptimize(sum);
  }
  state.counters["bytes"] = bytes;
}

void packed_prefill(benchmark::State& state) {
  const Model& m = model();
  Index total = 0;
  sdpa::AttentionOptions<float> o;
  o.causal = true;
  o.cu_seqlens_q = {0};
  for (Index n : kPrompts) o.cu_seqlens_q.push_back(total += n);
  o.cu_seqlens_k = o.cu_seqlens_q;
  const Tensor3 x = m.tokens(1, total, 7);
  for (auto _ : state) {
    Tensor3 y = m.module(x, x, x, o);
    benchmark::DoNotOptimize(y.data());
  }
}

void separate_prefill(benchmark::State& state) {
  const Model& m = model();
  std::vector<Tensor3> xs;
  for (std::size_t i = 0; i < kPrompts.size(); ++i) xs.push_back(m.tokens(1, kPrompts[i], 10 + i));
  sdpa::AttentionOptions<float> o;
  o.causal = true;
  for (auto _ : state) {
    for (const Tensor3& x : xs) {
      Tensor3 y = m.module(x, x, x, o);
      benchmark::DoNotOptimize(y.data());
    }
  }
}

void padded_prefill(benchmark::State& state) {
  const Model& m = model();
  const Index longest = kPrompts.back();
  const Tensor3 x = m.tokens(static_cast<Index>(kPrompts.size()), longest, 8);
  sdpa::AttentionOptions<float> o;
  o.causal = true;  // (lower-right on the padded length: the real rows are the first ones, keys past the length hidden)
  o.key_lengths = kPrompts;
  for (auto _ : state) {
    Tensor3 y = m.module(x, x, x, o);
    benchmark::DoNotOptimize(y.data());
  }
}

// 64 forks of a 4096-token prefix with 64 own tokens each, in one pool; each case sets the cascade.
constexpr Index kPrefix = 4096, kForks = 64, kOwn = 64;

struct Forks {
  Paged paged{model().module, 64, 200};
  std::vector<Paged::SequenceId> ids;
  Tensor3 x = model().tokens(kForks, 1, 98);
  Forks() {
    const Model& m = model();
    const Paged::SequenceId root = paged.add_sequence();
    (void)m.module.step(m.tokens(1, kPrefix, 3), paged, {root});
    for (Index i = 0; i < kForks; ++i) ids.push_back(paged.fork(root));
    paged.remove_sequence(root);
    (void)m.module.step(m.tokens(kForks, kOwn, 4), paged, ids);
  }
};

Forks& forks() {
  static Forks f;
  return f;
}

double cascade_bytes() { return 4.0 * ((kPrefix + kForks * kOwn) * 2.0 * 512.0 + 4.0 * 512.0 * 512.0); }
// The cascade step's useful FLOPs: the prefix's scores and p v for 64 x 8 query rows, each sequence's own
// 65 entries likewise, the four projections of 64 rows.
double cascade_flops() { return 4.0 * kForks * 8 * 64 * (kPrefix + kOwn + 1) + 4.0 * 2.0 * kForks * 512.0 * 512.0; }

void cascade_step(benchmark::State& state, bool cascade, int threads) {
  Forks& f = forks();
  f.paged.set_cascade(cascade);
  sdpa::AttentionOptions<float> o;
  o.device = device_for(threads);
  for (auto _ : state) {
    Tensor3 y = model().module.step(f.x, f.paged, f.ids, o);
    benchmark::DoNotOptimize(y.data());
    for (auto id : f.ids) f.paged.truncate(id, kPrefix + kOwn);
  }
  f.paged.set_cascade(true);
  state.counters["bytes"] = cascade_bytes();
  state.counters["flops"] = cascade_flops();
}

// A KVCache of 4096 entries; each case truncates back to them.
constexpr Index kTreeCache = 4096;
const std::vector<Index> kTree{-1, -1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3};

Cache& tree_cache() {
  static Cache cache = [] {
    Cache c(model().module, 1, kTreeCache + 32);
    (void)model().module.step(model().tokens(1, kTreeCache, 5), c);
    return c;
  }();
  return cache;
}

void tree_step(benchmark::State& state) {
  Cache& cache = tree_cache();
  const Tensor3 x = model().tokens(1, static_cast<Index>(kTree.size()), 6);
  for (auto _ : state) {
    Tensor3 y = model().module.step_tree(x, cache, kTree);
    benchmark::DoNotOptimize(y.data());
  }
  cache.truncate(kTreeCache);
}

void tree_single_steps(benchmark::State& state, Index steps) {
  Cache& cache = tree_cache();
  const Tensor3 x = model().tokens(1, 1, 7);
  Tensor3 out(1, 1, 512);
  Eigen::TensorMap<Tensor3> out_map(out.data(), 1, 1, 512);
  for (auto _ : state) {
    for (Index i = 0; i < steps; ++i) model().module.step(x, cache, {}, out_map);
    benchmark::DoNotOptimize(out.data());
    cache.truncate(kTreeCache);
  }
}

int fork_memory() {
  const Model& m = model();
  Paged paged(m.module, 16, 400);
  const Paged::SequenceId root = paged.add_sequence();
  (void)m.module.step(m.tokens(1, 2000, 1), paged, {root});
  std::vector<Paged::SequenceId> forks;
  for (int i = 0; i < 16; ++i) forks.push_back(paged.fork(root));
  paged.remove_sequence(root);
  for (int t = 0; t < 100; ++t) (void)m.module.step(m.tokens(16, 1, 100 + static_cast<std::uint64_t>(t)), paged, forks);
  const double entry_bytes = 2.0 * 512 * 4;
  const double held = (2000.0 + 16 * 100) * entry_bytes, copies = 16 * 2100.0 * entry_bytes;
  std::printf("{\"blocks_used\": %ld, \"block_size\": %ld, \"bytes\": %zu, \"prompt_and_continuations_bytes\": %.0f, "
              "\"ratio\": %.4f, \"copies_bytes\": %.0f, \"copies_ratio\": %.4f}\n",
              static_cast<long>(paged.blocks_used()), static_cast<long>(paged.block_size()), paged.bytes(), held,
              static_cast<double>(paged.bytes()) / held, copies, copies / held);
  return 0;
}

// q, k, v of (1, 8, 4096, 64), kBHND.
struct MergeInputs {
  using Tensor4 = Eigen::Tensor<float, 4, Eigen::RowMajor>;
  Tensor4 q{1, 8, 4096, 64}, k{1, 8, 4096, 64}, v{1, 8, 4096, 64}, k0{1, 8, 2048, 64}, v0{1, 8, 2048, 64},
      k1{1, 8, 2048, 64}, v1{1, 8, 2048, 64};
  MergeInputs() {
    sdpa::Philox gen(0x3e63, 1);
    for (Tensor4* t : {&q, &k, &v}) sdpa::init::Uniform{-1.0, 1.0}(*t, gen);
    const Eigen::array<Index, 4> half{{1, 8, 2048, 64}};
    k0 = k.slice(Eigen::array<Index, 4>{{0, 0, 0, 0}}, half);
    v0 = v.slice(Eigen::array<Index, 4>{{0, 0, 0, 0}}, half);
    k1 = k.slice(Eigen::array<Index, 4>{{0, 0, 2048, 0}}, half);
    v1 = v.slice(Eigen::array<Index, 4>{{0, 0, 2048, 0}}, half);
  }
};

const MergeInputs& merge_inputs() {
  static const MergeInputs m;
  return m;
}

void merge_one_call(benchmark::State& state) {
  const MergeInputs& m = merge_inputs();
  for (auto _ : state) benchmark::DoNotOptimize(sdpa::attention(m.q, m.k, m.v).data());
}

void merge_two_halves(benchmark::State& state) {
  const MergeInputs& m = merge_inputs();
  for (auto _ : state) {
    sdpa::AttentionPart<float> a, b;
    sdpa::AttentionOptions<float> oa, ob;
    oa.log_sum_exp = &a.lse;
    ob.log_sum_exp = &b.lse;
    a.out = sdpa::attention(m.q, m.k0, m.v0, oa);
    b.out = sdpa::attention(m.q, m.k1, m.v1, ob);
    sdpa::merge_attention_states(a.out, a.lse, b.out, b.lse);
    benchmark::DoNotOptimize(a.out.data());
  }
}

template <typename F>
void add(const std::string& name, F f) {
  benchmark::RegisterBenchmark(name.c_str(), f)->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace
}  // namespace sdpa_bench

int main(int argc, char** argv) {
  using namespace sdpa_bench;
  if (argc == 2 && std::strcmp(argv[1], "--fork_memory") == 0) return fork_memory();
  add("serve/ragged_step/threads:1", ragged_step);
  add("serve/separate_steps/threads:1", separate_steps);
  const double bytes = ragged_bytes();
  add("serve/read/bytes:" + std::to_string(static_cast<long long>(bytes)) + "/threads:1",
      [bytes](benchmark::State& s) { read_bound(s, bytes); });
  add("serve/packed_prefill/threads:1", packed_prefill);
  add("serve/separate_prefill/threads:1", separate_prefill);
  add("serve/padded_prefill/threads:1", padded_prefill);
  add("serve/merge/one_call/threads:1", merge_one_call);
  add("serve/merge/two_halves/threads:1", merge_two_halves);
  for (int threads : {1, 2}) {
    const std::string t = "/threads:" + std::to_string(threads);
    add("serve/cascade/step" + t, [threads](benchmark::State& s) { cascade_step(s, true, threads); });
    add("serve/cascade/ragged_step" + t, [threads](benchmark::State& s) { cascade_step(s, false, threads); });
    benchmark::RegisterBenchmark((std::string("serve/fma_peak/") + kPeakIsa).c_str(), fma_peak)
        ->Threads(threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  const double shared_bytes = cascade_bytes();
  add("serve/cascade/read/bytes:" + std::to_string(static_cast<long long>(shared_bytes)) + "/threads:1",
      [shared_bytes](benchmark::State& s) { read_bound(s, shared_bytes); });
  add("serve/tree/step/threads:1", tree_step);
  add("serve/tree/single_step/threads:1", [](benchmark::State& s) { tree_single_steps(s, 1); });
  add("serve/tree/16_steps/threads:1", [](benchmark::State& s) { tree_single_steps(s, 16); });
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
