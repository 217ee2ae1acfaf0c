#!/usr/bin/env bash
# valgrind memcheck over a representative subset of the tests, with
# PYTHONMALLOC=malloc so that Python's allocator does not hide errors.
# Fails when an error report has a fastattn frame (kernel, driver, binding).
#
#   tools/valgrind.sh                     # default subset
#   tools/valgrind.sh tests/test_sdpa.py  # other pytest arguments
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
log=$(mktemp)
args=("$@")
[ ${#args[@]} -gt 0 ] || args=("$src/tests/test_hardening.py" -q -p no:cacheprovider -k "valgrind_subset")
PYTHONMALLOC=malloc OMP_NUM_THREADS=2 valgrind --tool=memcheck --error-limit=no --num-callers=30 \
    --log-file="$log" python -m pytest "${args[@]}" || { echo "pytest failed under valgrind"; exit 1; }
python - "$log" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
blocks = re.split(r"\n==\d+== \n", text)
ours = [b for b in blocks if re.search(r"(Invalid|uninitialised|Conditional jump|Mismatched|overlap)", b)
        and re.search(r"(fa_|_kernels|kernel_|attention\.c|dispatch\.c)", b)]
total = re.search(r"ERROR SUMMARY: (\d+) errors", text)
print(f"valgrind: {total.group(1) if total else '?'} errors in total, {len(ours)} with a fastattn frame")
for b in ours[:5]:
    print(b)
sys.exit(1 if ours else 0)
PY
