"""``dot_product_attention`` with the argument names, layout and masking rules of
``jax.nn.dot_product_attention``, computed by fastattn's fused kernel on NumPy arrays.

JAX letters: B batch, T query length, S key length, N query heads, K key/value
heads (N a multiple of K), H head dim.

NumPy arrays in, NumPy arrays out; JAX arrays in (also tracers, under
``jax.jit`` and ``jax.vmap``), JAX arrays out, through ``jax.pure_callback``.
This module never imports JAX unless it is given JAX arrays (a JAX array can
only exist once JAX has been imported).
"""

from __future__ import annotations

import functools
import importlib
import numbers
import sys
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from ._args import check_dtypes, check_heads
from ._checks import as_array, scale_value, threads_value
from ._config import Precision, get_float32_matmul_precision
from ._jax_bias import bias_grad as _bias_gradient
from .backward import scaled_dot_product_attention_backward
from .functional import scaled_dot_product_attention

__all__ = ["dot_product_attention"]

_IMPLEMENTATIONS = (None, "xla", "fastattn")


def _level(precision: str | None) -> Precision | None:
    """A precision read from get_float32_matmul_precision (a str, one of the levels)."""
    return cast(Precision | None, precision)


def _ensure_4d(a: np.ndarray) -> np.ndarray:
    return a.reshape((1,) * (4 - a.ndim) + a.shape) if a.ndim < 4 else a


def _seq_lengths(x: Any, name: str, B: int, limit: int) -> np.ndarray | None:
    if x is None:
        return None
    a = as_array(x, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.shape != (B,):
        raise ValueError(f"{name} must have shape ({B},) (the batch size), got {a.shape}")
    # JAX keeps position t when t < length: lengths beyond the array mean "all".
    return np.clip(a.astype(np.int64), 0, limit)


def _window_size(w: Any) -> tuple[int, int] | None:
    if w is None:
        return None
    pair = (w, w) if isinstance(w, numbers.Integral) and not isinstance(w, (bool, np.bool_)) else w
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"local_window_size must be an int or a (left, right) pair of ints, got {w!r}")
    out = []
    for side, v in zip(("left", "right"), pair):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(f"local_window_size {side} must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"local_window_size {side} must be >= 0, got {v}")
        out.append(int(v))
    return out[0], out[1]


def dot_product_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    bias: npt.ArrayLike | None = None,
    mask: npt.ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: npt.ArrayLike | None = None,
    key_value_seq_lengths: npt.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    num_threads: int | None = None,
) -> Any:
    """softmax(query·keyᵀ·scale + bias, masked)·value in JAX's conventions.

    Same arguments and semantics as ``jax.nn.dot_product_attention`` (its XLA
    implementation), computed on the CPU by :func:`fastattn.scaled_dot_product_attention`
    with ``layout="bshd"``.  NumPy arrays in and out (anything ``numpy.asarray``
    accepts, read without a copy when possible); or, when any array argument is
    a JAX array, JAX arrays out: the kernel then runs through
    ``jax.pure_callback`` on the host, so the call works eagerly, under
    ``jax.jit`` and under ``jax.vmap`` (each vmapped element is one kernel call).
    ``jax.grad`` works through a ``jax.custom_vjp``: gradients with respect to
    query, key and value by :func:`fastattn.scaled_dot_product_attention_backward`
    (the backward runs the forward once more on the host, at the float32 matmul
    precision, :func:`fastattn.get_float32_matmul_precision`, that was in force
    when the forward was traced).  The gradient with respect to ``bias``, computed
    only when ``bias`` is differentiated, is the explicit
    ``dS = P * (dP - rowsum(P * dP))`` summed over the bias's broadcast axes, in
    float64 on the host, one (batch, head) at a time: a few ``(T, S)`` float64
    temporaries beyond the result.  mask, the lengths and the residual are
    constants (no gradient flows through them).

    Parameters
    ----------
    query
        ``(B, T, N, H)`` or ``(T, N, H)``.
    key
        ``(B, S, K, H)`` or ``(S, K, H)``; ``N`` must be a multiple of ``K``
        (grouped-query attention: query head ``n`` uses key/value head ``n // (N // K)``).
    value
        ``(B, S, K, Hv)`` or ``(S, K, Hv)``, same dtype as ``key``.
    bias
        Float, added to the scaled scores; broadcastable to ``(B, N, T, S)``
        (a 4-D shape, or fewer dims that numpy broadcasting aligns on the right).
    mask
        Bool, ``True`` = the query may attend to that key (keep);
        broadcastable to ``(B, N, T, S)``.
    scale
        Multiplies ``query·keyᵀ``; None means ``1/sqrt(H)``.
    is_causal
        Query ``t`` sees keys ``s <= t``.  As in JAX this causal
        mask is aligned to the TOP LEFT on absolute positions (unlike
        :func:`fastattn.scaled_dot_product_attention`, which aligns
        bottom-right); the two agree when ``T == S``.
    query_seq_lengths
        ``(B,)`` ints; query rows ``t >= query_seq_lengths[b]``
        are padding (their output is zeros).
    key_value_seq_lengths
        ``(B,)`` ints; keys ``s >= key_value_seq_lengths[b]``
        are ignored.
    local_window_size
        Int ``w`` or ``(left, right)``: query ``t`` sees keys
        ``t - left <= s <= t + right`` (absolute positions, as in JAX);
        ``w`` means ``(w, w)``.
    implementation
        None, ``"xla"`` or ``"fastattn"`` (all compute the same
        thing here); ``"cudnn"`` is not available and raises ValueError.
    return_residual
        Also return the log-sum-exp of each row's scaled,
        biased, masked logits, shape ``(B, T, N)`` (or ``(T, N)``), in the
        key's dtype, as JAX does.
    num_threads
        Threads for this call (fastattn extension); None uses
        :func:`fastattn.get_num_threads`.

    Returns
    -------
    output : ndarray
        ``(B, T, N, Hv)`` (or ``(T, N, Hv)``), the query's dtype.
    residual : ndarray
        Only with ``return_residual``: the pair is ``(output, residual)``.

    Notes
    -----
    Differences from JAX: a query row that can see no key at all (fully
    masked, or a padded query row) gives zeros here; JAX's XLA path gives the
    mean of all values for such a row (its masked logits are a large finite
    negative number, so the softmax is uniform), except padded query rows,
    which JAX also zeroes; such a row's residual is -inf here, a huge finite
    negative number in JAX.

    Examples
    --------
    NumPy in, NumPy out (JAX arrays in give JAX arrays out):

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 4, 2, 8)).astype(np.float32)   # (B, T, N, H)
    >>> out = fastattn.dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape
    (1, 4, 2, 8)
    >>> ref = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, layout="bshd")
    >>> bool(np.allclose(out, ref))
    True
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of None, 'xla', 'fastattn', got {implementation!r}")
    if not isinstance(return_residual, (bool, np.bool_)):
        raise TypeError(f"return_residual must be a bool, got {type(return_residual).__name__}")
    window = _window_size(local_window_size)
    args = (query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths)
    if _any_jax(args):
        out, res = _jax_forward(
            *args, scale=scale, is_causal=bool(is_causal), window=window, num_threads=num_threads
        )
    else:
        out, res = _numpy_forward(
            *args, scale=scale, is_causal=bool(is_causal), window=window, num_threads=num_threads
        )
    return (out, res) if return_residual else out


def _any_jax(args: tuple[Any, ...]) -> bool:
    jax = sys.modules.get("jax")  # no JAX array can exist before jax is imported
    return jax is not None and any(isinstance(a, jax.Array) for a in args)


def _numpy_forward(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    query_seq_lengths: Any,
    key_value_seq_lengths: Any,
    *,
    scale: float | None,
    is_causal: bool,
    window: tuple[int, int] | None,
    num_threads: int | None,
    precision: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The computation on NumPy arrays: ``(output, residual)``, residual ``(B, T, N)``
    (``(T, N)`` for 3-D inputs) in the key's dtype."""
    q4, k4, v4, kw, squeeze = _numpy_prepare(
        query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths, is_causal, window
    )
    out, lse = scaled_dot_product_attention(
        q4, k4, v4, scale=scale, num_threads=num_threads, return_lse=True, precision=_level(precision), **kw
    )
    res = np.swapaxes(lse, 1, 2).astype(k4.dtype)  # (B, N, T) -> (B, T, N), as JAX
    return (out[0], res[0]) if squeeze else (out, res)


def _numpy_backward(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    query_seq_lengths: Any,
    key_value_seq_lengths: Any,
    grad_out: Any,
    *,
    scale: float | None,
    is_causal: bool,
    window: tuple[int, int] | None,
    num_threads: int | None,
    precision: str | None = None,
    bias_grad: bool = False,
) -> tuple[np.ndarray, ...]:
    """Gradients of the output with respect to query, key and value (4-D inputs):
    the forward is run again for its output and float32/float64 LSE, then
    :func:`fastattn.scaled_dot_product_attention_backward` with the same options
    (precision included).  With ``bias_grad``, also the bias's (:func:`fastattn._jax_bias.bias_grad`)."""
    q4, k4, v4, kw, _ = _numpy_prepare(
        query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths, is_causal, window
    )
    out, lse = scaled_dot_product_attention(
        q4, k4, v4, scale=scale, num_threads=num_threads, return_lse=True, precision=_level(precision), **kw
    )
    go = np.asarray(grad_out, dtype=out.dtype)
    bwd: Any = scaled_dot_product_attention_backward  # (fastattn.backward is typed by its owner)
    dq, dk, dv = bwd(
        go, q4, k4, v4, out, lse, scale=scale, num_threads=num_threads, precision=precision, **kw
    )
    if not bias_grad:
        return dq, dk, dv
    return dq, dk, dv, _bias_gradient(q4, k4, v4, as_array(bias, "bias"), go, kw, scale, precision)


def _numpy_prepare(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    query_seq_lengths: Any,
    key_value_seq_lengths: Any,
    is_causal: bool,
    window: tuple[int, int] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any], bool]:
    """JAX's arguments as fastattn's: 4-D bshd query, key, value, the keyword
    arguments of :func:`fastattn.scaled_dot_product_attention` (mask, GQA, lengths,
    causal / window) and whether the inputs were 3-D."""
    q = as_array(query, "query")
    k = as_array(key, "key")
    v = as_array(value, "value")
    for a, n in ((q, "query"), (k, "key"), (v, "value")):
        if a.ndim not in (3, 4):
            raise ValueError(f"{n} must have shape (B, T|S, heads, H) or (T|S, heads, H), got {a.shape}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"query, key and value must have the same number of dimensions, got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    squeeze = q.ndim == 3
    q4, k4, v4 = _ensure_4d(q), _ensure_4d(k), _ensure_4d(v)
    B, T, N, _ = q4.shape
    S, K = k4.shape[1], k4.shape[2]
    if k4.shape[0] != B or v4.shape[0] != B:
        raise ValueError(
            f"query, key and value must have the same batch size, got {q.shape}, {k.shape}, {v.shape}"
        )
    check_heads(N, K, True, "query", "key/value")
    q_lens = _seq_lengths(query_seq_lengths, "query_seq_lengths", B, T)
    kv_lens = _seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", B, S)

    attn_mask = None
    if bias is not None:
        b = as_array(bias, "bias")
        if b.dtype.kind != "f" and b.dtype.name != "bfloat16":
            raise TypeError(f"bias must be a floating array, got dtype {b.dtype}")
        if b.ndim > 4:
            raise ValueError(f"bias must have at most 4 dimensions (B, N, T, S), got shape {b.shape}")
        attn_mask = b
    if mask is not None:
        m = as_array(mask, "mask")
        if m.dtype != np.bool_:
            raise TypeError(
                f"mask must be a bool array (True = keep; pass additive masks as bias), got dtype {m.dtype}"
            )
        if m.ndim > 4:
            raise ValueError(f"mask must have at most 4 dimensions (B, N, T, S), got shape {m.shape}")
        if attn_mask is None:
            attn_mask = m
        else:
            fdt = np.float64 if q.dtype == np.float64 else np.float32
            try:
                attn_mask = np.where(m, attn_mask.astype(fdt, copy=False), fdt(-np.inf))
            except ValueError:
                raise ValueError(
                    f"bias {attn_mask.shape} and mask {m.shape} do not broadcast together"
                ) from None

    # JAX's causal and window masks use absolute positions (top-left).  The
    # kernel aligns them bottom-right on the valid lengths; the two coincide
    # when every batch element has as many valid queries as valid keys.
    native_kw: dict[str, Any] = {}
    if is_causal or window is not None:
        ql = np.full(B, T) if q_lens is None else q_lens
        kl = np.full(B, S) if kv_lens is None else kv_lens
        if np.array_equal(ql, kl):
            native_kw = {"is_causal": bool(is_causal), "window": window}
        else:
            t = np.arange(T)[:, None]
            s = np.arange(S)[None, :]
            keep = np.ones((T, S), dtype=bool)
            if is_causal:
                keep &= s <= t
            if window is not None:
                keep &= (s >= t - window[0]) & (s <= t + window[1])
            if attn_mask is None:
                attn_mask = keep
            elif attn_mask.dtype == np.bool_:
                attn_mask = attn_mask & keep
            else:
                attn_mask = np.where(keep, attn_mask, attn_mask.dtype.type(-np.inf))
    kw = dict(
        attn_mask=attn_mask,
        enable_gqa=N != K,
        layout="bshd",
        key_lengths=kv_lens,
        query_lengths=q_lens,
        **native_kw,
    )
    return q4, k4, v4, kw, squeeze


# ------------------------------------------------------------------------- JAX
# Leading dims each argument of the callback has without vmap: q, k, v, bias,
# mask are 4-D, the two length arrays 1-D.  Under jax.vmap (vmap_method
# "expand_dims") every argument gains the vmapped dims in front, size 1 where
# that argument is not mapped.
_BASE_NDIM = (4, 4, 4, 4, 4, 1, 1)


def _host_callback(
    *arrays: Any, scale: Any, is_causal: bool, window: Any, num_threads: Any, precision: str
) -> tuple[np.ndarray, np.ndarray]:
    opts: dict[str, Any] = dict(
        scale=scale, is_causal=is_causal, window=window, num_threads=num_threads, precision=precision
    )
    leads = [a.shape[: a.ndim - nd] for a, nd in zip(arrays, _BASE_NDIM) if a is not None]
    lead = np.broadcast_shapes(*leads)
    if lead == ():
        return _numpy_forward(*arrays, **opts)
    outs, ress = [], []
    for idx in np.ndindex(*lead):  # one kernel call per vmapped element
        sub: list[Any] = []
        for a, nd in zip(arrays, _BASE_NDIM):
            if a is None:
                sub.append(None)
                continue
            la = a.shape[: a.ndim - nd]
            tail = idx[len(idx) - len(la) :] if la else ()
            sub.append(a[tuple(i if d != 1 else 0 for i, d in zip(tail, la))])
        o, r = _numpy_forward(*sub, **opts)
        outs.append(o)
        ress.append(r)
    return (
        np.stack(outs).reshape(lead + outs[0].shape),
        np.stack(ress).reshape(lead + ress[0].shape),
    )


def _host_backward(
    *arrays: Any,
    scale: Any,
    is_causal: bool,
    window: Any,
    num_threads: Any,
    precision: str,
    bias_grad: bool,
) -> tuple[Any, ...]:
    """Host side of the backward: ``(dq, dk, dv)`` (with ``bias_grad``, and dbias) for
    the 4-D arrays (plus the output cotangent, 4-D), one kernel call per element
    under jax.vmap."""
    opts: dict[str, Any] = dict(
        scale=scale,
        is_causal=is_causal,
        window=window,
        num_threads=num_threads,
        precision=precision,
        bias_grad=bias_grad,
    )
    base = _BASE_NDIM + (4,)
    leads = [a.shape[: a.ndim - nd] for a, nd in zip(arrays, base) if a is not None]
    lead = np.broadcast_shapes(*leads)
    if lead == ():
        return _numpy_backward(*arrays, **opts)
    typed = arrays[:4] if bias_grad else arrays[:3]  # (each gradient is typed as its input)
    grads: list[list[Any]] = [[] for _ in typed]
    for idx in np.ndindex(*lead):
        sub: list[Any] = []
        for a, nd in zip(arrays, base):
            if a is None:
                sub.append(None)
                continue
            la = a.shape[: a.ndim - nd]
            tail = idx[len(idx) - len(la) :] if la else ()
            sub.append(a[tuple(i if d != 1 else 0 for i, d in zip(tail, la))])
        for acc, g in zip(grads, _numpy_backward(*sub, **opts)):
            acc.append(g)
    return tuple(np.stack(g).reshape(lead + g[0].shape).astype(a.dtype) for g, a in zip(grads, typed))


def _to_4d(jnp: Any, a: Any) -> Any:
    return jnp.reshape(a, (1,) * (4 - a.ndim) + a.shape) if a.ndim < 4 else a


def _jax_forward(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    query_seq_lengths: Any,
    key_value_seq_lengths: Any,
    *,
    scale: float | None,
    is_causal: bool,
    window: tuple[int, int] | None,
    num_threads: int | None,
) -> tuple[Any, Any]:
    """The computation on JAX arrays (tracers included): ``(output, residual)`` as JAX
    arrays, through ``jax.pure_callback`` with ``vmap_method="expand_dims"``.

    One function of the seven array arguments with every option static, so
    that a ``jax.custom_vjp`` can wrap it.  Shapes and dtypes are checked here,
    at trace time, with the argument names; the host callback then runs
    :func:`_numpy_forward` (once per element under ``jax.vmap``)."""
    # Typed as Any (as the other optional dependencies are), so that mypy --strict
    # passes the same whether JAX is installed or not.
    jax: Any = importlib.import_module("jax")
    jnp: Any = importlib.import_module("jax.numpy")

    q, k, v = (jnp.asarray(a) for a in (query, key, value))
    for a, n in ((q, "query"), (k, "key"), (v, "value")):
        if a.ndim not in (3, 4):
            raise ValueError(f"{n} must have shape (B, T|S, heads, H) or (T|S, heads, H), got {a.shape}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            "query, key and value must have the same number of dimensions, got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    q0, k0, v0 = (np.empty(0, dtype=np.dtype(a.dtype)) for a in (q, k, v))  # dtype probes
    check_dtypes(q0, k0, v0)
    squeeze = q.ndim == 3
    q, k, v = (_to_4d(jnp, a) for a in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != (B, S, K):
        raise ValueError(
            f"query, key and value must share the batch size, and key and value the length and heads; "
            f"got {query.shape}, {key.shape}, {value.shape}"
        )
    if k.shape[3] != H:
        raise ValueError(f"query and key must have the same head dim, got {H} and {k.shape[3]}")
    check_heads(N, K, True, "query", "key/value")
    full = (B, N, T, S)
    b = m = None
    if bias is not None:
        b = jnp.asarray(bias)
        if not jnp.issubdtype(b.dtype, jnp.floating):
            raise TypeError(f"bias must be a floating array, got dtype {b.dtype}")
        if b.ndim > 4:
            raise ValueError(f"bias must have at most 4 dimensions (B, N, T, S), got shape {b.shape}")
        b = _to_4d(jnp, b)
    if mask is not None:
        m = jnp.asarray(mask)
        if m.dtype != jnp.bool_:
            raise TypeError(
                f"mask must be a bool array (True = keep; pass additive masks as bias), got dtype {m.dtype}"
            )
        if m.ndim > 4:
            raise ValueError(f"mask must have at most 4 dimensions (B, N, T, S), got shape {m.shape}")
        m = _to_4d(jnp, m)
    for arr, n in ((b, "bias"), (m, "mask")):
        if arr is not None:
            try:
                ok = np.broadcast_shapes(arr.shape, full) == full
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{n} of shape {arr.shape} does not broadcast to (B, N, T, S) = {full}")
    lens: list[Any] = []
    for x, n in ((query_seq_lengths, "query_seq_lengths"), (key_value_seq_lengths, "key_value_seq_lengths")):
        if x is None:
            lens.append(None)
            continue
        a = jnp.asarray(x)
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"{n} must be an integer array, got dtype {a.dtype}")
        if a.shape != (B,):
            raise ValueError(f"{n} must have shape ({B},) (the batch size), got {a.shape}")
        lens.append(a)
    if scale is not None:
        scale_value(scale, H)
    if num_threads is not None:
        threads_value(num_threads, lambda: 1)
    # The process's float32 matmul precision, read at trace time (as JAX reads its own
    # default_matmul_precision) and given to the forward and the backward alike, so
    # that the backward recomputes the forward's scores.  The residual is a constant
    # for jax.grad; bias gets its gradient in _jax_core.
    prec = get_float32_matmul_precision()
    out, res = _jax_core(scale, is_causal, window, num_threads, prec)(q, k, v, b, m, *lens)
    res = jax.lax.stop_gradient(res)
    return (out[0], res[0]) if squeeze else (out, res)


@functools.lru_cache(maxsize=64)
def _jax_core(
    scale: float | None,
    is_causal: bool,
    window: tuple[int, int] | None,
    num_threads: int | None,
    precision: str,
) -> Any:
    """``(q, k, v, bias, mask, q_lens, kv_lens) -> (output, residual)`` on 4-D JAX
    arrays for these (static) options: a ``jax.custom_vjp`` whose forward and
    backward run on the host through ``jax.pure_callback`` (``vmap_method=
    "expand_dims"``, so jax.vmap and jax.jit work for both).  The backward runs
    the fused forward again on the host (for its output and a float32/float64
    LSE, since the residual is in the key's dtype) and then
    :func:`fastattn.scaled_dot_product_attention_backward`.  Gradients flow to
    query, key, value and (when it is differentiated: ``symbolic_zeros`` tells the
    forward rule which inputs are perturbed) bias; mask and lengths are not
    differentiable, and the residual is stopped by the caller."""
    jax: Any = importlib.import_module("jax")  # typed as Any: see _jax_forward
    cd: Any = importlib.import_module("jax.custom_derivatives")
    opts: dict[str, Any] = dict(
        scale=scale, is_causal=is_causal, window=window, num_threads=num_threads, precision=precision
    )

    def forward(q: Any, k: Any, v: Any, b: Any, m: Any, ql: Any, kl: Any) -> Any:
        B, T, N, _ = q.shape
        result = (
            jax.ShapeDtypeStruct((B, T, N, v.shape[3]), q.dtype),
            jax.ShapeDtypeStruct((B, T, N), k.dtype),
        )
        callback = functools.partial(_host_callback, **opts)
        return jax.pure_callback(callback, result, q, k, v, b, m, ql, kl, vmap_method="expand_dims")

    core: Any = jax.custom_vjp(forward)

    def core_fwd(*primals: Any) -> Any:
        # symbolic_zeros: each array argument comes as (value, perturbed).  Whether
        # bias is differentiated is carried to core_bwd in the residuals' structure
        # (a static pytree: (b,) or ()), so dbias is computed only when asked for;
        # a silent zero (the bias as a constant) would be a wrong gradient.
        q, k, v, b, m, ql, kl = (None if a is None else a.value for a in primals)
        want_db = (b,) if primals[3] is not None and primals[3].perturbed else ()
        return forward(q, k, v, b, m, ql, kl), (q, k, v, b, m, ql, kl, want_db)

    def core_bwd(saved: Any, cts: Any) -> Any:
        q, k, v, b, m, ql, kl, want_db = saved
        d_out = cts[0]  # the residual's cotangent is dropped: it is stopped in _jax_forward
        if isinstance(d_out, cd.SymbolicZero):  # only the (constant) residual was used
            return None, None, None, None, None, None, None
        grads = (q, k, v) + tuple(want_db)
        result = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in grads)
        callback = functools.partial(_host_backward, **opts, bias_grad=bool(want_db))
        out = jax.pure_callback(callback, result, q, k, v, b, m, ql, kl, d_out, vmap_method="expand_dims")
        db = out[3] if want_db else None
        return out[0], out[1], out[2], db, None, None, None

    core.defvjp(core_fwd, core_bwd, symbolic_zeros=True)
    return core
