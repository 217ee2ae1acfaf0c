"""A block pool of paged K/V for many sequences: :class:`PagedKVCache`.

Sequences start, grow, fork (beam search, a shared prompt) and end; their tokens live
in fixed-size pages of one pool, listed per sequence, so that nothing is copied when a
sequence grows or forks (the child shares the parent's full pages; a partly filled
last page is copied, so that neither sees the other's later tokens).  Attention reads
the pages in place through a block table (:func:`fastattn.attention_with_kvcache`
with ``block_table``).
"""

from __future__ import annotations

import numbers
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from ._cache_args import cache_dtype_value, cache_tokens, to_cache_dtype
from ._checks import F32, F64
from ._paged import paged_attention
from ._quant import is_kv8, quantize

__all__ = ["PagedKVCache"]

Array = npt.NDArray[Any]


def _count(x: Any, name: str, minimum: int = 1) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if int(x) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {int(x)}")
    return int(x)


class PagedKVCache:
    """A pool of K/V pages shared by many sequences that start, fork and end.

    ``num_blocks`` pages of ``block_size`` tokens each hold every sequence's keys
    and values, flash-attn's paged layout: :attr:`k_cache` ``(num_blocks,
    block_size, num_kv_heads, head_dim)``, :attr:`v_cache` the same with
    ``value_dim``.  A sequence is a list of pages (its row of
    :meth:`block_table`); appending takes free pages as needed, :meth:`fork`
    shares the parent's full pages and copies its partly filled last page (copy
    on write at fork time: parent and child never see each other's later
    tokens), :meth:`free` returns the pages no other sequence shares.  An
    append or fork that needs more pages than are free raises ``MemoryError``
    and changes nothing.  8-bit dtypes (``"int8"``, ``"float8_e4m3fn"``,
    ``"float8_e5m2"``) quantise each appended token per token and head
    (``max|x| / 127``, ``/ 448``, ``/ 57344``), the scales kept beside the
    pages (:attr:`k_scale`, :attr:`v_scale`, ``(num_blocks, block_size,
    num_kv_heads, 1)`` float32).  Every method holds one lock: a cache may be
    shared by threads.

    Parameters
    ----------
    num_blocks : int
        Pages in the pool.
    block_size : int
        Tokens per page (any size >= 1; vLLM uses 16).
    num_kv_heads : int
        Key/value heads.
    head_dim : int
        Head dim of the keys (and queries).
    dtype : dtype or str, default float32
        float32, float16, bfloat16, float64, or 8-bit ``"int8"``,
        ``"float8_e4m3fn"``, ``"float8_e5m2"``.
    value_dim : int, optional
        Head dim of the values; default ``head_dim``.

    See Also
    --------
    fastattn.attention_with_kvcache : Paged attention over caller-owned pools.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> pool = fastattn.PagedKVCache(num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
    >>> a = pool.new_sequence()
    >>> k, v = rng.standard_normal((2, 6, 2, 8)).astype(np.float32)   # (T, Hk, D)
    >>> pool.append(a, k, v)
    >>> b = pool.fork(a)                          # shares a's full page, copies the partial one
    >>> pool.num_free_blocks
    13
    >>> out = pool.attend(rng.standard_normal((1, 4, 8)).astype(np.float32), b)   # (Lq, Hq, D)
    >>> out.shape
    (1, 4, 8)
    >>> bool(np.array_equal(pool.keys(b), k))
    True
    >>> pool.free(a)
    >>> pool.length(b), pool.num_free_blocks
    (6, 14)
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: Any = np.float32,
        value_dim: int | None = None,
    ) -> None:
        nb = _count(num_blocks, "num_blocks")
        bs = _count(block_size, "block_size")
        hk = _count(num_kv_heads, "num_kv_heads")
        d = _count(head_dim, "head_dim")
        dv = d if value_dim is None else _count(value_dim, "value_dim")
        if nb > 2**31 - 1:
            raise ValueError(f"num_blocks must fit the block table's int32, got {nb}")
        dt = cache_dtype_value(dtype)
        self._dtype = dt
        self._k = np.zeros((nb, bs, hk, d), dt)
        self._v = np.zeros((nb, bs, hk, dv), dt)
        self._ks = np.ones((nb, bs, hk, 1), F32) if is_kv8(dt) else None
        self._vs = np.ones((nb, bs, hk, 1), F32) if is_kv8(dt) else None
        self._free: list[int] = list(range(nb - 1, -1, -1))  # popped from the end: page 0 first
        self._refs = np.zeros(nb, np.int64)  # sequences holding each page
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next = 0
        self._lock = threading.RLock()

    # ---- the pool
    @property
    def block_size(self) -> int:
        """Tokens per page."""
        return int(self._k.shape[1])

    @property
    def num_blocks(self) -> int:
        """Pages in the pool."""
        return int(self._k.shape[0])

    @property
    def num_free_blocks(self) -> int:
        """Pages no sequence holds."""
        with self._lock:
            return len(self._free)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The storage dtype of the pages."""
        return self._dtype

    @property
    def k_cache(self) -> Array:
        """The key pages ``(num_blocks, block_size, num_kv_heads, head_dim)`` (the pool itself)."""
        return self._k

    @property
    def v_cache(self) -> Array:
        """The value pages ``(num_blocks, block_size, num_kv_heads, value_dim)``."""
        return self._v

    @property
    def k_scale(self) -> Array | None:
        """Per-token key scales ``(num_blocks, block_size, num_kv_heads, 1)`` of 8-bit pages, else None."""
        return self._ks

    @property
    def v_scale(self) -> Array | None:
        """Per-token value scales of 8-bit pages, else None."""
        return self._vs

    # ---- sequences
    def _seq(self, seq_id: Any) -> int:
        if isinstance(seq_id, (bool, np.bool_)) or not isinstance(seq_id, numbers.Integral):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__}")
        if int(seq_id) not in self._pages:
            raise KeyError(f"no sequence {int(seq_id)} in this cache (freed, or never made)")
        return int(seq_id)

    def new_sequence(self) -> int:
        """Start an empty sequence.

        Returns
        -------
        int
            Its id (never reused).
        """
        with self._lock:
            sid = self._next
            self._next += 1
            self._pages[sid] = []
            self._lens[sid] = 0
            return sid

    def length(self, seq_id: int) -> int:
        """Tokens held by sequence ``seq_id``.

        Parameters
        ----------
        seq_id : int
            A sequence of this cache.

        Returns
        -------
        int
        """
        with self._lock:
            return self._lens[self._seq(seq_id)]

    def append(self, seq_id: int, k: npt.ArrayLike, v: npt.ArrayLike) -> None:
        """Append tokens to a sequence, taking free pages as needed.

        Parameters
        ----------
        seq_id : int
            A sequence of this cache.
        k, v : array_like
            ``(T, num_kv_heads, head_dim)`` keys and ``(T, num_kv_heads, value_dim)``
            values, real floating; converted (8-bit: quantised per token) before
            anything is written.

        Raises
        ------
        MemoryError
            When the pool has too few free pages; nothing is written.
        """
        with self._lock:
            sid = self._seq(seq_id)
            nb, bs, hk, d = self._k.shape
            ka = (
                cache_tokens(np.asarray(k)[None].swapaxes(1, 2), "k", 1, hk, d, False)
                if np.ndim(k) == 3
                else None
            )
            va = (
                cache_tokens(np.asarray(v)[None].swapaxes(1, 2), "v", 1, hk, self._v.shape[3], False)
                if np.ndim(v) == 3
                else None
            )
            if ka is None or va is None:
                raise ValueError(
                    f"k and v must be (T, {hk}, D) tokens, got shapes {np.shape(k)} and {np.shape(v)}"
                )
            T = ka.shape[2]
            if va.shape[2] != T:
                raise ValueError(f"k and v must hold the same number of tokens, got {T} and {va.shape[2]}")
            if T == 0:
                return
            if is_kv8(self._dtype):
                kw, ksc = quantize(ka, self._dtype, None, "k")
                vw, vsc = quantize(va, self._dtype, None, "v")
            else:
                kw, vw = to_cache_dtype(ka, self._dtype, "k"), to_cache_dtype(va, self._dtype, "v")
            n = self._lens[sid]
            pages = self._pages[sid]
            need = -(-(n + T) // bs) - len(pages)
            if need > len(self._free):
                raise MemoryError(
                    f"PagedKVCache: {T} tokens need {need} more pages, {len(self._free)} are free; "
                    "nothing written"
                )
            for _ in range(need):
                p = self._free.pop()
                self._refs[p] = 1
                pages.append(p)
            pos = n + np.arange(T)
            pg = np.asarray(pages, np.int64)[pos // bs]
            sl = pos % bs
            self._k[pg, sl] = kw[0].swapaxes(0, 1)
            self._v[pg, sl] = vw[0].swapaxes(0, 1)
            if self._ks is not None and self._vs is not None:
                self._ks[pg, sl] = ksc[0].swapaxes(0, 1)
                self._vs[pg, sl] = vsc[0].swapaxes(0, 1)
            self._lens[sid] = n + T

    def fork(self, seq_id: int) -> int:
        """A new sequence with the same tokens as ``seq_id``.

        The full pages are shared; a partly filled last page is copied into a
        free page, so that later appends to either never reach the other.

        Parameters
        ----------
        seq_id : int
            The parent.

        Returns
        -------
        int
            The child's id.

        Raises
        ------
        MemoryError
            When the copy needs a page and none is free; nothing changes.
        """
        with self._lock:
            sid = self._seq(seq_id)
            n, bs = self._lens[sid], self.block_size
            pages = self._pages[sid]
            full = pages[: n // bs]
            partial = n % bs != 0
            if partial and not self._free:
                raise MemoryError("PagedKVCache: fork needs a free page for the partly filled last one")
            child = list(full)
            self._refs[full] += 1
            if partial:
                p = self._free.pop()
                self._refs[p] = 1
                src = pages[n // bs]
                for a in (self._k, self._v, self._ks, self._vs):
                    if a is not None:
                        a[p] = a[src]
                child.append(p)
            cid = self.new_sequence()
            self._pages[cid] = child
            self._lens[cid] = n
            return cid

    def free(self, seq_id: int) -> None:
        """End a sequence: its pages that no other sequence holds become free.

        Parameters
        ----------
        seq_id : int
            A sequence of this cache.
        """
        with self._lock:
            sid = self._seq(seq_id)
            for p in self._pages.pop(sid):
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.append(p)
            del self._lens[sid]

    def block_table(self, seq_ids: Any) -> tuple[Array, Array]:
        """The block table and lengths of some sequences, for the paged calls.

        Parameters
        ----------
        seq_ids : sequence of int
            Sequences of this cache.

        Returns
        -------
        table : ndarray
            int32 ``(len(seq_ids), max_pages)``, rows padded with zeros.
        lengths : ndarray
            int64 ``(len(seq_ids),)``.
        """
        with self._lock:
            ids = [self._seq(s) for s in seq_ids]
            width = max([len(self._pages[s]) for s in ids] + [1])
            table = np.zeros((len(ids), width), np.int32)
            for r, s in enumerate(ids):
                table[r, : len(self._pages[s])] = self._pages[s]
            return table, np.array([self._lens[s] for s in ids], np.int64)

    def _gather(self, pool: Array, scale: Array | None, seq_id: int) -> Array:
        with self._lock:
            sid = self._seq(seq_id)
            n, bs = self._lens[sid], self.block_size
            pos = np.arange(n)
            pg = np.asarray(self._pages[sid], np.int64)[pos // bs] if n else pos
            out: Array = pool[pg, pos % bs].astype(F64 if pool.dtype == F64 else F32)
            if scale is not None:
                out = out * scale[pg, pos % bs]
            return out

    def keys(self, seq_id: int) -> Array:
        """The keys of a sequence, dequantised: float32 ``(T, num_kv_heads, head_dim)``.

        Parameters
        ----------
        seq_id : int
            A sequence of this cache.

        Returns
        -------
        ndarray
        """
        return self._gather(self._k, self._ks, seq_id)

    def values(self, seq_id: int) -> Array:
        """The values of a sequence, dequantised: float32 ``(T, num_kv_heads, value_dim)``.

        Parameters
        ----------
        seq_id : int
            A sequence of this cache.

        Returns
        -------
        ndarray
        """
        return self._gather(self._v, self._vs, seq_id)

    def attend(self, q: npt.ArrayLike, seq_id: int, **options: Any) -> Any:
        """Attention of queries at a sequence's last positions over its tokens.

        Parameters
        ----------
        q : array_like
            ``(Lq, Hq, head_dim)``: the queries of the sequence's last Lq tokens
            (Hq a multiple of num_kv_heads).
        seq_id : int
            A sequence of this cache holding at least Lq tokens.
        **options
            ``is_causal`` (default True, bottom-right), ``window``,
            ``alibi_slopes``, ``softcap``, ``scale``, ``return_lse``,
            ``num_threads``, ``precision``, as for
            :func:`fastattn.attention_with_kvcache`.

        Returns
        -------
        out : ndarray
            ``(Lq, Hq, value_dim)`` in q's dtype (and the LSE ``(Hq, Lq)`` with
            ``return_lse=True``).
        """
        qa = np.asarray(q)
        if qa.ndim != 3:
            raise ValueError(f"q must be (Lq, Hq, head_dim), got shape {qa.shape}")
        res = self.attend_batch(qa[None], [seq_id], **options)
        if isinstance(res, tuple):
            return res[0][0], res[1][0]
        return res[0]

    def attend_batch(self, q: npt.ArrayLike, seq_ids: Any, **options: Any) -> Any:
        """:meth:`attend` for several sequences in one call (decode rows of a batch).

        Parameters
        ----------
        q : array_like
            ``(n, Lq, Hq, head_dim)``: Lq queries per sequence.
        seq_ids : sequence of int
            n sequences of this cache.
        **options
            As for :meth:`attend`.

        Returns
        -------
        out : ndarray
            ``(n, Lq, Hq, value_dim)`` (and the LSE ``(n, Hq, Lq)`` with
            ``return_lse=True``).
        """
        with self._lock:
            table, lens = self.block_table(seq_ids)
            options.setdefault("is_causal", True)
            return paged_attention(
                q,
                self._k,
                self._v,
                lens,
                None,
                None,
                table,
                is_causal=options.pop("is_causal"),
                window=options.pop("window", None),
                alibi_slopes=options.pop("alibi_slopes", None),
                softcap=options.pop("softcap", None),
                scale=options.pop("scale", None),
                return_lse=options.pop("return_lse", False),
                num_threads=options.pop("num_threads", None),
                layout="bshd",
                rotary=(None, None, False),
                precision=options.pop("precision", None),
                k_scale=self._ks,
                v_scale=self._vs,
                **_no_more(options),
            )


def _no_more(options: dict[str, Any]) -> dict[str, Any]:
    if options:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(options))}")
    return {}
