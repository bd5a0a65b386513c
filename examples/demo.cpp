// The seed project's demo: a (50, 49, 512) input through ScaledDotProductAttention(d_model=512, d_k=512,
// d_v=512, h=8) prints the output shape.
#include <iostream>

#include <sdpa/sdpa.hpp>

int main() {
  sdpa::ScaledDotProductAttention<float> sa(/*d_model=*/512, /*d_k=*/512, /*d_v=*/512, /*h=*/8);
  Eigen::Tensor<float, 3, Eigen::RowMajor> input(50, 49, 512);
  input.setRandom();
  const auto output = sa(input, input, input);
  std::cout << "(" << output.dimension(0) << ", " << output.dimension(1) << ", " << output.dimension(2) << ")\n";
  return 0;
}
