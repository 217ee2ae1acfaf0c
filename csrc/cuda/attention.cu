/* attention.cu: tiled flash-attention forward for CUDA (fastattn._cuda).
 *
 * Same semantics as the CPU kernel (csrc/kernel_impl.h): online softmax with
 * one pass over the keys, fp32 scores and accumulation for every storage
 * dtype, bottom-right causal / window / key-length ranges, softcap, ALiBi,
 * bool or float masks read through element strides (0 = broadcast), GQA by
 * indexing (query head h reads key/value head h / (Hq / Hk)), rows that see
 * no key -> zeros and LSE -inf, NaN scores poison their row.
 *
 * Work split.  One block of NWARPS warps handles BM = NWARPS * RPW stacked
 * rows of one (batch, key/value head): row r is query head hk*G + r / L at
 * position r % L (G = Hq / Hk), so the query heads sharing a key/value head
 * share its K/V tiles (this is what makes GQA decode cheap).  Each warp owns
 * RPW rows (RPW = 4 in general, 1 when a (batch, kv head) has <= 4 rows, so
 * that GQA decode spreads its rows over all warps).  Per tile of BN = 32 keys
 * the block stages K and V in shared memory as fp32; lane j of a warp
 * computes the scores of key jt + j for all the warp's rows (float4 dot
 * products over D), the warp reduces max and sum with shuffles, and lane c
 * accumulates output columns c, c+32, ... in registers.
 *
 * Loads.  When K and V rows are 16-byte aligned (checked on the host from
 * pointers, strides and head dims) each thread loads its share of the next
 * tile with 16-byte loads into registers while the current tile is being
 * computed (software pipelining), so a block keeps a whole tile in flight
 * instead of one element per thread.  Otherwise a batched scalar loader is
 * used (8 independent loads per thread before their stores).
 *
 * Split-KV.  When the blocks (row blocks x Hk x B) are too few to fill the GPU
 * (decode), the key range [0, S) is cut into NS chunks of `chunk` keys (a
 * multiple of BN); block (row block, split s) only visits keys of chunk s and
 * writes its normalised partial output (fp32) and LSE to a workspace; a second
 * kernel merges the NS parts of each row with the log-sum-exp rule.  Parts
 * that saw no key have LSE -inf (weight 0); a NaN part poisons the row.
 *
 * fa_fwd_kernel is a CUDA-core kernel (fp32 FMA).  Float16 / bfloat16
 * prefill without mask, ALiBi or softcap and with D = Dv in {64, 128} runs
 * on tensor cores instead (fa_mma_kernel, sm_80+, see "tensor-core
 * prefill" below; FASTATTN_CUDA_MMA=0 turns it off).  Decode (G * L <= 4
 * rows per (batch, kv head)) with 16-byte aligned K / V rows runs on
 * fa_decode_kernel, which streams K and V straight from global memory into
 * registers with no shared-memory staging or barrier in its key loop (see
 * "decode" below; FASTATTN_CUDA_DECODE=0 turns it off). */
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>

#include "fastattn_cuda.h"

namespace {

constexpr int NWARPS = 4;
constexpr int BN = 32;                /* keys per tile = warp size */
constexpr int THREADS = NWARPS * 32;
constexpr unsigned FULL = 0xffffffffu;
constexpr int64_t MIN_SPLIT_KEYS = 256; /* automatic splits keep >= this many keys per chunk */
constexpr int MAX_SPLITS = 128;
constexpr int MAX_DEVICES = 64;

/* 16-byte vectors per thread (for K, and again for V) that the pipelined
 * loader keeps in registers: a 32-key tile of 32 * DVL columns of T is
 * 32 * 32 * DVL * sizeof(T) / 16 / THREADS = DVL * sizeof(T) / 2 vectors per
 * thread; capped at 8 (32 registers per operand). */
template <typename T> __host__ __device__ constexpr int nvec_for(int dvl)
{
    return dvl * (int)sizeof(T) / 2 < 8 ? dvl * (int)sizeof(T) / 2 : 8;
}

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
__device__ __forceinline__ float add_mask(const fa_cuda_params &p, float x, int64_t mo)
{
    if (p.mask_kind == FA_MASK_BOOL) return ((const unsigned char *)p.mask)[mo] ? x : -INFINITY;
    if (p.mask_kind == FA_MASK_F32) return x + ((const float *)p.mask)[mo];
    return (float)((double)x + ((const double *)p.mask)[mo]);
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

/* The pipelined 16-byte loader of one operand (K or V) of a tile: a thread's
 * vectors u = 0..NV-1 are the tile's vectors tid + u * THREADS in row-major
 * order (rv = cols / VE vectors per row), so row j and column c advance by
 * (dj, dc) per u with at most one carry (dc < cols).  Vectors with j >= BN
 * lie beyond the tile: not stored.  Rows j >= nj (beyond the visible range)
 * are loaded as zeros.  Requires (host-checked) cols % VE == 0, 16-byte
 * aligned rows and BN * rv <= NV * THREADS (the whole tile fits). */
template <typename T, int NV>
struct VecLoader {
    static constexpr int VE = 16 / (int)sizeof(T);
    uint4 r[NV];
    int j0, c0, dj, dc, cols;

    __device__ __forceinline__ void init(int tid, int ncols)
    {
        cols = ncols;
        const int rv = ncols / VE;
        j0 = tid / rv;
        c0 = (tid % rv) * VE;
        dj = THREADS / rv;
        dc = (THREADS % rv) * VE;
    }

    /* global -> registers; base points at row 0 of the tile, rows sl apart */
    __device__ __forceinline__ void load(const T *base, int64_t sl, int nj)
    {
        int j = j0, c = c0;
#pragma unroll
        for (int u = 0; u < NV; u++) {
            r[u] = j < nj ? __ldg(reinterpret_cast<const uint4 *>(base + j * sl + c)) : make_uint4(0u, 0u, 0u, 0u);
            c += dc;
            j += dj;
            if (c >= cols) {
                c -= cols;
                j++;
            }
        }
    }

    /* registers -> shared memory as fp32, rows `stride` floats apart */
    __device__ __forceinline__ void store(float *dst, int stride) const
    {
        int j = j0, c = c0;
#pragma unroll
        for (int u = 0; u < NV; u++) {
            if (j < BN) st_vec(dst + j * stride + c, r[u], T());
            c += dc;
            j += dj;
            if (c >= cols) {
                c -= cols;
                j++;
            }
        }
    }
};

/* Fallback loader (any alignment, any head dim): rows [0, nj) of a tile of
 * `cols` columns into dst (rows `stride` floats apart, pcols >= cols columns
 * written, the pad and rows >= nj as zeros).  Each thread issues 8
 * independent loads before storing them, to keep several loads in flight. */
template <typename T>
__device__ __forceinline__ void load_tile_scalar(float *dst, int stride, const T *src, int64_t sl, int nj,
                                                 int cols, int pcols, int tid)
{
    const int total = BN * pcols;
    for (int base = 0; base < total; base += 8 * THREADS) {
        float t[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int idx = base + u * THREADS + tid;
            const int j = idx / pcols, d = idx - j * pcols;
            t[u] = (j < nj && d < cols) ? to_f(src[j * sl + d]) : 0.0f; /* j < nj implies idx < total */
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int idx = base + u * THREADS + tid;
            const int j = idx / pcols, d = idx - j * pcols;
            if (idx < total) dst[j * stride + d] = t[u];
        }
    }
}

/* Running state of a warp's RPW rows (rows >= R are never used):
 * online-softmax max m, sum l, output accumulators (lane c holds columns c,
 * c+32, ...), NaN flag, bottom-right position ip, mask row offset, ALiBi
 * slope. */
template <int RPW, int DVL>
struct RowState {
    float m[RPW], l[RPW], acc[RPW][DVL], slope[RPW];
    int64_t ipk[RPW], mrow[RPW];
    bool nan_row[RPW];
};

/* One tile of nj <= BN keys starting at jt, staged in Ks / Vs (rows >= nj
 * zero), for the warp's rows whose Q rows start at qw. */
template <int RPW, int DVL>
__device__ __forceinline__ void compute_tile(const fa_cuda_params &p, RowState<RPW, DVL> &st, const float *qw,
                                             const float *Ks, const float *Vs, int64_t jt, int nj, int64_t Sb,
                                             int64_t R, int64_t rw, int lane, int DP, int DK, int Dv)
{
    /* Scores of key j = jt + lane for the warp's RPW rows (Q rows are read
     * as broadcasts, K rows conflict-free, see k_stride). */
    const int64_t j = jt + lane;
    float dot[RPW];
#pragma unroll
    for (int k = 0; k < RPW; k++) dot[k] = 0.0f;
    {
        const int n4 = DP / 4;
        const float4 *kr = reinterpret_cast<const float4 *>(Ks + lane * DK);
        const float4 *qr = reinterpret_cast<const float4 *>(qw);
#pragma unroll 2 /* more unrolling only buys register pressure */
        for (int d4 = 0; d4 < n4; d4++) {
            const float4 kv = kr[d4];
#pragma unroll
            for (int k = 0; k < RPW; k++) {
                const float4 qv = qr[k * n4 + d4];
                dot[k] = fmaf(qv.x, kv.x, dot[k]);
                dot[k] = fmaf(qv.y, kv.y, dot[k]);
                dot[k] = fmaf(qv.z, kv.z, dot[k]);
                dot[k] = fmaf(qv.w, kv.w, dot[k]);
            }
        }
    }

    /* Online softmax per row; pj[k]: this lane's probability (relative to
     * the new running max) for row k, act[k]: row k takes this tile. */
    float pj[RPW];
    bool act[RPW];
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        pj[k] = 0.0f;
        act[k] = false;
        if (rw + k >= R) continue; /* uniform across the warp */
        const int64_t ip = st.ipk[k];
        int64_t lo, hi;
        row_range(p, ip, Sb, &lo, &hi);
        float s = -INFINITY;
        if (lane < nj && j >= lo && j < hi) {
            float x = dot[k] * (float)p.scale;
            if (p.softcap != 0.0) x = (float)p.softcap * tanhf(x / (float)p.softcap);
            if (p.alibi) x -= st.slope[k] * (float)(ip > j ? ip - j : j - ip);
            if (p.mask_kind != FA_MASK_NONE) x = add_mask(p, x, st.mrow[k] + j * p.m_ss);
            s = x;
        }
        if (__any_sync(FULL, s != s)) st.nan_row[k] = true;
        const float mx = warp_max(s); /* fmaxf skips NaN; nan_row records it */
        const float mnew = fmaxf(st.m[k], mx);
        if (mnew == -INFINITY) continue; /* nothing visible yet (uniform) */
        const float alpha = expf(st.m[k] - mnew); /* 0 when m is -inf */
        const float e = (s == -INFINITY || s != s) ? 0.0f : expf(s - mnew);
        st.l[k] = st.l[k] * alpha + warp_sum(e);
#pragma unroll
        for (int c = 0; c < DVL; c++) st.acc[k][c] *= alpha;
        st.m[k] = mnew;
        pj[k] = e;
        act[k] = true;
    }

    /* acc += P V over all BN keys of the tile: keys beyond nj have
     * probability 0 and zero V rows, so they add exact zeros. */
#pragma unroll 2
    for (int jj = 0; jj < BN; jj++) {
        float vv[DVL];
#pragma unroll
        for (int c = 0; c < DVL; c++) {
            const int d = lane + 32 * c;
            vv[c] = d < Dv ? Vs[jj * Dv + d] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < RPW; k++) {
            if (!act[k]) continue; /* uniform across the warp */
            const float pv = __shfl_sync(FULL, pj[k], jj);
#pragma unroll
            for (int c = 0; c < DVL; c++) st.acc[k][c] = fmaf(pv, vv[c], st.acc[k][c]);
        }
    }
}

/* RPW: rows per warp (1 or 4); DVL: output columns per lane (Dv <= 32 * DVL;
 * 2, 4 or 8).  Grid: (row blocks * sp.ns, Hk, B); blockIdx.x = row block *
 * sp.ns + split.  Every __syncthreads is reached by all threads: sp.vec and
 * the tile loop bounds are block-uniform, and the per-row `continue`s are
 * warp-uniform and contain no block barrier. */
template <typename TQ, typename TKV, int RPW, int DVL>
__global__ void __launch_bounds__(THREADS) fa_fwd_kernel(const fa_cuda_params p, const fa_split sp)
{
    constexpr int BM = NWARPS * RPW;
    constexpr int NV = nvec_for<TKV>(DVL);
    extern __shared__ float4 smem4[]; /* float4: 16-byte aligned */
    float *smem = reinterpret_cast<float *>(smem4);
    const int D = (int)p.D, Dv = (int)p.Dv, DP = padded_d(D), DK = k_stride(D);
    const int64_t G = p.Hq / p.Hk, L = p.L, R = G * L;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    const int split = (int)(blockIdx.x % (unsigned)sp.ns);
    const int64_t r0 = (int64_t)(blockIdx.x / (unsigned)sp.ns) * BM;
    const int64_t Sb = p.k_lens ? p.k_lens[b] : p.S;
    const int64_t delta = Sb - L;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t rw = r0 + warp * RPW; /* the warp's first row */

    /* Offsets are multiples of 4 floats, so every array is 16-byte aligned. */
    float *Qs = smem;         /* BM x DP (rows >= R and columns >= D are zero) */
    float *Ks = Qs + BM * DP; /* BN x DK (columns [D, DP) zero, [DP, DK) unused) */
    float *Vs = Ks + BN * DK; /* BN x Dv */
    const float *qw = Qs + warp * RPW * DP;

    const TQ *q = (const TQ *)p.q;
    const TKV *kp = (const TKV *)p.k + b * p.k_sb + hk * p.k_sh;
    const TKV *vp = (const TKV *)p.v + b * p.v_sb + hk * p.v_sh;

    for (int idx = tid; idx < BM * DP; idx += THREADS) {
        const int rr = idx / DP, d = idx - rr * DP;
        const int64_t r = r0 + rr;
        float x = 0.0f;
        if (r < R && d < D) {
            const int64_t h = hk * G + r / L, i = r % L;
            x = to_f(q[b * p.q_sb + h * p.q_sh + i * p.q_sl + d]);
        }
        Qs[idx] = x;
    }

    /* Keys any row of the block may see (identical in every thread), cut to
     * this block's chunk when the key range is split. */
    int64_t jlo = Sb, jhi = 0;
    for (int rr = 0; rr < BM && r0 + rr < R; rr++) {
        int64_t lo, hi;
        row_range(p, (r0 + rr) % L + delta, Sb, &lo, &hi);
        if (lo < hi) {
            jlo = min(jlo, lo);
            jhi = max(jhi, hi);
        }
    }
    if (sp.ns > 1) {
        const int64_t cs = (int64_t)split * sp.chunk;
        jlo = max(jlo, cs);
        jhi = min(jhi, cs + sp.chunk);
    }

    RowState<RPW, DVL> st;
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        st.m[k] = -INFINITY;
        st.l[k] = 0.0f;
        st.nan_row[k] = false;
#pragma unroll
        for (int c = 0; c < DVL; c++) st.acc[k][c] = 0.0f;
        const int64_t r = rw + k;
        st.ipk[k] = 0;
        st.mrow[k] = 0;
        st.slope[k] = 0.0f;
        if (r < R) {
            const int64_t h = hk * G + r / L, i = r % L;
            st.ipk[k] = i + delta;
            st.mrow[k] = b * p.m_sb + h * p.m_sh + i * p.m_sl;
            if (p.alibi) st.slope[k] = (float)p.alibi[b * p.alibi_sb + h * p.alibi_sh];
        }
    }

    if (sp.vec) { /* uniform over the grid */
        VecLoader<TKV, NV> kl, vl;
        kl.init(tid, D);
        vl.init(tid, Dv);
        if (jlo < jhi) {
            const int nj0 = (int)min((int64_t)BN, jhi - jlo);
            kl.load(kp + jlo * p.k_sl, p.k_sl, nj0);
            vl.load(vp + jlo * p.v_sl, p.v_sl, nj0);
        }
        for (int64_t jt = jlo; jt < jhi; jt += BN) {
            const int nj = (int)min((int64_t)BN, jhi - jt);
            __syncthreads(); /* everyone is done with the previous tile (and Qs is written) */
            kl.store(Ks, DK);
            vl.store(Vs, Dv);
            const int64_t jn = jt + BN; /* prefetch the next tile while this one is computed */
            if (jn < jhi) {
                const int nn = (int)min((int64_t)BN, jhi - jn);
                kl.load(kp + jn * p.k_sl, p.k_sl, nn);
                vl.load(vp + jn * p.v_sl, p.v_sl, nn);
            }
            __syncthreads();
            compute_tile<RPW, DVL>(p, st, qw, Ks, Vs, jt, nj, Sb, R, rw, lane, DP, DK, Dv);
        }
    } else {
        for (int64_t jt = jlo; jt < jhi; jt += BN) {
            const int nj = (int)min((int64_t)BN, jhi - jt);
            __syncthreads(); /* everyone is done with the previous tile (and Qs is written) */
            load_tile_scalar<TKV>(Ks, DK, kp + jt * p.k_sl, p.k_sl, nj, D, DP, tid);
            load_tile_scalar<TKV>(Vs, Dv, vp + jt * p.v_sl, p.v_sl, nj, Dv, Dv, tid);
            __syncthreads();
            compute_tile<RPW, DVL>(p, st, qw, Ks, Vs, jt, nj, Sb, R, rw, lane, DP, DK, Dv);
        }
    }

    TQ *o = (TQ *)p.o;
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        const int64_t r = rw + k;
        if (r >= R) continue;
        const int64_t h = hk * G + r / L, i = r % L;
        const bool nan_row = st.nan_row[k];
        const bool none = !nan_row && (st.m[k] == -INFINITY || !(st.l[k] > 0.0f));
        const float inv = none ? 0.0f : 1.0f / st.l[k];
        const float lse = nan_row ? NAN : none ? -INFINITY : st.m[k] + logf(st.l[k]);
        if (sp.ns == 1) {
            TQ *orow = o + b * p.o_sb + h * p.o_sh + i * p.o_sl;
#pragma unroll
            for (int c = 0; c < DVL; c++) {
                const int d = lane + 32 * c;
                if (d < Dv) orow[d] = from_f<TQ>(nan_row ? NAN : none ? 0.0f : st.acc[k][c] * inv);
            }
            if (p.lse && lane == 0) p.lse[b * p.lse_sb + h * p.lse_sh + i * p.lse_sl] = lse;
        } else {
            /* every (split, row) entry is written, also when the chunk held no key */
            const int64_t w = (int64_t)split * sp.nrows + (b * p.Hq + h) * L + i;
            float *prow = sp.part_o + w * Dv;
#pragma unroll
            for (int c = 0; c < DVL; c++) {
                const int d = lane + 32 * c;
                if (d < Dv) prow[d] = nan_row ? NAN : none ? 0.0f : st.acc[k][c] * inv;
            }
            if (lane == 0) sp.part_lse[w] = lse;
        }
    }
}

/* Merges the sp.ns partial results of each row: out = sum_s w_s o_s / sum_s
 * w_s with w_s = exp(lse_s - M), M = max_s lse_s; lse = M + log(sum_s w_s).
 * Parts with LSE -inf (no key) weigh 0; any NaN part makes the row NaN; a
 * row no part saw a key for is zeros with LSE -inf.  One warp per row (row =
 * (b * Hq + h) * L + i); no block barrier, so whole warps may return early. */
template <typename TQ>
__global__ void __launch_bounds__(THREADS) fa_merge_kernel(const fa_cuda_params p, const fa_split sp)
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
        p.lse[b * p.lse_sb + h * p.lse_sh + i * p.lse_sl] = nan ? NAN : none ? -INFINITY : M + logf(sum);
}

/* ---- decode (few rows per (batch, kv head)) ---------------------------------
 *
 * fa_decode_kernel takes the launches whose (batch, kv head) has at most
 * DEC_MAX_ROWS = 4 stacked rows (G * L <= 4: MHA / GQA decode, short
 * speculative blocks) and whose K and V rows are 16-byte aligned.  Such a
 * launch is bound by reading K and V once, so the kernel is built to keep
 * many independent 16-byte loads in flight and never waits at a barrier in
 * the key loop:
 *
 * - One block of DEC_WARPS warps per (key chunk, kv head, batch); all R rows
 *   of the (batch, kv head) live in every thread (registers), so each K / V
 *   byte is read by exactly one block.
 * - Lane layout.  A key row of W = max(D, Dv) columns is nvr = W / VE
 *   16-byte vectors (VE = 16 / sizeof(TKV) elements).  lp = the power of two
 *   >= nvr, capped at 32, lanes share a key ("group" g = lane / lp, position
 *   pos = lane % lp); a warp thus covers rp = 32 / lp keys per load round.
 *   Lane (g, pos) holds columns (pos + n * lp) * VE .. + VE - 1 for n < NV
 *   (NV = 2 only for fp32 rows of more than 128 columns) of K (if < D) and
 *   of V (if < Dv).  K and V share the layout, so the probability a lane
 *   computes is for the very key whose V columns it holds: no shuffle of P.
 * - Keys.  Warp w visits the block's keys in steps of U = DEC_U rounds: at step
 *   t its lanes of group g read key jb + u * rp + g (u < U) with
 *   jb = jlo + (t * DEC_WARPS + w) * U * rp, i.e. the warps of a block
 *   sweep adjacent rows.  All U rounds of K and V are loaded before any
 *   is used.  Dot products are summed over the group with xor shuffles
 *   (offsets < lp stay inside the group, and every lane of the group ends
 *   with the same bits, fp addition being commutative).
 * - Each group keeps its own online-softmax state (m, l, acc over its
 *   columns, NaN flag) per row: no communication inside the key loop.  At
 *   the end the groups of a warp are combined with xor shuffles (offsets
 *   lp .. 16) by the LSE rule, then the warps through shared memory.
 * - Split-KV as in fa_fwd_kernel: with sp.ns > 1 block x only sees chunk x of
 *   the keys and writes its normalised partial output and LSE for
 *   fa_merge_kernel.
 *
 * Semantics are those of fa_fwd_kernel: scale, softcap, ALiBi, mask (read
 * per element), then the causal / window / key-length range; a visible NaN
 * score poisons its row (output and LSE NaN); a row that sees no key is
 * zeros with LSE -inf; keys outside [jlo, jhi) are never read.  Warp
 * uniformity: every shuffle is executed by all 32 lanes (the key loop bound
 * and the lp loops are warp-uniform; per-lane branches hold no shuffle); the
 * two __syncthreads are outside all loops and reached by every thread. */

constexpr int DEC_WARPS = 4;
constexpr int DEC_THREADS = DEC_WARPS * 32;
/* Load rounds per warp step: 2 * DEC_U * NV independent 16-byte loads per
 * lane, DEC_U KiB per warp for NV = 1.  A round costs 8 registers per lane
 * while the rest of the state costs ~90 (1 row) to ~130 (4 rows), so more
 * rounds buy more bytes in flight per SM than more resident warps would:
 * with 4, sm_90 keeps 5 blocks (1 row, 96 registers) or 3 blocks (4 rows,
 * 168 registers) per SM, i.e. 80 or 48 KiB of K / V in flight per SM. */
constexpr int DEC_U = 4;
constexpr int DEC_MAX_ROWS = 4;    /* stacked rows per (batch, kv head) the kernel takes */
constexpr int64_t DEC_MIN_CHUNK = 128; /* automatic splits keep >= this many keys per chunk */

/* The 16 bytes u as VE = 16 / sizeof(T) floats (exact conversions). */
__device__ __forceinline__ void unpack16(uint4 u, float *f, float)
{
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
}

__device__ __forceinline__ void unpack16(uint4 u, float *f, __half)
{
    f[0] = h_lo(u.x); f[1] = h_hi(u.x); f[2] = h_lo(u.y); f[3] = h_hi(u.y);
    f[4] = h_lo(u.z); f[5] = h_hi(u.z); f[6] = h_lo(u.w); f[7] = h_hi(u.w);
}

__device__ __forceinline__ void unpack16(uint4 u, float *f, __nv_bfloat16)
{
    f[0] = b_lo(u.x); f[1] = b_hi(u.x); f[2] = b_lo(u.y); f[3] = b_hi(u.y);
    f[4] = b_lo(u.z); f[5] = b_hi(u.z); f[6] = b_lo(u.w); f[7] = b_hi(u.w);
}

/* RMAX: rows per (batch, kv head) compiled for (R <= RMAX; rows k >= R are
 * inert: empty range, zero Q).  NV: 16-byte vectors per lane per key row.
 * Grid: (sp.ns, Hk, B).  Dynamic shared memory: DEC_WARPS * RMAX * Dv
 * floats. */
template <typename TQ, typename TKV, int RMAX, int NV>
__global__ void __launch_bounds__(DEC_THREADS) fa_decode_kernel(const fa_cuda_params p, const fa_split sp)
{
    constexpr int VE = 16 / (int)sizeof(TKV);
    constexpr int NC = NV * VE; /* columns per lane */
    constexpr int U = DEC_U;
    extern __shared__ float4 dec_smem4[];
    float *sacc = reinterpret_cast<float *>(dec_smem4); /* [DEC_WARPS][RMAX][Dv] */
    __shared__ float sm_m[DEC_WARPS][RMAX], sm_l[DEC_WARPS][RMAX];
    __shared__ int sm_nan[DEC_WARPS][RMAX];
    /* Block-uniform row facts used only with ALiBi or a mask: kept in shared
     * memory (broadcast reads) rather than in 5 * RMAX registers. */
    __shared__ long long sm_ip[RMAX], sm_mrow[RMAX];
    __shared__ float sm_slope[RMAX];

    const int D = (int)p.D, Dv = (int)p.Dv;
    const int64_t G = p.Hq / p.Hk, L = p.L, R = G * L; /* R <= RMAX (host-checked) */
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    const int split = (int)blockIdx.x;
    const int64_t Sb = p.k_lens ? p.k_lens[b] : p.S;
    const int64_t delta = Sb - L;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    /* Lane layout (see above).  lp is a power of two in [1, 32]; the host
     * picked NV so that NV * lp * VE >= max(D, Dv). */
    const int nvr = (D > Dv ? D : Dv) / VE;
    int lp = 1;
    while (lp < nvr && lp < 32) lp <<= 1;
    const int rp = 32 / lp, g = lane / lp, pos = lane % lp;
    int col[NV];
    bool kin[NV], vin[NV];
#pragma unroll
    for (int n = 0; n < NV; n++) {
        col[n] = (pos + n * lp) * VE;
        kin[n] = col[n] < D; /* D, Dv are multiples of VE: a vector is all in or all out */
        vin[n] = col[n] < Dv;
    }

    /* Rows: Q columns of this lane, visible range [lo, hi) (empty for k >= R),
     * bottom-right position, mask row offset, ALiBi slope. */
    const TQ *q = (const TQ *)p.q;
    float qf[RMAX][NC];
    int64_t lo[RMAX], hi[RMAX];
    int64_t jlo = Sb, jhi = 0;
#pragma unroll
    for (int k = 0; k < RMAX; k++) {
        lo[k] = 0;
        hi[k] = 0;
#pragma unroll
        for (int c = 0; c < NC; c++) qf[k][c] = 0.0f;
        if (k < R) {
            const int64_t h = hk * G + k / L, i = k % L;
            row_range(p, i + delta, Sb, &lo[k], &hi[k]);
            if (tid == 0) {
                sm_ip[k] = i + delta;
                sm_mrow[k] = b * p.m_sb + h * p.m_sh + i * p.m_sl;
                sm_slope[k] = p.alibi ? (float)p.alibi[b * p.alibi_sb + h * p.alibi_sh] : 0.0f;
            }
            const TQ *qr = q + b * p.q_sb + h * p.q_sh + i * p.q_sl;
#pragma unroll
            for (int n = 0; n < NV; n++)
#pragma unroll
                for (int e = 0; e < VE; e++)
                    if (col[n] + e < D) qf[k][n * VE + e] = to_f(qr[col[n] + e]);
            if (lo[k] < hi[k]) {
                jlo = min(jlo, lo[k]);
                jhi = max(jhi, hi[k]);
            }
        }
    }
    if (sp.ns > 1) {
        const int64_t cs = (int64_t)split * sp.chunk;
        jlo = max(jlo, cs);
        jhi = min(jhi, cs + sp.chunk);
    }
    __syncthreads(); /* sm_ip, sm_mrow, sm_slope are written (reached by all threads) */

    const TKV *kp = (const TKV *)p.k + b * p.k_sb + hk * p.k_sh;
    const TKV *vp = (const TKV *)p.v + b * p.v_sb + hk * p.v_sh;
    const float scale = (float)p.scale, softcap = (float)p.softcap;

    /* Per-group online-softmax state (identical in the lanes of a group). */
    float m[RMAX], l[RMAX], acc[RMAX][NC];
    bool nanf[RMAX];
#pragma unroll
    for (int k = 0; k < RMAX; k++) {
        m[k] = -INFINITY;
        l[k] = 0.0f;
        nanf[k] = false;
#pragma unroll
        for (int c = 0; c < NC; c++) acc[k][c] = 0.0f;
    }

    const int step = U * rp; /* keys of one warp step */
    for (int64_t jb = jlo + (int64_t)warp * step; jb < jhi; jb += (int64_t)DEC_WARPS * step) { /* warp-uniform */
        /* Issue every load of the step first (2 * U * NV independent 16-byte loads per lane). */
        uint4 kr[U][NV], vr[U][NV];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t j = jb + u * rp + g;
            const bool jok = j < jhi; /* j >= jlo >= 0 always */
#pragma unroll
            for (int n = 0; n < NV; n++) {
                kr[u][n] = (jok && kin[n]) ? __ldg(reinterpret_cast<const uint4 *>(kp + j * p.k_sl + col[n]))
                                           : make_uint4(0u, 0u, 0u, 0u);
                vr[u][n] = (jok && vin[n]) ? __ldg(reinterpret_cast<const uint4 *>(vp + j * p.v_sl + col[n]))
                                           : make_uint4(0u, 0u, 0u, 0u);
            }
        }

        /* Partial dot products over this lane's columns, then summed over the group. */
        float s[U][RMAX];
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int k = 0; k < RMAX; k++) s[u][k] = 0.0f;
#pragma unroll
            for (int n = 0; n < NV; n++) {
                float kf[VE];
                unpack16(kr[u][n], kf, TKV());
#pragma unroll
                for (int k = 0; k < RMAX; k++)
#pragma unroll
                    for (int e = 0; e < VE; e++) s[u][k] = fmaf(qf[k][n * VE + e], kf[e], s[u][k]);
            }
        }
        for (int o = lp >> 1; o > 0; o >>= 1) /* warp-uniform trip count; all lanes shuffle */
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int k = 0; k < RMAX; k++) s[u][k] += __shfl_xor_sync(FULL, s[u][k], o);

        /* Scores (natural units), -inf where not visible; NaN recorded and dropped. */
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t j = jb + u * rp + g;
#pragma unroll
            for (int k = 0; k < RMAX; k++) {
                float x = -INFINITY;
                if (j < jhi && j >= lo[k] && j < hi[k]) { /* lo = hi = 0 for rows k >= R */
                    x = s[u][k] * scale;
                    if (softcap != 0.0f) x = softcap * tanhf(x / softcap);
                    if (p.alibi) {
                        const int64_t ip = sm_ip[k];
                        x -= sm_slope[k] * (float)(ip > j ? ip - j : j - ip);
                    }
                    if (p.mask_kind != FA_MASK_NONE) x = add_mask(p, x, sm_mrow[k] + j * p.m_ss);
                }
                if (x != x) {
                    nanf[k] = true;
                    x = -INFINITY;
                }
                s[u][k] = x;
            }
        }

        /* Online softmax per row over the step's U keys of this group:
         * s becomes p = exp(s - m_new) (0 where not visible).  act: the row
         * has seen a key (otherwise its acc stays exactly 0, as in
         * fa_fwd_kernel, whatever V holds). */
        bool act[RMAX];
#pragma unroll
        for (int k = 0; k < RMAX; k++) {
            float mx = s[0][k];
#pragma unroll
            for (int u = 1; u < U; u++) mx = fmaxf(mx, s[u][k]);
            const float mnew = fmaxf(m[k], mx);
            act[k] = mnew != -INFINITY;
            float alpha = 1.0f, ps = 0.0f;
            if (act[k]) {
                alpha = expf(m[k] - mnew); /* 0 when m was -inf */
#pragma unroll
                for (int u = 0; u < U; u++) {
                    s[u][k] = expf(s[u][k] - mnew); /* -inf -> 0 */
                    ps += s[u][k];
                }
                l[k] = l[k] * alpha + ps;
                m[k] = mnew;
#pragma unroll
                for (int c = 0; c < NC; c++) acc[k][c] *= alpha;
            }
        }

        /* acc += P V */
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int n = 0; n < NV; n++) {
                float vf[VE];
                unpack16(vr[u][n], vf, TKV());
#pragma unroll
                for (int k = 0; k < RMAX; k++) {
                    if (!act[k]) continue;
#pragma unroll
                    for (int e = 0; e < VE; e++) acc[k][n * VE + e] = fmaf(s[u][k], vf[e], acc[k][n * VE + e]);
                }
            }
    }

    /* Combine the rp groups of the warp (same pos, groups g and g ^ (o / lp))
     * by the LSE rule: weights exp(m - max), 0 for a side that saw nothing. */
    for (int o = lp; o < 32; o <<= 1) { /* warp-uniform trip count; all lanes shuffle */
#pragma unroll
        for (int k = 0; k < RMAX; k++) {
            const float mo = __shfl_xor_sync(FULL, m[k], o);
            const float lo_ = __shfl_xor_sync(FULL, l[k], o);
            const int no = __shfl_xor_sync(FULL, nanf[k] ? 1 : 0, o);
            const float mn = fmaxf(m[k], mo);
            const float wa = m[k] == -INFINITY ? 0.0f : expf(m[k] - mn);
            const float wb = mo == -INFINITY ? 0.0f : expf(mo - mn);
            l[k] = l[k] * wa + lo_ * wb;
#pragma unroll
            for (int c = 0; c < NC; c++) {
                const float ao = __shfl_xor_sync(FULL, acc[k][c], o);
                acc[k][c] = acc[k][c] * wa + ao * wb;
            }
            m[k] = mn;
            nanf[k] = nanf[k] || no != 0;
        }
    }

    /* Group 0 of each warp now holds the warp's result. */
    if (g == 0) {
#pragma unroll
        for (int k = 0; k < RMAX; k++) {
#pragma unroll
            for (int n = 0; n < NV; n++)
#pragma unroll
                for (int e = 0; e < VE; e++)
                    if (col[n] + e < Dv) sacc[(warp * RMAX + k) * Dv + col[n] + e] = acc[k][n * VE + e];
            if (pos == 0) {
                sm_m[warp][k] = m[k];
                sm_l[warp][k] = l[k];
                sm_nan[warp][k] = nanf[k] ? 1 : 0;
            }
        }
    }
    __syncthreads();

    /* Combine the warps and write row k, column d (thread per element). */
    TQ *o = (TQ *)p.o;
    for (int idx = tid; idx < (int)R * Dv; idx += DEC_THREADS) {
        const int k = idx / Dv, d = idx - k * Dv;
        float M = -INFINITY;
        bool nan_row = false;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) {
            nan_row = nan_row || sm_nan[w][k] != 0;
            M = fmaxf(M, sm_m[w][k]);
        }
        float lsum = 0.0f, a = 0.0f;
        if (!nan_row && M != -INFINITY) {
#pragma unroll
            for (int w = 0; w < DEC_WARPS; w++) {
                const float mw = sm_m[w][k];
                if (mw == -INFINITY) continue; /* that warp saw no key of this row */
                const float wt = expf(mw - M);
                lsum = fmaf(sm_l[w][k], wt, lsum);
                a = fmaf(sacc[(w * RMAX + k) * Dv + d], wt, a);
            }
        }
        const bool none = !nan_row && !(lsum > 0.0f); /* also M == -inf */
        const float val = nan_row ? NAN : none ? 0.0f : a / lsum;
        const float lse = nan_row ? NAN : none ? -INFINITY : M + logf(lsum);
        const int64_t h = hk * G + k / L, i = k % L;
        if (sp.ns == 1) {
            o[b * p.o_sb + h * p.o_sh + i * p.o_sl + d] = from_f<TQ>(val);
            if (p.lse && d == 0) p.lse[b * p.lse_sb + h * p.lse_sh + i * p.lse_sl] = lse;
        } else {
            /* every (split, row) entry is written, also when the chunk held no key */
            const int64_t w = (int64_t)split * sp.nrows + (b * p.Hq + h) * L + i;
            sp.part_o[w * Dv + d] = val;
            if (d == 0) sp.part_lse[w] = lse;
        }
    }
}

/* ---- tensor-core prefill (sm_80+, q/k/v float16 or bfloat16, D = Dv in {64, 128}) ----
 *
 * Flash-attention-2 style.  A block of 4 warps owns MMA_BM = 64 stacked rows
 * of one (batch, kv head) (row r = query head hk*G + r / L at position r % L,
 * as in fa_fwd_kernel), 16 rows per warp.  The warp keeps its Q rows in
 * registers as mma A fragments.  Per tile of MMA_BN = 64 keys the block
 * copies K and V into shared memory with cp.async (16-byte copies, two
 * stages: the next tile is in flight while the current one is computed);
 * each warp computes S = Q K^T (16 x 64, fp32) with mma.m16n8k16, masks it
 * per element, runs the online softmax in the base-2 domain (scores are
 * multiplied by scale * log2(e), p = exp2(s - m)), rounds P to the input
 * dtype as A fragments and accumulates O += P V (fp32) with mma, reading V
 * fragments with ldmatrix.trans.  Key tiles outside a warp's visible range
 * (e.g. above the causal diagonal) are skipped by that warp; tiles outside
 * the block's range are never loaded.  Split-KV (sp.ns > 1) restricts a block
 * to one chunk of keys and writes the fp32 partial output / LSE for
 * fa_merge_kernel, exactly like fa_fwd_kernel.
 *
 * Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4; a 32-bit
 * register holds two 16-bit values, the lower column / k index in bits 0-15):
 *   A (16 x 16, row-major)  a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
 *   B (16 x 8, k x n)       b0: (k = 2t..2t+1, n = g)          b1: (k = 2t+8..2t+9, n = g)
 *   C (16 x 8, fp32)        c0, c1: (g, 2t), (g, 2t+1)          c2, c3: (g+8, 2t), (g+8, 2t+1)
 * So each thread owns two rows of its warp's 16 (g and g+8); the four
 * threads of a quad (same g) share those rows, and row reductions are
 * shuffles over lane ^ 1 and lane ^ 2. */

constexpr int MMA_BM = 64;  /* query rows per block */
constexpr int MMA_BN = 64;  /* keys per tile */
constexpr int MMA_PAD = 8;  /* 16-bit elements of padding per shared row (16 bytes) */
constexpr int MMA_MIN_ROWS = 64; /* rows per (batch, kv head) below which the CUDA-core kernel is used */

/* Shared row stride in 16-bit elements: D + 8 keeps rows 16-byte aligned for
 * cp.async / ldmatrix and makes the row stride (D + 8) / 2 = 4 (mod 32)
 * words for D in {64, 128}, so 8 consecutive rows start in 8 disjoint
 * groups of 4 banks: the K fragment loads (rows g, words t) and the
 * ldmatrix phases (8 rows of 16 bytes) are conflict-free. */
__host__ __device__ constexpr int mma_stride(int D) { return D + MMA_PAD; }

template <int D> constexpr size_t mma_smem_bytes()
{
    return (size_t)2 /* stages */ * 2 /* K, V */ * MMA_BN * mma_stride(D) * 2 /* bytes */;
}

/* Two floats -> one register of two 16-bit values (lo in bits 0-15), rounded to nearest. */
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half)
{
    const __half2 h = __floats2half2_rn(lo, hi); /* .x = lo is the low half */
    uint32_t u;
    memcpy(&u, &h, sizeof u);
    return u;
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16)
{
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, sizeof u);
    return u;
}

/* c += a * b, one m16n8k16 tile, fp32 accumulation (layouts above). */
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __half)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1,
                                          __nv_bfloat16)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ldmatrix.x4.trans: lanes 8m..8m+7 give the row addresses (16 bytes each)
 * of stored 8 x 8 matrix m; r[m] receives, in lane (g, t), the elements
 * (row 2t, col g) and (row 2t+1, col g) of matrix m, i.e. a B fragment
 * register when the stored rows are k (keys) and the columns n. */
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const void *row_addr)
{
    const unsigned a = (unsigned)__cvta_generic_to_shared(row_addr);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

/* 16-byte global -> shared copy; valid == false writes 16 zero bytes and
 * reads nothing (src must still be a valid address). */
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, bool valid)
{
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Issues the copies of one tile of rows [0, nj) of an operand (rows sl
 * elements apart, D columns) into dst (MMA_BN rows of mma_stride(D)); rows
 * >= nj become zeros, so that P = 0 times them adds exact zeros. */
template <typename T, int D>
__device__ __forceinline__ void mma_load_tile(T *dst, const T *src, int64_t sl, int nj, int tid)
{
    constexpr int RV = D / 8;                     /* 16-byte vectors per row */
    constexpr int PER = MMA_BN * RV / THREADS;    /* vectors per thread (4 or 8) */
    static_assert(MMA_BN * RV % THREADS == 0, "tile must split evenly over the threads");
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int idx = tid + u * THREADS;
        const int j = idx / RV, c = (idx % RV) * 8;
        const bool ok = j < nj;
        cp_async_16(dst + j * mma_stride(D) + c, ok ? src + j * sl + c : src, ok);
    }
}

/* Grid: (row blocks * sp.ns, Hk, B); blockIdx.x = (reversed row block) *
 * sp.ns + split.  Row blocks run last-first, so that the longest causal rows
 * start early.  All __syncthreads are reached by every thread (the tile loop
 * bounds are block-uniform); the per-warp tile skip is warp-uniform and
 * holds no barrier; mma/ldmatrix/shuffles always run with the full warp. */
template <typename T, int D>
__global__ void __launch_bounds__(THREADS) fa_mma_kernel(const fa_cuda_params p, const fa_split sp)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    constexpr int DS = mma_stride(D);
    constexpr int KS = D / 16;      /* k-steps of S = Q K^T */
    constexpr int NT = MMA_BN / 8;  /* n-tiles of S (8 keys each) */
    constexpr int ND = D / 8;       /* n-tiles of O (8 columns each) */
    constexpr int KP = MMA_BN / 16; /* k-steps of O += P V */
    constexpr float LN2 = 0.693147180559945309f;
    static_assert(ND % 2 == 0, "V fragments are loaded two n-tiles at a time");

    extern __shared__ uint4 mma_smem[]; /* 16-byte aligned */
    T *sK = reinterpret_cast<T *>(mma_smem);     /* [2][MMA_BN][DS] */
    T *sV = sK + 2 * MMA_BN * DS;                /* [2][MMA_BN][DS] */
    __shared__ long long wrange[NWARPS][2];       /* each warp's visible key range */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int64_t G = p.Hq / p.Hk, L = p.L, R = G * L;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    const int64_t nrb = (R + MMA_BM - 1) / MMA_BM;
    const int split = (int)(blockIdx.x % (unsigned)sp.ns);
    const int64_t r0 = (nrb - 1 - (int64_t)(blockIdx.x / (unsigned)sp.ns)) * MMA_BM;
    const int64_t Sb = p.k_lens ? p.k_lens[b] : p.S;
    const int64_t delta = Sb - L;

    const T *q = (const T *)p.q;
    const T *kp = (const T *)p.k + b * p.k_sb + hk * p.k_sh;
    const T *vp = (const T *)p.v + b * p.v_sb + hk * p.v_sh;

    /* This thread's two rows: hr = 0 -> warp row g, hr = 1 -> warp row g + 8. */
    /* (Query head, position) of a valid row are recomputed where needed,
     * to keep registers for the fragments. */
    int64_t lo[2], hi[2];
    uint32_t qf[KS][4];
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int64_t r = r0 + warp * 16 + g + 8 * hr;
        lo[hr] = 0;
        hi[hr] = 0; /* invalid rows see nothing */
        const T *qr = nullptr;
        if (r < R) {
            const int64_t h = hk * G + r / L, i = r % L;
            row_range(p, i + delta, Sb, &lo[hr], &hi[hr]);
            qr = q + b * p.q_sb + h * p.q_sh + i * p.q_sl;
        }
        /* Q fragments straight from global memory (32-bit loads; rows are
         * 16-byte aligned, host-checked); invalid rows are zeros. */
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const int c = ks * 16 + 2 * t;
            qf[ks][hr] = qr ? *reinterpret_cast<const uint32_t *>(qr + c) : 0u;
            qf[ks][2 + hr] = qr ? *reinterpret_cast<const uint32_t *>(qr + c + 8) : 0u;
        }
    }

    /* Visible key range of the warp (union of its rows' ranges), then of the block. */
    long long wlo = LLONG_MAX, whi = LLONG_MIN;
#pragma unroll
    for (int hr = 0; hr < 2; hr++)
        if (lo[hr] < hi[hr]) {
            wlo = min(wlo, (long long)lo[hr]);
            whi = max(whi, (long long)hi[hr]);
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wlo = min(wlo, __shfl_xor_sync(FULL, wlo, o));
        whi = max(whi, __shfl_xor_sync(FULL, whi, o));
    }
    if (lane == 0) {
        wrange[warp][0] = wlo;
        wrange[warp][1] = whi;
    }
    __syncthreads();
    int64_t jlo = LLONG_MAX, jhi = LLONG_MIN;
#pragma unroll
    for (int w = 0; w < NWARPS; w++) {
        jlo = min(jlo, (int64_t)wrange[w][0]);
        jhi = max(jhi, (int64_t)wrange[w][1]);
    }
    if (sp.ns > 1) {
        const int64_t cs = (int64_t)split * sp.chunk;
        jlo = max(jlo, cs);
        jhi = min(jhi, cs + sp.chunk);
    }
    const int64_t ntiles = jlo < jhi ? (jhi - jlo + MMA_BN - 1) / MMA_BN : 0;

    /* Running state of the two rows: max m (base-2 units of scaled scores),
     * this thread's partial sum l (its 2 columns of each n-tile; summed over
     * the quad at the end), NaN flag, and O fragments. */
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    bool nanr[2] = {false, false};
    float o[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[nd][e] = 0.0f;
    const float sl2 = (float)(p.scale * 1.4426950408889634);

    if (ntiles > 0) {
        const int n0 = (int)min((int64_t)MMA_BN, jhi - jlo);
        mma_load_tile<T, D>(sK, kp + jlo * p.k_sl, p.k_sl, n0, tid);
        mma_load_tile<T, D>(sV, vp + jlo * p.v_sl, p.v_sl, n0, tid);
    }
    cp_async_commit();

    for (int64_t it = 0; it < ntiles; it++) {
        const int64_t jt = jlo + it * MMA_BN;
        const int nj = (int)min((int64_t)MMA_BN, jhi - jt);
        const int stage = (int)(it & 1);
        if (it + 1 < ntiles) { /* prefetch the next tile into the other stage */
            const int64_t jn = jt + MMA_BN;
            const int nn = (int)min((int64_t)MMA_BN, jhi - jn);
            mma_load_tile<T, D>(sK + (stage ^ 1) * MMA_BN * DS, kp + jn * p.k_sl, p.k_sl, nn, tid);
            mma_load_tile<T, D>(sV + (stage ^ 1) * MMA_BN * DS, vp + jn * p.v_sl, p.v_sl, nn, tid);
            cp_async_commit();
            cp_async_wait<1>(); /* this thread's copies of tile it have landed */
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); /* ... and everyone's */

        if (jt < whi && jt + MMA_BN > wlo) { /* warp-uniform: the tile holds keys some row of the warp sees */
            const T *Ks = sK + stage * MMA_BN * DS;
            const T *Vs = sV + stage * MMA_BN * DS;

            /* S = Q K^T: B fragment of n-tile nt, k-step ks is K[nt*8 + g][ks*16 + 2t (+1)]
             * (and + 8), two consecutive elements of a K row: one 32-bit load each. */
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const T *kr = Ks + (nt * 8 + g) * DS + ks * 16 + 2 * t;
                    mma_16816(s[nt], qf[ks], *reinterpret_cast<const uint32_t *>(kr),
                              *reinterpret_cast<const uint32_t *>(kr + 8), T());
                }

            /* Mask (visible: tile column c in [a, e) of the row, which also
             * excludes columns >= nj, the zero rows), scale, NaN check, row max. */
            int va[2], ve[2];
            float mx[2];
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                va[hr] = (int)max(min(lo[hr] - jt, (int64_t)MMA_BN), (int64_t)0);
                ve[hr] = (int)max(min(min(hi[hr] - jt, (int64_t)nj), (int64_t)MMA_BN), (int64_t)0);
                mx[hr] = -INFINITY;
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int hr = e >> 1, c = nt * 8 + 2 * t + (e & 1);
                    float x = (c >= va[hr] && c < ve[hr]) ? s[nt][e] * sl2 : -INFINITY;
                    if (x != x) { /* a visible NaN score poisons the row */
                        nanr[hr] = true;
                        x = -INFINITY;
                    }
                    s[nt][e] = x;
                    mx[hr] = fmaxf(mx[hr], x);
                }

            /* Online softmax.  The quad agrees bit for bit on the new max;
             * mu = 0 while a row has seen nothing (avoids -inf - -inf). */
            float mu[2];
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(FULL, mx[hr], 1));
                mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(FULL, mx[hr], 2));
                const float mnew = fmaxf(m[hr], mx[hr]);
                mu[hr] = mnew == -INFINITY ? 0.0f : mnew;
                const float alpha = exp2f(m[hr] - mu[hr]); /* 0 when m was -inf, 1 when unchanged */
                m[hr] = mnew;
                l[hr] *= alpha;
#pragma unroll
                for (int nd = 0; nd < ND; nd++) {
                    o[nd][2 * hr] *= alpha;
                    o[nd][2 * hr + 1] *= alpha;
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int hr = e >> 1;
                    const float pe = exp2f(s[nt][e] - mu[hr]); /* masked: exp2(-inf) = 0 */
                    s[nt][e] = pe;
                    l[hr] += pe;
                }

            /* O += P V.  The A fragment of k-step kp (keys 16kp..16kp+15) is
             * made of the C fragments of n-tiles 2kp (a0, a1) and 2kp+1 (a2, a3). */
#pragma unroll
            for (int kq = 0; kq < KP; kq++) {
                uint32_t pa[4];
                pa[0] = pack2(s[2 * kq][0], s[2 * kq][1], T());
                pa[1] = pack2(s[2 * kq][2], s[2 * kq][3], T());
                pa[2] = pack2(s[2 * kq + 1][0], s[2 * kq + 1][1], T());
                pa[3] = pack2(s[2 * kq + 1][2], s[2 * kq + 1][3], T());
                /* ldmatrix.trans: matrix mt = lane / 8 is keys 16kq + 8(mt & 1) .. +7,
                 * columns 8(nd + (mt >> 1)) .. +7; r[0], r[1] are the B fragment of
                 * n-tile nd, r[2], r[3] that of nd + 1. */
                const int mt = lane >> 3;
                const T *vrow = Vs + (kq * 16 + (mt & 1) * 8 + (lane & 7)) * DS + (mt >> 1) * 8;
#pragma unroll
                for (int nd = 0; nd < ND; nd += 2) {
                    uint32_t r[4];
                    ldsm_x4_trans(r, vrow + nd * 8);
                    mma_16816(o[nd], pa, r[0], r[1], T());
                    mma_16816(o[nd + 1], pa, r[2], r[3], T());
                }
            }
        }
        __syncthreads(); /* the stage read here is overwritten by the prefetch of the next iteration */
    }

    /* Finish: sum l and OR the NaN flags over the quad; write O (normalised)
     * and the LSE (natural log), or the partial results of this split. */
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        l[hr] += __shfl_xor_sync(FULL, l[hr], 1);
        l[hr] += __shfl_xor_sync(FULL, l[hr], 2);
        int nf = nanr[hr] ? 1 : 0;
        nf |= __shfl_xor_sync(FULL, nf, 1);
        nf |= __shfl_xor_sync(FULL, nf, 2);
        nanr[hr] = nf != 0;
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int64_t r = r0 + warp * 16 + g + 8 * hr;
        if (r >= R) continue;
        const int64_t h = hk * G + r / L, i = r % L;
        const bool nan_row = nanr[hr];
        const bool none = !nan_row && (m[hr] == -INFINITY || !(l[hr] > 0.0f));
        const float inv = none ? 0.0f : 1.0f / l[hr];
        const float lse = nan_row ? NAN : none ? -INFINITY : (m[hr] + log2f(l[hr])) * LN2;
        if (sp.ns == 1) {
            T *orow = (T *)p.o + b * p.o_sb + h * p.o_sh + i * p.o_sl;
#pragma unroll
            for (int nd = 0; nd < ND; nd++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float x = nan_row ? NAN : none ? 0.0f : o[nd][2 * hr + e] * inv;
                    orow[nd * 8 + 2 * t + e] = from_f<T>(x);
                }
            if (p.lse && t == 0) p.lse[b * p.lse_sb + h * p.lse_sh + i * p.lse_sl] = lse;
        } else {
            const int64_t w = (int64_t)split * sp.nrows + (b * p.Hq + h) * L + i;
            float *prow = sp.part_o + w * D;
#pragma unroll
            for (int nd = 0; nd < ND; nd++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    prow[nd * 8 + 2 * t + e] = nan_row ? NAN : none ? 0.0f : o[nd][2 * hr + e] * inv;
            if (t == 0) sp.part_lse[w] = lse;
        }
    }
#endif
}

/* ---- host side ---------------------------------------------------------- */

/* Per-device facts, looked up once: SM count and a memory pool for the
 * split-KV workspace (stream-ordered allocations, so concurrent launches on
 * different streams never share a buffer; up to 64 MiB stays cached in the
 * pool between launches).  nsm 0 or pool NULL: never split. */
struct DevState {
    bool init;
    int nsm;
    int major; /* compute capability major (0: unknown) */
    cudaMemPool_t pool;
};
std::mutex g_dev_mu;
DevState g_dev[MAX_DEVICES];

void device_state(int *nsm, cudaMemPool_t *pool, int *major = nullptr)
{
    *nsm = 0;
    *pool = nullptr;
    if (major) *major = 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    if (dev < 0 || dev >= MAX_DEVICES) return;
    std::lock_guard<std::mutex> guard(g_dev_mu);
    DevState &st = g_dev[dev];
    if (!st.init) {
        st.init = true;
        int n = 0, pools = 0;
        if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
            (void)cudaGetLastError();
            n = 0;
        }
        if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev) != cudaSuccess) {
            (void)cudaGetLastError();
            pools = 0;
        }
        if (n > 0 && pools) {
            cudaMemPoolProps props;
            memset(&props, 0, sizeof props);
            props.allocType = cudaMemAllocationTypePinned;
            props.handleTypes = cudaMemHandleTypeNone;
            props.location.type = cudaMemLocationTypeDevice;
            props.location.id = dev;
            cudaMemPool_t pl = nullptr;
            if (cudaMemPoolCreate(&pl, &props) == cudaSuccess) {
                uint64_t keep = 64ull << 20;
                if (cudaMemPoolSetAttribute(pl, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess)
                    (void)cudaGetLastError(); /* still usable, it just releases memory sooner */
                st.pool = pl;
            } else {
                (void)cudaGetLastError();
            }
        }
        st.nsm = n;
        int cc = 0;
        if (cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
            (void)cudaGetLastError();
            cc = 0;
        }
        st.major = cc;
    }
    *nsm = st.nsm;
    *pool = st.pool;
    if (major) *major = st.major;
}

/* Number of key chunks for nblk blocks over S keys.  Split only when the
 * blocks cannot fill the GPU (fewer than 2 per SM): then aim at about 4
 * blocks per SM with at least MIN_SPLIT_KEYS keys per chunk.  The
 * environment variable FASTATTN_CUDA_SPLITS=N forces N (a test hook, so that
 * the split path runs on small shapes; 1 disables splitting). */
int64_t clamp_splits(int64_t ns) { return ns < 1 ? 1 : ns > MAX_SPLITS ? MAX_SPLITS : ns; }

/* FASTATTN_CUDA_SPLITS as a split count in [1, MAX_SPLITS], or 0 when unset
 * (read at each launch). */
int64_t forced_splits()
{
    const char *env = getenv("FASTATTN_CUDA_SPLITS");
    return env && *env ? clamp_splits(strtoll(env, nullptr, 10)) : 0;
}

int64_t choose_splits(int64_t nblk, int64_t S, int nsm)
{
    if (const int64_t f = forced_splits()) return f;
    if (nsm <= 0 || nblk >= 2 * (int64_t)nsm) return 1;
    return clamp_splits(min((4 * (int64_t)nsm + nblk - 1) / nblk, S / MIN_SPLIT_KEYS));
}

/* Plans a split into ns requested key chunks: the chunk is rounded up to whole
 * tiles of `tile` keys (ns shrinks to match) and the (ns, B*Hq*L, Dv + 1)
 * float workspace is taken from the pool on the launch stream.  Without a
 * pool, with ns <= 1, a grid that would overflow (grid_rows row blocks per
 * chunk) or a failed allocation, sp->ns stays 1: the call runs unsplit. */
void plan_split(const fa_cuda_params *p, int64_t ns, int64_t tile, int64_t grid_rows, cudaMemPool_t pool,
                cudaStream_t stream, fa_split *sp)
{
    sp->ns = 1;
    sp->chunk = 0;
    sp->nrows = p->B * p->Hq * p->L;
    sp->part_o = nullptr;
    sp->part_lse = nullptr;
    if (!pool || ns <= 1) return;
    const int64_t chunk = ((p->S + ns - 1) / ns + tile - 1) / tile * tile;
    ns = (p->S + chunk - 1) / chunk;
    if (ns <= 1 || grid_rows * ns > 2147483647LL || (sp->nrows + NWARPS - 1) / NWARPS > 2147483647LL) return;
    void *ws = nullptr;
    const size_t bytes = sizeof(float) * (size_t)ns * (size_t)sp->nrows * (size_t)(p->Dv + 1);
    if (cudaMallocFromPoolAsync(&ws, bytes, pool, stream) != cudaSuccess) {
        (void)cudaGetLastError(); /* no workspace: run unsplit */
        return;
    }
    sp->ns = (int)ns;
    sp->chunk = chunk;
    sp->part_o = (float *)ws;
    sp->part_lse = sp->part_o + ns * sp->nrows * p->Dv;
}

/* After the launch of a planned split (e: its launch status): merges the
 * chunks when it succeeded and frees the workspace, stream-ordered after the
 * merge.  Returns the first error. */
template <typename TQ>
cudaError_t finish_split(const fa_cuda_params *p, const fa_split &sp, cudaError_t e, cudaStream_t stream)
{
    if (sp.ns <= 1) return e;
    if (e == cudaSuccess) {
        const unsigned nb = (unsigned)((sp.nrows + NWARPS - 1) / NWARPS);
        fa_merge_kernel<TQ><<<nb, THREADS, 0, stream>>>(*p, sp);
        e = cudaGetLastError();
    }
    const cudaError_t ef = cudaFreeAsync(sp.part_o, stream);
    return e == cudaSuccess ? ef : e;
}

/* May the 16-byte loader read K and V?  Every row start must be 16-byte
 * aligned (base pointer, and strides of dims that are not of size 1, in
 * whole vectors) and a 32-key tile must fit in the NV vectors per thread. */
template <typename T>
bool vec_ok(const fa_cuda_params *p, int nv)
{
    const int64_t VE = 16 / (int64_t)sizeof(T);
    auto ok = [&](const void *ptr, int64_t sb, int64_t sh, int64_t sl, int64_t cols) {
        return ptr != nullptr && (uintptr_t)ptr % 16 == 0 && cols % VE == 0 && sl % VE == 0 &&
               (p->B == 1 || sb % VE == 0) && (p->Hk == 1 || sh % VE == 0) &&
               BN * (cols / VE) <= (int64_t)nv * THREADS;
    };
    return p->S > 0 && ok(p->k, p->k_sb, p->k_sh, p->k_sl, p->D) && ok(p->v, p->v_sb, p->v_sh, p->v_sl, p->Dv);
}

template <typename TQ, typename TKV, int RPW, int DVL>
cudaError_t launch(const fa_cuda_params *p, cudaStream_t stream)
{
    constexpr int BM = NWARPS * RPW;
    const int64_t nrb = (p->Hq / p->Hk * p->L + BM - 1) / BM;
    int nsm;
    cudaMemPool_t pool;
    device_state(&nsm, &pool);
    fa_split sp;
    plan_split(p, (pool && p->S > BN) ? choose_splits(nrb * p->Hk * p->B, p->S, nsm) : 1, BN, nrb, pool,
               stream, &sp);
    sp.vec = vec_ok<TKV>(p, nvec_for<TKV>(DVL)) ? 1 : 0;

    const size_t smem = sizeof(float) * smem_floats(RPW, (int)p->D, (int)p->Dv);
    cudaError_t e = cudaFuncSetAttribute(fa_fwd_kernel<TQ, TKV, RPW, DVL>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess) {
        const dim3 grid((unsigned)(nrb * sp.ns), (unsigned)p->Hk, (unsigned)p->B);
        fa_fwd_kernel<TQ, TKV, RPW, DVL><<<grid, THREADS, smem, stream>>>(*p, sp);
        e = cudaGetLastError();
    }
    return finish_split<TQ>(p, sp, e, stream);
}

template <typename TQ, typename TKV, int RPW>
cudaError_t launch_dv(const fa_cuda_params *p, cudaStream_t stream)
{
    if (p->Dv <= 64) return launch<TQ, TKV, RPW, 2>(p, stream);
    if (p->Dv <= 128) return launch<TQ, TKV, RPW, 4>(p, stream);
    return launch<TQ, TKV, RPW, 8>(p, stream);
}

/* ---- decode path: selection and launch ------------------------------------- */

/* An environment variable set to the integer 0 (read at each launch). */
bool env_is_zero(const char *name)
{
    const char *env = getenv(name);
    if (!env || !*env) return false;
    char *end = nullptr;
    const long long v = strtoll(env, &end, 10);
    return end && *end == '\0' && v == 0;
}

/* Key chunks for the decode kernel over nblk = B * Hk (batch, kv head)
 * pairs, with slots = resident blocks per SM (occupancy) * SMs: the
 * smallest ns whose nblk * ns blocks keep >= 90% of the slots of their
 * waves busy (the blocks of a launch do about equal work, so a last wave
 * that is mostly empty would leave most SMs idle), else the best one; at
 * least DEC_MIN_CHUNK keys per chunk, at most MAX_SPLITS chunks.
 * FASTATTN_CUDA_SPLITS=N forces N, as for the other kernels. */
int64_t choose_decode_splits(int64_t nblk, int64_t S, int nsm, int occ)
{
    if (const int64_t f = forced_splits()) return f;
    if (nsm <= 0 || occ <= 0 || nblk <= 0) return 1;
    const int64_t slots = (int64_t)occ * nsm;
    const int64_t cap = min(S / DEC_MIN_CHUNK, (int64_t)MAX_SPLITS);
    int64_t best = 1;
    double best_eff = 0.0;
    for (int64_t ns = 1; ns <= cap || ns == 1; ns++) { /* nblk <= 65535^2, ns <= 128: no overflow */
        const int64_t blocks = nblk * ns, waves = (blocks + slots - 1) / slots;
        const double eff = (double)blocks / (double)(waves * slots);
        if (eff >= 0.9) return ns;
        if (eff > best_eff) {
            best_eff = eff;
            best = ns;
        }
    }
    return best;
}

/* The decode kernel applies when a (batch, kv head) has at most
 * DEC_MAX_ROWS rows, S > 0 and every K and V row starts 16-byte aligned with
 * D and Dv whole 16-byte vectors (base pointers, and the strides of
 * dimensions that are not of size 1, in whole vectors), unless
 * FASTATTN_CUDA_DECODE=0. */
template <typename TKV>
bool decode_applies(const fa_cuda_params *p)
{
    const int64_t VE = 16 / (int64_t)sizeof(TKV);
    if (p->S <= 0 || p->Hq / p->Hk * p->L > DEC_MAX_ROWS) return false;
    auto ok = [&](const void *ptr, int64_t sb, int64_t sh, int64_t sl, int64_t cols) {
        return ptr != nullptr && (uintptr_t)ptr % 16 == 0 && cols % VE == 0 && sl % VE == 0 &&
               (p->B == 1 || sb % VE == 0) && (p->Hk == 1 || sh % VE == 0);
    };
    if (!ok(p->k, p->k_sb, p->k_sh, p->k_sl, p->D) || !ok(p->v, p->v_sb, p->v_sh, p->v_sl, p->Dv)) return false;
    return !env_is_zero("FASTATTN_CUDA_DECODE");
}

template <typename TQ, typename TKV, int RMAX, int NV>
cudaError_t launch_decode(const fa_cuda_params *p, cudaStream_t stream)
{
    /* <= 4 warps * 4 rows * 256 columns * 4 bytes = 16 KiB: below the 48 KiB default */
    const size_t smem = sizeof(float) * (size_t)DEC_WARPS * RMAX * (size_t)p->Dv;
    int nsm, occ = 0;
    cudaMemPool_t pool;
    device_state(&nsm, &pool);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fa_decode_kernel<TQ, TKV, RMAX, NV>, DEC_THREADS,
                                                      smem) != cudaSuccess) {
        (void)cudaGetLastError();
        occ = 0; /* unknown: no automatic split */
    }
    fa_split sp; /* chunks of whole 32-key multiples; the grid has one block per chunk */
    plan_split(p, (pool && p->S > BN) ? choose_decode_splits(p->Hk * p->B, p->S, nsm, occ) : 1, BN, 1, pool,
               stream, &sp);
    sp.vec = 1; /* unused by fa_decode_kernel */

    const dim3 grid((unsigned)sp.ns, (unsigned)p->Hk, (unsigned)p->B);
    fa_decode_kernel<TQ, TKV, RMAX, NV><<<grid, DEC_THREADS, smem, stream>>>(*p, sp);
    cudaError_t e = cudaGetLastError();
    return finish_split<TQ>(p, sp, e, stream);
}

/* NV = 2 vectors per lane only when a row has more than 32 of them (fp32
 * rows of more than 128 columns); 16-bit rows have at most 256 / 8 = 32. */
template <typename TQ, typename TKV, int RMAX>
cudaError_t launch_decode_nv(const fa_cuda_params *p, cudaStream_t stream)
{
    if constexpr (sizeof(TKV) == 4) {
        if ((p->D > p->Dv ? p->D : p->Dv) / 4 > 32) return launch_decode<TQ, TKV, RMAX, 2>(p, stream);
    }
    return launch_decode<TQ, TKV, RMAX, 1>(p, stream);
}

template <typename TQ, typename TKV>
cudaError_t launch_decode_rows(const fa_cuda_params *p, cudaStream_t stream)
{
    const int64_t R = p->Hq / p->Hk * p->L; /* 1 .. DEC_MAX_ROWS */
    if (R == 1) return launch_decode_nv<TQ, TKV, 1>(p, stream);
    if (R == 2) return launch_decode_nv<TQ, TKV, 2>(p, stream);
    return launch_decode_nv<TQ, TKV, 4>(p, stream);
}

/* Decode rows (G * L <= DEC_MAX_ROWS, aligned K / V rows) go to
 * fa_decode_kernel.  Otherwise one row per warp when a (batch, kv head) has
 * at most NWARPS rows (decode with unaligned rows): all warps then have a
 * row instead of one warp having all. */
template <typename TQ, typename TKV>
cudaError_t launch_rows(const fa_cuda_params *p, cudaStream_t stream)
{
    if (decode_applies<TKV>(p)) return launch_decode_rows<TQ, TKV>(p, stream);
    if (p->Hq / p->Hk * p->L <= NWARPS) return launch_dv<TQ, TKV, 1>(p, stream);
    return launch_dv<TQ, TKV, 4>(p, stream);
}


/* ---- tensor-core path: selection and launch -------------------------------- */

/* FASTATTN_CUDA_MMA=0 (read at each launch) turns the tensor-core prefill
 * path off: every launch then uses fa_fwd_kernel (for A/B comparisons and as
 * an escape hatch).  Unset or any other value: on. */
bool mma_enabled() { return !env_is_zero("FASTATTN_CUDA_MMA"); }

/* Row starts of a (B, H, rows, cols) operand are 16-byte aligned: base
 * pointer, and the strides of dimensions that are not of size 1, in whole
 * 8-element vectors (cols is 64 or 128 here). */
bool rows16(const void *ptr, int64_t B, int64_t H, int64_t sb, int64_t sh, int64_t sl)
{
    return ptr != nullptr && (uintptr_t)ptr % 16 == 0 && sl % 8 == 0 && (B == 1 || sb % 8 == 0) &&
           (H == 1 || sh % 8 == 0);
}

/* The tensor-core prefill kernel is used only where it applies as is:
 * q, k, v all float16 or all bfloat16, D == Dv in {64, 128}, no mask, no
 * ALiBi, no softcap, S > 0, 16-byte aligned rows of q, k and v, at least
 * MMA_MIN_ROWS stacked rows per (batch, kv head) (G * L; fewer rows is
 * decode, where the CUDA-core kernel with split-KV is the better choice),
 * and a device of compute capability >= 8.0 (mma.m16n8k16 with bf16,
 * cp.async, ldmatrix). */
bool mma_applies(const fa_cuda_params *p)
{
    const int dt = p->q_dtype;
    if (!(p->kv_dtype == dt && (dt == FA_F16 || dt == FA_BF16))) return false;
    if (p->D != p->Dv || (p->D != 64 && p->D != 128)) return false;
    if (p->mask_kind != FA_MASK_NONE || p->alibi != nullptr || p->softcap != 0.0) return false;
    if (p->S <= 0 || p->Hq / p->Hk * p->L < MMA_MIN_ROWS) return false;
    if (!rows16(p->q, p->B, p->Hq, p->q_sb, p->q_sh, p->q_sl) ||
        !rows16(p->k, p->B, p->Hk, p->k_sb, p->k_sh, p->k_sl) ||
        !rows16(p->v, p->B, p->Hk, p->v_sb, p->v_sh, p->v_sl))
        return false;
    if (!mma_enabled()) return false;
    int nsm, major;
    cudaMemPool_t pool;
    device_state(&nsm, &pool, &major);
    return major >= 8;
}

template <typename T, int D>
cudaError_t launch_mma(const fa_cuda_params *p, cudaStream_t stream)
{
    const int64_t nrb = (p->Hq / p->Hk * p->L + MMA_BM - 1) / MMA_BM;
    int nsm, major;
    cudaMemPool_t pool;
    device_state(&nsm, &pool, &major);
    fa_split sp;
    plan_split(p, (pool && p->S > MMA_BN) ? choose_splits(nrb * p->Hk * p->B, p->S, nsm) : 1, MMA_BN, nrb,
               pool, stream, &sp);
    sp.vec = 1; /* unused by fa_mma_kernel */

    const size_t smem = mma_smem_bytes<D>();
    cudaError_t e = cudaFuncSetAttribute(fa_mma_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
    if (e == cudaSuccess) {
        const dim3 grid((unsigned)(nrb * sp.ns), (unsigned)p->Hk, (unsigned)p->B);
        fa_mma_kernel<T, D><<<grid, THREADS, smem, stream>>>(*p, sp);
        e = cudaGetLastError();
    }
    return finish_split<T>(p, sp, e, stream);
}

template <typename T>
cudaError_t launch_mma_d(const fa_cuda_params *p, cudaStream_t stream)
{
    return p->D == 64 ? launch_mma<T, 64>(p, stream) : launch_mma<T, 128>(p, stream);
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
    const int64_t blocks_x = (p->Hq / p->Hk * p->L + 15) / 16; /* at most 16 rows per block */
    if (blocks_x > 2147483647LL || p->Hk > 65535 || p->B > 65535)
        FA_FAIL("grid too large: %lld row blocks, Hk=%lld, B=%lld (limits 2^31-1, 65535, 65535)",
                (long long)blocks_x, (long long)p->Hk, (long long)p->B);
    cudaError_t e;
    const cudaStream_t st = (cudaStream_t)stream_handle;
    const int qt = p->q_dtype, kt = p->kv_dtype;
    if (mma_applies(p)) e = qt == FA_F16 ? launch_mma_d<__half>(p, st) : launch_mma_d<__nv_bfloat16>(p, st);
    else if (qt == FA_F32 && kt == FA_F32) e = launch_rows<float, float>(p, st);
    else if (qt == FA_F16 && kt == FA_F16) e = launch_rows<__half, __half>(p, st);
    else if (qt == FA_BF16 && kt == FA_BF16) e = launch_rows<__nv_bfloat16, __nv_bfloat16>(p, st);
    else if (qt == FA_F32 && kt == FA_F16) e = launch_rows<float, __half>(p, st);
    else if (qt == FA_F32 && kt == FA_BF16) e = launch_rows<float, __nv_bfloat16>(p, st);
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
