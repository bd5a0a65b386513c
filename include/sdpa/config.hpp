// What every sdpa header opens with: the namespace macros and the ABI tag they carry. All of sdpa lives in
// an inline namespace named after the instruction-set baseline of the translation unit (the -march it was
// compiled with) and the optional backends compiled in, e.g. sdpa::abi_sse2 for a plain -O2 build and
// sdpa::abi_avx512 for -march=native on an AVX-512 machine. Users still write sdpa::ScaledDotProductAttention;
// the tag only changes the linker's names. Every inline function of sdpa may be compiled differently under
// a different -march (the compiler vectorises with what the baseline allows), and without the tag two
// translation units would define the same function with two bodies: the linker keeps one of them, possibly
// the AVX-512 one, for code meant to run on any CPU. With the tag each baseline has functions of its own.
// (nlohmann_json does the same for its configuration macros.) A consequence: objects of sdpa types cannot be
// passed between translation units built with different baselines; the linker says so (an undefined
// symbol) rather than running the wrong code.
//
// The kernels chosen at run time (sdpa/cpu.hpp) are compiled through target attributes inside this same
// namespace, so they too exist once per baseline.
#pragma once

#define SDPA_DETAIL_CAT_(a, b) a##b
#define SDPA_DETAIL_CAT(a, b) SDPA_DETAIL_CAT_(a, b)

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#define SDPA_X86 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define SDPA_DETAIL_ABI_ISA abi_avx512
#elif defined(__AVX512F__)
#define SDPA_DETAIL_ABI_ISA abi_avx512f
#elif defined(__AVX2__) && defined(__FMA__)
#define SDPA_DETAIL_ABI_ISA abi_avx2
#elif defined(__AVX__)
#define SDPA_DETAIL_ABI_ISA abi_avx
#elif defined(__SSE4_2__)
#define SDPA_DETAIL_ABI_ISA abi_sse4
#else
#define SDPA_DETAIL_ABI_ISA abi_sse2
#endif
#elif defined(__aarch64__) || defined(_M_ARM64)
#if defined(__ARM_FEATURE_SVE)
#define SDPA_DETAIL_ABI_ISA abi_sve
#else
#define SDPA_DETAIL_ABI_ISA abi_neon
#endif
#else
#define SDPA_DETAIL_ABI_ISA abi_generic
#endif

// (Defined by the includer, it replaces the tag: for the ODR test, which shows what happens without it.)
#if !defined(SDPA_ABI_NAMESPACE)
#if defined(SDPA_USE_ONEDNN)
#define SDPA_ABI_NAMESPACE SDPA_DETAIL_CAT(SDPA_DETAIL_ABI_ISA, _dnnl)
#else
#define SDPA_ABI_NAMESPACE SDPA_DETAIL_ABI_ISA
#endif
#endif

#define SDPA_NAMESPACE_BEGIN \
  namespace sdpa {           \
  inline namespace SDPA_ABI_NAMESPACE {
#define SDPA_NAMESPACE_END \
  }                        \
  }

// Runtime instruction-set dispatch (sdpa/cpu.hpp): x86-64 with GCC or Clang, whose target attributes and
// pragmas compile AVX2 and AVX-512 kernels in any translation unit. Elsewhere (other compilers, other
// architectures) the portable kernels are the only ones, compiled for the baseline. Define
// SDPA_NO_DISPATCH to build the portable kernels only.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SDPA_NO_DISPATCH)
#define SDPA_DISPATCH 1
#else
#define SDPA_DISPATCH 0
#endif

// For a micro-kernel's store and steps: called out of line, they would take the accumulators through memory.
// (The _LAMBDA form goes after a lambda's parameter list.)
#if defined(__GNUC__) || defined(__clang__)
#define SDPA_ALWAYS_INLINE __attribute__((always_inline)) inline
#define SDPA_ALWAYS_INLINE_LAMBDA __attribute__((always_inline))
#else
#define SDPA_ALWAYS_INLINE inline
#define SDPA_ALWAYS_INLINE_LAMBDA
#endif
