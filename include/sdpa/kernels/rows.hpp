// The one row view through which the kernels read keys and values, whatever they are stored as: with_rows
// hands a kernel the rows of a problem as simd::Rows<T> (simd/rows.hpp), T the type they are stored as (the
// compute type, or for a float problem a KVCache's bfloat16, float16 or int8 entries with their scales).
// The row kernels take the view and widen narrow rows in registers as they load them (key_scores,
// stored_value_sums); the tiled kernel widens each key block of a head before it packs it (gather_kv, which also
// gathers a paged cache's blocks). Nothing widens a whole cache, and every path computes with the same
// widened values (int8: scale * q, rounded once), so the results are those of a float cache holding them,
// but for the AVX2 / AVX-512 decoding kernel's int8 key scores, integer products against the query rounded
// to int16 (simd/generic_int8.inc's int8_chunk_scores; simd/vnni.hpp where the CPU has VNNI).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "sdpa/kernels/problem.hpp"
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/simd/rows.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// Calls f with a cache's stored entries at `data` as the type `storage` names (bfloat16, float16 or int8;
// nothing for another storage).
template <typename F>
void with_stored_entries(Storage storage, const void* data, F&& f) {
  if (storage == Storage::kBFloat16)
    f(static_cast<const BFloat16*>(data));
  else if (storage == Storage::kFloat16)
    f(static_cast<const Float16*>(data));
  else if (storage == Storage::kInt8)
    f(static_cast<const std::int8_t*>(data));
}

// Calls f once with the keys (values: the values) of batch entry b as a simd::Rows<T>: its row 0 is row i0,
// its head 0 key head g0, T the type they are stored as. Paged rows are contiguous inside one block only:
// the caller reads at most p.run_of(i0, ...) rows of the view.
template <typename Scalar, typename F>
void with_rows(const AttentionProblem<Scalar>& p, bool values, Eigen::Index b, Eigen::Index g0, Eigen::Index i0,
               F&& f) {
  using Index = Eigen::Index;
  const Heads<const Scalar>& hd = values ? p.v : p.k;
  const Index row = p.row_of(b, i0);
  if constexpr (std::is_same<Scalar, float>::value) {
    if (p.stored()) {
      const Index offset = b * hd.batch_stride + row * hd.row_stride + g0 * hd.head_stride;
      const float* scales = values ? p.v_scales : p.k_scales;  // int8 only: one per (row, head)
      if (scales != nullptr) scales += b * p.scale_batch_stride + row * p.kv_heads() + g0;
      with_stored_entries(p.kv_storage, values ? p.v_stored : p.k_stored, [&](const auto* base) {
        using T = std::decay_t<decltype(*base)>;
        f(simd::Rows<T>{base + offset, hd.row_stride, hd.head_stride, scales, p.kv_heads()});
      });
      return;
    }
  }
  f(simd::Rows<Scalar>{hd.row(b, g0, row), hd.row_stride, hd.head_stride});
}

// Rows i0 .. i0 + rows - 1 of key (values: value) head g of batch entry b, as Scalar, into dst with row
// stride ldd: stored entries widened, Scalar ones copied; paged rows found block by block. For the tiled
// kernel, which packs a key block from contiguous rows.
template <typename Scalar>
void gather_kv(const AttentionProblem<Scalar>& p, bool values, Eigen::Index b, Eigen::Index g, Eigen::Index i0,
               Eigen::Index rows, Scalar* dst, Eigen::Index ldd) noexcept {
  using Index = Eigen::Index;
  const Index d = values ? p.d_v : p.d_k;
  for (Index i = i0; i < i0 + rows;) {
    const Index run = p.run_of(i, i0 + rows - i);
    Scalar* out = dst + (i - i0) * ldd;
    with_rows(p, values, b, g, i, [&](auto src) {
      using T = std::decay_t<decltype(*src.data)>;
      if constexpr (std::is_same<T, Scalar>::value) {
        for (Index r = 0; r < run; ++r) std::copy_n(src.data + r * src.row, d, out + r * ldd);
      } else {
        simd::widen_rows(p.isa, src, run, d, d, out, ldd);
      }
    });
    i += run;
  }
}

// simd::chunk_scores over n keys of batch entry b from row i0 (inside one block when paged) and key head
// g0 on: the queries' head h reads key head g0 + h / group; scores scaled by p.scale.
template <typename Scalar>
void key_scores(const AttentionProblem<Scalar>& p, Eigen::Index b, Eigen::Index g0, Eigen::Index i0, Eigen::Index n,
                const simd::Queries<Scalar>& queries, Scalar* s, Eigen::Index lds) noexcept {
  with_rows(p, /*values=*/false, b, g0, i0, [&](auto keys) {
    simd::chunk_scores(p.isa, keys, n, queries, simd::Scores<Scalar>{s, lds, p.scale});
  });
}

// acc[0, d_v) += sum over j < m of w[j] * value row i0 + j of value head g of batch entry b (inside one
// block when paged), for stored values (simd::add_weighted_rows_stored); rows i0 + m .. i0 + m + ahead - 1,
// which must lie in the same block, are read next.
template <typename Scalar>
void stored_value_sums(const AttentionProblem<Scalar>& p, Scalar* acc, const Scalar* w, Eigen::Index b, Eigen::Index g,
                       Eigen::Index i0, Eigen::Index m, Eigen::Index ahead = 0) noexcept {
  with_rows(p, /*values=*/true, b, g, i0, [&](auto v) {
    using T = std::decay_t<decltype(*v.data)>;
    if constexpr (!std::is_same<T, Scalar>::value) simd::add_weighted_rows_stored(p.isa, acc, p.d_v, w, v, m, ahead);
  });
}

// stored_value_sums for every query head over rows i0 .. i0 + m - 1 of batch entry b at once, as `sums`
// says (its heads and group those of the problem): each head gets the bits one stored_value_sums call gives
// it; each value head's rows i0 + m .. i0 + m + ahead - 1 (in the same block) are prefetched once.
template <typename Scalar>
void stored_value_sums_heads(const AttentionProblem<Scalar>& p, const simd::HeadSums<Scalar>& sums, Eigen::Index b,
                             Eigen::Index i0, Eigen::Index m, Eigen::Index ahead) noexcept {
  with_rows(p, /*values=*/true, b, Eigen::Index{0}, i0, [&](auto v) {
    using T = std::decay_t<decltype(*v.data)>;
    if constexpr (!std::is_same<T, Scalar>::value)
      simd::add_weighted_rows_stored_heads(p.isa, sums, p.d_v, v, m, ahead);
  });
}

}  // namespace kernels
SDPA_NAMESPACE_END
