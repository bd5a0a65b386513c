// Storage types apart from the compute type (ATen's opmath_type, tinyBLAS's TA/TB/TC): key/value caches and
// module weights may be stored as bfloat16, float16 or int8 while every kernel computes and accumulates in
// float (but the AVX2 / AVX-512 decoding kernel's int8 key scores: exact integer sums against the query
// rounded to int16, kInt16QueryMaxLength); values are converted where they are loaded or packed, never a whole cache
// or matrix at once.
//   sdpa::Storage              kFloat32, kBFloat16, kFloat16, kInt8 (and kFloat64, what a double module keeps)
//   BFloat16, Float16          one stored element each (the bits; distinct types so that a kernel cannot read
//                              one as the other)
//   to_bfloat16 / to_float16   float -> stored, rounded to nearest, ties to even (as PyTorch's .to() and
//                              the hardware conversions): NaN stays NaN (quiet, sign kept); float16 overflows
//                              to +-inf past its largest finite value, 65504, and has subnormals below 2^-14
//   bfloat16_to_float, half_to_float   stored -> float, exact
//   quantize_int8              one segment (a token's head) -> int8 values and one float scale (symmetric,
//                              absmax / 127, values rounded to nearest): value = scale * q
// Every conversion here is plain integer and float arithmetic with one rounding, so the vector paths
// (simd/*.hpp) give the same bits as these functions.
#pragma once

#include "sdpa/config.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

SDPA_NAMESPACE_BEGIN

enum class Storage : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3, kFloat64 = 4 };

inline const char* storage_name(Storage s) noexcept {
  switch (s) {
    case Storage::kFloat32:
      return "kFloat32";
    case Storage::kBFloat16:
      return "kBFloat16";
    case Storage::kFloat16:
      return "kFloat16";
    case Storage::kInt8:
      return "kInt8";
    case Storage::kFloat64:
      return "kFloat64";
  }
  return "an unknown Storage";
}

// Bytes per stored element (int8's scales come on top: one float per segment).
inline std::size_t storage_bytes(Storage s) noexcept {
  switch (s) {
    case Storage::kBFloat16:
    case Storage::kFloat16:
      return 2;
    case Storage::kInt8:
      return 1;
    case Storage::kFloat64:
      return 8;
    case Storage::kFloat32:
      break;
  }
  return 4;
}

// What a module or cache of Scalar stores when nothing narrower is asked for.
template <typename Scalar>
constexpr Storage native_storage() noexcept {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "sdpa::native_storage: float or double");
  return std::is_same<Scalar, float>::value ? Storage::kFloat32 : Storage::kFloat64;
}

// Whether s differs from Scalar itself (the kernels then convert while loading).
template <typename Scalar>
constexpr bool is_narrow(Storage s) noexcept {
  return s != native_storage<Scalar>();
}

struct BFloat16 {
  std::uint16_t bits;
};
struct Float16 {
  std::uint16_t bits;
};
static_assert(sizeof(BFloat16) == 2 && sizeof(Float16) == 2, "sdpa: stored halves must be 2 bytes");

namespace detail {
inline std::uint32_t float_bits(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace detail

// IEEE binary16 -> binary32, exact (every half is a float): subnormals are normalised, infinities kept,
// NaNs keep sign and payload and come out quiet, as PyTorch's conversion gives them.
inline float half_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1Fu;
  std::uint32_t mantissa = h & 0x3FFu;
  std::uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13) | (mantissa != 0 ? 0x00400000u : 0u);
  } else if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // mantissa * 2^-24: shift the leading one up to the implicit bit, one exponent step each
      std::uint32_t e = 113;  // 127 - 15 + 1
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --e;
      }
      bits = sign | (e << 23) | ((mantissa & 0x3FFu) << 13);
    }
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  return detail::bits_float(bits);
}

// bfloat16 is the top half of a binary32: the conversion is a shift, exact for every value, NaN payloads
// included (PyTorch does the same).
inline float bfloat16_to_float(std::uint16_t b) noexcept { return detail::bits_float(static_cast<std::uint32_t>(b) << 16); }

inline float to_float(BFloat16 x) noexcept { return bfloat16_to_float(x.bits); }
inline float to_float(Float16 x) noexcept { return half_to_float(x.bits); }

// float -> bfloat16, rounded to nearest, ties to even; NaN -> a quiet NaN of the same sign.
inline BFloat16 to_bfloat16(float f) noexcept {
  const std::uint32_t u = detail::float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return BFloat16{static_cast<std::uint16_t>((u >> 16) | 0x0040u)};
  const std::uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);  // carries into the exponent when it must
  return BFloat16{static_cast<std::uint16_t>(rounded >> 16)};
}

// float -> IEEE binary16, rounded to nearest, ties to even: +-inf past 65504 (from 65520 on, the midpoint
// to the next power of two), subnormal halves below 2^-14, zero at 2^-25 and below; NaN -> a quiet NaN of
// the same sign.
inline Float16 to_float16(float f) noexcept {
  const std::uint32_t u = detail::float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t x = u & 0x7FFFFFFFu;
  if (x > 0x7F800000u) return Float16{static_cast<std::uint16_t>(sign | 0x7E00u)};
  if (x >= 0x477FF000u) return Float16{static_cast<std::uint16_t>(sign | 0x7C00u)};  // 65520 and up, inf
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), mantissa = round(|f| * 2^24)
    if (x <= 0x33000000u) return Float16{sign};  // at most 2^-25: the tie at 2^-25 goes to the even zero
    const std::uint32_t e = x >> 23;  // 103 .. 112
    const std::uint32_t m = (x & 0x7FFFFFu) | 0x800000u;  // |f| = m * 2^(e - 150)
    const std::uint32_t shift = 126 - e;  // |f| * 2^24 = m / 2^shift, shift in 14 .. 23
    std::uint32_t q = m >> shift;
    const std::uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1u))) ++q;  // q = 0x400 is the smallest normal half: right
    return Float16{static_cast<std::uint16_t>(sign | q)};
  }
  const std::uint32_t r = x - 0x38000000u;  // the exponent rebiased from 127 to 15
  std::uint32_t q = r >> 13;
  const std::uint32_t rest = r & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (q & 1u))) ++q;  // a carry moves into the exponent, as it must
  return Float16{static_cast<std::uint16_t>(sign | q)};
}

// Symmetric int8 quantisation of n values (one token's key or value head): scale = max |x| / 127, q[i] =
// x[i] / scale rounded to nearest (ties to even) in [-127, 127], so that x[i] ~ scale * q[i] with an error of
// at most scale / 2. Returns the scale: 0 for an all-zero segment (every q 0), NaN when a value is not
// finite (every q 0 then: the whole segment reads back as NaN, so a NaN or infinity still poisons the rows
// that see it, as in a float cache, instead of vanishing).
inline float quantize_int8(const float* x, std::ptrdiff_t n, std::int8_t* q) noexcept {
  float amax = 0.0f;
  bool finite = true;
  for (std::ptrdiff_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::fmax(amax, std::fabs(x[i]));
  }
  if (!finite || amax == 0.0f) {
    for (std::ptrdiff_t i = 0; i < n; ++i) q[i] = 0;
    return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  const float scale = amax / 127.0f;
  for (std::ptrdiff_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(x[i] / scale);  // |x / scale| <= 127 * (1 + 2^-23): r in [-127, 127]
    q[i] = static_cast<std::int8_t>(std::fmin(127.0f, std::fmax(-127.0f, r)));
  }
  return scale;
}

// Queries against int8 keys, where a path sums their products in integers (simd/generic_int8.inc's
// int8_chunk_scores, against the query rounded to int16: q = x * (32767 / max |x|) rounded to nearest): the
// longest query so rounded. n int16 values of magnitude at most 32767 against int8 keys (magnitude at most
// 128, a loaded cache's -128 included) sum to less than 2^31 up to n = 512, so the int32 sums are exact.
constexpr std::ptrdiff_t kInt16QueryMaxLength = 512;

namespace detail {
// n rows of heads * d Scalar values (row stride ld) into rows of `storage` at dst (heads * d elements each,
// contiguous), rounded (bfloat16, float16) or quantised per head (int8: one scale per row and head at
// scales[row * heads + head]); Scalar itself (kFloat32 / kFloat64) is copied. What a cache does to entries
// it receives.
template <typename Scalar>
void store_rows(Storage storage, const Scalar* src, std::ptrdiff_t ld, std::ptrdiff_t n, std::ptrdiff_t heads,
                std::ptrdiff_t d, unsigned char* dst, float* scales) noexcept {
  const std::ptrdiff_t width = heads * d;
  for (std::ptrdiff_t r = 0; r < n; ++r) {
    const Scalar* row = src + r * ld;
    switch (storage) {
      case Storage::kBFloat16: {
        auto* out = reinterpret_cast<BFloat16*>(dst) + r * width;
        for (std::ptrdiff_t c = 0; c < width; ++c) out[c] = to_bfloat16(static_cast<float>(row[c]));
        break;
      }
      case Storage::kFloat16: {
        auto* out = reinterpret_cast<Float16*>(dst) + r * width;
        for (std::ptrdiff_t c = 0; c < width; ++c) out[c] = to_float16(static_cast<float>(row[c]));
        break;
      }
      case Storage::kInt8: {
        if constexpr (std::is_same<Scalar, float>::value) {
          auto* out = reinterpret_cast<std::int8_t*>(dst) + r * width;
          for (std::ptrdiff_t g = 0; g < heads; ++g) scales[r * heads + g] = quantize_int8(row + g * d, d, out + g * d);
        }
        break;
      }
      default: {
        auto* out = reinterpret_cast<Scalar*>(dst) + r * width;
        for (std::ptrdiff_t c = 0; c < width; ++c) out[c] = row[c];
        break;
      }
    }
  }
}

// The inverse: n stored rows back to Scalar, exactly (int8: scale * q).
template <typename Scalar>
void load_rows(Storage storage, const unsigned char* src, std::ptrdiff_t n, std::ptrdiff_t heads, std::ptrdiff_t d,
               const float* scales, Scalar* dst) noexcept {
  const std::ptrdiff_t width = heads * d;
  for (std::ptrdiff_t r = 0; r < n; ++r)
    for (std::ptrdiff_t c = 0; c < width; ++c) {
      const std::ptrdiff_t i = r * width + c;
      Scalar x;
      switch (storage) {
        case Storage::kBFloat16:
          x = static_cast<Scalar>(to_float(reinterpret_cast<const BFloat16*>(src)[i]));
          break;
        case Storage::kFloat16:
          x = static_cast<Scalar>(to_float(reinterpret_cast<const Float16*>(src)[i]));
          break;
        case Storage::kInt8:
          x = static_cast<Scalar>(static_cast<float>(reinterpret_cast<const std::int8_t*>(src)[i]) * scales[r * heads + c / d]);
          break;
        default:
          x = reinterpret_cast<const Scalar*>(src)[i];
          break;
      }
      dst[i] = x;
    }
}
}  // namespace detail

SDPA_NAMESPACE_END
