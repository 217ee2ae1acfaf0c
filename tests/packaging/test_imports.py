"""The package's import graph has no cycle.

The graph is read from the source (the AST of every ``fastattn/*.py``), so it
includes the imports inside functions, which run later and would hide a cycle
from an import-time test: ``from . import x``, ``from .x import y``,
``import fastattn.x`` and ``importlib.import_module(".x", ...)`` with a
constant name, wherever they appear.  Edges go to the package's Python modules
only (the compiled extensions import nothing of the package).  The package
itself (``__init__``) is left out: importing any submodule imports it first
anyway, and it is the root that imports the public modules.
"""

from __future__ import annotations

import ast
import os

import fastattn

PKG_DIR = os.path.dirname(os.path.abspath(fastattn.__file__))
PKG = "fastattn"


def _modules(pkg_dir: str) -> dict[str, list[str]]:
    """module name (without the package) -> paths: a module's .py file, or every .py
    file of a subpackage (fastattn.bench, fastattn.dask: one node each)."""
    mods: dict[str, list[str]] = {}
    for f in sorted(os.listdir(pkg_dir)):
        path = os.path.join(pkg_dir, f)
        if f.endswith(".py") and f != "__init__.py":
            mods[f[:-3]] = [path]
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            mods[f] = [os.path.join(path, g) for g in sorted(os.listdir(path)) if g.endswith(".py")]
    return mods


def _imported(tree: ast.AST, known: set[str], sub: str | None = None) -> set[str]:
    """The package modules (names in known) that the code in tree imports; ``sub``: the
    subpackage the code is in (its relative imports are one level deeper)."""
    out: set[str] = set()
    if sub is not None:  # from . (the subpackage itself) / from .. (the package)
        out |= _imported(_shift_levels(tree), known)
        return out

    def add(dotted: str) -> None:
        first = dotted.split(".")[0]
        if first in known:
            out.add(first)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import a, b
                for alias in node.names:
                    add(alias.name)
            elif node.level == 1:  # from .a import b
                add(node.module or "")
            elif node.level == 0 and node.module and node.module.startswith(PKG + "."):
                rest = node.module[len(PKG) + 1 :]
                add(rest)
            elif node.level == 0 and node.module == PKG:  # from fastattn import a
                for alias in node.names:
                    add(alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PKG + "."):
                    add(alias.name[len(PKG) + 1 :])
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                target = node.args[0].value
                if isinstance(target, str):
                    if target.startswith("."):
                        add(target[1:])
                    elif target.startswith(PKG + "."):
                        add(target[len(PKG) + 1 :])
    return out


def _shift_levels(tree: ast.AST) -> ast.AST:
    """A subpackage file's relative imports as seen from the package: ``from .. import
    a`` is the package's ``from . import a``; ``from . import x`` (the subpackage's own
    modules) is dropped (an edge to itself)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level == 1:
                node.names, node.module, node.level = [], None, 1
            else:
                node.level -= 1
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                target = node.args[0].value
                if isinstance(target, str) and target.startswith("."):
                    node.args[0].value = target[1:] if target.startswith("..") else "x"
    return tree


def import_graph(pkg_dir: str = PKG_DIR) -> dict[str, set[str]]:
    mods = _modules(pkg_dir)
    graph = {}
    for name, paths in mods.items():
        graph[name] = set()
        for path in paths:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            sub = None if os.path.normpath(os.path.dirname(path)) == os.path.normpath(pkg_dir) else name
            graph[name] |= _imported(tree, set(mods), sub)
        graph[name] -= {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = GREY
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if color.get(m, BLACK) == GREY:
                return stack[stack.index(m) :] + [m]
            if color.get(m) == WHITE:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        color[n] = BLACK
        return None

    for n in sorted(graph):
        if color[n] == WHITE:
            found = visit(n)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    # The graph is real: the layers it must see are there.
    assert "_args" in graph["functional"] and "_config" in graph["_args"]
    assert "_args" in graph["kvcache"] and "functional" in graph["hf"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_function_level_imports(tmp_path):
    # A cycle closed only by an import inside a function (what the package once had:
    # _config.config() imported fastattn.cuda, which imports back).
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import x\n    return x\n")
    (tmp_path / "c.py").write_text("import fastattn.a\nx = 1\n")
    (tmp_path / "d.py").write_text("import importlib\nm = importlib.import_module('.a', __package__)\n")
    graph = import_graph(str(tmp_path))
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (tmp_path / "b.py").write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(str(tmp_path))) is None


def test_a_subpackage_is_one_node(tmp_path):
    # fastattn.bench and fastattn.dask are packages: their files' imports are the
    # node's, ``from .. import x`` is the package's x, ``from . import y`` their own.
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("def f():\n    from .sub import g\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("from . import inner\n")
    (tmp_path / "sub" / "inner.py").write_text("from .. import b\nfrom ..c import x\nfrom .other import y\n")
    (tmp_path / "b.py").write_text("")
    (tmp_path / "c.py").write_text("import fastattn.a\nx = 1\n")
    graph = import_graph(str(tmp_path))
    assert graph == {"a": {"sub"}, "b": set(), "c": {"a"}, "sub": {"b", "c"}}
    assert find_cycle(graph) == ["a", "sub", "c", "a"]


def _package_files(pkg_dir: str = PKG_DIR) -> list[str]:
    return [path for paths in _modules(pkg_dir).values() for path in paths] + [
        os.path.join(pkg_dir, "__init__.py")
    ]


def _docstring_lines(tree: ast.AST) -> set[int]:
    """The line numbers of the module's, classes' and functions' docstrings."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
            ):
                if isinstance(body[0].value.value, str):
                    lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return lines


def test_no_module_is_over_600_lines():
    # Issue #19: a module that outgrows this is split along its seams.  Docstrings do
    # not count (issue 45: numpydoc Parameters / Returns / Examples on every public name
    # made the documented modules longer, not their code).
    sizes = {}
    for path in _package_files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        doc = _docstring_lines(ast.parse(text))
        sizes[os.path.relpath(path, PKG_DIR)] = sum(
            1 for n, _ in enumerate(text.splitlines(), 1) if n not in doc
        )
    assert "dask/__init__.py" in sizes and "bench/__init__.py" in sizes  # subpackages are read
    big = {p: n for p, n in sizes.items() if n > 600}
    assert not big, f"modules over 600 lines: {big}"


def _private_uses(tree: ast.AST) -> list[str]:
    """``from .mod import _name`` and ``mod._name`` where mod is a package module:
    one module reaching into another's private helpers."""
    modules: set[str] = set()  # local names bound to package modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or node.module == PKG):
            if node.module is None or node.module == PKG:  # from . import mod [as m]
                modules.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.asname and a.name.startswith(PKG + "."))
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (node.level or node.module.startswith(PKG + "."))
        ):
            found += [f"from {node.module} import {a.name}" for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in modules and _is_private(node.attr):
                found.append(f"{node.value.id}.{node.attr}")
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_helpers():
    # Issue #19: what another module uses is public there (a private module, _args,
    # may have public names); a private alias of a public name is fine.
    found = {}
    for path in _package_files():
        with open(path, encoding="utf-8") as f:
            uses = _private_uses(ast.parse(f.read(), path))
        if uses:
            found[os.path.relpath(path, PKG_DIR)] = uses
    assert not found, found


def test_the_private_use_finder():
    tree = ast.parse(
        "from . import positions, _args as a\nfrom ._args import x as _x, _y\n"
        "import fastattn.kvcache as kv\nz = positions._Rot, a._p, a.ok, kv._c, other._d\n"
    )
    assert sorted(_private_uses(tree)) == ["a._p", "from _args import _y", "kv._c", "positions._Rot"]
