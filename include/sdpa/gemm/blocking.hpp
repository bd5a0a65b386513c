// Cache blocking of the GEMM's three outer loops, from the cache sizes Eigen reports (Eigen::l1CacheSize()
// and friends; a VM may report an inflated L3 figure). The loops follow
// BLIS's five-loop order with the roles of A and B as a row-major C wants them:
//   kc  the A sliver (mr x kc) that a micro-kernel broadcasts from takes at most half of L1, so that it
//       stays there while the B slivers of a whole block stream past it (the other half is for them);
//       rounded down to a multiple of 8, within [16, 1024]. Float, AVX-512, mr = 6: 1024; double: 512.
//   nc  the packed B block (kc x nc) that each worker sweeps once per A sliver takes at most half of L2;
//       rounded down to a multiple of nr. Float, AVX-512: 128 on a 1 MiB L2, 256 on a 2 MiB one. gemm_loops
//       widens it for a product shallower than kc, keeping the block's bytes.
//   mc  the block of A (mc x kc, read in place by gemm_loops, packed by PackedA) that all workers share
//       takes at most half of min(L3, 32 MiB): the cap because a VM's L3 figure may be the whole host's,
//       and a block past a few MiB buys nothing (B is packed once per mc rows, so its cost falls as 1/mc);
//       rounded down to a multiple of mr.
// kc depends on nothing but the kernel and the cache sizes, never on the problem or the thread count, so
// the order in which an element's products are summed is fixed for a given build and machine.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstddef>

SDPA_NAMESPACE_BEGIN
namespace gemm {

struct Blocking {
  Eigen::Index mr;  // micro-tile rows (A values broadcast per k step)
  Eigen::Index nr;  // micro-tile columns (B values loaded per k step)
  Eigen::Index mc;  // rows of A per packed block
  Eigen::Index kc;  // depth of every packed block; products are summed block by block in this order
  Eigen::Index nc;  // columns of B per packed block
};

namespace detail {

// The rule above for a micro-tile of mr x nr elements of `scalar_bytes` each; cache sizes in bytes (a size
// of 0 or less, which Eigen reports when it cannot tell, takes a small common value).
inline Blocking compute_blocking(Eigen::Index mr, Eigen::Index nr, Eigen::Index scalar_bytes, Eigen::Index l1,
                                 Eigen::Index l2, Eigen::Index l3) noexcept {
  using Index = Eigen::Index;
  l1 = l1 > 0 ? l1 : Index{32} << 10;
  l2 = l2 > 0 ? l2 : Index{256} << 10;
  l3 = l3 > 0 ? std::min(l3, Index{32} << 20) : Index{2} << 20;
  const Index kc = std::clamp<Index>(l1 / 2 / (mr * scalar_bytes) / 8 * 8, 16, 1024);
  const Index nc = std::max<Index>(nr, l2 / 2 / (kc * scalar_bytes) / nr * nr);
  const Index mc = std::max<Index>(mr, l3 / 2 / (kc * scalar_bytes) / mr * mr);
  return Blocking{mr, nr, mc, kc, nc};
}

}  // namespace detail
}  // namespace gemm
SDPA_NAMESPACE_END
