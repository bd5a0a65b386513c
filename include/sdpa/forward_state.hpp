// sdpa::ForwardState: what ScaledDotProductAttention::backward needs from one forward call, at O(N)
// memory: copies of the inputs, their projections, the attention output before fc_o, each row's
// log-sum-exp, the options and the dropout draw (seed, call index, rate). Never the probabilities: the
// backward pass recomputes them tile by tile from the log-sum-exp (FlashAttention 2) and replays the dropout
// from the counter-based sampler. The mask, weights and bias tensors the options point to are not copied:
// they must stay alive, unchanged, until backward.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <cstdint>
#include <vector>

#include "sdpa/attention/saved.hpp"
#include "sdpa/detail/buffer.hpp"
#include "sdpa/options.hpp"
#include "sdpa/random.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class ScaledDotProductAttention;

template <typename Scalar>
class ForwardState {
 public:
  using Index = Eigen::Index;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;

  ForwardState() = default;
  ForwardState(ForwardState&&) noexcept = default;
  ForwardState& operator=(ForwardState&&) noexcept = default;
  ForwardState(const ForwardState&) = delete;  // megabytes of buffers: move it, or run forward again
  ForwardState& operator=(const ForwardState&) = delete;

  // Whether a forward has filled it.
  bool empty() const noexcept { return module_id_ == 0; }
  Index batch() const noexcept { return batch_; }
  Index nq() const noexcept { return nq_; }
  Index nk() const noexcept { return nk_; }

 private:
  friend class ScaledDotProductAttention<Scalar>;

  std::uint64_t module_id_ = 0;  // which module ran the forward (0: none)
  Index batch_ = 0, nq_ = 0, nk_ = 0;
  bool kv_same_ = false, qk_same_ = false;  // which inputs were one tensor
  Tensor3 queries_, keys_, values_;         // copies of the distinct inputs
  detail::Buffer<Scalar> qkv_, kv_;         // the projections, as forward laid them out
  const Scalar *q_ = nullptr, *k_ = nullptr, *v_ = nullptr;
  Index ldq_ = 0, ldk_ = 0, ldv_ = 0;
  detail::Buffer<Scalar> att_;              // (batch * nq, h * d_v): the attention output before fc_o (and the gate)
  detail::Buffer<Scalar> pre_q_, pre_k_;    // with a QK-norm: the projected q (h * d_k) and k rows before it
  detail::Buffer<Scalar> gate_, gated_;     // with an output gate: sigmoid(fc_g(queries)), and att_ times it
  // The options, each row's log-sum-exp (batch, h, nq), the dropout draw and the module's products' type
  // in the forward (set_compute): what every backward keeps (sdpa/attention/saved.hpp).
  detail::SavedAttention<Scalar> saved_;
};

SDPA_NAMESPACE_END
