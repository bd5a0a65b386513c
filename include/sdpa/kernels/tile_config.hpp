// The tiled kernels' block sizes: how many queries and keys make one tile of scores and how many query
// blocks take turns on each key block, derived from the cache sizes (or forced by a caller, as tests do),
// and the tile counts a kernel reports.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>

SDPA_NAMESPACE_BEGIN
namespace kernels {

// Block sizes of the tiled kernel: block_k keys make one tile with block_q queries, and `group` query
// blocks take turns on each key block (so that its k and v come from cache after the first). A zero field
// means "derive it from the caches" (for_problem), so TileConfig{} is the default and a test can force
// tiny blocks with TileConfig{4, 8}.
struct TileConfig {
  Eigen::Index block_q = 0;
  Eigen::Index block_k = 0;
  Eigen::Index group = 0;
  // false: every tile multiplies its operands where they lie (gemm_nt / gemm_nn) instead of packing the
  // key, value and query blocks once for several tiles; the path the packing is tested against.
  bool pack_operands = true;

  // The rule, for `scalar_bytes`-wide elements and the per-core L2 size in bytes (at least 1 MiB, below).
  // Everything a group
  // touches should stay in L2: the k and v blocks (block_k x (d_k + d_v)) get an eighth of it, the score
  // tile (block_q x block_k) another eighth, and the group's q rows and output accumulators
  // (group x block_q x (d_k + d_v)) half, leaving the rest for their packed copies. With
  // `eigen_products` (tiles multiplied by Eigen's products: the portable path, and the backward pass's
  // transposed products on every path) each operand also stays within EIGEN_STACK_ALLOCATION_LIMIT, so
  // that Eigen packs them in its stack buffers instead of allocating per tile, and groups hold at most 8
  // query blocks. Without it (sdpa::gemm's products) only the cache bounds hold, and groups reach 16.
  // block_k is the same either way: it fixes the order in which a row's softmax and output sum the keys.
  // Sizes are powers of two, block_k in [16, 512], block_q in [16, 256]. (In the measurements behind the
  // rule, float, d = 64, with sdpa::gemm: on a 1 MiB L2 its 128 x 256 tiles in groups of 8 were within noise
  // of 128 x 512, 96 x 256 and 192 x 256, and smaller tiles and groups were slower; on a 2 MiB L2 the cache
  // bounds alone (128 x 512 in groups of 16) were faster than the stack bound's 64 x 512 in groups of 8:
  // bench/RESULTS.md.)
  static TileConfig for_caches(Eigen::Index scalar_bytes, Eigen::Index d_k, Eigen::Index d_v, Eigen::Index l2_bytes,
                               bool eigen_products = true) noexcept {
    scalar_bytes = std::max<Eigen::Index>(1, scalar_bytes);
    d_k = std::max<Eigen::Index>(1, d_k);
    d_v = std::max<Eigen::Index>(1, d_v);
    // An L2 under 1 MiB is taken as 1 MiB: on a smaller L2 backed by a large L3, the blocks of a 1 MiB
    // one, whose k and v blocks and group spill to L3, were faster than the blocks that fit in the
    // measurements behind this rule (bench/RESULTS.md): fewer, longer products per packed operand.
    l2_bytes = std::max<Eigen::Index>(l2_bytes, Eigen::Index(1) << 20);
    const auto floor_pow2 = [](Eigen::Index x) {
      Eigen::Index p = 1;
      while (2 * p <= x) p *= 2;
      return p;
    };
    const Eigen::Index eighth = l2_bytes / 8 / scalar_bytes;  // in elements
    const Eigen::Index packed = static_cast<Eigen::Index>(EIGEN_STACK_ALLOCATION_LIMIT) / scalar_bytes;
    TileConfig c;
    const Eigen::Index k_bound = max_block_k(scalar_bytes, d_k, d_v);
    c.block_k = std::clamp<Eigen::Index>(floor_pow2(std::min(eighth / (d_k + d_v), k_bound)), 16, 512);
    const Eigen::Index q_bound = eigen_products ? std::min(std::min(eighth, packed) / c.block_k, packed / d_k)
                                                : eighth / c.block_k;
    c.block_q = std::clamp<Eigen::Index>(floor_pow2(q_bound), 16, 256);
    c.group = std::clamp<Eigen::Index>(floor_pow2(4 * eighth / (c.block_q * (d_k + d_v))), 1, eigen_products ? 8 : 16);
    return c;
  }

  // The most keys a block may hold: its k or v block within EIGEN_STACK_ALLOCATION_LIMIT (see above).
  static Eigen::Index max_block_k(Eigen::Index scalar_bytes, Eigen::Index d_k, Eigen::Index d_v) noexcept {
    const Eigen::Index limit = static_cast<Eigen::Index>(EIGEN_STACK_ALLOCATION_LIMIT);
    const Eigen::Index packed = limit / std::max<Eigen::Index>(1, scalar_bytes);
    return std::max<Eigen::Index>(1, packed / std::max({d_k, d_v, Eigen::Index(1)}));
  }

  template <typename Scalar>
  static TileConfig for_problem(Eigen::Index d_k, Eigen::Index d_v, bool eigen_products = true) noexcept {
    return for_caches(static_cast<Eigen::Index>(sizeof(Scalar)), d_k, d_v,
                      static_cast<Eigen::Index>(Eigen::l2CacheSize()), eigen_products);
  }
};

// What the kernel did with its tiles, for tests and tuning: a tile is one (block of queries, block of keys)
// pair of one (batch, head).
struct TileStats {
  Eigen::Index tiles_computed = 0;
  Eigen::Index tiles_skipped = 0;  // every score masked: no product at all
};

}  // namespace kernels
SDPA_NAMESPACE_END
