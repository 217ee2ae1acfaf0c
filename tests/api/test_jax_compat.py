"""fastattn.jax_compat.dot_product_attention on JAX arrays: eager, jax.jit, jax.vmap,
against jax.nn.dot_product_attention (skipped without JAX); and what it keeps
from JAX's signature."""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_close, optional, randn

from fastattn import reference as ref
from fastattn.jax_compat import dot_product_attention as dpa


def test_numpy_path_never_imports_jax(tmp_path):
    code = (
        "import sys, numpy as np, fastattn\n"
        "q = np.ones((1, 3, 2, 8), np.float32)\n"
        "fastattn.dot_product_attention(q, q, q, is_causal=True, return_residual=True)\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)  # not the source tree


def test_residual_on_numpy_inputs(rng):
    q, k, v = randn(rng, (2, 5, 4, 8)), randn(rng, (2, 9, 2, 8)), randn(rng, (2, 9, 2, 8))
    bias = randn(rng, (1, 4, 5, 9))
    out, res = dpa(q, k, v, bias, return_residual=True)
    _, lse = ref.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, enable_gqa=True, layout="bshd", return_lse=True
    )
    assert res.shape == (2, 5, 4) and res.dtype == np.float32
    assert_close(res, np.swapaxes(lse, 1, 2), np.float32, what="residual")
    out3, res3 = dpa(q[0], k[0], v[0], return_residual=True)
    assert out3.shape == (5, 4, 8) and res3.shape == (5, 4)
    with pytest.raises(TypeError, match="return_residual"):
        dpa(q, k, v, return_residual=1)


def test_signature_follows_jax():
    jax = optional("jax")
    ours = inspect.signature(dpa).parameters
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    for name, p in theirs.items():  # every JAX parameter, same kind and default
        assert name in ours, name
        assert ours[name].kind == p.kind, name
        assert ours[name].default == p.default, name
    assert [n for n in ours if n in theirs] == list(theirs)  # same order
    assert set(ours) - set(theirs) == {"num_threads"}


def _jax():
    jax = optional("jax")
    return jax, jax.numpy


CASES = [
    dict(is_causal=True),
    dict(is_causal=True, T=5, S=23),
    dict(mask=True, bias=True, gqa=True),
    dict(local_window_size=(4, 1), is_causal=True, T=7, S=30),
    dict(key_value_seq_lengths=True, T=6, S=26, local_window_size=(5, 1)),
]


def _case(rng, case):
    B, N, H = 2, 4, 16
    T, S = case.get("T", 11), case.get("S", 11)
    K = 2 if case.get("gqa") else N
    q, k, v = randn(rng, (B, T, N, H)), randn(rng, (B, S, K, H)), randn(rng, (B, S, K, H))
    kw = {n: case[n] for n in ("is_causal", "local_window_size") if n in case}
    if case.get("bias"):
        kw["bias"] = randn(rng, (1, N, T, S))
    if case.get("mask"):
        m = rng.random((B, 1, T, S)) < 0.75
        m[..., 0] = True
        kw["mask"] = m
    if case.get("key_value_seq_lengths"):
        kw["key_value_seq_lengths"] = np.array([S - 3, S], dtype=np.int32)
    return q, k, v, kw


def _live(q, k, kw):
    """(B, T, N) rows that see at least one key (JAX gives a uniform row elsewhere)."""
    B, T, N, _ = q.shape
    S = k.shape[1]
    keep = np.ones((B, N, T, S), bool)
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    if kw.get("is_causal"):
        keep &= s <= t
    if "local_window_size" in kw:
        lw = kw["local_window_size"]
        keep &= (s >= t - lw[0]) & (s <= t + lw[1])
    if "mask" in kw:
        keep &= kw["mask"]
    if "key_value_seq_lengths" in kw:
        keep &= s[None, None] < kw["key_value_seq_lengths"][:, None, None, None]
    return keep.any(-1).transpose(0, 2, 1)


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_jit_matches_jax(rng, case):
    jax, jnp = _jax()
    q, k, v, kw = _case(rng, case)
    arrays = {n: jnp.asarray(kw.pop(n)) for n in ("bias", "mask", "key_value_seq_lengths") if n in kw}
    live = _live(q, k, {**kw, **{n: np.asarray(a) for n, a in arrays.items()}})

    def ours(q, k, v, arrays):
        return dpa(q, k, v, return_residual=True, **arrays, **kw)

    def theirs(q, k, v, arrays):
        return jax.nn.dot_product_attention(
            q, k, v, implementation="xla", return_residual=True, **arrays, **kw
        )

    out, res = jax.jit(ours)(q, k, v, arrays)
    eout, eres = jax.jit(theirs)(q, k, v, arrays)
    assert isinstance(out, jax.Array) and out.shape == q.shape and out.dtype == jnp.float32
    out, res, eout, eres = (np.asarray(a) for a in (out, res, eout, eres))
    assert_close(out[live], eout[live], np.float32)
    assert_close(res[live], eres[live], np.float32, what="residual")
    assert np.all(out[~live] == 0)
    # Eager JAX arrays give the same, as JAX arrays.
    eager = dpa(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), **arrays, **kw)
    assert isinstance(eager, jax.Array)
    np.testing.assert_array_equal(np.asarray(eager), out)


def test_vmap_and_nested_vmap(rng):
    jax, jnp = _jax()
    V, B, T, S, N, K, H = 3, 2, 6, 10, 4, 2, 8
    q = randn(rng, (V, B, T, N, H))
    k, v = randn(rng, (B, S, K, H)), randn(rng, (B, S, K, H))
    mask = rng.random((V, 1, 1, T, S)) < 0.7
    mask[..., 0] = True

    def ours(q, k, v, m):
        return dpa(q, k, v, mask=m, is_causal=True)

    def theirs(q, k, v, m):
        return jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True)

    axes = (0, None, None, 0)  # q and the mask mapped, k and v shared
    got = np.asarray(jax.jit(jax.vmap(ours, in_axes=axes))(q, k, v, mask))
    want = np.asarray(jax.vmap(theirs, in_axes=axes)(q, k, v, mask))
    assert got.shape == (V, B, T, N, H)
    assert_close(got, want, np.float32)  # every row sees key 0
    # Nested: vmap over V, then over the batch (3-D per-example inputs); mapped not on axis 0.
    qt = np.moveaxis(q, 0, 2)  # (B, T, V, N, H)
    inner = jax.vmap(lambda a, b, c: dpa(a, b, c, is_causal=True), in_axes=(1, None, None))
    outer = jax.vmap(inner, in_axes=(0, 0, 0))
    got = np.asarray(jax.jit(outer)(qt, k, v))  # (B, V, T, N, H)
    inner_j = jax.vmap(
        lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True), in_axes=(1, None, None)
    )
    want = np.asarray(jax.vmap(inner_j)(qt, k, v))
    assert_close(got, want, np.float32)


def test_bfloat16_under_jit(rng):
    jax, jnp = _jax()
    q, k, v = (
        jnp.asarray(randn(rng, s)).astype(jnp.bfloat16) for s in ((2, 8, 4, 16), (2, 8, 4, 16), (2, 8, 4, 16))
    )
    out = jax.jit(lambda a, b, c: dpa(a, b, c, is_causal=True))(q, k, v)
    assert out.dtype == jnp.bfloat16
    want = ref.scaled_dot_product_attention(
        *(np.asarray(a.astype(jnp.float32)) for a in (q, k, v)), is_causal=True, layout="bshd"
    )
    assert_close(np.asarray(out.astype(jnp.float32)), want, tol=1e-2)


def test_bad_arguments_raise_at_trace_time(rng):
    jax, jnp = _jax()
    q = jnp.asarray(randn(rng, (1, 4, 2, 8)))
    bad = [
        (TypeError, "mask", dict(mask=jnp.zeros((4, 4)))),
        (TypeError, "bias", dict(bias=jnp.zeros((4, 4), bool))),
        (ValueError, "bias", dict(bias=jnp.zeros((3, 4)))),
        (ValueError, "query_seq_lengths", dict(query_seq_lengths=jnp.array([1, 2]))),
        (TypeError, "key_value_seq_lengths", dict(key_value_seq_lengths=jnp.array([1.0]))),
        (ValueError, "local_window_size", dict(local_window_size=(-1, 2))),
        (ValueError, "implementation", dict(implementation="cudnn")),
    ]
    for exc, match, kw in bad:
        with pytest.raises(exc, match=match):
            jax.jit(lambda a, kw=kw: dpa(a, a, a, **kw))(q)
    with pytest.raises(ValueError, match="multiple"):
        dpa(jnp.ones((1, 4, 3, 8)), q, q)
    with pytest.raises(ValueError, match="head dim"):
        dpa(q, jnp.ones((1, 4, 2, 4)), jnp.ones((1, 4, 2, 4)))
