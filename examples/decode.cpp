// A tiny greedy generator: token embeddings, one causal attention layer with a residual connection, and
// an output head, all with fixed random weights. It generates the same tokens twice, once recomputing the
// layer over the whole sequence for every new token and once with a KVCache (one step per token), and
// prints the tokens and both speeds. Then it generates again with the cache stored as bfloat16, float16 and
// int8 (sdpa::Storage) and prints how many of the tokens agree with the float cache's (greedy decoding
// follows the first different token elsewhere, so it counts the tokens up to the first difference) and the
// cache's bytes.
//
//   decode [TOKENS]        (default 256 new tokens after an 8-token prompt)
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <vector>

#include <sdpa/sdpa.hpp>

namespace {

using Tensor3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;
constexpr Eigen::Index kVocab = 256, kModel = 128;

struct Model {
  Eigen::MatrixXf embedding = Eigen::MatrixXf::Zero(kModel, kVocab);  // column t: token t's vector
  Eigen::MatrixXf head = Eigen::MatrixXf::Zero(kVocab, kModel);       // logits = head * hidden
  sdpa::ScaledDotProductAttention<float> attention{kModel, 32, 32, 4, 0.0f};

  Model() {
    sdpa::manual_seed(1);
    attention = sdpa::ScaledDotProductAttention<float>(kModel, 32, 32, 4, 0.0f);
    attention.init_weights(sdpa::init::PyTorchDefaultPolicy{});
    attention.eval();
    sdpa::Philox gen(2);
    for (Eigen::Index i = 0; i < embedding.size(); ++i) embedding.data()[i] = static_cast<float>(sdpa::normal_double(gen));
    for (Eigen::Index i = 0; i < head.size(); ++i) head.data()[i] = static_cast<float>(sdpa::normal_double(gen) * 0.1);
  }

  // The embeddings of tokens as a (1, n, d_model) tensor.
  Tensor3 embed(const std::vector<int>& tokens) const {
    Tensor3 x(1, static_cast<Eigen::Index>(tokens.size()), kModel);
    for (std::size_t t = 0; t < tokens.size(); ++t)
      for (Eigen::Index d = 0; d < kModel; ++d) x(0, static_cast<Eigen::Index>(t), d) = embedding(d, tokens[t]);
    return x;
  }

  // The greedy next token after position t of x (its embedding) and y (the layer's output there).
  int next(const Tensor3& x, const Tensor3& y, Eigen::Index tx, Eigen::Index ty) const {
    Eigen::VectorXf hidden(kModel);
    for (Eigen::Index d = 0; d < kModel; ++d) hidden(d) = x(0, tx, d) + y(0, ty, d);
    Eigen::Index best = 0;
    (head * hidden).maxCoeff(&best);
    return static_cast<int>(best);
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int new_tokens = argc > 1 ? std::atoi(argv[1]) : 256;
  const Model model;
  const std::vector<int> prompt{1, 2, 3, 4, 5, 6, 7, 8};
  using Clock = std::chrono::steady_clock;

  // Without a cache: the whole sequence through the layer for every new token.
  std::vector<int> slow = prompt;
  sdpa::AttentionOptions<float> causal;
  causal.causal = true;
  const auto t0 = Clock::now();
  for (int i = 0; i < new_tokens; ++i) {
    const Tensor3 x = model.embed(slow);
    const Tensor3 y = model.attention(x, x, x, causal);
    const Eigen::Index last = x.dimension(1) - 1;
    slow.push_back(model.next(x, y, last, last));
  }
  const double slow_s = std::chrono::duration<double>(Clock::now() - t0).count();

  // With a cache: the prompt in one step, then one step per token.
  const auto generate = [&](sdpa::KVCache<float>& cache) {
    std::vector<int> tokens = prompt;
    Tensor3 x = model.embed(prompt);
    Tensor3 y = model.attention.step(x, cache);
    for (int i = 0; i < new_tokens; ++i) {
      tokens.push_back(model.next(x, y, x.dimension(1) - 1, y.dimension(1) - 1));
      x = model.embed({tokens.back()});
      y = model.attention.step(x, cache);
    }
    return tokens;
  };
  sdpa::KVCache<float> cache(model.attention, /*batch=*/1);
  const auto t1 = Clock::now();
  const std::vector<int> fast = generate(cache);
  const double fast_s = std::chrono::duration<double>(Clock::now() - t1).count();

  std::cout << "tokens:";
  for (std::size_t i = prompt.size(); i < fast.size() && i < prompt.size() + 24; ++i) std::cout << ' ' << fast[i];
  std::cout << (fast.size() > prompt.size() + 24 ? " ...\n" : "\n");
  std::cout << "without a cache: " << new_tokens / slow_s << " tokens/s\n"
            << "with a KVCache:  " << new_tokens / fast_s << " tokens/s (" << slow_s / fast_s << "x), cache of "
            << cache.size() << " entries\n";
  // Narrow caches: the tokens that agree with the float cache's, up to the first that differs.
  for (sdpa::Storage s : {sdpa::Storage::kBFloat16, sdpa::Storage::kFloat16, sdpa::Storage::kInt8}) {
    sdpa::KVCache<float> narrow(model.attention, 1, 0, s);
    const std::vector<int> tokens = generate(narrow);
    std::size_t same = 0;
    while (prompt.size() + same < tokens.size() && tokens[prompt.size() + same] == fast[prompt.size() + same]) ++same;
    std::cout << sdpa::storage_name(s) << " cache: " << same << " of " << new_tokens << " tokens as the float cache's, "
              << narrow.bytes() << " bytes (float: " << cache.bytes() << ")\n";
  }
  // The two generate the same tokens (a near tie could in principle round differently; none here).
  if (slow != fast) {
    std::cerr << "the cached and the recomputed generations differ\n";
    return 1;
  }
  return 0;
}
