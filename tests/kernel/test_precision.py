"""torch's float32 matmul precision levels: ``precision=`` per call and
``fastattn.set_float32_matmul_precision`` as the process default.

"highest" (the default) is float32 arithmetic, bit-identical to a call without
the argument.  "high" (bf16x3) must be within 2e-4 relative of the float64
reference on unit-normal inputs; "medium" (Q, K, V, P rounded to bf16) within
twice the error of the naive bf16 computation on the rounded inputs.  The lower
levels take effect on the ``amx`` path, "medium" also on the ``avx512bf16``
path ("high" computes as "highest" there: three VDPBF16PS products would not
beat float32); elsewhere they compute as "highest".
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import ISAS

import fastattn
from fastattn import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
sdpa = fastattn.scaled_dot_product_attention


@pytest.fixture
def default_precision():
    before = fastattn.get_float32_matmul_precision()
    try:
        yield
    finally:
        fastattn.set_float32_matmul_precision(before)


def rnd(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def test_bad_values(rng, default_precision):
    q = rnd(rng, (1, 2, 8, 16))
    with pytest.raises(ValueError, match="precision"):
        sdpa(q, q, q, precision="low")
    with pytest.raises(TypeError, match="precision"):
        sdpa(q, q, q, precision=1)
    with pytest.raises(ValueError, match="precision"):
        fastattn.set_float32_matmul_precision("fast")
    with pytest.raises(TypeError, match="precision"):
        fastattn.set_float32_matmul_precision(None)
    with pytest.raises(ValueError, match="precision"):
        fastattn.varlen_attention(
            q[0].swapaxes(0, 1), q[0].swapaxes(0, 1), q[0].swapaxes(0, 1), [0, 8], [0, 8], precision="Highest"
        )
    assert fastattn.get_float32_matmul_precision() == "highest"


def test_highest_is_the_default_and_bit_identical(isa, rng, default_precision):
    q, k, v = rnd(rng, (1, 4, 70, 64)), rnd(rng, (1, 4, 90, 64)), rnd(rng, (1, 4, 90, 64))
    a = sdpa(q, k, v, is_causal=True)
    b = sdpa(q, k, v, is_causal=True, precision="highest")
    fastattn.set_float32_matmul_precision("highest")
    c = sdpa(q, k, v, is_causal=True)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L,S,D", [(64, 64, 64), (33, 130, 40), (300, 257, 128)])
def test_high_within_2e4_relative(isa, rng, causal, L, S, D):
    q, k, v = rnd(rng, (1, 2, L, D)), rnd(rng, (1, 2, S, D)), rnd(rng, (1, 2, S, D))
    o = sdpa(q, k, v, is_causal=causal, precision="high")
    r = ref.scaled_dot_product_attention(q, k, v, is_causal=causal)
    scale = max(1.0, float(np.abs(r).max()))
    assert np.max(np.abs(o - r)) <= 2e-4 * scale


@pytest.mark.parametrize(
    "opts", [{}, {"is_causal": True}, {"window": (20, 5)}, {"softcap": 4.0, "scale": 1.0}]
)
def test_medium_within_twice_naive_bf16(isa, rng, opts):
    q, k, v = rnd(rng, (2, 4, 70, 48)), rnd(rng, (2, 2, 150, 48)), rnd(rng, (2, 2, 150, 48))
    o = sdpa(q, k, v, enable_gqa=True, precision="medium", **opts)
    r = ref.scaled_dot_product_attention(q, k, v, enable_gqa=True, **opts)
    q16, k16, v16 = (a.astype(BF16) for a in (q, k, v))
    S = k.shape[-2]
    p = ref.scaled_dot_product_attention(
        q16, k16, np.broadcast_to(np.eye(S), (2, 2, S, S)), enable_gqa=True, **opts
    )
    p16 = p.astype(np.float32).astype(BF16).astype(np.float32)
    naive = np.matmul(p16, np.repeat(v16.astype(np.float32), 2, axis=1))
    naive_err = float(np.max(np.abs(naive - r)))
    assert np.max(np.abs(o - r)) <= 2 * naive_err + 1e-6


@pytest.mark.skipif("amx" not in ISAS, reason="the lower levels take effect on the amx path only")
def test_levels_take_effect_on_amx(rng, default_precision):
    before = fastattn.get_isa()
    fastattn.set_isa("amx")
    try:
        q, k, v = rnd(rng, (1, 2, 64, 64)), rnd(rng, (1, 2, 128, 64)), rnd(rng, (1, 2, 128, 64))
        hi = sdpa(q, k, v)
        h = sdpa(q, k, v, precision="high")
        m = sdpa(q, k, v, precision="medium")
        fastattn.set_float32_matmul_precision("medium")
        m2 = sdpa(q, k, v)
        assert np.any(hi != h) and np.any(h != m)
        np.testing.assert_array_equal(m, m2)
        r = ref.scaled_dot_product_attention(q, k, v)
        assert np.max(np.abs(h - r)) < np.max(np.abs(m - r))  # "high" is the more accurate
        # Decode-sized calls (< 32 rows) stay on the float32 kernel whatever the level.
        np.testing.assert_array_equal(sdpa(q[:, :, :1], k, v, precision="medium"), sdpa(q[:, :, :1], k, v))
    finally:
        fastattn.set_isa(before)


@pytest.mark.skipif("avx512bf16" not in ISAS, reason="no avx512bf16 path on this CPU/build")
def test_levels_on_avx512bf16(rng, default_precision):
    """ "medium" runs on VDPBF16PS (bf16 products: not the float32 result, within the
    naive bf16 contract of test_medium_within_twice_naive_bf16); "high" is "highest"."""
    before = fastattn.get_isa()
    fastattn.set_isa("avx512bf16")
    try:
        q, k, v = rnd(rng, (1, 2, 64, 64)), rnd(rng, (1, 2, 128, 64)), rnd(rng, (1, 2, 128, 64))
        hi = sdpa(q, k, v)
        m = sdpa(q, k, v, precision="medium")
        assert np.any(hi != m)
        np.testing.assert_array_equal(sdpa(q, k, v, precision="high"), hi)
        fastattn.set_isa("avx512")
        np.testing.assert_array_equal(sdpa(q, k, v), hi)  # "highest" is the AVX-512 kernel
        fastattn.set_isa("avx512bf16")
        r = ref.scaled_dot_product_attention(q, k, v)
        assert np.max(np.abs(m - r)) > np.max(np.abs(hi - r))
        np.testing.assert_array_equal(sdpa(q[:, :, :1], k, v, precision="medium"), sdpa(q[:, :, :1], k, v))
    finally:
        fastattn.set_isa(before)


def test_float64_and_float16_ignore_the_level(isa, rng):
    q, k, v = rnd(rng, (1, 2, 64, 32)), rnd(rng, (1, 2, 80, 32)), rnd(rng, (1, 2, 80, 32))
    for dt in (np.float64, np.float16):
        a = sdpa(q.astype(dt), k.astype(dt), v.astype(dt))
        b = sdpa(q.astype(dt), k.astype(dt), v.astype(dt), precision="medium")
        np.testing.assert_array_equal(a, b)
    # A float32 query over float16 keys is not rounded to bf16 either.
    a = sdpa(q, k.astype(np.float16), v.astype(np.float16))
    b = sdpa(q, k.astype(np.float16), v.astype(np.float16), precision="medium")
    np.testing.assert_array_equal(a, b)


def test_varlen_passes_precision(rng):
    cu = np.array([0, 40, 140])
    q, k, v = rnd(rng, (140, 2, 32)), rnd(rng, (140, 2, 32)), rnd(rng, (140, 2, 32))
    o = fastattn.varlen_attention(q, k, v, cu, cu, is_causal=True, precision="high")
    for b in range(2):
        sl = slice(cu[b], cu[b + 1])
        r = ref.scaled_dot_product_attention(*(np.swapaxes(a[sl], 0, 1) for a in (q, k, v)), is_causal=True)
        assert np.max(np.abs(np.swapaxes(o[sl], 0, 1) - r)) <= 2e-4 * max(1.0, float(np.abs(r).max()))
