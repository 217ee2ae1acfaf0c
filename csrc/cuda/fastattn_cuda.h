/* fastattn_cuda.h: the contract between the Python binding (module.c) and the
 * CUDA kernels (launch.cu, runtime.cu).
 *
 * The GPU takes the CPU's fa_params (../fastattn.h), with DEVICE pointers,
 * and implements this subset of it:
 * - q_dtype FA_F32, FA_F16 or FA_BF16; o_dtype == q_dtype; k_dtype == v_dtype,
 *   equal to q_dtype unless q_dtype is FA_F32 (float32 queries may read 16-bit
 *   keys / values); D, Dv <= FA_CUDA_MAX_HEAD_DIM;
 * - lse, when given, is float32 (B, Hq, L), natural log;
 * - mask (every fa_mask_kind), scale, causal, window, softcap, alibi, k_lens.
 * Not implemented (must be NULL / 0; fa_cuda_attention fails naming the
 * field): sinks, q_lens, cu_q, cu_k, bmask, precision != FA_PRECISION_HIGHEST
 * (the kernels compute float32 scores with fp32 FMA, never bf16 passes),
 * dropout_p != 0.
 * num_threads is a CPU setting and is not read, nor are dropout_seed and
 * dropout_b0 (dropout's).
 *
 * Strides are in ELEMENTS; the last dimension of q, k, v and o is contiguous
 * (stride 1).  Broadcast dimensions of the mask have stride 0.  Semantics are
 * those of fa_params: scores are scale * q.k, then softcap, ALiBi (-slope *
 * |i' - j|), the mask (bool True = may attend, floats added), then the causal
 * / window / key-length range, with bottom-right alignment i' = i + (S_b - L),
 * S_b = k_lens[b] or S.  Rows that see no key are written as zeros with LSE
 * -inf. */
#ifndef FASTATTN_CUDA_H
#define FASTATTN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "../fastattn.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FA_CUDA_MAX_HEAD_DIM 256

/* Checks p and launches the kernel on stream (a cudaStream_t; 0 = the default
 * stream), asynchronously.  Returns an fa_status; on failure writes a message
 * into err. */
int fa_cuda_attention(const fa_params *p, uintptr_t stream, char *err, size_t errlen);

/* Thin runtime wrappers (runtime.cu) so that module.c needs no CUDA headers.
 * Each returns 0 on success or a cudaError_t value; fa_cuda_error_string
 * names it. */
const char *fa_cuda_error_string(int code);
int fa_cuda_device_count(int *n);
int fa_cuda_device_name(int dev, char *name, size_t len, int *major, int *minor);
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
