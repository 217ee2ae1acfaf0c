"""Every instruction-set path this CPU has: kernel against the reference at
tile boundaries, and the vectorised exp2 over its whole input range."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from conftest import ISAS, assert_close, check_sdpa, optional, randn

import fastattn
from fastattn import _kernels

sdpa = fastattn.scaled_dot_product_attention

# Query tiles are 32/96 rows (192 from L = 1024) and key tiles 64/128 keys: probe 1, tile-1,
# tile, tile+1 and primes.
LS = [(1, 1), (47, 63), (48, 64), (49, 65), (95, 127), (96, 128), (97, 129), (101, 257), (193, 131), (7, 300)]


@pytest.mark.parametrize("L,S", LS)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_boundaries(isa, rng, L, S, causal):
    q, k, v = randn(rng, (1, 2, L, 40)), randn(rng, (1, 2, S, 40)), randn(rng, (1, 2, S, 24))
    check_sdpa(q, k, v, is_causal=causal)


# From L = 1024 (D, Dv <= 128) tasks take the row block derived from the L2 size (csrc/tiles.c,
# tests/kernel/test_tiles.py; 192 rows on AVX2 with a 512 KiB L2): 1025 and 1031 rows leave a
# partial last block for most blocks; with GQA 2 heads stack half as many positions per task.
@pytest.mark.parametrize("L,G,causal", [(1024, 1, True), (1025, 1, False), (1031, 2, True)])
def test_long_query_blocks(isa, rng, L, G, causal):
    q, k, v = randn(rng, (1, 2 * G, L, 32)), randn(rng, (1, 2, L + 3, 32)), randn(rng, (1, 2, L + 3, 24))
    check_sdpa(q, k, v, is_causal=causal, enable_gqa=True)


@pytest.mark.parametrize("D", [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 80, 128, 256])
def test_head_dims(isa, rng, D):
    q, k, v = randn(rng, (1, 2, 50, D)), randn(rng, (1, 2, 70, D)), randn(rng, (1, 2, 70, D))
    check_sdpa(q, k, v, is_causal=True)


@pytest.mark.parametrize("mdtype", [np.bool_, np.float32, np.float64])
def test_masks_gqa_layout(isa, rng, mdtype):
    q, k, v = randn(rng, (2, 30, 4, 33)), randn(rng, (2, 131, 2, 33)), randn(rng, (2, 131, 2, 33))
    m = rng.random((4, 30, 131)) > 0.3 if mdtype is np.bool_ else randn(rng, (4, 1, 131), mdtype)
    check_sdpa(q, k, v, attn_mask=m, is_causal=True, enable_gqa=True, layout="bshd")


def test_decode_split_kv(isa, rng):
    q, k, v = randn(rng, (1, 4, 1, 64)), randn(rng, (1, 4, 3001, 64)), randn(rng, (1, 4, 3001, 64))
    check_sdpa(q, k, v)


# Up to 8 stacked rows (GQA heads x query positions) read K and V in place; a single
# row takes 512-key tiles (whole-row V accumulators for 4, 8, 12 or 16 vectors):
# probe tile-1, tile, tile+1 and several tiles.
@pytest.mark.parametrize("S", [1, 511, 512, 513, 1300])
@pytest.mark.parametrize("D,Dv", [(32, 32), (64, 64), (96, 96), (128, 128), (256, 128), (64, 80)])
def test_single_row_long_tiles(isa, rng, S, D, Dv):
    q, k, v = randn(rng, (1, 3, 1, D)), randn(rng, (1, 3, S, D)), randn(rng, (1, 3, S, Dv))
    check_sdpa(q, k, v)


@pytest.mark.parametrize("S", [2, 511, 513, 1300])
@pytest.mark.parametrize("G,L", [(2, 1), (3, 1), (4, 1), (1, 3), (2, 2)])
@pytest.mark.parametrize("Dv", [64, 72])
def test_few_rows_long_tiles(isa, rng, S, G, L, Dv):
    q, k, v = randn(rng, (1, 2 * G, L, 64)), randn(rng, (1, 2, S, 64)), randn(rng, (1, 2, S, Dv))
    check_sdpa(q, k, v, is_causal=L > 1, enable_gqa=True)


@pytest.mark.parametrize("S", [1, 63, 65, 700])
@pytest.mark.parametrize("G,L", [(5, 1), (6, 1), (7, 1), (8, 1), (4, 2), (3, 2), (1, 8)])
@pytest.mark.parametrize("D,Dv", [(64, 64), (72, 40), (20, 24)])
def test_decode_5_to_8_rows(isa, rng, S, G, L, D, Dv):
    """5-8 stacked rows per key/value head (GQA groups up to 8, or a few query
    positions) take the decode path with one accumulator per row."""
    q, k, v = randn(rng, (2, 2 * G, L, D)), randn(rng, (2, 2, S, D)), randn(rng, (2, 2, S, Dv))
    check_sdpa(q, k, v, is_causal=L > 1, enable_gqa=True)


@pytest.mark.parametrize("G,L", [(9, 1), (16, 1), (32, 2), (4, 16), (1, 65), (13, 5)])
@pytest.mark.parametrize("Dv", [24, 40, 136, 256])
@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_v_column_panels(isa, rng, G, L, Dv, dt):
    """Prefill-path tasks with few rows (large GQA groups, short chunks) or Dv > 128
    copy V into column panels first; full and tail panels, converted dtypes."""
    q = randn(rng, (1, 2 * G, L, 48))
    k, v = randn(rng, (1, 2, 300, 48)).astype(dt), randn(rng, (1, 2, 300, Dv)).astype(dt)
    check_sdpa(q, k, v, is_causal=L > 1, enable_gqa=True)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("opt", ["none", "window", "softcap", "alibi", "key_lengths"])
def test_single_row_long_tiles_options(isa, rng, dt, opt):
    from fastattn import reference as ref

    dtype = np.dtype(np.float16) if dt == "float16" else np.dtype(optional("ml_dtypes").bfloat16)
    B = 2 if opt == "key_lengths" else 1
    for G in (1, 4, 8):  # one row; four and eight stacked GQA rows
        opts = {
            "none": {},
            "window": {"window": (700, 0), "is_causal": True},
            "softcap": {"softcap": 5.0},
            "alibi": {"alibi_slopes": np.linspace(0.005, 0.02, 3 * G)},
            "key_lengths": {"key_lengths": [1029, 3]},
        }[opt]
        q = randn(rng, (B, 3 * G, 1, 128))
        k, v = (randn(rng, (B, 3, 1537, 128)).astype(dtype) for _ in range(2))
        o = sdpa(q, k, v, enable_gqa=True, **opts)
        assert_close(o, ref.scaled_dot_product_attention(q, k, v, enable_gqa=True, **opts), np.float32)


@pytest.mark.parametrize("D", [64, 128, 96])
def test_decode_rows_head_sizes(isa, rng, D):
    """Decode rows (one row, and 2-8 stacked GQA rows) at the head sizes whose
    dot products are unrolled as constants (64, 128) and at one that is not;
    float32 K/V read in place, a key count that is no multiple of the key
    blocks, and per-batch key lengths."""
    from fastattn import reference as ref

    for G in (1, 2, 3, 4, 8):
        q = randn(rng, (2, 2 * G, 1, D))
        k, v = randn(rng, (2, 2, 1031, D)), randn(rng, (2, 2, 1031, D))
        for opts in ({}, {"key_lengths": [1031, 7]}):
            o = sdpa(q, k, v, enable_gqa=True, **opts)
            assert_close(o, ref.scaled_dot_product_attention(q, k, v, enable_gqa=True, **opts), np.float32)


@pytest.mark.parametrize("dt", ["float32", "float16"])
@pytest.mark.parametrize("G,L", [(2, 1), (4, 1), (8, 1), (3, 2)])
def test_decode_rows_beyond_l3(isa, rng, dt, G, L):
    """2-8 stacked decode rows whose K and V exceed half the L3 (from cpuid): their
    P.V prefetches the next tile's K rows (pv_rows).  The call's first n keys (key
    lengths, so that the tiles are the same) bit for bit against the same keys in
    arrays small enough to take no prefetch, and those against the reference."""
    from fastattn import reference as ref

    l3 = _kernels.cache_sizes()["l3"]
    if l3 > 128 << 20:
        pytest.skip("an L3 over 128 MiB would need K and V over 64 MiB here")
    esize = np.dtype(dt).itemsize
    S = l3 // (2 * 2 * 128 * esize) + 300 if l3 else 1100  # 2 heads, K and V rows of 128
    n = 1000  # keys visible: 7 whole 128-key tiles and part of one (avx2: 15 and part of 16)
    q = randn(rng, (1, 2 * G, L, 128))
    k, v = (randn(rng, (1, 2, S, 128)).astype(dt) for _ in range(2))
    opts = {"enable_gqa": True, "is_causal": L > 1}
    ks, vs = k[:, :, :n].copy(), v[:, :, :n].copy()
    small = sdpa(q, ks, vs, **opts)
    np.testing.assert_array_equal(sdpa(q, k, v, key_lengths=[n], **opts), small)
    assert_close(small, ref.scaled_dot_product_attention(q, ks, vs, **opts), np.float32)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_16bit_conversion(isa, rng, dt):
    from fastattn import reference as ref

    dtype = np.dtype(np.float16) if dt == "float16" else np.dtype(optional("ml_dtypes").bfloat16)
    q = randn(rng, (1, 2, 49, 24))
    k, v = (randn(rng, (1, 2, 65, 24)).astype(dtype) for _ in range(2))
    assert_close(sdpa(q, k, v), ref.scaled_dot_product_attention(q, k, v), np.float32)


def test_paths_agree(rng):
    """All available paths give the same result to float32 accuracy."""
    q, k, v = randn(rng, (2, 3, 97, 64)), randn(rng, (2, 3, 129, 64)), randn(rng, (2, 3, 129, 64))
    before = fastattn.get_isa()
    outs = []
    try:
        for i in ISAS:
            fastattn.set_isa(i)
            assert fastattn.get_isa() == i
            outs.append(sdpa(q, k, v, is_causal=True))
    finally:
        fastattn.set_isa(before)
    for o in outs[1:]:
        assert_close(o, outs[0], np.float32)


def test_unavailable_isa_rejected():
    missing = [i for i in _kernels.ISA_NAMES if not _kernels.cpu_has(i)]
    if not missing:
        pytest.skip("this CPU has every ISA path")
    before = fastattn.get_isa()
    with pytest.raises(ValueError, match=missing[0]):
        fastattn.set_isa(missing[0])
    assert fastattn.get_isa() == before
    with pytest.raises(ValueError):
        _kernels.exp2(np.zeros(4, np.float32), missing[0])


def test_paths_of_the_architecture():
    """x86 paths only on x86-64; on Arm64 the NEON path always, the SVE path
    exactly where the vector length has a unit (256 or 512 bits), each the
    default where present."""
    arm64 = platform.machine().lower() in ("aarch64", "arm64")
    x86 = [i for i in ("avx2", "avx512", "amx", "avx512bf16") if _kernels.cpu_has(i)]
    feats = _kernels.cpu_features()
    assert _kernels.cpu_has("neon") == feats["neon"] == arm64
    if not arm64:
        assert not _kernels.cpu_has("sve") and feats["sve_bits"] == 0
        return
    assert x86 == []
    built = fastattn._config.config()["sve_built (Arm64, compiler has fixed-length SVE)"]
    sve = feats["sve_bits"] in (256, 512) and built
    assert _kernels.cpu_has("sve") == sve
    assert _kernels.isa_best() == ("sve" if sve else "neon")


def test_scalar_always_available():
    assert _kernels.cpu_has("scalar")
    assert fastattn.get_isa() in ISAS


# --- exp2 --------------------------------------------------------------------


def _exp2_inputs():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    grid = np.linspace(-152.0, 130.0, 1_000_001, dtype=np.float32)
    ints = np.arange(-160, 140, dtype=np.float32)
    halves = ints + np.float32(0.5)
    small = np.float32(2.0) ** np.arange(-149, 0, dtype=np.float32)  # tiny |x| around 1.0
    special = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            127.99999,
            128.0,
            -126.0,
            -149.0,
            -149.5,
            -150.0,
            -150.5,
            1e30,
            -1e30,
            np.finfo(np.float32).max,
            -np.finfo(np.float32).max,
        ],
        np.float32,
    )
    x = np.concatenate([bits, grid, ints, halves, small, -small, special])
    with np.errstate(over="ignore", invalid="ignore"):
        return x, np.exp2(x.astype(np.float64))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 16, 17, 33])
def test_exp2_lengths(isa, n):
    x = np.linspace(-3, 3, n).astype(np.float32)
    y = _kernels.exp2(x, isa)
    assert y.shape == (n,) and y.dtype == np.float32
    np.testing.assert_allclose(y, np.exp2(x.astype(np.float64)), rtol=3e-7)


def test_exp2_whole_range(isa):
    x, exact = _exp2_inputs()
    x0 = x.copy()
    with np.errstate(over="ignore"):
        y = _kernels.exp2(x, isa).astype(np.float64)
        exact32 = exact.astype(np.float32).astype(np.float64)  # correctly rounded float32
    np.testing.assert_array_equal(x, x0)  # input untouched
    nan = np.isnan(x)
    assert np.all(np.isnan(y[nan])), "NaN -> NaN"
    fin = ~nan
    y, exact, exact32, x = y[fin], exact[fin], exact32[fin], x[fin]
    assert not np.any(np.isnan(y)), "NaN from a non-NaN input"
    assert np.all(y >= 0)

    tiny, fmax = 2.0**-126, float(np.finfo(np.float32).max)
    normal = (exact >= tiny) & (exact32 <= fmax)
    ulp = 2.0 ** (np.floor(np.log2(exact[normal])) - 23)
    err = np.abs(y[normal] - exact[normal]) / ulp
    worst = int(np.argmax(err))
    assert err.max() <= 2.0, f"{isa}: exp2({x[normal][worst]!r}) off by {err.max():.2f} ulp"

    sub = exact < tiny  # denormal results, underflow, -inf
    d = np.abs(y[sub] - exact32[sub])
    assert d.max() <= 2.0**-149, f"{isa}: denormal result off by {d.max() / 2.0**-149:.1f} x 2**-149"
    assert np.all(y[exact < 2.0**-151] == 0), "deep underflow must give 0"
    assert np.all(y[x == -np.inf] == 0)

    big = np.isinf(exact32)  # beyond the float32 range
    assert np.all(np.isinf(y[big]) & (y[big] > 0)), "overflow must give +inf"
    assert np.all(y[x == 0] == 1.0)
    ints = (x == np.round(x)) & (x >= -126) & (x <= 127)
    np.testing.assert_array_equal(y[ints], exact[ints])  # powers of two are exact


def test_exp2_paths_close():
    x, _ = _exp2_inputs()
    x = x[np.isfinite(x) & (np.abs(x) < 120)]
    ys = [_kernels.exp2(x, i).astype(np.float64) for i in ISAS]
    for y in ys[1:]:
        np.testing.assert_allclose(y, ys[0], rtol=4 * 2.0**-23)
