// The options of one attention call, as the forward, the cached decoding step and the backward pass take
// them: tensors that mask, multiply or add to the scores (each dimension 1 or full, broadcast without
// copies), the variants that need no tensor at all (causal, sliding windows, key lengths, ALiBi), where the
// probabilities go when a caller wants to see them, and the thread pool. Also the masked-row policy and the
// ALiBi paper's slopes.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <cmath>
#include <vector>

#include "sdpa/error.hpp"

SDPA_NAMESPACE_BEGIN

// What a query whose every key is hidden (by the mask, causal, a window or its key length) gets: zero
// attention output (PyTorch's SDPA since 2.5, ggml, CTranslate2), or NaN as the original module's softmax
// over -inf gives.
enum class MaskedRows { kZero, kNaN };

// Per score of (batch b, head h, query q, key k), with q' = q + (nk - nq) the query's position among the
// keys (lower-right alignment: FlashAttention 2, PyTorch's causal_lower_right; with a key/value cache,
// absolute positions):
//   s = (q . k) / sqrt(d_k);  s *= attention_weights;  s += attention_bias;  s -= alibi_slopes[h] * |q' - k|;
//   s = -inf where attention_mask, causal, the window or key_lengths hides k;  p = softmax(s);
//   probabilities = p;  p = dropout(p) in training mode;  out = p v.
// Windows do not imply causal (a decoder's sliding window is causal = true, window_left = W - 1) and each
// applies on its own side. A row whose every key is hidden follows the module's MaskedRows policy, in the
// output and in `probabilities`.
template <typename Scalar>
struct AttentionOptions {
  const Eigen::Tensor<bool, 4, Eigen::RowMajor>* attention_mask = nullptr;       // true = hidden
  const Eigen::Tensor<Scalar, 4, Eigen::RowMajor>* attention_weights = nullptr;  // multiplies
  const Eigen::Tensor<Scalar, 4, Eigen::RowMajor>* attention_bias = nullptr;     // added; dims 1 or full
  bool causal = false;                // key k hidden from query q when k > q'
  Eigen::Index window_left = -1;      // >= 0: key k hidden when k < q' - window_left
  Eigen::Index window_right = -1;     // >= 0: key k hidden when k > q' + window_right
  std::vector<Eigen::Index> key_lengths;  // empty, or one per batch entry: keys k >= key_lengths[b] hidden
  std::vector<Scalar> alibi_slopes;       // empty, or one per head: adds -slope[h] * |q' - k|
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor>* probabilities = nullptr;  // set: resized to (b, h, nq, nk), filled
  const Eigen::ThreadPoolDevice* device = nullptr;                    // nullptr: the calling thread
};

// The slopes of ALiBi (Press, Smith and Lewis, "Train Short, Test Long", ICLR 2022), as the paper's
// reference get_slopes: for a power of two n, (2^(-8/n))^i for i = 1..n; otherwise the slopes of the power
// of two p below n, followed by every other slope of 2p, the first n - p of them (in that order).
template <typename Scalar>
std::vector<Scalar> alibi_slopes(Eigen::Index heads) {
  if (heads <= 0) detail::throw_invalid("alibi_slopes", "heads", "positive", heads);
  const auto power_of_two = [](Eigen::Index n, std::vector<Scalar>& out) {
    for (Eigen::Index i = 1; i <= n; ++i)
      out.push_back(static_cast<Scalar>(std::pow(2.0, -8.0 * static_cast<double>(i) / static_cast<double>(n))));
  };
  Eigen::Index p = 1;
  while (2 * p <= heads) p *= 2;
  std::vector<Scalar> slopes;
  slopes.reserve(static_cast<std::size_t>(heads));
  power_of_two(p, slopes);
  if (p < heads) {
    std::vector<Scalar> twice;
    power_of_two(2 * p, twice);
    for (Eigen::Index i = 0; i < heads - p; ++i) slopes.push_back(twice[static_cast<std::size_t>(2 * i)]);
  }
  return slopes;
}

SDPA_NAMESPACE_END
