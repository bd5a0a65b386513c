// The softmax's exponent pass for float with AVX-512 (included by softmax.hpp when the build targets it):
// the float exp is the softmax's bottleneck, and the instruction set offers a cheaper one than Eigen's
// generic code: a table of 2^(i / 32) (one vpermt2ps) and a cubic, with vscalefps for the power of two,
// fused with the shift and the sum, and exactly 0 for arguments below -87.3 (hidden keys' -inf included).
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
  // exp(v - shift) in the lanes of `lanes`, 0 in the others: exp(t) = 2^(k / 32) exp(r) with k the integer
  // nearest t * 32 / ln 2 and |r| <= ln 2 / 64, 2^(k / 32) = 2^floor(k / 32) 2^((k mod 32) / 32) from a
  // table of 32 powers read by one vpermt2ps, and exp(r) by its series up to r^3 (the first term left
  // out, r^4 / 24, is below 6e-10 of it). 14 vector operations, 9 of them on the multiply units, where
  // Cephes' polynomial over |r| <= ln 2 / 2 (which Eigen uses) takes 15 and 11. At most 1.01 ulp from exp
  // over every third float in [-87.33, 88.7] (Cephes' 1.26); the pass 11-15% faster.
  static __m512 exp_shifted(__m512 v, __m512 shift, __mmask16 lanes) noexcept {
    // Arguments above 88.8 give +inf (exp overflows from 88.73); keeping them there keeps k exact below.
    // (vminps returns its second operand when either is NaN: a NaN argument stays NaN, as the reference's
    // exp gives.)
    const __m512 t = _mm512_min_ps(_mm512_set1_ps(88.8f), _mm512_sub_ps(v, shift));
    // Zero below -87.33, where exp falls under FLT_MIN; -inf (masked) included, whose NaN from the
    // reduction below is dropped here.
    // (The unmasked compare and an AND: at -O0 GCC's macro for the masked compare trips -Wsign-conversion.)
    lanes = static_cast<__mmask16>(lanes & _mm512_cmp_ps_mask(t, _mm512_set1_ps(-87.33f), _CMP_NLT_UQ));
    // k in the low bits of 1.5 * 2^23 + k (in the lanes kept, |k| <= 4100 < 2^22), rounded to nearest by
    // the fused add.
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 kk = _mm512_fmadd_ps(t, _mm512_set1_ps(46.1662413f), magic);
    const __m512 k = _mm512_sub_ps(kk, magic);
    // r = t - k ln 2 / 32 in two steps (Cephes' split of ln 2, over 32): k times the first part is exact.
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f / 32), t);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f / 32), r);
    // 2^(i / 32) rounded to float; vpermt2ps reads the index from the low five bits of kk: k mod 32.
    const __m512 pow_lo = _mm512_setr_ps(
        1.0f, 1.0218972f, 1.04427373f, 1.06714046f,
        1.09050775f, 1.1143868f, 1.13878858f, 1.1637249f,
        1.18920708f, 1.21524739f, 1.24185777f, 1.26905096f,
        1.29683959f, 1.32523668f, 1.35425556f, 1.38390994f);
    const __m512 pow_hi = _mm512_setr_ps(
        1.41421354f, 1.44518077f, 1.47682619f, 1.50916445f,
        1.54221082f, 1.5759809f, 1.61049032f, 1.64575553f,
        1.68179286f, 1.71861935f, 1.75625217f, 1.79470909f,
        1.8340081f, 1.87416768f, 1.91520655f, 1.95714414f);
    const __m512 pow = _mm512_permutex2var_ps(pow_lo, _mm512_castps_si512(kk), pow_hi);
    // pow (1 + r (1 + r / 2 + r^2 / 6)), the last addition rounding once.
    __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 6), r, _mm512_set1_ps(0.5f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
    const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(pow, r), q, pow);
    // vscalefps multiplies by 2^floor of its second operand: 2^floor(k / 32) (k / 32 is exact).
    return _mm512_maskz_scalef_ps(lanes, y, _mm512_mul_ps(k, _mm512_set1_ps(1.0f / 32)));
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
