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
    dropout_value,
    layout_value,
    lengths,
    mask_value,
    per_head,
    sinks_value,
    softcap_value,
    window_value,
)
from ._checks import (
    F32,
    F64,
    as_array,
    bfloat16_dtype,
    check_float,
    flag_value,
    kernel_ready,
    scale_value,
    threads_value,
)
from ._config import get_num_threads, precision_code
from ._plan import Plan, element_strides, merged_stride

__all__ = ["scaled_dot_product_attention_backward"]

# Rows of the -inf LSE check gathered at a time (rows x S mask values).
_CHECK_CHUNK = 1 << 22

# The fewest stacked rows (query positions x GQA group) per key/value head for which
# the forward sends float32 inputs to the bfloat16 tile kernel: FA_AMX_MIN_ROWS of
# csrc/kernel.h (the extension does not export it).
_BF16_MIN_ROWS = 32

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
    precision: str | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
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

    ``precision`` is the forward's (same values; None: the process default,
    :func:`fastattn.get_float32_matmul_precision`): pass what the forward used.
    Where the forward rounded float32 query, key and value to bfloat16 (precision
    "medium" on the ``amx`` or ``avx512bf16`` path, >= 32 stacked rows per key/value
    head), the backward rounds them the same way (copies of the three, in float32)
    so that its recomputed scores, and so P against the forward's LSE, are the
    forward's; elsewhere it computes float32 (at "high" the forward's bf16x3 scores
    are within ~1e-5 relative of float32 ones).

    NaN (or +inf) in the LSE, as NaN or inf inputs give the forward (float16
    overflow under mixed precision), is not an error: as in torch, NaN propagates
    wherever the math takes it: the row's dQ, and dK and dV of every key that
    row sees (with sinks, d sinks of its head); dK may also be NaN where the
    kernel multiplies the row's zero dS by a NaN query element (0 x NaN, as
    torch's dS^T Q does).  Rows with a finite LSE keep finite gradients unless
    they see a NaN key or value.

    Parameters
    ----------
    grad_out : array_like
        Gradient of the loss with respect to ``out``, same shape and dtype.
    query, key, value : array_like
        The forward's inputs.
    out, lse : array_like
        The forward's results for the same inputs and options (``return_lse=True``).
    attn_mask, is_causal, scale, enable_gqa, layout
        As for :func:`fastattn.scaled_dot_product_attention`.
    window, alibi_slopes, softcap, sinks, key_lengths, query_lengths
        As for :func:`fastattn.scaled_dot_product_attention`.
    num_threads : int, optional
        Threads for this call; None uses :func:`fastattn.get_num_threads`.
    precision : {None, "highest", "high", "medium"}, optional
        The forward's float32 matmul level, as described above.
    dropout_p, dropout_seed : optional
        The forward's dropout (pass the same two): the mask is regenerated from
        the seed, not stored; dV = (P Z)^T dout and dS = P (dP Z - D) with Z the
        mask over 1 - dropout_p.

    Returns
    -------
    dq, dk, dv : ndarray
        Shaped and typed as query, key and value.
    dsinks : ndarray
        Only with ``sinks``: float64 ``(Hq,)``.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 2, 6, 8))
    >>> out, lse = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    >>> dout = np.ones_like(out)                        # the loss is out.sum()
    >>> dq, dk, dv = fastattn.scaled_dot_product_attention_backward(
    ...     dout, q, k, v, out, lse, is_causal=True)
    >>> dq.shape, dk.shape, dv.shape
    ((1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8))

    dV is P^T @ dout, with P the attention weights:

    >>> p = fastattn.attention_weights(q, k, is_causal=True)
    >>> bool(np.allclose(dv, p.transpose(0, 1, 3, 2) @ dout))
    True
    """
    # The forward's checks, in its order (fastattn._args.sdpa_call).
    prec = precision_code(precision)
    drop_p, drop_seed = dropout_value(dropout_p, dropout_seed)
    layout = layout_value(layout)
    causal = flag_value(is_causal, "is_causal")
    q = as_array(query, "query")
    k = as_array(key, "key")
    v = as_array(value, "value")
    check_dtypes(q, k, v)
    lead, (Hq, L, D), (Hk, S, Dv) = check_shapes(q, k, v, layout, enable_gqa)
    cdt = compute_dtype(q.dtype)
    sc = scale_value(scale, D, cdt)
    threads = threads_value(num_threads, get_num_threads)
    wl, wr = (-1, -1) if window is None else window_value(window)
    cap = 0.0 if softcap is None else softcap_value(softcap)
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
    lse3 = np.asarray(la, dtype=cdt).reshape(B, Hq, L)
    poisoned = ~(lse3 < np.inf) & ~np.isneginf(lse3)  # NaN or +inf
    if poisoned.any():
        # NaN / inf inputs (the forward's NaN rows): NaN gradients, as torch gives
        # (GradScaler looks for them), not an error.  +inf (scores that overflowed)
        # becomes NaN too: the kernel would read it as P = 0, a silent zero gradient.
        # On a copy: the caller's lse is not modified.
        lse3 = np.where(poisoned, np.array(np.nan, dtype=cdt), lse3)
    _check_dead_rows(lse3, mask, lead, Hq, L, S, causal, wl, wr, k_lens, q_lens, sk is not None)
    if drop_p == 0 and forward_rounds_to_bf16(q.dtype, k.dtype, v.dtype, prec, L * (Hq // Hk)):
        # The forward's scores were products of bf16-rounded Q and K (exact in
        # float32) and its output used bf16 V: recompute P from the same values.
        bf16 = bfloat16_dtype()
        q, k, v = (a.astype(bf16).astype(F32) for a in (q, k, v))

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
        causal=causal,
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
        dropout_p=drop_p,
        dropout_seed=drop_seed,
    )
    if mask is not None and m4 is None:
        # A broadcast mask whose leading dims cannot merge: one call per batch element.
        for bidx, idx in enumerate(np.ndindex(*lead)):
            sl = slice(bidx, bidx + 1)
            part = None if dsinks is None else np.zeros(Hq, dtype=F64)
            sub = Plan(
                q=qh[sl], k=kh[sl], v=vh[sl], o=oh[sl], lse=lse3[sl], mask=mask[idx][None],
                mask_kind=mask_kind, scale=sc, causal=causal, window_left=wl, window_right=wr,
                softcap=cap, alibi=None if alibi is None else alibi[sl], sinks=sk,
                q_lens=None if q_lens is None else q_lens[sl], k_lens=None if k_lens is None else k_lens[sl],
                num_threads=threads, precision=plan.precision, L=L, S=S,
                dropout_p=drop_p, dropout_seed=drop_seed, dropout_b0=bidx,
            )  # fmt: skip
            _kernels.attention_backward(sub, goh[sl], dqh[sl], dkh[sl], dvh[sl], part)
            if part is not None and dsinks is not None:  # (part is set exactly when dsinks is)
                dsinks += part
    else:
        _kernels.attention_backward(plan, goh, dqh, dkh, dvh, dsinks)
    # Each gradient typed as its input (a float32 query may come with bf16/fp16 key and value).
    dq, dk, dv = (g if g.dtype == a.dtype else g.astype(a.dtype) for g, a in ((dq, q), (dk, k), (dv, v)))
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def forward_rounds_to_bf16(
    q_dtype: np.dtype[Any], k_dtype: np.dtype[Any], v_dtype: np.dtype[Any], prec: int, rows: int
) -> bool:
    """Whether the forward, for these dtypes, precision code and stacked rows per
    key/value head (L x Hq/Hk), rounds float32 Q, K and V to bfloat16: the
    condition of csrc/dispatch.c fa_select_kernel (keep the two in step).  That
    happens at "medium" on the ``amx`` and ``avx512bf16`` paths (the ISA can only be
    one of those where the extension was built with its kernel).  At "high" the
    ``amx`` path computes bf16x3, which no float32 rounding reproduces: the backward
    computes float32 there.  (A call with dropout never rounds: the caller checks.)"""
    if not (q_dtype == F32 and k_dtype == F32 and v_dtype == F32):
        return False
    if prec != _kernels.FA_PRECISION_MEDIUM or rows < _BF16_MIN_ROWS:
        return False
    return _kernels.isa_get() in ("amx", "avx512bf16")


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
