"""The argument layer: every check and normalisation of the attention front ends,
and the one call record the kernel binding reads (:class:`Plan`).

"Validate now, run later": :func:`sdpa_call` and :func:`varlen_call` do every
check (raising ``TypeError``/``ValueError`` naming the argument) and allocate
the outputs; :meth:`Call.run` then checks nothing and only runs the kernel.  A
front end that must not change anything on bad input (the KV cache appends)
builds its call first and writes afterwards.

Layouts are normalised here once: the plan's arrays are bhsd views
``(*lead, H, L, X)`` (:func:`bhsd` swaps a bshd array's sequence and head axes,
without a copy); :func:`kernel_plans` merges the leading dims into the one
batch dim the kernel reads, or splits the plan along its first leading dim
where strides do not allow that (:func:`split`), using each field's
``per_batch`` metadata so that no list of per-batch options is kept by hand.
The merge/split reads only ``.shape`` and element strides, so a plan may also
hold device views (see :class:`DeviceView`).

Enum values (dtype codes, mask kinds, precision levels) come from the
extension, which reads them from csrc/fastattn.h (fastattn/_kernels.pxd).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._checks import (
    F32,
    F64,
    INT64_MAX,
    as_array,
    bfloat16_dtype,
    check_float,
    flag_value,
    int_value,
    is_bfloat16,
    is_storage_dtype,
    kernel_ready,
    scale_value,
    threads_value,
)
from ._config import get_num_threads, precision_code

Array: TypeAlias = npt.NDArray[Any]

__all__ = [
    "Plan",
    "Call",
    "DeviceView",
    "kernel_plans",
    "split",
    "merged_stride",
    "run",
    "sdpa_call",
    "varlen_call",
]

# metadata key of a Plan field: the number of trailing (non-batch) dims of a
# per-batch array; fields without it are shared by every batch element.
PER_BATCH = "per_batch"

MASK_KINDS: dict[np.dtype[Any], int] = {
    np.dtype(np.bool_): _kernels.FA_MASK_BOOL,
    F32: _kernels.FA_MASK_F32,
    F64: _kernels.FA_MASK_F64,
}


def _batch_field(core: int) -> Any:
    """An optional per-batch Plan field: ``(*lead, <core trailing dims>)`` (None: absent)."""
    return field(default=None, metadata={PER_BATCH: core})


@dataclass(slots=True)
class Plan:
    """One kernel call, checked: the fields of ``fa_params`` (csrc/fastattn.h) by name.

    Arrays are bhsd views with the same leading dims ``lead`` (at least one):
    ``q (*lead, Hq, L, D)``, ``k (*lead, Hk, S, D)``, ``v (*lead, Hk, S, Dv)``,
    ``o (*lead, Hq, L, Dv)`` (written), ``lse (*lead, Hq, L)`` (written),
    ``mask (*lead, Hq, L, S)`` (broadcast strides), ``alibi (*lead, Hq)``
    float64, ``q_lens``/``k_lens (*lead)`` int64, ``bmask (*lead, Hq, nbq, nbk)``
    bool; ``sinks (Hq,)`` float64 and ``cu_q``/``cu_k (B + 1,)`` int64 are
    shared by every batch element.  The binding reads 4-D plans (one leading
    dim: the batch B), :func:`kernel_plans` makes them.  Every array's last
    dimension is contiguous (or of size 1), pointers and strides aligned.

    ``L`` and ``S`` are the query and key lengths the kernel iterates over: the
    arrays' lengths, except for packed variable-length batches (``cu_q``,
    ``cu_k``), where they are the longest sequence's.

    Field order: the fields every call sets come first, so that the small-call
    fast path can pass them by position (binding 10 keywords of a 25-field
    ``__init__`` costs ~0.8 µs more); every other caller passes keywords.
    """

    q: Any = field(metadata={PER_BATCH: 3})
    k: Any = field(metadata={PER_BATCH: 3})
    v: Any = field(metadata={PER_BATCH: 3})
    o: Any = field(metadata={PER_BATCH: 3})
    scale: float
    L: int
    S: int
    num_threads: int
    precision: int
    causal: bool = False
    lse: Any = _batch_field(2)
    mask: Any = _batch_field(3)
    mask_kind: int = _kernels.FA_MASK_NONE
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: Any = _batch_field(1)
    sinks: Array | None = None
    q_lens: Any = _batch_field(0)
    k_lens: Any = _batch_field(0)
    cu_q: Array | None = None
    cu_k: Array | None = None
    bmask: Any = _batch_field(3)
    bm_q: int = 1
    bm_k: int = 1


# (name, trailing dims) of the per-batch fields, read from the metadata once.
PER_BATCH_FIELDS: tuple[tuple[str, int], ...] = tuple(
    (f.name, f.metadata[PER_BATCH]) for f in dataclasses.fields(Plan) if PER_BATCH in f.metadata
)


_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))


def replace(plan: Plan, changes: dict[str, Any]) -> Plan:
    """``dataclasses.replace(plan, **changes)`` without its checks (~3 µs less: the
    fields are Plan's own, already checked)."""
    new = object.__new__(Plan)
    for n in _PLAN_FIELDS:
        setattr(new, n, changes[n] if n in changes else getattr(plan, n))
    return new


# ---------------------------------------------------------------------------
# Leading dims: the one merge / split


class DeviceView(Protocol):
    """What a non-NumPy plan array (fastattn.cuda's device views) provides:
    ``shape``, ``strides`` in elements, ``item(i)`` (the view of ``self[i]``)
    and ``restrided(shape, strides)`` (a view of the same memory)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    def item(self, i: int) -> DeviceView: ...
    def restrided(self, shape: tuple[int, ...], strides: tuple[int, ...]) -> DeviceView: ...


def element_strides(a: Any) -> tuple[int, ...]:
    """Strides in elements (NumPy's are in bytes; a device view's already in elements)."""
    if isinstance(a, np.ndarray):
        item = a.itemsize
        return tuple(s // item for s in a.strides)
    return tuple(a.strides)


def merged_stride(shape: Sequence[int], strides: Sequence[int]) -> int | None:
    """The one stride that walks dims ``shape`` (element ``strides``) in C order as
    a single dim, or None when they do not merge.  Dims of size 1 do not count;
    an empty shape merges (into a dim of size 1)."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not dims or any(n == 0 for n, _ in dims):
        return 0 if not dims else dims[-1][1]
    for (_, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            return None
    return dims[-1][1]


def _merged_view(a: Any, nl: int) -> Any:
    """``a`` with its first ``nl`` dims as one, as a view of the same memory; None when
    their strides do not merge."""
    shape = (math.prod(a.shape[:nl]),) + tuple(a.shape[nl:])
    if isinstance(a, np.ndarray):
        if _NUMPY_RESHAPE_COPY:  # NumPy decides in C (the same rule as merged_stride)
            try:
                return np.reshape(a, shape, copy=False)
            except ValueError:
                return None
        if merged_stride(a.shape[:nl], element_strides(a)[:nl]) is None:
            return None
        return a.reshape(shape)  # strides that merge: NumPy's reshape is a view
    sb = merged_stride(a.shape[:nl], element_strides(a)[:nl])
    return None if sb is None else a.restrided(shape, (sb,) + element_strides(a)[nl:])


# np.reshape(copy=False) (NumPy >= 2.1) raises instead of copying.
_NUMPY_RESHAPE_COPY = "copy" in getattr(np.reshape, "__text_signature__", "") or tuple(
    int(x) for x in np.__version__.split(".")[:2]
) >= (2, 1)


def _item(a: Any, i: int) -> Any:
    return a[i] if isinstance(a, np.ndarray) else a.item(i)


def split(plan: Plan) -> Iterator[Plan]:
    """The plans of ``plan[i]`` for each index i of the first leading dim: every
    per-batch field indexed, the others shared."""
    arrays = [(n, getattr(plan, n)) for n, _ in PER_BATCH_FIELDS]
    for i in range(plan.q.shape[0]):
        yield replace(plan, {n: _item(a, i) for n, a in arrays if a is not None})


def kernel_plans(plan: Plan) -> Iterator[Plan]:
    """4-D plans (one leading dim) covering ``plan``: its leading dims merged into
    one where every per-batch array's strides allow it (views, no copies), else
    one plan per index of the first leading dim, recursively.  Outputs are
    written in place and masks read through their broadcast strides, so a
    merge never copies; a split only costs more kernel calls."""
    nl = len(plan.q.shape) - 3
    if nl == 1:
        yield plan
        return
    merged: dict[str, Any] = {}
    for n, _ in PER_BATCH_FIELDS:
        a = getattr(plan, n)
        if a is None:
            continue
        m = _merged_view(a, nl)
        if m is None:
            for sub in split(plan):
                yield from kernel_plans(sub)
            return
        merged[n] = m
    yield replace(plan, merged)


def run(plan: Plan) -> None:
    """Run a checked plan on the CPU kernel (no checks here)."""
    if plan.q.ndim == 4:  # the common case: nothing to merge
        _kernels.attention(plan)
        return
    for p in kernel_plans(plan):
        _kernels.attention(p)


@dataclass(slots=True)
class Call:
    """A checked call: its plan (None when there is nothing to compute) and what
    :meth:`run` returns.  ``work`` is the array the kernel writes, ``result``
    the one returned (``out`` when the kernel cannot write ``out`` directly)."""

    plan: Plan | None
    result: Array
    work: Array
    lse: Array | None = None
    lse_result: Array | None = None

    def with_queries(self, q: Array) -> Call:
        """The same call on other queries of the plan's q's bhsd shape and dtype (the KV
        cache's rotated queries, made after every check: all other checks stand)."""
        assert self.plan is not None and q.shape == self.plan.q.shape and q.dtype == self.plan.q.dtype
        return dataclasses.replace(self, plan=replace(self.plan, {"q": kernel_ready(q)}))

    def run(self) -> Any:
        """Run the kernel; the result (and the LSE when asked for)."""
        if self.plan is not None:
            run(self.plan)
        elif self.lse is not None:
            self.lse[...] = -np.inf
        if self.work is not self.result:
            self.result[...] = self.work
        if self.lse is None:
            return self.result
        return self.result, self.lse if self.lse_result is None else self.lse_result


# ---------------------------------------------------------------------------
# Checks


def compute_dtype(dt: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype the kernel computes (and writes the LSE) in: float64 or float32."""
    return F64 if dt == F64 else F32


def check_dtypes(q: Any, k: Any, v: Any, names: Sequence[str] = ("query", "key", "value")) -> None:
    """Storage dtypes; all float64 when one is; key and value alike.  Reads ``.dtype`` only."""
    if q.dtype is F32 and k.dtype is F32 and v.dtype is F32:  # the common case, ~0.5 µs saved
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
        check_heads(Hq, Hk, enable_gqa)
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
    if a.size and (a.min() < 0 or a.max() > limit):
        raise ValueError(f"{name} values must lie in [0, {limit}], got range [{a.min()}, {a.max()}]")
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


def dropout_value(dropout_p: Any) -> None:
    """dropout_p must be 0 (an inference library)."""
    if type(dropout_p) is not float and type(dropout_p) is not int:  # (exact types: the common case)
        if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
            raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise NotImplementedError("dropout_p must be 0: fastattn is an inference library")


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
    check_dtypes(q, k, v)
    lead, (Hq, L, D), (Hk, S, Dv) = check_shapes(q, k, v, layout, enable_gqa)
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


def _cu_seqlens(cu: Any, name: str, T: int) -> Array:
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
) -> Call:
    """Every check of :func:`fastattn.varlen_attention` and its outputs, as a :class:`Call`."""
    causal = flag_value(is_causal, "is_causal")
    want_lse = flag_value(return_lse, "return_lse")
    qa, ka, va = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    check_dtypes(qa, ka, va, ("q", "k", "v"))
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
    cq = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", Tq)
    ck = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", Tk)
    if cq.shape != ck.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cq.shape[0]} and {ck.shape[0]}"
        )
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

    def repeat(a: Array) -> Array:  # (x, y, z) -> (nb, x, y, z) with batch stride 0
        return np.lib.stride_tricks.as_strided(a, (nb,) + a.shape, (0,) + a.strides)

    def batched(a: Array) -> Array:  # (T, H, X) -> (nb, H, T, X): each batch sees every token
        return repeat(bhsd(kernel_ready(a), "bshd"))

    plan = Plan(
        q=batched(qa),
        k=batched(ka),
        v=batched(va),
        o=batched(o),
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


# ---------------------------------------------------------------------------
# Key/value caches


def is_real_float(dt: np.dtype[Any]) -> bool:
    return dt.kind == "f" or is_bfloat16(dt)


def query_dtype_ok(qdt: np.dtype[Any], cdt: np.dtype[Any]) -> bool:
    """Queries may be float32 or the cache dtype (float64 caches need float64 queries)."""
    if cdt == F64:
        return qdt == F64
    return qdt == F32 or qdt == cdt


def query_dtypes(cdt: np.dtype[Any]) -> str:
    """The query dtypes a cache of dtype cdt takes, in words (for error messages)."""
    return cdt.name if cdt in (F32, F64) else f"float32 or {cdt}"


def cache_dtype_ok(cdt: np.dtype[Any]) -> bool:
    return is_storage_dtype(cdt)


def _progression(idx: Array) -> tuple[int, int] | None:
    """(start, step) when idx is start, start+step, ... with step >= 1 (a strided view suffices)."""
    if idx.size == 1:
        return int(idx[0]), 1
    d = np.diff(idx)
    if d[0] >= 1 and np.all(d == d[0]):
        return int(idx[0]), int(d[0])
    return None


def row_view(a: Array, idx: Array | None) -> Array | None:
    """``a[idx]`` as a view when idx is an arithmetic progression, else None."""
    if idx is None:
        return a
    if idx.size == 0:
        return a[:0]
    pr = _progression(idx)
    if pr is None:
        return None
    start, step = pr
    return a[start : start + step * (idx.size - 1) + 1 : step]


def cache_dtype_value(dtype: Any) -> np.dtype[Any]:
    """A KV cache's storage dtype: float16, bfloat16, float32 or float64 (``"bfloat16"`` by name too)."""
    try:
        dt = bfloat16_dtype() if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype!r}") from None
    if not is_storage_dtype(dt):
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dt}")
    return dt


def batch_indices(batch_index: Any, B: int, name: str = "batch_index") -> Array | None:
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


def new_tokens(x: Any, name: str, layout: str) -> Array:
    """New keys or values to append: a real floating 4-D array (in ``layout``)."""
    a = as_array(x, name)
    if not is_real_float(a.dtype):
        raise TypeError(f"{name} must be a real floating array, got dtype {a.dtype}")
    if a.ndim != 4:
        raise ValueError(f"{name} must be 4-D ({layout}), got shape {a.shape}")
    return a


def cache_tokens(x: Any, name: str, n: int, Hk: int, Dx: int, allow_3d: bool) -> Array:
    """One block of new keys/values for a KVCache: shape (n, Hk, T, Dx) (or (Hk, T, Dx)
    with allow_3d), real floating; returns it as an array."""
    a = as_array(x, name)
    if not is_real_float(a.dtype):
        raise TypeError(f"{name} must be a real floating array, got dtype {a.dtype}")
    if allow_3d and a.ndim == 3:
        a = a[None]
    if a.ndim != 4 or a.shape[0] != n or a.shape[1] != Hk or a.shape[3] != Dx:
        want = f"({n}, {Hk}, T, {Dx})" + (f" or ({Hk}, T, {Dx})" if allow_3d else "")
        raise ValueError(f"{name} must have shape {want}, got {np.shape(x)}")
    return a


def _max_finite(dt: np.dtype[Any]) -> float:
    if dt == F64 or dt == F32 or dt.kind == "f":
        return float(np.finfo(dt).max)
    import ml_dtypes  # bfloat16 (untyped)

    finfo: Any = ml_dtypes.finfo
    return float(finfo(dt).max)


def rotation_fits(k: Array, dt: np.dtype[Any]) -> bool:
    """True when rotating k's values (each output is x*cos -/+ y*sin of a pair, at most
    sqrt(2) * max|k| in magnitude) cannot overflow the cache dtype dt."""
    if k.size == 0:
        return True
    with np.errstate(invalid="ignore"):
        a = np.abs(k.astype(F64) if k.dtype != F64 else k)
    m = float(np.max(a, where=np.isfinite(a), initial=0.0))
    return m * 1.4142136 < _max_finite(dt) * 0.999


def to_cache_dtype(
    a: Array,
    dt: np.dtype[Any],
    name: str,
    rot: Any = None,
    pos: Array | None = None,
    num_threads: int | None = None,
) -> Array:
    """``a`` converted to the cache dtype ``dt`` (rotated at ``pos`` first with ``rot``, a
    fastattn.positions cache rotary); ValueError when a finite value becomes inf (beyond
    the dtype's range), so that nothing is lost silently.  Called before any write."""
    if rot is not None:
        from . import positions

        rotate: Any = positions.rotate  # (Any: typed or not, positions is another module's)
        contiguous: Any = positions._last_contiguous
        src = a if is_storage_dtype(a.dtype) else a.astype(rot.cos.dtype)
        c = np.empty(a.shape, dtype=dt)
        with np.errstate(over="ignore", invalid="ignore"):
            rotate(contiguous(src), c, pos, rot.cos, rot.sin, rot.interleaved, num_threads)
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


def seqlens_value(x: Any, name: str, B: int, limit: int | None = None, note: str = "") -> Array:
    """Per-sequence lengths from an int or a ``(B,)`` (or 0-D) integer array, as int64
    ``(B,)``; with ``limit``, each in ``[0, limit]``."""
    if isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)):
        if limit is not None and not 0 <= int(x) <= limit:  # before np.full: beyond int64 is OverflowError
            raise ValueError(f"{name} must lie in [0, {limit}], got {x}")
        return np.full(B, int(x), dtype=np.int64)
    a = as_array(x, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int or an integer array, got dtype {a.dtype}")
    if a.ndim == 0:
        a = np.broadcast_to(a, (B,))
    if a.shape != (B,):
        raise ValueError(f"{name} must have shape ({B},){note}, got {a.shape}")
    seq = a.astype(np.int64)
    if limit is not None and seq.size and (seq.min() < 0 or seq.max() > limit):
        raise ValueError(f"{name} values must lie in [0, {limit}], got range [{seq.min()}, {seq.max()}]")
    return seq


def cache_operands(
    qa: Array, k_cache: Any, v_cache: Any, cache_seqlens: Any, k_new: Any, v_new: Any, lay: str
) -> tuple[Array, Array, Array, Array, Array | None, Array | None]:
    """The operand checks of :func:`fastattn.attention_with_kvcache`: caller-owned
    caches, their lengths and the new tokens (all before anything is written).

    Returns the bhsd views ``(q, k_cache, v_cache)``, the int64 ``cache_seqlens``
    and the bhsd new keys and values (None without them)."""
    if not isinstance(k_cache, np.ndarray):
        raise TypeError(f"k_cache must be a numpy.ndarray, got {type(k_cache).__name__}")
    if not isinstance(v_cache, np.ndarray):
        raise TypeError(f"v_cache must be a numpy.ndarray, got {type(v_cache).__name__}")
    cdt = k_cache.dtype
    if not is_storage_dtype(cdt):
        raise TypeError(f"k_cache must have dtype float16, bfloat16, float32 or float64, got {cdt}")
    if v_cache.dtype != cdt:
        raise TypeError(f"v_cache must have the dtype of k_cache ({cdt}), got {v_cache.dtype}")
    if not query_dtype_ok(qa.dtype, cdt):
        raise TypeError(f"q must have dtype {query_dtypes(cdt)} for {cdt} caches, got {qa.dtype}")
    for a, name in ((qa, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D ({lay}), got shape {a.shape}")
    qh, kc, vc = bhsd(qa, lay), bhsd(k_cache, lay), bhsd(v_cache, lay)
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
    check_heads(Hq, Hk, True, "q", "the cache's kv")
    seq = seqlens_value(cache_seqlens, "cache_seqlens", B, S)

    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    kn = vn = None
    if k_new is not None:
        k_given, v_given = new_tokens(k_new, "k_new", lay), new_tokens(v_new, "v_new", lay)
        kn, vn = bhsd(k_given, lay), bhsd(v_given, lay)
        if kn.shape[:2] != (B, Hk) or kn.shape[3] != D:
            raise ValueError(
                f"k_new must have {B} sequences, {Hk} heads and head dim {D}, got {k_given.shape}"
            )
        if vn.shape[:2] != (B, Hk) or vn.shape[3] != Dv:
            raise ValueError(
                f"v_new must have {B} sequences, {Hk} heads and head dim {Dv}, got {v_given.shape}"
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
    return qh, kc, vc, seq, kn, vn


# ---------------------------------------------------------------------------
# The names fastattn.cuda and fastattn.dask import (their former home was
# fastattn.functional), with their former return shapes: per-head tables and
# lengths flattened to (B, ...).


def _per_head(x: Any, name: str, lead: tuple[int, ...], Hq: int, allow_batch: bool) -> Array:
    return per_head(x, name, lead, Hq, allow_batch).reshape(math.prod(lead), Hq)


def _lengths(x: Any, name: str, lead: tuple[int, ...], limit: int) -> Array:
    return lengths(x, name, lead, limit).reshape(-1)


_check_dtypes = check_dtypes
_check_shapes = check_shapes
_window = window_value
_softcap = softcap_value
