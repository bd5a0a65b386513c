// Counts the heap allocations a test makes: operator new (std::vector, Eigen's tensors) and aligned_alloc,
// which sdpa's own buffers use (sdpa::detail::Buffer: scratch, caches, packed operands), so that a test of
// "allocates nothing" or "never holds nq x nk" sees the library's allocator and not only the standard one.
// It replaces the global operator new/delete and interposes the C library's aligned_alloc (the program's
// definition wins over libc's for every call in the program), so it is included by exactly one translation
// unit of a test binary, before anything else.
//
//   sdpa_test::alloc::Scope scope;      // counting starts (counters reset); it stops when scope ends
//   scope.count(), scope.largest()      // allocations since, and the largest one in bytes
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace sdpa_test {
namespace alloc {

inline std::atomic<bool> g_tracking{false};
inline std::atomic<long> g_count{0};
inline std::atomic<std::size_t> g_largest{0};

inline void note(std::size_t size) noexcept {
  if (!g_tracking.load(std::memory_order_relaxed)) return;
  g_count.fetch_add(1, std::memory_order_relaxed);
  std::size_t seen = g_largest.load(std::memory_order_relaxed);
  while (size > seen && !g_largest.compare_exchange_weak(seen, size)) {
  }
}

class Scope {
 public:
  Scope() noexcept {
    g_count = 0;
    g_largest = 0;
    g_tracking = true;
  }
  ~Scope() { g_tracking = false; }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
  long count() const noexcept { return g_count.load(); }
  std::size_t largest() const noexcept { return g_largest.load(); }
};

}  // namespace alloc
}  // namespace sdpa_test

// GCC sees free() on a pointer from operator new; this replacement pairs them, so the warning is moot.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t size) {
  sdpa_test::alloc::note(size);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// std::aligned_alloc is the C library's aligned_alloc: this definition takes its place in the program.
// posix_memalign gives memory that free() releases, as aligned_alloc's does.
extern "C" void* aligned_alloc(std::size_t alignment, std::size_t size) noexcept {
  sdpa_test::alloc::note(size);
  void* p = nullptr;
  if (alignment < sizeof(void*)) alignment = sizeof(void*);
  return posix_memalign(&p, alignment, size == 0 ? 1 : size) == 0 ? p : nullptr;
}
