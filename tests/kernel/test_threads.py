"""Thread counts: results are bit-identical for every count (the work split
depends on shapes only), and the default count follows the documented rules."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import check_sdpa, optional, randn

import fastattn

sdpa = fastattn.scaled_dot_product_attention

SHAPES = [  # (q shape, k/v shape, kwargs)
    ((1, 8, 1, 64), (1, 8, 4096, 64), {}),  # decode: split-KV
    ((1, 8, 1, 64), (1, 2, 4096, 64), {"enable_gqa": True}),  # GQA decode
    ((2, 1, 3, 64), (2, 1, 3000, 64), {"is_causal": True}),  # few rows, long keys
    ((2, 4, 200, 32), (2, 2, 333, 32), {"enable_gqa": True, "is_causal": True}),
    ((1, 3, 97, 16), (1, 3, 1000, 16), {"mask": True}),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("qs,ks,kw", SHAPES)
def test_bit_identical_across_thread_counts(rng, dtype, qs, ks, kw):
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, ks, dtype)
    kw = dict(kw)
    if kw.pop("mask", False):
        kw["attn_mask"] = rng.random((qs[-2], ks[-2])) > 0.2
    results = [sdpa(q, k, v, return_lse=True, num_threads=n, **kw) for n in (1, 2, 3)]
    for o, lse in results[1:]:
        np.testing.assert_array_equal(o, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])
    check_sdpa(q, k, v, num_threads=2, **kw)


def test_num_threads_none_uses_default(rng):
    q, k, v = randn(rng, (1, 4, 1, 64)), randn(rng, (1, 4, 2000, 64)), randn(rng, (1, 4, 2000, 64))
    before = fastattn.get_num_threads()
    try:
        fastattn.set_num_threads(3)
        assert fastattn.get_num_threads() == 3
        a = sdpa(q, k, v)
        fastattn.set_num_threads(1)
        assert fastattn.get_num_threads() == 1
        b = sdpa(q, k, v)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, sdpa(q, k, v, num_threads=2))
    finally:
        fastattn.set_num_threads(None)
    assert fastattn.get_num_threads() == before


def _child_threads(env_extra):
    """get_num_threads() in a fresh interpreter with the given environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FASTATTN_NUM_THREADS")}
    env.update(env_extra)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env["PYTHONPATH"] = pkg_parent
    code = "import fastattn, numpy as np; print(fastattn.get_num_threads())"
    with tempfile.TemporaryDirectory() as d:  # a cwd that holds no fastattn source
        r = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=d
        )
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1])


def test_omp_num_threads_respected():
    assert _child_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert _child_threads({"OMP_NUM_THREADS": "1"}) == 1


def test_fastattn_num_threads_overrides_omp():
    assert _child_threads({"OMP_NUM_THREADS": "3", "FASTATTN_NUM_THREADS": "2"}) == 2


def test_threadpoolctl_limits():
    threadpoolctl = optional("threadpoolctl")
    if not fastattn._config.config()["openmp"]:
        pytest.skip("built without OpenMP")
    with threadpoolctl.threadpool_limits(limits=1, user_api="openmp"):
        assert fastattn.get_num_threads() == 1
