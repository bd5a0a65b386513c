// The score program the tiled kernels run (programmable attention, sdpa/flex.hpp): a score function
// applied to each visible score after the fixed options, a mask function that hides keys, and an optional
// block plan. A program is a compile-time policy, one more template argument of the kernels, whose
// functions are inlined into the tile loops. NoProgram is the empty one: the fixed options alone, the
// kernels' code as it was.
//
// A program P offers:
//   static constexpr bool kScore, kMask     whether it has a score / a mask function;
//   S score(S s, Index b, Index h, Index q, Index k) const   (S: Scalar, or flex::Dual<Scalar> backward);
//   static constexpr bool kScoreRow, void score_row(Scalar* y, Index m, b, h, q, Index k0) const
//                                                             score over a row's keys k0 .. k0 + m - 1 at
//                                                             once, bit for bit as score() per key;
//   bool visible(Index b, Index h, Index q, Index k) const   (true keeps the key);
//   bool narrow(Index b, Index h, Index q, Index& lo, Index& hi) const   narrows the key positions [lo, hi)
//                                                             to those the mask may keep; true when it
//                                                             keeps all of them (it need not be asked);
//   const BlockMask* plan() const                            (or null);
//   Index table_count() const, const void* table_id(Index), Index table_size(Index)  (the ScoreTables the
//                                                             score function reads, for their gradients).
// b is the batch entry (the sequence of a packed call), h the query head, q the query's position among the
// keys, k the key's position.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include "sdpa/flex/block_mask.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

struct NoProgram {
  using Index = Eigen::Index;
  static constexpr bool kScore = false, kMask = false, kScoreRow = false;
  template <typename Scalar>
  void score_row(Scalar*, Index, Index, Index, Index, Index) const noexcept {}
  template <typename S>
  S score(S s, Index, Index, Index, Index) const noexcept {
    return s;
  }
  bool visible(Index, Index, Index, Index) const noexcept { return true; }
  bool narrow(Index, Index, Index, Index&, Index&) const noexcept { return true; }
  const BlockMask* plan() const noexcept { return nullptr; }
  Index table_count() const noexcept { return 0; }
  const void* table_id(Index) const noexcept { return nullptr; }
  Index table_size(Index) const noexcept { return 0; }
};

}  // namespace kernels
SDPA_NAMESPACE_END
