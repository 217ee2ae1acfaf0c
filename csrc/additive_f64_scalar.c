/* additive_f64_scalar.c: the float64 additive-attention kernel (portable C, libm tanh). */
#define REAL double
#define AD_MR 4
#define AD_NV 4
#define AD_SUFFIX _f64
#include "additive_impl.h"
