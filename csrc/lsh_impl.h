/* lsh_impl.h: the LSH attention kernels (lsh.h), written once in the vector
 * vocabulary of simd.h and instantiated per ISA by lsh_<isa>.c, which define
 * LSH_SUFFIX and the register block LSH_MR (rows) x LSH_NV (vectors).
 *
 * hash: the projection x.R of a block of rows runs as a register-blocked
 * product over the padded rotations, then each row takes the first argmax
 * of [xR, -xR] (the rule of numpy.argmax over the concatenation).
 *
 * chunks: for each chunk, query rows in blocks of LSH_BM, its window of keys
 * (chunk c-1 then chunk c; chunk c alone when there is one chunk) in tiles
 * of LSH_BN.  The tile's keys are gathered by index straight from x and v
 * (never materialised as gathered copies of the sequence): K transposed into
 * a panel (D x BN) with kscale folded in, V rows into a panel (BN x Dvp).
 * The self rule is one store per row on the diagonal (query t of the chunk
 * is key off + t of its window), causal a compare of original positions;
 * then an online softmax over the tiles in the log2 domain (exp2), P.V, and
 * the row's result merged into the output by the log-sum-exp rule of the
 * rounds.  Scratch is bounded by the tiles, never by L.  Every loop bound
 * depends on the shapes only, so results do not depend on the thread count.
 * Needs MXCSR FTZ (vf_exp2_neg), set by the driver. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#include "lsh.h"

#ifndef vf_min /* the portable width-1 vocabulary has vf_max only */
#define vf_min(a, b) ((a) < (b) ? (a) : (b))
#endif

#define LSH_CAT_(a, b) a##b
#define LSH_CAT(a, b) LSH_CAT_(a, b)
#define LSH_NAME(x) LSH_CAT(x, LSH_SUFFIX)
#define LSH_BM 64  /* query rows per block */
#define LSH_BN 128 /* keys per tile (a multiple of every LSH_NV * VW) */
#define LSH_LOG2E 1.4426950408889634
#define LSH_LN2 0.6931471805599453
#define LSH_SELF (-1e5 * LSH_LOG2E) /* Reformer's self score -1e5, in the log2 domain */

static inline int64_t LSH_NAME(rup)(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static inline size_t LSH_NAME(al)(size_t n) { return (n + 63) / 64 * 64; }

/* The per-thread scratch: the larger of the two phases' needs. */
static size_t LSH_NAME(scratch)(const fa_lsh_params *p, const fa_lsh_work *w)
{
    const size_t e = sizeof(REAL);
    const int64_t Dvp = LSH_NAME(rup)(p->Dv, VW);
    size_t hash = LSH_NAME(al)((size_t)(LSH_MR * w->halfp) * e);
    size_t att = LSH_NAME(al)((size_t)(LSH_BM * p->D) * e)      /* Q rows */
                 + LSH_NAME(al)((size_t)(p->D * LSH_BN) * e)    /* K panel */
                 + LSH_NAME(al)((size_t)(LSH_BN * Dvp) * e)     /* V panel */
                 + LSH_NAME(al)((size_t)(LSH_BM * LSH_BN) * e)  /* scores, then p */
                 + LSH_NAME(al)((size_t)(LSH_BM * Dvp) * e)     /* output accumulator */
                 + 2 * LSH_NAME(al)((size_t)LSH_BM * e)         /* running max, sum */
                 + LSH_NAME(al)((size_t)LSH_BN * sizeof(int32_t)) /* key positions */
                 + LSH_NAME(al)((size_t)(LSH_BN * p->D) * e);   /* scaled key rows, before the transpose */
    return (hash > att ? hash : att) + 64;
}

/* C[i][0:nv*VW] (=|+=) sum_k A[i][k] * Bm[k][0:nv*VW] for mr rows: the one
 * register-blocked product of both phases (projection, Q.K^T, P.V). */
FA_INLINE void LSH_NAME(gemm)(int mr, int nv, const REAL *A, int64_t lda, int64_t K, const REAL *Bm,
                              int64_t ldb, REAL *C, int64_t ldc, int accumulate)
{
    vf acc[LSH_MR][LSH_NV];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = accumulate ? vf_load(C + i * ldc + v * VW) : vf_zero();
    for (int64_t k = 0; k < K; k++) {
        vf bv[LSH_NV];
        for (int v = 0; v < nv; v++) bv[v] = vf_load(Bm + k * ldb + v * VW);
        for (int i = 0; i < mr; i++) {
            vf a = vf_set1(A[i * lda + k]);
            for (int v = 0; v < nv; v++) acc[i][v] = vf_fma(a, bv[v], acc[i][v]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) vf_store(C + i * ldc + v * VW, acc[i][v]);
}

/* C (m x n, n a multiple of VW) (=|+=) A (m x K) . Bm (K x n), in register
 * blocks; mr and nv are constants in each call of gemm (full unrolling). */
#define LSH_MR_CASE(n, CALL) \
    case n: CALL((n) <= LSH_MR ? (n) : LSH_MR); break;
static void LSH_NAME(matmul)(int64_t m, int64_t n, const REAL *A, int64_t lda, int64_t K, const REAL *Bm,
                             int64_t ldb, REAL *C, int64_t ldc, int accumulate)
{
    for (int64_t i0 = 0; i0 < m; i0 += LSH_MR) {
        const int mr = (int)(m - i0 < LSH_MR ? m - i0 : LSH_MR);
        const REAL *Ai = A + i0 * lda;
        REAL *Ci = C + i0 * ldc;
        int64_t j0 = 0;
        for (; j0 + LSH_NV * VW <= n; j0 += LSH_NV * VW) {
#define LSH_CALL(r) LSH_NAME(gemm)(r, LSH_NV, Ai, lda, K, Bm + j0, ldb, Ci + j0, ldc, accumulate)
            switch (mr) {
                LSH_MR_CASE(1, LSH_CALL) LSH_MR_CASE(2, LSH_CALL) LSH_MR_CASE(3, LSH_CALL)
                LSH_MR_CASE(4, LSH_CALL) LSH_MR_CASE(5, LSH_CALL) LSH_MR_CASE(6, LSH_CALL)
                LSH_MR_CASE(7, LSH_CALL) LSH_MR_CASE(8, LSH_CALL) LSH_MR_CASE(9, LSH_CALL)
                LSH_MR_CASE(10, LSH_CALL) LSH_MR_CASE(11, LSH_CALL)
                default: LSH_CALL(LSH_MR); break;
            }
#undef LSH_CALL
        }
        for (; j0 < n; j0 += VW) { /* the last vectors, one at a time */
#define LSH_CALL(r) LSH_NAME(gemm)(r, 1, Ai, lda, K, Bm + j0, ldb, Ci + j0, ldc, accumulate)
            switch (mr) {
                LSH_MR_CASE(1, LSH_CALL) LSH_MR_CASE(2, LSH_CALL) LSH_MR_CASE(3, LSH_CALL)
                LSH_MR_CASE(4, LSH_CALL) LSH_MR_CASE(5, LSH_CALL) LSH_MR_CASE(6, LSH_CALL)
                LSH_MR_CASE(7, LSH_CALL) LSH_MR_CASE(8, LSH_CALL) LSH_MR_CASE(9, LSH_CALL)
                LSH_MR_CASE(10, LSH_CALL) LSH_MR_CASE(11, LSH_CALL)
                default: LSH_CALL(LSH_MR); break;
            }
#undef LSH_CALL
        }
    }
}

/* ------------------------------------------------------------------ hash */

static void LSH_NAME(hash)(const fa_lsh_params *p, const fa_lsh_work *w, int64_t b, int64_t i0, int64_t n,
                           void *scratch)
{
    const int64_t D = p->D, L = p->L, half = p->n_buckets / 2, halfp = w->halfp;
    const REAL *X = (const REAL *)p->x + b * p->x_sb;
    REAL *ks = (REAL *)w->kscale + b * L;
    REAL *proj = (REAL *)(((uintptr_t)scratch + 63) / 64 * 64);
    for (int64_t i = i0; i < i0 + n; i++) { /* the key factor of each row */
        const REAL *xr = X + i * p->x_sl;
        vf acc = vf_zero();
        int64_t d = 0;
        for (; d + VW <= D; d += VW) acc = vf_fma(vf_load(xr + d), vf_load(xr + d), acc);
        double ss = (double)vf_hsum(acc);
        for (; d < D; d++) ss += (double)xr[d] * (double)xr[d];
        ks[i] = ss > 0 ? (REAL)(p->scale * LSH_LOG2E / sqrt(ss)) : (REAL)0;
    }
    for (int64_t r = 0; r < p->n_hashes; r++) {
        const REAL *R = (const REAL *)w->rotp + r * D * halfp;
        int32_t *bk = w->bucket + (r * p->B + b) * L;
        for (int64_t r0 = i0; r0 < i0 + n; r0 += LSH_MR) {
            const int64_t mr = i0 + n - r0 < LSH_MR ? i0 + n - r0 : LSH_MR;
            LSH_NAME(matmul)(mr, halfp, X + r0 * p->x_sl, p->x_sl, D, R, halfp, proj, halfp, 0);
            for (int64_t i = 0; i < mr; i++) {
                const REAL *pr = proj + i * halfp;
                /* the largest and smallest projections (padding excluded), then their
                 * first indices: argmax([xR, -xR]) is the first argmax of xR when
                 * max >= -min (ties go to the first half), else half + the first argmin */
                REAL mx = pr[0], mn = pr[0];
                int64_t j = 0;
                if (half >= VW) {
                    vf vmx = vf_load(pr), vmn = vf_load(pr);
                    for (j = VW; j + VW <= half; j += VW) {
                        vf x = vf_load(pr + j);
                        vmx = vf_max(vmx, x);
                        vmn = vf_min(vmn, x);
                    }
                    mx = vf_hmax(vmx);
                    mn = -vf_hmax(vf_sub(vf_zero(), vmn));
                }
                for (; j < half; j++) {
                    if (pr[j] > mx) mx = pr[j];
                    if (pr[j] < mn) mn = pr[j];
                }
                int32_t bucket = 0; /* stays in range whatever the values (NaN included) */
                if (mx >= -mn) {
                    for (j = 0; j < half; j++)
                        if (pr[j] == mx) { bucket = (int32_t)j; break; }
                } else {
                    for (j = 0; j < half; j++)
                        if (pr[j] == mn) { bucket = (int32_t)(half + j); break; }
                }
                bk[r0 + i] = bucket;
            }
        }
    }
}

/* ---------------------------------------------------------------- chunks */

typedef struct LSH_NAME(tile) {
    REAL *K;       /* D x LSH_BN: keys along the columns, kscale folded in */
    REAL *V;       /* LSH_BN x Dvp: value rows, zero padded */
    int32_t *pos;  /* LSH_BN: the keys' original positions */
    REAL *T;       /* LSH_BN x D: the scaled key rows before the transpose */
} LSH_NAME(tile);

/* Keys tok[0:n] (rows of X and V) into columns / rows [col, col + n) of the tile. */
static void LSH_NAME(pack)(const LSH_NAME(tile) *t, int64_t col, const int32_t *tok, int64_t n, const REAL *X,
                           int64_t ldx, const REAL *V, int64_t ldv, const REAL *ks, int64_t D, int64_t Dv,
                           int64_t Dvp)
{
    for (int64_t j = 0; j < n; j++) {
        const REAL *xr = X + (int64_t)tok[j] * ldx;
        const vf f = vf_set1(ks[tok[j]]);
        REAL *tr = t->T + j * D;
        int64_t d = 0;
        for (; d + VW <= D; d += VW) vf_store(tr + d, vf_mul(vf_load(xr + d), f));
        for (; d < D; d++) tr[d] = xr[d] * ks[tok[j]];
        t->pos[col + j] = tok[j];
        REAL *vr = t->V + (col + j) * Dvp;
        memcpy(vr, V + (int64_t)tok[j] * ldv, (size_t)Dv * sizeof(REAL));
        for (int64_t k = Dv; k < Dvp; k++) vr[k] = 0;
    }
    int64_t j0 = 0;
#if defined(FA_HAVE_PACK8)
    for (; j0 + 8 <= n; j0 += 8) { /* 8 x 8 transposes, then the last features one by one */
        int64_t d0 = 0;
        for (; d0 + 8 <= D; d0 += 8) fa_pack8x8(t->T + j0 * D + d0, D, t->K + d0 * LSH_BN + col + j0, LSH_BN);
        for (; d0 < D; d0++)
            for (int64_t j = j0; j < j0 + 8; j++) t->K[d0 * LSH_BN + col + j] = t->T[j * D + d0];
    }
#endif
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = j0; j < n; j++) t->K[d * LSH_BN + col + j] = t->T[j * D + d];
}

/* The rows of tokens tok[0:n] of X, V and the output into the cache ahead of
 * their use (the rows are scattered: without this the gathers and the merge
 * into the output wait on memory). */
static inline void LSH_NAME(prefetch)(const int32_t *tok, int64_t n, const REAL *X, int64_t ldx, const REAL *V,
                                      int64_t ldv, const REAL *Out, int64_t ldo, int64_t D, int64_t Dv)
{
    for (int64_t j = 0; j < n; j++) {
        const char *xr = (const char *)(X + (int64_t)tok[j] * ldx), *vr = (const char *)(V + (int64_t)tok[j] * ldv);
        const char *orow = (const char *)(Out + (int64_t)tok[j] * ldo);
        for (int64_t o = 0; o < D * (int64_t)sizeof(REAL); o += 64) __builtin_prefetch(xr + o, 0, 2);
        for (int64_t o = 0; o < Dv * (int64_t)sizeof(REAL); o += 64) {
            __builtin_prefetch(vr + o, 0, 2);
            __builtin_prefetch(orow + o, 1, 2);
        }
    }
}

static void LSH_NAME(chunks)(const fa_lsh_params *p, const fa_lsh_work *w, int64_t r, int64_t b, int64_t c0,
                             int64_t c1, void *scratch)
{
    const int64_t D = p->D, Dv = p->Dv, Dvp = LSH_NAME(rup)(Dv, VW), L = p->L, ch = p->chunk;
    const int64_t nc = L / ch;
    const int64_t nk = nc == 1 ? ch : 2 * ch; /* keys per window */
    const int64_t off = nc == 1 ? 0 : ch;     /* query t of a chunk is key off + t of its window */
    const REAL *X = (const REAL *)p->x + b * p->x_sb;
    const REAL *V = (const REAL *)p->v + b * p->v_sb;
    const REAL *ks = (const REAL *)w->kscale + b * L;
    const int32_t *ord = w->order + (r * p->B + b) * L;
    REAL *Out = (REAL *)p->o + b * p->o_sb;
    double *Lse = p->lse + b * p->lse_sb;
    char *c = (char *)(((uintptr_t)scratch + 63) / 64 * 64);
    const size_t e = sizeof(REAL);
    REAL *Qp = (REAL *)c; c += LSH_NAME(al)((size_t)(LSH_BM * D) * e);
    REAL *Kp = (REAL *)c; c += LSH_NAME(al)((size_t)(D * LSH_BN) * e);
    REAL *Vp = (REAL *)c; c += LSH_NAME(al)((size_t)(LSH_BN * Dvp) * e);
    REAL *S = (REAL *)c; c += LSH_NAME(al)((size_t)(LSH_BM * LSH_BN) * e);
    REAL *O = (REAL *)c; c += LSH_NAME(al)((size_t)(LSH_BM * Dvp) * e);
    REAL *m = (REAL *)c; c += LSH_NAME(al)((size_t)LSH_BM * e);
    REAL *l = (REAL *)c; c += LSH_NAME(al)((size_t)LSH_BM * e);
    int32_t *kpos = (int32_t *)c; c += LSH_NAME(al)((size_t)LSH_BN * sizeof(int32_t));
    const LSH_NAME(tile) tl = {Kp, Vp, kpos, (REAL *)c};
    /* A window of one tile (chunks up to LSH_BN / 2 keys, the usual case) is packed
     * once per chunk, and chunk c's half of it is chunk c+1's first half: moved,
     * not gathered again.  Otherwise each tile is packed where it is used. */
    const int single = nk <= LSH_BN;
    const int64_t nkp = LSH_NAME(rup)(nk, VW);

    for (int64_t cc = c0; cc < c1; cc++) {
        const int32_t *qtok = ord + cc * ch;
        const int32_t *prev = ord + ((cc + nc - 1) % nc) * ch; /* the window's first half (nc > 1) */
        if (cc + 1 < nc) LSH_NAME(prefetch)(ord + (cc + 1) * ch, ch, X, p->x_sl, V, p->v_sl, Out, p->o_sl, D, Dv);
        if (single) {
            if (nc == 1) {
                LSH_NAME(pack)(&tl, 0, qtok, ch, X, p->x_sl, V, p->v_sl, ks, D, Dv, Dvp);
            } else {
                if (cc > c0) { /* the previous chunk's keys: already packed, in the second half */
                    for (int64_t d = 0; d < D; d++) memcpy(Kp + d * LSH_BN, Kp + d * LSH_BN + ch, (size_t)ch * e);
                    memcpy(Vp, Vp + ch * Dvp, (size_t)(ch * Dvp) * e);
                    memcpy(kpos, kpos + ch, (size_t)ch * sizeof(int32_t));
                } else {
                    LSH_NAME(pack)(&tl, 0, prev, ch, X, p->x_sl, V, p->v_sl, ks, D, Dv, Dvp);
                }
                LSH_NAME(pack)(&tl, ch, qtok, ch, X, p->x_sl, V, p->v_sl, ks, D, Dv, Dvp);
            }
            for (int64_t d = 0; d < D; d++)
                for (int64_t j = nk; j < nkp; j++) Kp[d * LSH_BN + j] = 0;
        }
        for (int64_t i0 = 0; i0 < ch; i0 += LSH_BM) {
            const int64_t mi = ch - i0 < LSH_BM ? ch - i0 : LSH_BM;
            for (int64_t i = 0; i < mi; i++) {
                memcpy(Qp + i * D, X + (int64_t)qtok[i0 + i] * p->x_sl, (size_t)D * e);
                m[i] = (REAL)-INFINITY;
                l[i] = 0;
                for (int64_t k = 0; k < Dvp; k++) O[i * Dvp + k] = 0;
            }
            for (int64_t w0 = 0; w0 < nk; w0 += LSH_BN) {
                const int64_t nj = nk - w0 < LSH_BN ? nk - w0 : LSH_BN, njp = LSH_NAME(rup)(nj, VW);
                if (!single) { /* gather the tile's keys (the window's [w0, w0 + nj)) */
                    for (int64_t j = 0; j < nj;) {
                        const int64_t wi = w0 + j;
                        /* a run of keys within one half of the window */
                        const int32_t *src = nc == 1 ? qtok + wi : wi < ch ? prev + wi : qtok + (wi - ch);
                        int64_t run = nc == 1 || wi >= ch ? nj - j : (ch - wi < nj - j ? ch - wi : nj - j);
                        LSH_NAME(pack)(&tl, j, src, run, X, p->x_sl, V, p->v_sl, ks, D, Dv, Dvp);
                        j += run;
                    }
                    for (int64_t d = 0; d < D; d++)
                        for (int64_t j = nj; j < njp; j++) Kp[d * LSH_BN + j] = 0;
                }
                LSH_NAME(matmul)(mi, njp, Qp, D, D, Kp, LSH_BN, S, LSH_BN, 0);
                for (int64_t i = 0; i < mi; i++) {
                    REAL *s = S + i * LSH_BN;
                    for (int64_t j = nj; j < njp; j++) s[j] = (REAL)-INFINITY;
                    const int64_t self = off + i0 + i - w0;
                    if (self >= 0 && self < nj) s[self] = (REAL)LSH_SELF;
                    if (p->causal) { /* later original positions are hidden (never the self key) */
                        const int32_t qp = qtok[i0 + i];
                        for (int64_t j = 0; j < nj; j++) s[j] = kpos[j] > qp ? (REAL)-INFINITY : s[j];
                    }
                    vf vmx = vf_load(s);
                    for (int64_t j = VW; j < njp; j += VW) vmx = vf_max(vmx, vf_load(s + j));
                    const REAL mx = vf_hmax(vmx);
                    if (mx != mx) m[i] = (REAL)NAN; /* a NaN score poisons the row */
                    const REAL mn = mx > m[i] ? mx : m[i];
                    if (mn == (REAL)-INFINITY) { /* nothing visible yet: this tile adds nothing */
                        for (int64_t j = 0; j < njp; j++) s[j] = 0;
                        continue;
                    }
                    if (mn > m[i]) {
                        const REAL alpha = (REAL)exp2((double)(m[i] - mn)); /* 0 on the first visible tile */
                        l[i] *= alpha;
                        for (int64_t k = 0; k < Dvp; k++) O[i * Dvp + k] *= alpha;
                        m[i] = mn;
                    }
                    const vf mv = vf_set1(mn);
                    vf sum = vf_zero();
                    for (int64_t j = 0; j < njp; j += VW) {
                        vf pj = vf_exp2_neg(vf_sub(vf_load(s + j), mv));
                        vf_store(s + j, pj);
                        sum = vf_add(sum, pj);
                    }
                    l[i] += vf_hsum(sum);
                }
                LSH_NAME(matmul)(mi, Dvp, S, LSH_BN, nj, Vp, Dvp, O, Dvp, 1);
            }
            /* the rows' results, merged into the output in original order: round 0
             * writes, later rounds combine by their log-sum-exp weights (float64) */
            for (int64_t i = 0; i < mi; i++) {
                const int64_t tok = qtok[i0 + i];
                REAL *out = Out + tok * p->o_sl;
                const REAL *acc = O + i * Dvp;
                const int isnan_ = m[i] != m[i] || l[i] != l[i];
                const int live = !isnan_ && m[i] != (REAL)-INFINITY && l[i] > 0;
                const double lr = isnan_ ? NAN : live ? ((double)m[i] + log2((double)l[i])) * LSH_LN2 : -INFINITY;
                const REAL inv = isnan_ ? (REAL)NAN : live ? (REAL)1 / l[i] : (REAL)0;
                if (r == 0) {
                    for (int64_t k = 0; k < Dv; k++) out[k] = acc[k] * inv;
                    Lse[tok] = lr;
                    continue;
                }
                const double lo = Lse[tok];
                const double mxl = lo > lr ? lo : lr;
                double ln = mxl, wo = 0, wn = 0;
                if (lo != lo || lr != lr) {
                    ln = wo = wn = NAN;
                } else if (mxl != -INFINITY) {
                    ln = mxl + log(exp(lo - mxl) + exp(lr - mxl));
                    wo = exp(lo - ln);
                    wn = exp(lr - ln);
                }
                const REAL fo = (REAL)wo, fn = (REAL)wn * inv;
                for (int64_t k = 0; k < Dv; k++) out[k] = fo * out[k] + fn * acc[k];
                Lse[tok] = ln;
            }
        }
    }
}

const fa_lsh_kernel LSH_NAME(fa_lsh_kernel) = {LSH_NAME(scratch), LSH_NAME(hash), LSH_NAME(chunks)};
