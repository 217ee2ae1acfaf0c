"""fastattn.dask.varlen_attention: the chunk-pair graph of a packed
variable-length batch."""

from __future__ import annotations

import functools
from typing import Any, Literal, overload

import dask.array as da
import numpy as np
import numpy.typing as npt
from dask.base import tokenize

from .. import _args
from .. import functional as _functional
from .._checks import (
    F16,
    F32,
    F64,
    flag_value,
    is_bfloat16,
    scale_value,
    threads_value,
)
from . import _alibi, _geometry, _graph
from ._geometry import NDArray, State


def vpart(
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
        st = _alibi.piece(
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


def vfinal_out(state: State, *, dtype: np.dtype[Any]) -> NDArray:
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

    Parameters
    ----------
    q, k, v : dask.array.Array or ndarray
        ``(Tq, Hq, D)``, ``(Tk, Hk, D)``, ``(Tk, Hk, Dv)`` packed sequences, chunked.
    cu_seqlens_q, cu_seqlens_k : array_like of int
        ``(batch + 1,)`` offsets of the sequences (NumPy array-likes).
    is_causal, scale, enable_gqa, window, alibi_slopes, softcap, sinks, precision : optional
        As for :func:`fastattn.varlen_attention`.
    return_lse : bool, default False
        Also return the log-sum-exp ``(Hq, Tq)``.
    num_threads : int, optional
        Threads of each chunk task; None: ``fastattn.get_num_threads()`` on the worker.

    Returns
    -------
    out : dask.array.Array
        ``(Tq, Hq, Dv)``, lazy.
    lse : dask.array.Array
        ``(Hq, Tq)``; only with ``return_lse=True``.

    Examples
    --------
    Needs dask.

    >>> import dask.array as da  # doctest: +SKIP
    >>> import fastattn.dask  # doctest: +SKIP
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 40, 2, 8)).astype(np.float32)
    >>> cu = np.array([0, 15, 40])
    >>> dq, dk, dv = (da.from_array(a, chunks=(10, 2, 8)) for a in (q, k, v))  # doctest: +SKIP
    >>> out = fastattn.dask.varlen_attention(dq, dk, dv, cu, cu, is_causal=True)  # doctest: +SKIP
    >>> ref = fastattn.varlen_attention(q, k, v, cu, cu, is_causal=True)
    >>> bool(np.allclose(out.compute(), ref, atol=1e-5))  # doctest: +SKIP
    True
    """
    # The in-memory function's checks, in its order, from fastattn._args.
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
    qa, ka, va = _graph.as_dask(q, "q"), _graph.as_dask(k, "k"), _graph.as_dask(v, "v")
    Tq, Hq, D, Tk, Hk, Dv, cq, ck = _args.varlen_geometry(qa, ka, va, enable_gqa, cu_seqlens_q, cu_seqlens_k)
    nb = cq.shape[0] - 1
    prec = _graph.precision(precision)
    cdt = _args.compute_dtype(qa.dtype)
    sc = scale_value(scale, D, cdt)
    if num_threads is not None:
        threads_value(num_threads, lambda: 1)
    wl, wr = _args.window_value(window)
    cap = _args.softcap_value(softcap)
    alibi = None if alibi_slopes is None else _args.per_head(alibi_slopes, "alibi_slopes", (nb,), Hq, True)
    sk = _args.sinks_value(sinks, Hq)

    G = Hq // Hk if Hk else 1
    qb = {(b // G) * G for b in _geometry.bounds(qa.chunks[1])} | {Hq}
    hq_chunks = _geometry.chunks_from_bounds(
        qb | _geometry.bounds(ka.chunks[1], G) | _geometry.bounds(va.chunks[1], G)
    )
    hk_chunks = tuple(c // G for c in hq_chunks)
    tq_chunks = tuple(qa.chunks[0])
    tk_chunks = _geometry.refine(ka.chunks[0], va.chunks[0])
    qa = _graph.rechunk(qa, (tq_chunks, hq_chunks, (D,)))
    ka = _graph.rechunk(ka, (tk_chunks, hk_chunks, (D,)))
    va = _graph.rechunk(va, (tk_chunks, hk_chunks, (Dv,)))

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
    u_off = _geometry.offsets(tk_chunks)
    u_starts = np.array([u for u, _ in u_off], dtype=np.int64)
    dsk: dict[Any, Any] = {}
    hi_t = 0 if causal else wr  # bound on j - i' (-1: none)
    for ti, (t0, t1) in enumerate(_geometry.offsets(tq_chunks)):
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
                if hi_t >= 0:  # (as in _geometry.any_visible: no diag + bound, which could wrap around)
                    ok &= c0 - (r1 - 1) - diag <= hi_t
                if wl >= 0:
                    ok &= (c1 - 1) - r0 - diag >= -wl
                kept = np.flatnonzero(ok)
                if kept.size:
                    pairs.append((uj, b_lo + int(kept[0]), b_lo + int(kept[-1]) + 1))
        for hi_, (h0, h1) in enumerate(_geometry.offsets(hq_chunks)):
            blk = (ti, hi_, 0)
            parts = []
            # Each task gets the cu_seqlens entries of the run of sequences from the first to the
            # last one it needs (any between them that see nothing are skipped in the task).
            for uj, s_lo, s_hi in pairs:
                u0, u1 = u_off[uj]
                pk = (pname, *blk, uj)
                dsk[pk] = (
                    functools.partial(
                        vpart,
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
                root = _graph.tree(dsk, parts, mname, blk)
            else:
                root = (ename, *blk)
                dsk[root] = (
                    functools.partial(
                        _graph.empty,
                        out_shape=(h1 - h0, t1 - t0, Dv),
                        lse_shape=(h1 - h0, t1 - t0),
                        dtype=cdt,
                    ),
                )
            if sk is not None:
                fk = (fname, *blk)
                dsk[fk] = (functools.partial(_graph.finish, sinks=sk[h0:h1], rows_dead=None), root)
                root = fk
            dsk[(oname, *blk)] = (functools.partial(vfinal_out, dtype=qa.dtype), root)
            if lname is not None:
                dsk[(lname, hi_, ti)] = (_graph.final_lse, root)
    out, lse = _graph.collections(
        dsk, [qa, ka, va], oname, lname, (tq_chunks, hq_chunks, (Dv,)), (hq_chunks, tq_chunks), qa.dtype, cdt
    )
    if want_lse:
        assert lse is not None
        return out, lse
    return out
