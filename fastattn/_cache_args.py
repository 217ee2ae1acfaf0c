"""The key/value cache front ends' checks (fastattn.kvcache, fastattn.flash_compat):
dtypes of caches and queries, batch indices, new tokens, sequence lengths and
the cache operands, all checked before any cache is written."""

from __future__ import annotations

import numbers
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from ._args import bhsd, check_heads
from ._checks import (
    F32,
    F64,
    as_array,
    bfloat16_dtype,
    is_bfloat16,
    is_storage_dtype,
)

Array: TypeAlias = npt.NDArray[Any]

# ---------------------------------------------------------------------------
# Key/value caches


def is_real_float(dt: np.dtype[Any]) -> bool:
    return dt.kind == "f" or is_bfloat16(dt)


def query_dtype_ok(qdt: np.dtype[Any], cdt: np.dtype[Any]) -> bool:
    """Queries may be float32 or the cache dtype (float64 caches need float64 queries)."""
    if cdt == F64:
        return qdt == F64
    return qdt == F32 or qdt == cdt


def query_dtypes(cdt: np.dtype[Any]) -> str:
    """The query dtypes a cache of dtype cdt takes, in words (for error messages)."""
    return cdt.name if cdt in (F32, F64) else f"float32 or {cdt}"


def cache_dtype_ok(cdt: np.dtype[Any]) -> bool:
    return is_storage_dtype(cdt)


def _progression(idx: Array) -> tuple[int, int] | None:
    """(start, step) when idx is start, start+step, ... with step >= 1 (a strided view suffices)."""
    if idx.size == 1:
        return int(idx[0]), 1
    d = np.diff(idx)
    if d[0] >= 1 and np.all(d == d[0]):
        return int(idx[0]), int(d[0])
    return None


def row_view(a: Array, idx: Array | None) -> Array | None:
    """``a[idx]`` as a view when idx is an arithmetic progression, else None."""
    if idx is None:
        return a
    if idx.size == 0:
        return a[:0]
    pr = _progression(idx)
    if pr is None:
        return None
    start, step = pr
    return a[start : start + step * (idx.size - 1) + 1 : step]


def cache_dtype_value(dtype: Any) -> np.dtype[Any]:
    """A KV cache's storage dtype: float16, bfloat16, float32 or float64 (``"bfloat16"`` by name too)."""
    try:
        dt = bfloat16_dtype() if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype!r}") from None
    if not is_storage_dtype(dt):
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dt}")
    return dt


def batch_indices(batch_index: Any, B: int, name: str = "batch_index") -> Array | None:
    """None -> None; int / slice / 1-D int array -> int64 array of distinct indices in [0, B)."""
    if batch_index is None:
        return None
    if isinstance(batch_index, slice):
        return np.arange(B, dtype=np.int64)[batch_index]
    if isinstance(batch_index, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, a slice or an integer array, got bool")
    if isinstance(batch_index, numbers.Integral):
        i = int(batch_index)
        if not 0 <= i < B:
            raise ValueError(f"{name} {i} is out of range for a batch of {B}")
        return np.array([i], dtype=np.int64)
    a = as_array(batch_index, name)
    if a.ndim == 1 and a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int, a slice or an integer array, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and (a.min() < 0 or a.max() >= B):
        raise ValueError(f"{name} values must lie in [0, {B}), got range [{a.min()}, {a.max()}]")
    a = a.astype(np.int64)
    if np.unique(a).size != a.size:
        raise ValueError(f"{name} must not repeat an index")
    return a


def new_tokens(x: Any, name: str, layout: str) -> Array:
    """New keys or values to append: a real floating 4-D array (in ``layout``)."""
    a = as_array(x, name)
    if not is_real_float(a.dtype):
        raise TypeError(f"{name} must be a real floating array, got dtype {a.dtype}")
    if a.ndim != 4:
        raise ValueError(f"{name} must be 4-D ({layout}), got shape {a.shape}")
    return a


def cache_tokens(x: Any, name: str, n: int, Hk: int, Dx: int, allow_3d: bool) -> Array:
    """One block of new keys/values for a KVCache: shape (n, Hk, T, Dx) (or (Hk, T, Dx)
    with allow_3d), real floating; returns it as an array."""
    a = as_array(x, name)
    if not is_real_float(a.dtype):
        raise TypeError(f"{name} must be a real floating array, got dtype {a.dtype}")
    if allow_3d and a.ndim == 3:
        a = a[None]
    if a.ndim != 4 or a.shape[0] != n or a.shape[1] != Hk or a.shape[3] != Dx:
        want = f"({n}, {Hk}, T, {Dx})" + (f" or ({Hk}, T, {Dx})" if allow_3d else "")
        raise ValueError(f"{name} must have shape {want}, got {np.shape(x)}")
    return a


def attend_query(
    q: Any, cdt: np.dtype[Any], shape: tuple[int, int, int], lens: Array, idx: Array | None, alibi: Any
) -> Array:
    """The query checks of :meth:`fastattn.KVCache.attend`, in its order: ``q`` of a
    dtype the cache ``cdt`` takes, shaped ``(n, Hq, Lq, D)`` with ``shape`` = ``(n, Hk,
    D)`` and Hq a multiple of Hk; each selected sequence (its length in ``lens``, its
    row in ``idx``, None for all rows) holds at least Lq tokens; ``alibi`` of
    ``(Hq,)`` or ``(n, Hq)``.  Returns q as an array."""
    n, Hk, D = shape
    qa = as_array(q, "q")
    if not query_dtype_ok(qa.dtype, cdt):
        raise TypeError(f"q must have dtype {query_dtypes(cdt)} for a {cdt} cache, got {qa.dtype}")
    if qa.ndim != 4 or qa.shape[0] != n or qa.shape[3] != D:
        raise ValueError(f"q must have shape ({n}, Hq, Lq, {D}), got {qa.shape}")
    Hq, Lq = qa.shape[1], qa.shape[2]
    check_heads(Hq, Hk, True, "q", "the cache's kv")
    if lens.size and lens.min() < Lq:
        r = int(np.argmin(lens))
        b = r if idx is None else int(idx[r])
        raise ValueError(
            f"q holds {Lq} query tokens but sequence {b} has only {int(lens[r])} "
            "cached tokens; append the new tokens' keys and values before attending"
        )
    if alibi is not None:
        al = as_array(alibi, "alibi_slopes")
        if al.ndim == 2 and al.shape[0] != n:
            raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({n}, {Hq}), got {al.shape}")
    return qa


def _max_finite(dt: np.dtype[Any]) -> float:
    if dt == F64 or dt == F32 or dt.kind == "f":
        return float(np.finfo(dt).max)
    import ml_dtypes  # bfloat16 (untyped)

    finfo: Any = ml_dtypes.finfo
    return float(finfo(dt).max)


def rotation_fits(k: Array, dt: np.dtype[Any]) -> bool:
    """True when rotating k's values (each output is x*cos -/+ y*sin of a pair, at most
    sqrt(2) * max|k| in magnitude) cannot overflow the cache dtype dt."""
    if k.size == 0:
        return True
    with np.errstate(invalid="ignore"):
        a = np.abs(k.astype(F64) if k.dtype != F64 else k)
    m = float(np.max(a, where=np.isfinite(a), initial=0.0))
    return m * 1.4142136 < _max_finite(dt) * 0.999


def to_cache_dtype(
    a: Array,
    dt: np.dtype[Any],
    name: str,
    rot: Any = None,
    pos: Array | None = None,
    num_threads: int | None = None,
) -> Array:
    """``a`` converted to the cache dtype ``dt`` (rotated at ``pos`` first with ``rot``, a
    fastattn.positions cache rotary); ValueError when a finite value becomes inf (beyond
    the dtype's range), so that nothing is lost silently.  Called before any write."""
    if rot is not None:
        from . import positions

        rotate: Any = positions.rotate  # (Any: typed or not, positions is another module's)
        contiguous: Any = positions.last_contiguous
        src = a if is_storage_dtype(a.dtype) else a.astype(rot.cos.dtype)
        c = np.empty(a.shape, dtype=dt)
        with np.errstate(over="ignore", invalid="ignore"):
            rotate(contiguous(src), c, pos, rot.cos, rot.sin, rot.interleaved, num_threads)
    elif a.dtype == dt:
        return a
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            c = a.astype(dt)
    inf = np.isinf(c)
    if inf.any():
        # an inf given stays inf; rotated, it may spread to its pair: any non-finite input in a row
        given = np.isinf(a) if rot is None else ~np.isfinite(a).all(axis=-1, keepdims=True)
        lost = inf & ~given
        if lost.any():
            where = tuple(int(i) for i in np.argwhere(lost)[0])
            raise ValueError(
                f"{name} holds {int(lost.sum())} value(s) beyond the range of the cache dtype {dt} "
                f"(e.g. {float(a[where])!r} at index {where}), which would be stored as inf; nothing was "
                "written. Use a wider cache dtype (float32) or rescale the values."
            )
    return c


def seqlens_value(x: Any, name: str, B: int, limit: int | None = None, note: str = "") -> Array:
    """Per-sequence lengths from an int or a ``(B,)`` (or 0-D) integer array, as int64
    ``(B,)``; with ``limit``, each in ``[0, limit]``."""
    if isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)):
        if limit is not None and not 0 <= int(x) <= limit:  # before np.full: beyond int64 is OverflowError
            raise ValueError(f"{name} must lie in [0, {limit}], got {x}")
        return np.full(B, int(x), dtype=np.int64)
    a = as_array(x, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int or an integer array, got dtype {a.dtype}")
    if a.ndim == 0:
        a = np.broadcast_to(a, (B,))
    if a.shape != (B,):
        raise ValueError(f"{name} must have shape ({B},){note}, got {a.shape}")
    seq = a.astype(np.int64)
    if limit is not None and seq.size and (seq.min() < 0 or seq.max() > limit):
        raise ValueError(f"{name} values must lie in [0, {limit}], got range [{seq.min()}, {seq.max()}]")
    return seq


def cache_operands(
    qa: Array, k_cache: Any, v_cache: Any, cache_seqlens: Any, k_new: Any, v_new: Any, lay: str
) -> tuple[Array, Array, Array, Array, Array | None, Array | None]:
    """The operand checks of :func:`fastattn.attention_with_kvcache`: caller-owned
    caches, their lengths and the new tokens (all before anything is written).

    Returns the bhsd views ``(q, k_cache, v_cache)``, the int64 ``cache_seqlens``
    and the bhsd new keys and values (None without them)."""
    if not isinstance(k_cache, np.ndarray):
        raise TypeError(f"k_cache must be a numpy.ndarray, got {type(k_cache).__name__}")
    if not isinstance(v_cache, np.ndarray):
        raise TypeError(f"v_cache must be a numpy.ndarray, got {type(v_cache).__name__}")
    cdt = k_cache.dtype
    if not is_storage_dtype(cdt):
        raise TypeError(f"k_cache must have dtype float16, bfloat16, float32 or float64, got {cdt}")
    if v_cache.dtype != cdt:
        raise TypeError(f"v_cache must have the dtype of k_cache ({cdt}), got {v_cache.dtype}")
    if not query_dtype_ok(qa.dtype, cdt):
        raise TypeError(f"q must have dtype {query_dtypes(cdt)} for {cdt} caches, got {qa.dtype}")
    for a, name in ((qa, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D ({lay}), got shape {a.shape}")
    qh, kc, vc = bhsd(qa, lay), bhsd(k_cache, lay), bhsd(v_cache, lay)
    B, Hq, Lq, D = qh.shape
    _, Hk, S, Dk = kc.shape
    if kc.shape[0] != B or vc.shape[0] != B:
        raise ValueError(
            f"q, k_cache and v_cache must share the batch size, got {qa.shape}, "
            f"{k_cache.shape}, {v_cache.shape}"
        )
    if Dk != D:
        raise ValueError(f"k_cache head dim ({Dk}) must equal q's ({D})")
    if vc.shape[1] != Hk or vc.shape[2] != S:
        raise ValueError(
            f"v_cache must have the heads and length of k_cache, got {v_cache.shape} and {k_cache.shape}"
        )
    Dv = vc.shape[3]
    if D == 0 or Dv == 0:
        raise ValueError(f"head dims must be >= 1, got head_dim {D} and value_dim {Dv}")
    check_heads(Hq, Hk, True, "q", "the cache's kv")
    seq = seqlens_value(cache_seqlens, "cache_seqlens", B, S)

    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    kn = vn = None
    if k_new is not None:
        k_given, v_given = new_tokens(k_new, "k_new", lay), new_tokens(v_new, "v_new", lay)
        kn, vn = bhsd(k_given, lay), bhsd(v_given, lay)
        if kn.shape[:2] != (B, Hk) or kn.shape[3] != D:
            raise ValueError(
                f"k_new must have {B} sequences, {Hk} heads and head dim {D}, got {k_given.shape}"
            )
        if vn.shape[:2] != (B, Hk) or vn.shape[3] != Dv:
            raise ValueError(
                f"v_new must have {B} sequences, {Hk} heads and head dim {Dv}, got {v_given.shape}"
            )
        T = kn.shape[2]
        if vn.shape[2] != T:
            raise ValueError(
                f"k_new and v_new must hold the same number of tokens, got {T} and {vn.shape[2]}"
            )
        if seq.size and seq.max() + T > S:
            b = int(np.argmax(seq))
            raise ValueError(
                f"cache_seqlens[{b}] + {T} new tokens = {int(seq[b]) + T} exceeds the cache length {S}"
            )
        for a, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            if not a.flags.writeable:
                raise ValueError(f"{name} must be writable to append k_new/v_new")
        if np.may_share_memory(k_cache, v_cache):
            raise ValueError("k_cache and v_cache must not share memory")
    return qh, kc, vc, seq, kn, vn
