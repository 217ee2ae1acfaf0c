"""16-bit inputs (float16, bfloat16) on every ISA path the CPU has.

Tolerances are derived, not guessed: the kernel computes in float32 on the
16-bit inputs, so its error should be of the order of a naive float32
computation on the same (already 16-bit) inputs, plus the rounding of the
output to 16 bits when the query is 16-bit.  ``bound`` measures the naive
float32 error against the float64 reference and allows a small multiple of it,
plus one 16-bit ulp of the reference value when the output is 16-bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import randn
from naive_bf16 import naive_bf16_error

import fastattn
from fastattn import _kernels
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention
F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
HALF = [F16, BF16]
EPS32 = float(np.finfo(np.float32).eps)


def eps_of(dt):
    """Spacing of 1.0 (one ulp at 1) of a floating dtype."""
    return float(ml_dtypes.finfo(dt).eps)


def tiny_of(dt):
    """Smallest positive subnormal: the absolute resolution near zero."""
    return float(ml_dtypes.finfo(dt).smallest_subnormal)


def naive_f32(q, k, v, *, is_causal=False, key_lengths=None, scale=None):
    """The obvious float32 computation (scores, softmax, weighted sum) on the given inputs."""
    q, k, v = (np.asarray(a).astype(np.float32) for a in (q, k, v))
    Hq, L, D = q.shape[-3:]
    Hk, S = k.shape[-3:-1]
    k = np.repeat(k, Hq // Hk, axis=-3)
    v = np.repeat(v, Hq // Hk, axis=-3)
    sc = np.float32(1.0 / np.sqrt(D) if scale is None else scale)
    s = np.einsum("bhld,bhsd->bhls", q, k).astype(np.float32) * sc
    Sb = np.full(q.shape[0], S) if key_lengths is None else np.asarray(key_lengths)
    Sb = Sb[:, None, None, None]
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    ok = j < Sb
    if is_causal:
        ok = ok & (j <= i + Sb - L)
    s = np.where(ok, s, np.float32(-np.inf))
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m).astype(np.float32)
    p = (e / e.sum(-1, keepdims=True)).astype(np.float32)
    return np.einsum("bhls,bhsd->bhld", p, v).astype(np.float32)


def bound(q, k, v, expected, out_dtype, **kw):
    """Per-element error allowed for the kernel's output (see the module docstring)."""
    naive = naive_f32(q, k, v, **kw).astype(np.float64)
    scale = max(1.0, float(np.abs(expected).max()))
    allowed = 8 * float(np.abs(naive - expected).max()) + 8 * EPS32 * scale
    if out_dtype != np.float32:
        allowed = allowed + eps_of(out_dtype) * np.abs(expected) + tiny_of(out_dtype)
    return allowed


def amx_path(q, k, v):
    """The 16-bit type P is rounded to when the call runs on a tile kernel, else None: isa "amx"
    (AMX tiles) or "avx512bf16" (the same kernel on VDPBF16PS), all bfloat16, >= 32 stacked rows
    per kv head; or isa "amx", all float16, on AMX-FP16 (real or emulated, test_amx_fp16.py)."""
    rows = q.shape[-2] * (q.shape[-3] // k.shape[-3])
    if rows < 32 or not q.dtype == k.dtype == v.dtype:
        return None
    if fastattn.get_isa() in ("amx", "avx512bf16") and q.dtype == BF16:
        return BF16
    if fastattn.get_isa() == "amx" and q.dtype == np.float16 and _kernels.amx_fp16_usable():
        return np.dtype(np.float16)
    return None


def check_half(rng, B, Hq, Hk, L, S, D, kv_dtype, q_dtype, *, Dv=None, mag=1.0, **kw):
    Dv = D if Dv is None else Dv
    q = randn(rng, (B, Hq, L, D), np.float32, mag).astype(q_dtype)
    k = randn(rng, (B, Hk, S, D), np.float32, mag).astype(kv_dtype)
    v = randn(rng, (B, Hk, S, Dv), np.float32).astype(kv_dtype)
    copies = [a.copy() for a in (q, k, v)]
    o, lse = sdpa(q, k, v, enable_gqa=Hq != Hk, return_lse=True, **kw)
    ro, rlse = ref.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hk, return_lse=True, **kw)
    assert o.dtype == np.dtype(q_dtype), "the output has the query's dtype"
    assert lse.dtype == np.float32
    assert np.all(np.isfinite(o.astype(np.float64)))
    err = np.abs(o.astype(np.float64) - ro)
    allowed = bound(q, k, v, ro, np.dtype(q_dtype), **kw)
    p16 = amx_path(q, k, v)
    if p16 is not None:  # 16-bit products, P rounded to 16 bits: the naive contract (test_amx.py)
        naive = naive_bf16_error(q, k, v, p_dtype=p16, enable_gqa=Hq != Hk, **kw)[0]
        allowed = np.maximum(allowed, 2 * naive)
    assert np.all(err <= allowed), f"max excess {np.max(err - allowed):.3e}, max error {err.max():.3e}"
    # The LSE is float32 whatever the inputs: compare at float32 precision of its magnitude.
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-4)
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)
    return o, ro


@pytest.mark.parametrize("kv_dtype", HALF, ids=["f16", "bf16"])
@pytest.mark.parametrize("q_same", [True, False], ids=["q16", "q32"])
@pytest.mark.parametrize("D", [3, 17, 80])
def test_half_inputs_every_isa(isa, rng, kv_dtype, q_same, D):
    qdt = kv_dtype if q_same else np.float32
    check_half(rng, 2, 4, 2, 19, 45, D, kv_dtype, qdt, is_causal=True)
    check_half(rng, 1, 2, 2, 1, 70, D, kv_dtype, qdt)


@pytest.mark.parametrize("kv_dtype", HALF, ids=["f16", "bf16"])
@pytest.mark.parametrize("q_same", [True, False], ids=["q16", "q32"])
def test_half_decode_split_kv(isa, rng, kv_dtype, q_same):
    # B*Hk*query-blocks = 2 < 16 with S >= 1024: the driver splits the keys.
    qdt = kv_dtype if q_same else np.float32
    check_half(rng, 1, 4, 2, 1, 1100, 64, kv_dtype, qdt, key_lengths=np.array([1037]), is_causal=True)


@pytest.mark.parametrize("kv_dtype", HALF, ids=["f16", "bf16"])
def test_half_value_dim_and_lengths(isa, rng, kv_dtype):
    check_half(
        rng, 3, 2, 1, 5, 33, 24, kv_dtype, kv_dtype, Dv=9, is_causal=True, key_lengths=np.array([33, 7, 5])
    )


@pytest.mark.parametrize("kv_dtype", HALF, ids=["f16", "bf16"])
def test_half_large_scores_do_not_overflow(rng, kv_dtype):
    # q.k reaches ~ 100*100*D: far beyond float16's range, fine in float32.
    check_half(rng, 1, 2, 2, 4, 30, 16, kv_dtype, kv_dtype, mag=100.0, scale=1.0)


@pytest.mark.parametrize("kv_dtype", HALF, ids=["f16", "bf16"])
def test_half_bshd_and_strided(rng, kv_dtype):
    q = randn(rng, (2, 9, 4, 32), np.float32).astype(kv_dtype)[:, :, :, ::2]  # bshd, strided D
    k = randn(rng, (2, 21, 2, 16), np.float32).astype(kv_dtype)
    v = randn(rng, (2, 21, 2, 16), np.float32).astype(kv_dtype)
    o = sdpa(q, k, v, layout="bshd", enable_gqa=True, is_causal=True)
    ro = ref.scaled_dot_product_attention(q, k, v, layout="bshd", enable_gqa=True, is_causal=True)
    assert o.dtype == kv_dtype and o.shape == (2, 9, 4, 16)
    qh, kh, vh = (np.swapaxes(a, 1, 2) for a in (q, k, v))
    allowed = np.swapaxes(bound(qh, kh, vh, np.swapaxes(ro, 1, 2), kv_dtype, is_causal=True), 1, 2)
    assert np.all(np.abs(o.astype(np.float64) - ro) <= allowed)


def test_half_matches_float32_path_on_same_values(isa, rng):
    # float16 storage of values that float16 represents exactly must give the float32 result
    # up to float32 rounding (the conversion is exact, the arithmetic is the same).
    q = randn(rng, (1, 2, 7, 17), np.float32).astype(np.float16)
    k = randn(rng, (1, 2, 29, 17), np.float32).astype(np.float16)
    v = randn(rng, (1, 2, 29, 17), np.float32).astype(np.float16)
    o16 = sdpa(q.astype(np.float32), k, v, is_causal=True)
    o32 = sdpa(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), is_causal=True)
    assert o16.dtype == np.float32
    np.testing.assert_allclose(o16, o32, rtol=0, atol=4 * EPS32 * np.abs(o32).max())


def test_bad_dtype_mixes():
    q = np.zeros((1, 1, 2, 4), np.float16)
    k = np.zeros((1, 1, 3, 4), np.float16)
    with pytest.raises(TypeError, match="key and value"):
        sdpa(q, k, k.astype(BF16))
    with pytest.raises(TypeError, match="float64"):
        sdpa(q.astype(np.float64), k, k)
    with pytest.raises(TypeError, match="query"):
        sdpa(q.astype(np.int16), k, k)
