"""Reliability, round 3 (issue 42): the KV-cache front ends.

- Caches the kernel cannot read in place (a last axis that is not contiguous: K kept
  transposed; a misaligned buffer) attend over exactly what the append wrote
  (attention_with_kvcache, flash_compat.flash_attn_with_kvcache), against
  fastattn.reference on the caches' contents after the write.
- A rotated new key that would overflow the cache dtype raises ValueError in all three
  cache front ends (float32 and bfloat16 caches too); apply_rotary raises ValueError
  instead of returning inf.
- Integers beyond int64 (Python ints, uint64) raise ValueError naming the argument and
  reporting the value as given.
- KVCache(dtype=None) is the documented default, float32.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import optional, randn

import fastattn
from fastattn import KVCache, attention_with_kvcache
from fastattn import reference as ref
from fastattn.flash_compat import flash_attn_varlen_func, flash_attn_with_kvcache
from fastattn.positions import apply_rotary, rotary_cos_sin, sinusoidal_positions

B, HK, HQ, S, D, DV = 3, 2, 4, 12, 8, 6  # GQA: 2 query heads per key/value head
BIG = 2**70
U64 = np.uint64(2**64 - 1)


def _misaligned(shape, dtype, offset):
    """A writable array of ``shape`` whose data starts ``offset`` bytes into a uint8 buffer."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    buf = np.zeros(n + offset, np.uint8)
    a = buf[offset : offset + n].view(dtype).reshape(shape)
    assert not a.flags.aligned
    return a


def _transposed(shape):
    """A writable (..., S, X) view of a (..., X, S) buffer: the last axis is not contiguous."""
    return np.zeros(shape[:-2] + (shape[-1], shape[-2]), np.float32).swapaxes(-1, -2)


def _cache(kind, shape, layout):
    """A zero cache of the bhsd ``shape`` in ``layout``, stored as ``kind`` says."""
    sh = shape if layout == "bhsd" else (shape[0], shape[2], shape[1], shape[3])
    if kind == "transposed":
        if layout == "bhsd":
            return _transposed(sh)  # (B, H, D, S) viewed as (B, H, S, D)
        return np.zeros((sh[0], sh[3], sh[1], sh[2]), np.float32).transpose(0, 2, 3, 1)  # D outermost
    if kind.startswith("misaligned"):
        return _misaligned(sh, np.float32, int(kind[-1]))
    return np.zeros(sh, np.float32)


def _bhsd(a, layout):
    return a if layout == "bhsd" else np.swapaxes(a, 1, 2)


CASES = [
    (kk, kv, layout, rot)
    for kk, kv in [
        ("transposed", "contiguous"),
        ("contiguous", "transposed"),
        ("transposed", "transposed"),
        ("misaligned1", "misaligned2"),
        ("misaligned3", "contiguous"),
        ("misaligned2", "transposed"),
    ]
    for layout in ("bhsd", "bshd")
    for rot in (False, True)
]


def _setup(rng, kk, kv, layout, seq, T, Lq):
    """Caches of the given storage holding ``seq[b]`` random tokens; q, k_new, v_new (bhsd)."""
    kc, vc = _cache(kk, (B, HK, S, D), layout), _cache(kv, (B, HK, S, DV), layout)
    for b, n in enumerate(seq):
        _bhsd(kc, layout)[b, :, :n] = randn(rng, (HK, n, D))
        _bhsd(vc, layout)[b, :, :n] = randn(rng, (HK, n, DV))
    q, kn, vn = randn(rng, (B, HQ, Lq, D)), randn(rng, (B, HK, T, D)), randn(rng, (B, HK, T, DV))
    return kc, vc, q, kn, vn


def _expected(kc, vc, layout, q, kn, vn, seq, T, rot, interleaved, causal=True):
    """Checks the caches hold the new tokens (rotated by the reference with ``rot``) and
    returns the reference attention over the caches' contents after the write."""
    kh, vh = _bhsd(kc, layout), _bhsd(vc, layout)
    Lq = q.shape[2]
    kpos = seq[:, None] + np.arange(T)
    knr = kn if rot is None else ref.apply_rotary(kn, *rot, positions=kpos, interleaved=interleaved)
    for b, n in enumerate(seq):
        np.testing.assert_allclose(kh[b, :, n : n + T], knr[b], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(vh[b, :, n : n + T], vn[b])
    qr = q
    if rot is not None:  # causal: query i at cache_seqlens[b] + i
        qpos = seq[:, None] + np.arange(Lq)
        qr = ref.apply_rotary(q, *rot, positions=qpos, interleaved=interleaved)
    return ref.scaled_dot_product_attention(
        qr, kh.copy(), vh.copy(), is_causal=causal, enable_gqa=True, key_lengths=seq + T
    )


def _assert_close(out, want):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("kk, kv, layout, rotary", CASES)
def test_attention_with_kvcache_sees_the_write_in_strided_caches(rng, kk, kv, layout, rotary):
    seq = np.array([5, 2, 7])  # ragged: per-row writes
    T, Lq = 3, 2
    kc, vc, q, kn, vn = _setup(rng, kk, kv, layout, seq, T, Lq)
    rot = rotary_cos_sin(S, D) if rotary else None
    kw = dict(rotary_cos=rot[0], rotary_sin=rot[1]) if rotary else {}
    qg, kg, vg = (_bhsd(a, layout) for a in (q, kn, vn))  # in the call's layout
    out = attention_with_kvcache(qg, kc, vc, seq, kg, vg, layout=layout, **kw)
    want = _expected(kc, vc, layout, q, kn, vn, seq, T, rot, False)
    _assert_close(_bhsd(out, layout), want)


@pytest.mark.parametrize("kk, kv", [("transposed", "transposed"), ("misaligned1", "misaligned3")])
@pytest.mark.parametrize("rotary", [False, True])
def test_attention_with_kvcache_uniform_lengths_and_lse(rng, kk, kv, rotary):
    seq = np.array([4, 4, 4])  # the one-slice write
    T = 1
    kc, vc, q, kn, vn = _setup(rng, kk, kv, "bhsd", seq, T, 1)
    rot = rotary_cos_sin(S, D) if rotary else None
    kw = dict(rotary_cos=rot[0], rotary_sin=rot[1]) if rotary else {}
    out, lse = attention_with_kvcache(q, kc, vc, 4, kn, vn, return_lse=True, **kw)
    want = _expected(kc, vc, "bhsd", q, kn, vn, seq, T, rot, False)
    _assert_close(out, want)
    qr = q if rot is None else ref.apply_rotary(q, *rot, positions=np.full((B, 1), 4))
    _, want_lse = ref.scaled_dot_product_attention(
        qr, kc.copy(), vc.copy(), is_causal=True, enable_gqa=True, key_lengths=seq + T, return_lse=True
    )
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kk, kv", [(a, b) for a, b, lay, r in CASES if lay == "bhsd" and not r])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("batch_idx", [None, [2, 0, 1], [0, 2, 4]])
def test_flash_attn_with_kvcache_sees_the_write_in_strided_caches(rng, kk, kv, rotary, batch_idx):
    """flash-attn's layout (bshd), its default interleaved rotary; cache rows picked by
    cache_batch_idx: scattered ([2, 0, 1]: one call per row) or a strided view ([0, 2, 4])."""
    Bc = 5 if batch_idx is not None else B
    seq = np.array([3, 6, 1])
    T, Lq = 2, 2
    kc, vc = _cache(kk, (Bc, HK, S, D), "bshd"), _cache(kv, (Bc, HK, S, DV), "bshd")
    rows = list(range(B)) if batch_idx is None else batch_idx
    for c, n in zip(rows, seq):
        kc[c, :n] = randn(rng, (n, HK, D))
        vc[c, :n] = randn(rng, (n, HK, DV))
    untouched = [c for c in range(Bc) if c not in rows]
    before = [(kc[c].copy(), vc[c].copy()) for c in untouched]
    q, kn, vn = randn(rng, (B, Lq, HQ, D)), randn(rng, (B, T, HK, D)), randn(rng, (B, T, HK, DV))
    rot = rotary_cos_sin(S, D) if rotary else (None, None)
    idx = None if batch_idx is None else np.array(batch_idx, np.int32)
    out = flash_attn_with_kvcache(
        q, kc, vc, kn, vn, *rot, cache_seqlens=seq, cache_batch_idx=idx, causal=True
    )
    kr, vr = kc[rows], vc[rows]  # the rows attended, after the write
    want = _expected(
        kr,
        vr,
        "bshd",
        np.swapaxes(q, 1, 2),
        np.swapaxes(kn, 1, 2),
        np.swapaxes(vn, 1, 2),
        seq,
        T,
        rot if rotary else None,
        True,
    )
    _assert_close(np.swapaxes(out, 1, 2), want)
    for c, (k0, v0) in zip(untouched, before):
        np.testing.assert_array_equal(kc[c], k0)
        np.testing.assert_array_equal(vc[c], v0)


def test_flash_attn_with_kvcache_decode_loop_transposed_cache(rng):
    """The issue's example: a decode loop whose K is kept transposed; every step's output
    matches a contiguous cache's bit for bit (they hold the same values)."""
    kt = _cache("transposed", (1, 1, S, D), "bshd")
    vt = np.zeros((1, S, 1, D), np.float32)
    k0, v0 = np.zeros_like(kt, order="C"), np.zeros_like(vt)
    for t in range(6):
        q, kn, vn = randn(rng, (1, 1, 2, D)), randn(rng, (1, 1, 1, D)), randn(rng, (1, 1, 1, D))
        o_t = flash_attn_with_kvcache(q, kt, vt, kn, vn, cache_seqlens=t, causal=True)
        o_c = flash_attn_with_kvcache(q, k0, v0, kn, vn, cache_seqlens=t, causal=True)
        np.testing.assert_array_equal(o_t, o_c)
        np.testing.assert_array_equal(kt, k0)


def test_flash_attn_with_kvcache_transposed_torch_cache(rng):
    """CPU tensors are written in place too: a transposed tensor cache attends over the write."""
    torch = optional("torch")
    kc = torch.zeros(B, HK, D, S).permute(0, 3, 1, 2)  # (B, S, Hk, D), D not contiguous
    vc = torch.zeros(B, S, HK, DV)
    seq = np.array([4, 1, 6])
    for b, n in enumerate(seq):
        kc[b, :n] = torch.from_numpy(randn(rng, (n, HK, D)))
        vc[b, :n] = torch.from_numpy(randn(rng, (n, HK, DV)))
    q, kn, vn = randn(rng, (B, 1, HQ, D)), randn(rng, (B, 1, HK, D)), randn(rng, (B, 1, HK, DV))
    out = flash_attn_with_kvcache(
        torch.from_numpy(q),
        kc,
        vc,
        torch.from_numpy(kn),
        torch.from_numpy(vn),
        cache_seqlens=torch.from_numpy(seq.astype(np.int32)),
        causal=True,
    )
    assert isinstance(out, torch.Tensor)
    want = _expected(
        kc.numpy(),
        vc.numpy(),
        "bshd",
        q.swapaxes(1, 2),
        kn.swapaxes(1, 2),
        vn.swapaxes(1, 2),
        seq,
        1,
        None,
        True,
    )
    _assert_close(out.numpy().swapaxes(1, 2), want)


# ---------------------------------------------------------------- rotary overflow (item 11)


def _bf16():
    return pytest.importorskip("ml_dtypes").bfloat16


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rotated_key_overflow_raises_in_every_cache_front_end(dtype):
    dt = np.dtype(_bf16()) if dtype == "bfloat16" else np.dtype(dtype)
    top = 65504.0 if dtype == "float16" else float(np.finfo(np.float32).max)
    big = float(np.array(top * 0.9, np.float32).astype(dt).astype(np.float64))  # fits: its rotation does not
    cos, sin = rotary_cos_sin(S, D)
    k = np.zeros((1, 1, 1, D), np.float32)
    k[..., 0], k[..., D // 2] = big, big  # the NeoX pair (0, D/2): rotates to ~sqrt(2) * big
    k[..., 1], k[..., 1 + D // 2] = big, big  # interleaved pairs (0, 1): likewise
    v = np.zeros((1, 1, 1, D), np.float32)
    q = np.zeros((1, 1, 1, D), np.float32)
    # position 1: cos = sin ~ 0.54 / 0.84 at the first frequency, the pair grows past max
    kc, vc = np.zeros((1, S, 1, D), dt), np.zeros((1, S, 1, D), dt)
    with pytest.raises(ValueError, match=r"k holds .* beyond the range"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=1, causal=True)
    assert not np.any(kc.astype(np.float64)) and not np.any(vc.astype(np.float64))  # nothing written
    kc, vc = np.zeros((1, 1, S, D), dt), np.zeros((1, 1, S, D), dt)
    with pytest.raises(ValueError, match=r"k_new holds .* beyond the range"):
        attention_with_kvcache(q, kc, vc, 1, k, v, rotary_cos=cos, rotary_sin=sin)
    assert not np.any(kc.astype(np.float64))
    cache = KVCache(1, 1, S, D, dtype=dt, rotary_cos=cos, rotary_sin=sin)
    cache.append(np.zeros((1, 1, 1, D), np.float32), np.zeros((1, 1, 1, D), np.float32))
    with pytest.raises(ValueError, match=r"k_new holds .* beyond the range"):
        cache.append(k, v)
    assert cache.lengths.tolist() == [1]
    # The same values, unrotated, fit: stored as given.
    out = flash_attn_with_kvcache(
        q, kc.swapaxes(1, 2).copy(), vc.swapaxes(1, 2).copy(), k, v, cache_seqlens=1
    )
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_apply_rotary_overflow_raises(dtype):
    dt = np.dtype(_bf16()) if dtype == "bfloat16" else np.dtype(dtype)
    top = 65504.0 if dtype == "float16" else float(np.finfo(np.float32).max)
    x = np.zeros((2, 4, D), dt)
    x[1, 2, 0] = x[1, 2, D // 2] = np.array(top * 0.9).astype(dt)  # x1 cos - x2 sin, x2 cos + x1 sin
    cos, sin = rotary_cos_sin(8, D)
    with pytest.raises(ValueError, match=r"x holds 1 value\(s\) whose rotation is beyond the range"):
        apply_rotary(x, cos, sin)
    # the rotation that fits is returned, and agrees with the reference
    x[1, 2] = 0
    x[1, 3, :2] = np.array(top * 0.5).astype(dt)
    out = apply_rotary(x, cos, sin)
    want = ref.apply_rotary(x.astype(np.float64), cos, sin)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=1e-2)
    # an inf given passes through (it is not an overflow of the rotation)
    x[0, 1, 0] = np.inf
    out = apply_rotary(x, cos, sin)
    assert np.isinf(out[0, 1, 0].astype(np.float64))


def test_apply_rotary_float16_overflow_matches_reference_bound():
    """The boundary: 46000 * sqrt(2) < 65504 fits, 47000 * sqrt(2) does not (at angle pi/4)."""
    cos = np.array([[math.cos(math.pi / 4)]], np.float32)
    sin = np.array([[math.sin(math.pi / 4)]], np.float32)
    ok = np.array([[46000.0, -46000.0]], np.float16)
    got = apply_rotary(ok, cos, sin)
    want = ref.apply_rotary(ok, cos, sin)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-3)
    with pytest.raises(ValueError, match="x holds"):
        apply_rotary(np.array([[47000.0, -47000.0]], np.float16), cos, sin)


def test_rotated_query_overflow_raises_before_any_write():
    """A float16 query whose rotation overflows would make the output NaN: ValueError naming
    q, raised before attention_with_kvcache writes the new tokens."""
    cos, sin = rotary_cos_sin(S, D)
    q = np.zeros((1, 1, 1, D), np.float16)
    q[..., 1] = q[..., 1 + D // 2] = 60000.0  # rotated at position 1: beyond 65504
    kc, vc = np.zeros((1, 1, S, D), np.float16), np.zeros((1, 1, S, D), np.float16)
    kn = np.ones((1, 1, 1, D), np.float16)
    with pytest.raises(ValueError, match="q holds"):
        attention_with_kvcache(q, kc, vc, 1, kn, kn, rotary_cos=cos, rotary_sin=sin)
    assert not np.any(kc) and not np.any(vc)
    cache = KVCache(1, 1, S, D, dtype=np.float16, rotary_cos=cos, rotary_sin=sin)
    cache.append(np.zeros((1, 1, 2, D), np.float16), np.zeros((1, 1, 2, D), np.float16))
    with pytest.raises(ValueError, match="q holds"):
        cache.attend(q)
    q[..., 1] = q[..., 1 + D // 2] = 30000.0  # fits: the reference's answer (all values zero)
    np.testing.assert_array_equal(cache.attend(q), np.zeros((1, 1, 1, D), np.float16))


# ---------------------------------------------------------------- integers beyond int64 (item 12)


def _kv_inputs():
    q = np.zeros((1, 1, 1, 4), np.float32)
    kc = np.zeros((1, 1, 8, 4), np.float32)
    return q, kc, kc.copy()


@pytest.mark.parametrize(
    "value, shown",
    [(BIG, str(BIG)), (U64, str(2**64 - 1)), (np.array([U64]), str(2**64 - 1)), ([BIG], str(BIG))],
)
def test_cache_seqlens_beyond_int64(value, shown):
    q, kc, vc = _kv_inputs()
    with pytest.raises(ValueError, match=rf"cache_seqlens .*{shown}"):
        attention_with_kvcache(q, kc, vc, value)
    qf, kf, vf = (
        np.zeros((1, 1, 1, 4), np.float32),
        np.zeros((1, 8, 1, 4), np.float32),
        np.zeros((1, 8, 1, 4), np.float32),
    )
    with pytest.raises(ValueError, match=rf"cache_seqlens .*{shown}"):
        flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=value)
    with pytest.raises(ValueError, match=rf"cache_leftpad .*{shown}"):
        flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=4, cache_leftpad=value)


def test_negative_uint64_never_reported_as_minus_one():
    q, kc, vc = _kv_inputs()
    with pytest.raises(ValueError) as e:
        attention_with_kvcache(q, kc, vc, np.array([2**64 - 1], np.uint64))
    assert "18446744073709551615" in str(e.value) and "-1" not in str(e.value)


@pytest.mark.parametrize("value", [BIG, U64, -BIG])
def test_kvcache_integer_arguments_beyond_int64(value):
    cache = KVCache(2, 1, 8, 4)
    cache.append(np.ones((2, 1, 3, 4), np.float32), np.ones((2, 1, 3, 4), np.float32))
    with pytest.raises(ValueError, match=rf"n must be .*{value}"):
        cache.crop(value)
    assert cache.lengths.tolist() == [3, 3]
    for name, args in [
        ("batch", (value, 1, 8, 4)),
        ("num_kv_heads", (1, value, 8, 4)),
        ("max_len", (1, 1, value, 4)),
        ("head_dim", (1, 1, 8, value)),
    ]:
        with pytest.raises(ValueError, match=rf"{name} must be .*{value}"):
            KVCache(*args)
    with pytest.raises(ValueError, match=rf"value_dim must be .*{value}"):
        KVCache(1, 1, 8, 4, value_dim=value)
    with pytest.raises(ValueError, match="batch_index"):
        cache.reset(value)
    with pytest.raises(
        ValueError, match=rf"batch_index values must lie in \[0, 2\), got range .*{int(value)}"
    ):
        cache.reset([0, value])
    with pytest.raises(ValueError, match=rf"beam_idx values must lie in \[0, 2\), got range .*{int(value)}"):
        cache.reorder_cache([value, 0])
    assert cache.lengths.tolist() == [3, 3]


def test_crop_large_in_range_is_a_no_op():
    cache = KVCache(1, 1, 8, 4)
    cache.append(np.ones((1, 1, 3, 4), np.float32), np.ones((1, 1, 3, 4), np.float32))
    cache.crop(2**63 - 1)
    assert cache.lengths.tolist() == [3]
    cache.crop(np.uint64(2))
    assert cache.lengths.tolist() == [2]


def test_flash_integer_arguments_beyond_int64():
    qf, kf, vf = (
        np.zeros((1, 1, 1, 4), np.float32),
        np.zeros((1, 8, 1, 4), np.float32),
        np.zeros((1, 8, 1, 4), np.float32),
    )
    with pytest.raises(
        ValueError, match=rf"cache_batch_idx values must lie in \[0, 1\), got range .*{2**64 - 1}"
    ):
        flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=4, cache_batch_idx=np.array([U64]))
    with pytest.raises(ValueError, match=rf"num_splits must be .*{BIG}"):
        flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=4, num_splits=BIG)
    with pytest.raises(ValueError, match=rf"window_size\[0\] must be .*{BIG}"):
        flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=4, window_size=(BIG, 0))
    x = np.zeros((4, 1, 4), np.float32)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(ValueError, match=rf"max_seqlen_q must be .*{BIG}"):
        flash_attn_varlen_func(x, x, x, cu, cu, BIG, 4)
    with pytest.raises(ValueError, match=rf"max_seqlen_k must be .*{2**64 - 1}"):
        flash_attn_varlen_func(x, x, x, cu, cu, 4, U64)
    with pytest.raises(ValueError, match=rf"cu_seqlens_q values must .*{2**64 - 1}"):
        flash_attn_varlen_func(x, x, x, np.array([0, 2**64 - 1], np.uint64), cu, 4, 4)
    with pytest.raises(ValueError, match=rf"cu_seqlens_k values must .*{BIG}"):
        flash_attn_varlen_func(x, x, x, cu, [0, BIG], 4, 4)
    # in range, uint64 offsets still work (against the reference)
    rng = np.random.default_rng(0)
    q, k, v = randn(rng, (4, 1, 4)), randn(rng, (4, 1, 4)), randn(rng, (4, 1, 4))
    out = flash_attn_varlen_func(q, k, v, np.array([0, 4], np.uint64), np.array([0, 4], np.uint64), 4, 4)
    _assert_close(out, ref.scaled_dot_product_attention(q, k, v, layout="bshd"))


def test_positions_integer_arguments_beyond_int64():
    cos, sin = rotary_cos_sin(8, 4)
    x = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(ValueError, match=rf"positions values .*{2**64 - 1}"):
        apply_rotary(x, cos, sin, positions=np.array([0, 2**64 - 1], np.uint64))
    with pytest.raises(ValueError, match=rf"positions values .*{BIG}"):
        apply_rotary(x, cos, sin, positions=[0, BIG])
    for f, name in [(rotary_cos_sin, "length"), (sinusoidal_positions, "length")]:
        with pytest.raises(ValueError, match=rf"{name} must be .*{BIG}"):
            f(BIG, 4)
    with pytest.raises(ValueError, match=rf"rotary_dim must be .*{BIG}"):
        rotary_cos_sin(4, BIG)
    with pytest.raises(ValueError, match=rf"dim must be .*{2**64 - 1}"):
        sinusoidal_positions(4, U64)
    # uint64 positions in range are the positions they say
    got = apply_rotary(
        randn(np.random.default_rng(1), (1, 2, 4)), cos, sin, positions=np.array([7, 3], np.uint64)
    )
    assert got.shape == (1, 2, 4)


# ---------------------------------------------------------------- KVCache(dtype=None) (item 18)


def test_kvcache_dtype_none_is_the_documented_default(rng):
    cache = KVCache(1, 1, 8, 4, dtype=None)
    assert cache.dtype == np.float32 == KVCache(1, 1, 8, 4).dtype
    k, v, q = randn(rng, (1, 1, 3, 4)), randn(rng, (1, 1, 3, 4)), randn(rng, (1, 2, 3, 4))
    cache.append(k, v)
    out = cache.attend(q)
    assert out.dtype == np.float32
    _assert_close(out, ref.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    for bad in (np.int64, object, "nope"):
        with pytest.raises(TypeError, match="dtype must be float16, bfloat16, float32 or float64"):
            KVCache(1, 1, 8, 4, dtype=bad)


def test_fastattn_namespace():  # the names this file uses are the public ones
    assert fastattn.KVCache is KVCache and fastattn.attention_with_kvcache is attention_with_kvcache
