// Opens a target region for the AMX tile kernels (simd/bf16.hpp's amx namespace): the AVX512_BF16 region's
// features plus AMX-TILE and AMX-BF16. The same rules as target_avx2_begin.hpp.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
