"""Attention dropout through torch: fastattn.torch_compat's scaled_dot_product_attention
(eager, torch.compile) and fastattn.hf (a BERT trained in train() mode), against
torch autograd of the explicit formula with fastattn's mask
(fastattn.reference.dropout_mask, NumPy's Philox) and the seed drawn from torch's
generator, reproducibility under torch.manual_seed, and refusals."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import optional

from fastattn import reference as ref

torch = optional("torch")
F = torch.nn.functional
import fastattn.torch_compat as tc  # noqa: E402


def drawn_seed(s):
    """The seed fastattn draws after torch.manual_seed(s): its first call's."""
    torch.manual_seed(s)
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def explicit(q, k, v, p, seed, mask=None, causal=False, gqa=False):
    """torch operations: softmax(q k^T / sqrt(D) + mask) times fastattn's keep mask / (1 - p), times v."""
    if gqa:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    L, S = s.shape[-2:]
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    w = torch.softmax(s.double(), -1).to(q.dtype)
    keep = torch.from_numpy(ref.dropout_mask(tuple(s.shape), p, seed))
    return (w * keep / (1 - p)) @ v


@pytest.mark.parametrize(
    "Hq,Hk,L,S,kind",
    [(2, 2, 40, 40, "causal"), (4, 2, 24, 70, "causal"), (2, 2, 33, 50, "bool"), (2, 1, 17, 90, "float"),
     (2, 2, 1, 64, "none")],
)  # fmt: skip
def test_forward_and_gradients_equal_explicit(Hq, Hk, L, S, kind):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, Hq, L, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, Hk, S, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, Hk, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mask = None
    if kind == "bool":
        mask = torch.rand(2, 1, L, S, generator=g) < 0.8
        mask[..., 0] = True
    elif kind == "float":
        mask = torch.randn(L, S, generator=g, dtype=torch.float64)
    p, gqa, causal = 0.3, Hq != Hk, kind == "causal"
    torch.manual_seed(11)
    out = tc.scaled_dot_product_attention(q, k, v, mask, dropout_p=p, is_causal=causal, enable_gqa=gqa)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), go)
    want = explicit(q, k, v, p, drawn_seed(11), mask, causal, gqa)
    wgrads = torch.autograd.grad(want, (q, k, v), go)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_float32_and_bfloat16():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 30, 32, generator=g) for _ in range(3))
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        a = [t.detach().to(dt).clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)
        out = tc.scaled_dot_product_attention(*a, dropout_p=0.2, is_causal=True)
        assert out.dtype == dt
        want = explicit(*(t.detach().double() for t in a), 0.2, drawn_seed(5), causal=True)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        out.sum().backward()
        assert all(t.grad is not None and t.grad.dtype == dt for t in a)


def test_reproducible_with_manual_seed_and_fresh_per_call():
    q = torch.randn(1, 2, 20, 16)
    torch.manual_seed(0)
    a = tc.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    b = tc.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.manual_seed(0)
    np.testing.assert_array_equal(a.numpy(), tc.scaled_dot_product_attention(q, q, q, dropout_p=0.5).numpy())
    assert not torch.equal(a, b)  # each call draws its own mask
    torch.testing.assert_close(
        tc.scaled_dot_product_attention(q, q, q, dropout_p=0.0), F.scaled_dot_product_attention(q, q, q)
    )
    # unbiased: the mean over many masks approaches the undropped output
    # (each entry within 5 standard errors of the sample mean; the draws are seeded)
    samples = torch.stack([tc.scaled_dot_product_attention(q, q, q, dropout_p=0.5) for _ in range(400)])
    err = (samples.mean(0) - F.scaled_dot_product_attention(q, q, q)).abs()
    assert (err <= 5 * samples.std(0) / 400**0.5 + 1e-6).all()


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_refuses_dropout(randomness):
    q = torch.randn(3, 2, 5, 8)
    f = lambda x: tc.scaled_dot_product_attention(x, x, x, dropout_p=0.1)  # noqa: E731
    with pytest.raises(NotImplementedError, match="vmap"):
        torch.func.vmap(f, randomness=randomness)(q)


def test_compiled_dropout_runs_forward_and_backward():
    """Under torch.compile the seed is a tensor input of the custom op, drawn in
    the graph: a fresh mask per call, the backward on the forward's mask (p = 1
    zeroes output and gradients; p = 0.5 matches the explicit formula for the
    seed the op received)."""
    seen = []
    real = tc._seed_int

    def spy(seed):
        seen.append(real(seed))
        return seen[-1]

    def f(q, k, v, p):
        return tc.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

    g = torch.Generator().manual_seed(6)
    q, k, v = (
        torch.randn(1, 2, 24, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tc, "_seed_int", spy)
        out = cf(q, k, v, 0.5)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        out2 = cf(q, k, v, 0.5)
    want = explicit(q, k, v, 0.5, seen[0], causal=True)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    for a, b in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    assert (
        seen[0] == seen[1] and seen[2] != seen[0]
    )  # forward and backward share one; the next call draws anew
    assert not torch.equal(out, out2)
    zero = cf(q, k, v, 1.0)
    assert torch.equal(zero, torch.zeros_like(zero))


def test_opcheck_with_seed():
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    torch.library.opcheck(
        torch.ops.fastattn.sdpa.default, (q, k, v, None, True, None, False, "highest", 0.3, torch.tensor(5))
    )


transformers = None


def _bert():
    global transformers
    transformers = optional("transformers")
    optional("transformers.masking_utils")
    import fastattn.hf

    fastattn.hf.register()
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.25,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertModel(cfg).double().train()


def test_bert_training_step_equals_eager_with_the_same_masks(monkeypatch):
    """A BERT in train() mode with attention dropout (padded batch): loss and
    parameter gradients through fastattn equal transformers' eager backend whose
    attention dropout is given fastattn's mask for the same seeds (drawn from
    torch's generator in the same order, one per layer and call)."""
    model = _bert()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (3, 12), generator=g)
    att = torch.ones(3, 12, dtype=torch.long)
    att[1, 8:] = 0
    att[2, 5:] = 0
    real_dropout = F.dropout

    def fastattn_mask_dropout(x, p=0.5, training=True, inplace=False):
        if p == 0 or not training:
            return real_dropout(x, p, training, inplace)
        seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
        keep = torch.from_numpy(ref.dropout_mask(tuple(x.shape), p, seed))
        return x * keep / (1 - p)

    results = {}
    for impl in ("eager", "fastattn"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        with monkeypatch.context() as mp:
            if impl == "eager":
                mp.setattr(F, "dropout", fastattn_mask_dropout)
            torch.manual_seed(9)
            h = model(input_ids=ids, attention_mask=att).last_hidden_state
        loss = (h * att[..., None]).square().sum()
        loss.backward()
        results[impl] = (
            loss.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
    torch.testing.assert_close(results["fastattn"][0], results["eager"][0], atol=1e-9, rtol=1e-9)
    for n, gr in results["eager"][1].items():
        torch.testing.assert_close(results["fastattn"][1][n], gr, atol=1e-8, rtol=1e-7, msg=n)
    # and the dropout is real: eval mode differs from train mode
    model.eval()
    with torch.no_grad():
        e = model(input_ids=ids, attention_mask=att).last_hidden_state
    assert not torch.allclose(e, h.detach())
