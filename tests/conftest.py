"""Shared helpers for the fastattn test suite.

Every test compares the kernel with :mod:`fastattn.reference` (a float64 NumPy
oracle) at a tolerance derived from the precision of the inputs.

With ``FASTATTN_TEST_INSTALLED=1`` (set by ``.ci/run``) the session refuses to
start unless ``fastattn`` was imported from an installed copy (site-packages),
so that CI tests what a user installs rather than the source tree.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import numpy as np
import pytest

import fastattn
from fastattn import _kernels
from fastattn import reference as ref

ISAS = [isa for isa in _kernels.ISA_NAMES if _kernels.cpu_has(isa)]
# FASTATTN_TEST_ISAS="neon sve": the ISA-parametrised tests run only these of the CPU's paths
# (tools/emulate_aarch64.sh: the scalar path's code is the same C as on x86, where it runs
# anyway, and under qemu every path costs minutes).  A name the CPU lacks is a usage error.
_TEST_ISAS = os.environ.get("FASTATTN_TEST_ISAS", "").split()
if _TEST_ISAS:
    ISAS = [isa for isa in ISAS if isa in _TEST_ISAS]

# Relative tolerances (relative to the output scale): float32 kernels
# accumulate in float32 and use a polynomial exp2; float64 kernels are exact
# to a few ulp of float64 per accumulated term.
TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-10}


def pytest_report_header(config):
    return f"fastattn {fastattn.__version__} from {os.path.dirname(fastattn.__file__)}; ISA paths: {ISAS}"


def pytest_configure(config):
    # An invalid FASTATTN_* knob is ignored with a warning at import; a session run with one
    # (FASTATTN_ISA=avx512 on a CPU without it) would test another path and pass: refuse.
    if fastattn._config.env_problems():
        raise pytest.UsageError("; ".join(fastattn._config.env_problems().values()))
    if not set(_TEST_ISAS) <= set(ISAS):
        raise pytest.UsageError(f"FASTATTN_TEST_ISAS={' '.join(_TEST_ISAS)}: this CPU's paths are {ISAS}")
    if os.environ.get("FASTATTN_TEST_INSTALLED") == "1":
        path = os.path.realpath(fastattn.__file__)
        if "site-packages" not in path and "dist-packages" not in path:
            raise pytest.UsageError(
                f"FASTATTN_TEST_INSTALLED=1 but fastattn was imported from {path}, not an installed copy"
            )


def optional(name: str) -> ModuleType:
    """Import the optional peer ``name`` (torch, jax, dask, ...) or skip the
    test (or, at module level, the module) when it is absent *or broken*.

    ``pytest.importorskip`` skips only on ModuleNotFoundError; an installed but
    broken peer (dask beside a mismatched distributed: ``ImportError: cannot
    import name ...``; a jaxlib that fails to load) then errors the test instead
    of skipping it.  Any exception at import skips here, and the reason names
    it.  fastattn's own modules are not optional: importing them goes through
    unguarded, so a bug in a front end can never turn into a skip."""
    if name == "fastattn" or name.startswith("fastattn."):
        return importlib.import_module(name)
    try:
        return importlib.import_module(name)
    except Exception as exc:  # absent, or present and broken: a skip either way, with the reason
        pytest.skip(f"optional {name!r} unusable: {type(exc).__name__}: {exc}", allow_module_level=True)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test under each ISA path this CPU has; restore the original after."""
    before = fastattn.get_isa()
    fastattn.set_isa(request.param)
    try:
        yield request.param
    finally:
        fastattn.set_isa(before)


def randn(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def to_pages(rng, x, page):
    """The (B, H, S, X) cache ``x`` as a pool of shuffled pages (num_pages, H, page, X)
    and its (B, ceil(S / page)) int32 block table; slots past S hold zeros."""
    B, H, S, X = x.shape
    per = -(-S // page)
    pad = np.zeros((B, H, per * page, X), x.dtype)
    pad[:, :, :S] = x
    bt = rng.permutation(B * per).reshape(B, per).astype(np.int32)
    pool = np.empty((B * per, H, page, X), x.dtype)
    pool[bt.ravel()] = pad.reshape(B, H, per, page, X).transpose(0, 2, 1, 3, 4).reshape(B * per, H, page, X)
    return pool, bt


def assert_close(out, expected, dtype=None, tol=None, what="output"):
    """Compare at ``tol`` relative to the scale of ``expected`` (max |expected|,
    at least 1); NaN and +-inf must sit at the same places."""
    out = np.asarray(out)
    expected = np.asarray(expected, dtype=np.float64)
    assert out.shape == expected.shape, f"{what}: shape {out.shape} != {expected.shape}"
    if tol is None:
        tol = TOL[np.dtype(dtype if dtype is not None else out.dtype)]
    o = out.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(o), np.isnan(expected), err_msg=f"{what}: NaN positions")
    inf = np.isinf(expected)
    np.testing.assert_array_equal(o[inf], expected[inf], err_msg=f"{what}: infinite values")
    fin = np.isfinite(expected)
    if not fin.any():
        return
    scale = max(1.0, float(np.abs(expected[fin]).max()))
    err = np.abs(o[fin] - expected[fin])
    assert np.all(np.isfinite(o[fin])), f"{what}: non-finite values where the reference is finite"
    assert err.max() <= tol * scale, f"{what}: max error {err.max():.3e} > {tol:.1e} * {scale:.3g}"


def check_sdpa(q, k, v, *, lse_too=True, **kw):
    """Run kernel and reference with the same arguments; compare output and LSE."""
    dt = np.dtype(np.float64 if np.asarray(q).dtype == np.float64 else np.float32)
    copies = [np.array(a, copy=True) for a in (q, k, v)]
    mask = kw.get("attn_mask")
    mcopy = None if mask is None else np.array(mask, copy=True)
    o, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    ro, rlse = ref.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    assert o.dtype == np.asarray(q).dtype.newbyteorder("=")
    assert lse.dtype == dt
    assert_close(o, ro, dt)
    if lse_too:
        assert_close(lse, rlse, dt, what="lse")
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)  # inputs never modified
    if mask is not None:
        np.testing.assert_array_equal(mask, mcopy)
    return o, lse


def under_asan():
    """True when AddressSanitizer's runtime is loaded (tools/sanitize.sh): its
    quarantine holds freed memory back, so resident memory grows by design."""
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False
