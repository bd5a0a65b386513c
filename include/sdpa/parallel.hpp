// Work splitting over an Eigen::ThreadPoolDevice. Without a device (nullptr) everything runs on the calling
// thread; with one, the caller and the pool's threads take chunks of the index range from a shared atomic
// counter, which balances uneven work (causal masks, ragged tails) without a cost model. The caller never
// waits for a helper that has not started: it takes chunks itself until none is left and then waits only
// for chunks already being run, so a call made from inside the pool's own tasks (every worker busy) runs
// on the calling thread instead of deadlocking. parallel_for_with_state does the same with a state (a
// worker's scratch) made once per thread that takes part, for kernels whose chunks share it.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

SDPA_NAMESPACE_BEGIN

// Number of workers `parallel_for` uses with this device.
inline int worker_count(const Eigen::ThreadPoolDevice* device) noexcept {
  return device == nullptr ? 1 : std::max(1, device->numThreads());
}

// Calls f(begin, end) over disjoint chunks covering [0, n), each at most `grain` long. f must not throw:
// callers validate everything before they parallelise.
template <typename F>
void parallel_for(const Eigen::ThreadPoolDevice* device, Eigen::Index n, Eigen::Index grain, F&& f) {
  if (n <= 0) return;
  grain = std::max<Eigen::Index>(1, grain);
  const Eigen::Index chunks = (n + grain - 1) / grain;
  const int helpers = static_cast<int>(std::min<Eigen::Index>(worker_count(device), chunks)) - 1;
  if (helpers <= 0) {
    f(Eigen::Index{0}, n);
    return;
  }
  // Shared with the helper tasks, which may start after this call has returned (when the pool was busy and
  // the caller ran every chunk): such a task finds no chunk left and touches nothing but this state, which
  // it keeps alive.
  struct State {
    explicit State(Eigen::Index c) : chunks(c) {}
    const Eigen::Index chunks;
    std::atomic<Eigen::Index> next{0};
    Eigen::Index done = 0;  // chunks finished, under `mutex`
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto state = std::make_shared<State>(chunks);
  // Runs the claimed chunk c and then claims more. It lives on the caller's stack, which stays valid
  // while any chunk is claimed but unfinished: the caller waits for all of them.
  auto run_from = [grain, n, &f](State& s, Eigen::Index c) {
    Eigen::Index ran = 0;
    for (; c < s.chunks; c = s.next.fetch_add(1, std::memory_order_relaxed)) {
      const Eigen::Index begin = c * grain;
      f(begin, std::min(n, begin + grain));
      ++ran;
    }
    std::lock_guard<std::mutex> lock(s.mutex);
    s.done += ran;
    if (s.done == s.chunks) s.finished.notify_all();
  };
  const auto* run = &run_from;
  for (int w = 0; w < helpers; ++w) {
    device->enqueueNoNotification([state, run]() {
      const Eigen::Index c = state->next.fetch_add(1, std::memory_order_relaxed);
      if (c < state->chunks) (*run)(*state, c);
    });
  }
  run_from(*state, state->next.fetch_add(1, std::memory_order_relaxed));
  std::unique_lock<std::mutex> lock(state->mutex);
  state->finished.wait(lock, [&] { return state->done == state->chunks; });
}

// The same chunks of [0, n) (at most `grain` long, from one shared counter), run as f(state, begin, end)
// with a state that each thread taking part makes once with make(), before its first chunk, and hands to
// finish(state) after its last: a worker's scratch (tile buffers, packed operands) is allocated and first
// touched once per call instead of once per chunk. A thread that finds no chunk left makes no state.
// make, f and finish must not throw.
struct NoFinish {
  template <typename State>
  void operator()(State&) const noexcept {}
};

template <typename Make, typename F, typename Finish = NoFinish>
void parallel_for_with_state(const Eigen::ThreadPoolDevice* device, Eigen::Index n, Eigen::Index grain, Make&& make,
                             F&& f, Finish&& finish = Finish{}) {
  if (n <= 0) return;
  grain = std::max<Eigen::Index>(1, grain);
  const Eigen::Index chunks = (n + grain - 1) / grain;
  std::atomic<Eigen::Index> next{0};
  parallel_for(device, std::min<Eigen::Index>(worker_count(device), chunks), 1, [&](Eigen::Index, Eigen::Index) {
    Eigen::Index c = next.fetch_add(1, std::memory_order_relaxed);
    if (c >= chunks) return;
    auto state = make();
    for (; c < chunks; c = next.fetch_add(1, std::memory_order_relaxed)) {
      const Eigen::Index begin = c * grain;
      f(state, begin, std::min(n, begin + grain));
    }
    finish(state);
  });
}

// A grain that gives each worker several chunks of [0, n) so that uneven chunks even out.
inline Eigen::Index balanced_grain(const Eigen::ThreadPoolDevice* device, Eigen::Index n,
                                   Eigen::Index chunks_per_worker = 4) noexcept {
  const Eigen::Index parts = static_cast<Eigen::Index>(worker_count(device)) * chunks_per_worker;
  return std::max<Eigen::Index>(1, (n + parts - 1) / parts);
}

SDPA_NAMESPACE_END
