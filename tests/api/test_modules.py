"""MultiHeadAttention against a plain NumPy transcription (projections + the
float64 reference attention) and, when torch is installed, against
torch.nn.MultiheadAttention with the same weights: batch_first both ways,
bool (True = NOT allowed) and float masks, key padding, cross-attention with
kdim/vdim, weights averaged or not, torch's positional argument order."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from conftest import assert_close, optional, randn

import fastattn
from fastattn import reference as ref

MHA = fastattn.MultiHeadAttention


def transcription(m, query, key=None, value=None, mask=None, is_causal=False):
    """float64 NumPy on batch-first ``(B, L, E)`` inputs: project, split heads,
    reference attention (``mask`` in fastattn's functional convention, bool
    True = may attend, broadcastable to (B, H, L, S); ``is_causal`` the
    reference's bottom-right alignment), merge, project."""
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
    m = with_biases(MHA(32, 4, num_kv_heads=num_kv_heads, batch_first=True, dtype=dtype, seed=1), rng)
    x = randn(rng, (2, 37, 32), dtype)
    x0 = x.copy()
    y, w = m(x, is_causal=causal, need_weights=False)
    assert w is None
    assert y.shape == (2, 37, 32) and y.dtype == dtype
    assert_close(y, transcription(m, x, is_causal=causal), dtype)
    np.testing.assert_array_equal(x, x0)


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_batch_first_false_is_sequence_major(rng, num_kv_heads):
    """batch_first=False (the default, as torch): (L, B, E) in and out, the same numbers."""
    bf = with_biases(MHA(24, 4, num_kv_heads=num_kv_heads, kdim=10, vdim=6, batch_first=True, seed=3), rng)
    sf = MHA(24, 4, num_kv_heads=num_kv_heads, kdim=10, vdim=6, seed=4)
    assert sf.batch_first is False and bf.batch_first is True
    sf.load_state_dict(bf.state_dict())
    x, kx, vx = randn(rng, (3, 11, 24)), randn(rng, (3, 19, 10)), randn(rng, (3, 19, 6))
    kpm = rng.random((3, 19)) < 0.3
    kpm[:, 0] = False
    am = rng.random((11, 19)) < 0.2
    y, w = bf(x, kx, vx, kpm, True, am, False)
    ys, ws = sf(x.swapaxes(0, 1), kx.swapaxes(0, 1), vx.swapaxes(0, 1), kpm, True, am, False)
    assert ys.shape == (11, 3, 24) and ws.shape == (3, 4, 11, 19)
    assert_close(ys.swapaxes(0, 1), y, np.float32)
    assert_close(ws, w, np.float32)
    expect = transcription(bf, x, kx, vx, mask=~am & ~kpm[:, None, None, :])
    assert_close(y, expect, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_attention_kdim_vdim_gqa(rng, dtype):
    m = with_biases(MHA(24, 6, num_kv_heads=3, kdim=10, vdim=7, batch_first=True, dtype=dtype, seed=2), rng)
    assert m.k_proj_weight.shape == (12, 10) and m.v_proj_weight.shape == (12, 7)
    x, kx, vx = (
        randn(rng, (3, 17, 24), dtype),
        randn(rng, (3, 129, 10), dtype),
        randn(rng, (3, 129, 7), dtype),
    )
    assert_close(m(x, kx, vx)[0], transcription(m, x, kx, vx), dtype)
    # is_causal with L != S: torch's top-left triangle (query i sees keys j <= i), both L < S and L > S
    for L, S in ((17, 129), (17, 5)):
        y, w = m(x[:, :L], kx[:, :S], vx[:, :S], is_causal=True)
        tri = np.tri(L, S, dtype=bool)
        assert_close(y, transcription(m, x[:, :L], kx[:, :S], vx[:, :S], mask=tri), dtype)
        assert np.all(w[:, ~tri] == 0)


def test_unbatched(rng):
    for batch_first in (False, True):
        m = with_biases(MHA(16, 2, batch_first=batch_first, seed=3), rng)
        x, kx = randn(rng, (9, 16)), randn(rng, (13, 16))
        kpm = np.zeros(13, bool)
        kpm[10:] = True
        y, w = m(x, kx, key_padding_mask=kpm, average_attn_weights=False)
        assert y.shape == (9, 16) and w.shape == (2, 9, 13)
        assert_close(y, transcription(m, x, kx, mask=~kpm), np.float32)
        xb, kb = (x[None], kx[None]) if batch_first else (x[:, None], kx[:, None])
        yb, wb = m(xb, kb, key_padding_mask=kpm[None], average_attn_weights=False)
        np.testing.assert_array_equal(y, yb[0] if batch_first else yb[:, 0])
        np.testing.assert_array_equal(w, wb[0])
        # unbatched (num_heads, L, S) attn_mask, torch's 3-D form
        am = rng.random((2, 9, 13)) < 0.3
        am[..., 0] = False
        assert_close(m(x, kx, attn_mask=am)[0], transcription(m, x, kx, mask=~am), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_masks_combined(rng, dtype):
    """torch's polarity: bool True = NOT allowed in both masks; floats added."""
    B, L, S, E, H = 2, 20, 50, 16, 4
    m = with_biases(MHA(E, H, batch_first=True, dtype=dtype, seed=4), rng)
    x, kx = randn(rng, (B, L, E), dtype), randn(rng, (B, S, E), dtype)
    kpm = np.zeros((B, S), bool)
    kpm[0, 40:] = True
    kpm[1, :5] = True
    allowed = (~kpm)[:, None, None, :]
    blocked = rng.random((L, S)) >= 0.7  # torch's bool attn_mask: True = NOT allowed
    may = ~blocked  # the same mask in the functional API's polarity
    float_am = randn(rng, (B, H, L, S), dtype)
    float_kpm = np.where(kpm, -np.inf, 0.0).astype(dtype)
    cases = [
        (dict(key_padding_mask=kpm), allowed),
        (dict(key_padding_mask=float_kpm), float_kpm[:, None, None, :]),
        (dict(attn_mask=blocked), may),
        (dict(attn_mask=blocked, key_padding_mask=kpm), may & allowed),
        (dict(attn_mask=float_am, key_padding_mask=kpm), float_am + float_kpm[:, None, None, :]),
        (
            dict(attn_mask=blocked, key_padding_mask=float_kpm),
            np.where(may, 0, -np.inf) + float_kpm[:, None, None, :],
        ),
        # torch's 3-D (B * num_heads, L, S) layout
        (dict(attn_mask=float_am.reshape(B * H, L, S)), float_am),
        (dict(attn_mask=np.broadcast_to(blocked, (B * H, L, S))), may),
    ]
    for kw, mask in cases:
        y, _ = m(x, kx, need_weights=False, **kw)
        assert_close(y, transcription(m, x, kx, mask=mask), dtype, what=str(list(kw)))
        # is_causal with L != S: torch's top-left triangle on top of the masks
        tri = np.tri(L, S, dtype=bool)
        causal = mask & tri if mask.dtype == bool else mask + np.where(tri, 0, -np.inf)
        y, _ = m(x, kx, need_weights=False, is_causal=True, **kw)
        assert_close(y, transcription(m, x, kx, mask=causal), dtype)


def test_need_weights_consistent(rng):
    B, L, S, E, H, Hk = 2, 11, 70, 24, 4, 2
    m = with_biases(MHA(E, H, num_kv_heads=Hk, batch_first=True, dtype=np.float64, seed=5), rng)
    x, kx = randn(rng, (B, L, E), np.float64), randn(rng, (B, S, E), np.float64)
    kpm = np.zeros((B, S), bool)
    kpm[1, 30:] = True
    blocked = rng.random((L, S)) >= 0.8
    blocked[3] = True  # a row with no key
    y, w = m(
        x,
        kx,
        key_padding_mask=kpm,
        attn_mask=blocked,
        is_causal=True,
        need_weights=True,
        average_attn_weights=False,
    )
    assert w.shape == (B, H, L, S)
    sums = w.sum(-1)
    np.testing.assert_allclose(np.delete(sums, 3, axis=-1), 1.0, atol=1e-12)
    assert np.all(w[:, :, 3] == 0) and np.all(y[:, 3] == (m.out_proj_bias))
    assert np.all(w[1, :, :, 30:] == 0)
    assert np.all(w[:, :, ~np.tri(L, S, dtype=bool)] == 0)  # top-left causal for L != S
    # The weights reproduce the output: out_proj(concat_h(w_h @ v_h)).
    v = (kx @ m.v_proj_weight.T + m.v_proj_bias).reshape(B, S, Hk, -1).transpose(0, 2, 1, 3)
    v = np.repeat(v, H // Hk, axis=1)
    o = (w @ v).transpose(0, 2, 1, 3).reshape(B, L, E)
    assert_close(y, o @ m.out_proj_weight.T + m.out_proj_bias, np.float64)
    y2, wa = m(x, kx, key_padding_mask=kpm, attn_mask=blocked, is_causal=True)  # need_weights=True default
    np.testing.assert_array_equal(y2, y)
    assert_close(wa, w.mean(axis=1), np.float64)


def test_no_lxs_allocation_without_weights(rng):
    L = S = 2048
    m = MHA(8, 1, batch_first=True, seed=6)
    x = randn(rng, (1, L, 8))
    kpm = np.zeros((1, S), bool)
    kpm[0, 900:] = True
    m(x, key_padding_mask=kpm, is_causal=True, need_weights=False)  # warm up
    tracemalloc.start()
    try:
        _, w = m(x, key_padding_mask=kpm, is_causal=True, need_weights=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert w is None
    # projections take ~L * 8 * 4 * 6 bytes; even an L x S bool array would take L * S.
    assert peak < L * S // 2, f"peak {peak} bytes: an L x S buffer was allocated"


# --- precision ---------------------------------------------------------------------

# The ISA paths on which the float32 level changes results (>= 32 query rows per key/value head).
LEVELS_APPLY = fastattn.get_isa() in ("amx", "avx512bf16")


def test_precision_passes_through(rng):
    """precision= reaches the kernel: MHA(precision="medium") is the hand-made projections,
    the direct call at "medium" and the output projection, bit for bit; it equals the
    process default "medium"; and where the level changes results it differs from "highest"."""
    B, L, S, E, H, Hk = 2, 64, 80, 64, 4, 2  # 64 queries x 2 heads per key/value head
    m = with_biases(MHA(E, H, num_kv_heads=Hk, batch_first=True, seed=9), rng)
    x, kx = randn(rng, (B, L, E)), randn(rng, (B, S, E))

    def lin(a, w, b):  # as the module projects: one GEMM over all tokens, bias added
        y = np.matmul(a.reshape(-1, a.shape[-1]), w.T)
        y += b
        return y.reshape(a.shape[:-1] + (-1,))

    q = lin(x, m.q_proj_weight, m.q_proj_bias).reshape(B, L, H, -1)
    k = lin(kx, m.k_proj_weight, m.k_proj_bias).reshape(B, S, Hk, -1)
    v = lin(kx, m.v_proj_weight, m.v_proj_bias).reshape(B, S, Hk, -1)
    got = {}
    for prec in ("medium", "highest"):
        o = fastattn.scaled_dot_product_attention(q, k, v, enable_gqa=True, layout="bshd", precision=prec)
        want = lin(o.reshape(B, L, E), m.out_proj_weight, m.out_proj_bias)
        got[prec], w = m(x, kx, need_weights=False, precision=prec)
        assert w is None
        np.testing.assert_array_equal(got[prec], want)
    default = fastattn.get_float32_matmul_precision()
    fastattn.set_float32_matmul_precision("medium")
    try:
        by_default, _ = m(x, kx, need_weights=False)
    finally:
        fastattn.set_float32_matmul_precision(default)
    np.testing.assert_array_equal(by_default, got["medium"])
    np.testing.assert_array_equal(m(x, kx, need_weights=False)[0], got["highest"])  # default restored
    assert_close(got["medium"], transcription(m, x, kx), np.float32, tol=3e-2)


@pytest.mark.skipif(
    not LEVELS_APPLY, reason=f"the {fastattn.get_isa()!r} path computes every float32 level as 'highest'"
)
def test_precision_medium_differs_from_highest(rng):
    """Where the level changes results (amx, avx512bf16), "medium" is not "highest":
    the value reached the kernel (the test above shows that it is the value given)."""
    m = MHA(64, 4, num_kv_heads=2, seed=10)  # (L, B, E): sequence-major strided views
    x = randn(rng, (64, 2, 64))
    med, _ = m(x, need_weights=False, precision="medium")
    hi, _ = m(x, need_weights=False, precision="highest")
    assert_close(med, hi, np.float32, tol=3e-2)
    assert np.abs(med - hi).max() > 1e-5


def test_bad_precision_raises_before_any_work(rng, monkeypatch):
    m = MHA(8, 2, batch_first=True, seed=0)
    x = randn(rng, (2, 5, 8))
    # checked first: the projections and the kernel never run
    monkeypatch.setattr(m, "_project", lambda *a: pytest.fail("projected before checking precision"))
    with pytest.raises(ValueError, match="precision"):
        m(x, precision="low")
    with pytest.raises(ValueError, match="precision"):
        m(x, precision="HIGHEST")
    with pytest.raises(TypeError, match="precision"):
        m(x, precision=2)


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
        a = MHA(16, 4, batch_first=True, seed=7, **kw)
        a = with_biases(a, rng) if kw.get("bias", True) else a
        sd = a.state_dict()
        assert ("in_proj_weight" in sd) == ("kdim" not in kw)
        b = MHA(16, 4, batch_first=True, seed=8, **kw)
        b.load_state_dict(sd)
        x = randn(rng, (2, 5, 16))
        kx = randn(rng, (2, 7, kw.get("kdim", 16)))
        vx = randn(rng, (2, 7, kw.get("vdim", 16)))
        np.testing.assert_array_equal(a(x, kx, vx)[0], b(x, kx, vx)[0])
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
    with pytest.raises(TypeError, match="batch_first"):
        MHA(8, 2, batch_first="yes")
    with pytest.raises(TypeError, match="batch_first"):
        MHA(8, 2, batch_first=1)
    m = MHA(8, 2, batch_first=True, seed=0)
    x = randn(rng, (2, 5, 8))
    # torch's positional order: (query, key, value, key_padding_mask, need_weights, attn_mask, ...)
    with pytest.raises(TypeError, match="need_weights"):
        m(x, x, x, None, np.ones((5, 5), bool))  # a mask where need_weights goes
    with pytest.raises(TypeError, match="average_attn_weights"):
        m(x, average_attn_weights=None)
    with pytest.raises(TypeError, match="is_causal"):
        m(x, is_causal="true")
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
    c = MHA(8, 2, kdim=3, vdim=4, batch_first=True, seed=0)
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
    torch = optional("torch")
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(
        E, H, kdim=kdim, vdim=vdim, bias=bias, batch_first=batch_first, dtype=getattr(torch, dtype)
    ).eval()
    if bias:
        with torch.no_grad():
            t.in_proj_bias.normal_()
            t.out_proj.bias.normal_()
    m = MHA.from_torch(t)
    assert m.batch_first is batch_first
    return torch, t, m


def _t(torch, a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


def _both(torch, t, m, *args, **kw):
    """Call torch's module and ours with the same (NumPy) arguments; return both results as NumPy."""
    targs = [_t(torch, a) if isinstance(a, np.ndarray) else a for a in args]
    tkw = {k: _t(torch, a) if isinstance(a, np.ndarray) else a for k, a in kw.items()}
    with torch.no_grad():
        yt, wt = t(*targs, **tkw)
    y, w = m(*args, **kw)
    assert (w is None) == (wt is None)
    return (y, w), (yt.numpy(), None if wt is None else wt.numpy())


MASKS = ["none", "attn bool", "attn float", "attn 3d", "kpm bool", "kpm float", "both bool", "both float"]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("average", [True, False])
def test_torch_parity_self_attention(rng, batch_first, masks, average):
    B, L, E, H = 3, 10, 16, 4
    torch, t, m = _torch_pair(E, H, batch_first=batch_first)
    x = randn(rng, (B, L, E) if batch_first else (L, B, E), np.float64)
    blocked = rng.random((L, L)) < 0.3  # True = NOT allowed (torch's and ours)
    blocked[:, 0] = False
    kpm = np.zeros((B, L), bool)
    kpm[1, 7:] = True
    kpm[2, 2:4] = True
    kw = {}
    if masks in ("attn bool", "both bool"):
        kw["attn_mask"] = blocked
    if masks in ("attn float", "both float"):
        kw["attn_mask"] = randn(rng, (L, L), np.float64)
    if masks == "attn 3d":
        kw["attn_mask"] = np.where(
            rng.random((B * H, L, L)) < 0.3, -np.inf, randn(rng, (B * H, L, L), np.float64)
        )
        kw["attn_mask"][..., 0] = 0.5
    if masks in ("kpm bool", "both bool"):
        kw["key_padding_mask"] = kpm
    if masks in ("kpm float", "both float"):
        kw["key_padding_mask"] = np.where(kpm, -np.inf, randn(rng, (B, L), np.float64))
    (y, w), (yt, wt) = _both(torch, t, m, x, x, x, average_attn_weights=average, **kw)
    assert y.shape == yt.shape and w.shape == wt.shape
    assert_close(y, yt, np.float64)
    assert_close(w, wt, np.float64)
    (y2, w2), (yt2, wt2) = _both(torch, t, m, x, x, x, need_weights=False, **kw)
    assert w2 is None
    assert_close(y2, yt2, np.float64)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("average", [True, False])
def test_torch_parity_cross_attention_kdim_vdim(rng, batch_first, average):
    torch, t, m = _torch_pair(20, 4, kdim=6, vdim=9, batch_first=batch_first)
    assert "q_proj_weight" in m.state_dict()
    B, L, S = 2, 17, 97

    def seq(n, f):
        return randn(rng, (B, n, f) if batch_first else (n, B, f), np.float64)

    x, kx, vx = seq(L, 20), seq(S, 6), seq(S, 9)
    am = randn(rng, (L, S), np.float64)
    kpm = np.zeros((B, S), bool)
    kpm[0, 50:] = True
    (y, w), (yt, wt) = _both(
        torch, t, m, x, kx, vx, np.where(kpm, -np.inf, 0.0), True, am, average
    )  # torch's positional order
    assert_close(y, yt, np.float64)
    assert_close(w, wt, np.float64)
    blocked = rng.random((L, S)) < 0.5
    blocked[:, :3] = False
    (y, w), (yt, wt) = _both(
        torch, t, m, x, kx, vx, key_padding_mask=kpm, attn_mask=blocked, average_attn_weights=average
    )
    assert_close(y, yt, np.float64)
    assert_close(w, wt, np.float64)


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_causal(rng, batch_first):
    torch, t, m = _torch_pair(24, 3, batch_first=batch_first, dtype="float32")
    assert m.dtype == np.float32
    L = 33
    x = randn(rng, (2, L, 24) if batch_first else (L, 2, 24))
    not_allowed = np.triu(np.ones((L, L), bool), 1)  # torch's polarity, and ours
    (y, w), (yt, wt) = _both(torch, t, m, x, x, x, attn_mask=not_allowed, is_causal=True)
    assert_close(y, yt, np.float32)
    assert_close(w, wt, np.float32)
    # torch requires the mask with is_causal; here the flag alone applies the same triangle
    y2, w2 = m(x, x, x, is_causal=True)
    assert_close(y2, yt, np.float32)
    assert_close(w2, wt, np.float32)
    (y3, _), (yt3, _) = _both(torch, t, m, x, x, x, need_weights=False, attn_mask=not_allowed, is_causal=True)
    assert_close(y3, yt3, np.float32)


def test_torch_unbatched(rng):
    torch, t, m = _torch_pair(16, 2, bias=False, batch_first=False)
    x, kx = randn(rng, (12, 16), np.float64), randn(rng, (30, 16), np.float64)
    not_allowed = rng.random((12, 30)) < 0.4
    not_allowed[:, 0] = False
    kpm = np.zeros(30, bool)
    kpm[20:] = True
    for kw in (dict(attn_mask=not_allowed), dict(key_padding_mask=kpm, average_attn_weights=False)):
        (y, w), (yt, wt) = _both(torch, t, m, x, kx, kx, **kw)
        assert y.shape == (12, 16)
        assert_close(y, yt, np.float64)
        assert_close(w, wt, np.float64)


def test_torch_load_our_state_dict(rng):
    torch = optional("torch")
    m = with_biases(MHA(16, 4, dtype=np.float64, seed=9), rng)
    t = torch.nn.MultiheadAttention(16, 4, dtype=torch.float64).eval()  # both batch_first=False
    t.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    x = randn(rng, (9, 2, 16), np.float64)
    (y, w), (yt, wt) = _both(torch, t, m, x, x, x)
    assert_close(y, yt, np.float64)
    assert_close(w, wt, np.float64)


def test_torch_unsupported_module():
    torch = optional("torch")
    with pytest.raises(ValueError, match="add_bias_kv"):
        MHA.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="module"):
        MHA.from_torch(object())
