// The module's training internals (declared in sdpa/scaled_dot_product_attention.hpp, which includes this
// header after the class): what a forward keeps for backward (start_capture, sdpa/forward_state.hpp), the
// projections' gradients (linear_backward) and backward itself: the attention core's backward
// (kernels/backward.hpp, or the reference's), then fc_o's, the rotary's and QK-norm's, and fc_q / fc_k /
// fc_v's, deterministic on any number of threads.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sdpa/kernels/backward.hpp"
#include "sdpa/kernels/bf16_projection.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::start_capture(ForwardState<Scalar>& s, const View& qv, const View& kv,
                                                      const View& vv, const AttentionOptions<Scalar>& options) const {
  s = ForwardState<Scalar>();
  s.module_id_ = id_;
  s.batch_ = qv.dims()[0];
  s.nq_ = qv.dims()[1];
  s.nk_ = kv.dims()[1];
  s.kv_same_ = kv.data() == vv.data() && kv.dims() == vv.dims();
  s.qk_same_ = s.kv_same_ && qv.data() == kv.data() && qv.dims() == kv.dims();
  auto copy = [](const View& v) {
    Tensor3 t(v.dims()[0], v.dims()[1], v.dims()[2]);
    if (t.size() > 0) std::copy_n(v.data(), t.size(), t.data());
    return t;
  };
  s.queries_ = copy(qv);
  if (!s.qk_same_) s.keys_ = copy(kv);
  if (!s.kv_same_) s.values_ = copy(vv);
  s.saved_.keep_options(options);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::linear_backward(const LinearType& layer, const Scalar* dy, Index ldy,
                                                        const Scalar* x, Index rows, LinearGradients<Scalar>& g, Scalar* dx,
                                                        const Eigen::ThreadPoolDevice* device) const {
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ConstMap = Eigen::Map<const RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  using Map = Eigen::Map<RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  const Index in = layer.in_features(), out = layer.out_features();
  g.weight = Eigen::Tensor<Scalar, 2, Eigen::RowMajor>(out, in);
  g.bias = Eigen::Tensor<Scalar, 1, Eigen::RowMajor>(out);
  const ConstMap dY(dy, rows, out, Eigen::OuterStride<>(ldy)), X(x, rows, in, Eigen::OuterStride<>(in));
  const ConstMap W(layer.weight().data(), out, in, Eigen::OuterStride<>(in));
  constexpr Index kFeatureBlock = 64, kRowBlock = 256;
  const Index feature_blocks = (out + kFeatureBlock - 1) / kFeatureBlock;
  parallel_for(device, feature_blocks, 1, [&](Index f0, Index f1) {
    for (Index f = f0; f < f1; ++f) {
      const Index o0 = f * kFeatureBlock, n = std::min(kFeatureBlock, out - o0);
      Map dW(g.weight.data() + o0 * in, n, in, Eigen::OuterStride<>(in));
      dW.noalias() = dY.middleCols(o0, n).transpose() * X;
      for (Index o = o0; o < o0 + n; ++o) g.bias(o) = dY.col(o).sum();
    }
  });
  if (dx == nullptr) return;
  const Index row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  parallel_for(device, row_blocks, 1, [&](Index b0, Index b1) {
    for (Index b = b0; b < b1; ++b) {
      const Index r0 = b * kRowBlock, n = std::min(kRowBlock, rows - r0);
      Map dX(dx + r0 * in, n, in, Eigen::OuterStride<>(in));
      dX.noalias() = dY.middleRows(r0, n) * W;
    }
  });
}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::backward_impl(const Tensor3& grad_output, const ForwardState<Scalar>& s)
    const -> Gradients<Scalar> {
  const char* where = "ScaledDotProductAttention::backward";
  if (s.empty())
    throw std::logic_error(std::string("sdpa::") + where +
                           ": the state is empty: pass the state that forward(queries, keys, values, options, state) filled");
  if (s.module_id_ != id_)
    detail::throw_invalid(where, "state", "the state of a forward call of this module", "the state of another module");
  const Index batch = s.batch_, nq = s.nq_, nk = s.nk_, hq = h_ * d_k_, hv = h_ * d_v_;
  const Index kk = kv_heads_ * d_k_, kv = kv_heads_ * d_v_;
  const std::array<Index, 3> want{batch, nq, d_model_};
  for (std::size_t i = 0; i < 3; ++i)
    if (grad_output.dimension(i) != want[i])
      detail::throw_invalid(where, "grad_output", detail::concat("of the forward's output shape ", detail::shape_string(want)),
                            detail::concat("of shape ", detail::shape_string(grad_output.dimensions())));
  const AttentionOptions<Scalar>& options = s.saved_.options;
  // The tensors must still have the shapes they had in the forward.
  const detail::CallShape shape = call_shape(where, batch, nq, nk);
  detail::check_attention_options(shape, options, /*module_call=*/true);
  // The forward's device (its options), as the state recorded it.
  const Eigen::ThreadPoolDevice* device = options.device;

  Gradients<Scalar> g;
  const Tensor3& xq = s.queries_;
  const Tensor3& xk = s.qk_same_ ? s.queries_ : s.keys_;
  const Tensor3& xv = s.kv_same_ ? xk : s.values_;
  if (options.attention_weights != nullptr) g.attention_weights = Weights(options.attention_weights->dimensions());
  if (options.attention_bias != nullptr) g.attention_bias = Weights(options.attention_bias->dimensions());
  if (!options.sinks.empty()) g.sinks.assign(options.sinks.size(), Scalar(0));
  const Index rows_q = batch * nq, rows_k = batch * nk;
  if (rows_q == 0 || rows_k == 0) {
    g.queries = Tensor3(batch, nq, d_model_);
    g.keys = Tensor3(batch, nk, d_model_);
    g.values = Tensor3(batch, nk, d_model_);
    // No output, or no keys (zero attention): only fc_o's bias has a say.
    g.queries.setZero();
    g.keys.setZero();
    g.values.setZero();
    if (g.attention_weights.size() > 0) g.attention_weights.setZero();
    if (g.attention_bias.size() > 0) g.attention_bias.setZero();
    auto zero_linear = [](const LinearType& layer, LinearGradients<Scalar>& lg) {
      lg.weight = Eigen::Tensor<Scalar, 2, Eigen::RowMajor>(layer.out_features(), layer.in_features());
      lg.weight.setZero();
      lg.bias = Eigen::Tensor<Scalar, 1, Eigen::RowMajor>(layer.out_features());
      lg.bias.setZero();
    };
    zero_linear(fc_q_, g.fc_q);
    zero_linear(fc_k_, g.fc_k);
    zero_linear(fc_v_, g.fc_v);
    zero_linear(fc_o_, g.fc_o);
    if (gated_) zero_linear(fc_g_, g.fc_g);
    if (has_qk_norm()) {
      g.q_norm.assign(qk_norm_.q_weight.size(), Scalar(0));
      g.k_norm.assign(qk_norm_.k_weight.size(), Scalar(0));
    }
    if (rows_q > 0) {
      // nk == 0: the attention output is zero, so fc_o's output is its bias.
      for (Index o = 0; o < d_model_; ++o) {
        Scalar sum = 0;
        for (Index r = 0; r < rows_q; ++r) sum += grad_output.data()[r * d_model_ + o];
        g.fc_o.bias(o) = sum;
      }
    }
    return g;
  }

  // fc_o: d att = dY W_o; dW_o = dY^T att; db_o.
  detail::Buffer<Scalar> d_att(static_cast<std::size_t>(rows_q * hv));
  linear_backward(fc_o_, grad_output.data(), d_model_, gated_ ? s.gated_.data() : s.att_.data(), rows_q, g.fc_o,
                  d_att.data(), device);
  // The gate: d att = d gated * sigmoid; d (fc_g's output) = d gated * att * sigmoid * (1 - sigmoid).
  detail::Buffer<Scalar> d_gate;
  if (gated_) {
    d_gate = detail::Buffer<Scalar>(static_cast<std::size_t>(rows_q * hv));
    for (Index i = 0; i < rows_q * hv; ++i) {
      const Scalar sg = s.gate_.data()[i];
      d_gate.data()[i] = d_att.data()[i] * s.att_.data()[i] * sg * (Scalar(1) - sg);
      d_att.data()[i] *= sg;
    }
  }

  // The attention core.
  kernels::AttentionProblem<Scalar> p = detail::problem_of(shape, options, masked_rows_, options.causal, nk - nq);
  p.q = {s.q_, nq * s.ldq_, s.ldq_, d_k_};
  p.k = {s.k_, nk * s.ldk_, s.ldk_, d_k_};
  p.v = {s.v_, nk * s.ldv_, s.ldv_, d_v_};
  p.out = {const_cast<Scalar*>(s.att_.data()), nq * hv, hv, d_v_};
  s.saved_.replay(p);
  // kBf16: the products read the transformed q, k, v and d att rounded to bfloat16 (the kernel rounds P
  // and dS per tile), as sdpa::attention_backward does; the projections' gradients stay float products.
  detail::Buffer<Scalar> q_bf16, k_bf16, v_bf16, d_att_bf16;
  Scalar* d_att_read = d_att.data();
  if (s.saved_.compute == Compute::kBf16) {
    if constexpr (std::is_same<Scalar, float>::value) {
      const auto rounded = [&](const Scalar* x, Index rows, Index ld, Index width, detail::Buffer<Scalar>& into) {
        into = detail::Buffer<Scalar>(static_cast<std::size_t>(rows * width));
        parallel_for(device, rows, kElementwiseRows, [&](Index r0, Index r1) {
          for (Index r = r0; r < r1; ++r) kernels::round_to_bf16(active_isa(), x + r * ld, width, into.data() + r * width);
        });
        return into.data();
      };
      p.q = {rounded(s.q_, rows_q, s.ldq_, hq, q_bf16), nq * hq, hq, d_k_};
      p.k = {rounded(s.k_, rows_k, s.ldk_, kk, k_bf16), nk * kk, kk, d_k_};
      p.v = {rounded(s.v_, rows_k, s.ldv_, kv, v_bf16), nk * kv, kv, d_v_};
      d_att_read = rounded(d_att.data(), rows_q, hv, hv, d_att_bf16);
      detail::set_compute(p, Compute::kBf16);
    }
  }
  detail::Buffer<Scalar> dq(static_cast<std::size_t>(rows_q * hq)), dk(static_cast<std::size_t>(rows_k * kk)),
      dv(static_cast<std::size_t>(rows_k * kv));
  kernels::BackwardProblem<Scalar> bp;
  bp.forward = &p;
  bp.d_out = {d_att_read, nq * hv, hv, d_v_};
  bp.d_q = {dq.data(), nq * hq, hq, d_k_};
  bp.d_k = {dk.data(), nk * kk, kk, d_k_};
  bp.d_v = {dv.data(), nk * kv, kv, d_v_};
  if (p.sinks != nullptr) bp.d_sinks = g.sinks.data();
  if (p.weights) {
    bp.d_weights = g.attention_weights.data();
    for (std::size_t i = 0; i < 4; ++i) bp.weights_dims[i] = g.attention_weights.dimension(i);
  }
  if (p.bias) {
    bp.d_bias = g.attention_bias.data();
    for (std::size_t i = 0; i < 4; ++i) bp.bias_dims[i] = g.attention_bias.dimension(i);
  }
  detail::ProgramTables<Scalar> tables(options.program.get());
  bp.d_tables = tables.data();
  const kernels::BackwardStatus status =
      options.packed() ? detail::run_packed_backward(bp, options.cu_seqlens_q, options.cu_seqlens_k, kernel_, device, tables.size())
                       : detail::run_attention_backward(bp, kernel_, device);
  g.tables = tables.finish(status, where);
  for (detail::Buffer<Scalar>* b : {&q_bf16, &k_bf16, &v_bf16, &d_att_bf16}) *b = detail::Buffer<Scalar>();
  // The gradients of the transformed (rotated, normalised) queries and keys, taken back through the
  // transforms: those of the projections' outputs.
  transform_backward(dq.data(), dk.data(), s, options, g);

  d_att = detail::Buffer<Scalar>();  // scratch is released as soon as it is used up: peak memory
  g.queries = Tensor3(batch, nq, d_model_);
  g.keys = Tensor3(batch, nk, d_model_);
  g.values = Tensor3(batch, nk, d_model_);

  // The projections.
  linear_backward(fc_q_, dq.data(), hq, xq.data(), rows_q, g.fc_q, g.queries.data(), device);
  dq = detail::Buffer<Scalar>();
  if (gated_) {
    Tensor3 dx(batch, nq, d_model_);
    linear_backward(fc_g_, d_gate.data(), hv, xq.data(), rows_q, g.fc_g, dx.data(), device);
    g.queries += dx;
  }
  linear_backward(fc_k_, dk.data(), kk, xk.data(), rows_k, g.fc_k, g.keys.data(), device);
  dk = detail::Buffer<Scalar>();
  linear_backward(fc_v_, dv.data(), kv, xv.data(), rows_k, g.fc_v, g.values.data(), device);
  return g;
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::transform_backward(Scalar* dq, Scalar* dk, const ForwardState<Scalar>& s,
                                                           const AttentionOptions<Scalar>& options, Gradients<Scalar>& g)
    const {
  const Index batch = s.batch_, nq = s.nq_, nk = s.nk_, hq = h_ * d_k_, kk = kv_heads_ * d_k_;
  temper_queries(dq, hq, batch, nq, nk, options);  // a diagonal scale: its own transpose
  if (!has_qk_norm()) {
    rotate_projected({dq, hq}, {dk, kk}, batch, nq, nk, options, /*inverse=*/true);
    return;
  }
  const bool per_head = qk_norm_.kind == QkNormKind::kHead;
  std::vector<double> dwq(qk_norm_.q_weight.size(), 0.0), dwk(qk_norm_.k_weight.size(), 0.0);
  const auto norm_backward = [&](const Scalar* x, Scalar* d, Index rows, bool query) {
    const Index heads = query ? h_ : kv_heads_, ld = heads * d_k_;
    const std::vector<Scalar>& w = query ? qk_norm_.q_weight : qk_norm_.k_weight;
    std::vector<double>& dw = query ? dwq : dwk;
    detail::rms_norm_backward_rows(x, d, {rows, ld, per_head ? heads : 1, per_head ? d_k_ : ld},
                                   w.empty() ? nullptr : w.data(), qk_norm_.eps, dw.empty() ? nullptr : dw.data());
  };
  if (qk_norm_.after_rotary) {
    // The norm's input is the rotated projection.
    detail::Buffer<Scalar> rq(static_cast<std::size_t>(batch * nq * hq)), rk(static_cast<std::size_t>(batch * nk * kk));
    std::copy_n(s.pre_q_.data(), rq.size(), rq.data());
    std::copy_n(s.pre_k_.data(), rk.size(), rk.data());
    rotate_projected({rq.data(), hq}, {rk.data(), kk}, batch, nq, nk, options);
    norm_backward(rq.data(), dq, batch * nq, true);
    norm_backward(rk.data(), dk, batch * nk, false);
    rotate_projected({dq, hq}, {dk, kk}, batch, nq, nk, options, /*inverse=*/true);
  } else {
    rotate_projected({dq, hq}, {dk, kk}, batch, nq, nk, options, /*inverse=*/true);
    norm_backward(s.pre_q_.data(), dq, batch * nq, true);
    norm_backward(s.pre_k_.data(), dk, batch * nk, false);
  }
  g.q_norm.assign(dwq.begin(), dwq.end());
  g.k_norm.assign(dwk.begin(), dwk.end());
}

SDPA_NAMESPACE_END
