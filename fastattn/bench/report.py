"""What a forward run prints: one block per case, the causal / non-causal summary and the
Markdown table (``--markdown``).  The JSON output is the records themselves."""

from __future__ import annotations

from typing import Any, TextIO

from fastattn.bench.cases import CAUSAL_PAIRS, Case, case_flops, kv_bytes, np_dtype

Record = dict[str, Any]


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:8.1f} µs"
    if s < 1:
        return f"{s * 1e3:8.2f} ms"
    return f"{s:8.2f} s "


def gemm_peak(r: Record, machine: dict[str, Any]) -> float | None:
    """The GEMM rate a prefill record's rate is compared with: the fp32 GEMM timed in
    its case's own rounds (float32 runs), else the machine's measured before and after
    the cases (the bf16 one in bfloat16 runs); None when neither was measured."""
    peak: float | None = r.get("gemm_gflops") or machine.get("gemm_bf16_gflops") or machine.get("gemm_gflops")
    return peak


def print_case(case: Case, records: list[Record], machine: dict[str, Any], out: TextIO) -> None:
    """The block of one case: a line per implementation, the decode yardsticks."""
    print(
        f"\n{case.name}  ({case_flops(case) / 1e9:.2f} GFLOP"
        + (
            f", K+V {kv_bytes(case, np_dtype(records[0]['dtype'])) / 2**20:.0f} MiB"
            if case.kind == "decode"
            else ""
        )
        + ")",
        file=out,
    )
    w = max([11] + [len(r["impl"]) for r in records])  # the name column (fastattn-highest is wider)
    for r in records:
        if r["seconds"] is None:
            print(f"  {r['impl']:{w}s} {r['status']}: {r['note']}", file=out)
            continue
        if case.kind == "decode":
            rate = f"{r['gbps']:7.1f} GB/s"
            peak = r.get("read_gbps") or machine.get("bandwidth_gbps")
        else:
            rate = f"{r['gflops']:7.1f} GFLOP/s"
            peak = gemm_peak(r, machine)
        what = ("kv-read" if r.get("read_gbps") else "bw") if case.kind == "decode" else "gemm"
        pct = (
            f"{100 * (r['gbps'] or r['gflops']) / peak:5.0f}% of {what:4s}"
            if peak and case.kind != "small"
            else " " * 16
        )
        if r.get("mem_gbps"):
            pct += f" {100 * r['gbps'] / r['mem_gbps']:4.0f}% of bw"
        ratio = ""
        if r["impl"] != "fastattn" and r["ratio"] is not None:
            ratio = (
                f"  fastattn {r['ratio']:.2f}x faster"
                if r["ratio"] >= 1
                else f"  fastattn {1 / r['ratio']:.2f}x slower"
            )
        note = f"  [{r['note']}]" if r["note"] else ""
        print(f"  {r['impl']:{w}s} {fmt_time(r['seconds'])}  {rate}  {pct}{ratio}{note}", file=out)
    g = next((r for r in records if r.get("gemm_gflops")), None)
    if g:
        what = "(NumPy's fp32 sgemm, n x n x n, on the same threads in the same rounds)"
        print(f"  {'gemm':{w}s} {'':11s}  {g['gemm_gflops']:7.1f} GFLOP/s  {what}", file=out)
    read = next((r for r in records if r.get("read_gbps")), None)
    if read:
        what = "(the same K and V read by the same threads: NumPy GEMVs)"
        print(f"  {'kv-read':{w}s} {'':11s}  {read['read_gbps']:7.1f} GB/s  {what}", file=out)
        what = "(one large array read by the same threads in the same rounds: the machine's bandwidth)"
        print(f"  {'bw':{w}s} {'':11s}  {read['mem_gbps']:7.1f} GB/s  {what}", file=out)


def causal_summary(records: list[Record], out: TextIO) -> None:
    """time(causal)/time(non-causal) per implementation: about 0.5 means masked work is skipped."""
    by = {(r["case"], r["impl"]): r["seconds"] for r in records}
    lines = []
    w = max([11] + [len(r["impl"]) for r in records])
    for full, causal in CAUSAL_PAIRS:
        for impl in dict.fromkeys(r["impl"] for r in records):
            a, b = by.get((full, impl)), by.get((causal, impl))
            if a and b:
                lines.append(
                    f"  {impl:{w}s} {causal}: {b / a:.2f} of the non-causal time"
                    + ("  (masked work not skipped)" if b / a > 0.85 else "")
                )
    if lines:
        print(
            "\ncausal / non-causal time (0.5 = the masked half is skipped; two cases timed apart, "
            "so noisy on a busy machine):",
            file=out,
        )
        for line in lines:
            print(line, file=out)


def markdown_table(records: list[Record], machine: dict[str, Any]) -> str:
    """One row per case: fastattn's time and rate, then fastattn's speedup over each peer."""
    impls = list(dict.fromkeys(r["impl"] for r in records if r["impl"] != "fastattn"))
    head = "| case | fastattn | rate | " + " | ".join(f"speedup vs {i}" for i in impls) + " |"
    lines = [head, "|" + "---|" * (3 + len(impls))]
    cases = list(dict.fromkeys(r["case"] for r in records))
    by = {(r["case"], r["impl"]): r for r in records}
    for c in cases:
        fa = by.get((c, "fastattn"))
        if fa is None or fa["seconds"] is None:
            continue
        if fa["kind"] == "decode":
            rate = f"{fa['gbps']:.1f} GB/s"
            if fa.get("read_gbps"):
                rate += f" ({100 * fa['gbps'] / fa['read_gbps']:.0f}% of kv-read"
                rate += f", {100 * fa['gbps'] / fa['mem_gbps']:.0f}% of bw)"
            elif machine.get("bandwidth_gbps"):
                rate += f" ({100 * fa['gbps'] / machine['bandwidth_gbps']:.0f}% bw)"
        elif fa["kind"] == "small":
            rate = "-"
        else:
            rate = f"{fa['gflops']:.1f} GFLOP/s"
            peak = gemm_peak(fa, machine)
            if peak:
                rate += f" ({100 * fa['gflops'] / peak:.0f}% gemm"
                best = machine.get("gemm_gflops")
                if fa.get("gemm_gflops") and best:  # beside it: the best back-to-back GEMM of the run
                    rate += f", {100 * fa['gflops'] / best:.0f}% best gemm"
                rate += ")"
        cells = []
        for i in impls:
            r = by.get((c, i))
            cells.append("-" if r is None or r["ratio"] is None else f"{r['ratio']:.2f}x")
        lines.append(f"| {c} | {fmt_time(fa['seconds']).strip()} | {rate} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
