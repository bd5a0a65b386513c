// The module's decoding entry points (declared in sdpa/scaled_dot_product_attention.hpp, which includes
// this header after the class): append, attend and step on a KVCache, and the ragged step on a
// PagedKVCache. They project the new tokens into the cache through its public interface
// (sdpa/cache/kv_cache.hpp, sdpa/cache/paged_kv_cache.hpp), hand the cache's rows (kernels::KVRows) to the
// attention core (detail::run_attention: the decoding kernel for up to kernels::kDecodeRows rows, the
// tiled kernel beyond) and apply fc_o.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "sdpa/cache/kv_cache.hpp"
#include "sdpa/cache/paged_kv_cache.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

SDPA_NAMESPACE_BEGIN

namespace detail {

// A PagedKVCache that a module of these sizes can step: the same d_model, kv_heads, d_k and d_v; entries
// stored narrower than Scalar need a kernel other than kReference.
template <typename Scalar>
void check_paged_cache(const char* where, const PagedKVCache<Scalar>& cache, const std::array<Eigen::Index, 4>& sizes,
                       Kernel kernel) {
  const std::array<Eigen::Index, 4> has{cache.d_model(), cache.kv_heads(), cache.d_k(), cache.d_v()};
  if (has != sizes)
    throw_invalid(
        where, "cache",
        concat("a cache for d_model ", sizes[0], ", kv_heads ", sizes[1], ", d_k ", sizes[2], ", d_v ", sizes[3]),
        concat("one for d_model ", has[0], ", kv_heads ", has[1], ", d_k ", has[2], ", d_v ", has[3]));
  if (is_narrow<Scalar>(cache.storage()) && kernel == Kernel::kReference)
    throw_invalid(where, "the module's kernel (set_kernel)",
                  concat("kAuto or kTiled for a cache stored as ", storage_name(cache.storage())), "kReference");
}

// Each of `ids` names a sequence of the cache, and no two the same one.
template <typename Scalar>
void check_sequence_ids(const char* where, const PagedKVCache<Scalar>& cache, const std::vector<std::int64_t>& ids) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (!cache.contains(ids[i]))
      throw_invalid(where, concat("sequence_ids[", i, "]"), "the id of a sequence of the cache", ids[i]);
    for (std::size_t j = 0; j < i; ++j)
      if (ids[j] == ids[i])
        throw_invalid(where, concat("sequence_ids[", i, "]"), concat("distinct from sequence_ids[", j, "]"), ids[i]);
  }
}

// The first option set that a step of sequences at different lengths (a PagedKVCache step, a draft tree)
// has no form for, or null.
template <typename Scalar>
const char* unsupported_ragged_option(const AttentionOptions<Scalar>& o) noexcept {
  return o.attention_mask != nullptr      ? "attention_mask"
         : o.attention_weights != nullptr ? "attention_weights"
         : o.attention_bias != nullptr    ? "attention_bias"
         : !o.key_lengths.empty()         ? "key_lengths"
         : o.probabilities != nullptr     ? "probabilities"
         : o.log_sum_exp != nullptr       ? "log_sum_exp"
         : o.packed()                     ? "cu_seqlens_q / cu_seqlens_k"
         : !o.rotary_positions.empty()    ? "rotary_positions"
                                          : nullptr;
}

// The queries, keys and values (targets) of `rows` new tokens, t per sequence: few-row projections (each
// weight row read once for all rows, and the bits a single sequence's step gets) for up to
// kernels::kFewRows tokens per sequence, the GEMM beyond.
template <typename Scalar>
void project_new_rows(const Scalar* x, Eigen::Index rows, Eigen::Index t, Eigen::Index d_model,
                      const kernels::ProjectionTarget<Scalar> (&targets)[3], const Eigen::ThreadPoolDevice* device) {
  if (t <= kernels::kFewRows)
    kernels::project_few_rows<Scalar>(x, rows, d_model, d_model, targets, 3, device);
  else
    kernels::project_rows<Scalar>(x, rows, d_model, d_model, targets, 3, device);
}

// The ragged problem's per-sequence tables (its block tables, key lengths, query offsets and key bases, and
// each sequence's first held position), which attend_cascade narrows to each sequence's own blocks.
struct RaggedTables {
  std::vector<const Eigen::Index*>& tables;
  std::vector<Eigen::Index>& lengths;
  std::vector<Eigen::Index>& offsets;
  std::vector<Eigen::Index>& bases;
  const std::vector<Eigen::Index>& first;
};

// A PagedKVCache step whose sequences share blocks: p is the ragged problem of the step (each sequence's
// new queries over all its entries). Each shared run (PagedKVCache::shared_blocks) is attended by the
// stacked queries of its members in one call (a GEMM of members x tokens queries, the run's blocks read
// once), each sequence by its own remaining blocks in the ragged call, every call with its rows'
// log-sum-exps, and the parts are merged into p.out row by row (kernels::merge_normalized_row). Every shared
// key precedes every query of the step (a step's new entries are in blocks of their sequence's own), so a
// run's call is not causal; its queries keep their positions (windows, ALiBi). Sinks go with the own
// call only. Equal to the ragged call to float rounding: the summation order changes, not the terms.
template <typename Scalar, typename Run>
void attend_cascade(kernels::AttentionProblem<Scalar>& p, const std::vector<Run>& runs, const RaggedTables& r,
                    Eigen::Index block_rows, Kernel kernel, StepScratch<Scalar>& scratch,
                    const Eigen::ThreadPoolDevice* device) {
  using Index = Eigen::Index;
  const Index n_seq = p.batch, t = p.nq, heads = p.heads, hq = heads * p.d_k, ha = heads * p.d_v;
  // Each sequence's blocks before the end of its deepest run are attended by the runs.
  std::vector<Index> covered(static_cast<std::size_t>(n_seq), 0);
  Index widest = 0;
  for (const Run& run : runs) {
    widest = std::max(widest, static_cast<Index>(run.members.size()));
    for (Index i : run.members)
      covered[static_cast<std::size_t>(i)] =
          std::max(covered[static_cast<std::size_t>(i)], run.first_block + run.blocks);
  }
  const std::vector<const Index*> tables = r.tables;  // (whole)
  Index nk = 0;
  for (std::size_t i = 0; i < covered.size(); ++i) {
    const Index skip = covered[i] * block_rows;
    r.tables[i] += covered[i];
    r.lengths[i] -= skip;
    r.offsets[i] -= skip;
    r.bases[i] += skip;
    nk = std::max(nk, r.lengths[i]);
  }
  const Index rows = widest * t;
  Scalar* own_lse =
      scratch.parts.reset_at_least(static_cast<std::size_t>(n_seq * t * heads + rows * (hq + ha + heads)));
  Scalar* qs = own_lse + n_seq * t * heads;
  Scalar* out = qs + rows * hq;
  Scalar* lse = out + rows * ha;
  if (static_cast<Index>(scratch.positions.size()) < rows) scratch.positions.resize(static_cast<std::size_t>(rows));
  p.nk = nk;
  p.key_lengths = r.lengths.data();
  p.lse = own_lse;
  run_attention(p, kernel, &scratch.decode, device);

  for (const Run& run : runs) {
    const Index m = static_cast<Index>(run.members.size()), skip = run.first_block * block_rows;
    const std::size_t lead = static_cast<std::size_t>(run.members[0]);
    const Index* table = tables[lead] + run.first_block;
    for (Index mi = 0; mi < m; ++mi) {
      const std::size_t i = static_cast<std::size_t>(run.members[static_cast<std::size_t>(mi)]);
      std::copy_n(p.q.data + static_cast<Index>(i) * t * hq, t * hq, qs + mi * t * hq);
      // The member's queries among the run's keys (its entries from the run's first on).
      for (Index u = 0; u < t; ++u)
        scratch.positions[static_cast<std::size_t>(mi * t + u)] = r.offsets[i] + covered[i] * block_rows - skip + u;
    }
    kernels::AttentionProblem<Scalar> s = p;
    s.batch = 1;
    s.nq = m * t;
    s.nk = run.blocks * block_rows;
    s.q = {qs, 0, hq, p.d_k};
    s.out = {out, 0, ha, p.d_v};
    s.lse = lse;
    s.block_tables = &table;
    s.key_lengths = nullptr;
    s.query_offsets = nullptr;
    s.query_positions = scratch.positions.data();
    s.key_bases = nullptr;
    s.key_base = r.first[lead] + skip;
    s.causal = false;
    s.sinks = nullptr;
    s.masked_rows = MaskedRows::kZero;
    run_attention(s, kernel, &scratch.decode, device);
    for (Index mi = 0; mi < m; ++mi) {
      const Index i = run.members[static_cast<std::size_t>(mi)];
      for (Index h = 0; h < heads; ++h)
        for (Index u = 0; u < t; ++u)
          kernels::merge_normalized_row(p.out.data + (i * t + u) * ha + h * p.d_v, own_lse[(i * heads + h) * t + u],
                                        out + (mi * t + u) * ha + h * p.d_v, lse[h * m * t + mi * t + u], p.d_v);
    }
  }
}

}  // namespace detail

template <typename Scalar>
template <typename K, typename V>
void ScaledDotProductAttention<Scalar>::append(const K& keys, const V& values, KVCache<Scalar>& cache,
                                               const Eigen::ThreadPoolDevice* device) const {
  SDPA_DETAIL_CHECK_INPUT(K, Scalar);
  SDPA_DETAIL_CHECK_INPUT(V, Scalar);
  if constexpr (detail::is_valid_input<K, Scalar>() && detail::is_valid_input<V, Scalar>()) {
    const detail::Inputs<Scalar> in(keys, keys, values);
    const char* where = "ScaledDotProductAttention::append";
    check_cache(cache, where);
    check_decoding_input(in.k(), "keys", cache.batch(), where);
    check_decoding_input(in.v(), "values", cache.batch(), where);
    if (in.v().dims()[1] != in.k().dims()[1])
      detail::throw_invalid(where, "values dimension 1 (sequence length)", detail::concat(in.k().dims()[1], ", the length of keys"),
                            detail::concat(in.v().dims()[1], " (values shape ", detail::shape_string(in.v().dims()), ")"));
    cache.make_room(in.k().dims()[1]);
    project_into_cache(in.k(), in.v(), cache, device, nullptr);
  }
}

template <typename Scalar>
template <typename Q>
auto ScaledDotProductAttention<Scalar>::attend(const Q& queries, const KVCache<Scalar>& cache,
                                               const AttentionOptions<Scalar>& options) const -> Tensor3 {
  SDPA_DETAIL_CHECK_INPUT(Q, Scalar);
  Tensor3 out;
  if constexpr (detail::is_valid_input<Q, Scalar>()) {
    const detail::InputView<Scalar> q(queries);
    out = Tensor3(q.dims()[0], q.dims()[1], d_model_);
    attend_impl(q, cache, options, out.data(), out.dimensions(), "ScaledDotProductAttention::attend");
  }
  return out;
}

template <typename Scalar>
template <typename Q>
void ScaledDotProductAttention<Scalar>::attend(const Q& queries, const KVCache<Scalar>& cache,
                                               const AttentionOptions<Scalar>& options, Eigen::TensorMap<Tensor3> out)
    const {
  SDPA_DETAIL_CHECK_INPUT(Q, Scalar);
  if constexpr (detail::is_valid_input<Q, Scalar>()) {
    const detail::InputView<Scalar> q(queries);
    attend_impl(q, cache, options, out.data(), out.dimensions(), "ScaledDotProductAttention::attend");
  }
}

template <typename Scalar>
template <typename X>
auto ScaledDotProductAttention<Scalar>::step(const X& x, KVCache<Scalar>& cache, AttentionOptions<Scalar> options)
    const -> Tensor3 {
  SDPA_DETAIL_CHECK_INPUT(X, Scalar);
  Tensor3 out;
  if constexpr (detail::is_valid_input<X, Scalar>()) {
    const detail::InputView<Scalar> in(x);
    out = Tensor3(in.dims()[0], in.dims()[1], d_model_);
    step_impl(in, cache, options, out.data(), out.dimensions());
  }
  return out;
}

template <typename Scalar>
template <typename X>
void ScaledDotProductAttention<Scalar>::step(const X& x, KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options,
                                             Eigen::TensorMap<Tensor3> out) const {
  SDPA_DETAIL_CHECK_INPUT(X, Scalar);
  if constexpr (detail::is_valid_input<X, Scalar>()) {
    const detail::InputView<Scalar> in(x);
    step_impl(in, cache, options, out.data(), out.dimensions());
  }
}

template <typename Scalar>
template <typename X>
auto ScaledDotProductAttention<Scalar>::step(const X& x, PagedKVCache<Scalar>& cache,
                                             const std::vector<std::int64_t>& sequence_ids,
                                             const AttentionOptions<Scalar>& options) const -> Tensor3 {
  SDPA_DETAIL_CHECK_INPUT(X, Scalar);
  Tensor3 out;
  if constexpr (detail::is_valid_input<X, Scalar>()) {
    const detail::InputView<Scalar> in(x);
    out = Tensor3(in.dims()[0], in.dims()[1], d_model_);
    paged_step_impl(in, cache, sequence_ids, options, out.data());
  }
  return out;
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::check_cache(const KVCache<Scalar>& cache, const char* where) const {
  if (cache.d_model() != d_model_ || cache.kv_heads() != kv_heads_ || cache.d_k() != d_k_ || cache.d_v() != d_v_)
    detail::throw_invalid(where, "cache",
                          detail::concat("a cache for d_model ", d_model_, ", kv_heads ", kv_heads_, ", d_k ", d_k_,
                                         ", d_v ", d_v_),
                          detail::concat("one for d_model ", cache.d_model(), ", kv_heads ", cache.kv_heads(), ", d_k ",
                                         cache.d_k(), ", d_v ", cache.d_v()));
  if (is_narrow<Scalar>(cache.storage()) && kernel_ == Kernel::kReference)
    detail::throw_invalid(where, "the module's kernel (set_kernel)",
                          detail::concat("kAuto or kTiled for a cache stored as ", storage_name(cache.storage()),
                                         " (the reference kernel reads Scalar keys only)"),
                          "kReference");
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::check_decoding_input(const View& in, const char* name, Index batch, const char* where)
    const {
  if (in.dims()[2] != d_model_)
    detail::throw_invalid(where, detail::concat(name, " dimension 2 (d_model)"), d_model_,
                          detail::concat(in.dims()[2], " (", name, " shape ", detail::shape_string(in.dims()), ")"));
  if (in.dims()[0] != batch)
    detail::throw_invalid(where, detail::concat(name, " dimension 0 (batch)"), detail::concat(batch, ", the cache's batch"),
                          detail::concat(in.dims()[0], " (", name, " shape ", detail::shape_string(in.dims()), ")"));
  if (in.data() == nullptr && in.dims()[0] * in.dims()[1] * in.dims()[2] != 0)
    detail::throw_invalid(where, name, "a tensor with data", "a null pointer");
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::check_output(const std::array<Index, 3>& want,
                                                     const typename Tensor3::Dimensions& got, const char* where) {
  if (got[0] != want[0] || got[1] != want[1] || got[2] != want[2])
    detail::throw_invalid(where, "out", detail::concat("of shape ", detail::shape_string(want)),
                          detail::concat("of shape ", detail::shape_string(got)));
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::check_dropped(Index first, Index position, const AttentionOptions<Scalar>& o,
                                                      Index nq, const char* where) {
  if (first == 0) return;
  // A score program that says what its first query sees (Llama 4's chunks) may have let the cache drop.
  if (o.program != nullptr && o.program->keep_from(position - nq) >= first) return;
  const bool windowed = o.window_left >= 0;
  if (!windowed || position - nq - o.window_left < first)
    detail::throw_invalid(where, "window_left",
                          detail::concat("at most ", std::max<Index>(0, position - nq - first), ": the cache holds positions ",
                                         first, " .. ", position - 1,
                                         " only (a sliding-window step dropped the older ones)"),
                          o.window_left);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::project_into_cache(const View& kv, const View& vv, KVCache<Scalar>& cache,
                                                           const Eigen::ThreadPoolDevice* device, Scalar* q_out,
                                                           const Index* pos) const {
  using Target = kernels::ProjectionTarget<Scalar>;
  const Index batch = cache.batch(), n = kv.dims()[1], hq = h_ * d_k_, hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
  const Index at = cache.size();
  const bool kv_same = kv.data() == vv.data() && kv.dims() == vv.dims();
  auto target = [](const LinearType& layer, Scalar* y, Index ldy, Index group_rows, Index group_stride) {
    Target t = layer.target(y, ldy);
    t.group_rows = group_rows;
    t.group_stride = group_stride;
    return t;
  };
  if (batch * n == 0) {
    cache.advance(n);
    return;
  }
  if (cache.narrow()) {
    project_into_narrow_cache(kv, vv, kv_same, cache, device, q_out, pos);
    cache.advance(n);
    return;
  }
  if (batch * n <= kernels::kFewRows) {
    // A decoding step: every weight row read once for all rows; the rows of batch entry b go to the
    // cache's entries of b (group stride: one sequence's capacity).
    Target targets[3];
    std::size_t count = 0;
    if (q_out != nullptr) targets[count++] = target(fc_q_, q_out, hq, 0, 0);
    targets[count++] = target(fc_k_, cache.key_rows(0) + at * hk, hk, n, cache.capacity() * hk);
    if (kv_same) targets[count++] = target(fc_v_, cache.value_rows(0) + at * hv, hv, n, cache.capacity() * hv);
    kernels::project_few_rows<Scalar>(kv.data(), batch * n, d_model_, d_model_, targets, count, device);
    if (!kv_same) {
      const Target tv = target(fc_v_, cache.value_rows(0) + at * hv, hv, n, cache.capacity() * hv);
      kernels::project_few_rows<Scalar>(vv.data(), batch * n, d_model_, d_model_, &tv, 1, device);
    }
  } else {
    for (Index b = 0; b < batch; ++b) {
      std::vector<Target> targets;
      if (q_out != nullptr) targets.push_back(target(fc_q_, q_out + b * n * hq, hq, 0, 0));
      targets.push_back(target(fc_k_, cache.key_rows(b) + at * hk, hk, 0, 0));
      if (kv_same) targets.push_back(target(fc_v_, cache.value_rows(b) + at * hv, hv, 0, 0));
      kernels::project_rows<Scalar>(kv.data() + b * n * d_model_, n, d_model_, targets, device);
      if (!kv_same)
        kernels::project_rows<Scalar>(vv.data() + b * n * d_model_, n, d_model_,
                                      {target(fc_v_, cache.value_rows(b) + at * hv, hv, 0, 0)}, device);
    }
  }
  transform(cache.key_rows(0) + at * hk, batch, cache.capacity() * hk, n, hk, false, cache.position(),
            {pos, batch * n});
  transform(q_out, batch, n * hq, n, hq, true, cache.position(), {pos, batch * n});
  cache.advance(n);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::project_into_narrow_cache(const View& kv, const View& vv, bool kv_same,
    KVCache<Scalar>& cache, const Eigen::ThreadPoolDevice* device, Scalar* q_out, const Index* pos) const {
  using Target = kernels::ProjectionTarget<Scalar>;
  constexpr Index kStageRows = 256;
  const Index batch = cache.batch(), n = kv.dims()[1], hq = h_ * d_k_, hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
  const Index at = cache.size();
  auto target = [](const LinearType& layer, Scalar* y, Index ldy) { return layer.target(y, ldy); };
  if (batch * n <= kernels::kFewRows) {
    // A decoding step: every weight row read once for all rows of the batch.
    Scalar* sk = cache.step_scratch().stage.reset_at_least(static_cast<std::size_t>(batch * n * (hk + hv)));
    Scalar* sv = sk + batch * n * hk;
    Target targets[3];
    std::size_t count = 0;
    if (q_out != nullptr) targets[count++] = target(fc_q_, q_out, hq);
    targets[count++] = target(fc_k_, sk, hk);
    if (kv_same) targets[count++] = target(fc_v_, sv, hv);
    kernels::project_few_rows<Scalar>(kv.data(), batch * n, d_model_, d_model_, targets, count, device);
    if (!kv_same) {
      const Target tv = target(fc_v_, sv, hv);
      kernels::project_few_rows<Scalar>(vv.data(), batch * n, d_model_, d_model_, &tv, 1, device);
    }
    transform(sk, batch, n * hk, n, hk, false, cache.position(), {pos, batch * n});
    transform(q_out, batch, n * hq, n, hq, true, cache.position(), {pos, batch * n});
    for (Index b = 0; b < batch; ++b) {
      cache.store_rows(false, b, at, sk + b * n * hk, hk, n);
      cache.store_rows(true, b, at, sv + b * n * hv, hv, n);
    }
    return;
  }
  const Index rows = std::min(n, kStageRows);
  Scalar* sk = cache.step_scratch().stage.reset_at_least(static_cast<std::size_t>(rows * (hk + hv)));
  Scalar* sv = sk + rows * hk;
  for (Index b = 0; b < batch; ++b) {
    for (Index r0 = 0; r0 < n; r0 += rows) {
      const Index m = std::min(rows, n - r0);
      std::vector<Target> targets;
      if (q_out != nullptr) targets.push_back(target(fc_q_, q_out + (b * n + r0) * hq, hq));
      targets.push_back(target(fc_k_, sk, hk));
      if (kv_same) targets.push_back(target(fc_v_, sv, hv));
      kernels::project_rows<Scalar>(kv.data() + (b * n + r0) * d_model_, m, d_model_, targets, device);
      if (!kv_same) kernels::project_rows<Scalar>(vv.data() + (b * n + r0) * d_model_, m, d_model_, {target(fc_v_, sv, hv)}, device);
      transform(sk, 1, 0, m, hk, false, cache.position() + r0,
                {pos == nullptr ? nullptr : pos + b * n + r0, batch * n});
      cache.store_rows(false, b, at + r0, sk, hk, m);
      cache.store_rows(true, b, at + r0, sv, hv, m);
    }
  }
  transform(q_out, batch, n * hq, n, hq, true, cache.position(), {pos, batch * n});
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::attend_projected(const ProjectedStep& step, const KVCache<Scalar>& cache,
                                                         const AttentionOptions<Scalar>& options, bool causal,
                                                         kernels::DecodeWorkspace<Scalar>& workspace,
                                                         const char* where) const {
  const Scalar* q = step.q;
  const Scalar* x = step.x;
  Scalar* att = step.att;
  Scalar* out = step.out;
  const Index nq = step.nq;
  const Index batch = cache.batch(), nk = cache.size(), hq = h_ * d_k_, hv = h_ * d_v_;
  kernels::AttentionProblem<Scalar> p =
      detail::problem_of(call_shape(where, batch, nq, nk), options, masked_rows_, causal, nk - nq);
  p.key_base = cache.first_position();  // a score program's positions are absolute
  p.q = {q, nq * hq, hq, d_k_};
  p.read_rows(cache.rows());  // entries stored narrower than Scalar are widened a block at a time
  p.out = {att, nq * hv, hv, d_v_};
  draw_dropout(p);
  detail::run_attention(p, kernel_, &workspace, options.device);
  apply_gate(x, batch * nq, att, att + batch * nq * hv, options.device);
  if (batch * nq <= kernels::kFewRows) {
    const kernels::ProjectionTarget<Scalar> to = fc_o_.target(out, d_model_);
    kernels::project_few_rows<Scalar>(att, batch * nq, hv, hv, &to, 1, options.device);
  } else {
    fc_o_.forward_rows(att, batch * nq, hv, out, d_model_, options.device);
  }
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::check_decoding_options(const KVCache<Scalar>& cache,
    const AttentionOptions<Scalar>& options, Index nq, Index nk, Index position, const char* where) const {
  if (options.packed())
    detail::throw_invalid(where, "cu_seqlens_q / cu_seqlens_k",
                          "empty for a KVCache (its batch entries are the sequences; a PagedKVCache holds ragged ones)", "set");
  detail::check_attention_options(call_shape(where, cache.batch(), nq, nk), options, /*module_call=*/true);
  check_dropped(position - nk, position, options, nq, where);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::attend_impl(const View& q, const KVCache<Scalar>& cache,
                                                    const AttentionOptions<Scalar>& options, Scalar* out,
                                                    const typename Tensor3::Dimensions& out_dims, const char* where) const {
  check_cache(cache, where);
  check_decoding_input(q, "queries", cache.batch(), where);
  const Index batch = cache.batch(), nq = q.dims()[1], hq = h_ * d_k_;
  check_output({batch, nq, d_model_}, out_dims, where);
  check_decoding_options(cache, options, nq, cache.size(), cache.position(), where);
  if (!options.rotary_positions.empty())
    detail::throw_invalid(where, "rotary_positions", "empty for attend (step takes them with the tokens it appends)", "given");
  if (options.probabilities != nullptr) options.probabilities->resize(batch, h_, nq, cache.size());
  if (options.log_sum_exp != nullptr) options.log_sum_exp->resize(batch, h_, nq);
  if (batch * nq == 0) return;
  detail::Buffer<Scalar> qbuf(static_cast<std::size_t>(batch * nq * hq));
  kernels::project_rows<Scalar>(q.data(), batch * nq, d_model_,
                                {fc_q_.target(qbuf.data(), hq)}, options.device);
  // The queries are the last nq positions.
  transform(qbuf.data(), batch, nq * hq, nq, hq, true, cache.position() - nq);
  detail::Buffer<Scalar> att(static_cast<std::size_t>(batch * nq * h_ * d_v_ * (gated_ ? 2 : 1)));
  kernels::DecodeWorkspace<Scalar> workspace;
  attend_projected({qbuf.data(), nq, q.data(), att.data(), out}, cache, options, options.causal, workspace, where);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::step_impl(const View& x, KVCache<Scalar>& cache,
                                                  const AttentionOptions<Scalar>& options, Scalar* out,
                                                  const typename Tensor3::Dimensions& out_dims) const {
  const char* where = "ScaledDotProductAttention::step";
  check_cache(cache, where);
  check_decoding_input(x, "x", cache.batch(), where);
  const Index batch = cache.batch(), n = x.dims()[1];
  check_output({batch, n, d_model_}, out_dims, where);
  // Checked against the cache as it will be after the append, before anything is appended.
  check_decoding_options(cache, options, n, cache.size() + n, cache.position() + n, where);
  check_rotary_positions(where, options, batch, n);
  if (options.probabilities != nullptr) options.probabilities->resize(batch, h_, n, cache.size() + n);
  if (options.log_sum_exp != nullptr) options.log_sum_exp->resize(batch, h_, n);
  if (n == 0 || batch == 0) return;
  cache.make_room(n);
  detail::StepScratch<Scalar>& scratch = cache.step_scratch();
  Scalar* q = scratch.queries.reset_at_least(static_cast<std::size_t>(batch * n * h_ * d_k_));
  Scalar* att = scratch.attention.reset_at_least(static_cast<std::size_t>(batch * n * h_ * d_v_ * (gated_ ? 2 : 1)));  // and the gate's
  project_into_cache(x, x, cache, options.device, q, options.rotary_positions.empty() ? nullptr : options.rotary_positions.data());
  attend_projected({q, n, x.data(), att, out}, cache, options, /*causal=*/true, scratch.decode, where);
  // A sliding window: no later query sees the entries before position() - window_left. Once they are
  // half of what is held they are dropped (a rolling buffer: memory stays O(window + chunk), and each
  // entry is moved O(1) times on average).
  // Likewise the keys before what a score program's next query can see (Llama 4's chunks: the cache keeps
  // the current chunk).
  Index keep = options.window_left >= 0 ? cache.position() - options.window_left : 0;
  if (options.program != nullptr) keep = std::max(keep, options.program->keep_from(cache.position()));
  const Index droppable = keep - cache.first_position();
  if (droppable > 0 && 2 * droppable >= cache.size()) cache.drop_front(droppable);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::paged_step_impl(const View& x, PagedKVCache<Scalar>& cache,
                                                        const std::vector<std::int64_t>& ids,
                                                        const AttentionOptions<Scalar>& options, Scalar* out) const {
  using Target = kernels::ProjectionTarget<Scalar>;
  const char* where = "ScaledDotProductAttention::step (PagedKVCache)";
  detail::check_paged_cache(where, cache, {d_model_, kv_heads_, d_k_, d_v_}, kernel_);
  const Index n_seq = static_cast<Index>(ids.size());
  check_decoding_input(x, "x", n_seq, where);
  detail::check_sequence_ids(where, cache, ids);
  if (const char* unsupported = detail::unsupported_ragged_option(options))
    detail::throw_invalid(where, unsupported, "unset for a PagedKVCache step (its sequences are ragged)", "set");
  const Index t = x.dims()[1], hq = h_ * d_k_, hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_, ha = h_ * d_v_;
  // The keys of the step's longest sequence, after the append.
  Index nk = 0;
  for (std::int64_t id : ids) nk = std::max(nk, cache.size(id) + t);
  detail::check_attention_options(call_shape(where, n_seq, t, nk), options, /*module_call=*/true);
  for (std::int64_t id : ids) check_dropped(cache.first_position(id), cache.position(id) + t, options, t, where);
  if (n_seq * t == 0) return;
  // Room for the new entries (refused before anything changes).
  cache.make_room(ids, t, where);

  // Queries, keys and values of every new token.
  const Index rows = n_seq * t;
  detail::StepScratch<Scalar>& scratch = cache.step_scratch();
  Scalar* q = scratch.queries.reset_at_least(static_cast<std::size_t>(rows * hq));
  Scalar* sk = scratch.stage.reset_at_least(static_cast<std::size_t>(rows * (hk + hv)));
  Scalar* sv = sk + rows * hk;
  const Target targets[3] = {fc_q_.target(q, hq), fc_k_.target(sk, hk), fc_v_.target(sv, hv)};
  detail::project_new_rows(x.data(), rows, t, d_model_, targets, options.device);
  // Each sequence's new rows at its own positions, then into its blocks.
  std::vector<const Index*> tables(static_cast<std::size_t>(n_seq));
  std::vector<Index> lengths(static_cast<std::size_t>(n_seq)), offsets(static_cast<std::size_t>(n_seq)),
      bases(static_cast<std::size_t>(n_seq));
  for (Index i = 0; i < n_seq; ++i) {
    const std::int64_t id = ids[static_cast<std::size_t>(i)];
    transform(sk + i * t * hk, 1, 0, t, hk, false, cache.position(id));
    transform(q + i * t * hq, 1, 0, t, hq, true, cache.position(id));
    cache.store_rows(id, false, sk + i * t * hk, hk, t);
    cache.store_rows(id, true, sv + i * t * hv, hv, t);
    cache.advance(id, t);
    tables[static_cast<std::size_t>(i)] = cache.block_table(id);
    lengths[static_cast<std::size_t>(i)] = cache.size(id);
    offsets[static_cast<std::size_t>(i)] = cache.size(id) - t;
    bases[static_cast<std::size_t>(i)] = cache.first_position(id);  // a score program's positions are absolute
  }

  // The attention of each sequence's queries to its own entries: batch entry i is sequence ids[i], its keys
  // found through its block table, hidden past its length, its queries at its last positions.
  AttentionOptions<Scalar> own = options;
  own.key_lengths = lengths;
  kernels::AttentionProblem<Scalar> p = detail::problem_of(call_shape(where, n_seq, t, nk), own, masked_rows_, true, 0);
  p.query_offsets = offsets.data();
  p.key_bases = bases.data();
  p.q = {q, t * hq, hq, d_k_};
  p.block_tables = tables.data();
  p.block_rows = cache.block_size();
  p.read_rows(cache.rows());
  Scalar* att = scratch.attention.reset_at_least(static_cast<std::size_t>(rows * ha * (gated_ ? 2 : 1)));
  p.out = {att, t * ha, ha, d_v_};
  draw_dropout(p);
  // Blocks that several of the sequences share (forks of one prompt) are attended once for all of them
  // (detail::attend_cascade); a score program asks per batch entry and a dropout draw is per sequence, so
  // those steps read every sequence's blocks as it alone would.
  std::vector<typename PagedKVCache<Scalar>::SharedBlocks> shared;
  if (cache.cascade() && !p.dropout && options.program == nullptr) shared = cache.shared_blocks(ids);
  if (shared.empty()) {
    detail::run_attention(p, kernel_, &scratch.decode, options.device);
  } else {
    std::vector<Index> first(static_cast<std::size_t>(n_seq));
    for (Index i = 0; i < n_seq; ++i)
      first[static_cast<std::size_t>(i)] = cache.first_position(ids[static_cast<std::size_t>(i)]);
    detail::attend_cascade(p, shared, {tables, lengths, offsets, bases, first}, cache.block_size(), kernel_, scratch,
                           options.device);
  }
  apply_gate(x.data(), rows, att, att + rows * ha, options.device);
  if (t <= kernels::kFewRows) {
    const kernels::ProjectionTarget<Scalar> to = fc_o_.target(out, d_model_);
    kernels::project_few_rows<Scalar>(att, rows, ha, ha, &to, 1, options.device);
  } else {
    fc_o_.forward_rows(att, rows, ha, out, d_model_, options.device);
  }
  if (options.window_left >= 0)
    for (std::int64_t id : ids) cache.drop_hidden(id, options.window_left);
}

template <typename Scalar>
template <typename X>
auto ScaledDotProductAttention<Scalar>::step_tree(const X& x, KVCache<Scalar>& cache, const std::vector<Index>& parents,
                                                  const AttentionOptions<Scalar>& options) const -> Tensor3 {
  SDPA_DETAIL_CHECK_INPUT(X, Scalar);
  Tensor3 out;
  if constexpr (detail::is_valid_input<X, Scalar>()) {
    const detail::InputView<Scalar> in(x);
    out = Tensor3(in.dims()[0], in.dims()[1], d_model_);
    tree_step_impl(in, cache, nullptr, parents, options, out.data());
  }
  return out;
}

template <typename Scalar>
template <typename X>
auto ScaledDotProductAttention<Scalar>::step_tree(const X& x, PagedKVCache<Scalar>& cache,
                                                  const std::vector<std::int64_t>& sequence_ids,
                                                  const std::vector<Index>& parents,
                                                  const AttentionOptions<Scalar>& options) const -> Tensor3 {
  SDPA_DETAIL_CHECK_INPUT(X, Scalar);
  Tensor3 out;
  if constexpr (detail::is_valid_input<X, Scalar>()) {
    const detail::InputView<Scalar> in(x);
    out = Tensor3(in.dims()[0], in.dims()[1], d_model_);
    tree_step_impl(in, cache, &sequence_ids, parents, options, out.data());
  }
  return out;
}

// A tree step in two parts merged by their log-sum-exps: every draft over the sequence's held entries (the
// decoding or tiled kernel, each query at its depth's position, so windows and ALiBi see its distances),
// and over the drafts themselves (a mask of its ancestors and itself, ALiBi as a bias of depth distances,
// the window on depths; the drafts' keys and values as stored, widened). Sinks go with the first part.
template <typename Scalar>
template <typename Cache>
void ScaledDotProductAttention<Scalar>::tree_step_impl(const View& x, Cache& cache,
                                                       const std::vector<std::int64_t>* ids,
                                                       const std::vector<Index>& parents,
                                                       const AttentionOptions<Scalar>& options, Scalar* out) const {
  using Target = kernels::ProjectionTarget<Scalar>;
  constexpr bool kPaged = std::is_same<Cache, PagedKVCache<Scalar>>::value;
  const char* where =
      kPaged ? "ScaledDotProductAttention::step_tree (PagedKVCache)" : "ScaledDotProductAttention::step_tree";
  Index batch = 0;
  if constexpr (kPaged) {
    detail::check_paged_cache(where, cache, {d_model_, kv_heads_, d_k_, d_v_}, kernel_);
    batch = static_cast<Index>(ids->size());
    detail::check_sequence_ids(where, cache, *ids);
  } else {
    check_cache(cache, where);
    batch = cache.batch();
  }
  check_decoding_input(x, "x", batch, where);
  const Index n = x.dims()[1];
  if (static_cast<Index>(parents.size()) != n)
    detail::throw_invalid(where, "parents", detail::concat(n, " entries (one per draft token: x dimension 1)"),
                          parents.size());
  const std::vector<Index> depth = detail::draft_depths(where, parents);
  const char* unsupported = detail::unsupported_ragged_option(options);
  if (unsupported == nullptr && options.program != nullptr) unsupported = "program";
  if (unsupported != nullptr) detail::throw_invalid(where, unsupported, "unset for a draft tree step", "set");
  if (training_ && dropout_ > Scalar(0))
    detail::throw_invalid(where, "the module's mode", "eval() or dropout 0 (a draft tree is verified without dropout)",
                          "training with dropout");
  // Each sequence's held entries, positions and first held position.
  const auto seq = [&](Index b) { return kPaged ? (*ids)[static_cast<std::size_t>(b)] : std::int64_t{0}; };
  std::vector<Index> sizes(static_cast<std::size_t>(batch)), positions(sizes), firsts(sizes);
  Index nk = 0;
  for (Index b = 0; b < batch; ++b) {
    if constexpr (kPaged) {
      sizes[static_cast<std::size_t>(b)] = cache.size(seq(b));
      positions[static_cast<std::size_t>(b)] = cache.position(seq(b));
    } else {
      sizes[static_cast<std::size_t>(b)] = cache.size();
      positions[static_cast<std::size_t>(b)] = cache.position();
    }
    firsts[static_cast<std::size_t>(b)] = positions[static_cast<std::size_t>(b)] - sizes[static_cast<std::size_t>(b)];
    nk = std::max(nk, sizes[static_cast<std::size_t>(b)]);
  }
  detail::check_attention_options(call_shape(where, batch, n, nk + n), options, /*module_call=*/true);
  // The shallowest draft (at the sequence's position) must see every key it needs.
  for (Index b = 0; b < batch; ++b)
    check_dropped(firsts[static_cast<std::size_t>(b)], positions[static_cast<std::size_t>(b)] + 1, options, 1, where);
  if (batch * n == 0) return;
  if constexpr (kPaged)
    cache.make_room(*ids, n, where);
  else
    cache.make_room(n);

  // Queries, keys and values of every draft, each turned at its depth's position, stored after the held
  // entries.
  const Index rows = batch * n, hq = h_ * d_k_, hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_, ha = h_ * d_v_;
  detail::StepScratch<Scalar>& scratch = cache.step_scratch();
  Scalar* q = scratch.queries.reset_at_least(static_cast<std::size_t>(rows * hq));
  Scalar* sk = scratch.stage.reset_at_least(static_cast<std::size_t>(rows * (hk + hv)));
  Scalar* sv = sk + rows * hk;
  const Target targets[3] = {fc_q_.target(q, hq), fc_k_.target(sk, hk), fc_v_.target(sv, hv)};
  detail::project_new_rows(x.data(), rows, n, d_model_, targets, options.device);
  for (Index b = 0; b < batch; ++b) {
    for (Index j = 0; j < n; ++j) {
      const Index r = b * n + j, pos = positions[static_cast<std::size_t>(b)] + depth[static_cast<std::size_t>(j)] - 1;
      transform(sk + r * hk, 1, 0, 1, hk, false, pos);
      transform(q + r * hq, 1, 0, 1, hq, true, pos);
    }
    if constexpr (kPaged) {
      cache.store_rows(seq(b), false, sk + b * n * hk, hk, n);
      cache.store_rows(seq(b), true, sv + b * n * hv, hv, n);
    } else {
      cache.store_rows(false, b, sizes[0], sk + b * n * hk, hk, n);
      cache.store_rows(true, b, sizes[0], sv + b * n * hv, hv, n);
    }
  }

  // Part 1: the drafts over the held entries.
  Scalar* att = scratch.attention.reset_at_least(static_cast<std::size_t>(rows * ha * (gated_ ? 2 : 1)));
  Scalar* part = scratch.parts.reset_at_least(static_cast<std::size_t>(rows * (ha + hk + hv) + 2 * batch * h_ * n));
  Scalar* kd = part + rows * ha;
  Scalar* vd = kd + rows * hk;
  Scalar* lse_held = vd + rows * hv;
  Scalar* lse_drafts = lse_held + batch * h_ * n;
  if (static_cast<Index>(scratch.positions.size()) < rows) scratch.positions.resize(static_cast<std::size_t>(rows));
  for (Index b = 0; b < batch; ++b)
    for (Index j = 0; j < n; ++j)
      scratch.positions[static_cast<std::size_t>(b * n + j)] =
          sizes[static_cast<std::size_t>(b)] + depth[static_cast<std::size_t>(j)] - 1;
  std::vector<const Index*> tables(static_cast<std::size_t>(batch));
  if (nk == 0) {
    // Nothing held: each row's part is empty (its sink alone, if any).
    std::fill_n(att, rows * ha, Scalar(0));
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < h_; ++h)
        std::fill_n(lse_held + (b * h_ + h) * n, n,
                    options.sinks.empty() ? -std::numeric_limits<Scalar>::infinity()
                                          : options.sinks[static_cast<std::size_t>(h)]);
  } else {
    AttentionOptions<Scalar> held = options;
    if constexpr (kPaged) held.key_lengths = sizes;
    kernels::AttentionProblem<Scalar> p =
        detail::problem_of(call_shape(where, batch, n, nk), held, masked_rows_, true, 0);
    p.query_positions = scratch.positions.data();
    p.q = {q, n * hq, hq, d_k_};
    p.read_rows(cache.rows());
    if constexpr (kPaged) {
      for (Index b = 0; b < batch; ++b) tables[static_cast<std::size_t>(b)] = cache.block_table(seq(b));
      p.block_tables = tables.data();
      p.block_rows = cache.block_size();
      p.key_bases = firsts.data();
    } else {
      p.key_base = firsts[0];
    }
    p.out = {att, n * ha, ha, d_v_};
    p.lse = lse_held;
    detail::run_attention(p, kernel_, &scratch.decode, options.device);
  }

  // Part 2: the drafts over their ancestors and themselves, their keys and values as the cache stores them.
  if (is_narrow<Scalar>(cache.storage())) {
    const std::size_t es = storage_bytes(cache.storage());
    detail::Buffer<unsigned char> bytes(static_cast<std::size_t>(rows * std::max(hk, hv)) * es);
    detail::Buffer<float> scales(static_cast<std::size_t>(rows * kv_heads_));
    detail::store_rows(cache.storage(), sk, hk, rows, kv_heads_, d_k_, bytes.data(), scales.data());
    detail::load_rows(cache.storage(), bytes.data(), rows, kv_heads_, d_k_, scales.data(), kd);
    detail::store_rows(cache.storage(), sv, hv, rows, kv_heads_, d_v_, bytes.data(), scales.data());
    detail::load_rows(cache.storage(), bytes.data(), rows, kv_heads_, d_v_, scales.data(), vd);
  } else {
    std::copy_n(sk, rows * hk, kd);
    std::copy_n(sv, rows * hv, vd);
  }
  Eigen::Tensor<bool, 4, Eigen::RowMajor> hidden(1, 1, n, n);
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor> distance;
  if (!options.alibi_slopes.empty()) distance.resize(1, h_, n, n);
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < n; ++j) {
      const Index gap = depth[static_cast<std::size_t>(i)] - depth[static_cast<std::size_t>(j)];
      hidden(0, 0, i, j) =
          !detail::draft_ancestor(parents, j, i) || (options.window_left >= 0 && gap > options.window_left);
      for (Index h = 0; h < distance.dimension(1); ++h)
        distance(0, h, i, j) = -options.alibi_slopes[static_cast<std::size_t>(h)] * static_cast<Scalar>(std::abs(gap));
    }
  AttentionOptions<Scalar> tree = options;
  tree.alibi_slopes.clear();
  tree.sinks.clear();
  tree.window_left = tree.window_right = -1;
  tree.attention_mask = &hidden;
  tree.attention_bias = options.alibi_slopes.empty() ? nullptr : &distance;
  kernels::AttentionProblem<Scalar> pt =
      detail::problem_of(call_shape(where, batch, n, n), tree, MaskedRows::kZero, false, 0);
  pt.q = {q, n * hq, hq, d_k_};
  pt.k = {kd, n * hk, hk, d_k_};
  pt.v = {vd, n * hv, hv, d_v_};
  pt.out = {part, n * ha, ha, d_v_};
  pt.lse = lse_drafts;
  detail::run_attention(pt, kernel_, &scratch.decode, options.device);
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < h_; ++h)
      for (Index j = 0; j < n; ++j) {
        const Index at = (b * n + j) * ha + h * d_v_, r = (b * h_ + h) * n + j;
        kernels::merge_normalized_row(att + at, lse_held[r], part + at, lse_drafts[r], d_v_);
      }

  apply_gate(x.data(), rows, att, att + rows * ha, options.device);
  if (n <= kernels::kFewRows) {
    const kernels::ProjectionTarget<Scalar> to = fc_o_.target(out, d_model_);
    kernels::project_few_rows<Scalar>(att, rows, ha, ha, &to, 1, options.device);
  } else {
    fc_o_.forward_rows(att, rows, ha, out, d_model_, options.device);
  }
  if constexpr (kPaged) {
    for (Index b = 0; b < batch; ++b) cache.hold_drafts(seq(b), parents);
  } else {
    cache.hold_drafts(parents);
  }
}

SDPA_NAMESPACE_END
