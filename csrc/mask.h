/* mask.h: which keys a query row may see (causal, window, lengths), shared by
 * every kernel.  Positions: query i of batch b sits at i' = i + (S_b - L_b)
 * (bottom-right alignment); it may see keys j in [lo, hi). */
#ifndef FA_MASK_H
#define FA_MASK_H

#include "fastattn.h"

static inline int64_t fa_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t fa_max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Valid lengths and sequence offsets of batch b. */
typedef struct fa_batch {
    int64_t Lb, Sb;     /* valid query / key lengths */
    int64_t qoff, koff; /* first row along the sequence axis (varlen) */
} fa_batch;

static inline fa_batch fa_batch_info(const fa_params *p, int64_t b)
{
    fa_batch r;
    if (p->cu_q) { r.qoff = p->cu_q[b]; r.Lb = p->cu_q[b + 1] - p->cu_q[b]; }
    else { r.qoff = 0; r.Lb = p->q_lens ? p->q_lens[b] : p->L; }
    if (p->cu_k) { r.koff = p->cu_k[b]; r.Sb = p->cu_k[b + 1] - p->cu_k[b]; }
    else { r.koff = 0; r.Sb = p->k_lens ? p->k_lens[b] : p->S; }
    return r;
}

/* a + b and a - b saturated to [INT64_MIN, INT64_MAX]: window bounds may be
 * anything up to INT64_MAX (sys.maxsize means "unbounded" to a caller) and ip
 * is negative for the first L - S queries when L > S, so i' - left and
 * i' + right + 1 must not wrap around. */
static inline int64_t fa_sat_add64(int64_t a, int64_t b)
{
    int64_t r;
    if (__builtin_add_overflow(a, b, &r)) return b > 0 ? INT64_MAX : INT64_MIN;
    return r;
}

static inline int64_t fa_sat_sub64(int64_t a, int64_t b)
{
    int64_t r;
    if (__builtin_sub_overflow(a, b, &r)) return b < 0 ? INT64_MAX : INT64_MIN;
    return r;
}

/* Visible key range [lo, hi) of the query at bottom-right position ip. */
static inline void fa_row_range(const fa_params *p, int64_t ip, int64_t Sb,
                                int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = Sb;
    if (p->causal) h = fa_min64(h, ip + 1);
    if (p->window_left >= 0) l = fa_max64(l, fa_sat_sub64(ip, p->window_left));
    if (p->window_right >= 0) h = fa_min64(h, fa_sat_add64(fa_sat_add64(ip, p->window_right), 1));
    *lo = l;
    *hi = h > l ? h : l;
}

/* Nonzero when any block of the block-sparse pattern that meets query rows
 * [i0, i1) and keys [j0, j1) of (b, h) is active. */
static inline int fa_bmask_any(const fa_params *p, int64_t b, int64_t h,
                               int64_t i0, int64_t i1, int64_t j0, int64_t j1)
{
    const uint8_t *base = p->bmask + b * p->bm_sb + h * p->bm_sh;
    for (int64_t bi = i0 / p->bm_q; bi <= (i1 - 1) / p->bm_q; bi++)
        for (int64_t bj = j0 / p->bm_k; bj <= (j1 - 1) / p->bm_k; bj++)
            if (base[bi * p->bm_si + bj * p->bm_sj]) return 1;
    return 0;
}

static inline int fa_bmask_at(const fa_params *p, int64_t b, int64_t h, int64_t i, int64_t j)
{
    return p->bmask[b * p->bm_sb + h * p->bm_sh + (i / p->bm_q) * p->bm_si + (j / p->bm_k) * p->bm_sj] != 0;
}

#endif
