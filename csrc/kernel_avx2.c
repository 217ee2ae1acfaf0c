/* kernel_avx2.c: float32 kernel for AVX2 + FMA + F16C. */
#define FA_TARGET_AVX2 1
#define FA_SUFFIX _f32_avx2
#define FA_ISA_SUFFIX _avx2
#define MR 6   /* rows per register block: 6 x 2 ymm accumulators */
#define NV 2
#define NVO 2
#define BN 64   /* keys per tile (measured on Zen 3: 64 x 96 beats 128 x 48) */
#define BMR 96
#define RD 4
#include "kernel_impl.h"
