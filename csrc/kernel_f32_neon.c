/* kernel_f32_neon.c: float32 kernel for AArch64 Advanced SIMD (every Arm64 CPU). */
#define FA_TARGET_NEON 1
#define FA_SUFFIX _f32_neon
#define FA_ISA_SUFFIX _neon
/* Rows per register block: 6 x 4 q-register accumulators, with the 4 K
 * vectors and the broadcast query value 29 of the 32 vector registers (the
 * 8 x 12 and 6 x 16 shapes of Arm GEMM kernels; 16 keys per panel keeps the
 * x86 tile of 64 keys a whole number of panels).  Not tuned on hardware:
 * no Arm CPU was at hand (docs/performance.md's estimates). */
#define FA_BLK_MR 6
#define FA_BLK_NV 4
#define FA_BLK_NVO 4
#define FA_BLK_BN 64
#define FA_BLK_BMR 192
#define FA_BLK_BMR_SHORT 96
#define FA_BLK_RD 8   /* at most this many rows take the decode path (GQA groups up to 8) */
#include "kernel_impl.h"
#include "backward_impl.h"
