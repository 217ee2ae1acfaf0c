/* kernel_f64.c: portable C float64 kernel, used for float64 on every ISA. */
#define REAL double
#define FA_SUFFIX _f64_scalar
#define FA_ISA_SUFFIX _f64
#define MR 4
#define NV 4
#define NVO 4
#define BN 64
#define BMR 32
#define RD 8   /* at most this many rows take the decode path (GQA groups up to 8) */
#include "kernel_impl.h"
#include "backward_impl.h"
