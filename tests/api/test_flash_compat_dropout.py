"""fastattn.flash_compat's attention dropout (flash-attn's ``dropout_p``).

Applied whenever ``dropout_p > 0``, as flash-attn's: outputs and gradients are
checked against the float64 reference with the seed the call drew (fastattn's
Philox mask, :func:`fastattn.reference.dropout_mask`); the seed comes from torch's
default generator for tensors (``torch.manual_seed`` reproduces a call) and from
NumPy's global generator for arrays; the backward regenerates the forward's mask.
flash-attn's tensors are ``(batch, seqlen, nheads, headdim)``: the reference runs
with ``layout="bshd"``; a packed (varlen) batch is compared through a zero-padded
batch with per-sequence lengths (the mask's batch is the sequence, its positions
those within the sequence)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, optional, randn
from test_flash_compat import _flash_kw

from fastattn import _flash_args
from fastattn import flash_compat as fc
from fastattn import reference as ref

torch = optional("torch")

P = 0.3
SEED = 0x1234_5678_9ABC_DEF0


def _torch_draw(s):
    """The seed a dropout call draws right after ``torch.manual_seed(s)``."""
    torch.manual_seed(s)
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


@pytest.fixture
def fixed_seed(monkeypatch):
    """Every dropout call uses SEED (and the draws are counted)."""
    calls = []

    def draw(torch_generator):
        calls.append(torch_generator)
        return SEED

    monkeypatch.setattr(_flash_args, "draw_seed", draw)
    return calls


def _ref_kw(case):
    kw = dict(is_causal=case.get("causal", False), enable_gqa=True, layout="bshd")
    if "window" in case:
        kw["window"] = case["window"]
    if "softcap" in case:
        kw["softcap"] = case["softcap"]
    if "alibi" in case:
        kw["alibi_slopes"] = case["alibi"]
    return kw


CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, Lq=23),  # bottom-right with fewer queries than keys
    dict(gqa=True),
    dict(gqa=True, causal=True),
    dict(window=(5, 3)),
    dict(softcap=4.0),
    dict(alibi=True, causal=True, gqa=True),
]


def _inputs(rng, case, dtype=np.float32):
    B, S, D = 2, 41, 16
    Lq = case.get("Lq", S)
    Hk, H = (2, 6) if case.get("gqa") else (3, 3)
    q, k, v = randn(rng, (B, Lq, H, D)), randn(rng, (B, S, Hk, D)), randn(rng, (B, S, Hk, D))
    case = dict(case)
    if case.get("alibi"):
        case["alibi"] = np.abs(randn(rng, (B, H))) * 0.3
    return q, k, v, case


def _ids(c):
    return "-".join(c) or "plain"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_and_gradients_match_the_reference(rng, case, fixed_seed):
    q, k, v, case = _inputs(rng, case)
    qt, kt, vt = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    out = fc.flash_attn_func(qt, kt, vt, dropout_p=P, **_flash_kw(case))
    assert fixed_seed == [True]  # one seed, from torch's generator
    kw = _ref_kw(case)
    want = ref.scaled_dot_product_attention(q, k, v, dropout_p=P, dropout_seed=SEED, **kw)
    assert_close(out.detach().numpy(), want, tol=2e-5)
    # dropout did something: the undropped output differs
    plain = ref.scaled_dot_product_attention(q, k, v, **kw)
    assert np.abs(want - plain).max() > 0.1
    g = randn(rng, tuple(out.shape))
    dq, dk, dv = torch.autograd.grad(out, (qt, kt, vt), torch.from_numpy(g))
    assert fixed_seed == [True]  # the backward reuses the forward's seed
    wq, wk, wv = ref.scaled_dot_product_attention_backward(g, q, k, v, dropout_p=P, dropout_seed=SEED, **kw)
    for got, exp, name in ((dq, wq, "dq"), (dk, wk, "dk"), (dv, wv, "dv")):
        assert_close(got.numpy(), exp, tol=5e-5, what=name)


def test_torch_manual_seed_reproduces_and_seeds_from_torch(rng):
    """The seed is the next draw of torch's default generator (as torch_compat draws it):
    the same torch seed gives the same output, bit for bit, another seed another mask."""
    q, k, v, _ = _inputs(rng, dict(gqa=True))
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    torch.manual_seed(7)
    a = fc.flash_attn_func(qt, kt, vt, dropout_p=P, causal=True)
    after = torch.rand(())
    torch.manual_seed(7)
    b = fc.flash_attn_func(qt, kt, vt, dropout_p=P, causal=True)
    assert torch.equal(a, b)
    assert torch.equal(torch.rand(()), after)  # exactly one draw per call
    c = fc.flash_attn_func(qt, kt, vt, dropout_p=P, causal=True)  # the generator moved on
    assert not torch.equal(a, c)
    want = ref.scaled_dot_product_attention(
        q, k, v, dropout_p=P, dropout_seed=_torch_draw(7), is_causal=True, enable_gqa=True, layout="bshd"
    )
    assert_close(a.numpy(), want, tol=2e-5)


def test_backward_uses_the_forwards_seed_when_the_generator_moves(rng):
    q, k, v, _ = _inputs(rng, dict(causal=True))
    qt, kt, vt = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    torch.manual_seed(11)
    out = fc.flash_attn_func(qt, kt, vt, dropout_p=P, causal=True)
    torch.manual_seed(12345)  # between forward and backward: no effect on the backward
    torch.rand(100)
    g = randn(rng, tuple(out.shape))
    out.backward(torch.from_numpy(g))
    seed = _torch_draw(11)
    kw = dict(is_causal=True, layout="bshd", dropout_p=P, dropout_seed=seed)
    wq, wk, wv = ref.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    for t, exp, name in ((qt, wq, "dq"), (kt, wk, "dk"), (vt, wv, "dv")):
        assert_close(t.grad.numpy(), exp, tol=5e-5, what=name)


def test_bfloat16_tensors(rng, fixed_seed):
    q, k, v, case = _inputs(rng, dict(causal=True, gqa=True))
    qt, kt, vt = (torch.from_numpy(a).to(torch.bfloat16).requires_grad_() for a in (q, k, v))
    out = fc.flash_attn_func(qt, kt, vt, dropout_p=P, causal=True)
    assert out.dtype == torch.bfloat16
    exact = [t.detach().double().numpy() for t in (qt, kt, vt)]
    kw = _ref_kw(case)
    want = ref.scaled_dot_product_attention(*exact, dropout_p=P, dropout_seed=SEED, **kw)
    assert_close(out.detach().double().numpy(), want, tol=3e-2)
    g = torch.from_numpy(randn(rng, tuple(out.shape))).to(torch.bfloat16)
    grads = torch.autograd.grad(out, (qt, kt, vt), g)
    wants = ref.scaled_dot_product_attention_backward(
        g.double().numpy(), *exact, dropout_p=P, dropout_seed=SEED, **kw
    )
    for got, exp, name in zip(grads, wants, ("dq", "dk", "dv")):
        assert got.dtype == torch.bfloat16
        assert_close(got.double().numpy(), exp, tol=5e-2, what=name)


def test_numpy_inputs_seed_from_numpys_generator(rng):
    q, k, v, _ = _inputs(rng, dict())
    np.random.seed(3)
    a = fc.flash_attn_func(q, k, v, dropout_p=P)
    np.random.seed(3)
    seed = int(np.random.randint(0, 2**63 - 1, dtype=np.int64))
    np.random.seed(3)
    b = fc.flash_attn_func(q, k, v, dropout_p=P)
    assert isinstance(a, np.ndarray) and np.array_equal(a, b)
    want = ref.scaled_dot_product_attention(q, k, v, dropout_p=P, dropout_seed=seed, layout="bshd")
    assert_close(a, want, tol=2e-5)


def test_packed_functions_use_the_same_mask(rng):
    B, S, H, D = 2, 19, 2, 16
    qkv = torch.from_numpy(randn(rng, (B, S, 3, H, D)))
    torch.manual_seed(5)
    a = fc.flash_attn_qkvpacked_func(qkv, dropout_p=P, causal=True)
    torch.manual_seed(5)
    b = fc.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p=P, causal=True)
    torch.manual_seed(5)
    c = fc.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], dropout_p=P, causal=True)
    assert torch.equal(a, b) and torch.equal(a, c)
    # the gradient reaches the packed tensor, with the forward's mask
    qkv_g = qkv.clone().requires_grad_()
    torch.manual_seed(5)
    out = fc.flash_attn_qkvpacked_func(qkv_g, dropout_p=P, causal=True)
    assert torch.equal(out.detach(), a)
    g = randn(rng, tuple(out.shape))
    out.backward(torch.from_numpy(g))
    x = qkv.numpy()
    want = ref.scaled_dot_product_attention_backward(
        g, x[:, :, 0], x[:, :, 1], x[:, :, 2], is_causal=True, layout="bshd", dropout_p=P,
        dropout_seed=_torch_draw(5),
    )  # fmt: skip
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_close(qkv_g.grad[:, :, i].numpy(), want[i], tol=5e-5, what=name)


# ------------------------------------------------------------------ varlen
VARLEN_CASES = [
    dict(),
    dict(causal=True),
    dict(window=(3, 2)),
    dict(causal=True, alibi=True),
    dict(softcap=3.0, gqa=True),
]


def _pad(x, cu, n):
    res = np.zeros((len(cu) - 1, n) + x.shape[1:], dtype=np.float64)
    for b in range(len(cu) - 1):
        res[b, : cu[b + 1] - cu[b]] = x[cu[b] : cu[b + 1]]
    return res


def _unpad(x, cu):
    return np.concatenate([x[b, : cu[b + 1] - cu[b]] for b in range(len(cu) - 1)])


@pytest.mark.parametrize("case", VARLEN_CASES, ids=_ids)
def test_varlen_forward_and_gradients_match_the_reference(rng, case, fixed_seed):
    """Sequence b's mask is batch element b's with positions within the sequence: a
    zero-padded batch with per-sequence lengths gives the same output and gradients."""
    lq, lk = np.array([5, 0, 33, 20, 4]), np.array([7, 3, 40, 20, 0])
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    Hk, H, D = (2, 4, 16) if case.get("gqa") else (2, 2, 16)
    q, k, v = randn(rng, (cq[-1], H, D)), randn(rng, (ck[-1], Hk, D)), randn(rng, (ck[-1], Hk, D))
    case = dict(case)
    if case.get("alibi"):
        case["alibi"] = np.abs(randn(rng, (len(lq), H))) * 0.3
    L, S = int(lq.max()), int(lk.max())
    qt, kt, vt = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    out = fc.flash_attn_varlen_func(qt, kt, vt, cq, ck, L, S, dropout_p=P, **_flash_kw(case))
    kw = dict(_ref_kw(case), query_lengths=lq, key_lengths=lk, dropout_p=P, dropout_seed=SEED)
    padded = (_pad(q, cq, L), _pad(k, ck, S), _pad(v, ck, S))
    want = _unpad(ref.scaled_dot_product_attention(*padded, **kw), cq)
    assert_close(out.detach().numpy(), want, tol=2e-5)
    g = randn(rng, tuple(out.shape))
    grads = torch.autograd.grad(out, (qt, kt, vt), torch.from_numpy(g))
    assert fixed_seed == [True]
    wants = ref.scaled_dot_product_attention_backward(_pad(g, cq, L), *padded, **kw)
    for got, exp, cu, name in zip(grads, wants, (cq, ck, ck), ("dq", "dk", "dv")):
        assert_close(got.numpy(), _unpad(exp, cu), tol=5e-5, what=name)
    # without autograd: the same forward
    with torch.no_grad():
        again = fc.flash_attn_varlen_func(qt, kt, vt, cq, ck, L, S, dropout_p=P, **_flash_kw(case))
    assert torch.equal(again, out.detach())


def test_varlen_packed_functions_use_the_same_mask(rng):
    cu = np.array([0, 6, 17], dtype=np.int32)
    qkv = torch.from_numpy(randn(rng, (17, 3, 2, 8)))
    torch.manual_seed(9)
    a = fc.flash_attn_varlen_qkvpacked_func(qkv, cu, 11, dropout_p=P, causal=True)
    torch.manual_seed(9)
    b = fc.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 11, 11, dropout_p=P, causal=True)
    torch.manual_seed(9)
    c = fc.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, 11, 11, dropout_p=P, causal=True)
    assert torch.equal(a, b) and torch.equal(a, c)


# ------------------------------------------------------- off, edges, errors
def test_dropout_p_zero_is_unchanged_and_draws_nothing(rng):
    q, k, v, _ = _inputs(rng, dict(causal=True))
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    state = torch.get_rng_state()
    a = fc.flash_attn_func(qt, kt, vt, dropout_p=0.0, causal=True)
    b = fc.flash_attn_func(qt, kt, vt, dropout_p=0, causal=True)
    c = fc.flash_attn_func(qt, kt, vt, causal=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, c) and torch.equal(b, c)


def test_dropout_p_one_drops_everything(rng):
    q, k, v, _ = _inputs(rng, dict())
    qt, kt, vt = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    out = fc.flash_attn_func(qt, kt, vt, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for t in (qt, kt, vt):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_refused_combinations(rng):
    q = torch.from_numpy(randn(rng, (1, 4, 2, 8)))
    cu = np.array([0, 4], dtype=np.int32)
    state = torch.get_rng_state()
    with pytest.raises(NotImplementedError, match="block_table"):
        pool = torch.zeros((1, 4, 2, 8))
        fc.flash_attn_varlen_func(
            q[0], pool, pool, cu, cu, 4, 4, dropout_p=0.1, block_table=np.zeros((1, 1), np.int32)
        )
    with pytest.raises(ValueError, match="head dim"):  # (a shape error)
        fc.flash_attn_func(q, q[..., :4], q, dropout_p=0.1)
    with pytest.raises(TypeError, match="same dtype"):
        fc.flash_attn_func(q.clone().requires_grad_(), q, q.double(), dropout_p=0.1)
    assert torch.equal(torch.get_rng_state(), state)  # a refused call draws no seed
    # return_attn_probs without dropout still returns the empty S_dmask
    _, _, s_dmask = fc.flash_attn_func(q, q, q, dropout_p=0.0, return_attn_probs=True)
    assert s_dmask.numel() == 0
    # flash_attn_with_kvcache has no dropout_p (nor has flash-attn's)
    with pytest.raises(TypeError, match="dropout_p"):
        fc.flash_attn_with_kvcache(q, torch.zeros((1, 8, 2, 8)), torch.zeros((1, 8, 2, 8)), dropout_p=0.1)


# flash-attn 2's key-block widths on sm80 with dropout (its _get_block_size_n), by head dim
_SM80_BLOCK_N = {32: 128, 64: 64, 128: 32, 160: 64}


def _decode_s_dmask(s_dmask, q, k, L, S, causal, window):
    """flash-attn's own decoding of S_dmask (tests/test_flash_attn.py's
    normalize_flash_attn_S, restated in float64 NumPy): the keep mask is the sign; the
    weights are |S| times exp(m - lse), m the maximum of the scores over the key's block
    and every later one.  Returns (weights, keep, visible)."""
    D = q.shape[-1]
    sc = np.einsum("blhd,bshd->bhls", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(D)
    i = np.arange(L)[:, None] + (S - L)
    j = np.arange(S)[None, :]
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    vis = np.ones((L, S), dtype=bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    sc = np.where(vis, sc, -np.inf)
    n = _SM80_BLOCK_N[D]
    nb = -(-S // n)
    pad = np.full(sc.shape[:-1] + (nb * n,), -np.inf)
    pad[..., :S] = sc
    bmax = pad.reshape(sc.shape[:-1] + (nb, n)).max(-1)
    m = np.repeat(np.maximum.accumulate(bmax[..., ::-1], -1)[..., ::-1], n, -1)[..., :S]
    with np.errstate(invalid="ignore"):
        lse = np.log(np.exp(sc - sc.max(-1, keepdims=True)).sum(-1, keepdims=True)) + sc.max(
            -1, keepdims=True
        )
    sd = np.asarray(s_dmask, dtype=np.float64)
    assert sd.shape[-2] % 128 == 0 and sd.shape[-1] % 128 == 0  # flash-attn's rounded shape
    sd = sd[..., :L, :S]
    w = np.where(vis, np.abs(sd) * np.exp(np.where(vis, m - lse, 0.0)), 0.0)
    return w, sd >= 0, np.broadcast_to(vis, w.shape)


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (False, (40, 7))])
def test_s_dmask_is_flash_attns_encoding_of_the_weights_and_the_mask(rng, fixed_seed, D, causal, window):
    """return_attn_probs with dropout: S_dmask decodes, by flash-attn's own rule, to the
    float64 reference weights and to fastattn's dropout mask, and that mask is the one
    the output was computed with."""
    B, L, S, H = 2, 70, 150, 3
    q, k, v = (randn(rng, (B, n, H, D)) for n in (L, S, S))
    kw = dict(causal=causal, window_size=window or (-1, -1), return_attn_probs=True)
    out, lse, s_dmask = fc.flash_attn_func(q, k, v, P, **kw)
    assert s_dmask.shape == (B, H, 128, 256) and s_dmask.dtype == q.dtype
    w, keep, vis = _decode_s_dmask(s_dmask, q, k, L, S, causal, window)
    rkw = dict(is_causal=causal, layout="bshd", window=window)
    assert_close(w, ref.attention_weights(q, k, **rkw), tol=1e-5, what="weights")
    mask = ref.dropout_mask((B, H, L, S), P, SEED)
    assert np.array_equal(keep[vis], mask[vis])
    assert_close(out, np.einsum("bhls,bshd->blhd", w * keep / (1 - P), v), tol=1e-5)
    # the packed call encodes each sequence's rows at its own positions
    cu_q, cu_k = np.array([0, L, 2 * L], np.int32), np.array([0, S, 2 * S], np.int32)
    _, _, s_var = fc.flash_attn_varlen_func(
        q.reshape(-1, H, D), k.reshape(-1, H, D), v.reshape(-1, H, D), cu_q, cu_k, L, S, P, **kw
    )
    assert s_var.shape == s_dmask.shape
    for b in range(B):
        wb, kb, _ = _decode_s_dmask(s_var[b : b + 1], q[b : b + 1], k[b : b + 1], L, S, causal, window)
        assert_close(wb, w[b : b + 1], tol=1e-6, what="packed weights")
        mb = ref.dropout_mask((1, H, L, S), P, SEED, batch_offset=b)
        assert np.array_equal(kb[vis[:1]], mb[vis[:1]])


def test_s_dmask_with_gradients_and_bfloat16(rng, fixed_seed):
    """A tensor that requires grad still gets S_dmask (bfloat16, as flash-attn's tests call it);
    the output stays differentiable."""
    q, k, v = (torch.from_numpy(randn(rng, (1, 40, 2, 64))).to(torch.bfloat16) for _ in range(3))
    q.requires_grad_()
    out, _, s_dmask = fc.flash_attn_func(q, k, v, P, causal=True, return_attn_probs=True)
    assert s_dmask.dtype == torch.bfloat16 and s_dmask.shape == (1, 2, 128, 128)
    w, keep, vis = _decode_s_dmask(
        s_dmask.float().numpy(), q.detach().float().numpy(), k.float().numpy(), 40, 40, True, None
    )
    qf, kf = q.detach().float().numpy(), k.float().numpy()
    assert_close(w, ref.attention_weights(qf, kf, is_causal=True, layout="bshd"), tol=1e-2, what="weights")
    assert np.array_equal(keep[vis], ref.dropout_mask((1, 2, 40, 40), P, SEED)[vis])
    out.float().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize(
    ("p", "error"),
    [
        (-0.1, ValueError),
        (1.5, ValueError),
        (float("nan"), ValueError),
        ("0.1", TypeError),
        (True, TypeError),
    ],
)
def test_bad_dropout_p(rng, p, error):
    q = randn(rng, (1, 4, 2, 8))
    cu = np.array([0, 4], dtype=np.int32)
    with pytest.raises(error, match="dropout_p"):
        fc.flash_attn_func(q, q, q, dropout_p=p)
    with pytest.raises(error, match="dropout_p"):
        fc.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, dropout_p=p)
