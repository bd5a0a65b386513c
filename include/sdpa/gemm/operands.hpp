// The operands of sdpa::gemm's products, so that an entry point takes a few views instead of a pointer and a
// leading dimension per matrix, sizes, device, workspace and path as positional arguments:
//   Shape           the product's sizes: C is m x n, the sums run over k
//   Matrix<Scalar>  a row-major matrix where it lies: element (i, j) at data[i * ld + j] (Scalar const for
//                   an operand that is only read)
//   Context<Scalar> where a product runs: the device's threads (null: the calling thread), the workspace
//                   that keeps its packing scratch (null: its own), the instruction-set path
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include "sdpa/cpu.hpp"
#include "sdpa/gemm/workspace.hpp"

SDPA_NAMESPACE_BEGIN
namespace gemm {

struct Shape {
  Eigen::Index m = 0;
  Eigen::Index n = 0;
  Eigen::Index k = 0;
};

template <typename Scalar>
struct Matrix {
  Scalar* data = nullptr;
  Eigen::Index ld = 0;
};

template <typename Scalar>
struct Context {
  const Eigen::ThreadPoolDevice* device = nullptr;
  Workspace<Scalar>* workspace = nullptr;
  Isa isa = active_isa();
};

}  // namespace gemm
SDPA_NAMESPACE_END
