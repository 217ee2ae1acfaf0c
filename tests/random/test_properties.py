"""Property tests: random shapes, strides, layouts, masks and options against
the float64 reference (hypothesis)."""

from __future__ import annotations

import numpy as np
from conftest import check_sdpa, optional

import fastattn

hypothesis = optional("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sdpa = fastattn.scaled_dot_product_attention


def _strided(rng, shape, dtype, how):
    """An array of ``shape`` with the requested memory arrangement."""
    if how == "contiguous":
        return rng.standard_normal(shape).astype(dtype)
    if how == "reversed":  # negative strides on every axis
        a = rng.standard_normal(shape).astype(dtype)
        return np.ascontiguousarray(a)[tuple(slice(None, None, -1) for _ in shape)]
    if how == "padded":  # a slice of a bigger buffer: gaps between rows and heads
        big = rng.standard_normal(tuple(n + 2 for n in shape)).astype(dtype)
        return big[tuple(slice(1, n + 1) for n in shape)]
    if how == "transposed":  # Fortran order: last dim not contiguous (copied by the wrapper)
        return np.asfortranarray(rng.standard_normal(shape).astype(dtype))
    raise AssertionError(how)


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    nlead = draw(st.integers(0, 2))
    lead = tuple(draw(st.integers(1, 3)) for _ in range(nlead))
    Hk = draw(st.integers(1, 3))
    gqa = draw(st.booleans())
    Hq = Hk * (draw(st.integers(1, 3)) if gqa else 1)
    L = draw(st.integers(0, 140))
    S = draw(st.integers(0, 200))
    D = draw(st.sampled_from([1, 2, 5, 8, 16, 17, 32, 48, 64]))
    Dv = draw(st.sampled_from([D, 1, 9, 32]))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from([None, "bool", "float32", "float64", "float16"]))
    # a mask shape broadcastable to lead + (Hq, L, S): each dim kept or set to 1, maybe fewer dims
    full = lead + (Hq, L, S)
    keep = [draw(st.booleans()) for _ in full]
    mshape = tuple(n if k else 1 for n, k in zip(full, keep))
    drop = draw(st.integers(0, len(full) - 2))
    mshape = mshape[drop:]
    how = [draw(st.sampled_from(["contiguous", "reversed", "padded", "transposed"])) for _ in range(3)]
    scale = draw(st.one_of(st.none(), st.floats(0.01, 4.0)))
    threads = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31))
    if layout == "bhsd" and nlead == 0 and Hq == 1 and draw(st.booleans()):
        lead, two_d = (), True
    else:
        two_d = False
    return dict(
        dtype=dtype,
        lead=lead,
        Hq=Hq,
        Hk=Hk,
        L=L,
        S=S,
        D=D,
        Dv=Dv,
        layout=layout,
        causal=causal,
        mask_kind=mask_kind,
        mshape=mshape,
        how=how,
        scale=scale,
        threads=threads,
        seed=seed,
        two_d=two_d,
    )


def _shape(p, H, n, d):
    if p["two_d"]:
        return (n, d)
    core = (H, n, d) if p["layout"] == "bhsd" else (n, H, d)
    return p["lead"] + core


@settings(max_examples=80, deadline=None)
@given(problems())
def test_matches_reference(p):
    rng = np.random.default_rng(p["seed"])
    q = _strided(rng, _shape(p, p["Hq"], p["L"], p["D"]), p["dtype"], p["how"][0])
    k = _strided(rng, _shape(p, p["Hk"], p["S"], p["D"]), p["dtype"], p["how"][1])
    v = _strided(rng, _shape(p, p["Hk"], p["S"], p["Dv"]), p["dtype"], p["how"][2])
    kw = dict(
        is_causal=p["causal"],
        scale=p["scale"],
        layout=p["layout"],
        num_threads=p["threads"],
        enable_gqa=p["Hq"] != p["Hk"],
    )
    if p["mask_kind"] is not None and not p["two_d"]:
        if p["mask_kind"] == "bool":
            m = rng.random(p["mshape"]) > 0.3
        else:
            m = rng.standard_normal(p["mshape"]).astype(p["mask_kind"])
            m[rng.random(p["mshape"]) < 0.1] = -np.inf
        kw["attn_mask"] = m
    o, lse = check_sdpa(q, k, v, **kw)
    Hq_axis_len = p["Hq"]
    if not p["two_d"]:
        assert lse.shape == p["lead"] + (Hq_axis_len, p["L"])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(1, 140), st.integers(0, 2**31), st.integers(1, 3))
def test_out_view_equals_fresh(L, S, seed, threads):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 2, n, 16)).astype(np.float32) for n in (L, S, S))
    big = np.full((2, L, 2, 40), 5.0, np.float32)
    view = np.swapaxes(big, 1, 2)[..., 3:19]
    sdpa(q, k, v, is_causal=True, out=view, num_threads=threads)
    np.testing.assert_array_equal(view, sdpa(q, k, v, is_causal=True, num_threads=1))
    assert np.all(big[..., :3] == 5.0) and np.all(big[..., 19:] == 5.0)
