// Tests of sdpa/mask.hpp (broadcast views, key-padding and causal masks) and sdpa/parallel.hpp
// (parallel_for covers every index exactly once, whatever the pool, n and grain).
#include "sdpa/mask.hpp"
#include "sdpa/parallel.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/reference.hpp"

namespace mask_test {

using Index = Eigen::Index;
using sdpa::Mask;
using sdpa_test::expect_invalid;
using Weights = Eigen::Tensor<float, 4, Eigen::RowMajor>;

std::string shape_str(const std::array<Index, 4>& d) {
  std::ostringstream os;
  os << "(" << d[0] << ", " << d[1] << ", " << d[2] << ", " << d[3] << ")";
  return os.str();
}

// ------------------------------------------------------------------------------------ make_broadcast_view

TEST(BroadcastView, NullGivesEmptyView) {
  const auto view = sdpa::make_broadcast_view<float>(nullptr, {2, 3, 4, 5}, "where", "w");
  EXPECT_FALSE(static_cast<bool>(view));
  EXPECT_EQ(view.data, nullptr);
}

TEST(BroadcastView, StridesAndElementsForEveryForm) {
  const std::array<Index, 4> full{2, 3, 4, 5};
  for (int form = 0; form < 16; ++form) {
    std::array<Index, 4> d{};
    for (int i = 0; i < 4; ++i) d[static_cast<std::size_t>(i)] = ((form >> (3 - i)) & 1) ? full[static_cast<std::size_t>(i)] : 1;
    SCOPED_TRACE(shape_str(d));
    Weights t(d[0], d[1], d[2], d[3]);
    for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(i);
    const auto view = sdpa::make_broadcast_view(&t, full, "where", "w");
    ASSERT_TRUE(static_cast<bool>(view));
    EXPECT_EQ(view.data, t.data());
    // Expected strides: row-major strides of t, 0 where t has extent 1.
    std::array<Index, 4> dense{d[1] * d[2] * d[3], d[2] * d[3], d[3], 1};
    for (int i = 0; i < 4; ++i) {
      const auto s = static_cast<std::size_t>(i);
      EXPECT_EQ(view.stride[s], d[s] == 1 ? 0 : dense[s]) << "dimension " << i;
    }
    for (Index b = 0; b < 2; ++b)
      for (Index h = 0; h < 3; ++h)
        for (Index q = 0; q < 4; ++q)
          for (Index k = 0; k < 5; ++k) {
            const float want = t(d[0] == 1 ? 0 : b, d[1] == 1 ? 0 : h, d[2] == 1 ? 0 : q, d[3] == 1 ? 0 : k);
            ASSERT_EQ(view(b, h, q, k), want) << b << h << q << k;
            ASSERT_EQ(view.data[view.row_offset(b, h, q) + k * view.stride[3]], want);
          }
  }
}

TEST(BroadcastView, FullDimensionOfOneAndZero) {
  // Where the full extent is itself 1 the dimension broadcasts trivially; a full extent of 0 accepts 0 or 1.
  Mask m(1, 1, 3, 0);
  const auto view = sdpa::make_broadcast_view(&m, {1, 1, 3, 0}, "where", "m");
  EXPECT_EQ(view.stride[0], 0);
  EXPECT_EQ(view.stride[1], 0);
  Mask one(1, 1, 1, 1);
  one.setConstant(true);
  const auto v1 = sdpa::make_broadcast_view(&one, {2, 2, 2, 0}, "where", "m");
  EXPECT_EQ(v1.stride, (std::array<Index, 4>{0, 0, 0, 0}));
}

TEST(BroadcastView, RefusesEachWrongDimension) {
  const std::array<Index, 4> full{2, 3, 4, 5};
  const char* axes[4] = {"batch", "heads", "queries", "keys"};
  for (int dim = 0; dim < 4; ++dim) {
    for (Index wrong : {full[static_cast<std::size_t>(dim)] + 1, full[static_cast<std::size_t>(dim)] - 1 == 1 ? Index{0}
                                                                                                            : full[static_cast<std::size_t>(dim)] - 1}) {
      std::array<Index, 4> d = full;
      d[static_cast<std::size_t>(dim)] = wrong;
      SCOPED_TRACE(shape_str(d));
      Mask m(d[0], d[1], d[2], d[3]);
      m.setConstant(false);
      expect_invalid([&] { sdpa::make_broadcast_view(&m, full, "SomeCaller", "my_mask"); },
                     {"SomeCaller", "my_mask", "dimension " + std::to_string(dim), axes[dim],
                      "1 or " + std::to_string(full[static_cast<std::size_t>(dim)]), shape_str(full), shape_str(d)});
    }
  }
}

// ------------------------------------------------------------------------------------ key padding, causal

TEST(KeyPaddingMask, ContentsAgainstLoop) {
  const std::vector<Index> lengths{0, 3, 7, 1};
  const Index nk = 7;
  const Mask m = sdpa::key_padding_mask(lengths, nk);
  ASSERT_EQ(m.dimension(0), 4);
  ASSERT_EQ(m.dimension(1), 1);
  ASSERT_EQ(m.dimension(2), 1);
  ASSERT_EQ(m.dimension(3), nk);
  for (Index b = 0; b < 4; ++b)
    for (Index k = 0; k < nk; ++k) EXPECT_EQ(m(b, 0, 0, k), k >= lengths[static_cast<std::size_t>(b)]) << b << "," << k;
}

TEST(KeyPaddingMask, EmptyCases) {
  const Mask none = sdpa::key_padding_mask({}, 5);
  EXPECT_EQ(none.dimension(0), 0);
  EXPECT_EQ(none.dimension(3), 5);
  const Mask zero_keys = sdpa::key_padding_mask({0, 0, 0}, 0);
  EXPECT_EQ(zero_keys.dimension(0), 3);
  EXPECT_EQ(zero_keys.dimension(3), 0);
}

TEST(KeyPaddingMask, RefusesBadArguments) {
  expect_invalid([] { sdpa::key_padding_mask({1}, -1); }, {"key_padding_mask", "nk", "non-negative", "-1"});
  expect_invalid([] { sdpa::key_padding_mask({2, -1}, 4); }, {"key_padding_mask", "lengths[1]", "[0, 4]", "-1"});
  expect_invalid([] { sdpa::key_padding_mask({2, 4, 5}, 4); }, {"key_padding_mask", "lengths[2]", "[0, 4]", "5"});
}

TEST(CausalMask, ContentsAgainstLoop) {
  const std::pair<Index, Index> sizes[] = {{5, 5}, {3, 6}, {6, 3}, {1, 1}, {1, 4}, {4, 1}, {0, 3}, {3, 0}};
  for (const auto& s : sizes) {
    SCOPED_TRACE(::testing::Message() << s.first << "x" << s.second);
    const Mask m = sdpa::causal_mask(s.first, s.second);
    ASSERT_EQ(m.dimension(0), 1);
    ASSERT_EQ(m.dimension(1), 1);
    ASSERT_EQ(m.dimension(2), s.first);
    ASSERT_EQ(m.dimension(3), s.second);
    for (Index q = 0; q < s.first; ++q)
      for (Index k = 0; k < s.second; ++k) EXPECT_EQ(m(0, 0, q, k), k > q) << q << "," << k;
  }
  // torch.triu(ones(3, 3), 1) spelled out.
  const Mask m = sdpa::causal_mask(3, 3);
  const bool want[3][3] = {{false, true, true}, {false, false, true}, {false, false, false}};
  for (int q = 0; q < 3; ++q)
    for (int k = 0; k < 3; ++k) EXPECT_EQ(m(0, 0, q, k), want[q][k]);
}

TEST(CausalMask, RefusesNegativeSizes) {
  expect_invalid([] { sdpa::causal_mask(-1, 3); }, {"causal_mask", "nq", "non-negative", "-1"});
  expect_invalid([] { sdpa::causal_mask(3, -2); }, {"causal_mask", "nk", "non-negative", "-2"});
}

// ------------------------------------------------------------------------------------------ parallel_for

struct PoolCase {
  std::unique_ptr<Eigen::ThreadPool> pool;
  std::unique_ptr<Eigen::ThreadPoolDevice> device;
};

PoolCase make_pool(int threads) {
  PoolCase c;
  if (threads > 0) {
    c.pool = std::make_unique<Eigen::ThreadPool>(threads);
    c.device = std::make_unique<Eigen::ThreadPoolDevice>(c.pool.get(), threads);
  }
  return c;
}

TEST(ParallelFor, CoversEveryIndexExactlyOnce) {
  for (int threads : {0, 1, 2, 4}) {  // 0: no device
    PoolCase pc = make_pool(threads);
    EXPECT_EQ(sdpa::worker_count(pc.device.get()), threads == 0 ? 1 : threads);
    for (Index n : {Index{0}, Index{1}, Index{7}, Index{1000}}) {
      for (Index grain : {Index{-3}, Index{0}, Index{1}, Index{3}, Index{7}, Index{64}, Index{999}, Index{1000},
                          Index{5000}, sdpa::balanced_grain(pc.device.get(), n)}) {
        SCOPED_TRACE(::testing::Message() << "threads=" << threads << " n=" << n << " grain=" << grain);
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
        for (auto& h : hits) h.store(0);
        std::atomic<int> bad_chunks{0}, calls{0};
        const Index max_len = std::max<Index>(1, grain);
        sdpa::parallel_for(pc.device.get(), n, grain, [&](Index b, Index e) {
          calls.fetch_add(1);
          if (!(0 <= b && b < e && e <= n && e - b <= std::max(max_len, n))) bad_chunks.fetch_add(1);
          // Chunks are at most `grain` long unless the range is run in one piece.
          if (e - b > max_len && !(b == 0 && e == n)) bad_chunks.fetch_add(1);
          for (Index i = b; i < e; ++i) hits[static_cast<std::size_t>(i)].fetch_add(1);
        });
        EXPECT_EQ(bad_chunks.load(), 0);
        if (n == 0) {
          EXPECT_EQ(calls.load(), 0);
        }
        for (Index i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<std::size_t>(i)].load(), 1) << "index " << i;
      }
    }
  }
}

TEST(ParallelFor, UsesThePoolThreads) {
  // With a pool and many slow-ish chunks, more than one thread takes part (otherwise the pool is unused).
  PoolCase pc = make_pool(4);
  std::mutex mu;
  std::vector<std::thread::id> ids;
  sdpa::parallel_for(pc.device.get(), 64, 1, [&](Index, Index) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::lock_guard<std::mutex> lock(mu);
    if (std::find(ids.begin(), ids.end(), std::this_thread::get_id()) == ids.end()) ids.push_back(std::this_thread::get_id());
  });
  EXPECT_GT(ids.size(), 1u);
  EXPECT_LE(ids.size(), 4u);
}

TEST(ParallelFor, BalancedGrain) {
  EXPECT_EQ(sdpa::balanced_grain(nullptr, 0), 1);
  EXPECT_EQ(sdpa::balanced_grain(nullptr, 100, 4), 25);
  PoolCase pc = make_pool(2);
  EXPECT_EQ(sdpa::balanced_grain(pc.device.get(), 100, 4), 13);
  EXPECT_EQ(sdpa::balanced_grain(pc.device.get(), 100, 1), 50);
}

}  // namespace mask_test
