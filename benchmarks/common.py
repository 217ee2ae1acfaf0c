"""What the asv benchmarks share: the case table of ``fastattn bench`` and the thread count.

The case table, the FLOP counts, the masks and the NumPy baseline are
``fastattn/bench/cases.py``, loaded from the checkout this file is in (not from the
fastattn being timed), so that every commit asv times, older ones included, meets the
same cases and the same baseline; only where that file is absent (this folder copied
elsewhere) is it imported from the installed fastattn.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

THREADS = int(os.environ.get("FASTATTN_BENCH_THREADS", "0")) or (os.cpu_count() or 1)

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "fastattn", "bench", "cases.py")


def _load_cases() -> Any:
    if not os.path.exists(_PATH):
        from fastattn.bench import cases as installed

        return installed
    name = "_fastattn_bench_cases"  # not fastattn.bench.cases: that name is the installed one's
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


cases = _load_cases()
