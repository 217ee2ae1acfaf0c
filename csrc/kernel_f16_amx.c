/* kernel_f16_amx.c: float16 prefill on the AMX-FP16 tile unit (TDPFP16PS:
 * Granite Rapids and later), built with the AMX unit's flags (the instruction
 * by its mnemonic, amx_emu.h); or, for tests, emulated (FA_EMULATE_AMX).
 *
 * The AMX kernel's source (kernel_bf16_amx.c: packing, row groups, masks,
 * softmax) with float16 operands: the packing moves 16-bit words and does not
 * care which type they hold, the products are TDPFP16PS (each product of two
 * float16 exact in fp32, fp32 accumulation), and P is rounded to float16 (11
 * significant bits, finer than the bf16 P of the bf16 kernel).  float16
 * inputs are never rounded to bfloat16: on CPUs without AMX-FP16 they keep the
 * float32-compute kernels (dispatch.c). */
#define FA_TILES_FP16 1
#include "kernel_bf16_amx.c"
