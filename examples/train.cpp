// Training with sdpa: a student ScaledDotProductAttention learns the mapping of a fixed, randomly
// initialised teacher of the same shape (causal self-attention over random sequences), by mean squared
// error, forward with a ForwardState, backward, and Adam (sdpa/optim.hpp). It prints the loss as it goes,
// writes the loss curve as a PNG, and fails unless the loss fell at least 100-fold.
//
//   train [STEPS] [OUT.png]        (defaults: 3000 steps, train_loss.png)
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <sdpa/optim.hpp>
#include <sdpa/sdpa.hpp>

#include "support/png.hpp"

namespace {

using Tensor3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;

// The loss curve: log10(loss) against the step, on a white background with light grid lines per decade.
void plot(const std::vector<double>& loss, const std::string& path) {
  const int width = 640, height = 320, margin = 20;
  std::vector<sdpa_examples::Rgb> pixels(static_cast<std::size_t>(width) * height, sdpa_examples::Rgb{255, 255, 255});
  auto put = [&](int x, int y, sdpa_examples::Rgb c) {
    if (x >= 0 && x < width && y >= 0 && y < height) pixels[static_cast<std::size_t>(y) * width + x] = c;
  };
  double lo = 1e300, hi = -1e300;
  for (double l : loss) {
    lo = std::min(lo, std::log10(l));
    hi = std::max(hi, std::log10(l));
  }
  lo = std::floor(lo);
  hi = std::ceil(hi);
  auto y_of = [&](double log_loss) {
    return margin + static_cast<int>((hi - log_loss) / (hi - lo) * (height - 2 * margin));
  };
  for (double decade = lo; decade <= hi; decade += 1)
    for (int x = margin; x < width - margin; ++x) put(x, y_of(decade), {220, 220, 220});
  for (int y = margin; y < height - margin; ++y) put(margin, y, {120, 120, 120});
  for (int x = margin; x < width - margin; ++x) put(x, height - margin, {120, 120, 120});
  const double n = static_cast<double>(loss.size() - 1);
  for (std::size_t i = 1; i < loss.size(); ++i) {
    const int x0 = margin + static_cast<int>((static_cast<double>(i) - 1) / n * (width - 2 * margin));
    const int x1 = margin + static_cast<int>(static_cast<double>(i) / n * (width - 2 * margin));
    const int y0 = y_of(std::log10(loss[i - 1])), y1 = y_of(std::log10(loss[i]));
    const int steps = std::max({1, std::abs(x1 - x0), std::abs(y1 - y0)});
    for (int s = 0; s <= steps; ++s)
      for (int t = 0; t < 2; ++t)
        put(x0 + (x1 - x0) * s / steps, y0 + (y1 - y0) * s / steps + t, {31, 119, 180});
  }
  sdpa_examples::write_png(path, width, height, pixels);
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 3000;
  const std::string path = argc > 2 ? argv[2] : "train_loss.png";
  const Eigen::Index batch = 8, n = 16, d_model = 32;

  sdpa::manual_seed(11);  // the teacher and the student start from different draws of PyTorch's default init
  sdpa::ScaledDotProductAttention<float> teacher(d_model, 8, 8, 4, 0.0f), student(d_model, 8, 8, 4, 0.0f);
  teacher.init_weights(sdpa::init::PyTorchDefaultPolicy{});
  student.init_weights(sdpa::init::PyTorchDefaultPolicy{});
  teacher.eval();
  student.train();  // no dropout here (p = 0); training mode as in PyTorch

  sdpa::AttentionOptions<float> causal;
  causal.causal = true;
  sdpa::optim::Adam<float> adam(/*lr=*/3e-3);
  sdpa::Philox gen(12);
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    Tensor3 x(batch, n, d_model);
    for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(sdpa::normal_double(gen));
    const Tensor3 target = teacher(x, x, x, causal);
    sdpa::ForwardState<float> state;
    const Tensor3 y = student.forward(x, x, x, causal, state);
    // Mean squared error and its gradient with respect to the output.
    Tensor3 grad(y.dimensions());
    double loss = 0;
    const double count = static_cast<double>(y.size());
    for (Eigen::Index i = 0; i < y.size(); ++i) {
      const double e = static_cast<double>(y.data()[i]) - static_cast<double>(target.data()[i]);
      loss += e * e / count;
      grad.data()[i] = static_cast<float>(2.0 * e / count);
    }
    losses.push_back(loss);
    auto gradients = student.backward(grad, state);
    adam.step(student, gradients);
    if (step % 100 == 0 || step == steps - 1) std::cout << "step " << step << "  loss " << loss << "\n";
  }
  plot(losses, path);
  // Averaged over a few steps, as each step sees a new random batch.
  auto average = [&](std::size_t from) {
    double s = 0;
    for (std::size_t i = from; i < from + 20; ++i) s += losses[i];
    return s / 20;
  };
  const double first = average(0), last = average(losses.size() - 20);
  std::cout << "loss fell " << first / last << "x (from " << first << " to " << last << "); curve: " << path << "\n";
  return first / last >= 100.0 ? 0 : 1;
}
