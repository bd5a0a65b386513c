// Closes the target region that target_avx2_begin.hpp or target_avx512_begin.hpp opened.
#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
