"""Exact attention over Dask arrays, sharded along batch, heads, queries and keys.

Import it explicitly (``import fastattn.dask``); ``import fastattn`` never
imports Dask.  Needs the ``dask`` extra (``pip install fastattn[dask]``).

Every (query chunk, key chunk) pair runs the in-memory
:func:`fastattn.scaled_dot_product_attention` with ``return_lse=True`` in one
task; the partial results of a query chunk are combined with
:func:`fastattn.merge_attention_states` in a binary tree (pairs, then pairs of
pairs), so no task holds more than one query chunk, one key/value chunk and
two partial outputs.  Under ``is_causal`` or a ``window``, key chunks that no
query of a query chunk can see get no task at all.

Chunking rules (the rechunks are lazy and happen only where needed):

* batch dims: the common refinement of the chunk boundaries of query, key,
  value (every boundary of any of them is a boundary of all);
* query heads: the common refinement of the query's head boundaries and the
  key/value head boundaries times ``G = Hq // Hk``, after rounding the
  query's boundaries down to whole groups (multiples of ``G``); key/value head
  chunks are then the query head chunks divided by ``G``, so each query head
  chunk reads exactly one key/value head chunk;
* query length L: the query's chunks; key length S: the common refinement of
  key and value chunks;
* the head dims D and Dv are made single chunks;
* ``attn_mask`` is rechunked to match; its broadcast (size-1) dims stay
  size 1, so a ``(L, S)`` mask is never expanded over batch or heads.

NumPy inputs are wrapped with ``dask.array.from_array`` as a single chunk
(then refined as above).
"""

from __future__ import annotations

import functools
import math
from itertools import product

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from . import functional as _functional
from ._checks import BFLOAT16, F16, F32, F64, scale_value, threads_value
from .merge import merge_attention_states

__all__ = ["scaled_dot_product_attention"]


# --------------------------------------------------------------------------- helpers run in tasks


def _to_bhsd(a, layout):
    """(…, L, H, X) -> (…, H, L, X) view for bshd; identity for bhsd."""
    return np.swapaxes(a, -2, -3) if layout == "bshd" else a


def _part(q, k, v, m, *, geom, opts):
    """Attention of one query chunk over one key chunk; returns (out, lse).

    ``geom = (i0, i1, j0, j1, lo, hi, kind)``: the chunk's global query rows
    [i0, i1) and keys [j0, j1); query i may see key j when
    ``lo <= j - i <= hi`` (None = unbounded); kind is "full" or "partial".
    """
    i0, i1, j0, j1, lo, hi, kind = geom
    if q.dtype in (F16, BFLOAT16):  # partial results in float32, cast once at the end
        q = q.astype(F32)
    window = None
    if kind == "partial":
        Lc, Sc = i1 - i0, j1 - j0
        window = _chunk_window(i0, i1, j0, j1, lo, hi)
        if window is None:  # not expressible as a window of the chunk: explicit boolean mask of Lc x Sc
            dj = np.arange(j0, j1)[None, :] - np.arange(i0, i1)[:, None]
            vis = np.ones((Lc, Sc), dtype=bool)
            if lo is not None:
                vis &= dj >= lo
            if hi is not None:
                vis &= dj <= hi
            if m is None:
                m = vis
            elif m.dtype == np.bool_:
                m = np.logical_and(m, vis)
            else:
                if m.dtype not in (F32, F64):
                    m = m.astype(F64 if q.dtype == F64 else F32)
                m = np.where(vis, m, np.array(-np.inf, dtype=m.dtype))
    return _functional.scaled_dot_product_attention(
        q,
        k,
        v,
        m,
        scale=opts["scale"],
        enable_gqa=opts["gqa"],
        layout=opts["layout"],
        return_lse=True,
        window=window,
        num_threads=opts["threads"],
    )


def _chunk_window(i0, i1, j0, j1, lo, hi):
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


def _merge2(a, b, *, layout):
    """Merge two (out, lse) partial states over disjoint key sets."""
    o, lse = merge_attention_states([_to_bhsd(a[0], layout), _to_bhsd(b[0], layout)], [a[1], b[1]])
    return _to_bhsd(o, layout), lse


def _empty(*, out_shape, lse_shape, dtype):
    """State of a query chunk that sees no key: zeros and -inf."""
    return np.zeros(out_shape, dtype=dtype), np.full(lse_shape, -np.inf, dtype=dtype)


def _final_out(state, *, dtype):
    return state[0].astype(dtype, copy=False)


def _final_lse(state):
    return state[1]


# --------------------------------------------------------------------------- graph-time helpers


def _as_dask(x, name):
    if isinstance(x, da.Array):
        a = x
    elif isinstance(x, np.ndarray):
        a = da.from_array(x, chunks=x.shape if x.ndim else (), asarray=True)
    else:
        raise TypeError(f"{name} must be a dask.array.Array or a numpy.ndarray, got {type(x).__name__}")
    if any(math.isnan(c) for cs in a.chunks for c in cs):
        raise ValueError(f"{name} has unknown chunk sizes; call {name}.compute_chunk_sizes() first")
    if not isinstance(a._meta, np.ndarray):
        raise TypeError(f"{name} must hold NumPy chunks, got chunks of type {type(a._meta).__name__}")
    return a


def _bounds(chunks, mult=1):
    return set(
        np.cumsum((0,) + tuple(chunks)).tolist()
        if mult == 1
        else (np.cumsum((0,) + tuple(chunks)) * mult).tolist()
    )


def _chunks_from_bounds(bounds):
    b = sorted(bounds)
    return tuple(int(y - x) for x, y in zip(b[:-1], b[1:])) if len(b) > 1 else (0,)


def _refine(*chunk_tuples):
    """Common refinement of several chunkings of one dimension."""
    bs = set()
    for c in chunk_tuples:
        bs |= _bounds(c)
    return _chunks_from_bounds(bs)


def _rechunk(a, chunks):
    chunks = tuple(tuple(c) for c in chunks)
    return a if tuple(a.chunks) == chunks else a.rechunk(chunks)


def _offsets(chunks):
    o = np.cumsum((0,) + tuple(chunks)).tolist()
    return list(zip(o[:-1], o[1:]))


def _visibility(i0, i1, j0, j1, lo, hi):
    """'none', 'full' or 'partial' for query rows [i0, i1) and keys [j0, j1)."""
    if i1 <= i0 or j1 <= j0:
        return "none"
    dmin, dmax = j0 - (i1 - 1), (j1 - 1) - i0
    if (hi is not None and dmin > hi) or (lo is not None and dmax < lo):
        return "none"
    if (hi is None or dmax <= hi) and (lo is None or dmin >= lo):
        return "full"
    return "partial"


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    *,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    layout="bhsd",
    return_lse=False,
    window=None,
    num_threads=None,
):
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
    num_threads: threads of each chunk task (None: ``fastattn.get_num_threads()``
        on the worker).  With several Dask threads per worker, 1 avoids
        oversubscription.
    return_lse: also return the log-sum-exp, ``(..., Hq, L)``, float32
        (float64 for float64 inputs).

    Returns a lazy ``dask.array.Array`` (and the LSE array): nothing runs until
    it is computed.  Partial results are float32 (float64 for float64 inputs),
    so the result is exact up to float32 rounding of the merge.  Argument
    errors raise ``TypeError``/``ValueError`` here, before any task runs.
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    q = _as_dask(query, "query")
    k = _as_dask(key, "key")
    v = _as_dask(value, "value")
    _functional._check_dtypes(q, k, v)
    # the in-memory function's shape checks (they read only .ndim and .shape)
    lead, (Hq, L, D), (Hk, S, Dv) = _functional._check_shapes(q, k, v, layout, enable_gqa)
    two_d = q.ndim == 2
    if two_d:  # one head: work on (1, L, D)
        q, k, v = q[None], k[None], v[None]
    nd = q.ndim
    nlead = nd - 3
    h_ax, s_ax = (nd - 3, nd - 2) if layout == "bhsd" else (nd - 2, nd - 3)
    G = Hq // Hk if Hk else 1
    sc = scale_value(scale, D, F64 if q.dtype == F64 else F32)
    if num_threads is not None:
        threads_value(num_threads, lambda: 1)
    wl, wr = _functional._window(window)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")

    # ---- chunk alignment
    lead_chunks = [_refine(q.chunks[d], k.chunks[d], v.chunks[d]) for d in range(nlead)]
    qb = {(b // G) * G for b in _bounds(q.chunks[h_ax])} | {Hq}
    hq_bounds = qb | _bounds(k.chunks[h_ax], G) | _bounds(v.chunks[h_ax], G)
    hq_chunks = _chunks_from_bounds(hq_bounds)
    hk_chunks = tuple(c // G for c in hq_chunks)
    l_chunks = tuple(q.chunks[s_ax])
    s_chunks = _refine(k.chunks[s_ax], v.chunks[s_ax])

    def layout_chunks(h, s, last):
        c = list(lead_chunks) + [None, None, (last,)]
        c[h_ax], c[s_ax] = h, s
        return c

    q = _rechunk(q, layout_chunks(hq_chunks, l_chunks, D))
    k = _rechunk(k, layout_chunks(hk_chunks, s_chunks, D))
    v = _rechunk(v, layout_chunks(hk_chunks, s_chunks, Dv))

    m = None
    mask_bcast = None
    if attn_mask is not None:
        m = _as_dask(attn_mask, "attn_mask")
        if not (m.dtype == np.bool_ or m.dtype.kind == "f" or m.dtype == BFLOAT16):
            raise TypeError(f"attn_mask must be bool or floating, got dtype {m.dtype}")
        full = lead + (Hq, L, S)
        if m.ndim > len(full):
            raise ValueError(
                f"attn_mask of shape {attn_mask.shape} does not broadcast to {(full[1:] if two_d else full)}"
            )
        if m.ndim < len(full):
            m = m[(None,) * (len(full) - m.ndim)]
        target = list(lead_chunks) + [hq_chunks, l_chunks, s_chunks]
        mask_bcast = []
        mchunks = []
        for d, (ms, fs) in enumerate(zip(m.shape, full)):
            if ms == fs and not (ms == 1 and len(m.chunks[d]) == 1):
                mask_bcast.append(False)
                mchunks.append(target[d])
            elif ms == 1:
                mask_bcast.append(True)
                mchunks.append((1,))
            else:
                raise ValueError(
                    f"attn_mask of shape {attn_mask.shape} does not broadcast to "
                    f"{(full[1:] if two_d else full)}"
                )
        m = _rechunk(m, mchunks)

    # ---- visibility bounds on j - i
    wr_eff = 0 if is_causal else wr
    lo = None if wl < 0 else S - L - wl
    hi = None if wr_eff < 0 else S - L + wr_eff

    cdt = F64 if q.dtype == F64 else F32
    opts = dict(scale=sc, gqa=G != 1, layout=layout, threads=num_threads)
    part_fn = functools.partial(_part, opts=opts)
    merge_fn = functools.partial(_merge2, layout=layout)
    tok = tokenize(
        q.name,
        k.name,
        v.name,
        None if m is None else m.name,
        is_causal,
        sc,
        G,
        layout,
        wl,
        wr,
        num_threads,
        return_lse,
    )
    pname, mname, ename = f"fastattn-part-{tok}", f"fastattn-merge-{tok}", f"fastattn-empty-{tok}"
    oname, lname = f"fastattn-sdpa-{tok}", f"fastattn-lse-{tok}"

    dsk = {}
    l_off, s_off = _offsets(l_chunks), _offsets(s_chunks)
    n_parts = 0
    for lidx in product(*[range(len(c)) for c in lead_chunks]):
        for hi_ in range(len(hq_chunks)):
            for li, (i0, i1) in enumerate(l_off):
                qidx = list(lidx) + [0, 0, 0]
                qidx[h_ax], qidx[s_ax] = hi_, li
                qkey = (q.name, *qidx)
                blk = tuple(qidx)
                parts = []
                for sj, (j0, j1) in enumerate(s_off):
                    kind = _visibility(i0, i1, j0, j1, lo, hi)
                    if kind == "none":
                        continue
                    kidx = list(lidx) + [0, 0, 0]
                    kidx[h_ax], kidx[s_ax] = hi_, sj
                    mkey = None
                    if m is not None:
                        midx = list(lidx) + [hi_, li, sj]
                        mkey = (m.name, *(0 if bc else ix for bc, ix in zip(mask_bcast, midx)))
                    pk = (pname, *blk, sj)
                    dsk[pk] = (
                        functools.partial(part_fn, geom=(i0, i1, j0, j1, lo, hi, kind)),
                        qkey,
                        (k.name, *kidx),
                        (v.name, *kidx),
                        mkey,
                    )
                    parts.append(pk)
                n_parts += len(parts)
                if not parts:
                    oshape = [lead_chunks[d][lidx[d]] for d in range(nlead)] + [0, 0, Dv]
                    oshape[h_ax], oshape[s_ax] = hq_chunks[hi_], i1 - i0
                    lshape = tuple(oshape[:nlead]) + (hq_chunks[hi_], i1 - i0)
                    root = (ename, *blk)
                    dsk[root] = (
                        functools.partial(_empty, out_shape=tuple(oshape), lse_shape=lshape, dtype=cdt),
                    )
                else:
                    level = 0
                    while len(parts) > 1:
                        nxt = []
                        for p in range(0, len(parts) - 1, 2):
                            mk = (mname, *blk, level, p // 2)
                            dsk[mk] = (merge_fn, parts[p], parts[p + 1])
                            nxt.append(mk)
                        if len(parts) % 2:
                            nxt.append(parts[-1])
                        parts, level = nxt, level + 1
                    root = parts[0]
                dsk[(oname, *blk)] = (functools.partial(_final_out, dtype=q.dtype), root)
                if return_lse:
                    dsk[(lname, *(tuple(lidx) + (hi_, li)))] = (_final_lse, root)

    deps = [q, k, v] + ([m] if m is not None else [])
    out_chunks = tuple(q.chunks[:-1]) + ((Dv,),)
    if return_lse:
        out_keys = {kk: vv for kk, vv in dsk.items() if kk[0] != lname}
        lse_keys = {kk: vv for kk, vv in dsk.items() if kk[0] == lname}
        g_in = HighLevelGraph.from_collections(oname, out_keys, dependencies=deps)
        inner = da.Array(
            g_in, oname, chunks=out_chunks, dtype=q.dtype, meta=np.empty((0,) * nd, dtype=q.dtype)
        )
        # The LSE layer depends on the roots inside the output layer.
        g_l = HighLevelGraph.from_collections(lname, lse_keys, dependencies=[inner])
        lse = da.Array(
            g_l,
            lname,
            chunks=tuple(lead_chunks) + (hq_chunks, l_chunks),
            dtype=cdt,
            meta=np.empty((0,) * (nlead + 2), dtype=cdt),
        )
        out = inner
    else:
        g = HighLevelGraph.from_collections(oname, dsk, dependencies=deps)
        out = da.Array(g, oname, chunks=out_chunks, dtype=q.dtype, meta=np.empty((0,) * nd, dtype=q.dtype))
        lse = None
    if two_d:
        out = out[0]
        lse = None if lse is None else lse[0]
    return (out, lse) if return_lse else out
