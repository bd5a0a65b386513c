// Ring attention's internals (sdpa/distributed/ring_attention.hpp): one rank's plan of the ring (its rows in
// chunks, its messages, its query blocks), the channel that moves key/value blocks around the ring with
// MPI, and the forward and backward passes that run sdpa's kernels on each block as it passes and merge the
// blocks by their log-sum-exp.
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
#include "sdpa/kernels/backward.hpp"
#include "sdpa/rotary.hpp"
#include "sdpa/distributed/ring_layout.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class RingState;

namespace distributed {
namespace detail {

using Index = Eigen::Index;
constexpr int kDepth = 4;       // message buffers per rank: how far a rank may run ahead of the next
constexpr int kRingTag = 0x5d9a;

// One rank's view of the ring: its rows in chunks, the messages its rows are cut into (in the order it
// injects them), and the query blocks it runs the kernel on.
struct RingPlan {
  struct Rows {
    Index local0 = 0, rows = 0;
  };
  RingLayout layout = RingLayout::kContiguous;
  int rank = 0, ranks = 1;
  Index n = 0;          // local rows
  Index block = 0;      // rows per message buffer
  std::vector<Rows> messages, queries;

  Index global(int owner, Index local) const noexcept { return ring_position(layout, owner, ranks, n, local); }
  Index steps() const noexcept { return static_cast<Index>(messages.size()) * ranks; }
  // Message and owner of step i: message i / P of rank r - i % P.
  const Rows& message(Index i) const noexcept { return messages[static_cast<std::size_t>(i / ranks)]; }
  int owner(Index i) const noexcept { return static_cast<int>(((rank - i % ranks) % ranks + ranks) % ranks); }
  bool injects(Index i) const noexcept { return i % ranks == 0; }
};

inline RingPlan make_plan(RingLayout layout, int rank, int ranks, Index n, Index block_rows) {
  RingPlan plan;
  plan.layout = layout;
  plan.rank = rank;
  plan.ranks = ranks;
  plan.n = n;
  const Index chunks = layout == RingLayout::kZigZag ? 2 : 1, chunk = n / chunks;
  plan.block = std::max<Index>(1, std::min(chunk, block_rows > 0 ? block_rows : Index{1024}));
  const Index query_block = 4 * plan.block;
  // Zigzag: the chunks' pieces interleaved (early 0, late 0, early 1, ...), so that each stretch of the
  // schedule holds about the same causal work on every rank.
  const auto cut = [&](Index size, std::vector<RingPlan::Rows>& into) {
    const Index per = chunk == 0 ? 0 : (chunk + size - 1) / size;
    for (Index j = 0; j < per; ++j)
      for (Index c = 0; c < chunks; ++c) {
        const Index lo = c * chunk + j * size;
        into.push_back({lo, std::min(size, (c + 1) * chunk - lo)});
      }
  };
  cut(plan.block, plan.messages);
  cut(query_block, plan.queries);
  return plan;
}

// Message buffers and their requests: step i uses buffer i % kDepth, received from rank - 1 and sent to
// rank + 1. A buffer is reused only once its last send has completed.
template <typename Scalar>
class RingChannel {
 public:
  RingChannel(MPI_Comm comm, const RingPlan& plan, std::size_t count, RingStats& stats)
      : comm_(comm), count_(count), stats_(stats), next_((plan.rank + 1) % plan.ranks),
        prev_((plan.rank + plan.ranks - 1) % plan.ranks) {
    for (auto& b : buffers_) b.reset(count);
    sends_.fill(MPI_REQUEST_NULL);
    recvs_.fill(MPI_REQUEST_NULL);
  }
  RingChannel(const RingChannel&) = delete;
  RingChannel& operator=(const RingChannel&) = delete;
  ~RingChannel() {
    // Only after an exception between posting and waiting: complete what is pending so that MPI does
    // not write into freed memory (the peers' matching calls were made by the same schedule).
    for (std::size_t s = 0; s < kDepth; ++s) {
      if (recvs_[s] != MPI_REQUEST_NULL) MPI_Wait(&recvs_[s], MPI_STATUS_IGNORE);
      if (sends_[s] != MPI_REQUEST_NULL) MPI_Wait(&sends_[s], MPI_STATUS_IGNORE);
    }
  }

  Scalar* buffer(Index step) noexcept { return buffers_[slot(step)].data(); }
  // The buffer of `step`, free to write (its previous send completed).
  Scalar* acquire(Index step) {
    wait(sends_[slot(step)]);
    return buffer(step);
  }
  void post_receive(Index step) {
    const std::size_t s = slot(step);
    wait(sends_[s]);
    check_mpi(MPI_Irecv(buffers_[s].data(), static_cast<int>(count_), mpi_type<Scalar>(), prev_, kRingTag, comm_, &recvs_[s]),
              "MPI_Irecv");
  }
  void receive(Index step) { wait(recvs_[slot(step)]); }
  void send(Index step) {
    const std::size_t s = slot(step);
    check_mpi(MPI_Isend(buffers_[s].data(), static_cast<int>(count_), mpi_type<Scalar>(), next_, kRingTag, comm_, &sends_[s]),
              "MPI_Isend");
    stats_.messages += 1;
    stats_.bytes += static_cast<std::int64_t>(count_ * sizeof(Scalar));
  }
  // Lets MPI progress the transfers in flight (a rendezvous transfer moves only inside MPI calls).
  void progress() {
    int flag = 0;
    for (std::size_t s = 0; s < kDepth; ++s) {
      if (recvs_[s] != MPI_REQUEST_NULL) MPI_Test(&recvs_[s], &flag, MPI_STATUS_IGNORE);
      if (sends_[s] != MPI_REQUEST_NULL) MPI_Test(&sends_[s], &flag, MPI_STATUS_IGNORE);
    }
  }
  void finish() {
    for (std::size_t s = 0; s < kDepth; ++s) {
      wait(recvs_[s]);
      wait(sends_[s]);
    }
  }

 private:
  static std::size_t slot(Index step) noexcept { return static_cast<std::size_t>(step % kDepth); }
  void wait(MPI_Request& r) {
    if (r == MPI_REQUEST_NULL) return;
    const auto t0 = std::chrono::steady_clock::now();
    check_mpi(MPI_Wait(&r, MPI_STATUS_IGNORE), "MPI_Wait");
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  MPI_Comm comm_;
  std::size_t count_;
  RingStats& stats_;
  int next_, prev_;
  std::array<::sdpa::detail::Buffer<Scalar>, kDepth> buffers_;
  std::array<MPI_Request, kDepth> sends_{}, recvs_{};
};

// A checked ring call as the forward and the backward run it.
template <typename Scalar>
struct RingCall {
  RingPlan plan;
  ::sdpa::detail::CallShape shape;  // nq = nk = the local rows
  const AttentionOptions<Scalar>* options = nullptr;
  const Rotary* rotary = nullptr;
  kernels::Heads<const Scalar> q, k, v;  // local rows; q already rotated, k rotated while packed
  MPI_Comm comm = MPI_COMM_NULL;

  Index kv_heads() const noexcept { return shape.kv_heads; }
  // Elements of a message: k then v, each (batch, kv_heads, block, d) (then dk and dv for the backward).
  Index k_size() const noexcept { return shape.batch * shape.kv_heads * plan.block * shape.d_k; }
  Index v_size() const noexcept { return shape.batch * shape.kv_heads * plan.block * shape.d_v; }
  kernels::Heads<Scalar> k_of(Scalar* m) const noexcept {
    return {m, shape.kv_heads * plan.block * shape.d_k, shape.d_k, plan.block * shape.d_k};
  }
  kernels::Heads<Scalar> v_of(Scalar* m) const noexcept {
    return {m + k_size(), shape.kv_heads * plan.block * shape.d_v, shape.d_v, plan.block * shape.d_v};
  }

  // Copies this rank's message j into m: its k rows rotated at their global positions, its v rows.
  void pack(const RingPlan::Rows& rows, Scalar* m) const {
    const kernels::Heads<Scalar> km = k_of(m), vm = v_of(m);
    for (Index b = 0; b < shape.batch; ++b)
      for (Index h = 0; h < shape.kv_heads; ++h)
        for (Index i = 0; i < rows.rows; ++i) {
          std::copy_n(k.row(b, h, rows.local0 + i), shape.d_k, km.row(b, h, i));
          std::copy_n(v.row(b, h, rows.local0 + i), shape.d_v, vm.row(b, h, i));
        }
    if (rotary != nullptr)
      for (Index b = 0; b < shape.batch; ++b)
        apply_rotary(*rotary,
                     RotaryRows(km.row(b, 0, 0), rows.rows, km.row_stride, shape.kv_heads, km.head_stride, shape.d_k),
                     plan.global(plan.rank, rows.local0));
  }

  // Whether any query of block `qb` (this rank's) can see any key of message `kb` of rank `owner`; and the
  // kernel problem of the pair, with the keys' global offset and their own key lengths.
  bool visible(const RingPlan::Rows& qb, const RingPlan::Rows& kb, int owner) const {
    const AttentionOptions<Scalar>& o = *options;
    const Index q0 = plan.global(plan.rank, qb.local0), q1 = q0 + qb.rows - 1;
    const Index k0 = plan.global(owner, kb.local0), k1 = k0 + kb.rows - 1;
    if (qb.rows == 0 || kb.rows == 0) return false;
    if (o.causal && k0 > q1) return false;
    if (o.window_right >= 0 && k0 - q1 > o.window_right) return false;
    if (o.window_left >= 0 && q0 - k1 > o.window_left) return false;
    if (!o.key_lengths.empty() && *std::max_element(o.key_lengths.begin(), o.key_lengths.end()) <= k0) return false;
    return true;
  }
  kernels::AttentionProblem<Scalar> problem(const RingPlan::Rows& qb, const RingPlan::Rows& kb, int owner, Scalar* m,
                                            std::vector<Index>& key_lengths) const {
    const AttentionOptions<Scalar>& o = *options;
    ::sdpa::detail::CallShape c = shape;
    c.nq = qb.rows;
    c.nk = kb.rows;
    const Index q0 = plan.global(plan.rank, qb.local0), k0 = plan.global(owner, kb.local0);
    kernels::AttentionProblem<Scalar> p = ::sdpa::detail::problem_of(c, o, MaskedRows::kZero, o.causal, q0 - k0);
    p.key_base = k0;  // a score program sees global positions
    p.probabilities = nullptr;
    p.sinks = nullptr;  // added once, after the merge
    if (!o.key_lengths.empty()) {
      key_lengths.resize(o.key_lengths.size());
      for (std::size_t b = 0; b < key_lengths.size(); ++b) key_lengths[b] = std::clamp<Index>(o.key_lengths[b] - k0, 0, kb.rows);
      p.key_lengths = key_lengths.data();
    }
    p.q = q;
    p.q.data = q.row(0, 0, qb.local0);
    const kernels::Heads<Scalar> km = k_of(m), vm = v_of(m);
    p.k = {km.data, km.batch_stride, km.row_stride, km.head_stride};
    p.v = {vm.data, vm.batch_stride, vm.row_stride, vm.head_stride};
    return p;
  }
};

// The forward on every rank: out (q's layout, d_v features) and lse (batch, heads, n), sinks included.
template <typename Scalar>
void ring_forward(const RingCall<Scalar>& call, const kernels::Heads<Scalar>& out, Scalar* lse, RingStats& stats) {
  const RingPlan& plan = call.plan;
  const ::sdpa::detail::CallShape& c = call.shape;
  const AttentionOptions<Scalar>& o = *call.options;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  // The log-sum-exp arithmetic of the merges and the sink in double for float, each result rounded once (as
  // SoftmaxRow::log_sum_exp rounds the blocks' own).
  using Wide = kernels::LseWide<Scalar>;
  const Index rows_bh = c.batch * c.heads;
  std::fill_n(lse, rows_bh * c.nq, kNegInf);
  for (Index b = 0; b < c.batch; ++b)
    for (Index h = 0; h < c.heads; ++h)
      for (Index i = 0; i < c.nq; ++i) std::fill_n(out.row(b, h, i), c.d_v, Scalar(0));

  Index max_q = 0;
  for (const auto& qb : plan.queries) max_q = std::max(max_q, qb.rows);
  std::vector<Scalar> part(static_cast<std::size_t>(rows_bh * max_q * c.d_v)), part_lse(static_cast<std::size_t>(rows_bh * max_q));
  std::vector<Index> key_lengths;
  RingChannel<Scalar> channel(call.comm, plan, static_cast<std::size_t>(call.k_size() + call.v_size()), stats);
  const Index steps = plan.steps();
  for (Index i = 0; i < steps; ++i) {
    const RingPlan::Rows& kb = plan.message(i);
    const int owner = plan.owner(i);
    Scalar* m = nullptr;
    if (plan.injects(i)) {
      m = channel.acquire(i);
      call.pack(kb, m);
    } else {
      channel.receive(i);
      m = channel.buffer(i);
    }
    if (i % plan.ranks != plan.ranks - 1) channel.send(i);
    if (i + 1 < steps && !plan.injects(i + 1)) channel.post_receive(i + 1);
    for (const auto& qb : plan.queries) {
      if (!call.visible(qb, kb, owner)) continue;
      kernels::AttentionProblem<Scalar> p = call.problem(qb, kb, owner, m, key_lengths);
      p.out = {part.data(), c.heads * qb.rows * c.d_v, c.d_v, qb.rows * c.d_v};
      p.lse = part_lse.data();
      ::sdpa::detail::run_attention(p, o.kernel, static_cast<kernels::DecodeWorkspace<Scalar>*>(nullptr), o.device);
      channel.progress();
      // Merge the block's normalized rows into the running ones by their log-sum-exp.
      for (Index b = 0; b < c.batch; ++b)
        for (Index h = 0; h < c.heads; ++h)
          for (Index r = 0; r < qb.rows; ++r)
            kernels::merge_normalized_row(out.row(b, h, qb.local0 + r), lse[(b * c.heads + h) * c.nq + qb.local0 + r],
                                          p.out.row(b, h, r),
                                          part_lse[static_cast<std::size_t>((b * c.heads + h) * qb.rows + r)], c.d_v);
    }
  }
  channel.finish();
  // The sinks: one more logit per row, whose value is zero.
  if (!o.sinks.empty())
    for (Index b = 0; b < c.batch; ++b)
      for (Index h = 0; h < c.heads; ++h) {
        const Scalar sink = o.sinks[static_cast<std::size_t>(h)];
        for (Index r = 0; r < c.nq; ++r) {
          Scalar& la = lse[(b * c.heads + h) * c.nq + r];
          if (la == kNegInf) {
            la = sink;  // every key hidden: all weight on the sink, output 0
            continue;
          }
          const Wide mx = std::max<Wide>(la, sink), total = mx + std::log(std::exp(la - mx) + std::exp(sink - mx));
          const Scalar f = static_cast<Scalar>(std::exp(la - total));
          Scalar* orow = out.row(b, h, r);
          for (Index d = 0; d < c.d_v; ++d) orow[d] *= f;
          la = static_cast<Scalar>(total);
        }
      }
}

// The backward on every rank: dq (q's layout, rotated space), dk and dv (k's and v's layouts, dk in rotated
// space), d_sinks (this rank's share) from the forward's out and lse.
// A score program's tables: this rank's share of their gradients added to d_tables (tables.size()
// elements), and what its backward could not do in status.
template <typename Scalar>
struct RingGradients {
  kernels::Heads<Scalar> q, k, v;
  Scalar* sinks = nullptr;
  ::sdpa::detail::ProgramTables<Scalar>* tables = nullptr;
  kernels::BackwardStatus* status = nullptr;
};

template <typename Scalar>
void ring_backward(const RingCall<Scalar>& call, const kernels::Heads<const Scalar>& out, const Scalar* lse,
                   const kernels::Heads<const Scalar>& d_out, const RingGradients<Scalar>& grads, RingStats& stats) {
  const kernels::Heads<Scalar>&d_q = grads.q, &d_k = grads.k, &d_v = grads.v;
  Scalar* d_sinks = grads.sinks;
  ::sdpa::detail::ProgramTables<Scalar>* tables = grads.tables;
  kernels::BackwardStatus* status = grads.status;
  const RingPlan& plan = call.plan;
  const ::sdpa::detail::CallShape& c = call.shape;
  const AttentionOptions<Scalar>& o = *call.options;
  const Index kvh = c.kv_heads;
  for (Index b = 0; b < c.batch; ++b)
    for (Index i = 0; i < c.nq; ++i) {
      for (Index h = 0; h < c.heads; ++h) std::fill_n(d_q.row(b, h, i), c.d_k, Scalar(0));
      for (Index h = 0; h < kvh; ++h) {
        std::fill_n(d_k.row(b, h, i), c.d_k, Scalar(0));
        std::fill_n(d_v.row(b, h, i), c.d_v, Scalar(0));
      }
    }
  Index max_q = 0;
  for (const auto& qb : plan.queries) max_q = std::max(max_q, qb.rows);
  std::vector<Scalar> dq(static_cast<std::size_t>(c.batch * c.heads * max_q * c.d_k)),
      dk(static_cast<std::size_t>(call.k_size())), dv(static_cast<std::size_t>(call.v_size())),
      block_lse(static_cast<std::size_t>(c.batch * c.heads * max_q));
  std::vector<Index> key_lengths;
  const Index ks = call.k_size(), vs = call.v_size();
  // A message: k, v, then the dk and dv accumulated by the ranks it has visited.
  RingChannel<Scalar> channel(call.comm, plan, static_cast<std::size_t>(2 * (ks + vs)), stats);
  const auto grads_of = [&](Scalar* m) {
    return std::make_pair(kernels::Heads<Scalar>{m + ks + vs, kvh * plan.block * c.d_k, c.d_k, plan.block * c.d_k},
                          kernels::Heads<Scalar>{m + 2 * ks + vs, kvh * plan.block * c.d_v, c.d_v, plan.block * c.d_v});
  };
  // Rank r's message j back from its tour: its dk and dv rows are final.
  const auto store = [&](Index j, Scalar* m) {
    const RingPlan::Rows& kb = plan.messages[static_cast<std::size_t>(j)];
    const auto g = grads_of(m);
    for (Index b = 0; b < c.batch; ++b)
      for (Index h = 0; h < kvh; ++h)
        for (Index i = 0; i < kb.rows; ++i) {
          std::copy_n(g.first.row(b, h, i), c.d_k, d_k.row(b, h, kb.local0 + i));
          std::copy_n(g.second.row(b, h, i), c.d_v, d_v.row(b, h, kb.local0 + i));
        }
  };
  const Index steps = plan.steps();
  for (Index i = 0; i < steps; ++i) {
    const RingPlan::Rows& kb = plan.message(i);
    const int owner = plan.owner(i);
    Scalar* m = nullptr;
    if (i > 0) channel.receive(i);
    if (plan.injects(i)) {
      if (i > 0) store(i / plan.ranks - 1, channel.buffer(i));
      m = channel.acquire(i);
      call.pack(kb, m);
      std::fill_n(m + ks + vs, ks + vs, Scalar(0));
    } else {
      m = channel.buffer(i);
    }
    channel.post_receive(i + 1);  // what rank - 1 sends at the end of step i (after the last: a message home)
    const auto g = grads_of(m);
    for (const auto& qb : plan.queries) {
      if (!call.visible(qb, kb, owner)) continue;
      kernels::AttentionProblem<Scalar> p = call.problem(qb, kb, owner, m, key_lengths);
      p.out = {const_cast<Scalar*>(out.data), out.batch_stride, out.row_stride, out.head_stride};
      p.out.data = const_cast<Scalar*>(out.row(0, 0, qb.local0));
      for (Index bh = 0; bh < c.batch * c.heads; ++bh)
        std::copy_n(lse + bh * c.nq + qb.local0, qb.rows, block_lse.data() + bh * qb.rows);
      p.lse = block_lse.data();
      kernels::BackwardProblem<Scalar> bp;
      bp.forward = &p;
      bp.d_out = d_out;
      bp.d_out.data = d_out.row(0, 0, qb.local0);
      bp.d_q = {dq.data(), c.heads * qb.rows * c.d_k, c.d_k, qb.rows * c.d_k};
      bp.d_k = {dk.data(), kvh * plan.block * c.d_k, c.d_k, plan.block * c.d_k};
      bp.d_v = {dv.data(), kvh * plan.block * c.d_v, c.d_v, plan.block * c.d_v};
      std::vector<Scalar> block_tables(tables != nullptr ? static_cast<std::size_t>(tables->size()) : 0);
      if (!block_tables.empty()) bp.d_tables = block_tables.data();
      const kernels::BackwardStatus st = ::sdpa::detail::run_attention_backward(bp, o.kernel, o.device);
      if (status != nullptr) {
        status->unlisted_table = status->unlisted_table || st.unlisted_table;
        status->too_many_reads = status->too_many_reads || st.too_many_reads;
      }
      for (std::size_t e = 0; e < block_tables.size(); ++e) tables->data()[e] += block_tables[e];
      channel.progress();
      for (Index b = 0; b < c.batch; ++b) {
        for (Index h = 0; h < c.heads; ++h)
          for (Index r = 0; r < qb.rows; ++r) {
            const Scalar* from = bp.d_q.row(b, h, r);
            Scalar* to = d_q.row(b, h, qb.local0 + r);
            for (Index d = 0; d < c.d_k; ++d) to[d] += from[d];
          }
        for (Index h = 0; h < kvh; ++h)
          for (Index r = 0; r < kb.rows; ++r) {
            const Scalar* fk = bp.d_k.row(b, h, r);
            const Scalar* fv = bp.d_v.row(b, h, r);
            Scalar* tk = g.first.row(b, h, r);
            Scalar* tv = g.second.row(b, h, r);
            for (Index d = 0; d < c.d_k; ++d) tk[d] += fk[d];
            for (Index d = 0; d < c.d_v; ++d) tv[d] += fv[d];
          }
      }
    }
    channel.send(i);  // on to the next rank, or home to the owner after the last
  }
  if (steps > 0) {
    channel.receive(steps);
    store(steps / plan.ranks - 1, channel.buffer(steps));
  }
  channel.finish();
  // This rank's share of the sinks' gradient: -sum of p_sink * (dO . O) over its rows.
  if (d_sinks != nullptr)
    for (Index h = 0; h < c.heads; ++h) {
      Scalar sum = 0;
      const Scalar sink = o.sinks[static_cast<std::size_t>(h)];
      for (Index b = 0; b < c.batch; ++b)
        for (Index r = 0; r < c.nq; ++r) {
          const Scalar* orow = out.row(b, h, r);
          const Scalar* grow = d_out.row(b, h, r);
          Scalar delta = 0;
          for (Index d = 0; d < c.d_v; ++d) delta += grow[d] * orow[d];
          sum -= std::exp(sink - lse[(b * c.heads + h) * c.nq + r]) * delta;
        }
      d_sinks[h] = sum;
    }
}

// The fields every rank must pass alike, read without checking (a rank whose arguments are malformed
// reports its refusal through the agreement, with the same fields in number and order).
template <typename Scalar>
Fields ring_fields(const ::sdpa::detail::CallShape& c, const AttentionOptions<Scalar>& o, const RingOptions& ro) {
  Fields f;
  f.integer("ring layout", static_cast<std::int64_t>(ro.layout))
      .integer("block_rows", ro.block_rows)
      .integer("the batch", c.batch)
      .integer("the query heads", c.heads)
      .integer("the key/value heads", c.kv_heads)
      .integer("the local sequence rows of q", c.nq)
      .integer("the local sequence rows of k", c.nk)
      .integer("d_k", c.d_k)
      .integer("d_v", c.d_v)
      .integer("a score program (0: none, 1: set)", o.program != nullptr ? 1 : 0)
      .integer("the score program's tables", o.program != nullptr ? o.program->table_count() : 0);
  add_option_fields(f, o);
  return f;
}

// This rank's own checks of a ring call: the shapes as sdpa::attention checks them (the whole sequence's
// options against N = P n rows), self-attention rows, the options that have no ring form.
template <typename Scalar>
void check_ring(const ::sdpa::detail::CallShape& local, const std::array<Index, 4>& qd, const std::array<Index, 4>& kd,
                const std::array<Index, 4>& vd, const AttentionOptions<Scalar>& o, const RingOptions& ro, int ranks) {
  using ::sdpa::detail::concat;
  using ::sdpa::detail::throw_invalid;
  const char* where = local.where;
  const char* axes = o.layout == Layout::kBHND ? "(batch, heads, seq, dim)" : "(batch, seq, heads, dim)";
  if (o.rotary != nullptr && !o.rotary->long_inv_freq.empty())
    throw_invalid(where, "rotary.long_inv_freq", "empty (LongRoPE picks its frequencies per whole call, which no rank sees)",
                  concat(o.rotary->long_inv_freq.size(), " frequencies"));
  const int seq_axis = o.layout == Layout::kBHND ? 2 : 1, head_axis = o.layout == Layout::kBHND ? 1 : 2;
  for (const auto& [name, d] : {std::make_pair("k", kd), std::make_pair("v", vd)})
    if (d[0] != qd[0])
      throw_invalid(where, concat(name, " dimension 0 (batch)"), concat(qd[0], ", the batch of q"), concat(d[0], " ", axes));
  if (kd[2] != qd[2] || vd[2] != qd[2])
    throw_invalid(where, concat(kd[2] != qd[2] ? "k" : "v", " dimension ", seq_axis, " (local rows)"),
                  concat(qd[2], ", the local rows of q (ring attention is self-attention: q, k and v hold the same rows)"),
                  kd[2] != qd[2] ? kd[2] : vd[2]);
  if (vd[1] != kd[1])
    throw_invalid(where, concat("v dimension ", head_axis, " (key/value heads)"), concat(kd[1], ", the heads of k"), vd[1]);
  if (kd[3] != qd[3]) throw_invalid(where, "k dimension 3 (d_k)", concat(qd[3], ", the d_k of q"), kd[3]);
  if (kd[1] <= 0 || qd[1] % kd[1] != 0)
    throw_invalid(where, concat("k dimension ", head_axis, " (key/value heads)"), concat("a positive divisor of the query heads, ", qd[1]),
                  kd[1]);
  if (ro.layout == RingLayout::kZigZag && qd[2] % 2 != 0)
    throw_invalid(where, concat("q dimension ", seq_axis, " (local rows)"), "even (kZigZag: two chunks per rank)", qd[2]);
  if (ro.block_rows < 0) throw_invalid(where, "ring options' block_rows", "0 (automatic) or positive", ro.block_rows);
  const char* refused = o.attention_mask != nullptr      ? "attention_mask"
                        : o.attention_weights != nullptr ? "attention_weights"
                        : o.attention_bias != nullptr    ? "attention_bias"
                        : o.probabilities != nullptr     ? "probabilities"
                        : o.log_sum_exp != nullptr       ? "log_sum_exp"
                        : o.packed()                     ? "cu_seqlens_q / cu_seqlens_k"
                                                         : nullptr;
  if (refused != nullptr) throw_invalid(where, refused, "unset in ring attention (it has no ring form)", "set");
  if (o.dropout != Scalar(0)) throw_invalid(where, "dropout", "0 in ring attention", o.dropout);
  if (o.masked_rows != MaskedRows::kZero)
    throw_invalid(where, "masked_rows", "MaskedRows::kZero in ring attention", "MaskedRows::kNaN");
  if (o.program != nullptr && o.program->has_plan())
    throw_invalid(where, "the score program's BlockMask", "none in ring attention (its blocks are the ring's)", "given");
  if (o.compute != Compute::kFloat)
    throw_invalid(where, "compute", "Compute::kFloat in ring attention (it has no bfloat16 form yet)", compute_name(o.compute));
  ::sdpa::detail::CallShape whole = local;
  whole.nq = whole.nk = local.nq * ranks;
  ::sdpa::detail::check_attention_options(whole, o, /*module_call=*/false);
}


template <typename Scalar>
Tensor4<Scalar> ring_impl(const ::sdpa::detail::Input4<Scalar>& qi, const ::sdpa::detail::Input4<Scalar>& ki,
                          const ::sdpa::detail::Input4<Scalar>& vi, const AttentionOptions<Scalar>& options, MPI_Comm comm,
                          const RingOptions& ro, RingState<Scalar>* state);

}  // namespace detail
}  // namespace distributed

SDPA_NAMESPACE_END
