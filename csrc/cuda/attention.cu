/* attention.cu: tiled flash-attention forward for CUDA (fastattn._cuda).
 *
 * Same semantics as the CPU kernel (csrc/kernel_impl.h): online softmax with
 * one pass over the keys, fp32 scores and accumulation for every storage
 * dtype, bottom-right causal / window / key-length ranges, softcap, ALiBi,
 * bool or float masks read through element strides (0 = broadcast), GQA by
 * indexing (query head h reads key/value head h / (Hq / Hk)), rows that see
 * no key -> zeros and LSE -inf, NaN scores poison their row.
 *
 * Work split: one block of NWARPS warps handles BM = NWARPS * RPW stacked
 * rows of one (batch, key/value head): row r is query head hk*G + r / L at
 * position r % L (G = Hq / Hk), so the query heads sharing a key/value head
 * share its K/V tiles (this is what makes GQA decode cheap).  Each warp owns
 * RPW rows.  Per tile of BN = 32 keys the block stages K and V in shared
 * memory as fp32; lane j of a warp computes the score of key jt + j for a row
 * (a dot product over D), the warp reduces max and sum with shuffles, and
 * lane c accumulates output columns c, c+32, ... in registers.
 *
 * This is a CUDA-core kernel (fp32 FMA); it does not use tensor cores. */
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "fastattn_cuda.h"

namespace {

constexpr int NWARPS = 4;
constexpr int RPW = 4;                /* rows per warp */
constexpr int BM = NWARPS * RPW;      /* rows per block */
constexpr int BN = 32;                /* keys per tile = warp size */
constexpr int THREADS = NWARPS * 32;
constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* Warp all-reduce; every lane returns lane 0's value so that all lanes agree
 * bit for bit. */
__device__ __forceinline__ float warp_max(float x)
{
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, o));
    return __shfl_sync(FULL, x, 0);
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
    return __shfl_sync(FULL, x, 0);
}

/* Visible key range [lo, hi) of the query at bottom-right position ip
 * (mask.h fa_row_range). */
__device__ __forceinline__ void row_range(const fa_cuda_params &p, int64_t ip, int64_t Sb,
                                          int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = Sb;
    if (p.causal) h = min(h, ip + 1);
    if (p.window_left >= 0) l = max(l, ip - p.window_left);
    if (p.window_right >= 0) h = min(h, ip + p.window_right + 1);
    *lo = l;
    *hi = h > l ? h : l;
}

/* DVL: output columns per lane (Dv <= 32 * DVL; 2, 4 or 8). */
template <typename TQ, typename TKV, int DVL>
__global__ void __launch_bounds__(THREADS) fa_fwd_kernel(const fa_cuda_params p)
{
    extern __shared__ float smem[];
    const int D = (int)p.D, Dv = (int)p.Dv, DK = D + 1; /* padded K rows: no bank conflicts */
    const int64_t G = p.Hq / p.Hk, L = p.L, R = G * L;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    const int64_t r0 = (int64_t)blockIdx.x * BM;
    const int64_t Sb = p.k_lens ? p.k_lens[b] : p.S;
    const int64_t delta = Sb - L;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    float *Qs = smem;              /* BM x D  */
    float *Ks = Qs + BM * D;       /* BN x DK */
    float *Vs = Ks + BN * DK;      /* BN x Dv */

    const TQ *q = (const TQ *)p.q;
    const TKV *kp = (const TKV *)p.k + b * p.k_sb + hk * p.k_sh;
    const TKV *vp = (const TKV *)p.v + b * p.v_sb + hk * p.v_sh;

    for (int idx = tid; idx < BM * D; idx += THREADS) {
        const int rr = idx / D, d = idx % D;
        const int64_t r = r0 + rr;
        float x = 0.0f;
        if (r < R) {
            const int64_t h = hk * G + r / L, i = r % L;
            x = to_f(q[b * p.q_sb + h * p.q_sh + i * p.q_sl + d]);
        }
        Qs[idx] = x;
    }

    /* Keys any row of the block may see (identical in every thread). */
    int64_t jlo = Sb, jhi = 0;
    for (int rr = 0; rr < BM && r0 + rr < R; rr++) {
        int64_t lo, hi;
        row_range(p, (r0 + rr) % L + delta, Sb, &lo, &hi);
        if (lo < hi) {
            jlo = min(jlo, lo);
            jhi = max(jhi, hi);
        }
    }

    float m[RPW], l[RPW], acc[RPW][DVL];
    bool nan_row[RPW];
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        m[k] = -INFINITY;
        l[k] = 0.0f;
        nan_row[k] = false;
#pragma unroll
        for (int c = 0; c < DVL; c++) acc[k][c] = 0.0f;
    }

    for (int64_t jt = jlo; jt < jhi; jt += BN) {
        const int nj = (int)min((int64_t)BN, jhi - jt);
        __syncthreads(); /* everyone is done with the previous tile (and Qs is written) */
        for (int idx = tid; idx < BN * D; idx += THREADS) {
            const int j = idx / D, d = idx % D;
            Ks[j * DK + d] = j < nj ? to_f(kp[(jt + j) * p.k_sl + d]) : 0.0f;
        }
        for (int idx = tid; idx < BN * Dv; idx += THREADS) {
            const int j = idx / Dv, d = idx % Dv;
            Vs[idx] = j < nj ? to_f(vp[(jt + j) * p.v_sl + d]) : 0.0f;
        }
        __syncthreads();

#pragma unroll
        for (int k = 0; k < RPW; k++) {
            const int rr = warp * RPW + k;
            const int64_t r = r0 + rr;
            if (r >= R) continue; /* uniform across the warp */
            const int64_t h = hk * G + r / L, i = r % L, ip = i + delta;
            int64_t lo, hi;
            row_range(p, ip, Sb, &lo, &hi);
            const int64_t j = jt + lane;
            float s = -INFINITY;
            if (lane < nj && j >= lo && j < hi) {
                const float *qr = Qs + rr * D, *kr = Ks + lane * DK;
                float dot = 0.0f;
                for (int d = 0; d < D; d++) dot = fmaf(qr[d], kr[d], dot);
                float x = dot * (float)p.scale;
                if (p.softcap != 0.0) x = (float)p.softcap * tanhf(x / (float)p.softcap);
                if (p.alibi) {
                    const float slope = (float)p.alibi[b * p.alibi_sb + h * p.alibi_sh];
                    x -= slope * (float)(ip > j ? ip - j : j - ip);
                }
                if (p.mask_kind != FA_MASK_NONE) {
                    const int64_t mo = b * p.m_sb + h * p.m_sh + i * p.m_sl + j * p.m_ss;
                    if (p.mask_kind == FA_MASK_BOOL) {
                        if (!((const unsigned char *)p.mask)[mo]) x = -INFINITY;
                    } else if (p.mask_kind == FA_MASK_F32) {
                        x += ((const float *)p.mask)[mo];
                    } else {
                        x = (float)((double)x + ((const double *)p.mask)[mo]);
                    }
                }
                s = x;
            }
            if (__any_sync(FULL, s != s)) nan_row[k] = true;
            const float mx = warp_max(s); /* fmaxf skips NaN; nan_row records it */
            const float mnew = fmaxf(m[k], mx);
            if (mnew == -INFINITY) continue; /* nothing visible yet (uniform) */
            const float alpha = expf(m[k] - mnew); /* 0 when m[k] is -inf */
            const float pj = (s == -INFINITY || s != s) ? 0.0f : expf(s - mnew);
            l[k] = l[k] * alpha + warp_sum(pj);
#pragma unroll
            for (int c = 0; c < DVL; c++) acc[k][c] *= alpha;
            for (int jj = 0; jj < nj; jj++) {
                const float pv = __shfl_sync(FULL, pj, jj);
                const float *vr = Vs + jj * Dv;
#pragma unroll
                for (int c = 0; c < DVL; c++) {
                    const int d = lane + 32 * c;
                    if (d < Dv) acc[k][c] = fmaf(pv, vr[d], acc[k][c]);
                }
            }
            m[k] = mnew;
        }
    }

    TQ *o = (TQ *)p.o;
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        const int64_t r = r0 + warp * RPW + k;
        if (r >= R) continue;
        const int64_t h = hk * G + r / L, i = r % L;
        float inv, lse;
        if (nan_row[k]) {
            inv = NAN;
            lse = NAN;
        } else if (m[k] == -INFINITY || !(l[k] > 0.0f)) {
            inv = 0.0f;
            lse = -INFINITY;
        } else {
            inv = 1.0f / l[k];
            lse = m[k] + logf(l[k]);
        }
        TQ *orow = o + b * p.o_sb + h * p.o_sh + i * p.o_sl;
#pragma unroll
        for (int c = 0; c < DVL; c++) {
            const int d = lane + 32 * c;
            if (d < Dv) orow[d] = from_f<TQ>(nan_row[k] ? NAN : acc[k][c] * inv);
        }
        if (p.lse && lane == 0) p.lse[b * p.lse_sb + h * p.lse_sh + i * p.lse_sl] = lse;
    }
}

size_t smem_bytes(const fa_cuda_params *p)
{
    return sizeof(float) * (size_t)(BM * p->D + BN * (p->D + 1) + BN * p->Dv);
}

template <typename TQ, typename TKV, int DVL>
cudaError_t launch(const fa_cuda_params *p, cudaStream_t stream)
{
    const size_t smem = smem_bytes(p);
    cudaError_t e = cudaFuncSetAttribute(fa_fwd_kernel<TQ, TKV, DVL>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    const dim3 grid((unsigned)((p->Hq / p->Hk * p->L + BM - 1) / BM), (unsigned)p->Hk, (unsigned)p->B);
    fa_fwd_kernel<TQ, TKV, DVL><<<grid, THREADS, smem, stream>>>(*p);
    return cudaGetLastError();
}

template <typename TQ, typename TKV>
cudaError_t launch_dv(const fa_cuda_params *p, cudaStream_t stream)
{
    if (p->Dv <= 64) return launch<TQ, TKV, 2>(p, stream);
    if (p->Dv <= 128) return launch<TQ, TKV, 4>(p, stream);
    return launch<TQ, TKV, 8>(p, stream);
}

} // namespace

extern "C" int fa_cuda_attention(const fa_cuda_params *p, uintptr_t stream_handle, char *err, size_t errlen)
{
#define FA_FAIL(...) do { snprintf(err, errlen, __VA_ARGS__); return FA_EINVAL; } while (0)
    if (p->B < 0 || p->Hq < 0 || p->Hk < 1 || p->L < 0 || p->S < 0 || p->D < 1 || p->Dv < 1)
        FA_FAIL("invalid sizes B=%lld Hq=%lld Hk=%lld L=%lld S=%lld D=%lld Dv=%lld",
                (long long)p->B, (long long)p->Hq, (long long)p->Hk, (long long)p->L,
                (long long)p->S, (long long)p->D, (long long)p->Dv);
    if (p->Hq % p->Hk) FA_FAIL("Hq (%lld) must be a multiple of Hk (%lld)", (long long)p->Hq, (long long)p->Hk);
    if (p->D > FA_CUDA_MAX_HEAD_DIM || p->Dv > FA_CUDA_MAX_HEAD_DIM)
        FA_FAIL("head dims must be <= %d on the GPU, got D=%lld Dv=%lld", FA_CUDA_MAX_HEAD_DIM,
                (long long)p->D, (long long)p->Dv);
    if (p->mask_kind < FA_MASK_NONE || p->mask_kind > FA_MASK_F64 || (p->mask_kind != FA_MASK_NONE && !p->mask))
        FA_FAIL("invalid mask kind %d", p->mask_kind);
    if (p->B == 0 || p->Hq == 0 || p->L == 0) return FA_OK;
    if (!p->q || !p->o || (p->S > 0 && (!p->k || !p->v)))
        FA_FAIL("q and o (and k, v when S > 0) must be device pointers");
    const int64_t blocks_x = (p->Hq / p->Hk * p->L + BM - 1) / BM;
    if (blocks_x > 2147483647LL || p->Hk > 65535 || p->B > 65535)
        FA_FAIL("grid too large: %lld row blocks, Hk=%lld, B=%lld (limits 2^31-1, 65535, 65535)",
                (long long)blocks_x, (long long)p->Hk, (long long)p->B);
    cudaError_t e;
    const cudaStream_t st = (cudaStream_t)stream_handle;
    const int qt = p->q_dtype, kt = p->kv_dtype;
    if (qt == FA_F32 && kt == FA_F32) e = launch_dv<float, float>(p, st);
    else if (qt == FA_F16 && kt == FA_F16) e = launch_dv<__half, __half>(p, st);
    else if (qt == FA_BF16 && kt == FA_BF16) e = launch_dv<__nv_bfloat16, __nv_bfloat16>(p, st);
    else if (qt == FA_F32 && kt == FA_F16) e = launch_dv<float, __half>(p, st);
    else if (qt == FA_F32 && kt == FA_BF16) e = launch_dv<float, __nv_bfloat16>(p, st);
    else FA_FAIL("unsupported dtype combination q=%d kv=%d", qt, kt);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "CUDA error: %s", cudaGetErrorString(e));
        return FA_EINVAL;
    }
    return FA_OK;
#undef FA_FAIL
}

extern "C" {

const char *fa_cuda_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

int fa_cuda_device_count(int *n)
{
    *n = 0;
    cudaError_t e = cudaGetDeviceCount(n);
    if (e != cudaSuccess) {
        *n = 0;
        (void)cudaGetLastError(); /* clear it so later calls do not report it */
    }
    return (int)e;
}

int fa_cuda_device_name(int dev, char *name, size_t len, int *major, int *minor)
{
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, dev);
    if (e != cudaSuccess) return (int)e;
    snprintf(name, len, "%s", prop.name);
    *major = prop.major;
    *minor = prop.minor;
    return 0;
}

int fa_cuda_get_device(int *dev) { return (int)cudaGetDevice(dev); }
int fa_cuda_runtime_version(int *v) { return (int)cudaRuntimeGetVersion(v); }
int fa_cuda_driver_version(int *v) { return (int)cudaDriverGetVersion(v); }
int fa_cuda_malloc(void **ptr, size_t nbytes) { return (int)cudaMalloc(ptr, nbytes); }
int fa_cuda_free(void *ptr) { return (int)cudaFree(ptr); }
int fa_cuda_memcpy_htod(void *dst, const void *src, size_t n) { return (int)cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice); }
int fa_cuda_memcpy_dtoh(void *dst, const void *src, size_t n) { return (int)cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost); }
int fa_cuda_synchronize(void) { return (int)cudaDeviceSynchronize(); }
int fa_cuda_stream_synchronize(uintptr_t stream) { return (int)cudaStreamSynchronize((cudaStream_t)stream); }

} /* extern "C" */
