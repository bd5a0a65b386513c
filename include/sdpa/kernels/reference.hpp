// The plain attention path: for each (batch, head, query) it forms the whole row of scores, softmaxes it
// and multiplies by v, in the original module's order, deciding each key's visibility and score by the
// options' definitions one element at a time. It is the oracle the tiled kernel is tested against, so it
// stays simple rather than fast; it shares only the masked-row finisher with the tiled kernel.
#pragma once

#include "sdpa/config.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/softmax.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// Whether key k is hidden from query q of (b, h): by the mask, causal, a window or the key length.
template <typename Scalar>
bool reference_hidden(const AttentionProblem<Scalar>& p, Eigen::Index b, Eigen::Index h, Eigen::Index q,
                      Eigen::Index k) noexcept {
  const Eigen::Index pos = p.position(b, q);
  if (p.mask && p.mask(b, h, q, k)) return true;
  if (p.causal && k > pos) return true;
  if (p.window_left >= 0 && k < pos - p.window_left) return true;
  if (p.window_right >= 0 && k > pos + p.window_right) return true;
  if (p.key_lengths != nullptr && k >= p.key_lengths[b]) return true;
  return false;
}

template <typename Scalar>
void reference_attention(const AttentionProblem<Scalar>& p, const Eigen::ThreadPoolDevice* device = nullptr) {
  constexpr Scalar kInf = std::numeric_limits<Scalar>::infinity();
  const Eigen::Index units = p.batch * p.heads;
  parallel_for(device, units, 1, [&](Eigen::Index u0, Eigen::Index u1) {
    std::vector<Scalar> s(static_cast<std::size_t>(p.nk)), acc(static_cast<std::size_t>(p.d_v));
    std::vector<char> hidden(static_cast<std::size_t>(p.nk));
    for (Eigen::Index u = u0; u < u1; ++u) {
      const Eigen::Index b = u / p.heads, h = u % p.heads;
      for (Eigen::Index i = 0; i < p.nq; ++i) {
        const Eigen::Index bh = b * p.heads + h;
        if (p.nk == 0) {
          // An empty softmax: the product with an empty v is zero, under either masked-row policy.
          std::fill(p.out.row(b, h, i), p.out.row(b, h, i) + p.d_v, Scalar(0));
          if (p.lse != nullptr) p.lse[bh * p.nq + i] = p.sinks != nullptr ? p.sinks[h] : -kInf;
          continue;
        }
        const Scalar* q = p.q.row(b, h, i);
        SoftmaxRow<Scalar> row;  // max (NaN-propagating), sum, whether any key is visible
        for (Eigen::Index j = 0; j < p.nk; ++j) {
          const std::size_t sj = static_cast<std::size_t>(j);
          hidden[sj] = reference_hidden(p, b, h, i, j);
          if (hidden[sj]) {
            s[sj] = -kInf;
            continue;
          }
          row.seen = true;
          const Scalar* k = p.key_row(b, h, j);
          Scalar dot = 0;
          for (Eigen::Index d = 0; d < p.d_k; ++d) dot += q[d] * k[d];
          Scalar x = dot * p.scale;
          if (p.weights) x *= p.weights(b, h, i, j);
          if (p.softcap > Scalar(0)) x = p.softcap * std::tanh(x / p.softcap);
          if (p.bias) x += p.bias(b, h, i, j);
          if (p.alibi != nullptr) x -= p.alibi[h] * static_cast<Scalar>(std::abs(p.position(b, i) - j));
          s[sj] = x;
          if (x > row.max || std::isnan(x)) row.max = std::isnan(row.max) ? row.max : x;
        }
        // The sink logit takes part in the softmax (its value is zero): in the max and in the sum. Visible
        // scores that are all -inf give exp(-inf - -inf) = NaN, as in PyTorch.
        if (p.sinks != nullptr) {
          row.sunk = true;
          const Scalar sink = p.sinks[h];
          if (!std::isnan(row.max) && (sink > row.max || row.max == -kInf)) row.max = sink;
        }
        for (Eigen::Index j = 0; j < p.nk; ++j) {
          const std::size_t sj = static_cast<std::size_t>(j);
          s[sj] = hidden[sj] ? Scalar(0) : std::exp(s[sj] - row.max);
          row.sum += s[sj];
        }
        if (p.sinks != nullptr) row.sum += std::exp(p.sinks[h] - row.max);
        if (p.lse != nullptr) p.lse[bh * p.nq + i] = row.log_sum_exp();
        if (p.probabilities != nullptr) {
          Scalar* out = p.probabilities + (bh * p.nq + i) * p.nk;
          for (Eigen::Index j = 0; j < p.nk; ++j) {
            const std::size_t sj = static_cast<std::size_t>(j);
            out[j] = !row.seen && !row.sunk && p.masked_rows == MaskedRows::kNaN ? std::numeric_limits<Scalar>::quiet_NaN()
                     : hidden[sj] || !row.seen                                    ? Scalar(0)
                                                                                  : s[sj] / row.sum;
          }
        }
        std::fill(acc.begin(), acc.end(), Scalar(0));
        for (Eigen::Index j = 0; j < p.nk; ++j) {
          // A hidden key contributes nothing, not even a NaN in its value row.
          if (hidden[static_cast<std::size_t>(j)]) continue;
          Scalar prob = s[static_cast<std::size_t>(j)];
          if (p.dropout) prob = p.sampler.dropped(bh, i, j) ? Scalar(0) : prob * p.keep_scale;
          const Scalar* v = p.value_row(b, h, j);
          for (Eigen::Index d = 0; d < p.d_v; ++d) acc[static_cast<std::size_t>(d)] += prob * v[d];
        }
        finish_row(p.out.row(b, h, i), acc.data(), p.d_v, row, p.masked_rows,
                   !(p.dropout && p.keep_scale == Scalar(0)));
      }
    }
  });
}

}  // namespace kernels
SDPA_NAMESPACE_END

#include "sdpa/detail/instances.inc"
SDPA_DETAIL_EXTERN_INSTANCES(REFERENCE_ATTENTION)
