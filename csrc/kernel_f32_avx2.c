/* kernel_f32_avx2.c: float32 kernel for AVX2 + FMA + F16C. */
#define FA_TARGET_AVX2 1
#define FA_SUFFIX _f32_avx2
#define FA_ISA_SUFFIX _avx2
#define FA_BLK_MR 6   /* rows per register block: 6 x 2 ymm accumulators */
#define FA_BLK_NV 2
#define FA_BLK_NVO 2
#define FA_BLK_BN 64  /* keys per tile (measured on Zen 3: 64 x 96 beats 128 x 48) */
/* Rows per task for L >= 1024 with D, Dv <= 128 are derived from the L2 size
 * (csrc/tiles.c); its share of L2 reproduces the 192 measured here on Zen 3
 * (K and V are re-read once per row block: interleaved A/B, 2 threads, B1 H8
 * L4096 D64 +13-20%, L1024 D64 and L2048 D128 +0-10% against 96).  192 is
 * the block where the L2 size is unknown.  Otherwise 96 (L = 300, B4 L512
 * causal and D = 256 causal were 2-10% slower with 192). */
#define FA_BLK_BMR 192
#define FA_BLK_BMR_SHORT 96
#define FA_BLK_RD 8   /* at most this many rows take the decode path (GQA groups up to 8) */
#include "kernel_impl.h"
#include "backward_impl.h"
