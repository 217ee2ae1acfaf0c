/* fastattn_cuda.h: the contract between the Python binding (module.c) and the
 * CUDA kernels (attention.cu).  It mirrors fa_params of ../fastattn.h for the
 * subset the GPU kernel implements (no sinks, query lengths, varlen or block
 * masks) and uses its enums (fa_dtype, fa_mask_kind, fa_status).
 *
 * All pointers are DEVICE pointers.  Strides are in ELEMENTS; the last
 * dimension of q, k, v and o is contiguous (stride 1).  Broadcast dimensions
 * of the mask have stride 0.  Semantics are those of fa_params: scores are
 * scale * q.k, then softcap, ALiBi (-slope * |i' - j|), the mask (bool True =
 * may attend, floats added), then the causal / window / key-length range,
 * with bottom-right alignment i' = i + (S_b - L), S_b = k_lens[b] or S.
 * Rows that see no key are written as zeros with LSE -inf. */
#ifndef FASTATTN_CUDA_H
#define FASTATTN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "../fastattn.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FA_CUDA_MAX_HEAD_DIM 256

typedef struct fa_cuda_params {
    int q_dtype;   /* FA_F32, FA_F16 or FA_BF16; the output has this dtype   */
    int kv_dtype;  /* FA_F32, FA_F16 or FA_BF16; equal to q_dtype unless q is FA_F32 */
    int64_t B, Hq, Hk, L, S, D, Dv;

    const void *q; int64_t q_sb, q_sh, q_sl; /* (B, Hq, L, D)  */
    const void *k; int64_t k_sb, k_sh, k_sl; /* (B, Hk, S, D)  */
    const void *v; int64_t v_sb, v_sh, v_sl; /* (B, Hk, S, Dv) */
    void *o;       int64_t o_sb, o_sh, o_sl; /* (B, Hq, L, Dv) */
    float *lse;    int64_t lse_sb, lse_sh, lse_sl; /* optional (B, Hq, L), natural log */

    int mask_kind; const void *mask; int64_t m_sb, m_sh, m_sl, m_ss; /* FA_MASK_* */

    double scale;
    int causal;
    int64_t window_left, window_right; /* -1: unbounded */
    double softcap;                    /* 0: off */
    const double *alibi; int64_t alibi_sb, alibi_sh; /* optional slopes */
    const int64_t *k_lens;             /* optional (B,) valid key lengths */
} fa_cuda_params;

/* Checks p and launches the kernel on stream (a cudaStream_t; 0 = the default
 * stream), asynchronously.  Returns an fa_status; on failure writes a message
 * into err. */
int fa_cuda_attention(const fa_cuda_params *p, uintptr_t stream, char *err, size_t errlen);

/* Thin runtime wrappers so that module.c needs no CUDA headers.  Each returns
 * 0 on success or a cudaError_t value; fa_cuda_error_string names it. */
const char *fa_cuda_error_string(int code);
int fa_cuda_device_count(int *n);
int fa_cuda_device_name(int dev, char *name, size_t len, int *major, int *minor);
int fa_cuda_get_device(int *dev);
int fa_cuda_runtime_version(int *v);
int fa_cuda_driver_version(int *v);
int fa_cuda_malloc(void **ptr, size_t nbytes);
int fa_cuda_free(void *ptr);
int fa_cuda_memcpy_htod(void *dst, const void *src, size_t nbytes);
int fa_cuda_memcpy_dtoh(void *dst, const void *src, size_t nbytes);
int fa_cuda_synchronize(void);
int fa_cuda_stream_synchronize(uintptr_t stream);

#ifdef __cplusplus
}
#endif
#endif
