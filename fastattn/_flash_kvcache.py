"""flash-attn's ``flash_attn_with_kvcache`` (re-exported by fastattn.flash_compat,
whose docstring gives the conventions): the cache checks, the in-place append and
the attention over the cache."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _torch_bridge, positions
from ._args import sdpa_call
from ._cache_args import (
    CACHE_DTYPES8,
    cache_dtype_ok,
    index_value,
    indices_value,
    keys_to_write,
    kv8_tokens,
    query_dtypes,
    reread_written,
    seqlens_value,
    to_cache_dtype,
    write_tokens,
)
from ._cache_args import is_real_float as _is_real_float
from ._cache_args import query_dtype_ok as _query_dtype_ok
from ._cache_args import row_view as _rows
from ._checks import F32
from ._flash_args import alibi_value as _alibi
from ._flash_args import array_value as _array
from ._flash_args import check_ndim as _ndim
from ._flash_args import flag_value as _flag
from ._flash_args import softcap_value as _softcap
from ._flash_args import window_size_value as _window_size
from ._flash_args import wrap as _wrap
from ._paged import paged_attention
from ._quant import F32_TINY, I8, is_kv8

# The rotary helper of fastattn.positions (Any: that module is typed by its owner).
_CacheRotary: Any = positions.CacheRotary


_ONE = np.ones((1, 1, 1, 1), dtype=F32)  # an fp8 cache's scale without a descale
_FP8_TORCH = ("float8_e4m3fn", "float8_e5m2")


def _cache_array(x: Any, name: str, writable: bool) -> np.ndarray:
    """A cache as a NumPy array (a view of a CPU tensor's memory): as ``_flash_args.array_value``,
    and an fp8 tensor (which has no NumPy dtype) as its bytes viewed as ml_dtypes' fp8."""
    if _torch_bridge.is_tensor(x) and str(x.dtype).removeprefix("torch.") in _FP8_TORCH:
        import ml_dtypes

        torch = _torch_bridge.torch_module()
        a = _torch_bridge.to_numpy(x.view(torch.uint8), name, writable=writable)
        return a.view(getattr(ml_dtypes, str(x.dtype).removeprefix("torch.")))
    return _array(x, name, writable=writable)


def _descale(x: Any, name: str, cdt: np.dtype[Any], cache_name: str, B: int, Hk: int) -> np.ndarray | None:
    """flash-attn 3's ``k_descale``/``v_descale`` of an 8-bit cache: ``(batch, nheads_k)`` (or
    anything broadcasting to it), finite and positive, as a float32 ``(B, Hk)`` array; None
    for an fp8 cache without one (scale 1).  TypeError for an int8 cache without one or a
    float cache with one."""
    if x is None:
        if cdt == I8:
            raise TypeError(
                f"{name} is required for an int8 {cache_name}: ({B}, {Hk}) float32 scales, "
                f"dequantised {cache_name} = {cache_name} * {name}"
            )
        return None
    if not is_kv8(cdt):
        raise TypeError(f"{name} applies to 8-bit caches (int8, float8_e4m3fn, float8_e5m2), got {cdt}")
    a = _array(x, name)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must be a real array or number, got dtype {a.dtype}")
    try:
        if a.ndim > 2:
            raise ValueError
        d = np.broadcast_to(np.asarray(a, dtype=F32), (B, Hk))
    except ValueError:
        raise ValueError(f"{name} must have shape (batch, nheads_k) = ({B}, {Hk}), got {a.shape}") from None
    if d.size and not (np.all(np.isfinite(d)) and np.min(d) >= F32_TINY):
        raise ValueError(f"{name} must be finite and positive (at least {F32_TINY:g}, a float32 normal)")
    return np.ascontiguousarray(d)


def _paged(
    qa: Any,
    kc: Any,
    vc: Any,
    k: Any,
    v: Any,
    rotary_cos: Any,
    rotary_sin: Any,
    cache_seqlens: Any,
    cache_batch_idx: Any,
    cache_leftpad: Any,
    block_table: Any,
    softmax_scale: Any,
    is_causal: bool,
    window: Any,
    cap: Any,
    rotary_interleaved: Any,
    alibi_slopes: Any,
    ret: bool,
    kd: Any,
    vd: Any,
    torch_out: bool,
) -> Any:
    """flash_attn_with_kvcache over page pools (``block_table``): fastattn's paged
    attention_with_kvcache in the bshd layout, with the descales per sequence and head."""
    if cache_batch_idx is not None:
        raise ValueError("cache_batch_idx cannot be combined with block_table (the table picks the pages)")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad together with block_table is not supported")
    bt = _ints(block_table, "block_table")
    if cache_seqlens is None:  # flash-attn: the whole table's capacity
        if k is not None:
            raise ValueError("cache_seqlens must be given with k and v (where to write them)")
        cache_seqlens = int(np.shape(bt)[-1]) * int(kc.shape[1]) if np.ndim(bt) == 2 else 0
    res = paged_attention(
        qa,
        kc,
        vc,
        _ints(cache_seqlens, "cache_seqlens"),
        None if k is None else _array(k, "k"),
        None if v is None else _array(v, "v"),
        bt,
        is_causal=is_causal,
        window=window,
        alibi_slopes=_alibi(alibi_slopes),
        softcap=cap,
        scale=softmax_scale,
        return_lse=ret,
        num_threads=None,
        layout="bshd",
        rotary=(rotary_cos, rotary_sin, rotary_interleaved),
        precision=None,
        k_scale=None if kd is None else kd[:, None, :, None],  # (B, 1, Hk, 1): bshd, per sequence and head
        v_scale=None if vd is None else vd[:, None, :, None],
        short_rows=True,  # flash-attn: causal rows that see no key output zeros
    )
    return _wrap(torch_out, *res) if ret else _wrap(torch_out, res)


def _ints(x: Any, name: str) -> Any:
    """An integer argument as the shared checker takes it: a CPU tensor as its array, anything
    else as given (a list of Python ints beyond int64 must reach the checker unconverted)."""
    return _array(x, name) if _torch_bridge.is_tensor(x) else x


def flash_attn_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    cache_seqlens: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    block_table: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: Any = True,
    alibi_slopes: Any = None,
    num_splits: Any = 0,
    return_softmax_lse: Any = False,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
) -> Any:
    """flash-attn's ``flash_attn_with_kvcache``: append new keys/values in place, then attend.

    q ``(batch, seqlen_q, nheads, headdim)``; k_cache ``(batch_cache, seqlen_cache,
    nheads_k, headdim)`` and v_cache ``(..., headdim_v)``, NumPy arrays or CPU
    tensors, written in place.  With ``k``/``v`` ``(batch, seqlen_new, nheads_k,
    headdim[_v])`` (given together) their tokens are written into cache row
    ``cache_batch_idx[b]`` (default ``b``) at positions ``cache_seqlens[b] ..
    cache_seqlens[b] + seqlen_new - 1`` (converted to the cache dtype; a value
    that would overflow it raises), then each query row attends over that row's
    keys ``cache_leftpad[b] <= j < cache_seqlens[b] + seqlen_new``.
    ``cache_seqlens`` (an int or ``(batch,)``) is not modified: the caller
    advances it, as with flash-attn; ``None`` means the whole cache is valid
    (then ``k``/``v`` cannot be given).  ``causal`` and ``window_size`` are
    aligned to the bottom right of the valid keys; ``alibi_slopes``, ``softcap``
    and ``softmax_scale`` as in :func:`flash_attn_func`.  Returns out ``(batch,
    seqlen_q, nheads, headdim_v)`` in q's dtype, and with ``return_softmax_lse``
    also the float32 ``softmax_lse (batch, nheads, seqlen_q)``.

    Rotary embeddings as flash-attn: ``rotary_cos``/``rotary_sin`` ``(seqlen_ro,
    rotary_dim / 2)`` (:func:`fastattn.rotary_cos_sin`), only with ``k``/``v``;
    the new keys are rotated at positions ``cache_seqlens[b] + t`` in the C pass
    that writes them into the cache; q at ``cache_seqlens[b] + i`` when causal or
    local (``window_size != (-1, -1)``), else every query at ``cache_seqlens[b]``.
    ``rotary_interleaved=True`` (flash-attn's default) pairs dimensions (0, 1),
    (2, 3), ...; False pairs i with i + rotary_dim/2 (GPT-NeoX).  Any even
    rotary_dim up to headdim is accepted (flash-attn's GPU kernel needs a
    multiple of 16).

    8-bit caches (int8, ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` arrays, or
    ``torch.int8`` / ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensors)
    with flash-attn 3's per-head descales ``k_descale``/``v_descale`` ``(batch,
    nheads_k)`` float32 (dequantised ``k_cache[b, :, h] * k_descale[b, h]``;
    required for int8, 1 by default for fp8): the cache is read in place with
    them, and new ``k``/``v`` (float) are quantised with them before anything
    is written (``round(k / k_descale)`` for int8, the fp8 cast otherwise); a
    value that does not fit (``|k / k_descale|`` beyond 127, 448 or 57344)
    raises ValueError with nothing written.  q stays float (float32, float16
    or bfloat16): ``q_descale`` must be None (NotImplementedError otherwise).

    Every check runs before anything is written; the attention reads exactly what
    the caches hold after the write, strided or misaligned caches included (K kept
    transposed).  Rotary positions are cache slots, as in flash-attn (with
    ``cache_leftpad`` too: new key ``t`` at ``cache_seqlens + t``, query ``i`` at
    ``cache_seqlens + i`` when causal or local, else ``cache_seqlens``);
    ``num_splits`` only tunes flash-attn's GPU kernel and changes nothing here.

    Parameters
    ----------
    q : array_like or torch.Tensor
        ``(batch, seqlen_q, nheads, headdim)``.
    k_cache, v_cache : ndarray or torch.Tensor
        ``(batch_cache, seqlen_cache, nheads_k, headdim[_v])``, written in place.
    k, v : array_like or torch.Tensor, optional
        ``(batch, seqlen_new, nheads_k, headdim[_v])`` new tokens, given together.
    rotary_cos, rotary_sin : array_like, optional
        ``(seqlen_ro, rotary_dim / 2)`` rotary tables; only with ``k``/``v``.
    cache_seqlens : int or array_like of int, optional
        Valid tokens per cache row before the append; None: the whole cache.
    cache_batch_idx : array_like of int, optional
        ``(batch,)`` cache row of each batch entry; default ``b``.
    cache_leftpad : array_like of int, optional
        ``(batch,)`` first valid key of each row.
    block_table : array_like of int or torch.Tensor, optional
        ``(batch, max_blocks_per_seq)`` int32: paged caches.  ``k_cache``/``v_cache``
        are then page pools ``(num_blocks, page_block_size, nheads_k, headdim[_v])``
        of any page size >= 1; token j of sequence b lies in page
        ``block_table[b, j // page_block_size]``.  New tokens are written across
        page boundaries; pages no entry in use points to are never touched.  Not
        with ``cache_batch_idx`` or ``cache_leftpad``.
    softmax_scale : float, optional
        Score scale; None means ``1/sqrt(headdim)``.
    causal : bool, default False
        Causal mask aligned to the bottom right of the valid keys.
    window_size : (int, int), default (-1, -1)
        ``(left, right)`` local window; -1 is unbounded on that side.
    softcap : float, default 0.0
        ``> 0`` caps the scores at ``softcap * tanh(s / softcap)``; 0 is off.
    rotary_interleaved : bool, default True
        GPT-J pairs (0, 1), (2, 3), ...; False: GPT-NeoX rotate-half.
    alibi_slopes : array_like, optional
        ``(nheads,)`` or ``(batch, nheads)`` ALiBi slopes.
    num_splits : int, default 0
        Accepted and ignored.
    return_softmax_lse : bool, default False
        Also return the log-sum-exp.
    q_descale : None
        Flash-attn 3's fp8 query descale: only None (NotImplementedError).
    k_descale, v_descale : array_like or torch.Tensor, optional
        ``(batch, nheads_k)`` float32 scales of 8-bit caches, as above
        (TypeError with float caches).

    Returns
    -------
    out : ndarray or torch.Tensor
        ``(batch, seqlen_q, nheads, headdim_v)`` in q's dtype.
    softmax_lse : ndarray or torch.Tensor
        ``(batch, nheads, seqlen_q)`` float32; only with ``return_softmax_lse=True``.

    Examples
    --------
    One decoding step: the new token's key and value are written at position 3.

    >>> from fastattn.flash_compat import flash_attn_func, flash_attn_with_kvcache
    >>> rng = np.random.default_rng(0)
    >>> k_cache, v_cache = np.zeros((2, 1, 8, 2, 4), np.float32)
    >>> k_cache[:, :3], v_cache[:, :3] = rng.standard_normal((2, 1, 3, 2, 4))
    >>> q, k, v = rng.standard_normal((3, 1, 1, 2, 4)).astype(np.float32)
    >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)
    >>> bool(np.array_equal(k_cache[:, 3], k[:, 0]))
    True
    >>> ref = flash_attn_func(q, k_cache[:, :4], v_cache[:, :4])
    >>> bool(np.allclose(out, ref))
    True

    The same step with int8 caches and per-head descales:

    >>> k8 = np.rint(k_cache / 0.05).astype(np.int8)
    >>> v8 = np.rint(v_cache / 0.05).astype(np.int8)
    >>> d = np.full((1, 2), 0.05, np.float32)  # (batch, nheads_k)
    >>> out8 = flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=3, k_descale=d, v_descale=d)
    >>> bool(np.array_equal(k8[:, 3], np.rint(k[:, 0] / 0.05)))
    True
    >>> bool(np.abs(out8 - ref).max() < 0.05)
    True
    """
    # Rotary tables given as torch tensors (bf16 ones too, which torch cannot hand to NumPy).
    if _torch_bridge.is_tensor(rotary_cos):
        rotary_cos = _array(rotary_cos, "rotary_cos")
    if _torch_bridge.is_tensor(rotary_sin):
        rotary_sin = _array(rotary_sin, "rotary_sin")
    # flash-attn features fastattn does not have: refused, never ignored.
    _flag(rotary_interleaved, "rotary_interleaved")
    index_value(num_splits, "num_splits", 0)
    ret = _flag(return_softmax_lse, "return_softmax_lse")
    is_causal = _flag(causal, "causal")
    window = _window_size(window_size)
    cap = _softcap(softcap)
    torch_out = _torch_bridge.is_tensor(q)

    qa = _array(q, "q")
    appending = k is not None or v is not None
    if appending and (k is None or v is None):
        raise ValueError("k and v must be given together")
    if q_descale is not None:
        raise NotImplementedError(
            "q_descale (flash-attn 3's fp8 queries) is not supported: fastattn's queries are float; "
            "pass q dequantised (q * q_descale) and q_descale=None"
        )
    kc = _cache_array(k_cache, "k_cache", appending)
    vc = _cache_array(v_cache, "v_cache", appending)
    _ndim(qa, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    _ndim(kc, "k_cache", 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _ndim(vc, "v_cache", 4, "(batch_cache, seqlen_cache, nheads_k, headdim_v)")
    cdt = kc.dtype
    if not cache_dtype_ok(cdt):
        raise TypeError(f"k_cache must have dtype {CACHE_DTYPES8}, got {cdt}")
    if vc.dtype != cdt:
        raise TypeError(f"v_cache must have the dtype of k_cache ({cdt}), got {vc.dtype}")
    if not _query_dtype_ok(qa.dtype, cdt):
        raise TypeError(f"q must have dtype {query_dtypes(cdt)} for {cdt} caches, got {qa.dtype}")
    B, Lq, Hq, D = qa.shape
    Bc, S, Hk, Dk = kc.shape
    if vc.shape[:3] != (Bc, S, Hk):
        raise ValueError(f"v_cache {vc.shape} must match k_cache {kc.shape} except in the last dim")
    Dv = vc.shape[3]
    if Dk != D:
        raise ValueError(f"k_cache head dim ({Dk}) must equal q's ({D})")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the cache's heads ({Hk})")
    # 8-bit caches: flash-attn 3's per-head descales (batch, nheads_k), None or float32.
    kd = _descale(k_descale, "k_descale", cdt, "k_cache", B, Hk)
    vd = _descale(v_descale, "v_descale", cdt, "v_cache", B, Hk)
    if block_table is not None:
        return _paged(
            qa,
            kc,
            vc,
            k,
            v,
            rotary_cos,
            rotary_sin,
            cache_seqlens,
            cache_batch_idx,
            cache_leftpad,
            block_table,
            softmax_scale,
            is_causal,
            window,
            cap,
            rotary_interleaved,
            alibi_slopes,
            ret,
            kd,
            vd,
            torch_out,
        )

    if cache_batch_idx is None:
        if Bc < B:
            raise ValueError(f"k_cache holds {Bc} sequences but q has {B}; pass cache_batch_idx")
        idx = None
    else:
        ia = _ints(cache_batch_idx, "cache_batch_idx")
        idx = indices_value(ia, "cache_batch_idx", 0, Bc - 1, "an integer array", half_open=True, shape=(B,))
        if appending and np.unique(idx).size != idx.size:
            raise ValueError("cache_batch_idx must not repeat an index when k and v are appended")
    rows = np.arange(B, dtype=np.int64) if idx is None else idx

    if cache_seqlens is None:
        if appending:
            raise ValueError("cache_seqlens must be given with k and v (where to write them)")
        seq = np.full(B, S, dtype=np.int64)
    else:
        seq = seqlens_value(_ints(cache_seqlens, "cache_seqlens"), "cache_seqlens", B, S, " (the batch of q)")
    left = None
    if cache_leftpad is not None:
        left = seqlens_value(
            _ints(cache_leftpad, "cache_leftpad"), "cache_leftpad", B, S, " (the batch of q)"
        )
        if np.any(left > seq):
            raise ValueError("cache_leftpad values must lie in [0, cache_seqlens]")

    T = 0
    if appending:
        ka, va = _array(k, "k"), _array(v, "v")
        for a, n, d in ((ka, "k", D), (va, "v", Dv)):
            if not _is_real_float(a.dtype):
                raise TypeError(f"{n} must be a real floating array, got dtype {a.dtype}")
            if a.ndim != 4 or a.shape[0] != B or a.shape[2] != Hk or a.shape[3] != d:
                raise ValueError(f"{n} must have shape ({B}, seqlen_new, {Hk}, {d}), got {a.shape}")
        T = ka.shape[1]
        if va.shape[1] != T:
            raise ValueError(f"k and v must hold the same number of tokens, got {T} and {va.shape[1]}")
        if seq.size and seq.max() + T > S:
            b = int(np.argmax(seq))
            raise ValueError(
                f"cache_seqlens[{b}] + {T} new tokens = {int(seq[b]) + T} exceeds the cache length {S}"
            )
        if np.may_share_memory(kc, vc):
            raise ValueError("k_cache and v_cache must not share memory")
    rot = None
    kpos = qpos = None
    if rotary_cos is not None or rotary_sin is not None:
        rot = _CacheRotary(rotary_cos, rotary_sin, rotary_interleaved, D, cdt)
        if not appending:
            raise ValueError("rotary_cos/rotary_sin need k and v (flash-attn rotates the new keys and q)")
        kpos = rot.positions(seq, T)
        local = window is not None and tuple(window) != (-1, -1)
        qpos = rot.positions(seq, Lq) if (is_causal or local) else np.broadcast_to(seq[:, None], (B, Lq))
        rot.check(kpos, "the new keys' positions (cache_seqlens + t)")
        rot.check(qpos, "the queries' positions")
        qr = rot.rotate_q(qa.swapaxes(1, 2), qpos)  # bhsd; before any write: it checks overflow
    if appending and is_kv8(cdt):
        # Rotated in float32, then quantised with the descales (fp8 without one: 1), before
        # any write: a value that does not fit raises.
        kb = ka.swapaxes(1, 2)
        kf = kb if rot is None else to_cache_dtype(kb, F32, "k", rot, kpos, bshd=True)
        kw, _ = kv8_tokens(kf, cdt, _ONE if kd is None else kd[:, :, None, None], "k")
        vw, _ = kv8_tokens(va.swapaxes(1, 2), cdt, _ONE if vd is None else vd[:, :, None, None], "v")
        rot_direct = False
    elif appending:
        # The new tokens as bhsd views, converted (and checked: a value, rotated or not, that
        # would overflow the cache dtype raises) before any write: the checks of
        # attention_with_kvcache and KVCache.append.
        kw, rot_direct = keys_to_write(ka.swapaxes(1, 2), cdt, "k", rot, kpos, bshd=True)
        vw = to_cache_dtype(va.swapaxes(1, 2), cdt, "v", bshd=True)
    total = seq + T
    mask = None
    if left is not None and np.any(left):
        mask = (np.arange(S)[None, :] >= left[:, None])[:, None, None, :]  # (B, 1, 1, S): True = attend
    opts: dict[str, Any] = dict(
        is_causal=is_causal,
        scale=softmax_scale,
        enable_gqa=True,
        layout="bshd",
        window=window,
        softcap=cap,
        return_lse=ret,
    )
    al = _alibi(alibi_slopes)
    # Every check of the attention, once, before anything is written: the calls read
    # the caches in place (views), so they see the tokens written below (a cache the
    # kernel cannot read in place is copied here, and the copy updated by reread_written).
    kview = kc[:B] if idx is None else _rows(kc, idx)
    vview = vc[:B] if idx is None else _rows(vc, idx)
    if kview is not None and vview is not None:
        calls = [
            sdpa_call(
                qa,
                kview,
                vview,
                attn_mask=mask,
                key_lengths=total,
                alibi_slopes=al,
                k_scale=None if kd is None else kd[:, None, :, None],  # (B, 1, Hk, 1): bshd per head
                v_scale=None if vd is None else vd[:, None, :, None],
                **opts,
            )
        ]
    else:  # scattered cache rows: one call per sequence, each on a view of its row
        if al is not None and al.ndim == 2 and al.shape[0] != B:
            raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({B}, {Hq}), got {al.shape}")
        calls = [
            sdpa_call(
                qa[b : b + 1],
                kc[c : c + 1],
                vc[c : c + 1],
                attn_mask=None if mask is None else mask[b : b + 1],
                key_lengths=total[b : b + 1],
                alibi_slopes=None if al is None else (al if al.ndim == 1 else al[b : b + 1]),
                k_scale=None if kd is None else kd[b : b + 1, None, :, None],
                v_scale=None if vd is None else vd[b : b + 1, None, :, None],
                **opts,
            )
            for b, c in enumerate(rows.tolist())
        ]

    # ---- write (nothing has been modified before this point)
    if T and B:
        kch, vch = kc.swapaxes(1, 2), vc.swapaxes(1, 2)  # the caches' bhsd views
        write_tokens(kch, vch, idx, seq, kw, vw, rot if rot_direct else None, kpos)
        # A cache the kernel cannot read in place (a last axis that is not contiguous, a
        # misaligned buffer) was copied by the checks above, before the write: the copies
        # take the new tokens too, read back from the cache.
        if kview is not None and vview is not None:
            reread_written(calls[0], kview.swapaxes(1, 2), vview.swapaxes(1, 2), seq, T)
        else:
            for b, c in enumerate(rows.tolist()):
                reread_written(calls[b], kch[c : c + 1], vch[c : c + 1], seq[b : b + 1], T)
    if rot is not None:  # the rotated queries (bhsd, as the plans hold them)
        calls = [c.with_queries(qr if len(calls) == 1 else qr[b : b + 1]) for b, c in enumerate(calls)]

    # ---- attend
    if len(calls) == 1 and kview is not None:
        res = calls[0].run()
    else:
        out = np.empty((B, Lq, Hq, Dv), dtype=qa.dtype)
        lse = np.empty((B, Hq, Lq), dtype=np.float64 if qa.dtype.name == "float64" else np.float32)
        for b, call in enumerate(calls):
            if ret:
                out[b : b + 1], lse[b : b + 1] = call.run()
            else:
                out[b : b + 1] = call.run()
        res = (out, lse) if ret else out
    if ret:
        return _wrap(torch_out, *res)
    return _wrap(torch_out, res)
