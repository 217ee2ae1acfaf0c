#!/usr/bin/env bash
# Test the AVX-512, AMX and AVX512-BF16 kernels on a CPU with AVX2 only, from
# ONE scratch build that emulates all three (FASTATTN_EMULATE_AMX=1 and
# FASTATTN_EMULATE_AVX512BF16=1, each implying FASTATTN_EMULATE_AVX512):
#   avx512      the width-16 instantiation of kernel_impl.h on AVX2 register
#               pairs (csrc/avx512_emu.h);
#   amx         the tile instructions (ldtilecfg, tileloadd, tilestored,
#               tilezero, tdpbf16ps, tdpfp16ps) in C (csrc/amx_emu.h), the
#               kernel's AVX-512 part on AVX2 pairs;
#   avx512bf16  VDPBF16PS in C with the instruction's rounding (csrc/vdpbf16.h),
#               the AMX kernel's source on vector products.
# Each path then runs its own test files with FASTATTN_ISA set to it.  One build
# serves all three because the ISA a call runs on picks exactly one kernel set
# (csrc/dispatch.c, fa_select_kernel): the other emulated units are present but
# never reached, as on a real Sapphire Rapids, which has all three.  (Three
# builds cost CI about 8 minutes more on a 2-core Zen 3.)
#
#   tools/emulate_x86.sh                          # every path, its default test files
#   tools/emulate_x86.sh amx                      # one path (or several: "avx512 amx")
#   tools/emulate_x86.sh avx512 tests -q -x       # one path, other pytest arguments
# tools/emulate_avx512.sh, emulate_amx.sh and emulate_avx512bf16.sh are this
# script for one path.  Needs AVX2.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
paths=()
while [ $# -gt 0 ]; do
    case "$1" in avx512 | amx | avx512bf16) paths+=("$1"); shift ;; *) break ;; esac
done
[ ${#paths[@]} -gt 0 ] || paths=(avx512 amx avx512bf16)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
tar -C "$src" --exclude=./build --exclude="*.so" --exclude=./.git --exclude=./.venv --exclude=./.asv -cf - . \
    | tar -C "$work/src" -xf -
cd "$work/src"
t0=$SECONDS
FASTATTN_EMULATE_AMX=1 FASTATTN_EMULATE_AVX512BF16=1 python setup.py -q build_ext --inplace >build.log 2>&1 \
    || { cat build.log; exit 1; }
echo "emulated x86 build (avx512, amx, avx512bf16) in $((SECONDS - t0)) s"

# The default test files of each path: the ISA-sensitive ones.
default_files() {
    case "$1" in
    avx512) echo tests/kernel/test_sdpa.py tests/kernel/test_isa.py tests/kernel/test_variants.py tests/kernel/test_dtypes.py \
                 tests/api/test_kvcache.py tests/kernel/test_threads.py tests/kernel/test_backward.py tests/kernel/test_family.py \
                 tests/kernel/test_register_blocks.py tests/kernel/test_fused_softmax.py tests/kernel/test_masks.py \
                 tests/kernel/test_kv8.py tests/api/test_paged.py tests/kernel/test_dropout.py ;;
    amx) echo tests/kernel/test_amx.py tests/kernel/test_amx_fp16.py tests/kernel/test_precision.py tests/kernel/test_dtypes.py \
              tests/kernel/test_masks.py tests/kernel/test_kv8.py tests/api/test_paged.py tests/kernel/test_dropout.py ;;
    avx512bf16) echo tests/kernel/test_amx.py tests/kernel/test_precision.py tests/kernel/test_dtypes.py tests/kernel/test_masks.py \
                     tests/kernel/test_kv8.py tests/api/test_paged.py ;;
    esac
}

for isa in "${paths[@]}"; do
    t1=$SECONDS
    echo "== emulated $isa"
    # the path is really taken, and (amx, avx512bf16) really emulated
    FASTATTN_ISA=$isa PYTHONPATH="$work/src" python - "$isa" <<'PY'
import sys
import fastattn
isa = sys.argv[1]
c = fastattn._config.config()
assert fastattn.get_isa() == isa, (fastattn.get_isa(), isa)
flag = {"amx": "amx_emulated (FASTATTN_EMULATE_AMX, tests only)",
        "avx512bf16": "avx512bf16_emulated (FASTATTN_EMULATE_AVX512BF16, tests only)"}.get(isa)
assert flag is None or c[flag], (flag, c)
PY
    if [ $# -gt 0 ]; then
        args=("$@")
    else
        # shellcheck disable=SC2207
        args=($(default_files "$isa") -q -x -p no:cacheprovider)
    fi
    FASTATTN_ISA=$isa PYTHONPATH="$work/src" python -m pytest "${args[@]}"
    echo "emulated $isa path: tests passed in $((SECONDS - t1)) s"
done
