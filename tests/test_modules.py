"""MultiHeadAttention against a plain NumPy transcription (projections + the
float64 reference attention) and, when torch is installed, against
torch.nn.MultiheadAttention with the same weights."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from conftest import assert_close, randn

import fastattn
from fastattn import reference as ref

MHA = fastattn.MultiHeadAttention


def transcription(m, query, key=None, value=None, mask=None, is_causal=False):
    """float64 NumPy: project, split heads, reference attention (``mask`` in
    fastattn's convention, broadcastable to (B, H, L, S)), merge, project."""
    f = np.float64
    x = np.asarray(query, f)
    kx = x if key is None else np.asarray(key, f)
    vx = kx if value is None else np.asarray(value, f)

    def lin(a, w, b):
        y = a @ np.asarray(w, f).T
        return y if b is None else y + np.asarray(b, f)

    H, Hk, hd = m.num_heads, m.num_kv_heads, m.head_dim
    q = lin(x, m.q_proj_weight, m.q_proj_bias)
    k = lin(kx, m.k_proj_weight, m.k_proj_bias)
    v = lin(vx, m.v_proj_weight, m.v_proj_bias)
    q = q.reshape(q.shape[:-1] + (H, hd)).swapaxes(-2, -3)
    k = k.reshape(k.shape[:-1] + (Hk, hd)).swapaxes(-2, -3)
    v = v.reshape(v.shape[:-1] + (Hk, hd)).swapaxes(-2, -3)
    o = ref.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=Hk != H)
    o = o.swapaxes(-2, -3).reshape(x.shape[:-1] + (H * hd,))
    return lin(o, m.out_proj_weight, m.out_proj_bias)


def with_biases(m, rng):
    for n in ("q_proj_bias", "k_proj_bias", "v_proj_bias", "out_proj_bias"):
        b = getattr(m, n)
        setattr(m, n, randn(rng, b.shape, m.dtype, 0.5))
    return m


# --- against the NumPy transcription ----------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention(rng, dtype, num_kv_heads, causal):
    m = with_biases(MHA(32, 4, num_kv_heads=num_kv_heads, dtype=dtype, seed=1), rng)
    x = randn(rng, (2, 37, 32), dtype)
    x0 = x.copy()
    y = m(x, is_causal=causal)
    assert y.shape == (2, 37, 32) and y.dtype == dtype
    assert_close(y, transcription(m, x, is_causal=causal), dtype)
    np.testing.assert_array_equal(x, x0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_attention_kdim_vdim_gqa(rng, dtype):
    m = with_biases(MHA(24, 6, num_kv_heads=3, kdim=10, vdim=7, dtype=dtype, seed=2), rng)
    assert m.k_proj_weight.shape == (12, 10) and m.v_proj_weight.shape == (12, 7)
    x, kx, vx = (
        randn(rng, (3, 17, 24), dtype),
        randn(rng, (3, 129, 10), dtype),
        randn(rng, (3, 129, 7), dtype),
    )
    assert_close(m(x, kx, vx), transcription(m, x, kx, vx), dtype)
    # bottom-right causal for L != S
    assert_close(m(x, kx, vx, is_causal=True), transcription(m, x, kx, vx, is_causal=True), dtype)


def test_unbatched(rng):
    m = with_biases(MHA(16, 2, seed=3), rng)
    x, kx = randn(rng, (9, 16)), randn(rng, (13, 16))
    kpm = np.zeros(13, bool)
    kpm[10:] = True
    y, w = m(x, kx, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    assert y.shape == (9, 16) and w.shape == (2, 9, 13)
    assert_close(y, transcription(m, x, kx, mask=~kpm), np.float32)
    np.testing.assert_array_equal(y, m(x[None], kx[None], key_padding_mask=kpm[None])[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_masks_combined(rng, dtype):
    B, L, S, E, H = 2, 20, 50, 16, 4
    m = with_biases(MHA(E, H, dtype=dtype, seed=4), rng)
    x, kx = randn(rng, (B, L, E), dtype), randn(rng, (B, S, E), dtype)
    kpm = np.zeros((B, S), bool)
    kpm[0, 40:] = True
    kpm[1, :5] = True
    allowed = (~kpm)[:, None, None, :]
    bool_am = rng.random((L, S)) < 0.7
    float_am = randn(rng, (B, H, L, S), dtype)
    float_kpm = np.where(kpm, -np.inf, 0.0).astype(dtype)
    cases = [
        (dict(key_padding_mask=kpm), allowed),
        (dict(key_padding_mask=float_kpm), float_kpm[:, None, None, :]),
        (dict(attn_mask=bool_am), bool_am),
        (dict(attn_mask=bool_am, key_padding_mask=kpm), bool_am & allowed),
        (dict(attn_mask=float_am, key_padding_mask=kpm), float_am + float_kpm[:, None, None, :]),
        (
            dict(attn_mask=bool_am, key_padding_mask=float_kpm),
            np.where(bool_am, 0, -np.inf) + float_kpm[:, None, None, :],
        ),
        # torch's 3-D (B * num_heads, L, S) layout
        (dict(attn_mask=float_am.reshape(B * H, L, S)), float_am),
    ]
    for kw, mask in cases:
        assert_close(m(x, kx, **kw), transcription(m, x, kx, mask=mask), dtype, what=str(list(kw)))
        assert_close(
            m(x, kx, is_causal=True, **kw), transcription(m, x, kx, mask=mask, is_causal=True), dtype
        )


def test_need_weights_consistent(rng):
    B, L, S, E, H, Hk = 2, 11, 70, 24, 4, 2
    m = with_biases(MHA(E, H, num_kv_heads=Hk, dtype=np.float64, seed=5), rng)
    x, kx = randn(rng, (B, L, E), np.float64), randn(rng, (B, S, E), np.float64)
    kpm = np.zeros((B, S), bool)
    kpm[1, 30:] = True
    am = rng.random((L, S)) < 0.8
    am[3] = False  # a row with no key
    y, w = m(
        x,
        kx,
        key_padding_mask=kpm,
        attn_mask=am,
        is_causal=True,
        need_weights=True,
        average_attn_weights=False,
    )
    assert w.shape == (B, H, L, S)
    sums = w.sum(-1)
    np.testing.assert_allclose(np.delete(sums, 3, axis=-1), 1.0, atol=1e-12)
    assert np.all(w[:, :, 3] == 0) and np.all(y[:, 3] == (m.out_proj_bias))
    assert np.all(w[1, :, :, 30:] == 0)
    # The weights reproduce the output: out_proj(concat_h(w_h @ v_h)).
    v = (kx @ m.v_proj_weight.T + m.v_proj_bias).reshape(B, S, Hk, -1).transpose(0, 2, 1, 3)
    v = np.repeat(v, H // Hk, axis=1)
    o = (w @ v).transpose(0, 2, 1, 3).reshape(B, L, E)
    assert_close(y, o @ m.out_proj_weight.T + m.out_proj_bias, np.float64)
    y2, wa = m(x, kx, key_padding_mask=kpm, attn_mask=am, is_causal=True, need_weights=True)
    np.testing.assert_array_equal(y2, y)
    assert_close(wa, w.mean(axis=1), np.float64)


def test_no_lxs_allocation_without_weights(rng):
    L = S = 2048
    m = MHA(8, 1, seed=6)
    x = randn(rng, (1, L, 8))
    kpm = np.zeros((1, S), bool)
    kpm[0, 900:] = True
    m(x, key_padding_mask=kpm, is_causal=True)  # warm up
    tracemalloc.start()
    try:
        m(x, key_padding_mask=kpm, is_causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # projections take ~L * 8 * 4 * 6 bytes; even an L x S bool array would take L * S.
    assert peak < L * S // 2, f"peak {peak} bytes: an L x S buffer was allocated"


# --- weights ---------------------------------------------------------------------


def test_init_like_torch():
    E = 64
    m = MHA(E, 4, seed=0)
    w = np.concatenate([m.q_proj_weight, m.k_proj_weight, m.v_proj_weight])
    bound = math.sqrt(6.0 / (E + 3 * E))
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.05 * bound
    ob = 1 / math.sqrt(E)
    assert np.abs(m.out_proj_weight).max() <= ob and np.abs(m.out_proj_weight).max() > 0.99 * ob
    for b in (m.q_proj_bias, m.k_proj_bias, m.v_proj_bias, m.out_proj_bias):
        assert np.all(b == 0)
    c = MHA(E, 4, kdim=16, vdim=32, seed=0)
    assert np.abs(c.k_proj_weight).max() <= math.sqrt(6.0 / (E + 16))
    assert np.abs(c.v_proj_weight).max() > 0.99 * math.sqrt(6.0 / (E + 32))
    np.testing.assert_array_equal(MHA(E, 4, seed=0).q_proj_weight, m.q_proj_weight)
    assert not np.array_equal(MHA(E, 4, seed=1).q_proj_weight, m.q_proj_weight)
    assert MHA(E, 4, bias=False).q_proj_bias is None
    assert MHA(E, 4, dtype=np.float64).q_proj_weight.dtype == np.float64


def test_state_dict_round_trip(rng):
    for kw in (dict(), dict(kdim=5, vdim=6), dict(num_kv_heads=2), dict(bias=False)):
        a = with_biases(MHA(16, 4, seed=7, **kw), rng) if kw.get("bias", True) else MHA(16, 4, seed=7, **kw)
        sd = a.state_dict()
        assert ("in_proj_weight" in sd) == ("kdim" not in kw)
        b = MHA(16, 4, seed=8, **kw)
        b.load_state_dict(sd)
        x = randn(rng, (2, 5, 16))
        kx = randn(rng, (2, 7, kw.get("kdim", 16)))
        vx = randn(rng, (2, 7, kw.get("vdim", 16)))
        np.testing.assert_array_equal(a(x, kx, vx), b(x, kx, vx))
        sd["out_proj.weight"][:] = 0  # a copy: the module is unchanged
        assert np.any(a.out_proj_weight != 0)


# --- errors ------------------------------------------------------------------------


def test_bad_arguments(rng):
    with pytest.raises(ValueError, match="num_heads"):
        MHA(10, 3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MHA(12, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="embed_dim"):
        MHA(0, 1)
    with pytest.raises(TypeError, match="dtype"):
        MHA(8, 2, dtype=np.float16)
    with pytest.raises(TypeError, match="kdim"):
        MHA(8, 2, kdim=2.5)
    m = MHA(8, 2, seed=0)
    x = randn(rng, (2, 5, 8))
    with pytest.raises(ValueError, match="query"):
        m(randn(rng, (2, 5, 7)))
    with pytest.raises(ValueError, match="query"):
        m(randn(rng, (1, 2, 5, 8)))
    with pytest.raises(TypeError, match="query"):
        m(np.ones((2, 5, 8), np.int32))
    with pytest.raises(ValueError, match="key"):
        m(x, randn(rng, (2, 6, 9)))
    with pytest.raises(ValueError, match="batch"):
        m(x, randn(rng, (3, 6, 8)))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x, key_padding_mask=np.zeros((2, 4), bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        m(x, key_padding_mask=np.zeros((2, 5), np.int64))
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, attn_mask=np.ones((5, 4), bool))
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, attn_mask=np.ones((3, 2, 5, 5), bool))
    with pytest.raises(TypeError, match="attn_mask"):
        m(x, attn_mask=np.ones((5, 5), np.int8))
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, attn_mask=np.ones((4, 5, 4), bool))  # (B * H, L, S') with the wrong S'
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, attn_mask=np.ones((1, 1, 1, 5, 5), bool))
    c = MHA(8, 2, kdim=3, vdim=4, seed=0)
    with pytest.raises(ValueError, match="key"):
        c(x)
    with pytest.raises(ValueError, match="value"):
        c(x, randn(rng, (2, 6, 3)))
    with pytest.raises(ValueError, match="value given without key"):
        m(x, value=x)
    sd = m.state_dict()
    with pytest.raises(ValueError, match="missing"):
        m.load_state_dict({k: v for k, v in sd.items() if k != "in_proj_bias"})
    with pytest.raises(ValueError, match="in_proj_weight"):
        m.load_state_dict(dict(sd, in_proj_weight=np.zeros((24, 7))))
    with pytest.raises(ValueError, match="out_proj.weight"):
        m.load_state_dict({**sd, "out_proj.weight": np.zeros((8, 7))})


# --- against torch ------------------------------------------------------------------


def _torch_pair(E, H, *, kdim=None, vdim=None, bias=True, batch_first=True, dtype="float64"):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(
        E, H, kdim=kdim, vdim=vdim, bias=bias, batch_first=batch_first, dtype=getattr(torch, dtype)
    ).eval()
    if bias:
        with torch.no_grad():
            t.in_proj_bias.normal_()
            t.out_proj.bias.normal_()
    return torch, t, MHA.from_torch(t)


def _t(torch, a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


def test_torch_self_attention_key_padding(rng):
    torch, t, m = _torch_pair(16, 4)
    assert m.dtype == np.float64
    x = randn(rng, (3, 10, 16), np.float64)
    kpm = np.zeros((3, 10), bool)
    kpm[1, 7:] = True
    kpm[2, 2:4] = True
    with torch.no_grad():
        yt, wt = t(_t(torch, x), _t(torch, x), _t(torch, x), key_padding_mask=_t(torch, kpm))
        yt2, wt2 = t(
            _t(torch, x),
            _t(torch, x),
            _t(torch, x),
            key_padding_mask=_t(torch, kpm),
            average_attn_weights=False,
        )
    y, w = m(x, key_padding_mask=kpm, need_weights=True)
    assert_close(y, yt.numpy(), np.float64)
    assert_close(w, wt.numpy(), np.float64)
    _, w2 = m(x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    assert_close(w2, wt2.numpy(), np.float64)


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_causal(rng, batch_first):
    torch, t, m = _torch_pair(24, 3, batch_first=batch_first, dtype="float32")
    assert m.dtype == np.float32
    x = randn(rng, (2, 33, 24))
    L = x.shape[1]
    not_allowed = np.triu(np.ones((L, L), bool), 1)  # torch's polarity
    xt = _t(torch, x if batch_first else x.swapaxes(0, 1))
    with torch.no_grad():
        yt, wt = t(xt, xt, xt, attn_mask=_t(torch, not_allowed), is_causal=True)
    yt = yt.numpy() if batch_first else yt.numpy().swapaxes(0, 1)
    y, w = m(x, is_causal=True, need_weights=True)
    assert_close(y, yt, np.float32)
    assert_close(w, wt.numpy(), np.float32)
    # the same mask in fastattn's polarity (True = may attend)
    assert_close(m(x, attn_mask=~not_allowed), yt, np.float32)


def test_torch_cross_attention_kdim_vdim(rng):
    torch, t, m = _torch_pair(20, 4, kdim=6, vdim=9)
    assert "q_proj_weight" in m.state_dict()
    x, kx, vx = (
        randn(rng, (2, 17, 20), np.float64),
        randn(rng, (2, 97, 6), np.float64),
        randn(rng, (2, 97, 9), np.float64),
    )
    am = randn(rng, (17, 97), np.float64)
    kpm = np.zeros((2, 97), bool)
    kpm[0, 50:] = True
    with torch.no_grad():
        yt, wt = t(
            _t(torch, x),
            _t(torch, kx),
            _t(torch, vx),
            attn_mask=_t(torch, am),
            key_padding_mask=_t(torch, np.where(kpm, -np.inf, 0.0)),
            average_attn_weights=False,
        )
    y, w = m(x, kx, vx, attn_mask=am, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    assert_close(y, yt.numpy(), np.float64)
    assert_close(w, wt.numpy(), np.float64)


def test_torch_bool_attn_mask_polarity_and_unbatched(rng):
    torch, t, m = _torch_pair(16, 2, bias=False)
    x, kx = randn(rng, (12, 16), np.float64), randn(rng, (30, 16), np.float64)
    not_allowed = rng.random((12, 30)) < 0.4
    not_allowed[:, 0] = False
    with torch.no_grad():
        yt, _ = t(_t(torch, x), _t(torch, kx), _t(torch, kx), attn_mask=_t(torch, not_allowed))
    assert_close(m(x, kx, attn_mask=~not_allowed), yt.numpy(), np.float64)


def test_torch_load_our_state_dict(rng):
    torch = pytest.importorskip("torch")
    m = with_biases(MHA(16, 4, dtype=np.float64, seed=9), rng)
    t = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64).eval()
    t.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    x = randn(rng, (2, 9, 16), np.float64)
    with torch.no_grad():
        yt, _ = t(_t(torch, x), _t(torch, x), _t(torch, x), need_weights=False)
    assert_close(m(x), yt.numpy(), np.float64)


def test_torch_unsupported_module():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="add_bias_kv"):
        MHA.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="module"):
        MHA.from_torch(object())
