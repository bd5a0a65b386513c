// The tiled attention core (FlashAttention's online softmax on the CPU): per (batch, head, block of queries)
// it walks blocks of keys, forms one tile of scores with an Eigen matrix product on the strided q/k rows,
// folds the tile into a running row max, row sum and output accumulator, and adds the tile's probabilities
// times v with a second product; the output is divided by the sum at the end. A few query blocks take turns
// on each key block so that its k and v rows are fetched once for all of them. Memory is one tile of scores
// plus the group's accumulators per worker, whatever the sequence lengths. Tiles whose every score is
// masked are skipped without a product (each mask row is summarised once as its run of unmasked keys), so a
// causal mask halves the work. Dropout is fused and asks the shared DropoutSampler for every element, so it
// drops exactly what reference_attention drops. TileConfig holds the block sizes, derived from the cache
// sizes unless a caller (a test) forces them.
#pragma once

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>


#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/projection.hpp"
#include "sdpa/parallel.hpp"

// Eigen 3.4's GEMM building blocks (its internal packing routines and block-panel kernel, unchanged
// through 3.4.x) let a worker pack each k and v block once for its whole query group and each q block once
// for all key blocks, where a public product packs all three again for every tile (measured 6% faster
// overall at d = 64, where packing took some 12% of the time). With another Eigen (or SDPA_TILED_PACKED_PRODUCTS defined to 0) every tile goes through
// the public product, as tiles trimmed by a mask always do.
#ifndef SDPA_TILED_PACKED_PRODUCTS
#if EIGEN_WORLD_VERSION == 3 && EIGEN_MAJOR_VERSION == 4
#define SDPA_TILED_PACKED_PRODUCTS 1
#else
#define SDPA_TILED_PACKED_PRODUCTS 0
#endif
#endif

namespace sdpa {
namespace kernels {

// Block sizes of the tiled kernel: block_k keys make one tile with block_q queries, and `group` query
// blocks take turns on each key block (so that its k and v come from cache after the first). A zero field
// means "derive it from the caches" (for_problem), so TileConfig{} is the default and a test can force
// tiny blocks with TileConfig{4, 8}.
struct TileConfig {
  Eigen::Index block_q = 0;
  Eigen::Index block_k = 0;
  Eigen::Index group = 0;

  // The rule, for `scalar_bytes`-wide elements and the per-core L2 size in bytes. Everything a group
  // touches should stay in L2: the k and v blocks (block_k x (d_k + d_v)) get an eighth of it, the score
  // tile (block_q x block_k) another eighth, and the group's q rows and output accumulators
  // (group x block_q x (d_k + d_v)) half, leaving the rest for the copies Eigen packs them into. Each
  // operand Eigen packs also stays within EIGEN_STACK_ALLOCATION_LIMIT, so that the products take their
  // buffers from the stack, never the heap. Sizes are powers of two, block_k in [16, 512], block_q in
  // [16, 256] and group in [1, 8]. (Measured on a 1 MiB L2, float, d = 64: 128 x 256 tiles in groups of
  // 8 ran about as fast as any other shape from 64 x 512 to 256 x 256, and groups of 4-8 about 10% faster
  // than no groups.)
  static TileConfig for_caches(Eigen::Index scalar_bytes, Eigen::Index d_k, Eigen::Index d_v,
                               Eigen::Index l2_bytes) noexcept {
    scalar_bytes = std::max<Eigen::Index>(1, scalar_bytes);
    d_k = std::max<Eigen::Index>(1, d_k);
    d_v = std::max<Eigen::Index>(1, d_v);
    l2_bytes = std::max<Eigen::Index>(l2_bytes, 128 * 1024);
    const auto floor_pow2 = [](Eigen::Index x) {
      Eigen::Index p = 1;
      while (2 * p <= x) p *= 2;
      return p;
    };
    const Eigen::Index eighth = l2_bytes / 8 / scalar_bytes;  // in elements
    const Eigen::Index packed = static_cast<Eigen::Index>(EIGEN_STACK_ALLOCATION_LIMIT) / scalar_bytes;
    TileConfig c;
    c.block_k = std::clamp<Eigen::Index>(
        floor_pow2(std::min(eighth / (d_k + d_v), packed / std::max(d_k, d_v))), 16, 512);
    c.block_q = std::clamp<Eigen::Index>(
        floor_pow2(std::min({std::min(eighth, packed) / c.block_k, packed / d_k})), 16, 256);
    c.group = std::clamp<Eigen::Index>(floor_pow2(4 * eighth / (c.block_q * (d_k + d_v))), 1, 8);
    return c;
  }

  template <typename Scalar>
  static TileConfig for_problem(Eigen::Index d_k, Eigen::Index d_v) noexcept {
    return for_caches(static_cast<Eigen::Index>(sizeof(Scalar)), d_k, d_v,
                      static_cast<Eigen::Index>(Eigen::l2CacheSize()));
  }
};

// What the kernel did with its tiles, for tests and tuning: a tile is one (block of queries, block of keys)
// pair of one (batch, head).
struct TileStats {
  Eigen::Index tiles_computed = 0;
  Eigen::Index tiles_skipped = 0;  // every score masked: no product at all
};

namespace detail {

// x[j] = exp(x[j] - shift) for j < n, returning the sum of the results: the softmax's one pass over a
// row of scores. Eigen's vectorised exp is the portable version; it clamps its argument, so exp(-inf) comes
// out as a tiny positive number rather than 0, and the caller zeroes masked entries again
// (kExpZeroesMasked says whether it must).
template <typename Scalar>
struct PortableShiftedExp {
  static constexpr bool kExpZeroesMasked = false;
  static Scalar run(Scalar* x, Eigen::Index n, Scalar shift) noexcept {
    Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> a(x, n);
    a = (a - shift).exp();
    return a.sum();
  }
};

template <typename Scalar>
struct ShiftedExp : PortableShiftedExp<Scalar> {};

#if defined(__AVX512F__)
// With AVX-512 the float exp is the softmax's bottleneck, and the instruction set offers a cheaper one
// than Eigen's generic code: Cephes' polynomial (as Eigen uses, about 1 ulp) with vscalefps for the power
// of two, fused with the shift and the sum, and exactly 0 for arguments below -87.3 (masked -inf included)
// so that masked keys need no second pass.
template <>
struct ShiftedExp<float> {
  static constexpr bool kExpZeroesMasked = true;
  static float run(float* x, Eigen::Index n, float shift) noexcept {
    const __m512 vshift = _mm512_set1_ps(shift);
    // Two sums so that consecutive packets do not wait on one another's addition.
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    Eigen::Index j = 0;
    for (; j + 32 <= n; j += 32) {
      const __m512 y0 = exp_shifted(_mm512_loadu_ps(x + j), vshift, __mmask16(0xFFFF));
      const __m512 y1 = exp_shifted(_mm512_loadu_ps(x + j + 16), vshift, __mmask16(0xFFFF));
      _mm512_storeu_ps(x + j, y0);
      _mm512_storeu_ps(x + j + 16, y1);
      sum0 = _mm512_add_ps(sum0, y0);
      sum1 = _mm512_add_ps(sum1, y1);
    }
    for (; j < n; j += 16) {
      const __mmask16 lanes = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
      const __m512 y = exp_shifted(_mm512_maskz_loadu_ps(lanes, x + j), vshift, lanes);
      _mm512_mask_storeu_ps(x + j, lanes, y);
      sum0 = _mm512_add_ps(sum0, y);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
  }

 private:
  // exp(v - shift) in the lanes of `lanes`, 0 in the others.
  static __m512 exp_shifted(__m512 v, __m512 shift, __mmask16 lanes) noexcept {
    const __m512 t = _mm512_sub_ps(v, shift);
    // Zero below -87.33, where exp falls under FLT_MIN; -inf (masked) included, whose NaN from the
    // reduction below is dropped here. A NaN argument stays NaN, as the reference's exp gives.
    // (The unmasked compare and an AND: at -O0 GCC's macro for the masked compare trips -Wsign-conversion.)
    lanes = static_cast<__mmask16>(lanes & _mm512_cmp_ps_mask(t, _mm512_set1_ps(-87.33f), _CMP_NLT_UQ));
    // At -O0 GCC's macro for vrndscaleps converts its all-ones mask to a signed short (-Wsign-conversion).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-conversion"
#endif
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), t);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(lanes, y, k);
  }
};
#endif

// Where the unmasked keys of one mask row lie: all in [lo, hi), and when `solid` every key of [lo, hi) is
// unmasked (one run; none when lo == hi). Causal, key-padding and sliding-window rows are solid, and a
// tile classifies them without reading the mask.
struct MaskRun {
  Eigen::Index lo = 0, hi = 0;
  bool solid = true;
};

// One MaskRun per distinct row of a broadcast mask, computed once before the tiles (in parallel): the
// mask's broadcast dimensions stay broadcast, so a causal (1, 1, nq, nk) mask gives nq runs for every
// batch and head.
class MaskRuns {
 public:
  using Index = Eigen::Index;

  MaskRuns(const BroadcastView<bool>& mask, Index batch, Index heads, Index nq, Index nk,
           const Eigen::ThreadPoolDevice* device)
      : mask_(mask),
        nh_(mask.stride[1] != 0 ? heads : 1),
        nr_(mask.stride[2] != 0 ? nq : 1),
        runs_(static_cast<std::size_t>((mask.stride[0] != 0 ? batch : 1) * nh_ * nr_)) {
    const Index n = static_cast<Index>(runs_.size());
    parallel_for(device, n, balanced_grain(device, n), [&](Index r0, Index r1) {
      for (Index r = r0; r < r1; ++r) {
        const Index q = r % nr_, bh = r / nr_;
        runs_[static_cast<std::size_t>(r)] = row_run(mask_.data + mask_.row_offset(bh / nh_, bh % nh_, q), nk);
      }
    });
  }

  const MaskRun& operator()(Index b, Index h, Index q) const noexcept {
    const Index r = ((mask_.stride[0] != 0 ? b : 0) * nh_ + (mask_.stride[1] != 0 ? h : 0)) * nr_ +
                    (mask_.stride[2] != 0 ? q : 0);
    return runs_[static_cast<std::size_t>(r)];
  }

 private:
  MaskRun row_run(const bool* m, Index nk) const noexcept {
    const Index stride = mask_.stride[3];
    MaskRun run;
    if (stride == 0) {
      run.hi = m[0] ? 0 : nk;
      return run;
    }
    if (stride == 1) {
      // memchr is the library's fastest byte scan; a bool is stored as 0 or 1.
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(m);
      const void* first = std::memchr(bytes, 0, static_cast<std::size_t>(nk));
      if (first == nullptr) return run;  // every key masked
      run.lo = static_cast<const unsigned char*>(first) - bytes;
      const void* next = std::memchr(bytes + run.lo, 1, static_cast<std::size_t>(nk - run.lo));
      run.hi = next == nullptr ? nk : static_cast<const unsigned char*>(next) - bytes;
      std::uint32_t rest = 0;  // masked keys after the first run: all of them when the row is solid
      for (Index j = run.hi; j < nk; ++j) rest += bytes[j];
      if (static_cast<Index>(rest) == nk - run.hi) return run;
    } else {
      while (run.lo < nk && m[run.lo * stride]) ++run.lo;
      if (run.lo == nk) return {};
      run.hi = run.lo;
      while (run.hi < nk && !m[run.hi * stride]) ++run.hi;
      Index j = run.hi;
      while (j < nk && m[j * stride]) ++j;
      if (j == nk) return run;
    }
    run.solid = false;
    run.hi = nk;
    while (m[(run.hi - 1) * stride]) --run.hi;
    return run;
  }

  BroadcastView<bool> mask_;
  Index nh_, nr_;
  std::vector<MaskRun> runs_;
};

// One worker's scratch and the per-(batch, head, query group) loop. The scratch is plain std::vector
// storage behind Eigen Maps, sized once per chunk of work; the tile loop allocates nothing.
template <typename Scalar>
class TiledWorker {
 public:
  using Index = Eigen::Index;
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ConstRows = Eigen::Map<const RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  using Rows = Eigen::Map<RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;

  TiledWorker(const AttentionProblem<Scalar>& p, const MaskRuns* runs, Index block_q, Index block_k, Index group)
      : p_(p),
        runs_(runs),
        bq_(block_q),
        bk_(block_k),
        // Score rows padded to a whole cache line so that each row the softmax reads starts on one.
        s_stride_((block_k + kLine - 1) / kLine * kLine),
        s_buf_(static_cast<std::size_t>(block_q * s_stride_ + kLine)),
        o_buf_(static_cast<std::size_t>(group * block_q * p.d_v + kLine)),
        q_buf_(static_cast<std::size_t>(group * block_q * p.d_k + kLine)),
        m_(static_cast<std::size_t>(group * block_q)),
        l_(static_cast<std::size_t>(group * block_q)),
        seen_(static_cast<std::size_t>(group * block_q)),
        state_(static_cast<std::size_t>(block_q)),
        first_(static_cast<std::size_t>(block_q)),
        last_(static_cast<std::size_t>(block_q)),
        bits_buf_(p.dropout ? static_cast<std::size_t>(block_k + 8) : 0) {
#if SDPA_TILED_PACKED_PRODUCTS
    // One cache-line-aligned slot per query block: the kernel's loads from packed operands are aligned.
    q_slot_ = (block_q * p.d_k + kLine - 1) / kLine * kLine;
    packed_q_.resize(static_cast<std::size_t>(group * q_slot_ + 2 * kLine));
    packed_k_.resize(static_cast<std::size_t>(block_k * p.d_k + 2 * kLine));
    packed_v_.resize(static_cast<std::size_t>(block_k * p.d_v + 2 * kLine));
    packed_p_.resize(static_cast<std::size_t>(block_k * block_q + 2 * kLine));
    q_packed_.resize(static_cast<std::size_t>(group));
#endif
  }

  // Attention output rows q0 .. q0 + rows - 1 of (batch b, head h), written to p.out; rows is at most
  // group * block_q. The query blocks of the group take turns on each key block, so that block's k and v
  // are read from memory once and from cache by the others.
  void run(Index b, Index h, Index q0, Index rows) {
    const AttentionProblem<Scalar>& p = p_;
    Rows o(aligned(o_buf_), rows, p.d_v, Eigen::OuterStride<>(p.d_v));
    o.setZero();
    std::fill(m_.begin(), m_.begin() + rows, -kInf);
    std::fill(l_.begin(), l_.begin() + rows, Scalar(0));
    // Without a mask every row sees every key; with one, tile() marks the rows that see any.
    std::fill(seen_.begin(), seen_.begin() + rows, static_cast<char>(!p.mask));
    v_checked_k0_ = -1;

    // Public products pack the q block again for every tile: a contiguous copy keeps it within a few
    // pages. (Packed products pack each q block once, from where it lies.)
    const Scalar* q_data = p.q.row(b, h, q0);
    Index q_stride = p.q.row_stride;
    if (!SDPA_TILED_PACKED_PRODUCTS && q_stride != p.d_k && rows > 1) {
      Scalar* q_copy = aligned(q_buf_);
      for (Index i = 0; i < rows; ++i) std::copy_n(p.q.row(b, h, q0 + i), p.d_k, q_copy + i * p.d_k);
      q_data = q_copy;
      q_stride = p.d_k;
    }
    const ConstRows q(q_data, rows, p.d_k, Eigen::OuterStride<>(q_stride));
#if SDPA_TILED_PACKED_PRODUCTS
    std::fill(q_packed_.begin(), q_packed_.end(), false);
    packed_k0_ = -1;
#endif

    for (Index k0 = 0; k0 < p.nk; k0 += bk_) {
      const Index cols = std::min(bk_, p.nk - k0);
      for (Index r0 = 0; r0 < rows; r0 += bq_) {
        const Index n = std::min(bq_, rows - r0);
        tile(b, h, q0, r0, n, k0, cols, q.middleRows(r0, n), o.middleRows(r0, n));
      }
    }

    // With p = 1 nothing reaches the output: every row that saw a key gets 0.
    const bool accumulate = !(p.dropout && p.keep_scale == Scalar(0));
    for (Index i = 0; i < rows; ++i) {
      Scalar* out = p.out.row(b, h, q0 + i);
      const std::size_t si = static_cast<std::size_t>(i);
      Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>> out_row(out, p.d_v);
      if (!seen_[si]) {
        // Every key masked: the reference's policy (its softmax over -inf gives NaN in the original).
        out_row.setConstant(p.masked_rows == MaskedRows::kNaN ? std::numeric_limits<Scalar>::quiet_NaN()
                                                              : Scalar(0));
      } else if (!accumulate) {
        out_row.setZero();
      } else {
        // Visible scores that were all -inf leave l = 0 and o = 0: 0 * (1 / 0) is NaN, as PyTorch's softmax.
        out_row = o.row(i).array() * (Scalar(1) / l_[si]);
      }
    }
  }

  const TileStats& stats() const noexcept { return stats_; }

 private:
  // One tile: queries q0 + r0 .. q0 + r0 + rows - 1 (rows of the group from r0) against keys k0 .. k0 +
  // cols - 1. q and o are those rows of the group's q and output accumulator.
  template <typename QRows, typename ORows>
  void tile(Index b, Index h, Index q0, Index r0, Index rows, Index k0, Index cols, const QRows& q, ORows o) {
    const AttentionProblem<Scalar>& p = p_;
    Index i0 = 0, i1 = rows, j0 = 0, j1 = cols;
    bool any_masked = false;
    if (p.mask && !classify_tile(b, h, q0 + r0, rows, k0, cols, i0, i1, j0, j1, any_masked)) {
      ++stats_.tiles_skipped;
      return;
    }
    ++stats_.tiles_computed;
    const Index ni = i1 - i0, nj = j1 - j0;
    Rows s(aligned(s_buf_), rows, bk_, Eigen::OuterStride<>(s_stride_));
    auto s_tile = s.block(i0, j0, ni, nj);
#if SDPA_TILED_PACKED_PRODUCTS
    const bool packed = ni == rows && nj == cols;  // a tile the mask trimmed takes the public product
#else
    constexpr bool packed = false;
#endif
    // The scale rides on the product as its alpha: dot * scale, as the reference rounds it.
    if (packed) {
      packed_scores(b, h, r0, rows, k0, cols, q, s.data());
    } else {
      gemm_nt(ni, nj, p.d_k, p.scale, q.data() + i0 * q.outerStride(), q.outerStride(), p.k.row(b, h, k0 + j0), p.k.row_stride,
              &s_tile(0, 0), s.outerStride());
    }

    const bool accumulate = !(p.dropout && p.keep_scale == Scalar(0));
    const Index bh = b * p.heads + h;
    for (Index i = i0; i < i1; ++i) {
      auto row = s.row(i).segment(j0, nj).array();
      const std::size_t ti = static_cast<std::size_t>(i), gi = static_cast<std::size_t>(r0 + i);
      if (any_masked && state_[ti] == kClosed) {
        row.setZero();  // this query sees none of these keys: the tile adds nothing to its row
        continue;
      }
      seen_[gi] = 1;
      const Index qi = q0 + r0 + i;
      if (p.weights) apply_weights(row, b, h, qi, k0 + j0);
      const bool mixed = any_masked && state_[ti] == kMixed;
      if (mixed) apply_mask(row, b, h, qi, k0 + j0, -kInf);
      // NaN propagates: a NaN score makes the row NaN, as in PyTorch (hidden keys' scores are -inf by now).
      const Scalar tile_max = row.template maxCoeff<Eigen::PropagateNaN>();
      if (tile_max == -kInf) {
        // Only when weights or scores are -inf themselves: keep the running state, add nothing.
        row.setZero();
        continue;
      }
      const Scalar m_old = m_[gi];
      const Scalar m_new = std::isnan(m_old) || !(tile_max > m_old || std::isnan(tile_max)) ? m_old : tile_max;
      Scalar tile_sum = ShiftedExp<Scalar>::run(&row(0), nj, m_new);
      // Masked keys must contribute exactly nothing, as in the reference.
      if (mixed && !ShiftedExp<Scalar>::kExpZeroesMasked) {
        apply_mask(row, b, h, qi, k0 + j0, Scalar(0));
        tile_sum = row.sum();
      }
      if (m_old == -kInf) {
        l_[gi] = tile_sum;  // first keys this row sees: its accumulator is still zero
      } else if (m_new != m_old) {
        // exp(m_old - m_new) with both finite: never the NaN of exp(-inf - -inf).
        const Scalar alpha = std::exp(m_old - m_new);
        l_[gi] = l_[gi] * alpha + tile_sum;
        o.row(i) *= alpha;
      } else {
        l_[gi] += tile_sum;
      }
      m_[gi] = m_new;
      // The sum above is over every probability, dropped or not (the reference normalises before it
      // drops); only the kept ones, scaled by 1 / (1 - p), reach the output.
      if (p.dropout && accumulate) apply_dropout(row, bh, qi, k0 + j0);
    }

    // A hidden key contributes nothing, not even a NaN or infinity in its value row; the products below
    // would give 0 * NaN for it, so a tile with hidden keys over non-finite values adds the visible ones
    // one by one (only inputs with NaN or inf come here).
    if (accumulate && any_masked && !values_finite(b, h, k0, cols)) {
      for (Index i = i0; i < i1; ++i) {
        const std::size_t ti = static_cast<std::size_t>(i);
        if (state_[ti] == kClosed) continue;
        const Index qi = q0 + r0 + i;
        const MaskRun& run = (*runs_)(b, h, qi);
        for (Index j = j0; j < j1; ++j) {
          const Index key = k0 + j;
          const bool hidden = run.solid ? key < run.lo || key >= run.hi : p.mask(b, h, qi, key);
          if (hidden) continue;
          const Scalar x = s(i, j);
          const Scalar* v = p.v.row(b, h, key);
          for (Index d = 0; d < p.d_v; ++d) o(i, d) += x * v[d];
        }
      }
      return;
    }

    if (accumulate && packed) {
      packed_accumulate(rows, cols, s.data(), o.data());
    } else if (accumulate) {
      gemm_nn_add(ni, p.d_v, nj, &s_tile(0, 0), s.outerStride(), p.v.row(b, h, k0 + j0), p.v.row_stride,
                  &o(i0, 0), o.outerStride());
    }
  }

#if SDPA_TILED_PACKED_PRODUCTS
  // The two products of an untrimmed tile on Eigen's block-panel kernel, as Eigen's own GEMM runs them
  // for a row-major result: s^T = k q^T and o^T += v^T p^T, column-major. k and v are packed once per key
  // block (the group's query blocks share them), q once per query block of the group.
  using Traits = Eigen::internal::gebp_traits<Scalar, Scalar>;
  using RowMapper = Eigen::internal::const_blas_data_mapper<Scalar, Index, Eigen::RowMajor>;
  using ColMapper = Eigen::internal::const_blas_data_mapper<Scalar, Index, Eigen::ColMajor>;
  using ResMapper = Eigen::internal::blas_data_mapper<Scalar, Index, Eigen::ColMajor, Eigen::Unaligned, 1>;
  using PackRowLhs = Eigen::internal::gemm_pack_lhs<Scalar, Index, RowMapper, Traits::mr, Traits::LhsProgress,
                                                     typename Traits::LhsPacket4Packing, Eigen::RowMajor>;
  using PackColLhs = Eigen::internal::gemm_pack_lhs<Scalar, Index, ColMapper, Traits::mr, Traits::LhsProgress,
                                                     typename Traits::LhsPacket4Packing, Eigen::ColMajor>;
  using PackRhs = Eigen::internal::gemm_pack_rhs<Scalar, Index, ColMapper, Traits::nr, Eigen::ColMajor>;
  using Kernel = Eigen::internal::gebp_kernel<Scalar, Scalar, Index, ResMapper, Traits::mr, Traits::nr>;

  // s (rows x cols, row stride s_stride_) = scale * q k^T for the group's rows r0 ... and keys k0 ...
  template <typename QRows>
  void packed_scores(Index b, Index h, Index r0, Index rows, Index k0, Index cols, const QRows& q, Scalar* s) {
    const AttentionProblem<Scalar>& p = p_;
    if (packed_k0_ != k0) {
      PackRowLhs()(aligned(packed_k_), RowMapper(p.k.row(b, h, k0), p.k.row_stride), p.d_k, cols);
      PackColLhs()(aligned(packed_v_), ColMapper(p.v.row(b, h, k0), p.v.row_stride), cols, p.d_v);
      packed_k0_ = k0;
    }
    const std::size_t qb = static_cast<std::size_t>(r0 / bq_);
    Scalar* packed_q = aligned(packed_q_) + static_cast<Index>(qb) * q_slot_;
    if (!q_packed_[qb]) {
      PackRhs()(packed_q, ColMapper(q.data(), q.outerStride()), p.d_k, rows);
      q_packed_[qb] = true;
    }
    // The kernel accumulates into its result.
    for (Index i = 0; i < rows; ++i) std::fill_n(s + i * s_stride_, cols, Scalar(0));
    Kernel()(ResMapper(s, s_stride_), aligned(packed_k_), packed_q, cols, p.d_k, rows, p.scale);
  }

  // o (rows x d_v, contiguous) += p v for the tile's probabilities p = s (rows x cols) and the packed v.
  void packed_accumulate(Index rows, Index cols, const Scalar* s, Scalar* o) {
    PackRhs()(aligned(packed_p_), ColMapper(s, s_stride_), cols, rows);
    Kernel()(ResMapper(o, p_.d_v), aligned(packed_v_), aligned(packed_p_), p_.d_v, cols, rows, Scalar(1));
  }
#else
  template <typename QRows>
  void packed_scores(Index, Index, Index, Index, Index, Index, const QRows&, Scalar*) {}
  void packed_accumulate(Index, Index, const Scalar*, Scalar*) {}
#endif

  // Whether v rows k0 .. k0 + cols - 1 of (b, h) are all finite; checked once per key block of a group.
  bool values_finite(Index b, Index h, Index k0, Index cols) {
    if (v_checked_k0_ != k0) {
      v_checked_k0_ = k0;
      v_finite_ = true;
      for (Index j = 0; j < cols && v_finite_; ++j)
        v_finite_ = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>(p_.v.row(b, h, k0 + j), p_.d_v).allFinite();
    }
    return v_finite_;
  }

  static constexpr Scalar kInf = std::numeric_limits<Scalar>::infinity();
  static constexpr Index kLine = 64 / static_cast<Index>(sizeof(Scalar));
  // Per-row masking state within one tile.
  static constexpr std::uint8_t kOpen = 0, kMixed = 1, kClosed = 2;

  static Scalar* aligned(std::vector<Scalar>& buf) noexcept {
    const auto addr = reinterpret_cast<std::uintptr_t>(buf.data());
    return buf.data() + ((64 - addr % 64) % 64) / sizeof(Scalar);
  }

  // Fills state_/first_/last_ for the rows of the tile and narrows it to the rows [i0, i1) and keys
  // [j0, j1) that hold an unmasked score. Returns false when every score of the tile is masked.
  bool classify_tile(Index b, Index h, Index q0, Index rows, Index k0, Index cols, Index& i0, Index& i1, Index& j0,
                     Index& j1, bool& any_masked) {
    // A mask broadcast over queries has one row for the whole tile: classify it once.
    const Index distinct = p_.mask.stride[2] == 0 ? 1 : rows;
    for (Index i = 0; i < distinct; ++i) classify_row(i, b, h, q0 + i, k0, cols);
    for (Index i = distinct; i < rows; ++i) {
      state_[static_cast<std::size_t>(i)] = state_[0];
      first_[static_cast<std::size_t>(i)] = first_[0];
      last_[static_cast<std::size_t>(i)] = last_[0];
    }
    i0 = rows;
    i1 = 0;
    j0 = cols;
    j1 = 0;
    any_masked = false;
    for (Index i = 0; i < rows; ++i) {
      const std::size_t si = static_cast<std::size_t>(i);
      if (state_[si] != kOpen) any_masked = true;
      if (state_[si] == kClosed) continue;
      i0 = std::min(i0, i);
      i1 = i + 1;
      j0 = std::min(j0, first_[si]);
      j1 = std::max(j1, last_[si] + 1);
    }
    return i1 > i0;
  }

  // State of tile row i (query q, keys k0 .. k0 + cols - 1), and its first and last unmasked key in the
  // tile unless closed. The row's run answers without the mask unless the row has several runs.
  void classify_row(Index i, Index b, Index h, Index q, Index k0, Index cols) {
    const std::size_t si = static_cast<std::size_t>(i);
    const MaskRun& run = (*runs_)(b, h, q);
    const Index lo = std::max(run.lo, k0) - k0, hi = std::min(run.hi, k0 + cols) - k0;
    if (lo >= hi) {
      state_[si] = kClosed;
      return;
    }
    if (run.solid) {
      state_[si] = lo == 0 && hi == cols ? kOpen : kMixed;
      first_[si] = lo;
      last_[si] = hi - 1;
      return;
    }
    // Several runs: count the masked keys of [lo, hi), a byte sum the compiler vectorises.
    const Index stride = p_.mask.stride[3];
    const bool* m = p_.mask.data + p_.mask.row_offset(b, h, q) + k0 * stride;
    Index masked = 0;
    if (stride == 1) {
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(m);
      std::uint32_t sum = 0;
      for (Index j = lo; j < hi; ++j) sum += bytes[j];
      masked = static_cast<Index>(sum);
    } else {
      for (Index j = lo; j < hi; ++j) masked += m[j * stride] ? 1 : 0;
    }
    if (masked == hi - lo) {
      state_[si] = kClosed;
      return;
    }
    Index f = lo, l = hi - 1;
    while (m[f * stride]) ++f;
    while (m[l * stride]) --l;
    state_[si] = masked == 0 && lo == 0 && hi == cols ? kOpen : kMixed;
    first_[si] = f;
    last_[si] = l;
  }

  template <typename Row>
  void apply_weights(Row& row, Index b, Index h, Index q, Index k0) const {
    const BroadcastView<Scalar>& w = p_.weights;
    const Scalar* data = w.data + w.row_offset(b, h, q) + k0 * w.stride[3];
    const Index n = row.size();
    if (w.stride[3] == 1) {
      row *= Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>(data, n);
    } else if (w.stride[3] == 0) {
      row *= data[0];
    } else {
      for (Index j = 0; j < n; ++j) row(j) *= data[j * w.stride[3]];
    }
  }

  // Sets the masked entries of a score row (keys k0 ...) to `value`.
  template <typename Row>
  void apply_mask(Row& row, Index b, Index h, Index q, Index k0, Scalar value) const {
    const Index n = row.size();
    Scalar* x = &row(0);
    const MaskRun& run = (*runs_)(b, h, q);
    if (run.solid) {
      // Masked are the keys before lo and from hi on.
      const Index lo = std::clamp<Index>(run.lo - k0, 0, n), hi = std::clamp<Index>(run.hi - k0, lo, n);
      std::fill(x, x + lo, value);
      std::fill(x + hi, x + n, value);
      return;
    }
    const BroadcastView<bool>& mask = p_.mask;
    const bool* m = mask.data + mask.row_offset(b, h, q) + k0 * mask.stride[3];
    const Index stride = mask.stride[3];
    if (stride == 1) {
      // A contiguous mask row: a loop the compiler turns into masked vector stores.
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(m);
      for (Index j = 0; j < n; ++j) x[j] = bytes[j] != 0 ? value : x[j];
    } else {
      for (Index j = 0; j < n; ++j) x[j] = m[j * stride] ? value : x[j];
    }
  }

  // Dropout on one row of unnormalised probabilities for keys k0 ...: dropped -> 0, kept -> x * keep_scale.
  // The row's random words come from one DropoutSampler::fill_bits call (vectorised Philox).
  template <typename Row>
  void apply_dropout(Row& row, Index bh, Index q, Index k0) {
    const DropoutSampler& sampler = p_.sampler;
    const Scalar keep = p_.keep_scale;
    Scalar* x = &row(0);  // x[k - k0] is key k
    const Index n = row.size();
    const Index k4_begin = k0 >> 2, blocks = ((k0 + n + 3) >> 2) - k4_begin;
    sampler.fill_bits(bh, q, k4_begin, blocks, bits_buf_.data());
    const std::uint32_t* bits = bits_buf_.data() + (k0 - 4 * k4_begin);
    for (Index j = 0; j < n; ++j) x[j] = sampler.dropped_bits(bits[j]) ? Scalar(0) : x[j] * keep;
  }

  const AttentionProblem<Scalar>& p_;
  const MaskRuns* runs_;  // set when p has a mask
  const Index bq_, bk_, s_stride_;
  std::vector<Scalar> s_buf_, o_buf_;
  std::vector<Scalar> q_buf_;
#if SDPA_TILED_PACKED_PRODUCTS
  // Eigen's packed operands: the group's q blocks (which are packed so far), the key block's k and v
  // (which key block: packed_k0_), and the tile's probabilities.
  std::vector<Scalar> packed_q_, packed_k_, packed_v_, packed_p_;
  std::vector<bool> q_packed_;
  Index q_slot_ = 0;
  Index packed_k0_ = -1;
#endif
  std::vector<Scalar> m_, l_;
  std::vector<char> seen_;  // whether row i of the group has seen any unmasked key
  Index v_checked_k0_ = -1;
  bool v_finite_ = true;
  std::vector<std::uint8_t> state_;
  std::vector<Index> first_, last_;
  std::vector<std::uint32_t> bits_buf_;  // one row's dropout words (block_k + 8), sized once per worker
  TileStats stats_;
};

}  // namespace detail

// The attention core of p, tiled (see the header comment). Zero fields of `config` are derived from the
// caches (TileConfig::for_problem); `stats`, when given, receives the tile counts.
template <typename Scalar>
void tiled_attention(const AttentionProblem<Scalar>& p, const Eigen::ThreadPoolDevice* device = nullptr,
                     TileConfig config = TileConfig{}, TileStats* stats = nullptr) {
  using Index = Eigen::Index;
  if (stats != nullptr) *stats = TileStats{};
  if (p.batch <= 0 || p.heads <= 0 || p.nq <= 0) return;
  if (p.nk == 0) {
    // An empty softmax: the product with an empty v is zero, under either masked-row policy.
    for (Index b = 0; b < p.batch; ++b)
      for (Index h = 0; h < p.heads; ++h)
        for (Index i = 0; i < p.nq; ++i) std::fill(p.out.row(b, h, i), p.out.row(b, h, i) + p.d_v, Scalar(0));
    return;
  }
  const TileConfig derived = TileConfig::for_problem<Scalar>(p.d_k, p.d_v);
  const Index block_q = std::min(p.nq, config.block_q > 0 ? config.block_q : derived.block_q);
  const Index block_k = std::min(p.nk, config.block_k > 0 ? config.block_k : derived.block_k);
  const Index q_blocks = (p.nq + block_q - 1) / block_q;
  const Index heads = p.batch * p.heads;
  Index group = std::min(q_blocks, config.group > 0 ? config.group : derived.group);
  // Smaller groups when there would be too few of them to keep every worker busy.
  const Index workers = static_cast<Index>(worker_count(device));
  const Index wanted = workers == 1 ? 1 : 4 * workers;
  while (group > 1 && heads * ((q_blocks + group - 1) / group) < wanted) group = (group + 1) / 2;
  const Index span = group * block_q;  // queries per unit of work
  const Index groups = (p.nq + span - 1) / span;
  const Index units = heads * groups;
  // Several chunks per worker: under a causal mask the query groups differ in cost, and the shared
  // counter in parallel_for evens that out.
  const Index grain = balanced_grain(device, units, 4);
  std::atomic<Index> computed{0}, skipped{0};
  std::unique_ptr<detail::MaskRuns> runs;
  if (p.mask) runs = std::make_unique<detail::MaskRuns>(p.mask, p.batch, p.heads, p.nq, p.nk, device);
  parallel_for(device, units, grain, [&](Index u0, Index u1) {
    detail::TiledWorker<Scalar> worker(p, runs.get(), block_q, block_k, group);
    for (Index u = u0; u < u1; ++u) {
      const Index bh = u / groups, g = u % groups;
      const Index q0 = g * span;
      worker.run(bh / p.heads, bh % p.heads, q0, std::min(span, p.nq - q0));
    }
    computed.fetch_add(worker.stats().tiles_computed, std::memory_order_relaxed);
    skipped.fetch_add(worker.stats().tiles_skipped, std::memory_order_relaxed);
  });
  if (stats != nullptr) {
    stats->tiles_computed = computed.load();
    stats->tiles_skipped = skipped.load();
  }
}

}  // namespace kernels
}  // namespace sdpa
