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
  Twin(const sdpa::ScaledDotProductAttention<Scalar>& m, Storage s)
      : cascade(m, 16, 600, s), plain(m, 16, 600, s) {
    plain.set_cascade(false);
  }
};

// The largest |cascade - plain| over `steps` steps of random subsets of a random fork tree, relative to
// the largest |plain| output.
template <typename Scalar>
double cascade_error(Storage s, const sdpa::AttentionOptions<Scalar>& o, Index tokens, std::uint64_t seed) {
  Rng rng(seed);
  const auto m = make_module<Scalar>(rng);
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
      EXPECT_LE(cascade_error<float>(GetParam(), os, tokens, ++seed), bound) << tokens << " tokens, threads " << threads;
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

}  // namespace serving_test
