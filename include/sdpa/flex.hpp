// Programmable attention (PyTorch's FlexAttention, on the CPU, with gradients): a score function and a mask
// function written in C++, inlined into the tiled kernels, with an optional block plan that lets the
// kernels skip what the mask hides.
//
//   mask function   bool(Index b, Index h, Index q, Index k): true where query q of head h sees key k
//                   (FlexAttention's mask_mod: true KEEPS, the opposite of attention_mask);
//   score function  S(S s, Index b, Index h, Index q, Index k), written generically (`auto s`): called with
//                   a Scalar in the forward pass and with flex::Dual in the backward pass, which gives
//                   d result / d s and the gradients of the ScoreTables it reads (sdpa/flex/dual.hpp).
//                   Returning -inf hides the key (the row then follows softmax's rules: a row of -inf
//                   scores is NaN, as a -inf bias makes it); NaN makes the row NaN.
// b is the batch entry (a packed call's sequence), h the query head, q the query's position among the keys
// (q + nk - nq: lower-right, as every other option), k the key's position.
// Per score: s = scale * q.k, the weights, softcap, bias and ALiBi of AttentionOptions, then the score
// function; then every hidden key (attention_mask, causal, windows, key_lengths and the mask function) is
// -inf. A row the mask function hides entirely follows the MaskedRows policy.
//
//   auto program = sdpa::flex::program<float>(score, visible, plan);   // any of them may be the defaults
//   options.program = program;                                         // or the attention overloads below
//   out = sdpa::attention(q, k, v, options, state);  grads = sdpa::attention_backward(d_out, state);
//
// The built-ins (namespace sdpa::flex) are mask or score functions with analytic plans: causal,
// sliding_window, chunked, document, prefix_lm, tree (flex/masks.hpp); t5_buckets, distance_bias, alibi,
// softcap (flex/scores.hpp). Masks
// combine with and_masks / or_masks, plans with & and |.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdpa/attention.hpp"
#include "sdpa/error.hpp"
#include "sdpa/flex/block_mask.hpp"
#include "sdpa/flex/dual.hpp"
#include "sdpa/flex/masks.hpp"
#include "sdpa/flex/score_program.hpp"
#include "sdpa/flex/scores.hpp"
#include "sdpa/flex/traits.hpp"
#include "sdpa/kernels/backward.hpp"
#include "sdpa/kernels/decode.hpp"
#include "sdpa/kernels/tiled.hpp"

SDPA_NAMESPACE_BEGIN
namespace flex {

// ---- The program ----

template <typename Scalar, typename Score, typename Visible>
class FlexProgram final : public ScoreProgram<Scalar> {
 public:
  static constexpr bool kScore = !std::is_same<Score, noop_score>::value;
  static constexpr bool kMask = !std::is_same<Visible, all_visible>::value;
  static constexpr bool kScoreRow = detail::has_row<Score, Scalar>::value;

  FlexProgram(Score score, Visible visible, std::shared_ptr<const BlockMask> plan, std::vector<const ScoreTable<Scalar>*> tables)
      : score_(std::move(score)), visible_(std::move(visible)), plan_(std::move(plan)), tables_(std::move(tables)) {
    for (std::size_t i = 0; i < tables_.size(); ++i)
      if (tables_[i] == nullptr) sdpa::detail::throw_invalid("flex::program", sdpa::detail::concat("tables[", i, "]"), "a ScoreTable", "null");
  }

  template <typename S>
  S score(S s, Index b, Index h, Index q, Index k) const noexcept {
    return static_cast<S>(score_(s, b, h, q, k));
  }
  void score_row(Scalar* y, Index m, Index b, Index h, Index q, Index k0) const noexcept {
    if constexpr (kScoreRow) score_.row(y, m, b, h, q, k0);
  }
  bool visible(Index b, Index h, Index q, Index k) const noexcept { return visible_(b, h, q, k); }
  bool narrow(Index b, Index h, Index q, Index& lo, Index& hi) const noexcept { return detail::narrow(visible_, b, h, q, lo, hi); }
  const BlockMask* plan() const noexcept { return plan_.get(); }
  const void* table_id(Index i) const noexcept { return tables_[static_cast<std::size_t>(i)]; }
  Index table_size(Index i) const noexcept { return tables_[static_cast<std::size_t>(i)]->size(); }

  bool has_plan() const override { return plan_ != nullptr; }
  Index keep_from(Index position) const override { return kMask ? detail::keep_from(visible_, position) : 0; }
  Index table_count() const override { return static_cast<Index>(tables_.size()); }
  std::array<Index, 2> table_dims(Index i) const override {
    const ScoreTable<Scalar>& t = *tables_[static_cast<std::size_t>(i)];
    return {t.rows(), t.cols()};
  }
  void check(const char* where, Index batch, Index heads, Index nq, Index nk, bool packed) const override {
    if (plan_) {
      if (packed)
        sdpa::detail::throw_invalid(where, "the score program's BlockMask", "none in a packed call (each sequence has its own shape)",
                                    "given");
      plan_->check(where, batch, heads, nq, nk);
    }
    // Packed: the functions see each sequence as batch entry s, of its own length (not checked here).
    if (packed) return;
    if constexpr (detail::has_check<Score>::value) score_.check(where, batch, heads, nq, nk);
    if constexpr (detail::has_check<Visible>::value) visible_.check(where, batch, heads, nq, nk);
  }
  void forward(const kernels::AttentionProblem<Scalar>& p, Kernel kernel, kernels::DecodeWorkspace<Scalar>* workspace,
               const Eigen::ThreadPoolDevice* device) const override {
    if (kernel == Kernel::kAuto && p.compute == Compute::kFloat && kernels::decode_suits_program(p)) {
      kernels::DecodeWorkspace<Scalar> local;
      kernels::decode_attention_program(p, *this, workspace != nullptr ? *workspace : local, device);
    } else {
      kernels::tiled_attention_program(p, *this, device);
    }
  }
  kernels::BackwardStatus backward(const kernels::BackwardProblem<Scalar>& bp, const Eigen::ThreadPoolDevice* device) const override {
    return kernels::tiled_backward_program(bp, *this, device);
  }

 private:
  Score score_;
  Visible visible_;
  std::shared_ptr<const BlockMask> plan_;
  std::vector<const ScoreTable<Scalar>*> tables_;
};

// A program for AttentionOptions::program: a score function (noop_score: none), a mask function
// (all_visible: none), a plan (an empty BlockMask: none) and the tables the score function reads (a
// built-in's own are added). The functions are copied; the tables must outlive every call that uses the
// program, including attention_backward.
template <typename Scalar, typename Score = noop_score, typename Visible = all_visible>
std::shared_ptr<const ScoreProgram<Scalar>> program(Score score = {}, Visible visible = {}, BlockMask plan = {},
                                                    std::vector<const ScoreTable<Scalar>*> tables = {}) {
  if constexpr (detail::has_tables<Score, Scalar>::value) {
    for (const ScoreTable<Scalar>* t : score.tables())
      if (std::find(tables.begin(), tables.end(), t) == tables.end()) tables.push_back(t);
  }
  std::shared_ptr<const BlockMask> p = plan.empty() ? nullptr : std::make_shared<const BlockMask>(std::move(plan));
  return std::make_shared<const FlexProgram<Scalar, Score, Visible>>(std::move(score), std::move(visible), std::move(p),
                                                                      std::move(tables));
}

}  // namespace flex

// sdpa::attention with a score function, a mask function and an optional plan (copied): options.program
// made from them.
template <typename Q, typename K, typename V, typename Score, typename Visible>
Tensor4<detail::ScalarOf<Q>> attention(const Q& q, const K& k, const V& v, const AttentionOptions<detail::ScalarOf<Q>>& options,
                                       Score score, Visible visible, const BlockMask* plan = nullptr) {
  AttentionOptions<detail::ScalarOf<Q>> o = options;
  o.program = flex::program<detail::ScalarOf<Q>>(std::move(score), std::move(visible), plan != nullptr ? *plan : BlockMask{});
  return attention(q, k, v, o);
}

// The same, keeping in `state` what attention_backward needs (which then returns the tables' gradients).
template <typename Q, typename K, typename V, typename Score, typename Visible>
Tensor4<detail::ScalarOf<Q>> attention(const Q& q, const K& k, const V& v, const AttentionOptions<detail::ScalarOf<Q>>& options,
                                       Score score, Visible visible, const BlockMask* plan,
                                       AttentionState<detail::ScalarOf<Q>>& state) {
  AttentionOptions<detail::ScalarOf<Q>> o = options;
  o.program = flex::program<detail::ScalarOf<Q>>(std::move(score), std::move(visible), plan != nullptr ? *plan : BlockMask{});
  return attention(q, k, v, o, state);
}

SDPA_NAMESPACE_END
