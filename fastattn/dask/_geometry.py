"""Chunk geometry (graph time and in tasks): which keys of a chunk pair a row sees
(the causal / window bounds on ``t = j - i``), as the chunk call's window, its
visibility, the trimmed call, and the chunk boundaries of the operands."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

NDArray = npt.NDArray[Any]
State = tuple[NDArray, NDArray]  # (out (..., H, L, Dv), lse (..., H, L)) of one query chunk, bhsd
Bound = int | None  # a bound on c - a (local key index minus local row index); None = unbounded


def chunk_window(i0: int, i1: int, j0: int, j1: int, lo: Bound, hi: Bound) -> tuple[int, int] | None:
    """The (left, right) window of the chunk call equal to ``lo <= j - i <= hi``
    on global indices, or None when that cannot be written as a window.

    The chunk call aligns its window to the chunk's own bottom right: local
    query a sees local keys c with ``Sc - Lc - left <= c - a <= Sc - Lc + right``,
    and global ``j - i = (c - a) + (j0 - i0)``.  A bound that would need a
    negative left or right (some rows of the chunk see none of its keys on
    that side) is not expressible.
    """
    b = (j1 - j0) - (i1 - i0)
    off = j0 - i0
    right = -1 if hi is None else hi - off - b
    left = -1 if lo is None else b - lo + off
    if (hi is not None and right < 0) or (lo is not None and left < 0):
        return None
    return left, right


def visibility(i0: int, i1: int, j0: int, j1: int, lo: Bound, hi: Bound) -> str:
    """'none', 'full' or 'partial' for query rows [i0, i1) and keys [j0, j1)
    under ``lo <= j - i <= hi``."""
    if i1 <= i0 or j1 <= j0:
        return "none"
    dmin, dmax = j0 - (i1 - 1), (j1 - 1) - i0
    if (hi is not None and dmin > hi) or (lo is not None and dmax < lo):
        return "none"
    if (hi is None or dmax <= hi) and (lo is None or dmin >= lo):
        return "full"
    return "partial"


def trim(Lr: int, Sr: int, lo: Bound, hi: Bound, unit: tuple[int, int]) -> tuple[int, int, int, int]:
    """Rows [a0, a1) and keys [c0, c1) holding every visible pair of an Lr x Sr call
    under ``lo <= c - a <= hi`` (the call is not "none"); the starts rounded down
    to multiples of ``unit`` (block sizes: a block mask's grid starts at 0).

    Without rounding the window of the trimmed call always exists: its right side
    is ``hi + a1 - c1 >= 0`` (as ``c1 <= a1 + hi``) and its left side
    ``c1 - a1 - lo >= 0`` (as ``a1 <= Sr - lo``), so no explicit mask is needed."""
    a0 = 0 if hi is None else max(0, -hi)  # row a sees keys c <= a + hi
    a1 = Lr if lo is None else min(Lr, Sr - lo)  # row a sees keys c >= a + lo
    c0 = 0 if lo is None else max(0, a0 + lo)
    c1 = Sr if hi is None else min(Sr, a1 + hi)
    return a0 // unit[0] * unit[0], a1, c0 // unit[1] * unit[1], c1


def bounds(chunks: Sequence[int], mult: int = 1) -> set[int]:
    return {int(x) * mult for x in np.cumsum((0,) + tuple(chunks))}


def chunks_from_bounds(bounds: set[int]) -> tuple[int, ...]:
    b = sorted(bounds)
    return tuple(int(y - x) for x, y in zip(b[:-1], b[1:])) if len(b) > 1 else (0,)


def refine(*chunk_tuples: Sequence[int]) -> tuple[int, ...]:
    """Common refinement of several chunkings of one dimension."""
    bs: set[int] = set()
    for c in chunk_tuples:
        bs |= bounds(c)
    return chunks_from_bounds(bs)


def round_to(chunks: tuple[int, ...], unit: int) -> tuple[int, ...]:
    """Chunk boundaries rounded down to multiples of unit (the end kept)."""
    total = sum(chunks)
    return chunks_from_bounds({(b // unit) * unit for b in bounds(chunks) if b < total} | {total})


def offsets(chunks: Sequence[int]) -> list[tuple[int, int]]:
    o = [int(x) for x in np.cumsum((0,) + tuple(chunks))]
    return list(zip(o[:-1], o[1:]))


def any_visible(
    i0: int, i1: int, j0: int, j1: int, Lb: NDArray, Sb: NDArray, causal: bool, wl: int, wr: int
) -> bool:
    """Whether any batch element (valid lengths Lb, Sb, arrays of one shape) has a
    visible pair among rows [i0, i1) and keys [j0, j1) under causal / window."""
    i1b, j1b = np.minimum(i1, Lb), np.minimum(j1, Sb)
    ok = (i1b > i0) & (j1b > j0)
    diag = Sb - Lb  # j - i on the bottom-right diagonal
    hi = 0 if causal else wr
    # (the bounds, up to 2**63 - 1, stay on their own side: diag + hi could wrap around in int64)
    if hi >= 0:
        ok &= j0 - (i1b - 1) - diag <= hi
    if wl >= 0:
        ok &= (j1b - 1) - i0 - diag >= -wl
    return bool(np.any(ok))
