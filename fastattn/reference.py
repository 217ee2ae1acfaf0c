"""The float64 NumPy oracle of the test suite.

Same signature and semantics as :func:`fastattn.scaled_dot_product_attention`,
computed the obvious way: materialise the (..., Hq, L, S) scores in float64,
transform, softmax, multiply.  Kept simple enough to check by eye.  Returns
float64 (the caller compares at the precision of its inputs).
"""

from __future__ import annotations

import numpy as np

__all__ = ["scaled_dot_product_attention", "varlen_attention"]


def _f64(x):
    return np.asarray(x).astype(np.float64)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    layout="bhsd",
    return_lse=False,
    out=None,
    num_threads=None,
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    key_lengths=None,
    query_lengths=None,
    block_mask=None,
    block_size=None,
):
    q, k, v = _f64(query), _f64(key), _f64(value)
    if layout == "bshd":
        q, k, v = (np.swapaxes(a, -2, -3) for a in (q, k, v))
    two_d = q.ndim == 2
    if two_d:
        q, k, v = q[None], k[None], v[None]
    Hq, L, D = q.shape[-3:]
    Hk, S = k.shape[-3], k.shape[-2]
    if Hq != Hk:  # GQA: query head h uses key/value head h // (Hq // Hk)
        k = np.repeat(k, Hq // Hk, axis=-3)
        v = np.repeat(v, Hq // Hk, axis=-3)
    lead = q.shape[:-3]
    if scale is None:
        scale = 1.0 / np.sqrt(D)

    s = np.einsum("...ld,...sd->...ls", q, k) * scale  # (..., Hq, L, S)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)

    # Valid lengths per batch element, shaped to broadcast over (..., Hq, L, S).
    Lb = np.full(lead, L) if query_lengths is None else np.asarray(query_lengths)
    Sb = np.full(lead, S) if key_lengths is None else np.asarray(key_lengths)
    Lb = np.asarray(Lb)[..., None, None, None]
    Sb = np.asarray(Sb)[..., None, None, None]
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    ipos = i + (Sb - Lb)  # bottom-right aligned query position

    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)[..., None, None]
        s = s - slopes * np.abs(ipos - j)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + m.astype(np.float64)

    allowed = (j < Sb) & (i < Lb)
    if is_causal:
        allowed = allowed & (j <= ipos)
    if window is not None:
        left, right = window
        if left >= 0:
            allowed = allowed & (j >= ipos - left)
        if right >= 0:
            allowed = allowed & (j <= ipos + right)
    if block_mask is not None:
        bq, bk = block_size
        allowed = allowed & np.asarray(block_mask)[..., i // bq, j // bk]
    s = np.where(allowed, s, -np.inf)

    if sinks is not None:  # an extra column that takes probability but adds no value
        sink_col = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[:, None, None], s.shape[:-1] + (1,))
        s = np.concatenate([s, sink_col], axis=-1)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # S = 0 -> -inf
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    denom = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(denom > 0, e / denom, 0.0)
        lse = np.where(denom[..., 0] > 0, m_safe[..., 0] + np.log(denom[..., 0]), -np.inf)
    if sinks is not None:
        p = p[..., :-1]
    o = p @ v
    # Rows with no visible key (and padded query rows) are zeros with LSE -inf.
    dead = ~np.any(allowed, axis=-1)
    if sinks is None:
        o = np.where(dead[..., None], 0.0, o)
    else:
        o = np.where(dead[..., None], 0.0, o)
    pad = np.broadcast_to(i[..., 0] >= Lb[..., 0], lse.shape)
    lse = np.where(pad, -np.inf, lse)
    # NaN in the scores of a row poisons that row (as in a plain softmax).
    nan_rows = np.isnan(s).any(axis=-1)
    o = np.where(nan_rows[..., None], np.nan, o)
    lse = np.where(nan_rows, np.nan, lse)

    if layout == "bshd":
        o = np.swapaxes(o, -2, -3)
    if two_d:
        o, lse = o[0], lse[0]
    return (o, lse) if return_lse else o


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    return_lse=False,
    out=None,
    num_threads=None,
):
    """Packed sequences, one reference call per sequence."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    Hq = q.shape[1]
    o = np.zeros((q.shape[0], Hq, v.shape[2]))
    lse = np.full((Hq, q.shape[0]), -np.inf)
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        ks, ke = cu_seqlens_k[b], cu_seqlens_k[b + 1]
        slopes = None
        if alibi_slopes is not None:
            a = np.asarray(alibi_slopes)
            slopes = a if a.ndim == 1 else a[b]
        ob, lb = scaled_dot_product_attention(
            q[qs:qe],
            k[ks:ke],
            v[ks:ke],
            is_causal=is_causal,
            scale=scale,
            layout="bshd",
            window=window,
            alibi_slopes=slopes,
            softcap=softcap,
            sinks=sinks,
            return_lse=True,
        )
        o[qs:qe] = ob
        lse[:, qs:qe] = lb
    return (o, lse) if return_lse else o


def scaled_dot_product_attention_backward(
    grad_out,
    query,
    key,
    value,
    out=None,
    lse=None,
    attn_mask=None,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    layout="bhsd",
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    key_lengths=None,
    query_lengths=None,
    num_threads=None,
):
    """Gradients of :func:`scaled_dot_product_attention` by the explicit float64
    formula, everything materialised (``out`` and ``lse`` are ignored: the
    probabilities are recomputed here from scratch):

    P = softmax(s) over the keys and the sink column; O = P V; D_i = sum(dO_i O_i);
    dV = P^T dO; dP = dO V^T; dS = P (dP - D) (times 1 - tanh^2 under softcap);
    dQ = dS K scale; dK = dS^T Q scale; d sink = -sum_i P_sink,i D_i.
    GQA sums each group's dK and dV.  Returns float64 arrays."""
    q, k, v, go = _f64(query), _f64(key), _f64(value), _f64(grad_out)
    if layout == "bshd":
        q, k, v, go = (np.swapaxes(a, -2, -3) for a in (q, k, v, go))
    two_d = q.ndim == 2
    if two_d:
        q, k, v, go = q[None], k[None], v[None], go[None]
    Hq, L, D = q.shape[-3:]
    Hk, S = k.shape[-3], k.shape[-2]
    g = Hq // Hk
    ke, ve = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    lead = q.shape[:-3]
    if scale is None:
        scale = 1.0 / np.sqrt(D)

    s = np.einsum("...ld,...sd->...ls", q, ke) * scale
    dcap = np.ones_like(s)
    if softcap is not None:
        t = np.tanh(s / softcap)
        s, dcap = softcap * t, 1.0 - t * t
    Lb = np.asarray(np.full(lead, L) if query_lengths is None else query_lengths)[..., None, None, None]
    Sb = np.asarray(np.full(lead, S) if key_lengths is None else key_lengths)[..., None, None, None]
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    ipos = i + (Sb - Lb)
    if alibi_slopes is not None:
        s = s - np.asarray(alibi_slopes, dtype=np.float64)[..., None, None] * np.abs(ipos - j)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + m.astype(np.float64)
    allowed = (j < Sb) & (i < Lb)
    if is_causal:
        allowed = allowed & (j <= ipos)
    if window is not None:
        if window[0] >= 0:
            allowed = allowed & (j >= ipos - window[0])
        if window[1] >= 0:
            allowed = allowed & (j <= ipos + window[1])
    s = np.where(allowed, s, -np.inf)
    if sinks is not None:
        col = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[:, None, None], s.shape[:-1] + (1,))
        s = np.concatenate([s, col], axis=-1)
    mx = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(s - np.where(np.isfinite(mx), mx, 0.0))
    den = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(den > 0, e / den, 0.0)
    p_sink = None
    if sinks is not None:
        p, p_sink = p[..., :-1], p[..., -1]
    dead = ~np.any(allowed, axis=-1)  # rows with no key: output 0, so no gradient
    p = np.where(dead[..., None], 0.0, p)
    o = p @ ve
    delta = np.sum(go * o, axis=-1)  # (..., Hq, L)
    dv = np.swapaxes(p, -1, -2) @ go
    dp = go @ np.swapaxes(ve, -1, -2)
    ds = p * (dp - delta[..., None]) * dcap
    dq = ds @ ke * scale
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    # GQA: query head h used kv head h // g; sum each group's contributions.
    dk = dk.reshape(lead + (Hk, g, S, D)).sum(axis=-3)
    dv = dv.reshape(lead + (Hk, g, S, v.shape[-1])).sum(axis=-3)
    res = [dq, dk, dv]
    if layout == "bshd":
        res = [np.swapaxes(a, -2, -3) for a in res]
    if two_d:
        res = [a[0] for a in res]
    if sinks is not None:
        dsinks = -np.sum(np.where(dead, 0.0, p_sink) * delta, axis=tuple(range(len(lead))) + (-1,))
        res.append(dsinks)
    return tuple(res)
