"""Type stubs for fastattn.functional (the public signatures; see the module for the docs).

tests/test_packaging.py checks that these signatures match the implementation.
"""

from typing import Any, Literal, Optional, Sequence, Union, overload

import numpy as np
import numpy.typing as npt

_Window = Union[tuple[int, int], Sequence[int], None]

def __getattr__(name: str) -> Any: ...  # private helpers used inside the package
@overload
def scaled_dot_product_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: Optional[npt.ArrayLike] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    return_lse: Literal[False] = False,
    out: Optional[np.ndarray] = None,
    num_threads: Optional[int] = None,
    window: _Window = None,
    alibi_slopes: Optional[npt.ArrayLike] = None,
    softcap: Optional[float] = None,
    sinks: Optional[npt.ArrayLike] = None,
    key_lengths: Optional[npt.ArrayLike] = None,
    query_lengths: Optional[npt.ArrayLike] = None,
    block_mask: Optional[npt.ArrayLike] = None,
    block_size: Optional[tuple[int, int]] = None,
    device: Optional[Literal["cpu", "cuda"]] = None,
) -> np.ndarray: ...
@overload
def scaled_dot_product_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: Optional[npt.ArrayLike] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    return_lse: Literal[True],
    out: Optional[np.ndarray] = None,
    num_threads: Optional[int] = None,
    window: _Window = None,
    alibi_slopes: Optional[npt.ArrayLike] = None,
    softcap: Optional[float] = None,
    sinks: Optional[npt.ArrayLike] = None,
    key_lengths: Optional[npt.ArrayLike] = None,
    query_lengths: Optional[npt.ArrayLike] = None,
    block_mask: Optional[npt.ArrayLike] = None,
    block_size: Optional[tuple[int, int]] = None,
    device: Optional[Literal["cpu", "cuda"]] = None,
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def varlen_attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: _Window = None,
    alibi_slopes: Optional[npt.ArrayLike] = None,
    softcap: Optional[float] = None,
    sinks: Optional[npt.ArrayLike] = None,
    return_lse: Literal[False] = False,
    out: Optional[np.ndarray] = None,
    num_threads: Optional[int] = None,
) -> np.ndarray: ...
@overload
def varlen_attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: _Window = None,
    alibi_slopes: Optional[npt.ArrayLike] = None,
    softcap: Optional[float] = None,
    sinks: Optional[npt.ArrayLike] = None,
    return_lse: Literal[True],
    out: Optional[np.ndarray] = None,
    num_threads: Optional[int] = None,
) -> tuple[np.ndarray, np.ndarray]: ...
