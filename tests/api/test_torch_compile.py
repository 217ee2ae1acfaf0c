"""fastattn.torch_compat under torch.compile(fullgraph=True): the custom ops
fastattn::sdpa / fastattn::sdpa_backward keep the call in the graph, and the
compiled outputs and gradients match torch's own SDPA (eager).  Skipped
without torch."""

from __future__ import annotations

import pytest
from conftest import optional

torch = optional("torch")
F = torch.nn.functional
tc = optional("fastattn.torch_compat")

TOL = {torch.float32: 2e-4, torch.float64: 1e-10}


def _inputs(dtype, Hq, Hk, L, S, D, Dv, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        for shape in ((2, Hq, L, D), (2, Hk, S, D), (2, Hk, S, Dv))
    ]


def _compare(fn, ref_fn, tensors, mask, dtype):
    out = fn(*tensors, mask)
    ref_in = [t.detach().clone().requires_grad_() for t in tensors]
    ref = ref_fn(*ref_in, mask)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad((out * w).sum(), tensors)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_in)
    for a, b, name in zip((out, *grads), (ref, *ref_grads), ("out", "dq", "dk", "dv")):
        a, b = a.detach().double(), b.detach().double()
        assert a.shape == b.shape, name
        scale = max(1.0, float(b.abs().max()))
        assert float((a - b).abs().max()) <= TOL[dtype] * scale, name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(
    "dtype,Hq,Hk,L,S,mask_kind,causal",
    [
        (torch.float32, 4, 2, 16, 24, "bool", True),  # GQA, top-left causal with L < S, a bool mask
        (torch.float32, 2, 2, 20, 12, "float", False),  # an additive mask, L > S
        (torch.float64, 2, 1, 9, 9, None, True),
    ],
)
def test_fullgraph_matches_torch(backend, dtype, Hq, Hk, L, S, mask_kind, causal):
    q, k, v = _inputs(dtype, Hq, Hk, L, S, 32, 16, seed=L * 100 + S)
    gen = torch.Generator().manual_seed(3)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand((L, S), generator=gen) > 0.3
    elif mask_kind == "float":
        mask = torch.randn((L, S), generator=gen, dtype=torch.float64).to(dtype)

    def block(q, k, v, m):
        return tc.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=Hq != Hk)

    def reference(q, k, v, m):
        if causal:  # torch's eager SDPA refuses is_causal with a mask: the same top-left rule by hand
            tril = torch.ones((L, S), dtype=torch.bool).tril()
            if m is None:
                m = tril
            else:
                m = m & tril if m.dtype == torch.bool else m.masked_fill(~tril, -torch.inf)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=Hq != Hk)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=backend)  # a graph break would raise
    _compare(compiled, reference, [q, k, v], mask, dtype)


def test_compiled_graph_holds_the_op():
    """The traced graph calls fastattn::sdpa (not a fallback to eager around a break)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    q, k, v = _inputs(torch.float32, 2, 2, 8, 8, 16, 16, seed=1)

    def plain(q, k, v):
        return tc.scaled_dot_product_attention(q, k, v)

    f = torch.compile(plain, fullgraph=True, backend=backend)
    torch._dynamo.reset()
    f(q, k, v)
    assert any("fastattn.sdpa" in s for s in seen), seen


def test_opcheck():
    """torch.library.opcheck: schema, fake tensors against the real kernel, autograd registration."""
    q, k, v = _inputs(torch.float32, 4, 2, 12, 20, 16, 8, seed=2)
    mask = torch.rand((12, 20), generator=torch.Generator().manual_seed(4)) > 0.2
    res = torch.library.opcheck(torch.ops.fastattn.sdpa.default, (q, k, v, mask, True, 0.3, True, "highest"))
    assert set(res.values()) == {"SUCCESS"}, res
    out, lse = torch.ops.fastattn.sdpa(q, k, v, mask, True, 0.3, True, "highest")
    go = torch.randn_like(out)
    args = (go, q.detach(), k.detach(), v.detach(), out.detach(), lse, mask, True, 0.3, True, "highest")
    res = torch.library.opcheck(torch.ops.fastattn.sdpa_backward.default, args)
    assert set(res.values()) == {"SUCCESS"}, res


def test_op_gradient_not_differentiable_again():
    q, k, v = _inputs(torch.float32, 2, 2, 6, 6, 8, 8, seed=5)
    out, _ = torch.ops.fastattn.sdpa(q, k, v, None, False, None, False, "highest")
    (dq,) = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError):
        dq.sum().backward()


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_hf_attention_function_fullgraph(mask_kind):
    """fastattn.hf's attention function (no softcap, sinks or bias) compiles whole, through the
    same op; against torch's SDPA on transformers' 4-D masks."""
    hf = optional("fastattn.hf")
    q, k, v = _inputs(torch.float32, 4, 2, 10, 10, 16, 16, seed=6)
    gen = torch.Generator().manual_seed(8)
    mask = None
    if mask_kind == "bool":
        mask = (torch.rand((2, 1, 10, 10), generator=gen) > 0.3) | torch.eye(10, dtype=torch.bool)
    elif mask_kind == "float":
        mask = torch.randn((2, 1, 10, 10), generator=gen)

    def layer(q, k, v, m):
        return hf.attention_forward(None, q, k, v, m, is_causal=True)[0]

    def reference(q, k, v, m):  # sdpa's rule: is_causal only without a mask
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None, enable_gqa=True)
        return o.transpose(1, 2)

    torch._dynamo.reset()
    _compare(
        torch.compile(layer, fullgraph=True, backend="aot_eager"), reference, [q, k, v], mask, torch.float32
    )


def test_hf_attention_function_inference_fullgraph():
    """Inference (no tensor requires grad, the usual compiled generate loop): the op too."""
    hf = optional("fastattn.hf")
    q, k, v = (t.detach() for t in _inputs(torch.float32, 4, 2, 1, 12, 16, 16, seed=9))

    def layer(q, k, v):
        return hf.attention_forward(None, q, k, v, None, is_causal=True)[0]

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)  # one query: no causal
    assert float((out - ref).abs().max()) <= 2e-4
