"""The kernel's call record, :class:`Plan`, and the leading-dimension merge/split.

A :class:`Plan` holds one checked kernel call (fastattn._args builds it, for
the CPU front ends and fastattn.cuda alike); :meth:`Call.run` then checks
nothing and only runs the kernel.

Layouts are normalised once, by the argument layer: the plan's arrays are bhsd
views ``(*lead, H, L, X)``; :func:`kernel_plans` merges the leading dims into
the one batch dim the kernel reads, or splits the plan along its first leading
dim where strides do not allow that (:func:`split`), using each field's
``per_batch`` metadata so that no list of per-batch options is kept by hand.
The merge/split reads only ``.shape`` and element strides, so a plan may also
hold device views (see :class:`DeviceView`).

Enum values (mask kinds) come from the extension, which reads them from
csrc/fastattn.h (fastattn/_kernels.pxd).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._checks import (
    F32,
    F64,
    kernel_ready,
)

Array: TypeAlias = npt.NDArray[Any]


__all__ = [
    "Plan",
    "Call",
    "DeviceView",
    "MASK_KINDS",
    "PER_BATCH_FIELDS",
    "element_strides",
    "kernel_plans",
    "merged_stride",
    "replace",
    "run",
    "split",
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
    ``k_scale``/``v_scale (*lead, Hk, S, D or Dv)`` float32 broadcast views (the
    scales of 8-bit K/V: per token, channel or head), ``mask (*lead, Hq, L,
    S)`` (broadcast strides), ``alibi (*lead, Hq)``
    float64, ``q_lens``/``k_lens (*lead)`` int64, ``bmask (*lead, Hq, nbq, nbk)``
    bool; ``sinks (Hq,)`` float64 and ``cu_q``/``cu_k (B + 1,)`` int64 are
    shared by every batch element.  The binding reads 4-D plans (one leading
    dim: the batch B), :func:`kernel_plans` makes them.  Every array's last
    dimension is contiguous (or of size 1), pointers and strides aligned.

    ``L`` and ``S`` are the query and key lengths the kernel iterates over: the
    arrays' lengths, except for packed variable-length batches (``cu_q``,
    ``cu_k``), where they are the longest sequence's.

    Paged K/V (``block_table (B, max_pages)`` int32, ``page_size``): ``k``,
    ``v`` (and per-token ``k_scale``/``v_scale``) are then the page pools,
    ``(num_pages, Hk, page_size, X)`` bhsd views, not per-batch arrays, and
    the plan is 4-D (fastattn._paged builds it).

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
    k_scale: Any = _batch_field(3)
    v_scale: Any = _batch_field(3)
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
    block_table: Array | None = None
    page_size: int = 0
    bmask: Any = _batch_field(3)
    bm_q: int = 1
    bm_k: int = 1
    # Attention dropout (csrc/fastattn.h): probability, Philox key, and the flat
    # index (over the caller's leading dims) of this plan's batch 0, so that a
    # split plan (split) draws the mask of the whole call's batch elements.
    dropout_p: float = 0.0
    dropout_seed: int = 0
    dropout_b0: int = 0


# (name, trailing dims) of the per-batch fields, read from the metadata once.
PER_BATCH_FIELDS: tuple[tuple[str, int], ...] = tuple(
    (f.name, f.metadata[PER_BATCH]) for f in dataclasses.fields(Plan) if PER_BATCH in f.metadata
)


_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))
# Every field's value at once (in C) and each field's place in __init__'s arguments.
_plan_values = operator.attrgetter(*_PLAN_FIELDS)
_PLAN_INDEX = {n: i for i, n in enumerate(_PLAN_FIELDS)}


def replace(plan: Plan, changes: dict[str, Any]) -> Plan:
    """``dataclasses.replace(plan, **changes)`` without its checks (~3 µs less: the
    fields are Plan's own, already checked).  The values are read by one attrgetter
    and passed to ``__init__`` by position (which only assigns them: ~1.5 µs less than
    a getattr and setattr per field); names that are not fields are ignored."""
    vals = list(_plan_values(plan))
    for n, x in changes.items():
        i = _PLAN_INDEX.get(n)
        if i is not None:
            vals[i] = x
    return Plan(*vals)


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
    per-batch field indexed, the others shared (``dropout_b0`` advanced by the
    batch elements of the indices before i)."""
    arrays = [(n, getattr(plan, n)) for n, _ in PER_BATCH_FIELDS]
    inner = math.prod(plan.q.shape[1:-3])
    for i in range(plan.q.shape[0]):
        changes = {n: _item(a, i) for n, a in arrays if a is not None}
        changes["dropout_b0"] = plan.dropout_b0 + i * inner
        yield replace(plan, changes)


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
        return self.with_plan(replace(self.plan, {"q": kernel_ready(q)}))

    def with_plan(self, plan: Plan) -> Call:
        """The same call with another plan: ``dataclasses.replace(self, plan=plan)``
        without its per-call field introspection (~2 µs)."""
        return Call(plan, self.result, self.work, self.lse, self.lse_result)

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
