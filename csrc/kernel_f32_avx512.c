/* kernel_f32_avx512.c: float32 kernel for AVX-512F (built with -mavx512f -mfma -mf16c). */
#define FA_TARGET_AVX512 1
#define FA_SUFFIX _f32_avx512
#define FA_ISA_SUFFIX _avx512
#define FA_BLK_MR 12  /* rows per register block: 12 x 2 zmm accumulators */
#define FA_BLK_NV 2   /* zmm vectors of keys per Q.K^T block (32 keys)    */
#define FA_BLK_NVO 2  /* zmm vectors of Dv per P.V block                  */
#define FA_BLK_BN 128 /* keys per tile                                    */
#define FA_BLK_BMR 96 /* stacked query rows per task (L >= 1024: tiles.c)  */
#define FA_BLK_RD 8   /* at most this many rows take the decode path      */
#include "kernel_impl.h"
#include "backward_impl.h"
