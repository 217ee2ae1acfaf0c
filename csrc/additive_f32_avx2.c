/* additive_f32_avx2.c: float32 additive-attention kernel for AVX2 + FMA. */
#define FA_TARGET_AVX2 1
#define AD_MR 2 /* rows per register block: 2 x 4 ymm accumulators (16 ymm registers) */
#define AD_NV 4
#define AD_SUFFIX _avx2
#include "additive_impl.h"
