/* kernel_f32_sve256.c: float32 kernel for AArch64 SVE at 256-bit vectors (built
 * with -march=armv8.2-a+sve -msve-vector-bits=256; run only where the CPU's
 * SVE length is 256 bits: csrc/dispatch.c). */
#define FA_TARGET_SVE 1
#define FA_SUFFIX _f32_sve256
#define FA_ISA_SUFFIX _sve256
/* Rows per register block: 8 x 2 z-register accumulators (16 keys per
 * panel), the NEON unit's block (26 of the 32 registers with the K vectors
 * and the query values: no spill; tools/mca_neon.sh for the NEON copy).
 * Not timed: no SVE CPU was at hand. */
#define FA_BLK_MR 8
#define FA_BLK_NV 2
#define FA_BLK_NVO 2
#define FA_BLK_BN 64
#define FA_BLK_BMR 96
#define FA_BLK_BMR_SHORT 96
#define FA_BLK_RD 8   /* at most this many rows take the decode path (GQA groups up to 8) */
#include "kernel_impl.h"
#include "backward_impl.h"
