"""The forward + backward case set: ``fastattn bench --backward``.

Times fastattn's fused forward (``return_lse=True``) plus
:func:`fastattn.scaled_dot_product_attention_backward` against torch's
``scaled_dot_product_attention`` forward plus ``backward()`` on CPU tensors
(when torch is installed), float32, at the same thread count (``--threads``).
Each implementation is first checked against the float64 reference backward on
a reduced copy of the case (one head, at most 256 queries).  Repetitions are
interleaved (fastattn, pause, torch, pause, ...) and the median of each is
reported with the ratio torch / fastattn (> 1: fastattn faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Callable, TextIO

import numpy as np

import fastattn
from fastattn import reference
from fastattn.bench.cases import BACKWARD_CASES, Array, BackwardCase, select_cases
from fastattn.bench.peers import missing, optional
from fastattn.bench.runner import Timed, interleaved_rounds
from fastattn.bench.yardsticks import cpu_model

Maker = Callable[[Array, Array, Array, Array, bool, int], Callable[[], Any]]


def inputs(B: int, H: int, L: int, D: int, seed: int = 0) -> tuple[Array, Array, Array, Array]:
    """q, k, v and the output's gradient, standard normal float32 (B, H, L, D)."""
    rng = np.random.default_rng(seed)
    q, k, v, go = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(4))
    return q, k, v, go


def fastattn_fwd_bwd(
    q: Array, k: Array, v: Array, go: Array, causal: bool, threads: int
) -> Callable[[], Any]:
    def run() -> Any:
        o, lse = fastattn.scaled_dot_product_attention(
            q, k, v, is_causal=causal, return_lse=True, num_threads=threads
        )
        return fastattn.scaled_dot_product_attention_backward(  # type: ignore[no-untyped-call, unused-ignore]
            go, q, k, v, o, lse, is_causal=causal, num_threads=threads
        )

    return run


def torch_fwd_bwd(q: Array, k: Array, v: Array, go: Array, causal: bool, threads: int) -> Callable[[], Any]:
    torch = optional("torch")
    torch.set_num_threads(threads)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    tgo = torch.from_numpy(go)

    def run() -> Any:
        for t in (tq, tk, tv):
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).backward(tgo)
        return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()

    return run


IMPLS: dict[str, Maker] = {"fastattn": fastattn_fwd_bwd, "torch": torch_fwd_bwd}
REQUIRES = {"torch": "torch"}  # implementation: the module it needs


def available(name: str) -> bool:
    return name not in REQUIRES or missing(REQUIRES[name]) is None


def check(name: str, L: int, D: int, causal: bool) -> float:
    """Max error (relative to the largest gradient) against the float64 reference
    on one head of at most 256 queries and keys."""
    n = min(L, 256)
    q, k, v, go = inputs(1, 1, n, D, seed=1)
    got = IMPLS[name](q, k, v, go, causal, 1)()
    exp = reference.scaled_dot_product_attention_backward(go, q, k, v, is_causal=causal)  # type: ignore[no-untyped-call, unused-ignore]
    return max(float(np.abs(g - e).max()) / max(1.0, float(np.abs(e).max())) for g, e in zip(got, exp))


def run_case(case: BackwardCase, impls: list[str], threads: int, repeat: int, pause: float) -> dict[str, Any]:
    """Time ``impls`` on ``case`` in interleaved rounds; the record of the JSON output."""
    q, k, v, go = inputs(case.B, case.H, case.L, case.D)
    runs = {i: Timed(IMPLS[i](q, k, v, go, case.causal, threads)) for i in impls}
    for r in runs.values():  # warm up (thread pools, scratch, page faults)
        r.fn()
    interleaved_rounds(list(runs.values()), repeat, pause)
    rec: dict[str, Any] = {"case": case.name, "threads": threads, "repeat": repeat}
    for i, r in runs.items():
        rec[f"{i}_ms"] = statistics.median(r.times) * 1e3
        rec[f"{i}_all_ms"] = [t * 1e3 for t in r.times]
    if "torch" in impls and "fastattn" in impls:
        rec["speedup_vs_torch"] = rec["torch_ms"] / rec["fastattn_ms"]
    return rec


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
    print("forward + backward, median of interleaved repetitions", file=out)
    records = []
    for case in cases:
        shape = case.quick() if args.quick else case
        ok = []
        for i in impls:
            err = check(i, shape.L, shape.D, shape.causal)
            if err > 1e-3:
                print(f"  {case.name}: {i} fails the reference check (error {err:.2e}); not timed", file=out)
            else:
                ok.append(i)
        rec = run_case(shape, ok, args.threads, args.repeat, args.pause)
        records.append(rec)
        line = "  ".join(f"{i} {rec[f'{i}_ms']:9.1f} ms" for i in ok)
        sp = f"  {rec['speedup_vs_torch']:.2f}x torch" if "speedup_vs_torch" in rec else ""
        print(f"{case.name + (' (quick)' if args.quick else ''):28s} {line}{sp}", file=out, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "threads": args.threads, "records": records}, f, indent=1)
    return 0
