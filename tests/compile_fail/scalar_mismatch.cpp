// Must not compile: double inputs to a float module. The first error must be sdpa's static_assert.
#include <sdpa/sdpa.hpp>
int main() {
  sdpa::ScaledDotProductAttention<float> att(8, 4, 4, 2);
  Eigen::Tensor<double, 3, Eigen::RowMajor> x(1, 3, 8);
  x.setRandom();
  auto y = att(x, x, x);
  return static_cast<int>(y.size());
}
