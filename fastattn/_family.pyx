# cython: language_level=3, boundscheck=False, wraparound=False
# cython: freethreading_compatible=True
"""Thin binding to the kernels of the attention family beyond dot-product
(csrc/family.h): additive attention and rotary embeddings.  Arguments arrive
checked and shaped by fastattn.additive / fastattn.positions; strides are
passed to C in elements.
"""
from libc.stdint cimport int64_t
cimport numpy as cnp

cnp.import_array()

cdef extern from "family.h":
    ctypedef struct fa_additive_params:
        int dtype
        int64_t B, L, S, A, Dv
        const void *pq
        int64_t pq_sb, pq_sl
        const void *pk
        int64_t pk_sb, pk_sa
        const void *w
        const void *v
        int64_t v_sb, v_sl
        void *o
        int64_t o_sb, o_sl
        void *lse
        int64_t lse_sb
        void *wts
        int64_t wts_sb, wts_sl
        int mask_kind
        const void *mask
        int64_t m_sb, m_sl, m_ss
        int num_threads

    ctypedef struct fa_rotary_params:
        int src_dtype, dst_dtype, cdtype
        int64_t B, H, T, D, rdim
        int interleaved
        const void *src
        int64_t s_sb, s_sh, s_st
        void *dst
        int64_t d_sb, d_sh, d_st
        int dst_at_pos
        const int64_t *pos
        int64_t p_sb, p_st
        const void *cos
        const void *sin
        int num_threads

    int fa_additive(const fa_additive_params *p, int isa) nogil
    int fa_rotary(const fa_rotary_params *p) nogil

# The element type codes of fastattn._kernels (bfloat16 added on first use, so that
# importing fastattn does not import ml_dtypes).
from fastattn._kernels import DTYPE_CODES

# amx, avx512bf16: the AVX-512 kernels here (their extra kernels are for bf16 SDPA only)
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "amx": 3, "avx512bf16": 4}


cdef inline const void *_ptr(object a):
    return NULL if a is None else cnp.PyArray_DATA(<cnp.ndarray>a)


cdef inline int64_t _st(cnp.ndarray a, int d):
    return cnp.PyArray_STRIDE(a, d) // cnp.PyArray_ITEMSIZE(a)


cdef _check(int rc):
    if rc == 1:
        raise MemoryError("fastattn: could not allocate kernel scratch memory")
    if rc != 0:
        raise RuntimeError(f"fastattn: kernel failed with status {rc}")


def additive(cnp.ndarray pq, cnp.ndarray pk, cnp.ndarray w, cnp.ndarray v, cnp.ndarray out,
             object lse, object wts, object mask, int mask_kind, str isa, int num_threads):
    """pq (B, L, A), pk (B, A, S), w (A,), v (B, S, Dv), out (B, L, Dv), lse (B, L) or None,
    wts (B, L, S) or None, mask (B, L, S) view or None.  Trusted (checked by the caller)."""
    cdef fa_additive_params p
    cdef int rc
    cdef int code = ISA_CODES[isa]
    p.dtype = DTYPE_CODES[pq.dtype]
    p.B = pq.shape[0]
    p.L = pq.shape[1]
    p.A = pq.shape[2]
    p.S = pk.shape[2]
    p.Dv = v.shape[2]
    p.pq = _ptr(pq)
    p.pq_sb, p.pq_sl = _st(pq, 0), _st(pq, 1)
    p.pk = _ptr(pk)
    p.pk_sb, p.pk_sa = _st(pk, 0), _st(pk, 1)
    p.w = _ptr(w)
    p.v = _ptr(v)
    p.v_sb, p.v_sl = _st(v, 0), _st(v, 1)
    p.o = <void *>_ptr(out)
    p.o_sb, p.o_sl = _st(out, 0), _st(out, 1)
    p.lse = <void *>_ptr(lse)
    p.lse_sb = 0 if lse is None else _st(<cnp.ndarray>lse, 0)
    p.wts = <void *>_ptr(wts)
    p.wts_sb = p.wts_sl = 0
    if wts is not None:
        p.wts_sb, p.wts_sl = _st(<cnp.ndarray>wts, 0), _st(<cnp.ndarray>wts, 1)
    p.mask_kind = mask_kind
    p.mask = _ptr(mask)
    p.m_sb = p.m_sl = p.m_ss = 0
    if mask is not None:
        p.m_sb = _st(<cnp.ndarray>mask, 0)
        p.m_sl = _st(<cnp.ndarray>mask, 1)
        p.m_ss = _st(<cnp.ndarray>mask, 2)
    p.num_threads = num_threads
    with nogil:
        rc = fa_additive(&p, code)
    _check(rc)


def rotary(cnp.ndarray src, cnp.ndarray dst, cnp.ndarray pos, cnp.ndarray cos, cnp.ndarray sin,
           bint interleaved, int num_threads, bint dst_at_pos=False):
    """src (B, H, T, D), dst (B, H, T or more, D) views (any storage dtype, last dim
    contiguous), pos (B, T) int64 view, cos/sin (npos, rdim/2) C-contiguous float32 or
    float64.  dst_at_pos: row t goes to dst row pos[b, t] (cache append).  Trusted."""
    cdef fa_rotary_params p
    cdef int rc
    p.src_dtype = DTYPE_CODES[src.dtype]
    p.dst_dtype = DTYPE_CODES[dst.dtype]
    p.cdtype = DTYPE_CODES[cos.dtype]
    p.B = src.shape[0]
    p.H = src.shape[1]
    p.T = src.shape[2]
    p.D = src.shape[3]
    p.rdim = 2 * cos.shape[1]
    p.interleaved = interleaved
    p.src = _ptr(src)
    p.s_sb, p.s_sh, p.s_st = _st(src, 0), _st(src, 1), _st(src, 2)
    p.dst = <void *>_ptr(dst)
    p.d_sb, p.d_sh, p.d_st = _st(dst, 0), _st(dst, 1), _st(dst, 2)
    p.dst_at_pos = dst_at_pos
    p.pos = <const int64_t *>_ptr(pos)
    p.p_sb, p.p_st = _st(pos, 0), _st(pos, 1)
    p.cos = _ptr(cos)
    p.sin = _ptr(sin)
    p.num_threads = num_threads
    with nogil:
        rc = fa_rotary(&p)
    _check(rc)
