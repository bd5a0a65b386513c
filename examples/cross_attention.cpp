// Cross-attention over a padded batch: each query sequence attends to a memory whose real length varies
// per batch element; the padding keys are hidden with a key-padding mask built from the lengths.
#include <iostream>
#include <vector>

#include <sdpa/sdpa.hpp>

int main() {
  const Eigen::Index batch = 3, nq = 4, nk = 10, d_model = 32;
  sdpa::ScaledDotProductAttention<float> att(d_model, /*d_k=*/8, /*d_v=*/16, /*h=*/4);
  att.eval();  // no dropout at inference

  Eigen::Tensor<float, 3, Eigen::RowMajor> queries(batch, nq, d_model), memory(batch, nk, d_model);
  queries.setRandom();
  memory.setRandom();

  // Batch element b has lengths[b] real keys; the rest of its nk rows are padding.
  const std::vector<Eigen::Index> lengths{10, 6, 1};
  const sdpa::Mask padding = sdpa::key_padding_mask(lengths, nk);  // (batch, 1, 1, nk), true = masked

  // Two worker threads; pass nullptr (the default) to run on the calling thread.
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  const auto out = att(queries, memory, memory, &padding, nullptr, &device);

  // Changing a padding key must not change the output of its batch element.
  Eigen::Tensor<float, 3, Eigen::RowMajor> changed = memory;
  for (Eigen::Index d = 0; d < d_model; ++d) changed(1, nk - 1, d) = 100.0f;
  const auto out2 = att(queries, changed, changed, &padding, nullptr, &device);
  float diff = 0;
  for (Eigen::Index q = 0; q < nq; ++q)
    for (Eigen::Index d = 0; d < d_model; ++d) diff = std::max(diff, std::abs(out(1, q, d) - out2(1, q, d)));

  std::cout << "output shape: (" << out.dimension(0) << ", " << out.dimension(1) << ", " << out.dimension(2)
            << ")\n"
            << "max change from editing a padding key: " << diff << "\n";
  return diff == 0.0f ? 0 : 1;
}
