// The AVX2 GEMM's full register tile (6 rows x 2 ymm vectors) k loop in assembly, for float and double.
// Included by sdpa/simd/avx2.hpp inside namespace sdpa::avx2 and its target region; the vector traits name
// it (Vec<Scalar>::tile_k_loop) and generic_gemm.inc's tile calls it for full tiles.
//
// Why assembly: with 16 ymm registers, the intrinsics' loop (generic_gemm.inc's step: 12 accumulators, 2 B
// vectors, a broadcast) leaves GCC 12 one register of slack; it interleaves the unrolled steps, runs out,
// and reloads B as memory operands of the FMAs, copies accumulators between registers and keeps one in a
// stack slot across the loop (bench/RESULTS.md, "The AVX2 tile's k loop in assembly"). The loop below is the
// same computation in the same order (each accumulator acc[r][v] += broadcast(A[r][p]) * B[p][v] for
// p = 0, 1, ..., one FMA per step), so its results are bit-identical to the intrinsics' tile, which the
// edge tiles still run.
//
// Contract of gemm_tile_k_loop<Scalar, StepBytes>(args, acc): as simd/avx512_tile.hpp's, with B step p's
// 2 vectors at args.b + p * 64 bytes, 32-byte aligned (a packed B sliver of 16 floats or 8 doubles).
// Registers: the accumulators wherever the compiler puts them (the 12 ymm registers it has left: the other
// four are clobbered), B ymm12-13, broadcasts ymm14-15; the arguments in fixed general registers.
#pragma once

using TileLoopArgs = gemm::detail::TileLoopArgs;  // the loop's arguments (sdpa/gemm/epilogue.hpp)

#include "sdpa/simd/tile_loop_asm.inc"

#define SDPA_DETAIL_TILE2_ROW(addr, bc, r, PS, SS)     \
  "vbroadcast" SS " " addr ", %%" bc "\n\t"             \
  "vfmadd231" PS " %%ymm12, %%" bc ", %[a" #r "0]\n\t" \
  "vfmadd231" PS " %%ymm13, %%" bc ", %[a" #r "1]\n\t"
// One k step: B's two vectors, rows 0-2 from r8 (+ 0, 1, 2 row strides), rows 3-5 from r9 = r8 + 3 row
// strides, the broadcasts alternating between two registers.
#define SDPA_DETAIL_TILE2_STEP(u, d, PS, SS)                       \
  "vmova" PS " " #u "*64+0(%%r11), %%ymm12\n\t"                   \
  "vmova" PS " " #u "*64+32(%%r11), %%ymm13\n\t"                  \
  SDPA_DETAIL_TILE2_ROW(d "(%%r8)", "ymm14", 0, PS, SS)           \
  SDPA_DETAIL_TILE2_ROW(d "(%%r8,%%r10,1)", "ymm15", 1, PS, SS)   \
  SDPA_DETAIL_TILE2_ROW(d "(%%r8,%%r10,2)", "ymm14", 2, PS, SS)   \
  SDPA_DETAIL_TILE2_ROW(d "(%%r9)", "ymm15", 3, PS, SS)           \
  SDPA_DETAIL_TILE2_ROW(d "(%%r9,%%r10,1)", "ymm14", 4, PS, SS)   \
  SDPA_DETAIL_TILE2_ROW(d "(%%r9,%%r10,2)", "ymm15", 5, PS, SS)
#define SDPA_DETAIL_TILE2_ASM(PS, SS)                                                                     \
  SDPA_DETAIL_TILE_LOAD_ARGS                                                                              \
  "vxor" PS " %[a00], %[a00], %[a00]\n\t"                                                                 \
  "vmova" PS " %[a00], %[a01]\n\t vmova" PS " %[a00], %[a10]\n\t vmova" PS " %[a00], %[a11]\n\t"          \
  "vmova" PS " %[a00], %[a20]\n\t vmova" PS " %[a00], %[a21]\n\t vmova" PS " %[a00], %[a30]\n\t"          \
  "vmova" PS " %[a00], %[a31]\n\t vmova" PS " %[a00], %[a40]\n\t vmova" PS " %[a00], %[a41]\n\t"          \
  "vmova" PS " %[a00], %[a50]\n\t vmova" PS " %[a00], %[a51]\n\t"                                         \
  SDPA_DETAIL_TILE_LOOPS(SDPA_DETAIL_TILE2_STEP, PS, SS, "256", "64")

#define SDPA_DETAIL_TILE2_OUT(r) [a##r##0] "=x"(acc[r][0]), [a##r##1] "=x"(acc[r][1])
// Operands shared by the float and the double loop: 12 outputs, 5 inputs.
#define SDPA_DETAIL_TILE2_OPERANDS                                                                          \
  : SDPA_DETAIL_TILE2_OUT(0), SDPA_DETAIL_TILE2_OUT(1), SDPA_DETAIL_TILE2_OUT(2), SDPA_DETAIL_TILE2_OUT(3), \
    SDPA_DETAIL_TILE2_OUT(4), SDPA_DETAIL_TILE2_OUT(5)                                                       \
  : [args] "r"(&args), [d1] "i"(StepBytes), [d2] "i"(2 * StepBytes), [d3] "i"(3 * StepBytes),              \
    [d4] "i"(4 * StepBytes)                                                                                 \
  : "memory", "cc", "rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "r12", "r13", "xmm12",     \
    "xmm13", "xmm14", "xmm15"

// The loop for Scalar (float or double; Reg its __m256 type); see the contract above.
template <typename Scalar, std::int64_t StepBytes, typename Reg>
SDPA_ALWAYS_INLINE void gemm_tile_k_loop(const TileLoopArgs& args, Reg (&acc)[6][2]) noexcept {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "gemm_tile_k_loop: float or double");
  if constexpr (std::is_same<Scalar, float>::value) {
    __asm__(SDPA_DETAIL_TILE2_ASM("ps", "ss") SDPA_DETAIL_TILE2_OPERANDS);
  } else {
    __asm__(SDPA_DETAIL_TILE2_ASM("pd", "sd") SDPA_DETAIL_TILE2_OPERANDS);
  }
}

#undef SDPA_DETAIL_TILE2_OPERANDS
#undef SDPA_DETAIL_TILE_LOOPS
#undef SDPA_DETAIL_TILE_LOAD_ARGS
#undef SDPA_DETAIL_TILE2_OUT
#undef SDPA_DETAIL_TILE2_ASM
#undef SDPA_DETAIL_TILE2_STEP
#undef SDPA_DETAIL_TILE2_ROW
