"""fastattn.torch_compat.scaled_dot_product_attention against torch's own SDPA:
outputs and autograd gradients (skipped when torch is absent)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import optional

torch = optional("torch")
F = torch.nn.functional
tc = optional("fastattn.torch_compat")

TOL = {torch.float32: 2e-4, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def _pair(gen, shape, dtype, transpose=False):
    a = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if transpose:  # a non-contiguous view with the same logical shape
        a = a.transpose(-2, -3).contiguous().transpose(-2, -3)
    return a.clone().requires_grad_(), a.clone().requires_grad_()


def check(Hq, Hk, L, S, D, Dv, dtype=torch.float32, mask=None, transpose=False, **kw):
    gen = torch.Generator().manual_seed(L * 1000 + S)
    (q1, q2), (k1, k2), (v1, v2) = (
        _pair(gen, (2, Hq, L, D), dtype, transpose),
        _pair(gen, (2, Hk, S, D), dtype, transpose),
        _pair(gen, (2, Hk, S, Dv), dtype, transpose),
    )
    w = torch.randn((2, Hq, L, Dv), generator=gen, dtype=torch.float64).to(dtype)
    o1 = tc.scaled_dot_product_attention(q1, k1, v1, mask, **kw)
    o2 = F.scaled_dot_product_attention(q2, k2, v2, mask, **kw)
    assert o1.dtype == dtype and o1.shape == o2.shape
    (o1 * w).sum().backward()
    (o2 * w).sum().backward()
    tol = TOL[dtype]
    for a, b, n in (
        (o1, o2, "out"),
        (q1.grad, q2.grad, "dq"),
        (k1.grad, k2.grad, "dk"),
        (v1.grad, v2.grad, "dv"),
    ):
        a, b = a.detach().double(), b.detach().double()
        scale = max(1.0, float(b.abs().max()))
        err = float((a - b).abs().max())
        assert err <= tol * scale, f"{n}: {err:.3e} > {tol:.1e} * {scale:.3g}"


@pytest.mark.parametrize("L,S", [(40, 40), (30, 70), (70, 30), (1, 65)])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_and_causal_top_left(L, S, causal):
    check(2, 2, L, S, 32, 24, is_causal=causal)


def test_gqa_scale_float64():
    check(4, 2, 33, 50, 16, 16, dtype=torch.float64, enable_gqa=True, scale=0.3, is_causal=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks(kind, causal):
    gen = torch.Generator().manual_seed(7)
    if kind == "bool":
        m = torch.rand((2, 1, 30, 50), generator=gen) > 0.3
        m[..., 0] = True
    else:
        m = torch.randn((30, 50), generator=gen)
    check(2, 2, 30, 50, 16, 16, mask=m, is_causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit(dtype):
    check(2, 2, 20, 30, 16, 16, dtype=dtype, is_causal=True)


def test_non_contiguous_and_plain_sum():
    check(2, 2, 25, 35, 16, 8, transpose=True)
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    out = tc.scaled_dot_product_attention(q, q, q)
    out.sum().backward()  # grad_out is a stride-0 expanded tensor
    q2 = q.detach().clone().requires_grad_()
    F.scaled_dot_product_attention(q2, q2, q2).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, atol=1e-5, rtol=1e-4)


def test_bad_inputs():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        tc.scaled_dot_product_attention(q, q, q, dropout_p=1.1)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        tc.scaled_dot_product_attention(q, q, q, torch.zeros(5, 5, requires_grad=True))
    with pytest.raises(TypeError, match="same dtype"):
        tc.scaled_dot_product_attention(q, q.double(), q)
    with pytest.raises(TypeError, match="torch.Tensor"):
        tc.scaled_dot_product_attention(q.numpy(), q, q)


def test_import_fastattn_does_not_import_torch():
    import fastattn

    # run from the directory that holds the fastattn under test (installed or source)
    where = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    code = "import sys, fastattn; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=where).returncode == 0
