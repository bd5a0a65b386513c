// The attention core's argument checks, made once per call before any work (sdpa::attention, its backward
// and varlen forms, and the module's forward and decoding steps): the call's shape, packed sequences, the
// compute type, and every AttentionOptions field against the shape. Each refusal is a
// std::invalid_argument naming the function, the field, what it must be and what it is.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdpa/cpu.hpp"
#include "sdpa/detail/inputs.hpp"
#include "sdpa/error.hpp"
#include "sdpa/compute.hpp"
#include "sdpa/mask.hpp"
#include "sdpa/options.hpp"
#include "sdpa/rotary.hpp"

SDPA_NAMESPACE_BEGIN
namespace detail {

// The sizes of one attention call, named where errors must name them.
struct CallShape {
  const char* where = "attention";
  Eigen::Index batch = 0, heads = 0, kv_heads = 0, nq = 0, nk = 0, d_k = 0, d_v = 0;

  // The shape of q, k, v given as (batch, heads, seq, dim) sizes.
  static CallShape of(const char* where, const std::array<Eigen::Index, 4>& qd, const std::array<Eigen::Index, 4>& kd,
                      const std::array<Eigen::Index, 4>& vd) noexcept {
    CallShape c;
    c.where = where;
    c.batch = qd[0];
    c.heads = qd[1];
    c.kv_heads = kd[1];
    c.nq = qd[2];
    c.nk = kd[2];
    c.d_k = qd[3];
    c.d_v = vd[3];
    return c;
  }
};

// Packed sequences (cu_seqlens_q / cu_seqlens_k) against the call's shape: a batch of one, two boundary
// lists of the same length from 0 up to the rows, and none of the options that have no packed form.
template <typename Scalar>
void check_packed(const CallShape& c, const AttentionOptions<Scalar>& o) {
  const char* where = c.where;
  if (c.batch != 1)
    throw_invalid(where, "the batch (packed sequences, cu_seqlens_q / cu_seqlens_k)", "1: the sequences are rows of one batch entry",
                  c.batch);
  if (o.cu_seqlens_q.empty() || o.cu_seqlens_q.size() != o.cu_seqlens_k.size())
    throw_invalid(where, "cu_seqlens_k", concat("as many entries as cu_seqlens_q (", o.cu_seqlens_q.size(), "), at least 1"),
                  concat(o.cu_seqlens_k.size(), " entries"));
  const auto bounds = [&](const std::vector<Eigen::Index>& cu, const char* name, Eigen::Index rows, const char* what) {
    if (cu.front() != 0) throw_invalid(where, concat(name, "[0]"), "0", cu.front());
    for (std::size_t s = 1; s < cu.size(); ++s)
      if (cu[s] < cu[s - 1])
        throw_invalid(where, concat(name, "[", s, "]"), concat("at least ", name, "[", s - 1, "] = ", cu[s - 1]), cu[s]);
    if (cu.back() != rows)
      throw_invalid(where, concat(name, "[", cu.size() - 1, "] (the last)"), concat(rows, ", the number of ", what), cu.back());
  };
  bounds(o.cu_seqlens_q, "cu_seqlens_q", c.nq, "query rows");
  bounds(o.cu_seqlens_k, "cu_seqlens_k", c.nk, "key rows");
  const char* unpacked = o.attention_mask != nullptr      ? "attention_mask"
                         : o.attention_weights != nullptr ? "attention_weights"
                         : o.attention_bias != nullptr    ? "attention_bias"
                         : !o.key_lengths.empty()         ? "key_lengths"
                         : o.probabilities != nullptr     ? "probabilities"
                         : o.log_sum_exp != nullptr       ? "log_sum_exp"
                                                          : nullptr;
  if (unpacked != nullptr)
    throw_invalid(where, unpacked, "unset with packed sequences (cu_seqlens: it has no packed form)", "set");
}

// Compute::kBf16 where it runs: float problems, the tiled or automatic kernel.
template <typename Scalar>
void check_compute(const char* where, Compute compute, Kernel kernel) {
  if (compute == Compute::kFloat) return;
  if (!std::is_same<Scalar, float>::value)
    throw_invalid(where, "compute", "Compute::kFloat for double (kBf16 rounds float operands)", compute_name(compute));
  if (kernel == Kernel::kReference)
    throw_invalid(where, "compute", "Compute::kFloat with Kernel::kReference (the reference multiplies in float)",
                  compute_name(compute));
}

// Every option against the call's shape, before any work: std::invalid_argument naming the function, the
// field, what it must be and what it is. A module call (module_call) refuses the fields that belong to
// sdpa::attention alone.
template <typename Scalar>
void check_attention_options(const CallShape& c, const AttentionOptions<Scalar>& o, bool module_call) {
  const char* where = c.where;
  if (o.packed()) check_packed(c, o);
  const std::array<Eigen::Index, 4> full{c.batch, c.heads, c.nq, c.nk};
  make_broadcast_view(o.attention_mask, full, where, "attention_mask");
  make_broadcast_view(o.attention_weights, full, where, "attention_weights");
  make_broadcast_view(o.attention_bias, full, where, "attention_bias");
  if (o.window_left < -1)
    throw_invalid(where, "window_left", "-1 (no window) or a non-negative number of keys", o.window_left);
  if (o.window_right < -1)
    throw_invalid(where, "window_right", "-1 (no window) or a non-negative number of keys", o.window_right);
  if (!o.key_lengths.empty()) {
    if (static_cast<Eigen::Index>(o.key_lengths.size()) != c.batch)
      throw_invalid(where, "key_lengths", concat("empty or one length per batch entry (", c.batch, ")"),
                    concat(o.key_lengths.size(), " lengths"));
    for (std::size_t b = 0; b < o.key_lengths.size(); ++b)
      if (o.key_lengths[b] < 0 || o.key_lengths[b] > c.nk)
        throw_invalid(where, concat("key_lengths[", b, "]"), concat("in [0, ", c.nk, "]"), o.key_lengths[b]);
  }
  const auto per_head = [&](const std::vector<Scalar>& values, const char* name, const char* what) {
    if (values.empty()) return;
    if (static_cast<Eigen::Index>(values.size()) != c.heads)
      throw_invalid(where, name, concat("empty or one ", what, " per query head (", c.heads, ")"),
                    concat(values.size(), " ", what, "s"));
    for (std::size_t i = 0; i < values.size(); ++i)
      if (!std::isfinite(values[i])) throw_invalid(where, concat(name, "[", i, "]"), "finite", values[i]);
  };
  per_head(o.alibi_slopes, "alibi_slopes", "slope");
  per_head(o.sinks, "sinks", "logit");
  if (!(std::isfinite(o.scale) && o.scale >= Scalar(0)))
    throw_invalid(where, "scale", "0 (1 / sqrt(d_k)) or a finite positive factor", o.scale);
  if (!(std::isfinite(o.softcap) && o.softcap >= Scalar(0)))
    throw_invalid(where, "softcap", "0 (none) or a finite positive cap", o.softcap);
  if (module_call && o.compute != Compute::kFloat)
    throw_invalid(where, "compute (set_compute sets the module's)", "left at its default in a module call",
                  "set: it is an option of sdpa::attention only");
  if (!module_call) check_compute<Scalar>(where, o.compute, o.kernel);
  if (o.program != nullptr) {
    if (o.kernel == Kernel::kReference)
      throw_invalid(where, "kernel", "Kernel::kAuto or Kernel::kTiled with a score program", "Kernel::kReference");
    o.program->check(where, c.batch, c.heads, c.nq, c.nk, o.packed());
  }
  if (module_call) {
    const char* own = nullptr;
    if (o.layout != Layout::kBHND) own = "layout (the module's inputs are (batch, seq, d_model))";
    else if (o.masked_rows != MaskedRows::kZero) own = "masked_rows (set_masked_rows sets the module's)";
    else if (o.kernel != Kernel::kAuto) own = "kernel (set_kernel sets the module's)";
    else if (o.dropout != Scalar(0) || o.dropout_seed != 0) own = "dropout, dropout_seed (the module has its own dropout)";
    else if (o.rotary != nullptr) own = "rotary (set_rotary sets the module's)";
    if (own != nullptr)
      throw_invalid(where, own, "left at its default in a module call", "set: it is an option of sdpa::attention only");
  } else {
    if (!(std::isfinite(o.dropout) && o.dropout >= Scalar(0) && o.dropout <= Scalar(1)))
      throw_invalid(where, "dropout", "a finite probability in [0, 1]", o.dropout);
    if (o.rotary != nullptr) check_rotary(where, *o.rotary, c.d_k);
    if (!o.rotary_positions.empty())
      throw_invalid(where, "rotary_positions", "empty for sdpa::attention (a module's forward and step take them)", "given");
  }
}

}  // namespace detail
SDPA_NAMESPACE_END
