/* mask.h: which keys a query row may see (causal, window, lengths), shared by
 * every kernel.  Positions: query i of batch b sits at i' = i + (S_b - L_b)
 * (bottom-right alignment); it may see keys j in [lo, hi). */
#ifndef FA_MASK_H
#define FA_MASK_H

#include <math.h>

#include "fastattn.h"

static inline int64_t fa_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t fa_max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Bytes per attn_mask element (enum fa_mask_kind). */
static inline size_t fa_mask_size(int kind) { return kind == FA_MASK_BOOL ? 1 : kind == FA_MASK_F32 ? 4 : 8; }

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
    if (p->cu_k) { r.koff = p->block_table ? 0 : p->cu_k[b]; r.Sb = p->cu_k[b + 1] - p->cu_k[b]; }
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

/* What the attn_mask does to a tile of nj keys at jt for the rows of a task
 * (batch b, heads h0 .. h0 + G - 1, query rows i0 .. i0 + ni - 1), where the
 * mask is the one per-element transform (no ALiBi, softcap or block mask):
 * FA_TM_HIDDEN when it removes every key from every row (bool False: the
 * tile adds nothing and is skipped), FA_TM_VISIBLE when it leaves every
 * score as it is (bool True, float +-0: the tile computes as an unmasked
 * one, the fused softmax included), else FA_TM_MIXED (the mask is applied
 * per element, fa_mask_apply_*; FA_TM_HUGE is a mixed tile whose float values
 * are all at most -FA_MASK_HUGE).  A float mask is never hidden: it is added,
 * so a NaN or +-inf score under -inf makes the row NaN (as in torch and the
 * reference), which a skipped tile would lose; and keys at finfo.min stay
 * in a row's softmax (a row of only such keys is uniform over them).  Pass
 * a bool mask to have padded tiles skipped.  Cost: one read of the tile's mask
 * values, fewer where the mask broadcasts over heads (m_sh == 0) or rows
 * (m_sl == 0): at most G ni nj bytes against the tile's G ni nj (D + Dv)
 * multiply-adds.  The state depends on the task's rows, which depend on the
 * shapes only, so results stay bit-identical for every thread count. */
enum { FA_TM_MIXED = 0, FA_TM_VISIBLE = 1, FA_TM_HIDDEN = 2, FA_TM_HUGE = 3 };
/* A float mask value at or below -FA_MASK_HUGE (HF's finfo(float32/bfloat16).min
 * padding) makes a key's logit at most |score| - 1.44e30: see path_prefill's
 * huge_tile_skips for when such a tile is skipped exactly. */
#define FA_MASK_HUGE 1e30
static inline int fa_tile_mask_state(const fa_params *p, int64_t b, int64_t h0, int64_t G, int64_t i0, int64_t ni,
                                     int64_t jt, int64_t nj)
{
    const int64_t ng = p->m_sh == 0 ? 1 : G, nr = p->m_sl == 0 ? 1 : ni, ms = p->m_ss;
    int vis = 1, hid = 1, huge = p->mask_kind != FA_MASK_BOOL;
    for (int64_t g = 0; g < ng && (vis || hid || huge); g++) {
        for (int64_t ii = 0; ii < nr && (vis || hid || huge); ii++) {
            const int64_t off = b * p->m_sb + (h0 + g) * p->m_sh + (i0 + ii) * p->m_sl + jt * ms;
            int all = 1, none = 1; /* every key kept as it is / every key removed */
            if (p->mask_kind == FA_MASK_BOOL) {
                const uint8_t *m = (const uint8_t *)p->mask + off;
                for (int64_t jj = 0; jj < nj; jj++) { all &= m[jj * ms] != 0; none &= m[jj * ms] == 0; }
            } else if (p->mask_kind == FA_MASK_F32) {
                const float *m = (const float *)p->mask + off;
                for (int64_t jj = 0; jj < nj; jj++) { all &= m[jj * ms] == 0.0f; huge &= m[jj * ms] <= -FA_MASK_HUGE; }
                none = 0;
            } else {
                const double *m = (const double *)p->mask + off;
                for (int64_t jj = 0; jj < nj; jj++) { all &= m[jj * ms] == 0.0; huge &= m[jj * ms] <= -FA_MASK_HUGE; }
                none = 0;
            }
            vis &= all;
            hid &= none;
        }
    }
    return hid ? FA_TM_HIDDEN : vis ? FA_TM_VISIBLE : huge ? FA_TM_HUGE : FA_TM_MIXED;
}

/* The attn_mask applied to a row's scores s[a, e) (log2 units), where it is
 * the one per-element transform; m points at the mask value of tile column
 * 0 (column jj at m + jj * m_ss elements).  The general per-element loop's
 * operations exactly (kernel_impl.h mask_row: the same bits), branch-free
 * so that the compiler vectorises it: that loop, one branchy element at a
 * time, made a masked B8 H12 L512 D64 call 2.2x the unmasked one (Zen 3,
 * avx2).  bool: True keeps the score (a finite one needs no clamp), False
 * is -inf.  float: x + mask * log2(e) in double; a finite logit with a
 * finite mask value stays finite (clamped to the score type's range: HF's
 * finfo.min), a non-finite one acts as given. */
#define FA_MASK_APPLY_FN(NAME, RT, RMAX)                                                                    \
    static inline void NAME(const fa_params *p, RT *restrict s, const char *m, int64_t a, int64_t e)        \
    {                                                                                                       \
        const int64_t ms = p->m_ss;                                                                         \
        if (p->mask_kind == FA_MASK_BOOL) {                                                                 \
            const uint8_t *mb = (const uint8_t *)m;                                                         \
            if (ms == 1)                                                                                    \
                for (int64_t jj = a; jj < e; jj++) s[jj] = mb[jj] ? s[jj] : (RT)-INFINITY;                  \
            else                                                                                            \
                for (int64_t jj = a; jj < e; jj++) s[jj] = mb[jj * ms] ? s[jj] : (RT)-INFINITY;             \
            return;                                                                                         \
        }                                                                                                   \
        if (p->mask_kind == FA_MASK_F32) {                                                                  \
            FA_MASK_ADD_LOOP(float, RT, RMAX)                                                               \
        } else {                                                                                            \
            FA_MASK_ADD_LOOP(double, RT, RMAX)                                                              \
        }                                                                                                   \
    }
#define FA_MASK_ADD_LOOP(MT, RT, RMAX)                                                                      \
    for (int64_t jj = a; jj < e; jj++) {                                                                    \
        const double x = (double)s[jj], mv = (double)((const MT *)m)[jj * ms], y = x + mv * 1.4426950408889634; \
        const int fin = (x - x == 0.0) & (mv - mv == 0.0);                                                  \
        const double yc = y < -(RMAX) ? -(RMAX) : y > (RMAX) ? (RMAX) : y;                                  \
        s[jj] = (RT)(fin ? yc : y);                                                                         \
    }
FA_MASK_APPLY_FN(fa_mask_apply_f32, float, 3.4028234663852886e38)
FA_MASK_APPLY_FN(fa_mask_apply_f64, double, 1.7976931348623157e308)
#undef FA_MASK_APPLY_FN
#undef FA_MASK_ADD_LOOP

#endif
