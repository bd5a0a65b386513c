// Opens a target region for the bfloat16 kernels (simd/bf16.hpp's avx512_bf16 namespace): the AVX-512
// region's features plus AVX512_BF16 (vdpbf16ps, vcvtne2ps2bf16). The same rules as target_avx2_begin.hpp.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
