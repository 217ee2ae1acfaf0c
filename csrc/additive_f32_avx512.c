/* additive_f32_avx512.c: float32 additive-attention kernel for AVX-512F (built
 * with -mavx512f -mavx2 -mfma -mf16c).  The emulated-AVX-512 test build
 * (FA_EMULATE_AVX512, AVX2 flags) compiles the AVX2 instantiation here:
 * the emulation header covers the dot-product kernel's intrinsics only. */
#if defined(FA_EMULATE_AVX512)
#define FA_TARGET_AVX2 1
#define AD_MR 2
#else
#define FA_TARGET_AVX512 1
#define AD_MR 4 /* rows per register block: 4 x 4 zmm accumulators, tanh temporaries fit in 32 */
#endif
#define AD_NV 4 /* vectors of keys per register block */
#define AD_SUFFIX _avx512
#include "additive_impl.h"
