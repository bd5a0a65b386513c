// The softmax's exponent pass for float with AVX-512 (included by softmax.hpp when the build targets it):
// the float exp is the softmax's bottleneck, and the instruction set offers a cheaper one than Eigen's
// generic code: Cephes' polynomial (as Eigen uses, about 1 ulp) with vscalefps for the power of two, fused
// with the shift and the sum, and exactly 0 for arguments below -87.3 (hidden keys' -inf included).
#pragma once

#include "sdpa/detail/intrinsics.hpp"
#include "sdpa/detail/eigen.hpp"

#include <limits>

#if defined(__AVX512F__)

namespace sdpa {
namespace kernels {
namespace detail {

// x[j] = exp(x[j] - shift) for j < n, returning their sum (see PortableShiftedExp in softmax.hpp).
struct ShiftedExpAvx512Float {
  static constexpr bool kExpZeroesMasked = true;
  static float run(float* x, Eigen::Index n, float shift) noexcept {
    const __m512 vshift = _mm512_set1_ps(shift);
    // Two sums so that consecutive packets do not wait on one another's addition.
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    Eigen::Index j = 0;
    for (; j + 32 <= n; j += 32) {
      const __m512 y0 = exp_shifted(_mm512_loadu_ps(x + j), vshift, __mmask16(0xFFFF));
      const __m512 y1 = exp_shifted(_mm512_loadu_ps(x + j + 16), vshift, __mmask16(0xFFFF));
      _mm512_storeu_ps(x + j, y0);
      _mm512_storeu_ps(x + j + 16, y1);
      sum0 = _mm512_add_ps(sum0, y0);
      sum1 = _mm512_add_ps(sum1, y1);
    }
    for (; j < n; j += 16) {
      const __mmask16 lanes = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
      const __m512 y = exp_shifted(_mm512_maskz_loadu_ps(lanes, x + j), vshift, lanes);
      _mm512_mask_storeu_ps(x + j, lanes, y);
      sum0 = _mm512_add_ps(sum0, y);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
  }

 private:
  // exp(v - shift) in the lanes of `lanes`, 0 in the others.
  static __m512 exp_shifted(__m512 v, __m512 shift, __mmask16 lanes) noexcept {
    const __m512 t = _mm512_sub_ps(v, shift);
    // Zero below -87.33, where exp falls under FLT_MIN; -inf (masked) included, whose NaN from the
    // reduction below is dropped here. A NaN argument stays NaN, as the reference's exp gives.
    // (The unmasked compare and an AND: at -O0 GCC's macro for the masked compare trips -Wsign-conversion.)
    lanes = static_cast<__mmask16>(lanes & _mm512_cmp_ps_mask(t, _mm512_set1_ps(-87.33f), _CMP_NLT_UQ));
    // At -O0 GCC's macro for vrndscaleps converts its all-ones mask to a signed short (-Wsign-conversion).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-conversion"
#endif
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), t);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(lanes, y, k);
  }
};

// The largest of x[0 .. n) for n > 0 (a NaN may or may not win: see segment_max in softmax.hpp).
inline float segment_max_avx512(const float* x, Eigen::Index n) noexcept {
  __m512 m0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
  Eigen::Index j = 0;
  for (; j + 32 <= n; j += 32) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + j + 16));
  }
  for (; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
    m0 = _mm512_mask_max_ps(m0, lanes, m0, _mm512_maskz_loadu_ps(lanes, x + j));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

}  // namespace detail
}  // namespace kernels
}  // namespace sdpa

#endif  // __AVX512F__
