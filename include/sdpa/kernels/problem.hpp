// The attention core's input as every kernel sees it: projected q, k, v in (batch, seq, heads * dim)
// row-major memory addressed through strides (so a fused QKV buffer, a key/value cache or a caller's tensor
// serves without a copy), what modifies the scores (broadcast weights and bias, ALiBi slopes), what hides
// keys (a broadcast mask, causal, windows, key lengths, all relative to the query's position among the
// keys), the masked-row policy, the dropout draw, and the optional outputs (probabilities, the rows'
// log-sum-exp). The checked core (attention.hpp) fills it after validating the arguments; kernels trust it.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include "sdpa/compute.hpp"
#include "sdpa/cpu.hpp"
#include "sdpa/mask.hpp"
#include "sdpa/options.hpp"
#include "sdpa/random.hpp"
#include "sdpa/storage.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

SDPA_NAMESPACE_BEGIN
namespace kernels {

// Rows of one projected tensor: head h of row i of batch b starts at
// data + b * batch_stride + i * row_stride + h * head_stride (the module's (batch, seq, heads * d) buffers:
// head_stride = d; PyTorch's (batch, heads, seq, d) tensors: head_stride = seq * d, row_stride = d).
template <typename T>
struct Heads {
  T* data = nullptr;
  Eigen::Index batch_stride = 0;
  Eigen::Index row_stride = 0;
  Eigen::Index head_stride = 0;

  T* row(Eigen::Index b, Eigen::Index h, Eigen::Index i) const noexcept {
    return data + b * batch_stride + i * row_stride + h * head_stride;
  }
};

// The keys and values of a cache as the kernels read them, whatever their storage: Scalar rows (k, v), or
// rows stored narrower (storage: bfloat16, float16, int8 with one float scale per (row, key/value head) at
// scales + b * scale_batch_stride + row * kv_heads + head), then addressed by k's and v's strides with null
// data. A cache hands one out (rows()); AttentionProblem::read_rows takes it.
template <typename Scalar>
struct KVRows {
  Heads<const Scalar> k, v;
  Storage storage = native_storage<Scalar>();
  const void* k_stored = nullptr;
  const void* v_stored = nullptr;
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  Eigen::Index scale_batch_stride = 0;
};

template <typename Scalar>
struct AttentionProblem {
  using Index = Eigen::Index;

  Index batch = 0, heads = 0, nq = 0, nk = 0, d_k = 0, d_v = 0;
  // Query heads per key/value head (grouped-query attention): query head h reads key/value head
  // h / kv_group; 1 for plain multi-head attention, heads for multi-query.
  Index kv_group = 1;
  Isa isa = active_isa();  // the kernels' path for this call (sdpa/cpu.hpp), read once
  // The products' type (sdpa/compute.hpp; kBf16: float problems, tiled kernel) and, for kBf16, the
  // instructions that run them, read once per call.
  Compute compute = Compute::kFloat;
  Bf16Path bf16_path = Bf16Path::kEmulated;
  Heads<const Scalar> q, k, v;  // q per query head, k and v per key/value head
  // Keys and values stored narrower than Scalar (a KVCache's bfloat16, float16 or int8 entries; float
  // problems only): then k.data and v.data are null and k_stored / v_stored hold the elements, addressed by
  // k's and v's strides (in elements, head_stride = d: a cache's rows). int8 adds one float scale per
  // (batch, row, key/value head): scales + b * scale_batch_stride + row * kv_heads() + head. The kernels
  // widen them a block at a time (kernels/rows.hpp), never the whole cache.
  Storage kv_storage = native_storage<Scalar>();
  const void* k_stored = nullptr;
  const void* v_stored = nullptr;
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  Index scale_batch_stride = 0;
  Heads<Scalar> out;  // per query head
  Scalar scale = Scalar(1);  // 1 / sqrt(d_k) unless the options give one

  // The scores: s = scale * q . k, times weights, then softcap * tanh(s / softcap) when softcap > 0, plus
  // bias, minus alibi[h] * |q' - k|.
  BroadcastView<Scalar> weights;
  Scalar softcap = Scalar(0);
  BroadcastView<Scalar> bias;
  const Scalar* alibi = nullptr;  // one slope per head, or none
  // One extra logit per query head whose value is zero (attention sinks, gpt-oss): it takes part in each
  // row's softmax and in nothing else. A row whose every key is hidden then puts all its weight on the
  // sink (output 0 whatever the masked-row policy).
  const Scalar* sinks = nullptr;

  // Which keys a query sees. q' = q + query_offset is the query's position among the keys (nk - nq for a
  // plain call: lower-right alignment); causal hides k > q', window_left (>= 0) hides k < q' - window_left,
  // window_right (>= 0) hides k > q' + window_right, key_lengths[b] hides k >= key_lengths[b].
  BroadcastView<bool> mask;
  bool causal = false;
  Index window_left = -1, window_right = -1;
  const Index* key_lengths = nullptr;  // one per batch entry, or none
  Index query_offset = 0;
  const Index* query_offsets = nullptr;  // one per batch entry instead (a ragged batch of cached sequences)
  // Or each query's own position among the keys, at [b * nq + q] (queries of several sequences stacked
  // over the blocks they share: a cascade level of a PagedKVCache step; a draft tree's depths).
  const Index* query_positions = nullptr;
  MaskedRows masked_rows = MaskedRows::kZero;
  // The checked call's score program (sdpa/flex/score_program.hpp), or none: the entry points hand the
  // problem to it, and it runs the kernels instantiated for its functions (kernels/program.hpp). Those are
  // told batch entry b is b + batch_base (a packed call's sequence runs as a batch of one at its index).
  // Positions as the program sees them are key_base(b) more than the kernel's (a cache that dropped its
  // first entries, a ring block's keys): q' + key_base(b) and k + key_base(b).
  const ScoreProgram<Scalar>* program = nullptr;
  Index batch_base = 0;
  Index key_base = 0;
  const Index* key_bases = nullptr;  // one per batch entry instead

  bool dropout = false;            // training mode with p > 0
  DropoutSampler sampler{0, 0, 0.0};
  Scalar keep_scale = Scalar(1);   // 1 / (1 - p); 0 when p = 1

  // Optional outputs: the probabilities before dropout, (batch, heads, nq, nk) row-major; and each row's
  // log-sum-exp max + log(sum) of its final scores, (batch, heads, nq) (-inf for a row with no visible key),
  // from which a backward pass recomputes the probabilities.
  Scalar* probabilities = nullptr;
  Scalar* lse = nullptr;

  // Keys and values in blocks of block_rows rows (a PagedKVCache): key row i of batch entry b is row
  // block_tables[b][i / block_rows] * block_rows + i % block_rows of k (and of v, and of the int8 scales), whose
  // batch_stride (and scale_batch_stride) is 0. A run of rows inside one block is contiguous.
  const Index* const* block_tables = nullptr;
  Index block_rows = 0;

  // Keys and values from a cache's row view (KVRows).
  void read_rows(const KVRows<Scalar>& rows) noexcept {
    k = rows.k;
    v = rows.v;
    kv_storage = rows.storage;
    k_stored = rows.k_stored;
    v_stored = rows.v_stored;
    k_scales = rows.k_scales;
    v_scales = rows.v_scales;
    scale_batch_stride = rows.scale_batch_stride;
  }

  bool paged() const noexcept { return block_tables != nullptr; }
  Index row_of(Index b, Index i) const noexcept {
    return block_tables != nullptr ? block_tables[b][i / block_rows] * block_rows + i % block_rows : i;
  }
  // How many rows from row i of batch entry b on (at most n) lie in one block.
  Index run_of(Index i, Index n) const noexcept {
    return block_tables != nullptr ? std::min(n, block_rows - i % block_rows) : n;
  }
  Index offset(Index b) const noexcept { return query_offsets != nullptr ? query_offsets[b] : query_offset; }
  Index position(Index b, Index query) const noexcept {
    return query_positions != nullptr ? query_positions[b * nq + query] : query + offset(b);
  }
  Index base(Index b) const noexcept { return key_bases != nullptr ? key_bases[b] : key_base; }
  const Scalar* key_row(Index b, Index h, Index i) const noexcept { return k.row(b, h / kv_group, row_of(b, i)); }
  const Scalar* value_row(Index b, Index h, Index i) const noexcept { return v.row(b, h / kv_group, row_of(b, i)); }
  Index kv_heads() const noexcept { return heads / kv_group; }
  bool stored() const noexcept { return kv_storage != native_storage<Scalar>(); }
};

// Whether the n values at x are all finite: the test behind the tiled kernels' rule that a hidden key
// passes nothing, not even a NaN or infinity in its value (forward) or key (backward) row, which the
// products would spread as 0 * NaN. On the exponent bits with integer operations, which compilers
// vectorise (Eigen's allFinite ran as a scalar subtract-and-compare per value; bench/RESULTS.md).
template <typename Scalar>
bool row_finite(const Scalar* x, Eigen::Index n) noexcept {
  static_assert(sizeof(Scalar) == 4 || sizeof(Scalar) == 8, "sdpa::kernels::row_finite: float or double");
  using Bits = std::conditional_t<sizeof(Scalar) == 4, std::uint32_t, std::uint64_t>;
  constexpr int kFraction = std::numeric_limits<Scalar>::digits - 1;
  constexpr Bits kExponent = (~Bits{0} >> 1) & ~((Bits{1} << kFraction) - 1);
  constexpr Bits kExponentOne = Bits{1} << kFraction;
  // exponent + its lowest bit carries into the sign bit exactly when the exponent is all ones.
  Bits carries = 0;
  for (Eigen::Index i = 0; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    carries |= (bits & kExponent) + kExponentOne;
  }
  return (carries >> (8 * sizeof(Bits) - 1)) == 0;
}

}  // namespace kernels
SDPA_NAMESPACE_END
