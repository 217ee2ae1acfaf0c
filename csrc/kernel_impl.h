/* kernel_impl.h: the fused attention kernel, written once in the vector
 * vocabulary of simd.h and instantiated per dtype and ISA by the units
 * kernel_<dtype>_<isa>.c, which define REAL (or a FA_TARGET_*), FA_SUFFIX and
 * the blocking constants:
 *   FA_BLK_MR   rows per Q.K^T / P.V register block (prefill)
 *   FA_BLK_NV   vectors of keys per Q.K^T register block (FA_BLK_NR keys)
 *   FA_BLK_NVO  vectors of Dv per P.V register block
 *   FA_BLK_BN   keys per tile
 *   FA_BLK_BMR  stacked query rows per task where the L2 size is unknown
 *               (FA_BLK_BMR_SHORT: for short sequences, optional); for long
 *               ones the driver derives the block from L2 (tiles.c), at most
 *               FA_BLK_ROWS_MAX, and sizes the scratch for it
 *   FA_BLK_RD   at most this many stacked rows take the decode path
 * and FA_ISA_SUFFIX where the unit provides this ISA's exp2 test hook.
 * (FA_TILE_* are the AMX tile instructions, amx_emu.h.)
 *
 * One task = a block of stacked query rows (GQA heads x query positions) of
 * one (batch, kv head).  For each tile of FA_BLK_BN keys it computes the score tile
 * S = Qs.K^T (Q pre-scaled by scale*log2(e), so exp2 replaces exp), applies the
 * masks only where a tile needs them, updates the running max m and sum l of
 * each row (rescaling the accumulator only when m grows; on whole, unmasked
 * tiles m is a reference that may trail the max by FA_SM_SLACK, softmax_block)
 * and accumulates P.V.
 * K/V storage formats enter in two places only.  Rows are read by dtype
 * (float32/64, float16, bfloat16, int8, fp8 e4m3 / e5m2): the decode paths
 * widen them in registers as they load (ld() in kernel_ukernels.h, its dtype a
 * compile-time constant per specialisation: the *_dt dispatchers), the
 * prefill path converts each tile's rows as it packs them (fa_cvt_row in
 * simd.h).  8-bit scales (fa_ctx.kts / kcs / vts / vcs, set once per task in
 * run()) are applied where they cost least: per-channel K on the scaled
 * queries (load_q), per-token K on the scores and per-token V on P (decode;
 * the packed / converted rows in prefill), per-channel V on the output row
 * (write_out).  The cache is never converted whole.
 * Scratch is bounded by the tiles, except the head K buffer (head_keys):
 * a thread's copy of one (batch, kv head)'s packed K, at most S x Dp values.
 * The micro-kernels and their constant-n dispatch are in kernel_ukernels.h. */
#include <math.h>
#include <string.h>
#include "simd.h"
#include "mask.h"
#include "kernel.h"
#include "dropout.h"

#define FA_CAT_(a, b) a##b
#define FA_CAT(a, b) FA_CAT_(a, b)
#define FA_NAME(x) FA_CAT(x, FA_SUFFIX)
#define FA_BLK_NR (FA_BLK_NV * VW) /* keys per packed K panel */
#define FA_PF_KEYS 16 /* decode: prefetch distance in keys */
/* 8-bit K/V rows take the 16-bit rows' order and prefetch (qk_rows, pv_row1),
 * FA_PF_KEYS keys ahead.  Measured on Zen 3 (avx2, B1 H32 S32768 D128 int8,
 * builds alternated, 2 threads): key after key without software prefetch (as
 * float32 rows) 0.85x; 32 keys ahead 1.00x; 8-bit V of Dv = 128 through
 * path_rows instead of path_row1 (whose 16 accumulators spill on AVX2) 1.00x
 * in L2. */
/* Keys per tile for a single query row whose K and V are read in place (the
 * usual decode step): one long tile streams K, then V, then the next K, each
 * pass reading its rows in address order, the output row held in registers
 * (interleaved A/B on Zen 3, B1 H32 S8192 D128 float32: +10% on 2 threads,
 * +15% on 1, against 64-key tiles with V read in column blocks).  The S
 * scratch (FA_BLK_BMR x FA_BLK_BN) holds it as one row.  Tried for 2-4 stacked GQA rows with
 * P.V one key at a time and O in L1: +3% float32, 15-30% slower float16; with
 * P.V one row at a time over the tile (V from DRAM once, then from L2): -0..-5%;
 * 16-256-key tiles: no better.  So those keep 64-key tiles. */
#define FA_ROW_TN 512
#define FA_VPANEL_ROWS 64 /* prefill-path tasks with at most this many rows pack V (see pv_prefill) */
/* ... in tiles of more keys than this.  A tile of a few keys is read a couple
 * of times at most, and copying it cost more than it saved: Zen 4, builds
 * alternated in one process, 1 thread, same bits: B1 H8 L16 D64 1.046 (avx2
 * path 1.085), L16 D128 1.064, B4 H8 L32 D64 1.046; B1 H8 L512 S8200 (an
 * 8-key last tile) 1.001. */
#define FA_VPANEL_MIN_KEYS 32
/* The fused softmax of whole, unmasked prefill tiles (softmax_block) keeps a
 * row's reference max while every score is below it plus this (log2
 * units): P < 2^8, far from float32's range, and the reference moves in
 * the row's first tile and on rare jumps only. */
#define FA_SM_SLACK 8

/* Prefetch the n bytes at p (one row), one line per instruction. */
#define FA_PREFETCH_ROW(p, n, hint) do { \
        const char *pf_ = (const char *)(p); \
        for (int64_t o_ = 0; o_ < (n); o_ += 64) __builtin_prefetch(pf_ + o_, 0, hint); \
    } while (0)

/* Prefetch every line that holds a byte of [p, p + n), wherever p lies in
 * its line (FA_PREFETCH_ROW starts at p: a 64-byte span not on a line
 * boundary touches two lines and it fetched the first). */
#define FA_PREFETCH_SPAN(p, n, hint) do { \
        const uintptr_t s_ = (uintptr_t)(const void *)(p), e_ = s_ + (uintptr_t)(n); \
        for (uintptr_t l_ = s_ & ~(uintptr_t)63; l_ < e_; l_ += 64) __builtin_prefetch((const void *)l_, 0, hint); \
    } while (0)

/* A single prefetch stream over one tile's K rows, then its V rows, then the
 * next tile's K rows (row r of a tile at base + r * ld; the next tile's K
 * rows follow this tile's).  nk keys remain from the tile start. */
typedef struct fa_stream {
    const char *k, *v;
    int64_t kld, vld, krow, vrow, nj;
    const char *kn; int64_t nkn; /* the next tile's first K row and its keys (0: none) */
    const float *ks, *vs; /* the per-token 8-bit scales of the tile's first key (NULL: none) */
    int paged;            /* rows of pages: float32 rows are prefetched too (qk_rows, pv_row1) */
} fa_stream;

#define FA_LOG2E 1.4426950408889634
#define FA_REAL_MAX (sizeof(REAL) == 8 ? 1.7976931348623157e308 : 3.4028234663852886e38)
/* mask.h's attn_mask arithmetic for this kernel's REAL. */
#define FA_MASK_APPLY(p, s, m, a, e) _Generic((REAL)0, float: fa_mask_apply_f32, double: fa_mask_apply_f64)(p, s, m, a, e)
#define FA_LN2 0.6931471805599453

static inline int64_t fa_rup(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

typedef struct fa_ws {
    REAL *Qs;   /* FA_BLK_BMR x Dp   pre-scaled queries                        */
    REAL *K;    /* FA_BLK_BN x Dp    packed K panels (or converted K rows)      */
    REAL *V;    /* FA_BLK_BN x Dvp   converted V rows (when not read in place)  */
    REAL *S;    /* FA_BLK_BMR x FA_BLK_BN   scores, then probabilities                 */
    REAL *O;    /* FA_BLK_BMR x Dvp  unnormalised output accumulator            */
    REAL *m;    /* FA_BLK_BMR        running row maxima (log2 domain)          */
    REAL *l;    /* FA_BLK_BMR x VW   running row sums, VW partial sums per row:
                 * the lanes are added once, in write_out (a horizontal sum per
                 * row and tile was 7% of a (1, 8, 16, 64) call)             */
    REAL *tmp;  /* 8 x max(Dp, Dvp): converted rows (8 K rows at a time: qk_packed) */
    REAL *Kh;   /* head_keys x D     packed K of one (batch, kv head), or NULL  */
    int64_t kh_keys;
    fa_scratch_state *st; /* which keys Kh holds (kernel.h; zeroed per call) */
} fa_ws;

#define FA_ALIGN 64
/* Values past the last query row in w->Qs that load_q_packed's 8-wide stores
 * may write (never read). */
#define FA_QS_SLACK 8
static inline size_t fa_al(size_t n) { return (n + FA_ALIGN - 1) / FA_ALIGN * FA_ALIGN; }

/* Rows of scratch per task.  The driver gives a task max(1, rows / G)
 * query positions of all G = Hq / Hk heads of its kv head, with rows <= FA_BLK_BMR,
 * so a task stacks at most max(FA_BLK_BMR, G) rows: a GQA group larger than the row
 * block (multi-query attention with many heads) stacks all G heads of one
 * position.  Sizing the scratch for that keeps K and V read once per task
 * (rather than once per slice of the group), and the tasks still depend on the
 * shapes only. */
static inline int64_t FA_NAME(cap_rows)(const fa_params *p, int64_t rows)
{
    const int64_t G = p->Hk > 0 ? p->Hq / p->Hk : 1;
    /* at least FA_ROW_TN / FA_BLK_BN rows: the single-row path keeps its long
     * tile of FA_ROW_TN scores in S */
    const int64_t r = rows > FA_ROW_TN / FA_BLK_BN ? rows : FA_ROW_TN / FA_BLK_BN;
    return G > r ? G : r;
}

/* One stacked row's working set per key tile (tiles.c): its scaled query, its
 * scores and its output accumulator. */
static int64_t FA_NAME(row_bytes)(int64_t D, int64_t Dv)
{
    return (fa_rup(D, VW) + FA_BLK_BN + fa_rup(Dv, VW)) * (int64_t)sizeof(REAL);
}

/* Keys of the head K buffer (0: none).  A non-causal call without a window
 * gives every task of a (batch, kv head) the same key range, and the driver
 * queues a head's query blocks one after another (attention.c), so each
 * thread packs a head's K once into this buffer and its next tasks of the
 * head read the panels from it instead of packing every tile again (the K
 * packing was 3% of L1024 D64 and 7% of L2048 D128 on Zen 3).  Only for
 * prefill-sized tasks with at least 3 query blocks per head (a thread meets
 * a head twice), and at most FA_HEAD_K_BYTES per thread (8 MiB: S = 16384 at
 * D = 128; a team of 64 threads then holds at most 512 MiB). */
#define FA_HEAD_K_BYTES ((int64_t)8 << 20)
static int64_t FA_NAME(head_keys)(const fa_params *p, int64_t rows)
{
    const int64_t G = p->Hk > 0 ? p->Hq / p->Hk : 1;
    const int64_t bmq = rows / G > 1 ? rows / G : 1, nqb = (p->L + bmq - 1) / bmq;
    const int64_t keys = fa_rup(p->S, FA_BLK_BN);
    if (p->causal || p->window_left >= 0 || p->window_right >= 0 || nqb < 3 || G * bmq <= FA_BLK_RD) return 0;
    return keys * fa_rup(p->D, VW) * (int64_t)sizeof(REAL) <= FA_HEAD_K_BYTES ? keys : 0;
}

static size_t FA_NAME(scratch_bytes)(const fa_params *p, int64_t rows)
{
    int64_t Dp = fa_rup(p->D, VW), Dvp = fa_rup(p->Dv, VW), W = Dp > Dvp ? Dp : Dvp;
    const size_t e = sizeof(REAL), R = (size_t)FA_NAME(cap_rows)(p, rows);
    return sizeof(fa_scratch_state) + fa_al((R * Dp + FA_QS_SLACK) * e) + fa_al(FA_BLK_BN * Dp * e) +
           fa_al(FA_BLK_BN * Dvp * e) + fa_al(R * FA_BLK_BN * e) + fa_al(R * Dvp * e) + fa_al(R * e) +
           fa_al(R * VW * e) + fa_al((size_t)(FA_NAME(head_keys)(p, rows) * Dp) * e) + fa_al(8 * W * e) + FA_ALIGN;
}

FA_INLINE void FA_NAME(carve)(const fa_params *p, int64_t rows, void *scratch, fa_ws *w)
{
    int64_t Dp = fa_rup(p->D, VW), Dvp = fa_rup(p->Dv, VW);
    const size_t e = sizeof(REAL), R = (size_t)FA_NAME(cap_rows)(p, rows);
    w->st = (fa_scratch_state *)scratch;
    char *c = (char *)(((uintptr_t)scratch + sizeof(fa_scratch_state) + FA_ALIGN - 1) / FA_ALIGN * FA_ALIGN);
    w->Qs = (REAL *)c; c += fa_al((R * Dp + FA_QS_SLACK) * e);
    w->K = (REAL *)c; c += fa_al(FA_BLK_BN * Dp * e);
    w->V = (REAL *)c; c += fa_al(FA_BLK_BN * Dvp * e);
    w->S = (REAL *)c; c += fa_al(R * FA_BLK_BN * e);
    w->O = (REAL *)c; c += fa_al(R * Dvp * e);
    w->m = (REAL *)c; c += fa_al(R * e);
    w->l = (REAL *)c; c += fa_al(R * VW * e);
    w->kh_keys = FA_NAME(head_keys)(p, rows);
    w->Kh = w->kh_keys ? (REAL *)c : NULL; c += fa_al((size_t)(w->kh_keys * Dp) * e);
    w->tmp = (REAL *)c;
}

/* This kernel's own dtype, a constant: the micro-kernels' dtype switches
 * (qk_rows_dt, pv_rows_dt, pv_row1_dt) fold with it (a field of the context,
 * read through the pointer of a path out of line, left a dtype test per
 * loaded vector in the GQA decode's P.V loop). */
#define FA_SELF_DT (sizeof(REAL) == 8 ? FA_F64 : FA_F32)

/* The micro-kernels and their constant-n dispatch functions. */
#include "kernel_ukernels.h"

/* nj rows of n values of dtype dt (row r at src + r * srow bytes) converted
 * to REAL rows of ld values at dst, zero-padded from n to ld. */
static void FA_NAME(cvt_rows)(REAL *dst, int64_t ld, const char *src, int64_t srow, int dt, int64_t n,
                              int64_t nj)
{
    for (int64_t r = 0; r < nj; r++) {
        REAL *d = dst + r * ld;
        fa_cvt_row(d, src + r * srow, dt, n);
        for (int64_t c = n; c < ld; c++) d[c] = 0;
    }
}

/* t[0:n] *= s, explicit vectors (through a pointer field of the scratch the
 * plain loop ran scalar, reloading the pointer and the bound per element: 14%
 * of an int8 L2048 causal prefill by perf). */
FA_INLINE void FA_NAME(scale_row)(REAL *t, int64_t n, REAL s)
{
    int64_t d = 0;
    for (const vf sv = vf_set1(s); d + VW <= n; d += VW) vf_store(t + d, vf_mul(vf_load(t + d), sv));
    for (; d < n; d++) t[d] *= s;
}

/* dst[0:Dv] = o[0:Dv] * inv, or zeros for a row past the valid length;
 * branch-free inside so that it vectorises (one multiply per vector). */
static inline void FA_NAME(write_row)(REAL *dst, const REAL *o, double inv, int valid, int64_t Dv)
{
    if (!valid) { memset(dst, 0, (size_t)Dv * sizeof(REAL)); return; }
    const REAL s = (REAL)inv;
    int64_t c = 0;
    /* Explicit vectors: under -fno-strict-aliasing the compiler cannot rule
     * out that dst overlaps o, and the plain loop ran nearly scalar. */
    for (const vf sv = vf_set1(s); c + VW <= Dv; c += VW) vf_store(dst + c, vf_mul(vf_load(o + c), sv));
    for (; c < Dv; c++) dst[c] = o[c] * s;
}
/* ---- The task: shared pieces and the three paths ---- */

/* path_prefill is a function of its own, out of line; it and run() are
 * 64-byte aligned.  So run(), with the decode paths inlined, compiles to the
 * same instructions at the same loop alignment whatever path_prefill holds
 * (inlined, a change to path_prefill alone moved the decode's timing by up to
 * 10% through GCC's code layout and scheduling; run_* can be compared across
 * builds by disassembly, addresses aside).  A small call's prologue is also
 * shorter (B1 H8 L16 D64 1.05x avx512, 1.15x avx2).  The decode paths stay
 * inlined: out of line, the GQA decode measured 0.95-0.97x (its loop bounds
 * spilled), within this VM's A/A noise on that case (two copies of one
 * build: 0.94-1.00) but not better. */
#ifndef FA_PATH
#define FA_PATH static __attribute__((noinline, aligned(64)))
#endif

/* What run() derives once per task from the call and the task; the paths and
 * the shared pieces only read it.  Row r of the task is query head
 * hk*G + r/ni at position i0 + r%ni (R = G*ni active rows). */
typedef struct fa_ctx {
    const fa_params *p;
    const fa_task *t;
    fa_batch bi;
    int64_t G, D, Dv, Dp, Dvp, b, delta, ni, R;
    int64_t ksz, vsz;                /* bytes per K / V element (storage dtype) */
    const char *kbase, *vbase;       /* key 0 of this (batch, kv head) */
    int64_t jlo, jhi;                /* keys any row may see */
    int64_t flo, fhi;                /* keys every row sees */
    int use_log2;                    /* no softcap: Q carries log2(e), exp2 replaces exp */
    int elem_always;                 /* mask, ALiBi, softcap or block mask: every tile per element */
    int mask_only;                   /* attn_mask is the one per-element transform (tile_mask_state) */
    int kfuse, vfuse;                /* K / V rows read in place, widened on load (decode) */
    int vdirect;                     /* V rows are whole vectors of REAL: usable as they lie */
    int panel_outer;                 /* Q.K^T panel by panel over the row blocks (qk_packed) */
    REAL *kh;                        /* the head K buffer, key jlo first, when this task uses it */
    /* 8-bit K / V scales (fastattn.h) of this (batch, kv head), NULL where
     * none: per token (key 0 first, stride *_tsl), applied to the scores and
     * to P on the decode paths and to the converted rows on path_prefill;
     * per channel or head (channel stride *_csd, 0 for a head's one
     * value), K's folded into the scaled queries (load_q), V's into the
     * output rows (write_out). */
    const float *kts, *vts, *kcs, *vcs;
    int64_t kts_sl, vts_sl, kcs_sd, vcs_sd;
    int kv_dram;                     /* the call's K and V stream from DRAM (path_rows' prefetch) */
    /* Paged K/V (fastattn.h): this batch's block table row and the page size
     * (0: contiguous).  A tile never crosses a page (tile_len), so that within
     * a tile K and V rows, and per-token scales, keep their strides. */
    const int32_t *bt;
    int64_t page;
    int page_shift;                  /* log2(page) for a power of two (every usual size), else -1 */
} fa_ctx;

/* The prefill products take R rows in nb = ceil(R / FA_BLK_MR) register
 * blocks of near-equal size, block kb = rows [R kb / nb, R (kb + 1) / nb):
 * a full-size run with a short last block (16 rows as 12 + 4) leaves the
 * short block's few accumulator chains waiting on the FMA latency.  Each
 * row's sums do not depend on the blocking. */
FA_INLINE int64_t FA_NAME(row_nblocks)(int64_t R) { return (R + FA_BLK_MR - 1) / FA_BLK_MR; }

/* Block kb of the nb blocks of R rows: its first row (*r0) and its row count.
 * load_q_packed lays the query out by these blocks and the products read it
 * by the same ones. */
FA_INLINE int FA_NAME(row_block)(int64_t R, int64_t nb, int64_t kb, int64_t *r0)
{
    *r0 = R * kb / nb;
    return (int)(R * (kb + 1) / nb - *r0);
}

/* Row r of the task in the query operand: head hk*G + r/ni at position i0 + r%ni. */
FA_INLINE const char *FA_NAME(q_row)(const fa_ctx *c, int64_t g, int64_t ii)
{
    const fa_params *p = c->p;
    const int64_t h = c->t->hk * c->G + g, i = c->t->i0 + ii;
    return (const char *)p->q +
        (c->b * p->q_sb + h * p->q_sh + (c->bi.qoff + i) * p->q_sl) * (int64_t)fa_dtype_size(p->q_dtype);
}

/* Keys [*a, *b) of a tile (nj keys at jt) that some row of the register
 * block at row r0 (mr rows) may see, 0 <= *a <= *b <= nj: the whole tile
 * unless the tile is partial (the causal diagonal, a window's edge, a key
 * length inside it).  Visible ranges grow with the position (mask.h), so the
 * block's union runs from its first position's lo to its last position's hi;
 * a block that spans two heads of the GQA group covers every position.  The
 * products, the masks and the softmax skip the keys outside it (every one is
 * outside each row's own range: an exact zero in the row's softmax); within
 * it mask_row sets the scores outside the row's range to -inf. */
FA_INLINE void FA_NAME(block_keys)(const fa_ctx *c, int partial, int64_t r0, int64_t mr, int64_t jt, int64_t nj,
                                   int64_t *a, int64_t *b)
{
    *a = 0;
    *b = nj;
    if (!partial) return;
    int64_t p0 = r0 % c->ni, p1 = (r0 + mr - 1) % c->ni, lo, hi, lo1, hi1;
    if (p1 < p0 || mr > c->ni) { p0 = 0; p1 = c->ni - 1; }
    fa_row_range(c->p, c->t->i0 + p0 + c->delta, c->bi.Sb, &lo, &hi);
    fa_row_range(c->p, c->t->i0 + p1 + c->delta, c->bi.Sb, &lo1, &hi1);
    *a = fa_min64(fa_max64(lo - jt, 0), nj);
    *b = fa_max64(fa_min64(hi1 - jt, nj), *a);
}

/* The prefill path's query operand: each register block of mr rows (at row
 * r0) packed d-major at w->Qs + r0 * Dp, element (r, d) at d * mr + r - r0,
 * pre-scaled and zero past D (qk_ukernel's Qp).  Float32 rows are scaled as
 * they are loaded and transposed 8 x 8 straight from the input (the same
 * single product per element as the row-major copy; a separate scaling pass
 * over the packed block was 2.4% of a (1, 8, 16, 64) call by perf). */
FA_INLINE void FA_NAME(load_q_packed)(const fa_ctx *c, const fa_ws *w, REAL qscale)
{
    const fa_params *p = c->p;
    const int64_t R = c->R, D = c->D, Dp = c->Dp, nb = FA_NAME(row_nblocks)(R);
    for (int64_t kb = 0; kb < nb; kb++) {
        int64_t r0;
        const int64_t mr = FA_NAME(row_block)(R, nb, kb, &r0);
        REAL *qb = w->Qs + r0 * Dp;
        const char *src[FA_BLK_MR] = { 0 };
        for (int64_t r = 0, g = r0 / c->ni, ii = r0 % c->ni; r < mr; r++) { /* row r0 + r = g * ni + ii */
            src[r] = FA_NAME(q_row)(c, g, ii);
            if (++ii == c->ni) { ii = 0; g++; }
        }
        if (p->q_dtype == FA_SELF_DT) {
            int64_t d8 = 0; /* d below this is transposed 8 x 8 */
#if defined(FA_HAVE_PACK8)
            /* Groups of 8 rows (columns r..r+7 of the block), the last group
             * first: a group of n < 8 rows repeats its last row pointer, and
             * each of its 8-wide stores runs past its n columns into the
             * next d's first columns, which the full groups, stored after
             * it, overwrite (as the next d stores the group's own tail).
             * Past the block's end the run lands on later d (the scalar d
             * below), the padding, the next block or the buffer's slack
             * (carve), all written later or never read. */
            d8 = D / 8 * 8;
            for (int64_t r = (mr - 1) / 8 * 8; r >= 0; r -= 8) {
                const char *g[8];
                for (int64_t u = 0; u < 8; u++) g[u] = src[r + u < mr ? r + u : mr - 1];
                for (int64_t d = 0; d < d8; d += 8)
                    fa_pack8x8_rows_scaled((const float *const *)g, d, qb + d * mr + r, mr, qscale);
            }
#endif
            for (int64_t r = 0; r < mr; r++)
                for (int64_t d = d8; d < D; d++) qb[d * mr + r] = ((const REAL *)src[r])[d] * qscale;
        } else {
            for (int64_t r = 0; r < mr; r++) {
                fa_cvt_row(w->tmp, src[r], p->q_dtype, D);
                for (int64_t d = 0; d < D; d++) qb[d * mr + r] = w->tmp[d] * qscale;
            }
        }
        for (int64_t e = D * mr; e < Dp * mr; e++) qb[e] = 0;
        if (c->kcs) /* per-channel K scales: on the queries once */
            for (int64_t d = 0; d < D; d++)
                for (int64_t r = 0; r < mr; r++) qb[d * mr + r] *= (REAL)c->kcs[d * c->kcs_sd];
    }
}

/* Pre-scaled, zero-padded query rows in w->Qs (row-major with stride Dp for
 * the decode paths, packed by register block for the prefill path), m = -inf,
 * l = 0, O = 0. */
FA_INLINE void FA_NAME(load_q)(const fa_ctx *c, const fa_ws *w, int packed)
{
    const fa_params *p = c->p;
    const REAL qscale = (REAL)(p->scale * (c->use_log2 ? FA_LOG2E : 1.0));
    for (int64_t r = 0; r < c->R; r++) {
        w->m[r] = -INFINITY;
        vf_store(w->l + r * VW, vf_zero());
    }
    memset(w->O, 0, (size_t)(c->R * c->Dvp) * sizeof(REAL));
    if (packed) {
        FA_NAME(load_q_packed)(c, w, qscale);
        return;
    }
    /* (g, ii) loops rather than r / ni and r % ni per row: two integer
     * divisions were a visible part of small calls. */
    for (int64_t g = 0, r = 0; g < c->G; g++)
    for (int64_t ii = 0; ii < c->ni; ii++, r++) {
        const char *src = FA_NAME(q_row)(c, g, ii);
        REAL *qd = w->Qs + r * c->Dp;
        if (p->q_dtype == FA_SELF_DT) { /* one pass: scaled while copied */
            const REAL *qs = (const REAL *)src;
            int64_t d = 0;
            for (const vf qv = vf_set1(qscale); d + VW <= c->D; d += VW) vf_store(qd + d, vf_mul(vf_load(qs + d), qv));
            for (; d < c->D; d++) qd[d] = qs[d] * qscale;
        } else {
            fa_cvt_row(qd, src, p->q_dtype, c->D);
            for (int64_t d = 0; d < c->D; d++) qd[d] *= qscale;
        }
        for (int64_t d = c->D; d < c->Dp; d++) qd[d] = 0;
        if (c->kcs)
            for (int64_t d = 0; d < c->D; d++) qd[d] *= (REAL)c->kcs[d * c->kcs_sd];
    }
}

/* S[r][jj] *= sc[jj * ld] for the R rows of a score or probability tile (row
 * stride TN) and its nj keys: the per-token K scales on the scores (before
 * the masks), the per-token V scales on P (after the softmax has summed it)
 * on the decode paths. */
FA_INLINE void FA_NAME(scale_keys)(REAL *S, int64_t TN, int64_t R, const float *sc, int64_t ld, int64_t nj)
{
    for (int64_t r = 0; r < R; r++) {
        REAL *s = S + r * TN;
        for (int64_t jj = 0; jj < nj; jj++) s[jj] *= (REAL)sc[jj * ld];
    }
}

/* Paged: the page (its block table entry) and slot of key j.  A shift and a
 * mask for the usual power-of-two sizes: the 64-bit divisions of a segment
 * (tile_stream, seg_len) were a visible part of 16-key pages. */
FA_INLINE int64_t FA_NAME(page_of)(const fa_ctx *c, int64_t j, int64_t *slot)
{
    if (c->page_shift >= 0) {
        *slot = j & (c->page - 1);
        return c->bt[j >> c->page_shift];
    }
    *slot = j % c->page;
    return c->bt[j / c->page];
}

/* The keys of the tile at jt: at most tn, to the end of the task's range and,
 * for paged K/V, of jt's page. */
FA_INLINE int64_t FA_NAME(tile_len)(const fa_ctx *c, int64_t jt, int64_t tn)
{
    const int64_t n = fa_min64(tn, c->jhi - jt);
    return c->page ? fa_min64(n, c->page - (c->page_shift >= 0 ? jt & (c->page - 1) : jt % c->page)) : n;
}

/* The tile of nj keys at jt: its first K and V rows, their per-token scales
 * and the prefetch stream over them, which goes on into the next tile's K
 * rows (kn: nkn keys there, to the end of the task's range).  Paged: the rows
 * of jt's page (the tile lies within it); the next tile's are the next
 * page's. */
FA_INLINE fa_stream FA_NAME(tile_stream)(const fa_ctx *c, int64_t jt, int64_t nj)
{
    const fa_params *p = c->p;
    const char *k = c->kbase, *v = c->vbase; /* key 0 of the rows that hold jt, key j there */
    const float *ks = c->kts, *vs = c->vts;
    int64_t j = jt;
    const int64_t hk = c->t->hk;
    if (c->page) {
        const int64_t pg = FA_NAME(page_of)(c, jt, &j);
        k = (const char *)p->k + (pg * p->k_sb + hk * p->k_sh) * c->ksz;
        v = (const char *)p->v + (pg * p->v_sb + hk * p->v_sh) * c->vsz;
        if (ks) ks = p->k_scale + pg * p->ks_sb + hk * p->ks_sh;
        if (vs) vs = p->v_scale + pg * p->vs_sb + hk * p->vs_sh;
    }
    fa_stream st = { k + j * p->k_sl * c->ksz, v + j * p->v_sl * c->vsz, p->k_sl * c->ksz, p->v_sl * c->vsz,
                     c->D * c->ksz, c->Dv * c->vsz, nj, NULL, 0,
                     ks ? ks + j * c->kts_sl : NULL, vs ? vs + j * c->vts_sl : NULL, c->page != 0 };
    /* The keys after the tile: the same rows on, or the next page's first. */
    const int64_t jn = jt + nj;
    st.nkn = c->jhi - jn;
    st.kn = st.k + nj * st.kld;
    if (c->page && st.nkn > 0) { /* (jn starts a page: the tile ends with its page) */
        int64_t slot;
        const int64_t pg = FA_NAME(page_of)(c, jn, &slot);
        st.nkn = fa_min64(st.nkn, c->page - slot);
        st.kn = (const char *)p->k + (pg * p->k_sb + hk * p->k_sh + slot * p->k_sl) * c->ksz;
    }
    return st;
}

/* Whether the block mask hides every key of the tile from every row. */
FA_INLINE int FA_NAME(tile_hidden)(const fa_ctx *c, int64_t jt, int64_t nj)
{
    const fa_params *p = c->p;
    if (!p->bmask) return 0;
    int any = 0;
    for (int64_t g = 0; g < c->G && !any; g++)
        any = fa_bmask_any(p, c->b, c->t->hk * c->G + g, c->t->i0, c->t->i0 + c->ni, jt, jt + nj);
    return !any;
}

/* What the attn_mask does to the tile of nj keys at jt for every row of the
 * task (fa_tile_mask_state, mask.h), where it is the one per-element
 * transform (mask_only); else FA_TM_MIXED. */
FA_INLINE int FA_NAME(tile_mask_state)(const fa_ctx *c, int64_t jt, int64_t nj)
{
    if (!c->mask_only) return FA_TM_MIXED;
    return fa_tile_mask_state(c->p, c->b, c->t->hk * c->G, c->G, c->t->i0, c->ni, jt, nj);
}

/* Whether some row of the task sees only part of the tile of nj keys at jt
 * (the causal diagonal, a window's edge, a key length inside it). */
FA_INLINE int FA_NAME(tile_partial)(const fa_ctx *c, int64_t jt, int64_t nj)
{
    return jt < c->flo || jt + nj > c->fhi;
}

/* The masks of row r's scores s (a tile of nj keys at jt), over the tile
 * columns [ja, jb) only (jb <= the padded width), where the tile needs them:
 * -inf past nj up to the vector edge always; the visible range's edges when
 * the tile is partial (causal diagonal, window); every element when a mask,
 * ALiBi, softcap or block mask applies. */
FA_INLINE void FA_NAME(mask_row)(const fa_ctx *c, REAL *s, int64_t r, int64_t jt, int64_t nj, int64_t ja,
                                 int64_t jb, int partial, int elem)
{
    const fa_params *p = c->p;
    const fa_task *t = c->t;
    const int64_t b = c->b, je = fa_min64(jb, nj);
    for (int64_t jj = fa_max64(nj, ja); jj < jb; jj++) s[jj] = -INFINITY;
    if (!(elem || partial)) return;
    int64_t h = t->hk * c->G + r / c->ni, i = t->i0 + r % c->ni, ip = i + c->delta, lo, hi;
    fa_row_range(p, ip, c->bi.Sb, &lo, &hi);
    const char *mrow = p->mask ? (const char *)p->mask +
        (b * p->m_sb + h * p->m_sh + i * p->m_sl) * (p->mask_kind == FA_MASK_BOOL ? 1 : p->mask_kind == FA_MASK_F32 ? 4 : 8) : NULL;
    if (!elem || c->mask_only) { /* the visible range (causal diagonal, window edge), then the mask */
        const int64_t a0 = fa_min64(fa_max64(lo - jt, 0), nj), a1 = fa_max64(fa_min64(hi - jt, nj), a0);
        for (int64_t jj = ja; jj < a0; jj++) s[jj] = -INFINITY;
        for (int64_t jj = fa_max64(a1, ja); jj < je; jj++) s[jj] = -INFINITY;
        if (elem) FA_MASK_APPLY(p, s, mrow + jt * p->m_ss * (int64_t)fa_mask_size(p->mask_kind),
                                fa_max64(a0, ja), fa_min64(a1, je));
        return;
    }
    const double slope = p->alibi ? p->alibi[b * p->alibi_sb + h * p->alibi_sh] * FA_LOG2E : 0.0;
    for (int64_t jj = ja; jj < je; jj++) {
        int64_t j = jt + jj;
        if (j < lo || j >= hi) { s[jj] = -INFINITY; continue; }
        double x = s[jj];
        if (!c->use_log2) {
            /* c*tanh(x/c) = x*(1 - (x/c)^2/3 + ...): for tiny x/c (which FTZ/DAZ
             * would flush to 0) the cap is the identity to double precision. */
            double y = x / p->softcap;
            x = (fabs(y) < 1e-6 ? x : p->softcap * tanh(y)) * FA_LOG2E;
        }
        /* A finite logit stays finite: an HF-style padding mask of
         * finfo(float32).min overflows float32 once in log2 units (and
         * finfo(float64).min overflows double), and -inf would mask the
         * key outright (a row of only such keys gave zeros where the
         * softmax is uniform over them).  Only -inf / NaN inputs, a False
         * bool mask and the block mask remove a key. */
        int fin = x - x == 0.0; /* finite (NaN and +-inf fail) */
        if (p->alibi) x -= slope * (double)(ip > j ? ip - j : j - ip);
        if (mrow) {
            int64_t mo = j * p->m_ss;
            if (p->mask_kind == FA_MASK_BOOL) {
                if (!((const uint8_t *)mrow)[mo]) { x = -INFINITY; fin = 0; }
            } else {
                double mv = p->mask_kind == FA_MASK_F32 ? (double)((const float *)mrow)[mo]
                                                        : ((const double *)mrow)[mo];
                if (mv - mv != 0.0) fin = 0; /* -inf / +inf / NaN in the mask act as given */
                x += mv * FA_LOG2E;
            }
        }
        if (p->bmask && !fa_bmask_at(p, b, h, i, j)) { x = -INFINITY; fin = 0; }
        if (fin) {
            if (x < -FA_REAL_MAX) x = -FA_REAL_MAX;
            else if (x > FA_REAL_MAX) x = FA_REAL_MAX;
        }
        s[jj] = (REAL)x;
    }
}

/* The masks of every row of a score tile S (R rows of stride TN, nj keys at
 * jt) over the tile's padded width. */
FA_INLINE void FA_NAME(mask_tile)(const fa_ctx *c, REAL *S, int64_t TN, int64_t jt, int64_t nj, int elem)
{
    const int64_t njp = fa_rup(nj, VW);
    const int partial = FA_NAME(tile_partial)(c, jt, nj);
    for (int64_t r = 0; r < c->R; r++) FA_NAME(mask_row)(c, S + r * TN, r, jt, nj, 0, njp, partial, elem);
}

/* P = exp2(s - m) in place over s[j0, j1) (multiples of VW), summed into the
 * row's lane sums l: the exp pass of softmax_row and softmax_block. */
FA_INLINE void FA_NAME(exp_row)(REAL *s, int64_t j0, int64_t j1, REAL m, REAL *l)
{
    const vf mv = vf_set1(m);
    vf sum = vf_load(l);
    for (int64_t j = j0; j < j1; j += VW) {
        const vf e = vf_exp2_neg(vf_sub(vf_load(s + j), mv));
        vf_store(s + j, e);
        sum = vf_add(sum, e);
    }
    vf_store(l, sum);
}

/* Online softmax of row r of a masked score tile over the vectors of keys
 * [j0, j1) (multiples of VW, j1 <= the tile's padded width; the row's keys
 * outside them are -inf, so they add nothing): they become P = exp2(S - m) in
 * place (zero past nj by the -inf there), m and l are updated and O rescaled
 * only when the row's max grows. */
FA_INLINE void FA_NAME(softmax_row)(const fa_ctx *c, const fa_ws *w, int64_t TN, int64_t r, int64_t j0, int64_t j1,
                                    int64_t nj)
{
    const int64_t Dvp = c->Dvp;
    REAL *s = w->S + r * TN;
    /* Two max chains (max is exact in any order: the same row max). */
    vf mv = vf_set1(-INFINITY), mv1 = mv;
    int64_t jj = j0;
    for (; jj + VW < j1; jj += 2 * VW) {
        mv = vf_max(mv, vf_load(s + jj));
        mv1 = vf_max(mv1, vf_load(s + jj + VW));
    }
    if (jj < j1) mv = vf_max(mv, vf_load(s + jj));
    REAL mx = vf_hmax(vf_max(mv, mv1)), mold = w->m[r];
    REAL mnew = mx > mold ? mx : mold;
    if (mx != mx) mnew = mx; /* NaN poisons the row */
    if (mnew == -INFINITY) {
        /* Nothing visible yet; NaN scores still poison the row. */
        for (int64_t j = j0, je = fa_min64(j1, nj); j < je; j++) { if (s[j] != s[j]) w->l[r * VW] = NAN; s[j] = 0; }
        return;
    }
    if (mnew > mold) {
        if (mold != -INFINITY) {
            /* The rescale factor by the kernel's own exp2 (not libm's: a
             * call per row and tile, 1% of a B1 H8 L1024 D64 profile). */
            const vf av = vf_exp2_neg(vf_set1(mold - mnew));
            REAL *o = w->O + r * Dvp;
            for (int64_t cc = 0; cc < Dvp; cc += VW) vf_store(o + cc, vf_mul(av, vf_load(o + cc)));
            vf_store(w->l + r * VW, vf_mul(av, vf_load(w->l + r * VW)));
        }
        w->m[r] = mnew;
    }
    FA_NAME(exp_row)(s, j0, j1, mnew, w->l + r * VW);
}

/* The online softmax of row r over the vectors of keys [j0, j1) in one pass
 * over its scores, not softmax_row's two, where the row's reference m allows
 * it: used right after Q.K^T on whole, unmasked tiles (softmax_block) and
 * after mask_row on partial ones (path_prefill).  Row r keeps its reference m
 * (the log2-domain max that O and l are scaled by) as long as all of its
 * scores here are below m + FA_SM_SLACK: then P = exp2(s - m) <
 * 2^FA_SM_SLACK replaces them and is summed into l (masked -inf scores give
 * P = 0, as in softmax_row).  Otherwise softmax_row takes the row, moving m
 * to the true max and rescaling O and l: the row's first visible tile (m =
 * -inf, and -inf >= -inf: a row of -inf scores stays at m = -inf with P = 0,
 * as softmax_row leaves it, where exp2(-inf - -inf) would be NaN), a max that
 * jumps, +inf or NaN scores (which compare unordered).  m never exceeds the
 * row's true max, so l >= 1 once a finite score was seen.
 * (The same work in the micro-kernel's epilogue, the scores still in
 * registers, made GCC spill the AVX2 kernel's accumulators in its loop: 0.67x
 * on B1 H8 L1024 D64; panel by panel it paid the per-row check and sum once
 * per 2 vectors: 0.97x on AVX2.) */
FA_INLINE void FA_NAME(softmax_row_lazy)(const fa_ctx *c, const fa_ws *w, int64_t TN, int64_t r, int64_t j0,
                                         int64_t j1, int64_t nj)
{
    REAL *s = w->S + r * TN;
    const vf lim = vf_set1(w->m[r] + (REAL)FA_SM_SLACK); /* -inf or NaN when m is */
    vm big = vm_none();
    for (int64_t j = j0; j < j1; j += VW) big = vm_or_ge(big, vf_load(s + j), lim);
    if (vm_any(big)) FA_NAME(softmax_row)(c, w, TN, r, j0, j1, nj);
    else FA_NAME(exp_row)(s, j0, j1, w->m[r], w->l + r * VW);
}

/* The online softmax of rows [r0, r0 + nr) of a fused tile (whole and
 * unmasked: path_prefill), right after the block's Q.K^T where row blocks run
 * outer (its scores still in L1), else after the tile's. */
FA_INLINE void FA_NAME(softmax_block)(const fa_ctx *c, const fa_ws *w, int64_t r0, int64_t nr)
{
    for (int64_t r = r0; r < r0 + nr; r++) FA_NAME(softmax_row_lazy)(c, w, FA_BLK_BN, r, 0, FA_BLK_BN, FA_BLK_BN);
}

/* The online softmax of every row of a masked score tile (nj keys). */
FA_INLINE void FA_NAME(softmax_tile)(const fa_ctx *c, const fa_ws *w, int64_t TN, int64_t nj)
{
    const int64_t njp = fa_rup(nj, VW);
    for (int64_t r = 0; r < c->R; r++) FA_NAME(softmax_row)(c, w, TN, r, 0, njp, nj);
}

/* Normalise once and write every row of the task (rows past L_b: zeros, LSE -inf). */
FA_INLINE void FA_NAME(write_out)(const fa_ctx *c, const fa_ws *w)
{
    const fa_params *p = c->p;
    const fa_task *t = c->t;
    const int64_t G = c->G, ni = c->ni, Dv = c->Dv, b = c->b;
    for (int64_t g = 0, r = 0; g < G; g++)
    for (int64_t ii = 0; ii < t->ni; ii++, r++) {
        int64_t h = t->hk * G + g, i = t->i0 + ii;
        if (p->cu_q && i >= c->bi.Lb) continue; /* packed varlen: the row belongs to the next sequence */
        int64_t ra = g * ni + ii; /* row in the active block */
        double mm = -INFINITY, ll = 0.0, f = 0.0;
        const int valid = ii < ni;
        if (valid) {
            mm = w->m[ra]; /* log2 domain */
            ll = vf_hsum(vf_load(w->l + ra * VW));
            f = 1.0;
            /* A split task's part leaves the sink out: the merge adds it to the
             * denominator once (attention.c, fa_merge_row). */
            if (p->sinks && !t->part_o) {
                double sk = p->sinks[h] * FA_LOG2E, M = mm > sk ? mm : sk;
                f = mm == -INFINITY ? 0.0 : exp2(mm - M);
                ll = ll * f + exp2(sk - M);
                mm = M;
            }
        }
        double lse = 0.0; /* the log2 only where an LSE is returned (small calls: ~6% of the time) */
        if (t->part_o || p->lse)
            lse = ll != ll ? NAN : (mm == -INFINITY || ll == 0.0) ? -INFINITY : (mm + log2(ll)) * FA_LN2;
        double inv = ll != ll ? NAN : (valid && mm != -INFINITY && ll > 0.0) ? f / ll : 0.0;
        REAL *o = w->O + ra * c->Dvp;
        if (c->vcs && valid) /* per-channel V scales: on the output row once */
            for (int64_t cc = 0; cc < Dv; cc++) o[cc] *= (REAL)c->vcs[cc * c->vcs_sd];
        if (t->part_o) {
            FA_NAME(write_row)((REAL *)t->part_o + r * Dv, o, inv, valid, Dv);
            ((REAL *)t->part_lse)[r] = (REAL)lse;
        } else {
            int64_t oo = b * p->o_sb + h * p->o_sh + (c->bi.qoff + i) * p->o_sl;
            if (p->o_dtype == FA_SELF_DT) {
                FA_NAME(write_row)((REAL *)p->o + oo, o, inv, valid, Dv);
            } else {
                for (int64_t cc = 0; cc < Dv; cc++) fa_store_elem(p->o, p->o_dtype, oo + cc, valid ? o[cc] * inv : 0.0);
            }
            if (p->lse)
                fa_store_elem(p->lse, FA_SELF_DT, b * p->lse_sb + h * p->lse_sh + (c->bi.qoff + i) * p->lse_sl, lse);
        }
    }
}

/* The keys of the segment at js of a decode tile ending at je: to je, and
 * for paged K/V to the end of js's page (tile_len: the prefill tiles). */
FA_INLINE int64_t FA_NAME(seg_len)(const fa_ctx *c, int64_t js, int64_t je)
{
    return c->page ? FA_NAME(tile_len)(c, js, je - js) : je - js;
}

/* The prefetch streams of the segment of ns keys at js of the decode tile
 * [jt, je): qs for its Q.K^T (its K rows, then the next segment's K rows, or
 * after the tile's last segment its first V rows), ps for its P.V (its V
 * rows, then the next segment's V rows, or after the last one the next
 * tile's K rows).  One segment (contiguous K/V): tile_stream's, unchanged.
 * Paged tiles without them read each page's K rows cold: 0.69x of the
 * contiguous decode on the same memory (a paged view of it, Zen 3). */
FA_INLINE void FA_NAME(seg_streams)(const fa_ctx *c, int64_t jt, int64_t js, int64_t ns, int64_t je, fa_stream *qs,
                                     fa_stream *ps)
{
    *qs = *ps = FA_NAME(tile_stream)(c, js, ns);
    if (js + ns < je) {
        const fa_stream n = FA_NAME(tile_stream)(c, js + ns, FA_NAME(seg_len)(c, js + ns, je));
        qs->v = n.k; qs->vld = n.kld; qs->vrow = n.krow;
        ps->kn = n.v; ps->kld = n.vld; ps->krow = n.vrow; ps->nkn = n.nj;
    } else if (js > jt) {
        const fa_stream f = FA_NAME(tile_stream)(c, jt, FA_NAME(seg_len)(c, jt, je));
        qs->v = f.v; qs->vld = f.vld; qs->vrow = f.vrow;
    }
}

/* Paged 8-bit K/V: the per-token scales of the segment at js (a line or two
 * of each page's scales) prefetched a tile ahead; without it each segment's
 * scale_keys waited on their cache misses (perf, int8 GQA decode on 16-token
 * pages: a quarter of the kernel's samples on the scale loads).  Every line
 * of the span: a 16-token page's 64 bytes of scales straddle two lines
 * unless the pool is 64-byte aligned (NumPy's large arrays are 16), and with
 * only the first prefetched the scale loads still held 15% of the samples
 * (perf, B4 H32/8 S8192 D128 int8 decode, 16-token pages, Zen 3). */
FA_INLINE void FA_NAME(prefetch_scales)(const fa_ctx *c, int64_t js, int64_t je)
{
    if (!c->page || !(c->kts || c->vts) || js >= je) return;
    const fa_stream n = FA_NAME(tile_stream)(c, js, FA_NAME(seg_len)(c, js, je));
    if (n.ks) FA_PREFETCH_SPAN(n.ks, n.nj * c->kts_sl * (int64_t)sizeof(float), 2);
    if (n.vs) FA_PREFETCH_SPAN(n.vs, n.nj * c->vts_sl * (int64_t)sizeof(float), 2);
}

/* path_row1: a single query row whose K and V are read in place (the usual
 * decode step; kfuse && vfuse, R == 1, Dvp / VW in {4, 8, 12, 16}).  Long
 * tiles of FA_ROW_TN keys (also the row stride of S): one pass over the
 * tile's K rows (qk_rows), then over its V rows with the output row in
 * registers (pv_row1); 16-bit K and V continue one prefetch stream (st)
 * through both passes, float32 rows need none (see qk_rows).
 * Paged K/V: the tile's products run page by page (segments: the rows of
 * one page keep their strides), its mask and softmax once per tile.  Tiles
 * of one page each (16 keys) were 0.56-0.70x of the contiguous decode on
 * Zen 3 (B4 H8 S512-8192 D128 bf16), cache-resident ones too: the per-tile
 * softmax, not the reads.
 * nh > 1 (run_heads: paged, the tasks of nh consecutive kv heads of one
 * sequence and key range, each its own ctx and scratch): the heads' segments
 * of each page in turn, page by page, so that a page's rows of all nh heads
 * (adjacent in the native page layout) are read together rather than one
 * head's whole key range after another's; each head's operations are those
 * of its own task (nh = 1): the same bits.  Out of line (FA_PATH): run()
 * and run_heads() both call it, and inlined in both its products were
 * compiled twice (the sanitizer build of this stop's CI rehearsal took
 * 2305 s, against about 1500 s before). */
FA_PATH void FA_NAME(path_row1)(const fa_ctx *cs, const fa_ws *ws, int64_t nh)
{
    const fa_params *p = cs->p;
    const int64_t TN = FA_ROW_TN;
    for (int64_t jt = cs->jlo; jt < cs->jhi; jt += TN) { /* (every task of cs: the same keys) */
        const int64_t nj = fa_min64(TN, cs->jhi - jt), je = jt + nj;
        int mst[FA_HEADS_MAX];
        int any = 0;
        for (int64_t h = 0; h < nh; h++) {
            mst[h] = FA_NAME(tile_mask_state)(&cs[h], jt, nj);
            if (mst[h] != FA_TM_HIDDEN && FA_NAME(tile_hidden)(&cs[h], jt, nj)) mst[h] = FA_TM_HIDDEN;
            any |= mst[h] != FA_TM_HIDDEN;
        }
        if (!any) continue;
        for (int64_t js = jt, ns; js < je; js += ns) {
            ns = FA_NAME(seg_len)(cs, js, je);
            for (int64_t h = 0; h < nh; h++) {
                if (mst[h] == FA_TM_HIDDEN) continue;
                const fa_ctx *c = &cs[h];
                fa_stream st, ps;
                FA_NAME(seg_streams)(c, jt, js, ns, je, &st, &ps);
                FA_NAME(prefetch_scales)(c, js + TN, fa_min64(js + TN + ns, c->jhi));
                REAL *S = ws[h].S + (js - jt);
                FA_NAME(qk_rows_nd)(1, p->k_dtype, ws[h].Qs, c->Dp, st.k, p->k_sl, ns, S, TN, NULL, 0, 0, &st);
                if (c->kts) FA_NAME(scale_keys)(S, TN, 1, st.ks, c->kts_sl, ns);
            }
        }
        for (int64_t h = 0; h < nh; h++) {
            if (mst[h] == FA_TM_HIDDEN) continue;
            FA_NAME(mask_tile)(&cs[h], ws[h].S, TN, jt, nj, cs[h].elem_always && mst[h] != FA_TM_VISIBLE);
            FA_NAME(softmax_tile)(&cs[h], &ws[h], TN, nj);
        }
        for (int64_t js = jt, ns; js < je; js += ns) {
            ns = FA_NAME(seg_len)(cs, js, je);
            for (int64_t h = 0; h < nh; h++) {
                if (mst[h] == FA_TM_HIDDEN) continue;
                const fa_ctx *c = &cs[h];
                fa_stream qs, st;
                FA_NAME(seg_streams)(c, jt, js, ns, je, &qs, &st);
                REAL *P = ws[h].S + (js - jt);
                if (c->vts) FA_NAME(scale_keys)(P, TN, 1, st.vs, c->vts_sl, ns);
                FA_NAME(pv_row1_n)(c->Dvp / VW, p->v_dtype, P, ns, st.v, p->v_sl, ws[h].O, &st);
            }
        }
    }
}

/* path_rows: 1 < R <= FA_BLK_RD stacked rows (GQA decode, a few query
 * positions) or a single row that path_row1 does not take; FA_BLK_BN-key
 * tiles.  Q.K^T straight from the key rows (qk_rows; rows of another dtype
 * or of a D that is not whole vectors are converted to w->K first); its
 * software prefetch brings the tile's V rows (vpf) for P.V when V is read in
 * place.  P.V (pv_rows) reads V in place when vfuse, else from rows converted
 * to this kernel's dtype in w->V, and prefetches the next tile's K rows.
 * Paged K/V: segments of one page, as path_row1 (rows converted to w->K /
 * w->V page by page, then one product over the tile); each segment's P.V
 * prefetches the keys one tile later at the same offset. */
FA_INLINE void FA_NAME(path_rows)(const fa_ctx *c, const fa_ws *w)
{
    const fa_params *p = c->p;
    const int64_t TN = FA_BLK_BN, Dp = c->Dp, Dvp = c->Dvp;
    for (int64_t jt = c->jlo; jt < c->jhi; jt += TN) {
        const int64_t nj = fa_min64(TN, c->jhi - jt), je = jt + nj;
        const int mst = FA_NAME(tile_mask_state)(c, jt, nj);
        if (mst == FA_TM_HIDDEN || FA_NAME(tile_hidden)(c, jt, nj)) continue;
        if (!c->kfuse) /* rows of another dtype or D converted to w->K first, page by page */
            for (int64_t js = jt, ns; js < je; js += ns) {
                ns = FA_NAME(seg_len)(c, js, je);
                const fa_stream st = FA_NAME(tile_stream)(c, js, ns);
                FA_NAME(cvt_rows)(w->K + (js - jt) * Dp, Dp, st.k, st.kld, p->k_dtype, c->D, ns);
            }
        /* Q.K^T: page by page from the key rows, or the converted tile at once.
         * One call site of qk_rows_nd (it expands into a copy per row count,
         * dtype and head size: two sites doubled the compile, ASan's above all). */
        for (int64_t js = jt, ns; js < je; js += ns) {
            ns = c->kfuse ? FA_NAME(seg_len)(c, js, je) : nj;
            fa_stream st, ps;
            FA_NAME(seg_streams)(c, jt, js, ns, je, &st, &ps);
            FA_NAME(prefetch_scales)(c, js + TN, fa_min64(js + TN + ns, c->jhi));
            /* Paged: the stream of the segment's K rows, then the next segment's
             * (past the segment, K + t * ldk is another head's or page's rows);
             * V rows prefetched where they lie as the keys do. */
            const char *vpf = c->vfuse && (c->kfuse || !c->page) ? ps.v : NULL;
            FA_NAME(qk_rows_nd)(c->R, c->kfuse ? p->k_dtype : FA_SELF_DT, w->Qs, Dp,
                                c->kfuse ? (const void *)st.k : (const void *)w->K, c->kfuse ? p->k_sl : Dp, ns,
                                w->S + (js - jt), TN, vpf, p->v_sl * c->vsz, c->Dv * c->vsz,
                                c->page && c->kfuse ? &st : NULL);
        }
        for (int64_t js = jt, ns; js < je && c->kts; js += ns) { /* per-token K scales, page by page */
            ns = FA_NAME(seg_len)(c, js, je);
            const fa_stream st = FA_NAME(tile_stream)(c, js, ns);
            FA_NAME(scale_keys)(w->S + (js - jt), TN, c->R, st.ks, c->kts_sl, ns);
        }
        FA_NAME(mask_tile)(c, w->S, TN, jt, nj, c->elem_always && mst != FA_TM_VISIBLE);
        FA_NAME(softmax_tile)(c, w, TN, nj);
        for (int64_t js = jt, ns; js < je; js += ns) {
            ns = FA_NAME(seg_len)(c, js, je);
            const fa_stream st = FA_NAME(tile_stream)(c, js, ns);
            REAL *P = w->S + (js - jt);
            if (c->vts) FA_NAME(scale_keys)(P, TN, c->R, st.vs, c->vts_sl, ns);
            fa_stream next;
            const fa_stream *nx = NULL;
            if (c->kv_dram && js + TN < c->jhi) {
                next = FA_NAME(tile_stream)(c, js + TN, FA_NAME(seg_len)(c, js + TN, fa_min64(js + TN + ns, c->jhi)));
                nx = &next;
            }
            if (c->vfuse) {
                FA_NAME(pv_rows_n)(c->R, p->v_dtype, P, TN, ns, st.v, p->v_sl, w->O, Dvp, nx);
            } else { /* !vfuse implies !vdirect: V is never usable in place here */
                FA_NAME(cvt_rows)(w->V + (js - jt) * Dvp, Dvp, st.v, st.vld, p->v_dtype, c->Dv, ns);
                if (js + ns == je)
                    FA_NAME(pv_rows_n)(c->R, FA_SELF_DT, w->S, TN, nj, w->V, Dvp, w->O, Dvp, nx);
            }
        }
    }
}

/* Where key cc of a tile goes in the packed K (panels of FA_BLK_NR keys from
 * K, the last one, from key jl, wl keys wide), and that panel's row stride. */
FA_INLINE REAL *FA_NAME(panel_at)(REAL *K, int64_t D, int64_t jl, int64_t wl, int64_t cc, int64_t *ld)
{
    *ld = cc < jl ? FA_BLK_NR : wl;
    return cc < jl ? K + (cc / FA_BLK_NR) * D * FA_BLK_NR + cc % FA_BLK_NR : K + jl * D + (cc - jl);
}

/* Share q of nq of the next tile's K and V rows (st: tile_stream), prefetched
 * towards L2 while this tile's products run; of its packed K (kbytes at kp)
 * instead of its K rows where the head buffer holds it already. */
FA_INLINE void FA_NAME(prefetch_share)(const fa_stream *next, const REAL *kp, int64_t kbytes, int64_t q, int64_t nq)
{
    for (int64_t t = next->nj * q / nq, te = next->nj * (q + 1) / nq; t < te; t++) {
        if (!kp) FA_PREFETCH_ROW(next->k + t * next->kld, next->krow, 2);
        FA_PREFETCH_ROW(next->v + t * next->vld, next->vrow, 2);
    }
    if (kp) {
        const int64_t a = kbytes * q / nq / 64 * 64, b = kbytes * (q + 1) / nq;
        FA_PREFETCH_ROW((const char *)kp + a, b - a, 2);
    }
}

/* Scores of register block (mr rows at r0) x K panel pp of np (the last one wl keys wide). */
FA_INLINE void FA_NAME(qk_block_panel)(const fa_ctx *c, const fa_ws *w, const REAL *K, int mr, int64_t r0,
                                        int64_t pp, int64_t np, int64_t wl)
{
    FA_NAME(qk_ukernel_n)(mr, pp < np - 1 ? FA_BLK_NV : (int)(wl / VW), w->Qs + r0 * c->Dp,
                          K + pp * c->D * FA_BLK_NR, c->D, w->S + r0 * FA_BLK_BN + pp * FA_BLK_NR, FA_BLK_BN);
}

/* The register blocks x panels of one tile's Q.K^T over its packed K, in
 * the loop order of c->panel_outer (qk_packed); the next tile's rows (and
 * its packed K, where the head buffer holds it) prefetched on the way.  On a
 * fused tile (whole: nj = FA_BLK_BN) each block's softmax follows its
 * scores where row blocks run outer, else the tile's (softmax_block). */
FA_INLINE void FA_NAME(qk_blocks)(const fa_ctx *c, const fa_ws *w, const REAL *K, int64_t jt, int64_t nj,
                                   int partial, int fused, const fa_stream *next)
{
    const int64_t R = c->R;
    const int64_t np = (nj + FA_BLK_NR - 1) / FA_BLK_NR, jl = (np - 1) * FA_BLK_NR;
    const int64_t wl = fa_rup(nj - jl, VW);
    const REAL *nk = NULL; /* the next tile's packed K, when the head buffer holds it */
    int64_t nkb = 0;
    if (next && c->kh && jt + nj < w->st->upto) {
        nk = K + nj * c->D; /* the head buffer holds the tiles back to back */
        nkb = next->nj * c->D * (int64_t)sizeof(REAL);
    }
    const int64_t nb = FA_NAME(row_nblocks)(R);
    if (!c->panel_outer) {
        for (int64_t kb = 0; kb < nb; kb++) {
            int64_t r0, a, b;
            const int mr = FA_NAME(row_block)(R, nb, kb, &r0);
            FA_NAME(block_keys)(c, partial, r0, mr, jt, nj, &a, &b);
            if (next) FA_NAME(prefetch_share)(next, nk, nkb, kb, nb);
            for (int64_t pp = a / FA_BLK_NR; pp * FA_BLK_NR < b; pp++) /* the panels that hold keys [a, b) */
                FA_NAME(qk_block_panel)(c, w, K, mr, r0, pp, np, wl);
            if (fused) FA_NAME(softmax_block)(c, w, r0, mr);
        }
        return;
    }
    for (int64_t pp = 0; pp < np; pp++)
        for (int64_t kb = 0; kb < nb; kb++) {
            int64_t r0, a, b;
            const int mr = FA_NAME(row_block)(R, nb, kb, &r0);
            FA_NAME(block_keys)(c, partial, r0, mr, jt, nj, &a, &b);
            if (next) FA_NAME(prefetch_share)(next, nk, nkb, pp * nb + kb, np * nb);
            if (pp * FA_BLK_NR < b && (pp + 1) * FA_BLK_NR > a) /* panel pp holds keys of [a, b) */
                FA_NAME(qk_block_panel)(c, w, K, mr, r0, pp, np, wl);
        }
    if (fused) FA_NAME(softmax_block)(c, w, 0, R);
}

/* Q.K^T of the prefill path for one tile: K packed into panels of FA_BLK_NR
 * keys (w->K, converted on the way), then register blocks of FA_BLK_MR rows x
 * one panel (qk_ukernel).  The last panel is only as wide as its keys rounded
 * up to whole vectors (wl): a 16-key tile of a 32-key panel kernel computed
 * twice its products and cleared a panel of padding (on (1, 8, 16, 64) the
 * padded half was an eighth of the call).  Its lanes past nj are zeros.
 * On a partial tile each block computes only the panels of its keys
 * (block_keys); mask_row then sets the scores of its vectors that the row
 * may not see to -inf.
 * Loop order: row blocks outer, so that a block's queries are read once and
 * the K tile (BN x Dp) stays in L1 across the blocks, while it fits there
 * (c->panel_outer clear).  A larger tile (float32 D = 128 on a 32 KiB L1:
 * 32 KiB) was read again from L2 by every row block; panels outer keep one
 * panel (NR x Dp) in L1 and read the query blocks once per panel instead,
 * which is less L2 traffic whenever FA_BLK_MR < FA_BLK_NR (np * R * Dp
 * values against nb * BN * Dp).  Same products in the same order per score:
 * the same bits.  Measured on Zen 3 (avx2, 32 KiB L1, same binary
 * alternated in one process, 2 threads / 1 thread): B1 H8 L2048 D128 1.03 /
 * 1.05, L1024 D128 1.05, B1 H4 L1024 D256 1.02; D = 64 (16 KiB tile) keeps
 * the row order (1.01 with panels outer). */
FA_INLINE void FA_NAME(qk_packed)(const fa_ctx *c, const fa_ws *w, const fa_stream *st, int64_t jt, int64_t nj,
                                   int partial, int fused, const fa_stream *next)
{
    const fa_params *p = c->p;
    const int64_t D = c->D;
    const int64_t np = (nj + FA_BLK_NR - 1) / FA_BLK_NR, jl = (np - 1) * FA_BLK_NR;
    const int64_t wl = fa_rup(nj - jl, VW); /* the last panel's width: VW <= wl <= FA_BLK_NR */
    /* The tile's panels: in the head buffer (the tile of keys [jt, jt + nj) at
     * (jt - jlo) * D; packed already where jt < upto, which grows only over
     * consecutive tiles (a hidden tile leaves a gap: the tiles after it are
     * packed each time), or in the tile buffer. */
    REAL *const K = c->kh ? c->kh + (jt - c->jlo) * D : w->K;
    fa_scratch_state *hs = w->st;
    if (c->kh && jt < hs->upto) {
        FA_NAME(qk_blocks)(c, w, K, jt, nj, partial, fused, next);
        return;
    }
    if (c->kh && jt == hs->upto) hs->upto = jt + nj;
    /* Lanes past nj within the last vector are cleared by one memset (a store
     * per element, a panel row apart, was a fifth of a small call's time). */
    if (nj - jl < wl) memset(K + jl * D, 0, (size_t)(D * wl) * sizeof(REAL));
    int64_t cc = 0;
#if defined(FA_HAVE_PACK8)
    /* Groups of 8 keys of a float32 K: 8 x 8 transposes (panel widths are
     * multiples of VW, so a group never straddles two panels). */
    if (p->k_dtype == FA_F32)
        for (; cc + 8 <= nj; cc += 8) {
            const float *ks = (const float *)(st->k + cc * st->kld);
            int64_t ld;
            REAL *kp = FA_NAME(panel_at)(K, D, jl, wl, cc, &ld);
            int64_t d = 0;
            for (; d + 8 <= D; d += 8) fa_pack8x8(ks + d, p->k_sl, kp + d * ld, ld);
            for (; d < D; d++)
                for (int u = 0; u < 8; u++) kp[d * ld + u] = ks[u * p->k_sl + d];
        }
    /* Other K dtypes (16- and 8-bit): groups of 8 keys converted (and scaled
     * by their per-token scales) into w->tmp, then transposed 8 x 8 as float32
     * K is; the same values as the key-by-key loop below, which stored
     * each element alone (a tenth of an int8 L2048 causal prefill by perf). */
    else
        for (; cc + 8 <= nj; cc += 8) {
            for (int64_t u = 0; u < 8; u++) {
                REAL *t = w->tmp + u * c->Dp;
                fa_cvt_row(t, st->k + (cc + u) * st->kld, p->k_dtype, D);
                if (c->kts) FA_NAME(scale_row)(t, D, (REAL)st->ks[(cc + u) * c->kts_sl]);
            }
            int64_t ld;
            REAL *kp = FA_NAME(panel_at)(K, D, jl, wl, cc, &ld);
            int64_t d = 0;
            for (; d + 8 <= D; d += 8) fa_pack8x8(w->tmp + d, c->Dp, kp + d * ld, ld);
            for (; d < D; d++)
                for (int u = 0; u < 8; u++) kp[d * ld + u] = w->tmp[u * c->Dp + d];
        }
#endif
    for (; cc < nj; cc++) {
        int64_t ld;
        REAL *kp = FA_NAME(panel_at)(K, D, jl, wl, cc, &ld);
        const char *ks = st->k + cc * st->kld;
        const REAL *kr = (const REAL *)ks;
        if (p->k_dtype != FA_SELF_DT) { fa_cvt_row(w->tmp, ks, p->k_dtype, D); kr = w->tmp; }
        if (c->kts) { /* the key's per-token scale, on its packed row */
            const REAL ts = (REAL)st->ks[cc * c->kts_sl];
            for (int64_t d = 0; d < D; d++) kp[d * ld] = kr[d] * ts;
        } else
            for (int64_t d = 0; d < D; d++) kp[d * ld] = kr[d];
    }
    FA_NAME(qk_blocks)(c, w, K, jt, nj, partial, fused, next);
}

/* P.V of the prefill path for one tile (st: its V rows).
 * P.V reads V in column blocks of PW = FA_BLK_NVO*VW values.  Read in place, the
 * rows of a block lie one row stride apart; with few rows per task (GQA
 * decode with large groups) they come from DRAM that way, and with long
 * rows (Dv > 128) a power-of-two stride maps a block to a few L1 sets that
 * evict each other (the D = 256 profile: ~38% of samples on V loads).
 * Then V is first copied row by row into column panels (the panel of
 * columns [c0, c0 + wd) holds nj rows of wd values at w->V + c0 * FA_BLK_BN,
 * wd = PW, or VW after the full panels), converted on the way.
 * Measured (Zen 3, standalone builds in one process): B1 H16/1 S32768
 * decode +15-20%, H128/8 +10%, D = 256 prefill +9-14% on one thread,
 * D = 160 +4-7%; with many rows and Dv <= 128 it was mixed (-6..+8%), so
 * those keep reading V in place, as do tiles of at most FA_VPANEL_MIN_KEYS
 * keys (small calls) with Dv <= 128. */
FA_INLINE void FA_NAME(pv_prefill)(const fa_ctx *c, const fa_ws *w, const fa_stream *st, int64_t jt, int64_t nj,
                                    int partial)
{
    const fa_params *p = c->p;
    const int64_t R = c->R, Dvp = c->Dvp, PW = FA_BLK_NVO * VW;
    const REAL *V = (const REAL *)st->v;
    const int64_t ldv = p->v_sl;
    const int vpanel = !c->vdirect || (R <= FA_VPANEL_ROWS && nj > FA_VPANEL_MIN_KEYS) || Dvp > 128;
    const int64_t Dfull = Dvp / PW * PW;
    if (vpanel)
        for (int64_t jj = 0; jj < nj; jj++) {
            const REAL *src = (const REAL *)(st->v + jj * st->vld);
            if (!c->vdirect) {
                FA_NAME(cvt_rows)(w->tmp, Dvp, st->v + jj * st->vld, 0, p->v_dtype, c->Dv, 1);
                if (c->vts) /* the key's per-token V scale, on its converted row */
                    FA_NAME(scale_row)(w->tmp, c->Dv, (REAL)st->vs[jj * c->vts_sl]);
                src = w->tmp;
            }
            for (int64_t c0 = 0; c0 < Dfull; c0 += PW)
                for (int64_t cc = 0; cc < PW; cc += VW) vf_store(w->V + c0 * FA_BLK_BN + jj * PW + cc, vf_load(src + c0 + cc));
            for (int64_t c0 = Dfull; c0 < Dvp; c0 += VW) vf_store(w->V + c0 * FA_BLK_BN + jj * VW, vf_load(src + c0));
        }
    /* Column blocks outer: a block of V (nj x wd) stays in L1 across the row blocks. */
    int64_t c0 = 0;
    for (; c0 < Dfull; c0 += PW) {
        const REAL *Vb = vpanel ? w->V + c0 * FA_BLK_BN : V + c0;
        const int64_t ldb = vpanel ? PW : ldv;
        for (int64_t kb = 0, nb = FA_NAME(row_nblocks)(R); kb < nb; kb++) {
            int64_t r0, a, b;
            const int mr = FA_NAME(row_block)(R, nb, kb, &r0);
            FA_NAME(block_keys)(c, partial, r0, mr, jt, nj, &a, &b);
            FA_NAME(pv_ukernel_n)(mr, FA_BLK_NVO, w->S + r0 * FA_BLK_BN + a, FA_BLK_BN, b - a, Vb + a * ldb, ldb,
                                  w->O + r0 * Dvp + c0, Dvp);
        }
    }
    for (; c0 < Dvp; c0 += VW) {
        const REAL *Vb = vpanel ? w->V + c0 * FA_BLK_BN : V + c0;
        const int64_t ldb = vpanel ? VW : ldv;
        for (int64_t kb = 0, nb = FA_NAME(row_nblocks)(R); kb < nb; kb++) {
            int64_t r0, a, b;
            const int mr = FA_NAME(row_block)(R, nb, kb, &r0);
            FA_NAME(block_keys)(c, partial, r0, mr, jt, nj, &a, &b);
            FA_NAME(pv_ukernel_n)(mr, 1, w->S + r0 * FA_BLK_BN + a, FA_BLK_BN, b - a, Vb + a * ldb, ldb,
                                  w->O + r0 * Dvp + c0, Dvp);
        }
    }
}

/* Whether a tile whose float mask is all at or below -FA_MASK_HUGE (HF's
 * finfo.min padding: FA_TM_HUGE) can be skipped with the same bits as
 * computing it: when every row of the task has a running max m above -1e29
 * (it has seen a key of ordinary logit) and every logit the tile's products
 * could give is below 1e29 in magnitude (D max|Q| max|K| over the task's
 * scaled rows and the tile's keys, all finite: a NaN or inf keeps the tile,
 * which then makes its rows NaN as the reference does).  Then each of the
 * tile's logits is below -1.3e30, at least 1.2e30 under m and under every
 * later max: exp2 underflows to exactly 0, the max, the sums and O are
 * unchanged.  A row that has seen only such keys (left padding, a row of
 * padding) keeps the tile: its softmax is over those keys.  *qmax caches
 * max|Q| for the task (negative: not yet computed).  Cost: one read of the
 * tile's K rows, against its R x nj x (D + Dv) multiply-adds. */
FA_INLINE int FA_NAME(huge_tile_skips)(const fa_ctx *c, const fa_ws *w, const fa_stream *st, int64_t nj, double *qmax)
{
    if (fa_dtype_8(c->p->k_dtype)) return 0; /* (8-bit K: its bound would need the scales) */
    for (int64_t r = 0; r < c->R; r++)
        if (!(w->m[r] > (REAL)-1e29)) return 0; /* (NaN: not skipped) */
    if (*qmax < 0) *qmax = fa_absmax(w->Qs, FA_SELF_DT, 1, c->R * c->Dp, 0);
    if (!(*qmax < INFINITY)) return 0;
    const double kmax = fa_absmax(st->k, c->p->k_dtype, nj, c->D, st->kld);
    return kmax < INFINITY && (double)c->D * *qmax * kmax < 1e29;
}

/* Dropout of a tile's probabilities (nj keys at jt; rows of stride TN), after
 * the softmax has summed them into l (the normaliser is the undropped one) and
 * before P.V reads them: each kept entry times 1 / (1 - p), the others 0
 * (dropout.h).  Every row over all nj keys: values that P.V does not read
 * (outside a partial tile's blocks) are multiplied too, harmlessly. */
FA_INLINE void FA_NAME(dropout_tile)(const fa_ctx *c, const fa_ws *w, int64_t TN, int64_t jt, int64_t nj)
{
    const fa_params *p = c->p;
    uint32_t u[FA_BLK_BN + 16]; /* >= fa_dropout_words_len(jt, nj) */
    REAL z[FA_BLK_BN];
    /* (dropout's constants are derived here, per tile, not in fa_ctx: run(),
     * which holds the decode paths, then compiles as it did without dropout) */
    const int32_t thr = FA_DROP_FLIP(fa_dropout_thr32(p->dropout_p));
    const REAL ks = (REAL)fa_dropout_keep_scale(p->dropout_p);
    for (int64_t r = 0; r < c->R; r++) {
        const int64_t h = c->t->hk * c->G + r / c->ni, i = c->t->i0 + r % c->ni;
        fa_dropout_words(p->dropout_seed, p->dropout_b0 + c->b, h, i, jt, nj, u);
        const uint32_t *uj = u + (jt & 7);
        REAL *s = w->S + r * TN;
        /* The factors first, in a local array (so that the loop vectorises:
         * the scratch may alias u as far as the compiler knows), then one
         * product (FA_DROP_FLIP: a branch-free select). */
        for (int64_t jj = 0; jj < nj; jj++) z[jj] = FA_DROP_FLIP(uj[jj]) >= thr ? ks : (REAL)0;
        for (int64_t jj = 0; jj < nj; jj++) s[jj] *= z[jj];
    }
}

/* path_prefill: more than FA_BLK_RD stacked rows; FA_BLK_BN-key tiles, K
 * packed into panels and both products register-blocked (qk_packed,
 * pv_prefill). */
FA_PATH void FA_NAME(path_prefill)(const fa_ctx *c, const fa_ws *w)
{
    const int64_t TN = FA_BLK_BN;
    double qmax = -1.0; /* huge_tile_skips' max|Q|, computed at the task's first such tile */
    for (int64_t jt = c->jlo, nj; jt < c->jhi; jt += nj) {
        nj = FA_NAME(tile_len)(c, jt, TN);
        const fa_stream st = FA_NAME(tile_stream)(c, jt, nj);
        const int mst = FA_NAME(tile_mask_state)(c, jt, nj);
        if (mst == FA_TM_HIDDEN || FA_NAME(tile_hidden)(c, jt, nj)) continue;
        if (mst == FA_TM_HUGE && FA_NAME(huge_tile_skips)(c, w, &st, nj, &qmax)) continue;
        const int partial = FA_NAME(tile_partial)(c, jt, nj);
        const int elem = c->elem_always && mst != FA_TM_VISIBLE; /* this tile per element */
        /* The next tile's K and V rows are prefetched while this tile's
         * products run (spread over the register blocks of Q.K^T): a task
         * reads each K and V row once from beyond L2, and the transposes
         * that pack K (and P.V reading V in place) waited on those loads
         * (B4 H8 L512 causal, perf: the K packing 6.6% of the samples for
         * ~2% of the operations). */
        fa_stream next;
        const fa_stream *nx = NULL;
        if (jt + nj < c->jhi) {
            next = FA_NAME(tile_stream)(c, jt + nj, FA_NAME(tile_len)(c, jt + nj, TN));
            nx = &next;
        }
        /* A whole tile that needs no mask takes its softmax in qk_packed,
         * in one pass (softmax_block). */
        const int fused = !partial && nj == TN && !elem;
        FA_NAME(qk_packed)(c, w, &st, jt, nj, partial, fused, nx);
        if (!partial && !fused) {
            FA_NAME(mask_tile)(c, w->S, TN, jt, nj, elem);
            FA_NAME(softmax_tile)(c, w, TN, nj);
        } else if (partial) {
            /* Each register block's rows masked and normalised over the
             * vectors of its keys only, the scores its P.V reads (masking
             * whole rows was 3.9% of a B4 H8 L512 causal call). */
            for (int64_t kb = 0, nb = FA_NAME(row_nblocks)(c->R); kb < nb; kb++) {
                int64_t r0, a, b;
                const int mr = FA_NAME(row_block)(c->R, nb, kb, &r0);
                FA_NAME(block_keys)(c, partial, r0, mr, jt, nj, &a, &b);
                const int64_t va = a / VW * VW, vb = fa_rup(b, VW);
                for (int64_t r = r0; r < r0 + mr && a < b; r++) {
                    FA_NAME(mask_row)(c, w->S + r * TN, r, jt, nj, va, vb, partial, elem);
                    FA_NAME(softmax_row_lazy)(c, w, TN, r, va, vb, nj);
                }
            }
        }
        if (c->p->dropout_p > 0.0) FA_NAME(dropout_tile)(c, w, TN, jt, nj);
        FA_NAME(pv_prefill)(c, w, &st, jt, nj, partial);
    }
}

enum { FA_PATH_PREFILL, FA_PATH_ROWS, FA_PATH_ROW1 };

/* A task's constants (c) and its scratch carved (w), Q loaded; returns the
 * path that runs it.  drop: the task applies dropout (run_dropout). */
FA_INLINE int FA_NAME(task_init)(const fa_params *p, const fa_task *t, void *scratch, int drop, fa_ctx *c, fa_ws *w)
{
    FA_NAME(carve)(p, t->rows, scratch, w);
    c->p = p;
    c->t = t;
    c->G = p->Hq / p->Hk;
    c->D = p->D;
    c->Dv = p->Dv;
    c->b = t->b;
    c->Dp = fa_rup(c->D, VW);
    c->Dvp = fa_rup(c->Dv, VW);
    c->bi = fa_batch_info(p, c->b);
    c->delta = c->bi.Sb - c->bi.Lb;
    c->ni = fa_min64(t->ni, c->bi.Lb - t->i0);
    if (c->ni < 0) c->ni = 0;
    c->R = c->G * c->ni;
    /* Every buffer of the scratch holds cap_rows rows (attention.c checks the
     * whole scratch with a guard zone in debug builds). */
    FA_DEBUG_CHECK(c->G * t->ni <= FA_NAME(cap_rows)(p, t->rows), "task stacks more rows than its scratch holds");
    c->use_log2 = p->softcap == 0.0;
    c->ksz = (int64_t)fa_dtype_size(p->k_dtype);
    c->vsz = (int64_t)fa_dtype_size(p->v_dtype);
    /* Paged: tile_stream finds each tile's rows (and per-token scales) through
     * the block table; k_sb is then a page stride, not a batch one. */
    c->page = p->block_table ? p->page_size : 0;
    c->page_shift = -1;
    if (c->page > 0 && (c->page & (c->page - 1)) == 0)
        for (c->page_shift = 0; ((int64_t)1 << c->page_shift) < c->page; c->page_shift++) {}
    c->bt = p->block_table ? p->block_table + c->b * p->bt_sb : NULL;
    c->kbase = (const char *)p->k + (c->page ? 0 : (c->b * p->k_sb + t->hk * p->k_sh + c->bi.koff * p->k_sl) * c->ksz);
    c->vbase = (const char *)p->v + (c->page ? 0 : (c->b * p->v_sb + t->hk * p->v_sh + c->bi.koff * p->v_sl) * c->vsz);
    const int kdirect = p->k_dtype == FA_SELF_DT && c->D % VW == 0;
    c->vdirect = p->v_dtype == FA_SELF_DT && c->Dv % VW == 0;
    /* The decode paths widen 16- and 8-bit K/V rows as they load them. */
    const int wide16 = sizeof(REAL) == 4;
    c->kfuse = c->D % VW == 0 && (kdirect || (wide16 && (fa_dtype_16(p->k_dtype) || fa_dtype_8(p->k_dtype))));
    c->vfuse = c->Dv % VW == 0 && (c->vdirect || (wide16 && (fa_dtype_16(p->v_dtype) || fa_dtype_8(p->v_dtype))));
    /* 8-bit scales (fa_ctx): a per-token one at key 0 of this (batch, kv
     * head), else a per-channel (or per-head) one. */
    c->kts = c->vts = c->kcs = c->vcs = NULL;
    c->kts_sl = c->vts_sl = c->kcs_sd = c->vcs_sd = 0;
    if (p->k_scale) {
        if (p->ks_sl) { /* per token (paged: with the pages, tile_stream) */
            c->kts = p->k_scale + (c->page ? 0 : c->b * p->ks_sb + t->hk * p->ks_sh + c->bi.koff * p->ks_sl);
            c->kts_sl = p->ks_sl;
        } else { c->kcs = p->k_scale + c->b * p->ks_sb + t->hk * p->ks_sh; c->kcs_sd = p->ks_sd; }
    }
    if (p->v_scale) {
        if (p->vs_sl) {
            c->vts = p->v_scale + (c->page ? 0 : c->b * p->vs_sb + t->hk * p->vs_sh + c->bi.koff * p->vs_sl);
            c->vts_sl = p->vs_sl;
        } else { c->vcs = p->v_scale + c->b * p->vs_sb + t->hk * p->vs_sh; c->vcs_sd = p->vs_sd; }
    }

    /* Key range any row may see, and the range every row sees (visible ranges
     * grow with the row: the first row has the smallest lo, the last the
     * largest hi, mask.h). */
    c->jlo = c->jhi = c->flo = c->fhi = 0;
    if (c->R > 0) {
        int64_t lo0, hi0, lo1, hi1;
        fa_row_range(p, t->i0 + c->delta, c->bi.Sb, &lo0, &hi0);
        fa_row_range(p, t->i0 + c->ni - 1 + c->delta, c->bi.Sb, &lo1, &hi1);
        c->jlo = fa_max64(lo0, t->j0);
        c->jhi = fa_min64(hi1, fa_min64(t->j1, c->bi.Sb));
        c->flo = lo1;
        c->fhi = hi0;
    }
    c->elem_always = p->mask_kind != FA_MASK_NONE || p->alibi || !c->use_log2 || p->bmask;
    c->mask_only = p->mask_kind != FA_MASK_NONE && !p->alibi && c->use_log2 && !p->bmask;
    /* Q.K^T's loop order (qk_packed): panel by panel when the packed K tile
     * would not stay in L1 beside a block's queries and scores (over 3/4 of
     * L1d; 32 KiB where cpuid does not tell). */
    {
        int64_t l1d, l2, l3;
        fa_cache_sizes(&l1d, &l2, &l3);
        if (l1d <= 0) l1d = 32768;
        c->panel_outer = (int64_t)(FA_BLK_BN * sizeof(REAL)) * c->Dp * 4 > 3 * l1d;
        /* The call's K and V come from DRAM where they are over half the L3
         * (an unknown L3: assumed so): then path_rows has P.V prefetch the
         * next tile's K (pv_rows; where they stayed in L3 between calls that
         * prefetch cost 3-8%). */
        const int64_t kv_bytes = p->B * p->Hk * p->S * (p->D * c->ksz + p->Dv * c->vsz);
        c->kv_dram = l3 <= 0 || kv_bytes > l3 / 2;
    }

    /* The path, chosen once per task.  A single row read in place takes
     * path_row1 when its output row fits pv_row1's registers (its long tile
     * fits the S scratch: cap_rows keeps at least FA_ROW_TN / FA_BLK_BN rows);
     * other tasks of at most FA_BLK_RD rows take path_rows; the rest, and
     * every task with dropout (applied to the probability tiles of
     * path_prefill only: dropout is for training, whose calls are prefill
     * shapes), path_prefill. */
    const int64_t nvo = c->Dvp / VW;
    const int rows = c->R <= FA_BLK_RD && !drop;
    const int row1 = c->R == 1 && rows && c->kfuse && c->vfuse && (nvo == 4 || nvo == 8 || nvo == 12 || nvo == 16);
    FA_NAME(load_q)(c, w, !rows); /* path_prefill's Q is packed by register block */
    /* The head K buffer (head_keys), when this task's keys fit it: a fresh
     * (batch, kv head, key range) starts it empty. */
    c->kh = NULL;
    if (!rows && w->Kh && c->jhi - c->jlo <= w->kh_keys) {
        fa_scratch_state *hs = w->st;
        if (!(hs->valid && hs->b == c->b && hs->hk == t->hk && hs->j0 == c->jlo && hs->j1 == c->jhi)) {
            hs->valid = 1; hs->b = c->b; hs->hk = t->hk; hs->j0 = c->jlo; hs->j1 = c->jhi; hs->upto = c->jlo;
        }
        c->kh = w->Kh;
    }
    return row1 ? FA_PATH_ROW1 : rows ? FA_PATH_ROWS : FA_PATH_PREFILL;
}

#define FA_RUN_NAME run
#define FA_RUN_DROP 0
#include "kernel_run.h"
#undef FA_RUN_NAME
#undef FA_RUN_DROP
#define FA_RUN_NAME run_dropout
#define FA_RUN_DROP 1
#include "kernel_run.h"
#undef FA_RUN_NAME
#undef FA_RUN_DROP

/* Decode tasks of n <= FA_HEADS_MAX consecutive kv heads of one sequence
 * and key range (t[0], t[stride], ...; kernel.h), each with its own part of
 * the scratch (part bytes apart), run together by path_row1; tasks it does
 * not take run one by one. */
FA_PATH void FA_NAME(run_heads)(const fa_params *p, const fa_task *t, int64_t n, int64_t stride, void *scratch,
                                size_t part)
{
    fa_ctx c[FA_HEADS_MAX];
    fa_ws w[FA_HEADS_MAX];
    int row1 = n >= 1 && n <= FA_HEADS_MAX;
    for (int64_t h = 0; h < n && row1; h++)
        row1 = FA_NAME(task_init)(p, &t[h * stride], (char *)scratch + h * part, 0, &c[h], &w[h]) == FA_PATH_ROW1;
    if (!row1) { /* (n < 1: nothing) */
        for (int64_t h = 0; h < n; h++) FA_NAME(run)(p, &t[h * stride], (char *)scratch + h * part);
        return;
    }
    FA_NAME(path_row1)(c, w, n);
    for (int64_t h = 0; h < n; h++) FA_NAME(write_out)(&c[h], &w[h]);
}

#ifndef FA_BLK_BMR_SHORT
#define FA_BLK_BMR_SHORT FA_BLK_BMR
#endif
#ifndef FA_BLK_ROWS_MAX
#define FA_BLK_ROWS_MAX 1024
#endif
const fa_kernel FA_NAME(fa_kernel) = { FA_NAME(scratch_bytes), FA_NAME(run), FA_BLK_BMR, FA_BLK_BMR_SHORT, FA_BLK_BN,
                                       FA_BLK_ROWS_MAX, FA_BLK_MR, FA_NAME(row_bytes), FA_BAND_L2, 1,
                                       FA_NAME(run_dropout), FA_NAME(run_heads) };

#if defined(FA_ISA_SUFFIX)
/* Test hook: the vectorised exp2 of this ISA over n values. */
void FA_CAT(fa_exp2, FA_ISA_SUFFIX)(const float *x, float *y, int64_t n)
{
#if VW > 1
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vf_store(y + i, vf_exp2(vf_load(x + i)));
    if (i < n) {
        float tx[VW], ty[VW];
        for (int64_t k = 0; k < VW; k++) tx[k] = i + k < n ? x[i + k] : 0.0f;
        vf_store(ty, vf_exp2(vf_load(tx)));
        for (int64_t k = 0; i + k < n; k++) y[i + k] = ty[k];
    }
#else
    for (int64_t i = 0; i < n; i++) y[i] = (float)vf_exp2((REAL)x[i]);
#endif
}
#endif
