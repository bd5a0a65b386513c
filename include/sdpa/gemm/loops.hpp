// The loops around the kernel for operands in their callers' memory (BLIS's five loops, with A and B
// swapped to suit a row-major C, and A read in place), and the work split that both these loops and the
// packed API use.
//   for each block of mc rows of A                      (read by all workers, from L3)
//     for each k block of depth kc, in order           (never split: each C element sums its k blocks
//                                                        in one order, so results do not depend on threads)
//       for each work item (a range of rows x a range of at most nc columns), on any worker:
//         pack the item's B columns into the worker's own buffer (in L2)
//         for each mr rows of A (in L1 while the B slivers pass), for each B sliver: micro-kernel
// The workers meet after each k block, unless there are fewer than two items per worker: then each owns
// its items and runs their k blocks without waiting for the others (gemm_loops).
// The k blocks are the same for any number of workers, and so is every element's sequence of operations
// in the micro-kernels, so results are bit-identical for any thread count (see min_items for Eigen's).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>

#include "sdpa/gemm/blocking.hpp"
#include "sdpa/gemm/epilogue.hpp"
#include "sdpa/gemm/kernel.hpp"
#include "sdpa/gemm/operands.hpp"
#include "sdpa/gemm/workspace.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN
namespace gemm {
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
// Columns come in chunks of at most nc (a B block in L2), as even as multiples of nr make them. When that
// gives fewer than `wanted` items, the rows split first, into pieces of at least kMinRows (each piece packs
// its B chunk again, which costs 1/(2 * rows) of its products), and only then do the chunks shrink towards
// nr: a narrower chunk reuses each A sliver for fewer tiles before the next one must come from L3. Both
// steps are multiples of the micro-tile.
struct Split {
  static constexpr Eigen::Index kMinRows = 64;
  Eigen::Index m_step = 0, n_step = 0, m_items = 0, n_items = 0;

  Split() = default;

  Split(Eigen::Index rows, Eigen::Index cols, const Blocking& bl, Eigen::Index wanted) noexcept {
    const Eigen::Index min_rows = round_up(kMinRows, bl.mr);
    const Eigen::Index max_pieces = std::max<Eigen::Index>(1, rows / min_rows);
    n_step = std::min(bl.nc, round_up(cols, bl.nr));
    n_items = ceil_div(cols, n_step);
    // As many chunks, of equal widths where the rounding to nr allows: 384 columns in chunks of 256 would
    // be 256 and 128, and two workers would wait on the wider one.
    n_step = std::max(bl.nr, round_up(ceil_div(cols, n_items), bl.nr));
    n_items = ceil_div(cols, n_step);
    const Eigen::Index pieces = std::min(max_pieces, ceil_div(wanted, n_items));
    if (pieces * n_items < wanted) {
      const Eigen::Index chunks = ceil_div(wanted, pieces);
      n_step = std::max(bl.nr, round_up(ceil_div(cols, chunks), bl.nr));
      n_items = ceil_div(cols, n_step);
    }
    // A few column chunks that the workers cannot share evenly (three on two workers: one runs two while
    // the other waits) become as many narrower ones as the next multiple of `wanted`, where the rounding
    // to nr allows it.
    if (pieces == 1 && n_items < 4 * wanted && n_items % wanted != 0) {
      const Eigen::Index step = std::max(bl.nr, round_up(ceil_div(cols, round_up(n_items, wanted)), bl.nr));
      if (ceil_div(cols, step) % wanted == 0) {
        n_step = step;
        n_items = ceil_div(cols, n_step);
      }
    }
    m_step = std::max<Eigen::Index>(1, round_up(ceil_div(rows, pieces), bl.mr));
    m_items = ceil_div(rows, m_step);
  }
  Eigen::Index count() const noexcept { return m_items * n_items; }
};

// How many work items to cut a product into for `workers` workers: at least one per worker, and none
// beyond the cache blocks when the B blocks alone give that many. Not several per worker: an item cut from
// rows packs its B block again, and an output projection on two workers cut into four items per k block
// ran slower than in two where measured (more packing than uneven items cost). The micro-kernels
// round every element the same way in any tile, so the split cannot change their results; Eigen's
// products can round differently for different shapes, so the portable kernel cuts every product the
// same way whatever the number of workers.
template <typename K>
Eigen::Index min_items(Eigen::Index workers) noexcept {
  if (K::kShapeDependentRounding) return 4;
  return std::max<Eigen::Index>(1, workers);
}

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

// One output of gemm_loops: C[m, n] (ldc) = alpha * A B + beta * C (+ bias[n]), with B given as b[n, k]
// (`transposed`: keys, PyTorch's (out, in) weights; gemm_nt) or as b[k, n] (values; gemm_nn), leading
// dimension ldb.
template <typename Scalar>
struct Output {
  Eigen::Index n = 0;
  const Scalar* b = nullptr;
  Eigen::Index ldb = 0;
  bool transposed = true;
  const Scalar* bias = nullptr;
  Scalar* c = nullptr;
  Eigen::Index ldc = 0;
  // B (transposed: b[n, k]) stored as bfloat16 or float16 at b_stored (b null), float products only: its
  // values are widened as they are packed, so the micro-kernels see exactly the float B of those values.
  Storage b_storage = native_storage<Scalar>();
  const void* b_stored = nullptr;

  // Packs B's columns [j0, j0 + cols) over k in [p0, p0 + kcp) into kernel K's nr-wide slivers at dst.
  template <typename K>
  void pack_b(Eigen::Index j0, Eigen::Index cols, Eigen::Index p0, Eigen::Index kcp, Scalar* dst) const noexcept {
    if constexpr (std::is_same<Scalar, float>::value) {
      if (b_storage == Storage::kBFloat16)
        return K::pack_b_rows(cols, kcp, static_cast<const BFloat16*>(b_stored) + j0 * ldb + p0, ldb, dst);
      if (b_storage == Storage::kFloat16)
        return K::pack_b_rows(cols, kcp, static_cast<const Float16*>(b_stored) + j0 * ldb + p0, ldb, dst);
    }
    if (transposed) K::pack_b_rows(cols, kcp, b + j0 * ldb + p0, ldb, dst);
    else K::pack_b_cols(cols, kcp, b + p0 * ldb + j0, ldb, dst);
  }
};

// At most this many outputs per gemm_loops call: their splits for a row block live on the stack, and each
// item finds its output by a linear scan.
constexpr std::size_t kMaxOutputs = 8;

// The outputs' products with one A[m, k], row-major (a fused projection: q, k and v from the same rows):
// their work items share one queue.
template <typename K, typename Scalar>
void kernel_loops(Eigen::Index m, Eigen::Index k, Scalar alpha, Matrix<const Scalar> a_rows,
                  const Output<Scalar>* outputs, std::size_t count, Scalar beta, const Context<Scalar>& context) {
  using Index = Eigen::Index;
  const Eigen::ThreadPoolDevice* device = context.device;
  Workspace<Scalar>* workspace = context.workspace;
  const Scalar* a = a_rows.data;
  const Index lda = a_rows.ld;
  if (m <= 0) return;
  if (k <= 0 || alpha == Scalar(0)) {
    for (std::size_t o = 0; o < count; ++o) scale_only(m, outputs[o].n, beta, outputs[o].bias, outputs[o].c, outputs[o].ldc);
    return;
  }
  Blocking bl = blocking_of<K, Scalar>();
  const Index kc = std::min(bl.kc, k);
  // The B block keeps the bytes blocking.hpp gives it (half of L2) at the depth this product has: one
  // shallower than kc (a projection from d_model 512 when kc is 1024) gets proportionally wider chunks, and
  // A is read from L3 once per chunk, so half as often. Columns only: no element's k order changes.
  bl.nc = std::max(bl.nr, bl.nc * bl.kc / kc / bl.nr * bl.nr);
  const Index mc = std::min(bl.mc, m);
  const Index wanted = min_items<K>(worker_count(device));
  // The split of each output over the first row block: how many items, and the widest B block.
  Index items = 0, widest_cols = 0;
  for (std::size_t o = 0; o < count; ++o) {
    if (outputs[o].n <= 0) continue;
    const Split split(mc, outputs[o].n, bl, wanted);
    items += split.count();
    widest_cols = std::max(widest_cols, split.n_step);
  }
  if (items == 0) return;
  const Index workers = std::min<Index>(worker_count(device), items);
  // One B block per worker, each starting on a cache line since the kernels load B with aligned loads: in
  // the caller's workspace, or one allocation for this call. sdpa::detail::Buffer puts blocks of 2 MiB and
  // more on huge pages. A is read where it lies: packing it slowed the projections (a transposing copy
  // of all of A per k block, and on two threads a barrier between the copy and the products) and bought
  // nothing, as the mr rows of a k block stay in L1 either way.
  constexpr Index line = 64 / static_cast<Index>(sizeof(Scalar));
  const Index b_size = round_up(round_up(widest_cols, K::nr) * kc, line);
  Workspace<Scalar> local;
  Scalar* const b_blocks =
      (workspace != nullptr ? workspace : &local)->reserve(static_cast<std::size_t>(workers * b_size));
  eigen_assert(count <= kMaxOutputs && "sdpa::gemm: too many outputs for one A");

  for (Index ic = 0; ic < m; ic += mc) {
    const Index rows = std::min(mc, m - ic);
    Split splits[kMaxOutputs];
    Index first_item[kMaxOutputs + 1] = {0};
    for (std::size_t o = 0; o < count; ++o) {
      if (outputs[o].n > 0) splits[o] = Split(rows, outputs[o].n, bl, wanted);
      first_item[o + 1] = first_item[o] + splits[o].count();
    }
    const Index total = first_item[count];
    // Item `item` over the k block [p0, p0 + kcp), with B packed into b_block.
    auto run_item = [&](Index item, Index p0, Index kcp, Scalar* b_block) {
      std::size_t o = 0;
      while (item >= first_item[o + 1]) ++o;
      const Output<Scalar>& out = outputs[o];
      const Split& split = splits[o];
      const Index local_item = item - first_item[o];
      const Index i0 = local_item / split.n_items * split.m_step;
      const Index j0 = local_item % split.n_items * split.n_step;
      const Index item_rows = std::min(split.m_step, rows - i0);
      const Index cols = std::min(split.n_step, out.n - j0);
      out.template pack_b<K>(j0, cols, p0, kcp, b_block);
      const Epilogue<Scalar> ep{alpha, beta, out.bias != nullptr ? out.bias + j0 : nullptr, p0 == 0};
      K::block_rows({item_rows, cols, kcp}, {a + (ic + i0) * lda + p0, lda}, b_block,
                    {out.c + (ic + i0) * out.ldc + j0, out.ldc}, ep);
    };
    if (k <= kc || total >= 2 * workers) {
      for (Index p0 = 0; p0 < k; p0 += kc) {
        const Index kcp = std::min(kc, k - p0);
        // A worker index per chunk gives each concurrent chunk its own B buffer; the items themselves are
        // handed out by a counter, so a worker that starts late simply takes fewer.
        std::atomic<Index> next{0};
        parallel_for(device, workers, 1, [&](Index w0, Index w1) {
          for (Index w = w0; w < w1; ++w) {
            for (Index item = next.fetch_add(1, std::memory_order_relaxed); item < total;
                 item = next.fetch_add(1, std::memory_order_relaxed)) {
              run_item(item, p0, kcp, b_blocks + w * b_size);
            }
          }
        });
      }
      continue;
    }
    // Several k blocks and fewer than two items per worker, where a counter has nothing to balance (each
    // worker takes one item of each k block, or two against one): worker w owns items w, w + workers and
    // runs them k block by k block without meeting the others between k blocks. The workers still sweep
    // the same block of A at about the same time, as above. With two items on two workers and several k
    // blocks this was faster than a parallel region per k block in every alternated run measured
    // (bench/RESULTS.md, "fc_o on two threads without a parallel region per k block").
    parallel_for(device, workers, 1, [&](Index w0, Index w1) {
      for (Index w = w0; w < w1; ++w) {
        for (Index p0 = 0; p0 < k; p0 += kc) {
          for (Index item = w; item < total; item += workers) {
            run_item(item, p0, std::min(kc, k - p0), b_blocks + w * b_size);
          }
        }
      }
    });
  }
}

// kernel_loops on the kernel of the context's path.
template <typename Scalar>
void gemm_loops(Eigen::Index m, Eigen::Index k, Scalar alpha, Matrix<const Scalar> a, const Output<Scalar>* outputs,
                std::size_t count, Scalar beta, const Context<Scalar>& context) {
  simd::with_gemm_kernel<Scalar>(context.isa, [&](auto kernel) {
    kernel_loops<decltype(kernel), Scalar>(m, k, alpha, a, outputs, count, beta, context);
  });
}

}  // namespace detail
}  // namespace gemm
SDPA_NAMESPACE_END

#include "sdpa/detail/instances.inc"
SDPA_DETAIL_EXTERN_INSTANCES(GEMM_LOOPS)
