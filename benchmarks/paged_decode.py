"""Paged against contiguous decode: the same cache read through a shuffled block table.

For each K/V format (bfloat16, float32, int8 with per-token scales), one decode step of
B sequences (GQA Hq/Hk, head dim 128) over S cached tokens each, timed as
``fastattn.attention_with_kvcache`` on the contiguous cache ``(B, Hk, S, D)`` and on the
same tokens in a pool of ``--page``-token pages ``(num_pages, Hk, page, D)`` whose block
table is a random permutation (no two consecutive pages adjacent, as in a long-running
server).  The two calls alternate in one process (interleaved rounds, median per call),
so the ratio ``paged / contiguous`` (speed, higher is better: 1.0 = no cost) is measured
under the same machine state.  Both outputs are checked equal to float32 rounding first.

    python benchmarks/paged_decode.py [--quick] [--page 16] [--threads 2] [--heads 32/8] [--seq 8192]

``--heads 32/32`` times multi-head attention (one query row per kv head, whose kv heads'
tasks run together over pages).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import ml_dtypes
import numpy as np

import fastattn


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def paged(x: np.ndarray, page: int, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (B, H, S, X) cache as a pool (num_pages, H, page, X) in ``order`` and its table."""
    B, H, S, X = x.shape
    n = S // page
    pages = x.reshape(B, H, n, page, X).transpose(0, 2, 1, 3, 4).reshape(B * n, H, page, X)
    pool = np.empty_like(pages)
    pool[order] = pages  # logical page i lives at pool[order[i]]
    return pool, order.reshape(B, n).astype(np.int32)


def timed(fns: list, rounds: int, reps: int) -> list[float]:
    """Median seconds per call of each fn, rounds interleaved."""
    t: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            t[i].append((time.perf_counter() - t0) / reps)
    return [float(np.median(x)) for x in t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S = 2048 and fewer rounds")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--heads", default="32/8", help="query heads / kv heads (default 32/8)")
    ap.add_argument("--seq", type=int, default=8192, help="cached tokens per sequence (default 8192)")
    args = ap.parse_args()
    Hq, Hk = (int(x) for x in args.heads.split("/"))
    B, D = 4, 128
    S = 2048 if args.quick else args.seq
    rounds = 5 if args.quick else args.rounds
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_name()}; fastattn ISA {fastattn.get_isa()}; {args.threads} threads")
    print(f"B{B} H{Hq}/{Hk} S{S} D{D} decode, {args.page}-token pages, shuffled block table\n")
    print(f"{'K/V':>9} | {'contiguous ms':>13} | {'paged ms':>8} | {'paged speed':>11}")
    print(f"{'-' * 9}-|-{'-' * 13}-|-{'-' * 8}-|-{'-' * 11}")
    lens = np.full(B, S, np.int64)
    order = rng.permutation(B * S // args.page)
    for name in ("bfloat16", "float32", "int8"):
        kf = rng.standard_normal((B, Hk, S, D)).astype(np.float32)
        vf = rng.standard_normal((B, Hk, S, D)).astype(np.float32)
        q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
        kw: dict = {}
        pkw: dict = {}
        if name == "int8":
            k, ks = fastattn.quantize_kv(kf, "int8")
            v, vs = fastattn.quantize_kv(vf, "int8")
            kw = {"k_scale": ks, "v_scale": vs}
            pkw = {"k_scale": paged(ks, args.page, order)[0], "v_scale": paged(vs, args.page, order)[0]}
        else:
            dt = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(np.float32)
            k, v = kf.astype(dt), vf.astype(dt)
            q = q.astype(dt)
        kp, bt = paged(k, args.page, order)
        vp, _ = paged(v, args.page, order)

        def dense(k=k, v=v, q=q, kw=kw):
            return fastattn.attention_with_kvcache(q, k, v, lens, num_threads=args.threads, **kw)

        def pagedcall(kp=kp, vp=vp, q=q, bt=bt, pkw=pkw):
            return fastattn.attention_with_kvcache(
                q, kp, vp, lens, block_table=bt, num_threads=args.threads, **pkw
            )

        np.testing.assert_allclose(
            np.asarray(pagedcall(), np.float32), np.asarray(dense(), np.float32), rtol=2e-2, atol=2e-3
        )
        td, tp = timed([dense, pagedcall], rounds, 3)
        print(f"{name:>9} | {td * 1e3:13.2f} | {tp * 1e3:8.2f} | {td / tp:10.2f}x")

    # Chunked prefill: one varlen call over the pages (decode rows of 6 sequences and a
    # 512-token prefill chunk of a seventh) against the separate calls it replaces.
    print(f"\nchunked prefill, bfloat16, {args.page}-token pages: 6 decode rows + one 512-query chunk")
    dt = np.dtype(ml_dtypes.bfloat16)
    lens = np.array([S // 2] * 6 + [S // 4])
    nq = np.array([1] * 6 + [512])
    pages_per = -(-lens // args.page)
    order = rng.permutation(int(pages_per.sum()))
    kp = rng.standard_normal((order.size, args.page, Hk, D)).astype(dt)  # flash-attn's page layout
    vp = rng.standard_normal((order.size, args.page, Hk, D)).astype(dt)
    bt = np.zeros((lens.size, int(pages_per.max())), np.int32)
    at = 0
    for b, n in enumerate(pages_per):
        bt[b, :n] = order[at : at + n]
        at += n
    cq = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), Hq, D)).astype(dt)
    kb, vb = kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3)

    def one_call():
        return fastattn.varlen_attention(
            q, kp, vp, cq, ck, block_table=bt, is_causal=True, enable_gqa=True, num_threads=args.threads
        )

    def separate():  # the decode rows in one batched call, the chunk in another
        d = fastattn.attention_with_kvcache(
            q[:6, :, None], kb, vb, lens[:6], block_table=bt[:6], num_threads=args.threads
        )
        c = fastattn.attention_with_kvcache(
            q[6:].swapaxes(0, 1)[None], kb, vb, lens[6:], block_table=bt[6:], num_threads=args.threads
        )
        return d, c

    tv, ts = timed([one_call, separate], rounds, 3)
    print(f"one varlen call {tv * 1e3:.2f} ms, separate calls {ts * 1e3:.2f} ms: {ts / tv:.2f}x")


if __name__ == "__main__":
    main()
