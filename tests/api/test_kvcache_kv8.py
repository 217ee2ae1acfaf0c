"""8-bit K/V caches (int8, fp8 e4m3fn / e5m2) in the KV-cache front ends: the writes.

``attention_with_kvcache(k_scale=, v_scale=)``, ``KVCache(dtype=<8-bit>)`` and
``flash_compat.flash_attn_with_kvcache(k_descale=, v_descale=)`` quantise the new
float tokens before anything is written: per token (scales computed and written
beside the data) or with a fixed scale (per channel / head / tensor; a value that
does not fit raises, nothing written).  Every output is compared with the float64
reference on the dequantised cache contents after the write (``data * scale``), at
float32 attention's tolerance (as tests/kernel/test_kv8.py); every written value
with the value given, within half a quantisation step (worked out from the format:
int8 0.5, e4m3 2**-4 relative (2**-10 subnormal), e5m2 2**-3 (2**-17)).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close

import fastattn
from fastattn import reference as ref
from fastattn.flash_compat import flash_attn_with_kvcache

KVCache = fastattn.KVCache
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
I8 = np.dtype(np.int8)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
KV8 = [I8, E4M3, E5M2]
TOL = 1e-4  # float32 attention (conftest.TOL), as tests/kernel/test_kv8.py
QMAX = {I8: 127.0, E4M3: 448.0, E5M2: 57344.0}
# Half a quantisation step of y = x / scale: (relative, absolute near zero).
HALF = {I8: (0.0, 0.5), E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}


def values(rng, shape, amax=3.0):
    """Float32 tokens with |x| <= amax (so that fixed scales of 3.5 / QMAX and up fit)."""
    return rng.uniform(-amax, amax, size=shape).astype(F32)


def assert_quantised(q8, s, x, dt):
    """The 8-bit q8 with scale s holds x within half a quantisation step of x / s."""
    y = np.asarray(x, F64) / np.asarray(s, F64)
    err = np.abs(q8.astype(F64) - y)
    rel, ab = HALF[dt]
    bound = np.maximum(rel * np.abs(y), ab) + 2e-6 * np.abs(y) + 1e-6  # float32 division
    assert np.all(err <= bound), f"max excess {float(np.max(err - bound))}"


def assert_token_scales(s, x, dt):
    """Per-token scales: max |x| over the head dim / the format's largest value."""
    np.testing.assert_allclose(s, np.abs(np.asarray(x, F64)).max(-1, keepdims=True) / QMAX[dt], rtol=1e-6)


def deq(x8, s):
    return x8.astype(F64) * np.asarray(s, F64)


def causal_reference(q, K, V, lens):
    """Row b's newest Lq queries over its first lens[b] keys (bhsd, float64)."""
    return np.concatenate(
        [
            ref.scaled_dot_product_attention(
                q[b : b + 1], K[b : b + 1, :, :n], V[b : b + 1, :, :n], is_causal=True, enable_gqa=True
            )
            for b, n in enumerate(lens)
        ]
    )


def to_layout(x, layout):
    """A bhsd array in ``layout`` (a contiguous copy for bshd), or a number as is."""
    if layout == "bshd" and np.ndim(x) == 4:
        return np.ascontiguousarray(np.swapaxes(x, 1, 2))
    return x


def bhsd(x, layout):
    return np.swapaxes(x, 1, 2) if layout == "bshd" else x


def scales(rng, dt, form, B, Hk, S, D, Dv):
    """(k_scale, v_scale) in bhsd: per token (ones to be written, v in float64: the
    caller's array is not the kernel's float32), per channel, or per head / a number."""
    lo = 3.5 / QMAX[dt]
    if form == "token":
        return np.ones((B, Hk, S, 1), F32), np.ones((B, Hk, S, 1), F64)
    if form == "channel":
        return (
            rng.uniform(lo, 2 * lo, (B, Hk, 1, D)).astype(F32),
            rng.uniform(lo, 2 * lo, (1, Hk, 1, Dv)).astype(F32),
        )
    return rng.uniform(lo, 2 * lo, (B, Hk, 1, 1)).astype(F32), np.float32(1.5 * lo)


# ---------------------------------------------------------------------------
# attention_with_kvcache


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("form", ["token", "channel", "head"])
@pytest.mark.parametrize("dt", KV8, ids=str)
def test_attention_with_kvcache_generation(rng, dt, form, layout):
    """A prefill, decode steps and a roll-back (row 1 rewinds 2 tokens) in GQA caches:
    each step's output against the reference on the dequantised caches; the new tokens
    (and their per-token scales) written where they belong, nothing else changed."""
    B, Hq, Hk, S, D, Dv = 2, 4, 2, 24, 16, 8
    ks, vs = scales(rng, dt, form, B, Hk, S, D, Dv)
    k_cache = to_layout(np.zeros((B, Hk, S, D), dt), layout)
    v_cache = to_layout(np.zeros((B, Hk, S, Dv), dt), layout)
    k_scale, v_scale = to_layout(ks, layout), to_layout(vs, layout)
    K, V = bhsd(k_cache, layout), bhsd(v_cache, layout)  # views of the caller's caches
    KS = np.broadcast_to(
        bhsd(k_scale, layout) if np.ndim(k_scale) == 4 else k_scale, (B, Hk, S, 1 if form == "token" else D)
    )
    VS = np.broadcast_to(
        bhsd(v_scale, layout) if np.ndim(v_scale) == 4 else v_scale, (B, Hk, S, 1 if form == "token" else Dv)
    )
    for seq, T in (([0, 0], 5), ([5, 3], 1), ([6, 4], 1), ([7, 5], 3)):
        seq = np.array(seq)
        q = rng.standard_normal((B, Hq, T, D)).astype(F32)
        kn, vn = values(rng, (B, Hk, T, D)), values(rng, (B, Hk, T, Dv))
        before = [a.copy() for a in (K, V, KS, VS)]
        out = fastattn.attention_with_kvcache(
            to_layout(q, layout),
            k_cache,
            v_cache,
            seq,
            to_layout(kn, layout),
            to_layout(vn, layout),
            layout=layout,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        written = np.zeros(S, bool)[None].repeat(B, 0)
        for b, s in enumerate(seq):
            w = slice(s, s + T)
            written[b, w] = True
            assert_quantised(K[b, :, w], KS[b, :, w], kn[b], dt)
            assert_quantised(V[b, :, w], VS[b, :, w], vn[b], dt)
            if form == "token":
                assert_token_scales(KS[b, :, w], kn[b], dt)
                assert_token_scales(VS[b, :, w], vn[b], dt)
        keep = ~written[:, None, :, None]
        for a, a0 in zip((K, V, KS, VS), before):
            np.testing.assert_array_equal(np.where(keep, a, 0), np.where(keep, a0, 0))
        expect = causal_reference(q, deq(K, KS), deq(V, VS), seq + T)
        assert_close(bhsd(out, layout), expect, tol=TOL)


@pytest.mark.parametrize("dt", [I8, E4M3], ids=str)
def test_attention_with_kvcache_rotary_and_transposed_cache(rng, dt):
    """Rotary keys are rotated in float32 and then quantised; a K cache kept transposed
    (the kernel reads a copy) sees the new tokens; LSE too."""
    B, Hq, Hk, S, D = 2, 4, 2, 16, 8
    cos, sin = fastattn.rotary_cos_sin(S, D)
    k_store = np.zeros((B, Hk, D, S), dt)
    k_cache = k_store.swapaxes(2, 3)  # (B, Hk, S, D) view, last axis strided
    v_cache = np.zeros((B, Hk, S, D), dt)
    ks, vs = np.ones((B, Hk, S, 1), F32), np.ones((B, Hk, S, 1), F32)
    seq = np.array([0, 2])
    for T in (4, 1, 2):
        q = rng.standard_normal((B, Hq, T, D)).astype(F32)
        kn, vn = values(rng, (B, Hk, T, D)), values(rng, (B, Hk, T, D))
        out, lse = fastattn.attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            seq,
            kn,
            vn,
            k_scale=ks,
            v_scale=vs,
            rotary_cos=cos,
            rotary_sin=sin,
            return_lse=True,
        )
        pos = seq[:, None] + np.arange(T)
        kr = fastattn.apply_rotary(kn, cos, sin, positions=pos)
        qr = fastattn.apply_rotary(q, cos, sin, positions=pos)
        for b, s in enumerate(seq):
            assert_quantised(k_cache[b, :, s : s + T], ks[b, :, s : s + T], kr[b], dt)
            assert_token_scales(ks[b, :, s : s + T], kr[b], dt)
        eo, el = zip(
            *[
                ref.scaled_dot_product_attention(
                    qr[b : b + 1],
                    deq(k_cache, ks)[b : b + 1, :, :n],
                    deq(v_cache, vs)[b : b + 1, :, :n],
                    is_causal=True,
                    enable_gqa=True,
                    return_lse=True,
                )
                for b, n in enumerate(seq + T)
            ]
        )
        assert_close(out, np.concatenate(eo), tol=TOL)
        assert_close(lse, np.concatenate(el), tol=TOL, what="lse")
        seq = seq + T


def _awk_caches(dt, B=2, Hk=2, S=8, D=4):
    return np.zeros((B, Hk, S, D), dt), np.zeros((B, Hk, S, D), dt)


@pytest.mark.parametrize("dt", KV8, ids=str)
@pytest.mark.parametrize("which", ["k", "v"])
def test_attention_with_kvcache_fixed_scale_overflow_writes_nothing(rng, dt, which):
    """A new value beyond the fixed scale's range raises ValueError naming it; the caches,
    the other side's per-token scales and everything else are unchanged."""
    k_cache, v_cache = _awk_caches(dt)
    k_cache[:, :, :2] = values(rng, (2, 2, 2, 4), 1.0).astype(dt) if dt != I8 else 5
    v_cache[:, :, :2] = k_cache[:, :, :2]
    fixed = np.full((1, 2, 1, 4), 1.0 / QMAX[dt], F32)  # |x| <= 1 fits
    token = np.ones((2, 2, 8, 1), F32)
    k_scale, v_scale = (fixed, token) if which == "k" else (token, fixed)
    kn, vn = values(rng, (2, 2, 1, 4), 0.9), values(rng, (2, 2, 1, 4), 0.9)
    (kn if which == "k" else vn)[1, 1, 0, 2] = 1.5  # does not fit
    q = rng.standard_normal((2, 2, 1, 4)).astype(F32)
    before = [a.copy() for a in (k_cache, v_cache, k_scale, v_scale)]
    with pytest.raises(ValueError, match=f"{which}_new does not fit .*nothing was written"):
        fastattn.attention_with_kvcache(q, k_cache, v_cache, 2, kn, vn, k_scale=k_scale, v_scale=v_scale)
    for a, a0 in zip((k_cache, v_cache, k_scale, v_scale), before):
        np.testing.assert_array_equal(a.view(np.uint8), a0.view(np.uint8))


def _bad_scale_cases():
    B, Hk, S = 2, 2, 8
    tok = np.ones((B, Hk, S, 1), F32)
    ro = tok.copy()
    ro.flags.writeable = False
    nan = tok.copy()
    nan[1, 0, 5] = np.nan
    return [
        # (cache dtype, k_scale, v_scale, exception, match)
        (I8, None, tok.copy(), TypeError, "k_scale is required"),
        (I8, tok.copy(), None, TypeError, "v_scale is required"),
        (F32, tok.copy(), None, TypeError, "k_scale applies to an 8-bit"),
        (E4M3, np.ones((B, Hk, S - 1, 1), F32), None, ValueError, "k_scale of shape"),
        (E4M3, np.ones((B, Hk, S, 4), F32), None, ValueError, "k_scale of shape .* varies along both"),
        (I8, tok.copy(), nan, ValueError, "v_scale must be finite and positive"),
        (I8, np.float32(0.0), tok.copy(), ValueError, "k_scale must be finite and positive"),
        (
            I8,
            tok.copy(),
            np.full((1, Hk, 1, 4), -0.1, F32),
            ValueError,
            "v_scale must be finite and positive",
        ),
        (
            I8,
            np.zeros((B, Hk, S, 1), F32),
            tok.copy(),
            ValueError,
            "k_scale must be finite and positive.*np.ones",
        ),
        (I8, ro, tok.copy(), ValueError, "k_scale must be writable"),
        (
            I8,
            np.ones((B, 1, S, 1), F32),
            tok.copy(),
            ValueError,
            r"k_scale holds per-token .*shape \(2, 2, 8, 1\)",
        ),
        (I8, tok.copy(), np.ones((B, Hk, S, 1), np.float16), TypeError, "v_scale .* float32 or float64"),
        (I8, tok.copy(), np.ones((B, Hk, S, 1)).tolist(), TypeError, "v_scale .* numpy.ndarray"),
        (I8, tok, tok, ValueError, "k_scale and v_scale must not share memory"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_scale_cases())))
def test_attention_with_kvcache_bad_scales(rng, case):
    dt, k_scale, v_scale, exc, match = _bad_scale_cases()[case]
    k_cache, v_cache = _awk_caches(dt)
    q = rng.standard_normal((2, 2, 1, 4)).astype(F32)
    kn, vn = values(rng, (2, 2, 1, 4)), values(rng, (2, 2, 1, 4))
    before = [
        np.array(a, copy=True) for a in (k_cache, v_cache, k_scale, v_scale) if isinstance(a, np.ndarray)
    ]
    with pytest.raises(exc, match=match):
        fastattn.attention_with_kvcache(q, k_cache, v_cache, 2, kn, vn, k_scale=k_scale, v_scale=v_scale)
    after = [a for a in (k_cache, v_cache, k_scale, v_scale) if isinstance(a, np.ndarray)]
    for a, a0 in zip(after, before):
        np.testing.assert_array_equal(a, a0)


def test_attention_with_kvcache_reads_any_scale_form_without_writing(rng):
    """Read only (no new tokens): a read-only per-token scale and scales broadcast over
    heads are fine; the result is the attention over the dequantised caches."""
    B, Hq, Hk, S, D = 2, 4, 2, 12, 8
    k8, ks = fastattn.quantize_kv(values(rng, (B, Hk, S, D)), "int8")
    v8, _ = fastattn.quantize_kv(values(rng, (B, Hk, S, D)), "int8")
    ks.flags.writeable = False
    vs = np.full((B, 1, S, 1), 0.03, F32)  # per token, shared by the heads
    q = rng.standard_normal((B, Hq, 2, D)).astype(F32)
    out = fastattn.attention_with_kvcache(q, k8, v8, [12, 7], k_scale=ks, v_scale=vs)
    assert_close(out, causal_reference(q, deq(k8, ks), deq(v8, vs), [12, 7]), tol=TOL)


# ---------------------------------------------------------------------------
# KVCache


@pytest.mark.parametrize("form", ["token", "channel", "head"])
@pytest.mark.parametrize("dt", KV8, ids=str)
def test_kvcache_generation(rng, dt, form):
    """A growing GQA cache: prefill, ragged appends (batch_index), decode steps; attend
    (all rows, and scattered rows) against the reference on k * k_scale, v * v_scale."""
    B, Hq, Hk, D, Dv = 3, 4, 2, 16, 8
    lo = 3.5 / QMAX[dt]
    kw = {}
    if form == "channel":
        kw = dict(
            k_scale=rng.uniform(lo, 2 * lo, (Hk, 1, D)).astype(F32), v_scale=rng.uniform(lo, 2 * lo, (Dv,))
        )
    elif form == "head":
        kw = dict(k_scale=rng.uniform(lo, 2 * lo, (Hk, 1, 1)), v_scale=1.5 * lo)
    cache = KVCache(B, Hk, None, D, value_dim=Dv, dtype=dt.name, **kw)
    assert cache.dtype == dt
    for T, idx in ((5, None), (3, [0, 2]), (1, None), (1, 1), (14, None)):  # the last grows the cache
        n = B if idx is None else np.size(idx)
        kn, vn = values(rng, (n, Hk, T, D)), values(rng, (n, Hk, T, Dv))
        start = cache.lengths if idx is None else np.atleast_1d(cache.lengths[idx])
        if isinstance(idx, int):
            cache.append(kn[0], vn[0], batch_index=idx)  # (Hk, T, D)
        else:
            cache.append(kn, vn, batch_index=idx)
        rows = np.arange(B) if idx is None else np.atleast_1d(idx)
        k, v = cache.k, cache.v
        KS = np.broadcast_to(cache.k_scale, k.shape[:3] + (1 if form == "token" else D,))
        VS = np.broadcast_to(cache.v_scale, v.shape[:3] + (1 if form == "token" else Dv,))
        for r, b in enumerate(rows):
            w = slice(int(start[r]), int(start[r]) + T)
            assert_quantised(k[b, :, w], KS[b, :, w], kn[r], dt)
            assert_quantised(v[b, :, w], VS[b, :, w], vn[r], dt)
            if form == "token":
                assert_token_scales(KS[b, :, w], kn[r], dt)
        Lq = min(T, 2)
        q = rng.standard_normal((B, Hq, Lq, D)).astype(F32)
        lens = cache.lengths
        expect = causal_reference(q, deq(k, KS), deq(v, VS), lens)
        assert_close(cache.attend(q), expect, tol=TOL)
        assert_close(cache.attend(q[[2, 0]], batch_index=[2, 0]), expect[[2, 0]], tol=TOL)
    assert cache.capacity > 16


def test_kvcache_crop_reorder_reset_keep_scales(rng):
    """crop / reorder_cache / reset on an int8 cache with per-token scales: the scales
    follow their tokens, and appends after each land where the lengths say."""
    B, Hq, Hk, D = 3, 2, 1, 8
    cache = KVCache(B, Hk, 12, D, dtype=np.int8)
    kn, vn = values(rng, (B, Hk, 6, D)), values(rng, (B, Hk, 6, D))
    cache.append(kn, vn)
    cache.crop(4)  # speculative decoding: two draft tokens rejected
    k2, v2 = values(rng, (B, Hk, 2, D), 0.1), values(rng, (B, Hk, 2, D), 0.1)
    cache.append(k2, v2)
    assert cache.lengths.tolist() == [6, 6, 6]
    assert_quantised(cache.k[:, :, 4:6], cache.k_scale[:, :, 4:6], k2, I8)
    assert_token_scales(cache.k_scale[:, :, 4:6], k2, I8)
    assert_token_scales(cache.v_scale[:, :, :4], vn[:, :, :4], I8)
    snap = [a.copy() for a in (cache.k, cache.v, cache.k_scale, cache.v_scale)]
    cache.reorder_cache([2, 2, 0])  # beam search
    for a, a0 in zip((cache.k, cache.v, cache.k_scale, cache.v_scale), snap):
        np.testing.assert_array_equal(a[:, :, :6], a0[[2, 2, 0], :, :6])
    cache.reset(batch_index=1)
    k3, v3 = values(rng, (1, Hk, 3, D), 0.01), values(rng, (1, Hk, 3, D), 0.01)
    cache.append(k3, v3, batch_index=1)
    assert cache.lengths.tolist() == [6, 3, 6]
    assert_quantised(cache.k[1:2, :, :3], cache.k_scale[1:2, :, :3], k3, I8)
    assert_token_scales(cache.k_scale[1:2, :, :3], k3, I8)
    q = rng.standard_normal((B, Hq, 1, D)).astype(F32)
    expect = causal_reference(q, deq(cache.k, cache.k_scale), deq(cache.v, cache.v_scale), cache.lengths)
    assert_close(cache.attend(q), expect, tol=TOL)


def test_kvcache_properties_nbytes_and_rotary(rng):
    """k/v are the 8-bit read-only views, k_scale/v_scale the scales; nbytes counts them;
    a rotary 8-bit cache stores the rotated keys, quantised."""
    B, Hk, S, D, Dv = 2, 2, 10, 8, 4
    cos, sin = fastattn.rotary_cos_sin(S, D)
    cache = KVCache(
        B, Hk, S, D, value_dim=Dv, dtype=E4M3, v_scale=np.float32(0.01), rotary_cos=cos, rotary_sin=sin
    )
    assert cache.k.dtype == E4M3 and not cache.k.flags.writeable and not cache.k_scale.flags.writeable
    assert cache.k_scale.shape == (B, Hk, S, 1) and cache.v_scale.shape == (1, 1, 1, 1)
    assert cache.nbytes == B * Hk * S * (D + Dv) + B * Hk * S * 4 + 4
    assert KVCache(1, 1, 4, 4).k_scale is None
    kn, vn = values(rng, (B, Hk, 4, D)), values(rng, (B, Hk, 4, Dv))
    cache.append(kn, vn)
    kr = fastattn.apply_rotary(kn, cos, sin)
    assert_quantised(cache.k[:, :, :4], cache.k_scale[:, :, :4], kr, E4M3)
    assert_quantised(cache.v[:, :, :4], 0.01, vn, E4M3)
    q = rng.standard_normal((B, 4, 2, D)).astype(F32)
    qr = fastattn.apply_rotary(q, cos, sin, positions=np.arange(2, 4))
    expect = causal_reference(qr, deq(cache.k, cache.k_scale), deq(cache.v, 0.01), [4, 4])
    assert_close(cache.attend(q), expect, tol=TOL)


@pytest.mark.parametrize("dt", KV8, ids=str)
def test_kvcache_fixed_scale_overflow_writes_nothing(rng, dt):
    cache = KVCache(2, 2, 8, 4, dtype=dt, k_scale=np.full((2, 1, 4), 1.0 / QMAX[dt]), v_scale=1.0 / QMAX[dt])
    cache.append(values(rng, (2, 2, 3, 4), 0.9), values(rng, (2, 2, 3, 4), 0.9))
    snap = [a.copy() for a in (cache.k, cache.v, cache.lengths)]
    kn, vn = values(rng, (2, 2, 2, 4), 0.9), values(rng, (2, 2, 2, 4), 0.9)
    vn[0, 1, 1, 3] = -2.0
    with pytest.raises(ValueError, match="v_new does not fit .*nothing was written"):
        cache.append(kn, vn)
    for a, a0 in zip((cache.k, cache.v, cache.lengths), snap):
        np.testing.assert_array_equal(
            a.view(np.uint8) if a.dtype != np.int64 else a, a0.view(np.uint8) if a0.dtype != np.int64 else a0
        )


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(dtype=F32, k_scale=1.0), TypeError, "k_scale applies to an 8-bit"),
        (dict(dtype=I8, k_scale=np.ones((2, 2, 1, 4))), ValueError, "k_scale must be a fixed scale"),
        (dict(dtype=I8, k_scale=np.ones((2, 3, 4))), ValueError, "k_scale must be a fixed scale"),
        (dict(dtype=I8, v_scale=np.ones(3)), ValueError, "v_scale must be a fixed scale"),
        (dict(dtype=I8, k_scale=np.nan), ValueError, "k_scale must be finite and positive"),
        (
            dict(dtype=E5M2, v_scale=np.array([1.0, 0.0, 1.0, 1.0])),
            ValueError,
            "v_scale must be finite and positive",
        ),
        (dict(dtype=E4M3, k_scale=-1.0), ValueError, "k_scale must be finite and positive"),
        (dict(dtype="int4"), TypeError, "dtype must be"),
    ],
)
def test_kvcache_bad_scales(kw, exc, match):
    with pytest.raises(exc, match=match):
        KVCache(2, 2, 8, 4, **kw)


# ---------------------------------------------------------------------------
# flash_compat.flash_attn_with_kvcache: flash-attn 3's per-head descales (batch, nheads_k)


@pytest.mark.parametrize("dt", KV8, ids=str)
def test_flash_attn_with_kvcache_descales(rng, dt):
    """Scattered cache rows (cache_batch_idx), GQA, causal decode steps: the new tokens
    quantised with the descales, the output over the dequantised rows."""
    B, Bc, Hq, Hk, S, D = 2, 3, 4, 2, 16, 8
    k_cache, v_cache = np.zeros((Bc, S, Hk, D), dt), np.zeros((Bc, S, Hk, D), dt)
    lo = 3.5 / QMAX[dt]
    kd = rng.uniform(lo, 2 * lo, (B, Hk)).astype(F32)
    vd = np.float32(1.5 * lo) if dt != I8 else rng.uniform(lo, 2 * lo, (B, Hk)).astype(F32)
    rows = np.array([2, 0])
    seq = np.array([0, 1])
    for T in (4, 1, 2):
        q = rng.standard_normal((B, T, Hq, D)).astype(F32)
        k, v = values(rng, (B, T, Hk, D)), values(rng, (B, T, Hk, D))
        before = (k_cache.copy(), v_cache.copy())
        out = flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=seq,
            cache_batch_idx=rows,
            causal=True,
            k_descale=kd,
            v_descale=vd,
        )
        KS = np.broadcast_to(kd, (B, Hk))[:, None, :, None]
        VS = np.broadcast_to(vd, (B, Hk))[:, None, :, None]
        for b, (c, s) in enumerate(zip(rows, seq)):
            assert_quantised(k_cache[c, s : s + T], KS[b], k[b], dt)
            assert_quantised(v_cache[c, s : s + T], VS[b], v[b], dt)
        np.testing.assert_array_equal(
            k_cache[1].view(np.uint8), before[0][1].view(np.uint8)
        )  # not a row of q
        K, V = deq(k_cache[rows], KS).swapaxes(1, 2), deq(v_cache[rows], VS).swapaxes(1, 2)
        expect = causal_reference(q.swapaxes(1, 2), K, V, seq + T)
        assert_close(out.swapaxes(1, 2), expect, tol=TOL)
        seq = seq + T


def test_flash_attn_with_kvcache_torch_fp8(rng):
    """A torch float8_e4m3fn cache (no NumPy dtype) is written in place and read."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8")
    k_cache = torch.zeros((1, 8, 2, 4), dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros((1, 8, 2, 4), dtype=torch.float8_e4m3fn)
    kd = torch.full((1, 2), 0.01)
    k, v = (torch.from_numpy(values(rng, (1, 3, 2, 4))) for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((1, 3, 2, 4)).astype(F32))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=0, causal=True, k_descale=kd)
    assert isinstance(out, torch.Tensor)
    k8 = k_cache.view(torch.uint8).numpy().view(E4M3)
    v8 = v_cache.view(torch.uint8).numpy().view(E4M3)
    assert_quantised(k8[0, :3], 0.01, k.numpy()[0], E4M3)
    assert_quantised(v8[0, :3], 1.0, v.numpy()[0], E4M3)  # no v_descale: 1 (flash-attn's default)
    expect = causal_reference(
        q.numpy().swapaxes(1, 2), deq(k8, 0.01).swapaxes(1, 2), deq(v8, 1.0).swapaxes(1, 2), [3]
    )
    assert_close(out.numpy().swapaxes(1, 2), expect, tol=TOL)


@pytest.mark.parametrize(
    "dt, kw, exc, match",
    [
        (I8, dict(v_descale=np.ones((2, 2))), TypeError, "k_descale is required"),
        (F32, dict(k_descale=np.ones((2, 2))), TypeError, "k_descale applies to 8-bit"),
        (
            I8,
            dict(k_descale=np.ones((2, 3)), v_descale=np.ones((2, 2))),
            ValueError,
            r"k_descale must have shape \(batch, nheads_k\)",
        ),
        (
            E4M3,
            dict(v_descale=np.array([[1.0, np.nan], [1.0, 1.0]])),
            ValueError,
            "v_descale must be finite and positive",
        ),
        (E5M2, dict(k_descale=np.zeros((2, 2))), ValueError, "k_descale must be finite and positive"),
        (E4M3, dict(q_descale=np.ones((2, 2))), NotImplementedError, "q_descale"),
        (E4M3, dict(k_descale=np.full((2, 2), 1e-3)), ValueError, "k does not fit .*nothing was written"),
    ],
)
def test_flash_attn_with_kvcache_bad_descales(rng, dt, kw, exc, match):
    k_cache, v_cache = np.zeros((2, 8, 2, 4), dt), np.zeros((2, 8, 2, 4), dt)
    q = rng.standard_normal((2, 1, 2, 4)).astype(F32)
    k, v = values(rng, (2, 1, 2, 4)), values(rng, (2, 1, 2, 4))
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=1, **kw)
    assert not k_cache.view(np.uint8).any() and not v_cache.view(np.uint8).any()


def test_dtype_recognition_by_scalar_type():
    """The 16- and 8-bit dtypes are told by their scalar type's name, then compared with
    ml_dtypes' own (fastattn._checks.is_bfloat16, fastattn._quant.is_kv8): every other
    dtype, a 1- or 2-byte one or a structured one named alike, is neither."""
    from fastattn._checks import is_bfloat16
    from fastattn._quant import is_kv8

    assert is_bfloat16(np.dtype(ml_dtypes.bfloat16))
    for dt in (np.float16, np.uint16, np.int16, np.float32, [("bfloat16", "<u2")]):
        assert not is_bfloat16(np.dtype(dt)), dt
    for dt in (np.int8, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        assert is_kv8(np.dtype(dt)), dt
    others = (np.uint8, np.bool_, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.bfloat16)
    for dt in others + ([("float8_e4m3fn", "u1")], np.float32):
        assert not is_kv8(np.dtype(dt)), dt
