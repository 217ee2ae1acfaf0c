"""Graph building: the operands as Dask arrays, the merge tree of a query chunk's
parts, the output collections, and the tasks that merge and finish a query chunk."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import dask.array as da
import numpy as np
from dask.highlevelgraph import HighLevelGraph

from .._config import get_float32_matmul_precision, precision_code
from ..merge import merge_attention_states
from . import _chunk
from ._geometry import NDArray, State

# Dask's array API is untyped (and its collection protocol does not match da.Array in its own
# annotations): its constructors are called through these typed names.
from_array: Callable[..., da.Array] = da.from_array


DaskArray: Callable[..., da.Array] = da.Array


def merge2(a: State, b: State) -> State:
    """Merge two (out, lse) partial states over disjoint key sets."""
    o, lse = merge_attention_states([a[0], b[0]], [a[1], b[1]])
    return o, lse


def empty(*, out_shape: tuple[int, ...], lse_shape: tuple[int, ...], dtype: np.dtype[Any]) -> State:
    """State of a query chunk that sees no key: zeros and -inf."""
    return np.zeros(out_shape, dtype=dtype), np.full(lse_shape, -np.inf, dtype=dtype)


def finish(state: State, *, sinks: NDArray | None, rows_dead: NDArray | None) -> State:
    """The root of a query chunk: merge the sinks in once (a part with output 0 and
    LSE sink[h]) and clear the rows past a query length (zeros, LSE -inf).
    ``sinks`` (H,), ``rows_dead`` a bool (…, 1, L) broadcast over the heads."""
    o, lse = state
    if sinks is not None:
        sk = np.broadcast_to(sinks.astype(lse.dtype)[:, None], lse.shape)
        o, lse = merge_attention_states([o, np.zeros_like(o)], [lse, sk])
    if rows_dead is not None and rows_dead.any():
        o = np.where(rows_dead[..., None], np.zeros((), dtype=o.dtype), o)
        lse = np.where(rows_dead, np.array(-np.inf, dtype=lse.dtype), lse)
    return o, lse


def final_out(state: State, *, dtype: np.dtype[Any], layout: str) -> NDArray:
    return _chunk.to_bhsd(state[0], layout).astype(dtype, copy=False)


def final_lse(state: State) -> NDArray:
    return state[1]


def as_dask(x: object, name: str) -> da.Array:
    if isinstance(x, da.Array):
        a = x
    elif isinstance(x, np.ndarray):
        a = from_array(x, chunks=x.shape if x.ndim else (), asarray=True)
    else:
        raise TypeError(f"{name} must be a dask.array.Array or a numpy.ndarray, got {type(x).__name__}")
    if any(math.isnan(c) for cs in a.chunks for c in cs):
        raise ValueError(f"{name} has unknown chunk sizes; call {name}.compute_chunk_sizes() first")
    if not isinstance(a._meta, np.ndarray):
        raise TypeError(f"{name} must hold NumPy chunks, got chunks of type {type(a._meta).__name__}")
    return a


def rechunk(a: da.Array, chunks: Sequence[Sequence[int]]) -> da.Array:
    c = tuple(tuple(x) for x in chunks)
    rechunk: Callable[..., da.Array] = a.rechunk
    return a if tuple(a.chunks) == c else rechunk(c)


def tree(dsk: dict[Any, Any], parts: list[Any], mname: str, blk: tuple[int, ...]) -> Any:
    """Binary merge tree over the parts' keys; returns the root's key."""
    level = 0
    while len(parts) > 1:
        nxt = []
        for p in range(0, len(parts) - 1, 2):
            mk = (mname, *blk, level, p // 2)
            dsk[mk] = (merge2, parts[p], parts[p + 1])
            nxt.append(mk)
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts, level = nxt, level + 1
    return parts[0]


def collections(
    dsk: dict[Any, Any],
    deps: list[Any],
    oname: str,
    lname: str | None,
    out_chunks: tuple[tuple[int, ...], ...],
    lse_chunks: tuple[tuple[int, ...], ...],
    dtype: np.dtype[Any],
    cdt: np.dtype[Any],
) -> tuple[da.Array, da.Array | None]:
    """The output (and LSE) Dask arrays of a graph whose final keys are named
    oname (and lname)."""
    nd = len(out_chunks)
    if lname is None:
        g = HighLevelGraph.from_collections(oname, dsk, dependencies=deps)
        return DaskArray(
            g, oname, chunks=out_chunks, dtype=dtype, meta=np.empty((0,) * nd, dtype=dtype)
        ), None
    out_keys = {kk: vv for kk, vv in dsk.items() if kk[0] != lname}
    lse_keys = {kk: vv for kk, vv in dsk.items() if kk[0] == lname}
    g_in = HighLevelGraph.from_collections(oname, out_keys, dependencies=deps)
    out = DaskArray(g_in, oname, chunks=out_chunks, dtype=dtype, meta=np.empty((0,) * nd, dtype=dtype))
    # The LSE layer depends on the roots inside the output layer.
    g_l = HighLevelGraph.from_collections(lname, lse_keys, dependencies=[cast(Any, out)])
    lse = DaskArray(
        g_l, lname, chunks=lse_chunks, dtype=cdt, meta=np.empty((0,) * len(lse_chunks), dtype=cdt)
    )
    return out, lse


def precision(precision: str | None) -> str:
    """The precision name each task uses: checked here, the caller's default resolved
    here (a worker process has its own default)."""
    precision_code(precision)
    return get_float32_matmul_precision() if precision is None else precision
