"""Zero-copy views between CPU torch tensors and NumPy arrays, bfloat16 included.

torch is never imported here: a tensor is recognised through ``sys.modules``
(if torch was not imported, nothing can be a tensor).  NumPy has no bfloat16,
so a bfloat16 tensor is viewed as int16 and that view reinterpreted as
``ml_dtypes.bfloat16`` (same bits, same memory); the way back reverses it.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["is_tensor", "is_compiling", "to_numpy", "from_numpy"]


def torch_module() -> Any:
    """The torch module when it was imported, else None (typed Any: torch is optional)."""
    torch: ModuleType | None = sys.modules.get("torch")
    return torch


def is_tensor(x: Any) -> bool:
    """True when x is a torch.Tensor (without importing torch)."""
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def is_compiling() -> bool:
    """True while ``torch.compile`` traces the caller (NumPy views cannot be traced: a front end
    takes its custom-op path there)."""
    torch = torch_module()
    return torch is not None and bool(torch.compiler.is_compiling())


def to_numpy(t: Any, name: str, *, writable: bool = False) -> npt.NDArray[Any]:
    """A NumPy view of a CPU tensor's memory (no copy, strides kept).

    Refuses tensors on other devices and, while autograd is recording,
    tensors that require grad: a caller that has no backward for them would
    silently drop the graph and give wrong gradients (the differentiable front
    ends, torch_compat and flash_compat's attention functions, go through their
    autograd Functions first and hand this function detached tensors)."""
    torch = torch_module()
    if t.is_nested:
        raise TypeError(
            f"{name} is a nested (jagged) tensor, which fastattn does not take: pass the sequences "
            "packed with their offsets to the varlen functions (fastattn.varlen_attention, "
            "flash_compat.flash_attn_varlen_func), or padded with a mask"
        )
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.requires_grad:
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{name} requires grad, and this function has no backward; run it under torch.no_grad() "
                "or torch.inference_mode()"
            )
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    a: npt.NDArray[Any]
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # only when a bfloat16 tensor is actually seen

        a = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        a = t.numpy()
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} must be writable")
    return a


def from_numpy(a: npt.NDArray[Any]) -> Any:
    """A tensor sharing a's memory (bfloat16 arrays become bfloat16 tensors)."""
    torch = torch_module()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
