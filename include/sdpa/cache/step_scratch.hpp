// The scratch a decoding step needs, kept by a cache between steps so that once the cache has the capacity
// a step allocates nothing: the step's projected queries, its attention output (and an output gate's
// values), its new keys and values in Scalar before a narrow cache converts them, the decoding kernel's
// workspace, and the parts a PagedKVCache step merges (a cascade level's stacked queries, outputs, log-sum-exps
// and query positions). A cache owns one and hands it to the decoding entry points (sdpa/module/decoding.hpp); what it
// holds between steps means nothing.
#pragma once

#include "sdpa/config.hpp"

#include <utility>
#include <vector>

#include "sdpa/detail/buffer.hpp"
#include "sdpa/kernels/decode.hpp"

SDPA_NAMESPACE_BEGIN
namespace detail {

template <typename Scalar>
struct StepScratch {
  Buffer<Scalar> queries, attention, stage, parts;
  std::vector<Eigen::Index> positions;
  kernels::DecodeWorkspace<Scalar> decode;

  void swap(StepScratch& other) noexcept {
    std::swap(queries, other.queries);
    std::swap(attention, other.attention);
    std::swap(stage, other.stage);
    std::swap(parts, other.parts);
    std::swap(positions, other.positions);
    std::swap(decode, other.decode);
  }
};

}  // namespace detail
SDPA_NAMESPACE_END
