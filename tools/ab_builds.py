"""A/B two builds of fastattn's kernels inside one process.

On a shared machine the same call's time moves by 2x within minutes, so
timing builds in separate processes (or one after the other) cannot resolve
a 5% change.  This loads ``fastattn/_kernels*.so`` from two source trees
(each built in place: ``python setup.py build_ext --inplace``) into one
process and alternates short bursts of calls between them, so that the host's
noise hits both alike; it reports the median of the paired time ratios with
its interquartile range.  The outputs of the two builds are compared first
(bit for bit, or within 1e-5 relative when the change alters rounding).

    python tools/ab_builds.py OLD_TREE NEW_TREE 1x8x1024x64 [--threads 1] [--bursts 40] [--causal]
                              [--isa avx2] [--kv-heads HK] [--kv-float16] [--upper-bound]

SHAPE is BxHxLxD or BxHxLxDxS (float32, bhsd); --kv-heads gives K and V
fewer heads than Q (grouped-query, e.g. decode ``1x32x1x128x8192 --kv-heads 8``).
One thread is timed as thread CPU time, more as wall time.  A ratio above 1 means NEW is faster.  --isa
times another ISA path of both builds (``avx2`` on an AVX-512 machine: the
path AVX2-only CPUs take).

    python tools/ab_builds.py OLD NEW - --case "B4 H32/8 S8192 D128 decode int8kv page16" --threads 2

--case times the kernel calls fastattn makes for a ``fastattn bench`` case
(paged, 8-bit, masked, varlen: whatever the case's call is), captured from
OLD's Python side; SHAPE is then ignored.
"""

from __future__ import annotations

import argparse
import glob
import importlib.machinery
import importlib.util
import os
import sys
import time
from types import ModuleType

import numpy as np


def load_kernels(tree: str) -> ModuleType:
    """The compiled ``fastattn._kernels`` of a source tree, as a module of its own."""
    found = glob.glob(os.path.join(tree, "fastattn", "_kernels*.so"))
    if not found:
        raise SystemExit(f"{tree}: no fastattn/_kernels*.so (build it in place first)")
    loader = importlib.machinery.ExtensionFileLoader("fastattn._kernels", found[0])
    spec = importlib.util.spec_from_file_location("fastattn._kernels", found[0], loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("shape", help="BxHxLxD or BxHxLxDxS")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bursts", type=int, default=40)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--isa", default=None, help="ISA path of both builds (fastattn.set_isa names)")
    ap.add_argument("--kv-heads", type=int, default=None, help="K/V heads (grouped-query; default: H)")
    ap.add_argument("--kv-float16", action="store_true", help="K and V in float16 (a 16-bit KV cache)")
    ap.add_argument(
        "--kv-dtype",
        default=None,
        help="K and V in this dtype: float16, bfloat16, or int8 / float8_e4m3fn / float8_e5m2 "
        "(8-bit: fastattn.quantize_kv's per-token scales; both trees need the 8-bit Plan fields)",
    )
    ap.add_argument(
        "--upper-bound", action="store_true", help="time NEW even if its results differ (a wrong build)"
    )
    ap.add_argument(
        "--case",
        default=None,
        help="instead of SHAPE's call: the kernel call(s) that fastattn makes for this `fastattn bench` "
        "case (its exact name, e.g. 'B4 H32/8 S8192 D128 decode int8kv page16': paged calls too), "
        "captured from OLD's Python side",
    )
    a = ap.parse_args()
    sys.path.insert(0, a.old)  # the Plan record (pure Python) of the old tree
    from fastattn._plan import Plan

    old, new = load_kernels(a.old), load_kernels(a.new)
    if a.isa is not None:
        for mod in (old, new):
            if not mod.isa_set(a.isa):
                raise SystemExit(f"this CPU cannot run the {a.isa!r} path")
    if a.case is not None:
        label = f"{a.case} threads={a.threads}"
        alternate(old, new, *case_plans(a.case, a.threads), a.bursts, a.threads, label, a.upper_bound)
        return
    dims = [int(x) for x in a.shape.split("x")]
    B, H, L, D = dims[:4]
    S = dims[4] if len(dims) > 4 else L
    Hk = a.kv_heads or H
    if H % Hk:
        raise SystemExit(f"--kv-heads {Hk} must divide H = {H}")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, L, D), dtype=np.float32)
    k = rng.standard_normal((B, Hk, S, D), dtype=np.float32)
    v = rng.standard_normal((B, Hk, S, D), dtype=np.float32)
    kv_dtype = "float16" if a.kv_float16 else a.kv_dtype
    scales: dict[str, np.ndarray] = {}
    if kv_dtype in ("int8", "float8_e4m3fn", "float8_e5m2"):
        from fastattn._quant import kv8_dtype, quantize

        (k, ks), (v, vs) = (quantize(x, kv8_dtype(kv_dtype), None, "x") for x in (k, v))
        scales = dict(k_scale=np.broadcast_to(ks, k.shape), v_scale=np.broadcast_to(vs, v.shape))
    elif kv_dtype is not None:
        import ml_dtypes

        dt = np.dtype(getattr(ml_dtypes, kv_dtype, None) or kv_dtype)
        k, v = k.astype(dt), v.astype(dt)
    o_old, o_new = np.empty_like(q), np.empty_like(q)
    # Plan(q, k, v, o, scale, L, S, num_threads, precision, causal), as fastattn.functional's fast path.
    p_old = Plan(q, k, v, o_old, D**-0.5, L, S, a.threads, 0, a.causal, **scales)
    p_new = Plan(q, k, v, o_new, D**-0.5, L, S, a.threads, 0, a.causal, **scales)
    calls = max(1, int(2e7 / (B * H * L * S * D)))  # ~ the same work per burst for every shape
    tag = (" causal" if a.causal else "") + (f" kv-heads={Hk}" if Hk != H else "")
    tag += f" isa={a.isa}" if a.isa else ""
    tag += f" kv={kv_dtype}" if kv_dtype else ""
    label = f"{a.shape} threads={a.threads}{tag}"
    alternate(old, new, [p_old], [p_new], [o_old], [o_new], a.bursts, a.threads, label, a.upper_bound, calls)


Plans = list[object]
Outs = list[np.ndarray]


def case_plans(name: str, threads: int) -> tuple[Plans, Plans, Outs, Outs]:
    """The Plans of one call of fastattn's runner for bench case ``name`` (two copies, each
    with outputs of its own), captured at ``fastattn._plan``'s kernel call, and those outputs."""
    import dataclasses

    import fastattn._plan as plan_mod
    from fastattn.bench.cases import CASES
    from fastattn.bench.inputs import make_inputs
    from fastattn.bench.peers import FastAttn

    case = next((c for c in CASES if c.name == name), None)
    if case is None:
        raise SystemExit(f"no bench case {name!r}")
    runner = FastAttn().prepare(make_inputs(case, "float32"), threads)
    seen: list[object] = []
    real = plan_mod._kernels

    class Capture:
        def __getattr__(self, n: str) -> object:
            return getattr(real, n)

        @staticmethod
        def attention(plan: object) -> None:
            seen.append(plan)
            real.attention(plan)

    plan_mod._kernels = Capture()  # type: ignore[assignment]
    try:
        runner()
    finally:
        plan_mod._kernels = real
    copies: tuple[list[object], list[object]] = ([], [])
    outs: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for pl in seen:
        for plans, o in zip(copies, outs):
            out = np.empty_like(pl.o)  # type: ignore[attr-defined]
            o.append(out)
            plans.append(dataclasses.replace(pl, o=out))  # type: ignore[type-var]
    return copies[0], copies[1], outs[0], outs[1]


def alternate(
    old: ModuleType,
    new: ModuleType,
    p_old: list[object],
    p_new: list[object],
    o_old: list[np.ndarray],
    o_new: list[np.ndarray],
    bursts: int,
    threads: int,
    label: str,
    upper_bound: bool,
    calls: int = 1,
) -> None:
    """Time the kernel calls of p_old on ``old`` and p_new on ``new`` (each list run ``calls``
    times per burst) in alternating bursts, after comparing their outputs o_old / o_new."""
    for _ in range(3):
        for pl in p_old:
            old.attention(pl)
        for pl in p_new:
            new.attention(pl)
    same = all(np.array_equal(x, y) for x, y in zip(o_old, o_new))
    differ = not same and not all(
        np.abs(x - y).max() <= 1e-5 * np.abs(x).max() + 1e-6 for x, y in zip(o_old, o_new) if x.size
    )
    if differ and not upper_bound:
        raise SystemExit("the two builds give different results")
    clock = time.thread_time if threads == 1 else time.perf_counter
    t_old: list[float] = []
    t_new: list[float] = []
    runs = ((old, p_old, t_old), (new, p_new, t_new))
    for i in range(bursts):
        for mod, plans, acc in runs if i % 2 == 0 else runs[::-1]:
            t0 = clock()
            for _ in range(calls):
                for pl in plans:
                    mod.attention(pl)
            acc.append((clock() - t0) / calls)
    r = np.array(t_old) / np.array(t_new)
    print(
        f"{label}: old {np.median(t_old) * 1e6:.1f} us, new {np.median(t_new) * 1e6:.1f} us, "
        f"old/new {np.median(r):.3f} [{np.percentile(r, 25):.3f}-{np.percentile(r, 75):.3f}] "
        f"({calls} calls per burst, "
        f"{'same bits' if same else 'DIFFERENT RESULTS' if differ else 'not the same bits'})"
    )


if __name__ == "__main__":
    main()
