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
#include <memory>
#include <type_traits>
#include <vector>

#include "sdpa/detail/buffer.hpp"
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/scores.hpp"
#include "sdpa/kernels/softmax.hpp"
#include "sdpa/kernels/rows.hpp"
#include "sdpa/kernels/visibility.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// Keys per work item: long enough that an item's per-row overhead is small against streaming its keys,
// short enough that a cache of a few thousand keys gives every thread several items.
constexpr Eigen::Index kDecodeChunk = 256;
// Key and value rows per block of pass 3's products (a paged cache's blocks are multiples of it, so that no
// block of them crosses one of the cache's).
constexpr Eigen::Index kDecodeRows = 16;

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
  sdpa::detail::Buffer<bool> holes;  // a score program's mask: per thread slot, a chunk per (head, query)

  void reserve(Eigen::Index items, Eigen::Index rows_per_item, Eigen::Index d_v, Eigen::Index slots) {
    if (static_cast<Eigen::Index>(states.size()) < items * rows_per_item)
      states.resize(static_cast<std::size_t>(items * rows_per_item));
    grow(acc, items * rows_per_item * d_v);
    grow(scores, slots * rows_per_item * kDecodeChunk);
    if (static_cast<Eigen::Index>(segments.size()) < slots * rows_per_item)
      segments.resize(static_cast<std::size_t>(slots * rows_per_item));
    if (static_cast<Eigen::Index>(bits.size()) < slots * (kDecodeChunk + 8))
      bits.resize(static_cast<std::size_t>(slots * (kDecodeChunk + 8)));
  }

 private:
  static void grow(sdpa::detail::Buffer<Scalar>& b, Eigen::Index n) {
    if (static_cast<Eigen::Index>(b.size()) < n) b.reset(static_cast<std::size_t>(n));  // scratch: no content kept
  }
};

// The decoding kernel's inner products are the per-ISA row kernels of simd/dispatch.hpp (chunk_scores,
// add_weighted_rows and their forms for stored keys and values): short enough that Eigen's GEMV spent more
// time in its call than in the arithmetic.

// The most queries per batch entry that decode_attention takes (each item recomputes nothing, but covers
// all of them); run_attention sends more to the tiled kernel.
constexpr Eigen::Index kDecodeQueries = 16;

// Whether decode_attention suits p: at most kDecodeQueries queries.
template <typename Scalar>
bool decode_suits(const AttentionProblem<Scalar>& p) noexcept {
  return p.nq <= kDecodeQueries;
}

// The same under a score program, whose mask the decoding kernel asks per row and chunk: the tiled kernel
// asks it per tile and overtakes it at fewer queries than under the fixed options (the measurement is in
// the commit that set the limit).
constexpr Eigen::Index kProgramDecodeRows = 4;
template <typename Scalar>
bool decode_suits_program(const AttentionProblem<Scalar>& p) noexcept {
  return p.nq <= kProgramDecodeRows;
}

// Under a score program (kernels/program.hpp): its score function in the pipeline, each row's range narrowed
// by its mask function's interval (narrow_row) and, unless that is exact, the function asked for the keys of
// each row's segment of a chunk (ask_mask in scores.hpp).
template <typename Scalar, typename Program>
void decode_attention_program(const AttentionProblem<Scalar>& p, const Program& program, DecodeWorkspace<Scalar>& ws,
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
  ws.reserve(items, rows, p.d_v, slots);
  if (Program::kMask && ws.holes.size() < static_cast<std::size_t>(slots * rows * kDecodeChunk))
    ws.holes.reset(static_cast<std::size_t>(slots * rows * kDecodeChunk));
  const Visibility<Scalar> visibility(p, device);
  const ScorePipeline<Scalar, Program> pipeline(visibility, &program);
  parallel_for(device, items, 1, [&](Index i0, Index i1) {
    // The running thread's scratch slot: 0 for a thread outside the pool (the caller), 1 + its index for a
    // pool thread; two threads never share one.
    const Index slot = device == nullptr ? 0 : std::clamp<Index>(device->currentThreadId() + 1, 0, slots - 1);
    Scalar* scores = ws.scores.data() + slot * rows * kDecodeChunk;  // row r = h * nq + q of the item
    std::uint32_t* bits = ws.bits.data() + slot * (kDecodeChunk + 8);
    Segment* segs = ws.segments.data() + slot * rows;
    using Vec = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>;
    constexpr Index kRows = kDecodeRows;
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
          KeyRange range = visibility.row(b, h, q);
          bool exact = true;
          if constexpr (Program::kMask) exact = narrow_row(program, p, b, h, q, range);
          segs[r] = visibility.segment(range, b, h, q, k0, n);
          if constexpr (Program::kMask) {
            if (!segs[r].none() && !exact) ask_mask(program, visibility, b, h, q, k0, segs[r], ws.holes.data() + (slot * rows + r) * kDecodeChunk);
          }
          any = any || !segs[r].none();
        }
      if (!any) continue;
      // Pass 1: every (head, query)'s scores over the chunk, a block of key rows (one vector width) at a time:
      // a row holds every key/value head, so the chunk's keys are streamed from memory once and in order (a
      // group of query heads reads its key head's block while it is in L1). Stored keys are widened in
      // registers as they are loaded.
      // Only the keys some row sees, [lo, hi) of the chunk (pass 2 makes the others -inf; a paged batch
      // entry's table ends at its length); paged keys a block's run at a time. A score does not depend on the
      // run its key is in.
      Index lo = n, hi = 0;
      for (Index r = 0; r < rows; ++r)
        if (!segs[r].none()) {
          lo = std::min(lo, segs[r].lo);
          hi = std::max(hi, segs[r].hi);
        }
      const simd::Queries<Scalar> all_queries{
          p.q.row(b, 0, 0), p.q.head_stride, p.q.row_stride, p.heads, p.kv_group, p.nq, p.d_k};
      for (Index j = lo; j < hi;) {
        const Index run = p.run_of(k0 + j, hi - j);
        key_scores(p, b, Index{0}, k0 + j, run, all_queries, scores + j, kDecodeChunk);
        j += run;
      }
      // Pass 2: per row, the score pipeline, the softmax fold and dropout, over the batch entry's own keys of
      // the chunk (those before its key length): then a sequence of a ragged or padded batch is folded as it
      // is alone, in the same vector lanes, and gets the same bits.
      const Index nb = p.key_lengths != nullptr ? std::clamp<Index>(p.key_lengths[b] - k0, 0, n) : n;
      for (Index h = 0; h < p.heads; ++h)
        for (Index q = 0; q < p.nq; ++q) {
          const Index r = h * p.nq + q;
          if (segs[r].none()) continue;
          Scalar* s = scores + r * kDecodeChunk;
          SoftmaxRow<Scalar>& st = ws.states[static_cast<std::size_t>((item * p.heads + h) * p.nq + q)];
          pipeline.apply_segment(s, nb, b, h, q, k0, segs[r]);
          st.seen = true;
          st.fold(p.isa, s, nb);  // a fresh state: the factor is 1
          if (p.dropout) {
            const Index k4 = k0 >> 2, blocks = ((k0 + nb + 3) >> 2) - k4;
            p.sampler.fill_bits(p.isa, b * p.heads + h, q, k4, blocks, bits);
            const std::uint32_t* w = bits + (k0 - 4 * k4);
            for (Index j = 0; j < nb; ++j) s[j] = p.sampler.dropped_bits(w[j]) ? Scalar(0) : s[j] * p.keep_scale;
          }
        }
      if (p.dropout && p.keep_scale == Scalar(0)) continue;  // p = 1: nothing reaches the output
      // Pass 3: acc += p v over each row's visible keys, the value rows taken in blocks of kRows (inside one
      // block of a paged cache, whose blocks are multiples of kRows rows). A hidden key adds nothing, not even
      // a NaN in its value: a row's product covers its visible segment only, and a mask's holes inside it go
      // one key at a time.
      // (Float value rows are not prefetched: the hardware streams them, and where measured the prefetches
      // only slowed the step down; bench/RESULTS.md. Stored ones are, on the paths whose kPrefetchStoredRows
      // says so.)
      // Stored values where every row sees the same solid segment of the chunk (no mask holes: the usual
      // step): a block's rows go to every head in one call per query (stored_value_sums_heads), each
      // head's sums as the per-head calls below would give them.
      bool uniform = p.stored() && segs[0].solid;
      for (Index r = 1; uniform && r < rows; ++r)
        uniform = segs[r].solid && segs[r].lo == segs[0].lo && segs[r].hi == segs[0].hi;
      for (Index j0 = 0; j0 < n; j0 += kRows) {
        const Index m = std::min(kRows, n - j0);
        if (uniform) {
          const Index jlo = std::max(segs[0].lo, j0), jhi = std::min(segs[0].hi, j0 + m);
          if (jlo >= jhi) continue;
          // The next block's rows, where they follow in memory (the same block of a paged cache).
          const Index ahead = std::clamp<Index>(p.run_of(k0 + jlo, n - jlo) - (jhi - jlo), 0, kRows);
          for (Index q = 0; q < p.nq; ++q)
            stored_value_sums_heads(
                p,
                simd::HeadSums<Scalar>{ws.acc.data() + (item * p.heads * p.nq + q) * p.d_v, p.nq * p.d_v,
                                       scores + q * kDecodeChunk + jlo, p.nq * kDecodeChunk, p.heads, p.kv_group},
                b, k0 + jlo, jhi - jlo, q == 0 ? ahead : Index{0});
          continue;
        }
        Index prefetched = -1;  // the last value head whose next block was prefetched for this block
        for (Index h = 0; h < p.heads; ++h) {
          for (Index q = 0; q < p.nq; ++q) {
            const Index r = h * p.nq + q;
            const Segment& seg = segs[r];
            const Index jlo = std::max(seg.lo, j0), jhi = std::min(seg.hi, j0 + m);
            if (jlo >= jhi) continue;
            // The block's value rows (inside one block of a paged cache; stored values are read through
            // stored_value_sums instead).
            const Scalar* vb = p.stored() ? nullptr : p.value_row(b, h, k0 + j0);
            Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>> av(ws.acc.data() + ((item * p.heads + h) * p.nq + q) * p.d_v, p.d_v);
            const Scalar* pr = scores + r * kDecodeChunk;
            if (p.stored()) {
              // Solid or not, key by key where the mask has holes.
              if (seg.solid) {
                // The next block's rows of this value head, where they follow in memory (the same block of a
                // paged cache), are read next: a hint to prefetch them, given by the first row of the value
                // head's query heads whose visible segment reaches this block solidly.
                const Index g = h / p.kv_group;
                const Index ahead = g != prefetched ? std::clamp<Index>(p.run_of(k0 + jlo, n - jlo) - (jhi - jlo), 0, kRows) : Index{0};
                prefetched = g;
                stored_value_sums(p, av.data(), pr + jlo, b, g, k0 + jlo, jhi - jlo, ahead);
              } else {
                for (Index j = jlo; j < jhi; ++j)
                  if (!segment_hole(seg, visibility, b, h, q, k0, j))
                    stored_value_sums(p, av.data(), pr + j, b, h / p.kv_group, k0 + j, Index{1});
              }
            } else if (seg.solid) {
              simd::add_weighted_rows(p.isa, av.data(), p.d_v, pr + jlo, vb + (jlo - j0) * p.v.row_stride, p.v.row_stride, jhi - jlo);
            } else {
              for (Index j = jlo; j < jhi; ++j)
                if (!segment_hole(seg, visibility, b, h, q, k0, j)) av += pr[j] * Vec(vb + (j - j0) * p.v.row_stride, p.d_v);
            }
          }
        }
      }
    }
  });

  // Merge each row's partial states in chunk order, then finish it.
  const bool accumulated = !(p.dropout && p.keep_scale == Scalar(0));
  parallel_for(device, p.batch * rows, std::max<Index>(1, p.batch * rows / (4 * workers)), [&](Index r0, Index r1) {
    // A program's mask over a chunk of one row, for the probabilities.
    std::unique_ptr<bool[]> holes(Program::kMask && p.probabilities != nullptr ? new bool[kDecodeChunk] : nullptr);
    for (Index r = r0; r < r1; ++r) {
      const Index b = r / rows, hq = r % rows, h = hq / p.nq, q = hq % p.nq;
      const Index first = (b * chunks) * rows + hq;
      SoftmaxRow<Scalar> st = ws.states[static_cast<std::size_t>(first)];
      Scalar* acc = ws.acc.data() + first * p.d_v;
      for (Index c = 1; c < chunks; ++c) {
        const Index other = (b * chunks + c) * rows + hq;
        st.merge(ws.states[static_cast<std::size_t>(other)], acc, ws.acc.data() + other * p.d_v, p.d_v);
      }
      if constexpr (std::is_same<Scalar, float>::value)
        if (p.kv_storage == Storage::kBFloat16) simd::unpair_features(p.isa, acc, p.d_v);  // (the paired layout)
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
        KeyRange range = visibility.row(b, h, q);
        bool exact = true;
        if constexpr (Program::kMask) exact = narrow_row(program, p, b, h, q, range);
        const Scalar lse = st.log_sum_exp();
        for (Index k0 = range.lo / kDecodeChunk * kDecodeChunk; k0 < range.hi; k0 += kDecodeChunk) {
          const Index n = std::min(kDecodeChunk, p.nk - k0);
          Scalar* x = out + k0;
          // The row's keys only (apply hides the rest).
          const Index lo = std::max<Index>(range.lo - k0, 0), hi = std::min(range.hi - k0, n);
          for (Index j = lo; j < hi;) {
            const Index run = p.run_of(k0 + j, hi - j);
            key_scores(p, b, h / p.kv_group, k0 + j, run, simd::Queries<Scalar>{p.q.row(b, h, q), 0, 0, 1, 1, 1, p.d_k},
                       x + j, kDecodeChunk);
            j += run;
          }
          if constexpr (Program::kMask) {
            Segment seg = visibility.segment(range, b, h, q, k0, n);
            if (!seg.none() && !exact) ask_mask(program, visibility, b, h, q, k0, seg, holes.get());
            pipeline.apply_segment(x, n, b, h, q, k0, seg);
          } else {
            pipeline.apply(x, n, b, h, q, k0, range);
          }
          simd::exp_shifted_sum(p.isa, x, n, lse);
        }
      }
    }
  });
}

// The decoding kernel with the fixed options alone.
template <typename Scalar>
void decode_attention(const AttentionProblem<Scalar>& p, DecodeWorkspace<Scalar>& ws,
                      const Eigen::ThreadPoolDevice* device = nullptr) {
  decode_attention_program(p, NoProgram{}, ws, device);
}

}  // namespace kernels
SDPA_NAMESPACE_END

#include "sdpa/detail/instances.inc"
SDPA_DETAIL_EXTERN_INSTANCES(DECODE_ATTENTION)
