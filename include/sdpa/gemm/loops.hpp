// The loops around the kernel for operands in their callers' memory (BLIS's five loops, with A and B
// swapped to suit a row-major C), and the work split that both these loops and the packed API use.
//   for each block of mc rows of A                      (A block: all workers share it, in L3)
//     for each k block of depth kc, in order           (never split: each C element sums its k blocks
//                                                        in one order, so results do not depend on threads)
//       pack the A block, its slivers spread over the workers
//       for each work item (a range of rows x a range of at most nc columns), on any worker:
//         pack the item's B columns into the worker's own buffer (in L2)
//         for each A sliver, for each B sliver: micro-kernel
// Work items depend on the problem and the blocking only, never on the number of workers, so that the
// Eigen fallback (whose results depend on its operands' shapes) is bit-identical across thread counts too.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

#include "sdpa/gemm/blocking.hpp"
#include "sdpa/gemm/epilogue.hpp"
#include "sdpa/gemm/isa.hpp"
#include "sdpa/gemm/kernel.hpp"
#include "sdpa/parallel.hpp"

namespace sdpa {
namespace gemm {
inline namespace SDPA_GEMM_ABI_NAMESPACE {
namespace detail {

// Keeps alpha and beta out of template argument deduction: Scalar comes from the pointers alone, so that
// gemm_nt(..., 1.0, float_ptr, ...) compiles.
template <typename T>
struct NoDeduce {
  using type = T;
};
template <typename T>
using NoDeduceT = typename NoDeduce<T>::type;

inline Eigen::Index ceil_div(Eigen::Index a, Eigen::Index b) noexcept { return (a + b - 1) / b; }
inline Eigen::Index round_up(Eigen::Index a, Eigen::Index b) noexcept { return ceil_div(a, b) * b; }

// rows x cols of C as a grid of m_items x n_items work items of m_step x n_step (the last ones smaller).
// Columns come in chunks of nc (a B block in L2). When that gives fewer than kMinItems items, the rows
// split first, into pieces of at least kMinRows (each piece packs its B chunk again, which costs 1/(2 *
// rows) of its products), and only then do the chunks shrink towards nr: a narrower chunk reuses each A
// sliver for fewer tiles before the next one must come from L3. Both steps are multiples of the micro-tile.
struct Split {
  static constexpr Eigen::Index kMinItems = 4;
  static constexpr Eigen::Index kMinRows = 64;
  Eigen::Index m_step, n_step, m_items, n_items;

  Split(Eigen::Index rows, Eigen::Index cols, const Blocking& bl) noexcept {
    const Eigen::Index min_rows = round_up(kMinRows, bl.mr);
    const Eigen::Index max_pieces = std::max<Eigen::Index>(1, rows / min_rows);
    n_step = std::min(bl.nc, round_up(cols, bl.nr));
    n_items = ceil_div(cols, n_step);
    const Eigen::Index pieces = std::min(max_pieces, ceil_div(kMinItems, n_items));
    if (pieces * n_items < kMinItems) {
      const Eigen::Index chunks = ceil_div(kMinItems, pieces);
      n_step = std::max(bl.nr, round_up(ceil_div(cols, chunks), bl.nr));
      n_items = ceil_div(cols, n_step);
    }
    m_step = std::max<Eigen::Index>(1, round_up(ceil_div(rows, pieces), bl.mr));
    m_items = ceil_div(rows, m_step);
  }
  Eigen::Index count() const noexcept { return m_items * n_items; }
};

// Scratch for one call's packed blocks: 64-byte aligned, from the C heap, so that glibc hands the same
// memory to the next call of a similar size (sdpa::detail::Buffer advises huge pages from 2 MiB on, and
// the kernel would then zero fresh 2 MiB pages on every call: 1% of a projection).
template <typename Scalar>
class Scratch {
 public:
  explicit Scratch(std::size_t count) {
    if (count > (std::size_t(-1) - 63) / sizeof(Scalar)) throw std::bad_alloc();
    const std::size_t bytes = (count * sizeof(Scalar) + 63) / 64 * 64;
    data_.reset(static_cast<Scalar*>(std::aligned_alloc(64, std::max<std::size_t>(bytes, 64))));
    if (data_ == nullptr) throw std::bad_alloc();
  }
  Scalar* data() const noexcept { return data_.get(); }

 private:
  struct Free {
    void operator()(Scalar* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<Scalar, Free> data_;
};

// C = beta * C + bias, for k = 0 or alpha = 0, where no product term exists; beta = 0 does not read C.
template <typename Scalar>
void scale_only(Eigen::Index m, Eigen::Index n, Scalar beta, const Scalar* bias, Scalar* c, Eigen::Index ldc) noexcept {
  for (Eigen::Index i = 0; i < m; ++i) {
    Scalar* row = c + i * ldc;
    for (Eigen::Index j = 0; j < n; ++j) {
      const Scalar scaled = beta == Scalar(0) ? Scalar(0) : beta * row[j];
      row[j] = bias != nullptr ? scaled + bias[j] : scaled;
    }
  }
}

// C[m, n] = alpha * A[m, k] B + beta * C (+ bias[n]), with A row-major and B reached through
// pack_b(j0, cols, p0, kcp, dst), which packs B's columns [j0, j0 + cols) over k in [p0, p0 + kcp) into
// nr-wide slivers at dst.
template <typename Scalar, typename PackB>
void gemm_loops(Eigen::Index m, Eigen::Index n, Eigen::Index k, Scalar alpha, const Scalar* a, Eigen::Index lda,
                const PackB& pack_b, Scalar beta, const Scalar* bias, Scalar* c, Eigen::Index ldc,
                const Eigen::ThreadPoolDevice* device) {
  using Index = Eigen::Index;
  using K = Kernel<Scalar>;
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == Scalar(0)) {
    scale_only(m, n, beta, bias, c, ldc);
    return;
  }
  const Blocking& bl = blocking<Scalar>();
  const Index kc = std::min(bl.kc, k);
  const Index mc = std::min(bl.mc, m);
  const Split widest(mc, n, bl);
  const Index workers = std::min<Index>(worker_count(device), widest.count());
  // One allocation per call: the shared A block, then one B block per worker, each starting on a cache
  // line since the kernels load B with aligned loads.
  constexpr Index line = 64 / static_cast<Index>(sizeof(Scalar));
  const Index a_size = round_up(round_up(mc, K::mr) * kc, line);
  const Index b_size = round_up(round_up(widest.n_step, K::nr) * kc, line);
  const Scratch<Scalar> buffer(static_cast<std::size_t>(a_size + workers * b_size));
  Scalar* const a_block = buffer.data();

  for (Index ic = 0; ic < m; ic += mc) {
    const Index rows = std::min(mc, m - ic);
    const Split split(rows, n, bl);
    const Index slivers = ceil_div(rows, K::mr);
    for (Index p0 = 0; p0 < k; p0 += kc) {
      const Index kcp = std::min(kc, k - p0);
      parallel_for(device, slivers, balanced_grain(device, slivers), [&](Index s0, Index s1) {
        const Index r0 = s0 * K::mr;
        K::pack_a(std::min(s1 * K::mr, rows) - r0, kcp, a + (ic + r0) * lda + p0, lda, a_block + r0 * kcp);
      });
      // A worker index per chunk gives each concurrent chunk its own B buffer; the items themselves are
      // handed out by a counter, so a worker that starts late simply takes fewer.
      std::atomic<Index> next{0};
      parallel_for(device, workers, 1, [&](Index w0, Index w1) {
        for (Index w = w0; w < w1; ++w) {
          Scalar* const b_block = buffer.data() + a_size + w * b_size;
          for (Index item = next.fetch_add(1, std::memory_order_relaxed); item < split.count();
               item = next.fetch_add(1, std::memory_order_relaxed)) {
            const Index i0 = item / split.n_items * split.m_step;
            const Index j0 = item % split.n_items * split.n_step;
            const Index item_rows = std::min(split.m_step, rows - i0);
            const Index cols = std::min(split.n_step, n - j0);
            pack_b(j0, cols, p0, kcp, b_block);
            const Epilogue<Scalar> ep{alpha, beta, bias != nullptr ? bias + j0 : nullptr, p0 == 0};
            K::block(kcp, item_rows, cols, a_block + i0 * kcp, b_block, c + (ic + i0) * ldc + j0, ldc, ep);
          }
        }
      });
    }
  }
}

}  // namespace detail
}  // namespace SDPA_GEMM_ABI_NAMESPACE
}  // namespace gemm
}  // namespace sdpa
