// What a micro-kernel does with its accumulators when it stores a tile of C. The k dimension is cut into
// blocks (see blocking.hpp); the first block's store applies beta and the bias, the later ones add their
// partial sums. Every element of C therefore goes through the same sequence of roundings whichever thread
// computes it and whichever tile (full or edge) it falls in, which is what makes results independent of
// the thread count.
#pragma once

#include "sdpa/gemm/isa.hpp"

namespace sdpa {
namespace gemm {
inline namespace SDPA_GEMM_ABI_NAMESPACE {
namespace detail {

template <typename Scalar>
struct Epilogue {
  Scalar alpha;
  Scalar beta;  // first block only; 0 means C is never read (it may hold NaN or be uninitialised)
  // First block only: bias[j] is added to every row's column j. Points at the tile's first column.
  const Scalar* bias;
  bool first;   // false: C += alpha * acc
};

}  // namespace detail
}  // namespace SDPA_GEMM_ABI_NAMESPACE
}  // namespace gemm
}  // namespace sdpa
