"""The key/value cache front ends' checks (fastattn.kvcache, fastattn.flash_compat):
dtypes of caches and queries, batch indices, new tokens, sequence lengths, the
cache operands and the scales of 8-bit caches, all checked before any cache is
written."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from ._args import bhsd, check_heads
from ._checks import (
    F16,
    F32,
    F64,
    INT64_MAX,
    as_array,
    int_bounds,
    int_value,
    is_bfloat16,
    is_storage_dtype,
)
from ._plan import Call, replace
from ._quant import is_kv8, quantize, scale_value

Array: TypeAlias = npt.NDArray[Any]

# ---------------------------------------------------------------------------
# Integers: the one checker of every integer argument of the cache front ends, flash_compat
# and fastattn.positions.  A Python int has no size limit and a uint64 above 2**63 - 1
# wraps to a negative int64 when converted, so each value is compared with its bounds
# before any conversion, and reported as given.


def index_value(x: Any, name: str, minimum: int | None = None, maximum: int = INT64_MAX) -> int:
    """One integer argument (a Python int of any size or a NumPy integer, not a bool), in
    ``[minimum, maximum]``; the upper bound defaults to the int64 range the kernels and
    NumPy's index arrays hold."""
    return int_value(x, name, minimum, maximum)


def _object_ints(x: Any) -> Array | None:
    """x as an object array when it is one (or a list/tuple NumPy makes one of) holding
    only Python/NumPy ints: ints beyond int64; else None (as_array refuses other objects)."""
    if isinstance(x, np.ndarray):
        if x.dtype != object:
            return None
        a = x
    elif isinstance(x, (list, tuple)):
        try:
            a = np.asarray(x, dtype=object)
        except ValueError:  # ragged: as_array reports it
            return None
    else:
        return None
    if a.size == 0 or not all(
        isinstance(e, numbers.Integral) and not isinstance(e, (bool, np.bool_)) for e in a.flat
    ):
        return None
    if all(-(2**63) <= int(e) <= INT64_MAX for e in a.flat):
        return None  # NumPy would not have made an object array of these
    return a


def indices_value(
    x: Any,
    name: str,
    minimum: int | None = None,
    maximum: int = INT64_MAX,
    what: str = "an int or an integer array",
    half_open: bool = False,
    shape: tuple[int, ...] | None = None,
) -> Array:
    """An integer scalar or array argument, each value in ``[minimum, maximum]``, as an int64
    array of x's shape (0-D for a scalar).  The range is checked on the values as given
    (uint64, Python ints beyond int64) before any conversion, so that the error reports
    them as given.  ``half_open`` words the bounds as ``[minimum, maximum + 1)``; ``shape``, when
    given, is checked after the dtype and before the range."""
    if type(x) is int and (minimum is None or minimum <= x) and x <= maximum and shape in (None, ()):
        return np.array(x, dtype=np.int64)  # the common case, in range
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be {what}, got bool")
    if isinstance(x, numbers.Integral):
        v = int(x)
        a = np.array(v, dtype=np.int64 if -(2**63) <= v <= INT64_MAX else object)
    else:
        obj = _object_ints(x)
        a = as_array(x, name) if obj is None else obj
    if a.dtype.kind not in "iuO":
        raise TypeError(f"{name} must be {what}, got dtype {a.dtype}")
    if shape is not None and a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    if a.size:
        lo, hi = int_bounds(a)  # Python ints: exact for uint64 and object arrays
        if (minimum is not None and lo < minimum) or hi > maximum:
            if minimum is None:
                bounds = f"be <= {maximum}"
            elif half_open:
                bounds = f"lie in [{minimum}, {maximum + 1})"
            else:
                bounds = f"lie in [{minimum}, {maximum}]"
            if a.ndim == 0:
                raise ValueError(f"{name} must {bounds}, got {lo}")
            raise ValueError(f"{name} values must {bounds}, got range [{lo}, {hi}]")
    return a.astype(np.int64)


# ---------------------------------------------------------------------------
# Key/value caches


def is_real_float(dt: np.dtype[Any]) -> bool:
    return dt.kind == "f" or is_bfloat16(dt)


def query_dtype_ok(qdt: np.dtype[Any], cdt: np.dtype[Any]) -> bool:
    """Queries may be float32 or the cache dtype (float64 caches need float64 queries);
    8-bit caches take float32, float16 or bfloat16 queries (the kernel's 8-bit K/V)."""
    if cdt == F64:
        return qdt == F64
    if is_kv8(cdt):
        return qdt == F32 or qdt == F16 or is_bfloat16(qdt)
    return qdt == F32 or qdt == cdt


def query_dtypes(cdt: np.dtype[Any]) -> str:
    """The query dtypes a cache of dtype cdt takes, in words (for error messages)."""
    if is_kv8(cdt):
        return "float32, float16 or bfloat16"
    return cdt.name if cdt in (F32, F64) else f"float32 or {cdt}"


CACHE_DTYPES = "float16, bfloat16, float32 or float64"
CACHE_DTYPES8 = f"{CACHE_DTYPES} (or 8-bit: int8, float8_e4m3fn or float8_e5m2)"


def cache_dtype_ok(cdt: np.dtype[Any]) -> bool:
    """A dtype a cache front end stores: the kernel's float dtypes or an 8-bit K/V one."""
    return is_storage_dtype(cdt) or is_kv8(cdt)


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
    """A KV cache's storage dtype: float16, bfloat16, float32 or float64, or 8-bit int8,
    float8_e4m3fn or float8_e5m2 (``ml_dtypes``; these three and ``"bfloat16"`` by name
    too); None is the documented default, float32 (not NumPy's ``np.dtype(None)``, float64)."""
    if dtype is None:
        return F32
    try:
        if isinstance(dtype, str) and dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            import ml_dtypes  # by name: only when one is asked for

            dt: np.dtype[Any] = np.dtype(getattr(ml_dtypes, dtype))
        else:
            dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be {CACHE_DTYPES8}, got {dtype!r}") from None
    if not cache_dtype_ok(dt):
        raise TypeError(f"dtype must be {CACHE_DTYPES8}, got {dt}")
    return dt


def batch_indices(batch_index: Any, B: int, name: str = "batch_index") -> Array | None:
    """None -> None; int / slice / 1-D int array -> int64 array of distinct indices in [0, B)."""
    if batch_index is None:
        return None
    if isinstance(batch_index, slice):
        return np.arange(B, dtype=np.int64)[batch_index]
    what = "an int, a slice or an integer array"
    if isinstance(batch_index, numbers.Integral) and not isinstance(batch_index, (bool, np.bool_)):
        i = int(batch_index)
        if not 0 <= i < B:
            raise ValueError(f"{name} {i} is out of range for a batch of {B}")
        return np.array([i], dtype=np.int64)
    if isinstance(batch_index, (bool, np.bool_)):
        raise TypeError(f"{name} must be {what}, got bool")
    a = _object_ints(batch_index)
    if a is None:
        a = as_array(batch_index, name)
    if a.ndim == 1 and a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iuO":
        raise TypeError(f"{name} must be {what}, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    idx = indices_value(a, name, 0, B - 1, what, half_open=True)
    if np.unique(idx).size != idx.size:
        raise ValueError(f"{name} must not repeat an index")
    return idx


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
    m = float(np.abs(k).max())  # in k's dtype: one pass, no float64 copy (decode steps)
    if not math.isfinite(m):  # an inf or NaN given: the largest finite value decides
        with np.errstate(invalid="ignore"):
            a = np.abs(k.astype(F64) if k.dtype != F64 else k)
        m = float(np.max(a, where=np.isfinite(a), initial=0.0))
    return m * 1.4142136 < _max_finite(dt) * 0.999


def overflow_error(
    given: Array, out: Array, name: str, rotated: bool = False, bshd: bool = False
) -> str | None:
    """The error message when ``out`` (``given`` converted, or rotated with ``rotated``) holds
    an inf that ``given`` did not: a finite value beyond the range of out's dtype.  None when
    there is none.  An inf given stays inf; rotated, a non-finite value spreads to its pair,
    so a row of ``given`` with any non-finite value may hold infs.  ``bshd``: given is the
    bhsd view of the caller's bshd array, whose index the message reports."""
    inf = np.isinf(out)
    if not inf.any():
        return None
    with np.errstate(invalid="ignore"):
        had = np.isinf(given) if not rotated else ~np.isfinite(given).all(axis=-1, keepdims=True)
    lost = inf & ~had
    if not lost.any():
        return None
    where = tuple(int(i) for i in np.argwhere(lost)[0])
    value = float(given[where])
    if bshd:
        where = where[:-3] + (where[-2], where[-3], where[-1])
    what = "value(s) whose rotation is" if rotated else "value(s)"
    return (
        f"{name} holds {int(lost.sum())} {what} beyond the range of {out.dtype} "
        f"(e.g. {value!r} at index {where}), which would be inf"
    )


def to_cache_dtype(
    a: Array,
    dt: np.dtype[Any],
    name: str,
    rot: Any = None,
    pos: Array | None = None,
    num_threads: int | None = None,
    bshd: bool = False,
) -> Array:
    """``a`` converted to the cache dtype ``dt`` (rotated at ``pos`` first with ``rot``, a
    fastattn.positions cache rotary); ValueError when a finite value becomes inf (beyond
    the dtype's range), so that nothing is lost silently.  Called before any write.
    ``bshd``: a is the bhsd view of the caller's bshd array (for the error's index)."""
    if rot is not None:
        c = np.empty(a.shape, dtype=dt)
        with np.errstate(over="ignore", invalid="ignore"):
            rot.rotate_into(a, c, pos, num_threads)
    elif a.dtype == dt:
        return a
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            c = a.astype(dt)
    msg = overflow_error(a, c, name, rot is not None, bshd)
    if msg is not None:
        raise ValueError(
            f"{msg} in the {dt} cache; nothing was written. Use a wider cache dtype or rescale the values."
        )
    return c


def keys_to_write(
    k: Array,
    dt: np.dtype[Any],
    name: str,
    rot: Any,
    pos: Array | None,
    num_threads: int | None = None,
    bshd: bool = False,
) -> tuple[Array, bool]:
    """The new keys ``k`` (bhsd) of every cache front end (KVCache, attention_with_kvcache,
    flash_attn_with_kvcache), checked before any write: ``(keys, rotate_while_writing)``.
    Unrotated: k in the cache dtype ``dt``.  Rotated (``rot`` at positions ``pos``): k itself
    when the rotation cannot overflow ``dt`` (then rotated and converted in the C pass that
    writes it), else rotated into a checked buffer (ValueError naming ``name`` when a
    rotated value overflows), written as unrotated keys are."""
    if rot is not None and rotation_fits(k, dt):
        return k, True
    return to_cache_dtype(k, dt, name, rot, pos, num_threads, bshd), False


def write_tokens(
    kc: Array,
    vc: Array,
    rows: Array | None,
    starts: Array,
    kw: Array,
    vw: Array,
    rot: Any = None,
    kpos: Array | None = None,
    num_threads: int | None = None,
) -> None:
    """Write the new tokens ``kw``/``vw`` (bhsd ``(n, Hk, T, D/Dv)``, from :func:`keys_to_write`
    and :func:`to_cache_dtype`) into the bhsd caches ``kc``/``vc``: token t of row r into
    cache row ``rows[r]`` (None: r) at position ``starts[r] + t``.  With ``rot``, kw is
    rotated at ``kpos`` in the C pass that writes it."""
    n, T = kw.shape[0], kw.shape[2]
    if not (n and T):
        return
    if rot is None:
        write_rows(kc, rows, starts, kw)
    else:
        assert kpos is not None
        kv = kc[:n] if rows is None else row_view(kc, rows)
        if kv is not None:
            rot.append(kw, kv, kpos, num_threads)
        else:
            for r, b in enumerate(rows.tolist() if rows is not None else range(n)):
                rot.append(kw[r : r + 1], kc[b : b + 1], kpos[r : r + 1], num_threads)
    write_rows(vc, rows, starts, vw)


def reread_written(call: Call, kc: Array, vc: Array, starts: Array, T: int) -> None:
    """After :func:`write_tokens`: make ``call`` see the tokens just written.

    A call checked before the write reads the caches in place, unless the kernel cannot
    read them there: a last axis that is not contiguous (K kept transposed), a misaligned
    or byte-swapped cache.  Then its plan holds a copy made before the write, which would
    miss the new tokens; copy them into it from the cache (``kc``/``vc``: the bhsd views of
    the rows the call reads, row r written at ``starts[r] .. + T``), so that the attention
    sees exactly what the cache holds (O(new tokens), not a second copy of the cache)."""
    plan = call.plan
    if plan is None or T == 0:
        return
    for held, cache in ((plan.k, kc), (plan.v, vc)):
        if held.size == 0 or np.may_share_memory(held, cache):
            continue  # read in place: sees the write
        if np.all(starts == starts[0]):
            s0 = int(starts[0])
            held[:, :, s0 : s0 + T] = cache[:, :, s0 : s0 + T]
        else:
            for r, s in enumerate(starts.tolist()):
                held[r, :, s : s + T] = cache[r, :, s : s + T]


# ---------------------------------------------------------------------------
# 8-bit caches (int8, float8_e4m3fn, float8_e5m2; fastattn._quant): their scales and writes.
# A cache's scale is read as scaled_dot_product_attention reads it (per token, per channel,
# per head or one number).  New tokens are quantised before any write: with the cache's own
# per-token scales (computed for them and written beside them), or with a fixed scale
# (a value that does not fit raises).


def kv8_scale(
    scale: Any, name: str, cache: Array, lay: str, kv_name: str, writing: bool
) -> tuple[Array | None, Array | None]:
    """The scale ``scale`` (argument ``name``) of the 4-D cache ``cache`` (argument
    ``kv_name``, in layout ``lay``), checked as the attention checks it: ``(fixed,
    target)``, both None for a float cache or when nothing is written.

    Writing new tokens: a scale that varies along the sequence axis (its length there is
    the cache's, > 1) holds per-token scales: ``target`` is the bhsd ``(B, H, S, 1)`` view
    of the caller's array that the new tokens' scales are written to (a writable float32
    or float64 ndarray of exactly that shape, not sharing memory with the cache); any
    other scale is fixed: ``fixed`` is its float32 bhsd ``(B, H, 1, X)`` broadcast view,
    the scale the new tokens are quantised with (fp8 without a scale: 1).

    Raises TypeError for an int8 cache without a scale or a float cache with one,
    ValueError for a scale that is not finite and positive or does not fit the cache
    (fastattn._quant.scale_value), or a per-token scale that cannot be written."""
    if scale is None and not is_kv8(cache.dtype):
        return None, None  # a float cache (the common case: no more checks)
    seq_axis = -2 if lay == "bhsd" else -3
    shape = np.shape(scale) if scale is not None else ()
    S = cache.shape[seq_axis]
    per_token = scale is not None and len(shape) <= 4 and S > 1
    if per_token:
        padded = (1,) * (4 - len(shape)) + tuple(shape)
        per_token = padded[seq_axis] == S
    try:
        checked = scale_value(scale, name, cache, seq_axis, kv_name)
    except ValueError as e:
        if per_token and "finite and positive" in str(e):  # e.g. an array preallocated with zeros
            raise ValueError(
                f"{e}, everywhere: the positions past the cached tokens included (preallocate a "
                "per-token scale array with np.ones)"
            ) from None
        raise
    if checked is None or not writing:
        return None, None
    if not per_token:
        return bhsd(checked, lay)[:, :, :1], None
    assert isinstance(shape, tuple)
    want = cache.shape[:-1] + (1,)
    if not isinstance(scale, np.ndarray):
        raise TypeError(
            f"{name} holds per-token scales, which the new tokens' are written to: it must be a "
            f"numpy.ndarray, got {type(scale).__name__}"
        )
    if scale.dtype not in (F32, F64):
        raise TypeError(
            f"{name} holds per-token scales, which the new tokens' are written to: it must be "
            f"float32 or float64, got {scale.dtype}"
        )
    if (1,) * (4 - scale.ndim) + scale.shape != want:
        raise ValueError(
            f"{name} holds per-token scales, which the new tokens' are written to: it must have "
            f"one scale per token of each sequence and head, shape {want}, got {scale.shape}"
        )
    if not scale.flags.writeable:
        raise ValueError(f"{name} must be writable: the new tokens' per-token scales are written to it")
    if np.may_share_memory(scale, cache):
        raise ValueError(f"{name} must not share memory with {kv_name}")
    return None, bhsd(scale[(None,) * (4 - scale.ndim)], lay)


def kv8_fixed_scale(scale: Any, name: str, dt: np.dtype[Any], Hk: int, X: int, kv_name: str) -> Array | None:
    """A :class:`fastattn.KVCache`'s fixed scale given at construction (``name``, for its
    keys or values ``kv_name`` of head dim X): a number, per head ``(Hk, 1, 1)``, per
    channel ``(Hk, 1, X)`` / ``(X,)``, or any shape broadcasting to ``(Hk, 1, X)`` (with
    leading ones up to 4-D): the same for every sequence, so beam reordering and resets
    keep it.  Returns a float32 copy of shape ``(1, Hk', 1, X')`` (Hk' in {1, Hk}, X' in
    {1, X}) that broadcasts against the bhsd cache; None without a scale (then the cache
    keeps per-token scales).  TypeError for a float cache with a scale (``scale_value``)."""
    if scale is None:
        return None
    if not is_kv8(dt):
        raise TypeError(
            f"{name} applies to an 8-bit cache (int8, float8_e4m3fn, float8_e5m2), got dtype {dt}"
        )
    shape = np.shape(scale)
    padded = (1,) * (4 - len(shape)) + tuple(shape) if len(shape) <= 4 else None
    if (
        padded is None
        or padded[0] != 1
        or padded[2] != 1
        or padded[1] not in (1, Hk)
        or padded[3] not in (1, X)
    ):
        raise ValueError(
            f"{name} must be a fixed scale broadcasting to ({Hk}, 1, {X}) (a number, per head "
            f"({Hk}, 1, 1) or per channel ({Hk}, 1, {X}) / ({X},)); got shape {shape}. Leave it "
            "None for per-token scales kept by the cache"
        )
    proxy = np.empty(padded, dtype=dt)  # the shape the scale must fit
    checked = scale_value(scale, name, proxy, -2, kv_name)
    assert checked is not None
    return np.array(checked, dtype=F32)  # a copy: later changes to the caller's array change nothing


def kv8_tokens(x: Array, dt: np.dtype[Any], fixed: Array | None, name: str) -> tuple[Array, Array]:
    """New tokens ``x`` (bhsd, float) quantised to the 8-bit cache dtype ``dt``: ``(data,
    scales)``, with the ``fixed`` scale (from :func:`kv8_scale`) or, None, per token
    (scales ``(n, H, T, 1)`` float32).  Called before any write: a value that does not
    fit a fixed scale (or is not finite) raises ValueError naming ``name``."""
    try:
        return quantize(x, dt, fixed, name)
    except ValueError as e:
        raise ValueError(f"{e}; nothing was written") from None


def kv8_targets_apart(targets: Sequence[tuple[Array | None, str]], others: Sequence[Array]) -> None:
    """Per-token scale arrays written to (each ``(array or None, its name)``) must not share
    memory with each other or with ``others`` (the caches): a write would corrupt the other."""
    given = [(t, n) for t, n in targets if t is not None]
    for i, (t, n) in enumerate(given):
        for u, m in given[i + 1 :]:
            if np.may_share_memory(t, u):
                raise ValueError(f"{n} and {m} must not share memory")
        for o in others:
            if np.may_share_memory(t, o):
                raise ValueError(f"{n} must not share memory with the caches or the new tokens")


def write_rows(c: Array, rows: Array | None, starts: Array, w: Array) -> None:
    """Write ``w`` (bhsd ``(n, H, T, X)``) into the bhsd array ``c``: token t of row r into
    row ``rows[r]`` (None: r) at position ``starts[r] + t``; one slice per array where every
    row starts at the same position (a few rows: no ufunc).  :func:`write_tokens` writes the
    caches with it, the 8-bit caches' per-token scales too."""
    n, T = w.shape[0], w.shape[2]
    if not (n and T):
        return
    starts_l = starts.tolist()
    rows_l = list(range(n)) if rows is None else rows.tolist()
    if starts_l.count(starts_l[0]) == len(starts_l):
        s0 = starts_l[0]
        view = c[:n] if rows is None else row_view(c, rows)
        if view is not None:
            view[:, :, s0 : s0 + T] = w
        else:
            c[rows_l, :, s0 : s0 + T] = w
        return
    for r, (b, s) in enumerate(zip(rows_l, starts_l)):
        c[b, :, s : s + T] = w[r]


def reread_scales(call: Call, k_target: Array | None, v_target: Array | None) -> Call:
    """After the per-token scales of new tokens were written to ``k_target``/``v_target``
    (bhsd views of the caller's arrays, from :func:`kv8_scale`): ``call`` reading them.

    A float32 scale is read in place (the write is seen); another (float64, byte-swapped)
    was converted by the check before the write: the call takes a fresh conversion."""
    plan = call.plan
    if plan is None:
        return call
    changes: dict[str, Any] = {}
    for field, t in (("k_scale", k_target), ("v_scale", v_target)):
        held = getattr(plan, field)
        if t is None or held is None or np.may_share_memory(held, t):
            continue
        changes[field] = np.broadcast_to(np.asarray(t, dtype=F32), held.shape)
    return call.with_plan(replace(plan, changes)) if changes else call


def seqlens_value(x: Any, name: str, B: int, limit: int | None = None, note: str = "") -> Array:
    """Per-sequence lengths from an int or a ``(B,)`` (or 0-D) integer array, as int64
    ``(B,)``; each in ``[0, limit]`` (``[0, 2**63 - 1]`` without a limit)."""
    a = indices_value(x, name, 0, INT64_MAX if limit is None else limit)
    if a.ndim == 0:
        return np.full(B, int(a), dtype=np.int64)
    if a.shape != (B,):
        raise ValueError(f"{name} must have shape ({B},){note}, got {a.shape}")
    return a


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
    if not cache_dtype_ok(cdt):
        raise TypeError(f"k_cache must have dtype {CACHE_DTYPES8}, got {cdt}")
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
