#!/usr/bin/env bash
# Build fastattn with AddressSanitizer + UndefinedBehaviorSanitizer in a
# scratch copy of the tree and run the test suite (or the given pytest
# arguments) against that build.  Any sanitizer report fails the run.
#
#   tools/sanitize.sh                 # whole suite
#   tools/sanitize.sh tests/kernel/test_sdpa.py -k causal
#   FASTATTN_SAN_DIR=/tmp/fa-san tools/sanitize.sh ...   # keep (and reuse) the build there
#
# Every C file (kernels, driver, dispatch and the Cython-generated binding) is
# compiled with -fsanitize=address,undefined: setuptools adds $CFLAGS to every
# compile, and the per-ISA kernel objects are compiled by the same compiler
# object.  The interpreter is not instrumented, so the ASan and UBSan runtimes
# are preloaded (LD_PRELOAD; ASan must come first).  OpenMP worker threads are
# created through the intercepted pthread_create, so they are covered too.
# Subprocesses started by tests (dask workers, `python -c` checks) inherit
# LD_PRELOAD and run sanitized as well.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
t0=$SECONDS
if [ -n "${FASTATTN_SAN_DIR:-}" ]; then
    work=$FASTATTN_SAN_DIR
    mkdir -p "$work"
else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# -DFA_DEBUG_SCRATCH: exactly sized per-thread scratch (no cached, larger block
# to hide an overrun from ASan), a guard zone after it checked after every call,
# and the kernels' internal checks (rows per task <= scratch rows); a failed
# check aborts with a message.
dbg="-DFA_DEBUG_SCRATCH"
# The units of ISAs this CPU lacks are built uninstrumented (setup.py's
# FASTATTN_UNINSTRUMENTED_UNITS): no test can run them here, and each
# instrumented kernel unit costs ~1000 s of compile CPU.
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
skip=""
case "$flags" in *" avx512f "*) ;; *) skip="kernel_f32_avx512 additive_f32_avx512 lsh_f32_avx512" ;; esac
case "$flags" in *" avx512_bf16 "*) ;; *) skip="$skip kernel_bf16_avx512bf16" ;; esac
case "$flags" in *" amx_bf16 "*) ;; *) skip="$skip kernel_bf16_amx kernel_f16_amx" ;; esac
export FASTATTN_UNINSTRUMENTED_UNITS="$skip"
echo "sanitizers: uninstrumented (ISA not on this CPU): ${skip:-none}"
# Reuse a kept build when no C/Cython source is newer than it.
so=$(ls "$work"/src/fastattn/_kernels*.so 2>/dev/null | head -1 || true)
if [ -z "$so" ] || [ -n "$(find "$src/csrc" "$src/fastattn/_kernels.pyx" "$src/setup.py" -newer "$so" -print -quit)" ]; then
    rm -rf "$work/src"
    mkdir -p "$work/src"
    # tar, not rsync: rsync is missing on fresh machines.  No build outputs are copied.
    tar -C "$src" --exclude=./build --exclude="*.so" --exclude=./.git --exclude=./.venv --exclude=./.asv \
        --exclude=__pycache__ -cf - . | tar -C "$work/src" -xf -
    (cd "$work/src" && CFLAGS="$san $dbg -g" LDFLAGS="$san" python setup.py -q build_ext --inplace \
        >"$work/build.log" 2>&1) || { cat "$work/build.log"; exit 1; }
    echo "sanitizers: built in $((SECONDS - t0)) s (log: $work/build.log)"
else
    # Python files may have changed since the build: refresh them (not the built extension).
    tar -C "$src" --exclude=./build --exclude="*.so" --exclude=./.git --exclude=./.venv --exclude=./.asv \
        --exclude=__pycache__ --exclude=./csrc --exclude="./fastattn/_kernels.c" --exclude=./fastattn/_build_config.py \
        -cf - . | tar -C "$work/src" -xf -
    echo "sanitizers: reusing the build in $work/src"
fi
cd "$work/src"
preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
# detect_leaks=0: the interpreter itself is not leak-clean; fastattn's own
# leaks are covered by tests/reliability/test_hardening.py (RSS over 10 000 calls) and by
# tools/valgrind.sh (definite leaks with a fastattn frame).
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# The huge-size tests need ~10 GB without ASan; skip them unless asked for.
export FASTATTN_TEST_HUGE=${FASTATTN_TEST_HUGE:-0}
args=("$@")
# Deselected by default: the dask distributed tests give each worker a 200 MB
# memory limit on purpose, which ASan's shadow memory and quarantine exceed (the
# nanny kills the worker); the nvcc build test builds CUDA code, not ours.
[ ${#args[@]} -gt 0 ] || args=(tests -q -x -p no:cacheprovider
    --deselect tests/api/test_dask.py::test_distributed_matches_in_memory
    --deselect tests/api/test_dask.py::test_distributed_keys_larger_than_worker_memory
    --deselect tests/cuda/test_cuda.py::test_build_extension_with_nvcc)
t1=$SECONDS
LD_PRELOAD="$preload" PYTHONPATH="$work/src" python -m pytest "${args[@]}"
echo "sanitizers: no reports (tests ran in $((SECONDS - t1)) s)"
