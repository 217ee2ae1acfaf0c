"""The float64 NumPy oracle of the test suite.

Same signature and semantics as :func:`fastattn.scaled_dot_product_attention`,
computed the obvious way: materialise the (..., Hq, L, S) scores in float64,
transform, softmax, multiply.  Masks as in the functional API: bool True = may
attend, float masks added to the scores.  Kept simple enough to check by eye.  Returns
float64 (the caller compares at the precision of its inputs).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import numpy.typing as npt

NDArray = npt.NDArray[Any]

__all__ = [
    "scaled_dot_product_attention",
    "varlen_attention",
    "additive_attention",
    "lsh_attention",
    "sinusoidal_positions",
    "rotary_cos_sin",
    "apply_rotary",
    "attention_weights",
    "dropout_mask",
]


def _f64(x: npt.ArrayLike) -> npt.NDArray[np.float64]:
    return np.asarray(x).astype(np.float64)


def scaled_dot_product_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: str = "bhsd",
    return_lse: bool = False,
    out: NDArray | None = None,
    num_threads: int | None = None,
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    key_lengths: npt.ArrayLike | None = None,
    query_lengths: npt.ArrayLike | None = None,
    block_mask: npt.ArrayLike | None = None,
    block_size: tuple[int, int] | None = None,
    dropout_seed: int | None = None,
) -> NDArray | tuple[NDArray, NDArray]:
    """:func:`fastattn.scaled_dot_product_attention` the obvious way, in float64.

    The ``(..., Hq, L, S)`` scores are materialised, transformed (softcap,
    ALiBi, masks, lengths, causal, window, block mask, sinks), softmaxed and
    multiplied by value.

    Parameters
    ----------
    query, key, value : array_like
        As for :func:`fastattn.scaled_dot_product_attention`.
    attn_mask, is_causal, scale, enable_gqa, layout : optional
        As for :func:`fastattn.scaled_dot_product_attention`.
    window, alibi_slopes, softcap, sinks, key_lengths, query_lengths : optional
        As for :func:`fastattn.scaled_dot_product_attention`.
    block_mask, block_size : optional
        As for :func:`fastattn.scaled_dot_product_attention`.
    return_lse : bool, default False
        Also return the log-sum-exp of each row.
    dropout_p, dropout_seed : optional
        Dropout as fastattn applies it: the weights times
        :func:`dropout_mask` ``/ (1 - dropout_p)`` (the LSE is undropped).
    out, num_threads : optional
        Accepted for the same signature; ignored.

    Returns
    -------
    out : ndarray
        float64, shaped as the fastattn output.
    lse : ndarray
        float64; only with ``return_lse=True``.

    Examples
    --------
    >>> from fastattn import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 4, 8)).astype(np.float32)
    >>> ref = reference.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> ref.dtype
    dtype('float64')
    >>> bool(np.allclose(fastattn.scaled_dot_product_attention(q, k, v, is_causal=True), ref, atol=1e-5))
    True
    """
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
        bq, bk = cast("tuple[int, int]", block_size)
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
    if dropout_p > 0:
        p = p * _dropout_factor(p.shape, dropout_p, dropout_seed)
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
    nan_rows = cast(NDArray, np.isnan(s).any(axis=-1))
    o = np.where(nan_rows[..., None], np.nan, o)
    lse = np.where(nan_rows, np.nan, lse)

    if layout == "bshd":
        o = np.swapaxes(o, -2, -3)
    if two_d:
        o, lse = o[0], lse[0]
    return (o, lse) if return_lse else o


def varlen_attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    return_lse: bool = False,
    out: NDArray | None = None,
    num_threads: int | None = None,
) -> NDArray | tuple[NDArray, NDArray]:
    """Packed sequences, one reference call per sequence.

    Parameters
    ----------
    q, k, v : array_like
        As for :func:`fastattn.varlen_attention`.
    cu_seqlens_q, cu_seqlens_k : array_like of int
        As for :func:`fastattn.varlen_attention`.
    is_causal, scale, enable_gqa, window, alibi_slopes, softcap, sinks : optional
        As for :func:`fastattn.varlen_attention`.
    return_lse : bool, default False
        Also return the log-sum-exp of each row.
    out, num_threads : optional
        Accepted for the same signature; ignored.

    Returns
    -------
    out : ndarray
        float64, shaped as the fastattn output.
    lse : ndarray
        float64; only with ``return_lse=True``.

    Examples
    --------
    >>> from fastattn import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 5, 2, 8)).astype(np.float32)
    >>> cu = np.array([0, 2, 5])
    >>> ref = reference.varlen_attention(q, k, v, cu, cu, is_causal=True)
    >>> bool(np.allclose(fastattn.varlen_attention(q, k, v, cu, cu, is_causal=True), ref, atol=1e-5))
    True
    """
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
        ob, lb = cast(
            "tuple[NDArray, NDArray]",
            scaled_dot_product_attention(
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
            ),
        )
        o[qs:qe] = ob
        lse[:, qs:qe] = lb
    return (o, lse) if return_lse else o


def scaled_dot_product_attention_backward(
    grad_out: npt.ArrayLike,
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    out: npt.ArrayLike | None = None,
    lse: npt.ArrayLike | None = None,
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
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
) -> tuple[NDArray, ...]:
    """Gradients of :func:`scaled_dot_product_attention` by the explicit float64
    formula, everything materialised (``out`` and ``lse`` are ignored: the
    probabilities are recomputed here from scratch):

    P = softmax(s) over the keys and the sink column; O = P V; D_i = sum(dO_i O_i);
    dV = P^T dO; dP = dO V^T; dS = P (dP - D) (times 1 - tanh^2 under softcap);
    dQ = dS K scale; dK = dS^T Q scale; d sink = -sum_i P_sink,i D_i.
    With dropout (Z = :func:`dropout_mask` / (1 - p)): O = (P Z) V, dV = (P Z)^T dO
    and dS = P (dP Z - D).
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
    z = _dropout_factor(p.shape, dropout_p, dropout_seed) if dropout_p > 0 else np.ones_like(p)
    o = (p * z) @ ve
    delta = np.sum(go * o, axis=-1)  # (..., Hq, L)
    dv = np.swapaxes(p * z, -1, -2) @ go
    dp = go @ np.swapaxes(ve, -1, -2)
    ds = p * (dp * z - delta[..., None]) * dcap
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
        assert p_sink is not None  # (set above whenever sinks is given)
        dsinks = -np.sum(np.where(dead, 0.0, p_sink) * delta, axis=tuple(range(len(lead))) + (-1,))
        res.append(dsinks)
    return tuple(res)


def dropout_mask(
    shape: tuple[int, ...], dropout_p: float, dropout_seed: int, *, batch_offset: int = 0
) -> npt.NDArray[np.bool_]:
    """The keep mask (True = kept) of fastattn's attention dropout over scores of
    ``shape = (*lead, Hq, L, S)``, computed by NumPy's Philox bit generator (an
    implementation independent of fastattn's C): entry (b, h, i, j), b the flat
    index over ``lead`` plus ``batch_offset``, takes the 32-bit word ``j % 8``
    (little-endian halves of the four 64-bit outputs) of Philox-4x64-10 of the
    counter (j // 8, i, h, b) under the key ``dropout_seed``, and is kept when that
    word is >= round(dropout_p * 2**32) (csrc/dropout.h).  For a packed
    variable-length batch, b is the sequence and i, j are positions within it.

    >>> from fastattn import reference
    >>> m = reference.dropout_mask((1, 2, 64, 64), 0.2, 1234)
    >>> m.shape, round(float(m.mean()), 1)
    ((1, 2, 64, 64), 0.8)
    """
    *lead, H, L, S = shape
    B = int(np.prod(lead, dtype=np.int64)) if lead else 1
    thr = int(dropout_p * 4294967296.0 + 0.5)
    nblk = (S + 7) // 8
    out = np.empty((B, H, L, S), dtype=bool)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                # NumPy's Philox increments its 256-bit counter before each block, and
                # the blocks of a row are consecutive counters from (0, i, h, b).
                ctr = ((b + batch_offset) << 192 | h << 128 | i << 64) - 1
                gen = np.random.Philox(counter=ctr % (1 << 256), key=dropout_seed)
                words = gen.random_raw(4 * nblk).astype("<u8").view("<u4")[:S]
                out[b, h, i] = words >= thr
    return out.reshape(tuple(lead) + (H, L, S))


def _dropout_factor(shape: tuple[int, ...], dropout_p: float, dropout_seed: int | None) -> NDArray:
    """The dropout multipliers of scores of ``shape``: 1 / (1 - p) where kept, 0 where dropped."""
    if dropout_seed is None:
        raise ValueError("dropout_seed is required when dropout_p > 0")
    keep = dropout_mask(shape, dropout_p, dropout_seed)
    return np.where(keep, 1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0, 0.0)


def _softmax_rows(s: NDArray) -> tuple[NDArray, NDArray]:
    """Row softmax of float64 scores with -inf exclusions: (weights, lse); dead rows give 0, -inf."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    den = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(den > 0, e / den, 0.0)
        lse = np.where(den[..., 0] > 0, m_safe[..., 0] + np.log(den[..., 0]), -np.inf)
    return p, lse


def additive_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    w_query: npt.ArrayLike,
    w_key: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    bias: npt.ArrayLike | None = None,
    attn_mask: npt.ArrayLike | None = None,
    return_weights: bool = False,
    num_threads: int | None = None,
) -> NDArray | tuple[NDArray, NDArray]:
    """Bahdanau attention the textbook way: the (..., L, S, A) tanh tensor, then v.

    Parameters
    ----------
    query, key, value, w_query, w_key, v : array_like
        As for :func:`fastattn.additive_attention`.
    bias, attn_mask, return_weights : optional
        As for :func:`fastattn.additive_attention`.
    num_threads : optional
        Accepted for the same signature; ignored.

    Returns
    -------
    out : ndarray
        ``(..., L, Dv)`` float64.
    weights : ndarray
        ``(..., L, S)`` float64; only with ``return_weights=True``.

    Examples
    --------
    >>> from fastattn import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 4, 8))
    >>> wq, wk = rng.standard_normal((2, 6, 8))
    >>> vec = rng.standard_normal(6)
    >>> ref = reference.additive_attention(q, k, v, wq, wk, vec)
    >>> bool(np.allclose(fastattn.additive_attention(q, k, v, wq, wk, vec), ref))
    True
    """
    q, k, val = _f64(query), _f64(key), _f64(value)
    pq = q @ _f64(w_query).T  # (..., L, A)
    if bias is not None:
        pq = pq + _f64(bias)
    pk = k @ _f64(w_key).T  # (..., S, A)
    e = np.tanh(pq[..., :, None, :] + pk[..., None, :, :]) @ _f64(v)  # (..., L, S)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        e = np.where(m, e, -np.inf) if m.dtype == bool else e + m.astype(np.float64)
    p, _ = _softmax_rows(e)
    o = p @ val
    return (o, p) if return_weights else o


def lsh_rotations(seed: int | None, n_hashes: int, head_dim: int, n_buckets: int) -> NDArray:
    """The rotations a seed stands for (the documented recipe of fastattn.lsh_attention)."""
    return np.random.default_rng(seed).standard_normal((n_hashes, head_dim, n_buckets // 2))


def lsh_attention(
    qk: npt.ArrayLike,
    value: npt.ArrayLike,
    *,
    n_buckets: int,
    n_hashes: int = 1,
    chunk_size: int = 64,
    causal: bool = False,
    scale: float | None = None,
    seed: int | None = None,
    rotations: npt.ArrayLike | None = None,
    return_lse: bool = False,
    num_threads: int | None = None,
) -> NDArray | tuple[NDArray, NDArray]:
    """Reformer LSH attention, one chunk at a time, each rule written out.

    Parameters
    ----------
    qk, value : array_like
        As for :func:`fastattn.lsh_attention`.
    n_buckets, n_hashes, chunk_size, causal, scale, seed, rotations, return_lse : optional
        As for :func:`fastattn.lsh_attention`.
    num_threads : optional
        Accepted for the same signature; ignored.

    Returns
    -------
    out : ndarray
        ``(..., L, Dv)`` float64.
    lse : ndarray
        ``(..., L)`` float64; only with ``return_lse=True``.

    Examples
    --------
    >>> from fastattn import reference
    >>> qk, v = np.random.default_rng(0).standard_normal((2, 8, 4))
    >>> ref = reference.lsh_attention(qk, v, n_buckets=4, n_hashes=2, chunk_size=4, seed=1)
    >>> out = fastattn.lsh_attention(qk, v, n_buckets=4, n_hashes=2, chunk_size=4, seed=1)
    >>> bool(np.allclose(out, ref))
    True
    """
    x, val = _f64(qk), _f64(value)
    lead, (L, D) = x.shape[:-2], x.shape[-2:]
    R = _f64(rotations) if rotations is not None else lsh_rotations(seed, n_hashes, D, n_buckets)
    sc = 1.0 / np.sqrt(D) if scale is None else float(scale)
    xb = x.reshape((-1, L, D))
    vb = val.reshape((-1, L, val.shape[-1]))
    out = np.zeros(vb.shape)
    lse_all = np.zeros(xb.shape[:2])
    nc = L // chunk_size
    for b in range(xb.shape[0]):
        xs = xb[b]
        norms = np.linalg.norm(xs, axis=-1, keepdims=True)
        khat = np.where(norms > 0, xs / np.where(norms > 0, norms, 1.0), 0.0)
        outs, lses = [], []
        for r in range(R.shape[0]):
            proj = xs @ R[r]
            bucket = np.argmax(np.concatenate([proj, -proj], axis=-1), axis=-1)
            order = np.lexsort((np.arange(L), bucket))  # by bucket, then position
            o_r, l_r = np.zeros((L, vb.shape[-1])), np.zeros(L)
            for c in range(nc):
                qi = order[c * chunk_size : (c + 1) * chunk_size]
                chunks = [c] if nc == 1 else [(c - 1) % nc, c]
                kj = np.concatenate([order[cc * chunk_size : (cc + 1) * chunk_size] for cc in chunks])
                s = (xs[qi] @ khat[kj].T) * sc
                s = np.where(qi[:, None] == kj[None, :], -1e5, s)  # self only when nothing else
                if causal:
                    s = np.where(kj[None, :] > qi[:, None], -np.inf, s)
                p, lse = _softmax_rows(s)
                o_r[qi] = p @ vb[b][kj]
                l_r[qi] = lse
            outs.append(o_r)
            lses.append(l_r)
        lse_rounds = np.stack(lses)  # (rounds, L)
        tot = np.logaddexp.reduce(lse_rounds, axis=0)
        w = np.exp(lse_rounds - tot)
        out[b] = np.einsum("rl,rld->ld", w, np.stack(outs))
        lse_all[b] = tot
    o = out.reshape(lead + (L, vb.shape[-1]))
    return (o, lse_all.reshape(lead + (L,))) if return_lse else o


def sinusoidal_positions(length: int, dim: int, base: float = 10000.0) -> NDArray:
    """The sinusoidal table one entry at a time, in float64.

    Parameters
    ----------
    length, dim, base
        As for :func:`fastattn.sinusoidal_positions`.

    Returns
    -------
    ndarray
        ``(length, dim)`` float64.

    Examples
    --------
    >>> from fastattn import reference
    >>> ref = reference.sinusoidal_positions(5, 6)
    >>> bool(np.allclose(fastattn.sinusoidal_positions(5, 6, dtype=np.float64), ref))
    True
    """
    pe = np.zeros((length, dim))
    for p in range(length):
        for c in range(dim):
            i2 = c - (c % 2)  # 2i
            a = p / base ** (i2 / dim)
            pe[p, c] = np.sin(a) if c % 2 == 0 else np.cos(a)
    return pe


def rotary_cos_sin(length: int, rotary_dim: int, base: float = 10000.0) -> tuple[NDArray, NDArray]:
    """The rotary tables in float64.

    Parameters
    ----------
    length, rotary_dim, base
        As for :func:`fastattn.rotary_cos_sin`.

    Returns
    -------
    cos, sin : ndarray
        ``(length, rotary_dim // 2)`` float64.

    Examples
    --------
    >>> from fastattn import reference
    >>> cos, sin = reference.rotary_cos_sin(5, 4)
    >>> bool(np.allclose(fastattn.rotary_cos_sin(5, 4, dtype=np.float64)[1], sin))
    True
    """
    theta = base ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    ang = np.arange(length)[:, None] * theta[None, :]
    return np.cos(ang), np.sin(ang)


def apply_rotary(
    x: npt.ArrayLike,
    cos: npt.ArrayLike,
    sin: npt.ArrayLike,
    *,
    positions: npt.ArrayLike | None = None,
    interleaved: bool = False,
    layout: str = "bhsd",
) -> NDArray:
    """Rotation written with explicit feature pairs: pair (i, i + h) (NeoX) or (2i, 2i+1) (GPT-J).

    Parameters
    ----------
    x, cos, sin : array_like
        As for :func:`fastattn.apply_rotary`.
    positions, interleaved, layout : optional
        As for :func:`fastattn.apply_rotary`.

    Returns
    -------
    ndarray
        The rotated x, float64.

    Examples
    --------
    >>> from fastattn import reference
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 4))
    >>> cos, sin = reference.rotary_cos_sin(5, 4)
    >>> ref = reference.apply_rotary(x, cos, sin, interleaved=True)
    >>> bool(np.allclose(fastattn.apply_rotary(x, cos, sin, interleaved=True), ref))
    True
    """
    x = _f64(x)
    cos, sin = _f64(cos), _f64(sin)
    xh = np.swapaxes(x, -2, -3) if layout == "bshd" else (x[None] if x.ndim == 2 else x)
    L, h = xh.shape[-2], cos.shape[1]
    pos = np.arange(L) if positions is None else np.asarray(positions)
    pos = np.broadcast_to(pos, xh.shape[:-3] + (L,))[..., None, :]  # (..., 1, L): shared by heads
    c, s = cos[pos], sin[pos]  # (..., 1, L, h)
    out = xh.copy()
    a_idx = np.arange(0, 2 * h, 2) if interleaved else np.arange(h)
    b_idx = a_idx + 1 if interleaved else a_idx + h
    xa, xb = xh[..., a_idx], xh[..., b_idx]
    out[..., a_idx] = xa * c - xb * s
    out[..., b_idx] = xb * c + xa * s
    if layout == "bshd":
        return np.swapaxes(out, -2, -3)
    return out[0] if x.ndim == 2 else out


def attention_weights(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    attn_mask: npt.ArrayLike | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rows: npt.ArrayLike | None = None,
    layout: str = "bhsd",
    **options: Any,
) -> NDArray:
    """The weights as the output of attention over the identity: softmax(scores) @ I = softmax(scores).

    Parameters
    ----------
    query, key : array_like
        As for :func:`fastattn.attention_weights`.
    attn_mask, is_causal, scale, enable_gqa, rows, layout : optional
        As for :func:`fastattn.attention_weights`.
    **options
        The other score options of :func:`fastattn.scaled_dot_product_attention`.

    Returns
    -------
    ndarray
        ``(..., Hq, R, S)`` float64 weights.

    Examples
    --------
    >>> from fastattn import reference
    >>> q, k = np.random.default_rng(0).standard_normal((2, 2, 4, 8))
    >>> ref = reference.attention_weights(q, k, is_causal=True)
    >>> bool(np.allclose(fastattn.attention_weights(q, k, is_causal=True), ref))
    True
    """
    k = _f64(key)
    S = k.shape[-3] if layout == "bshd" else k.shape[-2]
    eye = np.eye(S)
    if layout == "bshd":  # value (..., S, Hk, S): value[..., s, h, :] = e_s
        v = np.broadcast_to(eye[:, None, :], k.shape[:-1] + (S,))
    else:
        v = np.broadcast_to(eye, k.shape[:-1] + (S,))
    w = cast(
        NDArray,
        scaled_dot_product_attention(
            query, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa, layout=layout, **options
        ),
    )
    if layout == "bshd":
        w = np.swapaxes(w, -2, -3)
    elif w.ndim == 2:
        w = w[None]
    return w if rows is None else w[..., np.asarray(rows), :]
