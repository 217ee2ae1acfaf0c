/* attention.c: the driver.  Splits the work into tasks that depend only on
 * the shapes (never on the thread count, so results are bit-identical for any
 * number of threads), runs them on OpenMP threads, and merges split-KV
 * partial results with the log-sum-exp rule. */
#include <fenv.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernel.h"
#include "mask.h"
#include "convert.h"
#include "tiles.h"
#include "fpenv.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if !defined(_WIN32)
#include <pthread.h>
#define FA_WS_CACHE 1
#endif

/* Split the keys when there are fewer tasks than this (shape-only rule). */
#define FA_SPLIT_TASKS 16
#define FA_SPLIT_MIN_KEYS 512
/* Calls with less work than this (multiply-adds) run on the calling thread:
 * starting a thread team costs more than it saves.  Tasks do not depend on
 * the thread count, so neither do the results. */
#define FA_SERIAL_MACS (1 << 19)
/* The most threads one call uses (fastattn/_checks.py rejects more): far
 * above any core count this library targets, far below what makes libgomp
 * try to allocate a team it cannot hold. */
#define FA_MAX_THREADS 1024
/* Per-thread scratch up to this size is kept for the thread's next call;
 * larger scratch (head dims in the thousands) is freed after the call, so one
 * odd call does not pin hundreds of MiB per thread. */
#define FA_WS_KEEP ((size_t)16 << 20)
#define FA_WS_GUARD 64 /* debug builds: guard bytes after the scratch */

/* Per-thread scratch, kept between calls (bounded by the tile sizes, freed
 * when the thread exits) so that small calls do not pay malloc/mmap and
 * page faults every time. */
#if defined(FA_WS_CACHE)
typedef struct fa_ws_hdr { size_t n; size_t pad[7]; } fa_ws_hdr;
static pthread_key_t fa_ws_key;
static pthread_once_t fa_ws_once = PTHREAD_ONCE_INIT;
static int fa_ws_key_ok;
static void fa_ws_free(void *h) { free(h); }
static void fa_ws_key_init(void) { fa_ws_key_ok = pthread_key_create(&fa_ws_key, fa_ws_free) == 0; }
#endif

static void *fa_ws_get(size_t bytes)
{
#if defined(FA_DEBUG_SCRATCH)
    /* Debug and sanitizer builds: a fresh block of exactly this size (so that
     * ASan sees any overrun, which a larger cached block would hide) followed
     * by a guard zone that fa_ws_put checks. */
    unsigned char *g = (unsigned char *)malloc(bytes + FA_WS_GUARD);
    if (g) memset(g + bytes, 0xA5, FA_WS_GUARD);
    return g;
#endif
#if defined(FA_WS_CACHE)
    pthread_once(&fa_ws_once, fa_ws_key_init);
    if (fa_ws_key_ok && bytes <= FA_WS_KEEP) {
        fa_ws_hdr *h = (fa_ws_hdr *)pthread_getspecific(fa_ws_key);
        if (h && h->n >= bytes) return h + 1;
        free(h);
        h = (fa_ws_hdr *)malloc(sizeof(fa_ws_hdr) + bytes);
        if (h) h->n = bytes;
        if (pthread_setspecific(fa_ws_key, h) != 0) { free(h); return NULL; }
        return h ? (void *)(h + 1) : NULL;
    }
#endif
    return malloc(bytes);
}

static void fa_ws_put(void *ws, size_t bytes)
{
#if defined(FA_DEBUG_SCRATCH)
    for (size_t i = 0; i < FA_WS_GUARD; i++)
        FA_DEBUG_CHECK(((unsigned char *)ws)[bytes + i] == 0xA5, "a kernel wrote past its scratch");
    free(ws);
    return;
#endif
#if defined(FA_WS_CACHE)
    if (fa_ws_key_ok && bytes <= FA_WS_KEEP) return; /* kept for the next call of this thread */
#endif
    (void)bytes;
    free(ws);
}

/* The floating-point environment of a call.  Every thread that runs a part
 * of it, the caller's included, computes in round-to-nearest with denormals
 * flushed to zero (FTZ/DAZ) and restores its own mode afterwards: a worker
 * thread never sees the caller's fesetround() mode, so the caller's thread
 * switches to the workers' mode for the call, and the results do not depend
 * on the thread count or on the caller's rounding mode. */
void fa_fpenv_enter(fa_fpenv *e) { fa_fpmode_enter(&e->csr, &e->round); }

void fa_fpenv_exit(const fa_fpenv *e) { fa_fpmode_exit(e->csr, e->round); }

#if !defined(_WIN32)
/* Fork safety.  libgomp's thread pool does not survive fork(): a child that
 * asks for a team after its parent ran one waits for threads that do not
 * exist.  A child of such a process (os.fork, multiprocessing's "fork" start
 * method) therefore runs every call on its calling thread; results are the
 * same, as they are for any thread count.  A process that never started a
 * team (e.g. a fork before the first call) keeps its threads. */
static volatile int fa_team_started, fa_forked;
static void fa_atfork_child(void)
{
    if (fa_team_started) fa_forked = 1;
}
__attribute__((constructor)) static void fa_atfork_register(void)
{
    pthread_atfork(NULL, NULL, fa_atfork_child);
}

/* libgomp calls exit() when the OS refuses a team's threads.  Before the
 * first team of a given size, the driver starts (and joins) that many threads
 * itself, so that a refusal is reported as an error instead. */
static int fa_team_ok = 1;
static pthread_mutex_t fa_team_lock = PTHREAD_MUTEX_INITIALIZER;
static void *fa_probe_thread(void *arg) { return arg; }

static int fa_team_available(int nt)
{
    int ok;
    if (nt <= __atomic_load_n(&fa_team_ok, __ATOMIC_ACQUIRE)) return 1; /* the usual case: no lock */
    pthread_mutex_lock(&fa_team_lock);
    ok = nt <= fa_team_ok;
    if (!ok) {
        pthread_t *th = (pthread_t *)malloc((size_t)nt * sizeof(pthread_t));
        int made = 0;
        ok = th != NULL;
        for (; ok && made < nt - 1; made++)
            if (pthread_create(&th[made], NULL, fa_probe_thread, NULL) != 0) { ok = 0; break; }
        for (int i = 0; i < made; i++) pthread_join(th[i], NULL);
        free(th);
        if (ok) __atomic_store_n(&fa_team_ok, nt, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&fa_team_lock);
    return ok;
}
#else
static const int fa_forked = 0;
static int fa_team_started;
static int fa_team_available(int nt) { (void)nt; return 1; }
#endif

/* run_heads on or off (fa_heads_together, a test hook). */
static int fa_heads_on = 1;

int fa_heads_together(int on)
{
    return __atomic_exchange_n(&fa_heads_on, on != 0, __ATOMIC_RELAXED);
}

/* A unit of work: n tasks of consecutive kv heads, t[first], t[first +
 * stride], ..., of one sequence, query block and key range.  n > 1 runs them
 * together (kern->run_heads), each with its own part of the scratch. */
typedef struct fa_unit {
    int64_t first, n, stride;
} fa_unit;

/* One thread's share of the work (all of it when called outside a team):
 * the units (nunit of them, in the queue order), or, where units is NULL,
 * every task alone.  heads: the most tasks of a unit (scratch parts). */
static void fa_run_tasks(const fa_kernel *kern, const fa_params *p, const fa_task *tasks, int64_t ntask,
                         const fa_unit *units, int64_t nunit, int64_t heads, size_t ws_bytes, int *failed)
{
    fa_fpenv env;
    fa_fpenv_enter(&env); /* nearest, FTZ/DAZ inside the kernel only; restored below */
    const size_t part = (ws_bytes + 63) / 64 * 64;
    const int64_t nparts = units ? heads : 1;
    const size_t total = units ? part * (size_t)nparts : ws_bytes;
    void *ws = fa_ws_get(total);
    if (ws) /* nothing kept from an earlier call (kernel.h), in any part */
        for (int64_t h = 0; h < nparts; h++) memset((char *)ws + (size_t)h * part, 0, sizeof(fa_scratch_state));
    if (!ws) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
        *failed = 1;
    }
    const int64_t nwork = units ? nunit : ntask;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t u = 0; u < nwork; u++) {
        if (!ws) continue;
        if (!units) (p->dropout_p > 0.0 ? kern->run_dropout : kern->run)(p, &tasks[u], ws);
        else if (units[u].n == 1) kern->run(p, &tasks[units[u].first], ws);
        else kern->run_heads(p, &tasks[units[u].first], units[u].n, units[u].stride, ws, part);
    }
    if (ws) fa_ws_put(ws, total);
    fa_fpenv_exit(&env);
}

int fa_team_size(int requested)
{
    int nt = requested < 1 ? 1 : requested > FA_MAX_THREADS ? FA_MAX_THREADS : requested;
#ifdef _OPENMP
    if (fa_forked) return 1; /* a fork() child of a process with a thread team: see above */
    if (nt > 1) {
        if (!fa_team_available(nt)) return 0;
        fa_team_started = 1;
    }
    return nt;
#else
    (void)nt;
    return 1;
#endif
}

int fa_openmp_enabled(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int fa_omp_max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Row r of the split parts of one task group, merged with the log-sum-exp
 * rule in double: out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max). */
static void fa_merge_row(const fa_params *p, const fa_task *parts, int64_t nsplit, int64_t r, int64_t h,
                         int64_t i, const fa_batch *bi)
{
    const int f64 = p->q_dtype == FA_F64;
    const int64_t Dv = p->Dv;
    double wgt[FA_SPLIT_TASKS], M = -INFINITY, den = 0.0; /* nsplit <= FA_SPLIT_TASKS */
    int nan = 0;
    for (int64_t s = 0; s < nsplit; s++) {
        wgt[s] = f64 ? ((double *)parts[s].part_lse)[r] : ((float *)parts[s].part_lse)[r];
        if (wgt[s] != wgt[s]) nan = 1;
        if (wgt[s] > M) M = wgt[s];
    }
    /* The sink joins the denominator once, here (the parts leave it out), and
     * only for rows within the valid query length, as in the kernel. */
    const double sink = p->sinks && i < bi->Lb ? p->sinks[h] : -INFINITY;
    if (sink > M) M = sink;
    const int live = !nan && M != -INFINITY;
    if (live) {
        for (int64_t s = 0; s < nsplit; s++) {
            wgt[s] = exp(wgt[s] - M); /* parts at -inf weigh exactly 0 */
            den += wgt[s];
        }
        if (sink != -INFINITY) den += exp(sink - M);
    }
    int64_t oo = parts[0].b * p->o_sb + h * p->o_sh + (bi->qoff + i) * p->o_sl;
    for (int64_t c = 0; c < Dv; c++) {
        double acc = nan ? NAN : 0.0;
        if (live) {
            for (int64_t s = 0; s < nsplit; s++) {
                double o = f64 ? ((double *)parts[s].part_o)[r * Dv + c] : ((float *)parts[s].part_o)[r * Dv + c];
                if (wgt[s] > 0.0) acc += wgt[s] * o;
            }
            acc /= den;
        }
        fa_store_elem(p->o, p->o_dtype, oo + c, acc);
    }
    if (p->lse) {
        double lse = nan ? NAN : live ? M + log(den) : -INFINITY;
        fa_store_elem(p->lse, f64 ? FA_F64 : FA_F32,
                      parts[0].b * p->lse_sb + h * p->lse_sh + (bi->qoff + i) * p->lse_sl, lse);
    }
}

/* Merge the split parts of task groups (each thread of a team takes a static
 * share; the whole range outside a team). */
static void fa_merge(const fa_params *p, const fa_task *tasks, int64_t ngroup, int64_t nsplit, int64_t G)
{
    fa_fpenv env;
    fa_fpenv_enter(&env);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t gi = 0; gi < ngroup; gi++) {
        const fa_task *parts = &tasks[gi * nsplit];
        fa_batch bi = fa_batch_info(p, parts[0].b);
        for (int64_t r = 0; r < G * parts[0].ni; r++) {
            int64_t g = r / parts[0].ni, ii = r % parts[0].ni;
            if (p->cu_q && parts[0].i0 + ii >= bi.Lb) continue; /* packed varlen: not ours */
            fa_merge_row(p, parts, nsplit, r, parts[0].hk * G + g, parts[0].i0 + ii, &bi);
        }
    }
    fa_fpenv_exit(&env);
}

int fa_attention(const fa_params *p)
{
    /* Empty work first: zero heads must not reach the divisions below. */
    if (p->B <= 0 || p->Hq <= 0 || p->Hk <= 0 || p->L <= 0) return FA_OK;
    if (p->Hq % p->Hk != 0 || p->D < 1 || p->Dv < 1) return FA_EINVAL;
    const fa_kernel *kern = fa_select_kernel(p);
    const int64_t G = p->Hq / p->Hk;
    /* The row block: derived from the L2 size for long sequences with D, Dv <= 128,
     * the kernel's short block otherwise, or FASTATTN_TILES (tiles.c). */
    const int64_t rows = fa_rows_per_task(kern, p);
    int64_t bmq = rows / G;
    if (bmq < 1) bmq = 1;
    if (bmq > p->L) bmq = p->L > 0 ? p->L : 1;
    const int64_t nqb = (p->L + bmq - 1) / bmq;
    /* Near-equal query blocks: a short last block (L512 at 252 rows: 252 +
     * 252 + 8) is a task of its own with little work per K/V pass, and one
     * of at most FA_BLK_RD rows takes the decode path. */
    bmq = (p->L + nqb - 1) / nqb;
    const int64_t base = p->B * p->Hk * nqb;
    if (base == 0) return FA_OK;

    /* Split-KV over the longest valid key range (a KV cache padded to max_len
     * with short sequences would otherwise get mostly empty parts).  It depends
     * on the shapes and lengths only, never on the thread count. */
    int64_t Seff = p->S;
    if (p->k_lens || p->cu_k) {
        Seff = 0;
        for (int64_t b = 0; b < p->B; b++) {
            int64_t sb = fa_batch_info(p, b).Sb;
            if (sb > Seff) Seff = sb;
        }
    }
    int64_t nsplit = 1, chunk = p->S > 0 ? p->S : 1;
    if (base < FA_SPLIT_TASKS && Seff >= 2 * FA_SPLIT_MIN_KEYS) {
        nsplit = (FA_SPLIT_TASKS + base - 1) / base;
        if (nsplit > Seff / FA_SPLIT_MIN_KEYS) nsplit = Seff / FA_SPLIT_MIN_KEYS;
        int64_t bn = kern->block_keys;
        chunk = ((Seff + nsplit - 1) / nsplit + bn - 1) / bn * bn;
        nsplit = (Seff + chunk - 1) / chunk;
    }
    const int64_t ntask = base * nsplit;
    const size_t esz = p->q_dtype == FA_F64 ? 8 : 4;
    const int64_t prow = G * bmq;

    fa_task *tasks = (fa_task *)malloc((size_t)ntask * sizeof(fa_task));
    char *part_o = NULL, *part_lse = NULL;
    if (!tasks) return FA_ENOMEM;
    if (nsplit > 1) {
        part_o = (char *)malloc((size_t)(ntask * prow * (p->Dv > 0 ? p->Dv : 1)) * esz);
        part_lse = (char *)malloc((size_t)(ntask * prow) * esz);
        if (!part_o || !part_lse) { free(tasks); free(part_o); free(part_lse); return FA_ENOMEM; }
    }
    /* The queue order (the dynamic schedule takes tasks in it).  Causal: query
     * blocks outer, later blocks (more keys) first, so that the schedule
     * balances the triangle.  Otherwise a (b, hk)'s query blocks are
     * consecutive: the threads share one head's K and V, read again within a
     * few tasks instead of after every other head's (B1 H8 L2048 D128 keeps
     * 2 MiB in L3 instead of cycling 16 MiB through it).  Measured on Zen 3
     * (tools/ab_builds.py, 2 threads): L2048 D128 1.04 / 1.05, L1024 D128
     * 1.06, one thread 1.07; D = 256 1.015; D = 64 0.98-1.04 (noise).  The
     * order decides nothing else: every task's result is the same. */
    const int qblocks_outer = p->causal;
    const int64_t nbh = p->B * p->Hk;
    int64_t n = 0;
    for (int64_t it = 0; it < base; it++) {
        const int64_t qq = qblocks_outer ? it / nbh : it % nqb;
        const int64_t bh = qblocks_outer ? it % nbh : it / nqb;
        const int64_t qb = p->causal ? nqb - 1 - qq : qq;
        for (int64_t s = 0; s < nsplit; s++, n++) {
            fa_task *t = &tasks[n];
            t->b = bh / p->Hk; t->hk = bh % p->Hk; t->i0 = qb * bmq;
            t->ni = p->L - t->i0 < bmq ? p->L - t->i0 : bmq;
            t->j0 = s * chunk; t->j1 = (s + 1) * chunk < p->S ? (s + 1) * chunk : p->S;
            t->part_o = part_o ? part_o + (size_t)(n * prow * p->Dv) * esz : NULL;
            t->part_lse = part_lse ? part_lse + (size_t)(n * prow) * esz : NULL;
            t->rows = rows;
        }
    }

    int failed = 0;
    int nt = p->num_threads < 1 ? 1 : p->num_threads > FA_MAX_THREADS ? FA_MAX_THREADS : p->num_threads;
    if (nt > ntask) nt = (int)ntask;
    const size_t ws_bytes = kern->scratch_bytes(p, rows);
    {
        double macs = (double)p->B * (double)p->Hq * (double)p->L * (double)p->S * (double)(p->D + p->Dv);
        if (p->causal) macs *= 0.5;
        if (macs < FA_SERIAL_MACS) nt = 1;
    }
    if (nt > 1 && (nt = fa_team_size(nt)) == 0) {
        free(tasks); free(part_o); free(part_lse);
        return FA_ETHREADS;
    }
    /* Paged single-row decode (one query row per kv head: G == 1): the tasks
     * of up to FA_HEADS_MAX kv heads of a sequence run together (run_heads),
     * reading each page's rows of all of them in turn, in units of as many
     * heads as leave two units per thread (the dynamic schedule's balance; a
     * unit's results are its tasks' own, so this depends on the thread count
     * freely).  Zen 3, 2 threads, B4 H32 S2048 D128, 16-token shuffled pages,
     * against one task per head: int8 1.20-1.34x, bfloat16 1.10-1.15x
     * (tools/ab_builds.py; CHANGELOG).  A call with L == 1 groups every task;
     * a packed varlen call (chunked prefill) the first query block's tasks of
     * its one-query sequences, each other task its own unit. */
    int64_t heads = 1, nunit = 0;
    fa_unit *units = NULL;
    if (kern->run_heads && __atomic_load_n(&fa_heads_on, __ATOMIC_RELAXED) && p->block_table && G == 1 &&
        (p->L == 1 || p->cu_q) && p->dropout_p == 0.0) {
        heads = ntask / (2 * (int64_t)nt); /* (under 2: no unit) */
        if (heads > FA_HEADS_MAX) heads = FA_HEADS_MAX;
        if (heads > p->Hk) heads = p->Hk;
    }
    if (heads > 1) {
        /* The queue holds a (b, kv head)'s tasks nsplit apart where query
         * blocks run outer (causal) or there is one, nqb * nsplit otherwise. */
        const int64_t stride = qblocks_outer || nqb == 1 ? nsplit : nqb * nsplit;
        units = (fa_unit *)malloc((size_t)ntask * sizeof(fa_unit));
        if (!units) { free(tasks); free(part_o); free(part_lse); return FA_ENOMEM; }
        for (int64_t i = 0; i < ntask; i++) {
            const fa_task *t = &tasks[i];
            const int together = t->i0 == 0 && (p->L == 1 || fa_batch_info(p, t->b).Lb == 1);
            if (!together) units[nunit++] = (fa_unit){ i, 1, 0 };
            else if (t->hk % heads == 0) units[nunit++] = (fa_unit){ i, fa_min64(heads, p->Hk - t->hk), stride };
            /* (else: in the unit of its group's first head) */
        }
    }
    if (nt == 1) {
        fa_run_tasks(kern, p, tasks, ntask, units, nunit, heads, ws_bytes, &failed);
    } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
        fa_run_tasks(kern, p, tasks, ntask, units, nunit, heads, ws_bytes, &failed);
    }
    free(units);
    if (!failed && nsplit > 1) {
        if (nt == 1) {
            fa_merge(p, tasks, base, nsplit, G);
        } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
            fa_merge(p, tasks, base, nsplit, G);
        }
    }
    free(tasks); free(part_o); free(part_lse);
    return failed ? FA_ENOMEM : FA_OK;
}
