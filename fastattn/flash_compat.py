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

Differentiable as flash-attn's: where autograd records and a q, k or v tensor
requires grad, ``flash_attn_func``, ``flash_attn_varlen_func`` and their packed
forms return an output whose backward is fastattn's fused backward with the same
options (every score option, GQA; the gradient reaches a packed tensor through
torch's slicing; not differentiable again, as flash-attn's is not).
``flash_attn_with_kvcache`` has no backward (nor has flash-attn's): a tensor that
requires grad is refused there while autograd records; a paged ``flash_attn_varlen_func``
(``block_table``) runs its forward, and its output's backward raises ``NotImplementedError``.

``dropout_p`` is flash-attn's attention dropout, applied whenever it is > 0 (as
flash-attn's: the caller passes 0 at evaluation): each attention weight is zeroed
with that probability and the others scaled by ``1 / (1 - dropout_p)``; the
log-sum-exp is the undropped softmax's.  The backward regenerates the forward's
mask.

Differences, all loud: the dropout mask is fastattn's (Philox keyed by a seed
drawn from torch's default generator for tensor inputs, from NumPy's global
generator for arrays: ``torch.manual_seed`` / ``numpy.random.seed`` reproduce it;
for a packed batch sequence ``b``'s positions within it, see
:func:`fastattn.reference.dropout_mask`), not the one flash-attn draws;
``return_attn_probs=True`` with ``dropout_p > 0`` returns flash-attn 2's ``S_dmask``
encoding (for its tests: each key block's weights over the running row maximum, with
the block widths of its sm80 kernel, negated where dropped, ``(batch, nheads, seqlen_q,
seqlen_k)`` rounded up to multiples of 128, q's dtype) of fastattn's weights and mask,
materialised after the call; without dropout ``S_dmask`` is empty, as flash-attn's.
``dropout_p > 0`` with ``block_table`` and ``cache_leftpad`` with paged caches raise
``NotImplementedError``.  Where flash-attn leaves a case undefined, fastattn refuses it with a
``ValueError`` (repeated ``cache_batch_idx`` with new keys, ``max_seqlen`` smaller
than a sequence, a new key that overflows a 16-bit cache).  ``deterministic``
and ``num_splits`` are accepted and change nothing: every result is already
deterministic and bit-identical for every thread count.  fastattn extends
flash-attn where it costs nothing: float32/float64 inputs, a float32 ``q`` with
16-bit caches (``flash_attn_with_kvcache``; elsewhere q, k and v must share a dtype,
as in flash-attn), head dims above flash-attn's 256 and of any size, value head dims
different from the key head dim.  From
flash-attn 3, ``flash_attn_with_kvcache`` takes 8-bit caches (int8, fp8
e4m3fn / e5m2) with their per-head descales ``k_descale``/``v_descale``
``(batch, nheads_k)``: new float keys/values are quantised with them (one
that does not fit raises); queries stay float (``q_descale`` must be None).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _flash_args, _flash_grad, _flash_sdmask, _torch_bridge
from ._args import sdpa_call, varlen_call
from ._cache_args import index_value, indices_value
from ._flash_args import Opts as _Opts
from ._flash_args import array_value as _array
from ._flash_args import check_ndim as _ndim
from ._flash_args import dropout_value as _dropout_p
from ._flash_args import flag_value as _flag
from ._flash_args import probs_placeholder as _probs_placeholder
from ._flash_args import wrap as _wrap
from ._flash_kvcache import flash_attn_with_kvcache
from ._paged import paged_varlen_call
from ._plan import Call

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


# ------------------------------------------------------------- dense batches
def _same_dtype(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """flash-attn's rule: q, k and v of one dtype (fastattn would take a float32 q with
    16-bit K/V, but code written for flash-attn never means that)."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must have the same dtype (as flash-attn), got {q.dtype}, {k.dtype}, {v.dtype}"
        )


def _unpack(x: Any, name: str, nd: int, axis: int, n: int, shape: str) -> list[Any]:
    """The ``n`` parts of a packed q/k/v along ``axis``: views of the array, or for a
    tensor torch's own slices (so that a gradient reaches the packed tensor)."""
    a = x if _torch_bridge.is_tensor(x) else _array(x, name)
    if a.ndim != nd or a.shape[axis] != n:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(a.shape)}")
    return [a[(slice(None),) * axis + (i,)] for i in range(n)]


def _dropout(o: _Opts, ret: bool) -> dict[str, Any]:
    """The call's dropout keywords (fastattn's ``dropout_p``/``dropout_seed``): empty at
    ``dropout_p == 0``; else ``dropout_p``, and the seed that :func:`_run` draws once the
    call's arguments are checked (the backward reuses it: it regenerates the forward's
    mask)."""
    p = _dropout_p(o.dropout_p)
    if p == 0:
        return {}
    return {"dropout_p": p}


def _np_of(x: Any, name: str) -> np.ndarray:
    return _torch_bridge.to_numpy(x.detach(), name) if _torch_bridge.is_tensor(x) else _array(x, name)


def _with_s_dmask(res: Any, q: Any, k: Any, drop: dict[str, Any], torch_out: bool, **kw: Any) -> Any:
    """``(out, lse, S_dmask)`` of a call that ran with dropout and ``return_attn_probs``:
    the empty placeholder replaced by flash-attn's ``S_dmask`` (:mod:`fastattn._flash_sdmask`)
    under the seed the call drew."""
    qa, ka = _np_of(q, "q"), _np_of(k, "k")
    s = _flash_sdmask.s_dmask(qa, ka, dropout_p=drop["dropout_p"], dropout_seed=drop["dropout_seed"], **kw)
    return (res[0], res[1], _wrap(torch_out, s))


def _run(call: Call, drop: dict[str, Any], torch_out: bool) -> Any:
    """Run a checked call, with dropout when ``drop`` asks for it: a fresh seed
    (:func:`fastattn._flash_args.draw_seed`, kept in ``drop`` for the backward) and the
    Plan fields, as fastattn.scaled_dot_product_attention sets them."""
    if drop:
        if "dropout_seed" not in drop:
            drop["dropout_seed"] = _flash_args.draw_seed(torch_out)
        if call.plan is not None:
            call.plan.dropout_p = drop["dropout_p"]
            call.plan.dropout_seed = drop["dropout_seed"]
    return call.run()


def _dense(q: Any, k: Any, v: Any, o: _Opts) -> Any:
    """flash_attn_func's call on q, k, v as given (arrays or tensors; differentiable
    where a tensor requires grad, :mod:`fastattn._flash_grad`)."""
    opts = o.common()
    ret = _flag(o.return_attn_probs, "return_attn_probs")
    causal = _flag(o.causal, "causal")
    grad = _flash_grad.wants_grad(q, k, v)
    torch_out = _torch_bridge.is_tensor(q)
    drop = _dropout(o, ret)

    def forward(qa: np.ndarray, ka: np.ndarray, va: np.ndarray) -> Any:
        for a, n in ((qa, "q"), (ka, "k"), (va, "v")):
            _ndim(a, n, 4, "(batch, seqlen, nheads, headdim)")
        _same_dtype(qa, ka, va)
        call = sdpa_call(
            qa,
            ka,
            va,
            is_causal=causal,
            scale=o.softmax_scale,
            enable_gqa=True,
            layout="bshd",
            return_lse=ret or grad,
            **opts,
        )
        return _run(call, drop, torch_out)

    if grad:
        spec = _flash_grad.dense_spec(forward, causal, o.softmax_scale, opts, drop)
        res = _flash_grad.run(spec, q, k, v, ret)
    else:
        res = forward(_array(q, "q"), _array(k, "k"), _array(v, "v"))
        if not ret:
            return _wrap(torch_out, res)
        res = _wrap(torch_out, res[0], res[1], _probs_placeholder(res[0]))
    if ret and drop:
        return _with_s_dmask(res, q, k, drop, torch_out, causal=causal, scale=o.softmax_scale, opts=opts)
    return res


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

    Parameters
    ----------
    q : array_like or torch.Tensor
        ``(batch, seqlen_q, nheads, headdim)``.
    k : array_like or torch.Tensor
        ``(batch, seqlen_k, nheads_k, headdim)``.
    v : array_like or torch.Tensor
        ``(batch, seqlen_k, nheads_k, headdim_v)``.
    dropout_p : float, default 0.0
        Attention dropout probability in [0, 1], applied whenever > 0 (pass 0 at
        evaluation); the mask is fastattn's, seeded from torch's (NumPy's) global
        generator, see the module docstring.  Not with ``return_attn_probs=True``.
    softmax_scale : float, optional
        Score scale; None means ``1/sqrt(headdim)``.
    causal : bool, default False
        Causal mask aligned to the bottom right.
    window_size : (int, int), default (-1, -1)
        ``(left, right)`` local window; -1 is unbounded on that side.
    softcap : float, default 0.0
        ``> 0`` caps the scores at ``softcap * tanh(s / softcap)``; 0 is off.
    alibi_slopes : array_like, optional
        ``(nheads,)`` or ``(batch, nheads)`` ALiBi slopes.
    deterministic : bool, default False
        Accepted and ignored (every result is deterministic).
    return_attn_probs : bool, default False
        Also return the log-sum-exp and an empty ``S_dmask``.

    Returns
    -------
    out : ndarray or torch.Tensor
        ``(batch, seqlen_q, nheads, headdim_v)`` in q's dtype (a tensor when the input is one).
    softmax_lse : ndarray or torch.Tensor
        ``(batch, nheads, seqlen_q)`` float32; only with ``return_attn_probs=True``.
    S_dmask : ndarray or torch.Tensor
        Empty; only with ``return_attn_probs=True``.

    Examples
    --------
    >>> from fastattn.flash_compat import flash_attn_func
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 4, 2, 8)).astype(np.float32)
    >>> out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    >>> out.shape, lse.shape
    ((1, 4, 2, 8), (1, 2, 4))
    >>> ref = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, layout="bshd")
    >>> bool(np.allclose(out, ref))
    True
    """
    return _dense(
        q,
        k,
        v,
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
    read in place; otherwise as :func:`flash_attn_func`.

    Parameters
    ----------
    qkv : array_like or torch.Tensor
        ``(batch, seqlen, 3, nheads, headdim)``.
    dropout_p : float, default 0.0
        Attention dropout probability in [0, 1], applied whenever > 0 (pass 0 at
        evaluation); the mask is fastattn's, seeded from torch's (NumPy's) global
        generator, see the module docstring.  Not with ``return_attn_probs=True``.
    softmax_scale : float, optional
        Score scale; None means ``1/sqrt(headdim)``.
    causal : bool, default False
        Causal mask aligned to the bottom right.
    window_size : (int, int), default (-1, -1)
        ``(left, right)`` local window; -1 is unbounded on that side.
    softcap : float, default 0.0
        ``> 0`` caps the scores at ``softcap * tanh(s / softcap)``; 0 is off.
    alibi_slopes : array_like, optional
        ``(nheads,)`` or ``(batch, nheads)`` ALiBi slopes.
    deterministic : bool, default False
        Accepted and ignored (every result is deterministic).
    return_attn_probs : bool, default False
        Also return the log-sum-exp and an empty ``S_dmask``.

    Returns
    -------
    out : ndarray or torch.Tensor
        ``(batch, seqlen_q, nheads, headdim_v)`` in q's dtype (a tensor when the input is one).
    softmax_lse : ndarray or torch.Tensor
        ``(batch, nheads, seqlen_q)`` float32; only with ``return_attn_probs=True``.
    S_dmask : ndarray or torch.Tensor
        Empty; only with ``return_attn_probs=True``.

    Examples
    --------
    >>> from fastattn.flash_compat import flash_attn_func, flash_attn_qkvpacked_func
    >>> qkv = np.random.default_rng(0).standard_normal((1, 4, 3, 2, 8)).astype(np.float32)
    >>> out = flash_attn_qkvpacked_func(qkv, causal=True)
    >>> out.shape
    (1, 4, 2, 8)
    >>> bool(np.array_equal(out, flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)))
    True
    """
    q, k, v = _unpack(qkv, "qkv", 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    return _dense(
        q,
        k,
        v,
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
    :func:`flash_attn_func`.

    Parameters
    ----------
    q : array_like or torch.Tensor
        ``(batch, seqlen_q, nheads, headdim)``.
    kv : array_like or torch.Tensor
        ``(batch, seqlen_k, 2, nheads_k, headdim)``.
    dropout_p : float, default 0.0
        Attention dropout probability in [0, 1], applied whenever > 0 (pass 0 at
        evaluation); the mask is fastattn's, seeded from torch's (NumPy's) global
        generator, see the module docstring.  Not with ``return_attn_probs=True``.
    softmax_scale : float, optional
        Score scale; None means ``1/sqrt(headdim)``.
    causal : bool, default False
        Causal mask aligned to the bottom right.
    window_size : (int, int), default (-1, -1)
        ``(left, right)`` local window; -1 is unbounded on that side.
    softcap : float, default 0.0
        ``> 0`` caps the scores at ``softcap * tanh(s / softcap)``; 0 is off.
    alibi_slopes : array_like, optional
        ``(nheads,)`` or ``(batch, nheads)`` ALiBi slopes.
    deterministic : bool, default False
        Accepted and ignored (every result is deterministic).
    return_attn_probs : bool, default False
        Also return the log-sum-exp and an empty ``S_dmask``.

    Returns
    -------
    out : ndarray or torch.Tensor
        ``(batch, seqlen_q, nheads, headdim_v)`` in q's dtype (a tensor when the input is one).
    softmax_lse : ndarray or torch.Tensor
        ``(batch, nheads, seqlen_q)`` float32; only with ``return_attn_probs=True``.
    S_dmask : ndarray or torch.Tensor
        Empty; only with ``return_attn_probs=True``.

    Examples
    --------
    >>> from fastattn.flash_compat import flash_attn_func, flash_attn_kvpacked_func
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    >>> kv = rng.standard_normal((1, 5, 2, 2, 8)).astype(np.float32)
    >>> out = flash_attn_kvpacked_func(q, kv)
    >>> out.shape
    (1, 2, 4, 8)
    >>> bool(np.array_equal(out, flash_attn_func(q, kv[:, :, 0], kv[:, :, 1])))
    True
    """
    k, v = _unpack(kv, "kv", 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return _dense(
        q,
        k,
        v,
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
    """flash-attn sizes its grid by max_seqlen: a smaller value would skip rows there.
    An int, or a 0-d integer tensor / array (as flash-attn's callers often pass
    ``cu_seqlens.diff().max()``)."""
    if (_torch_bridge.is_tensor(m) or isinstance(m, np.ndarray)) and np.ndim(_array(m, name)) == 0:
        a = _array(m, name)
        if a.dtype.kind in "iu":
            m = a[()]
    m = index_value(m, name, 0)
    if cu.dtype.kind not in "iu" or cu.ndim != 1:
        return  # varlen_attention reports the malformed cu_seqlens
    longest = int(np.max(np.diff(cu.astype(np.int64)))) if cu.size > 1 else 0
    if m < longest:
        raise ValueError(f"{name} ({m}) is smaller than the longest sequence in {cu_name} ({longest})")


def _varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    o: _Opts,
    block_table: Any,
) -> Any:
    """flash_attn_varlen_func's call on q, k, v as given (arrays or tensors; differentiable
    where a tensor requires grad and K/V are not pages, :mod:`fastattn._flash_grad`)."""
    opts = o.common()
    ret = _flag(o.return_attn_probs, "return_attn_probs")
    # Offsets as given (uint64, Python ints beyond int64) checked before any conversion.
    cq, ck = (
        indices_value(_array(c, n) if _torch_bridge.is_tensor(c) else c, n, 0, what="an integer array")
        for c, n in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"))
    )
    _max_seqlen(max_seqlen_q, "max_seqlen_q", cq, "cu_seqlens_q")
    _max_seqlen(max_seqlen_k, "max_seqlen_k", ck, "cu_seqlens_k")
    causal = _flag(o.causal, "causal")
    grad = _flash_grad.wants_grad(q, k, v)
    # Paged K/V: forward only; under grad the output's backward raises (the forward runs,
    # as flash-attn's does: its tests call it with a q that requires grad).
    paged_grad = grad and block_table is not None
    inputs = (q, k, v)
    if paged_grad:
        grad = False
        q, k, v = (x.detach() if _torch_bridge.is_tensor(x) else x for x in inputs)
    if block_table is not None and _dropout_p(o.dropout_p) > 0:
        raise NotImplementedError(
            "flash_attn_varlen_func with block_table (paged K/V, an inference call) has no dropout "
            "in fastattn: pass dropout_p=0"
        )
    torch_out = _torch_bridge.is_tensor(q)
    drop = _dropout(o, ret)
    kw: dict[str, Any] = dict(
        is_causal=causal, scale=o.softmax_scale, enable_gqa=True, return_lse=ret or grad, **opts
    )

    def forward(qa: np.ndarray, ka: np.ndarray, va: np.ndarray) -> Any:
        _same_dtype(qa, ka, va)
        # (dropout: batch b of the mask is sequence b, positions within it)
        return _run(varlen_call(qa, ka, va, cq, ck, **kw), drop, torch_out)

    if grad:
        spec = _flash_grad.varlen_spec(forward, cq, ck, causal, o.softmax_scale, opts, drop)
        res = _flash_grad.run(spec, q, k, v, ret)
    else:
        q, k, v = _array(q, "q"), _array(k, "k"), _array(v, "v")
        if block_table is not None:  # chunked prefill: k and v are page pools
            bt = _array(block_table, "block_table") if _torch_bridge.is_tensor(block_table) else block_table
            res = paged_varlen_call(q, k, v, cq, ck, bt, **kw).run()
        else:
            res = forward(q, k, v)
        res = _wrap(torch_out, res[0], res[1], _probs_placeholder(res[0])) if ret else _wrap(torch_out, res)
        if paged_grad and torch_out:  # (paged calls have no dropout: no S_dmask to add)
            what = "flash_attn_varlen_func with block_table"
            if not ret:
                return _flash_grad.without_backward(res, inputs, what)
            return (_flash_grad.without_backward(res[0], inputs, what), *res[1:])
        if not ret:
            return res
    if ret and drop:
        return _with_s_dmask(
            res,
            q,
            k,
            drop,
            torch_out,
            cu_seqlens_q=cq,
            cu_seqlens_k=ck,
            max_seqlen_q=int(max_seqlen_q),
            max_seqlen_k=int(max_seqlen_k),
            causal=causal,
            scale=o.softmax_scale,
            opts=opts,
        )
    return res


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

    Parameters
    ----------
    q : array_like or torch.Tensor
        ``(total_q, nheads, headdim)``.
    k : array_like or torch.Tensor
        ``(total_k, nheads_k, headdim)``.
    v : array_like or torch.Tensor
        ``(total_k, nheads_k, headdim_v)``.
    cu_seqlens_q, cu_seqlens_k : array_like of int
        ``(batch + 1,)`` offsets of the sequences in q and in k, v.
    max_seqlen_q, max_seqlen_k : int
        At least the longest query / key sequence.
    dropout_p : float, default 0.0
        Attention dropout probability in [0, 1], applied whenever > 0 (pass 0 at
        evaluation); the mask is fastattn's, seeded from torch's (NumPy's) global
        generator, see the module docstring.  Not with ``return_attn_probs=True``
        nor with ``block_table``.
    softmax_scale : float, optional
        Score scale; None means ``1/sqrt(headdim)``.
    causal : bool, default False
        Causal mask aligned to the bottom right.
    window_size : (int, int), default (-1, -1)
        ``(left, right)`` local window; -1 is unbounded on that side.
    softcap : float, default 0.0
        ``> 0`` caps the scores at ``softcap * tanh(s / softcap)``; 0 is off.
    alibi_slopes : array_like, optional
        ``(nheads,)`` or ``(batch, nheads)`` ALiBi slopes.
    deterministic : bool, default False
        Accepted and ignored (every result is deterministic).
    return_attn_probs : bool, default False
        Also return the log-sum-exp and an empty ``S_dmask``.
    block_table : array_like of int or torch.Tensor, optional
        ``(batch, max_blocks_per_seq)`` int32: chunked prefill over paged caches.  k
        and v are then page pools ``(num_blocks, page_block_size, nheads_k,
        headdim[_v])`` and ``cu_seqlens_k`` the cumulative key lengths (each
        sequence's keys are its first tokens in its pages).

    Returns
    -------
    out : ndarray or torch.Tensor
        ``(total_q, nheads, headdim_v)`` in q's dtype (a tensor when the input is one).
    softmax_lse : ndarray or torch.Tensor
        ``(nheads, total_q)`` float32; only with ``return_attn_probs=True``.
    S_dmask : ndarray or torch.Tensor
        Empty; only with ``return_attn_probs=True``.

    Examples
    --------
    Two sequences, of 2 and 3 tokens, packed:

    >>> from fastattn.flash_compat import flash_attn_func, flash_attn_varlen_func
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 5, 2, 8)).astype(np.float32)
    >>> cu = np.array([0, 2, 5], dtype=np.int32)
    >>> out = flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, causal=True)
    >>> out.shape
    (5, 2, 8)
    >>> second = flash_attn_func(q[None, 2:], k[None, 2:], v[None, 2:], causal=True)[0]
    >>> bool(np.allclose(out[2:], second))
    True
    """
    return _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
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
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` ``(total, 3, nheads, headdim)``.

    Parameters
    ----------
    qkv : array_like or torch.Tensor
        ``(total, 3, nheads, headdim)``.
    cu_seqlens : array_like of int
        ``(batch + 1,)`` offsets of the sequences.
    max_seqlen : int
        At least the longest sequence.
    dropout_p : float, default 0.0
        Attention dropout probability in [0, 1], applied whenever > 0 (pass 0 at
        evaluation); the mask is fastattn's, seeded from torch's (NumPy's) global
        generator, see the module docstring.  Not with ``return_attn_probs=True``.
    softmax_scale : float, optional
        Score scale; None means ``1/sqrt(headdim)``.
    causal : bool, default False
        Causal mask aligned to the bottom right.
    window_size : (int, int), default (-1, -1)
        ``(left, right)`` local window; -1 is unbounded on that side.
    softcap : float, default 0.0
        ``> 0`` caps the scores at ``softcap * tanh(s / softcap)``; 0 is off.
    alibi_slopes : array_like, optional
        ``(nheads,)`` or ``(batch, nheads)`` ALiBi slopes.
    deterministic : bool, default False
        Accepted and ignored (every result is deterministic).
    return_attn_probs : bool, default False
        Also return the log-sum-exp and an empty ``S_dmask``.

    Returns
    -------
    out : ndarray or torch.Tensor
        ``(total_q, nheads, headdim_v)`` in q's dtype (a tensor when the input is one).
    softmax_lse : ndarray or torch.Tensor
        ``(nheads, total_q)`` float32; only with ``return_attn_probs=True``.
    S_dmask : ndarray or torch.Tensor
        Empty; only with ``return_attn_probs=True``.

    Examples
    --------
    >>> from fastattn.flash_compat import flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func
    >>> qkv = np.random.default_rng(0).standard_normal((5, 3, 2, 8)).astype(np.float32)
    >>> cu = np.array([0, 2, 5], dtype=np.int32)
    >>> out = flash_attn_varlen_qkvpacked_func(qkv, cu, 3, causal=True)
    >>> out.shape
    (5, 2, 8)
    >>> ref = flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 3, 3, causal=True)
    >>> bool(np.array_equal(out, ref))
    True
    """
    q, k, v = _unpack(qkv, "qkv", 4, 1, 3, "(total, 3, nheads, headdim)")
    return _varlen(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
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
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: ``kv`` ``(total_k, 2, nheads_k, headdim)``.

    Parameters
    ----------
    q : array_like or torch.Tensor
        ``(total_q, nheads, headdim)``.
    kv : array_like or torch.Tensor
        ``(total_k, 2, nheads_k, headdim)``.
    cu_seqlens_q, cu_seqlens_k : array_like of int
        ``(batch + 1,)`` offsets of the sequences in q and in kv.
    max_seqlen_q, max_seqlen_k : int
        At least the longest query / key sequence.
    dropout_p : float, default 0.0
        Attention dropout probability in [0, 1], applied whenever > 0 (pass 0 at
        evaluation); the mask is fastattn's, seeded from torch's (NumPy's) global
        generator, see the module docstring.  Not with ``return_attn_probs=True``.
    softmax_scale : float, optional
        Score scale; None means ``1/sqrt(headdim)``.
    causal : bool, default False
        Causal mask aligned to the bottom right.
    window_size : (int, int), default (-1, -1)
        ``(left, right)`` local window; -1 is unbounded on that side.
    softcap : float, default 0.0
        ``> 0`` caps the scores at ``softcap * tanh(s / softcap)``; 0 is off.
    alibi_slopes : array_like, optional
        ``(nheads,)`` or ``(batch, nheads)`` ALiBi slopes.
    deterministic : bool, default False
        Accepted and ignored (every result is deterministic).
    return_attn_probs : bool, default False
        Also return the log-sum-exp and an empty ``S_dmask``.

    Returns
    -------
    out : ndarray or torch.Tensor
        ``(total_q, nheads, headdim_v)`` in q's dtype (a tensor when the input is one).
    softmax_lse : ndarray or torch.Tensor
        ``(nheads, total_q)`` float32; only with ``return_attn_probs=True``.
    S_dmask : ndarray or torch.Tensor
        Empty; only with ``return_attn_probs=True``.

    Examples
    --------
    >>> from fastattn.flash_compat import flash_attn_varlen_func, flash_attn_varlen_kvpacked_func
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((3, 2, 8)).astype(np.float32)
    >>> kv = rng.standard_normal((5, 2, 2, 8)).astype(np.float32)
    >>> cu_q, cu_k = np.array([0, 1, 3], np.int32), np.array([0, 2, 5], np.int32)
    >>> out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 2, 3)
    >>> out.shape
    (3, 2, 8)
    >>> ref = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, 2, 3)
    >>> bool(np.array_equal(out, ref))
    True
    """
    k, v = _unpack(kv, "kv", 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    return _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
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


# Defined in fastattn._flash_kvcache; this module's public function (help(), the API docs).
flash_attn_with_kvcache.__module__ = __name__
