"""Argument checking shared by the public functions.  Every check raises
``TypeError`` or ``ValueError`` naming the argument, before any C code runs."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
_DTYPE_NAMES = "float32, float64, float16 or bfloat16"


# bfloat16 comes from ml_dtypes, whose import costs ~0.5 s: ``import fastattn`` does not
# import it.  An array can only have the bfloat16 dtype once ml_dtypes has been imported
# (by whoever made the array), so a dtype is recognised by its name first and compared
# with ml_dtypes' only then; code that creates bfloat16 arrays calls bfloat16_dtype().
def bfloat16_dtype() -> np.dtype[Any]:
    """``np.dtype(ml_dtypes.bfloat16)`` (imports ml_dtypes on first use)."""
    import ml_dtypes

    dt: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dt


def is_bfloat16(dt: np.dtype[Any]) -> bool:
    """True when ``dt`` is ml_dtypes' bfloat16 (without importing ml_dtypes for other dtypes).

    Told by its scalar type's name first: ``dtype.name`` is computed in Python on each
    access (~3 us, NumPy 2), where ``dtype.type.__name__`` is an attribute (~0.1 us),
    and every call checks its arrays' dtypes several times."""
    return bool(dt.type.__name__ == "bfloat16" and dt == bfloat16_dtype())


def is_storage_dtype(dt: np.dtype[Any]) -> bool:
    """float32, float64, float16 or bfloat16: the dtypes the kernel reads."""
    return dt == F32 or dt == F64 or dt == F16 or is_bfloat16(dt)


def __getattr__(name: str) -> Any:
    # Older spellings, resolved on use (they import ml_dtypes).
    if name == "BFLOAT16":
        return bfloat16_dtype()
    if name == "STORAGE_DTYPES":
        return (F32, F64, F16, bfloat16_dtype())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The most threads one call uses (csrc/attention.c, FA_MAX_THREADS).
MAX_THREADS = 1024
INT64_MAX = 2**63 - 1


def as_array(x: Any, name: str) -> npt.NDArray[Any]:
    """``np.asarray`` without copying when possible; rejects non-array-likes.
    Non-native byte order is converted to native (a copy)."""
    if type(x) is np.ndarray:  # the common case
        return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))
    if isinstance(x, np.ma.MaskedArray):
        # np.asarray would drop its mask silently: the masked entries would count.
        raise TypeError(
            f"{name} must not be a numpy.ma.MaskedArray (its mask would be ignored); "
            f"pass {name}.filled(value) or a separate attn_mask"
        )
    if isinstance(x, np.ndarray):
        return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))
    if x is None or isinstance(x, (str, bytes, dict, set)):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - any conversion failure is a type error
        raise TypeError(f"{name} must be an array, got {type(x).__name__}: {e}") from None
    if a.dtype == object:
        raise TypeError(f"{name} must be a numeric array, got an object array")
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


# The first element along an axis (distinct_elements' cut of a zero-stride axis).
_FIRST = slice(0, 1)


def distinct_elements(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``a`` with each zero-stride axis cut to its first element: a broadcast view's
    distinct elements (its memory), ``a`` itself where no stride is zero."""
    if not any(a.strides):  # (every axis: one element, without the generator's ~1 µs)
        return a[(_FIRST,) * a.ndim]
    return a[tuple(_FIRST if st == 0 else slice(None) for st in a.strides)]


def broadcast_view(a: npt.NDArray[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """``np.broadcast_to(a, shape)``: the same read-only view (shape, strides, memory).

    NumPy's broadcast_to runs a Python-level nditer (~3.5 µs), and a paged KV cache call
    makes several such views (stand-ins, scales).  Where ``a`` is a non-empty ndarray of a
    NumPy or ml_dtypes dtype (native byte order) whose memory is one C-contiguous block
    once its zero-stride dims are cut to one element (a C-contiguous array, or a broadcast
    view of one), and ``shape`` a tuple of positive ints that ``a`` broadcasts to, the view
    is made by ndarray's constructor on that block (~2 µs), with broadcast_to's strides: 0
    along new dims and along a's dims of size 1, a's own along the others.  Every other
    case (a subclass, an empty array or shape, a shape it does not broadcast to: the error,
    a view too large for the constructor) is np.broadcast_to's."""
    if type(a) is not np.ndarray or type(shape) is not tuple:
        return np.broadcast_to(a, shape)
    dt = a.dtype
    k = len(shape) - a.ndim  # new leading dims
    if k < 0 or not a.size or dt.hasobject or dt.isbuiltin not in (1, 2):  # (0: structured, byte-swapped)
        return np.broadcast_to(a, shape)
    strides = [0] * k
    for m in shape[:k]:
        if type(m) is not int or m < 1:
            return np.broadcast_to(a, shape)
    for n, m, st in zip(a.shape, shape[k:], a.strides):
        if n == m and n != 1:  # (an m of another type that equals n: the constructor's to refuse)
            strides.append(st)
        elif n == 1 and type(m) is int and m >= 1:
            strides.append(0)
        else:
            return np.broadcast_to(a, shape)
    buf = a
    if not a.flags.c_contiguous:
        if 0 not in a.strides:
            return np.broadcast_to(a, shape)
        buf = distinct_elements(a)  # a broadcast view: the memory of its distinct elements
        if not buf.flags.c_contiguous:
            return np.broadcast_to(a, shape)
    try:
        view: npt.NDArray[Any] = np.ndarray(shape, dt, buf, 0, tuple(strides))
    except (TypeError, ValueError):  # (a shape of floats, a view too large: broadcast_to's error)
        return np.broadcast_to(a, shape)
    view.setflags(write=False)
    return view


# Up to this many elements, int_bounds reads a list instead of running two reductions.
SMALL_INTS = 64


def int_bounds(a: npt.NDArray[Any]) -> tuple[int, int]:
    """``(int(a.min()), int(a.max()))`` of a non-empty integer array (exact for uint64).

    A NumPy reduction costs ~1.3 µs however few the elements (its setup), and a KV cache
    call checks several per-sequence arrays of B elements: a small array's values are
    read as a list of Python ints (``tolist``, ~0.1 µs) and compared there."""
    if a.size <= SMALL_INTS and a.dtype.kind in "iu":
        vals = (a if a.ndim == 1 else a.ravel()).tolist()
        return min(vals), max(vals)
    return int(a.min()), int(a.max())


def check_float(a: Any, name: str) -> None:
    if not is_storage_dtype(a.dtype):
        raise TypeError(f"{name} must have dtype {_DTYPE_NAMES}, got {a.dtype}")


def kernel_ready(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A view the kernel can read: native byte order, aligned (pointer and
    strides multiples of the item size), last dim contiguous; else a copy."""
    if a.flags.aligned and a.dtype.isnative and (a.strides[-1] == a.itemsize or a.shape[-1] <= 1):
        return a
    b = np.empty(a.shape, dtype=a.dtype.newbyteorder("=") if a.dtype.byteorder not in "=|" else a.dtype)
    b[...] = a
    return b


# Largest |scale| whose product with log2(e) (the kernels fold it into the
# queries) is finite in the compute dtype.
_SCALE_MAX = {
    F32: float(np.finfo(np.float32).max) / math.log2(math.e),
    F64: 1.7976931348623157e308 / math.log2(math.e),
}


def scale_value(scale: Any, D: int, compute_dtype: np.dtype[Any] = F32) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale must be finite, got {scale!r}")
    limit = _SCALE_MAX[F64 if compute_dtype == F64 else F32]
    if abs(s) > limit:
        prec = "float64" if compute_dtype == F64 else "float32"
        raise ValueError(
            f"scale must have magnitude at most {limit:.4g} for {prec} computation "
            f"(it is applied in that precision), got {scale!r}"
        )
    return s


def flag_value(x: Any, name: str) -> bool:
    """A bool argument: bool, NumPy bool, int or None (false); arrays are rejected
    with the argument's name instead of NumPy's "truth value is ambiguous"."""
    if x is None or isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, numbers.Integral):
        return bool(x)
    raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def threads_value(num_threads: Any, default: Callable[[], int]) -> int:
    if num_threads is None:
        return default()
    if type(num_threads) is int and 1 <= num_threads <= MAX_THREADS:  # the fast path (no ABC check)
        return num_threads
    if isinstance(num_threads, (bool, np.bool_)) or not isinstance(num_threads, numbers.Integral):
        raise TypeError(f"num_threads must be an int or None, got {type(num_threads).__name__}")
    n = int(num_threads)
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"num_threads must be in [1, {MAX_THREADS}], got {num_threads}")
    return n


def int_value(x: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    v = int(x)
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {x}")
    return v
