// Which instruction set this translation unit's GEMM is compiled for, chosen from the compiler's target
// macros (-march): AVX-512F, else AVX2 with FMA, else Eigen's products. The choice also names an inline
// namespace around everything in sdpa::gemm, so that two translation units built for different targets
// (one with -march=native, one without) define differently mangled functions instead of silently breaking
// the one-definition rule: the linker could otherwise keep the AVX-512 copy of an inline function for a
// caller that was compiled to run anywhere.
#pragma once

#if defined(__AVX512F__)
#define SDPA_GEMM_ISA_AVX512 1
#define SDPA_GEMM_ABI_NAMESPACE avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define SDPA_GEMM_ISA_AVX2 1
#define SDPA_GEMM_ABI_NAMESPACE avx2
#else
#define SDPA_GEMM_ISA_EIGEN 1
#define SDPA_GEMM_ABI_NAMESPACE eigen
#endif

// For a micro-kernel's store: called out of line, it would take the accumulators through memory (the
// array is passed by reference), 24 spills and 24 reloads per tile, a tenth of a 64-deep tile's time.
#if defined(__GNUC__) || defined(__clang__)
#define SDPA_GEMM_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define SDPA_GEMM_ALWAYS_INLINE inline
#endif

namespace sdpa {
namespace gemm {
inline namespace SDPA_GEMM_ABI_NAMESPACE {

// "avx512", "avx2" or "eigen": for benchmark labels and test names.
constexpr const char* isa_name() noexcept {
#if defined(SDPA_GEMM_ISA_AVX512)
  return "avx512";
#elif defined(SDPA_GEMM_ISA_AVX2)
  return "avx2";
#else
  return "eigen";
#endif
}

}  // namespace SDPA_GEMM_ABI_NAMESPACE
}  // namespace gemm
}  // namespace sdpa
