/* lsh.h: internal contract between the LSH attention driver (family.c) and
 * its per-ISA kernels (lsh_<dtype>_<isa>.c, all generated from lsh_impl.h).
 *
 * The driver owns the arrays shared by the phases of one call:
 *   rotp    (n_hashes, D, halfp) rotations in the compute dtype, zero padded
 *           from half = n_buckets / 2 to halfp (a multiple of 16, so of every
 *           vector width), so that the projection runs over whole vectors;
 *   kscale  (B, L) compute dtype: scale * log2(e) / |x_j| (0 for a zero row),
 *           the factor that turns a row x_j into its key khat_j * scale in
 *           the log2 domain of the kernels' exp2;
 *   bucket  (n_hashes, B, L) the bucket of each token per round;
 *   order   (n_hashes, B, L) the tokens of each round sorted by (bucket, position).
 * Phases: hash (kscale and the buckets of every round for a block of rows),
 * then the counting sort (driver), then per round the chunk attention, which
 * merges its rows into the output and the float64 LSE in original order.
 * Every task writes rows no other task of its phase writes, and the phases
 * are separated by barriers, so results do not depend on the thread count. */
#ifndef FA_LSH_H
#define FA_LSH_H

#include <stdint.h>
#include "family.h"

#define FA_LSH_HASH_ROWS 256 /* rows per hash task */
#define FA_LSH_HALF_ALIGN 16 /* halfp is a multiple of this */

typedef struct fa_lsh_work {
    const void *rotp;
    int64_t halfp;
    void *kscale;
    int32_t *bucket;
    int32_t *order;
} fa_lsh_work;

typedef struct fa_lsh_kernel {
    size_t (*scratch_bytes)(const fa_lsh_params *p, const fa_lsh_work *w);
    /* kscale of rows [i0, i0 + n) of batch b and their buckets in every round */
    void (*hash)(const fa_lsh_params *p, const fa_lsh_work *w, int64_t b, int64_t i0, int64_t n, void *ws);
    /* round r, chunks [c0, c1) of batch b: attention, merged into o and lse */
    void (*chunks)(const fa_lsh_params *p, const fa_lsh_work *w, int64_t r, int64_t b, int64_t c0, int64_t c1,
                   void *ws);
} fa_lsh_kernel;

extern const fa_lsh_kernel fa_lsh_kernel_f32_scalar, fa_lsh_kernel_f64;
#if defined(__x86_64__) || defined(_M_X64)
extern const fa_lsh_kernel fa_lsh_kernel_avx2, fa_lsh_kernel_avx512;
#endif
#if defined(__aarch64__)
extern const fa_lsh_kernel fa_lsh_kernel_neon;
#endif

#endif
