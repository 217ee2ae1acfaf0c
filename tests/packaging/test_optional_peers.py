"""Optional peers: a test that needs one skips when it is absent *or broken*,
and the extras can never pair mismatched dask / distributed releases."""

from __future__ import annotations

import os
import re
import sys

import pytest
from conftest import optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _skip_reason(name: str) -> str:
    with pytest.raises(pytest.skip.Exception) as info:
        optional(name)
    return str(info.value)


def test_absent_peer_skips_with_its_name():
    reason = _skip_reason("fastattn_no_such_peer_xyz")
    assert "fastattn_no_such_peer_xyz" in reason and "ModuleNotFoundError" in reason


@pytest.mark.parametrize(
    "body,exc",
    [
        # what dask 2026.11 beside distributed 2021.4 raised: a plain ImportError, which
        # pytest.importorskip does not catch
        ("from os import collections_to_dsk\n", "ImportError"),
        ("raise RuntimeError('jaxlib failed to load')\n", "RuntimeError"),
    ],
)
def test_broken_peer_skips_with_the_cause(tmp_path, monkeypatch, body, exc):
    name = f"fastattn_broken_peer_{exc.lower()}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        reason = _skip_reason(name)
    finally:
        sys.modules.pop(name, None)
    assert name in reason and exc in reason


def test_fastattn_modules_are_never_skipped():
    # a front end that fails to import is a bug to report, not a peer to skip
    with pytest.raises(ModuleNotFoundError):
        optional("fastattn.no_such_front_end")


def test_extras_tie_distributed_to_dask():
    """Every extra that brings distributed does so through dask's own
    ``distributed`` extra, which pins distributed to dask's exact release."""
    tomllib = optional("tomllib")  # Python >= 3.11
    path = os.path.join(ROOT, "pyproject.toml")
    if not os.path.exists(path):
        pytest.skip("no pyproject.toml beside the tests (an installed copy without its source)")
    with open(path, "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for extra, reqs in extras.items():
        for req in reqs:
            name = re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower()
            assert name != "distributed", f"extra {extra!r} lists distributed on its own: {req!r}"
            if name == "dask" and extra in ("test", "dask"):
                assert re.search(r"\[[^\]]*\bdistributed\b", req), f"extra {extra!r}: {req!r}"
