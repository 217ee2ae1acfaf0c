"""flash-attn's Python API (``flash_attn.flash_attn_interface``, version 2) on fastattn's CPU kernel.

A model written for flash-attn runs on the CPU by changing one import::

    # from flash_attn import flash_attn_func, flash_attn_with_kvcache
    from fastattn.flash_compat import flash_attn_func, flash_attn_with_kvcache

Same argument names, defaults, layouts and semantics as flash-attn 2:

- layout ``(batch, seqlen, nheads, headdim)`` (packed: ``(total, nheads, headdim)``);
- ``causal=False`` by default; ``causal=True`` is aligned to the bottom right
  (query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``); a row that sees no
  key outputs zeros;
- ``window_size=(left, right)``, ``-1`` = unbounded on that side, at the same
  bottom-right positions;
- ``softcap=0.0`` means off, ``> 0`` caps the scores at ``softcap * tanh(s / softcap)``;
- ``alibi_slopes`` ``(nheads,)`` or ``(batch, nheads)``: adds
  ``-slope * |i + seqlen_k - seqlen_q - j|``;
- grouped-query attention when ``nheads`` is a multiple of the key/value heads;
- the log-sum-exp is ``(batch, nheads, seqlen_q)``, packed ``(nheads, total_q)``, float32.

Inputs are NumPy arrays (anything ``numpy.asarray`` takes, e.g. ml_dtypes
bfloat16 arrays) or CPU torch tensors, read in place (bfloat16 tensors too);
outputs are NumPy arrays, or torch tensors when ``q`` (``qkv``) is one.

Differences, all loud: ``dropout_p`` must be 0 (``NotImplementedError``
otherwise: fastattn is inference only); paged caches (``block_table``) and
rotary embeddings together with ``cache_leftpad`` raise ``NotImplementedError``;
``return_attn_probs`` returns an empty ``S_dmask`` as flash-attn does without
dropout.  Where flash-attn leaves a case undefined, fastattn refuses it with a
``ValueError`` (repeated ``cache_batch_idx`` with new keys, ``max_seqlen`` smaller
than a sequence, a new key that overflows a 16-bit cache).  ``deterministic``
and ``num_splits`` are accepted and change nothing: every result is already
deterministic and bit-identical for every thread count.  fastattn extends
flash-attn where it costs nothing: float32/float64 inputs, a float32 ``q`` with
16-bit caches, value head dims different from the key head dim.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import numpy as np

from . import _torch_bridge, positions
from ._args import sdpa_call, varlen_call
from ._cache_args import is_real_float as _is_real_float
from ._cache_args import query_dtype_ok as _query_dtype_ok
from ._cache_args import row_view as _rows
from ._checks import as_array, int_value, is_storage_dtype

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]

# The rotary helper of fastattn.positions (Any: that module is typed by its owner).
_CacheRotary: Any = positions._CacheRotary


# ------------------------------------------------------------------ arguments
def _array(x: Any, name: str, *, writable: bool = False) -> np.ndarray:
    if _torch_bridge.is_tensor(x):
        return _torch_bridge.to_numpy(x, name, writable=writable)
    if writable:  # written in place: a converted copy would silently lose the writes
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray or a CPU torch.Tensor, got {type(x).__name__}")
        if not x.flags.writeable:
            raise ValueError(f"{name} must be writable to append k and v")
        if not x.dtype.isnative:
            raise ValueError(f"{name} must be in native byte order to be written in place")
    return as_array(x, name)


def _wrap(torch_out: bool, *arrays: np.ndarray) -> Any:
    res = tuple(_torch_bridge.from_numpy(a) if torch_out else a for a in arrays)
    return res if len(res) > 1 else res[0]


def _dropout(dropout_p: Any) -> None:
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise NotImplementedError(
            f"dropout_p must be 0 (got {dropout_p}): fastattn is inference only and has no dropout"
        )


def _flag(x: Any, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return bool(x)


def _window_size(window_size: Any) -> tuple[int, int] | None:
    """flash-attn's (left, right), -1 = unbounded; None when both sides are unbounded."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left = int_value(window_size[0], "window_size[0]", -1)
    right = int_value(window_size[1], "window_size[1]", -1)
    return None if (left, right) == (-1, -1) else (left, right)


def _softcap(softcap: Any) -> float | None:
    """flash-attn's softcap: 0.0 = off, > 0 = on."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a number (0.0 = off), got {type(softcap).__name__}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0.0 = off), got {softcap!r}")
    return None if softcap == 0 else float(softcap)


def _alibi(alibi_slopes: Any) -> np.ndarray | None:
    return None if alibi_slopes is None else _array(alibi_slopes, "alibi_slopes")


class _Opts(NamedTuple):
    """The trailing arguments every flash-attn function shares (checked by common())."""

    dropout_p: Any
    softmax_scale: Any
    causal: Any
    window_size: Any
    softcap: Any
    alibi_slopes: Any
    deterministic: Any
    return_attn_probs: Any

    def common(self) -> dict[str, Any]:
        _dropout(self.dropout_p)
        _flag(self.deterministic, "deterministic")
        return dict(
            window=_window_size(self.window_size),
            softcap=_softcap(self.softcap),
            alibi_slopes=_alibi(self.alibi_slopes),
        )


def _ndim(a: np.ndarray, name: str, nd: int, shape: str) -> None:
    if a.ndim != nd:
        raise ValueError(f"{name} must be {nd}-D {shape}, got shape {a.shape}")


def _probs_placeholder(q: np.ndarray) -> np.ndarray:
    # flash-attn returns an empty S_dmask unless dropout_p > 0 (which fastattn refuses).
    return np.empty((0,), dtype=q.dtype)


# ------------------------------------------------------------- dense batches
def _dense(q: np.ndarray, k: np.ndarray, v: np.ndarray, torch_out: bool, o: _Opts) -> Any:
    opts = o.common()
    ret = _flag(o.return_attn_probs, "return_attn_probs")
    for a, n in ((q, "q"), (k, "k"), (v, "v")):
        _ndim(a, n, 4, "(batch, seqlen, nheads, headdim)")
    res = sdpa_call(
        q,
        k,
        v,
        is_causal=_flag(o.causal, "causal"),
        scale=o.softmax_scale,
        enable_gqa=True,
        layout="bshd",
        return_lse=ret,
        **opts,
    ).run()
    if not ret:
        return _wrap(torch_out, res)
    out, lse = res
    return _wrap(torch_out, out, lse, _probs_placeholder(out))


def flash_attn_func(
    q: Any,
    k: Any,
    v: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_func``.

    q ``(batch, seqlen_q, nheads, headdim)``, k ``(batch, seqlen_k, nheads_k,
    headdim)``, v ``(batch, seqlen_k, nheads_k, headdim_v)``; ``nheads`` a
    multiple of ``nheads_k``.  Returns out ``(batch, seqlen_q, nheads,
    headdim_v)`` in q's dtype, or with ``return_attn_probs=True`` the tuple
    ``(out, softmax_lse (batch, nheads, seqlen_q) float32, S_dmask (empty))``.
    Semantics of every argument: see the module docstring.
    """
    torch_out = _torch_bridge.is_tensor(q)
    qa, ka, va = _array(q, "q"), _array(k, "k"), _array(v, "v")
    return _dense(
        qa,
        ka,
        va,
        torch_out,
        _Opts(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
        ),
    )


def flash_attn_qkvpacked_func(
    qkv: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_qkvpacked_func``: ``qkv`` is ``(batch, seqlen, 3, nheads, headdim)``,
    read in place; otherwise as :func:`flash_attn_func`."""
    torch_out = _torch_bridge.is_tensor(qkv)
    a = _array(qkv, "qkv")
    if a.ndim != 5 or a.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {a.shape}")
    return _dense(
        a[:, :, 0],
        a[:, :, 1],
        a[:, :, 2],
        torch_out,
        _Opts(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
        ),
    )


def flash_attn_kvpacked_func(
    q: Any,
    kv: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_kvpacked_func``: q ``(batch, seqlen_q, nheads, headdim)``,
    ``kv`` ``(batch, seqlen_k, 2, nheads_k, headdim)``, read in place; otherwise as
    :func:`flash_attn_func`."""
    torch_out = _torch_bridge.is_tensor(q)
    qa, kva = _array(q, "q"), _array(kv, "kv")
    if kva.ndim != 5 or kva.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {kva.shape}")
    return _dense(
        qa,
        kva[:, :, 0],
        kva[:, :, 1],
        torch_out,
        _Opts(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
        ),
    )


# ------------------------------------------------------------ packed batches
def _max_seqlen(m: Any, name: str, cu: np.ndarray, cu_name: str) -> None:
    """flash-attn sizes its grid by max_seqlen: a smaller value would skip rows there."""
    m = int_value(m, name, 0)
    if cu.dtype.kind not in "iu" or cu.ndim != 1:
        return  # varlen_attention reports the malformed cu_seqlens
    longest = int(np.max(np.diff(cu.astype(np.int64)))) if cu.size > 1 else 0
    if m < longest:
        raise ValueError(f"{name} ({m}) is smaller than the longest sequence in {cu_name} ({longest})")


def _varlen(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    torch_out: bool,
    o: _Opts,
    block_table: Any,
) -> Any:
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV cache) is not supported by fastattn")
    opts = o.common()
    ret = _flag(o.return_attn_probs, "return_attn_probs")
    cq, ck = _array(cu_seqlens_q, "cu_seqlens_q"), _array(cu_seqlens_k, "cu_seqlens_k")
    _max_seqlen(max_seqlen_q, "max_seqlen_q", cq, "cu_seqlens_q")
    _max_seqlen(max_seqlen_k, "max_seqlen_k", ck, "cu_seqlens_k")
    res = varlen_call(
        q,
        k,
        v,
        cq,
        ck,
        is_causal=_flag(o.causal, "causal"),
        scale=o.softmax_scale,
        enable_gqa=True,
        return_lse=ret,
        **opts,
    ).run()
    if not ret:
        return _wrap(torch_out, res)
    out, lse = res
    return _wrap(torch_out, out, lse, _probs_placeholder(out))


def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Any = None,
) -> Any:
    """flash-attn's ``flash_attn_varlen_func``: sequences packed back to back.

    q ``(total_q, nheads, headdim)``, k ``(total_k, nheads_k, headdim)``, v
    ``(total_k, nheads_k, headdim_v)``; sequence ``b`` owns rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
    of k and v.  ``max_seqlen_q``/``max_seqlen_k`` must be at least the longest
    sequence.  Causal alignment and windows are bottom-right per sequence;
    ``alibi_slopes`` ``(nheads,)`` or ``(batch, nheads)``.  Returns out ``(total_q,
    nheads, headdim_v)``, or ``(out, softmax_lse (nheads, total_q), S_dmask (empty))``.
    """
    torch_out = _torch_bridge.is_tensor(q)
    qa, ka, va = _array(q, "q"), _array(k, "k"), _array(v, "v")
    return _varlen(
        qa,
        ka,
        va,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        torch_out,
        _Opts(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
        ),
        block_table,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: Any,
    cu_seqlens: Any,
    max_seqlen: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` ``(total, 3, nheads, headdim)``."""
    torch_out = _torch_bridge.is_tensor(qkv)
    a = _array(qkv, "qkv")
    if a.ndim != 4 or a.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, nheads, headdim), got {a.shape}")
    return _varlen(
        a[:, 0],
        a[:, 1],
        a[:, 2],
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        torch_out,
        _Opts(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
        ),
        None,
    )


def flash_attn_varlen_kvpacked_func(
    q: Any,
    kv: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: ``kv`` ``(total_k, 2, nheads_k, headdim)``."""
    torch_out = _torch_bridge.is_tensor(q)
    qa, kva = _array(q, "q"), _array(kv, "kv")
    if kva.ndim != 4 or kva.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, nheads_k, headdim), got {kva.shape}")
    return _varlen(
        qa,
        kva[:, 0],
        kva[:, 1],
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        torch_out,
        _Opts(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
        ),
        None,
    )


# ------------------------------------------------------------------ KV cache
def _per_batch_ints(x: Any, name: str, B: int) -> np.ndarray:
    if isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)):
        return np.full(B, int(x), dtype=np.int64)
    a = _array(x, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int or an integer array, got dtype {a.dtype}")
    if a.ndim == 0:
        a = np.broadcast_to(a, (B,))
    if a.shape != (B,):
        raise ValueError(f"{name} must have shape ({B},) (the batch of q), got {a.shape}")
    return a.astype(np.int64)


def _to_cache_dtype(x: np.ndarray, dt: np.dtype, name: str) -> np.ndarray:
    if x.dtype == dt:
        return x
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(dt)
        overflow = ~np.isfinite(y) & np.isfinite(x)
    if np.any(overflow):
        raise ValueError(f"{name} holds values beyond the range of the {dt} cache (they would become inf)")
    return y


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

    Every check runs before anything is written.  ``block_table``, and rotary
    together with a nonzero ``cache_leftpad``, raise ``NotImplementedError``;
    ``num_splits`` only tunes flash-attn's GPU kernel and changes nothing here.
    """
    # flash-attn features fastattn does not have: refused, never ignored.
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV cache) is not supported by fastattn")
    _flag(rotary_interleaved, "rotary_interleaved")
    int_value(num_splits, "num_splits", 0)
    ret = _flag(return_softmax_lse, "return_softmax_lse")
    is_causal = _flag(causal, "causal")
    window = _window_size(window_size)
    cap = _softcap(softcap)
    torch_out = _torch_bridge.is_tensor(q)

    qa = _array(q, "q")
    appending = k is not None or v is not None
    if appending and (k is None or v is None):
        raise ValueError("k and v must be given together")
    kc = _array(k_cache, "k_cache", writable=appending)
    vc = _array(v_cache, "v_cache", writable=appending)
    _ndim(qa, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    _ndim(kc, "k_cache", 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _ndim(vc, "v_cache", 4, "(batch_cache, seqlen_cache, nheads_k, headdim_v)")
    cdt = kc.dtype
    if not is_storage_dtype(cdt):
        raise TypeError(f"k_cache must have dtype float16, bfloat16, float32 or float64, got {cdt}")
    if vc.dtype != cdt:
        raise TypeError(f"v_cache must have the dtype of k_cache ({cdt}), got {vc.dtype}")
    if not _query_dtype_ok(qa.dtype, cdt):
        allowed = "float64" if cdt.name == "float64" else f"float32 or {cdt}"
        raise TypeError(f"q must have dtype {allowed} for {cdt} caches, got {qa.dtype}")
    B, Lq, Hq, D = qa.shape
    Bc, S, Hk, Dk = kc.shape
    if vc.shape[:3] != (Bc, S, Hk):
        raise ValueError(f"v_cache {vc.shape} must match k_cache {kc.shape} except in the last dim")
    Dv = vc.shape[3]
    if Dk != D:
        raise ValueError(f"k_cache head dim ({Dk}) must equal q's ({D})")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the cache's heads ({Hk})")

    if cache_batch_idx is None:
        if Bc < B:
            raise ValueError(f"k_cache holds {Bc} sequences but q has {B}; pass cache_batch_idx")
        idx = None
    else:
        ia = _array(cache_batch_idx, "cache_batch_idx")
        if ia.shape != (B,):
            raise ValueError(f"cache_batch_idx must have shape ({B},) (the batch of q), got {ia.shape}")
        if ia.dtype.kind not in "iu":
            raise TypeError(f"cache_batch_idx must be an integer array, got dtype {ia.dtype}")
        if ia.size and (ia.min() < 0 or ia.max() >= Bc):
            raise ValueError(f"cache_batch_idx values must lie in [0, {Bc}), got [{ia.min()}, {ia.max()}]")
        idx = ia.astype(np.int64)
        if appending and np.unique(idx).size != idx.size:
            raise ValueError("cache_batch_idx must not repeat an index when k and v are appended")
    rows = np.arange(B, dtype=np.int64) if idx is None else idx

    if cache_seqlens is None:
        if appending:
            raise ValueError("cache_seqlens must be given with k and v (where to write them)")
        seq = np.full(B, S, dtype=np.int64)
    else:
        seq = _per_batch_ints(cache_seqlens, "cache_seqlens", B)
    if seq.size and (seq.min() < 0 or seq.max() > S):
        raise ValueError(f"cache_seqlens values must lie in [0, {S}], got [{seq.min()}, {seq.max()}]")
    left = None
    if cache_leftpad is not None:
        left = _per_batch_ints(cache_leftpad, "cache_leftpad", B)
        if left.size and (left.min() < 0 or np.any(left > seq)):
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
        vw = _to_cache_dtype(va, cdt, "v")
    rot = None
    if rotary_cos is not None or rotary_sin is not None:
        rot = _CacheRotary(rotary_cos, rotary_sin, rotary_interleaved, D, cdt)
        if not appending:
            raise ValueError("rotary_cos/rotary_sin need k and v (flash-attn rotates the new keys and q)")
        if left is not None and np.any(left):
            raise NotImplementedError("rotary_cos/rotary_sin together with a nonzero cache_leftpad")
        kpos = rot.positions(seq, T)
        local = window is not None and tuple(window) != (-1, -1)
        qpos = rot.positions(seq, Lq) if (is_causal or local) else np.broadcast_to(seq[:, None], (B, Lq))
        rot.check(kpos, "the new keys' positions (cache_seqlens + t)")
        rot.check(qpos, "the queries' positions")
        ka_h = np.swapaxes(ka, 1, 2)  # (B, Hk, T, D)
        if cdt.itemsize == 2 and ka.size and np.abs(ka).max() * 1.4143 >= float(np.finfo(cdt).max):
            # a rotated pair can grow by sqrt(2): check the rotated keys before writing anything
            _to_cache_dtype(rot.rotate_q(ka_h, kpos), cdt, "k (rotated)")
    elif appending:
        kw = _to_cache_dtype(ka, cdt, "k")
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
    # the caches in place (views), so they see the tokens written below.
    kview = kc[:B] if idx is None else _rows(kc, idx)
    vview = vc[:B] if idx is None else _rows(vc, idx)
    if kview is not None and vview is not None:
        calls = [sdpa_call(qa, kview, vview, attn_mask=mask, key_lengths=total, alibi_slopes=al, **opts)]
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
                **opts,
            )
            for b, c in enumerate(rows.tolist())
        ]

    # ---- write (nothing has been modified before this point)
    if T and B:
        seq_l = seq.tolist()
        if rot is not None:  # keys rotated and written in one C pass over the new tokens
            if kview is not None:
                rot.append(ka_h, np.swapaxes(kview, 1, 2), kpos)
            else:
                for b, c in enumerate(rows.tolist()):
                    rot.append(ka_h[b : b + 1], np.swapaxes(kc[c : c + 1], 1, 2), kpos[b : b + 1])
        if len(set(seq_l)) == 1 and kview is not None and vview is not None:
            s0 = seq_l[0]
            if rot is None:
                kview[:, s0 : s0 + T] = kw
            vview[:, s0 : s0 + T] = vw
        else:
            for b, (c, s0) in enumerate(zip(rows.tolist(), seq_l)):
                if rot is None:
                    kc[c, s0 : s0 + T] = kw[b]
                vc[c, s0 : s0 + T] = vw[b]
    if rot is not None:  # the queries rotated after every check (bhsd, as the plans hold them)
        qr = rot.rotate_q(np.swapaxes(qa, 1, 2), qpos)
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
