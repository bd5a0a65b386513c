// Opens a target region for the AVX2 + FMA kernels: every function defined until target_end.hpp (templates
// and lambdas included) is compiled for Haswell-class CPUs (AVX2, FMA, F16C, BMI1/2) whatever the
// translation unit's -march. Include it after every header the region needs (a header first included
// inside the region would be compiled for its target), and close it with target_end.hpp. No include
// guard: each per-ISA header opens and closes its own region.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
