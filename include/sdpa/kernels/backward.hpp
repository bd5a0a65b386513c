// The attention core's backward pass (FlashAttention 2's, Dao 2023, on the CPU): from dL/dO, the forward's
// output O and each row's log-sum-exp it gives dL/dq, dL/dk, dL/dv and the gradients of the score weights
// and bias. tiled_backward revisits the forward's tiles with the same TileScorer and score pipeline
// (tiled.hpp, scores.hpp), so its scores are the forward's bit for bit; it recomputes each tile's
// probabilities as exp(s - lse), replays dropout from the problem's sampler and runs the tile's products
// as GEMMs, storing nothing of size nq x nk. reference_backward is the plain oracle: whole rows, one element
// at a time, straight from the definitions. Both follow PyTorch's autograd of the original module, where
// a row's softmax is NaN (every key hidden under MaskedRows::kNaN, or a NaN or infinite score): its
// probabilities are NaN over all keys, so every dv row of its (batch, head) is NaN, while the masked_fill
// zeroes the hidden scores' gradient, so dq and dk get nothing through hidden keys.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include "sdpa/detail/buffer.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "sdpa/flex/dual.hpp"
#include "sdpa/kernels/bf16_products.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/program.hpp"
#include "sdpa/kernels/projection.hpp"
#include "sdpa/kernels/reference.hpp"
#include "sdpa/kernels/scores.hpp"
#include "sdpa/kernels/softmax.hpp"
#include "sdpa/kernels/tile_config.hpp"
#include "sdpa/kernels/tiled.hpp"
#include "sdpa/kernels/visibility.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

template <typename Scalar>
struct BackwardProblem {
  // As the forward ran it: forward->out holds O (the attention output before fc_o) and forward->lse the
  // rows' log-sum-exp, which the backward requires.
  const AttentionProblem<Scalar>* forward = nullptr;
  Heads<const Scalar> d_out;  // dL/dO, the layout of forward->out: (batch, nq, heads * d_v)
  // Written, not accumulated: the layouts of forward->q, k and v, each with its own strides (d_k and d_v per
  // key/value head: the query heads of a group add their terms in head order).
  Heads<Scalar> d_q, d_k, d_v;
  // When forward->weights (bias) is set and this is not null: dense, row-major, the shape of the weights
  // (bias) tensor, its broadcast dimensions summed over; written.
  Scalar* d_weights = nullptr;
  Scalar* d_bias = nullptr;
  std::array<Eigen::Index, 4> weights_dims{}, bias_dims{};  // each dimension 1 or full
  // When forward->sinks is set and this is not null: one per query head, written. d L / d sink_h =
  // -sum over (b, q) of p_sink(b, h, q) * D(b, h, q), p_sink = exp(sink_h - lse), D = dO . O.
  Scalar* d_sinks = nullptr;
  // When the score program's function reads ScoreTables and this is not null: their gradients, written one
  // after the other in the program's table order (kernels/program.hpp).
  Scalar* d_tables = nullptr;
};

// What a backward under a score program could not do: the score function read a ScoreTable the program
// does not list, or more tables per score than flex::Dual has tangents (their gradients are incomplete).
struct BackwardStatus {
  bool unlisted_table = false;
  bool too_many_reads = false;
};

namespace detail {

// c[m, n] += a[k, m]^T * b[k, n] (s = {m, n, k}): the tile products that read a tile transposed (P^T dO,
// dS^T q). Eigen packs the transposed operand as it reads it, where a transposed copy followed by
// gemm_nn_add would add a pass over the tile.
template <typename Scalar>
void gemm_tn_add(gemm::Shape s, gemm::Matrix<const Scalar> a, gemm::Matrix<const Scalar> b, gemm::Matrix<Scalar> c) {
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Stride = Eigen::OuterStride<>;
  const Eigen::Map<const RowMatrix, Eigen::Unaligned, Stride> as(a.data, s.k, s.m, Stride(a.ld)),
      bs(b.data, s.k, s.n, Stride(b.ld));
  Eigen::Map<RowMatrix, Eigen::Unaligned, Stride> cs(c.data, s.m, s.n, Stride(c.ld));
  cs.noalias() += as.transpose() * bs;
}

// A dense gradient of a broadcast tensor, addressed with full (b, h, q, k) coordinates: stride 0 along the
// tensor's broadcast dimensions, so that adding to it sums over them.
template <typename Scalar>
struct DenseGradient {
  Scalar* data = nullptr;
  std::array<Eigen::Index, 4> stride{};
  Eigen::Index size = 0;

  DenseGradient() = default;
  DenseGradient(Scalar* d, const std::array<Eigen::Index, 4>& dims) : data(d) {
    Eigen::Index dense = 1;
    for (std::size_t i = 4; i-- > 0;) {
      stride[i] = dims[i] == 1 ? 0 : dense;
      dense *= dims[i];
    }
    size = dense;
  }
  explicit operator bool() const noexcept { return data != nullptr; }
  Scalar* row(Eigen::Index b, Eigen::Index h, Eigen::Index q) const noexcept {
    return data + b * stride[0] + h * stride[1] + q * stride[2];
  }
  void zero() const { std::fill_n(data, size, Scalar(0)); }
};

template <typename Scalar>
DenseGradient<Scalar> dense_gradient(Scalar* data, const BroadcastView<Scalar>& of,
                                     const std::array<Eigen::Index, 4>& dims) {
  if (data == nullptr || !of) return {};
  return DenseGradient<Scalar>(data, dims);
}

// The (batch, head) pairs of the backward, in units of work: a unit is the query heads of one key/value head
// (they add to the same dk and dv rows) of one batch entry, or every pair that adds to the same slice of a
// broadcast weights or bias gradient (all batch entries when one broadcasts over the batch, all heads when
// one broadcasts over the heads). One worker runs a unit's pairs in a fixed order (batch, then head), so
// every gradient element receives its terms in the same order whatever the threads.
struct BackwardUnits {
  Eigen::Index batch = 0, heads = 0, head_group = 1;  // head_group: query heads per unit
  bool share_batch = false;

  Eigen::Index count() const noexcept { return (share_batch ? 1 : batch) * (heads / head_group); }

  template <typename F>
  void for_each_pair(Eigen::Index unit, F&& f) const {
    const Eigen::Index nh = heads / head_group;
    const Eigen::Index ub = unit / nh, uh = unit % nh;
    for (Eigen::Index b = share_batch ? 0 : ub; b < (share_batch ? batch : ub + 1); ++b)
      for (Eigen::Index h = uh * head_group; h < (uh + 1) * head_group; ++h) f(b, h);
  }
};

template <typename Scalar>
BackwardUnits backward_units(const BackwardProblem<Scalar>& bp) {
  const AttentionProblem<Scalar>& p = *bp.forward;
  const bool w = bp.d_weights != nullptr && p.weights, bias = bp.d_bias != nullptr && p.bias;
  BackwardUnits u;
  u.batch = p.batch;
  u.heads = p.heads;
  u.share_batch = p.batch > 1 && ((w && bp.weights_dims[0] == 1) || (bias && bp.bias_dims[0] == 1));
  const bool share_heads = p.heads > 1 && ((w && bp.weights_dims[1] == 1) || (bias && bp.bias_dims[1] == 1));
  u.head_group = share_heads ? p.heads : p.kv_group;
  return u;
}

// The sinks' gradient from per-(batch, head) partial sums, added in batch order: the same bits on any
// number of threads.
template <typename Scalar>
void reduce_sink_gradients(const BackwardProblem<Scalar>& bp, const std::vector<Scalar>& partial) {
  const AttentionProblem<Scalar>& p = *bp.forward;
  if (bp.d_sinks == nullptr || p.sinks == nullptr) return;
  for (Eigen::Index h = 0; h < p.heads; ++h) {
    Scalar sum = Scalar(0);
    for (Eigen::Index b = 0; b < p.batch; ++b) sum += partial[static_cast<std::size_t>(b * p.heads + h)];
    bp.d_sinks[h] = sum;
  }
}

template <typename Scalar>
void fill_rows(const Heads<Scalar>& x, Eigen::Index b, Eigen::Index h, Eigen::Index n, Eigen::Index d, Scalar value) {
  for (Eigen::Index i = 0; i < n; ++i) std::fill_n(x.row(b, h, i), d, value);
}

// The gradients of an empty problem (no queries or no keys): zero, as nothing flows (a row without keys has
// all its weight on its sink, whose value is zero: no gradient either).
template <typename Scalar>
void backward_nothing_flows(const BackwardProblem<Scalar>& bp) {
  const AttentionProblem<Scalar>& p = *bp.forward;
  for (Eigen::Index b = 0; b < p.batch; ++b) {
    for (Eigen::Index h = 0; h < p.heads; ++h) fill_rows(bp.d_q, b, h, p.nq, p.d_k, Scalar(0));
    for (Eigen::Index g = 0; g < p.kv_heads(); ++g) {
      fill_rows(bp.d_k, b, g, p.nk, p.d_k, Scalar(0));
      fill_rows(bp.d_v, b, g, p.nk, p.d_v, Scalar(0));
    }
  }
  if (bp.d_sinks != nullptr && p.sinks != nullptr) std::fill_n(bp.d_sinks, p.heads, Scalar(0));
}

}  // namespace detail

// The backward of one worker: every gradient of the (batch, head) pairs it is given, one pair at a time.
// Per group of query rows it walks the forward's tiles (key blocks outer, query blocks inner) and
// accumulates dq of the group in scratch, dk and dv straight into their outputs; so each gradient element
// sums its terms in the order of the blocks, whatever the grouping or the threads.
// Under a score program with a score function, dS is carried through it by the chain rule (its derivative
// from flex::Dual at the score it took), and the reads of ScoreTables add to the current unit's share of
// their gradients (set_table_partial).
template <typename Scalar, typename Program = NoProgram>
class TiledBackward {
 public:
  using Index = Eigen::Index;
  using Segment = typename Visibility<Scalar>::Segment;

  // sink_partial: per (batch, head), this worker's pairs' share of the sinks' gradient (when there are sinks).
  TiledBackward(const BackwardProblem<Scalar>& bp, const ScorePipeline<Scalar, Program>& pipeline, const TileConfig& c,
                Scalar* sink_partial)
      : bp_(bp),
        p_(*bp.forward),
        vis_(pipeline.visibility()),
        scorer_(pipeline, c, /*keep_pre=*/Program::kScore),
        span_(c.group * c.block_q),
        ldd_((c.block_k + kLine - 1) / kLine * kLine),
        dw_(detail::dense_gradient(bp.d_weights, p_.weights, bp.weights_dims)),
        db_(detail::dense_gradient(bp.d_bias, p_.bias, bp.bias_dims)),
        ds_buf_(static_cast<std::size_t>(c.block_q * ldd_ + kLine)),
        u_buf_(dw_ || p_.softcap > Scalar(0) ? static_cast<std::size_t>(c.block_q * ldd_ + kLine) : 0),
        y_buf_(p_.softcap > Scalar(0) ? static_cast<std::size_t>(ldd_ + kLine) : 0),
        dq_buf_(static_cast<std::size_t>(span_ * p_.d_k + kLine)),
        delta_(static_cast<std::size_t>(span_)),
        lse_(static_cast<std::size_t>(span_)),
        seen_(static_cast<std::size_t>(span_)),
        bits_(p_.dropout ? static_cast<std::size_t>(c.block_k + 8) : 0),
        sink_partial_(sink_partial),
        bf16_(p_.compute == Compute::kBf16 ? p_.bf16_path : Bf16Path::kEmulated) {
    if constexpr (Program::kScore) {
      const Program& f = *pipeline.program();
      Index offset = 0;
      for (Index i = 0; i < f.table_count(); ++i) {
        table_offsets_.push_back(offset);
        offset += f.table_size(i);
      }
    }
  }

  // Where the next pairs' table reads add their gradient terms (null: nowhere).
  void set_table_partial(Scalar* partial) noexcept { table_partial_ = partial; }
  const BackwardStatus& status() const noexcept { return status_; }

  // Pair (b, h); the first query head of a key/value head's group starts that group's dk and dv rows.
  void run(Index b, Index h) {
    const AttentionProblem<Scalar>& p = p_;
    const Index g = h / p.kv_group;
    if (h % p.kv_group == 0) {
      detail::fill_rows(bp_.d_k, b, g, p.nk, p.d_k, Scalar(0));
      detail::fill_rows(bp_.d_v, b, g, p.nk, p.d_v, Scalar(0));
    }
    nan_values_ = false;
    sink_sum_ = Scalar(0);
    for (Index q0 = 0; q0 < p.nq; q0 += span_) run_group(b, h, q0, std::min(span_, p.nq - q0));
    if (nan_values_) detail::fill_rows(bp_.d_v, b, g, p.nk, p.d_v, std::numeric_limits<Scalar>::quiet_NaN());
    if (sink_partial_ != nullptr) sink_partial_[b * p.heads + h] = sink_sum_;
  }

 private:
  static constexpr Index kLine = 64 / static_cast<Index>(sizeof(Scalar));
  using Row = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  using ConstRow = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;

  static Scalar* aligned(std::vector<Scalar>& buf) noexcept { return sdpa::detail::cache_line_start(buf); }

  // d L / d y for the softcapped scores of row q of (b, h) over keys k0 .. k0 + n - 1: dr[j] *= 1 -
  // tanh(y_j / c)^2, where y = u (times the weights) is the score the softcap took and u = scale * q . k
  // (ur); y is computed into y_buf_ and capped there with the forward's own kernel, so the derivative is that
  // of the value the forward used.
  void softcap_gradient(Index b, Index h, Index q, Index k0, const Scalar* ur, Scalar* dr, Index n) {
    const AttentionProblem<Scalar>& p = p_;
    Scalar* yr = aligned(y_buf_);
    std::copy_n(ur, n, yr);
    if (p.weights) detail::apply_broadcast_row(yr, n, p.weights, b, h, q, k0, /*multiply=*/true);
    simd::softcap(p.isa, yr, n, p.softcap);
    const Scalar inv = Scalar(1) / p.softcap;
    for (Index j = 0; j < n; ++j) {
      const Scalar t = yr[j] * inv;
      dr[j] *= Scalar(1) - t * t;
    }
  }

  void run_group(Index b, Index h, Index q0, Index rows) {
    const AttentionProblem<Scalar>& p = p_;
    const Index bh = b * p.heads + h;
    for (Index r = 0; r < rows; ++r) {
      const std::size_t sr = static_cast<std::size_t>(r);
      // D = rowsum(dO o O): with dropout too, since O already holds the dropped, rescaled probabilities.
      delta_[sr] = ConstRow(bp_.d_out.row(b, h, q0 + r), p.d_v).matrix().dot(ConstRow(p.out.row(b, h, q0 + r), p.d_v).matrix());
      lse_[sr] = p.lse[bh * p.nq + q0 + r];
      seen_[sr] = 0;
    }
    Scalar* dq = aligned(dq_buf_);
    std::fill_n(dq, rows * p.d_k, Scalar(0));
    scorer_.run(b, h, q0, rows, [&](const Tile<Scalar>& t) { visit(t); }, /*count=*/false);
    for (Index r = 0; r < rows; ++r) {
      const std::size_t sr = static_cast<std::size_t>(r);
      std::copy_n(dq + r * p.d_k, p.d_k, bp_.d_q.row(b, h, q0 + r));
      if (!seen_[sr] && p.masked_rows == MaskedRows::kNaN && p.sinks == nullptr) nan_values_ = true;
      // The sink's probability times D, in row order.
      if (p.sinks != nullptr) sink_sum_ -= std::exp(p.sinks[h] - lse_[sr]) * delta_[sr];
    }
  }

  void visit(const Tile<Scalar>& t) {
    const AttentionProblem<Scalar>& p = p_;
    const Index b = t.b, h = t.h, bh = b * p.heads + h;
    const Index ni = t.i1 - t.i0, nj = t.width();
    const Index first_query = t.q0 + t.r0 + t.i0, first_key = t.k0 + t.j0;
    const Scalar* dout = bp_.d_out.row(b, h, first_query);
    const Scalar* q = p.q.row(b, h, first_query);
    const Scalar* k = p.key_row(b, h, first_key);
    // Rectangle row i - i0 of ds (and u) is tile row i, from key first_key on.
    Scalar* ds = aligned(ds_buf_);
    Scalar* u = u_buf_.empty() ? nullptr : aligned(u_buf_);

    // kBf16 where the CPU has bfloat16 instructions: dP, dq, dv and dk on them (their operands rounded).
    bool on_bf16 = false;
    if constexpr (std::is_same<Scalar, float>::value) on_bf16 = p.compute == Compute::kBf16 && bf16_.hardware();
    // dP = dO v^T, then dS in place; u = scale * q k^T, the score before the weights and the softcap, for
    // their gradients.
    if constexpr (std::is_same<Scalar, float>::value) {
      if (on_bf16)
        bf16_.nt({ni, nj, p.d_v}, 1.0f, {dout, bp_.d_out.row_stride}, {p.value_row(b, h, first_key), p.v.row_stride},
                 {ds, ldd_});
    }
    if (!on_bf16)
      gemm_nt<Scalar>(p.isa, {ni, nj, p.d_v}, Scalar(1), {dout, bp_.d_out.row_stride},
                      {p.value_row(b, h, first_key), p.v.row_stride}, {ds, ldd_});
    if (u != nullptr)
      gemm_nt<Scalar>(p.isa, {ni, nj, p.d_k}, p.scale, {q, p.q.row_stride}, {k, p.k.row_stride}, {u, ldd_});
    for (Index i = t.i0; i < t.i1; ++i) {
      const Index r = t.r0 + i, query = t.q0 + r;
      Scalar* pr = t.row(i);
      Scalar* dr = ds + (i - t.i0) * ldd_;
      Segment seg = t.segments[i];
      if (seg.none()) {
        // A row that sees no key of this tile: no probability, no gradient.
        std::fill_n(pr, nj, Scalar(0));
        std::fill_n(dr, nj, Scalar(0));
        continue;
      }
      seg.lo -= t.j0;
      seg.hi -= t.j0;
      seen_[static_cast<std::size_t>(r)] = 1;
      const Scalar lse = lse_[static_cast<std::size_t>(r)];
      if (std::isfinite(lse)) {
        simd::exp_shifted_sum(p.isa, pr, nj, lse);  // hidden keys' -inf give exactly 0
      } else {
        // The forward's softmax of this row was NaN (a NaN or infinite score, or every visible score -inf):
        // so are its probabilities, and PyTorch's dv gets NaN from every key of the (batch, head).
        std::fill_n(pr, nj, Scalar(0));
        std::fill(pr + seg.lo, pr + seg.hi, std::numeric_limits<Scalar>::quiet_NaN());
        nan_values_ = true;
      }
      const Scalar delta = delta_[static_cast<std::size_t>(r)];
      if (p.dropout) {
        // dP = (dO v^T) o Z and dv's operand P o Z, Z = 0 (dropped) or keep_scale, from the forward's draw.
        const DropoutSampler& sampler = p.sampler;
        const Index k4_begin = first_key >> 2, blocks = ((first_key + nj + 3) >> 2) - k4_begin;
        sampler.fill_bits(p.isa, bh, query, k4_begin, blocks, bits_.data());
        const std::uint32_t* bits = bits_.data() + (first_key - 4 * k4_begin);
        for (Index j = 0; j < nj; ++j) {
          const Scalar z = sampler.dropped_bits(bits[j]) ? Scalar(0) : p.keep_scale;
          dr[j] = pr[j] * (dr[j] * z - delta);
          pr[j] *= z;
        }
      } else {
        Row(dr, nj) = ConstRow(pr, nj) * (Row(dr, nj) - delta);
      }
      if (t.any_hidden) zero_hidden(t, i, seg, dr, nj);
      if constexpr (Program::kScore) through_score_function(t, i, query, seg, dr);
      const Scalar* ur = u == nullptr ? nullptr : u + (i - t.i0) * ldd_;
      // The bias was added after the softcap; the weights multiplied before it.
      if (db_) add_score_gradient(db_, t, i, query, seg, [&](Index j) { return dr[j]; });
      if (p.softcap > Scalar(0)) softcap_gradient(b, h, query, first_key, ur, dr, nj);
      if (dw_) add_score_gradient(dw_, t, i, query, seg, [&](Index j) { return dr[j] * ur[j]; });
      // dU = dY o weights, times the scale that multiplied q . k: the operand of dq and dk.
      if (p.weights) detail::apply_broadcast_row(dr, nj, p.weights, b, h, query, first_key, /*multiply=*/true);
      Row(dr, nj) *= p.scale;
    }

    if constexpr (std::is_same<Scalar, float>::value) {
      if (p.compute == Compute::kBf16) {
        // The operands of the three products below rounded to bfloat16: P (after dropout) and dS (scaled).
        for (Index i = t.i0; i < t.i1; ++i) {
          round_to_bf16(p.isa, t.row(i), nj, t.row(i));
          round_to_bf16(p.isa, ds + (i - t.i0) * ldd_, nj, ds + (i - t.i0) * ldd_);
        }
      }
    }
    // The two products that read a tile transposed (on bf16_ as above; it rounds what it packs, rounded
    // already).
    const auto tn_add = [&](gemm::Shape s, gemm::Matrix<const Scalar> a, gemm::Matrix<const Scalar> bm,
                            gemm::Matrix<Scalar> c) {
      if constexpr (std::is_same<Scalar, float>::value) {
        if (on_bf16) return bf16_.tn_add(s, a, bm, c);
      }
      detail::gemm_tn_add(s, a, bm, c);
    };
    // With p = 1 every probability is dropped and dv gets nothing.
    if (!(p.dropout && p.keep_scale == Scalar(0)))
      tn_add({nj, p.d_v, ni}, {t.row(t.i0), t.lds}, {dout, bp_.d_out.row_stride},
             {bp_.d_v.row(b, h / p.kv_group, first_key), bp_.d_v.row_stride});
    Scalar* dq = aligned(dq_buf_) + (t.r0 + t.i0) * p.d_k;
    if (t.any_hidden && !keys_finite(k, nj)) {
      // A hidden key passes no gradient, not even a NaN or infinity in its k row, which the product would
      // spread as 0 * NaN: the visible keys one by one (only inputs with NaN or inf come here).
      for (Index i = t.i0; i < t.i1; ++i)
        for (Index j = t.j0; j < t.j1; ++j) {
          if (t.hidden(vis_, i, j)) continue;
          const Scalar g = ds[(i - t.i0) * ldd_ + (j - t.j0)];
          const Scalar* kj = p.key_row(b, h, t.k0 + j);
          for (Index d = 0; d < p.d_k; ++d) dq[(i - t.i0) * p.d_k + d] += g * kj[d];
        }
    } else if (on_bf16) {
      if constexpr (std::is_same<Scalar, float>::value)
        bf16_.nn_add({ni, p.d_k, nj}, {ds, ldd_}, {k, p.k.row_stride}, {dq, p.d_k});
    } else {
      gemm_nn_add<Scalar>(p.isa, {ni, p.d_k, nj}, {ds, ldd_}, {k, p.k.row_stride}, {dq, p.d_k});
    }
    tn_add({nj, p.d_k, ni}, {ds, ldd_}, {q, p.q.row_stride},
           {bp_.d_k.row(b, h / p.kv_group, first_key), bp_.d_k.row_stride});
  }

  // dr (dL / d the function's result, over the row's segment) becomes dL / d the score it took: times
  // d result / d score from the dual; each table entry read adds dr times its derivative. Keys with dr 0
  // (hidden, or no gradient) are not asked.
  void through_score_function(const Tile<Scalar>& t, Index i, Index query, const Segment& seg, Scalar* dr) {
    const Program& f = *scorer_.program();
    const Scalar* pre = t.pre_row(i);
    const Index bb = t.b + p_.batch_base, base = p_.base(t.b), pos = p_.position(t.b, query) + base;
    const Index first_key = t.k0 + t.j0 + base;
    flex::detail::TableTape& tape = flex::detail::table_tape();
    for (Index j = seg.lo; j < seg.hi; ++j) {
      const Scalar g = dr[j];
      if (g == Scalar(0)) continue;
      tape.start();
      const flex::Dual<Scalar> y = f.score(flex::Dual<Scalar>::variable(pre[j], 0), bb, t.h, pos, first_key + j);
      dr[j] = g * y.d[0];
      for (int r = 0; r < tape.reads; ++r) {
        const std::size_t sr = static_cast<std::size_t>(r);
        Index table = 0;
        while (table < f.table_count() && f.table_id(table) != tape.table[sr]) ++table;
        if (table == f.table_count()) {
          status_.unlisted_table = true;
          continue;
        }
        if (table_partial_ != nullptr)
          table_partial_[table_offsets_[static_cast<std::size_t>(table)] + tape.index[sr]] += g * y.d[sr + 1];
      }
      if (tape.overflow) status_.too_many_reads = true;
    }
    tape.recording = false;
  }

  // dS = 0 at the keys the row does not see (seg relative to the rectangle's first key), whatever dP held
  // there: the masked_fill's gradient.
  void zero_hidden(const Tile<Scalar>& t, Index i, const Segment& seg, Scalar* dr, Index nj) const {
    std::fill(dr, dr + seg.lo, Scalar(0));
    std::fill(dr + seg.hi, dr + nj, Scalar(0));
    if (seg.solid) return;
    for (Index j = seg.lo; j < seg.hi; ++j)
      if (t.hidden(vis_, i, t.j0 + j)) dr[j] = Scalar(0);
  }

  // g += term(j) over the row's visible keys, summed over g's broadcast dimensions: the bias's gradient
  // (dS) and the weights' (dY o u).
  template <typename Term>
  void add_score_gradient(const detail::DenseGradient<Scalar>& g, const Tile<Scalar>& t, Index i, Index query,
                          const Segment& seg, Term term) {
    const Index first_key = t.k0 + t.j0;
    Scalar* target = g.row(t.b, t.h, query);
    const Index stride = g.stride[3];
    Scalar sum = Scalar(0);
    for (Index j = seg.lo; j < seg.hi; ++j) {
      if (!seg.solid && t.hidden(vis_, i, t.j0 + j)) continue;
      if (stride == 0) sum += term(j);
      else target[(first_key + j) * stride] += term(j);
    }
    if (stride == 0) *target += sum;
  }

  bool keys_finite(const Scalar* k, Index nj) const {
    for (Index j = 0; j < nj; ++j)
      if (!row_finite(k + j * p_.k.row_stride, p_.d_k)) return false;
    return true;
  }

  const BackwardProblem<Scalar>& bp_;
  const AttentionProblem<Scalar>& p_;
  const Visibility<Scalar>& vis_;
  TileScorer<Scalar, Program> scorer_;
  const Index span_, ldd_;
  const detail::DenseGradient<Scalar> dw_, db_;
  // Scratch starts on a cache line in every worker: Eigen's products of small operands vectorise from the
  // first aligned element, so their rounding would otherwise depend on where a worker's buffer landed.
  std::vector<Scalar> ds_buf_, u_buf_;  // one tile of dP, then dS; of u = scale * q . k
  std::vector<Scalar> y_buf_;           // one row of softcapped scores (softcap_gradient)
  std::vector<Scalar> dq_buf_;          // the group's dq rows
  std::vector<Scalar> delta_, lse_;     // per group row
  std::vector<char> seen_;              // per group row: saw a visible key
  std::vector<std::uint32_t> bits_;     // one row's dropout words
  bool nan_values_ = false;             // a row of the current pair had a NaN softmax
  Scalar* sink_partial_;                // per (batch, head), or null
  Scalar sink_sum_ = Scalar(0);         // the current pair's
  Bf16Gemm bf16_;                       // kBf16 on a hardware path: the gradient products
  std::vector<Index> table_offsets_;    // each table's first element in a unit's share
  Scalar* table_partial_ = nullptr;     // the current unit's share of the tables' gradients
  BackwardStatus status_;
};

// The attention core's backward under a score program, tiled (see the header comment). Zero fields of
// `config` are derived from the caches as for the forward. Deterministic: for a given config the results
// are the same bits on any number of threads and in every call (the tables' gradients too: each unit of
// work adds to a share of its own, and the shares are summed in unit order).
template <typename Scalar, typename Program>
BackwardStatus tiled_backward_program(const BackwardProblem<Scalar>& bp, const Program& program,
                                      const Eigen::ThreadPoolDevice* device = nullptr, TileConfig config = TileConfig{}) {
  using Index = Eigen::Index;
  eigen_assert(bp.forward != nullptr);
  const AttentionProblem<Scalar>& p = *bp.forward;
  const detail::DenseGradient<Scalar> dw = detail::dense_gradient(bp.d_weights, p.weights, bp.weights_dims);
  const detail::DenseGradient<Scalar> db = detail::dense_gradient(bp.d_bias, p.bias, bp.bias_dims);
  if (dw) dw.zero();
  if (db) db.zero();
  Index table_elements = 0;
  for (Index i = 0; i < program.table_count(); ++i) table_elements += program.table_size(i);
  if (bp.d_tables != nullptr) std::fill_n(bp.d_tables, table_elements, Scalar(0));
  BackwardStatus status;
  if (p.batch <= 0 || p.heads <= 0) return status;
  if (p.nq <= 0 || p.nk <= 0) {
    detail::backward_nothing_flows(bp);
    return status;
  }
  eigen_assert(p.lse != nullptr);
  // One worker's view of the config: groups only decide which query blocks share packed operands here, as
  // a unit is a whole (batch, head), so they are never shrunk for the threads (which keeps the bits too).
  const TileConfig c = resolve_tile_config(p, config, 1);
  const detail::BackwardUnits units = detail::backward_units(bp);
  const Visibility<Scalar> visibility(p, device);
  const ScorePipeline<Scalar, Program> pipeline(visibility, &program);
  const Index n = units.count();
  const bool sinks = bp.d_sinks != nullptr && p.sinks != nullptr;
  std::vector<Scalar> sink_partial(sinks ? static_cast<std::size_t>(p.batch * p.heads) : 0);
  const bool tables = Program::kScore && bp.d_tables != nullptr && table_elements > 0;
  std::vector<Scalar> table_partial(tables ? static_cast<std::size_t>(n * table_elements) : 0);
  std::atomic<bool> unlisted{false}, too_many{false};
  parallel_for_with_state(
      device, n, balanced_grain(device, n, 4),
      [&] { return TiledBackward<Scalar, Program>(bp, pipeline, c, sinks ? sink_partial.data() : nullptr); },
      [&](TiledBackward<Scalar, Program>& worker, Index u0, Index u1) {
        for (Index u = u0; u < u1; ++u) {
          if (tables) worker.set_table_partial(table_partial.data() + u * table_elements);
          units.for_each_pair(u, [&](Index b, Index h) { worker.run(b, h); });
        }
      },
      [&](TiledBackward<Scalar, Program>& worker) {
        if (worker.status().unlisted_table) unlisted.store(true, std::memory_order_relaxed);
        if (worker.status().too_many_reads) too_many.store(true, std::memory_order_relaxed);
      });
  detail::reduce_sink_gradients(bp, sink_partial);
  if (tables) {
    for (Index u = 0; u < n; ++u) {
      const Scalar* share = table_partial.data() + u * table_elements;
      for (Index e = 0; e < table_elements; ++e) bp.d_tables[e] += share[e];
    }
  }
  status.unlisted_table = unlisted.load();
  status.too_many_reads = too_many.load();
  return status;
}

// The attention core's backward with its fixed options alone.
template <typename Scalar>
void tiled_backward(const BackwardProblem<Scalar>& bp, const Eigen::ThreadPoolDevice* device = nullptr,
                    TileConfig config = TileConfig{}) {
  tiled_backward_program(bp, NoProgram{}, device, config);
}

// The plain backward, the oracle of tiled_backward: per (batch, head, query) the whole row of scores and
// its softmax formed again one element at a time (it needs neither O nor the log-sum-exp), then every
// gradient term in loops. Simple rather than fast.
template <typename Scalar>
void reference_backward(const BackwardProblem<Scalar>& bp, const Eigen::ThreadPoolDevice* device = nullptr) {
  using Index = Eigen::Index;
  constexpr Scalar kInf = std::numeric_limits<Scalar>::infinity();
  eigen_assert(bp.forward != nullptr);
  const AttentionProblem<Scalar>& p = *bp.forward;
  const detail::DenseGradient<Scalar> dw = detail::dense_gradient(bp.d_weights, p.weights, bp.weights_dims);
  const detail::DenseGradient<Scalar> db = detail::dense_gradient(bp.d_bias, p.bias, bp.bias_dims);
  if (dw) dw.zero();
  if (db) db.zero();
  if (p.batch <= 0 || p.heads <= 0) return;
  if (p.nq <= 0 || p.nk <= 0) {
    detail::backward_nothing_flows(bp);
    return;
  }
  const detail::BackwardUnits units = detail::backward_units(bp);
  const bool sinks = bp.d_sinks != nullptr && p.sinks != nullptr;
  std::vector<Scalar> sink_partial(sinks ? static_cast<std::size_t>(p.batch * p.heads) : 0);
  parallel_for(device, units.count(), 1, [&](Index u0, Index u1) {
    const std::size_t nk = static_cast<std::size_t>(p.nk);
    std::vector<Scalar> u(nk), y(nk), s(nk), prob(nk), dprob(nk), dq(static_cast<std::size_t>(p.d_k));
    std::vector<char> hidden(nk), dropped(nk);
    for (Index unit = u0; unit < u1; ++unit) {
      units.for_each_pair(unit, [&](Index b, Index h) {
        const Index bh = b * p.heads + h, g = h / p.kv_group;
        if (h % p.kv_group == 0) {  // the first query head of the key/value head's group
          detail::fill_rows(bp.d_k, b, g, p.nk, p.d_k, Scalar(0));
          detail::fill_rows(bp.d_v, b, g, p.nk, p.d_v, Scalar(0));
        }
        Scalar sink_sum = 0;
        for (Index i = 0; i < p.nq; ++i) {
          const Scalar* qi = p.q.row(b, h, i);
          const Scalar* doi = bp.d_out.row(b, h, i);
          bool seen = false;
          Scalar max = -kInf;
          for (Index j = 0; j < p.nk; ++j) {
            const std::size_t sj = static_cast<std::size_t>(j);
            hidden[sj] = reference_hidden(p, b, h, i, j);
            dropped[sj] = p.dropout && p.sampler.dropped(bh, i, j);
            if (hidden[sj]) {
              s[sj] = -kInf;
              continue;
            }
            seen = true;
            const Scalar* kj = p.key_row(b, h, j);
            Scalar dot = 0;
            for (Index d = 0; d < p.d_k; ++d) dot += qi[d] * kj[d];
            u[sj] = dot * p.scale;
            Scalar x = u[sj];
            if (p.weights) x *= p.weights(b, h, i, j);
            y[sj] = x;
            if (p.softcap > Scalar(0)) x = p.softcap * std::tanh(x / p.softcap);
            if (p.bias) x += p.bias(b, h, i, j);
            if (p.alibi != nullptr) x -= p.alibi[h] * static_cast<Scalar>(std::abs(p.position(b, i) - j));
            s[sj] = x;
            if (x > max || std::isnan(x)) max = std::isnan(max) ? max : x;
          }
          // The softmax as PyTorch evaluates it over the masked scores, hidden keys included: exp(-inf - max)
          // is 0 unless the row is NaN, when every probability is. A row with no visible key is all NaN
          // under kNaN and all 0 under kZero; with a sink it has all its weight there (keys 0).
          const Scalar sink = p.sinks != nullptr ? p.sinks[h] : -kInf;
          if (p.sinks != nullptr && !std::isnan(max) && (sink > max || max == -kInf)) max = sink;
          Scalar sum = p.sinks != nullptr ? std::exp(p.sinks[h] - max) : Scalar(0);
          for (std::size_t j = 0; j < nk; ++j) {
            prob[j] = std::exp(s[j] - max);
            sum += prob[j];
          }
          const bool normalised = seen || p.sinks != nullptr;
          for (std::size_t j = 0; j < nk; ++j) {
            prob[j] = normalised ? prob[j] / sum
                                 : (p.masked_rows == MaskedRows::kNaN ? std::numeric_limits<Scalar>::quiet_NaN() : Scalar(0));
          }
          // dP (dropped and rescaled) at the visible keys and D = sum_j P_j dP_j = dO . O.
          Scalar delta = 0;
          for (Index j = 0; j < p.nk; ++j) {
            const std::size_t sj = static_cast<std::size_t>(j);
            if (hidden[sj]) continue;
            const Scalar* vj = p.value_row(b, h, j);
            Scalar dot = 0;
            for (Index d = 0; d < p.d_v; ++d) dot += doi[d] * vj[d];
            dprob[sj] = dropped[sj] ? Scalar(0) : dot * p.keep_scale;
            delta += prob[sj] * dprob[sj];
          }
          // d sink = -p_sink D: the sink's logit shifts every key's probability and adds no value.
          if (sinks) sink_sum -= std::exp(sink - max) / sum * delta;
          std::fill(dq.begin(), dq.end(), Scalar(0));
          for (Index j = 0; j < p.nk; ++j) {
            const std::size_t sj = static_cast<std::size_t>(j);
            // dv sees every key's probability (0 at a hidden key, unless the row is NaN).
            const Scalar pz = dropped[sj] ? Scalar(0) * prob[sj] : prob[sj] * p.keep_scale;
            Scalar* dvj = bp.d_v.row(b, g, j);
            for (Index d = 0; d < p.d_v; ++d) dvj[d] += pz * doi[d];
            if (hidden[sj]) continue;
            Scalar ds = prob[sj] * (dprob[sj] - delta);  // d L / d (the final score)
            if (db) db.row(b, h, i)[j * db.stride[3]] += ds;
            if (p.softcap > Scalar(0)) {
              const Scalar t = std::tanh(y[sj] / p.softcap);
              ds *= Scalar(1) - t * t;
            }
            if (dw) dw.row(b, h, i)[j * dw.stride[3]] += ds * u[sj];
            const Scalar gu = (p.weights ? ds * p.weights(b, h, i, j) : ds) * p.scale;
            const Scalar* kj = p.key_row(b, h, j);
            Scalar* dkj = bp.d_k.row(b, g, j);
            for (Index d = 0; d < p.d_k; ++d) {
              dq[static_cast<std::size_t>(d)] += gu * kj[d];
              dkj[d] += gu * qi[d];
            }
          }
          std::copy(dq.begin(), dq.end(), bp.d_q.row(b, h, i));
        }
        if (sinks) sink_partial[static_cast<std::size_t>(bh)] = sink_sum;
      });
    }
  });
  detail::reduce_sink_gradients(bp, sink_partial);
}

}  // namespace kernels
SDPA_NAMESPACE_END

#include "sdpa/detail/instances.inc"
SDPA_DETAIL_EXTERN_INSTANCES(REFERENCE_BACKWARD)
SDPA_DETAIL_EXTERN_INSTANCES(TILED_BACKWARD)
