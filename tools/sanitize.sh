#!/usr/bin/env bash
# Build fastattn with AddressSanitizer + UndefinedBehaviorSanitizer in a
# scratch copy of the tree and run the test suite (or the given pytest
# arguments) against that build.  Any sanitizer report fails the run.
#
#   tools/sanitize.sh                 # whole suite
#   tools/sanitize.sh tests/test_sdpa.py -k causal
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
tar -C "$src" --exclude=./build --exclude="*.so" --exclude=./.git --exclude=./.venv --exclude=./.asv -cf - . | tar -C "$work/src" -xf -
cd "$work/src"
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CFLAGS="$san -g" LDFLAGS="$san" python setup.py -q build_ext --inplace >build.log 2>&1 || { cat build.log; exit 1; }
preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
# detect_leaks=0: the interpreter itself is not leak-clean; fastattn's own
# leaks are covered by tests/test_hardening.py (RSS over 10 000 calls).
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests -q -x -p no:cacheprovider)
LD_PRELOAD="$preload" PYTHONPATH="$work/src" python -m pytest "${args[@]}"
echo "sanitizers: no reports"
