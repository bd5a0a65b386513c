// Keys and values stored narrower than the compute type (AttentionProblem::stored(): a KVCache of bfloat16,
// float16 or int8 entries) read by the float kernels: the decoding kernel's row products widen them in
// registers as they load them (stored_chunk_scores, stored_add_weighted_rows), the tiled kernel widens each
// key block of a head before it packs it (gather_kv, which also gathers a paged cache's blocks). Nothing widens a whole cache, and every path computes
// with the same widened values (int8: scale * q, rounded once), so the results are those of a float cache
// holding them, but for the AVX2 / AVX-512 decoding kernel's int8 key scores, integer products against the
// query rounded to int16 (simd/generic_int8.inc's int8_chunk_scores; simd/vnni.hpp where the CPU has VNNI).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "sdpa/kernels/problem.hpp"
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// Calls f with a cache's stored entries at `data` as the type `storage` names (bfloat16, float16 or int8;
// nothing for another storage).
template <typename F>
void with_stored_entries(Storage storage, const void* data, F&& f) {
  if (storage == Storage::kBFloat16) f(static_cast<const BFloat16*>(data));
  else if (storage == Storage::kFloat16) f(static_cast<const Float16*>(data));
  else if (storage == Storage::kInt8) f(static_cast<const std::int8_t*>(data));
}

// Rows i0 .. i0 + rows - 1 of `heads` consecutive key (values: value) heads from g0 of batch entry b, as
// Scalar, into dst with row stride ldd: row r holds the heads side by side (heads * d values). Stored
// entries are widened, Scalar ones copied; paged rows are found block by block (a run of rows inside one
// block is contiguous). For the tiled kernel, which packs a key block from contiguous rows.
template <typename Scalar>
void gather_kv(const AttentionProblem<Scalar>& p, bool values, Eigen::Index b, Eigen::Index g0, Eigen::Index heads,
               Eigen::Index i0, Eigen::Index rows, Scalar* dst, Eigen::Index ldd) noexcept {
  using Index = Eigen::Index;
  const Heads<const Scalar>& hd = values ? p.v : p.k;
  const Index d = values ? p.d_v : p.d_k;
  for (Index i = i0; i < i0 + rows;) {
    const Index run = p.run_of(i, i0 + rows - i), row = p.row_of(b, i);
    Scalar* out = dst + (i - i0) * ldd;
    if (!p.stored()) {
      for (Index r = 0; r < run; ++r)
        for (Index g = 0; g < heads; ++g) std::copy_n(hd.row(b, g0 + g, row + r), d, out + r * ldd + g * d);
      i += run;
      continue;
    }
    if constexpr (std::is_same<Scalar, float>::value) {
      const Index offset = b * hd.batch_stride + row * hd.row_stride + g0 * hd.head_stride;
      const float* scales = values ? p.v_scales : p.k_scales;
      if (scales != nullptr) scales += b * p.scale_batch_stride + row * p.kv_heads() + g0;
      with_stored_entries(p.kv_storage, values ? p.v_stored : p.k_stored, [&](const auto* base) {
        // int8: one scale per (row, head) of d entries; the others have none.
        constexpr bool kInt8 = std::is_same<std::decay_t<decltype(*base)>, std::int8_t>::value;
        simd::widen_rows(p.isa, base + offset, hd.row_stride, run, heads * d, kInt8 ? scales : nullptr,
                         kInt8 ? p.kv_heads() : Index{0}, kInt8 ? d : heads * d, out, ldd);
      });
    }
    i += run;
  }
}

// simd::chunk_scores for the stored keys of batch entry b, rows i0 .. i0 + n - 1 (inside one block when paged):
// query heads h < heads read key head g0 + h / group (the queries and the output as chunk_scores takes them).
template <typename Scalar>
void stored_chunk_scores(const AttentionProblem<Scalar>& p, Eigen::Index b, Eigen::Index g0, Eigen::Index i0,
                         Eigen::Index n, const Scalar* q, Eigen::Index q_head, Eigen::Index q_row, Eigen::Index heads,
                         Eigen::Index group, Eigen::Index nq, Scalar* s, Eigen::Index lds) noexcept {
  using Index = Eigen::Index;
  if constexpr (std::is_same<Scalar, float>::value) {
    const Index row = p.row_of(b, i0);
    const Index offset = b * p.k.batch_stride + row * p.k.row_stride + g0 * p.k.head_stride;
    const float* scales = p.k_scales != nullptr ? p.k_scales + b * p.scale_batch_stride + row * p.kv_heads() + g0 : nullptr;
    const auto run = [&](const auto* k) {
      simd::chunk_scores_stored(p.isa, k + offset, p.k.row_stride, p.k.head_stride, n, scales, p.kv_heads(), q, q_head, q_row,
                                heads, group, nq, p.d_k, p.scale, s, lds);
    };
    with_stored_entries(p.kv_storage, p.k_stored, run);
  } else {
    (void)p, (void)b, (void)g0, (void)i0, (void)n, (void)q, (void)q_head, (void)q_row, (void)heads, (void)group, (void)nq,
        (void)s, (void)lds;
  }
}

// simd::add_weighted_rows for the stored values of value head g of batch entry b, rows i0 .. i0 + m - 1
// (inside one block when paged): acc[0, d_v) += sum over j of w[j] * value row i0 + j. Rows i0 + m ..
// i0 + m + ahead - 1, which must lie in the same block, are read next (simd::add_weighted_rows_stored).
template <typename Scalar>
void stored_add_weighted_rows(const AttentionProblem<Scalar>& p, Scalar* acc, const Scalar* w, Eigen::Index b,
                              Eigen::Index g, Eigen::Index i0, Eigen::Index m, Eigen::Index ahead = 0) noexcept {
  using Index = Eigen::Index;
  if constexpr (std::is_same<Scalar, float>::value) {
    const Index row = p.row_of(b, i0);
    const Index offset = b * p.v.batch_stride + row * p.v.row_stride + g * p.v.head_stride;
    const float* scales = p.v_scales != nullptr ? p.v_scales + b * p.scale_batch_stride + row * p.kv_heads() + g : nullptr;
    const auto run = [&](const auto* v) {
      simd::add_weighted_rows_stored(p.isa, acc, p.d_v, w, v + offset, p.v.row_stride, scales, p.kv_heads(), m, ahead);
    };
    with_stored_entries(p.kv_storage, p.v_stored, run);
  } else {
    (void)p, (void)acc, (void)w, (void)b, (void)g, (void)i0, (void)m, (void)ahead;
  }
}

// stored_add_weighted_rows for every query head over rows i0 .. i0 + m - 1 of batch entry b at once (query
// head h reads value head h / kv_group): head h's weights at w + h * w_head, its accumulator at acc + h * acc_head.
// Each head gets the bits one stored_add_weighted_rows call gives it; each value head's rows i0 + m ..
// i0 + m + ahead - 1 (in the same block) are prefetched once.
template <typename Scalar>
void stored_add_weighted_rows_heads(const AttentionProblem<Scalar>& p, Scalar* acc, Eigen::Index acc_head, const Scalar* w,
                                    Eigen::Index w_head, Eigen::Index b, Eigen::Index i0, Eigen::Index m,
                                    Eigen::Index ahead) noexcept {
  using Index = Eigen::Index;
  if constexpr (std::is_same<Scalar, float>::value) {
    const Index row = p.row_of(b, i0);
    const Index offset = b * p.v.batch_stride + row * p.v.row_stride;
    const float* scales = p.v_scales != nullptr ? p.v_scales + b * p.scale_batch_stride + row * p.kv_heads() : nullptr;
    const auto run = [&](const auto* v) {
      simd::add_weighted_rows_stored_heads(p.isa, acc, acc_head, p.d_v, w, w_head, v + offset, p.v.row_stride,
                                           p.v.head_stride, scales, p.kv_heads(), p.heads, p.kv_group, m, ahead);
    };
    with_stored_entries(p.kv_storage, p.v_stored, run);
  } else {
    (void)p, (void)acc, (void)acc_head, (void)w, (void)w_head, (void)b, (void)i0, (void)m, (void)ahead;
  }
}

}  // namespace kernels
SDPA_NAMESPACE_END
