// The run-time choice between the per-ISA kernels (sdpa::avx512, sdpa::avx2, sdpa::portable), made in one
// place: with_isa(isa, f) calls f with the path as a type (IsaPath<Isa::k...>), and SDPA_SIMD_CALL(isa, fn,
// args...) runs namespace <path>::fn(args...) through it. Each function below takes the Isa a kernel call
// read at its start (sdpa/cpu.hpp) and runs that path's version; where a path has no version of its own for
// a type (the softmax exponent in double), the portable one serves. with_gemm_kernel hands a GEMM's loops
// the micro-kernel type of the path, so that the loops are instantiated once per path and run without a
// branch inside.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <cstdint>
#include <type_traits>

#include "sdpa/cpu.hpp"
#include "sdpa/simd/avx2.hpp"
#include "sdpa/simd/avx512.hpp"
#include "sdpa/simd/portable.hpp"
#include "sdpa/simd/rows.hpp"
#include "sdpa/simd/vnni.hpp"

SDPA_NAMESPACE_BEGIN
namespace simd {

// The path `isa` names, as a type: f(IsaPath<isa>{}) for the paths this build has (only the portable one
// without SDPA_DISPATCH). Every per-ISA call goes through here.
template <Isa kIsa>
using IsaPath = std::integral_constant<Isa, kIsa>;

template <typename F>
SDPA_ALWAYS_INLINE decltype(auto) with_isa(Isa isa, F&& f) {
#if SDPA_DISPATCH
  if (isa == Isa::kAvx512) return f(IsaPath<Isa::kAvx512>{});
  if (isa == Isa::kAvx2) return f(IsaPath<Isa::kAvx2>{});
#endif
  (void)isa;
  return f(IsaPath<Isa::kPortable>{});
}

// namespace <path of isa>::fn(args...), through with_isa.
#if SDPA_DISPATCH
#define SDPA_SIMD_CALL(isa, fn, ...)                                                   \
  ::sdpa::simd::with_isa(isa, [&](auto sdpa_path_) SDPA_ALWAYS_INLINE_LAMBDA -> decltype(auto) { \
    if constexpr (decltype(sdpa_path_)::value == ::sdpa::Isa::kAvx512)                 \
      return ::sdpa::SDPA_ABI_NAMESPACE::avx512::fn(__VA_ARGS__);                      \
    else if constexpr (decltype(sdpa_path_)::value == ::sdpa::Isa::kAvx2)              \
      return ::sdpa::SDPA_ABI_NAMESPACE::avx2::fn(__VA_ARGS__);                        \
    else                                                                               \
      return ::sdpa::SDPA_ABI_NAMESPACE::portable::fn(__VA_ARGS__);                    \
  })
#else
#define SDPA_SIMD_CALL(isa, fn, ...) ((void)(isa), ::sdpa::SDPA_ABI_NAMESPACE::portable::fn(__VA_ARGS__))
#endif

// f(Kernel{}) with the GEMM micro-kernel of `isa` for Scalar.
template <typename Scalar, typename F>
decltype(auto) with_gemm_kernel(Isa isa, F&& f) {
  return with_isa(isa, [&](auto path) -> decltype(auto) {
#if SDPA_DISPATCH
    if constexpr (decltype(path)::value == Isa::kAvx512) return f(avx512::GemmKernel<Scalar>{});
    else if constexpr (decltype(path)::value == Isa::kAvx2) return f(avx2::GemmKernel<Scalar>{});
    else return f(portable::GemmKernel<Scalar>{});
#else
    (void)path;
    return f(portable::GemmKernel<Scalar>{});
#endif
  });
}

// The path for a row function that only the portable path has for Scalar other than float.
template <typename Scalar>
Isa float_path(Isa isa) noexcept {
  return std::is_same<Scalar, float>::value ? isa : Isa::kPortable;
}

// x[j] = exp(x[j] - shift) for j < n, returning their sum: the softmax's pass over a row of scores; exactly
// 0 for hidden keys (-inf).
template <typename Scalar>
Scalar exp_shifted_sum(Isa isa, Scalar* x, Eigen::Index n, Scalar shift) noexcept {
  if constexpr (std::is_same<Scalar, float>::value) return SDPA_SIMD_CALL(isa, exp_shifted_sum, x, n, shift);
  (void)isa;
  return portable::exp_shifted_sum(x, n, shift);
}

// exp_shifted_sum for a shift that may lie below the row's largest score, by at most limit - shift (a few
// units; the online softmax's lazy maximum, SoftmaxRow::fold): the pass stops before the first group of
// scores (a few vectors' worth) that holds one above `limit`, so that no exponent it takes can overflow, and
// sets *done to where it stopped, n when it went through. x[0, *done) holds the exponentials, whose sum it
// returns; x[*done, n) is untouched.
template <typename Scalar>
Scalar exp_shifted_sum_below(Isa isa, Scalar* x, Eigen::Index n, Scalar shift, Scalar limit, Eigen::Index* done) noexcept {
  if constexpr (std::is_same<Scalar, float>::value) return SDPA_SIMD_CALL(isa, exp_shifted_sum_below, x, n, shift, limit, done);
  (void)isa;
  return portable::exp_shifted_sum_below(x, n, shift, limit, done);
}

// x[j] = cap * tanh(x[j] / cap) for j < n: the logit softcap (Gemma 2), cap > 0.
template <typename Scalar>
void softcap(Isa isa, Scalar* x, Eigen::Index n, Scalar cap) noexcept {
  if constexpr (std::is_same<Scalar, float>::value) return SDPA_SIMD_CALL(isa, softcap_row, x, n, cap);
  (void)isa;
  portable::softcap_row(x, n, cap);
}

// The largest of x[0 .. n), n > 0 (a NaN may or may not win).
template <typename Scalar>
Scalar row_max(Isa isa, const Scalar* x, Eigen::Index n) noexcept {
  return SDPA_SIMD_CALL(isa, row_max, x, n);
}

template <typename Scalar>
Scalar dot(Isa isa, const Scalar* a, const Scalar* b, Eigen::Index n) noexcept {
  return SDPA_SIMD_CALL(isa, dot, a, b, n);
}

// acc[0, n) += sum over j < m of w[j] * rows[j * stride + (0, n)].
template <typename Scalar>
void add_weighted_rows(Isa isa, Scalar* acc, Eigen::Index n, const Scalar* w, const Scalar* rows, Eigen::Index stride,
                       Eigen::Index m) noexcept {
  SDPA_SIMD_CALL(isa, add_weighted_rows, acc, n, w, rows, stride, m);
}

// Stored rows widened to float (generic_rows.inc's widen_rows): T is BFloat16, Float16 or std::int8_t.
template <typename T>
void widen_rows(Isa isa, Rows<T> src, Eigen::Index rows, Eigen::Index cols, Eigen::Index span, float* dst,
                Eigen::Index ldd) noexcept {
  SDPA_SIMD_CALL(isa, widen_rows, src, rows, cols, span, dst, ldd);
}

// a . b with a stored as bfloat16 or float16 (generic_rows.inc's dot_stored).
template <typename T>
float dot_stored(Isa isa, const T* a, const float* b, Eigen::Index n) noexcept {
  return SDPA_SIMD_CALL(isa, dot_stored, a, b, n);
}

// out[r] = a . b[r * ldb, +n) for r < rows: dot (T = Scalar) or dot_stored (T bfloat16 / float16, Scalar
// float) of each row, with their bits (generic_rows.inc's dot_rows).
template <typename T, typename Scalar>
void dot_rows(Isa isa, const T* a, const Scalar* b, Eigen::Index ldb, Eigen::Index rows, Eigen::Index n, Scalar* out) noexcept {
  SDPA_SIMD_CALL(isa, dot_rows, a, b, ldb, rows, n, out);
}

// Whether int8 keys' integer products run on the VNNI instructions on this path (simd/vnni.hpp): the
// AVX-512 path where the CPU has AVX512_VNNI, the AVX2 path where it has AVX-VNNI.
inline bool int8_vnni(Isa isa) noexcept {
  const CpuFeatures& f = cpu_features();
  return (isa == Isa::kAvx512 && f.avx512vnni) || (isa == Isa::kAvx2 && f.avx_vnni);
}

// The decoding step's scores of a chunk of n keys (generic_rows.inc's chunk_scores): keys stored as T, the
// compute type Scalar or (Scalar float) BFloat16, Float16, std::int8_t with one scale per (row, head); int8
// keys' scores on the VNNI kernels where int8_vnni says so (the same bits).
template <typename T, typename Scalar>
void chunk_scores(Isa isa, Rows<T> k, Eigen::Index n, Queries<Scalar> q, Scores<Scalar> s) noexcept {
#if SDPA_DISPATCH
  if constexpr (std::is_same<T, std::int8_t>::value) {
    if (q.d <= kInt16QueryMaxLength && int8_vnni(isa)) {
      if (isa == Isa::kAvx512) return avx512_vnni::int8_scores(k, n, q, s);
      return avx_vnni::int8_scores(k, n, q, s);
    }
  }
#endif
  SDPA_SIMD_CALL(isa, chunk_scores, k, n, q, s);
}

// Whether chunk_scores sums int8 keys' products in integers on this path, against each query rounded
// to int16 (generic_int8.inc's int8_chunk_scores), for head sizes up to kInt16QueryMaxLength.
inline bool int8_integer_products(Isa isa) noexcept {
  return with_isa(isa, [](auto path) {
#if SDPA_DISPATCH
    if constexpr (decltype(path)::value == Isa::kAvx512) return avx512::Vec<float>::kInt8Products;
    else if constexpr (decltype(path)::value == Isa::kAvx2) return avx2::Vec<float>::kInt8Products;
    else return false;
#else
    (void)path;
    return false;
#endif
  });
}

// The instructions that multiply int8 keys by queries on this path, for reports and test names.
inline const char* int8_products_name(Isa isa) noexcept {
  if (int8_vnni(isa)) return isa == Isa::kAvx512 ? "vpdpwssd zmm (AVX512_VNNI)" : "vpdpwssd ymm (AVX-VNNI)";
  if (int8_integer_products(isa)) return isa == Isa::kAvx512 ? "vpmaddwd zmm" : "vpmaddwd ymm";
  return "widened float";
}

// add_weighted_rows over m value rows of head 0 of `rows`, stored as T (BFloat16, Float16, std::int8_t with
// one scale per (row, head)); the `ahead` rows after them are read next (generic_rows.inc's
// add_weighted_rows_stored).
template <typename T>
void add_weighted_rows_stored(Isa isa, float* acc, Eigen::Index n, const float* w, Rows<T> rows, Eigen::Index m,
                              Eigen::Index ahead = 0) noexcept {
  SDPA_SIMD_CALL(isa, add_weighted_rows_stored, acc, n, w, rows, m, ahead);
}

// add_weighted_rows_stored for several query heads over the same rows, as `sums` says (simd/rows.hpp's
// HeadSums; generic_rows.inc's add_weighted_rows_stored_heads).
template <typename T>
void add_weighted_rows_stored_heads(Isa isa, HeadSums<float> sums, Eigen::Index n, Rows<T> rows, Eigen::Index m,
                                    Eigen::Index ahead) noexcept {
  SDPA_SIMD_CALL(isa, add_weighted_rows_stored_heads, sums, n, rows, m, ahead);
}

// The natural order of the features of an accumulator that add_weighted_rows_stored filled from bfloat16
// rows (generic_rows.inc's unpair_features; nothing to do on the portable path).
inline void unpair_features(Isa isa, float* acc, Eigen::Index n) noexcept {
  with_isa(isa, [&](auto path) {
#if SDPA_DISPATCH
    if constexpr (decltype(path)::value == Isa::kAvx512) avx512::unpair_features(acc, n);
    else if constexpr (decltype(path)::value == Isa::kAvx2) avx2::unpair_features(acc, n);
#else
    (void)path, (void)acc, (void)n;
#endif
  });
}

// A dropout draw's Philox stream: its key and the call it numbers.
struct PhiloxStream {
  std::uint32_t key0 = 0;
  std::uint32_t key1 = 0;
  std::uint32_t call = 0;
};

// Philox words of the first blocks of [k4_begin, k4_begin + blocks) of row (bh, q) that the path computes
// `width` blocks at a time, in DropoutSampler::fill_bits's layout; returns how many blocks that covered
// (0 on the portable path). The caller computes the rest one block at a time.
inline std::int64_t philox_fill(Isa isa, const PhiloxStream& stream, std::int64_t bh, std::int64_t q,
                                std::int64_t k4_begin, std::int64_t blocks, std::uint32_t* out) noexcept {
  const std::uint32_t key0 = stream.key0, key1 = stream.key1, call = stream.call;
  std::int64_t i = 0;
  const auto run = [&](auto width, auto fill) {
    for (; i + width <= blocks; i += width)
      fill(key0, key1, call, static_cast<std::uint32_t>(bh), static_cast<std::uint32_t>(q),
           static_cast<std::uint32_t>(k4_begin + i), out + 4 * i);
  };
  with_isa(isa, [&](auto path) {
#if SDPA_DISPATCH
    if constexpr (decltype(path)::value == Isa::kAvx512) run(std::int64_t{avx512::Words::width}, avx512::philox_blocks);
    else if constexpr (decltype(path)::value == Isa::kAvx2) run(std::int64_t{avx2::Words::width}, avx2::philox_blocks);
#else
    (void)path, (void)run;
#endif
  });
  return i;
}

}  // namespace simd
SDPA_NAMESPACE_END
