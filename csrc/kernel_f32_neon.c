/* kernel_f32_neon.c: float32 kernel for AArch64 Advanced SIMD (every Arm64 CPU). */
#define FA_TARGET_NEON 1
#define FA_SUFFIX _f32_neon
#define FA_ISA_SUFFIX _neon
/* Rows per register block: 8 x 2 q-register accumulators.  With the 2 K
 * vectors and the 8 query values GCC keeps in registers, 26 of the 32: no
 * spill.  llvm-mca (tools/mca_neon.sh, docs/performance.md): Q.K^T and P.V
 * at 92-94% of the FMA pipes on the Neoverse N1, N2, V1 and V2 models; the
 * first block, 6 x 4, needed 34 registers, spilled two accumulators every
 * step and modelled at <= 60% on V1 / V2.  Not timed: no Arm CPU was at hand. */
#define FA_BLK_MR 8
#define FA_BLK_NV 2
#define FA_BLK_NVO 2
#define FA_BLK_BN 64
#define FA_BLK_BMR 192
#define FA_BLK_BMR_SHORT 96
#define FA_BLK_RD 8   /* at most this many rows take the decode path (GQA groups up to 8) */
#include "kernel_impl.h"
#include "backward_impl.h"
