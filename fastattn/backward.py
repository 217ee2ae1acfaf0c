"""The backward pass of :func:`fastattn.scaled_dot_product_attention`: fused dQ,
dK, dV (and d sinks) by recomputing each score tile from the forward's LSE."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._args import bhsd as bhsd_view
from ._args import (
    check_dtypes,
    check_shapes,
    compute_dtype,
    lengths,
    mask_value,
    per_head,
    sinks_value,
    softcap_value,
    window_value,
)
from ._checks import F32, F64, as_array, check_float, kernel_ready, scale_value, threads_value
from ._config import get_num_threads
from ._plan import Plan, element_strides, merged_stride

__all__ = ["scaled_dot_product_attention_backward"]

# Rows of the -inf LSE check gathered at a time (rows x S mask values).
_CHECK_CHUNK = 1 << 22

NDArray = npt.NDArray[Any]


def scaled_dot_product_attention_backward(
    grad_out: npt.ArrayLike,
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    out: npt.ArrayLike,
    lse: npt.ArrayLike,
    attn_mask: npt.ArrayLike | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: str = "bhsd",
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    key_lengths: npt.ArrayLike | None = None,
    query_lengths: npt.ArrayLike | None = None,
    num_threads: int | None = None,
) -> tuple[NDArray, ...]:
    """Gradients of :func:`fastattn.scaled_dot_product_attention` with respect to
    query, key and value (and sinks), fused and tiled as in FlashAttention-2.

    ``out`` and ``lse`` are what the forward returned with ``return_lse=True``
    for the same inputs and options; ``grad_out`` is the gradient of the loss
    with respect to ``out`` (same shape and dtype).  Every other argument means
    what it means for the forward (same checks, same order of transforms:
    scale, softcap, ALiBi, mask, causal / window / length restrictions); a
    bool ``attn_mask`` is True = may attend, a float one is added.

    Returns ``(dq, dk, dv)`` shaped and typed as query, key and value; with
    ``sinks``, ``(dq, dk, dv, dsinks)`` with ``dsinks`` a float64 ``(Hq,)``
    array.  Masks, ALiBi slopes and softcap are constants (no gradient).
    Grouped-query heads sum their group's dK and dV.  A row that sees no key
    (and a query row past ``query_lengths``) has zero gradient; keys past
    ``key_lengths`` get zero dK and dV.  float16 and bfloat16 are computed in
    float32.  Memory beyond the results: tile scratch per thread and dQ partial
    sums (one per split of the keys: a split is added while there are fewer
    than 32 (batch, kv head) tasks), never an L x S array.  Results are
    bit-identical for every thread count.

    The LSE convention is the forward's: natural log, sinks included.
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    q = as_array(query, "query")
    k = as_array(key, "key")
    v = as_array(value, "value")
    check_dtypes(q, k, v)
    lead, (Hq, L, D), (Hk, S, Dv) = check_shapes(q, k, v, layout, enable_gqa)
    sc = scale_value(scale, D, F64 if q.dtype == F64 else F32)
    threads = threads_value(num_threads, get_num_threads)
    wl, wr = window_value(window)
    cap = softcap_value(softcap)
    cdt = compute_dtype(q.dtype)
    B = math.prod(lead)
    mask, mask_kind = mask_value(attn_mask, lead + (Hq, L, S), cdt)
    alibi = None
    if alibi_slopes is not None:
        alibi = per_head(alibi_slopes, "alibi_slopes", lead, Hq, True).reshape(B, Hq)
    sk = sinks_value(sinks, Hq)
    k_lens = None if key_lengths is None else lengths(key_lengths, "key_lengths", lead, S).reshape(B)
    q_lens = None if query_lengths is None else lengths(query_lengths, "query_lengths", lead, L).reshape(B)

    out_shape = q.shape[:-1] + (Dv,)
    go = as_array(grad_out, "grad_out")
    o = as_array(out, "out")
    for a, n in ((go, "grad_out"), (o, "out")):
        check_float(a, n)
        if a.shape != out_shape:
            raise ValueError(f"{n} must have the forward output's shape {out_shape}, got {a.shape}")
        if a.dtype != q.dtype:
            raise TypeError(f"{n} must have the query's dtype {q.dtype}, got {a.dtype}")
    lse_shape = (L,) if q.ndim == 2 else lead + (Hq, L)
    la = as_array(lse, "lse")
    if la.dtype.kind != "f":
        raise TypeError(
            f"lse must be a float array (the forward's return_lse=True result), got dtype {la.dtype}"
        )
    if la.shape != lse_shape:
        raise ValueError(f"lse must have shape {lse_shape} (the forward's LSE), got {la.shape}")
    if np.isnan(la).any() or np.isposinf(la).any():
        raise ValueError("lse must not be NaN or +inf (a NaN LSE comes from NaN inputs to the forward)")
    lse3 = np.asarray(la, dtype=cdt).reshape(B, Hq, L)
    _check_dead_rows(lse3, mask, lead, Hq, L, S, is_causal, wl, wr, k_lens, q_lens, sk is not None)

    # bhsd views in the compute dtype (16-bit inputs are computed in float32).
    def bhsd(a: NDArray) -> NDArray:
        if a.dtype != cdt:
            a = a.astype(cdt)
        a = bhsd_view(a, layout)
        return a[None] if a.ndim == 2 else a

    def merged(a: NDArray) -> NDArray:  # (*lead, x, y, z) -> (B, x, y, z), kernel-readable
        return kernel_ready(a.reshape((B,) + a.shape[-3:]))

    qh, kh, vh, oh, goh = (merged(bhsd(a)) for a in (q, k, v, o, go))
    dq = np.zeros(q.shape, dtype=cdt)
    dk = np.zeros(k.shape, dtype=cdt)
    dv = np.zeros(v.shape, dtype=cdt)
    dqh, dkh, dvh = (bhsd(a).reshape((B,) + bhsd(a).shape[-3:]) for a in (dq, dk, dv))
    dsinks = np.zeros(Hq, dtype=F64) if sk is not None else None
    m4 = None
    if mask is not None:
        m = mask[None] if lead == () else mask
        nl = m.ndim - 3
        if merged_stride(m.shape[:nl], element_strides(m)[:nl]) is not None:
            m4 = m.reshape((B,) + m.shape[nl:])
    plan = Plan(
        q=qh,
        k=kh,
        v=vh,
        o=oh,
        lse=lse3,
        mask=m4,
        mask_kind=mask_kind,
        scale=sc,
        causal=bool(is_causal),
        window_left=wl,
        window_right=wr,
        softcap=cap,
        alibi=alibi,
        sinks=sk,
        q_lens=q_lens,
        k_lens=k_lens,
        num_threads=threads,
        precision=_kernels.FA_PRECISION_HIGHEST,  # (the backward computes float32 as "highest")
        L=L,
        S=S,
    )
    if mask is not None and m4 is None:
        # A broadcast mask whose leading dims cannot merge: one call per batch element.
        for bidx, idx in enumerate(np.ndindex(*lead)):
            sl = slice(bidx, bidx + 1)
            part = None if dsinks is None else np.zeros(Hq, dtype=F64)
            sub = Plan(
                q=qh[sl], k=kh[sl], v=vh[sl], o=oh[sl], lse=lse3[sl], mask=mask[idx][None],
                mask_kind=mask_kind, scale=sc, causal=bool(is_causal), window_left=wl, window_right=wr,
                softcap=cap, alibi=None if alibi is None else alibi[sl], sinks=sk,
                q_lens=None if q_lens is None else q_lens[sl], k_lens=None if k_lens is None else k_lens[sl],
                num_threads=threads, precision=plan.precision, L=L, S=S,
            )  # fmt: skip
            _kernels.attention_backward(sub, goh[sl], dqh[sl], dkh[sl], dvh[sl], part)
            if part is not None and dsinks is not None:  # (part is set exactly when dsinks is)
                dsinks += part
    else:
        _kernels.attention_backward(plan, goh, dqh, dkh, dvh, dsinks)
    if q.dtype != cdt:
        dq, dk, dv = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def _check_dead_rows(
    lse3: NDArray,
    mask: NDArray | None,
    lead: tuple[int, ...],
    Hq: int,
    L: int,
    S: int,
    causal: bool,
    wl: int,
    wr: int,
    k_lens: NDArray | None,
    q_lens: NDArray | None,
    has_sinks: bool,
) -> None:
    """ValueError when the LSE is -inf on a row that sees a key (with sinks: on
    any valid row): such an LSE did not come from this forward."""
    b, h, i = np.nonzero(np.isneginf(lse3))
    if b.size == 0:
        return
    Lb = np.full(b.shape, L) if q_lens is None else q_lens[b]
    Sb = np.full(b.shape, S) if k_lens is None else k_lens[b]
    valid = i < Lb
    b, h, i, Lb, Sb = b[valid], h[valid], i[valid], Lb[valid], Sb[valid]
    if has_sinks:
        bad = np.ones(b.shape, dtype=bool)
    else:
        ip = i + Sb - Lb
        lo, hi = np.zeros_like(ip), Sb.copy()
        if causal:
            hi = np.minimum(hi, ip + 1)
        if wl >= 0:
            lo = np.maximum(lo, ip - wl)
        if wr >= 0:
            hi = np.minimum(hi, ip + wr + 1)
        bad = hi > lo
        if mask is not None and bad.any():
            sel = np.nonzero(bad)[0]
            j = np.arange(S)
            step = max(1, _CHECK_CHUNK // max(S, 1))
            for c in range(0, sel.size, step):
                rows = sel[c : c + step]
                lidx = np.unravel_index(b[rows], lead) if lead else ()
                mrows = mask[lidx + (h[rows], i[rows])]
                seen = mrows if mrows.dtype == np.bool_ else mrows > -np.inf
                inrange = (j >= lo[rows, None]) & (j < hi[rows, None])
                bad[rows] = np.any(seen & inrange, axis=-1)
    if bad.any():
        n = int(bad.sum())
        first = (int(b[bad][0]), int(h[bad][0]), int(i[bad][0]))
        raise ValueError(
            f"lse is -inf on {n} row(s) that see at least one key (first at batch, head, row {first}); "
            "pass the LSE the forward returned (return_lse=True) for these same arguments"
        )
