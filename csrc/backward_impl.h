/* backward_impl.h: the fused backward kernel, written once in the vector
 * vocabulary of simd.h and included at the end of each kernel_<isa>.c, whose
 * FA_SUFFIX, REAL and VW it shares.  Tile constants (the unit may override):
 * FB_MR x FB_NV (register block: rows x vectors), FB_BQ (query rows per tile)
 * and FB_BK (keys per tile, a multiple of FB_NV * VW).
 *
 * One task = a range of keys of one (batch, kv head).  For each block of
 * FB_NKT tiles of FB_BK keys it packs K and V once, then visits every tile of
 * FB_BQ query rows of the head's query heads that can see those keys (the
 * forward's masked-tile skipping, per key tile): it recomputes S = Q.K^T,
 * P = exp2(S scale log2e - LSE log2e), dP = dO.V^T and dS = P (dP - D),
 * accumulates dV += P^T.dO and dK += dS^T.Q in the block's scratch (GQA heads
 * sum there, in a fixed order) and dQ += dS.K into the task's dQ rows.
 * With dropout (fastattn.h), Z the tile's regenerated multipliers (0 or
 * 1 / (1 - p), dropout.h): dV += (P o Z)^T.dO and dS = P (dP o Z - D), D
 * being rowsum(dO o O) of the dropped output as without it.
 * Scratch is bounded by the tiles. */
#include <math.h>
#include <string.h>
#include "simd.h"
#include "mask.h"
#include "backward.h"
#include "dropout.h"

/* Register blocks: 24 zmm accumulators as 6 rows x 64 columns (one block for
 * D = 64 and for the 64-key tiles; 1 thread, B1 H4 L2048 D64, CPU time,
 * interleaved: ~3% faster than the forward's 12 x 32), the forward's 6 x 2
 * ymm, 4 x 4 values on the portable paths. */
#ifndef FB_MR
#if VW == 16
#define FB_MR 6
#define FB_NV 4
#elif VW == 8
#define FB_MR 6
#define FB_NV 2
#else
#define FB_MR 4
#define FB_NV 4
#endif
#endif
#ifndef FB_BQ
#define FB_BQ (VW > 1 ? 96 : 32)
#endif
#ifndef FB_BK
#define FB_BK 64
#endif
/* Key tiles per block: the block's tiles are packed once and share each pass
 * over the query rows (each query tile's rows are copied once per block, not
 * once per tile: the copies of whole Q and dO per tile were ~10% of the time). */
#ifndef FB_NKT
#define FB_NKT 4
#endif

#define FB_CAT_(a, b) a##b
#define FB_CAT(a, b) FB_CAT_(a, b)
#define FB_NAME(x) FB_CAT(x, FA_SUFFIX)
#define FB_LOG2E 1.4426950408889634
#define FB_ALIGN 64

static inline int64_t FB_NAME(fb_rup)(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static inline size_t FB_NAME(fb_al)(size_t n) { return (n + FB_ALIGN - 1) / FB_ALIGN * FB_ALIGN; }

typedef struct FB_NAME(fb_ws) {
    /* per key tile u of the block (NKT tiles):                               */
    REAL *Kt;  /* D x BK    K^T of the key tile (zero past the last key)      */
    REAL *Vt;  /* Dv x BK   V^T                                               */
    REAL *Kr;  /* BK x Dp   K rows, zero-padded                               */
    REAL *dK;  /* NKT*BK x Dp   dK accumulator of the block (unscaled)        */
    REAL *dV;  /* NKT*BK x Dvp  dV accumulator                                */
    REAL *Q;   /* BQ x Dp   query rows of the query tile, zero-padded         */
    REAL *dO;  /* BQ x Dvp  dO rows                                           */
    REAL *S;   /* BQ x BK   scores, then P                                    */
    REAL *dP;  /* BQ x BK   dP, then dS                                       */
    REAL *Dr;  /* BQ x BK   softcap derivative                                */
} FB_NAME(fb_ws);

static size_t FB_NAME(fb_scratch_bytes)(const fa_params *p)
{
    const int64_t Dp = FB_NAME(fb_rup)(p->D, VW), Dvp = FB_NAME(fb_rup)(p->Dv, VW);
    const size_t e = sizeof(REAL);
    const int64_t KB = FB_NKT * FB_BK;
    return FB_NAME(fb_al)(Dp * KB * e) + FB_NAME(fb_al)(Dvp * KB * e) + 2 * FB_NAME(fb_al)(KB * Dp * e) +
           FB_NAME(fb_al)(KB * Dvp * e) + FB_NAME(fb_al)(FB_BQ * Dp * e) + FB_NAME(fb_al)(FB_BQ * Dvp * e) +
           3 * FB_NAME(fb_al)(FB_BQ * FB_BK * e) + FB_ALIGN;
}

/* The next n values of the scratch at *c, which then moves past them (each
 * buffer starts FB_ALIGN-aligned: fb_scratch_bytes sizes them so). */
static inline REAL *FB_NAME(fb_take)(char **c, size_t n)
{
    REAL *r = (REAL *)*c;
    *c += FB_NAME(fb_al)(n * sizeof(REAL));
    return r;
}

static void FB_NAME(fb_carve)(const fa_params *p, void *scratch, FB_NAME(fb_ws) *w)
{
    const int64_t Dp = FB_NAME(fb_rup)(p->D, VW), Dvp = FB_NAME(fb_rup)(p->Dv, VW);
    char *c = (char *)(((uintptr_t)scratch + FB_ALIGN - 1) / FB_ALIGN * FB_ALIGN);
    w->Kt = FB_NAME(fb_take)(&c, (size_t)(Dp * FB_NKT * FB_BK));
    w->Vt = FB_NAME(fb_take)(&c, (size_t)(Dvp * FB_NKT * FB_BK));
    w->Kr = FB_NAME(fb_take)(&c, (size_t)(FB_NKT * FB_BK * Dp));
    w->dK = FB_NAME(fb_take)(&c, (size_t)(FB_NKT * FB_BK * Dp));
    w->dV = FB_NAME(fb_take)(&c, (size_t)(FB_NKT * FB_BK * Dvp));
    w->Q = FB_NAME(fb_take)(&c, (size_t)(FB_BQ * Dp));
    w->dO = FB_NAME(fb_take)(&c, (size_t)(FB_BQ * Dvp));
    w->S = FB_NAME(fb_take)(&c, (size_t)(FB_BQ * FB_BK));
    w->dP = FB_NAME(fb_take)(&c, (size_t)(FB_BQ * FB_BK));
    w->Dr = FB_NAME(fb_take)(&c, (size_t)(FB_BQ * FB_BK));
}

/* C[i][0:nv*VW] (+)= sum_k A[i*ai + k*ak] * B[k*ldb + 0:nv*VW] for i < mr
 * (register blocked; A is read by element, so it may be a transposed view). */
FA_INLINE void FB_NAME(fb_ukr)(const int mr, const int nv, int64_t K, const REAL *A, int64_t ai, int64_t ak,
                               const REAL *B, int64_t ldb, REAL *C, int64_t ldc, int load)
{
    vf acc[FB_MR][FB_NV];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = load ? vf_load(C + i * ldc + v * VW) : vf_zero();
    for (int64_t k = 0; k < K; k++) {
        vf bv[FB_NV];
        for (int v = 0; v < nv; v++) bv[v] = vf_load(B + k * ldb + v * VW);
        const REAL *ak_ = A + k * ak;
        for (int i = 0; i < mr; i++) {
            vf a = vf_set1(ak_[i * ai]);
            for (int v = 0; v < nv; v++) acc[i][v] = vf_fma(a, bv[v], acc[i][v]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) vf_store(C + i * ldc + v * VW, acc[i][v]);
}

/* P[i][0:nv*VW] = exp2(S c1 - l2[i]) for i < mr, S the raw scores stored in P,
 * one fused multiply-add into the exponent (c1 = scale log2e).  Not inlined:
 * inlined, the compiler keeps the exp2 constants in registers across the
 * products around it and spills their accumulators instead (AVX-512: 24 of
 * the 32 zmm hold accumulators). */
static __attribute__((noinline)) void FB_NAME(fb_exp_block)(int mr, int nv, vf c1v, const REAL *l2, REAL *P,
                                                            int64_t ldc)
{
    for (int i = 0; i < mr; i++) {
        const vf nl2 = vf_set1(-l2[i]);
        for (int v = 0; v < nv; v++)
            vf_store(P + i * ldc + v * VW, vf_exp2_neg(vf_fma(vf_load(P + i * ldc + v * VW), c1v, nl2)));
    }
}

/* The fused first half of a tile, for one block of mr rows x nv vectors of
 * keys when the scores need no elementwise transform (no mask, ALiBi or
 * softcap): S = Q.K^T is accumulated in registers and leaves as
 * P = exp2(S c1 - LSE log2e) (fb_exp_block), then dP = dO.V^T leaves as
 * dS = P (dP - D), P read back from the rows just stored (still in L1).  This
 * replaces two plain products and a separate pass over the S and dP tiles. */
FA_INLINE void FB_NAME(fb_ukr_sdp)(const int mr, const int nv, int64_t D, int64_t Dv, const REAL *Q, int64_t qs,
                                   const REAL *Kt, const REAL *dO, int64_t os, const REAL *Vt, int64_t ldb,
                                   const REAL *l2, const REAL *di, vf c1v, REAL *P, REAL *dS, int64_t ldc)
{
    vf acc[FB_MR][FB_NV];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = vf_zero();
    for (int64_t k = 0; k < D; k++) {
        vf bv[FB_NV];
        for (int v = 0; v < nv; v++) bv[v] = vf_load(Kt + k * ldb + v * VW);
        for (int i = 0; i < mr; i++) {
            vf a = vf_set1(Q[i * qs + k]);
            for (int v = 0; v < nv; v++) acc[i][v] = vf_fma(a, bv[v], acc[i][v]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) vf_store(P + i * ldc + v * VW, acc[i][v]);
    FB_NAME(fb_exp_block)(mr, nv, c1v, l2, P, ldc);
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = vf_zero();
    for (int64_t k = 0; k < Dv; k++) {
        vf bv[FB_NV];
        for (int v = 0; v < nv; v++) bv[v] = vf_load(Vt + k * ldb + v * VW);
        for (int i = 0; i < mr; i++) {
            vf a = vf_set1(dO[i * os + k]);
            for (int v = 0; v < nv; v++) acc[i][v] = vf_fma(a, bv[v], acc[i][v]);
        }
    }
    for (int i = 0; i < mr; i++) {
        const vf dv_ = vf_set1(di[i]);
        for (int v = 0; v < nv; v++)
            vf_store(dS + i * ldc + v * VW, vf_mul(vf_load(P + i * ldc + v * VW), vf_sub(acc[i][v], dv_)));
    }
}

/* ---- Constant-mr dispatch: fb_ukr and fb_ukr_sdp for mr = 1..FB_MR rows,
 * each case a call with mr (and the caller's nv) compile-time constants, so
 * that each inlines its own unrolled copy; always_inline, so that those copies
 * sit in the caller as when these switches were macros there.  FB_MRC clamps
 * the unreachable cases past FB_MR (the callers pass at most FB_MR rows). */
#define FB_MRC(n) ((n) <= FB_MR ? (n) : FB_MR)

FA_INLINE void FB_NAME(fb_ukr_n)(int64_t mr, const int nv, int64_t K, const REAL *A, int64_t ai, int64_t ak,
                                 const REAL *B, int64_t ldb, REAL *C, int64_t ldc, int load)
{
    switch (mr) {
    case 1: FB_NAME(fb_ukr)(1, nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 2: FB_NAME(fb_ukr)(FB_MRC(2), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 3: FB_NAME(fb_ukr)(FB_MRC(3), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 4: FB_NAME(fb_ukr)(FB_MRC(4), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 5: FB_NAME(fb_ukr)(FB_MRC(5), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 6: FB_NAME(fb_ukr)(FB_MRC(6), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 7: FB_NAME(fb_ukr)(FB_MRC(7), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 8: FB_NAME(fb_ukr)(FB_MRC(8), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 9: FB_NAME(fb_ukr)(FB_MRC(9), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 10: FB_NAME(fb_ukr)(FB_MRC(10), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    case 11: FB_NAME(fb_ukr)(FB_MRC(11), nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    default: FB_NAME(fb_ukr)(FB_MR, nv, K, A, ai, ak, B, ldb, C, ldc, load); break;
    }
}

FA_INLINE void FB_NAME(fb_ukr_sdp_n)(int64_t mr, const int nv, int64_t D, int64_t Dv, const REAL *Q, int64_t qs,
                                     const REAL *Kt, const REAL *dO, int64_t os, const REAL *Vt, int64_t ldb,
                                     const REAL *l2, const REAL *di, vf c1v, REAL *P, REAL *dS, int64_t ldc)
{
    switch (mr) {
    case 1: FB_NAME(fb_ukr_sdp)(1, nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 2: FB_NAME(fb_ukr_sdp)(FB_MRC(2), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 3: FB_NAME(fb_ukr_sdp)(FB_MRC(3), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 4: FB_NAME(fb_ukr_sdp)(FB_MRC(4), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 5: FB_NAME(fb_ukr_sdp)(FB_MRC(5), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 6: FB_NAME(fb_ukr_sdp)(FB_MRC(6), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 7: FB_NAME(fb_ukr_sdp)(FB_MRC(7), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 8: FB_NAME(fb_ukr_sdp)(FB_MRC(8), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 9: FB_NAME(fb_ukr_sdp)(FB_MRC(9), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 10: FB_NAME(fb_ukr_sdp)(FB_MRC(10), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 11: FB_NAME(fb_ukr_sdp)(FB_MRC(11), nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    default: FB_NAME(fb_ukr_sdp)(FB_MR, nv, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    }
}

/* fb_ukr_sdp_n for nv = 1..FB_NV vectors (a constant per case): the blocks
 * of a partial tile that see fewer than FB_NV vectors of its keys. */
#define FB_NVC(n) ((n) <= FB_NV ? (n) : FB_NV)
FA_INLINE void FB_NAME(fb_ukr_sdp_nv)(int64_t mr, int64_t nv, int64_t D, int64_t Dv, const REAL *Q, int64_t qs,
                                      const REAL *Kt, const REAL *dO, int64_t os, const REAL *Vt, int64_t ldb,
                                      const REAL *l2, const REAL *di, vf c1v, REAL *P, REAL *dS, int64_t ldc)
{
    switch (nv) {
    case 1: FB_NAME(fb_ukr_sdp_n)(mr, 1, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 2: FB_NAME(fb_ukr_sdp_n)(mr, FB_NVC(2), D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    case 3: FB_NAME(fb_ukr_sdp_n)(mr, FB_NVC(3), D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    default: FB_NAME(fb_ukr_sdp_n)(mr, FB_NV, D, Dv, Q, qs, Kt, dO, os, Vt, ldb, l2, di, c1v, P, dS, ldc); break;
    }
}

/* The reduction range [*kb, *kb + n) of the rows [r0, r0 + mr) (fb_gemm). */
FA_INLINE int64_t FB_NAME(fb_krange)(const int32_t *klo, const int32_t *khi, int64_t r0, int64_t mr, int64_t K,
                                     int64_t *kb)
{
    *kb = klo ? klo[r0] : 0;
    const int64_t ke = khi ? khi[r0 + mr - 1] : K;
    return ke > *kb ? ke - *kb : 0;
}

/* C (M x N, ldc) (+)= A (M x K, element (i, k) at A[i*ai + k*ak]) . B (K x N, ldb);
 * N is a multiple of VW.  Column blocks outer, so that a block of B stays in
 * L1 across the row blocks.  With klo/khi (non-decreasing in i; NULL: all of
 * K), row i's A is zero outside [klo[i], khi[i]), and a block of rows sums
 * only over the union of its rows' ranges: on a partial tile (the causal
 * diagonal, a window edge) the terms left out are exact zeros. */
static void FB_NAME(fb_gemm)(int64_t M, int64_t N, int64_t K, const REAL *A, int64_t ai, int64_t ak,
                             const REAL *B, int64_t ldb, REAL *C, int64_t ldc, int load, const int32_t *klo,
                             const int32_t *khi)
{
    int64_t c0 = 0, kb;
    for (; c0 + FB_NV * VW <= N; c0 += FB_NV * VW)
        for (int64_t r0 = 0; r0 < M; r0 += FB_MR) {
            const int64_t mr = M - r0 < FB_MR ? M - r0 : FB_MR, nk = FB_NAME(fb_krange)(klo, khi, r0, mr, K, &kb);
            if (nk == 0 && load) continue; /* no term: C stays */
            FB_NAME(fb_ukr_n)(mr, FB_NV, nk, A + r0 * ai + kb * ak, ai, ak, B + kb * ldb + c0, ldb,
                              C + r0 * ldc + c0, ldc, load);
        }
    for (int64_t u = 0, nt = (N - c0) / VW; u < nt; u++, c0 += VW) /* (this form: no GCC loop warning) */
        for (int64_t r0 = 0; r0 < M; r0 += FB_MR) {
            const int64_t mr = M - r0 < FB_MR ? M - r0 : FB_MR, nk = FB_NAME(fb_krange)(klo, khi, r0, mr, K, &kb);
            if (nk == 0 && load) continue;
            FB_NAME(fb_ukr_n)(mr, 1, nk, A + r0 * ai + kb * ak, ai, ak, B + kb * ldb + c0, ldb,
                              C + r0 * ldc + c0, ldc, load);
        }
}

/* P and dS of a query tile (nq rows) against one key tile (FB_BK keys) by
 * fb_ukr_sdp: row blocks outer, so that the S block a dS block reads back was
 * stored a moment before.  With a0/a1 (a partial tile: row r sees keys
 * [a0[r], a1[r]) of the tile, both non-decreasing), a block of rows computes
 * only the vectors that hold keys some row of it sees, and nothing when it
 * sees none; fb_edge then clears what it left (every value outside a row's
 * range). */
static void FB_NAME(fb_sdp)(int64_t nq, int64_t D, int64_t Dv, const REAL *Q, int64_t qs, const REAL *Kt,
                            const REAL *dO, int64_t os, const REAL *Vt, const REAL *l2, const REAL *di, REAL c1,
                            REAL *P, REAL *dS, const int32_t *a0, const int32_t *a1)
{
    const vf c1v = vf_set1(c1);
    for (int64_t r0 = 0; r0 < nq; r0 += FB_MR) {
        const int64_t mr = nq - r0 < FB_MR ? nq - r0 : FB_MR;
        int64_t v = 0, ve = FB_BK / VW; /* vectors [v, ve) of the tile */
        if (a0) {
            if (a1[r0 + mr - 1] <= a0[r0]) continue;
            v = a0[r0] / VW;
            ve = (a1[r0 + mr - 1] + VW - 1) / VW;
        }
        while (v < ve) {
            const int64_t nv = ve - v < FB_NV ? ve - v : FB_NV, c0 = v * VW;
            FB_NAME(fb_ukr_sdp_nv)(mr, nv, D, Dv, Q + r0 * qs, qs, Kt + c0, dO + r0 * os, os, Vt + c0, FB_BK,
                                   l2 + r0, di + r0, c1v, P + r0 * FB_BK + c0, dS + r0 * FB_BK + c0, FB_BK);
            v += nv;
        }
    }
}

/* The keys [a0[r], a1[r]) of a key tile (at jt, nk keys) that row r of a
 * query tile (nq rows from i0) sees, and the rows [qlo[j], qhi[j]) that see
 * key j of it: intervals, all four non-decreasing, because visible ranges
 * grow with the position (mask.h). */
static void FB_NAME(fb_ranges)(const fa_params *p, int64_t i0, int64_t nq, int64_t delta, int64_t Sb, int64_t jt,
                               int64_t nk, int32_t *a0, int32_t *a1, int32_t *qlo, int32_t *qhi)
{
    for (int64_t r = 0; r < nq; r++) {
        int64_t lo, hi;
        fa_row_range(p, i0 + r + delta, Sb, &lo, &hi);
        a0[r] = (int32_t)fa_min64(fa_max64(lo - jt, 0), nk);
        a1[r] = (int32_t)fa_max64(fa_min64(hi - jt, nk), a0[r]);
    }
    for (int64_t j = 0, rl = 0, rh = 0; j < nk; j++) {
        while (rl < nq && a1[rl] <= j) rl++; /* first row whose range ends past j */
        while (rh < nq && a0[rh] <= j) rh++; /* first row whose range starts past j */
        qlo[j] = (int32_t)rl;
        qhi[j] = (int32_t)(rh > rl ? rh : rl);
    }
}

/* Clears P and dS outside each row's visible keys [a0[r], a1[r]) of a key
 * tile (fb_ranges; past its nk keys too): the causal diagonal, a window edge,
 * the last tile's tail.  The values there came from zero-padded or unseen
 * keys, or were not computed (fb_sdp). */
static void FB_NAME(fb_edge)(int64_t nq, const int32_t *a0, const int32_t *a1, REAL *S, REAL *dP)
{
    for (int64_t r = 0; r < nq; r++) {
        REAL *s = S + r * FB_BK, *dp = dP + r * FB_BK;
        for (int64_t jj = 0; jj < a0[r]; jj++) s[jj] = dp[jj] = 0;
        for (int64_t jj = a1[r]; jj < FB_BK; jj++) s[jj] = dp[jj] = 0;
    }
}

static void FB_NAME(fb_run)(const fa_bwd_params *bp, const fa_bwd_task *t, void *scratch)
{
    const fa_params *p = &bp->f;
    const int64_t G = p->Hq / p->Hk, D = p->D, Dv = p->Dv, b = t->b, hk = t->hk;
    const int64_t Dp = FB_NAME(fb_rup)(D, VW), Dvp = FB_NAME(fb_rup)(Dv, VW);
    FB_NAME(fb_ws) w;
    FB_NAME(fb_carve)(p, scratch, &w);
    const fa_batch bi = fa_batch_info(p, b);
    const int64_t delta = bi.Sb - bi.Lb;
    const int use_log2 = p->softcap == 0.0;
    /* dropout: every tile takes the per-element pass, which applies Z */
    const int drop = p->dropout_p > 0.0;
    const int32_t drop_thr = FA_DROP_FLIP(fa_dropout_thr32(p->dropout_p)); /* (dropout.h) */
    const REAL drop_scale = (REAL)fa_dropout_keep_scale(p->dropout_p);
    const int elem_always = p->mask_kind != FA_MASK_NONE || p->alibi || !use_log2;
    /* the attn_mask is the one per-element transform: a tile a bool mask hides
     * from the tile's rows is skipped (its P and dS are 0), one it leaves alone
     * takes the unmasked pass (fa_tile_mask_state, mask.h; as the forward) */
    const int mask_only = p->mask_kind != FA_MASK_NONE && !p->alibi && use_log2;
    const REAL c1 = (REAL)(p->scale * FB_LOG2E); /* the fused path's S -> log2-domain logit */
    const REAL *K = (const REAL *)p->k + b * p->k_sb + hk * p->k_sh;
    const REAL *V = (const REAL *)p->v + b * p->v_sb + hk * p->v_sh;
    REAL *dk = (REAL *)bp->dk + b * bp->dk_sb + hk * bp->dk_sh;
    REAL *dv = (REAL *)bp->dv + b * bp->dv_sb + hk * bp->dv_sh;
    const REAL *delta_all = (const REAL *)t->delta, *lse2_all = (const REAL *)t->lse2;
    const int64_t jend = fa_min64(t->j1, bi.Sb);
    const size_t mesz = p->mask_kind == FA_MASK_BOOL ? 1 : p->mask_kind == FA_MASK_F32 ? 4 : 8;
    const int64_t KB = FB_NKT * FB_BK; /* keys per block: its tiles share each pass over the queries */

    for (int64_t jb = t->j0; jb < jend; jb += KB) {
        const int64_t nkb = fa_min64(KB, jend - jb), ntile = (nkb + FB_BK - 1) / FB_BK;
        /* ---- the key block's tiles: K^T, V^T and K rows, zero past the last key ---- */
        for (int64_t u = 0; u < ntile; u++) {
            const int64_t jt = jb + u * FB_BK, nk = fa_min64(FB_BK, jend - jt);
            REAL *Kt = w.Kt + u * Dp * FB_BK, *Vt = w.Vt + u * Dvp * FB_BK, *Kr = w.Kr + u * FB_BK * Dp;
            for (int64_t jj = 0; jj < FB_BK; jj++) {
                const REAL *kr = K + (jt + jj) * p->k_sl, *vr = V + (jt + jj) * p->v_sl;
                REAL *kd = Kr + jj * Dp;
                if (jj < nk) {
                    for (int64_t d = 0; d < D; d++) { Kt[d * FB_BK + jj] = kr[d]; kd[d] = kr[d]; }
                    for (int64_t d = 0; d < Dv; d++) Vt[d * FB_BK + jj] = vr[d];
                } else {
                    for (int64_t d = 0; d < D; d++) { Kt[d * FB_BK + jj] = 0; kd[d] = 0; }
                    for (int64_t d = 0; d < Dv; d++) Vt[d * FB_BK + jj] = 0;
                }
                for (int64_t d = D; d < Dp; d++) kd[d] = 0;
            }
        }
        memset(w.dK, 0, (size_t)(ntile * FB_BK * Dp) * sizeof(REAL));
        memset(w.dV, 0, (size_t)(ntile * FB_BK * Dvp) * sizeof(REAL));

        for (int64_t g = 0; g < G; g++) {
            const int64_t h = hk * G + g;
            const REAL *Q = (const REAL *)p->q + b * p->q_sb + h * p->q_sh;
            const REAL *dO = (const REAL *)bp->dout + b * bp->do_sb + h * bp->do_sh;
            const int64_t rowbase = (b * p->Hq + h) * p->L;
            REAL *dq = (REAL *)t->dq_part + rowbase * Dp;
            for (int64_t i0 = 0; i0 < bi.Lb; i0 += FB_BQ) {
                const int64_t nq = fa_min64(FB_BQ, bi.Lb - i0);
                /* Visible ranges grow with the row: the first row has the
                 * smallest lo, the last the largest hi (mask.h). */
                int64_t lo0, hi0, lo1, hi1;
                fa_row_range(p, i0 + delta, bi.Sb, &lo0, &hi0);
                fa_row_range(p, i0 + nq - 1 + delta, bi.Sb, &lo1, &hi1);
                if (hi1 <= jb || lo0 >= jb + nkb) continue; /* no row sees a key of the block */

                /* Zero-padded copies of the tile's Q and dO rows, shared by the
                 * block's key tiles: compact rows for the four products that read
                 * them (reading the rows in place instead, when D and Dv are whole
                 * vectors, measured 2-3% slower on B1 H8 L2048 D64). */
                for (int64_t r = 0; r < nq; r++) {
                    const REAL *qs = Q + (i0 + r) * p->q_sl, *os = dO + (i0 + r) * bp->do_sl;
                    REAL *qd = w.Q + r * Dp, *od = w.dO + r * Dvp;
                    for (int64_t d = 0; d < D; d++) qd[d] = qs[d];
                    for (int64_t d = D; d < Dp; d++) qd[d] = 0;
                    for (int64_t d = 0; d < Dv; d++) od[d] = os[d];
                    for (int64_t d = Dv; d < Dvp; d++) od[d] = 0;
                }
                const REAL *qt = w.Q, *ot = w.dO;
                const int64_t qst = Dp, ost = Dvp;
                const REAL *l2t = lse2_all + rowbase + i0, *dit = delta_all + rowbase + i0;
                for (int64_t u = 0; u < ntile; u++) {
                    const int64_t jt = jb + u * FB_BK, nk = fa_min64(FB_BK, jend - jt);
                    if (hi1 <= jt || lo0 >= jt + nk) continue; /* the forward's masked-tile skipping */
                    const int mst = mask_only ? fa_tile_mask_state(p, b, h, 1, i0, nq, jt, nk) : FA_TM_MIXED;
                    if (mst == FA_TM_HIDDEN) continue;
                    const int elem = elem_always && mst != FA_TM_VISIBLE; /* this tile per element */
                    const int full = lo1 <= jt && hi0 >= jt + nk && nk == FB_BK;
                    const REAL *Kt = w.Kt + u * Dp * FB_BK, *Vt = w.Vt + u * Dvp * FB_BK;
                    const REAL *Kr = w.Kr + u * FB_BK * Dp;

                    /* A partial tile: each row's keys and each key's rows, so that
                     * the products skip the blocks' zeros (fb_sdp, fb_gemm). */
                    int32_t a0[FB_BQ], a1[FB_BQ], qlo[FB_BK], qhi[FB_BK];
                    if (!full) FB_NAME(fb_ranges)(p, i0, nq, delta, bi.Sb, jt, nk, a0, a1, qlo, qhi);
                    const int32_t *rl = full ? NULL : a0, *rh = full ? NULL : a1;   /* keys per row */
                    const int32_t *kl = full ? NULL : qlo, *kh = full ? NULL : qhi; /* rows per key */
                    if (!elem && !drop) {
                        /* ---- P and dS in one pass (fb_sdp) ---- */
                        FB_NAME(fb_sdp)(nq, D, Dv, qt, qst, Kt, ot, ost, Vt, l2t, dit, c1, w.S, w.dP, rl, rh);
                        if (!full) FB_NAME(fb_edge)(nq, a0, a1, w.S, w.dP);
                    } else {
                        /* ---- S = Q.K^T and dP = dO.V^T ---- */
                        FB_NAME(fb_gemm)(nq, FB_BK, D, qt, qst, 1, Kt, FB_BK, w.S, FB_BK, 0, NULL, NULL);
                        FB_NAME(fb_gemm)(nq, FB_BK, Dv, ot, ost, 1, Vt, FB_BK, w.dP, FB_BK, 0, NULL, NULL);

                        /* ---- the forward's transforms, only where the tile needs them:
                         * S becomes the log2-domain logit (-inf where not seen) ---- */
                        for (int64_t r = 0; r < nq && elem; r++) {
                            REAL *s = w.S + r * FB_BK;
                            const int64_t i = i0 + r, ip = i + delta;
                            int64_t lo, hi;
                            fa_row_range(p, ip, bi.Sb, &lo, &hi);
                            const char *mrow = p->mask ? (const char *)p->mask +
                                (b * p->m_sb + h * p->m_sh + i * p->m_sl) * (int64_t)mesz : NULL;
                            const double slope = p->alibi ? p->alibi[b * p->alibi_sb + h * p->alibi_sh] * FB_LOG2E : 0.0;
                            REAL *dr = w.Dr + r * FB_BK;
                            for (int64_t jj = 0; jj < FB_BK; jj++) {
                                const int64_t j = jt + jj;
                                if (jj >= nk || j < lo || j >= hi) { s[jj] = -INFINITY; dr[jj] = 0; continue; }
                                double x = (double)s[jj] * p->scale, der = 1.0;
                                if (!use_log2) {
                                    /* as the forward: the identity for tiny x/c (see kernel_impl.h) */
                                    double y = x / p->softcap;
                                    if (fabs(y) >= 1e-6) {
                                        double th = tanh(y);
                                        x = p->softcap * th;
                                        der = 1.0 - th * th;
                                    }
                                }
                                x *= FB_LOG2E;
                                if (p->alibi) x -= slope * (double)(ip > j ? ip - j : j - ip);
                                if (mrow) {
                                    int64_t mo = j * p->m_ss;
                                    if (p->mask_kind == FA_MASK_BOOL) { if (!((const uint8_t *)mrow)[mo]) x = -INFINITY; }
                                    else if (p->mask_kind == FA_MASK_F32) x += ((const float *)mrow)[mo] * FB_LOG2E;
                                    else x += ((const double *)mrow)[mo] * FB_LOG2E;
                                }
                                s[jj] = (REAL)x;
                                dr[jj] = (REAL)der;
                            }
                        }
                        /* ---- P = exp2(S - LSE log2e), dS = P (dP - D) [x softcap'] (S was
                         * transformed above, so c1 = 1 here); with dropout, dP o Z
                         * and P o Z for dV, and an untransformed tile (dropout only: the
                         * raw scores, as fb_sdp's, c1 scaling them; fb_edge clears
                         * what its rows do not see) ---- */
                        const vf c1v = vf_set1(elem ? (REAL)1 : c1);
                        for (int64_t r = 0; r < nq; r++) {
                            REAL *s = w.S + r * FB_BK, *dp = w.dP + r * FB_BK;
                            const vf l2v = vf_set1(l2t[r]), dv_ = vf_set1(dit[r]);
                            if (drop) {
                                REAL z[FB_BK];
                                uint32_t u[FB_BK + 16]; /* >= fa_dropout_words_len */
                                fa_dropout_words(p->dropout_seed, p->dropout_b0 + b, h, i0 + r, jt, FB_BK, u);
                                const uint32_t *uj = u + (jt & 7);
                                for (int64_t jj = 0; jj < FB_BK; jj++) z[jj] = FA_DROP_FLIP(uj[jj]) >= drop_thr ? drop_scale : 0;
                                const REAL *dr = w.Dr + r * FB_BK;
                                const vf nl2 = vf_sub(vf_zero(), l2v);
                                for (int64_t jj = 0; jj < FB_BK; jj += VW) {
                                    const vf pv = vf_exp2_neg(vf_fma(vf_load(s + jj), c1v, nl2));
                                    const vf zv = vf_load(z + jj);
                                    vf ds = vf_mul(pv, vf_sub(vf_mul(vf_load(dp + jj), zv), dv_));
                                    if (!use_log2) ds = vf_mul(ds, vf_load(dr + jj));
                                    vf_store(s + jj, vf_mul(pv, zv));
                                    vf_store(dp + jj, ds);
                                }
                            } else if (use_log2) {
                                for (int64_t jj = 0; jj < FB_BK; jj += VW) {
                                    vf pv = vf_exp2_neg(vf_sub(vf_load(s + jj), l2v));
                                    vf_store(s + jj, pv);
                                    vf_store(dp + jj, vf_mul(pv, vf_sub(vf_load(dp + jj), dv_)));
                                }
                            } else {
                                const REAL *dr = w.Dr + r * FB_BK;
                                for (int64_t jj = 0; jj < FB_BK; jj += VW) {
                                    vf pv = vf_exp2_neg(vf_sub(vf_load(s + jj), l2v));
                                    vf_store(s + jj, pv);
                                    vf_store(dp + jj, vf_mul(vf_mul(pv, vf_sub(vf_load(dp + jj), dv_)), vf_load(dr + jj)));
                                }
                            }
                        }
                    }
                    if (drop && !elem && !full) FB_NAME(fb_edge)(nq, a0, a1, w.S, w.dP);
                    /* ---- dV += P^T.dO, dK += dS^T.Q, dQ += dS.K ---- */
                    FB_NAME(fb_gemm)(nk, Dvp, nq, w.S, 1, FB_BK, ot, ost, w.dV + u * FB_BK * Dvp, Dvp, 1, kl, kh);
                    FB_NAME(fb_gemm)(nk, Dp, nq, w.dP, 1, FB_BK, qt, qst, w.dK + u * FB_BK * Dp, Dp, 1, kl, kh);
                    FB_NAME(fb_gemm)(nq, Dp, nk, w.dP, FB_BK, 1, Kr, Dp, dq + i0 * Dp, Dp, 1, rl, rh);
                }
            }
        }
        /* ---- the key block's dK (times scale) and dV ---- */
        const REAL sc = (REAL)p->scale;
        for (int64_t jj = 0; jj < nkb; jj++) {
            REAL *kd = dk + (jb + jj) * bp->dk_sl, *vd = dv + (jb + jj) * bp->dv_sl;
            const REAL *ks = w.dK + jj * Dp, *vs = w.dV + jj * Dvp;
            for (int64_t d = 0; d < D; d++) kd[d] = ks[d] * sc;
            for (int64_t d = 0; d < Dv; d++) vd[d] = vs[d];
        }
    }
    /* Keys past the valid length get no gradient. */
    for (int64_t j = fa_max64(t->j0, bi.Sb); j < t->j1; j++) {
        memset(dk + j * bp->dk_sl, 0, (size_t)D * sizeof(REAL));
        memset(dv + j * bp->dv_sl, 0, (size_t)Dv * sizeof(REAL));
    }
}

const fa_bwd_kernel FB_NAME(fa_bwd_kernel) = { FB_NAME(fb_scratch_bytes), FB_NAME(fb_run), FB_BK, VW };
