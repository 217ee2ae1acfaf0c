"""Attention functions: ``scaled_dot_product_attention`` and ``varlen_attention``.

Vocabulary: B batch, Hq/Hk query and key/value heads, L query length, S key
length, D head dim, Dv value head dim.  Masks: bool ``True`` = may attend,
floats are added to the scores.  ``is_causal`` is aligned to the bottom right:
query i sees keys j <= i + (S - L).

Every check lives in fastattn._args (which builds the kernel's call record,
the Plan); this module is the public signatures, the small-call fast path and
the CUDA dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._args import dropout_value, no_dropout, sdpa_call, varlen_call
from ._checks import F32, threads_value
from ._config import Precision, get_num_threads, precision_code
from ._paged import paged_varlen_call
from ._plan import Plan

__all__ = ["scaled_dot_product_attention", "varlen_attention"]

_SCALE_MAX_F32 = float(np.finfo(np.float32).max) / math.log2(math.e)  # as _checks.scale_value

_Window = tuple[int, int] | Sequence[int] | None
_Layout = Literal["bhsd", "bshd"]
_Precision = Precision | None


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
    layout: _Layout = "bhsd",
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
    precision: _Precision = None,
    k_scale: npt.ArrayLike | float | None = None,
    v_scale: npt.ArrayLike | float | None = None,
    dropout_seed: int | None = None,
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
    layout: _Layout = "bhsd",
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
    precision: _Precision = None,
    k_scale: npt.ArrayLike | float | None = None,
    v_scale: npt.ArrayLike | float | None = None,
    dropout_seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...
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
    layout: _Layout = "bhsd",
    return_lse: bool = False,
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
    precision: _Precision = None,
    k_scale: npt.ArrayLike | float | None = None,
    v_scale: npt.ArrayLike | float | None = None,
    dropout_seed: int | None = None,
) -> Any:
    """softmax(query @ key^T * scale + mask) @ value, fused and tiled.

    Shapes (``layout="bhsd"``): query ``(..., Hq, L, D)``, key ``(..., Hk, S, D)``,
    value ``(..., Hk, S, Dv)``; 2-D ``(L, D)`` inputs are one head.  With
    ``layout="bshd"``: ``(..., L, H, D)`` as flash-attn and JAX use.  The output
    has the query's layout and dtype, last dimension Dv.

    Order of score transforms: scale, softcap, ALiBi, attn_mask, then the
    causal / window / length / block restrictions.

    Parameters
    ----------
    query, key, value : array_like
        float32, float64, float16 or bfloat16 (``ml_dtypes``); key and value share
        a dtype, and a float32 query may be used with 16-bit keys and values.
        Key and value may also be 8-bit (``int8``, ``ml_dtypes.float8_e4m3fn`` or
        ``float8_e5m2``) under a float32, float16 or bfloat16 query, with
        ``k_scale`` / ``v_scale``.  Read in place through their strides; never modified.
    attn_mask : array_like, optional
        bool (True = may attend) or float (added to the scores; -inf
        excludes), broadcastable to ``(..., Hq, L, S)``; read in place through
        broadcasting strides, never expanded.
    dropout_p : float, default 0.0
        Attention dropout for training, as torch's: each attention weight is
        zeroed with probability ``dropout_p`` and the others multiplied by
        ``1 / (1 - dropout_p)``; the LSE is the undropped softmax's.  The mask
        is a function of ``dropout_seed`` and the coordinates (batch element,
        query head, query position, key position) only, drawn in the kernel and
        never stored: :func:`fastattn.reference.dropout_mask` gives it and
        :func:`fastattn.scaled_dot_product_attention_backward` regenerates it
        from the same seed.  It does not depend on the thread count or ISA.  A
        dropout call runs the tiled prefill path in float32 ("highest") for
        every shape.  Not with ``device="cuda"``.
    is_causal : bool, default False
        Query i may see keys j <= i + (S - L), aligned to the bottom
        right (flash-attn's convention, what a KV cache needs).  Equal to the
        usual lower triangle when L == S; torch aligns top-left when L != S.
    scale : float, optional
        Multiplies the scores; None means 1/sqrt(D).
    enable_gqa : bool, default False
        Allow Hq to be a multiple of Hk (grouped-query attention); each
        key/value head serves Hq/Hk consecutive query heads, without copies.
    layout : {"bhsd", "bshd"}, default "bhsd"
        Where the heads axis is, for the inputs and the output.
    return_lse : bool, default False
        Also return the natural-log sum of exponentials of each row,
        shape ``(..., Hq, L)`` (``(B, Hq, L)`` for bshd), float32 (float64 for
        float64 inputs).  A row whose keys are all masked gives zeros and -inf.
    out : ndarray, optional
        Write the result into this array (right shape and dtype, writable,
        not overlapping an input) and return it.
    num_threads : int, optional
        Threads for this call; None uses ``fastattn.get_num_threads()``.
        Results are bit-identical for every thread count.
    window : tuple of (int, int), optional
        ``(left, right)`` sliding window: query at bottom-right position i'
        sees keys in ``[i' - left, i' + right]``; -1 is unbounded.
    alibi_slopes : array_like, optional
        ``(Hq,)`` or ``(..., Hq)``: adds ``-slope * |i' - j|``.
    softcap : float, optional
        Scores become ``softcap * tanh(scores / softcap)`` before masks.
    sinks : array_like, optional
        ``(Hq,)`` logits that join each row's softmax denominator only.
    key_lengths, query_lengths : array_like of int, optional
        Integer arrays of the batch dims' shape; keys
        ``j >= key_lengths[b]`` are ignored (their tiles skipped), output rows
        ``i >= query_lengths[b]`` are zeros with LSE -inf.  Causal alignment
        uses these lengths.
    block_mask : array_like of bool, optional
        Block-sparse pattern, ``(..., Hq, ceil(L/bq), ceil(S/bk))``; True blocks
        are computed, the others skipped entirely (see :mod:`fastattn.sparse`).
    block_size : tuple of (int, int), optional
        ``(bq, bk)``, the query and key rows per block of ``block_mask``.
    device : {None, "cpu", "cuda"}, optional
        None or "cpu" (this kernel), or "cuda": run
        :func:`fastattn.cuda.scaled_dot_product_attention` (NumPy or
        ``__cuda_array_interface__`` inputs; RuntimeError when fastattn was
        built without CUDA or no GPU is present).  ``num_threads``, ``sinks``,
        ``query_lengths`` and ``block_mask`` are CPU-only.
    precision : {None, "highest", "high", "medium"}, optional
        float32 inputs only, torch's names: "highest" (float32 arithmetic),
        "high" (bf16x3: three bfloat16 products per float32 product, ~16 mantissa
        bits) or "medium" (Q, K, V and P rounded to bfloat16); None uses
        ``fastattn.get_float32_matmul_precision()`` ("highest" unless set).  The lower
        levels take effect on the ``amx`` path (>= 32 rows per key/value head) and
        compute as "highest" elsewhere; float64 and float16 ignore it.  bfloat16
        inputs on the ``amx`` path always use bf16 products (P rounded to bf16).

    k_scale, v_scale : array_like or float, optional
        Scales of 8-bit key and value: the kernel attends over ``key * k_scale``
        and ``value * v_scale`` (float32), dequantised in registers, never
        copied.  Each broadcasts against its array in the call's layout and
        varies along the sequence axis (per token, e.g. ``(B, Hk, S, 1)``) or the
        head-dim axis (per channel, ``(B, Hk, 1, D)``), not both; a scalar or
        ``(B, Hk, 1, 1)`` is per tensor / head.  Finite and positive.  Required
        for int8; 1 by default for fp8; an error with float keys and values.
        See :func:`fastattn.quantize_kv`.
    dropout_seed : int, optional
        The dropout mask's key, an int in [0, 2**64); required when
        ``dropout_p > 0``.  Pass a fresh one per call (and the same one to the
        backward): the same seed gives the same mask.

    Returns
    -------
    out : ndarray
        The attention output, the query's shape with last dimension Dv, in the
        query's dtype and layout (``out`` itself when given).
    lse : ndarray
        Only with ``return_lse=True``: the rows' log-sum-exp, as described above.

    Raises
    ------
    TypeError, ValueError
        For a bad argument (wrong dtype, shape, option), before any computation.

    See Also
    --------
    fastattn.reference.scaled_dot_product_attention : The float64 oracle.
    fastattn.torch_compat.scaled_dot_product_attention : torch's semantics on tensors.
    scaled_dot_product_attention_backward : The gradients.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 8, 16), dtype=np.float32)
    >>> k = rng.standard_normal((2, 4, 12, 16), dtype=np.float32)
    >>> v = rng.standard_normal((2, 4, 12, 16), dtype=np.float32)
    >>> out = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape, out.dtype
    ((2, 4, 8, 16), dtype('float32'))
    >>> ref = fastattn.reference.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> bool(np.allclose(out, ref, atol=1e-5))
    True

    A padding mask (True = may attend) and the log-sum-exp:

    >>> mask = np.arange(12) < 10                       # the last two keys are padding
    >>> out, lse = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    >>> lse.shape
    (2, 4, 8)
    """
    # Fast path for the common small call: float32 NumPy arrays in bhsd layout
    # with the default options (only is_causal, scale, num_threads and precision
    # given).
    # It skips no check: each condition below is what the general path would
    # accept, and anything else (including every error) takes the general path.
    # On (1, 8, 16, 64) it cut a call from 28.0 to 22.6 µs (Sapphire Rapids
    # class, 1 thread, thread CPU time, median of interleaved rounds).
    if (
        attn_mask is None
        and type(layout) is str  # an array layout would make the comparison below an array
        and layout == "bhsd"
        and (scale is None or type(scale) is float)
        and (is_causal is False or is_causal is True)
        and (dropout_p == 0 if type(dropout_p) is float or type(dropout_p) is int else False)
        and dropout_seed is None
        and out is None
        and return_lse is False  # (not `not return_lse`: an array there must reach the named check)
        and device is None
        and window is None
        and alibi_slopes is None
        and softcap is None
        and sinks is None
        and key_lengths is None
        and query_lengths is None
        and block_mask is None
        and block_size is None
        and k_scale is None
        and v_scale is None
        and (scale is None or abs(scale) <= _SCALE_MAX_F32)  # finite, and finite times log2(e)
    ):
        # float32 ndarrays, 4-D, equal heads, native, aligned, last dim contiguous (tested in C).
        dims = _kernels.small_call_dims(query, key, value)
        if dims is not None:
            B, Hq, L, D, S, Dv = dims
            res = np.empty((B, Hq, L, Dv), dtype=F32)
            # Plan(q, k, v, o, scale, L, S, num_threads, precision, causal): by position
            # (~0.8 µs less than keywords, see fastattn._plan.Plan).
            _kernels.attention(
                Plan(
                    query,
                    key,
                    value,
                    res,
                    1.0 / math.sqrt(D) if scale is None else scale,
                    L,
                    S,
                    threads_value(num_threads, get_num_threads),
                    precision_code(precision),
                    is_causal,
                )
            )
            return res
    drop_p, drop_seed = dropout_value(dropout_p, dropout_seed)
    if device is not None and device != "cpu":
        precision_code(precision)  # checked for either device
        if device != "cuda":
            raise ValueError(f"device must be None, 'cpu' or 'cuda', got {device!r}")
        no_dropout(drop_p, "with device='cuda'")
        cpu_only = dict(
            num_threads=num_threads,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=sinks,
            query_lengths=query_lengths,
            block_mask=block_mask,
            block_size=block_size,
        )
        for name, val in cpu_only.items():
            if val is not None:
                raise ValueError(f"{name} is not supported with device='cuda'")
        from . import cuda

        cuda_sdpa: Any = cuda.scaled_dot_product_attention  # (fastattn.cuda is typed by its owner)
        return cuda_sdpa(
            query,
            key,
            value,
            attn_mask,
            is_causal,
            scale,
            enable_gqa,
            layout=layout,
            return_lse=return_lse,
            out=out,
            window=window,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            key_lengths=key_lengths,
        )
    # sdpa_call takes this function's arguments in this order (by position: ~1 µs less).
    call = sdpa_call(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        enable_gqa,
        layout,
        return_lse,
        out,
        num_threads,
        window,
        alibi_slopes,
        softcap,
        sinks,
        key_lengths,
        query_lengths,
        block_mask,
        block_size,
        precision,
        k_scale,
        v_scale,
    )
    if drop_p > 0 and call.plan is not None:
        call.plan.dropout_p = drop_p
        call.plan.dropout_seed = drop_seed
    return call.run()


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
    precision: _Precision = None,
    k_scale: npt.ArrayLike | float | None = None,
    v_scale: npt.ArrayLike | float | None = None,
    block_table: npt.ArrayLike | None = None,
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
    precision: _Precision = None,
    k_scale: npt.ArrayLike | float | None = None,
    v_scale: npt.ArrayLike | float | None = None,
    block_table: npt.ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...
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
    return_lse: bool = False,
    out: np.ndarray | None = None,
    num_threads: int | None = None,
    precision: _Precision = None,
    k_scale: npt.ArrayLike | float | None = None,
    v_scale: npt.ArrayLike | float | None = None,
    block_table: npt.ArrayLike | None = None,
) -> Any:
    """Attention over packed variable-length sequences (flash-attn's
    ``flash_attn_varlen_func`` convention).

    q: ``(Tq, Hq, D)``, k: ``(Tk, Hk, D)``, v: ``(Tk, Hk, Dv)`` hold the tokens of
    all sequences back to back; sequence b owns query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.  Nothing is computed across
    sequences and no padding is computed.  Causal alignment is bottom-right per
    sequence.  ``precision``: as for :func:`scaled_dot_product_attention`.  Returns
    ``(Tq, Hq, Dv)`` and, with ``return_lse``, ``(Hq, Tq)``.

    Parameters
    ----------
    q, k, v : array_like
        The packed tokens, ``(Tq, Hq, D)``, ``(Tk, Hk, D)`` and ``(Tk, Hk, Dv)``.
    cu_seqlens_q, cu_seqlens_k : array_like of int
        ``(B + 1,)`` cumulative lengths starting at 0 and ending at Tq / Tk.
    is_causal : bool, default False
        Causal mask, aligned bottom-right within each sequence.
    scale, enable_gqa, window, alibi_slopes, softcap, sinks, out, num_threads, precision
        As for :func:`scaled_dot_product_attention` (``alibi_slopes`` ``(Hq,)`` or
        ``(B, Hq)``).
    k_scale, v_scale : array_like or float, optional
        The scales of 8-bit k and v, as for :func:`scaled_dot_product_attention`,
        broadcast against the packed ``(Tk, Hk, D)`` arrays (per token: ``(Tk, Hk, 1)``;
        with ``block_table``, per token ``(num_pages, page_size, Hk, 1)``).
    block_table : array_like of int, optional
        Chunked prefill over paged caches: k and v are then page pools
        ``(num_pages, page_size, Hk, D/Dv)`` (flash-attn's), ``block_table`` an
        integer ``(B, max_pages)`` array of each sequence's pages, and
        ``cu_seqlens_k`` the cumulative key lengths (the keys of sequence b are
        its first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` paged tokens).  Decode
        rows (one query) and prefill chunks mix in one call.
    return_lse : bool, default False
        Also return the log-sum-exp, ``(Hq, Tq)``.

    Returns
    -------
    out : ndarray
        ``(Tq, Hq, Dv)`` in q's dtype.
    lse : ndarray
        Only with ``return_lse=True``: ``(Hq, Tq)``.

    Examples
    --------
    Two sequences of 3 and 5 tokens, packed:

    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((8, 2, 16), dtype=np.float32)
    >>> k = rng.standard_normal((8, 2, 16), dtype=np.float32)
    >>> v = rng.standard_normal((8, 2, 16), dtype=np.float32)
    >>> cu = np.array([0, 3, 8], dtype=np.int32)
    >>> out = fastattn.varlen_attention(q, k, v, cu, cu, is_causal=True)
    >>> out.shape
    (8, 2, 16)

    Each sequence is attended alone:

    >>> second = fastattn.scaled_dot_product_attention(
    ...     q[3:], k[3:], v[3:], is_causal=True, layout="bshd")
    >>> bool(np.allclose(out[3:], second, atol=1e-6))
    True
    """
    opts: dict[str, Any] = dict(
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        window=window,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
        return_lse=return_lse,
        out=out,
        num_threads=num_threads,
        precision=precision,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if block_table is not None:
        return paged_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, **opts).run()
    return varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, **opts).run()
