"""float16 inputs where the ISA is ``amx``: on CPUs with AMX-FP16 (Granite
Rapids and later; and in the test-only emulated build, tools/emulate_amx.sh)
they run on the tile kernel with TDPFP16PS products (csrc/kernel_f16_amx.c),
P rounded to float16; elsewhere they keep the float32-compute kernels, bit for
bit.  float16 is never rounded to bfloat16 behind the caller's back.

Precision contract as for bf16 (tests/kernel/test_amx.py): the error against
the float64 reference is at most twice that of the naive float16 computation
(float softmax, P rounded to float16, float32 accumulation).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ISAS, to_pages
from naive_bf16 import check_naive_contract

import fastattn
from fastattn import _kernels

F16 = np.dtype(np.float16)
sdpa = fastattn.scaled_dot_product_attention
pytestmark = pytest.mark.skipif("amx" not in ISAS, reason="no AMX path (real or emulated) here")
ON_TILES = _kernels.amx_fp16_usable()
tiles_only = pytest.mark.skipif(not ON_TILES, reason="no AMX-FP16 on this CPU (and not the emulated build)")


@pytest.fixture(autouse=True)
def amx_isa():
    before = fastattn.get_isa()
    fastattn.set_isa("amx")
    try:
        yield
    finally:
        fastattn.set_isa(before)


def rnd(rng, shape, mag=1.0):
    return (rng.standard_normal(shape) * mag).astype(np.float32).astype(F16)


def check_contract(q, k, v, *, factor=2.0, **kw):
    """float16 output within ``factor`` x the naive error with P in float16."""
    assert q.dtype == F16
    return check_naive_contract(sdpa, q, k, v, p_dtype=F16, factor=factor, **kw)[0]


def float32_compute(q, k, v, **kw):
    fastattn.set_isa("avx512")
    try:
        return sdpa(q, k, v, **kw)
    finally:
        fastattn.set_isa("amx")


def test_config_reports_the_fp16_path():
    c = fastattn._config.config()
    assert c["amx_fp16 (float16 inputs on the tiles, isa amx)"] is ON_TILES
    assert c["cpu_features"]["amx_fp16"] in (True, False)
    if not c["amx_emulated (FASTATTN_EMULATE_AMX, tests only)"]:
        assert ON_TILES == c["cpu_features"]["amx_fp16"]


@pytest.mark.skipif(ON_TILES, reason="this CPU/build puts float16 on the tiles")
def test_without_amx_fp16_float16_keeps_float32_compute(rng):
    """No AMX-FP16: the amx path gives float16 prefill the float32 kernel's bits
    (not the bf16 tiles)."""
    q, k, v = rnd(rng, (1, 2, 64, 64)), rnd(rng, (1, 2, 256, 64)), rnd(rng, (1, 2, 256, 64))
    np.testing.assert_array_equal(sdpa(q, k, v).view(np.uint16), float32_compute(q, k, v).view(np.uint16))


@tiles_only
def test_tile_path_taken(rng):
    """P is rounded to float16 on the tiles, so prefill differs from the float32
    kernel; decode (< 32 rows) is that kernel bit for bit."""
    q, k, v = rnd(rng, (1, 2, 64, 64)), rnd(rng, (1, 2, 256, 64)), rnd(rng, (1, 2, 256, 64))
    assert np.any(sdpa(q, k, v).view(np.uint16) != float32_compute(q, k, v).view(np.uint16))
    np.testing.assert_array_equal(
        sdpa(q[:, :, :1], k, v).view(np.uint16), float32_compute(q[:, :, :1], k, v).view(np.uint16)
    )


@tiles_only
@pytest.mark.parametrize("L,S", [(32, 1), (33, 32), (47, 33), (65, 65), (129, 128), (131, 300), (257, 97)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_edges(rng, L, S, causal):
    q, k, v = rnd(rng, (1, 2, L, 40)), rnd(rng, (1, 2, S, 40)), rnd(rng, (1, 2, S, 24))
    check_contract(q, k, v, is_causal=causal)


@tiles_only
@pytest.mark.parametrize("D,Dv", [(1, 1), (31, 33), (64, 64), (80, 48), (128, 128), (256, 96)])
def test_head_dims(rng, D, Dv):
    q, k, v = rnd(rng, (1, 2, 70, D)), rnd(rng, (1, 2, 90, D)), rnd(rng, (1, 2, 90, Dv))
    check_contract(q, k, v, is_causal=True)


@tiles_only
@pytest.mark.parametrize("mkind", ["bool", "float32"])
def test_masks_gqa(rng, mkind):
    q, k, v = rnd(rng, (2, 4, 45, 33)), rnd(rng, (2, 2, 131, 33)), rnd(rng, (2, 2, 131, 33))
    if mkind == "bool":
        m = rng.random((4, 45, 131)) > 0.3
        m[1, 3] = False  # a fully masked row: zeros
    else:
        m = rng.standard_normal((4, 1, 131)).astype(np.float32)
    o = check_contract(q, k, v, attn_mask=m, is_causal=True, enable_gqa=True)
    if mkind == "bool":
        assert np.all(o[:, 1, 3].astype(np.float32) == 0)


@tiles_only
@pytest.mark.parametrize("opt", ["window", "alibi", "softcap", "sinks", "key_lengths"])
def test_options(rng, opt):
    B, Hq, Hk, L, S, D = 2, 4, 2, 70, 150, 64
    q, k, v = rnd(rng, (B, Hq, L, D)), rnd(rng, (B, Hk, S, D)), rnd(rng, (B, Hk, S, D))
    kw = {
        "window": {"window": (40, 0), "is_causal": True},
        "alibi": {"alibi_slopes": np.linspace(0.01, 0.2, Hq)},
        "softcap": {"softcap": 3.0, "scale": 1.0},
        "sinks": {"sinks": np.linspace(-1.0, 2.0, Hq)},
        "key_lengths": {"key_lengths": np.array([150, 0]), "is_causal": True},
    }[opt]
    check_contract(q, k, v, enable_gqa=True, **kw)


@tiles_only
def test_long_rows_and_dominant_key(rng):
    """Full 256-key tiles over several row blocks; a dominant key late in a tile
    (the row max must see every score vector), where float16's range matters."""
    q, k, v = rnd(rng, (1, 2, 600, 64)), rnd(rng, (1, 2, 700, 64)), rnd(rng, (1, 2, 700, 64))
    k[:, :, 300] = (q[:, :, :1].astype(np.float32) * 3.0).astype(F16).reshape(1, 2, 64)
    check_contract(q, k, v)


@tiles_only
def test_thread_counts_bit_identical(rng):
    q, k, v = rnd(rng, (2, 4, 300, 64)), rnd(rng, (2, 2, 300, 64)), rnd(rng, (2, 2, 300, 64))
    a = sdpa(q, k, v, is_causal=True, enable_gqa=True, num_threads=1)
    for t in (2, 3):
        b = sdpa(q, k, v, is_causal=True, enable_gqa=True, num_threads=t)
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@tiles_only
@pytest.mark.parametrize("page", [1, 16, 48])
def test_paged_prefill_is_the_contiguous_cache_bit_for_bit(rng, page):
    """float16 pages (block_table) on the AMX-FP16 tiles: each tile's rows gathered
    through the table, so bit for bit the contiguous cache; the float32-compute
    kernel's output differs (the tiles are really taken)."""
    B, Hq, Hk, D, Lq, S = 2, 8, 2, 64, 40, 130
    lens = np.array([130, 77])
    k, v, q = rnd(rng, (B, Hk, S, D)), rnd(rng, (B, Hk, S, D)), rnd(rng, (B, Hq, Lq, D))
    kv, bt = to_pages(rng, np.concatenate([k, v], axis=-1), page)  # one table for K and V
    kp, vp = kv[..., :D], kv[..., D:]
    want = fastattn.attention_with_kvcache(q, k, v, lens)
    got = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    fastattn.set_isa("avx512")
    vec = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt)
    assert np.any(vec.view(np.uint16) != got.view(np.uint16))
