// A block-sparse plan for programmable attention (sdpa/flex.hpp): which key blocks each query block of a
// call sees, as FlexAttention's BlockMask. Per (batch entry or 1, head or 1, query block, key block) it
// records one of three states: none (the mask function hides every pair: the kernels skip the block),
// partly (the mask function is evaluated on it) or fully visible (it is not evaluated). Query blocks are
// counted by query index (0 .. nq - 1), key blocks by key index; the mask functions themselves receive the
// query's position among the keys, q + nk - nq.
//
// A plan is exact or conservative: "none" and "full" must be true of every pair of the block; "partly" is
// always safe. The kernels' tiles need not match the plan's blocks: a tile takes the state of the plan
// blocks it overlaps (none when all are none, full when all are full, partly otherwise), so a plan gives
// the same bits as no plan.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sdpa/error.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN

enum class BlockState : std::uint8_t { kNone = 0, kPartial = 1, kFull = 2 };

class BlockMask {
 public:
  using Index = Eigen::Index;

  BlockMask() = default;
  // Every block "partly" visible (the safe plan) for a call of `batch` entries (or 1: the same for all),
  // `heads` query heads (or 1), nq queries and nk keys, in blocks of q_block queries and k_block keys.
  BlockMask(Index batch, Index heads, Index nq, Index nk, Index q_block = 128, Index k_block = 128)
      : batch_(batch), heads_(heads), nq_(nq), nk_(nk), q_block_(q_block), k_block_(k_block) {
    const char* where = "BlockMask";
    if (batch < 1) detail::throw_invalid(where, "batch", "at least 1 (1: every batch entry alike)", batch);
    if (heads < 1) detail::throw_invalid(where, "heads", "at least 1 (1: every head alike)", heads);
    if (nq < 0) detail::throw_invalid(where, "nq", "non-negative", nq);
    if (nk < 0) detail::throw_invalid(where, "nk", "non-negative", nk);
    if (q_block < 1) detail::throw_invalid(where, "q_block", "positive", q_block);
    if (k_block < 1) detail::throw_invalid(where, "k_block", "positive", k_block);
    qb_ = (nq + q_block - 1) / q_block;
    kb_ = (nk + k_block - 1) / k_block;
    states_.assign(static_cast<std::size_t>(batch * heads * qb_ * kb_), BlockState::kPartial);
  }

  Index batch() const noexcept { return batch_; }
  Index heads() const noexcept { return heads_; }
  Index nq() const noexcept { return nq_; }
  Index nk() const noexcept { return nk_; }
  Index q_block() const noexcept { return q_block_; }
  Index k_block() const noexcept { return k_block_; }
  Index q_blocks() const noexcept { return qb_; }
  Index k_blocks() const noexcept { return kb_; }
  bool empty() const noexcept { return batch_ == 0; }  // default-constructed: no plan

  // The state of key block kb for query block qb of (b, h); b and h are taken modulo a broadcast 1.
  BlockState at(Index b, Index h, Index qb, Index kb) const noexcept { return states_[offset(b, h, qb, kb)]; }
  void set(Index b, Index h, Index qb, Index kb, BlockState s) noexcept { states_[offset(b, h, qb, kb)] = s; }

  // The state of the rectangle of queries [q0, q1) and keys [k0, k1) (non-empty, inside the call): none when
  // every plan block it overlaps is none, full when every one is full, partly otherwise.
  BlockState covering(Index b, Index h, Index q0, Index q1, Index k0, Index k1) const noexcept {
    const Index qa = q0 / q_block_, qz = (q1 - 1) / q_block_, ka = k0 / k_block_, kz = (k1 - 1) / k_block_;
    bool all_none = true, all_full = true;
    for (Index qb = qa; qb <= qz; ++qb) {
      const BlockState* row = &states_[offset(b, h, qb, 0)];
      for (Index kb = ka; kb <= kz; ++kb) {
        all_none = all_none && row[kb] == BlockState::kNone;
        all_full = all_full && row[kb] == BlockState::kFull;
      }
    }
    return all_none ? BlockState::kNone : all_full ? BlockState::kFull : BlockState::kPartial;
  }

  // Blocks of each state over the whole plan, and the fraction of pairs a kernel skips.
  Index count(BlockState s) const noexcept {
    return static_cast<Index>(std::count(states_.begin(), states_.end(), s));
  }
  double sparsity() const noexcept {
    return states_.empty() ? 0.0 : static_cast<double>(count(BlockState::kNone)) / static_cast<double>(states_.size());
  }

  // Refuses a plan that does not describe a call of this shape (where: the function that asks).
  void check(const char* where, Index batch, Index heads, Index nq, Index nk) const {
    if (batch_ != 1 && batch_ != batch)
      detail::throw_invalid(where, "the BlockMask's batch", detail::concat("1 or the call's batch ", batch), batch_);
    if (heads_ != 1 && heads_ != heads)
      detail::throw_invalid(where, "the BlockMask's heads", detail::concat("1 or the call's query heads ", heads), heads_);
    if (nq_ != nq) detail::throw_invalid(where, "the BlockMask's nq", detail::concat("the call's queries ", nq), nq_);
    if (nk_ != nk) detail::throw_invalid(where, "the BlockMask's nk", detail::concat("the call's keys ", nk), nk_);
  }

  // Both plans' blocks visible (and of masks: both functions); the plans must be of one shape and blocks
  // (a broadcast 1 meets a full batch or head count).
  friend BlockMask operator&(const BlockMask& a, const BlockMask& b) { return combine(a, b, /*both=*/true); }
  // Either plan's blocks visible (or of masks).
  friend BlockMask operator|(const BlockMask& a, const BlockMask& b) { return combine(a, b, /*both=*/false); }

  friend bool operator==(const BlockMask& a, const BlockMask& b) noexcept {
    return a.batch_ == b.batch_ && a.heads_ == b.heads_ && a.nq_ == b.nq_ && a.nk_ == b.nk_ &&
           a.q_block_ == b.q_block_ && a.k_block_ == b.k_block_ && a.states_ == b.states_;
  }

 private:
  std::size_t offset(Index b, Index h, Index qb, Index kb) const noexcept {
    const Index bb = batch_ == 1 ? 0 : b, hh = heads_ == 1 ? 0 : h;
    return static_cast<std::size_t>(((bb * heads_ + hh) * qb_ + qb) * kb_ + kb);
  }

  static BlockMask combine(const BlockMask& a, const BlockMask& b, bool both) {
    const char* where = both ? "BlockMask operator&" : "BlockMask operator|";
    if (a.nq_ != b.nq_ || a.nk_ != b.nk_)
      detail::throw_invalid(where, "the second plan's (nq, nk)", detail::concat("the first's (", a.nq_, ", ", a.nk_, ")"),
                            detail::concat("(", b.nq_, ", ", b.nk_, ")"));
    if (a.q_block_ != b.q_block_ || a.k_block_ != b.k_block_)
      detail::throw_invalid(where, "the second plan's blocks (q_block, k_block)",
                            detail::concat("the first's (", a.q_block_, ", ", a.k_block_, ")"),
                            detail::concat("(", b.q_block_, ", ", b.k_block_, ")"));
    if (a.batch_ != b.batch_ && a.batch_ != 1 && b.batch_ != 1)
      detail::throw_invalid(where, "the second plan's batch", detail::concat("1 or the first's ", a.batch_), b.batch_);
    if (a.heads_ != b.heads_ && a.heads_ != 1 && b.heads_ != 1)
      detail::throw_invalid(where, "the second plan's heads", detail::concat("1 or the first's ", a.heads_), b.heads_);
    BlockMask r(std::max(a.batch_, b.batch_), std::max(a.heads_, b.heads_), a.nq_, a.nk_, a.q_block_, a.k_block_);
    for (Index bb = 0; bb < r.batch_; ++bb)
      for (Index h = 0; h < r.heads_; ++h)
        for (Index qb = 0; qb < r.qb_; ++qb)
          for (Index kb = 0; kb < r.kb_; ++kb) {
            const BlockState x = a.at(bb, h, qb, kb), y = b.at(bb, h, qb, kb);
            BlockState s;
            if (both) {
              s = x == BlockState::kNone || y == BlockState::kNone ? BlockState::kNone
                  : x == BlockState::kFull && y == BlockState::kFull ? BlockState::kFull
                                                                       : BlockState::kPartial;
            } else {
              s = x == BlockState::kFull || y == BlockState::kFull ? BlockState::kFull
                  : x == BlockState::kNone && y == BlockState::kNone ? BlockState::kNone
                                                                       : BlockState::kPartial;
            }
            r.set(bb, h, qb, kb, s);
          }
    return r;
  }

  Index batch_ = 0, heads_ = 0, nq_ = 0, nk_ = 0, q_block_ = 128, k_block_ = 128, qb_ = 0, kb_ = 0;
  std::vector<BlockState> states_;
};

// The exact plan of a mask function visible(b, h, q', k) (q' = q + nk - nq): every pair evaluated, in
// parallel over the blocks on `device`. batch or heads 1 when the function does not read b or h (then it is
// called with 0).
template <typename Visible>
BlockMask block_mask_from(const Visible& visible, Eigen::Index batch, Eigen::Index heads, Eigen::Index nq,
                          Eigen::Index nk, Eigen::Index q_block = 128, Eigen::Index k_block = 128,
                          const Eigen::ThreadPoolDevice* device = nullptr) {
  using Index = Eigen::Index;
  BlockMask plan(batch, heads, nq, nk, q_block, k_block);
  const Index qbs = plan.q_blocks(), kbs = plan.k_blocks(), offset = nk - nq;
  const Index n = batch * heads * qbs;
  parallel_for(device, n, balanced_grain(device, n, 4), [&](Index u0, Index u1) {
    for (Index u = u0; u < u1; ++u) {
      const Index qb = u % qbs, bh = u / qbs, b = bh / heads, h = bh % heads;
      const Index q0 = qb * q_block, q1 = std::min(nq, q0 + q_block);
      for (Index kb = 0; kb < kbs; ++kb) {
        const Index k0 = kb * k_block, k1 = std::min(nk, k0 + k_block);
        Index seen = 0;
        for (Index q = q0; q < q1; ++q)
          for (Index k = k0; k < k1; ++k) seen += visible(b, h, q + offset, k) ? 1 : 0;
        const Index pairs = (q1 - q0) * (k1 - k0);
        plan.set(b, h, qb, kb, seen == 0 ? BlockState::kNone : seen == pairs ? BlockState::kFull : BlockState::kPartial);
      }
    }
  });
  return plan;
}

SDPA_NAMESPACE_END
