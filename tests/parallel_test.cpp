// Tests of sdpa/parallel.hpp: parallel_for covers [0, n) exactly once in chunks of at most `grain`, on the
// calling thread without a device and across the pool with one, and a call made from inside the pool's
// own tasks (every worker busy with such a call) completes instead of deadlocking, for the bare
// parallel_for and for the module's forward. parallel_for_with_state makes one state per thread that runs
// chunks.
#include "sdpa/parallel.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "sdpa/scaled_dot_product_attention.hpp"

namespace parallel_test {

using Index = Eigen::Index;

TEST(ParallelFor, CoversTheRangeOnceInBoundedChunks) {
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  const Eigen::ThreadPoolDevice* devices[2] = {nullptr, &device};
  for (const Eigen::ThreadPoolDevice* d : devices)
    for (Index n : {Index{0}, Index{1}, Index{7}, Index{64}, Index{1000}})
      for (Index grain : {Index{1}, Index{3}, Index{64}, Index{5000}}) {
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
        std::atomic<Index> longest{0};
        sdpa::parallel_for(d, n, grain, [&](Index begin, Index end) {
          Index seen = longest.load();
          while (end - begin > seen && !longest.compare_exchange_weak(seen, end - begin)) {
          }
          for (Index i = begin; i < end; ++i) hits[static_cast<std::size_t>(i)].fetch_add(1);
        });
        for (Index i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<std::size_t>(i)].load(), 1) << n << " " << grain << " " << i;
        if (d == nullptr) EXPECT_EQ(longest.load(), n);  // one call on the calling thread
        else EXPECT_LE(longest.load(), grain);
      }
}

// parallel_for_with_state: the same coverage; one state per thread that takes a chunk, made before its
// first chunk and finished once after its last, with every chunk run on the state of the thread running it.
TEST(ParallelForWithState, CoversTheRangeOnceWithOneStatePerThread) {
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  const Eigen::ThreadPoolDevice* devices[2] = {nullptr, &device};
  struct State {
    std::thread::id owner;
    int chunks = 0;
    bool finished = false;
  };
  for (const Eigen::ThreadPoolDevice* d : devices)
    for (Index n : {Index{0}, Index{1}, Index{7}, Index{64}, Index{1000}})
      for (Index grain : {Index{1}, Index{3}, Index{64}, Index{5000}}) {
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
        std::atomic<int> made{0}, finished{0}, chunks_finished{0}, wrong_owner{0}, too_long{0};
        sdpa::parallel_for_with_state(
            d, n, grain,
            [&] {
              made.fetch_add(1);
              return State{std::this_thread::get_id()};
            },
            [&](State& state, Index begin, Index end) {
              if (state.owner != std::this_thread::get_id() || state.finished) wrong_owner.fetch_add(1);
              if (end - begin > grain || end <= begin) too_long.fetch_add(1);
              ++state.chunks;
              for (Index i = begin; i < end; ++i) hits[static_cast<std::size_t>(i)].fetch_add(1);
            },
            [&](State& state) {
              if (state.owner != std::this_thread::get_id() || state.finished || state.chunks == 0) wrong_owner.fetch_add(1);
              state.finished = true;
              finished.fetch_add(1);
              chunks_finished.fetch_add(state.chunks);
            });
        for (Index i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<std::size_t>(i)].load(), 1) << n << " " << grain << " " << i;
        const Index chunks = (n + grain - 1) / grain;
        const int most = static_cast<int>(std::min<Index>(chunks, sdpa::worker_count(d)));
        EXPECT_LE(made.load(), most) << n << " " << grain;
        EXPECT_EQ(made.load() > 0, n > 0);
        EXPECT_EQ(finished.load(), made.load());
        EXPECT_EQ(chunks_finished.load(), chunks);
        EXPECT_EQ(wrong_owner.load(), 0);
        EXPECT_EQ(too_long.load(), 0);
      }
}

TEST(ParallelFor, UsesThePoolsThreads) {
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  std::atomic<int> in_pool{0};
  for (int attempt = 0; attempt < 50 && in_pool.load() == 0; ++attempt) {
    sdpa::parallel_for(&device, 64, 1, [&](Index, Index) {
      if (pool.CurrentThreadId() >= 0) in_pool.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    });
  }
  EXPECT_GT(in_pool.load(), 0);
}

// Runs `body` on every thread of a 2-thread pool at once (so no worker is free) and waits at most 60 s.
template <typename Body>
void run_on_every_worker(Eigen::ThreadPool& pool, Body body) {
  std::atomic<int> started{0}, finished{0};
  for (int w = 0; w < 2; ++w)
    pool.Schedule([&] {
      started.fetch_add(1);
      while (started.load() < 2) std::this_thread::yield();  // both workers are inside a task now
      body();
      finished.fetch_add(1);
    });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (finished.load() < 2 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(finished.load(), 2) << "parallel_for from inside the pool did not return (deadlock)";
}

TEST(ParallelFor, CalledFromInsideThePoolDoesNotDeadlock) {
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  std::atomic<Index> total{0};
  run_on_every_worker(pool, [&] {
    sdpa::parallel_for(&device, 100, 1, [&](Index begin, Index end) { total.fetch_add(end - begin); });
  });
  EXPECT_EQ(total.load(), 200);
}

TEST(ParallelFor, ForwardFromInsideThePoolDoesNotDeadlock) {
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  sdpa::ScaledDotProductAttention<float> att(32, 8, 8, 4, 0.0f);
  att.eval();
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(2, 40, 32);
  x.setRandom();
  // The same work split as from outside the pool (the chunks depend on the device, not on who runs them).
  const auto expected = att(x, x, x, nullptr, nullptr, &device);
  std::vector<Eigen::Tensor<float, 3, Eigen::RowMajor>> out(2);
  std::atomic<int> slot{0};
  run_on_every_worker(pool, [&] {
    out[static_cast<std::size_t>(slot.fetch_add(1))] = att(x, x, x, nullptr, nullptr, &device);
  });
  for (const auto& y : out) {
    ASSERT_EQ(y.size(), expected.size());
    for (Index i = 0; i < y.size(); ++i) ASSERT_EQ(y.data()[i], expected.data()[i]) << i;
  }
}

}  // namespace parallel_test
