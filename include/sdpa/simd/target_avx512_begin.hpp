// Opens a target region for the AVX-512 kernels: every function defined until target_end.hpp is compiled
// for Skylake-X-class CPUs (AVX-512 F, BW, DQ, VL, with AVX2, FMA, F16C, BMI1/2) whatever the translation
// unit's -march. The same rules as target_avx2_begin.hpp.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
