"""flash-attn's ``S_dmask``: what ``return_attn_probs=True`` returns with ``dropout_p > 0``.

flash-attn 2 returns, for its tests, the attention weights of each key block as its
kernel held them and the dropout pattern in their signs: ``S_dmask[b, h, i, j]`` is
``exp(s_ij - m)`` with ``m`` the running row maximum when key ``j``'s block was
processed (its kernel walks the key blocks from the last to the first, so ``m`` is the
maximum over that block and every later one), negated where the weight was dropped,
in ``q``'s dtype and of shape ``(batch, nheads, seqlen_q, seqlen_k)`` each rounded up to
a multiple of 128.  Its tests undo the block scaling with the block width of
:func:`block_size_n` (``flash_attn_interface._get_block_size_n``).

fastattn produces the same encoding from its own quantities, after the call:

- the weights ``P`` of :func:`fastattn.attention_weights` (float64 scores of the
  same inputs and score options, the kernel's normaliser), so ``exp(s - m)`` is
  ``P / max(P over the key's block and every later block)``;
- the keep mask of :func:`fastattn.reference.dropout_mask` under the call's seed: the
  mask the kernel applied (both are Philox-4x64-10 of the same counters; the tests of
  the dropout compare them).

It materialises ``(batch, nheads, L, S)`` weights: a testing aid, as in flash-attn.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import reference
from .weights import attention_weights

NDArray = npt.NDArray[Any]

_ROUND = 128  # flash-attn rounds S_dmask's two sequence dims up to its 128-row tiles


def block_size_n(head_dim: int, is_dropout: bool) -> int:
    """The key-block width of flash-attn 2's sm80 (A100) forward kernel for ``head_dim``:
    the value ``flash_attn_interface._get_block_size_n`` gives on that device, and the
    width :func:`s_dmask` scales its blocks by (head dims above 256, a fastattn extension,
    take 64)."""
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32 if is_dropout else 64
    return 64


def _round(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


def _encode(p: NDArray, keep: npt.NDArray[np.bool_], width: int) -> NDArray:
    """``(..., L, S)`` weights -> ``P / (max of P over the key's block and the later
    blocks)``, negated where ``keep`` is False; 0 where those blocks hold no weight."""
    S = p.shape[-1]
    nb = -(-S // width)
    padded = np.zeros(p.shape[:-1] + (nb * width,), dtype=np.float64)
    padded[..., :S] = p
    bmax = padded.reshape(p.shape[:-1] + (nb, width)).max(axis=-1)
    later = np.maximum.accumulate(bmax[..., ::-1], axis=-1)[..., ::-1]
    m = np.repeat(later, width, axis=-1)[..., :S]
    e = np.divide(p, m, out=np.zeros(p.shape, dtype=np.float64), where=m > 0)
    signed: NDArray = np.where(keep, e, -e)
    return signed


def s_dmask(
    q: NDArray,
    k: NDArray,
    *,
    cu_seqlens_q: NDArray | None = None,
    cu_seqlens_k: NDArray | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    causal: bool,
    scale: float | None,
    opts: dict[str, Any],
    dropout_p: float,
    dropout_seed: int,
) -> NDArray:
    """The ``S_dmask`` of a checked call (module docstring): dense ``q``/``k``
    ``(batch, seqlen, heads, headdim)`` when ``cu_seqlens_q`` is None, else packed
    ``(total, heads, headdim)`` sequences (sequence ``b``'s positions within it, as the
    dropout mask counts them) whose rows ``max_seqlen_q``/``max_seqlen_k`` round up."""
    D = q.shape[-1]
    width = block_size_n(D, True)
    window, softcap = opts.get("window"), opts.get("softcap")
    slopes = opts.get("alibi_slopes")

    def weights(qs: NDArray, ks: NDArray, sl: NDArray | None) -> NDArray:
        return attention_weights(
            qs,
            ks,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
            layout="bshd",
            window=window,
            softcap=softcap,
            alibi_slopes=sl,
        )

    if cu_seqlens_q is None or cu_seqlens_k is None:  # dense: the shapes give the lengths
        B, L, H = q.shape[0], q.shape[1], q.shape[2]
        S = k.shape[1]
        p = weights(q, k, slopes)
        keep = reference.dropout_mask((B, H, L, S), dropout_p, dropout_seed)
        out = np.zeros((B, H, _round(L), _round(S)), dtype=q.dtype)
        out[:, :, :L, :S] = _encode(p, keep, width)
        return out
    B, H = len(cu_seqlens_q) - 1, q.shape[1]
    out = np.zeros((B, H, _round(max_seqlen_q), _round(max_seqlen_k)), dtype=q.dtype)
    for b in range(B):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        sb = None if slopes is None else (slopes[b] if slopes.ndim == 2 else slopes)
        p = weights(q[None, q0:q1], k[None, k0:k1], sb)[0]
        keep = reference.dropout_mask((1, H, q1 - q0, k1 - k0), dropout_p, dropout_seed, batch_offset=b)[0]
        out[b, :, : q1 - q0, : k1 - k0] = _encode(p, keep, width)
    return out
