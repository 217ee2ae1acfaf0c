/* kernel_f64_scalar.c: portable C float64 kernel, used for float64 on every ISA. */
#define REAL double
#define FA_SUFFIX _f64_scalar
#define FA_BLK_MR 4
#define FA_BLK_NV 4
#define FA_BLK_NVO 4
#define FA_BLK_BN 64
#define FA_BLK_BMR 32
#define FA_BLK_RD 8   /* at most this many rows take the decode path (GQA groups up to 8) */
#include "kernel_impl.h"
#include "backward_impl.h"
