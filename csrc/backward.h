/* backward.h: the fused backward pass (FlashAttention-2 manner), its contract
 * with the Python binding and, below, with the per-ISA kernels.
 *
 * Given the forward's problem (fa_params: q, k, v, options), its output o and
 * its natural-log LSE (which includes the sinks), and dO, it computes
 *   D_i = rowsum(dO o O), P = exp(s - LSE), dV = P^T dO, dP = dO V^T,
 *   dS = P o (dP - D) (times the softcap derivative), dQ = dS K scale,
 *   dK = dS^T Q scale,
 * recomputing P tile by tile (no L x S array).  Every array is in the compute
 * dtype (float32, or float64 for float64); the caller converts 16-bit data. */
#ifndef FA_BACKWARD_H
#define FA_BACKWARD_H

#include "kernel.h"

typedef struct fa_bwd_params {
    /* The forward's problem: q, k, v and the options as for fa_attention; o is
     * the forward's output (read only here) and lse its LSE (required). */
    fa_params f;
    const void *dout; int64_t do_sb, do_sh, do_sl; /* (B, Hq, L, Dv) */
    void *dq; int64_t dq_sb, dq_sh, dq_sl;         /* (B, Hq, L, D)  */
    void *dk; int64_t dk_sb, dk_sh, dk_sl;         /* (B, Hk, S, D)  */
    void *dv; int64_t dv_sb, dv_sh, dv_sl;         /* (B, Hk, S, Dv) */
    double *dsinks;                                /* (Hq,), written when f.sinks */
} fa_bwd_params;

/* Returns enum fa_status.  Results do not depend on f.num_threads. */
int fa_attention_backward(const fa_bwd_params *p);

/* ---- internal: driver (backward.c) <-> per-ISA kernels (backward_impl.h) ---- */

/* One task: keys [j0, j1) of key/value head hk of batch b, against every query
 * row of the hk's query heads.  dQ contributions go to dq_part, rows
 * ((b * Hq + h) * L + i) * Dp (Dp = D rounded up to the kernel's vector width). */
typedef struct fa_bwd_task {
    int64_t b, hk, j0, j1;
    void *dq_part;
    const void *delta, *lse2; /* (B * Hq * L): D_i and LSE * log2(e) (+inf for a dead row) */
} fa_bwd_task;

typedef struct fa_bwd_kernel {
    size_t (*scratch_bytes)(const fa_params *p);
    void (*run)(const fa_bwd_params *p, const fa_bwd_task *t, void *scratch);
    int64_t block_keys; /* keys per tile; task key ranges are multiples of it */
    int64_t vw;         /* vector width: dq_part rows are padded to a multiple */
} fa_bwd_kernel;

extern const fa_bwd_kernel fa_bwd_kernel_f32_scalar, fa_bwd_kernel_f64_scalar;
#if defined(FA_HAVE_X86)
extern const fa_bwd_kernel fa_bwd_kernel_f32_avx2, fa_bwd_kernel_f32_avx512;
#endif
#if defined(FA_HAVE_ARM64)
extern const fa_bwd_kernel fa_bwd_kernel_f32_neon;
#if defined(FA_HAVE_SVE)
extern const fa_bwd_kernel fa_bwd_kernel_f32_sve256, fa_bwd_kernel_f32_sve512;
#endif
#endif

#endif
