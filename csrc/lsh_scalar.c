/* lsh_scalar.c: portable float32 LSH attention kernels (CPUs without AVX2). */
#define REAL float
#define LSH_MR 4
#define LSH_NV 4
#define LSH_SUFFIX _f32_scalar
#include "lsh_impl.h"
