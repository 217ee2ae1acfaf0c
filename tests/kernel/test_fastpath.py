"""The small-call fast path of scaled_dot_product_attention (float32 NumPy
bhsd arrays, default options): same results as the general path, bit for bit,
and against the float64 reference; every argument it does not take goes to the
general path, errors included."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ISAS, assert_close, randn

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention


def _qkv(rng, B, H, L, S, D, Dv):
    return randn(rng, (B, H, L, D)), randn(rng, (B, H, S, D)), randn(rng, (B, H, S, Dv))


@pytest.mark.parametrize("shape", [(1, 8, 16, 16, 64, 64), (2, 3, 37, 131, 17, 5), (1, 1, 1, 1, 1, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_fast_path_matches_general_path(rng, shape, causal, scale):
    q, k, v = _qkv(rng, *shape)
    copies = [a.copy() for a in (q, k, v)]
    fast = sdpa(q, k, v, is_causal=causal, scale=scale)
    # window=(-1, -1) means "no window" but is not the default, so this call
    # takes the general path with the same semantics.
    general = sdpa(q, k, v, is_causal=causal, scale=scale, window=(-1, -1))
    assert fast.dtype == np.float32 and fast.shape == shape[:3] + (shape[5],)
    np.testing.assert_array_equal(fast, general)
    assert_close(fast, ref.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale), np.float32)
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)


def test_fast_path_strided_and_threads(rng):
    big = randn(rng, (2, 4, 24, 128))
    q, k, v = big[..., :64], big[..., 64:], big[:, :, ::2, :64]  # strided views, last dim contiguous
    k = k[:, :, ::2]
    out1 = sdpa(q, k, v, num_threads=1)
    out2 = sdpa(q, k, v, num_threads=2)
    np.testing.assert_array_equal(out1, out2)
    assert_close(out1, ref.scaled_dot_product_attention(q, k, v), np.float32)


def test_fast_path_non_contiguous_last_dim(rng):
    q, k, v = _qkv(rng, 1, 2, 9, 11, 32, 8)
    qs = np.asfortranarray(q)  # last dim strided: the general path copies it
    np.testing.assert_array_equal(sdpa(qs, k, v), sdpa(q, k, v))


@pytest.mark.parametrize(
    "kw,exc",
    [
        ({"num_threads": 0}, ValueError),
        ({"num_threads": 1.5}, TypeError),
        ({"scale": float("inf")}, ValueError),
        ({"scale": float("nan")}, ValueError),
        ({"dropout_p": 0.1}, ValueError),  # (no dropout_seed)
        ({"dropout_seed": -1}, ValueError),
        ({"dropout_p": "0"}, TypeError),
    ],
)
def test_fast_path_errors_unchanged(rng, kw, exc):
    q, k, v = _qkv(rng, 1, 2, 4, 4, 8, 8)
    with pytest.raises(exc):
        sdpa(q, k, v, **kw)


@pytest.mark.parametrize("which", ["heads", "length", "dim", "batch"])
def test_fast_path_shape_errors_unchanged(rng, which):
    q, k, v = _qkv(rng, 2, 2, 4, 5, 8, 8)
    if which == "heads":
        k, v = k[:, :1], v[:, :1]  # 2 query heads, 1 kv head, no enable_gqa
    elif which == "length":
        v = v[:, :, :4]
    elif which == "dim":
        k = k[..., :4]
    else:
        k = k[:1]
    with pytest.raises(ValueError):
        sdpa(q, k, v)


# The (path, level) pairs where a lower level changes the result: both on the tiles,
# "medium" on VDPBF16PS ("high" computes as "highest" there).
LEVEL_PATHS = [p for p in (("amx", "high"), ("amx", "medium"), ("avx512bf16", "medium")) if p[0] in ISAS]


@pytest.mark.skipif(
    not LEVEL_PATHS, reason="precision levels take effect on the amx and avx512bf16 paths only"
)
@pytest.mark.parametrize("isa,level", LEVEL_PATHS)
def test_fast_path_follows_precision(rng, isa, level):
    """The fast path passes precision= and the process default on, as the general path does."""
    before_isa, before_prec = fastattn.get_isa(), fastattn.get_float32_matmul_precision()
    fastattn.set_isa(isa)
    try:
        q, k, v = _qkv(rng, 1, 2, 64, 128, 64, 64)
        explicit = sdpa(q, k, v, precision=level)
        np.testing.assert_array_equal(explicit, sdpa(q, k, v, precision=level, window=(-1, -1)))
        assert np.any(explicit != sdpa(q, k, v))  # the default, "highest", differs
        fastattn.set_float32_matmul_precision(level)
        np.testing.assert_array_equal(sdpa(q, k, v), explicit)
    finally:
        fastattn.set_float32_matmul_precision(before_prec)
        fastattn.set_isa(before_isa)
