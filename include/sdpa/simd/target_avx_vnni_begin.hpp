// Opens a target region for simd/vnni.hpp's avx_vnni namespace: the AVX2 region's features plus AVX-VNNI
// (vpdpwssd on ymm, VEX-encoded: Alder Lake, Sapphire Rapids, Zen 5). The same rules as
// target_avx2_begin.hpp.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni,bmi,bmi2,lzcnt,popcnt")
#endif
