"""Reformer's LSH attention (Kitaev et al. 2020): shared-QK attention within hash buckets.

Per hash round, tokens are hashed by a random rotation (``bucket = argmax([x R,
-x R])``), stably sorted by (bucket, position) and split into chunks; chunk c
attends to chunks c and c - 1 (chunk 0 to the last one).  Keys are the qk
vectors normalised to unit length; a token attends to itself only when it has
no other key (its self score is -1e5, as in Reformer).  The rounds are
combined with their log-sum-exp weights.  Cost and memory are O(L * chunk)
per round, never O(L^2): the chunks are gathered a group at a time and each
group is one call of the fused kernel (:func:`fastattn.scaled_dot_product_attention`
with a float mask carrying the self and causal rules).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import numpy.typing as npt

from ._checks import F32, F64, as_array, int_value, scale_value, threads_value
from ._config import get_num_threads
from .functional import scaled_dot_product_attention

__all__ = ["lsh_attention", "lsh_rotations"]

SELF_SCORE = -1e5  # Reformer's score of a token for itself
_GROUP_ROWS = 4096  # query rows gathered per kernel call (bounds the scratch, not the result)


def lsh_rotations(seed: int | None, n_hashes: int, head_dim: int, n_buckets: int) -> np.ndarray:
    """The random rotations ``(n_hashes, head_dim, n_buckets // 2)`` drawn for ``seed``:
    ``numpy.random.default_rng(seed).standard_normal(...)`` in float64."""
    return np.random.default_rng(seed).standard_normal((n_hashes, head_dim, n_buckets // 2))


def _buckets(x, rot):
    """argmax over [x R, -x R] (the first index on ties, as argmax of the concatenation)."""
    proj = x @ rot
    hi, lo = proj.argmax(axis=-1), proj.argmin(axis=-1)
    up = np.take_along_axis(proj, hi[:, None], axis=-1)[:, 0]
    dn = -np.take_along_axis(proj, lo[:, None], axis=-1)[:, 0]
    return np.where(up >= dn, hi, rot.shape[-1] + lo)


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
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Reformer LSH attention with shared queries and keys.

    qk ``(..., L, D)`` and value ``(..., L, Dv)``, float32 or float64 (the same
    dtype and batch dims).  Keys are ``qk / |qk|`` (a zero vector stays zero);
    score ``qk_i . khat_j * scale`` (scale None: ``1/sqrt(D)``).

    n_buckets: even, >= 2.  Per hash round, bucket = argmax of ``[x R, -x R]``
        with R ``(D, n_buckets/2)``: ``rotations[r]`` when ``rotations``
        ``(n_hashes, D, n_buckets/2)`` is given, else drawn from ``seed``
        (:func:`lsh_rotations`; None draws fresh ones).  Hashing runs in the
        inputs' dtype.
    chunk_size: L must be a multiple of it.  Chunk c of the sorted order
        attends to chunks c and c-1, chunk 0 to itself and the last chunk (a
        single chunk attends to itself only).
    causal: key j is excluded when its original position is after query i's.
    return_lse: also return the combined log-sum-exp ``(..., L)`` (compute dtype).

    Returns ``(..., L, Dv)`` in qk's dtype.
    """
    x = as_array(qk, "qk")
    val = as_array(value, "value")
    for a, n in ((x, "qk"), (val, "value")):
        if a.dtype not in (F32, F64):
            raise TypeError(f"{n} must be float32 or float64, got dtype {a.dtype}")
        if a.ndim < 2:
            raise ValueError(f"{n} must have at least 2 dimensions (..., L, features), got {a.shape}")
    if x.dtype != val.dtype:
        raise TypeError(f"qk and value must share a dtype, got {x.dtype} and {val.dtype}")
    if x.shape[:-1] != val.shape[:-1]:
        raise ValueError(f"qk {x.shape} and value {val.shape} must share their batch dims and length")
    L, D = x.shape[-2:]
    Dv = val.shape[-1]
    if D < 1 or Dv < 1:
        raise ValueError(f"feature dims must be >= 1, got qk {x.shape}, value {val.shape}")
    nb = int_value(n_buckets, "n_buckets", 2)
    if nb % 2:
        raise ValueError(f"n_buckets must be even (buckets are argmax over [xR, -xR]), got {nb}")
    nh = int_value(n_hashes, "n_hashes", 1)
    ch = int_value(chunk_size, "chunk_size", 1)
    if L % ch:
        raise ValueError(f"the length L = {L} must be a multiple of chunk_size = {ch}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    sc = scale_value(scale, D)
    threads = threads_value(num_threads, get_num_threads)
    if rotations is not None:
        if seed is not None:
            raise ValueError("pass seed or rotations, not both")
        rot = as_array(rotations, "rotations")
        if rot.dtype.kind not in "fiu" or rot.dtype == np.bool_:
            raise TypeError(f"rotations must be a real array, got dtype {rot.dtype}")
        if rot.shape != (nh, D, nb // 2):
            raise ValueError(f"rotations must have shape {(nh, D, nb // 2)}, got {rot.shape}")
        if not np.all(np.isfinite(rot)):
            raise ValueError("rotations must be finite")
    else:
        if seed is not None and (
            isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral)
        ):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        rot = lsh_rotations(seed, nh, D, nb)
    cdt = x.dtype
    rot = np.ascontiguousarray(rot, dtype=cdt)

    lead = x.shape[:-2]
    B = math.prod(lead)
    xb = x.reshape((B, L, D))
    vb = val.reshape((B, L, Dv))
    out = np.zeros((B, L, Dv), dtype=cdt)
    # The rounds' LSEs combine in float64: a token that saw only itself sits near -1e5,
    # where a float32 log-sum-exp would lose the weights (its ulp there is 0.008).
    lse = np.full((B, L), -np.inf, dtype=F64)
    if nh > 1:  # one later round's result at a time, in original order
        o_buf = np.empty((L, Dv), dtype=cdt)
        l_buf = np.empty(L, dtype=F64)
    nc = L // ch
    G = max(1, _GROUP_ROWS // ch)  # chunks per kernel call
    ar = np.arange(ch)
    off = 0 if nc == 1 else ch  # the self key of query t sits at key t + off of its window
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for b in range(B):
            xs = xb[b]
            norms = np.sqrt(np.einsum("ld,ld->l", xs, xs))
            inv = np.where(norms > 0, 1.0 / np.where(norms > 0, norms, 1), 0).astype(cdt)
            self_val = (SELF_SCORE - sc * norms.astype(F64)).astype(cdt)
            for r in range(nh):
                order = np.argsort(_buckets(xs, rot[r]), kind="stable")  # by (bucket, position)
                o_dst, l_dst = (out[b], lse[b]) if r == 0 else (o_buf, l_buf)
                for c0 in range(0, nc, G):
                    c1 = min(nc, c0 + G)
                    g = c1 - c0
                    q_idx = order[c0 * ch : c1 * ch]
                    if nc == 1:
                        k_idx = order
                    elif c0 == 0:
                        k_idx = np.concatenate([order[(nc - 1) * ch :], order[: c1 * ch]])
                    else:
                        k_idx = order[(c0 - 1) * ch : c1 * ch]
                    kg = xs[k_idx] * inv[k_idx, None]
                    vg = vb[b][k_idx]
                    isz = kg.itemsize
                    if nc == 1:
                        k4, v4, pk = kg[None, None], vg[None, None], k_idx[None]
                    else:  # window of chunk c = keys [c*ch, c*ch + 2ch) of the gathered rows
                        k4 = np.lib.stride_tricks.as_strided(
                            kg, (1, g, 2 * ch, D), (0, ch * D * isz, D * isz, isz)
                        )
                        v4 = np.lib.stride_tricks.as_strided(
                            vg, (1, g, 2 * ch, Dv), (0, ch * Dv * isz, Dv * isz, isz)
                        )
                        pk = np.lib.stride_tricks.as_strided(k_idx, (g, 2 * ch), (ch * 8, 8))
                    pq = q_idx.reshape(g, ch)
                    nk = pk.shape[-1]
                    if causal:
                        m = np.where(pk[:, None, :] > pq[:, :, None], cdt.type(-np.inf), cdt.type(0))
                    else:
                        m = np.zeros((g, ch, nk), dtype=cdt)
                    # The self score becomes -1e5: the mask cancels the kernel's own score |x| * scale.
                    m[:, ar, ar + off] = self_val[pq]
                    o4, l4 = scaled_dot_product_attention(
                        xs[q_idx].reshape(1, g, ch, D),
                        k4,
                        v4,
                        attn_mask=m[None],
                        scale=sc,
                        return_lse=True,
                        num_threads=threads,
                    )
                    o_g = o4.reshape(g * ch, Dv)
                    l_g = l4.reshape(g * ch).astype(F64)
                    # back to the original positions (round 0 straight into the result)
                    o_dst[q_idx] = o_g
                    l_dst[q_idx] = l_g
                if r > 0:  # combine with the earlier rounds by their log-sum-exp weights
                    l_new = np.logaddexp(lse[b], l_buf)
                    w_old = np.exp(lse[b] - l_new).astype(cdt)[:, None]
                    w_new = np.exp(l_buf - l_new).astype(cdt)[:, None]
                    out[b] *= w_old
                    o_buf *= w_new
                    out[b] += o_buf
                    lse[b] = l_new
    res = out.reshape(lead + (L, Dv))
    if return_lse:
        return res, lse.astype(cdt).reshape(lead + (L,))
    return res
