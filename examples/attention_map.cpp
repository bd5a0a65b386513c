// The attention map of a small causal run with ALiBi, as a PNG heatmap: the probabilities of every head
// for one sequence (AttentionOptions::probabilities), one panel per head. ALiBi's slopes give each head
// its own reach: the steepest head attends to the last few tokens, the flattest almost evenly to all.
//
//   attention_map [OUT.png]        (default attention_map.png)
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include <sdpa/sdpa.hpp>

#include "support/png.hpp"

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "attention_map.png";
  const Eigen::Index n = 48, d_model = 64, heads = 4;
  sdpa::manual_seed(2024);  // reproducible weights
  sdpa::ScaledDotProductAttention<float> att(d_model, /*d_k=*/16, /*d_v=*/16, heads);
  att.init_weights(sdpa::init::PyTorchDefaultPolicy{});
  att.eval();

  Eigen::Tensor<float, 3, Eigen::RowMajor> x(1, n, d_model);
  sdpa::Philox gen(7);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(sdpa::normal_double(gen));

  sdpa::AttentionOptions<float> options;
  options.causal = true;
  options.alibi_slopes = sdpa::alibi_slopes<float>(heads);  // 1/4, 1/16, 1/64, 1/256
  Eigen::Tensor<float, 4, Eigen::RowMajor> p;               // (1, heads, n, n), filled by the call
  options.probabilities = &p;
  att(x, x, x, options);

  // Every row sums to 1 and the keys after the query are exactly 0.
  for (Eigen::Index h = 0; h < heads; ++h)
    for (Eigen::Index q = 0; q < n; ++q) {
      double sum = 0;
      for (Eigen::Index k = 0; k < n; ++k) {
        if (k > q && p(0, h, q, k) != 0.0f) {
          std::cerr << "a hidden key has probability " << p(0, h, q, k) << "\n";
          return 1;
        }
        sum += p(0, h, q, k);
      }
      if (std::abs(sum - 1.0) > 1e-5) {
        std::cerr << "row " << q << " of head " << h << " sums to " << sum << "\n";
        return 1;
      }
    }

  // Panels side by side: each score a cell of 4 x 4 pixels, colour sqrt(p) (so that small probabilities
  // still show), hidden keys dark grey, 8 white pixels between panels.
  const int cell = 4, gap = 8, side = static_cast<int>(n) * cell;
  const int width = static_cast<int>(heads) * side + (static_cast<int>(heads) - 1) * gap, height = side;
  std::vector<sdpa_examples::Rgb> pixels(static_cast<std::size_t>(width) * static_cast<std::size_t>(height),
                                         sdpa_examples::Rgb{255, 255, 255});
  for (Eigen::Index h = 0; h < heads; ++h)
    for (Eigen::Index q = 0; q < n; ++q)
      for (Eigen::Index k = 0; k < n; ++k) {
        const sdpa_examples::Rgb colour =
            k > q ? sdpa_examples::Rgb{40, 40, 40} : sdpa_examples::viridis(std::sqrt(p(0, h, q, k)));
        const int x0 = static_cast<int>(h) * (side + gap) + static_cast<int>(k) * cell, y0 = static_cast<int>(q) * cell;
        for (int dy = 0; dy < cell; ++dy)
          for (int dx = 0; dx < cell; ++dx)
            pixels[static_cast<std::size_t>(y0 + dy) * static_cast<std::size_t>(width) + static_cast<std::size_t>(x0 + dx)] = colour;
      }
  sdpa_examples::write_png(path, width, height, pixels);
  if (!sdpa_examples::check_png(path, width, height)) {
    std::cerr << "the PNG written to " << path << " does not read back\n";
    return 1;
  }
  std::cout << "wrote " << path << " (" << width << " x " << height << "): heads' attention to their own token: ";
  for (Eigen::Index h = 0; h < heads; ++h) std::cout << (h ? ", " : "") << p(0, h, n - 1, n - 1);
  std::cout << "\n";
  return 0;
}
