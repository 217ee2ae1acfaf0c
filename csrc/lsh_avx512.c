/* lsh_avx512.c: float32 LSH attention kernels for AVX-512F (built with
 * -mavx512f -mavx2 -mfma -mf16c).  The kernels use only the vocabulary of
 * simd.h, which the emulated-AVX-512 test build (FA_EMULATE_AVX512, AVX2
 * flags) covers, so that build runs this width-16 code on AVX2 pairs. */
#define FA_TARGET_AVX512 1
#define LSH_MR 12 /* rows per register block: 12 x 2 zmm accumulators */
#define LSH_NV 2
#define LSH_SUFFIX _avx512
#include "lsh_impl.h"
