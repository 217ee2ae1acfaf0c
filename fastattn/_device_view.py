"""Device views for fastattn.cuda, without the extension: :class:`View` (pointer,
shape, element strides, dtype of device memory: what ``_plan.DeviceView`` asks of
a plan array), its broadcast to a target shape, and the ``fa_params`` record of a
4-D plan of views (csrc/cuda/module.c reads it by field name)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._plan import Plan

Array = npt.NDArray[Any]


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides in elements."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


class View:
    """(pointer, shape, element strides, dtype) of device memory; owner keeps it
    alive.  It provides what ``_plan.DeviceView`` asks of a plan array."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "owner", "stream")

    def __init__(
        self,
        ptr: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dtype: np.dtype[Any],
        owner: object,
        stream: int | None = None,
    ) -> None:
        self.ptr, self.shape, self.strides = int(ptr), tuple(shape), tuple(strides)
        self.dtype, self.owner, self.stream = dtype, owner, stream

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def restrided(self, shape: tuple[int, ...], strides: tuple[int, ...]) -> View:
        """A view of the same memory (same first element) with other shape and strides."""
        return View(self.ptr, shape, strides, self.dtype, self.owner, self.stream)

    def swap(self, a: int, b: int) -> View:
        sh, st = list(self.shape), list(self.strides)
        sh[a], sh[b] = sh[b], sh[a]
        st[a], st[b] = st[b], st[a]
        return self.restrided(tuple(sh), tuple(st))

    def prepend(self) -> View:
        """A new leading dim of size 1."""
        return self.restrided((1,) + self.shape, (0,) + self.strides)

    def item(self, i: int) -> View:
        """The view of self[i] (first axis)."""
        return View(
            self.ptr + i * self.strides[0] * self.dtype.itemsize,
            self.shape[1:],
            self.strides[1:],
            self.dtype,
            self.owner,
            self.stream,
        )

    def extent(self) -> tuple[int, int] | None:
        """[lo, hi) bytes touched; None when empty."""
        if any(n == 0 for n in self.shape):
            return None
        item = self.dtype.itemsize
        lo = hi = self.ptr
        for n, s in zip(self.shape, self.strides):
            d = (n - 1) * s * item
            lo, hi = (lo + d, hi) if d < 0 else (lo, hi + d)
        return lo, hi + item


def bcast(view: View, target: tuple[int, ...], name: str) -> View:
    """view broadcast to target: element strides 0 along broadcast dims."""
    if view.ndim > len(target):
        raise ValueError(f"{name} of shape {view.shape} does not broadcast to {target}")
    pad = len(target) - view.ndim
    shape, strides = (1,) * pad + view.shape, (0,) * pad + view.strides
    out = []
    for n, s, t in zip(shape, strides, target):
        if n == t:
            out.append(s if t != 1 else 0)
        elif n == 1:
            out.append(0)
        else:
            raise ValueError(f"{name} of shape {view.shape} does not broadcast to {target}")
    return view.restrided(target, tuple(out))


def distinct(a: Array) -> Array:
    """The elements a broadcast view really holds: size 1 along its stride-0
    dims (so that an uploaded mask is as small as the user's)."""
    return a[tuple(slice(0, 1) if s == 0 else slice(None) for s in a.strides)]


# How a plan array field becomes fa_params fields: the pointer under the
# field's name, then the element strides of its leading dims under these
# names (its last dim is contiguous and has no stride field, except for the
# mask, whose every dim may broadcast).  Arrays not listed are contiguous 1-D
# tables (k_lens, and the fields the GPU lacks: module.c refuses those).
STRIDE_NAMES: dict[str, tuple[str, ...]] = {
    "q": ("q_sb", "q_sh", "q_sl"),
    "k": ("k_sb", "k_sh", "k_sl"),
    "v": ("v_sb", "v_sh", "v_sl"),
    "o": ("o_sb", "o_sh", "o_sl"),
    "lse": ("lse_sb", "lse_sh", "lse_sl"),
    "mask": ("m_sb", "m_sh", "m_sl", "m_ss"),
    "alibi": ("alibi_sb", "alibi_sh"),
    "bmask": ("bm_sb", "bm_sh", "bm_si", "bm_sj"),
}


PLAN_FIELDS = tuple((f.name, STRIDE_NAMES.get(f.name, ())) for f in dataclasses.fields(Plan))


def record(plan: Plan) -> dict[str, Any]:
    """The fa_params record of a 4-D plan of Views: every plan field under its
    own name (arrays as device pointers, None for NULL, and their strides), plus
    the sizes and dtype codes read from the arrays."""
    rec: dict[str, Any] = {}
    for name, strides in PLAN_FIELDS:
        x = getattr(plan, name)
        if isinstance(x, View):
            rec[name] = x.ptr
            rec.update(zip(strides, x.strides))
        else:  # an option, or None (NULL) for an array the call does not have
            rec[name] = x
            if x is None:
                rec.update(dict.fromkeys(strides, 0))
    q, k, v, o = plan.q, plan.k, plan.v, plan.o
    rec.update(
        B=q.shape[0],
        Hq=q.shape[1],
        Hk=k.shape[1],
        D=q.shape[3],
        Dv=v.shape[3],
        q_dtype=_kernels.DTYPE_CODES[q.dtype],
        k_dtype=_kernels.DTYPE_CODES[k.dtype],
        v_dtype=_kernels.DTYPE_CODES[v.dtype],
        o_dtype=_kernels.DTYPE_CODES[o.dtype],
    )
    return rec
