// sdpa::attention, the checked functional core: attention over head tensors a caller has already projected,
// as PyTorch's F.scaled_dot_product_attention (with enable_gqa), FlashAttention's flash_attn_func and
// ggml's ggml_flash_attn_ext take them, with every AttentionOptions field, and its backward. The module
// (scaled_dot_product_attention.hpp) runs its forward, its decoding steps and its backward through the same
// functions of namespace detail below: the options are checked, the broadcast views made and the kernel
// chosen in one place.
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

#include "sdpa/cpu.hpp"
#include "sdpa/detail/inputs.hpp"
#include "sdpa/error.hpp"
#include "sdpa/kernels/backward.hpp"
#include "sdpa/kernels/decode.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/reference.hpp"
#include "sdpa/kernels/tiled.hpp"
#include "sdpa/mask.hpp"
#include "sdpa/options.hpp"
#include "sdpa/random.hpp"
#include "sdpa/rotary.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
using Tensor4 = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>;

namespace detail {

// The sizes of one attention call, named where errors must name them.
struct CallShape {
  const char* where = "attention";
  Eigen::Index batch = 0, heads = 0, kv_heads = 0, nq = 0, nk = 0, d_k = 0, d_v = 0;
};

// Packed sequences (cu_seqlens_q / cu_seqlens_k) against the call's shape: a batch of one, two boundary
// lists of the same length from 0 up to the rows, and none of the options that have no packed form.
template <typename Scalar>
void check_packed(const CallShape& c, const AttentionOptions<Scalar>& o) {
  const char* where = c.where;
  if (c.batch != 1)
    throw_invalid(where, "the batch (packed sequences, cu_seqlens_q / cu_seqlens_k)", "1: the sequences are rows of one batch entry",
                  c.batch);
  if (o.cu_seqlens_q.empty() || o.cu_seqlens_q.size() != o.cu_seqlens_k.size())
    throw_invalid(where, "cu_seqlens_k", concat("as many entries as cu_seqlens_q (", o.cu_seqlens_q.size(), "), at least 1"),
                  concat(o.cu_seqlens_k.size(), " entries"));
  const auto bounds = [&](const std::vector<Eigen::Index>& cu, const char* name, Eigen::Index rows, const char* what) {
    if (cu.front() != 0) throw_invalid(where, concat(name, "[0]"), "0", cu.front());
    for (std::size_t s = 1; s < cu.size(); ++s)
      if (cu[s] < cu[s - 1])
        throw_invalid(where, concat(name, "[", s, "]"), concat("at least ", name, "[", s - 1, "] = ", cu[s - 1]), cu[s]);
    if (cu.back() != rows)
      throw_invalid(where, concat(name, "[", cu.size() - 1, "] (the last)"), concat(rows, ", the number of ", what), cu.back());
  };
  bounds(o.cu_seqlens_q, "cu_seqlens_q", c.nq, "query rows");
  bounds(o.cu_seqlens_k, "cu_seqlens_k", c.nk, "key rows");
  const char* unpacked = o.attention_mask != nullptr      ? "attention_mask"
                         : o.attention_weights != nullptr ? "attention_weights"
                         : o.attention_bias != nullptr    ? "attention_bias"
                         : !o.key_lengths.empty()         ? "key_lengths"
                         : o.probabilities != nullptr     ? "probabilities"
                                                          : nullptr;
  if (unpacked != nullptr)
    throw_invalid(where, unpacked, "unset with packed sequences (cu_seqlens: it has no packed form)", "set");
}

// Compute::kBf16 where it runs: float problems, the tiled or automatic kernel.
template <typename Scalar>
void check_compute(const char* where, Compute compute, Kernel kernel) {
  if (compute == Compute::kFloat) return;
  if (!std::is_same<Scalar, float>::value)
    throw_invalid(where, "compute", "Compute::kFloat for double (kBf16 rounds float operands)", compute_name(compute));
  if (kernel == Kernel::kReference)
    throw_invalid(where, "compute", "Compute::kFloat with Kernel::kReference (the reference multiplies in float)",
                  compute_name(compute));
}

// The products' type of a checked call, and under kBf16 the instructions that run them (read once).
template <typename Scalar>
void set_compute(kernels::AttentionProblem<Scalar>& p, Compute compute) {
  p.compute = compute;
  p.bf16_path = compute == Compute::kBf16 ? active_bf16_path() : Bf16Path::kEmulated;
}

// Every option against the call's shape, before any work: std::invalid_argument naming the function, the
// field, what it must be and what it is. A module call (module_call) refuses the fields that belong to
// sdpa::attention alone.
template <typename Scalar>
void check_attention_options(const CallShape& c, const AttentionOptions<Scalar>& o, bool module_call) {
  const char* where = c.where;
  if (o.packed()) check_packed(c, o);
  const std::array<Eigen::Index, 4> full{c.batch, c.heads, c.nq, c.nk};
  make_broadcast_view(o.attention_mask, full, where, "attention_mask");
  make_broadcast_view(o.attention_weights, full, where, "attention_weights");
  make_broadcast_view(o.attention_bias, full, where, "attention_bias");
  if (o.window_left < -1)
    throw_invalid(where, "window_left", "-1 (no window) or a non-negative number of keys", o.window_left);
  if (o.window_right < -1)
    throw_invalid(where, "window_right", "-1 (no window) or a non-negative number of keys", o.window_right);
  if (!o.key_lengths.empty()) {
    if (static_cast<Eigen::Index>(o.key_lengths.size()) != c.batch)
      throw_invalid(where, "key_lengths", concat("empty or one length per batch entry (", c.batch, ")"),
                    concat(o.key_lengths.size(), " lengths"));
    for (std::size_t b = 0; b < o.key_lengths.size(); ++b)
      if (o.key_lengths[b] < 0 || o.key_lengths[b] > c.nk)
        throw_invalid(where, concat("key_lengths[", b, "]"), concat("in [0, ", c.nk, "]"), o.key_lengths[b]);
  }
  const auto per_head = [&](const std::vector<Scalar>& values, const char* name, const char* what) {
    if (values.empty()) return;
    if (static_cast<Eigen::Index>(values.size()) != c.heads)
      throw_invalid(where, name, concat("empty or one ", what, " per query head (", c.heads, ")"),
                    concat(values.size(), " ", what, "s"));
    for (std::size_t i = 0; i < values.size(); ++i)
      if (!std::isfinite(values[i])) throw_invalid(where, concat(name, "[", i, "]"), "finite", values[i]);
  };
  per_head(o.alibi_slopes, "alibi_slopes", "slope");
  per_head(o.sinks, "sinks", "logit");
  if (!(std::isfinite(o.scale) && o.scale >= Scalar(0)))
    throw_invalid(where, "scale", "0 (1 / sqrt(d_k)) or a finite positive factor", o.scale);
  if (!(std::isfinite(o.softcap) && o.softcap >= Scalar(0)))
    throw_invalid(where, "softcap", "0 (none) or a finite positive cap", o.softcap);
  if (module_call && o.compute != Compute::kFloat)
    throw_invalid(where, "compute (set_compute sets the module's)", "left at its default in a module call",
                  "set: it is an option of sdpa::attention only");
  if (!module_call) check_compute<Scalar>(where, o.compute, o.kernel);
  if (o.program != nullptr) {
    if (o.kernel == Kernel::kReference)
      throw_invalid(where, "kernel", "Kernel::kAuto or Kernel::kTiled with a score program", "Kernel::kReference");
    o.program->check(where, c.batch, c.heads, c.nq, c.nk, o.packed());
  }
  if (module_call) {
    const char* own = nullptr;
    if (o.layout != Layout::kBHND) own = "layout (the module's inputs are (batch, seq, d_model))";
    else if (o.masked_rows != MaskedRows::kZero) own = "masked_rows (set_masked_rows sets the module's)";
    else if (o.kernel != Kernel::kAuto) own = "kernel (set_kernel sets the module's)";
    else if (o.dropout != Scalar(0) || o.dropout_seed != 0) own = "dropout, dropout_seed (the module has its own dropout)";
    else if (o.rotary != nullptr) own = "rotary (set_rotary sets the module's)";
    if (own != nullptr)
      throw_invalid(where, own, "left at its default in a module call", "set: it is an option of sdpa::attention only");
  } else {
    if (!(std::isfinite(o.dropout) && o.dropout >= Scalar(0) && o.dropout <= Scalar(1)))
      throw_invalid(where, "dropout", "a finite probability in [0, 1]", o.dropout);
    if (o.rotary != nullptr) check_rotary(where, *o.rotary, c.d_k);
    if (!o.rotary_positions.empty())
      throw_invalid(where, "rotary_positions", "empty for sdpa::attention (a module's forward and step take them)", "given");
  }
}

// The kernel problem of a checked call with nq queries at positions q + query_offset among nk keys: sizes,
// scale, the broadcast views and the tensor-free options, the masked-row policy and whether causal holds
// (a decoding step forces it). q, k, v, out and the dropout draw are the caller's.
template <typename Scalar>
kernels::AttentionProblem<Scalar> problem_of(const CallShape& c, const AttentionOptions<Scalar>& o, MaskedRows policy,
                                             bool causal, Eigen::Index query_offset) {
  kernels::AttentionProblem<Scalar> p;
  const std::array<Eigen::Index, 4> full{c.batch, c.heads, c.nq, c.nk};
  p.batch = c.batch;
  p.heads = c.heads;
  p.kv_group = c.kv_heads > 0 ? c.heads / c.kv_heads : 1;
  p.nq = c.nq;
  p.nk = c.nk;
  p.d_k = c.d_k;
  p.d_v = c.d_v;
  p.scale = o.scale > Scalar(0) ? o.scale : Scalar(1) / std::sqrt(static_cast<Scalar>(c.d_k));
  p.mask = make_broadcast_view(o.attention_mask, full, c.where, "attention_mask");
  p.weights = make_broadcast_view(o.attention_weights, full, c.where, "attention_weights");
  p.bias = make_broadcast_view(o.attention_bias, full, c.where, "attention_bias");
  p.softcap = o.softcap;
  p.alibi = o.alibi_slopes.empty() ? nullptr : o.alibi_slopes.data();
  p.sinks = o.sinks.empty() ? nullptr : o.sinks.data();
  p.causal = causal;
  p.window_left = o.window_left;
  p.window_right = o.window_right;
  p.key_lengths = o.key_lengths.empty() ? nullptr : o.key_lengths.data();
  p.query_offset = query_offset;
  p.masked_rows = policy;
  p.probabilities = o.probabilities != nullptr ? o.probabilities->data() : nullptr;
  set_compute(p, o.compute);
  p.program = o.program.get();
  return p;
}

// Runs the forward kernel the choice names: the plain reference, the decoding kernel (kAuto with 16 queries
// or fewer, float products; its scratch in `workspace`, or a fresh one), or the tiled kernel.
template <typename Scalar>
void run_attention(const kernels::AttentionProblem<Scalar>& p, Kernel kernel,
                   kernels::DecodeWorkspace<Scalar>* workspace, const Eigen::ThreadPoolDevice* device) {
  if (p.program != nullptr) {
    p.program->forward(p, kernel, workspace, device);  // the program's own kernels (kReference is refused)
  } else if (kernel == Kernel::kReference) {
    kernels::reference_attention(p, device);
  } else if (kernel == Kernel::kAuto && p.compute == Compute::kFloat && kernels::decode_suits(p)) {
    kernels::DecodeWorkspace<Scalar> local;
    kernels::decode_attention(p, workspace != nullptr ? *workspace : local, device);
  } else {
    kernels::tiled_attention(p, device);
  }
}

// The backward kernel for the same choice (the tiled backward for kAuto and kTiled, and for a score
// program, whose status it returns).
template <typename Scalar>
kernels::BackwardStatus run_attention_backward(const kernels::BackwardProblem<Scalar>& bp, Kernel kernel,
                                               const Eigen::ThreadPoolDevice* device) {
  if (bp.forward->program != nullptr) return bp.forward->program->backward(bp, device);
  if (kernel == Kernel::kReference)
    kernels::reference_backward(bp, device);
  else
    kernels::tiled_backward(bp, device);
  return {};
}

// Sequence s of a packed problem p (a batch of one whose q rows are the sequences' queries one after the
// other, k and v rows their keys): a batch of one over its own rows, its queries at q + nk_s - nq_s, its
// log-sum-exp at lse + heads * cu_q[s], its dropout drawn as batch entry s's would be.
template <typename Scalar>
kernels::AttentionProblem<Scalar> sequence_problem(const kernels::AttentionProblem<Scalar>& p,
                                                   const std::vector<Eigen::Index>& cu_q,
                                                   const std::vector<Eigen::Index>& cu_k, std::size_t s) {
  kernels::AttentionProblem<Scalar> ps = p;
  const Eigen::Index q0 = cu_q[s], k0 = cu_k[s];
  ps.nq = cu_q[s + 1] - q0;
  ps.nk = cu_k[s + 1] - k0;
  ps.query_offset = ps.nk - ps.nq;
  ps.q.data = p.q.data != nullptr ? p.q.row(0, 0, q0) : nullptr;
  ps.k.data = p.k.data != nullptr ? p.k.row(0, 0, k0) : nullptr;
  ps.v.data = p.v.data != nullptr ? p.v.row(0, 0, k0) : nullptr;
  ps.out.data = p.out.data != nullptr ? p.out.row(0, 0, q0) : nullptr;
  if (p.lse != nullptr) ps.lse = p.lse + p.heads * q0;
  ps.sampler = p.sampler.offset_rows(static_cast<std::int64_t>(s) * p.heads);
  ps.batch_base = static_cast<Eigen::Index>(s);
  return ps;
}

// The forward of a packed problem: each sequence on its own (its rows only: no padding is computed).
template <typename Scalar>
void run_packed(const kernels::AttentionProblem<Scalar>& p, const std::vector<Eigen::Index>& cu_q,
                const std::vector<Eigen::Index>& cu_k, Kernel kernel, const Eigen::ThreadPoolDevice* device) {
  for (std::size_t s = 0; s + 1 < cu_q.size(); ++s) {
    const kernels::AttentionProblem<Scalar> ps = sequence_problem(p, cu_q, cu_k, s);
    if (ps.nq > 0 && ps.heads > 0) run_attention(ps, kernel, static_cast<kernels::DecodeWorkspace<Scalar>*>(nullptr), device);
  }
}

// The backward of a packed problem, sequence by sequence: the gradients' rows of each sequence from its
// own backward (zero where it has no queries or no keys); the sinks' gradients summed in sequence order.
// A score program's table gradients (d_tables_size elements) likewise.
template <typename Scalar>
kernels::BackwardStatus run_packed_backward(const kernels::BackwardProblem<Scalar>& bp, const std::vector<Eigen::Index>& cu_q,
                                            const std::vector<Eigen::Index>& cu_k, Kernel kernel,
                                            const Eigen::ThreadPoolDevice* device, Eigen::Index d_tables_size = 0) {
  using Index = Eigen::Index;
  const kernels::AttentionProblem<Scalar>& p = *bp.forward;
  kernels::BackwardStatus status;
  std::vector<Scalar> sinks(bp.d_sinks != nullptr ? static_cast<std::size_t>(p.heads) : 0);
  if (bp.d_sinks != nullptr) std::fill_n(bp.d_sinks, p.heads, Scalar(0));
  std::vector<Scalar> tables(bp.d_tables != nullptr ? static_cast<std::size_t>(d_tables_size) : 0);
  if (bp.d_tables != nullptr) std::fill_n(bp.d_tables, d_tables_size, Scalar(0));
  const auto zero = [&](const kernels::Heads<Scalar>& t, Index row, Index rows, Index heads, Index d) {
    for (Index i = 0; i < rows; ++i)
      for (Index h = 0; h < heads; ++h) std::fill_n(t.row(0, h, row + i), d, Scalar(0));
  };
  for (std::size_t s = 0; s + 1 < cu_q.size(); ++s) {
    const kernels::AttentionProblem<Scalar> ps = sequence_problem(p, cu_q, cu_k, s);
    if (ps.nq == 0 || ps.nk == 0 || ps.heads == 0) {
      zero(bp.d_q, cu_q[s], ps.nq, p.heads, p.d_k);
      zero(bp.d_k, cu_k[s], ps.nk, p.kv_heads(), p.d_k);
      zero(bp.d_v, cu_k[s], ps.nk, p.kv_heads(), p.d_v);
      continue;
    }
    kernels::BackwardProblem<Scalar> bps = bp;
    bps.forward = &ps;
    bps.d_out.data = bp.d_out.row(0, 0, cu_q[s]);
    bps.d_q.data = bp.d_q.row(0, 0, cu_q[s]);
    bps.d_k.data = bp.d_k.row(0, 0, cu_k[s]);
    bps.d_v.data = bp.d_v.row(0, 0, cu_k[s]);
    if (bp.d_sinks != nullptr) bps.d_sinks = sinks.data();
    if (bp.d_tables != nullptr) bps.d_tables = tables.data();
    const kernels::BackwardStatus st = run_attention_backward(bps, kernel, device);
    status.unlisted_table = status.unlisted_table || st.unlisted_table;
    status.too_many_reads = status.too_many_reads || st.too_many_reads;
    if (bp.d_sinks != nullptr)
      for (Index h = 0; h < p.heads; ++h) bp.d_sinks[h] += sinks[static_cast<std::size_t>(h)];
    if (bp.d_tables != nullptr)
      for (Index e = 0; e < d_tables_size; ++e) bp.d_tables[e] += tables[static_cast<std::size_t>(e)];
  }
  return status;
}

// The gradients of a score program's tables (ScoreProgram::table_dims): one buffer for the backward kernels
// (BackwardProblem::d_tables), split into one (rows, cols) tensor per table when the backward is done.
template <typename Scalar>
class ProgramTables {
 public:
  using Index = Eigen::Index;
  using Table = Eigen::Tensor<Scalar, 2, Eigen::RowMajor>;

  explicit ProgramTables(const ScoreProgram<Scalar>* program) {
    const Index n = program != nullptr ? program->table_count() : 0;
    for (Index i = 0; i < n; ++i) {
      const std::array<Index, 2> d = program->table_dims(i);
      dims_.push_back(d);
      size_ += d[0] * d[1];
    }
    flat_.assign(static_cast<std::size_t>(size_), Scalar(0));
  }
  Scalar* data() noexcept { return size_ > 0 ? flat_.data() : nullptr; }
  Index size() const noexcept { return size_; }

  // Refuses a backward that lost table gradients (std::invalid_argument, naming `where`); else the tables.
  std::vector<Table> finish(const kernels::BackwardStatus& status, const char* where) const {
    if (status.unlisted_table)
      throw_invalid(where, "the score program's tables", "every ScoreTable its score function reads",
                    "missing one the function read (list it when making the program)");
    if (status.too_many_reads)
      throw_invalid(where, "the score function's table reads per score", concat("at most ", flex::Dual<Scalar>::kTangents - 1),
                    "more");
    std::vector<Table> tables;
    Index offset = 0;
    for (const auto& d : dims_) {
      tables.emplace_back(d[0], d[1]);
      if (d[0] * d[1] > 0) std::copy_n(flat_.data() + offset, d[0] * d[1], tables.back().data());
      offset += d[0] * d[1];
    }
    return tables;
  }

 private:
  std::vector<std::array<Index, 2>> dims_;
  std::vector<Scalar> flat_;
  Index size_ = 0;
};

// Rotates rows [0, n) of heads `heads` (row i at position first + i): once per batch entry, or for packed
// sequences (cu given) each sequence's rows from its own positions (queries first = nk_s - nq_s: pass the
// other list as `other`, keys first = 0).
template <typename Scalar>
void rotate_rows(const Rotary& rotary, const kernels::Heads<Scalar>& t, Eigen::Index batch, Eigen::Index n,
                 Eigen::Index heads, Eigen::Index d, Eigen::Index first, const std::vector<Eigen::Index>* cu,
                 const std::vector<Eigen::Index>* other, bool inverse = false) {
  if (t.data == nullptr) return;
  if (cu == nullptr) {
    for (Eigen::Index b = 0; b < batch; ++b)
      apply_rotary(rotary, t.row(b, 0, 0), n, t.row_stride, heads, t.head_stride, d, first, inverse);
    return;
  }
  for (std::size_t s = 0; s + 1 < cu->size(); ++s) {
    const Eigen::Index rows = (*cu)[s + 1] - (*cu)[s];
    const Eigen::Index start = other != nullptr ? ((*other)[s + 1] - (*other)[s]) - rows : 0;
    if (rows > 0) apply_rotary(rotary, t.row(0, 0, (*cu)[s]), rows, t.row_stride, heads, t.head_stride, d, start, inverse);
  }
}

// The view of a head tensor in one of the two layouts: head h of row i of batch b.
template <typename T>
kernels::Heads<T> heads_of(T* data, const std::array<Eigen::Index, 4>& dims, Layout layout) {
  // kBHND: (b, h, n, d); kBNHD: (b, n, h, d).
  const Eigen::Index d = dims[3];
  if (layout == Layout::kBHND) return {data, dims[1] * dims[2] * d, d, dims[2] * d};
  return {data, dims[1] * dims[2] * d, dims[2] * d, d};
}

// The (batch, heads, seq, dim) sizes of a tensor of the given layout.
inline std::array<Eigen::Index, 4> bhnd(const std::array<Eigen::Index, 4>& dims, Layout layout) {
  return layout == Layout::kBHND ? dims : std::array<Eigen::Index, 4>{dims[0], dims[2], dims[1], dims[3]};
}

// One rank-4 input: read in place (a row-major Tensor or TensorMap of Scalar) or evaluated once.
template <typename Scalar>
class Input4 {
 public:
  template <typename T>
  explicit Input4(const T& t) {
    if constexpr (IsInPlace4<T>::value) {
      data_ = t.data();
      dims_ = {t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)};
    } else {
      owned_ = t;
      data_ = owned_.data();
      dims_ = {owned_.dimension(0), owned_.dimension(1), owned_.dimension(2), owned_.dimension(3)};
    }
  }
  const Scalar* data() const noexcept { return data_; }
  const std::array<Eigen::Index, 4>& dims() const noexcept { return dims_; }

 private:
  template <typename T>
  struct IsInPlace4 : std::false_type {};
  template <typename S, int Options, typename I>
  struct IsInPlace4<Eigen::Tensor<S, 4, Options, I>> : std::integral_constant<bool, (Options & Eigen::RowMajor) != 0> {};
  template <typename S, int Options, typename I, int MapOptions, template <class> class MakePointer>
  struct IsInPlace4<Eigen::TensorMap<Eigen::Tensor<S, 4, Options, I>, MapOptions, MakePointer>>
      : std::integral_constant<bool, (Options & Eigen::RowMajor) != 0> {};

  Tensor4<Scalar> owned_;
  const Scalar* data_ = nullptr;
  std::array<Eigen::Index, 4> dims_{};
};

template <typename T>
using ScalarOf = typename InputTraits<T>::Scalar;

template <typename T, typename Scalar>
constexpr bool is_valid_head_tensor() {
  using Tr = InputTraits<T>;
  return Tr::kIsTensor && Tr::kRank == 4 && Tr::kRowMajor && std::is_same<typename Tr::Scalar, Scalar>::value;
}

#define SDPA_DETAIL_CHECK_HEADS(T, Scalar)                                                                       \
  static_assert(::sdpa::detail::InputTraits<T>::kIsTensor,                                                      \
                "sdpa::attention: q, k and v must be Eigen tensors (Eigen::Tensor, Eigen::TensorMap or a tensor " \
                "expression) of rank 4");                                                                        \
  static_assert(!::sdpa::detail::InputTraits<T>::kIsTensor || ::sdpa::detail::InputTraits<T>::kRank == 4,        \
                "sdpa::attention: q, k and v must be rank-4 tensors (batch, heads, seq, dim) or (batch, seq, "    \
                "heads, dim)");                                                                                  \
  static_assert(!::sdpa::detail::InputTraits<T>::kIsTensor ||                                                    \
                    std::is_same<typename ::sdpa::detail::InputTraits<T>::Scalar, Scalar>::value,                \
                "sdpa::attention: q, k and v must have the same scalar type (float or double)");                \
  static_assert(!::sdpa::detail::InputTraits<T>::kIsTensor || ::sdpa::detail::InputTraits<T>::kRowMajor,        \
                "sdpa::attention: q, k and v must be RowMajor (PyTorch memory order)")

}  // namespace detail

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
  detail::CallShape shape_;
  std::array<Eigen::Index, 4> q_dims_{}, k_dims_{}, v_dims_{};
  Tensor4<Scalar> q_, k_, v_, out_;
  std::vector<Scalar> lse_;
  AttentionOptions<Scalar> options_;  // without probabilities and rotary (the copy below)
  Rotary rotary_;
  bool has_rotary_ = false;
  bool dropout_ = false;
  DropoutSampler sampler_{0, 0, 0.0};
  Scalar keep_scale_ = Scalar(1);
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
  CallShape c;
  c.where = where;
  c.batch = qd[0];
  c.heads = qd[1];
  c.kv_heads = kd[1];
  c.nq = qd[2];
  c.nk = kd[2];
  c.d_k = qd[3];
  c.d_v = vd[3];
  check_attention_options(c, options, /*module_call=*/false);

  // Checked: from here on nothing throws but an allocation failure.
  const std::array<Index, 4> out_dims =
      layout == Layout::kBHND ? std::array<Index, 4>{c.batch, c.heads, c.nq, c.d_v}
                              : std::array<Index, 4>{c.batch, c.nq, c.heads, c.d_v};
  Tensor4<Scalar> out(out_dims);
  if (options.probabilities != nullptr) options.probabilities->resize(c.batch, c.heads, c.nq, c.nk);
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
      rotate_rows(*options.rotary, heads_of(q_rot.data(), q_rot.dimensions(), layout), c.batch, c.nq, c.heads, c.d_k,
                  c.nk - c.nq, packed ? &options.cu_seqlens_q : nullptr, packed ? &options.cu_seqlens_k : nullptr);
    if (k_rot.size() > 0)
      rotate_rows(*options.rotary, heads_of(k_rot.data(), k_rot.dimensions(), layout), c.batch, c.nk, c.kv_heads, c.d_k,
                  Index{0}, packed ? &options.cu_seqlens_k : nullptr, static_cast<const std::vector<Index>*>(nullptr));
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

  if (state != nullptr) {
    AttentionState<Scalar>& s = *state;
    s = AttentionState<Scalar>();
    s.filled_ = true;
    s.shape_ = c;
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
      s.rotary_ = *options.rotary;
      s.has_rotary_ = true;
    } else {
      copy(qi.data(), qi.dims(), s.q_);
      copy(ki.data(), ki.dims(), s.k_);
    }
    copy(vi.data(), vi.dims(), s.v_);
    copy(out.data(), out.dimensions(), s.out_);
    s.lse_ = std::move(lse);
    s.options_ = options;
    s.options_.probabilities = nullptr;
    s.options_.rotary = nullptr;
    s.dropout_ = p.dropout;
    s.sampler_ = p.sampler;
    s.keep_scale_ = p.keep_scale;
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
  const detail::CallShape& c = s.shape_;
  const AttentionOptions<Scalar>& o = s.options_;
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
  p.lse = const_cast<Scalar*>(s.lse_.data());
  p.dropout = s.dropout_;
  p.sampler = s.sampler_;
  p.keep_scale = s.keep_scale_;
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
  if (s.has_rotary_) {
    const bool packed = o.packed();
    if (g.q.size() > 0)
      detail::rotate_rows(s.rotary_, detail::heads_of(g.q.data(), g.q.dimensions(), layout), c.batch, c.nq, c.heads, c.d_k,
                          c.nk - c.nq, packed ? &o.cu_seqlens_q : nullptr, packed ? &o.cu_seqlens_k : nullptr,
                          /*inverse=*/true);
    if (g.k.size() > 0)
      detail::rotate_rows(s.rotary_, detail::heads_of(g.k.data(), g.k.dimensions(), layout), c.batch, c.nk, c.kv_heads, c.d_k,
                          Index{0}, packed ? &o.cu_seqlens_k : nullptr, static_cast<const std::vector<Index>*>(nullptr),
                          /*inverse=*/true);
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
