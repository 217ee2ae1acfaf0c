"""fastattn.dask.scaled_dot_product_attention: the chunk-pair graph of a
batched attention call."""

from __future__ import annotations

import functools
from itertools import product
from typing import Any, Literal, overload

import dask.array as da
import numpy as np
import numpy.typing as npt
from dask.base import tokenize

from .. import _args
from .._checks import (
    flag_value,
    is_bfloat16,
    scale_value,
    threads_value,
)
from . import _alibi, _geometry, _graph
from ._geometry import NDArray


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

    Parameters
    ----------
    query, key, value : dask.array.Array or ndarray
        As for :func:`fastattn.scaled_dot_product_attention`, chunked.
    attn_mask : dask.array.Array or ndarray, optional
        Bool (True = may attend) or float (added), broadcastable to ``(..., Hq, L, S)``.
    is_causal, scale, enable_gqa, layout, window : optional
        As for :func:`fastattn.scaled_dot_product_attention`.
    alibi_slopes, softcap, sinks, key_lengths, query_lengths : optional
        As for :func:`fastattn.scaled_dot_product_attention` (NumPy array-likes).
    block_mask, block_size, precision : optional
        As for :func:`fastattn.scaled_dot_product_attention`.
    return_lse : bool, default False
        Also return the log-sum-exp ``(..., Hq, L)``.
    num_threads : int, optional
        Threads of each chunk task; None: ``fastattn.get_num_threads()`` on the worker.

    Returns
    -------
    out : dask.array.Array
        The lazy output, shaped as the in-memory one.
    lse : dask.array.Array
        Only with ``return_lse=True``.

    Examples
    --------
    Needs dask.

    >>> import dask.array as da  # doctest: +SKIP
    >>> import fastattn.dask  # doctest: +SKIP
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 64, 16)).astype(np.float32)
    >>> dq, dk, dv = (da.from_array(a, chunks=(1, 16, 16)) for a in (q, k, v))  # doctest: +SKIP
    >>> out = fastattn.dask.scaled_dot_product_attention(dq, dk, dv, is_causal=True)  # doctest: +SKIP
    >>> ref = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> bool(np.allclose(out.compute(), ref, atol=1e-5))  # doctest: +SKIP
    True
    """
    # The in-memory function's checks, in its order, from fastattn._args (the shape and dtype
    # checks read only .shape, .ndim and .dtype, so they take the Dask arrays as they are).
    prec = _graph.precision(precision)
    layout = _args.layout_value(layout)
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
    q = _graph.as_dask(query, "query")
    k = _graph.as_dask(key, "key")
    v = _graph.as_dask(value, "value")
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
        m = _graph.as_dask(attn_mask, "attn_mask")
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
    lead_chunks = [_geometry.refine(q.chunks[d], k.chunks[d], v.chunks[d]) for d in range(nlead)]
    qb = {(b // G) * G for b in _geometry.bounds(q.chunks[h_ax])} | {Hq}
    hq_bounds = qb | _geometry.bounds(k.chunks[h_ax], G) | _geometry.bounds(v.chunks[h_ax], G)
    hq_chunks = _geometry.chunks_from_bounds(hq_bounds)
    hk_chunks = tuple(c // G for c in hq_chunks)
    l_chunks = tuple(q.chunks[s_ax])
    s_chunks = _geometry.refine(k.chunks[s_ax], v.chunks[s_ax])
    if bsz is not None:  # whole blocks per chunk: a chunk's block grid is a slice of the global one
        l_chunks, s_chunks = _geometry.round_to(l_chunks, bsz[0]), _geometry.round_to(s_chunks, bsz[1])

    def layout_chunks(h: tuple[int, ...], s: tuple[int, ...], last: int) -> list[tuple[int, ...]]:
        c: list[tuple[int, ...]] = list(lead_chunks) + [(), (), (last,)]
        c[h_ax], c[s_ax] = h, s
        return c

    q = _graph.rechunk(q, layout_chunks(hq_chunks, l_chunks, D))
    k = _graph.rechunk(k, layout_chunks(hk_chunks, s_chunks, D))
    v = _graph.rechunk(v, layout_chunks(hk_chunks, s_chunks, Dv))

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
        m = _graph.rechunk(m, mchunks)

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
    l_off, s_off = _geometry.offsets(l_chunks), _geometry.offsets(s_chunks)
    lead_off = [_geometry.offsets(c) for c in lead_chunks]
    h_off = _geometry.offsets(hq_chunks)
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
                    if not _geometry.any_visible(i0, i1, j0, j1, Lb, Sb, causal, wl, wr):
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
                        functools.partial(_alibi.part, geom=(i0, i1, j0, j1), opts=opts, **extra),
                        (q.name, *qidx),
                        (k.name, *kidx),
                        (v.name, *kidx),
                        mkey,
                    )
                    parts.append(pk)
                bshape = tuple(lead_chunks[d][lidx[d]] for d in range(nlead))
                if parts:
                    root = _graph.tree(dsk, parts, mname, blk)
                else:
                    root = (ename, *blk)
                    dsk[root] = (
                        functools.partial(
                            _graph.empty,
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
                        functools.partial(_graph.finish, sinks=sk[h0:h1], rows_dead=dead),
                        root,
                    )
                    root = fk
                dsk[(oname, *blk)] = (functools.partial(_graph.final_out, dtype=q.dtype, layout=layout), root)
                if lname is not None:
                    dsk[(lname, *(tuple(lidx) + (hi_, li)))] = (_graph.final_lse, root)

    deps = [q, k, v] + ([m] if m is not None else [])
    out, lse = _graph.collections(
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
