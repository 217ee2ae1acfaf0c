/* common.cuh: what the three CUDA kernels share (included by launch.cu only,
 * which is the one translation unit that holds every kernel; hence the
 * anonymous namespace).
 *
 * The kernels read fa_params (../fastattn.h) as is, passed by value, with
 * device pointers; launch.cu has checked the subset they implement (see
 * fastattn_cuda.h).  Semantics are those of the CPU kernel
 * (csrc/kernel_impl.h): online softmax with one pass over the keys, fp32
 * scores and accumulation for every storage dtype, bottom-right causal /
 * window / key-length ranges, softcap, ALiBi, bool or float masks read through
 * element strides (0 = broadcast), GQA by indexing (query head h reads
 * key/value head h / (Hq / Hk)), rows that see no key -> zeros and LSE -inf,
 * NaN scores poison their row.
 *
 * Split-KV.  When the blocks of a launch are too few to fill the GPU
 * (decode), the key range [0, S) is cut into NS chunks of `chunk` keys (a
 * multiple of the kernel's key tile); block (row block, split s) only visits
 * keys of chunk s and writes its normalised partial output (fp32) and LSE to
 * a workspace (fa_split); fa_merge_kernel then merges the NS parts of each
 * row with the log-sum-exp rule.  Parts that saw no key have LSE -inf
 * (weight 0); a NaN part poisons the row. */
#ifndef FASTATTN_CUDA_COMMON_CUH
#define FASTATTN_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastattn_cuda.h"

namespace {

constexpr int NWARPS = 4;
constexpr int BN = 32;                /* keys per tile = warp size */
constexpr int THREADS = NWARPS * 32;
constexpr unsigned FULL = 0xffffffffu;

/* Split-KV and loader settings of one launch (decided on the host). */
struct fa_split {
    int ns;          /* key chunks; 1: no split, the kernel writes o and lse itself */
    int vec;         /* 1: the 16-byte pipelined loader may be used */
    int64_t chunk;   /* keys per chunk (a multiple of BN); unused when ns == 1 */
    int64_t nrows;   /* B * Hq * L: rows of the workspace per split */
    float *part_o;   /* (ns, nrows, Dv) normalised partial outputs */
    float *part_lse; /* (ns, nrows) partial LSEs (-inf: no key, NaN: poisoned) */
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* Stores the 16 bytes u (16 / sizeof(T) elements of type T, little-endian)
 * as floats at dst (16-byte aligned shared memory).  Conversions are exact. */
__device__ __forceinline__ void st_vec(float *dst, uint4 u, float)
{
    *reinterpret_cast<float4 *>(dst) =
        make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w));
}

__device__ __forceinline__ float h_lo(unsigned w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu))); }
__device__ __forceinline__ float h_hi(unsigned w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }

__device__ __forceinline__ void st_vec(float *dst, uint4 u, __half)
{
    float4 *d4 = reinterpret_cast<float4 *>(dst);
    d4[0] = make_float4(h_lo(u.x), h_hi(u.x), h_lo(u.y), h_hi(u.y));
    d4[1] = make_float4(h_lo(u.z), h_hi(u.z), h_lo(u.w), h_hi(u.w));
}

/* bfloat16 -> float is the 16 bits placed high in a float. */
__device__ __forceinline__ float b_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float b_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ void st_vec(float *dst, uint4 u, __nv_bfloat16)
{
    float4 *d4 = reinterpret_cast<float4 *>(dst);
    d4[0] = make_float4(b_lo(u.x), b_hi(u.x), b_lo(u.y), b_hi(u.y));
    d4[1] = make_float4(b_lo(u.z), b_hi(u.z), b_lo(u.w), b_hi(u.w));
}

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

/* x with the mask element at offset mo applied (mask_kind != FA_MASK_NONE):
 * bool False -> -inf (True = may attend), float32 / float64 added. */
__device__ __forceinline__ float add_mask(const fa_params &p, float x, int64_t mo)
{
    if (p.mask_kind == FA_MASK_BOOL) return ((const unsigned char *)p.mask)[mo] ? x : -INFINITY;
    if (p.mask_kind == FA_MASK_F32) return x + ((const float *)p.mask)[mo];
    return (float)((double)x + ((const double *)p.mask)[mo]);
}

/* Visible key range [lo, hi) of the query at bottom-right position ip
 * (mask.h fa_row_range). */
__device__ __forceinline__ void row_range(const fa_params &p, int64_t ip, int64_t Sb,
                                          int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = Sb;
    if (p.causal) h = min(h, ip + 1);
    if (p.window_left >= 0) l = max(l, ip - p.window_left);
    if (p.window_right >= 0) h = min(h, ip + p.window_right + 1);
    *lo = l;
    *hi = h > l ? h : l;
}

/* Shared-memory geometry of a launch.  DP: D rounded up to a multiple of 4
 * (pad columns are zero in Qs and Ks); DK: Ks row stride, a multiple of 4
 * floats (16-byte rows for float4 access) with DK / 4 odd, so that the 8
 * lanes of a quarter warp reading float4 from 8 consecutive rows hit 8
 * disjoint groups of 4 banks (conflict-free). */
__host__ __device__ __forceinline__ int padded_d(int D) { return (D + 3) & ~3; }
__host__ __device__ __forceinline__ int k_stride(int D) { return 4 * ((padded_d(D) / 4) | 1); }

size_t smem_floats(int rpw, int D, int Dv)
{
    return (size_t)NWARPS * rpw * padded_d(D) + (size_t)BN * k_stride(D) + (size_t)BN * Dv;
}

/* fa_params.lse is untyped (the CPU writes float32 or float64); the GPU
 * kernels always write float32 (launch.cu checks the dtypes). */
__host__ __device__ __forceinline__ float *lse_f32(const fa_params &p) { return (float *)p.lse; }

/* Merges the sp.ns partial results of each row: out = sum_s w_s o_s / sum_s
 * w_s with w_s = exp(lse_s - M), M = max_s lse_s; lse = M + log(sum_s w_s).
 * Parts with LSE -inf (no key) weigh 0; any NaN part makes the row NaN; a
 * row no part saw a key for is zeros with LSE -inf.  One warp per row (row =
 * (b * Hq + h) * L + i); no block barrier, so whole warps may return early. */
template <typename TQ>
__global__ void __launch_bounds__(THREADS) fa_merge_kernel(const fa_params p, const fa_split sp)
{
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * NWARPS + (threadIdx.x >> 5);
    if (row >= sp.nrows) return;
    const int64_t i = row % p.L, bh = row / p.L, h = bh % p.Hq, b = bh / p.Hq;
    const int Dv = (int)p.Dv, ns = sp.ns;
    float M = -INFINITY;
    bool nan = false;
    for (int s = 0; s < ns; s++) {
        const float x = sp.part_lse[s * sp.nrows + row];
        if (x != x) nan = true;
        else M = fmaxf(M, x);
    }
    const bool none = !nan && M == -INFINITY;
    float sum = 0.0f;
    if (!nan && !none)
        for (int s = 0; s < ns; s++) sum += expf(sp.part_lse[s * sp.nrows + row] - M); /* -inf -> 0 */
    TQ *orow = (TQ *)p.o + b * p.o_sb + h * p.o_sh + i * p.o_sl;
    for (int d = lane; d < Dv; d += 32) {
        float v = nan ? NAN : 0.0f;
        if (!nan && !none) {
            float a = 0.0f;
            for (int s = 0; s < ns; s++) {
                const float x = sp.part_lse[s * sp.nrows + row];
                if (x != -INFINITY) a = fmaf(expf(x - M), sp.part_o[(s * sp.nrows + row) * Dv + d], a);
            }
            v = a / sum;
        }
        orow[d] = from_f<TQ>(v);
    }
    if (p.lse && lane == 0)
        lse_f32(p)[b * p.lse_sb + h * p.lse_sh + i * p.lse_sl] = nan ? NAN : none ? -INFINITY : M + logf(sum);
}

} // namespace

#endif
