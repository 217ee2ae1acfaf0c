"""The in-memory call of one (query chunk, key chunk) pair, run inside a task: the
causal / window bounds as the call's window, the user mask and ALiBi bias sliced
to the pair."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import functional as _functional
from . import _geometry
from ._geometry import Bound, NDArray, State


def to_bhsd(a: NDArray, layout: str) -> NDArray:
    """(…, L, H, X) -> (…, H, L, X) view for bshd; identity for bhsd."""
    return np.swapaxes(a, -2, -3) if layout == "bshd" else a


def with_bias(m: NDArray | None, bias: NDArray) -> NDArray:
    """The user's chunk mask with an additive float bias folded in."""
    if m is None:
        return bias
    if m.dtype == np.bool_:
        return np.where(m, bias, np.array(-np.inf, dtype=bias.dtype))
    return m + bias  # (float masks were converted to the compute dtype at the task's start)


def bcast_index(a: NDArray, idx: tuple[int, ...]) -> NDArray:
    """a[idx] over a's leading dims, index 0 where a dim is broadcast (size 1)."""
    r: NDArray = a[tuple(0 if a.shape[d] == 1 else i for d, i in enumerate(idx))]
    return r


def sub(a: NDArray, r0: int, r1: int, c0: int, c1: int) -> NDArray:
    """a[..., r0:r1, c0:c1] of a (…, rows, keys) array, its broadcast (size-1) dims kept."""
    return a[
        ...,
        slice(r0, r1) if a.shape[-2] != 1 else slice(None),
        slice(c0, c1) if a.shape[-1] != 1 else slice(None),
    ]


def bounded(
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
    if _geometry.visibility(0, Lr, 0, Sr, lo, hi) == "none":
        return None
    # Bounds that restrict nothing (every pair has -(Lr - 1) <= c - a <= Sr - 1) are dropped: a window
    # of up to 2**63 - 1 shifted by a chunk offset could otherwise exceed what the call accepts.
    if lo is not None and lo <= -(Lr - 1):
        lo = None
    if hi is not None and hi >= Sr - 1:
        hi = None
    bq, bk = opts["block_size"] or (1, 1)
    a0, a1, c0, c1 = _geometry.trim(Lr, Sr, lo, hi, (bq, bk))
    d = c0 - a0  # the trimmed call's c - a is the original's minus d
    lo2 = None if lo is None else lo - d
    hi2 = None if hi is None else hi - d
    qs, ks, vs = q[..., a0:a1, :], k[..., c0:c1, :], v[..., c0:c1, :]
    if m is not None:
        m = sub(m, a0, a1, c0, c1)
    if bias is not None:
        m = with_bias(m, bias[..., c0:c1])
    if bm is not None:
        bm = sub(bm, a0 // bq, -(-a1 // bq), c0 // bk, -(-c1 // bk))
    Lt, St = a1 - a0, c1 - c0
    window = None
    if _geometry.visibility(0, Lt, 0, St, lo2, hi2) == "partial":
        window = _geometry.chunk_window(0, Lt, 0, St, lo2, hi2)
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
