// The plain attention path: for each (batch, head, query) it forms the whole row of scores, softmaxes it
// and multiplies by v, in the original module's order. It is the oracle the fast kernels are tested
// against, so it stays simple rather than fast.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "sdpa/kernels/problem.hpp"
#include "sdpa/parallel.hpp"

namespace sdpa {
namespace kernels {

template <typename Scalar>
void reference_attention(const AttentionProblem<Scalar>& p, const Eigen::ThreadPoolDevice* device = nullptr) {
  constexpr Scalar kInf = std::numeric_limits<Scalar>::infinity();
  const Eigen::Index units = p.batch * p.heads;
  parallel_for(device, units, 1, [&](Eigen::Index u0, Eigen::Index u1) {
    std::vector<Scalar> s(static_cast<std::size_t>(p.nk));
    std::vector<char> hidden(static_cast<std::size_t>(p.nk));
    for (Eigen::Index u = u0; u < u1; ++u) {
      const Eigen::Index b = u / p.heads, h = u % p.heads;
      for (Eigen::Index i = 0; i < p.nq; ++i) {
        const Scalar* q = p.q.row(b, h, i);
        Scalar* o = p.out.row(b, h, i);
        // The max propagates NaN (a NaN score makes the whole row NaN, as PyTorch's softmax does).
        Scalar max = -kInf;
        bool any_visible = false;
        for (Eigen::Index j = 0; j < p.nk; ++j) {
          const std::size_t sj = static_cast<std::size_t>(j);
          hidden[sj] = p.mask && p.mask(b, h, i, j);
          if (hidden[sj]) {
            s[sj] = -kInf;
            continue;
          }
          any_visible = true;
          const Scalar* k = p.k.row(b, h, j);
          Scalar dot = 0;
          for (Eigen::Index d = 0; d < p.d_k; ++d) dot += q[d] * k[d];
          Scalar x = dot * p.scale;
          if (p.weights) x *= p.weights(b, h, i, j);
          s[sj] = x;
          if (x > max || std::isnan(x)) max = std::isnan(max) ? max : x;
        }
        std::fill(o, o + p.d_v, Scalar(0));
        if (p.nk == 0) continue;  // an empty softmax: the product with an empty v is zero
        if (!any_visible) {
          // Every key hidden: the softmax over -inf is NaN in the original; kZero gives no attention at all.
          if (p.masked_rows == MaskedRows::kNaN)
            std::fill(o, o + p.d_v, std::numeric_limits<Scalar>::quiet_NaN());
          continue;
        }
        // Visible scores that are all -inf give exp(-inf - -inf) = NaN, as in PyTorch.
        Scalar sum = 0;
        for (Eigen::Index j = 0; j < p.nk; ++j) {
          const std::size_t sj = static_cast<std::size_t>(j);
          if (hidden[sj]) continue;
          s[sj] = std::exp(s[sj] - max);
          sum += s[sj];
        }
        for (Eigen::Index j = 0; j < p.nk; ++j) {
          // A hidden key contributes nothing, not even a NaN in its value row.
          if (hidden[static_cast<std::size_t>(j)]) continue;
          Scalar prob = s[static_cast<std::size_t>(j)] / sum;
          if (p.dropout) prob = p.sampler.dropped(u, i, j) ? Scalar(0) : prob * p.keep_scale;
          const Scalar* v = p.v.row(b, h, j);
          for (Eigen::Index d = 0; d < p.d_v; ++d) o[d] += prob * v[d];
        }
      }
    }
  });
}

}  // namespace kernels
}  // namespace sdpa
