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


# ----------------------------------------------------------------------------- 8-bit K/V cases


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_kv8_quantize_per_token_is_fastattns(fmt):
    """The bench's NumPy quantiser (cases.py imports no fastattn) gives exactly what
    fastattn.quantize_kv gives: the same codes and scales, a row of zeros included."""
    from fastattn.bench import cases

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2, 3, 17, 40)) * rng.uniform(0.01, 30, (2, 3, 17, 1))).astype(np.float32)
    x[0, 1, 4] = 0.0
    got_q, got_s = cases.quantize_per_token(x, fmt)
    want_q, want_s = fastattn.quantize_kv(x, fmt)
    assert got_q.dtype == want_q.dtype and got_s.shape == (2, 3, 17, 1)
    np.testing.assert_array_equal(got_q.view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(got_s, want_s)
    assert got_s[0, 1, 4, 0] == 1.0


def test_kv8_cases_and_their_quick_sizes():
    from fastattn.bench import cases

    kv8 = [c for c in cases.CASES if c.kv8]
    assert {(c.kv_dtype, c.kind) for c in kv8} == {(f, k) for f in cases.KV8 for k in ("decode", "prefill")}
    for fmt in cases.KV8:
        kv = cases.KV8_SHORT[fmt] + "kv"
        d = cases.by_name(f"B1 H32 S32768 D128 decode {kv}")
        g = cases.by_name(f"B1 H32/8 S65536 D128 decode {kv}")
        p = cases.by_name(f"B1 H8 L2048 D128 causal {kv}")
        assert (d.Hq, d.Hk, d.S, d.D, g.Hq, g.Hk, g.S) == (32, 32, 32768, 128, 32, 8, 65536)
        assert p.causal and p.L == p.S == 2048 and p.q_dtype == "bfloat16"
        qd, qg, qp = (cases.quick_case(c) for c in (d, g, p))
        assert (qd.name, qd.S, qd.L) == (f"B1 H32 S4096 D128 decode {kv}", 4096, 1)
        assert (qg.name, qg.S) == (f"B1 H32/8 S8192 D128 decode {kv}", 8192)
        assert (qp.name, qp.L, qp.S) == (f"B1 H8 L512 D128 causal {kv}", 512, 512)
    plain = cases.by_name("B1 H32 S8192 D128 decode bf16kv")
    assert cases.quick_case(plain) is plain  # only 8-bit cases shrink
    assert all(cases.by_name(n) for n in cases.QUICK_CASES)
    with pytest.raises(ValueError, match="8-bit"):
        bench.Case("bad", 1, 1, 1, 4, 4, 8, kv_dtype="int8", mask="padding")
    with pytest.raises(ValueError, match="kv8_inputs"):
        cases.random_inputs(cases.by_name("B1 H32 S32768 D128 decode int8kv"), "float32")


def test_kv8_bytes_count_the_scales():
    from fastattn.bench import cases

    c = bench.Case("c", 2, 8, 4, 1, 100, 64, kv_dtype="int8", kind="decode")
    # K and V: 2 x (2 x 4 x 100) tokens of 64 bytes and one float32 scale each
    assert cases.kv_bytes(c, cases.np_dtype("int8")) == 2 * 2 * 4 * 100 * (64 + 4)
    assert cases.kv_bytes(c, cases.np_dtype("float8_e5m2")) == 2 * 2 * 4 * 100 * (64 + 4)
    assert cases.kv_bytes(c, cases.np_dtype("bfloat16")) == 2 * 2 * 4 * 100 * 128
    assert cases.kv_bytes(c, np.dtype(np.float32)) == 2 * 2 * 4 * 100 * 256


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_kv8_inputs_are_the_float_draws_quantised(fmt):
    """An 8-bit case's K/V dequantise to the float case's draws within half a step (int8)
    or fp8's relative rounding; the same-contents inputs are those dequantised values."""
    from fastattn.bench import cases, inputs

    c8 = bench.Case("c", 1, 4, 2, 3, 50, 16, kv_dtype=fmt, q_dtype="bfloat16")
    inp = inputs.make_inputs(c8, "float32")
    q, k, v = cases.random_inputs(dataclasses.replace(c8, kv_dtype="float32", q_dtype=None), "float32")
    assert inp.q.dtype == cases.np_dtype("bfloat16") and inp.k.dtype == cases.np_dtype(fmt)
    np.testing.assert_array_equal(inp.q.astype(np.float32), q.astype(cases.np_dtype("bfloat16")))
    for x8, s, x in ((inp.k, inp.k_scale, k), (inp.v, inp.v_scale, v)):
        assert s.shape == (1, 2, 50, 1) and s.dtype == np.float32
        deq = x8.astype(np.float32) * s
        step = s / 2 if fmt == "int8" else np.abs(x) * (2.0**-4 if fmt == "float8_e4m3fn" else 2.0**-3)
        assert np.all(np.abs(deq - x) <= step + 1e-6)
    same = inp.dequantised("float32", "float32")
    np.testing.assert_array_equal(same.k, inp.k.astype(np.float32) * inp.k_scale)
    assert same.q.dtype == np.float32 and same.k_scale is None
    small = inputs.check_slice(inp)
    assert small.k_scale.shape == (1, 1, 50, 1) and small.k.shape == (1, 1, 50, 16)
    ref = inputs.reference_output(small)  # the oracle on the dequantised K/V
    want = fastattn.reference.scaled_dot_product_attention(
        small.q.astype(np.float32), same.k[:, :1], same.v[:, :1], is_causal=False
    )
    np.testing.assert_allclose(ref, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_kv8_case_is_timed_against_the_same_contents(kind):
    """An 8-bit case: fastattn's 8-bit call passes the oracle's check, fastattn on the same
    contents in float32 and bfloat16 is timed beside it, the peers skip, each record's
    GB/s counts its own K/V bytes, and the summary gives the speed ratios."""
    import io

    from fastattn.bench import cases, peers, report, runner

    L, causal = (1, False) if kind == "decode" else (40, True)
    case = bench.Case("kv8", 1, 4, 2, L, 300 if L == 1 else 40, 32, causal=causal, kv_dtype="int8", kind=kind)
    args = bench.parse_args(["--quick", "--repeat", "1", "--threads", "1", "--pause", "0"])
    args.gemm_n = 64
    recs = runner.run_case(case, [peers.FastAttn, peers.NumpyRef], args, io.StringIO())
    by = {r["impl"]: r for r in recs}
    assert list(by) == ["fastattn", "numpy", "fastattn-bf16kv", "fastattn-f32kv"]
    assert by["numpy"]["status"] == "skipped" and "8-bit" in by["numpy"]["note"]
    for name, dt in (("fastattn", "int8"), ("fastattn-bf16kv", "bfloat16"), ("fastattn-f32kv", "float32")):
        r = by[name]
        assert r["status"] == "ok" and r["dtype"] == dt and r["seconds"] > 0, r
        assert r["max_err"] <= (3e-2 if dt == "bfloat16" else 2e-3)
        if kind == "decode":
            assert r["gbps"] * r["seconds"] * 1e9 == pytest.approx(cases.kv_bytes(case, cases.np_dtype(dt)))
    out = io.StringIO()
    rows = report.kv8_summary(recs, out)
    assert [(x["kv_dtype"], x["against"]) for x in rows] == [("int8", "bfloat16"), ("int8", "float32")]
    for x in rows:
        other = by["fastattn-" + cases.KV8_COMPARE[x["against"]] + "kv"]
        assert x["speedup"] == pytest.approx(other["seconds"] / by["fastattn"]["seconds"])
    assert "x bf16" in out.getvalue() and "x f32" in out.getvalue()


def test_kv8_quick_run_writes_its_summary(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench.main(
        ["--quick", "--cases", "B1 H32/8 S65536 D128 decode e5m2kv", "--no-machine", "--impls", "fastattn"]
        + ["--repeat", "1", "--threads", "1", "--pause", "0", "--json", str(out)]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert {r["case"] for r in data["records"]} == {"B1 H32/8 S8192 D128 decode e5m2kv"}  # the quick size
    assert {(x["kv_dtype"], x["against"]) for x in data["kv8_summary"]} == {
        ("float8_e5m2", "bfloat16"),
        ("float8_e5m2", "float32"),
    }


def test_paged_pool_gathers_back_to_the_sequences():
    """paged_pool: the table's pages, gathered, are each sequence's tokens (zeros past its
    end); every page belongs to one sequence; the order is shuffled, the same for a seed."""
    from fastattn.bench import cases

    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((2, n, 5)).astype(np.float32) for n in (33, 16, 1)]
    pool, table = cases.paged_pool(xs, 16, seed=7)
    assert pool.shape == (3 + 1 + 1, 2, 16, 5) and table.shape == (3, 3) and table.dtype == np.int32
    for b, x in enumerate(xs):
        n = x.shape[1]
        pages = -(-n // 16)
        got = pool[table[b, :pages]].transpose(1, 0, 2, 3).reshape(2, pages * 16, 5)
        np.testing.assert_array_equal(got[:, :n], x)
        assert not got[:, n:].any()
        assert not table[b, pages:].any()
    used = np.concatenate([table[0, :3], table[1, :1], table[2, :1]])
    assert sorted(used) == list(range(5))
    np.testing.assert_array_equal(cases.paged_pool(xs, 16, seed=7)[1], table)
    assert not np.array_equal(cases.paged_pool(xs, 16, seed=8)[1], table)


def test_paged_cases_and_their_quick_sizes():
    from fastattn.bench import cases

    paged = [c for c in cases.CASES if c.page]
    assert {(c.kind, c.kv_dtype) for c in paged} == {
        ("decode", "bfloat16"),
        ("decode", None),
        ("decode", "int8"),
        ("varlen", None),
    }
    d = cases.by_name("B4 H32/8 S8192 D128 decode int8kv page16")
    assert (d.B, d.Hq, d.Hk, d.S, d.D, d.page) == (4, 32, 8, 8192, 128, 16)
    qd = cases.quick_case(d)
    assert (qd.name, qd.S) == ("B4 H32/8 S2048 D128 decode int8kv page16", 2048)
    c = next(c for c in paged if c.kind == "varlen")
    assert c.causal and c.query_lens == (1,) * 6 + (512,) and c.seqlens == (4096,) * 6 + (2048,)
    qc = cases.quick_case(c)
    assert qc.seqlens == (1024,) * 6 + (512,) and qc.query_lens == (1,) * 6 + (512,)
    # FLOPs: each decode row sees its keys, the chunk's rows a bottom-right causal band
    want = 4 * 32 * 128 * (6 * 4096 + sum(2048 - 512 + i + 1 for i in range(512)))
    assert cases.case_flops(c) == want
    with pytest.raises(ValueError, match="paged"):
        bench.Case("bad", 1, 1, 1, 4, 4, 8, page=16)
    with pytest.raises(ValueError, match="q_lens"):
        bench.Case("bad", 2, 1, 1, 0, 0, 8, kind="varlen", seqlens=(4, 4), q_lens=(5, 1))


@pytest.mark.parametrize("kv", [None, "bfloat16", "int8"])
def test_paged_decode_case_is_timed_against_the_contiguous_call(kv):
    """A paged decode case: fastattn's paged call (pages shuffled, a partly filled last
    page) passes the oracle's check, its call without pages is timed beside it, the peers
    skip, and the summary gives the ratio."""
    import io

    from fastattn.bench import peers, report, runner

    case = bench.Case("paged", 2, 4, 2, 1, 300, 32, kv_dtype=kv, kind="decode", page=16)
    args = bench.parse_args(["--quick", "--repeat", "1", "--threads", "1", "--pause", "0"])
    recs = runner.run_case(case, [peers.FastAttn, peers.NumpyRef], args, io.StringIO())
    by = {r["impl"]: r for r in recs}
    assert list(by) == ["fastattn", "numpy", "fastattn-contig"]
    assert by["numpy"]["status"] == "skipped" and "paged" in by["numpy"]["note"]
    for name in ("fastattn", "fastattn-contig"):
        assert by[name]["status"] == "ok" and by[name]["seconds"] > 0, by[name]
        assert by[name]["max_err"] <= (3e-2 if kv == "bfloat16" else 2e-3)
    out = io.StringIO()
    (row,) = report.paged_summary(recs, out)
    assert row["speed"] == pytest.approx(by["fastattn-contig"]["seconds"] / by["fastattn"]["seconds"])
    assert "x contig" in out.getvalue()


def test_paged_runner_really_reads_pages(monkeypatch):
    """The paged call passes the shuffled pool and its table to attention_with_kvcache, and
    a wrong table fails the oracle's check (the check is not vacuous)."""
    from fastattn.bench import inputs, peers

    case = bench.Case("paged", 1, 2, 1, 1, 64, 16, kind="decode", page=16)
    inp = inputs.make_inputs(case, "float32")
    ref = inputs.reference_output(inp)
    seen = {}
    real = fastattn.attention_with_kvcache

    def spy(q, k, v, lens, **kw):
        seen.update(kw, k=k)
        bt = kw["block_table"]
        if seen.get("swap"):
            kw["block_table"] = np.zeros_like(
                bt
            )  # every page the first (a reorder would not show: keys are a set)
        return real(q, k, v, lens, **kw)

    monkeypatch.setattr(fastattn, "attention_with_kvcache", spy)
    fn = peers.FastAttn().prepare(inp, 1)
    assert inputs.check(fn, inp, ref) < 1e-5
    assert seen["k"].shape == (4, 1, 16, 16) and seen["block_table"].shape == (1, 4)
    seen["swap"] = True
    assert inputs.check(fn, inp, ref) > 1e-2


def test_chunked_prefill_case_is_timed_against_the_separate_calls(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench.main(
        ["--quick", "--cases", "chunked prefill", "--no-machine", "--impls", "fastattn", "numpy"]
        + ["--repeat", "1", "--threads", "1", "--pause", "0", "--json", str(out)]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    by = {r["impl"]: r for r in data["records"]}
    assert by["fastattn"]["status"] == by["fastattn-separate"]["status"] == "ok"
    assert by["fastattn"]["max_err"] <= 1e-3 and by["fastattn-separate"]["max_err"] <= 1e-3
    assert by["numpy"]["status"] == "skipped"
    (row,) = data["paged_summary"]
    assert row["against"] == "fastattn-separate"
    assert row["speed"] == pytest.approx(by["fastattn-separate"]["seconds"] / by["fastattn"]["seconds"])
