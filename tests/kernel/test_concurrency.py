"""Concurrency: many Python threads calling the kernels at once.

The kernels release the GIL, so calls from several Python threads really run
at the same time (each with its own OpenMP team when ``num_threads`` > 1).
Every concurrent result must be bit-identical to the same call made serially
(and that serial result matches :mod:`fastattn.reference`); inputs are never
modified.  Covered: ``scaled_dot_product_attention`` with different shapes,
dtypes, masks, variants and ``num_threads`` in {1, 2, 3}; ``varlen_attention``;
``KVCache.attend`` on one shared cache (concurrent ``attend`` is documented as
safe; ``append``/``reset`` concurrently with anything else are documented as
unsafe and are not exercised).
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
from conftest import assert_close, randn

import fastattn
from fastattn import reference as ref

N_THREADS = 8
ROUNDS = 3  # each Python thread runs its whole job list this many times


def _jobs(rng):
    """(name, callable, reference result or None) jobs over varied shapes, dtypes, masks, thread counts."""
    jobs = []
    sdpa = fastattn.scaled_dot_product_attention
    bf16 = ml_dtypes.bfloat16
    cases = [
        (np.float32, (1, 4, 1, 64), (1, 4, 1500, 64), dict(num_threads=3)),  # split-KV decode
        (np.float64, (2, 4, 37, 32), (2, 2, 53, 32), dict(enable_gqa=True, is_causal=True, num_threads=2)),
        (np.float32, (1, 2, 70, 16), (1, 2, 90, 16), dict(mask="bool", dv=24, num_threads=1)),
        (np.float16, (2, 2, 33, 64), (2, 2, 65, 64), dict(mask="float", num_threads=2)),
        (bf16, (1, 3, 40, 16), (1, 3, 40, 16), dict(window=(8, 0), softcap=30.0, num_threads=3)),
        (
            np.float32,
            (1, 4, 25, 32),
            (1, 4, 300, 32),
            dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), num_threads=2),
        ),
        (np.float64, (1, 2, 1, 16), (1, 2, 700, 16), dict(num_threads=3)),
        (np.float32, (3, 2, 9, 8), (3, 2, 31, 8), dict(key_lengths=np.array([31, 5, 0]), num_threads=1)),
    ]
    for dt, qs, ks, kw in cases:
        kw = dict(kw)
        q, k = randn(rng, qs, dt), randn(rng, ks, dt)
        v = randn(rng, ks[:-1] + (kw.pop("dv", ks[-1]),), dt)
        mask = kw.pop("mask", None)
        if mask == "bool":
            kw["attn_mask"] = rng.random((qs[-2], ks[-2])) > 0.3
        elif mask == "float":
            kw["attn_mask"] = randn(rng, (qs[-2], ks[-2]), np.float32)
        ref_kw = {a: b for a, b in kw.items() if a != "num_threads"}
        expected = ref.scaled_dot_product_attention(q, k, v, return_lse=True, **ref_kw)
        name = f"sdpa {np.dtype(dt).name} q{qs} k{ks} {sorted(kw)}"
        jobs.append(
            (
                name,
                (lambda q=q, k=k, v=v, kw=kw: sdpa(q, k, v, return_lse=True, **kw)),
                expected,
                (q, k, v, kw.get("attn_mask")),
            )
        )

    # varlen: three packed sequences (one empty query sequence), causal GQA
    cu_q, cu_k = np.array([0, 5, 5, 42]), np.array([0, 17, 30, 99])
    q, k, v = randn(rng, (42, 4, 32)), randn(rng, (99, 2, 32)), randn(rng, (99, 2, 16))
    for nt in (1, 2, 3):
        kw = dict(is_causal=True, enable_gqa=True, return_lse=True)
        expected = ref.varlen_attention(q, k, v, cu_q, cu_k, **kw)
        jobs.append(
            (
                f"varlen num_threads={nt}",
                (lambda nt=nt, kw=kw: fastattn.varlen_attention(q, k, v, cu_q, cu_k, num_threads=nt, **kw)),
                expected,
                (q, k, v, None),
            )
        )
    return jobs


def _kvcache_jobs(rng):
    """Concurrent attend calls on one shared, already-filled cache."""
    cache = fastattn.KVCache(3, 2, 256, 32, dtype=np.float16)
    cache.append(randn(rng, (3, 2, 200, 32), np.float16), randn(rng, (3, 2, 200, 32), np.float16))
    cache.append(
        randn(rng, (2, 2, 40, 32), np.float16), randn(rng, (2, 2, 40, 32), np.float16), batch_index=[0, 2]
    )
    jobs = []
    for lq, nt, dt in ((1, 1, np.float32), (4, 2, np.float16), (16, 3, np.float32)):
        q = randn(rng, (3, 4, lq, 32), dt)
        lens = cache.lengths.copy()
        kf = cache.k.astype(np.float64)
        vf = cache.v.astype(np.float64)
        expected = ref.scaled_dot_product_attention(
            q, kf, vf, is_causal=True, enable_gqa=True, key_lengths=lens, return_lse=True
        )
        jobs.append(
            (
                f"kvcache.attend Lq={lq} {np.dtype(dt).name}",
                (lambda q=q, nt=nt: cache.attend(q, num_threads=nt, return_lse=True)),
                expected,
                (q, cache.k, cache.v, None),
            )
        )
    return jobs, cache


def _run_concurrently(jobs):
    """Run every job ROUNDS times in each of N_THREADS Python threads (each
    thread in its own order, all started together); return per-thread results."""
    barrier = threading.Barrier(N_THREADS)
    results = [None] * N_THREADS
    errors = []

    def worker(t):
        order = np.random.default_rng(t).permutation(len(jobs) * ROUNDS) % len(jobs)
        mine = []
        try:
            barrier.wait()
            for j in order:
                mine.append((int(j), jobs[j][1]()))
        except BaseException as e:  # reported in the main thread
            errors.append((t, repr(e)))
        results[t] = mine

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a worker thread hung"
    assert not errors, errors
    return results


def _check(jobs, results):
    serial = [job[1]() for job in jobs]
    for (name, _, expected, _), (o, lse) in zip(jobs, serial):
        tol = 1e-10 if o.dtype == np.float64 else 1e-4 if o.dtype == np.float32 else 2e-2
        assert_close(o, expected[0], tol=tol, what=f"{name}: output")
        assert_close(lse, expected[1], tol=max(tol, 1e-4), what=f"{name}: lse")
    seen = 0
    for t, mine in enumerate(results):
        for j, (o, lse) in mine:
            np.testing.assert_array_equal(o, serial[j][0], err_msg=f"thread {t}, {jobs[j][0]}: output")
            np.testing.assert_array_equal(lse, serial[j][1], err_msg=f"thread {t}, {jobs[j][0]}: lse")
            seen += 1
    assert seen == N_THREADS * ROUNDS * len(jobs)


def test_sdpa_and_varlen_concurrent_bit_identical(isa):
    """Under each ISA path this CPU has (``isa`` sets it process-wide before the threads start)."""
    rng = np.random.default_rng(20)
    jobs = _jobs(rng)
    copies = [[None if a is None else np.array(a, copy=True) for a in job[3]] for job in jobs]
    results = _run_concurrently(jobs)
    _check(jobs, results)
    for job, cps in zip(jobs, copies):  # inputs never modified, even under concurrency
        for a, c in zip(job[3], cps):
            if a is not None:
                np.testing.assert_array_equal(a, c)


def test_kvcache_attend_concurrent_bit_identical():
    rng = np.random.default_rng(21)
    jobs, cache = _kvcache_jobs(rng)
    k0, v0, len0 = cache.k.copy(), cache.v.copy(), cache.lengths.copy()
    results = _run_concurrently(jobs)
    _check(jobs, results)
    np.testing.assert_array_equal(cache.k, k0)
    np.testing.assert_array_equal(cache.v, v0)
    np.testing.assert_array_equal(cache.lengths, len0)


def test_concurrent_calls_with_out_buffers_do_not_interfere():
    """Each thread writes into its own ``out`` buffer; no thread sees another's data."""
    rng = np.random.default_rng(22)
    q = [randn(rng, (1, 2, 48, 32)) for _ in range(N_THREADS)]
    k, v = randn(rng, (1, 2, 96, 32)), randn(rng, (1, 2, 96, 32))
    outs = [np.full((1, 2, 48, 32), np.nan, np.float32) for _ in range(N_THREADS)]
    barrier = threading.Barrier(N_THREADS)
    errors = []

    def worker(t):
        try:
            barrier.wait()
            for _ in range(20):
                r = fastattn.scaled_dot_product_attention(q[t], k, v, out=outs[t], num_threads=1 + t % 3)
                assert r is outs[t] or np.shares_memory(r, outs[t])
        except BaseException as e:
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    for t in range(N_THREADS):
        np.testing.assert_array_equal(outs[t], fastattn.scaled_dot_product_attention(q[t], k, v))
        assert_close(outs[t], ref.scaled_dot_product_attention(q[t], k, v))
