// sdpa::KVCache: the projected keys and values of one module's past tokens, per batch entry, for
// autoregressive decoding (ScaledDotProductAttention::append, attend and step). Entries are stored as the
// projections leave them, (batch, capacity, heads * d) row-major, so a step projects its new keys and values
// straight into place and the kernels read every head through strides; the buffer grows like a
// std::vector. A cache also keeps the scratch a step needs, so that once it has the capacity a step
// allocates nothing. A sliding-window step may drop entries no later query can see (a rolling buffer); the
// entries held are then those of positions first_position() .. position() - 1.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "sdpa/detail/buffer.hpp"
#include "sdpa/error.hpp"
#include "sdpa/kernels/decode.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class KVCache {
 public:
  using Index = Eigen::Index;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;

  // An empty cache for `batch` sequences of `module` (any module with the same d_model, kv_heads, d_k and
  // d_v can use it), with room for `capacity` entries per sequence. It holds the module's kv_heads
  // key/value heads (grouped-query attention: h / kv_heads times less than h heads would).
  KVCache(const ScaledDotProductAttention<Scalar>& module, Index batch, Index capacity = 0)
      : d_model_(module.d_model()), kv_heads_(module.kv_heads()), d_k_(module.d_k()), d_v_(module.d_v()),
        batch_(checked_nonnegative("KVCache", "batch", batch)) {
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

  // Grows to hold `capacity` entries per sequence, keeping the content; never shrinks.
  void reserve(Index capacity) {
    checked_nonnegative("KVCache::reserve", "capacity", capacity);
    if (capacity <= capacity_) return;
    if (batch_ > 0 && capacity > std::numeric_limits<Index>::max() / batch_ / std::max(kv_heads_ * d_k_, kv_heads_ * d_v_))
      detail::throw_invalid("KVCache::reserve", "capacity", "representable as a number of elements", capacity);
    detail::Buffer<Scalar> keys(static_cast<std::size_t>(batch_ * capacity * kv_heads_ * d_k_));
    detail::Buffer<Scalar> values(static_cast<std::size_t>(batch_ * capacity * kv_heads_ * d_v_));
    copy_entries(keys.data(), values.data(), capacity, keys_.data(), values_.data(), capacity_, size_);
    keys_ = std::move(keys);
    values_ = std::move(values);
    capacity_ = capacity;
  }

  // Empties the cache (positions start again at 0), keeping its capacity.
  void clear() noexcept {
    size_ = 0;
    position_ = 0;
  }

  // Drops the newest entries so that `size` remain (speculative decoding, retries); position() goes back
  // by as many.
  void truncate(Index size) {
    if (size < 0 || size > size_)
      detail::throw_invalid("KVCache::truncate", "size", detail::concat("in [0, ", size_, "] (the entries held)"), size);
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
    detail::Buffer<Scalar> keys(static_cast<std::size_t>(batch * capacity_ * kv_heads_ * d_k_));
    detail::Buffer<Scalar> values(static_cast<std::size_t>(batch * capacity_ * kv_heads_ * d_v_));
    const Index hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
    for (Index i = 0; i < batch; ++i) {
      const Index from = rows[static_cast<std::size_t>(i)];
      std::copy_n(keys_.data() + from * capacity_ * hk, size_ * hk, keys.data() + i * capacity_ * hk);
      std::copy_n(values_.data() + from * capacity_ * hv, size_ * hv, values.data() + i * capacity_ * hv);
    }
    keys_ = std::move(keys);
    values_ = std::move(values);
    batch_ = batch;
  }

  // The held entries: (batch, size, kv_heads * d_k) projected keys (rotated, when the module has a rotary)
  // and (batch, size, kv_heads * d_v) values, features head-major as fc_k and fc_v give them.
  Tensor3 keys() const { return held(keys_.data(), kv_heads_ * d_k_); }
  Tensor3 values() const { return held(values_.data(), kv_heads_ * d_v_); }

  // Replaces the content (a saved cache being loaded): keys (batch, n, kv_heads * d_k) and values (batch, n,
  // kv_heads * d_v) become the entries of positions position - n .. position - 1; the batch follows keys.
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
      std::copy_n(keys.data() + b * n * hk, n * hk, fresh.keys_.data() + b * fresh.capacity_ * hk);
      std::copy_n(values.data() + b * n * hv, n * hv, fresh.values_.data() + b * fresh.capacity_ * hv);
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
    swap(keys_, other.keys_);
    swap(values_, other.values_);
    swap(q_scratch_, other.q_scratch_);
    swap(att_scratch_, other.att_scratch_);
    swap(decode_, other.decode_);
  }

 private:
  friend class ScaledDotProductAttention<Scalar>;

  // An empty cache of this one's shape.
  KVCache(const KVCache& shape, Index batch, Index capacity)
      : d_model_(shape.d_model_), kv_heads_(shape.kv_heads_), d_k_(shape.d_k_), d_v_(shape.d_v_), batch_(batch) {
    reserve(capacity);
  }

  static Index checked_nonnegative(const char* where, const char* name, Index value) {
    if (value < 0) detail::throw_invalid(where, name, "non-negative", value);
    return value;
  }

  void copy_entries(Scalar* keys, Scalar* values, Index capacity, const Scalar* old_keys, const Scalar* old_values,
                    Index old_capacity, Index count) const {
    const Index hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
    for (Index b = 0; b < batch_ && count > 0; ++b) {
      std::copy_n(old_keys + b * old_capacity * hk, count * hk, keys + b * capacity * hk);
      std::copy_n(old_values + b * old_capacity * hv, count * hv, values + b * capacity * hv);
    }
  }

  Tensor3 held(const Scalar* data, Index width) const {
    Tensor3 out(batch_, size_, width);
    for (Index b = 0; b < batch_; ++b) std::copy_n(data + b * capacity_ * width, size_ * width, out.data() + b * size_ * width);
    return out;
  }

  // Room for `extra` more entries per sequence, growing by at least doubling.
  void make_room(Index extra) {
    if (size_ + extra > capacity_) reserve(std::max(size_ + extra, 2 * capacity_));
  }

  // Drops the oldest `count` entries (a sliding window's rolling buffer): positions are kept.
  void drop_front(Index count) {
    count = std::clamp<Index>(count, 0, size_);
    if (count == 0) return;
    const Index hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
    for (Index b = 0; b < batch_; ++b) {
      Scalar* k = key_rows(b);
      Scalar* v = value_rows(b);
      std::memmove(k, k + count * hk, static_cast<std::size_t>((size_ - count) * hk) * sizeof(Scalar));
      std::memmove(v, v + count * hv, static_cast<std::size_t>((size_ - count) * hv) * sizeof(Scalar));
    }
    size_ -= count;
  }

  Scalar* key_rows(Index b) noexcept { return keys_.data() + b * capacity_ * kv_heads_ * d_k_; }
  Scalar* value_rows(Index b) noexcept { return values_.data() + b * capacity_ * kv_heads_ * d_v_; }
  const Scalar* key_rows(Index b) const noexcept { return keys_.data() + b * capacity_ * kv_heads_ * d_k_; }
  const Scalar* value_rows(Index b) const noexcept { return values_.data() + b * capacity_ * kv_heads_ * d_v_; }

  // Scratch of a step, grown to the largest step seen (count elements each).
  Scalar* scratch(detail::Buffer<Scalar>& buf, Index count) {
    if (static_cast<Index>(buf.size()) < count) buf.reset(static_cast<std::size_t>(count));
    return buf.data();
  }

  Index d_model_, kv_heads_, d_k_, d_v_;
  Index batch_ = 0, capacity_ = 0, size_ = 0, position_ = 0;
  detail::Buffer<Scalar> keys_, values_;
  detail::Buffer<Scalar> q_scratch_, att_scratch_;
  kernels::DecodeWorkspace<Scalar> decode_;
};

SDPA_NAMESPACE_END
