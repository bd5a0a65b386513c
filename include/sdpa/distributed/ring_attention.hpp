// Context-parallel (ring) attention over MPI (Ring Attention, Liu, Zaharia and Abbeel 2023; Megatron's
// context parallelism; ring-flash-attn): one long self-attention sequence split across the ranks of a
// communicator, each holding its rows of q, k and v, while blocks of keys and values travel around the ring
// of ranks (rank r sends to r + 1 and receives from r - 1). Each rank runs sdpa's kernels on its queries
// against every block as it passes, with the blocks' global positions, and merges the blocks' normalized
// outputs by their log-sum-exp, exactly as the kernel merges its own key tiles: per rank memory O(N / P),
// never a whole key/value tensor of another rank.
//
// Which rows a rank holds (RingLayout):
//   kContiguous: rank r holds rows [r n, (r + 1) n) of the N = P n rows.
//   kZigZag: the sequence is cut into 2P chunks of c = n / 2 rows; rank r holds chunk r and then chunk
//     2P - 1 - r (its local rows [0, c) and [c, n)): with causal attention every rank then has the same
//     work (Megatron's and ring-flash-attn's zigzag), where the contiguous split leaves rank P - 1 with
//     2P - 1 times the work of rank 0. ring_shard cuts a whole tensor the same way.
//
// The ring: each rank's rows of k and v are cut into messages of at most RingOptions::block_rows rows
// (never across a zigzag chunk). Every message makes a tour of the ring: the owner injects its message j
// at step j P, and at step j P + t rank r works on message j of rank r - t, which r - 1 forwarded as soon
// as it had it. The next message's receive is posted before a step's work and its send starts before the
// work, so the transfer overlaps the work; a few buffers (kDepth) let a rank run ahead of its neighbours.
// The merge order on a rank is this fixed schedule: the result does not depend on timing and is the same
// bits run to run (and on any thread count); against the single-process kernel it differs by the rounding
// of the merges (of order 1e-7 of the output for float).
//
// The backward pass (ring_attention_backward) sends each block around the ring again with its dK and dV
// accumulators: every rank adds its queries' terms, the last one sends them home to the owner; dQ stays
// local. The sinks' gradients are summed over ranks in rank order.
//
// Options: causal (global positions), window_left / window_right, key_lengths (global lengths), ALiBi,
// scale, softcap, sinks, grouped-query heads, rotary (at global positions), either Layout, a device and the
// kernel choice. Refused (std::invalid_argument, on every rank): attention_mask, attention_weights and
// attention_bias (tensors over the whole sequence), probabilities (an N x N tensor), dropout, packed
// sequences and MaskedRows::kNaN. A query whose every key is hidden gets zero output (kZero), or all its
// weight on its sink.
//
// Collective: every rank of the communicator calls with the same sizes and options (checked before any
// exchange; a mismatch or a local refusal throws the same std::invalid_argument on every rank).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/distributed/mpi.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "sdpa/attention.hpp"
#include "sdpa/distributed/ring_layout.hpp"
#include "sdpa/distributed/ring_passes.hpp"
#include "sdpa/kernels/backward.hpp"
#include "sdpa/rotary.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
AttentionGradients<Scalar> ring_attention_backward(const Tensor4<Scalar>& grad_output, const RingState<Scalar>& state,
                                                   MPI_Comm comm, RingStats* stats = nullptr);

// What ring_attention_backward needs from a forward: this rank's rows of q (rotated), k, v, the output and
// the rows' log-sum-exp (O(N / P)), the options (the device they point to must outlive the backward) and
// the ring's layout.
template <typename Scalar>
class RingState {
 public:
  RingState() = default;
  RingState(RingState&&) noexcept = default;
  RingState& operator=(RingState&&) noexcept = default;
  RingState(const RingState&) = delete;
  RingState& operator=(const RingState&) = delete;
  bool empty() const noexcept { return !filled_; }

 private:
  template <typename S>
  friend Tensor4<S> distributed::detail::ring_impl(const ::sdpa::detail::Input4<S>&, const ::sdpa::detail::Input4<S>&,
                                                   const ::sdpa::detail::Input4<S>&, const AttentionOptions<S>&, MPI_Comm,
                                                   const RingOptions&, RingState<S>*);
  template <typename S>
  friend AttentionGradients<S> ring_attention_backward(const Tensor4<S>&, const RingState<S>&, MPI_Comm, RingStats*);

  bool filled_ = false;
  int ranks_ = 0, rank_ = 0;
  Tensor4<Scalar> q_, k_, v_, out_;  // this rank's rows, q rotated when a rotary was given
  ::sdpa::detail::SavedAttention<Scalar> saved_;  // shape, log-sum-exp, options, rotary
  RingOptions ring_;
};

// Ring attention of this rank's rows q (batch, heads, n, d_k), k (batch, kv_heads, n, d_k) and v (batch,
// kv_heads, n, d_v) (or the (batch, n, heads, dim) layout) over the whole sequence of the P ranks of comm:
// returns this rank's rows of the output, as sdpa::attention over the whole q, k and v would give them (see
// the header comment for the options). Collective.
template <typename Q, typename K, typename V>
Tensor4<::sdpa::detail::ScalarOf<Q>> ring_attention(const Q& q, const K& k, const V& v,
                                                    const AttentionOptions<::sdpa::detail::ScalarOf<Q>>& options, MPI_Comm comm,
                                                    const RingOptions& ring = {}) {
  using Scalar = ::sdpa::detail::ScalarOf<Q>;
  SDPA_DETAIL_CHECK_HEADS(Q, Scalar);
  SDPA_DETAIL_CHECK_HEADS(K, Scalar);
  SDPA_DETAIL_CHECK_HEADS(V, Scalar);
  if constexpr (::sdpa::detail::is_valid_head_tensor<Q, Scalar>() && ::sdpa::detail::is_valid_head_tensor<K, Scalar>() &&
                ::sdpa::detail::is_valid_head_tensor<V, Scalar>()) {
    const ::sdpa::detail::Input4<Scalar> qi(q), ki(k), vi(v);
    return distributed::detail::ring_impl(qi, ki, vi, options, comm, ring, static_cast<RingState<Scalar>*>(nullptr));
  } else {
    return Tensor4<Scalar>();
  }
}

// The same, keeping in `state` what ring_attention_backward needs.
template <typename Q, typename K, typename V>
Tensor4<::sdpa::detail::ScalarOf<Q>> ring_attention(const Q& q, const K& k, const V& v,
                                                    const AttentionOptions<::sdpa::detail::ScalarOf<Q>>& options, MPI_Comm comm,
                                                    const RingOptions& ring, RingState<::sdpa::detail::ScalarOf<Q>>& state) {
  using Scalar = ::sdpa::detail::ScalarOf<Q>;
  SDPA_DETAIL_CHECK_HEADS(Q, Scalar);
  SDPA_DETAIL_CHECK_HEADS(K, Scalar);
  SDPA_DETAIL_CHECK_HEADS(V, Scalar);
  if constexpr (::sdpa::detail::is_valid_head_tensor<Q, Scalar>() && ::sdpa::detail::is_valid_head_tensor<K, Scalar>() &&
                ::sdpa::detail::is_valid_head_tensor<V, Scalar>()) {
    const ::sdpa::detail::Input4<Scalar> qi(q), ki(k), vi(v);
    return distributed::detail::ring_impl(qi, ki, vi, options, comm, ring, &state);
  } else {
    return Tensor4<Scalar>();
  }
}

namespace distributed {
namespace detail {

template <typename Scalar>
Tensor4<Scalar> ring_impl(const ::sdpa::detail::Input4<Scalar>& qi, const ::sdpa::detail::Input4<Scalar>& ki,
                          const ::sdpa::detail::Input4<Scalar>& vi, const AttentionOptions<Scalar>& options, MPI_Comm comm,
                          const RingOptions& ro, RingState<Scalar>* state) {
  using ::sdpa::detail::bhnd;
  using ::sdpa::detail::heads_of;
  const char* where = "ring_attention";
  const auto start = std::chrono::steady_clock::now();
  const CommShape cs = comm_shape(comm, where);
  const Layout layout = options.layout;
  const std::array<Index, 4> qd = bhnd(qi.dims(), layout), kd = bhnd(ki.dims(), layout), vd = bhnd(vi.dims(), layout);
  const ::sdpa::detail::CallShape c = ::sdpa::detail::CallShape::of(where, qd, kd, vd);
  checked_collectively(
      comm, cs, where, [&] { check_ring(c, qd, kd, vd, options, ro, cs.size); }, ring_fields(c, options, ro));

  RingStats stats;
  RingCall<Scalar> call;
  call.plan = make_plan(ro.layout, cs.rank, cs.size, c.nq, ro.block_rows);
  call.shape = c;
  call.options = &options;
  call.rotary = options.rotary;
  call.comm = comm;
  // The queries, rotated at their global positions when a rotary is given.
  Tensor4<Scalar> q_rot;
  const Scalar* qp = qi.data();
  if (options.rotary != nullptr && c.nq > 0) {
    q_rot = Tensor4<Scalar>(qi.dims());
    std::copy_n(qp, q_rot.size(), q_rot.data());
    const kernels::Heads<Scalar> rq = heads_of(q_rot.data(), q_rot.dimensions(), layout);
    for (const auto& qb : call.plan.queries)
      for (Index b = 0; b < c.batch; ++b)
        apply_rotary(*options.rotary,
                     RotaryRows(rq.row(b, 0, qb.local0), qb.rows, rq.row_stride, c.heads, rq.head_stride, c.d_k),
                     call.plan.global(cs.rank, qb.local0));
    qp = q_rot.data();
  }
  call.q = heads_of(qp, qi.dims(), layout);
  call.k = heads_of(ki.data(), ki.dims(), layout);
  call.v = heads_of(vi.data(), vi.dims(), layout);
  const std::array<Index, 4> out_dims = layout == Layout::kBHND ? std::array<Index, 4>{c.batch, c.heads, c.nq, c.d_v}
                                                                : std::array<Index, 4>{c.batch, c.nq, c.heads, c.d_v};
  Tensor4<Scalar> out(out_dims);
  std::vector<Scalar> lse(static_cast<std::size_t>(c.batch * c.heads * c.nq));
  ring_forward(call, heads_of(out.data(), out.dimensions(), layout), lse.data(), stats);

  if (state != nullptr) {
    RingState<Scalar>& s = *state;
    s = RingState<Scalar>();
    s.filled_ = true;
    s.saved_.shape = c;
    s.ranks_ = cs.size;
    s.rank_ = cs.rank;
    const auto copy = [](const ::sdpa::detail::Input4<Scalar>& t, Tensor4<Scalar>& into) {
      into = Tensor4<Scalar>(t.dims());
      if (into.size() > 0) std::copy_n(t.data(), into.size(), into.data());
    };
    if (q_rot.size() > 0)
      s.q_ = std::move(q_rot);
    else
      copy(qi, s.q_);
    copy(ki, s.k_);
    copy(vi, s.v_);
    s.out_ = out;
    s.saved_.lse = std::move(lse);
    s.saved_.keep_options(options);
    s.ring_ = ro;
    s.ring_.stats = nullptr;
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (ro.stats != nullptr) *ro.stats = stats;
  return out;
}

}  // namespace detail
}  // namespace distributed

// d loss / d (q, k, v, sinks) of the ring_attention call that filled `state`, for this rank's rows, given
// its rows of d loss / d output: the gradients of sdpa::attention_backward over the whole sequence (the
// sinks' summed over every rank, the same on each). Collective over the forward's communicator (or one of
// the same ranks in the same order); `stats`, when given, receives this call's RingStats.
template <typename Scalar>
AttentionGradients<Scalar> ring_attention_backward(const Tensor4<Scalar>& grad_output, const RingState<Scalar>& s, MPI_Comm comm,
                                                   RingStats* stats_out) {
  using ::sdpa::detail::heads_of;
  using distributed::detail::Index;
  const char* where = "ring_attention_backward";
  const auto start = std::chrono::steady_clock::now();
  const distributed::detail::CommShape cs = distributed::detail::comm_shape(comm, where);
  const AttentionOptions<Scalar>& o = s.saved_.options;
  distributed::detail::Fields fields;
  fields.integer("the state (filled or empty)", s.empty() ? 0 : 1);
  for (std::size_t i = 0; i < 4; ++i) fields.integer("grad_output's shape", grad_output.dimension(i));
  distributed::detail::checked_collectively(
      comm, cs, where,
      [&] {
        if (s.empty())
          throw std::logic_error("sdpa::ring_attention_backward: the state is empty: pass the state that ring_attention(q, k, v, "
                                 "options, comm, ring, state) filled");
        if (s.ranks_ != cs.size || s.rank_ != cs.rank)
          ::sdpa::detail::throw_invalid(where, "comm", ::sdpa::detail::concat("the forward's (rank ", s.rank_, " of ", s.ranks_, ")"),
                                        ::sdpa::detail::concat("rank ", cs.rank, " of ", cs.size));
        const auto want = s.out_.dimensions();
        for (std::size_t i = 0; i < 4; ++i)
          if (grad_output.dimension(i) != want[i])
            ::sdpa::detail::throw_invalid(where, "grad_output",
                                          ::sdpa::detail::concat("of the forward's output shape ", ::sdpa::detail::shape_string(want)),
                                          ::sdpa::detail::concat("of shape ", ::sdpa::detail::shape_string(grad_output.dimensions())));
      },
      fields);
  const ::sdpa::detail::CallShape& c = s.saved_.shape;
  const Layout layout = o.layout;
  RingStats stats;
  distributed::detail::RingCall<Scalar> call;
  call.plan = distributed::detail::make_plan(s.ring_.layout, cs.rank, cs.size, c.nq, s.ring_.block_rows);
  call.shape = c;
  call.options = &o;
  call.rotary = s.saved_.rotary_or_null();
  call.comm = comm;
  call.q = heads_of(s.q_.data(), s.q_.dimensions(), layout);
  call.k = heads_of(s.k_.data(), s.k_.dimensions(), layout);
  call.v = heads_of(s.v_.data(), s.v_.dimensions(), layout);
  AttentionGradients<Scalar> g;
  g.q = Tensor4<Scalar>(s.q_.dimensions());
  g.k = Tensor4<Scalar>(s.k_.dimensions());
  g.v = Tensor4<Scalar>(s.v_.dimensions());
  std::vector<Scalar> sinks(o.sinks.size());
  ::sdpa::detail::ProgramTables<Scalar> tables(o.program.get());
  kernels::BackwardStatus status;
  distributed::detail::RingGradients<Scalar> grads;
  grads.q = heads_of(g.q.data(), g.q.dimensions(), layout);
  grads.k = heads_of(g.k.data(), g.k.dimensions(), layout);
  grads.v = heads_of(g.v.data(), g.v.dimensions(), layout);
  grads.sinks = sinks.empty() ? nullptr : sinks.data();
  grads.tables = &tables;
  grads.status = &status;
  distributed::detail::ring_backward(call, heads_of(s.out_.data(), s.out_.dimensions(), layout), s.saved_.lse.data(),
                                     heads_of(grad_output.data(), grad_output.dimensions(), layout), grads, stats);
  // The rotated q's and k's gradients, rotated back at their global positions.
  if (call.rotary != nullptr) {
    const kernels::Heads<Scalar> dq = heads_of(g.q.data(), g.q.dimensions(), layout), dk = heads_of(g.k.data(), g.k.dimensions(), layout);
    for (const auto& qb : call.plan.queries)
      for (Index b = 0; b < c.batch; ++b) {
        const Index first = call.plan.global(cs.rank, qb.local0);
        apply_rotary(*call.rotary,
                     RotaryRows(dq.row(b, 0, qb.local0), qb.rows, dq.row_stride, c.heads, dq.head_stride, c.d_k), first,
                     true);
        apply_rotary(*call.rotary,
                     RotaryRows(dk.row(b, 0, qb.local0), qb.rows, dk.row_stride, c.kv_heads, dk.head_stride, c.d_k),
                     first, true);
      }
  }
  // The sinks' gradient: every rank's share, summed in rank order (the same bits on every rank).
  if (!sinks.empty()) {
    std::vector<Scalar> all(sinks.size() * static_cast<std::size_t>(cs.size));
    distributed::detail::check_mpi(MPI_Allgather(sinks.data(), static_cast<int>(sinks.size()), distributed::detail::mpi_type<Scalar>(),
                                                 all.data(), static_cast<int>(sinks.size()), distributed::detail::mpi_type<Scalar>(), comm),
                                   "MPI_Allgather");
    g.sinks.assign(sinks.size(), Scalar(0));
    for (int r = 0; r < cs.size; ++r)
      for (std::size_t h = 0; h < sinks.size(); ++h) g.sinks[h] += all[static_cast<std::size_t>(r) * sinks.size() + h];
  }
  // The tables' gradients likewise, and whether any rank's backward lost some (refused on every rank).
  if (tables.size() > 0) {
    const std::size_t n = static_cast<std::size_t>(tables.size());
    std::vector<Scalar> all(n * static_cast<std::size_t>(cs.size));
    distributed::detail::check_mpi(MPI_Allgather(tables.data(), static_cast<int>(n), distributed::detail::mpi_type<Scalar>(), all.data(),
                                                 static_cast<int>(n), distributed::detail::mpi_type<Scalar>(), comm),
                                   "MPI_Allgather");
    std::fill_n(tables.data(), n, Scalar(0));
    for (int r = 0; r < cs.size; ++r)
      for (std::size_t e = 0; e < n; ++e) tables.data()[e] += all[static_cast<std::size_t>(r) * n + e];
  }
  int lost[2] = {status.unlisted_table ? 1 : 0, status.too_many_reads ? 1 : 0};
  if (o.program != nullptr)
    distributed::detail::check_mpi(MPI_Allreduce(MPI_IN_PLACE, lost, 2, MPI_INT, MPI_MAX, comm), "MPI_Allreduce");
  status.unlisted_table = lost[0] != 0;
  status.too_many_reads = lost[1] != 0;
  g.tables = tables.finish(status, where);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (stats_out != nullptr) *stats_out = stats;
  return g;
}

SDPA_NAMESPACE_END
