"""What a forward run prints: one block per case, the causal / non-causal and masked /
unmasked summaries and the Markdown table (``--markdown``).  The JSON output is the
records themselves and the masked / unmasked summary."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from fastattn.bench.cases import (
    CAUSAL_PAIRS,
    KV8_COMPARE,
    KV8_SHORT,
    MASK_PAIRS,
    Case,
    case_flops,
    kv_bytes,
    np_dtype,
)

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
            ratio = f"  {faster(r['ratio'])}"
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


def faster(ratio: float) -> str:
    """A speedup (peer time / fastattn time) in words."""
    return f"fastattn {ratio:.2f}x faster" if ratio >= 1 else f"fastattn {1 / ratio:.2f}x slower"


def mask_summary(
    records: list[Record], out: TextIO, pairs: tuple[tuple[str, str], ...] = MASK_PAIRS
) -> dict[str, list[Record]]:
    """Print, and return for the JSON, each masked case against the unmasked case of its
    shape (``pairs``: (unmasked, masked) case names).  ``masked_over_unmasked``: per
    implementation, time(masked) / time(unmasked) beside ``visible``, the share of (query,
    key) pairs the mask leaves.  ``torch_over_fastattn``: fastattn's speedup over torch on
    the masked case beside the one on the unmasked shape (None where that was not timed)."""
    by = {(r["case"], r["impl"]): r["seconds"] for r in records}
    visibles = {r["case"]: r.get("visible") for r in records}
    impls = list(dict.fromkeys(r["impl"] for r in records))
    w = max([11] + [len(i) for i in impls])
    cw = max([0] + [len(m) for _, m in pairs])
    summary: dict[str, list[Record]] = {"masked_over_unmasked": [], "torch_over_fastattn": []}
    lines, vs_torch = [], []
    for full, masked in pairs:
        if masked not in visibles:
            continue
        visible = visibles[masked]
        for impl in impls:
            a, b = by.get((full, impl)), by.get((masked, impl))
            if a and b:
                summary["masked_over_unmasked"].append(
                    {"case": masked, "unmasked": full, "impl": impl, "ratio": b / a, "visible": visible}
                )
                lines.append(
                    f"  {impl:{w}s} {masked + ':':{cw + 1}s} {b / a:.2f} of the unmasked time"
                    + (f" (visible {visible:.2f})" if visible is not None else "")
                )
        fa, t = by.get((masked, "fastattn")), by.get((masked, "torch"))
        if fa and t:
            fu, tu = by.get((full, "fastattn")), by.get((full, "torch"))
            unmasked = tu / fu if fu and tu else None
            summary["torch_over_fastattn"].append(
                {"case": masked, "unmasked": full, "ratio": t / fa, "unmasked_ratio": unmasked}
            )
            vs_torch.append(
                f"  {masked:{cw}s} {faster(t / fa)}"
                + (f"  (unmasked: {faster(unmasked)})" if unmasked else "")
            )
    if lines:
        print(
            "\nmasked / unmasked time (the same shape with and without its attn_mask; visible = the "
            "share of (query, key) pairs the mask leaves; two cases timed apart, so noisy on a busy "
            "machine):",
            file=out,
        )
        for line in lines:
            print(line, file=out)
    if vs_torch:
        print(
            "\nfastattn against torch on the masked cases (the same mask; speedup = torch time / "
            "fastattn time):",
            file=out,
        )
        for line in vs_torch:
            print(line, file=out)
    return summary


def kv8_summary(records: list[Record], out: TextIO) -> list[Record]:
    """Print, and return for the JSON, each 8-bit K/V case's speed against fastattn on the
    same contents in float32 and bfloat16 (timed in the same interleaved rounds):
    ``speedup`` = time(fastattn-<dtype>kv) / time(fastattn), above 1 when the 8-bit call
    is faster; ``gbps``: the 8-bit call's K/V bytes (scales included) per second."""
    by = {(r["case"], r["impl"]): r for r in records}
    rows: list[Record] = []
    for r in records:
        if r["impl"] != "fastattn" or r["dtype"] not in KV8_SHORT or not r["seconds"]:
            continue
        for dt, short in KV8_COMPARE.items():
            other = by.get((r["case"], f"fastattn-{short}kv"))
            if other and other["seconds"]:
                rows.append(
                    {
                        "case": r["case"],
                        "kv_dtype": r["dtype"],
                        "against": dt,
                        "speedup": other["seconds"] / r["seconds"],
                        "seconds": r["seconds"],
                        "gbps": r["gbps"],
                    }
                )
    if rows:
        print(
            "\n8-bit K/V against fastattn's own float32 / bfloat16 K/V of the same contents (timed in "
            "the same rounds; speed = their time / the 8-bit time, above 1: the 8-bit call is faster):",
            file=out,
        )
        cw = max(len(x["case"]) for x in rows)
        for case in dict.fromkeys(x["case"] for x in rows):
            mine = [x for x in rows if x["case"] == case]
            rate = f", {mine[0]['gbps']:.1f} GB/s" if mine[0]["gbps"] else ""
            parts = ", ".join(f"{x['speedup']:.2f}x {KV8_COMPARE[x['against']]}" for x in mine)
            print(f"  {case:{cw}s} {fmt_time(mine[0]['seconds']).strip()}{rate}: {parts}", file=out)
    return rows


def paged_summary(records: list[Record], out: TextIO) -> list[Record]:
    """Print, and return for the JSON, each paged case's speed against fastattn's same call
    without pages (``fastattn-contig``) or the separate calls a chunked-prefill call
    replaces (``fastattn-separate``), timed in the same rounds: ``speed`` = their time /
    the paged call's time, 1.0 when the pages cost nothing."""
    by = {(r["case"], r["impl"]): r for r in records}
    rows: list[Record] = []
    for r in records:
        if r["impl"] != "fastattn" or not r["seconds"]:
            continue
        for against in ("fastattn-contig", "fastattn-separate"):
            other = by.get((r["case"], against))
            if other and other["seconds"]:
                rows.append(
                    {
                        "case": r["case"],
                        "against": against,
                        "speed": other["seconds"] / r["seconds"],
                        "seconds": r["seconds"],
                    }
                )
    if rows:
        print(
            "\npaged K/V against fastattn without pages (contig: the contiguous cache) or the separate "
            "calls one chunked-prefill call replaces (timed in the same rounds; speed = their time / the "
            "paged time, 1.00: the pages cost nothing):",
            file=out,
        )
        cw = max(len(x["case"]) for x in rows)
        for x in rows:
            what = x["against"].removeprefix("fastattn-")
            print(f"  {x['case']:{cw}s} {fmt_time(x['seconds']).strip()}: {x['speed']:.2f}x {what}", file=out)
    return rows


def markdown_table(records: list[Record], machine: dict[str, Any]) -> str:
    """One row per case: fastattn's time and rate, then fastattn's speedup over each peer
    (a column per implementation timed in at least one case: an 8-bit K/V run's skipped
    peers get none)."""
    impls = list(
        dict.fromkeys(r["impl"] for r in records if r["impl"] != "fastattn" and r["ratio"] is not None)
    )
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


def write_json(path: str, data: object, out: TextIO) -> int:
    """Write ``--json``'s file (``finish_args`` checked that it is writable before the run);
    should it fail after all (the disk filled, the directory went away), the JSON goes to
    stdout instead of being lost.  Returns the exit status (1 then)."""
    text = json.dumps(data, indent=1)
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        print(
            f"fastattn bench: cannot write --json {path} ({e.strerror or e}); the JSON follows",
            file=sys.stderr,
        )
        print(text, file=out)
        return 1
    print(f"wrote {path}", file=out)
    return 0
