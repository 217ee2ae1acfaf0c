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
