/* kernel_f32_sve256.c: float32 kernel for AArch64 SVE at 256-bit vectors (built
 * with -march=armv8.2-a+sve -msve-vector-bits=256; run only where the CPU's
 * SVE length is 256 bits: csrc/dispatch.c). */
#define FA_TARGET_SVE 1
#define FA_SUFFIX _f32_sve256
#define FA_ISA_SUFFIX _sve256
/* Rows per register block: 6 x 4 z-register accumulators (32 keys per panel), as the NEON unit's 6 x 4.
 * Not tuned on hardware: no SVE CPU was at hand (docs/performance.md). */
#define FA_BLK_MR 6
#define FA_BLK_NV 4
#define FA_BLK_NVO 4
#define FA_BLK_BN 64
#define FA_BLK_BMR 96
#define FA_BLK_BMR_SHORT 96
#define FA_BLK_RD 8   /* at most this many rows take the decode path (GQA groups up to 8) */
#include "kernel_impl.h"
#include "backward_impl.h"
