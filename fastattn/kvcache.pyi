"""Type stubs for fastattn.kvcache (the public signatures; see the module for the docs)."""

from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

_Window = tuple[int, int] | Sequence[int] | None
_Index = int | slice | npt.ArrayLike | None

class KVCache:
    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        max_len: int | None,
        head_dim: int,
        *,
        dtype: npt.DTypeLike = ...,
        value_dim: int | None = None,
        rotary_cos: npt.ArrayLike | None = None,
        rotary_sin: npt.ArrayLike | None = None,
        rotary_interleaved: bool = False,
    ) -> None: ...
    @property
    def batch(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def max_len(self) -> int | None: ...
    @property
    def capacity(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def value_dim(self) -> int: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def lengths(self) -> np.ndarray: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def k(self) -> np.ndarray: ...
    @property
    def v(self) -> np.ndarray: ...
    def append(
        self, k_new: npt.ArrayLike, v_new: npt.ArrayLike, *, batch_index: _Index = None
    ) -> np.ndarray: ...
    def crop(self, n: int) -> None: ...
    def reorder_cache(self, beam_idx: npt.ArrayLike) -> None: ...
    def get_seq_length(self) -> int: ...
    def reset(self, batch_index: _Index = None) -> None: ...
    @overload
    def attend(
        self,
        q: npt.ArrayLike,
        *,
        window: _Window = None,
        alibi_slopes: npt.ArrayLike | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        return_lse: Literal[False] = False,
        num_threads: int | None = None,
        batch_index: _Index = None,
    ) -> np.ndarray: ...
    @overload
    def attend(
        self,
        q: npt.ArrayLike,
        *,
        window: _Window = None,
        alibi_slopes: npt.ArrayLike | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        return_lse: Literal[True],
        num_threads: int | None = None,
        batch_index: _Index = None,
    ) -> tuple[np.ndarray, np.ndarray]: ...

@overload
def attention_with_kvcache(
    q: npt.ArrayLike,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    cache_seqlens: int | npt.ArrayLike,
    k_new: npt.ArrayLike | None = None,
    v_new: npt.ArrayLike | None = None,
    *,
    is_causal: bool = True,
    window: _Window = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: Literal[False] = False,
    num_threads: int | None = None,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    rotary_cos: npt.ArrayLike | None = None,
    rotary_sin: npt.ArrayLike | None = None,
    rotary_interleaved: bool = False,
) -> np.ndarray: ...
@overload
def attention_with_kvcache(
    q: npt.ArrayLike,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    cache_seqlens: int | npt.ArrayLike,
    k_new: npt.ArrayLike | None = None,
    v_new: npt.ArrayLike | None = None,
    *,
    is_causal: bool = True,
    window: _Window = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: Literal[True],
    num_threads: int | None = None,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    rotary_cos: npt.ArrayLike | None = None,
    rotary_sin: npt.ArrayLike | None = None,
    rotary_interleaved: bool = False,
) -> tuple[np.ndarray, np.ndarray]: ...
