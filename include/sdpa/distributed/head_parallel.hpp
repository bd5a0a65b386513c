// Head-parallel attention over MPI (Megatron's tensor parallelism for attention): rank r of P owns query
// heads [r h / P, (r + 1) h / P) of a ScaledDotProductAttention, with their key/value heads, that is the
// matching rows of fc_q, fc_k and fc_v and the matching columns of fc_o (fc_o's bias on rank 0 only). Each
// rank projects the whole input to its heads, attends, and applies its columns of fc_o; one MPI_Allreduce
// sums the P partial outputs into the module's output, on every rank. Weights and work per rank are 1 / P
// of the module's (the inputs and the output are whole on every rank).
//
// Requires h and kv_heads divisible by P. Options are the whole module's: the per-head ones (alibi_slopes,
// sinks, and the head dimension of attention_mask / attention_weights / attention_bias when it is full)
// are sliced to the rank's heads here. probabilities is refused (each rank has only its heads'). In
// training mode a rank's dropout draws its own heads' masks from its own module's seed, not the whole
// module's. The reduction is MPI_SUM over the ranks' partial outputs: the same bits on every rank and run to
// run for a given P (MPI's reduction order is fixed for a fixed communicator and size); against the whole
// module it differs by the rounding of the split sum over heads (of order 1e-7 of the output for float).
//
// Collective: every rank calls with the same shapes and options, checked together before the exchange (a
// rank's refusal throws the same std::invalid_argument on every rank). io/head_parallel_io.hpp loads a
// rank's slice from the whole module's safetensors file.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/distributed/mpi.hpp"

#include <algorithm>
#include <array>
#include <vector>

#include "sdpa/scaled_dot_product_attention.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class HeadParallelAttention {
 public:
  using Index = Eigen::Index;
  using Module = ScaledDotProductAttention<Scalar>;
  using Tensor3 = typename Module::Tensor3;

  // Rank `comm`'s slice of a module of these sizes (as ScaledDotProductAttention's constructor), its
  // parameters zero (load_slice, or set_slice from a whole module, gives them values). Collective: the
  // sizes must be the same on every rank.
  HeadParallelAttention(MPI_Comm comm, Index d_model, Index d_k, Index d_v, Index h, Scalar dropout = Scalar(0.1),
                        Index kv_heads = 0)
      : comm_(comm), h_(h), kv_heads_(kv_heads == 0 ? h : kv_heads), local_(checked_local(comm, d_model, d_k, d_v, h, dropout, kv_heads)) {
    const distributed::detail::CommShape cs = distributed::detail::comm_shape(comm, "HeadParallelAttention");
    rank_ = cs.rank;
    ranks_ = cs.size;
    local_.fc_o().bias().setZero();
  }

  // Rank `comm`'s slice of `whole` (every rank holds the same whole module, e.g. built with the same seed or
  // loaded from the same file): its parameters, weight storage, rotary, masked-row policy, kernel,
  // dropout and training mode.
  static HeadParallelAttention slice_of(const Module& whole, MPI_Comm comm) {
    HeadParallelAttention hp(comm, whole.d_model(), whole.d_k(), whole.d_v(), whole.h(), whole.dropout(), whole.kv_heads());
    hp.set_slice(whole);
    return hp;
  }

  // Copies this rank's slice of `whole`'s parameters and settings (sizes must match: std::invalid_argument).
  void set_slice(const Module& whole) {
    const char* where = "HeadParallelAttention::set_slice";
    const auto same = [&](const char* name, Index mine, Index theirs) {
      if (mine != theirs) detail::throw_invalid(where, detail::concat("the whole module's ", name), mine, theirs);
    };
    same("d_model", local_.d_model(), whole.d_model());
    same("d_k", local_.d_k(), whole.d_k());
    same("d_v", local_.d_v(), whole.d_v());
    same("h", h_, whole.h());
    same("kv_heads", kv_heads_, whole.kv_heads());
    if (whole.qk_norm() != nullptr && whole.qk_norm()->kind == QkNormKind::kProjection)
      detail::throw_invalid(where, "the whole module's qk_norm",
                            "none or per head (a norm over the whole projection needs every head on one rank)", "kProjection");
    set_rows(local_.fc_q(), whole.fc_q().weight_values(), whole.fc_q().bias(), first_head() * local_.d_k());
    set_rows(local_.fc_k(), whole.fc_k().weight_values(), whole.fc_k().bias(), first_kv_head() * local_.d_k());
    set_rows(local_.fc_v(), whole.fc_v().weight_values(), whole.fc_v().bias(), first_kv_head() * local_.d_v());
    set_columns(whole.fc_o().weight_values(), whole.fc_o().bias());
    local_.set_weight_storage(whole.weight_storage());
    if (whole.rotary() != nullptr)
      local_.set_rotary(*whole.rotary());
    else
      local_.clear_rotary();
    if (whole.qk_norm() != nullptr)
      local_.set_qk_norm(*whole.qk_norm());  // per head: every rank's heads take the same weights
    else
      local_.clear_qk_norm();
    if (whole.query_temperature() != nullptr)
      local_.set_query_temperature(*whole.query_temperature());
    else
      local_.clear_query_temperature();
    local_.set_output_gate(whole.output_gate());
    if (whole.output_gate()) set_rows(local_.fc_g(), whole.fc_g().weight_values(), whole.fc_g().bias(), first_head() * local_.d_v());
    local_.set_masked_rows(whole.masked_rows());
    local_.set_kernel(whole.kernel());
    local_.set_dropout(whole.dropout());
    local_.train(whole.is_training());
  }

  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return ranks_; }
  Index h() const noexcept { return h_; }
  Index kv_heads() const noexcept { return kv_heads_; }
  Index first_head() const noexcept { return rank_ * (h_ / ranks_); }
  Index first_kv_head() const noexcept { return rank_ * (kv_heads_ / ranks_); }
  // This rank's slice: a ScaledDotProductAttention of h / P heads whose fc_o adds up to a partial output.
  Module& local() noexcept { return local_; }
  const Module& local() const noexcept { return local_; }
  MPI_Comm comm() const noexcept { return comm_; }

  // The whole module's output (batch, nq, d_model), on every rank. Collective.
  Tensor3 forward(const Tensor3& queries, const Tensor3& keys, const Tensor3& values, const AttentionOptions<Scalar>& options = {}) const {
    return run(queries, keys, values, options, nullptr);
  }

  // The same, keeping what backward needs.
  Tensor3 forward(const Tensor3& queries, const Tensor3& keys, const Tensor3& values, const AttentionOptions<Scalar>& options,
                  ForwardState<Scalar>& state) const {
    return run(queries, keys, values, options, &state);
  }

  // The gradients of the inputs (summed over ranks: the whole module's, on every rank) and of this rank's
  // parameters (its slices of the whole module's; fc_o.bias's on rank 0, zero elsewhere), and of its heads'
  // sinks. Collective.
  Gradients<Scalar> backward(const Tensor3& grad_output, const ForwardState<Scalar>& state) const {
    const char* where = "HeadParallelAttention::backward";
    const distributed::detail::CommShape cs = distributed::detail::comm_shape(comm_, where);
    distributed::detail::Fields fields;
    for (std::size_t i = 0; i < 3; ++i) fields.integer("grad_output's shape", grad_output.dimension(i));
    Gradients<Scalar> g;
    distributed::detail::checked_collectively(
        comm_, cs, where, [&] { g = local_.backward(grad_output, state); }, fields);
    for (Tensor3* t : {&g.queries, &g.keys, &g.values}) all_reduce(t->data(), t->size());
    if (rank_ != 0) g.fc_o.bias.setZero();
    return g;
  }

 private:
  static Module checked_local(MPI_Comm comm, Index d_model, Index d_k, Index d_v, Index h, Scalar dropout, Index kv_heads) {
    const char* where = "HeadParallelAttention";
    const distributed::detail::CommShape cs = distributed::detail::comm_shape(comm, where);
    distributed::detail::Fields fields;
    fields.integer("d_model", d_model).integer("d_k", d_k).integer("d_v", d_v).integer("h", h).integer("kv_heads", kv_heads);
    fields.real("dropout", static_cast<double>(dropout));
    Index kv = kv_heads == 0 ? h : kv_heads;
    distributed::detail::checked_collectively(
        comm, cs, where,
        [&] {
          if (h <= 0) detail::throw_invalid(where, "h", "positive", h);
          if (kv <= 0 || h % kv != 0) detail::throw_invalid(where, "kv_heads", detail::concat("0 or a divisor of h (", h, ")"), kv_heads);
          if (h % cs.size != 0)
            detail::throw_invalid(where, "h", detail::concat("a multiple of the ranks (", cs.size, ")"), h);
          if (kv % cs.size != 0)
            detail::throw_invalid(where, "kv_heads", detail::concat("a multiple of the ranks (", cs.size, ")"), kv);
          Module one_head(d_model, d_k, d_v, 1, dropout, 1);  // d_model, d_k, d_v and dropout as the module checks them
          (void)one_head;
        },
        fields);
    return Module(d_model, d_k, d_v, h / cs.size, dropout, kv / cs.size);
  }

  // layer's rows := rows [first, first + layer rows) of the whole layer's weight and bias.
  static void set_rows(Linear<Scalar>& layer, const typename Linear<Scalar>::Weight& w, const typename Linear<Scalar>::Bias& b,
                       Index first) {
    typename Linear<Scalar>::Weight mine(layer.out_features(), layer.in_features());
    for (Index i = 0; i < mine.dimension(0); ++i)
      for (Index j = 0; j < mine.dimension(1); ++j) mine(i, j) = w(first + i, j);
    layer.set_weight_storage(native_storage<Scalar>());
    layer.weight() = mine;
    for (Index i = 0; i < mine.dimension(0); ++i) layer.bias()(i) = b(first + i);
  }
  void set_columns(const typename Linear<Scalar>::Weight& w, const typename Linear<Scalar>::Bias& b) {
    Linear<Scalar>& fc_o = local_.fc_o();
    const Index first = first_head() * local_.d_v();
    typename Linear<Scalar>::Weight mine(fc_o.out_features(), fc_o.in_features());
    for (Index i = 0; i < mine.dimension(0); ++i)
      for (Index j = 0; j < mine.dimension(1); ++j) mine(i, j) = w(i, first + j);
    fc_o.set_weight_storage(native_storage<Scalar>());
    fc_o.weight() = mine;
    if (rank_ == 0)
      fc_o.bias() = b;
    else
      fc_o.bias().setZero();
  }

  void all_reduce(Scalar* data, Index size) const {
    if (size == 0) return;
    distributed::detail::check_mpi(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(size), distributed::detail::mpi_type<Scalar>(),
                                                 MPI_SUM, comm_),
                                   "MPI_Allreduce");
  }

  // A tensor option's slice: its head dimension (1) cut to this rank's heads when it is full.
  template <typename T>
  const Eigen::Tensor<T, 4, Eigen::RowMajor>* slice(const Eigen::Tensor<T, 4, Eigen::RowMajor>* t,
                                                     Eigen::Tensor<T, 4, Eigen::RowMajor>& into) const {
    if (t == nullptr || t->dimension(1) != h_) return t;
    const Index hl = h_ / ranks_;
    const std::array<Index, 4> offsets{0, first_head(), 0, 0}, extents{t->dimension(0), hl, t->dimension(2), t->dimension(3)};
    into = t->slice(offsets, extents);
    return &into;
  }

  Tensor3 run(const Tensor3& queries, const Tensor3& keys, const Tensor3& values, const AttentionOptions<Scalar>& options,
              ForwardState<Scalar>* state) const {
    const char* where = "HeadParallelAttention::forward";
    const distributed::detail::CommShape cs = distributed::detail::comm_shape(comm_, where);
    distributed::detail::Fields fields;
    for (const Tensor3* t : {&queries, &keys, &values})
      for (std::size_t i = 0; i < 3; ++i) fields.integer("the inputs' shapes", t->dimension(i));
    distributed::detail::add_option_fields(fields, options);
    Tensor3 out;
    // The local forward is this rank's check: it refuses before any work, and nothing is exchanged until
    // every rank has passed it.
    distributed::detail::checked_collectively(
        comm_, cs, where,
        [&] {
          if (options.probabilities != nullptr)
            detail::throw_invalid(where, "probabilities", "unset (each rank has only its own heads')", "set");
          if (options.log_sum_exp != nullptr)
            detail::throw_invalid(where, "log_sum_exp", "unset (each rank has only its own heads')", "set");
          const auto per_head = [&](const std::vector<Scalar>& v, const char* name) {
            if (!v.empty() && static_cast<Index>(v.size()) != h_)
              detail::throw_invalid(where, name, detail::concat("empty or one per query head of the whole module (", h_, ")"),
                                    detail::concat(v.size(), " values"));
          };
          per_head(options.alibi_slopes, "alibi_slopes");
          per_head(options.sinks, "sinks");
          AttentionOptions<Scalar> mine = options;
          const Index hl = h_ / ranks_;
          const auto cut = [&](const std::vector<Scalar>& v) {
            return v.empty() ? v : std::vector<Scalar>(v.begin() + first_head(), v.begin() + first_head() + hl);
          };
          mine.alibi_slopes = cut(options.alibi_slopes);
          mine.sinks = cut(options.sinks);
          mine.attention_mask = slice(options.attention_mask, mask_);
          mine.attention_weights = slice(options.attention_weights, weights_);
          mine.attention_bias = slice(options.attention_bias, bias_);
          out = state != nullptr ? local_.forward(queries, keys, values, mine, *state) : local_.forward(queries, keys, values, mine);
        },
        fields);
    all_reduce(out.data(), out.size());
    return out;
  }

  MPI_Comm comm_;
  int rank_ = 0, ranks_ = 1;
  // This rank's heads of the last forward's full-head mask / weights / bias tensors, kept for a backward
  // (its state points to them) until the next forward: one forward at a time per object.
  mutable Eigen::Tensor<bool, 4, Eigen::RowMajor> mask_;
  mutable Eigen::Tensor<Scalar, 4, Eigen::RowMajor> weights_, bias_;
  Index h_ = 0, kv_heads_ = 0;
  Module local_;
};

SDPA_NAMESPACE_END
