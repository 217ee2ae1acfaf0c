"""KVCache and attention_with_kvcache: token-by-token decoding equals full causal
attention over the whole sequence (the float64 reference) at every step; ragged
batches; bounds and bad input leave the cache unchanged; the generate example."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, randn

import fastattn
from fastattn import reference as ref

KVCache = fastattn.KVCache
awk = fastattn.attention_with_kvcache
BF16 = np.dtype(ml_dtypes.bfloat16)
CACHE_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def out_tol(dtype):
    """Tolerance relative to the output scale: float32 kernels 1e-4; a 16-bit output adds
    its rounding (one ulp at 1 covers the half-ulp rounding of values up to the scale)."""
    dt = np.dtype(dtype)
    return 1e-4 if dt == np.float32 else 1e-4 + float(ml_dtypes.finfo(dt).eps)


def expected_step(q, K, V, **kw):
    """Reference: causal attention of q (the newest len(q) tokens) over the whole prefix K, V."""
    return ref.scaled_dot_product_attention(q, K, V, is_causal=True, enable_gqa=True, **kw)


def snapshot(cache):
    return cache.k.copy(), cache.v.copy(), cache.lengths


def assert_unchanged(cache, snap):
    k, v, lens = snap
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)
    np.testing.assert_array_equal(cache.lengths, lens)


# --- decoding equals full attention -----------------------------------------


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("q_in_cache_dtype", [False, True], ids=["q32", "qc"])
def test_token_by_token_equals_full_causal(isa, rng, cache_dtype, q_in_cache_dtype):
    B, Hq, Hk, D, Dv, T, P = 2, 4, 2, 17, 11, 24, 6
    cache = KVCache(B, Hk, 40, D, dtype=cache_dtype, value_dim=Dv)
    qdt = cache_dtype if q_in_cache_dtype else np.float32
    q = randn(rng, (B, Hq, T, D)).astype(qdt)
    k = randn(rng, (B, Hk, T, D))
    v = randn(rng, (B, Hk, T, Dv))
    # The cache stores keys/values rounded to its dtype: the reference sees the same values.
    kr, vr = k.astype(cache_dtype), v.astype(cache_dtype)
    cache.append(k[:, :, :P], v[:, :, :P])  # prefill P tokens at once
    o = cache.attend(q[:, :, :P])
    assert o.dtype == qdt and o.shape == (B, Hq, P, Dv)
    assert_close(o, expected_step(q[:, :, :P], kr[:, :, :P], vr[:, :, :P]), tol=out_tol(qdt))
    for t in range(P, T):
        lens = cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        np.testing.assert_array_equal(lens, [t + 1] * B)
        # one thread: results are bit-identical for any thread count, and tiny calls are cheaper
        o, lse = cache.attend(q[:, :, t : t + 1], return_lse=True, num_threads=1)
        eo, else_ = expected_step(q[:, :, t : t + 1], kr[:, :, : t + 1], vr[:, :, : t + 1], return_lse=True)
        assert_close(o, eo, tol=out_tol(qdt), what=f"step {t}")
        assert_close(lse, else_, np.float32, what=f"lse step {t}")
    np.testing.assert_array_equal(cache.k[:, :, :T], kr)  # stored exactly as converted
    np.testing.assert_array_equal(cache.v[:, :, :T], vr)


def test_decode_long_cache_uses_split_kv(isa, rng):
    # One sequence, 2 kv heads, 2048 slots: each decode step is split over the keys by the driver.
    Hq, Hk, D, n = 8, 2, 64, 1500
    cache = KVCache(1, Hk, 2048, D, dtype=np.float16)
    k, v = randn(rng, (1, Hk, n + 3, D)), randn(rng, (1, Hk, n + 3, D))
    cache.append(k[:, :, :n], v[:, :, :n])
    kr, vr = k.astype(np.float16), v.astype(np.float16)
    for t in range(n, n + 3):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        q = randn(rng, (1, Hq, 1, D))
        assert_close(cache.attend(q), expected_step(q, kr[:, :, : t + 1], vr[:, :, : t + 1]), np.float32)


def test_split_kv_follows_valid_lengths_not_max_len(isa, rng):
    # A cache padded far past its sequences splits like one cut at the longest valid
    # length: the same split points, so bit-identical results at every thread count.
    B, Hq, Hk, D, S = 2, 8, 2, 64, 8192
    seqlens = np.array([1500, 700], dtype=np.int32)
    kc, vc = randn(rng, (B, Hk, S, D)), randn(rng, (B, Hk, S, D))
    q = randn(rng, (B, Hq, 1, D))
    n = int(seqlens.max())
    cut = awk(q, kc[:, :, :n].copy(), vc[:, :, :n].copy(), seqlens, num_threads=1)
    for nt in (1, 2, 3):
        np.testing.assert_array_equal(awk(q, kc, vc, seqlens, num_threads=nt), cut)
    for b in range(B):
        m = seqlens[b]
        assert_close(
            cut[b : b + 1],
            expected_step(q[b : b + 1], kc[b : b + 1, :, :m], vc[b : b + 1, :, :m]),
            np.float32,
        )


def test_attend_options_match_reference(rng):
    B, Hq, Hk, D, n = 2, 4, 2, 8, 30
    cache = KVCache(B, Hk, 64, D, dtype=np.float32)
    k, v = randn(rng, (B, Hk, n, D)), randn(rng, (B, Hk, n, D))
    cache.append(k, v)
    q = randn(rng, (B, Hq, 3, D))
    slopes = rng.uniform(0.1, 1.0, size=(B, Hq))
    kw = dict(window=(7, 0), alibi_slopes=slopes, softcap=2.5, scale=0.3)
    o, lse = cache.attend(q, return_lse=True, **kw)
    eo, else_ = expected_step(q, k, v, return_lse=True, **kw)
    assert_close(o, eo, np.float32)
    assert_close(lse, else_, np.float32, what="lse")


# --- precision -------------------------------------------------------------------

# The ISA paths on which the float32 level changes results (>= 32 query rows per key/value head).
LEVELS_APPLY = fastattn.get_isa() in ("amx", "avx512bf16")


def _precision_cache(rng, B=3, Hk=2, D=32, lengths=(96, 70, 81)):
    cache = KVCache(B, Hk, 128, D)
    for b, n in enumerate(lengths):
        cache.append(randn(rng, (Hk, n, D)), randn(rng, (Hk, n, D)), batch_index=b)
    return cache


def test_attend_precision_passes_through(rng):
    """attend(precision=...) is the direct call at that precision on the same cache, bit
    for bit: contiguous rows (one call) and scattered rows (one call per sequence)."""
    cache = _precision_cache(rng)
    q = randn(rng, (3, 4, 64, 32))  # 64 queries x 2 heads per key/value head
    kw = dict(is_causal=True, enable_gqa=True)
    for prec in ("medium", "high", "highest"):
        want = fastattn.scaled_dot_product_attention(
            q, cache.k, cache.v, key_lengths=cache.lengths, precision=prec, **kw
        )
        np.testing.assert_array_equal(cache.attend(q, precision=prec), want)
        o, lse = cache.attend(q[[2, 0]], batch_index=[2, 0], return_lse=True, precision=prec)
        for r, b in enumerate([2, 0]):
            one = slice(b, b + 1)
            wo, wl = fastattn.scaled_dot_product_attention(
                q[one],
                cache.k[one],
                cache.v[one],
                key_lengths=cache.lengths[one],
                return_lse=True,
                precision=prec,
                **kw,
            )
            np.testing.assert_array_equal(o[r : r + 1], wo)
            np.testing.assert_array_equal(lse[r : r + 1], wl)
    default = fastattn.get_float32_matmul_precision()
    fastattn.set_float32_matmul_precision("medium")
    try:
        by_default = cache.attend(q)
    finally:
        fastattn.set_float32_matmul_precision(default)
    np.testing.assert_array_equal(by_default, cache.attend(q, precision="medium"))


def test_attention_with_kvcache_precision_passes_through(rng):
    B, Hq, Hk, D, S = 2, 4, 2, 32, 128
    kc, vc = randn(rng, (B, Hk, S, D)), randn(rng, (B, Hk, S, D))
    seqlens = np.array([70, 100])
    kn, vn = randn(rng, (B, Hk, 8, D)), randn(rng, (B, Hk, 8, D))
    q = randn(rng, (B, Hq, 64, D))
    o = awk(q, kc, vc, seqlens, kn, vn, precision="medium")
    want = fastattn.scaled_dot_product_attention(
        q, kc, vc, is_causal=True, enable_gqa=True, key_lengths=seqlens + 8, precision="medium"
    )
    np.testing.assert_array_equal(o, want)


@pytest.mark.skipif(
    not LEVELS_APPLY, reason=f"the {fastattn.get_isa()!r} path computes every float32 level as 'highest'"
)
def test_cache_precision_medium_differs_from_highest(rng):
    """Where the level changes results (amx, avx512bf16), "medium" is not "highest": the
    value reached the kernel (the tests above show that it is the value given)."""
    cache = _precision_cache(rng)
    q = randn(rng, (3, 4, 64, 32))
    med, hi = cache.attend(q, precision="medium"), cache.attend(q, precision="highest")
    assert_close(med, hi, np.float32, tol=3e-2)
    assert np.abs(med - hi).max() > 1e-5
    kc, vc, seq = np.array(cache.k), np.array(cache.v), cache.lengths
    med2, hi2 = (awk(q, kc, vc, seq, precision=p) for p in ("medium", "highest"))
    np.testing.assert_array_equal(med2, med)
    np.testing.assert_array_equal(hi2, hi)


# --- ragged batches ------------------------------------------------------------


def test_ragged_batch_with_batch_index(rng):
    B, Hq, Hk, D = 4, 2, 1, 16
    cache = KVCache(B, Hk, 50, D, dtype=BF16)
    seqs_k = [randn(rng, (Hk, 40, D)) for _ in range(B)]
    seqs_v = [randn(rng, (Hk, 40, D)) for _ in range(B)]
    n = [0] * B

    def add(idx, T):
        idx_list = [idx] if isinstance(idx, int) else list(range(B)[idx] if isinstance(idx, slice) else idx)
        kn = np.stack([seqs_k[b][:, n[b] : n[b] + T] for b in idx_list])
        vn = np.stack([seqs_v[b][:, n[b] : n[b] + T] for b in idx_list])
        if isinstance(idx, int):
            kn, vn = kn[0], vn[0]  # an int index also takes (Hk, T, D)
        cache.append(kn, vn, batch_index=idx)
        for b in idx_list:
            n[b] += T

    def check(idx, Lq):
        q = randn(rng, (len(idx), Hq, Lq, D))
        o = cache.attend(q, batch_index=np.array(idx), num_threads=1)
        for r, b in enumerate(idx):
            e = expected_step(
                q[r : r + 1], seqs_k[b][None, :, : n[b]].astype(BF16), seqs_v[b][None, :, : n[b]].astype(BF16)
            )
            assert_close(o[r : r + 1], e, np.float32, what=f"sequence {b}")

    add(0, 9)
    add([2, 1], 4)  # non-monotone index array
    add(3, 1)
    np.testing.assert_array_equal(cache.lengths, [9, 4, 4, 1])
    check([0, 1, 2, 3], 1)  # all sequences, different lengths, one kernel call
    check([2, 0], 3)  # scattered order: per-sequence calls
    add([0, 2], 2)  # equal-step progression: a strided view
    check([0, 2], 2)
    add(slice(None), 1)  # a slice selects all
    check([0, 1, 2, 3], 1)
    np.testing.assert_array_equal(cache.lengths, [12, 5, 7, 2])
    o = cache.attend(np.zeros((0, Hq, 1, D), np.float32), batch_index=[])
    assert o.shape == (0, Hq, 1, D)
    lens = cache.lengths
    assert cache.append(np.zeros((0, Hk, 2, D)), np.zeros((0, Hk, 2, D)), batch_index=[]).shape == (0,)
    np.testing.assert_array_equal(cache.lengths, lens)


def test_reset(rng):
    cache = KVCache(3, 2, 20, 8, dtype=np.float32)
    k, v = randn(rng, (3, 2, 5, 8)), randn(rng, (3, 2, 5, 8))
    cache.append(k, v)
    cache.reset(batch_index=[0, 2])
    np.testing.assert_array_equal(cache.lengths, [0, 5, 0])
    k2, v2 = randn(rng, (2, 2, 3, 8)), randn(rng, (2, 2, 3, 8))
    cache.append(k2, v2, batch_index=[0, 2])
    q = randn(rng, (3, 4, 1, 8))
    o = cache.attend(q[[0, 2]], batch_index=[0, 2])
    assert_close(o, expected_step(q[[0, 2]], k2, v2), np.float32)  # the old tokens are gone
    assert_close(cache.attend(q[1:2], batch_index=1), expected_step(q[1:2], k[1:2], v[1:2]), np.float32)
    cache.reset()
    np.testing.assert_array_equal(cache.lengths, [0, 0, 0])


def test_properties_nbytes_and_read_only_views():
    cache = KVCache(2, 3, 10, 8, dtype=np.float16, value_dim=5)
    assert cache.nbytes == 2 * 3 * 10 * (8 + 5) * 2
    dims = (cache.batch, cache.num_kv_heads, cache.max_len, cache.head_dim, cache.value_dim)
    assert dims == (2, 3, 10, 8, 5)
    assert cache.dtype == np.float16 and cache.k.shape == (2, 3, 10, 8) and cache.v.shape == (2, 3, 10, 5)
    with pytest.raises(ValueError):
        cache.k[0, 0, 0, 0] = 1.0
    with pytest.raises(ValueError):
        cache.v[...] = 1.0
    lens = cache.lengths
    lens[0] = 7
    np.testing.assert_array_equal(cache.lengths, [0, 0])  # a copy
    assert KVCache(1, 1, 4, 4, dtype=np.float64).nbytes == 2 * 16 * 8
    assert KVCache(1, 1, 4, 4, dtype=BF16).nbytes == 2 * 16 * 2


# --- bounds and bad input leave the cache unchanged ----------------------------


def test_append_past_max_len_raises_and_changes_nothing(rng):
    cache = KVCache(2, 1, 8, 4, dtype=np.float16)
    cache.append(randn(rng, (2, 1, 5, 4)), randn(rng, (2, 1, 5, 4)))
    cache.append(randn(rng, (1, 1, 2, 4)), randn(rng, (1, 1, 2, 4)), batch_index=[1])  # lengths 5, 7
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="max_len"):  # sequence 1 overflows; 0 would fit
        cache.append(randn(rng, (2, 1, 2, 4)), randn(rng, (2, 1, 2, 4)))
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match="max_len"):
        cache.append(randn(rng, (1, 1, 4, 4)), randn(rng, (1, 1, 4, 4)), batch_index=0)
    assert_unchanged(cache, snap)
    cache.append(randn(rng, (1, 1, 3, 4)), randn(rng, (1, 1, 3, 4)), batch_index=0)  # exactly full
    np.testing.assert_array_equal(cache.lengths, [8, 7])


def test_bad_input_names_the_argument_and_changes_nothing(rng):
    cache = KVCache(2, 2, 8, 4, dtype=np.float16)
    cache.append(randn(rng, (2, 2, 3, 4)), randn(rng, (2, 2, 3, 4)))
    snap = snapshot(cache)
    k1 = randn(rng, (2, 2, 1, 4))
    bad_appends = [
        (TypeError, "k_new", dict(k_new=k1.astype(np.int32), v_new=k1)),
        (TypeError, "v_new", dict(k_new=k1, v_new=k1.astype(np.complex64))),
        (ValueError, "k_new", dict(k_new=randn(rng, (2, 3, 1, 4)), v_new=k1)),  # heads
        (ValueError, "v_new", dict(k_new=k1, v_new=randn(rng, (2, 2, 1, 5)))),  # value dim
        (ValueError, "k_new", dict(k_new=k1[:1], v_new=k1[:1])),  # batch
        (ValueError, "same number of tokens", dict(k_new=k1, v_new=randn(rng, (2, 2, 2, 4)))),
        (ValueError, "batch_index", dict(k_new=k1[:1], v_new=k1[:1], batch_index=2)),
        (ValueError, "batch_index", dict(k_new=k1, v_new=k1, batch_index=[1, 1])),
        (ValueError, "batch_index", dict(k_new=k1, v_new=k1, batch_index=[0, -1])),
        (TypeError, "batch_index", dict(k_new=k1[:1], v_new=k1[:1], batch_index=True)),
        (TypeError, "batch_index", dict(k_new=k1[:1], v_new=k1[:1], batch_index=[0.0])),
        (TypeError, "k_new", dict(k_new=None, v_new=k1)),
    ]
    for exc, name, kw in bad_appends:
        with pytest.raises(exc, match=name):
            cache.append(**kw)
        assert_unchanged(cache, snap)
    q = randn(rng, (2, 4, 1, 4))
    bad_attends = [
        (TypeError, "q", dict(q=q.astype(np.float64))),
        (TypeError, "q", dict(q=q.astype(BF16))),  # a float16 cache takes float32 or float16
        (ValueError, "q", dict(q=randn(rng, (2, 3, 1, 4)))),  # 3 heads over 2 kv heads
        (ValueError, "q", dict(q=randn(rng, (2, 4, 1, 5)))),  # head dim
        (ValueError, "q", dict(q=q[:1])),  # batch
        (ValueError, "cached tokens", dict(q=randn(rng, (2, 4, 4, 4)))),  # 4 queries, 3 tokens
        (ValueError, "batch_index", dict(q=q[:1], batch_index=5)),
        (ValueError, "window", dict(q=q, window=(-2, 0))),
        (ValueError, "alibi_slopes", dict(q=q, alibi_slopes=np.ones(3))),
        (ValueError, "precision", dict(q=q, precision="low")),
        (TypeError, "precision", dict(q=q, precision=2)),
    ]
    for exc, name, kw in bad_attends:
        with pytest.raises(exc, match=name):
            cache.attend(**kw)
        assert_unchanged(cache, snap)
    for exc, kw in [
        (TypeError, dict(dtype=np.int32)),
        (TypeError, dict(dtype=np.complex64)),
        (TypeError, dict(dtype="nope")),
    ]:
        with pytest.raises(exc, match="dtype"):
            KVCache(1, 1, 4, 4, **kw)
    for args, name in [
        ((0, 1, 4, 4), "batch"),
        ((1, 0, 4, 4), "num_kv_heads"),
        ((1, 1, 0, 4), "max_len"),
        ((1, 1, 4, 0), "head_dim"),
        ((1, 1, 4.0, 4), "max_len"),
    ]:
        with pytest.raises((ValueError, TypeError), match=name):
            KVCache(*args)


def test_concurrent_attend_matches_serial(rng):
    cache = KVCache(2, 2, 300, 32, dtype=np.float16)
    cache.append(randn(rng, (2, 2, 257, 32)), randn(rng, (2, 2, 257, 32)))
    qs = [randn(rng, (2, 4, 1, 32)) for _ in range(8)]
    serial = [cache.attend(q, num_threads=1) for q in qs]
    with ThreadPoolExecutor(4) as ex:
        par = list(ex.map(lambda q: cache.attend(q, num_threads=1), qs))
    for a, b in zip(serial, par):
        np.testing.assert_array_equal(a, b)


# --- attention_with_kvcache ----------------------------------------------------


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["f32", "f16", "bf16"])
def test_attention_with_kvcache_matches_kvcache(rng, cache_dtype):
    B, Hq, Hk, D, S = 3, 4, 2, 16, 32
    seqlens = np.array([5, 0, 12], dtype=np.int32)
    kc = randn(rng, (B, Hk, S, D)).astype(cache_dtype)  # garbage past seqlens must not matter
    vc = randn(rng, (B, Hk, S, D)).astype(cache_dtype)
    cache = KVCache(B, Hk, S, D, dtype=cache_dtype)
    for b in range(B):
        cache.append(kc[b, :, : seqlens[b]], vc[b, :, : seqlens[b]], batch_index=b)
    kn, vn = randn(rng, (B, Hk, 2, D)), randn(rng, (B, Hk, 2, D))
    q = randn(rng, (B, Hq, 2, D))
    copies = seqlens.copy(), kn.copy(), vn.copy(), q.copy()
    o, lse = awk(q, kc, vc, seqlens, kn, vn, return_lse=True)
    for a, c in zip((seqlens, kn, vn, q), copies):  # not advanced (the caller does that), not modified
        np.testing.assert_array_equal(a, c)
    for b in range(B):  # written in place at cache_seqlens[b]
        np.testing.assert_array_equal(kc[b, :, seqlens[b] : seqlens[b] + 2], kn[b].astype(cache_dtype))
        np.testing.assert_array_equal(vc[b, :, seqlens[b] : seqlens[b] + 2], vn[b].astype(cache_dtype))
    cache.append(kn, vn)
    co, clse = cache.attend(q, return_lse=True)
    np.testing.assert_array_equal(o, co)
    np.testing.assert_array_equal(lse, clse)
    for b in range(B):
        n = seqlens[b] + 2
        e = expected_step(q[b : b + 1], kc[b : b + 1, :, :n], vc[b : b + 1, :, :n])
        assert_close(o[b : b + 1], e, np.float32)


def test_attention_with_kvcache_bshd_int_seqlens_and_no_new(rng):
    B, Hq, Hk, D, S = 2, 2, 1, 8, 20
    kc, vc = randn(rng, (B, S, Hk, D)), randn(rng, (B, S, Hk, D))  # flash-attn's layout
    q = randn(rng, (B, 1, Hq, D))
    kn, vn = randn(rng, (B, 1, Hk, D)), randn(rng, (B, 1, Hk, D))
    o = awk(q, kc, vc, 9, kn, vn, layout="bshd")
    assert o.shape == (B, 1, Hq, D)
    np.testing.assert_array_equal(kc[:, 9], kn[:, 0])
    e = ref.scaled_dot_product_attention(
        q, kc[:, :10], vc[:, :10], is_causal=True, enable_gqa=True, layout="bshd"
    )
    assert_close(o, e, np.float32)
    o2 = awk(q, kc, vc, np.array([10, 10]), layout="bshd")  # attend only, same keys
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(awk(q, kc, vc, np.int32(10), layout="bshd"), o)  # 0-d seqlens
    # Non-causal: every query sees all valid keys, whatever Lq.
    q3 = randn(rng, (B, 15, Hq, D))
    o3 = awk(q3, kc, vc, np.array([4, 10]), is_causal=False, layout="bshd")
    for b, n in enumerate([4, 10]):
        e = ref.scaled_dot_product_attention(
            q3[b : b + 1], kc[b : b + 1, :n], vc[b : b + 1, :n], enable_gqa=True, layout="bshd"
        )
        assert_close(o3[b : b + 1], e, np.float32)


def test_attention_with_kvcache_bad_input_changes_nothing(rng):
    B, Hq, Hk, D, S = 2, 4, 2, 8, 10
    kc, vc = randn(rng, (B, Hk, S, D)).astype(np.float16), randn(rng, (B, Hk, S, D)).astype(np.float16)
    before = kc.copy(), vc.copy()
    q = randn(rng, (B, Hq, 1, D))
    kn = randn(rng, (B, Hk, 1, D))
    cases = [
        (ValueError, "exceeds", dict(cache_seqlens=np.array([3, 10]), k_new=kn, v_new=kn)),
        (ValueError, "cache_seqlens", dict(cache_seqlens=np.array([3, 11]))),
        (ValueError, "cache_seqlens", dict(cache_seqlens=np.array([3, 4, 5]))),
        (TypeError, "cache_seqlens", dict(cache_seqlens=np.array([3.0, 4.0]))),
        (ValueError, "together", dict(cache_seqlens=3, k_new=kn)),
        (ValueError, "k_new", dict(cache_seqlens=3, k_new=kn[:, :1], v_new=kn)),
        (TypeError, "k_new", dict(cache_seqlens=3, k_new=kn.astype(int), v_new=kn)),
        (TypeError, "v_cache", dict(cache_seqlens=3, v_cache=vc.astype(np.float32), k_new=kn, v_new=kn)),
        (
            TypeError,
            "k_cache",
            dict(cache_seqlens=3, k_cache=kc.astype(np.int16), v_cache=kc.astype(np.int16)),
        ),
        (TypeError, "q", dict(cache_seqlens=3, q=q.astype(np.float64), k_new=kn, v_new=kn)),
        (ValueError, "multiple", dict(cache_seqlens=3, q=randn(rng, (B, 3, 1, D)), k_new=kn, v_new=kn)),
        (
            ValueError,
            "query length",
            dict(cache_seqlens=np.array([0, 4]), q=randn(rng, (B, Hq, 2, D)), k_new=kn, v_new=kn),
        ),
        (ValueError, "window", dict(cache_seqlens=3, k_new=kn, v_new=kn, window=(1, -5))),
        (ValueError, "softcap", dict(cache_seqlens=3, k_new=kn, v_new=kn, softcap=-1.0)),
        (ValueError, "alibi_slopes", dict(cache_seqlens=3, k_new=kn, v_new=kn, alibi_slopes=np.ones(5))),
        (ValueError, "num_threads", dict(cache_seqlens=3, k_new=kn, v_new=kn, num_threads=0)),
        (ValueError, "layout", dict(cache_seqlens=3, k_new=kn, v_new=kn, layout="sbhd")),
        (ValueError, "precision", dict(cache_seqlens=3, k_new=kn, v_new=kn, precision="fast")),
    ]
    for exc, name, kw in cases:
        args = dict(q=q, k_cache=kc, v_cache=vc)
        args.update(kw)
        with pytest.raises(exc, match=name):
            awk(**args)
        np.testing.assert_array_equal(kc, before[0])
        np.testing.assert_array_equal(vc, before[1])
    ro = kc.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        awk(q, ro, vc, 3, kn, kn)


# --- the example -----------------------------------------------------------------


def load_example():
    spec = importlib.util.spec_from_file_location(
        "fastattn_example_generate", os.path.join(ROOT, "examples", "generate.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_generate_example_matches_full_attention(monkeypatch, capsys, dtype):
    monkeypatch.setattr(fastattn._config, "_thread_override", 1)  # many tiny calls on a shared machine
    assert load_example().main(["--steps", "6", "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    assert "max |cached - full|" in out and "lengths [11, 15]" in out


def test_generate_example_script_exit_status():
    env = dict(os.environ, FASTATTN_NUM_THREADS="1")
    # import the fastattn under test (installed or in-place build), never a bare source tree
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "generate.py"),
            "--steps",
            "2",
            "--dtype",
            "bfloat16",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    assert r.returncode == 0, r.stdout + r.stderr
