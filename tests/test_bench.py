"""The benchmark command runs end to end (tiny case, no peers timed for long)."""

import json

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
