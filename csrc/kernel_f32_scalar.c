/* kernel_f32_scalar.c: portable C float32 kernel (the only path off x86). */
#define REAL float
#define FA_SUFFIX _f32_scalar
#define FA_ISA_SUFFIX _scalar
#define FA_BLK_MR 4
#define FA_BLK_NV 4
#define FA_BLK_NVO 4
#define FA_BLK_BN 64
#define FA_BLK_BMR 32
#define FA_BLK_RD 8   /* at most this many rows take the decode path (GQA groups up to 8) */
#include "kernel_impl.h"
#include "backward_impl.h"
