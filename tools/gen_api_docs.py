"""Write docs/api.md from the docstrings of fastattn's public API.

    PYTHONPATH=. python tools/gen_api_docs.py          # rewrite docs/api.md
    PYTHONPATH=. python tools/gen_api_docs.py --check  # exit 1 if docs/api.md is stale

Covers every name in ``fastattn.__all__`` (functions, classes with their public
methods, submodules' public functions) and the optional modules (``fastattn.dask``,
``fastattn.torch_compat``, ...).  Those import their peer (Dask, torch); where a peer is
not installed, it is imported as a stand-in (any attribute a bare class) so that the
module's own docstrings are documented all the same: the output, and ``--check``, do not
depend on which peers are installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "api.md")
OPTIONAL_MODULES = ["fastattn.flash_compat", "fastattn.dask", "fastattn.torch_compat", "fastattn.hf"]


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"


def _doc(obj: object) -> str:
    return inspect.getdoc(obj) or "*(no docstring)*"


def _function(name: str, obj: object, level: str = "###") -> list[str]:
    return [f"{level} `{name}{_signature(obj)}`", "", "```text", _doc(obj), "```", ""]


def _class(name: str, cls: type) -> list[str]:
    lines = [f"### class `{name}{_signature(cls)}`", "", "```text", _doc(cls), "```", ""]
    for attr, member in sorted(vars(cls).items()):
        if attr.startswith("_") and attr != "__call__":
            continue
        if isinstance(member, property):
            lines += [f"#### property `{name}.{attr}`", "", "```text", _doc(member), "```", ""]
        elif inspect.isfunction(member) or isinstance(member, (classmethod, staticmethod)):
            fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
            lines += _function(f"{name}.{attr}", fn, "####")
    return lines


def _module(modname: str, mod: types.ModuleType) -> list[str]:
    lines = [f"## Module `{modname}`", "", inspect.getdoc(mod) or "", ""]
    names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    for n in names:
        obj = getattr(mod, n)
        if inspect.isclass(obj):
            lines += _class(n, obj)
        elif callable(obj) and getattr(obj, "__module__", "").startswith("fastattn"):
            lines += _function(f"{modname.split('.', 1)[1]}.{n}", obj)
    return lines


class _StandInType(type):
    """A class of a peer that is not installed: any public attribute is another such class
    (``torch.autograd.Function``), so a documented module can subclass it or keep it in a tuple
    at import time."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _StandInType(name, (), {"__module__": cls.__module__})
        setattr(cls, name, sub)
        return sub


class _StandIn(types.ModuleType):
    """A peer module that is not installed: any public attribute is a _StandInType class.
    Nothing of it reaches the output: only objects whose __module__ is fastattn's are rendered,
    and their signatures are strings (``from __future__ import annotations``)."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _StandInType(name, (), {"__module__": self.__name__})
        setattr(self, name, cls)
        return cls


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a _StandIn for the packages in ``tops`` and every submodule of them."""

    def __init__(self) -> None:
        self.tops: set[str] = set()

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.tops:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandIn(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _import_optional(modname: str) -> types.ModuleType:
    """modname, imported with a stand-in for each peer package it needs that is not installed
    (or does not import)."""
    finder = _StandInFinder()
    try:
        while True:
            try:
                return importlib.import_module(modname)
            except ImportError as e:
                top = (e.name or "").split(".")[0]
                if not top or top == "fastattn" or top in finder.tops:
                    raise
                # drop what the failed import left half done, then retry with the stand-in
                for name in [n for n in sys.modules if n == modname or n.startswith(modname + ".")]:
                    del sys.modules[name]
                for name in [n for n in sys.modules if n.split(".")[0] == top]:
                    del sys.modules[name]
                finder.tops.add(top)
                if finder not in sys.meta_path:
                    sys.meta_path.insert(0, finder)
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


def generate() -> str:
    import fastattn

    lines = [
        "# fastattn API reference",
        "",
        "Generated from the docstrings by `tools/gen_api_docs.py`; do not edit by hand.",
        "Conventions (B batch, Hq/Hk heads, L query length, S key length, D/Dv head dims;",
        "bool masks True = may attend; causal aligned bottom-right) are compared with",
        "torch, JAX and flash-attn in [semantics.md](semantics.md).",
        "",
        f"fastattn {fastattn.__version__}",
        "",
        "## Package `fastattn`",
        "",
    ]
    submodules = []
    for name in fastattn.__all__:
        obj = getattr(fastattn, name)
        if isinstance(obj, types.ModuleType):
            submodules.append(obj)
        elif inspect.isclass(obj):
            lines += _class(name, obj)
        elif callable(obj):
            lines += _function(name, obj)
    for mod in submodules:
        if mod.__name__ != "fastattn.reference":  # the test oracle mirrors the public signatures
            lines += _module(mod.__name__, mod)
    for modname in OPTIONAL_MODULES:
        lines += _module(modname, _import_optional(modname))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if docs/api.md differs from the docstrings")
    args = ap.parse_args(argv)
    text = generate()
    if args.check:
        try:
            with open(OUT, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = ""
        if current != text:
            print("docs/api.md is stale: run `PYTHONPATH=. python tools/gen_api_docs.py`", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
