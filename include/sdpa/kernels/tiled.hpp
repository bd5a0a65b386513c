// The tiled attention core (FlashAttention's online softmax on the CPU): per (batch, head, block of queries)
// it walks blocks of keys, forms one tile of scores with an Eigen matrix product on the strided q/k rows,
// folds the tile into a running row max, row sum and output accumulator, and adds the tile's probabilities
// times v with a second product; the output is divided by the sum at the end. Memory is one tile of scores
// per worker whatever the sequence lengths. Tiles whose every score is masked are skipped without a product,
// so a causal mask halves the work. Dropout is fused and asks the shared DropoutSampler for every element,
// so it drops exactly what reference_attention drops. TileConfig holds the block sizes, derived from the
// cache sizes unless a caller (a test) forces them.
#pragma once

#define EIGEN_USE_THREADS
#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "sdpa/kernels/problem.hpp"
#include "sdpa/parallel.hpp"

namespace sdpa {
namespace kernels {

// Block sizes of the tiled kernel: block_q queries share each pass over the keys, block_k keys make one
// tile. A zero field means "derive it from the caches" (for_problem), so TileConfig{} is the default and a
// test can force tiny blocks with TileConfig{4, 8}.
struct TileConfig {
  Eigen::Index block_q = 0;
  Eigen::Index block_k = 0;

  // The rule, for `scalar_bytes`-wide elements and the given per-core cache sizes in bytes. The score tile
  // (block_q x block_k) is written by one product and read by the softmax and the next product, so it
  // should stay in L2 together with the blocks the products pack: budget half of L2 for the tile, the
  // q block, the k and v blocks and the output accumulator. Within that, block_k is as long as keeps one
  // k block plus one v block within L1 (Eigen packs them for the products and the softmax streams score
  // rows of that length), and block_q as large as the L2 budget allows; both are powers of two, block_q in
  // [16, 256] and block_k in [32, 512], where measurements put Eigen's products near their best speed.
  static TileConfig for_caches(Eigen::Index scalar_bytes, Eigen::Index d_k, Eigen::Index d_v, Eigen::Index l1_bytes,
                               Eigen::Index l2_bytes) noexcept {
    scalar_bytes = std::max<Eigen::Index>(1, scalar_bytes);
    d_k = std::max<Eigen::Index>(1, d_k);
    d_v = std::max<Eigen::Index>(1, d_v);
    l1_bytes = std::max<Eigen::Index>(l1_bytes, 16 * 1024);
    l2_bytes = std::max<Eigen::Index>(l2_bytes, 4 * l1_bytes);
    const auto floor_pow2 = [](Eigen::Index x) {
      Eigen::Index p = 1;
      while (2 * p <= x) p *= 2;
      return p;
    };
    TileConfig c;
    c.block_k = std::clamp<Eigen::Index>(floor_pow2(2 * l1_bytes / (scalar_bytes * (d_k + d_v))), 32, 512);
    const Eigen::Index budget = l2_bytes / 2 / scalar_bytes - c.block_k * (d_k + d_v);
    c.block_q = std::clamp<Eigen::Index>(floor_pow2(std::max<Eigen::Index>(1, budget / (c.block_k + d_k + d_v))),
                                         16, 256);
    return c;
  }

  template <typename Scalar>
  static TileConfig for_problem(Eigen::Index d_k, Eigen::Index d_v) noexcept {
    return for_caches(static_cast<Eigen::Index>(sizeof(Scalar)), d_k, d_v,
                      static_cast<Eigen::Index>(Eigen::l1CacheSize()), static_cast<Eigen::Index>(Eigen::l2CacheSize()));
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
struct ShiftedExp {
  static constexpr bool kExpZeroesMasked = false;
  static Scalar run(Scalar* x, Eigen::Index n, Scalar shift) noexcept {
    Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> a(x, n);
    a = (a - shift).exp();
    return a.sum();
  }
};

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
    lanes = _mm512_mask_cmp_ps_mask(lanes, t, _mm512_set1_ps(-87.33f), _CMP_NLT_UQ);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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

// One worker's scratch and the per-(batch, head, query block) loop. The scratch is plain std::vector
// storage behind Eigen Maps, sized once per chunk of work; the tile loop allocates nothing.
template <typename Scalar>
class TiledWorker {
 public:
  using Index = Eigen::Index;
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ConstRows = Eigen::Map<const RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  using Rows = Eigen::Map<RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  using ColMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
  using ConstCols = Eigen::Map<const ColMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  using Cols = Eigen::Map<ColMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  using RowArray = Eigen::Array<Scalar, 1, Eigen::Dynamic>;

  TiledWorker(const AttentionProblem<Scalar>& p, Index block_q, Index block_k)
      : p_(p),
        bq_(block_q),
        bk_(block_k),
        // Score rows padded to a whole cache line so that each row the softmax reads starts on one.
        s_stride_((block_k + kLine - 1) / kLine * kLine),
        s_buf_(static_cast<std::size_t>(block_q * s_stride_ + kLine)),
        o_buf_(static_cast<std::size_t>(block_q * p.d_v + kLine)),
        q_buf_(static_cast<std::size_t>(block_q * p.d_k + kLine)),
        m_(static_cast<std::size_t>(block_q)),
        l_(static_cast<std::size_t>(block_q)),
        state_(static_cast<std::size_t>(block_q)),
        first_(static_cast<std::size_t>(block_q)),
        last_(static_cast<std::size_t>(block_q)) {}

  // Copies the k and v rows of (b, h) into contiguous storage that run() then reads instead of p.k/p.v:
  // k as one column-major (block_k x d_k) panel per key block, v row-major. Rows of one head lie
  // row_stride apart (heads * d_k or more), so reading them in place touches a few cache lines per key in
  // pages far apart, and the score product's packing must transpose row-major k; it pays that on every
  // tile, while a worker that serves several query blocks of the head pays for one copy instead.
  void stage(Index b, Index h) {
    const AttentionProblem<Scalar>& p = p_;
    const Index k_blocks = (p.nk + bk_ - 1) / bk_;
    const Index k_size = (k_blocks * bk_ * p.d_k + kLine - 1) / kLine * kLine;
    kv_buf_.resize(static_cast<std::size_t>(k_size + p.nk * p.d_v + kLine));
    Scalar* k = aligned(kv_buf_);
    Scalar* v = k + k_size;
    for (Index kb = 0; kb < k_blocks; ++kb) {
      const Index k0 = kb * bk_, cols = std::min(bk_, p.nk - k0);
      Cols(k + kb * bk_ * p.d_k, cols, p.d_k, Eigen::OuterStride<>(bk_)) =
          ConstRows(p.k.row(b, h, k0), cols, p.d_k, Eigen::OuterStride<>(p.k.row_stride));
    }
    for (Index j = 0; j < p.nk; ++j) std::copy_n(p.v.row(b, h, j), p.d_v, v + j * p.d_v);
    staged_k_ = k;
    staged_v_ = v;
    staged_bh_ = b * p.heads + h;
  }

  // Attention output rows q0 .. q0 + rows - 1 of (batch b, head h), written to p.out.
  void run(Index b, Index h, Index q0, Index rows) {
    const AttentionProblem<Scalar>& p = p_;
    const Index bh = b * p.heads + h;
    const bool staged = staged_bh_ == bh;
    const Scalar* v_base = staged ? staged_v_ : p.v.row(b, h, 0);
    const Index v_stride = staged ? p.d_v : p.v.row_stride;
    Scalar* s_data = aligned(s_buf_);
    Scalar* o_data = aligned(o_buf_);
    Rows s(s_data, rows, bk_, Eigen::OuterStride<>(s_stride_));
    Rows o(o_data, rows, p.d_v, Eigen::OuterStride<>(p.d_v));
    o.setZero();
    std::fill(m_.begin(), m_.begin() + rows, -kInf);
    std::fill(l_.begin(), l_.begin() + rows, Scalar(0));

    // The q block is packed again for every tile: a contiguous copy keeps it within a few pages.
    const Scalar* q_data = p.q.row(b, h, q0);
    Index q_stride = p.q.row_stride;
    if (q_stride != p.d_k && rows > 1) {
      Scalar* q_copy = aligned(q_buf_);
      for (Index i = 0; i < rows; ++i) std::copy_n(p.q.row(b, h, q0 + i), p.d_k, q_copy + i * p.d_k);
      q_data = q_copy;
      q_stride = p.d_k;
    }
    const ConstRows q(q_data, rows, p.d_k, Eigen::OuterStride<>(q_stride));
    // With p = 1 every probability is dropped: the scores still decide which rows are fully masked, but
    // nothing reaches the output, so the second product is pointless.
    const bool accumulate = !(p.dropout && p.keep_scale == Scalar(0));

    for (Index k0 = 0; k0 < p.nk; k0 += bk_) {
      const Index cols = std::min(bk_, p.nk - k0);
      Index i0 = 0, i1 = rows, j0 = 0, j1 = cols;
      bool any_masked = false;
      if (p.mask) {
        if (!classify_tile(b, h, q0, rows, k0, cols, i0, i1, j0, j1, any_masked)) {
          ++stats_.tiles_skipped;
          continue;
        }
      }
      ++stats_.tiles_computed;
      const Index ni = i1 - i0, nj = j1 - j0;
      auto s_tile = s.block(i0, j0, ni, nj);
      // The scale rides on the product as its alpha: dot * scale, as the reference rounds it.
      if (staged) {
        const ConstCols k(staged_k_ + k0 * p.d_k + j0, nj, p.d_k, Eigen::OuterStride<>(bk_));
        s_tile.noalias() = (p.scale * q.middleRows(i0, ni)) * k.transpose();
      } else {
        const ConstRows k(p.k.row(b, h, k0 + j0), nj, p.d_k, Eigen::OuterStride<>(p.k.row_stride));
        s_tile.noalias() = (p.scale * q.middleRows(i0, ni)) * k.transpose();
      }

      for (Index i = i0; i < i1; ++i) {
        auto row = s.row(i).segment(j0, nj).array();
        const std::size_t si = static_cast<std::size_t>(i);
        if (any_masked && state_[si] == kClosed) {
          row.setZero();  // this query sees none of these keys: the tile adds nothing to its row
          continue;
        }
        if (p.weights) apply_weights(row, b, h, q0 + i, k0 + j0);
        const bool mixed = any_masked && state_[si] == kMixed;
        if (mixed) apply_mask(row, b, h, q0 + i, k0 + j0, -kInf);
        const Scalar tile_max = row.maxCoeff();
        if (tile_max == -kInf) {
          // Only when weights or scores are -inf themselves: keep the running state, add nothing.
          row.setZero();
          continue;
        }
        const Scalar m_old = m_[si];
        const Scalar m_new = std::max(m_old, tile_max);
        Scalar tile_sum = ShiftedExp<Scalar>::run(&row(0), nj, m_new);
        // Masked keys must contribute exactly nothing, as in the reference.
        if (mixed && !ShiftedExp<Scalar>::kExpZeroesMasked) {
          apply_mask(row, b, h, q0 + i, k0 + j0, Scalar(0));
          tile_sum = row.sum();
        }
        if (m_old == -kInf) {
          l_[si] = tile_sum;  // first keys this row sees: the accumulator is still zero
        } else if (m_new != m_old) {
          const Scalar alpha = std::exp(m_old - m_new);
          l_[si] = l_[si] * alpha + tile_sum;
          o.row(i) *= alpha;
        } else {
          l_[si] += tile_sum;
        }
        m_[si] = m_new;
        // The sum above is over every probability, dropped or not (the reference normalises before it
        // drops); only the kept ones, scaled by 1 / (1 - p), reach the output.
        if (p.dropout && accumulate) apply_dropout(row, bh, q0 + i, k0 + j0);
      }

      if (accumulate) {
        const ConstRows v(v_base + (k0 + j0) * v_stride, nj, p.d_v, Eigen::OuterStride<>(v_stride));
        o.middleRows(i0, ni).noalias() += s_tile * v;
      }
    }

    for (Index i = 0; i < rows; ++i) {
      Scalar* out = p.out.row(b, h, q0 + i);
      const std::size_t si = static_cast<std::size_t>(i);
      Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>> out_row(out, p.d_v);
      if (m_[si] == -kInf) {
        // Every key masked: the reference's policy (its softmax over -inf gives NaN in the original).
        out_row.setConstant(p.masked_rows == MaskedRows::kNaN ? std::numeric_limits<Scalar>::quiet_NaN()
                                                              : Scalar(0));
      } else if (!accumulate) {
        out_row.setZero();
      } else {
        out_row = o.row(i).array() * (Scalar(1) / l_[si]);
      }
    }
  }

  const TileStats& stats() const noexcept { return stats_; }

 private:
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
    const BroadcastView<bool>& mask = p_.mask;
    // A mask broadcast over queries has one row for the whole tile: classify it once.
    const Index distinct = mask.stride[2] == 0 ? 1 : rows;
    for (Index i = 0; i < distinct; ++i) classify_row(i, mask.row_offset(b, h, q0 + i) + k0 * mask.stride[3], cols);
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

  void classify_row(Index i, Index offset, Index cols) {
    const std::size_t si = static_cast<std::size_t>(i);
    const Index stride = p_.mask.stride[3];
    const bool* m = p_.mask.data + offset;
    if (stride == 0) {
      state_[si] = m[0] ? kClosed : kOpen;
      first_[si] = 0;
      last_[si] = cols - 1;
      return;
    }
    // Count the masked keys first: a byte sum the compiler vectorises, and most rows are all or nothing.
    Index masked = 0;
    if (stride == 1) {
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(m);
      unsigned int chunk = 0;
      for (Index j = 0; j < cols; ++j) {
        chunk += bytes[j] != 0;
        if ((j & 127) == 127) {
          masked += chunk;
          chunk = 0;
        }
      }
      masked += chunk;
    } else {
      for (Index j = 0; j < cols; ++j) masked += m[j * stride] ? 1 : 0;
    }
    if (masked == 0) {
      state_[si] = kOpen;
      first_[si] = 0;
      last_[si] = cols - 1;
    } else if (masked == cols) {
      state_[si] = kClosed;
    } else {
      state_[si] = kMixed;
      Index f = 0, l = cols - 1;
      while (m[f * stride]) ++f;
      while (m[l * stride]) --l;
      first_[si] = f;
      last_[si] = l;
    }
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
    const BroadcastView<bool>& mask = p_.mask;
    const bool* m = mask.data + mask.row_offset(b, h, q) + k0 * mask.stride[3];
    const Index stride = mask.stride[3];
    const Index n = row.size();
    Scalar* x = &row(0);
    if (stride == 1) {
      // A contiguous mask row: a loop the compiler turns into masked vector stores.
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(m);
      for (Index j = 0; j < n; ++j) x[j] = bytes[j] != 0 ? value : x[j];
    } else {
      for (Index j = 0; j < n; ++j) x[j] = m[j * stride] ? value : x[j];
    }
  }

  // Dropout on one row of unnormalised probabilities for keys k0 ...: dropped -> 0, kept -> x * keep_scale.
  // One Philox call gives the decisions of four keys (4 * k4 .. 4 * k4 + 3); groups whose probabilities are
  // all zero (masked keys) need no decision.
  template <typename Row>
  void apply_dropout(Row& row, Index bh, Index q, Index k0) const {
    const DropoutSampler& sampler = p_.sampler;
    const Scalar keep = p_.keep_scale;
    const Index n = row.size();
    Scalar* x = &row(0) - k0;  // indexed by the global key
    const Index end = k0 + n;
    for (Index k4 = k0 >> 2; 4 * k4 < end; ++k4) {
      const Index lo = std::max(k0, 4 * k4), hi = std::min(end, 4 * k4 + 4);
      bool any = false;
      for (Index k = lo; k < hi; ++k) any |= x[k] != Scalar(0);
      if (!any) continue;
      const PhiloxCounter bits = sampler.block(bh, q, k4);
      for (Index k = lo; k < hi; ++k)
        x[k] = sampler.dropped_bits(bits[static_cast<std::size_t>(k & 3)]) ? Scalar(0) : x[k] * keep;
    }
  }

  const AttentionProblem<Scalar>& p_;
  const Index bq_, bk_, s_stride_;
  std::vector<Scalar> s_buf_, o_buf_;
  std::vector<Scalar> q_buf_, kv_buf_;
  const Scalar* staged_k_ = nullptr;
  const Scalar* staged_v_ = nullptr;
  Index staged_bh_ = -1;
  std::vector<Scalar> m_, l_;
  std::vector<std::uint8_t> state_;
  std::vector<Index> first_, last_;
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
  const Index units = p.batch * p.heads * q_blocks;
  // A few chunks per worker: under a causal mask the query blocks differ in cost, and the shared counter
  // in parallel_for evens that out; more chunks would stage each head's k and v more often.
  const Index grain = balanced_grain(device, units, 4);
  std::atomic<Index> computed{0}, skipped{0};
  parallel_for(device, units, grain, [&](Index u0, Index u1) {
    detail::TiledWorker<Scalar> worker(p, block_q, block_k);
    for (Index u = u0; u < u1; ++u) {
      const Index bh = u / q_blocks, qb = u % q_blocks;
      const Index q0 = qb * block_q;
      // Stage the head's k and v when this chunk reads them more than once.
      if (qb == 0 || u == u0) {
        const Index uses = std::min(u1, (bh + 1) * q_blocks) - u;
        if (uses > 1) worker.stage(bh / p.heads, bh % p.heads);
      }
      worker.run(bh / p.heads, bh % p.heads, q0, std::min(block_q, p.nq - q0));
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
