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

import numpy as np

from ._args import is_real_float as _is_real_float
from ._args import per_head, softcap_value, window_value
from ._args import query_dtype_ok as _query_dtype_ok
from ._args import query_dtypes as _query_dtypes
from ._args import rows as _rows
from ._checks import (
    F32,
    F64,
    as_array,
    bfloat16_dtype,
    flag_value,
    int_value,
    is_storage_dtype,
    scale_value,
    threads_value,
)
from .functional import scaled_dot_product_attention
from .positions import _CacheRotary

__all__ = ["KVCache", "attention_with_kvcache"]


def _cache_dtype(dtype):
    try:
        dt = bfloat16_dtype() if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype!r}") from None
    if not is_storage_dtype(dt):
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dt}")
    return dt


def _batch_indices(batch_index, B, name="batch_index"):
    """None -> None; int / slice / 1-D int array -> int64 array of distinct indices in [0, B)."""
    if batch_index is None:
        return None
    if isinstance(batch_index, slice):
        return np.arange(B, dtype=np.int64)[batch_index]
    if isinstance(batch_index, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, a slice or an integer array, got bool")
    if isinstance(batch_index, numbers.Integral):
        i = int(batch_index)
        if not 0 <= i < B:
            raise ValueError(f"{name} {i} is out of range for a batch of {B}")
        return np.array([i], dtype=np.int64)
    a = as_array(batch_index, name)
    if a.ndim == 1 and a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int, a slice or an integer array, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and (a.min() < 0 or a.max() >= B):
        raise ValueError(f"{name} values must lie in [0, {B}), got range [{a.min()}, {a.max()}]")
    a = a.astype(np.int64)
    if np.unique(a).size != a.size:
        raise ValueError(f"{name} must not repeat an index")
    return a


def _new_tokens(x, name, n, Hk, Dx, allow_3d):
    """Check one block of new keys/values: shape (n, Hk, T, Dx), real floating; returns it converted."""
    a = as_array(x, name)
    if not _is_real_float(a.dtype):
        raise TypeError(f"{name} must be a real floating array, got dtype {a.dtype}")
    if allow_3d and a.ndim == 3:
        a = a[None]
    if a.ndim != 4 or a.shape[0] != n or a.shape[1] != Hk or a.shape[3] != Dx:
        want = f"({n}, {Hk}, T, {Dx})" + (f" or ({Hk}, T, {Dx})" if allow_3d else "")
        raise ValueError(f"{name} must have shape {want}, got {np.shape(x)}")
    return a


def _max_finite(dt):
    if dt == F64 or dt == F32 or dt.kind == "f":
        return float(np.finfo(dt).max)
    import ml_dtypes  # bfloat16

    return float(ml_dtypes.finfo(dt).max)


def _rotation_fits(k, dt):
    """True when rotating k's values (each output is x*cos -/+ y*sin of a pair, at most
    sqrt(2) * max|k| in magnitude) cannot overflow the cache dtype dt."""
    if k.size == 0:
        return True
    with np.errstate(invalid="ignore"):
        a = np.abs(k.astype(F64) if k.dtype != F64 else k)
    m = float(np.max(a, where=np.isfinite(a), initial=0.0))
    return m * 1.4142136 < _max_finite(dt) * 0.999


def _to_cache_dtype(a, dt, name, rot=None, pos=None, num_threads=None):
    """``a`` converted to the cache dtype ``dt`` (rotated at ``pos`` first with ``rot``);
    ValueError when a finite value becomes inf (beyond the dtype's range), so that nothing
    is lost silently.  Called before any write."""
    if rot is not None:
        from .positions import _last_contiguous, rotate

        src = a if is_storage_dtype(a.dtype) else a.astype(rot.cos.dtype)
        c = np.empty(a.shape, dtype=dt)
        with np.errstate(over="ignore", invalid="ignore"):
            rotate(_last_contiguous(src), c, pos, rot.cos, rot.sin, rot.interleaved, num_threads)
    elif a.dtype == dt:
        return a
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            c = a.astype(dt)
    inf = np.isinf(c)
    if inf.any():
        # an inf given stays inf; rotated, it may spread to its pair: any non-finite input in a row
        given = np.isinf(a) if rot is None else ~np.isfinite(a).all(axis=-1, keepdims=True)
        lost = inf & ~given
        if lost.any():
            where = tuple(int(i) for i in np.argwhere(lost)[0])
            raise ValueError(
                f"{name} holds {int(lost.sum())} value(s) beyond the range of the cache dtype {dt} "
                f"(e.g. {float(a[where])!r} at index {where}), which would be stored as inf; nothing was "
                "written. Use a wider cache dtype (float32) or rescale the values."
            )
    return c


class KVCache:
    """A key/value cache for ``batch`` sequences of up to ``max_len`` tokens.

    Keys are stored as ``(batch, num_kv_heads, capacity, head_dim)`` and values
    as ``(batch, num_kv_heads, capacity, value_dim)`` in ``dtype`` (float32 by
    default; float16, bfloat16 and float64 on request); ``lengths[b]`` tokens of
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
    """

    _INITIAL_CAPACITY = 16  # tokens per sequence of a growing cache before its first growth

    def __init__(
        self,
        batch,
        num_kv_heads,
        max_len,
        head_dim,
        *,
        dtype=np.float32,
        value_dim=None,
        rotary_cos=None,
        rotary_sin=None,
        rotary_interleaved=False,
    ):
        B = int_value(batch, "batch", 1)
        Hk = int_value(num_kv_heads, "num_kv_heads", 1)
        self._max_len = None if max_len is None else int_value(max_len, "max_len", 1)
        D = int_value(head_dim, "head_dim", 1)
        Dv = D if value_dim is None else int_value(value_dim, "value_dim", 1)
        dt = _cache_dtype(dtype)
        S = self._INITIAL_CAPACITY if self._max_len is None else self._max_len
        self._k = np.zeros((B, Hk, S, D), dtype=dt)
        self._v = np.zeros((B, Hk, S, Dv), dtype=dt)
        self._len = np.zeros(B, dtype=np.int64)
        self._lock = threading.Lock()  # append/reset/crop/reorder_cache (see the class doc)
        # Rotary (RoPE): keys rotated at their positions as they are appended, queries as they attend.
        self._rot = None
        if rotary_cos is not None or rotary_sin is not None:
            self._rot = _CacheRotary(rotary_cos, rotary_sin, rotary_interleaved, D, dt)

    # ----------------------------------------------------------- properties
    @property
    def batch(self):
        """Number of sequences."""
        return self._k.shape[0]

    @property
    def num_kv_heads(self):
        """Key/value heads (Hk)."""
        return self._k.shape[1]

    @property
    def max_len(self):
        """The most tokens a sequence may hold: the ``max_len`` given, None for a growing cache."""
        return self._max_len

    @property
    def capacity(self):
        """Tokens per sequence allocated now (``max_len``, or a growing cache's current size)."""
        return self._k.shape[2]

    @property
    def head_dim(self):
        """Key head dim (D)."""
        return self._k.shape[3]

    @property
    def value_dim(self):
        """Value head dim (Dv)."""
        return self._v.shape[3]

    @property
    def dtype(self):
        """Storage dtype of keys and values."""
        return self._k.dtype

    @property
    def lengths(self):
        """Valid tokens per sequence: an int64 copy, shape (batch,)."""
        return self._len.copy()

    @property
    def nbytes(self):
        """Bytes held by the key and value arrays."""
        return self._k.nbytes + self._v.nbytes

    @property
    def k(self):
        """The whole allocated key array (read-only view; only ``[b, :, :lengths[b]]`` is valid)."""
        view = self._k.view()
        view.flags.writeable = False
        return view

    @property
    def v(self):
        """The whole preallocated value array (read-only view)."""
        view = self._v.view()
        view.flags.writeable = False
        return view

    def __repr__(self):
        return (
            f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, max_len={self.max_len}, "
            f"capacity={self.capacity}, "
            f"head_dim={self.head_dim}, value_dim={self.value_dim}, dtype={self.dtype}, "
            f"lengths={self._len.tolist()})"
        )

    # -------------------------------------------------------------- mutation
    def append(self, k_new, v_new, *, batch_index=None):
        """Append T tokens to each selected sequence.

        ``k_new``: ``(B, Hk, T, D)`` (``(len(idx), Hk, T, D)`` with
        ``batch_index``; an int ``batch_index`` also takes ``(Hk, T, D)``),
        ``v_new`` likewise with ``Dv``.  Any real floating dtype; converted to
        the cache dtype.  Every check runs before anything is written: on an
        error (a sequence would exceed ``max_len``, or a value does not fit the
        cache dtype and would become inf) the cache and its lengths are
        unchanged.  A growing cache (``max_len=None``) doubles its capacity when
        needed.  Returns the new lengths of the selected sequences.
        """
        with self._lock:  # the length checks and the writes as one step
            return self._append(k_new, v_new, batch_index)

    def _append(self, k_new, v_new, batch_index):
        idx = _batch_indices(batch_index, self.batch)
        n = self.batch if idx is None else idx.size
        allow_3d = isinstance(batch_index, numbers.Integral) and not isinstance(batch_index, bool)
        dt = self.dtype
        k = _new_tokens(k_new, "k_new", n, self.num_kv_heads, self.head_dim, allow_3d)
        v = _new_tokens(v_new, "v_new", n, self.num_kv_heads, self.value_dim, allow_3d)
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
        if rot is not None:  # keys rotated at positions lengths[b] + t while written (C)
            kpos = rot.positions(self._len[rows], T)
            rot.check(kpos, "the appended tokens' positions")
        # Convert (and check that every value fits) before the first write, so that a
        # failing conversion changes nothing.  Rotated keys are rotated and converted in
        # one C pass while written, unless the rotation could overflow the cache dtype:
        # then into a checked buffer first (kc), written like unrotated keys.
        rot_direct = rot is not None and _rotation_fits(k, dt)
        kc = k if rot_direct else _to_cache_dtype(k, dt, "k_new", rot, kpos if rot is not None else None)
        vc = _to_cache_dtype(v, dt, "v_new")
        if need > self.capacity:
            self._grow(need)
        if T and rows.size:
            if rot_direct:
                if idx is None:
                    rot.append(k, self._k, kpos)
                else:
                    for r, b in enumerate(rows.tolist()):
                        rot.append(k[r : r + 1], self._k[b : b + 1], kpos[r : r + 1])
            start = self._len[rows]
            if np.all(start == start[0]):
                s0 = int(start[0])
                kv = _rows(self._k, idx)
                if kv is not None:
                    if not rot_direct:
                        kv[:, :, s0 : s0 + T] = kc
                    _rows(self._v, idx)[:, :, s0 : s0 + T] = vc
                else:
                    if not rot_direct:
                        self._k[rows, :, s0 : s0 + T] = kc
                    self._v[rows, :, s0 : s0 + T] = vc
            else:
                for r, (b, s) in enumerate(zip(rows.tolist(), start.tolist())):
                    if not rot_direct:
                        self._k[b, :, s : s + T] = kc[r]
                    self._v[b, :, s : s + T] = vc[r]
            self._len[rows] += T
        return self._len[rows].copy()

    def _grow(self, need):
        """Reallocate a growing cache to max(need, 2 * capacity) tokens, keeping the valid prefix."""
        cap = max(need, 2 * self.capacity)
        used = int(self._len.max()) if self._len.size else 0
        k = np.zeros(self._k.shape[:2] + (cap, self._k.shape[3]), dtype=self.dtype)
        v = np.zeros(self._v.shape[:2] + (cap, self._v.shape[3]), dtype=self.dtype)
        k[:, :, :used] = self._k[:, :, :used]
        v[:, :, :used] = self._v[:, :, :used]
        self._k, self._v = k, v

    def crop(self, n):
        """Roll back to at most ``n`` tokens per sequence (``lengths = min(lengths, n)``).

        What speculative decoding calls after rejected draft tokens.  ``n``: an
        int >= 0 (ValueError for a negative one, TypeError for a non-int); the
        tokens past ``n`` are forgotten, the memory is kept.
        """
        n = int_value(n, "n")
        if n < 0:
            raise ValueError(f"n must be >= 0 (the tokens to keep per sequence), got {n}")
        with self._lock:
            np.minimum(self._len, n, out=self._len)

    def reorder_cache(self, beam_idx):
        """Beam search: sequence ``b`` takes the contents and length of sequence ``beam_idx[b]``.

        ``beam_idx``: ``(batch,)`` integers in ``[0, batch)`` (repeats allowed: a
        beam may be continued by several); checked before anything changes.
        Copies the valid tokens of the selected rows (O(batch x longest length)).
        """
        a = as_array(beam_idx, "beam_idx")
        if a.dtype.kind not in "iu":
            raise TypeError(f"beam_idx must be an integer array, got dtype {a.dtype}")
        if a.shape != (self.batch,):
            raise ValueError(
                f"beam_idx must have shape ({self.batch},) (one source row per row), got {a.shape}"
            )
        if a.size and (a.min() < 0 or a.max() >= self.batch):
            raise ValueError(
                f"beam_idx values must lie in [0, {self.batch}), got range [{a.min()}, {a.max()}]"
            )
        idx = a.astype(np.intp)
        with self._lock:
            used = int(self._len[idx].max()) if idx.size else 0
            if used:
                # The fancy index copies first, so rows that read each other are safe.
                self._k[:, :, :used] = self._k[idx, :, :used]
                self._v[:, :, :used] = self._v[idx, :, :used]
            self._len = self._len[idx]

    def get_seq_length(self):
        """Tokens in the cache: the longest sequence's length, an int (0 when empty)."""
        return int(self._len.max()) if self._len.size else 0

    def reset(self, batch_index=None):
        """Forget the tokens of the selected sequences (all when None): their lengths become 0."""
        idx = _batch_indices(batch_index, self.batch)
        with self._lock:
            if idx is None:
                self._len[:] = 0
            else:
                self._len[idx] = 0

    # -------------------------------------------------------------- attention
    def attend(
        self,
        q,
        *,
        window=None,
        alibi_slopes=None,
        softcap=None,
        scale=None,
        return_lse=False,
        num_threads=None,
        batch_index=None,
    ):
        """Causal attention of the ``Lq`` newest tokens over each sequence's cached prefix.

        ``q``: ``(B, Hq, Lq, D)`` (``(len(idx), Hq, Lq, D)`` with
        ``batch_index``), float32 or the cache dtype; Hq a multiple of Hk
        (grouped-query attention without copies).  The queries are the last
        ``Lq`` cached positions of each sequence (append first, then attend),
        so every selected sequence needs ``lengths[b] >= Lq``.  Returns
        ``(.., Hq, Lq, Dv)`` in q's dtype (and the float32 LSE ``(.., Hq, Lq)``
        with ``return_lse``).  ``window``, ``alibi_slopes`` (``(Hq,)`` or
        ``(B, Hq)``), ``softcap``, ``scale``, ``num_threads`` as in
        :func:`fastattn.scaled_dot_product_attention`.
        """
        idx = _batch_indices(batch_index, self.batch)
        n = self.batch if idx is None else idx.size
        qa = as_array(q, "q")
        if not _query_dtype_ok(qa.dtype, self.dtype):
            raise TypeError(
                f"q must have dtype {_query_dtypes(self.dtype)} for a {self.dtype} cache, got {qa.dtype}"
            )
        if qa.ndim != 4 or qa.shape[0] != n or qa.shape[3] != self.head_dim:
            raise ValueError(f"q must have shape ({n}, Hq, Lq, {self.head_dim}), got {qa.shape}")
        Hq, Lq = qa.shape[1], qa.shape[2]
        if Hq % self.num_kv_heads:
            raise ValueError(
                f"q heads ({Hq}) must be a multiple of the cache's kv heads ({self.num_kv_heads})"
            )
        lens = self._len if idx is None else self._len[idx]
        if lens.size and lens.min() < Lq:
            b = int(np.argmin(lens)) if idx is None else int(idx[np.argmin(lens)])
            raise ValueError(
                f"q holds {Lq} query tokens but sequence {b} has only {int(self._len[b])} "
                "cached tokens; append the new tokens' keys and values before attending"
            )
        if alibi_slopes is not None:
            al = as_array(alibi_slopes, "alibi_slopes")
            if al.ndim == 2 and al.shape[0] != n:
                raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({n}, {Hq}), got {al.shape}")
        if self._rot is not None:  # the queries are the last Lq cached positions
            qa = self._rot.rotate_q(qa, self._rot.positions(lens - Lq, Lq))
        opts = dict(
            is_causal=True,
            enable_gqa=True,
            window=window,
            softcap=softcap,
            scale=scale,
            return_lse=return_lse,
            num_threads=num_threads,
        )
        kv = _rows(self._k, idx)
        if kv is not None:
            return scaled_dot_product_attention(
                qa, kv, _rows(self._v, idx), key_lengths=lens.copy(), alibi_slopes=alibi_slopes, **opts
            )
        # Scattered indices: one kernel call per sequence, each on a view of the cache.
        out = np.empty(qa.shape[:3] + (self.value_dim,), dtype=qa.dtype)
        # The LSE dtype of the contiguous path: float64 for a float64 cache.
        want_lse = flag_value(return_lse, "return_lse")
        lse = np.empty(qa.shape[:3], dtype=F64 if qa.dtype == F64 else F32) if want_lse else None
        al = None if alibi_slopes is None else as_array(alibi_slopes, "alibi_slopes")
        for r, b in enumerate(idx.tolist()):
            slopes = None if al is None else (al[r : r + 1] if al.ndim == 2 else al)
            res = scaled_dot_product_attention(
                qa[r : r + 1],
                self._k[b : b + 1],
                self._v[b : b + 1],
                key_lengths=self._len[b : b + 1].copy(),
                alibi_slopes=slopes,
                **opts,
            )
            if return_lse:
                out[r : r + 1], lse[r : r + 1] = res
            else:
                out[r : r + 1] = res
        return (out, lse) if return_lse else out


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    k_new=None,
    v_new=None,
    *,
    is_causal=True,
    window=None,
    alibi_slopes=None,
    softcap=None,
    scale=None,
    return_lse=False,
    num_threads=None,
    layout="bhsd",
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=False,
):
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
    flash-attn).  All checks run before anything is written.

    ``is_causal`` (default True) aligns bottom-right: query i of sequence b
    sees keys ``j <= i + n_b - Lq`` with ``n_b`` the attended length; it then
    requires ``Lq <= n_b``.  The caches may be float16, bfloat16, float32 or
    float64 (k_cache and v_cache alike); q float32 or the cache dtype.
    Returns the output in q's dtype and layout (and the LSE ``(B, Hq, Lq)``
    with ``return_lse``).

    Rotary embeddings (flash-attn's): ``rotary_cos``/``rotary_sin``
    ``(positions, rotary_dim / 2)`` (:func:`fastattn.rotary_cos_sin`), with
    k_new/v_new only.  The new keys are rotated at positions
    ``cache_seqlens[b] + t`` in the C pass that writes them into the cache;
    q is rotated at ``cache_seqlens[b] + i`` when causal or windowed, else at
    ``cache_seqlens[b]`` for every query (flash-attn's rule).  NeoX
    rotate-half by default, GPT-J pairs with ``rotary_interleaved=True``.
    q and k_new are not modified.
    """
    if not isinstance(layout, str) or layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    is_causal = flag_value(is_causal, "is_causal")
    return_lse = flag_value(return_lse, "return_lse")
    qa = as_array(q, "q")
    if not isinstance(k_cache, np.ndarray):
        raise TypeError(f"k_cache must be a numpy.ndarray, got {type(k_cache).__name__}")
    if not isinstance(v_cache, np.ndarray):
        raise TypeError(f"v_cache must be a numpy.ndarray, got {type(v_cache).__name__}")
    cdt = k_cache.dtype
    if not is_storage_dtype(cdt):
        raise TypeError(f"k_cache must have dtype float16, bfloat16, float32 or float64, got {cdt}")
    if v_cache.dtype != cdt:
        raise TypeError(f"v_cache must have the dtype of k_cache ({cdt}), got {v_cache.dtype}")
    if not _query_dtype_ok(qa.dtype, cdt):
        raise TypeError(f"q must have dtype {_query_dtypes(cdt)} for {cdt} caches, got {qa.dtype}")
    for a, name in ((qa, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {a.shape}")

    def bhsd(a):
        return a if layout == "bhsd" else np.swapaxes(a, 1, 2)

    qh, kc, vc = bhsd(qa), bhsd(k_cache), bhsd(v_cache)
    B, Hq, Lq, D = qh.shape
    _, Hk, S, Dk = kc.shape
    if kc.shape[0] != B or vc.shape[0] != B:
        raise ValueError(
            f"q, k_cache and v_cache must share the batch size, got {qa.shape}, "
            f"{k_cache.shape}, {v_cache.shape}"
        )
    if Dk != D:
        raise ValueError(f"k_cache head dim ({Dk}) must equal q's ({D})")
    if vc.shape[1] != Hk or vc.shape[2] != S:
        raise ValueError(
            f"v_cache must have the heads and length of k_cache, got {v_cache.shape} and {k_cache.shape}"
        )
    Dv = vc.shape[3]
    if D == 0 or Dv == 0:
        raise ValueError(f"head dims must be >= 1, got head_dim {D} and value_dim {Dv}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the cache's kv heads ({Hk})")

    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, (bool, np.bool_)):
        if not 0 <= cache_seqlens <= S:  # before np.full: a value beyond int64 is OverflowError there
            raise ValueError(f"cache_seqlens must lie in [0, {S}], got {cache_seqlens}")
        seq = np.full(B, int(cache_seqlens), dtype=np.int64)
    else:
        s = as_array(cache_seqlens, "cache_seqlens")
        if s.dtype.kind not in "iu":
            raise TypeError(f"cache_seqlens must be an int or an integer array, got dtype {s.dtype}")
        if s.ndim == 0:
            s = np.broadcast_to(s, (B,))
        if s.shape != (B,):
            raise ValueError(f"cache_seqlens must have shape ({B},), got {s.shape}")
        seq = s.astype(np.int64)
    if seq.size and (seq.min() < 0 or seq.max() > S):
        raise ValueError(f"cache_seqlens values must lie in [0, {S}], got range [{seq.min()}, {seq.max()}]")

    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    T = 0
    if k_new is not None:
        kn = bhsd(_as_new(k_new, "k_new", layout))
        vn = bhsd(_as_new(v_new, "v_new", layout))
        if kn.shape[:2] != (B, Hk) or kn.shape[3] != D:
            raise ValueError(
                f"k_new must have {B} sequences, {Hk} heads and head dim {D}, got {np.shape(k_new)}"
            )
        if vn.shape[:2] != (B, Hk) or vn.shape[3] != Dv:
            raise ValueError(
                f"v_new must have {B} sequences, {Hk} heads and head dim {Dv}, got {np.shape(v_new)}"
            )
        T = kn.shape[2]
        if vn.shape[2] != T:
            raise ValueError(
                f"k_new and v_new must hold the same number of tokens, got {T} and {vn.shape[2]}"
            )
        if seq.size and seq.max() + T > S:
            b = int(np.argmax(seq))
            raise ValueError(
                f"cache_seqlens[{b}] + {T} new tokens = {int(seq[b]) + T} exceeds the cache length {S}"
            )
        for a, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            if not a.flags.writeable:
                raise ValueError(f"{name} must be writable to append k_new/v_new")
        if np.may_share_memory(k_cache, v_cache):
            raise ValueError("k_cache and v_cache must not share memory")
    total = seq + T
    if is_causal and total.size and total.min() < Lq:
        b = int(np.argmin(total))
        raise ValueError(
            f"q holds {Lq} query tokens but sequence {b} has only {int(total[b])} keys; "
            "causal decoding needs cache_seqlens + new tokens >= query length "
            "(or pass is_causal=False)"
        )
    _check_options(window, alibi_slopes, softcap, scale, num_threads, B, Hq, D, qa.dtype)
    rot = None
    if rotary_cos is not None or rotary_sin is not None:
        rot = _CacheRotary(rotary_cos, rotary_sin, rotary_interleaved, D, cdt)
        if k_new is None:
            raise ValueError("rotary_cos/rotary_sin need k_new and v_new (the keys to rotate)")
        kpos = rot.positions(seq, T)
        local = window is not None and tuple(window) != (-1, -1)
        qpos = rot.positions(seq, Lq) if (is_causal or local) else np.broadcast_to(seq[:, None], (B, Lq))
        rot.check(kpos, "the new keys' positions (cache_seqlens + t)")
        rot.check(qpos, "the queries' positions")
    if T and B:
        rot_direct = rot is not None and _rotation_fits(kn, cdt)
        kw = (
            kn
            if rot_direct
            else _to_cache_dtype(kn, cdt, "k_new", rot, kpos if rot is not None else None, num_threads)
        )
        vw = _to_cache_dtype(vn, cdt, "v_new")  # raises before any write when a value does not fit
        if rot_direct:  # rotate and write in one C pass over the new tokens
            rot.append(kw, kc, kpos, num_threads)
        if np.all(seq == seq[0]):
            s0 = int(seq[0])
            if not rot_direct:
                kc[:, :, s0 : s0 + T] = kw
            vc[:, :, s0 : s0 + T] = vw
        else:
            for b, s0 in enumerate(seq.tolist()):
                if not rot_direct:
                    kc[b, :, s0 : s0 + T] = kw[b]
                vc[b, :, s0 : s0 + T] = vw[b]
    if rot is not None:
        qr = rot.rotate_q(qh, qpos, num_threads)
        qa = qr if layout == "bhsd" else np.swapaxes(qr, 1, 2)
    return scaled_dot_product_attention(
        qa,
        k_cache,
        v_cache,
        is_causal=bool(is_causal),
        enable_gqa=True,
        layout=layout,
        key_lengths=total,
        window=window,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        scale=scale,
        return_lse=return_lse,
        num_threads=num_threads,
    )


def _as_new(x, name, layout):
    a = as_array(x, name)
    if not _is_real_float(a.dtype):
        raise TypeError(f"{name} must be a real floating array, got dtype {a.dtype}")
    if a.ndim != 4:
        raise ValueError(f"{name} must be 4-D ({layout}), got shape {a.shape}")
    return a


def _check_options(window, alibi_slopes, softcap, scale, num_threads, B, Hq, D, qdt):
    """The option checks of scaled_dot_product_attention, run before the caches are written."""
    window_value(window)
    softcap_value(softcap)
    scale_value(scale, D, F64 if qdt == F64 else F32)
    threads_value(num_threads, lambda: 1)
    if alibi_slopes is not None:
        per_head(alibi_slopes, "alibi_slopes", (B,), Hq, True)
