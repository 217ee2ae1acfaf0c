#!/usr/bin/env bash
# Build the documentation site the way CI does, and fail on anything wrong:
#   - pip-installs docs/requirements.txt (pinned sphinx, numpydoc, myst-parser, theme)
#     into the CURRENT environment (activate the venv first);
#   - html build with warnings as errors (a broken reference, a bad docstring, a
#     public name missing from docs/api/, a numpydoc gap in a checked name);
#   - the doctest builder: every Examples section and every {doctest} block runs.
# Both builds import the fastattn Python finds: the installed package in CI; in a
# source tree with the extension built in place, run with PYTHONPATH set to the
# checkout. The output goes to a temporary directory (kept with KEEP_DOCS=1), nothing
# is written into the checkout.
#
#   tools/check_docs.sh            # ~30 s on 2 cores once the packages are installed
#   SKIP_DOCS_INSTALL=1 tools/check_docs.sh   # the packages are already there
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
OUT="$(mktemp -d)"
if [ "${KEEP_DOCS:-0}" = 1 ]; then
  echo "docs output kept in $OUT"
else
  trap 'rm -rf "$OUT"' EXIT
fi

if [ "${SKIP_DOCS_INSTALL:-0}" != 1 ]; then
  "$PY" -m pip install -q -r "$REPO/docs/requirements.txt"
fi

# -P: the current directory is not put on sys.path (run from the checkout's root, it
# would shadow the installed package with the unbuilt source tree).
"$PY" -P -c 'import fastattn; print("documenting fastattn", fastattn.__version__, "from", fastattn.__file__)'
"$PY" -P -m sphinx -W --keep-going -q -b html -d "$OUT/doctrees" "$REPO/docs" "$OUT/html"
"$PY" -P -m sphinx -W --keep-going -q -b doctest -d "$OUT/doctrees" "$REPO/docs" "$OUT/doctest"
grep -A4 '^Doctest summary' "$OUT/doctest/output.txt"
echo "docs: html and doctests passed"
