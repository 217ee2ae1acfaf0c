"""scaled_dot_product_attention against the float64 reference: shapes, dtypes,
masks, causal alignment, GQA, layouts, strides, out=, special values."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, check_sdpa, optional, randn

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention
DTYPES = [np.float32, np.float64]


def qkv(rng, B, Hq, L, S, D, Dv=None, Hk=None, dtype=np.float32):
    Hk = Hq if Hk is None else Hk
    Dv = D if Dv is None else Dv
    return (
        randn(rng, (B, Hq, L, D), dtype),
        randn(rng, (B, Hk, S, D), dtype),
        randn(rng, (B, Hk, S, Dv), dtype),
    )


# --- shapes ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 3, 16, 17, 64, 80, 128, 256])
def test_head_dims(rng, dtype, D):
    check_sdpa(*qkv(rng, 1, 2, 37, 131, D, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "L,S",
    [
        (1, 1),
        (1, 17),
        (17, 1),
        (97, 127),
        (127, 128),
        (128, 129),
        (47, 63),
        (48, 64),
        (49, 65),
        (95, 191),
        (96, 192),
        (97, 193),
        (1, 2053),
        (211, 1031),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(rng, dtype, L, S, causal):
    check_sdpa(*qkv(rng, 1, 2, L, S, 32, dtype=dtype), is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long(rng, dtype):
    check_sdpa(*qkv(rng, 1, 1, 1031, 2053, 64, dtype=dtype), is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_head_dim_differs(rng, dtype):
    check_sdpa(*qkv(rng, 2, 3, 50, 70, 24, Dv=40, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_and_heads(rng, dtype):
    check_sdpa(*qkv(rng, 3, 5, 33, 65, 16, dtype=dtype), is_causal=True)


def test_2d_inputs(rng):
    q, k, v = randn(rng, (40, 16)), randn(rng, (70, 16)), randn(rng, (70, 8))
    o, lse = check_sdpa(q, k, v)
    assert o.shape == (40, 8) and lse.shape == (40,)


def test_3d_inputs(rng):
    q, k, v = randn(rng, (4, 40, 16)), randn(rng, (4, 70, 16)), randn(rng, (4, 70, 16))
    o, lse = check_sdpa(q, k, v, is_causal=True)
    assert o.shape == (4, 40, 16) and lse.shape == (4, 40)


def test_5d_inputs(rng):
    q = randn(rng, (2, 3, 4, 20, 16))
    k = randn(rng, (2, 3, 4, 30, 16))
    v = randn(rng, (2, 3, 4, 30, 16))
    o, lse = check_sdpa(q, k, v, is_causal=True)
    assert o.shape == (2, 3, 4, 20, 16) and lse.shape == (2, 3, 4, 20)


def test_5d_mask_over_unmergeable_lead_dims(rng):
    B1, B2, H, L, S = 2, 3, 2, 19, 23
    q, k, v = (randn(rng, (B1, B2, H, n, 8)) for n in (L, S, S))
    mask = rng.random((B1, 1, H, L, S)) > 0.3  # varies over B1, broadcast over B2
    check_sdpa(q, k, v, attn_mask=mask)
    fmask = randn(rng, (B1, 1, H, L, S))
    check_sdpa(q, k, v, attn_mask=fmask, is_causal=True)


def test_empty(rng):
    for L, S in [(0, 5), (5, 0), (0, 0)]:
        q, k, v = qkv(rng, 2, 2, L, S, 8)
        o, lse = sdpa(q, k, v, return_lse=True)
        assert o.shape == (2, 2, L, 8) and lse.shape == (2, 2, L)
        assert np.all(o == 0)
        assert np.all(lse == -np.inf)
    q, k, v = qkv(rng, 0, 2, 4, 4, 8)
    assert sdpa(q, k, v).shape == (0, 2, 4, 8)


# --- masks ----------------------------------------------------------------

MASK_SHAPES = [
    (11, 13),
    (1, 13),
    (11, 1),
    (3, 1, 13),
    (3, 11, 13),
    (2, 1, 11, 13),
    (2, 3, 11, 13),
    (1, 1, 1, 13),
]


@pytest.mark.parametrize("mdtype", [np.bool_, np.float32, np.float64, np.float16])
@pytest.mark.parametrize("mshape", MASK_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_masks(rng, mdtype, mshape, causal):
    q, k, v = qkv(rng, 2, 3, 11, 13, 8)
    if mdtype is np.bool_:
        m = rng.random(mshape) > 0.3
    else:
        m = randn(rng, mshape, mdtype, 2.0)
        m[rng.random(mshape) < 0.2] = -np.inf
    check_sdpa(q, k, v, attn_mask=m, is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masks_big_tiles(rng, dtype):
    q, k, v = qkv(rng, 1, 2, 150, 300, 32, dtype=dtype)
    check_sdpa(q, k, v, attn_mask=rng.random((150, 300)) > 0.5)
    check_sdpa(q, k, v, attn_mask=randn(rng, (2, 1, 300), dtype), is_causal=True)


def test_bool_mask_polarity(rng):
    q, k, v = qkv(rng, 1, 1, 1, 3, 4)
    m = np.array([False, True, False])
    o = sdpa(q, k, v, attn_mask=m)
    np.testing.assert_allclose(o[0, 0, 0], v[0, 0, 1], rtol=1e-6)  # only key 1 visible


def test_float_mask_equals_bool(rng):
    q, k, v = qkv(rng, 2, 2, 20, 30, 16)
    b = rng.random((20, 30)) > 0.4
    f = np.where(b, 0.0, -np.inf).astype(np.float32)
    np.testing.assert_allclose(sdpa(q, k, v, attn_mask=b), sdpa(q, k, v, attn_mask=f), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(rng, dtype):
    q, k, v = qkv(rng, 1, 2, 10, 12, 8, dtype=dtype)
    m = rng.random((2, 10, 12)) > 0.5
    m[0, 3] = False
    m[1, 7] = False
    o, lse = check_sdpa(q, k, v, attn_mask=m)
    assert np.all(o[0, 0, 3] == 0) and np.all(o[0, 1, 7] == 0)
    assert lse[0, 0, 3] == -np.inf and lse[0, 1, 7] == -np.inf
    fm = np.where(m, 0.0, -np.inf).astype(dtype)
    o2, lse2 = sdpa(q, k, v, attn_mask=fm, return_lse=True)
    assert np.all(o2[0, 0, 3] == 0) and lse2[0, 1, 7] == -np.inf


# --- causal -----------------------------------------------------------------


@pytest.mark.parametrize("L,S", [(5, 9), (9, 5), (64, 200), (200, 64), (1, 100), (100, 1)])
def test_causal_bottom_right(rng, L, S):
    q, k, v = qkv(rng, 1, 2, L, S, 8)
    o, lse = check_sdpa(q, k, v, is_causal=True)
    # Build the same result from an explicit bool mask: query i sees j <= i + S - L.
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    o2, lse2 = sdpa(q, k, v, attn_mask=j <= i + S - L, return_lse=True)
    assert_close(o, o2, np.float32)
    dead = np.arange(L) + S - L < 0  # rows with no visible key
    assert np.all(o[:, :, dead] == 0) and np.all(lse[:, :, dead] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, ~dead]))


def test_causal_decode_row_sees_everything(rng):
    q, k, v = qkv(rng, 1, 2, 1, 50, 8)
    np.testing.assert_allclose(sdpa(q, k, v, is_causal=True), sdpa(q, k, v), rtol=1e-6, atol=1e-7)


# --- GQA / MQA --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hk", [(8, 2), (6, 3), (8, 1), (4, 4)])
def test_gqa(rng, dtype, Hq, Hk):
    q, k, v = qkv(rng, 2, Hq, 21, 77, 16, Hk=Hk, dtype=dtype)
    o, _ = check_sdpa(q, k, v, enable_gqa=True, is_causal=True)
    expected = sdpa(q, np.repeat(k, Hq // Hk, 1), np.repeat(v, Hq // Hk, 1), is_causal=True)
    assert_close(o, expected, dtype)


def test_gqa_with_mask(rng):
    q, k, v = qkv(rng, 2, 6, 21, 33, 16, Hk=2)
    check_sdpa(q, k, v, enable_gqa=True, attn_mask=rng.random((6, 21, 33)) > 0.3)


# --- layouts -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_bshd_layout(rng, dtype):
    q, k, v = qkv(rng, 2, 4, 30, 50, 16, Hk=2, dtype=dtype)
    t = [np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in (q, k, v)]
    m = rng.random((4, 30, 50)) > 0.3
    o, lse = check_sdpa(*t, layout="bshd", enable_gqa=True, is_causal=True, attn_mask=m)
    assert o.shape == (2, 30, 4, 16) and lse.shape == (2, 4, 30)
    o2, lse2 = sdpa(q, k, v, enable_gqa=True, is_causal=True, attn_mask=m, return_lse=True)
    np.testing.assert_array_equal(np.swapaxes(o, 1, 2), o2)
    np.testing.assert_array_equal(lse, lse2)


def test_bshd_3d(rng):
    q, k, v = randn(rng, (30, 4, 16)), randn(rng, (50, 4, 16)), randn(rng, (50, 4, 16))
    o, lse = check_sdpa(q, k, v, layout="bshd")
    assert o.shape == (30, 4, 16) and lse.shape == (4, 30)


# --- strides and memory -------------------------------------------------------


def test_packed_qkv_views(rng):
    B, L, H, D = 2, 37, 4, 16
    qkv_ = randn(rng, (B, L, 3, H, D))
    q, k, v = qkv_[:, :, 0], qkv_[:, :, 1], qkv_[:, :, 2]
    check_sdpa(q, k, v, layout="bshd", is_causal=True)
    check_sdpa(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), is_causal=True)


def test_transposed_and_negative_strides(rng):
    q, k, v = qkv(rng, 2, 3, 20, 30, 16)
    check_sdpa(q[::-1, :, ::-1], k[:, ::-1, ::2], v[:, ::-1, ::2])
    base = randn(rng, (16, 30, 3, 2)).T  # shape (2, 3, 30, 16), last dim strided
    assert not base.flags.c_contiguous
    check_sdpa(q, base, base)


def test_non_contiguous_last_dim(rng):
    q, k, v = (randn(rng, (2, 3, n, 32))[..., ::2] for n in (20, 30, 30))
    check_sdpa(q, k, v, is_causal=True)


def test_read_only_inputs(rng):
    q, k, v = qkv(rng, 1, 2, 20, 30, 16)
    m = rng.random((20, 30)) > 0.3
    for a in (q, k, v, m):
        a.flags.writeable = False
    check_sdpa(q, k, v, attn_mask=m)


def test_non_native_byte_order(rng):
    q, k, v = qkv(rng, 1, 2, 20, 30, 16)
    sw = [a.astype(a.dtype.newbyteorder(">" if np.little_endian else "<")) for a in (q, k, v)]
    m = randn(rng, (20, 30)).astype(">f4" if np.little_endian else "<f4")
    o = sdpa(*sw, attn_mask=m)
    np.testing.assert_array_equal(o, sdpa(q, k, v, attn_mask=m.astype(np.float32)))
    check_sdpa(*sw, attn_mask=m)


def test_lists_are_accepted():
    q = [[1.0, 0.0], [0.0, 1.0]]
    o = sdpa(q, q, [[1.0, 2.0], [3.0, 4.0]])
    assert o.dtype == np.float64
    assert_close(o, ref.scaled_dot_product_attention(q, q, [[1.0, 2.0], [3.0, 4.0]]), np.float64)


# --- out= ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_out(rng, dtype):
    q, k, v = qkv(rng, 2, 3, 20, 30, 16, dtype=dtype)
    out = np.full((2, 3, 20, 16), 7, dtype=dtype)
    r = sdpa(q, k, v, out=out, is_causal=True)
    assert r is out
    np.testing.assert_array_equal(out, sdpa(q, k, v, is_causal=True))


def test_out_non_contiguous_view(rng):
    q, k, v = qkv(rng, 2, 3, 20, 30, 16)
    expected = sdpa(q, k, v)
    big = np.zeros((2, 20, 3, 40), np.float32)
    view = np.swapaxes(big, 1, 2)[..., 4:20]
    r = sdpa(q, k, v, out=view)
    assert r is view
    np.testing.assert_array_equal(view, expected)
    assert np.all(big[..., :4] == 0) and np.all(big[..., 20:] == 0)
    big2 = np.zeros((2, 3, 20, 32), np.float32)
    view2 = big2[..., ::2]  # strided last dim: written through a copy
    assert sdpa(q, k, v, out=view2) is view2
    np.testing.assert_array_equal(view2, expected)
    assert np.all(big2[..., 1::2] == 0)


# --- special values --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_very_negative_logits_not_masked(rng, dtype):
    q = np.ones((1, 1, 1, 4), dtype)
    k = np.full((1, 1, 3, 4), -5e4, dtype)
    k[0, 0, 1] = -5e4 + 0.5  # scaled logits -1e5, -1e5 + 1, -1e5 (all exact in float32)
    v = randn(rng, (1, 1, 3, 5), dtype)
    o, lse = sdpa(q, k, v, return_lse=True)
    p = np.array([1.0, np.e, 1.0]) / (2 + np.e)
    # A float32 logit of magnitude 1e5 carries an absolute error of a few
    # 1e5 * 2**-24 (after the change to base 2), i.e. that relative error in p.
    tol = 1e-10 if dtype == np.float64 else 1e5 * 2.0**-24 * 8
    assert_close(o[0, 0, 0], p @ v[0, 0].astype(np.float64), tol=tol)
    assert_close(lse[0, 0, 0], -1e5 + np.log(2 + np.e), tol=tol)
    f = np.full((1, 1, 1, 3), -1e5, dtype)  # equal logits: uniform, whatever the rounding
    o2, lse2 = check_sdpa(np.zeros((1, 1, 1, 4), dtype), k, v, attn_mask=f)
    np.testing.assert_allclose(o2[0, 0, 0], v[0, 0].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse2, -1e5 + np.log(3), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_one_query_row(rng, dtype):
    q, k, v = qkv(rng, 1, 2, 100, 130, 16, dtype=dtype)
    q[0, 1, 57, 3] = np.nan
    o, lse = check_sdpa(q, k, v)
    assert np.all(np.isnan(o[0, 1, 57]))
    o[0, 1, 57] = 0
    assert np.all(np.isfinite(o))


def test_large_scale_stays_finite(rng):
    q, k, v = qkv(rng, 1, 2, 60, 70, 16)
    o, _ = check_sdpa(q, k, v, scale=50.0)
    assert np.all(np.isfinite(o))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale(rng, dtype):
    q, k, v = qkv(rng, 1, 2, 20, 30, 16, dtype=dtype)
    check_sdpa(q, k, v, scale=0.3)
    assert_close(sdpa(q, k, v, scale=0.5), sdpa(q * 2, k, v, scale=0.25), dtype)


def test_hand_computed():
    q = np.array([[[[1.0, 0.0]]]])
    k = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = np.array([[[[1.0], [3.0]]]])
    o, lse = sdpa(q, k, v, scale=1.0, return_lse=True)
    p = np.exp(1.0) / (np.exp(1.0) + 1.0)
    np.testing.assert_allclose(o[0, 0, 0, 0], p * 1 + (1 - p) * 3, rtol=1e-14)
    np.testing.assert_allclose(lse[0, 0, 0], np.log(np.e + 1), rtol=1e-14)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_16bit_inputs(rng, dt):
    dtype = np.dtype(np.float16) if dt == "float16" else np.dtype(optional("ml_dtypes").bfloat16)
    q, k, v = (randn(rng, (1, 2, n, 32)).astype(dtype) for n in (40, 70, 70))
    o = sdpa(q, k, v, is_causal=True)
    assert o.dtype == dtype
    # Inputs are exact in the 16-bit type; the result is rounded once to it.
    eps = float(optional("ml_dtypes").finfo(dtype).eps)
    assert_close(o, ref.scaled_dot_product_attention(q, k, v, is_causal=True), tol=2 * eps)
    o32 = sdpa(q.astype(np.float32), k, v, is_causal=True)
    assert o32.dtype == np.float32
    assert_close(o32, ref.scaled_dot_product_attention(q, k, v, is_causal=True), np.float32)
