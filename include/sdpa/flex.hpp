// Programmable attention (PyTorch's FlexAttention, on the CPU, with gradients): a score function and a mask
// function written in C++, inlined into the tiled kernels, with an optional block plan that lets the
// kernels skip what the mask hides.
//
//   mask function   bool(Index b, Index h, Index q, Index k): true where query q of head h sees key k
//                   (FlexAttention's mask_mod: true KEEPS, the opposite of attention_mask);
//   score function  S(S s, Index b, Index h, Index q, Index k), written generically (`auto s`): called with
//                   a Scalar in the forward pass and with flex::Dual in the backward pass, which gives
//                   d result / d s and the gradients of the ScoreTables it reads (sdpa/flex/dual.hpp).
//                   Returning -inf hides the key (the row then follows softmax's rules: a row of -inf
//                   scores is NaN, as a -inf bias makes it); NaN makes the row NaN.
// b is the batch entry (a packed call's sequence), h the query head, q the query's position among the keys
// (q + nk - nq: lower-right, as every other option), k the key's position.
// Per score: s = scale * q.k, the weights, softcap, bias and ALiBi of AttentionOptions, then the score
// function; then every hidden key (attention_mask, causal, windows, key_lengths and the mask function) is
// -inf. A row the mask function hides entirely follows the MaskedRows policy.
//
//   auto program = sdpa::flex::program<float>(score, visible, plan);   // any of them may be the defaults
//   options.program = program;                                         // or the attention overloads below
//   out = sdpa::attention(q, k, v, options, state);  grads = sdpa::attention_backward(d_out, state);
//
// The built-ins (namespace sdpa::flex) are mask or score functions with analytic plans: causal,
// sliding_window, chunked, document, prefix_lm, tree; t5_buckets, distance_bias, alibi, softcap. Masks
// combine with and_masks / or_masks, plans with & and |.
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

#include "sdpa/attention.hpp"
#include "sdpa/error.hpp"
#include "sdpa/flex/block_mask.hpp"
#include "sdpa/flex/dual.hpp"
#include "sdpa/flex/score_program.hpp"
#include "sdpa/kernels/backward.hpp"
#include "sdpa/kernels/decode.hpp"
#include "sdpa/kernels/tiled.hpp"

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

// ---- Score functions ----
// row(y, m, b, h, q, k0) (optional): y[j] = f(y[j], b, h, q, k0 + j) for j < m, bit for bit as the function
// gives them, a row at a time (the forward pass uses it; the backward pass calls the function per score).

// T5's relative position buckets (transformers' T5Attention._relative_position_bucket of k - q, float32
// logarithms as it computes them): s + table(h, bucket). The table is (heads, num_buckets) and learnable.
// The buckets of every distance up to max_distance are computed once, when the function is made (beyond
// it the bucket is the last one, max_distance > the exact buckets being required).
template <typename Scalar>
struct t5_buckets {
  const ScoreTable<Scalar>* table = nullptr;
  bool bidirectional = true;
  Index num_buckets = 32, max_distance = 128;
  std::shared_ptr<const std::vector<std::int32_t>> lookup;  // bucket of distance r at r + max_distance
  const std::int32_t* buckets = nullptr;                      // lookup->data()

  t5_buckets() = default;
  t5_buckets(const ScoreTable<Scalar>* table_, bool bidirectional_, Index num_buckets_, Index max_distance_)
      : table(table_), bidirectional(bidirectional_), num_buckets(num_buckets_), max_distance(max_distance_) {
    const char* where = "flex::t5_buckets";
    if (num_buckets < 2 || (bidirectional && num_buckets < 4))
      sdpa::detail::throw_invalid(where, "num_buckets", bidirectional ? "at least 4" : "at least 2", num_buckets);
    const Index exact = (bidirectional ? num_buckets / 2 : num_buckets) / 2;
    if (max_distance <= exact)
      sdpa::detail::throw_invalid(where, "max_distance", sdpa::detail::concat("more than the exact buckets, ", exact), max_distance);
    auto l = std::make_shared<std::vector<std::int32_t>>(static_cast<std::size_t>(2 * max_distance + 1));
    for (Index r = -max_distance; r <= max_distance; ++r) (*l)[static_cast<std::size_t>(r + max_distance)] = static_cast<std::int32_t>(bucket(r));
    lookup = std::move(l);
    buckets = lookup->data();
  }

  // The bucket of relative position k - q, by transformers' formula.
  Index bucket(Index relative) const noexcept {
    Index half = num_buckets, result = 0;
    if (bidirectional) {
      half /= 2;
      if (relative > 0) result += half;
      relative = relative < 0 ? -relative : relative;
    } else {
      relative = relative < 0 ? -relative : 0;
    }
    const Index exact = half / 2;
    if (relative < exact) return result + relative;
    const float scaled = std::log(static_cast<float>(relative) / static_cast<float>(exact)) /
                         static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(exact))) *
                         static_cast<float>(half - exact);
    return result + std::min<Index>(exact + static_cast<Index>(scaled), half - 1);
  }
  template <typename S>
  S operator()(S s, Index, Index h, Index q, Index k) const noexcept {
    const Index r = std::clamp(k - q, -max_distance, max_distance);
    return s + table->at(s, h, buckets[r + max_distance]);
  }
  // Keys at max_distance or more on either side share the last bucket: two constant runs and the buckets
  // between them.
  void row(Scalar* y, Index m, Index b, Index h, Index q, Index k0) const noexcept {
    if (h < 0 || h >= table->rows() || table->cols() < num_buckets) {
      for (Index j = 0; j < m; ++j) y[j] = (*this)(y[j], b, h, q, k0 + j);
      return;
    }
    const Scalar* t = table->values().data() + h * table->cols();
    const std::int32_t* at = buckets + max_distance;  // the bucket of distance r at at[r]
    detail::distance_runs(y, m, k0 - q, max_distance, t[at[-max_distance]], t[at[max_distance]],
                          [t, at](Index r) { return t[at[r]]; });
  }
  std::vector<const ScoreTable<Scalar>*> tables() const { return {table}; }
  void check(const char* where, Index, Index heads, Index, Index) const {
    if (table == nullptr || buckets == nullptr) sdpa::detail::throw_invalid(where, "flex::t5_buckets::table", "a ScoreTable", "null");
    if (table->rows() != heads || table->cols() != num_buckets)
      sdpa::detail::throw_invalid(where, "flex::t5_buckets' table", sdpa::detail::concat("of shape (heads, num_buckets) = (", heads, ", ", num_buckets, ")"),
                                  sdpa::detail::concat("(", table->rows(), ", ", table->cols(), ")"));
  }
};

// A learned bias per (head, distance): s + table(h, clamp(k - q, -radius, radius) + radius), the table
// (heads, 2 radius + 1).
template <typename Scalar>
struct distance_bias {
  const ScoreTable<Scalar>* table = nullptr;
  Index radius = 0;

  template <typename S>
  S operator()(S s, Index, Index h, Index q, Index k) const noexcept {
    return s + table->at(s, h, std::clamp(k - q, -radius, radius) + radius);
  }
  void row(Scalar* y, Index m, Index b, Index h, Index q, Index k0) const noexcept {
    if (h < 0 || h >= table->rows() || radius < 0 || table->cols() < 2 * radius + 1) {
      for (Index j = 0; j < m; ++j) y[j] = (*this)(y[j], b, h, q, k0 + j);
      return;
    }
    const Scalar* t = table->values().data() + h * table->cols() + radius;  // distance r at t[r]
    detail::distance_runs(y, m, k0 - q, radius, t[-radius], t[radius], [t](Index r) { return t[r]; });
  }
  std::vector<const ScoreTable<Scalar>*> tables() const { return {table}; }
  void check(const char* where, Index, Index heads, Index, Index) const {
    if (table == nullptr) sdpa::detail::throw_invalid(where, "flex::distance_bias::table", "a ScoreTable", "null");
    if (table->rows() != heads || table->cols() != 2 * radius + 1)
      sdpa::detail::throw_invalid(where, "flex::distance_bias' table",
                                  sdpa::detail::concat("of shape (heads, 2 radius + 1) = (", heads, ", ", 2 * radius + 1, ")"),
                                  sdpa::detail::concat("(", table->rows(), ", ", table->cols(), ")"));
  }
};

// ALiBi as a score function: s - slopes[h] |q - k| (AttentionOptions::alibi_slopes' twin).
template <typename Scalar>
struct alibi {
  std::shared_ptr<const std::vector<Scalar>> slopes;

  alibi() = default;
  explicit alibi(std::vector<Scalar> s) : slopes(std::make_shared<const std::vector<Scalar>>(std::move(s))) {}
  template <typename S>
  S operator()(S s, Index, Index h, Index q, Index k) const noexcept {
    const Index d = q - k;
    return s - (*slopes)[static_cast<std::size_t>(h)] * static_cast<Scalar>(d < 0 ? -d : d);
  }
  void check(const char* where, Index, Index heads, Index, Index) const {
    const Index n = slopes ? static_cast<Index>(slopes->size()) : 0;
    if (n != heads) sdpa::detail::throw_invalid(where, "flex::alibi's slopes", sdpa::detail::concat("one per query head (", heads, ")"), n);
  }
};

// The softcap as a score function: cap tanh(s / cap) (AttentionOptions::softcap's twin).
template <typename Scalar>
struct softcap {
  Scalar cap = Scalar(1);
  template <typename S>
  S operator()(S s, Index, Index, Index, Index) const noexcept {
    return cap * flex::tanh(s / cap);
  }
  void check(const char* where, Index, Index, Index, Index) const {
    if (!(std::isfinite(cap) && cap > Scalar(0))) sdpa::detail::throw_invalid(where, "flex::softcap::cap", "finite and positive", cap);
  }
};

// ---- The program ----

template <typename Scalar, typename Score, typename Visible>
class FlexProgram final : public ScoreProgram<Scalar> {
 public:
  static constexpr bool kScore = !std::is_same<Score, noop_score>::value;
  static constexpr bool kMask = !std::is_same<Visible, all_visible>::value;
  static constexpr bool kScoreRow = detail::has_row<Score, Scalar>::value;

  FlexProgram(Score score, Visible visible, std::shared_ptr<const BlockMask> plan, std::vector<const ScoreTable<Scalar>*> tables)
      : score_(std::move(score)), visible_(std::move(visible)), plan_(std::move(plan)), tables_(std::move(tables)) {
    for (std::size_t i = 0; i < tables_.size(); ++i)
      if (tables_[i] == nullptr) sdpa::detail::throw_invalid("flex::program", sdpa::detail::concat("tables[", i, "]"), "a ScoreTable", "null");
  }

  template <typename S>
  S score(S s, Index b, Index h, Index q, Index k) const noexcept {
    return static_cast<S>(score_(s, b, h, q, k));
  }
  void score_row(Scalar* y, Index m, Index b, Index h, Index q, Index k0) const noexcept {
    if constexpr (kScoreRow) score_.row(y, m, b, h, q, k0);
  }
  bool visible(Index b, Index h, Index q, Index k) const noexcept { return visible_(b, h, q, k); }
  bool narrow(Index b, Index h, Index q, Index& lo, Index& hi) const noexcept { return detail::narrow(visible_, b, h, q, lo, hi); }
  const BlockMask* plan() const noexcept { return plan_.get(); }
  const void* table_id(Index i) const noexcept { return tables_[static_cast<std::size_t>(i)]; }
  Index table_size(Index i) const noexcept { return tables_[static_cast<std::size_t>(i)]->size(); }

  bool has_plan() const override { return plan_ != nullptr; }
  Index keep_from(Index position) const override { return kMask ? detail::keep_from(visible_, position) : 0; }
  Index table_count() const override { return static_cast<Index>(tables_.size()); }
  std::array<Index, 2> table_dims(Index i) const override {
    const ScoreTable<Scalar>& t = *tables_[static_cast<std::size_t>(i)];
    return {t.rows(), t.cols()};
  }
  void check(const char* where, Index batch, Index heads, Index nq, Index nk, bool packed) const override {
    if (plan_) {
      if (packed)
        sdpa::detail::throw_invalid(where, "the score program's BlockMask", "none in a packed call (each sequence has its own shape)",
                                    "given");
      plan_->check(where, batch, heads, nq, nk);
    }
    // Packed: the functions see each sequence as batch entry s, of its own length (not checked here).
    if (packed) return;
    if constexpr (detail::has_check<Score>::value) score_.check(where, batch, heads, nq, nk);
    if constexpr (detail::has_check<Visible>::value) visible_.check(where, batch, heads, nq, nk);
  }
  void forward(const kernels::AttentionProblem<Scalar>& p, Kernel kernel, kernels::DecodeWorkspace<Scalar>* workspace,
               const Eigen::ThreadPoolDevice* device) const override {
    if (kernel == Kernel::kAuto && p.compute == Compute::kFloat && kernels::decode_suits_program(p)) {
      kernels::DecodeWorkspace<Scalar> local;
      kernels::decode_attention_program(p, *this, workspace != nullptr ? *workspace : local, device);
    } else {
      kernels::tiled_attention_program(p, *this, device);
    }
  }
  kernels::BackwardStatus backward(const kernels::BackwardProblem<Scalar>& bp, const Eigen::ThreadPoolDevice* device) const override {
    return kernels::tiled_backward_program(bp, *this, device);
  }

 private:
  Score score_;
  Visible visible_;
  std::shared_ptr<const BlockMask> plan_;
  std::vector<const ScoreTable<Scalar>*> tables_;
};

// A program for AttentionOptions::program: a score function (noop_score: none), a mask function
// (all_visible: none), a plan (an empty BlockMask: none) and the tables the score function reads (a
// built-in's own are added). The functions are copied; the tables must outlive every call that uses the
// program, including attention_backward.
template <typename Scalar, typename Score = noop_score, typename Visible = all_visible>
std::shared_ptr<const ScoreProgram<Scalar>> program(Score score = {}, Visible visible = {}, BlockMask plan = {},
                                                    std::vector<const ScoreTable<Scalar>*> tables = {}) {
  if constexpr (detail::has_tables<Score, Scalar>::value) {
    for (const ScoreTable<Scalar>* t : score.tables())
      if (std::find(tables.begin(), tables.end(), t) == tables.end()) tables.push_back(t);
  }
  std::shared_ptr<const BlockMask> p = plan.empty() ? nullptr : std::make_shared<const BlockMask>(std::move(plan));
  return std::make_shared<const FlexProgram<Scalar, Score, Visible>>(std::move(score), std::move(visible), std::move(p),
                                                                      std::move(tables));
}

}  // namespace flex

// sdpa::attention with a score function, a mask function and an optional plan (copied): options.program
// made from them.
template <typename Q, typename K, typename V, typename Score, typename Visible>
Tensor4<detail::ScalarOf<Q>> attention(const Q& q, const K& k, const V& v, const AttentionOptions<detail::ScalarOf<Q>>& options,
                                       Score score, Visible visible, const BlockMask* plan = nullptr) {
  AttentionOptions<detail::ScalarOf<Q>> o = options;
  o.program = flex::program<detail::ScalarOf<Q>>(std::move(score), std::move(visible), plan != nullptr ? *plan : BlockMask{});
  return attention(q, k, v, o);
}

// The same, keeping in `state` what attention_backward needs (which then returns the tables' gradients).
template <typename Q, typename K, typename V, typename Score, typename Visible>
Tensor4<detail::ScalarOf<Q>> attention(const Q& q, const K& k, const V& v, const AttentionOptions<detail::ScalarOf<Q>>& options,
                                       Score score, Visible visible, const BlockMask* plan,
                                       AttentionState<detail::ScalarOf<Q>>& state) {
  AttentionOptions<detail::ScalarOf<Q>> o = options;
  o.program = flex::program<detail::ScalarOf<Q>>(std::move(score), std::move(visible), plan != nullptr ? *plan : BlockMask{});
  return attention(q, k, v, o, state);
}

SDPA_NAMESPACE_END
