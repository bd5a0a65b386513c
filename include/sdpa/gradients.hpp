// What a backward pass returns: the gradient of the loss with respect to each input of the call and each
// parameter of the module, in the shapes of the things they are gradients of (PyTorch's .grad), and the
// parameter gradients by state_dict name, in the module's order, for optimizers (sdpa/optim.hpp).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <string>
#include <vector>

#include "sdpa/parameter.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
struct LinearGradients {
  Eigen::Tensor<Scalar, 2, Eigen::RowMajor> weight;  // (out_features, in_features)
  Eigen::Tensor<Scalar, 1, Eigen::RowMajor> bias;    // (out_features)
};

template <typename Scalar>
struct Gradients {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> queries, keys, values;  // d loss / d each input, its shape
  LinearGradients<Scalar> fc_q, fc_k, fc_v, fc_o;
  LinearGradients<Scalar> fc_g;        // the output gate's projection; empty without a gate
  std::vector<Scalar> q_norm, k_norm;  // the QK-norm's weights; empty without them
  // The given tensors' shapes (broadcast dimensions summed); empty when not given.
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor> attention_weights, attention_bias;
  std::vector<Scalar> sinks;  // one per query head when the call had sinks, else empty
  // One per ScoreTable the call's score program reads (AttentionOptions::program), in its order.
  std::vector<Eigen::Tensor<Scalar, 2, Eigen::RowMajor>> tables;

  // The parameter gradients by state_dict name, in the module's order ("fc_q.weight", "fc_q.bias", ...).
  std::vector<ParameterRef<Scalar>> named_parameters() {
    std::vector<ParameterRef<Scalar>> out;
    const char* names[4] = {"fc_q", "fc_k", "fc_v", "fc_o"};
    LinearGradients<Scalar>* layers[4] = {&fc_q, &fc_k, &fc_v, &fc_o};
    for (std::size_t i = 0; i < 4; ++i) {
      LinearGradients<Scalar>& g = *layers[i];
      out.push_back({std::string(names[i]) + ".weight", g.weight.data(), {g.weight.dimension(0), g.weight.dimension(1)}});
      out.push_back({std::string(names[i]) + ".bias", g.bias.data(), {g.bias.dimension(0)}});
    }
    if (fc_g.weight.size() > 0) {
      out.push_back({"fc_g.weight", fc_g.weight.data(), {fc_g.weight.dimension(0), fc_g.weight.dimension(1)}});
      out.push_back({"fc_g.bias", fc_g.bias.data(), {fc_g.bias.dimension(0)}});
    }
    if (!q_norm.empty()) out.push_back({"q_norm.weight", q_norm.data(), {static_cast<Eigen::Index>(q_norm.size())}});
    if (!k_norm.empty()) out.push_back({"k_norm.weight", k_norm.data(), {static_cast<Eigen::Index>(k_norm.size())}});
    return out;
  }
};

SDPA_NAMESPACE_END
