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

from ._config import get_float32_matmul_precision
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
    if t.is_nested:
        raise TypeError(
            f"{name} is a nested (jagged) tensor, which fastattn does not take: pad the sequences and "
            "pass a mask, or use fastattn.varlen_attention on the packed sequences"
        )
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


class _Options:
    """The forward's non-tensor arguments: ``is_causal`` (torch's top-left),
    ``scale``, ``enable_gqa``, the float32 ``precision`` captured when the
    forward ran (so the backward recomputes P exactly as the forward did, even
    if the process default changes in between), and the dropout probability
    with the seed of its mask (drawn from torch's generator by the caller, so
    the backward regenerates the forward's mask)."""

    __slots__ = ("is_causal", "scale", "enable_gqa", "precision", "dropout_p", "dropout_seed")

    def __init__(
        self,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        precision: str,
        dropout_p: float = 0.0,
        dropout_seed: int | None = None,
    ) -> None:
        self.is_causal = is_causal
        self.scale = scale
        self.enable_gqa = enable_gqa
        self.precision = precision
        self.dropout_p = dropout_p
        self.dropout_seed = dropout_seed

    def arrays(
        self, mask_t: torch.Tensor | None, L: int, S: int
    ) -> tuple[npt.NDArray[Any] | None, dict[str, Any]]:
        """The NumPy mask and keyword arguments shared by fastattn's forward and backward."""
        mask = None if mask_t is None else _np(mask_t)
        kw: dict[str, Any] = {"scale": self.scale, "enable_gqa": self.enable_gqa, "precision": self.precision}
        if self.dropout_p > 0:
            kw.update(dropout_p=self.dropout_p, dropout_seed=self.dropout_seed)
        if self.is_causal:
            mask, extra = _causal_top_left(mask, L, S)
            kw.update(extra)
        return mask, kw


def _forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask_t: torch.Tensor | None, opts: _Options
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) by fastattn's forward: the eager Function's and the custom op's body."""
    mask, kw = opts.arrays(mask_t, query.shape[-2], key.shape[-2])
    out, lse = _sdpa(_np(query), _np(key), _np(value), mask, return_lse=True, **kw)
    return _torch(out), _torch(lse)


def _backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask_t: torch.Tensor | None,
    opts: _Options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by fastattn's fused backward (both paths' body)."""
    mask, kw = opts.arrays(mask_t, query.shape[-2], key.shape[-2])
    go = _np(grad_out.to(query.dtype))
    dq, dk, dv = scaled_dot_product_attention_backward(
        go, _np(query), _np(key), _np(value), _np(out), _np(lse), mask, **kw
    )
    return _torch(dq), _torch(dk), _torch(dv)


def _batched_front(
    args: tuple[torch.Tensor | None, ...], in_dims: tuple[int | None, ...], size: int, mask_at: int, ndim: int
) -> list[torch.Tensor | None]:
    """For a ``vmap`` rule: every tensor with its vmapped dim moved to the front
    (unbatched query/key/value-like tensors expanded there, a view), so one call
    computes the whole batch as extra leading dims.  The mask (position
    ``mask_at``) is right-aligned against ``ndim``-dim logical inputs: a batched
    one gets singleton dims after the batch dim; an unbatched one broadcasts."""
    res: list[torch.Tensor | None] = []
    for i, (t, d) in enumerate(zip(args, in_dims)):
        if t is None:
            res.append(None)
        elif i == mask_at:
            if d is None:
                res.append(t)
            else:
                t = t.movedim(d, 0)
                pad = ndim - (t.dim() - 1)
                res.append(t.reshape((size,) + (1,) * pad + tuple(t.shape[1:])) if pad > 0 else t)
        elif d is None:
            res.append(t.expand((size,) + tuple(t.shape)))
        else:
            res.append(t.movedim(d, 0))
    return res


def _no_dropout_vmap(opts: _Options) -> None:
    if opts.dropout_p > 0:
        # One seed is drawn outside the vmapped function, and the batched call
        # would give each sample its own mask: neither of vmap's randomness
        # modes ("same" / "different") as torch defines them.
        raise NotImplementedError("dropout_p > 0 under torch.func.vmap is not supported by fastattn")


class _FusedSDPA(torch.autograd.Function):
    """out, lse = attention(query, key, value, mask); lse is saved for the
    backward (an output, so that torch.func transforms accept saving it)."""

    @staticmethod
    def forward(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask_t: torch.Tensor | None,
        opts: _Options,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward(query, key, value, mask_t, opts)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        query, key, value, mask_t, opts = inputs
        out, lse = output
        # All through save_for_backward, the returned output and the user's
        # mask included: torch's version counters then refuse a backward after
        # any of them was modified in place (it would compute wrong gradients).
        ctx.save_for_backward(query, key, value, out, lse, mask_t)
        ctx.mark_non_differentiable(lse)
        ctx.opts = opts

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        query, key, value, out, lse, mask_t = ctx.saved_tensors
        # Through a second Function: its forward gets plain tensors under
        # torch.func.grad (whose wrapped tensors have no NumPy view), and its
        # backward refuses double backward instead of dropping that term.
        dq, dk, dv = _FusedSDPABackward.apply(  # type: ignore[no-untyped-call]  # (torch's apply is untyped)
            grad_out, query, key, value, out, lse, mask_t, ctx.opts
        )
        return dq, dk, dv, None, None

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask_t: torch.Tensor | None,
        opts: _Options,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
        _no_dropout_vmap(opts)
        # The vmapped dim becomes one more leading (batch) dim: one fused call.
        ndim = query.dim() - (in_dims[0] is not None)  # the query's per-sample (logical) dims
        q, k, v, m = _batched_front((query, key, value, mask_t), in_dims[:4], info.batch_size, 3, ndim)
        assert q is not None and k is not None and v is not None
        out, lse = _FusedSDPA.apply(q, k, v, m, opts)  # type: ignore[no-untyped-call]
        return (out, lse), (0, 0)


class _FusedSDPABackward(torch.autograd.Function):
    """(dq, dk, dv) of _FusedSDPA; not differentiable again."""

    @staticmethod
    def forward(
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        mask_t: torch.Tensor | None,
        opts: _Options,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward(grad_out, query, key, value, out, lse, mask_t, opts)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        # torch's flash backend refuses the same way ("derivative for
        # aten::_scaled_dot_product_flash_attention_backward is not implemented").
        raise RuntimeError(
            "fastattn.torch_compat.scaled_dot_product_attention does not support double backward: "
            "its gradient (taken with create_graph=True, or under torch.func.grad) cannot be "
            "differentiated again (e.g. a gradient penalty); use torch.nn.functional."
            "scaled_dot_product_attention for that"
        )

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        mask_t: torch.Tensor | None,
        opts: _Options,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[int, int, int]]:
        _no_dropout_vmap(opts)
        args = _batched_front(
            (grad_out, query, key, value, out, lse, mask_t),
            in_dims[:7],
            info.batch_size,
            6,
            query.dim() - (in_dims[1] is not None),
        )
        res = _FusedSDPABackward.apply(*args, opts)  # type: ignore[no-untyped-call]
        return res, (0, 0, 0)


# Under torch.compile the call is this custom op (Dynamo cannot trace the NumPy
# views of the eager path): its fake gives the output shapes, so a compiled
# graph keeps it whole (fullgraph=True), and AOTAutograd differentiates it
# through fastattn::sdpa_backward (its autograd formula; that op has none, so a
# double backward raises).  Same kernels as the eager path.  The float32
# precision is the one in effect when the graph was traced.
@torch.library.custom_op("fastattn::sdpa", mutates_args=())
def _sdpa_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    precision: str,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    opts = _Options(is_causal, scale, enable_gqa, precision, dropout_p, _seed_int(dropout_seed))
    return _forward(query, key, value, attn_mask, opts)


@_sdpa_op.register_fake
def _sdpa_op_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    # fastattn's results: C-contiguous, out in the query's dtype, lse float32 (float64 for float64)
    rows = tuple(query.shape[:-1])
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return query.new_empty(rows + (value.shape[-1],)), query.new_empty(rows, dtype=lse_dtype)


@torch.library.custom_op("fastattn::sdpa_backward", mutates_args=())
def _sdpa_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    precision: str,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = _Options(is_causal, scale, enable_gqa, precision, dropout_p, _seed_int(dropout_seed))
    return _backward(grad_out, query, key, value, out, lse, attn_mask, opts)


@_sdpa_backward_op.register_fake
def _sdpa_backward_op_fake(
    grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _op_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    query, key, value, attn_mask, is_causal, scale, enable_gqa, precision, *rest = inputs
    dropout_p, dropout_seed = (list(rest) + [0.0, None])[len(rest) - 2 :] if len(rest) < 2 else rest
    ctx.save_for_backward(query, key, value, output[0], output[1], attn_mask, dropout_seed)
    ctx.mark_non_differentiable(output[1])
    ctx.opts = (is_causal, scale, enable_gqa, precision, dropout_p)


def _op_backward(ctx: Any, grad_out: torch.Tensor | None, _grad_lse: torch.Tensor | None) -> tuple[Any, ...]:
    query, key, value, out, lse, attn_mask, seed = ctx.saved_tensors
    go = torch.zeros_like(out) if grad_out is None else grad_out
    dq, dk, dv = torch.ops.fastattn.sdpa_backward(go, query, key, value, out, lse, attn_mask, *ctx.opts, seed)
    return dq, dk, dv, None, None, None, None, None, None, None


_sdpa_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def _seed_int(seed: torch.Tensor | None) -> int | None:
    """The dropout seed as fastattn takes it (a 0-d int64 tensor in the ops: a
    tensor, so that a compiled graph draws a fresh one per call)."""
    if seed is None:
        return None
    if torch._C._functorch.is_batchedtensor(seed):  # vmap(randomness="different") drew one per sample
        raise NotImplementedError("dropout_p > 0 under torch.func.vmap is not supported by fastattn")
    return int(seed) % (1 << 64)


def _draw_seed() -> torch.Tensor:
    """A dropout seed from torch's default CPU generator (``torch.manual_seed``
    makes the masks reproducible, as it does torch's dropout)."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)


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
    requires grad is refused while autograd records; under ``torch.no_grad()``
    or ``torch.inference_mode()`` it is accepted).  is_causal: **top-left** as torch (query i sees
    keys j <= i, also when L != S), combined with attn_mask when both are given,
    as torch 2.13 does.  scale: None = 1/sqrt(D).  enable_gqa: Hq a multiple of
    Hk.  dropout_p: torch's attention dropout (each weight zeroed with that
    probability, the rest scaled by 1 / (1 - dropout_p), whenever dropout_p > 0,
    as torch's function does: the caller passes 0 in eval mode); the mask is
    fastattn's Philox mask (fastattn.reference.dropout_mask) keyed by a seed drawn
    from torch's default generator, so ``torch.manual_seed`` reproduces it, but
    it is not the mask torch would draw; the backward regenerates it.  Not under
    ``torch.func.vmap`` (NotImplementedError).  A row with no
    visible key gives zeros (as torch 2.13 on the CPU) and zero gradients.

    As torch: under ``torch.autocast("cpu")`` every floating input but float64
    (the mask included) is cast to the autocast dtype; ``torch.func.vmap`` and
    ``torch.func.grad`` (and their compositions) work; under ``torch.compile``
    (``fullgraph=True`` too) the call is the custom op ``torch.ops.fastattn.sdpa``
    (its backward ``torch.ops.fastattn.sdpa_backward``), kept whole in the
    graph, with the float32 precision in effect when it was traced; the backward refuses to
    run after the output, an input or the mask was modified in place; the
    gradient is not differentiable again (double backward, e.g. a gradient
    penalty, raises RuntimeError).  float32 is computed at
    ``fastattn.get_float32_matmul_precision()`` as of the forward call, by the
    forward and its backward alike.

    Parameters
    ----------
    query : torch.Tensor
        ``(..., Hq, L, D)``.
    key : torch.Tensor
        ``(..., Hk, S, D)``.
    value : torch.Tensor
        ``(..., Hk, S, Dv)``.
    attn_mask : torch.Tensor, optional
        Bool (True = may attend) or float (added), broadcastable to ``(..., Hq, L, S)``.
    dropout_p : float, default 0.0
        Attention dropout probability in [0, 1], as described above.
    is_causal : bool, default False
        Top-left causal mask, as torch.
    scale : float, optional
        Score scale; None means ``1/sqrt(D)``.
    enable_gqa : bool, default False
        Allow Hq a multiple of Hk.

    Returns
    -------
    torch.Tensor
        ``(..., Hq, L, Dv)`` in query's dtype.

    Examples
    --------
    Needs torch.

    >>> import torch  # doctest: +SKIP
    >>> from fastattn.torch_compat import scaled_dot_product_attention  # doctest: +SKIP
    >>> q, k, v = torch.randn(3, 1, 2, 4, 8, requires_grad=True)  # doctest: +SKIP
    >>> out = scaled_dot_product_attention(q, k, v, is_causal=True)  # doctest: +SKIP
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # doctest: +SKIP
    >>> torch.allclose(out, ref, atol=1e-5)  # doctest: +SKIP
    True
    >>> out.sum().backward()  # doctest: +SKIP
    """
    for t, n in ((query, "query"), (key, "key"), (value, "value")):
        _check_tensor(t, n)
        if t.dtype not in _DTYPES:
            raise TypeError(f"{n} must be float32, float64, float16 or bfloat16, got {t.dtype}")
    if attn_mask is not None:
        _check_tensor(attn_mask, "attn_mask")
    if torch.is_autocast_enabled("cpu"):
        # torch's autocast rule for SDPA (a lower-precision op on the CPU): every
        # floating input except float64, the mask included, is cast to the
        # autocast dtype (a differentiable cast: gradients return in the
        # caller's dtype).
        low = torch.get_autocast_dtype("cpu")

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(low) if t.is_floating_point() and t.dtype != torch.float64 else t

        query, key, value = cast(query), cast(key), cast(value)
        if attn_mask is not None:
            attn_mask = cast(attn_mask)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must have the same dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    drop_p = float(dropout_p)
    if not 0.0 <= drop_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if attn_mask is not None and attn_mask.requires_grad:
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "attn_mask is a constant here: gradients with respect to it are not computed "
                "(under torch.no_grad() or torch.inference_mode() such a mask is accepted)"
            )
        attn_mask = attn_mask.detach()  # nothing is recorded: it is just a constant
    if query.dim() < 2:
        raise ValueError(f"query must have at least 2 dimensions, got shape {tuple(query.shape)}")
    precision = get_float32_matmul_precision()
    seed = _draw_seed() if drop_p > 0 else None
    if torch.compiler.is_compiling():
        sc = None if scale is None else float(scale)
        flags = (bool(is_causal), sc, bool(enable_gqa), precision, drop_p, seed)
        compiled: torch.Tensor = torch.ops.fastattn.sdpa(query, key, value, attn_mask, *flags)[0]
        return compiled
    opts = _Options(bool(is_causal), scale, bool(enable_gqa), precision, drop_p, _seed_int(seed))
    out: torch.Tensor = _FusedSDPA.apply(query, key, value, attn_mask, opts)[0]
    return out
