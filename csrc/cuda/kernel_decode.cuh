/* kernel_decode.cuh: fa_decode_kernel, decode (few rows per (batch, kv
 * head)); included by launch.cu only.
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
#ifndef FASTATTN_CUDA_KERNEL_DECODE_CUH
#define FASTATTN_CUDA_KERNEL_DECODE_CUH

#include "common.cuh"

namespace {

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
__global__ void __launch_bounds__(DEC_THREADS) fa_decode_kernel(const fa_params p, const fa_split sp)
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
            if (p.lse && d == 0) lse_f32(p)[b * p.lse_sb + h * p.lse_sh + i * p.lse_sl] = lse;
        } else {
            /* every (split, row) entry is written, also when the chunk held no key */
            const int64_t w = (int64_t)split * sp.nrows + (b * p.Hq + h) * L + i;
            sp.part_o[w * Dv + d] = val;
            if (d == 0) sp.part_lse[w] = lse;
        }
    }
}

} // namespace

#endif
