/* amx_emu.h: the tile layer of kernel_bf16_amx.c.  FA_TILE_* name the AMX
 * instructions the kernel uses (ldtilecfg, tileloadd, tilestored, tilezero,
 * tdpbf16ps, tdpfp16ps for kernel_f16_amx.c, plus tilerelease).  Normally they are the compiler's intrinsics;
 * with FA_EMULATE_AMX (a TEST-ONLY build, setup.py FASTATTN_EMULATE_AMX=1,
 * tools/emulate_amx.sh) they are scalar C over eight thread-local tile
 * registers, so that the same kernel source (tile shapes, VNNI packing, edge
 * padding) runs and is tested on CPUs without AMX.
 *
 * Emulated semantics follow the instruction reference: a tile is rows x colsb
 * bytes (the rest of its 16 x 64 bytes reads as zero); TDPBF16PS adds, for
 * each pair k of the K dimension, A[m][2k] * B[k][2n] then A[m][2k+1] * B[k][2n+1]
 * to the fp32 C[m][n], each product of two bfloat16 exact in fp32 and each
 * addition rounded once (round to nearest even; the kernel runs with FTZ/DAZ
 * set, which the real instruction also implies). */
#ifndef FA_AMX_EMU_H
#define FA_AMX_EMU_H

#include <stdint.h>
#include <string.h>

#ifndef FA_TILECFG_DEFINED
#define FA_TILECFG_DEFINED
/* The 64-byte operand of ldtilecfg (palette 1). */
typedef struct fa_tilecfg {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} fa_tilecfg;
#endif

#if defined(FA_EMULATE_AMX)
#include "convert.h"

typedef struct fa_emu_amx_state {
    uint8_t t[8][16][64];
    fa_tilecfg cfg;
} fa_emu_amx_state;
static _Thread_local fa_emu_amx_state fa_emu_amx;

static inline void fa_emu_ldtilecfg(const void *cfg)
{
    memcpy(&fa_emu_amx.cfg, cfg, sizeof(fa_tilecfg));
    memset(fa_emu_amx.t, 0, sizeof(fa_emu_amx.t)); /* ldtilecfg zeroes the tiles */
}

static inline void fa_emu_tilerelease(void) { memset(&fa_emu_amx, 0, sizeof(fa_emu_amx)); }

static inline void fa_emu_tilezero(int t) { memset(fa_emu_amx.t[t], 0, sizeof(fa_emu_amx.t[t])); }

static inline void fa_emu_tileloadd(int t, const void *base, long stride)
{
    const int rows = fa_emu_amx.cfg.rows[t], colsb = fa_emu_amx.cfg.colsb[t];
    memset(fa_emu_amx.t[t], 0, sizeof(fa_emu_amx.t[t]));
    for (int r = 0; r < rows; r++) memcpy(fa_emu_amx.t[t][r], (const char *)base + (long)r * stride, (size_t)colsb);
}

static inline void fa_emu_tilestored(int t, void *base, long stride)
{
    const int rows = fa_emu_amx.cfg.rows[t], colsb = fa_emu_amx.cfg.colsb[t];
    for (int r = 0; r < rows; r++) memcpy((char *)base + (long)r * stride, fa_emu_amx.t[t][r], (size_t)colsb);
}

/* Element i of a tile row of 16-bit values: bfloat16, or float16 (f16). */
static inline float fa_emu_p16_at(const uint8_t *row, int i, int f16)
{
    uint16_t h;
    memcpy(&h, row + 2 * i, 2);
    return f16 ? fa_f16_to_f32(h) : fa_bf16_to_f32(h);
}

/* TDPBF16PS, or with f16 TDPFP16PS (AMX-FP16: the same pairs of float16
 * elements, each product exact in fp32, subnormal inputs included). */
static inline void fa_emu_tdp16ps(int c, int a, int b, int f16)
{
    const int M = fa_emu_amx.cfg.rows[c], N = fa_emu_amx.cfg.colsb[c] / 4, K = fa_emu_amx.cfg.colsb[a] / 4;
    for (int m = 0; m < M; m++) {
        float acc[16];
        memcpy(acc, fa_emu_amx.t[c][m], sizeof(acc));
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) {
                volatile float p0 = fa_emu_p16_at(fa_emu_amx.t[a][m], 2 * k, f16) *
                                    fa_emu_p16_at(fa_emu_amx.t[b][k], 2 * n, f16);
                acc[n] = acc[n] + p0;
                volatile float p1 = fa_emu_p16_at(fa_emu_amx.t[a][m], 2 * k + 1, f16) *
                                    fa_emu_p16_at(fa_emu_amx.t[b][k], 2 * n + 1, f16);
                acc[n] = acc[n] + p1;
            }
        memset(fa_emu_amx.t[c][m], 0, 64);
        memcpy(fa_emu_amx.t[c][m], acc, (size_t)N * 4);
    }
}

#define FA_TILE_LOADCONFIG(cfg) fa_emu_ldtilecfg(cfg)
#define FA_TILE_RELEASE() fa_emu_tilerelease()
#define FA_TILE_ZERO(t) fa_emu_tilezero(t)
#define FA_TILE_LOAD(t, base, stride) fa_emu_tileloadd((t), (base), (long)(stride))
#define FA_TILE_STORE(t, base, stride) fa_emu_tilestored((t), (base), (long)(stride))
#define FA_TILE_DPBF16(c, a, b) fa_emu_tdp16ps((c), (a), (b), 0)
#define FA_TILE_DPFP16(c, a, b) fa_emu_tdp16ps((c), (a), (b), 1)

#else
#include <immintrin.h>
/* The compiler's tileloadd (and ldtilecfg) asm names no memory operand beyond a
 * pointer: a compiler barrier first, so that the stores which filled the
 * buffer (packed K/V, P) are not moved after the load. */
#define FA_TILE_BARRIER() __asm__ volatile("" ::: "memory")
#define FA_TILE_LOADCONFIG(cfg) do { FA_TILE_BARRIER(); _tile_loadconfig(cfg); } while (0)
#define FA_TILE_RELEASE() _tile_release()
#define FA_TILE_ZERO(t) _tile_zero(t)
#define FA_TILE_LOAD(t, base, stride) do { FA_TILE_BARRIER(); _tile_loadd(t, base, stride); FA_TILE_BARRIER(); } while (0)
#define FA_TILE_STORE(t, base, stride) do { _tile_stored(t, base, stride); FA_TILE_BARRIER(); } while (0)
#define FA_TILE_DPBF16(c, a, b) _tile_dpbf16ps(c, a, b)
/* TDPFP16PS by its mnemonic (GCC < 13 has no -mamx-fp16 intrinsic; the
 * assembler knows it: binutils >= 2.38).  Operands as _tile_dpbf16ps: c += a.b,
 * in AT&T order b, a, c; c, a, b are literal tile numbers. */
#define FA_TILE_DPFP16(c, a, b) __asm__ volatile("tdpfp16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#endif

#endif
