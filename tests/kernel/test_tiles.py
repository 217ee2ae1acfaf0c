"""The row block (stacked query rows per task) derived from the L2 size, its
override (``fastattn.set_tiles`` / ``FASTATTN_TILES``) and the cache sizes read
by cpuid, against the OS's own account (sysfs) and the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ISAS, check_sdpa, optional, randn

import fastattn
from fastattn import _kernels

sdpa = fastattn.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _derived_tiles():
    fastattn.set_tiles(None)
    yield
    fastattn.set_tiles(None)


def _sysfs_caches() -> dict[int, int]:
    """Data/unified cache size per level of cpu0 as Linux reports it (bytes)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    out: dict[int, int] = {}
    for d in sorted(base.glob("index*")):
        try:
            level = int((d / "level").read_text())
            ctype = (d / "type").read_text().strip()
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        if ctype == "Instruction":
            continue
        mult = {"K": 1024, "M": 1024 * 1024}.get(size[-1], 1)
        out[level] = int(size.rstrip("KM")) * mult
    return out


def test_cache_sizes_match_the_os():
    got = _kernels.cache_sizes()
    assert set(got) == {"l1d", "l2", "l3"} and all(isinstance(v, int) and v >= 0 for v in got.values())
    sysfs = _sysfs_caches()
    if not sysfs or not sys.platform.startswith("linux"):
        pytest.skip("no sysfs cache description here")
    # cpuid's deterministic cache parameters and the kernel's account agree on
    # the per-core caches (L3 may be reported per socket or per CCX).
    if got["l1d"]:
        assert got["l1d"] == sysfs.get(1)
    if got["l2"]:
        assert got["l2"] == sysfs.get(2)


def _expected_rows(isa: str, D: int, Dv: int, L: int, dtype: str, heads: int = 1) -> int:
    """The rule of csrc/tiles.c, written again from its comment."""
    l2 = _kernels.cache_sizes()["l2"]
    short_l2 = True  # the kernel_impl.h kernels; the AMX kernel keeps its short block
    if dtype == "bfloat16" and isa in ("amx", "avx512bf16") and L >= 32:
        short_l2 = False
        short, rows_max, mult, longr = 128, 512, 32, 512
        row = 4 * -(-D // 32) * 32 + 4 * -(-Dv // 32) * 32 + 96
    else:
        if isa in ("amx", "avx512bf16", "avx512"):
            vw, bn, short, mult, longr = 16, 128, 96, 12, 96
        elif isa == "avx2":
            vw, bn, short, mult, longr = 8, 64, 96, 6, 192
        else:
            vw, bn, short, mult, longr = 1, 64, 32, 4, 32  # kernel_f32_scalar.c
        if dtype == "float64":  # kernel_f64_scalar.c on every ISA
            vw, bn, short, mult, longr = 1, 64, 32, 4, 32
        rows_max = 1024
        row = (-(-D // vw) * vw + bn + -(-Dv // vw) * vw) * (8 if dtype == "float64" else 4)
    if L < 1024 and not short_l2:
        return short
    r = longr if l2 <= 0 else min(max(int(0.28 * l2) // row // mult * mult, short), rows_max)
    if L < 1024:  # the L2 block while at least 32 tasks remain
        r = max(min(r, heads * L // 32), short)
    return r


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize(
    "D,Dv,L,dtype",
    [
        (64, 64, 1024, "float32"),
        (128, 128, 4096, "float32"),
        (64, 64, 1023, "float32"),
        (160, 160, 2048, "float32"),
        (40, 24, 2048, "float32"),
        (64, 64, 2048, "float64"),
        (64, 64, 1024, "bfloat16"),
        (128, 128, 100, "bfloat16"),
    ],
)
def test_derived_rows_follow_the_rule(isa_name, D, Dv, L, dtype):
    prev = fastattn.get_isa()
    fastattn.set_isa(isa_name)
    try:
        assert _kernels.tiles_rows(D, Dv, L, dtype) == _expected_rows(isa_name, D, Dv, L, dtype)
        # short calls with many heads: the L2 block while 32 tasks remain
        for heads in (4, 32, 128):
            got = _kernels.tiles_rows(D, Dv, L, dtype, heads=heads)
            assert got == _expected_rows(isa_name, D, Dv, L, dtype, heads)
    finally:
        fastattn.set_isa(prev)


def test_short_calls_keep_enough_tasks():
    # B * H * L / rows >= 32 whenever the derived block is above the short one
    for D in (64, 128):
        for L in (64, 256, 512, 1000):
            for heads in (1, 8, 32, 256):
                short = _kernels.tiles_rows(D, D, L, "float32")
                rows = _kernels.tiles_rows(D, D, L, "float32", heads=heads)
                assert rows >= short
                if rows > short:
                    assert heads * L // rows >= 32
    with pytest.raises(ValueError, match="heads must be >= 1"):
        _kernels.tiles_rows(64, 64, 512, "float32", heads=0)


def _expected_band_rows(isa: str, D: int, Dv: int, L: int, dtype: str) -> int:
    """The causal/windowed rule of csrc/tiles.c (float32 and float64 kernels):
    the L2 rule at every L, at most L / 2, at least the short block."""
    short = _expected_rows(isa, D, Dv, 1, dtype)
    mult = {"avx2": 6, "scalar": 4}.get(isa, 12) if dtype == "float32" else 4
    r = min(_expected_rows(isa, D, Dv, 1 << 20, dtype), L // 2 // mult * mult)
    return max(r, short)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("L", [100, 512, 1024, 2048, 4096, 16384])
@pytest.mark.parametrize("D", [64, 128, 160])
def test_causal_blocks_follow_the_band_rule(isa_name, L, D):
    prev = fastattn.get_isa()
    fastattn.set_isa(isa_name)
    try:
        for dtype in ("float32", "float64"):
            band = _expected_band_rows(isa_name, D, D, L, dtype)
            assert _kernels.tiles_rows(D, D, L, dtype, True) == band
        # the AMX kernel skips masked tiles per group of 32 rows and keeps its
        # plain rule for causal calls
        if isa_name in ("amx", "avx512bf16") and L >= 32:
            bf = _kernels.tiles_rows(D, D, L, "bfloat16")
            assert _kernels.tiles_rows(D, D, L, "bfloat16", True) == bf
    finally:
        fastattn.set_isa(prev)


def test_derived_rows_grow_with_the_cache():
    # The shape of the rule: long sequences never take fewer rows than short ones,
    # and larger heads never take more (for the same kernel).
    for dtype in ("float32", "float64"):
        short = _kernels.tiles_rows(64, 64, 512, dtype)
        assert _kernels.tiles_rows(64, 64, 4096, dtype) >= short
        assert _kernels.tiles_rows(128, 128, 4096, dtype) <= _kernels.tiles_rows(64, 64, 4096, dtype)


@pytest.mark.parametrize("rows", [1, 5, 97, 600, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_forced_rows_against_reference(isa, rng, rows, causal):
    fastattn.set_tiles(rows)
    assert fastattn.get_tiles() == rows
    # L >= 1024 takes the (forced) long block; GQA 4 stacks 4 heads per position, so a
    # block of 1 or 5 rows still holds a whole group; L != S exercises the causal offset.
    q, k, v = randn(rng, (1, 4, 1030, 24)), randn(rng, (1, 1, 1100, 24)), randn(rng, (1, 1, 1100, 16))
    check_sdpa(q, k, v, is_causal=causal, enable_gqa=True)
    # decode: a single row with long tiles (the scratch must hold its 512 scores)
    q1 = randn(rng, (1, 2, 1, 64))
    k1, v1 = randn(rng, (1, 2, 1300, 64)), randn(rng, (1, 2, 1300, 64))
    check_sdpa(q1, k1, v1)


@pytest.mark.parametrize("rows", [7, 200])
def test_forced_rows_bit_identical_over_threads(isa, rng, rows):
    fastattn.set_tiles(rows)
    q, k, v = randn(rng, (2, 4, 1100, 32)), randn(rng, (2, 4, 1100, 32)), randn(rng, (2, 4, 1100, 32))
    outs = [sdpa(q, k, v, is_causal=True, num_threads=n) for n in (1, 2, 3)]
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])


def test_bfloat16_forced_rows(rng):
    ml_dtypes = optional("ml_dtypes")
    for rows in (32, 100, 512):
        fastattn.set_tiles(rows)
        q = randn(rng, (1, 4, 1050, 64)).astype(ml_dtypes.bfloat16)
        k = randn(rng, (1, 4, 1050, 64)).astype(ml_dtypes.bfloat16)
        v = randn(rng, (1, 4, 1050, 64)).astype(ml_dtypes.bfloat16)
        out = sdpa(q, k, v, is_causal=True).astype(np.float64)
        ref = fastattn.reference.scaled_dot_product_attention(
            q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), is_causal=True
        )
        # bf16 contract (tests/kernel/test_amx.py): well within the bf16 rounding of P and the output
        assert np.max(np.abs(out - ref)) < 2e-2


@pytest.mark.parametrize("D", [160, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_large_head_dims_at_the_derived_block(isa, rng, D, causal):
    # D > 128 takes the L2 rule at L >= 1024 (more rows than the short block
    # where L2 is large); the block's last rows and the partial last key tile
    # (1050 = 8 * 128 + 26) included.
    q, k, v = randn(rng, (1, 2, 1050, D)), randn(rng, (1, 2, 1050, D)), randn(rng, (1, 2, 1050, D))
    check_sdpa(q, k, v, is_causal=causal)


@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("rows", [None, 7])
def test_qk_loop_orders_against_reference(isa, rng, D, rows):
    # Q.K^T runs row blocks outer while the packed K tile fits L1, panels outer
    # past it (kernel_impl.h, qk_packed): D = 64 keeps the row order on every
    # listed CPU, D = 256 takes panels on all of them, 96 / 128 depend on the
    # L1 size and the ISA's tile.  Both orders under every kind of partial
    # tile: the causal diagonal, a window's two edges, a boolean mask and
    # ALiBi (per element), a last key tile of 1100 - 17 * 64 = 12 keys, GQA
    # stacking, and a forced block of 7 rows (register blocks of unequal size).
    fastattn.set_tiles(rows)
    q, k, v = randn(rng, (1, 4, 300, D)), randn(rng, (1, 2, 1100, D)), randn(rng, (1, 2, 1100, D))
    check_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    check_sdpa(q, k, v, window=(150, 40), enable_gqa=True)
    mask = rng.random((1, 4, 300, 1100)) < 0.7
    check_sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    check_sdpa(q, k, v, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), enable_gqa=True)
    outs = [sdpa(q, k, v, is_causal=True, enable_gqa=True, num_threads=n) for n in (1, 2, 3)]
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])


@pytest.mark.parametrize("D", [40, 64, 128])
def test_head_k_buffer_against_reference(isa, rng, D):
    # Non-causal prefill with at least 3 query blocks per (batch, kv head):
    # each thread packs a head's K once into its head buffer and its later
    # tasks of that head read it (kernel_impl.h, head_keys).  Forced 48-row
    # blocks (300 x 2 GQA rows: 13 tasks per head), two batches and two kv
    # heads (the buffer changes hands), a last key tile of 700 - 10 * 64 =
    # 60 keys, D = 40 (not whole vectors); per-batch key lengths (another key
    # range per batch); a block mask that hides whole key tiles from some
    # tasks only (a gap in the packed tiles: the first tasks of a head
    # skip them); a second call of the same shapes
    # with other K on one thread, which must not see the first call's packed K; float16 K
    # and V (K converted while packed); and the same bits on 1, 2 and 3 threads.
    fastattn.set_tiles(48)
    q, k, v = randn(rng, (2, 4, 300, D)), randn(rng, (2, 2, 700, D)), randn(rng, (2, 2, 700, D))
    check_sdpa(q, k, v, enable_gqa=True)
    # One (batch, kv head) on one thread: the second call's first task has the
    # key of the first call's last one.
    q1, k1, v1 = q[:1, :2], k[:1, :1], v[:1, :1]
    check_sdpa(q1, k1, v1, enable_gqa=True, num_threads=1)
    check_sdpa(q1, randn(rng, (1, 1, 700, D)), v1, enable_gqa=True, num_threads=1)
    check_sdpa(q, k, v, enable_gqa=True, key_lengths=np.array([700, 333]))
    bm = rng.random((2, 4, 4, 11)) < 0.6
    bm[:, :, 0, 2:5] = False  # tiles 2..4 hidden from the first 3 tasks of every head only
    for n in (1, 2):
        check_sdpa(q, k, v, enable_gqa=True, block_mask=bm, block_size=(75, 64), num_threads=n)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    o16 = sdpa(q, k16, v16, enable_gqa=True)
    r16 = fastattn.reference.scaled_dot_product_attention(
        q.astype(np.float64), k16.astype(np.float64), v16.astype(np.float64), enable_gqa=True
    )
    assert np.max(np.abs(o16 - r16)) < 1e-4
    outs = [sdpa(q, k, v, enable_gqa=True, num_threads=n) for n in (1, 2, 3)]
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])


@pytest.mark.parametrize("D", [160, 256])
def test_bfloat16_large_head_dims_at_the_derived_block(rng, D):
    ml_dtypes = optional("ml_dtypes")
    q, k, v = (randn(rng, (1, 2, 1050, D)).astype(ml_dtypes.bfloat16) for _ in range(3))
    for causal in (False, True):
        out = sdpa(q, k, v, is_causal=causal).astype(np.float64)
        ref = fastattn.reference.scaled_dot_product_attention(
            q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), is_causal=causal
        )
        # bf16 contract (tests/kernel/test_amx.py): well within the bf16 rounding of P and the output
        assert np.max(np.abs(out - ref)) < 2e-2


def test_set_tiles_checks():
    with pytest.raises(TypeError, match="rows must be an int"):
        fastattn.set_tiles(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rows must be an int"):
        fastattn.set_tiles(True)
    for bad in (0, -3, 4097):
        with pytest.raises(ValueError, match=r"rows must be in \[1, 4096\]"):
            fastattn.set_tiles(bad)
    assert fastattn.get_tiles() is None


def test_show_config_reports_tiles():
    cfg = fastattn._config.config()
    assert cfg["caches (L1d, L2, L3 bytes per core)"] == _kernels.cache_sizes()
    assert cfg["rows per task (float32, L >= 1024, D = 64 / 128)"] == (
        _kernels.tiles_rows(64, 64, 1024, "float32"),
        _kernels.tiles_rows(128, 128, 1024, "float32"),
    )


def _import_with_env(value: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FASTATTN_TILES=value)
    code = "import fastattn; print(fastattn.get_tiles())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_env_knob():
    r = _import_with_env("200")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "200"
    # an invalid value is ignored with a warning naming it (fastattn._config's docstring)
    r = _import_with_env("lots")
    assert r.returncode == 0 and r.stdout.strip() == "None" and "FASTATTN_TILES='lots' ignored" in r.stderr
    r = _import_with_env("0")
    assert r.returncode == 0 and r.stdout.strip() == "None" and "FASTATTN_TILES='0' ignored" in r.stderr
