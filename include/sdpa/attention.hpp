// sdpa::attention, the checked functional core: attention over head tensors a caller has already projected,
// as PyTorch's F.scaled_dot_product_attention (with enable_gqa), FlashAttention's flash_attn_func and
// ggml's ggml_flash_attn_ext take them, with every AttentionOptions field, and its backward. The module
// (scaled_dot_product_attention.hpp) runs its forward, its decoding steps and its backward through the same
// functions of namespace detail: the options are checked in one place (attention/checks.hpp), the problem
// made and the kernel chosen in another (attention/run.hpp).
//
//   q (b, h, nq, d_k), k (b, kv_heads, nk, d_k), v (b, kv_heads, nk, d_v)   (Layout::kBHND, the default)
//   q (b, nq, h, d_k), k (b, nk, kv_heads, d_k), v (b, nk, kv_heads, d_v)   (Layout::kBNHD)
// row-major Eigen::Tensor or TensorMap (read in place) or tensor expressions (evaluated once);
// h % kv_heads == 0: query head i reads key/value head i / (h / kv_heads), as PyTorch's enable_gqa and
// Hugging Face's repeat_kv. The result has q's layout with d_v features.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdpa/attention/checks.hpp"
#include "sdpa/attention/run.hpp"
#include "sdpa/attention/saved.hpp"
#include "sdpa/cpu.hpp"
#include "sdpa/detail/inputs.hpp"
#include "sdpa/error.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/options.hpp"
#include "sdpa/rotary.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class AttentionState;
template <typename Scalar>
struct AttentionGradients;

template <typename Scalar>
using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;
template <typename Scalar>
struct VarlenGradients;

namespace detail {
template <typename Scalar>
Tensor4<Scalar> attention_impl(const Input4<Scalar>& q, const Input4<Scalar>& k, const Input4<Scalar>& v,
                               const AttentionOptions<Scalar>& options, AttentionState<Scalar>* state,
                               const char* where = "attention");
template <typename Scalar>
AttentionGradients<Scalar> attention_backward_impl(const Scalar* grad_output, const std::array<Eigen::Index, 4>& dims,
                                                   const AttentionState<Scalar>& state, const char* where);
template <typename Scalar>
Tensor3<Scalar> attention_varlen_impl(const InputView<Scalar>& q, const InputView<Scalar>& k, const InputView<Scalar>& v,
                                      const AttentionOptions<Scalar>& options, AttentionState<Scalar>* state);
}  // namespace detail

template <typename Scalar>
AttentionGradients<Scalar> attention_backward(const Tensor4<Scalar>& grad_output, const AttentionState<Scalar>& state);
template <typename Scalar>
VarlenGradients<Scalar> attention_varlen_backward(const Tensor3<Scalar>& grad_output, const AttentionState<Scalar>& state);

// What attention_backward needs from one forward (O(N) memory: copies of q, k and v as the kernel read them,
// rotated when a rotary was given; the output; each row's log-sum-exp; the options and the dropout draw;
// never the probabilities). The mask, weights and bias tensors the options point to, and the device, must
// stay alive and unchanged until attention_backward.
template <typename Scalar>
class AttentionState {
 public:
  AttentionState() = default;
  AttentionState(AttentionState&&) noexcept = default;
  AttentionState& operator=(AttentionState&&) noexcept = default;
  AttentionState(const AttentionState&) = delete;
  AttentionState& operator=(const AttentionState&) = delete;

  bool empty() const noexcept { return !filled_; }

 private:
  template <typename S>
  friend Tensor4<S> detail::attention_impl(const detail::Input4<S>&, const detail::Input4<S>&, const detail::Input4<S>&,
                                           const AttentionOptions<S>&, AttentionState<S>*, const char*);
  template <typename S>
  friend AttentionGradients<S> detail::attention_backward_impl(const S*, const std::array<Eigen::Index, 4>&,
                                                                const AttentionState<S>&, const char*);
  template <typename S>
  friend AttentionGradients<S> attention_backward(const Tensor4<S>&, const AttentionState<S>&);
  template <typename S>
  friend VarlenGradients<S> attention_varlen_backward(const Tensor3<S>&, const AttentionState<S>&);
  template <typename S>
  friend Tensor3<S> detail::attention_varlen_impl(const detail::InputView<S>&, const detail::InputView<S>&,
                                                  const detail::InputView<S>&, const AttentionOptions<S>&, AttentionState<S>*);

  bool filled_ = false;
  bool varlen_ = false;  // filled by attention_varlen: its backward is attention_varlen_backward
  std::array<Eigen::Index, 4> q_dims_{}, k_dims_{}, v_dims_{};
  Tensor4<Scalar> q_, k_, v_, out_;  // as the kernel read them (q and k rotated when a rotary was given)
  detail::SavedAttention<Scalar> saved_;  // shape, log-sum-exp, options, rotary, dropout draw
};

// The gradients of attention's inputs: q, k, v in their shapes and layout; the attention_weights' and
// attention_bias' in their broadcast shapes (empty when not given); one per query head for the sinks
// (empty when not given); one per ScoreTable a score program's function reads, in the program's order.
template <typename Scalar>
struct AttentionGradients {
  Tensor4<Scalar> q, k, v;
  Tensor4<Scalar> attention_weights, attention_bias;
  std::vector<Scalar> sinks;
  std::vector<Eigen::Tensor<Scalar, 2, Eigen::RowMajor>> tables;
};

// Attention of q over k and v (see the header comment for the shapes); every AttentionOptions field
// applies. Returns q's layout with d_v features.
template <typename Q, typename K, typename V>
Tensor4<detail::ScalarOf<Q>> attention(const Q& q, const K& k, const V& v,
                                       const AttentionOptions<detail::ScalarOf<Q>>& options,
                                       AttentionState<detail::ScalarOf<Q>>& state);

template <typename Q, typename K, typename V>
Tensor4<detail::ScalarOf<Q>> attention(const Q& q, const K& k, const V& v,
                                       const AttentionOptions<detail::ScalarOf<Q>>& options = {}) {
  using Scalar = detail::ScalarOf<Q>;
  SDPA_DETAIL_CHECK_HEADS(Q, Scalar);
  SDPA_DETAIL_CHECK_HEADS(K, Scalar);
  SDPA_DETAIL_CHECK_HEADS(V, Scalar);
  if constexpr (detail::is_valid_head_tensor<Q, Scalar>() && detail::is_valid_head_tensor<K, Scalar>() &&
                detail::is_valid_head_tensor<V, Scalar>()) {
    const detail::Input4<Scalar> qi(q), ki(k), vi(v);
    return detail::attention_impl(qi, ki, vi, options, static_cast<AttentionState<Scalar>*>(nullptr));
  } else {
    return Tensor4<Scalar>();
  }
}

// The same, keeping in `state` what attention_backward needs.
template <typename Q, typename K, typename V>
Tensor4<detail::ScalarOf<Q>> attention(const Q& q, const K& k, const V& v,
                                       const AttentionOptions<detail::ScalarOf<Q>>& options,
                                       AttentionState<detail::ScalarOf<Q>>& state) {
  using Scalar = detail::ScalarOf<Q>;
  SDPA_DETAIL_CHECK_HEADS(Q, Scalar);
  SDPA_DETAIL_CHECK_HEADS(K, Scalar);
  SDPA_DETAIL_CHECK_HEADS(V, Scalar);
  if constexpr (detail::is_valid_head_tensor<Q, Scalar>() && detail::is_valid_head_tensor<K, Scalar>() &&
                detail::is_valid_head_tensor<V, Scalar>()) {
    const detail::Input4<Scalar> qi(q), ki(k), vi(v);
    return detail::attention_impl(qi, ki, vi, options, &state);
  } else {
    return Tensor4<Scalar>();
  }
}

namespace detail {

// The checks and the kernel run of both attention overloads; state (optional) is filled for a backward.
template <typename Scalar>
Tensor4<Scalar> attention_impl(const Input4<Scalar>& qi, const Input4<Scalar>& ki, const Input4<Scalar>& vi,
                               const AttentionOptions<Scalar>& options, AttentionState<Scalar>* state, const char* where) {
  using Index = Eigen::Index;
  const Layout layout = options.layout;
  const std::array<Index, 4> qd = bhnd(qi.dims(), layout), kd = bhnd(ki.dims(), layout), vd = bhnd(vi.dims(), layout);
  const auto shape = [&](const Input4<Scalar>& t) { return shape_string(t.dims()); };
  const char* axes = layout == Layout::kBHND ? "(batch, heads, seq, dim)" : "(batch, seq, heads, dim)";
  const int seq_axis = layout == Layout::kBHND ? 2 : 1, head_axis = layout == Layout::kBHND ? 1 : 2;
  // Shapes.
  for (const auto& [name, d, t] : {std::make_tuple("k", kd, &ki), std::make_tuple("v", vd, &vi)}) {
    if (d[0] != qd[0])
      throw_invalid(where, concat(name, " dimension 0 (batch)"), concat(qd[0], ", the batch of q"),
                    concat(d[0], " (", name, " shape ", shape(*t), ", ", axes, ")"));
  }
  if (kd[1] != vd[1])
    throw_invalid(where, concat("v dimension ", head_axis, " (key/value heads)"), concat(kd[1], ", the heads of k"),
                  concat(vd[1], " (v shape ", shape(vi), ")"));
  if (kd[2] != vd[2])
    throw_invalid(where, concat("v dimension ", seq_axis, " (keys)"), concat(kd[2], ", the keys of k"),
                  concat(vd[2], " (v shape ", shape(vi), ")"));
  if (kd[3] != qd[3])
    throw_invalid(where, "k dimension 3 (d_k)", concat(qd[3], ", the d_k of q"), concat(kd[3], " (k shape ", shape(ki), ")"));
  if (kd[1] <= 0 && qd[1] > 0)
    throw_invalid(where, concat("k dimension ", head_axis, " (key/value heads)"), "positive", kd[1]);
  if (kd[1] > 0 && (qd[1] % kd[1] != 0))
    throw_invalid(where, concat("k dimension ", head_axis, " (key/value heads)"),
                  concat("a divisor of the query heads, ", qd[1]), concat(kd[1], " (k shape ", shape(ki), ")"));
  for (const Input4<Scalar>* t : {&qi, &ki, &vi}) {
    const auto& d = t->dims();
    if (t->data() == nullptr && d[0] * d[1] * d[2] * d[3] != 0)
      throw_invalid(where, t == &qi ? "q" : t == &ki ? "k" : "v", "a tensor with data", "a null pointer");
  }
  const CallShape c = CallShape::of(where, qd, kd, vd);
  check_attention_options(c, options, /*module_call=*/false);

  // Checked: from here on nothing throws but an allocation failure.
  const std::array<Index, 4> out_dims =
      layout == Layout::kBHND ? std::array<Index, 4>{c.batch, c.heads, c.nq, c.d_v}
                              : std::array<Index, 4>{c.batch, c.nq, c.heads, c.d_v};
  Tensor4<Scalar> out(out_dims);
  if (options.probabilities != nullptr) options.probabilities->resize(c.batch, c.heads, c.nq, c.nk);
  if (options.log_sum_exp != nullptr) options.log_sum_exp->resize(c.batch, c.heads, c.nq);
  // Rotary: rotated copies of q and k (positions q' = q + nk - nq and k).
  Tensor4<Scalar> q_rot, k_rot;
  const Scalar* qp = qi.data();
  const Scalar* kp = ki.data();
  if (options.rotary != nullptr) {
    q_rot = Tensor4<Scalar>(qi.dims());
    k_rot = Tensor4<Scalar>(ki.dims());
    if (q_rot.size() > 0) std::copy_n(qp, q_rot.size(), q_rot.data());
    if (k_rot.size() > 0) std::copy_n(kp, k_rot.size(), k_rot.data());
    const bool packed = options.packed();
    if (q_rot.size() > 0)
      rotate_rows(*options.rotary, heads_of(q_rot.data(), q_rot.dimensions(), layout), {c.batch, c.nq, c.heads, c.d_k},
                  c.nk - c.nq, packed ? &options.cu_seqlens_q : nullptr, packed ? &options.cu_seqlens_k : nullptr);
    if (k_rot.size() > 0)
      rotate_rows(*options.rotary, heads_of(k_rot.data(), k_rot.dimensions(), layout),
                  {c.batch, c.nk, c.kv_heads, c.d_k}, Index{0}, packed ? &options.cu_seqlens_k : nullptr,
                  static_cast<const std::vector<Index>*>(nullptr));
    qp = q_rot.data();
    kp = k_rot.data();
  }
  kernels::AttentionProblem<Scalar> p = problem_of(c, options, options.masked_rows, options.causal, c.nk - c.nq);
  p.q = heads_of(qp, qi.dims(), layout);
  p.k = heads_of(kp, ki.dims(), layout);
  p.v = heads_of(vi.data(), vi.dims(), layout);
  p.out = heads_of(out.data(), out.dimensions(), layout);
  if (options.dropout > Scalar(0)) {
    p.dropout = true;
    p.sampler = DropoutSampler(options.dropout_seed, 0, static_cast<double>(options.dropout));
    p.keep_scale = options.dropout >= Scalar(1) ? Scalar(0) : Scalar(1) / (Scalar(1) - options.dropout);
  }
  std::vector<Scalar> lse;
  if (state != nullptr) {
    lse.resize(static_cast<std::size_t>(c.batch * c.heads * c.nq));
    p.lse = lse.data();
  }
  if (options.packed())
    run_packed(p, options.cu_seqlens_q, options.cu_seqlens_k, options.kernel, options.device);
  else if (c.batch * c.heads * c.nq > 0)
    run_attention(p, options.kernel, static_cast<kernels::DecodeWorkspace<Scalar>*>(nullptr), options.device);
  if (state != nullptr && options.log_sum_exp != nullptr && !lse.empty())  // (the kernel wrote the state's copy)
    std::copy(lse.begin(), lse.end(), options.log_sum_exp->data());

  if (state != nullptr) {
    AttentionState<Scalar>& s = *state;
    s = AttentionState<Scalar>();
    s.filled_ = true;
    s.saved_.shape = c;
    s.q_dims_ = qi.dims();
    s.k_dims_ = ki.dims();
    s.v_dims_ = vi.dims();
    const auto copy = [](const Scalar* data, const std::array<Index, 4>& dims, Tensor4<Scalar>& into) {
      into = Tensor4<Scalar>(dims);
      if (into.size() > 0) std::copy_n(data, into.size(), into.data());
    };
    if (options.rotary != nullptr) {
      s.q_ = std::move(q_rot);
      s.k_ = std::move(k_rot);
    } else {
      copy(qi.data(), qi.dims(), s.q_);
      copy(ki.data(), ki.dims(), s.k_);
    }
    copy(vi.data(), vi.dims(), s.v_);
    copy(out.data(), out.dimensions(), s.out_);
    s.saved_.lse = std::move(lse);
    s.saved_.keep_options(options);
    s.saved_.keep_draw(p);
  }
  return out;
}

}  // namespace detail

// d loss / d (q, k, v, weights, bias, sinks) of the forward that filled `state`, given grad_output =
// d loss / d (its output), of the output's shape: FlashAttention 2's backward (probabilities recomputed
// from each row's log-sum-exp, dropout replayed); the key/value gradients of a group of query heads are
// summed in head order. Runs on the device of the forward's options. The same bits on any thread count.
template <typename Scalar>
AttentionGradients<Scalar> attention_backward(const Tensor4<Scalar>& grad_output, const AttentionState<Scalar>& s) {
  const char* where = "attention_backward";
  if (s.empty())
    throw std::logic_error("sdpa::attention_backward: the state is empty: pass the state that attention(q, k, v, options, "
                           "state) filled");
  if (s.varlen_)
    throw std::logic_error("sdpa::attention_backward: the state is attention_varlen's: pass it to attention_varlen_backward");
  const std::array<Eigen::Index, 4> want = s.out_.dimensions();
  for (std::size_t i = 0; i < 4; ++i)
    if (grad_output.dimension(i) != want[i])
      detail::throw_invalid(where, "grad_output", detail::concat("of the forward's output shape ", detail::shape_string(want)),
                            detail::concat("of shape ", detail::shape_string(grad_output.dimensions())));
  return detail::attention_backward_impl(grad_output.data(), want, s, where);
}

namespace detail {

// attention_backward and attention_varlen_backward after their checks of grad_output: dims, the forward's
// output shape (a packed call's as (1, total, heads, d_v)).
template <typename Scalar>
AttentionGradients<Scalar> attention_backward_impl(const Scalar* grad_data, const std::array<Eigen::Index, 4>& grad_dims,
                                                   const AttentionState<Scalar>& s, const char* where) {
  using Index = Eigen::Index;
  const detail::CallShape& c = s.saved_.shape;
  const AttentionOptions<Scalar>& o = s.saved_.options;
  const Layout layout = o.layout;
  detail::CallShape checked = c;
  checked.where = where;
  // The tensors the options point to must still have the shapes they had.
  detail::check_attention_options(checked, o, /*module_call=*/false);

  AttentionGradients<Scalar> g;
  g.q = Tensor4<Scalar>(s.q_dims_);
  g.k = Tensor4<Scalar>(s.k_dims_);
  g.v = Tensor4<Scalar>(s.v_dims_);
  if (o.attention_weights != nullptr) g.attention_weights = Tensor4<Scalar>(o.attention_weights->dimensions());
  if (o.attention_bias != nullptr) g.attention_bias = Tensor4<Scalar>(o.attention_bias->dimensions());
  if (!o.sinks.empty()) g.sinks.assign(o.sinks.size(), Scalar(0));

  kernels::AttentionProblem<Scalar> p = detail::problem_of(checked, o, o.masked_rows, o.causal, c.nk - c.nq);
  p.probabilities = nullptr;
  // kBf16: the products read q, k, v and dO rounded to bfloat16 (and the kernel rounds P and dS per tile),
  // summed in float: the forward's scores again, and bfloat16 operands for the four gradient products.
  Tensor4<Scalar> q_bf16, k_bf16, v_bf16, d_out_bf16;
  const Scalar* qd = s.q_.data();
  const Scalar* kd = s.k_.data();
  const Scalar* vd = s.v_.data();
  if (o.compute == Compute::kBf16) {
    const auto rounded = [](const Scalar* x, const std::array<Index, 4>& dims, Tensor4<Scalar>& into) {
      into = Tensor4<Scalar>(dims);
      if constexpr (std::is_same<Scalar, float>::value)
        kernels::round_to_bf16(active_isa(), x, into.size(), into.data());
      else
        std::copy_n(x, into.size(), into.data());  // not reached: kBf16 is refused for double
      return into.data();
    };
    qd = rounded(qd, s.q_.dimensions(), q_bf16);
    kd = rounded(kd, s.k_.dimensions(), k_bf16);
    vd = rounded(vd, s.v_.dimensions(), v_bf16);
    grad_data = rounded(grad_data, grad_dims, d_out_bf16);
  }
  p.q = detail::heads_of(qd, s.q_.dimensions(), layout);
  p.k = detail::heads_of(kd, s.k_.dimensions(), layout);
  p.v = detail::heads_of(vd, s.v_.dimensions(), layout);
  p.out = detail::heads_of(const_cast<Scalar*>(s.out_.data()), s.out_.dimensions(), layout);
  s.saved_.replay(p);
  kernels::BackwardProblem<Scalar> bp;
  bp.forward = &p;
  bp.d_out = detail::heads_of(grad_data, grad_dims, layout);
  bp.d_q = detail::heads_of(g.q.data(), g.q.dimensions(), layout);
  bp.d_k = detail::heads_of(g.k.data(), g.k.dimensions(), layout);
  bp.d_v = detail::heads_of(g.v.data(), g.v.dimensions(), layout);
  if (p.weights) {
    bp.d_weights = g.attention_weights.data();
    for (std::size_t i = 0; i < 4; ++i) bp.weights_dims[i] = g.attention_weights.dimension(i);
  }
  if (p.bias) {
    bp.d_bias = g.attention_bias.data();
    for (std::size_t i = 0; i < 4; ++i) bp.bias_dims[i] = g.attention_bias.dimension(i);
  }
  if (p.sinks != nullptr) bp.d_sinks = g.sinks.data();
  detail::ProgramTables<Scalar> tables(o.program.get());
  bp.d_tables = tables.data();
  kernels::BackwardStatus status;
  if (o.packed()) {
    status = detail::run_packed_backward(bp, o.cu_seqlens_q, o.cu_seqlens_k, o.kernel, o.device, tables.size());
  } else if (c.batch > 0 && c.heads > 0) {
    status = detail::run_attention_backward(bp, o.kernel, o.device);
  } else {
    if (g.q.size() > 0) g.q.setZero();
    if (g.k.size() > 0) g.k.setZero();
    if (g.v.size() > 0) g.v.setZero();
  }
  g.tables = tables.finish(status, where);
  // The gradients of the rotated q and k, rotated back.
  if (s.saved_.has_rotary) {
    const bool packed = o.packed();
    if (g.q.size() > 0)
      detail::rotate_rows(s.saved_.rotary, detail::heads_of(g.q.data(), g.q.dimensions(), layout),
                          {c.batch, c.nq, c.heads, c.d_k}, c.nk - c.nq, packed ? &o.cu_seqlens_q : nullptr,
                          packed ? &o.cu_seqlens_k : nullptr, /*inverse=*/true);
    if (g.k.size() > 0)
      detail::rotate_rows(s.saved_.rotary, detail::heads_of(g.k.data(), g.k.dimensions(), layout),
                          {c.batch, c.nk, c.kv_heads, c.d_k}, Index{0}, packed ? &o.cu_seqlens_k : nullptr,
                          static_cast<const std::vector<Index>*>(nullptr), /*inverse=*/true);
  }
  return g;
}

}  // namespace detail

// ---- Packed variable-length sequences (FlashAttention's flash_attn_varlen_func) ----

// The gradients of attention_varlen's inputs, in their (total, heads, dim) shapes, and of the sinks.
template <typename Scalar>
struct VarlenGradients {
  Tensor3<Scalar> q, k, v;
  std::vector<Scalar> sinks;
};

namespace detail {

template <typename T, typename Scalar>
constexpr bool is_valid_varlen_tensor() {
  using Tr = InputTraits<T>;
  return Tr::kIsTensor && Tr::kRank == 3 && Tr::kRowMajor && std::is_same<typename Tr::Scalar, Scalar>::value;
}

#define SDPA_DETAIL_CHECK_VARLEN(T, Scalar)                                                                      \
  static_assert(::sdpa::detail::InputTraits<T>::kIsTensor && ::sdpa::detail::InputTraits<T>::kRank == 3,       \
                "sdpa::attention_varlen: q, k and v must be rank-3 Eigen tensors (total rows, heads, dim)");    \
  static_assert(!::sdpa::detail::InputTraits<T>::kIsTensor ||                                                   \
                    std::is_same<typename ::sdpa::detail::InputTraits<T>::Scalar, Scalar>::value,               \
                "sdpa::attention_varlen: q, k and v must have the same scalar type (float or double)");         \
  static_assert(!::sdpa::detail::InputTraits<T>::kIsTensor || ::sdpa::detail::InputTraits<T>::kRowMajor,       \
                "sdpa::attention_varlen: q, k and v must be RowMajor")

// attention_varlen's checks of its rank-3 inputs, then attention_impl over (1, total, heads, dim) views in
// the (batch, seq, heads, dim) layout, the result copied out as (total, heads, d_v).
template <typename Scalar>
Tensor3<Scalar> attention_varlen_impl(const InputView<Scalar>& q, const InputView<Scalar>& k, const InputView<Scalar>& v,
                                      const AttentionOptions<Scalar>& options, AttentionState<Scalar>* state) {
  const char* where = "attention_varlen";
  if (!options.packed())
    throw_invalid(where, "cu_seqlens_q and cu_seqlens_k", "the sequences' row boundaries", "empty");
  if (options.layout != Layout::kBHND)
    throw_invalid(where, "layout", "left at its default (the inputs are (total rows, heads, dim))", "set");
  const auto shape = [](const InputView<Scalar>& t) { return shape_string(t.dims()); };
  const auto& qd = q.dims();
  const auto& kd = k.dims();
  const auto& vd = v.dims();
  if (vd[0] != kd[0] || vd[1] != kd[1])
    throw_invalid(where, "v dimensions 0 and 1 (rows, key/value heads)", concat("those of k, (", kd[0], ", ", kd[1], ")"),
                  concat("(", vd[0], ", ", vd[1], ") (v shape ", shape(v), ")"));
  if (kd[2] != qd[2]) throw_invalid(where, "k dimension 2 (d_k)", concat(qd[2], ", the d_k of q"), concat(kd[2], " (k shape ", shape(k), ")"));
  if (qd[1] > 0 && (kd[1] <= 0 || qd[1] % kd[1] != 0))
    throw_invalid(where, "k dimension 1 (key/value heads)", concat("a positive divisor of the query heads, ", qd[1]),
                  concat(kd[1], " (k shape ", shape(k), ")"));
  AttentionOptions<Scalar> o = options;
  o.layout = Layout::kBNHD;
  const auto as4 = [](const InputView<Scalar>& t) {
    return Eigen::TensorMap<Tensor4<Scalar>>(const_cast<Scalar*>(t.data()), 1, t.dims()[0], t.dims()[1], t.dims()[2]);
  };
  const Input4<Scalar> qi(as4(q)), ki(as4(k)), vi(as4(v));
  const Tensor4<Scalar> out4 = attention_impl(qi, ki, vi, o, state, where);
  if (state != nullptr) state->varlen_ = true;
  Tensor3<Scalar> out(out4.dimension(1), out4.dimension(2), out4.dimension(3));
  if (out.size() > 0) std::copy_n(out4.data(), out.size(), out.data());
  return out;
}

}  // namespace detail

// Attention over packed sequences (FlashAttention's flash_attn_varlen_func): q (total_q, h, d_k), k
// (total_k, kv_heads, d_k), v (total_k, kv_heads, d_v), row-major; options.cu_seqlens_q / cu_seqlens_k give
// each sequence's rows (options.hpp), and every option applies per sequence; no padding is computed or
// stored. Returns (total_q, h, d_v).
template <typename Q, typename K, typename V>
Tensor3<detail::ScalarOf<Q>> attention_varlen(const Q& q, const K& k, const V& v, const AttentionOptions<detail::ScalarOf<Q>>& options) {
  using Scalar = detail::ScalarOf<Q>;
  SDPA_DETAIL_CHECK_VARLEN(Q, Scalar);
  SDPA_DETAIL_CHECK_VARLEN(K, Scalar);
  SDPA_DETAIL_CHECK_VARLEN(V, Scalar);
  if constexpr (detail::is_valid_varlen_tensor<Q, Scalar>() && detail::is_valid_varlen_tensor<K, Scalar>() &&
                detail::is_valid_varlen_tensor<V, Scalar>()) {
    const detail::InputView<Scalar> qi(q), ki(k), vi(v);
    return detail::attention_varlen_impl(qi, ki, vi, options, static_cast<AttentionState<Scalar>*>(nullptr));
  } else {
    return Tensor3<Scalar>();
  }
}

// The same, keeping in `state` what attention_varlen_backward needs.
template <typename Q, typename K, typename V>
Tensor3<detail::ScalarOf<Q>> attention_varlen(const Q& q, const K& k, const V& v, const AttentionOptions<detail::ScalarOf<Q>>& options,
                                              AttentionState<detail::ScalarOf<Q>>& state) {
  using Scalar = detail::ScalarOf<Q>;
  SDPA_DETAIL_CHECK_VARLEN(Q, Scalar);
  SDPA_DETAIL_CHECK_VARLEN(K, Scalar);
  SDPA_DETAIL_CHECK_VARLEN(V, Scalar);
  if constexpr (detail::is_valid_varlen_tensor<Q, Scalar>() && detail::is_valid_varlen_tensor<K, Scalar>() &&
                detail::is_valid_varlen_tensor<V, Scalar>()) {
    const detail::InputView<Scalar> qi(q), ki(k), vi(v);
    return detail::attention_varlen_impl(qi, ki, vi, options, &state);
  } else {
    return Tensor3<Scalar>();
  }
}

// d loss / d (q, k, v, sinks) of the attention_varlen call that filled `state`, given grad_output (total_q,
// h, d_v); each sequence's own backward (attention_backward's rules).
template <typename Scalar>
VarlenGradients<Scalar> attention_varlen_backward(const Tensor3<Scalar>& grad_output, const AttentionState<Scalar>& s) {
  const char* where = "attention_varlen_backward";
  if (s.empty() || !s.varlen_)
    throw std::logic_error("sdpa::attention_varlen_backward: pass the state that attention_varlen(q, k, v, options, state) "
                           "filled");
  const std::array<Eigen::Index, 4> want = s.out_.dimensions();  // (1, total_q, h, d_v)
  const std::array<Eigen::Index, 3> want3{want[1], want[2], want[3]};
  for (std::size_t i = 0; i < 3; ++i)
    if (grad_output.dimension(i) != want3[i])
      detail::throw_invalid(where, "grad_output", detail::concat("of the forward's output shape ", detail::shape_string(want3)),
                            detail::concat("of shape ", detail::shape_string(grad_output.dimensions())));
  AttentionGradients<Scalar> g4 = detail::attention_backward_impl(grad_output.data(), want, s, where);
  VarlenGradients<Scalar> g;
  const auto as3 = [](const Tensor4<Scalar>& t) {
    Tensor3<Scalar> out(t.dimension(1), t.dimension(2), t.dimension(3));
    if (out.size() > 0) std::copy_n(t.data(), out.size(), out.data());
    return out;
  };
  g.q = as3(g4.q);
  g.k = as3(g4.k);
  g.v = as3(g4.v);
  g.sinks = std::move(g4.sinks);
  return g;
}

SDPA_NAMESPACE_END
