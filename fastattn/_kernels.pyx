# cython: language_level=3, boundscheck=False, wraparound=False
# cython: freethreading_compatible=True
"""Thin binding to the C kernels: fill ``fa_params`` from arrays that
``fastattn.functional`` has already validated, then make one ``nogil`` call.

Arrays arrive as 4-D ``(B, H, L, D)`` views whose last dimension is
contiguous; strides are passed to C in elements.
"""
from libc.stdint cimport int64_t, uint8_t
cimport numpy as cnp

cnp.import_array()

cdef extern from "fastattn.h":
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
        const uint8_t *bmask
        int64_t bm_sb, bm_sh, bm_si, bm_sj, bm_q, bm_k
        int num_threads
        int precision

    int fa_attention(const fa_params *p) nogil
    int fa_cpu_has(int isa)
    int fa_isa_best()
    int fa_isa_get()
    int fa_isa_set(int isa)
    int fa_cpu_has_f16c()
    int fa_cpu_has_avx512bf16()
    int fa_cpu_has_amx()
    int fa_openmp_enabled()
    int fa_omp_max_threads()
    int fa_exp2_isa(int isa, const float *x, float *y, int64_t n) nogil

import numpy as np

# Indexed by csrc/fastattn.h enum fa_isa; "amx" is AVX-512 plus AMX tiles for bfloat16 prefill.
ISA_NAMES = ("scalar", "avx2", "avx512", "amx")


class _DtypeCodes(dict):
    """Element type codes shared with csrc/fastattn.h (enum fa_dtype), keyed by
    dtype objects (a dict lookup is much cheaper than dtype.name).  bfloat16 is
    added on first use: importing ml_dtypes costs ~0.5 s, and a bfloat16 array
    exists only once its maker has imported it."""

    def __missing__(self, dt):
        if getattr(dt, "name", None) == "bfloat16":
            import ml_dtypes

            if dt == np.dtype(ml_dtypes.bfloat16):
                self[dt] = 3
                return 3
        raise KeyError(dt)


DTYPE_CODES = _DtypeCodes({np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2})
MASK_NONE, MASK_BOOL, MASK_F32, MASK_F64 = 0, 1, 2, 3


cdef inline const void *_ptr(object a):
    return NULL if a is None else cnp.PyArray_DATA(<cnp.ndarray>a)


cdef inline void _strides3(cnp.ndarray a, int64_t *s):
    cdef int64_t item = cnp.PyArray_ITEMSIZE(a)
    s[0] = cnp.PyArray_STRIDE(a, 0) // item
    s[1] = cnp.PyArray_STRIDE(a, 1) // item
    s[2] = cnp.PyArray_STRIDE(a, 2) // item


def attention(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse,
              object mask, int mask_kind, double scale, bint causal,
              int64_t window_left, int64_t window_right, double softcap,
              object alibi, object sinks, object q_lens, object k_lens,
              object cu_q, object cu_k, object bmask, int64_t bm_q, int64_t bm_k,
              int num_threads, int64_t seq_q=-1, int64_t seq_k=-1, int precision=0):
    """Run the fused kernel.  Every argument is trusted (checked by the caller)."""
    cdef fa_params p
    cdef int64_t s[3]
    cdef int rc
    p.q_dtype = DTYPE_CODES[q.dtype]
    p.k_dtype = DTYPE_CODES[k.dtype]
    p.v_dtype = DTYPE_CODES[v.dtype]
    p.o_dtype = DTYPE_CODES[out.dtype]
    p.B = q.shape[0]
    p.Hq = q.shape[1]
    p.L = q.shape[2]
    p.D = q.shape[3]
    p.Hk = k.shape[1]
    p.S = k.shape[2]
    p.Dv = v.shape[3]
    if seq_q >= 0:  # packed varlen: the longest sequence, not the packed length
        p.L = seq_q
    if seq_k >= 0:
        p.S = seq_k
    p.q = _ptr(q)
    _strides3(q, s)
    p.q_sb, p.q_sh, p.q_sl = s[0], s[1], s[2]
    p.k = _ptr(k)
    _strides3(k, s)
    p.k_sb, p.k_sh, p.k_sl = s[0], s[1], s[2]
    p.v = _ptr(v)
    _strides3(v, s)
    p.v_sb, p.v_sh, p.v_sl = s[0], s[1], s[2]
    p.o = <void *>_ptr(out)
    _strides3(out, s)
    p.o_sb, p.o_sh, p.o_sl = s[0], s[1], s[2]
    p.lse = <void *>_ptr(lse)
    p.lse_sb = p.lse_sh = p.lse_sl = 0
    if lse is not None:
        _strides3(lse, s)
        p.lse_sb, p.lse_sh, p.lse_sl = s[0], s[1], s[2]
    p.mask_kind = mask_kind
    p.mask = _ptr(mask)
    p.m_sb = p.m_sh = p.m_sl = p.m_ss = 0
    if mask is not None:
        _strides3(mask, s)
        p.m_sb, p.m_sh, p.m_sl = s[0], s[1], s[2]
        p.m_ss = cnp.PyArray_STRIDE(<cnp.ndarray>mask, 3) // cnp.PyArray_ITEMSIZE(<cnp.ndarray>mask)
    p.scale = scale
    p.causal = causal
    p.window_left = window_left
    p.window_right = window_right
    p.softcap = softcap
    p.alibi = <const double *>_ptr(alibi)
    p.alibi_sb = p.alibi_sh = 0
    if alibi is not None:
        p.alibi_sb = cnp.PyArray_STRIDE(<cnp.ndarray>alibi, 0) // 8
        p.alibi_sh = cnp.PyArray_STRIDE(<cnp.ndarray>alibi, 1) // 8
    p.sinks = <const double *>_ptr(sinks)
    p.q_lens = <const int64_t *>_ptr(q_lens)
    p.k_lens = <const int64_t *>_ptr(k_lens)
    p.cu_q = <const int64_t *>_ptr(cu_q)
    p.cu_k = <const int64_t *>_ptr(cu_k)
    p.bmask = <const uint8_t *>_ptr(bmask)
    p.bm_sb = p.bm_sh = p.bm_si = p.bm_sj = 0
    if bmask is not None:
        _strides3(bmask, s)
        p.bm_sb, p.bm_sh, p.bm_si = s[0], s[1], s[2]
        p.bm_sj = cnp.PyArray_STRIDE(<cnp.ndarray>bmask, 3)
    p.bm_q = bm_q
    p.bm_k = bm_k
    p.num_threads = num_threads
    p.precision = precision
    with nogil:
        rc = fa_attention(&p)
    if rc == 1:
        raise MemoryError("fastattn: could not allocate kernel scratch memory")
    if rc == 3:
        raise RuntimeError(
            f"fastattn: the operating system refused to start the threads of a team "
            f"(num_threads={num_threads}); pass a smaller num_threads")
    if rc != 0:
        raise RuntimeError(f"fastattn: kernel failed with status {rc}")


def exp2(cnp.ndarray[cnp.float32_t, ndim=1, mode="c"] x, str isa):
    """The vectorised exp2 of one ISA path (a test hook)."""
    cdef cnp.ndarray[cnp.float32_t, ndim=1, mode="c"] y = x.copy()
    cdef int code = ISA_NAMES.index(isa)
    cdef int rc
    with nogil:
        rc = fa_exp2_isa(code, &x[0] if x.shape[0] else NULL, &y[0] if y.shape[0] else NULL, x.shape[0])
    if rc != 0:
        raise ValueError(f"this CPU cannot run the {isa!r} path")
    return y


def cpu_has(str isa):
    return bool(fa_cpu_has(ISA_NAMES.index(isa)))


def isa_best():
    return ISA_NAMES[fa_isa_best()]


def isa_get():
    return ISA_NAMES[fa_isa_get()]


def isa_set(str isa):
    """Select an ISA path; returns False when the CPU lacks it."""
    return fa_isa_set(ISA_NAMES.index(isa)) == 0


def cpu_features():
    return {"avx2": bool(fa_cpu_has(1)), "avx512f": bool(fa_cpu_has(2)),
            "f16c": bool(fa_cpu_has_f16c()), "avx512bf16": bool(fa_cpu_has_avx512bf16()),
            "amx_bf16": bool(fa_cpu_has_amx())}


def openmp_enabled():
    return bool(fa_openmp_enabled())


def omp_max_threads():
    return fa_omp_max_threads()


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


def attention_backward(cnp.ndarray dout, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out,
                       cnp.ndarray lse, cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv,
                       object mask, int mask_kind, double scale, bint causal,
                       int64_t window_left, int64_t window_right, double softcap,
                       object alibi, object sinks, object dsinks, object q_lens, object k_lens,
                       int num_threads):
    """Run the fused backward kernel (fastattn.backward checks every argument).

    All arrays are 4-D (B, H, L, X) views in the compute dtype (lse: (B, Hq, L))."""
    cdef fa_bwd_params bp
    cdef int64_t s[3]
    cdef int rc
    cdef int code = DTYPE_CODES[q.dtype]
    bp.f.q_dtype = bp.f.k_dtype = bp.f.v_dtype = bp.f.o_dtype = code
    bp.f.B = q.shape[0]
    bp.f.Hq = q.shape[1]
    bp.f.L = q.shape[2]
    bp.f.D = q.shape[3]
    bp.f.Hk = k.shape[1]
    bp.f.S = k.shape[2]
    bp.f.Dv = v.shape[3]
    bp.f.q = _ptr(q)
    _strides3(q, s)
    bp.f.q_sb, bp.f.q_sh, bp.f.q_sl = s[0], s[1], s[2]
    bp.f.k = _ptr(k)
    _strides3(k, s)
    bp.f.k_sb, bp.f.k_sh, bp.f.k_sl = s[0], s[1], s[2]
    bp.f.v = _ptr(v)
    _strides3(v, s)
    bp.f.v_sb, bp.f.v_sh, bp.f.v_sl = s[0], s[1], s[2]
    bp.f.o = <void *>_ptr(out)
    _strides3(out, s)
    bp.f.o_sb, bp.f.o_sh, bp.f.o_sl = s[0], s[1], s[2]
    bp.f.lse = <void *>_ptr(lse)
    _strides3(lse, s)
    bp.f.lse_sb, bp.f.lse_sh, bp.f.lse_sl = s[0], s[1], s[2]
    bp.f.mask_kind = mask_kind
    bp.f.mask = _ptr(mask)
    bp.f.m_sb = bp.f.m_sh = bp.f.m_sl = bp.f.m_ss = 0
    if mask is not None:
        _strides3(mask, s)
        bp.f.m_sb, bp.f.m_sh, bp.f.m_sl = s[0], s[1], s[2]
        bp.f.m_ss = cnp.PyArray_STRIDE(<cnp.ndarray>mask, 3) // cnp.PyArray_ITEMSIZE(<cnp.ndarray>mask)
    bp.f.scale = scale
    bp.f.causal = causal
    bp.f.window_left = window_left
    bp.f.window_right = window_right
    bp.f.softcap = softcap
    bp.f.alibi = <const double *>_ptr(alibi)
    bp.f.alibi_sb = bp.f.alibi_sh = 0
    if alibi is not None:
        bp.f.alibi_sb = cnp.PyArray_STRIDE(<cnp.ndarray>alibi, 0) // 8
        bp.f.alibi_sh = cnp.PyArray_STRIDE(<cnp.ndarray>alibi, 1) // 8
    bp.f.sinks = <const double *>_ptr(sinks)
    bp.dsinks = <double *>_ptr(dsinks)
    bp.f.q_lens = <const int64_t *>_ptr(q_lens)
    bp.f.k_lens = <const int64_t *>_ptr(k_lens)
    bp.f.cu_q = NULL
    bp.f.cu_k = NULL
    bp.f.bmask = NULL
    bp.f.bm_sb = bp.f.bm_sh = bp.f.bm_si = bp.f.bm_sj = 0
    bp.f.bm_q = bp.f.bm_k = 1
    bp.f.num_threads = num_threads
    bp.dout = _ptr(dout)
    _strides3(dout, s)
    bp.do_sb, bp.do_sh, bp.do_sl = s[0], s[1], s[2]
    bp.dq = <void *>_ptr(dq)
    _strides3(dq, s)
    bp.dq_sb, bp.dq_sh, bp.dq_sl = s[0], s[1], s[2]
    bp.dk = <void *>_ptr(dk)
    _strides3(dk, s)
    bp.dk_sb, bp.dk_sh, bp.dk_sl = s[0], s[1], s[2]
    bp.dv = <void *>_ptr(dv)
    _strides3(dv, s)
    bp.dv_sb, bp.dv_sh, bp.dv_sl = s[0], s[1], s[2]
    with nogil:
        rc = fa_attention_backward(&bp)
    if rc == 1:
        raise MemoryError("fastattn: could not allocate backward scratch memory")
    if rc == 3:
        raise RuntimeError(
            f"fastattn: the operating system refused to start the threads of a team "
            f"(num_threads={num_threads}); pass a smaller num_threads")
    if rc != 0:
        raise RuntimeError(f"fastattn: backward kernel failed with status {rc}")
