// Tests of sdpa/kv_cache.hpp and the module's append / attend / step (float and double): a sequence fed
// through step in chunks of any sizes (1, 3, 7, past the decoding kernel's key chunks and its query limit,
// mixed) gives the rows of forward(x, x, x, {causal}); with window_left (the cache dropping old entries and
// staying small), ALiBi, key_lengths and a mask over the cache; attend for cross-attention equals
// forward(q, memory, memory) on both kernels; reorder and truncate against recomputation; batch entries
// independent; 1 and 2 threads; training-mode dropout in attend drops what forward drops for the same call
// index; every refusal leaves the cache unchanged; a step on a cache with room allocates nothing (operator new
// and the library's aligned_alloc counted) and can write into a caller's TensorMap.
#include "support/alloc_tracking.hpp"

#include "sdpa/kv_cache.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "support/reference.hpp"

namespace kv_cache_test {

using Index = Eigen::Index;
using sdpa_test::expect_invalid;
using sdpa_test::max_relative_error;
using sdpa_test::Rng;
using Mask = Eigen::Tensor<bool, 4, Eigen::RowMajor>;

template <typename T>
class KVCacheTest : public ::testing::Test {
 protected:
  using Module = sdpa::ScaledDotProductAttention<T>;
  using Cache = sdpa::KVCache<T>;
  using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;
  using Options = sdpa::AttentionOptions<T>;
  static constexpr bool kFloat = std::is_same<T, float>::value;
  static double tol() { return kFloat ? 1e-5 : 1e-12; }

  static Tensor3 random3(Rng& rng, Index a, Index b, Index c) {
    Tensor3 t(a, b, c);
    rng.fill_normal(t);
    return t;
  }
  static Module make_module(Rng& rng, Index d_model = 16, Index d_k = 4, Index d_v = 6, Index h = 2) {
    Module m(d_model, d_k, d_v, h);
    m.eval();
    sdpa_test::randomize_module(m, rng, 0.3);
    return m;
  }
  static Tensor3 rows(const Tensor3& x, Index t0, Index n) {
    const Eigen::array<Index, 3> off{0, t0, 0}, ext{x.dimension(0), n, x.dimension(2)};
    return x.slice(off, ext);
  }
  // Feeds x through step in chunks of the given sizes (cycled), each with options_for(t0, n); returns the
  // outputs stitched together.
  template <typename OptionsFor>
  static Tensor3 chunked(const Module& m, Cache& cache, const Tensor3& x, const std::vector<Index>& sizes,
                         OptionsFor options_for) {
    Tensor3 out(x.dimension(0), x.dimension(1), m.d_model());
    Index t0 = 0;
    for (std::size_t i = 0; t0 < x.dimension(1); ++i) {
      const Index n = std::min(sizes[i % sizes.size()], x.dimension(1) - t0);
      const Tensor3 y = m.step(rows(x, t0, n), cache, options_for(t0, n));
      for (Index b = 0; b < x.dimension(0); ++b)
        for (Index j = 0; j < n; ++j)
          for (Index d = 0; d < m.d_model(); ++d) out(b, t0 + j, d) = y(b, j, d);
      t0 += n;
    }
    return out;
  }
  // Everything observable of a cache, to check that a refused call changed nothing.
  struct Snapshot {
    Index batch, size, capacity, position;
    Tensor3 keys, values;
  };
  static Snapshot snapshot(const Cache& c) { return {c.batch(), c.size(), c.capacity(), c.position(), c.keys(), c.values()}; }
  static void expect_unchanged(const Cache& c, const Snapshot& s) {
    EXPECT_EQ(c.batch(), s.batch);
    EXPECT_EQ(c.size(), s.size);
    EXPECT_EQ(c.capacity(), s.capacity);
    EXPECT_EQ(c.position(), s.position);
    const Tensor3 k = c.keys(), v = c.values();
    ASSERT_EQ(k.size(), s.keys.size());
    for (Index i = 0; i < k.size(); ++i) ASSERT_EQ(k.data()[i], s.keys.data()[i]);
    for (Index i = 0; i < v.size(); ++i) ASSERT_EQ(v.data()[i], s.values.data()[i]);
  }
};

using ScalarTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(KVCacheTest, ScalarTypes);

TYPED_TEST(KVCacheTest, ChunkedStepsEqualTheCausalForward) {
  Rng rng(1);
  const auto m = TestFixture::make_module(rng);
  const Index n = 530;  // past two of the decoding kernel's key chunks
  const auto x = TestFixture::random3(rng, 2, n, 16);
  typename TestFixture::Options causal;
  causal.causal = true;
  const auto full = m.forward(x, x, x, causal);
  const std::vector<std::vector<Index>> plans = {{1}, {3}, {7}, {255, 1, 2}, {17}, {256}, {1, 16, 40, 3, 7}, {n}};
  for (const auto& plan : plans) {
    typename TestFixture::Cache cache(m, 2);
    const auto got = TestFixture::chunked(m, cache, x, plan, [](Index, Index) { return typename TestFixture::Options{}; });
    EXPECT_LT(max_relative_error(got, sdpa_test::to_array3(full)), TestFixture::tol()) << "chunks " << plan[0];
    EXPECT_EQ(cache.size(), n);
    EXPECT_EQ(cache.position(), n);
  }
}

// Head sizes past the decoding kernel's register chunk (64 floats, 32 doubles) and not a multiple of it:
// the chunked dot products and weighted sums and their remainders.
TYPED_TEST(KVCacheTest, WideHeadsStepsEqualTheCausalForward) {
  Rng rng(11);
  const auto m = TestFixture::make_module(rng, 24, 80, 72, 3);
  const Index n = 290;
  const auto x = TestFixture::random3(rng, 2, n, 24);
  typename TestFixture::Options causal;
  causal.causal = true;
  const auto full = m.forward(x, x, x, causal);
  for (const std::vector<Index>& plan : {std::vector<Index>{1}, std::vector<Index>{7, 1, 16}}) {
    typename TestFixture::Cache cache(m, 2);
    const auto got = TestFixture::chunked(m, cache, x, plan, [](Index, Index) { return typename TestFixture::Options{}; });
    EXPECT_LT(max_relative_error(got, sdpa_test::to_array3(full)), TestFixture::tol()) << "chunks " << plan[0];
  }
}

TYPED_TEST(KVCacheTest, SlidingWindowStepsDropOldEntriesAndMatchTheForward) {
  Rng rng(2);
  const auto m = TestFixture::make_module(rng);
  const Index n = 300, w = 20;
  const auto x = TestFixture::random3(rng, 2, n, 16);
  typename TestFixture::Options o;
  o.causal = true;
  o.window_left = w;
  const auto full = m.forward(x, x, x, o);
  for (const std::vector<Index>& plan : {std::vector<Index>{1}, std::vector<Index>{5, 1, 9}}) {
    typename TestFixture::Cache cache(m, 2);
    Index largest = 0;
    const auto got = TestFixture::chunked(m, cache, x, plan, [&](Index, Index) {
      largest = std::max(largest, cache.capacity());
      return o;
    });
    EXPECT_LT(max_relative_error(got, sdpa_test::to_array3(full)), TestFixture::tol());
    EXPECT_EQ(cache.position(), n);
    EXPECT_LT(cache.size(), n);  // entries were dropped
    EXPECT_LE(std::max(largest, cache.capacity()), 4 * (w + 9));  // O(window + chunk), not O(n)
    // The dropped entries are gone: a wider window, or none, is refused.
    const auto next = TestFixture::random3(rng, 2, 1, 16);
    const auto before = TestFixture::snapshot(cache);
    typename TestFixture::Options wider = o;
    wider.window_left = 10 * w;
    expect_invalid([&] { m.step(next, cache, wider); }, {"window_left", "dropped"});
    expect_invalid([&] { m.step(next, cache); }, {"window_left", "dropped"});
    TestFixture::expect_unchanged(cache, before);
  }
}

TYPED_TEST(KVCacheTest, AlibiKeyLengthsAndAMaskOverTheCache) {
  using T = TypeParam;
  Rng rng(3);
  const auto m = TestFixture::make_module(rng, 16, 4, 6, 4);
  const Index n = 40;
  const auto x = TestFixture::random3(rng, 2, n, 16);
  Mask mask(2, 1, n, n);
  for (Index i = 0; i < mask.size(); ++i) mask.data()[i] = rng.bernoulli(0.25);
  const std::vector<Index> lengths{n, 23};
  typename TestFixture::Options o;
  o.causal = true;
  o.alibi_slopes = sdpa::alibi_slopes<T>(4);
  o.key_lengths = lengths;
  o.attention_mask = &mask;
  const auto full = m.forward(x, x, x, o);
  std::vector<Mask> slices;
  slices.reserve(64);
  typename TestFixture::Cache cache(m, 2);
  const auto got = TestFixture::chunked(m, cache, x, {1, 3, 7}, [&](Index t0, Index c) {
    // The mask's rows of this chunk over the keys held after it; the lengths clipped to them.
    slices.emplace_back(2, 1, c, t0 + c);
    Mask& s = slices.back();
    for (Index b = 0; b < 2; ++b)
      for (Index i = 0; i < c; ++i)
        for (Index j = 0; j < t0 + c; ++j) s(b, 0, i, j) = mask(b, 0, t0 + i, j);
    typename TestFixture::Options oc;
    oc.alibi_slopes = o.alibi_slopes;
    oc.attention_mask = &s;
    for (Index l : lengths) oc.key_lengths.push_back(std::min(l, t0 + c));
    return oc;
  });
  EXPECT_LT(max_relative_error(got, sdpa_test::to_array3(full)), TestFixture::tol());
}

TYPED_TEST(KVCacheTest, AttendForCrossAttentionEqualsForward) {
  Rng rng(4);
  auto m = TestFixture::make_module(rng);
  const auto memory = TestFixture::random3(rng, 3, 300, 16);
  typename TestFixture::Cache cache(m, 3);
  m.append(memory, memory, cache);
  EXPECT_EQ(cache.size(), 300);
  for (Index nq : {Index(1), Index(5), Index(40)}) {  // the decoding kernel, and the tiled one past 16 queries
    const auto q = TestFixture::random3(rng, 3, nq, 16);
    typename TestFixture::Options o;
    o.key_lengths = {300, 17, 0};
    for (sdpa::MaskedRows policy : {sdpa::MaskedRows::kZero, sdpa::MaskedRows::kNaN}) {
      m.set_masked_rows(policy);
      EXPECT_LT(max_relative_error(m.attend(q, cache, o), sdpa_test::to_array3(m.forward(q, memory, memory, o))),
                TestFixture::tol())
          << "nq " << nq;
    }
    m.set_masked_rows(sdpa::MaskedRows::kZero);
    // Separate keys and values tensors append like one.
    typename TestFixture::Cache split(m, 3);
    const auto values = TestFixture::random3(rng, 3, 300, 16);
    m.append(memory, values, split);
    EXPECT_LT(max_relative_error(m.attend(q, split), sdpa_test::to_array3(m.forward(q, memory, values))), TestFixture::tol());
  }
}

// Decoding steps (few rows: projections that read each weight row once, the split-key kernel) give the
// same bits on 1 and 2 threads: their work split never changes an element's arithmetic. Long chunks go
// through the row-blocked projections, whose blocks follow the thread count: equal to rounding.
TYPED_TEST(KVCacheTest, TwoThreadsGiveTheSameSteps) {
  Rng rng(5);
  const auto m = TestFixture::make_module(rng, 32, 8, 8, 4);
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  auto on_device = [&](Index, Index) {
    typename TestFixture::Options o;
    o.device = &device;
    return o;
  };
  auto serial = [](Index, Index) { return typename TestFixture::Options{}; };
  {
    const auto x = TestFixture::random3(rng, 2, 600, 32);
    typename TestFixture::Cache one(m, 2), two(m, 2);
    const auto a = TestFixture::chunked(m, one, x, {1, 7, 5}, serial);
    const auto b = TestFixture::chunked(m, two, x, {1, 7, 5}, on_device);
    for (Index i = 0; i < a.size(); ++i) ASSERT_EQ(a.data()[i], b.data()[i]) << i;
  }
  const auto x = TestFixture::random3(rng, 2, 400, 32);
  typename TestFixture::Cache one(m, 2), two(m, 2);
  const auto a = TestFixture::chunked(m, one, x, {300, 1}, serial);
  const auto b = TestFixture::chunked(m, two, x, {300, 1}, on_device);
  EXPECT_LT(max_relative_error(b, sdpa_test::to_array3(a)), TestFixture::kFloat ? 1e-6 : 1e-14);
}

TYPED_TEST(KVCacheTest, ReorderAndTruncateAgainstRecomputation) {
  Rng rng(6);
  const auto m = TestFixture::make_module(rng);
  const auto x = TestFixture::random3(rng, 3, 12, 16);
  typename TestFixture::Cache cache(m, 3);
  (void)TestFixture::chunked(m, cache, x, {4}, [](Index, Index) { return typename TestFixture::Options{}; });
  // Beams: new entry i = old entry rows[i]; the batch changes size.
  const std::vector<Index> rows{2, 0, 0, 1};
  cache.reorder(rows);
  EXPECT_EQ(cache.batch(), 4);
  typename TestFixture::Tensor3 x4(4, 12, 16), next(4, 1, 16);
  rng.fill_normal(next);
  for (Index i = 0; i < 4; ++i)
    for (Index t = 0; t < 12; ++t)
      for (Index d = 0; d < 16; ++d) x4(i, t, d) = x(rows[static_cast<std::size_t>(i)], t, d);
  typename TestFixture::Tensor3 x5(4, 13, 16);
  x5.slice(Eigen::array<Index, 3>{0, 0, 0}, Eigen::array<Index, 3>{4, 12, 16}) = x4;
  x5.slice(Eigen::array<Index, 3>{0, 12, 0}, Eigen::array<Index, 3>{4, 1, 16}) = next;
  typename TestFixture::Options causal;
  causal.causal = true;
  const auto full = m.forward(x5, x5, x5, causal);
  const auto y = m.step(next, cache);
  EXPECT_LT(max_relative_error(y, sdpa_test::to_array3(TestFixture::rows(full, 12, 1))), TestFixture::tol());
  // Truncate the last 5 entries and retry with other tokens.
  cache.truncate(8);
  EXPECT_EQ(cache.position(), 8);
  EXPECT_EQ(cache.size(), 8);
  const auto other = TestFixture::random3(rng, 4, 2, 16);
  typename TestFixture::Tensor3 x6(4, 10, 16);
  x6.slice(Eigen::array<Index, 3>{0, 0, 0}, Eigen::array<Index, 3>{4, 8, 16}) = TestFixture::rows(x4, 0, 8);
  x6.slice(Eigen::array<Index, 3>{0, 8, 0}, Eigen::array<Index, 3>{4, 2, 16}) = other;
  const auto full6 = m.forward(x6, x6, x6, causal);
  EXPECT_LT(max_relative_error(m.step(other, cache), sdpa_test::to_array3(TestFixture::rows(full6, 8, 2))), TestFixture::tol());
  cache.clear();
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(cache.position(), 0);
}

TYPED_TEST(KVCacheTest, BatchEntriesAreIndependent) {
  Rng rng(7);
  const auto m = TestFixture::make_module(rng);
  const auto x = TestFixture::random3(rng, 2, 9, 16);
  typename TestFixture::Cache both(m, 2), alone(m, 1);
  const auto y = TestFixture::chunked(m, both, x, {2}, [](Index, Index) { return typename TestFixture::Options{}; });
  const typename TestFixture::Tensor3 x0 = x.slice(Eigen::array<Index, 3>{1, 0, 0}, Eigen::array<Index, 3>{1, 9, 16});
  const auto y0 = TestFixture::chunked(m, alone, x0, {2}, [](Index, Index) { return typename TestFixture::Options{}; });
  for (Index t = 0; t < 9; ++t)
    for (Index d = 0; d < 16; ++d) EXPECT_NEAR(y(1, t, d), y0(0, t, d), 1e-5);
}

// Training mode: attend takes the module's next dropout call, and drops exactly what forward drops with the
// same call index (the same counter-based sampler and coordinates).
TYPED_TEST(KVCacheTest, DropoutInAttendDropsWhatForwardDrops) {
  using T = TypeParam;
  Rng rng(8);
  typename TestFixture::Module m(16, 4, 6, 2, T(0.5));
  sdpa_test::randomize_module(m, rng, 0.3);
  const auto memory = TestFixture::random3(rng, 2, 50, 16), q = TestFixture::random3(rng, 2, 3, 16);
  typename TestFixture::Cache cache(m, 2);
  m.append(memory, memory, cache);  // draws nothing
  m.manual_seed(9);
  const auto a = m.attend(q, cache);
  m.manual_seed(9);
  const auto b = m.forward(q, memory, memory);
  EXPECT_LT(max_relative_error(a, sdpa_test::to_array3(b)), TestFixture::tol());
  EXPECT_GT(max_relative_error(a, sdpa_test::to_array3(m.forward(q, memory, memory))), 1e-3);  // another call: other masks
}

TYPED_TEST(KVCacheTest, RefusalsLeaveTheCacheUnchanged) {
  using T = TypeParam;
  Rng rng(9);
  const auto m = TestFixture::make_module(rng);
  typename TestFixture::Cache cache(m, 2);
  (void)m.step(TestFixture::random3(rng, 2, 5, 16), cache);
  const auto before = TestFixture::snapshot(cache);
  expect_invalid([&] { m.step(TestFixture::random3(rng, 3, 1, 16), cache); }, {"x dimension 0 (batch)", "2", "(3, 1, 16)"});
  expect_invalid([&] { m.step(TestFixture::random3(rng, 2, 1, 15), cache); }, {"x dimension 2 (d_model)", "16"});
  expect_invalid([&] { m.append(TestFixture::random3(rng, 2, 1, 16), TestFixture::random3(rng, 2, 2, 16), cache); },
                 {"values dimension 1", "1"});
  const typename TestFixture::Module other(16, 2, 6, 4);  // same h * d_k, other h
  expect_invalid([&] { other.step(TestFixture::random3(rng, 2, 1, 16), cache); }, {"cache", "kv_heads 4", "kv_heads 2"});
  typename TestFixture::Options o;
  o.alibi_slopes = {T(1)};
  expect_invalid([&] { m.step(TestFixture::random3(rng, 2, 1, 16), cache, o); }, {"alibi_slopes"});
  o = {};
  o.key_lengths = {7, 3};  // past the 6 entries held after the step
  expect_invalid([&] { m.step(TestFixture::random3(rng, 2, 1, 16), cache, o); }, {"key_lengths[0]", "[0, 6]"});
  const Mask wrong(2, 1, 1, 5);  // the step's keys are the 6 entries after the append
  o = {};
  o.attention_mask = &wrong;
  expect_invalid([&] { m.step(TestFixture::random3(rng, 2, 1, 16), cache, o); }, {"attention_mask", "dimension 3"});
  typename TestFixture::Tensor3 small(2, 1, 15);
  expect_invalid([&] { m.step(TestFixture::random3(rng, 2, 1, 16), cache, {}, Eigen::TensorMap<typename TestFixture::Tensor3>(small.data(), 2, 1, 15)); },
                 {"out", "(2, 1, 16)"});
  expect_invalid([&] { cache.reorder({0, 2}); }, {"rows[1]", "[0, 2)", "2"});
  expect_invalid([&] { cache.truncate(6); }, {"size", "[0, 5]", "6"});
  expect_invalid([&] { cache.truncate(-1); }, {"size", "-1"});
  expect_invalid([&] { cache.reserve(-3); }, {"capacity", "-3"});
  TestFixture::expect_unchanged(cache, before);
  expect_invalid([&] { typename TestFixture::Cache bad(m, -1); }, {"batch", "-1"});
}

// Once the cache has room, a step on the calling thread allocates nothing, and writes into the caller's
// output through a TensorMap.
TYPED_TEST(KVCacheTest, StepsWithRoomAllocateNothing) {
  Rng rng(10);
  const auto m = TestFixture::make_module(rng, 32, 8, 8, 4);
  for (Index batch : {Index(1), Index(8)}) {
    typename TestFixture::Cache cache(m, batch, 600);
    const auto prompt = TestFixture::random3(rng, batch, 300, 32);
    (void)m.step(prompt, cache);
    const auto token = TestFixture::random3(rng, batch, 1, 32);
    std::vector<TypeParam> out(static_cast<std::size_t>(batch * 32));
    Eigen::TensorMap<typename TestFixture::Tensor3> out_map(out.data(), batch, 1, 32);
    typename TestFixture::Options o;
    o.alibi_slopes = sdpa::alibi_slopes<TypeParam>(4);
    m.step(token, cache, o, out_map);  // warms the step's scratch up
    long allocations = 0;
    {
      sdpa_test::alloc::Scope scope;  // operator new and the library's aligned_alloc
      for (int i = 0; i < 20; ++i) m.step(token, cache, o, out_map);
      allocations = scope.count();
    }
    EXPECT_EQ(allocations, 0) << "batch " << batch;
    // The TensorMap got the step's result.
    cache.truncate(cache.size() - 1);
    const auto y = m.step(token, cache, o);
    for (Index i = 0; i < y.size(); ++i) ASSERT_EQ(y.data()[i], out[static_cast<std::size_t>(i)]);
  }
}

TYPED_TEST(KVCacheTest, PositionsAndGrowth) {
  Rng rng(11);
  const auto m = TestFixture::make_module(rng);
  typename TestFixture::Cache cache(m, 1);
  EXPECT_EQ(cache.capacity(), 0);
  Index grows = 0, last = 0;
  for (int t = 0; t < 100; ++t) {
    (void)m.step(TestFixture::random3(rng, 1, 1, 16), cache);
    if (cache.capacity() != last) ++grows;
    last = cache.capacity();
  }
  EXPECT_EQ(cache.position(), 100);
  EXPECT_LE(grows, 8);  // amortised: doubling
  cache.reserve(1000);
  EXPECT_EQ(cache.capacity(), 1000);
  EXPECT_EQ(cache.size(), 100);
  // The held entries are fc_k and fc_v of the inputs.
  typename TestFixture::Cache c2(m, 1);
  const auto x = TestFixture::random3(rng, 1, 3, 16);
  m.append(x, x, c2);
  const auto k = m.fc_k()(x), v = m.fc_v()(x);
  EXPECT_LT(max_relative_error(c2.keys(), sdpa_test::to_array3(k)), 1e-6);
  EXPECT_LT(max_relative_error(c2.values(), sdpa_test::to_array3(v)), 1e-6);
}

}  // namespace kv_cache_test
