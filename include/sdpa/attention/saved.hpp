// What every backward needs from its forward, whoever ran it (the module's ForwardState, sdpa::attention's
// AttentionState, ring attention's RingState hold one each): the call's shape, each row's log-sum-exp (from
// which the backward recomputes the probabilities, FlashAttention 2), the options without the
// probabilities, the rotary the forward applied (a copy: the caller's may be gone), the dropout draw
// (replayed, never stored as a mask) and the products' type. The saved tensors (q, k, v and the output as
// the kernel read them) stay with each state: the module keeps its projections' buffers, the functional
// core copies of its head tensors, ring attention its rank's shard.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <vector>

#include "sdpa/attention/checks.hpp"
#include "sdpa/compute.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/options.hpp"
#include "sdpa/random.hpp"
#include "sdpa/rotary.hpp"

SDPA_NAMESPACE_BEGIN
namespace detail {

template <typename Scalar>
struct SavedAttention {
  CallShape shape;
  std::vector<Scalar> lse;           // (batch, heads, nq)
  AttentionOptions<Scalar> options;  // probabilities, log_sum_exp and rotary null (the rotary is the copy below)
  Rotary rotary;
  bool has_rotary = false;
  bool dropout = false;
  DropoutSampler sampler{0, 0, 0.0};
  Scalar keep_scale = Scalar(1);
  Compute compute = Compute::kFloat;

  // The forward's options, kept for the backward.
  void keep_options(const AttentionOptions<Scalar>& o) {
    options = o;
    options.probabilities = nullptr;
    options.log_sum_exp = nullptr;
    options.rotary = nullptr;
    has_rotary = o.rotary != nullptr;
    if (has_rotary) rotary = *o.rotary;
  }
  // The forward problem's dropout draw.
  void keep_draw(const kernels::AttentionProblem<Scalar>& p) noexcept {
    dropout = p.dropout;
    sampler = p.sampler;
    keep_scale = p.keep_scale;
  }
  // A backward problem's log-sum-exp and dropout, as the forward had them (P: a problem with those fields).
  template <typename P>
  void replay(P& p) const noexcept {
    p.lse = const_cast<Scalar*>(lse.data());
    p.dropout = dropout;
    p.sampler = sampler;
    p.keep_scale = keep_scale;
  }
  const Rotary* rotary_or_null() const noexcept { return has_rotary ? &rotary : nullptr; }
};

}  // namespace detail
SDPA_NAMESPACE_END
