/* lsh_avx2.c: float32 LSH attention kernels for AVX2 + FMA. */
#define FA_TARGET_AVX2 1
#define LSH_MR 6 /* rows per register block: 6 x 2 ymm accumulators */
#define LSH_NV 2
#define LSH_SUFFIX _avx2
#include "lsh_impl.h"
