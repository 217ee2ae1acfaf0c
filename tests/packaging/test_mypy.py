"""``mypy --strict -p fastattn``: the package's own code type-checks (inline
annotations; stubs only for the compiled extensions and the modules that still
carry one).  Runs when mypy is installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest

import fastattn

PKG = os.path.dirname(os.path.abspath(fastattn.__file__))
ROOT = os.path.dirname(PKG)
SOURCE_TREE = os.path.exists(os.path.join(ROOT, "setup.py"))
# Shared with test_packaging's mypy run: a cold run reads all of numpy's (and
# torch's, dask's) stubs, ~1 minute on 2 busy cores; a warm one a few seconds.
MYPY_CACHE = os.path.join(tempfile.gettempdir(), "fastattn-mypy-cache")


def test_mypy_strict_package():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed")
    # fastattn.torch_compat and fastattn.dask import these at the top (the other optional
    # dependencies are imported inside functions and typed as Any where used).
    for dep in ("torch", "dask"):
        if importlib.util.find_spec(dep) is None:
            pytest.skip(f"{dep} is not installed (mypy needs its types for fastattn's {dep} module)")
    cmd = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", MYPY_CACHE, "-p", "fastattn"]
    env = dict(os.environ)
    if SOURCE_TREE:  # this checkout's fastattn, not an installed copy
        env["MYPYPATH"] = ROOT
    cwd = ROOT if SOURCE_TREE else tempfile.gettempdir()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    errors = [ln for ln in r.stdout.splitlines() if ": error:" in ln]
    assert r.returncode == 0 and not errors, r.stdout[-20000:] + r.stderr[-5000:]
