// The one place sdpa includes the x86 intrinsics. GCC before 13 reports -Wmaybe-uninitialized /
// -Wuninitialized inside its own AVX-512 intrinsics (_mm512_undefined_ps() is `__m512 __Y = __Y;`, GCC bug
// 105593) wherever they are inlined, Eigen's packets included: the two warnings are silenced for the
// text of <immintrin.h> only, so a consumer's -Werror build stays clean and their own code keeps them.
#pragma once

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif
