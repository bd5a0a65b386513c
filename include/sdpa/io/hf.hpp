// Hugging Face checkpoints: the attention block of a model saved by transformers (model.safetensors and its
// config.json), loaded into a ScaledDotProductAttention by the checkpoint's own tensor names, converting
// layouts where they differ, with the settings the config implies:
//
//   HfLayout::kBert     <prefix>self.query / self.key / self.value, <prefix>output.dense   (weights + biases)
//   HfLayout::kGpt2     <prefix>c_attn (fused q | k | v, Conv1D: stored (in, out), transposed), <prefix>c_proj
//   HfLayout::kLlama, kMistral, kQwen2, kGemma2, kGptOss
//                       <prefix>q_proj / k_proj / v_proj / o_proj (biases where the model has them: Qwen2's
//                       q/k/v, gpt-oss's all four, Llama's with attention_bias), kv_heads from the shapes,
//                       the rotary embedding and its rope_type ("default", "linear", "llama3", "yarn"),
//                       Gemma 2's softcap and scale, gpt-oss's <prefix>sinks, the sliding window of the
//                       layers that have one (sliding_window, layer_types)
//
//   sdpa::HfAttentionConfig c = sdpa::read_hf_config("model/config.json", sdpa::HfLayout::kLlama);
//   sdpa::ScaledDotProductAttention<float> att = sdpa::make_hf_attention<float>(c);
//   sdpa::AttentionOptions<float> o = sdpa::load_hf_attention(att, "model/model.safetensors",
//                                                           "model.layers.3.self_attn.", sdpa::HfLayout::kLlama);
//   auto y = att(x, x, x, o);   // o: causal, the window, softcap, scale, sinks of layer 3
//
// Every config key that changes the attention's arithmetic is followed or refused: BERT's is_decoder
// (causal), GPT-2's scale_attn_weights and scale_attn_by_inverse_layer_idx (the scale of the returned
// options), a key of the wrong JSON type (layer_types given as a string, rope_scaling as a string).
// Everything is read from files already on disk (nothing is fetched). A missing tensor, a tensor of the
// wrong shape and a config sdpa cannot follow (an unknown rope_type) throw SafetensorsError (a
// std::runtime_error) naming the file and the problem; a module of another shape than the config's throws
// std::invalid_argument naming the field. config.json is read by sdpa/io/hf/config.hpp; DeepSeek's latent
// attention blocks load through sdpa/io/hf/latent.hpp (included at the end). Needs nlohmann_json (CMake
// target sdpa::io).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "sdpa/error.hpp"
#include "sdpa/flex.hpp"
#include "sdpa/head_norm.hpp"
#include "sdpa/io/hf/config.hpp"
#include "sdpa/io/safetensors.hpp"
#include "sdpa/options.hpp"
#include "sdpa/rotary.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

SDPA_NAMESPACE_BEGIN

// A module of the config's shape: d_model hidden_size, h num_heads of head_dim, kv_heads num_kv_heads, no
// dropout, eval mode, with the config's rotary.
template <typename Scalar>
ScaledDotProductAttention<Scalar> make_hf_attention(const HfAttentionConfig& c) {
  ScaledDotProductAttention<Scalar> m(c.hidden_size, c.head_dim, c.head_dim, c.num_heads, Scalar(0), c.num_kv_heads);
  m.eval();
  if (c.has_rotary) m.set_rotary(c.rotary);
  m.set_output_gate(c.output_gate);
  return m;
}

namespace detail {
namespace hf {

// tensor `name` of the file, of exactly `shape`, as Scalar values.
template <typename Scalar>
std::vector<Scalar> tensor(const SafetensorsFile& f, const std::string& name, const std::vector<Eigen::Index>& shape) {
  const SafetensorsTensor* t = f.find(name);
  if (t == nullptr) fail(f.name, "tensor \"" + name + "\" is missing");
  if (t->shape != shape)
    fail(f.name, "tensor \"" + name + "\" has shape " + safetensors::shape_text(t->shape) + ", but the attention needs " +
                     safetensors::shape_text(shape));
  return tensor_values<Scalar>(f, *t);
}

}  // namespace hf
}  // namespace detail

// Loads the attention block under `prefix` of the safetensors file into `module`, with config.json (beside
// the file unless config_path is given) for its settings: the module's shape must be the config's (it gets
// the config's rotary), and the returned options are those every call of this layer takes (causal, the
// sliding window of its layer, softcap, scale, sinks). Nothing in the module changes unless everything
// loads.
template <typename Scalar>
AttentionOptions<Scalar> load_hf_attention(ScaledDotProductAttention<Scalar>& module, const std::string& safetensors_path,
                                           const std::string& prefix, HfLayout layout, const std::string& config_path = "") {
  namespace hf = detail::hf;
  using Index = Eigen::Index;
  const std::string cfg_path =
      config_path.empty() ? (std::filesystem::path(safetensors_path).parent_path() / "config.json").string() : config_path;
  const HfAttentionConfig c = read_hf_config(cfg_path, layout);
  const char* where = "load_hf_attention";
  const auto expect = [&](const char* field, Index want, Index got) {
    if (want != got)
      detail::throw_invalid(where, detail::concat("module ", field),
                            detail::concat(want, " (", cfg_path, ": ", hf_layout_name(layout), ")"), got);
  };
  expect("d_model", c.hidden_size, module.d_model());
  expect("h", c.num_heads, module.h());
  expect("kv_heads", c.num_kv_heads, module.kv_heads());
  expect("d_k", c.head_dim, module.d_k());
  expect("d_v", c.head_dim, module.d_v());
  const SafetensorsFile f = read_safetensors(safetensors_path);
  const Index d = c.hidden_size, hq = c.num_heads * c.head_dim, hk = c.num_kv_heads * c.head_dim;
  std::vector<Scalar> wq, wk, wv, wo, bq(static_cast<std::size_t>(hq), Scalar(0)), bk(static_cast<std::size_t>(hk), Scalar(0)),
      bv(static_cast<std::size_t>(hk), Scalar(0)), bo(static_cast<std::size_t>(d), Scalar(0)), sinks;
  std::vector<Scalar> wg, bg(static_cast<std::size_t>(hq), Scalar(0)), q_norm, k_norm;
  const Index layer = hf::layer_of(prefix);
  const auto layer_type = [&]() -> std::string {
    if (c.layer_types.empty()) return "";
    if (layer < 0 || layer >= static_cast<Index>(c.layer_types.size()))
      hf::fail(cfg_path, "prefix \"" + prefix + "\" names no layer of layer_types (" + std::to_string(c.layer_types.size()) +
                             " layers)");
    return c.layer_types[static_cast<std::size_t>(layer)];
  };
  if (layout == HfLayout::kQwen3Next && layer_type() == "linear_attention")
    hf::fail(cfg_path, "layer " + std::to_string(layer) + " (prefix \"" + prefix +
                           "\") is a linear-attention layer (Gated DeltaNet), which sdpa does not implement; its full-attention layers load");
  if (layout == HfLayout::kBert) {
    wq = hf::tensor<Scalar>(f, prefix + "self.query.weight", {hq, d});
    bq = hf::tensor<Scalar>(f, prefix + "self.query.bias", {hq});
    wk = hf::tensor<Scalar>(f, prefix + "self.key.weight", {hk, d});
    bk = hf::tensor<Scalar>(f, prefix + "self.key.bias", {hk});
    wv = hf::tensor<Scalar>(f, prefix + "self.value.weight", {hk, d});
    bv = hf::tensor<Scalar>(f, prefix + "self.value.bias", {hk});
    wo = hf::tensor<Scalar>(f, prefix + "output.dense.weight", {d, hq});
    bo = hf::tensor<Scalar>(f, prefix + "output.dense.bias", {d});
  } else if (layout == HfLayout::kGpt2) {
    // Conv1D stores (in, out): y = x W + b, with W's columns q | k | v.
    const std::vector<Scalar> w = hf::tensor<Scalar>(f, prefix + "c_attn.weight", {d, 3 * d});
    const std::vector<Scalar> b = hf::tensor<Scalar>(f, prefix + "c_attn.bias", {3 * d});
    const std::vector<Scalar> w_o = hf::tensor<Scalar>(f, prefix + "c_proj.weight", {d, d});
    bo = hf::tensor<Scalar>(f, prefix + "c_proj.bias", {d});
    const auto split = [&](Index part, std::vector<Scalar>& weight, std::vector<Scalar>& bias) {
      weight.resize(static_cast<std::size_t>(d * d));
      for (Index o = 0; o < d; ++o)
        for (Index i = 0; i < d; ++i) weight[static_cast<std::size_t>(o * d + i)] = w[static_cast<std::size_t>(i * 3 * d + part * d + o)];
      bias.assign(b.begin() + part * d, b.begin() + (part + 1) * d);
    };
    split(0, wq, bq);
    split(1, wk, bk);
    split(2, wv, bv);
    wo.resize(static_cast<std::size_t>(d * d));
    for (Index o = 0; o < d; ++o)
      for (Index i = 0; i < d; ++i) wo[static_cast<std::size_t>(o * d + i)] = w_o[static_cast<std::size_t>(i * d + o)];
  } else {
    if (layout == HfLayout::kPhi3) {
      // Phi-3's fused qkv_proj: rows q | k | v.
      const std::vector<Scalar> w = hf::tensor<Scalar>(f, prefix + "qkv_proj.weight", {hq + 2 * hk, d});
      wq.assign(w.begin(), w.begin() + hq * d);
      wk.assign(w.begin() + hq * d, w.begin() + (hq + hk) * d);
      wv.assign(w.begin() + (hq + hk) * d, w.end());
    } else if (c.output_gate) {
      // Qwen3-Next: q_proj's rows hold, per head, head_dim query rows then head_dim gate rows.
      const std::vector<Scalar> w = hf::tensor<Scalar>(f, prefix + "q_proj.weight", {2 * hq, d});
      const std::vector<Scalar> b =
          c.attention_bias ? hf::tensor<Scalar>(f, prefix + "q_proj.bias", {2 * hq}) : std::vector<Scalar>(static_cast<std::size_t>(2 * hq), Scalar(0));
      wq.resize(static_cast<std::size_t>(hq * d));
      wg.resize(wq.size());
      const Index dh = c.head_dim;
      for (Index head = 0; head < c.num_heads; ++head)
        for (Index r = 0; r < dh; ++r) {
          const Index to = head * dh + r, from_q = head * 2 * dh + r, from_g = from_q + dh;
          std::copy_n(w.begin() + from_q * d, d, wq.begin() + to * d);
          std::copy_n(w.begin() + from_g * d, d, wg.begin() + to * d);
          bq[static_cast<std::size_t>(to)] = b[static_cast<std::size_t>(from_q)];
          bg[static_cast<std::size_t>(to)] = b[static_cast<std::size_t>(from_g)];
        }
    } else {
      wq = hf::tensor<Scalar>(f, prefix + "q_proj.weight", {hq, d});
    }
    if (layout != HfLayout::kPhi3) {
      wk = hf::tensor<Scalar>(f, prefix + "k_proj.weight", {hk, d});
      wv = hf::tensor<Scalar>(f, prefix + "v_proj.weight", {hk, d});
    }
    wo = hf::tensor<Scalar>(f, prefix + "o_proj.weight", {d, hq});
    const bool qkv_bias = c.attention_bias || layout == HfLayout::kQwen2 || layout == HfLayout::kQwen2Vl;
    if (qkv_bias && !c.output_gate) bq = hf::tensor<Scalar>(f, prefix + "q_proj.bias", {hq});
    if (qkv_bias) {
      bk = hf::tensor<Scalar>(f, prefix + "k_proj.bias", {hk});
      bv = hf::tensor<Scalar>(f, prefix + "v_proj.bias", {hk});
    }
    if (c.attention_bias) bo = hf::tensor<Scalar>(f, prefix + "o_proj.bias", {d});
    if (layout == HfLayout::kGptOss) sinks = hf::tensor<Scalar>(f, prefix + "sinks", {c.num_heads});
    if (c.qk_norm != QkNormKind::kNone && !c.qk_norm_after_rotary) {
      const bool per_head = c.qk_norm == QkNormKind::kHead;
      q_norm = hf::tensor<Scalar>(f, prefix + "q_norm.weight", {per_head ? c.head_dim : hq});
      k_norm = hf::tensor<Scalar>(f, prefix + "k_norm.weight", {per_head ? c.head_dim : hk});
      if (c.qk_norm_plus_one) {
        for (Scalar& w : q_norm) w = Scalar(1) + w;
        for (Scalar& w : k_norm) w = Scalar(1) + w;
      }
    }
  }
  // The options of this layer.
  AttentionOptions<Scalar> o;
  o.causal = c.causal;
  bool sliding = c.sliding_window > 0;
  if (!c.layer_types.empty()) {
    sliding = sliding && layer_type() == "sliding_attention";
  } else if (layout == HfLayout::kGemma2 && sliding) {
    // Configs from before layer_types: Gemma 2 alternates, its even layers sliding.
    if (layer < 0) hf::fail(cfg_path, "prefix \"" + prefix + "\" names no layer (Gemma 2's window depends on it)");
    sliding = layer % 2 == 0;
  }
  if (sliding) o.window_left = c.sliding_window - 1;
  o.softcap = static_cast<Scalar>(c.softcap);
  o.scale = static_cast<Scalar>(c.scale);
  if (layout == HfLayout::kGpt2 && (!c.scale_attn_weights || c.scale_by_inverse_layer)) {
    double scale = c.scale_attn_weights ? 1.0 / std::sqrt(static_cast<double>(c.head_dim)) : 1.0;
    if (c.scale_by_inverse_layer) {
      if (layer < 0) hf::fail(cfg_path, "prefix \"" + prefix + "\" names no layer (scale_attn_by_inverse_layer_idx depends on it)");
      scale /= static_cast<double>(layer + 1);
    }
    o.scale = static_cast<Scalar>(scale);
  }
  o.sinks = sinks;
  // Llama 4: rotary layers (no_rope_layers 1) are chunked and L2-normalised; the others have no rotary and,
  // with attn_temperature_tuning, temper their queries.
  bool use_rope = c.has_rotary;
  if (layout == HfLayout::kLlama4) {
    if (layer < 0 || layer >= static_cast<Index>(c.no_rope_layers.size()))
      hf::fail(cfg_path, "prefix \"" + prefix + "\" names no layer of no_rope_layers (" + std::to_string(c.no_rope_layers.size()) +
                             " layers)");
    use_rope = c.no_rope_layers[static_cast<std::size_t>(layer)] != 0;
    if (layer_type() == "chunked_attention") {
      if (c.attention_chunk_size <= 0) hf::fail(cfg_path, "a chunked_attention layer needs a positive attention_chunk_size");
      o.program = flex::program<Scalar>(flex::noop_score{}, flex::chunked{c.attention_chunk_size});
    }
  }
  const bool sliding_rotary = c.has_local_rotary && layer_type() == "sliding_attention";
  QkNorm<Scalar> norm;
  if (c.qk_norm != QkNormKind::kNone && (!c.qk_norm_after_rotary || use_rope)) {
    norm.kind = c.qk_norm;
    norm.eps = c.rms_norm_eps;
    norm.after_rotary = c.qk_norm_after_rotary;
    norm.q_weight = std::move(q_norm);
    norm.k_weight = std::move(k_norm);
  }
  detail::check_qk_norm("load_hf_attention", norm, c.num_heads, c.num_kv_heads, c.head_dim);
  // Everything read: the module changes now (weights rounded to the module's weight storage, if narrower).
  const auto put = [](const std::vector<Scalar>& from, Scalar* to) { std::copy(from.begin(), from.end(), to); };
  const auto put_weight = [](const std::vector<Scalar>& from, Linear<Scalar>& to) {
    typename Linear<Scalar>::Weight w(to.out_features(), to.in_features());
    std::copy(from.begin(), from.end(), w.data());
    to.set_weight_values(w);
  };
  put_weight(wq, module.fc_q());
  put(bq, module.fc_q().bias().data());
  put_weight(wk, module.fc_k());
  put(bk, module.fc_k().bias().data());
  put_weight(wv, module.fc_v());
  put(bv, module.fc_v().bias().data());
  put_weight(wo, module.fc_o());
  put(bo, module.fc_o().bias().data());
  if (use_rope) module.set_rotary(sliding_rotary ? c.local_rotary : c.rotary);
  else module.clear_rotary();
  module.set_qk_norm(std::move(norm));
  if (layout == HfLayout::kLlama4 && !use_rope && c.temperature_tuning) module.set_query_temperature(c.temperature);
  else module.clear_query_temperature();
  module.set_output_gate(c.output_gate);
  if (c.output_gate) {
    put_weight(wg, module.fc_g());
    put(bg, module.fc_g().bias().data());
  }
  return o;
}

SDPA_NAMESPACE_END

#include "sdpa/io/hf/latent.hpp"
