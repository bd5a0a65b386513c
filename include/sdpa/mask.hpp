// Broadcast views of the 4-d attention_mask and attention_weights tensors, whose every dimension is
// either 1 or the full size of (batch, heads, nq, nk), and helpers that build the usual masks: key
// padding from sequence lengths, and causal. A broadcast dimension gets stride 0, so kernels index
// the view with full coordinates and never expand the tensor.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>
#include <string>
#include <vector>

#include "sdpa/error.hpp"

SDPA_NAMESPACE_BEGIN

using Mask = Eigen::Tensor<bool, 4, Eigen::RowMajor>;

template <typename T>
struct BroadcastView {
  const T* data = nullptr;
  std::array<Eigen::Index, 4> stride{};  // 0 along broadcast dimensions

  explicit operator bool() const noexcept { return data != nullptr; }
  // Offset of the first element of row (b, h, q): add k * stride[3] for key k.
  Eigen::Index row_offset(Eigen::Index b, Eigen::Index h, Eigen::Index q) const noexcept {
    return b * stride[0] + h * stride[1] + q * stride[2];
  }
  const T& operator()(Eigen::Index b, Eigen::Index h, Eigen::Index q, Eigen::Index k) const noexcept {
    return data[row_offset(b, h, q) + k * stride[3]];
  }
};

// Checks that every dimension of t is 1 or full[i] and returns the view; nullptr gives an empty view.
template <typename T>
BroadcastView<T> make_broadcast_view(const Eigen::Tensor<T, 4, Eigen::RowMajor>* t,
                                     const std::array<Eigen::Index, 4>& full, const char* where,
                                     const char* name) {
  BroadcastView<T> view;
  if (t == nullptr) return view;
  static const char* const kAxis[4] = {"batch", "heads", "queries", "keys"};
  Eigen::Index dense = 1;
  for (std::size_t i = 4; i-- > 0;) {
    const Eigen::Index d = t->dimension(i);
    if (d != 1 && d != full[i]) {
      detail::throw_invalid(where, detail::concat(name, " dimension ", i, " (", kAxis[i], ")"),
                            detail::concat("1 or ", full[i], " to broadcast over ",
                                           detail::shape_string(full)),
                            detail::concat(d, " (", name, " shape ", detail::shape_string(t->dimensions()), ")"));
    }
    view.stride[i] = d == 1 ? 0 : dense;
    dense *= d;
  }
  view.data = t->data();
  return view;
}

// (batch, 1, 1, nk) mask that hides the keys at and past each batch element's length, as a key-padding
// mask for padded batches. Lengths must lie in [0, nk].
inline Mask key_padding_mask(const std::vector<Eigen::Index>& lengths, Eigen::Index nk) {
  if (nk < 0) detail::throw_invalid("key_padding_mask", "nk", "non-negative", nk);
  const auto batch = static_cast<Eigen::Index>(lengths.size());
  Mask mask(batch, 1, 1, nk);
  for (Eigen::Index b = 0; b < batch; ++b) {
    const Eigen::Index len = lengths[static_cast<std::size_t>(b)];
    if (len < 0 || len > nk) {
      detail::throw_invalid("key_padding_mask", detail::concat("lengths[", b, "]"),
                            detail::concat("in [0, ", nk, "]"), len);
    }
    for (Eigen::Index k = 0; k < nk; ++k) mask(b, 0, 0, k) = k >= len;
  }
  return mask;
}

// (1, 1, nq, nk) mask that hides key k from query q when k > q (top-left aligned, as PyTorch's
// is_causal and torch.triu(ones, 1)).
inline Mask causal_mask(Eigen::Index nq, Eigen::Index nk) {
  if (nq < 0) detail::throw_invalid("causal_mask", "nq", "non-negative", nq);
  if (nk < 0) detail::throw_invalid("causal_mask", "nk", "non-negative", nk);
  Mask mask(1, 1, nq, nk);
  for (Eigen::Index q = 0; q < nq; ++q)
    for (Eigen::Index k = 0; k < nk; ++k) mask(0, 0, q, k) = k > q;
  return mask;
}

SDPA_NAMESPACE_END
