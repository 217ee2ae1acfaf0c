/* read_order.c: how fast this machine reads a decode step's K and V bytes in the
 * orders a kernel may read them, contiguous and paged, with no arithmetic
 * beside the loads: the ceiling that the read order alone puts on a paged
 * decode (issue 44's target: paged >= 0.9x of the contiguous decode).
 *
 *     cc -O2 -fopenmp tools/read_order.c -o /tmp/read_order
 *     OMP_NUM_THREADS=2 /tmp/read_order [B Hk S row_bytes page]   (default 4 8 8192 128 16)
 *
 * The cache is B sequences x Hk kv heads x S tokens of row_bytes (128: int8
 * D128) for K and for V; the threads share the sequences (one per thread at a
 * time, as the kernel's split tasks).  Each order sums every row once
 * (16-byte loads); the median of 21 interleaved rounds is reported with its
 * speed against the first order:
 *   contig_bhsd        (B, Hk, S, D), head by head, 64-key tiles of K then V:
 *                      the contiguous decode's order (one stream per head)
 *   paged_head         the native pool (pages, Hk, page, D), shuffled pages, the
 *                      same order: the paged decode's (one 2 KiB run per page)
 *   paged_tile_heads   the pool, each 64-key tile of every head in turn
 *   paged_page_major   the pool, page by page (all heads of a page, in address
 *                      order), the tile's K pages then its V pages
 *   page_major_pf      that, with the next page's first line prefetched
 *
 * Measured on Zen 3 (2026-12-07, 2-vCPU KVM guest, AMD EPYC, gcc -O2 -fopenmp;
 * int8 D128, 16-token pages, B4 Hk8 S8192: 64 MiB per step), two runs each:
 *   2 threads: contig_bhsd 18.2 / 20.2 GB/s; paged_head 0.55 / 0.52x;
 *              paged_tile_heads 0.90 / 0.95x; paged_page_major 1.02 / 1.05x;
 *              page_major_pf 1.06 / 1.11x
 *   1 thread:  contig_bhsd 8.5 / 12.2 GB/s; paged_head 0.50 / 0.55x;
 *              paged_tile_heads 0.87 / 0.87x; paged_page_major 1.03 / 0.93x;
 *              page_major_pf 1.05 / 1.00x
 * So the read order alone costs a head-by-head read through shuffled pages
 * about half its speed on that CPU, and reading a page's heads together wins
 * it back.  fastattn's kernel (software prefetch of each next page) ran the
 * same step at 0.77-0.80x of its contiguous decode, which itself moved ~13
 * GB/s on 2 threads (two thirds of these reads: the int8 decode is not
 * read-bound there); running its tiles of all kv heads in turn (the
 * paged_tile_heads order) measured
 * 0.95-1.05x of head by head in the kernel (not kept). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int64_t B = 4, HK = 8, S = 8192, ROW = 128, PG = 16;
static unsigned char *K, *V, *KP, *VP;
static int64_t *perm;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The sum of one row's 16-byte words (GCC / Clang vector extensions: SSE2 or
 * NEON loads; the compiler keeps them). */
typedef uint64_t u64x2 __attribute__((vector_size(16)));
static u64x2 rd(const unsigned char *p)
{
    u64x2 s = { 0, 0 }, w;
    for (int64_t o = 0; o < ROW; o += 16) {
        memcpy(&w, p + o, 16);
        s += w;
    }
    return s;
}

static size_t rc(int64_t b, int64_t h, int64_t j) { return (size_t)(((b * HK + h) * S + j) * ROW); }

static size_t rp(int64_t b, int64_t h, int64_t j)
{
    const int64_t pg = perm[b * (S / PG) + j / PG];
    return (size_t)(((pg * HK + h) * PG + j % PG) * ROW);
}

/* Sequence b's tiles in order `mode` (2, 3 or 4 above). */
static u64x2 one(int mode, int64_t b)
{
    u64x2 a = { 0, 0 };
    for (int64_t j = 0; j < S; j += 64) {
        const int64_t n = S - j < 64 ? S - j : 64;
        if (mode == 2) {
            for (int64_t h = 0; h < HK; h++) {
                for (int64_t u = 0; u < n; u++) a += rd(KP + rp(b, h, j + u));
                for (int64_t u = 0; u < n; u++) a += rd(VP + rp(b, h, j + u));
            }
            continue;
        }
        for (int kv = 0; kv < 2; kv++) {
            const unsigned char *X = kv ? VP : KP;
            for (int64_t jj = j; jj < j + n; jj += PG) {
                if (mode == 4 && jj + PG < S) __builtin_prefetch(X + rp(b, 0, jj + PG), 0, 3);
                for (int64_t h = 0; h < HK; h++)
                    for (int64_t u = 0; u < PG && jj + u < j + n; u++) a += rd(X + rp(b, h, jj + u));
            }
        }
    }
    return a;
}

static uint64_t run(int mode)
{
    uint64_t s = 0;
    u64x2 x;
    if (mode <= 1) { /* head by head (a task per (sequence, head)): its tiles' K rows, then V rows */
#pragma omp parallel for reduction(+ : s) schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * HK; bh++) {
            const int64_t b = bh / HK, h = bh % HK;
            u64x2 a = { 0, 0 };
            for (int64_t j = 0; j < S; j += 64) {
                const int64_t n = S - j < 64 ? S - j : 64;
                for (int64_t u = 0; u < n; u++) a += mode == 0 ? rd(K + rc(b, h, j + u)) : rd(KP + rp(b, h, j + u));
                for (int64_t u = 0; u < n; u++) a += mode == 0 ? rd(V + rc(b, h, j + u)) : rd(VP + rp(b, h, j + u));
            }
            s += a[0] + a[1];
        }
        return s;
    }
#pragma omp parallel for reduction(+ : s) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        x = one(mode, b);
        s += x[0] + x[1];
    }
    return s;
}

static int cmp(const void *x, const void *y)
{
    const double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

int main(int argc, char **argv)
{
    if (argc == 6) {
        B = atoll(argv[1]); HK = atoll(argv[2]); S = atoll(argv[3]); ROW = atoll(argv[4]); PG = atoll(argv[5]);
    }
    if (B < 1 || HK < 1 || S < PG || PG < 1 || S % PG || ROW < 8 || ROW % 8) {
        fprintf(stderr, "usage: read_order [B Hk S row_bytes page] (S a multiple of page, row_bytes of 8)\n");
        return 2;
    }
    const size_t n = (size_t)(B * HK * S * ROW);
    K = malloc(n); V = malloc(n); KP = malloc(n); VP = malloc(n);
    const int64_t np = B * S / PG;
    perm = malloc((size_t)np * sizeof(int64_t));
    if (!K || !V || !KP || !VP || !perm) return 1;
    for (size_t i = 0; i < n; i++) { K[i] = (unsigned char)(i * 7); V[i] = (unsigned char)(i * 13); }
    memcpy(KP, K, n); memcpy(VP, V, n);
    srand(1);
    for (int64_t i = 0; i < np; i++) perm[i] = i;
    for (int64_t i = np - 1; i > 0; i--) { /* a shuffled block table */
        const int64_t r = rand() % (i + 1), t = perm[i];
        perm[i] = perm[r]; perm[r] = t;
    }
    const char *name[] = { "contig_bhsd", "paged_head", "paged_tile_heads", "paged_page_major", "page_major_pf" };
    enum { NM = 5, ROUNDS = 21 };
    double t[NM][ROUNDS], med[NM];
    uint64_t sink = 0;
    for (int r = 0; r < ROUNDS; r++)
        for (int k = 0; k < NM; k++) {
            const double t0 = now();
            sink += run(k);
            t[k][r] = now() - t0;
        }
    printf("B%lld Hk%lld S%lld, %lld-byte rows, %lld-token pages: %.0f MiB of K and V per step\n", (long long)B,
           (long long)HK, (long long)S, (long long)ROW, (long long)PG, 2.0 * (double)n / 1048576.0);
    for (int k = 0; k < NM; k++) {
        qsort(t[k], ROUNDS, sizeof(double), cmp);
        med[k] = t[k][ROUNDS / 2];
        printf("%-18s %8.2f ms %6.1f GB/s  %.2fx\n", name[k], med[k] * 1e3, 2.0 * (double)n / med[k] / 1e9,
               med[0] / med[k]);
    }
    return (int)(sink & 0); /* the sums are kept, not printed */
}
