"""Additive (Bahdanau) attention: ``e_ij = v . tanh(W_q q_i + W_k k_j + b)``.

The alignment model of Bahdanau et al. (2015), still the attention of seq2seq
speech models (Tacotron 2, listen-attend-spell).  The two projections are
GEMMs (NumPy/BLAS); the ``L x S x A`` tanh term runs in a fused, tiled C
kernel (``csrc/additive_impl.h``) with a vectorised tanh and an online
softmax, so the ``(L, S, A)`` tensor of the textbook formulation never exists.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _family
from ._checks import F32, F64, as_array, threads_value
from ._config import get_isa, get_num_threads

__all__ = ["additive_attention"]

_MASK_BOOL, _MASK_F32, _MASK_F64 = 1, 2, 3

NDArray = npt.NDArray[Any]


def _param(x: object, name: str, shape: tuple[int, ...], cdt: np.dtype[Any]) -> NDArray:
    a = as_array(x, name)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must be a real array, got dtype {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return np.ascontiguousarray(a, dtype=cdt)


def _merge(a: NDArray, shape: tuple[int, ...]) -> NDArray:
    """a reshaped to shape as a view, or a contiguous copy when the strides cannot merge."""
    try:
        return np.reshape(a, shape, copy=False)
    except ValueError:
        return np.ascontiguousarray(a).reshape(shape)


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
    """Additive attention: ``softmax_j(e_ij + mask) @ value`` with
    ``e_ij = sum_a v[a] tanh((query_i @ w_query.T)[a] + (key_j @ w_key.T)[a] + bias[a])``.

    query ``(..., L, Dq)``, key ``(..., S, Dk)``, value ``(..., S, Dv)`` (the
    batch dims ``...`` broadcast), all float32 or all float64; ``w_query (A,
    Dq)``, ``w_key (A, Dk)``, ``v (A,)``, ``bias (A,)`` (None: zeros), any real
    dtype, used in the compute dtype (query's).

    attn_mask: bool (True = may attend) or float (added to the scores; -inf
        excludes), broadcastable to ``(..., L, S)``.  A row whose keys are all
        excluded gives zeros (and zero weights); a row with a NaN or +inf
        score (a +inf mask entry, an infinite ``v``) gives NaN (and NaN
        weights), as a softmax does.
    return_weights: also return the softmax weights ``(..., L, S)`` (compute
        dtype), the ones that produced the output.
    num_threads: threads for this call; None uses ``fastattn.get_num_threads()``.
        Results are bit-identical for every thread count.

    Returns the output ``(..., L, Dv)`` in query's dtype (and the weights).

    Parameters
    ----------
    query : array_like
        ``(..., L, Dq)``, float32 or float64.
    key : array_like
        ``(..., S, Dk)``, query's dtype.
    value : array_like
        ``(..., S, Dv)``, query's dtype.
    w_query : array_like
        ``(A, Dq)`` query projection.
    w_key : array_like
        ``(A, Dk)`` key projection.
    v : array_like
        ``(A,)`` scoring vector.
    bias : array_like, optional
        ``(A,)``; None means zeros.
    attn_mask : array_like, optional
        Bool (True = may attend) or float (added), broadcastable to ``(..., L, S)``.
    return_weights : bool, default False
        Also return the softmax weights ``(..., L, S)``.
    num_threads : int, optional
        Threads for this call; None uses :func:`fastattn.get_num_threads`.

    Returns
    -------
    out : ndarray
        ``(..., L, Dv)`` in query's dtype.
    weights : ndarray
        ``(..., L, S)`` in the compute dtype; only with ``return_weights=True``.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 3, 4))
    >>> k, v = rng.standard_normal((2, 2, 5, 4))
    >>> wq, wk = rng.standard_normal((2, 6, 4))
    >>> vec = rng.standard_normal(6)
    >>> out, w = fastattn.additive_attention(q, k, v, wq, wk, vec, return_weights=True)
    >>> out.shape, w.shape
    ((2, 3, 4), (2, 3, 5))
    >>> e = np.tanh((q @ wq.T)[..., :, None, :] + (k @ wk.T)[..., None, :, :]) @ vec
    >>> p = np.exp(e - e.max(-1, keepdims=True))
    >>> bool(np.allclose(w, p / p.sum(-1, keepdims=True))), bool(np.allclose(out, w @ v))
    (True, True)
    """
    q = as_array(query, "query")
    k = as_array(key, "key")
    val = as_array(value, "value")
    for a, n in ((q, "query"), (k, "key"), (val, "value")):
        if a.dtype not in (F32, F64):
            raise TypeError(f"{n} must be float32 or float64, got dtype {a.dtype}")
        if a.ndim < 2:
            raise ValueError(f"{n} must have at least 2 dimensions (..., length, features), got {a.shape}")
    if not (q.dtype == k.dtype == val.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {val.dtype}")
    cdt = q.dtype
    L, Dq = q.shape[-2:]
    S, Dk = k.shape[-2:]
    Sv, Dv = val.shape[-2:]
    if Sv != S:
        raise ValueError(f"key and value must have the same length, got {k.shape} and {val.shape}")
    if min(Dq, Dk, Dv) < 1:
        raise ValueError(f"feature dims must be >= 1, got query {q.shape}, key {k.shape}, value {val.shape}")
    try:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], val.shape[:-2])
    except ValueError:
        raise ValueError(
            f"the batch dims of query {q.shape}, key {k.shape} and value {val.shape} do not broadcast"
        ) from None
    wq = as_array(w_query, "w_query")
    if wq.ndim != 2:
        raise ValueError(f"w_query must have shape (A, {Dq}), got {wq.shape}")
    A = wq.shape[0]
    if A < 1:
        raise ValueError(f"w_query must have at least one row (A >= 1), got {wq.shape}")
    wq = _param(wq, "w_query", (A, Dq), cdt)
    wk = _param(w_key, "w_key", (A, Dk), cdt)
    vv = _param(v, "v", (A,), cdt)
    bb = None if bias is None else _param(bias, "bias", (A,), cdt)
    threads = threads_value(num_threads, get_num_threads)
    if not isinstance(return_weights, (bool, np.bool_)):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    B = math.prod(lead)

    mask, kind = None, 0
    if attn_mask is not None:
        m = as_array(attn_mask, "attn_mask")
        if m.dtype == np.bool_:
            kind = _MASK_BOOL
        elif m.dtype.kind == "f" or m.dtype.name == "bfloat16":
            if m.dtype not in (F32, F64):
                m = m.astype(cdt)
            kind = _MASK_F32 if m.dtype == F32 else _MASK_F64
        else:
            raise TypeError(f"attn_mask must be bool or floating, got dtype {m.dtype}")
        try:
            mb = np.broadcast_to(m, lead + (L, S))
        except ValueError:
            raise ValueError(f"attn_mask of shape {m.shape} does not broadcast to {lead + (L, S)}") from None
        mask = _merge(mb, (B, L, S))
        if not mask.flags.aligned:
            mask = np.ascontiguousarray(mask)

    out_shape = lead + (L, Dv)
    out = np.empty((B, L, Dv), dtype=cdt)
    wts = np.empty((B, L, S), dtype=cdt) if return_weights else None
    if B and L:
        # The projections: two GEMMs; the bias folds into the query side.
        pq = np.matmul(q, wq.T)
        if bb is not None:
            pq += bb
        pkt = np.matmul(wk, np.swapaxes(k, -1, -2))  # (..., A, S): keys along the kernel's vector lanes
        pq = _merge(np.broadcast_to(pq, lead + (L, A)), (B, L, A))
        pkt = _merge(np.broadcast_to(pkt, lead + (A, S)), (B, A, S))
        vb = _merge(np.broadcast_to(val, lead + (S, Dv)), (B, S, Dv))
        if Dv > 1 and vb.strides[-1] != vb.itemsize:
            vb = np.ascontiguousarray(vb)
        pq = pq if pq.strides[-1] == pq.itemsize or A == 1 else np.ascontiguousarray(pq)
        pkt = pkt if pkt.strides[-1] == pkt.itemsize or S <= 1 else np.ascontiguousarray(pkt)
        _family.additive(pq, pkt, vv, vb, out, None, wts, mask, kind, get_isa(), threads)
    elif wts is not None:
        wts[...] = 0
    res = out.reshape(out_shape)
    if wts is not None:  # (return_weights)
        return res, wts.reshape(lead + (L, S))
    return res
