// Must not compile: a rank-2 input. The first error must be sdpa's static_assert.
#include <sdpa/sdpa.hpp>
int main() {
  sdpa::ScaledDotProductAttention<float> att(8, 4, 4, 2);
  Eigen::Tensor<float, 2, Eigen::RowMajor> x(3, 8);
  x.setRandom();
  auto y = att(x, x, x);
  return static_cast<int>(y.size());
}
