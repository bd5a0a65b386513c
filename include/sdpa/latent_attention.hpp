// sdpa::LatentAttention: DeepSeek's multi-head latent attention (MLA: DeepSeek V2 / V3 / R1, Kimi K2), and
// sdpa::LatentCache, the cache of its latents.
//
// Per token x (d_model):
//   queries   q = q_proj(x), or q_b_proj(rmsnorm(q_a_proj(x)) * q_a_norm) with q_lora_rank > 0;
//             per head [q_nope (nope) | q_rope (rope)], q_rope rotated at the token's position
//   latent    [c | k_rope] = kv_a_proj(x); c = rmsnorm(c) * kv_a_norm (kv_lora values), k_rope rotated: one
//             rotary key head shared by every head
//   expanded  kv_b_proj(c) per head [k_nope (nope) | v (v_dim)]; key = [k_nope | k_rope]
//   output    o_proj(softmax(scale * q . key) v), scale 1 / sqrt(nope + rope) unless set (YaRN's mscale)
// The cache holds [c | k_rope] per token: kv_lora + rope values, not heads * (nope + rope + v_dim).
//
// Two forms compute the same attention. The expanded one (forward, backward, a step of more than
// kLatentAbsorbRows tokens) builds every head's keys and values and runs sdpa::attention. The absorbed one (a
// decoding step) folds kv_b_proj's key rows into the query (q_lat = W_UK^T q_nope) and its value rows into the
// output (W_UV out_lat): multi-query attention with d_k = kv_lora + rope and d_v = kv_lora straight over the
// cache's rows, on the same kernels as every other call, in any storage the cache holds.
//
// Rotary: the module's (set_rotary; its dim 0 means all of rope), interleaved pairs as DeepSeek's checkpoints
// store them (transformers' rope_interleave). RMS norms in Scalar with sums in double, eps 1e-6 (transformers'
// DeepseekV3RMSNorm default, whatever the config's rms_norm_eps).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <cstdint>
#include <string>
#include <vector>

#include "sdpa/attention.hpp"
#include "sdpa/error.hpp"
#include "sdpa/gradients.hpp"
#include "sdpa/head_norm.hpp"
#include "sdpa/init.hpp"
#include "sdpa/kernels/decode.hpp"
#include "sdpa/kernels/tiled.hpp"
#include "sdpa/linear.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/parameter.hpp"
#include "sdpa/random.hpp"
#include "sdpa/rotary.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN

// The shape of a latent attention block (transformers' DeepseekV3Config names).
struct LatentConfig {
  Eigen::Index d_model = 0;          // hidden_size
  Eigen::Index heads = 0;            // num_attention_heads
  Eigen::Index q_lora_rank = 0;      // 0: q_proj; else q_a_proj -> q_a_norm -> q_b_proj
  Eigen::Index kv_lora_rank = 0;
  Eigen::Index qk_nope_head_dim = 0;
  Eigen::Index qk_rope_head_dim = 0;
  Eigen::Index v_head_dim = 0;
  bool bias = false;                 // attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj biases
  double norm_eps = 1e-6;
};

namespace detail {
// A process-wide id per LatentAttention, so that backward can tell its own states.
inline std::uint64_t next_latent_id() noexcept {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}
}  // namespace detail

// A step of at most this many tokens per sequence runs the absorbed form; longer ones (a prompt) the
// expanded one.
constexpr Eigen::Index kLatentAbsorbRows = 16;
// The key blocks of the absorbed form's tiled products (heads as the rows of one product).
constexpr Eigen::Index kLatentBlockK = 128;

template <typename Scalar>
class LatentAttention;

// The latents of a batch of sequences: per token kv_lora + rope values, stored as `storage` (Scalar, or for a
// float cache bf16, f16 or int8 with one scale per token), rotated at their absolute positions.
template <typename Scalar>
class LatentCache {
 public:
  using Index = Eigen::Index;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;

  LatentCache(const LatentAttention<Scalar>& module, Index batch, Index capacity = 0, Storage storage = native_storage<Scalar>());

  Index batch() const noexcept { return batch_; }
  Index size() const noexcept { return size_; }
  Index capacity() const noexcept { return capacity_; }
  Index position() const noexcept { return size_; }
  Index width() const noexcept { return width_; }  // kv_lora + rope
  Index kv_lora_rank() const noexcept { return kv_lora_; }
  Storage storage() const noexcept { return storage_; }
  // The bytes the held latents take (rows and int8 scales).
  std::size_t bytes() const noexcept {
    return static_cast<std::size_t>(batch_ * size_ * width_) * storage_bytes(storage_) +
           (storage_ == Storage::kInt8 ? static_cast<std::size_t>(batch_ * size_) * sizeof(float) : 0);
  }
  void clear() noexcept { size_ = 0; }
  // Appends latents (batch, n, kv_lora + rope) as a step would have made them (c normalised, k_rope rotated
  // at their positions): a cache restored or shared. Refused (std::invalid_argument) when the shape differs.
  void append(const Tensor3& latents) {
    if (latents.dimension(0) != batch_ || latents.dimension(2) != width_)
      detail::throw_invalid("LatentCache::append", "latents", detail::concat("of shape (", batch_, ", n, ", width_, ")"),
                            detail::concat("of shape ", detail::shape_string(latents.dimensions())));
    const Index n = latents.dimension(1);
    make_room(n);
    for (Index b = 0; b < batch_; ++b) put_rows(b, size_, latents.data() + b * n * width_, width_, n);
    size_ += n;
  }
  // The held latents as Scalar: (batch, size, kv_lora + rope), c then the rotated k_rope.
  Tensor3 held() const {
    Tensor3 out(batch_, size_, width_);
    for (Index b = 0; b < batch_; ++b)
      detail::load_rows(storage_, rows_.data() + static_cast<std::size_t>(b * capacity_ * width_) * storage_bytes(storage_), size_, 1,
                        width_, storage_ == Storage::kInt8 ? scales_.data() + b * capacity_ : nullptr, out.data() + b * size_ * width_);
    return out;
  }

 private:
  friend class LatentAttention<Scalar>;

  void reserve(Index capacity) {
    if (capacity <= capacity_) return;
    const std::size_t bytes = storage_bytes(storage_);
    std::vector<unsigned char> rows(static_cast<std::size_t>(batch_ * capacity * width_) * bytes);
    std::vector<float> scales(storage_ == Storage::kInt8 ? static_cast<std::size_t>(batch_ * capacity) : 0);
    for (Index b = 0; b < batch_; ++b) {
      std::copy_n(rows_.data() + static_cast<std::size_t>(b * capacity_ * width_) * bytes, static_cast<std::size_t>(size_ * width_) * bytes,
                  rows.data() + static_cast<std::size_t>(b * capacity * width_) * bytes);
      if (!scales.empty()) std::copy_n(scales_.data() + b * capacity_, size_, scales.data() + b * capacity);
    }
    rows_.swap(rows);
    scales_.swap(scales);
    capacity_ = capacity;
  }
  void make_room(Index extra) {
    if (size_ + extra > capacity_) reserve(std::max(size_ + extra, 2 * capacity_));
  }
  // n rows of Scalar (stride ld) into batch entry b's rows from `at`.
  void put_rows(Index b, Index at, const Scalar* src, Index ld, Index n) {
    unsigned char* dst = rows_.data() + static_cast<std::size_t>((b * capacity_ + at) * width_) * storage_bytes(storage_);
    detail::store_rows(storage_, src, ld, n, 1, width_, dst, storage_ == Storage::kInt8 ? scales_.data() + b * capacity_ + at : nullptr);
  }

  Index batch_ = 0, width_ = 0, kv_lora_ = 0, size_ = 0, capacity_ = 0;
  Storage storage_;
  std::vector<unsigned char> rows_;  // (batch, capacity, width) elements of storage_
  std::vector<float> scales_;        // int8: (batch, capacity)
};

// Gradients of LatentAttention::backward, by parameter and by state_dict name.
template <typename Scalar>
struct LatentGradients {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> input;  // d loss / d x
  LinearGradients<Scalar> q_proj, q_a_proj, q_b_proj, kv_a_proj, kv_b_proj, o_proj;
  std::vector<Scalar> q_a_norm, kv_a_norm;

  std::vector<ParameterRef<Scalar>> named_parameters() {
    std::vector<ParameterRef<Scalar>> out;
    const auto linear = [&](const char* name, LinearGradients<Scalar>& g, bool bias) {
      if (g.weight.size() == 0) return;
      out.push_back({std::string(name) + ".weight", g.weight.data(), {g.weight.dimension(0), g.weight.dimension(1)}});
      if (bias) out.push_back({std::string(name) + ".bias", g.bias.data(), {g.bias.dimension(0)}});
    };
    linear("q_proj", q_proj, false);
    linear("q_a_proj", q_a_proj, q_a_proj.bias.size() > 0);
    if (!q_a_norm.empty()) out.push_back({"q_a_layernorm.weight", q_a_norm.data(), {static_cast<Eigen::Index>(q_a_norm.size())}});
    linear("q_b_proj", q_b_proj, false);
    linear("kv_a_proj_with_mqa", kv_a_proj, kv_a_proj.bias.size() > 0);
    out.push_back({"kv_a_layernorm.weight", kv_a_norm.data(), {static_cast<Eigen::Index>(kv_a_norm.size())}});
    linear("kv_b_proj", kv_b_proj, false);
    linear("o_proj", o_proj, o_proj.bias.size() > 0);
    return out;
  }
};

// What backward needs from a forward: the input, the normalised latents' inputs, the options and the core's state.
template <typename Scalar>
class LatentState {
 public:
  bool empty() const noexcept { return !filled_; }

 private:
  friend class LatentAttention<Scalar>;
  bool filled_ = false;
  std::uint64_t module_ = 0;
  Eigen::Index batch_ = 0, n_ = 0;
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> x_;
  std::vector<Scalar> qa_, ckv_, c_;  // q_a_proj's output (before its norm), kv_a_proj's, the normalised latent
  std::vector<Scalar> att_;           // the attention output before o_proj (rows, heads * v)
  AttentionOptions<Scalar> options_;
  AttentionState<Scalar> core_;
};

template <typename Scalar>
class LatentAttention {
  static_assert(std::is_floating_point<Scalar>::value, "sdpa::LatentAttention needs a floating-point Scalar");

 public:
  using Index = Eigen::Index;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;
  using Tensor4 = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>;
  using LinearType = Linear<Scalar>;
  using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Map = Eigen::Map<Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  using ConstMap = Eigen::Map<const Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;

  // Weights drawn as the original module's init (N(0, 0.001), biases 0), norms 1, seeded by `seed`.
  explicit LatentAttention(const LatentConfig& c, std::uint64_t seed = 0)
      : c_(checked(c)),
        id_(detail::next_latent_id()),
        q_proj_(c.d_model, c.q_lora_rank > 0 ? 1 : c.heads * qk()),
        q_a_proj_(c.d_model, c.q_lora_rank > 0 ? c.q_lora_rank : 1),
        q_b_proj_(c.q_lora_rank > 0 ? c.q_lora_rank : 1, c.q_lora_rank > 0 ? c.heads * qk() : 1),
        kv_a_proj_(c.d_model, c.kv_lora_rank + c.qk_rope_head_dim),
        kv_b_proj_(c.kv_lora_rank, c.heads * (c.qk_nope_head_dim + c.v_head_dim)),
        o_proj_(c.heads * c.v_head_dim, c.d_model) {
    q_a_norm_.assign(static_cast<std::size_t>(c.q_lora_rank), Scalar(1));
    kv_a_norm_.assign(static_cast<std::size_t>(c.kv_lora_rank), Scalar(1));
    rotary_.interleaved = true;
    std::uint64_t stream = 0;
    for (LinearType* l : layers()) {
      Philox gen(seed, stream++);
      init::ExternalAttentionPolicy{}.linear(l->weight(), l->bias(), gen);
    }
  }

  const LatentConfig& config() const noexcept { return c_; }
  Index heads() const noexcept { return c_.heads; }
  Index qk() const noexcept { return c_.qk_nope_head_dim + c_.qk_rope_head_dim; }
  Index latent_width() const noexcept { return c_.kv_lora_rank + c_.qk_rope_head_dim; }

  // The rotary of the rope part (dim 0 or rope; interleaved by default).
  void set_rotary(const Rotary& r) {
    detail::check_rotary("LatentAttention::set_rotary", r, c_.qk_rope_head_dim);
    rotary_ = r;
  }
  const Rotary& rotary() const noexcept { return rotary_; }
  // The softmax scale (0: 1 / sqrt(nope + rope)).
  void set_scale(Scalar scale) {
    if (!(std::isfinite(scale) && scale >= Scalar(0))) detail::throw_invalid("LatentAttention::set_scale", "scale", "finite and >= 0", scale);
    scale_ = scale;
  }
  Scalar scale() const noexcept { return scale_ > Scalar(0) ? scale_ : Scalar(1) / std::sqrt(static_cast<Scalar>(qk())); }

  LinearType& q_proj() noexcept { return q_proj_; }
  LinearType& q_a_proj() noexcept { return q_a_proj_; }
  LinearType& q_b_proj() noexcept { return q_b_proj_; }
  LinearType& kv_a_proj() noexcept { return kv_a_proj_; }
  LinearType& kv_b_proj() noexcept { return kv_b_proj_; }
  LinearType& o_proj() noexcept { return o_proj_; }
  std::vector<Scalar>& q_a_norm() noexcept { return q_a_norm_; }
  std::vector<Scalar>& kv_a_norm() noexcept { return kv_a_norm_; }
  const LinearType& kv_b_proj() const noexcept { return kv_b_proj_; }

  // The parameters by transformers' names, in its order.
  std::vector<ParameterRef<Scalar>> named_parameters() {
    std::vector<ParameterRef<Scalar>> out;
    const auto linear = [&](const char* name, LinearType& l, bool bias) {
      out.push_back({std::string(name) + ".weight", l.weight().data(), {l.weight().dimension(0), l.weight().dimension(1)}});
      if (bias) out.push_back({std::string(name) + ".bias", l.bias().data(), {l.bias().dimension(0)}});
    };
    if (c_.q_lora_rank == 0) {
      linear("q_proj", q_proj_, false);
    } else {
      linear("q_a_proj", q_a_proj_, c_.bias);
      out.push_back({"q_a_layernorm.weight", q_a_norm_.data(), {c_.q_lora_rank}});
      linear("q_b_proj", q_b_proj_, false);
    }
    linear("kv_a_proj_with_mqa", kv_a_proj_, c_.bias);
    out.push_back({"kv_a_layernorm.weight", kv_a_norm_.data(), {c_.kv_lora_rank}});
    linear("kv_b_proj", kv_b_proj_, false);
    linear("o_proj", o_proj_, c_.bias);
    return out;
  }

  // Self-attention of x (batch, n, d_model) in the expanded form; the options as sdpa::attention takes them
  // (causal, masks, windows, key lengths, a device...), but rotary, scale and layout are the module's.
  Tensor3 forward(const Tensor3& x, const AttentionOptions<Scalar>& options = {}) const { return forward_impl(x, options, nullptr); }
  Tensor3 forward(const Tensor3& x, const AttentionOptions<Scalar>& options, LatentState<Scalar>& state) const {
    return forward_impl(x, options, &state);
  }

  // d loss / d everything given d loss / d (the forward's output) and that forward's state.
  LatentGradients<Scalar> backward(const Tensor3& grad_output, const LatentState<Scalar>& s) const;

  // Appends x's tokens (cache.batch(), n, d_model) to the cache and attends them causally to everything it
  // holds: the absorbed form for up to kLatentAbsorbRows tokens, else the expanded one (the same attention
  // to rounding). Returns (batch, n, d_model).
  Tensor3 step(const Tensor3& x, LatentCache<Scalar>& cache, const Eigen::ThreadPoolDevice* device = nullptr) const;

  // The absorbed attention of projected, rotated queries q (cache.batch(), n, heads * (nope + rope)), the last
  // n positions of the cache, to everything it holds (causal): each head's output before o_proj, (batch, n,
  // heads * v_head_dim). What step runs for a short step, without the projections.
  Tensor3 attend(const Tensor3& q, const LatentCache<Scalar>& cache, const Eigen::ThreadPoolDevice* device = nullptr) const {
    const char* where = "LatentAttention::attend";
    if (q.dimension(0) != cache.batch() || q.dimension(2) != c_.heads * qk() || q.dimension(1) > cache.size())
      detail::throw_invalid(where, "q", detail::concat("of shape (", cache.batch(), ", n <= ", cache.size(), ", ", c_.heads * qk(), ")"),
                            detail::concat("of shape ", detail::shape_string(q.dimensions())));
    check_cache(cache, where);
    Tensor3 att(q.dimension(0), q.dimension(1), c_.heads * c_.v_head_dim);
    if (att.size() > 0) absorbed(q.data(), q.dimension(0), q.dimension(1), cache, att.data(), device, where);
    return att;
  }

 private:
  static LatentConfig checked(const LatentConfig& c) {
    const char* where = "LatentAttention";
    const auto positive = [&](const char* name, Index v) {
      if (v <= 0) detail::throw_invalid(where, name, "positive", v);
    };
    positive("d_model", c.d_model);
    positive("heads", c.heads);
    positive("kv_lora_rank", c.kv_lora_rank);
    positive("qk_nope_head_dim", c.qk_nope_head_dim);
    positive("qk_rope_head_dim", c.qk_rope_head_dim);
    positive("v_head_dim", c.v_head_dim);
    if (c.q_lora_rank < 0) detail::throw_invalid(where, "q_lora_rank", "0 (none) or positive", c.q_lora_rank);
    if (c.qk_rope_head_dim % 2 != 0) detail::throw_invalid(where, "qk_rope_head_dim", "even", c.qk_rope_head_dim);
    if (!(std::isfinite(c.norm_eps) && c.norm_eps > 0)) detail::throw_invalid(where, "norm_eps", "finite and positive", c.norm_eps);
    return c;
  }

  void check_cache(const LatentCache<Scalar>& cache, const char* where) const {
    if (cache.width() != latent_width() || cache.kv_lora_rank() != c_.kv_lora_rank)
      detail::throw_invalid(where, "cache", detail::concat("a cache of latents of ", c_.kv_lora_rank, " + ", c_.qk_rope_head_dim),
                            detail::concat("one of ", cache.kv_lora_rank(), " + ", cache.width() - cache.kv_lora_rank()));
  }

  // The absorbed form: q_lat = W_UK^T q_nope per head, beside q_rope; multi-query attention over the latents
  // (d_k = kv_lora + rope, d_v = kv_lora) for the last n positions; then W_UV per head into att (rows of
  // heads * v_head_dim).
  void absorbed(const Scalar* q, Index batch, Index n, const LatentCache<Scalar>& cache, Scalar* att,
                const Eigen::ThreadPoolDevice* device, const char* where) const;

  std::vector<LinearType*> layers() { return {&q_proj_, &q_a_proj_, &q_b_proj_, &kv_a_proj_, &kv_b_proj_, &o_proj_}; }

  void check_input(const Tensor3& x, const char* where, Index batch = -1) const {
    if (x.dimension(2) != c_.d_model)
      detail::throw_invalid(where, "x dimension 2 (d_model)", c_.d_model, detail::concat(x.dimension(2), " (x shape ", detail::shape_string(x.dimensions()), ")"));
    if (batch >= 0 && x.dimension(0) != batch)
      detail::throw_invalid(where, "x dimension 0 (batch)", detail::concat(batch, ", the cache's batch"), x.dimension(0));
  }

  // Queries of `rows` tokens (rows of heads * qk), the rope parts rotated at first + i of each batch entry
  // of n rows; qa (rows of q_lora, before its norm) kept when given.
  void queries(const Scalar* x, Index batch, Index n, Index first, Scalar* q, std::vector<Scalar>* qa,
               const Eigen::ThreadPoolDevice* device) const {
    const Index rows = batch * n, hq = c_.heads * qk();
    if (c_.q_lora_rank == 0) {
      q_proj_.forward_rows(x, rows, c_.d_model, q, hq, device);
    } else {
      std::vector<Scalar> a(static_cast<std::size_t>(rows * c_.q_lora_rank));
      q_a_proj_.forward_rows(x, rows, c_.d_model, a.data(), c_.q_lora_rank, device);
      if (qa != nullptr) *qa = a;
      detail::rms_norm_rows(a.data(), rows, c_.q_lora_rank, 1, c_.q_lora_rank, q_a_norm_.data(), c_.norm_eps);
      q_b_proj_.forward_rows(a.data(), rows, c_.q_lora_rank, q, hq, device);
    }
    for (Index b = 0; b < batch; ++b)
      apply_rotary(rotary_,
                   RotaryRows(q + b * n * hq + c_.qk_nope_head_dim, n, hq, c_.heads, qk(), c_.qk_rope_head_dim), first);
  }

  // The latents [c | k_rope] of `rows` tokens into lat (row stride latent_width()), c normalised, k_rope
  // rotated; ckv (kv_a_proj's output) kept when given.
  void latents(const Scalar* x, Index batch, Index n, Index first, Scalar* lat, std::vector<Scalar>* ckv,
               const Eigen::ThreadPoolDevice* device) const {
    const Index rows = batch * n, w = latent_width();
    kv_a_proj_.forward_rows(x, rows, c_.d_model, lat, w, device);
    if (ckv != nullptr) ckv->assign(lat, lat + rows * w);
    detail::rms_norm_rows(lat, rows, w, 1, c_.kv_lora_rank, kv_a_norm_.data(), c_.norm_eps);
    for (Index b = 0; b < batch; ++b)
      apply_rotary(rotary_, RotaryRows(lat + b * n * w + c_.kv_lora_rank, n, w, 1, w, c_.qk_rope_head_dim), first);
  }

  // Every head's keys (rows, heads, qk) and values (rows, heads, v) from latents (row stride ld).
  void expand(const Scalar* lat, Index ld, Index rows, Scalar* k, Scalar* v, const Eigen::ThreadPoolDevice* device) const {
    const Index h = c_.heads, nope = c_.qk_nope_head_dim, rope = c_.qk_rope_head_dim, dv = c_.v_head_dim, wb = h * (nope + dv);
    std::vector<Scalar> kvb(static_cast<std::size_t>(rows * wb));
    kv_b_proj_.forward_rows(lat, rows, ld, kvb.data(), wb, device);
    for (Index r = 0; r < rows; ++r)
      for (Index j = 0; j < h; ++j) {
        const Scalar* src = kvb.data() + r * wb + j * (nope + dv);
        Scalar* kd = k + (r * h + j) * (nope + rope);
        std::copy_n(src, nope, kd);
        std::copy_n(lat + r * ld + c_.kv_lora_rank, rope, kd + nope);
        std::copy_n(src + nope, dv, v + (r * h + j) * dv);
      }
  }

  Tensor3 forward_impl(const Tensor3& x, const AttentionOptions<Scalar>& options, LatentState<Scalar>* state) const {
    const char* where = "LatentAttention::forward";
    check_input(x, where);
    if (options.rotary != nullptr || options.layout != Layout::kBHND || options.scale != Scalar(0))
      detail::throw_invalid(where, options.rotary != nullptr ? "rotary" : options.layout != Layout::kBHND ? "layout" : "scale",
                            "left at its default (the module has its own)", "set");
    const Index batch = x.dimension(0), n = x.dimension(1), rows = batch * n, h = c_.heads, dv = c_.v_head_dim;
    std::vector<Scalar> q(static_cast<std::size_t>(rows * h * qk())), lat(static_cast<std::size_t>(rows * latent_width()));
    queries(x.data(), batch, n, 0, q.data(), state != nullptr ? &state->qa_ : nullptr, options.device);
    latents(x.data(), batch, n, 0, lat.data(), state != nullptr ? &state->ckv_ : nullptr, options.device);
    Tensor4 k(batch, n, h, qk()), v(batch, n, h, dv);
    expand(lat.data(), latent_width(), rows, k.data(), v.data(), options.device);
    const Eigen::TensorMap<const Tensor4> qm(q.data(), batch, n, h, qk());
    AttentionOptions<Scalar> o = options;
    o.layout = Layout::kBNHD;
    o.scale = scale();
    Tensor4 att = state != nullptr ? attention(qm, k, v, o, state->core_) : attention(qm, k, v, o);
    Tensor3 y(batch, n, c_.d_model);
    o_proj_.forward_rows(att.data(), rows, h * dv, y.data(), c_.d_model, options.device);
    if (state != nullptr) {
      state->filled_ = true;
      state->module_ = id_;
      state->batch_ = batch;
      state->n_ = n;
      state->x_ = x;
      state->c_.resize(static_cast<std::size_t>(rows * c_.kv_lora_rank));
      for (Index r = 0; r < rows; ++r)
        std::copy_n(lat.data() + r * latent_width(), c_.kv_lora_rank, state->c_.data() + r * c_.kv_lora_rank);
      state->att_.assign(att.data(), att.data() + att.size());
      state->options_ = o;
    }
    return y;
  }

  Scalar scale_ = Scalar(0);
  LatentConfig c_;
  std::uint64_t id_;
  Rotary rotary_;
  LinearType q_proj_, q_a_proj_, q_b_proj_, kv_a_proj_, kv_b_proj_, o_proj_;
  std::vector<Scalar> q_a_norm_, kv_a_norm_;
};

template <typename Scalar>
LatentCache<Scalar>::LatentCache(const LatentAttention<Scalar>& module, Index batch, Index capacity, Storage storage)
    : batch_(batch), width_(module.latent_width()), kv_lora_(module.config().kv_lora_rank), storage_(storage) {
  const char* where = "LatentCache";
  if (batch < 0) detail::throw_invalid(where, "batch", "non-negative", batch);
  if (capacity < 0) detail::throw_invalid(where, "capacity", "non-negative", capacity);
  if (storage != native_storage<Scalar>() && !is_narrow<Scalar>(storage))
    detail::throw_invalid(where, "storage",
                          detail::concat(storage_name(native_storage<Scalar>()),
                                         std::is_same<Scalar, float>::value ? ", kBFloat16, kFloat16 or kInt8" : ""),
                          storage_name(storage));
  reserve(capacity);
}

template <typename Scalar>
typename LatentAttention<Scalar>::Tensor3 LatentAttention<Scalar>::step(const Tensor3& x, LatentCache<Scalar>& cache,
                                                                        const Eigen::ThreadPoolDevice* device) const {
  const char* where = "LatentAttention::step";
  check_input(x, where, cache.batch());
  check_cache(cache, where);
  const Index batch = x.dimension(0), n = x.dimension(1), rows = batch * n, h = c_.heads, w = latent_width();
  const Index dv = c_.v_head_dim;
  Tensor3 y(batch, n, c_.d_model);
  if (rows == 0) return y;
  const Index first = cache.position();
  std::vector<Scalar> q(static_cast<std::size_t>(rows * h * qk())), lat(static_cast<std::size_t>(rows * w));
  queries(x.data(), batch, n, first, q.data(), nullptr, device);
  latents(x.data(), batch, n, first, lat.data(), nullptr, device);
  cache.make_room(n);
  for (Index b = 0; b < batch; ++b) cache.put_rows(b, cache.size_, lat.data() + b * n * w, w, n);
  cache.size_ += n;
  const Index nk = cache.size();
  std::vector<Scalar> att(static_cast<std::size_t>(rows * h * dv));
  AttentionOptions<Scalar> causal;
  causal.causal = true;
  causal.device = device;
  if (n > kLatentAbsorbRows) {
    // The expanded form over everything held (a prompt): keys and values of every head.
    const Tensor3 held = cache.held();
    Tensor4 k(batch, nk, h, qk()), v(batch, nk, h, dv);
    expand(held.data(), w, batch * nk, k.data(), v.data(), device);
    causal.layout = Layout::kBNHD;
    causal.scale = scale();
    const Eigen::TensorMap<const Tensor4> qm(q.data(), batch, n, h, qk());
    const Tensor4 out = attention(qm, k, v, causal);
    std::copy_n(out.data(), out.size(), att.data());
  } else {
    absorbed(q.data(), batch, n, cache, att.data(), device, where);
  }
  o_proj_.forward_rows(att.data(), rows, h * dv, y.data(), c_.d_model, device);
  return y;
}

template <typename Scalar>
void LatentAttention<Scalar>::absorbed(const Scalar* q, Index batch, Index n, const LatentCache<Scalar>& cache, Scalar* att_out,
                                       const Eigen::ThreadPoolDevice* device, const char* where) const {
  const Index rows = batch * n, h = c_.heads, w = latent_width(), nk = cache.size();
  const Index nope = c_.qk_nope_head_dim, rope = c_.qk_rope_head_dim, dv = c_.v_head_dim, L = c_.kv_lora_rank;
  AttentionOptions<Scalar> causal;
  causal.causal = true;
  causal.device = device;
  const Index wb = h * (nope + dv);
  const ConstMap W(kv_b_proj_.weight().data(), wb, L, Eigen::OuterStride<>(L));
  std::vector<Scalar> qa(static_cast<std::size_t>(rows * h * w)), out_lat(static_cast<std::size_t>(rows * h * L));
  // Per head (in parallel: a step streams all of kv_b_proj's weights, W_UK here and W_UV below).
  parallel_for(device, h, 1, [&](Index j0, Index j1) {
    for (Index j = j0; j < j1; ++j) {
      const ConstMap qn(q + j * qk(), rows, nope, Eigen::OuterStride<>(h * qk()));
      Map ql(qa.data() + j * w, rows, L, Eigen::OuterStride<>(h * w));
      ql.noalias() = qn * W.middleRows(j * (nope + dv), nope);
      for (Index r = 0; r < rows; ++r) std::copy_n(q + r * h * qk() + j * qk() + nope, rope, qa.data() + r * h * w + j * w + L);
    }
  });
  // Token t's heads are the rows of one query head against the one latent key head: a product of h rows
  // per key block (the tiled kernel's GEMM shape) rather than h products of one row. Causal: token t sees
  // the keys up to its own position (a key length).
  kernels::DecodeWorkspace<Scalar> workspace;
  for (Index t = 0; t < n; ++t) {
    detail::CallShape shape;
    shape.where = where;
    shape.batch = batch;
    shape.heads = 1;
    shape.kv_heads = 1;
    shape.nq = h;
    shape.nk = nk;
    shape.d_k = w;
    shape.d_v = L;
    AttentionOptions<Scalar> own = causal;
    own.causal = false;
    own.key_lengths.assign(static_cast<std::size_t>(batch), nk - n + t + 1);
    kernels::AttentionProblem<Scalar> p = detail::problem_of(shape, own, MaskedRows::kZero, false, 0);
    p.scale = scale();
    p.q = {qa.data() + t * h * w, n * h * w, w, w};
    if (cache.storage() == native_storage<Scalar>()) {
      const Scalar* base = reinterpret_cast<const Scalar*>(cache.rows_.data());
      p.k = {base, cache.capacity() * w, w, w};
      p.v = {base, cache.capacity() * w, w, L};
    } else {
      p.k = {nullptr, cache.capacity() * w, w, w};
      p.v = {nullptr, cache.capacity() * w, w, L};
      p.kv_storage = cache.storage();
      p.k_stored = p.v_stored = cache.rows_.data();
      p.k_scales = p.v_scales = cache.storage() == Storage::kInt8 ? cache.scales_.data() : nullptr;
      p.scale_batch_stride = cache.capacity();
    }
    p.out = {out_lat.data() + t * h * L, n * h * L, L, L};
    // Key blocks of kLatentBlockK: the tiled kernel's cache rule, made for heads of 64 to 256, gives
    // shorter ones at d_k + d_v this wide, and the products over them ran slower (the commit's measurement).
    if (h > kernels::kDecodeRows) {
      // Rows shared out among the workers: one block of rows per worker.
      const Index workers = std::max<Index>(1, static_cast<Index>(worker_count(device)));
      kernels::TileConfig tiles;
      tiles.block_k = kLatentBlockK;
      tiles.block_q = std::max<Index>(16, (h + workers - 1) / workers);
      kernels::tiled_attention(p, device, tiles);
    } else {
      detail::run_attention(p, Kernel::kAuto, &workspace, device);
    }
  }
  parallel_for(device, h, 1, [&](Index j0, Index j1) {
    for (Index j = j0; j < j1; ++j) {
      const ConstMap ol(out_lat.data() + j * L, rows, L, Eigen::OuterStride<>(h * L));
      Map a(att_out + j * dv, rows, dv, Eigen::OuterStride<>(h * dv));
      a.noalias() = ol * W.middleRows(j * (nope + dv) + nope, dv).transpose();
    }
  });
}

template <typename Scalar>
LatentGradients<Scalar> LatentAttention<Scalar>::backward(const Tensor3& grad_output, const LatentState<Scalar>& s) const {
  const char* where = "LatentAttention::backward";
  if (!s.filled_) throw std::logic_error("sdpa::LatentAttention::backward: the state is empty: pass the state forward filled");
  if (s.module_ != id_) detail::throw_invalid(where, "state", "the state of a forward call of this module", "the state of another module");
  const Index batch = s.batch_, n = s.n_, rows = batch * n, h = c_.heads, dv = c_.v_head_dim, L = c_.kv_lora_rank;
  const Index nope = c_.qk_nope_head_dim, rope = c_.qk_rope_head_dim, w = latent_width(), d = c_.d_model;
  if (grad_output.dimension(0) != batch || grad_output.dimension(1) != n || grad_output.dimension(2) != d)
    detail::throw_invalid(where, "grad_output", detail::concat("of shape (", batch, ", ", n, ", ", d, ")"),
                          detail::concat("of shape ", detail::shape_string(grad_output.dimensions())));
  LatentGradients<Scalar> g;
  g.input = Tensor3(batch, n, d);
  g.input.setZero();
  // y = x W^T + b: dW = dY^T X, db = column sums, dX += dY W.
  const auto linear_backward = [&](const LinearType& l, const Scalar* dy, const Scalar* in, Index in_ld, LinearGradients<Scalar>& lg,
                                   Scalar* d_in, Index d_in_ld, bool bias) {
    const ConstMap DY(dy, rows, l.out_features(), Eigen::OuterStride<>(l.out_features()));
    const ConstMap IN(in, rows, l.in_features(), Eigen::OuterStride<>(in_ld));
    lg.weight = Eigen::Tensor<Scalar, 2, Eigen::RowMajor>(l.out_features(), l.in_features());
    Map(lg.weight.data(), l.out_features(), l.in_features(), Eigen::OuterStride<>(l.in_features())).noalias() = DY.transpose() * IN;
    if (bias) {
      lg.bias = Eigen::Tensor<Scalar, 1, Eigen::RowMajor>(l.out_features());
      for (Index o = 0; o < l.out_features(); ++o) lg.bias(o) = DY.col(o).sum();
    }
    if (d_in != nullptr) {
      const ConstMap W(l.weight().data(), l.out_features(), l.in_features(), Eigen::OuterStride<>(l.in_features()));
      Map(d_in, rows, l.in_features(), Eigen::OuterStride<>(d_in_ld)).noalias() += DY * W;
    }
  };
  // o_proj.
  std::vector<Scalar> d_att(static_cast<std::size_t>(rows * h * dv), Scalar(0));
  linear_backward(o_proj_, grad_output.data(), s.att_.data(), h * dv, g.o_proj, d_att.data(), h * dv, c_.bias);
  // The core.
  const Eigen::TensorMap<const Tensor4> datt(d_att.data(), batch, n, h, dv);
  const AttentionGradients<Scalar> cg = attention_backward(Tensor4(datt), s.core_);
  // Queries: rope parts rotated back, then the query path.
  std::vector<Scalar> dq(cg.q.data(), cg.q.data() + cg.q.size());
  for (Index b = 0; b < batch; ++b)
    apply_rotary(rotary_, RotaryRows(dq.data() + b * n * h * qk() + nope, n, h * qk(), h, qk(), rope), 0,
                 /*inverse=*/true);
  if (c_.q_lora_rank == 0) {
    linear_backward(q_proj_, dq.data(), s.x_.data(), d, g.q_proj, g.input.data(), d, false);
  } else {
    const Index R = c_.q_lora_rank;
    std::vector<Scalar> qn = s.qa_;  // the normalised q_a output: q_b_proj's input
    detail::rms_norm_rows(qn.data(), rows, R, 1, R, q_a_norm_.data(), c_.norm_eps);
    std::vector<Scalar> dqn(static_cast<std::size_t>(rows * R), Scalar(0));
    linear_backward(q_b_proj_, dq.data(), qn.data(), R, g.q_b_proj, dqn.data(), R, false);
    std::vector<double> dw(static_cast<std::size_t>(R), 0.0);
    detail::rms_norm_backward_rows(s.qa_.data(), dqn.data(), {rows, R, 1, R}, q_a_norm_.data(), c_.norm_eps, dw.data());
    g.q_a_norm.assign(dw.begin(), dw.end());
    linear_backward(q_a_proj_, dqn.data(), s.x_.data(), d, g.q_a_proj, g.input.data(), d, c_.bias);
  }
  // Keys and values: kv_b_proj's output gradient per head, and the shared k_rope's summed over heads.
  const Index wb = h * (nope + dv);
  std::vector<Scalar> dkvb(static_cast<std::size_t>(rows * wb)), dckv(static_cast<std::size_t>(rows * w), Scalar(0));
  for (Index r = 0; r < rows; ++r)
    for (Index j = 0; j < h; ++j) {
      const Scalar* dk = cg.k.data() + (r * h + j) * qk();
      std::copy_n(dk, nope, dkvb.data() + r * wb + j * (nope + dv));
      std::copy_n(cg.v.data() + (r * h + j) * dv, dv, dkvb.data() + r * wb + j * (nope + dv) + nope);
      for (Index i = 0; i < rope; ++i) dckv[static_cast<std::size_t>(r * w + L + i)] += dk[nope + i];
    }
  for (Index b = 0; b < batch; ++b)
    apply_rotary(rotary_, RotaryRows(dckv.data() + b * n * w + L, n, w, 1, w, rope), 0, /*inverse=*/true);
  linear_backward(kv_b_proj_, dkvb.data(), s.c_.data(), L, g.kv_b_proj, dckv.data(), w, false);
  std::vector<double> dw(static_cast<std::size_t>(L), 0.0);
  detail::rms_norm_backward_rows(s.ckv_.data(), dckv.data(), {rows, w, 1, L}, kv_a_norm_.data(), c_.norm_eps,
                                 dw.data());
  g.kv_a_norm.assign(dw.begin(), dw.end());
  linear_backward(kv_a_proj_, dckv.data(), s.x_.data(), d, g.kv_a_proj, g.input.data(), d, c_.bias);
  return g;
}

SDPA_NAMESPACE_END
