"""A Hugging Face transformers attention backend: ``attn_implementation="fastattn"``.

::

    import fastattn.hf
    from transformers import AutoModel

    fastattn.hf.register()
    model = AutoModel.from_pretrained(name, attn_implementation="fastattn")

:func:`register` adds :func:`attention_forward` to transformers'
``AttentionInterface`` and, under the same name, the mask function of the
``"sdpa"`` backend to ``AttentionMaskInterface`` (models then build the same
4-D boolean masks, True = attend, as for sdpa, or no mask at all when causality
alone describes it).  Every attention call of a model that supports attention
backends then runs fastattn's fused CPU kernel.

What :func:`attention_forward` covers, with sdpa's semantics:

- CPU tensors float32, float64, float16 and bfloat16, read in place as NumPy
  views (bfloat16 through an int16 view) and the output written straight into
  the ``(batch, seq, heads, head_dim)`` tensor the model expects: no copies;
- ``attention_mask``: None, a bool 4-D mask (True = attend) or an additive
  float mask, broadcast in place; ``is_causal`` (the kwarg, else the module's
  attribute) applies when there is no mask and more than one query, top-left
  aligned as torch's;
- ``scaling``; grouped-query attention (key/value with fewer heads, no
  ``repeat_kv`` copies); the KV cache of ``generate`` (the keys arrive already
  concatenated);
- ``sliding_window``: carried by the mask, as for sdpa (the mask function
  builds the window into it and skips the mask only when the window cannot
  matter);
- ``softcap`` (Gemma 2) and ``s_aux``, gpt-oss' attention sinks: computed by
  the kernel (sdpa refuses both);
- ``position_bias`` (an additive bias, T5-style) joins the mask.

``dropout`` (transformers passes the module's ``attention_dropout`` in
``train()`` mode, 0 in ``eval()``) is applied as torch's sdpa applies it,
through :func:`fastattn.torch_compat.scaled_dot_product_attention` (fused
forward and backward, the mask fastattn's Philox mask keyed by a seed from
torch's generator); dropout with softcap, sinks or a position bias, or with
``output_attentions=True``, raises ``NotImplementedError``.  While autograd records and an input requires
grad, the call is differentiable: through
:func:`fastattn.torch_compat.scaled_dot_product_attention` (fused backward) when no
softcap, sinks or position bias are involved; with softcap or sinks (a constant
position bias joining the mask) through fastattn's fused forward and backward
(:func:`fastattn.scaled_dot_product_attention_backward`, whose ``dsinks`` is the
gradient of ``s_aux``); with a position bias that requires grad (T5's learned
relative bias) by torch operations as the "eager" backend computes it (the
``(L, S)`` scores are formed: fastattn's backward gives no bias gradient).  The
gradient is not differentiable again (double backward raises).
``output_attentions=True`` (the model's kwarg) returns the
attention weights ``(batch, heads, q_len, kv_len)`` in the query's dtype, as
the "eager" backend does (sdpa only warns and returns none): computed by
:func:`fastattn.attention_weights` from the kernel's own normalisers (the
weights that produced the output; a row that sees no key is zeros), or, while
autograd records, by differentiable torch operations.  Otherwise the weights
are ``None``, as sdpa.

Neither ``import fastattn`` nor ``import fastattn.hf`` imports transformers or
torch; :func:`register` imports transformers.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import numpy as np

from . import _torch_bridge
from .backward import scaled_dot_product_attention_backward
from .functional import scaled_dot_product_attention
from .weights import attention_weights

__all__ = ["register", "attention_forward", "NAME"]

NAME = "fastattn"


def register(name: str = NAME) -> str:
    """Register fastattn with transformers as the attention implementation ``name``
    (default ``"fastattn"``), with sdpa's mask function.  Returns ``name``.

    Then ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` selects it.  Registering twice is
    harmless.

    Parameters
    ----------
    name : str, default "fastattn"
        The attention implementation's name in transformers.

    Returns
    -------
    str
        ``name``.

    Examples
    --------
    Needs transformers.

    >>> import fastattn.hf
    >>> fastattn.hf.register()  # doctest: +SKIP
    'fastattn'
    >>> from transformers import AutoModel  # doctest: +SKIP
    >>> model = AutoModel.from_pretrained("gpt2", attn_implementation="fastattn")  # doctest: +SKIP
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    try:
        # (transformers is optional and may be absent, or present without type information)
        from transformers import AttentionInterface  # type: ignore[import-not-found, import-untyped, unused-ignore]
        from transformers.masking_utils import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
            AttentionMaskInterface,
            sdpa_mask,
        )
    except ImportError as e:  # pragma: no cover - exercised without transformers
        raise ImportError(
            "fastattn.hf.register() needs transformers with AttentionInterface and "
            f"AttentionMaskInterface (pip install '.[hf]' from a clone): {e}"
        ) from None
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _grad_needed(*tensors: Any) -> bool:
    torch = _torch_bridge.torch_module()
    return bool(torch.is_grad_enabled()) and any(t is not None and t.requires_grad for t in tensors)


def attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    s_aux: Any = None,
    position_bias: Any = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """transformers' attention-function interface, computed by fastattn.

    query ``(batch, heads, q_len, head_dim)``, key/value ``(batch, kv_heads,
    kv_len, head_dim)`` CPU tensors; returns ``(output (batch, q_len, heads,
    head_dim_v), weights)``: weights ``(batch, heads, q_len, kv_len)`` when
    ``output_attentions=True`` is passed, else None.  See the module docstring
    for each argument.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer calling (its ``is_causal`` is read when the kwarg is None).
    query : torch.Tensor
        ``(batch, heads, q_len, head_dim)``.
    key, value : torch.Tensor
        ``(batch, kv_heads, kv_len, head_dim)``.
    attention_mask : torch.Tensor or None
        Bool 4-D mask (True = attend) or an additive float mask.
    dropout : float, default 0.0
        Attention dropout probability (transformers passes 0 in eval mode), as described above.
    scaling : float, optional
        Score scale; None means ``1/sqrt(head_dim)``.
    is_causal : bool, optional
        Causal (top-left) without a mask and with more than one query; None reads
        the module's ``is_causal`` (True when it has none).
    softcap : float, optional
        Gemma 2's score cap.
    sliding_window : int, optional
        Carried by the mask, as for sdpa.
    s_aux : torch.Tensor, optional
        Attention sinks, one logit per head (gpt-oss).
    position_bias : torch.Tensor, optional
        An additive bias (T5-style), joined to the mask.
    **kwargs
        The model's other kwargs; ``output_attentions`` is read.

    Returns
    -------
    output : torch.Tensor
        ``(batch, q_len, heads, head_dim_v)``.
    weights : torch.Tensor or None
        ``(batch, heads, q_len, kv_len)`` with ``output_attentions=True``, else None.

    Examples
    --------
    Needs torch (transformers calls it; a direct call works too).

    >>> import torch  # doctest: +SKIP
    >>> from fastattn.hf import attention_forward  # doctest: +SKIP
    >>> q, k, v = torch.randn(3, 1, 2, 4, 8)  # doctest: +SKIP
    >>> out, w = attention_forward(None, q, k, v, None, is_causal=True)  # doctest: +SKIP
    >>> out.shape, w  # doctest: +SKIP
    (torch.Size([1, 4, 2, 8]), None)
    """
    for t, n in ((query, "query"), (key, "key"), (value, "value")):
        if not _torch_bridge.is_tensor(t):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(dropout, (bool, np.bool_)) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"dropout must be a number, got {type(dropout).__name__}")
    drop = float(dropout)
    if not 0.0 <= drop <= 1.0:
        raise ValueError(f"dropout must be in [0, 1], got {dropout}")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "query, key and value must be 4-D (batch, heads, seq, head_dim), got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    B, Hq, L, D = query.shape
    S = key.shape[2]
    # transformers passes the model's output_attentions through to the attention function;
    # its hooks then collect what comes back as the weights.
    want_weights = bool(kwargs.get("output_attentions", False))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    mask = attention_mask
    if mask is not None:
        if not _torch_bridge.is_tensor(mask):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dim() != 4:
            raise ValueError(
                f"attention_mask must be 4-D (batch, 1 or heads, q_len, kv_len), got {tuple(mask.shape)}"
            )
        if mask.shape[-1] > S:  # (as eager: a mask built for a longer, e.g. static, cache)
            mask = mask[..., :S]
    # sdpa's rule: is_causal only without a mask and with more than one query.
    causal = causal and mask is None and L > 1

    cap = None if softcap is None or softcap == 0 else softcap
    if drop > 0 and (cap is not None or s_aux is not None or position_bias is not None or want_weights):
        raise NotImplementedError(
            f"dropout={dropout} with softcap, s_aux (sinks), position_bias or output_attentions=True is "
            "not supported by fastattn (dropout is supported in plain attention calls)"
        )
    grad = _grad_needed(query, key, value, s_aux, position_bias)
    if grad and _torch_bridge.is_tensor(position_bias) and position_bias.requires_grad:
        # A learned bias: torch operations, as eager (fastattn's backward has no bias gradient).
        w = _torch_weights(query, key, mask, causal, scaling, cap, s_aux, position_bias)
        o = _matmul_gqa(w, value)
        return o.transpose(1, 2).contiguous(), (w if want_weights else None)
    if grad and (cap is not None or s_aux is not None or position_bias is not None):
        sinks_t = s_aux if _torch_bridge.is_tensor(s_aux) else None
        q, k, v, m, opts, sinks = _arrays(query, key, value, mask, causal, position_bias, s_aux)
        spec = _FusedSpec(q, k, v, m, opts, sinks, scaling, cap, key.shape[2])
        out = _fused_function().apply(query, key, value, sinks_t, spec)
        weights = (
            _torch_weights(query, key, mask, causal, scaling, cap, s_aux, position_bias)
            if want_weights
            else None
        )
        return out.transpose(1, 2).contiguous(), weights
    plain = cap is None and s_aux is None and position_bias is None
    if grad or drop > 0 or (plain and _torch_bridge.is_compiling()):
        # (under torch.compile: torch_compat's custom op, which the graph keeps whole)
        from .torch_compat import scaled_dot_product_attention as torch_sdpa

        out = torch_sdpa(
            query,
            key,
            value,
            mask,
            dropout_p=drop,
            is_causal=causal,
            scale=scaling,
            enable_gqa=key.shape[1] != Hq,
        )
        weights = _torch_weights(query, key, mask, causal, scaling) if want_weights else None
        return out.transpose(1, 2).contiguous(), weights

    q, k, v, m, opts, sinks = _arrays(query, key, value, mask, causal, position_bias, s_aux)
    weights = None
    if want_weights:
        w = attention_weights(
            q, k, m, scale=scaling, enable_gqa=k.shape[1] != Hq, softcap=cap, sinks=sinks, **opts
        )
        if w.shape[-1] < key.shape[2]:  # keys cropped above (never visible): zero weights, as eager
            w = np.concatenate([w, np.zeros(w.shape[:-1] + (key.shape[2] - w.shape[-1],), w.dtype)], -1)
        weights = _torch_bridge.from_numpy(w).to(query.dtype)  # (eager: float32 softmax, then this cast)
    buf = np.empty((B, L, Hq, v.shape[3]), dtype=q.dtype)
    scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=m,
        scale=scaling,
        enable_gqa=k.shape[1] != Hq,
        out=np.swapaxes(buf, 1, 2),  # the kernel writes (B, L, H, Dv) directly
        softcap=cap,
        sinks=sinks,
        **opts,
    )
    return _torch_bridge.from_numpy(buf), weights


def _arrays(
    query: Any, key: Any, value: Any, mask: Any, causal: bool, position_bias: Any, s_aux: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, dict[str, Any], np.ndarray | None]:
    """NumPy views of the call's tensors and fastattn's options for them: ``(q, k, v,
    mask, opts, sinks)``, torch's top-left causal as fastattn's options (keys that are
    never visible cropped), a position bias folded into the mask."""
    q = _torch_bridge.to_numpy(query.detach(), "query")
    k = _torch_bridge.to_numpy(key.detach(), "key")
    v = _torch_bridge.to_numpy(value.detach(), "value")
    L, S = q.shape[2], k.shape[2]
    m = None if mask is None else _torch_bridge.to_numpy(mask.detach(), "attention_mask")
    opts: dict[str, Any] = {}
    if causal:
        # torch's causal is top-left: query i sees keys j <= i.  fastattn's is
        # bottom-right; they agree when L == S.  L < S (a static cache's empty
        # slots): the keys past L are never visible, so they are cropped, as sdpa
        # does.  L > S: the window (unbounded, L - S) at bottom-right positions.
        if S > L:
            k, v, S = k[:, :, :L], v[:, :, :L], L
        if L == S:
            opts["is_causal"] = True
        else:
            opts["window"] = (-1, L - S)
    if position_bias is not None:
        pb = position_bias.detach() if _torch_bridge.is_tensor(position_bias) else position_bias
        pb = _torch_bridge.to_numpy(pb, "position_bias")[..., :S].astype(np.float32)
        if opts:  # fold the causal restriction into the additive bias
            tri = np.tri(L, S, dtype=bool)  # top-left: j <= i
            pb = np.where(tri, pb, np.float32(-np.inf))
            opts = {}
        if m is None:
            m = pb
        elif m.dtype == np.bool_:
            m = np.where(m, pb, np.float32(-np.inf))
        else:
            m = pb + m.astype(np.float32)
    sinks = None
    if s_aux is not None:
        sinks = _torch_bridge.to_numpy(s_aux.detach(), "s_aux") if _torch_bridge.is_tensor(s_aux) else s_aux
        sinks = np.asarray(sinks, dtype=np.float32)
    return q, k, v, m, opts, sinks


class _FusedSpec:
    """What the fused Function's forward and backward share: the NumPy views and
    options of :func:`_arrays` (K/V possibly cropped to the keys ever visible), the
    scale, the softcap and the full key length S (the cropped keys get zero gradients)."""

    def __init__(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        m: np.ndarray | None,
        opts: dict[str, Any],
        sinks: np.ndarray | None,
        scale: float | None,
        cap: float | None,
        S: int,
    ) -> None:
        self.q, self.k, self.v = q, k, v
        self.kw: dict[str, Any] = dict(
            attn_mask=m, scale=scale, enable_gqa=k.shape[1] != q.shape[1], softcap=cap, sinks=sinks, **opts
        )
        self.S = S
        self.lse: np.ndarray | None = None  # the forward's, for the backward


@functools.cache
def _fused_function() -> Any:
    """The autograd Function of the softcap / sinks path (made on first use: torch is optional)."""
    import torch

    class FusedHF(torch.autograd.Function):
        @staticmethod
        def forward(query: Any, key: Any, value: Any, sinks_t: Any, spec: _FusedSpec) -> Any:
            out, lse = scaled_dot_product_attention(spec.q, spec.k, spec.v, return_lse=True, **spec.kw)
            spec.lse = lse
            return _torch_bridge.from_numpy(out)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            query, key, value, sinks_t, spec = inputs
            # the version counters refuse a backward after an in-place change
            ctx.save_for_backward(query, key, value, output, *(() if sinks_t is None else (sinks_t,)))
            ctx.spec = spec

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> tuple[Any, ...]:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "fastattn.hf's gradient with softcap or sinks cannot be differentiated again "
                    "(double backward)"
                )
            saved = ctx.saved_tensors  # (reading them checks that none was modified in place)
            out = saved[3]
            spec = ctx.spec
            go = _torch_bridge.to_numpy(grad_out.to(out.dtype), "grad_out")
            res = scaled_dot_product_attention_backward(
                go, spec.q, spec.k, spec.v, _torch_bridge.to_numpy(out, "out"), spec.lse, **spec.kw
            )
            pad = spec.S - spec.k.shape[2]  # keys cropped as never visible: zero gradients

            def full(d: np.ndarray) -> Any:
                if pad:
                    d = np.concatenate([d, np.zeros(d.shape[:2] + (pad,) + d.shape[3:], d.dtype)], axis=2)
                return _torch_bridge.from_numpy(d)

            dsinks = None
            if len(saved) == 5:
                dsinks = torch.from_numpy(np.asarray(res[3])).to(saved[4].dtype).reshape(saved[4].shape)
            return _torch_bridge.from_numpy(res[0]), full(res[1]), full(res[2]), dsinks, None

    return FusedHF


def _matmul_gqa(w: Any, value: Any) -> Any:
    """``w @ value`` with value's heads repeated for grouped-query attention (torch ops)."""
    rep = w.shape[1] // value.shape[1]
    v = value.repeat_interleave(rep, dim=1) if rep > 1 else value
    return w.to(v.dtype) @ v


def _torch_weights(
    query: Any,
    key: Any,
    mask: Any,
    causal: bool,
    scaling: float | None,
    softcap: float | None = None,
    sinks: Any = None,
    bias: Any = None,
) -> Any:
    """The attention weights as differentiable torch operations (the grad path), in
    eager's order (scale, softcap, bias and mask, sinks as one more logit per row
    that is dropped after the softmax), softmax in float32 as eager; a row that sees
    no key (and has no sink) is zeros, as fastattn's kernel and output give."""
    torch = _torch_bridge.torch_module()
    B, Hq, L, D = query.shape
    S = key.shape[2]
    k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scale = D**-0.5 if scaling is None else scaling
    scores = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + torch.as_tensor(bias)[..., :S].float()
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    if causal:  # top-left, as torch: query i sees keys j <= i
        tri = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~tri, float("-inf"))
    if sinks is not None:  # one more logit per row and head, dropped after the softmax
        sink = torch.as_tensor(sinks).float().reshape(1, -1, 1, 1).expand(B, Hq, L, 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(query.dtype)
    # Rows without a visible key: softmax of zeros times 0 (no NaN, in the values or their gradients).
    seen = torch.isfinite(scores).any(dim=-1, keepdim=True)
    scores = torch.where(seen, scores, torch.zeros((), dtype=scores.dtype))
    return (torch.softmax(scores, dim=-1) * seen).to(query.dtype)
