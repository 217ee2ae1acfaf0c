#!/usr/bin/env bash
# Test the AVX512-BF16 (VDPBF16PS) bfloat16 kernel on a CPU without AVX512-BF16:
# build a scratch copy with FASTATTN_EMULATE_AVX512BF16=1 (VDPBF16PS in C with
# the instruction's rounding, csrc/vdpbf16.h; the kernel's AVX-512 part on AVX2
# register pairs, csrc/avx512_emu.h) and run the tests with
# FASTATTN_ISA=avx512bf16, so the same source paths (the AMX kernel's packing,
# tile edges, row groups, masks, on vector products) run everywhere.  Needs AVX2.
#
#   tools/emulate_avx512bf16.sh               # the tile-kernel and 16-bit test files
#   tools/emulate_avx512bf16.sh tests -q -x   # other pytest arguments
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
tar -C "$src" --exclude=./build --exclude="*.so" --exclude=./.git --exclude=./.venv --exclude=./.asv -cf - . \
    | tar -C "$work/src" -xf -
cd "$work/src"
FASTATTN_EMULATE_AVX512BF16=1 python setup.py -q build_ext --inplace >build.log 2>&1 || { cat build.log; exit 1; }
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/kernel/test_amx.py tests/kernel/test_precision.py tests/kernel/test_dtypes.py tests/kernel/test_masks.py tests/kernel/test_kv8.py tests/api/test_paged.py -q -x -p no:cacheprovider)
FASTATTN_ISA=avx512bf16 PYTHONPATH="$work/src" python -c \
    "import fastattn, sys; c = fastattn._config.config(); sys.exit(0 if fastattn.get_isa() == 'avx512bf16' and c['avx512bf16_emulated (FASTATTN_EMULATE_AVX512BF16, tests only)'] else 1)"
FASTATTN_ISA=avx512bf16 PYTHONPATH="$work/src" python -m pytest "${args[@]}"
echo "emulated AVX512-BF16 path: tests passed"
