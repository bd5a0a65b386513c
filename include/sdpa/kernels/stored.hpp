// Keys and values stored narrower than the compute type (AttentionProblem::stored(): a KVCache of bfloat16,
// float16 or int8 entries) widened for the float kernels a block at a time: the decoding kernel widens each
// block of 16 rows of every key/value head before its products, the tiled kernel each key block of a head
// before it packs it. Nothing widens a whole cache.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <cstdint>
#include <type_traits>

#include "sdpa/kernels/problem.hpp"
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// Rows i0 .. i0 + rows - 1 of `heads` consecutive key (values: value) heads from g0 of batch entry b, as
// Scalar, into dst with row stride ldd: row r holds the heads side by side (heads * d values). p must be
// stored(), which only a float problem can be.
template <typename Scalar>
void widen_kv(const AttentionProblem<Scalar>& p, bool values, Eigen::Index b, Eigen::Index g0, Eigen::Index heads,
              Eigen::Index i0, Eigen::Index rows, Scalar* dst, Eigen::Index ldd) noexcept {
  using Index = Eigen::Index;
  if constexpr (std::is_same<Scalar, float>::value) {
    const Heads<const Scalar>& hd = values ? p.v : p.k;
    const Index d = values ? p.d_v : p.d_k;
    const Index offset = b * hd.batch_stride + i0 * hd.row_stride + g0 * hd.head_stride;
    const float* scales = values ? p.v_scales : p.k_scales;
    if (scales != nullptr) scales += b * p.scale_batch_stride + i0 * p.kv_heads() + g0;
    const void* base = values ? p.v_stored : p.k_stored;
    switch (p.kv_storage) {
      case Storage::kBFloat16:
        simd::widen_rows(p.isa, static_cast<const BFloat16*>(base) + offset, hd.row_stride, rows, heads * d, nullptr,
                         Index{0}, heads * d, dst, ldd);
        break;
      case Storage::kFloat16:
        simd::widen_rows(p.isa, static_cast<const Float16*>(base) + offset, hd.row_stride, rows, heads * d, nullptr,
                         Index{0}, heads * d, dst, ldd);
        break;
      case Storage::kInt8:
        simd::widen_rows(p.isa, static_cast<const std::int8_t*>(base) + offset, hd.row_stride, rows, heads * d, scales,
                         p.kv_heads(), d, dst, ldd);
        break;
      default:
        break;
    }
  } else {
    (void)p, (void)values, (void)b, (void)g0, (void)heads, (void)i0, (void)rows, (void)dst, (void)ldd;
  }
}

// The address of row i of stored key (values: value) head g of batch entry b, for prefetching.
template <typename Scalar>
const unsigned char* stored_row(const AttentionProblem<Scalar>& p, bool values, Eigen::Index b, Eigen::Index g,
                                Eigen::Index i) noexcept {
  const Heads<const Scalar>& hd = values ? p.v : p.k;
  return static_cast<const unsigned char*>(values ? p.v_stored : p.k_stored) +
         static_cast<std::size_t>(b * hd.batch_stride + i * hd.row_stride + g * hd.head_stride) * storage_bytes(p.kv_storage);
}

}  // namespace kernels
SDPA_NAMESPACE_END
