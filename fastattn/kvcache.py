"""Decoding with a key/value cache: :class:`KVCache` and :func:`attention_with_kvcache`.

Autoregressive decoding appends the keys and values of the newest tokens to a
preallocated cache and attends the newest queries over each sequence's valid
prefix.  Nothing here copies the cache: the kernel receives the full
preallocated arrays together with the per-sequence lengths
(``key_lengths``) and skips every key tile past a sequence's length, so a
decode step costs O(length) reads and an append costs O(new tokens).

Causal alignment is bottom-right per sequence: the ``Lq`` queries of a step
are the ``Lq`` newest cached positions, so query ``i`` of sequence ``b`` (with
``n_b`` valid keys) sees keys ``j <= i + n_b - Lq``.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from . import positions
from ._args import layout_value, sdpa_call
from ._cache_args import (
    attend_query,
    batch_indices,
    cache_dtype_value,
    cache_operands,
    cache_tokens,
    index_value,
    indices_value,
    keys_to_write,
    kv8_fixed_scale,
    kv8_scale,
    kv8_targets_apart,
    kv8_tokens,
    reread_scales,
    reread_written,
    row_view,
    to_cache_dtype,
    write_rows,
    write_tokens,
)
from ._checks import F32, F64, as_array, flag_value
from ._config import Precision, precision_code
from ._paged import paged_attention
from ._quant import is_kv8

__all__ = ["KVCache", "attention_with_kvcache"]

_Window = tuple[int, int] | Sequence[int] | None
_Index = int | slice | npt.ArrayLike | None
_Precision = Precision | None
# The rotary helper of fastattn.positions (Any: that module is typed by its owner).
_CacheRotary: Any = positions.CacheRotary


def _read_only(a: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return None
    view = a.view()
    view.flags.writeable = False
    return view


class KVCache:
    """A key/value cache for ``batch`` sequences of up to ``max_len`` tokens.

    Keys are stored as ``(batch, num_kv_heads, capacity, head_dim)`` and values
    as ``(batch, num_kv_heads, capacity, value_dim)`` in ``dtype`` (float32 by
    default, ``dtype=None`` included, unlike NumPy's ``np.dtype(None)``: float64;
    float16, bfloat16 and float64 on request); ``lengths[b]`` tokens of
    sequence ``b`` are valid.  With an int ``max_len`` the capacity is
    ``max_len``, allocated once; with ``max_len=None`` the cache starts small
    and doubles its capacity whenever an append needs more (amortised O(1) per
    token; ``k``/``v`` views taken before a growth keep the old arrays).

    Nothing is lost silently: an append whose values do not fit the dtype (a
    finite value that would become inf, e.g. above 65504 for float16) raises
    ValueError before anything is written.  Typical use, one layer::

        cache = fastattn.KVCache(1, 8, 4096, 128)  # float32; dtype=np.float16 halves the memory
        cache.append(k_prompt, v_prompt)          # (1, 8, P, 128)
        out = cache.attend(q_prompt)              # (1, 32, P, 128), causal
        for step in range(n):
            cache.append(k_tok, v_tok)            # (1, 8, 1, 128)
            out = cache.attend(q_tok)             # (1, 32, 1, 128)

    Appends convert to the cache dtype and cost O(new tokens); attention reads
    the cache in place and skips the part past each sequence's length.

    8-bit caches (``dtype`` int8, ``ml_dtypes.float8_e4m3fn`` or
    ``float8_e5m2``, or their names) store a quarter of float32's bytes plus
    float32 scales: dequantised keys are ``k.astype(np.float32) * k_scale``
    (values alike), and the attention reads them so, in place
    (:func:`fastattn.scaled_dot_product_attention`'s ``k_scale``/``v_scale``).
    By default the cache keeps one scale per token and head (``max|x| / 127``
    for int8, ``/ 448`` for e4m3, ``/ 57344`` for e5m2, as
    :func:`fastattn.quantize_kv`), written with the token and kept through
    growth, :meth:`crop`, :meth:`reorder_cache` and :meth:`reset`; every value
    is within half a quantisation step of the value appended.  A fixed
    ``k_scale``/``v_scale`` given to the constructor (a number, per head or per
    channel, the same for every sequence) quantises every append instead; a
    value that does not fit it (``|x / scale|`` beyond 127, 448 or 57344)
    raises ValueError before anything is written.
    Ragged batches: ``batch_index`` restricts ``append``/``attend``/``reset``
    to some sequences.  Generation loops: :meth:`crop` rolls back (speculative
    decoding), :meth:`reorder_cache` follows beam search, :meth:`get_seq_length`.

    Thread safety: ``append``, ``reset``, ``crop`` and ``reorder_cache`` hold
    a per-cache lock, so concurrent calls of them from several threads each
    take effect whole (no appended token is lost), in some order; they must
    still not run concurrently with ``attend`` on the same sequences (an
    ``attend`` may see new keys with an old length, or the reverse).
    Concurrent ``attend`` calls (and reads of ``k``/``v``/``lengths``) are safe
    (the kernel releases the GIL and only reads the cache).

    Parameters
    ----------
    batch : int
        Sequences in the cache.
    num_kv_heads : int
        Key/value heads Hk.
    max_len : int or None
        Tokens per sequence (allocated once), or None for a growing cache.
    head_dim : int
        D, the key head dimension.
    dtype : dtype or str, default float32
        float32, float64, float16 or bfloat16 (``ml_dtypes.bfloat16``); 8-bit:
        int8, ``ml_dtypes.float8_e4m3fn`` or ``ml_dtypes.float8_e5m2`` (or the
        names ``"int8"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"bfloat16"``).
    value_dim : int, optional
        Dv, the value head dimension; default ``head_dim``.
    rotary_cos, rotary_sin : array_like, optional
        ``(positions, rotary_dim / 2)`` tables (:func:`fastattn.rotary_cos_sin`):
        keys are rotated as they are appended, queries in :meth:`attend`.
    rotary_interleaved : bool, default False
        GPT-J pairs (0, 1), (2, 3), ... instead of NeoX's rotate-half.
    k_scale, v_scale : array_like or float, optional
        8-bit caches only (TypeError otherwise): a fixed float32 scale
        (finite, positive) for the keys / values, shaped to broadcast against
        ``(num_kv_heads, 1, head_dim)`` (``value_dim`` for v_scale): a number
        (per tensor), ``(num_kv_heads, 1, 1)`` (per head), ``(num_kv_heads, 1,
        head_dim)`` or ``(head_dim,)`` (per channel), leading ones allowed up to
        4-D; one scale for every sequence and position (ValueError for other
        shapes).  None (the default): per-token scales kept by the cache.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> cache = fastattn.KVCache(1, 2, 16, 8)
    >>> cache.append(rng.standard_normal((1, 2, 4, 8)), rng.standard_normal((1, 2, 4, 8)))
    array([4]...)
    >>> out = cache.attend(rng.standard_normal((1, 4, 1, 8)).astype(np.float32))
    >>> out.shape
    (1, 4, 1, 8)

    An int8 cache with per-token scales (a quarter of the memory, plus 4 bytes
    per token and head):

    >>> cache8 = fastattn.KVCache(1, 2, 16, 8, dtype="int8")
    >>> k, v = rng.standard_normal((2, 1, 2, 4, 8))
    >>> cache8.append(k, v)
    array([4]...)
    >>> cache8.k.dtype, cache8.k_scale.shape
    (dtype('int8'), (1, 2, 16, 1))
    >>> deq = cache8.k[:, :, :4] * cache8.k_scale[:, :, :4]
    >>> bool(np.all(np.abs(deq - k) <= 0.5 * cache8.k_scale[:, :, :4] + 1e-7))
    True
    """

    _INITIAL_CAPACITY = 16  # tokens per sequence of a growing cache before its first growth

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        max_len: int | None,
        head_dim: int,
        *,
        dtype: npt.DTypeLike = np.float32,
        value_dim: int | None = None,
        rotary_cos: npt.ArrayLike | None = None,
        rotary_sin: npt.ArrayLike | None = None,
        rotary_interleaved: bool = False,
        k_scale: npt.ArrayLike | float | None = None,
        v_scale: npt.ArrayLike | float | None = None,
    ) -> None:
        B = index_value(batch, "batch", 1)
        Hk = index_value(num_kv_heads, "num_kv_heads", 1)
        self._max_len = None if max_len is None else index_value(max_len, "max_len", 1)
        D = index_value(head_dim, "head_dim", 1)
        Dv = D if value_dim is None else index_value(value_dim, "value_dim", 1)
        dt = cache_dtype_value(dtype)
        S = self._INITIAL_CAPACITY if self._max_len is None else self._max_len
        try:
            self._k = np.zeros((B, Hk, S, D), dtype=dt)
            self._v = np.zeros((B, Hk, S, Dv), dtype=dt)
        except ValueError:  # "array is too big": NumPy's words name no argument
            raise ValueError(
                f"a KVCache of batch={B}, num_kv_heads={Hk}, max_len={S}, head_dim={D} and "
                f"value_dim={Dv} holds more {dt} values than an array can; lower max_len"
            ) from None
        # 8-bit caches: per-token scales (B, Hk, capacity, 1) kept with the data (ones past
        # the lengths: the attention checks every scale), or a fixed (1, Hk', 1, X') scale.
        self._ks = kv8_fixed_scale(k_scale, "k_scale", dt, Hk, D, "k")
        self._vs = kv8_fixed_scale(v_scale, "v_scale", dt, Hk, Dv, "v")
        self._ktok = is_kv8(dt) and self._ks is None
        self._vtok = is_kv8(dt) and self._vs is None
        if self._ktok:
            self._ks = np.ones((B, Hk, S, 1), dtype=F32)
        if self._vtok:
            self._vs = np.ones((B, Hk, S, 1), dtype=F32)
        self._len = np.zeros(B, dtype=np.int64)
        self._lock = threading.Lock()  # append/reset/crop/reorder_cache (see the class doc)
        # Rotary (RoPE): keys rotated at their positions as they are appended, queries as they attend.
        self._rot: Any = None
        if rotary_cos is not None or rotary_sin is not None:
            self._rot = _CacheRotary(rotary_cos, rotary_sin, rotary_interleaved, D, dt)

    # ----------------------------------------------------------- properties
    @property
    def batch(self) -> int:
        """Number of sequences.

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.batch
        2
        """
        return int(self._k.shape[0])

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads (Hk).

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.num_kv_heads
        1
        """
        return int(self._k.shape[1])

    @property
    def max_len(self) -> int | None:
        """The most tokens a sequence may hold: the ``max_len`` given, None for a growing cache.

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.max_len is None
        True
        """
        return self._max_len

    @property
    def capacity(self) -> int:
        """Tokens per sequence allocated now (``max_len``, or a growing cache's current size).

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.capacity
        16
        """
        return int(self._k.shape[2])

    @property
    def head_dim(self) -> int:
        """Key head dim (D).

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.head_dim
        4
        """
        return int(self._k.shape[3])

    @property
    def value_dim(self) -> int:
        """Value head dim (Dv).

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.value_dim
        3
        """
        return int(self._v.shape[3])

    @property
    def dtype(self) -> np.dtype[Any]:
        """Storage dtype of keys and values.

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.dtype
        dtype('float32')
        """
        dt: np.dtype[Any] = self._k.dtype
        return dt

    @property
    def lengths(self) -> np.ndarray:
        """Valid tokens per sequence: an int64 copy, shape (batch,).

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.lengths
        array([3, 3])
        """
        return self._len.copy()

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value arrays (and an 8-bit cache's scales).

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.nbytes
        896
        """
        scales = sum(int(s.nbytes) for s in (self._ks, self._vs) if s is not None)
        return int(self._k.nbytes + self._v.nbytes) + scales

    @property
    def k(self) -> np.ndarray:
        """The whole allocated key array (read-only view; only ``[b, :, :lengths[b]]`` is valid).

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.k.shape, cache.k.flags.writeable
        ((2, 1, 16, 4), False)
        """
        view = self._k.view()
        view.flags.writeable = False
        return view

    @property
    def v(self) -> np.ndarray:
        """The whole preallocated value array (read-only view).

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, None, 4, value_dim=3)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 3)))
        >>> cache.v.shape
        (2, 1, 16, 3)
        """
        view = self._v.view()
        view.flags.writeable = False
        return view

    @property
    def k_scale(self) -> np.ndarray | None:
        """The keys' float32 scales of an 8-bit cache (read-only view; None for a float cache).

        Dequantised keys are ``k.astype(np.float32) * k_scale`` (it broadcasts against
        :attr:`k`): per token ``(batch, num_kv_heads, capacity, 1)``, kept by the cache
        (valid up to ``lengths[b]``, 1 past it), or the fixed scale given to the
        constructor as ``(1, Hk or 1, 1, head_dim or 1)``.

        Examples
        --------
        >>> cache = fastattn.KVCache(1, 1, 8, 4, dtype="int8")
        >>> _ = cache.append(np.array([[[[0.5, -1.0, 0.25, 0.0]]]]), np.ones((1, 1, 1, 4)))
        >>> cache.k[0, 0, 0], cache.k_scale[0, 0, 0]
        (array([  64, -127,   32,    0], dtype=int8), array([0.00787402], dtype=float32))
        """
        return _read_only(self._ks)

    @property
    def v_scale(self) -> np.ndarray | None:
        """The values' float32 scales of an 8-bit cache (read-only view; None for a float cache).

        As :attr:`k_scale`, for :attr:`v`: per token ``(batch, num_kv_heads,
        capacity, 1)`` or the fixed scale ``(1, Hk or 1, 1, value_dim or 1)``.

        Examples
        --------
        >>> cache = fastattn.KVCache(1, 2, 8, 4, dtype="float8_e4m3fn", v_scale=0.5)
        >>> cache.v_scale
        array([[[[0.5]]]], dtype=float32)
        """
        return _read_only(self._vs)

    def __repr__(self) -> str:
        return (
            f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, max_len={self.max_len}, "
            f"capacity={self.capacity}, "
            f"head_dim={self.head_dim}, value_dim={self.value_dim}, dtype={self.dtype}, "
            f"lengths={self._len.tolist()})"
        )

    # -------------------------------------------------------------- mutation
    def append(self, k_new: npt.ArrayLike, v_new: npt.ArrayLike, *, batch_index: _Index = None) -> np.ndarray:
        """Append T tokens to each selected sequence.

        ``k_new``: ``(B, Hk, T, D)`` (``(len(idx), Hk, T, D)`` with
        ``batch_index``; an int ``batch_index`` also takes ``(Hk, T, D)``),
        ``v_new`` likewise with ``Dv``.  Any real floating dtype; converted to
        the cache dtype (an 8-bit cache quantises them: per token, its scales
        written with them, or with its fixed scale).  Every check runs before
        anything is written: on an error (a sequence would exceed ``max_len``,
        a value does not fit the cache dtype and would become inf, or does not
        fit an 8-bit cache's fixed scale) the cache, its scales and its lengths
        are unchanged.  A growing cache (``max_len=None``) doubles its capacity when
        needed.  Returns the new lengths of the selected sequences.

        Parameters
        ----------
        k_new, v_new : array_like
            The new keys and values, as above.
        batch_index : int or array_like of int, optional
            Append only to these sequences.

        Returns
        -------
        ndarray
            The new lengths of the selected sequences.

        Examples
        --------
        >>> import numpy as np
        >>> import fastattn
        >>> cache = fastattn.KVCache(2, 1, 8, 4)
        >>> cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 4)))
        array([3, 3]...)
        >>> cache.append(np.zeros((1, 1, 4)), np.zeros((1, 1, 4)), batch_index=1)   # (Hk, T, D)
        array([4]...)
        """
        with self._lock:  # the length checks and the writes as one step
            return self._append(k_new, v_new, batch_index)

    def _append(self, k_new: npt.ArrayLike, v_new: npt.ArrayLike, batch_index: _Index) -> np.ndarray:
        idx = batch_indices(batch_index, self.batch)
        n = self.batch if idx is None else idx.size
        allow_3d = isinstance(batch_index, numbers.Integral) and not isinstance(batch_index, bool)
        dt = self.dtype
        k = cache_tokens(k_new, "k_new", n, self.num_kv_heads, self.head_dim, allow_3d)
        v = cache_tokens(v_new, "v_new", n, self.num_kv_heads, self.value_dim, allow_3d)
        T = k.shape[2]
        if v.shape[2] != T:
            raise ValueError(f"k_new and v_new must hold the same number of tokens, got {T} and {v.shape[2]}")
        sel = self._len if idx is None else self._len[idx]
        need = int(sel.max()) + T if sel.size else 0
        if self._max_len is not None and need > self._max_len:
            b = int(np.argmax(sel)) if idx is None else int(idx[np.argmax(sel)])
            raise ValueError(
                f"appending {T} tokens to sequence {b} (length {int(self._len[b])}) exceeds "
                f"max_len={self.max_len}"
            )
        rows = np.arange(self.batch, dtype=np.int64) if idx is None else idx
        rot = self._rot
        kpos = None
        if rot is not None:  # keys rotated at positions lengths[b] + t while written (C)
            kpos = rot.positions(self._len[rows], T)
            rot.check(kpos, "the appended tokens' positions")
        if is_kv8(dt):
            # Rotated in float32, then quantised (per token, or with the fixed scale: a
            # value that does not fit raises), all before the first write.
            kf = k if rot is None else to_cache_dtype(k, F32, "k_new", rot, kpos)
            kc, ks_new = kv8_tokens(kf, dt, None if self._ktok else self._ks, "k_new")
            vc, vs_new = kv8_tokens(v, dt, None if self._vtok else self._vs, "v_new")
            if need > self.capacity:
                self._grow(need)
            if T and rows.size:
                starts = self._len[rows]
                write_tokens(self._k, self._v, idx, starts, kc, vc)
                if self._ktok and self._ks is not None:
                    write_rows(self._ks, idx, starts, ks_new)
                if self._vtok and self._vs is not None:
                    write_rows(self._vs, idx, starts, vs_new)
                self._len[rows] += T
            return self._len[rows].copy()
        # Convert (and check that every value fits) before the first write, so that a
        # failing conversion changes nothing (the check attention_with_kvcache and
        # flash_attn_with_kvcache make: keys_to_write).
        kc, rot_direct = keys_to_write(k, dt, "k_new", rot, kpos)
        vc = to_cache_dtype(v, dt, "v_new")
        if need > self.capacity:
            self._grow(need)
        if T and rows.size:
            write_tokens(self._k, self._v, idx, self._len[rows], kc, vc, rot if rot_direct else None, kpos)
            self._len[rows] += T
        return self._len[rows].copy()

    def _grow(self, need: int) -> None:
        """Reallocate a growing cache to max(need, 2 * capacity) tokens, keeping the valid prefix."""
        cap = max(need, 2 * self.capacity)
        used = int(self._len.max()) if self._len.size else 0
        k = np.zeros(self._k.shape[:2] + (cap, self._k.shape[3]), dtype=self.dtype)
        v = np.zeros(self._v.shape[:2] + (cap, self._v.shape[3]), dtype=self.dtype)
        k[:, :, :used] = self._k[:, :, :used]
        v[:, :, :used] = self._v[:, :, :used]
        ks, vs = self._ks, self._vs
        if self._ktok:
            assert self._ks is not None
            ks = np.ones(self._ks.shape[:2] + (cap, 1), dtype=F32)
            ks[:, :, :used] = self._ks[:, :, :used]
        if self._vtok:
            assert self._vs is not None
            vs = np.ones(self._vs.shape[:2] + (cap, 1), dtype=F32)
            vs[:, :, :used] = self._vs[:, :, :used]
        self._k, self._v, self._ks, self._vs = k, v, ks, vs

    def crop(self, n: int) -> None:
        """Roll back to at most ``n`` tokens per sequence (``lengths = min(lengths, n)``).

        What speculative decoding calls after rejected draft tokens.  ``n``: an
        int >= 0 (ValueError for a negative one, TypeError for a non-int); the
        tokens past ``n`` are forgotten, the memory is kept.

        Parameters
        ----------
        n : int
            Tokens to keep per sequence, >= 0.

        Returns
        -------
        None
            The lengths change in place.

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, 8, 4)
        >>> _ = cache.append(np.zeros((2, 1, 5, 4)), np.zeros((2, 1, 5, 4)))
        >>> _ = cache.append(np.zeros((1, 1, 4)), np.zeros((1, 1, 4)), batch_index=0)
        >>> cache.crop(5)
        >>> cache.lengths
        array([5, 5])
        """
        n = index_value(n, "n")
        if n < 0:
            raise ValueError(f"n must be >= 0 (the tokens to keep per sequence), got {n}")
        with self._lock:
            np.minimum(self._len, n, out=self._len)

    def reorder_cache(self, beam_idx: npt.ArrayLike) -> None:
        """Beam search: sequence ``b`` takes the contents and length of sequence ``beam_idx[b]``.

        ``beam_idx``: ``(batch,)`` integers in ``[0, batch)`` (repeats allowed: a
        beam may be continued by several); checked before anything changes.
        Copies the valid tokens of the selected rows (O(batch x longest length)),
        with their per-token scales in an 8-bit cache.

        Parameters
        ----------
        beam_idx : array_like of int
            ``(batch,)``: the sequence each row continues.

        Returns
        -------
        None
            The cache changes in place.

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, 8, 1)
        >>> _ = cache.append(np.array([1.0, 2.0]).reshape(2, 1, 1, 1), np.zeros((2, 1, 1, 1)))
        >>> cache.reorder_cache([1, 1])
        >>> cache.k[:, 0, 0, 0]
        array([2., 2.], dtype=float32)
        """
        B = self.batch
        a = indices_value(beam_idx, "beam_idx", 0, B - 1, "an integer array", half_open=True, shape=(B,))
        idx = a.astype(np.intp)
        with self._lock:
            used = int(self._len[idx].max()) if idx.size else 0
            if used:
                # The fancy index copies first, so rows that read each other are safe.
                self._k[:, :, :used] = self._k[idx, :, :used]
                self._v[:, :, :used] = self._v[idx, :, :used]
                if self._ktok:  # per-token scales travel with their tokens
                    assert self._ks is not None
                    self._ks[:, :, :used] = self._ks[idx, :, :used]
                if self._vtok:
                    assert self._vs is not None
                    self._vs[:, :, :used] = self._vs[idx, :, :used]
            self._len = self._len[idx]

    def get_seq_length(self) -> int:
        """Tokens in the cache: the longest sequence's length, an int (0 when empty).

        Returns
        -------
        int
            ``max(lengths)``, 0 for an empty cache.

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, 8, 4)
        >>> _ = cache.append(np.zeros((1, 3, 4)), np.zeros((1, 3, 4)), batch_index=1)
        >>> cache.get_seq_length()
        3
        """
        return int(self._len.max()) if self._len.size else 0

    def reset(self, batch_index: _Index = None) -> None:
        """Forget the tokens of the selected sequences (all when None): their lengths become 0.

        Parameters
        ----------
        batch_index : int or array_like of int, optional
            The sequences to reset; None resets all.

        Returns
        -------
        None
            The lengths change in place.

        Examples
        --------
        >>> cache = fastattn.KVCache(2, 1, 8, 4)
        >>> _ = cache.append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 4)))
        >>> cache.reset(batch_index=0)
        >>> cache.lengths
        array([0, 3])
        """
        idx = batch_indices(batch_index, self.batch)
        with self._lock:
            if idx is None:
                self._len[:] = 0
            else:
                self._len[idx] = 0

    # -------------------------------------------------------------- attention
    @overload
    def attend(
        self,
        q: npt.ArrayLike,
        *,
        window: _Window = None,
        alibi_slopes: npt.ArrayLike | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        return_lse: Literal[False] = False,
        num_threads: int | None = None,
        batch_index: _Index = None,
        precision: _Precision = None,
    ) -> np.ndarray: ...
    @overload
    def attend(
        self,
        q: npt.ArrayLike,
        *,
        window: _Window = None,
        alibi_slopes: npt.ArrayLike | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        return_lse: Literal[True],
        num_threads: int | None = None,
        batch_index: _Index = None,
        precision: _Precision = None,
    ) -> tuple[np.ndarray, np.ndarray]: ...
    def attend(
        self,
        q: npt.ArrayLike,
        *,
        window: _Window = None,
        alibi_slopes: npt.ArrayLike | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        return_lse: bool = False,
        num_threads: int | None = None,
        batch_index: _Index = None,
        precision: _Precision = None,
    ) -> Any:
        """Causal attention of the ``Lq`` newest tokens over each sequence's cached prefix.

        ``q``: ``(B, Hq, Lq, D)`` (``(len(idx), Hq, Lq, D)`` with
        ``batch_index``), float32 or the cache dtype; Hq a multiple of Hk
        (grouped-query attention without copies).  The queries are the last
        ``Lq`` cached positions of each sequence (append first, then attend),
        so every selected sequence needs ``lengths[b] >= Lq``.  Returns
        ``(.., Hq, Lq, Dv)`` in q's dtype (and the float32 LSE ``(.., Hq, Lq)``
        with ``return_lse``).  ``window``, ``alibi_slopes`` (``(Hq,)`` or
        ``(B, Hq)``), ``softcap``, ``scale``, ``num_threads`` and ``precision``
        (float32 matmul level; None: ``fastattn.get_float32_matmul_precision()``)
        as in :func:`fastattn.scaled_dot_product_attention`.

        Parameters
        ----------
        q : array_like
            The newest queries, as above.
        window, alibi_slopes, softcap, scale, num_threads, precision
            As for :func:`fastattn.scaled_dot_product_attention`.
        return_lse : bool, default False
            Also return the float32 log-sum-exp ``(.., Hq, Lq)``.
        batch_index : int or array_like of int, optional
            Attend only these sequences (their queries stacked in q's first axis).

        Returns
        -------
        out : ndarray
            ``(.., Hq, Lq, Dv)`` in q's dtype.
        lse : ndarray
            Only with ``return_lse=True``.

        Examples
        --------
        >>> import numpy as np
        >>> import fastattn
        >>> cache = fastattn.KVCache(2, 1, 8, 4)
        >>> lengths = cache.append(np.ones((2, 1, 3, 4)), np.arange(24.0).reshape(2, 1, 3, 4))
        >>> out = cache.attend(np.zeros((2, 1, 1, 4), np.float32))  # equal scores: the mean value
        >>> out[:, 0, 0]
        array([[ 4.,  5.,  6.,  7.],
               [16., 17., 18., 19.]], dtype=float32)
        """
        precision_code(precision)  # a bad level raises before the queries are rotated (C)
        idx = batch_indices(batch_index, self.batch)
        n = self.batch if idx is None else idx.size
        lens = self._len if idx is None else self._len[idx]
        qa = attend_query(q, self.dtype, (n, self.num_kv_heads, self.head_dim), lens, idx, alibi_slopes)
        Lq = qa.shape[2]
        if self._rot is not None:  # the queries are the last Lq cached positions
            qa = self._rot.rotate_q(qa, self._rot.positions(lens - Lq, Lq))
        opts: dict[str, Any] = dict(
            is_causal=True,
            enable_gqa=True,
            window=window,
            softcap=softcap,
            scale=scale,
            return_lse=return_lse,
            num_threads=num_threads,
            precision=precision,
        )
        ks, vs, ktok, vtok = self._ks, self._vs, self._ktok, self._vtok
        kv, vv = row_view(self._k, idx), row_view(self._v, idx)
        if kv is not None and vv is not None:
            # Per-token scales: the same rows (a progression: views); fixed ones broadcast.
            kss = row_view(ks, idx) if ktok and ks is not None else ks
            vss = row_view(vs, idx) if vtok and vs is not None else vs
            return sdpa_call(
                qa,
                kv,
                vv,
                key_lengths=lens.copy(),
                alibi_slopes=alibi_slopes,
                k_scale=kss,
                v_scale=vss,
                **opts,
            ).run()
        # Scattered indices: one kernel call per sequence, each on a view of the cache,
        # every one checked before the first runs.
        assert idx is not None
        al_all = None if alibi_slopes is None else as_array(alibi_slopes, "alibi_slopes")
        calls = [
            sdpa_call(
                qa[r : r + 1],
                self._k[b : b + 1],
                self._v[b : b + 1],
                key_lengths=self._len[b : b + 1].copy(),
                alibi_slopes=None if al_all is None else (al_all[r : r + 1] if al_all.ndim == 2 else al_all),
                k_scale=ks[b : b + 1] if ktok and ks is not None else ks,
                v_scale=vs[b : b + 1] if vtok and vs is not None else vs,
                **opts,
            )
            for r, b in enumerate(idx.tolist())
        ]
        out = np.empty(qa.shape[:3] + (self.value_dim,), dtype=qa.dtype)
        # The LSE dtype of the contiguous path: float64 for a float64 cache.
        want_lse = flag_value(return_lse, "return_lse")
        lse = np.empty(qa.shape[:3], dtype=F64 if qa.dtype == F64 else F32)
        for r, call in enumerate(calls):
            if want_lse:
                out[r : r + 1], lse[r : r + 1] = call.run()
            else:
                out[r : r + 1] = call.run()
        return (out, lse) if want_lse else out


@overload
def attention_with_kvcache(
    q: npt.ArrayLike,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    cache_seqlens: int | npt.ArrayLike,
    k_new: npt.ArrayLike | None = None,
    v_new: npt.ArrayLike | None = None,
    *,
    is_causal: bool = True,
    window: _Window = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: Literal[False] = False,
    num_threads: int | None = None,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    rotary_cos: npt.ArrayLike | None = None,
    rotary_sin: npt.ArrayLike | None = None,
    rotary_interleaved: bool = False,
    precision: _Precision = None,
    k_scale: npt.ArrayLike | None = None,
    v_scale: npt.ArrayLike | None = None,
    block_table: npt.ArrayLike | None = None,
) -> np.ndarray: ...
@overload
def attention_with_kvcache(
    q: npt.ArrayLike,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    cache_seqlens: int | npt.ArrayLike,
    k_new: npt.ArrayLike | None = None,
    v_new: npt.ArrayLike | None = None,
    *,
    is_causal: bool = True,
    window: _Window = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: Literal[True],
    num_threads: int | None = None,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    rotary_cos: npt.ArrayLike | None = None,
    rotary_sin: npt.ArrayLike | None = None,
    rotary_interleaved: bool = False,
    precision: _Precision = None,
    k_scale: npt.ArrayLike | None = None,
    v_scale: npt.ArrayLike | None = None,
    block_table: npt.ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...
def attention_with_kvcache(
    q: npt.ArrayLike,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    cache_seqlens: int | npt.ArrayLike,
    k_new: npt.ArrayLike | None = None,
    v_new: npt.ArrayLike | None = None,
    *,
    is_causal: bool = True,
    window: _Window = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    num_threads: int | None = None,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    rotary_cos: npt.ArrayLike | None = None,
    rotary_sin: npt.ArrayLike | None = None,
    rotary_interleaved: bool = False,
    precision: _Precision = None,
    k_scale: npt.ArrayLike | None = None,
    v_scale: npt.ArrayLike | None = None,
    block_table: npt.ArrayLike | None = None,
) -> Any:
    """Attention over caller-owned caches, optionally appending new keys/values first
    (the semantics of flash-attn's ``flash_attn_with_kvcache``).

    Shapes (``layout="bhsd"``): q ``(B, Hq, Lq, D)``, k_cache ``(B, Hk, S_max,
    D)``, v_cache ``(B, Hk, S_max, Dv)``, k_new/v_new ``(B, Hk, T, D/Dv)``;
    with ``layout="bshd"`` (flash-attn's): ``(B, Lq, Hq, D)``, ``(B, S_max, Hk,
    D)``, ``(B, T, Hk, D)``.  ``cache_seqlens``: an int or ``(B,)`` integer
    array, the tokens already valid in each cache row.

    With ``k_new``/``v_new`` (given together) their T tokens are written in
    place into the caches at positions ``cache_seqlens[b] .. + T`` (converted
    to the cache dtype), and attention runs over ``cache_seqlens + T`` keys;
    ``cache_seqlens`` itself is not modified (the caller advances it, as with
    flash-attn).  All checks run before anything is written.  The caches may be
    any strided views (K kept transposed, a misaligned or byte-swapped buffer):
    the attention reads exactly what the caches hold after the write.

    ``is_causal`` (default True) aligns bottom-right: query i of sequence b
    sees keys ``j <= i + n_b - Lq`` with ``n_b`` the attended length; it then
    requires ``Lq <= n_b``.  The caches may be float16, bfloat16, float32 or
    float64 (k_cache and v_cache alike); q float32 or the cache dtype.
    Returns the output in q's dtype and layout (and the LSE ``(B, Hq, Lq)``
    with ``return_lse``).  ``precision``: the float32 matmul level, as for
    :func:`fastattn.scaled_dot_product_attention` (None: the process default).

    8-bit caches (int8, ``ml_dtypes.float8_e4m3fn``, ``float8_e5m2``; both
    alike) take float32, float16 or bfloat16 queries and their float32 scales
    ``k_scale``/``v_scale`` in the caches' layout, as
    :func:`fastattn.scaled_dot_product_attention` takes them (dequantised
    K = ``k_cache * k_scale``; required for int8, 1 by default for fp8).
    New tokens are quantised before anything is written.  A scale with the
    cache's length on its sequence axis is per token (bhsd ``(B, Hk, S_max,
    1)``, bshd ``(B, S_max, Hk, 1)``, a writable float32 or float64 ndarray):
    the new tokens' scales (``max|x| / 127`` for int8, ``/ 448`` e4m3, ``/
    57344`` e5m2, per token and head, as :func:`fastattn.quantize_kv`) are
    written into it at the same positions as their data.  Every scale is
    checked, the positions past ``cache_seqlens`` included, so preallocate a
    per-token scale array with ``np.ones``.  Any other scale (per channel,
    per head, one number) is fixed: the new tokens are quantised with it,
    and one that does not fit (``|x / scale|`` beyond 127, 448 or 57344)
    raises ValueError naming k_new/v_new, with nothing written.  The
    rotation of rotary keys happens in float32, before the quantisation.

    Rotary embeddings (flash-attn's): ``rotary_cos``/``rotary_sin``
    ``(positions, rotary_dim / 2)`` (:func:`fastattn.rotary_cos_sin`), with
    k_new/v_new only.  The new keys are rotated at positions
    ``cache_seqlens[b] + t`` in the C pass that writes them into the cache;
    q is rotated at ``cache_seqlens[b] + i`` when causal or windowed, else at
    ``cache_seqlens[b]`` for every query (flash-attn's rule).  NeoX
    rotate-half by default, GPT-J pairs with ``rotary_interleaved=True``.
    q and k_new are not modified; a finite q or k_new whose rotation overflows
    its dtype (the cache's for k_new) raises ValueError before anything is written.

    Paged caches (``block_table``, flash-attn's convention): ``k_cache`` /
    ``v_cache`` are page pools ``(num_pages, Hk, page_size, D/Dv)`` (bshd:
    ``(num_pages, page_size, Hk, D/Dv)``) of any page size >= 1, and
    ``block_table`` an integer ``(B, max_pages)`` array: token j of sequence
    b lies in page ``block_table[b, j // page_size]`` at slot ``j %
    page_size``.  New tokens are written there (across page boundaries);
    no other slot is written, entries past a sequence's tokens are never
    read, and an entry out of range, too few pages or two sequences writing
    one slot raise ValueError with nothing written.  Per-token scales of
    8-bit pools are paged too, ``(num_pages, Hk, page_size, 1)`` (bhsd;
    written with the tokens); any other scale is per sequence.  The pages
    are read in place.

    Parameters
    ----------
    q : array_like
        The queries, ``(B, Hq, Lq, D)`` (bshd: ``(B, Lq, Hq, D)``).
    k_cache, v_cache : ndarray
        The caches, written in place when ``k_new``/``v_new`` are given.
    cache_seqlens : int or array_like of int
        Tokens already valid per cache row; not modified.
    k_new, v_new : array_like, optional
        New tokens to write at ``cache_seqlens`` before attending.
    is_causal : bool, default True
        Bottom-right causal mask over the attended keys.
    window, alibi_slopes, softcap, scale, num_threads, precision
        As for :func:`fastattn.scaled_dot_product_attention`.
    return_lse : bool, default False
        Also return the log-sum-exp ``(B, Hq, Lq)``.
    layout : {"bhsd", "bshd"}, default "bhsd"
        The layout of q, the caches and the new tokens.
    rotary_cos, rotary_sin : array_like, optional
        Rotary tables, as above.
    rotary_interleaved : bool, default False
        GPT-J pairs instead of NeoX's rotate-half.
    k_scale, v_scale : array_like or float, optional
        The float32 scales of 8-bit caches, as above (TypeError with float
        caches; int8 caches require them).
    block_table : array_like of int, optional
        Paged caches, as below: ``(B, max_pages)`` page indices.

    Returns
    -------
    out : ndarray
        In q's dtype and layout, last dimension Dv.
    lse : ndarray
        Only with ``return_lse=True``.

    See Also
    --------
    KVCache : The same with the cache and its lengths kept for you.
    fastattn.flash_compat.flash_attn_with_kvcache : flash-attn's signature.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> k_cache = np.zeros((1, 2, 16, 8), np.float32)
    >>> v_cache = np.zeros((1, 2, 16, 8), np.float32)
    >>> k_new, v_new = rng.standard_normal((2, 1, 2, 3, 8)).astype(np.float32)
    >>> q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    >>> out = fastattn.attention_with_kvcache(q, k_cache, v_cache, 0, k_new, v_new)
    >>> bool(np.array_equal(k_cache[:, :, :3], k_new))           # written in place
    True
    >>> ref = fastattn.reference.scaled_dot_product_attention(q, k_new, v_new, is_causal=True)
    >>> bool(np.allclose(out, ref, atol=1e-5))
    True

    int8 caches with per-token scales, written with the tokens:

    >>> k8, v8 = np.zeros((2, 1, 2, 16, 8), np.int8)
    >>> ks, vs = np.ones((2, 1, 2, 16, 1), np.float32)
    >>> out8 = fastattn.attention_with_kvcache(q, k8, v8, 0, k_new, v_new, k_scale=ks, v_scale=vs)
    >>> bool(np.allclose(ks[:, :, :3], np.abs(k_new).max(-1, keepdims=True) / 127))
    True
    >>> bool(np.abs(out8 - ref).max() < 0.05)
    True
    """
    if block_table is not None:
        return paged_attention(
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            k_new,
            v_new,
            block_table,
            is_causal=is_causal,
            window=window,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            scale=scale,
            return_lse=return_lse,
            num_threads=num_threads,
            layout=layout,
            rotary=(rotary_cos, rotary_sin, rotary_interleaved),
            precision=precision,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    lay = layout_value(layout)
    is_causal = flag_value(is_causal, "is_causal")
    return_lse = flag_value(return_lse, "return_lse")
    qa = as_array(q, "q")
    qh, kc, vc, seq, kn, vn = cache_operands(qa, k_cache, v_cache, cache_seqlens, k_new, v_new, lay)
    B, Hq, Lq, D = qh.shape
    cdt = kc.dtype
    T = 0 if kn is None else kn.shape[2]
    # 8-bit caches: the scales (checked here, naming the caches; per token or fixed).
    writing = bool(T and B)
    kfix, kst = kv8_scale(k_scale, "k_scale", k_cache, lay, "k_cache", writing)
    vfix, vst = kv8_scale(v_scale, "v_scale", v_cache, lay, "v_cache", writing)
    if writing:
        others = [a for a in (k_cache, v_cache, kn, vn) if a is not None]
        kv8_targets_apart([(kst, "k_scale"), (vst, "v_scale")], others)
    total = seq + T
    if is_causal and total.size and total.min() < Lq:
        b = int(np.argmin(total))
        raise ValueError(
            f"q holds {Lq} query tokens but sequence {b} has only {int(total[b])} keys; "
            "causal decoding needs cache_seqlens + new tokens >= query length "
            "(or pass is_causal=False)"
        )
    # Every check of the attention itself, once, before anything is written; the
    # plan reads the caches in place, so it sees the tokens written below (a cache the
    # kernel cannot read in place is copied here, and the copy updated by reread_written).
    call = sdpa_call(
        qa,
        k_cache,
        v_cache,
        is_causal=is_causal,
        enable_gqa=True,
        layout=lay,
        key_lengths=total,
        window=window,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        scale=scale,
        return_lse=return_lse,
        num_threads=num_threads,
        precision=precision,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    rot: Any = None
    kpos = qpos = None
    if rotary_cos is not None or rotary_sin is not None:
        rot = _CacheRotary(rotary_cos, rotary_sin, rotary_interleaved, D, cdt)
        if k_new is None:
            raise ValueError("rotary_cos/rotary_sin need k_new and v_new (the keys to rotate)")
        kpos = rot.positions(seq, T)
        local = window is not None and tuple(window) != (-1, -1)
        qpos = rot.positions(seq, Lq) if (is_causal or local) else np.broadcast_to(seq[:, None], (B, Lq))
        rot.check(kpos, "the new keys' positions (cache_seqlens + t)")
        rot.check(qpos, "the queries' positions")
        qr = rot.rotate_q(qh, qpos, num_threads)  # before any write: its overflow check raises
    if writing and kn is not None and vn is not None and is_kv8(cdt):
        # Rotated in float32, then quantised (a value that does not fit a fixed scale
        # raises), all before any write.
        kf = kn if rot is None else to_cache_dtype(kn, F32, "k_new", rot, kpos, num_threads)
        kw, ks_new = kv8_tokens(kf, cdt, kfix, "k_new")
        vw, vs_new = kv8_tokens(vn, cdt, vfix, "v_new")
        write_tokens(kc, vc, None, seq, kw, vw)
        if kst is not None:
            write_rows(kst, None, seq, ks_new)
        if vst is not None:
            write_rows(vst, None, seq, vs_new)
        reread_written(call, kc, vc, seq, T)
        call = reread_scales(call, kst, vst)
    elif writing and kn is not None and vn is not None:
        # Converted and checked (a value that would overflow the cache dtype raises) before any write.
        kw, rot_direct = keys_to_write(kn, cdt, "k_new", rot, kpos, num_threads)
        vw = to_cache_dtype(vn, cdt, "v_new")
        write_tokens(kc, vc, None, seq, kw, vw, rot if rot_direct else None, kpos, num_threads)
        # A cache the kernel cannot read in place was copied by the check above, before the
        # write: the copy takes the new tokens too, read back from the cache.
        reread_written(call, kc, vc, seq, T)
    if rot is not None:
        call = call.with_queries(qr)
    return call.run()
