// Work splitting over an Eigen::ThreadPoolDevice. Without a device (nullptr) everything runs on the calling
// thread; with one, the caller and the pool's threads take chunks of the index range from a shared atomic
// counter, which balances uneven work (causal masks, ragged tails) without a cost model.
#pragma once

#define EIGEN_USE_THREADS
#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <atomic>

namespace sdpa {

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
  const int workers = static_cast<int>(std::min<Eigen::Index>(worker_count(device), chunks));
  if (workers <= 1) {
    f(Eigen::Index{0}, n);
    return;
  }
  std::atomic<Eigen::Index> next{0};
  auto run = [&]() {
    for (Eigen::Index c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      const Eigen::Index begin = c * grain;
      f(begin, std::min(n, begin + grain));
    }
  };
  Eigen::Barrier barrier(static_cast<unsigned int>(workers - 1));
  for (int w = 1; w < workers; ++w) {
    device->enqueueNoNotification([&run, &barrier]() {
      run();
      barrier.Notify();
    });
  }
  run();
  barrier.Wait();
}

// A grain that gives each worker several chunks of [0, n) so that uneven chunks even out.
inline Eigen::Index balanced_grain(const Eigen::ThreadPoolDevice* device, Eigen::Index n,
                                   Eigen::Index chunks_per_worker = 4) noexcept {
  const Eigen::Index parts = static_cast<Eigen::Index>(worker_count(device)) * chunks_per_worker;
  return std::max<Eigen::Index>(1, (n + parts - 1) / parts);
}

}  // namespace sdpa
