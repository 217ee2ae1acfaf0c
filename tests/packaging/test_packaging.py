"""Packaging and typing: the stubs match the implementation, package data
ships them, ``mypy --strict`` accepts a user script (and rejects a wrong one),
``show_config`` reports the build options, and (with ``FASTATTN_TEST_WHEEL=1``,
slow) ``tools/test_wheel.sh`` builds, repairs, installs and tests the wheel."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import tempfile

import pytest
from conftest import optional

import fastattn
from fastattn import _build_config, _config, _kernels, functional, jax_compat, kvcache, merge

PKG = os.path.dirname(os.path.abspath(fastattn.__file__))
ROOT = os.path.dirname(PKG)
SOURCE_TREE = os.path.exists(os.path.join(ROOT, "setup.py"))


def _stub_functions(path):
    """name -> list of ast.FunctionDef (overloads give several) from a .pyi file."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out: dict[str, list] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name != "__getattr__":
            out.setdefault(node.name, []).append(node)
    return out


def _stub_params(fn):
    a = fn.args
    pos = a.posonlyargs + a.args
    pos_defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    params = [(p.arg, "POSITIONAL_OR_KEYWORD", d is not None) for p, d in zip(pos, pos_defaults)]
    params += [(p.arg, "KEYWORD_ONLY", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return params


def _runtime_params(func):
    return [
        (p.name, p.kind.name, p.default is not inspect.Parameter.empty)
        for p in inspect.signature(func).parameters.values()
    ]


def _check_stub(module, stub_name):
    path = os.path.join(PKG, stub_name)
    assert os.path.exists(path), f"missing {stub_name}"
    stubs = _stub_functions(path)
    assert stubs, stub_name
    for name, overloads in stubs.items():
        runtime = getattr(module, name)
        want = _runtime_params(runtime)
        for fn in overloads:
            got = _stub_params(fn)
            assert [g[:2] for g in got] == [w[:2] for w in want], f"{stub_name}: {name} parameters differ"
            # A parameter without a default in the stub must have none at runtime,
            # except in a Literal overload that pins it (return_lse: Literal[True]).
            for g, w in zip(got, want):
                if g[2] and not w[2]:
                    raise AssertionError(f"{stub_name}: {name}({g[0]}) has a default only in the stub")
    return stubs


# (the Python modules carry inline annotations; only the compiled extensions have stubs)
@pytest.mark.parametrize("module", [functional, kvcache, merge])
def test_annotated_modules_have_no_stub_and_full_annotations(module):
    # These modules carry their types inline (checked by mypy --strict): a stub
    # next to them would hide the code from type checkers.
    path = module.__file__
    assert not os.path.exists(path[:-3] + ".pyi"), f"{path}: a stale stub"
    funcs = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            funcs += [f for n, f in vars(obj).items() if inspect.isfunction(f) and not n.startswith("_")]
            funcs.append(obj.__init__)
        else:
            funcs.append(obj)
    assert funcs
    for f in funcs:
        sig = inspect.signature(f)
        missing = [
            p
            for p in sig.parameters
            if p != "self" and sig.parameters[p].annotation is inspect.Parameter.empty
        ]
        assert not missing, f"{f.__qualname__}: parameters without annotations {missing}"
        assert sig.return_annotation is not inspect.Signature.empty, f"{f.__qualname__}: no return annotation"


def test_compiled_module_stub_matches():
    stubs = _check_stub(_kernels, "_kernels.pyi")
    public = {
        n
        for n in dir(_kernels)
        if not n.startswith("_")
        and callable(getattr(_kernels, n))
        and type(getattr(_kernels, n)).__name__ in ("cython_function_or_method", "builtin_function_or_method")
    }
    assert public <= set(stubs), f"_kernels.pyi lacks {sorted(public - set(stubs))}"
    with open(os.path.join(PKG, "_kernels.pyi")) as f:
        text = f.read()
    for const in ("ISA_NAMES", "DTYPE_CODES", "MASK_NONE", "MASK_BOOL", "MASK_F32", "MASK_F64"):
        assert hasattr(_kernels, const) and f"{const}:" in text
    # The enums of csrc/fastattn.h: the stub's classes name the extension's members and values,
    # and each member is also a plain module-level int of that value.
    tree = ast.parse(text)
    enums = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    assert set(enums) == {"fa_dtype", "fa_mask_kind", "fa_isa", "fa_precision", "fa_status"}
    for name, node in enums.items():
        stub = {t.targets[0].id: t.value.value for t in node.body if isinstance(t, ast.Assign)}
        runtime = getattr(_kernels, name)
        assert stub == {m.name: int(m) for m in runtime}, name
        for member, value in stub.items():
            assert type(getattr(_kernels, member)) is int and getattr(_kernels, member) == value
            assert f"{member}: int" in text


def test_typing_files_are_package_data():
    assert os.path.exists(os.path.join(PKG, "py.typed"))
    if not SOURCE_TREE:
        pytest.skip("installed copy: the files above are what was installed")
    tomllib = optional("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["fastattn"]
    for pattern in ("*.pyi", "py.typed"):
        assert pattern in data
    with open(os.path.join(ROOT, "MANIFEST.in")) as f:
        manifest = f.read()
    assert "recursive-include csrc" in manifest and "*.pyx" in manifest


def test_public_functions_have_docstrings():
    missing = []
    for name in fastattn.__all__:
        obj = getattr(fastattn, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            if len(inspect.getdoc(obj) or "") < 40:
                missing.append(name)
    assert not missing, f"public names without a real docstring: {missing}"
    doc = inspect.getdoc(jax_compat.dot_product_attention)
    for words in ("(B, T, N, H)", "True", "TOP LEFT", "(B,)"):
        assert words in doc


def test_show_config_reports_the_build_options(capsys):
    cfg = _config.config()
    assert cfg["native_build (FASTATTN_NATIVE)"] == _build_config.NATIVE
    assert cfg["cuda_requested (FASTATTN_CUDA)"] == _build_config.CUDA_REQUESTED
    assert cfg["openmp"] == _kernels.openmp_enabled()
    assert cfg["compiler"] == _build_config.COMPILER and cfg["cflags"] == _build_config.CFLAGS
    assert ("-march=native" in cfg["cflags"]) == bool(_build_config.NATIVE)
    assert cfg["isa"] in _kernels.ISA_NAMES and cfg["isa_best"] in _kernels.ISA_NAMES
    fastattn.show_config()
    printed = capsys.readouterr().out
    for key in cfg:
        assert key in printed


def test_show_config_reports_the_cuda_launch_knobs(monkeypatch):
    monkeypatch.setenv("FASTATTN_CUDA_MMA", "0")
    monkeypatch.delenv("FASTATTN_CUDA_SPLITS", raising=False)
    cfg = _config.config()
    assert cfg["FASTATTN_CUDA_MMA"] == "0" and cfg["FASTATTN_CUDA_SPLITS"] is None
    assert "FASTATTN_CUDA_DECODE" in cfg


# A cache kept between runs: a cold mypy run reads all of numpy's stubs
# (~30-60 s on 2 busy cores); a warm one takes a few seconds.
MYPY_CACHE = os.path.join(tempfile.gettempdir(), "fastattn-mypy-cache")

MYPY_BAD = """
import numpy as np
import fastattn
q = np.zeros((2, 4, 8), dtype=np.float32)
lse: int = fastattn.scaled_dot_product_attention(q, q, q, return_lse=True)[1]
fastattn.set_num_threads("2")
x: int = fastattn.get_isa()
"""


def test_mypy_strict_accepts_user_code_and_rejects_wrong_code(tmp_path):
    if not _has_module("mypy"):
        pytest.skip("mypy is not installed")
    good = os.path.join(os.path.dirname(os.path.abspath(__file__)), "typing_check.py")
    bad = tmp_path / "typing_bad.py"
    bad.write_text(MYPY_BAD)
    # follow-imports=silent: fastattn's own modules are not the subject here
    # (as for an installed package), only what a user script sees of them.
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--follow-imports=silent",
        "--no-error-summary",
        "--cache-dir",
        MYPY_CACHE,
        good,
        str(bad),
    ]
    env = dict(os.environ)
    if SOURCE_TREE:  # an installed copy is found in site-packages
        env["MYPYPATH"] = ROOT
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ": error:" in ln]
    assert not [ln for ln in lines if "typing_check.py" in ln], r.stdout
    bad_lines = {int(ln.split(":")[1]) for ln in lines if "typing_bad.py" in ln}
    assert bad_lines == {5, 6, 7}, r.stdout + r.stderr


def _has_module(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.skipif(os.environ.get("FASTATTN_TEST_WHEEL") != "1", reason="slow: set FASTATTN_TEST_WHEEL=1")
def test_wheel_builds_repairs_installs_and_passes():
    script = os.path.join(ROOT, "tools", "test_wheel.sh")
    if not os.path.exists(script):
        pytest.skip("not a source tree")
    r = subprocess.run(["bash", script, "-x", "-q"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "manylinux" in r.stdout and "passed" in r.stdout


@pytest.mark.skipif(not SOURCE_TREE, reason="reads pyproject.toml of the source tree")
def test_every_subpackage_is_listed_in_pyproject():
    # setuptools takes the packages one by one from pyproject.toml: a subpackage
    # missing there would be left out of the wheel (its modules would not import).
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {"fastattn"} | {
        f"fastattn.{d}" for d in os.listdir(PKG) if os.path.isfile(os.path.join(PKG, d, "__init__.py"))
    }
    assert {"fastattn.bench", "fastattn.dask"} <= found
    assert listed == found
