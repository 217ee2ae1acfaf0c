/* tiles.c: the machine's caches, and the query block (stacked rows per task)
 * of the forward kernels derived from them.
 *
 * Why the row block follows L2: a task holds, for each of its R rows, the
 * scaled query (Dp values), one tile of scores (BN) and the output
 * accumulator (Dvp), and streams every K/V tile of its key range past them.
 * Those R rows are touched once per key tile, so they must stay in the core's
 * L2; and the larger R, the fewer times K and V are read again (once per task,
 * from L3 or memory).  So R is the largest multiple of the register block
 * that keeps the rows' working set within a fraction FA_L2_SHARE of L2,
 * clamped to [the kernel's short block, the kernel's rows_max]:
 *
 *     R = FA_L2_SHARE * L2 / row_bytes(D, Dv),  row_bytes = (Dp + BN + Dvp) * sizeof(REAL)
 *
 * (kernel_impl.h; the AMX kernel's rows hold bf16 queries and fp32 outputs, its
 * scores live per group of 32 rows, and its rows_max is the measured 512).
 * The kernels' long-sequence constants were measured before this rule; the
 * share reproduces them where they were measured (Zen 3, 512 KiB L2, AVX2,
 * BN = 64, D = 64: 0.28 * 512 KiB / 768 B = 191 -> 192 measured best, +13-20%
 * on L4096 against 96).  Short sequences (L < FA_LONG_L) take it only while
 * the call keeps FA_MIN_TASKS tasks (balance over threads decides there), and
 * causal and windowed calls follow their own rule (fa_rows_per_task).  Head
 * dims above 128 follow the same rule: their rows are larger, so a small L2
 * gives the short block anyway (Zen 3, D = 256: 62 rows -> 96), and a large
 * one more (Sapphire Rapids, 2 MiB: 228 rows for float32 D = 256, 324 for
 * D = 160, 256 for bf16 D = 256).  Measured there, the blocks alternated in one
 * process, 2 threads, ratio over the short block (96 rows float32, 128 bf16)
 * the rule kept for D > 128 before: float32 B1 H8 L1024 D256 1.10, B1 H4
 * L2048 D256 1.16, B1 H8 L1024 D160 1.13; causal L1024 D256 1.08, L2048 D160
 * 1.11; bf16 (AMX) L1024 D256 1.22, L2048 D160 1.14.
 * FASTATTN_TILES (fastattn._config) overrides R for measurement.
 *
 * Cache sizes: cpuid's deterministic cache parameters (leaf 4 on Intel,
 * 0x8000001D on AMD), read once; 0 where unknown (then the kernel's compiled
 * constants apply). */
#include <stdatomic.h>
#include <string.h>
#include "kernel.h"
#include "tiles.h"

#if defined(FA_HAVE_X86)
#include <cpuid.h>

/* Size in bytes of the data/unified cache of each level (1..3) from a
 * leaf-4-format cpuid leaf (4 or 0x8000001D); 0 for a level not found. */
static void fa_read_caches(unsigned leaf, int64_t size[4])
{
    for (unsigned sub = 0; sub < 16; sub++) {
        unsigned a, b, c, d;
        __cpuid_count(leaf, sub, a, b, c, d);
        const unsigned type = a & 31, level = (a >> 5) & 7;
        if (type == 0) break;       /* no more caches */
        if (type == 2) continue;    /* instruction cache */
        if (level < 1 || level > 3) continue;
        const int64_t ways = (int64_t)((b >> 22) & 1023) + 1, parts = (int64_t)((b >> 12) & 1023) + 1;
        const int64_t line = (int64_t)(b & 4095) + 1, sets = (int64_t)c + 1;
        size[level] = ways * parts * line * sets;
    }
}

static void fa_detect_caches(int64_t size[4])
{
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    const unsigned maxleaf = a;
    char vendor[13];
    memcpy(vendor, &b, 4); memcpy(vendor + 4, &d, 4); memcpy(vendor + 8, &c, 4);
    vendor[12] = 0;
    if (strcmp(vendor, "AuthenticAMD") == 0 || strcmp(vendor, "HygonGenuine") == 0) {
        /* 0x8000001D exists when cpuid 0x80000001 ECX bit 22 (TopologyExtensions) is set. */
        if (__get_cpuid(0x80000001, &a, &b, &c, &d) && ((c >> 22) & 1)) fa_read_caches(0x8000001D, size);
    } else if (maxleaf >= 4) {
        fa_read_caches(4, size);
    }
}
#endif

/* Detected once; racing first callers compute and store the same values, and
 * `known` is published last (release), so a reader that sees it sees them. */
static atomic_llong fa_cache_l1d, fa_cache_l2, fa_cache_l3;
static atomic_int fa_cache_known;

void fa_cache_sizes(int64_t *l1d, int64_t *l2, int64_t *l3)
{
    if (!atomic_load_explicit(&fa_cache_known, memory_order_acquire)) {
        int64_t size[4] = { 0, 0, 0, 0 };
#if defined(FA_HAVE_X86)
        fa_detect_caches(size);
#endif
        atomic_store_explicit(&fa_cache_l1d, size[1], memory_order_relaxed);
        atomic_store_explicit(&fa_cache_l2, size[2], memory_order_relaxed);
        atomic_store_explicit(&fa_cache_l3, size[3], memory_order_relaxed);
        atomic_store_explicit(&fa_cache_known, 1, memory_order_release);
    }
    *l1d = atomic_load_explicit(&fa_cache_l1d, memory_order_relaxed);
    *l2 = atomic_load_explicit(&fa_cache_l2, memory_order_relaxed);
    *l3 = atomic_load_explicit(&fa_cache_l3, memory_order_relaxed);
}

/* The override of FASTATTN_TILES (0: none), set by fastattn._config at import
 * or by fastattn.set_tiles; a call reads it once. */
static atomic_llong fa_rows_override;

int fa_tiles_set_rows(int64_t rows)
{
    if (rows < 0 || rows > FA_ROWS_MAX) return -1;
    atomic_store_explicit(&fa_rows_override, rows, memory_order_relaxed);
    return 0;
}

int64_t fa_tiles_get_rows(void) { return atomic_load_explicit(&fa_rows_override, memory_order_relaxed); }

static int64_t fa_round_down(int64_t x, int64_t m) { return x / m * m; }

/* The L2 rule's block for head dims D, Dv (the rule above; the compiled
 * constant where the L2 size is unknown). */
static int64_t fa_rows_l2(const fa_kernel *k, int64_t D, int64_t Dv)
{
    int64_t l1d, l2, l3;
    fa_cache_sizes(&l1d, &l2, &l3);
    if (l2 <= 0) return k->block_rows;
    int64_t r = fa_round_down((int64_t)(FA_L2_SHARE * (double)l2) / k->row_bytes(D, Dv), k->row_multiple);
    if (r < k->block_rows_short) r = k->block_rows_short;
    if (r > k->rows_max) r = k->rows_max;
    return r;
}

int64_t fa_rows_per_task(const fa_kernel *k, const fa_params *p)
{
    const int64_t o = fa_tiles_get_rows();
    if (o > 0) return o < k->rows_max ? o : k->rows_max;
    /* Causal and windowed rows see a band.  The kernel_impl.h kernels skip
     * the masked keys of a diagonal tile per register block (block_keys), so
     * a block of R rows wastes about FA_BLK_MR / 2 keys per row rather than
     * R / 2 (they computed the R x R diagonal region whole before, and this
     * rule kept R within L / 16), and a larger block reads the band's K/V
     * fewer times, also for short sequences.  So they take the L2 rule at
     * every L, at most L / 2 (at least two tasks per head: the triangle's
     * last task holds the most work).  Measured on a Sapphire Rapids, float32
     * D64 causal, blocks alternated in one process (medians of 6-30 rounds,
     * ratio over the L / 16 rule's block, 2 threads / 1 thread): B4 H8 L512
     * 252 rows 1.055 / 1.10 (120 rows: 1.01); B1 H8 L1024 564 rows 1.07
     * (252: 1.01-1.05); L2048 504 rows 1.03 / 1.12; L4096 564 rows 1.03
     * (1020: 1.01).  The AMX kernel keeps its plain rule: bf16 B4 L512 causal
     * ran 0.91 / 0.94 at 256 rows against its 128, B1 L1024 0.96-0.98 at 256
     * against its 512. */
    const int band = p->causal || p->window_left >= 0 || p->window_right >= 0;
    if (band && k->band_rule == FA_BAND_L2) {
        int64_t r = fa_rows_l2(k, p->D, p->Dv);
        const int64_t cap = fa_round_down(p->L / 2, k->row_multiple);
        if (r > cap) r = cap;
        return r > k->block_rows_short ? r : k->block_rows_short;
    }
    if (p->L >= FA_LONG_L) return fa_rows_l2(k, p->D, p->Dv);
    /* Short sequences: the short block kept threads balanced on calls with few
     * heads, and cost K/V re-reads on calls with many.  The kernel_impl.h
     * kernels take the L2 block as long as the call keeps FA_MIN_TASKS tasks
     * (a shape-only rule: results never depend on the thread count).  Measured
     * on the Sapphire Rapids VM, float32, blocks alternated in one process,
     * 2 threads (1 thread), ratio over the 96-row short block: B4 H8 L512 D64
     * 512 rows 1.26 (1.17), 252 rows 1.19 (1.10); B4 H8 L512 D128 372 rows
     * 1.16; B2 H8 L256 128 rows 1.09, 256 rows 1.00; B1 H8 L512 128 rows 0.99,
     * 256 rows 1.05, 512 rows 0.97. */
    if (!k->short_l2) return k->block_rows_short;
    int64_t r = fa_rows_l2(k, p->D, p->Dv);
    /* The cap is not rounded to the register block: B4 H8 L512 at 512 rows is
     * one task per head, at 504 it would be two of 256 (near-equal blocks). */
    const int64_t cap = p->B * p->Hq * p->L / FA_MIN_TASKS;
    if (r > cap) r = cap;
    return r > k->block_rows_short ? r : k->block_rows_short;
}

int64_t fa_tiles_rows(int64_t D, int64_t Dv, int64_t L, int dtype, int causal, int64_t heads)
{
    fa_params p;
    memset(&p, 0, sizeof(p));
    p.B = 1;
    p.Hq = p.Hk = heads;
    p.L = L; p.S = L; p.D = D; p.Dv = Dv;
    p.q_dtype = p.k_dtype = p.v_dtype = p.o_dtype = dtype;
    p.window_left = p.window_right = -1;
    p.causal = causal;
    return fa_rows_per_task(fa_select_kernel(&p), &p);
}
