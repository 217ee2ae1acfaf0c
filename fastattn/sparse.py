"""Block-sparse attention patterns for ``block_mask`` / ``block_size``.

Each builder returns ``(block_mask, block_size)``: a bool array of shape
``(ceil(L/block), ceil(S/block))`` (True = the block of scores is computed,
False = skipped entirely) and the pair ``(block, block)``, ready for::

    bm, bs = fastattn.sparse.strided_pattern(L, S, block=64, stride=4)
    out = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, block_mask=bm, block_size=bs)

The mask is 2-D and broadcasts over batch and heads; stack several masks along
a head axis to give heads different patterns (as the factorised heads of the
Sparse Transformer do).

Geometry.  Query block ``a`` holds query rows ``a*block .. a*block+block-1``,
key block ``c`` holds keys ``c*block .. c*block+block-1``.  Query rows are
aligned to the keys at the bottom right, as ``is_causal`` is: row i sits at key
position ``i + (S - L)``.  The patterns are defined on block indices, so
``S - L`` must be a multiple of ``block``; query block ``a`` then sits on the
*diagonal* key block ``d(a) = a + (S - L) // block`` and ``delta = d(a) - c``
is the block distance (``delta > 0``: the key block lies in the past).

Causality.  With ``causal=True`` no block with ``c > d(a)`` is active.  The
diagonal block still contains keys later than some of its query rows: pass
``is_causal=True`` to the attention call as well so that element-level
causality holds inside the diagonal blocks.  With ``causal=False`` the
patterns are symmetric (bidirectional, encoder-style).

:func:`to_dense` expands a block mask to the ``(L, S)`` element mask it
describes (for checks and for peers without block sparsity).
"""

from __future__ import annotations

import numbers

import numpy as np
import numpy.typing as npt

__all__ = ["strided_pattern", "fixed_pattern", "local_global_pattern", "to_dense"]


def _pos_int(x: object, name: str, minimum: int) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return int(x)


def _grid(L: int, S: int, block: int) -> tuple[int, int, npt.NDArray[np.int_], npt.NDArray[np.int_], int]:
    """Block counts and the (nbq, 1) diagonal / (1, nbk) key-block index grids."""
    L = _pos_int(L, "L", 0)
    S = _pos_int(S, "S", 0)
    block = _pos_int(block, "block", 1)
    if (S - L) % block:
        raise ValueError(
            f"S - L must be a multiple of block for block-level causal alignment, "
            f"got L={L}, S={S}, block={block}"
        )
    nbq, nbk = -(-L // block), -(-S // block)
    diag = (np.arange(nbq) + (S - L) // block)[:, None]
    c = np.arange(nbk)[None, :]
    return nbq, nbk, diag, c, block


def strided_pattern(
    L: int, S: int, block: int, stride: int, *, causal: bool = True, part: str = "both"
) -> tuple[npt.NDArray[np.bool_], tuple[int, int]]:
    """Strided factorised pattern of Sparse Transformers (Child et al. 2019, eq. for
    "strided attention"), in units of blocks: ``stride`` is the period ``l / block``.

    part="local": key blocks with ``0 <= delta < stride`` (the previous ``stride``
    blocks, the diagonal included); non-causal: ``|delta| < stride``.
    part="strided": key blocks with ``delta % stride == 0`` and ``delta >= 0``
    (every ``stride``-th block back from the diagonal); non-causal: any sign.
    part="both": the union (one "merged" head).

    Returns ``(block_mask, (block, block))``, block_mask of shape
    ``(ceil(L/block), ceil(S/block))``.

    Parameters
    ----------
    L, S : int
        Query and key lengths (``S - L`` a multiple of ``block``; causal alignment is bottom-right).
    block : int
        Block size, used for queries and keys.
    stride : int
        The period, in blocks.
    causal : bool, default True
        Drop the blocks after the diagonal.
    part : {"both", "local", "strided"}, default "both"
        Which factor of the pattern.

    Returns
    -------
    block_mask : ndarray of bool
        ``(ceil(L/block), ceil(S/block))``, True = the block is computed.
    block_size : (int, int)
        ``(block, block)``, to pass on as ``block_size``.

    Examples
    --------
    >>> from fastattn import sparse
    >>> bm, bs = sparse.strided_pattern(8, 8, block=2, stride=2)
    >>> bm.astype(int), bs
    (array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [0, 1, 1, 1]]), (2, 2))
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 1, 8, 4)).astype(np.float32)
    >>> out = fastattn.scaled_dot_product_attention(q, k, v, block_mask=bm, block_size=bs)
    >>> dense = fastattn.scaled_dot_product_attention(q, k, v, sparse.to_dense(bm, bs, 8, 8))
    >>> bool(np.allclose(out, dense))
    True
    """
    nbq, nbk, diag, c, block = _grid(L, S, block)
    stride = _pos_int(stride, "stride", 1)
    if part not in ("both", "local", "strided"):
        raise ValueError(f"part must be 'both', 'local' or 'strided', got {part!r}")
    delta = diag - c
    local = np.abs(delta) < stride
    strided = delta % stride == 0
    m = np.zeros((nbq, nbk), dtype=bool)
    if part in ("both", "local"):
        m |= local
    if part in ("both", "strided"):
        m |= strided
    if causal:
        m &= delta >= 0
    return np.broadcast_to(m, (nbq, nbk)).copy(), (block, block)


def fixed_pattern(
    L: int, S: int, block: int, stride: int, num_summary: int = 1, *, causal: bool = True, part: str = "both"
) -> tuple[npt.NDArray[np.bool_], tuple[int, int]]:
    """Fixed factorised pattern of Sparse Transformers (Child et al. 2019), in units of
    blocks: keys are cut into windows of ``stride`` blocks.

    part="local": key blocks in the same window as the diagonal block
    (``c // stride == d(a) // stride``).
    part="summary": the last ``num_summary`` blocks of every window
    (``c % stride >= stride - num_summary``), the "summary" cells every
    later query reads.
    part="both": the union.
    With ``causal=True`` blocks after the diagonal are removed (so a query sees
    the summaries of earlier windows and the causal part of its own window).

    Returns ``(block_mask, (block, block))``.

    Parameters
    ----------
    L, S : int
        Query and key lengths (``S - L`` a multiple of ``block``; causal alignment is bottom-right).
    block : int
        Block size, used for queries and keys.
    stride : int
        Window length, in blocks.
    num_summary : int, default 1
        Summary blocks at the end of each window (<= stride).
    causal : bool, default True
        Drop the blocks after the diagonal.
    part : {"both", "local", "summary"}, default "both"
        Which factor of the pattern.

    Returns
    -------
    block_mask : ndarray of bool
        ``(ceil(L/block), ceil(S/block))``, True = the block is computed.
    block_size : (int, int)
        ``(block, block)``, to pass on as ``block_size``.

    Examples
    --------
    >>> from fastattn import sparse
    >>> bm, bs = sparse.fixed_pattern(8, 8, block=2, stride=2)
    >>> bm.astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 1, 1, 1]])
    """
    nbq, nbk, diag, c, block = _grid(L, S, block)
    stride = _pos_int(stride, "stride", 1)
    num_summary = _pos_int(num_summary, "num_summary", 0)
    if num_summary > stride:
        raise ValueError(f"num_summary must be <= stride ({stride}), got {num_summary}")
    if part not in ("both", "local", "summary"):
        raise ValueError(f"part must be 'both', 'local' or 'summary', got {part!r}")
    local = (c // stride) == (diag // stride)
    summary = (c % stride) >= stride - num_summary
    m = np.zeros((nbq, nbk), dtype=bool)
    if part in ("both", "local"):
        m |= local
    if part in ("both", "summary"):
        m |= summary
    if causal:
        m &= c <= diag
    return np.broadcast_to(m, (nbq, nbk)).copy(), (block, block)


def local_global_pattern(
    L: int,
    S: int,
    block: int,
    window: int,
    num_global: int = 1,
    *,
    causal: bool = False,
    num_random: int = 0,
    seed: int | None = None,
) -> tuple[npt.NDArray[np.bool_], tuple[int, int]]:
    """Sliding window plus global blocks (Longformer / BigBird style).

    Active blocks:

    - window: key blocks with ``|delta| <= window`` (``0 <= delta <= window``
      when causal);
    - global keys: the first ``num_global`` key blocks, read by every query block;
    - global queries: the first ``num_global`` query blocks read every key
      block (non-causal only; with ``causal=True`` they read every block up to
      their diagonal);
    - random (BigBird): ``num_random`` further key blocks per query block, drawn
      without replacement from the blocks not yet active (and not after the
      diagonal when causal) by ``numpy.random.default_rng(seed)``.

    Returns ``(block_mask, (block, block))``.

    Parameters
    ----------
    L, S : int
        Query and key lengths (``S - L`` a multiple of ``block``; causal alignment is bottom-right).
    block : int
        Block size, used for queries and keys.
    window : int
        Window half-width, in blocks.
    num_global : int, default 1
        Global query and key blocks.
    causal : bool, default False
        Drop the blocks after the diagonal.
    num_random : int, default 0
        Random key blocks per query block (BigBird).
    seed : int, optional
        Seed of the random blocks.

    Returns
    -------
    block_mask : ndarray of bool
        ``(ceil(L/block), ceil(S/block))``, True = the block is computed.
    block_size : (int, int)
        ``(block, block)``, to pass on as ``block_size``.

    Examples
    --------
    >>> from fastattn import sparse
    >>> bm, bs = sparse.local_global_pattern(8, 8, block=2, window=1)
    >>> bm.astype(int)
    array([[1, 1, 1, 1],
           [1, 1, 1, 0],
           [1, 1, 1, 1],
           [1, 0, 1, 1]])
    """
    nbq, nbk, diag, c, block = _grid(L, S, block)
    window = _pos_int(window, "window", 0)
    num_global = _pos_int(num_global, "num_global", 0)
    num_random = _pos_int(num_random, "num_random", 0)
    delta = diag - c
    m = (delta >= 0) & (delta <= window) if causal else np.abs(delta) <= window
    m = m | (c < num_global)
    m = m | (np.arange(nbq)[:, None] < num_global)
    if causal:
        m &= delta >= 0
    m = np.broadcast_to(m, (nbq, nbk)).copy()
    if num_random:
        rng = np.random.default_rng(seed)
        for a in range(nbq):
            free = np.flatnonzero(~m[a] & ((c[0] <= diag[a, 0]) if causal else True))
            if free.size:
                pick = rng.choice(free, size=min(num_random, free.size), replace=False)
                m[a, pick] = True
    return m, (block, block)


def to_dense(block_mask: npt.ArrayLike, block_size: tuple[int, int], L: int, S: int) -> npt.NDArray[np.bool_]:
    """The element mask ``(..., L, S)`` a block mask describes: entry (i, j) is
    ``block_mask[..., i // bq, j // bk]``.

    Parameters
    ----------
    block_mask : array_like of bool
        ``(..., ceil(L/bq), ceil(S/bk))``.
    block_size : (int, int)
        ``(bq, bk)``.
    L, S : int
        Query and key lengths.

    Returns
    -------
    ndarray of bool
        ``(..., L, S)``.

    Examples
    --------
    >>> from fastattn import sparse
    >>> sparse.to_dense(np.array([[True, False], [True, True]]), (2, 2), 3, 4).astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 1]])
    """
    bm = np.asarray(block_mask)
    if bm.dtype != np.bool_:
        raise TypeError(f"block_mask must be a bool array, got dtype {bm.dtype}")
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise TypeError(f"block_size must be a (bq, bk) pair of ints, got {block_size!r}")
    bq = _pos_int(block_size[0], "block_size[0]", 1)
    bk = _pos_int(block_size[1], "block_size[1]", 1)
    L = _pos_int(L, "L", 0)
    S = _pos_int(S, "S", 0)
    if bm.ndim < 2 or bm.shape[-2:] != (-(-L // bq), -(-S // bk)):
        raise ValueError(f"block_mask must end in shape {(-(-L // bq), -(-S // bk))}, got {bm.shape}")
    return bm[..., np.arange(L)[:, None] // bq, np.arange(S)[None, :] // bk]
