/* kernel_bf16_amx.c: bfloat16 prefill on the AMX tile unit (built with -mamx-tile
 * -mamx-bf16 -mavx512f -mavx512bw -mavx512bf16; or, for tests, emulated:
 * FA_EMULATE_AMX + FA_EMULATE_AVX512 on AVX2, see amx_emu.h).
 *
 * Used for calls whose query, key and value are all bfloat16 with at least
 * FA_AMX_MIN_ROWS stacked rows per key/value head (dispatch.c); decode keeps
 * the AVX-512 kernel, which reads 16-bit K/V in place at memory speed.
 *
 * Same task contract and the same score transforms as kernel_impl.h.  Per task
 * (up to AMX_BMR stacked rows) and tile of AMX_BN keys:
 *   - K is packed into the tiles' B layout (row r of a tile = the bf16 pair
 *     d = 2r, 2r+1 of 16 keys: a 16 x 16 transpose of 32-bit words) and V into
 *     the VNNI pair layout (row r = keys 2r and 2r+1 interleaved) once per
 *     tile, for all the task's rows;
 *   - per group of 32 rows (two row tiles): S = Q.K^T by TDPBF16PS (2 x 2 C
 *     tiles of 16 x 16 fp32), stored fp32; scale, masks and the online softmax
 *     in fp32 (AVX-512; exp2 by amx_exp2_neg; in the common unmasked case one
 *     pass per row over registers with the scale folded into the exp's FMA,
 *     amx_softmax_full); P rounded to bf16 (as flash-attention does);
 *     O += P.V by TDPBF16PS with O's fp32 rows loaded into and stored from
 *     the C tiles (rescaled in memory only when a row's max grows);
 *   - the tile work of the neighbouring groups (the next group's Q.K^T, the
 *     previous group's P.V) is issued in small steps from inside a group's
 *     softmax (amx_jobs), so that the tile unit and the vector units overlap.
 * Where the time goes (one thread, B1 H8 L1024 D64, bench build with
 * -DFA_AMX_PROF and parts switched off): the softmax and the tile products
 * about 40 % each, packing and the output about 10 %; they overlap only in
 * part (tile loads and stores share the load/store ports with the softmax).
 * Precision: products of bf16 are exact in fp32 and accumulate in fp32; the
 * extra error against the fp32 path is the rounding of P to bf16 (the naive
 * bf16 contract of the tests, tests/test_amx.py).
 * Padding: rows to 32, d to 32, Dv to 32, keys to 32, all with zeros (scores
 * of padded keys are -inf, so their P is 0, and padded V rows are 0). */
#define FA_TARGET_AVX512 1
#include <math.h>
#include <string.h>
#include "simd.h"
#include "mask.h"
#include "kernel.h"
/* The products: the AMX unit's tiles (or their scalar emulation, amx_emu.h),
 * or, for kernel_bf16_avx512bf16.c, which compiles this file with
 * FA_TILES_VDPBF16, register-blocked VDPBF16PS products over the same packed
 * operands (vdpbf16.h; amx_qk_step / amx_pv_step below). */
#if defined(FA_TILES_VDPBF16)
#include "vdpbf16.h"
#define AMX_KERNEL fa_kernel_bf16_avx512bf16
#else
#include "amx_emu.h"
#if defined(FA_TILES_FP16) /* kernel_f16_amx.c: float16 on AMX-FP16 (TDPFP16PS), P rounded to float16 */
#define AMX_KERNEL fa_kernel_f16_amx
#else
#define AMX_KERNEL fa_kernel_bf16_amx
#endif
#endif

/* Keys per tile (a multiple of 32).  256, not 128: each row group's O rows are
 * loaded into and stored from the C tiles once per key tile, and each row's
 * softmax overhead (max reduction, rescale test, lane sums) is paid once per
 * tile, so a longer tile halves both per key.  Measured (Sapphire Rapids, 2
 * threads, 128 and 256 builds in alternating processes, median of 6 paired
 * rounds): L1024 D64 1.26x, L4096 D64 1.23x, L4096 causal 1.08x, L2048 D128
 * 1.05x faster; on VDPBF16PS (same machine) 1.04-1.07x.  512 gained nothing more
 * (0.94-1.04x: the full-tile softmax's 32 score vectors no longer fit the
 * registers, and causal tiles are masked more coarsely). */
#define AMX_BN 256
#define AMX_BMR 512        /* stacked rows per task for L >= 1024 (attention.c) */
#define AMX_BMR_SHORT 128 /* otherwise */
#define AMX_RG 32         /* rows per group: two 16-row tiles */
#define AMX_LOG2E 1.4426950408889634
#define AMX_LN2 0.6931471805599453
#define AMX_ALIGN 64

/* Profiling build only (-DFA_AMX_PROF, a bench harness, never setup.py): cycle
 * counts of the phases, one thread. */
#if defined(FA_AMX_PROF)
#include <x86intrin.h>
#if defined(FA_TILES_VDPBF16) || defined(FA_TILES_FP16) /* one definition, in the AMX unit */
extern double fa_amx_prof[8];
#else
double fa_amx_prof[8];
#endif
#define AMX_PT(v) const unsigned long long v = __rdtsc()
#define AMX_PADD(i, a, b) (fa_amx_prof[i] += (double)((b) - (a)))
#else
#define AMX_PT(v) ((void)0)
#define AMX_PADD(i, a, b) ((void)0)
#endif

static inline int64_t amx_rup(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static inline size_t amx_al(size_t n) { return (n + AMX_ALIGN - 1) / AMX_ALIGN * AMX_ALIGN; }

/* Rows a task may hold: attention.c gives G * ni <= max(rows, G), rows the
 * call's row block (tiles.c). */
static int64_t amx_rows_cap(const fa_params *p, int64_t rows)
{
    int64_t G = p->Hk > 0 ? p->Hq / p->Hk : 1;
    return amx_rup(G > rows ? G : rows, AMX_RG);
}

/* One stacked row's working set (tiles.c): bf16 query (and its low part at
 * "high"), fp32 output, lane sums and the row's scalars; the scores live per
 * group of 32 rows. */
static int64_t amx_row_bytes(int64_t D, int64_t Dv)
{
    return 4 * amx_rup(D, 32) + 4 * amx_rup(Dv, 32) + 96;
}

typedef struct amx_ws {
    uint16_t *Q; /* rows_cap x Dq   bf16 queries (unscaled), zero-padded      */
    uint16_t *K; /* BN x Dq         packed K tiles                              */
    uint16_t *V; /* BN x Dvq        V in VNNI pairs                             */
    uint16_t *P; /* 2 x RG x BN     bf16 probabilities of two row groups        */
    float *S;    /* 2 x RG x BN     fp32 scores of two row groups               */
    float *O;    /* rows_cap x Dvq  unnormalised output                         */
    float *m, *l;          /* rows_cap */
    float *lv;             /* rows_cap x 16: per-lane partial sums of l (full tiles), added at the end */
    int64_t *lo, *hi;      /* rows_cap: visible key range of each row          */
    int64_t *glo, *ghi, *gflo, *gfhi, *act; /* per row group                   */
    /* float32 inputs at precision "high" / "medium" (fa_params.precision): */
    uint16_t *Ql, *Kl, *Vl, *Pl; /* low bf16 parts (bf16x3, "high") of Q, K, V, P  */
    uint16_t *Kc, *Kcl, *Vc, *Vcl; /* a tile's K, V rows in bf16 (hi, lo), before packing */
} amx_ws;

static size_t amx_own_scratch_bytes(const fa_params *p, int64_t rows)
{
    const int64_t Dq = amx_rup(p->D, 32), Dvq = amx_rup(p->Dv, 32), RC = amx_rows_cap(p, rows), NG = RC / AMX_RG;
    return amx_al((size_t)(RC * Dq) * 2) + amx_al((size_t)(AMX_BN * Dq) * 2) + amx_al((size_t)(AMX_BN * Dvq) * 2) +
           amx_al((size_t)(2 * AMX_RG * AMX_BN) * 2) + amx_al((size_t)(2 * AMX_RG * AMX_BN) * 4) +
           amx_al((size_t)(RC * Dvq) * 4) + 2 * amx_al((size_t)RC * 4) + 2 * amx_al((size_t)RC * 8) +
           5 * amx_al((size_t)NG * 8) + amx_al((size_t)RC * 64) + amx_al((size_t)(RC * Dq) * 2) + 3 * amx_al((size_t)(AMX_BN * Dq) * 2) +
           3 * amx_al((size_t)(AMX_BN * Dvq) * 2) + amx_al((size_t)(2 * AMX_RG * AMX_BN) * 2) + AMX_ALIGN +
           sizeof(fa_scratch_state);
}

/* A task of fewer than FA_AMX_MIN_ROWS stacked rows runs on the AVX-512 vector
 * kernel, as a whole call of so few rows does (dispatch.c): a packed varlen call
 * holds prefill chunks (whose row count picks this kernel) and decode rows of
 * other sequences (G rows each); on the tiles such a task pads G rows to 32 and
 * packs its whole key range for them.  Measured (Zen 4, avx512bf16, 2 threads,
 * benchmarks/paged_decode.py's chunked prefill: 6 decode rows + a 512-query
 * chunk, bf16, 16-token pages): one call was 0.88x (GQA 32/8, S8192) and 0.63x
 * (32/32, S2048) of the separate calls, whose decode call takes the vector
 * kernel; see the CHANGELOG for after.  The choice follows the task's rows
 * only, never the thread count; the vector kernel keeps its head state in the
 * scratch's first bytes (kernel.h), which this kernel leaves alone. */
static int amx_task_on_vectors(const fa_params *p, const fa_task *t)
{
    const fa_batch bi = fa_batch_info(p, t->b);
    const int64_t ni = fa_min64(t->ni, bi.Lb - t->i0);
    return ni > 0 && (p->Hq / p->Hk) * ni < FA_AMX_MIN_ROWS;
}

static size_t amx_scratch_bytes(const fa_params *p, int64_t rows)
{
    const size_t own = amx_own_scratch_bytes(p, rows), vec = fa_kernel_f32_avx512.scratch_bytes(p, rows);
    return own > vec ? own : vec;
}

static void amx_carve(const fa_params *p, int64_t rows, void *scratch, amx_ws *w)
{
    const int64_t Dq = amx_rup(p->D, 32), Dvq = amx_rup(p->Dv, 32), RC = amx_rows_cap(p, rows), NG = RC / AMX_RG;
    /* past the state the driver zeroes (kernel.h), which this kernel does not use */
    char *c = (char *)(((uintptr_t)scratch + sizeof(fa_scratch_state) + AMX_ALIGN - 1) / AMX_ALIGN * AMX_ALIGN);
    w->Q = (uint16_t *)c; c += amx_al((size_t)(RC * Dq) * 2);
    w->K = (uint16_t *)c; c += amx_al((size_t)(AMX_BN * Dq) * 2);
    w->V = (uint16_t *)c; c += amx_al((size_t)(AMX_BN * Dvq) * 2);
    w->P = (uint16_t *)c; c += amx_al((size_t)(2 * AMX_RG * AMX_BN) * 2);
    w->S = (float *)c; c += amx_al((size_t)(2 * AMX_RG * AMX_BN) * 4);
    w->O = (float *)c; c += amx_al((size_t)(RC * Dvq) * 4);
    w->m = (float *)c; c += amx_al((size_t)RC * 4);
    w->l = (float *)c; c += amx_al((size_t)RC * 4);
    w->lv = (float *)c; c += amx_al((size_t)RC * 64);
    w->lo = (int64_t *)c; c += amx_al((size_t)RC * 8);
    w->hi = (int64_t *)c; c += amx_al((size_t)RC * 8);
    w->glo = (int64_t *)c; c += amx_al((size_t)NG * 8);
    w->ghi = (int64_t *)c; c += amx_al((size_t)NG * 8);
    w->gflo = (int64_t *)c; c += amx_al((size_t)NG * 8);
    w->gfhi = (int64_t *)c; c += amx_al((size_t)NG * 8);
    w->act = (int64_t *)c; c += amx_al((size_t)NG * 8);
    w->Ql = (uint16_t *)c; c += amx_al((size_t)(RC * Dq) * 2);
    w->Kl = (uint16_t *)c; c += amx_al((size_t)(AMX_BN * Dq) * 2);
    w->Kc = (uint16_t *)c; c += amx_al((size_t)(AMX_BN * Dq) * 2);
    w->Kcl = (uint16_t *)c; c += amx_al((size_t)(AMX_BN * Dq) * 2);
    w->Vl = (uint16_t *)c; c += amx_al((size_t)(AMX_BN * Dvq) * 2);
    w->Vc = (uint16_t *)c; c += amx_al((size_t)(AMX_BN * Dvq) * 2);
    w->Vcl = (uint16_t *)c; c += amx_al((size_t)(AMX_BN * Dvq) * 2);
    w->Pl = (uint16_t *)c;
}

/* 16 fp32 values rounded to bf16 (nearest even) at dst. */
static inline void amx_store_bf16(uint16_t *dst, vf x)
{
#if defined(FA_EMULATE_AVX512)
    float t[16];
    vf_store(t, x);
    for (int i = 0; i < 16; i++) dst[i] = fa_f32_to_bf16(t[i]);
#else
    __m256bh h = _mm512_cvtneps_pbh(x);
    memcpy(dst, &h, 32);
#endif
}

/* 32 fp32 values (lo: the first 16) rounded to bf16 at dst. */
static inline void amx_store_bf16x2(uint16_t *dst, vf lo, vf hi)
{
#if defined(FA_EMULATE_AVX512)
    amx_store_bf16(dst, lo);
    amx_store_bf16(dst + 16, hi);
#else
    __m512bh h = _mm512_cvtne2ps_pbh(hi, lo);
    memcpy(dst, &h, 64);
#endif
}

/* 32 probabilities (lo: the first 16) rounded to the products' 16-bit type at
 * dst: bfloat16, or float16 in the AMX-FP16 unit (never bf16 for float16
 * inputs: their P keeps float16's 11 bits). */
static inline void amx_store_p16x2(uint16_t *dst, vf lo, vf hi)
{
#if defined(FA_TILES_FP16)
#if defined(FA_EMULATE_AVX512)
    float t[32];
    vf_store(t, lo);
    vf_store(t + 16, hi);
    for (int i = 0; i < 32; i++) dst[i] = fa_f32_to_f16(t[i]);
#else
    __m256i h0 = _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i h1 = _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    memcpy(dst, &h0, 32);
    memcpy(dst + 16, &h1, 32);
#endif
#else
    amx_store_bf16x2(dst, lo, hi);
#endif
}

/* 2^x for x <= 0, -inf or NaN (NaN stays NaN; x < -126 gives 0 under the
 * kernel's FTZ), for P: 2^n * q(f), n = floor(x), f = x - n in [0, 1], q the
 * degree-4 minimax fit of 2^f on [0, 1] (relative error 2.7e-6 in float32,
 * far below the bf16 rounding of P, 2^-9; the row sums l, and so the LSE, see
 * the same error).  On AVX-512 f is one VREDUCEPS (x - floor(x); 0 for -inf)
 * and the scaling one VSCALEFPS (q * 2^floor(x); 0 for -inf): 6 vector
 * operations where the round-to-nearest form took 9 uops (clamp, VRNDSCALEPS
 * is 2, the subtraction), measured below as the softmax's largest part.  The
 * emulated build clamps at -127 and scales by exponent bits: the same values
 * (FTZ takes 2^n with n <= -127 to 0 either way). */
#define AMX_EXP2_Q0 1.0000026226043701f
#define AMX_EXP2_Q1 0.6930038332939148f
#define AMX_EXP2_Q2 0.24144279956817627f
#define AMX_EXP2_Q3 0.052011482417583466f
#define AMX_EXP2_Q4 0.013534121215343475f
static inline vf amx_exp2_neg(vf x)
{
#if defined(FA_EMULATE_AVX512)
    vf xc = vf_max(vf_set1(-127.0f), x); /* max(c, NaN) is NaN: NaN stays */
    vf n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    vf f = vf_sub(xc, n);
#else
    vf f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#endif
    vf q = vf_set1(AMX_EXP2_Q4);
    q = vf_fma(q, f, vf_set1(AMX_EXP2_Q3));
    q = vf_fma(q, f, vf_set1(AMX_EXP2_Q2));
    q = vf_fma(q, f, vf_set1(AMX_EXP2_Q1));
    q = vf_fma(q, f, vf_set1(AMX_EXP2_Q0));
#if defined(FA_EMULATE_AVX512)
    /* 2^n from the exponent bits n + 127 (0 for n = -127: a zero) */
    return vf_mul(q, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23)));
#else
    return _mm512_scalef_ps(q, x);
#endif
}

#if !defined(FA_EMULATE_AVX512)
/* dst row w (64 bytes) = 32-bit word w of each of 16 source rows (src + n * ld
 * bf16): a 16 x 16 transpose of words in four stages, each swapping the
 * off-diagonal blocks of size b (8, 4, 2, 1) between rows i and i + b. */
static const int32_t amx_tr_idx[4][2][16] = {
    /* stage b = 8, 4, 2, 1: lo[k] = (k & b) ? 16 + k - b : k, hi[k] = (k & b) ? 16 + k : k + b */
    {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
    {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}, {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}},
    {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
    {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}, {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}},
};
static inline void amx_tr16(const uint16_t *src, int64_t ld, uint16_t *dst)
{
    __m512i r[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(src + i * ld));
#pragma GCC unroll 4
    for (int st = 0; st < 4; st++) {
        const int b = 8 >> st;
        const __m512i lo = _mm512_loadu_si512((const void *)amx_tr_idx[st][0]);
        const __m512i hi = _mm512_loadu_si512((const void *)amx_tr_idx[st][1]);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            if (!(i & b)) {
                __m512i x = _mm512_permutex2var_epi32(r[i], lo, r[i + b]);
                __m512i y = _mm512_permutex2var_epi32(r[i], hi, r[i + b]);
                r[i] = x;
                r[i + b] = y;
            }
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(dst + i * 32), r[i]);
}
#endif

/* K tile (kb, dc) at Kp + (kb * ndc + dc) * 512: row r holds the pair
 * d = dc * 32 + 2r, 2r + 1 of keys kb * 16 + n, n < 16 (zeros past nj, D). */
static void amx_pack_k(uint16_t *Kp, const uint16_t *K, int64_t ldk, int64_t nj, int64_t njp, int64_t D,
                       int64_t Dq)
{
    const int64_t ndc = Dq / 32;
    for (int64_t kb = 0; kb < njp / 16; kb++)
        for (int64_t dc = 0; dc < ndc; dc++) {
            uint16_t *t = Kp + (kb * ndc + dc) * 512;
#if !defined(FA_EMULATE_AVX512)
            if (kb * 16 + 16 <= nj && dc * 32 + 32 <= D) {
                amx_tr16(K + kb * 16 * ldk + dc * 32, ldk, t);
                continue;
            }
#endif
            for (int r = 0; r < 16; r++)
                for (int n = 0; n < 16; n++) {
                    const int64_t key = kb * 16 + n, d = dc * 32 + 2 * r;
                    const uint16_t *kr = K + key * ldk;
                    t[r * 32 + 2 * n] = key < nj && d < D ? kr[d] : 0;
                    t[r * 32 + 2 * n + 1] = key < nj && d + 1 < D ? kr[d + 1] : 0;
                }
        }
}

/* V tile (kc, cb) at Vp + (kc * ncb + cb) * 512: row r holds, for the columns
 * c = cb * 16 + n, the pair (V[2r][c], V[2r + 1][c]) of keys kc * 32 + 2r, +1. */
static void amx_pack_v(uint16_t *Vp, const uint16_t *V, int64_t ldv, int64_t nj, int64_t njp, int64_t Dv,
                       int64_t Dvq)
{
    const int64_t ncb = Dvq / 16;
#if !defined(FA_EMULATE_AVX512)
    int16_t i0[32], i1[32];
    for (int k = 0; k < 16; k++) {
        i0[2 * k] = (int16_t)k; i0[2 * k + 1] = (int16_t)(32 + k);
        i1[2 * k] = (int16_t)(16 + k); i1[2 * k + 1] = (int16_t)(48 + k);
    }
    const __m512i x0 = _mm512_loadu_si512((const void *)i0), x1 = _mm512_loadu_si512((const void *)i1);
#endif
    for (int64_t kc = 0; kc < njp / 32; kc++)
        for (int r = 0; r < 16; r++) {
            const int64_t key = kc * 32 + 2 * r;
            const uint16_t *v0 = V + key * ldv, *v1 = v0 + ldv;
            int64_t cb = 0;
#if !defined(FA_EMULATE_AVX512)
            if (key + 1 < nj)
                for (; cb * 16 + 32 <= Dv; cb += 2) {
                    __m512i a = _mm512_loadu_si512((const void *)(v0 + cb * 16));
                    __m512i b = _mm512_loadu_si512((const void *)(v1 + cb * 16));
                    _mm512_storeu_si512((void *)(Vp + (kc * ncb + cb) * 512 + r * 32), _mm512_permutex2var_epi16(a, x0, b));
                    _mm512_storeu_si512((void *)(Vp + (kc * ncb + cb + 1) * 512 + r * 32), _mm512_permutex2var_epi16(a, x1, b));
                }
#endif
            for (; cb < ncb; cb++) {
                uint16_t *t = Vp + (kc * ncb + cb) * 512 + r * 32;
                for (int n = 0; n < 16; n++) {
                    const int64_t c = cb * 16 + n;
                    t[2 * n] = key < nj && c < Dv ? v0[c] : 0;
                    t[2 * n + 1] = key + 1 < nj && c < Dv ? v1[c] : 0;
                }
            }
        }
}

#if defined(FA_TILES_VDPBF16)
/* On VDPBF16PS (vdpbf16.h): the same two steps as register-blocked vector
 * products over the same packed operands. */
static inline void amx_qk_step(const uint16_t *Q, const uint16_t *Ql, int64_t Dq, const uint16_t *Kp,
                               const uint16_t *Kpl, int64_t kb, float *S)
{
    const int64_t t = Dq / 32 * 512; /* one key tile's packed K */
    avx512bf16_qk_step(Q, Ql, Dq, Kp + kb * t, Kp + (kb + 1) * t, Kpl ? Kpl + kb * t : NULL,
                       Kpl ? Kpl + (kb + 1) * t : NULL, S + kb * 16, AMX_BN);
}

static inline void amx_pv_step(const uint16_t *P, const uint16_t *Pl, const uint16_t *Vp, const uint16_t *Vpl,
                               int64_t njp, int64_t cb, float *O, int64_t Dvq)
{
    const int64_t ldvc = Dvq / 16 * 512; /* one 32-key chunk of packed V */
    avx512bf16_pv_step(P, Pl, AMX_BN, njp, Vp + cb * 512, Vp + (cb + 1) * 512, Vpl ? Vpl + cb * 512 : NULL,
                       Vpl ? Vpl + (cb + 1) * 512 : NULL, ldvc, O + cb * 16, Dvq);
}
#else
/* The 2x2 block product every tile loop issues: accumulators 0-3 (rows 0-15 / 16-31 by
   columns 0-15 / 16-31) += A tiles 4, 5 times B tiles 6, 7.  A macro, not a function:
   tile numbers must be immediates. */
#if defined(FA_TILES_FP16)
#define AMX_TILE_DP(c, a, b) FA_TILE_DPFP16(c, a, b)
#else
#define AMX_TILE_DP(c, a, b) FA_TILE_DPBF16(c, a, b)
#endif
#define AMX_DP_2X2() \
    do { AMX_TILE_DP(0, 4, 6); AMX_TILE_DP(1, 4, 7); AMX_TILE_DP(2, 5, 6); AMX_TILE_DP(3, 5, 7); } while (0)

/* One step of S[0:32][0:njp] = Q[g0:g0+32] . K^T: the 32 keys of key tiles kb,
 * kb + 1 (2 x 2 C tiles).  With Ql (bf16x3, "high"): S = Qh.Kh^T + Qh.Kl^T +
 * Ql.Kh^T (the lo.lo product, ~2^-16 relative, is left out as in torch's
 * "high"). */
static inline void amx_qk_step(const uint16_t *Q, const uint16_t *Ql, int64_t Dq, const uint16_t *Kp,
                               const uint16_t *Kpl, int64_t kb, float *S)
{
    const int64_t ndc = Dq / 32, ldq = Dq * 2, lds = AMX_BN * 4;
    FA_TILE_ZERO(0); FA_TILE_ZERO(1); FA_TILE_ZERO(2); FA_TILE_ZERO(3);
    for (int64_t dc = 0; dc < ndc; dc++) {
        const int64_t k0 = (kb * ndc + dc) * 512, k1 = ((kb + 1) * ndc + dc) * 512;
        FA_TILE_LOAD(4, Q + dc * 32, ldq);
        FA_TILE_LOAD(5, Q + 16 * Dq + dc * 32, ldq);
        if (Ql) {
            FA_TILE_LOAD(6, Kpl + k0, 64);
            FA_TILE_LOAD(7, Kpl + k1, 64);
            AMX_DP_2X2();
        }
        FA_TILE_LOAD(6, Kp + k0, 64);
        FA_TILE_LOAD(7, Kp + k1, 64);
        AMX_DP_2X2();
        if (Ql) {
            FA_TILE_LOAD(4, Ql + dc * 32, ldq);
            FA_TILE_LOAD(5, Ql + 16 * Dq + dc * 32, ldq);
            AMX_DP_2X2();
        }
    }
    FA_TILE_STORE(0, S + kb * 16, lds);
    FA_TILE_STORE(1, S + kb * 16 + 16, lds);
    FA_TILE_STORE(2, S + 16 * AMX_BN + kb * 16, lds);
    FA_TILE_STORE(3, S + 16 * AMX_BN + kb * 16 + 16, lds);
}

/* One step of O[0:32][0:Dvq] += P[0:32][0:njp] . V: the output columns of
 * column tiles cb, cb + 1.  With Pl (bf16x3): O += Ph.Vh + Ph.Vl + Pl.Vh. */
static inline void amx_pv_step(const uint16_t *P, const uint16_t *Pl, const uint16_t *Vp, const uint16_t *Vpl,
                               int64_t njp, int64_t cb, float *O, int64_t Dvq)
{
    const int64_t ncb = Dvq / 16, ldo = Dvq * 4, ldp = AMX_BN * 2;
    float *o0 = O + cb * 16, *o1 = O + 16 * Dvq + cb * 16;
    FA_TILE_LOAD(0, o0, ldo);
    FA_TILE_LOAD(1, o0 + 16, ldo);
    FA_TILE_LOAD(2, o1, ldo);
    FA_TILE_LOAD(3, o1 + 16, ldo);
    for (int64_t kc = 0; kc < njp / 32; kc++) {
        const int64_t v0 = (kc * ncb + cb) * 512, v1 = (kc * ncb + cb + 1) * 512;
        FA_TILE_LOAD(4, P + kc * 32, ldp);
        FA_TILE_LOAD(5, P + 16 * AMX_BN + kc * 32, ldp);
        if (Pl) {
            FA_TILE_LOAD(6, Vpl + v0, 64);
            FA_TILE_LOAD(7, Vpl + v1, 64);
            AMX_DP_2X2();
        }
        FA_TILE_LOAD(6, Vp + v0, 64);
        FA_TILE_LOAD(7, Vp + v1, 64);
        AMX_DP_2X2();
        if (Pl) {
            FA_TILE_LOAD(4, Pl + kc * 32, ldp);
            FA_TILE_LOAD(5, Pl + 16 * AMX_BN + kc * 32, ldp);
            AMX_DP_2X2();
        }
    }
    FA_TILE_STORE(0, o0, ldo);
    FA_TILE_STORE(1, o0 + 16, ldo);
    FA_TILE_STORE(2, o1, ldo);
    FA_TILE_STORE(3, o1 + 16, ldo);
}

#endif

/* n float32 values x split into bf16 hi = bf16(x) and (when lo) lo = bf16(x - hi),
 * the bf16x3 split (hi + lo carries ~16 mantissa bits); zeros from n to npad.
 * An infinite x has lo = 0 (x - hi would be NaN); NaN stays in hi. */
static void amx_split_row(uint16_t *hi, uint16_t *lo, const float *x, int64_t n, int64_t npad)
{
    int64_t i = 0;
#if !defined(FA_EMULATE_AVX512)
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __m256bh h = _mm512_cvtneps_pbh(v);
        memcpy(hi + i, &h, 32);
        if (lo) {
            __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(hi + i))), 16));
            __m512 d = _mm512_sub_ps(v, hv);
            d = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, d, _CMP_ORD_Q), d);
            __m256bh l = _mm512_cvtneps_pbh(d);
            memcpy(lo + i, &l, 32);
        }
    }
#endif
    for (; i < n; i++) {
        hi[i] = fa_f32_to_bf16(x[i]);
        if (lo) {
            float d = x[i] - fa_bf16_to_f32(hi[i]);
            lo[i] = d == d ? fa_f32_to_bf16(d) : 0;
        }
    }
    for (; i < npad; i++) {
        hi[i] = 0;
        if (lo) lo[i] = 0;
    }
}

/* The tile work that runs while the vector units do one row group's softmax:
 * the next group's Q.K^T and the previous group's P.V, issued one step (a
 * 2 x 2 block of C tiles) at a time from inside the softmax's row loops
 * (amx_pump), so that the tile unit and the vector units work at the same time
 * and the out-of-order window never fills with tile stores waiting on their
 * products.  The buffers never overlap: S and P are double-buffered by group
 * parity, and the softmax rescales only its own group's O rows.  The steps
 * and their arithmetic are the same whatever the interleaving, so the result
 * does not depend on it. */
typedef struct amx_jobs {
    const uint16_t *Q, *Ql, *K, *Kl;  /* next group's Q.K^T into S (nqk steps)   */
    float *S;
    const uint16_t *P, *Pl, *V, *Vl;  /* previous group's P.V into O (npv steps) */
    float *O;
    int64_t Dq, Dvq, njp, nqk, iqk, npv, ipv;
    int64_t every, tick;              /* a step every `every` pump calls          */
} amx_jobs;

/* Round of the pipeline: the Q.K^T of active group aq (-1: none) into S buffer
 * aq & 1, and the P.V of active group ap (-1: none) from P buffer ap & 1
 * (w->act lists the active groups of the key tile; j->njp, Dq, Dvq are set). */
static inline void amx_jobs_round(amx_jobs *j, const amx_ws *w, int x3, int64_t aq, int64_t ap)
{
    j->iqk = j->ipv = j->tick = 0;
    j->nqk = aq >= 0 ? j->njp / 32 : 0;
    j->npv = ap >= 0 ? j->Dvq / 32 : 0;
    if (aq >= 0) {
        j->Q = w->Q + w->act[aq] * AMX_RG * j->Dq;
        j->Ql = x3 ? w->Ql + w->act[aq] * AMX_RG * j->Dq : NULL;
        j->S = w->S + (aq & 1) * AMX_RG * AMX_BN;
    }
    if (ap >= 0) {
        j->P = w->P + (ap & 1) * AMX_RG * AMX_BN;
        j->Pl = x3 ? w->Pl + (ap & 1) * AMX_RG * AMX_BN : NULL;
        j->O = w->O + w->act[ap] * AMX_RG * j->Dvq;
    }
}

/* Issue the next pending step; 0 when none is left. */
static inline int amx_step(amx_jobs *j)
{
    if (j->iqk < j->nqk) { amx_qk_step(j->Q, j->Ql, j->Dq, j->K, j->Kl, 2 * j->iqk++, j->S); return 1; }
    if (j->ipv < j->npv) { amx_pv_step(j->P, j->Pl, j->V, j->Vl, j->njp, 2 * j->ipv++, j->O, j->Dvq); return 1; }
    return 0;
}

/* Called once per row in each of the softmax's two row loops (64 calls per group). */
static inline void amx_pump(amx_jobs *j)
{
    if (++j->tick >= j->every) { j->tick = 0; amx_step(j); }
}

/* amx_softmax for a full tile (AMX_BN keys, no padding) in the common case
 * (see amx_softmax): one pass per row with the row's 8 score vectors held in
 * registers (max, then exp2 of the scaled scores, the sum and P), instead of
 * reading S twice. */
static void amx_softmax_full(const amx_ws *w, int64_t g0, int64_t nr, const float *S, uint16_t *P, uint16_t *Pl,
                             float qscale, int64_t Dvq, amx_jobs *jobs)
{
    enum { NV = AMX_BN / 16 };
    _Static_assert(NV >= 4, "the max below starts from four score vectors");
    const vf ev = vf_set1(qscale);
    for (int64_t r = 0; r < AMX_RG; r++) {
        uint16_t *pr = P + r * AMX_BN, *pl = Pl ? Pl + r * AMX_BN : NULL;
        amx_pump(jobs);
        if (r >= nr) {
            memset(pr, 0, AMX_BN * 2);
            if (pl) memset(pl, 0, AMX_BN * 2);
            continue;
        }
        const int64_t rr = g0 + r;
        const float *s = S + r * AMX_BN;
        vf x[NV];
        for (int k = 0; k < NV; k++) x[k] = vf_load(s + 16 * k);
        vf mx4[4] = {x[0], x[1], x[2], x[3]}; /* four chains: a tree, not a sequence */
        for (int k = 4; k < NV; k++) mx4[k & 3] = vf_max(mx4[k & 3], x[k]);
        vf mv = vf_max(vf_max(mx4[0], mx4[1]), vf_max(mx4[2], mx4[3]));
        const float m1 = vf_hmax(mv) * qscale, mold = w->m[rr];
        float mnew = m1 > mold ? m1 : mold;
        if (m1 != m1) mnew = m1; /* NaN poisons the row */
        if (mnew == -INFINITY) { /* no finite score (infinite inputs): P = 0; NaN poisons l */
            for (int k = 0; k < AMX_BN; k++) if (s[k] != s[k]) w->l[rr] = NAN;
            memset(pr, 0, AMX_BN * 2);
            if (pl) memset(pl, 0, AMX_BN * 2);
            continue;
        }
        if (mnew > mold && mold != -INFINITY) { /* the max grew: rescale this row's O and l */
            /* vf_exp2 of one lane, as amx_softmax's 32 rows at once: libm's
             * exp2 here (about one row in three per tile on random data) was
             * 2-3% of an L1024 call's samples. */
            float a16[16];
            vf_store(a16, vf_exp2(vf_set1(mold - mnew)));
            const float alpha = a16[0];
            float *o = w->O + rr * Dvq;
            const vf av = vf_set1(alpha);
            for (int64_t c = 0; c < Dvq; c += 16) vf_store(o + c, vf_mul(av, vf_load(o + c)));
            w->l[rr] *= alpha;
            float *lv = w->lv + rr * 16;
            vf_store(lv, vf_mul(av, vf_load(lv)));
        }
        if (mnew > mold || mnew != mnew) w->m[rr] = mnew;
        const vf mn = vf_set1(-mnew);
        vf sum0 = vf_zero(), sum1 = vf_zero();
        for (int k = 0; k < NV; k += 2) {
            vf e0 = amx_exp2_neg(vf_fma(x[k], ev, mn));
            vf e1 = amx_exp2_neg(vf_fma(x[k + 1], ev, mn));
            sum0 = vf_add(sum0, e0);
            sum1 = vf_add(sum1, e1);
            amx_store_p16x2(pr + 16 * k, e0, e1);
            if (pl) { /* the low parts: e - bf16(e) */
                vf h0 = vf_load_bf16(pr + 16 * k), h1 = vf_load_bf16(pr + 16 * k + 16);
                amx_store_bf16x2(pl + 16 * k, vf_sub(e0, h0), vf_sub(e1, h1));
            }
        }
        float *lv = w->lv + rr * 16; /* no horizontal sum per tile: lanes summed once, at the end */
        vf_store(lv, vf_add(vf_load(lv), vf_add(sum0, sum1)));
    }
}

/* Scale, masks and the online softmax of row group g over the scores S of
 * keys [jt, jt + nj) (padded to njp): P = exp2(s - m) rounded to bf16, the
 * running max m and sum l (from the fp32 values), O rows rescaled when m grows. */
static void amx_softmax(const fa_params *p, const fa_task *t, const amx_ws *w, int64_t g, int64_t jt, int64_t nj,
                        int64_t njp, float *S, uint16_t *P, uint16_t *Pl, int64_t ni, int64_t delta, int elem_always,
                        int mask_only, int use_log2, float qscale, int64_t R, int64_t Dvq, amx_jobs *jobs)
{
    const int64_t G = p->Hq / p->Hk, b = t->b, g0 = g * AMX_RG, nr = fa_min64(AMX_RG, R - g0);
    const int partial = jt < w->gflo[g] || jt + nj > w->gfhi[g];
    /* The common case (no masks or transforms, every row of the group sees every
     * key of the tile, a positive scale): S keeps the raw products, the max
     * pass only reads them (max(c * s) = c * max(s) for c > 0, rounding being
     * monotonic) and the exp pass applies the scale in its FMA.  Otherwise the
     * max pass writes the scaled, masked scores back to S and the exp pass
     * scales by 1. */
    const int fast = !(elem_always || partial) && qscale > 0.0f;
    if (fast && nj == AMX_BN) {
        jobs->every = fa_max64(1, AMX_RG / (jobs->nqk + jobs->npv + 1)); /* 32 pump calls */
        amx_softmax_full(w, g0, nr, S, P, Pl, qscale, Dvq, jobs);
        return;
    }
    jobs->every = fa_max64(1, 2 * AMX_RG / (jobs->nqk + jobs->npv + 1)); /* 64 pump calls */
    const int64_t nfull = fast ? nj / 16 * 16 : 0; /* vectors read in place by the max pass */
    const float esc = fast ? qscale : 1.0f;
    float mx[AMX_RG], arg[AMX_RG], alpha[AMX_RG];
    for (int64_t r = 0; r < AMX_RG; r++) {
        float *s = S + r * AMX_BN;
        arg[r] = 0;
        amx_pump(jobs);
        if (r >= nr) continue;
        const int64_t rr = g0 + r, lo = w->lo[rr], hi = w->hi[rr];
        vf mv = vf_set1(-INFINITY);
        for (int64_t jj = 0; jj < nfull; jj += 16) mv = vf_max(mv, vf_load(s + jj));
        for (int64_t jj = nfull; jj < njp; jj++) s[jj] = jj < nj ? s[jj] * (fast ? 1.0f : qscale) : -INFINITY;
        if (!fast) {
            const int64_t h = t->hk * G + rr / ni, i = t->i0 + rr % ni, ip = i + delta;
            if (!elem_always || mask_only) { /* the key range, then the attn_mask alone */
                const int64_t a0 = fa_min64(fa_max64(lo - jt, 0), nj), a1 = fa_max64(fa_min64(hi - jt, nj), a0);
                for (int64_t jj = 0; jj < a0; jj++) s[jj] = -INFINITY;
                for (int64_t jj = a1; jj < nj; jj++) s[jj] = -INFINITY;
                if (elem_always)
                    fa_mask_apply_f32(p, s, (const char *)p->mask + (b * p->m_sb + h * p->m_sh + i * p->m_sl + jt * p->m_ss) *
                                      (int64_t)fa_mask_size(p->mask_kind), a0, a1);
            } else {
                const char *mrow = p->mask ? (const char *)p->mask +
                    (b * p->m_sb + h * p->m_sh + i * p->m_sl) * (p->mask_kind == FA_MASK_BOOL ? 1 : p->mask_kind == FA_MASK_F32 ? 4 : 8) : NULL;
                const double slope = p->alibi ? p->alibi[b * p->alibi_sb + h * p->alibi_sh] * AMX_LOG2E : 0.0;
                for (int64_t jj = 0; jj < nj; jj++) {
                    const int64_t j = jt + jj;
                    if (j < lo || j >= hi) { s[jj] = -INFINITY; continue; }
                    double x = s[jj];
                    if (!use_log2) {
                        double y = x / p->softcap;
                        x = (fabs(y) < 1e-6 ? x : p->softcap * tanh(y)) * AMX_LOG2E;
                    }
                    /* A finite logit stays finite (see kernel_impl.h): only -inf/NaN
                     * inputs, a False bool mask and the block mask remove a key. */
                    int fin = x - x == 0.0;
                    if (p->alibi) x -= slope * (double)(ip > j ? ip - j : j - ip);
                    if (mrow) {
                        const int64_t mo = j * p->m_ss;
                        if (p->mask_kind == FA_MASK_BOOL) {
                            if (!((const uint8_t *)mrow)[mo]) { x = -INFINITY; fin = 0; }
                        } else {
                            double mv = p->mask_kind == FA_MASK_F32 ? (double)((const float *)mrow)[mo]
                                                                    : ((const double *)mrow)[mo];
                            if (mv - mv != 0.0) fin = 0;
                            x += mv * AMX_LOG2E;
                        }
                    }
                    if (p->bmask && !fa_bmask_at(p, b, h, i, j)) { x = -INFINITY; fin = 0; }
                    if (fin) {
                        if (x < -3.4028234663852886e38) x = -3.4028234663852886e38;
                        else if (x > 3.4028234663852886e38) x = 3.4028234663852886e38;
                    }
                    s[jj] = (float)x;
                }
            }
        }
        for (int64_t jj = nfull; jj < njp; jj += 16) mv = vf_max(mv, vf_load(s + jj));
        const float m1 = fast ? vf_hmax(mv) * qscale : vf_hmax(mv), mold = w->m[rr];
        float mnew = m1 > mold ? m1 : mold;
        if (m1 != m1) mnew = m1; /* NaN poisons the row */
        mx[r] = mnew;
        if (mnew > mold && mold != -INFINITY) arg[r] = mold - mnew;
    }
    /* ---- the rescale factors of the 32 rows at once (exp2(0) = 1) ---- */
    vf_store(alpha, vf_exp2(vf_load(arg)));
    vf_store(alpha + 16, vf_exp2(vf_load(arg + 16)));
    /* ---- P = exp2(s - m) rounded to bf16; l from the fp32 values ---- */
    for (int64_t r = 0; r < AMX_RG; r++) {
        uint16_t *pr = P + r * AMX_BN;
        uint16_t *pl = Pl ? Pl + r * AMX_BN : NULL;
        amx_pump(jobs);
        if (r >= nr || mx[r] == -INFINITY) {
            if (pl) memset(pl, 0, (size_t)njp * 2);
        }
        if (r >= nr) { memset(pr, 0, (size_t)njp * 2); continue; }
        const int64_t rr = g0 + r;
        const float *s = S + r * AMX_BN;
        const float mnew = mx[r];
        if (mnew == -INFINITY) { /* nothing visible yet; NaN scores still poison the row */
            for (int64_t jj = 0; jj < nj; jj++) if (s[jj] != s[jj]) w->l[rr] = NAN;
            memset(pr, 0, (size_t)njp * 2);
            continue;
        }
        if (alpha[r] != 1.0f) {
            float *o = w->O + rr * Dvq;
            const vf av = vf_set1(alpha[r]);
            for (int64_t c = 0; c < Dvq; c += 16) vf_store(o + c, vf_mul(av, vf_load(o + c)));
            w->l[rr] *= alpha[r];
            vf_store(w->lv + rr * 16, vf_mul(av, vf_load(w->lv + rr * 16)));
        }
        if (mnew > w->m[rr]) w->m[rr] = mnew;
        const vf mn = vf_set1(-mnew), ev = vf_set1(esc);
        vf sum0 = vf_zero(), sum1 = vf_zero();
        for (int64_t jj = 0; jj < njp; jj += 32) {
            vf e0 = amx_exp2_neg(vf_fma(vf_load(s + jj), ev, mn));
            vf e1 = amx_exp2_neg(vf_fma(vf_load(s + jj + 16), ev, mn));
            sum0 = vf_add(sum0, e0);
            sum1 = vf_add(sum1, e1);
            amx_store_p16x2(pr + jj, e0, e1);
            if (pl) { /* the low parts: e - bf16(e) */
                vf h0 = vf_load_bf16(pr + jj), h1 = vf_load_bf16(pr + jj + 16);
                amx_store_bf16x2(pl + jj, vf_sub(e0, h0), vf_sub(e1, h1));
            }
        }
        w->l[rr] += vf_hsum(vf_add(sum0, sum1));
    }
}

/* dst[oo + c] = o[c] * inv (c < Dv) in dtype dt, the product in double as
 * fa_store_elem's scalar form (which the tail and the emulated build use), so
 * both give the same values.  inv = 0 writes zeros (o is finite or NaN only
 * where inv is NaN too). */
static void amx_write_row(void *dst, int dt, int64_t oo, const float *o, double inv, int64_t Dv)
{
    int64_t c = 0;
    if (inv == 0.0) {
        for (; c < Dv; c++) fa_store_elem(dst, dt, oo + c, 0.0);
        return;
    }
#if !defined(FA_EMULATE_AVX512)
    const __m512d iv = _mm512_set1_pd(inv);
    if (dt == FA_F32) {
        float *d = (float *)dst + oo;
        for (; c + 8 <= Dv; c += 8)
            _mm256_storeu_ps(d + c, _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(o + c)), iv)));
    } else if (dt == FA_F16) {
        uint16_t *d = (uint16_t *)dst + oo;
        for (; c + 8 <= Dv; c += 8) {
            __m128i h = _mm256_cvtps_ph(_mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(o + c)), iv)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            memcpy(d + c, &h, 16);
        }
    } else if (dt == FA_BF16) {
        uint16_t *d = (uint16_t *)dst + oo;
        for (; c + 16 <= Dv; c += 16) {
            __m256 x0 = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(o + c)), iv));
            __m256 x1 = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(o + c + 8)), iv));
            amx_store_bf16(d + c, _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(x0)),
                                                                        _mm256_castps_pd(x1), 1)));
        }
    }
#endif
    for (; c < Dv; c++) fa_store_elem(dst, dt, oo + c, o[c] * inv);
}

/* The K (or V) rows of one (batch, kv head): key j's row at base + j * ld
 * bytes, or, paged (fastattn.h), in page bt[j / page] at pool + pg * sb + hsh
 * + (j % page) * ld.  A tile may span pages: its rows are then gathered (the
 * products run on the packed tile, whatever its rows' addresses), so tiles
 * and results are those of the contiguous cache holding the same keys. */
typedef struct amx_rows {
    const char *base;           /* contiguous: key 0's row; paged: the pool */
    const int32_t *bt;          /* paged: this batch's block table row, else NULL */
    int64_t ld, sb, hsh, page;  /* bytes: row and page strides, this head's offset */
} amx_rows;

static amx_rows amx_rows_of(const fa_params *p, const void *x, int64_t sb, int64_t sh, int64_t sl, int64_t b,
                            int64_t hk, int64_t koff, int64_t esz)
{
    amx_rows r;
    r.bt = p->block_table ? p->block_table + b * p->bt_sb : NULL;
    r.base = (const char *)x + (r.bt ? 0 : (b * sb + hk * sh + koff * sl) * esz);
    r.ld = sl * esz;
    r.sb = sb * esz;
    r.hsh = hk * sh * esz;
    r.page = p->page_size;
    return r;
}

static inline const char *amx_row(const amx_rows *r, int64_t j)
{
    if (!r->bt) return r->base + j * r->ld;
    return r->base + r->bt[j / r->page] * r->sb + r->hsh + (j % r->page) * r->ld;
}

/* Row r of a task is query head hk*G + r/ni at position i0 + r%ni (kernel.h). */
static void amx_run(const fa_params *p, const fa_task *t, void *scratch)
{
    const int64_t G = p->Hq / p->Hk, D = p->D, Dv = p->Dv, b = t->b;
    const int64_t Dq = amx_rup(D, 32), Dvq = amx_rup(Dv, 32);
    if (amx_task_on_vectors(p, t)) {
        fa_kernel_f32_avx512.run(p, t, scratch);
        return;
    }
    amx_ws w;
    amx_carve(p, t->rows, scratch, &w);
    const fa_batch bi = fa_batch_info(p, b);
    const int64_t delta = bi.Sb - bi.Lb;
    int64_t ni = fa_min64(t->ni, bi.Lb - t->i0);
    if (ni < 0) ni = 0;
    const int64_t R = G * ni, Rp = amx_rup(R, AMX_RG), NG = Rp / AMX_RG;
    const int use_log2 = p->softcap == 0.0;
    const float qscale = (float)(p->scale * (use_log2 ? AMX_LOG2E : 1.0));
    /* float32 inputs (dispatch.c sends them only at precision "high" or "medium"):
     * rounded to bf16 on the way in; "high" also keeps the low parts (bf16x3). */
    const int f32in = p->q_dtype == FA_F32, x3 = f32in && p->precision == FA_PRECISION_HIGH;
    const int64_t esz = f32in ? 4 : 2;
    const amx_rows kr = amx_rows_of(p, p->k, p->k_sb, p->k_sh, p->k_sl, b, t->hk, bi.koff, esz);
    const amx_rows vr = amx_rows_of(p, p->v, p->v_sb, p->v_sh, p->v_sl, b, t->hk, bi.koff, esz);
    const int elem_always = p->mask_kind != FA_MASK_NONE || p->alibi || !use_log2 || p->bmask;
    /* the attn_mask is the one per-element transform: tiles it hides are
     * skipped, tiles it leaves alone take the unmasked softmax, and the rest
     * apply it branch-free (fa_tile_mask_state, fa_mask_apply_f32: mask.h) */
    const int mask_only = p->mask_kind != FA_MASK_NONE && !p->alibi && use_log2 && !p->bmask;

    /* Queries (bf16, unscaled: the scale is applied to the fp32 scores), the
     * running max / sum, the output accumulator and each row's key range. */
    for (int64_t r = 0; r < Rp; r++) {
        uint16_t *qd = w.Q + r * Dq;
        w.m[r] = -INFINITY;
        w.l[r] = 0;
        memset(w.lv + r * 16, 0, 64);
        if (r >= R) {
            memset(qd, 0, (size_t)Dq * 2);
            if (x3) memset(w.Ql + r * Dq, 0, (size_t)Dq * 2);
            w.lo[r] = w.hi[r] = 0;
            continue;
        }
        const int64_t h = t->hk * G + r / ni, i = t->i0 + r % ni;
        const int64_t qo = b * p->q_sb + h * p->q_sh + (bi.qoff + i) * p->q_sl;
        if (f32in) {
            amx_split_row(qd, x3 ? w.Ql + r * Dq : NULL, (const float *)p->q + qo, D, Dq);
        } else {
            memcpy(qd, (const uint16_t *)p->q + qo, (size_t)D * 2);
            memset(qd + D, 0, (size_t)(Dq - D) * 2);
        }
        fa_row_range(p, i + delta, bi.Sb, &w.lo[r], &w.hi[r]);
        w.lo[r] = fa_max64(w.lo[r], t->j0);
        w.hi[r] = fa_min64(w.hi[r], t->j1);
    }
    memset(w.O, 0, (size_t)(Rp * Dvq) * sizeof(float));
    /* Per group of 32 rows: the keys any row sees [glo, ghi) and all see [gflo, gfhi). */
    int64_t jlo = INT64_MAX, jhi = INT64_MIN;
    for (int64_t g = 0; g < NG; g++) {
        int64_t lo = INT64_MAX, hi = INT64_MIN, flo = INT64_MIN, fhi = INT64_MAX;
        for (int64_t r = g * AMX_RG; r < fa_min64(R, (g + 1) * AMX_RG); r++) {
            if (w.hi[r] <= w.lo[r]) { flo = INT64_MAX; fhi = INT64_MIN; continue; } /* sees nothing */
            lo = fa_min64(lo, w.lo[r]); hi = fa_max64(hi, w.hi[r]);
            flo = fa_max64(flo, w.lo[r]); fhi = fa_min64(fhi, w.hi[r]);
        }
        w.glo[g] = lo; w.ghi[g] = hi; w.gflo[g] = flo; w.gfhi[g] = fhi;
        if (lo < hi) { jlo = fa_min64(jlo, lo); jhi = fa_max64(jhi, hi); }
    }

    fa_tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    int cfg_loaded = 0;

    for (int64_t jt = jlo; jt < jhi; jt += AMX_BN) {
        const int64_t nj = fa_min64(AMX_BN, jhi - jt), njp = amx_rup(nj, 32);
        if (p->bmask) {
            int any = 0;
            for (int64_t g = 0; g < G && !any; g++)
                any = fa_bmask_any(p, b, t->hk * G + g, t->i0, t->i0 + ni, jt, jt + nj);
            if (!any) continue;
        }
        const int mst = mask_only ? fa_tile_mask_state(p, b, t->hk * G, G, t->i0, ni, jt, nj) : FA_TM_MIXED;
        if (mst == FA_TM_HIDDEN) continue;
        const int elem = elem_always && mst != FA_TM_VISIBLE; /* this tile per element */
        int64_t na = 0; /* the row groups that see a key of this tile */
        for (int64_t g = 0; g < NG; g++)
            if (!(w.ghi[g] <= jt || w.glo[g] >= jt + nj || w.glo[g] >= w.ghi[g])) w.act[na++] = g;
        if (na == 0) continue;
        AMX_PT(tp0);
        if (f32in) { /* rows to bf16 (hi, lo) first, then packed like bf16 inputs */
            for (int64_t jj = 0; jj < nj; jj++) {
                amx_split_row(w.Kc + jj * Dq, x3 ? w.Kcl + jj * Dq : NULL, (const float *)amx_row(&kr, jt + jj), D, Dq);
                amx_split_row(w.Vc + jj * Dvq, x3 ? w.Vcl + jj * Dvq : NULL, (const float *)amx_row(&vr, jt + jj), Dv,
                              Dvq);
            }
            amx_pack_k(w.K, w.Kc, Dq, nj, njp, D, Dq);
            amx_pack_v(w.V, w.Vc, Dvq, nj, njp, Dv, Dvq);
            if (x3) {
                amx_pack_k(w.Kl, w.Kcl, Dq, nj, njp, D, Dq);
                amx_pack_v(w.Vl, w.Vcl, Dvq, nj, njp, Dv, Dvq);
            }
        } else if (kr.bt) { /* paged 16-bit rows: gathered into the tile buffers, then packed */
            for (int64_t jj = 0; jj < nj; jj++) {
                memcpy(w.Kc + jj * Dq, amx_row(&kr, jt + jj), (size_t)D * 2);
                memcpy(w.Vc + jj * Dvq, amx_row(&vr, jt + jj), (size_t)Dv * 2);
            }
            amx_pack_k(w.K, w.Kc, Dq, nj, njp, D, Dq);
            amx_pack_v(w.V, w.Vc, Dvq, nj, njp, Dv, Dvq);
        } else {
            amx_pack_k(w.K, (const uint16_t *)kr.base + jt * p->k_sl, p->k_sl, nj, njp, D, Dq);
            amx_pack_v(w.V, (const uint16_t *)vr.base + jt * p->v_sl, p->v_sl, nj, njp, Dv, Dvq);
        }
        AMX_PT(tp1);
        AMX_PADD(0, tp0, tp1);
        if (!cfg_loaded) { FA_TILE_LOADCONFIG(&cfg); cfg_loaded = 1; }
        /* Software pipeline over the active groups a: Q.K^T of group a + 1 and
         * P.V of group a - 1 are interleaved with the softmax of group a (amx_jobs). */
        amx_jobs jb;
        memset(&jb, 0, sizeof(jb));
        jb.Dq = Dq; jb.Dvq = Dvq; jb.njp = njp;
        jb.K = w.K; jb.Kl = x3 ? w.Kl : NULL; jb.V = w.V; jb.Vl = x3 ? w.Vl : NULL;
        AMX_PT(tq0);
        amx_jobs_round(&jb, &w, x3, 0, -1);
        while (amx_step(&jb)) {}
        AMX_PT(tq1);
        AMX_PADD(1, tq0, tq1);
        for (int64_t a = 0; a < na; a++) {
            amx_jobs_round(&jb, &w, x3, a + 1 < na ? a + 1 : -1, a - 1);
            uint16_t *Pl = x3 ? w.Pl + (a & 1) * AMX_RG * AMX_BN : NULL;
            AMX_PT(ta1);
            amx_softmax(p, t, &w, w.act[a], jt, nj, njp, w.S + (a & 1) * AMX_RG * AMX_BN,
                        w.P + (a & 1) * AMX_RG * AMX_BN, Pl, ni, delta, elem, mask_only, use_log2, qscale, R, Dvq, &jb);
            AMX_PT(ta2);
            while (amx_step(&jb)) {}
            AMX_PT(ta3);
            AMX_PADD(2, ta1, ta2);
            AMX_PADD(3, ta2, ta3);
        }
        amx_jobs_round(&jb, &w, x3, -1, na - 1);
        while (amx_step(&jb)) {}
    }
    if (cfg_loaded) FA_TILE_RELEASE();

    /* ---- normalise once and write (rows past L_b: zeros, LSE -inf), as kernel_impl.h ---- */
    for (int64_t r = 0; r < G * t->ni; r++) {
        const int64_t g = r / t->ni, ii = r % t->ni, h = t->hk * G + g, i = t->i0 + ii;
        if (p->cu_q && i >= bi.Lb) continue; /* packed varlen: the row belongs to the next sequence */
        const int64_t ra = g * ni + ii;
        double mm = -INFINITY, ll = 0.0, f = 0.0;
        const int valid = ii < ni;
        if (valid) {
            mm = w.m[ra];
            ll = w.l[ra] + vf_hsum(vf_load(w.lv + ra * 16));
            f = 1.0;
            if (p->sinks && !t->part_o) { /* split parts: the merge adds the sink once */
                double sk = p->sinks[h] * AMX_LOG2E, M = mm > sk ? mm : sk;
                f = mm == -INFINITY ? 0.0 : exp2(mm - M);
                ll = ll * f + exp2(sk - M);
                mm = M;
            }
        }
        double lse = 0.0;
        if (t->part_o || p->lse)
            lse = ll != ll ? NAN : (mm == -INFINITY || ll == 0.0) ? -INFINITY : (mm + log2(ll)) * AMX_LN2;
        const double inv = ll != ll ? NAN : (valid && mm != -INFINITY && ll > 0.0) ? f / ll : 0.0;
        const float *o = w.O + ra * Dvq;
        if (t->part_o) {
            float *dst = (float *)t->part_o + r * Dv;
            const float s = (float)inv;
            for (int64_t c = 0; c < Dv; c++) dst[c] = valid ? o[c] * s : 0.0f;
            ((float *)t->part_lse)[r] = (float)lse;
        } else {
            const int64_t oo = b * p->o_sb + h * p->o_sh + (bi.qoff + i) * p->o_sl;
            amx_write_row(p->o, p->o_dtype, oo, o, valid ? inv : 0.0, Dv);
            if (p->lse)
                fa_store_elem(p->lse, FA_F32, b * p->lse_sb + h * p->lse_sh + (bi.qoff + i) * p->lse_sl, lse);
        }
    }
}

/* Tasks of consecutive kv heads (kernel.h run_heads; attention.c gives it the
 * decode rows of a packed varlen call): the vector kernel's run_heads where
 * every one of them is the vector kernel's (amx_task_on_vectors), else one
 * by one.  part is this kernel's scratch_bytes rounded up, at least the
 * vector kernel's. */
static void amx_run_heads(const fa_params *p, const fa_task *t, int64_t n, int64_t stride, void *scratch, size_t part)
{
    int vec = 1;
    for (int64_t h = 0; h < n; h++) vec &= amx_task_on_vectors(p, &t[h * stride]);
    if (vec) {
        fa_kernel_f32_avx512.run_heads(p, t, n, stride, scratch, part);
        return;
    }
    for (int64_t h = 0; h < n; h++) amx_run(p, &t[h * stride], (char *)scratch + (size_t)h * part);
}

/* rows_max: 512 rows (measured: 1024 gave +6% on L2048/L4096 causal but cost L1024
 * 38% through the key split it forces; see the notes of AMX_BMR). */
const fa_kernel AMX_KERNEL = { amx_scratch_bytes, amx_run, AMX_BMR, AMX_BMR_SHORT, AMX_BN, AMX_BMR, AMX_RG, amx_row_bytes, FA_BAND_PLAIN, 0, NULL, amx_run_heads };
