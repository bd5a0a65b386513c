// The options of one attention call, as the forward, the cached decoding step, the backward pass and
// sdpa::attention take them: tensors that mask, multiply or add to the scores (each dimension 1 or full,
// broadcast without copies), the variants that need no tensor at all (causal, sliding windows, key
// lengths, ALiBi, a scale, softcapping, sinks), where the probabilities and each row's log-sum-exp go when
// a caller wants to see them, and the thread pool. Also the masked-row policy, the kernel choice and the
// ALiBi paper's slopes.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <cmath>
#include <cstdint>
#include <vector>

#include <memory>

#include "sdpa/compute.hpp"
#include "sdpa/error.hpp"
#include "sdpa/flex/score_program.hpp"

SDPA_NAMESPACE_BEGIN

// What a query whose every key is hidden (by the mask, causal, a window or its key length) gets: zero
// attention output (PyTorch's SDPA since 2.5, ggml, CTranslate2), or NaN as the original module's softmax
// over -inf gives.
enum class MaskedRows { kZero, kNaN };

// Which attention kernel a call runs: kAuto is the tiled kernel, or the decoding kernel for a few queries
// (16 or fewer); kTiled forces the tiled kernel (also for a decoding step); kReference is the plain path
// the others are tested against (it holds a whole row of scores per query and is much slower).
enum class Kernel { kAuto, kTiled, kReference };

// How sdpa::attention's head tensors are laid out: PyTorch's (batch, heads, seq, dim), as
// F.scaled_dot_product_attention takes them, or FlashAttention's (batch, seq, heads, dim).
enum class Layout { kBHND, kBNHD };

struct Rotary;  // sdpa/rotary.hpp

// Per score of (batch b, query head i, query q, key k), with j = i / (h / kv_heads) the key/value head it
// reads and q' = q + (nk - nq) the query's position among the keys (lower-right alignment: FlashAttention
// 2, PyTorch's causal_lower_right; with a key/value cache, absolute positions):
//   q_i and k_j rotated at positions q' and k (a module's rotary, or `rotary` for sdpa::attention);
//   s = scale * q_i . k_j (scale 1 / sqrt(d_k) unless given);  s *= attention_weights;
//   s = softcap * tanh(s / softcap) when softcap > 0;  s += attention_bias;  s -= alibi_slopes[i] * |q' - k|;
//   s = -inf where attention_mask, causal, the window or key_lengths hides k;
//   p = softmax over the visible keys and, when given, one extra logit sinks[i] whose value is zero;
//   probabilities = p (they sum to less than 1 with a sink);  p = dropout(p) in training mode;  out = p v.
// Windows do not imply causal (a decoder's sliding window is causal = true, window_left = W - 1) and each
// applies on its own side. A row whose every key is hidden follows the MaskedRows policy, in the output
// and in `probabilities`; with a sink it puts all its weight on the sink instead (output 0).
template <typename Scalar>
struct AttentionOptions {
  const Eigen::Tensor<bool, 4, Eigen::RowMajor>* attention_mask = nullptr;       // true = hidden
  const Eigen::Tensor<Scalar, 4, Eigen::RowMajor>* attention_weights = nullptr;  // multiplies
  const Eigen::Tensor<Scalar, 4, Eigen::RowMajor>* attention_bias = nullptr;     // added; dims 1 or full
  bool causal = false;                // key k hidden from query q when k > q'
  Eigen::Index window_left = -1;      // >= 0: key k hidden when k < q' - window_left
  Eigen::Index window_right = -1;     // >= 0: key k hidden when k > q' + window_right
  std::vector<Eigen::Index> key_lengths;  // empty, or one per batch entry: keys k >= key_lengths[b] hidden
  std::vector<Scalar> alibi_slopes;       // empty, or one per query head: adds -slope[i] * |q' - k|
  Scalar scale = Scalar(0);               // > 0: replaces 1 / sqrt(d_k)
  Scalar softcap = Scalar(0);             // > 0: s = softcap * tanh(s / softcap) (Gemma 2)
  std::vector<Scalar> sinks;              // empty, or one logit per query head (gpt-oss)
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor>* probabilities = nullptr;  // set: resized to (b, h, nq, nk), filled
  // Set: resized to (b, h, nq) and filled with each row's log-sum-exp, natural log, over its visible keys and
  // its sink (FlashAttention's softmax_lse; -inf for a row that saw neither): what merge_attention_states
  // (sdpa/merge.hpp) combines the outputs of disjoint key sets by.
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor>* log_sum_exp = nullptr;
  const Eigen::ThreadPoolDevice* device = nullptr;                    // nullptr: the calling thread

  // Packed variable-length sequences (FlashAttention's cu_seqlens): sequence s is query rows
  // cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1 and key/value rows cu_seqlens_k[s] .. cu_seqlens_k[s + 1] - 1
  // of a batch of one (the module's (1, total, d_model) inputs; sdpa::attention_varlen's (total, heads,
  // dim) tensors), and attends to its own keys only. Every option above applies per sequence, with its own
  // q' = q + nk_s - nq_s and its rotary positions from 0; the tensors of the first three fields, key_lengths
  // and probabilities have no packed form and are refused. Both empty: not packed; else both with the same
  // number of sequences + 1 entries, from 0, non-decreasing, the last the total number of rows.
  std::vector<Eigen::Index> cu_seqlens_q, cu_seqlens_k;
  bool packed() const noexcept { return !cu_seqlens_q.empty() || !cu_seqlens_k.empty(); }

  // Rotary positions given by the caller, for a module's forward and KVCache step (MRoPE's three streams per
  // token, Qwen2-VL): empty, each row turns at its own position (q' and k); else streams * batch * rows
  // values, rows the call's key rows (a step's: its new tokens), stream st of key row r of batch entry b at
  // [(st * batch + b) * rows + r]; a query row takes its key row's (q' = q + nk - nq; packed: within its
  // sequence). streams is the module's rotary's (3 with an mrope_section, else 1).
  std::vector<Eigen::Index> rotary_positions;

  // sdpa::attention only. A module's calls refuse values other than these defaults: the module has its
  // own (set_masked_rows, set_kernel, its dropout and train()/eval(), set_rotary), and its inputs have one
  // layout.
  Layout layout = Layout::kBHND;
  MaskedRows masked_rows = MaskedRows::kZero;
  Kernel kernel = Kernel::kAuto;
  Scalar dropout = Scalar(0);         // probability; the mask is drawn from dropout_seed (Philox)
  std::uint64_t dropout_seed = 0;
  const Rotary* rotary = nullptr;     // rotates q (at q') and k (at k) before the scores
  // The products' type (sdpa/compute.hpp): kBf16 multiplies bfloat16-rounded q, k, v and probabilities
  // with float sums (float only; the tiled kernel whatever the shape; attention_backward after it rounds
  // its operands too). The module has set_compute.
  Compute compute = Compute::kFloat;
  // A score program (sdpa/flex.hpp: score and mask functions, a block plan): its score function follows
  // ALiBi above, its mask function hides keys as the fixed rules do (true keeps). Runs on the tiled
  // kernel (kAuto or kTiled); the objects it refers to (plan, tables) must outlive attention_backward.
  std::shared_ptr<const ScoreProgram<Scalar>> program;
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
