"""Attention dropout in the fused forward and backward (csrc/dropout.h): the
mask against an independent implementation (NumPy's Philox bit generator, in
fastattn.reference.dropout_mask), read back exactly from the kernel's output,
its statistics, outputs and gradients against the float64 reference with that
mask, every ISA path and shape class, bit-identical results for every thread
count, and argument checks."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, check_sdpa, randn
from test_backward import check_bwd, qkv

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention
bwd = fastattn.scaled_dot_product_attention_backward


def test_numpy_philox_is_random123s_philox4x64_10():
    """The oracle's generator is Philox-4x64-10 as published: Random123's
    known-answer vectors (kat_vectors, philox4x64 10 rounds), with NumPy's
    counter incremented before each block (so counter c - 1 gives block c)."""
    zero = np.random.Philox(counter=(1 << 256) - 1, key=0).random_raw(4)
    assert [f"{int(x):016x}" for x in zero] == [
        "16554d9eca36314c",
        "db20fe9d672d0fdc",
        "d7e772cee186176b",
        "7e68b68aec7ba23b",
    ]
    ones = (1 << 64) - 1
    top = np.random.Philox(counter=(1 << 256) - 2, key=(ones << 64) | ones).random_raw(4)
    assert [f"{int(x):016x}" for x in top] == [
        "87b092c3013fe90b",
        "438c3c67be8d0224",
        "9cc7d7c69cd777b6",
        "a09caebf594f0ba0",
    ]


def read_mask(L, S, H, B, p, seed, isa_threads=1, **kw):
    """The kernel's keep mask, read back exactly: q = 0 makes every weight 1/S,
    and value = the identity gives out[..., i, j] = keep[i, j] / (S (1 - p))."""
    q = np.zeros((B, H, L, 8), np.float32)
    k = np.ones((B, H, S, 8), np.float32)
    v = np.broadcast_to(np.eye(S, dtype=np.float64), (B, H, S, S))
    out = sdpa(q.astype(np.float64), k.astype(np.float64), v, dropout_p=p, dropout_seed=seed,
               num_threads=isa_threads, **kw)  # fmt: skip
    z = out * S * (1 - p)
    assert np.all((np.abs(z) < 1e-9) | (np.abs(z - 1) < 1e-9))
    return z > 0.5


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kernel_mask_is_the_reference_mask(p):
    keep = read_mask(70, 150, 3, 2, p, 987654321)
    np.testing.assert_array_equal(keep, ref.dropout_mask((2, 3, 70, 150), p, 987654321))


def test_mask_statistics():
    """Keep rate within 5 sigma of 1 - p overall and near it on every row, column,
    head and batch element; rows, heads and batch elements draw different masks;
    the mask has no correlation between neighbouring keys."""
    p, B, H, L, S = 0.3, 2, 3, 96, 256
    keep = read_mask(L, S, H, B, p, 2**64 - 12345)
    n = keep.size
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - (1 - p)) < 5 * sigma
    for axis in ((2, 3), (0, 1, 2), (0, 1, 3)):  # per (b, h), per key, per query position
        m = keep.mean(axis=axis)
        cnt = n / m.size
        assert np.all(np.abs(m - (1 - p)) < 6 * np.sqrt(p * (1 - p) / cnt))
    flat = keep.reshape(-1, S)
    assert len({r.tobytes() for r in flat}) == flat.shape[0]
    # neighbouring keys (also across the 8-key Philox blocks) are independent
    a, b = flat[:, :-1].astype(float), flat[:, 1:].astype(float)
    corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
    assert abs(corr) < 5 / np.sqrt(a.size)


def test_seed_and_batch_offset():
    keep = ref.dropout_mask((3, 2, 5, 40), 0.5, 7)
    np.testing.assert_array_equal(ref.dropout_mask((1, 2, 5, 40), 0.5, 7, batch_offset=2)[0], keep[2])
    assert not np.array_equal(ref.dropout_mask((3, 2, 5, 40), 0.5, 8), keep)


# Shapes of every path class: decode rows (L = 1, GQA groups: dropout takes the
# prefill path), a few positions, tiles and their edges, split-KV (one row,
# long keys), float64.
@pytest.mark.parametrize(
    "B,Hq,Hk,L,S,D,Dv",
    [
        (1, 1, 1, 1, 1, 8, 8),
        (2, 8, 2, 1, 300, 64, 64),
        (1, 4, 1, 3, 77, 32, 16),
        (2, 2, 2, 65, 129, 40, 24),
        (1, 2, 1, 200, 130, 64, 64),
        (1, 1, 1, 1, 5000, 64, 64),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_every_isa(isa, rng, B, Hq, Hk, L, S, D, Dv, causal):
    q, k, v = qkv(rng, B, Hq, Hk, L, S, D, Dv)
    check_sdpa(q, k, v, is_causal=causal, enable_gqa=Hq != Hk, dropout_p=0.2, dropout_seed=11)


@pytest.mark.parametrize(
    "kw",
    [
        {"attn_mask": "bool"},
        {"attn_mask": "float"},
        {"window": (20, 3), "alibi_slopes": np.array([0.3, 0.1])},
        {"softcap": 5.0, "sinks": np.array([0.5, -1.0])},
        {"key_lengths": np.array([50, 90]), "query_lengths": np.array([33, 60])},
        {"block_mask": np.tril(np.ones((4, 5), bool)), "block_size": (16, 20)},
        {"precision": "medium"},
    ],
    ids=["bool", "float", "window-alibi", "softcap-sinks", "lengths", "blocks", "medium"],
)
def test_forward_options_every_isa(isa, rng, kw):
    q, k, v = qkv(rng, 2, 2, 2, 60, 90, 32, 32)
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = rng.random((2, 1, 60, 90)) < 0.8
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = randn(rng, (60, 90))
    if "precision" in kw:  # (the reference has no precision: float32 "medium" is computed as "highest")
        o = sdpa(q, k, v, dropout_p=0.3, dropout_seed=5, **kw)
        assert_close(o, ref.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=5), np.float32)
        return
    check_sdpa(q, k, v, dropout_p=0.3, dropout_seed=5, **kw)


def test_forward_dtypes_and_layouts(rng):
    q, k, v = qkv(rng, 2, 2, 2, 33, 47, 16, 16)
    for dt in (np.float16, np.float64):
        o = sdpa(q.astype(dt), k.astype(dt), v.astype(dt), dropout_p=0.4, dropout_seed=3)
        r = ref.scaled_dot_product_attention(
            q.astype(dt), k.astype(dt), v.astype(dt), dropout_p=0.4, dropout_seed=3
        )
        assert_close(
            o, r, dtype=np.float32 if dt == np.float16 else dt, tol=2e-3 if dt == np.float16 else None
        )
    # bshd, 3-D (one batch element), 2-D (one head): the mask's (b, h, i, j) are the bhsd ones
    t = [np.swapaxes(a, 1, 2).copy() for a in (q, k, v)]
    assert_close(sdpa(*t, layout="bshd", dropout_p=0.4, dropout_seed=3),
                 np.swapaxes(ref.scaled_dot_product_attention(q, k, v, dropout_p=0.4, dropout_seed=3), 1, 2),
                 np.float32)  # fmt: skip
    check_sdpa(q[0], k[0], v[0], dropout_p=0.4, dropout_seed=3)
    check_sdpa(q[0, 0], k[0, 0], v[0, 0], dropout_p=0.4, dropout_seed=3)


def test_split_plans_keep_batch_indices(rng):
    """Leading dims whose strides cannot merge are run plan by plan
    (fastattn._plan.split): each batch element still draws its own mask."""
    big = [randn(rng, (2, 4, 2, 30, 16)) for _ in range(3)]
    q, k, v = (a[:, :3] for a in big)
    check_sdpa(q, k, v, dropout_p=0.25, dropout_seed=99)


def test_p_zero_and_one(rng):
    q, k, v = qkv(rng, 1, 2, 2, 40, 50, 16, 16)
    plain, lse0 = sdpa(q, k, v, return_lse=True)
    o, lse = sdpa(q, k, v, return_lse=True, dropout_p=0.0, dropout_seed=1)
    np.testing.assert_array_equal(o, plain)
    o1, lse1 = sdpa(q, k, v, return_lse=True, dropout_p=1.0, dropout_seed=1)
    np.testing.assert_array_equal(o1, np.zeros_like(o1))
    assert_close(lse1, lse0)  # the LSE is the undropped softmax's
    go = randn(rng, o.shape)
    dq, dk, dv = bwd(go, q, k, v, o1, lse1, dropout_p=1.0, dropout_seed=1)
    for g in (dq, dk, dv):
        np.testing.assert_array_equal(g, np.zeros_like(g))


def test_seed_reproducible(rng):
    q, k, v = qkv(rng, 1, 2, 2, 40, 50, 16, 16)
    a = sdpa(q, k, v, dropout_p=0.5, dropout_seed=42)
    np.testing.assert_array_equal(a, sdpa(q, k, v, dropout_p=0.5, dropout_seed=42))
    assert not np.array_equal(a, sdpa(q, k, v, dropout_p=0.5, dropout_seed=43))


@pytest.mark.parametrize("L,S", [(1, 1), (33, 65), (97, 128), (150, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_every_isa(isa, rng, L, S, causal):
    check_bwd(*qkv(rng, 1, 2, 2, L, S, 40, 24), rng=rng, is_causal=causal, dropout_p=0.3, dropout_seed=17)


@pytest.mark.parametrize(
    "kw",
    [
        {"enable_gqa": True},
        {"window": (30, 2), "alibi_slopes": np.array([0.2, 0.05, 0.1, 0.3])},
        {"softcap": 4.0, "sinks": np.array([0.1, 0.2, -0.3, 1.0])},
        {"key_lengths": np.array([70, 20]), "query_lengths": np.array([40, 9])},
    ],
    ids=["gqa", "window-alibi", "softcap-sinks", "lengths"],
)
def test_backward_options(rng, kw):
    Hk = 2 if kw.get("enable_gqa") else 4
    check_bwd(*qkv(rng, 2, 4, Hk, 45, 80, 24, 24), rng=rng, dropout_p=0.4, dropout_seed=2**63 + 5, **kw)


def test_backward_per_batch_mask_calls(rng, monkeypatch):
    """A mask whose leading dims cannot merge: the backward runs one call per
    batch element (dropout_b0 keeps each element's mask)."""
    from fastattn import _kernels

    q, k, v = (randn(rng, (2, 3, 2, 30, 16)) for _ in range(3))
    mask = rng.random((2, 1, 1, 30, 30)) < 0.8
    calls = []
    real = _kernels.attention_backward
    monkeypatch.setattr(_kernels, "attention_backward", lambda *a: calls.append(1) or real(*a))
    check_bwd(q, k, v, rng=rng, attn_mask=mask, dropout_p=0.3, dropout_seed=8)
    assert len(calls) == 6


def test_threads_bit_identical(rng):
    q, k, v = qkv(rng, 2, 4, 2, 130, 150, 32, 32)
    kw = dict(enable_gqa=True, is_causal=True, dropout_p=0.3, dropout_seed=77)
    o1, l1 = sdpa(q, k, v, return_lse=True, num_threads=1, **kw)
    go = randn(rng, o1.shape)
    g1 = bwd(go, q, k, v, o1, l1, num_threads=1, **kw)
    for t in (2, 3):
        o, lse = sdpa(q, k, v, return_lse=True, num_threads=t, **kw)
        np.testing.assert_array_equal(o, o1)
        for a, b in zip(bwd(go, q, k, v, o, lse, num_threads=t, **kw), g1):
            np.testing.assert_array_equal(a, b)
    # a long single row: split-KV merges, also bit-identical
    q1, k1, v1 = qkv(rng, 1, 1, 1, 1, 6000, 64, 64)
    a = sdpa(q1, k1, v1, dropout_p=0.1, dropout_seed=1, num_threads=1)
    np.testing.assert_array_equal(a, sdpa(q1, k1, v1, dropout_p=0.1, dropout_seed=1, num_threads=2))


def test_gradient_by_finite_differences(rng):
    """The dropped forward's gradient, against central differences of the
    fastattn forward itself (float64, the same seed: the mask is fixed)."""
    q, k, v = (a.astype(np.float64) for a in qkv(rng, 1, 1, 1, 6, 9, 4, 3))
    kw = dict(dropout_p=0.5, dropout_seed=123)
    go = randn(rng, (1, 1, 6, 3), np.float64)
    o, lse = sdpa(q, k, v, return_lse=True, **kw)
    grads = bwd(go, q, k, v, o, lse, **kw)
    eps = 1e-6
    for a, g in zip((q, k, v), grads):
        num = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            a[idx] += eps
            up = (sdpa(q, k, v, **kw) * go).sum()
            a[idx] -= 2 * eps
            dn = (sdpa(q, k, v, **kw) * go).sum()
            a[idx] += eps
            num[idx] = (up - dn) / (2 * eps)
        np.testing.assert_allclose(g, num, atol=1e-7)


@pytest.mark.parametrize(
    "kw,exc,msg",
    [
        ({"dropout_p": 0.1}, ValueError, "dropout_seed is required"),
        ({"dropout_p": -0.1, "dropout_seed": 1}, ValueError, "dropout_p must be in"),
        ({"dropout_p": 1.5, "dropout_seed": 1}, ValueError, "dropout_p must be in"),
        ({"dropout_p": "0.1", "dropout_seed": 1}, TypeError, "dropout_p must be a number"),
        ({"dropout_p": True, "dropout_seed": 1}, TypeError, "dropout_p must be a number"),
        ({"dropout_p": 0.1, "dropout_seed": -1}, ValueError, "dropout_seed must be in"),
        ({"dropout_p": 0.1, "dropout_seed": 2**64}, ValueError, "dropout_seed must be in"),
        ({"dropout_p": 0.1, "dropout_seed": 1.0}, TypeError, "dropout_seed must be an int"),
        ({"dropout_p": 0.0, "dropout_seed": "x"}, TypeError, "dropout_seed must be an int"),
    ],
)
def test_bad_arguments(rng, kw, exc, msg):
    q, k, v = qkv(rng, 1, 1, 1, 4, 4, 8, 8)
    with pytest.raises(exc, match=msg):
        sdpa(q, k, v, **kw)
    o, lse = sdpa(q, k, v, return_lse=True)
    with pytest.raises(exc, match=msg):
        bwd(o, q, k, v, o, lse, **kw)


def test_cuda_refuses_dropout(rng):
    q, k, v = qkv(rng, 1, 1, 1, 4, 4, 8, 8)
    with pytest.raises(NotImplementedError, match="device='cuda'"):
        sdpa(q, k, v, dropout_p=0.1, dropout_seed=1, device="cuda")
