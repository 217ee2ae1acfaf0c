"""8-bit K/V: the storage dtypes (int8, fp8 e4m3fn and e5m2), their scales, and
quantisation for the caches' writes.

Dequantised K is ``key.astype(float32) * k_scale`` (V alike).  A scale is float32,
finite and positive (a float32 normal: the kernels run with denormals as zero), and
broadcasts against the key in the call's layout; it may vary along the sequence
axis (per token) or the head-dim axis (per channel), not both (a full ``(S, D)``
scale would cost a scale read per element: every engine this follows keeps one or
the other).  The kernels apply a per-channel K scale to the query once, a per-token
K scale to the scores, a per-token V scale to the probabilities and a per-channel V
scale to the output row (csrc/kernel_impl.h): the cache is never converted whole.

The fp8 dtypes come from ``ml_dtypes`` (recognised by name first, as bfloat16 is in
fastattn._checks, so that ``import fastattn`` does not import it).
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._checks import F32, as_array, broadcast_view, distinct_elements

Array: TypeAlias = npt.NDArray[Any]

__all__ = [
    "F32_TINY",
    "KV8_NAMES",
    "QMAX",
    "is_kv8",
    "kv8_dtype",
    "positive_normal",
    "quantize",
    "quantize_kv",
    "scale_value",
]

I8 = np.dtype(np.int8)
KV8_NAMES = ("int8", "float8_e4m3fn", "float8_e5m2")

# The largest finite magnitude of each 8-bit format: a per-token scale is
# max|x| / QMAX (int8 127: symmetric, -128 unused, as llama.cpp's q8_0, SGLang and
# OpenVINO's symmetric mode).
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}

F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)

# fp8's default scale, 1: the source of its read-only broadcast views (read-only itself, shared)
_ONE = np.ones((), F32)
_ONE.flags.writeable = False


def is_kv8(dt: np.dtype[Any]) -> bool:
    """True for int8 and ml_dtypes' float8_e4m3fn / float8_e5m2 (fp8 checked by name
    first: no ml_dtypes import for other dtypes; the scalar type's name, an attribute,
    where ``dtype.name`` is computed on each access, see ``_checks.is_bfloat16``)."""
    if dt == I8:
        return True
    name = dt.type.__name__
    if name in ("float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return bool(dt == np.dtype(getattr(ml_dtypes, name)))
    return False


def kv8_dtype(dtype: Any, name: str = "dtype") -> np.dtype[Any]:
    """``dtype`` (a dtype, type or one of KV8_NAMES) as an 8-bit K/V dtype; TypeError else."""
    if isinstance(dtype, str) and dtype in ("float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        fp8: np.dtype[Any] = np.dtype(getattr(ml_dtypes, dtype))
        return fp8
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be int8, float8_e4m3fn or float8_e5m2, got {dtype!r}") from None
    if not is_kv8(dt):
        raise TypeError(f"{name} must be int8, float8_e4m3fn or float8_e5m2, got {dt}")
    return dt


def positive_normal(s: Array) -> bool:
    """Every value of float32 ``s`` finite and at least float32's least normal: one pass
    over a contiguous array's bits in C (``_kernels.positive_normal_f32``), else two
    NumPy reductions and no temporary (a NaN fails the min's comparison).  Per call this
    reads the scales once, as the kernel does (a per-token scale is 4 / D bytes per
    8-bit cache byte).  A broadcast view (zero strides) is reduced over its distinct
    values only: a scale broadcast over the tokens costs nothing to check."""
    if not s.flags.c_contiguous and 0 in s.strides:  # (C-contiguous: zero strides only on size-1 dims)
        s = distinct_elements(s)
    if s.dtype == F32 and s.flags.c_contiguous:
        return bool(_kernels.positive_normal_f32(s))  # one pass over the bits
    return bool(s.min() >= F32_TINY and s.max() <= _F32_MAX)


def scale_value(
    scale: Any, name: str, arr: Any, seq_axis: int, kv_name: str, values: bool = True
) -> Array | None:
    """The scale of 8-bit ``arr`` (``kv_name``'s array) as a float32 read-only view of
    ``arr.shape``, checked; ``seq_axis`` is arr's sequence axis (negative), its last
    the head dim.  None for a float ``arr`` without a scale.  fp8 without a scale: 1.

    Raises TypeError for int8 without a scale, a scale with a float ``arr`` or a
    non-real scale; ValueError for a shape that does not broadcast, a scale that
    varies along both the sequence and head-dim axes, or a value that is not a
    positive float32 normal (``values=False``: the values are the caller's to check, as a
    paged scale's are where the call reads them)."""
    kv8 = is_kv8(arr.dtype)
    if scale is None:
        if not kv8:
            return None
        if arr.dtype == I8:
            raise TypeError(
                f"{name} is required for an int8 {kv_name} (dequantised {kv_name} = {kv_name} * {name})"
            )
        return broadcast_view(_ONE, arr.shape)
    if not kv8:
        raise TypeError(
            f"{name} applies to an 8-bit {kv_name} (int8, float8_e4m3fn, float8_e5m2), got {arr.dtype}"
        )
    s = as_array(scale, name)
    if s.dtype.kind not in "fiu" or s.dtype == np.bool_:
        raise TypeError(f"{name} must be a real array or number, got dtype {s.dtype}")
    if s.ndim > arr.ndim:
        raise ValueError(f"{name} of shape {s.shape} has more dimensions than {kv_name} {arr.shape}")
    padded = (1,) * (arr.ndim - s.ndim) + s.shape
    if padded[seq_axis] != 1 and padded[-1] != 1:
        raise ValueError(
            f"{name} of shape {s.shape} varies along both the sequence and head-dim axes of {kv_name} "
            f"{arr.shape}; a scale is per token (sequence axis, head dim 1), per channel (sequence 1) "
            "or per head / tensor"
        )
    s32 = s if s.dtype == F32 else np.asarray(s, dtype=F32)
    if values and s32.size and not positive_normal(s32):
        raise ValueError(f"{name} must be finite and positive (at least {F32_TINY:g}, a float32 normal)")
    try:
        return broadcast_view(s32, arr.shape)
    except ValueError:
        raise ValueError(f"{name} of shape {s.shape} does not broadcast to {kv_name}'s {arr.shape}") from None


def quantize(x: Any, dtype: np.dtype[Any], scale: Array | None, name: str) -> tuple[Array, Array]:
    """``(q, s)``: float ``x`` (..., D) in an 8-bit ``dtype`` with its scale.

    ``scale`` None: per token, ``s = max|x| / QMAX`` over the last axis (shape
    ``(..., 1)``; a row of zeros takes the scale 1), int8 rounded to nearest (half to
    even) and fp8 by ml_dtypes' cast (round to nearest even): every value within
    half a step of ``x``.  A given ``scale`` (broadcast against x) quantises with
    it; a value beyond the format's range is a ValueError naming ``name``, raised
    before anything is returned, as are non-finite values of x."""
    xf = np.asarray(x, dtype=np.float32)
    if not np.all(np.isfinite(xf)):
        raise ValueError(f"{name} must be finite to be written to an 8-bit cache")
    qmax = QMAX[dtype.name]
    if scale is None:
        amax = (
            np.max(np.abs(xf), axis=-1, keepdims=True)
            if xf.shape[-1]
            else np.zeros(xf.shape[:-1] + (1,), F32)
        )
        s = np.where(amax > 0, amax / np.float32(qmax), np.float32(1.0)).astype(F32)
        # a row of tiny values whose scale would be a float32 denormal: the least normal
        s = np.maximum(s, np.float32(F32_TINY))
    else:
        s = np.asarray(scale, dtype=F32)
    y = xf / s
    if scale is not None and y.size and float(np.max(np.abs(y))) > qmax * (1 + 2**-10):
        raise ValueError(
            f"{name} does not fit the cache's fixed scale: max |{name} / scale| is "
            f"{float(np.max(np.abs(y))):.6g}, beyond {dtype.name}'s {qmax:g}"
        )
    if dtype == I8:
        q = np.clip(np.rint(y), -127, 127).astype(I8)
    else:
        q = np.clip(y, -qmax, qmax).astype(dtype)
    return q, s


def quantize_kv(
    x: npt.ArrayLike, dtype: Any = "int8", *, scale: npt.ArrayLike | float | None = None
) -> tuple[Array, Array]:
    """Quantise float keys or values to an 8-bit cache format, with their scales.

    Parameters
    ----------
    x : array_like
        Float keys or values, head dim last: ``(..., D)``; finite.
    dtype : {"int8", "float8_e4m3fn", "float8_e5m2"} or dtype, default "int8"
        The 8-bit format (fp8 from ``ml_dtypes``).
    scale : array_like or float, optional
        None: one scale per token (row of the last axis), ``max|x| / 127`` for
        int8, ``/ 448`` for e4m3, ``/ 57344`` for e5m2, shape ``(..., 1)``.  Given
        (broadcast against ``x``, e.g. per channel ``(D,)`` or one number): the
        values are quantised with it, and a value beyond the format's range
        raises ValueError.

    Returns
    -------
    q : ndarray
        ``x / scale`` in ``dtype``: int8 rounded to nearest (ties to even) and
        clipped to [-127, 127]; fp8 by ml_dtypes' cast (nearest even).  Every
        value is within half a quantisation step of ``x / scale``.
    scale : ndarray
        float32, ``(..., 1)`` per token, or the given scale as float32 (its own
        shape).  Pass it as ``k_scale`` / ``v_scale``.

    Raises
    ------
    TypeError
        For a dtype that is not one of the three.
    ValueError
        For non-finite ``x``, a bad scale, or a value that does not fit a given scale.

    See Also
    --------
    fastattn.scaled_dot_product_attention : reads 8-bit keys and values with ``k_scale`` / ``v_scale``.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 1, 64), dtype=np.float32)
    >>> k = rng.standard_normal((1, 4, 256, 64), dtype=np.float32)
    >>> v = rng.standard_normal((1, 4, 256, 64), dtype=np.float32)
    >>> k8, ks = fastattn.quantize_kv(k, "int8")
    >>> v8, vs = fastattn.quantize_kv(v, "int8")
    >>> k8.dtype, ks.shape
    (dtype('int8'), (1, 4, 256, 1))
    >>> out = fastattn.scaled_dot_product_attention(q, k8, v8, k_scale=ks, v_scale=vs)
    >>> ref = fastattn.scaled_dot_product_attention(q, k, v)
    >>> bool(np.abs(out - ref).max() < 0.02)
    True
    """
    dt = kv8_dtype(dtype)
    xa = as_array(x, "x")
    if xa.dtype.kind != "f" and xa.dtype.name != "bfloat16":
        raise TypeError(f"x must be a float array, got dtype {xa.dtype}")
    if xa.ndim < 1:
        raise ValueError("x must have at least one dimension (the head dim)")
    s = None
    if scale is not None:
        sa = as_array(scale, "scale")
        if sa.dtype.kind not in "fiu" or sa.dtype == np.bool_:
            raise TypeError(f"scale must be a real array or number, got dtype {sa.dtype}")
        s = np.asarray(sa, dtype=F32)
        if s.size and not positive_normal(s):
            raise ValueError(f"scale must be finite and positive (at least {F32_TINY:g}, a float32 normal)")
        try:
            np.broadcast_shapes(s.shape, xa.shape)
        except ValueError:
            raise ValueError(f"scale of shape {s.shape} does not broadcast to x's {xa.shape}") from None
    return quantize(xa, dt, s, "x")
