"""Exact attention of a few thousand queries over a million keys on a Dask cluster.

The keys and values are generated chunk by chunk on the workers (a seed per
chunk) and never exist as one array anywhere: each worker holds a few key/value
chunks at a time while ``fastattn.dask`` runs one fused attention task per
(query chunk, key chunk) pair and merges the partial results with the
log-sum-exp rule in a tree.

    python examples/dask_million_keys.py                    # 2 workers x 1 thread
    python examples/dask_million_keys.py --causal --check   # + compare a few rows in memory

Prints the wall time and every worker's peak resident memory next to the size
of K/V.  Needs the dask extra: ``pip install ".[dask]"`` in a clone (no PyPI wheels yet).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np


def _peak_rss_bytes():
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux


def _random_block(seed, dtype, block_info=None):
    """A chunk of standard normal numbers, reproducible from its position."""
    loc = block_info[None]["array-location"]
    shape = tuple(b - a for a, b in loc)
    rng = np.random.default_rng([seed] + [a for a, _ in loc])
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1 << 20, help="key length S (default 1048576)")
    p.add_argument("--queries", type=int, default=2048, help="query length L")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64, help="head dim D (= Dv)")
    p.add_argument("--key-chunk", type=int, default=1 << 16, help="keys per chunk")
    p.add_argument("--query-chunk", type=int, default=1024, help="queries per chunk")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-limit", default="600MB", help="per worker")
    p.add_argument("--causal", action="store_true", help="bottom-right causal (query i sees j <= i + S - L)")
    p.add_argument(
        "--window", type=int, default=None, help="sliding window: each query sees this many past keys"
    )
    p.add_argument("--check", action="store_true", help="recompute a few query rows in memory and compare")
    args = p.parse_args()

    import dask.array as da
    from dask.distributed import Client, LocalCluster

    import fastattn
    import fastattn.dask as fd

    H, S, L, D = args.heads, args.keys, args.queries, args.dim
    kv_chunks = ((1,) * H, tuple(_split(S, args.key_chunk)), (D,))
    meta = np.empty((0, 0, 0), np.float32)
    k = da.map_blocks(_random_block, 1, np.float32, chunks=kv_chunks, dtype=np.float32, meta=meta)
    v = da.map_blocks(_random_block, 2, np.float32, chunks=kv_chunks, dtype=np.float32, meta=meta)
    q_np = np.random.default_rng(0).standard_normal((H, L, D), dtype=np.float32)
    q = da.from_array(q_np, chunks=(1, args.query_chunk, D))
    window = None if args.window is None else (args.window, 0)

    cluster = LocalCluster(
        n_workers=args.workers,
        threads_per_worker=1,
        processes=True,
        memory_limit=args.memory_limit,
        dashboard_address=":0",
    )
    with cluster, Client(cluster) as client:
        out, lse = fd.scaled_dot_product_attention(
            q, k, v, is_causal=args.causal, window=window, return_lse=True, num_threads=1
        )
        n_parts = sum(1 for key in dict(out.__dask_graph__()) if str(key[0]).startswith("fastattn-part"))
        kv_bytes = k.nbytes + v.nbytes
        print(
            f"H={H} L={L} S={S} D={D}: K/V {kv_bytes / 2**20:.0f} MiB in {k.numblocks[1]} key chunks of "
            f"{args.key_chunk}, {q.numblocks[1]} query chunks, {n_parts} attention tasks"
        )
        print(f"workers: {args.workers} x 1 thread, memory_limit={args.memory_limit}")
        t0 = time.perf_counter()
        o, s = client.compute([out, lse], sync=True)
        dt = time.perf_counter() - t0
        flops = 4.0 * H * L * S * D
        print(f"time: {dt:.1f} s  ({flops / dt / 1e9:.1f} GFLOP/s incl. generating K/V)")
        print(
            f"output {o.shape} {o.dtype}, mean |out| {np.abs(o).mean():.4g}, lse range "
            f"[{np.nanmin(s):.3f}, {np.nanmax(s):.3f}]"
        )
        for addr, peak in sorted(client.run(_peak_rss_bytes).items()):
            print(f"peak RSS {addr}: {peak / 2**20:.0f} MiB (K/V total {kv_bytes / 2**20:.0f} MiB)")

        if args.check:  # a few rows against the in-memory function, K/V of head 0 regenerated here
            k0, v0 = (_regenerate(seed, S, D, args.key_chunk) for seed in (1, 2))
            j = np.arange(S)
            for i in np.unique(np.linspace(0, L - 1, 4).astype(int)):
                vis = np.ones(S, bool)  # bottom-right alignment: query i sees j <= i + S - L
                if args.causal or window:
                    vis &= j <= i + S - L
                if window:
                    vis &= j >= i + S - L - window[0]
                want = fastattn.scaled_dot_product_attention(q_np[0, i : i + 1], k0, v0, vis[None])[0]
                err = np.abs(o[0, i] - want).max()
                print(f"check row {i}: max |dask - in memory| = {err:.2e}")
                assert err < 1e-4, err


def _regenerate(seed, S, D, chunk):
    """Head 0 of the K or V that the workers generated, rebuilt chunk by chunk on the client."""
    blocks, s0 = [], 0
    for c in _split(S, chunk):
        info = {None: {"array-location": [(0, 1), (s0, s0 + c), (0, D)]}}
        blocks.append(_random_block(seed, np.float32, block_info=info)[0])
        s0 += c
    return np.concatenate(blocks)


def _split(n, c):
    return [c] * (n // c) + ([n % c] if n % c else [])


if __name__ == "__main__":
    main()
