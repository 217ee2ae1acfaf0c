/* lsh_f32_neon.c: float32 LSH attention kernels for AArch64 Advanced SIMD. */
#define FA_TARGET_NEON 1
#define LSH_MR 6 /* rows per register block: 6 x 4 q-register accumulators */
#define LSH_NV 4
#define LSH_SUFFIX _neon
#include "lsh_impl.h"
