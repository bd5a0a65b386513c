// Opens a target region for simd/vnni.hpp's avx512_vnni namespace: the AVX-512 region's features plus
// AVX512_VNNI (vpdpwssd on zmm). The same rules as target_avx2_begin.hpp.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
