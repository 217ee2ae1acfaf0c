/* additive_f32_neon.c: float32 additive-attention kernel for AArch64 Advanced SIMD. */
#define FA_TARGET_NEON 1
#define AD_MR 4 /* rows per register block: 4 x 4 q-register accumulators, tanh temporaries fit in 32 */
#define AD_NV 4
#define AD_SUFFIX _neon
#include "additive_impl.h"
