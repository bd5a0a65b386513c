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
  const Eigen::Index units = p.batch * p.heads;
  parallel_for(device, units, 1, [&](Eigen::Index u0, Eigen::Index u1) {
    std::vector<Scalar> s(static_cast<std::size_t>(p.nk));
    for (Eigen::Index u = u0; u < u1; ++u) {
      const Eigen::Index b = u / p.heads, h = u % p.heads;
      for (Eigen::Index i = 0; i < p.nq; ++i) {
        const Scalar* q = p.q.row(b, h, i);
        Scalar* o = p.out.row(b, h, i);
        Scalar max = -std::numeric_limits<Scalar>::infinity();
        for (Eigen::Index j = 0; j < p.nk; ++j) {
          const Scalar* k = p.k.row(b, h, j);
          Scalar dot = 0;
          for (Eigen::Index d = 0; d < p.d_k; ++d) dot += q[d] * k[d];
          Scalar x = dot * p.scale;
          if (p.weights) x *= p.weights(b, h, i, j);
          if (p.mask && p.mask(b, h, i, j)) x = -std::numeric_limits<Scalar>::infinity();
          s[static_cast<std::size_t>(j)] = x;
          max = std::max(max, x);
        }
        std::fill(o, o + p.d_v, Scalar(0));
        if (p.nk == 0) continue;  // an empty softmax: the product with an empty v is zero
        if (max == -std::numeric_limits<Scalar>::infinity()) {
          // Every key masked: exp(-inf - -inf) is NaN in the original; kZero gives no attention at all.
          if (p.masked_rows == MaskedRows::kNaN)
            std::fill(o, o + p.d_v, std::numeric_limits<Scalar>::quiet_NaN());
          continue;
        }
        Scalar sum = 0;
        for (Eigen::Index j = 0; j < p.nk; ++j) {
          Scalar& x = s[static_cast<std::size_t>(j)];
          x = std::exp(x - max);
          sum += x;
        }
        for (Eigen::Index j = 0; j < p.nk; ++j) {
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
