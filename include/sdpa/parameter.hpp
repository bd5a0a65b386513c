// ParameterRef: one parameter (or its gradient) reached by its PyTorch state_dict name, with its data and
// shape; what named_parameters() of the module and of Gradients return.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <string>
#include <vector>

SDPA_NAMESPACE_BEGIN

// A parameter reached by its PyTorch state_dict name; T is Scalar or const Scalar.
template <typename T>
struct ParameterRef {
  std::string name;
  T* data = nullptr;
  std::vector<Eigen::Index> shape;

  Eigen::Index size() const noexcept {
    Eigen::Index n = 1;
    for (Eigen::Index d : shape) n *= d;
    return n;
  }
};

SDPA_NAMESPACE_END
