/* backward.c: the driver of the fused backward pass.  Splits the keys of each
 * (batch, kv head) into tasks by a rule that depends only on the shapes, runs
 * them on OpenMP threads, and sums each split's dQ rows in split order, so
 * that results are bit-identical for every thread count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "backward.h"
#include "mask.h"
#include "convert.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(FA_HAVE_X86)
#include <xmmintrin.h>
#endif

/* Split the keys of each (batch, kv head) into more tasks when there are
 * fewer than this (shape-only rule; each split adds one dQ-sized buffer). */
#define FB_SPLIT_TASKS 32
/* Splits stop adding dQ partial buffers beyond this many bytes in all (or one
 * buffer, when that is larger): with few kv heads and long sequences (MQA)
 * 32 dQ-sized buffers would be gigabytes.  A shape-only rule too. */
#define FB_PART_BYTES ((size_t)512 << 20)
/* Calls with less work than this (multiply-adds) run on the calling thread. */
#define FB_SERIAL_MACS (1 << 19)

static const fa_bwd_kernel *fa_select_bwd_kernel(const fa_params *p)
{
    if (p->q_dtype == FA_F64) return &fa_bwd_kernel_f64_scalar;
#if defined(FA_HAVE_X86)
    switch (fa_isa_get()) {
    case FA_ISA_AMX: /* AVX-512 plus tiles for the bf16 forward only */
    case FA_ISA_AVX512BF16: /* AVX-512 plus VDPBF16PS for the bf16 forward only */
    case FA_ISA_AVX512: return &fa_bwd_kernel_f32_avx512;
    case FA_ISA_AVX2: return &fa_bwd_kernel_f32_avx2;
    default: break;
    }
#endif
#if defined(FA_HAVE_ARM64)
    switch (fa_isa_get()) { /* read once: the call runs whole on one path */
#if defined(FA_HAVE_SVE)
    case FA_ISA_SVE: return fa_sve_bits() == 256 ? &fa_bwd_kernel_f32_sve256 : &fa_bwd_kernel_f32_sve512;
#endif
    case FA_ISA_NEON: return &fa_bwd_kernel_f32_neon;
    default: break;
    }
#endif
    return &fa_bwd_kernel_f32_scalar;
}

static void fb_run_tasks(const fa_bwd_kernel *kern, const fa_bwd_params *p, const fa_bwd_task *tasks,
                         int64_t ntask, size_t ws_bytes, int *failed)
{
    fa_fpenv env;
    fa_fpenv_enter(&env); /* as the forward: nearest, FTZ/DAZ inside the kernel only */
    void *ws = malloc(ws_bytes);
    if (!ws) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
        *failed = 1;
    }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t t = 0; t < ntask; t++)
        if (ws) kern->run(p, &tasks[t], ws);
    free(ws);
    fa_fpenv_exit(&env);
}

int fa_attention_backward(const fa_bwd_params *bp)
{
    const fa_params *p = &bp->f;
    const fa_bwd_kernel *kern = fa_select_bwd_kernel(p);
    const int f64 = p->q_dtype == FA_F64;
    const int cdt = f64 ? FA_F64 : FA_F32;
    const size_t esz = f64 ? 8 : 4;
    const int64_t G = p->Hk > 0 ? p->Hq / p->Hk : 0, BK = kern->block_keys; /* zero heads: no division */
    const int64_t Dp = (p->D + kern->vw - 1) / kern->vw * kern->vw;
    const int64_t nrow = p->B * p->Hq * p->L;
    int nt = p->num_threads < 1 ? 1 : p->num_threads;
    {
        double macs = (double)p->B * (double)p->Hq * (double)p->L * (double)p->S * (double)(3 * p->D + 2 * p->Dv);
        if (p->causal) macs *= 0.5;
        if (macs < FB_SERIAL_MACS) nt = 1;
    }
    /* Bound, fork safety, threads the OS will start (attention.c). */
    if (nt > 1 && (nt = fa_team_size(nt)) == 0) return FA_ETHREADS;

    /* ---- per row: D_i = dO_i . O_i and LSE_i * log2(e) (+inf where the LSE is
     * -inf: a row that sees no key gets P = 0) ---- */
    char *rows = (char *)malloc((size_t)(2 * (nrow > 0 ? nrow : 1)) * esz);
    if (!rows) return FA_ENOMEM;
    char *delta = rows, *lse2 = rows + (size_t)nrow * esz;
    const int64_t nbh = p->B * p->Hq;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
    fa_fpenv env;
    fa_fpenv_enter(&env);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t bh = 0; bh < nbh; bh++) {
        const int64_t b = bh / p->Hq, h = bh % p->Hq;
        const fa_batch bi = fa_batch_info(p, b);
        for (int64_t i = 0; i < p->L; i++) {
            double d = 0.0, l2 = INFINITY;
            if (i < bi.Lb) {
                const int64_t oo = b * p->o_sb + h * p->o_sh + i * p->o_sl;
                const int64_t go = b * bp->do_sb + h * bp->do_sh + i * bp->do_sl;
                for (int64_t c = 0; c < p->Dv; c++)
                    d += fa_load_elem(p->o, cdt, oo + c) * fa_load_elem(bp->dout, cdt, go + c);
                double l = fa_load_elem(p->lse, cdt, b * p->lse_sb + h * p->lse_sh + i * p->lse_sl);
                if (l != -INFINITY) l2 = l * 1.4426950408889634;
            }
            fa_store_elem(delta, cdt, bh * p->L + i, d);
            fa_store_elem(lse2, cdt, bh * p->L + i, l2);
        }
    }
    fa_fpenv_exit(&env);
    }
    /* d loss / d sink_h = -sum_i P_sink,i D_i, P_sink,i = exp(sink_h - LSE_i);
     * summed in row order (one thread). */
    if (p->sinks && bp->dsinks)
        for (int64_t h = 0; h < p->Hq; h++) {
            double acc = 0.0;
            for (int64_t b = 0; b < p->B; b++) {
                const fa_batch bi = fa_batch_info(p, b);
                for (int64_t i = 0; i < bi.Lb; i++) {
                    double l = fa_load_elem(p->lse, cdt, b * p->lse_sb + h * p->lse_sh + i * p->lse_sl);
                    double d = fa_load_elem(delta, cdt, (b * p->Hq + h) * p->L + i);
                    if (l != -INFINITY && d != 0.0) acc -= exp(p->sinks[h] - l) * d;
                }
            }
            bp->dsinks[h] = acc;
        }

    /* ---- tasks: key ranges of whole tiles per (batch, kv head) ---- */
    const int64_t base = p->B * p->Hk;
    const int64_t nkt = (p->S + BK - 1) / BK;
    int64_t nsplit = 1, chunk = nkt > 0 ? nkt : 1; /* in tiles */
    if (base > 0 && base < FB_SPLIT_TASKS && nkt > 1) {
        nsplit = (FB_SPLIT_TASKS + base - 1) / base;
        if (nsplit > nkt) nsplit = nkt;
        const size_t one = (size_t)nrow * (size_t)Dp * esz;
        while (nsplit > 1 && (size_t)nsplit * one > FB_PART_BYTES) nsplit--;
        chunk = (nkt + nsplit - 1) / nsplit;
        nsplit = (nkt + chunk - 1) / chunk;
    }
    const int64_t ntask = base * nsplit;
    const size_t part_elems = (size_t)nrow * (size_t)Dp;
    fa_bwd_task *tasks = (fa_bwd_task *)malloc((size_t)(ntask > 0 ? ntask : 1) * sizeof(fa_bwd_task));
    char *part = (char *)calloc(part_elems * (size_t)nsplit + 1, esz);
    if (!tasks || !part) { free(rows); free(tasks); free(part); return FA_ENOMEM; }
    /* Splits in order: under a causal mask the first keys are seen by the
     * most queries, so the heaviest tasks are queued first. */
    int64_t n = 0;
    for (int64_t s = 0; s < nsplit; s++)
        for (int64_t b = 0; b < p->B; b++)
            for (int64_t hk = 0; hk < p->Hk; hk++, n++) {
                fa_bwd_task *t = &tasks[n];
                t->b = b; t->hk = hk;
                t->j0 = s * chunk * BK;
                t->j1 = (s + 1) * chunk * BK < p->S ? (s + 1) * chunk * BK : p->S;
                if (t->j0 > p->S) t->j0 = p->S;
                t->dq_part = part + (size_t)s * part_elems * esz;
                t->delta = delta;
                t->lse2 = lse2;
            }

    int failed = 0;
    if (nt > ntask) nt = ntask > 0 ? (int)ntask : 1;
    const size_t ws_bytes = kern->scratch_bytes(p);
    if (nt == 1) {
        fb_run_tasks(kern, bp, tasks, ntask, ws_bytes, &failed);
    } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
        fb_run_tasks(kern, bp, tasks, ntask, ws_bytes, &failed);
    }

    /* ---- dQ = scale * sum over splits, in split order ---- */
    if (!failed) {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
        {
        fa_fpenv env;
        fa_fpenv_enter(&env);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < nrow; r++) {
            const int64_t b = r / (p->Hq * p->L), h = (r / p->L) % p->Hq, i = r % p->L;
            const int64_t qo = b * bp->dq_sb + h * bp->dq_sh + i * bp->dq_sl;
            /* Per element: 0 + split 0 + split 1 + ..., then times the scale;
             * splits outer and D in a local (the stores could alias p under
             * -fno-strict-aliasing) so that the loops over c vectorise. */
            const int64_t D = p->D;
            const double scd = p->scale;
            if (f64) {
                double *restrict dst = (double *)bp->dq + qo;
                for (int64_t c = 0; c < D; c++) dst[c] = 0.0;
                for (int64_t s = 0; s < nsplit; s++) {
                    const double *restrict ps = (const double *)part + s * part_elems + r * Dp;
                    for (int64_t c = 0; c < D; c++) dst[c] += ps[c];
                }
                for (int64_t c = 0; c < D; c++) dst[c] *= scd;
            } else {
                float *restrict dst = (float *)bp->dq + qo;
                const float sc = (float)p->scale;
                for (int64_t c = 0; c < D; c++) dst[c] = 0.0f;
                for (int64_t s = 0; s < nsplit; s++) {
                    const float *restrict ps = (const float *)part + s * part_elems + r * Dp;
                    for (int64_t c = 0; c < D; c++) dst[c] += ps[c];
                }
                for (int64_t c = 0; c < D; c++) dst[c] *= sc;
            }
        }
        fa_fpenv_exit(&env);
        }
    }
    (void)G;
    free(rows); free(tasks); free(part);
    return failed ? FA_ENOMEM : FA_OK;
}
