#!/usr/bin/env bash
# The emulated amx path alone: tools/emulate_x86.sh amx (one scratch build that
# emulates the AVX-512, AMX and AVX512-BF16 kernels on AVX2, then this path's
# test files with FASTATTN_ISA=amx).  Needs AVX2.
#
#   tools/emulate_amx.sh                 # the path's default test files
#   tools/emulate_amx.sh tests -q -x     # other pytest arguments
exec "$(dirname "$0")/emulate_x86.sh" amx "$@"
