"""``python -m fastattn.bench ARGS``: ``fastattn bench ARGS`` (:func:`fastattn.bench.main`)."""

import sys

from fastattn.bench import main

if __name__ == "__main__":
    sys.exit(main())
