// Must not compile: an Eigen::Matrix is not a (batch, seq, d_model) tensor. The first error must be sdpa's.
#include <sdpa/sdpa.hpp>
int main() {
  sdpa::ScaledDotProductAttention<float> att(8, 4, 4, 2);
  Eigen::MatrixXf x(3, 8);
  auto y = att(x, x, x);
  return static_cast<int>(y.size());
}
