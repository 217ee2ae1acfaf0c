"""The run loop: check each implementation against the oracle, then time them all in
interleaved rounds (round robin, a pause before every sample so that the spinning
BLAS/OpenMP workers of one library do not slow the next, then untimed calls of a
short callable so that its own sleeping workers are awake) and keep the medians."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from fastattn.bench.cases import KV8_COMPARE, Case, case_flops, kv_bytes, mask_pairs, np_dtype
from fastattn.bench.inputs import check, check_slice, make_inputs, reference_output, tolerance
from fastattn.bench.peers import FastAttn, FastAttnContiguous, FastAttnKV, FastAttnSeparate, Impl, Skip
from fastattn.bench.yardsticks import gemm_reader, kv_reader, mem_reader

Record = dict[str, Any]


# A callable whose warm call is shorter than WARMUP_BELOW is called, untimed, for
# WARMUP_SECONDS after each pause.  Why: a thread team that slept through the pause
# runs slowly for milliseconds.  Measured on a 2-vCPU KVM guest (AMD EPYC Zen 4,
# 2026-12-04): a libgomp parallel region of 1.8 ms per thread took 6-10 ms as the
# first region after a 0.25 s sleep and 1.7-1.9 ms back to back; fastattn's
# B1 H32/8 S8192 D128 float16 decode (1.3 ms warm) took 11 ms as the first call
# after the pause and 2.0 ms as the second, and 10 calls after 0-3 / 40-80 ms of
# warm-up calls averaged 3.2 / 2.85 ms on B1 H64/8 (2.75-2.9 ms back to back).
# Without the warm-up the benchmark timed the wake-up, not the kernel (7.4 ms for
# that float16 case, 19% of the K/V read).  Longer calls pay it once in a sample of
# at least WARMUP_BELOW, a few percent at most.
WARMUP_BELOW = 0.1
WARMUP_SECONDS = 0.05


@dataclasses.dataclass
class Timed:
    """One callable of the interleaved rounds: ``number`` calls per sample, its samples;
    ``warmup``: untimed calls for WARMUP_SECONDS after each pause (see WARMUP_BELOW)."""

    fn: Callable[[], object]
    number: int = 1
    times: list[float] = dataclasses.field(default_factory=list)
    warmup: bool = False


def timed(fn: Callable[[], object], min_time: float, called: bool = False) -> Timed:
    """``fn`` timed in samples of about ``min_time``: the calls per sample and the
    warm-up follow a second call (the first pays for thread pools, scratch and page
    faults, and a sample sized by it would hold too few calls).  ``called``: the
    caller has made that first call already."""
    if not called:
        first_call(fn)
    warm = first_call(fn)
    return Timed(fn, calls_per_sample(warm, min_time), warmup=warm < WARMUP_BELOW)


def first_call(fn: Callable[[], object]) -> float:
    """Seconds of one call (the warm-up: thread pools, scratch, page faults)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def calls_per_sample(first: float, min_time: float) -> int:
    """Calls timed together per sample so that one sample lasts about ``min_time``."""
    return max(1, min(100000, int(min_time / max(first, 1e-7))))


def interleaved_rounds(runs: list[Timed], repeat: int, pause: float, budget: float = float("inf")) -> None:
    """``repeat`` rounds over ``runs``: in each, every callable in turn after a pause of
    ``pause`` s (and the untimed warm-up calls of a ``warmup`` callable), ``number`` calls
    timed together (their mean is one sample).  A callable whose samples already cost
    more than ``budget`` seconds sits out the later rounds."""
    for _ in range(repeat):
        for r in runs:
            if r.times and sum(r.times) * r.number > budget:  # slow peer: fewer rounds
                continue
            time.sleep(pause)
            if r.warmup:
                t0 = time.perf_counter()
                r.fn()
                while time.perf_counter() - t0 < WARMUP_SECONDS:
                    r.fn()
            t0 = time.perf_counter()
            for _ in range(r.number):
                r.fn()
            r.times.append((time.perf_counter() - t0) / r.number)


def _failure(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def run_case(
    case: Case, impls: Sequence[Callable[[], Impl]], args: argparse.Namespace, log: TextIO
) -> list[Record]:
    """Check, then time every implementation of one case (``impls``: the classes, or
    callables that make them); returns records.  An 8-bit K/V case times fastattn on the
    same contents in float32 and bfloat16 beside it (:class:`~fastattn.bench.peers.FastAttnKV`,
    at fastattn's ``--precision``); the peers skip it.  A paged case times fastattn's same
    call without pages (:class:`~fastattn.bench.peers.FastAttnContiguous`) or, for chunked
    prefill, the separate calls it replaces (:class:`~fastattn.bench.peers.FastAttnSeparate`)
    beside it; the peers skip it (none reads pages)."""
    if case.page:
        impls = list(impls) + [
            functools.partial(FastAttnSeparate if case.q_lens else FastAttnContiguous, args.precision)
        ]
    elif case.kv8:
        impls = list(impls) + [functools.partial(FastAttnKV, d, args.precision) for d in KV8_COMPARE]
    inp = make_inputs(case, args.dtype)
    small = check_slice(inp)
    ref = reference_output(small)
    tol = tolerance(small)
    flops = case_flops(case)
    records: list[Record] = []
    runs: list[tuple[Record, Timed]] = []
    for cls in impls:
        impl = cls()
        rec: Record = {
            "case": case.name,
            "impl": impl.name,
            "seconds": None,
            "seconds_min": None,
            "gflops": None,
            "gbps": None,
            "ratio": None,
            "status": "ok",
            "note": "",
            "max_err": None,
            "kind": case.kind,
            "dtype": impl.kv_dtype or case.kv_dtype or args.dtype,
            "L": case.L,
            "S": case.S,
            "mask": case.mask,
            # the share of (query, key) pairs the case's mask leaves visible
            "visible": mask_pairs(case) / (case.B * case.L * case.S) if case.mask else None,
            "precision": impl.precision if args.dtype == "float32" else None,
        }
        records.append(rec)
        why = impl.available()
        if why is None and args.quick and case.window is not None and not isinstance(impl, FastAttn):
            why = "peers skipped in --quick (they compute the full L×S)"
        if why is None and case.page and not isinstance(impl, FastAttn):
            why = "paged K/V: fastattn only (timed against its own call without pages, or the separate calls)"
        if why is None and case.kv8 and not isinstance(impl, FastAttn):
            why = (
                "8-bit K/V: fastattn only (timed against its own float32 / bfloat16 K/V of the same contents)"
            )
        if why is not None:
            rec.update(status="skipped", note=why)
            continue
        try:
            err = check(impl.prepare(small, args.threads), small, ref)
        except Skip as e:
            rec.update(status="skipped", note=str(e))
            continue
        except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
            rec.update(status="failed", note=_failure(e))
            continue
        rec["max_err"] = err
        bound = max(tol, impl.tolerance)
        if not err <= bound:
            rec.update(
                status="failed", note=f"wrong result: max error {err:.2e} > {bound:.0e} of output scale"
            )
            continue
        try:
            fn = impl.prepare(inp, args.threads)
            first = first_call(fn)
        except Skip as e:
            rec.update(status="skipped", note=str(e))
            continue
        except Exception as e:  # noqa: BLE001
            rec.update(status="failed", note=_failure(e))
            continue
        rec["note"] = impl.note
        # a call slower than the whole budget is timed once: its first call is the sample
        t = Timed(fn, times=[first]) if first > args.budget else timed(fn, args.min_time, called=True)
        runs.append((rec, t))
    # decode cases: the two read yardsticks (kv-read, bw) run in the same rounds
    reads: list[Timed] = []
    if case.kind == "decode" and runs:
        for reader in (kv_reader(inp, args.threads), mem_reader(args.threads, args.bw_bytes)):
            reads.append(timed(reader, args.min_time))
    # float32 prefill cases: the fp32 GEMM yardstick (gemm) runs in the same rounds
    gemm: Timed | None = None
    if case.kind not in ("decode", "small") and args.dtype == "float32" and runs:
        gemm_fn, gemm_flops = gemm_reader(args.threads, args.gemm_n)
        gemm = timed(gemm_fn, args.min_time)
    yardsticks = reads + ([gemm] if gemm else [])
    interleaved_rounds([t for _, t in runs] + yardsticks, args.repeat, args.pause, args.budget)
    fa = None
    read_gbps = mem_gbps = None
    gemm_gflops = gemm_flops / statistics.median(gemm.times) / 1e9 if gemm else None
    nbytes = kv_bytes(case, np_dtype(case.kv_dtype or args.dtype))  # the kv-read yardstick's bytes
    if reads:
        read_gbps = nbytes / statistics.median(reads[0].times) / 1e9
        mem_gbps = args.bw_bytes / statistics.median(reads[1].times) / 1e9
    for rec, t in runs:
        rec["seconds"] = statistics.median(t.times)
        if read_gbps is not None:
            rec["read_gbps"] = read_gbps
            rec["mem_gbps"] = mem_gbps
        if gemm_gflops is not None:
            rec["gemm_gflops"] = gemm_gflops
        rec["seconds_min"] = min(t.times)
        rec["rounds"] = len(t.times)
        rec["gflops"] = flops / rec["seconds"] / 1e9
        if case.kind == "decode":  # each record's own K/V bytes (fastattn-f32kv reads float32)
            rec["gbps"] = kv_bytes(case, np_dtype(rec["dtype"])) / rec["seconds"] / 1e9
        if rec["impl"] == "fastattn":
            fa = rec["seconds"]
    if fa is not None:
        for rec in records:
            if rec["seconds"] is not None:
                rec["ratio"] = rec["seconds"] / fa  # fastattn's speedup over this implementation
    return records
