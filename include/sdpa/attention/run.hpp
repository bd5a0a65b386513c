// The attention core's one kernel choice (run_attention, run_attention_backward, and their packed forms),
// and what a checked call hands the kernels: the AttentionProblem (problem_of), the head views of both
// layouts, a rank-4 input read in place or evaluated once, a score program's table gradients. Everything
// here trusts its arguments: attention/checks.hpp checked them.
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
#include "sdpa/attention/checks.hpp"
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

// The products' type of a checked call, and under kBf16 the instructions that run them (read once).
template <typename Scalar>
void set_compute(kernels::AttentionProblem<Scalar>& p, Compute compute) {
  p.compute = compute;
  p.bf16_path = compute == Compute::kBf16 ? active_bf16_path() : Bf16Path::kEmulated;
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
  p.lse = o.log_sum_exp != nullptr ? o.log_sum_exp->data() : nullptr;
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

// The rows rotate_rows turns: batch entries of n rows of `heads` heads of d features.
struct RotatedBlock {
  Eigen::Index batch = 0;
  Eigen::Index n = 0;
  Eigen::Index heads = 0;
  Eigen::Index d = 0;
};

// Rotates rows [0, n) of the block's heads (row i at position first + i): once per batch entry, or for
// packed sequences (cu given) each sequence's rows from its own positions (queries first = nk_s - nq_s: pass
// the other list as `other`, keys first = 0).
template <typename Scalar>
void rotate_rows(const Rotary& rotary, const kernels::Heads<Scalar>& t, const RotatedBlock& block, Eigen::Index first,
                 const std::vector<Eigen::Index>* cu, const std::vector<Eigen::Index>* other, bool inverse = false) {
  const Eigen::Index batch = block.batch, n = block.n, heads = block.heads, d = block.d;
  if (t.data == nullptr) return;
  if (cu == nullptr) {
    for (Eigen::Index b = 0; b < batch; ++b)
      apply_rotary(rotary, RotaryRows(t.row(b, 0, 0), n, t.row_stride, heads, t.head_stride, d), first, inverse);
    return;
  }
  for (std::size_t s = 0; s + 1 < cu->size(); ++s) {
    const Eigen::Index rows = (*cu)[s + 1] - (*cu)[s];
    const Eigen::Index start = other != nullptr ? ((*other)[s + 1] - (*other)[s]) - rows : 0;
    if (rows > 0)
      apply_rotary(rotary, RotaryRows(t.row(0, 0, (*cu)[s]), rows, t.row_stride, heads, t.head_stride, d), start,
                   inverse);
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
SDPA_NAMESPACE_END
