// The AVX-512 GEMM's full register tile (6 rows x 4 zmm vectors) k loop in assembly, for float and double.
// Included by sdpa/simd/avx512.hpp inside namespace sdpa::avx512 and its target region; the vector traits
// name it (Vec<Scalar>::tile_k_loop) and generic_gemm.inc's tile calls it for full tiles.
//
// Why assembly: written with intrinsics (generic_gemm.inc's step), GCC 12 allocates the 24 accumulators,
// 4 B vectors and the broadcasts of the 4-step unrolled loop badly: it rotates accumulators through B's
// registers with zmm copies and spills one accumulator to the stack every iteration, which held the tile
// below the rate of this loop (bench/RESULTS.md). The loop below is the same computation in the same order
// (each accumulator acc[r][v] += broadcast(A[r][p]) * B[p][v] for p = 0, 1, ..., one FMA per step), so its
// results are bit-identical to the intrinsics' tile, which the edge tiles still run.
//
// Contract of tile_k_loop<StepBytes>(kc, a0, row_bytes, b, pf, pf_stride, out):
//   A value r of step p at (const char*)a0 + r * row_bytes + p * StepBytes (A in place: row_bytes = lda *
//   sizeof(Scalar), StepBytes = sizeof(Scalar); a packed sliver: row_bytes = sizeof(Scalar), StepBytes =
//   mr * sizeof(Scalar));
//   B step p's 4 vectors at b + p * nr, 64-byte aligned (a packed B sliver);
//   after every 4 steps, one prefetch to L2 of the line *pf, then pf advances by pf_stride bytes (0: the
//   same line every time); kc / 4 entries are read;
//   out (64-byte aligned, 24 vectors) receives acc[r][v] at out + (r * 4 + v) * width.
// Registers: accumulators zmm0-23, B zmm24-27, broadcasts zmm28-31; all declared clobbered.
#pragma once

#define SDPA_DETAIL_TILE_B(u, PS)                  \
  "vmova" PS " " #u "*256+0(%[b]), %%zmm24\n\t"   \
  "vmova" PS " " #u "*256+64(%[b]), %%zmm25\n\t"  \
  "vmova" PS " " #u "*256+128(%[b]), %%zmm26\n\t" \
  "vmova" PS " " #u "*256+192(%[b]), %%zmm27\n\t"
#define SDPA_DETAIL_TILE_ROW(addr, bc, a0, a1, a2, a3, PS, SS) \
  "vbroadcast" SS " " addr ", %%" bc "\n\t"                      \
  "vfmadd231" PS " %%zmm24, %%" bc ", %%" a0 "\n\t"             \
  "vfmadd231" PS " %%zmm25, %%" bc ", %%" a1 "\n\t"             \
  "vfmadd231" PS " %%zmm26, %%" bc ", %%" a2 "\n\t"             \
  "vfmadd231" PS " %%zmm27, %%" bc ", %%" a3 "\n\t"
// One k step: rows 0-2 from p0 (+ 0, 1, 2 row strides), rows 3-5 from p3 = p0 + 3 row strides.
#define SDPA_DETAIL_TILE_STEP(u, d, PS, SS)                                                       \
  SDPA_DETAIL_TILE_B(u, PS)                                                                      \
  SDPA_DETAIL_TILE_ROW(d "(%[p0])", "zmm28", "zmm0", "zmm1", "zmm2", "zmm3", PS, SS)           \
  SDPA_DETAIL_TILE_ROW(d "(%[p0],%[rs],1)", "zmm29", "zmm4", "zmm5", "zmm6", "zmm7", PS, SS)   \
  SDPA_DETAIL_TILE_ROW(d "(%[p0],%[rs],2)", "zmm30", "zmm8", "zmm9", "zmm10", "zmm11", PS, SS) \
  SDPA_DETAIL_TILE_ROW(d "(%[p3])", "zmm31", "zmm12", "zmm13", "zmm14", "zmm15", PS, SS)       \
  SDPA_DETAIL_TILE_ROW(d "(%[p3],%[rs],1)", "zmm28", "zmm16", "zmm17", "zmm18", "zmm19", PS, SS) \
  SDPA_DETAIL_TILE_ROW(d "(%[p3],%[rs],2)", "zmm29", "zmm20", "zmm21", "zmm22", "zmm23", PS, SS)
#define SDPA_DETAIL_TILE_STORE(i, j, k, l, PS)                                                           \
  "vmova" PS " %%zmm" #i ", " #i "*64(%[out])\n\t vmova" PS " %%zmm" #j ", " #j "*64(%[out])\n\t"        \
  "vmova" PS " %%zmm" #k ", " #k "*64(%[out])\n\t vmova" PS " %%zmm" #l ", " #l "*64(%[out])\n\t"
#define SDPA_DETAIL_TILE_ASM(PS, SS)                                                                        \
  "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"                                                                       \
  "vmovdqa64 %%zmm0, %%zmm1\n\t vmovdqa64 %%zmm0, %%zmm2\n\t vmovdqa64 %%zmm0, %%zmm3\n\t"                  \
  "vmovdqa64 %%zmm0, %%zmm4\n\t vmovdqa64 %%zmm0, %%zmm5\n\t vmovdqa64 %%zmm0, %%zmm6\n\t"                  \
  "vmovdqa64 %%zmm0, %%zmm7\n\t vmovdqa64 %%zmm0, %%zmm8\n\t vmovdqa64 %%zmm0, %%zmm9\n\t"                  \
  "vmovdqa64 %%zmm0, %%zmm10\n\t vmovdqa64 %%zmm0, %%zmm11\n\t vmovdqa64 %%zmm0, %%zmm12\n\t"               \
  "vmovdqa64 %%zmm0, %%zmm13\n\t vmovdqa64 %%zmm0, %%zmm14\n\t vmovdqa64 %%zmm0, %%zmm15\n\t"               \
  "vmovdqa64 %%zmm0, %%zmm16\n\t vmovdqa64 %%zmm0, %%zmm17\n\t vmovdqa64 %%zmm0, %%zmm18\n\t"               \
  "vmovdqa64 %%zmm0, %%zmm19\n\t vmovdqa64 %%zmm0, %%zmm20\n\t vmovdqa64 %%zmm0, %%zmm21\n\t"               \
  "vmovdqa64 %%zmm0, %%zmm22\n\t vmovdqa64 %%zmm0, %%zmm23\n\t"                                             \
  "test %[n4], %[n4]\n\t"                                                                                   \
  "jz 2f\n\t"                                                                                               \
  ".p2align 5\n"                                                                                            \
  "1:\n\t" SDPA_DETAIL_TILE_STEP(0, "", PS, SS) SDPA_DETAIL_TILE_STEP(1, "%c[d1]", PS, SS)                  \
      SDPA_DETAIL_TILE_STEP(2, "%c[d2]", PS, SS) SDPA_DETAIL_TILE_STEP(3, "%c[d3]", PS, SS)                 \
  "mov (%[pf]), %[line]\n\t"                                                                                \
  "prefetcht1 (%[line])\n\t"                                                                                \
  "add %[pfs], %[pf]\n\t"                                                                                   \
  "add %[d4], %[p0]\n\t"                                                                                    \
  "add %[d4], %[p3]\n\t"                                                                                    \
  "add $1024, %[b]\n\t"                                                                                     \
  "dec %[n4]\n\t"                                                                                           \
  "jnz 1b\n"                                                                                                \
  "2:\n\t"                                                                                                  \
  "test %[rem], %[rem]\n\t"                                                                                 \
  "jz 4f\n"                                                                                                 \
  "3:\n\t" SDPA_DETAIL_TILE_STEP(0, "", PS, SS)                                                             \
  "add %[d1], %[p0]\n\t"                                                                                    \
  "add %[d1], %[p3]\n\t"                                                                                    \
  "add $256, %[b]\n\t"                                                                                      \
  "dec %[rem]\n\t"                                                                                          \
  "jnz 3b\n"                                                                                                \
  "4:\n\t" SDPA_DETAIL_TILE_STORE(0, 1, 2, 3, PS) SDPA_DETAIL_TILE_STORE(4, 5, 6, 7, PS)                    \
      SDPA_DETAIL_TILE_STORE(8, 9, 10, 11, PS) SDPA_DETAIL_TILE_STORE(12, 13, 14, 15, PS)                   \
          SDPA_DETAIL_TILE_STORE(16, 17, 18, 19, PS) SDPA_DETAIL_TILE_STORE(20, 21, 22, 23, PS)

// Operands shared by the float and the double loop.
#define SDPA_DETAIL_TILE_OPERANDS                                                                              \
  : [p0] "+r"(p0), [p3] "+r"(p3), [b] "+r"(bp), [n4] "+r"(n4), [rem] "+r"(rem), [pf] "+r"(pf), [line] "=&r"(line) \
  : [rs] "r"(row_bytes), [pfs] "r"(pf_stride), [out] "r"(out), [d1] "i"(StepBytes), [d2] "i"(2 * StepBytes),     \
    [d3] "i"(3 * StepBytes), [d4] "i"(4 * StepBytes)                                                               \
  : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",      \
    "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",   \
    "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31"

// The loop for Scalar (float or double); see the contract above.
template <typename Scalar, long StepBytes>
SDPA_ALWAYS_INLINE void gemm_tile_k_loop(Eigen::Index kc, const Scalar* a0, Eigen::Index row_bytes, const Scalar* b,
                                    const void* const* pf, Eigen::Index pf_stride, Scalar* out) noexcept {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "gemm_tile_k_loop: float or double");
  long n4 = static_cast<long>(kc / 4), rem = static_cast<long>(kc % 4);
  const char* p0 = reinterpret_cast<const char*>(a0);
  const char* p3 = p0 + 3 * row_bytes;
  const char* bp = reinterpret_cast<const char*>(b);
  const void* line = nullptr;
  if constexpr (std::is_same<Scalar, float>::value) {
    __asm__ volatile(SDPA_DETAIL_TILE_ASM("ps", "ss") SDPA_DETAIL_TILE_OPERANDS);
  } else {
    __asm__ volatile(SDPA_DETAIL_TILE_ASM("pd", "sd") SDPA_DETAIL_TILE_OPERANDS);
  }
}

#undef SDPA_DETAIL_TILE_OPERANDS
#undef SDPA_DETAIL_TILE_ASM
#undef SDPA_DETAIL_TILE_STORE
#undef SDPA_DETAIL_TILE_STEP
#undef SDPA_DETAIL_TILE_ROW
#undef SDPA_DETAIL_TILE_B
