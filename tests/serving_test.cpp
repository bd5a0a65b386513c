// Tests of the serving paths that share work between sequences (issue 51):
//   - PagedKVCache::shared_blocks finds the levels of a fork tree (a prompt shared by all, documents shared
//     by some), full blocks only, and nothing among sequences that share no block;
//   - a cascade step (the blocks several sequences share attended once by their stacked queries, merged with
//     each sequence's own blocks) equals the per-sequence ragged step (set_cascade(false)) within float
//     rounding, on random fork trees with appends after the forks: every storage, grouped heads, rotary,
//     ALiBi, softcap, sinks, a sliding window, 1 and several tokens per sequence (decoding and tiled kernels),
//     1 and 2 threads; and in double within 1e-12.
#include "sdpa/paged_kv_cache.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "support/reference.hpp"

namespace serving_test {

using Index = Eigen::Index;
using sdpa::Storage;
using sdpa_test::Rng;

template <typename Scalar>
sdpa::ScaledDotProductAttention<Scalar> make_module(Rng& rng) {
  sdpa::ScaledDotProductAttention<Scalar> m(48, 16, 16, 4, Scalar(0), 2);
  m.eval();
  sdpa_test::randomize_module(m, rng, 0.15);
  m.set_rotary(sdpa::rope_linear(16, 10000, 2));
  return m;
}

template <typename Scalar>
Eigen::Tensor<Scalar, 3, Eigen::RowMajor> random3(Rng& rng, Index a, Index b, Index c) {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> t(a, b, c);
  rng.fill_normal(t);
  return t;
}

// The levels of a fork tree: a root prompt of 5 full blocks and a partial one; two documents forked from
// it, each forked again; a stranger that shares nothing.
TEST(SharedBlocks, FollowTheForkTree) {
  Rng rng(1);
  const auto m = make_module<float>(rng);
  sdpa::PagedKVCache<float> paged(m, 16, 200);
  using Id = sdpa::PagedKVCache<float>::SequenceId;
  const Id root = paged.add_sequence(), stranger = paged.add_sequence();
  (void)m.step(random3<float>(rng, 1, 5 * 16 + 3, 48), paged, {root});
  (void)m.step(random3<float>(rng, 1, 40, 48), paged, {stranger});
  const Id doc_a = paged.fork(root), doc_b = paged.fork(root);
  (void)m.step(random3<float>(rng, 2, 2 * 16, 48), paged, {doc_a, doc_b});  // 83 + 32: 7 full blocks each
  const Id a1 = paged.fork(doc_a), a2 = paged.fork(doc_a), b1 = paged.fork(doc_b);
  (void)m.step(random3<float>(rng, 3, 20, 48), paged, {a1, a2, b1});
  // The step's order: ids {stranger, a2, b1, root, a1, doc_b}.
  const std::vector<Id> ids{stranger, a2, b1, root, a1, doc_b};
  const auto runs = paged.shared_blocks(ids);
  // Block 5 (entries 80..95) of root is partly filled in root (83 entries): the root level is blocks 0..4,
  // shared by every sequence but the stranger.
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].members, (std::vector<Index>{1, 2, 3, 4, 5}));
  EXPECT_EQ(runs[0].first_block, 0);
  EXPECT_EQ(runs[0].blocks, 5);
  // Below it, the two documents: their copies of block 5 differ (each copied root's partial block), and
  // a1 and a2 share doc_a's blocks 5..6 (block 7 was partial when they forked: each appended to a copy),
  // b1 and doc_b likewise.
  std::vector<std::vector<Index>> members;
  for (std::size_t r = 1; r < runs.size(); ++r) {
    members.push_back(runs[r].members);
    EXPECT_EQ(runs[r].first_block, 5);
    EXPECT_EQ(runs[r].blocks, 2);
  }
  std::sort(members.begin(), members.end());
  EXPECT_EQ(members, (std::vector<std::vector<Index>>{{1, 4}, {2, 5}}));
  // One sequence alone, or sequences that share nothing: no run.
  EXPECT_TRUE(paged.shared_blocks({root}).empty());
  EXPECT_TRUE(paged.shared_blocks({stranger, root}).empty());
}

// A random fork tree built the same way in two caches, one stepping with the cascade and one without.
template <typename Scalar>
struct Twin {
  using Paged = sdpa::PagedKVCache<Scalar>;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;
  Paged cascade, plain;
  std::vector<typename Paged::SequenceId> ids;
  Twin(const sdpa::ScaledDotProductAttention<Scalar>& m, Storage s) : cascade(m, 16, 600, s), plain(m, 16, 600, s) {
    plain.set_cascade(false);
  }
};

// The largest |cascade - plain| over `steps` steps of random subsets of a random fork tree, relative to
// the largest |plain| output.
template <typename Scalar>
double cascade_error(Storage s, const sdpa::AttentionOptions<Scalar>& o, Index tokens, std::uint64_t seed,
                     sdpa::Kernel kernel = sdpa::Kernel::kAuto) {
  Rng rng(seed);
  auto m = make_module<Scalar>(rng);
  m.set_kernel(kernel);
  Twin<Scalar> twin(m, s);
  const auto both = [&](const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& x, const std::vector<std::int64_t>& ids) {
    (void)m.step(x, twin.cascade, ids, o);
    (void)m.step(x, twin.plain, ids, o);
  };
  twin.ids.push_back(twin.cascade.add_sequence());
  twin.plain.add_sequence();
  both(random3<Scalar>(rng, 1, 90 + static_cast<Index>(seed % 40), 48), {twin.ids[0]});
  double worst = 0, scale = 0;
  int cascaded = 0;
  for (int round = 0; round < 10; ++round) {
    // Fork one or two sequences, then append a few tokens to some of them (so that levels form).
    for (int f = 0; f < 2; ++f) {
      const auto parent = twin.ids[static_cast<std::size_t>(rng.uniform(0, static_cast<double>(twin.ids.size())))];
      twin.ids.push_back(twin.cascade.fork(parent));
      EXPECT_EQ(twin.plain.fork(parent), twin.ids.back());
    }
    std::vector<std::int64_t> some;
    for (auto id : twin.ids)
      if (rng.bernoulli(0.5)) some.push_back(id);
    if (!some.empty()) both(random3<Scalar>(rng, static_cast<Index>(some.size()), 1 + round % 3 * 9, 48), some);
    // A step of a random subset in a random order, compared.
    std::vector<std::int64_t> step = twin.ids;
    std::shuffle(step.begin(), step.end(), rng.gen);
    step.resize(std::max<std::size_t>(2, step.size() - static_cast<std::size_t>(rng.uniform(0, 3))));
    const auto x = random3<Scalar>(rng, static_cast<Index>(step.size()), tokens, 48);
    const auto yc = m.step(x, twin.cascade, step, o);
    const auto yp = m.step(x, twin.plain, step, o);
    for (Index j = 0; j < yp.size(); ++j) {
      worst = std::max(worst, std::fabs(static_cast<double>(yc.data()[j]) - static_cast<double>(yp.data()[j])));
      scale = std::max(scale, std::fabs(static_cast<double>(yp.data()[j])));
    }
    cascaded += twin.cascade.shared_blocks(step).empty() ? 0 : 1;
  }
  for (auto id : twin.ids) EXPECT_EQ(twin.cascade.size(id), twin.plain.size(id));
  EXPECT_GE(cascaded, 5) << "steps that had shared blocks to cascade, of 10";
  return worst / std::max(scale, 1e-30);
}

class CascadeStorage : public ::testing::TestWithParam<Storage> {};

// The bound: 2e-6 of the largest output (measured: at most 4e-7; each level's merge rounds its two weights
// and the weighted sum once more than one pass does). int8 on the AVX2 / AVX-512 paths: 5e-5 (measured:
// at most 1.3e-5), as the per-sequence step's decoding kernel scores int8 keys by integer products against
// the query rounded to int16 while a level's stacked queries take the tiled kernel's widened keys.
TEST_P(CascadeStorage, EqualsThePerSequenceStep) {
  const double bound = GetParam() == Storage::kInt8 && sdpa::active_isa() != sdpa::Isa::kPortable ? 5e-5 : 2e-6;
  sdpa::AttentionOptions<float> o;
  o.alibi_slopes = sdpa::alibi_slopes<float>(4);
  o.softcap = 30;
  o.sinks = {0.2f, -0.5f, 1.0f, 0.0f};
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  std::uint64_t seed = 10;
  for (Index tokens : {Index(1), Index(3), Index(20)}) {
    for (bool threads : {false, true}) {
      sdpa::AttentionOptions<float> os = o;
      if (threads) os.device = &device;
      EXPECT_LE(cascade_error<float>(GetParam(), os, tokens, ++seed), bound)
          << tokens << " tokens, threads " << threads;
    }
  }
  // A sliding window whose edge falls inside the shared blocks for some queries.
  sdpa::AttentionOptions<float> w;
  w.window_left = 70;
  for (Index tokens : {Index(1), Index(4)})
    EXPECT_LE(cascade_error<float>(GetParam(), w, tokens, ++seed), bound) << tokens << " tokens, window";
}

INSTANTIATE_TEST_SUITE_P(Storages, CascadeStorage,
                         ::testing::Values(Storage::kFloat32, Storage::kBFloat16, Storage::kFloat16, Storage::kInt8),
                         [](const ::testing::TestParamInfo<Storage>& i) {
                           return std::string(sdpa::storage_name(i.param)).substr(1);
                         });

TEST(Cascade, DoubleEqualsThePerSequenceStep) {
  sdpa::AttentionOptions<double> o;
  o.alibi_slopes = sdpa::alibi_slopes<double>(4);
  o.sinks = {0.2, -0.5, 1.0, 0.0};
  EXPECT_LE(cascade_error<double>(Storage::kFloat64, o, 1, 3), 1e-12);
  EXPECT_LE(cascade_error<double>(Storage::kFloat64, o, 18, 4), 1e-12);
}

// Under the module's other kernels: the tiled kernel for every part, and the reference kernel.
TEST(Cascade, EqualsThePerSequenceStepOnEveryKernel) {
  sdpa::AttentionOptions<float> o;
  o.alibi_slopes = sdpa::alibi_slopes<float>(4);
  o.sinks = {0.2f, -0.5f, 1.0f, 0.0f};
  o.window_left = 60;
  for (sdpa::Kernel k : {sdpa::Kernel::kTiled, sdpa::Kernel::kReference})
    EXPECT_LE(cascade_error<float>(Storage::kFloat32, o, 2, 5, k), 2e-6) << static_cast<int>(k);
}

}  // namespace serving_test

namespace serving_test {

using Tensor3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using Module = sdpa::ScaledDotProductAttention<float>;

// Rows [j, j + 1) of batch entry b of x.
Tensor3 token(const Tensor3& x, Index b, Index j) {
  Tensor3 t(1, 1, x.dimension(2));
  std::copy_n(x.data() + (b * x.dimension(1) + j) * x.dimension(2), x.dimension(2), t.data());
  return t;
}

// The drafts from under the sequence to j, in order.
std::vector<Index> path_to(const std::vector<Index>& parents, Index j) {
  std::vector<Index> path;
  for (; j >= 0; j = parents[static_cast<std::size_t>(j)]) path.insert(path.begin(), j);
  return path;
}

double max_abs(const Tensor3& a, Index ai, const Tensor3& b, Index bi, Index n) {
  double d = 0;
  for (Index c = 0; c < n; ++c)
    d = std::max(d, std::fabs(static_cast<double>(a.data()[ai * n + c]) - b.data()[bi * n + c]));
  return d;
}

// A random tree of n drafts (each under -1 or an earlier one).
std::vector<Index> random_tree(Rng& rng, Index n) {
  std::vector<Index> parents;
  for (Index j = 0; j < n; ++j)
    parents.push_back(static_cast<Index>(std::floor(rng.uniform(-1, static_cast<double>(j)))));
  return parents;
}

struct TreeCase {
  Storage storage;
  std::vector<Index> parents;
  Index prompt;
  sdpa::AttentionOptions<float> options;
};

// A tree step on a KVCache of one sequence: draft j's output equals that of decoding the drafts from under
// the sequence to j one at a time; accepting a path leaves the cache as appending it token by token does
// (the same entries, bit for bit when the tree has at most 16 drafts, the same position).
void check_kv_tree(const TreeCase& c, std::uint64_t seed, double bound) {
  Rng rng(seed);
  const Module m = make_module<float>(rng);
  const Index n = static_cast<Index>(c.parents.size());
  const Tensor3 prompt = random3<float>(rng, 1, c.prompt, 48), x = random3<float>(rng, 1, n, 48);
  sdpa::KVCache<float> cache(m, 1, 0, c.storage);
  (void)m.step(prompt, cache, c.options);
  const Tensor3 y = m.step_tree(x, cache, c.parents, c.options);
  ASSERT_EQ(cache.drafts(), n);
  ASSERT_EQ(cache.position(), c.prompt);
  for (Index j = 0; j < n; ++j) {
    sdpa::KVCache<float> ref(m, 1, 0, c.storage);
    (void)m.step(prompt, ref, c.options);
    Tensor3 last;
    for (Index k : path_to(c.parents, j)) last = m.step(token(x, 0, k), ref, c.options);
    EXPECT_LE(max_abs(y, j, last, 0, 48), bound) << "draft " << j << " of " << n;
  }
  // Accept the path to the deepest draft.
  Index deepest = 0;
  for (Index j = 0; j < n; ++j)
    if (path_to(c.parents, j).size() > path_to(c.parents, deepest).size()) deepest = j;
  const std::vector<Index> path = path_to(c.parents, deepest);
  cache.accept(path);
  sdpa::KVCache<float> ref(m, 1, 0, c.storage);
  (void)m.step(prompt, ref, c.options);
  for (Index k : path) (void)m.step(token(x, 0, k), ref, c.options);
  EXPECT_EQ(cache.drafts(), 0);
  EXPECT_EQ(cache.position(), ref.position());
  if (c.options.window_left < 0) {  // (a window's steps drop entries the tree step keeps until the next step)
    ASSERT_EQ(cache.size(), ref.size());
    const Tensor3 ka = cache.keys(), kb = ref.keys(), va = cache.values(), vb = ref.values();
    const double entry_bound = n <= 16 ? 0.0 : 1e-5;
    EXPECT_LE(max_abs(ka, 0, kb, 0, ka.size()), entry_bound);
    EXPECT_LE(max_abs(va, 0, vb, 0, va.size()), entry_bound);
  }
  // Then decoding goes on as after the token-by-token path.
  const Tensor3 next = random3<float>(rng, 1, 1, 48);
  EXPECT_LE(max_abs(m.step(next, cache, c.options), 0, m.step(next, ref, c.options), 0, 48), bound);
}

class TreeStorage : public ::testing::TestWithParam<Storage> {};

// Chains, wide trees and a tree of 20 drafts (the tiled kernel and the projections' GEMM), with grouped
// heads, rotary, ALiBi, softcap, sinks and a window. The bound: 2e-5 (int8 on the vector paths 2e-4: the
// token-by-token steps score int8 keys by integer products, the tree's second part by widened keys).
TEST_P(TreeStorage, EqualsDecodingEachPath) {
  const Storage s = GetParam();
  const double bound = s == Storage::kInt8 && sdpa::active_isa() != sdpa::Isa::kPortable ? 2e-4 : 2e-5;
  Rng rng(40);
  sdpa::AttentionOptions<float> o;
  o.alibi_slopes = sdpa::alibi_slopes<float>(4);
  o.softcap = 30;
  o.sinks = {0.2f, -0.5f, 1.0f, 0.0f};
  check_kv_tree({s, {-1, 0, 1, 2, 3}, 37, o}, 41, bound);                          // a chain
  check_kv_tree({s, {-1, -1, -1, 0, 0, 1, 3, 3, 6, -1, 2, 5}, 70, o}, 42, bound);  // a wide tree
  check_kv_tree({s, random_tree(rng, 20), 50, o}, 43, bound);
  check_kv_tree({s, {-1, 0}, 0, o}, 44, bound);  // an empty cache
  sdpa::AttentionOptions<float> w;
  w.window_left = 3;
  check_kv_tree({s, {-1, 0, 1, 0, 3, 4, 5}, 30, w}, 45, bound);  // the window ends among the drafts
}

INSTANTIATE_TEST_SUITE_P(Storages, TreeStorage,
                         ::testing::Values(Storage::kFloat32, Storage::kBFloat16, Storage::kFloat16, Storage::kInt8),
                         [](const ::testing::TestParamInfo<Storage>& i) {
                           return std::string(sdpa::storage_name(i.param)).substr(1);
                         });

// On a PagedKVCache: two sequences (one a fork of the other) with trees crossing a block boundary, each
// accepting its own path; then both decode on as their token-by-token copies do.
TEST(TreeStep, PagedSequencesAcceptTheirOwnPaths) {
  Rng rng(50);
  const Module m = make_module<float>(rng);
  sdpa::AttentionOptions<float> o;
  o.alibi_slopes = sdpa::alibi_slopes<float>(4);
  o.sinks = {0.2f, -0.5f, 1.0f, 0.0f};
  const std::vector<Index> parents{-1, 0, 0, 1, 2, 3, 5, -1, 7};
  const Index n = static_cast<Index>(parents.size());
  sdpa::PagedKVCache<float> paged(m, 16, 64), ref(m, 16, 64);
  ref.set_cascade(false);
  const auto a = paged.add_sequence();
  ASSERT_EQ(ref.add_sequence(), a);
  const Tensor3 prompt = random3<float>(rng, 1, 29, 48);  // 29 + 9 drafts cross blocks 1 and 2
  (void)m.step(prompt, paged, {a}, o);
  (void)m.step(prompt, ref, {a}, o);
  const auto b = paged.fork(a);
  ASSERT_EQ(ref.fork(a), b);
  const Tensor3 x = random3<float>(rng, 2, n, 48);
  const Tensor3 y = m.step_tree(x, paged, {b, a}, parents, o);
  EXPECT_EQ(paged.drafts(a), n);
  EXPECT_EQ(paged.size(a), 29);
  // Each draft of each sequence against its path decoded one token at a time (on forks of the reference,
  // removed after).
  for (Index s = 0; s < 2; ++s)
    for (Index j = 0; j < n; ++j) {
      const auto f = ref.fork(s == 0 ? b : a);
      Tensor3 last;
      for (Index k : path_to(parents, j)) last = m.step(token(x, s, k), ref, {f}, o);
      EXPECT_LE(max_abs(y, s * n + j, last, 0, 48), 2e-5) << "sequence " << s << ", draft " << j;
      ref.remove_sequence(f);
    }
  const std::vector<Index> pa = path_to(parents, 6), pb = path_to(parents, 8);
  paged.accept(a, pa);
  paged.accept(b, pb);
  for (Index k : pa) (void)m.step(token(x, 1, k), ref, {a}, o);
  for (Index k : pb) (void)m.step(token(x, 0, k), ref, {b}, o);
  for (auto id : {a, b}) {
    EXPECT_EQ(paged.size(id), ref.size(id));
    EXPECT_EQ(paged.position(id), ref.position(id));
    const Tensor3 k1 = paged.keys(id), k2 = ref.keys(id);
    ASSERT_EQ(k1.size(), k2.size());
    EXPECT_EQ(max_abs(k1, 0, k2, 0, k1.size()), 0.0);
  }
  EXPECT_EQ(paged.blocks_used(), ref.blocks_used());
  const Tensor3 next = random3<float>(rng, 2, 1, 48);
  const Tensor3 y1 = m.step(next, paged, {a, b}, o), y2 = m.step(next, ref, {a, b}, o);
  EXPECT_LE(max_abs(y1, 0, y2, 0, y1.size()), 2e-5);
}

// In double, and under the tiled and reference kernels: a chain and a wide tree against decoding each path.
TEST(TreeStep, DoubleAndEveryKernel) {
  Rng rng(70);
  auto md = make_module<double>(rng);
  const std::vector<Index> parents{-1, 0, -1, 1, 2, 3};
  const Index n = static_cast<Index>(parents.size());
  sdpa::AttentionOptions<double> o;
  o.alibi_slopes = sdpa::alibi_slopes<double>(4);
  o.sinks = {0.2, -0.5, 1.0, 0.0};
  const auto prompt = random3<double>(rng, 1, 21, 48), x = random3<double>(rng, 1, n, 48);
  for (sdpa::Kernel k : {sdpa::Kernel::kAuto, sdpa::Kernel::kTiled, sdpa::Kernel::kReference}) {
    md.set_kernel(k);
    sdpa::KVCache<double> cache(md, 1);
    (void)md.step(prompt, cache, o);
    const auto y = md.step_tree(x, cache, parents, o);
    for (Index j = 0; j < n; ++j) {
      sdpa::KVCache<double> ref(md, 1);
      (void)md.step(prompt, ref, o);
      Eigen::Tensor<double, 3, Eigen::RowMajor> last;
      for (Index t : path_to(parents, j)) {
        Eigen::Tensor<double, 3, Eigen::RowMajor> one(1, 1, 48);
        std::copy_n(x.data() + t * 48, 48, one.data());
        last = md.step(one, ref, o);
      }
      double d = 0;
      for (Index c = 0; c < 48; ++c) d = std::max(d, std::fabs(y.data()[j * 48 + c] - last.data()[c]));
      EXPECT_LE(d, 1e-12) << "draft " << j << ", kernel " << static_cast<int>(k);
    }
  }
}

// Refusals: a parent out of range or not before its child; a path that is not a chain of the tree; the
// cache as it was.
TEST(TreeStep, RefusesBadTreesAndPaths) {
  Rng rng(60);
  const Module m = make_module<float>(rng);
  sdpa::KVCache<float> cache(m, 1);
  (void)m.step(random3<float>(rng, 1, 10, 48), cache);
  const Tensor3 x = random3<float>(rng, 1, 4, 48);
  for (const std::vector<Index>& bad : {std::vector<Index>{-1, 1, 0, 0}, std::vector<Index>{-1, 0, -2, 0},
                                        std::vector<Index>{0, 0, 0, 0}, std::vector<Index>{-1, 0, 5, 0}}) {
    sdpa_test::expect_invalid([&] { (void)m.step_tree(x, cache, bad); }, {"step_tree", "parents["});
    EXPECT_EQ(cache.size(), 10);
    EXPECT_EQ(cache.drafts(), 0);
  }
  sdpa_test::expect_invalid([&] { (void)m.step_tree(x, cache, {-1, 0, 1}); }, {"step_tree", "parents", "4 entries"});
  const std::vector<Index> parents{-1, 0, -1, 2};
  (void)m.step_tree(x, cache, parents);
  const Tensor3 keys = cache.keys();
  for (const std::vector<Index>& bad : {std::vector<Index>{1}, std::vector<Index>{0, 2}, std::vector<Index>{2, 3, 0},
                                        std::vector<Index>{4}, std::vector<Index>{-1}}) {
    sdpa_test::expect_invalid([&] { cache.accept(bad); }, {"KVCache::accept", "path["});
    EXPECT_EQ(cache.size(), 10);
    EXPECT_EQ(cache.position(), 10);
    EXPECT_EQ(cache.drafts(), 4);
  }
  EXPECT_EQ(max_abs(cache.keys(), 0, keys, 0, keys.size()), 0.0);
  cache.accept({2, 3});
  EXPECT_EQ(cache.size(), 12);
  EXPECT_EQ(cache.drafts(), 0);
  sdpa_test::expect_invalid([&] { cache.accept({0}); }, {"KVCache::accept", "path[0]"});  // nothing pending
  sdpa::AttentionOptions<float> o;
  o.probabilities = nullptr;
  o.program = nullptr;
  sdpa::AttentionOptions<float> lse = o;
  Eigen::Tensor<float, 3, Eigen::RowMajor> l;
  lse.log_sum_exp = &l;
  sdpa_test::expect_invalid([&] { (void)m.step_tree(x, cache, parents, lse); }, {"step_tree", "log_sum_exp"});
  sdpa::PagedKVCache<float> paged(m, 16, 8);
  const auto id = paged.add_sequence();
  sdpa_test::expect_invalid([&] { paged.accept(id, {0}); }, {"PagedKVCache::accept", "path[0]"});
  sdpa_test::expect_invalid(
      [&] {
        (void)m.step_tree(random3<float>(rng, 1, 2, 48), paged, {id + 1}, {-1, 0});
      },
      {"step_tree", "sequence_ids[0]"});
  // A pool too small for the drafts: refused, nothing changed.
  (void)m.step(random3<float>(rng, 1, 100, 48), paged, {id});
  EXPECT_THROW((void)m.step_tree(random3<float>(rng, 1, 40, 48), paged, {id}, random_tree(rng, 40)),
               std::runtime_error);
  EXPECT_EQ(paged.size(id), 100);
  EXPECT_EQ(paged.drafts(id), 0);
}

}  // namespace serving_test
