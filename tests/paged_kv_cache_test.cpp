// Tests of sdpa/paged_kv_cache.hpp and the module's step on it (float, and double where storage allows):
//   - a ragged batch of sequences stepped together gets, per sequence, the bits that sequence gets alone
//     through a KVCache (vector paths; within float rounding on the portable one), for 1 and 3 tokens per
//     step, with grouped heads, rotary, ALiBi, softcap and sinks, for every storage, on 1 and 2 threads;
//   - sequences join and leave between steps; ids are not reused; blocks go back to the pool;
//   - fork shares the parent's blocks (blocks_used grows by the copied partial block only when one of them
//     appends) and both continue as independent sequences would; truncate gives back blocks and positions;
//   - a sliding window drops whole blocks and keeps a sequence's blocks bounded;
//   - a step the pool cannot hold throws std::runtime_error and changes nothing; every bad argument is
//     refused, named;
//   - memory: 16 forks of a 2000-token prompt, each decoding 100 tokens, take at most 1.1x the blocks of one
//     prompt and the 16 continuations.
#include "sdpa/paged_kv_cache.hpp"

#include "sdpa/kv_cache.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "support/reference.hpp"

namespace paged_kv_cache_test {

using Index = Eigen::Index;
using sdpa::Storage;
using sdpa_test::expect_invalid;
using sdpa_test::Rng;
using Tensor3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using Module = sdpa::ScaledDotProductAttention<float>;
using Paged = sdpa::PagedKVCache<float>;
using Cache = sdpa::KVCache<float>;
using Id = Paged::SequenceId;

Module make_module(Rng& rng) {
  Module m(48, 16, 16, 4, 0.0f, 2);
  m.eval();
  sdpa_test::randomize_module(m, rng, 0.15);
  m.set_rotary(sdpa::rope_linear(16, 10000, 2));
  return m;
}

Tensor3 random3(Rng& rng, Index a, Index b, Index c) {
  Tensor3 t(a, b, c);
  rng.fill_normal(t);
  return t;
}

Tensor3 row(const Tensor3& x, Index i) {
  Tensor3 out(1, x.dimension(1), x.dimension(2));
  std::copy_n(x.data() + i * out.size(), out.size(), out.data());
  return out;
}

// |a - b| over the rows of sequence i of a step's output, against that sequence's own output.
double diff(const Tensor3& batch_out, Index i, const Tensor3& alone) {
  double d = 0;
  for (Index j = 0; j < alone.size(); ++j)
    d = std::max(d, std::fabs(static_cast<double>(batch_out.data()[i * alone.size() + j]) - alone.data()[j]));
  return d;
}

class PagedStorage : public ::testing::TestWithParam<Storage> {};

// A ragged batch stepped together: each sequence's output (and its entries) as stepping it alone gives them.
TEST_P(PagedStorage, RaggedStepsMatchEachSequenceAlone) {
  const Storage s = GetParam();
  Rng rng(1);
  const Module m = make_module(rng);
  sdpa::AttentionOptions<float> o;
  o.alibi_slopes = sdpa::alibi_slopes<float>(4);
  o.softcap = 30;
  o.sinks = {0.2f, -0.5f, 1.0f, 0.0f};
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  const bool exact = sdpa::active_isa() != sdpa::Isa::kPortable;
  for (Index t : {Index(1), Index(3)}) {
    Paged paged(m, 32, 200, s);
    std::vector<Cache> alone;
    std::vector<Id> ids;
    for (Index prompt : {Index(100), Index(7), Index(300), Index(33)}) {
      ids.push_back(paged.add_sequence());
      alone.emplace_back(m, 1, 0, s);
      const Tensor3 x = random3(rng, 1, prompt, 48);
      (void)m.step(x, alone.back(), o);
      (void)m.step(x, paged, {ids.back()}, o);
    }
    for (int step = 0; step < 12; ++step) {
      sdpa::AttentionOptions<float> os = o;
      if (step % 2 == 1) os.device = &device;
      const Tensor3 x = random3(rng, 4, t, 48);
      const Tensor3 y = m.step(x, paged, ids, os);
      for (Index i = 0; i < 4; ++i) {
        const Tensor3 yi = m.step(row(x, i), alone[static_cast<std::size_t>(i)], o);
        if (exact) ASSERT_EQ(diff(y, i, yi), 0.0) << "step " << step << ", sequence " << i << ", " << t << " tokens";
        else ASSERT_LE(diff(y, i, yi), 1e-5) << "step " << step << ", sequence " << i;
      }
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(paged.size(ids[i]), alone[i].size());
      EXPECT_EQ(paged.position(ids[i]), alone[i].position());
      const Tensor3 a = paged.keys(ids[i]), b = alone[i].keys();
      for (Index j = 0; j < a.size(); ++j) ASSERT_EQ(a.data()[j], b.data()[j]);
    }
  }
}

// Sequences join and leave; a fork shares blocks until it diverges; truncate gives blocks back.
TEST_P(PagedStorage, JoinLeaveForkTruncate) {
  const Storage s = GetParam();
  Rng rng(2);
  const Module m = make_module(rng);
  Paged paged(m, 16, 64, s);
  EXPECT_EQ(paged.blocks_used(), 0);
  const Id a = paged.add_sequence(), b = paged.add_sequence();
  (void)m.step(random3(rng, 1, 40, 48), paged, {a});  // 3 blocks, the last with 8 entries
  (void)m.step(random3(rng, 1, 16, 48), paged, {b});  // 1 full block
  EXPECT_EQ(paged.blocks_used(), 4);
  EXPECT_EQ(paged.bytes(), 4 * paged.block_bytes());
  // The fork shares all three blocks of a.
  const Id f = paged.fork(a);
  EXPECT_EQ(paged.blocks_used(), 4);
  EXPECT_EQ(paged.size(f), 40);
  EXPECT_EQ(paged.position(f), 40);
  // Both continue with the same token: each its own copy of the partial block from now on, the same outputs.
  const Tensor3 x = random3(rng, 2, 1, 48);
  const Tensor3 both = m.step(Tensor3(x.constant(0.5f)), paged, {a, f});
  EXPECT_EQ(paged.blocks_used(), 5);  // the partial block copied once
  EXPECT_EQ(diff(both, 1, row(both, 0)), 0.0);
  // Then they diverge: a's entries are its own.
  const Tensor3 ka = paged.keys(a);
  (void)m.step(row(x, 1), paged, {f});
  const Tensor3 ka2 = paged.keys(a);
  for (Index j = 0; j < ka.size(); ++j) ASSERT_EQ(ka.data()[j], ka2.data()[j]);
  EXPECT_EQ(paged.size(f), 42);
  // A sequence alone with the same tokens as the fork.
  Cache ref(m, 1, 0, s);
  // (Refill a reference with a's first 40 entries: they are the fork's.)
  ref.assign(Tensor3(paged.keys(a).slice(Eigen::array<Index, 3>{0, 0, 0}, Eigen::array<Index, 3>{1, 40, paged.keys(a).dimension(2)})),
             Tensor3(paged.values(a).slice(Eigen::array<Index, 3>{0, 0, 0}, Eigen::array<Index, 3>{1, 40, paged.values(a).dimension(2)})), 40);
  (void)m.step(Tensor3(x.constant(0.5f).slice(Eigen::array<Index, 3>{0, 0, 0}, Eigen::array<Index, 3>{1, 1, 48})), ref);
  (void)m.step(row(x, 1), ref);
  const Tensor3 kf = paged.keys(f), kr = ref.keys();
  ASSERT_EQ(kf.size(), kr.size());
  for (Index j = 0; j < kf.size(); ++j) ASSERT_EQ(kf.data()[j], kr.data()[j]);
  // truncate: back to 20 entries (2 blocks), position with it.
  const Index used = paged.blocks_used();
  paged.truncate(f, 20);
  EXPECT_EQ(paged.size(f), 20);
  EXPECT_EQ(paged.position(f), 20);
  EXPECT_EQ(paged.blocks_used(), used - 1);  // its third block was its own; the first two are shared with a
  // Leaving: the blocks shared with a stay, the others return.
  paged.remove_sequence(f);
  EXPECT_FALSE(paged.contains(f));
  paged.remove_sequence(b);
  EXPECT_EQ(paged.blocks_used(), 3);
  const Id c = paged.add_sequence();
  EXPECT_GT(c, f);  // ids are not reused
  EXPECT_EQ(paged.sequences(), (std::vector<Id>{a, c}));
  paged.remove_sequence(a);
  paged.remove_sequence(c);
  EXPECT_EQ(paged.blocks_used(), 0);
}

// A sliding window: whole blocks no later query sees are dropped; the outputs are those of a KVCache with
// the same window (its rolling buffer drops other entries, so within rounding).
TEST_P(PagedStorage, SlidingWindowDropsWholeBlocks) {
  const Storage s = GetParam();
  Rng rng(3);
  const Module m = make_module(rng);
  Paged paged(m, 16, 40, s);
  Cache ref(m, 1, 0, s);
  const Id a = paged.add_sequence();
  sdpa::AttentionOptions<float> o;
  o.window_left = 40;
  for (int step = 0; step < 200; ++step) {
    const Tensor3 x = random3(rng, 1, 1 + step % 2, 48);
    const Tensor3 y = m.step(x, paged, {a}, o), yr = m.step(x, ref, o);
    ASSERT_LE(diff(y, 0, yr), 1e-5) << step;
    ASSERT_LE(paged.size(a), 40 + 16 + 2);
    EXPECT_EQ(paged.first_position(a) % 16, 0);
  }
  EXPECT_LE(paged.blocks_used(), 4);
}

// Pool exhaustion: refused with std::runtime_error before anything changes.
TEST_P(PagedStorage, ExhaustedPoolRefusesAndChangesNothing) {
  const Storage s = GetParam();
  Rng rng(4);
  const Module m = make_module(rng);
  Paged paged(m, 16, 5, s);
  const Id a = paged.add_sequence(), b = paged.add_sequence();
  (void)m.step(random3(rng, 1, 40, 48), paged, {a});  // 3 blocks
  (void)m.step(random3(rng, 1, 30, 48), paged, {b});  // 2 blocks
  const Tensor3 ka = paged.keys(a), kb = paged.keys(b);
  try {
    (void)m.step(random3(rng, 2, 9, 48), paged, {a, b});  // a needs 1 more block, b 1 more: none free
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("pool is exhausted"), std::string::npos) << msg;
    EXPECT_NE(msg.find("needs 2 more blocks"), std::string::npos) << msg;
  }
  EXPECT_EQ(paged.size(a), 40);
  EXPECT_EQ(paged.size(b), 30);
  EXPECT_EQ(paged.blocks_used(), 5);
  const Tensor3 ka2 = paged.keys(a);
  for (Index j = 0; j < ka.size(); ++j) ASSERT_EQ(ka.data()[j], ka2.data()[j]);
  (void)m.step(random3(rng, 2, 2, 48), paged, {a, b});  // fits in their last blocks
  EXPECT_EQ(paged.size(a), 42);
}

INSTANTIATE_TEST_SUITE_P(Storages, PagedStorage,
                         ::testing::Values(Storage::kFloat32, Storage::kBFloat16, Storage::kFloat16, Storage::kInt8),
                         [](const ::testing::TestParamInfo<Storage>& i) { return std::string(sdpa::storage_name(i.param)).substr(1); });

// 16 forks of a 2000-token prompt, each decoding 100 tokens: the blocks of one prompt and the 16
// continuations, within 1.1x of their entries (16 copies would take 16 prompts).
TEST(PagedKVCache, ForksShareTheirPrompt) {
  Rng rng(5);
  Module m(64, 16, 16, 4, 0.0f, 4);
  m.eval();
  Paged paged(m, 16, 400);
  const Id root = paged.add_sequence();
  (void)m.step(random3(rng, 1, 2000, 64), paged, {root});
  std::vector<Id> forks;
  for (int i = 0; i < 16; ++i) forks.push_back(paged.fork(root));
  paged.remove_sequence(root);
  for (int t = 0; t < 100; ++t) (void)m.step(random3(rng, 16, 1, 64), paged, forks);
  const double entries = 2000 + 16 * 100;
  const double used = static_cast<double>(paged.blocks_used() * paged.block_size());
  EXPECT_LE(used / entries, 1.1);
  EXPECT_EQ(paged.bytes(), static_cast<std::size_t>(paged.blocks_used()) * paged.block_bytes());
  for (Id f : forks) EXPECT_EQ(paged.size(f), 2100);
}

TEST(PagedKVCache, RefusesBadArguments) {
  Rng rng(6);
  Module m = make_module(rng);
  expect_invalid([&] { Paged p(m, 24, 4); }, {"PagedKVCache", "block_size", "multiple of 16", "24"});
  expect_invalid([&] { Paged p(m, 0, 4); }, {"block_size", "0"});
  expect_invalid([&] { Paged p(m, 16, -1); }, {"max_blocks", "-1"});
  expect_invalid([&] { Paged p(m, 16, 4, Storage::kFloat64); }, {"storage", "kFloat64"});
  sdpa::ScaledDotProductAttention<double> md(48, 16, 16, 4);
  expect_invalid([&] { sdpa::PagedKVCache<double> p(md, 16, 4, Storage::kInt8); }, {"storage", "kInt8"});
  Paged paged(m, 16, 8);
  const Id a = paged.add_sequence();
  expect_invalid([&] { paged.remove_sequence(a + 7); }, {"PagedKVCache::remove_sequence", "sequence id", std::to_string(a + 7)});
  expect_invalid([&] { paged.truncate(a, 1); }, {"PagedKVCache::truncate", "size", "[0, 0]", "1"});
  expect_invalid([&] { (void)paged.fork(a + 3); }, {"PagedKVCache::fork", "sequence id"});
  const Tensor3 x = random3(rng, 2, 1, 48);
  expect_invalid([&] { (void)m.step(x, paged, {a, a}); }, {"step (PagedKVCache)", "sequence_ids[1]", "distinct"});
  expect_invalid([&] { (void)m.step(x, paged, {a}); }, {"x dimension 0 (batch)", "1", "2"});
  expect_invalid([&] { (void)m.step(row(x, 0), paged, {a + 9}); }, {"sequence_ids[0]", std::to_string(a + 9)});
  sdpa::AttentionOptions<float> o;
  o.key_lengths = {1};
  expect_invalid([&] { (void)m.step(row(x, 0), paged, {a}, o); }, {"key_lengths", "PagedKVCache"});
  Module other(48, 16, 16, 4, 0.0f, 4);
  expect_invalid([&] { (void)other.step(row(x, 0), paged, {a}); }, {"cache", "kv_heads 4", "kv_heads 2"});
  EXPECT_EQ(paged.size(a), 0);
  EXPECT_EQ(paged.blocks_used(), 0);
}


// The caches' public decoding interface, as another user than the module would drive it: rows stored after
// the held ones become held on advance, read back exactly (float storage), and a write or advance beyond
// the room taken is refused, naming n and the room.
TEST(CacheInterface, StoreAdvanceAndRefusals) {
  Rng rng(31);
  Module m = make_module(rng);
  const Index width = m.kv_heads() * m.d_k();  // d_k == d_v here
  std::vector<float> k(static_cast<std::size_t>(3 * width)), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i) * 0.5f, v[i] = -static_cast<float>(i);

  Cache cache(m, /*batch=*/1);
  cache.make_room(3);
  cache.store_rows(false, 0, 0, k.data(), width, 3);
  cache.store_rows(true, 0, 0, v.data(), width, 3);
  EXPECT_EQ(cache.size(), 0);
  cache.advance(3);
  EXPECT_EQ(cache.size(), 3);
  EXPECT_EQ(cache.position(), 3);
  const Tensor3 keys = cache.keys(), values = cache.values();
  for (std::size_t i = 0; i < k.size(); ++i) {
    EXPECT_EQ(keys.data()[i], k[i]);
    EXPECT_EQ(values.data()[i], v[i]);
  }
  EXPECT_EQ(cache.rows().k.data, cache.key_rows(0));
  expect_invalid([&] { cache.advance(cache.capacity()); }, {"KVCache::advance", "n", "room"});
  expect_invalid([&] { cache.make_room(-1); }, {"KVCache::make_room", "extra"});

  Paged paged(m, /*block_size=*/16, /*max_blocks=*/4);
  const Id id = paged.add_sequence();
  paged.make_room({id}, 3);
  paged.store_rows(id, false, k.data(), width, 3);
  paged.store_rows(id, true, v.data(), width, 3);
  paged.advance(id, 3);
  EXPECT_EQ(paged.size(id), 3);
  EXPECT_EQ(paged.block_table(id)[0], 0);  // the lowest block is taken first
  const Tensor3 pk = paged.keys(id), pv = paged.values(id);
  for (std::size_t i = 0; i < k.size(); ++i) {
    EXPECT_EQ(pk.data()[i], k[i]);
    EXPECT_EQ(pv.data()[i], v[i]);
  }
  expect_invalid([&] { paged.store_rows(id, false, k.data(), width, 14); }, {"PagedKVCache::store_rows", "n", "[0, 13]"});
  expect_invalid([&] { paged.advance(id, 14); }, {"PagedKVCache::advance", "n", "[0, 13]"});
  expect_invalid([&] { paged.advance(id, -1); }, {"PagedKVCache::advance", "n"});
  EXPECT_EQ(paged.size(id), 3);
}

}  // namespace paged_kv_cache_test
