"""Position encodings: sinusoidal tables and rotary embeddings (RoPE).

Attention by itself is permutation-equivariant; models add positions.

- :func:`sinusoidal_positions`: the original transformer's table,
  ``PE[p, 2i] = sin(p / base**(2i/dim))``, ``PE[p, 2i+1] = cos(...)``.
- :func:`rotary_cos_sin`: the ``(length, rotary_dim/2)`` cos and sin tables of
  rotary embeddings, flash-attn's layout (``theta_i = base**(-2i/rotary_dim)``,
  angle ``p * theta_i``).
- :func:`apply_rotary`: rotates the first ``rotary_dim`` features of each
  vector by its position's angles: GPT-NeoX/LLaMA "rotate half" by default
  (feature i pairs with i + rotary_dim/2), GPT-J adjacent pairs (2i, 2i+1)
  with ``interleaved=True``.  The rest of the features pass through.

The rotation runs in C (``fastattn._family``) in float32 (float64 for float64
inputs); the same routine rotates q and the new keys inside
:func:`fastattn.attention_with_kvcache` and :class:`fastattn.KVCache`, so the
fused and separate paths agree bit for bit.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _family
from ._cache_args import index_value, indices_value, overflow_error
from ._checks import F32, F64, as_array, is_storage_dtype
from ._config import get_num_threads

__all__ = ["sinusoidal_positions", "rotary_cos_sin", "apply_rotary"]

NDArray = npt.NDArray[Any]


def _base_value(base: object) -> float:
    if isinstance(base, (bool, np.bool_)) or not isinstance(base, numbers.Real):
        raise TypeError(f"base must be a real number, got {type(base).__name__}")
    b = float(base)
    if not (b > 1.0 and math.isfinite(b)):
        raise ValueError(f"base must be finite and > 1, got {base!r}")
    return b


def _out_dtype(dtype: npt.DTypeLike) -> np.dtype[Any]:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dt not in (F32, F64):
        raise TypeError(f"dtype must be float32 or float64, got {dt}")
    return dt


def sinusoidal_positions(
    length: int, dim: int, base: float = 10000.0, *, dtype: npt.DTypeLike = np.float32
) -> np.ndarray:
    """The ``(length, dim)`` sinusoidal table: ``PE[p, 2i] = sin(p / base**(2i/dim))``,
    ``PE[p, 2i+1] = cos(p / base**(2i/dim))`` (Vaswani et al.).  An odd ``dim``
    ends with a sine column.  Computed in float64, returned in ``dtype``.

    Parameters
    ----------
    length : int
        Number of positions (rows), >= 0.
    dim : int
        Number of features (columns), >= 1.
    base : float, default 10000.0
        Wavelength base, finite and > 1.
    dtype : dtype, default float32
        float32 or float64.

    Returns
    -------
    ndarray
        ``(length, dim)`` table in ``dtype``.

    Examples
    --------
    >>> pe = fastattn.sinusoidal_positions(4, 6, dtype=np.float64)
    >>> pe.shape
    (4, 6)
    >>> pe[0]
    array([0., 1., 0., 1., 0., 1.])
    >>> bool(np.isclose(pe[3, 2], np.sin(3 / 10000 ** (2 / 6))))
    True
    """
    n = index_value(length, "length", 0)
    d = index_value(dim, "dim", 1)
    b = _base_value(base)
    dt = _out_dtype(dtype)
    i2 = np.arange(0, d, 2, dtype=F64)  # the even feature indices 2i
    ang = np.arange(n, dtype=F64)[:, None] / b ** (i2 / d)
    pe = np.empty((n, d), dtype=F64)
    pe[:, 0::2] = np.sin(ang)
    pe[:, 1::2] = np.cos(ang[:, : d // 2])
    return pe.astype(dt, copy=False)


def rotary_cos_sin(
    length: int, rotary_dim: int, base: float = 10000.0, *, dtype: npt.DTypeLike = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """The rotary tables ``cos, sin`` of shape ``(length, rotary_dim // 2)``:
    ``cos[p, i] = cos(p * base**(-2i/rotary_dim))`` (and sin), flash-attn's
    ``rotary_cos``/``rotary_sin`` layout.  ``rotary_dim`` must be even.
    Computed in float64, returned in ``dtype``.

    Parameters
    ----------
    length : int
        Number of positions, >= 0.
    rotary_dim : int
        Number of rotated features, even and >= 2.
    base : float, default 10000.0
        Frequency base, finite and > 1.
    dtype : dtype, default float32
        float32 or float64.

    Returns
    -------
    cos, sin : ndarray
        ``(length, rotary_dim // 2)`` tables in ``dtype``.

    Examples
    --------
    >>> cos, sin = fastattn.rotary_cos_sin(3, 4, dtype=np.float64)
    >>> cos.shape
    (3, 2)
    >>> bool(np.allclose(cos[2], np.cos(2 * 10000.0 ** -(np.arange(0, 4, 2) / 4))))
    True
    >>> bool(np.allclose(cos**2 + sin**2, 1))
    True
    """
    n = index_value(length, "length", 0)
    rd = index_value(rotary_dim, "rotary_dim", 2)
    if rd % 2:
        raise ValueError(f"rotary_dim must be even, got {rd}")
    b = _base_value(base)
    dt = _out_dtype(dtype)
    inv_freq = 1.0 / b ** (np.arange(0, rd, 2, dtype=F64) / rd)
    ang = np.arange(n, dtype=F64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(dt, copy=False), np.sin(ang).astype(dt, copy=False)


def rotary_tables(
    cos: object,
    sin: object,
    head_dim: int,
    cdt: np.dtype[Any],
    names: tuple[str, str] = ("cos", "sin"),
) -> tuple[NDArray, NDArray]:
    """Checked ``(npos, rotary_dim/2)`` tables, C-contiguous in the compute dtype cdt
    (anything else, None included, is refused by name)."""
    nc, ns = names
    c = as_array(cos, nc)
    s = as_array(sin, ns)
    for a, n in ((c, nc), (s, ns)):
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise TypeError(f"{n} must be a real floating array, got dtype {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"{n} must have shape (positions, rotary_dim / 2), got {a.shape}")
    if c.shape != s.shape:
        raise ValueError(f"{nc} and {ns} must have the same shape, got {c.shape} and {s.shape}")
    half = c.shape[1]
    if half < 1:
        raise ValueError(f"{nc} must have at least one column (rotary_dim / 2 >= 1), got {c.shape}")
    if 2 * half > head_dim:
        raise ValueError(f"rotary_dim = 2 * {nc}.shape[1] = {2 * half} exceeds the head dim {head_dim}")
    return np.ascontiguousarray(c, dtype=cdt), np.ascontiguousarray(s, dtype=cdt)


def check_positions(pos: NDArray, npos: int, what: str) -> None:
    """Positions must index the tables: 0 <= pos < npos (pos is an int64 array)."""
    if pos.size == 0:
        return
    lo, hi = int(pos.min()), int(pos.max())
    if lo < 0:
        raise ValueError(f"{what} must be >= 0, got {lo}")
    if hi >= npos:
        raise ValueError(
            f"the cos/sin tables have {npos} positions but {what} reach position {hi}; "
            f"build tables of length >= {hi + 1}"
        )


def rotate(
    src4: NDArray,
    dst4: NDArray,
    pos2: NDArray,
    cos: NDArray,
    sin: NDArray,
    interleaved: bool,
    num_threads: int | None = None,
    dst_at_pos: bool = False,
) -> None:
    """The C rotation over (B, H, T, D) views (checked by the caller)."""
    _family.rotary(
        src4,
        dst4,
        pos2,
        cos,
        sin,
        bool(interleaved),
        get_num_threads() if num_threads is None else num_threads,
        dst_at_pos,
    )


def last_contiguous(a: NDArray) -> NDArray:
    if a.shape[-1] <= 1 or a.strides[-1] == a.itemsize:
        if a.flags.aligned:
            return a
    return np.ascontiguousarray(a)


def apply_rotary(
    x: npt.ArrayLike,
    cos: npt.ArrayLike,
    sin: npt.ArrayLike,
    *,
    positions: npt.ArrayLike | None = None,
    interleaved: bool = False,
    layout: str = "bhsd",
) -> np.ndarray:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` features of each vector of x.

    x: ``(..., H, L, D)`` with ``layout="bhsd"`` (a 2-D ``(L, D)`` is one
    head) or ``(..., L, H, D)`` with ``layout="bshd"``; float16, bfloat16,
    float32 or float64.  cos, sin: ``(positions, rotary_dim / 2)`` tables (see
    :func:`rotary_cos_sin`).  positions: None (token l is at position l) or an
    integer array broadcastable to ``(..., L)`` (the batch dims of x and its
    sequence axis; every head of a token shares its position).

    NeoX rotate-half (default): with ``h = rotary_dim / 2``, ``x1 = x[:h]``,
    ``x2 = x[h:2h]``: ``(x1 cos - x2 sin, x2 cos + x1 sin)``.
    ``interleaved=True`` (GPT-J): pairs ``(x[2i], x[2i+1])`` rotate by angle i.
    Returns a new array of x's shape and dtype; x is not modified.  Computed
    in float32 (float64 for float64 x).  A rotated pair grows by up to sqrt(2):
    where a finite x rotates beyond x's dtype (e.g. float16 values above ~46300)
    ValueError names x instead of returning inf (as the KV caches refuse such
    keys); an inf or NaN already in x passes through.

    Parameters
    ----------
    x : array_like
        ``(..., H, L, D)`` (``layout="bhsd"``; 2-D is one head) or ``(..., L, H, D)``
        (``layout="bshd"``); float16, bfloat16, float32 or float64.
    cos, sin : array_like
        ``(positions, rotary_dim / 2)`` tables (see :func:`rotary_cos_sin`).
    positions : array_like of int, optional
        Each token's position, broadcastable to ``(..., L)``; None means token l is at l.
    interleaved : bool, default False
        GPT-J adjacent pairs instead of NeoX rotate-half.
    layout : {"bhsd", "bshd"}, default "bhsd"
        Axis order of x.

    Returns
    -------
    ndarray
        The rotated copy, x's shape and dtype.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((5, 4))
    >>> cos, sin = fastattn.rotary_cos_sin(5, 4, dtype=np.float64)
    >>> y = fastattn.apply_rotary(x, cos, sin)
    >>> x1, x2 = x[:, :2], x[:, 2:]
    >>> bool(np.allclose(y, np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)))
    True
    >>> bool(np.allclose(y[0], x[0]))   # position 0: angle 0
    True
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    xa = as_array(x, "x")
    if not is_storage_dtype(xa.dtype):
        raise TypeError(f"x must have dtype float16, bfloat16, float32 or float64, got {xa.dtype}")
    min_nd = 2 if layout == "bhsd" else 3
    if xa.ndim < min_nd:
        raise ValueError(f"x must have at least {min_nd} dimensions for layout={layout!r}, got {xa.shape}")
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    D = xa.shape[-1]
    cdt = F64 if xa.dtype == F64 else F32
    c, s = rotary_tables(cos, sin, D, cdt)
    npos = c.shape[0]
    # the (B, H, L, D) view
    if layout == "bhsd":
        xh = xa[None] if xa.ndim == 2 else xa
        lead, L = xh.shape[:-3], xh.shape[-2]
    else:
        xh = np.swapaxes(xa, -2, -3)
        lead, L = xh.shape[:-3], xh.shape[-2]
    if positions is None:
        pos = np.arange(L, dtype=np.int64)
        check_positions(pos, npos, "positions (0 .. L-1)")
        pos = np.broadcast_to(pos, lead + (L,))
    else:
        # int64, the values as given checked first (uint64, Python ints beyond int64)
        pa = indices_value(positions, "positions", what="an integer array")
        try:
            pos = np.broadcast_to(pa, lead + (L,))
        except ValueError:
            raise ValueError(f"positions of shape {pa.shape} does not broadcast to {lead + (L,)}") from None
        check_positions(pa, npos, "positions")
        pos = pos.astype(np.int64, copy=False)
    out = np.empty(xa.shape, dtype=xa.dtype)
    oh = out[None] if (layout == "bhsd" and xa.ndim == 2) else out
    if layout == "bshd":
        oh = np.swapaxes(oh, -2, -3)
    B = math.prod(lead)
    H = xh.shape[-3]
    src = last_contiguous(xh).reshape((B, H, L, D))  # merges leading dims (a copy only when it must)
    dst = oh.reshape((B, H, L, D))  # out is fresh and C-contiguous: always a view
    p2 = pos.reshape((B, L))  # a view with broadcast strides where it can be
    rotate(src, dst, p2, c, s, interleaved)
    check_rotated(xa, out, "x")
    return out


def check_rotated(x: NDArray, out: NDArray, name: str) -> None:
    """ValueError when the rotation of a finite ``x`` overflowed ``out``'s dtype to inf
    (a pair (a, b) rotates to up to sqrt(2) max(|a|, |b|): e.g. float16 beyond ~46300):
    the cache paths refuse such keys (nothing is lost silently), and so does every rotation."""
    msg = overflow_error(x, out, name, rotated=True)
    if msg is not None:
        raise ValueError(f"{msg}; use a wider dtype or rescale {name}")


class CacheRotary:
    """Checked rotary tables of a cache path (attention_with_kvcache, KVCache)."""

    def __init__(
        self,
        rotary_cos: npt.ArrayLike | None,
        rotary_sin: npt.ArrayLike | None,
        rotary_interleaved: bool,
        head_dim: int,
        cache_dtype: np.dtype[Any],
    ) -> None:
        if not isinstance(rotary_interleaved, (bool, np.bool_)):
            raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
        if (rotary_cos is None) != (rotary_sin is None):
            raise ValueError("rotary_cos and rotary_sin must be given together")
        cdt = F64 if cache_dtype == F64 else F32
        self.cos, self.sin = rotary_tables(
            rotary_cos, rotary_sin, head_dim, cdt, ("rotary_cos", "rotary_sin")
        )
        self.interleaved = bool(rotary_interleaved)
        self.npos = self.cos.shape[0]

    @staticmethod
    def positions(start: npt.ArrayLike, n: int) -> NDArray:
        """(B, n) int64 positions start[b] + t."""
        return np.asarray(start, dtype=np.int64)[:, None] + np.arange(n, dtype=np.int64)[None, :]

    def check(self, pos: NDArray, what: str) -> None:
        check_positions(pos, self.npos, what)

    def append(self, k_new4: NDArray, cache4: NDArray, pos: NDArray, num_threads: int | None = None) -> None:
        """Rotate the new keys (B, H, T, D) and write them into cache rows pos[b, t], in one C pass."""
        if not is_storage_dtype(k_new4.dtype):  # e.g. longdouble: through the compute dtype
            k_new4 = k_new4.astype(self.cos.dtype)
        src = last_contiguous(k_new4)
        if cache4.flags.aligned and (cache4.shape[-1] <= 1 or cache4.strides[-1] == cache4.itemsize):
            rotate(src, cache4, pos, self.cos, self.sin, self.interleaved, num_threads, dst_at_pos=True)
            return
        # A cache whose rows are not contiguous, or misaligned: rotate into a buffer, then
        # copy row by row.
        buf: NDArray = np.empty(src.shape, dtype=cache4.dtype)
        rotate(src, buf, pos, self.cos, self.sin, self.interleaved, num_threads)
        for b in range(buf.shape[0]):
            s0 = int(pos[b, 0])
            cache4[b, :, s0 : s0 + buf.shape[2]] = buf[b]

    def rotate_into(self, x4: NDArray, out4: NDArray, pos: NDArray, num_threads: int | None = None) -> None:
        """Rotate x (B, H, T, D), any real floating dtype, into a fresh out4 of a storage
        dtype (unchecked: fastattn._cache_args.to_cache_dtype checks it for overflow)."""
        src = x4 if is_storage_dtype(x4.dtype) else x4.astype(self.cos.dtype)
        rotate(last_contiguous(src), out4, pos, self.cos, self.sin, self.interleaved, num_threads)

    def rotate_q(self, q4: NDArray, pos: NDArray, num_threads: int | None = None) -> NDArray:
        """A rotated copy of q (B, H, L, D) in q's dtype (its bhsd view is returned)."""
        out = np.empty(q4.shape, dtype=q4.dtype)
        rotate(last_contiguous(q4), out, pos, self.cos, self.sin, self.interleaved, num_threads)
        check_rotated(q4, out, "q")  # an inf query would make the output NaN silently
        return out
