// A consumer project's program: builds the module through the installed or embedded package, runs a
// small cross-attention and checks the output shape and that it is finite.
#include <cmath>
#include <iostream>

#include <sdpa/sdpa.hpp>

int main() {
  sdpa::ScaledDotProductAttention<float> att(16, 4, 6, 2, 0.0f);
  att.eval();
  Eigen::Tensor<float, 3, Eigen::RowMajor> q(2, 3, 16), kv(2, 5, 16);
  q.setRandom();
  kv.setRandom();
  const auto y = att(q, kv, kv);
  if (y.dimension(0) != 2 || y.dimension(1) != 3 || y.dimension(2) != 16) {
    std::cerr << "wrong output shape\n";
    return 1;
  }
  for (Eigen::Index i = 0; i < y.size(); ++i) {
    if (!std::isfinite(y.data()[i])) {
      std::cerr << "non-finite output\n";
      return 1;
    }
  }
  std::cout << "consumer ok: (" << y.dimension(0) << ", " << y.dimension(1) << ", " << y.dimension(2) << ")\n";
  return 0;
}
