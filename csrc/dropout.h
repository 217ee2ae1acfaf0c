/* dropout.h: the attention dropout mask (fa_params.dropout_*), one
 * definition for the forward kernel, the backward and the documentation.
 *
 * Entry (b, h, i, j) of the (batch, query head, query position, key position)
 * grid takes the 32-bit word u = lane j mod 8 of Philox-4x64-10 (Salmon et
 * al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) of the counter
 * (j / 8, i, h, b) under the key (seed, 0), lane t being the low (t even) or
 * high (t odd) half of the output word t / 2.  It is kept when
 * u >= thr = round(p * 2^32).  So the mask is a pure function of the seed and
 * the coordinates: the backward regenerates the forward's mask without
 * storing it, and no thread count, tile size or ISA changes it.  NumPy's
 * Philox bit generator computes the same function (its counter is
 * incremented before each block: fastattn.reference.dropout_keep). */
#ifndef FA_DROPOUT_H
#define FA_DROPOUT_H

#include <stdint.h>

/* The Philox-4x64 round constants (Random123's multipliers and Weyl key
 * increments). */
#define FA_PHILOX_M0 0xD2E7470EE14C6C93ULL
#define FA_PHILOX_M1 0xCA5A826395121157ULL
#define FA_PHILOX_W0 0x9E3779B97F4A7C15ULL
#define FA_PHILOX_W1 0xBB67AE8584CAA73BULL

/* a * b: the low word returned, the high one in *hi. */
static inline uint64_t fa_mulhilo64(uint64_t a, uint64_t b, uint64_t *hi)
{
#if defined(__SIZEOF_INT128__)
    const unsigned __int128 r = (unsigned __int128)a * b;
    *hi = (uint64_t)(r >> 64);
    return (uint64_t)r;
#else
    const uint64_t al = a & 0xffffffffu, ah = a >> 32, bl = b & 0xffffffffu, bh = b >> 32;
    const uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    const uint64_t mid = (ll >> 32) + (lh & 0xffffffffu) + (hl & 0xffffffffu);
    *hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
    return (mid << 32) | (ll & 0xffffffffu);
#endif
}

/* Philox-4x64 with 10 rounds of the counter c (in place) under the key (k0, k1). */
static inline void fa_philox4x64_10(uint64_t c[4], uint64_t k0, uint64_t k1)
{
    for (int r = 0; r < 10; r++) {
        if (r) { k0 += FA_PHILOX_W0; k1 += FA_PHILOX_W1; }
        uint64_t hi0, hi1;
        const uint64_t lo0 = fa_mulhilo64(FA_PHILOX_M0, c[0], &hi0);
        const uint64_t lo1 = fa_mulhilo64(FA_PHILOX_M1, c[2], &hi1);
        const uint64_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
}

/* round(p * 2^32) for 0 <= p <= 1: a word u is kept when u >= it (so p = 0
 * keeps everything and p = 1, 2^32, nothing). */
static inline uint64_t fa_dropout_threshold(double p)
{
    return (uint64_t)(p * 4294967296.0 + 0.5);
}

/* The multipliers of keys [j0, j0 + n) of row (b, h, i): keep_scale where the
 * entry is kept, 0 where it is dropped, as float (z32) or double (z64, when
 * not NULL).  One Philox block per 8 keys. */
static inline void fa_dropout_row(uint64_t seed, uint64_t thr, double keep_scale, int64_t b, int64_t h, int64_t i,
                                  int64_t j0, int64_t n, float *z32, double *z64)
{
    for (int64_t j = j0, e = j0 + n; j < e;) {
        uint64_t c[4] = { (uint64_t)j >> 3, (uint64_t)i, (uint64_t)h, (uint64_t)b };
        fa_philox4x64_10(c, seed, 0);
        for (const int64_t be = ((j >> 3) + 1) << 3; j < e && j < be; j++) {
            const int t = (int)(j & 7);
            const uint64_t u = (c[t >> 1] >> (32 * (t & 1))) & 0xffffffffu;
            const double z = u >= thr ? keep_scale : 0.0;
            if (z64) z64[j - j0] = z;
            else z32[j - j0] = (float)z;
        }
    }
}

/* 1 / (1 - p), the kept entries' factor (0 when p = 1: nothing is kept). */
static inline double fa_dropout_keep_scale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

#endif
