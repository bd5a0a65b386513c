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
// std::invalid_argument naming the field. Needs nlohmann_json (CMake target sdpa::io).
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
#include "sdpa/io/safetensors.hpp"
#include "sdpa/latent_attention.hpp"
#include "sdpa/options.hpp"
#include "sdpa/rotary.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

SDPA_NAMESPACE_BEGIN

enum class HfLayout { kBert, kGpt2, kLlama, kMistral, kQwen2, kGemma2, kGptOss, kQwen3, kOlmo2, kGemma3, kQwen3Next, kLlama4, kPhi3, kQwen2Vl };

inline const char* hf_layout_name(HfLayout l) noexcept {
  switch (l) {
    case HfLayout::kBert: return "bert";
    case HfLayout::kGpt2: return "gpt2";
    case HfLayout::kLlama: return "llama";
    case HfLayout::kMistral: return "mistral";
    case HfLayout::kQwen2: return "qwen2";
    case HfLayout::kGemma2: return "gemma2";
    case HfLayout::kGptOss: return "gpt_oss";
    case HfLayout::kQwen3: return "qwen3";
    case HfLayout::kOlmo2: return "olmo2";
    case HfLayout::kGemma3: return "gemma3_text";
    case HfLayout::kQwen3Next: return "qwen3_next";
    case HfLayout::kPhi3: return "phi3";
    case HfLayout::kQwen2Vl: return "qwen2_vl";
    default: return "llama4_text";
  }
}

// What an attention block of the model needs from its config.json.
struct HfAttentionConfig {
  std::string path;                  // the config file, for messages
  HfLayout layout = HfLayout::kLlama;
  Eigen::Index hidden_size = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  bool causal = true;                // decoders; BERT attends both ways
  bool has_rotary = false;
  Rotary rotary;
  Eigen::Index sliding_window = -1;  // keys per query, the query's own included (transformers' meaning); -1 none
  std::vector<std::string> layer_types;  // "sliding_attention" / "full_attention" per layer, when given
  double softcap = 0;                // attn_logit_softcapping
  double scale = 0;                  // query_pre_attn_scalar^-1/2 (Gemma 2); 0: 1 / sqrt(head_dim)
  bool attention_bias = false;       // q/k/v/o biases (Llama's attention_bias, gpt-oss); Qwen2: q/k/v only
  // GPT-2: scale_attn_weights (false: scores not divided by sqrt(head_dim)) and
  // scale_attn_by_inverse_layer_idx (scores divided by layer + 1 too); reorder_and_upcast_attn only moves
  // the scale into a float32 product, which is what sdpa computes anyway.
  bool scale_attn_weights = true;
  bool scale_by_inverse_layer = false;
  // QK-norm (sdpa/head_norm.hpp): per head (Qwen3, Gemma 3, Qwen3-Next) or over the projection (OLMo 2),
  // its weights applied as 1 + w (Gemma 3, Qwen3-Next); Llama 4's is weightless, after the rotary, on its
  // rotary layers only (use_qk_norm).
  QkNormKind qk_norm = QkNormKind::kNone;
  bool qk_norm_plus_one = false;
  bool qk_norm_after_rotary = false;
  double rms_norm_eps = 1e-6;
  bool output_gate = false;          // Qwen3-Next: q_proj's rows are [query | gate] per head
  bool has_local_rotary = false;     // Gemma 3: the sliding layers' rotary (rope_local_base_freq)
  Rotary local_rotary;
  std::vector<Eigen::Index> no_rope_layers;  // Llama 4: per layer, 0 marks a layer without rotary (NoPE)
  Eigen::Index attention_chunk_size = -1;    // Llama 4's chunked layers: a key is seen within the query's chunk
  bool temperature_tuning = false;           // Llama 4's NoPE layers (attn_temperature_tuning)
  QueryTemperature temperature;
};

namespace detail {
namespace hf {

[[noreturn]] inline void fail(const std::string& file, const std::string& what) {
  throw SafetensorsError("sdpa: Hugging Face model '" + file + "': " + what);
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(path, "cannot open the config file");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("config.json is not valid JSON: ") + e.what());
  }
}

inline Eigen::Index integer(const nlohmann::json& j, const std::string& path, const char* key, bool required = true,
                            Eigen::Index fallback = 0) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) fail(path, std::string("config.json has no \"") + key + "\"");
    return fallback;
  }
  if (!it->is_number_integer() || it->get<long long>() < 0)
    fail(path, std::string("config.json \"") + key + "\" must be a non-negative integer, but is " + it->dump());
  return static_cast<Eigen::Index>(it->get<long long>());
}

inline double number(const nlohmann::json& j, const std::string& path, const char* key, double fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number()) fail(path, std::string("config.json \"") + key + "\" must be a number, but is " + it->dump());
  return it->get<double>();
}

inline bool boolean(const nlohmann::json& j, const std::string& path, const char* key, bool fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) fail(path, std::string("config.json \"") + key + "\" must be true or false, but is " + it->dump());
  return it->get<bool>();
}

// `key` of j when it is a JSON object; absent or null: an empty object; any other type refused.
inline nlohmann::json object(const nlohmann::json& j, const std::string& path, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nlohmann::json::object();
  if (!it->is_object()) fail(path, std::string("config.json \"") + key + "\" must be an object, but is " + it->dump());
  return *it;
}

// `key` of j when it is a string; absent or null: fallback; any other type refused.
inline std::string text(const nlohmann::json& j, const std::string& path, const char* key, const std::string& fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_string()) fail(path, std::string("config.json \"") + key + "\" must be a string, but is " + it->dump());
  return it->get<std::string>();
}

// `key` of j as a list of strings; absent or null: empty; anything else (a string, a list holding a number)
// refused.
inline std::vector<std::string> texts(const nlohmann::json& j, const std::string& path, const char* key) {
  std::vector<std::string> out;
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_array()) fail(path, std::string("config.json \"") + key + "\" must be a list of strings, but is " + it->dump());
  for (const auto& t : *it) {
    if (!t.is_string())
      fail(path, std::string("config.json \"") + key + "\" must be a list of strings, but holds " + t.dump());
    out.push_back(t.get<std::string>());
  }
  return out;
}

// `key` of j as a list of numbers; absent or null: empty; anything else refused.
inline std::vector<double> numbers(const nlohmann::json& j, const std::string& path, const char* key) {
  std::vector<double> out;
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_array()) fail(path, std::string("config.json \"") + key + "\" must be a list of numbers, but is " + it->dump());
  for (const auto& v : *it) {
    if (!v.is_number()) fail(path, std::string("config.json \"") + key + "\" must be a list of numbers, but holds " + v.dump());
    out.push_back(v.get<double>());
  }
  return out;
}

// The layer index in a prefix such as "model.layers.3.self_attn." or "transformer.h.0.attn.": the last
// all-digit component of at most 9 digits (longer ones name no layer a config has); -1 when there is none.
inline Eigen::Index layer_of(const std::string& prefix) {
  Eigen::Index layer = -1;
  std::size_t start = 0;
  while (start < prefix.size()) {
    const std::size_t dot = prefix.find('.', start);
    const std::string part = prefix.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!part.empty() && part.size() <= 9 && part.find_first_not_of("0123456789") == std::string::npos)
      layer = static_cast<Eigen::Index>(std::stol(part));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return layer;
}

// The rotary of a decoder's config: rope_parameters (transformers 5) or rope_theta + rope_scaling (4), the
// rotated share of each head (partial_rotary_factor).
inline Rotary rope_of(const nlohmann::json& j, const nlohmann::json& rope, const HfAttentionConfig& c);

inline void read_rope(const nlohmann::json& j, HfAttentionConfig& c) {
  nlohmann::json rope = object(j, c.path, "rope_parameters");
  const nlohmann::json scaling = object(j, c.path, "rope_scaling");  // named: items() of a temporary would dangle
  for (const auto& [k, v] : scaling.items()) rope[k] = v;
  c.rotary = rope_of(j, rope, c);
  c.has_rotary = true;
}

// The rotary of one rope parameter set (rope_type, rope_theta, its scaling; j: the config, for the keys a
// parameter set may leave to it).
inline Rotary rope_of(const nlohmann::json& j, const nlohmann::json& rope, const HfAttentionConfig& c) {
  Rotary r;
  const double theta = number(rope, c.path, "rope_theta", number(j, c.path, "rope_theta", 10000.0));
  const double partial = number(rope, c.path, "partial_rotary_factor", number(j, c.path, "partial_rotary_factor", 1.0));
  const Eigen::Index dim = static_cast<Eigen::Index>(static_cast<double>(c.head_dim) * partial);
  std::string type = text(rope, c.path, "rope_type", text(rope, c.path, "type", "default"));
  if (type == "mrope") type = "default";  // Qwen2-VL's transformers 4 configs: default frequencies, sections below
  const Eigen::Index max_positions = integer(j, c.path, "max_position_embeddings", false, 2048);
  const Eigen::Index original = integer(rope, c.path, "original_max_position_embeddings", false,
                                       integer(j, c.path, "original_max_position_embeddings", false, max_positions));
  // yarn without a factor scales from the pretrained length to max_position_embeddings (transformers' rule).
  const double factor = number(rope, c.path, "factor",
                               type == "yarn" && original > 0 ? static_cast<double>(max_positions) / static_cast<double>(original) : 1.0);
  if (dim <= 0 || dim % 2 != 0)
    fail(c.path, "the rotated features (head_dim " + std::to_string(c.head_dim) + " times partial_rotary_factor) are " +
                     std::to_string(dim) + ", not a positive even number");
  if (type == "default") {
    r.dim = dim;
    r.theta = theta;
    r.inv_freq = r.frequencies(dim);
  } else if (type == "linear") {
    r = rope_linear(dim, theta, factor);
  } else if (type == "llama3") {
    r = rope_llama3(dim, theta, factor, number(rope, c.path, "low_freq_factor", 1.0),
                    number(rope, c.path, "high_freq_factor", 4.0), original);
  } else if (type == "yarn") {
    const bool truncate = boolean(rope, c.path, "truncate", true);
    r = rope_yarn(dim, theta, factor, original, number(rope, c.path, "beta_fast", 32.0),
                  number(rope, c.path, "beta_slow", 1.0), truncate);
    const double attention_factor = number(rope, c.path, "attention_factor", 0.0);
    const double mscale = number(rope, c.path, "mscale", 0.0), mscale_all_dim = number(rope, c.path, "mscale_all_dim", 0.0);
    const auto get_mscale = [](double s, double m) { return s <= 1 ? 1.0 : 0.1 * m * std::log(s) + 1.0; };
    if (attention_factor > 0) r.attention_factor = attention_factor;
    else if (mscale > 0 && mscale_all_dim > 0)
      r.attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim);
  } else if (type == "longrope" || type == "su") {
    // Phi-3: factor, unless given, is max_position_embeddings / original_max_position_embeddings.
    const std::vector<double> short_factor = numbers(rope, c.path, "short_factor"), long_factor = numbers(rope, c.path, "long_factor");
    const std::size_t half = static_cast<std::size_t>(dim / 2);
    if (short_factor.size() != half || long_factor.size() != half)
      fail(c.path, "longrope's short_factor and long_factor must hold " + std::to_string(half) + " factors each (rotated features / 2), but hold " +
                       std::to_string(short_factor.size()) + " and " + std::to_string(long_factor.size()));
    const double longrope_factor = number(rope, c.path, "factor", static_cast<double>(max_positions) / static_cast<double>(original));
    try {
      r = rope_longrope(dim, theta, short_factor, long_factor, original, longrope_factor, number(rope, c.path, "attention_factor", 0.0));
    } catch (const std::invalid_argument& e) {
      fail(c.path, std::string("longrope parameters: ") + e.what());
    }
  } else {
    fail(c.path, "rope_type \"" + type + "\" is not one sdpa implements (default, linear, llama3, yarn, longrope)");
  }
  // Qwen2-VL's multimodal sections (frequencies per position stream t, h, w).
  const auto sections = rope.find("mrope_section");
  if (sections != rope.end() && !sections->is_null()) {
    if (!sections->is_array()) fail(c.path, "config.json \"mrope_section\" must be a list of integers, but is " + sections->dump());
    Eigen::Index sum = 0;
    for (const auto& v : *sections) {
      if (!v.is_number_integer() || v.get<long long>() < 0)
        fail(c.path, "config.json \"mrope_section\" must be a list of non-negative integers, but holds " + v.dump());
      r.mrope_section.push_back(static_cast<Eigen::Index>(v.get<long long>()));
      sum += r.mrope_section.back();
    }
    if (sum != dim / 2)
      fail(c.path, "config.json \"mrope_section\" must sum to the rotated features / 2 = " + std::to_string(dim / 2) + ", but sums to " +
                       std::to_string(sum));
  }
  return r;
}

// Gemma 3's two rotaries: transformers 5 keeps one rope parameter set per layer kind in rope_parameters
// ("full_attention", "sliding_attention"); transformers 4 has rope_theta and rope_scaling for the full layers
// and rope_local_base_freq for the sliding ones (whose rotary is never scaled).
inline void read_gemma3_rope(const nlohmann::json& j, HfAttentionConfig& c) {
  const nlohmann::json params = object(j, c.path, "rope_parameters");
  if (params.contains("full_attention") || params.contains("sliding_attention")) {
    c.rotary = rope_of(j, object(params, c.path, "full_attention"), c);
    nlohmann::json local = object(params, c.path, "sliding_attention");
    if (!local.contains("rope_theta")) local["rope_theta"] = number(j, c.path, "rope_local_base_freq", 10000.0);
    c.local_rotary = rope_of(j, local, c);
  } else {
    read_rope(j, c);
    nlohmann::json local = nlohmann::json::object();
    local["rope_theta"] = number(j, c.path, "rope_local_base_freq", 10000.0);
    c.local_rotary = rope_of(j, local, c);
  }
  c.has_rotary = c.has_local_rotary = true;
}

}  // namespace hf
}  // namespace detail

// The layout of a config's model_type (transformers' name; "gemma3" and "llama4", the multimodal models,
// for their text_config). An unknown one throws SafetensorsError naming it.
inline HfLayout hf_layout_of(const std::string& model_type, const std::string& path = "config.json") {
  const std::pair<const char*, HfLayout> known[] = {
      {"bert", HfLayout::kBert},           {"gpt2", HfLayout::kGpt2},           {"llama", HfLayout::kLlama},
      {"mistral", HfLayout::kMistral},     {"qwen2", HfLayout::kQwen2},         {"gemma2", HfLayout::kGemma2},
      {"gpt_oss", HfLayout::kGptOss},      {"qwen3", HfLayout::kQwen3},         {"olmo2", HfLayout::kOlmo2},
      {"gemma3", HfLayout::kGemma3},       {"gemma3_text", HfLayout::kGemma3},  {"qwen3_next", HfLayout::kQwen3Next},
      {"llama4", HfLayout::kLlama4},       {"llama4_text", HfLayout::kLlama4},  {"phi3", HfLayout::kPhi3},
      {"qwen2_vl", HfLayout::kQwen2Vl},    {"qwen2_vl_text", HfLayout::kQwen2Vl},
      {"qwen2_5_vl", HfLayout::kQwen2Vl},  {"qwen2_5_vl_text", HfLayout::kQwen2Vl}};
  for (const auto& [name, layout] : known)
    if (model_type == name) return layout;
  std::string names;
  for (const auto& [name, layout] : known) names += (names.empty() ? "" : ", ") + std::string(name);
  detail::hf::fail(path, "model_type \"" + model_type + "\" is not one sdpa loads (" + names + ")");
}

// Reads config.json for the layout's attention.
inline HfAttentionConfig read_hf_config(const std::string& path, HfLayout layout) {
  namespace hf = detail::hf;
  nlohmann::json j = hf::read_json(path);
  if (!j.is_object()) hf::fail(path, "config.json is not a JSON object");
  // The multimodal models' text part (transformers 5 nests it; flat configs have none).
  if ((layout == HfLayout::kGemma3 || layout == HfLayout::kLlama4 || layout == HfLayout::kQwen2Vl) && j.contains("text_config") && !j["text_config"].is_null()) {
    const nlohmann::json text = hf::object(j, path, "text_config");
    j = text;
  }
  HfAttentionConfig c;
  c.path = path;
  c.layout = layout;
  if (layout == HfLayout::kGpt2) {
    c.hidden_size = hf::integer(j, path, "n_embd");
    c.num_heads = hf::integer(j, path, "n_head");
  } else {
    c.hidden_size = hf::integer(j, path, "hidden_size");
    c.num_heads = hf::integer(j, path, "num_attention_heads");
  }
  if (c.hidden_size <= 0 || c.num_heads <= 0) hf::fail(path, "config.json gives no positive hidden size and head count");
  c.num_kv_heads = hf::integer(j, path, "num_key_value_heads", false, c.num_heads);
  c.head_dim = hf::integer(j, path, "head_dim", false, c.hidden_size / c.num_heads);
  if (c.head_dim <= 0) hf::fail(path, "config.json gives a head_dim of 0");
  // BERT attends both ways unless it is configured as a decoder (transformers: is_causal = is_decoder).
  c.causal = layout != HfLayout::kBert || hf::boolean(j, path, "is_decoder", false);
  if (layout == HfLayout::kGpt2) {
    c.scale_attn_weights = hf::boolean(j, path, "scale_attn_weights", true);
    c.scale_by_inverse_layer = hf::boolean(j, path, "scale_attn_by_inverse_layer_idx", false);
    hf::boolean(j, path, "reorder_and_upcast_attn", false);  // checked; the same float32 arithmetic either way
  }
  if (layout == HfLayout::kBert || layout == HfLayout::kGpt2) return c;
  if (layout == HfLayout::kGemma3) hf::read_gemma3_rope(j, c);
  else hf::read_rope(j, c);
  if (layout == HfLayout::kLlama4) c.rotary.interleaved = true;  // complex pairs (2m, 2m + 1), as Meta's checkpoints
  c.attention_bias = hf::boolean(j, path, "attention_bias", layout == HfLayout::kGptOss);
  // Qwen2 and Qwen3 have a sliding_window that only applies with use_sliding_window.
  const bool qwen = layout == HfLayout::kQwen2 || layout == HfLayout::kQwen3 || layout == HfLayout::kQwen2Vl;
  if (!qwen || hf::boolean(j, path, "use_sliding_window", false))
    c.sliding_window = hf::integer(j, path, "sliding_window", false, -1);
  c.layer_types = hf::texts(j, path, "layer_types");
  const char* other_type = layout == HfLayout::kLlama4 ? "chunked_attention" : layout == HfLayout::kQwen3Next ? "linear_attention" : "sliding_attention";
  for (const std::string& t : c.layer_types)
    if (t != other_type && t != "full_attention")
      hf::fail(path, "config.json \"layer_types\" holds \"" + t + "\"; sdpa follows \"" + other_type + "\" and \"full_attention\" for " +
                         hf_layout_name(layout));
  // Qwen2 / Qwen3 / Qwen2-VL configs without layer_types: the window, when used, holds from max_window_layers on.
  if (qwen && c.layer_types.empty() && c.sliding_window > 0) {
    const Eigen::Index layers = hf::integer(j, path, "num_hidden_layers"), from = hf::integer(j, path, "max_window_layers", false, 28);
    for (Eigen::Index i = 0; i < layers; ++i) c.layer_types.push_back(i >= from ? "sliding_attention" : "full_attention");
  }
  c.rms_norm_eps = hf::number(j, path, "rms_norm_eps", 1e-6);
  if (!(c.rms_norm_eps > 0)) hf::fail(path, "config.json \"rms_norm_eps\" must be positive, but is " + std::to_string(c.rms_norm_eps));
  switch (layout) {
    case HfLayout::kQwen3: c.qk_norm = QkNormKind::kHead; break;
    case HfLayout::kOlmo2: c.qk_norm = QkNormKind::kProjection; break;
    case HfLayout::kGemma3:
    case HfLayout::kQwen3Next:
      c.qk_norm = QkNormKind::kHead;
      c.qk_norm_plus_one = true;
      break;
    case HfLayout::kLlama4:
      if (hf::boolean(j, path, "use_qk_norm", true)) {
        c.qk_norm = QkNormKind::kHead;
        c.qk_norm_after_rotary = true;
      }
      break;
    default: break;
  }
  c.output_gate = layout == HfLayout::kQwen3Next;
  if (layout == HfLayout::kPhi3) c.attention_bias = false;  // Phi-3's qkv_proj and o_proj have no biases
  if (layout == HfLayout::kGemma3) {
    c.softcap = hf::number(j, path, "attn_logit_softcapping", 0.0);
    c.scale = 1.0 / std::sqrt(hf::number(j, path, "query_pre_attn_scalar", 256.0));
    if (hf::boolean(j, path, "use_bidirectional_attention", false))
      hf::fail(path, "config.json \"use_bidirectional_attention\": true (EmbeddingGemma) is not one sdpa follows");
    if (c.layer_types.empty()) {
      // Configs without layer_types: every sliding_window_pattern-th layer is full (transformers' default 6).
      const Eigen::Index pattern = hf::integer(j, path, "sliding_window_pattern", false, 6);
      const Eigen::Index layers = hf::integer(j, path, "num_hidden_layers");
      for (Eigen::Index i = 0; i < layers; ++i)
        c.layer_types.push_back(pattern > 0 && (i + 1) % pattern == 0 ? "full_attention" : "sliding_attention");
    }
  }
  if (layout == HfLayout::kLlama4) {
    c.sliding_window = -1;
    const auto it = j.find("no_rope_layers");
    const Eigen::Index layers = hf::integer(j, path, "num_hidden_layers");
    if (it != j.end() && !it->is_null() && !(it->is_array() && it->empty())) {
      if (!it->is_array()) hf::fail(path, "config.json \"no_rope_layers\" must be a list of 0 and 1, but is " + it->dump());
      for (const auto& v : *it) {
        if (!v.is_number_integer() || (v.get<long long>() != 0 && v.get<long long>() != 1))
          hf::fail(path, "config.json \"no_rope_layers\" must be a list of 0 and 1, but holds " + v.dump());
        c.no_rope_layers.push_back(static_cast<Eigen::Index>(v.get<long long>()));
      }
    } else {
      const Eigen::Index interval = hf::integer(j, path, "no_rope_layer_interval", false, 4);
      for (Eigen::Index i = 0; i < layers; ++i) c.no_rope_layers.push_back(interval > 0 && (i + 1) % interval != 0 ? 1 : 0);
    }
    c.attention_chunk_size = hf::integer(j, path, "attention_chunk_size", false, -1);
    if (c.attention_chunk_size == 0) hf::fail(path, "config.json \"attention_chunk_size\" must be positive or null, but is 0");
    if (c.layer_types.empty())
      for (const Eigen::Index rope : c.no_rope_layers)
        c.layer_types.push_back(rope != 0 && c.attention_chunk_size > 0 ? "chunked_attention" : "full_attention");
    c.temperature_tuning = hf::boolean(j, path, "attn_temperature_tuning", true);
    c.temperature.floor_scale = hf::number(j, path, "floor_scale", 8192.0);
    c.temperature.attn_scale = hf::number(j, path, "attn_scale", 0.1);
    if (c.temperature_tuning) {
      try {
        detail::check_temperature("read_hf_config", c.temperature);
      } catch (const std::invalid_argument& e) {
        hf::fail(path, std::string("config.json's floor_scale / attn_scale: ") + e.what());
      }
    }
  }
  if (layout == HfLayout::kGemma2) {
    c.softcap = hf::number(j, path, "attn_logit_softcapping", 0.0);
    const double scalar = hf::number(j, path, "query_pre_attn_scalar", static_cast<double>(c.head_dim));
    c.scale = 1.0 / std::sqrt(scalar);
  }
  return c;
}

// Reads config.json for the attention of its model_type (hf_layout_of).
inline HfAttentionConfig read_hf_config(const std::string& path) {
  const nlohmann::json j = detail::hf::read_json(path);
  if (!j.is_object()) detail::hf::fail(path, "config.json is not a JSON object");
  return read_hf_config(path, hf_layout_of(detail::hf::text(j, path, "model_type", ""), path));
}

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

// ---- Multi-head latent attention: deepseek_v2, deepseek_v3, kimi_k2 (sdpa/latent_attention.hpp) ----

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
