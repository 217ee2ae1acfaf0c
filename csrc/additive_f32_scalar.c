/* additive_f32_scalar.c: the portable float32 additive-attention kernel (libm
 * tanh), for CPUs without AVX2. */
#define REAL float
#define AD_MR 4
#define AD_NV 4
#define AD_SUFFIX _f32_scalar
#include "additive_impl.h"
