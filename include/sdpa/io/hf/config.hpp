// Hugging Face config.json for sdpa's attention blocks: the model families sdpa loads (HfLayout, by
// transformers' model_type), what an attention block needs from the config (HfAttentionConfig: shape,
// rotary and its scaling, windows, softcap, scale, QK-norm, gates, chunks), and read_hf_config, which
// follows or refuses every key that changes the attention's arithmetic. The loaders are sdpa/io/hf.hpp's.
// Needs nlohmann_json (CMake target sdpa::io).
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
#include "sdpa/head_norm.hpp"
#include "sdpa/io/safetensors_format.hpp"
#include "sdpa/options.hpp"
#include "sdpa/rotary.hpp"

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

SDPA_NAMESPACE_END
