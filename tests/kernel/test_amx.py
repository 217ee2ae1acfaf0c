"""The AMX bfloat16 path (``isa="amx"``): bfloat16 query, key and value with at
least 32 stacked rows per key/value head run on the tile kernel
(csrc/kernel_bf16_amx.c), real tiles where the CPU has AMX-BF16, emulated ones in
the test-only build (tools/emulate_amx.sh).  The same tests run on the
``avx512bf16`` path (the same kernel source with its tile operations on
VDPBF16PS, csrc/kernel_bf16_avx512bf16.c; real where the CPU has AVX512-BF16,
emulated in tools/emulate_avx512bf16.sh).  Skipped where neither path exists.

Precision contract (flash-attention's): the error against the float64
reference is at most twice that of the naive bfloat16 computation (float
softmax, P rounded to bfloat16, float32 accumulation; tests/naive_bf16.py).
Tile geometry: 16 x 16 fp32 score tiles, 32 bf16 of d per tile row, row groups
of 32, key tiles of 64: sizes probe 1, tile - 1, tile, tile + 1 and primes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import ISAS, to_pages
from naive_bf16 import check_naive_contract, naive_bf16_error

import fastattn

BF16 = np.dtype(ml_dtypes.bfloat16)
sdpa = fastattn.scaled_dot_product_attention
TILE_ISAS = [i for i in ("amx", "avx512bf16") if i in ISAS]
pytestmark = pytest.mark.skipif(not TILE_ISAS, reason="no AMX or AVX512-BF16 path (real or emulated) here")


@pytest.fixture(autouse=True, params=TILE_ISAS)
def tile_isa(request):
    """Every test on each tile-kernel path this CPU/build has."""
    before = fastattn.get_isa()
    fastattn.set_isa(request.param)
    try:
        yield request.param
    finally:
        fastattn.set_isa(before)


def rnd(rng, shape, dtype=BF16, mag=1.0):
    return (rng.standard_normal(shape) * mag).astype(np.float32).astype(dtype)


def check_contract(q, k, v, *, factor=2.0, **kw):
    """Kernel output within ``factor`` x the naive bf16 error (plus float32 slack)."""
    return check_naive_contract(sdpa, q, k, v, factor=factor, **kw)


LS = [
    (32, 1),
    (32, 31),
    (33, 32),
    (47, 33),
    (64, 64),
    (65, 65),
    (100, 127),
    (129, 128),
    (131, 300),
    (257, 97),
]


@pytest.mark.parametrize("L,S", LS)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_edges(rng, L, S, causal):
    q, k, v = rnd(rng, (1, 2, L, 40)), rnd(rng, (1, 2, S, 40)), rnd(rng, (1, 2, S, 24))
    check_contract(q, k, v, is_causal=causal)


@pytest.mark.parametrize(
    "D,Dv", [(1, 1), (8, 8), (31, 33), (32, 32), (33, 31), (64, 64), (80, 48), (128, 128), (256, 96)]
)
def test_head_dims(rng, D, Dv):
    q, k, v = rnd(rng, (1, 2, 70, D)), rnd(rng, (1, 2, 90, D)), rnd(rng, (1, 2, 90, Dv))
    check_contract(q, k, v, is_causal=True)


@pytest.mark.parametrize("mkind", ["bool", "float32", "float64"])
def test_masks_gqa(rng, mkind):
    q, k, v = rnd(rng, (2, 4, 45, 33)), rnd(rng, (2, 2, 131, 33)), rnd(rng, (2, 2, 131, 33))
    if mkind == "bool":
        m = rng.random((4, 45, 131)) > 0.3
        m[1, 3] = False  # a fully masked row: zeros
    else:
        m = rng.standard_normal((4, 1, 131)).astype(mkind)
    o, _ = check_contract(q, k, v, attn_mask=m, is_causal=True, enable_gqa=True)
    if mkind == "bool":
        assert np.all(o[:, 1, 3].astype(np.float32) == 0)


@pytest.mark.parametrize(
    "opt",
    ["window", "window_right", "alibi", "softcap", "sinks", "key_lengths", "query_lengths", "block_mask"],
)
def test_options(rng, opt):
    B, Hq, Hk, L, S, D = 2, 4, 2, 70, 150, 64
    q, k, v = rnd(rng, (B, Hq, L, D)), rnd(rng, (B, Hk, S, D)), rnd(rng, (B, Hk, S, D))
    kw = {
        "window": {"window": (40, 0), "is_causal": True},
        "window_right": {"window": (20, 9)},
        "alibi": {"alibi_slopes": np.linspace(0.01, 0.2, Hq)},
        "softcap": {"softcap": 3.0, "scale": 1.0},
        "sinks": {"sinks": np.linspace(-1.0, 2.0, Hq)},
        "key_lengths": {"key_lengths": np.array([150, 0]), "is_causal": True},
        "query_lengths": {
            "query_lengths": np.array([3, 70]),
            "key_lengths": np.array([100, 41]),
            "is_causal": True,
        },
        "block_mask": {"block_mask": rng.random((B, Hq, 3, 5)) > 0.4, "block_size": (32, 32)},
    }[opt]
    check_contract(q, k, v, enable_gqa=True, **kw)


@pytest.mark.parametrize("G,L", [(8, 4), (4, 8), (16, 2), (2, 16)])
def test_gqa_stacked_rows(rng, G, L):
    """Few query positions of a large group still fill the 32-row groups."""
    q, k, v = rnd(rng, (1, 2 * G, L, 64)), rnd(rng, (1, 2, 200, 64)), rnd(rng, (1, 2, 200, 64))
    check_contract(q, k, v, enable_gqa=True, is_causal=True)


def test_fully_masked_rows_and_lse(rng):
    q, k, v = rnd(rng, (1, 2, 40, 32)), rnd(rng, (1, 2, 60, 32)), rnd(rng, (1, 2, 60, 32))
    m = np.ones((1, 2, 40, 60), dtype=bool)
    m[0, 0, 5:9] = False
    o, lse = sdpa(q, k, v, attn_mask=m, return_lse=True)
    assert np.all(o[0, 0, 5:9].astype(np.float32) == 0)
    assert np.all(np.isneginf(lse[0, 0, 5:9]))
    assert np.all(np.isfinite(o.astype(np.float32)))
    from fastattn import reference as ref

    _, rlse = ref.scaled_dot_product_attention(q, k, v, attn_mask=m, return_lse=True)
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], rtol=1e-5, atol=1e-4)


def test_split_kv(rng):
    """One key/value head, few row blocks: the driver splits the keys (partial outputs)."""
    q, k, v = rnd(rng, (1, 1, 40, 64)), rnd(rng, (1, 1, 2500, 64)), rnd(rng, (1, 1, 2500, 64))
    check_contract(q, k, v, is_causal=True)


def test_long_query_blocks(rng):
    """From L = 1024 tasks take 256 rows; 1031 = 4 x 256 + 7."""
    q, k, v = rnd(rng, (1, 1, 1031, 64)), rnd(rng, (1, 1, 1040, 64)), rnd(rng, (1, 1, 1040, 64))
    check_contract(q, k, v, is_causal=True)


def test_varlen(rng):
    cu = np.array([0, 40, 41, 140])
    q, k, v = rnd(rng, (140, 4, 48)), rnd(rng, (140, 2, 48)), rnd(rng, (140, 2, 48))
    o = fastattn.varlen_attention(q, k, v, cu, cu, is_causal=True, enable_gqa=True)
    for b in range(3):
        sl = slice(cu[b], cu[b + 1])
        qb, kb, vb = (np.swapaxes(a[sl], 0, 1)[None] for a in (q, k, v))
        err, expected = naive_bf16_error(qb, kb, vb, is_causal=True, enable_gqa=True)
        got = np.swapaxes(o[sl], 0, 1)[None].astype(np.float64)
        assert np.max(np.abs(got - expected)) <= 2 * err + 1e-5


def test_large_scores_nan_and_inf(rng):
    q, k, v = rnd(rng, (1, 2, 33, 16), mag=30.0), rnd(rng, (1, 2, 50, 16), mag=30.0), rnd(rng, (1, 2, 50, 16))
    check_contract(q, k, v, scale=1.0)
    q2 = q.copy()
    q2[0, 1, 7, 3] = np.nan
    o = sdpa(q2, k, v)
    o32 = o.astype(np.float32)
    assert np.all(np.isnan(o32[0, 1, 7])) and np.all(np.isfinite(np.delete(o32[0, 1], 7, axis=0)))


@pytest.mark.parametrize("spike", [5, 130, 255, 300, 511])
def test_row_max_anywhere_in_a_full_key_tile(rng, spike):
    """A dominant score at any key of a full key tile (keys 0-255, 256-511): the
    unmasked fast path's row max must see every score vector, or exp2(s - max)
    overflows to inf and the row turns NaN."""
    q = np.full((1, 2, 40, 16), 8.0, np.float32).astype(BF16)
    k = rnd(rng, (1, 2, 512, 16), mag=0.1)
    k[:, :, spike] = 8.0  # score 1024: exp2 overflows float32 unless it is the max
    v = rnd(rng, (1, 2, 512, 16))
    o, _ = check_contract(q, k, v, scale=1.0)
    expected = np.broadcast_to(v[:, :, spike : spike + 1], o.shape).astype(np.float32)
    np.testing.assert_allclose(o.astype(np.float32), expected)


def test_thread_counts_bit_identical(rng):
    q, k, v = rnd(rng, (2, 4, 300, 64)), rnd(rng, (2, 2, 300, 64)), rnd(rng, (2, 2, 300, 64))
    a = sdpa(q, k, v, is_causal=True, enable_gqa=True, num_threads=1)
    b = sdpa(q, k, v, is_causal=True, enable_gqa=True, num_threads=2)
    c = sdpa(q, k, v, is_causal=True, enable_gqa=True, num_threads=3)
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    np.testing.assert_array_equal(a.view(np.uint16), c.view(np.uint16))


def test_tile_path_taken_and_decode_unchanged(rng, tile_isa):
    """bf16 prefill takes the tiles (P is rounded to bf16, so the result differs
    from the float32-compute AVX-512 path); decode (< 32 rows) is that path bit for bit."""
    q, k, v = rnd(rng, (1, 2, 64, 64)), rnd(rng, (1, 2, 256, 64)), rnd(rng, (1, 2, 256, 64))
    a = sdpa(q, k, v).view(np.uint16)
    fastattn.set_isa("avx512")
    b = sdpa(q, k, v).view(np.uint16)
    d1 = sdpa(q[:, :, :1], k, v).view(np.uint16)
    fastattn.set_isa(tile_isa)
    d2 = sdpa(q[:, :, :1], k, v).view(np.uint16)
    assert np.any(a != b)
    np.testing.assert_array_equal(d1, d2)


def test_float32_and_mixed_inputs_use_the_float32_kernel(rng):
    q = rng.standard_normal((1, 2, 64, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, 80, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 80, 32)).astype(np.float32)
    a = sdpa(q, k.astype(BF16), v.astype(BF16))
    fastattn.set_isa("avx512")
    b = sdpa(q, k.astype(BF16), v.astype(BF16))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("page", [1, 16, 48])
@pytest.mark.parametrize("inputs", ["bfloat16", "medium", "high"])
def test_paged_prefill_is_the_contiguous_cache_bit_for_bit(rng, tile_isa, page, inputs):
    """Paged K/V (block_table) on the tile kernel: a tile's rows are gathered through
    the table before packing (tiles may span pages, pages are shuffled, the last ones
    partly filled), so the output is the contiguous cache's bit for bit; and the
    prefill rows really take the tiles (the float32-compute kernel's output differs)."""
    if inputs == "high" and tile_isa == "avx512bf16":
        pytest.skip('"high" (bf16x3) takes the float32 kernel on avx512bf16 (dispatch.c)')
    B, Hq, Hk, D, Lq = 2, 8, 2, 64, 40  # 4 x 40 = 160 stacked rows per kv head
    lens = np.array([130, 77])
    S = int(lens.max())
    dt = BF16 if inputs == "bfloat16" else np.dtype(np.float32)
    kw = {} if inputs == "bfloat16" else {"precision": inputs}
    k, v = rnd(rng, (B, Hk, S, D), dt), rnd(rng, (B, Hk, S, D), dt)
    q = rnd(rng, (B, Hq, Lq, D), dt)
    kv, bt = to_pages(rng, np.concatenate([k, v], axis=-1), page)  # one table for K and V
    kp, vp = kv[..., :D], kv[..., D:]
    want = fastattn.attention_with_kvcache(q, k, v, lens, **kw)
    got = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt, **kw)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    fastattn.set_isa("avx512")
    vec = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt, **kw)
    assert np.any(vec.view(np.uint8) != got.view(np.uint8))
    np.testing.assert_allclose(got.astype(np.float32), vec.astype(np.float32), rtol=0.05, atol=0.05)


def packed_over_pages(rng, lens, nq, Hq, Hk, D, page):
    """Packed varlen queries of sequences with ``lens`` keys (``nq`` queries each, the last
    positions) over a shuffled pool of bf16 pages in flash-attn's layout ``(pages, page,
    Hk, D)``: (q, k_pool, v_pool, block_table, cu_seqlens_q, cu_seqlens_k) and the same
    keys and values packed contiguously ``(total_k, Hk, D)``."""
    per = -(-lens // page)
    order = rng.permutation(int(per.sum()))
    kp = rnd(rng, (order.size, page, Hk, D))
    vp = rnd(rng, (order.size, page, Hk, D))
    bt = np.zeros((lens.size, int(per.max())), np.int32)
    at = 0
    for b, n in enumerate(per):
        bt[b, :n] = order[at : at + n]
        at += n
    q = rnd(rng, (int(nq.sum()), Hq, D))
    cq = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    j = [np.arange(n) for n in lens]
    k = np.concatenate([kp[bt[b, jb // page], jb % page] for b, jb in enumerate(j)])  # (Tk, Hk, D)
    v = np.concatenate([vp[bt[b, jb // page], jb % page] for b, jb in enumerate(j)])
    return q, kp, vp, bt, cq, ck, k, v


def test_paged_chunked_prefill_is_the_packed_call_bit_for_bit(rng):
    """varlen_attention over pages (decode rows of two sequences and a 40-query chunk of
    a third, bfloat16) on the tile kernel: bit for bit the packed varlen call on the same
    tokens."""
    Hq, Hk, D, page = 8, 2, 64, 16
    lens = np.array([70, 33, 100])  # keys per sequence, its queries included
    nq = np.array([1, 1, 40])
    q, kp, vp, bt, cq, ck, k, v = packed_over_pages(rng, lens, nq, Hq, Hk, D, page)
    kw = dict(is_causal=True, enable_gqa=True)
    want = fastattn.varlen_attention(q, k, v, cq, ck, **kw)
    got = fastattn.varlen_attention(q, kp, vp, cq, ck, block_table=bt, **kw)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    fastattn.set_isa("avx512")
    vec = fastattn.varlen_attention(q, kp, vp, cq, ck, block_table=bt, **kw)
    assert np.any(vec.view(np.uint16) != got.view(np.uint16))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("nq", [(1, 3, 40), (40, 1, 7, 1)])
def test_varlen_tasks_of_few_rows_take_the_vector_kernel(rng, paged, nq):
    """A packed varlen call whose prefill chunks pick the tile kernel also holds
    sequences of G * Lb < 32 stacked rows (decode rows): those run on the float32
    vector kernel, as a call of so few rows does (kernel_bf16_amx.c), so their rows are
    bit for bit the same call's on the vector path, and the chunks' rows are not."""
    Hq, Hk, D, page = 8, 2, 64, 16  # G = 4: 1, 3 and 7 queries are 4, 12, 28 rows
    nq = np.array(nq)
    lens = nq + rng.integers(5, 90, nq.size)  # keys per sequence, its queries included
    q, kp, vp, bt, cq, ck, k, v = packed_over_pages(rng, lens, nq, Hq, Hk, D, page)
    kv = dict(k=kp, v=vp, block_table=bt) if paged else dict(k=k, v=v)
    kw = dict(is_causal=True, enable_gqa=True)
    got = fastattn.varlen_attention(q, cu_seqlens_q=cq, cu_seqlens_k=ck, **kv, **kw)
    fastattn.set_isa("avx512")
    vec = fastattn.varlen_attention(q, cu_seqlens_q=cq, cu_seqlens_k=ck, **kv, **kw)
    few = np.repeat((Hq // Hk) * nq < 32, nq)  # the packed rows of few-row sequences
    np.testing.assert_array_equal(got[few].view(np.uint16), vec[few].view(np.uint16))
    assert np.any(got[~few].view(np.uint16) != vec[~few].view(np.uint16))
    want = fastattn.reference.varlen_attention(q, k, v, cq, ck, **kw)
    np.testing.assert_allclose(got.astype(np.float64), want, atol=2e-2)
