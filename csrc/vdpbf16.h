/* vdpbf16.h: the two products of kernel_bf16_amx.c (S = Q.K^T and O += P.V of
 * one 32-row group, 32 columns at a time) on AVX512-BF16 vectors, for CPUs with
 * VDPBF16PS and no AMX (Zen 4/5, Cooper Lake): kernel_bf16_avx512bf16.c
 * compiles the AMX kernel's source with FA_TILES_VDPBF16, and its amx_qk_step /
 * amx_pv_step call avx512bf16_qk_step / avx512bf16_pv_step here.  The operands
 * are the AMX kernel's: K packed into the tiles' B layout, V into VNNI pairs,
 * so that one 64-byte row of a packed tile is one VDPBF16PS operand (16 lanes x
 * a bf16 pair), and Q / P rows whose 32-bit pairs are broadcast.
 *
 * Register blocking (BLIS-style: the micro-tile from the register file, the
 * accumulators never leave registers over the reduction): a micro-tile of
 * AVX512BF16_MR = 8 rows x 2 vectors (32 columns) is 16 zmm accumulators, plus
 * the 2 operand rows of the current pair; per pair, 2 vector loads and 16
 * VDPBF16PS whose broadcast operand is folded into the instruction ({1to16}).
 * Measured on Zen 4 (this file's target; rdtsc loop, 12 independent chains):
 * VDPBF16PS zmm with a broadcast memory operand issues one per cycle, as a zmm
 * FMA does, so each does twice an FMA's products.  8 rows keep the loads at
 * 10 per 16 products (3 load ports) and leave registers for the addresses; the
 * emulated-tile form this replaces kept 16 accumulators in memory and issued a
 * separate broadcast per product (1.0-1.36x the fp32 kernel on Zen 4, was).
 *
 * Arithmetic order, per output element: the pairs of the reduction in
 * increasing order, in chunks of 16 pairs (one tile row of K or V); with the
 * bf16x3 low parts (precision "high"), per chunk hi.lo, hi.hi, lo.hi, as the
 * tile form issued them.  VDPBF16PS adds, per lane, the odd product and then
 * the even one, each addition rounded to nearest even (the product of two
 * bf16 is exact in fp32), with DAZ/FTZ: so the sums are not the real AMX
 * unit's, but they are fixed, the same for every thread count.  Checked on a
 * Zen 4 (2026-12-02): the instruction and the emulation below agree on every
 * bit of 3.2 million random lanes (2^-10 .. 2^20 magnitudes).
 *
 * Every function here that can hold a zmm register is named *avx512bf16*
 * (tools/test_wheel.sh checks that only AVX-named functions use them).
 *
 * FA_EMULATE_AVX512BF16 (a TEST-ONLY build, setup.py FASTATTN_EMULATE_AVX512BF16=1,
 * tools/emulate_avx512bf16.sh): VDPBF16PS in scalar C with exactly those
 * semantics, so that the same source runs and is tested on AVX2 machines and
 * gives the same values as the real path (also used in every emulated AVX-512
 * build, where __m512 is not the real register). */
#ifndef FA_VDPBF16_H
#define FA_VDPBF16_H

#include <stdint.h>
#include <string.h>
#include "convert.h"

#ifndef FA_TILECFG_DEFINED
#define FA_TILECFG_DEFINED
/* The 64-byte operand of ldtilecfg (palette 1); kept so that the kernel's
 * source is the AMX one (nothing here reads it). */
typedef struct fa_tilecfg {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} fa_tilecfg;
#endif
#define FA_TILE_LOADCONFIG(cfg) ((void)(cfg))
#define FA_TILE_RELEASE() ((void)0)

#define AVX512BF16_MR 8 /* rows per micro-tile (see above) */

#if defined(FA_EMULATE_AVX512BF16) || defined(FA_EMULATE_AVX512)
/* (Also in any emulated AVX-512 build: the kernel's vectors are AVX2 pairs there.)
 * acc[j] += a[2j+1] * b[2j+1], then += a[2j] * b[2j] (j < 16), each addition
 * rounded once: VDPBF16PS.  volatile keeps the compiler from contracting the
 * product and the addition into an FMA or reassociating. */
static inline void fa_emu_vdpbf16ps(float *acc, const uint16_t *a, const uint16_t *b)
{
    for (int j = 0; j < 16; j++) {
        volatile float p1 = fa_bf16_to_f32(a[2 * j + 1]) * fa_bf16_to_f32(b[2 * j + 1]);
        volatile float s = acc[j] + p1;
        volatile float p0 = fa_bf16_to_f32(a[2 * j]) * fa_bf16_to_f32(b[2 * j]);
        acc[j] = s + p0;
    }
}
typedef const uint16_t *avx512bf16_vb; /* an operand row: its address */
static inline avx512bf16_vb avx512bf16_loadb(const uint16_t *p) { return p; }
/* acc + VDPBF16PS(b, broadcast of the pair at a2) */
static inline vf avx512bf16_dp(vf acc, avx512bf16_vb b, const uint16_t *a2)
{
    float t[16];
    uint16_t pair[32];
    for (int j = 0; j < 16; j++) { pair[2 * j] = a2[0]; pair[2 * j + 1] = a2[1]; }
    vf_store(t, acc);
    fa_emu_vdpbf16ps(t, pair, b);
    return vf_load(t);
}
#else
#include <immintrin.h>
typedef __m512bh avx512bf16_vb;
static inline avx512bf16_vb avx512bf16_loadb(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline vf avx512bf16_dp(vf acc, avx512bf16_vb b, const uint16_t *a2)
{
    int32_t w;
    memcpy(&w, a2, 4);
    return _mm512_dpbf16_ps(acc, b, (__m512bh)_mm512_set1_epi32(w)); /* folds to {1to16} */
}
#endif

/* acc[r][0..1] += sum over the 16 pairs k of chunk: A[r] pair k (at A + r * lda
 * + 2k) times operand rows B0 + 32k, B1 + 32k, for the MR rows of a micro-tile. */
static inline __attribute__((always_inline)) void avx512bf16_chunk(vf acc[AVX512BF16_MR][2], const uint16_t *A,
                                                                   int64_t lda, const uint16_t *B0,
                                                                   const uint16_t *B1)
{
#pragma GCC unroll 2
    for (int k = 0; k < 16; k++) {
        const avx512bf16_vb b0 = avx512bf16_loadb(B0 + 32 * k), b1 = avx512bf16_loadb(B1 + 32 * k);
#pragma GCC unroll 8
        for (int r = 0; r < AVX512BF16_MR; r++) {
            acc[r][0] = avx512bf16_dp(acc[r][0], b0, A + r * lda + 2 * k);
            acc[r][1] = avx512bf16_dp(acc[r][1], b1, A + r * lda + 2 * k);
        }
    }
}

/* S[0:32][0:32] (row stride lds floats) = Q[0:32] . K^T of two packed key tiles
 * K0, K1 (16 keys each; pair p of d at K + 32p), over Dq/2 pairs; Q rows of Dq
 * bf16.  With Ql/K0l/K1l (bf16x3): + Qh.Kl + Ql.Kh. */
static void avx512bf16_qk_step(const uint16_t *Q, const uint16_t *Ql, int64_t Dq, const uint16_t *K0,
                               const uint16_t *K1, const uint16_t *K0l, const uint16_t *K1l, float *S,
                               int64_t lds)
{
    for (int64_t r0 = 0; r0 < 32; r0 += AVX512BF16_MR) {
        vf acc[AVX512BF16_MR][2];
        for (int r = 0; r < AVX512BF16_MR; r++) acc[r][0] = acc[r][1] = vf_zero();
        const uint16_t *q = Q + r0 * Dq, *ql = Ql ? Ql + r0 * Dq : NULL;
        for (int64_t dc = 0; dc < Dq / 32; dc++) {
            const int64_t o = dc * 512;
            if (ql) avx512bf16_chunk(acc, q + dc * 32, Dq, K0l + o, K1l + o);
            avx512bf16_chunk(acc, q + dc * 32, Dq, K0 + o, K1 + o);
            if (ql) avx512bf16_chunk(acc, ql + dc * 32, Dq, K0 + o, K1 + o);
        }
        for (int r = 0; r < AVX512BF16_MR; r++) {
            vf_store(S + (r0 + r) * lds, acc[r][0]);
            vf_store(S + (r0 + r) * lds + 16, acc[r][1]);
        }
    }
}

/* O[0:32][0:32] (row stride ldo floats) += P[0:32][0:njp] . V for two column
 * tiles of packed V: the 16 pairs of key chunk kc at V0 + kc * ldvc (and V1).
 * P rows of ldp bf16.  With Pl/V0l/V1l (bf16x3): + Ph.Vl + Pl.Vh. */
static void avx512bf16_pv_step(const uint16_t *P, const uint16_t *Pl, int64_t ldp, int64_t njp, const uint16_t *V0,
                               const uint16_t *V1, const uint16_t *V0l, const uint16_t *V1l, int64_t ldvc,
                               float *O, int64_t ldo)
{
    for (int64_t r0 = 0; r0 < 32; r0 += AVX512BF16_MR) {
        vf acc[AVX512BF16_MR][2];
        float *o = O + r0 * ldo;
        for (int r = 0; r < AVX512BF16_MR; r++) {
            acc[r][0] = vf_load(o + r * ldo);
            acc[r][1] = vf_load(o + r * ldo + 16);
        }
        const uint16_t *pp = P + r0 * ldp, *pl = Pl ? Pl + r0 * ldp : NULL;
        for (int64_t kc = 0; kc < njp / 32; kc++) {
            const int64_t v = kc * ldvc;
            if (pl) avx512bf16_chunk(acc, pp + kc * 32, ldp, V0l + v, V1l + v);
            avx512bf16_chunk(acc, pp + kc * 32, ldp, V0 + v, V1 + v);
            if (pl) avx512bf16_chunk(acc, pl + kc * 32, ldp, V0 + v, V1 + v);
        }
        for (int r = 0; r < AVX512BF16_MR; r++) {
            vf_store(o + r * ldo, acc[r][0]);
            vf_store(o + r * ldo + 16, acc[r][1]);
        }
    }
}

#endif
