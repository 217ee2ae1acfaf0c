"""Reliability round 3, the torch front ends (fastattn.torch_compat, fastattn.hf):
version-counter checks on what the backward reads, double backward, the
forward's float32 precision kept for the backward, masks that require grad
under no_grad, torch.func (vmap, grad), autocast, and output_attentions.
Peers: torch's own SDPA and transformers' "eager" attention (skipped when absent)."""

from __future__ import annotations

from unittest import mock

import pytest
from conftest import optional

import fastattn

torch = optional("torch")
F = torch.nn.functional
tc = optional("fastattn.torch_compat")


def _qkv(B=2, H=2, L=5, S=7, D=8, dtype=torch.float32, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    ts = [
        torch.randn(shape, generator=g, dtype=dtype) for shape in ((B, H, L, D), (B, H, S, D), (B, H, S, D))
    ]
    return [t.requires_grad_(grad) for t in ts]


def _clones(ts):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]


def _close(a, b, tol=2e-5, what=""):
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).abs().max())
    assert err <= tol * max(1.0, float(b.abs().max())), f"{what}: {err:.3e}"


INPLACE = "modified by an inplace operation"


# Item 2: the output modified in place before backward().
def test_output_modified_in_place_refused_like_torch():
    for sdpa in (tc.scaled_dot_product_attention, F.scaled_dot_product_attention):
        q, k, v = _qkv()
        out = sdpa(q, k, v)
        out.mul_(2.0)
        with pytest.raises(RuntimeError, match=INPLACE):
            out.sum().backward()
    # unmodified: the same call differentiates as torch's
    (q1, k1, v1), (q2, k2, v2) = _qkv(), _qkv()
    tc.scaled_dot_product_attention(q1, k1, v1).pow(2).sum().backward()
    F.scaled_dot_product_attention(q2, k2, v2).pow(2).sum().backward()
    for a, b, n in ((q1, q2, "dq"), (k1, k2, "dk"), (v1, v2, "dv")):
        _close(a.grad, b.grad, what=n)


# Item 3: the mask modified in place after the forward (directly, or through the
# tensor it is a view of; with is_causal and L < S the kernel reads a derived copy,
# the user's tensor must still be tracked).  torch refuses the same for a float
# mask; a bool one it converts to a float copy at the forward (so its backward never
# reads the user's tensor again), while fastattn's backward reads the mask in place.
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_modified_after_forward_refused(kind, causal):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 5, 7, generator=g)
    if kind == "bool":
        base = base > -0.5
        base[..., 0] = True
    peers = [tc.scaled_dot_product_attention] + ([F.scaled_dot_product_attention] if kind == "float" else [])
    for sdpa in peers:
        for modify_base in (False, True):
            b = base.clone()
            m = b[1]  # a view
            q, k, v = _qkv()
            out = sdpa(q, k, v, m, is_causal=causal)
            target = b if modify_base else m
            if kind == "bool":
                target.logical_not_()
            else:
                target.add_(1.0)
            with pytest.raises(RuntimeError, match=INPLACE):
                out.sum().backward()
    # unmodified, the gradients equal torch's
    (q1, k1, v1), (q2, k2, v2) = _qkv(), _qkv()
    m = base[1]
    tc.scaled_dot_product_attention(q1, k1, v1, m, is_causal=causal).pow(2).sum().backward()
    F.scaled_dot_product_attention(q2, k2, v2, m, is_causal=causal).pow(2).sum().backward()
    for a, b, n in ((q1, q2, "dq"), (k1, k2, "dk"), (v1, v2, "dv")):
        _close(a.grad, b.grad, what=n)


# Item 4: create_graph=True.  As torch's flash backend: the first-order gradient is
# right (and carries a graph), differentiating it again raises; never silently dropped.
def test_double_backward_raises_not_dropped():
    (q1, k1, v1), (q2, k2, v2) = _qkv(), _qkv()
    g1 = torch.autograd.grad(tc.scaled_dot_product_attention(q1, k1, v1).pow(2).sum(), q1, create_graph=True)[
        0
    ]
    g2 = torch.autograd.grad(F.scaled_dot_product_attention(q2, k2, v2).pow(2).sum(), q2, create_graph=True)[
        0
    ]
    _close(g1, g2, what="dq with create_graph")
    assert g1.requires_grad  # a gradient penalty built on it reaches the refusal below
    with pytest.raises(RuntimeError, match="double backward"):
        g1.pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g1.sum(), k1)
    # plain backward unaffected
    q, k, v = _qkv()
    tc.scaled_dot_product_attention(q, k, v).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# Item 5: the backward recomputes P at the precision the forward used, whatever the
# process default is when backward() runs.
def test_backward_uses_forward_precision():
    spy = mock.patch.object(
        tc, "scaled_dot_product_attention_backward", wraps=tc.scaled_dot_product_attention_backward
    )
    before = fastattn.get_float32_matmul_precision()
    q, k, v = _qkv(B=1, H=1, L=64, S=64, D=32)  # amx-sized (>= 32 rows per head) where AMX exists
    try:
        fastattn.set_float32_matmul_precision("medium")
        out = tc.scaled_dot_product_attention(q, k, v)
        fastattn.set_float32_matmul_precision("highest")
        with spy as s:
            out.pow(2).sum().backward()
        assert s.call_args.kwargs["precision"] == "medium"
        # the same as forward and backward both at "medium" (bit for bit)
        fastattn.set_float32_matmul_precision("medium")
        q2, k2, v2 = _clones((q, k, v))
        out2 = tc.scaled_dot_product_attention(q2, k2, v2)
        out2.pow(2).sum().backward()
    finally:
        fastattn.set_float32_matmul_precision(before)
    assert torch.equal(out, out2)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.equal(a.grad, b.grad)
    # and the default ("highest" here) is captured the same way
    q3, k3, v3 = _clones((q, k, v))
    with spy as s:
        tc.scaled_dot_product_attention(q3, k3, v3).sum().backward()
    assert s.call_args.kwargs["precision"] == before


# Item 21: a mask that requires grad is a plain constant where nothing is recorded.
def test_mask_requiring_grad_under_no_grad_and_inference_mode():
    q, k, v = _qkv(grad=False)
    m = torch.randn(5, 7, requires_grad=True)
    want = F.scaled_dot_product_attention(q, k, v, m.detach())
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            got = tc.scaled_dot_product_attention(q, k, v, m)
        _close(got, want, what=ctx.__name__)
    assert m.grad is None
    with pytest.raises(NotImplementedError, match="attn_mask"):  # recorded: still refused
        tc.scaled_dot_product_attention(q, k, v, m)


# 48.2: torch.func.vmap / torch.func.grad, compared with torch's own SDPA under the same transforms.
def test_vmap_against_torch():
    q, k, v = _qkv(grad=False, B=3)
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(3, 5, 7, generator=g) > 0.3
    mask[..., 0] = True
    cases = [
        ((q, k, v), (0, 0, 0), {}),
        ((q.movedim(0, 2), k, v[0]), (2, 0, None), {"is_causal": True}),  # batched at dim 2; unbatched v
        ((q[:, 0], k[:, 0], v[:, 0], mask), (0, 0, 0, 0), {}),  # batched 3-D mask, per-sample heads
        ((q, k, v, mask[0]), (0, 0, 0, None), {}),  # unbatched mask
        ((q[:, :, 0:1].expand(3, 2, 5, 8).contiguous(), k, v), (1, 1, 1), {"scale": 0.5}),
    ]
    for args, dims, kw in cases:
        got = torch.vmap(lambda *a, kw=kw: tc.scaled_dot_product_attention(*a, **kw), in_dims=dims)(*args)
        want = torch.vmap(lambda *a, kw=kw: F.scaled_dot_product_attention(*a, **kw), in_dims=dims)(*args)
        assert got.shape == want.shape
        _close(got, want, what=f"vmap {dims}")


def test_func_grad_and_per_sample_grads_against_torch():
    q, k, v = _qkv(grad=False)

    def loss(sdpa):
        return lambda q, k, v: sdpa(q, k, v, is_causal=True).pow(2).sum()

    got = torch.func.grad(loss(tc.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    want = torch.func.grad(loss(F.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b, n in zip(got, want, ("dq", "dk", "dv")):
        _close(a, b, what=f"func.grad {n}")
    # per-sample gradients: vmap over grad, value shared (unbatched)
    dims = (0, 0, None)
    got = torch.vmap(torch.func.grad(loss(tc.scaled_dot_product_attention), argnums=(0, 1, 2)), in_dims=dims)(
        q, k, v[0]
    )
    want = torch.vmap(torch.func.grad(loss(F.scaled_dot_product_attention), argnums=(0, 1, 2)), in_dims=dims)(
        q, k, v[0]
    )
    for a, b, n in zip(got, want, ("dq", "dk", "dv")):
        assert a.shape == b.shape
        _close(a, b, what=f"vmap(grad) {n}")
    # with a per-sample mask (batched) on 3-D per-sample inputs
    g = torch.Generator().manual_seed(9)
    mask = torch.randn(2, 5, 7, generator=g)

    def mloss(sdpa):
        return lambda q, k, v, m: sdpa(q, k, v, m).pow(2).sum()

    got, want = (
        torch.vmap(torch.func.grad(mloss(f), argnums=(0, 1, 2)))(q[:, 0], k[:, 0], v[:, 0], mask)
        for f in (tc.scaled_dot_product_attention, F.scaled_dot_product_attention)
    )
    for a, b, n in zip(got, want, ("dq", "dk", "dv")):
        _close(a, b, what=f"vmap(grad) with mask {n}")
    # grad of grad is double backward: refused
    with pytest.raises(RuntimeError, match="double backward"):
        torch.func.grad(lambda x: torch.func.grad(loss(tc.scaled_dot_product_attention))(x, k, v).sum())(q)


# 48.3: autocast casts every floating input but float64 (the mask included) to the autocast dtype.
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_autocast_like_torch(low):
    (q1, k1, v1), (q2, k2, v2) = _qkv(), _qkv()
    m = torch.randn(5, 7)
    with torch.autocast("cpu", dtype=low):
        got = tc.scaled_dot_product_attention(q1.to(low), k1, v1, m)  # mixed dtypes, as torch accepts
        want = F.scaled_dot_product_attention(q2.to(low), k2, v2, m)
    assert got.dtype == want.dtype == low
    _close(got, want, tol=1e-2, what="autocast out")
    got.float().pow(2).sum().backward()
    want.float().pow(2).sum().backward()
    for a, b, n in ((q1, q2, "dq"), (k1, k2, "dk"), (v1, v2, "dv")):
        assert a.grad.dtype == torch.float32  # back in the caller's dtype
        _close(a.grad, b.grad, tol=5e-2, what=f"autocast {n}")
    # float64 is not cast, by either
    qd, kd, vd = (t.detach().double() for t in (q1, k1, v1))
    with torch.autocast("cpu", dtype=low):
        got = tc.scaled_dot_product_attention(qd, kd, vd)
        want = F.scaled_dot_product_attention(qd, kd, vd)
    assert got.dtype == want.dtype == torch.float64
    _close(got, want, tol=1e-10, what="autocast float64")
    with torch.autocast("cpu", dtype=low), pytest.raises(TypeError, match="same dtype"):
        tc.scaled_dot_product_attention(q1.to(low), kd, v1)


# Item 13: transformers' output_attentions with attn_implementation="fastattn".
def _eager_weights(q, k, mask, causal, scale):
    """softmax(q k^T * scale + mask) in float64, rows without a visible key zero."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0)


def test_hf_attention_forward_returns_weights():
    optional("transformers")
    import fastattn.hf

    class Mod(torch.nn.Module):
        is_causal = True

    fwd = fastattn.hf.attention_forward
    g = torch.Generator().manual_seed(3)
    B, Hq, Hk, L, S, D = 2, 4, 2, 5, 9, 8
    q = torch.randn(B, Hq, L, D, generator=g)
    k, v = torch.randn(B, Hk, S, D, generator=g), torch.randn(B, Hk, S, D, generator=g)
    bm = torch.rand(B, 1, L, S, generator=g) < 0.6
    bm[0, 0, 2] = False  # a row that sees no key: zero weights
    cases = [
        (bm, {}, False),
        (torch.randn(B, 1, L, S, generator=g), {"scaling": 0.3}, False),
        (None, {}, True),  # module's is_causal, L < S: top-left
    ]
    for mask, kw, causal in cases:
        out, w = fwd(Mod(), q, k, v, mask, output_attentions=True, **kw)
        want = _eager_weights(q, k, mask, causal, kw.get("scaling", D**-0.5))
        assert w is not None and w.shape == (B, Hq, L, S) and w.dtype == q.dtype
        _close(w, want, tol=1e-5, what="weights")
        # and they are the weights that produced the output
        vv = v.repeat_interleave(Hq // Hk, dim=1)
        _close(out, (w.double() @ vv.double()).transpose(1, 2), tol=1e-5, what="w @ v")
        assert fwd(Mod(), q, k, v, mask, **kw)[1] is None  # not asked: None, as sdpa
    # softcap (computed by the kernel), compared with the eager formula
    out, w = fwd(Mod(), q, k, v, bm, softcap=2.0, output_attentions=True)
    kk = k.double().repeat_interleave(2, dim=1)
    s = 2.0 * torch.tanh(q.double() @ kk.transpose(-1, -2) * D**-0.5 / 2.0)
    _close(w, torch.softmax(s.masked_fill(~bm, float("-inf")), -1).nan_to_num(0.0), tol=1e-5, what="softcap")
    # the grad path: differentiable weights, gradients as torch's eager formula
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, w = fwd(Mod(), qg, kg, vg, bm, output_attentions=True)
    assert w.requires_grad
    _close(w, _eager_weights(q, k, bm, False, D**-0.5), tol=1e-5, what="grad-path weights")
    (w.pow(2).sum() + out.sum()).backward()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_w = _eager_weights(qr, kr, bm, False, D**-0.5)
    ref_out = ref_w @ vr.double().repeat_interleave(2, dim=1)
    (ref_w.pow(2).sum() + ref_out.sum()).backward()
    for a, b, n in ((qg, qr, "dq"), (kg, kr, "dk"), (vg, vr, "dv")):
        _close(a.grad, b.grad, tol=1e-4, what=f"grad path {n}")


def test_hf_llama_output_attentions_equal_eager():
    transformers = optional("transformers")
    import fastattn.hf

    fastattn.hf.register()
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 6))
    am = torch.ones(2, 6, dtype=torch.long)
    am[0, :2] = 0  # left padding
    res = {}
    model = transformers.LlamaModel(cfg).eval()
    for impl in ("eager", "fastattn"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            res[impl] = model(input_ids=ids, attention_mask=am, output_attentions=True).attentions
    assert len(res["fastattn"]) == len(res["eager"]) == 2
    for a, b in zip(res["fastattn"], res["eager"]):
        assert a.shape == b.shape == (2, 4, 6, 6)
        _close(a[1], b[1], tol=1e-5, what="unpadded sequence")
        # padded sequence: its real query rows (eager gives padding query rows a uniform row;
        # fastattn's sdpa mask leaves them no key: zeros)
        _close(a[0, :, 2:], b[0, :, 2:], tol=1e-5, what="padded sequence")
        assert torch.equal(a[0, :, :2], torch.zeros_like(a[0, :, :2]))
