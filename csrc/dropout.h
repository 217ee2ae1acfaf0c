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
 * incremented before each block: fastattn.reference.dropout_mask). */
#ifndef FA_DROPOUT_H
#define FA_DROPOUT_H

#include <stdint.h>
#include <string.h>

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

/* round(p * 2^32) for 0 <= p <= 1: a word u is kept when u >= it (so p = 0
 * keeps everything and p = 1, 2^32, nothing). */
static inline uint64_t fa_dropout_threshold(double p)
{
    return (uint64_t)(p * 4294967296.0 + 0.5);
}

/* The factor of kept entries: 1 / (1 - p); 0 when the threshold is 2^32
 * (nothing is kept), so that the kernels may compare 32-bit words with the
 * threshold clamped to 2^32 - 1 (fa_dropout_thr32): the one word it then
 * keeps is multiplied by 0. */
static inline double fa_dropout_keep_scale(double p)
{
    return fa_dropout_threshold(p) > 0xffffffffu ? 0.0 : 1.0 / (1.0 - p);
}

static inline uint32_t fa_dropout_thr32(double p)
{
    const uint64_t t = fa_dropout_threshold(p);
    return t > 0xffffffffu ? 0xffffffffu : (uint32_t)t;
}

/* The kernels compare words as signed 32-bit integers after flipping their
 * sign bits (u >= thr exactly when FA_DROP_FLIP(u) >= FA_DROP_FLIP(thr)):
 * GCC vectorises that select into a compare and a blend, where the unsigned
 * comparison became a branch on random bits (Zen 3, 64 keys: 0.15 ns a key
 * against 1.4 ns, most of it mispredictions). */
#define FA_DROP_FLIP(u) ((int32_t)((u) ^ 0x80000000u))

/* The words of row (b, h, i) for the keys [j0 & ~7, (j0 + n + 7) & ~7): one
 * Philox block per 8 keys, u holding fa_dropout_words_len(j0, n) <= n + 14
 * words; key j's word is u[j - (j0 & ~7)].  (One block at a time: the
 * out-of-order core overlaps the blocks' multiply chains by itself; computing
 * 2-8 blocks side by side measured no faster on Zen 3.) */
static inline int64_t fa_dropout_words_len(int64_t j0, int64_t n) { return (((j0 & 7) + n + 7) >> 3) * 8; }

static inline void fa_dropout_words(uint64_t seed, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
                                    uint32_t *u)
{
    const int64_t nb = ((j0 & 7) + n + 7) >> 3;
    const uint64_t blk0 = (uint64_t)j0 >> 3;
    for (int64_t q = 0; q < nb; q++) {
        uint64_t c0 = blk0 + (uint64_t)q, c1 = (uint64_t)i, c2 = (uint64_t)h, c3 = (uint64_t)b;
        uint64_t k0 = seed, k1 = 0;
        for (int r = 0; r < 10; r++) {
            uint64_t hi0, hi1;
            const uint64_t lo0 = fa_mulhilo64(FA_PHILOX_M0, c0, &hi0);
            const uint64_t lo1 = fa_mulhilo64(FA_PHILOX_M1, c2, &hi1);
            c0 = hi1 ^ c1 ^ k0;
            c1 = lo1;
            c2 = hi0 ^ c3 ^ k1;
            c3 = lo0;
            k0 += FA_PHILOX_W0;
            k1 += FA_PHILOX_W1;
        }
        const uint64_t w[4] = { c0, c1, c2, c3 };
        uint32_t *o = u + 8 * q;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        memcpy(o, w, sizeof w); /* word t of the block is the low (t even) or high half of w[t / 2] */
#else
        for (int t = 0; t < 8; t++) o[t] = (uint32_t)(w[t >> 1] >> (32 * (t & 1)));
#endif
    }
}

#endif
