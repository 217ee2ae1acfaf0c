#!/usr/bin/env bash
# The emulated avx512bf16 path alone: tools/emulate_x86.sh avx512bf16 (one scratch build that
# emulates the AVX-512, AMX and AVX512-BF16 kernels on AVX2, then this path's
# test files with FASTATTN_ISA=avx512bf16).  Needs AVX2.
#
#   tools/emulate_avx512bf16.sh                 # the path's default test files
#   tools/emulate_avx512bf16.sh tests -q -x     # other pytest arguments
exec "$(dirname "$0")/emulate_x86.sh" avx512bf16 "$@"
