// Hugging Face checkpoints of multi-head latent attention (deepseek_v2, deepseek_v3, kimi_k2) for
// sdpa::LatentAttention (sdpa/latent_attention.hpp): read_hf_latent_config and the loader, by the
// checkpoint's own tensor names. Included by sdpa/io/hf.hpp. Needs nlohmann_json (CMake target sdpa::io).
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

#include "sdpa/io/hf.hpp"
#include "sdpa/latent_attention.hpp"

SDPA_NAMESPACE_BEGIN

// What a latent attention block needs from config.json: its shape, its rotary (the rope part's: head_dim is
// qk_rope_head_dim in these configs; interleaved unless rope_interleave is false, deepseek_v2's always) and
// its softmax scale (YaRN's mscale_all_dim folded in, as transformers' yarn_apply_mscale).
struct HfLatentConfig {
  std::string path;
  std::string model_type;
  LatentConfig shape;
  Rotary rotary;
  double scale = 0;
};

inline HfLatentConfig read_hf_latent_config(const std::string& path) {
  namespace hf = detail::hf;
  const nlohmann::json j = hf::read_json(path);
  if (!j.is_object()) hf::fail(path, "config.json is not a JSON object");
  HfLatentConfig c;
  c.path = path;
  c.model_type = hf::text(j, path, "model_type", "");
  if (c.model_type != "deepseek_v2" && c.model_type != "deepseek_v3" && c.model_type != "kimi_k2")
    hf::fail(path, "model_type \"" + c.model_type + "\" has no latent attention (deepseek_v2, deepseek_v3, kimi_k2 have)");
  LatentConfig& s = c.shape;
  s.d_model = hf::integer(j, path, "hidden_size");
  s.heads = hf::integer(j, path, "num_attention_heads");
  s.q_lora_rank = hf::integer(j, path, "q_lora_rank", false, 0);
  s.kv_lora_rank = hf::integer(j, path, "kv_lora_rank");
  s.qk_nope_head_dim = hf::integer(j, path, "qk_nope_head_dim");
  s.qk_rope_head_dim = hf::integer(j, path, "qk_rope_head_dim");
  s.v_head_dim = hf::integer(j, path, "v_head_dim");
  s.bias = hf::boolean(j, path, "attention_bias", false);
  s.norm_eps = 1e-6;  // DeepseekV3RMSNorm's default: the latents' norms are built without the config's eps
  if (s.d_model <= 0 || s.heads <= 0 || s.kv_lora_rank <= 0 || s.qk_nope_head_dim <= 0 || s.qk_rope_head_dim <= 0 || s.v_head_dim <= 0)
    hf::fail(path, "config.json gives a latent attention without positive sizes (hidden_size, num_attention_heads, kv_lora_rank, "
                   "qk_nope_head_dim, qk_rope_head_dim, v_head_dim)");
  HfAttentionConfig rc;
  rc.path = path;
  rc.head_dim = s.qk_rope_head_dim;
  hf::read_rope(j, rc);
  c.rotary = rc.rotary;
  c.rotary.interleaved = c.model_type == "deepseek_v2" || hf::boolean(j, path, "rope_interleave", true);
  nlohmann::json rope = hf::object(j, path, "rope_parameters");
  const nlohmann::json scaling = hf::object(j, path, "rope_scaling");
  for (const auto& [k, v] : scaling.items()) rope[k] = v;
  c.scale = 1.0 / std::sqrt(static_cast<double>(s.qk_nope_head_dim + s.qk_rope_head_dim));
  const std::string type = hf::text(rope, path, "rope_type", hf::text(rope, path, "type", "default"));
  const double mscale_all_dim = hf::number(rope, path, "mscale_all_dim", 0.0);
  if (type != "default" && mscale_all_dim != 0) {
    const double factor = hf::number(rope, path, "factor", 1.0);
    const double m = factor <= 1 ? 1.0 : 0.1 * mscale_all_dim * std::log(factor) + 1.0;
    c.scale *= m * m;
  }
  return c;
}

template <typename Scalar>
LatentAttention<Scalar> make_hf_latent_attention(const HfLatentConfig& c) {
  LatentAttention<Scalar> m(c.shape);
  m.set_rotary(c.rotary);
  m.set_scale(static_cast<Scalar>(c.scale));
  return m;
}

// Loads the latent attention block under `prefix` (e.g. "model.layers.0.self_attn.") into `module`, whose
// shape must be the config's; returns the options of its calls (causal). Nothing changes unless everything
// loads.
template <typename Scalar>
AttentionOptions<Scalar> load_hf_latent_attention(LatentAttention<Scalar>& module, const std::string& safetensors_path,
                                                  const std::string& prefix, const std::string& config_path = "") {
  namespace hf = detail::hf;
  using Index = Eigen::Index;
  const std::string cfg_path =
      config_path.empty() ? (std::filesystem::path(safetensors_path).parent_path() / "config.json").string() : config_path;
  const HfLatentConfig c = read_hf_latent_config(cfg_path);
  const LatentConfig& s = c.shape;
  const LatentConfig& m = module.config();
  const auto expect = [&](const char* field, Index want, Index got) {
    if (want != got)
      detail::throw_invalid("load_hf_latent_attention", detail::concat("module ", field), detail::concat(want, " (", cfg_path, ")"), got);
  };
  expect("d_model", s.d_model, m.d_model);
  expect("heads", s.heads, m.heads);
  expect("q_lora_rank", s.q_lora_rank, m.q_lora_rank);
  expect("kv_lora_rank", s.kv_lora_rank, m.kv_lora_rank);
  expect("qk_nope_head_dim", s.qk_nope_head_dim, m.qk_nope_head_dim);
  expect("qk_rope_head_dim", s.qk_rope_head_dim, m.qk_rope_head_dim);
  expect("v_head_dim", s.v_head_dim, m.v_head_dim);
  expect("bias (attention_bias)", s.bias ? 1 : 0, m.bias ? 1 : 0);
  const SafetensorsFile f = read_safetensors(safetensors_path);
  const Index d = s.d_model, qk = s.qk_nope_head_dim + s.qk_rope_head_dim, hq = s.heads * qk, w = s.kv_lora_rank + s.qk_rope_head_dim;
  struct Part {
    Linear<Scalar>* layer;
    std::vector<Scalar> weight, bias;
  };
  std::vector<Part> parts;
  const auto read = [&](const std::string& name, Linear<Scalar>& layer, Index out, Index in, bool bias) {
    Part p{&layer, hf::tensor<Scalar>(f, prefix + name + ".weight", {out, in}), {}};
    p.bias = bias ? hf::tensor<Scalar>(f, prefix + name + ".bias", {out}) : std::vector<Scalar>(static_cast<std::size_t>(out), Scalar(0));
    parts.push_back(std::move(p));
  };
  std::vector<Scalar> q_norm;
  if (s.q_lora_rank == 0) {
    read("q_proj", module.q_proj(), hq, d, false);
  } else {
    read("q_a_proj", module.q_a_proj(), s.q_lora_rank, d, s.bias);
    q_norm = hf::tensor<Scalar>(f, prefix + "q_a_layernorm.weight", {s.q_lora_rank});
    read("q_b_proj", module.q_b_proj(), hq, s.q_lora_rank, false);
  }
  read("kv_a_proj_with_mqa", module.kv_a_proj(), w, d, s.bias);
  const std::vector<Scalar> kv_norm = hf::tensor<Scalar>(f, prefix + "kv_a_layernorm.weight", {s.kv_lora_rank});
  read("kv_b_proj", module.kv_b_proj(), s.heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank, false);
  read("o_proj", module.o_proj(), d, s.heads * s.v_head_dim, s.bias);
  // Everything read: the module changes now.
  for (const Part& p : parts) {
    typename Linear<Scalar>::Weight wt(p.layer->out_features(), p.layer->in_features());
    std::copy(p.weight.begin(), p.weight.end(), wt.data());
    p.layer->set_weight_values(wt);
    std::copy(p.bias.begin(), p.bias.end(), p.layer->bias().data());
  }
  if (!q_norm.empty()) module.q_a_norm() = q_norm;
  module.kv_a_norm() = kv_norm;
  module.set_rotary(c.rotary);
  module.set_scale(static_cast<Scalar>(c.scale));
  AttentionOptions<Scalar> o;
  o.causal = true;
  return o;
}

SDPA_NAMESPACE_END
