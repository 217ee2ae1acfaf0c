#!/usr/bin/env bash
# Build fastattn for Arm64 (aarch64) on this x86-64 Debian machine and run its
# kernel tests under qemu user-mode emulation, once per emulated CPU.
#
#   tools/emulate_aarch64.sh                       # default CPUs and test files
#   tools/emulate_aarch64.sh tests/kernel/test_isa.py -q -x   # other pytest arguments
#   FASTATTN_ARM64_CPUS="neoverse-n1 max" tools/emulate_aarch64.sh
#
# How (needs root: apt-get, binfmt_misc, mmdebstrap; Debian's archive and PyPI):
#   * the arm64 userland (python3.11, its headers, libgomp) is EXTRACTED from
#     Debian's arm64 packages into a root filesystem (mmdebstrap
#     --variant=extract: no package scripts run, nothing is emulated);
#   * Python itself (pip, Cython, pytest, numpy's aarch64 wheels) runs under
#     qemu-aarch64-static through binfmt_misc, with QEMU_LD_PREFIX pointing the
#     loader at that root filesystem;
#   * C is compiled by Debian's native x86-64 cross gcc aimed at the root
#     filesystem (--sysroot) and handed to setup.py as $CC: setup.py sees the
#     emulated interpreter's platform.machine() == "aarch64" and builds the
#     portable and NEON units with the same flags as an aarch64 wheel.
# The root filesystem and venv are kept in $FASTATTN_ARM64_DIR (default
# ~/.cache/fastattn-arm64) and reused when present; the build is fresh each run.
#
# Emulated CPUs (QEMU_CPU; qemu gives no speeds, only results), each with the
# path fastattn must choose there (tests/kernel/test_isa.py checks it):
#   neoverse-n1                         NEON only, as Graviton 2      -> neon
#   max,sve-default-vector-length=16    SVE at 128 bits (Graviton 4)  -> neon
#   max,sve-default-vector-length=32    SVE at 256 bits (Graviton 3)  -> sve (sve256 unit)
#   max                                 SVE at 512 bits (A64FX)       -> sve (sve512 unit)
# On each, the ISA-parametrised files (test_isa.py) run every path the CPU has
# (scalar, neon, sve); the other files run its default path.
# numpy's OpenBLAS is pinned to its NEON kernels (OPENBLAS_CORETYPE): its
# SVE/SME kernels on "-cpu max" are ~16x slower emulated, which makes the
# float64 reference's matmuls look like hangs.  fastattn sees the whole CPU.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
W="${FASTATTN_ARM64_DIR:-$HOME/.cache/fastattn-arm64}"
ROOT="$W/rootfs"
VENV="$W/venv"
CPUS="${FASTATTN_ARM64_CPUS:-neoverse-n1 max,sve-default-vector-length=16 max,sve-default-vector-length=32 max}"
t0=$SECONDS
say() { printf '== [%4ds] %s\n' "$((SECONDS - t0))" "$*"; }

if [ "$(id -u)" != 0 ]; then
    echo "tools/emulate_aarch64.sh needs root (apt-get, binfmt_misc, mmdebstrap)" >&2
    exit 1
fi

say "qemu-user-static, binfmt-support, aarch64 cross gcc, mmdebstrap"
export DEBIAN_FRONTEND=noninteractive
if ! command -v qemu-aarch64-static >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null ||
    ! command -v mmdebstrap >/dev/null; then
    apt-get update -q >/dev/null
    # binfmt_misc is mounted before qemu-user-static's postinst registers its handlers
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    apt-get install -y -q --no-install-recommends qemu-user-static binfmt-support gcc-aarch64-linux-gnu \
        libc6-dev-arm64-cross mmdebstrap >/dev/null
fi
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64

if [ ! -e "$ROOT/.complete" ]; then
    say "arm64 root filesystem (Debian's arm64 python3.11, extracted)"
    . /etc/os-release
    # the Debian archive this machine's apt already uses
    mirror="$(apt-get indextargets --format '$(RELEASE) $(SITE)' | awk -v c="$VERSION_CODENAME" '$1 == c {print $2; exit}')"
    if mount | grep -q " $ROOT"; then
        echo "something is mounted under $ROOT: not deleting it" >&2
        exit 1
    fi
    rm -rf "$ROOT" "$VENV"
    mkdir -p "$W"
    mmdebstrap --quiet --variant=extract --mode=root --architectures=arm64 \
        --include=python3.11-venv,libpython3.11-dev,libc6-dev,libgomp1,libstdc++6 \
        "$VERSION_CODENAME" "$ROOT" "$mirror"
    touch "$ROOT/.complete"
fi
mkdir -p "$W/bin" "$W/home"
cp /etc/ssl/certs/ca-certificates.crt "$W/ca.crt" 2>/dev/null || true
cat >"$W/bin/aarch64-cc" <<EOF
#!/bin/sh
exec /usr/bin/aarch64-linux-gnu-gcc --sysroot=$ROOT -I$ROOT/usr/include/python3.11 "\$@"
EOF
chmod +x "$W/bin/aarch64-cc"

# A command in the emulated arm64 world, in a clean environment (the host's pip
# configuration and x86 wheel caches stay out).
a64() {
    env -i PATH="$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        HOME="$W/home" LANG=C.UTF-8 TMPDIR="${TMPDIR:-/tmp}" \
        QEMU_LD_PREFIX="$ROOT" QEMU_CPU="${QEMU_CPU:-max}" OPENBLAS_CORETYPE=NEOVERSEN1 \
        PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
        ${PIP_CERT:+PIP_CERT="$PIP_CERT"} CC="$W/bin/aarch64-cc" FASTATTN_BUILD_JOBS=2 \
        ${FASTATTN_ISA:+FASTATTN_ISA="$FASTATTN_ISA"} "$@"
}
[ -s "$W/ca.crt" ] && export PIP_CERT="$W/ca.crt"

if [ ! -e "$VENV/.complete" ]; then
    say "venv (emulated python3.11) with aarch64 wheels from PyPI"
    rm -rf "$VENV"
    a64 "$ROOT/usr/bin/python3.11" -m venv "$VENV"
    # the build's and the tests' requirements (pyproject.toml's [build-system] and [test] core)
    a64 pip install -q "setuptools>=77" "Cython>=3.0" "numpy>=1.25" wheel pytest hypothesis threadpoolctl ml_dtypes
    touch "$VENV/.complete"
fi
a64 python -c 'import platform; assert platform.machine() == "aarch64", platform.machine()'

say "build (emulated Cython, native cross gcc) in a scratch copy"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -C "$src" --exclude=./build --exclude="*.so" --exclude=./.git --exclude=./.venv --exclude=./.asv \
    --exclude=__pycache__ -cf - . | tar -C "$work" -xf -
(cd "$work" && a64 python setup.py -q build_ext --inplace >build.log 2>&1) || { cat "$work/build.log"; exit 1; }
for unit in kernel_f32_neon kernel_f32_sve256 kernel_f32_sve512; do
    grep -q "$unit" "$work/build.log" || { echo "the $unit unit was not built" >&2; exit 1; }
done

# The default files of each CPU model.  Under qemu NEON code runs a few times
# slower than natively, SVE code much slower (test_kv8.py: ~8 minutes on the
# sve256 unit against ~1 on NEON, 2-core Zen 3), so the wide files run on the
# NEON-only model and the SVE models run test_isa.py (tile boundaries, head
# dims, decode rows, 16-bit K/V, exp2) and the thread-count check on their
# own path.
default_args() {
    local k=tests/kernel
    case "$1" in
    neoverse-n1) args=($k/test_isa.py $k/test_threads.py $k/test_backward.py $k/test_dtypes.py $k/test_kv8.py
        $k/test_sdpa.py tests/api/test_paged.py $k/test_dropout.py) ;;
    *sve-default-vector-length=16*) args=($k/test_isa.py -k "architecture or exp2 or tile_boundaries") ;;
    *) args=($k/test_isa.py $k/test_threads.py) ;;
    esac
    args+=(-q -x -p no:cacheprovider -o faulthandler_timeout=900)
}
for cpu in $CPUS; do
    # the CPU's best vector path only: the scalar path is the same C as on x86, where it runs
    # anyway, and the NEON path runs on the models without a usable SVE length
    paths=$(cd "$work" && QEMU_CPU=$cpu a64 env PYTHONPATH="$work" python -c '
import fastattn._kernels as k
print(k.isa_best())')
    if [ $# -gt 0 ]; then
        args=("$@")
    else
        default_args "$cpu"
    fi
    t1=$SECONDS
    say "QEMU_CPU=$cpu: path $paths; pytest ${args[*]}"
    (cd "$work" && QEMU_CPU=$cpu a64 env FASTATTN_TEST_INSTALLED=0 FASTATTN_TEST_ISAS="$paths" PYTHONPATH="$work" \
        python -m pytest "${args[@]}")
    say "QEMU_CPU=$cpu: passed in $((SECONDS - t1)) s"
done
say "aarch64 emulation: all passed"
