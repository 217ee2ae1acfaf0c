"""Gradients for flash_compat's differentiable functions (flash-attn's ``flash_attn_func``,
its packed forms and ``flash_attn_varlen_func``) on torch tensors that require grad.

Where autograd records (``torch.is_grad_enabled()``) and a query, key or value tensor
requires grad, the call runs through a ``torch.autograd.Function``: its forward is the
same fastattn call on the tensors' memory with the log-sum-exp kept, its backward
fastattn's fused backward (:func:`fastattn.scaled_dot_product_attention_backward`) with
the forward's options (dropout included: the forward's seed is kept in the spec, so the
backward regenerates its mask), on the bshd layout flash-attn uses; a varlen call's
backward runs sequence by sequence on views of the packed arrays (with dropout, on one
zero-padded batch, :func:`varlen_spec`).  The packed functions slice the
packed tensor with torch, so the gradient reaches it through torch's own indexing.
Like flash-attn's, the gradient is not differentiable again (double backward raises).

torch is imported here only when such a call is made (this module is imported by
flash_compat, which works without torch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _torch_bridge
from ._checks import as_array
from .backward import scaled_dot_product_attention_backward

Array = npt.NDArray[Any]
# (q, k, v) as NumPy views -> (out, lse) of the forward
Forward = Callable[[Array, Array, Array], tuple[Array, Array]]

__all__ = ["wants_grad", "Spec", "dense_spec", "varlen_spec", "run"]


def wants_grad(*xs: Any) -> bool:
    """True when autograd records and one of ``xs`` is a tensor that requires grad."""
    torch = _torch_bridge.torch_module()
    return (
        torch is not None
        and torch.is_grad_enabled()
        and any(_torch_bridge.is_tensor(x) and x.requires_grad for x in xs)
    )


def without_backward(out: Any, inputs: Sequence[Any], what: str) -> Any:
    """``out``, a tensor computed from ``inputs`` outside autograd, as the output of a node
    whose backward raises ``NotImplementedError`` naming ``what``: the forward of a call
    that has none (flash-attn's own paged varlen call runs forward under grad too)."""
    torch = _torch_bridge.torch_module()

    class NoBackward(torch.autograd.Function):  # type: ignore[misc, name-defined]
        @staticmethod
        def forward(ctx: Any, o: Any, *ins: Any) -> Any:
            return o.clone()

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            raise NotImplementedError(f"{what} has no backward (nor has flash-attn's)")

    return NoBackward.apply(out, *[x for x in inputs if _torch_bridge.is_tensor(x)])


class Spec:
    """One differentiable call: ``forward(q, k, v) -> (out, lse)`` and
    ``backward(grad_out, q, k, v, out, lse) -> (dq, dk, dv)`` on NumPy arrays."""

    def __init__(self, forward: Forward, backward: Callable[..., tuple[Array, ...]]) -> None:
        self.forward = forward
        self.backward = backward


def dense_spec(
    forward: Forward,
    causal: bool,
    scale: float | None,
    options: dict[str, Any],
    dropout: dict[str, Any] | None = None,
) -> Spec:
    """flash_attn_func's call: bshd, grouped-query heads, ``options`` (window, softcap,
    alibi_slopes) as the forward checked them, ``dropout`` (``dropout_p`` and the
    forward's ``dropout_seed``, or empty) as the forward applied it."""
    drop = dropout or {}

    def backward(go: Array, q: Array, k: Array, v: Array, out: Array, lse: Array) -> tuple[Array, ...]:
        return scaled_dot_product_attention_backward(
            go, q, k, v, out, lse, is_causal=causal, scale=scale, enable_gqa=True, layout="bshd",
            **options, **drop,
        )  # fmt: skip

    return Spec(forward, backward)


def varlen_spec(
    forward: Forward,
    cu_q: Array,
    cu_k: Array,
    causal: bool,
    scale: float | None,
    options: dict[str, Any],
    dropout: dict[str, Any] | None = None,
) -> Spec:
    """flash_attn_varlen_func's call: sequence ``b`` owns rows ``cu_q[b]:cu_q[b+1]`` of q
    and ``cu_k[b]:cu_k[b+1]`` of k and v; each sequence's backward runs on views
    ``(1, n, H, D)`` (bshd) with its own ALiBi slopes when they are per sequence.

    With ``dropout`` (the forward's ``dropout_p`` and ``dropout_seed``) the mask's batch
    index is the sequence's, which a one-sequence call cannot give: the sequences are
    then copied into a zero-padded ``(batch, longest, H, D)`` batch and differentiated in
    one call with their lengths (``query_lengths``/``key_lengths``: bottom-right
    alignment and the mask's positions within each sequence, as in the packed forward)."""
    if dropout:
        return Spec(forward, _padded_backward(cu_q, cu_k, causal, scale, options, dropout))
    alibi = options.get("alibi_slopes")
    rest = {n: x for n, x in options.items() if n != "alibi_slopes"}

    def backward(go: Array, q: Array, k: Array, v: Array, out: Array, lse: Array) -> tuple[Array, ...]:
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        for b in range(len(cu_q) - 1):
            qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            if qs.start == qs.stop:
                continue
            slopes = None if alibi is None else (alibi if np.ndim(alibi) == 1 else alibi[b])
            g = scaled_dot_product_attention_backward(
                go[None, qs],
                q[None, qs],
                k[None, ks],
                v[None, ks],
                out[None, qs],
                lse[None, :, qs],
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
                layout="bshd",
                alibi_slopes=slopes,
                **rest,
            )
            dq[qs], dk[ks], dv[ks] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv

    return Spec(forward, backward)


def _padded_backward(
    cu_q: Array,
    cu_k: Array,
    causal: bool,
    scale: float | None,
    options: dict[str, Any],
    dropout: dict[str, Any],
) -> Callable[..., tuple[Array, ...]]:
    """A packed call's backward through one padded bshd batch (see :func:`varlen_spec`)."""
    nb = len(cu_q) - 1
    lq, lk = np.diff(cu_q).astype(np.int64), np.diff(cu_k).astype(np.int64)
    L, S = int(lq.max(initial=0)), int(lk.max(initial=0))

    def pad(x: Array, cu: Array, n: int, fill: float = 0.0) -> Array:
        """(T, H, X) -> (nb, n, H, X), sequence b's rows first, ``fill`` after."""
        res = np.full((nb, n) + x.shape[1:], fill, dtype=x.dtype)
        for b in range(nb):
            res[b, : int(cu[b + 1] - cu[b])] = x[int(cu[b]) : int(cu[b + 1])]
        return res

    def unpad(x: Array, cu: Array, like: Array) -> Array:
        res = np.empty_like(like)
        for b in range(nb):
            res[int(cu[b]) : int(cu[b + 1])] = x[b, : int(cu[b + 1] - cu[b])]
        return res

    def backward(go: Array, q: Array, k: Array, v: Array, out: Array, lse: Array) -> tuple[Array, ...]:
        if nb == 0 or L == 0 or S == 0:  # no query, or no key: every row outputs zeros
            return np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        # lse (H, Tq) -> (nb, L, H) padded with -inf (a padded row's, as the forward gives it)
        lse_p = np.moveaxis(pad(np.ascontiguousarray(lse.T), cu_q, L, -np.inf), 2, 1)
        dq, dk, dv = scaled_dot_product_attention_backward(
            pad(go, cu_q, L), pad(q, cu_q, L), pad(k, cu_k, S), pad(v, cu_k, S), pad(out, cu_q, L), lse_p,
            is_causal=causal, scale=scale, enable_gqa=True, layout="bshd",
            query_lengths=lq, key_lengths=lk, **options, **dropout,
        )  # fmt: skip
        return unpad(dq, cu_q, q), unpad(dk, cu_k, k), unpad(dv, cu_k, v)

    return backward


def run(spec: Spec, q: Any, k: Any, v: Any, return_attn_probs: bool) -> Any:
    """The call on tensors: ``out`` (differentiable with respect to q, k and v), or
    ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs`` (the lse is not
    differentiable; ``S_dmask`` is empty, as flash-attn returns it without dropout:
    the caller refuses ``return_attn_probs`` with dropout)."""
    torch = _torch_bridge.torch_module()
    # (an array beside tensors that require grad: a tensor of its memory, a constant)
    q, k, v = (_tensor_of(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    out, lse = _forward_function().apply(q, k, v, spec)
    if not return_attn_probs:
        return out
    return out, lse, torch.empty((0,), dtype=out.dtype)


def _tensor_of(x: Any, name: str) -> Any:
    if _torch_bridge.is_tensor(x):
        return x
    a = as_array(x, name)
    return _torch_bridge.from_numpy(a if a.flags.writeable else a.copy())


def _np(t: Any, name: str) -> Array:
    return _torch_bridge.to_numpy(t.detach(), name)


def _tensors(arrays: Sequence[Array]) -> tuple[Any, ...]:
    return tuple(_torch_bridge.from_numpy(a) for a in arrays)


@functools.cache
def _forward_function() -> Any:
    """The autograd Function, with its backward's own Function (made on first use: torch is
    optional)."""
    import torch

    class FlashForward(torch.autograd.Function):
        @staticmethod
        def forward(q: Any, k: Any, v: Any, spec: Spec) -> tuple[Any, Any]:
            return _tensors(spec.forward(_np(q, "q"), _np(k, "k"), _np(v, "v")))

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, Any]) -> None:
            q, k, v, spec = inputs
            out, lse = output
            # torch's version counters then refuse a backward after an in-place change
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.mark_non_differentiable(lse)
            ctx.spec = spec

        @staticmethod
        def backward(ctx: Any, grad_out: Any, _grad_lse: Any) -> tuple[Any, Any, Any, None]:
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = FlashBackward.apply(grad_out, q, k, v, out, lse, ctx.spec)  # type: ignore[no-untyped-call]
            return dq, dk, dv, None

    class FlashBackward(torch.autograd.Function):
        @staticmethod
        def forward(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, spec: Spec) -> tuple[Any, ...]:
            go = _np(grad_out.to(out.dtype), "grad_out")
            arrays = (_np(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse")))
            return _tensors(spec.backward(go, *arrays))

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            raise RuntimeError(
                "fastattn.flash_compat's gradients cannot be differentiated again (double backward, "
                "e.g. a gradient penalty), as flash-attn's cannot"
            )

    return FlashForward
