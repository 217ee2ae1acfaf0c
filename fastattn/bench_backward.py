"""``python -m fastattn.bench_backward ARGS``: ``fastattn bench --backward ARGS``.

The forward + backward benchmark lives in :mod:`fastattn.bench.backward`; this module
keeps the older command (and its default of 2 threads) working.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fastattn.bench.backward import check
from fastattn.bench.cases import BACKWARD_CASES as CASES

__all__ = ["CASES", "check", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``fastattn bench --backward ARGV`` with ``--threads`` 2 unless given; the exit status."""
    from fastattn import bench, cli

    p = cli.build_parser()
    args = p.parse_args(["bench", "--backward", *(sys.argv[1:] if argv is None else argv)])
    if args.threads is None:
        args.threads = 2  # this command's default since it was written (for 2-core machines)
    return bench.run(bench.finish_args(p, args))


if __name__ == "__main__":
    sys.exit(main())
