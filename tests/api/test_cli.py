"""The command line (one argparse parser behind ``fastattn``, ``python -m fastattn`` and
``python -m fastattn.bench``), ``import fastattn`` from an unbuilt source tree (it hands
over to the installed copy, or says how to fix it), and what ``import fastattn`` imports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import optional

import fastattn
from fastattn import cli

PKG = os.path.dirname(os.path.abspath(fastattn.__file__))
INSTALLED = "site-packages" in PKG or "dist-packages" in PKG


def run(args, cwd, **kw):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120, env=env, **kw)


@pytest.fixture
def unbuilt_tree(tmp_path):
    """A copy of the package's Python files without the compiled extension: what a fresh
    clone's root holds."""
    for sub in ("", "bench"):  # the package and its subpackage fastattn.bench
        src = tmp_path / "fastattn" / sub
        src.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(os.path.join(PKG, sub)):
            if name.endswith(".py") and name != "_build_config.py":
                shutil.copy(os.path.join(PKG, sub, name), src / name)
    return tmp_path


def test_import_fastattn_imports_no_optional_heavy_module(tmp_path):
    code = (
        "import sys, fastattn\n"
        "print(sorted(m for m in ('ml_dtypes', 'dask', 'jax', 'torch', 'transformers', 'onnxruntime') "
        "if m in sys.modules))"
    )
    r = run([sys.executable, "-c", code], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_bfloat16_still_works_after_the_lazy_import():
    ml_dtypes = optional("ml_dtypes")
    import numpy as np

    q = np.ones((1, 2, 3, 8), np.float32)
    k = np.ones((1, 2, 5, 8), ml_dtypes.bfloat16)
    out = fastattn.scaled_dot_product_attention(q, k, k)
    np.testing.assert_array_equal(out, 1.0)
    assert fastattn.KVCache(1, 1, 4, 8, dtype="bfloat16").dtype == np.dtype(ml_dtypes.bfloat16)


def test_version_everywhere(tmp_path):
    want = f"fastattn {fastattn.__version__}"
    for args in (
        ["-m", "fastattn", "--version"],
        ["-m", "fastattn.bench", "--version"],
        ["-m", "fastattn", "check", "--version"],
    ):
        r = run([sys.executable, *args], cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.strip() == want, (args, r.stdout, r.stderr)
    exe = shutil.which("fastattn")
    if exe is None or not INSTALLED:
        pytest.skip("the fastattn console script is not on PATH")
    r = run([exe, "--version"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == want


def test_help_only_prints_help(capsys):
    for argv in (["--help"], ["check", "--help"], ["info", "-h"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: fastattn"), out
        assert "max error" not in out and "checking against" not in out  # nothing ran
    with pytest.raises(SystemExit) as e:
        cli.main(["nonsense"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--threads", "0"])
    assert e.value.code == 2 and "--threads must be >= 1" in capsys.readouterr().err


def test_one_parser_for_fastattn_bench():
    from fastattn import bench

    args = bench.parse_args(["--quick", "--cases", "decode", "--threads", "2"])
    assert args.command == "bench" and args.quick and args.cases == ["decode"] and args.threads == 2
    assert args.repeat == 2  # filled in by finish_args
    sub = cli.build_parser()._subparsers._group_actions[0].choices
    assert set(sub) == {"check", "info", "bench"}


def test_check_command(capsys):
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 5 and "FAIL" not in out


def test_timing_table_uses_the_bench_cases(monkeypatch, capsys):
    """python -m fastattn's table: the case table, baseline and FLOP count of fastattn.bench."""
    from fastattn.bench import cases

    small = [cases._table_case(1, 2, 256, 256, 32, causal=True), cases._table_case(1, 2, 1, 4096, 32)]
    monkeypatch.setattr(cases, "TABLE_CASES", small)
    cli.benchmark(budget_s=0.0)
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("B1 H2 "):
            label, numbers = line[:30].strip(), line[30:].split()
            rows[label] = [float(x.rstrip("x")) for x in numbers]
    assert list(rows) == ["B1 H2 L256 S256 D32 causal", "B1 H2 L1 S4096 D32"]
    for c in small:  # GFLOP/s = the bench's FLOP count / the time shown, for both columns
        fa_ms, fa_rate, np_ms, np_rate, speedup = rows[c.name]
        assert fa_rate == pytest.approx(cases.case_flops(c) / fa_ms / 1e6, rel=0.02, abs=0.1)
        assert np_rate == pytest.approx(cases.case_flops(c) / np_ms / 1e6, rel=0.02, abs=0.1)
        assert speedup == pytest.approx(np_ms / fa_ms, rel=0.02, abs=0.01)


@pytest.mark.skipif(not INSTALLED, reason="needs an installed copy to hand over to")
def test_unbuilt_source_tree_hands_over_to_the_installed_copy(unbuilt_tree):
    """`python -m fastattn` in a fresh clone's root: the source tree is first on sys.path."""
    code = (
        "import fastattn, fastattn.cli, fastattn._kernels as k; print(fastattn.__file__); print(k.__file__)"
    )
    r = run([sys.executable, "-c", code], cwd=unbuilt_tree)
    assert r.returncode == 0, r.stderr
    for line in r.stdout.split():
        assert os.path.dirname(os.path.realpath(line)) == os.path.realpath(PKG)
    r = run([sys.executable, "-m", "fastattn", "check"], cwd=unbuilt_tree)
    assert r.returncode == 0 and r.stdout.count("PASS") == 5, r.stdout + r.stderr
    r = run([sys.executable, "-m", "fastattn.bench", "--help"], cwd=unbuilt_tree)
    assert r.returncode == 0 and r.stdout.startswith("usage: fastattn bench"), r.stderr


def test_unbuilt_source_tree_without_an_installed_copy_says_how_to_fix_it(unbuilt_tree):
    # -S: no site-packages, so no installed copy to hand over to
    r = run([sys.executable, "-S", "-c", "import fastattn"], cwd=unbuilt_tree)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "source tree" in r.stderr and "pip install ." in r.stderr, r.stderr


def test_packaging_metadata():
    """LICENSE (MIT, PEP 639) in the metadata, the version written once, the console script."""
    from importlib import metadata

    try:
        md = metadata.metadata("fastattn")
        dist = metadata.distribution("fastattn")
    except metadata.PackageNotFoundError:
        pytest.skip("fastattn is not installed (an in-place build has no metadata)")
    assert md["Version"] == fastattn.__version__
    assert md["License-Expression"] == "MIT"
    assert any(str(f).endswith("LICENSE") for f in dist.files or ())
    assert any(ep.name == "fastattn" and ep.value == "fastattn.cli:main" for ep in dist.entry_points)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tomllib = optional("tomllib")
    if not os.path.exists(os.path.join(root, "pyproject.toml")):
        # tools/test_wheel.sh and cibuildwheel run a copy of tests/ outside the checkout:
        # the installed metadata above is what they can check.
        return
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    p = project["project"]
    assert p["license"] == "MIT" and p["license-files"] == ["LICENSE"] and "version" not in p
    assert p["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fastattn.__version__"}
    assert os.path.exists(os.path.join(root, "LICENSE"))
    build = project["tool"]["cibuildwheel"]["build"].split()
    assert {"cp310-*", "cp311-*", "cp312-*", "cp313-*", "cp314-*", "cp314t-*"} <= set(build)
