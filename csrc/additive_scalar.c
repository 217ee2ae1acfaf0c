/* additive_scalar.c: portable additive-attention kernels (libm tanh): float32
 * for CPUs without AVX2, and float64 everywhere. */
#define REAL float
#define AD_MR 4
#define AD_NV 4
#define AD_SUFFIX _f32_scalar
#include "additive_impl.h"
