// Ring attention's layout over the ranks (RingLayout: which rows of the sequence a rank holds), its options
// and statistics, and the helpers that place rows (ring_position) and cut a whole tensor into a rank's
// shard (ring_shard). sdpa/distributed/ring_attention.hpp holds the calls.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/distributed/mpi.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "sdpa/attention.hpp"
#include "sdpa/kernels/backward.hpp"
#include "sdpa/rotary.hpp"

SDPA_NAMESPACE_BEGIN

enum class RingLayout { kContiguous, kZigZag };

// What one ring call did, on this rank: its wall time, the part of it spent waiting on MPI (messages not
// yet arrived, or sends not yet taken), and what it sent.
struct RingStats {
  double seconds = 0;
  double wait_seconds = 0;
  std::int64_t messages = 0;
  std::int64_t bytes = 0;
};

struct RingOptions {
  RingLayout layout = RingLayout::kContiguous;
  // Rows of keys and values per message: 0 chooses min(1024, the rows of a chunk). Smaller: less memory
  // and finer overlap; larger: fewer, larger kernel calls.
  Eigen::Index block_rows = 0;
  RingStats* stats = nullptr;  // set: filled by the call
};

// The global row of local row i of `rank` among `ranks`, each holding local_rows rows (see RingLayout).
inline Eigen::Index ring_position(RingLayout layout, int rank, int ranks, Eigen::Index local_rows, Eigen::Index i) {
  if (layout == RingLayout::kContiguous) return static_cast<Eigen::Index>(rank) * local_rows + i;
  const Eigen::Index c = local_rows / 2;
  return i < c ? static_cast<Eigen::Index>(rank) * c + i : static_cast<Eigen::Index>(2 * ranks - 1 - rank) * c + (i - c);
}

// The rows of a whole (batch, heads, seq, dim) tensor (or (batch, seq, heads, dim) with Layout::kBNHD) that
// `rank` holds: seq / ranks of them, as ring_position places them. The sequence must divide among the ranks
// (into 2 * ranks chunks for kZigZag).
template <typename Scalar>
Tensor4<Scalar> ring_shard(const Tensor4<Scalar>& full, RingLayout layout, int rank, int ranks, Layout tensor_layout = Layout::kBHND) {
  const char* where = "ring_shard";
  if (ranks <= 0) detail::throw_invalid(where, "ranks", "positive", ranks);
  if (rank < 0 || rank >= ranks) detail::throw_invalid(where, "rank", detail::concat("in [0, ", ranks, ")"), rank);
  const int seq_axis = tensor_layout == Layout::kBHND ? 2 : 1;
  const Eigen::Index n = full.dimension(static_cast<std::size_t>(seq_axis)), parts = layout == RingLayout::kZigZag ? 2 * ranks : ranks;
  if (n % parts != 0)
    detail::throw_invalid(where, detail::concat("the sequence (dimension ", seq_axis, ")"),
                          detail::concat("a multiple of ", parts, layout == RingLayout::kZigZag ? " (2 chunks per rank)" : " (the ranks)"), n);
  const Eigen::Index local = n / ranks;
  std::array<Eigen::Index, 4> dims{full.dimension(0), full.dimension(1), full.dimension(2), full.dimension(3)};
  dims[static_cast<std::size_t>(seq_axis)] = local;
  Tensor4<Scalar> out(dims);
  const kernels::Heads<const Scalar> from = detail::heads_of(full.data(), full.dimensions(), tensor_layout);
  const kernels::Heads<Scalar> to = detail::heads_of(out.data(), out.dimensions(), tensor_layout);
  const std::array<Eigen::Index, 4> bh = detail::bhnd(dims, tensor_layout);
  for (Eigen::Index b = 0; b < bh[0]; ++b)
    for (Eigen::Index h = 0; h < bh[1]; ++h)
      for (Eigen::Index i = 0; i < local; ++i)
        std::copy_n(from.row(b, h, ring_position(layout, rank, ranks, local, i)), bh[3], to.row(b, h, i));
  return out;
}

SDPA_NAMESPACE_END
