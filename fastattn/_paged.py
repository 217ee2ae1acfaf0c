"""Paged K/V caches (flash-attn's ``block_table``): checks, writes and the kernel plan.

A paged cache is a pool of fixed-size pages, ``(num_pages, Hk, page_size, X)``
bhsd (``(num_pages, page_size, Hk, X)`` bshd, flash-attn's), and a block table
``(B, max_pages)`` of page indices: token j of sequence b lies in page
``block_table[b, j // page_size]`` at slot ``j % page_size``.  The kernel reads
the pages in place (csrc/fastattn.h, ``block_table``); nothing is gathered.

Every check of the attention runs through :func:`fastattn._args.sdpa_call` on
contiguous stand-ins of the gathered K/V (zero-stride views of the first token, of
the gathered shape ``(B, Hk, max_pages * page_size, X)``), so that the paged
call takes exactly the options, dtypes and errors of the dense one; the plan's
K/V (and per-token scales) are then the pools themselves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import positions
from ._args import bhsd, check_heads, layout_value, sdpa_call, varlen_call
from ._cache_args import (
    CACHE_DTYPES8,
    cache_dtype_ok,
    kv8_tokens,
    new_tokens,
    query_dtype_ok,
    query_dtypes,
    seqlens_value,
    to_cache_dtype,
)
from ._checks import F32, SMALL_INTS, as_array, broadcast_view, flag_value, int_bounds, kernel_ready
from ._plan import Call, replace
from ._quant import F32_TINY, is_kv8, positive_normal, scale_value

Array = npt.NDArray[Any]

__all__ = ["block_table_value", "paged_attention", "paged_varlen_call", "page_slots"]

_I32_MAX = 2**31 - 1

# The per-token paged scales' stand-in's values (read-only: its views are shared)
_ONES = np.ones((1, 1, 1, 1), F32)
_ONES.flags.writeable = False


def block_table_value(x: Any, name: str, B: int, num_pages: int, page: int, lengths: Array) -> Array:
    """The block table: an integer ``(B, max_pages)`` array whose entries that hold a
    token (page ``j // page`` for ``j < lengths[b]``) lie in ``[0, num_pages)``; the
    others are never read.  Returns it as a C-contiguous int32 array (the kernel's)."""
    a = as_array(x, name)
    if a.dtype.kind not in "iu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must be an integer array (int32, as flash-attn's), got dtype {a.dtype}")
    if a.ndim != 2 or a.shape[0] != B:
        raise ValueError(f"{name} must have shape ({B}, max_pages) (one row per sequence), got {a.shape}")
    need = (lengths + page - 1) // page  # pages that hold tokens, per sequence
    if need.size and int_bounds(need)[1] > a.shape[1]:
        b = int(np.argmax(need))
        raise ValueError(
            f"{name} has {a.shape[1]} pages per sequence but sequence {b} needs {int(need[b])} "
            f"({int(lengths[b])} tokens in pages of {page})"
        )
    if a.size:
        lo, hi = int_bounds(a)
        if lo >= 0 and hi < num_pages:  # every entry a page (the usual table)
            return np.ascontiguousarray(a, dtype=np.int32)
    used = np.arange(a.shape[1])[None, :] < need[:, None]
    vals = a[used]
    if vals.size and (int(vals.min()) < 0 or int(vals.max()) >= num_pages):
        bad = np.argwhere(used & ((a < 0) | (a >= num_pages)))[0]
        raise ValueError(
            f"{name}[{int(bad[0])}, {int(bad[1])}] = {int(a[bad[0], bad[1]])} is not a page of the "
            f"cache (0 <= page < {num_pages})"
        )
    out = np.where(used, a, 0) if a.shape[1] else a  # unused entries are never read: zeros
    return np.ascontiguousarray(out, dtype=np.int32)


def page_slots(bt: Array, starts: Array, T: int, page: int) -> tuple[Array, Array]:
    """The (page, slot) of token t of sequence b at position ``starts[b] + t``: two
    ``(B, T)`` int64 arrays."""
    pos = starts[:, None] + np.arange(T, dtype=np.int64)[None, :]
    pg = np.take_along_axis(bt.astype(np.int64), pos // page, axis=1)
    return pg, pos % page


def _pool(x: Any, name: str, lay: str, writing: bool) -> Array:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray (the page pool), got {type(x).__name__}")
    if x.ndim != 4:
        want = "(num_pages, Hk, page_size, X)" if lay == "bhsd" else "(num_pages, page_size, Hk, X)"
        raise ValueError(f"{name} must be a 4-D page pool {want} with block_table, got shape {x.shape}")
    if writing and not x.flags.writeable:
        raise ValueError(f"{name} must be writable to append the new tokens")
    return x


def _paged_scale(
    scale: Any, name: str, pool: Array, lay: str, B: int, pool_name: str
) -> tuple[Array | None, Array | None, Any]:
    """An 8-bit pool's scale: ``(paged, fixed, for_sdpa)``.

    A 4-D scale with the pool's page count on its first axis and the page size on its
    sequence axis (page size > 1, or any 4-D ``(num_pages, Hk, 1, 1)`` with pages of one
    token) is per token and paged with the tokens: ``paged`` is its checked float32 bhsd
    view ``(num_pages, Hk, page_size, 1)``.  Any other scale (a number, per head, per
    channel, per sequence ``(B, Hk, 1, X)``) is the sequences' and goes to sdpa_call as
    given (``for_sdpa``); ``fixed`` is its float32 bhsd ``(B, Hk, 1, X)`` broadcast view
    (the scale new tokens are quantised with; fp8 without a scale: 1)."""
    if scale is None and not is_kv8(pool.dtype):
        return None, None, None
    seq_axis = -2 if lay == "bhsd" else -3
    # (an ndarray's own shape: np.shape is a Python-level call)
    shape: tuple[int, ...] = (
        () if scale is None else scale.shape if type(scale) is np.ndarray else np.shape(scale)
    )
    NP, P = pool.shape[0], pool.shape[seq_axis]
    if len(shape) == 4 and shape[0] == NP and shape[seq_axis] == P and (P > 1 or shape[-1] == 1):
        # its values are checked where the call reads them (_check_token_scales)
        checked = scale_value(scale, name, pool, seq_axis, pool_name, values=False)
        assert checked is not None  # (broadcast to the pool's shape: one column is the scales)
        return bhsd(checked, lay)[..., :1], None, None
    # The sequences' scale: checked against the gathered shape (B, Hk, S, X) by sdpa_call;
    # here only as the fixed scale new tokens are quantised with.
    X = pool.shape[-1]
    Hk = pool.shape[1] if lay == "bhsd" else pool.shape[2]
    gathered = (B, Hk, 1, X) if lay == "bhsd" else (B, 1, Hk, X)
    proxy = broadcast_view(np.zeros((), dtype=pool.dtype), gathered)
    checked = scale_value(scale, name, proxy, seq_axis, pool_name)
    fixed = None if checked is None else broadcast_view(bhsd(checked, lay), (B, Hk, 1, X))
    return None, fixed, scale


def _check_token_scales(paged: Array | None, bt: Array, lens: Array, name: str) -> None:
    """A per-token paged scale (bhsd ``(num_pages, Hk, page, 1)``) holds float32 normals
    where the call reads it: the slots below each sequence's length ``lens``, through the
    table ``bt``.  Slots past a sequence's end and pages in no row are never read and may
    hold anything (a pool's unused pages: zeros, garbage), so they are not checked.  Reads
    the sequences' scales once (a gather of the full pages, then the last pages' used
    slots): work in proportion to the tokens, not the pool.  Where the pool is not much
    larger than the tokens read, the whole pool is checked first (two reductions, no
    gather); only when that fails are the slots read told from the others."""
    if paged is None or not lens.size:
        return
    P = paged.shape[2]
    # (the tokens read; a few sequences' summed as Python ints, as int_bounds reads them)
    tokens = sum(lens.tolist()) if lens.size <= SMALL_INTS else int(lens.sum())
    if paged.size <= 2 * paged.shape[1] * tokens and positive_normal(paged):
        return
    full = lens // P  # pages each sequence fills
    pages = bt[np.arange(bt.shape[1])[None, :] < full[:, None]]
    ok = not pages.size or positive_normal(paged[pages])
    tail = np.nonzero(lens % P)[0]  # sequences whose last page is partly filled
    if ok and tail.size:
        last = paged[bt[tail, full[tail]]]  # (n, Hk, P, 1)
        used = np.arange(P)[None, None, :, None] < (lens[tail] % P)[:, None, None, None]
        ok = positive_normal(last[np.broadcast_to(used, last.shape)])
    if not ok:
        raise ValueError(
            f"{name} must be finite and positive (at least {F32_TINY:g}, a float32 normal) in every "
            "slot the call reads (the sequences' tokens through block_table)"
        )


def _scale_target(scale: Any, name: str, lay: str, pools: tuple[Array, Array]) -> Array:
    """The bhsd view of a per-token paged scale that new tokens' scales are written to:
    the caller's writable float32 / float64 ndarray, apart from the pools."""
    if not isinstance(scale, np.ndarray) or scale.dtype not in (F32, np.dtype(np.float64)):
        raise TypeError(
            f"{name} holds per-token scales, which the new tokens' are written to: it must be a "
            f"float32 or float64 numpy.ndarray, got {type(scale).__name__}"
        )
    if not scale.flags.writeable:
        raise ValueError(f"{name} must be writable: the new tokens' per-token scales are written to it")
    if any(np.may_share_memory(scale, p) for p in pools):
        raise ValueError(f"{name} must not share memory with the caches")
    return bhsd(scale, lay)


def _standin(pool: Array, lay: str, B: int, S: int) -> Array:
    """The gathered K/V's shape in layout ``lay``, as a zero-stride view of the pool's
    first token of its first head: sdpa_call reads a stand-in's shape, dtype and
    alignment, never its values or other strides (the plan's K/V are then the pools).
    One token (a contiguous row wherever the head dim is) makes the view in ~1 µs
    (broadcast_view), where a row of every head of a bhsd pool is strided (~3.5 µs)."""
    Hk = pool.shape[1] if lay == "bhsd" else pool.shape[2]
    shape = (B, Hk, S, pool.shape[3]) if lay == "bhsd" else (B, S, Hk, pool.shape[3])
    return broadcast_view(pool[:1, :1, :1], shape)


def _token_view(t: Array) -> Array:
    """A per-token paged scale (bhsd ``(num_pages, Hk, P, 1)``) as the kernel reads it:
    float32, with a nonzero stride along the page's tokens (the kernel tells per-token
    scales by that stride; a page of one token may have any stride there)."""
    a = kernel_ready(t if t.dtype == F32 else t.astype(F32))
    if a.shape[2] == 1 and a.strides[2] == 0:
        a = np.lib.stride_tricks.as_strided(a, a.shape, a.strides[:2] + (a.itemsize,) + a.strides[3:])
    return a


def _on_pages(
    call: Call,
    kp: Array,
    vp: Array,
    bt: Array,
    kpaged: Array | None,
    vpaged: Array | None,
    q: Array | None = None,
) -> Call:
    """``call`` (checked on stand-ins) reading the bhsd pools ``kp``/``vp`` through the
    block table ``bt``, with the per-token paged scales (None: the call's own) and the
    queries ``q`` (None: the call's own).  Pools the kernel cannot read in place are
    copied here, after any write."""
    if call.plan is None:
        return call
    changes: dict[str, Any] = {
        "k": kernel_ready(kp),
        "v": kernel_ready(vp),
        "block_table": bt,
        "page_size": kp.shape[2],
    }
    if kpaged is not None:
        changes["k_scale"] = _token_view(kpaged)
    if vpaged is not None:
        changes["v_scale"] = _token_view(vpaged)
    if q is not None:
        changes["q"] = q
    return call.with_plan(replace(call.plan, changes))


def paged_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    k_new: Any,
    v_new: Any,
    block_table: Any,
    *,
    is_causal: Any,
    window: Any,
    alibi_slopes: Any,
    softcap: Any,
    scale: Any,
    return_lse: Any,
    num_threads: Any,
    layout: Any,
    rotary: Any,
    precision: Any,
    k_scale: Any,
    v_scale: Any,
    short_rows: bool = False,
) -> Any:
    """:func:`fastattn.attention_with_kvcache` with ``block_table`` (its docstring
    documents the layouts).  ``rotary``: its ``(rotary_cos, rotary_sin,
    rotary_interleaved)``.  ``short_rows``: flash-attn's rule for a causal call with
    more queries than a sequence's keys (the first rows, which see no key, output
    zeros) instead of fastattn's ValueError."""
    lay = layout_value(layout)
    causal = flag_value(is_causal, "is_causal")
    qa = as_array(q, "q")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    writing = k_new is not None
    kpool, vpool = _pool(k_cache, "k_cache", lay, writing), _pool(v_cache, "v_cache", lay, writing)
    cdt = kpool.dtype
    if not cache_dtype_ok(cdt):
        raise TypeError(f"k_cache must have dtype {CACHE_DTYPES8}, got {cdt}")
    if vpool.dtype != cdt:
        raise TypeError(f"v_cache must have the dtype of k_cache ({cdt}), got {vpool.dtype}")
    if not query_dtype_ok(qa.dtype, cdt):
        raise TypeError(f"q must have dtype {query_dtypes(cdt)} for {cdt} caches, got {qa.dtype}")
    if qa.ndim != 4:
        raise ValueError(f"q must be 4-D ({lay}), got shape {qa.shape}")
    qh, kp, vp = bhsd(qa, lay), bhsd(kpool, lay), bhsd(vpool, lay)
    B, Hq, Lq, D = qh.shape
    NP, Hk, P, Dk = kp.shape
    if vp.shape[:3] != (NP, Hk, P):
        raise ValueError(
            "v_cache must have the pages, heads and page size of k_cache, "
            f"got {vpool.shape} and {kpool.shape}"
        )
    if Dk != D:
        raise ValueError(f"k_cache head dim ({Dk}) must equal q's ({D})")
    if NP > _I32_MAX:
        raise ValueError(f"k_cache holds {NP} pages; block_table's int32 entries address at most {_I32_MAX}")
    if P < 1 or NP < 1:
        raise ValueError(
            f"k_cache must hold at least one page of at least one token, got shape {kpool.shape}"
        )
    check_heads(Hq, Hk, True, "q", "the cache's kv")
    Dv = vp.shape[3]
    seq = seqlens_value(cache_seqlens, "cache_seqlens", B)
    kn = vn = None
    T = 0
    if writing:
        kn, vn = bhsd(new_tokens(k_new, "k_new", lay), lay), bhsd(new_tokens(v_new, "v_new", lay), lay)
        if kn.shape[:2] != (B, Hk) or kn.shape[3] != D:
            raise ValueError(
                f"k_new must have {B} sequences, {Hk} heads and head dim {D}, got shape {np.shape(k_new)}"
            )
        if vn.shape[:2] != (B, Hk) or vn.shape[3] != Dv:
            raise ValueError(
                f"v_new must have {B} sequences, {Hk} heads and head dim {Dv}, got shape {np.shape(v_new)}"
            )
        T = kn.shape[2]
        if vn.shape[2] != T:
            raise ValueError(
                f"k_new and v_new must hold the same number of tokens, got {T} and {vn.shape[2]}"
            )
        if np.may_share_memory(kpool, vpool):
            raise ValueError("k_cache and v_cache must not share memory")
    total = seq + T
    bt = block_table_value(block_table, "block_table", B, NP, P, total)
    S = bt.shape[1] * P
    if causal and not short_rows and total.size and int_bounds(total)[0] < Lq:
        b = int(np.argmin(total))
        raise ValueError(
            f"q holds {Lq} query tokens but sequence {b} has only {int(total[b])} keys; "
            "causal decoding needs cache_seqlens + new tokens >= query length "
            "(or pass is_causal=False)"
        )
    kpaged, kfix, ks_seq = _paged_scale(k_scale, "k_scale", kpool, lay, B, "k_cache")
    vpaged, vfix, vs_seq = _paged_scale(v_scale, "v_scale", vpool, lay, B, "v_cache")
    # the cached tokens' scales (the new tokens' are computed here, or checked fixed ones)
    _check_token_scales(kpaged, bt, seq, "k_scale")
    _check_token_scales(vpaged, bt, seq, "v_scale")
    # Per-token paged scales are written with the new tokens, into the caller's arrays.
    ktarget = (
        _scale_target(k_scale, "k_scale", lay, (kpool, vpool)) if writing and kpaged is not None else None
    )
    vtarget = (
        _scale_target(v_scale, "v_scale", lay, (kpool, vpool)) if writing and vpaged is not None else None
    )
    if ktarget is not None and vtarget is not None and np.may_share_memory(ktarget, vtarget):
        raise ValueError("k_scale and v_scale must not share memory")
    # Every check of the attention, on stand-ins of the gathered K/V (and of paged scales).
    # (a per-token paged scale's stand-in is ones: its values were checked where read above)
    ones = None
    if kpaged is not None or vpaged is not None:  # (one view serves both)
        ones = broadcast_view(_ONES, (B, Hk, S, 1) if lay == "bhsd" else (B, S, Hk, 1))
    ks_arg = ks_seq if kpaged is None else ones
    vs_arg = vs_seq if vpaged is None else ones
    call = sdpa_call(
        qa,
        _standin(kpool, lay, B, S),
        _standin(vpool, lay, B, S),
        is_causal=causal,
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
        k_scale=ks_arg,
        v_scale=vs_arg,
    )
    qr = None
    kpos = None
    rot_cos, rot_sin, rot_inter = rotary
    rot: Any = None
    if rot_cos is not None or rot_sin is not None:
        rot = positions.CacheRotary(rot_cos, rot_sin, rot_inter, D, cdt)
    if rot is not None:
        if not writing:
            raise ValueError("rotary_cos/rotary_sin need k_new and v_new (the keys to rotate)")
        kpos = rot.positions(seq, T)
        local = window is not None and tuple(window) != (-1, -1)
        qpos = rot.positions(seq, Lq) if (causal or local) else np.broadcast_to(seq[:, None], (B, Lq))
        rot.check(kpos, "the new keys' positions (cache_seqlens + t)")
        rot.check(qpos, "the queries' positions")
        qr = rot.rotate_q(qh, qpos, num_threads)
    # The new tokens in the cache dtype (quantised, rotated), checked before any write.
    if writing and T and B:
        assert kn is not None and vn is not None
        pg, sl = page_slots(bt, seq, T, P)
        flat = (pg * P + sl).ravel()
        if np.unique(flat).size != flat.size:
            raise ValueError(
                "block_table maps two new tokens to the same cache slot (a page shared by "
                "sequences that both append: give each its own last page)"
            )
        if is_kv8(cdt):
            kf = kn if rot is None else to_cache_dtype(kn, F32, "k_new", rot, kpos, num_threads)
            kw, ks_new = kv8_tokens(kf, cdt, kfix if kpaged is None else None, "k_new")
            vw, vs_new = kv8_tokens(vn, cdt, vfix if vpaged is None else None, "v_new")
        else:
            kw = to_cache_dtype(kn, cdt, "k_new", rot, kpos, num_threads)
            vw = to_cache_dtype(vn, cdt, "v_new")
            ks_new = vs_new = np.empty(0, F32)  # (no scales: ktarget and vtarget are None)
        # ---- write (nothing has been modified before this point)
        kp[pg, :, sl] = kw.transpose(0, 2, 1, 3)
        vp[pg, :, sl] = vw.transpose(0, 2, 1, 3)
        if ktarget is not None:
            ktarget[pg, :, sl] = ks_new.transpose(0, 2, 1, 3)
            kpaged = ktarget
        if vtarget is not None:
            vtarget[pg, :, sl] = vs_new.transpose(0, 2, 1, 3)
            vpaged = vtarget
    return _on_pages(call, kp, vp, bt, kpaged, vpaged, None if qr is None else kernel_ready(qr)).run()


def paged_varlen_call(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    block_table: Any,
    *,
    k_scale: Any = None,
    v_scale: Any = None,
    **options: Any,
) -> Call:
    """:func:`fastattn.varlen_attention` with ``block_table`` (chunked prefill): packed
    queries ``(Tq, Hq, D)``, K/V in page pools ``(num_pages, page_size, Hk, D/Dv)``,
    ``cu_seqlens_k`` the sequences' cumulative key lengths.  Every check is
    varlen_call's, on stand-ins ``(Tk, Hk, D)`` of the gathered K/V."""
    kpool, vpool = _pool(k_cache, "k", "bshd", False), _pool(v_cache, "v", "bshd", False)
    if vpool.shape[:3] != kpool.shape[:3]:
        raise ValueError(
            f"v must have the pages, page size and heads of k, got {vpool.shape} and {kpool.shape}"
        )
    ca = as_array(cu_seqlens_k, "cu_seqlens_k")
    Tk = int(ca[-1]) if ca.ndim == 1 and ca.shape[0] and ca.dtype.kind in "iu" else 0
    # cu_seqlens_k is checked (1-D, from 0, non-decreasing) by varlen_call; the table here.
    lens = np.maximum(np.diff(ca.astype(np.int64)), 0) if ca.ndim == 1 and ca.dtype.kind in "iu" else None
    NP, P = kpool.shape[0], kpool.shape[1]
    nb = 0 if lens is None else lens.shape[0]
    kpaged, _, ks_seq = _paged_scale(k_scale, "k_scale", kpool, "bshd", max(nb, 1), "k")
    vpaged, _, vs_seq = _paged_scale(v_scale, "v_scale", vpool, "bshd", max(nb, 1), "v")
    kst = np.broadcast_to(kpool[0, 0], (Tk,) + kpool.shape[2:])
    vst = np.broadcast_to(vpool[0, 0], (Tk,) + vpool.shape[2:])
    call = varlen_call(
        q,
        kst,
        vst,
        cu_seqlens_q,
        cu_seqlens_k,
        # (a per-token paged scale's stand-in is ones: its values are checked where read below)
        k_scale=ks_seq if kpaged is None else np.broadcast_to(np.float32(1.0), (Tk, kpool.shape[2], 1)),
        v_scale=vs_seq if vpaged is None else np.broadcast_to(np.float32(1.0), (Tk, vpool.shape[2], 1)),
        **options,
    )
    assert lens is not None  # (varlen_call raised otherwise)
    bt = block_table_value(block_table, "block_table", nb, NP, P, lens)
    _check_token_scales(kpaged, bt, lens, "k_scale")
    _check_token_scales(vpaged, bt, lens, "v_scale")
    return _on_pages(call, bhsd(kpool, "bshd"), bhsd(vpool, "bshd"), bt, kpaged, vpaged)
