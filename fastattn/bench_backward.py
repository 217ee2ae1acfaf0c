"""Forward + backward benchmark: ``python -m fastattn.bench_backward``.

Times fastattn's fused forward (``return_lse=True``) plus
:func:`fastattn.scaled_dot_product_attention_backward` against torch's
``scaled_dot_product_attention`` forward plus ``backward()`` on CPU tensors
(when torch is installed), float32, at the same thread count (``--threads``,
default 2).  Each implementation is first checked against the float64 reference
backward on a reduced copy of the case (one head, at most 256 queries).
Repetitions are interleaved (fastattn, pause, torch, pause, ...) and the median
of each is reported with the ratio torch / fastattn (> 1: fastattn faster).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

import fastattn
from fastattn import reference

__all__ = ["CASES", "main"]

# name: (B, H, L, D, causal)
CASES = {
    "B1 H8 L2048 D64": (1, 8, 2048, 64, False),
    "B1 H8 L2048 D64 causal": (1, 8, 2048, 64, True),
    "B4 H8 L512 D128 causal": (4, 8, 512, 128, True),
}


def _inputs(B: int, H: int, L: int, D: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(4))


def _fastattn(q, k, v, go, causal: bool, threads: int):
    def run():
        o, lse = fastattn.scaled_dot_product_attention(
            q, k, v, is_causal=causal, return_lse=True, num_threads=threads
        )
        return fastattn.scaled_dot_product_attention_backward(
            go, q, k, v, o, lse, is_causal=causal, num_threads=threads
        )

    return run


def _torch(q, k, v, go, causal: bool, threads: int):
    import torch

    torch.set_num_threads(threads)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    tgo = torch.from_numpy(go)

    def run():
        for t in (tq, tk, tv):
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).backward(tgo)
        return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()

    return run


IMPLS = {"fastattn": _fastattn, "torch": _torch}


def _available(name: str) -> bool:
    if name == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            return False
    return True


def check(name: str, L: int, D: int, causal: bool) -> float:
    """Max error (relative to the largest gradient) against the float64 reference
    on one head of at most 256 queries and keys."""
    n = min(L, 256)
    q, k, v, go = _inputs(1, 1, n, D, seed=1)
    got = IMPLS[name](q, k, v, go, causal, 1)()
    exp = reference.scaled_dot_product_attention_backward(go, q, k, v, is_causal=causal)
    return max(float(np.abs(g - e).max()) / max(1.0, float(np.abs(e).max())) for g, e in zip(got, exp))


def run_case(name: str, shape: tuple, impls: list, threads: int, repeat: int, pause: float) -> dict:
    B, H, L, D, causal = shape
    q, k, v, go = _inputs(B, H, L, D)
    fns = {i: IMPLS[i](q, k, v, go, causal, threads) for i in impls}
    for fn in fns.values():  # warm up (thread pools, scratch, page faults)
        fn()
    times: dict = {i: [] for i in impls}
    for _ in range(repeat):
        for i, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
            time.sleep(pause)
    rec = {"case": name, "threads": threads, "repeat": repeat}
    for i in impls:
        rec[f"{i}_ms"] = statistics.median(times[i]) * 1e3
        rec[f"{i}_all_ms"] = [t * 1e3 for t in times[i]]
    if "torch" in impls and "fastattn" in impls:
        rec["speedup_vs_torch"] = rec["torch_ms"] / rec["fastattn_ms"]
    return rec


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=None, help="case names or substrings")
    ap.add_argument("--impls", nargs="+", default=None, choices=sorted(IMPLS))
    ap.add_argument("--quick", action="store_true", help="L / 8 and 2 heads (smoke test)")
    ap.add_argument("--pause", type=float, default=0.05, help="seconds between timed calls")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    impls = [i for i in (args.impls or list(IMPLS)) if _available(i)]
    names = [n for n in CASES if not args.cases or any(c in n for c in args.cases)]
    print(
        f"fastattn {fastattn.__version__} ({fastattn.get_isa()}), {_cpu()}, {args.threads} threads, float32"
    )
    print("forward + backward, median of interleaved repetitions")
    records = []
    for name in names:
        B, H, L, D, causal = CASES[name]
        if args.quick:
            H, L = 2, max(L // 8, 16)
        ok = []
        for i in impls:
            err = check(i, L, D, causal)
            if err > 1e-3:
                print(f"  {name}: {i} fails the reference check (error {err:.2e}); not timed")
            else:
                ok.append(i)
        rec = run_case(name, (B, H, L, D, causal), ok, args.threads, args.repeat, args.pause)
        records.append(rec)
        line = "  ".join(f"{i} {rec[f'{i}_ms']:9.1f} ms" for i in ok)
        sp = f"  {rec['speedup_vs_torch']:.2f}x torch" if "speedup_vs_torch" in rec else ""
        print(f"{name + (' (quick)' if args.quick else ''):28s} {line}{sp}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu(), "threads": args.threads, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
