// The attention core for a few queries against many keys (decoding with a key/value cache: one token, or
// a short chunk, per step). A tile kernel would leave most threads idle (one query has only batch x heads
// rows of work) and its products would be matrix-vector products anyway, so this kernel splits the keys
// into fixed chunks (flash-decoding): a work item is (batch entry, chunk of keys) and covers every head and
// query, so each key and value row is streamed from memory once, in order; each item folds its scores into
// partial softmax states (softmax.hpp) with the same score pipeline as the tiled kernel (scores.hpp), and the
// partial states of a row are merged in chunk order. The chunks do not depend on the number of threads, so
// the result does not either. All scratch comes from a DecodeWorkspace the caller keeps (a KVCache does), so
// a step allocates nothing once the workspace has grown to the cache's capacity.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "sdpa/detail/buffer.hpp"
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/scores.hpp"
#include "sdpa/kernels/softmax.hpp"
#include "sdpa/kernels/stored.hpp"
#include "sdpa/kernels/visibility.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// Keys per work item: long enough that an item's per-row overhead is small against streaming its keys,
// short enough that a cache of a few thousand keys gives every thread several items.
constexpr Eigen::Index kDecodeChunk = 256;
// Key and value rows per block of the products (pass 1 widens stored keys, pass 3 takes value rows, a block
// at a time): a block of every head's rows stays in L1 while the heads that read it take their turns.
constexpr Eigen::Index kDecodeBlock = 16;

// The decoding kernel's scratch, grown on demand and kept between calls. Cache-line aligned, so that how
// Eigen splits a segment into packets (hence the rounding of exp and sums) depends on offsets only, never on
// where an allocation landed: two workspaces give the same bits.
template <typename Scalar>
struct DecodeWorkspace {
  std::vector<SoftmaxRow<Scalar>> states;  // per (item, head, query)
  sdpa::detail::Buffer<Scalar> acc;              // per (item, head, query): d_v accumulators
  sdpa::detail::Buffer<Scalar> scores;           // per thread slot: a chunk of scores per (head, query)
  std::vector<std::uint32_t> bits;         // per thread slot: one chunk of dropout words
  std::vector<typename Visibility<Scalar>::Segment> segments;  // per thread slot: per (head, query)
  sdpa::detail::Buffer<Scalar> wide;       // per thread slot: a widened block of stored rows (stored problems)

  // wide_row: the widest stored row (kv_heads * max(d_k, d_v)), 0 for a problem that is not stored().
  void reserve(Eigen::Index items, Eigen::Index rows_per_item, Eigen::Index d_v, Eigen::Index slots,
               Eigen::Index wide_row = 0) {
    if (static_cast<Eigen::Index>(states.size()) < items * rows_per_item)
      states.resize(static_cast<std::size_t>(items * rows_per_item));
    grow(acc, items * rows_per_item * d_v);
    grow(scores, slots * rows_per_item * kDecodeChunk);
    if (static_cast<Eigen::Index>(segments.size()) < slots * rows_per_item)
      segments.resize(static_cast<std::size_t>(slots * rows_per_item));
    if (static_cast<Eigen::Index>(bits.size()) < slots * (kDecodeChunk + 8))
      bits.resize(static_cast<std::size_t>(slots * (kDecodeChunk + 8)));
    grow(wide, slots * kDecodeBlock * wide_row);
  }

 private:
  static void grow(sdpa::detail::Buffer<Scalar>& b, Eigen::Index n) {
    if (static_cast<Eigen::Index>(b.size()) < n) b.reset(static_cast<std::size_t>(n));  // scratch: no content kept
  }
};

// The decoding kernel's inner products are the per-ISA row kernels of simd/dispatch.hpp (chunk_scores,
// add_weighted_rows): short enough that Eigen's GEMV spent more time in its call than in the arithmetic.
namespace decode_detail {

// Asks for the cache lines of m rows of n bytes, `stride` bytes apart (a hint: nothing on compilers without it).
inline void prefetch_rows(const unsigned char* rows, Eigen::Index stride, Eigen::Index m, Eigen::Index n) noexcept {
#if defined(__GNUC__)
  for (Eigen::Index j = 0; j < m; ++j)
    for (Eigen::Index d = 0; d < n; d += 64) __builtin_prefetch(rows + j * stride + d);
#else
  (void)rows;
  (void)stride;
  (void)m;
  (void)n;
#endif
}

}  // namespace decode_detail

// Whether decode_attention suits p: few queries (each item recomputes nothing, but covers all of them).
template <typename Scalar>
bool decode_suits(const AttentionProblem<Scalar>& p) noexcept {
  return p.nq <= 16;
}

template <typename Scalar>
void decode_attention(const AttentionProblem<Scalar>& p, DecodeWorkspace<Scalar>& ws,
                      const Eigen::ThreadPoolDevice* device = nullptr) {
  using Index = Eigen::Index;
  using Segment = typename Visibility<Scalar>::Segment;
  if (p.batch <= 0 || p.heads <= 0 || p.nq <= 0) return;
  if (p.nk == 0) {
    // An empty softmax: the product with an empty v is zero, under either masked-row policy.
    for (Index b = 0; b < p.batch; ++b)
      for (Index h = 0; h < p.heads; ++h)
        for (Index q = 0; q < p.nq; ++q) {
          std::fill_n(p.out.row(b, h, q), p.d_v, Scalar(0));
          if (p.lse != nullptr)
            p.lse[(b * p.heads + h) * p.nq + q] = p.sinks != nullptr ? p.sinks[h] : -std::numeric_limits<Scalar>::infinity();
        }
    return;
  }
  const Index chunks = std::max<Index>(1, (p.nk + kDecodeChunk - 1) / kDecodeChunk);
  const Index items = p.batch * chunks, rows = p.heads * p.nq;  // rows per item: every (head, query)
  const Index workers = static_cast<Index>(worker_count(device));
  // Scratch slots: one per thread that can run an item (the caller, and any thread of the device's pool).
  const Index slots = device == nullptr ? 1 : 1 + std::max<Index>(workers, device->numThreadsInPool());
  const Index hk = p.kv_heads() * p.d_k, hv = p.kv_heads() * p.d_v;
  ws.reserve(items, rows, p.d_v, slots, p.stored() ? std::max(hk, hv) : 0);
  const Visibility<Scalar> visibility(p, device);
  const ScorePipeline<Scalar> pipeline(visibility);
  parallel_for(device, items, 1, [&](Index i0, Index i1) {
    // The running thread's scratch slot: 0 for a thread outside the pool (the caller), 1 + its index for a
    // pool thread; two threads never share one.
    const Index slot = device == nullptr ? 0 : std::clamp<Index>(device->currentThreadId() + 1, 0, slots - 1);
    Scalar* scores = ws.scores.data() + slot * rows * kDecodeChunk;  // row r = h * nq + q of the item
    std::uint32_t* bits = ws.bits.data() + slot * (kDecodeChunk + 8);
    Segment* segs = ws.segments.data() + slot * rows;
    Scalar* wide = p.stored() ? ws.wide.data() + slot * kDecodeBlock * std::max(hk, hv) : nullptr;
    using Vec = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>;
    constexpr Index kRows = kDecodeBlock;
    for (Index item = i0; item < i1; ++item) {
      const Index b = item / chunks, c = item % chunks;
      const Index k0 = c * kDecodeChunk, n = std::min(kDecodeChunk, p.nk - k0);
      // Which rows see any key of the chunk, and where.
      bool any = false;
      for (Index h = 0; h < p.heads; ++h)
        for (Index q = 0; q < p.nq; ++q) {
          const Index r = h * p.nq + q, slot_r = (item * p.heads + h) * p.nq + q;
          ws.states[static_cast<std::size_t>(slot_r)] = SoftmaxRow<Scalar>{};
          std::fill_n(ws.acc.data() + slot_r * p.d_v, p.d_v, Scalar(0));
          const KeyRange range = visibility.row(b, h, q);
          segs[r] = visibility.segment(range, b, h, q, k0, n);
          any = any || !segs[r].none();
        }
      if (!any) continue;
      // Pass 1: every (head, query)'s scores over the chunk, a block of key rows (one vector width) at a time:
      // a row holds every key/value head, so the chunk's keys are streamed from memory once and in order (a
      // group of query heads reads its key head's block while it is in L1). Stored keys are widened a block
      // of rows at a time first; a score's sum does not depend on the block its key is in, so the two give
      // the same bits for the same keys.
      if (p.stored()) {
        for (Index j0 = 0; j0 < n; j0 += kRows) {
          const Index m = std::min(kRows, n - j0);
          widen_kv(p, /*values=*/false, b, 0, p.kv_heads(), k0 + j0, m, wide, hk);
          simd::chunk_scores(p.isa, static_cast<const Scalar*>(wide), hk, p.d_k, m, p.q.row(b, 0, 0), p.q.head_stride,
                             p.q.row_stride, p.heads, p.kv_group, p.nq, p.d_k, p.scale, scores + j0, kDecodeChunk);
        }
      } else {
        simd::chunk_scores(p.isa, p.k.row(b, 0, k0), p.k.row_stride, p.k.head_stride, n, p.q.row(b, 0, 0),
                           p.q.head_stride, p.q.row_stride, p.heads, p.kv_group, p.nq, p.d_k, p.scale, scores,
                           kDecodeChunk);
      }
      // Pass 2: per row, the score pipeline, the softmax fold and dropout.
      for (Index h = 0; h < p.heads; ++h)
        for (Index q = 0; q < p.nq; ++q) {
          const Index r = h * p.nq + q;
          if (segs[r].none()) continue;
          Scalar* s = scores + r * kDecodeChunk;
          SoftmaxRow<Scalar>& st = ws.states[static_cast<std::size_t>((item * p.heads + h) * p.nq + q)];
          pipeline.apply_segment(s, n, b, h, q, k0, segs[r]);
          st.seen = true;
          st.fold(p.isa, s, n);  // a fresh state: the factor is 1
          if (p.dropout) {
            const Index k4 = k0 >> 2, blocks = ((k0 + n + 3) >> 2) - k4;
            p.sampler.fill_bits(p.isa, b * p.heads + h, q, k4, blocks, bits);
            const std::uint32_t* w = bits + (k0 - 4 * k4);
            for (Index j = 0; j < n; ++j) s[j] = p.sampler.dropped_bits(w[j]) ? Scalar(0) : s[j] * p.keep_scale;
          }
        }
      if (p.dropout && p.keep_scale == Scalar(0)) continue;  // p = 1: nothing reaches the output
      // Pass 3: acc += p v over each row's visible keys, the value rows taken in blocks as in pass 1. A hidden
      // key adds nothing, not even a NaN in its value: a row's product covers its visible segment only, and
      // a mask's holes inside it go one key at a time.
      // Stored values are widened a block at a time into `wide` (row stride hv).
      const Index v_row = p.stored() ? hv : p.v.row_stride;
      const Index v_head = p.stored() ? p.d_v : p.v.head_stride;
      for (Index j0 = 0; j0 < n; j0 += kRows) {
        const Index m = std::min(kRows, n - j0);
        // The next block's value rows are requested now: within a block the heads take their parts of the
        // rows in turn, an order the hardware prefetcher does not follow ahead.
        if (j0 + kRows < n) {
          const Index ahead = std::min(kRows, n - j0 - kRows);
          if (p.stored()) {
            const Index bytes = static_cast<Index>(storage_bytes(p.kv_storage));
            decode_detail::prefetch_rows(stored_row(p, true, b, 0, k0 + j0 + kRows), p.v.row_stride * bytes, ahead,
                                         hv * bytes);
          } else {
            decode_detail::prefetch_rows(reinterpret_cast<const unsigned char*>(p.v.row(b, 0, k0 + j0 + kRows)),
                                         p.v.row_stride * static_cast<Index>(sizeof(Scalar)), ahead,
                                         hv * static_cast<Index>(sizeof(Scalar)));
          }
        }
        const Scalar* block = p.stored() ? wide : p.v.row(b, 0, k0 + j0);
        if (p.stored()) widen_kv(p, /*values=*/true, b, 0, p.kv_heads(), k0 + j0, m, wide, hv);
        for (Index h = 0; h < p.heads; ++h) {
          const Scalar* vb = block + (h / p.kv_group) * v_head;
          for (Index q = 0; q < p.nq; ++q) {
            const Index r = h * p.nq + q;
            const Segment& seg = segs[r];
            const Index lo = std::max(seg.lo, j0), hi = std::min(seg.hi, j0 + m);
            if (lo >= hi) continue;
            Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>> av(ws.acc.data() + ((item * p.heads + h) * p.nq + q) * p.d_v, p.d_v);
            const Scalar* pr = scores + r * kDecodeChunk;
            if (seg.solid) {
              simd::add_weighted_rows(p.isa, av.data(), p.d_v, pr + lo, vb + (lo - j0) * v_row, v_row, hi - lo);
            } else {
              for (Index j = lo; j < hi; ++j)
                if (!visibility.masked(b, h, q, k0 + j)) av += pr[j] * Vec(vb + (j - j0) * v_row, p.d_v);
            }
          }
        }
      }
    }
  });

  // Merge each row's partial states in chunk order, then finish it.
  const bool accumulated = !(p.dropout && p.keep_scale == Scalar(0));
  parallel_for(device, p.batch * rows, std::max<Index>(1, p.batch * rows / (4 * workers)), [&](Index r0, Index r1) {
    std::vector<Scalar> keys;  // the probabilities' widened key chunk (stored problems)
    for (Index r = r0; r < r1; ++r) {
      const Index b = r / rows, hq = r % rows, h = hq / p.nq, q = hq % p.nq;
      const Index first = (b * chunks) * rows + hq;
      SoftmaxRow<Scalar> st = ws.states[static_cast<std::size_t>(first)];
      Scalar* acc = ws.acc.data() + first * p.d_v;
      for (Index c = 1; c < chunks; ++c) {
        const Index other = (b * chunks + c) * rows + hq;
        st.merge(ws.states[static_cast<std::size_t>(other)], acc, ws.acc.data() + other * p.d_v, p.d_v);
      }
      if (p.sinks != nullptr) st.add_sink(p.sinks[h], acc, p.d_v);
      finish_row(p.out.row(b, h, q), acc, p.d_v, st, p.masked_rows, accumulated);
      const Index bh = b * p.heads + h;
      if (p.lse != nullptr) p.lse[bh * p.nq + q] = st.log_sum_exp();
      if (p.probabilities != nullptr) {
        // The scores again (the same products as pass 1), normalised by the row's log-sum-exp, as the tiled
        // kernel writes them.
        Scalar* out = p.probabilities + (bh * p.nq + q) * p.nk;
        const Scalar fill = !st.seen && !st.sunk && p.masked_rows == MaskedRows::kNaN
                                ? std::numeric_limits<Scalar>::quiet_NaN()
                                : Scalar(0);
        std::fill_n(out, p.nk, fill);
        if (!st.seen) continue;
        const KeyRange range = visibility.row(b, h, q);
        const Scalar lse = st.log_sum_exp();
        for (Index k0 = range.lo / kDecodeChunk * kDecodeChunk; k0 < range.hi; k0 += kDecodeChunk) {
          const Index n = std::min(kDecodeChunk, p.nk - k0);
          Scalar* x = out + k0;
          const Scalar* kr = keys.data();
          Index k_row = p.d_k;
          if (p.stored()) {
            keys.resize(static_cast<std::size_t>(n * p.d_k));
            widen_kv(p, /*values=*/false, b, h / p.kv_group, Index{1}, k0, n, keys.data(), p.d_k);
            kr = keys.data();
          } else {
            kr = p.key_row(b, h, k0);
            k_row = p.k.row_stride;
          }
          simd::chunk_scores(p.isa, kr, k_row, Index{0}, n, p.q.row(b, h, q), Index{0}, Index{0}, Index{1}, Index{1},
                             Index{1}, p.d_k, p.scale, x, kDecodeChunk);
          pipeline.apply(x, n, b, h, q, k0, range);
          simd::exp_shifted_sum(p.isa, x, n, lse);
        }
      }
    }
  });
}

}  // namespace kernels
SDPA_NAMESPACE_END
