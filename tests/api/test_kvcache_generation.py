"""KVCache for generation loops: nothing is lost silently (float32 by default; a value that
does not fit the cache dtype raises before anything is written), crop (speculative
decoding), reorder_cache (beam search), get_seq_length and growth with max_len=None.
Outputs are compared with the float64 reference over the tokens the cache should hold."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, randn

import fastattn
from fastattn import reference as ref

KVCache = fastattn.KVCache
BF16 = np.dtype(ml_dtypes.bfloat16)


def snapshot(cache):
    return cache.k.copy(), cache.v.copy(), cache.lengths


def assert_unchanged(cache, snap):
    k, v, lens = snap
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)
    np.testing.assert_array_equal(cache.lengths, lens)


def attend_reference(q, K, V):
    """Causal attention of q (the newest tokens) over the whole K, V (float64)."""
    return ref.scaled_dot_product_attention(q, K, V, is_causal=True, enable_gqa=True)


# --- no silent loss -----------------------------------------------------------------


def test_default_dtype_is_float32(rng):
    cache = KVCache(1, 2, 8, 4)
    assert cache.dtype == np.float32
    k = randn(rng, (1, 2, 3, 4))
    cache.append(k, k)
    np.testing.assert_array_equal(cache.k[:, :, :3], k)  # stored exactly


@pytest.mark.parametrize(
    "cache_dtype, big",
    [(np.float16, 1e5), (np.float16, -7e4), (BF16, 1e39), (np.float32, 1e39)],
    ids=["f16", "f16-neg", "bf16", "f32-from-f64"],
)
def test_append_value_beyond_dtype_range_raises_and_changes_nothing(rng, cache_dtype, big):
    cache = KVCache(2, 2, 8, 4, dtype=cache_dtype)
    cache.append(randn(rng, (2, 2, 3, 4)), randn(rng, (2, 2, 3, 4)))
    snap = snapshot(cache)
    for which in ("k_new", "v_new"):
        k, v = randn(rng, (2, 2, 2, 4), np.float64), randn(rng, (2, 2, 2, 4), np.float64)
        (k if which == "k_new" else v)[1, 0, 1, 2] = big
        with pytest.raises(ValueError, match=which) as e:
            cache.append(k, v)
        assert "(1, 0, 1, 2)" in str(e.value) and "nothing was written" in str(e.value)
        assert_unchanged(cache, snap)
        with pytest.raises(ValueError, match=which):
            cache.append(k[1:], v[1:], batch_index=[1])
        assert_unchanged(cache, snap)


def test_infinite_and_nan_inputs_are_stored_as_given(rng):
    """inf and NaN are not lost by the conversion: they are stored (as the kernel's NaN/inf rules apply)."""
    cache = KVCache(1, 1, 4, 2, dtype=np.float16)
    k = np.array([[[[np.inf, 1.0], [np.nan, -np.inf]]]], np.float32)
    cache.append(k, np.zeros_like(k))
    got = cache.k[0, 0, :2].astype(np.float32)
    np.testing.assert_array_equal(got, k[0, 0])


def test_attention_with_kvcache_overflow_raises_before_writing(rng):
    B, Hk, S, D = 2, 1, 8, 4
    kc, vc = np.zeros((B, Hk, S, D), np.float16), np.zeros((B, Hk, S, D), np.float16)
    q = randn(rng, (B, 2, 1, D))
    kn, vn = randn(rng, (B, Hk, 1, D)), randn(rng, (B, Hk, 1, D))
    vn[0, 0, 0, 1] = 1e6
    with pytest.raises(ValueError, match="v_new"):
        fastattn.attention_with_kvcache(q, kc, vc, 3, kn, vn)
    assert not kc.any() and not vc.any()


# --- crop --------------------------------------------------------------------------


def test_crop_rolls_back_and_later_appends_overwrite(rng):
    B, Hk, Hq, D = 2, 2, 4, 8
    cache = KVCache(B, Hk, 32, D)
    k, v = randn(rng, (B, Hk, 10, D)), randn(rng, (B, Hk, 10, D))
    cache.append(k, v)
    cache.append(k[1:, :, :3], v[1:, :, :3], batch_index=1)  # lengths 10, 13
    cache.crop(12)
    np.testing.assert_array_equal(cache.lengths, [10, 12])
    cache.crop(6)  # speculative decoding: the last 4 (6) draft tokens rejected
    np.testing.assert_array_equal(cache.lengths, [6, 6])
    assert cache.get_seq_length() == 6
    # New tokens go where the rejected ones were; attention sees only the kept + new ones.
    k2, v2 = randn(rng, (B, Hk, 2, D)), randn(rng, (B, Hk, 2, D))
    cache.append(k2, v2)
    q = randn(rng, (B, Hq, 2, D))
    K = np.concatenate([k[:, :, :6], k2], axis=2)
    V = np.concatenate([v[:, :, :6], v2], axis=2)
    assert_close(cache.attend(q), attend_reference(q, K, V), np.float32)
    cache.crop(100)  # more than held: nothing changes
    np.testing.assert_array_equal(cache.lengths, [8, 8])
    cache.crop(0)
    assert cache.get_seq_length() == 0


def test_crop_bad_input_changes_nothing(rng):
    cache = KVCache(2, 1, 8, 4)
    cache.append(randn(rng, (2, 1, 5, 4)), randn(rng, (2, 1, 5, 4)))
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="n must be >= 0"):
        cache.crop(-1)
    for bad in (2.0, "3", None, True, np.array([2])):
        with pytest.raises(TypeError, match="n must be an int"):
            cache.crop(bad)
    assert_unchanged(cache, snap)
    cache.crop(np.int64(3))
    np.testing.assert_array_equal(cache.lengths, [3, 3])


# --- reorder_cache -----------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
def test_reorder_cache_follows_the_beams(rng, cache_dtype):
    B, Hk, Hq, D = 4, 2, 4, 8
    cache = KVCache(B, Hk, 16, D, dtype=cache_dtype)
    k, v = randn(rng, (B, Hk, 6, D)), randn(rng, (B, Hk, 6, D))
    cache.append(k, v)
    cache.crop(6)
    cache.append(k[2:3, :, :2], v[2:3, :, :2], batch_index=2)  # lengths 6, 6, 8, 6
    kc, vc, lens = cache.k.copy(), cache.v.copy(), cache.lengths
    beam_idx = np.array([2, 2, 0, 3])  # beam 2 continued twice, beam 1 dropped
    cache.reorder_cache(beam_idx)
    np.testing.assert_array_equal(cache.lengths, lens[beam_idx])
    for b, src in enumerate(beam_idx):
        n = lens[src]
        np.testing.assert_array_equal(cache.k[b, :, :n], kc[src, :, :n])
        np.testing.assert_array_equal(cache.v[b, :, :n], vc[src, :, :n])
    # The next step attends each row over its new history.
    kn, vn = randn(rng, (B, Hk, 1, D)), randn(rng, (B, Hk, 1, D))
    cache.append(kn, vn)
    q = randn(rng, (B, Hq, 1, D))
    out = cache.attend(q)
    for b, src in enumerate(beam_idx):
        n = lens[src]
        K = np.concatenate([kc[src : src + 1, :, :n], kn[b : b + 1].astype(cache_dtype)], axis=2)
        V = np.concatenate([vc[src : src + 1, :, :n], vn[b : b + 1].astype(cache_dtype)], axis=2)
        assert_close(out[b : b + 1], attend_reference(q[b : b + 1], K, V), np.float32)


def test_reorder_cache_bad_input_changes_nothing(rng):
    cache = KVCache(3, 1, 8, 4)
    cache.append(randn(rng, (3, 1, 5, 4)), randn(rng, (3, 1, 5, 4)))
    cache.crop(4)
    snap = snapshot(cache)
    cases = [
        (ValueError, r"beam_idx values must lie in \[0, 3\)", [0, 1, 3]),
        (ValueError, r"beam_idx values must lie in \[0, 3\)", [0, -1, 2]),
        (ValueError, r"beam_idx must have shape \(3,\)", [0, 1]),
        (ValueError, r"beam_idx must have shape \(3,\)", [[0, 1, 2]]),
        (TypeError, "beam_idx must be an integer array", [0.0, 1.0, 2.0]),
        (TypeError, "beam_idx must be an integer array", [True, False, True]),
        (TypeError, "beam_idx must be an array", None),
    ]
    for exc, msg, bad in cases:
        with pytest.raises(exc, match=msg):
            cache.reorder_cache(bad)
        assert_unchanged(cache, snap)


# --- growth ------------------------------------------------------------------------


def test_growing_cache_doubles_and_matches_a_fixed_one(rng):
    B, Hk, Hq, D, Dv = 2, 2, 4, 8, 6
    grow = KVCache(B, Hk, None, D, value_dim=Dv)
    fixed = KVCache(B, Hk, 300, D, value_dim=Dv)
    assert grow.max_len is None and fixed.max_len == fixed.capacity == 300
    caps = [grow.capacity]
    k, v = randn(rng, (B, Hk, 300, D)), randn(rng, (B, Hk, 300, Dv))
    pos = 0
    for step in (7, 1, 20, 1, 1, 100, 3, 150, 1, 1):
        for c in (grow, fixed):
            c.append(k[:, :, pos : pos + step], v[:, :, pos : pos + step])
        pos += step
        if grow.capacity != caps[-1]:
            caps.append(grow.capacity)
        assert grow.capacity >= pos
        q = randn(rng, (B, Hq, 1, D))
        np.testing.assert_array_equal(grow.attend(q), fixed.attend(q))
    np.testing.assert_array_equal(grow.k[:, :, :pos], k[:, :, :pos])
    np.testing.assert_array_equal(grow.v[:, :, :pos], v[:, :, :pos])
    # each growth at least doubles (amortised O(1) per token): few reallocations
    assert all(b >= 2 * a for a, b in zip(caps, caps[1:])), caps
    assert len(caps) <= 6, caps
    assert_close(grow.attend(q), attend_reference(q, k[:, :, :pos], v[:, :, :pos]), np.float32)


def test_growing_cache_token_by_token_is_amortised(rng):
    cache = KVCache(1, 1, None, 4)
    growths = 0
    for _ in range(1000):
        before = cache.capacity
        cache.append(np.ones((1, 1, 1, 4), np.float32), np.ones((1, 1, 1, 4), np.float32))
        growths += cache.capacity != before
    assert cache.get_seq_length() == 1000 and cache.capacity == 1024 and growths == 6  # 16 -> 1024


def test_growing_cache_errors_and_ragged_rows(rng):
    cache = KVCache(2, 1, None, 4, dtype=np.float16)
    cache.append(randn(rng, (1, 1, 30, 4)), randn(rng, (1, 1, 30, 4)), batch_index=1)
    np.testing.assert_array_equal(cache.lengths, [0, 30])
    snap = snapshot(cache)
    big = np.full((1, 1, 40, 4), 1e6, np.float32)
    with pytest.raises(ValueError, match="k_new"):  # the dtype check runs before the growth
        cache.append(big, big, batch_index=1)
    assert cache.capacity == 32
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match="max_len"):
        KVCache(1, 1, 0, 4)
    with pytest.raises(TypeError, match="max_len"):
        KVCache(1, 1, 8.0, 4)
    assert "max_len=None" in repr(cache)


# --- rotary keys -----------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotated_keys_that_overflow_raise_and_near_range_keys_are_exact(rng, interleaved):
    """Rotation mixes each pair (x, y): values that fit float16 may not after rotation.
    The cache then rotates into a checked buffer; it must raise before writing when a
    rotated value overflows, and store exactly what the one-pass path stores otherwise."""
    D = 8
    c, s = fastattn.rotary_cos_sin(16, D)
    kw = dict(dtype=np.float16, rotary_cos=c, rotary_sin=s, rotary_interleaved=interleaved)
    # Near the range (the checked path, max|k| * sqrt(2) >= 65504) but no rotated overflow:
    big = KVCache(1, 1, 8, D, **kw)
    small = KVCache(1, 1, 8, D, **kw)
    k = randn(rng, (1, 1, 3, D))
    k_big = k.copy()
    k_big[0, 0, 0, 0] = 50000.0  # position 0: no rotation, fits; forces the checked path
    big.append(k_big, k_big)
    small.append(k, k)  # the same rows 1 and 2, through the one-pass path
    np.testing.assert_array_equal(big.k[:, :, 1:3], small.k[:, :, 1:3])
    expect = ref.apply_rotary(k_big.astype(np.float64), c, s, interleaved=interleaved)
    np.testing.assert_allclose(big.k[:, :, :3].astype(np.float64), expect, rtol=1e-3)
    # A rotated pair beyond float16's range: (6e4, 6e4) at a position with cos = sin-ish grows by ~sqrt(2).
    snap = snapshot(big)
    bad = np.zeros((1, 1, 1, D), np.float32)
    half = D // 2
    j = (0, 1) if interleaved else (0, half)
    bad[0, 0, 0, j[0]] = bad[0, 0, 0, j[1]] = 60000.0
    with pytest.raises(ValueError, match="k_new"):
        big.append(bad, np.zeros_like(bad))  # at position 3: cos(3) < 0, sin(3) > 0: |x c - y s| > 65504
    assert_unchanged(big, snap)
    kc, vc = np.zeros((1, 1, 8, D), np.float16), np.zeros((1, 1, 8, D), np.float16)
    q = randn(rng, (1, 1, 1, D))
    with pytest.raises(ValueError, match="k_new"):
        fastattn.attention_with_kvcache(
            q, kc, vc, 3, bad, np.zeros_like(bad), rotary_cos=c, rotary_sin=s, rotary_interleaved=interleaved
        )
    assert not kc.any() and not vc.any()
