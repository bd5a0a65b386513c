// Partial attention and its exact merge. Attention over a set of keys split into disjoint parts (keys on
// different devices or stores, a shared prefix and each sequence's own suffix) is each part's attention
// output, with each row's log-sum-exp (AttentionOptions::log_sum_exp), merged row by row:
//   m = max_i lse_i,  w_i = exp(lse_i - m),  out = sum_i w_i out_i / sum_i w_i,  lse = m + log(sum_i w_i)
// (FlashAttention's split-KV combine, FlashInfer's merge_state; ring attention merges its passes with the
// same row function, kernels::merge_normalized_row). The result equals one call over the union of the keys
// to rounding: the summation order differs, not the terms.
//   - Sinks: pass them to exactly one part's call; its log-sum-exp carries the sink, and the merge adds it
//     once.
//   - A part whose row saw no key (lse -inf) contributes nothing, whatever its output holds (under kNaN, NaN);
//     a row that no part saw ends with lse -inf and the MaskedRows policy of MergeOptions (0 or NaN), as one
//     call would give it. A NaN log-sum-exp makes its row NaN.
//   - Dropout: each part's own draw; the merge of parts drawn with one seed is not one call's draw.
// Outputs are (batch, heads, nq, d_v) or (batch, nq, heads, d_v) as MergeOptions::layout says (the calls'
// AttentionOptions::layout), log-sum-exps (batch, heads, nq).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "sdpa/error.hpp"
#include "sdpa/kernels/softmax.hpp"
#include "sdpa/options.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN

// One part: its attention output and its rows' log-sum-exp.
template <typename Scalar>
struct AttentionPart {
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor> out;
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> lse;
};

struct MergeOptions {
  Layout layout = Layout::kBHND;                    // the outputs' layout
  MaskedRows masked_rows = MaskedRows::kZero;       // rows no part saw
  const Eigen::ThreadPoolDevice* device = nullptr;  // nullptr: the calling thread
};

namespace detail {

// The (batch, heads, nq, d_v) of an output in `layout`, after checking that it and lse agree and that
// `other` (an output and its lse) has the same shapes.
template <typename Scalar>
std::array<Eigen::Index, 4> merge_shape(const char* where, const Eigen::Tensor<Scalar, 4, Eigen::RowMajor>& out,
                                        const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& lse, Layout layout,
                                        const Eigen::Tensor<Scalar, 4, Eigen::RowMajor>& other_out,
                                        const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& other_lse, std::size_t part) {
  const std::array<Eigen::Index, 4> o{out.dimension(0), out.dimension(1), out.dimension(2), out.dimension(3)};
  const std::array<Eigen::Index, 4> other{other_out.dimension(0), other_out.dimension(1), other_out.dimension(2),
                                          other_out.dimension(3)};
  const std::array<Eigen::Index, 4> shape = layout == Layout::kBHND
                                                ? std::array<Eigen::Index, 4>{o[0], o[1], o[2], o[3]}
                                                : std::array<Eigen::Index, 4>{o[0], o[2], o[1], o[3]};
  const std::array<Eigen::Index, 3> want{shape[0], shape[1], shape[2]};
  const auto check_lse = [&](const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& l, std::size_t i) {
    const std::array<Eigen::Index, 3> got{l.dimension(0), l.dimension(1), l.dimension(2)};
    if (got != want)
      throw_invalid(where, concat("part ", i, "'s lse shape"),
                    concat(shape_string(want), " (batch, heads, nq of the outputs in ",
                           layout == Layout::kBHND ? "kBHND" : "kBNHD", ")"),
                    shape_string(got));
  };
  check_lse(lse, 0);
  if (other != o)
    throw_invalid(where, concat("part ", part, "'s output shape"), concat(shape_string(o), ", part 0's"),
                  shape_string(other));
  check_lse(other_lse, part);
  return shape;
}

// Merges part (out2, lse2) into (out, lse) in place, rows split over the device's threads.
template <typename Scalar>
void merge_into(Eigen::Tensor<Scalar, 4, Eigen::RowMajor>& out, Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& lse,
                const Eigen::Tensor<Scalar, 4, Eigen::RowMajor>& out2,
                const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& lse2, const std::array<Eigen::Index, 4>& shape,
                const MergeOptions& options) {
  using Index = Eigen::Index;
  const Index heads = shape[1], nq = shape[2], d = shape[3], rows = shape[0] * heads * nq;
  // Row (b, h, i) = r = (b * heads + h) * nq + i of lse; of the outputs as the layout lays them.
  const auto at = [&](Index r) {
    const Index b = r / (heads * nq), h = r / nq % heads, i = r % nq;
    return (options.layout == Layout::kBHND ? (b * heads + h) * nq + i : (b * nq + i) * heads + h) * d;
  };
  parallel_for(options.device, rows, std::max<Index>(1, 4096 / std::max<Index>(d, 1)), [&](Index r0, Index r1) {
    for (Index r = r0; r < r1; ++r)
      kernels::merge_normalized_row(out.data() + at(r), lse.data()[r], out2.data() + at(r), lse2.data()[r], d);
  });
}

// Rows that no part saw: the policy's output.
template <typename Scalar>
void finish_merge(Eigen::Tensor<Scalar, 4, Eigen::RowMajor>& out, const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& lse,
                  const std::array<Eigen::Index, 4>& shape, const MergeOptions& options) {
  using Index = Eigen::Index;
  const Index heads = shape[1], nq = shape[2], d = shape[3];
  const Scalar fill = options.masked_rows == MaskedRows::kNaN ? std::numeric_limits<Scalar>::quiet_NaN() : Scalar(0);
  for (Index r = 0; r < lse.size(); ++r) {
    if (lse.data()[r] != -std::numeric_limits<Scalar>::infinity()) continue;
    const Index b = r / (heads * nq), h = r / nq % heads, i = r % nq;
    const Index row = options.layout == Layout::kBHND ? (b * heads + h) * nq + i : (b * nq + i) * heads + h;
    std::fill_n(out.data() + row * d, d, fill);
  }
}

}  // namespace detail

// Merges (out2, lse2), attention of the same queries over keys disjoint from those of (out, lse), into
// (out, lse): afterwards they are the attention over both key sets.
template <typename Scalar>
void merge_attention_states(Eigen::Tensor<Scalar, 4, Eigen::RowMajor>& out,
                            Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& lse,
                            const Eigen::Tensor<Scalar, 4, Eigen::RowMajor>& out2,
                            const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& lse2, const MergeOptions& options = {}) {
  const char* where = "merge_attention_states";
  const auto shape = detail::merge_shape(where, out, lse, options.layout, out2, lse2, 1);
  detail::merge_into(out, lse, out2, lse2, shape, options);
  detail::finish_merge(out, lse, shape, options);
}

// The merge of two parts, as a new part.
template <typename Scalar>
AttentionPart<Scalar> merge_attention_states(const AttentionPart<Scalar>& a, const AttentionPart<Scalar>& b,
                                             const MergeOptions& options = {}) {
  const auto shape = detail::merge_shape("merge_attention_states", a.out, a.lse, options.layout, b.out, b.lse, 1);
  AttentionPart<Scalar> merged{a.out, a.lse};
  detail::merge_into(merged.out, merged.lse, b.out, b.lse, shape, options);
  detail::finish_merge(merged.out, merged.lse, shape, options);
  return merged;
}

// The merge of any number of parts (at least one), in their order.
template <typename Scalar>
AttentionPart<Scalar> merge_attention_states(const std::vector<AttentionPart<Scalar>>& parts,
                                             const MergeOptions& options = {}) {
  const char* where = "merge_attention_states";
  if (parts.empty()) detail::throw_invalid(where, "parts", "at least one part", "empty");
  std::array<Eigen::Index, 4> shape{};
  for (std::size_t i = 0; i < parts.size(); ++i)
    shape = detail::merge_shape(where, parts[0].out, parts[0].lse, options.layout, parts[i].out, parts[i].lse, i);
  AttentionPart<Scalar> merged{parts[0].out, parts[0].lse};
  for (std::size_t i = 1; i < parts.size(); ++i)
    detail::merge_into(merged.out, merged.lse, parts[i].out, parts[i].lse, shape, options);
  detail::finish_merge(merged.out, merged.lse, shape, options);
  return merged;
}

SDPA_NAMESPACE_END
