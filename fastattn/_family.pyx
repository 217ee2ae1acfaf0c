# cython: language_level=3, boundscheck=False, wraparound=False
# cython: freethreading_compatible=True
"""Thin binding to the kernels of the attention family beyond dot-product
(csrc/family.h): additive attention, LSH attention and rotary embeddings.
Arguments arrive checked and shaped by fastattn.additive / fastattn.lsh /
fastattn.positions; strides are passed to C in elements.
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

    ctypedef struct fa_lsh_params:
        int dtype
        int64_t B, L, D, Dv, n_hashes, n_buckets, chunk
        int causal
        double scale
        const void *x
        int64_t x_sb, x_sl
        const void *v
        int64_t v_sb, v_sl
        const void *rot
        void *o
        int64_t o_sb, o_sl
        double *lse
        int64_t lse_sb
        int num_threads

    int fa_additive(const fa_additive_params *p, int isa) nogil
    int fa_lsh(const fa_lsh_params *p, int isa) nogil
    int fa_rotary(const fa_rotary_params *p) nogil
    void fa_family_bind(void *team_size, void *fpenv_enter, void *fpenv_exit)

# The element type codes of fastattn._kernels (bfloat16 added on first use, so that
# importing fastattn does not import ml_dtypes).
from fastattn._kernels import DTYPE_CODES

import fastattn._kernels as _kernels_mod

cdef bint _bound = False


cdef _bind():
    """Hand the C drivers the thread and floating-point functions of fastattn._kernels
    (csrc/attention.c), so that both extensions share one fork and team state: a team
    started by either makes a fork() child run single-threaded in both.  Loaded by
    address through ctypes (the extensions do not link each other); where that fails
    the drivers keep their local rules (bounded teams, the same floating-point mode)."""
    global _bound
    if _bound:
        return
    _bound = True
    cdef size_t a = 0, b = 0, c = 0
    try:
        import ctypes

        lib = ctypes.CDLL(_kernels_mod.__file__)
        a = <size_t>ctypes.cast(lib.fa_team_size, ctypes.c_void_p).value
        b = <size_t>ctypes.cast(lib.fa_fpenv_enter, ctypes.c_void_p).value
        c = <size_t>ctypes.cast(lib.fa_fpenv_exit, ctypes.c_void_p).value
    except (OSError, AttributeError, TypeError):
        return
    fa_family_bind(<void *>a, <void *>b, <void *>c)

# enum fa_isa as fastattn._kernels reads it from csrc/fastattn.h; amx and avx512bf16
# run the AVX-512 kernels here (their extra kernels are for bf16 SDPA only).
ISA_CODES = {name: code for code, name in enumerate(_kernels_mod.ISA_NAMES)}


cdef inline const void *_ptr(object a):
    return NULL if a is None else cnp.PyArray_DATA(<cnp.ndarray>a)


cdef inline int64_t _st(cnp.ndarray a, int d):
    return cnp.PyArray_STRIDE(a, d) // cnp.PyArray_ITEMSIZE(a)


cdef _check(int rc, int num_threads):
    if rc == 1:
        raise MemoryError("fastattn: could not allocate kernel scratch memory")
    if rc == 3:
        raise RuntimeError(
            f"fastattn: the operating system refused to start the threads of a team "
            f"(num_threads={num_threads}); pass a smaller num_threads")
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
    _bind()
    with nogil:
        rc = fa_additive(&p, code)
    _check(rc, num_threads)


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
    _bind()
    with nogil:
        rc = fa_rotary(&p)
    _check(rc, num_threads)


def lsh(cnp.ndarray x, cnp.ndarray v, cnp.ndarray rot, cnp.ndarray out, cnp.ndarray lse,
        int n_buckets, int n_hashes, int chunk, bint causal, double scale, str isa, int num_threads):
    """x (B, L, D), v (B, L, Dv) views with a contiguous last dim (float32 or float64),
    rot (n_hashes, D, n_buckets/2) C-contiguous in x's dtype, out (B, L, Dv) and lse
    (B, L) float64 written.  Trusted (checked by fastattn.lsh)."""
    cdef fa_lsh_params p
    cdef int rc
    cdef int code = ISA_CODES[isa]
    p.dtype = DTYPE_CODES[x.dtype]
    p.B = x.shape[0]
    p.L = x.shape[1]
    p.D = x.shape[2]
    p.Dv = v.shape[2]
    p.n_hashes = n_hashes
    p.n_buckets = n_buckets
    p.chunk = chunk
    p.causal = causal
    p.scale = scale
    p.x = _ptr(x)
    p.x_sb, p.x_sl = _st(x, 0), _st(x, 1)
    p.v = _ptr(v)
    p.v_sb, p.v_sl = _st(v, 0), _st(v, 1)
    p.rot = _ptr(rot)
    p.o = <void *>_ptr(out)
    p.o_sb, p.o_sl = _st(out, 0), _st(out, 1)
    p.lse = <double *>_ptr(lse)
    p.lse_sb = _st(lse, 0)
    p.num_threads = num_threads
    _bind()
    with nogil:
        rc = fa_lsh(&p, code)
    _check(rc, num_threads)
