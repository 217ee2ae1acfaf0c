/* additive_impl.h: the fused additive (Bahdanau) attention kernel, written
 * once in the vector vocabulary of simd.h and instantiated per ISA by
 * additive_<isa>.c, which define AD_SUFFIX and the tile constants AD_MR
 * (query rows per register block) and AD_NV (vectors of keys per block).
 *
 * One task = AD_BM query rows of one batch element.  For each tile of AD_BN
 * keys it packs the tile of the transposed key projection (A x AD_BN, zero
 * padded), computes the score tile e[i][j] = sum_a w[a] tanh(pq[i][a] +
 * pk[a][j]) with the vectorised tanh below (keys along the vector lanes, so
 * nothing is reduced horizontally), applies the mask, and folds the tile into
 * an online softmax (running max m and sum l per row, rescaling the output
 * accumulator).  Scratch is bounded by the tiles: (L, S, A) never exists.
 * Tasks depend on the shapes only, so results do not depend on the thread
 * count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#include "family.h"

#define AD_CAT_(a, b) a##b
#define AD_CAT(a, b) AD_CAT_(a, b)
#define AD_NAME(x) AD_CAT(x, AD_SUFFIX)
#define AD_NR (AD_NV * VW) /* keys per register block */
#define AD_BN (4 * AD_NR)  /* keys per tile */
#define AD_BM 32           /* query rows per task */
#define AD_LOG2E 1.4426950408889634

#if defined(FA_TARGET_AVX512)
#define ad_abs(x) _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)))
#define ad_signbits(x) _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)))
#define ad_or(a, b) _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)))
#define ad_rcp(x) _mm512_rcp14_ps(x) /* 14 bits; one Newton step below gives ~float precision */
#elif defined(FA_TARGET_AVX2)
#define ad_abs(x) _mm256_and_ps((x), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)))
#define ad_signbits(x) _mm256_and_ps((x), _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u)))
#define ad_or(a, b) _mm256_or_ps((a), (b))
#define ad_rcp(x) _mm256_rcp_ps(x) /* 12 bits; one Newton step below gives ~23 bits */
#elif defined(FA_TARGET_NEON)
#define ad_abs(x) vabsq_f32(x)
#define ad_signbits(x) vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u)))
#define ad_or(a, b) vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(a), vreinterpretq_u32_f32(b)))
/* FRECPE gives 8 bits, where the x86 estimates give 12 or 14: one Newton step
 * (FRECPS) here and the one below give ~float precision. */
FA_INLINE vf ad_rcp(vf x)
{
    const vf r = vrecpeq_f32(x);
    return vmulq_f32(r, vrecpsq_f32(x, r));
}
#endif

#if defined(FA_TARGET_AVX512) || defined(FA_TARGET_AVX2) || defined(FA_TARGET_NEON)
/* tanh(x) = sign(x) (1 - t) / (1 + t) with t = exp(-2|x|) in (0, 1]: t never
 * overflows, large |x| gives t = 0 and exactly +-1, NaN propagates.  The
 * absolute error is a few float ulps of 1 (the cancellation in 1 - t near 0
 * is absolute, which is what a weighted sum of tanh values needs).  Needs
 * MXCSR FTZ (vf_exp2_neg), set by the driver. */
FA_INLINE vf ad_tanh(vf x)
{
    vf ax = ad_abs(x);
    vf t = vf_exp2_neg(vf_mul(ax, vf_set1((float)(-2.0 * AD_LOG2E))));
    vf d = vf_add(vf_set1(1.0f), t);
    vf r = ad_rcp(d);
    r = vf_mul(r, vf_sub(vf_set1(2.0f), vf_mul(d, r))); /* Newton: r (2 - d r) */
    vf y = vf_mul(vf_sub(vf_set1(1.0f), t), r);
    return ad_or(y, ad_signbits(x));
}
#define AD_EXP(x) vf_exp2(vf_mul((x), vf_set1((float)AD_LOG2E)))
#else
#define ad_tanh(x) ((REAL)(sizeof(REAL) == 4 ? (double)tanhf((float)(x)) : tanh((double)(x))))
#define AD_EXP(x) ((REAL)(sizeof(REAL) == 4 ? (double)expf((float)(x)) : exp((double)(x))))
#endif

static inline int64_t ad_rup(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

size_t AD_NAME(fa_additive_scratch)(const fa_additive_params *p)
{
    int64_t Dvp = ad_rup(p->Dv, VW);
    size_t e = sizeof(REAL);
    /* Kp (A x BN), scores (BM x BN), O (BM x Dvp), m, l, row of p (BN) */
    return (size_t)(p->A * AD_BN + AD_BM * AD_BN + AD_BM * Dvp + 2 * AD_BM + AD_BN) * e + 128;
}

/* S[r][0:NR] = sum_a w[a] tanh(Q[r][a] + Kp[a][0:NR]) for mr rows. */
FA_INLINE void AD_NAME(ukernel)(int mr, const REAL *Q, int64_t ldq, const REAL *Kp, const REAL *w,
                                int64_t A, REAL *S, int64_t lds)
{
    vf acc[AD_MR][AD_NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < AD_NV; v++) acc[r][v] = vf_zero();
    for (int64_t a = 0; a < A; a++) {
        vf kv[AD_NV];
        vf wa = vf_set1(w[a]);
        for (int v = 0; v < AD_NV; v++) kv[v] = vf_load(Kp + a * AD_BN + v * VW);
        for (int r = 0; r < mr; r++) {
            vf qa = vf_set1(Q[r * ldq + a]);
            for (int v = 0; v < AD_NV; v++) acc[r][v] = vf_fma(wa, ad_tanh(vf_add(qa, kv[v])), acc[r][v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < AD_NV; v++) vf_store(S + r * lds + v * VW, acc[r][v]);
}

static inline REAL AD_NAME(mask_at)(const fa_additive_params *p, int64_t off, REAL s)
{
    switch (p->mask_kind) {
    case FA_MASK_BOOL: return ((const uint8_t *)p->mask)[off] ? s : (REAL)-INFINITY;
    case FA_MASK_F32: return s + (REAL)((const float *)p->mask)[off];
    case FA_MASK_F64: return (REAL)((double)s + ((const double *)p->mask)[off]);
    default: return s;
    }
}

void AD_NAME(fa_additive_task)(const fa_additive_params *p, int64_t b, int64_t i0, int64_t ni, void *scratch)
{
    const int64_t A = p->A, S = p->S, Dv = p->Dv, Dvp = ad_rup(Dv, VW);
    REAL *Kp = (REAL *)(((uintptr_t)scratch + 63) / 64 * 64);
    REAL *St = Kp + A * AD_BN;
    REAL *O = St + AD_BM * AD_BN;
    REAL *m = O + AD_BM * Dvp;
    REAL *l = m + AD_BM;
    REAL *prow = l + AD_BM;
    const REAL *Q = (const REAL *)p->pq + b * p->pq_sb + i0 * p->pq_sl;
    const REAL *PK = (const REAL *)p->pk + b * p->pk_sb;
    const REAL *W = (const REAL *)p->w;
    const REAL *V = (const REAL *)p->v + b * p->v_sb;
    REAL *wts = p->wts ? (REAL *)p->wts + b * p->wts_sb + i0 * p->wts_sl : NULL;
    const int64_t mbase = b * p->m_sb + i0 * p->m_sl;

    for (int64_t r = 0; r < ni; r++) {
        m[r] = (REAL)-INFINITY;
        l[r] = 0;
        for (int64_t c = 0; c < Dvp; c++) O[r * Dvp + c] = 0;
    }
    for (int64_t j0 = 0; j0 < S; j0 += AD_BN) {
        const int64_t nj = S - j0 < AD_BN ? S - j0 : AD_BN;
        for (int64_t a = 0; a < A; a++) { /* pack the tile, zero padded to AD_BN keys */
            memcpy(Kp + a * AD_BN, PK + a * p->pk_sa + j0, (size_t)nj * sizeof(REAL));
            for (int64_t j = nj; j < AD_BN; j++) Kp[a * AD_BN + j] = 0;
        }
        const int64_t nb = (nj + AD_NR - 1) / AD_NR;
        for (int64_t r0 = 0; r0 < ni; r0 += AD_MR) {
            const int64_t mr = ni - r0 < AD_MR ? ni - r0 : AD_MR;
            for (int64_t jb = 0; jb < nb; jb++) {
                if (mr == AD_MR)
                    AD_NAME(ukernel)(AD_MR, Q + r0 * p->pq_sl, p->pq_sl, Kp + jb * AD_NR, W, A,
                                     St + r0 * AD_BN + jb * AD_NR, AD_BN);
                else
                    for (int64_t r = r0; r < r0 + mr; r++)
                        AD_NAME(ukernel)(1, Q + r * p->pq_sl, p->pq_sl, Kp + jb * AD_NR, W, A,
                                         St + r * AD_BN + jb * AD_NR, AD_BN);
            }
        }
        /* Masks, then the online softmax and P.V of each row. */
        for (int64_t r = 0; r < ni; r++) {
            REAL *s = St + r * AD_BN;
            if (p->mask_kind != FA_MASK_NONE) {
                const int64_t mo = mbase + r * p->m_sl + j0 * p->m_ss;
                for (int64_t j = 0; j < nj; j++) s[j] = AD_NAME(mask_at)(p, mo + j * p->m_ss, s[j]);
            }
            if (wts) memcpy(wts + r * p->wts_sl + j0, s, (size_t)nj * sizeof(REAL));
            REAL mx = (REAL)-INFINITY;
            int nan = 0;
            for (int64_t j = 0; j < nj; j++) {
                if (s[j] != s[j]) nan = 1;
                else if (s[j] > mx) mx = s[j];
            }
            /* A +inf score (a +inf mask entry, an infinite v) makes exp(s - m) =
             * exp(inf - inf) NaN in any softmax (torch, fastattn.reference): the row
             * is NaN, like a NaN score, not the zeros of a row with nothing visible. */
            if (nan || mx == (REAL)INFINITY) { m[r] = (REAL)NAN; }
            if (m[r] != m[r]) continue; /* a NaN score poisons the row (set at the end) */
            REAL mn = mx > m[r] ? mx : m[r];
            if (mn == (REAL)-INFINITY) continue; /* nothing visible yet */
            REAL alpha = 1;
            if (mn > m[r]) {
                alpha = (REAL)(sizeof(REAL) == 4 ? (double)expf((float)(m[r] - mn)) : exp((double)(m[r] - mn)));
                l[r] *= alpha;
                for (int64_t c = 0; c < Dvp; c++) O[r * Dvp + c] *= alpha;
                m[r] = mn;
            }
            /* p_j = exp(s_j - m), vectorised over the tile's nj keys. */
            int64_t j = 0;
            vf mv = vf_set1(mn);
            for (; j + VW <= nj; j += VW) vf_store(prow + j, AD_EXP(vf_sub(vf_load(s + j), mv)));
            for (; j < nj; j++)
                prow[j] = (REAL)(sizeof(REAL) == 4 ? (double)expf((float)(s[j] - mn)) : exp((double)(s[j] - mn)));
            REAL sum = 0;
            for (j = 0; j < nj; j++) sum += prow[j];
            l[r] += sum;
            REAL *o = O + r * Dvp;
            for (j = 0; j < nj; j++) {
                const REAL pj = prow[j];
                if (pj == 0) continue;
                const REAL *vr = V + (j0 + j) * p->v_sl;
                vf pv = vf_set1(pj);
                int64_t c = 0;
                for (; c + VW <= Dv; c += VW) vf_store(o + c, vf_fma(pv, vf_load(vr + c), vf_load(o + c)));
                for (; c < Dv; c++) o[c] += pj * vr[c];
            }
        }
    }
    /* Normalise; write outputs, LSE and (on request) the weights. */
    for (int64_t r = 0; r < ni; r++) {
        REAL *out = (REAL *)p->o + b * p->o_sb + (i0 + r) * p->o_sl;
        const int isnan_ = m[r] != m[r];
        const int live = !isnan_ && m[r] != (REAL)-INFINITY && l[r] > 0;
        const REAL inv = live ? (REAL)1 / l[r] : 0;
        for (int64_t c = 0; c < Dv; c++) out[c] = isnan_ ? (REAL)NAN : live ? O[r * Dvp + c] * inv : 0;
        if (p->lse)
            ((REAL *)p->lse)[b * p->lse_sb + i0 + r] =
                isnan_ ? (REAL)NAN : live ? (REAL)((double)m[r] + log((double)l[r])) : (REAL)-INFINITY;
        if (wts) { /* the same exp as the softmax above, so these are the weights used */
            REAL *wr = wts + r * p->wts_sl;
            const REAL mm = m[r];
            int64_t j = 0;
            if (isnan_ || !live) {
                for (; j < S; j++) wr[j] = isnan_ ? (REAL)NAN : 0;
                continue;
            }
            vf mv = vf_set1(mm), iv = vf_set1(inv);
            for (; j + VW <= S; j += VW) vf_store(wr + j, vf_mul(AD_EXP(vf_sub(vf_load(wr + j), mv)), iv));
            for (; j < S; j++)
                wr[j] = (REAL)(sizeof(REAL) == 4 ? (double)expf((float)(wr[j] - mm)) : exp((double)(wr[j] - mm))) * inv;
        }
    }
}
