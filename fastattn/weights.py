"""Attention weights for inspection: :func:`attention_weights` and :func:`plot_attention_weights`.

The fused kernel never forms the ``(L, S)`` weight matrix.  For inspection,
:func:`attention_weights` asks the kernel for each row's log-sum-exp (the
normaliser it used) and then recomputes the weights ``exp(score - lse)`` a
tile of query rows at a time, so that the returned weights are the ones that
produced the output, and ``rows`` keeps a long-context map from being forced
into memory: only the selected rows are ever held.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

from ._checks import F64, as_array
from .functional import scaled_dot_product_attention

__all__ = ["attention_weights", "plot_attention_weights"]

_TILE_ELEMS = 1 << 21  # scores held at once while tiling (per call)

NDArray = npt.NDArray[Any]


def _rows_value(rows: npt.ArrayLike | None, L: int) -> npt.NDArray[np.int64]:
    if rows is None:
        return np.arange(L, dtype=np.int64)
    r = as_array(rows, "rows")
    if r.size == 0 and r.dtype.kind == "f" and r.ndim == 1:
        # rows=[] (NumPy makes an empty list float64): no rows selected, an empty result
        return np.zeros(0, dtype=np.int64)
    if r.dtype.kind not in "iu":
        raise TypeError(f"rows must be an integer array of query indices, got dtype {r.dtype}")
    if r.ndim != 1:
        raise ValueError(f"rows must be 1-D, got shape {r.shape}")
    if r.size and (r.min() < 0 or r.max() >= L):
        raise ValueError(f"rows must lie in [0, {L}), got range [{r.min()}, {r.max()}]")
    return r.astype(np.int64)


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
    window: tuple[int, int] | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    key_lengths: npt.ArrayLike | None = None,
    query_lengths: npt.ArrayLike | None = None,
    block_mask: npt.ArrayLike | None = None,
    block_size: tuple[int, int] | None = None,
    num_threads: int | None = None,
) -> NDArray:
    """The softmax weights ``(..., Hq, len(rows), S)`` of
    :func:`fastattn.scaled_dot_product_attention` called with the same score
    options (attn_mask, is_causal, scale, enable_gqa, layout, window,
    alibi_slopes, softcap, sinks, key_lengths, query_lengths, block_mask);
    a bool ``attn_mask`` is True = may attend, a float one is added.

    The scores are recomputed in float64 one tile of rows at a time and
    normalised there (a float64 softmax over the keys the kernel saw, the
    ``sinks`` logits joining the denominator), so each row sums to 1 (less
    what ``sinks`` take) to the output dtype's rounding, whatever the logits'
    magnitude, and ``weights @ value`` is the attention output to the
    kernel's precision.  The kernel's log-sum-exp decides only which rows are
    NaN (a NaN or +inf score) and which have no visible key: those, and
    padded query rows, are zeros.

    rows: query indices (1-D integer array; ``[]`` gives no rows) to return;
    None returns all L.
    Returns float32 (float64 for float64 inputs), shape ``(..., Hq, R, S)``
    for either layout.

    Parameters
    ----------
    query, key : array_like
        As for :func:`fastattn.scaled_dot_product_attention` (no value needed).
    attn_mask, is_causal, scale, enable_gqa, layout, window, alibi_slopes, softcap
        The score options of :func:`fastattn.scaled_dot_product_attention`.
    sinks, key_lengths, query_lengths, block_mask, block_size, num_threads
        As for :func:`fastattn.scaled_dot_product_attention`.
    rows : array_like of int, optional
        The query rows to return; None returns all of them.

    Returns
    -------
    ndarray
        ``(..., Hq, R, S)`` weights, float32 (float64 for float64 inputs).

    See Also
    --------
    plot_attention_weights : Draw them.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 5, 8)).astype(np.float32)
    >>> w = fastattn.attention_weights(q, k, is_causal=True)
    >>> w.shape
    (2, 5, 5)
    >>> bool(np.allclose(w.sum(-1), 1)), float(w[0, 0, 1])   # causal: row 0 sees key 0 only
    (True, 0.0)
    >>> out = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> bool(np.allclose(w @ v, out, atol=1e-5))
    True
    """
    q = as_array(query, "query")
    k = as_array(key, "key")
    # The kernel's LSE (all checks happen here); a zero value of width 1 keeps P.V free.
    vdt = k.dtype if k.dtype.kind == "f" or k.dtype.name == "bfloat16" else np.float32
    zero_v = np.broadcast_to(np.zeros((), dtype=vdt), k.shape[:-1] + (1,))
    _, lse = scaled_dot_product_attention(
        q,
        k,
        zero_v,
        attn_mask,
        0.0,
        is_causal,
        scale,
        enable_gqa,
        layout=cast(Literal["bhsd", "bshd"], layout),  # (checked by the call)
        return_lse=True,
        num_threads=num_threads,
        window=window,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
        key_lengths=key_lengths,
        query_lengths=query_lengths,
        block_mask=block_mask,
        block_size=block_size,
    )
    # bhsd views; the checks above passed, so the shapes are consistent.
    if layout == "bshd":
        qh, kh = np.swapaxes(q, -2, -3), np.swapaxes(k, -2, -3)
    elif q.ndim == 2:
        qh, kh, lse = q[None], k[None], lse[None]
    else:
        qh, kh = q, k
    lead = qh.shape[:-3]
    Hq, L, D = qh.shape[-3:]
    Hk, S = kh.shape[-3], kh.shape[-2]
    lse = lse.reshape(lead + (Hq, L))
    sel = _rows_value(rows, L)
    cdt = lse.dtype
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    G = Hq // Hk

    # Per-batch lengths and bottom-right positions, broadcast over (..., Hq, R, S).
    Lb = np.full(lead, L) if query_lengths is None else np.asarray(query_lengths)
    Sb = np.full(lead, S) if key_lengths is None else np.asarray(key_lengths)
    Lb = np.asarray(Lb, dtype=np.int64)[..., None, None, None]
    Sb = np.asarray(Sb, dtype=np.int64)[..., None, None, None]
    j = np.arange(S)[None, :]
    mask = None
    if attn_mask is not None:
        mask = np.broadcast_to(as_array(attn_mask, "attn_mask"), lead + (Hq, L, S))
    slopes = None
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=F64), lead + (Hq,))[..., None, None]
    bm = None
    if block_mask is not None:
        assert block_size is not None  # (the call above requires it with block_mask)
        bq, bk = int(block_size[0]), int(block_size[1])
        bm = np.broadcast_to(np.asarray(block_mask), lead + (Hq, -(-L // bq), -(-S // bk)))
    sink = None  # (Hq, 1, 1) float64 logits in each row's denominator
    if sinks is not None:
        sink = np.asarray(sinks, dtype=F64).reshape(Hq, 1, 1)
    kf = np.repeat(kh.astype(F64), G, axis=-3) if G > 1 else kh.astype(F64)  # (..., Hq, S, D)

    out = np.empty(lead + (Hq, sel.size, S), dtype=cdt)
    per_row = max(1, math.prod(lead) * Hq * S)
    tile = max(1, _TILE_ELEMS // per_row)
    for t0 in range(0, sel.size, tile):
        ri = sel[t0 : t0 + tile]
        i = ri[:, None]
        s = np.matmul(qh[..., ri, :].astype(F64), np.swapaxes(kf, -1, -2)) * sc  # (..., Hq, R, S)
        if softcap is not None:
            s = float(softcap) * np.tanh(s / float(softcap))
        ipos = i + (Sb - Lb)
        if slopes is not None:
            s = s - slopes * np.abs(ipos - j)
        if mask is not None:
            m = mask[..., ri, :]
            s = np.where(m, s, -np.inf) if m.dtype == np.bool_ else s + m.astype(F64)
        allowed = (j < Sb) & (i < Lb)
        if is_causal:
            allowed = allowed & (j <= ipos)
        if window is not None:
            left, right = window
            if left >= 0:
                allowed = allowed & (j >= ipos - left)
            if right >= 0:
                allowed = allowed & (j <= ipos + right)
        if bm is not None:
            allowed = allowed & np.take(bm[..., ri // bq, :], j[0] // bk, axis=-1)
        lt = lse[..., ri].astype(F64)[..., None]
        # Normalise in float64 here rather than with the kernel's LSE: a float32 LSE
        # is off by ~|logit| * 2**-24, which at logits ~1e4 left rows summing to
        # 0.998-1.002 (exp of an absolute error is a relative error).
        z = np.where(allowed & np.isfinite(lt), s, -np.inf)
        mx = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
        if sink is not None:
            mx = np.maximum(mx, sink)
        mx = np.where(np.isfinite(mx), mx, 0.0)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            e = np.exp(z - mx)
            den = np.sum(e, axis=-1, keepdims=True)
            if sink is not None:
                den = den + np.exp(sink - mx)
            w = np.where(den > 0, e / den, 0.0)
        w = np.where(np.isnan(lt), np.nan, w)  # a NaN row stays NaN, as in the output
        out[..., t0 : t0 + ri.size, :] = w
    return out


def plot_attention_weights(
    weights: npt.ArrayLike,
    *,
    heads: Any = None,
    ncols: int = 4,
    ax: Any = None,
    cmap: str = "viridis",
    titles: Any = None,
    query_labels: Any = None,
    key_labels: Any = None,
) -> Any:
    """Draw attention maps with matplotlib (imported only here; optional).

    weights: ``(L, S)`` (one map) or ``(H, L, S)`` (a grid of heads; ``heads``
    selects some of them), e.g. ``attention_weights(...)[0]``.  ``ax`` (one
    map only) draws into an existing Axes.  Rows are queries, columns keys.
    Returns the matplotlib Figure.

    Parameters
    ----------
    weights : array_like
        ``(L, S)`` (one map) or ``(H, L, S)`` (a grid of heads).
    heads : sequence of int, optional
        The heads of a ``(H, L, S)`` grid to draw; None draws all.
    ncols : int, default 4
        Columns of the grid.
    ax : matplotlib.axes.Axes, optional
        Axes to draw one ``(L, S)`` map into; None makes a new figure.
    cmap : str, default "viridis"
        Matplotlib colormap name.
    titles : str or sequence of str, optional
        Title of the map, or one per drawn head (default ``"head h"``).
    query_labels, key_labels : sequence of str, optional
        Tick labels of the rows and columns (one map only).

    Returns
    -------
    matplotlib.figure.Figure
        The figure drawn into.

    Examples
    --------
    Needs matplotlib.

    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
    >>> w = fastattn.attention_weights(q, k, is_causal=True)
    >>> fig = fastattn.plot_attention_weights(w, ncols=2)  # doctest: +SKIP
    >>> fig.savefig("weights.png")  # doctest: +SKIP
    """
    try:
        # (by name: matplotlib is optional, and its types, where installed, are not needed here)
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plot_attention_weights needs matplotlib (pip install matplotlib)") from e
    w = np.asarray(weights)
    if w.ndim not in (2, 3):
        raise ValueError(f"weights must be (L, S) or (H, L, S), got shape {w.shape}")
    if w.ndim == 2:
        if ax is None:
            fig, ax = plt.subplots(figsize=(5, 4))
        else:
            fig = ax.figure
        im = ax.imshow(w, cmap=cmap, aspect="auto", interpolation="nearest")
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        if titles:
            ax.set_title(titles if isinstance(titles, str) else titles[0])
        if query_labels is not None:
            ax.set_yticks(range(len(query_labels)), labels=list(query_labels))
        if key_labels is not None:
            ax.set_xticks(range(len(key_labels)), labels=list(key_labels), rotation=90)
        fig.colorbar(im, ax=ax)
        return fig
    if ax is not None:
        raise ValueError("ax draws one map; pass (L, S) weights or leave ax=None for a grid")
    hs = list(range(w.shape[0])) if heads is None else [int(h) for h in heads]
    for h in hs:
        if not 0 <= h < w.shape[0]:
            raise ValueError(f"heads must lie in [0, {w.shape[0]}), got {h}")
    n = len(hs)
    nc = max(1, min(int(ncols), n))
    nr = -(-n // nc)
    fig, axes = plt.subplots(nr, nc, figsize=(3 * nc, 2.6 * nr), squeeze=False)
    vmax = float(np.nanmax(w[hs])) if n and w[hs].size else 1.0
    for a in axes.ravel()[n:]:
        a.axis("off")
    for a, h, t in zip(axes.ravel(), hs, titles or [f"head {h}" for h in hs]):
        a.imshow(w[h], cmap=cmap, aspect="auto", interpolation="nearest", vmin=0.0, vmax=vmax)
        a.set_title(t)
        a.set_xticks([])
        a.set_yticks([])
    return fig
