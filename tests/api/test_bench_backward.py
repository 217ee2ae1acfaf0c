"""The forward + backward benchmark runs end to end (quick shapes, one repetition)."""

import json

from fastattn import bench_backward


def test_quick_run_writes_json(tmp_path, capsys):
    out = tmp_path / "bwd.json"
    rc = bench_backward.main(
        [
            "--quick",
            "--cases",
            "B4 H8 L512 D128 causal",
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
    (rec,) = data["records"]
    assert rec["case"] == "B4 H8 L512 D128 causal" and rec["fastattn_ms"] > 0
    assert "B4 H8 L512 D128 causal" in capsys.readouterr().out


def test_fastattn_passes_its_reference_check():
    assert bench_backward.check("fastattn", 100, 32, True) < 1e-4


def test_fastattn_bench_backward_is_the_same_run(tmp_path, capsys):
    from fastattn import bench

    out = tmp_path / "bwd.json"
    rc = bench.main(
        ["--backward", "--quick", "--cases", "L2048 D64 causal", "--impls", "fastattn", "--repeat", "2"]
        + ["--threads", "1", "--json", str(out)]
    )
    assert rc == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["case"] == "B1 H8 L2048 D64 causal" and len(rec["fastattn_all_ms"]) == 2
    assert "torch_ms" not in rec and "speedup_vs_torch" not in rec
    assert "forward + backward" in capsys.readouterr().out


def test_backward_rejects_what_it_cannot_time(capsys):
    import pytest

    from fastattn import bench

    for extra in (["--dtype", "float16"], ["--sweep"], ["--impls", "numpy"]):
        with pytest.raises(SystemExit) as e:
            bench.main(["--backward", *extra])
        assert e.value.code == 2
        assert "--backward" in capsys.readouterr().err
