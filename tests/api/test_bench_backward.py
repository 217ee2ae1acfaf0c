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
