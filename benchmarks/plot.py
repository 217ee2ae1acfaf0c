"""Plot throughput against sequence length from ``python -m fastattn.bench --sweep --json``.

    python -m fastattn.bench --sweep --json sweep.json
    python benchmarks/plot.py sweep.json -o docs/performance.png

One line per implementation (GFLOP/s of the B1 H8 D64 non-causal sweep over L),
with the machine's fp32 GEMM rate measured in the same run as a dashed line.
Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import sys


def load(path: str) -> tuple:
    """(machine dict, {impl: [(L, gflops), ...]}) of the sweep records in a bench JSON file."""
    with open(path) as f:
        data = json.load(f)
    series: dict = {}
    for r in data["records"]:
        if r.get("sweep") and r.get("gflops"):
            series.setdefault(r["impl"], []).append((r["L"], r["gflops"]))
    if not series:
        raise SystemExit(
            f"{path} holds no sweep records; make it with python -m fastattn.bench --sweep --json PATH"
        )
    return data.get("machine", {}), {k: sorted(v) for k, v in series.items()}


def plot(machine: dict, series: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for impl, pts in series.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=impl)
    if machine.get("gemm_gflops"):
        ax.axhline(
            machine["gemm_gflops"],
            color="gray",
            linestyle="--",
            linewidth=1,
            label=f"fp32 GEMM (numpy) {machine['gemm_gflops']:.0f}",
        )
    ax.set_xscale("log", base=2)
    xs = sorted({x for pts in series.values() for x, _ in pts})
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("sequence length L = S")
    ax.set_ylabel("GFLOP/s")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"attention B1 H8 D64 float32, non-causal\n{machine.get('cpu', '?')}, "
        f"{machine.get('isa', '?')}, {machine.get('threads', '?')} threads, "
        f"{machine.get('date', '')}",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="output of python -m fastattn.bench --sweep --json PATH")
    p.add_argument("-o", "--output", default="docs/performance.png")
    args = p.parse_args(argv)
    machine, series = load(args.json)
    plot(machine, series, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
