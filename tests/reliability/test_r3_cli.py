"""Reliability round 3 (issue 42 items 14-17, issue 45 item 6): the command line and the
run-time knobs.

- An invalid ``FASTATTN_ISA`` / ``FASTATTN_TILES`` / ``FASTATTN_NUM_THREADS`` is ignored with
  a one-line warning at import (the default is used); ``fastattn --help`` and ``fastattn info``
  work and ``info`` lists it; ``check`` and ``bench`` refuse to run (exit status 2).
- ``fastattn bench --threads`` is bounded like ``num_threads`` (1024).
- ``fastattn bench --json PATH`` checks PATH before the run.
- ``set_tiles`` / ``set_num_threads`` take NumPy integers.
- ``fastattn info`` reads optional packages' versions from their metadata (no import).
- ``fastattn bench --backward --quick`` names the shapes it times and prints no speedup from
  fewer than 3 samples.

The command line runs in a child process (with a timeout) wherever a regression could
crash or hang it.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import optional

import fastattn
from fastattn import _kernels, bench, reference
from fastattn._checks import MAX_THREADS
from fastattn.bench import backward
from fastattn.bench.report import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
KNOBS = ("FASTATTN_ISA", "FASTATTN_TILES", "FASTATTN_NUM_THREADS")


def child(args: list[str], cwd: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` importing this fastattn, with ``env`` as the only FASTATTN_* knobs."""
    e = {k: v for k, v in os.environ.items() if k not in KNOBS and k != "PYTHONWARNINGS"}
    e["PYTHONPATH"] = ROOT
    e.update(env)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout
    )


# (variable, invalid value, what the message must list as accepted)
_missing_isa = [i for i in _kernels.ISA_NAMES if not _kernels.cpu_has(i)]
BAD_KNOBS = [
    ("FASTATTN_ISA", "bogus", ", ".join(_kernels.ISA_NAMES)),
    ("FASTATTN_TILES", "lots", "an integer in [1, 4096]"),
    ("FASTATTN_NUM_THREADS", "100000", f"an integer in [1, {MAX_THREADS}]"),
]  # (tests/kernel/test_tiles.py and test_threadctl.py import with "0" and "zero")
if _missing_isa:  # a real path name that this CPU cannot run: ignored the same way
    BAD_KNOBS.append(("FASTATTN_ISA", _missing_isa[0], ", ".join(_kernels.ISA_NAMES)))


def _warning_lines(stderr: str, var: str) -> list[str]:
    return [line for line in stderr.splitlines() if f"{var}=" in line]


@pytest.mark.parametrize("var,value,accepted", BAD_KNOBS)
def test_bad_knob_is_ignored_with_one_line_and_the_cli_still_diagnoses(tmp_path, var, value, accepted):
    env = {var: value}
    # the library: imports, warns once on one line naming the variable and the accepted values,
    # and runs with the default (the same values as without the variable)
    code = (
        "import fastattn; from fastattn import _kernels; "
        "print(fastattn.get_isa() == _kernels.isa_best(), fastattn.get_tiles(), "
        "fastattn.get_num_threads() == min(_kernels.omp_max_threads(), 1024), "
        "sorted(fastattn._config.env_problems()))"
    )
    r = child(["-c", code], str(tmp_path), **env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "None", "True", f"['{var}']"]
    (line,) = _warning_lines(r.stderr, var)
    assert f"{var}={value!r} ignored" in line and accepted in line and "RuntimeWarning" in line
    assert "Traceback" not in r.stderr

    # --help: the help, no traceback
    r = child(["-m", "fastattn", "--help"], str(tmp_path), **env)
    assert r.returncode == 0 and "usage: fastattn" in r.stdout and "Traceback" not in r.stderr
    assert len(_warning_lines(r.stderr, var)) == 1

    # info: the whole configuration, the ignored variable listed with what it expects
    r = child(["-m", "fastattn", "info"], str(tmp_path), **env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = r.stdout.splitlines()
    i = next(n for n, line in enumerate(out) if line.startswith("ignored environment variables"))
    assert f"{var}={value!r} ignored" in out[i + 1] and accepted in out[i + 1]
    assert any(line.split() == [var, value] for line in out)  # the raw value, as before
    assert any(line.startswith("isa ") for line in out)

    # check (and the default command): refuse, one line naming the variable, before any kernel runs
    r = child(["-m", "fastattn", "check"], str(tmp_path), **env)
    assert r.returncode == 2 and "PASS" not in r.stdout and "Traceback" not in r.stderr
    (refusal,) = [line for line in r.stderr.splitlines() if line.startswith("fastattn check: not run")]
    assert f"{var}={value!r}" in refusal and accepted in refusal


def test_bench_refuses_to_time_under_an_ignored_knob(tmp_path):
    r = child(
        ["-m", "fastattn", "bench", "--quick", "--no-machine", "--cases", "B1 H8 L1024 D64"],
        str(tmp_path),
        timeout=60,
        FASTATTN_TILES="-3",
    )
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert "fastattn bench: not run, because FASTATTN_TILES='-3' ignored" in r.stderr


def test_valid_knobs_still_apply(tmp_path):
    code = "import fastattn; print(fastattn.get_tiles(), fastattn.get_num_threads(), fastattn.get_isa())"
    r = child(
        ["-W", "error", "-c", code],
        str(tmp_path),
        FASTATTN_TILES=" 200 ",
        FASTATTN_NUM_THREADS="3",
        FASTATTN_ISA=" Scalar",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["200", "3", "scalar"]


def test_show_config_lists_no_ignored_knob_when_there_is_none(capsys):
    assert fastattn._config.env_problems() == {}  # conftest refuses a session with one
    fastattn.show_config()
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("ignored environment")]
    assert line.split()[-1] == "none"


# ------------------------------------------------------------------ bench --threads


@pytest.mark.parametrize("threads", ["100000", "0"])
def test_bench_threads_out_of_range_is_an_argument_error(tmp_path, threads):
    # It was accepted and hung starting 100000 threads per library: a child with a timeout.
    r = child(
        ["-m", "fastattn", "bench", "--quick", "--no-machine", "--threads", threads],
        str(tmp_path),
        timeout=60,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines()[-1] == (
        f"fastattn: error: --threads must be >= 1 and <= {MAX_THREADS} (num_threads' bound), "
        f"got {int(threads)}"
    )


def test_bench_threads_bound_is_the_library_bound(capsys):
    args = bench.parse_args(["--threads", str(MAX_THREADS), "--quick"])
    assert args.threads == MAX_THREADS
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--threads", str(MAX_THREADS + 1)])
    assert e.value.code == 2 and "--threads" in capsys.readouterr().err
    with pytest.raises(ValueError):  # the library refuses the same number
        fastattn.set_num_threads(MAX_THREADS + 1)


# ------------------------------------------------------------------ bench --json


@pytest.mark.parametrize("where", ["missing directory", "a directory", "backward"])
def test_bench_json_to_an_unwritable_path_fails_before_the_run(tmp_path, monkeypatch, capsys, where):
    import fastattn.bench.command as command

    def no_run(*a, **k):  # the run must not start
        raise AssertionError("benchmarked before checking --json")

    monkeypatch.setattr(command, "run_case", no_run)
    monkeypatch.setattr(backward, "run_case", no_run)
    path = str(tmp_path / "no" / "such" / "r.json") if where != "a directory" else str(tmp_path)
    argv = ["--quick", "--no-machine", "--json", path] + (["--backward"] if where == "backward" else [])
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--json {path}: cannot write there" in err


def test_bench_json_check_leaves_no_file_and_keeps_an_existing_one(tmp_path, capsys):
    new = tmp_path / "new.json"
    bench.parse_args(["--json", str(new)])
    assert not new.exists()  # the probe removed what it created
    old = tmp_path / "old.json"
    old.write_text('{"keep": 1}')
    bench.parse_args(["--json", str(old)])
    assert old.read_text() == '{"keep": 1}'  # appended nothing, truncated nothing


def test_json_write_failing_after_the_run_prints_the_json(tmp_path, capsys):
    data = {"records": [{"case": "x", "seconds": 1.5}]}
    out = io.StringIO()
    assert write_json(str(tmp_path / "gone" / "r.json"), data, out) == 1
    assert json.loads(out.getvalue()) == data
    assert "cannot write --json" in capsys.readouterr().err
    out = io.StringIO()
    assert write_json(str(tmp_path / "r.json"), data, out) == 0
    assert json.loads((tmp_path / "r.json").read_text()) == data


# ------------------------------------------------------------------ NumPy integers


@pytest.mark.parametrize("np_int", [np.int64, np.int32, np.uint16])
def test_set_tiles_and_set_num_threads_take_numpy_integers(np_int):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 100, 16)).astype(np.float32) for _ in range(3))
    expected = reference.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        fastattn.set_tiles(np_int(32))
        fastattn.set_num_threads(np_int(2))
        assert fastattn.get_tiles() == 32 and type(fastattn.get_tiles()) is int
        assert fastattn.get_num_threads() == 2 and type(fastattn.get_num_threads()) is int
        got = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    finally:
        fastattn.set_tiles(None)
        fastattn.set_num_threads(None)


@pytest.mark.parametrize("bad", [True, np.True_, 32.0, np.float64(32), "32"])
def test_set_tiles_and_set_num_threads_still_refuse_non_integers(bad):
    with pytest.raises(TypeError, match="rows must be an int"):
        fastattn.set_tiles(bad)
    with pytest.raises(TypeError, match="num_threads must be an int"):
        fastattn.set_num_threads(bad)
    assert fastattn.get_tiles() is None


def test_set_tiles_numpy_integer_out_of_range():
    with pytest.raises(ValueError, match=r"rows must be in \[1, 4096\], got 4097"):
        fastattn.set_tiles(np.int64(4097))
    assert fastattn.get_tiles() is None


# ------------------------------------------------------------------ info without imports


def test_info_reads_versions_without_importing_optional_packages(tmp_path):
    code = (
        "import sys, fastattn; cfg = fastattn._config.config(); "
        "print('ml_dtypes' in sys.modules, cfg['ml_dtypes'], cfg['numpy'])"
    )
    r = child(["-c", code], str(tmp_path))
    assert r.returncode == 0, r.stderr
    imported, ml, npv = r.stdout.split()
    assert imported == "False"
    from importlib import metadata

    assert npv == metadata.version("numpy") == np.__version__
    try:
        assert ml == metadata.version("ml_dtypes")
    except metadata.PackageNotFoundError:
        assert ml == "None"
    assert fastattn._config._module_version("no-such-package-fastattn") is None


# ------------------------------------------------------------------ bench --backward --quick


def _quick_backward(tmp_path, repeat: int, capsys):
    out = tmp_path / "bwd.json"
    argv = ["--backward", "--quick", "--cases", "B4 H8 L512 D128 causal", "--threads", "1"]
    rc = bench.main([*argv, "--repeat", str(repeat), "--pause", "0", "--json", str(out)])
    assert rc == 0
    (rec,) = json.loads(out.read_text())["records"]
    return rec, capsys.readouterr().out


def test_backward_quick_names_the_shapes_it_times_and_no_speedup_from_one_sample(tmp_path, capsys):
    optional("torch")
    rec, text = _quick_backward(tmp_path, 1, capsys)
    quick = backward.BACKWARD_CASES[2].quick()
    assert (rec["B"], rec["H"], rec["L"], rec["D"]) == (4, 2, 64, 128) == (quick.B, quick.H, quick.L, quick.D)
    assert rec["shape"] == "B4 H2 L64 D128 causal" and rec["case"] == "B4 H8 L512 D128 causal"
    assert rec["quick"] is True and "speedup_vs_torch" not in rec
    (line,) = [x for x in text.splitlines() if x.startswith("B4 H2 L64 D128 causal")]
    assert "x torch" not in line and "no speedup from 1 sample(s)" in line
    assert "--quick shape of B4 H8 L512 D128 causal" in line
    assert "2 heads and L / 8" in text


def test_backward_speedup_comes_with_the_spread(tmp_path, capsys):
    optional("torch")
    rec, text = _quick_backward(tmp_path, 3, capsys)
    for impl in ("fastattn", "torch"):
        times = rec[f"{impl}_all_ms"]
        q1, q3 = rec[f"{impl}_iqr_ms"]
        assert len(times) == 3 and min(times) <= q1 <= rec[f"{impl}_ms"] <= q3 <= max(times)
        assert rec[f"{impl}_ms"] == pytest.approx(float(np.median(times)))
        assert rec[f"{impl}_calls_per_sample"] >= 1
    assert rec["speedup_vs_torch"] == pytest.approx(rec["torch_ms"] / rec["fastattn_ms"])
    (line,) = [x for x in text.splitlines() if x.startswith("B4 H2 L64 D128 causal")]
    assert f"{rec['speedup_vs_torch']:.2f}x torch" in line and line.count("(IQR ") == 2
