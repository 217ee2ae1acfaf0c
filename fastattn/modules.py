"""``MultiHeadAttention``: the projections around the fused kernel, with the
weights, arguments and conventions of ``torch.nn.MultiheadAttention``.

Inputs are ``(L, B, E)`` by default (``batch_first=False``, torch's default),
``(B, L, E)`` with ``batch_first=True``, or unbatched ``(L, E)``.  The
projected queries/keys/values are handed to the kernel as strided views in its
``"bshd"`` layout, so neither layout is transposed in memory; grouped-query
attention (``num_kv_heads < num_heads``) uses ``enable_gqa`` and never repeats
keys.

Masks follow torch.nn.MultiheadAttention (note: the OPPOSITE bool polarity of
``fastattn.scaled_dot_product_attention`` and torch's SDPA):

=====================  ====================================  ===================
argument               bool                                  float
=====================  ====================================  ===================
``key_padding_mask``   True = padding, NOT allowed (ignored)  added to the scores
``attn_mask``          True = NOT allowed                     added to the scores
=====================  ====================================  ===================

A mask for ``fastattn.scaled_dot_product_attention`` (True = may attend) is
passed here as ``~mask``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from ._args import sdpa_call
from ._checks import as_array, int_value
from ._config import Precision, precision_code

__all__ = ["MultiHeadAttention"]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# need_weights materialises (B, num_heads, L, S) weights (and temporaries of
# that size): calls that would need more than this raise ValueError instead of
# exhausting memory.  A module attribute, so that a caller can raise it.
NEED_WEIGHTS_MAX_BYTES = 1 << 30


def _pos_int(x: Any, name: str) -> int:
    return int_value(x, name, 1)


def _flag(x: Any, name: str) -> bool:
    """A bool argument: True/False (or NumPy's bool); anything else is a TypeError."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return bool(x)


def _to_numpy(x: Any, name: str) -> np.ndarray:
    """A torch tensor (detached, on the CPU) or an array-like as a NumPy array."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu()
        if str(getattr(x, "dtype", "")) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    return as_array(x, name)


class MultiHeadAttention:
    """Multi-head attention: ``out_proj(attention(q_proj(query), k_proj(key), v_proj(value)))``,
    a drop-in for ``torch.nn.MultiheadAttention`` at inference (``from_torch`` loads one).

    Calls follow torch: ``mha(query, key, value, key_padding_mask=None,
    need_weights=True, attn_mask=None, average_attn_weights=True,
    is_causal=False)`` returns ``(attn_output, attn_weights or None)``; inputs
    are ``(L, B, E)`` unless ``batch_first=True``.  Masks as in torch: bool
    **True = NOT allowed** for both ``key_padding_mask`` and ``attn_mask``
    (the opposite of ``fastattn.scaled_dot_product_attention``), float masks
    are added.

    Parameters
    ----------
    embed_dim : int
        E, the query (and output) feature size; a multiple of ``num_heads``.
    num_heads : int
        Query heads H; ``head_dim = embed_dim // num_heads``.
    num_kv_heads : int, optional
        Key/value heads Hk (a divisor of ``num_heads``); fewer than H gives
        grouped-query attention (Hk = 1: multi-query attention).  Default H.
    kdim, vdim : int, optional
        Feature sizes of ``key`` and ``value`` (cross-attention); default E.
    bias : bool
        Add biases to the four projections.
    batch_first : bool
        False (torch's default): inputs and output are ``(L, B, E)``; True:
        ``(B, L, E)``.  Unbatched ``(L, E)`` inputs work either way.
    dtype : float32 or float64
        Dtype of the weights and of the computation; inputs are converted to it.
    seed : int or numpy.random.Generator, optional
        Source of the initial weights, drawn like torch's: Xavier-uniform
        input projections (on the packed ``(E + 2*Hk*head_dim, E)`` matrix when
        ``kdim == vdim == E``, else each separately), the output projection
        uniform in ``±1/sqrt(E)``, all biases zero.

    Attributes
    ----------
    q_proj_weight (E, E), k_proj_weight (Hk*head_dim, kdim),
    v_proj_weight (Hk*head_dim, vdim), out_proj_weight (E, E): NumPy arrays
    ``(out_features, in_features)`` (``y = x @ W.T + b``);
    q_proj_bias, k_proj_bias, v_proj_bias, out_proj_bias: NumPy arrays or None.

    Examples
    --------
    >>> mha = fastattn.MultiHeadAttention(8, 2, num_kv_heads=1, batch_first=True, seed=0)
    >>> mha.head_dim, mha.kv_dim, mha.k_proj_weight.shape
    (4, 4, (4, 8))
    >>> x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)
    >>> out, _ = mha(x, need_weights=False)
    >>> out.shape
    (1, 3, 8)
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        batch_first: bool = False,
        dtype: npt.DTypeLike = np.float32,
        seed: int | None = None,
    ) -> None:
        self.embed_dim = _pos_int(embed_dim, "embed_dim")
        self.num_heads = _pos_int(num_heads, "num_heads")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.num_kv_heads = self.num_heads if num_kv_heads is None else _pos_int(num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.kdim = self.embed_dim if kdim is None else _pos_int(kdim, "kdim")
        self.vdim = self.embed_dim if vdim is None else _pos_int(vdim, "vdim")
        self.batch_first = _flag(batch_first, "batch_first")
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
        if dt not in _DTYPES:
            raise TypeError(f"dtype must be float32 or float64, got {dt}")
        self.dtype: np.dtype[Any] = dt
        self.head_dim = self.embed_dim // self.num_heads
        self.bias = bool(bias)
        self._init_weights(np.random.default_rng(seed))

    # ------------------------------------------------------------------ weights
    @property
    def kv_dim(self) -> int:
        """Output features of the key and value projections: ``num_kv_heads * head_dim``.

        Returns
        -------
        int
            ``num_kv_heads * head_dim``.

        Examples
        --------
        >>> fastattn.MultiHeadAttention(16, 4, num_kv_heads=2).kv_dim
        8
        """
        return self.num_kv_heads * self.head_dim

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        E, kv = self.embed_dim, self.kv_dim
        return {
            "q_proj_weight": (E, E),
            "k_proj_weight": (kv, self.kdim),
            "v_proj_weight": (kv, self.vdim),
            "out_proj_weight": (E, E),
            "q_proj_bias": (E,),
            "k_proj_bias": (kv,),
            "v_proj_bias": (kv,),
            "out_proj_bias": (E,),
        }

    @property
    def _packed(self) -> bool:
        return self.kdim == self.embed_dim and self.vdim == self.embed_dim

    def _init_weights(self, rng: np.random.Generator) -> None:
        E, kv, dt = self.embed_dim, self.kv_dim, self.dtype

        def xavier(fan_out: int, fan_in: int) -> np.ndarray:
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-bound, bound, size=(fan_out, fan_in)).astype(dt)

        if self._packed:
            w = xavier(E + 2 * kv, E)
            self.q_proj_weight, self.k_proj_weight, self.v_proj_weight = (
                np.ascontiguousarray(w[:E]),
                np.ascontiguousarray(w[E : E + kv]),
                np.ascontiguousarray(w[E + kv :]),
            )
        else:
            self.q_proj_weight = xavier(E, E)
            self.k_proj_weight = xavier(kv, self.kdim)
            self.v_proj_weight = xavier(kv, self.vdim)
        # torch's Linear init (kaiming_uniform with a=sqrt(5)) is uniform(+-1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(E)
        self.out_proj_weight = rng.uniform(-bound, bound, size=(E, E)).astype(dt)
        if self.bias:
            self.q_proj_bias = np.zeros(E, dt)
            self.k_proj_bias = np.zeros(kv, dt)
            self.v_proj_bias = np.zeros(kv, dt)
            self.out_proj_bias = np.zeros(E, dt)
        else:
            self.q_proj_bias = self.k_proj_bias = self.v_proj_bias = self.out_proj_bias = None  # type: ignore[assignment]  # (None only with bias=False; every reader checks self.bias)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The weights under ``torch.nn.MultiheadAttention``'s names (copies):
        ``in_proj_weight`` (packed q, k, v rows) when ``kdim == vdim == embed_dim``,
        else ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``; then
        ``in_proj_bias`` (packed), ``out_proj.weight`` and ``out_proj.bias``
        (biases only when ``bias=True``).

        Returns
        -------
        dict of str to ndarray
            Copies of the weights, under torch's names.

        Examples
        --------
        >>> mha = fastattn.MultiHeadAttention(8, 2, seed=0)
        >>> {k: v.shape for k, v in mha.state_dict().items()}
        {'in_proj_weight': (24, 8), 'in_proj_bias': (24,), 'out_proj.weight': (8, 8), 'out_proj.bias': (8,)}
        """
        d = {}
        if self._packed:
            d["in_proj_weight"] = np.concatenate([self.q_proj_weight, self.k_proj_weight, self.v_proj_weight])
        else:
            d["q_proj_weight"] = self.q_proj_weight.copy()
            d["k_proj_weight"] = self.k_proj_weight.copy()
            d["v_proj_weight"] = self.v_proj_weight.copy()
        if self.bias:
            d["in_proj_bias"] = np.concatenate([self.q_proj_bias, self.k_proj_bias, self.v_proj_bias])
        d["out_proj.weight"] = self.out_proj_weight.copy()
        if self.bias:
            d["out_proj.bias"] = self.out_proj_bias.copy()
        return d

    def load_state_dict(self, state_dict: Any) -> None:
        """Load weights named as in :meth:`state_dict` (NumPy arrays or torch
        tensors, e.g. ``torch_mha.state_dict()``); converted to ``self.dtype``.
        Every expected key must be present, with the right shape, and no other.

        Parameters
        ----------
        state_dict : mapping of str to array_like
            The weights, named as :meth:`state_dict` names them.

        Returns
        -------
        None
            The weights are replaced in place (copies of the given arrays).

        Examples
        --------
        >>> a = fastattn.MultiHeadAttention(8, 2, seed=0)
        >>> b = fastattn.MultiHeadAttention(8, 2, seed=1)
        >>> b.load_state_dict(a.state_dict())
        >>> bool(np.array_equal(a.q_proj_weight, b.q_proj_weight))
        True
        """
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        E, kv = self.embed_dim, self.kv_dim
        expected = set(self.state_dict())
        got = set(state_dict.keys())
        if got != expected:
            missing, extra = sorted(expected - got), sorted(got - expected)
            raise ValueError(
                f"state_dict keys do not match this module: missing {missing}, unexpected {extra}"
            )
        arrs = {}
        for name in expected:
            a = _to_numpy(state_dict[name], f"state_dict[{name!r}]")
            if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
                raise TypeError(f"state_dict[{name!r}] must be a real array, got dtype {a.dtype}")
            arrs[name] = np.array(a, dtype=self.dtype)  # a copy: never aliases the caller's arrays
        new = {}
        if self._packed:
            w = arrs["in_proj_weight"]
            if w.shape != (E + 2 * kv, E):
                raise ValueError(
                    f"state_dict['in_proj_weight'] must have shape {(E + 2 * kv, E)}, got {w.shape}"
                )
            new["q_proj_weight"], new["k_proj_weight"], new["v_proj_weight"] = (
                np.ascontiguousarray(w[:E]),
                np.ascontiguousarray(w[E : E + kv]),
                np.ascontiguousarray(w[E + kv :]),
            )
        else:
            for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                new[n] = arrs[n]
        new["out_proj_weight"] = arrs["out_proj.weight"]
        if self.bias:
            b = arrs["in_proj_bias"]
            if b.shape != (E + 2 * kv,):
                raise ValueError(f"state_dict['in_proj_bias'] must have shape {(E + 2 * kv,)}, got {b.shape}")
            new["q_proj_bias"], new["k_proj_bias"], new["v_proj_bias"] = (
                b[:E].copy(),
                b[E : E + kv].copy(),
                b[E + kv :].copy(),
            )
            new["out_proj_bias"] = arrs["out_proj.bias"]
        shapes = self._shapes()
        for n, a in new.items():
            if a.shape != shapes[n]:
                src = {"out_proj_weight": "out_proj.weight", "out_proj_bias": "out_proj.bias"}.get(n, n)
                raise ValueError(f"state_dict[{src!r}] must have shape {shapes[n]}, got {a.shape}")
        for n, a in new.items():
            setattr(self, n, a)

    @classmethod
    def from_torch(cls, module: Any, *, dtype: npt.DTypeLike | None = None) -> MultiHeadAttention:
        """A module with the weights and ``batch_first`` of a ``torch.nn.MultiheadAttention``,
        so that it takes the same inputs and gives the same outputs.  ``add_bias_kv`` and
        ``add_zero_attn`` are not supported (ValueError); dropout is ignored
        (inference).  ``dtype`` defaults to float64 for a float64 module, else
        float32.

        Parameters
        ----------
        module : torch.nn.MultiheadAttention
            The module to copy.
        dtype : float32 or float64, optional
            Dtype of the new module; None follows the module's.

        Returns
        -------
        MultiHeadAttention
            A new module with the same weights.

        Examples
        --------
        Needs torch.

        >>> import torch  # doctest: +SKIP
        >>> t = torch.nn.MultiheadAttention(8, 2, batch_first=True)  # doctest: +SKIP
        >>> mha = fastattn.MultiHeadAttention.from_torch(t)  # doctest: +SKIP
        >>> x = np.ones((1, 3, 8), np.float32)  # doctest: +SKIP
        >>> ref, _ = t(*(torch.from_numpy(x),) * 3)  # doctest: +SKIP
        >>> bool(np.allclose(mha(x)[0], ref.detach().numpy(), atol=1e-5))  # doctest: +SKIP
        True
        """
        for attr in ("embed_dim", "num_heads", "in_proj_bias", "out_proj"):
            if not hasattr(module, attr):
                raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
            raise ValueError("module: add_bias_kv and add_zero_attn are not supported")
        if dtype is None:
            dtype = np.float64 if str(module.out_proj.weight.dtype) == "torch.float64" else np.float32
        m = cls(
            module.embed_dim,
            module.num_heads,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=module.in_proj_bias is not None,
            batch_first=bool(getattr(module, "batch_first", False)),
            dtype=dtype,
        )
        m.load_state_dict({k: v for k, v in module.state_dict().items() if k in m.state_dict()})
        return m

    # ------------------------------------------------------------------ forward
    def _input(self, x: Any, name: str, feat: int, batched: bool) -> np.ndarray:
        a = as_array(x, name)
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise TypeError(f"{name} must be a floating array, got dtype {a.dtype}")
        want = 3 if batched else 2
        if a.ndim != want:
            layout = ("(B, L, E)" if self.batch_first else "(L, B, E)") if batched else "(L, E)"
            raise ValueError(f"{name} must be {layout} like query, got shape {a.shape}")
        if a.shape[-1] != feat:
            raise ValueError(f"{name} must have {feat} features in its last dim, got shape {a.shape}")
        return a if a.dtype == self.dtype else a.astype(self.dtype)

    def _project(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, heads: int) -> np.ndarray:
        y = np.matmul(x.reshape(-1, x.shape[-1]), w.T)  # one GEMM over all tokens, in x's layout
        if b is not None:
            y += b
        out: np.ndarray = y.reshape(x.shape[:-1] + (heads, self.head_dim))
        return out

    def _masks(
        self, key_padding_mask: Any, attn_mask: Any, B: int, L: int, S: int, causal_mask: np.ndarray | None
    ) -> np.ndarray | None:
        """The combined mask in the kernel's convention (bool True = may attend, float
        added), broadcastable to (B, H, L, S), or None.  Inputs use torch's convention:
        bool True = NOT allowed.  ``causal_mask``: an (L, S) bool "may attend" mask to
        apply as well, or None."""
        H, ft = self.num_heads, self.dtype
        kpm = None
        if key_padding_mask is not None:
            k = as_array(key_padding_mask, "key_padding_mask")
            if k.shape != (B, S):
                raise ValueError(
                    f"key_padding_mask must have shape {(B, S)} (batch, key length), got {k.shape}"
                )
            if k.dtype == np.bool_:
                kpm = ~k  # True = padding (ignored) -> True = may attend
            elif k.dtype.kind == "f":
                kpm = k.astype(ft, copy=False)
            else:
                raise TypeError(f"key_padding_mask must be bool or floating, got dtype {k.dtype}")
            kpm = kpm[:, None, None, :]
        am = None
        if attn_mask is not None:
            a = as_array(attn_mask, "attn_mask")
            if a.dtype != np.bool_ and a.dtype.kind != "f":
                raise TypeError(f"attn_mask must be bool or floating, got dtype {a.dtype}")
            if a.ndim > 4:
                raise ValueError(f"attn_mask must have at most 4 dims, got shape {a.shape}")
            if a.shape == (B * H, L, S) and B > 1:
                a = a.reshape(B, H, L, S)  # torch's (B * num_heads, L, S)
            elif a.ndim == 4 and a.shape[0] not in (1, B):
                raise ValueError(f"attn_mask of shape {a.shape} does not broadcast to {(B, H, L, S)}")
            try:
                np.broadcast_shapes(a.shape, (B, H, L, S))
            except ValueError:
                raise ValueError(
                    f"attn_mask of shape {a.shape} must be ({L}, {S}), ({B * H}, {L}, {S}) or "
                    f"broadcast to {(B, H, L, S)}"
                ) from None
            am = ~a if a.dtype == np.bool_ else a.astype(ft, copy=False)  # bool: True = NOT allowed
        if causal_mask is not None:
            am = causal_mask if am is None else _combine(am, causal_mask, ft)
        if kpm is None or am is None:
            return kpm if am is None else am
        return _combine(am, kpm, ft)

    def __call__(
        self,
        query: npt.ArrayLike,
        key: npt.ArrayLike | None = None,
        value: npt.ArrayLike | None = None,
        key_padding_mask: npt.ArrayLike | None = None,
        need_weights: bool = True,
        attn_mask: npt.ArrayLike | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        num_threads: int | None = None,
        precision: Precision | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Attend ``query`` to ``key``/``value``: ``torch.nn.MultiheadAttention.forward``.

        The arguments, their order and their defaults are torch's.

        Parameters
        ----------
        query
            ``(L, B, E)``, or ``(B, L, E)`` with ``batch_first=True``, or
            unbatched ``(L, E)``.
        key, value
            ``(S, B, kdim)`` / ``(B, S, kdim)`` / ``(S, kdim)``; value likewise
            with ``vdim``.  (An extension of torch's: key defaults to query,
            self-attention, and value to key.)
        key_padding_mask
            ``(B, S)`` (``(S,)`` unbatched); bool **True = padding,
            NOT allowed** (the key is ignored), as in torch; a float mask is added.
        need_weights
            Also return the attention probabilities (default True, as
            torch), recomputed from the log-sum-exp the kernel returns so that
            they are the weights that produced the output.  Pass False to skip
            them: then nothing of size L x S is allocated.
        attn_mask
            ``(L, S)``, torch's ``(B * num_heads, L, S)`` (unbatched:
            ``(num_heads, L, S)``) or anything broadcastable to
            ``(B, num_heads, L, S)``; bool **True = NOT allowed**, as in
            torch.nn.MultiheadAttention (the opposite of
            ``fastattn.scaled_dot_product_attention``); a float mask is added.
        average_attn_weights
            Weights averaged over heads ``(B, L, S)`` (True,
            the default) or per head ``(B, num_heads, L, S)``; unbatched without B.
        is_causal
            Apply a causal mask, query i sees keys j <= i (torch's
            top-left triangle; the usual lower triangle for self-attention).
            torch treats it as a hint that ``attn_mask`` is that mask and
            requires the mask; here the mask may be left out (the triangle is
            then applied in the kernel without a mask when L == S), and when
            both are given both apply (the same result when the hint is right).
        num_threads
            Threads of the attention kernel (keyword only; the
            projections use NumPy's BLAS).
        precision
            The attention kernel's float32 matmul precision (keyword
            only): "highest", "high" or "medium" as for
            :func:`fastattn.scaled_dot_product_attention`; None (the default) uses
            ``fastattn.get_float32_matmul_precision()``.  The projections
            (NumPy's BLAS) and the ``need_weights`` weights are float32 or
            float64 arithmetic whatever the level.

        Returns
        -------
        attn_output : ndarray
            In the query's layout with E features, in ``self.dtype``.
        attn_weights : ndarray or None
            None when ``need_weights`` is False.  Always a pair, like torch.

        Notes
        -----
        Rows whose keys are all masked give zeros (torch gives NaN) and zero weights.

        Examples
        --------
        >>> import numpy as np
        >>> import fastattn
        >>> mha = fastattn.MultiHeadAttention(16, 4, batch_first=True, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
        >>> out, w = mha(x)                     # self-attention
        >>> out.shape, w.shape                  # weights averaged over the heads
        ((2, 5, 16), (2, 5, 5))
        >>> bool(np.allclose(w.sum(-1), 1))
        True
        """
        precision_code(precision)  # a bad level raises before any projection or kernel runs
        need_weights = _flag(need_weights, "need_weights")
        average_attn_weights = _flag(average_attn_weights, "average_attn_weights")
        is_causal = _flag(is_causal, "is_causal")
        q_in = as_array(query, "query")
        batched = q_in.ndim == 3
        if q_in.ndim not in (2, 3):
            layout = "(B, L, E)" if self.batch_first else "(L, B, E)"
            raise ValueError(f"query must be {layout} or unbatched (L, E), got shape {q_in.shape}")
        x = self._input(q_in, "query", self.embed_dim, batched)
        if key is None and value is not None:
            raise ValueError("value given without key")
        if key is None and self.kdim != self.embed_dim:
            raise ValueError(f"key must be given when kdim ({self.kdim}) != embed_dim ({self.embed_dim})")
        if value is None and self.vdim != self.kdim:
            raise ValueError(f"value must be given when vdim ({self.vdim}) != kdim ({self.kdim})")
        kx = x if key is None else self._input(key, "key", self.kdim, batched)
        vx = kx if value is None else self._input(value, "value", self.vdim, batched)
        # Token-major (L, B, E) inputs are projected in their own layout (a GEMM over all
        # tokens) and seen by the kernel through batch-major strided views: no transposes.
        seq_first = batched and not self.batch_first
        if not batched:
            x, kx, vx = x[None], kx[None], vx[None]
            if key_padding_mask is not None:
                key_padding_mask = as_array(key_padding_mask, "key_padding_mask")[None]
            if attn_mask is not None:
                am = as_array(attn_mask, "attn_mask")
                attn_mask = am[None] if am.ndim == 3 else am
        elif seq_first:
            x, kx, vx = x.swapaxes(0, 1), kx.swapaxes(0, 1), vx.swapaxes(0, 1)
        B, L, _ = x.shape
        if kx.shape[0] != B or vx.shape[0] != B:
            raise ValueError(
                f"query, key and value must have the same batch size, got "
                f"{x.shape[0]}, {kx.shape[0]}, {vx.shape[0]}"
            )
        S = kx.shape[1]
        if vx.shape[1] != S:
            raise ValueError(f"key and value must have the same length, got {kx.shape[1]} and {vx.shape[1]}")
        # Causal L == S: the kernel's own triangle (bottom-right = top-left), no mask;
        # L != S: torch's top-left triangle as an (L, S) mask.
        kernel_causal = is_causal and L == S
        tri = np.tri(L, S, dtype=bool) if is_causal and L != S else None
        mask = self._masks(key_padding_mask, attn_mask, B, L, S, tri)
        if need_weights:
            nbytes = B * self.num_heads * L * S * self.dtype.itemsize
            if nbytes > NEED_WEIGHTS_MAX_BYTES:
                raise ValueError(
                    f"need_weights=True would allocate (B, num_heads, L, S) = "
                    f"{(B, self.num_heads, L, S)} weights ({nbytes / 2**30:.1f} GiB, plus temporaries), "
                    f"above fastattn.modules.NEED_WEIGHTS_MAX_BYTES = "
                    f"{NEED_WEIGHTS_MAX_BYTES / 2**30:g} GiB; pass need_weights=False (the output "
                    "does not need them) or raise the limit"
                )

        H, Hk = self.num_heads, self.num_kv_heads

        def project(a: np.ndarray, w: np.ndarray, b: np.ndarray | None, heads: int) -> np.ndarray:
            if seq_first:  # project the (S, B, E) original, view it as (B, S, heads, hd)
                return self._project(a.swapaxes(0, 1), w, b, heads).swapaxes(0, 1)
            return self._project(a, w, b, heads)

        q = project(x, self.q_proj_weight, self.q_proj_bias, H)  # (B, L, H, hd)
        k = project(kx, self.k_proj_weight, self.k_proj_bias, Hk)  # (B, S, Hk, hd)
        v = project(vx, self.v_proj_weight, self.v_proj_bias, Hk)
        o = np.empty((L, B, H, self.head_dim) if seq_first else (B, L, H, self.head_dim), self.dtype)
        res = sdpa_call(
            q,
            k,
            v,
            mask,
            is_causal=kernel_causal,
            enable_gqa=Hk != H,
            layout="bshd",
            return_lse=need_weights,
            out=o.swapaxes(0, 1) if seq_first else o,
            num_threads=num_threads,
            precision=precision,
        ).run()
        lse = res[1] if need_weights else None
        E = self.embed_dim
        y = np.matmul(o.reshape(-1, E), self.out_proj_weight.T).reshape(o.shape[:2] + (E,))
        if self.out_proj_bias is not None:
            y += self.out_proj_bias
        if not batched:
            y = y[0]
        if not need_weights:
            return y, None
        assert lse is not None  # (need_weights: the call returned the LSE)
        w = self._weights(q, k, mask, kernel_causal, lse)
        if average_attn_weights:
            w = w.mean(axis=1)
        return y, (w if batched else w[0])

    def _weights(
        self, q: np.ndarray, k: np.ndarray, mask: np.ndarray | None, is_causal: bool, lse: np.ndarray
    ) -> np.ndarray:
        """exp(scores * scale + mask - lse): (B, H, L, S).  ``mask`` in the kernel's
        convention (bool True = may attend); ``is_causal`` only with L == S."""
        B, L, H, hd = q.shape
        S, Hk = k.shape[1], k.shape[2]
        g = H // Hk
        qg = q.reshape(B, L, Hk, g, hd).transpose(0, 2, 3, 1, 4)  # (B, Hk, g, L, hd)
        kt = k.transpose(0, 2, 3, 1)[:, :, None]  # (B, Hk, 1, hd, S)
        s = np.matmul(qg, kt).reshape(B, H, L, S)
        s *= np.asarray(1.0 / math.sqrt(hd), dtype=self.dtype)
        if mask is not None:
            if mask.dtype == np.bool_:
                s = np.where(mask, s, -np.inf)
            else:
                s += mask
        if is_causal:
            s = np.where(np.tri(L, S, dtype=bool), s, -np.inf)
        lse = lse[..., None]
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.exp(s - lse)
        return np.where(np.isfinite(lse), p, 0).astype(self.dtype, copy=False)

    def __repr__(self) -> str:
        extra = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        if not self._packed:
            extra += f", kdim={self.kdim}, vdim={self.vdim}"
        return (
            f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}{extra}, "
            f"bias={self.bias}, batch_first={self.batch_first}, dtype={self.dtype.name})"
        )


def _combine(a: np.ndarray, b: np.ndarray, ft: np.dtype[Any]) -> np.ndarray:
    """Two masks in the kernel's convention combined: both bool -> and; else additive floats."""
    if a.dtype == np.bool_ and b.dtype == np.bool_:
        both: np.ndarray = np.logical_and(a, b)
        return both

    def add(m: np.ndarray) -> np.ndarray:
        return np.where(m, ft.type(0), ft.type(-np.inf)) if m.dtype == np.bool_ else m

    total: np.ndarray = add(a) + add(b)
    return total
