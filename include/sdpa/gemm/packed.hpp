// Operands packed once and multiplied many times. The attention kernel multiplies every query block of a
// group by the same key block and every probability block by the same value block, and a projection
// multiplies every batch by the same weights; packing such an operand once (and keeping its storage for
// the next one) removes the packing from all products but the first.
//
//   PackedA  the left operand A[m, k], from row-major memory: pack(m, k, a, lda).
//   PackedB  the right operand, from either layout: pack_nt(n, k, b, ldb) takes b[n, k] (keys, weights:
//            the product is A b^T), pack_nn(k, n, b, ldb) takes b[k, n] (values: the product is A b).
//   multiply(pa, pb, alpha, beta, c, ldc, bias = nullptr, device = nullptr)
//            C[m, n] = alpha * A B + beta * C (+ bias[n]); beta = 0 never reads C.
//   multiply(m, {a, lda}, pb, alpha, beta, {c, ldc}, bias = nullptr, device = nullptr)
//            the same with A read in place from row-major a[m, k]: for an A used once (the probabilities
//            of p v), which packing would cost a transpose of m x k for a single product.
//
// pack() reallocates only when the operand is larger than every one the object held before (reserve()
// sizes it up front), so objects kept per worker make the attention loop allocation-free:
//   PackedB kb, vb; PackedA qa[group];                       // per worker, reused across heads and batches
//   for each query block i of the group: qa[i].pack(bq, d, q_i, ldq)        // once per group
//   for each key block j:
//     kb.pack_nt(bk, d, k_j, ldk); vb.pack_nn(bk, dv, v_j, ldv)            // once per key block
//     for each query block i:
//       multiply(qa[i], kb, scale, 0, s, bk)                                // S = scale Q_i K_j^T
//       (online softmax of s into p)
//       multiply(bq, p, bk, vb, 1, 1, o_i, ldo)                             // O_i += P_i V_j
// Both operands hold the whole depth k in blocks of kc (blocking.hpp), so a product of packed operands
// sums in the same order as gemm_nt/gemm_nn and gives the same bits. An operand is packed for one path's
// kernel (the ISA given to pack, by default the one chosen now: sdpa/cpu.hpp) and remembers it; multiply
// runs on that path, and both operands must have been packed for the same one. The objects are not
// thread-safe to pack concurrently; multiplying from several threads with the same packed operands is safe.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstddef>

#include "sdpa/detail/buffer.hpp"
#include "sdpa/cpu.hpp"
#include "sdpa/gemm/blocking.hpp"
#include "sdpa/gemm/epilogue.hpp"
#include "sdpa/gemm/kernel.hpp"
#include "sdpa/gemm/loops.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN
namespace gemm {

namespace detail {

// Packed storage of `lines` x `depth` in slivers of `width` lines: k block by k block (offset p0 * the
// padded line count), each block sliver by sliver (kcp * width values).
template <typename Scalar>
class PackedStorage {
 public:
  void reserve(Eigen::Index lines, Eigen::Index depth, Eigen::Index width) {
    eigen_assert(lines >= 0 && depth >= 0 && "sdpa::gemm: negative size of a packed operand");
    const std::size_t needed = static_cast<std::size_t>(round_up(lines, width) * depth);
    if (needed > storage_.size()) storage_.reset(needed);
  }
  // Packs block by block with pack(block_depth, p0, dst), in kernel K's k blocks.
  template <typename K, typename PackBlock>
  void pack(Isa isa, Eigen::Index lines, Eigen::Index depth, Eigen::Index width, const PackBlock& pack_block) {
    reserve(lines, depth, width);
    isa_ = isa;
    lines_ = lines;
    depth_ = depth;
    const Eigen::Index kc = blocking_of<K, Scalar>().kc;
    const Eigen::Index padded = round_up(lines, width);
    for (Eigen::Index p0 = 0; p0 < depth; p0 += kc)
      pack_block(std::min(kc, depth - p0), p0, storage_.data() + p0 * padded);
  }
  Isa isa() const noexcept { return isa_; }
  Eigen::Index lines() const noexcept { return lines_; }
  Eigen::Index depth() const noexcept { return depth_; }
  const Scalar* data() const noexcept { return storage_.data(); }

 private:
  sdpa::detail::Buffer<Scalar> storage_;
  Isa isa_ = Isa::kPortable;
  Eigen::Index lines_ = 0;
  Eigen::Index depth_ = 0;
};

}  // namespace detail

template <typename Scalar>
class PackedA {
 public:
  using Index = Eigen::Index;

  PackedA() = default;
  PackedA(Index m, Index k, Isa isa = active_isa()) { reserve(m, k, isa); }

  // Storage for any m x k operand up to these sizes packed for `isa`, so that pack() will not allocate.
  void reserve(Index m, Index k, Isa isa = active_isa()) {
    simd::with_gemm_kernel<Scalar>(isa, [&](auto kernel) { storage_.reserve(m, k, decltype(kernel)::mr); });
  }

  // A = a[m, k] (row-major, leading dimension lda >= k), for the kernels of `isa`.
  void pack(Index m, Index k, const Scalar* a, Index lda, Isa isa = active_isa()) {
    eigen_assert((m == 0 || k == 0 || lda >= k) && "sdpa::gemm::PackedA: lda is smaller than k");
    simd::with_gemm_kernel<Scalar>(isa, [&](auto kernel) {
      using K = decltype(kernel);
      storage_.template pack<K>(isa, m, k, K::mr,
                                [&](Index kcp, Index p0, Scalar* dst) { K::pack_a(m, kcp, a + p0, lda, dst); });
    });
  }

  Isa isa() const noexcept { return storage_.isa(); }
  Index rows() const noexcept { return storage_.lines(); }
  Index depth() const noexcept { return storage_.depth(); }
  const Scalar* data() const noexcept { return storage_.data(); }

 private:
  detail::PackedStorage<Scalar> storage_;
};

template <typename Scalar>
class PackedB {
 public:
  using Index = Eigen::Index;

  PackedB() = default;
  PackedB(Index k, Index n, Isa isa = active_isa()) { reserve(k, n, isa); }

  // Storage for any k x n operand up to these sizes packed for `isa`, so that pack_nt()/pack_nn() will not
  // allocate.
  void reserve(Index k, Index n, Isa isa = active_isa()) {
    simd::with_gemm_kernel<Scalar>(isa, [&](auto kernel) { storage_.reserve(n, k, decltype(kernel)::nr); });
  }

  // B = b^T for b[n, k] (row-major, ldb >= k): keys for q k^T, PyTorch's (out, in) weights for x W^T.
  void pack_nt(Index n, Index k, const Scalar* b, Index ldb, Isa isa = active_isa()) {
    eigen_assert((n == 0 || k == 0 || ldb >= k) && "sdpa::gemm::PackedB::pack_nt: ldb is smaller than k");
    simd::with_gemm_kernel<Scalar>(isa, [&](auto kernel) {
      using K = decltype(kernel);
      storage_.template pack<K>(isa, n, k, K::nr,
                                [&](Index kcp, Index p0, Scalar* dst) { K::pack_b_rows(n, kcp, b + p0, ldb, dst); });
    });
  }

  // B = b[k, n] (row-major, ldb >= n): values for p v.
  void pack_nn(Index k, Index n, const Scalar* b, Index ldb, Isa isa = active_isa()) {
    eigen_assert((n == 0 || k == 0 || ldb >= n) && "sdpa::gemm::PackedB::pack_nn: ldb is smaller than n");
    simd::with_gemm_kernel<Scalar>(isa, [&](auto kernel) {
      using K = decltype(kernel);
      storage_.template pack<K>(isa, n, k, K::nr, [&](Index kcp, Index p0, Scalar* dst) {
        K::pack_b_cols(n, kcp, b + p0 * ldb, ldb, dst);
      });
    });
  }

  Isa isa() const noexcept { return storage_.isa(); }
  Index depth() const noexcept { return storage_.depth(); }
  Index cols() const noexcept { return storage_.lines(); }
  const Scalar* data() const noexcept { return storage_.data(); }

 private:
  detail::PackedStorage<Scalar> storage_;
};

namespace detail {

// multiply's loops on kernel K: every item runs its k blocks in order, so it needs no other item's result
// and no buffer of its own. A is packed (a_packed) or read in place (a, lda).
// The epilogue's alpha, beta and bias (bias[j] on column j) are the call's; its `first` is ignored.
template <typename K, typename Scalar>
void multiply_blocks(Shape s, const Scalar* a_packed, Matrix<const Scalar> a_rows, const Scalar* b_packed,
                     Matrix<Scalar> c_rows, Epilogue<Scalar> call, const Eigen::ThreadPoolDevice* device) {
  using Index = Eigen::Index;
  const Index m = s.m, n = s.n, k = s.k, lda = a_rows.ld, ldc = c_rows.ld;
  const Scalar* a = a_rows.data;
  Scalar* c = c_rows.data;
  const Scalar alpha = call.alpha, beta = call.beta;
  const Scalar* bias = call.bias;
  const Blocking& bl = blocking_of<K, Scalar>();
  const Split split(m, n, bl, min_items<K>(worker_count(device)));
  const Index m_padded = round_up(m, K::mr), n_padded = round_up(n, K::nr);
  parallel_for(device, split.count(), 1, [&](Index t0, Index t1) {
    for (Index item = t0; item < t1; ++item) {
      const Index i0 = item / split.n_items * split.m_step;
      const Index j0 = item % split.n_items * split.n_step;
      const Index rows = std::min(split.m_step, m - i0);
      const Index cols = std::min(split.n_step, n - j0);
      for (Index p0 = 0; p0 < k; p0 += bl.kc) {
        const Index kcp = std::min(bl.kc, k - p0);
        const Epilogue<Scalar> ep{alpha, beta, bias != nullptr ? bias + j0 : nullptr, p0 == 0};
        const Scalar* pb = b_packed + p0 * n_padded + j0 * kcp;
        if (a_packed != nullptr)
          K::block({rows, cols, kcp}, a_packed + p0 * m_padded + i0 * kcp, pb, {c + i0 * ldc + j0, ldc}, ep);
        else
          K::block_in_place({rows, cols, kcp}, {a + i0 * lda + p0, lda}, pb, {c + i0 * ldc + j0, ldc}, ep);
      }
    }
  });
}

// multiply_blocks on the kernel of the path `isa`: the one function multiply calls, so that
// sdpa/instances.hpp compiles the kernels' tiles for the packed products once per program (with
// SDPA_EXTERN_TEMPLATES a caller's translation unit only calls it).
template <typename Scalar>
void multiply_packed(Isa isa, Shape s, const Scalar* a_packed, Matrix<const Scalar> a, const Scalar* b_packed,
                     Matrix<Scalar> c, Epilogue<Scalar> call, const Eigen::ThreadPoolDevice* device) {
  simd::with_gemm_kernel<Scalar>(
      isa, [&](auto kernel) { multiply_blocks<decltype(kernel), Scalar>(s, a_packed, a, b_packed, c, call, device); });
}

}  // namespace detail

// C[m, n] (ldc) = alpha * A B + beta * C, plus bias[j] on every row's column j when bias is given, for
// m = a.rows(), n = b.cols() and a.depth() == b.depth(), on the path both were packed for.
template <typename Scalar>
void multiply(const PackedA<Scalar>& a, const PackedB<Scalar>& b, detail::NoDeduceT<Scalar> alpha,
              detail::NoDeduceT<Scalar> beta, Scalar* c, Eigen::Index ldc,
              detail::NoDeduceT<const Scalar*> bias = nullptr, const Eigen::ThreadPoolDevice* device = nullptr) {
  using Index = Eigen::Index;
  eigen_assert(a.depth() == b.depth() && "sdpa::gemm::multiply: the packed operands' depths differ");
  eigen_assert(a.isa() == b.isa() && "sdpa::gemm::multiply: the operands were packed for different paths");
  const Index m = a.rows(), n = b.cols(), k = a.depth();
  eigen_assert((m == 0 || ldc >= n) && "sdpa::gemm::multiply: ldc is smaller than n");
  if (m == 0 || n == 0) return;
  if (k == 0 || alpha == Scalar(0)) {
    detail::scale_only(m, n, beta, bias, c, ldc);
    return;
  }
  detail::multiply_packed<Scalar>(a.isa(), {m, n, k}, a.data(), {}, b.data(), {c, ldc}, {alpha, beta, bias, true},
                                  device);
}

// C[m, n] = alpha * A B + beta * C (+ bias[n]) with A[m, b.depth()] read where it lies, on the path b
// was packed for.
template <typename Scalar>
void multiply(Eigen::Index m, Matrix<const Scalar> a_rows, const PackedB<Scalar>& b, detail::NoDeduceT<Scalar> alpha,
              detail::NoDeduceT<Scalar> beta, Matrix<Scalar> c_rows, detail::NoDeduceT<const Scalar*> bias = nullptr,
              const Eigen::ThreadPoolDevice* device = nullptr) {
  using Index = Eigen::Index;
  const Index n = b.cols(), k = b.depth(), ldc = c_rows.ld;
  Scalar* c = c_rows.data;
  eigen_assert(m >= 0 && "sdpa::gemm::multiply: negative m");
  eigen_assert((m == 0 || k == 0 || a_rows.ld >= k) && "sdpa::gemm::multiply: lda is smaller than k");
  eigen_assert((m == 0 || ldc >= n) && "sdpa::gemm::multiply: ldc is smaller than n");
  if (m <= 0 || n == 0) return;
  if (k == 0 || alpha == Scalar(0)) {
    detail::scale_only(m, n, beta, bias, c, ldc);
    return;
  }
  detail::multiply_packed<Scalar>(b.isa(), {m, n, k}, nullptr, a_rows, b.data(), c_rows, {alpha, beta, bias, true},
                                  device);
}

}  // namespace gemm
SDPA_NAMESPACE_END

#include "sdpa/detail/instances.inc"
SDPA_DETAIL_EXTERN_INSTANCES(MULTIPLY_PACKED)
