/* kernel_scalar.c: portable C float32 kernel (the only path off x86). */
#define REAL float
#define FA_SUFFIX _f32_scalar
#define FA_ISA_SUFFIX _scalar
#define MR 4
#define NV 4
#define NVO 4
#define BN 64
#define BMR 32
#define RD 8   /* at most this many rows take the decode path (GQA groups up to 8) */
#include "kernel_impl.h"
#include "backward_impl.h"
