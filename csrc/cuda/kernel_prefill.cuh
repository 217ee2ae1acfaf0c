/* kernel_prefill.cuh: fa_fwd_kernel, the CUDA-core kernel (fp32 FMA) that
 * takes every launch the tensor-core and decode kernels do not (included by
 * launch.cu only).
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
 * used (8 independent loads per thread before their stores).  Split-KV: see
 * common.cuh. */
#ifndef FASTATTN_CUDA_KERNEL_PREFILL_CUH
#define FASTATTN_CUDA_KERNEL_PREFILL_CUH

#include "common.cuh"

namespace {

/* 16-byte vectors per thread (for K, and again for V) that the pipelined
 * loader keeps in registers: a 32-key tile of 32 * DVL columns of T is
 * 32 * 32 * DVL * sizeof(T) / 16 / THREADS = DVL * sizeof(T) / 2 vectors per
 * thread; capped at 8 (32 registers per operand). */
template <typename T> __host__ __device__ constexpr int nvec_for(int dvl)
{
    return dvl * (int)sizeof(T) / 2 < 8 ? dvl * (int)sizeof(T) / 2 : 8;
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
__device__ __forceinline__ void compute_tile(const fa_params &p, RowState<RPW, DVL> &st, const float *qw,
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
__global__ void __launch_bounds__(THREADS) fa_fwd_kernel(const fa_params p, const fa_split sp)
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
            if (p.lse && lane == 0) lse_f32(p)[b * p.lse_sb + h * p.lse_sh + i * p.lse_sl] = lse;
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

} // namespace

#endif
