// The scratch a module keeps from one call to the next: the projected q/k/v and the attention output
// before fc_o. They are large (they grow with the batch and the sequence length) and the kernel only writes
// them, but a fresh allocation of that size is a fresh mapping whose pages the kernel zero-fills on first
// touch, a cost huge pages reduce but do not remove. A call takes the smallest kept buffer that is
// large enough and gives its buffers back when it is done; concurrent calls on one module each take their
// own (a call that finds none allocates), so the pool only ever costs a short lock per buffer. It keeps at
// most kSlots buffers, so what a module holds between calls is bounded by its few largest recent buffers;
// ScaledDotProductAttention::release_scratch() frees them.
#pragma once

#include "sdpa/config.hpp"

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "sdpa/detail/buffer.hpp"

SDPA_NAMESPACE_BEGIN
namespace detail {

template <typename Scalar>
class ScratchPool {
 public:
  static constexpr std::size_t kSlots = 4;

  ScratchPool() : state_(std::make_unique<State>()) {}
  // A copy starts empty: scratch belongs to the object that allocated it.
  ScratchPool(const ScratchPool&) : ScratchPool() {}
  ScratchPool& operator=(const ScratchPool&) noexcept { return *this; }
  ScratchPool(ScratchPool&&) noexcept = default;
  ScratchPool& operator=(ScratchPool&&) noexcept = default;
  void swap(ScratchPool& other) noexcept { state_.swap(other.state_); }

  // Storage for `count` elements, uninitialised (a kept buffer holds whatever its last user wrote).
  Buffer<Scalar> take(std::size_t count) {
    Buffer<Scalar> out, too_small;
    if (count == 0) return out;
    if (state_ != nullptr) {
      std::lock_guard<std::mutex> lock(state_->mutex);
      std::vector<Buffer<Scalar>>& kept = state_->kept;
      auto best = kept.end(), largest = kept.end();
      for (auto it = kept.begin(); it != kept.end(); ++it) {
        if (it->capacity() >= count && (best == kept.end() || it->capacity() < best->capacity())) best = it;
        if (largest == kept.end() || it->capacity() > largest->capacity()) largest = it;
      }
      if (best != kept.end()) {
        out = std::move(*best);
        kept.erase(best);
        out.shrink_to(count);
        return out;
      }
      // None fits: this call's new buffer will take the place of the largest kept one, freed first (below,
      // outside the lock) so that the two are never held at once.
      if (largest != kept.end()) {
        too_small = std::move(*largest);
        kept.erase(largest);
      }
    }
    too_small = Buffer<Scalar>();
    out.reset(count);
    return out;
  }

  // Keeps `buffer` for a later take; with kSlots kept already, the smallest of them all is freed.
  void give(Buffer<Scalar>&& buffer) noexcept {
    if (buffer.capacity() == 0) return;
    Buffer<Scalar> dropped;
    if (state_ == nullptr) return;  // moved from
    try {
      std::lock_guard<std::mutex> lock(state_->mutex);
      std::vector<Buffer<Scalar>>& kept = state_->kept;
      kept.reserve(kSlots + 1);
      kept.push_back(std::move(buffer));
      if (kept.size() > kSlots) {
        auto smallest = std::min_element(kept.begin(), kept.end(), [](const Buffer<Scalar>& a, const Buffer<Scalar>& b) {
          return a.capacity() < b.capacity();
        });
        dropped = std::move(*smallest);
        kept.erase(smallest);
      }
    } catch (...) {
      // No room to keep it (allocation or lock failure): the buffer is simply freed.
    }
  }

  // Frees everything kept.
  void clear() {
    if (state_ == nullptr) return;
    std::vector<Buffer<Scalar>> kept;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      kept.swap(state_->kept);
    }
  }

  // The bytes kept between calls.
  std::size_t bytes() const {
    if (state_ == nullptr) return 0;
    std::lock_guard<std::mutex> lock(state_->mutex);
    std::size_t total = 0;
    for (const Buffer<Scalar>& b : state_->kept) total += b.capacity() * sizeof(Scalar);
    return total;
  }

 private:
  struct State {
    std::mutex mutex;
    std::vector<Buffer<Scalar>> kept;
  };
  // Behind a pointer so that a swap or a move (of the module, never concurrent with its calls) need not
  // lock; null only in a moved-from pool, which keeps nothing.
  std::unique_ptr<State> state_;
};

}  // namespace detail
SDPA_NAMESPACE_END
