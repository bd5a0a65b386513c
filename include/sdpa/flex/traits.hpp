// What the programmable attention's pieces share: the defaults (no score function, no mask function),
// the traits that tell which optional members a mask or score function offers (plan, check, narrow,
// keep_from, row, tables), and the helpers the built-ins' plans and rows are made of (sdpa/flex.hpp).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdpa/error.hpp"
#include "sdpa/flex/block_mask.hpp"
#include "sdpa/flex/dual.hpp"
#include "sdpa/flex/score_program.hpp"

SDPA_NAMESPACE_BEGIN
namespace flex {

using Index = Eigen::Index;

// The defaults: no score function, no mask function (the kernels then run without either).
struct noop_score {
  template <typename S>
  S operator()(S s, Index, Index, Index, Index) const noexcept {
    return s;
  }
};
struct all_visible {
  bool operator()(Index, Index, Index, Index) const noexcept { return true; }
};

namespace detail {

template <typename T, typename = void>
struct has_plan : std::false_type {};
template <typename T>
struct has_plan<T, std::void_t<decltype(std::declval<const T&>().plan(Index{}, Index{}, Index{}, Index{}, Index{}, Index{}))>>
    : std::true_type {};

template <typename T, typename = void>
struct has_check : std::false_type {};
template <typename T>
struct has_check<T, std::void_t<decltype(std::declval<const T&>().check("", Index{}, Index{}, Index{}, Index{}))>>
    : std::true_type {};

template <typename T, typename = void>
struct has_narrow : std::false_type {};
template <typename T>
struct has_narrow<T, std::void_t<decltype(std::declval<const T&>().narrow(Index{}, Index{}, Index{}, std::declval<Index&>(),
                                                                          std::declval<Index&>()))>> : std::true_type {};

// A mask function's interval (narrow below), or none: [lo, hi) left as it is, not exact.
template <typename T, typename = void>
struct has_keep_from : std::false_type {};
template <typename T>
struct has_keep_from<T, std::void_t<decltype(std::declval<const T&>().keep_from(Index{}))>> : std::true_type {};

// A mask's keep_from(p): the first key any query at p or later sees (0: unknown).
template <typename Mask>
Index keep_from(const Mask& m, Index p) noexcept {
  if constexpr (has_keep_from<Mask>::value) return m.keep_from(p);
  else return 0;
}

template <typename Mask>
bool narrow(const Mask& m, Index b, Index h, Index q, Index& lo, Index& hi) noexcept {
  if constexpr (has_narrow<Mask>::value) return m.narrow(b, h, q, lo, hi);
  else return false;
}

template <typename T, typename Scalar, typename = void>
struct has_row : std::false_type {};
template <typename T, typename Scalar>
struct has_row<T, Scalar, std::void_t<decltype(std::declval<const T&>().row(std::declval<Scalar*>(), Index{}, Index{}, Index{}, Index{}, Index{}))>>
    : std::true_type {};

template <typename T, typename Scalar, typename = void>
struct has_tables : std::false_type {};
template <typename T, typename Scalar>
struct has_tables<T, Scalar, std::void_t<decltype(std::declval<const T&>().tables())>>
    : std::is_convertible<decltype(std::declval<const T&>().tables()), std::vector<const ScoreTable<Scalar>*>> {};

// An analytic plan: state(b, qa, qz, ka, kz) classifies the block of query positions [qa, qz] and keys
// [ka, kz] (inclusive) in O(1); called once per block.
template <typename State>
BlockMask plan_of(Index batch, Index nq, Index nk, Index q_block, Index k_block, State state) {
  BlockMask plan(batch, 1, nq, nk, q_block, k_block);
  const Index offset = nk - nq;
  for (Index b = 0; b < batch; ++b)
    for (Index qb = 0; qb < plan.q_blocks(); ++qb) {
      const Index qa = qb * q_block + offset, qz = std::min(nq, (qb + 1) * q_block) - 1 + offset;
      for (Index kb = 0; kb < plan.k_blocks(); ++kb) {
        const Index ka = kb * k_block, kz = std::min(nk, (kb + 1) * k_block) - 1;
        plan.set(b, 0, qb, kb, state(b, qa, qz, ka, kz));
      }
    }
  return plan;
}

inline BlockState classify(bool none, bool full) noexcept {
  return none ? BlockState::kNone : full ? BlockState::kFull : BlockState::kPartial;
}

// y[j] += value(clamp(d0 + j, -reach, reach)) for j < m, where value(-reach) = before and value(reach) =
// after: the runs of keys at or beyond reach on either side get one constant each.
template <typename Scalar, typename Value>
void distance_runs(Scalar* y, Index m, Index d0, Index reach, Scalar before, Scalar after, Value value) noexcept {
  const Index left = std::clamp<Index>(-reach - d0 + 1, 0, m);   // d0 + j <= -reach below it
  const Index right = std::clamp<Index>(reach - d0, left, m);    // d0 + j >= reach from it on
  for (Index j = 0; j < left; ++j) y[j] = y[j] + before;
  for (Index j = left; j < right; ++j) y[j] = y[j] + value(d0 + j);
  for (Index j = right; j < m; ++j) y[j] = y[j] + after;
}

}  // namespace detail

}  // namespace flex
SDPA_NAMESPACE_END
