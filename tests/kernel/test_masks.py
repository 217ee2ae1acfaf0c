"""attn_mask against the float64 reference (issue 47, "Masks at no cost").

The kernel classifies each key tile of a task by its attn_mask: hidden (bool
False / float -inf for every row of the task: skipped), visible (bool True /
float 0 everywhere: computed as an unmasked tile, fused softmax included) or
mixed (the mask applied per element).  These tests build masks whose runs of
visible, hidden and mixed keys start inside and on the tile edges of every
path (64-, 128- and 256-key tiles of the prefill / stacked-row paths, the
512-key tile of a single decode row), in every form the front end accepts
(bool, float32/64/16, bfloat16; key-only, broadcast, dense, strided,
transposed and reversed views; HF's 0 / finfo.min padding), alone and with
every option that combines with a mask, and compare with the reference.

Nothing here depends on the tile widths of one ISA: the runs are placed at
1, 63, 64, 65, 128, 255, 256, 257, 512, ... so that each tile width of each
path (including the emulated AVX-512/AMX ones CI runs) meets every state.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, randn
from naive_bf16 import check_naive_contract, naive_bf16

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention
# The matrices of small calls run on one thread: results are bit-identical for
# every thread count (test_bit_identical_across_thread_counts covers masked
# calls big enough to split), and waking a team costs more than these calls.
sdpa1 = functools.partial(sdpa, num_threads=1)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32MIN = float(np.finfo(np.float32).min)
S = 600  # over one 512-key decode tile, several 64/128/256-key tiles

# name: (B, Hq, Hk, L, D).  "prefill": stacked rows beyond the decode paths'
# FA_BLK_RD (8); "rows": a few stacked rows (path_rows); "decode": one row, D
# 64 takes the single-row 512-key path (path_row1) on the vector ISAs, D 16 on
# the scalar one; GQA stacks the group's rows (Hq 4 over Hk 2).
PATHS = {
    "prefill": (2, 2, 2, 24, 32),
    "gqa_prefill": (2, 4, 2, 24, 32),
    "rows": (2, 2, 2, 5, 32),
    "gqa_rows": (2, 4, 2, 3, 32),
    "decode": (2, 2, 2, 1, 64),
    "decode_d16": (2, 2, 2, 1, 16),
    "gqa_decode": (2, 4, 2, 1, 64),
}
FEW_PATHS = ["prefill", "gqa_rows", "decode"]

# Runs of (start, kind): "v" visible, "h" hidden, "m" mixed (random keys, and
# random finite values in float masks).  PATTERNS[0] meets all three states at
# every tile width; [1] hides the whole first 512-key tile; [2] is a left
# padding (generation batches), [3] a right padding inside a tile.
PATTERNS = [
    [(0, "v"), (64, "m"), (128, "h"), (256, "v"), (300, "m"), (320, "v"), (512, "h"), (577, "v")],
    [(0, "h"), (512, "m"), (530, "v")],
    [(0, "h"), (255, "v")],
    [(0, "v"), (257, "h")],
]


def qkv(rng, path, dtype=np.float32, S=S, layout="bhsd"):
    B, Hq, Hk, L, D = PATHS[path]
    q, k, v = (
        randn(rng, (B, Hq, L, D), dtype),
        randn(rng, (B, Hk, S, D), dtype),
        randn(rng, (B, Hk, S, D), dtype),
    )
    if layout == "bshd":
        q, k, v = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v))
    return q, k, v, dict(enable_gqa=True) if Hq != Hk else {}


def runs(rng, segs, S=S):
    """(keep, bias) over S keys for runs of (start, kind); bias is nonzero
    only on the mixed runs (the values a float mask adds there)."""
    keep = np.zeros(S, bool)
    bias = np.zeros(S)
    ends = [a for a, _ in segs[1:]] + [S]
    for (a, kind), e in zip(segs, ends):
        if kind == "v":
            keep[a:e] = True
        elif kind == "m":
            keep[a:e] = rng.random(e - a) < 0.6
            bias[a:e] = rng.normal(size=e - a) * 2
    return keep, bias


def padding(S, right, left):
    """keep of shape (2, S): batch 0 sees its first `right` keys, batch 1 its last `left`."""
    j = np.arange(S)
    return np.stack([j < right, j >= S - left])


def to_form(keep, bias, form):
    """The mask of `keep` (True: may attend) in `form`; float forms add `bias` where kept."""
    if form == "bool":
        return keep.copy()
    if form == "hf32":  # transformers: 0 where kept, finfo(float32).min elsewhere
        return np.where(keep, 0.0, F32MIN).astype(np.float32)
    dt = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "bf16": BF16}[form]
    return np.where(keep, bias, -np.inf).astype(dt)


def view(m, how):
    """`m` as the same values in another memory layout; the padding between
    strided elements holds values (NaN, the opposite bool) that would show
    if the kernel read them."""
    if how == "strided":
        w = np.empty(m.shape[:-1] + (2 * m.shape[-1],), m.dtype)
        w[..., 1::2] = ~m if m.dtype == bool else np.nan
        w[..., ::2] = m
        return w[..., ::2]
    if how == "transposed":  # keys outermost: key stride H * L, head stride 1
        return np.ascontiguousarray(m.transpose(0, 3, 2, 1)).transpose(0, 3, 2, 1)
    if how == "reversed":
        return np.ascontiguousarray(m[..., ::-1])[..., ::-1]
    return m


def check(q, k, v, **kw):
    """Kernel against the reference: output always; LSE where the reference's
    is meaningful in the compute dtype (a row whose every key carries
    finfo(float32).min has LSE ~ -3.4e38, which float32 cannot carry through
    the base-2 change: there the kernel's must be as hopeless, below -1e37).
    Inputs and mask unmodified.  One thread unless num_threads is given.
    Returns (out, lse, ref out, ref lse)."""
    kw.setdefault("num_threads", 1)
    dt = np.dtype(np.float64 if q.dtype == np.float64 else np.float32)
    args = [q, k, v] + ([kw["attn_mask"]] if kw.get("attn_mask") is not None else [])
    copies = [np.array(a, copy=True) for a in args]
    o, lse = sdpa(q, k, v, return_lse=True, **kw)
    ro, rlse = ref.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    assert o.dtype == q.dtype and lse.dtype == dt
    assert_close(o, ro, dt)
    huge = np.isfinite(rlse) & (rlse < -1e30)
    assert np.all(lse[huge] < -1e37), "lse of rows masked by finfo.min"
    assert_close(lse[~huge], rlse[~huge], dt, what="lse")
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)
    return o, lse, ro, rlse


def pattern_mask(rng, path, shape):
    """(keep, bias) of the mask `shape` names for a call on `path`: key-only
    (per batch or shared), broadcast over rows, or dense with rows (and heads)
    that differ: two patterns per task's rows, a fully hidden row, and in the
    per-head form different patterns within one GQA group."""
    B, Hq, _, L, _ = PATHS[path]
    pats = [runs(rng, p) for p in PATTERNS]
    keep = np.stack([p[0] for p in pats])  # (4, S)
    bias = np.stack([p[1] for p in pats])
    if shape == "(S,)":
        return keep[0], bias[0]
    if shape == "(1,S)":
        return keep[1:2], bias[1:2]
    if shape in ("(B,1,1,S)", "broadcast"):
        kb, bb = keep[:B, None, None, :], bias[:B, None, None, :]
        if shape == "broadcast":
            return np.broadcast_to(kb, (B, 1, L, S)), np.broadcast_to(bb, (B, 1, L, S))
        return kb, bb
    H = 1 if shape == "(B,1,L,S)" else Hq
    b, h, i = np.ogrid[:B, :H, :L]
    sel = (b + h + (i >= L // 2)) % 4  # pattern per (batch, head, row)
    kd, bd = keep[sel], bias[sel]
    if L > 2:
        kd[0, H - 1, L // 3] = False  # a fully hidden row
    return kd, bd


SHAPES = ["(S,)", "(1,S)", "(B,1,1,S)", "broadcast", "(B,1,L,S)", "(B,H,L,S)"]


# --- forms of the mask ----------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("form", ["bool", "f32", "f64", "hf32"])
@pytest.mark.parametrize(
    "right,left", [(0, 600), (1, 599), (63, 64), (65, 128), (255, 256), (257, 511), (512, 513), (600, 1)]
)
def test_key_padding(rng, isa, path, form, right, left):
    """A (B, 1, 1, S) padding mask: batch 0 right-padded, batch 1 left-padded,
    the edge inside a tile, on one, one past it; no key (0) and all keys."""
    q, k, v, kw = qkv(rng, path)
    m = to_form(padding(S, right, left), 0.0, form)[:, None, None, :]
    o, lse, _, _ = check(q, k, v, attn_mask=m, **kw)
    if right == 0 and form != "hf32":  # nothing visible: zeros and -inf
        assert np.all(o[0] == 0) and np.all(lse[0] == -np.inf)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", ["bool", "f32", "hf32"])
def test_mask_shapes(rng, isa, path, shape, form):
    """Key-only, broadcast (zero strides) and dense masks with visible, hidden
    and mixed runs (random finite values on the mixed runs of float masks)."""
    q, k, v, kw = qkv(rng, path)
    keep, bias = pattern_mask(rng, path, shape)
    m = to_form(keep, bias, form)
    if shape == "broadcast":
        m = np.broadcast_to(to_form(keep[:, :, :1], bias[:, :, :1], form), keep.shape)
        assert m.strides[2] == 0
    check(q, k, v, attn_mask=m, **kw)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("how", ["strided", "transposed", "reversed"])
@pytest.mark.parametrize("form", ["bool", "f32", "f64"])
def test_mask_views(rng, isa, path, how, form):
    """Dense masks read through non-contiguous views: every other element of
    a wider array (the gaps hold NaN / the opposite bool), a transposed
    copy (keys outermost), a reversed one (negative key stride)."""
    q, k, v, kw = qkv(rng, path)
    keep, bias = pattern_mask(rng, path, "(B,H,L,S)")
    m = view(to_form(keep, bias, form), how)
    assert not m.flags.c_contiguous
    o, lse, _, _ = check(q, k, v, attn_mask=m, **kw)
    o2, lse2 = sdpa1(q, k, v, attn_mask=np.ascontiguousarray(m), return_lse=True, **kw)
    np.testing.assert_array_equal(o, o2)  # the layout of the mask changes nothing
    np.testing.assert_array_equal(lse, lse2)


@pytest.mark.parametrize("path", FEW_PATHS)
@pytest.mark.parametrize("dt", [np.float16, BF16])
@pytest.mark.parametrize("qdt", [np.float32, np.float64])
def test_16bit_float_masks_are_converted(rng, isa, path, dt, qdt):
    """float16 / bfloat16 masks are accepted and act as their conversion to
    the compute dtype (bit for bit)."""
    q, k, v, kw = qkv(rng, path, qdt)
    keep, bias = pattern_mask(rng, path, "(B,H,L,S)")
    m = np.where(keep, bias, -np.inf).astype(dt)
    check(q, k, v, attn_mask=m, **kw)
    a = sdpa1(q, k, v, attn_mask=m, **kw)
    np.testing.assert_array_equal(a, sdpa1(q, k, v, attn_mask=m.astype(qdt), **kw))


@pytest.mark.parametrize("path", FEW_PATHS)
def test_hf_float16_min_padding(rng, isa, path):
    """HF's float16 padding (0 / finfo(float16).min = -65504): masked keys get
    weight exp(-65504) = 0 in any row that sees a key; a row that sees none
    is the softmax over all keys shifted by -65504, which float32 scores
    resolve to ~|shift| * 2**-24 in log2 units: the tolerance of those rows."""
    q, k, v, kw = qkv(rng, path)
    keep = padding(S, 300, 64)
    keep[1, :] = False  # batch 1: no key visible
    m = np.where(keep, 0.0, np.finfo(np.float16).min).astype(np.float16)[:, None, None, :]
    o = sdpa1(q, k, v, attn_mask=m, **kw)
    r = ref.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)
    assert_close(o[0], r[0], np.float32)
    assert_close(o[1], r[1], tol=65504 * 1.45 * 2.0**-24 * 4)
    assert_close(o[1], ref.scaled_dot_product_attention(q, k, v, **kw)[1], tol=65504 * 1.45 * 2.0**-24 * 4)


def test_mask_dtype_refused(rng):
    q, k, v, _ = qkv(rng, "rows")
    with pytest.raises(TypeError, match="attn_mask"):
        sdpa(q, k, v, attn_mask=np.ones(S, np.int32))
    with pytest.raises(ValueError, match="attn_mask"):
        sdpa(q, k, v, attn_mask=np.ones(S - 1, bool))


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_5d_batch_dims(rng, isa, path):
    """Two batch dims, the mask varying over the first only (its stride over
    the second is 0)."""
    B, Hq, Hk, L, D = PATHS[path]
    q, k, v = randn(rng, (2, 3, Hq, L, D)), randn(rng, (2, 3, Hk, S, D)), randn(rng, (2, 3, Hk, S, D))
    keep = padding(S, 257, 64)[:, None, None, None, :]
    check(q, k, v, attn_mask=keep, enable_gqa=Hq != Hk)
    check(q, k, v, attn_mask=to_form(keep, 0.0, "f32"), enable_gqa=Hq != Hk)


# --- fully masked rows and tiles -----------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("form", ["bool", "f32", "f64"])
@pytest.mark.parametrize("sinks", [False, True])
def test_fully_masked(rng, isa, path, form, sinks):
    """Rows with no visible key give zeros and LSE -inf (with sinks: zeros and
    the sink's logit, as the reference); a whole call with no visible key too."""
    B, Hq, _, L, _ = PATHS[path]
    q, k, v, kw = qkv(rng, path)
    if sinks:
        kw["sinks"] = np.linspace(-1.0, 2.0, Hq)
    keep, bias = pattern_mask(rng, path, "(B,H,L,S)")
    keep[1, :, L - 1] = False  # the last row of every head of batch 1
    keep[0, 0] = False  # every row of head 0 of batch 0
    o, lse, _, _ = check(q, k, v, attn_mask=to_form(keep, bias, form), **kw)
    for idx in [(1, slice(None), L - 1), (0, 0)]:
        assert np.all(o[idx] == 0)
        if not sinks:
            assert np.all(lse[idx] == -np.inf)
    none = to_form(np.zeros((B, 1, L, S), bool), 0.0, form)
    o, lse, _, _ = check(q, k, v, attn_mask=none, **kw)
    assert np.all(o == 0)
    if not sinks:
        assert np.all(lse == -np.inf)


# --- with the other options ---------------------------------------------------------

OPTIONS = {
    "causal": dict(is_causal=True),
    "window": dict(window=(70, 3)),
    "window_causal": dict(window=(300, 0), is_causal=True),
    "window_right": dict(window=(-1, 100)),
    "alibi": dict(alibi_slopes="h"),
    "alibi_causal": dict(alibi_slopes="h", is_causal=True),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks="h"),
    "key_lengths": dict(key_lengths=np.array([513, 256])),
    "lengths_causal": dict(key_lengths=np.array([600, 300]), query_lengths="half", is_causal=True),
    "bshd": dict(layout="bshd"),
    "scale": dict(scale=0.9),
    "block_mask": dict(block_mask="b", block_size=(8, 64)),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("form", ["bool", "f32"])
def test_mask_with_options(rng, isa, path, option, form):
    B, Hq, _, L, _ = PATHS[path]
    kw = dict(OPTIONS[option])
    q, k, v, gqa = qkv(rng, path, layout=kw.get("layout", "bhsd"))
    kw.update(gqa)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq) * 4
    if kw.get("sinks") == "h":
        kw["sinks"] = np.linspace(-1.0, 2.0, Hq)
    if kw.get("query_lengths") == "half":
        kw["query_lengths"] = np.array([L, max(1, L // 2)])
    if kw.get("block_mask") == "b":
        kw["block_mask"] = rng.random((B, Hq, -(-L // 8), -(-S // 64))) < 0.7
    keep, bias = pattern_mask(rng, path, "(B,H,L,S)")
    if option == "softcap":
        q = q * 3  # scores beyond the cap
    check(q, k, v, attn_mask=to_form(keep, bias, form), **kw)
    check(q, k, v, attn_mask=to_form(keep[:, :1, :1], bias[:, :1, :1], form), **kw)


@pytest.mark.parametrize("path", ["prefill", "gqa_rows", "decode"])
@pytest.mark.parametrize("option", ["causal", "window", "key_lengths", "sinks", "alibi"])
def test_mask_with_options_float64(rng, isa, path, option):
    kw = dict(OPTIONS[option])
    B, Hq, _, L, _ = PATHS[path]
    q, k, v, gqa = qkv(rng, path, np.float64)
    kw.update(gqa)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq)
    if kw.get("sinks") == "h":
        kw["sinks"] = np.linspace(-1.0, 2.0, Hq)
    keep, bias = pattern_mask(rng, path, "(B,H,L,S)")
    check(q, k, v, attn_mask=to_form(keep, bias, "f64"), **kw)
    check(q, k, v, attn_mask=keep, **kw)


@pytest.mark.parametrize("L", [1, 40, 320])
def test_documents_mask(rng, isa, L):
    """Packed sequences: block-diagonal bool mask (query block d sees key
    block d).  Each task's rows hide other tiles, and with L 320 a head's
    query blocks meet its keys several times (the head K buffer, filled
    over the tiles each block does not skip, on one thread and on two)."""
    D = 32
    q, k, v = randn(rng, (1, 3, L, D)), randn(rng, (1, 3, S, D)), randn(rng, (1, 3, S, D))
    kb = np.array([0, 65, 128, 385, S])  # key documents
    qb = np.round(kb * L / S).astype(int)
    qd = np.searchsorted(qb, np.arange(L), side="right")
    kd = np.searchsorted(kb, np.arange(S), side="right")
    m = qd[:, None] == kd[None, :]
    check(q, k, v, attn_mask=m)
    check(q, k, v, attn_mask=np.where(m, 0.0, -np.inf).astype(np.float32), num_threads=2)


# --- equivalences -------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lengths", [(0, 600), (1, 64), (63, 65), (128, 255), (256, 257), (512, 513)])
def test_padding_mask_equals_key_lengths(rng, isa, path, dtype, lengths):
    """A right padding given as a bool mask, as a float -inf mask and as
    key_lengths: the same output and LSE (to the dtype's tolerance)."""
    q, k, v, kw = qkv(rng, path, dtype)
    kl = np.array(lengths)
    keep = (np.arange(S)[None, :] < kl[:, None])[:, None, None, :]
    o, lse = sdpa1(q, k, v, key_lengths=kl, return_lse=True, **kw)
    for m in (keep, np.where(keep, 0.0, -np.inf).astype(dtype)):
        om, lsem = sdpa1(q, k, v, attn_mask=m, return_lse=True, **kw)
        assert_close(om, o, dtype)
        assert_close(lsem, lse, dtype, what="lse")
    check(q, k, v, attn_mask=keep, **kw)


@pytest.mark.parametrize("path", ["prefill", "gqa_prefill", "rows", "decode"])
def test_all_visible_equals_no_mask(rng, isa, path):
    """A mask that hides nothing (True / 0.0 / -0.0 everywhere) computes every
    tile as an unmasked one: the unmasked result, bit for bit."""
    q, k, v, kw = qkv(rng, path)
    B, Hq, _, L, _ = PATHS[path]
    o, lse = sdpa1(q, k, v, return_lse=True, **kw)
    for m in (np.ones((B, 1, L, S), bool), np.zeros(S, np.float32), np.full((Hq, L, S), -0.0)):
        om, lsem = sdpa1(q, k, v, attn_mask=m, return_lse=True, **kw)
        np.testing.assert_array_equal(om, o)
        np.testing.assert_array_equal(lsem, lse)
    check(q, k, v, attn_mask=np.ones(S, bool), is_causal=True, **kw)


@pytest.mark.parametrize("path", ["prefill", "rows", "decode"])
def test_explicit_causal_mask_equals_is_causal(rng, isa, path):
    """The bottom-right causal band as a bool and a float mask (hidden tiles
    above the diagonal for a task's rows) against is_causal."""
    q, k, v, kw = qkv(rng, path)
    L = q.shape[-2]
    band = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
    o, lse = sdpa1(q, k, v, is_causal=True, return_lse=True, **kw)
    for m in (band, np.where(band, 0.0, -np.inf)):
        om, lsem = sdpa1(q, k, v, attn_mask=m, return_lse=True, **kw)
        assert_close(om, o, np.float32)
        assert_close(lsem, lse, np.float32, what="lse")


# --- threads --------------------------------------------------------------------------------

THREAD_CASES = {
    "prefill_bool_padding": ((2, 4, 256, 64), (2, 4, 300, 64), "pad_bool", {}),
    "prefill_f32_dense": ((2, 4, 256, 64), (2, 4, 300, 64), "dense_f32", {}),
    "prefill_hf32_causal": ((2, 4, 256, 64), (2, 2, 300, 64), "pad_hf32", {"is_causal": True}),
    "decode_split_bool": ((1, 8, 1, 64), (1, 8, 4096, 64), "pad_bool", {}),
    "decode_split_f32_gqa": ((1, 8, 1, 64), (1, 2, 4096, 64), "pad_f32", {}),
}


@pytest.mark.parametrize("case", list(THREAD_CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bit_identical_across_thread_counts(rng, isa, case, dtype):
    qs, ks, mk, kw = THREAD_CASES[case]
    kw = dict(kw, enable_gqa=qs[1] != ks[1])
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, ks, dtype)
    B, Sk, L = qs[0], ks[2], qs[2]
    if mk.startswith("pad"):  # batch b sees its first keys: 1000 / 257 of 4096, 65 / 256 of 300
        n = np.array([1000, 2049])[:B] if Sk > 1000 else np.array([65, 256])[:B]
        keep = (np.arange(Sk)[None, :] < n[:, None])[:, None, None, :]
        m = to_form(keep, 0.0, mk[4:])
    else:
        keep = rng.random((B, 1, L, Sk)) < 0.7
        keep[..., 64:192] = False
        keep[..., 256:] = True
        m = np.where(keep, rng.normal(size=keep.shape), -np.inf).astype(np.float32)
    results = [sdpa(q, k, v, attn_mask=m, return_lse=True, num_threads=n, **kw) for n in (1, 2, 3)]
    for o, lse in results[1:]:
        np.testing.assert_array_equal(o, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])
    check(q, k, v, attn_mask=m, num_threads=3, **kw)


# --- 16-bit inputs and float32 precision levels -------------------------------------------


S16 = 300  # the naive contract materialises (L, S, S): shorter keys for its tests
SEGS16 = [[(0, "v"), (64, "m"), (128, "h"), (256, "v")], [(0, "h"), (255, "m"), (257, "v")]]


def mask16(rng, form):
    """A (2, 1, 1, S16) mask with visible, hidden and mixed tiles at every tile width up to 256."""
    keep, bias = zip(*(runs(rng, segs, S16) for segs in SEGS16))
    return to_form(np.stack(keep), np.stack(bias), form)[:, None, None, :]


@pytest.mark.parametrize("path", ["prefill", "gqa_rows", "decode"])
@pytest.mark.parametrize("dt", [np.dtype(np.float16), BF16])
@pytest.mark.parametrize("form", ["bool", "f32"])
def test_16bit_inputs(rng, isa, path, dt, form):
    """16-bit Q, K, V with masks, within the naive bf16 contract (P rounded to
    bf16, what the AMX paths do; the float32 paths are well inside it)."""
    B, Hq, Hk, L, D = PATHS[path]
    L = 64 if path == "prefill" else L  # >= 32 rows per kv head: the AMX paths where present
    q, k, v = (randn(rng, s).astype(dt) for s in ((B, Hq, L, D), (B, Hk, S16, D), (B, Hk, S16, D)))
    m = mask16(rng, form)
    for causal in (False, True):
        o, _ = check_naive_contract(sdpa1, q, k, v, attn_mask=m, enable_gqa=Hq != Hk, is_causal=causal)
        assert o.dtype == dt


@pytest.mark.parametrize("precision", ["high", "medium"])
@pytest.mark.parametrize("form", ["bool", "f32", "hf32"])
def test_precision_levels(rng, isa, precision, form):
    """float32 at "high" within 2e-4 of the reference, "medium" within the
    naive bf16 contract, with masks (on the paths where the levels take
    effect, amx / avx512bf16, and as "highest" elsewhere)."""
    q, k, v = randn(rng, (2, 4, 64, 64)), randn(rng, (2, 2, S16, 64)), randn(rng, (2, 2, S16, 64))
    for causal in (False, True):
        kw = dict(attn_mask=mask16(rng, form), enable_gqa=True, is_causal=causal)
        if precision == "high":
            o = sdpa1(q, k, v, precision="high", **kw)
            assert_close(o, ref.scaled_dot_product_attention(q, k, v, **kw), tol=2e-4)
        else:  # "medium" rounds Q, K, V and P: the naive bf16 model of the rounded inputs
            o = sdpa1(q, k, v, precision="medium", **kw)
            r = ref.scaled_dot_product_attention(q, k, v, **kw)
            q16, k16, v16 = (a.astype(ml_dtypes.bfloat16).astype(np.float32) for a in (q, k, v))
            naive, _ = naive_bf16(q16, k16, v16, **kw)
            fin = np.isfinite(r)
            np.testing.assert_array_equal(np.isnan(o), np.isnan(r))
            naive_err = float(np.max(np.abs(naive[fin] - r[fin]), initial=0.0))
            scale = max(1.0, float(np.abs(r[fin]).max(initial=0.0)))
            assert float(np.max(np.abs(o[fin] - r[fin]), initial=0.0)) <= 2 * naive_err + 1e-5 * scale
        if isa not in ("amx", "avx512bf16"):  # the levels compute as "highest" on the other paths
            np.testing.assert_array_equal(sdpa1(q, k, v, precision=precision, **kw), sdpa1(q, k, v, **kw))


# --- special values -----------------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("j", [100, 520], ids=["mixed_tile", "hidden_tile"])
def test_nan_key_under_minus_inf_float_mask(rng, isa, path, j):
    """A float mask adds: a NaN score plus -inf is NaN, and the row is NaN
    (the reference, torch, the general mask loop), whether the key lies in a
    tile that the mask hides for every row (key 520: keys 512-599 are -inf)
    or in a mixed one (key 100 of the -inf run 90-109): the result must not
    depend on the tile widths.  A bool False removes the key: no NaN."""
    q, k, v, kw = qkv(rng, path)
    keep = np.ones(S, bool)
    keep[512:] = False
    keep[90:110] = False
    k[0, 0, j, 3] = np.nan
    _, _, ro, _ = check(q, k, v, attn_mask=np.where(keep, 0.0, -np.inf).astype(np.float32), **kw)
    assert np.isnan(ro[0]).any()
    _, _, ro, _ = check(q, k, v, attn_mask=keep, **kw)
    assert not np.isnan(ro).any()


@pytest.mark.parametrize("path", ["prefill", "gqa_rows", "decode"])
def test_nan_query_fully_masked_float(rng, isa, path):
    """A NaN query row: NaN + -inf is NaN, so the row is NaN even when the
    float mask hides every key (the reference); a bool mask hides it."""
    q, k, v, kw = qkv(rng, path)
    q[0, 0, 0, 1] = np.nan
    m = np.full(S, -np.inf, np.float32)
    _, _, ro, _ = check(q, k, v, attn_mask=m, **kw)
    assert np.isnan(ro[0, 0, 0]).all() and not np.isnan(ro[1]).any()
    o = sdpa1(q, k, v, attn_mask=np.zeros(S, bool), **kw)
    assert np.all(o == 0)


@pytest.mark.parametrize("path", ["prefill", "gqa_rows", "decode", "decode_d16"])
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_inf_and_nan_mask_entries(rng, isa, path, value):
    """A +inf or NaN mask value makes its row's output NaN (exp(inf - inf),
    NaN scores), the other rows untouched.  That row's LSE is NaN for NaN; for
    +inf the reference's is +inf (log of an infinite sum) and the kernel's
    NaN (it treats the row as a NaN row): only required not finite."""
    q, k, v, kw = qkv(rng, path)
    B, Hq, _, L, _ = PATHS[path]
    keep, bias = pattern_mask(rng, path, "(B,H,L,S)")
    m = to_form(keep, bias, "f32")
    m[1, Hq - 1, L - 1, 530] = value
    o, lse = sdpa1(q, k, v, attn_mask=m, return_lse=True, **kw)
    ro, rlse = ref.scaled_dot_product_attention(q, k, v, attn_mask=m, return_lse=True, **kw)
    assert np.isnan(ro[1, Hq - 1, L - 1]).all()
    assert_close(o, ro, np.float32)
    assert not np.isfinite(lse[1, Hq - 1, L - 1])
    lse[1, Hq - 1, L - 1] = rlse[1, Hq - 1, L - 1] = 0
    assert_close(lse, rlse, np.float32, what="lse")


def test_additive_inf_mask_entry(rng, isa):
    """fastattn.additive_attention: a +inf mask entry makes the row NaN (like
    the reference softmax), not zeros."""
    L, Sk, Dq, A = 5, 70, 8, 6
    q, k, v = randn(rng, (2, L, Dq)), randn(rng, (2, Sk, Dq)), randn(rng, (2, Sk, 4))
    wq, wk, va = randn(rng, (A, Dq)), randn(rng, (A, Dq)), randn(rng, (A,))
    m = np.where(rng.random((L, Sk)) < 0.8, 0.0, -np.inf).astype(np.float32)
    m[2, 40] = np.inf
    o = fastattn.additive_attention(q, k, v, wq, wk, va, attn_mask=m)
    r = ref.additive_attention(q, k, v, wq, wk, va, attn_mask=m)
    assert np.isnan(r[:, 2]).all()
    assert_close(o, r, np.float32)


# ---- HF finfo.min padding tiles (FA_TM_HUGE): skipped only where that is exact ----
# The prefill path skips a key tile whose float mask is all <= -1e30 once every row of
# the task has seen an ordinary key and the tile's scores are provably < 1e29 in
# magnitude; the result must then be the bool mask's, bit for bit, and every other case
# (left padding, padded rows, huge or NaN scores) must still follow the reference.


def _hf(keep):
    return np.where(keep, np.float32(0), np.finfo(np.float32).min).astype(np.float32)


@pytest.mark.parametrize("valid", [64, 200, 256, 257])
def test_hf_min_right_padding_equals_bool_bits(rng, isa, valid):
    q, k, v = (randn(rng, (2, 4, 96, 32)), randn(rng, (2, 4, 600, 32)), randn(rng, (2, 4, 600, 16)))
    keep = np.ones((2, 1, 96, 600), dtype=bool)
    keep[1, ..., valid:] = False
    for causal in (False, True):
        ob = fastattn.scaled_dot_product_attention(q, k, v, keep, is_causal=causal, num_threads=1)
        of = fastattn.scaled_dot_product_attention(q, k, v, _hf(keep), is_causal=causal, num_threads=1)
        np.testing.assert_array_equal(ob, of)
        assert_close(of, ref.scaled_dot_product_attention(q, k, v, _hf(keep), is_causal=causal))


def test_hf_min_left_padding_and_padded_rows(rng, isa):
    """Rows that meet the padded tiles first, and rows of padding only (uniform over the
    finfo.min keys, as torch): both computed, never skipped."""
    q, k, v = (randn(rng, (2, 2, 80, 32)), randn(rng, (2, 2, 520, 32)), randn(rng, (2, 2, 520, 16)))
    keep = np.ones((2, 1, 80, 520), dtype=bool)
    keep[0, ..., :300] = False  # left padding over whole tiles
    keep[1, :, :10, :] = False  # ten query rows see only padding
    m = _hf(keep)
    assert_close(
        fastattn.scaled_dot_product_attention(q, k, v, m), ref.scaled_dot_product_attention(q, k, v, m)
    )


@pytest.mark.parametrize("what", ["huge_scores", "nan_key", "inf_key"])
def test_hf_min_tiles_with_extreme_keys_follow_the_reference(rng, isa, what):
    q, k, v = (randn(rng, (1, 2, 64, 32)), randn(rng, (1, 2, 512, 32)), randn(rng, (1, 2, 512, 16)))
    keep = np.ones((1, 1, 64, 512), dtype=bool)
    keep[..., 256:] = False
    if what == "huge_scores":  # scores near 1e31: a padded key's logit is no longer negligible
        q *= np.float32(3e15)
        k *= np.float32(3e15)
    else:
        k[0, 0, 400, 5] = np.nan if what == "nan_key" else np.inf
    m = _hf(keep)
    out = fastattn.scaled_dot_product_attention(q, k, v, m)
    expected = ref.scaled_dot_product_attention(q, k, v, m)
    if what == "huge_scores":
        assert_close(out, expected)
    else:  # NaN + finfo.min: every row of head 0 is NaN; +-inf: the rows where inf - inf meets
        np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
        assert np.isnan(expected[0, 0]).any()  # the test reaches the padded tile's bad key
        if what == "nan_key":
            assert np.isnan(expected[0, 0]).all()
        assert_close(out[0, 1], expected[0, 1])
