"""fastattn.cuda: the optional CUDA forward kernel.

Built only with ``FASTATTN_CUDA=1 pip install .`` (module ``fastattn._cuda``);
importing this module never fails: without the extension :func:`is_built` is
False and the attention function raises ``RuntimeError``.

:func:`scaled_dot_product_attention` takes

- NumPy arrays: copied to the current device and back; the result is NumPy;
- objects exposing ``__cuda_array_interface__`` (CuPy arrays, torch CUDA
  tensors, Numba device arrays): read in place (any element strides, last
  dimension contiguous); the result is a CuPy array when CuPy is installed
  (a :class:`DeviceArray` otherwise, or for bfloat16 which CuPy lacks), or
  ``out`` when given.

The kernel runs on the current device, on the stream the query's
``__cuda_array_interface__`` names (CAI v3; the default stream for NumPy
inputs or when none is named), and returns without synchronising (as CUDA
libraries do); other operands' streams are synchronised before the launch.
"""

from __future__ import annotations

import math

import numpy as np

from . import _kernels
from ._checks import BFLOAT16, F16, F32, F64, as_array, scale_value
from .functional import _check_dtypes, _check_shapes, _lengths, _per_head, _softcap, _window

try:
    from . import _cuda

    _IMPORT_ERROR = None
except ImportError as _e:  # the CPU-only build (or a CUDA module that cannot load)
    _cuda = None
    _missing = isinstance(_e, ModuleNotFoundError) or "cannot import name '_cuda'" in str(_e)
    _IMPORT_ERROR = None if _missing else f"{type(_e).__name__}: {_e}"

__all__ = [
    "scaled_dot_product_attention",
    "is_built",
    "is_available",
    "build_info",
    "DeviceArray",
    "to_device",
    "synchronize",
]

MAX_HEAD_DIM = 256
# The mask element dtypes the GPU reads, with their enum fa_mask_kind (csrc/fastattn.h)
# values as the CPU extension defines them; dtype codes come from _kernels.DTYPE_CODES.
_MASK_CODES = {np.dtype(np.bool_): _kernels.MASK_BOOL, F32: _kernels.MASK_F32, F64: _kernels.MASK_F64}


def is_built() -> bool:
    """True when fastattn was built with its CUDA extension (``FASTATTN_CUDA=1``)."""
    return _cuda is not None


def is_available() -> bool:
    """True when the CUDA extension is built and a CUDA device is usable."""
    return _cuda is not None and _cuda.device_count() > 0


def _unavailable_reason():
    if _cuda is None:
        if _IMPORT_ERROR:
            return f"fastattn._cuda exists but cannot be imported ({_IMPORT_ERROR})"
        return "fastattn was built without its CUDA extension; rebuild with `FASTATTN_CUDA=1 pip install .`"
    err = _cuda.device_count_error()
    return f"no usable CUDA device ({err})" if err else "no CUDA device is visible"


def _require():
    if not is_available():
        raise RuntimeError(f"fastattn's CUDA backend is not available: {_unavailable_reason()}")


def build_info() -> dict:
    """What the CUDA extension was built with and what it sees now."""
    if _cuda is None:
        return {"built": False, "available": False, "reason": _unavailable_reason()}
    rt, drv = _cuda.versions()
    n = _cuda.device_count()
    info = {
        "built": True,
        "available": n > 0,
        "archs": _cuda.BUILD_ARCHS,
        "nvcc": _cuda.NVCC_VERSION,
        "runtime_version": rt,
        "driver_version": drv,
        "device_count": n,
        "devices": [_cuda.device_name(i)[0] for i in range(n)],
    }
    if n == 0:
        info["reason"] = _unavailable_reason()
    return info


# ---------------------------------------------------------------------------
# Device memory and strided views


class _Buffer:
    """cudaMalloc'ed bytes, freed with the object."""

    def __init__(self, nbytes):
        self.ptr = _cuda.malloc(nbytes) if nbytes > 0 else 0

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr and _cuda is not None:
            try:
                _cuda.free(ptr)
            except Exception:  # noqa: BLE001, S110 - nothing to do about a failing free at teardown
                pass


def _c_strides(shape):
    """C-contiguous strides in elements."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


class DeviceArray:
    """A C-contiguous device array owned by fastattn (returned when CuPy is not
    installed, or for bfloat16).  Wrap it with ``cupy.asarray`` or
    ``torch.as_tensor(x, device="cuda")`` through ``__cuda_array_interface__``,
    or copy it to NumPy with :meth:`get`."""

    def __init__(self, shape, dtype, stream=0):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._buf = _Buffer(self.nbytes)
        self._stream = stream  # where the kernel writing it runs (0: the default stream)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def __cuda_array_interface__(self):
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": [("", self.dtype.str)],
            "data": (self._buf.ptr, False),
            "strides": None,
            "version": 3,
            "stream": self._stream or 1,
        }

    def get(self) -> np.ndarray:
        """A NumPy copy (waits for the kernels that write it)."""
        a = np.empty(self.shape, dtype=self.dtype)
        if self._stream not in (0, 1):
            _cuda.stream_synchronize(self._stream)
        if self.nbytes:
            _cuda.memcpy_dtoh(a.ctypes.data, self._buf.ptr, self.nbytes)
        return a

    def __repr__(self):
        return f"fastattn.cuda.DeviceArray(shape={self.shape}, dtype={self.dtype})"


class _View:
    """(pointer, shape, element strides, dtype) of device memory; owner keeps it alive."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "owner", "stream")

    def __init__(self, ptr, shape, strides, dtype, owner, stream=None):
        self.ptr, self.shape, self.strides = int(ptr), tuple(shape), tuple(strides)
        self.dtype, self.owner, self.stream = dtype, owner, stream

    @property
    def ndim(self):
        return len(self.shape)

    def swap(self, a, b):
        sh, st = list(self.shape), list(self.strides)
        sh[a], sh[b] = sh[b], sh[a]
        st[a], st[b] = st[b], st[a]
        return _View(self.ptr, sh, st, self.dtype, self.owner, self.stream)

    def prepend(self):
        return _View(self.ptr, (1,) + self.shape, (0,) + self.strides, self.dtype, self.owner, self.stream)

    def item(self, i):
        """The view of self[i] (first axis)."""
        return _View(
            self.ptr + i * self.strides[0] * self.dtype.itemsize,
            self.shape[1:],
            self.strides[1:],
            self.dtype,
            self.owner,
            self.stream,
        )

    def rows(self, start, count):
        """self[start:start + count] (first axis)."""
        return _View(
            self.ptr + start * self.strides[0] * self.dtype.itemsize,
            (count,) + self.shape[1:],
            self.strides,
            self.dtype,
            self.owner,
            self.stream,
        )

    def extent(self):
        """[lo, hi) bytes touched; None when empty."""
        if any(n == 0 for n in self.shape):
            return None
        item = self.dtype.itemsize
        lo = hi = self.ptr
        for n, s in zip(self.shape, self.strides):
            d = (n - 1) * s * item
            lo, hi = (lo + d, hi) if d < 0 else (lo, hi + d)
        return lo, hi + item


def to_device(a) -> DeviceArray:
    """Copy a NumPy array (any dtype fastattn takes) to a new C-contiguous :class:`DeviceArray`."""
    _require()
    a = np.ascontiguousarray(as_array(a, "a"))
    d = DeviceArray(a.shape, a.dtype)
    if a.nbytes:
        _cuda.memcpy_htod(d._buf.ptr, a.ctypes.data, a.nbytes)
    return d


def synchronize() -> None:
    """Wait for all work on the current device (``cudaDeviceSynchronize``)."""
    _require()
    _cuda.synchronize()


def _is_device(x):
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception:  # noqa: BLE001 - a property that raises means "not a device array"
        return False


def _from_cai(obj, name, writable=False):
    """A _View of an object exposing ``__cuda_array_interface__``."""
    try:
        cai = obj.__cuda_array_interface__
        shape = tuple(int(n) for n in cai["shape"])
        ptr, readonly = cai["data"]
        typestr = cai["typestr"]
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"{name}: cannot read its __cuda_array_interface__: {e}") from None
    try:
        dtype = np.dtype(typestr)
    except TypeError:
        raise TypeError(f"{name} has a dtype NumPy does not know: {typestr!r}") from None
    if isinstance(obj, DeviceArray):
        dtype = obj.dtype  # keeps bfloat16, which typestr cannot name
    elif dtype.kind == "V" and dtype.itemsize == 2 and BFLOAT16 is not None:
        descr = cai.get("descr")
        if descr and "bfloat16" in str(descr):
            dtype = BFLOAT16
    if not dtype.isnative:
        raise TypeError(f"{name} must be in native byte order on the GPU, got {typestr!r}")
    if cai.get("mask") is not None:
        raise ValueError(f"{name}: masked device arrays are not supported")
    if writable and readonly:
        raise ValueError(f"{name} must be writable")
    item = dtype.itemsize
    strides = cai.get("strides")
    if strides is None:
        strides = _c_strides(shape)
    else:
        if len(strides) != len(shape) or any(int(s) % item for s in strides):
            raise ValueError(
                f"{name} must have strides that are multiples of its itemsize, got {tuple(strides)}"
            )
        strides = tuple(int(s) // item for s in strides)
    if ptr and int(ptr) % item:
        raise ValueError(f"{name} must be aligned to its itemsize ({item} bytes)")
    stream = cai.get("stream")  # the exporter's stream (CAI v3): 1 legacy, 2 per-thread default
    return _View(ptr or 0, shape, strides, dtype, obj, None if stream is None else int(stream))


def _upload(a):
    """A _View of a device copy of the NumPy array a (C-contiguous)."""
    a = np.ascontiguousarray(a)
    buf = _Buffer(a.nbytes)
    if a.nbytes:
        _cuda.memcpy_htod(buf.ptr, a.ctypes.data, a.nbytes)
    return _View(buf.ptr, a.shape, _c_strides(a.shape), a.dtype, buf)


def _to_host(x, name):
    """NumPy copy of a small argument that may live on the device."""
    if not _is_device(x):
        return x
    v = _from_cai(x, name)
    if v.stream is not None:
        _cuda.stream_synchronize(v.stream)
    if any(s < 0 for s in v.strides):
        raise ValueError(f"{name}: negative strides are not supported")
    if v.extent() is None:
        return np.empty(v.shape, dtype=v.dtype)
    lo, hi = v.extent()
    raw = np.empty(hi - lo, dtype=np.uint8)
    _cuda.memcpy_dtoh(raw.ctypes.data, lo, hi - lo)
    base = np.frombuffer(raw, dtype=v.dtype)
    item = v.dtype.itemsize
    return np.lib.stride_tricks.as_strided(base, v.shape, [s * item for s in v.strides]).copy()


def _device_empty(shape, dtype, stream):
    """(result object, _View) of fresh device memory: CuPy when available."""
    if dtype in (F16, F32):
        try:
            import cupy  # type: ignore[import-not-found]
        except ImportError:
            cupy = None
        if cupy is not None:
            a = cupy.empty(shape, dtype=dtype)
            return a, _from_cai(a, "result")
    a = DeviceArray(shape, dtype, stream)
    return a, _View(a._buf.ptr, a.shape, _c_strides(a.shape), a.dtype, a)


def _bcast(view, target, name):
    """view broadcast to target: element strides 0 along broadcast dims."""
    if view.ndim > len(target):
        raise ValueError(f"{name} of shape {view.shape} does not broadcast to {target}")
    pad = len(target) - view.ndim
    shape, strides = (1,) * pad + view.shape, (0,) * pad + view.strides
    out = []
    for n, s, t in zip(shape, strides, target):
        if n == t:
            out.append(s if t != 1 else 0)
        elif n == 1:
            out.append(0)
        else:
            raise ValueError(f"{name} of shape {view.shape} does not broadcast to {target}")
    return _View(view.ptr, target, out, view.dtype, view.owner, view.stream)


def _merged_stride(shape, strides):
    """The one stride that walks the leading dims (shape, strides) in C order
    as a single batch dim, or None when they do not merge."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not dims:
        return 0
    for (_, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            return None
    return dims[-1][1]


def _launch(q, k, v, o, lse, mask, alibi, klens, opts, stream):
    """One kernel launch over views with the same leading dims (recursing over
    the first leading dim when a view's leading dims do not merge)."""
    nl = q.ndim - 3
    lead = q.shape[:nl]
    B = math.prod(lead)
    if B == 0:
        return
    views = [x for x in (q, k, v, o, lse, mask) if x is not None]
    sb = [_merged_stride(x.shape[:nl], x.strides[:nl]) for x in views]
    if any(s is None for s in sb):
        n = lead[0]
        per = B // n
        for i in range(n):
            _launch(
                q.item(i),
                k.item(i),
                v.item(i),
                o.item(i),
                None if lse is None else lse.item(i),
                None if mask is None else mask.item(i),
                None if alibi is None else alibi.rows(i * per, per),
                None if klens is None else klens.rows(i * per, per),
                opts,
                stream,
            )
        return
    qs, ks, vs, os_ = (x.strides[nl:] for x in (q, k, v, o))
    Hq, L, D = q.shape[nl:]
    Hk, S, Dv = v.shape[nl:]
    p = dict(opts)
    p.update(
        B=B,
        Hq=Hq,
        Hk=Hk,
        L=L,
        S=S,
        D=D,
        Dv=Dv,
        q=q.ptr,
        q_sb=_merged_stride(lead, q.strides[:nl]),
        q_sh=qs[0],
        q_sl=qs[1],
        k=k.ptr,
        k_sb=_merged_stride(lead, k.strides[:nl]),
        k_sh=ks[0],
        k_sl=ks[1],
        v=v.ptr,
        v_sb=_merged_stride(lead, v.strides[:nl]),
        v_sh=vs[0],
        v_sl=vs[1],
        o=o.ptr,
        o_sb=_merged_stride(lead, o.strides[:nl]),
        o_sh=os_[0],
        o_sl=os_[1],
    )
    if lse is None:
        p.update(lse=None, lse_sb=0, lse_sh=0, lse_sl=0)
    else:
        p.update(
            lse=lse.ptr,
            lse_sb=_merged_stride(lead, lse.strides[:nl]),
            lse_sh=lse.strides[nl],
            lse_sl=lse.strides[nl + 1],
        )
    if mask is None:
        p.update(mask=None, m_sb=0, m_sh=0, m_sl=0, m_ss=0)
    else:
        ms = mask.strides[nl:]
        p.update(
            mask=mask.ptr, m_sb=_merged_stride(lead, mask.strides[:nl]), m_sh=ms[0], m_sl=ms[1], m_ss=ms[2]
        )
    if alibi is None:
        p.update(alibi=None, alibi_sb=0, alibi_sh=0)
    else:
        p.update(alibi=alibi.ptr, alibi_sb=alibi.strides[0], alibi_sh=alibi.strides[1])
    p["k_lens"] = None if klens is None else klens.ptr
    _cuda.attention(p, stream)


def _operand(x, name):
    """_View (device object) or NumPy array (host)."""
    return _from_cai(x, name) if _is_device(x) else as_array(x, name)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    layout="bhsd",
    return_lse=False,
    out=None,
    window=None,
    alibi_slopes=None,
    softcap=None,
    key_lengths=None,
):
    """The CUDA kernel of :func:`fastattn.scaled_dot_product_attention`.

    Same arguments and semantics as the CPU function (bool masks True = may
    attend, float masks added, bottom-right causal, ``window=(left, right)``,
    ALiBi, softcap, ``key_lengths``, GQA without copies, LSE in float32,
    fully masked rows give zeros and LSE -inf), for float32, float16 and
    bfloat16 inputs (fp32 accumulation; key/value share query's dtype or
    query is float32) and head dims up to 256.

    NumPy inputs are copied to the device and the result comes back as NumPy.
    When query, key or value exposes ``__cuda_array_interface__`` every array
    operand must, and the result stays on the device (CuPy array, or
    :class:`DeviceArray`; or ``out``, a writable device array).  Small
    arguments (``alibi_slopes``, ``key_lengths``) may live on either side.

    Raises RuntimeError when the CUDA backend is not available.
    """
    _require()
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    names = ("query", "key", "value")
    device = [_is_device(x) for x in (query, key, value)]
    if any(device) and not all(device):
        raise TypeError(
            "query, key and value must all be device arrays (__cuda_array_interface__) or all "
            "host arrays, got "
            + ", ".join(f"{n}: {'device' if d else 'host'}" for n, d in zip(names, device))
        )
    dev = all(device)
    q, k, v = (_operand(x, n) for x, n in zip((query, key, value), names))
    _check_dtypes(q, k, v)
    if q.dtype == F64:
        raise TypeError(
            "float64 is not supported by the CUDA kernel; use float32, float16 or bfloat16 "
            "(or the CPU function)"
        )
    if k.dtype != q.dtype and q.dtype != F32:
        raise TypeError(
            f"on the GPU key/value must have query's dtype, or query must be float32; got query "
            f"{q.dtype}, key/value {k.dtype}"
        )
    lead, (Hq, L, D), (Hk, S, Dv) = _check_shapes(q, k, v, layout, enable_gqa)
    if D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM} on the GPU, got query/key {D}, value {Dv}")
    sc = scale_value(scale, D, F64 if q.dtype == F64 else F32)
    wl, wr = _window(window)
    cap = _softcap(softcap)
    B = math.prod(lead)
    alibi = None
    if alibi_slopes is not None:
        alibi = _per_head(_to_host(alibi_slopes, "alibi_slopes"), "alibi_slopes", lead, Hq, True)
    klens = None
    if key_lengths is not None:
        klens = _lengths(_to_host(key_lengths, "key_lengths"), "key_lengths", lead, S)

    mask = m_host = None
    if attn_mask is not None:
        target = lead + (Hq, L, S)
        if dev and _is_device(attn_mask):
            mv = _from_cai(attn_mask, "attn_mask")
            if mv.dtype not in _MASK_CODES:
                raise TypeError(
                    f"attn_mask on the GPU must be bool, float32 or float64, got dtype {mv.dtype}"
                )
            mask = _bcast(mv, target, "attn_mask")
        else:
            m_host = as_array(_to_host(attn_mask, "attn_mask"), "attn_mask")
            if m_host.dtype == np.bool_:
                pass
            elif m_host.dtype.kind == "f" or m_host.dtype.name == "bfloat16":
                if m_host.dtype not in (F32, F64):
                    m_host = m_host.astype(F32)
            else:
                raise TypeError(f"attn_mask must be bool or floating, got dtype {m_host.dtype}")
            # Shape check now; the upload waits until every argument is checked.
            _bcast(_View(0, m_host.shape, _c_strides(m_host.shape), m_host.dtype, None), target, "attn_mask")

    out_shape = tuple(q.shape[:-1]) + (Dv,)
    lse_shape = (L,) if (q.ndim == 2 and layout == "bhsd") else lead + (Hq, L)
    if out is not None:
        if dev:
            if not _is_device(out):
                raise TypeError(
                    f"out must be a device array (__cuda_array_interface__) for device inputs, got "
                    f"{type(out).__name__}"
                )
            ov = _from_cai(out, "out", writable=True)
        else:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"out must be a numpy.ndarray for NumPy inputs, got {type(out).__name__}")
            if not out.flags.writeable:
                raise ValueError("out must be writable")
            ov = out
        if tuple(ov.shape) != out_shape:
            raise ValueError(f"out must have shape {out_shape}, got {tuple(ov.shape)}")
        if ov.dtype != q.dtype:
            raise TypeError(f"out must have dtype {q.dtype}, got {ov.dtype}")
        if dev:
            if Dv > 1 and ov.strides[-1] != 1:
                raise ValueError("out must be contiguous in its last dimension on the GPU")
            eo = ov.extent()
            for x, n in ((q, "query"), (k, "key"), (v, "value"), (mask, "attn_mask")):
                ex = None if x is None else x.extent()
                if eo is not None and ex is not None and eo[0] < ex[1] and ex[0] < eo[1]:
                    raise ValueError(f"out must not share memory with {n}")
    if m_host is not None:
        mask = _bcast(_upload(m_host), lead + (Hq, L, S), "attn_mask")
    if dev:
        for x, n in ((q, "query"), (k, "key"), (v, "value")):
            if x.shape[-1] > 1 and x.strides[-1] != 1:
                raise ValueError(
                    f"{n} must be contiguous in its last dimension on the GPU, got element strides "
                    f"{x.strides}"
                )
    else:
        q, k, v = _upload(q), _upload(k), _upload(v)

    # Launch on the query's stream (CAI v3) and wait for the other operands' streams.
    stream = q.stream if dev and q.stream is not None else 0
    if dev:
        for x in (k, v, mask, ov if out is not None else None):
            if x is not None and x.stream is not None and x.stream != stream:
                _cuda.stream_synchronize(x.stream)
    if dev and out is not None:
        res, o = out, ov
    elif dev:
        res, o = _device_empty(out_shape, q.dtype, stream)
    else:
        res = DeviceArray(out_shape, q.dtype)
        o = _View(res._buf.ptr, out_shape, _c_strides(out_shape), res.dtype, res)
    lse_res = lse = None
    if return_lse:
        lse_res, lse = _device_empty(lse_shape, F32, stream) if dev else (None, None)
        if not dev:
            lse_res = DeviceArray(lse_shape, F32)
            lse = _View(lse_res._buf.ptr, lse_shape, _c_strides(lse_shape), F32, lse_res)
        if q.ndim == 2 and layout == "bhsd":
            lse = lse.prepend()

    def bhsd(x):
        if layout == "bshd":
            return x.swap(-2, -3)
        return x.prepend() if x.ndim == 2 else x

    qh, kh, vh, oh = bhsd(q), bhsd(k), bhsd(v), bhsd(o)
    if lead == ():
        qh, kh, vh, oh = qh.prepend(), kh.prepend(), vh.prepend(), oh.prepend()
        mask = None if mask is None else mask.prepend()
        lse = None if lse is None else lse.prepend()
    alibi_v = None if alibi is None else _upload(alibi)
    klens_v = None if klens is None else _upload(klens)
    opts = dict(
        q_dtype=_kernels.DTYPE_CODES[q.dtype],
        k_dtype=_kernels.DTYPE_CODES[k.dtype],
        v_dtype=_kernels.DTYPE_CODES[v.dtype],
        o_dtype=_kernels.DTYPE_CODES[q.dtype],
        mask_kind=_kernels.MASK_NONE if mask is None else _MASK_CODES[mask.dtype],
        scale=sc,
        causal=int(bool(is_causal)),
        window_left=wl,
        window_right=wr,
        softcap=cap,
    )
    if B > 0 and Hq > 0 and L > 0:
        _launch(qh, kh, vh, oh, lse, mask, alibi_v, klens_v, opts, stream)
    # Keep the uploaded temporaries alive until the kernel is done with them.
    if not dev:
        o_host = res.get()
        lse_host = lse_res.get() if return_lse else None
        if out is not None:
            out[...] = o_host
            o_host = out
        return (o_host, lse_host) if return_lse else o_host
    if alibi_v is not None or klens_v is not None or (mask is not None and isinstance(mask.owner, _Buffer)):
        _cuda.stream_synchronize(stream)  # fastattn-owned temporaries are freed on return
    return (res, lse_res) if return_lse else res
