/* fastattn.h: the one contract between the Python binding and the C kernels.
 *
 * Vocabulary: B batch, Hq query heads, Hk key/value heads, L query length,
 * S key length, D head dim of Q and K, Dv head dim of V and O.
 * All strides are in ELEMENTS (not bytes); the last dimension of q, k, v, o is
 * contiguous (stride 1).  Index arithmetic is 64-bit throughout.
 * Masks: bool masks have polarity True = may attend; float masks are added to
 * the scores.  Causal alignment is bottom-right: query i sees keys
 * j <= i + (S_b - L_b), where S_b and L_b are the valid lengths of batch b.
 */
#ifndef FASTATTN_H
#define FASTATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* FA_I8, FA_E4M3 (fp8 e4m3fn: no infinities, NaN = S.1111.111) and FA_E5M2
 * (fp8 e5m2: the upper byte of a float16) are K/V storage only, read with
 * float32 scales (k_scale, v_scale); q and o are never 8-bit. */
enum fa_dtype { FA_F32 = 0, FA_F64 = 1, FA_F16 = 2, FA_BF16 = 3, FA_I8 = 4, FA_E4M3 = 5, FA_E5M2 = 6 };
enum fa_mask_kind { FA_MASK_NONE = 0, FA_MASK_BOOL = 1, FA_MASK_F32 = 2, FA_MASK_F64 = 3 };
/* FA_ISA_AMX: AVX-512 for every call, plus the AMX tile kernel for bfloat16 prefill.
 * FA_ISA_AVX512BF16: AVX-512 for every call, plus the same kernel on VDPBF16PS
 * products (CPUs with AVX512-BF16 and no AMX). */
/* FA_ISA_NEON: AArch64 Advanced SIMD (kernel_f32_neon.c).  FA_ISA_SVE: the
 * same kernels in SVE vectors of the CPU's length where it is 256 or 512
 * bits (kernel_f32_sve256.c, kernel_f32_sve512.c), NEON for the rest.  The x86
 * ISAs are never available on Arm64 and the Arm ones never on x86. */
enum fa_isa {
    FA_ISA_SCALAR = 0, FA_ISA_AVX2 = 1, FA_ISA_AVX512 = 2, FA_ISA_AMX = 3, FA_ISA_AVX512BF16 = 4, FA_ISA_NEON = 5,
    FA_ISA_SVE = 6
};
/* torch's float32 matmul precision levels (fa_params.precision). */
enum fa_precision { FA_PRECISION_HIGHEST = 0, FA_PRECISION_HIGH = 1, FA_PRECISION_MEDIUM = 2 };
/* FA_ETHREADS: the OS refused to start the threads of a team (num_threads). */
enum fa_status { FA_OK = 0, FA_ENOMEM = 1, FA_EINVAL = 2, FA_ETHREADS = 3 };

typedef struct fa_params {
    int q_dtype, k_dtype, v_dtype, o_dtype; /* enum fa_dtype; FA_F64 only with all F64 */
    int64_t B, Hq, Hk, L, S, D, Dv;

    const void *q; int64_t q_sb, q_sh, q_sl; /* (B, Hq, L, D)  */
    const void *k; int64_t k_sb, k_sh, k_sl; /* (B, Hk, S, D)  */
    const void *v; int64_t v_sb, v_sh, v_sl; /* (B, Hk, S, Dv) */
    void *o;       int64_t o_sb, o_sh, o_sl; /* (B, Hq, L, Dv) */
    /* Optional (NULL): natural-log LSE, compute dtype (f32, or f64 for f64). */
    void *lse;     int64_t lse_sb, lse_sh, lse_sl;

    /* Scales of 8-bit K / V (NULL for float K / V; required for 8-bit ones):
     * dequantised K[b, h, j, d] = k[b, h, j, d] * k_scale[b*ks_sb + h*ks_sh +
     * j*ks_sl + d*ks_sd], float32, finite and > 0 (a float32 normal), and the
     * same for V.  ks_sl and ks_sd are never both nonzero: a scale is per
     * token (ks_sd = 0), per channel (ks_sl = 0) or per head / tensor (both
     * 0).  Token j is counted as k's rows are (with cu_k, from the packed
     * start: the scale of the key at row koff + j). */
    const float *k_scale; int64_t ks_sb, ks_sh, ks_sl, ks_sd;
    const float *v_scale; int64_t vs_sb, vs_sh, vs_sl, vs_sd;

    /* Optional additive / boolean mask, broadcast through (possibly 0) strides
     * over (B, Hq, L, S). */
    int mask_kind; const void *mask; int64_t m_sb, m_sh, m_sl, m_ss;

    double scale;            /* multiplies Q.K^T */
    int causal;              /* bottom-right aligned */
    int64_t window_left;     /* -1: unbounded; sees keys >= i' - left  */
    int64_t window_right;    /* -1: unbounded; sees keys <= i' + right */
    double softcap;          /* 0: off; else s = softcap * tanh(s / softcap) */
    const double *alibi;     /* optional: slope at alibi[b*alibi_sb + h*alibi_sh]; adds -slope*|i'-j| */
    int64_t alibi_sb, alibi_sh;
    const double *sinks;     /* optional (Hq,): logits joining the denominator only */

    /* Optional per-batch valid lengths (B,). Rows i >= L_b are written as zeros
     * with LSE -inf; keys j >= S_b are ignored. */
    const int64_t *q_lens, *k_lens;
    /* Optional packed variable-length batches (B+1,) cumulative offsets along
     * the sequence axis (flash-attn's cu_seqlens); batch strides are then 0. */
    const int64_t *cu_q, *cu_k;
    /* Optional paged K/V (flash-attn's block_table; NULL: contiguous).  Key j
     * of batch b lies in page pg = block_table[b*bt_sb + j / page_size]: its
     * row at k + pg*k_sb + h*k_sh + (j % page_size)*k_sl, so that k_sb (and
     * v_sb, and ks_sb / vs_sb of per-token scales, which are paged with their
     * tokens) is the stride between pages; per-channel and per-head scales
     * stay indexed by batch.  Every entry that a key j < S_b falls in is a
     * valid page (the caller checks); page_size >= 1.  With cu_k, cu_k gives
     * the key lengths only (no offsets into k). */
    const int32_t *block_table; int64_t bt_sb, page_size;

    /* Optional block-sparse pattern over (B, Hq, ceil(L/bm_q), ceil(S/bm_k)),
     * nonzero = block is computed. */
    const uint8_t *bmask; int64_t bm_sb, bm_sh, bm_si, bm_sj, bm_q, bm_k;

    int num_threads;         /* >= 1; at most 1024 are used */
    /* enum fa_precision, float32 q, k, v only: "high" (bf16x3) and "medium" (bf16)
     * run on the AMX kernel where the ISA is amx, "medium" on VDPBF16PS where it is
     * avx512bf16; elsewhere float32 ("highest"). */
    int precision;

    /* Attention dropout (training; 0: off): a probability P[b, h, i, j] is
     * kept, and multiplied by 1 / (1 - dropout_p), when the 32-bit word
     * u(b, h, i, j) >= round(dropout_p * 2^32), else zeroed; the normaliser
     * and the LSE are those of the undropped softmax (dropout.h gives u:
     * Philox-4x64-10 keyed by dropout_seed, counted by (j / 8, i, h, b)).
     * b counts from dropout_b0 (the caller's batch index of this call's
     * batch 0), i and j are the positions within the batch's sequences, h
     * the query head.  0 <= dropout_p <= 1.  The forward and the backward
     * given the same fields regenerate the same mask; it does not depend on
     * the thread count, the ISA or the path. */
    double dropout_p;
    uint64_t dropout_seed;
    int64_t dropout_b0;
} fa_params;

/* Runs the attention described by p.  Returns enum fa_status. */
int fa_attention(const fa_params *p);

/* CPU features and ISA selection (dispatch.c). */
int fa_cpu_has(int isa);             /* 1 when the CPU and OS support isa */
int fa_isa_best(void);
int fa_isa_get(void);
int fa_isa_set(int isa);             /* 0 ok, -1 when the CPU lacks it */
int fa_cpu_has_f16c(void);
int fa_cpu_has_avx512bf16(void);
int fa_cpu_has_amx(void);            /* AMX-BF16 usable: CPU, OS state and tile permission */
int fa_cpu_has_amx_fp16(void);       /* the CPU has AMX-FP16 (with AMX-BF16 usable) */
int fa_amx_fp16_usable(void);        /* float16 inputs take the tiles where the ISA is amx */
int fa_sve_bits(void);               /* the CPU's SVE vector length in bits; 0 without SVE */

/* Caches and the forward kernels' row block (tiles.c).  fa_cache_sizes: bytes
 * of the L1 data, L2 and L3 caches of one core (0 where unknown).
 * fa_tiles_set_rows: stacked rows per task for every later call (0: derived
 * from the L2 size, the default), -1 when rows is negative or above 4096.
 * fa_tiles_rows: the rows a call of that shape, dtype and causality takes now. */
void fa_cache_sizes(int64_t *l1d, int64_t *l2, int64_t *l3);
int fa_tiles_set_rows(int64_t rows);
int64_t fa_tiles_get_rows(void);
int64_t fa_tiles_rows(int64_t D, int64_t Dv, int64_t L, int dtype, int causal, int64_t heads);

/* OpenMP facts (attention.c). */
int fa_openmp_enabled(void);
int fa_omp_max_threads(void);

/* Test hook: whether paged single-row decode runs the tasks of several kv heads
 * together (kernel.h run_heads; on by default).  Sets it, returns the old value;
 * for tests that compare it with one task per head (process-wide: not for
 * concurrent calls). */
int fa_heads_together(int on);

/* Test hook: the vectorised exp2 of an ISA path applied to n floats. */
int fa_exp2_isa(int isa, const float *x, float *y, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
