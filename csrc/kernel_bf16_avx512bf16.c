/* kernel_bf16_avx512bf16.c: bfloat16 prefill with VDPBF16PS products (AVX512-BF16,
 * CPUs without AMX: Zen 4/5, Cooper Lake), built with -mavx512f -mavx512bw
 * -mavx512bf16; or, for tests, emulated on AVX2 (FA_EMULATE_AVX512BF16 +
 * FA_EMULATE_AVX512, see vdpbf16.h).
 *
 * The AMX kernel's source (kernel_bf16_amx.c: packing, row groups, masks, softmax,
 * bf16x3 at precision "high") with its two products as register-blocked
 * VDPBF16PS (vdpbf16.h): one kernel body to test, the same task contract, the same
 * accuracy contract (products of bf16 exact, fp32 accumulation, P rounded to
 * bf16).  Used, where the ISA is avx512bf16, for the calls the AMX kernel
 * takes where the ISA is amx (dispatch.c): bfloat16 query, key and value, and
 * float32 ones at precision "medium" (rounded to bf16) or "high" (bf16x3),
 * with at least FA_AMX_MIN_ROWS stacked rows per key/value head. */
#define FA_TILES_VDPBF16 1
#include "kernel_bf16_amx.c"
