"""Reformer's LSH attention (Kitaev et al. 2020): shared-QK attention within hash buckets.

Per hash round, tokens are hashed by a random rotation (``bucket = argmax([x R,
-x R])``), stably sorted by (bucket, position) and split into chunks; chunk c
attends to chunks c and c - 1 (chunk 0 to the last one).  Keys are the qk
vectors normalised to unit length; a token attends to itself only when it has
no other key (its self score is -1e5, as in Reformer).  The rounds are
combined with their log-sum-exp weights.  Cost is O(L * chunk) per round,
never O(L^2), and memory O(L) beyond the inputs and the result: the whole
computation is one call of the C kernels (csrc/lsh_impl.h, driver in
csrc/family.c): the hash as a register-blocked projection with the argmax
in C, the stable sort as a counting sort over the buckets, and a fused
chunk kernel that reads its rows by index, applies the self and causal rules
in place and merges each round into the result by log-sum-exp.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import numpy.typing as npt

from . import _family
from ._checks import F32, F64, as_array, int_value, scale_value, threads_value
from ._config import get_isa, get_num_threads

__all__ = ["lsh_attention", "lsh_rotations"]

SELF_SCORE = -1e5  # Reformer's score of a token for itself (csrc/lsh_impl.h: LSH_SELF)
_MAX_LEN = 2**31 - 1  # positions and buckets are int32 in the kernels


def lsh_rotations(seed: int | None, n_hashes: int, head_dim: int, n_buckets: int) -> np.ndarray:
    """The random rotations ``(n_hashes, head_dim, n_buckets // 2)`` drawn for ``seed``:
    ``numpy.random.default_rng(seed).standard_normal(...)`` in float64."""
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
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Reformer LSH attention with shared queries and keys.

    qk ``(..., L, D)`` and value ``(..., L, Dv)``, float32 or float64 (the same
    dtype and batch dims).  Keys are ``qk / |qk|`` (a zero vector stays zero);
    score ``qk_i . khat_j * scale`` (scale None: ``1/sqrt(D)``).

    Parameters
    ----------
    qk : array_like
        ``(..., L, D)`` shared queries and keys, float32 or float64.
    value : array_like
        ``(..., L, Dv)``, qk's dtype and batch dims.
    n_buckets : int
        Even, >= 2.  Per hash round, bucket = argmax of ``[x R, -x R]``
        with R ``(D, n_buckets/2)``: ``rotations[r]`` when ``rotations``
        ``(n_hashes, D, n_buckets/2)`` is given, else drawn from ``seed``
        (:func:`lsh_rotations`; None draws fresh ones).  Hashing runs in the
        inputs' dtype.
    n_hashes : int, default 1
        Hash rounds; their results combine by log-sum-exp.
    chunk_size : int, default 64
        L must be a multiple of it.  Chunk c of the sorted order
        attends to chunks c and c-1, chunk 0 to itself and the last chunk (a
        single chunk attends to itself only).
    causal : bool, default False
        Key j is excluded when its original position is after query i's.
    scale : float, optional
        Score scale; None means ``1/sqrt(D)``.
    seed : int, optional
        Seed of the rotations (:func:`lsh_rotations`); not with ``rotations``.
    rotations : array_like, optional
        ``(n_hashes, D, n_buckets/2)`` rotations to hash with, instead of ``seed``.
    return_lse : bool, default False
        Also return the combined log-sum-exp ``(..., L)`` (compute dtype).
    num_threads : int, optional
        Threads for this call; None uses :func:`fastattn.get_num_threads`.

    Returns
    -------
    out : ndarray
        ``(..., L, Dv)`` in qk's dtype.
    lse : ndarray
        Only with ``return_lse=True``.

    Examples
    --------
    One chunk holding the whole sequence: every token sees every other one, and
    itself only at Reformer's score of -1e5.

    >>> rng = np.random.default_rng(0)
    >>> qk, v = rng.standard_normal((2, 8, 4))
    >>> out = fastattn.lsh_attention(qk, v, n_buckets=2, chunk_size=8, seed=0)
    >>> out.shape
    (8, 4)
    >>> khat = qk / np.linalg.norm(qk, axis=-1, keepdims=True)
    >>> s = qk @ khat.T / 2.0
    >>> np.fill_diagonal(s, -1e5)
    >>> p = np.exp(s - s.max(-1, keepdims=True))
    >>> bool(np.allclose(out, p / p.sum(-1, keepdims=True) @ v))
    True
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
    if nb > _MAX_LEN:
        raise ValueError(f"n_buckets must be below 2**31, got {nb}")
    nh = int_value(n_hashes, "n_hashes", 1)
    ch = int_value(chunk_size, "chunk_size", 1)
    if L % ch:
        raise ValueError(f"the length L = {L} must be a multiple of chunk_size = {ch}")
    if L > _MAX_LEN:
        raise ValueError(f"the length L = {L} must be below 2**31")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    # The scale's limit is the compute dtype's: float64 inputs run the float64 kernels.
    sc = scale_value(scale, D, x.dtype)
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
    # The kernels read rows through strides (elements) with a contiguous last dim.
    xb = x.reshape((B, L, D))
    vb = val.reshape((B, L, Dv))
    if xb.strides[-1] != xb.itemsize:
        xb = np.ascontiguousarray(xb)
    if vb.strides[-1] != vb.itemsize:
        vb = np.ascontiguousarray(vb)
    out = np.zeros((B, L, Dv), dtype=cdt)
    # The rounds' LSEs combine in float64: a token that saw only itself sits near -1e5,
    # where a float32 log-sum-exp would lose the weights (its ulp there is 0.008).
    lse = np.full((B, L), -np.inf, dtype=F64)
    if B * L > 0:
        _family.lsh(xb, vb, rot, out, lse, nb, nh, ch, bool(causal), sc, get_isa(), threads)
    res = out.reshape(lead + (L, Dv))
    if return_lse:
        return res, lse.astype(cdt).reshape(lead + (L,))
    return res
