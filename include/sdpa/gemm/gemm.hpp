// sdpa's own GEMM, the entry point of include/sdpa/gemm/: row-major products with leading dimensions in
// elements, for the projections (y = x W^T + b with W in PyTorch's (out, in) layout) and the attention
// tiles (q k^T, p v). Register-blocked AVX-512 or AVX2 micro-kernels over packed operands, chosen at run
// time (sdpa/cpu.hpp); Eigen's products on the portable path. With an Eigen::ThreadPoolDevice the work is split over
// rows and columns of C, never over k, so results are bit-identical for any number of threads. Where one
// operand is reused across many products, packed.hpp keeps it packed (PackedA, PackedB, multiply).
//
//   gemm_nt:      C[m, n] = alpha * A[m, k] B[n, k]^T + beta * C
//   gemm_nn:      C[m, n] = alpha * A[m, k] B[k, n]   + beta * C
//   gemm_nt_bias: C[m, n] = A[m, k] W[n, k]^T + bias[n]   (bias added as the tiles are stored)
//   gemm_nt_bias_shared: several of those with the same A, in one pass with one work queue
// beta = 0 never reads C (it may be uninitialised or NaN); alpha = 0 or k = 0 never reads A or B. Each
// takes an optional device (nullptr: the calling thread) and an optional Workspace (workspace.hpp) that
// keeps the packing scratch from one call to the next; a workspace serves one call at a time.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include "sdpa/cpu.hpp"
#include "sdpa/gemm/blocking.hpp"
#include "sdpa/gemm/kernel.hpp"
#include "sdpa/gemm/loops.hpp"
#include "sdpa/gemm/operands.hpp"
#include "sdpa/gemm/packed.hpp"
#include "sdpa/gemm/workspace.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN
namespace gemm {

namespace detail {
inline void check_operands(Eigen::Index m, Eigen::Index n, Eigen::Index k, Eigen::Index lda, Eigen::Index ldb_min,
                           Eigen::Index ldb, Eigen::Index ldc) noexcept {
  eigen_assert(m >= 0 && n >= 0 && k >= 0 && "sdpa::gemm: negative size");
  eigen_assert((m == 0 || k == 0 || lda >= k) && "sdpa::gemm: lda is smaller than k");
  eigen_assert((n == 0 || k == 0 || ldb >= ldb_min) && "sdpa::gemm: ldb is smaller than a row of B");
  eigen_assert((m == 0 || ldc >= n) && "sdpa::gemm: ldc is smaller than n");
  (void)m, (void)n, (void)k, (void)lda, (void)ldb_min, (void)ldb, (void)ldc;
}
}  // namespace detail

// Every function below runs on the path its context names (sdpa/cpu.hpp; by default the one chosen now).

// C[m, n] = alpha * A[m, k] * B[n, k]^T + beta * C.
template <typename Scalar>
void gemm_nt(Shape s, detail::NoDeduceT<Scalar> alpha, Matrix<const Scalar> a, Matrix<const Scalar> b,
             detail::NoDeduceT<Scalar> beta, Matrix<Scalar> c, const Context<Scalar>& context = {}) {
  detail::check_operands(s.m, s.n, s.k, a.ld, s.k, b.ld, c.ld);
  if (s.n <= 0) return;
  const detail::Output<Scalar> out{s.n, b.data, b.ld, /*transposed=*/true, nullptr, c.data, c.ld};
  detail::gemm_loops<Scalar>(s.m, s.k, alpha, a, &out, 1, beta, context);
}

// C[m, n] = alpha * A[m, k] * B[k, n] + beta * C.
template <typename Scalar>
void gemm_nn(Shape s, detail::NoDeduceT<Scalar> alpha, Matrix<const Scalar> a, Matrix<const Scalar> b,
             detail::NoDeduceT<Scalar> beta, Matrix<Scalar> c, const Context<Scalar>& context = {}) {
  detail::check_operands(s.m, s.n, s.k, a.ld, s.n, b.ld, c.ld);
  if (s.n <= 0) return;
  const detail::Output<Scalar> out{s.n, b.data, b.ld, /*transposed=*/false, nullptr, c.data, c.ld};
  detail::gemm_loops<Scalar>(s.m, s.k, alpha, a, &out, 1, beta, context);
}

// The projection y = x W^T + b: C[m, n] = A[m, k] * W[n, k]^T + bias[n]. C is not read.
template <typename Scalar>
void gemm_nt_bias(Shape s, Matrix<const Scalar> a, Matrix<const Scalar> w, detail::NoDeduceT<const Scalar*> bias,
                  Matrix<Scalar> c, const Context<Scalar>& context = {}) {
  detail::check_operands(s.m, s.n, s.k, a.ld, s.k, w.ld, c.ld);
  if (s.n <= 0) return;
  const detail::Output<Scalar> out{s.n, w.data, w.ld, /*transposed=*/true, bias, c.data, c.ld};
  detail::gemm_loops<Scalar>(s.m, s.k, Scalar(1), a, &out, 1, Scalar(0), context);
}

// One projection of gemm_nt_bias_shared: C[m, n] (ldc) = A W[n, k]^T (ldw) + bias[n].
template <typename Scalar>
struct BiasedProduct {
  const Scalar* w;
  Eigen::Index ldw;
  Eigen::Index n;
  const Scalar* bias;
  Scalar* c;
  Eigen::Index ldc;
  // W stored as bfloat16 or float16 (float products only): at w_stored, w null; widened as it is packed.
  Storage storage = native_storage<Scalar>();
  const void* w_stored = nullptr;
};

// Several projections of the same A[m, k] (lda) at once: one pass over the k blocks whose tiles, of all
// the outputs, share one work queue (one parallel region per k block instead of one per output, and no
// worker idles at an output's tail); more than 8 outputs run 8 at a time. Each output gets the bits
// gemm_nt_bias gives it.
template <typename Scalar>
void gemm_nt_bias_shared(Eigen::Index m, Eigen::Index k, Matrix<const Scalar> a, const BiasedProduct<Scalar>* products,
                         std::size_t count, const Context<Scalar>& context = {}) {
  constexpr std::size_t kGroup = detail::kMaxOutputs;
  for (std::size_t o0 = 0; o0 < count; o0 += kGroup) {
    const std::size_t group = std::min(kGroup, count - o0);
    detail::Output<Scalar> outputs[kGroup] = {};
    for (std::size_t o = 0; o < group; ++o) {
      const BiasedProduct<Scalar>& p = products[o0 + o];
      detail::check_operands(m, p.n, k, a.ld, k, p.ldw, p.ldc);
      outputs[o] = {p.n, p.w, p.ldw, /*transposed=*/true, p.bias, p.c, p.ldc, p.storage, p.w_stored};
    }
    detail::gemm_loops<Scalar>(m, k, Scalar(1), a, outputs, group, Scalar(0), context);
  }
}

}  // namespace gemm
SDPA_NAMESPACE_END
