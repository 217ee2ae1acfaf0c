/* launch.cu: the host side of fa_cuda_attention (fastattn_cuda.h): checks of
 * the fa_params subset the GPU implements, kernel selection, split planning,
 * knobs and launches.  It is the one translation unit that holds the kernels
 * (common.cuh, kernel_*.cuh); runtime.cu holds the thin runtime wrappers.
 *
 * Which kernel runs.  Float16 / bfloat16 prefill without mask, ALiBi or
 * softcap and with D = Dv in {64, 128} runs on tensor cores (fa_mma_kernel,
 * sm_80+, kernel_mma.cuh; FASTATTN_CUDA_MMA=0 turns it off).  Decode (G * L
 * <= 4 rows per (batch, kv head)) with 16-byte aligned K / V rows runs on
 * fa_decode_kernel, which streams K and V straight from global memory into
 * registers with no shared-memory staging or barrier in its key loop
 * (kernel_decode.cuh; FASTATTN_CUDA_DECODE=0 turns it off).  Everything else
 * runs the CUDA-core kernel fa_fwd_kernel (kernel_prefill.cuh).  Any of them
 * may split the keys when the blocks cannot fill the GPU (common.cuh;
 * FASTATTN_CUDA_SPLITS=N forces N chunks).  The knobs are read at each
 * launch, so that tests can flip them between calls. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>

#include "common.cuh"
#include "kernel_decode.cuh"
#include "kernel_mma.cuh"
#include "kernel_prefill.cuh"

namespace {

constexpr int64_t MIN_SPLIT_KEYS = 256; /* automatic splits keep >= this many keys per chunk */
constexpr int MAX_SPLITS = 128;
constexpr int MAX_DEVICES = 64;

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
void plan_split(const fa_params *p, int64_t ns, int64_t tile, int64_t grid_rows, cudaMemPool_t pool,
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
cudaError_t finish_split(const fa_params *p, const fa_split &sp, cudaError_t e, cudaStream_t stream)
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
bool vec_ok(const fa_params *p, int nv)
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
cudaError_t launch(const fa_params *p, cudaStream_t stream)
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
cudaError_t launch_dv(const fa_params *p, cudaStream_t stream)
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
bool decode_applies(const fa_params *p)
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
cudaError_t launch_decode(const fa_params *p, cudaStream_t stream)
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
cudaError_t launch_decode_nv(const fa_params *p, cudaStream_t stream)
{
    if constexpr (sizeof(TKV) == 4) {
        if ((p->D > p->Dv ? p->D : p->Dv) / 4 > 32) return launch_decode<TQ, TKV, RMAX, 2>(p, stream);
    }
    return launch_decode<TQ, TKV, RMAX, 1>(p, stream);
}

template <typename TQ, typename TKV>
cudaError_t launch_decode_rows(const fa_params *p, cudaStream_t stream)
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
cudaError_t launch_rows(const fa_params *p, cudaStream_t stream)
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
bool mma_applies(const fa_params *p)
{
    const int dt = p->q_dtype;
    if (!(p->k_dtype == dt && (dt == FA_F16 || dt == FA_BF16))) return false;
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
cudaError_t launch_mma(const fa_params *p, cudaStream_t stream)
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
cudaError_t launch_mma_d(const fa_params *p, cudaStream_t stream)
{
    return p->D == 64 ? launch_mma<T, 64>(p, stream) : launch_mma<T, 128>(p, stream);
}

} // namespace

extern "C" int fa_cuda_attention(const fa_params *p, uintptr_t stream_handle, char *err, size_t errlen)
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
    /* The fa_params fields the GPU kernels do not implement (fastattn_cuda.h). */
    if (p->sinks) FA_FAIL("sinks is not supported by the CUDA kernels");
    if (p->q_lens) FA_FAIL("q_lens is not supported by the CUDA kernels");
    if (p->cu_q) FA_FAIL("cu_q (packed varlen) is not supported by the CUDA kernels");
    if (p->cu_k) FA_FAIL("cu_k (packed varlen) is not supported by the CUDA kernels");
    if (p->bmask) FA_FAIL("bmask (block-sparse) is not supported by the CUDA kernels");
    if (p->precision != FA_PRECISION_HIGHEST)
        FA_FAIL("precision %d is not supported by the CUDA kernels (float32 only)", p->precision);
    if (p->dropout_p != 0.0) FA_FAIL("dropout is not supported by the CUDA kernels");
    if (p->o_dtype != p->q_dtype || p->v_dtype != p->k_dtype)
        FA_FAIL("o_dtype (%d) must equal q_dtype (%d), v_dtype (%d) must equal k_dtype (%d)", p->o_dtype,
                p->q_dtype, p->v_dtype, p->k_dtype);
    if (p->B == 0 || p->Hq == 0 || p->L == 0) return FA_OK;
    if (!p->q || !p->o || (p->S > 0 && (!p->k || !p->v)))
        FA_FAIL("q and o (and k, v when S > 0) must be device pointers");
    const int64_t blocks_x = (p->Hq / p->Hk * p->L + 15) / 16; /* at most 16 rows per block */
    if (blocks_x > 2147483647LL || p->Hk > 65535 || p->B > 65535)
        FA_FAIL("grid too large: %lld row blocks, Hk=%lld, B=%lld (limits 2^31-1, 65535, 65535)",
                (long long)blocks_x, (long long)p->Hk, (long long)p->B);
    cudaError_t e;
    const cudaStream_t st = (cudaStream_t)stream_handle;
    const int qt = p->q_dtype, kt = p->k_dtype;
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
