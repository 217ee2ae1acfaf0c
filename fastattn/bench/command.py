"""The options of ``fastattn bench`` and the run they start.

:func:`add_arguments` defines this command's options once: :func:`fastattn.cli.build_parser`
adds them to its ``bench`` command and :func:`build_parser` to ``python -m fastattn.bench``'s
own parser, so both parse alike; :func:`finish_args` checks them and fills in the settings
that depend on others.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence

import fastattn
from fastattn._checks import MAX_THREADS
from fastattn._config import refusal_lines
from fastattn.bench import backward
from fastattn.bench.cases import BACKWARD_CASES, CASES, QUICK_CASES, quick_case, select_cases, sweep_cases
from fastattn.bench.ort import OrtAttention, OrtMHA
from fastattn.bench.peers import PRECISIONS, FastAttn, FastAttnHighest, Impl, Jax, NumpyRef, Torch
from fastattn.bench.report import (
    causal_summary,
    kv8_summary,
    markdown_table,
    mask_summary,
    paged_summary,
    print_case,
    write_json,
)
from fastattn.bench.runner import Record, run_case
from fastattn.bench.yardsticks import (
    cpu_model,
    machine_info,
    measure_bandwidth,
    measure_gemm,
    measure_gemm_bf16,
)

# Every implementation --impls may name, in the order of the output.
IMPLS: list[type[Impl]] = [FastAttn, Torch, OrtMHA, OrtAttention, Jax, NumpyRef]


def default_impls() -> list[type[Impl]]:
    """The implementations of a run without --impls: all of them, but JAX only where it is
    installed (the other peers say 'not installed' in the output; JAX is the newer one)."""
    return [c for c in IMPLS if c is not Jax or Jax().available() is None]


EPILOG = (
    "cases:\n  "
    + "\n  ".join(c.name for c in CASES)
    + "\nforward + backward cases (--backward):\n  "
    + "\n  ".join(c.name for c in BACKWARD_CASES)
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``fastattn bench``, added to either parser (see :func:`build_parser`)."""
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"threads for every library, 1 to {MAX_THREADS} (default: all cores)",
    )
    p.add_argument("--cases", nargs="+", default=None, help="case names or substrings")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="highest",
        help="fastattn's float32 matmul precision (torch's levels; default highest); below highest, "
        "fastattn at highest is timed too, as fastattn-highest",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="write records and machine info as JSON (PATH is checked before the run)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="interleaved rounds per case (default 5, quick 2; --backward: 5)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a subset of the cases (unless --cases), fewer rounds, shorter samples (< 1 minute), "
        "8-bit K/V cases at S / 8 (decode) or L / 4 (prefill); with --backward: 2 heads and L / 8",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="throughput vs L (256..8192, B1 H8 D64) for fastattn, torch, numpy (for benchmarks/plot.py)",
    )
    p.add_argument(
        "--backward",
        action="store_true",
        help="time forward + backward (fastattn against torch, float32) on the --backward cases",
    )
    p.add_argument("--impls", nargs="+", default=None, help="restrict to these implementations")
    p.add_argument("--markdown", action="store_true", help="also print a Markdown summary table")
    p.add_argument("--no-machine", action="store_true", help="skip the GEMM and bandwidth measurements")
    p.add_argument(
        "--pause",
        type=float,
        default=None,
        metavar="SECONDS",
        help="pause before each timed sample (default 0.25, quick 0.1; --backward: 0.05)",
    )


def finish_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Check the parsed options (``p.error`` on a bad one) and fill in the derived settings."""
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    if not 1 <= args.threads <= MAX_THREADS:
        # fastattn's own bound (set_num_threads, num_threads=); a larger team would only
        # start thousands of threads per library and hang the machine
        p.error(f"--threads must be >= 1 and <= {MAX_THREADS} (num_threads' bound), got {args.threads}")
    if args.repeat is not None and args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.pause is not None and args.pause < 0:
        p.error("--pause must be >= 0")
    if args.json is not None:
        why = unwritable(args.json)
        if why:  # now, not after a run of minutes whose records would be lost
            p.error(f"--json {args.json}: cannot write there ({why})")
    if args.precision != "highest" and (args.backward or args.dtype != "float32"):
        p.error("--precision applies to float32 forward runs (--dtype float32, without --backward)")
    if args.backward:
        return backward.finish_args(p, args)
    if args.repeat is None:
        args.repeat = 2 if args.quick else 5
    args.min_time = 0.02 if args.quick else 0.05
    if args.pause is None:
        args.pause = 0.1 if args.quick else 0.25
    args.bw_bytes = (256 << 20) if args.quick else (1 << 30)  # the bandwidth yardstick's array
    args.gemm_n = 1024 if args.quick else 2048  # the interleaved GEMM yardstick: n x n x n
    args.budget = 3.0 if args.quick else 10.0  # seconds of timed calls per implementation and case
    return args


def unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (None: it can): opened for appending, so that an
    existing file keeps its contents, and removed again when this created it."""
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        try:
            os.remove(path)
        except OSError:
            pass  # written later anyway
    return None


def build_parser() -> argparse.ArgumentParser:
    """``fastattn bench``'s own parser: the options of :func:`add_arguments`, which
    :func:`fastattn.cli.build_parser` adds to its ``bench`` command too, so both parse
    alike.  The benchmark never imports :mod:`fastattn.cli` (no import cycle)."""
    from fastattn.bench import DESCRIPTION

    p = argparse.ArgumentParser(
        prog="fastattn bench",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.add_argument("--version", action="version", version=f"fastattn {fastattn.__version__}")
    p.set_defaults(command="bench")  # the namespace fastattn.cli's bench command gives
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The options of ``fastattn bench ARGV``."""
    p = build_parser()
    return finish_args(p, p.parse_args(list(argv)))


def main(argv: Sequence[str] | None = None) -> int:
    """``fastattn bench ARGV`` (``python -m fastattn.bench ARGV``); returns the exit status."""
    return run(parse_args(sys.argv[1:] if argv is None else argv)) or 0


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed options (:func:`finish_args`); returns the exit status."""
    refusal = refusal_lines("fastattn bench")
    if refusal:  # timings for a configuration other than the one asked for: refuse (exit 2)
        print("\n".join(refusal), file=sys.stderr)
        return 2
    out = sys.stdout
    if args.backward:
        return backward.run(args, out)
    cases = sweep_cases() if args.sweep else CASES
    if args.quick and not args.cases and not args.sweep:
        cases = [c for c in cases if c.name in QUICK_CASES]
    cases = select_cases(args.cases, cases)
    if args.quick:
        cases = [quick_case(c) for c in cases]
    impls: list[type[Impl]] = [FastAttn, Torch, NumpyRef] if args.sweep else default_impls()
    if args.impls:
        names = {cls.name: cls for cls in IMPLS}
        bad = [n for n in args.impls if n not in names]
        if bad:
            raise SystemExit(f"unknown implementation(s) {bad}; known: {', '.join(names)}")
        impls = [c for c in (impls if args.sweep else IMPLS) if c.name in args.impls]
        if FastAttn not in impls:
            impls.insert(0, FastAttn)
    # fastattn at --precision; below "highest", fastattn at "highest" beside it (the ratio of the two).
    makers: list[Callable[[], Impl]] = [
        (lambda: FastAttn(args.precision)) if c is FastAttn else c for c in impls
    ]
    if args.precision != "highest":
        makers.insert(1, FastAttnHighest)
    print(
        f"fastattn {fastattn.__version__} on {cpu_model()} ({fastattn.get_isa()} kernels), "
        f"{args.threads} thread(s), dtype {args.dtype}"
        + (f", precision {args.precision}" if args.dtype == "float32" else ""),
        file=out,
    )
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if os.environ.get(var):
            print(
                f"note: {var}={os.environ[var]} is set and slows NumPy's BLAS (GEMM reference, numpy "
                "baseline); for the true limit run\n  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "
                "python -m fastattn.bench",
                file=out,
            )
            break
    gemm = bw = None
    if not args.no_machine:
        gemm = measure_gemm(args.threads)
        bw = measure_bandwidth(args.threads, nbytes=args.bw_bytes)
        print(
            f"machine: fp32 GEMM (numpy sgemm 2048^3) {gemm:.1f} GFLOP/s, read bandwidth {bw:.1f} GB/s"
            " (best of 6; float32 prefill and decode cases compare with the median of a GEMM or of reads"
            " timed in their own rounds)",
            file=out,
        )
    machine = machine_info(args.threads, gemm, bw)
    if not args.no_machine and args.dtype == "bfloat16":
        gemm16 = measure_gemm_bf16(args.threads)
        if gemm16 is None:
            print(
                "machine: no bf16 GEMM limit (no torch, or a CPU without AVX512-BF16 / AMX: "
                "bfloat16 cases are compared with the fp32 GEMM)",
                file=out,
            )
        elif gemm is not None:
            # 16-bit cases are compared with the 16-bit limit, printed beside the fp32 one.
            machine["gemm_bf16_gflops"] = gemm16
            print(
                f"machine: bf16 GEMM (torch.mm 2048^3) {gemm16:.1f} GFLOP/s "
                f"({gemm16 / gemm:.1f}x the fp32 GEMM; bfloat16 cases are compared with it)",
                file=out,
            )
    records: list[Record] = []
    t_start = time.perf_counter()
    for case in cases:
        recs = run_case(case, makers, args, out)
        for r in recs:
            r["sweep"] = bool(args.sweep)
        print_case(case, recs, machine, out)
        out.flush()
        records.extend(recs)
    causal_summary(records, out)
    masked = mask_summary(records, out)
    kv8 = kv8_summary(records, out)
    paged = paged_summary(records, out)
    if gemm is not None and bw is not None:  # measured again: on a busy machine one may be low
        gemm2 = measure_gemm(args.threads)
        bw2 = measure_bandwidth(args.threads, nbytes=args.bw_bytes)
        print(
            f"\nmachine again at the end: fp32 GEMM {gemm2:.1f} GFLOP/s, read bandwidth {bw2:.1f} GB/s "
            "(the JSON keeps the higher of the two)",
            file=out,
        )
        machine["gemm_gflops"] = max(gemm, gemm2)
        machine["bandwidth_gbps"] = max(bw, bw2)
        if machine.get("gemm_bf16_gflops"):
            g16 = measure_gemm_bf16(args.threads) or 0.0
            print(f"bf16 GEMM again at the end: {g16:.1f} GFLOP/s", file=out)
            machine["gemm_bf16_gflops"] = max(machine["gemm_bf16_gflops"], g16)
    print(
        f"\n(time = median of {args.repeat} interleaved rounds (fewer for calls over "
        f"{args.budget / args.repeat:.0f} s); speedup = peer time / fastattn time; "
        f"total {time.perf_counter() - t_start:.0f} s)",
        file=out,
    )
    if args.markdown:
        print("\n" + markdown_table(records, machine), file=out)
    if args.json:
        return write_json(
            args.json,
            {
                "machine": machine,
                "records": records,
                "mask_summary": masked,
                "kv8_summary": kv8,
                "paged_summary": paged,
            },
            out,
        )
    return 0
