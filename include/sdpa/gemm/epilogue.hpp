// What a micro-kernel reads and what it does with its accumulators. A comes either packed (mr values per
// k step, contiguous) or in place (rows of a row-major matrix, for an operand used once, where packing
// would cost more than it saves). The k dimension is cut into blocks (see blocking.hpp); the first
// block's store applies beta and the bias, the later ones add their partial sums. Every element of C
// therefore goes through the same sequence of roundings whichever thread computes it and whichever tile
// (full or edge) it falls in, which is what makes results independent of the thread count.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <cstddef>
#include <cstdint>

SDPA_NAMESPACE_BEGIN
namespace gemm {
namespace detail {

// A packed sliver: value r of k step p at a[p * Stride + r].
template <typename Scalar, Eigen::Index Stride>
struct PackedSliver {
  const Scalar* a;
  const Scalar* ptr(int r) const noexcept { return a + r; }
  static constexpr Eigen::Index offset(int u) noexcept { return u * Stride; }  // of step u from the current one
  void step(Eigen::Index n) noexcept { a += n * Stride; }
};

// Rows of A where they lie: value r of k step p at a[r * lda + p].
template <typename Scalar>
struct RowsInPlace {
  const Scalar* a;
  Eigen::Index lda;
  const Scalar* ptr(int r) const noexcept { return a + r * lda; }
  static constexpr Eigen::Index offset(int u) noexcept { return u; }
  void step(Eigen::Index n) noexcept { a += n; }
};

// Lines a micro-kernel brings to L2 while it runs, one per k step: `rows` segments of `width` values, ld
// apart, 64 bytes at a time (the next packed A sliver: one segment of mr * kc values; the next row of tiles'
// A rows in place: mr segments of kc). The default prefetches nothing (A in place that the caller has just
// written). One type for every case, so that each micro-kernel is compiled once per A source.
template <typename Scalar>
struct LinePrefetch {
  static constexpr Eigen::Index kLine = 64 / static_cast<Eigen::Index>(sizeof(Scalar));
  const Scalar* base = nullptr;
  Eigen::Index ld = 0;
  Eigen::Index rows = 0;
  Eigen::Index width = 0;
  Eigen::Index row = 0;
  Eigen::Index done = 0;
  // The line to fetch at this step, or null once all are.
  const Scalar* next() noexcept {
    if (row >= rows) return nullptr;
    const Scalar* line = base + row * ld + done;
    done += kLine;
    if (done >= width) {
      done = 0;
      ++row;
    }
    return line;
  }
  // For a loop that walks the lines itself: lines per segment, the lines next() has still to give, and
  // the state after n more calls of next() (at most remaining()).
  Eigen::Index lines_per_segment() const noexcept { return (width + kLine - 1) / kLine; }
  Eigen::Index remaining() const noexcept {
    const Eigen::Index per = lines_per_segment();
    return row >= rows || per <= 0 ? 0 : (rows - row) * per - done / kLine;
  }
  void advance(Eigen::Index n) noexcept {
    const Eigen::Index per = lines_per_segment();
    if (per <= 0) return;
    const Eigen::Index position = row * per + done / kLine + n;
    row = position / per;
    done = position % per * kLine;
  }
};

template <typename Scalar>
struct Epilogue {
  Scalar alpha;
  Scalar beta;  // first block only; 0 means C is never read (it may hold NaN or be uninitialised)
  // First block only: bias[j] is added to every row's column j. Points at the tile's first column.
  const Scalar* bias;
  bool first;  // false: C += alpha * acc
};

// The arguments of an ISA's full-tile k loop in assembly (simd/avx512_tile.hpp, simd/avx2_tile.hpp), read
// from memory by the asm statement (one operand instead of eleven, which leaves room for the accumulator
// outputs within GCC's limit of 30 operands). The register each field goes to is the loops' contract.
struct TileLoopArgs {
  const char* a;             // r8
  const char* a3;            // r9: a + 3 * row_bytes
  std::int64_t row_bytes;    // r10
  const char* b;             // r11
  std::int64_t iterations;   // r12: kc / 4
  std::int64_t rem;          // r13: kc % 4
  const char* line;          // rax
  std::int64_t seg_left;     // rcx
  std::int64_t seg_lines;    // rdx
  std::int64_t seg_skip;     // rsi
  std::int64_t rows_left;    // rdi
};
static_assert(sizeof(const char*) == 8 && offsetof(TileLoopArgs, rows_left) == 80,
              "TileLoopArgs: the asm statements read its fields at offsets 0, 8, ..., 80");

}  // namespace detail
}  // namespace gemm
SDPA_NAMESPACE_END
