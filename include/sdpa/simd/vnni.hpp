// int8 keys' scores on the VNNI instructions (sdpa/storage.hpp's int8 caches in a decoding step): the
// integer kernel of generic_int8.inc instantiated once more over traits that fuse each step's products and
// their sum into one vpdpwssd (int16 pairs multiplied and added into int32 lanes): avx512_vnni on zmm
// (AVX512_VNNI: Ice Lake, Sapphire Rapids, Zen 4 / 5), avx_vnni on ymm (AVX-VNNI: Alder Lake, Zen 5).
// The products are exact integer sums either way, so these kernels give the bits of the AVX-512 / AVX2
// kernels they replace (tested); simd/dispatch.hpp picks them where cpu_features() has the instructions.
//
// The query keeps 16 bits (int16, as on AVX2): vpdpbusd (u8 x s8) would need it rounded to 8 bits, an
// error as large as the int8 key's own, which the int8 cache's accuracy bound (the key's rounding only)
// does not allow; split into two bytes it takes the same issue slots as vpdpwssd.
#pragma once

#include "sdpa/config.hpp"

#if SDPA_DISPATCH

#include "sdpa/detail/intrinsics.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "sdpa/simd/avx2.hpp"
#include "sdpa/simd/avx512.hpp"
#include "sdpa/storage.hpp"

#include "sdpa/simd/target_avx512_vnni_begin.hpp"

SDPA_NAMESPACE_BEGIN
namespace avx512_vnni {

template <typename Scalar>
struct Vec;

template <>
struct Vec<float> : avx512::Vec<float> {
  static IReg int8_accumulate(IReg acc, const std::int8_t* k, const std::int16_t* q) noexcept {
    return _mm512_dpwssd_epi32(acc, widen_keys(k), _mm512_loadu_si512(q));
  }
};

using avx512::kPrefetchStoredRows;
using avx512::prefetch_rows;
using avx512::widened_chunk_scores;

#include "sdpa/simd/generic_int8.inc"

}  // namespace avx512_vnni
SDPA_NAMESPACE_END

#include "sdpa/simd/target_end.hpp"

#include "sdpa/simd/target_avx_vnni_begin.hpp"

SDPA_NAMESPACE_BEGIN
namespace avx_vnni {

template <typename Scalar>
struct Vec;

template <>
struct Vec<float> : avx2::Vec<float> {
  static IReg int8_accumulate(IReg acc, const std::int8_t* k, const std::int16_t* q) noexcept {
    const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k)));
    return _mm256_dpwssd_avx_epi32(acc, wide, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  }
};

using avx2::kPrefetchStoredRows;
using avx2::prefetch_rows;
using avx2::widened_chunk_scores;

#include "sdpa/simd/generic_int8.inc"

}  // namespace avx_vnni
SDPA_NAMESPACE_END

#include "sdpa/simd/target_end.hpp"

#endif  // SDPA_DISPATCH
