"""setup.py's OpenMP flags: ``-fopenmp`` where the compiler has it (GCC, LLVM clang), Apple
clang's ``-Xpreprocessor -fopenmp`` with LLVM's libomp where it has not, else none (a
one-thread build).

Apple clang is stood in for by LLVM clang behind a wrapper that rejects a bare ``-fopenmp``
as Apple's driver does; those cases skip where clang or libomp is not installed (.ci/run
installs both where it may).  The helpers are run from setup.py's text: importing setup.py
would build the package."""

from __future__ import annotations

import ast
import glob
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

SETUP = Path(__file__).resolve().parents[2] / "setup.py"
pytestmark = pytest.mark.skipif(not SETUP.exists(), reason="needs the source tree's setup.py")

PROGRAM = r"""
#include <omp.h>
#include <stdio.h>
int main(void)
{
    int n = 0;
#pragma omp parallel
    {
#pragma omp atomic
        n++;
    }
    printf("%d\n", n);
    return 0;
}
"""


def helpers() -> dict[str, Any]:
    """setup.py's _compiler_accepts, _libomp_prefix and _openmp_flags."""
    names = {"_compiler_accepts", "_libomp_prefix", "_openmp_flags"}
    body: list[ast.stmt] = [
        n for n in ast.parse(SETUP.read_text()).body if isinstance(n, ast.FunctionDef) and n.name in names
    ]
    assert {n.name for n in body if isinstance(n, ast.FunctionDef)} == names
    ns: dict[str, Any] = {"os": os, "platform": platform, "subprocess": subprocess, "tempfile": tempfile}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(SETUP), "exec"), ns)
    return ns


def threads_of(cc: str, cflags: list[str], ldflags: list[str], tmp: Path, n: int) -> int:
    """The thread count of an OpenMP parallel region built with these flags, OMP_NUM_THREADS=n."""
    src, exe = tmp / "t.c", tmp / "t"
    src.write_text(PROGRAM)
    subprocess.run([cc, *cflags, str(src), "-o", str(exe), *ldflags], check=True, capture_output=True)
    out = subprocess.run(
        [str(exe)], check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(n)}
    )
    return int(out.stdout)


def llvm_libomp() -> str | None:
    """An LLVM prefix holding lib/libomp.so (Debian's libomp-dev), or None."""
    hits = sorted(glob.glob("/usr/lib/llvm-*/lib/libomp.so"))
    return os.path.dirname(os.path.dirname(hits[-1])) if hits else None


@pytest.fixture
def apple_clang(tmp_path: Path) -> str:
    """A C compiler that behaves as Apple clang towards OpenMP: no -fopenmp driver flag."""
    if shutil.which("clang") is None or llvm_libomp() is None:
        pytest.skip("needs LLVM clang and libomp (apt-get install clang libomp-dev)")
    cc = tmp_path / "apple-clang"
    cc.write_text(
        "#!/bin/sh\n"
        'prev=""\n'
        'for a in "$@"; do\n'
        '  if [ "$a" = -fopenmp ] && [ "$prev" != -Xpreprocessor ]; then\n'
        "    echo \"clang: error: unsupported option '-fopenmp'\" >&2; exit 1\n"
        "  fi\n"
        '  prev="$a"\n'
        "done\n"
        'exec clang "$@"\n'
    )
    cc.chmod(0o755)
    return str(cc)


def test_apple_clang_builds_with_libomp(
    apple_clang: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = llvm_libomp()
    monkeypatch.setenv("CC", apple_clang)
    monkeypatch.setenv("FASTATTN_LIBOMP_PREFIX", str(prefix))
    monkeypatch.delenv("FASTATTN_OPENMP", raising=False)
    h = helpers()
    assert not h["_compiler_accepts"](["-fopenmp"])  # the stand-in rejects it, as Apple clang does
    cflags, ldflags = h["_openmp_flags"]()
    assert cflags == ["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"]
    assert ldflags == [f"-L{prefix}/lib", f"-Wl,-rpath,{prefix}/lib", "-lomp"]
    assert threads_of(apple_clang, cflags, ldflags, tmp_path, 3) == 3  # the flags make real threads


def test_apple_clang_without_libomp_builds_one_thread(
    apple_clang: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if platform.system() == "Darwin":
        pytest.skip("on macOS _libomp_prefix also looks for Homebrew's libomp")
    monkeypatch.setenv("CC", apple_clang)
    monkeypatch.delenv("FASTATTN_LIBOMP_PREFIX", raising=False)
    monkeypatch.delenv("FASTATTN_OPENMP", raising=False)
    assert helpers()["_openmp_flags"]() == ([], [])
    # A prefix without libomp is no better: the flags are probed, not assumed.
    monkeypatch.setenv("FASTATTN_LIBOMP_PREFIX", str(tmp_path))
    assert helpers()["_openmp_flags"]() == ([], [])


def test_gcc_takes_fopenmp_and_the_switch_turns_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc")
    monkeypatch.setenv("CC", gcc)
    monkeypatch.delenv("FASTATTN_LIBOMP_PREFIX", raising=False)
    monkeypatch.delenv("FASTATTN_OPENMP", raising=False)
    h = helpers()
    if not h["_compiler_accepts"](["-fopenmp"]):
        pytest.skip("this gcc has no libgomp")
    assert h["_openmp_flags"]() == (["-fopenmp"], ["-fopenmp"])
    assert threads_of(gcc, ["-fopenmp"], ["-fopenmp"], tmp_path, 2) == 2
    monkeypatch.setenv("FASTATTN_OPENMP", "0")
    assert h["_openmp_flags"]() == ([], [])
