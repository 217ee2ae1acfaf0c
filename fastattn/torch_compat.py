"""``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors, by
fastattn's fused forward and backward (a ``torch.autograd.Function``).

Importing this module imports torch; ``import fastattn`` never does.  Tensors
cross to NumPy and back without copies (``Tensor.numpy()`` / ``torch.from_numpy``;
bfloat16 through an int16 view).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .backward import scaled_dot_product_attention_backward
from .functional import scaled_dot_product_attention as _sdpa

__all__ = ["scaled_dot_product_attention"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _np(t: torch.Tensor) -> npt.NDArray[Any]:
    """A NumPy view of a CPU tensor's data (no copy, strides kept)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        a: npt.NDArray[Any] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return a
    return t.numpy()


def _torch(a: npt.NDArray[Any]) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _check_tensor(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (fastattn runs on the CPU), got device {t.device}")


def _causal_top_left(
    mask: npt.NDArray[Any] | None, L: int, S: int
) -> tuple[npt.NDArray[Any] | None, dict[str, Any]]:
    """torch's is_causal: query i sees keys j <= i (top-left), combined with any
    mask.  fastattn's is_causal is bottom-right, so: L == S as is; L > S as the
    window right = L - S on the bottom-right position; L < S as a bool (L, S)
    lower triangle folded into the mask."""
    if L == S:
        return mask, {"is_causal": True}
    if L > S:
        return mask, {"window": (-1, L - S)}
    tril = np.tri(L, S, dtype=bool)
    if mask is None:
        return tril, {}
    if mask.dtype == np.bool_:
        return mask & tril, {}
    return np.where(tril, mask, np.array(-np.inf, dtype=mask.dtype)), {}


class _FusedSDPA(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: npt.NDArray[Any] | None,
        kw: dict[str, Any],
    ) -> torch.Tensor:
        q, k, v = _np(query), _np(key), _np(value)
        out, lse = _sdpa(q, k, v, mask, return_lse=True, **kw)
        ctx.save_for_backward(query, key, value)
        ctx.fa = (out, lse, mask, kw)
        return _torch(out)

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        query, key, value = ctx.saved_tensors
        out, lse, mask, kw = ctx.fa
        go = _np(grad_out.to(query.dtype))
        dq, dk, dv = scaled_dot_product_attention_backward(
            go, _np(query), _np(key), _np(value), out, lse, mask, **kw
        )
        return _torch(dq), _torch(dk), _torch(dv), None, None


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with torch's
    signature and semantics on CPU tensors, computed by fastattn's fused kernels,
    differentiable (``loss.backward()`` runs the fused backward pass).

    query ``(..., Hq, L, D)``, key ``(..., Hk, S, D)``, value ``(..., Hk, S, Dv)``;
    float32, float64, float16 or bfloat16 (16-bit computed in float32).
    attn_mask: bool (**True = may attend**, as torch) or float added to the
    scores, broadcastable to ``(..., Hq, L, S)``; a constant (a mask that
    requires grad is refused).  is_causal: **top-left** as torch (query i sees
    keys j <= i, also when L != S), combined with attn_mask when both are given,
    as torch 2.13 does.  scale: None = 1/sqrt(D).  enable_gqa: Hq a multiple of
    Hk.  dropout_p must be 0 (NotImplementedError otherwise).  A row with no
    visible key gives zeros (as torch 2.13 on the CPU) and zero gradients.
    """
    for t, n in ((query, "query"), (key, "key"), (value, "value")):
        _check_tensor(t, n)
        if t.dtype not in _DTYPES:
            raise TypeError(f"{n} must be float32, float64, float16 or bfloat16, got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must have the same dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise NotImplementedError("dropout_p must be 0: fastattn's fused kernels have no dropout")
    mask = None
    if attn_mask is not None:
        _check_tensor(attn_mask, "attn_mask")
        if attn_mask.requires_grad:
            raise NotImplementedError(
                "attn_mask is a constant here: gradients with respect to it are not computed"
            )
        mask = _np(attn_mask)
    if query.dim() < 2:
        raise ValueError(f"query must have at least 2 dimensions, got shape {tuple(query.shape)}")
    kw: dict[str, Any] = {"scale": scale, "enable_gqa": bool(enable_gqa)}
    if is_causal:
        mask, extra = _causal_top_left(mask, query.shape[-2], key.shape[-2])
        kw.update(extra)
    out: torch.Tensor = _FusedSDPA.apply(query, key, value, mask, kw)
    return out
