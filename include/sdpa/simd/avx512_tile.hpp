// The AVX-512 GEMM's full register tile (6 rows x 4 zmm vectors) k loop in assembly, for float and double.
// Included by sdpa/simd/avx512.hpp inside namespace sdpa::avx512 and its target region; the vector traits
// name it (Vec<Scalar>::tile_k_loop) and generic_gemm.inc's tile calls it for full tiles.
//
// Why assembly: written with intrinsics (generic_gemm.inc's step), GCC 12 allocates the 24 accumulators,
// 4 B vectors and the broadcasts of the 4-step unrolled loop badly: it rotates accumulators through B's
// registers with zmm copies and spills one accumulator to the stack every iteration (bench/RESULTS.md, "The
// full tile's k loop in assembly"). The loop below is the same computation in the same order (each
// accumulator acc[r][v] += broadcast(A[r][p]) * B[p][v] for p = 0, 1, ..., one FMA per step), so its results
// are bit-identical to the intrinsics' tile, which the edge tiles still run.
//
// Contract of gemm_tile_k_loop<Scalar, StepBytes>(args, acc):
//   A value r of step p at args.a + r * args.row_bytes + p * StepBytes (A in place: row_bytes = lda *
//   sizeof(Scalar), StepBytes = sizeof(Scalar); a packed sliver: row_bytes = sizeof(Scalar), StepBytes =
//   mr * sizeof(Scalar));
//   B step p's 4 vectors at args.b + p * 256 bytes, 64-byte aligned (a packed B sliver);
//   after every 4 steps, while args.rows_left > 0: one prefetch to L2 of the line at args.line, which then
//   advances by 64 bytes; after args.seg_left lines it skips args.seg_skip bytes, the next segment has
//   args.seg_lines lines, and rows_left counts down the segments;
//   acc[r][v] receives the sum over 4 * args.iterations + args.rem steps (zeroed first).
// Registers: the accumulators wherever the compiler puts them (the only 24 zmm registers it has left: the
// others are clobbered), B zmm24-27, broadcasts zmm28-31; the arguments in fixed general registers.
#pragma once

using TileLoopArgs = gemm::detail::TileLoopArgs;  // the loop's arguments (sdpa/gemm/epilogue.hpp)

#include "sdpa/simd/tile_loop_asm.inc"

#define SDPA_DETAIL_TILE_B(u, PS)                  \
  "vmova" PS " " #u "*256+0(%%r11), %%zmm24\n\t"   \
  "vmova" PS " " #u "*256+64(%%r11), %%zmm25\n\t"  \
  "vmova" PS " " #u "*256+128(%%r11), %%zmm26\n\t" \
  "vmova" PS " " #u "*256+192(%%r11), %%zmm27\n\t"
#define SDPA_DETAIL_TILE_ROW(addr, bc, r, PS, SS)                   \
  "vbroadcast" SS " " addr ", %%" bc "\n\t"                          \
  "vfmadd231" PS " %%zmm24, %%" bc ", %[a" #r "0]\n\t"              \
  "vfmadd231" PS " %%zmm25, %%" bc ", %[a" #r "1]\n\t"              \
  "vfmadd231" PS " %%zmm26, %%" bc ", %[a" #r "2]\n\t"              \
  "vfmadd231" PS " %%zmm27, %%" bc ", %[a" #r "3]\n\t"
// One k step: rows 0-2 from r8 (+ 0, 1, 2 row strides), rows 3-5 from r9 = r8 + 3 row strides.
#define SDPA_DETAIL_TILE_STEP(u, d, PS, SS)                             \
  SDPA_DETAIL_TILE_B(u, PS)                                            \
  SDPA_DETAIL_TILE_ROW(d "(%%r8)", "zmm28", 0, PS, SS)                 \
  SDPA_DETAIL_TILE_ROW(d "(%%r8,%%r10,1)", "zmm29", 1, PS, SS)         \
  SDPA_DETAIL_TILE_ROW(d "(%%r8,%%r10,2)", "zmm30", 2, PS, SS)         \
  SDPA_DETAIL_TILE_ROW(d "(%%r9)", "zmm31", 3, PS, SS)                 \
  SDPA_DETAIL_TILE_ROW(d "(%%r9,%%r10,1)", "zmm28", 4, PS, SS)         \
  SDPA_DETAIL_TILE_ROW(d "(%%r9,%%r10,2)", "zmm29", 5, PS, SS)
#define SDPA_DETAIL_TILE_ZERO(r, PS)                                                                       \
  "vmova" PS " %[a00], %[a" #r "0]\n\t vmova" PS " %[a00], %[a" #r "1]\n\t vmova" PS " %[a00], %[a" #r "2]\n\t" \
  "vmova" PS " %[a00], %[a" #r "3]\n\t"
#define SDPA_DETAIL_TILE_ASM(PS, SS)                                                                        \
  SDPA_DETAIL_TILE_LOAD_ARGS                                                                              \
  "vpxord %[a00], %[a00], %[a00]\n\t"                                                                       \
  "vmova" PS " %[a00], %[a01]\n\t vmova" PS " %[a00], %[a02]\n\t vmova" PS " %[a00], %[a03]\n\t"            \
  SDPA_DETAIL_TILE_ZERO(1, PS) SDPA_DETAIL_TILE_ZERO(2, PS) SDPA_DETAIL_TILE_ZERO(3, PS)                    \
  SDPA_DETAIL_TILE_ZERO(4, PS) SDPA_DETAIL_TILE_ZERO(5, PS)                                                 \
  SDPA_DETAIL_TILE_LOOPS(SDPA_DETAIL_TILE_STEP, PS, SS, "1024", "256")

#define SDPA_DETAIL_TILE_OUT(r)                                                                             \
  [a##r##0] "=v"(acc[r][0]), [a##r##1] "=v"(acc[r][1]), [a##r##2] "=v"(acc[r][2]), [a##r##3] "=v"(acc[r][3])
// Operands shared by the float and the double loop: 24 outputs, 5 inputs.
#define SDPA_DETAIL_TILE_OPERANDS                                                                            \
  : SDPA_DETAIL_TILE_OUT(0), SDPA_DETAIL_TILE_OUT(1), SDPA_DETAIL_TILE_OUT(2), SDPA_DETAIL_TILE_OUT(3),      \
    SDPA_DETAIL_TILE_OUT(4), SDPA_DETAIL_TILE_OUT(5)                                                         \
  : [args] "r"(&args), [d1] "i"(StepBytes), [d2] "i"(2 * StepBytes), [d3] "i"(3 * StepBytes),                \
    [d4] "i"(4 * StepBytes)                                                                                   \
  : "memory", "cc", "rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "r12", "r13", "xmm24",       \
    "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31"

// The loop for Scalar (float or double; Reg its __m512 type); see the contract above.
template <typename Scalar, std::int64_t StepBytes, typename Reg>
SDPA_ALWAYS_INLINE void gemm_tile_k_loop(const TileLoopArgs& args, Reg (&acc)[6][4]) noexcept {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "gemm_tile_k_loop: float or double");
  if constexpr (std::is_same<Scalar, float>::value) {
    __asm__(SDPA_DETAIL_TILE_ASM("ps", "ss") SDPA_DETAIL_TILE_OPERANDS);
  } else {
    __asm__(SDPA_DETAIL_TILE_ASM("pd", "sd") SDPA_DETAIL_TILE_OPERANDS);
  }
}

#undef SDPA_DETAIL_TILE_OPERANDS
#undef SDPA_DETAIL_TILE_LOOPS
#undef SDPA_DETAIL_TILE_LOAD_ARGS
#undef SDPA_DETAIL_TILE_OUT
#undef SDPA_DETAIL_TILE_ASM
#undef SDPA_DETAIL_TILE_ZERO
#undef SDPA_DETAIL_TILE_STEP
#undef SDPA_DETAIL_TILE_ROW
#undef SDPA_DETAIL_TILE_B
