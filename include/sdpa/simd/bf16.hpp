// The bfloat16 products of Compute::kBf16 (sdpa/compute.hpp): float operands packed as bfloat16 (rounded
// to nearest, ties to even), multiplied in pairs and accumulated in float. Two ISA namespaces, each in its
// own target region and run only where sdpa/compute.hpp chose its path:
//   avx512_bf16   packing (vcvtne2ps2bf16) and a product on vdpbf16ps, 8 rows x 2 panels of registers
//   amx           the same product on AMX-BF16 tiles (tdpbf16ps), 2 x 2 tiles of 16 x 16 floats at a time
// The operand layouts are namespace bf16's: A row-major (one row of the product's depth per row, padded),
// B in pairs along the depth ("VNNI": each 32-bit lane holds two consecutive depth entries of one column),
// 16 columns per panel, which is both vdpbf16ps's and an AMX B tile's layout.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include "sdpa/storage.hpp"

namespace sdpa {
inline namespace SDPA_ABI_NAMESPACE {
namespace bf16 {
using Index = Eigen::Index;

constexpr Index kTile = 16;  // rows of an A tile, columns of a B panel and of a C tile
constexpr Index kStep = 32;  // depth per product step: one 64-byte row of an A tile

inline constexpr Index round_up(Index x, Index to) noexcept { return (x + to - 1) / to * to; }

// The source of a row-major packing: row r, column c of the packed block is src[r * ld + c] inside the
// rectangle [r0, r1) x [c0, c1) and zero outside it (only the rectangle is read).
struct Rect {
  const float* src = nullptr;
  Index ld = 0;
  Index r0 = 0, r1 = 0, c0 = 0, c1 = 0;
};

// A packed row-major bfloat16 block: rows x cols values, row stride ld (cols a multiple of kStep).
struct Block {
  BFloat16* data = nullptr;
  Index ld = 0;
  Index rows = 0, cols = 0;
};

// B of a product in pairs: B[k][n] is value 2 * (k % 2) ... of lane n % 16 of pair k / 2 of panel n / 16,
// i.e. at data[((n / 16) * pairs + k / 2) * 32 + (n % 16) * 2 + k % 2]. pairs * 2 is the padded depth.
struct Panels {
  BFloat16* data = nullptr;
  Index pairs = 0;
  Index panels = 0;
};

// C[16 * m_tiles][16 * n_panels] (ldc floats) = A (lda values per row, from a) times the B panels from b
// (panel_stride values from one panel to the next), over `steps` * kStep of depth, plus bias[n] in every
// row when bias is set (16 * n_panels floats; the sums start from it). C is overwritten.
struct Product {
  const float* bias = nullptr;
  const BFloat16* a = nullptr;
  Index lda = 0;
  const BFloat16* b = nullptr;
  Index panel_stride = 0;
  Index m_tiles = 0, n_panels = 0, steps = 0;
  float* c = nullptr;
  Index ldc = 0;
};

}  // namespace bf16
}  // namespace SDPA_ABI_NAMESPACE
}  // namespace sdpa

#if SDPA_DISPATCH

#include "sdpa/detail/intrinsics.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "sdpa/simd/avx512.hpp"

#include "sdpa/simd/target_avx512_bf16_begin.hpp"

SDPA_NAMESPACE_BEGIN
namespace avx512_bf16 {
using Index = Eigen::Index;

// 32 floats (lo: the first 16) as 32 bfloat16 in order.
SDPA_ALWAYS_INLINE __m512i to_bf16(__m512 lo, __m512 hi) noexcept {
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

SDPA_ALWAYS_INLINE __mmask16 lanes(Index from, Index to) noexcept {  // lanes [from, to) of 16, clamped
  const Index a = from < 0 ? 0 : from > 16 ? 16 : from, b = to < 0 ? 0 : to > 16 ? 16 : to;
  if (b <= a) return 0;
  return static_cast<__mmask16>(((1u << static_cast<unsigned>(b - a)) - 1u) << static_cast<unsigned>(a));
}

// dst = the rectangle of src times `scale`, rounded to bfloat16, zero elsewhere (bf16::Rect).
inline void pack_rows(const bf16::Rect& src, const bf16::Block& dst, float scale = 1.0f) noexcept {
  const __m512i zero = _mm512_setzero_si512();
  const __m512 f = _mm512_set1_ps(scale);
  // Whole 32-column chunks inside the rectangle's columns take plain loads.
  const Index full_lo = (src.c0 + 31) / 32 * 32, full_hi = src.c1 / 32 * 32;
  for (Index r = 0; r < dst.rows; ++r) {
    BFloat16* out = dst.data + r * dst.ld;
    if (r < src.r0 || r >= src.r1) {
      for (Index c = 0; c < dst.cols; c += 32) _mm512_storeu_si512(out + c, zero);
      continue;
    }
    const float* in = src.src + r * src.ld;
    for (Index c = 0; c < dst.cols; c += 32) {
      __m512 lo, hi;
      if (c >= full_lo && c + 32 <= full_hi) {
        lo = _mm512_loadu_ps(in + c);
        hi = _mm512_loadu_ps(in + c + 16);
      } else {
        const __mmask16 m0 = lanes(src.c0 - c, src.c1 - c), m1 = lanes(src.c0 - c - 16, src.c1 - c - 16);
        lo = _mm512_maskz_loadu_ps(m0, in + c);
        hi = _mm512_maskz_loadu_ps(m1, in + c + 16);
      }
      if (scale != 1.0f) {
        lo = _mm512_mul_ps(lo, f);
        hi = _mm512_mul_ps(hi, f);
      }
      _mm512_storeu_si512(out + c, to_bf16(lo, hi));
    }
  }
}

// B[k][n] = src[n * ld + k] for n < n_rows, k < k_cols, zero elsewhere: the keys of a score product (one
// key per source row), in panels of 16 keys. Each 16 x 16 block of bfloat16 pairs is a transpose of 32-bit
// words.
inline void pack_transposed_pairs(const float* src, Index ld, Index n_rows, Index k_cols, const bf16::Panels& dst) noexcept {
  for (Index n0 = 0; n0 < dst.panels * 16; n0 += 16) {
    for (Index k0 = 0; k0 < dst.pairs * 2; k0 += 32) {
      __m512 w[16];
      const __mmask16 m0 = lanes(0, k_cols - k0), m1 = lanes(0, k_cols - k0 - 16);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        if (n0 + j < n_rows) {
          const float* in = src + (n0 + j) * ld + k0;
          w[j] = _mm512_castsi512_ps(to_bf16(_mm512_maskz_loadu_ps(m0, in), _mm512_maskz_loadu_ps(m1, in + 16)));
        } else {
          w[j] = _mm512_setzero_ps();
        }
      }
      // w[j] lane p: key n0 + j, pair k0 / 2 + p. Transposed: register p holds pair k0 / 2 + p of the 16 keys.
      avx512::Vec<float>::transpose(w);
      BFloat16* out = dst.data + ((n0 / 16) * dst.pairs + k0 / 2) * 32;
      for (Index p = 0; p < 16 && p < dst.pairs - k0 / 2; ++p)
        _mm512_storeu_ps(reinterpret_cast<float*>(out + p * 32), w[p]);
    }
  }
}

// B[k][n] = src[k * ld + n] for k < k_rows, n < n_cols, zero elsewhere: the values of an output product
// (one key per source row), in panels of 16 value columns; two source rows make one pair.
inline void pack_pairs(const float* src, Index ld, Index k_rows, Index n_cols, const bf16::Panels& dst) noexcept {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (Index n = 0; n < dst.panels; ++n) {
    const __mmask16 m = lanes(0, n_cols - n * 16);
    for (Index p = 0; p < dst.pairs; ++p) {
      const Index k = 2 * p;
      const __m512 even = k < k_rows ? _mm512_maskz_loadu_ps(m, src + k * ld + n * 16) : _mm512_setzero_ps();
      const __m512 odd = k + 1 < k_rows ? _mm512_maskz_loadu_ps(m, src + (k + 1) * ld + n * 16) : _mm512_setzero_ps();
      _mm512_storeu_si512(dst.data + (n * dst.pairs + p) * 32, _mm512_permutexvar_epi16(interleave, to_bf16(even, odd)));
    }
  }
}

// dst[j * ld + i] = src[i * lds + j] rounded to bfloat16 for i < n_rows, j < n_cols, zero elsewhere in its
// rows x cols (multiples of 16): a tile read transposed as the A of a product (the backward's P^T and dS^T).
inline void pack_transposed_rows(const float* src, Index lds, Index n_rows, Index n_cols, const bf16::Block& dst) noexcept {
  for (Index j0 = 0; j0 < dst.rows; j0 += 16) {
    const __mmask16 m = lanes(0, n_cols - j0);
    for (Index i0 = 0; i0 < dst.cols; i0 += 16) {
      __m512 r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = i0 + i < n_rows && m != 0 ? _mm512_maskz_loadu_ps(m, src + (i0 + i) * lds + j0) : _mm512_setzero_ps();
      avx512::Vec<float>::transpose(r);  // r[j] lane i: src row i0 + i, column j0 + j
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst.data + (j0 + j) * dst.ld + i0), (__m256i)_mm512_cvtneps_pbh(r[j]));
    }
  }
}

// s[i * lds + j] = alpha * c[i * ldc + j] for i < rows, j < cols: a score tile out of the products' scratch.
inline void scale_rows(const float* c, Index ldc, Index rows, Index cols, float alpha, float* s, Index lds) noexcept {
  const __m512 a = _mm512_set1_ps(alpha);
  for (Index i = 0; i < rows; ++i) {
    const float* in = c + i * ldc;
    float* out = s + i * lds;
    Index j = 0;
    for (; j + 16 <= cols; j += 16) _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_loadu_ps(in + j), a));
    if (j < cols) {
      const __mmask16 m = lanes(0, cols - j);
      _mm512_mask_storeu_ps(out + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, in + j), a));
    }
  }
}

// o[i * ldo + d] += c[i * ldc + d] for i < rows, d < cols: an output tile's products into the accumulators.
inline void add_rows(const float* c, Index ldc, Index rows, Index cols, float* o, Index ldo) noexcept {
  for (Index i = 0; i < rows; ++i) {
    const float* in = c + i * ldc;
    float* out = o + i * ldo;
    Index d = 0;
    for (; d + 16 <= cols; d += 16)
      _mm512_storeu_ps(out + d, _mm512_add_ps(_mm512_loadu_ps(out + d), _mm512_loadu_ps(in + d)));
    if (d < cols) {
      const __mmask16 m = lanes(0, cols - d);
      _mm512_mask_storeu_ps(out + d, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + d), _mm512_maskz_loadu_ps(m, in + d)));
    }
  }
}

// C = A B (bf16::Product) with vdpbf16ps: 8 rows x 2 panels of accumulators, A's pairs broadcast.
template <int Panels>
SDPA_ALWAYS_INLINE void product_block(const bf16::Product& x, Index i, Index n) noexcept {
  constexpr std::size_t kPanels = static_cast<std::size_t>(Panels);
  __m512 acc[8][kPanels];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < Panels; ++c) acc[r][c] = x.bias != nullptr ? _mm512_loadu_ps(x.bias + (n + c) * 16) : _mm512_setzero_ps();
  const BFloat16* a = x.a + i * x.lda;
  const BFloat16* b = x.b + n * x.panel_stride;
  const Index pairs = x.steps * bf16::kStep / 2;
  for (Index p = 0; p < pairs; ++p) {
    __m512bh bv[kPanels];
#pragma GCC unroll 2
    for (int c = 0; c < Panels; ++c) bv[c] = (__m512bh)_mm512_loadu_si512(b + c * x.panel_stride + p * 32);
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      std::int32_t word;
      std::memcpy(&word, a + r * x.lda + 2 * p, sizeof word);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(word);
#pragma GCC unroll 2
      for (int c = 0; c < Panels; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], av, bv[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < Panels; ++c) _mm512_storeu_ps(x.c + (i + r) * x.ldc + (n + c) * 16, acc[r][c]);
}

inline void product(const bf16::Product& x) noexcept {
  for (Index i = 0; i < x.m_tiles * 16; i += 8) {
    Index n = 0;
    for (; n + 2 <= x.n_panels; n += 2) product_block<2>(x, i, n);
    if (n < x.n_panels) product_block<1>(x, i, n);
  }
}

}  // namespace avx512_bf16
SDPA_NAMESPACE_END

#include "sdpa/simd/target_end.hpp"

#include "sdpa/simd/target_amx_begin.hpp"

SDPA_NAMESPACE_BEGIN
namespace amx {
using Index = Eigen::Index;

// ldtilecfg's 64-byte operand, palette 1: every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Tiles 0-3: C (rows x panels: 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)); 4-5: A; 6-7: B.
template <int Rows, int Cols>
SDPA_ALWAYS_INLINE void product_block(const bf16::Product& x, Index i, Index n) noexcept {
  if (x.bias != nullptr) {  // every row of a C tile the same 16 floats: a load with stride 0
    const float* bias = x.bias + n * 16;
    _tile_loadd(0, bias, 0);
    if (Cols == 2) _tile_loadd(1, bias + 16, 0);
    if (Rows == 2) _tile_loadd(2, bias, 0);
    if (Rows == 2 && Cols == 2) _tile_loadd(3, bias + 16, 0);
  } else {
    _tile_zero(0);
    if (Cols == 2) _tile_zero(1);
    if (Rows == 2) _tile_zero(2);
    if (Rows == 2 && Cols == 2) _tile_zero(3);
  }
  const long lda = static_cast<long>(x.lda * 2);
  const BFloat16* a = x.a + i * 16 * x.lda;
  const BFloat16* b = x.b + n * x.panel_stride;
  for (Index s = 0; s < x.steps; ++s) {
    _tile_loadd(4, a + s * bf16::kStep, lda);
    _tile_loadd(6, b + s * 512, 64);
    if (Rows == 2) _tile_loadd(5, a + 16 * x.lda + s * bf16::kStep, lda);
    if (Cols == 2) _tile_loadd(7, b + x.panel_stride + s * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (Cols == 2) _tile_dpbf16ps(1, 4, 7);
    if (Rows == 2) _tile_dpbf16ps(2, 5, 6);
    if (Rows == 2 && Cols == 2) _tile_dpbf16ps(3, 5, 7);
  }
  const long ldc = static_cast<long>(x.ldc * 4);
  float* c = x.c + i * 16 * x.ldc + n * 16;
  _tile_stored(0, c, ldc);
  if (Cols == 2) _tile_stored(1, c + 16, ldc);
  if (Rows == 2) _tile_stored(2, c + 16 * x.ldc, ldc);
  if (Rows == 2 && Cols == 2) _tile_stored(3, c + 16 * x.ldc + 16, ldc);
}

// C = A B (bf16::Product) on AMX tiles. Loads the tile configuration and releases the tile state, so a
// call leaves nothing behind for the thread.
inline void product(const bf16::Product& x) noexcept {
  static const TileConfig config{};
  _tile_loadconfig(&config);
  Index i = 0;
  for (; i + 2 <= x.m_tiles; i += 2) {
    Index n = 0;
    for (; n + 2 <= x.n_panels; n += 2) product_block<2, 2>(x, i, n);
    if (n < x.n_panels) product_block<2, 1>(x, i, n);
  }
  if (i < x.m_tiles) {
    Index n = 0;
    for (; n + 2 <= x.n_panels; n += 2) product_block<1, 2>(x, i, n);
    if (n < x.n_panels) product_block<1, 1>(x, i, n);
  }
  _tile_release();
}

}  // namespace amx
SDPA_NAMESPACE_END

#include "sdpa/simd/target_end.hpp"

// The emulated path's rounding (kernels/bf16_products.hpp): out[i] = x[i] rounded to bfloat16 and widened
// back, as sdpa::to_bfloat16 rounds (to nearest, ties to even; a NaN quiet with its sign), 16 or 8 at a time.
#include "sdpa/simd/target_avx512_begin.hpp"
SDPA_NAMESPACE_BEGIN
namespace avx512 {
inline void round_to_bf16(const float* x, Eigen::Index n, float* out) noexcept {
  const __m512i low = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i quiet = _mm512_set1_epi32(0x00400000), abs = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  for (Eigen::Index i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << static_cast<unsigned>(n - i)) - 1u);
    const __m512i u = _mm512_maskz_loadu_epi32(m, x + i);
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(low, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
    const __m512i r = _mm512_mask_or_epi32(rounded, nan, u, quiet);
    _mm512_mask_storeu_epi32(out + i, m, _mm512_and_si512(r, top));
  }
}
}  // namespace avx512
SDPA_NAMESPACE_END
#include "sdpa/simd/target_end.hpp"

#include "sdpa/simd/target_avx2_begin.hpp"
SDPA_NAMESPACE_BEGIN
namespace avx2 {
inline void round_to_bf16(const float* x, Eigen::Index n, float* out) noexcept {
  const __m256i low = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i quiet = _mm256_set1_epi32(0x00400000), abs = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
  Eigen::Index i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(low, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    // A NaN (|u| > inf as signed integers: both are non-negative) takes u with the quiet bit instead.
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, quiet), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_and_si256(r, top));
  }
  for (; i < n; ++i) out[i] = bfloat16_to_float(to_bfloat16(x[i]).bits);
}
}  // namespace avx2
SDPA_NAMESPACE_END
#include "sdpa/simd/target_end.hpp"

#endif  // SDPA_DISPATCH
