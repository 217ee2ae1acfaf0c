"""The naive bfloat16 attention that the 16-bit compute paths are held to
(flash-attention's precision contract): scores and softmax at full precision,
the probabilities P rounded to bfloat16, P.V accumulated in float32 and the
output rounded to the query's dtype.

P comes from the float64 reference itself (``fastattn.reference`` applied to an
identity value matrix), so every option (masks, ALiBi, softcap, sinks, lengths,
windows, block masks) is covered by the same code as the reference output.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fastattn import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)


def naive_bf16(q, k, v, p_dtype=BF16, **kw):
    """(naive output, float64 reference output) for sdpa arguments in bhsd layout;
    P is rounded to ``p_dtype`` (bfloat16; float16 for the AMX-FP16 kernel)."""
    kw = dict(kw)
    kw.pop("num_threads", None)
    S = np.asarray(k).shape[-2]
    Hk = np.asarray(k).shape[-3]
    lead = np.asarray(k).shape[:-3]
    eye = np.broadcast_to(np.eye(S), lead + (Hk, S, S))
    p = np.asarray(ref.scaled_dot_product_attention(q, k, eye, **kw), dtype=np.float64)  # (..., Hq, L, S)
    expected = np.asarray(ref.scaled_dot_product_attention(q, k, v, **kw), dtype=np.float64)
    p16 = p.astype(np.float32).astype(p_dtype).astype(np.float32)
    vv = np.asarray(v).astype(np.float32)
    Hq = p.shape[-3]
    vv = np.repeat(vv, Hq // Hk, axis=-3)
    o = np.matmul(p16, vv).astype(np.float32)
    out_dt = np.asarray(q).dtype
    return o.astype(out_dt).astype(np.float64), expected


def naive_bf16_error(q, k, v, p_dtype=BF16, **kw):
    """(max |naive - reference|, reference): the error the contract scales."""
    o, expected = naive_bf16(q, k, v, p_dtype=p_dtype, **kw)
    fin = np.isfinite(expected)
    err = float(np.max(np.abs(o[fin] - expected[fin]), initial=0.0))
    return err, expected


def check_naive_contract(sdpa, q, k, v, *, p_dtype=BF16, factor=2.0, **kw):
    """``sdpa``'s output within ``factor`` x the naive error with P in ``p_dtype`` (plus
    float32 slack), NaN where the reference is NaN, inputs unmodified; (output, reference)."""
    copies = [a.copy() for a in (q, k, v)]
    o = sdpa(q, k, v, **kw)
    naive_err, expected = naive_bf16_error(q, k, v, p_dtype=p_dtype, **kw)
    assert o.dtype == q.dtype and o.shape == expected.shape
    o64 = o.astype(np.float64)
    fin = np.isfinite(expected)
    np.testing.assert_array_equal(np.isnan(o64), np.isnan(expected))
    err = float(np.max(np.abs(o64[fin] - expected[fin]), initial=0.0))
    scale = max(1.0, float(np.abs(expected[fin]).max(initial=0.0)))
    allowed = factor * naive_err + 1e-5 * scale
    name = "bf16" if np.dtype(p_dtype) == BF16 else str(np.dtype(p_dtype))
    assert err <= allowed, f"error {err:.3e} > {factor} x naive {name} error {naive_err:.3e}"
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)
    return o, expected
