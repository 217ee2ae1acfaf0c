"""Build fastattn: one Cython extension linking per-ISA kernel objects.

Build options (environment variables, read here only and recorded in the
generated module fastattn/_build_config.py so that ``fastattn.show_config()``
reports them).  The build writes that module, like the Cython C code and the
objects, into the build directory only (build_lib, whence the wheel takes it);
an in-place build (``build_ext --inplace``, an editable install) copies it next
to the extension modules in the package, as it does them:

- ``FASTATTN_NATIVE=1``: add ``-march=native`` (local builds only; wheels never).
- ``FASTATTN_CUDA=1``: also build the optional ``fastattn._cuda`` extension.
- OpenMP is used when the compiler accepts ``-fopenmp``; with Apple clang (no such flag),
  ``-Xpreprocessor -fopenmp`` and LLVM's libomp where one is found
  (``FASTATTN_LIBOMP_PREFIX``, else Homebrew's ``brew --prefix libomp``); otherwise one
  thread (``show_config()``: ``openmp False``).  ``FASTATTN_OPENMP=0`` builds without it.
- ``FASTATTN_EMULATE_AVX512=1`` (tests only): build the AVX-512 kernel from
  AVX2 register pairs so its width-16 logic runs on CPUs without AVX-512
  (``tools/emulate_avx512.sh``).  Never for a real install.
- ``FASTATTN_EMULATE_AMX=1`` (tests only): build the AMX bfloat16 kernel with
  the tile instructions emulated in C (csrc/amx_emu.h) and its AVX-512 part
  from AVX2 pairs (implies ``FASTATTN_EMULATE_AVX512``), so that the ``amx``
  path runs on any AVX2 CPU (``tools/emulate_amx.sh``).  Never for a real install.
- The AMX unit is built when the compiler accepts ``-mamx-tile -mamx-bf16``
  (GCC >= 11, Clang >= 12); otherwise the ``amx`` path is simply absent.
  Beside it, the AMX-FP16 unit (float16 inputs on TDPFP16PS) where the
  assembler knows that instruction (binutils >= 2.38).
- ``FASTATTN_EMULATE_AVX512BF16=1`` (tests only): build the AVX512-BF16 kernel
  (csrc/kernel_bf16_avx512bf16.c) with VDPBF16PS emulated in C (csrc/vdpbf16.h) and
  its AVX-512 part from AVX2 pairs (implies ``FASTATTN_EMULATE_AVX512``), so that
  the ``avx512bf16`` path runs on any AVX2 CPU (``tools/emulate_avx512bf16.sh``).
- The AVX512-BF16 unit is built when the compiler accepts ``-mavx512bf16``
  (GCC >= 10, Clang >= 9); otherwise the ``avx512bf16`` path is absent.
- ``FASTATTN_BUILD_JOBS=N``: compile up to N C files at once (default: the
  CPUs this process may run on).  The per-ISA units and the extension's own
  sources are independent files: an in-place build on a 2-vCPU Zen 3 VM took
  166 s instead of 281 s one file at a time (CI builds the extension six times).
- ``FASTATTN_DEBUG=1``: keep debug info (``-g``, as Python's own flags have it).  By default
  every unit is compiled with ``-g0``: the same machine code, a third less compile time and
  modules without DWARF (a -g in ``$CFLAGS`` keeps it too, as tools/sanitize.sh sets).
- ``FASTATTN_BUILD_TIMES=1``: after the build, a table of every compiler and linker call's
  CPU time (the line per unit, printed as each finishes, shows with ``pip install -v``).
"""

import os
import platform
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import ExecError as DistutilsExecError

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE = os.environ.get("FASTATTN_NATIVE", "0") == "1"
CUDA = os.environ.get("FASTATTN_CUDA", "0") not in ("", "0")
IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
# Arm64 (Linux "aarch64", macOS "arm64"): the NEON units need no flag (Advanced SIMD is part of
# every AArch64 CPU); never -march=native, so a wheel runs on any Arm64 CPU.
IS_ARM64 = platform.machine().lower() in ("aarch64", "arm64")
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# FASTATTN_BUILD_TIMES=1: a table of every compile's CPU time at the end of the build.
BUILD_TIMES = os.environ.get("FASTATTN_BUILD_TIMES", "0") == "1"
BUILD_JOBS = max(1, int(os.environ.get("FASTATTN_BUILD_JOBS", "0") or 0) or _CPUS)

# Test-only: run the AVX-512 instantiation on AVX2 hardware (csrc/avx512_emu.h).
EMULATE_AVX512 = os.environ.get("FASTATTN_EMULATE_AVX512", "0") == "1"
# Test-only: the AMX tile instructions in C (csrc/amx_emu.h); needs the emulated AVX-512 too.
EMULATE_AMX = os.environ.get("FASTATTN_EMULATE_AMX", "0") == "1"
# Test-only: VDPBF16PS in C (csrc/vdpbf16.h); needs the emulated AVX-512 too.
EMULATE_AVX512BF16 = os.environ.get("FASTATTN_EMULATE_AVX512BF16", "0") == "1"
EMULATE_AVX512 = EMULATE_AVX512 or EMULATE_AMX or EMULATE_AVX512BF16

BASE_FLAGS = ["-O3", "-std=c11", "-fno-strict-aliasing", "-Wall", "-Wno-unused-function"]
if EMULATE_AVX512:
    BASE_FLAGS.append("-DFA_EMULATE_AVX512")
if EMULATE_AMX:
    BASE_FLAGS.append("-DFA_EMULATE_AMX")
if EMULATE_AVX512BF16:
    BASE_FLAGS.append("-DFA_EMULATE_AVX512BF16")
if NATIVE:
    BASE_FLAGS.append("-march=native")
# Debug info only where asked for: Python's sysconfig CFLAGS carry -g, which made the kernel
# objects take a third longer to compile and _kernels*.so 12.5 MB instead of 1.7 MB (the code is
# the same either way: GCC's -g does not change code generation).  FASTATTN_DEBUG=1, or a -g
# in $CFLAGS (tools/sanitize.sh), keeps it.  Symbols stay (perf, tools/test_wheel.sh need them).
DEBUG = os.environ.get("FASTATTN_DEBUG", "0") not in ("", "0") or any(
    f.startswith("-g") and f != "-g0" for f in os.environ.get("CFLAGS", "").split()
)
if not DEBUG:
    BASE_FLAGS.append("-g0")

# One instruction set per compile unit: (source, extra flags).  Units are named
# <family>_<dtype>_<isa>.c: the dtype the kernel computes in (f32, f64, bf16
# for the AMX tiles) and the instruction set the unit is compiled for (scalar
# = portable C, avx2, avx512, amx); kernel_* is the dot-product kernel
# (kernel_impl.h), additive_* the additive family (additive_impl.h).  The
# kernel's symbols carry the same _<dtype>_<isa> suffix (fa_kernel_f32_avx512),
# and tools/test_wheel.sh requires every function that uses ymm/zmm registers
# to have avx2, avx512 or amx in its name.
ISA_UNITS = [("csrc/kernel_f32_scalar.c", []), ("csrc/kernel_f64_scalar.c", [])]
if IS_X86:
    ISA_UNITS += [
        ("csrc/kernel_f32_avx2.c", ["-mavx2", "-mfma", "-mf16c"]),
        (
            "csrc/kernel_f32_avx512.c",
            ["-mavx2", "-mfma", "-mf16c"] if EMULATE_AVX512 else ["-mavx512f", "-mavx2", "-mfma", "-mf16c"],
        ),
    ]

if IS_ARM64:
    ISA_UNITS += [("csrc/kernel_f32_neon.c", [])]

# The attention family beyond dot-product (fastattn._family): the same
# one-ISA-per-unit rule, linked into its own extension.
FAMILY_UNITS = [
    ("csrc/additive_f32_scalar.c", []),
    ("csrc/additive_f64_scalar.c", []),
    ("csrc/lsh_f32_scalar.c", []),
    ("csrc/lsh_f64_scalar.c", []),
]
if IS_X86:
    FAMILY_UNITS += [
        ("csrc/additive_f32_avx2.c", ["-mavx2", "-mfma", "-mf16c"]),
        (
            "csrc/additive_f32_avx512.c",
            ["-mavx2", "-mfma", "-mf16c"] if EMULATE_AVX512 else ["-mavx512f", "-mavx2", "-mfma", "-mf16c"],
        ),
        ("csrc/lsh_f32_avx2.c", ["-mavx2", "-mfma", "-mf16c"]),
        (
            "csrc/lsh_f32_avx512.c",
            ["-mavx2", "-mfma", "-mf16c"] if EMULATE_AVX512 else ["-mavx512f", "-mavx2", "-mfma", "-mf16c"],
        ),
    ]
if IS_ARM64:
    FAMILY_UNITS += [("csrc/additive_f32_neon.c", []), ("csrc/lsh_f32_neon.c", [])]
EXT_UNITS = {"fastattn._kernels": ISA_UNITS, "fastattn._family": FAMILY_UNITS}


def _compiler_accepts(cflags, ldflags=()):
    """True when the C compiler builds and links a small OpenMP program with these flags."""
    cc = os.environ.get("CC", "cc")
    src = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.c")
        with open(path, "w") as f:
            f.write(src)
        try:
            r = subprocess.run(
                [cc, *cflags, path, "-o", os.path.join(d, "t"), *ldflags], capture_output=True, timeout=60
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return r.returncode == 0


def _libomp_prefix():
    """Where LLVM's OpenMP runtime is installed, for a compiler without -fopenmp (Apple
    clang): FASTATTN_LIBOMP_PREFIX, else on macOS Homebrew's libomp (``brew --prefix
    libomp``, then its usual places); None if none is found."""
    env = os.environ.get("FASTATTN_LIBOMP_PREFIX")
    if env:
        return env
    if platform.system() != "Darwin":
        return None
    try:
        r = subprocess.run(["brew", "--prefix", "libomp"], capture_output=True, text=True, timeout=60)
        if r.returncode == 0 and os.path.isdir(r.stdout.strip()):
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for d in ("/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"):
        if os.path.isdir(d):
            return d
    return None


def _openmp_flags():
    """(compile flags, link flags) for OpenMP; ([], []) builds a one-thread fastattn.

    GCC and LLVM clang: -fopenmp.  Apple clang has OpenMP's front end but neither the
    driver flag nor the runtime: -Xpreprocessor -fopenmp with LLVM's libomp
    (_libomp_prefix; the rpath lets a build from source find it, and delocate copies it
    into a macOS wheel).  FASTATTN_OPENMP=0 builds without OpenMP."""
    if os.environ.get("FASTATTN_OPENMP", "1") == "0":
        return [], []
    if _compiler_accepts(["-fopenmp"]):
        return ["-fopenmp"], ["-fopenmp"]
    prefix = _libomp_prefix()
    if prefix:
        cflags = ["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"]
        ldflags = [f"-L{prefix}/lib", f"-Wl,-rpath,{prefix}/lib", "-lomp"]
        if _compiler_accepts(cflags, ldflags):
            return cflags, ldflags
    return [], []


OMP_CFLAGS, OMP_LDFLAGS = _openmp_flags()
OPENMP = bool(OMP_CFLAGS)

AMX_FLAGS = [
    "-mamx-tile",
    "-mamx-bf16",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512dq",
    "-mavx512bf16",
    "-mavx2",
    "-mfma",
    "-mf16c",
]


def _compiler_builds(flags, src):
    """True when the C compiler compiles src (a C file's text) with flags."""
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.c")
        with open(path, "w") as f:
            f.write(src)
        try:
            r = subprocess.run(
                [cc, *flags, "-c", path, "-o", os.path.join(d, "t.o")], capture_output=True, timeout=60
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return r.returncode == 0


# The AMX bfloat16 unit (csrc/kernel_bf16_amx.c): real tiles where the compiler knows them,
# emulated ones in the test-only build.
AMX = IS_X86 and (
    EMULATE_AMX
    or _compiler_builds(
        AMX_FLAGS,
        "#include <immintrin.h>\nvoid f(void *c, float *s) { _tile_loadconfig(c); _tile_zero(0);\n"
        "_tile_dpbf16ps(0, 1, 2); _tile_stored(0, s, 64); _tile_release(); }\n",
    )
)
if AMX:
    BASE_FLAGS.append("-DFA_HAVE_AMX")
    ISA_UNITS.append(("csrc/kernel_bf16_amx.c", ["-mavx2", "-mfma", "-mf16c"] if EMULATE_AMX else AMX_FLAGS))

# The AMX-FP16 unit (csrc/kernel_f16_amx.c: float16 inputs on TDPFP16PS), beside the
# AMX unit where the assembler knows the instruction (binutils >= 2.38; the C
# compiler needs no intrinsic), emulated in the test-only build.
AMX_FP16 = AMX and (
    EMULATE_AMX
    or _compiler_builds(
        AMX_FLAGS, 'void f(void) { __asm__ volatile("tdpfp16ps %%tmm2, %%tmm1, %%tmm0" ::); }\n'
    )
)
if AMX_FP16:
    BASE_FLAGS.append("-DFA_HAVE_AMX_FP16")
    ISA_UNITS.append(("csrc/kernel_f16_amx.c", ["-mavx2", "-mfma", "-mf16c"] if EMULATE_AMX else AMX_FLAGS))


# The AVX512-BF16 unit (csrc/kernel_bf16_avx512bf16.c: the AMX kernel's source on
# VDPBF16PS): where the compiler knows the instruction; in any emulated AVX-512
# build it is compiled for AVX2 with VDPBF16PS in C (vdpbf16.h).
AVX512BF16_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"]
AVX512BF16 = IS_X86 and (
    EMULATE_AVX512
    or _compiler_builds(
        AVX512BF16_FLAGS,
        "#include <immintrin.h>\n"
        "__m512 f(__m512 a, __m512i b) { return _mm512_dpbf16_ps(a, (__m512bh)b, (__m512bh)b); }\n",
    )
)
if AVX512BF16:
    BASE_FLAGS.append("-DFA_HAVE_AVX512BF16")
    ISA_UNITS.append(
        (
            "csrc/kernel_bf16_avx512bf16.c",
            ["-mavx2", "-mfma", "-mf16c"] if EMULATE_AVX512 else AVX512BF16_FLAGS,
        )
    )


# Arm64 SVE: one unit per vector length (fixed-length SVE types, so that the register blocks are
# arrays as on x86), each run only where the CPU's length is its own (csrc/dispatch.c); built
# where the compiler has -msve-vector-bits (GCC >= 10, Clang >= 12).
SVE = IS_ARM64 and _compiler_builds(
    ["-march=armv8.2-a+sve", "-msve-vector-bits=256"],
    "#include <arm_sve.h>\ntypedef svfloat32_t v __attribute__((arm_sve_vector_bits(256)));\n"
    "void f(float *p) { v a[2] = {svdup_n_f32(1), svdup_n_f32(2)}; svst1_f32(svptrue_b32(), p, a[1]); }\n",
)
if SVE:
    BASE_FLAGS.append("-DFA_HAVE_SVE")
    ISA_UNITS += [
        (f"csrc/kernel_f32_sve{n}.c", ["-march=armv8.2-a+sve", f"-msve-vector-bits={n}"]) for n in (256, 512)
    ]


# Test-only (tools/sanitize.sh): the units named here (file names without .c) are compiled
# without the sanitizers that $CFLAGS asks for.  It names the units of ISAs this CPU lacks, which
# no test can reach: under ASan + UBSan each kernel unit took ~1000 s of compile CPU (Zen 3).
UNINSTRUMENTED = set(os.environ.get("FASTATTN_UNINSTRUMENTED_UNITS", "").split())
for _units in (ISA_UNITS, FAMILY_UNITS):
    _units[:] = [
        (src, flags + ["-fno-sanitize=all"] if os.path.basename(src)[:-2] in UNINSTRUMENTED else flags)
        for src, flags in _units
    ]
    if UNINSTRUMENTED:
        # Longest compiles first (BUILD_JOBS at a time): the instrumented vector units (the avx2
        # kernel alone ~1100 s of CPU), then the scalar ones, the uninstrumented ones last.  In list
        # order the two scalar units went first and the avx2 unit started only after them.
        _units.sort(key=lambda u: (os.path.basename(u[0])[:-2] in UNINSTRUMENTED, "_scalar" in u[0]))


def _build_config_text():
    """The text of fastattn/_build_config.py: the options this build used."""
    cc = os.environ.get("CC", "cc")
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        ver = cc
    return (
        "# Generated by setup.py at build time; do not edit.\n"
        f"COMPILER = {ver!r}\nOPENMP = {OPENMP!r}\nNATIVE = {NATIVE!r}\nCUDA_REQUESTED = {CUDA!r}\n"
        f"EMULATE_AVX512 = {EMULATE_AVX512!r}\nEMULATE_AMX = {EMULATE_AMX!r}\nAMX_BUILT = {AMX!r}\n"
        f"AMX_FP16_BUILT = {AMX_FP16!r}\n"
        f"EMULATE_AVX512BF16 = {EMULATE_AVX512BF16!r}\nAVX512BF16_BUILT = {AVX512BF16!r}\n"
        f"SVE_BUILT = {SVE!r}\n"
        f"CFLAGS = {' '.join(BASE_FLAGS + OMP_CFLAGS)!r}\n"
    )


BUILD_CONFIG = ("fastattn", "_build_config.py")


def _run_timed(cmd, env=None, **kwargs):
    """Run cmd like subprocess.check_call; return (wall seconds, CPU seconds of the process and the
    processes it waited for: the compiler driver's cc1 and as), from wait4, so that other work on a
    shared machine does not count."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, **kwargs)
    if hasattr(os, "wait4"):
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        cpu = ru.ru_utime + ru.ru_stime
    else:
        p.wait()
        cpu = float("nan")
    if p.returncode:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    return time.perf_counter() - t0, cpu


def _unit_name(cmd):
    """What a compiler command builds: its source file, or 'link <module>'."""
    args = [os.fspath(a) for a in cmd]
    i = args.index("-o") if "-o" in args else len(args) - 1
    if "-c" in args:
        rel = os.path.relpath(args[i - 1])
        if rel.startswith(("build" + os.sep, os.pardir)):  # Cython's C, in the build directory
            return os.path.join(*rel.split(os.sep)[-2:]) + " (Cython)"
        return rel
    return "link " + os.path.basename(args[i + 1]) if i + 1 < len(args) else " ".join(args[:1])


class BuildExt(build_ext):
    """Compiles each ISA unit with its own flags and links the objects in;
    cythonizes into build_temp and writes the build config into build_lib, so
    that nothing generated lands in the source tree except what an in-place
    build copies there (the extension modules and the build config)."""

    def _config_paths(self):
        regular = os.path.join(self.build_lib, *BUILD_CONFIG)
        package_dir = self.get_finalized_command("build_py").get_package_dir(BUILD_CONFIG[0])
        return regular, os.path.join(package_dir, BUILD_CONFIG[1])

    def run(self):
        super().run()  # builds into build_lib; copies the extensions into the package when inplace
        regular, inplace = self._config_paths()
        os.makedirs(os.path.dirname(regular), exist_ok=True)
        with open(regular, "w") as f:
            f.write(_build_config_text())
        if self.inplace:
            self.copy_file(regular, inplace, level=self.verbose)

    def get_outputs(self):
        regular, inplace = self._config_paths()
        return [*super().get_outputs(), inplace if self.inplace else regular]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if self.inplace:
            regular, inplace = self._config_paths()
            mapping[regular] = inplace
        return mapping

    def build_extensions(self):
        # Every compiler and linker call through the timed runner: a line per unit as it finishes
        # (seen with `pip install -v`), and with FASTATTN_BUILD_TIMES=1 a table at the end.
        self._times = []
        lock = threading.Lock()

        def run(cmd, env=None, **kwargs):
            if self.verbose:  # the command line, as setuptools' own runner logs it
                print(subprocess.list2cmdline([os.fspath(a) for a in cmd]), flush=True)
            wall, cpu = _run_timed(cmd, env=env, **kwargs)
            what = _unit_name(cmd)
            with lock:
                self._times.append((what, cpu, wall))
            print(f"fastattn build: {what}: {cpu:.1f} s CPU, {wall:.1f} s wall", flush=True)

        def spawn(cmd, **kwargs):  # older setuptools: compilers run commands through spawn
            try:
                run(cmd, **kwargs)
            except (subprocess.CalledProcessError, OSError) as e:
                raise DistutilsExecError(f"command {cmd[0]!r} failed: {e}") from e

        # newer setuptools runs them through the compiler's call (subprocess errors propagate), older
        # ones through its spawn (DistutilsExecError)
        name, runner = ("call", run) if hasattr(self.compiler, "call") else ("spawn", spawn)
        setattr(self.compiler, name, runner)
        t0 = time.perf_counter()
        try:
            super().build_extensions()
        finally:
            delattr(self.compiler, name)
        if BUILD_TIMES and self._times:
            total = sum(t[1] for t in self._times)
            print(
                f"fastattn build: {len(self._times)} commands, {total:.1f} s CPU in all, "
                f"{time.perf_counter() - t0:.1f} s wall ({BUILD_JOBS} at a time)"
            )
            for what, cpu, wall in sorted(self._times, key=lambda t: -t[1]):
                print(f"  {cpu:7.1f} s CPU {wall:7.1f} s wall  {what}")

    def build_extension(self, ext):
        if any(src.endswith(".pyx") for src in ext.sources):
            # The generated C goes to build_temp (not next to the .pyx); cythonize
            # regenerates it only when the .pyx (or a .pxd it uses) changed.
            ext.sources = cythonize(
                [ext],
                build_dir=self.build_temp,
                compiler_directives={"language_level": 3},
                force=self.force,
                quiet=True,
            )[0].sources
        compile_one = self.compiler.compile
        with ThreadPoolExecutor(BUILD_JOBS) as pool:

            def compile_each(compile_file, items):
                # compile_file over items, BUILD_JOBS at a time (each call spawns the
                # compiler); the objects in the items' order
                return [obj for objs in pool.map(compile_file, items) for obj in objs]

            if ext.name in EXT_UNITS:  # each ISA unit with its own flags
                ext.extra_objects = compile_each(
                    lambda unit: compile_one(
                        [unit[0]],
                        output_dir=self.build_temp,
                        include_dirs=["csrc"],
                        extra_postargs=BASE_FLAGS + unit[1],
                        depends=ext.depends,
                    ),
                    EXT_UNITS[ext.name],
                )
            # build_ext's one call for the extension's own sources: a file per job
            self.compiler.compile = lambda sources, *a, **kw: compile_each(
                lambda src: compile_one([src], *a, **kw), sources
            )
            try:
                super().build_extension(ext)
            finally:
                self.compiler.compile = compile_one


extensions = [
    Extension(
        "fastattn._kernels",
        sources=[
            "fastattn/_kernels.pyx",
            "csrc/attention.c",
            "csrc/dispatch.c",
            "csrc/tiles.c",
            "csrc/backward.c",
        ],
        include_dirs=["csrc", np.get_include()],
        depends=[os.path.join("csrc", f) for f in os.listdir(os.path.join(HERE, "csrc")) if f.endswith(".h")],
        extra_compile_args=BASE_FLAGS + OMP_CFLAGS,
        extra_link_args=OMP_LDFLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    Extension(
        "fastattn._family",
        sources=["fastattn/_family.pyx", "csrc/family.c"],
        include_dirs=["csrc", np.get_include()],
        depends=[os.path.join("csrc", f) for f in os.listdir(os.path.join(HERE, "csrc")) if f.endswith(".h")],
        extra_compile_args=BASE_FLAGS + OMP_CFLAGS,
        extra_link_args=OMP_LDFLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
]

ext_modules = extensions

cmdclass = {"build_ext": BuildExt}
if CUDA:
    # Optional fastattn._cuda (csrc/cuda/build.py, loaded by path; only now is CUDA looked for).
    # No nvcc is a hard error (CudaNotFoundError) rather than a silent CPU-only build.
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "fastattn_cuda_build", os.path.join(HERE, "csrc", "cuda", "build.py")
    )
    _cuda_build = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_cuda_build)
    ext_modules.append(_cuda_build.cuda_extension())
    cmdclass["build_ext"] = _cuda_build.with_cuda(BuildExt)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
