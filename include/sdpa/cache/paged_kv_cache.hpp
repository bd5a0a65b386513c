// sdpa::PagedKVCache: the keys and values of many sequences of one module in a pool of fixed-size blocks
// (vLLM's paged attention, FlashAttention's block_table), for serving: sequences join (add_sequence) and
// leave (remove_sequence) at any step, fork (beam search, a shared system prompt: the fork shares its
// parent's blocks, and the last, partly filled one is copied only when one of them appends to it), and are
// truncated; one call, the module's step(x, cache, sequence_ids), appends a token (or a few) to each of a
// ragged batch of them and attends each to its own entries. Memory is the pool's, fixed at construction;
// blocks_used() and bytes() account for it, and a step that needs more blocks than are free is refused
// before anything changes.
//
// A sequence's held entries are indices 0 .. size - 1 of its block list (block i holds entries
// i * block_size ..); position counts the tokens appended since it was added (its first held entry is
// position - size: a sliding-window step drops whole blocks no later query can see). Entries are stored as
// a KVCache stores them (sdpa::Storage: the module's Scalar, or for a float module bfloat16, float16 or int8
// with one scale per token and head); keys are rotated at their absolute positions before they are stored.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <vector>

#include <type_traits>
#include <utility>

#include "sdpa/cache/draft_tree.hpp"
#include "sdpa/cache/step_scratch.hpp"
#include "sdpa/detail/buffer.hpp"
#include "sdpa/error.hpp"
#include "sdpa/kernels/decode.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class PagedKVCache {
 public:
  using Index = Eigen::Index;
  using SequenceId = std::int64_t;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;

  // A pool of max_blocks blocks of block_size tokens each (a positive multiple of 16: the decoding kernel's
  // blocks of value rows never cross one of the pool's) for sequences of `module` (any module with the same
  // d_model, kv_heads, d_k and d_v; anything that tells those four), stored as `storage` (as KVCache's).
  template <typename Module, typename = std::enable_if_t<!std::is_same<Module, PagedKVCache>::value>,
            typename = decltype(std::declval<const Module&>().kv_heads())>
  PagedKVCache(const Module& module, Index block_size, Index max_blocks, Storage storage = native_storage<Scalar>())
      : d_model_(module.d_model()), kv_heads_(module.kv_heads()), d_k_(module.d_k()), d_v_(module.d_v()),
        block_size_(checked_block_size(block_size)), max_blocks_(checked_blocks(max_blocks)),
        storage_(checked_storage(storage)) {
    const std::size_t es = storage_bytes(storage_);
    const std::size_t rows = static_cast<std::size_t>(max_blocks_ * block_size_);
    keys_.reset(rows * static_cast<std::size_t>(kv_heads_ * d_k_) * es);
    values_.reset(rows * static_cast<std::size_t>(kv_heads_ * d_v_) * es);
    if (storage_ == Storage::kInt8) {
      key_scales_.reset(rows * static_cast<std::size_t>(kv_heads_));
      value_scales_.reset(rows * static_cast<std::size_t>(kv_heads_));
    }
    refs_.assign(static_cast<std::size_t>(max_blocks_), 0);
    free_.reserve(static_cast<std::size_t>(max_blocks_));
    for (Index b = max_blocks_ - 1; b >= 0; --b) free_.push_back(b);  // the lowest blocks are taken first
  }

  PagedKVCache(const PagedKVCache&) = delete;
  PagedKVCache& operator=(const PagedKVCache&) = delete;

  // ---- Sequences ----

  // A new, empty sequence; its id is never reused.
  SequenceId add_sequence() {
    sequences_[next_id_] = Sequence{};
    return next_id_++;
  }

  // The sequence's blocks go back to the pool (those it shares, once their last user is gone).
  void remove_sequence(SequenceId id) {
    Sequence& s = find("PagedKVCache::remove_sequence", id);
    for (Index b : s.blocks) release(b);
    sequences_.erase(id);
  }

  // A new sequence with the entries and position of `id`, sharing its blocks: no entry is copied until one
  // of the two appends to their shared, partly filled last block (that block alone is then copied). The
  // fork shares the blocks of the held entries only (not `id`'s pending drafts).
  SequenceId fork(SequenceId id) {
    Sequence copy = find("PagedKVCache::fork", id);
    copy.blocks.resize(static_cast<std::size_t>((copy.size + block_size_ - 1) / block_size_));
    copy.drafts.clear();
    for (Index b : copy.blocks) ++refs_[static_cast<std::size_t>(b)];
    sequences_[next_id_] = copy;
    return next_id_++;
  }

  // Drops the sequence's newest entries so that `size` remain; position() goes back by as many.
  void truncate(SequenceId id, Index size) {
    Sequence& s = find("PagedKVCache::truncate", id);
    if (size < 0 || size > s.size)
      detail::throw_invalid("PagedKVCache::truncate", "size", detail::concat("in [0, ", s.size, "] (the entries held)"), size);
    s.drafts.clear();
    s.position -= s.size - size;
    s.size = size;
    release_unused(s);
  }

  bool contains(SequenceId id) const noexcept { return sequences_.count(id) > 0; }
  std::vector<SequenceId> sequences() const {
    std::vector<SequenceId> ids;
    for (const auto& entry : sequences_) ids.push_back(entry.first);
    return ids;
  }
  Index size(SequenceId id) const { return find("PagedKVCache::size", id).size; }
  Index position(SequenceId id) const { return find("PagedKVCache::position", id).position; }
  Index first_position(SequenceId id) const {
    const Sequence& s = find("PagedKVCache::first_position", id);
    return s.position - s.size;
  }

  // The sequence's held entries, (1, size, kv_heads * d_k) keys (rotated when the module has a rotary) and
  // values, converted to Scalar exactly.
  Tensor3 keys(SequenceId id) const { return held(find("PagedKVCache::keys", id), false); }
  Tensor3 values(SequenceId id) const { return held(find("PagedKVCache::values", id), true); }

  // ---- The pool ----

  Index block_size() const noexcept { return block_size_; }
  Index max_blocks() const noexcept { return max_blocks_; }
  Index blocks_free() const noexcept { return static_cast<Index>(free_.size()); }
  Index blocks_used() const noexcept { return max_blocks_ - blocks_free(); }
  // The bytes of one block: its keys and values in the storage type, and int8's scales.
  std::size_t block_bytes() const noexcept {
    std::size_t b = static_cast<std::size_t>(block_size_ * kv_heads_ * (d_k_ + d_v_)) * storage_bytes(storage_);
    if (storage_ == Storage::kInt8) b += 2 * static_cast<std::size_t>(block_size_ * kv_heads_) * sizeof(float);
    return b;
  }
  // The bytes of the blocks in use (shared blocks counted once); pool_bytes(): of the whole pool.
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(blocks_used()) * block_bytes(); }
  std::size_t pool_bytes() const noexcept { return static_cast<std::size_t>(max_blocks_) * block_bytes(); }

  Index d_model() const noexcept { return d_model_; }
  Index kv_heads() const noexcept { return kv_heads_; }
  Index d_k() const noexcept { return d_k_; }
  Index d_v() const noexcept { return d_v_; }
  Storage storage() const noexcept { return storage_; }

  // ---- For the decoding entry points (sdpa/module/decoding.hpp) ----
  // A step makes room for the new entries of every sequence it appends to (make_room, refused before
  // anything changes), writes them after each one's held entries (store_rows) and makes them held
  // (advance).

  // Blocks that appending n entries to each of `ids` needs: a copy of a shared, partly filled last block,
  // and new blocks past the last. Refused (std::runtime_error, naming `where`) when more than are free,
  // before anything changes; otherwise taken.
  void make_room(const std::vector<SequenceId>& ids, Index n, const char* where = "PagedKVCache::make_room") {
    Index needed = 0;
    for (SequenceId id : ids) {
      const Sequence& s = find(where, id);
      const Index held = static_cast<Index>(s.blocks.size());
      const bool shared_tail = s.size % block_size_ != 0 && refs_[static_cast<std::size_t>(s.blocks.back())] > 1;
      needed += (shared_tail ? 1 : 0) + std::max<Index>(0, (s.size + n + block_size_ - 1) / block_size_ - held);
    }
    if (needed > blocks_free())
      throw std::runtime_error(detail::concat("sdpa::", where, ": the PagedKVCache's pool is exhausted: the step needs ", needed,
                                              " more blocks of ", block_size_, " tokens, ", blocks_free(), " of ", max_blocks_,
                                              " are free (remove or truncate sequences, or make a larger pool)"));
    for (SequenceId id : ids) {
      Sequence& s = find(where, id);
      s.drafts.clear();  // (the new entries take their place)
      if (s.size % block_size_ != 0 && refs_[static_cast<std::size_t>(s.blocks.back())] > 1) {
        // Copy on write: the shared tail block's filled rows into a block of this sequence's own.
        const Index old = s.blocks.back(), fresh = take();
        const Index filled = s.size % block_size_;
        for (bool v : {false, true}) {
          std::memcpy(entry(v, fresh * block_size_), entry(v, old * block_size_), static_cast<std::size_t>(filled) * row_bytes(v));
          if (storage_ == Storage::kInt8)
            std::copy_n(scales(v, old * block_size_), filled * kv_heads_, scales(v, fresh * block_size_));
        }
        release(old);
        s.blocks.back() = fresh;
      }
      while (static_cast<Index>(s.blocks.size()) * block_size_ < s.size + n) s.blocks.push_back(take());
    }
  }

  // The sequence's entries size(id) .. size(id) + n - 1, keys (values = false) or values, from n Scalar rows
  // of kv_heads * d (row stride ld), converted to the storage, in blocks that make_room took.
  void store_rows(SequenceId id, bool values, const Scalar* src, Index ld, Index n) {
    Sequence& s = find("PagedKVCache::store_rows", id);
    check_room("PagedKVCache::store_rows", s, n);
    const Index d = values ? d_v_ : d_k_;
    for (Index i = 0; i < n;) {
      const Index row = physical(s, s.size + i), run = std::min(n - i, block_size_ - (s.size + i) % block_size_);
      detail::store_rows(storage_, src + i * ld, ld, run, kv_heads_, d, entry(values, row), scales(values, row));
      i += run;
    }
  }

  // The n entries written after the sequence's held ones become held: size and position grow by n.
  void advance(SequenceId id, Index n) {
    Sequence& s = find("PagedKVCache::advance", id);
    check_room("PagedKVCache::advance", s, n);
    s.size += n;
    s.position += n;
  }

  // After a sliding-window step: the sequence's whole blocks no later query can see (their entries all
  // before position - window_left) are dropped from the front.
  void drop_hidden(SequenceId id, Index window_left) {
    Sequence& s = find("PagedKVCache::drop_hidden", id);
    const Index droppable = s.position - window_left - (s.position - s.size);
    const Index blocks = std::max<Index>(0, droppable) / block_size_;
    for (Index b = 0; b < blocks; ++b) release(s.blocks[static_cast<std::size_t>(b)]);
    s.blocks.erase(s.blocks.begin(), s.blocks.begin() + blocks);
    s.size -= blocks * block_size_;
  }

  // The sequence's block table: entry i is row table[i / block_size()] * block_size() + i % block_size() of
  // rows(); valid until the sequence next changes.
  const Index* block_table(SequenceId id) const { return find("PagedKVCache::block_table", id).blocks.data(); }

  // The pool's entries as the kernels read them, addressed through block tables (batch strides 0).
  kernels::KVRows<Scalar> rows() const noexcept {
    kernels::KVRows<Scalar> r;
    const Index hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
    r.storage = storage_;
    if (is_narrow<Scalar>(storage_)) {
      r.k = {nullptr, 0, hk, d_k_};
      r.v = {nullptr, 0, hv, d_v_};
      r.k_stored = keys_.data();
      r.v_stored = values_.data();
      r.k_scales = storage_ == Storage::kInt8 ? key_scales_.data() : nullptr;
      r.v_scales = storage_ == Storage::kInt8 ? value_scales_.data() : nullptr;
    } else {
      r.k = {reinterpret_cast<const Scalar*>(keys_.data()), 0, hk, d_k_};
      r.v = {reinterpret_cast<const Scalar*>(values_.data()), 0, hv, d_v_};
    }
    return r;
  }

  // ---- Cascade: blocks several sequences of a step share ----

  // A run of blocks that two or more sequences of a step hold (through fork): entries
  // first_block * block_size() .. (first_block + blocks) * block_size() - 1 of each member, full blocks, the
  // same physical blocks in every member's table at the same index (so at the same positions).
  struct SharedBlocks {
    std::vector<Index> members;  // indices into the step's sequence ids, ascending
    Index first_block = 0, blocks = 0;
  };

  // The shared runs of the sequences `ids` as a tree of levels from the front of their tables: the
  // members of a run hold the same blocks from block 0 up to its end (a system prompt shared by all, then
  // a document shared by some); a run's members split into the runs below it where their blocks differ.
  // Only full blocks (those before each member's last entry's block, or full) are shared; a block shared
  // only with sequences outside `ids` is not. Runs come parents first, in the order of their first blocks.
  std::vector<SharedBlocks> shared_blocks(const std::vector<SequenceId>& ids) const {
    std::vector<const Sequence*> seqs;
    for (SequenceId id : ids) seqs.push_back(&find("PagedKVCache::shared_blocks", id));
    const auto full_blocks = [&](Index i) { return seqs[static_cast<std::size_t>(i)]->size / block_size_; };
    const auto block = [&](Index i, Index j) {
      return seqs[static_cast<std::size_t>(i)]->blocks[static_cast<std::size_t>(j)];
    };
    std::vector<SharedBlocks> runs;
    // (members, depth): members hold the same blocks before depth.
    std::vector<std::pair<std::vector<Index>, Index>> todo;
    std::vector<Index> all(ids.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<Index>(i);
    todo.emplace_back(std::move(all), 0);
    while (!todo.empty()) {
      auto [members, depth] = std::move(todo.back());
      todo.pop_back();
      std::map<Index, std::vector<Index>> groups;  // by the block at depth: ordered, so runs come out the same
      for (Index i : members)
        if (full_blocks(i) > depth) groups[block(i, depth)].push_back(i);
      std::vector<std::pair<std::vector<Index>, Index>> below;
      for (auto& g : groups) {
        std::vector<Index>& group = g.second;
        if (group.size() < 2) continue;
        Index end = depth + 1;
        while (std::all_of(group.begin(), group.end(),
                           [&](Index i) { return full_blocks(i) > end && block(i, end) == block(group[0], end); }))
          ++end;
        runs.push_back(SharedBlocks{group, depth, end - depth});
        below.emplace_back(std::move(group), end);
      }
      for (auto it = below.rbegin(); it != below.rend(); ++it) todo.push_back(std::move(*it));
    }
    return runs;
  }

  // Whether a step attends the blocks its sequences share once for all of them (the default; the module's
  // step, sdpa/module/decoding.hpp) or reads them once per sequence as each sequence alone would.
  void set_cascade(bool on) noexcept { cascade_ = on; }
  bool cascade() const noexcept { return cascade_; }

  // The steps' scratch (sdpa/cache/step_scratch.hpp).
  detail::StepScratch<Scalar>& step_scratch() noexcept { return scratch_; }

  // ---- Speculative decoding (sdpa/cache/draft_tree.hpp) ----
  // A tree step (ScaledDotProductAttention::step_tree) stores each sequence's draft tokens after its held
  // entries, pending until accept; anything that appends to the sequence, truncates it or forks from it
  // leaves them out (the fork) or discards them.

  Index drafts(SequenceId id) const { return static_cast<Index>(find("PagedKVCache::drafts", id).drafts.size()); }
  const std::vector<Index>& draft_parents(SequenceId id) const {
    return find("PagedKVCache::draft_parents", id).drafts;
  }

  // Keeps the sequence's drafts of `path` (a chain of the tree from under the sequence: path[0]'s parent
  // -1, path[i]'s parent path[i - 1]) in its order and drops the others (their blocks go back to the
  // pool): the sequence is then as if the accepted tokens had been appended one by one (the same entries,
  // positions and rotation). An empty path accepts none. A bad id or a path that is not such a chain is
  // refused before anything changes.
  void accept(SequenceId id, const std::vector<Index>& path) {
    Sequence& s = find("PagedKVCache::accept", id);
    detail::check_draft_path("PagedKVCache::accept", s.drafts, path);
    const Index n = static_cast<Index>(path.size());
    for (Index i = 0; i < n; ++i) {
      const Index from = physical(s, s.size + path[static_cast<std::size_t>(i)]), to = physical(s, s.size + i);
      if (from == to) continue;
      for (bool v : {false, true}) {
        std::memcpy(entry(v, to), entry(v, from), row_bytes(v));
        if (storage_ == Storage::kInt8) std::copy_n(scales(v, from), kv_heads_, scales(v, to));
      }
    }
    s.drafts.clear();
    s.size += n;
    s.position += n;
    release_unused(s);
  }

  // For step_tree: the parents.size() entries after the sequence's held ones (stored after make_room) are
  // drafts.
  void hold_drafts(SequenceId id, std::vector<Index> parents) {
    Sequence& s = find("PagedKVCache::hold_drafts", id);
    check_room("PagedKVCache::hold_drafts", s, static_cast<Index>(parents.size()));
    (void)detail::draft_depths("PagedKVCache::hold_drafts", parents);
    s.drafts = std::move(parents);
  }

 private:
  struct Sequence {
    std::vector<Index> blocks;
    Index size = 0, position = 0;
    std::vector<Index> drafts;  // the pending drafts' parents
  };

  // The blocks past those of the held entries go back to the pool.
  void release_unused(Sequence& s) {
    const Index keep = (s.size + block_size_ - 1) / block_size_;
    while (static_cast<Index>(s.blocks.size()) > keep) {
      release(s.blocks.back());
      s.blocks.pop_back();
    }
  }

  static Index checked_block_size(Index n) {
    if (n <= 0 || n % kernels::kDecodeRows != 0)
      detail::throw_invalid("PagedKVCache", "block_size", detail::concat("a positive multiple of ", kernels::kDecodeRows), n);
    return n;
  }
  static Index checked_blocks(Index n) {
    if (n < 0) detail::throw_invalid("PagedKVCache", "max_blocks", "non-negative", n);
    return n;
  }
  static Storage checked_storage(Storage s) {
    const bool is_float = std::is_same<Scalar, float>::value;
    const bool ok = is_float ? (s == Storage::kFloat32 || s == Storage::kBFloat16 || s == Storage::kFloat16 || s == Storage::kInt8)
                             : s == Storage::kFloat64;
    if (!ok)
      detail::throw_invalid("PagedKVCache", "storage",
                            is_float ? "kFloat32, kBFloat16, kFloat16 or kInt8 for a PagedKVCache<float>"
                                     : "kFloat64 for a PagedKVCache<double> (narrow storage needs a float cache)",
                            storage_name(s));
    return s;
  }

  Sequence& find(const char* where, SequenceId id) {
    const auto it = sequences_.find(id);
    if (it == sequences_.end()) detail::throw_invalid(where, "sequence id", "the id of a sequence of this cache", id);
    return it->second;
  }
  const Sequence& find(const char* where, SequenceId id) const {
    const auto it = sequences_.find(id);
    if (it == sequences_.end()) detail::throw_invalid(where, "sequence id", "the id of a sequence of this cache", id);
    return it->second;
  }

  // n new entries must fit the blocks the sequence holds after its held entries (make_room took them).
  void check_room(const char* where, const Sequence& s, Index n) const {
    const Index room = static_cast<Index>(s.blocks.size()) * block_size_ - s.size;
    if (n < 0 || n > room) detail::throw_invalid(where, "n", detail::concat("in [0, ", room, "] (the room make_room took)"), n);
  }

  void release(Index block) {
    if (--refs_[static_cast<std::size_t>(block)] == 0) free_.push_back(block);
  }
  Index take() {
    const Index b = free_.back();
    free_.pop_back();
    refs_[static_cast<std::size_t>(b)] = 1;
    return b;
  }

  std::size_t row_bytes(bool values) const noexcept {
    return static_cast<std::size_t>(kv_heads_ * (values ? d_v_ : d_k_)) * storage_bytes(storage_);
  }
  unsigned char* entry(bool values, Index physical_row) noexcept {
    return (values ? values_ : keys_).data() + static_cast<std::size_t>(physical_row) * row_bytes(values);
  }
  const unsigned char* entry(bool values, Index physical_row) const noexcept {
    return (values ? values_ : keys_).data() + static_cast<std::size_t>(physical_row) * row_bytes(values);
  }
  float* scales(bool values, Index physical_row) noexcept {
    return storage_ == Storage::kInt8 ? (values ? value_scales_ : key_scales_).data() + physical_row * kv_heads_ : nullptr;
  }
  const float* scales(bool values, Index physical_row) const noexcept {
    return storage_ == Storage::kInt8 ? (values ? value_scales_ : key_scales_).data() + physical_row * kv_heads_ : nullptr;
  }
  Index physical(const Sequence& s, Index i) const noexcept {
    return s.blocks[static_cast<std::size_t>(i / block_size_)] * block_size_ + i % block_size_;
  }

  Tensor3 held(const Sequence& s, bool values) const {
    const Index d = values ? d_v_ : d_k_, width = kv_heads_ * d;
    Tensor3 out(1, s.size, width);
    for (Index i = 0; i < s.size;) {
      const Index row = physical(s, i), run = std::min(s.size - i, block_size_ - i % block_size_);
      detail::load_rows(storage_, entry(values, row), run, kv_heads_, d, scales(values, row), out.data() + i * width);
      i += run;
    }
    return out;
  }

  Index d_model_, kv_heads_, d_k_, d_v_;
  Index block_size_, max_blocks_;
  Storage storage_;
  detail::Buffer<unsigned char> keys_, values_;  // (max_blocks * block_size, kv_heads * d) in the storage type
  detail::Buffer<float> key_scales_, value_scales_;  // int8: (max_blocks * block_size, kv_heads)
  std::vector<int> refs_;     // per block: the sequences that hold it
  std::vector<Index> free_;   // blocks no sequence holds
  std::map<SequenceId, Sequence> sequences_;
  SequenceId next_id_ = 0;
  bool cascade_ = true;
  // A step's scratch, kept between steps.
  detail::StepScratch<Scalar> scratch_;
};

SDPA_NAMESPACE_END
