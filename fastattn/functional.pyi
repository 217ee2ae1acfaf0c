"""Type stubs for fastattn.functional (the public signatures; see the module for the docs).

tests/test_packaging.py checks that these signatures match the implementation.
"""

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias, overload

import numpy as np
import numpy.typing as npt

_Window: TypeAlias = tuple[int, int] | Sequence[int] | None

def __getattr__(name: str) -> Any: ...  # private helpers used inside the package
@overload
def scaled_dot_product_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    return_lse: Literal[False] = False,
    out: np.ndarray | None = None,
    num_threads: int | None = None,
    window: _Window = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    key_lengths: npt.ArrayLike | None = None,
    query_lengths: npt.ArrayLike | None = None,
    block_mask: npt.ArrayLike | None = None,
    block_size: tuple[int, int] | None = None,
    device: Literal["cpu", "cuda"] | None = None,
    precision: Literal["highest", "high", "medium"] | None = None,
) -> np.ndarray: ...
@overload
def scaled_dot_product_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    return_lse: Literal[True],
    out: np.ndarray | None = None,
    num_threads: int | None = None,
    window: _Window = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    key_lengths: npt.ArrayLike | None = None,
    query_lengths: npt.ArrayLike | None = None,
    block_mask: npt.ArrayLike | None = None,
    block_size: tuple[int, int] | None = None,
    device: Literal["cpu", "cuda"] | None = None,
    precision: Literal["highest", "high", "medium"] | None = None,
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
    scale: float | None = None,
    enable_gqa: bool = False,
    window: _Window = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    return_lse: Literal[False] = False,
    out: np.ndarray | None = None,
    num_threads: int | None = None,
    precision: Literal["highest", "high", "medium"] | None = None,
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
    scale: float | None = None,
    enable_gqa: bool = False,
    window: _Window = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    return_lse: Literal[True],
    out: np.ndarray | None = None,
    num_threads: int | None = None,
    precision: Literal["highest", "high", "medium"] | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...
