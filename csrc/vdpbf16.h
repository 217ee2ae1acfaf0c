/* vdpbf16.h: the tile layer of kernel_amx.c on AVX512-BF16 vectors, for CPUs
 * with VDPBF16PS and no AMX (Zen 4/5, Cooper Lake): kernel_avx512bf16.c
 * compiles the AMX kernel's source with FA_TILES_VDPBF16, and the FA_TILE_*
 * operations it issues (always full 16 x 64-byte tiles, accumulators in tiles
 * 0-3, operands in tiles 4-7: AMX_DP_2X2) run here:
 *   - an accumulator tile (0-3) is 16 x 16 fp32 in thread-local memory
 *     (tileloadd / tilestored copy it, tilezero clears it);
 *   - an operand tile (4-7) is only a pointer and a row stride: the kernel
 *     never writes a buffer between loading it into a tile and the products
 *     that read it (packed K/V, Q, P stay put for the whole step);
 *   - TDPBF16PS C += A.B is, for each row m of C and each pair k of the K
 *     dimension, C[m][0:16] += VDPBF16PS(broadcast(A[m] pair k), B[k]): 256
 *     VDPBF16PS per tile product, all 16 rows at once (16 independent
 *     accumulators cover the instruction's latency), B's rows loaded once.
 * VDPBF16PS adds, per lane, the odd product and then the even one, each
 * addition rounded to nearest even (the products of two bf16 are exact in
 * fp32), with DAZ/FTZ; k runs upwards.  So the sums are not the real AMX
 * unit's: this path has its own (fixed) rounding order, the same for every
 * thread count.
 *
 * Every function here that can hold a zmm register is named *avx512bf16*
 * (tools/test_wheel.sh checks that only AVX-named functions use them).
 *
 * FA_EMULATE_AVX512BF16 (a TEST-ONLY build, setup.py FASTATTN_EMULATE_AVX512BF16=1,
 * tools/emulate_avx512bf16.sh): VDPBF16PS in scalar C with exactly those
 * semantics (odd product first, each addition rounded; checked against the
 * instruction on a CPU that has it), so that the same source runs and is
 * tested on AVX2 machines and gives the same values as the real path (also used
 * in every emulated AVX-512 build, where __m512 is not the real register). */
#ifndef FA_VDPBF16_H
#define FA_VDPBF16_H

#include <stdint.h>
#include <string.h>
#include "convert.h"

#ifndef FA_TILECFG_DEFINED
#define FA_TILECFG_DEFINED
/* The 64-byte operand of ldtilecfg (palette 1); kept so that the kernel's
 * source is the AMX one (its contents are not needed here: every tile is full). */
typedef struct fa_tilecfg {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} fa_tilecfg;
#endif

typedef struct fa_avx512bf16_tiles {
    float acc[4][16][16];      /* accumulator tiles 0-3                    */
    const char *ptr[8];        /* operand tiles 4-7: first row, row stride */
    long ld[8];
} fa_avx512bf16_tiles;
static _Thread_local fa_avx512bf16_tiles fa_avx512bf16_tile;

static inline void fa_avx512bf16_tileload(int t, const void *base, long stride)
{
    if (t < 4) {
        for (int r = 0; r < 16; r++) memcpy(fa_avx512bf16_tile.acc[t][r], (const char *)base + (long)r * stride, 64);
    } else {
        fa_avx512bf16_tile.ptr[t] = (const char *)base;
        fa_avx512bf16_tile.ld[t] = stride;
    }
}

static inline void fa_avx512bf16_tilestore(int t, void *base, long stride)
{
    for (int r = 0; r < 16; r++) memcpy((char *)base + (long)r * stride, fa_avx512bf16_tile.acc[t][r], 64);
}

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

static inline void fa_avx512bf16_tdp(int c, int a, int b)
{
    const char *A = fa_avx512bf16_tile.ptr[a], *B = fa_avx512bf16_tile.ptr[b];
    const long lda = fa_avx512bf16_tile.ld[a], ldb = fa_avx512bf16_tile.ld[b];
    for (int m = 0; m < 16; m++)
        for (int k = 0; k < 16; k++) {
            uint16_t pair[32];
            for (int j = 0; j < 16; j++) memcpy(pair + 2 * j, A + (long)m * lda + 4 * k, 4); /* broadcast */
            fa_emu_vdpbf16ps(fa_avx512bf16_tile.acc[c][m], pair, (const uint16_t *)(B + (long)k * ldb));
        }
}
#else
#include <immintrin.h>
static inline void fa_avx512bf16_tdp(int c, int a, int b)
{
    const char *A = fa_avx512bf16_tile.ptr[a], *B = fa_avx512bf16_tile.ptr[b];
    const long lda = fa_avx512bf16_tile.ld[a], ldb = fa_avx512bf16_tile.ld[b];
    /* All 16 rows at once: 16 independent accumulator chains (the instruction's
     * latency times its throughput), B's row k loaded once per k. */
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_loadu_ps(fa_avx512bf16_tile.acc[c][i]);
    for (int k = 0; k < 16; k++) {
        const __m512bh bk = (__m512bh)_mm512_loadu_si512((const void *)(B + (long)k * ldb));
        for (int i = 0; i < 16; i++) {
            int32_t w;
            memcpy(&w, A + (long)i * lda + 4 * k, 4);
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(w), bk);
        }
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(fa_avx512bf16_tile.acc[c][i], acc[i]);
}
#endif

#define FA_TILE_LOADCONFIG(cfg) ((void)(cfg))
#define FA_TILE_RELEASE() ((void)0)
#define FA_TILE_ZERO(t) memset(fa_avx512bf16_tile.acc[t], 0, sizeof(fa_avx512bf16_tile.acc[t]))
#define FA_TILE_LOAD(t, base, stride) fa_avx512bf16_tileload((t), (base), (long)(stride))
#define FA_TILE_STORE(t, base, stride) fa_avx512bf16_tilestore((t), (base), (long)(stride))
#define FA_TILE_DPBF16(c, a, b) fa_avx512bf16_tdp((c), (a), (b))

#endif
