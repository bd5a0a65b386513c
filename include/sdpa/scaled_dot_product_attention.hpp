// sdpa::ScaledDotProductAttention, the multi-head attention module of External-Attention-pytorch: four
// projections (fc_q, fc_k, fc_v, fc_o), heads split head-major, softmax(q k^T / sqrt(d_k) * weights,
// masked) with dropout, heads merged, fc_o; with grouped-query heads (kv_heads < h: fc_k and fc_v project
// to kv_heads heads) and a rotary position embedding when set. This header declares the module: its
// contract, parameters and settings. The definitions are in sdpa/module/ (parameters.hpp, forward.hpp,
// training.hpp, decoding.hpp), included at the end; the attention core, its option checks and the kernel
// choice are sdpa/attention.hpp's, shared with sdpa::attention.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "sdpa/attention.hpp"
#include "sdpa/detail/buffer.hpp"
#include "sdpa/detail/inputs.hpp"
#include "sdpa/detail/scratch_pool.hpp"
#include "sdpa/forward_state.hpp"
#include "sdpa/gradients.hpp"
#include "sdpa/head_norm.hpp"
#include "sdpa/error.hpp"
#include "sdpa/init.hpp"
#include "sdpa/kernels/decode.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/projection.hpp"
#include "sdpa/linear.hpp"
#include "sdpa/mask.hpp"
#include "sdpa/options.hpp"
#include "sdpa/parameter.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/random.hpp"
#include "sdpa/rotary.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class KVCache;  // sdpa/cache/kv_cache.hpp
template <typename Scalar>
class PagedKVCache;  // sdpa/cache/paged_kv_cache.hpp

namespace detail {
// A process-wide unique id per module object, so that backward can tell its own ForwardStates.
inline std::uint64_t next_module_id() noexcept {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}
}  // namespace detail

template <typename Scalar>
class ScaledDotProductAttention {
  static_assert(std::is_floating_point<Scalar>::value,
                "sdpa::ScaledDotProductAttention needs a floating-point Scalar");

 public:
  using Index = Eigen::Index;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;
  using Mask = Eigen::Tensor<bool, 4, Eigen::RowMajor>;
  using Weights = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>;
  using LinearType = Linear<Scalar>;

  // kv_heads: the key/value heads fc_k and fc_v project to (grouped-query attention; query head i reads
  // key/value head i / (h / kv_heads)); 0 means h (multi-head attention), 1 multi-query attention.
  ScaledDotProductAttention(Index d_model, Index d_k, Index d_v, Index h, Scalar dropout = Scalar(0.1),
                            Index kv_heads = 0)
      : d_model_(checked_size("d_model", d_model)),
        d_k_(checked_size("d_k", d_k)),
        d_v_(checked_size("d_v", d_v)),
        h_(checked_size("h", h)),
        kv_heads_(checked_kv_heads(kv_heads, h)),
        dropout_(checked_dropout(dropout)),
        seed_(next_seed()),
        id_(detail::next_module_id()),
        fc_q_(d_model, checked_product("d_model * h * d_k (weight count of fc_q)", d_model,
                                       checked_product("h * d_k", h, d_k)) / d_model),
        fc_k_(d_model, kv_heads_ * d_k),
        fc_v_(d_model, checked_product("d_model * h * d_v (weight count of fc_v)", d_model,
                                       checked_product("h * d_v", h, d_v)) / d_model / h * kv_heads_),  // kv * d_v
        fc_o_(h * d_v, d_model) {
    init_weights();
  }

  // A copy has the original's parameters and settings, and a seed of its own from the process-wide
  // sequence (sdpa::next_seed), as a deep copy in PyTorch draws from the global generator: it does not
  // replay the original's dropout masks. Call manual_seed on both for identical masks.
  ScaledDotProductAttention(const ScaledDotProductAttention& other);
  ScaledDotProductAttention& operator=(const ScaledDotProductAttention& other);
  // A move keeps the seed and the dropout call count: it is the same module in a new place. It draws
  // nothing from the process-wide sequence.
  ScaledDotProductAttention(ScaledDotProductAttention&& other) noexcept;
  ScaledDotProductAttention& operator=(ScaledDotProductAttention&& other) noexcept;

  // The original's init: linear weights ~ N(0, 0.001), biases 0, drawn from a Philox generator keyed by
  // the module's seed (one stream per layer, so a layer's draw does not depend on the others).
  void init_weights() { init_weights(init::ExternalAttentionPolicy{}); }

  template <typename Policy>
  void init_weights(const Policy& policy);

  // Every layer drawn from `gen`, in the order fc_q, fc_k, fc_v, fc_o (then fc_g).
  template <typename Policy, typename Gen>
  void init_weights(const Policy& policy, Gen& gen);

  // ---- Weight storage ----

  // Stores the four layers' weights as `storage` (Linear::set_weight_storage): a float module takes
  // kFloat32, kBFloat16 or kFloat16 (half the weights' bytes; biases stay float). The forward, decoding and
  // attention calls read narrow weights while they pack them, computing exactly what the float module with
  // the rounded weights computes; training (forward with a state, backward, named_parameters, optimizers)
  // needs Scalar weights and refuses narrow ones with std::invalid_argument.
  void set_weight_storage(Storage storage) {
    for (LinearType* layer : {&fc_q_, &fc_k_, &fc_v_, &fc_o_, &fc_g_}) layer->set_weight_storage(storage);
  }
  Storage weight_storage() const noexcept { return fc_q_.weight_storage(); }

  // queries (batch, nq, d_model), keys and values (batch, nk, d_model): an Eigen::Tensor<Scalar, 3, RowMajor>
  // or a TensorMap of that layout (read in place), or any rank-3 row-major tensor expression of Scalar
  // (evaluated once). Returns (batch, nq, d_model). The options (options.hpp) say what masks, modifies or
  // hides the scores and where the probabilities go; every option is checked before any work.
  template <typename Q, typename K, typename V>
  Tensor3 forward(const Q& queries, const K& keys, const V& values, const AttentionOptions<Scalar>& options) const;

  template <typename Q, typename K, typename V>
  Tensor3 operator()(const Q& queries, const K& keys, const V& values, const AttentionOptions<Scalar>& options) const;

  // ---- Training ----

  // The forward, keeping in `state` what backward needs (sdpa/forward_state.hpp: O(N) memory, never the
  // probabilities). The tensors the options point to (mask, weights, bias) and the device must outlive
  // the backward call; `probabilities` is filled as usual.
  template <typename Q, typename K, typename V>
  Tensor3 forward(const Q& queries, const K& keys, const V& values, const AttentionOptions<Scalar>& options,
                  ForwardState<Scalar>& state) const;

  // d loss / d everything, given grad_output = d loss / d (the forward's output) and that forward's state:
  // FlashAttention 2's backward (the probabilities recomputed from each row's log-sum-exp, the dropout
  // replayed), then the projections'. The same bits on any number of threads. The state can be used again
  // (it is not consumed), but only with this module, and the module's parameters must not have changed
  // since its forward. q = k = v: the input's gradient is queries + keys + values.
  Gradients<Scalar> backward(const Tensor3& grad_output, const ForwardState<Scalar>& state) const {
    check_scalar_weights("ScaledDotProductAttention::backward");
    return backward_impl(grad_output, state);
  }

  // The original module's signature: an optional bool mask (true = masked) and multiplicative weights, each
  // dimension 1 or full (batch, h, nq, nk), and a thread pool (nullptr: the calling thread).
  template <typename Q, typename K, typename V>
  Tensor3 forward(const Q& queries, const K& keys, const V& values, const Mask* attention_mask = nullptr,
                  const Weights* attention_weights = nullptr,
                  const Eigen::ThreadPoolDevice* device = nullptr) const;

  template <typename Q, typename K, typename V>
  Tensor3 operator()(const Q& queries, const K& keys, const V& values, const Mask* attention_mask = nullptr,
                     const Weights* attention_weights = nullptr,
                     const Eigen::ThreadPoolDevice* device = nullptr) const;

  // ---- Decoding with a key/value cache (defined in sdpa/module/decoding.hpp) ----

  // Projects keys with fc_k and values with fc_v ((cache.batch(), n, d_model) each) and appends them to the
  // cache, which grows as needed.
  template <typename K, typename V>
  void append(const K& keys, const V& values, KVCache<Scalar>& cache, const Eigen::ThreadPoolDevice* device = nullptr) const;

  // Projects the queries ((cache.batch(), nq, d_model)) with fc_q, attends them to the cache's entries with
  // every option of AttentionOptions (nk = cache.size(); the queries are the last nq positions, so `causal`
  // lets the last query see every key), applies fc_o. Returns (batch, nq, d_model), or writes it to `out`.
  template <typename Q>
  Tensor3 attend(const Q& queries, const KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options = {}) const;
  template <typename Q>
  void attend(const Q& queries, const KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options,
              Eigen::TensorMap<Tensor3> out) const;

  // append(x, x, cache) then attend(x, cache, options) with `causal` on (whatever options.causal says): feeding a sequence through
  // step in chunks of any sizes gives the rows of forward(x, x, x, {causal = true}). Every option is checked
  // before anything is appended (a refused step leaves the cache as it was). With window_left = w the cache
  // may drop the entries no later query can see. Once the cache has the capacity (and for chunks of up to
  // kernels::kFewRows (16) tokens, without a mask tensor), a step allocates nothing; the second form writes
  // into `out`.
  template <typename X>
  Tensor3 step(const X& x, KVCache<Scalar>& cache, AttentionOptions<Scalar> options = {}) const;
  template <typename X>
  void step(const X& x, KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options, Eigen::TensorMap<Tensor3> out) const;

  // A ragged batch of a PagedKVCache's sequences at once (continuous batching): x (n, t, d_model) holds t new
  // tokens of each of the n sequences sequence_ids[i] (distinct), which are appended to their sequences and
  // attend to them causally, each to its own entries only, as step on a KVCache of that sequence alone would
  // (the same bits, on the vector paths, for t <= kernels::kFewRows, 16). Every tensor-free option applies
  // (windows: whole blocks no later query can see are dropped); attention_mask, attention_weights,
  // attention_bias, key_lengths, probabilities and packed sequences are refused. A step whose new entries
  // need more blocks than the pool has free throws std::runtime_error; a refused step changes nothing.
  // Returns (n, t, d_model).
  template <typename X>
  Tensor3 step(const X& x, PagedKVCache<Scalar>& cache, const std::vector<std::int64_t>& sequence_ids,
               const AttentionOptions<Scalar>& options = {}) const;

  // Speculative decoding: x (batch, n, d_model) is a tree of n draft tokens for every sequence of the cache
  // (or of sequence_ids), token j under parents[j] (an earlier token, or -1: the sequence's last). Each
  // attends to the sequence's entries, its ancestors and itself, at position position() + depth - 1; all
  // are stored, pending until the cache's accept keeps a path. Returns (batch, n, d_model). The options of
  // a step except a score program and dropout; refused before anything changes (parents, options, pool).
  template <typename X>
  Tensor3 step_tree(const X& x, KVCache<Scalar>& cache, const std::vector<Index>& parents,
                    const AttentionOptions<Scalar>& options = {}) const;
  template <typename X>
  Tensor3 step_tree(const X& x, PagedKVCache<Scalar>& cache, const std::vector<std::int64_t>& sequence_ids,
                    const std::vector<Index>& parents, const AttentionOptions<Scalar>& options = {}) const;

  void train(bool on = true) noexcept { training_ = on; }
  void eval() noexcept { training_ = false; }
  bool is_training() const noexcept { return training_; }

  // Seeds this module's dropout and restarts its call counter; also the seed of later init_weights().
  void manual_seed(std::uint64_t seed) noexcept {
    seed_ = seed;
    calls_.store(0);
  }
  std::uint64_t seed() const noexcept { return seed_; }

  void set_masked_rows(MaskedRows policy) noexcept { masked_rows_ = policy; }
  MaskedRows masked_rows() const noexcept { return masked_rows_; }

  // Which attention kernel the calls run (options.hpp's Kernel): kAuto, kTiled (also for decoding steps),
  // kReference; the backward runs the tiled backward unless kReference.
  void set_kernel(Kernel kernel) noexcept { kernel_ = kernel; }
  Kernel kernel() const noexcept { return kernel_; }

  // The type forward's products run in (sdpa/compute.hpp): kFloat, or kBf16 (float modules only, with the
  // kAuto or kTiled kernel; a forward that keeps what backward needs refuses it): the four projections and
  // the attention core multiply bfloat16-rounded operands with float sums. The cached decoding steps stay
  // in float.
  void set_compute(Compute compute);
  Compute compute() const noexcept { return compute_; }

  // The rotary position embedding of the model's queries and keys (sdpa/rotary.hpp): every call rotates
  // its queries and keys at their positions (keys once, when a cache receives them). A cache filled
  // before set_rotary or clear_rotary holds keys rotated the old way. Refused (std::invalid_argument)
  // when it does not fit d_k.
  void set_rotary(const Rotary& rotary);
  void clear_rotary() noexcept { has_rotary_ = false; }
  const Rotary* rotary() const noexcept { return has_rotary_ ? &rotary_ : nullptr; }

  // QK-norm (sdpa/head_norm.hpp): the projected queries and keys RMS-normalised per head or over the whole
  // projection, before the rotary or (Llama 4) after it. Its weights are parameters ("q_norm.weight",
  // "k_norm.weight": trained by backward, saved and loaded). A cache filled before set_qk_norm holds keys
  // normalised the old way. Refused (std::invalid_argument) when the weights do not fit the heads.
  void set_qk_norm(QkNorm<Scalar> norm);
  void clear_qk_norm() noexcept { qk_norm_ = QkNorm<Scalar>(); }
  const QkNorm<Scalar>* qk_norm() const noexcept { return qk_norm_.kind == QkNormKind::kNone ? nullptr : &qk_norm_; }

  // Llama 4's attention temperature tuning: each query multiplied by temperature.factor(its absolute
  // position) after the rotary and the norm.
  void set_query_temperature(const QueryTemperature& temperature);
  void clear_query_temperature() noexcept { has_temperature_ = false; }
  const QueryTemperature* query_temperature() const noexcept { return has_temperature_ ? &temperature_ : nullptr; }

  // A gated output (Qwen3-Next): a fifth projection fc_g (d_model -> h * d_v, from the queries' input) whose
  // sigmoid multiplies the attention output, element by element, before fc_o. Turning it on makes fc_g
  // (drawn as the module's init draws layer 4, in the module's weight storage); off drops it.
  void set_output_gate(bool on);
  bool output_gate() const noexcept { return gated_; }

  Scalar dropout() const noexcept { return dropout_; }
  void set_dropout(Scalar p) { dropout_ = checked_dropout(p); }

  // forward keeps its scratch (the projected q/k/v and the attention output before fc_o, sized by the
  // call's shapes) from one call to the next, so that later calls do not pay the page faults of fresh
  // memory (detail/scratch_pool.hpp); scratch_bytes() is what is kept now, release_scratch() frees it.
  // Thread-safe: concurrent calls each take their own buffers.
  std::size_t scratch_bytes() const { return scratch_.bytes(); }
  void release_scratch() const { scratch_.clear(); }

  Index d_model() const noexcept { return d_model_; }
  Index d_k() const noexcept { return d_k_; }
  Index d_v() const noexcept { return d_v_; }
  Index h() const noexcept { return h_; }
  Index kv_heads() const noexcept { return kv_heads_; }

  LinearType& fc_q() noexcept { return fc_q_; }
  LinearType& fc_k() noexcept { return fc_k_; }
  LinearType& fc_v() noexcept { return fc_v_; }
  LinearType& fc_o() noexcept { return fc_o_; }
  const LinearType& fc_q() const noexcept { return fc_q_; }
  const LinearType& fc_k() const noexcept { return fc_k_; }
  const LinearType& fc_v() const noexcept { return fc_v_; }
  const LinearType& fc_o() const noexcept { return fc_o_; }
  // The output gate's projection (set_output_gate); a 1 x 1 placeholder when there is no gate.
  LinearType& fc_g() noexcept { return fc_g_; }
  const LinearType& fc_g() const noexcept { return fc_g_; }

  // The parameters in state_dict order, by their PyTorch names.
  // Scalar weights only: a module whose weights are stored narrower refuses (std::invalid_argument).
  std::vector<ParameterRef<Scalar>> named_parameters() {
    check_scalar_weights("ScaledDotProductAttention::named_parameters");
    return collect<Scalar>(*this);
  }
  std::vector<ParameterRef<const Scalar>> named_parameters() const {
    check_scalar_weights("ScaledDotProductAttention::named_parameters");
    return collect<const Scalar>(*this);
  }

  ParameterRef<Scalar> parameter(const std::string& name) { return find(named_parameters(), name); }
  ParameterRef<const Scalar> parameter(const std::string& name) const { return find(named_parameters(), name); }

  void swap(ScaledDotProductAttention& other) noexcept;

 private:
  using View = detail::InputView<Scalar>;

  static Index checked_size(const char* name, Index value);
  static Index checked_product(const char* name, Index a, Index b);
  static Index checked_kv_heads(Index kv_heads, Index h);
  template <typename Policy, typename Gen>
  static void init_layer(LinearType& layer, const Policy& policy, Gen& gen);
  void check_scalar_weights(const char* where) const;
  static Scalar checked_dropout(Scalar p);
  template <typename T, typename Self>
  static std::vector<ParameterRef<T>> collect(Self& self);
  template <typename T>
  static ParameterRef<T> find(std::vector<ParameterRef<T>> params, const std::string& name);

  void check_inputs(const View& q, const View& k, const View& v) const;

  // The projected q, k, v. Inputs that are the same tensor share one pass and one buffer whose rows
  // hold q | k | v side by side; the kernel reads each head in place through the row strides.
  struct Projected {
    detail::Buffer<Scalar> qkv, kv_only;
    Scalar *q = nullptr, *k = nullptr, *v = nullptr;
    Index ldq = 0, ldk = 0, ldv = 0;
  };

  // One pass of the forward's projections over rows of d_model_ inputs, in the module's compute type.
  void project_pass(const Scalar* x, Index rows, const std::vector<kernels::ProjectionTarget<Scalar>>& targets,
                    const Eigen::ThreadPoolDevice* device) const;

  // Keys a query can see per batch entry (key_lengths, or nullptr for all): keys past a length are hidden
  // from every query, so they are not projected (their rows of the buffer are zeroed instead).
  Projected project(const View& qv, const View& kv, const View& vv, const Eigen::ThreadPoolDevice* device,
                    const Index* key_lengths) const;

  // Rotates rows of projected queries (heads of h) or keys (kv_heads) in place, `n` rows per batch entry
  // (batch_stride apart, row stride ld), row i at position first + i, with the module's rotary if it has
  // one. inverse: the transpose, for gradients.
  void rotate(Scalar* x, Index batch, Index batch_stride, Index n, Index ld, Index heads, Index first,
              bool inverse = false) const;

  // Rotates projected queries (row stride ldq, at q' = q + nk - nq) and keys (ldk, at k) of batch entries of
  // nq and nk rows, or of the options' packed sequences each from its own positions.
  void rotate_projected(gemm::Matrix<Scalar> q, gemm::Matrix<Scalar> k, Index batch, Index nq, Index nk,
                        const AttentionOptions<Scalar>& options, bool inverse = false) const;

  // The caller's rotary positions (options.rotary_positions) for `rows` key rows of `batch` entries: their
  // count, and a rotary to turn them (where: the function called).
  void check_rotary_positions(const char* where, const AttentionOptions<Scalar>& options, Index batch, Index rows) const;

  // QK-norm of query (or key) rows: n rows per batch entry (batch_stride apart, row stride ld).
  void norm_rows(Scalar* x, Index batch, Index batch_stride, Index n, Index ld, bool query,
                 const Eigen::ThreadPoolDevice* device = nullptr) const;
  // Rows per task of the elementwise passes (norms, temperature, gate) on a device.
  static constexpr Index kElementwiseRows = 256;
  bool has_qk_norm() const noexcept { return qk_norm_.kind != QkNormKind::kNone; }

  // Everything between the projection and the scores for query (or key) rows laid out as rotate's, the
  // first at position `first`: norm, rotary, norm after it, temperature (head_norm.hpp's order).
  // positions: the caller's positions of these rows (batch entry b's at pos + b * n, streams `stride`
  // apart), or none (pos null) for first + i.
  struct Positions {
    const Index* pos = nullptr;
    Index stride = 0;
  };
  void transform(Scalar* x, Index batch, Index batch_stride, Index n, Index ld, bool query, Index first,
                 Positions positions = {}) const;

  // The temperature of a forward's queries (row stride ldq), at q' = q + nk - nq of each batch entry or
  // packed sequence.
  void temper_queries(Scalar* q, Index ldq, Index batch, Index nq, Index nk, const AttentionOptions<Scalar>& options) const;

  // transform for a forward's projected queries and keys (rotate_projected's layout and positions).
  void transform_projected(Scalar* q, Index ldq, Scalar* k, Index ldk, Index batch, Index nq, Index nk,
                           const AttentionOptions<Scalar>& options) const;

  // The gradients of transformed queries and keys (dq: rows of h * d_k, dk: rows of kv_heads * d_k) become
  // those of the projections' outputs; the QK-norm's weight gradients go to g.
  void transform_backward(Scalar* dq, Scalar* dk, const ForwardState<Scalar>& s, const AttentionOptions<Scalar>& options,
                          Gradients<Scalar>& g) const;

  // The output gate: projects the queries' input rows x (rows of d_model) by fc_g into gate (rows of h * d_v)
  // and takes its sigmoid there.
  void gate_values(const Scalar* x, Index rows, Scalar* gate, const Eigen::ThreadPoolDevice* device) const;

  // att (rows of h * d_v) times the output gate of x's rows, in place, before fc_o.
  void apply_gate(const Scalar* x, Index rows, Scalar* att, Scalar* gate, const Eigen::ThreadPoolDevice* device) const;

  // The shape of a call with nq queries against nk keys, for the core's checks (where: the function called).
  detail::CallShape call_shape(const char* where, Index batch, Index nq, Index nk) const noexcept;

  // In training mode with p > 0, this call's dropout: the module's next call index.
  void draw_dropout(kernels::AttentionProblem<Scalar>& p) const;

  Tensor3 forward_impl(const View& qv, const View& kv, const View& vv, const AttentionOptions<Scalar>& options,
                       ForwardState<Scalar>* capture = nullptr) const;

  // A fresh state for this call: the module, the shapes, copies of the distinct inputs and the options.
  void start_capture(ForwardState<Scalar>& s, const View& qv, const View& kv, const View& vv,
                     const AttentionOptions<Scalar>& options) const;

  // y = x W^T + b over `rows`: dW (out, in) = dY^T X, db = the column sums of dY, dX = dY W. Fixed blocks
  // of rows and of output features (not the thread count) decide each product's shape, so the result is
  // the same on any number of threads.
  void linear_backward(const LinearType& layer, const Scalar* dy, Index ldy, const Scalar* x, Index rows,
                       LinearGradients<Scalar>& g, Scalar* dx, const Eigen::ThreadPoolDevice* device) const;

  Gradients<Scalar> backward_impl(const Tensor3& grad_output, const ForwardState<Scalar>& s) const;
  // ---- decoding internals ----

  void check_cache(const KVCache<Scalar>& cache, const char* where) const;
  void check_decoding_input(const View& in, const char* name, Index batch, const char* where) const;
  static void check_output(const std::array<Index, 3>& want, const typename Tensor3::Dimensions& got, const char* where);

  // Entries before the cache's first held position were dropped: the options must not need them. The first
  // of nq queries (the last nq of `position` positions) sees keys from position - nq - window_left on.
  static void check_dropped(Index first, Index position, const AttentionOptions<Scalar>& o, Index nq, const char* where);

  // Projects keys (and values) into the cache after its held entries, and queries into q_out (batch, n,
  // h * d_k) when given (then kv is the step's input x, whose keys and values are itself). With a rotary the
  // new keys, and the queries, are rotated at their absolute positions position() .. position() + n - 1.
  void project_into_cache(const View& kv, const View& vv, KVCache<Scalar>& cache, const Eigen::ThreadPoolDevice* device,
                          Scalar* q_out, const Index* pos = nullptr) const;

  // project_into_cache for a cache that stores its entries narrower than Scalar: keys and values are
  // projected (and keys rotated) in Scalar into the cache's stage, rows of at most kStageRows tokens at a
  // time, then converted into place. Queries go to q_out as for any cache.
  void project_into_narrow_cache(const View& kv, const View& vv, bool kv_same, KVCache<Scalar>& cache,
                                 const Eigen::ThreadPoolDevice* device, Scalar* q_out, const Index* pos = nullptr) const;

  // A decoding step between the projections: projected (and rotated) queries q (batch, nq, h * d_k), the
  // module's input x (the output gate's), the attention's rows att (batch, nq, h * d_v; scratch) and fc_o's
  // output out.
  struct ProjectedStep {
    const Scalar* q = nullptr;
    Index nq = 0;
    const Scalar* x = nullptr;
    Scalar* att = nullptr;
    Scalar* out = nullptr;
  };
  // The attention of the step's queries to the cache's entries, then fc_o into its out.
  void attend_projected(const ProjectedStep& step, const KVCache<Scalar>& cache,
                        const AttentionOptions<Scalar>& options, bool causal,
                        kernels::DecodeWorkspace<Scalar>& workspace, const char* where) const;

  // Everything a call with nq queries against the nk entries of positions first .. position - 1 checks:
  // options, tensors' shapes, dropped entries.
  void check_decoding_options(const KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options, Index nq, Index nk,
                              Index position, const char* where) const;

  void attend_impl(const View& q, const KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options, Scalar* out,
                   const typename Tensor3::Dimensions& out_dims, const char* where) const;
  void step_impl(const View& x, KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options, Scalar* out,
                 const typename Tensor3::Dimensions& out_dims) const;

  // step on a PagedKVCache (see there).
  void paged_step_impl(const View& x, PagedKVCache<Scalar>& cache, const std::vector<std::int64_t>& ids,
                       const AttentionOptions<Scalar>& options, Scalar* out) const;
  // step_tree on either cache (ids null: the KVCache's batch).
  template <typename Cache>
  void tree_step_impl(const View& x, Cache& cache, const std::vector<std::int64_t>* ids,
                      const std::vector<Index>& parents, const AttentionOptions<Scalar>& options, Scalar* out) const;

  Index d_model_, d_k_, d_v_, h_, kv_heads_;
  Scalar dropout_;
  bool training_ = true;
  MaskedRows masked_rows_ = MaskedRows::kZero;
  Kernel kernel_ = Kernel::kAuto;
  Compute compute_ = Compute::kFloat;
  Rotary rotary_;
  bool has_rotary_ = false;
  QkNorm<Scalar> qk_norm_;
  QueryTemperature temperature_;
  bool has_temperature_ = false;
  bool gated_ = false;
  std::uint64_t seed_;
  mutable std::atomic<std::uint64_t> calls_{0};
  std::uint64_t id_;  // which module a ForwardState came from (copies get their own, moves keep it)
  LinearType fc_q_, fc_k_, fc_v_, fc_o_;
  LinearType fc_g_{1, 1};  // the output gate's projection when gated_
  mutable detail::ScratchPool<Scalar> scratch_;  // forward's buffers, kept between calls (scratch_pool.hpp)
};

SDPA_NAMESPACE_END

#include "sdpa/module/parameters.hpp"
#include "sdpa/module/forward.hpp"
#include "sdpa/module/training.hpp"
#include "sdpa/module/decoding.hpp"
