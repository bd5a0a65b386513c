// The tiled attention core (FlashAttention's online softmax on the CPU). Per (batch, head, group of query
// blocks) a TileScorer walks the key blocks the group's rows can see (their key ranges bound the loop, so
// tiles past a causal diagonal, outside a window or past a key length are never touched), forms each
// tile's final scores (the products of tile_products.hpp, then the score pipeline of scores.hpp) and hands
// the tile to a visitor. The forward's visitor folds the tile into each row's running softmax
// (softmax.hpp), applies dropout and adds probabilities times v; a second visitor writes the normalised
// probabilities when a caller asks for them, from each row's log-sum-exp, as a backward pass recomputes
// them. A few query blocks take turns on each key block so that its k and v are fetched once for all of
// them. Memory is one tile of scores plus the group's accumulators per worker, whatever the lengths.
// Dropout asks the shared DropoutSampler for every element, so it drops exactly what reference_attention
// drops. Key and query blocks start at multiples of the block sizes whatever the grouping and the
// threads, so every row is computed by the same operations on 1 thread or many.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include "sdpa/detail/buffer.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "sdpa/kernels/bf16_products.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/scores.hpp"
#include "sdpa/kernels/softmax.hpp"
#include "sdpa/kernels/rows.hpp"
#include "sdpa/kernels/tile_config.hpp"
#include "sdpa/kernels/tile_products.hpp"
#include "sdpa/kernels/visibility.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// One tile as a visitor sees it: tile row i is query q0 + r0 + i, tile column j is key k0 + j. Only the
// rectangle [i0, i1) x [j0, j1) was computed; inside it s holds the final scores, -inf where hidden.
template <typename Scalar>
struct Tile {
  using Index = Eigen::Index;
  using Segment = typename Visibility<Scalar>::Segment;
  Index b = 0, h = 0, q0 = 0;
  Index r0 = 0, rows = 0, slot = 0;  // the query block: group rows r0 .. r0 + rows - 1, packed in `slot`
  Index k0 = 0, cols = 0;            // the key block
  Index i0 = 0, i1 = 0, j0 = 0, j1 = 0;
  bool any_hidden = false;           // some score of the rectangle is hidden
  Scalar* s = nullptr;
  Index lds = 0;
  Scalar* pre = nullptr;              // when asked for: the scores as a program's score function took them
  const Segment* segments = nullptr;  // per tile row: its visible keys of the block (none: a closed row)

  Scalar* row(Index i) const noexcept { return s + i * lds + j0; }
  Scalar* pre_row(Index i) const noexcept { return pre + i * lds + j0; }
  Index width() const noexcept { return j1 - j0; }
  // Whether key k0 + j (j in [j0, j1)) is hidden from tile row i.
  bool hidden(const Visibility<Scalar>& vis, Index i, Index j) const noexcept {
    const Segment& seg = segments[i];
    if (j < seg.lo || j >= seg.hi) return true;
    return segment_hole(seg, vis, b, h, q0 + r0 + i, k0, j);
  }
};

// Walks the tiles of one group of query rows and forms their scores; shared by the forward, the
// probabilities and the backward pass. Scratch is sized once per worker; the tile loop allocates nothing.
// With a program's mask function (kernels/program.hpp), each row's range is first narrowed by the
// function's interval (narrow_row); a tile its plan marks none is skipped, one it marks full is not asked,
// nor a row whose interval is exact, and in any other the function is asked for each key a row's range
// holds (its answers narrow the row's segment as a mask tensor's would). keep_pre: tiles carry the scores
// as the program's score function took them (the backward's chain rule).
template <typename Scalar, typename Program = NoProgram>
class TileScorer {
 public:
  using Index = Eigen::Index;
  using Segment = typename Visibility<Scalar>::Segment;

  TileScorer(const ScorePipeline<Scalar, Program>& pipeline, const TileConfig& c, bool keep_pre = false)
      : pipeline_(pipeline),
        vis_(pipeline.visibility()),
        p_(vis_.problem()),
        bq_(c.block_q),
        bk_(c.block_k),
        // Score rows padded to a whole cache line so that each row the softmax reads starts on one.
        lds_((c.block_k + kLine - 1) / kLine * kLine),
        s_buf_(static_cast<std::size_t>(c.block_q * lds_ + kLine)),
        ranges_(static_cast<std::size_t>(c.group * c.block_q)),
        exact_(Program::kMask ? static_cast<std::size_t>(c.group * c.block_q) : 0),
        segments_(static_cast<std::size_t>(c.block_q)),
        products_(TileShape{c.block_q, c.block_k, c.group, p_.d_k, p_.d_v}, p_.isa, p_.compute, p_.bf16_path,
                  c.pack_operands),
        k_wide_(p_.stored() || p_.paged() ? static_cast<std::size_t>(c.block_k * p_.d_k) : 0),
        v_wide_(p_.stored() || p_.paged() ? static_cast<std::size_t>(c.block_k * p_.d_v) : 0),
        holes_(Program::kMask ? new bool[static_cast<std::size_t>(c.block_q * c.block_k)] : nullptr),
        pre_buf_(Program::kScore && keep_pre ? static_cast<std::size_t>(c.block_q * lds_ + kLine) : 0) {}

  // Calls visit(tile) for every tile of (b, h) and the group rows q0 .. q0 + rows - 1 that some row sees,
  // key blocks in order (restricted to keys [key_lo, key_hi), which must start at a multiple of the key
  // block), the group's query blocks in order within each. count: add the tiles to stats().
  template <typename Visit>
  void run(Index b, Index h, Index q0, Index rows, Visit&& visit, bool count = true, Index key_lo = 0,
           Index key_hi = std::numeric_limits<Index>::max()) {
    Index lo = std::numeric_limits<Index>::max(), hi = std::numeric_limits<Index>::min();
    for (Index i = 0; i < rows; ++i) {
      KeyRange r = vis_.row(b, h, q0 + i);
      if constexpr (Program::kMask) exact_[static_cast<std::size_t>(i)] = narrow_row(*program(), p_, b, h, q0 + i, r);
      // Field by field: GCC 12 copied the whole struct through the stack, a wide load right after the
      // narrower stores that built it (a store-forwarding stall per row; the same in classify).
      KeyRange& kept = ranges_[static_cast<std::size_t>(i)];
      kept.lo = r.lo;
      kept.hi = r.hi;
      kept.solid = r.solid;
      if (r.empty()) continue;
      lo = std::min(lo, r.lo);
      hi = std::max(hi, r.hi);
    }
    lo = std::max(lo, key_lo);
    hi = std::min(hi, key_hi);
    if (lo >= hi) return;
    products_.new_group(/*single_key_block=*/(hi - 1) / bk_ == lo / bk_);
    Tile<Scalar> t;
    t.b = b;
    t.h = h;
    t.q0 = q0;
    t.s = aligned(s_buf_);
    t.lds = lds_;
    t.pre = pre_buf_.empty() ? nullptr : aligned(pre_buf_);
    t.segments = segments_.data();
    const BlockMask* plan = nullptr;
    if constexpr (Program::kMask) plan = program()->plan();
    for (Index k0 = lo / bk_ * bk_; k0 < hi; k0 += bk_) {
      const Index cols = std::min(bk_, p_.nk - k0);
      // A key block the plan hides from every row of the group is neither fetched nor packed.
      if (plan != nullptr && plan->covering(b + p_.batch_base, h, q0, q0 + rows, k0, k0 + cols) == BlockState::kNone) {
        if (count) stats_.tiles_skipped += (rows + bq_ - 1) / bq_;
        continue;
      }
      if (gathered()) {
        // Stored or paged keys and values: the block of this head widened or gathered once, then packed like
        // any other.
        // A paged batch entry's table ends at its length: the block's rows past it are zeros (hidden keys).
        const Index g = h / p_.kv_group;
        const Index held = p_.paged() && p_.key_lengths != nullptr ? std::clamp<Index>(p_.key_lengths[b] - k0, 0, cols) : cols;
        gather_kv(p_, /*values=*/false, b, g, k0, held, k_wide_.data(), p_.d_k);
        gather_kv(p_, /*values=*/true, b, g, k0, held, v_wide_.data(), p_.d_v);
        std::fill(k_wide_.data() + held * p_.d_k, k_wide_.data() + cols * p_.d_k, Scalar(0));
        std::fill(v_wide_.data() + held * p_.d_v, v_wide_.data() + cols * p_.d_v, Scalar(0));
        wide_k0_ = k0;
        products_.set_keys(k_wide_.data(), p_.d_k, v_wide_.data(), p_.d_v, cols);
      } else {
        products_.set_keys(p_.key_row(b, h, k0), p_.k.row_stride, p_.value_row(b, h, k0), p_.v.row_stride, cols);
      }
      t.k0 = k0;
      t.cols = cols;
      for (Index r0 = 0; r0 < rows; r0 += bq_) {
        const Index n = std::min(bq_, rows - r0);
        t.r0 = r0;
        t.rows = n;
        t.slot = r0 / bq_;
        if (!classify(t, count)) continue;
        const Index ni = t.i1 - t.i0, nj = t.j1 - t.j0;
        // The scale rides on the product as its alpha: dot * scale, as the reference rounds it.
        products_.scores(t.slot, {p_.q.row(b, h, q0 + r0), p_.q.row_stride}, TileRect{n, t.i0, ni, t.j0, nj}, p_.scale,
                         {t.s, lds_});
        for (Index i = t.i0; i < t.i1; ++i) {
          Segment seg = segments_[static_cast<std::size_t>(i)];
          seg.lo -= t.j0;
          seg.hi -= t.j0;
          if (seg.holes != nullptr) seg.holes += t.j0;
          if (seg.none()) seg = Segment{};
          pipeline_.apply_segment(t.row(i), nj, b, h, q0 + r0 + i, k0 + t.j0, seg, t.pre != nullptr ? t.pre_row(i) : nullptr);
        }
        visit(static_cast<const Tile<Scalar>&>(t));
      }
    }
  }

  ComputeTileProducts<Scalar>& products() noexcept { return products_; }
  const TileStats& stats() const noexcept { return stats_; }
  const Program* program() const noexcept { return pipeline_.program(); }

  // The value row of key k for (b, h), inside the key block a visitor is being handed: widened or gathered
  // when the problem's values are stored or paged.
  const Scalar* value_row(Index b, Index h, Index k) const noexcept {
    return gathered() ? v_wide_.data() + (k - wide_k0_) * p_.d_v : p_.value_row(b, h, k);
  }
  bool gathered() const noexcept { return p_.stored() || p_.paged(); }

 private:
  static constexpr Index kLine = 64 / static_cast<Index>(sizeof(Scalar));

  static Scalar* aligned(std::vector<Scalar>& buf) noexcept { return sdpa::detail::cache_line_start(buf); }

  // Finds each row's visible keys in the tile and the rectangle of rows and keys that holds any. Returns
  // false when no row sees a key of the tile.
  bool classify(Tile<Scalar>& t, bool count) {
    t.i0 = t.rows;
    t.i1 = 0;
    t.j0 = t.cols;
    t.j1 = 0;
    BlockState state = BlockState::kFull;
    if constexpr (Program::kMask) {
      const BlockMask* plan = program()->plan();
      state = plan == nullptr ? BlockState::kPartial
                              : plan->covering(t.b + p_.batch_base, t.h, t.q0 + t.r0, t.q0 + t.r0 + t.rows, t.k0, t.k0 + t.cols);
      if (state == BlockState::kNone) {
        if (count) ++stats_.tiles_skipped;
        return false;
      }
    }
    for (Index i = 0; i < t.rows; ++i) {
      const Segment seg = vis_.segment(ranges_[static_cast<std::size_t>(t.r0 + i)], t.b, t.h, t.q0 + t.r0 + i, t.k0, t.cols);
      Segment& kept = segments_[static_cast<std::size_t>(i)];
      kept.lo = seg.lo;
      kept.hi = seg.hi;
      kept.solid = seg.solid;
      kept.holes = nullptr;
      if constexpr (Program::kMask) {
        if (state == BlockState::kPartial && !seg.none() && !exact_[static_cast<std::size_t>(t.r0 + i)]) ask_mask(t, i, kept);
      }
      if (kept.none()) continue;
      t.i0 = std::min(t.i0, i);
      t.i1 = i + 1;
      t.j0 = std::min(t.j0, kept.lo);
      t.j1 = std::max(t.j1, kept.hi);
    }
    if (t.i1 <= t.i0) {
      if (count) ++stats_.tiles_skipped;
      return false;
    }
    if (count) ++stats_.tiles_computed;
    t.any_hidden = false;
    for (Index i = t.i0; i < t.i1 && !t.any_hidden; ++i) {
      const Segment& seg = segments_[static_cast<std::size_t>(i)];
      t.any_hidden = seg.none() || !seg.solid || seg.lo > t.j0 || seg.hi < t.j1;
    }
    return true;
  }

  // The program's mask function over tile row i's segment (ask_mask in scores.hpp).
  void ask_mask(const Tile<Scalar>& t, Index i, Segment& seg) {
    kernels::ask_mask(*program(), vis_, t.b, t.h, t.q0 + t.r0 + i, t.k0, seg, holes_.get() + i * bk_);
  }

  const ScorePipeline<Scalar, Program>& pipeline_;
  const Visibility<Scalar>& vis_;
  const AttentionProblem<Scalar>& p_;
  const Index bq_, bk_, lds_;
  std::vector<Scalar> s_buf_;
  std::vector<KeyRange> ranges_;   // per group row
  std::vector<char> exact_;        // per group row: the program's mask keeps every key of its range
  std::vector<Segment> segments_;  // per tile row of the current tile
  ComputeTileProducts<Scalar> products_;
  TileStats stats_;
  std::vector<Scalar> k_wide_, v_wide_;  // a stored or paged problem's current key block, gathered (block_k x d)
  Index wide_k0_ = 0;
  // A program's hidden keys: per tile row, one per key of the block (bool, whose stores the compiler knows
  // do not alias the mask function's data, as char stores would).
  std::unique_ptr<bool[]> holes_;
  std::vector<Scalar> pre_buf_;          // keep_pre: one tile of the scores before the score function
};

// The forward of one worker: output rows q0 .. q0 + rows - 1 of (batch b, head h), written to p.out (and
// the rows' log-sum-exp and probabilities when the problem asks for them).
template <typename Scalar, typename Program = NoProgram>
class TiledForward {
 public:
  using Index = Eigen::Index;
  using Segment = typename Visibility<Scalar>::Segment;

  TiledForward(const ScorePipeline<Scalar, Program>& pipeline, const TileConfig& c)
      : scorer_(pipeline, c),
        vis_(pipeline.visibility()),
        p_(vis_.problem()),
        o_buf_(static_cast<std::size_t>(c.group * c.block_q * p_.d_v + kLine)),
        rows_(static_cast<std::size_t>(c.group * c.block_q)),
        bits_(p_.dropout ? static_cast<std::size_t>(c.block_k + 8) : 0) {}

  void run(Index b, Index h, Index q0, Index rows) {
    const AttentionProblem<Scalar>& p = p_;
    Scalar* o = aligned(o_buf_);
    std::fill(o, o + rows * p.d_v, Scalar(0));
    std::fill(rows_.begin(), rows_.begin() + rows, SoftmaxRow<Scalar>{});
    // With p = 1 nothing reaches the output, and the products are skipped.
    const bool accumulate = !(p.dropout && p.keep_scale == Scalar(0));
    const Index bh = b * p.heads + h;

    scorer_.run(b, h, q0, rows, [&](const Tile<Scalar>& t) {
      const Index nj = t.width();
      for (Index i = t.i0; i < t.i1; ++i) {
        SoftmaxRow<Scalar>& row = rows_[static_cast<std::size_t>(t.r0 + i)];
        if (!t.segments[i].none()) row.seen = true;
        // Rows that see nothing here have only -inf scores: fold zeroes them and changes nothing.
        const Scalar alpha = row.fold(p.isa, t.row(i), nj, /*lazy=*/p.compute == Compute::kFloat);
        if (alpha != Scalar(1)) {
          Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>(o + (t.r0 + i) * p.d_v, p.d_v) *= alpha;
        }
        // The sum above is over every probability, dropped or not (the reference normalises before it
        // drops); only the kept ones, scaled by 1 / (1 - p), reach the output.
        if (p.dropout && accumulate) apply_dropout(t.row(i), nj, bh, t.q0 + t.r0 + i, t.k0 + t.j0);
      }
      if (!accumulate) return;
      Scalar* ot = o + t.r0 * p.d_v;
      // A hidden key contributes nothing, not even a NaN or infinity in its value row; the products would
      // give 0 * NaN for it, so a tile with hidden keys over non-finite values adds the visible ones one
      // by one (only inputs with NaN or inf come here).
      if (t.any_hidden && !values_finite(t)) {
        for (Index i = t.i0; i < t.i1; ++i) {
          for (Index j = t.j0; j < t.j1; ++j) {
            if (t.hidden(vis_, i, j)) continue;
            const Scalar x = t.s[i * t.lds + j];
            const Scalar* v = scorer_.value_row(b, h, t.k0 + j);
            for (Index d = 0; d < p.d_v; ++d) ot[i * p.d_v + d] += x * v[d];
          }
        }
        return;
      }
      scorer_.products().accumulate(TileRect{t.rows, t.i0, t.i1 - t.i0, t.j0, nj}, {t.s, t.lds}, {ot, p.d_v});
    });

    for (Index i = 0; i < rows; ++i) {
      SoftmaxRow<Scalar>& row = rows_[static_cast<std::size_t>(i)];
      if (p.sinks != nullptr) row.add_sink(p.sinks[h], o + i * p.d_v, p.d_v);
      finish_row(p.out.row(b, h, q0 + i), o + i * p.d_v, p.d_v, row, p.masked_rows, accumulate);
      if (p.lse != nullptr) p.lse[bh * p.nq + q0 + i] = row.log_sum_exp();
    }
    if (p.probabilities != nullptr) write_probabilities(b, h, q0, rows);
  }

  const TileStats& stats() const noexcept { return scorer_.stats(); }

 private:
  static constexpr Index kLine = 64 / static_cast<Index>(sizeof(Scalar));

  static Scalar* aligned(std::vector<Scalar>& buf) noexcept { return sdpa::detail::cache_line_start(buf); }

  // p = exp(s - lse) for the visible keys, 0 for hidden ones, the policy's value in rows that see nothing:
  // the scores again (the same products and pipeline, so the same values), normalised by each row's
  // log-sum-exp, as a backward pass recomputes them.
  void write_probabilities(Index b, Index h, Index q0, Index rows) {
    const AttentionProblem<Scalar>& p = p_;
    const Index bh = b * p.heads + h;
    auto prob_row = [&](Index q) { return p.probabilities + (bh * p.nq + q) * p.nk; };
    for (Index i = 0; i < rows; ++i) {
      const SoftmaxRow<Scalar>& row = rows_[static_cast<std::size_t>(i)];
      const Scalar fill = !row.seen && !row.sunk && p.masked_rows == MaskedRows::kNaN
                              ? std::numeric_limits<Scalar>::quiet_NaN()
                              : Scalar(0);
      std::fill_n(prob_row(q0 + i), p.nk, fill);
    }
    scorer_.run(
        b, h, q0, rows,
        [&](const Tile<Scalar>& t) {
          for (Index i = t.i0; i < t.i1; ++i) {
            if (t.segments[i].none()) continue;
            const Scalar lse = rows_[static_cast<std::size_t>(t.r0 + i)].log_sum_exp();
            simd::exp_shifted_sum(p.isa, t.row(i), t.width(), lse);
            std::copy_n(t.row(i), t.width(), prob_row(t.q0 + t.r0 + i) + t.k0 + t.j0);
          }
        },
        /*count=*/false);
  }

  // Whether the v rows of the tile's computed keys [j0, j1) are all finite (only asked for tiles with
  // hidden keys inside their rectangle; keys outside it may not even be projected).
  // The answer is remembered per key block as the interval of its keys known finite, and a tile whose keys
  // overlap or adjoin it reads only the rows it adds: the query blocks of a group visit each key block in
  // turn, and under a window or causal mask nearly every tile has hidden keys (a causal group's diagonal
  // tiles reach 64, 128, ... keys further each).
  bool values_finite(const Tile<Scalar>& t) {
    const Index bh = t.b * p_.heads + t.h;
    if (bh != finite_bh_ || t.k0 != finite_k0_) {
      finite_bh_ = bh;
      finite_k0_ = t.k0;
      finite_lo_ = finite_hi_ = 0;
    }
    const auto finite = [&](Index j0, Index j1) {
      for (Index j = j0; j < j1; ++j)
        if (!row_finite(scorer_.value_row(t.b, t.h, t.k0 + j), p_.d_v)) return false;
      return true;
    };
    if (finite_hi_ <= finite_lo_ || t.j1 < finite_lo_ || t.j0 > finite_hi_) {
      if (!finite(t.j0, t.j1)) return false;
      finite_lo_ = t.j0;
      finite_hi_ = t.j1;
      return true;
    }
    if (!finite(t.j0, finite_lo_) || !finite(finite_hi_, t.j1)) return false;  // empty where inside
    finite_lo_ = std::min(finite_lo_, t.j0);
    finite_hi_ = std::max(finite_hi_, t.j1);
    return true;
  }

  // Dropout on a row of unnormalised probabilities for keys k0 ...: dropped -> 0, kept -> x * keep_scale.
  // The row's random words come from one DropoutSampler::fill_bits call (vectorised Philox).
  void apply_dropout(Scalar* x, Index n, Index bh, Index q, Index k0) {
    const DropoutSampler& sampler = p_.sampler;
    const Scalar keep = p_.keep_scale;
    const Index k4_begin = k0 >> 2, blocks = ((k0 + n + 3) >> 2) - k4_begin;
    sampler.fill_bits(p_.isa, bh, q, k4_begin, blocks, bits_.data());
    const std::uint32_t* bits = bits_.data() + (k0 - 4 * k4_begin);
    for (Index j = 0; j < n; ++j) x[j] = sampler.dropped_bits(bits[j]) ? Scalar(0) : x[j] * keep;
  }

  TileScorer<Scalar, Program> scorer_;
  const Visibility<Scalar>& vis_;
  const AttentionProblem<Scalar>& p_;
  std::vector<Scalar> o_buf_;
  std::vector<SoftmaxRow<Scalar>> rows_;
  std::vector<std::uint32_t> bits_;  // one row's dropout words (block_k + 8)
  // values_finite's memory: keys [finite_lo_, finite_hi_) of key block finite_k0_ of (batch, head) finite_bh_.
  Index finite_bh_ = -1, finite_k0_ = -1, finite_lo_ = 0, finite_hi_ = 0;
};

// Asks for the cache lines of [p, p + bytes) to be brought to L2: a hint, nothing where the compiler offers
// no prefetch. Inlined into its caller's loop, and so is that loop's lambda: out of line, GCC 12 finds the
// function free of side effects (a prefetch has none it counts) and drops every call to it at -O3.
SDPA_ALWAYS_INLINE void prefetch_l2(const void* p, std::size_t bytes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = static_cast<const char*>(p);
  for (std::size_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(c + offset, 0, 2);
  if (bytes > 0) __builtin_prefetch(c + bytes - 1, 0, 2);  // the last line, where p is not on a line start
#else
  (void)p;
  (void)bytes;
#endif
}

// The block sizes a problem runs with: the config's fields, zero ones derived from the caches, each no
// larger than its sequence, and query groups made smaller when there would be too few of them to keep
// every worker busy. (Groups change which blocks share packed operands, never a row's arithmetic.)
// `forward`: the forward pass, whose tiles go to sdpa::gemm except on the portable path; the backward's
// transposed products are Eigen's (TileConfig::for_caches' eigen_products).
template <typename Scalar>
TileConfig resolve_tile_config(const AttentionProblem<Scalar>& p, TileConfig config, Eigen::Index workers,
                               bool forward = false) {
  using Index = Eigen::Index;
  TileConfig derived = TileConfig::for_problem<Scalar>(p.d_k, p.d_v, /*eigen_products=*/!forward || p.isa == Isa::kPortable);
  // Causal query groups differ in cost (the later ones see more keys); groups of 16 blocks left two workers
  // unevenly loaded (slower than groups of 8 in the measurements behind this rule; bench/RESULTS.md).
  if (p.causal) derived.group = std::min<Index>(derived.group, 8);
  // A sliding window: each query block sees a band of window + block_q keys, and every key block it
  // touches is computed whole, so long key blocks would compute several times the band. Key blocks of a
  // quarter of the window (at least 16 keys) keep that waste under about 1.5x.
  if (p.window_left >= 0 && (p.causal || p.window_right >= 0)) {
    const Index band = p.window_left + 1 + (p.causal ? 0 : p.window_right);
    Index k = 16;
    while (2 * k <= band / 4) k *= 2;
    derived.block_k = std::min(derived.block_k, k);
  }
  // Keys that would make two blocks or fewer make one (while it stays within the operand bound of the
  // rule): a short sequence cut in two (49 keys at d_k 512 as 32 + 17) multiplied a ragged second block,
  // folded every row twice and packed its queries for two uses; as one block it ran faster.
  const Index max_block_k = TileConfig::max_block_k(static_cast<Index>(sizeof(Scalar)), p.d_k, p.d_v);
  if (p.nk <= 2 * derived.block_k && p.nk <= max_block_k) derived.block_k = std::max(derived.block_k, p.nk);
  TileConfig c;
  c.pack_operands = config.pack_operands;
  c.block_q = std::max<Index>(1, std::min(p.nq, config.block_q > 0 ? config.block_q : derived.block_q));
  c.block_k = std::max<Index>(1, std::min(p.nk, config.block_k > 0 ? config.block_k : derived.block_k));
  const Index q_blocks = (p.nq + c.block_q - 1) / c.block_q;
  c.group = std::max<Index>(1, std::min(q_blocks, config.group > 0 ? config.group : derived.group));
  const Index wanted = workers == 1 ? 1 : 4 * workers;
  while (c.group > 1 && p.batch * p.heads * ((q_blocks + c.group - 1) / c.group) < wanted) c.group = (c.group + 1) / 2;
  return c;
}

// The attention core of p under a score program (kernels/program.hpp), tiled (see the header comment).
// Zero fields of `config` are derived from the caches (TileConfig::for_problem); `stats`, when given,
// receives the tile counts.
template <typename Scalar, typename Program>
void tiled_attention_program(const AttentionProblem<Scalar>& p, const Program& program,
                             const Eigen::ThreadPoolDevice* device = nullptr, TileConfig config = TileConfig{},
                             TileStats* stats = nullptr) {
  using Index = Eigen::Index;
  if (stats != nullptr) *stats = TileStats{};
  if (p.batch <= 0 || p.heads <= 0 || p.nq <= 0) return;
  if (p.nk == 0) {
    // An empty softmax: the product with an empty v is zero, under either masked-row policy; no row saw a
    // key (log-sum-exp -inf, or the sink's logit), and there are no probabilities to write.
    for (Index b = 0; b < p.batch; ++b)
      for (Index h = 0; h < p.heads; ++h)
        for (Index i = 0; i < p.nq; ++i) {
          std::fill(p.out.row(b, h, i), p.out.row(b, h, i) + p.d_v, Scalar(0));
          if (p.lse != nullptr)
            p.lse[(b * p.heads + h) * p.nq + i] = p.sinks != nullptr ? p.sinks[h] : -std::numeric_limits<Scalar>::infinity();
        }
    return;
  }
  const TileConfig c = resolve_tile_config(p, config, static_cast<Index>(worker_count(device)), /*forward=*/true);
  const Index span = c.group * c.block_q;  // queries per unit of work
  const Index groups = (p.nq + span - 1) / span;
  const Index units = p.batch * p.heads * groups;
  // Several chunks per worker: under causal masks the query groups differ in cost, and the shared counter
  // evens that out. Each thread keeps one TiledForward (its scratch) for all the chunks it takes.
  const Index grain = balanced_grain(device, units, 4);
  const Visibility<Scalar> visibility(p, device);
  const ScorePipeline<Scalar, Program> pipeline(visibility, &program);
  // The rows a unit reads and writes (its queries and output rows, every key and value row of its head)
  // are brought to L2 while the unit before it computes, when they take at most an eighth of L2: a short
  // sequence's unit (the 50 x 49 shapes: 49 rows) otherwise waits on them, since they lie a row stride
  // apart in the projection's buffers (a page or more per row, beyond what the hardware prefetcher
  // follows) and come from L3 or memory, the projection having written megabytes after them. (Issued in
  // one go; spread over the unit's softmax rows instead, they measured the same.) Stored and paged keys
  // are gathered block by block instead (TileScorer). A hint only: no result depends on it.
  const Index row_bytes = (p.d_k + p.d_v) * static_cast<Index>(sizeof(Scalar));
  const bool prefetch_next = !p.stored() && !p.paged() && units > 1 &&
                             (std::min(span, p.nq) + p.nk) * row_bytes <= static_cast<Index>(Eigen::l2CacheSize()) / 8;
  const auto prefetch_unit = [&](Index u) SDPA_ALWAYS_INLINE_LAMBDA {
    const Index bh = u / groups, q0 = u % groups * span, rows = std::min(span, p.nq - q0);
    const Index b = bh / p.heads, h = bh % p.heads;
    const std::size_t q_bytes = static_cast<std::size_t>(p.d_k) * sizeof(Scalar);
    const std::size_t v_bytes = static_cast<std::size_t>(p.d_v) * sizeof(Scalar);
    for (Index i = q0; i < q0 + rows; ++i) prefetch_l2(p.q.row(b, h, i), q_bytes);
    for (Index j = 0; j < p.nk; ++j) {
      prefetch_l2(p.key_row(b, h, j), q_bytes);
      prefetch_l2(p.value_row(b, h, j), v_bytes);
    }
    for (Index i = q0; i < q0 + rows; ++i) prefetch_l2(p.out.row(b, h, i), v_bytes);
  };
  std::atomic<Index> computed{0}, skipped{0};
  parallel_for_with_state(
      device, units, grain, [&] { return TiledForward<Scalar, Program>(pipeline, c); },
      [&](TiledForward<Scalar, Program>& worker, Index u0, Index u1) {
        for (Index u = u0; u < u1; ++u) {
          const Index bh = u / groups, g = u % groups;
          const Index q0 = g * span;
          if (prefetch_next && u + 1 < units) prefetch_unit(u + 1);
          worker.run(bh / p.heads, bh % p.heads, q0, std::min(span, p.nq - q0));
        }
      },
      [&](TiledForward<Scalar, Program>& worker) {
        computed.fetch_add(worker.stats().tiles_computed, std::memory_order_relaxed);
        skipped.fetch_add(worker.stats().tiles_skipped, std::memory_order_relaxed);
      });
  if (stats != nullptr) {
    stats->tiles_computed = computed.load();
    stats->tiles_skipped = skipped.load();
  }
}

// The attention core of p with its fixed options alone.
template <typename Scalar>
void tiled_attention(const AttentionProblem<Scalar>& p, const Eigen::ThreadPoolDevice* device = nullptr,
                     TileConfig config = TileConfig{}, TileStats* stats = nullptr) {
  tiled_attention_program(p, NoProgram{}, device, config, stats);
}

}  // namespace kernels
SDPA_NAMESPACE_END

#include "sdpa/detail/instances.inc"
SDPA_DETAIL_EXTERN_INSTANCES(TILED_ATTENTION)
