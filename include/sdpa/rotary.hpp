// Rotary position embeddings (RoPE, Su et al. 2021), as Llama, Mistral, Qwen, Gemma, GPT-NeoX and GPT-J use
// them: the first `dim` features of every query and key head are rotated in pairs by angles proportional to
// the token's position, so that q . k depends on their distance only. A property of the model: a module's
// rotary (ScaledDotProductAttention::set_rotary) rotates its queries and keys at their positions (keys once,
// before they enter a cache, at their absolute positions), and sdpa::attention takes one in its options.
// The long-context scalings follow Hugging Face's rope_type "linear", "llama3", "yarn" and "longrope"
// (transformers' _compute_*_parameters).
//
// LongRoPE (Phi-3) has two frequency sets: a call whose positions reach past long_after (the pretrained
// length) rotates with long_inv_freq, else with inv_freq, as transformers picks the set for a whole call
// by its largest position. A call here is what one apply_rotary covers: a forward (every row up to nk), a
// decoding step (the cache's positions through the step's last), each sequence of a packed call or a paged
// step (transformers, with a ragged batch, would take the largest of all). Keys keep the set they were
// rotated with when they enter a cache: the keys of a prompt rotated short stay short when a later step
// runs long, as in transformers' cache.
//
// Multimodal rotary (MRoPE, Qwen2-VL): mrope_section splits the dim/2 frequencies into sections, section i
// turning with position stream i % 3 (temporal, height, width) of the token; the caller gives the three
// positions per token (AttentionOptions::rotary_positions, apply_rotary_at). A token whose three positions
// are equal (text) turns as the plain rotary does, which is what implicit positions give.
//
// Pair m of a head, angle = position * inv_freq[m], c = cos(angle) * attention_factor, s = sin(angle) *
// attention_factor:
//   half-split (interleaved = false; Llama, NeoX, rotate_half): x[m], x[m + dim/2]
//   interleaved (true; GPT-J):                                 x[2m], x[2m + 1]
//   (a, b) -> (a c - b s, b c + a s); features past dim pass through.
// inv_freq[m] = theta^(-2m / dim) unless given. The angle is position * inv_freq rounded to Scalar, as
// transformers computes it in the model's dtype, then its cosine and sine.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "sdpa/error.hpp"

SDPA_NAMESPACE_BEGIN

struct Rotary {
  Eigen::Index dim = 0;          // rotated features at the start of each head, even, <= d_k; 0 = d_k
  bool interleaved = false;      // false: half-split pairs (m, m + dim/2); true: (2m, 2m + 1)
  double theta = 10000;
  std::vector<double> inv_freq;  // empty: theta^(-2m/dim); else dim/2 frequencies
  double attention_factor = 1;   // cos and sin multiplied by it (YaRN, LongRoPE)
  std::vector<double> long_inv_freq;  // LongRoPE: empty, or the dim/2 frequencies of calls past long_after
  Eigen::Index long_after = 0;        // LongRoPE: the largest position + 1 a call may reach with inv_freq
  std::vector<Eigen::Index> mrope_section;  // MRoPE: empty, or frequency counts summing to dim/2

  // Position streams a token has: 3 with an mrope_section (t, h, w), else 1.
  Eigen::Index streams() const noexcept { return mrope_section.empty() ? 1 : 3; }

  // The features rotated in a head of d_k features.
  Eigen::Index rotated(Eigen::Index d_k) const noexcept { return dim == 0 ? d_k : dim; }

  // The frequencies for a head of d_k features: inv_freq, or theta^(-2m/dim).
  std::vector<double> frequencies(Eigen::Index d_k) const {
    const Eigen::Index n = rotated(d_k);
    if (!inv_freq.empty()) return inv_freq;
    std::vector<double> f(static_cast<std::size_t>(n / 2));
    for (Eigen::Index m = 0; m < n / 2; ++m)
      f[static_cast<std::size_t>(m)] = 1.0 / std::pow(theta, static_cast<double>(2 * m) / static_cast<double>(n));
    return f;
  }
};

namespace detail {

// Refuses a rotary that does not fit heads of d_k features: std::invalid_argument naming the field.
inline void check_rotary(const char* where, const Rotary& r, Eigen::Index d_k) {
  if (r.dim < 0 || r.dim % 2 != 0 || r.dim > d_k)
    throw_invalid(where, "rotary.dim", concat("0 (all of d_k) or an even number of features at most d_k = ", d_k), r.dim);
  const Eigen::Index n = r.rotated(d_k);
  if (n % 2 != 0) throw_invalid(where, "rotary.dim", concat("even (0 means d_k, which is ", d_k, ")"), n);
  if (!(std::isfinite(r.theta) && r.theta > 0)) throw_invalid(where, "rotary.theta", "a finite positive base", r.theta);
  if (!r.inv_freq.empty() && static_cast<Eigen::Index>(r.inv_freq.size()) != n / 2)
    throw_invalid(where, "rotary.inv_freq", concat("empty or dim / 2 = ", n / 2, " frequencies"),
                  concat(r.inv_freq.size(), " frequencies"));
  for (std::size_t i = 0; i < r.inv_freq.size(); ++i)
    if (!std::isfinite(r.inv_freq[i])) throw_invalid(where, concat("rotary.inv_freq[", i, "]"), "finite", r.inv_freq[i]);
  if (!std::isfinite(r.attention_factor))
    throw_invalid(where, "rotary.attention_factor", "finite", r.attention_factor);
  if (!r.long_inv_freq.empty() && static_cast<Eigen::Index>(r.long_inv_freq.size()) != n / 2)
    throw_invalid(where, "rotary.long_inv_freq", concat("empty or dim / 2 = ", n / 2, " frequencies"),
                  concat(r.long_inv_freq.size(), " frequencies"));
  for (std::size_t i = 0; i < r.long_inv_freq.size(); ++i)
    if (!std::isfinite(r.long_inv_freq[i])) throw_invalid(where, concat("rotary.long_inv_freq[", i, "]"), "finite", r.long_inv_freq[i]);
  if (r.long_after < 0) throw_invalid(where, "rotary.long_after", "non-negative", r.long_after);
  if (!r.mrope_section.empty()) {
    Eigen::Index sum = 0;
    for (std::size_t i = 0; i < r.mrope_section.size(); ++i) {
      if (r.mrope_section[i] < 0) throw_invalid(where, concat("rotary.mrope_section[", i, "]"), "non-negative", r.mrope_section[i]);
      sum += r.mrope_section[i];
    }
    if (sum != n / 2) throw_invalid(where, "rotary.mrope_section", concat("sections summing to dim / 2 = ", n / 2), concat("a sum of ", sum));
  }
}

// The cosines and sines of one position for every pair, times the attention factor.
template <typename Scalar>
void rotary_angles(const std::vector<Scalar>& inv_freq, double factor, Eigen::Index position, Scalar* cos_out,
                   Scalar* sin_out) {
  const Scalar pos = static_cast<Scalar>(position);
  for (std::size_t m = 0; m < inv_freq.size(); ++m) {
    const Scalar angle = pos * inv_freq[m];  // rounded as the model's dtype rounds it
    cos_out[m] = static_cast<Scalar>(std::cos(static_cast<double>(angle)) * factor);
    sin_out[m] = static_cast<Scalar>(std::sin(static_cast<double>(angle)) * factor);
  }
}

}  // namespace detail

// Rows to rotate in place: row i (i < rows) holds `heads` heads of d_k features, head h of row i at
// data + i * row_stride + h * head_stride.
template <typename Scalar>
struct RotaryRows {
  Scalar* data;
  Eigen::Index rows;
  Eigen::Index row_stride;
  Eigen::Index heads;
  Eigen::Index head_stride;
  Eigen::Index d_k;
  RotaryRows(Scalar* data_, Eigen::Index rows_, Eigen::Index row_stride_, Eigen::Index heads_,
             Eigen::Index head_stride_, Eigen::Index d_k_) noexcept
      : data(data_), rows(rows_), row_stride(row_stride_), heads(heads_), head_stride(head_stride_), d_k(d_k_) {}
};

// Rotates the rows xs in place, row i at position first_position + i. inverse: rotate by -angle (the
// transpose, for gradients), with the same factor. The rows are one call for LongRoPE's choice of
// frequencies (long past long_after).
template <typename Scalar>
void apply_rotary(const Rotary& r, const RotaryRows<Scalar>& xs, Eigen::Index first_position, bool inverse = false) {
  Scalar* x = xs.data;
  const Eigen::Index rows = xs.rows, row_stride = xs.row_stride, heads = xs.heads, head_stride = xs.head_stride,
                     d_k = xs.d_k;
  const Eigen::Index n = r.rotated(d_k), half = n / 2;
  if (rows <= 0 || heads <= 0 || half == 0) return;
  const bool long_call = !r.long_inv_freq.empty() && first_position + rows > r.long_after;
  const std::vector<double> freq = long_call ? r.long_inv_freq : r.frequencies(d_k);
  std::vector<Scalar> inv_freq(freq.begin(), freq.end()), c(static_cast<std::size_t>(half)), s(c.size());
  const Eigen::Index lo_stride = r.interleaved ? 2 : 1, hi_offset = r.interleaved ? 1 : half;
  for (Eigen::Index i = 0; i < rows; ++i) {
    detail::rotary_angles(inv_freq, r.attention_factor, first_position + i, c.data(), s.data());
    for (Eigen::Index h = 0; h < heads; ++h) {
      Scalar* v = x + i * row_stride + h * head_stride;
      for (Eigen::Index m = 0; m < half; ++m) {
        Scalar& a = v[m * lo_stride];
        Scalar& b = v[m * lo_stride + hi_offset];
        const Scalar cm = c[static_cast<std::size_t>(m)];
        const Scalar sm = inverse ? -s[static_cast<std::size_t>(m)] : s[static_cast<std::size_t>(m)];
        const Scalar a0 = a, b0 = b;
        a = a0 * cm - b0 * sm;
        b = b0 * cm + a0 * sm;
      }
    }
  }
}

// apply_rotary with positions given per row: row i of xs turns frequency m at position
// pos[stream(m) * stream_stride + i], stream(m) the position stream of m's MRoPE section (0 without one).
// One call for LongRoPE (long when a position reaches past long_after).
template <typename Scalar>
void apply_rotary_at(const Rotary& r, const RotaryRows<Scalar>& xs, const Eigen::Index* pos, Eigen::Index stream_stride,
                     bool inverse = false) {
  Scalar* x = xs.data;
  const Eigen::Index rows = xs.rows, row_stride = xs.row_stride, heads = xs.heads, head_stride = xs.head_stride,
                     d_k = xs.d_k;
  const Eigen::Index n = r.rotated(d_k), half = n / 2;
  if (rows <= 0 || heads <= 0 || half == 0) return;
  std::vector<Eigen::Index> stream(static_cast<std::size_t>(half), 0);
  for (std::size_t i = 0, m = 0; i < r.mrope_section.size(); ++i)
    for (Eigen::Index j = 0; j < r.mrope_section[i] && m < stream.size(); ++j) stream[m++] = static_cast<Eigen::Index>(i % 3);
  Eigen::Index end = 0;
  for (Eigen::Index st = 0; st < r.streams(); ++st)
    for (Eigen::Index i = 0; i < rows; ++i) end = std::max(end, pos[st * stream_stride + i] + 1);
  const bool long_call = !r.long_inv_freq.empty() && end > r.long_after;
  const std::vector<double> freq = long_call ? r.long_inv_freq : r.frequencies(d_k);
  std::vector<Scalar> c(static_cast<std::size_t>(half)), s(c.size());
  const Eigen::Index lo_stride = r.interleaved ? 2 : 1, hi_offset = r.interleaved ? 1 : half;
  for (Eigen::Index i = 0; i < rows; ++i) {
    for (Eigen::Index m = 0; m < half; ++m) {
      const Scalar p = static_cast<Scalar>(pos[stream[static_cast<std::size_t>(m)] * stream_stride + i]);
      const Scalar angle = p * static_cast<Scalar>(freq[static_cast<std::size_t>(m)]);  // rounded as the model's dtype
      c[static_cast<std::size_t>(m)] = static_cast<Scalar>(std::cos(static_cast<double>(angle)) * r.attention_factor);
      s[static_cast<std::size_t>(m)] = static_cast<Scalar>(std::sin(static_cast<double>(angle)) * r.attention_factor);
    }
    for (Eigen::Index h = 0; h < heads; ++h) {
      Scalar* v = x + i * row_stride + h * head_stride;
      for (Eigen::Index m = 0; m < half; ++m) {
        Scalar& a = v[m * lo_stride];
        Scalar& b = v[m * lo_stride + hi_offset];
        const Scalar cm = c[static_cast<std::size_t>(m)];
        const Scalar sm = inverse ? -s[static_cast<std::size_t>(m)] : s[static_cast<std::size_t>(m)];
        const Scalar a0 = a, b0 = b;
        a = a0 * cm - b0 * sm;
        b = b0 * cm + a0 * sm;
      }
    }
  }
}

// The default frequencies with every position divided by `factor` (rope_type "linear").
inline Rotary rope_linear(Eigen::Index dim, double theta, double factor) {
  if (dim <= 0 || dim % 2 != 0) detail::throw_invalid("rope_linear", "dim", "a positive even number of features", dim);
  if (!(std::isfinite(factor) && factor > 0)) detail::throw_invalid("rope_linear", "factor", "finite and positive", factor);
  Rotary r;
  r.dim = dim;
  r.theta = theta;
  r.inv_freq = r.frequencies(dim);
  for (double& f : r.inv_freq) f /= factor;
  return r;
}

// Llama 3.1's scaling (rope_type "llama3"): wavelengths above original_max_positions / low_freq_factor are
// divided by factor, those below original_max_positions / high_freq_factor kept, the ones between blended.
inline Rotary rope_llama3(Eigen::Index dim, double theta, double factor, double low_freq_factor,
                          double high_freq_factor, Eigen::Index original_max_positions) {
  const char* where = "rope_llama3";
  if (dim <= 0 || dim % 2 != 0) detail::throw_invalid(where, "dim", "a positive even number of features", dim);
  if (!(std::isfinite(factor) && factor > 0)) detail::throw_invalid(where, "factor", "finite and positive", factor);
  if (!(std::isfinite(low_freq_factor) && std::isfinite(high_freq_factor) && high_freq_factor > low_freq_factor))
    detail::throw_invalid(where, "high_freq_factor", detail::concat("finite and above low_freq_factor = ", low_freq_factor),
                          high_freq_factor);
  if (original_max_positions <= 0)
    detail::throw_invalid(where, "original_max_positions", "positive", original_max_positions);
  Rotary r;
  r.dim = dim;
  r.theta = theta;
  const std::vector<double> base = r.frequencies(dim);
  const double old = static_cast<double>(original_max_positions);
  const double low_wavelen = old / low_freq_factor, high_wavelen = old / high_freq_factor;
  const double pi = 3.14159265358979323846;
  r.inv_freq = base;
  for (double& f : r.inv_freq) {
    const double wavelen = 2 * pi / f;
    if (wavelen > low_wavelen) {
      f = f / factor;
    } else if (!(wavelen < high_wavelen)) {
      const double smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      f = (1 - smooth) * f / factor + smooth * f;
    }
  }
  return r;
}

// YaRN (Peng et al. 2023; rope_type "yarn"): each frequency blends interpolation (divided by factor) and
// extrapolation by where its wavelength falls against original_max_positions (the correction range of
// beta_fast and beta_slow rotations, rounded outwards unless truncate is false, as gpt-oss configures it),
// and the attention factor is 0.1 ln(factor) + 1.
inline Rotary rope_yarn(Eigen::Index dim, double theta, double factor, Eigen::Index original_max_positions,
                        double beta_fast = 32, double beta_slow = 1, bool truncate = true) {
  const char* where = "rope_yarn";
  if (dim <= 0 || dim % 2 != 0) detail::throw_invalid(where, "dim", "a positive even number of features", dim);
  if (!(std::isfinite(factor) && factor > 0)) detail::throw_invalid(where, "factor", "finite and positive", factor);
  if (original_max_positions <= 0)
    detail::throw_invalid(where, "original_max_positions", "positive", original_max_positions);
  if (!(std::isfinite(beta_fast) && std::isfinite(beta_slow) && beta_fast > 0 && beta_slow > 0))
    detail::throw_invalid(where, "beta_fast, beta_slow", "finite and positive", detail::concat(beta_fast, ", ", beta_slow));
  const double pi = 3.14159265358979323846;
  const double d = static_cast<double>(dim), max_pos = static_cast<double>(original_max_positions);
  const auto correction_dim = [&](double rotations) {
    return d * std::log(max_pos / (rotations * 2 * pi)) / (2 * std::log(theta));
  };
  const double lo = correction_dim(beta_fast), hi = correction_dim(beta_slow);
  const double low = std::max(truncate ? std::floor(lo) : lo, 0.0);
  double high = std::min(truncate ? std::ceil(hi) : hi, d - 1);
  if (low == high) high += 0.001;
  Rotary r;
  r.dim = dim;
  r.theta = theta;
  r.inv_freq.resize(static_cast<std::size_t>(dim / 2));
  for (Eigen::Index m = 0; m < dim / 2; ++m) {
    const double pos_freq = std::pow(theta, static_cast<double>(2 * m) / d);
    const double extrapolation = 1.0 / pos_freq, interpolation = 1.0 / (factor * pos_freq);
    const double ramp = std::clamp((static_cast<double>(m) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_factor = 1 - ramp;
    r.inv_freq[static_cast<std::size_t>(m)] =
        interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  r.attention_factor = factor <= 1 ? 1.0 : 0.1 * std::log(factor) + 1.0;
  return r;
}

// LongRoPE (Phi-3, rope_type "longrope"): frequencies theta^(-2m/dim) / short_factor[m] for calls within
// original_max_positions, / long_factor[m] past it; the attention factor sqrt(1 + ln(factor) /
// ln(original_max_positions)) for factor > 1 (else 1) unless attention_factor > 0 gives it.
inline Rotary rope_longrope(Eigen::Index dim, double theta, const std::vector<double>& short_factor,
                            const std::vector<double>& long_factor, Eigen::Index original_max_positions, double factor,
                            double attention_factor = 0) {
  const char* where = "rope_longrope";
  if (dim <= 0 || dim % 2 != 0) detail::throw_invalid(where, "dim", "a positive even number of features", dim);
  const std::size_t half = static_cast<std::size_t>(dim / 2);
  if (short_factor.size() != half)
    detail::throw_invalid(where, "short_factor", detail::concat("dim / 2 = ", half, " factors"), detail::concat(short_factor.size(), " factors"));
  if (long_factor.size() != half)
    detail::throw_invalid(where, "long_factor", detail::concat("dim / 2 = ", half, " factors"), detail::concat(long_factor.size(), " factors"));
  for (std::size_t m = 0; m < half; ++m) {
    if (!(std::isfinite(short_factor[m]) && short_factor[m] > 0))
      detail::throw_invalid(where, detail::concat("short_factor[", m, "]"), "finite and positive", short_factor[m]);
    if (!(std::isfinite(long_factor[m]) && long_factor[m] > 0))
      detail::throw_invalid(where, detail::concat("long_factor[", m, "]"), "finite and positive", long_factor[m]);
  }
  if (original_max_positions <= 1) detail::throw_invalid(where, "original_max_positions", "above 1", original_max_positions);
  if (!(std::isfinite(factor) && factor > 0)) detail::throw_invalid(where, "factor", "finite and positive", factor);
  Rotary r;
  r.dim = dim;
  r.theta = theta;
  const std::vector<double> base = r.frequencies(dim);
  r.inv_freq.resize(half);
  r.long_inv_freq.resize(half);
  for (std::size_t m = 0; m < half; ++m) {
    r.inv_freq[m] = base[m] / short_factor[m];
    r.long_inv_freq[m] = base[m] / long_factor[m];
  }
  r.long_after = original_max_positions;
  r.attention_factor = attention_factor > 0 ? attention_factor
                       : factor <= 1        ? 1.0
                                            : std::sqrt(1 + std::log(factor) / std::log(static_cast<double>(original_max_positions)));
  return r;
}

SDPA_NAMESPACE_END
