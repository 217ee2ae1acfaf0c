"""The benchmark command runs end to end (tiny case, no peers timed for long)."""

import dataclasses
import json
import sys

import numpy as np
import pytest
from conftest import optional

import fastattn

bench = optional("fastattn.bench")


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


def test_bench_precision_times_fastattn_at_highest_too(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(
        ["--precision", "medium", "--quick", "--cases", "B1 H8 L16 D64", "--no-machine"]
        + ["--impls", "fastattn", "--repeat", "1", "--threads", "1", "--json", str(out)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    header = text.splitlines()[0]
    assert "dtype float32, precision medium" in header, header
    line = next(x for x in text.splitlines() if x.strip().startswith("fastattn-highest"))
    assert "x faster" in line or "x slower" in line  # its time against fastattn at "medium"
    recs = {r["impl"]: r for r in json.loads(out.read_text())["records"]}
    assert set(recs) == {"fastattn", "fastattn-highest"}
    assert recs["fastattn"]["precision"] == "medium" and recs["fastattn-highest"]["precision"] == "highest"
    assert all(r["status"] == "ok" and r["ratio"] is not None for r in recs.values())


def test_bench_precision_default_and_bad_combinations(capsys):
    assert bench.parse_args(["--quick"]).precision == "highest"
    bad = (
        ["--precision", "medium", "--dtype", "bfloat16"],  # the level is for float32 runs
        ["--precision", "high", "--backward"],  # the backward computes float32 at "highest"
        ["--precision", "low"],
    )
    for argv in bad:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2 and "precision" in capsys.readouterr().err


def test_bench_precision_reaches_fastattn_calls():
    """A case that takes the bf16 path (64 rows per key/value head): fastattn at "medium"
    passes its check (a bfloat16 bound) and its error is not the error at "highest"
    where the level changes results."""
    import io

    from fastattn.bench import peers, runner

    args = bench.parse_args(["--quick", "--repeat", "1", "--threads", "1", "--pause", "0"])
    case = bench.Case("B1 H2 L64 D32", B=1, Hq=2, Hk=2, L=64, S=64, D=32)
    recs = runner.run_case(
        case, [lambda: peers.FastAttn("medium"), peers.FastAttnHighest], args, io.StringIO()
    )
    med, hi = recs
    assert med["status"] == "ok" and hi["status"] == "ok", recs
    assert (med["precision"], hi["precision"]) == ("medium", "highest")
    assert hi["max_err"] <= 1e-3
    if fastattn.get_isa() in ("amx", "avx512bf16"):
        assert med["max_err"] > 10 * hi["max_err"], (med["max_err"], hi["max_err"])


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


def test_prefill_case_reports_its_interleaved_gemm(tmp_path, capsys):
    """A float32 prefill case times NumPy's sgemm in its own rounds, and its rate is
    compared with that GEMM (not the machine's, which --no-machine skips)."""
    out = tmp_path / "bench.json"
    rc = bench.main(
        ["--quick", "--cases", "B1 H8 L1024 D64", "--no-machine", "--impls", "fastattn"]
        + ["--repeat", "2", "--threads", "1", "--json", str(out), "--markdown"]
    )
    assert rc == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["gemm_gflops"] > 0 and rec["gflops"] > 0
    pct = f"({100 * rec['gflops'] / rec['gemm_gflops']:.0f}% gemm)"
    text = capsys.readouterr().out
    assert pct in text and "gemm " in text


def test_short_callables_get_untimed_calls_after_each_pause(monkeypatch):
    """A short callable is called untimed for WARMUP_SECONDS after every pause (its thread
    team wakes outside the sample); a long one is not; the samples count only the timed
    calls."""
    from fastattn.bench import runner

    calls = {"short": 0, "long": 0}

    def short() -> None:
        calls["short"] += 1

    def long() -> None:
        calls["long"] += 1
        runner.time.sleep(runner.WARMUP_BELOW * 1.2)

    s = runner.timed(short, min_time=0.001)
    ln = runner.timed(long, min_time=0.001)
    assert s.warmup and not ln.warmup
    assert calls == {"short": 2, "long": 2}  # the sizing calls
    assert s.number > 1 and ln.number == 1
    monkeypatch.setattr(runner, "WARMUP_SECONDS", 0.0)  # one warm-up call each
    runner.interleaved_rounds([s, ln], repeat=3, pause=0.0)
    assert calls["short"] == 2 + 3 * (s.number + 1)
    assert calls["long"] == 2 + 3
    assert len(s.times) == len(ln.times) == 3
    assert min(ln.times) >= runner.WARMUP_BELOW  # the long call's own time, not a mean with warm-ups
    monkeypatch.setattr(runner, "WARMUP_SECONDS", 0.02)
    before = calls["short"]
    t0 = runner.time.perf_counter()
    runner.interleaved_rounds([s], repeat=1, pause=0.0)
    assert runner.time.perf_counter() - t0 >= 0.02
    assert calls["short"] - before > s.number + 1  # warm-up calls until 0.02 s had passed


def test_gemm_yardstick_runs_and_counts_its_flops():
    from fastattn.bench.yardsticks import gemm_reader

    run, flops = gemm_reader(1, n=64)
    run()
    assert flops == 2 * 64**3  # the flops of one 64 x 64 x 64 product


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
    """The 16-bit limit of --dtype bfloat16 runs: torch.mm in bf16 (None without torch,
    and None on a CPU without bf16 arithmetic, where torch emulates it)."""
    from fastattn import _kernels
    from fastattn.bench import measure_gemm_bf16

    try:
        import torch  # noqa: F401
    except ImportError:
        assert measure_gemm_bf16(1, n=128, repeat=1) is None
        return
    if not (_kernels.cpu_has("avx512bf16") or _kernels.cpu_has("amx")):
        assert measure_gemm_bf16(1, n=128, repeat=1) is None
        return
    rate = measure_gemm_bf16(1, n=256, repeat=2)
    assert rate is not None and rate > 0


# Small shapes that reach every adapter's branches: causal L == S (the ops' own causal
# flags), a window (explicit masks), GQA (K/V heads repeated for ORT's MHA), causal
# L < S (bottom-right aligned: masks for torch/JAX, a skip for MHA), a 16-bit K/V cache
# (float32 copies) and varlen (one call per sequence, or one packed call).
PEER_CASES = [
    ("causal", dict(B=2, Hq=2, Hk=2, L=40, S=40, D=16, causal=True)),
    ("window", dict(B=1, Hq=2, Hk=2, L=48, S=48, D=16, causal=True, window=(7, 0))),
    ("gqa decode", dict(B=2, Hq=4, Hk=2, L=1, S=70, D=32, kind="decode")),
    ("causal L<S", dict(B=1, Hq=2, Hk=1, L=9, S=30, D=8, causal=True)),
    ("f16kv", dict(B=1, Hq=2, Hk=2, L=1, S=50, D=16, kv_dtype="float16", kind="decode")),
    ("varlen", dict(B=2, Hq=2, Hk=2, L=0, S=0, D=16, causal=True, kind="varlen", seqlens=(19, 33))),
    # the masked cases' attn_mask forms (every batch checked: batch 0 of padding is full)
    ("padding gqa", dict(B=3, Hq=4, Hk=2, L=12, S=40, D=16, mask="padding")),
    ("hf_float", dict(B=2, Hq=2, Hk=2, L=24, S=24, D=16, mask="hf_float")),
    ("random", dict(B=2, Hq=2, Hk=1, L=16, S=33, D=8, mask="random")),
]


@pytest.mark.parametrize("name,shape", PEER_CASES, ids=[n for n, _ in PEER_CASES])
@pytest.mark.parametrize("impl", [c.name for c in bench.IMPLS])
def test_every_peer_agrees_with_the_reference(impl, name, shape):
    from fastattn.bench import inputs, peers

    cls = next(c for c in bench.IMPLS if c.name == impl)
    adapter = cls()
    why = adapter.available()
    if why is not None:
        pytest.skip(why)
    inp = bench.make_inputs(bench.Case(name, **shape), "float32", seed=3)
    try:
        run = adapter.prepare(inp, 1)
    except peers.Skip as e:  # the adapter says why it cannot run this case
        assert impl == "ort-mha" and name == "causal L<S", e
        pytest.skip(str(e))
    ref = inputs.reference_output(inp)
    err = inputs.check(run, inp, ref)
    assert err <= inputs.tolerance(inp), err
    if inp.mask is not None:  # the mask changes the answer: a peer that dropped it would fail
        unmasked = inputs.reference_output(dataclasses.replace(inp, mask=None))
        assert np.abs(unmasked - ref).max() > 10 * inputs.tolerance(inp) * np.abs(ref).max()


def test_case_masks_by_construction():
    from fastattn.bench import cases

    c = bench.Case("c", 6, 2, 2, 7, 50, 8, mask="padding")
    n = cases.padding_lengths(c)
    assert n[0] == 50 and all(25 <= x <= 50 for x in n) and len(set(n.tolist())) > 1
    np.testing.assert_array_equal(n, cases.padding_lengths(c))  # deterministic
    pad = cases.case_mask(c)
    assert pad.dtype == np.bool_ and pad.shape == (6, 1, 1, 50)
    np.testing.assert_array_equal(pad[:, 0, 0], np.arange(50)[None, :] < n[:, None])
    one = cases.padding_lengths(bench.Case("one", 1, 2, 2, 7, 50, 8, mask="padding"))
    assert one.tolist() == [40]  # a single sequence: 80% of S
    hf = cases.case_mask(dataclasses.replace(c, mask="hf_float"))
    assert hf.dtype == np.float32 and hf.shape == (6, 1, 7, 50) and hf.flags.c_contiguous
    lo = np.finfo(np.float32).min
    np.testing.assert_array_equal(hf, np.where(np.broadcast_to(pad, hf.shape), np.float32(0), lo))
    np.testing.assert_array_equal(cases.mask_visible(hf), np.broadcast_to(pad, hf.shape))
    big = bench.Case("r", 2, 2, 2, 64, 300, 8, mask="random")
    r = cases.case_mask(big)
    assert r.dtype == np.bool_ and r.shape == (2, 1, 64, 300) and 0.88 < r.mean() < 0.92
    np.testing.assert_array_equal(r, cases.case_mask(big))
    sparse = cases.case_mask(bench.Case("r", 4, 1, 1, 50, 2, 8, mask="random"))  # rows of 2 keys
    assert sparse.any(axis=-1).all()  # every row sees a key
    assert cases.mask_pairs(c) == 7 * n.sum()
    assert bench.case_flops(c) == 4 * 8 * 2 * 7 * n.sum()  # the visible pairs only
    for bad in (dict(mask="ragged"), dict(mask="padding", causal=True), dict(mask="random", window=(3, 0))):
        with pytest.raises(ValueError, match="mask"):
            bench.Case("bad", 1, 1, 1, 4, 4, 8, **bad)


def test_masked_cases_are_paired_and_kept_out_of_quick():
    from fastattn.bench import cases

    masked = [c for c in cases.CASES if c.mask is not None]
    assert {c.mask for c in masked} == set(cases.MASKS)
    assert {m for _, m in cases.MASK_PAIRS} == {c.name for c in masked}
    for full, m in cases.MASK_PAIRS:
        assert dataclasses.replace(cases.by_name(m), name=full, mask=None) == cases.by_name(full)
    assert [n for n in cases.QUICK_CASES if cases.by_name(n).mask] == ["B8 H12 L512 D64 padding"]


@pytest.mark.parametrize("name", [m for _, m in bench.cases.MASK_PAIRS])
def test_masked_case_runs_and_checks_its_mask(name):
    """Each masked case at 2 heads and D=16 (its batch, lengths and mask kept), through the
    bench's own check and timing: fastattn and torch pass the reference check on a slice
    that holds masked pairs, and are timed."""
    import io

    from fastattn.bench import cases, inputs, peers, runner

    case = dataclasses.replace(cases.by_name(name), Hq=2, Hk=2, D=16)
    small = inputs.check_slice(inputs.make_inputs(case, "float32"))
    assert not cases.mask_visible(small.mask).all()  # the check meets the mask
    args = bench.parse_args(["--quick", "--repeat", "1", "--threads", "1", "--pause", "0"])
    args.gemm_n = 64
    recs = runner.run_case(case, [peers.FastAttn, peers.Torch], args, io.StringIO())
    for r in recs:
        if r["impl"] == "torch" and r["status"] == "skipped":
            continue  # torch not installed
        assert r["status"] == "ok", r
        assert r["max_err"] <= 1e-3 and r["seconds"] > 0
        assert r["mask"] == case.mask and 0.5 < r["visible"] < 1


def test_mask_summary(capsys):
    from fastattn.bench.report import mask_summary

    def rec(case, impl, seconds, visible=None):
        return {"case": case, "impl": impl, "seconds": seconds, "visible": visible}

    records = [
        rec("u", "fastattn", 2.0),
        rec("u", "torch", 3.0),
        rec("u pad", "fastattn", 1.5, 0.75),
        rec("u pad", "torch", 6.0, 0.75),
        rec("u rand", "fastattn", 2.5, 0.9),
        rec("u rand", "torch", None, 0.9),  # failed: no ratio
    ]
    got = mask_summary(records, sys.stdout, pairs=(("u", "u pad"), ("u", "u rand"), ("u", "absent")))
    assert got["masked_over_unmasked"] == [
        {"case": "u pad", "unmasked": "u", "impl": "fastattn", "ratio": 0.75, "visible": 0.75},
        {"case": "u pad", "unmasked": "u", "impl": "torch", "ratio": 2.0, "visible": 0.75},
        {"case": "u rand", "unmasked": "u", "impl": "fastattn", "ratio": 1.25, "visible": 0.9},
    ]
    assert got["torch_over_fastattn"] == [
        {"case": "u pad", "unmasked": "u", "ratio": 4.0, "unmasked_ratio": 1.5}
    ]
    text = capsys.readouterr().out
    assert "fastattn    u pad:  0.75 of the unmasked time (visible 0.75)" in text
    assert "u pad  fastattn 4.00x faster  (unmasked: fastattn 1.50x faster)" in text
    assert "absent" not in text


def test_numpy_baseline_against_the_reference():
    # the baseline of fastattn bench, python -m fastattn and asv: GQA, causal L < S, window
    from fastattn import reference
    from fastattn.bench import cases

    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 6, 11, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 3, 29, 8)).astype(np.float32) for _ in range(2))
    for causal, window in ((False, None), (True, None), (True, (4, 0)), (False, (3, 2))):
        got = cases.numpy_attention(q, k, v, cases.additive_mask(11, 29, causal, window))
        want = reference.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True, window=window
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_flop_count_by_hand():
    c = bench.Case("c", 2, 3, 3, 4, 4, 8, causal=True)  # rows see 1, 2, 3, 4 keys
    assert bench.case_flops(c) == 4 * 8 * 2 * 3 * 10
    w = bench.Case("w", 1, 1, 1, 5, 5, 2, causal=True, window=(1, 0))  # 1, 2, 2, 2, 2 keys
    assert bench.case_flops(w) == 4 * 2 * 9
    d = bench.Case("d", 1, 4, 2, 1, 100, 16, kind="decode")  # bottom-right: all 100 keys
    assert bench.case_flops(d) == 4 * 16 * 4 * 100
    v = bench.Case("v", 2, 2, 2, 0, 0, 4, causal=True, kind="varlen", seqlens=(2, 3))  # 3 + 6 pairs
    assert bench.case_flops(v) == 4 * 4 * 2 * 9
