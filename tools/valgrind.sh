#!/usr/bin/env bash
# valgrind memcheck over a representative subset of the tests, with
# PYTHONMALLOC=malloc so that Python's allocator does not hide errors.
# Fails when an error report (invalid read/write/free, uninitialised value,
# overlap, fishy argument, definite leak, ...) has a fastattn frame in its
# stack: a frame in the fastattn extension (fastattn/_kernels*.so), a
# function named fa_*, or a source file under csrc/ or fastattn/_kernels.c.
# CPython, NumPy and OpenBLAS report errors of their own under memcheck
# (tens to a couple of hundred contexts); those are counted but do not fail the run.
#
#   tools/valgrind.sh                     # default subset (test_valgrind_subset)
#   tools/valgrind.sh tests/kernel/test_sdpa.py -k causal   # other pytest arguments
#   tools/valgrind.sh --self-test         # check that the filter catches an injected error
#
# valgrind runs on the real interpreter (sys.executable), not a launcher
# script such as a pyenv shim (memcheck would otherwise check only bash).
# The XML log is parsed (not the text log); it is kept when the run fails.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
command -v valgrind >/dev/null || { echo "valgrind is not installed"; exit 2; }
py=$(python -c 'import sys; print(sys.executable)')
work=$(mktemp -d)
keep=0
trap '[ $keep = 1 ] || rm -rf "$work"' EXIT
vg=(valgrind --tool=memcheck --error-limit=no --num-callers=40 --leak-check=full
    --show-leak-kinds=definite --errors-for-leak-kinds=definite --track-origins=no
    --xml=yes --xml-file="$work/vg.%p.xml")

if [ "${1:-}" = "--self-test" ]; then
    # A probe library with one out-of-bounds read and one uninitialised branch in
    # functions named fa_*: the filter below must flag both ...
    cat >"$work/probe.c" <<'C'
#include <stdlib.h>
float fa_probe_oob(int n) { float *p = malloc(n * sizeof(float)); for (int i = 0; i < n; i++) p[i] = i;
                            float s = p[n]; free(p); return s; }
int fa_probe_uninit(void) { int *p = malloc(8 * sizeof(int)); int r = p[3] > 0 ? 1 : 2; free(p); return r; }
C
    gcc -g -O0 -shared -fPIC "$work/probe.c" -o "$work/libfaprobe.so"
    # ... and a strided view that claims more keys than its buffer holds, so that the
    # kernel itself reads past a heap block: that report must be flagged too.
    cd "$src"
    PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" PYTHONMALLOC=malloc "${vg[@]}" "$py" -c "
import ctypes; lib = ctypes.CDLL('$work/libfaprobe.so'); lib.fa_probe_oob.restype = ctypes.c_float
lib.fa_probe_oob(5); lib.fa_probe_uninit()
import numpy as np, fastattn
buf = np.ones(8 * 16, np.float32)
k = np.lib.stride_tricks.as_strided(buf, shape=(1, 1, 12, 16), strides=(3072, 3072, 64, 4))
fastattn.scaled_dot_product_attention(np.ones((1, 1, 4, 16), np.float32), k, k, num_threads=1)" >/dev/null
    expect=-1
else
    args=("$@")
    [ ${#args[@]} -gt 0 ] || args=("$src/tests/reliability/test_hardening.py" -q -p no:cacheprovider -k "valgrind_subset")
    if ls "$src"/fastattn/_kernels*.so >/dev/null 2>&1; then
        # an in-place build: test it
        cd "$src"
        export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
    else
        # no in-place build (e.g. CI): test the installed package, away from the source tree
        cd "$work"
    fi
    PYTHONMALLOC=malloc OMP_NUM_THREADS=2 "${vg[@]}" "$py" -m pytest "${args[@]}" \
        || { keep=1; echo "pytest failed under valgrind (logs: $work/vg.*.xml)"; exit 1; }
    expect=0
fi

rc=0
python - "$work" "$expect" <<'PY' || rc=$?
import re
import sys
import xml.etree.ElementTree as ET

import glob

path, expect = sys.argv[1], int(sys.argv[2])


def load(name):
    """Parse one XML log; a forked child that exec'd (subprocess) leaves an unterminated one."""
    text = open(name, errors="replace").read()
    try:
        return ET.fromstring(text).findall("error")
    except ET.ParseError:
        cut = text.rfind("</error>")
        head = text[: cut + len("</error>")] if cut >= 0 else text.split("<error>")[0]
        try:
            return ET.fromstring(head + "\n</valgrindoutput>\n").findall("error")
        except ET.ParseError:
            sys.exit(f"cannot parse {name}")


files = sorted(glob.glob(f"{path}/vg.*.xml"))
OURS = re.compile(r"(^|/)(fastattn/_kernels[^/]*\.so|_kernels\.c|csrc/[^/]+\.[ch])$")


def ours(frame):
    fn = frame.findtext("fn") or ""
    obj = frame.findtext("obj") or ""
    f = "/".join(x for x in (frame.findtext("dir"), frame.findtext("file")) if x)
    return fn.startswith("fa_") or bool(OURS.search(obj)) or bool(OURS.search(f))


def describe(err):
    what = err.findtext("what") or err.findtext("xwhat/text") or ""
    lines = [f"{err.findtext('kind')}: {what}"]
    for stack in err.findall("stack"):
        for fr in stack.findall("frame")[:14]:
            where = f"{fr.findtext('file')}:{fr.findtext('line')}" if fr.findtext("file") else fr.findtext("obj")
            lines.append(f"    {fr.findtext('fn') or '???'}  ({where})")
        lines.append("  --")
    aux = err.findtext("auxwhat")
    if aux:
        lines.insert(1, f"  {aux}")
    return "\n".join(lines)


errors = [e for name in files for e in load(name)]
flagged = [e for e in errors if any(ours(fr) for st in e.findall("stack") for fr in st.findall("frame"))]
print(f"valgrind: {len(files)} process log(s), {len(errors)} error contexts in total, {len(flagged)} with a fastattn frame")
for e in flagged[: 3 if expect < 0 else 10]:
    print(describe(e))
if expect < 0:  # self-test: both probe errors and a kernel overrun (a frame in the extension) flagged
    kinds = {e.findtext("kind") for e in flagged}
    in_ext = [e for e in flagged if any(OURS.search(fr.findtext("obj") or "") for fr in e.iter("frame"))]
    if not ({"InvalidRead", "UninitCondition"} <= kinds and in_ext):
        print(f"self-test FAILED: flagged kinds {kinds}, {len(in_ext)} in the extension; logs kept in {path}")
        sys.exit(1)
elif len(flagged) != expect:
    print(f"expected {expect}; logs kept in {path}")
    sys.exit(1)
print("valgrind: self-test passed (the filter catches injected errors)" if expect else "valgrind: clean")
PY
[ $rc = 0 ] || keep=1
exit $rc
