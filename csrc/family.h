/* family.h: the contract between fastattn/_family.pyx and the kernels of the
 * attention family beyond dot-product (csrc/family.c, additive_*.c, lsh_*.c):
 * additive (Bahdanau) attention, Reformer's LSH attention and rotary
 * position embeddings.
 *
 * Strides are in ELEMENTS; the last dimension of every array is contiguous.
 * The ISA is passed in by the caller (fastattn.get_isa()), so that
 * fastattn.set_isa() selects these kernels as it selects the dot-product one.
 */
#ifndef FA_FAMILY_H
#define FA_FAMILY_H

#include <stddef.h>
#include <stdint.h>
#include "fastattn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Additive attention after the two projections:
 *   e[b,i,j] = sum_a w[a] * tanh(pq[b,i,a] + pk[b,a,j])   (bias folded into pq)
 *   e += mask (float) / e = -inf where mask is False (bool)
 *   out[b,i,:] = softmax_j(e[b,i,:]) @ value[b,:,:]
 * pq (B, L, A), pk TRANSPOSED (B, A, S) so that the hot loop runs over keys,
 * value (B, S, Dv), out (B, L, Dv); all in the compute dtype (FA_F32 / FA_F64).
 * A fully masked row gives zeros (weights zeros, LSE -inf). */
typedef struct fa_additive_params {
    int dtype;                 /* FA_F32 or FA_F64 */
    int64_t B, L, S, A, Dv;
    const void *pq; int64_t pq_sb, pq_sl;     /* (B, L, A) */
    const void *pk; int64_t pk_sb, pk_sa;     /* (B, A, S) */
    const void *w;                            /* (A,) contiguous */
    const void *v;  int64_t v_sb, v_sl;       /* (B, S, Dv) */
    void *o;        int64_t o_sb, o_sl;       /* (B, L, Dv) */
    void *lse;      int64_t lse_sb;           /* optional (B, L), contiguous along L */
    void *wts;      int64_t wts_sb, wts_sl;   /* optional (B, L, S) normalised weights */
    int mask_kind; const void *mask; int64_t m_sb, m_sl, m_ss; /* (B, L, S), broadcast strides */
    int num_threads;
} fa_additive_params;

int fa_additive(const fa_additive_params *p, int isa);

/* Reformer LSH attention with shared queries and keys (fastattn/lsh.py has
 * the rules).  x (B, L, D) and v (B, L, Dv) in the compute dtype (FA_F32 /
 * FA_F64), rot (n_hashes, D, n_buckets / 2) C-contiguous in the same dtype;
 * o (B, L, Dv) and lse (B, L) float64 are written (the rounds' LSEs combine
 * in float64: a token that saw only itself sits near -1e5, where a float32
 * LSE would lose the rounds' weights).  L is a multiple of chunk and below
 * 2^31; n_buckets is even and below 2^31.  Returns enum fa_status. */
typedef struct fa_lsh_params {
    int dtype;
    int64_t B, L, D, Dv, n_hashes, n_buckets, chunk;
    int causal;
    double scale;
    const void *x;  int64_t x_sb, x_sl;
    const void *v;  int64_t v_sb, v_sl;
    const void *rot;
    void *o;        int64_t o_sb, o_sl;
    double *lse;    int64_t lse_sb;
    int num_threads;
} fa_lsh_params;

int fa_lsh(const fa_lsh_params *p, int isa);

/* The thread and floating-point-environment functions of the dot-product
 * driver (attention.c: fa_team_size, fa_fpenv_enter, fa_fpenv_exit, whose
 * fork and team state must be the process's one), bound once by the binding
 * before any call.  Unbound, the drivers bound the team size and set the
 * floating-point mode themselves. */
void fa_family_bind(void *team_size, void *fpenv_enter, void *fpenv_exit);

/* Rotary position embedding applied while copying rows:
 *   dst[b,h,t,:] = rotate(src[b,h,t,:], pos[b,t])
 * over the first rdim features (rdim even, <= D), the others copied.  NeoX
 * rotate-half (interleaved = 0): x1 = x[:rdim/2], x2 = x[rdim/2:rdim],
 * (x1 cos - x2 sin, x2 cos + x1 sin); GPT-J (interleaved = 1): pairs
 * (x[2i], x[2i+1]).  cos/sin: (npos, rdim/2) contiguous in the compute dtype
 * (FA_F64 when cdtype is FA_F64, else FA_F32); src and dst may be any
 * storage dtype (converted through the compute dtype).  pos values were
 * checked to lie in [0, npos).  dst_at_pos: row t of (b, h) goes to dst row
 * pos[b,t] instead of t (a cache append: keys land at their positions). */
typedef struct fa_rotary_params {
    int src_dtype, dst_dtype, cdtype;
    int64_t B, H, T, D, rdim;
    int interleaved;
    const void *src; int64_t s_sb, s_sh, s_st;
    void *dst;       int64_t d_sb, d_sh, d_st;
    int dst_at_pos;
    const int64_t *pos; int64_t p_sb, p_st;
    const void *cos, *sin;
    int num_threads;
} fa_rotary_params;

int fa_rotary(const fa_rotary_params *p);

#ifdef __cplusplus
}
#endif
#endif
