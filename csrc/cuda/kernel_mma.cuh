/* kernel_mma.cuh: fa_mma_kernel, tensor-core prefill (sm_80+, q/k/v float16
 * or bfloat16, D = Dv in {64, 128}); included by launch.cu only.
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
#ifndef FASTATTN_CUDA_KERNEL_MMA_CUH
#define FASTATTN_CUDA_KERNEL_MMA_CUH

#include "common.cuh"

namespace {

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
__global__ void __launch_bounds__(THREADS) fa_mma_kernel(const fa_params p, const fa_split sp)
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
            if (p.lse && t == 0) lse_f32(p)[b * p.lse_sb + h * p.lse_sh + i * p.lse_sl] = lse;
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

} // namespace

#endif
