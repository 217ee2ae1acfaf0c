"""The argument checks flash-attn's functions share (fastattn.flash_compat and its
KV-cache function, fastattn._flash_kvcache): arrays or CPU torch tensors in,
flash-attn's option conventions (``window_size`` -1, ``softcap`` 0.0 = off)."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import numpy as np

from . import _torch_bridge
from ._args import dropout_p_value
from ._cache_args import index_value
from ._checks import as_array


def array_value(x: Any, name: str, *, writable: bool = False) -> np.ndarray:
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


def wrap(torch_out: bool, *arrays: np.ndarray) -> Any:
    res = tuple(_torch_bridge.from_numpy(a) if torch_out else a for a in arrays)
    return res if len(res) > 1 else res[0]


def dropout_value(dropout_p: Any) -> float:
    """flash-attn's ``dropout_p``: a real number in [0, 1] (TypeError / ValueError)."""
    return dropout_p_value(dropout_p)


def draw_seed(torch_generator: bool) -> int:
    """A fresh dropout seed (an int in [0, 2**63 - 1)): from torch's default generator for
    tensor inputs, drawn as fastattn.torch_compat draws it (``torch.manual_seed`` then
    reproduces the masks, as it does flash-attn's), else from NumPy's global generator
    (``numpy.random.seed`` reproduces them)."""
    torch = _torch_bridge.torch_module() if torch_generator else None
    if torch is not None:
        return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    return int(np.random.randint(0, 2**63 - 1, dtype=np.int64))


def flag_value(x: Any, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return bool(x)


def window_size_value(window_size: Any) -> tuple[int, int] | None:
    """flash-attn's (left, right), -1 = unbounded; None when both sides are unbounded.
    A pair given as a 1-D integer array or CPU tensor of two values is taken too (flash-attn's
    own tests build it with torch)."""
    if _torch_bridge.is_tensor(window_size) or isinstance(window_size, np.ndarray):
        a = array_value(window_size, "window_size")
        if a.ndim == 1 and a.shape[0] == 2 and a.dtype.kind in "iu":
            window_size = (int(a[0]), int(a[1]))
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left = index_value(window_size[0], "window_size[0]", -1)
    right = index_value(window_size[1], "window_size[1]", -1)
    return None if (left, right) == (-1, -1) else (left, right)


def softcap_value(softcap: Any) -> float | None:
    """flash-attn's softcap: 0.0 = off, > 0 = on."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a number (0.0 = off), got {type(softcap).__name__}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0.0 = off), got {softcap!r}")
    return None if softcap == 0 else float(softcap)


def alibi_value(alibi_slopes: Any) -> np.ndarray | None:
    return None if alibi_slopes is None else array_value(alibi_slopes, "alibi_slopes")


class Opts(NamedTuple):
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
        dropout_value(self.dropout_p)
        flag_value(self.deterministic, "deterministic")
        return dict(
            window=window_size_value(self.window_size),
            softcap=softcap_value(self.softcap),
            alibi_slopes=alibi_value(self.alibi_slopes),
        )


def check_ndim(a: np.ndarray, name: str, nd: int, shape: str) -> None:
    if a.ndim != nd:
        raise ValueError(f"{name} must be {nd}-D {shape}, got shape {a.shape}")


def probs_placeholder(q: np.ndarray) -> np.ndarray:
    # flash-attn returns an empty S_dmask unless dropout_p > 0 (then fastattn._flash_sdmask's).
    return np.empty((0,), dtype=q.dtype)
