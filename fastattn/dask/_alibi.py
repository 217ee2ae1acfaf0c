"""The chunk pair's call when ALiBi cannot be the kernel's own (the trimmed call's
alignment is not the global one): split at the diagonal ``t = 0`` into rows of
``ALIBI_ROWS`` (see the package docstring), and the task that runs a pair."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._checks import (
    F16,
    F32,
    F64,
    is_bfloat16,
)
from ..merge import merge_attention_states
from . import _chunk, _geometry
from ._geometry import Bound, NDArray, State

# Rows per call of the split ALiBi (the package docstring): its per-key bias on a row's keys nearest the
# diagonal grows with the rows of the call (slope * rows), and so does the float32 rounding of those
# logits; 64 rows keep it within a few float32 ulps of 1 for slopes <= 1, at one call per 64 rows.
ALIBI_ROWS = 64


def piece(
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
    alignment is the global one, else split at t = 0 (the package docstring)."""
    lo_t: Bound = None if opts["wl"] < 0 else -opts["wl"]
    hi_t: Bound = 0 if opts["causal"] else (None if opts["wr"] < 0 else opts["wr"])
    lo = None if lo_t is None else lo_t - e
    hi = None if hi_t is None else hi_t - e
    Lr, Sr = q.shape[-2], k.shape[-2]
    if slopes is None:
        return _chunk.bounded(q, k, v, m, bm, lo, hi, opts)
    if _geometry.visibility(0, Lr, 0, Sr, lo, hi) == "none":
        return None
    a0, a1, c0, c1 = _geometry.trim(Lr, Sr, lo, hi, opts["block_size"] or (1, 1))
    # The trimmed call puts row a at i' = (a - a0) + (c1 - c0) - (a1 - a0), so its
    # t = (c - c0) - i' = (c - a) + (a1 - c1): the global alignment iff a1 - c1 == e.
    if a1 - c1 == e:
        return _chunk.bounded(q, k, v, m, bm, lo, hi, opts, alibi=slopes)
    bq, bk = opts["block_size"] or (1, 1)
    rows = -(-ALIBI_ROWS // bq) * bq  # (whole blocks: a row block's block grid is a slice of the call's)
    if Lr > rows:  # row blocks, each with its own reference key (below)
        out, lse = None, None
        for r0 in range(0, Lr, rows):
            r1 = min(r0 + rows, Lr)
            mr = None if m is None else _chunk.sub(m, r0, r1, 0, m.shape[-1])
            bmr = None if bm is None else _chunk.sub(bm, r0 // bq, -(-r1 // bq), 0, bm.shape[-1])
            st = piece(q[..., r0:r1, :], k, v, mr, bmr, slopes, e - r0, opts)
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
    # and at most slope * Lr (Lr <= ALIBI_ROWS) in magnitude on each row's key nearest the diagonal.
    for sign, cref, lo_p, hi_p in (
        (1.0, min(max(Lr - 1 - e, 0), Sr - 1), lo, -e if hi is None else min(hi, -e)),
        (-1.0, min(max(1 - e, 0), Sr - 1), 1 - e if lo is None else max(lo, 1 - e), hi),
    ):
        if lo_p is not None and hi_p is not None and lo_p > hi_p:
            continue
        bias = (sign * sl * (c - cref)).astype(cdt)  # (…, H, 1, Sr)
        row = (sign * sl * (cref + e - a))[..., 0]  # (…, H, Lr)
        st = _chunk.bounded(q, k, v, m, bm, lo_p, hi_p, opts, bias=bias, row_shift=row)
        if st is not None:
            states.append(st)
    if not states:
        return None
    if len(states) == 1:
        return states[0]
    o, lse = merge_attention_states([s[0] for s in states], [s[1] for s in states])
    return o, lse


def part(
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
    qh, kh, vh = (_chunk.to_bhsd(x, opts["layout"]) for x in (q, k, v))
    if qh.dtype == F16 or is_bfloat16(qh.dtype):  # partial results in float32, cast once at the end
        qh = qh.astype(F32)
    cdt = F64 if qh.dtype == F64 else F32
    if m is not None and m.dtype != np.bool_ and m.dtype not in (F32, F64):
        m = m.astype(cdt)
    if qlens is None and klens is None:  # one alignment for the whole chunk
        st = piece(qh, kh, vh, m, bm, slopes, (j0 - i0) - (S - L), opts)
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
        mb = None if m is None else _chunk.sub(_chunk.bcast_index(m, b), 0, nr, 0, nk)
        bmb = None if bm is None else _chunk.sub(_chunk.bcast_index(bm, b), 0, -(-nr // bq), 0, -(-nk // bk))
        sb = None if slopes is None else _chunk.bcast_index(slopes, b)
        st = piece(qh[b][:, :nr], kh[b][:, :nk], vh[b][:, :nk], mb, bmb, sb, (j0 - i0) - (Sb - Lb), opts)
        if st is not None:
            out[b][:, :nr], lse[b][:, :nr] = st
    return out, lse
