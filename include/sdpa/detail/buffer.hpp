// Scratch buffers for the projected q/k/v and the attention output. They are large (they grow with the
// batch and the sequence length) and live for one forward call, so first-touch page faults would be a
// sizeable share of the call: on Linux, buffers of 2 MiB and more are aligned to 2 MiB and advised for
// transparent huge pages, which cuts the faults 512-fold. Elsewhere they are plain aligned allocations.
#pragma once

#include "sdpa/config.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

SDPA_NAMESPACE_BEGIN
namespace detail {

// Advises the 2 MiB pages wholly inside [p, p + bytes) for transparent huge pages, before anything touches
// them. For memory sdpa does not allocate itself (the output tensor, which Eigen allocates with malloc: from
// 32 MiB on, glibc maps every one afresh, so each call would otherwise fault it in 4 KiB at a time). Advice
// only: failure, or memory already touched, changes nothing but speed.
inline void advise_huge_pages(void* p, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  if (p == nullptr || bytes < 2 * kHuge) return;
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t first = (begin + kHuge - 1) / kHuge * kHuge;
  const std::uintptr_t last = (begin + bytes) / kHuge * kHuge;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

template <typename Scalar>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t count) { reset(count); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept : data_(other.data_), size_(other.size_), capacity_(other.capacity_) {
    other.data_ = nullptr;
    other.size_ = 0;
    other.capacity_ = 0;
  }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      std::free(data_);
      data_ = other.data_;
      size_ = other.size_;
      capacity_ = other.capacity_;
      other.data_ = nullptr;
      other.size_ = 0;
      other.capacity_ = 0;
    }
    return *this;
  }
  ~Buffer() { std::free(data_); }

  // Uninitialised storage for `count` elements (the previous contents are dropped).
  void reset(std::size_t count) {
    std::free(data_);
    data_ = nullptr;
    size_ = 0;
    capacity_ = 0;
    if (count == 0) return;
    if (count > std::numeric_limits<std::size_t>::max() / sizeof(Scalar)) throw std::bad_alloc();
    constexpr std::size_t kHuge = std::size_t{2} << 20;
    std::size_t bytes = count * sizeof(Scalar);
    const std::size_t align = bytes >= kHuge ? kHuge : 64;
    if (bytes > std::numeric_limits<std::size_t>::max() - align) throw std::bad_alloc();
    bytes = (bytes + align - 1) / align * align;  // aligned_alloc wants a multiple of the alignment
    void* p = std::aligned_alloc(align, bytes);
    if (p == nullptr) throw std::bad_alloc();
    if (align == kHuge) advise_huge_pages(p, bytes);
    data_ = static_cast<Scalar*>(p);
    size_ = count;
    capacity_ = count;
  }

  // The first `count` elements of the storage this buffer already holds, without allocating; count at
  // most capacity() (what the last reset allocated). The contents are kept.
  void shrink_to(std::size_t count) noexcept { size_ = count <= capacity_ ? count : capacity_; }
  // Scratch of at least `count` elements: the storage held, or new storage (contents not kept) when it is
  // smaller.
  Scalar* reset_at_least(std::size_t count) {
    if (size_ < count) reset(count);
    return data_;
  }
  std::size_t capacity() const noexcept { return capacity_; }

  Scalar* data() noexcept { return data_; }
  const Scalar* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  Scalar* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
};

// The first 64-byte-aligned element of buf: scratch that kernels keep in std::vectors (allocated a cache
// line longer than needed) starts on a cache line, so that how Eigen and the kernels split it into packets,
// hence their rounding, never depends on where an allocation landed.
template <typename T>
T* cache_line_start(std::vector<T>& buf) noexcept {
  const auto addr = reinterpret_cast<std::uintptr_t>(buf.data());
  return buf.data() + ((64 - addr % 64) % 64) / sizeof(T);
}

// A std::vector allocator whose storage starts on a cache line (std::aligned_alloc, as Buffer): for operands
// of AMX tile loads and stores, which move 16 rows of 64 bytes, where each row that straddles two cache lines
// costs two accesses.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;

  CacheLineAllocator() noexcept = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}  // NOLINT: converting, as allocators are

  T* allocate(std::size_t n) {
    if (n > (std::numeric_limits<std::size_t>::max() - 64) / sizeof(T)) throw std::bad_alloc();
    const std::size_t bytes = std::max<std::size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }

  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const noexcept {
    return false;
  }
};

// A std::vector that starts on a cache line.
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace detail
SDPA_NAMESPACE_END
