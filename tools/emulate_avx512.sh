#!/usr/bin/env bash
# The emulated avx512 path alone: tools/emulate_x86.sh avx512 (one scratch build that
# emulates the AVX-512, AMX and AVX512-BF16 kernels on AVX2, then this path's
# test files with FASTATTN_ISA=avx512).  Needs AVX2.
#
#   tools/emulate_avx512.sh                 # the path's default test files
#   tools/emulate_avx512.sh tests -q -x     # other pytest arguments
exec "$(dirname "$0")/emulate_x86.sh" avx512 "$@"
