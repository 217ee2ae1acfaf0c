#!/usr/bin/env bash
# Test the AVX-512 kernel on a CPU without AVX-512: build a scratch copy with
# FASTATTN_EMULATE_AVX512=1 (the width-16 instantiation of kernel_impl.h on
# AVX2 register pairs, csrc/avx512_emu.h) and run the tests with
# FASTATTN_ISA=avx512.  Needs AVX2.
#
#   tools/emulate_avx512.sh                      # the ISA-sensitive test files
#   tools/emulate_avx512.sh tests -q -x          # other pytest arguments
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
tar -C "$src" --exclude=./build --exclude="*.so" --exclude=./.git --exclude=./.venv --exclude=./.asv -cf - . \
    | tar -C "$work/src" -xf -
cd "$work/src"
FASTATTN_EMULATE_AVX512=1 python setup.py -q build_ext --inplace >build.log 2>&1 || { cat build.log; exit 1; }
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/kernel/test_sdpa.py tests/kernel/test_isa.py tests/kernel/test_variants.py tests/kernel/test_dtypes.py
                                tests/api/test_kvcache.py tests/kernel/test_threads.py tests/kernel/test_backward.py tests/kernel/test_family.py
                                tests/kernel/test_register_blocks.py tests/kernel/test_fused_softmax.py tests/kernel/test_masks.py tests/kernel/test_kv8.py tests/api/test_paged.py -q -x -p no:cacheprovider)
FASTATTN_ISA=avx512 PYTHONPATH="$work/src" python -c \
    "import fastattn, sys; c = fastattn._config.config(); sys.exit(0 if fastattn.get_isa() == 'avx512' else 1)"
FASTATTN_ISA=avx512 PYTHONPATH="$work/src" python -m pytest "${args[@]}"
echo "emulated AVX-512 path: tests passed"
