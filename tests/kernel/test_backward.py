"""The fused backward pass against the explicit float64 formula
(fastattn.reference.scaled_dot_product_attention_backward), finite differences,
thread-count determinism and argument checks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, randn

import fastattn
from fastattn import reference as ref

bwd = fastattn.scaled_dot_product_attention_backward


def check_bwd(q, k, v, *, rng, dtype=None, tol=None, **kw):
    """Forward with return_lse, fused backward, compare with the reference."""
    go = randn(rng, np.asarray(q).shape[:-1] + (np.asarray(v).shape[-1],), np.asarray(q).dtype)
    if kw.get("layout") == "bshd":
        go = randn(rng, q.shape[:-1] + (v.shape[-1],), q.dtype)
    copies = [a.copy() for a in (go, q, k, v)]
    fw = {n: x for n, x in kw.items() if n != "num_threads"}
    o, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **fw)
    got = bwd(go, q, k, v, o, lse, **kw)
    exp = ref.scaled_dot_product_attention_backward(go, q, k, v, **fw)
    assert len(got) == len(exp)
    for g, e, a, n in zip(got, exp, (q, k, v, None), ("dq", "dk", "dv", "dsinks")):
        if a is not None:
            assert g.shape == a.shape and g.dtype == a.dtype, n
        cdt = np.float64 if np.asarray(q).dtype == np.float64 else np.float32
        assert_close(g, e, dtype=dtype or cdt, tol=tol, what=n)
    for a, c in zip((go, q, k, v), copies):
        np.testing.assert_array_equal(a, c)  # inputs never modified
    return got


def qkv(rng, B, Hq, Hk, L, S, D, Dv, dtype=np.float32):
    return (
        randn(rng, (B, Hq, L, D), dtype),
        randn(rng, (B, Hk, S, D), dtype),
        randn(rng, (B, Hk, S, Dv), dtype),
    )


# Tiles: 64 keys, 32 (scalar, float64) or 96 query rows; probe the edges and primes.
@pytest.mark.parametrize(
    "L,S", [(1, 1), (31, 63), (32, 64), (33, 65), (95, 129), (97, 128), (7, 200), (150, 40)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_tiles_every_isa(isa, rng, L, S, causal):
    check_bwd(*qkv(rng, 1, 2, 2, L, S, 40, 24), rng=rng, is_causal=causal)


# Partial tiles: the products of a register block sum only over the keys (or
# query rows) some row (key) of it sees (fb_ranges); causal diagonals with
# L = S, L < S and L > S, window edges on both sides, D a multiple of the
# vector and not (the fused score pass and the separate products).
@pytest.mark.parametrize(
    "L,S,kw",
    [
        (200, 200, {"is_causal": True}),
        (130, 300, {"is_causal": True}),
        (300, 130, {"is_causal": True}),
        (250, 260, {"window": (37, 5)}),
        (250, 260, {"window": (-1, 20)}),
        (250, 260, {"window": (70, 0), "alibi_slopes": np.array([0.2, 0.05])}),
    ],
)
@pytest.mark.parametrize("D", [32, 20])
def test_partial_tiles_every_isa(isa, rng, L, S, kw, D):
    check_bwd(*qkv(rng, 1, 2, 2, L, S, D, D), rng=rng, **kw)


@pytest.mark.parametrize("D,Dv", [(1, 1), (3, 5), (16, 16), (17, 33), (64, 64), (128, 80)])
def test_head_dims(isa, rng, D, Dv):
    check_bwd(*qkv(rng, 1, 2, 2, 50, 70, D, Dv), rng=rng, is_causal=True)


# Without a mask, ALiBi or softcap, P and dS come from the fused score pass
# (fb_sdp): several query and key tiles, GQA, strided rows (bshd), D and Dv
# whole vectors on every path, the causal diagonal and a window's edges.
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_score_pass(isa, rng, layout, causal):
    B, Hq, Hk, L, S, D, Dv = 2, 4, 2, 200, 150, 32, 48
    if layout == "bshd":
        q, k, v = randn(rng, (B, L, Hq, D)), randn(rng, (B, S, Hk, D)), randn(rng, (B, S, Hk, Dv))
    else:
        q, k, v = qkv(rng, B, Hq, Hk, L, S, D, Dv)
    check_bwd(q, k, v, rng=rng, is_causal=causal, enable_gqa=True, layout=layout)
    check_bwd(q, k, v, rng=rng, is_causal=causal, enable_gqa=True, layout=layout, window=(40, 3))


def test_gqa_masks_layout(isa, rng):
    q, k, v = randn(rng, (2, 30, 4, 33)), randn(rng, (2, 131, 2, 33)), randn(rng, (2, 131, 2, 20))
    m = rng.random((4, 30, 131)) > 0.3
    check_bwd(q, k, v, rng=rng, attn_mask=m, is_causal=True, enable_gqa=True, layout="bshd")
    check_bwd(q, k, v, rng=rng, attn_mask=randn(rng, (4, 1, 131)), enable_gqa=True, layout="bshd")


@pytest.mark.parametrize("mdtype", [np.float32, np.float64])
def test_float_mask_with_minus_inf(rng, mdtype):
    q, k, v = qkv(rng, 1, 2, 2, 40, 70, 32, 32)
    m = randn(rng, (2, 40, 70), mdtype)
    m[:, :, 10:30] = -np.inf
    m[1, 5, :] = -np.inf  # one row fully masked
    got = check_bwd(q, k, v, rng=rng, attn_mask=m)
    assert np.all(got[0][0, 1, 5] == 0)


def test_options_every_isa(isa, rng):
    """softcap, ALiBi, sinks, window and both length arrays together."""
    q, k, v = qkv(rng, 2, 4, 2, 70, 90, 24, 24)
    check_bwd(
        q,
        k,
        v,
        rng=rng,
        enable_gqa=True,
        is_causal=True,
        softcap=3.0,
        alibi_slopes=np.array([0.3, 0.1, 0.05, 0.02]),
        sinks=np.array([0.5, -1.0, 2.0, 0.0]),
        window=(40, -1),
        key_lengths=np.array([90, 61]),
        query_lengths=np.array([70, 33]),
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"softcap": 2.0},
        {"alibi_slopes": np.array([[0.5, 0.25], [0.1, 0.0]])},
        {"sinks": np.array([1.0, -0.5])},
        {"key_lengths": np.array([0, 50])},
        {"window": (5, 7)},
        {"is_causal": True, "query_lengths": np.array([10, 3]), "key_lengths": np.array([60, 2])},
        {"scale": 0.3},
    ],
)
def test_option(rng, kw):
    check_bwd(*qkv(rng, 2, 2, 2, 45, 60, 16, 16), rng=rng, **kw)


def test_float64_every_isa(isa, rng):
    q, k, v = qkv(rng, 1, 4, 2, 67, 130, 20, 12, np.float64)
    check_bwd(q, k, v, rng=rng, is_causal=True, enable_gqa=True, sinks=np.array([0.1, 0.2, 0.3, 0.4]))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16bit_inputs(rng, dtype):
    q, k, v = qkv(rng, 1, 2, 2, 40, 50, 32, 32, dtype)
    # 16-bit: computed in float32 from the rounded inputs, the results rounded to 16 bits.
    check_bwd(q, k, v, rng=rng, dtype=np.float32, tol=1e-2, is_causal=True)


def test_two_d_and_lead_dims(rng):
    check_bwd(randn(rng, (20, 8)), randn(rng, (30, 8)), randn(rng, (30, 8)), rng=rng, is_causal=True)
    q, k, v = randn(rng, (2, 3, 2, 20, 8)), randn(rng, (2, 3, 2, 30, 8)), randn(rng, (2, 3, 2, 30, 4))
    # a mask whose leading dims cannot merge into one batch stride (one call per batch element)
    m = np.broadcast_to(rng.random((2, 1, 2, 20, 30)) > 0.2, (2, 3, 2, 20, 30))
    check_bwd(q, k, v, rng=rng, attn_mask=m, sinks=np.array([0.5, 1.5]))


def test_fully_masked_rows_zero_gradient(rng):
    q, k, v = qkv(rng, 1, 2, 2, 8, 6, 4, 4)
    m = np.ones((8, 6), dtype=bool)
    m[2] = False
    go = randn(rng, (1, 2, 8, 4))
    for kw in ({}, {"sinks": np.array([0.3, -0.2])}):
        o, lse = fastattn.scaled_dot_product_attention(q, k, v, m, return_lse=True, **kw)
        dq = bwd(go, q, k, v, o, lse, m, **kw)[0]
        assert np.all(dq[:, :, 2] == 0)
    # L > S causal (bottom-right): the first L - S rows see nothing
    q, k, v = qkv(rng, 1, 1, 1, 10, 4, 4, 4)
    got = check_bwd(q, k, v, rng=rng, is_causal=True)
    assert np.all(got[0][0, 0, :6] == 0)


@pytest.mark.parametrize("Dv,causal", [(24, True), (64, False)])
def test_threads_bit_identical(rng, Dv, causal):
    q, k, v = qkv(rng, 1, 4, 2, 300, 333, 32, Dv)
    go = randn(rng, (1, 4, 300, Dv))
    kw = {"is_causal": causal, "enable_gqa": True}
    o, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    base = bwd(go, q, k, v, o, lse, num_threads=1, **kw)
    for nt in (2, 3):
        for a, b in zip(base, bwd(go, q, k, v, o, lse, num_threads=nt, **kw)):
            np.testing.assert_array_equal(a, b)


def test_finite_differences(rng):
    """Central differences of sum(O * W) on a tiny float64 case with every option."""
    q, k, v = qkv(rng, 1, 2, 1, 3, 5, 3, 2, np.float64)
    w = randn(rng, (1, 2, 3, 2), np.float64)
    sinks = np.array([0.4, -0.3])
    kw = dict(
        is_causal=True,
        enable_gqa=True,
        softcap=1.5,
        alibi_slopes=np.array([0.2, 0.7]),
        attn_mask=randn(rng, (2, 3, 5), np.float64),
        key_lengths=np.array([4]),
    )

    def loss(q, k, v, sinks):
        return float(np.sum(fastattn.scaled_dot_product_attention(q, k, v, sinks=sinks, **kw) * w))

    o, lse = fastattn.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    grads = bwd(w, q, k, v, o, lse, sinks=sinks, **kw)
    args = [q, k, v, sinks]
    h = 1e-6
    for n, (a, g) in enumerate(zip(args, grads)):
        fd = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus = [x.copy() for x in args]
            minus = [x.copy() for x in args]
            plus[n][idx] += h
            minus[n][idx] -= h
            fd[idx] = (loss(*plus) - loss(*minus)) / (2 * h)
        np.testing.assert_allclose(g, fd, atol=1e-7, rtol=1e-6)
    assert np.all(grads[1][0, 0, 4] == 0) and np.all(grads[2][0, 0, 4] == 0)  # past key_lengths


def test_bad_inputs(rng):
    q, k, v = qkv(rng, 1, 2, 2, 8, 6, 4, 4)
    go = randn(rng, (1, 2, 8, 4))
    o, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse must have shape"):
        bwd(go, q, k, v, o, lse[..., :-1])
    with pytest.raises(TypeError, match="lse must be a float"):
        bwd(go, q, k, v, o, lse.astype(np.int32))
    with pytest.raises(ValueError, match="out must have the forward output's shape"):
        bwd(go, q, k, v, o[..., :-1], lse)
    with pytest.raises(TypeError, match="out must have the query's dtype"):
        bwd(go, q, k, v, o.astype(np.float64), lse)
    with pytest.raises(ValueError, match="grad_out must have"):
        bwd(go[:, :1], q, k, v, o, lse)
    bad = lse.copy()
    bad[0, 1, 3] = np.nan
    dq_nan = bwd(go, q, k, v, o, bad)[0]  # NaN inputs' LSE: NaN gradients (as torch), not an error
    assert np.isnan(dq_nan[0, 1, 3]).all() and not np.isnan(np.delete(dq_nan[0, 1], 3, axis=0)).any()
    bad[0, 1, 3] = -np.inf  # that row sees keys
    with pytest.raises(ValueError, match=r"lse is -inf on 1 row"):
        bwd(go, q, k, v, o, bad)
    # -inf is right where the row sees nothing (bool mask, or past query_lengths)
    m = np.ones((8, 6), dtype=bool)
    m[3] = False
    o2, lse2 = fastattn.scaled_dot_product_attention(q, k, v, m, return_lse=True)
    assert np.isneginf(lse2[0, 1, 3])
    bwd(go, q, k, v, o2, lse2, m)
    with pytest.raises(ValueError, match="lse is -inf"):
        bwd(go, q, k, v, o2, lse2)  # without the mask the row sees keys
    with pytest.raises(ValueError, match="enable_gqa"):
        bwd(go, q, k[:, :1], v[:, :1], o, lse)
    with pytest.raises(ValueError, match="softcap"):
        bwd(go, q, k, v, o, lse, softcap=-1.0)
    with pytest.raises(ValueError, match="layout"):
        bwd(go, q, k, v, o, lse, layout="sbhd")
