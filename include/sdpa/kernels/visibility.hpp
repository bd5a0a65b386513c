// Which keys each query sees, as a range of keys per row rather than a test per score: causal, sliding
// windows and key lengths bound a row to an interval of keys; a mask tensor's row is summarised once as its
// run of unmasked keys (MaskRuns, computed before the tiles). The tiled kernels bound their key loop by
// these ranges and skip tiles that no row of a query block sees, so hidden tiles are never touched, and
// only a row whose mask has holes inside its range reads the mask again.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "sdpa/kernels/problem.hpp"
#include "sdpa/parallel.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// Where the unmasked keys of one mask row lie: all in [lo, hi), and when `solid` every key of [lo, hi) is
// unmasked (one run; none when lo == hi). Causal, key-padding and sliding-window rows are solid.
struct MaskRun {
  Eigen::Index lo = 0, hi = 0;
  bool solid = true;
};

// One MaskRun per distinct row of a broadcast mask, computed once before the tiles (in parallel): the
// mask's broadcast dimensions stay broadcast, so a causal (1, 1, nq, nk) mask gives nq runs for every
// batch and head.
class MaskRuns {
 public:
  using Index = Eigen::Index;

  MaskRuns(const BroadcastView<bool>& mask, Index batch, Index heads, Index nq, Index nk,
           const Eigen::ThreadPoolDevice* device)
      : mask_(mask),
        nh_(mask.stride[1] != 0 ? heads : 1),
        nr_(mask.stride[2] != 0 ? nq : 1),
        runs_(static_cast<std::size_t>((mask.stride[0] != 0 ? batch : 1) * nh_ * nr_)) {
    const Index n = static_cast<Index>(runs_.size());
    parallel_for(device, n, balanced_grain(device, n), [&](Index r0, Index r1) {
      for (Index r = r0; r < r1; ++r) {
        const Index q = r % nr_, bh = r / nr_;
        runs_[static_cast<std::size_t>(r)] = row_run(mask_.data + mask_.row_offset(bh / nh_, bh % nh_, q), nk);
      }
    });
  }

  const MaskRun& operator()(Index b, Index h, Index q) const noexcept {
    const Index r = ((mask_.stride[0] != 0 ? b : 0) * nh_ + (mask_.stride[1] != 0 ? h : 0)) * nr_ +
                    (mask_.stride[2] != 0 ? q : 0);
    return runs_[static_cast<std::size_t>(r)];
  }

 private:
  MaskRun row_run(const bool* m, Index nk) const noexcept {
    const Index stride = mask_.stride[3];
    MaskRun run;
    if (nk == 0) return run;
    if (stride == 0) {
      run.hi = m[0] ? 0 : nk;
      return run;
    }
    if (stride == 1) {
      // memchr is the library's fastest byte scan; a bool is stored as 0 or 1.
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(m);
      const void* first = std::memchr(bytes, 0, static_cast<std::size_t>(nk));
      if (first == nullptr) return run;  // every key masked
      run.lo = static_cast<const unsigned char*>(first) - bytes;
      const void* next = std::memchr(bytes + run.lo, 1, static_cast<std::size_t>(nk - run.lo));
      run.hi = next == nullptr ? nk : static_cast<const unsigned char*>(next) - bytes;
      std::uint32_t rest = 0;  // masked keys after the first run: all of them when the row is solid
      for (Index j = run.hi; j < nk; ++j) rest += bytes[j];
      if (static_cast<Index>(rest) == nk - run.hi) return run;
    } else {
      while (run.lo < nk && m[run.lo * stride]) ++run.lo;
      if (run.lo == nk) return {};
      run.hi = run.lo;
      while (run.hi < nk && !m[run.hi * stride]) ++run.hi;
      Index j = run.hi;
      while (j < nk && m[j * stride]) ++j;
      if (j == nk) return run;
    }
    run.solid = false;
    run.hi = nk;
    while (m[(run.hi - 1) * stride]) --run.hi;
    return run;
  }

  BroadcastView<bool> mask_;
  Index nh_, nr_;
  std::vector<MaskRun> runs_;
};

// The keys one row may see: every visible key lies in [lo, hi); when `solid`, every key of [lo, hi) is
// visible, otherwise the mask has holes inside the range.
struct KeyRange {
  Eigen::Index lo = 0, hi = 0;
  bool solid = true;

  bool empty() const noexcept { return hi <= lo; }
};

// Every rule that hides keys, per row: the problem's interval rules (causal, windows, key lengths) and its
// mask's runs.
template <typename Scalar>
class Visibility {
 public:
  using Index = Eigen::Index;

  Visibility(const AttentionProblem<Scalar>& p, const Eigen::ThreadPoolDevice* device) : p_(p) {
    if (p.mask) runs_ = std::make_unique<MaskRuns>(p.mask, p.batch, p.heads, p.nq, p.nk, device);
  }

  KeyRange row(Index b, Index h, Index q) const noexcept {
    const Index nk = p_.nk, pos = p_.position(b, q);
    Index lo = 0, hi = nk;
    // Windows wider than every distance behave as none (and cannot overflow the sums).
    const Index reach = nk + std::max<Index>(p_.nq, 0) + std::abs(p_.offset(b)) + std::abs(pos);
    if (p_.causal) hi = std::min(hi, pos + 1);
    if (p_.window_right >= 0) hi = std::min(hi, pos + std::min(p_.window_right, reach) + 1);
    if (p_.window_left >= 0) lo = std::max(lo, pos - std::min(p_.window_left, reach));
    if (p_.key_lengths != nullptr) hi = std::min(hi, p_.key_lengths[b]);
    KeyRange r{lo, hi, true};
    if (runs_) {
      const MaskRun& m = (*runs_)(b, h, q);
      r.lo = std::max(r.lo, m.lo);
      r.hi = std::min(r.hi, m.hi);
      r.solid = m.solid;
    }
    // One return, field by field: with two, GCC 12 built the struct on the stack and its callers read it
    // back with a wider load than the stores that wrote it (a store-forwarding stall per row).
    if (r.empty()) {
      r.lo = 0;
      r.hi = 0;
      r.solid = true;
    }
    return r;
  }

  // Whether key k, inside the row's range r, is masked (only a row that is not solid asks).
  bool masked(Index b, Index h, Index q, Index k) const noexcept { return p_.mask && p_.mask(b, h, q, k); }

  // Visible keys of range r among keys k0 .. k0 + n - 1, in segment coordinates: [lo, hi) bounds them;
  // `none` when the mask hides all of them. `first_last` narrows [lo, hi) to the first and last visible key
  // when the row is not solid (reading the mask).
  // `holes`, when set (a program's mask function, kernels/program.hpp), marks the hidden keys of a segment
  // that is not solid, one per key, indexed like the segment's lo and hi; otherwise the mask tensor
  // does.
  struct Segment {
    Index lo = 0, hi = 0;
    bool solid = true;
    const bool* holes = nullptr;
    bool none() const noexcept { return hi <= lo; }
  };
  Segment segment(const KeyRange& r, Index b, Index h, Index q, Index k0, Index n) const noexcept {
    Segment s;
    s.lo = std::clamp<Index>(r.lo - k0, 0, n);
    s.hi = std::clamp<Index>(r.hi - k0, s.lo, n);
    s.solid = r.solid;
    if (r.solid || s.none()) return s;
    // Narrow to the first and last unmasked key; none when every key in between is masked.
    const Index stride = p_.mask.stride[3];
    const bool* m = p_.mask.data + p_.mask.row_offset(b, h, q) + k0 * stride;
    while (s.lo < s.hi && m[s.lo * stride]) ++s.lo;
    while (s.hi > s.lo && m[(s.hi - 1) * stride]) --s.hi;
    if (s.none()) return Segment{};
    // Solid after all when nothing between is masked.
    Index masked = 0;
    if (stride == 1) {
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(m);
      std::uint32_t sum = 0;
      for (Index j = s.lo; j < s.hi; ++j) sum += bytes[j];
      masked = static_cast<Index>(sum);
    } else {
      for (Index j = s.lo; j < s.hi; ++j) masked += m[j * stride] ? 1 : 0;
    }
    s.solid = masked == 0;
    return s;
  }

  const AttentionProblem<Scalar>& problem() const noexcept { return p_; }

 private:
  const AttentionProblem<Scalar>& p_;
  std::unique_ptr<MaskRuns> runs_;
};

}  // namespace kernels
SDPA_NAMESPACE_END
