"""Build helper of the optional CUDA extension ``fastattn._cuda``.

Used by setup.py only when ``FASTATTN_CUDA=1`` (setup.py loads this file by
path, so nothing here is imported by a CPU build), and runnable on its own to
build just the CUDA module::

    python csrc/cuda/build.py --build-lib OUTDIR [--archs 80]

How it builds: nvcc compiles ``csrc/cuda/{launch,runtime}.cu`` (``-O3 --std=c++17
-Xcompiler -fPIC``, one ``-gencode`` per architecture) into objects; the C
compiler builds the plain Python C API binding ``module.c`` and links the
objects with the static CUDA runtime (``-lcudart_static -lrt -ldl
-lpthread``), so the module needs the NVIDIA driver but no libcudart.so.

Environment:

- ``CUDA_HOME`` or ``CUDA_PATH``: the toolkit; else the toolkit of the ``nvcc``
  on ``PATH``; else ``/usr/local/cuda``.  No nvcc found is an error.
- ``FASTATTN_CUDA_ARCHS``: ``;``/``,``/space separated compute capabilities,
  e.g. ``"80;90"`` or ``"8.0 9.0+PTX"`` (``+PTX`` also embeds PTX for
  newer GPUs).  Default ``"80;90+PTX"``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# launch.cu includes the kernels (common.cuh, kernel_*.cuh); runtime.cu wraps the runtime.
CU_SOURCES = ["launch.cu", "runtime.cu"]
HEADERS = [
    "fastattn_cuda.h",
    "common.cuh",
    "kernel_prefill.cuh",
    "kernel_decode.cuh",
    "kernel_mma.cuh",
    os.path.join(os.pardir, "fastattn.h"),
]
DEFAULT_ARCHS = "80;90+PTX"
DEFAULT_CUDA_HOME = "/usr/local/cuda"


class CudaNotFoundError(RuntimeError):
    """FASTATTN_CUDA=1 was requested but no usable CUDA toolkit was found."""


def _nvcc_in(home):
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def find_cuda_home():
    """(cuda_home, nvcc) located like torch.utils.cpp_extension does.

    Raises CudaNotFoundError with what was tried when nothing is found."""
    tried = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            nvcc = _nvcc_in(home)
            if nvcc is None:
                raise CudaNotFoundError(
                    f"FASTATTN_CUDA=1 but {var}={home!r} has no bin/nvcc; point {var} at a CUDA toolkit "
                    "or unset FASTATTN_CUDA for the CPU-only build"
                )
            return home, nvcc
        tried.append(f"{var} (unset)")
    which = shutil.which("nvcc")
    if which:
        # nvcc may be a symlink or a wrapper script: the toolkit is where the real one lives.
        home = os.path.dirname(os.path.dirname(os.path.realpath(which)))
        if os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return home, _nvcc_in(home) or which
        tried.append(f"nvcc on PATH ({which}, no include/cuda_runtime.h next to it)")
    else:
        tried.append("nvcc on PATH (not found)")
    nvcc = _nvcc_in(DEFAULT_CUDA_HOME)
    if nvcc:
        return DEFAULT_CUDA_HOME, nvcc
    tried.append(f"{DEFAULT_CUDA_HOME}/bin/nvcc (not found)")
    raise CudaNotFoundError(
        "FASTATTN_CUDA=1 asks for the CUDA extension but no CUDA toolkit was found; tried: "
        + "; ".join(tried)
        + ". Install the CUDA toolkit and set CUDA_HOME (or put nvcc on PATH), "
        "or unset FASTATTN_CUDA for the CPU-only build."
    )


def parse_archs(spec=None):
    """[(cc, with_ptx)] from FASTATTN_CUDA_ARCHS-style text, e.g. '80;9.0+PTX'."""
    if spec is None:
        spec = os.environ.get("FASTATTN_CUDA_ARCHS") or DEFAULT_ARCHS
    out = []
    for item in re.split(r"[;,\s]+", spec.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(?:sm_)?(\d+)(?:\.(\d))?([a-z]?)(\+PTX)?", item, flags=re.IGNORECASE)
        if not m:
            raise ValueError(
                f"FASTATTN_CUDA_ARCHS: cannot parse {item!r} (expected e.g. '80', '9.0', '90+PTX')"
            )
        cc = m.group(1) + (m.group(2) or "") + m.group(3).lower()
        if (m.group(2) is None and len(m.group(1)) < 2) or int(re.match(r"\d+", cc).group()) < 50:
            raise ValueError(f"FASTATTN_CUDA_ARCHS: {item!r} is not a compute capability such as 80 or 9.0")
        out.append((cc, bool(m.group(4))))
    if not out:
        raise ValueError(f"FASTATTN_CUDA_ARCHS is empty: {spec!r}")
    return out


def gencode_flags(archs):
    flags = []
    for cc, ptx in archs:
        flags.append(f"-gencode=arch=compute_{cc},code=sm_{cc}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{cc},code=compute_{cc}")
    return flags


def nvcc_version(nvcc):
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CudaNotFoundError(f"FASTATTN_CUDA=1 but {nvcc} --version failed: {e}") from None
    m = re.search(r"V(\d+\.\d+\.\d+)", text) or re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else "unknown"


def _rel(path):
    """Path relative to the working directory when below it (setuptools prefers
    relative sources), else absolute."""
    rel = os.path.relpath(path, os.getcwd())
    return path if rel.startswith(os.pardir) else rel


def _lib_dirs(home):
    cands = [
        os.path.join(home, "lib64"),
        os.path.join(home, "lib"),
        os.path.join(home, "targets", "x86_64-linux", "lib"),
        os.path.join(home, "targets", "sbsa-linux", "lib"),
    ]
    return [d for d in cands if os.path.isfile(os.path.join(d, "libcudart_static.a"))]


def cuda_extension():
    """The setuptools Extension of fastattn._cuda; its ``fa_cuda`` attribute
    tells the build_ext of :func:`with_cuda` what to compile with nvcc."""
    home, nvcc = find_cuda_home()
    archs = parse_archs()
    libdirs = _lib_dirs(home)
    if not libdirs:
        raise CudaNotFoundError(
            f"FASTATTN_CUDA=1 but no libcudart_static.a under {home} (lib64/ or targets/*/lib)"
        )
    ver = nvcc_version(nvcc)
    arch_text = ";".join(cc + ("+PTX" if ptx else "") for cc, ptx in archs)
    ext = Extension(
        "fastattn._cuda",
        sources=[_rel(os.path.join(HERE, "module.c"))],
        include_dirs=[_rel(HERE), _rel(os.path.dirname(HERE))],
        depends=[_rel(os.path.join(HERE, f)) for f in CU_SOURCES + HEADERS],
        library_dirs=libdirs,
        libraries=["cudart_static", "rt", "dl", "pthread", "stdc++"],
        define_macros=[("FA_CUDA_ARCHS", f'"{arch_text}"'), ("FA_NVCC_VERSION", f'"{ver}"')],
        extra_compile_args=["-O2", "-Wall"],
    )
    ext.fa_cuda = {"home": home, "nvcc": nvcc, "archs": archs, "version": ver}
    return ext


def compile_cuda_objects(info, build_temp):
    """nvcc-compile CU_SOURCES into build_temp; returns the object paths."""
    out_dir = os.path.join(build_temp, "cuda")
    os.makedirs(out_dir, exist_ok=True)
    objects = []
    for src in CU_SOURCES:
        obj = os.path.join(out_dir, os.path.splitext(src)[0] + ".o")
        cmd = [
            info["nvcc"],
            "-c",
            os.path.join(HERE, src),
            "-o",
            obj,
            "-O3",
            "--std=c++17",
            "-Xcompiler",
            "-fPIC",
            "-I",
            HERE,
            "-I",
            os.path.dirname(HERE),
        ] + gencode_flags(info["archs"])
        print(" ".join(cmd), flush=True)
        r = subprocess.run(cmd)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed ({r.returncode}) compiling {src}; command: {' '.join(cmd)}")
        objects.append(obj)
    return objects


def with_cuda(build_ext_cls):
    """A subclass of build_ext_cls that nvcc-compiles the objects of
    extensions made by :func:`cuda_extension` before linking them."""

    class BuildExtCuda(build_ext_cls):
        def build_extension(self, ext):
            info = getattr(ext, "fa_cuda", None)
            if info is not None:
                ext.extra_objects = list(ext.extra_objects or []) + compile_cuda_objects(
                    info, self.build_temp
                )
            super().build_extension(ext)

    return BuildExtCuda


def main(argv=None):
    import argparse

    from setuptools import Distribution
    from setuptools.command.build_ext import build_ext

    ap = argparse.ArgumentParser(description="Build only fastattn._cuda.")
    ap.add_argument("--build-lib", required=True, help="fastattn/_cuda*.so is written below this folder")
    ap.add_argument("--build-temp", default=None, help="objects (default: BUILD_LIB/tmp)")
    ap.add_argument("--archs", default=None, help="overrides FASTATTN_CUDA_ARCHS")
    a = ap.parse_args(argv)
    if a.archs:
        os.environ["FASTATTN_CUDA_ARCHS"] = a.archs
    build_lib = os.path.abspath(a.build_lib)
    build_temp = os.path.abspath(a.build_temp or os.path.join(build_lib, "tmp"))
    os.chdir(ROOT)  # sources are given relative to the repository root
    dist = Distribution(
        {
            "name": "fastattn-cuda",
            "ext_modules": [cuda_extension()],
            "cmdclass": {"build_ext": with_cuda(build_ext)},
        }
    )
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp, cmd.inplace, cmd.force = build_lib, build_temp, 0, 1
    dist.run_command("build_ext")
    print(cmd.get_ext_fullpath("fastattn._cuda"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
