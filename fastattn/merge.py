"""Combining partial attention results computed over disjoint key sets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._checks import as_array

__all__ = ["merge_attention_states"]


def merge_attention_states(
    outs: Sequence[npt.ArrayLike] | npt.NDArray[Any],
    lses: Sequence[npt.ArrayLike] | npt.NDArray[Any],
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Merge partial attention outputs with the log-sum-exp rule.

    Part p attended over a disjoint subset of the keys and produced ``outs[p]``
    (shape ``(..., L, Dv)``, already normalised) and ``lses[p]`` (shape
    ``(..., L)``, natural log of its softmax denominator, -inf for a part that
    saw no key).  The result equals attention over the union of the keys::

        lse = log(sum_p exp(lse_p));  out = sum_p exp(lse_p - lse) * out_p

    ``outs`` and ``lses`` are sequences of arrays (or arrays with the parts on
    axis 0).  Returns ``(out, lse)``; rows where every part is -inf give zeros
    and -inf.  Computed in float64 for float64 parts, else float32; ``out``
    keeps the dtype of the first part.  A NaN LSE gives a NaN row; a +inf LSE
    (an overflowed denominator) gives NaN outputs and a +inf LSE.

    Parameters
    ----------
    outs : sequence of array_like, or ndarray
        The parts' outputs, each ``(..., L, Dv)``.
    lses : sequence of array_like, or ndarray
        The parts' log-sum-exps, each ``(..., L)``.

    Returns
    -------
    out : ndarray
        ``(..., L, Dv)``, attention over all the parts' keys.
    lse : ndarray
        ``(..., L)``, its log-sum-exp.

    Examples
    --------
    Attention over 10 keys, computed as two parts of 4 and 6 keys:

    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 3, 8))
    >>> k, v = rng.standard_normal((2, 2, 10, 8))
    >>> o1, l1 = fastattn.scaled_dot_product_attention(q, k[:, :4], v[:, :4], return_lse=True)
    >>> o2, l2 = fastattn.scaled_dot_product_attention(q, k[:, 4:], v[:, 4:], return_lse=True)
    >>> out, lse = fastattn.merge_attention_states([o1, o2], [l1, l2])
    >>> full = fastattn.scaled_dot_product_attention(q, k, v)
    >>> bool(np.allclose(out, full))
    True
    """
    if isinstance(outs, np.ndarray):
        outs = list(outs)
    if isinstance(lses, np.ndarray):
        lses = list(lses)
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outs and lses must be sequences of arrays")
    if len(outs) == 0:
        raise ValueError("outs must hold at least one part")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have the same number of parts, got {len(outs)} and {len(lses)}")
    o = [as_array(x, f"outs[{i}]") for i, x in enumerate(outs)]
    s = [as_array(x, f"lses[{i}]") for i, x in enumerate(lses)]
    for i, (a, b) in enumerate(zip(o, s)):
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise TypeError(f"outs[{i}] must be floating, got {a.dtype}")
        if b.dtype.kind != "f":
            raise TypeError(f"lses[{i}] must be floating, got {b.dtype}")
        if a.ndim < 1 or a.shape != o[0].shape:
            raise ValueError(f"outs[{i}] has shape {a.shape}, expected {o[0].shape}")
        if b.shape != a.shape[:-1]:
            raise ValueError(f"lses[{i}] has shape {b.shape}, expected {a.shape[:-1]}")
    cdt = np.float64 if o[0].dtype == np.float64 else np.float32
    L = np.stack([b.astype(cdt, copy=False) for b in s])  # (P, ..., L)
    M = np.max(L, axis=0)
    live = np.isfinite(M)
    Ms = np.where(live, M, 0.0).astype(cdt)
    with np.errstate(invalid="ignore"):
        w = np.exp(L - Ms)  # parts at -inf weigh 0
    w = np.where(np.isneginf(L), 0.0, w).astype(cdt)
    den = w.sum(axis=0)
    out = np.zeros(o[0].shape, dtype=cdt)
    for p, a in enumerate(o):
        wp = w[p][..., None]
        out += np.where(wp > 0, wp * a.astype(cdt, copy=False), 0.0).astype(cdt)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(live[..., None], out / den[..., None], 0.0)
        lse = np.where(live, Ms + np.log(den), M)
    # NaN anywhere poisons the row; an overflowed (+inf) LSE leaves the weights undefined: NaN output.
    nan = np.isnan(M) | np.isposinf(M)
    out = np.where(nan[..., None], np.nan, out)
    return out.astype(o[0].dtype, copy=False), lse.astype(cdt, copy=False)
