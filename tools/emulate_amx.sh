#!/usr/bin/env bash
# Test the AMX bfloat16 kernel on a CPU without AMX: build a scratch copy with
# FASTATTN_EMULATE_AMX=1 (the tile instructions ldtilecfg, tileloadd,
# tilestored, tilezero, tdpbf16ps and tdpfp16ps in C, csrc/amx_emu.h; the kernel's AVX-512
# part on AVX2 register pairs, csrc/avx512_emu.h) and run the tests with
# FASTATTN_ISA=amx, so the same source paths (VNNI packing, tile edges, row
# groups, masks) run everywhere.  Needs AVX2.
#
#   tools/emulate_amx.sh                      # the AMX and 16-bit test files
#   tools/emulate_amx.sh tests -q -x          # other pytest arguments
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
tar -C "$src" --exclude=./build --exclude="*.so" --exclude=./.git --exclude=./.venv --exclude=./.asv -cf - . \
    | tar -C "$work/src" -xf -
cd "$work/src"
FASTATTN_EMULATE_AMX=1 python setup.py -q build_ext --inplace >build.log 2>&1 || { cat build.log; exit 1; }
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/kernel/test_amx.py tests/kernel/test_amx_fp16.py tests/kernel/test_precision.py tests/kernel/test_dtypes.py tests/kernel/test_masks.py tests/kernel/test_kv8.py tests/api/test_paged.py -q -x -p no:cacheprovider)
FASTATTN_ISA=amx PYTHONPATH="$work/src" python -c \
    "import fastattn, sys; c = fastattn._config.config(); sys.exit(0 if fastattn.get_isa() == 'amx' and c['amx_emulated (FASTATTN_EMULATE_AMX, tests only)'] else 1)"
FASTATTN_ISA=amx PYTHONPATH="$work/src" python -m pytest "${args[@]}"
echo "emulated AMX path: tests passed"
