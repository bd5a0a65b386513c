// The built-in mask functions of programmable attention, each with its analytic block plan (sdpa/flex.hpp):
// causal, sliding_window, chunked, document, prefix_lm, tree, and their combinations (and_masks, or_masks).
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
#include "sdpa/flex/traits.hpp"

SDPA_NAMESPACE_BEGIN
namespace flex {

// ---- Mask functions with their analytic plans ----
// plan(batch, heads, nq, nk, q_block, k_block): the exact block plan of the mask for a call of that shape,
// in O(blocks) (O(nk) more for document), without calling the function.
// narrow(b, h, q, lo, hi): narrows the key positions [lo, hi) to the interval outside which query q sees
// nothing, in O(1); returns true when q sees every key of the narrowed interval (the kernels then treat the
// row as they treat causal or a window: a range, without asking the function). A mask function of one's
// own may offer it too; it must never drop a key the function keeps.

// k <= q.
struct causal {
  bool operator()(Index, Index, Index q, Index k) const noexcept { return k <= q; }
  bool narrow(Index, Index, Index q, Index&, Index& hi) const noexcept {
    hi = std::min(hi, q + 1);
    return true;
  }
  BlockMask plan(Index, Index, Index nq, Index nk, Index q_block = 128, Index k_block = 128) const {
    return detail::plan_of(1, nq, nk, q_block, k_block,
                           [](Index, Index qa, Index qz, Index ka, Index kz) { return detail::classify(ka > qz, kz <= qa); });
  }
};

// q - left <= k <= q + right; a negative side is unbounded (sliding_window{W - 1, 0}: a causal window of W).
struct sliding_window {
  Index left = -1, right = -1;
  Index keep_from(Index p) const noexcept { return left >= 0 ? std::max<Index>(0, p - left) : 0; }
  bool operator()(Index, Index, Index q, Index k) const noexcept {
    return (left < 0 || k >= q - left) && (right < 0 || k <= q + right);
  }
  bool narrow(Index, Index, Index q, Index& lo, Index& hi) const noexcept {
    if (left >= 0) lo = std::max(lo, q - left);
    if (right >= 0) hi = std::min(hi, q + right + 1);
    return true;
  }
  BlockMask plan(Index, Index, Index nq, Index nk, Index q_block = 128, Index k_block = 128) const {
    const Index l = left, r = right;
    return detail::plan_of(1, nq, nk, q_block, k_block, [l, r](Index, Index qa, Index qz, Index ka, Index kz) {
      const bool none = (l >= 0 && kz < qa - l) || (r >= 0 && ka > qz + r);
      const bool full = (l < 0 || ka >= qz - l) && (r < 0 || kz <= qa + r);
      return detail::classify(none, full);
    });
  }
};

// Llama 4's chunked attention (attention_chunk_size): causal and in the query's chunk of `size` positions.
struct chunked {
  Index size = 1;
  Index keep_from(Index p) const noexcept { return std::max<Index>(0, floor_div(p) * size); }
  bool operator()(Index, Index, Index q, Index k) const noexcept { return k <= q && floor_div(k) == floor_div(q); }
  bool narrow(Index, Index, Index q, Index& lo, Index& hi) const noexcept {
    lo = std::max(lo, floor_div(q) * size);
    hi = std::min(hi, q + 1);
    return true;
  }
  BlockMask plan(Index, Index, Index nq, Index nk, Index q_block = 128, Index k_block = 128) const {
    const chunked c = *this;
    return detail::plan_of(1, nq, nk, q_block, k_block, [c](Index, Index qa, Index qz, Index ka, Index kz) {
      const bool none = ka > qz || kz < c.floor_div(qa) * c.size;
      const bool full = kz <= qa && c.floor_div(ka) == c.floor_div(qz);
      return detail::classify(none, full);
    });
  }
  void check(const char* where, Index, Index, Index, Index) const {
    if (size < 1) sdpa::detail::throw_invalid(where, "flex::chunked::size", "positive", size);
  }
  Index floor_div(Index x) const noexcept { return x >= 0 ? x / size : -((-x + size - 1) / size); }
};

// Packed documents: one id per key position of each batch entry (ids: batch rows of n, row-major); query
// q sees key k when both positions hold the same id. Not causal by itself: and_masks(document, causal).
// Positions outside [0, n), and batch entries past its rows (a packed call's), see nothing.
struct document {
  std::shared_ptr<const std::vector<Index>> ids;
  const Index* data = nullptr;  // ids->data(): what the function reads (a plain pointer it can keep in a register)
  Index batch = 1, n = 0;
  // Per position of each batch entry: the first and one past the last position holding its id (narrow),
  // and per batch entry whether every id's positions are one run (then a query sees exactly that span).
  std::shared_ptr<const std::vector<Index>> spans;
  std::shared_ptr<const std::vector<char>> runs;

  document() = default;
  document(std::vector<Index> ids_, Index batch_ = 1)
      : ids(std::make_shared<const std::vector<Index>>(std::move(ids_))), data(ids->data()), batch(batch_),
        n(batch_ > 0 ? static_cast<Index>(ids->size()) / batch_ : 0) {
    if (batch_ < 1 || static_cast<Index>(ids->size()) % batch_ != 0)
      sdpa::detail::throw_invalid("flex::document", "ids", sdpa::detail::concat("batch (", batch_, ") rows of equal length"),
                                  sdpa::detail::concat(ids->size(), " ids"));
    auto span = std::make_shared<std::vector<Index>>(static_cast<std::size_t>(2 * batch * n));
    auto run = std::make_shared<std::vector<char>>(static_cast<std::size_t>(batch), 1);
    std::vector<std::pair<Index, Index>> order(static_cast<std::size_t>(n));  // (id, position), sorted
    for (Index b = 0; b < batch; ++b) {
      const Index* row = data + b * n;
      for (Index x = 0; x < n; ++x) order[static_cast<std::size_t>(x)] = {row[x], x};
      std::sort(order.begin(), order.end());
      for (std::size_t i = 0; i < order.size();) {
        std::size_t j = i;
        while (j < order.size() && order[j].first == order[i].first) ++j;
        const Index first = order[i].second, last = order[j - 1].second;
        if (last - first + 1 != static_cast<Index>(j - i)) (*run)[static_cast<std::size_t>(b)] = 0;
        for (std::size_t e = i; e < j; ++e) {
          const auto x = static_cast<std::size_t>(b * n + order[e].second);
          (*span)[2 * x] = first;
          (*span)[2 * x + 1] = last + 1;
        }
        i = j;
      }
    }
    spans = std::move(span);
    runs = std::move(run);
  }
  bool operator()(Index b, Index, Index q, Index k) const noexcept {
    if (q < 0 || q >= n || k < 0 || k >= n || (batch != 1 && (b < 0 || b >= batch))) return false;
    const Index* row = data + (batch == 1 ? 0 : b) * n;
    return row[q] == row[k];
  }
  bool narrow(Index b, Index, Index q, Index& lo, Index& hi) const noexcept {
    if (q < 0 || q >= n || (batch != 1 && (b < 0 || b >= batch))) {
      hi = lo;
      return true;
    }
    const Index e = batch == 1 ? 0 : b;
    const Index* span = spans->data() + 2 * (e * n + q);
    lo = std::max(lo, span[0]);
    hi = std::min(hi, span[1]);
    return (*runs)[static_cast<std::size_t>(e)] != 0;
  }
  void check(const char* where, Index call_batch, Index, Index, Index nk) const {
    if (batch != 1 && batch != call_batch)
      sdpa::detail::throw_invalid(where, "flex::document's batch", sdpa::detail::concat("1 or the call's ", call_batch), batch);
    if (n != nk) sdpa::detail::throw_invalid(where, "flex::document's ids per batch entry", sdpa::detail::concat("one per key, ", nk), n);
  }
  BlockMask plan(Index, Index, Index nq, Index nk, Index q_block = 128, Index k_block = 128) const {
    // Per block of positions, the least and largest id (and whether a position lies outside the ids).
    struct Range {
      Index lo = std::numeric_limits<Index>::max(), hi = std::numeric_limits<Index>::min();
      bool outside = false;
    };
    const document& d = *this;
    const auto range = [&d](Index b, Index first, Index last) {
      Range r;
      for (Index x = first; x <= last; ++x) {
        if (x < 0 || x >= d.n) {
          r.outside = true;
          continue;
        }
        const Index id = d.ids->data()[(d.batch == 1 ? 0 : b) * d.n + x];
        r.lo = std::min(r.lo, id);
        r.hi = std::max(r.hi, id);
      }
      return r;
    };
    // Each block's range once: O(nq + nk) per batch entry, then O(1) per block.
    const Index offset = nk - nq, qbs = (nq + q_block - 1) / q_block, kbs = (nk + k_block - 1) / k_block;
    std::vector<Range> qr(static_cast<std::size_t>(batch * qbs)), kr(static_cast<std::size_t>(batch * kbs));
    for (Index b = 0; b < batch; ++b) {
      for (Index qb = 0; qb < qbs; ++qb)
        qr[static_cast<std::size_t>(b * qbs + qb)] = range(b, qb * q_block + offset, std::min(nq, (qb + 1) * q_block) - 1 + offset);
      for (Index kb = 0; kb < kbs; ++kb)
        kr[static_cast<std::size_t>(b * kbs + kb)] = range(b, kb * k_block, std::min(nk, (kb + 1) * k_block) - 1);
    }
    BlockMask plan(batch, 1, nq, nk, q_block, k_block);
    for (Index b = 0; b < batch; ++b)
      for (Index qb = 0; qb < qbs; ++qb)
        for (Index kb = 0; kb < kbs; ++kb) {
          const Range& a = qr[static_cast<std::size_t>(b * qbs + qb)];
          const Range& c = kr[static_cast<std::size_t>(b * kbs + kb)];
          const bool none = a.lo > a.hi || c.lo > c.hi || a.hi < c.lo || c.hi < a.lo;
          const bool full = !a.outside && !c.outside && a.lo == a.hi && c.lo == c.hi && a.lo == c.lo;
          plan.set(b, 0, qb, kb, detail::classify(none, full));
        }
    return plan;
  }
};

// Prefix-LM: key k visible when k < prefix[b] (the bidirectional prefix) or k <= q (causal after it).
struct prefix_lm {
  std::shared_ptr<const std::vector<Index>> prefix;  // one per batch entry, or one for all

  prefix_lm() = default;
  explicit prefix_lm(std::vector<Index> lengths) : prefix(std::make_shared<const std::vector<Index>>(std::move(lengths))) {}
  // (A batch entry past the lengths, as a packed call may make, has no prefix.)
  Index length(Index b) const noexcept {
    if (prefix->size() == 1) return prefix->front();
    return b >= 0 && static_cast<std::size_t>(b) < prefix->size() ? (*prefix)[static_cast<std::size_t>(b)] : 0;
  }
  bool operator()(Index b, Index, Index q, Index k) const noexcept { return k < length(b) || k <= q; }
  bool narrow(Index b, Index, Index q, Index&, Index& hi) const noexcept {
    hi = std::min(hi, std::max(length(b), q + 1));
    return true;
  }
  void check(const char* where, Index call_batch, Index, Index, Index) const {
    const Index n = prefix ? static_cast<Index>(prefix->size()) : 0;
    if (n != 1 && n != call_batch)
      sdpa::detail::throw_invalid(where, "flex::prefix_lm's lengths", sdpa::detail::concat("1 or one per batch entry (", call_batch, ")"), n);
  }
  BlockMask plan(Index batch, Index, Index nq, Index nk, Index q_block = 128, Index k_block = 128) const {
    const prefix_lm m = *this;
    const Index entries = prefix->size() == 1 ? 1 : batch;
    return detail::plan_of(entries, nq, nk, q_block, k_block, [m](Index b, Index qa, Index qz, Index ka, Index kz) {
      const Index p = m.length(b);
      return detail::classify(ka >= p && ka > qz, kz < p || kz <= qa);
    });
  }
};

// A tree of draft tokens (speculative decoding): n drafts at positions prefix + i (the call's last
// queries: in sdpa::attention prefix = nk - n; in a cache step, the cache's position before the step), with
// parents[i] an index j < i among the drafts or -1 (a root on the prefix); per batch entry (batch rows of
// n) or one tree for all. A draft sees every prefix key, its ancestors and itself.
struct tree {
  std::shared_ptr<const std::vector<std::uint8_t>> ancestor;  // (batch, n, n): j is i or an ancestor of i
  const std::uint8_t* data = nullptr;                         // ancestor->data()
  Index batch = 1, n = 0, prefix = 0;

  tree() = default;
  tree(const std::vector<Index>& parents, Index prefix_length, Index batch_ = 1) : batch(batch_), prefix(prefix_length) {
    const char* where = "flex::tree";
    if (batch_ < 1 || static_cast<Index>(parents.size()) % batch_ != 0)
      sdpa::detail::throw_invalid(where, "parents", sdpa::detail::concat("batch (", batch_, ") rows of equal length"),
                                  sdpa::detail::concat(parents.size(), " indices"));
    if (prefix_length < 0) sdpa::detail::throw_invalid(where, "prefix_length", "non-negative", prefix_length);
    n = static_cast<Index>(parents.size()) / batch_;
    auto a = std::make_shared<std::vector<std::uint8_t>>(static_cast<std::size_t>(batch_ * n * n), 0);
    for (Index b = 0; b < batch_; ++b)
      for (Index i = 0; i < n; ++i) {
        const Index parent = parents[static_cast<std::size_t>(b * n + i)];
        if (parent < -1 || parent >= i)
          sdpa::detail::throw_invalid(where, sdpa::detail::concat("parents[", b * n + i, "]"),
                                      sdpa::detail::concat("-1 or a draft before ", i), parent);
        std::uint8_t* row = a->data() + (b * n + i) * n;
        if (parent >= 0) std::copy_n(a->data() + (b * n + parent) * n, n, row);
        row[i] = 1;
      }
    ancestor = std::move(a);
    data = ancestor->data();
  }
  bool operator()(Index b, Index, Index q, Index k) const noexcept {
    if (k < prefix) return true;
    const Index i = q - prefix, j = k - prefix;
    if (i < 0 || i >= n || j >= n || (batch != 1 && (b < 0 || b >= batch))) return false;
    return data[((batch == 1 ? 0 : b) * n + i) * n + j] != 0;
  }
  // A draft sees no key after itself; a query outside the drafts sees the prefix alone.
  bool narrow(Index, Index, Index q, Index&, Index& hi) const noexcept {
    const Index i = q - prefix;
    if (i < 0 || i >= n) {
      hi = std::min(hi, prefix);
      return true;
    }
    hi = std::min(hi, q + 1);
    return false;
  }
  void check(const char* where, Index call_batch, Index, Index nq, Index) const {
    if (batch != 1 && batch != call_batch)
      sdpa::detail::throw_invalid(where, "flex::tree's batch", sdpa::detail::concat("1 or the call's ", call_batch), batch);
    if (nq > n) sdpa::detail::throw_invalid(where, "the call's queries", sdpa::detail::concat("at most the tree's drafts ", n), nq);
  }
  BlockMask plan(Index, Index, Index nq, Index nk, Index q_block = 128, Index k_block = 128) const {
    const Index p = prefix;
    return detail::plan_of(1, nq, nk, q_block, k_block,
                           [p](Index, Index, Index qz, Index ka, Index kz) { return detail::classify(ka > qz, kz < p); });
  }
};

// Both masks (and_masks) or either (or_masks); the plan, when both have one, is their plans' & or |.
template <typename A, typename B, bool kAnd>
struct combined_mask {
  A a;
  B b;
  // and: the later of the two; or: the earlier.
  Index keep_from(Index p) const noexcept {
    const Index x = detail::keep_from(a, p), y = detail::keep_from(b, p);
    return kAnd ? std::max(x, y) : std::min(x, y);
  }
  bool operator()(Index bb, Index h, Index q, Index k) const noexcept {
    return kAnd ? (a(bb, h, q, k) && b(bb, h, q, k)) : (a(bb, h, q, k) || b(bb, h, q, k));
  }
  // and: the intersection of the intervals (exact when both are); or: their hull (exact when both are and
  // they meet). A side without an interval leaves [lo, hi) as it is.
  bool narrow(Index bb, Index h, Index q, Index& lo, Index& hi) const noexcept {
    if constexpr (kAnd) {
      const bool exact_a = detail::narrow(a, bb, h, q, lo, hi);
      const bool exact_b = detail::narrow(b, bb, h, q, lo, hi);
      return exact_a && exact_b;
    } else {
      Index la = lo, ha = hi, lb = lo, hb = hi;
      const bool exact_a = detail::narrow(a, bb, h, q, la, ha), exact_b = detail::narrow(b, bb, h, q, lb, hb);
      if (la >= ha) {
        lo = lb;
        hi = hb;
        return exact_b;
      }
      if (lb >= hb) {
        lo = la;
        hi = ha;
        return exact_a;
      }
      lo = std::min(la, lb);
      hi = std::max(ha, hb);
      return exact_a && exact_b && la <= hb && lb <= ha;
    }
  }
  template <typename X = A, typename = std::enable_if_t<detail::has_plan<X>::value && detail::has_plan<B>::value>>
  BlockMask plan(Index batch, Index heads, Index nq, Index nk, Index q_block = 128, Index k_block = 128) const {
    const BlockMask x = a.plan(batch, heads, nq, nk, q_block, k_block), y = b.plan(batch, heads, nq, nk, q_block, k_block);
    return kAnd ? (x & y) : (x | y);
  }
  void check(const char* where, Index batch, Index heads, Index nq, Index nk) const {
    if constexpr (detail::has_check<A>::value) a.check(where, batch, heads, nq, nk);
    if constexpr (detail::has_check<B>::value) b.check(where, batch, heads, nq, nk);
  }
};
template <typename A, typename B>
combined_mask<A, B, true> and_masks(A a, B b) {
  return {std::move(a), std::move(b)};
}
template <typename A, typename B>
combined_mask<A, B, false> or_masks(A a, B b) {
  return {std::move(a), std::move(b)};
}

}  // namespace flex
SDPA_NAMESPACE_END
