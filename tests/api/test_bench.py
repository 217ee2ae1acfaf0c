"""The benchmark command runs end to end (tiny case, no peers timed for long)."""

import json

import numpy as np
import pytest

bench = pytest.importorskip("fastattn.bench")


def test_bench_quick_case_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(
        [
            "--quick",
            "--cases",
            "B1 H8 L16 D64",
            "--no-machine",
            "--impls",
            "fastattn",
            "numpy",
            "--repeat",
            "1",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    impls = {r["impl"] for r in data["records"]}
    assert "fastattn" in impls
    assert all(r["case"] == "B1 H8 L16 D64" for r in data["records"])
    assert "B1 H8 L16 D64" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kv_reader_reads_every_byte_once(dtype, threads):
    # The decode yardstick splits the same K and V bytes over the threads: every
    # float32 word exactly once (checked by recording what each GEMV multiplies).
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 2, 4099, 8)).astype(dtype)  # not a multiple of 4096 words: a tail
    v = rng.standard_normal((1, 2, 4099, 8)).astype(dtype)
    inp = bench.Inputs(None, None, k, v)
    seen = []
    real = np.ones

    class Spy(np.ndarray):
        def __rmatmul__(self, other):
            seen.append(np.array(other, copy=True))
            return other @ np.asarray(self)

    np.ones = lambda *a, **kw: real(*a, **kw).view(Spy)
    try:
        bench.kv_reader(inp, threads)()
    finally:
        np.ones = real
    got = np.sort(np.concatenate([s.reshape(-1).view(np.uint32) for s in seen]))
    want = np.sort(
        np.concatenate([a.reshape(-1).view(np.uint8)[: a.nbytes // 4 * 4].view(np.uint32) for a in (k, v)])
    )
    np.testing.assert_array_equal(got, want)


def test_decode_case_reports_kv_read(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench.main(
        ["--quick", "--cases", "B8 H32/8 S2048 D128 decode", "--no-machine", "--impls", "fastattn"]
        + ["--repeat", "1", "--threads", "2", "--json", str(out)]
    )
    assert rc == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["read_gbps"] > 0 and rec["gbps"] > 0 and rec["mem_gbps"] > 0


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bandwidth_yardstick_reads_the_whole_array(threads):
    # the decode cases' bw: every thread gets a share, the shares cover all nbytes once
    nbytes = (1 << 20) + 3 * 4096 * 4
    parts = bench.read_parts(threads, nbytes)
    assert len(parts) == threads and all(p.shape[1] == 4096 for p in parts)
    assert sum(p.nbytes for p in parts) == nbytes
    base = parts[0].base if parts[0].base is not None else parts[0]
    assert all(np.shares_memory(p, base) for p in parts)
    bench.mem_reader(threads, nbytes)()


def test_bf16_gemm_yardstick():
    """The 16-bit limit of --dtype bfloat16 runs: torch.mm in bf16 (None without torch)."""
    from fastattn.bench import measure_gemm_bf16

    try:
        import torch  # noqa: F401
    except ImportError:
        assert measure_gemm_bf16(1, n=128, repeat=1) is None
        return
    rate = measure_gemm_bf16(1, n=256, repeat=2)
    assert rate is not None and rate > 0
