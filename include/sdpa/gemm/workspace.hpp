// Scratch for the packed blocks of gemm_nt / gemm_nn / gemm_nt_bias, kept from one call to the next. Without
// one, every call allocates its blocks (one allocation, 64-byte aligned, on huge pages from 2 MiB on) and
// pays their first-touch page faults, which weigh more the smaller the product. A caller that multiplies
// repeatedly (a layer's projections, a benchmark) keeps one Workspace per thread that calls; it grows to
// the largest call and never shrinks.
#pragma once

#include "sdpa/config.hpp"

#include <cstddef>

#include "sdpa/detail/buffer.hpp"

SDPA_NAMESPACE_BEGIN
namespace gemm {

template <typename Scalar>
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Workspace(Workspace&&) noexcept = default;
  Workspace& operator=(Workspace&&) noexcept = default;

  // At least `count` elements, 64-byte aligned; the contents are not kept when it grows.
  Scalar* reserve(std::size_t count) {
    if (count > storage_.size()) storage_.reset(count);
    return storage_.data();
  }
  std::size_t capacity() const noexcept { return storage_.size(); }

 private:
  sdpa::detail::Buffer<Scalar> storage_;
};

}  // namespace gemm
SDPA_NAMESPACE_END
