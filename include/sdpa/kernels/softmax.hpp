// The online softmax (FlashAttention's running max and sum) as one small state per query row, shared by
// the tiled forward, the decoding step and the backward pass, and the one finisher that turns a row's state
// and output accumulator into its attention output under the masked-row policy (the reference kernel ends
// its rows through it too). The row passes (max, exponent and sum) are the per-ISA kernels of
// simd/dispatch.hpp. NaN propagates: a NaN score makes the row's sum and output NaN, as in PyTorch; only a
// row that saw no visible key at all (and has no sink logit) gets the masked-row policy.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "sdpa/cpu.hpp"
#include "sdpa/options.hpp"
#include "sdpa/simd/dispatch.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {
// The type a log-sum-exp is computed in before it is rounded once to Scalar: double for float.
template <typename Scalar>
using LseWide = std::conditional_t<std::is_same<Scalar, float>::value, double, Scalar>;

// One query row's running softmax: the reference point `max` (NaN once any score was NaN), the sum of the
// exponentials of the scores folded so far relative to it, and whether the row has seen any visible key.
// The reference lags behind the largest score folded by at most kLag (FlashAttention 4's lazy rescaling):
// once a row has a finite reference, a segment whose scores all stay within kLag above it is folded in one
// pass, relative to it, with neither a pass for the segment's max nor a rescaling of the accumulator; only
// a score further above moves the reference (to the largest score then). Exponentials and sums relative to
// it reach at most e^kLag times theirs relative to the largest score, far from float's range, and
// max + log(sum) is the log-sum-exp all the same. The lag is kept small so that the largest scores'
// arguments, x - max, stay as short as under the exact max, and round as little.
template <typename Scalar>
struct SoftmaxRow {
  static constexpr Scalar kInf = std::numeric_limits<Scalar>::infinity();
  static constexpr Scalar kLag = Scalar(2);
  Scalar max = -kInf;
  Scalar sum = Scalar(0);
  bool seen = false;
  bool sunk = false;  // the row's sink logit is folded in (add_sink)

  // Folds a segment of final scores (hidden keys -inf) into the row on the kernels of `isa`: x becomes
  // exp(x - new reference), and the return value is the factor by which the row's output accumulator must
  // be scaled first (1: unchanged). lazy = false keeps the reference at the largest score folded (no lag):
  // for exponentials that are rounded to bfloat16 next (Compute::kBf16), where the largest one is then
  // exactly 1 and loses nothing, as in FlashAttention 2 and PyTorch's CPU kernel, instead of up to e^kLag
  // rounded to 8 bits.
  Scalar fold(Isa isa, Scalar* x, Eigen::Index n, bool lazy = true) noexcept {
    Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> a(x, n);
    if (lazy && max > -kInf && max < kInf) {
      // A finite reference: the lazy pass, up to the first scores above it by more than kLag.
      Eigen::Index done = n;
      const Scalar lazy_sum = simd::exp_shifted_sum_below(isa, x, n, max, max + kLag, &done);
      if (done == n) {
        sum += lazy_sum;  // NaN scores make it NaN, and the row's output with it
        return Scalar(1);
      }
      // The reference moves to the largest of the scores left (above max + kLag, or NaN, or, beside a NaN
      // that vmaxps lets win, anything: the row's sum is NaN then), and the exponentials taken so far follow.
      const Scalar old_max = max;
      const Scalar rest_max = simd::row_max(isa, x + done, n - done);
      max = std::isnan(rest_max) || rest_max > old_max ? rest_max : old_max;
      const Scalar alpha = std::exp(old_max - max);
      a.head(done) *= alpha;
      sum = (sum + lazy_sum) * alpha + simd::exp_shifted_sum(isa, x + done, n - done, max);
      return alpha;
    }
    Scalar segment_max = simd::row_max(isa, x, n);
    if (segment_max == -kInf) {
      if (a.isNaN().any()) {
        segment_max = std::numeric_limits<Scalar>::quiet_NaN();  // -inf beside NaN: the NaN wins
      } else {
        // Nothing visible here, or only -inf scores: adds nothing (exp(-inf - m) = 0), changes nothing.
        a.setZero();
        return Scalar(1);
      }
    }
    const Scalar old_max = max;
    max = std::isnan(old_max) || !(segment_max > old_max || std::isnan(segment_max)) ? old_max : segment_max;
    const Scalar segment_sum = simd::exp_shifted_sum(isa, x, n, max);
    if (old_max == -kInf) {
      sum = segment_sum;  // the accumulator is still zero
      return Scalar(1);
    }
    if (max == old_max) {  // false for NaN: the accumulator becomes NaN below
      sum += segment_sum;
      return Scalar(1);
    }
    // exp(old - new) with both finite (or NaN, which propagates): never exp(-inf - -inf).
    const Scalar alpha = std::exp(old_max - max);
    sum = sum * alpha + segment_sum;
    return alpha;
  }

  // Folds the row's sink logit (a value of zero: nothing is added to the accumulator) into the state, with
  // acc (d values) rescaled to the new maximum: the keys' weights then sum to less than 1, and a row without
  // a visible key puts all its weight on the sink. Once per row, after every segment and merge, before
  // finish_row and log_sum_exp.
  void add_sink(Scalar sink, Scalar* acc, Eigen::Index d) noexcept {
    sunk = true;
    if (std::isnan(max)) return;  // a NaN row stays NaN
    if (max == -kInf || sink > max) {
      const Scalar alpha = max == -kInf ? Scalar(0) : std::exp(max - sink);
      for (Eigen::Index i = 0; i < d; ++i) acc[i] *= alpha;
      sum = sum * alpha + Scalar(1);
      max = sink;
    } else {
      sum += std::exp(sink - max);
    }
  }

  // log(sum of exp(scores)), the sink's included: what a backward pass recomputes the probabilities from,
  // p = exp(s - lse). -inf for a row without visible keys or sink.
  // (In double, rounded once: one rounding of the result instead of the logarithm's and the addition's, whose
  // operands carry the reference's lag.)
  Scalar log_sum_exp() const noexcept {
    if (!(seen || sunk)) return -kInf;
    return static_cast<Scalar>(static_cast<LseWide<Scalar>>(max) + std::log(static_cast<LseWide<Scalar>>(sum)));
  }

  // Merges another partial state of the same row (another range of its keys), whose accumulator is
  // other_acc, into this one and acc (flash-decoding's split of the keys across threads).
  void merge(const SoftmaxRow& other, Scalar* acc, const Scalar* other_acc, Eigen::Index d) noexcept {
    seen = seen || other.seen;
    if (other.max == -kInf) return;  // the other part folded nothing: its sum and accumulator are 0
    if (max == -kInf) {
      max = other.max;
      sum = other.sum;
      std::copy(other_acc, other_acc + d, acc);
      return;
    }
    const Scalar m = std::isnan(max) || std::isnan(other.max) ? std::numeric_limits<Scalar>::quiet_NaN()
                                                               : std::max(max, other.max);
    const Scalar a = std::exp(max - m), b = std::exp(other.max - m);
    for (Eigen::Index i = 0; i < d; ++i) acc[i] = acc[i] * a + other_acc[i] * b;
    sum = sum * a + other.sum * b;
    max = m;
  }
};

// Merges a row's attention over another, disjoint set of keys into this one by their log-sum-exps (the
// outputs normalized, FlashAttention's split-KV combine, FlashInfer's merge_state): with m = max(lse,
// part_lse), wa = exp(lse - m), wb = exp(part_lse - m), out = (wa out + wb part) / (wa + wb) and lse = m +
// log(wa + wb), the exponent arithmetic in LseWide and the two factors rounded once. A part that saw no key
// (lse -inf) changes nothing; onto a row that saw none, the part is copied; a NaN lse makes the row NaN.
// The same operations in the same order wherever it runs (ring attention, sdpa::merge_attention_states).
template <typename Scalar>
void merge_normalized_row(Scalar* out, Scalar& lse, const Scalar* part, Scalar part_lse, Eigen::Index d) noexcept {
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  using Wide = LseWide<Scalar>;
  if (part_lse == kNegInf) return;
  if (lse == kNegInf) {
    std::copy_n(part, d, out);
    lse = part_lse;
  } else if (std::isnan(lse) || std::isnan(part_lse)) {
    std::fill_n(out, d, std::numeric_limits<Scalar>::quiet_NaN());
    lse = std::numeric_limits<Scalar>::quiet_NaN();
  } else {
    const Wide mx = std::max<Wide>(lse, part_lse), wa = std::exp(lse - mx), wb = std::exp(part_lse - mx), sum = wa + wb;
    const Scalar fa = static_cast<Scalar>(wa / sum), fb = static_cast<Scalar>(wb / sum);
    for (Eigen::Index i = 0; i < d; ++i) out[i] = fa * out[i] + fb * part[i];
    lse = static_cast<Scalar>(mx + std::log(sum));
  }
}

// A row's attention output from its state and accumulator (the probabilities-times-v sum, not yet
// divided): the masked-row policy when it saw no visible key and has no sink, zero when dropout removed
// everything (p = 1), otherwise acc / sum (0 for a row with a sink and no visible key). Visible scores that
// were all -inf leave sum = 0 and acc = 0: 0 * (1 / 0) is NaN, as PyTorch's softmax gives.
template <typename Scalar>
void finish_row(Scalar* out, const Scalar* acc, Eigen::Index d, const SoftmaxRow<Scalar>& row, MaskedRows policy,
                bool accumulated = true) noexcept {
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> o(out, d);
  if (!row.seen && !row.sunk) {
    o.setConstant(policy == MaskedRows::kNaN ? std::numeric_limits<Scalar>::quiet_NaN() : Scalar(0));
  } else if (!accumulated) {
    o.setZero();
  } else {
    o = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(acc, d) * (Scalar(1) / row.sum);
  }
}

}  // namespace kernels
SDPA_NAMESPACE_END
