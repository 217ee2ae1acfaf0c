/* family.c: drivers of the attention family beyond dot-product (family.h):
 * additive attention (tasks over query-row blocks, run on OpenMP threads,
 * kernels in additive_<isa>.c) and rotary embeddings applied while copying.
 * Tasks depend on the shapes only, never on the thread count, so results
 * are bit-identical for every number of threads. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "family.h"
#include "convert.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#define FA_FAMILY_X86 1
#include <xmmintrin.h>
#endif

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
#else
    (void)isa;
#endif
    const int64_t nrb = (p->L + AD_BM - 1) / AD_BM;
    const int64_t ntask = p->B * nrb;
    if (ntask == 0) return FA_OK;
    const size_t ws_bytes = scratch(p);
    int nt = p->num_threads < 1 ? 1 : p->num_threads;
    if (nt > ntask) nt = (int)ntask;
    if ((double)p->B * (double)p->L * (double)p->S * (double)p->A < AD_SERIAL_WORK) nt = 1;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
#if defined(FA_FAMILY_X86)
        unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* FTZ/DAZ inside the kernel only (its exp2 relies on it) */
#endif
        void *ws = malloc(ws_bytes);
        if (!ws) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
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
#if defined(FA_FAMILY_X86)
        _mm_setcsr(csr);
#endif
    }
    return failed ? FA_ENOMEM : FA_OK;
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

int fa_rotary(const fa_rotary_params *p)
{
    const int64_t nrow = p->B * p->H * p->T;
    if (nrow == 0) return FA_OK;
    const size_t ssz = fa_dtype_size(p->src_dtype), dsz = fa_dtype_size(p->dst_dtype);
    const size_t csz = p->cdtype == FA_F64 ? 8 : 4;
    const int64_t half = p->rdim / 2;
    int nt = p->num_threads < 1 ? 1 : p->num_threads;
    if ((double)nrow * (double)p->D < (1 << 18)) nt = 1; /* a decode step: not worth a team */
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
        void *tmp = malloc((size_t)(p->D > 0 ? p->D : 1) * csz);
        if (!tmp) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
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
    }
    return failed ? FA_ENOMEM : FA_OK;
}
