// The module's forward internals (declared in sdpa/scaled_dot_product_attention.hpp, which includes this
// header after the class): the input checks, the projections (one pass over inputs that are the same
// tensor), the per-token transforms of projected queries and keys that forward and the decoding steps share
// (QK-norm, rotary, temperature), the output gate, and forward itself, which hands the projections to the
// attention core (detail::run_attention) and applies fc_o.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sdpa/kernels/bf16_projection.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
template <typename Q, typename K, typename V>
auto ScaledDotProductAttention<Scalar>::forward(const Q& queries, const K& keys, const V& values,
                                                const AttentionOptions<Scalar>& options) const -> Tensor3 {
  SDPA_DETAIL_CHECK_INPUT(Q, Scalar);
  SDPA_DETAIL_CHECK_INPUT(K, Scalar);
  SDPA_DETAIL_CHECK_INPUT(V, Scalar);
  if constexpr (detail::is_valid_input<Q, Scalar>() && detail::is_valid_input<K, Scalar>() &&
                detail::is_valid_input<V, Scalar>()) {
    const detail::Inputs<Scalar> in(queries, keys, values);
    return forward_impl(in.q(), in.k(), in.v(), options);
  } else {
    return Tensor3();  // not reached: the static_asserts above stop the build
  }
}

template <typename Scalar>
template <typename Q, typename K, typename V>
auto ScaledDotProductAttention<Scalar>::operator()(const Q& queries, const K& keys, const V& values,
                                                   const AttentionOptions<Scalar>& options) const -> Tensor3 {
  return forward(queries, keys, values, options);
}

template <typename Scalar>
template <typename Q, typename K, typename V>
auto ScaledDotProductAttention<Scalar>::forward(const Q& queries, const K& keys, const V& values,
                                                const AttentionOptions<Scalar>& options, ForwardState<Scalar>& state)
    const -> Tensor3 {
  SDPA_DETAIL_CHECK_INPUT(Q, Scalar);
  SDPA_DETAIL_CHECK_INPUT(K, Scalar);
  SDPA_DETAIL_CHECK_INPUT(V, Scalar);
  if constexpr (detail::is_valid_input<Q, Scalar>() && detail::is_valid_input<K, Scalar>() &&
                detail::is_valid_input<V, Scalar>()) {
    check_scalar_weights("ScaledDotProductAttention::forward (with a ForwardState)");
    const detail::Inputs<Scalar> in(queries, keys, values);
    return forward_impl(in.q(), in.k(), in.v(), options, &state);
  } else {
    return Tensor3();
  }
}

template <typename Scalar>
template <typename Q, typename K, typename V>
auto ScaledDotProductAttention<Scalar>::forward(const Q& queries, const K& keys, const V& values, const Mask* attention_mask,
                                                const Weights* attention_weights, const Eigen::ThreadPoolDevice* device)
    const -> Tensor3 {
  AttentionOptions<Scalar> options;
  options.attention_mask = attention_mask;
  options.attention_weights = attention_weights;
  options.device = device;
  return forward(queries, keys, values, options);
}

template <typename Scalar>
template <typename Q, typename K, typename V>
auto ScaledDotProductAttention<Scalar>::operator()(const Q& queries, const K& keys, const V& values,
                                                   const Mask* attention_mask, const Weights* attention_weights,
                                                   const Eigen::ThreadPoolDevice* device) const -> Tensor3 {
  return forward(queries, keys, values, attention_mask, attention_weights, device);
}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::call_shape(const char* where, Index batch, Index nq, Index nk)
    const noexcept -> detail::CallShape {
  detail::CallShape c;
  c.where = where;
  c.batch = batch;
  c.heads = h_;
  c.kv_heads = kv_heads_;
  c.nq = nq;
  c.nk = nk;
  c.d_k = d_k_;
  c.d_v = d_v_;
  return c;
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::draw_dropout(kernels::AttentionProblem<Scalar>& p) const {
  if (!(training_ && dropout_ > Scalar(0))) return;
  p.dropout = true;
  p.sampler = DropoutSampler(seed_, calls_.fetch_add(1), static_cast<double>(dropout_));
  p.keep_scale = dropout_ >= Scalar(1) ? Scalar(0) : Scalar(1) / (Scalar(1) - dropout_);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::check_inputs(const View& q, const View& k, const View& v) const {
  const char* where = "ScaledDotProductAttention::forward";
  const char* names[3] = {"queries", "keys", "values"};
  const View* views[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    if (views[i]->dims()[2] != d_model_)
      detail::throw_invalid(where, detail::concat(names[i], " dimension 2 (d_model)"), d_model_,
                            detail::concat(views[i]->dims()[2], " (", names[i], " shape ",
                                           detail::shape_string(views[i]->dims()), ")"));
  }
  for (int i = 1; i < 3; ++i) {
    if (views[i]->dims()[0] != q.dims()[0])
      detail::throw_invalid(where, detail::concat(names[i], " dimension 0 (batch)"),
                            detail::concat(q.dims()[0], ", the batch size of queries"),
                            detail::concat(views[i]->dims()[0], " (", names[i], " shape ",
                                           detail::shape_string(views[i]->dims()), ")"));
  }
  if (v.dims()[1] != k.dims()[1])
    detail::throw_invalid(where, "values dimension 1 (sequence length)",
                          detail::concat(k.dims()[1], ", the length of keys"),
                          detail::concat(v.dims()[1], " (values shape ", detail::shape_string(v.dims()), ")"));
  for (int i = 0; i < 3; ++i) {
    if (views[i]->data() == nullptr && views[i]->dims()[0] * views[i]->dims()[1] * views[i]->dims()[2] != 0)
      detail::throw_invalid(where, names[i], "a tensor with data", "a null pointer");
  }
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::project_pass(const Scalar* x, Index rows,
                                                     const std::vector<kernels::ProjectionTarget<Scalar>>& targets,
                                                     const Eigen::ThreadPoolDevice* device) const {
  if constexpr (std::is_same<Scalar, float>::value) {
    if (compute_ == Compute::kBf16) {
      kernels::project_rows_bf16(x, rows, d_model_, d_model_, targets.data(), targets.size(), device, active_bf16_path());
      return;
    }
  }
  kernels::project_rows<Scalar>(x, rows, d_model_, targets, device);
}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::project(const View& qv, const View& kv, const View& vv,
                                                const Eigen::ThreadPoolDevice* device, const Index* key_lengths)
    const -> Projected {
  using Target = kernels::ProjectionTarget<Scalar>;
  const Index hq = h_ * d_k_, hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
  const Index batch = qv.dims()[0], nk = kv.dims()[1];
  const Index rows_q = qv.dims()[0] * qv.dims()[1], rows_k = kv.dims()[0] * kv.dims()[1];
  const bool kv_same = kv.data() == vv.data() && kv.dims() == vv.dims();
  const bool qk_same = kv_same && qv.data() == kv.data() && qv.dims() == kv.dims();
  auto target = [](const LinearType& layer, Scalar* y, Index ldy) { return layer.target(y, ldy); };
  // One pass of `targets` over input rows [r0, r1) (target rows likewise).
  auto pass = [&](const Scalar* x, Index r0, Index r1, std::vector<Target> targets) {
    if (r1 <= r0) return;
    for (Target& t : targets) t.y += r0 * t.ldy;
    project_pass(x + r0 * d_model_, r1 - r0, targets, device);
  };
  // The key rows of each batch entry: [b * nk, b * nk + length) projected by `layers` into columns
  // [c0, c0 + their widths) of the buffer (stride ld), the rest of those columns zeroed. With lengths
  // shorter than nk in a batch of several entries, the visible rows are gathered into one block and
  // projected in one pass, then scattered back: each weight is packed once for the whole batch, not once
  // per batch entry (whose short passes spent as long packing as multiplying).
  auto key_passes = [&](const Scalar* x, std::vector<const LinearType*> layers, Scalar* buffer, Index ld, Index c0) {
    Index width = 0;
    for (const LinearType* l : layers) width += l->out_features();
    Index visible = 0;
    for (Index b = 0; key_lengths != nullptr && b < batch; ++b) visible += key_lengths[b];
    if (key_lengths == nullptr || visible == rows_k || batch == 1) {
      std::vector<Target> targets;
      Index c = c0;
      for (const LinearType* l : layers) {
        targets.push_back(target(*l, buffer + c, ld));
        c += l->out_features();
      }
      pass(x, 0, key_lengths == nullptr ? rows_k : key_lengths[0], targets);
    } else {
      detail::Buffer<Scalar> block = scratch_.take(static_cast<std::size_t>(visible * (d_model_ + width)));
      Scalar* gathered = block.data();
      Scalar* projected = gathered + visible * d_model_;
      for (Index b = 0, at = 0; b < batch; at += key_lengths[b], ++b)
        std::copy_n(x + b * nk * d_model_, key_lengths[b] * d_model_, gathered + at * d_model_);
      std::vector<Target> targets;
      Index c = 0;
      for (const LinearType* l : layers) {
        targets.push_back(target(*l, projected + c, width));
        c += l->out_features();
      }
      if (visible > 0) project_pass(gathered, visible, targets, device);
      for (Index b = 0, at = 0; b < batch; at += key_lengths[b], ++b)
        for (Index r = 0; r < key_lengths[b]; ++r)
          std::copy_n(projected + (at + r) * width, width, buffer + (b * nk + r) * ld + c0);
      scratch_.give(std::move(block));
    }
    for (Index b = 0; key_lengths != nullptr && b < batch; ++b)
      for (Index r = b * nk + key_lengths[b]; r < (b + 1) * nk; ++r) std::fill_n(buffer + r * ld + c0, width, Scalar(0));
  };
  Projected r;
  if (qk_same) {
    const Index ld = hq + hk + hv;
    r.qkv = scratch_.take(static_cast<std::size_t>(rows_q * ld));
    Scalar* base = r.qkv.data();
    const Target tq = target(fc_q_, base, ld), tk = target(fc_k_, base + hq, ld), tv = target(fc_v_, base + hq + hk, ld);
    if (key_lengths == nullptr) {
      pass(qv.data(), 0, rows_q, {tq, tk, tv});
    } else {
      // Every query row, and the keys and values of the visible rows only.
      pass(qv.data(), 0, rows_q, {tq});
      key_passes(qv.data(), {&fc_k_, &fc_v_}, base, ld, hq);
    }
    r.q = base;
    r.k = base + hq;
    r.v = base + hq + hk;
    r.ldq = r.ldk = r.ldv = ld;
    return r;
  }
  r.qkv = scratch_.take(static_cast<std::size_t>(rows_q * hq));
  pass(qv.data(), 0, rows_q, {target(fc_q_, r.qkv.data(), hq)});
  r.q = r.qkv.data();
  r.ldq = hq;
  if (rows_k == 0) return r;  // no keys: nothing to project, and no pointer into an empty buffer
  r.kv_only = scratch_.take(static_cast<std::size_t>(rows_k * (hk + hv)));
  Scalar* base = r.kv_only.data();
  const Index ld = hk + hv;
  if (kv_same) {
    key_passes(kv.data(), {&fc_k_, &fc_v_}, base, ld, 0);
  } else {
    key_passes(kv.data(), {&fc_k_}, base, ld, 0);
    key_passes(vv.data(), {&fc_v_}, base, ld, hk);
  }
  r.k = base;
  r.v = base + hk;
  r.ldk = r.ldv = ld;
  return r;
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::rotate_projected(gemm::Matrix<Scalar> qm, gemm::Matrix<Scalar> km, Index batch,
                                                         Index nq, Index nk, const AttentionOptions<Scalar>& options,
                                                         bool inverse) const {
  Scalar* q = qm.data;
  Scalar* k = km.data;
  const Index ldq = qm.ld, ldk = km.ld;
  if (!has_rotary_) return;
  if (!options.rotary_positions.empty()) {
    // The caller's positions: of the key rows, the queries taking their key row's.
    const Index* pos = options.rotary_positions.data();
    const Index rows_k = batch * nk;
    if (!options.packed()) {
      for (Index b = 0; b < batch; ++b) {
        if (k != nullptr)
          apply_rotary_at(rotary_, RotaryRows(k + b * nk * ldk, nk, ldk, kv_heads_, d_k_, d_k_), pos + b * nk, rows_k,
                          inverse);
        if (q != nullptr)
          apply_rotary_at(rotary_, RotaryRows(q + b * nq * ldq, nq, ldq, h_, d_k_, d_k_), pos + b * nk + (nk - nq),
                          rows_k, inverse);
      }
      return;
    }
    if (k != nullptr) apply_rotary_at(rotary_, RotaryRows(k, nk, ldk, kv_heads_, d_k_, d_k_), pos, rows_k, inverse);
    const std::vector<Index>&cq = options.cu_seqlens_q, &ck = options.cu_seqlens_k;
    for (std::size_t i = 0; q != nullptr && i + 1 < cq.size(); ++i) {
      const Index n = cq[i + 1] - cq[i], first = ck[i + 1] - n;  // the sequence's last n key rows
      if (n > 0)
        apply_rotary_at(rotary_, RotaryRows(q + cq[i] * ldq, n, ldq, h_, d_k_, d_k_), pos + first, rows_k, inverse);
    }
    return;
  }
  if (!options.packed()) {
    rotate(q, batch, nq * ldq, nq, ldq, h_, nk - nq, inverse);
    rotate(k, batch, nk * ldk, nk, ldk, kv_heads_, 0, inverse);
    return;
  }
  detail::rotate_rows(rotary_, kernels::Heads<Scalar>{q, 0, ldq, d_k_}, {1, nq, h_, d_k_}, nk - nq,
                      &options.cu_seqlens_q, &options.cu_seqlens_k, inverse);
  detail::rotate_rows(rotary_, kernels::Heads<Scalar>{k, 0, ldk, d_k_}, {1, nk, kv_heads_, d_k_}, Index{0},
                      &options.cu_seqlens_k, static_cast<const std::vector<Index>*>(nullptr), inverse);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::check_rotary_positions(const char* where, const AttentionOptions<Scalar>& options,
    Index batch, Index rows) const {
  if (options.rotary_positions.empty()) return;
  if (!has_rotary_)
    detail::throw_invalid(where, "rotary_positions", "empty for a module without a rotary (set_rotary)", "given");
  const Index want = rotary_.streams() * batch * rows;
  if (static_cast<Index>(options.rotary_positions.size()) != want)
    detail::throw_invalid(where, "rotary_positions",
                          detail::concat(want, " values (", rotary_.streams(), " streams x batch ", batch, " x ", rows, " rows)"),
                          detail::concat(options.rotary_positions.size(), " values"));
  for (std::size_t i = 0; i < options.rotary_positions.size(); ++i)
    if (options.rotary_positions[i] < 0)
      detail::throw_invalid(where, detail::concat("rotary_positions[", i, "]"), "non-negative", options.rotary_positions[i]);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::norm_rows(Scalar* x, Index batch, Index batch_stride, Index n, Index ld, bool query,
                                                  const Eigen::ThreadPoolDevice* device) const {
  const bool per_head = qk_norm_.kind == QkNormKind::kHead;
  const Index heads = query ? h_ : kv_heads_;
  const std::vector<Scalar>& w = query ? qk_norm_.q_weight : qk_norm_.k_weight;
  for (Index b = 0; b < batch; ++b)
    parallel_for(device, n, kElementwiseRows, [&](Index r0, Index r1) {
      detail::rms_norm_rows(x + b * batch_stride + r0 * ld, r1 - r0, ld, per_head ? heads : 1, per_head ? d_k_ : heads * d_k_,
                            w.empty() ? nullptr : w.data(), qk_norm_.eps);
    });
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::transform(Scalar* x, Index batch, Index batch_stride, Index n, Index ld,
                                                  bool query, Index first, Positions positions) const {
  const Index* pos = positions.pos;
  const Index pos_stride = positions.stride;
  if (x == nullptr) return;
  if (has_qk_norm() && !qk_norm_.after_rotary) norm_rows(x, batch, batch_stride, n, ld, query);
  if (pos != nullptr && has_rotary_)
    for (Index b = 0; b < batch; ++b)
      apply_rotary_at(rotary_, RotaryRows(x + b * batch_stride, n, ld, query ? h_ : kv_heads_, d_k_, d_k_), pos + b * n,
                      pos_stride);
  else
    rotate(x, batch, batch_stride, n, ld, query ? h_ : kv_heads_, first);
  if (has_qk_norm() && qk_norm_.after_rotary) norm_rows(x, batch, batch_stride, n, ld, query);
  if (query && has_temperature_)
    for (Index b = 0; b < batch; ++b) detail::temper_rows(temperature_, x + b * batch_stride, n, ld, h_ * d_k_, first);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::temper_queries(Scalar* q, Index ldq, Index batch, Index nq, Index nk,
                                                       const AttentionOptions<Scalar>& options) const {
  if (!has_temperature_) return;
  if (!options.packed()) {
    for (Index b = 0; b < batch; ++b)
      parallel_for(options.device, nq, kElementwiseRows, [&](Index r0, Index r1) {
        detail::temper_rows(temperature_, q + (b * nq + r0) * ldq, r1 - r0, ldq, h_ * d_k_, nk - nq + r0);
      });
    return;
  }
  const std::vector<Index>&cq = options.cu_seqlens_q, &ck = options.cu_seqlens_k;
  for (std::size_t i = 0; i + 1 < cq.size(); ++i) {
    const Index n = cq[i + 1] - cq[i];
    detail::temper_rows(temperature_, q + cq[i] * ldq, n, ldq, h_ * d_k_, ck[i + 1] - ck[i] - n);
  }
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::transform_projected(Scalar* q, Index ldq, Scalar* k, Index ldk, Index batch,
                                                            Index nq, Index nk, const AttentionOptions<Scalar>& options)
    const {
  if (has_qk_norm() && !qk_norm_.after_rotary) {
    norm_rows(q, 1, 0, batch * nq, ldq, true, options.device);
    norm_rows(k, 1, 0, batch * nk, ldk, false, options.device);
  }
  rotate_projected({q, ldq}, {k, ldk}, batch, nq, nk, options);
  if (has_qk_norm() && qk_norm_.after_rotary) {
    norm_rows(q, 1, 0, batch * nq, ldq, true, options.device);
    norm_rows(k, 1, 0, batch * nk, ldk, false, options.device);
  }
  temper_queries(q, ldq, batch, nq, nk, options);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::gate_values(const Scalar* x, Index rows, Scalar* gate,
                                                    const Eigen::ThreadPoolDevice* device) const {
  const Index ha = h_ * d_v_;
  if (rows <= kernels::kFewRows) {
    const kernels::ProjectionTarget<Scalar> t = fc_g_.target(gate, ha);
    kernels::project_few_rows<Scalar>(x, rows, d_model_, d_model_, &t, 1, device);
  } else {
    project_pass(x, rows, {fc_g_.target(gate, ha)}, device);
  }
  parallel_for(device, rows, kElementwiseRows, [&](Index r0, Index r1) {
    for (Index i = r0 * ha; i < r1 * ha; ++i) gate[i] = Scalar(1) / (Scalar(1) + std::exp(-gate[i]));
  });
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::apply_gate(const Scalar* x, Index rows, Scalar* att, Scalar* gate,
                                                   const Eigen::ThreadPoolDevice* device) const {
  if (!gated_) return;
  gate_values(x, rows, gate, device);
  for (Index i = 0; i < rows * h_ * d_v_; ++i) att[i] *= gate[i];
}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::forward_impl(const View& qv, const View& kv, const View& vv,
                                                     const AttentionOptions<Scalar>& options, ForwardState<Scalar>* capture)
    const -> Tensor3 {
  check_inputs(qv, kv, vv);
  const Index batch = qv.dims()[0], nq = qv.dims()[1], nk = kv.dims()[1];
  const detail::CallShape shape = call_shape("ScaledDotProductAttention::forward", batch, nq, nk);
  detail::check_attention_options(shape, options, /*module_call=*/true);
  check_rotary_positions(shape.where, options, batch, nk);
  detail::check_compute<Scalar>(shape.where, compute_, kernel_);
  const Eigen::ThreadPoolDevice* device = options.device;

  // Checked: from here on nothing throws but an allocation failure.
  if (options.probabilities != nullptr) options.probabilities->resize(batch, h_, nq, nk);
  if (options.log_sum_exp != nullptr) options.log_sum_exp->resize(batch, h_, nq);
  Tensor3 result(batch, nq, d_model_);
  detail::advise_huge_pages(result.data(), static_cast<std::size_t>(result.size()) * sizeof(Scalar));
  if (capture != nullptr) start_capture(*capture, qv, kv, vv, options);
  if (result.size() == 0) return result;

  const Index hv = h_ * d_v_;
  Projected proj = project(qv, kv, vv, device, options.key_lengths.empty() ? nullptr : options.key_lengths.data());
  // Queries at q' = q + nk - nq, keys at k (packed sequences: each from its own positions).
  if (capture != nullptr && has_qk_norm()) {
    // What the norm's gradient needs: the projections before it.
    const Index hq = h_ * d_k_, kk = kv_heads_ * d_k_;
    capture->pre_q_ = detail::Buffer<Scalar>(static_cast<std::size_t>(batch * nq * hq));
    capture->pre_k_ = detail::Buffer<Scalar>(static_cast<std::size_t>(batch * nk * kk));
    for (Index r = 0; r < batch * nq; ++r) std::copy_n(proj.q + r * proj.ldq, hq, capture->pre_q_.data() + r * hq);
    for (Index r = 0; r < batch * nk; ++r) std::copy_n(proj.k + r * proj.ldk, kk, capture->pre_k_.data() + r * kk);
  }
  transform_projected(proj.q, proj.ldq, proj.k, proj.ldk, batch, nq, nk, options);

  detail::Buffer<Scalar> att = scratch_.take(static_cast<std::size_t>(batch * nq * hv));
  kernels::AttentionProblem<Scalar> p = detail::problem_of(shape, options, masked_rows_, options.causal, nk - nq);
  p.q = {proj.q, nq * proj.ldq, proj.ldq, d_k_};
  p.k = {proj.k, nk * proj.ldk, proj.ldk, d_k_};
  p.v = {proj.v, nk * proj.ldv, proj.ldv, d_v_};
  p.out = {att.data(), nq * hv, hv, d_v_};
  detail::set_compute(p, compute_);
  draw_dropout(p);
  if (capture != nullptr) {
    capture->saved_.lse.resize(static_cast<std::size_t>(batch * h_ * nq));
    p.lse = capture->saved_.lse.data();
    capture->saved_.keep_draw(p);
    capture->saved_.compute = compute_;
  }
  if (options.packed())
    detail::run_packed(p, options.cu_seqlens_q, options.cu_seqlens_k, kernel_, device);
  else
    detail::run_attention(p, kernel_, static_cast<kernels::DecodeWorkspace<Scalar>*>(nullptr), device);
  if (capture != nullptr && options.log_sum_exp != nullptr)  // (the kernel wrote the capture's copy)
    std::copy(capture->saved_.lse.begin(), capture->saved_.lse.end(), options.log_sum_exp->data());

  // The output gate: fc_o reads att times it (kept apart from att when backward needs both).
  detail::Buffer<Scalar> gate, gated;
  const Scalar* to_fc_o = att.data();
  if (gated_) {
    gate = scratch_.take(static_cast<std::size_t>(batch * nq * hv));
    gate_values(qv.data(), batch * nq, gate.data(), device);
    Scalar* dst = att.data();
    if (capture != nullptr) {
      gated = scratch_.take(static_cast<std::size_t>(batch * nq * hv));
      dst = gated.data();
    }
    parallel_for(device, batch * nq, kElementwiseRows, [&](Index r0, Index r1) {
      for (Index i = r0 * hv; i < r1 * hv; ++i) dst[i] = att.data()[i] * gate.data()[i];
    });
    to_fc_o = dst;
  }
  if (compute_ == Compute::kBf16) {
    if constexpr (std::is_same<Scalar, float>::value) {
      const kernels::ProjectionTarget<Scalar> out = fc_o_.target(result.data(), d_model_);
      kernels::project_rows_bf16(to_fc_o, batch * nq, hv, hv, &out, 1, device, active_bf16_path());
    }
  } else {
    fc_o_.forward_rows(to_fc_o, batch * nq, hv, result.data(), d_model_, device);
  }
  if (capture != nullptr) {
    capture->qkv_ = std::move(proj.qkv);
    capture->kv_ = std::move(proj.kv_only);
    capture->q_ = proj.q;
    capture->k_ = proj.k;
    capture->v_ = proj.v;
    capture->ldq_ = proj.ldq;
    capture->ldk_ = proj.ldk;
    capture->ldv_ = proj.ldv;
    capture->att_ = std::move(att);
    capture->gate_ = std::move(gate);
    capture->gated_ = std::move(gated);
  } else {
    scratch_.give(std::move(proj.qkv));
    scratch_.give(std::move(proj.kv_only));
    scratch_.give(std::move(att));
    if (gated_) scratch_.give(std::move(gate));
  }
  return result;
}

SDPA_NAMESPACE_END
