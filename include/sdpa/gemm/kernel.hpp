// The micro-kernel concept the GEMM loops are written against, and the blocking of each kernel. A kernel K
// (sdpa::avx512::GemmKernel, sdpa::avx2::GemmKernel, sdpa::portable::GemmKernel; simd/dispatch.hpp picks
// one per call from the ISA) provides
//   K::mr, K::nr                 the register tile (rows of A broadcast, columns of B loaded per k step)
//   K::kShapeDependentRounding   whether an element's rounding depends on the block it falls in (Eigen's)
//   K::pack_a(rows, kc, a, lda, dst), K::pack_b_rows(cols, kc, b, ldb, dst) (B given as b[n, k]),
//   K::pack_b_cols(cols, kc, b, ldb, dst) (B given as b[k, n]): operands into mr- and nr-wide slivers
//   K::block({rows, cols, kc}, packed_a, packed_b, {c, ldc}, epilogue): rows x cols of C from one k block
//   K::block_in_place({rows, cols, kc}, {a, lda}, packed_b, {c, ldc}, epilogue): A read where it lies
//   K::block_rows(...): the same for A from L3 or memory (the next rows' A is prefetched to L2)
// and every element of C goes through the same operations whichever tile it falls in, so results do not
// depend on how the loops split the work.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include "sdpa/cpu.hpp"
#include "sdpa/gemm/blocking.hpp"
#include "sdpa/simd/dispatch.hpp"

SDPA_NAMESPACE_BEGIN
namespace gemm {

// The blocking of kernel K for its Scalar on the machine it runs on (see blocking.hpp); computed once per kernel.
template <typename K, typename Scalar>
const Blocking& blocking_of() {
  static const Blocking b = detail::compute_blocking(K::mr, K::nr, static_cast<Eigen::Index>(sizeof(Scalar)),
                                                     Eigen::l1CacheSize(), Eigen::l2CacheSize(), Eigen::l3CacheSize());
  return b;
}

// The blocking the kernels of `isa` use for Scalar (kc, the depth of every block, decides the order in
// which each element's products are summed).
template <typename Scalar>
const Blocking& blocking(Isa isa = active_isa()) {
  return simd::with_gemm_kernel<Scalar>(isa, [](auto kernel) -> const Blocking& {
    return blocking_of<decltype(kernel), Scalar>();
  });
}

}  // namespace gemm
SDPA_NAMESPACE_END
