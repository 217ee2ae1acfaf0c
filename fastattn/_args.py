"""The argument layer: every check and normalisation of the attention front ends
(:func:`sdpa_call`, :func:`varlen_call`), building the kernel's call record
(:class:`fastattn._plan.Plan`).

"Validate now, run later": :func:`sdpa_call` and :func:`varlen_call` do every
check (raising ``TypeError``/``ValueError`` naming the argument) and allocate
the outputs; :meth:`fastattn._plan.Call.run` then checks nothing and only runs
the kernel.  A front end that must not change anything on bad input (the KV
cache appends) builds its call first and writes afterwards; the KV caches' own
checks are in fastattn._cache_args.

Layouts are normalised here once: the plan's arrays are bhsd views
``(*lead, H, L, X)`` (:func:`bhsd` swaps a bshd array's sequence and head axes,
without a copy); fastattn._plan merges or splits the leading dims.

Enum values (dtype codes, mask kinds, precision levels) come from the
extension, which reads them from csrc/fastattn.h (fastattn/_kernels.pxd).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._checks import (
    F32,
    F64,
    INT64_MAX,
    as_array,
    check_float,
    flag_value,
    int_bounds,
    int_value,
    kernel_ready,
    scale_value,
    threads_value,
)
from ._config import get_num_threads, precision_code
from ._plan import MASK_KINDS, Call, Plan
from ._quant import is_kv8
from ._quant import scale_value as kv_scale_value

Array: TypeAlias = npt.NDArray[Any]

__all__ = [
    "sdpa_call",
    "varlen_call",
]


# ---------------------------------------------------------------------------
# Checks


def compute_dtype(dt: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype the kernel computes (and writes the LSE) in: float64 or float32."""
    return F64 if dt == F64 else F32


def check_dtypes(
    q: Any, k: Any, v: Any, names: Sequence[str] = ("query", "key", "value"), allow_kv8: bool = False
) -> None:
    """Storage dtypes; all float64 when one is; key and value alike.  With ``allow_kv8``
    (the forward calls that take k_scale / v_scale) key and value may be 8-bit under a
    float32, float16 or bfloat16 query.  Reads ``.dtype`` only."""
    if q.dtype is F32 and k.dtype is F32 and v.dtype is F32:  # the common case, ~0.5 µs saved
        return
    if allow_kv8 and (is_kv8(k.dtype) or is_kv8(v.dtype)):  # 8-bit K/V (fastattn._quant) under a float query
        check_float(q, names[0])
        if q.dtype == F64:
            raise TypeError(
                f"{names[0]} must be float32, float16 or bfloat16 with 8-bit {names[1]} and "
                f"{names[2]}, got float64"
            )
        if k.dtype != v.dtype:
            raise TypeError(f"{names[1]} and {names[2]} must share a dtype, got {k.dtype} and {v.dtype}")
        return
    for a, n in zip((q, k, v), names):
        check_float(a, n)
    dts = (q.dtype, k.dtype, v.dtype)
    if F64 in dts and not all(d == F64 for d in dts):
        raise TypeError(
            f"{names[0]}, {names[1]} and {names[2]} must all be float64 when one is; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.dtype != v.dtype:
        raise TypeError(f"{names[1]} and {names[2]} must share a dtype, got {k.dtype} and {v.dtype}")


def check_heads(Hq: int, Hk: int, enable_gqa: bool = True, q: str = "query", kv: str = "key/value") -> None:
    """Hq query heads over Hk key/value heads: equal, or (grouped-query attention,
    with enable_gqa) a multiple."""
    if Hq == Hk and Hk > 0:
        return
    if Hq != Hk and not enable_gqa:
        raise ValueError(
            f"{q} has {Hq} heads but {kv} have {Hk}; pass enable_gqa=True for grouped-query attention"
        )
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"{q} heads ({Hq}) must be a multiple of {kv} heads ({Hk})")


def layout_value(layout: Any) -> str:
    if not isinstance(layout, str) or layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    return layout


def bhsd_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The bhsd view's shape of an array of ``shape`` in ``layout``."""
    if layout == "bshd":
        return shape[:-3] + (shape[-2], shape[-3], shape[-1])
    return shape


def bhsd(a: Array, layout: str) -> Array:
    """The bhsd view ``(..., H, L, X)`` of a bshd ``(..., L, H, X)`` array (no copy);
    bhsd arrays as they are.  The one place the two layouts meet."""
    return np.swapaxes(a, -2, -3) if layout == "bshd" else a


def check_shapes(
    q: Any, k: Any, v: Any, layout: str, enable_gqa: bool
) -> tuple[tuple[int, ...], tuple[int, int, int], tuple[int, int, int]]:
    """Shape checks (``.ndim``/``.shape`` only, so device arrays too).

    Returns ``(lead, (Hq, L, D), (Hk, S, Dv))`` of the bhsd view (2-D bhsd
    inputs are one head: lead ``()``)."""
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
    if layout == "bshd":
        qs, ks, vs = bhsd_shape(qs, layout), bhsd_shape(ks, layout), bhsd_shape(vs, layout)
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
        # Read only here (where it decides): a named TypeError for an array or a
        # string, instead of NumPy's "truth value is ambiguous" or a truthy "no".
        check_heads(Hq, Hk, flag_value(enable_gqa, "enable_gqa"))
    return lead, (Hq, L, D), (Hk, S, Dv)


def window_value(window: Any) -> tuple[int, int]:
    """``(left, right)``; ``(-1, -1)`` (unbounded) for None."""
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    # Up to 2**63 - 1 (sys.maxsize: "unbounded"); the kernel saturates i' +- bound.
    left = int_value(window[0], "window[0]", -1, INT64_MAX)
    right = int_value(window[1], "window[1]", -1, INT64_MAX)
    return left, right


def softcap_value(softcap: Any) -> float:
    """The softcap as a float; 0.0 (off) for None."""
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


def per_head(x: Any, name: str, lead: tuple[int, ...], Hq: int, allow_batch: bool) -> Array:
    """Contiguous float64 ``(*lead, Hq)`` table from a ``(Hq,)`` or (allow_batch)
    ``(*lead, Hq)`` argument."""
    a = as_array(x, name)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must be a real array, got dtype {a.dtype}")
    shapes = [(Hq,)] + ([lead + (Hq,)] if allow_batch else [])
    if a.shape not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {a.shape}")
    a = np.asarray(a, dtype=F64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite")
    return np.ascontiguousarray(np.broadcast_to(a, lead + (Hq,)))


def sinks_value(sinks: Any, Hq: int) -> Array | None:
    """Contiguous float64 ``(Hq,)`` sink logits, None for None."""
    return None if sinks is None else per_head(sinks, "sinks", (), Hq, False)


def lengths(x: Any, name: str, lead: tuple[int, ...], limit: int) -> Array:
    """Contiguous int64 lengths of the batch dims' shape ``lead``, in ``[0, limit]``."""
    a = as_array(x, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.shape != lead:
        raise ValueError(f"{name} must have shape {lead} (the batch dims), got {a.shape}")
    if a.size:
        lo, hi = int_bounds(a)
        if lo < 0 or hi > limit:
            raise ValueError(f"{name} values must lie in [0, {limit}], got range [{lo}, {hi}]")
    return np.ascontiguousarray(a, dtype=np.int64)


def mask_value(attn_mask: Any, shape: tuple[int, ...], cdt: np.dtype[Any]) -> tuple[Array | None, int]:
    """(mask, kind): attn_mask as a read-only broadcast view of ``shape`` (bool,
    float32 or float64; other floats converted to cdt) and its kernel code;
    ``(None, FA_MASK_NONE)`` when there is none."""
    if attn_mask is None:
        return None, _kernels.FA_MASK_NONE
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
    return mask, MASK_KINDS[mask.dtype]


def block_mask_value(
    block_mask: Any, block_size: Any, lead: tuple[int, ...], Hq: int, L: int, S: int
) -> tuple[Array | None, int, int]:
    """(bmask, bm_q, bm_k): the block-sparse pattern as a broadcast bool view of
    ``(*lead, Hq, ceil(L/bq), ceil(S/bk))``; ``(None, 1, 1)`` when there is none."""
    if block_mask is None and block_size is None:
        return None, 1, 1
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
        # Read in place through broadcasting strides (the kernel takes a stride per dim).
        return np.broadcast_to(bm, lead + (Hq, nbq, nbk)), bm_q, bm_k
    except ValueError:
        raise ValueError(
            f"block_mask of shape {bm.shape} does not broadcast to "
            f"{lead + (Hq, nbq, nbk)} (blocks of {bm_q}x{bm_k})"
        ) from None


def dropout_p_value(dropout_p: Any) -> float:
    """A dropout probability: a real number in [0, 1] (torch's range)."""
    if type(dropout_p) is not float and type(dropout_p) is not int:  # (exact types: the common case)
        if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
            raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    return p


def dropout_value(dropout_p: Any, dropout_seed: Any) -> tuple[float, int]:
    """``(p, seed)`` of attention dropout (csrc/dropout.h): ``dropout_p`` in [0, 1];
    ``dropout_seed`` an integer in [0, 2**64), required when ``dropout_p > 0``
    (the backward regenerates the forward's mask from it), checked when given."""
    p = dropout_p_value(dropout_p)
    seed = 0
    if dropout_seed is not None:
        if isinstance(dropout_seed, (bool, np.bool_)) or not isinstance(dropout_seed, numbers.Integral):
            raise TypeError(f"dropout_seed must be an int, got {type(dropout_seed).__name__}")
        seed = int(dropout_seed)
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"dropout_seed must be in [0, 2**64), got {seed}")
    elif p > 0:
        raise ValueError(
            "dropout_seed is required when dropout_p > 0 (an int in [0, 2**64): the backward "
            "passes the same seed to regenerate the forward's dropout mask)"
        )
    return p, seed


def no_dropout(dropout_p: Any, where: str) -> None:
    """``dropout_p`` must be 0 where fastattn has no dropout (``where`` says which call)."""
    if dropout_p_value(dropout_p) != 0:
        raise NotImplementedError(f"dropout_p must be 0 {where}: fastattn has no dropout there")


def check_out(
    out: Any,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    inputs: Sequence[tuple[Any, str]],
    *,
    contiguous: bool = False,
) -> Array:
    """``out``: a writable NumPy array of ``shape`` and ``dtype`` sharing no memory
    with ``inputs`` ((array or None, name) pairs).  With ``contiguous``, C-contiguous
    (the packed layouts)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if contiguous:
        if out.shape != shape or out.dtype != dtype:
            raise ValueError(f"out must have shape {shape} and dtype {dtype}, got {out.shape} {out.dtype}")
        if not out.flags.writeable or not out.flags.c_contiguous:
            raise ValueError("out must be writable and C-contiguous")
    else:
        if out.shape != shape:
            raise ValueError(f"out must have shape {shape}, got {out.shape}")
        if out.dtype != dtype:
            raise TypeError(f"out must have dtype {dtype}, got {out.dtype}")
        if not out.flags.writeable:
            raise ValueError("out must be writable")
    for a, n in inputs:
        if a is not None and np.may_share_memory(out, a):
            raise ValueError(f"out must not share memory with {n}")
    return out


# ---------------------------------------------------------------------------
# Front ends' calls


def sdpa_call(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    is_causal: Any = False,
    scale: Any = None,
    enable_gqa: Any = False,
    layout: Any = "bhsd",
    return_lse: Any = False,
    out: Any = None,
    num_threads: Any = None,
    window: Any = None,
    alibi_slopes: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    key_lengths: Any = None,
    query_lengths: Any = None,
    block_mask: Any = None,
    block_size: Any = None,
    precision: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> Call:
    """Every check of :func:`fastattn.scaled_dot_product_attention` (CPU; dropout
    and device are the caller's) and its outputs, as a :class:`Call`.  The
    arguments are that function's, in its order (positional-or-keyword: binding
    20 keywords costs ~1 µs per call)."""
    prec = precision_code(precision)
    layout = layout_value(layout)
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
    q = as_array(query, "query")
    k = as_array(key, "key")
    v = as_array(value, "value")
    check_dtypes(q, k, v, allow_kv8=True)
    lead, (Hq, L, D), (Hk, S, Dv) = check_shapes(q, k, v, layout, enable_gqa)
    seq_axis = -2 if layout == "bhsd" else -3
    ks = kv_scale_value(k_scale, "k_scale", k, seq_axis, "key")
    vs = kv_scale_value(v_scale, "v_scale", v, seq_axis, "value")
    cdt = compute_dtype(q.dtype)
    sc = scale_value(scale, D, cdt)
    threads = threads_value(num_threads, get_num_threads)
    wl, wr = (-1, -1) if window is None else window_value(window)
    cap = 0.0 if softcap is None else softcap_value(softcap)
    # lead1: the plan's leading dims (at least one; () for one head or a 3-D input).
    lead1 = lead or (1,)
    mask, mask_kind = mask_value(attn_mask, lead + (Hq, L, S), cdt)
    alibi = None
    if alibi_slopes is not None:
        alibi = per_head(alibi_slopes, "alibi_slopes", lead, Hq, True).reshape(lead1 + (Hq,))
    sk = None if sinks is None else sinks_value(sinks, Hq)
    k_lens = q_lens = None
    if key_lengths is not None:
        k_lens = lengths(key_lengths, "key_lengths", lead, S).reshape(lead1)
    if query_lengths is not None:
        q_lens = lengths(query_lengths, "query_lengths", lead, L).reshape(lead1)
    bmask, bm_q, bm_k = None, 1, 1
    if block_mask is not None or block_size is not None:
        bmask, bm_q, bm_k = block_mask_value(block_mask, block_size, lead, Hq, L, S)

    out_shape = q.shape[:-1] + (Dv,)
    if out is not None:
        # The converted arrays (a torch tensor or other array-like mask included).
        ins = ((q, "query"), (k, "key"), (v, "value"), (mask, "attn_mask"), (bmask, "block_mask"))
        res = check_out(out, out_shape, q.dtype, ins)
        direct = out.dtype.isnative and out.flags.aligned and (Dv == 1 or out.strides[-1] == out.itemsize)
        work = out if direct else np.empty(out_shape, dtype=q.dtype)
    else:
        res = work = np.empty(out_shape, dtype=q.dtype)
    lse = np.empty(lead + (Hq, L), dtype=cdt) if want_lse else None

    def view(a: Array) -> Array:  # the plan's (*lead1, H, L, X) view
        a = bhsd(a, layout)
        if a.ndim == 2:  # one head
            a = a[None]
        return a if lead else a[None]

    plan = Plan(
        q=kernel_ready(view(q)),
        k=kernel_ready(view(k)),
        v=kernel_ready(view(v)),
        o=view(work),
        k_scale=None if ks is None else view(ks),
        v_scale=None if vs is None else view(vs),
        lse=None if lse is None else (lse if lead else lse[None]),
        mask=None if mask is None else (mask if lead else mask[None]),
        mask_kind=mask_kind,
        scale=sc,
        causal=causal,
        window_left=wl,
        window_right=wr,
        softcap=cap,
        alibi=alibi,
        sinks=sk,
        q_lens=q_lens,
        k_lens=k_lens,
        bmask=None if bmask is None else (bmask if lead else bmask[None]),
        bm_q=bm_q,
        bm_k=bm_k,
        num_threads=threads,
        precision=prec,
        L=L,
        S=S,
    )
    return Call(plan, res, work, lse, None if lse is None or q.ndim != 2 else lse[0])


def cu_seqlens_value(cu: Any, name: str, T: int) -> Array:
    """A packed batch's cumulative sequence lengths: 1-D integers from 0 to ``T``,
    non-decreasing, as contiguous int64."""
    c = as_array(cu, name)
    if c.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {c.dtype}")
    if c.ndim != 1 or c.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with at least one entry, got shape {c.shape}")
    c = np.ascontiguousarray(c, dtype=np.int64)
    if c[0] != 0 or np.any(np.diff(c) < 0):
        raise ValueError(f"{name} must start at 0 and be non-decreasing")
    if c[-1] != T:
        raise ValueError(f"{name}[-1] must equal the packed length {T}, got {c[-1]}")
    return c


def varlen_geometry(
    qa: Any, ka: Any, va: Any, enable_gqa: bool, cu_seqlens_q: Any, cu_seqlens_k: Any
) -> tuple[int, int, int, int, int, int, Array, Array]:
    """The operand checks of :func:`fastattn.varlen_attention`, in its order, on packed
    ``(total_tokens, heads, head_dim)`` arrays (NumPy, or Dask for ``fastattn.dask``):
    ``(Tq, Hq, D, Tk, Hk, Dv, cu_q, cu_k)``."""
    check_dtypes(qa, ka, va, ("q", "k", "v"), allow_kv8=True)
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
        check_heads(Hq, Hk, enable_gqa, "q", "k/v")
    cq = cu_seqlens_value(cu_seqlens_q, "cu_seqlens_q", Tq)
    ck = cu_seqlens_value(cu_seqlens_k, "cu_seqlens_k", Tk)
    if cq.shape != ck.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cq.shape[0]} and {ck.shape[0]}"
        )
    return Tq, Hq, D, Tk, Hk, Dv, cq, ck


def varlen_call(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    is_causal: Any = False,
    scale: Any = None,
    enable_gqa: Any = False,
    window: Any = None,
    alibi_slopes: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    return_lse: Any = False,
    out: Any = None,
    num_threads: Any = None,
    precision: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> Call:
    """Every check of :func:`fastattn.varlen_attention` and its outputs, as a :class:`Call`."""
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
    qa, ka, va = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    Tq, Hq, D, Tk, Hk, Dv, cq, ck = varlen_geometry(qa, ka, va, enable_gqa, cu_seqlens_q, cu_seqlens_k)
    ks = kv_scale_value(k_scale, "k_scale", ka, -3, "k")
    vs = kv_scale_value(v_scale, "v_scale", va, -3, "v")
    nb = cq.shape[0] - 1
    prec = precision_code(precision)
    cdt = compute_dtype(qa.dtype)
    sc = scale_value(scale, D, cdt)
    threads = threads_value(num_threads, get_num_threads)
    wl, wr = window_value(window)
    cap = softcap_value(softcap)
    alibi = None if alibi_slopes is None else per_head(alibi_slopes, "alibi_slopes", (nb,), Hq, True)
    sk = sinks_value(sinks, Hq)
    if out is not None:
        o = check_out(out, (Tq, Hq, Dv), qa.dtype, ((qa, "q"), (ka, "k"), (va, "v")), contiguous=True)
    else:
        o = np.empty((Tq, Hq, Dv), dtype=qa.dtype)
    lse = np.empty((Hq, Tq), dtype=cdt) if want_lse else None
    if nb == 0 or Tq == 0:
        return Call(None, o, o, lse)

    # (x, y, z) -> (nb, x, y, z) with batch stride 0: a broadcast view, for any dtype (as_strided
    # cannot take ml_dtypes' fp8); read-only to NumPy, the kernel writes the output through it.
    def repeat(a: Array) -> Array:
        return np.broadcast_to(a[None], (nb,) + a.shape)

    def batched(a: Array) -> Array:  # (T, H, X) -> (nb, H, T, X): each batch sees every token
        return repeat(bhsd(kernel_ready(a), "bshd"))

    plan = Plan(
        q=batched(qa),
        k=batched(ka),
        v=batched(va),
        o=batched(o),
        k_scale=None if ks is None else repeat(bhsd(ks, "bshd")),
        v_scale=None if vs is None else repeat(bhsd(vs, "bshd")),
        lse=None if lse is None else repeat(lse),
        scale=sc,
        causal=causal,
        window_left=wl,
        window_right=wr,
        softcap=cap,
        alibi=alibi,
        sinks=sk,
        cu_q=cq,
        cu_k=ck,
        num_threads=threads,
        precision=prec,
        # The longest sequences: the packed lengths Tq, Tk are the arrays'.
        L=int(np.max(np.diff(cq))),
        S=int(np.max(np.diff(ck))),
    )
    return Call(plan, o, o, lse)
