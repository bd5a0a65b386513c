// sdpa::ScaledDotProductAttention, the multi-head attention module of External-Attention-pytorch: four
// projections (fc_q, fc_k, fc_v, fc_o), heads split head-major, softmax(q k^T / sqrt(d_k) * weights,
// masked) with dropout, heads merged, fc_o; with grouped-query heads (kv_heads < h: fc_k and fc_v project
// to kv_heads heads) and a rotary position embedding when set. This header owns the parameters, the
// train/eval state and the checks of its own inputs; the attention core, its option checks and the kernel
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
#include "sdpa/kernels/backward.hpp"
#include "sdpa/kernels/bf16_projection.hpp"
#include "sdpa/kernels/decode.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/projection.hpp"
#include "sdpa/kernels/reference.hpp"
#include "sdpa/kernels/tiled.hpp"
#include "sdpa/linear.hpp"
#include "sdpa/mask.hpp"
#include "sdpa/options.hpp"
#include "sdpa/parameter.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/random.hpp"
#include "sdpa/rotary.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
class KVCache;  // sdpa/kv_cache.hpp
template <typename Scalar>
class PagedKVCache;  // sdpa/paged_kv_cache.hpp

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
  ScaledDotProductAttention(const ScaledDotProductAttention& other)
      : d_model_(other.d_model_), d_k_(other.d_k_), d_v_(other.d_v_), h_(other.h_), kv_heads_(other.kv_heads_),
        dropout_(other.dropout_), training_(other.training_), masked_rows_(other.masked_rows_), kernel_(other.kernel_),
        compute_(other.compute_), rotary_(other.rotary_), has_rotary_(other.has_rotary_), qk_norm_(other.qk_norm_),
        temperature_(other.temperature_), has_temperature_(other.has_temperature_), gated_(other.gated_),
        seed_(next_seed()), calls_(0), id_(detail::next_module_id()), fc_q_(other.fc_q_), fc_k_(other.fc_k_),
        fc_v_(other.fc_v_), fc_o_(other.fc_o_), fc_g_(other.fc_g_) {}
  ScaledDotProductAttention& operator=(const ScaledDotProductAttention& other) {
    if (this != &other) {
      ScaledDotProductAttention copy(other);
      swap(copy);
    }
    return *this;
  }
  // A move keeps the seed and the dropout call count: it is the same module in a new place. It draws
  // nothing from the process-wide sequence.
  ScaledDotProductAttention(ScaledDotProductAttention&& other) noexcept
      : d_model_(1), d_k_(1), d_v_(1), h_(1), kv_heads_(1), dropout_(0), seed_(0), id_(0),
        fc_q_(1, 1), fc_k_(1, 1), fc_v_(1, 1), fc_o_(1, 1), fc_g_(1, 1) {
    swap(other);
  }
  ScaledDotProductAttention& operator=(ScaledDotProductAttention&& other) noexcept {
    swap(other);
    return *this;
  }

  // The original's init: linear weights ~ N(0, 0.001), biases 0, drawn from a Philox generator keyed by
  // the module's seed (one stream per layer, so a layer's draw does not depend on the others).
  void init_weights() { init_weights(init::ExternalAttentionPolicy{}); }

  template <typename Policy>
  void init_weights(const Policy& policy) {
    LinearType* layers[5] = {&fc_q_, &fc_k_, &fc_v_, &fc_o_, &fc_g_};
    for (int i = 0; i < (gated_ ? 5 : 4); ++i) {
      Philox gen(seed_, static_cast<std::uint64_t>(i));
      init_layer(*layers[i], policy, gen);
    }
  }

  template <typename Policy, typename Gen>
  void init_weights(const Policy& policy, Gen& gen) {
    for (LinearType* layer : {&fc_q_, &fc_k_, &fc_v_, &fc_o_}) init_layer(*layer, policy, gen);
    if (gated_) init_layer(fc_g_, policy, gen);
  }

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
  Tensor3 forward(const Q& queries, const K& keys, const V& values, const AttentionOptions<Scalar>& options) const {
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

  template <typename Q, typename K, typename V>
  Tensor3 operator()(const Q& queries, const K& keys, const V& values, const AttentionOptions<Scalar>& options) const {
    return forward(queries, keys, values, options);
  }

  // ---- Training ----

  // The forward, keeping in `state` what backward needs (sdpa/forward_state.hpp: O(N) memory, never the
  // probabilities). The tensors the options point to (mask, weights, bias) and the device must outlive
  // the backward call; `probabilities` is filled as usual.
  template <typename Q, typename K, typename V>
  Tensor3 forward(const Q& queries, const K& keys, const V& values, const AttentionOptions<Scalar>& options,
                  ForwardState<Scalar>& state) const {
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
                  const Eigen::ThreadPoolDevice* device = nullptr) const {
    AttentionOptions<Scalar> options;
    options.attention_mask = attention_mask;
    options.attention_weights = attention_weights;
    options.device = device;
    return forward(queries, keys, values, options);
  }

  template <typename Q, typename K, typename V>
  Tensor3 operator()(const Q& queries, const K& keys, const V& values, const Mask* attention_mask = nullptr,
                     const Weights* attention_weights = nullptr,
                     const Eigen::ThreadPoolDevice* device = nullptr) const {
    return forward(queries, keys, values, attention_mask, attention_weights, device);
  }

  // ---- Decoding with a key/value cache (include sdpa/kv_cache.hpp) ----

  // Projects keys with fc_k and values with fc_v ((cache.batch(), n, d_model) each) and appends them to the
  // cache, which grows as needed.
  template <typename K, typename V>
  void append(const K& keys, const V& values, KVCache<Scalar>& cache, const Eigen::ThreadPoolDevice* device = nullptr) const {
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

  // Projects the queries ((cache.batch(), nq, d_model)) with fc_q, attends them to the cache's entries with
  // every option of AttentionOptions (nk = cache.size(); the queries are the last nq positions, so `causal`
  // lets the last query see every key), applies fc_o. Returns (batch, nq, d_model), or writes it to `out`.
  template <typename Q>
  Tensor3 attend(const Q& queries, const KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options = {}) const {
    SDPA_DETAIL_CHECK_INPUT(Q, Scalar);
    Tensor3 out;
    if constexpr (detail::is_valid_input<Q, Scalar>()) {
      const detail::InputView<Scalar> q(queries);
      out = Tensor3(q.dims()[0], q.dims()[1], d_model_);
      attend_impl(q, cache, options, out.data(), out.dimensions(), "ScaledDotProductAttention::attend");
    }
    return out;
  }
  template <typename Q>
  void attend(const Q& queries, const KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options,
              Eigen::TensorMap<Tensor3> out) const {
    SDPA_DETAIL_CHECK_INPUT(Q, Scalar);
    if constexpr (detail::is_valid_input<Q, Scalar>()) {
      const detail::InputView<Scalar> q(queries);
      attend_impl(q, cache, options, out.data(), out.dimensions(), "ScaledDotProductAttention::attend");
    }
  }

  // append(x, x, cache) then attend(x, cache, options) with `causal` on (whatever options.causal says): feeding a sequence through
  // step in chunks of any sizes gives the rows of forward(x, x, x, {causal = true}). Every option is checked
  // before anything is appended (a refused step leaves the cache as it was). With window_left = w the cache
  // may drop the entries no later query can see. Once the cache has the capacity (and for chunks of up to
  // 16 tokens, without a mask tensor), a step allocates nothing; the second form writes into `out`.
  template <typename X>
  Tensor3 step(const X& x, KVCache<Scalar>& cache, AttentionOptions<Scalar> options = {}) const {
    SDPA_DETAIL_CHECK_INPUT(X, Scalar);
    Tensor3 out;
    if constexpr (detail::is_valid_input<X, Scalar>()) {
      const detail::InputView<Scalar> in(x);
      out = Tensor3(in.dims()[0], in.dims()[1], d_model_);
      step_impl(in, cache, options, out.data(), out.dimensions());
    }
    return out;
  }
  template <typename X>
  void step(const X& x, KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options, Eigen::TensorMap<Tensor3> out) const {
    SDPA_DETAIL_CHECK_INPUT(X, Scalar);
    if constexpr (detail::is_valid_input<X, Scalar>()) {
      const detail::InputView<Scalar> in(x);
      step_impl(in, cache, options, out.data(), out.dimensions());
    }
  }

  // A ragged batch of a PagedKVCache's sequences at once (continuous batching): x (n, t, d_model) holds t new
  // tokens of each of the n sequences sequence_ids[i] (distinct), which are appended to their sequences and
  // attend to them causally, each to its own entries only, as step on a KVCache of that sequence alone would
  // (the same bits, on the vector paths, for t <= 16). Every tensor-free option applies (windows: whole blocks
  // no later query can see are dropped); attention_mask, attention_weights, attention_bias, key_lengths,
  // probabilities and packed sequences are refused. A step whose new entries need more blocks than the pool
  // has free throws std::runtime_error; a refused step changes nothing. Returns (n, t, d_model).
  template <typename X>
  Tensor3 step(const X& x, PagedKVCache<Scalar>& cache, const std::vector<std::int64_t>& sequence_ids,
               const AttentionOptions<Scalar>& options = {}) const {
    SDPA_DETAIL_CHECK_INPUT(X, Scalar);
    Tensor3 out;
    if constexpr (detail::is_valid_input<X, Scalar>()) {
      const detail::InputView<Scalar> in(x);
      out = Tensor3(in.dims()[0], in.dims()[1], d_model_);
      paged_step_impl(in, cache, sequence_ids, options, out.data());
    }
    return out;
  }

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
  void set_compute(Compute compute) {
    detail::check_compute<Scalar>("ScaledDotProductAttention::set_compute", compute, kernel_);
    compute_ = compute;
  }
  Compute compute() const noexcept { return compute_; }

  // The rotary position embedding of the model's queries and keys (sdpa/rotary.hpp): every call rotates
  // its queries and keys at their positions (keys once, when a cache receives them). A cache filled
  // before set_rotary or clear_rotary holds keys rotated the old way. Refused (std::invalid_argument)
  // when it does not fit d_k.
  void set_rotary(const Rotary& rotary) {
    detail::check_rotary("ScaledDotProductAttention::set_rotary", rotary, d_k_);
    rotary_ = rotary;
    has_rotary_ = true;
  }
  void clear_rotary() noexcept { has_rotary_ = false; }
  const Rotary* rotary() const noexcept { return has_rotary_ ? &rotary_ : nullptr; }

  // QK-norm (sdpa/head_norm.hpp): the projected queries and keys RMS-normalised per head or over the whole
  // projection, before the rotary or (Llama 4) after it. Its weights are parameters ("q_norm.weight",
  // "k_norm.weight": trained by backward, saved and loaded). A cache filled before set_qk_norm holds keys
  // normalised the old way. Refused (std::invalid_argument) when the weights do not fit the heads.
  void set_qk_norm(QkNorm<Scalar> norm) {
    detail::check_qk_norm("ScaledDotProductAttention::set_qk_norm", norm, h_, kv_heads_, d_k_);
    qk_norm_ = std::move(norm);
  }
  void clear_qk_norm() noexcept { qk_norm_ = QkNorm<Scalar>(); }
  const QkNorm<Scalar>* qk_norm() const noexcept { return qk_norm_.kind == QkNormKind::kNone ? nullptr : &qk_norm_; }

  // Llama 4's attention temperature tuning: each query multiplied by temperature.factor(its absolute
  // position) after the rotary and the norm.
  void set_query_temperature(const QueryTemperature& temperature) {
    detail::check_temperature("ScaledDotProductAttention::set_query_temperature", temperature);
    temperature_ = temperature;
    has_temperature_ = true;
  }
  void clear_query_temperature() noexcept { has_temperature_ = false; }
  const QueryTemperature* query_temperature() const noexcept { return has_temperature_ ? &temperature_ : nullptr; }

  // A gated output (Qwen3-Next): a fifth projection fc_g (d_model -> h * d_v, from the queries' input) whose
  // sigmoid multiplies the attention output, element by element, before fc_o. Turning it on makes fc_g
  // (drawn as the module's init draws layer 4, in the module's weight storage); off drops it.
  void set_output_gate(bool on) {
    if (on == gated_) return;
    gated_ = on;
    if (!on) {
      fc_g_ = LinearType(1, 1);
      return;
    }
    LinearType g(d_model_, h_ * d_v_);
    Philox gen(seed_, 4);
    init_layer(g, init::ExternalAttentionPolicy{}, gen);
    g.set_weight_storage(fc_q_.weight_storage());
    fc_g_ = std::move(g);
  }
  bool output_gate() const noexcept { return gated_; }

  Scalar dropout() const noexcept { return dropout_; }
  void set_dropout(Scalar p) { dropout_ = checked_dropout(p); }

  // forward keeps its scratch (the projected q/k/v and the attention output before fc_o, up to 160 MB for
  // the demo's shapes) from one call to the next, so that later calls do not pay the page faults of fresh
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

  void swap(ScaledDotProductAttention& other) noexcept {
    using std::swap;
    swap(d_model_, other.d_model_);
    swap(d_k_, other.d_k_);
    swap(d_v_, other.d_v_);
    swap(h_, other.h_);
    swap(kv_heads_, other.kv_heads_);
    swap(rotary_, other.rotary_);
    swap(has_rotary_, other.has_rotary_);
    swap(qk_norm_, other.qk_norm_);
    swap(temperature_, other.temperature_);
    swap(has_temperature_, other.has_temperature_);
    swap(gated_, other.gated_);
    swap(dropout_, other.dropout_);
    swap(training_, other.training_);
    swap(masked_rows_, other.masked_rows_);
    swap(kernel_, other.kernel_);
    swap(compute_, other.compute_);
    swap(seed_, other.seed_);
    swap(id_, other.id_);
    const std::uint64_t calls = calls_.load();
    calls_.store(other.calls_.load());
    other.calls_.store(calls);
    swap(fc_q_, other.fc_q_);
    swap(fc_k_, other.fc_k_);
    swap(fc_v_, other.fc_v_);
    swap(fc_o_, other.fc_o_);
    swap(fc_g_, other.fc_g_);
    scratch_.swap(other.scratch_);
  }

 private:
  using View = detail::InputView<Scalar>;

  static Index checked_size(const char* name, Index value) {
    if (value <= 0) detail::throw_invalid("ScaledDotProductAttention", name, "positive", value);
    return value;
  }

  static Index checked_product(const char* name, Index a, Index b) {
    if (a > 0 && b > 0 && a > std::numeric_limits<Index>::max() / b)
      detail::throw_invalid("ScaledDotProductAttention", name, "representable as Eigen::Index",
                            detail::concat(a, " * ", b));
    return a * b;
  }

  static Index checked_kv_heads(Index kv_heads, Index h) {
    if (kv_heads == 0) return h;
    if (kv_heads < 0 || kv_heads > h || h % kv_heads != 0)
      detail::throw_invalid("ScaledDotProductAttention", "kv_heads",
                            detail::concat("0 (as many as h) or a divisor of h = ", h), kv_heads);
    return kv_heads;
  }

  template <typename Policy, typename Gen>
  static void init_layer(LinearType& layer, const Policy& policy, Gen& gen) {
    if (layer.weight_storage() == native_storage<Scalar>()) return policy.linear(layer.weight(), layer.bias(), gen);
    typename LinearType::Weight w(layer.out_features(), layer.in_features());  // drawn in Scalar, then rounded
    policy.linear(w, layer.bias(), gen);
    layer.set_weight_values(w);
  }

  void check_scalar_weights(const char* where) const {
    if (weight_storage() != native_storage<Scalar>())
      detail::throw_invalid(where, "the module's weight storage",
                            detail::concat(storage_name(native_storage<Scalar>()),
                                           " (training and named_parameters need Scalar weights: "
                                           "set_weight_storage(", storage_name(native_storage<Scalar>()), ") first)"),
                            storage_name(weight_storage()));
  }

  static Scalar checked_dropout(Scalar p) {
    if (!(std::isfinite(p) && p >= Scalar(0) && p <= Scalar(1)))
      detail::throw_invalid("ScaledDotProductAttention", "dropout", "a finite probability in [0, 1]", p);
    return p;
  }

  template <typename T, typename Self>
  static std::vector<ParameterRef<T>> collect(Self& self) {
    std::vector<ParameterRef<T>> out;
    const char* names[4] = {"fc_q", "fc_k", "fc_v", "fc_o"};
    const std::array<decltype(&self.fc_q_), 4> layers{&self.fc_q_, &self.fc_k_, &self.fc_v_, &self.fc_o_};
    for (std::size_t i = 0; i < 4; ++i) {
      auto& layer = *layers[i];
      out.push_back({std::string(names[i]) + ".weight", layer.weight().data(),
                     {layer.weight().dimension(0), layer.weight().dimension(1)}});
      out.push_back({std::string(names[i]) + ".bias", layer.bias().data(), {layer.bias().dimension(0)}});
    }
    // The options' parameters, when the module has them: the gate's projection, the QK-norm's weights.
    if (self.gated_) {
      out.push_back({"fc_g.weight", self.fc_g_.weight().data(), {self.fc_g_.weight().dimension(0), self.fc_g_.weight().dimension(1)}});
      out.push_back({"fc_g.bias", self.fc_g_.bias().data(), {self.fc_g_.bias().dimension(0)}});
    }
    if (self.qk_norm_.kind != QkNormKind::kNone && !self.qk_norm_.q_weight.empty())
      out.push_back({"q_norm.weight", self.qk_norm_.q_weight.data(), {static_cast<Index>(self.qk_norm_.q_weight.size())}});
    if (self.qk_norm_.kind != QkNormKind::kNone && !self.qk_norm_.k_weight.empty())
      out.push_back({"k_norm.weight", self.qk_norm_.k_weight.data(), {static_cast<Index>(self.qk_norm_.k_weight.size())}});
    return out;
  }

  template <typename T>
  static ParameterRef<T> find(std::vector<ParameterRef<T>> params, const std::string& name) {
    std::string known;
    for (auto& p : params) {
      if (p.name == name) return p;
      known += (known.empty() ? "" : ", ") + p.name;
    }
    detail::throw_invalid("ScaledDotProductAttention::parameter", "name", detail::concat("one of ", known),
                          detail::concat('"', name, '"'));
  }

  void check_inputs(const View& q, const View& k, const View& v) const {
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

  // The projected q, k, v. Inputs that are the same tensor share one pass and one buffer whose rows
  // hold q | k | v side by side; the kernel reads each head in place through the row strides.
  struct Projected {
    detail::Buffer<Scalar> qkv, kv_only;
    Scalar *q = nullptr, *k = nullptr, *v = nullptr;
    Index ldq = 0, ldk = 0, ldv = 0;
  };

  // One pass of the forward's projections over rows of d_model_ inputs, in the module's compute type.
  void project_pass(const Scalar* x, Index rows, const std::vector<kernels::ProjectionTarget<Scalar>>& targets,
                    const Eigen::ThreadPoolDevice* device) const {
    if constexpr (std::is_same<Scalar, float>::value) {
      if (compute_ == Compute::kBf16) {
        kernels::project_rows_bf16(x, rows, d_model_, d_model_, targets.data(), targets.size(), device, active_bf16_path());
        return;
      }
    }
    kernels::project_rows<Scalar>(x, rows, d_model_, targets, device);
  }

  // Keys a query can see per batch entry (key_lengths, or nullptr for all): keys past a length are hidden
  // from every query, so they are not projected (their rows of the buffer are zeroed instead).
  Projected project(const View& qv, const View& kv, const View& vv, const Eigen::ThreadPoolDevice* device,
                    const Index* key_lengths) const {
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

  // Rotates rows of projected queries (heads of h) or keys (kv_heads) in place, `n` rows per batch entry
  // (batch_stride apart, row stride ld), row i at position first + i, with the module's rotary if it has
  // one. inverse: the transpose, for gradients.
  void rotate(Scalar* x, Index batch, Index batch_stride, Index n, Index ld, Index heads, Index first,
              bool inverse = false) const {
    if (!has_rotary_ || x == nullptr) return;
    for (Index b = 0; b < batch; ++b) apply_rotary(rotary_, x + b * batch_stride, n, ld, heads, d_k_, d_k_, first, inverse);
  }

  // Rotates projected queries (row stride ldq, at q' = q + nk - nq) and keys (ldk, at k) of batch entries of
  // nq and nk rows, or of the options' packed sequences each from its own positions.
  void rotate_projected(Scalar* q, Index ldq, Scalar* k, Index ldk, Index batch, Index nq, Index nk,
                        const AttentionOptions<Scalar>& options, bool inverse = false) const {
    if (!has_rotary_) return;
    if (!options.rotary_positions.empty()) {
      // The caller's positions: of the key rows, the queries taking their key row's.
      const Index* pos = options.rotary_positions.data();
      const Index rows_k = batch * nk;
      if (!options.packed()) {
        for (Index b = 0; b < batch; ++b) {
          if (k != nullptr) apply_rotary_at(rotary_, k + b * nk * ldk, nk, ldk, kv_heads_, d_k_, d_k_, pos + b * nk, rows_k, inverse);
          if (q != nullptr)
            apply_rotary_at(rotary_, q + b * nq * ldq, nq, ldq, h_, d_k_, d_k_, pos + b * nk + (nk - nq), rows_k, inverse);
        }
        return;
      }
      if (k != nullptr) apply_rotary_at(rotary_, k, nk, ldk, kv_heads_, d_k_, d_k_, pos, rows_k, inverse);
      const std::vector<Index>&cq = options.cu_seqlens_q, &ck = options.cu_seqlens_k;
      for (std::size_t i = 0; q != nullptr && i + 1 < cq.size(); ++i) {
        const Index n = cq[i + 1] - cq[i], first = ck[i + 1] - n;  // the sequence's last n key rows
        if (n > 0) apply_rotary_at(rotary_, q + cq[i] * ldq, n, ldq, h_, d_k_, d_k_, pos + first, rows_k, inverse);
      }
      return;
    }
    if (!options.packed()) {
      rotate(q, batch, nq * ldq, nq, ldq, h_, nk - nq, inverse);
      rotate(k, batch, nk * ldk, nk, ldk, kv_heads_, 0, inverse);
      return;
    }
    detail::rotate_rows(rotary_, kernels::Heads<Scalar>{q, 0, ldq, d_k_}, 1, nq, h_, d_k_, nk - nq, &options.cu_seqlens_q,
                        &options.cu_seqlens_k, inverse);
    detail::rotate_rows(rotary_, kernels::Heads<Scalar>{k, 0, ldk, d_k_}, 1, nk, kv_heads_, d_k_, Index{0},
                        &options.cu_seqlens_k, static_cast<const std::vector<Index>*>(nullptr), inverse);
  }

  // The caller's rotary positions (options.rotary_positions) for `rows` key rows of `batch` entries: their
  // count, and a rotary to turn them (where: the function called).
  void check_rotary_positions(const char* where, const AttentionOptions<Scalar>& options, Index batch, Index rows) const {
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

  // QK-norm of query (or key) rows: n rows per batch entry (batch_stride apart, row stride ld).
  void norm_rows(Scalar* x, Index batch, Index batch_stride, Index n, Index ld, bool query,
                 const Eigen::ThreadPoolDevice* device = nullptr) const {
    const bool per_head = qk_norm_.kind == QkNormKind::kHead;
    const Index heads = query ? h_ : kv_heads_;
    const std::vector<Scalar>& w = query ? qk_norm_.q_weight : qk_norm_.k_weight;
    for (Index b = 0; b < batch; ++b)
      parallel_for(device, n, kElementwiseRows, [&](Index r0, Index r1) {
        detail::rms_norm_rows(x + b * batch_stride + r0 * ld, r1 - r0, ld, per_head ? heads : 1, per_head ? d_k_ : heads * d_k_,
                              w.empty() ? nullptr : w.data(), qk_norm_.eps);
      });
  }
  // Rows per task of the elementwise passes (norms, temperature, gate) on a device.
  static constexpr Index kElementwiseRows = 256;
  bool has_qk_norm() const noexcept { return qk_norm_.kind != QkNormKind::kNone; }

  // Everything between the projection and the scores for query (or key) rows laid out as rotate's, the
  // first at position `first`: norm, rotary, norm after it, temperature (head_norm.hpp's order).
  // pos: the caller's positions of these rows (batch entry b's at pos + b * n, streams pos_stride apart), or
  // nullptr for first + i.
  void transform(Scalar* x, Index batch, Index batch_stride, Index n, Index ld, bool query, Index first,
                 const Index* pos = nullptr, Index pos_stride = 0) const {
    if (x == nullptr) return;
    if (has_qk_norm() && !qk_norm_.after_rotary) norm_rows(x, batch, batch_stride, n, ld, query);
    if (pos != nullptr && has_rotary_)
      for (Index b = 0; b < batch; ++b)
        apply_rotary_at(rotary_, x + b * batch_stride, n, ld, query ? h_ : kv_heads_, d_k_, d_k_, pos + b * n, pos_stride);
    else
      rotate(x, batch, batch_stride, n, ld, query ? h_ : kv_heads_, first);
    if (has_qk_norm() && qk_norm_.after_rotary) norm_rows(x, batch, batch_stride, n, ld, query);
    if (query && has_temperature_)
      for (Index b = 0; b < batch; ++b) detail::temper_rows(temperature_, x + b * batch_stride, n, ld, h_ * d_k_, first);
  }

  // The temperature of a forward's queries (row stride ldq), at q' = q + nk - nq of each batch entry or
  // packed sequence.
  void temper_queries(Scalar* q, Index ldq, Index batch, Index nq, Index nk, const AttentionOptions<Scalar>& options) const {
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

  // transform for a forward's projected queries and keys (rotate_projected's layout and positions).
  void transform_projected(Scalar* q, Index ldq, Scalar* k, Index ldk, Index batch, Index nq, Index nk,
                           const AttentionOptions<Scalar>& options) const {
    if (has_qk_norm() && !qk_norm_.after_rotary) {
      norm_rows(q, 1, 0, batch * nq, ldq, true, options.device);
      norm_rows(k, 1, 0, batch * nk, ldk, false, options.device);
    }
    rotate_projected(q, ldq, k, ldk, batch, nq, nk, options);
    if (has_qk_norm() && qk_norm_.after_rotary) {
      norm_rows(q, 1, 0, batch * nq, ldq, true, options.device);
      norm_rows(k, 1, 0, batch * nk, ldk, false, options.device);
    }
    temper_queries(q, ldq, batch, nq, nk, options);
  }

  // The gradients of transformed queries and keys (dq: rows of h * d_k, dk: rows of kv_heads * d_k) become
  // those of the projections' outputs; the QK-norm's weight gradients go to g.
  void transform_backward(Scalar* dq, Scalar* dk, const ForwardState<Scalar>& s, const AttentionOptions<Scalar>& options,
                          Gradients<Scalar>& g) const {
    const Index batch = s.batch_, nq = s.nq_, nk = s.nk_, hq = h_ * d_k_, kk = kv_heads_ * d_k_;
    temper_queries(dq, hq, batch, nq, nk, options);  // a diagonal scale: its own transpose
    if (!has_qk_norm()) {
      rotate_projected(dq, hq, dk, kk, batch, nq, nk, options, /*inverse=*/true);
      return;
    }
    const bool per_head = qk_norm_.kind == QkNormKind::kHead;
    std::vector<double> dwq(qk_norm_.q_weight.size(), 0.0), dwk(qk_norm_.k_weight.size(), 0.0);
    const auto norm_backward = [&](const Scalar* x, Scalar* d, Index rows, bool query) {
      const Index heads = query ? h_ : kv_heads_, ld = heads * d_k_;
      const std::vector<Scalar>& w = query ? qk_norm_.q_weight : qk_norm_.k_weight;
      std::vector<double>& dw = query ? dwq : dwk;
      detail::rms_norm_backward_rows(x, d, rows, ld, ld, per_head ? heads : 1, per_head ? d_k_ : ld,
                                     w.empty() ? nullptr : w.data(), qk_norm_.eps, dw.empty() ? nullptr : dw.data());
    };
    if (qk_norm_.after_rotary) {
      // The norm's input is the rotated projection.
      detail::Buffer<Scalar> rq(static_cast<std::size_t>(batch * nq * hq)), rk(static_cast<std::size_t>(batch * nk * kk));
      std::copy_n(s.pre_q_.data(), rq.size(), rq.data());
      std::copy_n(s.pre_k_.data(), rk.size(), rk.data());
      rotate_projected(rq.data(), hq, rk.data(), kk, batch, nq, nk, options);
      norm_backward(rq.data(), dq, batch * nq, true);
      norm_backward(rk.data(), dk, batch * nk, false);
      rotate_projected(dq, hq, dk, kk, batch, nq, nk, options, /*inverse=*/true);
    } else {
      rotate_projected(dq, hq, dk, kk, batch, nq, nk, options, /*inverse=*/true);
      norm_backward(s.pre_q_.data(), dq, batch * nq, true);
      norm_backward(s.pre_k_.data(), dk, batch * nk, false);
    }
    g.q_norm.assign(dwq.begin(), dwq.end());
    g.k_norm.assign(dwk.begin(), dwk.end());
  }

  // The output gate: projects the queries' input rows x (rows of d_model) by fc_g into gate (rows of h * d_v)
  // and takes its sigmoid there.
  void gate_values(const Scalar* x, Index rows, Scalar* gate, const Eigen::ThreadPoolDevice* device) const {
    const Index ha = h_ * d_v_;
    if (rows <= 16) {
      const kernels::ProjectionTarget<Scalar> t = fc_g_.target(gate, ha);
      kernels::project_few_rows<Scalar>(x, rows, d_model_, d_model_, &t, 1, device);
    } else {
      project_pass(x, rows, {fc_g_.target(gate, ha)}, device);
    }
    parallel_for(device, rows, kElementwiseRows, [&](Index r0, Index r1) {
      for (Index i = r0 * ha; i < r1 * ha; ++i) gate[i] = Scalar(1) / (Scalar(1) + std::exp(-gate[i]));
    });
  }

  // att (rows of h * d_v) times the output gate of x's rows, in place, before fc_o.
  void apply_gate(const Scalar* x, Index rows, Scalar* att, Scalar* gate, const Eigen::ThreadPoolDevice* device) const {
    if (!gated_) return;
    gate_values(x, rows, gate, device);
    for (Index i = 0; i < rows * h_ * d_v_; ++i) att[i] *= gate[i];
  }

  // The shape of a call with nq queries against nk keys, for the core's checks (where: the function called).
  detail::CallShape call_shape(const char* where, Index batch, Index nq, Index nk) const noexcept {
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

  // In training mode with p > 0, this call's dropout: the module's next call index.
  void draw_dropout(kernels::AttentionProblem<Scalar>& p) const {
    if (!(training_ && dropout_ > Scalar(0))) return;
    p.dropout = true;
    p.sampler = DropoutSampler(seed_, calls_.fetch_add(1), static_cast<double>(dropout_));
    p.keep_scale = dropout_ >= Scalar(1) ? Scalar(0) : Scalar(1) / (Scalar(1) - dropout_);
  }

  Tensor3 forward_impl(const View& qv, const View& kv, const View& vv, const AttentionOptions<Scalar>& options,
                       ForwardState<Scalar>* capture = nullptr) const {
    check_inputs(qv, kv, vv);
    const Index batch = qv.dims()[0], nq = qv.dims()[1], nk = kv.dims()[1];
    const detail::CallShape shape = call_shape("ScaledDotProductAttention::forward", batch, nq, nk);
    detail::check_attention_options(shape, options, /*module_call=*/true);
    check_rotary_positions(shape.where, options, batch, nk);
    detail::check_compute<Scalar>(shape.where, compute_, kernel_);
    const Eigen::ThreadPoolDevice* device = options.device;

    // Checked: from here on nothing throws but an allocation failure.
    if (options.probabilities != nullptr) options.probabilities->resize(batch, h_, nq, nk);
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
      capture->lse_.resize(static_cast<std::size_t>(batch * h_ * nq));
      p.lse = capture->lse_.data();
      capture->dropout_ = p.dropout;
      capture->sampler_ = p.sampler;
      capture->keep_scale_ = p.keep_scale;
      capture->compute_ = compute_;
    }
    if (options.packed())
      detail::run_packed(p, options.cu_seqlens_q, options.cu_seqlens_k, kernel_, device);
    else
      detail::run_attention(p, kernel_, static_cast<kernels::DecodeWorkspace<Scalar>*>(nullptr), device);

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

  // A fresh state for this call: the module, the shapes, copies of the distinct inputs and the options.
  void start_capture(ForwardState<Scalar>& s, const View& qv, const View& kv, const View& vv,
                     const AttentionOptions<Scalar>& options) const {
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
    s.options_ = options;
    s.options_.probabilities = nullptr;
  }

  // y = x W^T + b over `rows`: dW (out, in) = dY^T X, db = the column sums of dY, dX = dY W. Fixed blocks
  // of rows and of output features (not the thread count) decide each product's shape, so the result is
  // the same on any number of threads.
  void linear_backward(const LinearType& layer, const Scalar* dy, Index ldy, const Scalar* x, Index rows,
                       LinearGradients<Scalar>& g, Scalar* dx, const Eigen::ThreadPoolDevice* device) const {
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

  Gradients<Scalar> backward_impl(const Tensor3& grad_output, const ForwardState<Scalar>& s) const {
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
    const AttentionOptions<Scalar>& options = s.options_;
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
    p.lse = const_cast<Scalar*>(s.lse_.data());
    p.dropout = s.dropout_;
    p.sampler = s.sampler_;
    p.keep_scale = s.keep_scale_;
    // kBf16: the products read the transformed q, k, v and d att rounded to bfloat16 (the kernel rounds P
    // and dS per tile), as sdpa::attention_backward does; the projections' gradients stay float products.
    detail::Buffer<Scalar> q_bf16, k_bf16, v_bf16, d_att_bf16;
    Scalar* d_att_read = d_att.data();
    if (s.compute_ == Compute::kBf16) {
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

  // ---- decoding internals ----

  void check_cache(const KVCache<Scalar>& cache, const char* where) const {
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

  void check_decoding_input(const View& in, const char* name, Index batch, const char* where) const {
    if (in.dims()[2] != d_model_)
      detail::throw_invalid(where, detail::concat(name, " dimension 2 (d_model)"), d_model_,
                            detail::concat(in.dims()[2], " (", name, " shape ", detail::shape_string(in.dims()), ")"));
    if (in.dims()[0] != batch)
      detail::throw_invalid(where, detail::concat(name, " dimension 0 (batch)"), detail::concat(batch, ", the cache's batch"),
                            detail::concat(in.dims()[0], " (", name, " shape ", detail::shape_string(in.dims()), ")"));
    if (in.data() == nullptr && in.dims()[0] * in.dims()[1] * in.dims()[2] != 0)
      detail::throw_invalid(where, name, "a tensor with data", "a null pointer");
  }

  static void check_output(const std::array<Index, 3>& want, const typename Tensor3::Dimensions& got, const char* where) {
    if (got[0] != want[0] || got[1] != want[1] || got[2] != want[2])
      detail::throw_invalid(where, "out", detail::concat("of shape ", detail::shape_string(want)),
                            detail::concat("of shape ", detail::shape_string(got)));
  }

  // Entries before the cache's first held position were dropped: the options must not need them. The first
  // of nq queries (the last nq of `position` positions) sees keys from position - nq - window_left on.
  static void check_dropped(Index first, Index position, const AttentionOptions<Scalar>& o, Index nq, const char* where) {
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

  // Projects keys (and values) into the cache after its held entries, and queries into q_out (batch, n,
  // h * d_k) when given (then kv is the step's input x, whose keys and values are itself). With a rotary the
  // new keys, and the queries, are rotated at their absolute positions position() .. position() + n - 1.
  void project_into_cache(const View& kv, const View& vv, KVCache<Scalar>& cache, const Eigen::ThreadPoolDevice* device,
                          Scalar* q_out, const Index* pos = nullptr) const {
    using Target = kernels::ProjectionTarget<Scalar>;
    const Index batch = cache.batch(), n = kv.dims()[1], hq = h_ * d_k_, hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
    const Index at = cache.size_;
    const bool kv_same = kv.data() == vv.data() && kv.dims() == vv.dims();
    auto target = [](const LinearType& layer, Scalar* y, Index ldy, Index group_rows, Index group_stride) {
      Target t = layer.target(y, ldy);
      t.group_rows = group_rows;
      t.group_stride = group_stride;
      return t;
    };
    if (batch * n == 0) {
      cache.size_ += n;
      cache.position_ += n;
      return;
    }
    if (cache.narrow()) {
      project_into_narrow_cache(kv, vv, kv_same, cache, device, q_out, pos);
      cache.size_ += n;
      cache.position_ += n;
      return;
    }
    if (batch * n <= 16) {
      // A decoding step: every weight row read once for all rows; the rows of batch entry b go to the
      // cache's entries of b (group stride: one sequence's capacity).
      Target targets[3];
      std::size_t count = 0;
      if (q_out != nullptr) targets[count++] = target(fc_q_, q_out, hq, 0, 0);
      targets[count++] = target(fc_k_, cache.key_rows(0) + at * hk, hk, n, cache.capacity_ * hk);
      if (kv_same) targets[count++] = target(fc_v_, cache.value_rows(0) + at * hv, hv, n, cache.capacity_ * hv);
      kernels::project_few_rows<Scalar>(kv.data(), batch * n, d_model_, d_model_, targets, count, device);
      if (!kv_same) {
        const Target tv = target(fc_v_, cache.value_rows(0) + at * hv, hv, n, cache.capacity_ * hv);
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
    transform(cache.key_rows(0) + at * hk, batch, cache.capacity_ * hk, n, hk, false, cache.position_, pos, batch * n);
    transform(q_out, batch, n * hq, n, hq, true, cache.position_, pos, batch * n);
    cache.size_ += n;
    cache.position_ += n;
  }

  // project_into_cache for a cache that stores its entries narrower than Scalar: keys and values are
  // projected (and keys rotated) in Scalar into the cache's stage, rows of at most kStageRows tokens at a
  // time, then converted into place. Queries go to q_out as for any cache.
  void project_into_narrow_cache(const View& kv, const View& vv, bool kv_same, KVCache<Scalar>& cache,
                                 const Eigen::ThreadPoolDevice* device, Scalar* q_out, const Index* pos = nullptr) const {
    using Target = kernels::ProjectionTarget<Scalar>;
    constexpr Index kStageRows = 256;
    const Index batch = cache.batch(), n = kv.dims()[1], hq = h_ * d_k_, hk = kv_heads_ * d_k_, hv = kv_heads_ * d_v_;
    const Index at = cache.size_;
    auto target = [](const LinearType& layer, Scalar* y, Index ldy) { return layer.target(y, ldy); };
    if (batch * n <= 16) {
      // A decoding step: every weight row read once for all rows of the batch.
      Scalar* sk = cache.scratch(cache.stage_, batch * n * (hk + hv));
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
      transform(sk, batch, n * hk, n, hk, false, cache.position_, pos, batch * n);
      transform(q_out, batch, n * hq, n, hq, true, cache.position_, pos, batch * n);
      for (Index b = 0; b < batch; ++b) {
        cache.put_rows(false, b, at, sk + b * n * hk, hk, n);
        cache.put_rows(true, b, at, sv + b * n * hv, hv, n);
      }
      return;
    }
    const Index rows = std::min(n, kStageRows);
    Scalar* sk = cache.scratch(cache.stage_, rows * (hk + hv));
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
        transform(sk, 1, 0, m, hk, false, cache.position_ + r0, pos == nullptr ? nullptr : pos + b * n + r0, batch * n);
        cache.put_rows(false, b, at + r0, sk, hk, m);
        cache.put_rows(true, b, at + r0, sv, hv, m);
      }
    }
    transform(q_out, batch, n * hq, n, hq, true, cache.position_, pos, batch * n);
  }

  // The attention of projected (and rotated) queries q (batch, nq, h * d_k) to the cache's entries, then
  // fc_o into out.
  void attend_projected(const Scalar* q, Index nq, const KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options,
                        bool causal, Scalar* att, kernels::DecodeWorkspace<Scalar>& workspace, Scalar* out,
                        const char* where, const Scalar* x) const {
    const Index batch = cache.batch(), nk = cache.size(), hq = h_ * d_k_, hv = h_ * d_v_;
    const Index hk = kv_heads_ * d_k_, kv = kv_heads_ * d_v_;
    kernels::AttentionProblem<Scalar> p =
        detail::problem_of(call_shape(where, batch, nq, nk), options, masked_rows_, causal, nk - nq);
    p.key_base = cache.first_position();  // a score program's positions are absolute
    p.q = {q, nq * hq, hq, d_k_};
    if (cache.narrow()) {
      // Entries stored narrower than Scalar: the kernels widen them a block at a time.
      p.k = {nullptr, cache.capacity() * hk, hk, d_k_};
      p.v = {nullptr, cache.capacity() * kv, kv, d_v_};
      p.kv_storage = cache.storage();
      p.k_stored = cache.stored_keys(0);
      p.v_stored = cache.stored_values(0);
      p.k_scales = cache.stored_key_scales(0);
      p.v_scales = cache.stored_value_scales(0);
      p.scale_batch_stride = cache.capacity() * kv_heads_;
    } else {
      p.k = {cache.key_rows(0), cache.capacity() * hk, hk, d_k_};
      p.v = {cache.value_rows(0), cache.capacity() * kv, kv, d_v_};
    }
    p.out = {att, nq * hv, hv, d_v_};
    draw_dropout(p);
    detail::run_attention(p, kernel_, &workspace, options.device);
    apply_gate(x, batch * nq, att, att + batch * nq * hv, options.device);
    if (batch * nq <= 16) {
      const kernels::ProjectionTarget<Scalar> to = fc_o_.target(out, d_model_);
      kernels::project_few_rows<Scalar>(att, batch * nq, hv, hv, &to, 1, options.device);
    } else {
      fc_o_.forward_rows(att, batch * nq, hv, out, d_model_, options.device);
    }
  }

  // Everything a call with nq queries against the nk entries of positions first .. position - 1 checks:
  // options, tensors' shapes, dropped entries.
  void check_decoding_options(const KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options, Index nq, Index nk,
                              Index position, const char* where) const {
    if (options.packed())
      detail::throw_invalid(where, "cu_seqlens_q / cu_seqlens_k",
                            "empty for a KVCache (its batch entries are the sequences; a PagedKVCache holds ragged ones)", "set");
    detail::check_attention_options(call_shape(where, cache.batch(), nq, nk), options, /*module_call=*/true);
    check_dropped(position - nk, position, options, nq, where);
  }

  void attend_impl(const View& q, const KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options, Scalar* out,
                   const typename Tensor3::Dimensions& out_dims, const char* where) const {
    check_cache(cache, where);
    check_decoding_input(q, "queries", cache.batch(), where);
    const Index batch = cache.batch(), nq = q.dims()[1], hq = h_ * d_k_;
    check_output({batch, nq, d_model_}, out_dims, where);
    check_decoding_options(cache, options, nq, cache.size(), cache.position(), where);
    if (!options.rotary_positions.empty())
      detail::throw_invalid(where, "rotary_positions", "empty for attend (step takes them with the tokens it appends)", "given");
    if (options.probabilities != nullptr) options.probabilities->resize(batch, h_, nq, cache.size());
    if (batch * nq == 0) return;
    detail::Buffer<Scalar> qbuf(static_cast<std::size_t>(batch * nq * hq));
    kernels::project_rows<Scalar>(q.data(), batch * nq, d_model_,
                                  {fc_q_.target(qbuf.data(), hq)}, options.device);
    // The queries are the last nq positions.
    transform(qbuf.data(), batch, nq * hq, nq, hq, true, cache.position() - nq);
    detail::Buffer<Scalar> att(static_cast<std::size_t>(batch * nq * h_ * d_v_ * (gated_ ? 2 : 1)));
    kernels::DecodeWorkspace<Scalar> workspace;
    attend_projected(qbuf.data(), nq, cache, options, options.causal, att.data(), workspace, out, where, q.data());
  }

  void step_impl(const View& x, KVCache<Scalar>& cache, const AttentionOptions<Scalar>& options, Scalar* out,
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
    if (n == 0 || batch == 0) return;
    cache.make_room(n);
    Scalar* q = cache.scratch(cache.q_scratch_, batch * n * h_ * d_k_);
    Scalar* att = cache.scratch(cache.att_scratch_, batch * n * h_ * d_v_ * (gated_ ? 2 : 1));  // and the gate's
    project_into_cache(x, x, cache, options.device, q, options.rotary_positions.empty() ? nullptr : options.rotary_positions.data());
    attend_projected(q, n, cache, options, /*causal=*/true, att, cache.decode_, out, where, x.data());
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

  // step on a PagedKVCache (see there).
  void paged_step_impl(const View& x, PagedKVCache<Scalar>& cache, const std::vector<std::int64_t>& ids,
                       const AttentionOptions<Scalar>& options, Scalar* out) const {
    using Target = kernels::ProjectionTarget<Scalar>;
    const char* where = "ScaledDotProductAttention::step (PagedKVCache)";
    if (cache.d_model() != d_model_ || cache.kv_heads() != kv_heads_ || cache.d_k() != d_k_ || cache.d_v() != d_v_)
      detail::throw_invalid(where, "cache",
                            detail::concat("a cache for d_model ", d_model_, ", kv_heads ", kv_heads_, ", d_k ", d_k_, ", d_v ", d_v_),
                            detail::concat("one for d_model ", cache.d_model(), ", kv_heads ", cache.kv_heads(), ", d_k ",
                                           cache.d_k(), ", d_v ", cache.d_v()));
    if (is_narrow<Scalar>(cache.storage()) && kernel_ == Kernel::kReference)
      detail::throw_invalid(where, "the module's kernel (set_kernel)",
                            detail::concat("kAuto or kTiled for a cache stored as ", storage_name(cache.storage())), "kReference");
    const Index n_seq = static_cast<Index>(ids.size());
    check_decoding_input(x, "x", n_seq, where);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (!cache.contains(ids[i]))
        detail::throw_invalid(where, detail::concat("sequence_ids[", i, "]"), "the id of a sequence of the cache", ids[i]);
      for (std::size_t j = 0; j < i; ++j)
        if (ids[j] == ids[i])
          detail::throw_invalid(where, detail::concat("sequence_ids[", i, "]"), detail::concat("distinct from sequence_ids[", j, "]"),
                                ids[i]);
    }
    const char* unsupported = options.attention_mask != nullptr      ? "attention_mask"
                              : options.attention_weights != nullptr ? "attention_weights"
                              : options.attention_bias != nullptr    ? "attention_bias"
                              : !options.key_lengths.empty()         ? "key_lengths"
                              : options.probabilities != nullptr     ? "probabilities"
                              : options.packed()                     ? "cu_seqlens_q / cu_seqlens_k"
                              : !options.rotary_positions.empty()    ? "rotary_positions"
                                                                     : nullptr;
    if (unsupported != nullptr)
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

    // Queries, keys and values of every new token: few-row projections (each weight row read once for all
    // rows, and the bits a single sequence's step gets) for up to 16 tokens per sequence.
    const Index rows = n_seq * t;
    Scalar* q = cache.q_scratch_.reset_at_least(static_cast<std::size_t>(rows * hq));
    Scalar* sk = cache.stage_.reset_at_least(static_cast<std::size_t>(rows * (hk + hv)));
    Scalar* sv = sk + rows * hk;
    const Target targets[3] = {fc_q_.target(q, hq), fc_k_.target(sk, hk), fc_v_.target(sv, hv)};
    if (t <= 16)
      kernels::project_few_rows<Scalar>(x.data(), rows, d_model_, d_model_, targets, 3, options.device);
    else
      kernels::project_rows<Scalar>(x.data(), rows, d_model_, d_model_, targets, 3, options.device);
    // Each sequence's new rows at its own positions, then into its blocks.
    std::vector<const Index*> tables(static_cast<std::size_t>(n_seq));
    std::vector<Index> lengths(static_cast<std::size_t>(n_seq)), offsets(static_cast<std::size_t>(n_seq)),
        bases(static_cast<std::size_t>(n_seq));
    for (Index i = 0; i < n_seq; ++i) {
      typename PagedKVCache<Scalar>::Sequence& s = cache.find(where, ids[static_cast<std::size_t>(i)]);
      transform(sk + i * t * hk, 1, 0, t, hk, false, s.position);
      transform(q + i * t * hq, 1, 0, t, hq, true, s.position);
      cache.put_rows(s, false, s.size, sk + i * t * hk, hk, t);
      cache.put_rows(s, true, s.size, sv + i * t * hv, hv, t);
      s.size += t;
      s.position += t;
      tables[static_cast<std::size_t>(i)] = s.blocks.data();
      lengths[static_cast<std::size_t>(i)] = s.size;
      offsets[static_cast<std::size_t>(i)] = s.size - t;
      bases[static_cast<std::size_t>(i)] = s.position - s.size;  // a score program's positions are absolute
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
    if (is_narrow<Scalar>(cache.storage())) {
      p.k = {nullptr, 0, hk, d_k_};
      p.v = {nullptr, 0, hv, d_v_};
      p.kv_storage = cache.storage();
      p.k_stored = cache.keys_.data();
      p.v_stored = cache.values_.data();
      p.k_scales = cache.storage() == Storage::kInt8 ? cache.key_scales_.data() : nullptr;
      p.v_scales = cache.storage() == Storage::kInt8 ? cache.value_scales_.data() : nullptr;
      p.scale_batch_stride = 0;
    } else {
      p.k = {reinterpret_cast<const Scalar*>(cache.keys_.data()), 0, hk, d_k_};
      p.v = {reinterpret_cast<const Scalar*>(cache.values_.data()), 0, hv, d_v_};
    }
    Scalar* att = cache.att_scratch_.reset_at_least(static_cast<std::size_t>(rows * ha * (gated_ ? 2 : 1)));
    p.out = {att, t * ha, ha, d_v_};
    draw_dropout(p);
    detail::run_attention(p, kernel_, &cache.decode_, options.device);
    apply_gate(x.data(), rows, att, att + rows * ha, options.device);
    if (t <= 16) {
      const kernels::ProjectionTarget<Scalar> to = fc_o_.target(out, d_model_);
      kernels::project_few_rows<Scalar>(att, rows, ha, ha, &to, 1, options.device);
    } else {
      fc_o_.forward_rows(att, rows, ha, out, d_model_, options.device);
    }
    if (options.window_left >= 0)
      for (std::int64_t id : ids) cache.drop_before(cache.find(where, id), options.window_left);
  }

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
