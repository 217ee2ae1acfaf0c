"""The forward + backward case set: ``fastattn bench --backward``.

Times fastattn's fused forward (``return_lse=True``) plus
:func:`fastattn.scaled_dot_product_attention_backward` against torch's
``scaled_dot_product_attention`` forward plus ``backward()`` on CPU tensors
(when torch is installed), float32, at the same thread count (``--threads``);
the dropout cases pass their ``dropout_p`` to both (each draws its own mask).
Each implementation is first checked against the float64 reference backward on
a reduced copy of the case (one head, at most 256 queries).  Repetitions are
interleaved (fastattn, pause, torch, pause, ...); a sample is the mean of as many
calls as last ``MIN_TIME`` seconds (one call of a full-size case; many of the small
``--quick`` shapes).  The median of each is reported with the interquartile range of
its samples and the ratio torch / fastattn (> 1: fastattn faster), the latter only
from at least ``MIN_SAMPLES`` samples each: a ratio of two single samples is noise.
``--quick`` times the shrunk shapes (:meth:`BackwardCase.quick`), and the output
and the JSON name those.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

import fastattn
from fastattn import reference
from fastattn.bench.cases import BACKWARD_CASES, QUICK_WHAT, Array, BackwardCase, select_cases
from fastattn.bench.peers import missing, optional
from fastattn.bench.report import write_json
from fastattn.bench.runner import interleaved_rounds, timed
from fastattn.bench.yardsticks import cpu_model

# Seconds of calls per sample (a full-size forward + backward takes longer: one call).
MIN_TIME = 0.05
# The fewest samples per implementation from which a speedup is printed (and stored).
MIN_SAMPLES = 3

Maker = Callable[[Array, Array, Array, Array, bool, int, float], Callable[[], Any]]
# The dropout seed of fastattn's timed calls (any fixed one: the cost does not depend on it).
SEED = 1234


def inputs(B: int, H: int, L: int, D: int, seed: int = 0) -> tuple[Array, Array, Array, Array]:
    """q, k, v and the output's gradient, standard normal float32 (B, H, L, D)."""
    rng = np.random.default_rng(seed)
    q, k, v, go = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(4))
    return q, k, v, go


def fastattn_fwd_bwd(
    q: Array, k: Array, v: Array, go: Array, causal: bool, threads: int, dropout: float = 0.0
) -> Callable[[], Any]:
    drop: dict[str, Any] = {"dropout_p": dropout, "dropout_seed": SEED} if dropout else {}

    def run() -> Any:
        o, lse = fastattn.scaled_dot_product_attention(
            q, k, v, is_causal=causal, return_lse=True, num_threads=threads, **drop
        )
        return fastattn.scaled_dot_product_attention_backward(  # type: ignore[no-untyped-call, unused-ignore]
            go, q, k, v, o, lse, is_causal=causal, num_threads=threads, **drop
        )

    return run


def torch_fwd_bwd(
    q: Array, k: Array, v: Array, go: Array, causal: bool, threads: int, dropout: float = 0.0
) -> Callable[[], Any]:
    torch = optional("torch")
    torch.set_num_threads(threads)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    tgo = torch.from_numpy(go)

    def run() -> Any:
        for t in (tq, tk, tv):
            t.grad = None
        sdpa = torch.nn.functional.scaled_dot_product_attention
        sdpa(tq, tk, tv, is_causal=causal, dropout_p=dropout).backward(tgo)
        return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()

    return run


IMPLS: dict[str, Maker] = {"fastattn": fastattn_fwd_bwd, "torch": torch_fwd_bwd}
REQUIRES = {"torch": "torch"}  # implementation: the module it needs


def available(name: str) -> bool:
    return name not in REQUIRES or missing(REQUIRES[name]) is None


def check(name: str, L: int, D: int, causal: bool) -> float:
    """Max error (relative to the largest gradient) against the float64 reference
    on one head of at most 256 queries and keys (without dropout: torch's mask is
    its own; fastattn's dropout gradients are tested against the reference in
    tests/kernel/test_dropout.py)."""
    n = min(L, 256)
    q, k, v, go = inputs(1, 1, n, D, seed=1)
    got = IMPLS[name](q, k, v, go, causal, 1, 0.0)()
    exp = reference.scaled_dot_product_attention_backward(go, q, k, v, is_causal=causal)  # type: ignore[no-untyped-call, unused-ignore]
    return max(float(np.abs(g - e).max()) / max(1.0, float(np.abs(e).max())) for g, e in zip(got, exp))


def shape_name(case: BackwardCase) -> str:
    """The shape of ``case`` in the case names' notation (its own name for a full-size case)."""
    return (
        f"B{case.B} H{case.H} L{case.L} D{case.D}"
        + (f" dropout {case.dropout}" if case.dropout else "")
        + (" causal" if case.causal else "")
    )


def iqr(times: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``times`` (linear interpolation, NumPy's default)."""
    q1, q3 = np.percentile(times, [25, 75])
    return float(q1), float(q3)


def run_case(
    case: BackwardCase, impls: list[str], threads: int, repeat: int, pause: float, min_time: float = MIN_TIME
) -> dict[str, Any]:
    """Time ``impls`` on ``case`` in interleaved rounds; the record of the JSON output."""
    q, k, v, go = inputs(case.B, case.H, case.L, case.D)
    # timed(): two warm-up calls (thread pools, scratch, page faults), then calls per sample
    runs = {i: timed(IMPLS[i](q, k, v, go, case.causal, threads, case.dropout), min_time) for i in impls}
    interleaved_rounds(list(runs.values()), repeat, pause)
    rec: dict[str, Any] = {
        "case": case.name,
        "shape": shape_name(case),
        "B": case.B,
        "H": case.H,
        "L": case.L,
        "D": case.D,
        "causal": case.causal,
        "dropout": case.dropout,
        "threads": threads,
        "repeat": repeat,
    }
    for i, r in runs.items():
        rec[f"{i}_ms"] = statistics.median(r.times) * 1e3
        rec[f"{i}_all_ms"] = [t * 1e3 for t in r.times]
        rec[f"{i}_iqr_ms"] = [t * 1e3 for t in iqr(r.times)]
        rec[f"{i}_calls_per_sample"] = r.number
    if "torch" in impls and "fastattn" in impls and repeat >= MIN_SAMPLES:
        rec["speedup_vs_torch"] = rec["torch_ms"] / rec["fastattn_ms"]
    return rec


def format_record(rec: dict[str, Any], impls: list[str]) -> str:
    """The timings of one record: median and IQR per implementation, then the speedup
    (or why there is none)."""
    parts = []
    for i in impls:
        q1, q3 = rec[f"{i}_iqr_ms"]
        spread = f" (IQR {q1:.2f}-{q3:.2f})" if rec["repeat"] >= MIN_SAMPLES else ""
        parts.append(f"{i} {rec[f'{i}_ms']:9.2f} ms{spread}")
    line = "  ".join(parts)
    if "speedup_vs_torch" in rec:
        line += f"  {rec['speedup_vs_torch']:.2f}x torch"
        (f1, f3), (t1, t3) = rec["fastattn_iqr_ms"], rec["torch_iqr_ms"]
        if f1 <= t3 and t1 <= f3:
            line += " (the IQRs overlap: no clear difference)"
    elif "torch" in impls and "fastattn" in impls:
        line += f"  (no speedup from {rec['repeat']} sample(s) each: --repeat {MIN_SAMPLES} or more)"
    return line


def finish_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The ``--backward`` settings: float32 only, its own implementations and defaults."""
    if args.sweep or args.markdown or args.dtype != "float32":
        p.error("--backward times float32 only, without --sweep or --markdown")
    bad = [i for i in args.impls or () if i not in IMPLS]
    if bad:
        p.error(f"--backward: unknown implementation(s) {bad}; known: {', '.join(IMPLS)}")
    if args.repeat is None:
        args.repeat = 5
    if args.pause is None:
        args.pause = 0.05
    return args


def run(args: argparse.Namespace, out: TextIO) -> int:
    """``fastattn bench --backward``: the table (and ``--json``) of the forward + backward cases."""
    impls = [i for i in (args.impls or list(IMPLS)) if available(i)]
    cases = select_cases(args.cases, BACKWARD_CASES)
    print(
        f"fastattn {fastattn.__version__} ({fastattn.get_isa()}), {cpu_model()}, "
        f"{args.threads} threads, float32",
        file=out,
    )
    print(
        f"forward + backward: median of {args.repeat} interleaved samples (each the mean of calls "
        f"lasting >= {MIN_TIME * 1e3:.0f} ms)"
        + (", IQR in parentheses" if args.repeat >= MIN_SAMPLES else "")
        + (f"; --quick: the shapes shrunk to {QUICK_WHAT}" if args.quick else ""),
        file=out,
    )
    records = []
    for case in cases:
        shape = case.quick() if args.quick else case
        ok = []
        for i in impls:
            err = check(i, shape.L, shape.D, shape.causal)
            if err > 1e-3:
                print(
                    f"  {shape_name(shape)}: {i} fails the reference check (error {err:.2e}); not timed",
                    file=out,
                )
            else:
                ok.append(i)
        rec = run_case(shape, ok, args.threads, args.repeat, args.pause)
        rec["quick"] = bool(args.quick)
        records.append(rec)
        of = f"  [--quick shape of {case.name}]" if args.quick else ""
        print(f"{shape_name(shape):36s} {format_record(rec, ok)}{of}", file=out, flush=True)
    if args.json:
        return write_json(args.json, {"cpu": cpu_model(), "threads": args.threads, "records": records}, out)
    return 0
