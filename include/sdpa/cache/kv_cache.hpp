// sdpa::KVCache: the projected keys and values of one module's past tokens, per batch entry, for
// autoregressive decoding (ScaledDotProductAttention::append, attend and step, sdpa/module/decoding.hpp). Entries are stored as the
// projections leave them, (batch, capacity, heads * d) row-major, so a step projects its new keys and values
// straight into place and the kernels read every head through strides; the buffer grows like a
// std::vector. A cache also keeps the scratch a step needs, so that once it has the capacity a step
// allocates nothing. A sliding-window step may drop entries no later query can see (a rolling buffer); the
// entries held are then those of positions first_position() .. position() - 1.
//
// A float cache may store its entries narrower (sdpa::Storage): bfloat16 or float16 (half the bytes), or
// int8 with one float scale per (token, head) (symmetric absmax: a little over a quarter of the bytes).
// Entries are projected (and rotated) in float, then converted once as they are appended; the kernels widen
// a block of rows at a time while they compute, and keys() / values() / save_kv_cache read them back as
// stored, so nothing is silently widened or kept twice.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdpa/cache/draft_tree.hpp"
#include "sdpa/cache/step_scratch.hpp"
#include "sdpa/detail/buffer.hpp"
#include "sdpa/error.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class KVCache {
 public:
  using Index = Eigen::Index;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;

  // An empty cache for `batch` sequences of `module` (a ScaledDotProductAttention<Scalar>, or anything
  // that tells d_model(), kv_heads(), d_k() and d_v(); any module of the same shape can use the cache),
  // with room for `capacity` entries per sequence. It holds the module's kv_heads key/value heads
  // (grouped-query attention: h / kv_heads times less than h heads would). `storage`: how entries are
  // kept: Scalar itself by default; a KVCache<float> also takes kBFloat16, kFloat16 or kInt8.
  template <typename Module, typename = std::enable_if_t<!std::is_same<Module, KVCache>::value>,
            typename = decltype(std::declval<const Module&>().kv_heads())>
  KVCache(const Module& module, Index batch, Index capacity = 0, Storage storage = native_storage<Scalar>())
      : d_model_(module.d_model()), kv_heads_(module.kv_heads()), d_k_(module.d_k()), d_v_(module.d_v()),
        batch_(checked_nonnegative("KVCache", "batch", batch)), storage_(checked_storage("KVCache", storage)) {
    checked_nonnegative("KVCache", "capacity", capacity);
    reserve(capacity);
  }

  Index batch() const noexcept { return batch_; }
  Index size() const noexcept { return size_; }          // entries held per sequence
  Index capacity() const noexcept { return capacity_; }
  Index position() const noexcept { return position_; }  // tokens appended since construction or clear()
  Index first_position() const noexcept { return position_ - size_; }  // position of held entry 0

  Index d_model() const noexcept { return d_model_; }
  Index kv_heads() const noexcept { return kv_heads_; }
  Index d_k() const noexcept { return d_k_; }
  Index d_v() const noexcept { return d_v_; }
  Storage storage() const noexcept { return storage_; }

  // The bytes the entries take at the current capacity: keys and values in the storage type, plus int8's
  // scales (one float per token, head and tensor). The step scratch comes on top.
  std::size_t bytes() const noexcept {
    const std::size_t entries = static_cast<std::size_t>(batch_ * capacity_);
    std::size_t b = entries * static_cast<std::size_t>(kv_heads_ * (d_k_ + d_v_)) * storage_bytes(storage_);
    if (storage_ == Storage::kInt8) b += 2 * entries * static_cast<std::size_t>(kv_heads_) * sizeof(float);
    return b;
  }

  // Grows to hold `capacity` entries per sequence, keeping the content; never shrinks.
  void reserve(Index capacity) {
    checked_nonnegative("KVCache::reserve", "capacity", capacity);
    if (capacity <= capacity_) return;
    if (batch_ > 0 && capacity > std::numeric_limits<Index>::max() / batch_ / std::max(kv_heads_ * d_k_, kv_heads_ * d_v_))
      detail::throw_invalid("KVCache::reserve", "capacity", "representable as a number of elements", capacity);
    Store fresh = allocate(batch_, capacity);
    copy_entries(fresh, capacity, size_ + drafts());  // (pending drafts too)
    store_ = std::move(fresh);
    capacity_ = capacity;
  }

  // Empties the cache (positions start again at 0), keeping its capacity.
  void clear() noexcept {
    drafts_.clear();
    size_ = 0;
    position_ = 0;
  }

  // Drops the newest entries so that `size` remain (speculative decoding, retries); position() goes back
  // by as many.
  void truncate(Index size) {
    if (size < 0 || size > size_)
      detail::throw_invalid("KVCache::truncate", "size", detail::concat("in [0, ", size_, "] (the entries held)"), size);
    drafts_.clear();
    position_ -= size_ - size;
    size_ = size;
  }

  // Beam search: sequence i of the new cache is sequence rows[i] of this one (the batch may change size).
  void reorder(const std::vector<Index>& rows) {
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (rows[i] < 0 || rows[i] >= batch_)
        detail::throw_invalid("KVCache::reorder", detail::concat("rows[", i, "]"), detail::concat("in [0, ", batch_, ")"),
                              rows[i]);
    const Index batch = static_cast<Index>(rows.size());
    drafts_.clear();
    Store fresh = allocate(batch, capacity_);
    for (Index i = 0; i < batch; ++i) copy_sequence(fresh, i, capacity_, rows[static_cast<std::size_t>(i)], 0, size_);
    store_ = std::move(fresh);
    batch_ = batch;
  }

  // The held entries: (batch, size, kv_heads * d_k) projected keys (rotated, when the module has a rotary)
  // and (batch, size, kv_heads * d_v) values, features head-major as fc_k and fc_v give them; a narrow
  // cache's entries as stored, converted to Scalar exactly (int8: scale * q).
  Tensor3 keys() const { return held(false); }
  Tensor3 values() const { return held(true); }

  // Replaces the content (a saved cache being loaded): keys (batch, n, kv_heads * d_k) and values (batch, n,
  // kv_heads * d_v) become the entries of positions position - n .. position - 1; the batch follows keys. A
  // narrow cache rounds them to its storage (int8: quantises each token's heads).
  void assign(const Tensor3& keys, const Tensor3& values, Index position) {
    const char* where = "KVCache::assign";
    if (keys.dimension(2) != kv_heads_ * d_k_)
      detail::throw_invalid(where, "keys dimension 2 (kv_heads * d_k)", kv_heads_ * d_k_, keys.dimension(2));
    if (values.dimension(2) != kv_heads_ * d_v_)
      detail::throw_invalid(where, "values dimension 2 (kv_heads * d_v)", kv_heads_ * d_v_, values.dimension(2));
    if (values.dimension(0) != keys.dimension(0) || values.dimension(1) != keys.dimension(1))
      detail::throw_invalid(where, "values dimensions 0 and 1", detail::concat("those of keys, (", keys.dimension(0), ", ",
                                                                               keys.dimension(1), ")"),
                            detail::concat("(", values.dimension(0), ", ", values.dimension(1), ")"));
    if (position < keys.dimension(1))
      detail::throw_invalid(where, "position", detail::concat("at least the number of entries, ", keys.dimension(1)), position);
    KVCache fresh(*this, keys.dimension(0), keys.dimension(1));
    const Index n = keys.dimension(1), hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
    for (Index b = 0; b < fresh.batch_; ++b) {
      fresh.store_rows(false, b, 0, keys.data() + b * n * hk, hk, n);
      fresh.store_rows(true, b, 0, values.data() + b * n * hv, hv, n);
    }
    fresh.size_ = n;
    fresh.position_ = position;
    swap(fresh);
  }

  // Replaces the content with entries already in this cache's storage (load_kv_cache of a file saved from a
  // cache of the same storage: nothing is rounded twice). Bytes (batch, n, kv_heads * d) each, scales
  // (batch, n, kv_heads) for int8 (else null).
  void assign_stored(Index batch, Index n, const void* keys, const void* values, const float* key_scales,
                     const float* value_scales, Index position) {
    const char* where = "KVCache::assign_stored";
    if (batch < 0) detail::throw_invalid(where, "batch", "non-negative", batch);
    if (n < 0 || position < n) detail::throw_invalid(where, "position", detail::concat("at least the number of entries, ", n), position);
    if (storage_ == Storage::kInt8 && batch * n > 0 && (key_scales == nullptr || value_scales == nullptr))
      detail::throw_invalid(where, "key_scales and value_scales", "given for an int8 cache", "null");
    KVCache fresh(*this, batch, n);
    const std::size_t es = storage_bytes(storage_);
    const std::size_t hk = static_cast<std::size_t>(kv_heads_ * d_k_) * es, hv = static_cast<std::size_t>(kv_heads_ * d_v_) * es;
    const std::size_t rows = static_cast<std::size_t>(batch * n);
    if (rows > 0) {
      std::memcpy(fresh.store_.keys.data(), keys, rows * hk);
      std::memcpy(fresh.store_.values.data(), values, rows * hv);
      if (storage_ == Storage::kInt8) {
        std::copy_n(key_scales, rows * static_cast<std::size_t>(kv_heads_), fresh.store_.key_scales.data());
        std::copy_n(value_scales, rows * static_cast<std::size_t>(kv_heads_), fresh.store_.value_scales.data());
      }
    }
    fresh.size_ = n;
    fresh.position_ = position;
    swap(fresh);
  }

  void swap(KVCache& other) noexcept {
    using std::swap;
    swap(d_model_, other.d_model_);
    swap(kv_heads_, other.kv_heads_);
    swap(d_k_, other.d_k_);
    swap(d_v_, other.d_v_);
    swap(batch_, other.batch_);
    swap(capacity_, other.capacity_);
    swap(size_, other.size_);
    swap(position_, other.position_);
    swap(storage_, other.storage_);
    swap(store_, other.store_);
    swap(drafts_, other.drafts_);
    scratch_.swap(other.scratch_);
  }

  // The stored bytes of sequence b's held entries (row-major, kv_heads * d elements per entry) and, for
  // int8, its scales (kv_heads per entry): what save_kv_cache writes.
  const unsigned char* stored_keys(Index b) const noexcept { return bytes_of(store_.keys, b, kv_heads_ * d_k_); }
  const unsigned char* stored_values(Index b) const noexcept { return bytes_of(store_.values, b, kv_heads_ * d_v_); }
  const float* stored_key_scales(Index b) const noexcept { return scales_of(store_.key_scales, b); }
  const float* stored_value_scales(Index b) const noexcept { return scales_of(store_.value_scales, b); }

  // ---- For the decoding entry points (sdpa/module/decoding.hpp) ----
  // A step makes room, writes its new entries after the held ones (store_rows, or key_rows / value_rows for
  // a cache that stores Scalar) and then makes them held with advance(n).

  // Room for `extra` more entries per sequence, growing by at least doubling (pending drafts are dropped:
  // the new entries take their place).
  void make_room(Index extra) {
    checked_nonnegative("KVCache::make_room", "extra", extra);
    drafts_.clear();
    if (size_ + extra > capacity_) reserve(std::max(size_ + extra, 2 * capacity_));
  }

  // Entries [at, at + n) of sequence b, keys (values = false) or values, from n Scalar rows of kv_heads * d
  // (ld apart), converted to the storage. The caller keeps at + n within capacity().
  void store_rows(bool values, Index b, Index at, const Scalar* src, Index ld, Index n) {
    const Index d = values ? d_v_ : d_k_, width = kv_heads_ * d;
    unsigned char* dst = (values ? store_.values : store_.keys).data() +
                         static_cast<std::size_t>((b * capacity_ + at) * width) * storage_bytes(storage_);
    float* scales = storage_ == Storage::kInt8 ? (values ? store_.value_scales : store_.key_scales).data() +
                                                     (b * capacity_ + at) * kv_heads_
                                               : nullptr;
    detail::store_rows(storage_, src, ld, n, kv_heads_, d, dst, scales);
  }

  // The n entries written after the held ones become held: size() and position() grow by n.
  void advance(Index n) {
    if (n < 0 || size_ + n > capacity_)
      detail::throw_invalid("KVCache::advance", "n", detail::concat("in [0, ", capacity_ - size_, "] (the room after the entries held)"), n);
    size_ += n;
    position_ += n;
  }

  // Drops the oldest `count` entries (a sliding window's rolling buffer): positions are kept.
  void drop_front(Index count) {
    count = std::clamp<Index>(count, 0, size_);
    if (count == 0) return;
    drafts_.clear();
    for (Index b = 0; b < batch_; ++b) copy_sequence(store_, b, capacity_, b, count, size_ - count);
    size_ -= count;
  }

  // Whether entries are stored narrower than Scalar (then key_rows and value_rows must not be used).
  bool narrow() const noexcept { return is_narrow<Scalar>(storage_); }

  // Sequence b's entries (capacity() of kv_heads * d each) as Scalar, for a cache that stores Scalar itself:
  // a step projects straight into them.
  Scalar* key_rows(Index b) noexcept { return reinterpret_cast<Scalar*>(store_.keys.data()) + b * capacity_ * kv_heads_ * d_k_; }
  Scalar* value_rows(Index b) noexcept {
    return reinterpret_cast<Scalar*>(store_.values.data()) + b * capacity_ * kv_heads_ * d_v_;
  }
  const Scalar* key_rows(Index b) const noexcept {
    return reinterpret_cast<const Scalar*>(store_.keys.data()) + b * capacity_ * kv_heads_ * d_k_;
  }
  const Scalar* value_rows(Index b) const noexcept {
    return reinterpret_cast<const Scalar*>(store_.values.data()) + b * capacity_ * kv_heads_ * d_v_;
  }

  // The entries as the kernels read them (batch entry b's row i at b * capacity() + i), valid until the
  // cache next grows or is reordered or assigned.
  kernels::KVRows<Scalar> rows() const noexcept {
    kernels::KVRows<Scalar> r;
    const Index hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
    r.storage = storage_;
    if (narrow()) {
      r.k = {nullptr, capacity_ * hk, hk, d_k_};
      r.v = {nullptr, capacity_ * hv, hv, d_v_};
      r.k_stored = store_.keys.data();
      r.v_stored = store_.values.data();
      r.k_scales = scales_of(store_.key_scales, 0);
      r.v_scales = scales_of(store_.value_scales, 0);
      r.scale_batch_stride = capacity_ * kv_heads_;
    } else {
      r.k = {key_rows(0), capacity_ * hk, hk, d_k_};
      r.v = {value_rows(0), capacity_ * hv, hv, d_v_};
    }
    return r;
  }

  // The steps' scratch (sdpa/cache/step_scratch.hpp).
  detail::StepScratch<Scalar>& step_scratch() noexcept { return scratch_; }

  // ---- Speculative decoding (sdpa/cache/draft_tree.hpp) ----
  // A tree step (ScaledDotProductAttention::step_tree) stores its draft tokens after the held entries of
  // every sequence, pending until accept; anything that appends, truncates, reorders, clears or drops
  // entries discards them.

  Index drafts() const noexcept { return static_cast<Index>(drafts_.size()); }
  const std::vector<Index>& draft_parents() const noexcept { return drafts_; }

  // Keeps the drafts of `path` (a chain of the tree from under the sequences: path[0]'s parent -1,
  // path[i]'s parent path[i - 1]) in its order in every sequence and drops the others: the cache is then
  // as if the accepted tokens had been appended one by one (the same entries, positions and rotation).
  // An empty path accepts none. A path that is not such a chain is refused before anything changes.
  void accept(const std::vector<Index>& path) {
    detail::check_draft_path("KVCache::accept", drafts_, path);
    const Index n = static_cast<Index>(path.size());
    for (Index b = 0; b < batch_; ++b)
      for (Index i = 0; i < n; ++i)
        if (path[static_cast<std::size_t>(i)] != i)
          copy_sequence(store_, b, capacity_, b, size_ + path[static_cast<std::size_t>(i)], 1, size_ + i);
    drafts_.clear();
    size_ += n;
    position_ += n;
  }

  // For step_tree: the parents.size() entries after the held ones (stored after make_room) are drafts.
  void hold_drafts(std::vector<Index> parents) {
    if (size_ + static_cast<Index>(parents.size()) > capacity_)
      detail::throw_invalid("KVCache::hold_drafts", "parents",
                            detail::concat("at most ", capacity_ - size_, " drafts (the room after the entries held)"),
                            parents.size());
    (void)detail::draft_depths("KVCache::hold_drafts", parents);
    drafts_ = std::move(parents);
  }

 private:
  // Keys and values (bytes in the storage type) and int8's scales, each (batch, capacity, ...).
  struct Store {
    detail::Buffer<unsigned char> keys, values;
    detail::Buffer<float> key_scales, value_scales;
    void swap(Store& o) noexcept {
      std::swap(keys, o.keys);
      std::swap(values, o.values);
      std::swap(key_scales, o.key_scales);
      std::swap(value_scales, o.value_scales);
    }
    friend void swap(Store& a, Store& b) noexcept { a.swap(b); }
  };

  // An empty cache of this one's shape and storage.
  KVCache(const KVCache& shape, Index batch, Index capacity)
      : d_model_(shape.d_model_), kv_heads_(shape.kv_heads_), d_k_(shape.d_k_), d_v_(shape.d_v_), batch_(batch),
        storage_(shape.storage_) {
    reserve(capacity);
  }

  static Index checked_nonnegative(const char* where, const char* name, Index value) {
    if (value < 0) detail::throw_invalid(where, name, "non-negative", value);
    return value;
  }

  static Storage checked_storage(const char* where, Storage s) {
    const bool is_float = std::is_same<Scalar, float>::value;
    const bool known = s == Storage::kFloat32 || s == Storage::kBFloat16 || s == Storage::kFloat16 ||
                       s == Storage::kInt8 || s == Storage::kFloat64;
    if (!known) detail::throw_invalid(where, "storage", "a sdpa::Storage", static_cast<int>(s));
    if (is_float && s == Storage::kFloat64)
      detail::throw_invalid(where, "storage", "kFloat32, kBFloat16, kFloat16 or kInt8 for a KVCache<float>", storage_name(s));
    if (!is_float && s != Storage::kFloat64)
      detail::throw_invalid(where, "storage",
                            "kFloat64 for a KVCache<double> (narrow storage needs a KVCache<float>: the kernels "
                            "compute in float)",
                            storage_name(s));
    return s;
  }

  Store allocate(Index batch, Index capacity) const {
    Store s;
    const std::size_t es = storage_bytes(storage_), entries = static_cast<std::size_t>(batch * capacity);
    s.keys.reset(entries * static_cast<std::size_t>(kv_heads_ * d_k_) * es);
    s.values.reset(entries * static_cast<std::size_t>(kv_heads_ * d_v_) * es);
    if (storage_ == Storage::kInt8) {
      s.key_scales.reset(entries * static_cast<std::size_t>(kv_heads_));
      s.value_scales.reset(entries * static_cast<std::size_t>(kv_heads_));
    }
    return s;
  }

  // count entries of sequence `from` starting at entry `from_at` of this cache into sequence `to` at entry
  // to_at of `dst` (whose capacity is dst_capacity).
  void copy_sequence(Store& dst, Index to, Index dst_capacity, Index from, Index from_at, Index count,
                     Index to_at = 0) const {
    if (count <= 0) return;
    const std::size_t es = storage_bytes(storage_);
    const auto copy = [&](unsigned char* d, const unsigned char* s, Index width) {
      const std::size_t row = static_cast<std::size_t>(width) * es;
      std::memmove(d + static_cast<std::size_t>(to * dst_capacity + to_at) * row,
                   s + static_cast<std::size_t>(from * capacity_ + from_at) * row,
                   static_cast<std::size_t>(count) * row);
    };
    copy(dst.keys.data(), store_.keys.data(), kv_heads_ * d_k_);
    copy(dst.values.data(), store_.values.data(), kv_heads_ * d_v_);
    if (storage_ == Storage::kInt8) {
      const Index g = kv_heads_;
      std::memmove(dst.key_scales.data() + (to * dst_capacity + to_at) * g,
                   store_.key_scales.data() + (from * capacity_ + from_at) * g,
                   static_cast<std::size_t>(count * g) * sizeof(float));
      std::memmove(dst.value_scales.data() + (to * dst_capacity + to_at) * g,
                   store_.value_scales.data() + (from * capacity_ + from_at) * g,
                   static_cast<std::size_t>(count * g) * sizeof(float));
    }
  }

  void copy_entries(Store& dst, Index dst_capacity, Index count) const {
    for (Index b = 0; b < batch_ && count > 0; ++b) copy_sequence(dst, b, dst_capacity, b, 0, count);
  }

  const unsigned char* bytes_of(const detail::Buffer<unsigned char>& buf, Index b, Index width) const noexcept {
    return buf.data() + static_cast<std::size_t>(b * capacity_ * width) * storage_bytes(storage_);
  }
  const float* scales_of(const detail::Buffer<float>& buf, Index b) const noexcept {
    return storage_ == Storage::kInt8 ? buf.data() + b * capacity_ * kv_heads_ : nullptr;
  }

  Tensor3 held(bool values) const {
    const Index d = values ? d_v_ : d_k_, width = kv_heads_ * d;
    Tensor3 out(batch_, size_, width);
    for (Index b = 0; b < batch_; ++b)
      detail::load_rows(storage_, bytes_of(values ? store_.values : store_.keys, b, width), size_, kv_heads_, d,
                        scales_of(values ? store_.value_scales : store_.key_scales, b), out.data() + b * size_ * width);
    return out;
  }

  Index d_model_, kv_heads_, d_k_, d_v_;
  Index batch_ = 0, capacity_ = 0, size_ = 0, position_ = 0;
  Storage storage_ = native_storage<Scalar>();
  Store store_;
  std::vector<Index> drafts_;  // the pending drafts' parents
  detail::StepScratch<Scalar> scratch_;
};

SDPA_NAMESPACE_END
