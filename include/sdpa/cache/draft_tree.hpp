// A tree of draft tokens (speculative decoding: Medusa, EAGLE, a draft model's candidates) as the caches hold
// it between ScaledDotProductAttention::step_tree and accept: token j's parent is parents[j], an earlier
// draft token or -1 for the sequence's last held token. A token sits at depth 1 + its parent's (1 under the
// sequence), so at position position() + depth - 1, as the tokens of an accepted chain are when appended one
// by one.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <vector>

#include "sdpa/error.hpp"

SDPA_NAMESPACE_BEGIN
namespace detail {

// Each token's depth (1 under the sequence); std::invalid_argument naming `where` for a parent that is not
// -1 or an earlier token.
inline std::vector<Eigen::Index> draft_depths(const char* where, const std::vector<Eigen::Index>& parents) {
  std::vector<Eigen::Index> depth(parents.size());
  for (std::size_t j = 0; j < parents.size(); ++j) {
    const Eigen::Index p = parents[j];
    if (p < -1 || p >= static_cast<Eigen::Index>(j))
      throw_invalid(where, concat("parents[", j, "]"),
                    j == 0 ? std::string("-1 (the sequence's last token: a parent comes before its child)")
                           : concat("-1 (the sequence's last token) or an earlier draft, in [0, ", j, ")"),
                    p);
    depth[j] = p < 0 ? 1 : depth[static_cast<std::size_t>(p)] + 1;
  }
  return depth;
}

// Whether draft `k` is draft `j` or one of its ancestors.
inline bool draft_ancestor(const std::vector<Eigen::Index>& parents, Eigen::Index k, Eigen::Index j) noexcept {
  for (; j >= 0; j = parents[static_cast<std::size_t>(j)])
    if (j == k) return true;
  return false;
}

// `path` must be a chain of the tree from under the sequence: path[0]'s parent -1, path[i]'s parent
// path[i - 1] (std::invalid_argument naming `where` otherwise).
inline void check_draft_path(const char* where, const std::vector<Eigen::Index>& parents,
                             const std::vector<Eigen::Index>& path) {
  const Eigen::Index n = static_cast<Eigen::Index>(parents.size());
  for (std::size_t i = 0; i < path.size(); ++i) {
    if (path[i] < 0 || path[i] >= n)
      throw_invalid(where, concat("path[", i, "]"), concat("a pending draft token, in [0, ", n, ")"), path[i]);
    const Eigen::Index want = i == 0 ? -1 : path[i - 1];
    if (parents[static_cast<std::size_t>(path[i])] != want)
      throw_invalid(where, concat("path[", i, "]"),
                    i == 0 ? std::string("a draft whose parent is -1 (the path starts under the sequence)")
                           : concat("a child of path[", i - 1, "] = ", want, " (the path is a chain of the tree)"),
                    concat(path[i], " (whose parent is ", parents[static_cast<std::size_t>(path[i])], ")"));
  }
}

}  // namespace detail
SDPA_NAMESPACE_END
