"""Interop: inputs that are not NumPy arrays (memoryviews, objects with
``__array__`` such as CPU torch tensors), read without copies when possible;
``fastattn.dot_product_attention`` against the reference in JAX's conventions,
and against ``jax.nn.dot_product_attention`` itself when JAX is installed."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, check_sdpa, optional, randn

import fastattn
from fastattn import reference as ref

dpa = fastattn.dot_product_attention


class ArrayLike:
    """An object numpy.asarray converts through __array__ (no buffer protocol)."""

    def __init__(self, a):
        self.a = a
        self.calls = 0

    def __array__(self, dtype=None, copy=None):
        self.calls += 1
        return self.a if dtype is None else self.a.astype(dtype)


def test_memoryview_and_array_protocol_inputs(rng):
    q, k, v = (randn(rng, (2, 3, 20, 16)) for _ in range(3))
    expected = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    mv = fastattn.scaled_dot_product_attention(memoryview(q), memoryview(k), memoryview(v), is_causal=True)
    np.testing.assert_array_equal(mv, expected)
    wrapped = [ArrayLike(a) for a in (q, k, v)]
    out = fastattn.scaled_dot_product_attention(*wrapped, is_causal=True)
    np.testing.assert_array_equal(out, expected)
    assert all(w.calls >= 1 for w in wrapped)
    mask = rng.random((20, 20)) < 0.8
    check_sdpa(memoryview(q), k, ArrayLike(v), attn_mask=memoryview(mask))


def test_nested_lists_are_accepted(rng):
    q = randn(rng, (4, 8), np.float64)
    out = fastattn.scaled_dot_product_attention(q.tolist(), q.tolist(), q.tolist())
    assert_close(out, ref.scaled_dot_product_attention(q, q, q), np.float64)


def test_torch_cpu_tensors_are_read_in_place(rng):
    torch = optional("torch")
    q, k, v = (randn(rng, (2, 4, 33, 32)) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    # numpy.asarray of a CPU tensor is a view of the same memory: no copy.
    assert np.shares_memory(np.asarray(tq), q)
    out = fastattn.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    expected = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).numpy()
    assert_close(out, expected, np.float32)
    # A transposed (non-contiguous) tensor view works too.
    tqt = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3))).transpose(1, 2)
    np.testing.assert_array_equal(fastattn.scaled_dot_product_attention(tqt, tk, tv, is_causal=True), out)
    # float64 tensors and a bool mask tensor.
    mask = torch.from_numpy(rng.random((33, 33)) < 0.7)
    mask[:, 0] = True
    q64 = tq.double()
    out64 = fastattn.scaled_dot_product_attention(q64, tk.double(), tv.double(), attn_mask=mask)
    exp64 = torch.nn.functional.scaled_dot_product_attention(q64, tk.double(), tv.double(), attn_mask=mask)
    assert_close(out64, exp64.numpy(), np.float64)


def test_tensor_requiring_grad_is_refused_with_a_clear_error(rng):
    torch = optional("torch")
    t = torch.zeros((2, 8, 4), requires_grad=True)
    with pytest.raises(TypeError, match="query"):
        fastattn.scaled_dot_product_attention(t, t.detach(), t.detach())


# ---------------------------------------------------------------- JAX API
def _jax_oracle(
    q,
    k,
    v,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
):
    """JAX's documented semantics in float64 via fastattn.reference, with JAX's
    top-left causal/window masks written out explicitly as a bool mask."""
    B, T, N, H = q.shape
    S = k.shape[1]
    keep = np.ones((B, N, T, S), dtype=bool)
    t = np.arange(T)[:, None]
    s = np.arange(S)[None, :]
    if is_causal:
        keep &= s <= t
    if local_window_size is not None:
        lw = local_window_size
        left, right = (lw, lw) if isinstance(lw, int) else lw
        keep &= (s >= t - left) & (s <= t + right)
    if mask is not None:
        keep &= mask
    if key_value_seq_lengths is not None:
        keep &= s[None, None] < np.asarray(key_value_seq_lengths)[:, None, None, None]
    if query_seq_lengths is not None:
        keep &= t[None, None] < np.asarray(query_seq_lengths)[:, None, None, None]
    am = np.where(keep, 0.0 if bias is None else np.broadcast_to(bias, keep.shape), -np.inf)
    return ref.scaled_dot_product_attention(
        q, k, v, attn_mask=am, scale=scale, layout="bshd", enable_gqa=True
    ), keep


JAX_CASES = [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, T=5, S=23),  # T != S: JAX's causal is top-left
    dict(is_causal=True, T=23, S=9),
    dict(bias=True),
    dict(mask=True, bias=True, gqa=True),
    dict(local_window_size=3),
    dict(local_window_size=(4, 0), is_causal=True, T=7, S=30),
    dict(query_seq_lengths=True, key_value_seq_lengths=True, is_causal=True),
    dict(key_value_seq_lengths=True, T=6, S=26, local_window_size=(5, 1)),
    dict(key_value_seq_lengths=True, is_causal=True, T=20, S=20),
    dict(scale=0.3, gqa=True, is_causal=True),
]


def _jax_inputs(rng, case, dtype=np.float32):
    T, S = case.get("T", 19), case.get("S", 19)
    B, N, H = 2, 4, 16
    K = 2 if case.get("gqa") else N
    q, k, v = (
        randn(rng, (B, T, N, H), dtype),
        randn(rng, (B, S, K, H), dtype),
        randn(rng, (B, S, K, H), dtype),
    )
    kw = {}
    if case.get("bias"):
        kw["bias"] = randn(rng, (1, N, T, S), dtype)
    if case.get("mask"):
        m = rng.random((B, 1, T, S)) < 0.75
        m[..., 0] = True
        kw["mask"] = m
    if case.get("query_seq_lengths"):
        kw["query_seq_lengths"] = np.array([T, T - 4], dtype=np.int32)
    if case.get("key_value_seq_lengths"):
        kw["key_value_seq_lengths"] = np.array([S - 3, S], dtype=np.int32)
    for name in ("scale", "is_causal", "local_window_size"):
        if name in case:
            kw[name] = case[name]
    return q, k, v, kw


@pytest.mark.parametrize(
    "case", JAX_CASES, ids=[",".join(f"{a}={b}" for a, b in c.items()) or "plain" for c in JAX_CASES]
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dot_product_attention_matches_jax_semantics(rng, case, dtype):
    q, k, v, kw = _jax_inputs(rng, case, dtype)
    copies = [a.copy() for a in (q, k, v)]
    out = dpa(q, k, v, **kw)
    expected, keep = _jax_oracle(q, k, v, **kw)
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == dtype
    assert_close(out, expected, dtype)
    dead = ~keep.any(-1)  # (B, N, T): rows that see no key are zeros here
    assert np.all(out.transpose(0, 2, 1, 3)[dead] == 0)
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)


def test_dot_product_attention_3d_inputs_and_jax_names(rng):
    q, k, v = randn(rng, (9, 2, 8)), randn(rng, (12, 2, 8)), randn(rng, (12, 2, 8))
    out = dpa(q, k, v, is_causal=True, implementation="xla")
    expected, _ = _jax_oracle(q[None], k[None], v[None], is_causal=True)
    assert out.shape == (9, 2, 8)
    assert_close(out, expected[0], np.float32)


def test_dot_product_attention_bad_arguments(rng):
    q = randn(rng, (1, 4, 2, 8))
    with pytest.raises(ValueError, match="implementation"):
        dpa(q, q, q, implementation="cudnn")
    with pytest.raises(TypeError, match="mask"):
        dpa(q, q, q, mask=np.zeros((4, 4), dtype=np.float32))
    with pytest.raises(TypeError, match="bias"):
        dpa(q, q, q, bias=np.zeros((4, 4), dtype=bool))
    with pytest.raises(ValueError, match="local_window_size"):
        dpa(q, q, q, local_window_size=(-1, 2))
    with pytest.raises(TypeError, match="local_window_size"):
        dpa(q, q, q, local_window_size=(1, 2, 3))
    with pytest.raises(ValueError, match="query_seq_lengths"):
        dpa(q, q, q, query_seq_lengths=np.array([1, 2]))
    with pytest.raises(TypeError, match="key_value_seq_lengths"):
        dpa(q, q, q, key_value_seq_lengths=np.array([1.0]))
    with pytest.raises(ValueError, match="multiple"):
        dpa(randn(rng, (1, 4, 3, 8)), q, q)
    with pytest.raises(ValueError, match="query"):
        dpa(q[0, 0], q, q)


JAX_CHECK = [JAX_CASES[i] for i in (3, 5, 7, 9)]  # causal T != S, bias+mask+GQA, window, lengths


@pytest.mark.parametrize("case", JAX_CHECK, ids=[str(i) for i in range(len(JAX_CHECK))])
def test_dot_product_attention_against_jax(rng, case):
    jax = optional("jax")
    q, k, v, kw = _jax_inputs(rng, case, np.float32)  # JAX's softmax runs in float32 anyway
    out = dpa(q, k, v, **kw)
    jout = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw))
    _, keep = _jax_oracle(q, k, v, **kw)
    live = keep.any(-1).transpose(0, 2, 1)  # (B, T, N): rows with at least one key
    # JAX gives the mean of all values on rows with no key (see the docstring).
    assert_close(out[live], jout[live], np.float32)
    assert np.all(out[~live] == 0)
