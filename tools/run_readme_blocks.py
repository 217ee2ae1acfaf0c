"""Run every ```python block of README.md and docs/guide.md, each as pasted, in a fresh process.

    python tools/run_readme_blocks.py                 # README.md and docs/guide.md
    python tools/run_readme_blocks.py README.md -k kv  # some files; blocks whose text contains "kv"

Each block runs in its own ``python`` subprocess (this interpreter) with a temporary directory as
its working directory, so ``import fastattn`` finds the installed package, not the checkout (the
environment is passed through unchanged: a ``PYTHONPATH`` you set still applies).  A block whose
first line is ``# needs: NAME[, NAME...]`` is skipped, with the reason printed, when one of the
named modules is not importable; ``cuda`` stands for a GPU that ``fastattn.cuda`` can use.  Any
other failure (an exception, a non-zero exit, a block over the time limit) fails the run.  Exit
status: 0 when every block passed or was skipped, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = ("README.md", "docs/guide.md")
# A fence line opens a block only at the start of a line: ```python, then the block up to the next ```.
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NEEDS = re.compile(r"^#\s*needs:\s*(.+?)\s*$")


@dataclass
class Block:
    path: str
    line: int  # 1-based line of the opening fence
    code: str

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def extract(path: Path, label: str) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    return [Block(label, text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


def needs(block: Block) -> list[str]:
    first = block.code.lstrip("\n").split("\n", 1)[0]
    m = NEEDS.match(first)
    return [n.strip() for n in m.group(1).split(",") if n.strip()] if m else []


def missing(names: list[str], env: dict[str, str]) -> str | None:
    """The reason to skip, or None when every named requirement is met."""
    for name in names:
        if name == "cuda":
            # In a child: fastattn.cuda must be importable and see a GPU.
            probe = "import sys, fastattn.cuda as c; sys.exit(0 if c.is_built() and c.is_available() else 1)"
            cwd = tempfile.gettempdir()
            r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, cwd=cwd)
            if r.returncode != 0:
                return "needs cuda: no CUDA build of fastattn or no GPU"
        elif importlib.util.find_spec(name) is None:
            return f"needs {name}: not importable"
    return None


def run(block: Block, timeout: float, env: dict[str, str]) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory(prefix="readme_block_") as tmp:
        script = Path(tmp) / "block.py"
        script.write_text(block.code, encoding="utf-8")
        t0 = time.perf_counter()
        try:
            cmd = [sys.executable, str(script)]
            r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
        dt = time.perf_counter() - t0
        output = (r.stdout + r.stderr).strip()
        if r.returncode != 0:
            output += f"\n(exit status {r.returncode})"
        return r.returncode == 0, output.strip(), dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help=f"Markdown files (default: {', '.join(DEFAULT_FILES)})")
    p.add_argument("-k", default=None, help="run only blocks whose text contains this string")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per block (default 120)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each block's output")
    args = p.parse_args(argv)

    files = args.files or [f for f in DEFAULT_FILES if (ROOT / f).exists()]
    blocks: list[Block] = []
    for f in files:
        # relative to the current directory, else to the repository root
        path = Path(f) if Path(f).is_absolute() or Path(f).exists() else ROOT / f
        if not path.exists():
            print(f"no such file: {f}", file=sys.stderr)
            return 1
        blocks += extract(path, f)
    if args.k:
        blocks = [b for b in blocks if args.k in b.code]
    if not blocks:
        print("no ```python blocks found", file=sys.stderr)
        return 1

    env = dict(os.environ)  # passed through as is (PYTHONPATH included)
    env.setdefault("MPLBACKEND", "Agg")  # a block that plots must not need a display
    t_all = time.perf_counter()
    passed, skipped, failed = [], [], []
    for b in blocks:
        reason = missing(needs(b), env)
        if reason is not None:
            print(f"SKIP {b.name} ({reason})", flush=True)
            skipped.append(b)
            continue
        ok, output, dt = run(b, args.timeout, env)
        if ok:
            print(f"PASS {b.name} ({dt:.1f} s)", flush=True)
            passed.append(b)
            if args.verbose and output:
                print("    " + output.replace("\n", "\n    "))
        else:
            print(f"FAIL {b.name} ({dt:.1f} s)", flush=True)
            print("    " + (output or "(no output)").replace("\n", "\n    "), flush=True)
            failed.append(b)
    total = time.perf_counter() - t_all
    print(
        f"\n{len(blocks)} blocks: {len(passed)} passed, {len(skipped)} skipped, {len(failed)} failed"
        f" in {total:.1f} s"
    )
    for b in failed:
        print(f"  failed: {b.name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
