// The streaming rate of the loop every decoding kernel over a narrow cache runs: load a vector of stored
// entries, widen it to float as sdpa's AVX2 path widens (bfloat16: the 16-bit shift and mask of widen_pairs,
// float16: F16C, int8: sign extension and conversion; float: a plain load), one FMA into one of 8
// independent accumulators. The entries sit in L1 (a 16 KiB buffer read over and over), so nothing waits on
// memory and no sum across lanes interrupts the chains: a lower bound on the time a step's arithmetic over its
// cached keys and values takes on this core, measured in the same run as the step (decode_bench's
// decode/limit/widen_fma cases). AVX2 + FMA only (the path of the AVX2 machines this was measured on).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include <sdpa/storage.hpp>

namespace sdpa_bench {

// Accumulates n entries of `buffer` (bytes long, a multiple of 8 vectors of the type) as `storage`, the
// buffer taken as many times as n needs (n a multiple of 8 vectors); returns a sum of the accumulators.
__attribute__((target("avx2,fma"))) inline float widen_fma_avx2(sdpa::Storage storage, const void* buffer,
                                                                 std::size_t bytes, long long n) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const __m256 q = _mm256_set1_ps(0.5f);
  const char* base = static_cast<const char*>(buffer);
  if (storage == sdpa::Storage::kBFloat16) {
    // 16 entries per 32-byte load: the even ones shifted up, the odd ones masked (two FMAs).
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (long long done = 0; done < n;)
      for (std::size_t off = 0; off < bytes && done < n; off += 8 * 32, done += 8 * 16) {
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + off + 32 * t));
          acc[t] = _mm256_fmadd_ps(q, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), acc[t]);
          acc[t] = _mm256_fmadd_ps(q, _mm256_castsi256_ps(_mm256_and_si256(x, high)), acc[t]);
        }
      }
  } else if (storage == sdpa::Storage::kFloat16) {
    for (long long done = 0; done < n;)
      for (std::size_t off = 0; off < bytes && done < n; off += 8 * 16, done += 8 * 8) {
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t)
          acc[t] = _mm256_fmadd_ps(q, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + off + 16 * t))), acc[t]);
      }
  } else if (storage == sdpa::Storage::kInt8) {
    for (long long done = 0; done < n;)
      for (std::size_t off = 0; off < bytes && done < n; off += 8 * 8, done += 8 * 8) {
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + off + 8 * t));
          acc[t] = _mm256_fmadd_ps(q, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)), acc[t]);
        }
      }
  } else {
    for (long long done = 0; done < n;)
      for (std::size_t off = 0; off < bytes && done < n; off += 8 * 32, done += 8 * 8) {
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t)
          acc[t] = _mm256_fmadd_ps(q, _mm256_loadu_ps(reinterpret_cast<const float*>(base + off + 32 * t)), acc[t]);
      }
  }
  __m256 sum = acc[0];
  for (int t = 1; t < 8; ++t) sum = _mm256_add_ps(sum, acc[t]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}

// A 16 KiB buffer of small finite entries of every storage (the same bytes serve all four: every 16-bit half
// is 0x3C00-0x3C06, finite as bfloat16 and as float16, and so is every float of two such halves; int8 takes
// any byte).
inline std::vector<std::uint8_t> widen_floor_buffer() {
  std::vector<std::uint8_t> b(16 * 1024);
  for (std::size_t i = 0; i < b.size(); i += 2) {
    b[i] = static_cast<std::uint8_t>(i % 7);
    b[i + 1] = 0x3C;
  }
  return b;
}

}  // namespace sdpa_bench
