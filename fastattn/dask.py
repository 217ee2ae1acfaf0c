"""Exact attention over Dask arrays, sharded along batch, heads, queries and keys.

Import it explicitly (``import fastattn.dask``); ``import fastattn`` never
imports Dask.  Needs the ``dask`` extra (``pip install fastattn[dask]``).

Every (query chunk, key chunk) pair runs the in-memory
:func:`fastattn.scaled_dot_product_attention` with ``return_lse=True`` in one
task; the partial results of a query chunk are combined with
:func:`fastattn.merge_attention_states` in a binary tree (pairs, then pairs of
pairs), so no task holds more than one query chunk, one key/value chunk and
two partial outputs.  Under ``is_causal``, a ``window``, ``key_lengths``,
``query_lengths`` or a ``block_mask``, key chunks that no query of a query
chunk can see get no task at all.

Chunking rules (the rechunks are lazy and happen only where needed):

* batch dims: the common refinement of the chunk boundaries of query, key,
  value (every boundary of any of them is a boundary of all);
* query heads: the common refinement of the query's head boundaries and the
  key/value head boundaries times ``G = Hq // Hk``, after rounding the
  query's boundaries down to whole groups (multiples of ``G``); key/value head
  chunks are then the query head chunks divided by ``G``, so each query head
  chunk reads exactly one key/value head chunk;
* query length L: the query's chunks; key length S: the common refinement of
  key and value chunks; with ``block_mask``, both rounded down to whole blocks
  (multiples of ``block_size``), so a chunk's blocks are whole blocks of the
  global grid;
* the head dims D and Dv are made single chunks;
* ``attn_mask`` is rechunked to match; its broadcast (size-1) dims stay
  size 1, so a ``(L, S)`` mask is never expanded over batch or heads.

NumPy inputs are wrapped with ``dask.array.from_array`` as a single chunk
(then refined as above).

How a chunk pair reproduces the whole problem's positions.  The kernel aligns
``is_causal``, ``window`` and ALiBi to the bottom right of the call it is given:
query i sits at ``i' = i + S_b - L_b``.  A chunk call has its own, different
bottom right, so each task works with ``t = j - i'`` in global terms:

* the call is trimmed (views) to the rows and keys holding visible pairs under
  the causal / window bounds on t; those bounds are then always a window of the
  trimmed call (only with a block mask, whose grid fixes where a call may start,
  can an explicit boolean mask of the pair's rows x keys be needed);
* ALiBi, ``-slope * |t|``: when the trimmed call's own alignment equals the
  global one (diagonal chunks of an equal L/S chunking, and any pair under
  ``window=(0, 0)``) the kernel's ALiBi is used as is; otherwise the pair is
  split at ``t = 0`` into the part with keys at or before the diagonal and the
  part after it, where ``|t|`` is linear: a per-key bias (an additive
  ``(.., 1, S_chunk)`` mask, broadcast over the rows) plus a per-row constant,
  added to the part's LSE (it does not change the softmax weights), and the
  parts are merged by LSE.  The kernel stores each logit in float32, so the
  bias is kept small where the weight is: calls of at most 64 rows
  (``_ALIBI_ROWS``), each with its reference key next to the diagonal;
* ``key_lengths`` / ``query_lengths``: each batch element's valid keys and
  rows of the chunk are sliced (views), so the chunk call needs no lengths;
  rows past a query length stay zeros with LSE -inf;
* ``sinks`` join the denominator exactly once: merged into the root of each
  query chunk's tree as one more part with LSE ``sink`` and output 0;
* ``softcap`` acts on each score and is passed to every chunk call;
* ``block_mask``: each chunk call gets its slice of the block grid.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from itertools import product
from typing import Any, Literal, cast, overload

import dask.array as da
import numpy as np
import numpy.typing as npt
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from . import _args
from . import functional as _functional
from ._checks import (
    F16,
    F32,
    F64,
    flag_value,
    is_bfloat16,
    scale_value,
    threads_value,
)
from ._config import get_float32_matmul_precision, precision_code
from .merge import merge_attention_states

__all__ = ["scaled_dot_product_attention", "varlen_attention"]

NDArray = npt.NDArray[Any]
# Dask's array API is untyped (and its collection protocol does not match da.Array in its own
# annotations): its constructors are called through these typed names.
_from_array: Callable[..., da.Array] = da.from_array
_DaskArray: Callable[..., da.Array] = da.Array
State = tuple[NDArray, NDArray]  # (out (..., H, L, Dv), lse (..., H, L)) of one query chunk, bhsd
Bound = int | None  # a bound on c - a (local key index minus local row index); None = unbounded

# Rows per call of the split ALiBi (module docstring): its per-key bias on a row's keys nearest the
# diagonal grows with the rows of the call (slope * rows), and so does the float32 rounding of those
# logits; 64 rows keep it within a few float32 ulps of 1 for slopes <= 1, at one call per 64 rows.
_ALIBI_ROWS = 64


# --------------------------------------------------------------------------- helpers run in tasks


def _to_bhsd(a: NDArray, layout: str) -> NDArray:
    """(…, L, H, X) -> (…, H, L, X) view for bshd; identity for bhsd."""
    return np.swapaxes(a, -2, -3) if layout == "bshd" else a


def _chunk_window(i0: int, i1: int, j0: int, j1: int, lo: Bound, hi: Bound) -> tuple[int, int] | None:
    """The (left, right) window of the chunk call equal to ``lo <= j - i <= hi``
    on global indices, or None when that cannot be written as a window.

    The chunk call aligns its window to the chunk's own bottom right: local
    query a sees local keys c with ``Sc - Lc - left <= c - a <= Sc - Lc + right``,
    and global ``j - i = (c - a) + (j0 - i0)``.  A bound that would need a
    negative left or right (some rows of the chunk see none of its keys on
    that side) is not expressible.
    """
    b = (j1 - j0) - (i1 - i0)
    off = j0 - i0
    right = -1 if hi is None else hi - off - b
    left = -1 if lo is None else b - lo + off
    if (hi is not None and right < 0) or (lo is not None and left < 0):
        return None
    return left, right


def _visibility(i0: int, i1: int, j0: int, j1: int, lo: Bound, hi: Bound) -> str:
    """'none', 'full' or 'partial' for query rows [i0, i1) and keys [j0, j1)
    under ``lo <= j - i <= hi``."""
    if i1 <= i0 or j1 <= j0:
        return "none"
    dmin, dmax = j0 - (i1 - 1), (j1 - 1) - i0
    if (hi is not None and dmin > hi) or (lo is not None and dmax < lo):
        return "none"
    if (hi is None or dmax <= hi) and (lo is None or dmin >= lo):
        return "full"
    return "partial"


def _with_bias(m: NDArray | None, bias: NDArray) -> NDArray:
    """The user's chunk mask with an additive float bias folded in."""
    if m is None:
        return bias
    if m.dtype == np.bool_:
        return np.where(m, bias, np.array(-np.inf, dtype=bias.dtype))
    return m + bias  # (float masks were converted to the compute dtype at the task's start)


def _bcast_index(a: NDArray, idx: tuple[int, ...]) -> NDArray:
    """a[idx] over a's leading dims, index 0 where a dim is broadcast (size 1)."""
    r: NDArray = a[tuple(0 if a.shape[d] == 1 else i for d, i in enumerate(idx))]
    return r


def _sub(a: NDArray, r0: int, r1: int, c0: int, c1: int) -> NDArray:
    """a[..., r0:r1, c0:c1] of a (…, rows, keys) array, its broadcast (size-1) dims kept."""
    return a[
        ...,
        slice(r0, r1) if a.shape[-2] != 1 else slice(None),
        slice(c0, c1) if a.shape[-1] != 1 else slice(None),
    ]


def _trim(Lr: int, Sr: int, lo: Bound, hi: Bound, unit: tuple[int, int]) -> tuple[int, int, int, int]:
    """Rows [a0, a1) and keys [c0, c1) holding every visible pair of an Lr x Sr call
    under ``lo <= c - a <= hi`` (the call is not "none"); the starts rounded down
    to multiples of ``unit`` (block sizes: a block mask's grid starts at 0).

    Without rounding the window of the trimmed call always exists: its right side
    is ``hi + a1 - c1 >= 0`` (as ``c1 <= a1 + hi``) and its left side
    ``c1 - a1 - lo >= 0`` (as ``a1 <= Sr - lo``), so no explicit mask is needed."""
    a0 = 0 if hi is None else max(0, -hi)  # row a sees keys c <= a + hi
    a1 = Lr if lo is None else min(Lr, Sr - lo)  # row a sees keys c >= a + lo
    c0 = 0 if lo is None else max(0, a0 + lo)
    c1 = Sr if hi is None else min(Sr, a1 + hi)
    return a0 // unit[0] * unit[0], a1, c0 // unit[1] * unit[1], c1


def _bounded(
    q: NDArray,
    k: NDArray,
    v: NDArray,
    m: NDArray | None,
    bm: NDArray | None,
    lo: Bound,
    hi: Bound,
    opts: dict[str, Any],
    *,
    alibi: NDArray | None = None,
    bias: NDArray | None = None,
    row_shift: NDArray | None = None,
) -> State | None:
    """One in-memory call over bhsd views q (…, H, Lr, D), k and v (…, Hk, Sr, X),
    restricted to keys with ``lo <= c - a <= hi`` (local indices); None when no
    pair is visible.  ``alibi``: slopes for the kernel's own ALiBi (the caller
    checked that the trimmed call's alignment is the global one); ``bias``
    (…, 1, Sr) an additive per-key mask and ``row_shift`` (…, Lr) the per-row
    constant added to the LSE (the split ALiBi).

    The call is trimmed to the rows and keys that hold visible pairs (views), so
    the restriction is a window of the trimmed call; only with a block mask
    (whose grid fixes the starts) can it need an explicit bool mask."""
    Lr, Sr = q.shape[-2], k.shape[-2]
    if _visibility(0, Lr, 0, Sr, lo, hi) == "none":
        return None
    # Bounds that restrict nothing (every pair has -(Lr - 1) <= c - a <= Sr - 1) are dropped: a window
    # of up to 2**63 - 1 shifted by a chunk offset could otherwise exceed what the call accepts.
    if lo is not None and lo <= -(Lr - 1):
        lo = None
    if hi is not None and hi >= Sr - 1:
        hi = None
    bq, bk = opts["block_size"] or (1, 1)
    a0, a1, c0, c1 = _trim(Lr, Sr, lo, hi, (bq, bk))
    d = c0 - a0  # the trimmed call's c - a is the original's minus d
    lo2 = None if lo is None else lo - d
    hi2 = None if hi is None else hi - d
    qs, ks, vs = q[..., a0:a1, :], k[..., c0:c1, :], v[..., c0:c1, :]
    if m is not None:
        m = _sub(m, a0, a1, c0, c1)
    if bias is not None:
        m = _with_bias(m, bias[..., c0:c1])
    if bm is not None:
        bm = _sub(bm, a0 // bq, -(-a1 // bq), c0 // bk, -(-c1 // bk))
    Lt, St = a1 - a0, c1 - c0
    window = None
    if _visibility(0, Lt, 0, St, lo2, hi2) == "partial":
        window = _chunk_window(0, Lt, 0, St, lo2, hi2)
        if window is None:  # (block mask only) not a window of the call: an explicit Lt x St bool mask
            dj = np.arange(St)[None, :] - np.arange(Lt)[:, None]
            vis = np.ones((Lt, St), dtype=bool)
            if lo2 is not None:
                vis &= dj >= lo2
            if hi2 is not None:
                vis &= dj <= hi2
            if m is None:
                m = vis
            elif m.dtype == np.bool_:
                m = np.logical_and(m, vis)
            else:
                m = np.where(vis, m, np.array(-np.inf, dtype=m.dtype))
    o, lse = _functional.scaled_dot_product_attention(
        qs,
        ks,
        vs,
        m,
        scale=opts["scale"],
        enable_gqa=opts["gqa"],
        return_lse=True,
        window=window,
        softcap=opts["softcap"],
        alibi_slopes=alibi,
        block_mask=bm,
        block_size=opts["block_size"] if bm is not None else None,
        num_threads=opts["threads"],
        precision=opts["precision"],
    )
    if row_shift is not None:
        lse = (lse + row_shift[..., a0:a1]).astype(lse.dtype)  # -inf (no key) stays -inf
    if Lt == Lr:
        return o, lse
    out = np.zeros(o.shape[:-2] + (Lr, o.shape[-1]), dtype=o.dtype)
    full = np.full(lse.shape[:-1] + (Lr,), -np.inf, dtype=lse.dtype)
    out[..., a0:a1, :], full[..., a0:a1] = o, lse
    return out, full


def _piece(
    q: NDArray,
    k: NDArray,
    v: NDArray,
    m: NDArray | None,
    bm: NDArray | None,
    slopes: NDArray | None,
    e: int,
    opts: dict[str, Any],
) -> State | None:
    """Attention of bhsd views q (…, H, Lr, D) over k, v (…, Hk, Sr, X) whose
    global positions satisfy ``t = j - i' = (c - a) + e`` for local row a and key c.

    The causal and window bounds on t become bounds on ``c - a``; ALiBi
    (``-slope * |t|``, slopes (…, H)) is the kernel's own when the trimmed call's
    alignment is the global one, else split at t = 0 (module docstring)."""
    lo_t: Bound = None if opts["wl"] < 0 else -opts["wl"]
    hi_t: Bound = 0 if opts["causal"] else (None if opts["wr"] < 0 else opts["wr"])
    lo = None if lo_t is None else lo_t - e
    hi = None if hi_t is None else hi_t - e
    Lr, Sr = q.shape[-2], k.shape[-2]
    if slopes is None:
        return _bounded(q, k, v, m, bm, lo, hi, opts)
    if _visibility(0, Lr, 0, Sr, lo, hi) == "none":
        return None
    a0, a1, c0, c1 = _trim(Lr, Sr, lo, hi, opts["block_size"] or (1, 1))
    # The trimmed call puts row a at i' = (a - a0) + (c1 - c0) - (a1 - a0), so its
    # t = (c - c0) - i' = (c - a) + (a1 - c1): the global alignment iff a1 - c1 == e.
    if a1 - c1 == e:
        return _bounded(q, k, v, m, bm, lo, hi, opts, alibi=slopes)
    bq, bk = opts["block_size"] or (1, 1)
    rows = -(-_ALIBI_ROWS // bq) * bq  # (whole blocks: a row block's block grid is a slice of the call's)
    if Lr > rows:  # row blocks, each with its own reference key (below)
        out, lse = None, None
        for r0 in range(0, Lr, rows):
            r1 = min(r0 + rows, Lr)
            mr = None if m is None else _sub(m, r0, r1, 0, m.shape[-1])
            bmr = None if bm is None else _sub(bm, r0 // bq, -(-r1 // bq), 0, bm.shape[-1])
            st = _piece(q[..., r0:r1, :], k, v, mr, bmr, slopes, e - r0, opts)
            if st is None:
                continue
            if out is None or lse is None:
                out = np.zeros(st[0].shape[:-2] + (Lr, st[0].shape[-1]), dtype=st[0].dtype)
                lse = np.full(st[1].shape[:-1] + (Lr,), -np.inf, dtype=st[1].dtype)
            out[..., r0:r1, :], lse[..., r0:r1] = st
        return None if out is None or lse is None else (out, lse)
    cdt = F64 if q.dtype == F64 else F32
    sl = slopes[..., None, None]  # (…, H, 1, 1), float64
    c = np.arange(Sr, dtype=F64)
    a = np.arange(Lr, dtype=F64)[:, None]
    states = []
    # Keys at or before the diagonal (t <= 0): -slope*|t| = slope*t = slope*(c - cref) + slope*(cref + e - a);
    # after it (t >= 1): -slope*t.  The kernel stores each logit (score plus bias) in float32, so the
    # bias should be small where the softmax weight is: cref is the visible key nearest the diagonal
    # of the last row (before it) or of the first row (after it), so the bias is <= 0 on visible keys
    # and at most slope * Lr (Lr <= _ALIBI_ROWS) in magnitude on each row's key nearest the diagonal.
    for sign, cref, lo_p, hi_p in (
        (1.0, min(max(Lr - 1 - e, 0), Sr - 1), lo, -e if hi is None else min(hi, -e)),
        (-1.0, min(max(1 - e, 0), Sr - 1), 1 - e if lo is None else max(lo, 1 - e), hi),
    ):
        if lo_p is not None and hi_p is not None and lo_p > hi_p:
            continue
        bias = (sign * sl * (c - cref)).astype(cdt)  # (…, H, 1, Sr)
        row = (sign * sl * (cref + e - a))[..., 0]  # (…, H, Lr)
        st = _bounded(q, k, v, m, bm, lo_p, hi_p, opts, bias=bias, row_shift=row)
        if st is not None:
            states.append(st)
    if not states:
        return None
    if len(states) == 1:
        return states[0]
    o, lse = merge_attention_states([s[0] for s in states], [s[1] for s in states])
    return o, lse


def _part(
    q: NDArray,
    k: NDArray,
    v: NDArray,
    m: NDArray | None,
    *,
    geom: tuple[int, int, int, int],
    opts: dict[str, Any],
    bm: NDArray | None = None,
    slopes: NDArray | None = None,
    qlens: NDArray | None = None,
    klens: NDArray | None = None,
) -> State:
    """Attention of one query chunk over one key chunk; returns (out, lse) in bhsd.

    ``geom = (i0, i1, j0, j1)``: the chunk's global query rows [i0, i1) and keys
    [j0, j1).  ``bm``, ``slopes``, ``qlens`` and ``klens`` are this chunk's slices
    of the block mask (…, H, blocks, blocks), the ALiBi slopes (…, H) and the
    lengths (…) (None where not given)."""
    i0, i1, j0, j1 = geom
    L, S = opts["L"], opts["S"]
    qh, kh, vh = (_to_bhsd(x, opts["layout"]) for x in (q, k, v))
    if qh.dtype == F16 or is_bfloat16(qh.dtype):  # partial results in float32, cast once at the end
        qh = qh.astype(F32)
    cdt = F64 if qh.dtype == F64 else F32
    if m is not None and m.dtype != np.bool_ and m.dtype not in (F32, F64):
        m = m.astype(cdt)
    if qlens is None and klens is None:  # one alignment for the whole chunk
        st = _piece(qh, kh, vh, m, bm, slopes, (j0 - i0) - (S - L), opts)
        if st is not None:
            return st
    lead = qh.shape[:-3]
    Hc, Lc = qh.shape[-3], qh.shape[-2]
    out = np.zeros(lead + (Hc, Lc, vh.shape[-1]), dtype=cdt)
    lse = np.full(lead + (Hc, Lc), -np.inf, dtype=cdt)
    if qlens is None and klens is None:
        return out, lse
    bq, bk = opts["block_size"] or (1, 1)
    for b in np.ndindex(*lead):
        Lb = L if qlens is None else int(qlens[b])
        Sb = S if klens is None else int(klens[b])
        nr, nk = min(max(Lb - i0, 0), Lc), min(max(Sb - j0, 0), j1 - j0)
        if nr == 0 or nk == 0:
            continue
        mb = None if m is None else _sub(_bcast_index(m, b), 0, nr, 0, nk)
        bmb = None if bm is None else _sub(_bcast_index(bm, b), 0, -(-nr // bq), 0, -(-nk // bk))
        sb = None if slopes is None else _bcast_index(slopes, b)
        st = _piece(qh[b][:, :nr], kh[b][:, :nk], vh[b][:, :nk], mb, bmb, sb, (j0 - i0) - (Sb - Lb), opts)
        if st is not None:
            out[b][:, :nr], lse[b][:, :nr] = st
    return out, lse


def _merge2(a: State, b: State) -> State:
    """Merge two (out, lse) partial states over disjoint key sets."""
    o, lse = merge_attention_states([a[0], b[0]], [a[1], b[1]])
    return o, lse


def _empty(*, out_shape: tuple[int, ...], lse_shape: tuple[int, ...], dtype: np.dtype[Any]) -> State:
    """State of a query chunk that sees no key: zeros and -inf."""
    return np.zeros(out_shape, dtype=dtype), np.full(lse_shape, -np.inf, dtype=dtype)


def _finish(state: State, *, sinks: NDArray | None, rows_dead: NDArray | None) -> State:
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


def _final_out(state: State, *, dtype: np.dtype[Any], layout: str) -> NDArray:
    return _to_bhsd(state[0], layout).astype(dtype, copy=False)


def _final_lse(state: State) -> NDArray:
    return state[1]


# --------------------------------------------------------------------------- graph-time helpers


def _as_dask(x: object, name: str) -> da.Array:
    if isinstance(x, da.Array):
        a = x
    elif isinstance(x, np.ndarray):
        a = _from_array(x, chunks=x.shape if x.ndim else (), asarray=True)
    else:
        raise TypeError(f"{name} must be a dask.array.Array or a numpy.ndarray, got {type(x).__name__}")
    if any(math.isnan(c) for cs in a.chunks for c in cs):
        raise ValueError(f"{name} has unknown chunk sizes; call {name}.compute_chunk_sizes() first")
    if not isinstance(a._meta, np.ndarray):
        raise TypeError(f"{name} must hold NumPy chunks, got chunks of type {type(a._meta).__name__}")
    return a


def _bounds(chunks: Sequence[int], mult: int = 1) -> set[int]:
    return {int(x) * mult for x in np.cumsum((0,) + tuple(chunks))}


def _chunks_from_bounds(bounds: set[int]) -> tuple[int, ...]:
    b = sorted(bounds)
    return tuple(int(y - x) for x, y in zip(b[:-1], b[1:])) if len(b) > 1 else (0,)


def _refine(*chunk_tuples: Sequence[int]) -> tuple[int, ...]:
    """Common refinement of several chunkings of one dimension."""
    bs: set[int] = set()
    for c in chunk_tuples:
        bs |= _bounds(c)
    return _chunks_from_bounds(bs)


def _round_to(chunks: tuple[int, ...], unit: int) -> tuple[int, ...]:
    """Chunk boundaries rounded down to multiples of unit (the end kept)."""
    total = sum(chunks)
    return _chunks_from_bounds({(b // unit) * unit for b in _bounds(chunks) if b < total} | {total})


def _rechunk(a: da.Array, chunks: Sequence[Sequence[int]]) -> da.Array:
    c = tuple(tuple(x) for x in chunks)
    rechunk: Callable[..., da.Array] = a.rechunk
    return a if tuple(a.chunks) == c else rechunk(c)


def _offsets(chunks: Sequence[int]) -> list[tuple[int, int]]:
    o = [int(x) for x in np.cumsum((0,) + tuple(chunks))]
    return list(zip(o[:-1], o[1:]))


def _any_visible(
    i0: int, i1: int, j0: int, j1: int, Lb: NDArray, Sb: NDArray, causal: bool, wl: int, wr: int
) -> bool:
    """Whether any batch element (valid lengths Lb, Sb, arrays of one shape) has a
    visible pair among rows [i0, i1) and keys [j0, j1) under causal / window."""
    i1b, j1b = np.minimum(i1, Lb), np.minimum(j1, Sb)
    ok = (i1b > i0) & (j1b > j0)
    diag = Sb - Lb  # j - i on the bottom-right diagonal
    hi = 0 if causal else wr
    # (the bounds, up to 2**63 - 1, stay on their own side: diag + hi could wrap around in int64)
    if hi >= 0:
        ok &= j0 - (i1b - 1) - diag <= hi
    if wl >= 0:
        ok &= (j1b - 1) - i0 - diag >= -wl
    return bool(np.any(ok))


def _tree(dsk: dict[Any, Any], parts: list[Any], mname: str, blk: tuple[int, ...]) -> Any:
    """Binary merge tree over the parts' keys; returns the root's key."""
    level = 0
    while len(parts) > 1:
        nxt = []
        for p in range(0, len(parts) - 1, 2):
            mk = (mname, *blk, level, p // 2)
            dsk[mk] = (_merge2, parts[p], parts[p + 1])
            nxt.append(mk)
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts, level = nxt, level + 1
    return parts[0]


def _collections(
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
        return _DaskArray(
            g, oname, chunks=out_chunks, dtype=dtype, meta=np.empty((0,) * nd, dtype=dtype)
        ), None
    out_keys = {kk: vv for kk, vv in dsk.items() if kk[0] != lname}
    lse_keys = {kk: vv for kk, vv in dsk.items() if kk[0] == lname}
    g_in = HighLevelGraph.from_collections(oname, out_keys, dependencies=deps)
    out = _DaskArray(g_in, oname, chunks=out_chunks, dtype=dtype, meta=np.empty((0,) * nd, dtype=dtype))
    # The LSE layer depends on the roots inside the output layer.
    g_l = HighLevelGraph.from_collections(lname, lse_keys, dependencies=[cast(Any, out)])
    lse = _DaskArray(
        g_l, lname, chunks=lse_chunks, dtype=cdt, meta=np.empty((0,) * len(lse_chunks), dtype=cdt)
    )
    return out, lse


def _precision(precision: str | None) -> str:
    """The precision name each task uses: checked here, the caller's default resolved
    here (a worker process has its own default)."""
    precision_code(precision)
    return get_float32_matmul_precision() if precision is None else precision


@overload
def scaled_dot_product_attention(
    query: da.Array | NDArray,
    key: da.Array | NDArray,
    value: da.Array | NDArray,
    attn_mask: da.Array | NDArray | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    layout: str = "bhsd",
    return_lse: Literal[False] = False,
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    key_lengths: npt.ArrayLike | None = None,
    query_lengths: npt.ArrayLike | None = None,
    block_mask: npt.ArrayLike | None = None,
    block_size: tuple[int, int] | None = None,
    num_threads: int | None = None,
    precision: str | None = None,
) -> da.Array: ...


@overload
def scaled_dot_product_attention(
    query: da.Array | NDArray,
    key: da.Array | NDArray,
    value: da.Array | NDArray,
    attn_mask: da.Array | NDArray | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    layout: str = "bhsd",
    return_lse: Literal[True],
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    key_lengths: npt.ArrayLike | None = None,
    query_lengths: npt.ArrayLike | None = None,
    block_mask: npt.ArrayLike | None = None,
    block_size: tuple[int, int] | None = None,
    num_threads: int | None = None,
    precision: str | None = None,
) -> tuple[da.Array, da.Array]: ...


def scaled_dot_product_attention(
    query: da.Array | NDArray,
    key: da.Array | NDArray,
    value: da.Array | NDArray,
    attn_mask: da.Array | NDArray | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    layout: str = "bhsd",
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    key_lengths: npt.ArrayLike | None = None,
    query_lengths: npt.ArrayLike | None = None,
    block_mask: npt.ArrayLike | None = None,
    block_size: tuple[int, int] | None = None,
    num_threads: int | None = None,
    precision: str | None = None,
) -> da.Array | tuple[da.Array, da.Array]:
    """Lazy exact attention over Dask arrays; same semantics as
    :func:`fastattn.scaled_dot_product_attention`.

    query ``(..., Hq, L, D)``, key ``(..., Hk, S, D)``, value ``(..., Hk, S, Dv)``
    (``(..., L, H, D)`` with ``layout="bshd"``; 2-D ``(L, D)`` is one head) as
    ``dask.array.Array`` or ``numpy.ndarray``, chunked along any of batch,
    heads, L and S (see the module docstring for how chunks are aligned).

    attn_mask: bool (True = may attend) or float (added), broadcastable to
        ``(..., Hq, L, S)``, Dask or NumPy; chunked alongside the inputs.
    is_causal: bottom-right aligned (query i sees keys j <= i + S - L); key
        chunks entirely in the future of a query chunk are skipped.
    window: ``(left, right)``, as in the in-memory function; key chunks outside
        every query's window are skipped.
    alibi_slopes, softcap, sinks, key_lengths, query_lengths, block_mask,
        block_size, scale, precision: as in the in-memory function (the small
        per-head, per-batch and block arrays as NumPy array-likes; the block mask
        is sliced per chunk; ``precision=None`` is the caller's
        ``fastattn.get_float32_matmul_precision()`` when the graph is built).
        With a block mask the L and S chunks are rounded down to whole blocks.
        Key chunks past every key length, and chunk pairs whose blocks are all
        False, get no task.
    num_threads: threads of each chunk task (None: ``fastattn.get_num_threads()``
        on the worker).  With several Dask threads per worker, 1 avoids
        oversubscription.
    return_lse: also return the log-sum-exp, ``(..., Hq, L)``, float32
        (float64 for float64 inputs).

    Returns a lazy ``dask.array.Array`` (and the LSE array): nothing runs until
    it is computed.  Partial results are float32 (float64 for float64 inputs),
    so the result is exact up to float32 rounding of the merge.  ALiBi on chunk
    pairs off the diagonal (or with unequal L/S chunks) runs in calls of 64 rows
    with a per-key bias of up to ``slope * 64`` where the weights are: float32
    logits a few ulps further from the in-memory ones.  Argument errors
    raise ``TypeError``/``ValueError`` here, before any task runs.
    """
    # The in-memory function's checks, in its order, from fastattn._args (the shape and dtype
    # checks read only .shape, .ndim and .dtype, so they take the Dask arrays as they are).
    prec = _precision(precision)
    layout = _args.layout_value(layout)
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
    q = _as_dask(query, "query")
    k = _as_dask(key, "key")
    v = _as_dask(value, "value")
    _args.check_dtypes(q, k, v)
    lead, (Hq, L, D), (Hk, S, Dv) = _args.check_shapes(q, k, v, layout, enable_gqa)
    cdt = _args.compute_dtype(q.dtype)
    sc = scale_value(scale, D, cdt)
    if num_threads is not None:  # (None: the worker's default, resolved there)
        threads_value(num_threads, lambda: 1)
    wl, wr = _args.window_value(window)
    cap = _args.softcap_value(softcap)
    m = None
    full = lead + (Hq, L, S)
    if attn_mask is not None:  # as _args.mask_value, on the shape only
        m = _as_dask(attn_mask, "attn_mask")
        if not (m.dtype == np.bool_ or m.dtype.kind == "f" or is_bfloat16(m.dtype)):
            raise TypeError(f"attn_mask must be bool or floating, got dtype {m.dtype}")
        try:
            ok = np.broadcast_shapes(m.shape, full) == full
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"attn_mask of shape {m.shape} does not broadcast to {full}")
    alibi = None
    if alibi_slopes is not None:
        alibi = _args.per_head(alibi_slopes, "alibi_slopes", lead, Hq, True)
    sk = _args.sinks_value(sinks, Hq)
    # (reshaped: for lead == () the contiguous copy is 1-D)
    klens = None if key_lengths is None else _args.lengths(key_lengths, "key_lengths", lead, S).reshape(lead)
    qlens = (
        None
        if query_lengths is None
        else _args.lengths(query_lengths, "query_lengths", lead, L).reshape(lead)
    )
    bm_view, bq_, bk_ = _args.block_mask_value(block_mask, block_size, lead, Hq, L, S)
    bm_full, bsz = None, None
    if bm_view is not None:
        # the user's array (not the broadcast view): its broadcast dims stay size 1 in each task
        bm_full, bsz = np.asarray(block_mask), (bq_, bk_)

    two_d = q.ndim == 2
    if two_d:  # one head: work on (1, L, D)
        q, k, v = q[None], k[None], v[None]
    nd = q.ndim
    nlead = nd - 3
    h_ax, s_ax = (nd - 3, nd - 2) if layout == "bhsd" else (nd - 2, nd - 3)
    G = Hq // Hk if Hk else 1
    if bm_full is not None:  # all dims present, broadcast dims kept at size 1 (sliced per chunk)
        bm_full = bm_full.reshape((1,) * (nlead + 3 - bm_full.ndim) + bm_full.shape)

    # ---- chunk alignment
    lead_chunks = [_refine(q.chunks[d], k.chunks[d], v.chunks[d]) for d in range(nlead)]
    qb = {(b // G) * G for b in _bounds(q.chunks[h_ax])} | {Hq}
    hq_bounds = qb | _bounds(k.chunks[h_ax], G) | _bounds(v.chunks[h_ax], G)
    hq_chunks = _chunks_from_bounds(hq_bounds)
    hk_chunks = tuple(c // G for c in hq_chunks)
    l_chunks = tuple(q.chunks[s_ax])
    s_chunks = _refine(k.chunks[s_ax], v.chunks[s_ax])
    if bsz is not None:  # whole blocks per chunk: a chunk's block grid is a slice of the global one
        l_chunks, s_chunks = _round_to(l_chunks, bsz[0]), _round_to(s_chunks, bsz[1])

    def layout_chunks(h: tuple[int, ...], s: tuple[int, ...], last: int) -> list[tuple[int, ...]]:
        c: list[tuple[int, ...]] = list(lead_chunks) + [(), (), (last,)]
        c[h_ax], c[s_ax] = h, s
        return c

    q = _rechunk(q, layout_chunks(hq_chunks, l_chunks, D))
    k = _rechunk(k, layout_chunks(hk_chunks, s_chunks, D))
    v = _rechunk(v, layout_chunks(hk_chunks, s_chunks, Dv))

    mask_bcast: list[bool] = []
    if m is not None:  # (checked above: broadcasts to full)
        if m.ndim < len(full):
            m = m[(None,) * (len(full) - m.ndim)]
        target = list(lead_chunks) + [hq_chunks, l_chunks, s_chunks]
        mchunks: list[tuple[int, ...]] = []
        for d, (ms, fs) in enumerate(zip(m.shape, full)):
            if ms == fs and not (ms == 1 and len(m.chunks[d]) == 1):
                mask_bcast.append(False)
                mchunks.append(target[d])
            else:  # size 1: broadcast
                mask_bcast.append(True)
                mchunks.append((1,))
        m = _rechunk(m, mchunks)

    opts: dict[str, Any] = dict(
        scale=sc,
        gqa=G != 1,
        layout=layout,
        threads=num_threads,
        causal=causal,
        wl=wl,
        wr=wr,
        softcap=softcap if softcap is None else cap,
        block_size=bsz,
        precision=prec,
        L=L,
        S=S,
    )
    tok = tokenize(
        q.name,
        k.name,
        v.name,
        None if m is None else m.name,
        causal,
        sc,
        G,
        layout,
        wl,
        wr,
        cap,
        alibi,
        sk,
        klens,
        qlens,
        bm_full,
        bsz,
        num_threads,
        prec,
        want_lse,
    )
    pname, mname, ename = f"fastattn-part-{tok}", f"fastattn-merge-{tok}", f"fastattn-empty-{tok}"
    fname, oname = f"fastattn-finish-{tok}", f"fastattn-sdpa-{tok}"
    lname = f"fastattn-lse-{tok}" if want_lse else None

    dsk: dict[Any, Any] = {}
    l_off, s_off = _offsets(l_chunks), _offsets(s_chunks)
    lead_off = [_offsets(c) for c in lead_chunks]
    h_off = _offsets(hq_chunks)
    Lb_all = np.full(lead, L, dtype=np.int64) if qlens is None else qlens
    Sb_all = np.full(lead, S, dtype=np.int64) if klens is None else klens
    for lidx in product(*[range(len(c)) for c in lead_chunks]):
        lsl = tuple(slice(*lead_off[d][lidx[d]]) for d in range(nlead))
        Lb, Sb = Lb_all[lsl], Sb_all[lsl]
        for hi_, (h0, h1) in enumerate(h_off):
            for li, (i0, i1) in enumerate(l_off):
                qidx = list(lidx) + [0, 0, 0]
                qidx[h_ax], qidx[s_ax] = hi_, li
                blk = tuple(qidx)
                parts = []
                for sj, (j0, j1) in enumerate(s_off):
                    if not _any_visible(i0, i1, j0, j1, Lb, Sb, causal, wl, wr):
                        continue
                    extra: dict[str, Any] = {}
                    if bm_full is not None:
                        assert bsz is not None
                        sl = [slice(None) if bm_full.shape[d] == 1 else lsl[d] for d in range(nlead)]
                        sl.append(slice(None) if bm_full.shape[nlead] == 1 else slice(h0, h1))
                        sl.append(
                            slice(None) if bm_full.shape[-2] == 1 else slice(i0 // bsz[0], -(-i1 // bsz[0]))
                        )
                        sl.append(
                            slice(None) if bm_full.shape[-1] == 1 else slice(j0 // bsz[1], -(-j1 // bsz[1]))
                        )
                        bmc = bm_full[tuple(sl)]
                        if not bmc.any():
                            continue
                        extra["bm"] = bmc
                    if alibi is not None:
                        extra["slopes"] = alibi[lsl + (slice(h0, h1),)]
                    if qlens is not None or klens is not None:
                        extra["qlens"] = None if qlens is None else qlens[lsl]
                        extra["klens"] = None if klens is None else klens[lsl]
                    kidx = list(lidx) + [0, 0, 0]
                    kidx[h_ax], kidx[s_ax] = hi_, sj
                    mkey = None
                    if m is not None:
                        midx = list(lidx) + [hi_, li, sj]
                        mkey = (m.name, *(0 if bc else ix for bc, ix in zip(mask_bcast, midx)))
                    pk = (pname, *blk, sj)
                    dsk[pk] = (
                        functools.partial(_part, geom=(i0, i1, j0, j1), opts=opts, **extra),
                        (q.name, *qidx),
                        (k.name, *kidx),
                        (v.name, *kidx),
                        mkey,
                    )
                    parts.append(pk)
                bshape = tuple(lead_chunks[d][lidx[d]] for d in range(nlead))
                if parts:
                    root = _tree(dsk, parts, mname, blk)
                else:
                    root = (ename, *blk)
                    dsk[root] = (
                        functools.partial(
                            _empty,
                            out_shape=bshape + (h1 - h0, i1 - i0, Dv),
                            lse_shape=bshape + (h1 - h0, i1 - i0),
                            dtype=cdt,
                        ),
                    )
                if sk is not None:
                    dead = None
                    if qlens is not None:
                        dead = (np.arange(i0, i1) >= qlens[lsl][..., None])[..., None, :]
                    fk = (fname, *blk)
                    dsk[fk] = (
                        functools.partial(_finish, sinks=sk[h0:h1], rows_dead=dead),
                        root,
                    )
                    root = fk
                dsk[(oname, *blk)] = (functools.partial(_final_out, dtype=q.dtype, layout=layout), root)
                if lname is not None:
                    dsk[(lname, *(tuple(lidx) + (hi_, li)))] = (_final_lse, root)

    deps = [q, k, v] + ([m] if m is not None else [])
    out, lse = _collections(
        dsk,
        deps,
        oname,
        lname,
        tuple(q.chunks[:-1]) + ((Dv,),),
        tuple(lead_chunks) + (hq_chunks, l_chunks),
        q.dtype,
        cdt,
    )
    if two_d:
        out = out[0]
        lse = None if lse is None else lse[0]
    if want_lse:
        assert lse is not None
        return out, lse
    return out


# --------------------------------------------------------------------------- varlen


def _vpart(
    q: NDArray,
    k: NDArray,
    v: NDArray,
    *,
    geom: tuple[int, int, int, int],
    cq: NDArray,
    ck: NDArray,
    slopes: NDArray | None,
    opts: dict[str, Any],
) -> State:
    """Packed query tokens [t0, t1) (q chunk (Tc, H, D)) over packed keys [u0, u1);
    ``cq``, ``ck``: the cu_seqlens entries of the sequences that meet both
    (sequence b: rows cq[b]:cq[b+1]), ``slopes`` their ALiBi slopes (n, H).
    Returns the (H, Tc, Dv) / (H, Tc) state."""
    t0, t1, u0, u1 = geom
    if q.dtype == F16 or is_bfloat16(q.dtype):
        q = q.astype(F32)
    cdt = F64 if q.dtype == F64 else F32
    Hc = q.shape[1]
    out = np.zeros((Hc, t1 - t0, v.shape[2]), dtype=cdt)
    lse = np.full((Hc, t1 - t0), -np.inf, dtype=cdt)
    n = cq.shape[0] - 1
    # Whole sequences (all their queries and keys in this pair) go to one in-memory varlen call,
    # whose per-sequence alignment is the global one; the (at most four) cut ones one by one.
    whole = (cq[:-1] >= t0) & (cq[1:] <= t1) & (ck[:-1] >= u0) & (ck[1:] <= u1)
    idx = np.flatnonzero(whole)
    if idx.size:
        b0, b1 = int(idx[0]), int(idx[-1]) + 1  # a contiguous run (both conditions are intervals of b)
        r0, r1, c0, c1 = int(cq[b0]) - t0, int(cq[b1]) - t0, int(ck[b0]) - u0, int(ck[b1]) - u0
        o, lw = _functional.varlen_attention(
            q[r0:r1],
            k[c0:c1],
            v[c0:c1],
            cq[b0 : b1 + 1] - cq[b0],
            ck[b0 : b1 + 1] - ck[b0],
            is_causal=opts["causal"],
            scale=opts["scale"],
            enable_gqa=opts["gqa"],
            window=None if opts["wl"] < 0 and opts["wr"] < 0 else (opts["wl"], opts["wr"]),
            alibi_slopes=None if slopes is None else slopes[b0:b1],
            softcap=opts["softcap"],
            return_lse=True,
            num_threads=opts["threads"],
            precision=opts["precision"],
        )
        out[:, r0:r1] = np.swapaxes(o, 0, 1)
        lse[:, r0:r1] = lw
    for b in range(n):
        if whole[b]:
            continue
        rs, re_ = max(int(cq[b]), t0), min(int(cq[b + 1]), t1)
        ks, ke = max(int(ck[b]), u0), min(int(ck[b + 1]), u1)
        if rs >= re_ or ks >= ke:
            continue
        Lb, Sb = int(cq[b + 1] - cq[b]), int(ck[b + 1] - ck[b])
        i0, j0 = rs - int(cq[b]), ks - int(ck[b])  # positions inside the sequence
        st = _piece(
            np.swapaxes(q[rs - t0 : re_ - t0], 0, 1),
            np.swapaxes(k[ks - u0 : ke - u0], 0, 1),
            np.swapaxes(v[ks - u0 : ke - u0], 0, 1),
            None,
            None,
            None if slopes is None else slopes[b],
            (j0 - i0) - (Sb - Lb),
            opts,
        )
        if st is not None:
            out[:, rs - t0 : re_ - t0], lse[:, rs - t0 : re_ - t0] = st
    return out, lse


def _vfinal_out(state: State, *, dtype: np.dtype[Any]) -> NDArray:
    return np.swapaxes(state[0], 0, 1).astype(dtype, copy=False)


@overload
def varlen_attention(
    q: da.Array | NDArray,
    k: da.Array | NDArray,
    v: da.Array | NDArray,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    return_lse: Literal[False] = False,
    num_threads: int | None = None,
    precision: str | None = None,
) -> da.Array: ...


@overload
def varlen_attention(
    q: da.Array | NDArray,
    k: da.Array | NDArray,
    v: da.Array | NDArray,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    return_lse: Literal[True],
    num_threads: int | None = None,
    precision: str | None = None,
) -> tuple[da.Array, da.Array]: ...


def varlen_attention(
    q: da.Array | NDArray,
    k: da.Array | NDArray,
    v: da.Array | NDArray,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    return_lse: bool = False,
    num_threads: int | None = None,
    precision: str | None = None,
) -> da.Array | tuple[da.Array, da.Array]:
    """Lazy :func:`fastattn.varlen_attention` over Dask arrays: packed sequences,
    q ``(Tq, Hq, D)``, k ``(Tk, Hk, D)``, v ``(Tk, Hk, Dv)`` chunked along the
    tokens and heads (heads aligned as in :func:`scaled_dot_product_attention`;
    key tokens the common refinement of k and v; D, Dv single chunks), the
    ``cu_seqlens`` as NumPy array-likes.

    Each (query token chunk, key token chunk) pair that shares a sequence runs
    one task: the sequences it holds whole go to one in-memory varlen call, the
    sequences cut by a chunk boundary are computed with their global positions
    (as in :func:`scaled_dot_product_attention`).  Pairs that share no sequence,
    or whose shared sequences see nothing of each other under ``is_causal`` /
    ``window``, get no task.  Returns ``(Tq, Hq, Dv)`` and, with ``return_lse``,
    ``(Hq, Tq)``; the same argument errors as the in-memory function, raised here.
    """
    # The in-memory function's checks, in its order, from fastattn._args.
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
    qa, ka, va = _as_dask(q, "q"), _as_dask(k, "k"), _as_dask(v, "v")
    _args.check_dtypes(qa, ka, va, ("q", "k", "v"))
    for a, nm in ((qa, "q"), (ka, "k"), (va, "v")):
        if a.ndim != 3:
            raise ValueError(f"{nm} must be 3-D (total_tokens, heads, head_dim), got shape {a.shape}")
    Tq, Hq, D = qa.shape
    Tk, Hk, Dk = ka.shape
    if va.shape[:2] != (Tk, Hk):
        raise ValueError(f"k and v must have the same tokens and heads, got {ka.shape} and {va.shape}")
    Dv = va.shape[2]
    if D != Dk:
        raise ValueError(f"q and k must have the same head dim, got {D} and {Dk}")
    if D == 0 or Dv == 0:
        raise ValueError("head dims of q, k and v must be >= 1")
    if Hq != Hk:
        _args.check_heads(Hq, Hk, enable_gqa, "q", "k/v")
    cq = _args.cu_seqlens_value(cu_seqlens_q, "cu_seqlens_q", Tq)
    ck = _args.cu_seqlens_value(cu_seqlens_k, "cu_seqlens_k", Tk)
    if cq.shape != ck.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cq.shape[0]} and {ck.shape[0]}"
        )
    nb = cq.shape[0] - 1
    prec = _precision(precision)
    cdt = _args.compute_dtype(qa.dtype)
    sc = scale_value(scale, D, cdt)
    if num_threads is not None:
        threads_value(num_threads, lambda: 1)
    wl, wr = _args.window_value(window)
    cap = _args.softcap_value(softcap)
    alibi = None if alibi_slopes is None else _args.per_head(alibi_slopes, "alibi_slopes", (nb,), Hq, True)
    sk = _args.sinks_value(sinks, Hq)

    G = Hq // Hk if Hk else 1
    qb = {(b // G) * G for b in _bounds(qa.chunks[1])} | {Hq}
    hq_chunks = _chunks_from_bounds(qb | _bounds(ka.chunks[1], G) | _bounds(va.chunks[1], G))
    hk_chunks = tuple(c // G for c in hq_chunks)
    tq_chunks = tuple(qa.chunks[0])
    tk_chunks = _refine(ka.chunks[0], va.chunks[0])
    qa = _rechunk(qa, (tq_chunks, hq_chunks, (D,)))
    ka = _rechunk(ka, (tk_chunks, hk_chunks, (D,)))
    va = _rechunk(va, (tk_chunks, hk_chunks, (Dv,)))

    opts: dict[str, Any] = dict(
        scale=sc,
        gqa=G != 1,
        threads=num_threads,
        causal=causal,
        wl=wl,
        wr=wr,
        softcap=softcap if softcap is None else cap,
        block_size=None,
        precision=prec,
    )
    tok = tokenize(
        qa.name, ka.name, va.name, cq, ck, causal, sc, G, wl, wr, cap, alibi, sk, num_threads, prec, want_lse
    )
    pname, mname, ename = f"fastattn-part-{tok}", f"fastattn-merge-{tok}", f"fastattn-empty-{tok}"
    fname, oname = f"fastattn-finish-{tok}", f"fastattn-varlen-{tok}"
    lname = f"fastattn-lse-{tok}" if want_lse else None
    Lseq, Sseq = np.diff(cq), np.diff(ck)
    u_off = _offsets(tk_chunks)
    u_starts = np.array([u for u, _ in u_off], dtype=np.int64)
    dsk: dict[Any, Any] = {}
    hi_t = 0 if causal else wr  # bound on j - i' (-1: none)
    for ti, (t0, t1) in enumerate(_offsets(tq_chunks)):
        # sequences with query rows in [t0, t1): a contiguous range [b_lo, b_hi)
        b_lo = max(int(np.searchsorted(cq, t0, side="right")) - 1, 0)
        b_hi = min(max(int(np.searchsorted(cq, t1, side="left")), b_lo), nb)
        pairs: list[tuple[int, int, int]] = []  # (key chunk, first and last + 1 sequence it needs)
        if b_hi > b_lo and t1 > t0:
            bs = np.arange(b_lo, b_hi)
            k_hi = int(ck[b_hi])
            first = max(int(np.searchsorted(u_starts, int(ck[b_lo]), side="right")) - 1, 0)
            for uj in range(first, len(u_off)):
                u0, u1 = u_off[uj]
                if u0 >= k_hi:
                    break
                # per sequence: this pair's rows [r0, r1) and keys [c0, c1), positions inside the sequence
                r0 = np.maximum(cq[bs], t0) - cq[bs]
                r1 = np.minimum(cq[bs + 1], t1) - cq[bs]
                c0 = np.maximum(ck[bs], u0) - ck[bs]
                c1 = np.minimum(ck[bs + 1], u1) - ck[bs]
                ok = (r1 > r0) & (c1 > c0)
                diag = Sseq[bs] - Lseq[bs]  # j - i on each sequence's bottom-right diagonal
                if hi_t >= 0:  # (as in _any_visible: no diag + bound, which could wrap around)
                    ok &= c0 - (r1 - 1) - diag <= hi_t
                if wl >= 0:
                    ok &= (c1 - 1) - r0 - diag >= -wl
                kept = np.flatnonzero(ok)
                if kept.size:
                    pairs.append((uj, b_lo + int(kept[0]), b_lo + int(kept[-1]) + 1))
        for hi_, (h0, h1) in enumerate(_offsets(hq_chunks)):
            blk = (ti, hi_, 0)
            parts = []
            # Each task gets the cu_seqlens entries of the run of sequences from the first to the
            # last one it needs (any between them that see nothing are skipped in the task).
            for uj, s_lo, s_hi in pairs:
                u0, u1 = u_off[uj]
                pk = (pname, *blk, uj)
                dsk[pk] = (
                    functools.partial(
                        _vpart,
                        geom=(t0, t1, u0, u1),
                        cq=cq[s_lo : s_hi + 1],
                        ck=ck[s_lo : s_hi + 1],
                        slopes=None if alibi is None else alibi[s_lo:s_hi, h0:h1],
                        opts=opts,
                    ),
                    (qa.name, ti, hi_, 0),
                    (ka.name, uj, hi_, 0),
                    (va.name, uj, hi_, 0),
                )
                parts.append(pk)
            if parts:
                root = _tree(dsk, parts, mname, blk)
            else:
                root = (ename, *blk)
                dsk[root] = (
                    functools.partial(
                        _empty, out_shape=(h1 - h0, t1 - t0, Dv), lse_shape=(h1 - h0, t1 - t0), dtype=cdt
                    ),
                )
            if sk is not None:
                fk = (fname, *blk)
                dsk[fk] = (functools.partial(_finish, sinks=sk[h0:h1], rows_dead=None), root)
                root = fk
            dsk[(oname, *blk)] = (functools.partial(_vfinal_out, dtype=qa.dtype), root)
            if lname is not None:
                dsk[(lname, hi_, ti)] = (_final_lse, root)
    out, lse = _collections(
        dsk, [qa, ka, va], oname, lname, (tq_chunks, hq_chunks, (Dv,)), (hq_chunks, tq_chunks), qa.dtype, cdt
    )
    if want_lse:
        assert lse is not None
        return out, lse
    return out
