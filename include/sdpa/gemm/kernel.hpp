// The kernel this build uses and the loop around it that covers one packed block: rows x cols of C from
// a k block of packed A (ceil(rows / mr) slivers; or A in place) and packed B (ceil(cols / nr) slivers).
// With AVX-512 or AVX2 the loop runs register-tile micro-kernels (A sliver outside, so that it stays in L1
// while the B slivers pass); without either, mr = nr = 1 makes a packed block a plain row-major matrix
// (A as [rows, kc], B as [cols, kc]) and the block is one Eigen product, which is correct on any target.
#pragma once

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>

#include "sdpa/gemm/blocking.hpp"
#include "sdpa/gemm/epilogue.hpp"
#include "sdpa/gemm/isa.hpp"
#include "sdpa/gemm/pack.hpp"

#if defined(SDPA_GEMM_ISA_AVX512)
#include "sdpa/gemm/microkernel_avx512.hpp"
#elif defined(SDPA_GEMM_ISA_AVX2)
#include "sdpa/gemm/microkernel_avx2.hpp"
#endif

namespace sdpa {
namespace gemm {
inline namespace SDPA_GEMM_ABI_NAMESPACE {
namespace detail {

#if defined(SDPA_GEMM_ISA_AVX512) || defined(SDPA_GEMM_ISA_AVX2)

template <typename Scalar>
struct Kernel {
  using Index = Eigen::Index;
#if defined(SDPA_GEMM_ISA_AVX512)
  using Micro = Avx512Kernel<Scalar>;
#else
  using Micro = Avx2Kernel<Scalar>;
#endif
  static constexpr Index mr = Micro::mr;
  static constexpr Index nr = Micro::nr;
  static constexpr bool kShapeDependentRounding = false;

  static void pack_a(Index rows, Index kc, const Scalar* a, Index lda, Scalar* dst) noexcept {
    Micro::template pack_rows<mr>(rows, kc, a, lda, dst);
  }
  static void pack_b_rows(Index cols, Index kc, const Scalar* b, Index ldb, Scalar* dst) noexcept {
    Micro::template pack_rows<nr>(cols, kc, b, ldb, dst);
  }
  static void pack_b_cols(Index cols, Index kc, const Scalar* b, Index ldb, Scalar* dst) noexcept {
    Micro::template pack_cols<nr>(cols, kc, b, ldb, dst);
  }

  static void block(Index kc, Index rows, Index cols, const Scalar* pa, const Scalar* pb, Scalar* c, Index ldc,
                    const Epilogue<Scalar>& ep) noexcept {
    for (Index i = 0; i < rows; i += mr) {
      // The first tile of a row prefetches the next row's A sliver: one sliver's worth of tiles ahead.
      Prefetch next_a;
      if (i + mr < rows) next_a = Prefetch{pa + mr * kc, mr * kc};
      row_of_tiles(kc, std::min(mr, rows - i), Packed{pa}, cols, pb, c + i * ldc, ldc, ep, next_a);
      pa += mr * kc;
    }
  }

  // The same with A read where it lies, a[rows, kc] with leading dimension lda (rows the caller has just
  // written: in cache, nothing to prefetch).
  static void block_in_place(Index kc, Index rows, Index cols, const Scalar* a, Index lda, const Scalar* pb, Scalar* c,
                             Index ldc, const Epilogue<Scalar>& ep) noexcept {
    for (Index i = 0; i < rows; i += mr) {
      row_of_tiles(kc, std::min(mr, rows - i), InPlace{a + i * lda, lda}, cols, pb, c + i * ldc, ldc, ep, NoPrefetch{});
    }
  }

  // A in place from L3 or memory (a projection's input): as block does for packed A, the first tile of a
  // row of tiles brings the next row's A segments to L2.
  static void block_rows(Index kc, Index rows, Index cols, const Scalar* a, Index lda, const Scalar* pb, Scalar* c,
                         Index ldc, const Epilogue<Scalar>& ep) noexcept {
    for (Index i = 0; i < rows; i += mr) {
      RowPrefetch next_a;
      if (i + mr < rows) next_a = RowPrefetch{a + (i + mr) * lda, lda, std::min(mr, rows - i - mr), kc};
      row_of_tiles(kc, std::min(mr, rows - i), InPlace{a + i * lda, lda}, cols, pb, c + i * ldc, ldc, ep, next_a);
    }
  }

 private:
  using Packed = PackedSliver<Scalar, mr>;
  using InPlace = RowsInPlace<Scalar>;
  using Prefetch = LinePrefetch<Scalar>;
  using RowPrefetch = RowLinesPrefetch<Scalar>;
  template <typename ASource, typename P>
  using TileFn = void (*)(Index, ASource, const Scalar*, Scalar*, Index, Index, const Epilogue<Scalar>&, P);

  // One row of tiles; only the first prefetches, so that the next sliver arrives one row of tiles ahead.
  template <typename ASource, typename P>
  static void row_of_tiles(Index kc, Index rows, ASource a, Index cols, const Scalar* pb, Scalar* c, Index ldc,
                           const Epilogue<Scalar>& ep, P next_a) noexcept {
    const TileFn<ASource, P> tile = tiles<ASource, P>()[static_cast<std::size_t>(rows - 1)];
    Epilogue<Scalar> e = ep;
    for (Index j = 0; j < cols; j += nr) {
      e.bias = ep.bias != nullptr ? ep.bias + j : nullptr;
      tile(kc, a, pb + j * kc, c + j, ldc, std::min(nr, cols - j), e, j == 0 ? next_a : P{});
    }
  }

  template <typename ASource, typename P, std::size_t... R>
  static constexpr std::array<TileFn<ASource, P>, sizeof...(R)> make_tiles(std::index_sequence<R...>) noexcept {
    return {{&Micro::template tile<static_cast<int>(R) + 1, ASource, P>...}};
  }
  // tiles()[r - 1] computes r rows: the bottom edge runs as many accumulator chains as it has rows.
  template <typename ASource, typename P>
  static const std::array<TileFn<ASource, P>, static_cast<std::size_t>(mr)>& tiles() noexcept {
    static constexpr std::array<TileFn<ASource, P>, static_cast<std::size_t>(mr)> table =
        make_tiles<ASource, P>(std::make_index_sequence<static_cast<std::size_t>(mr)>{});
    return table;
  }
};

#else  // SDPA_GEMM_ISA_EIGEN

template <typename Scalar>
struct Kernel {
  using Index = Eigen::Index;
  static constexpr Index mr = 1;
  static constexpr Index nr = 1;
  // Eigen's kernels take different code paths (and roundings) for different block shapes.
  static constexpr bool kShapeDependentRounding = true;

  static void pack_a(Index rows, Index kc, const Scalar* a, Index lda, Scalar* dst) noexcept {
    pack_rows<mr>(rows, kc, a, lda, dst);
  }
  static void pack_b_rows(Index cols, Index kc, const Scalar* b, Index ldb, Scalar* dst) noexcept {
    pack_rows<nr>(cols, kc, b, ldb, dst);
  }
  static void pack_b_cols(Index cols, Index kc, const Scalar* b, Index ldb, Scalar* dst) noexcept {
    pack_cols<nr>(cols, kc, b, ldb, dst);
  }

  static void block(Index kc, Index rows, Index cols, const Scalar* pa, const Scalar* pb, Scalar* c, Index ldc,
                    const Epilogue<Scalar>& ep) noexcept {
    block_in_place(kc, rows, cols, pa, kc, pb, c, ldc, ep);
  }

  static void block_rows(Index kc, Index rows, Index cols, const Scalar* a, Index lda, const Scalar* pb, Scalar* c,
                         Index ldc, const Epilogue<Scalar>& ep) noexcept {
    block_in_place(kc, rows, cols, a, lda, pb, c, ldc, ep);
  }

  static void block_in_place(Index kc, Index rows, Index cols, const Scalar* pa, Index lda, const Scalar* pb, Scalar* c,
                             Index ldc, const Epilogue<Scalar>& ep) noexcept {
    using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using Stride = Eigen::OuterStride<>;
    const Eigen::Map<const RowMatrix, Eigen::Unaligned, Stride> a(pa, rows, kc, Stride(lda));
    const Eigen::Map<const RowMatrix> b(pb, cols, kc);
    Eigen::Map<RowMatrix, Eigen::Unaligned, Stride> cm(c, rows, cols, Stride(ldc));
    if (!ep.first) {
      cm.noalias() += ep.alpha * a * b.transpose();
      return;
    }
    if (ep.beta == Scalar(0)) {
      cm.noalias() = ep.alpha * a * b.transpose();
    } else {
      cm *= ep.beta;
      cm.noalias() += ep.alpha * a * b.transpose();
    }
    if (ep.bias != nullptr) {
      cm.rowwise() += Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(ep.bias, cols);
    }
  }
};

#endif

}  // namespace detail

// The blocking of this build's kernel for Scalar on this machine (see blocking.hpp); computed once.
template <typename Scalar>
const Blocking& blocking() {
  using K = detail::Kernel<Scalar>;
  static const Blocking b = detail::compute_blocking(K::mr, K::nr, static_cast<Eigen::Index>(sizeof(Scalar)),
                                                     Eigen::l1CacheSize(), Eigen::l2CacheSize(), Eigen::l3CacheSize());
  return b;
}

}  // namespace SDPA_GEMM_ABI_NAMESPACE
}  // namespace gemm
}  // namespace sdpa
