// The score pipeline of one row segment, after the product has left scale * (q . k) in it: the
// multiplicative weights, the softcap (s = c tanh(s / c)), the additive bias, ALiBi's distance penalty, then
// -inf for every hidden key. Each
// step is a small function over a contiguous segment (vectorised by the compiler or Eigen), applied only to
// the keys the row sees; the forward, the probabilities, the decoding step and the backward pass all form
// their scores through ScorePipeline::apply, so they agree on every score bit for bit.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/program.hpp"
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/kernels/visibility.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

namespace detail {

template <typename Scalar>
using RowArray = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;

// x[j] *= view(b, h, q, k0 + j) (multiply) or += (add) for j < n, reading the broadcast row once.
template <typename Scalar>
void apply_broadcast_row(Scalar* x, Eigen::Index n, const BroadcastView<Scalar>& view, Eigen::Index b, Eigen::Index h,
                         Eigen::Index q, Eigen::Index k0, bool multiply) noexcept {
  const Eigen::Index stride = view.stride[3];
  const Scalar* data = view.data + view.row_offset(b, h, q) + k0 * stride;
  RowArray<Scalar> row(x, n);
  if (stride == 1) {
    const Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>> w(data, n);
    if (multiply) row *= w;
    else row += w;
  } else if (stride == 0) {
    if (multiply) row *= data[0];
    else row += data[0];
  } else {
    for (Eigen::Index j = 0; j < n; ++j) x[j] = multiply ? x[j] * data[j * stride] : x[j] + data[j * stride];
  }
}

}  // namespace detail

// Row (b, h, q)'s key range narrowed by a program's mask function (its `narrow`, in positions: the keys
// outside the interval it returns are hidden). Returns true when the function keeps every key of the
// narrowed range, so that the kernels need not ask it there.
template <typename Scalar, typename Program>
bool narrow_row(const Program& f, const AttentionProblem<Scalar>& p, Eigen::Index b, Eigen::Index h, Eigen::Index q,
                KeyRange& r) noexcept {
  using Index = Eigen::Index;
  const Index base = p.base(b);
  Index lo = r.lo + base, hi = r.hi + base;
  const bool exact = f.narrow(b + p.batch_base, h, p.position(b, q) + base, lo, hi);
  r.lo = std::max(r.lo, lo - base);
  r.hi = std::max(r.lo, std::min(r.hi, hi - base));
  return exact;
}

// A program's mask function over the keys of row (b, h, q)'s segment of the block of keys k0 .. (seg, from
// Visibility::segment; not none), and the mask tensor's holes there: the segment narrowed to the first and
// last key both keep, with its holes marked in `hidden` (one per key of the block, indexed like seg) when
// any lie between; none when no key is kept. With a plan, the function is asked only on the plan's partly
// visible blocks. (bool, whose stores the compiler knows do not alias the function's data, as char stores
// would.)
template <typename Scalar, typename Program>
void ask_mask(const Program& f, const Visibility<Scalar>& vis, Eigen::Index b, Eigen::Index h, Eigen::Index q,
              Eigen::Index k0, typename Visibility<Scalar>::Segment& seg, bool* hidden) {
  using Index = Eigen::Index;
  const AttentionProblem<Scalar>& p = vis.problem();
  const Index bb = b + p.batch_base, base = p.base(b), pos = p.position(b, q) + base, key0 = k0 + base;
  const Index lo = seg.lo, hi = seg.hi;
  // The keys kept, counted as they are marked (locals only: the loops store nothing else).
  Index kept = 0;
  const auto ask = [&](Index j0, Index j1) SDPA_ALWAYS_INLINE_LAMBDA {
    Index n = 0;
    for (Index j = j0; j < j1; ++j) {
      const bool v = f.visible(bb, h, pos, key0 + j);
      hidden[j] = !v;
      n += v ? 1 : 0;
    }
    kept += n;
  };
  const BlockMask* plan = f.plan();
  if (plan == nullptr) {
    ask(lo, hi);
  } else {
    const Index qb = q / plan->q_block(), kblock = plan->k_block();
    for (Index j0 = lo; j0 < hi;) {
      const Index key = k0 + j0, j1 = std::min(hi, (key / kblock + 1) * kblock - k0);
      const BlockState state = plan->at(bb, h, qb, key / kblock);
      if (state == BlockState::kPartial) {
        ask(j0, j1);
      } else {
        std::fill(hidden + j0, hidden + j1, state == BlockState::kNone);
        if (state == BlockState::kFull) kept += j1 - j0;
      }
      j0 = j1;
    }
  }
  if (!seg.solid)
    for (Index j = lo; j < hi; ++j)
      if (!hidden[j] && vis.masked(b, h, q, k0 + j)) {
        hidden[j] = true;
        --kept;
      }
  if (kept == 0) {
    seg = typename Visibility<Scalar>::Segment{};
    return;
  }
  // The first and the last key kept (a bool is one byte, 0 for false), then holes when fewer were kept than
  // lie between them.
  Index first = lo, last = hi;
  if (const void* found = std::memchr(hidden + lo, 0, static_cast<std::size_t>(hi - lo)))
    first = static_cast<const bool*>(found) - hidden;
  while (last - 8 >= first) {
    std::uint64_t word;
    std::memcpy(&word, hidden + last - 8, 8);
    if (word != 0x0101010101010101ull) break;
    last -= 8;
  }
  while (hidden[last - 1]) --last;
  seg.lo = first;
  seg.hi = last;
  seg.solid = kept == last - first;
  seg.holes = seg.solid ? nullptr : hidden;
}

// Whether key k0 + j of a row's segment (relative to k0, inside [seg.lo, seg.hi)) is hidden by its holes.
template <typename Scalar>
bool segment_hole(const typename Visibility<Scalar>::Segment& seg, const Visibility<Scalar>& vis, Eigen::Index b,
                  Eigen::Index h, Eigen::Index q, Eigen::Index k0, Eigen::Index j) noexcept {
  if (seg.solid) return false;
  return seg.holes != nullptr ? seg.holes[j] : vis.masked(b, h, q, k0 + j);
}

// Program: a score program (kernels/program.hpp) whose score function follows ALiBi, called with the
// query's position, before the hidden keys become -inf.
template <typename Scalar, typename Program = NoProgram>
class ScorePipeline {
 public:
  using Index = Eigen::Index;
  static constexpr Scalar kInf = std::numeric_limits<Scalar>::infinity();

  explicit ScorePipeline(const Visibility<Scalar>& visibility, const Program* program = nullptr) noexcept
      : vis_(visibility), p_(visibility.problem()), program_(program) {}

  // x[j] (j < n) holds scale * (q . k) of row (b, h, q) and key k0 + j, and r is the row's key range: turns
  // them into the final scores, -inf where hidden. Returns false when every key of the segment is hidden.
  bool apply(Scalar* x, Index n, Index b, Index h, Index q, Index k0, const KeyRange& r) const noexcept {
    return apply_segment(x, n, b, h, q, k0, vis_.segment(r, b, h, q, k0, n));
  }

  // The same with the row's visible segment already found (Visibility::segment, relative to k0).
  // pre (optional, indexed like x): receives the visible scores as the score function takes them.
  bool apply_segment(Scalar* x, Index n, Index b, Index h, Index q, Index k0,
                     const typename Visibility<Scalar>::Segment& seg, Scalar* pre = nullptr) const noexcept {
    if (seg.none()) {
      std::fill(x, x + n, -kInf);
      return false;
    }
    std::fill(x, x + seg.lo, -kInf);
    std::fill(x + seg.hi, x + n, -kInf);
    Scalar* y = x + seg.lo;
    const Index m = seg.hi - seg.lo, kbegin = k0 + seg.lo;
    if (p_.weights)
      detail::apply_broadcast_row(y, m, p_.weights, b, h, q, kbegin, /*multiply=*/true);
    if (p_.softcap > Scalar(0)) simd::softcap(p_.isa, y, m, p_.softcap);
    if (p_.bias)
      detail::apply_broadcast_row(y, m, p_.bias, b, h, q, kbegin, /*multiply=*/false);
    if (p_.alibi != nullptr) add_alibi(y, m, p_.alibi[h], p_.position(b, q) - kbegin);
    if constexpr (Program::kScore) {
      if (pre != nullptr) std::copy_n(y, m, pre + seg.lo);
      const Program& f = *program_;
      const Index bb = b + p_.batch_base, base = p_.base(b), pos = p_.position(b, q) + base, key = kbegin + base;
      if constexpr (Program::kScoreRow) f.score_row(y, m, bb, h, pos, key);
      else
        for (Index j = 0; j < m; ++j) y[j] = f.score(y[j], bb, h, pos, key + j);
    } else {
      (void)pre;
    }
    if (!seg.solid && seg.holes != nullptr) {
      const bool* holes = seg.holes + seg.lo;
      for (Index j = 0; j < m; ++j) y[j] = holes[j] ? -kInf : y[j];
    } else if (!seg.solid) {
      // Holes in the mask inside the range: the mask decides each key.
      const BroadcastView<bool>& mask = p_.mask;
      const Index stride = mask.stride[3];
      const bool* mk = mask.data + mask.row_offset(b, h, q) + kbegin * stride;
      if (stride == 1) {
        const unsigned char* bytes = reinterpret_cast<const unsigned char*>(mk);
        for (Index j = 0; j < m; ++j) y[j] = bytes[j] != 0 ? -kInf : y[j];
      } else {
        for (Index j = 0; j < m; ++j) y[j] = mk[j * stride] ? -kInf : y[j];
      }
    }
    return true;
  }

  // y[j] -= slope * |distance - j|, where distance = q' - (key of y[0]).
  static void add_alibi(Scalar* y, Index m, Scalar slope, Index distance) noexcept {
    for (Index j = 0; j < m; ++j) {
      const Index d = distance - j;
      y[j] -= slope * static_cast<Scalar>(d < 0 ? -d : d);
    }
  }

  const Visibility<Scalar>& visibility() const noexcept { return vis_; }
  const Program* program() const noexcept { return program_; }

 private:
  const Visibility<Scalar>& vis_;
  const AttentionProblem<Scalar>& p_;
  const Program* program_;
};

}  // namespace kernels
SDPA_NAMESPACE_END
