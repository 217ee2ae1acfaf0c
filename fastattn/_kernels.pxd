# cython: language_level=3
# The C contract of csrc/fastattn.h and csrc/backward.h, declared once.
# fastattn/_kernels.pyx includes this file (same name); its cpdef enums become
# Python enum classes of that module, whose members _kernels.pyx also exports
# as plain ints (_kernels.FA_F32, _kernels.FA_MASK_BOOL, ...), so no Python
# file writes an enum value by hand.  A new fa_params field is added here and
# in fastattn.h (same name), and filled in _kernels.pyx from the Plan field of
# that name (fastattn/_args.py).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

cdef extern from "fastattn.h":
    cpdef enum fa_dtype:
        FA_F32
        FA_F64
        FA_F16
        FA_BF16
        FA_I8
        FA_E4M3
        FA_E5M2

    cpdef enum fa_mask_kind:
        FA_MASK_NONE
        FA_MASK_BOOL
        FA_MASK_F32
        FA_MASK_F64

    cpdef enum fa_isa:
        FA_ISA_SCALAR
        FA_ISA_AVX2
        FA_ISA_AVX512
        FA_ISA_AMX
        FA_ISA_AVX512BF16
        FA_ISA_NEON
        FA_ISA_SVE

    cpdef enum fa_precision:
        FA_PRECISION_HIGHEST
        FA_PRECISION_HIGH
        FA_PRECISION_MEDIUM

    cpdef enum fa_status:
        FA_OK
        FA_ENOMEM
        FA_EINVAL
        FA_ETHREADS

    ctypedef struct fa_params:
        int q_dtype, k_dtype, v_dtype, o_dtype
        int64_t B, Hq, Hk, L, S, D, Dv
        const void *q
        int64_t q_sb, q_sh, q_sl
        const void *k
        int64_t k_sb, k_sh, k_sl
        const void *v
        int64_t v_sb, v_sh, v_sl
        void *o
        int64_t o_sb, o_sh, o_sl
        void *lse
        int64_t lse_sb, lse_sh, lse_sl
        const float *k_scale
        int64_t ks_sb, ks_sh, ks_sl, ks_sd
        const float *v_scale
        int64_t vs_sb, vs_sh, vs_sl, vs_sd
        int mask_kind
        const void *mask
        int64_t m_sb, m_sh, m_sl, m_ss
        double scale
        int causal
        int64_t window_left, window_right
        double softcap
        const double *alibi
        int64_t alibi_sb, alibi_sh
        const double *sinks
        const int64_t *q_lens
        const int64_t *k_lens
        const int64_t *cu_q
        const int64_t *cu_k
        const int32_t *block_table
        int64_t bt_sb, page_size
        const uint8_t *bmask
        int64_t bm_sb, bm_sh, bm_si, bm_sj, bm_q, bm_k
        int num_threads
        int precision
        double dropout_p
        uint64_t dropout_seed
        int64_t dropout_b0

    int fa_attention(const fa_params *p) nogil
    int fa_cpu_has(int isa)
    int fa_isa_best()
    int fa_isa_get()
    int fa_isa_set(int isa)
    int fa_cpu_has_f16c()
    int fa_cpu_has_avx512bf16()
    int fa_cpu_has_amx()
    int fa_cpu_has_amx_fp16()
    int fa_sve_bits()
    int fa_amx_fp16_usable()
    int fa_openmp_enabled()
    int fa_omp_max_threads()
    void fa_cache_sizes(int64_t *l1d, int64_t *l2, int64_t *l3)
    int fa_tiles_set_rows(int64_t rows)
    int64_t fa_tiles_get_rows()
    int64_t fa_tiles_rows(int64_t D, int64_t Dv, int64_t L, int dtype, int causal, int64_t heads)
    int fa_exp2_isa(int isa, const float *x, float *y, int64_t n) nogil
    int fa_heads_together(int on)

cdef extern from "backward.h":
    ctypedef struct fa_bwd_params:
        fa_params f
        const void *dout
        int64_t do_sb, do_sh, do_sl
        void *dq
        int64_t dq_sb, dq_sh, dq_sl
        void *dk
        int64_t dk_sb, dk_sh, dk_sl
        void *dv
        int64_t dv_sb, dv_sh, dv_sl
        double *dsinks

    int fa_attention_backward(const fa_bwd_params *p) nogil
