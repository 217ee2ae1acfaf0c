"""The gradient of :func:`fastattn.jax_compat.dot_product_attention` with respect to
its ``bias`` (jax_compat's custom VJP asks for it only when ``bias`` is differentiated).
Kept apart from jax_compat: an explicit float64 recomputation, not the fused backward."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._checks import bfloat16_dtype
from ._config import precision_code
from .backward import forward_rounds_to_bf16

__all__ = ["bias_grad"]


def bias_grad(
    q4: np.ndarray,
    k4: np.ndarray,
    v4: np.ndarray,
    bias: np.ndarray,
    go: np.ndarray,
    kw: dict[str, Any],
    scale: float | None,
    precision: str | None,
) -> np.ndarray:
    """d loss / d bias for 4-D bshd inputs and the forward's keyword arguments ``kw``
    (from :func:`_numpy_prepare`): the gradient of the biased scores,
    ``dS = P * (dP - rowsum(P * dP))`` with ``dP = dO V^T`` (``rowsum(P * dP)`` is
    ``rowsum(dO * O)`` for the exact O), summed over the axes ``bias`` broadcasts
    along, in ``bias``'s shape (at most 4-D) and dtype.  The fused backward never forms
    dS, so this recomputes P explicitly: float64, one (batch, head) at a time (a few
    ``(T, S)`` float64 temporaries), from Q, K, V as the forward read them (rounded to
    bfloat16 where it computed at precision "medium").  The scores are masked as the
    forward masks them (mask, causal / window aligned as in
    :func:`fastattn.scaled_dot_product_attention`, lengths); a row that sees no key
    gets no gradient, and NaN propagates as the math takes it."""
    B, T, N, H = q4.shape
    S, K = k4.shape[1], k4.shape[2]
    G = N // K
    sc = 1.0 / np.sqrt(H) if scale is None else float(scale)
    q, k, v = q4, k4, v4
    if forward_rounds_to_bf16(q.dtype, k.dtype, v.dtype, precision_code(precision), T * G):
        bf16 = bfloat16_dtype()
        q, k, v = (a.astype(bf16) for a in (q, k, v))
    q, k, v, g = (np.asarray(a, dtype=np.float64) for a in (q, k, v, go))
    b4 = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    db = np.zeros(b4.shape, dtype=np.float64)
    am = kw.get("attn_mask")
    m4 = None if am is None else np.broadcast_to(am, (B, N, T, S))
    ql, kl = kw.get("query_lengths"), kw.get("key_lengths")
    window = kw.get("window")
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    bcast_b, bcast_n = b4.shape[0] != 1, b4.shape[1] != 1  # bias has its own batch / head entries
    axes = tuple(a for a, d in zip((0, 1), b4.shape[2:]) if d == 1)  # (T, S) axes the bias broadcasts
    for bi in range(B):
        Lb = T if ql is None else int(ql[bi])
        Sb = S if kl is None else int(kl[bi])
        ipos = i + (Sb - Lb)  # bottom-right aligned, as the kernel (kw already holds JAX's top-left)
        allowed = (i < Lb) & (j < Sb)
        if kw.get("is_causal"):
            allowed &= j <= ipos
        if window is not None:
            allowed &= (j >= ipos - window[0]) & (j <= ipos + window[1])
        for n in range(N):
            s = (q[bi, :, n] @ k[bi, :, n // G].T) * sc
            if m4 is not None:
                mb = m4[bi, n]
                s = np.where(mb, s, -np.inf) if mb.dtype == np.bool_ else s + mb.astype(np.float64)
            s = np.where(allowed, s, -np.inf)
            mx = np.max(s, axis=-1, keepdims=True)
            with np.errstate(invalid="ignore", over="ignore"):
                e = np.exp(s - np.where(mx == -np.inf, 0.0, mx))  # NaN rows stay NaN
                den = np.sum(e, axis=-1, keepdims=True)
                p = np.where(den == 0, 0.0, e / np.where(den == 0, 1.0, den))  # no key: no gradient
                dp = g[bi, :, n] @ v[bi, :, n // G].T
                ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
            db[bi if bcast_b else 0, n if bcast_n else 0] += ds.sum(axis=axes, keepdims=True)
    return db.reshape(bias.shape).astype(bias.dtype)
