"""Run-time knobs.  Each ``FASTATTN_*`` environment variable is read here
and nowhere else, except the CUDA launcher's escape hatches and test hooks
(``FASTATTN_CUDA_MMA``, ``FASTATTN_CUDA_DECODE``, ``FASTATTN_CUDA_SPLITS``),
which csrc/cuda/attention.cu reads at each launch so that they can change
between calls; ``show_config()`` reports every one of them.

An invalid ``FASTATTN_NUM_THREADS``, ``FASTATTN_ISA`` or ``FASTATTN_TILES``
(garbage, out of range, or an ISA path this CPU cannot run) does not make
``import fastattn`` fail: the knob is ignored (its default is used), a
``RuntimeWarning`` naming the variable and its accepted values is issued at
import, and :func:`env_problems` / ``show_config()`` list it.  Why not an
ImportError: the command line (``fastattn info``, the diagnosis command, and
``--help``) lives in this package, so a failing import would leave no way to
show the problem but a traceback.  The commands that compute (``fastattn check``,
``fastattn bench``) refuse to run while a knob is ignored, and the test suite
refuses to start (tests/conftest.py), so no result is reported for a
configuration that was asked for but not applied.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from numbers import Integral
from typing import Any, Literal, cast

from . import _build_config, _kernels
from ._checks import MAX_THREADS

__all__ = [
    "get_num_threads",
    "set_num_threads",
    "show_config",
    "get_isa",
    "set_isa",
    "config",
    "get_float32_matmul_precision",
    "set_float32_matmul_precision",
    "get_tiles",
    "set_tiles",
    "env_problems",
]

# Read by the CUDA launcher itself at each call (see the module docstring); reported here.
_CUDA_LAUNCH_KNOBS = ("FASTATTN_CUDA_MMA", "FASTATTN_CUDA_DECODE", "FASTATTN_CUDA_SPLITS")

_ENV_THREADS = os.environ.get("FASTATTN_NUM_THREADS")
_ENV_ISA = os.environ.get("FASTATTN_ISA")
_ENV_TILES = os.environ.get("FASTATTN_TILES")
_thread_override: int | None = None

# Knobs ignored at import: variable -> the one-line reason (see the module docstring).
_ENV_PROBLEMS: dict[str, str] = {}
_HERE = os.path.dirname(os.path.abspath(__file__))


def env_problems() -> dict[str, str]:
    """The ``FASTATTN_*`` environment variables ignored at import (invalid values), each
    with a one-line message naming it and its accepted values; empty when all are valid."""
    return dict(_ENV_PROBLEMS)


def refusal_lines(command: str) -> list[str]:
    """What ``command`` (a command that checks or times the kernel: ``fastattn check``,
    ``fastattn bench``) prints instead of running while a knob is ignored: one line per
    variable; empty when none is."""
    return [
        f"{command}: not run, because {msg}; fix or unset {var} (`fastattn info` runs with it)"
        for var, msg in _ENV_PROBLEMS.items()
    ]


def _importer_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this package: the code that imported
    fastattn (the import system's own frames are skipped by ``warnings``, and so here)."""
    level, f = 2, sys._getframe(2)  # 1: _ignore_env, 2: its caller
    while f is not None:
        name = f.f_code.co_filename
        internal = "importlib" in name and "_bootstrap" in name
        if not internal:
            if not os.path.abspath(name).startswith(_HERE + os.sep):
                return level
            level += 1
        f = f.f_back  # type: ignore[assignment]
    return 1


def _ignore_env(var: str, value: str, expected: str, default: str) -> None:
    """Record an invalid knob and warn once, at import, on one line."""
    msg = f"{var}={value!r} ignored: expected {expected}; using {default}"
    _ENV_PROBLEMS[var] = msg
    warnings.warn(msg, RuntimeWarning, stacklevel=_importer_stacklevel())


def _parse_threads(value: str | None) -> int | None:
    """FASTATTN_NUM_THREADS: None when unset or empty; an integer in [1, MAX_THREADS]."""
    if value is None or value.strip() == "":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_THREADS:
        _ignore_env(
            "FASTATTN_NUM_THREADS",
            value,
            f"an integer in [1, {MAX_THREADS}]",
            "the default thread count (OpenMP's)",
        )
        return None
    return n


_env_threads = _parse_threads(_ENV_THREADS)


def get_num_threads() -> int:
    """Threads a call uses when ``num_threads=None``.

    In order: the value given to :func:`set_num_threads`, else the environment
    variable ``FASTATTN_NUM_THREADS``, else OpenMP's current default (which
    follows ``OMP_NUM_THREADS`` and ``threadpoolctl.threadpool_limits``).

    Returns
    -------
    int
        The default thread count, at least 1.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.get_num_threads() >= 1
    True
    """
    if _thread_override is not None:
        return _thread_override
    if _env_threads is not None:
        return _env_threads
    return min(max(1, _kernels.omp_max_threads()), MAX_THREADS)


def set_num_threads(n: int | None) -> None:
    """Set the default thread count for later calls (``None`` restores the default).

    Results are bit-identical for every thread count; a call's ``num_threads=``
    overrides this default for that call.

    Parameters
    ----------
    n : int or None
        Threads, 1 to 1024 (ValueError otherwise); None returns to the default
        described in :func:`get_num_threads`.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.set_num_threads(1)
    >>> fastattn.get_num_threads()
    1
    >>> fastattn.set_num_threads(None)
    """
    global _thread_override
    if n is None:
        _thread_override = None
        return
    # Any integer but a bool (NumPy's too), like every integer argument (_checks.int_value).
    if isinstance(n, bool) or not isinstance(n, Integral):
        raise TypeError(f"num_threads must be an int, got {type(n).__name__}")
    if not 1 <= int(n) <= MAX_THREADS:
        raise ValueError(f"num_threads must be in [1, {MAX_THREADS}], got {n}")
    _thread_override = int(n)


# torch's float32 matmul precision levels (codes shared with csrc/fastattn.h); the
# type of every front end's precision= argument (None there: the process default).
Precision = Literal["highest", "high", "medium"]
PRECISIONS: dict[str, int] = {"highest": 0, "high": 1, "medium": 2}
_f32_precision = "highest"


def precision_code(precision: str | None) -> int:
    """The kernel code of a ``precision=`` argument (None: the process default)."""
    if precision is None:
        return PRECISIONS[_f32_precision]
    if not isinstance(precision, str):
        raise TypeError(
            f"precision must be a str ('highest', 'high' or 'medium'), got {type(precision).__name__}"
        )
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"precision must be 'highest', 'high' or 'medium', got {precision!r}") from None


def set_float32_matmul_precision(precision: str) -> None:
    """Process default for float32 inputs, with torch's names.

    ``"highest"`` (the default): float32 arithmetic.  ``"high"``: each float32 of
    Q, K, V and P split into two bfloat16 parts with three bf16 products (bf16x3,
    ~16 mantissa bits), accumulated in float32.  ``"medium"``: Q, K, V and P rounded
    to bfloat16.  The lower levels are permissions, as in torch: they take effect
    on the ``amx`` path (float32 query, key and value, >= 32 rows per key/value head),
    ``"medium"`` also on the ``avx512bf16`` path, and elsewhere compute as ``"highest"``.
    float64 and float16 inputs ignore the level (float16 is never rounded to bfloat16).
    Per call: ``precision=``.

    Parameters
    ----------
    precision : {"highest", "high", "medium"}
        The level for later calls (TypeError / ValueError for anything else).

    Examples
    --------
    >>> import fastattn
    >>> fastattn.set_float32_matmul_precision("high")
    >>> fastattn.get_float32_matmul_precision()
    'high'
    >>> fastattn.set_float32_matmul_precision("highest")
    """
    global _f32_precision
    precision_code(precision)  # TypeError / ValueError on bad values; None is not a level
    if precision is None:
        raise TypeError("precision must be a str ('highest', 'high' or 'medium'), got NoneType")
    _f32_precision = precision


def get_float32_matmul_precision() -> str:
    """The process default set by :func:`set_float32_matmul_precision` ("highest" at start).

    Returns
    -------
    str
        ``"highest"``, ``"high"`` or ``"medium"``.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.get_float32_matmul_precision()
    'highest'
    """
    return _f32_precision


def get_isa() -> str:
    """The kernels' instruction-set path: 'amx', 'avx512bf16', 'avx512', 'avx2', 'sve', 'neon' or 'scalar'.

    'amx' is the AVX-512 path plus the AMX tile kernel for bfloat16 query, key
    and value with at least 32 stacked rows (query positions x GQA group) per
    key/value head; it is the default where the CPU and OS allow AMX.
    'avx512bf16' is the AVX-512 path plus the same kernel with VDPBF16PS
    products (bfloat16 inputs, and float32 ones at precision "medium"), for
    CPUs with AVX512-BF16 and no AMX.  'neon' is the Arm64 path (Advanced
    SIMD, which every AArch64 CPU has), 'sve' the same kernels in SVE vectors
    where the CPU's length is 256 or 512 bits; 'scalar' the portable C one.

    Returns
    -------
    str
        The current path: the best the CPU supports unless :func:`set_isa` or
        ``FASTATTN_ISA`` chose another.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.get_isa() in ("amx", "avx512bf16", "avx512", "avx2", "sve", "neon", "scalar")
    True
    """
    return _kernels.isa_get()


def set_isa(isa: str) -> None:
    """Force an ISA path (a name :func:`get_isa` lists); ValueError if the CPU lacks it.

    For testing and measurement: every path gives results within the same
    accuracy contract.

    Parameters
    ----------
    isa : str
        One of the names above; the CPU (and OS) must support it.

    Examples
    --------
    >>> import fastattn
    >>> best = fastattn.get_isa()
    >>> fastattn.set_isa("scalar")      # every CPU has the portable C path
    >>> fastattn.get_isa()
    'scalar'
    >>> fastattn.set_isa(best)
    """
    if isa not in _kernels.ISA_NAMES:
        raise ValueError(f"isa must be one of {', '.join(_kernels.ISA_NAMES)}, got {isa!r}")
    if not _kernels.isa_set(isa):
        raise ValueError(
            f"this CPU cannot run the {isa!r} path (it supports: "
            f"{', '.join(i for i in _kernels.ISA_NAMES if _kernels.cpu_has(i))})"
        )


if _ENV_ISA and _ENV_ISA.strip():
    try:
        set_isa(_ENV_ISA.strip().lower())
    except ValueError:
        _ignore_env(
            "FASTATTN_ISA",
            _ENV_ISA,
            f"one of {', '.join(_kernels.ISA_NAMES)} that this CPU runs "
            f"({', '.join(i for i in _kernels.ISA_NAMES if _kernels.cpu_has(i))})",
            f"the default path {_kernels.isa_get()!r}",
        )

# The most stacked rows per task a row block may have (csrc/tiles.h, FA_ROWS_MAX).
TILES_ROWS_MAX = 4096


def set_tiles(rows: int | None) -> None:
    """Force the forward kernels' row block (stacked query rows per task) for later calls.

    By default (``None``) it is derived from the core's L2 size for query lengths
    >= 1024; for shorter ones the float32 and float64 kernels take it too while the
    call keeps at least 32 tasks (batch x heads x length / rows; causal and windowed
    calls: at most half the query length), the bfloat16 tile kernel its short block
    (see docs/performance.md, "Tiles from the cache").
    A number is for measurement: every forward call takes at most that many rows per
    task (clamped to the kernel's maximum, at least a GQA group), the query length cut
    into near-equal blocks of at most that size.  Results do not depend on the thread count either way,
    but they may differ in the last bits between row blocks.  The environment
    variable ``FASTATTN_TILES`` (an integer, read at import) sets the same.

    Parameters
    ----------
    rows : int or None
        Rows per task, at least 1 (ValueError above the kernel's limit); None
        returns to the derived block.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.set_tiles(64)
    >>> fastattn.get_tiles()
    64
    >>> fastattn.set_tiles(None)
    """
    if rows is None:
        _kernels.tiles_set_rows(0)
        return
    # Any integer but a bool (NumPy's too), like every integer argument (_checks.int_value).
    if isinstance(rows, bool) or not isinstance(rows, Integral):
        raise TypeError(f"rows must be an int or None, got {type(rows).__name__}")
    if not 1 <= int(rows) <= TILES_ROWS_MAX:
        raise ValueError(f"rows must be in [1, {TILES_ROWS_MAX}], got {rows}")
    _kernels.tiles_set_rows(int(rows))


def get_tiles() -> int | None:
    """The row block forced by :func:`set_tiles` or ``FASTATTN_TILES`` (None: derived).

    Returns
    -------
    int or None
        The forced rows per task, or None when the kernels derive it.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.get_tiles() is None    # unless FASTATTN_TILES is set
    True
    """
    rows = _kernels.tiles_get_rows()
    return rows if rows > 0 else None


if _ENV_TILES and _ENV_TILES.strip():
    try:
        set_tiles(int(_ENV_TILES))
    except ValueError:
        _ignore_env(
            "FASTATTN_TILES",
            _ENV_TILES,
            f"an integer in [1, {TILES_ROWS_MAX}]",
            "the row blocks derived from the caches",
        )


def _module_version(name: str) -> str | None:
    """Installed version of a distribution, None when it is missing.

    Read from the package metadata, not by importing the module: ``import ml_dtypes``
    alone took 4.2 s of ``fastattn info``'s 4-7 s (it imports its own dependencies)."""
    from importlib import metadata

    for dist in dict.fromkeys((name, name.replace("_", "-"))):  # Python 3.9 does not normalize
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - broken metadata: report it as missing, never fail
            return None
    return None


def config() -> dict[str, Any]:
    """The configuration as a dict (what :func:`show_config` prints)."""
    from . import __version__

    # The extension itself, not fastattn.cuda: that module imports the argument
    # layer, which imports this one (an import cycle).  Same facts as
    # fastattn.cuda.is_built() / is_available().
    try:
        from . import _cuda

        # (an optional extension without a stub: its one call here is typed by hand)
        count: int = cast(Any, _cuda).device_count()
        cuda_built, cuda_available = True, count > 0
    except Exception:  # noqa: BLE001 - optional module
        cuda_built = cuda_available = False
    return {
        "version": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": _module_version("numpy"),
        "ml_dtypes": _module_version("ml_dtypes"),
        "compiler": _build_config.COMPILER,
        "cflags": _build_config.CFLAGS,
        "native_build (FASTATTN_NATIVE)": _build_config.NATIVE,
        "avx512_emulated (FASTATTN_EMULATE_AVX512, tests only)": getattr(
            _build_config, "EMULATE_AVX512", False
        ),
        "amx_built (compiler has AMX)": getattr(_build_config, "AMX_BUILT", False),
        "amx_emulated (FASTATTN_EMULATE_AMX, tests only)": getattr(_build_config, "EMULATE_AMX", False),
        "amx_fp16 (float16 inputs on the tiles, isa amx)": _kernels.amx_fp16_usable(),
        "avx512bf16_built (compiler has AVX512-BF16)": getattr(_build_config, "AVX512BF16_BUILT", False),
        "avx512bf16_emulated (FASTATTN_EMULATE_AVX512BF16, tests only)": getattr(
            _build_config, "EMULATE_AVX512BF16", False
        ),
        "sve_built (Arm64, compiler has fixed-length SVE)": getattr(_build_config, "SVE_BUILT", False),
        "openmp": _kernels.openmp_enabled(),
        "cpu_features": _kernels.cpu_features(),
        "isa": get_isa(),
        "isa_best": _kernels.isa_best(),
        "FASTATTN_ISA": _ENV_ISA,
        "caches (L1d, L2, L3 bytes per core)": _kernels.cache_sizes(),
        "rows per task (float32, L >= 1024, D = 64 / 128)": (
            _kernels.tiles_rows(64, 64, 1024, "float32"),
            _kernels.tiles_rows(128, 128, 1024, "float32"),
        ),
        "rows per task (bfloat16, L >= 1024, D = 64)": _kernels.tiles_rows(64, 64, 1024, "bfloat16"),
        "FASTATTN_TILES": _ENV_TILES,
        "float32_matmul_precision": _f32_precision,
        "num_threads": get_num_threads(),
        "FASTATTN_NUM_THREADS": _ENV_THREADS,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "cuda_requested (FASTATTN_CUDA)": _build_config.CUDA_REQUESTED,
        "cuda_built": cuda_built,
        "cuda_available": cuda_available,
        **{k: os.environ.get(k) for k in _CUDA_LAUNCH_KNOBS},
        # ignored at import (invalid values; their defaults are in use): variable -> why
        "ignored environment variables": env_problems(),
    }


def show_config() -> None:
    """Print version, compiler, kernel path, OpenMP, threads and CUDA build.

    What ``fastattn info`` (``python -m fastattn info``) prints: one line per
    setting, with the environment variables that set them.  Include it in a bug
    report.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.show_config()          # doctest: +ELLIPSIS
    version                          ...
    """
    for k, v in config().items():
        if k == "ignored environment variables":
            # one line each, in full: the line says what was expected and what is used instead
            print(f"{k:32s} {'none' if not v else ''}".rstrip())
            for msg in v.values():
                print(f"  {msg}")
            continue
        print(f"{k:32s} {v}")
