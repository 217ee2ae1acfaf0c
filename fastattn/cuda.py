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

The arguments are checked by fastattn._args, as for the CPU; the call becomes
a ``_plan.Plan`` of device views (:class:`_View`), split into kernel calls by
``_plan.kernel_plans`` (the leading-dimension merge shared with the CPU), and
each call is handed to ``fastattn._cuda`` as a record of ``fa_params`` fields
(csrc/fastattn.h; csrc/cuda/module.c reads it by field name).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt

from . import _args, _kernels, _plan
from ._checks import F16, F32, F64, as_array, bfloat16_dtype, flag_value, scale_value
from ._device_view import View as _View
from ._device_view import bcast as _bcast
from ._device_view import c_strides as _c_strides
from ._device_view import distinct as _distinct
from ._device_view import record as _record
from ._plan import Plan

Array = npt.NDArray[Any]


class _CudaModule(Protocol):
    """What fastattn._cuda (csrc/cuda/module.c) provides."""

    BUILD_ARCHS: str
    NVCC_VERSION: str
    MAX_HEAD_DIM: int
    PARAMS: tuple[tuple[str, str, str], ...]

    def device_count(self) -> int: ...
    def device_count_error(self) -> str | None: ...
    def device_name(self, dev: int = 0) -> tuple[str, int, int]: ...
    def versions(self) -> tuple[int, int]: ...
    def malloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def memcpy_htod(self, dst: int, src: int, nbytes: int) -> None: ...
    def memcpy_dtoh(self, dst: int, src: int, nbytes: int) -> None: ...
    def synchronize(self) -> None: ...
    def stream_synchronize(self, stream: int) -> None: ...
    def attention(self, record: dict[str, Any], stream: int = 0) -> None: ...


_cuda: _CudaModule | None
_IMPORT_ERROR: str | None
try:
    _cuda = cast(_CudaModule, importlib.import_module("._cuda", __package__))
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


def is_built() -> bool:
    """True when fastattn was built with its CUDA extension (``FASTATTN_CUDA=1``).

    Returns
    -------
    bool
        Whether ``fastattn._cuda`` is there.

    Examples
    --------
    >>> import fastattn.cuda
    >>> isinstance(fastattn.cuda.is_built(), bool)
    True
    """
    return _cuda is not None


def is_available() -> bool:
    """True when the CUDA extension is built and a CUDA device is usable.

    Returns
    -------
    bool
        Whether the CUDA functions can run.

    Examples
    --------
    >>> import fastattn.cuda
    >>> fastattn.cuda.is_available() <= fastattn.cuda.is_built()
    True
    """
    return _cuda is not None and _cuda.device_count() > 0


def _unavailable_reason() -> str:
    if _cuda is None:
        if _IMPORT_ERROR:
            return f"fastattn._cuda exists but cannot be imported ({_IMPORT_ERROR})"
        return "fastattn was built without its CUDA extension; rebuild with `FASTATTN_CUDA=1 pip install .`"
    err = _cuda.device_count_error()
    return f"no usable CUDA device ({err})" if err else "no CUDA device is visible"


def _require() -> _CudaModule:
    """The extension, when a device is usable (else RuntimeError saying why not):
    the check of the public entry points."""
    if _cuda is None or _cuda.device_count() == 0:
        raise RuntimeError(f"fastattn's CUDA backend is not available: {_unavailable_reason()}")
    return _cuda


def _ext() -> _CudaModule:
    """The extension, for helpers that run after _require() succeeded."""
    if _cuda is None:
        raise RuntimeError(f"fastattn's CUDA backend is not available: {_unavailable_reason()}")
    return _cuda


def build_info() -> dict[str, Any]:
    """What the CUDA extension was built with and what it sees now.

    Returns
    -------
    dict
        ``built`` and ``available`` (bools), ``reason`` when not available; with
        the extension also ``archs``, ``nvcc``, ``runtime_version``,
        ``driver_version``, ``device_count`` and ``devices`` (names).

    Examples
    --------
    >>> import fastattn.cuda
    >>> info = fastattn.cuda.build_info()
    >>> info["available"] == fastattn.cuda.is_available()
    True
    """
    if _cuda is None:
        return {"built": False, "available": False, "reason": _unavailable_reason()}
    rt, drv = _cuda.versions()
    n = _cuda.device_count()
    info: dict[str, Any] = {
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

    def __init__(self, nbytes: int) -> None:
        self.ptr = _ext().malloc(nbytes) if nbytes > 0 else 0

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr and _cuda is not None:
            try:
                _cuda.free(ptr)
            except Exception:  # noqa: BLE001, S110 - nothing to do about a failing free at teardown
                pass


class DeviceArray:
    """A C-contiguous device array owned by fastattn (returned when CuPy is not
    installed, or for bfloat16).  Wrap it with ``cupy.asarray`` or
    ``torch.as_tensor(x, device="cuda")`` through ``__cuda_array_interface__``,
    or copy it to NumPy with :meth:`get`.

    Parameters
    ----------
    shape : tuple of int
        The array's shape.
    dtype : dtype
        Its element type.
    stream : int, default 0
        The CUDA stream whose kernels write it (0: the default stream).

    Examples
    --------
    Needs a CUDA device (and fastattn built with ``FASTATTN_CUDA=1``).

    >>> import fastattn.cuda
    >>> d = fastattn.cuda.to_device(np.arange(6, dtype=np.float32).reshape(2, 3))  # doctest: +SKIP
    >>> d  # doctest: +SKIP
    fastattn.cuda.DeviceArray(shape=(2, 3), dtype=float32)
    >>> d.get()  # doctest: +SKIP
    array([[0., 1., 2.],
           [3., 4., 5.]], dtype=float32)
    """

    def __init__(self, shape: tuple[int, ...], dtype: npt.DTypeLike, stream: int = 0) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.dtype: np.dtype[Any] = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._buf = _Buffer(self.nbytes)
        self._stream = stream  # where the kernel writing it runs (0: the default stream)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": [("", self.dtype.str)],
            "data": (self._buf.ptr, False),
            "strides": None,
            "version": 3,
            "stream": self._stream or 1,
        }

    def view(self) -> _View:
        """The whole array as a _View."""
        return _View(self._buf.ptr, self.shape, _c_strides(self.shape), self.dtype, self)

    def get(self) -> Array:
        """A NumPy copy (waits for the kernels that write it).

        Returns
        -------
        ndarray
            The array's contents, on the host.

        Examples
        --------
        Needs a CUDA device.

        >>> import fastattn.cuda
        >>> fastattn.cuda.to_device(np.ones(3, np.float32)).get()  # doctest: +SKIP
        array([1., 1., 1.], dtype=float32)
        """
        cu = _ext()
        a = np.empty(self.shape, dtype=self.dtype)
        if self._stream not in (0, 1):
            cu.stream_synchronize(self._stream)
        if self.nbytes:
            cu.memcpy_dtoh(a.ctypes.data, self._buf.ptr, self.nbytes)
        return a

    def __repr__(self) -> str:
        return f"fastattn.cuda.DeviceArray(shape={self.shape}, dtype={self.dtype})"


def to_device(a: npt.ArrayLike) -> DeviceArray:
    """Copy a NumPy array (any dtype fastattn takes) to a new C-contiguous :class:`DeviceArray`.

    Parameters
    ----------
    a : array_like
        The host array.

    Returns
    -------
    DeviceArray
        A device copy of ``a``.

    Examples
    --------
    Needs a CUDA device.

    >>> import fastattn.cuda
    >>> d = fastattn.cuda.to_device(np.zeros((2, 4), np.float16))  # doctest: +SKIP
    >>> d.shape, d.dtype  # doctest: +SKIP
    ((2, 4), dtype('float16'))
    """
    cu = _require()
    h = np.ascontiguousarray(as_array(a, "a"))
    d = DeviceArray(h.shape, h.dtype)
    if h.nbytes:
        cu.memcpy_htod(d._buf.ptr, h.ctypes.data, h.nbytes)
    return d


def synchronize() -> None:
    """Wait for all work on the current device (``cudaDeviceSynchronize``).

    Returns
    -------
    None
        When the device is idle.

    Examples
    --------
    Needs a CUDA device.

    >>> import fastattn.cuda
    >>> fastattn.cuda.synchronize()  # doctest: +SKIP
    """
    _require().synchronize()


def _is_device(x: object) -> bool:
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception:  # noqa: BLE001 - a property that raises means "not a device array"
        return False


def _from_cai(obj: Any, name: str, writable: bool = False) -> _View:
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
    elif dtype.kind == "V" and dtype.itemsize == 2:
        descr = cai.get("descr")
        if descr and "bfloat16" in str(descr):
            dtype = bfloat16_dtype()
    if not dtype.isnative:
        raise TypeError(f"{name} must be in native byte order on the GPU, got {typestr!r}")
    if cai.get("mask") is not None:
        raise ValueError(f"{name}: masked device arrays are not supported")
    if writable and readonly:
        raise ValueError(f"{name} must be writable")
    item = dtype.itemsize
    cai_strides = cai.get("strides")
    if cai_strides is None:
        strides = _c_strides(shape)
    else:
        if len(cai_strides) != len(shape) or any(int(s) % item for s in cai_strides):
            raise ValueError(
                f"{name} must have strides that are multiples of its itemsize, got {tuple(cai_strides)}"
            )
        strides = tuple(int(s) // item for s in cai_strides)
    if ptr and int(ptr) % item:
        raise ValueError(f"{name} must be aligned to its itemsize ({item} bytes)")
    stream = cai.get("stream")  # the exporter's stream (CAI v3): 1 legacy, 2 per-thread default
    return _View(ptr or 0, shape, strides, dtype, obj, None if stream is None else int(stream))


def _upload(a: Array) -> _View:
    """A _View of a device copy of the NumPy array a (C-contiguous)."""
    cu = _ext()
    h = np.ascontiguousarray(a)
    buf = _Buffer(h.nbytes)
    if h.nbytes:
        cu.memcpy_htod(buf.ptr, h.ctypes.data, h.nbytes)
    return _View(buf.ptr, h.shape, _c_strides(h.shape), h.dtype, buf)


def _to_host(x: Any, name: str) -> Any:
    """NumPy copy of a small argument that may live on the device (anything else as is)."""
    if not _is_device(x):
        return x
    cu = _ext()
    v = _from_cai(x, name)
    if v.stream is not None:
        cu.stream_synchronize(v.stream)
    if any(s < 0 for s in v.strides):
        raise ValueError(f"{name}: negative strides are not supported")
    ext = v.extent()
    if ext is None:
        return np.empty(v.shape, dtype=v.dtype)
    lo, hi = ext
    raw = np.empty(hi - lo, dtype=np.uint8)
    cu.memcpy_dtoh(raw.ctypes.data, lo, hi - lo)
    base = np.frombuffer(raw, dtype=v.dtype)
    item = v.dtype.itemsize
    return np.lib.stride_tricks.as_strided(base, v.shape, [s * item for s in v.strides]).copy()


def _device_empty(shape: tuple[int, ...], dtype: np.dtype[Any], stream: int) -> tuple[Any, _View]:
    """(result object, _View) of fresh device memory: CuPy when available."""
    if dtype in (F16, F32):
        try:
            import cupy  # type: ignore[import-not-found, unused-ignore]
        except ImportError:
            cupy = None
        if cupy is not None:
            a = cupy.empty(shape, dtype=dtype)
            return a, _from_cai(a, "result")
    d = DeviceArray(shape, dtype, stream)
    return d, d.view()


# ---------------------------------------------------------------------------
# The call (its Plan -> fa_params record: fastattn._device_view)


def _operand(x: Any, name: str) -> Any:
    """_View (device object) or NumPy array (host)."""
    return _from_cai(x, name) if _is_device(x) else as_array(x, name)


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: str = "bhsd",
    return_lse: bool = False,
    out: Any = None,
    window: tuple[int, int] | None = None,
    alibi_slopes: Any = None,
    softcap: float | None = None,
    key_lengths: Any = None,
) -> Any:
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

    Parameters
    ----------
    query, key, value : array_like or device array
        As for :func:`fastattn.scaled_dot_product_attention`; NumPy arrays or
        objects with ``__cuda_array_interface__``.
    attn_mask, is_causal, scale, enable_gqa, layout : optional
        As for :func:`fastattn.scaled_dot_product_attention`.
    window, alibi_slopes, softcap, key_lengths : optional
        As for :func:`fastattn.scaled_dot_product_attention`.
    return_lse : bool, default False
        Also return the float32 log-sum-exp of each row.
    out : device array, optional
        A writable device array to write the output into (device inputs only).

    Returns
    -------
    out : ndarray, cupy.ndarray or DeviceArray
        The attention output, on the side the inputs came from.
    lse : ndarray, cupy.ndarray or DeviceArray
        float32; only with ``return_lse=True``.

    Examples
    --------
    Needs a CUDA device (and fastattn built with ``FASTATTN_CUDA=1``).

    >>> import fastattn.cuda
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 16, 64)).astype(np.float32)
    >>> out = fastattn.cuda.scaled_dot_product_attention(q, k, v, is_causal=True)  # doctest: +SKIP
    >>> ref = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> bool(np.allclose(out, ref, atol=1e-3))  # doctest: +SKIP
    True
    """
    cu = _require()
    layout = _args.layout_value(layout)
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
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
    _args.check_dtypes(q, k, v)
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
    lead, (Hq, L, D), (Hk, S, Dv) = _args.check_shapes(q, k, v, layout, enable_gqa)
    if D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM} on the GPU, got query/key {D}, value {Dv}")
    sc = scale_value(scale, D, F32)
    wl, wr = _args.window_value(window)
    cap = _args.softcap_value(softcap)
    lead1 = lead or (1,)  # the plan's leading dims: at least one
    alibi = klens = None
    if alibi_slopes is not None:
        slopes = _to_host(alibi_slopes, "alibi_slopes")
        alibi = _args.per_head(slopes, "alibi_slopes", lead, Hq, True).reshape(lead1 + (Hq,))
    if key_lengths is not None:
        klens = _args.lengths(_to_host(key_lengths, "key_lengths"), "key_lengths", lead, S).reshape(lead1)

    mask: _View | None = None
    m_host: Array | None = None
    target = lead + (Hq, L, S)
    if attn_mask is not None:
        if dev and _is_device(attn_mask):
            mv = _from_cai(attn_mask, "attn_mask")
            if mv.dtype not in _plan.MASK_KINDS:
                raise TypeError(
                    f"attn_mask on the GPU must be bool, float32 or float64, got dtype {mv.dtype}"
                )
            mask = _bcast(mv, target, "attn_mask")
        else:
            # Checked and converted as on the CPU; uploaded (its distinct elements only)
            # once every argument is checked.
            mb = _args.mask_value(_to_host(attn_mask, "attn_mask"), target, F32)[0]
            m_host = None if mb is None else _distinct(mb)

    out_shape = tuple(q.shape[:-1]) + (Dv,)
    lse_shape = (L,) if (q.ndim == 2 and layout == "bhsd") else lead + (Hq, L)
    ov: Any = None
    if out is not None:
        if dev:
            if not _is_device(out):
                raise TypeError(
                    f"out must be a device array (__cuda_array_interface__) for device inputs, got "
                    f"{type(out).__name__}"
                )
            ov = _from_cai(out, "out", writable=True)
            if tuple(ov.shape) != out_shape:
                raise ValueError(f"out must have shape {out_shape}, got {tuple(ov.shape)}")
            if ov.dtype != q.dtype:
                raise TypeError(f"out must have dtype {q.dtype}, got {ov.dtype}")
            if Dv > 1 and ov.strides[-1] != 1:
                raise ValueError("out must be contiguous in its last dimension on the GPU")
            eo = ov.extent()
            for x, n in ((q, "query"), (k, "key"), (v, "value"), (mask, "attn_mask")):
                ex = None if x is None else x.extent()
                if eo is not None and ex is not None and eo[0] < ex[1] and ex[0] < eo[1]:
                    raise ValueError(f"out must not share memory with {n}")
        else:
            # The device result is copied into out: out may be any writable array of the
            # right shape and dtype (also one sharing memory with an input).
            ov = _args.check_out(out, out_shape, q.dtype, ())
    if dev:
        for x, n in ((q, "query"), (k, "key"), (v, "value")):
            if x.shape[-1] > 1 and x.strides[-1] != 1:
                raise ValueError(
                    f"{n} must be contiguous in its last dimension on the GPU, got element strides "
                    f"{x.strides}"
                )
    else:
        q, k, v = _upload(q), _upload(k), _upload(v)
    if m_host is not None:
        mask = _bcast(_upload(m_host), target, "attn_mask")

    # Launch on the query's stream (CAI v3) and wait for the other operands' streams.
    stream = q.stream if dev and q.stream is not None else 0
    if dev:
        for x in (k, v, mask, ov):
            if x is not None and x.stream is not None and x.stream != stream:
                cu.stream_synchronize(x.stream)
    res: Any
    if dev and out is not None:
        res, o = out, ov
    elif dev:
        res, o = _device_empty(out_shape, q.dtype, stream)
    else:
        res = DeviceArray(out_shape, q.dtype)
        o = res.view()
    lse_res: Any = None
    lse: _View | None = None
    if want_lse:
        if dev:
            lse_res, lse = _device_empty(lse_shape, F32, stream)
        else:
            lse_res = DeviceArray(lse_shape, F32)
            lse = lse_res.view()

    def bhsd(x: _View) -> _View:
        """The plan's (*lead1, H, L, X) view of an operand."""
        x = x.swap(-2, -3) if layout == "bshd" else x
        if x.ndim == 2:  # one head
            x = x.prepend()
        return x if lead else x.prepend()

    alibi_v = None if alibi is None else _upload(alibi)
    klens_v = None if klens is None else _upload(klens)
    if lse is not None and not lead:
        lse = lse.restrided((1, 1, L), (0, 0, 1)) if lse.ndim == 1 else lse.prepend()
    plan = Plan(
        q=bhsd(q),
        k=bhsd(k),
        v=bhsd(v),
        o=bhsd(o),
        lse=lse,
        mask=None if mask is None else (mask if lead else mask.prepend()),
        mask_kind=_kernels.FA_MASK_NONE if mask is None else _plan.MASK_KINDS[mask.dtype],
        scale=sc,
        causal=causal,
        window_left=wl,
        window_right=wr,
        softcap=cap,
        alibi=alibi_v,
        k_lens=klens_v,
        L=L,
        S=S,
        num_threads=1,  # a CPU setting: the GPU binding does not read it
        precision=_kernels.FA_PRECISION_HIGHEST,  # the kernels compute float32 scores with fp32 FMA
    )
    if math.prod(lead) > 0 and Hq > 0 and L > 0:
        for p in _plan.kernel_plans(plan):
            cu.attention(_record(p), stream)
    # Keep the uploaded temporaries alive until the kernel is done with them.
    if not dev:
        o_host = res.get()
        lse_host = lse_res.get() if want_lse else None
        if out is not None:
            out[...] = o_host
            o_host = out
        return (o_host, lse_host) if want_lse else o_host
    if alibi_v is not None or klens_v is not None or (mask is not None and isinstance(mask.owner, _Buffer)):
        cu.stream_synchronize(stream)  # fastattn-owned temporaries are freed on return
    return (res, lse_res) if want_lse else res
