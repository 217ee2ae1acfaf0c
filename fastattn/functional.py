"""Attention functions: ``scaled_dot_product_attention`` and ``varlen_attention``.

Vocabulary: B batch, Hq/Hk query and key/value heads, L query length, S key
length, D head dim, Dv value head dim.  Masks: bool ``True`` = may attend,
floats are added to the scores.  ``is_causal`` is aligned to the bottom right:
query i sees keys j <= i + (S - L).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import _kernels
from ._checks import (
    F32,
    F64,
    INT64_MAX,
    as_array,
    check_float,
    flag_value,
    int_value,
    kernel_ready,
    scale_value,
    threads_value,
)
from ._config import get_num_threads, precision_code

__all__ = ["scaled_dot_product_attention", "varlen_attention"]

_SCALE_MAX_F32 = float(np.finfo(np.float32).max) / math.log2(math.e)  # as _checks.scale_value
_MASK_KINDS = {np.dtype(np.bool_): _kernels.MASK_BOOL, F32: _kernels.MASK_F32, F64: _kernels.MASK_F64}


def _compute_dtype(q):
    return F64 if q.dtype == F64 else F32


def _check_dtypes(q, k, v):
    if q.dtype is F32 and k.dtype is F32 and v.dtype is F32:  # the common case, ~0.5 µs saved
        return
    for a, n in ((q, "query"), (k, "key"), (v, "value")):
        check_float(a, n)
    dts = (q.dtype, k.dtype, v.dtype)
    if F64 in dts and not all(d == F64 for d in dts):
        raise TypeError(
            f"query, key and value must all be float64 when one is; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.dtype != v.dtype:
        raise TypeError(f"key and value must share a dtype, got {k.dtype} and {v.dtype}")


def _window(window):
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    # Up to 2**63 - 1 (sys.maxsize: "unbounded"); the kernel saturates i' +- bound.
    left = int_value(window[0], "window[0]", -1, INT64_MAX)
    right = int_value(window[1], "window[1]", -1, INT64_MAX)
    return left, right


def _softcap(softcap):
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive number or None, got {type(softcap).__name__}")
    c = float(softcap)
    if not (c > 0 and math.isfinite(c)):
        raise ValueError(f"softcap must be positive and finite, got {softcap!r}")
    if c < 2.2250738585072014e-308:  # a denormal: the kernel reads it as 0 (DAZ)
        raise ValueError(
            f"softcap must be at least 2.2250738585072014e-308 (a normal float64), got {softcap!r}"
        )
    return c


def _per_head(x, name, lead, Hq, allow_batch):
    """float64 (B, Hq) table from a (Hq,) or (*lead, Hq) argument."""
    a = as_array(x, name)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must be a real array, got dtype {a.dtype}")
    shapes = [(Hq,)] + ([lead + (Hq,)] if allow_batch else [])
    if a.shape not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {a.shape}")
    a = np.asarray(a, dtype=F64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite")
    B = math.prod(lead)
    return np.ascontiguousarray(np.broadcast_to(a, lead + (Hq,)).reshape(B, Hq))


def _lengths(x, name, lead, limit):
    a = as_array(x, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.shape != lead:
        raise ValueError(f"{name} must have shape {lead} (the batch dims), got {a.shape}")
    if a.size and (a.min() < 0 or a.max() > limit):
        raise ValueError(f"{name} values must lie in [0, {limit}], got range [{a.min()}, {a.max()}]")
    return np.ascontiguousarray(a, dtype=np.int64).reshape(-1)


def _mask_value(attn_mask, shape, cdt):
    """(mask, kind): attn_mask as a read-only broadcast view of ``shape``
    (bool, float32 or float64; other floats converted to cdt) and its kernel
    code; (None, MASK_NONE) when there is none."""
    if attn_mask is None:
        return None, _kernels.MASK_NONE
    m = as_array(attn_mask, "attn_mask")
    if m.dtype == np.bool_:
        pass
    elif m.dtype.kind == "f" or (m.dtype.name == "bfloat16"):
        if m.dtype not in (F32, F64):
            m = m.astype(cdt)
    else:
        raise TypeError(f"attn_mask must be bool or floating, got dtype {m.dtype}")
    if not m.dtype.isnative:
        m = m.astype(m.dtype.newbyteorder("="))
    try:
        mask = np.broadcast_to(m, shape)
    except ValueError:
        raise ValueError(f"attn_mask of shape {m.shape} does not broadcast to {shape}") from None
    if not mask.flags.aligned:
        mask = np.broadcast_to(m.copy(), shape)
    return mask, _MASK_KINDS[mask.dtype]


def _check_shapes(q, k, v, layout, enable_gqa):
    """Shape checks shared with fastattn.cuda (uses only ``.ndim`` and ``.shape``).

    Returns ``(lead, (Hq, L, D), (Hk, S, Dv))`` of the bhsd view."""
    min_nd = 2 if layout == "bhsd" else 3
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    for s, n in ((qs, "query"), (ks, "key"), (vs, "value")):
        if len(s) < min_nd:
            raise ValueError(
                f"{n} must have at least {min_nd} dimensions for layout={layout!r}, got shape {s}"
            )
    if not (len(qs) == len(ks) == len(vs)):
        raise ValueError(
            f"query, key and value must have the same number of dimensions, got {qs}, {ks}, {vs}"
        )
    if layout == "bshd":  # the bhsd view's shapes
        qs, ks, vs = (s[:-3] + (s[-2], s[-3], s[-1]) for s in (qs, ks, vs))
    elif len(qs) == 2:
        qs, ks, vs = (1,) + qs, (1,) + ks, (1,) + vs
    lead = qs[:-3]
    if ks[:-3] != lead or vs[:-3] != lead:
        raise ValueError(
            f"query, key and value must share their batch dims, got {q.shape}, {k.shape}, {v.shape}"
        )
    Hq, L, D = qs[-3:]
    Hk, S, Dk = ks[-3:]
    Hv, Sv, Dv = vs[-3:]
    if D != Dk:
        raise ValueError(f"query and key must have the same head dim, got {D} and {Dk}")
    if D == 0 or Dv == 0:
        raise ValueError("head dims of query, key and value must be >= 1")
    if Hk != Hv or S != Sv:
        raise ValueError(
            f"key and value must have the same heads and length, got key {k.shape}, value {v.shape}"
        )
    if Hq != Hk:
        if not enable_gqa:
            raise ValueError(
                f"query has {Hq} heads but key/value have {Hk}; pass enable_gqa=True for "
                "grouped-query attention"
            )
        if Hk == 0 or Hq % Hk:
            raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hk})")
    return lead, (Hq, L, D), (Hk, S, Dv)


def _merge_lead(a, B):
    """(*lead, x, y, z) -> (B, x, y, z) as a view, or None when the strides of
    the leading dims cannot merge (a reshape would copy)."""
    if a.ndim == 4:
        return a
    shape = (B,) + a.shape[-3:]
    try:
        return np.reshape(a, shape, copy=False)
    except ValueError:
        return None
    except TypeError:  # NumPy < 2.1 has no copy argument
        r = a.reshape(shape)
        return r if (r.size == 0 or np.may_share_memory(r, a)) else None


def _attention(qh, kh, vh, mask, oh, lseh, opts):
    """Kernel call on bhsd views with equal leading dims (recursing over the
    first leading dim when a mask or output cannot be merged without a copy)."""
    if qh.ndim == 4:  # the common case: nothing to merge
        q4, k4, v4, o4, m4, l4 = qh, kh, vh, oh, mask, lseh
    else:
        lead = qh.shape[:-3]
        B = math.prod(lead)
        q4 = qh.reshape((B,) + qh.shape[-3:])
        k4 = kh.reshape((B,) + kh.shape[-3:])
        v4 = vh.reshape((B,) + vh.shape[-3:])
        o4 = _merge_lead(oh, B)
        m4 = None if mask is None else _merge_lead(mask, B)
        l4 = None if lseh is None else lseh.reshape((B,) + lseh.shape[-2:])  # freshly allocated: a view
    if o4 is None or (mask is not None and m4 is None):
        lead = qh.shape[:-3]
        for i in range(lead[0]):
            sub = dict(opts)
            for key in ("alibi", "q_lens", "k_lens"):
                if opts[key] is not None:
                    n = opts[key].shape[0] // lead[0]
                    sub[key] = opts[key][i * n : (i + 1) * n]
            if opts["bmask"] is not None:
                n = opts["bmask"].shape[0] // lead[0]
                sub["bmask"] = opts["bmask"][i * n : (i + 1) * n]
            _attention(
                qh[i],
                kh[i],
                vh[i],
                None if mask is None else mask[i],
                oh[i],
                None if lseh is None else lseh[i],
                sub,
            )
        return
    _kernels.attention(
        kernel_ready(q4),
        kernel_ready(k4),
        kernel_ready(v4),
        o4,
        l4,
        m4,
        opts["mask_kind"],
        opts["scale"],
        opts["causal"],
        opts["wl"],
        opts["wr"],
        opts["softcap"],
        opts["alibi"],
        opts["sinks"],
        opts["q_lens"],
        opts["k_lens"],
        None,
        None,
        opts["bmask"],
        opts["bm_q"],
        opts["bm_k"],
        opts["threads"],
        precision=opts["precision"],
    )


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    layout="bhsd",
    return_lse=False,
    out=None,
    num_threads=None,
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    key_lengths=None,
    query_lengths=None,
    block_mask=None,
    block_size=None,
    device=None,
    precision=None,
):
    """softmax(query @ key^T * scale + mask) @ value, fused and tiled.

    Shapes (``layout="bhsd"``): query ``(..., Hq, L, D)``, key ``(..., Hk, S, D)``,
    value ``(..., Hk, S, Dv)``; 2-D ``(L, D)`` inputs are one head.  With
    ``layout="bshd"``: ``(..., L, H, D)`` as flash-attn and JAX use.  The output
    has the query's layout and dtype, last dimension Dv.

    attn_mask: bool (True = may attend) or float (added to the scores; -inf
        excludes), broadcastable to ``(..., Hq, L, S)``; read in place through
        broadcasting strides, never expanded.
    is_causal: query i may see keys j <= i + (S - L), aligned to the bottom
        right (flash-attn's convention, what a KV cache needs).  Equal to the
        usual lower triangle when L == S; torch aligns top-left when L != S.
    scale: multiplies the scores; None means 1/sqrt(D).
    enable_gqa: allow Hq to be a multiple of Hk (grouped-query attention); each
        key/value head serves Hq/Hk consecutive query heads, without copies.
    return_lse: also return the natural-log sum of exponentials of each row,
        shape ``(..., Hq, L)`` (``(B, Hq, L)`` for bshd), float32 (float64 for
        float64 inputs).  A row whose keys are all masked gives zeros and -inf.
    out: write the result into this array (right shape and dtype, writable,
        not overlapping an input) and return it.
    num_threads: threads for this call; None uses ``fastattn.get_num_threads()``.
        Results are bit-identical for every thread count.
    window: ``(left, right)`` sliding window: query at bottom-right position i'
        sees keys in ``[i' - left, i' + right]``; -1 is unbounded.
    alibi_slopes: ``(Hq,)`` or ``(..., Hq)``: adds ``-slope * |i' - j|``.
    softcap: scores become ``softcap * tanh(scores / softcap)`` before masks.
    sinks: ``(Hq,)`` logits that join each row's softmax denominator only.
    key_lengths, query_lengths: integer arrays of the batch dims' shape; keys
        ``j >= key_lengths[b]`` are ignored (their tiles skipped), output rows
        ``i >= query_lengths[b]`` are zeros with LSE -inf.  Causal alignment
        uses these lengths.
    block_mask, block_size: block-sparse pattern, bool ``(..., Hq, ceil(L/bq),
        ceil(S/bk))`` with ``block_size=(bq, bk)``; True blocks are computed,
        the others skipped entirely.

    Order of score transforms: scale, softcap, ALiBi, attn_mask, then the
    causal / window / length / block restrictions.

    precision: float32 inputs only, torch's names: "highest" (float32 arithmetic),
        "high" (bf16x3: three bfloat16 products per float32 product, ~16 mantissa
        bits) or "medium" (Q, K, V and P rounded to bfloat16); None uses
        ``fastattn.get_float32_matmul_precision()`` ("highest" unless set).  The lower
        levels take effect on the ``amx`` path (>= 32 rows per key/value head) and
        compute as "highest" elsewhere; float64 and float16 ignore it.  bfloat16
        inputs on the ``amx`` path always use bf16 products (P rounded to bf16).

    device: None or "cpu" (this kernel), or "cuda": run
        :func:`fastattn.cuda.scaled_dot_product_attention` (NumPy or
        ``__cuda_array_interface__`` inputs; RuntimeError when fastattn was
        built without CUDA or no GPU is present).  ``num_threads``, ``sinks``,
        ``query_lengths`` and ``block_mask`` are CPU-only.
    """
    # Fast path for the common small call: float32 NumPy arrays in bhsd layout
    # with the default options (only is_causal, scale, num_threads and precision
    # given).
    # It skips no check: each condition below is what the general path would
    # accept, and anything else (including every error) takes the general path.
    # On (1, 8, 16, 64) it cut a call from 28.0 to 22.6 µs (Sapphire Rapids
    # class, 1 thread, thread CPU time, median of interleaved rounds).
    if (
        type(query) is np.ndarray
        and type(key) is np.ndarray
        and type(value) is np.ndarray
        and attn_mask is None
        and type(layout) is str  # an array layout would make the comparison below an array
        and layout == "bhsd"
        and (scale is None or type(scale) is float)
        and (is_causal is False or is_causal is True)
        and (dropout_p == 0 if type(dropout_p) is float or type(dropout_p) is int else False)
        and out is None
        and return_lse is False  # (not `not return_lse`: an array there must reach the named check)
        and device is None
        and window is None
        and alibi_slopes is None
        and softcap is None
        and sinks is None
        and key_lengths is None
        and query_lengths is None
        and block_mask is None
        and block_size is None
        and query.dtype is F32
        and key.dtype is F32
        and value.dtype is F32
        and query.ndim == 4
        and key.ndim == 4
        and value.ndim == 4
    ):
        B, Hq, L, D = query.shape
        Bk, Hk, S, Dk = key.shape
        Bv, Hv, Sv, Dv = value.shape
        if (
            B == Bk == Bv
            and Hq == Hk == Hv
            and S == Sv
            and D == Dk
            and D > 0
            and Dv > 0
            and query.strides[3] == 4
            and key.strides[3] == 4
            and value.strides[3] == 4
            and query.flags.aligned
            and key.flags.aligned
            and value.flags.aligned
            and (scale is None or abs(scale) <= _SCALE_MAX_F32)  # finite, and finite times log2(e)
        ):
            res = np.empty((B, Hq, L, Dv), dtype=F32)
            _kernels.attention(
                query,
                key,
                value,
                res,
                None,
                None,
                0,  # MASK_NONE
                1.0 / math.sqrt(D) if scale is None else scale,
                is_causal,
                -1,
                -1,
                0.0,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                1,
                1,
                threads_value(num_threads, get_num_threads),
                precision=precision_code(precision),
            )
            return res
    if type(dropout_p) is not float and type(dropout_p) is not int:  # (exact types: the fast path)
        if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
            raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise NotImplementedError("dropout_p must be 0: fastattn is an inference library")
    prec = precision_code(precision)
    if device is not None and device != "cpu":
        if device != "cuda":
            raise ValueError(f"device must be None, 'cpu' or 'cuda', got {device!r}")
        cpu_only = dict(
            num_threads=num_threads,
            sinks=sinks,
            query_lengths=query_lengths,
            block_mask=block_mask,
            block_size=block_size,
        )
        for name, val in cpu_only.items():
            if val is not None:
                raise ValueError(f"{name} is not supported with device='cuda'")
        from . import cuda

        return cuda.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask,
            is_causal,
            scale,
            enable_gqa,
            layout=layout,
            return_lse=return_lse,
            out=out,
            window=window,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            key_lengths=key_lengths,
        )
    if not isinstance(layout, str) or layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
    q = as_array(query, "query")
    k = as_array(key, "key")
    v = as_array(value, "value")
    _check_dtypes(q, k, v)
    lead, (Hq, L, D), (Hk, S, Dv) = _check_shapes(q, k, v, layout, enable_gqa)
    if layout == "bshd":
        qh, kh, vh = (np.swapaxes(a, -2, -3) for a in (q, k, v))
    elif q.ndim == 2:
        qh, kh, vh = q[None], k[None], v[None]
    else:
        qh, kh, vh = q, k, v
    cdt = _compute_dtype(q)
    sc = scale_value(scale, D, cdt)
    threads = threads_value(num_threads, get_num_threads)
    wl, wr = _window(window)
    cap = _softcap(softcap)
    B = math.prod(lead)

    mask, mask_kind = _mask_value(attn_mask, lead + (Hq, L, S), cdt)
    alibi = None if alibi_slopes is None else _per_head(alibi_slopes, "alibi_slopes", lead, Hq, True)
    sk = None if sinks is None else _per_head(sinks, "sinks", (1,), Hq, False)[0].copy()
    k_lens = None if key_lengths is None else _lengths(key_lengths, "key_lengths", lead, S)
    q_lens = None if query_lengths is None else _lengths(query_lengths, "query_lengths", lead, L)
    bmask, bm_q, bm_k = None, 1, 1
    if block_mask is not None or block_size is not None:
        if block_mask is None or block_size is None:
            raise ValueError("block_mask and block_size must be given together")
        if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
            raise TypeError(f"block_size must be a (bq, bk) pair of ints, got {block_size!r}")
        bm_q = int_value(block_size[0], "block_size[0]", 1, INT64_MAX)
        bm_k = int_value(block_size[1], "block_size[1]", 1, INT64_MAX)
        bm = as_array(block_mask, "block_mask")
        if bm.dtype != np.bool_:
            raise TypeError(f"block_mask must be a bool array, got dtype {bm.dtype}")
        nbq, nbk = -(-L // bm_q), -(-S // bm_k)
        try:
            bm = np.broadcast_to(bm, lead + (Hq, nbq, nbk))
        except ValueError:
            raise ValueError(
                f"block_mask of shape {bm.shape} does not broadcast to "
                f"{lead + (Hq, nbq, nbk)} (blocks of {bm_q}x{bm_k})"
            ) from None
        # Read in place through broadcasting strides (the kernel takes a stride per
        # dim); a copy only when the leading dims cannot merge into one.
        bmask = _merge_lead(bm, B) if bm.ndim > 4 else bm.reshape((B, Hq, nbq, nbk))
        if bmask is None:
            bmask = np.ascontiguousarray(bm).reshape((B, Hq, nbq, nbk))

    out_dtype = q.dtype
    out_shape = q.shape[:-1] + (Dv,)
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
        if out.shape != out_shape:
            raise ValueError(f"out must have shape {out_shape}, got {out.shape}")
        if out.dtype != out_dtype:
            raise TypeError(f"out must have dtype {out_dtype}, got {out.dtype}")
        if not out.flags.writeable:
            raise ValueError("out must be writable")
        # The converted arrays (a torch tensor or other array-like mask included).
        for a, n in ((q, "query"), (k, "key"), (v, "value"), (mask, "attn_mask"), (bmask, "block_mask")):
            if a is not None and np.may_share_memory(out, a):
                raise ValueError(f"out must not share memory with {n}")
        res = out
        direct = (
            out.dtype.isnative and out.flags.aligned and (Dv == 1 or out.strides[-1] == out.dtype.itemsize)
        )
        work = out if direct else np.empty(out_shape, dtype=out_dtype)
    else:
        res = work = np.empty(out_shape, dtype=out_dtype)
    if layout == "bshd":
        oh = np.swapaxes(work, -2, -3)
    elif work.ndim == 2:
        oh = work[None]
    else:
        oh = work
    lse = lseh = None
    if want_lse:
        lse = np.empty(lead + (Hq, L), dtype=cdt)
        lseh = lse

    opts = {
        "mask_kind": mask_kind,
        "scale": sc,
        "causal": causal,
        "wl": wl,
        "wr": wr,
        "softcap": cap,
        "alibi": alibi,
        "sinks": sk,
        "q_lens": q_lens,
        "k_lens": k_lens,
        "bmask": bmask,
        "bm_q": bm_q,
        "bm_k": bm_k,
        "threads": threads,
        "precision": prec,
    }
    if lead == ():
        qh, kh, vh, oh = qh[None], kh[None], vh[None], oh[None]
        mask = None if mask is None else mask[None]
        lseh = None if lseh is None else lseh[None]
    _attention(qh, kh, vh, mask, oh, lseh, opts)
    if work is not res:
        res[...] = work
    if want_lse:
        if q.ndim == 2:
            lse = lse[0]
        return res, lse
    return res


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    return_lse=False,
    out=None,
    num_threads=None,
    precision=None,
):
    """Attention over packed variable-length sequences (flash-attn's
    ``flash_attn_varlen_func`` convention).

    q: ``(Tq, Hq, D)``, k: ``(Tk, Hk, D)``, v: ``(Tk, Hk, Dv)`` hold the tokens of
    all sequences back to back; sequence b owns query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.  Nothing is computed across
    sequences and no padding is computed.  Causal alignment is bottom-right per
    sequence.  ``precision``: as for :func:`scaled_dot_product_attention`.  Returns
    ``(Tq, Hq, Dv)`` and, with ``return_lse``, ``(Hq, Tq)``.
    """
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
    qa, ka, va = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    _check_dtypes(qa, ka, va)
    for a, n in ((qa, "q"), (ka, "k"), (va, "v")):
        if a.ndim != 3:
            raise ValueError(f"{n} must be 3-D (total_tokens, heads, head_dim), got shape {a.shape}")
    Tq, Hq, D = qa.shape
    Tk, Hk, Dk = ka.shape
    if va.shape[:2] != (Tk, Hk):
        raise ValueError(f"k and v must have the same tokens and heads, got {ka.shape} and {va.shape}")
    Dv = va.shape[2]
    if D != Dk:
        raise ValueError(f"q and k must have the same head dim, got {D} and {Dk}")
    if D == 0 or Dv == 0:
        raise ValueError("head dims of q, k and v must be >= 1")
    if Hq != Hk:
        if not enable_gqa:
            raise ValueError(f"q has {Hq} heads but k/v have {Hk}; pass enable_gqa=True")
        if Hk == 0 or Hq % Hk:
            raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hk})")
    cus = []
    for cu, n, T in ((cu_seqlens_q, "cu_seqlens_q", Tq), (cu_seqlens_k, "cu_seqlens_k", Tk)):
        c = as_array(cu, n)
        if c.dtype.kind not in "iu":
            raise TypeError(f"{n} must be an integer array, got dtype {c.dtype}")
        if c.ndim != 1 or c.shape[0] < 1:
            raise ValueError(f"{n} must be 1-D with at least one entry, got shape {c.shape}")
        c = np.ascontiguousarray(c, dtype=np.int64)
        if c[0] != 0 or np.any(np.diff(c) < 0):
            raise ValueError(f"{n} must start at 0 and be non-decreasing")
        if c[-1] != T:
            raise ValueError(f"{n}[-1] must equal the packed length {T}, got {c[-1]}")
        cus.append(c)
    cq, ck = cus
    if cq.shape != ck.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cq.shape[0]} and {ck.shape[0]}"
        )
    nb = cq.shape[0] - 1
    prec = precision_code(precision)
    sc = scale_value(scale, D, _compute_dtype(qa))
    threads = threads_value(num_threads, get_num_threads)
    wl, wr = _window(window)
    cap = _softcap(softcap)
    alibi = None if alibi_slopes is None else _per_head(alibi_slopes, "alibi_slopes", (nb,), Hq, True)
    sk = None if sinks is None else _per_head(sinks, "sinks", (), Hq, False)[0].copy()
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
        if out.shape != (Tq, Hq, Dv) or out.dtype != qa.dtype:
            raise ValueError(
                f"out must have shape {(Tq, Hq, Dv)} and dtype {qa.dtype}, got {out.shape} {out.dtype}"
            )
        if not out.flags.writeable or not out.flags.c_contiguous:
            raise ValueError("out must be writable and C-contiguous")
        for a, n in ((qa, "q"), (ka, "k"), (va, "v")):
            if np.may_share_memory(out, a):
                raise ValueError(f"out must not share memory with {n}")
        o = out
    else:
        o = np.empty((Tq, Hq, Dv), dtype=qa.dtype)
    lse = np.empty((Hq, Tq), dtype=_compute_dtype(qa)) if want_lse else None
    if nb > 0 and Tq > 0:

        def batched(a):  # (T, H, X) -> (nb, H, T, X) with batch stride 0
            a = np.swapaxes(kernel_ready(a), 0, 1)
            return np.lib.stride_tricks.as_strided(a, (nb,) + a.shape, (0,) + a.strides)

        l4 = None
        if lse is not None:
            l4 = np.lib.stride_tricks.as_strided(lse, (nb,) + lse.shape, (0,) + lse.strides)
        _kernels.attention(
            batched(qa),
            batched(ka),
            batched(va),
            batched(o),
            l4,
            None,
            _kernels.MASK_NONE,
            sc,
            causal,
            wl,
            wr,
            cap,
            alibi,
            sk,
            None,
            None,
            cq,
            ck,
            None,
            1,
            1,
            threads,
            int(np.max(np.diff(cq))),
            int(np.max(np.diff(ck))),
            precision=prec,
        )
    elif lse is not None:
        lse[...] = -np.inf
    return (o, lse) if want_lse else o
