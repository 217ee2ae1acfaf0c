"""The command line: ``fastattn [--version] [check | info | bench ARGS...]``.

One argparse parser serves the ``fastattn`` command (a console script, the entry
point that works from any directory), ``python -m fastattn`` and
``python -m fastattn.bench`` (which is ``fastattn bench``):

- no command: check the kernel against the float64 reference on a few shapes
  (PASS/FAIL each, exit status 1 on any failure), then time fastattn and a plain
  NumPy ``softmax(Q Kᵀ) V`` (float32) on typical shapes;
- ``check``: the check only;
- ``info``: :func:`fastattn.show_config` (it lists the ``FASTATTN_*`` environment
  variables ignored at import for invalid values);
- ``bench ARGS``: the benchmark suite (:mod:`fastattn.bench`; ``bench --backward``: forward +
  backward).

Every command takes ``--help`` (which only prints help) and ``--version``.  While an
invalid ``FASTATTN_*`` knob is ignored (``import fastattn`` warns, see
:mod:`fastattn._config`), ``--help``, ``--version`` and ``info`` work and the commands
that check or time the kernel refuse to run (exit status 2): their results would be
for a configuration other than the one asked for.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

# (label, q shape, k shape, v shape, dtype, kwargs, mask shape or None)
CHECKS: list[tuple[str, Any, Any, Any, Any, dict[str, Any], Any]] = [
    (
        "f32 B2 H4 L97 S97 D64 causal",
        (2, 4, 97, 64),
        (2, 4, 97, 64),
        (2, 4, 97, 64),
        np.float32,
        {"is_causal": True},
        None,
    ),
    (
        "f32 B1 H3 L130 S257 D80 bool mask",
        (1, 3, 130, 80),
        (1, 3, 257, 80),
        (1, 3, 257, 80),
        np.float32,
        {},
        (3, 130, 257),
    ),
    (
        "f32 GQA 8/2 decode S1029 D128 bshd",
        (2, 1, 8, 128),
        (2, 1029, 2, 128),
        (2, 1029, 2, 128),
        np.float32,
        {"enable_gqa": True, "layout": "bshd"},
        None,
    ),
    (
        "f32 L200 S50 causal (rows w/o keys)",
        (1, 2, 200, 32),
        (1, 2, 50, 32),
        (1, 2, 50, 16),
        np.float32,
        {"is_causal": True},
        None,
    ),
    (
        "f64 B2 H2 L33 S65 D17 float mask",
        (2, 2, 33, 17),
        (2, 2, 65, 17),
        (2, 2, 65, 17),
        np.float64,
        {"is_causal": True},
        (2, 1, 33, 65),
    ),
]


def _max_rel_err(a: npt.ArrayLike, b: npt.ArrayLike) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if not np.array_equal(np.isnan(a), np.isnan(b)) or not np.array_equal(a[np.isinf(b)], b[np.isinf(b)]):
        return math.inf
    fin = np.isfinite(b)
    if not fin.any():
        return 0.0
    return float(np.abs(a[fin] - b[fin]).max() / max(1.0, np.abs(b[fin]).max()))


def self_check() -> bool:
    """Compare the kernel with :mod:`fastattn.reference`; print one line per shape."""
    import fastattn
    from fastattn import reference

    rng = np.random.default_rng(0)
    ok_all = True
    print(
        f"fastattn {fastattn.__version__}: checking against the float64 reference "
        f"(isa {fastattn.get_isa()}, {fastattn.get_num_threads()} threads)"
    )
    for label, qs, ks, vs, dt, kw, ms in CHECKS:
        q, k, v = (rng.standard_normal(s).astype(dt) for s in (qs, ks, vs))
        kw = dict(kw)
        if ms is not None:
            kw["attn_mask"] = rng.random(ms) > 0.3 if dt == np.float32 else rng.standard_normal(ms)
        tol = 1e-4 if dt == np.float32 else 1e-10
        try:
            o, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
            # the oracle has no annotations (yet)
            ro, rlse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)  # type: ignore[no-untyped-call, unused-ignore]
            err = max(_max_rel_err(o, ro), _max_rel_err(lse, rlse))
            ok = err <= tol
            detail = f"max error {err:.1e} (tolerance {tol:.0e})"
        except Exception as e:  # noqa: BLE001 - report and go on
            ok, detail = False, f"{type(e).__name__}: {e}"
        ok_all &= ok
        print(f"  {'PASS' if ok else 'FAIL'}  {label:38s} {detail}")
    return ok_all


def _progress(msg: str) -> None:
    if sys.stderr.isatty():
        print(f"\r{msg:70s}", end="\r", file=sys.stderr, flush=True)


def benchmark(budget_s: float = 1.0) -> None:
    """Time fastattn against the NumPy baseline on :data:`fastattn.bench.cases.TABLE_CASES`,
    interleaving the repetitions (the baseline, the cases and the FLOP count are the
    benchmark suite's)."""
    import fastattn
    from fastattn.bench.cases import TABLE_CASES, additive_mask, case_flops, numpy_attention

    rng = np.random.default_rng(1)
    print(
        f"\nfloat32 timings, best of interleaved runs (fastattn: {fastattn.get_num_threads()} threads, "
        f"isa {fastattn.get_isa()}; NumPy: its BLAS)"
    )
    print("GFLOP/s counts 4*L*S*D per head over the visible key pairs (half for causal L=S)")
    hdr = (
        f"{'shape':30s} {'fastattn ms':>12s} {'GFLOP/s':>8s} {'numpy ms':>10s} {'GFLOP/s':>8s} "
        f"{'speedup':>8s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for n, case in enumerate(TABLE_CASES, 1):
        B, H, L, S, D, causal = case.B, case.Hq, case.L, case.S, case.D, case.causal
        label = case.name
        _progress(f"[{n}/{len(TABLE_CASES)}] measuring {label} ...")
        q = rng.standard_normal((B, H, L, D), dtype=np.float32)
        k = rng.standard_normal((B, H, S, D), dtype=np.float32)
        v = rng.standard_normal((B, H, S, D), dtype=np.float32)
        add = additive_mask(L, S, causal, None)
        out = np.empty_like(q)
        best = [math.inf, math.inf]
        start = time.perf_counter()
        reps = 0
        while reps < 2 or (time.perf_counter() - start < budget_s and reps < 50):
            t0 = time.perf_counter()
            fastattn.scaled_dot_product_attention(q, k, v, is_causal=causal, out=out)
            t1 = time.perf_counter()
            numpy_attention(q, k, v, add)
            t2 = time.perf_counter()
            best = [min(best[0], t1 - t0), min(best[1], t2 - t1)]
            reps += 1
            if time.perf_counter() - start > 1.0:
                _progress(f"[{n}/{len(TABLE_CASES)}] measuring {label} ... {reps} runs")
        fl = case_flops(case)
        _progress("")
        print(
            f"{label:30s} {best[0] * 1e3:12.3f} {fl / best[0] / 1e9:8.1f} {best[1] * 1e3:10.3f} "
            f"{fl / best[1] / 1e9:8.1f} {best[1] / best[0]:7.2f}x",
            flush=True,
        )


def _version() -> str:
    import fastattn

    return f"fastattn {fastattn.__version__}"


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``fastattn``, ``python -m fastattn`` and ``python -m fastattn.bench``."""
    version = _version()
    p = argparse.ArgumentParser(
        prog="fastattn",
        description="fastattn: fused scaled dot-product attention for NumPy on the CPU. "
        "Without a command: check the kernel against the float64 reference, then time it "
        "against plain NumPy (under a minute).",
        epilog="`python -m fastattn ...` is the same command; `python -m fastattn.bench ARGS` is "
        "`fastattn bench ARGS`.",
    )
    p.add_argument("--version", action="version", version=version)
    sub = p.add_subparsers(dest="command", metavar="{check,info,bench}")
    c = sub.add_parser(
        "check",
        help="check the kernel against the float64 reference (exit status 1 on a failure)",
        description="Compare the kernel with the float64 reference on a few shapes; PASS/FAIL each.",
    )
    i = sub.add_parser(
        "info",
        help="print the build and run-time configuration",
        description="Print the build and run-time configuration: compiler, flags, ISA path, OpenMP, threads.",
    )
    bench: ModuleType | None
    try:
        from fastattn import bench
    except ImportError as e:
        if getattr(e, "name", None) not in ("fastattn.bench", None):
            raise
        bench = None
    if bench is not None:
        b = sub.add_parser(
            "bench",
            help="the benchmark suite against torch, ONNX Runtime and NumPy (fastattn bench --help)",
            description=bench.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=bench.EPILOG,
        )
        bench.add_arguments(b)
    else:
        b = sub.add_parser("bench", help="(not part of this installation)")
    for sp in (c, i, b):
        sp.add_argument("--version", action="version", version=version)
    return p


def refuse_ignored_knobs(command: str) -> bool:
    """Print one line per ``FASTATTN_*`` variable ignored at import and return True when
    there is any: ``command`` (which checks or times the kernel) must not run then."""
    from fastattn._config import refusal_lines

    lines = refusal_lines(command)
    for line in lines:
        print(line, file=sys.stderr)
    return bool(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        import fastattn

        fastattn.show_config()  # ignored knobs included: the diagnosis runs whatever they hold
        return 0
    if args.command == "bench":
        try:
            from fastattn import bench
        except ImportError:
            print(
                "fastattn bench: the benchmark suite (fastattn.bench) is not part of this installation",
                file=sys.stderr,
            )
            return 2
        status: int = bench.run(bench.finish_args(parser, args))
        return status or 0
    if refuse_ignored_knobs(f"fastattn {args.command or ''}".rstrip()):
        return 2
    if not self_check():
        print("\nFAIL: the kernel disagrees with the reference (see above)")
        return 1
    if args.command == "check":
        return 0
    benchmark()
    return 0
