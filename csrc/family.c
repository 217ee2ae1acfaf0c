/* family.c: drivers of the attention family beyond dot-product (family.h):
 * additive attention (tasks over query-row blocks, kernels in
 * additive_<isa>.c), LSH attention (hash, sort and chunk phases, kernels in
 * lsh_<dtype>_<isa>.c) and rotary embeddings applied while copying, all run on
 * OpenMP threads.  Tasks depend on the shapes only, never on the thread
 * count, so results are bit-identical for every number of threads.
 *
 * Threads follow the rules of the dot-product driver (attention.c), through
 * its own functions (fa_family_bind): the team size is bounded (1024), a
 * fork() child of a process that ran a team runs on its calling thread
 * (libgomp's pool does not survive fork), a team the OS refuses is an error
 * (FA_ETHREADS) instead of libgomp's exit(), and every thread computes in
 * round-to-nearest with FTZ/DAZ and restores its own mode.  The state behind
 * those rules (has a team run, was this process forked) must be the one of
 * the whole process, whichever extension started the team, so the
 * functions are attention.c's, bound at run time, not copies. */
#include <fenv.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "family.h"
#include "convert.h"
#include "lsh.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#include "fpenv.h"
#if defined(__x86_64__) || defined(_M_X64)
#define FA_FAMILY_X86 1
#endif
#if defined(__aarch64__)
#define FA_FAMILY_ARM64 1
#endif

/* ------------------------------------------------------- threads, fp env */

#define FAM_MAX_THREADS 1024 /* as attention.c's FA_MAX_THREADS */

typedef struct fam_fpenv { unsigned int csr; int round; } fam_fpenv; /* attention.c's fa_fpenv */
typedef int (*fam_team_fn)(int);
typedef void (*fam_enter_fn)(fam_fpenv *);
typedef void (*fam_exit_fn)(const fam_fpenv *);

/* Until bound (or where binding failed): the bound alone, and the same
 * floating-point mode set locally. */
static int fam_team_local(int nt) { return nt < 1 ? 1 : nt > FAM_MAX_THREADS ? FAM_MAX_THREADS : nt; }
static void fam_enter_local(fam_fpenv *e) { fa_fpmode_enter(&e->csr, &e->round); }
static void fam_exit_local(const fam_fpenv *e) { fa_fpmode_exit(e->csr, e->round); }

static fam_team_fn fam_team = fam_team_local;
static fam_enter_fn fam_enter = fam_enter_local;
static fam_exit_fn fam_exit = fam_exit_local;

void fa_family_bind(void *team_size, void *fpenv_enter, void *fpenv_exit)
{
    if (!team_size || !fpenv_enter || !fpenv_exit) return;
    fam_team = (fam_team_fn)team_size;
    fam_enter = (fam_enter_fn)fpenv_enter;
    fam_exit = (fam_exit_fn)fpenv_exit;
}

/* The team for a call asking for nt threads (1 when work is below serial);
 * 0 when the OS will not start it. */
static int fam_threads(int nt, int64_t ntask, double work, double serial)
{
    nt = nt < 1 ? 1 : nt > FAM_MAX_THREADS ? FAM_MAX_THREADS : nt;
    if (nt > ntask) nt = ntask < 1 ? 1 : (int)ntask;
    if (work < serial) nt = 1;
    return nt > 1 ? fam_team(nt) : 1;
}

#define AD_BM 32 /* query rows per task: must match additive_impl.h */
/* Calls with less work than this (tanh evaluations) stay on the calling thread. */
#define AD_SERIAL_WORK (1 << 18)

typedef size_t (*ad_scratch_fn)(const fa_additive_params *);
typedef void (*ad_task_fn)(const fa_additive_params *, int64_t, int64_t, int64_t, void *);

size_t fa_additive_scratch_f32_scalar(const fa_additive_params *p);
void fa_additive_task_f32_scalar(const fa_additive_params *p, int64_t b, int64_t i0, int64_t ni, void *ws);
size_t fa_additive_scratch_f64(const fa_additive_params *p);
void fa_additive_task_f64(const fa_additive_params *p, int64_t b, int64_t i0, int64_t ni, void *ws);
#if defined(FA_FAMILY_X86)
size_t fa_additive_scratch_avx2(const fa_additive_params *p);
void fa_additive_task_avx2(const fa_additive_params *p, int64_t b, int64_t i0, int64_t ni, void *ws);
size_t fa_additive_scratch_avx512(const fa_additive_params *p);
void fa_additive_task_avx512(const fa_additive_params *p, int64_t b, int64_t i0, int64_t ni, void *ws);
#endif
#if defined(FA_FAMILY_ARM64)
size_t fa_additive_scratch_neon(const fa_additive_params *p);
void fa_additive_task_neon(const fa_additive_params *p, int64_t b, int64_t i0, int64_t ni, void *ws);
#endif

/* One thread's share of the additive tasks (all of them outside a team). */
static void ad_run(const fa_additive_params *p, ad_task_fn task, int64_t nrb, int64_t ntask, size_t ws_bytes,
                   int *failed)
{
    fam_fpenv env;
    fam_enter(&env); /* nearest, FTZ/DAZ inside the kernel only (its exp2 relies on it) */
    void *ws = malloc(ws_bytes);
    if (!ws) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
        *failed = 1;
    }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t t = 0; t < ntask; t++) {
        if (!ws) continue;
        int64_t b = t / nrb, i0 = (t % nrb) * AD_BM;
        task(p, b, i0, p->L - i0 < AD_BM ? p->L - i0 : AD_BM, ws);
    }
    free(ws);
    fam_exit(&env);
}

int fa_additive(const fa_additive_params *p, int isa)
{
    ad_scratch_fn scratch = fa_additive_scratch_f32_scalar;
    ad_task_fn task = fa_additive_task_f32_scalar;
    if (p->dtype == FA_F64) {
        scratch = fa_additive_scratch_f64;
        task = fa_additive_task_f64;
    }
#if defined(FA_FAMILY_X86)
    else if (isa == FA_ISA_AVX512 || isa == FA_ISA_AMX || isa == FA_ISA_AVX512BF16) {
        /* amx, avx512bf16: AVX-512 plus tiles / VDPBF16PS for bf16 SDPA only */
        scratch = fa_additive_scratch_avx512;
        task = fa_additive_task_avx512;
    } else if (isa == FA_ISA_AVX2) {
        scratch = fa_additive_scratch_avx2;
        task = fa_additive_task_avx2;
    }
#elif defined(FA_FAMILY_ARM64)
    else if (isa == FA_ISA_NEON || isa == FA_ISA_SVE) { /* sve: the NEON family kernels */
        scratch = fa_additive_scratch_neon;
        task = fa_additive_task_neon;
    }
#else
    (void)isa;
#endif
    const int64_t nrb = (p->L + AD_BM - 1) / AD_BM;
    const int64_t ntask = p->B * nrb;
    if (ntask == 0) return FA_OK;
    const size_t ws_bytes = scratch(p);
    const int nt = fam_threads(p->num_threads, ntask, (double)p->B * (double)p->L * (double)p->S * (double)p->A,
                               AD_SERIAL_WORK);
    if (nt == 0) return FA_ETHREADS;
    int failed = 0;
    if (nt == 1) {
        ad_run(p, task, nrb, ntask, ws_bytes, &failed);
    } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
        ad_run(p, task, nrb, ntask, ws_bytes, &failed);
    }
    return failed ? FA_ENOMEM : FA_OK;
}

/* --------------------------------------------------------------------- LSH */

/* Query rows per chunk task (at least one chunk): enough work per task for
 * the dynamic schedule, from the shapes only. */
#define LSH_TASK_ROWS 256
/* Calls with less work than this (multiply-adds) run on the calling thread. */
#define LSH_SERIAL_MACS (1 << 19)

typedef struct lsh_ctx {
    const fa_lsh_params *p;
    const fa_lsh_kernel *k;
    fa_lsh_work w;
    size_t ws_bytes;
    int64_t nhash_task, cpt, ngroup;
    int failed;
} lsh_ctx;

/* The tokens of one round of batch b sorted by (bucket, position): a counting
 * sort over the buckets that visits positions in increasing order, which is
 * the stable sort.  count: n_buckets + 1 entries of scratch. */
static void lsh_sort(const fa_lsh_params *p, const fa_lsh_work *w, int64_t r, int64_t b, int64_t *count)
{
    const int64_t L = p->L, nb = p->n_buckets;
    const int32_t *bk = w->bucket + (r * p->B + b) * L;
    int32_t *ord = w->order + (r * p->B + b) * L;
    memset(count, 0, (size_t)(nb + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < L; i++) count[bk[i] + 1]++;
    for (int64_t j = 0; j < nb; j++) count[j + 1] += count[j];
    for (int64_t i = 0; i < L; i++) ord[count[bk[i]]++] = (int32_t)i;
}

/* One thread's share of every phase (all of it outside a team).  The phases
 * are work-sharing loops whose implicit barriers order them; a thread
 * without scratch makes every thread skip the call (checked after a barrier,
 * so that all threads meet the same loops). */
static void lsh_run(lsh_ctx *c)
{
    const fa_lsh_params *p = c->p;
    const int64_t L = p->L, ch = p->chunk, nrb = (L + FA_LSH_HASH_ROWS - 1) / FA_LSH_HASH_ROWS;
    fam_fpenv env;
    fam_enter(&env); /* nearest, FTZ/DAZ inside the kernels only (their exp2 relies on it) */
    void *ws = malloc(c->ws_bytes);
    if (!ws) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
        c->failed = 1;
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    int failed;
#ifdef _OPENMP
#pragma omp atomic read
#endif
    failed = c->failed;
    if (!failed) {
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t t = 0; t < c->nhash_task; t++) {
            const int64_t b = t / nrb, i0 = (t % nrb) * FA_LSH_HASH_ROWS;
            c->k->hash(p, &c->w, b, i0, L - i0 < FA_LSH_HASH_ROWS ? L - i0 : FA_LSH_HASH_ROWS, ws);
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t t = 0; t < p->n_hashes * p->B; t++) lsh_sort(p, &c->w, t / p->B, t % p->B, (int64_t *)ws);
        for (int64_t r = 0; r < p->n_hashes; r++) { /* rounds in order: each merges into the last */
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t t = 0; t < p->B * c->ngroup; t++) {
                const int64_t b = t / c->ngroup, c0 = (t % c->ngroup) * c->cpt;
                const int64_t c1 = c0 + c->cpt < L / ch ? c0 + c->cpt : L / ch;
                c->k->chunks(p, &c->w, r, b, c0, c1, ws);
            }
        }
    }
    free(ws);
    fam_exit(&env);
}

int fa_lsh(const fa_lsh_params *p, int isa)
{
    if (p->B <= 0 || p->L <= 0) return FA_OK;
    if (p->D < 1 || p->Dv < 1 || p->chunk < 1 || p->L % p->chunk || p->n_hashes < 1 || p->n_buckets < 2 ||
        p->n_buckets % 2 || p->L > INT32_MAX || p->n_buckets > INT32_MAX)
        return FA_EINVAL;
    lsh_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p;
    c.k = &fa_lsh_kernel_f32_scalar;
    if (p->dtype == FA_F64) c.k = &fa_lsh_kernel_f64;
#if defined(FA_FAMILY_X86)
    else if (isa == FA_ISA_AVX512 || isa == FA_ISA_AMX || isa == FA_ISA_AVX512BF16) c.k = &fa_lsh_kernel_avx512;
    else if (isa == FA_ISA_AVX2) c.k = &fa_lsh_kernel_avx2;
#elif defined(FA_FAMILY_ARM64)
    else if (isa == FA_ISA_NEON || isa == FA_ISA_SVE) c.k = &fa_lsh_kernel_neon;
#else
    (void)isa;
#endif
    const int64_t B = p->B, L = p->L, D = p->D, nh = p->n_hashes, half = p->n_buckets / 2;
    const size_t esz = p->dtype == FA_F64 ? 8 : 4;
    const int64_t halfp = (half + FA_LSH_HALF_ALIGN - 1) / FA_LSH_HALF_ALIGN * FA_LSH_HALF_ALIGN;
    char *rotp = (char *)calloc((size_t)(nh * D * halfp), esz);
    void *kscale = malloc((size_t)(B * L) * esz);
    int32_t *bucket = (int32_t *)malloc((size_t)(nh * B * L) * sizeof(int32_t));
    int32_t *order = (int32_t *)malloc((size_t)(nh * B * L) * sizeof(int32_t));
    int rc = FA_OK;
    if (!rotp || !kscale || !bucket || !order) { rc = FA_ENOMEM; goto done; }
    for (int64_t rd = 0; rd < nh * D; rd++) /* rows of the rotations, zero padded to halfp */
        memcpy(rotp + (size_t)(rd * halfp) * esz, (const char *)p->rot + (size_t)(rd * half) * esz,
               (size_t)half * esz);
    c.w.rotp = rotp;
    c.w.halfp = halfp;
    c.w.kscale = kscale;
    c.w.bucket = bucket;
    c.w.order = order;
    c.ws_bytes = c.k->scratch_bytes(p, &c.w);
    if (c.ws_bytes < (size_t)(p->n_buckets + 1) * sizeof(int64_t)) c.ws_bytes = (size_t)(p->n_buckets + 1) * sizeof(int64_t);
    c.nhash_task = B * ((L + FA_LSH_HASH_ROWS - 1) / FA_LSH_HASH_ROWS);
    c.cpt = LSH_TASK_ROWS / p->chunk > 1 ? LSH_TASK_ROWS / p->chunk : 1;
    c.ngroup = (L / p->chunk + c.cpt - 1) / c.cpt;
    {
        const int64_t nk = L / p->chunk == 1 ? p->chunk : 2 * p->chunk;
        const double macs = (double)B * (double)nh * (double)L * ((double)nk * (double)(D + p->Dv) + (double)D * half);
        int64_t ntask = c.nhash_task > B * c.ngroup ? c.nhash_task : B * c.ngroup;
        const int nt = fam_threads(p->num_threads, ntask, macs, LSH_SERIAL_MACS);
        if (nt == 0) { rc = FA_ETHREADS; goto done; }
        if (nt == 1) {
            lsh_run(&c);
        } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
            lsh_run(&c);
        }
    }
    if (c.failed) rc = FA_ENOMEM;
done:
    free(rotp);
    free(kscale);
    free(bucket);
    free(order);
    return rc;
}

/* ------------------------------------------------------------------ rotary */

/* dst[0:n] = src[0:n] in the compute dtype (cd = FA_F32 or FA_F64). */
static void rot_load(void *dst, int cd, const void *src, int sdt, int64_t n)
{
    if (cd == FA_F64) {
        double *d = (double *)dst;
        if (sdt == FA_F64) memcpy(d, src, (size_t)n * 8);
        else for (int64_t i = 0; i < n; i++) d[i] = fa_load_elem(src, sdt, i);
    } else {
        float *d = (float *)dst;
        switch (sdt) {
        case FA_F32: memcpy(d, src, (size_t)n * 4); break;
        case FA_F64: for (int64_t i = 0; i < n; i++) d[i] = (float)((const double *)src)[i]; break;
        case FA_F16: for (int64_t i = 0; i < n; i++) d[i] = fa_f16_to_f32(((const uint16_t *)src)[i]); break;
        default: for (int64_t i = 0; i < n; i++) d[i] = fa_bf16_to_f32(((const uint16_t *)src)[i]); break;
        }
    }
}

static void rot_store(void *dst, int ddt, const void *src, int cd, int64_t n)
{
    if (cd == FA_F64) {
        const double *s = (const double *)src;
        if (ddt == FA_F64) memcpy(dst, s, (size_t)n * 8);
        else for (int64_t i = 0; i < n; i++) fa_store_elem(dst, ddt, i, s[i]);
    } else {
        const float *s = (const float *)src;
        switch (ddt) {
        case FA_F32: memcpy(dst, s, (size_t)n * 4); break;
        case FA_F64: for (int64_t i = 0; i < n; i++) ((double *)dst)[i] = s[i]; break;
        case FA_F16: for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = fa_f32_to_f16(s[i]); break;
        default: for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = fa_f32_to_bf16(s[i]); break;
        }
    }
}

/* The rotation of one row in place (x in the compute dtype). */
#define ROT_ROW(T)                                                                      \
    static void rot_row_##T(T *x, const T *c, const T *s, int64_t half, int interleaved) \
    {                                                                                   \
        if (interleaved) {                                                              \
            for (int64_t i = 0; i < half; i++) {                                        \
                T a = x[2 * i], b = x[2 * i + 1];                                       \
                x[2 * i] = a * c[i] - b * s[i];                                         \
                x[2 * i + 1] = b * c[i] + a * s[i];                                     \
            }                                                                           \
        } else {                                                                        \
            T *x1 = x, *x2 = x + half;                                                  \
            for (int64_t i = 0; i < half; i++) {                                        \
                T a = x1[i], b = x2[i];                                                 \
                x1[i] = a * c[i] - b * s[i];                                            \
                x2[i] = b * c[i] + a * s[i];                                            \
            }                                                                           \
        }                                                                               \
    }
ROT_ROW(float)
ROT_ROW(double)

/* One thread's share of the rotary rows (all of them outside a team). */
static void rot_run(const fa_rotary_params *p, int64_t nrow, int *failed)
{
    const size_t ssz = fa_dtype_size(p->src_dtype), dsz = fa_dtype_size(p->dst_dtype);
    const size_t csz = p->cdtype == FA_F64 ? 8 : 4;
    const int64_t half = p->rdim / 2;
    fam_fpenv env;
    fam_enter(&env); /* the rotation rounds to nearest on every thread */
    void *tmp = malloc((size_t)(p->D > 0 ? p->D : 1) * csz);
    if (!tmp) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
        *failed = 1;
    }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t r = 0; r < nrow; r++) {
        if (!tmp) continue;
        const int64_t t = r % p->T, h = (r / p->T) % p->H, b = r / (p->T * p->H);
        const char *src = (const char *)p->src + (size_t)(b * p->s_sb + h * p->s_sh + t * p->s_st) * ssz;
        const int64_t pos = p->pos[b * p->p_sb + t * p->p_st];
        const int64_t dt = p->dst_at_pos ? pos : t;
        char *dst = (char *)p->dst + (size_t)(b * p->d_sb + h * p->d_sh + dt * p->d_st) * dsz;
        rot_load(tmp, p->cdtype, src, p->src_dtype, p->D);
        if (p->cdtype == FA_F64)
            rot_row_double((double *)tmp, (const double *)p->cos + pos * half,
                           (const double *)p->sin + pos * half, half, p->interleaved);
        else
            rot_row_float((float *)tmp, (const float *)p->cos + pos * half, (const float *)p->sin + pos * half,
                          half, p->interleaved);
        rot_store(dst, p->dst_dtype, tmp, p->cdtype, p->D);
    }
    free(tmp);
    fam_exit(&env);
}

int fa_rotary(const fa_rotary_params *p)
{
    const int64_t nrow = p->B * p->H * p->T;
    if (nrow == 0) return FA_OK;
    /* a decode step (less than 2^18 values) is not worth a team */
    const int nt = fam_threads(p->num_threads, nrow, (double)nrow * (double)p->D, (double)(1 << 18));
    if (nt == 0) return FA_ETHREADS;
    int failed = 0;
    if (nt == 1) {
        rot_run(p, nrow, &failed);
    } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
        rot_run(p, nrow, &failed);
    }
    return failed ? FA_ENOMEM : FA_OK;
}
