"""``python -m fastattn``: the command line of :mod:`fastattn.cli` (also installed as ``fastattn``)."""

import sys

from fastattn.cli import main

if __name__ == "__main__":
    sys.exit(main())
