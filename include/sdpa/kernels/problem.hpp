// The attention core's input as every kernel sees it: projected q, k, v in (batch, seq, heads * dim)
// row-major memory addressed through strides (so a fused QKV buffer or a caller's tensor serves without a
// copy), the broadcast mask and weights, the masked-row policy and the dropout draw. The module fills it
// after validating the arguments; kernels trust it.
#pragma once

#include "sdpa/detail/eigen.hpp"

#include "sdpa/mask.hpp"
#include "sdpa/random.hpp"

namespace sdpa {

// What a query whose every key is masked gets: zero attention output (PyTorch's SDPA since 2.5, ggml,
// CTranslate2), or NaN as the original module's softmax over -inf gives.
enum class MaskedRows { kZero, kNaN };

namespace kernels {

// Rows of one projected tensor: head h of row i of batch b starts at
// data + b * batch_stride + i * row_stride + h * head_dim.
template <typename T>
struct Heads {
  T* data = nullptr;
  Eigen::Index batch_stride = 0;
  Eigen::Index row_stride = 0;
  Eigen::Index head_dim = 0;

  T* row(Eigen::Index b, Eigen::Index h, Eigen::Index i) const noexcept {
    return data + b * batch_stride + i * row_stride + h * head_dim;
  }
};

template <typename Scalar>
struct AttentionProblem {
  Eigen::Index batch = 0, heads = 0, nq = 0, nk = 0, d_k = 0, d_v = 0;
  Heads<const Scalar> q, k, v;
  Heads<Scalar> out;  // (batch, nq, heads * d_v)
  Scalar scale = Scalar(1);  // 1 / sqrt(d_k)
  BroadcastView<bool> mask;
  BroadcastView<Scalar> weights;
  MaskedRows masked_rows = MaskedRows::kZero;
  bool dropout = false;            // training mode with p > 0
  DropoutSampler sampler{0, 0, 0.0};
  Scalar keep_scale = Scalar(1);   // 1 / (1 - p); 0 when p = 1
};

}  // namespace kernels
}  // namespace sdpa
