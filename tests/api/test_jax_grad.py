"""jax.grad through fastattn.jax_compat.dot_product_attention (a jax.custom_vjp over
the fused backward) against jax.grad through jax.nn.dot_product_attention (XLA),
under jax.jit and jax.vmap (skipped without JAX)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, optional, randn

from fastattn.jax_compat import dot_product_attention as dpa

jax = optional("jax")
jnp = jax.numpy

# (B, T, S, N, K, H, options); T == S where a causal / window mask is used (JAX and
# fastattn agree there; T != S top-left is covered by a built mask, also tested).
CASES = [
    (2, 9, 9, 2, 2, 8, {}),
    (1, 16, 16, 4, 2, 16, {"is_causal": True}),
    (2, 7, 12, 4, 1, 8, {"bias": True, "mask": True}),
    (1, 20, 20, 2, 2, 8, {"local_window_size": (3, 2)}),
    (2, 6, 10, 2, 2, 8, {"is_causal": True, "scale": 0.5}),
    (2, 10, 10, 2, 2, 8, {"key_value_seq_lengths": np.array([10, 6], np.int32)}),
]


def _grads(fn, q, k, v, w, kw):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, **kw) * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_grad_matches_jax(rng, case):
    B, T, S, N, K, H, opts = case
    q, k, v = randn(rng, (B, T, N, H)), randn(rng, (B, S, K, H)), randn(rng, (B, S, K, H))
    w = randn(rng, (B, T, N, H))
    kw = dict(opts)
    if kw.pop("bias", False):
        kw["bias"] = jnp.asarray(randn(rng, (1, N, T, S)))
    if kw.pop("mask", False):
        m = rng.random((B, 1, T, S)) > 0.3
        m[..., 0] = True
        kw["mask"] = jnp.asarray(m)
    if "key_value_seq_lengths" in kw:
        kw["key_value_seq_lengths"] = jnp.asarray(kw["key_value_seq_lengths"])
    ours = _grads(dpa, q, k, v, w, kw)
    theirs = _grads(
        lambda *a, **k_: jax.nn.dot_product_attention(*a, implementation="xla", **k_), q, k, v, w, kw
    )
    for g, e, n in zip(ours, theirs, ("dq", "dk", "dv")):
        assert isinstance(g, jax.Array) and g.shape == e.shape and g.dtype == e.dtype
        assert_close(np.asarray(g), np.asarray(e), np.float32, tol=2e-4, what=n)


def test_grad_under_vmap_and_3d(rng):
    V, T, S, N, H = 3, 6, 6, 2, 8
    q, k, v = randn(rng, (V, T, N, H)), randn(rng, (V, S, N, H)), randn(rng, (V, S, N, H))

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, is_causal=True) ** 2)

    def xla(*a, **k_):
        return jax.nn.dot_product_attention(*a, implementation="xla", **k_)

    ours = jax.vmap(jax.grad(loss(dpa), argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.vmap(jax.grad(loss(xla), argnums=(0, 1, 2)))(q, k, v)
    for g, e in zip(ours, theirs):
        assert_close(np.asarray(g), np.asarray(e), np.float32, tol=2e-4)
    # key and value shared by the vmapped queries (not mapped): their gradients sum
    ours = jax.vmap(jax.grad(loss(dpa), argnums=(1, 2)), in_axes=(0, None, None))(q, k[0], v[0])
    theirs = jax.vmap(jax.grad(loss(xla), argnums=(1, 2)), in_axes=(0, None, None))(q, k[0], v[0])
    for g, e in zip(ours, theirs):
        assert_close(np.asarray(g), np.asarray(e), np.float32, tol=2e-4)


def test_bias_gets_jax_gradient_and_residual_is_constant(rng):
    # (Issue 48.1: the bias gradient used to be a silent zero.)
    q = randn(rng, (1, 4, 2, 8))
    bias = jnp.asarray(randn(rng, (1, 2, 4, 4)))

    def loss(bias):
        out, res = dpa(q, q, q, bias, return_residual=True)
        return jnp.sum(out) + jnp.sum(res)

    def xla_loss(bias):
        return jnp.sum(jax.nn.dot_product_attention(q, q, q, bias, implementation="xla"))

    assert_close(np.asarray(jax.grad(loss)(bias)), np.asarray(jax.grad(xla_loss)(bias)), np.float32, tol=2e-4)

    def res_loss(bias):  # the residual alone: a constant
        return jnp.sum(dpa(q, q, q, bias, return_residual=True)[1])

    assert np.all(np.asarray(jax.grad(res_loss)(bias)) == 0)
