# cython: language_level=3, boundscheck=False, wraparound=False
# cython: freethreading_compatible=True
"""Thin binding to the C kernels: fill ``fa_params`` by field name from a
``fastattn._plan.Plan`` that has already been checked, then make one ``nogil``
call.

The C declarations (fa_params, the enums) are in fastattn/_kernels.pxd, which
Cython includes here.  Plan arrays arrive as 4-D ``(B, H, L, D)`` views whose
last dimension is contiguous; strides are passed to C in elements.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
cimport numpy as cnp

cnp.import_array()

import numpy as np

# The enum members as plain module-level ints (FA_F32, FA_MASK_BOOL, ...), their
# values read from csrc/fastattn.h: no Python file writes one by hand.
for _enum in (fa_dtype, fa_mask_kind, fa_isa, fa_precision, fa_status):
    globals().update({_m.name: int(_m) for _m in _enum})
del _enum

# Indexed by enum fa_isa; "amx" is AVX-512 plus AMX tiles for bfloat16 prefill,
# "avx512bf16" AVX-512 plus the same kernel on VDPBF16PS (AVX512-BF16 CPUs without AMX),
# "neon" AArch64 Advanced SIMD, "sve" the same kernels in SVE vectors of 256 or 512 bits.
ISA_NAMES = tuple(m.name[len("FA_ISA_"):].lower() for m in sorted(fa_isa, key=int))


class _DtypeCodes(dict):
    """enum fa_dtype codes keyed by dtype objects (a dict lookup is much cheaper
    than dtype.name).  bfloat16 is added on first use: importing ml_dtypes costs
    ~0.5 s, and a bfloat16 array exists only once its maker has imported it."""

    def __missing__(self, dt):
        code = {"bfloat16": <int>FA_BF16, "float8_e4m3fn": <int>FA_E4M3,
                "float8_e5m2": <int>FA_E5M2}.get(getattr(dt, "name", None))
        if code is not None:
            import ml_dtypes

            if dt == np.dtype(getattr(ml_dtypes, dt.name)):
                self[dt] = code
                return code
        raise KeyError(dt)


DTYPE_CODES = _DtypeCodes({np.dtype(np.float32): <int>FA_F32, np.dtype(np.float64): <int>FA_F64,
                           np.dtype(np.float16): <int>FA_F16, np.dtype(np.int8): <int>FA_I8})
# Older names of the mask kinds.
MASK_NONE, MASK_BOOL = <int>FA_MASK_NONE, <int>FA_MASK_BOOL
MASK_F32, MASK_F64 = <int>FA_MASK_F32, <int>FA_MASK_F64


cdef inline int _dtype_code(cnp.ndarray a) except -1:
    """enum fa_dtype of a's dtype (a C switch for the NumPy types; bfloat16 by DTYPE_CODES)."""
    cdef int t = cnp.PyArray_TYPE(a)
    if t == cnp.NPY_FLOAT32:
        return FA_F32
    if t == cnp.NPY_FLOAT64:
        return FA_F64
    if t == cnp.NPY_FLOAT16:
        return FA_F16
    if t == cnp.NPY_INT8:
        return FA_I8
    return DTYPE_CODES[a.dtype]


cdef inline const void *_ptr(object a):
    return NULL if a is None else cnp.PyArray_DATA(<cnp.ndarray>a)


cdef inline int64_t _stride(cnp.ndarray a, int dim):
    """Stride of dim in elements."""
    return cnp.PyArray_STRIDE(a, dim) // cnp.PyArray_ITEMSIZE(a)


cdef inline void _strides3(cnp.ndarray a, int64_t *sb, int64_t *sh, int64_t *sl):
    sb[0] = _stride(a, 0)
    sh[0] = _stride(a, 1)
    sl[0] = _stride(a, 2)


cdef inline void _scale4(object a, const float **ptr, int64_t *sb, int64_t *sh, int64_t *sl, int64_t *sd):
    """An 8-bit K/V scale: a float32 (B, Hk, S, D) broadcast view, or None."""
    ptr[0] = <const float *>_ptr(a)
    sb[0] = sh[0] = sl[0] = sd[0] = 0
    if a is not None:
        _strides3(<cnp.ndarray>a, sb, sh, sl)
        sd[0] = _stride(<cnp.ndarray>a, 3)


cdef int _fill(fa_params *p, object plan) except -1:
    """p from plan, field by field (the names are fa_params')."""
    cdef cnp.ndarray q = plan.q
    cdef cnp.ndarray k = plan.k
    cdef cnp.ndarray v = plan.v
    cdef cnp.ndarray o = plan.o
    cdef object lse = plan.lse
    cdef object mask = plan.mask
    cdef object alibi = plan.alibi
    cdef object bmask = plan.bmask
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or o.ndim != 4:  # (C-level reads: free)
        raise ValueError("fastattn: a kernel plan's q, k, v and o must be 4-D (a bug in fastattn._args)")
    p.q_dtype = _dtype_code(q)
    p.k_dtype = _dtype_code(k)
    p.v_dtype = _dtype_code(v)
    p.o_dtype = _dtype_code(o)
    p.B = cnp.PyArray_DIM(q, 0)
    p.Hq = cnp.PyArray_DIM(q, 1)
    p.D = cnp.PyArray_DIM(q, 3)
    p.Hk = cnp.PyArray_DIM(k, 1)
    p.Dv = cnp.PyArray_DIM(v, 3)
    p.L = plan.L
    p.S = plan.S
    p.q = cnp.PyArray_DATA(q)
    _strides3(q, &p.q_sb, &p.q_sh, &p.q_sl)
    p.k = cnp.PyArray_DATA(k)
    _strides3(k, &p.k_sb, &p.k_sh, &p.k_sl)
    p.v = cnp.PyArray_DATA(v)
    _strides3(v, &p.v_sb, &p.v_sh, &p.v_sl)
    p.o = cnp.PyArray_DATA(o)
    _strides3(o, &p.o_sb, &p.o_sh, &p.o_sl)
    p.lse = <void *>_ptr(lse)
    p.lse_sb = p.lse_sh = p.lse_sl = 0
    if lse is not None:
        _strides3(lse, &p.lse_sb, &p.lse_sh, &p.lse_sl)
    _scale4(plan.k_scale, &p.k_scale, &p.ks_sb, &p.ks_sh, &p.ks_sl, &p.ks_sd)
    _scale4(plan.v_scale, &p.v_scale, &p.vs_sb, &p.vs_sh, &p.vs_sl, &p.vs_sd)
    p.mask_kind = plan.mask_kind
    p.mask = _ptr(mask)
    p.m_sb = p.m_sh = p.m_sl = p.m_ss = 0
    if mask is not None:
        _strides3(mask, &p.m_sb, &p.m_sh, &p.m_sl)
        p.m_ss = _stride(mask, 3)
    p.scale = plan.scale
    p.causal = plan.causal
    p.window_left = plan.window_left
    p.window_right = plan.window_right
    p.softcap = plan.softcap
    p.alibi = <const double *>_ptr(alibi)
    p.alibi_sb = p.alibi_sh = 0
    if alibi is not None:
        p.alibi_sb = _stride(alibi, 0)
        p.alibi_sh = _stride(alibi, 1)
    p.sinks = <const double *>_ptr(plan.sinks)
    p.q_lens = <const int64_t *>_ptr(plan.q_lens)
    p.k_lens = <const int64_t *>_ptr(plan.k_lens)
    p.cu_q = <const int64_t *>_ptr(plan.cu_q)
    p.cu_k = <const int64_t *>_ptr(plan.cu_k)
    p.block_table = <const int32_t *>_ptr(plan.block_table)
    p.bt_sb = 0 if plan.block_table is None else _stride(<cnp.ndarray>plan.block_table, 0)
    p.page_size = plan.page_size
    p.bmask = <const uint8_t *>_ptr(bmask)
    p.bm_sb = p.bm_sh = p.bm_si = p.bm_sj = 0
    if bmask is not None:
        _strides3(bmask, &p.bm_sb, &p.bm_sh, &p.bm_si)
        p.bm_sj = _stride(bmask, 3)
    p.bm_q = plan.bm_q
    p.bm_k = plan.bm_k
    p.num_threads = plan.num_threads
    p.precision = plan.precision
    p.dropout_p = plan.dropout_p
    p.dropout_seed = plan.dropout_seed
    p.dropout_b0 = plan.dropout_b0
    return 0


cdef int _status(int rc, int num_threads, str what) except -1:
    """The Python error of an enum fa_status; what: "kernel" or "backward"."""
    if rc == FA_ENOMEM:
        raise MemoryError(f"fastattn: could not allocate {what} scratch memory")
    if rc == FA_ETHREADS:
        raise RuntimeError(
            f"fastattn: the operating system refused to start the threads of a team "
            f"(num_threads={num_threads}); pass a smaller num_threads")
    if rc != FA_OK:
        name = "backward kernel" if what == "backward" else what
        raise RuntimeError(f"fastattn: {name} failed with status {rc}")
    return 0


cdef inline bint _plain_f32_4d(object a):
    """A float32 ndarray (not a subclass), 4-D, native, aligned, last dim contiguous."""
    if type(a) is not cnp.ndarray:
        return False
    cdef cnp.ndarray x = <cnp.ndarray>a
    return (cnp.PyArray_NDIM(x) == 4 and cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32
            and cnp.PyArray_ISNOTSWAPPED(x) and cnp.PyArray_ISALIGNED(x) and cnp.PyArray_STRIDE(x, 3) == 4)


def small_call_dims(object q, object k, object v):
    """``(B, Hq, L, D, S, Dv)`` when q, k, v are what the small-call fast path of
    fastattn.functional takes without any conversion (float32 ndarrays, 4-D bhsd,
    native, aligned, last dim contiguous, equal heads, D and Dv >= 1: exactly
    what the general checks accept unchanged), else None.  A predicate, not a
    check: None sends the call down the general path, which names the errors.
    (The same tests in Python cost ~0.7 µs more.)"""
    if not (_plain_f32_4d(q) and _plain_f32_4d(k) and _plain_f32_4d(v)):
        return None
    cdef cnp.ndarray a = <cnp.ndarray>q, b = <cnp.ndarray>k, c = <cnp.ndarray>v
    cdef cnp.npy_intp B = cnp.PyArray_DIM(a, 0), Hq = cnp.PyArray_DIM(a, 1)
    cdef cnp.npy_intp D = cnp.PyArray_DIM(a, 3), S = cnp.PyArray_DIM(b, 2), Dv = cnp.PyArray_DIM(c, 3)
    if (cnp.PyArray_DIM(b, 0) != B or cnp.PyArray_DIM(c, 0) != B or cnp.PyArray_DIM(b, 1) != Hq
            or cnp.PyArray_DIM(c, 1) != Hq or cnp.PyArray_DIM(c, 2) != S or cnp.PyArray_DIM(b, 3) != D
            or D <= 0 or Dv <= 0):
        return None
    return B, Hq, cnp.PyArray_DIM(a, 2), D, S, Dv


def attention(object plan):
    """Run the fused kernel on a 4-D ``fastattn._plan.Plan`` (trusted: checked when built)."""
    cdef fa_params p
    cdef int rc
    _fill(&p, plan)
    with nogil:
        rc = fa_attention(&p)
    _status(rc, p.num_threads, "kernel")


def heads_together(bint on):
    """Paged single-row decode runs several kv heads' tasks together (on, the default)
    or one task per head; returns the old setting (a test hook, process-wide)."""
    return bool(fa_heads_together(on))


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


def positive_normal_f32(cnp.ndarray a):
    """Every value of the C-contiguous float32 array ``a`` finite and at least float32's
    least normal, i.e. its bits in [0x00800000, 0x7f7fffff] (NaN, infinities, zeros,
    denormals and negatives are outside): one pass where NumPy's min and max take two
    (8-bit K/V scales are checked on every call; a per-token scale array is 4 / D bytes
    per cache byte).  The caller checks the dtype and contiguity."""
    cdef const uint32_t *p = <const uint32_t *>cnp.PyArray_DATA(a)
    cdef Py_ssize_t n = a.size, i
    cdef uint32_t bad = 0
    with nogil:
        for i in range(n):
            bad |= <uint32_t>(<uint32_t>(p[i] - <uint32_t>0x00800000) >= <uint32_t>0x7f000000)
    return bad == 0


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
    return {"avx2": bool(fa_cpu_has(FA_ISA_AVX2)), "avx512f": bool(fa_cpu_has(FA_ISA_AVX512)),
            "f16c": bool(fa_cpu_has_f16c()), "avx512bf16": bool(fa_cpu_has_avx512bf16()),
            "amx_bf16": bool(fa_cpu_has_amx()), "amx_fp16": bool(fa_cpu_has_amx_fp16()),
            "neon": bool(fa_cpu_has(FA_ISA_NEON)), "sve_bits": int(fa_sve_bits())}


def amx_fp16_usable():
    """Whether float16 inputs take the AMX-FP16 tile kernel where the ISA is amx."""
    return bool(fa_amx_fp16_usable())


def cache_sizes():
    """Bytes of one core's L1 data, L2 and L3 caches (cpuid; 0 where unknown)."""
    cdef int64_t l1d = 0, l2 = 0, l3 = 0
    fa_cache_sizes(&l1d, &l2, &l3)
    return {"l1d": l1d, "l2": l2, "l3": l3}


def tiles_set_rows(int64_t rows):
    """Stacked query rows per task for later calls (0: derived from L2); False when out of range."""
    return fa_tiles_set_rows(rows) == 0


def tiles_get_rows():
    return fa_tiles_get_rows()


def tiles_rows(int64_t D, int64_t Dv, int64_t L, str dtype, bint causal=False, int64_t heads=1):
    """Rows per task that a call of this shape and dtype ("float32", "float64", "bfloat16") takes now
    (batch 1, ``heads`` query and key/value heads)."""
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    cdef int dt = {"float32": FA_F32, "float64": FA_F64, "bfloat16": FA_BF16}[dtype]
    return fa_tiles_rows(D, Dv, L, dt, causal, heads)


def openmp_enabled():
    return bool(fa_openmp_enabled())


def omp_max_threads():
    return fa_omp_max_threads()


def attention_backward(object plan, cnp.ndarray dout, cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv,
                       object dsinks):
    """Run the fused backward kernel (fastattn.backward checks every argument).

    plan: the forward's 4-D Plan in the compute dtype, its ``o`` the forward's
    output and ``lse`` its LSE (both read); dout, dq, dk, dv: (B, H, L, X) views
    in the compute dtype; dsinks: float64 (Hq,) when the plan has sinks."""
    cdef fa_bwd_params bp
    cdef int rc
    _fill(&bp.f, plan)
    bp.dout = _ptr(dout)
    _strides3(dout, &bp.do_sb, &bp.do_sh, &bp.do_sl)
    bp.dq = <void *>_ptr(dq)
    _strides3(dq, &bp.dq_sb, &bp.dq_sh, &bp.dq_sl)
    bp.dk = <void *>_ptr(dk)
    _strides3(dk, &bp.dk_sb, &bp.dk_sh, &bp.dk_sl)
    bp.dv = <void *>_ptr(dv)
    _strides3(dv, &bp.dv_sb, &bp.dv_sh, &bp.dv_sl)
    bp.dsinks = <double *>_ptr(dsinks)
    with nogil:
        rc = fa_attention_backward(&bp)
    _status(rc, bp.f.num_threads, "backward")
