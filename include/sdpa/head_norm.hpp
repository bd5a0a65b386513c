// What today's open models do to their projected queries and keys besides rotating them, as properties
// of a module (ScaledDotProductAttention::set_qk_norm, set_query_temperature):
//
//   QK-norm: an RMS norm, y = x / sqrt(mean(x^2) + eps) * w, over each head (Qwen3, Gemma 3, Qwen3-Next:
//     kHead, w of d_k values shared by the heads) or over the whole projection (OLMo 2: kProjection, w of
//     h * d_k values for the queries and kv_heads * d_k for the keys), before the rotary; or after it and
//     without a weight (Llama 4's L2 norm on its rotary layers: after_rotary, empty weights). Gemma's
//     "1 + w" weights are stored as their sum (the loader adds the 1).
//   Temperature tuning (Llama 4's NoPE layers): the query at absolute position p is multiplied by
//     log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1.
//
// The order is transformers': norm (unless after_rotary), rotary, norm (after_rotary), temperature. Keys are
// stored in a cache after all of it, so decoding reads them as the forward does.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <cmath>
#include <vector>

#include "sdpa/error.hpp"

SDPA_NAMESPACE_BEGIN

enum class QkNormKind { kNone, kHead, kProjection };

template <typename Scalar>
struct QkNorm {
  QkNormKind kind = QkNormKind::kNone;
  double eps = 1e-6;           // > 0 and finite
  bool after_rotary = false;   // Llama 4: normalised after the rotary
  std::vector<Scalar> q_weight, k_weight;  // empty: no weight; kHead: d_k each; kProjection: h * d_k, kv_heads * d_k
};

struct QueryTemperature {
  double floor_scale = 8192;  // > 0
  double attn_scale = 0.1;    // finite
  // The factor of the query at absolute position p.
  double factor(Eigen::Index position) const {
    return std::log(std::floor((static_cast<double>(position) + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0;
  }
};

namespace detail {

// Refuses a norm that does not fit a module of h query heads and kv_heads key heads of d_k features.
template <typename Scalar>
void check_qk_norm(const char* where, const QkNorm<Scalar>& n, Eigen::Index h, Eigen::Index kv_heads, Eigen::Index d_k) {
  if (!(std::isfinite(n.eps) && n.eps > 0)) throw_invalid(where, "qk_norm.eps", "finite and positive", n.eps);
  if (n.kind == QkNormKind::kNone) return;
  const bool per_head = n.kind == QkNormKind::kHead;
  const Eigen::Index wq = per_head ? d_k : h * d_k, wk = per_head ? d_k : kv_heads * d_k;
  const auto check = [&](const char* name, const std::vector<Scalar>& w, Eigen::Index want) {
    if (!w.empty() && static_cast<Eigen::Index>(w.size()) != want)
      throw_invalid(where, name, concat("empty (no weight) or ", want, " values (", per_head ? "d_k" : "heads * d_k", ")"),
                    concat(w.size(), " values"));
    for (std::size_t i = 0; i < w.size(); ++i)
      if (!std::isfinite(static_cast<double>(w[i]))) throw_invalid(where, concat(name, "[", i, "]"), "finite", w[i]);
  };
  check("qk_norm.q_weight", n.q_weight, wq);
  check("qk_norm.k_weight", n.k_weight, wk);
  if (n.after_rotary && (!n.q_weight.empty() || !n.k_weight.empty()))
    throw_invalid(where, "qk_norm", "no weights with after_rotary (Llama 4's norm has none)", "weights given");
}

inline void check_temperature(const char* where, const QueryTemperature& t) {
  if (!(std::isfinite(t.floor_scale) && t.floor_scale > 0))
    throw_invalid(where, "temperature.floor_scale", "finite and positive", t.floor_scale);
  if (!std::isfinite(t.attn_scale)) throw_invalid(where, "temperature.attn_scale", "finite", t.attn_scale);
}

// Each of `rows` rows (stride ld) holds `groups` groups of `width` values; each group is RMS-normalised in
// place and multiplied by w (width values; nullptr: none). Sums in double.
template <typename Scalar>
void rms_norm_rows(Scalar* x, Eigen::Index rows, Eigen::Index ld, Eigen::Index groups, Eigen::Index width, const Scalar* w,
                   double eps) {
  for (Eigen::Index r = 0; r < rows; ++r)
    for (Eigen::Index g = 0; g < groups; ++g) {
      Scalar* v = x + r * ld + g * width;
      double sum = 0;
      for (Eigen::Index i = 0; i < width; ++i) sum += static_cast<double>(v[i]) * static_cast<double>(v[i]);
      const Scalar inv = static_cast<Scalar>(1.0 / std::sqrt(sum / static_cast<double>(width) + eps));
      if (w == nullptr)
        for (Eigen::Index i = 0; i < width; ++i) v[i] = v[i] * inv;
      else
        for (Eigen::Index i = 0; i < width; ++i) v[i] = w[i] * (v[i] * inv);
    }
}

// The gradient through rms_norm_rows: d (the output's gradient, same layout) becomes the input's; x is the
// input; dw (width values, or nullptr) accumulates the weight's gradient. With r = 1 / sqrt(mean(x^2) + eps)
// and u = w * dy: dx = r u - x r^3 (x . u) / width; dw += dy x r.
//
// The layout of rms_norm_backward_rows' x and d: `rows` rows (stride ld) of `groups` groups of `width` values.
struct NormRows {
  Eigen::Index rows = 0;
  Eigen::Index ld = 0;
  Eigen::Index groups = 1;
  Eigen::Index width = 0;
};

template <typename Scalar>
void rms_norm_backward_rows(const Scalar* x, Scalar* d, const NormRows& layout, const Scalar* w, double eps,
                            double* dw) {
  const Eigen::Index rows = layout.rows, ldx = layout.ld, ldd = layout.ld, groups = layout.groups, width = layout.width;
  for (Eigen::Index r = 0; r < rows; ++r)
    for (Eigen::Index g = 0; g < groups; ++g) {
      const Scalar* v = x + r * ldx + g * width;
      Scalar* dv = d + r * ldd + g * width;
      double sum = 0, xu = 0;
      for (Eigen::Index i = 0; i < width; ++i) {
        const double u = static_cast<double>(dv[i]) * (w == nullptr ? 1.0 : static_cast<double>(w[i]));
        sum += static_cast<double>(v[i]) * static_cast<double>(v[i]);
        xu += static_cast<double>(v[i]) * u;
      }
      const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + eps);
      const double c = inv * inv * inv * xu / static_cast<double>(width);
      for (Eigen::Index i = 0; i < width; ++i) {
        const double dy = static_cast<double>(dv[i]);
        if (dw != nullptr) dw[i] += dy * static_cast<double>(v[i]) * inv;
        const double u = dy * (w == nullptr ? 1.0 : static_cast<double>(w[i]));
        dv[i] = static_cast<Scalar>(inv * u - static_cast<double>(v[i]) * c);
      }
    }
}

// Rows i < n (stride ld) at positions first + i multiplied by the temperature's factor.
template <typename Scalar>
void temper_rows(const QueryTemperature& t, Scalar* x, Eigen::Index n, Eigen::Index ld, Eigen::Index width, Eigen::Index first) {
  for (Eigen::Index i = 0; i < n; ++i) {
    const Scalar f = static_cast<Scalar>(t.factor(first + i));
    Scalar* v = x + i * ld;
    for (Eigen::Index c = 0; c < width; ++c) v[c] *= f;
  }
}

}  // namespace detail

SDPA_NAMESPACE_END
