/* lsh_f64.c: the float64 LSH attention kernels (portable C, every ISA). */
#define REAL double
#define LSH_MR 4
#define LSH_NV 4
#define LSH_SUFFIX _f64
#include "lsh_impl.h"
