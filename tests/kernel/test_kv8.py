"""8-bit K/V (int8, fp8 e4m3fn / e5m2) with scales, on every ISA path the CPU has.

The kernel attends over the dequantised K/V (``key.astype(float32) * k_scale``),
so it is compared with the float64 reference on exactly those values, at the
tolerance of float32 attention (conftest.TOL): every scale form (per token,
per channel, per head, a scalar), GQA, causal L != S, masks and the score
options, both layouts, the LSE, and each path (a single decode row, a few GQA
rows, prefill).  The conversions themselves are checked against ml_dtypes on
every byte value, subnormals and NaN included.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention
F32 = np.dtype(np.float32)
I8 = np.dtype(np.int8)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
KV8 = [I8, E4M3, E5M2]
TOL = 1e-4  # float32 attention (conftest.TOL)


def qkv8(rng, dt, B, Hq, Hk, L, S, D, Dv=None, outliers=True):
    """Float32 queries, 8-bit keys/values (random bytes of the format's ordinary
    range: no NaN), keys with a few outlier channels as real K has."""
    Dv = D if Dv is None else Dv
    q = rng.standard_normal((B, Hq, L, D)).astype(F32)
    k = rng.standard_normal((B, Hk, S, D))
    if outliers:
        k[..., : max(1, D // 16)] *= 8.0
    v = rng.standard_normal((B, Hk, S, Dv))
    if dt == I8:
        k8 = np.clip(np.rint(k * 127 / np.abs(k).max()), -127, 127).astype(I8)
        v8 = np.clip(np.rint(v * 127 / np.abs(v).max()), -127, 127).astype(I8)
    else:
        k8, v8 = (k * 4).astype(dt), (v * 4).astype(dt)
    return q, k8, v8


def scale_of(rng, form, shape):
    """A positive float32 scale of ``form`` for a bhsd array of ``shape`` (B, H, S, D)."""
    if form == "scalar":
        return np.float32(rng.uniform(0.01, 0.05))
    B, H, S, D = shape
    s = {"token": (B, H, S, 1), "channel": (B, H, 1, D), "head": (B, H, 1, 1)}[form]
    return rng.uniform(0.005, 0.05, size=s).astype(F32)


def deq(x8, s):
    return x8.astype(np.float64) * np.asarray(s, dtype=np.float64)


def check8(q, k8, v8, ks, vs, **kw):
    o, lse = sdpa(q, k8, v8, k_scale=ks, v_scale=vs, return_lse=True, **kw)
    ro, rlse = ref.scaled_dot_product_attention(
        q, deq(k8, 1.0 if ks is None else ks), deq(v8, 1.0 if vs is None else vs), return_lse=True, **kw
    )
    assert o.dtype == q.dtype
    assert_close(o, ro, tol=TOL)
    assert_close(lse, rlse, tol=TOL, what="lse")
    return o


# ---------------------------------------------------------------------------
# The conversions, on every byte


@pytest.mark.parametrize("dt", [E4M3, E5M2, I8], ids=str)
@pytest.mark.parametrize("S", [1, 300])
def test_every_byte_value(isa, dt, S):
    """Each of the 256 values as one key's only nonzero channel: the score (hence
    the output) must see exactly ml_dtypes' float32 value (NaN rows give NaN)."""
    vals = np.arange(256, dtype=np.uint8).view(dt)
    f = vals.astype(np.float64)
    D = 16
    k = np.zeros((1, 1, 256, D), dtype=dt)
    k[0, 0, :, 3] = vals
    v = np.zeros((1, 1, 256, D), dtype=dt)
    # (a NaN value poisons every row through P = 0 times it, as in float V: K only has them)
    v[0, 0, :, 5] = np.where(np.isfinite(f), vals, np.zeros((), dt))
    # q picks channel 3 of each key: one query per key value through a mask
    q = np.zeros((1, 1, 256, D), dtype=F32)
    q[0, 0, :, 3] = 1.0
    mask = np.eye(256, dtype=bool)[None, None]
    kw = dict(k_scale=1.0, v_scale=1.0) if dt == I8 else {}
    o, lse = sdpa(q, k, v, attn_mask=mask, scale=1.0, return_lse=True, **kw)
    # one visible key per row: lse = its score (through the kernel's log2
    # domain: a few float32 ulp), out = its V row exactly
    fin = np.isfinite(f)
    np.testing.assert_allclose(lse[0, 0][fin], f[fin], rtol=1e-6, atol=1e-30)
    np.testing.assert_array_equal(o[0, 0, :, 5][fin], f[fin].astype(F32))
    nan = np.isnan(f)
    assert np.all(np.isnan(lse[0, 0][nan])) and np.all(np.isnan(o[0, 0, :, 5][nan]))
    assert np.all(lse[0, 0][f == -np.inf] == -np.inf)  # (e5m2's -inf: the key's score is -inf)


@pytest.mark.parametrize("dt", KV8, ids=str)
def test_every_byte_value_decode(isa, dt):
    """The decode paths' vector loads: K rows of all 256 values, one query row."""
    vals = np.arange(256, dtype=np.uint8).view(dt)
    fin = np.isfinite(vals.astype(np.float64))
    D = 64
    rng = np.random.default_rng(0)
    k = rng.permutation(np.tile(vals[fin], 64))[: 64 * D].reshape(1, 1, 64, D).astype(dt)
    v = rng.permutation(np.tile(vals[fin], 64))[: 64 * D].reshape(1, 1, 64, D).astype(dt)
    q = (rng.standard_normal((1, 1, 1, D)) * 1e-3).astype(F32)
    kw = dict(k_scale=1e-2, v_scale=1.0) if dt == I8 else dict(k_scale=1e-3 if dt == E5M2 else 1e-2)
    check8(q, k, v, kw["k_scale"], kw.get("v_scale"))


# ---------------------------------------------------------------------------
# Scale forms x paths


FORMS = ["token", "channel", "head", "scalar"]
# (Hq, Hk, L, S): a decode row, GQA decode, a few rows, prefill, prefill L != S
SHAPES = [(4, 4, 1, 700), (8, 2, 1, 300), (4, 4, 3, 200), (4, 2, 150, 300), (2, 2, 257, 129)]


@pytest.mark.parametrize("dt", KV8, ids=str)
@pytest.mark.parametrize("kform", FORMS)
@pytest.mark.parametrize("vform", ["token", "channel"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_scale_forms(isa, dt, kform, vform, shape):
    rng = np.random.default_rng(hash((str(dt), kform, vform, shape)) % 2**32)
    Hq, Hk, L, S = shape
    q, k8, v8 = qkv8(rng, dt, 2, Hq, Hk, L, S, 64)
    ks = scale_of(rng, kform, k8.shape)
    vs = scale_of(rng, vform, v8.shape)
    check8(q, k8, v8, ks, vs, enable_gqa=True)


@pytest.mark.parametrize("dt", KV8, ids=str)
@pytest.mark.parametrize("D,Dv", [(64, 64), (128, 128), (40, 24), (96, 80), (256, 256), (7, 5)])
@pytest.mark.parametrize("L", [1, 4, 96])
def test_head_dims(isa, dt, D, Dv, L):
    rng = np.random.default_rng(D * 1000 + Dv + L)
    q, k8, v8 = qkv8(rng, dt, 1, 4, 2, L, 333, D, Dv)
    check8(q, k8, v8, scale_of(rng, "token", k8.shape), scale_of(rng, "channel", v8.shape), enable_gqa=True)


@pytest.mark.parametrize("dt", KV8, ids=str)
@pytest.mark.parametrize("L,S", [(1, 513), (5, 700), (200, 200), (100, 333)])
def test_causal_window_lengths(isa, dt, L, S):
    rng = np.random.default_rng(L + S)
    q, k8, v8 = qkv8(rng, dt, 3, 4, 4, L, S, 64)
    ks, vs = scale_of(rng, "token", k8.shape), scale_of(rng, "token", v8.shape)
    check8(q, k8, v8, ks, vs, is_causal=True)
    check8(q, k8, v8, ks, vs, window=(64, 0), is_causal=True)
    check8(q, k8, v8, ks, vs, key_lengths=np.array([S, S // 2, 1]), is_causal=True)


@pytest.mark.parametrize("dt", KV8, ids=str)
@pytest.mark.parametrize("L", [1, 3, 130])
def test_masks_and_score_options(isa, dt, L):
    rng = np.random.default_rng(L)
    S = 300
    q, k8, v8 = qkv8(rng, dt, 2, 4, 2, L, S, 64)
    ks, vs = scale_of(rng, "channel", k8.shape), scale_of(rng, "token", v8.shape)
    pad = np.ones((2, 1, 1, S), dtype=bool)
    pad[1, ..., 200:] = False
    check8(q, k8, v8, ks, vs, attn_mask=pad, enable_gqa=True)
    hf = np.where(pad, 0.0, np.finfo(np.float32).min).astype(F32)
    check8(q, k8, v8, ks, vs, attn_mask=hf, enable_gqa=True)
    check8(q, k8, v8, ks, vs, attn_mask=rng.standard_normal((L, S)).astype(F32), enable_gqa=True)
    check8(q, k8, v8, ks, vs, softcap=5.0, enable_gqa=True)
    check8(q, k8, v8, ks, vs, alibi_slopes=np.linspace(0.01, 0.1, 4), enable_gqa=True)
    check8(q, k8, v8, ks, vs, sinks=np.linspace(-1, 1, 4), enable_gqa=True)


@pytest.mark.parametrize("dt", KV8, ids=str)
@pytest.mark.parametrize("L", [1, 64])
def test_bshd_layout(isa, dt, L):
    rng = np.random.default_rng(L + 7)
    q, k8, v8 = qkv8(rng, dt, 2, 4, 2, L, 257, 64)
    ks, vs = scale_of(rng, "token", k8.shape), scale_of(rng, "channel", v8.shape)
    qb, kb, vb = (np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in (q, k8, v8))
    ksb, vsb = np.swapaxes(ks, 1, 2), np.swapaxes(vs, 1, 2)
    o = sdpa(qb, kb, vb, k_scale=ksb, v_scale=vsb, layout="bshd", enable_gqa=True)
    ro = ref.scaled_dot_product_attention(q, deq(k8, ks), deq(v8, vs), enable_gqa=True)
    assert_close(np.swapaxes(o, 1, 2), ro, tol=TOL)


@pytest.mark.parametrize("dt", KV8, ids=str)
@pytest.mark.parametrize("qdt", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
def test_16bit_query(isa, dt, qdt):
    rng = np.random.default_rng(3)
    q, k8, v8 = qkv8(rng, dt, 1, 4, 4, 2, 300, 64)
    ks, vs = scale_of(rng, "token", k8.shape), scale_of(rng, "head", v8.shape)
    q16 = q.astype(qdt)
    o = sdpa(q16, k8, v8, k_scale=ks, v_scale=vs)
    assert o.dtype == np.dtype(qdt)
    ro = ref.scaled_dot_product_attention(q16.astype(np.float64), deq(k8, ks), deq(v8, vs))
    assert_close(o.astype(np.float64), ro, tol=float(ml_dtypes.finfo(qdt).eps) * 2)


@pytest.mark.parametrize("dt", KV8, ids=str)
def test_varlen(isa, dt):
    rng = np.random.default_rng(11)
    cu = np.array([0, 5, 5, 300, 420])
    T = cu[-1]
    q = rng.standard_normal((T, 4, 64)).astype(F32)
    k8 = (
        (rng.standard_normal((T, 2, 64)) * 4).astype(dt)
        if dt != I8
        else rng.integers(-127, 128, (T, 2, 64)).astype(I8)
    )
    v8 = (
        (rng.standard_normal((T, 2, 64)) * 4).astype(dt)
        if dt != I8
        else rng.integers(-127, 128, (T, 2, 64)).astype(I8)
    )
    ks = rng.uniform(0.001, 0.01, (T, 2, 1)).astype(F32)
    vs = rng.uniform(0.001, 0.01, (1, 1, 64)).astype(F32)
    o = fastattn.varlen_attention(q, k8, v8, cu, cu, is_causal=True, enable_gqa=True, k_scale=ks, v_scale=vs)
    kd, vd = deq(k8, ks), deq(v8, vs)
    for b in range(len(cu) - 1):
        a, e = cu[b], cu[b + 1]
        if a == e:
            continue
        r = ref.scaled_dot_product_attention(
            q[a:e], kd[a:e], vd[a:e], is_causal=True, enable_gqa=True, layout="bshd"
        )
        assert_close(o[a:e], r, tol=TOL)


@pytest.mark.parametrize("dt", KV8, ids=str)
@pytest.mark.parametrize("L", [1, 8, 200])
def test_threads_bit_identical(dt, L):
    rng = np.random.default_rng(L)
    q, k8, v8 = qkv8(rng, dt, 2, 8, 2, L, 1500, 64)
    ks, vs = scale_of(rng, "token", k8.shape), scale_of(rng, "token", v8.shape)
    outs = [sdpa(q, k8, v8, k_scale=ks, v_scale=vs, enable_gqa=True, num_threads=t) for t in (1, 2, 3)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_inputs_not_modified():
    rng = np.random.default_rng(5)
    q, k8, v8 = qkv8(rng, I8, 1, 2, 2, 3, 100, 32)
    ks, vs = scale_of(rng, "token", k8.shape), scale_of(rng, "channel", v8.shape)
    copies = [a.copy() for a in (q, k8, v8, ks, vs)]
    sdpa(q, k8, v8, k_scale=ks, v_scale=vs)
    for a, c in zip((q, k8, v8, ks, vs), copies):
        np.testing.assert_array_equal(a, c)


# ---------------------------------------------------------------------------
# Bad input


def test_bad_scales():
    rng = np.random.default_rng(0)
    q, k8, v8 = qkv8(rng, I8, 1, 2, 2, 3, 16, 8)
    good = np.ones((1, 2, 16, 1), F32)
    with pytest.raises(TypeError, match="k_scale"):
        sdpa(q, k8, v8, v_scale=good)
    with pytest.raises(TypeError, match="v_scale"):
        sdpa(q, k8, v8, k_scale=good)
    with pytest.raises(ValueError, match="k_scale.*both"):
        sdpa(q, k8, v8, k_scale=np.ones((1, 2, 16, 8), F32), v_scale=good)
    for bad in (0.0, -1.0, np.nan, np.inf, 1e-45):
        with pytest.raises(ValueError, match="k_scale"):
            sdpa(q, k8, v8, k_scale=bad, v_scale=good)
    with pytest.raises(ValueError, match="v_scale"):
        sdpa(q, k8, v8, k_scale=good, v_scale=np.ones((1, 2, 15, 1), F32))
    with pytest.raises(TypeError, match="v_scale"):
        sdpa(q, k8, v8, k_scale=good, v_scale=np.ones((1, 2, 16, 1), bool))
    with pytest.raises(TypeError, match="k_scale"):
        sdpa(q, q[:, :, :3].copy(), q[:, :, :3].copy(), k_scale=1.0)
    with pytest.raises(TypeError, match="share a dtype"):
        sdpa(q, k8, v8.astype(E4M3), k_scale=good, v_scale=good)
    with pytest.raises(TypeError, match="float64"):
        sdpa(q.astype(np.float64), k8, v8, k_scale=good, v_scale=good)
    with pytest.raises(TypeError):
        sdpa(q.astype(I8), k8, v8, k_scale=good, v_scale=good)


@pytest.mark.parametrize("S", [1, 5, 16, 37])
def test_bad_scale_anywhere_in_an_array(S):
    """One bad per-token value at the first, a middle or the last token is found by
    the one-pass check of a contiguous scale (every lane and tail of its loop) and by
    the NumPy check of a strided one; float32's least normal and largest pass."""
    rng = np.random.default_rng(S)
    q, k8, v8 = qkv8(rng, I8, 1, 2, 2, 1, S, 8)
    tiny, big = np.finfo(F32).tiny, np.finfo(F32).max
    edge = np.full((1, 2, S, 1), tiny, F32)
    edge[0, 1, -1] = big
    sdpa(q, k8, v8, k_scale=edge, v_scale=edge[:, ::-1])
    for bad in (0.0, -0.0, -1.0, -tiny, np.nextafter(tiny, np.float32(0)), np.nan, np.inf, -np.inf):
        for h, t in ((0, 0), (1, S // 2), (1, S - 1)):
            ks = np.ones((1, 2, S, 1), F32)
            ks[0, h, t] = bad
            with pytest.raises(ValueError, match="k_scale"):
                sdpa(q, k8, v8, k_scale=ks, v_scale=np.ones_like(ks))
            wide = np.ones((1, 2, S, 2), F32)  # a strided view: the NumPy check
            wide[0, h, t, 0] = bad
            with pytest.raises(ValueError, match="v_scale"):
                sdpa(q, k8, v8, k_scale=np.ones_like(ks), v_scale=wide[..., :1])


def test_fp8_default_scale_is_one():
    rng = np.random.default_rng(2)
    q, k8, v8 = qkv8(rng, E4M3, 1, 2, 2, 1, 50, 16)
    np.testing.assert_array_equal(sdpa(q, k8, v8), sdpa(q, k8, v8, k_scale=1.0, v_scale=1.0))


# ---------------------------------------------------------------------------
# quantize_kv


@pytest.mark.parametrize("dt", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_quantize_kv_per_token(dt):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 50, 64)).astype(F32)
    x[..., 0] *= 20
    x[0, 0, 7] = 0.0
    q, s = fastattn.quantize_kv(x, dt)
    assert s.shape == (2, 3, 50, 1) and s.dtype == F32
    qmax = {"int8": 127, "float8_e4m3fn": 448, "float8_e5m2": 57344}[dt]
    amax = np.abs(x).max(-1, keepdims=True)
    np.testing.assert_allclose(s[amax > 0], (amax / qmax)[amax > 0], rtol=1e-6)
    y = x / s
    back = q.astype(np.float64)
    if dt == "int8":
        assert np.all(np.abs(back - y) <= 0.5 + 1e-6)
    else:
        # half a step of the format at each value: 2^(exponent - mantissa bits - 1)
        mbits = 3 if dt == "float8_e4m3fn" else 2
        e = np.floor(np.log2(np.maximum(np.abs(y), ml_dtypes.finfo(q.dtype).smallest_normal)))
        assert np.all(np.abs(back - y) <= 2.0 ** (e - mbits - 1) * (1 + 1e-6))


def test_quantize_kv_fixed_scale_overflow():
    x = np.array([[1.0, -2.0, 3.0]], F32)
    q, s = fastattn.quantize_kv(x, "int8", scale=3.0 / 127)
    np.testing.assert_array_equal(q, [[42, -85, 127]])
    with pytest.raises(ValueError, match="does not fit"):
        fastattn.quantize_kv(x, "int8", scale=1.0 / 127)
    with pytest.raises(ValueError, match="finite"):
        fastattn.quantize_kv(np.array([np.nan], F32), "int8")
    with pytest.raises(TypeError, match="dtype"):
        fastattn.quantize_kv(x, "int4")
