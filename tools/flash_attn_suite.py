"""Run flash-attn's own test file (``tests/test_flash_attn.py``) on the CPU against
``fastattn.flash_compat``, as a user porting a model would: the peer's references
and tolerance rules, with only the device changed.

Usage (from anywhere; fastattn, torch and einops importable)::

    python tools/flash_attn_suite.py PATH/TO/flash-attention/tests/test_flash_attn.py \
        [--sample N] [--seed S] [-- PYTEST ARGS...]

The test file is not part of fastattn (nor of flash-attn's sdist on PyPI): take it
from a checkout of https://github.com/Dao-AILab/flash-attention (the file of the
flash-attn 2 interface; tested with the one of 2.8.3's line).  The tool builds, in a
temporary folder,

- the file with every ``"cuda"`` string replaced by ``"cpu"`` (its device; nothing else
  of it is changed);
- a ``flash_attn`` package whose functions are ``fastattn.flash_compat``'s, with
  fastattn's own implementations of the helpers the test file imports:
  ``bert_padding.pad_input``/``unpad_input`` and ``layers.rotary.apply_rotary_emb``
  (written from their documented contracts, in PyTorch), and
  ``flash_attn_interface._get_block_size_n`` (the sm80 widths, as
  ``fastattn._flash_sdmask.block_size_n``)/``USE_TRITON_ROCM``;
- a ``conftest.py`` that answers ``torch.cuda.get_device_capability`` as an sm80
  (the file's default branch: both 16-bit dtypes, every head dim) and
  ``torch.cuda.get_device_properties(...).total_memory`` with this machine's memory
  (the file skips its largest references below 16 GiB), and, with ``--sample N``,
  keeps every N-th test by a hash of its id (the file has ~10^5 cases; the hash is
  fixed, so a sample is the same on every run; ``--seed`` picks another one).

Nothing is skipped or patched beyond that: what fails is reported as pytest reports it.
The dropout tests decode ``S_dmask`` (flash-attn's encoding of the weights and of the
dropout pattern, which ``flash_compat`` returns with fastattn's own mask) and compare the
output against the reference with that mask; their check of the dropped fraction is
statistical, as in flash-attn.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

_INIT = '''\
"""fastattn.flash_compat under flash-attn's name (tools/flash_attn_suite.py)."""
from fastattn.flash_compat import *  # noqa: F401,F403
from fastattn.flash_compat import __all__  # noqa: F401
'''

_INTERFACE = """\
from fastattn._flash_sdmask import block_size_n
from fastattn.flash_compat import *  # noqa: F401,F403

USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, causal):
    # The width S_dmask's blocks are scaled by: flash-attn 2's sm80 kernel's, the device
    # the conftest reports.
    return block_size_n(head_dim, is_dropout)
"""

_BERT_PADDING = '''\
"""pad_input / unpad_input with flash-attn 2.8's contract, in PyTorch."""
import torch


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(batch, seqlen, ...) and a (batch, seqlen) mask of kept tokens -> the kept tokens
    packed (total, ...), their flat indices, cu_seqlens (int32, batch + 1), the longest
    sequence, and each sequence's length (int32)."""
    mask = attention_mask if unused_mask is None else (attention_mask + unused_mask).bool()
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=seqlens.device)
    cu[1:] = torch.cumsum(seqlens, dim=0)
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu, int(seqlens.max().item()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse: packed (total, ...) tokens scattered to (batch, seqlen, ...), zeros
    elsewhere."""
    out = torch.zeros(
        batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype,
        device=hidden_states.device,
    )
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
'''

_ROTARY = '''\
"""apply_rotary_emb with flash-attn's contract, in PyTorch (float32 arithmetic, as its
kernel; the result in x's dtype)."""
import torch


def apply_rotary_emb(
    x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
    max_seqlen=None,
):
    """x (batch, seqlen, nheads, headdim); cos, sin (seqlen_ro, rotary_dim / 2). The first
    rotary_dim features of token s of sequence b are rotated by the angles of row
    s + seqlen_offsets[b] (an int or a (batch,) tensor): pairs (x_i, x_{i + rotary_dim/2})
    (GPT-NeoX), or (x_{2i}, x_{2i+1}) when interleaved (GPT-J)."""
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb with cu_seqlens: not needed by the test file")
    batch, seqlen = x.shape[0], x.shape[1]
    half = cos.shape[-1]
    rd = 2 * half
    pos = torch.arange(seqlen, device=x.device).unsqueeze(0)
    if isinstance(seqlen_offsets, torch.Tensor):
        pos = pos + seqlen_offsets.to(torch.long).reshape(-1, 1)
    else:
        pos = pos + int(seqlen_offsets)
    pos = pos.expand(batch, seqlen)
    c = cos.float()[pos].unsqueeze(2)  # (batch, seqlen, 1, half)
    s = sin.float()[pos].unsqueeze(2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        o = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    out = x if inplace else x.clone()
    out[..., :rd] = o.to(x.dtype)
    return out
'''

_CONFTEST = """\
import os
import zlib
from types import SimpleNamespace

import torch

# The file asks the CUDA device what it is at import: answer as an sm80 with this
# machine's memory (the file skips its largest float32 references below 16 GiB).
torch.cuda.get_device_capability = lambda *a, **k: (8, 0)
_MEM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(total_memory=_MEM)

_SAMPLE = int(os.environ.get("FA_SUITE_SAMPLE", "1"))
_SEED = os.environ.get("FA_SUITE_SEED", "0")


def pytest_collection_modifyitems(config, items):
    if _SAMPLE <= 1:
        return
    keep, drop = [], []
    for item in items:
        h = zlib.crc32((_SEED + ":" + item.nodeid).encode())
        (keep if h % _SAMPLE == 0 else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
"""


def build(test_file: Path, where: Path) -> Path:
    """The test folder described in the module docstring; returns the test file's path."""
    pkg = where / "flash_attn"
    (pkg / "layers").mkdir(parents=True)
    (pkg / "__init__.py").write_text(_INIT)
    (pkg / "flash_attn_interface.py").write_text(_INTERFACE)
    (pkg / "bert_padding.py").write_text(_BERT_PADDING)
    (pkg / "layers" / "__init__.py").write_text("")
    (pkg / "layers" / "rotary.py").write_text(_ROTARY)
    tests = where / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(_CONFTEST)
    src = test_file.read_text()
    out = tests / test_file.name
    out.write_text(src.replace('"cuda"', '"cpu"').replace("'cuda'", "'cpu'"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("test_file", type=Path, help="flash-attention's tests/test_flash_attn.py")
    p.add_argument("--sample", type=int, default=1, help="keep every N-th test (by a hash of its id)")
    p.add_argument("--seed", default="0", help="which sample --sample keeps")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder and print it")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    extra = argv[cut + 1 :]
    if not a.test_file.is_file():
        p.error(f"test_file: no such file {a.test_file}")
    if a.sample < 1:
        p.error(f"--sample: expected an integer >= 1, got {a.sample}")
    where = Path(tempfile.mkdtemp(prefix="fa_suite_"))
    try:
        test = build(a.test_file, where)
        env = dict(os.environ, FA_SUITE_SAMPLE=str(a.sample), FA_SUITE_SEED=a.seed)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(where), env.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(test), *extra]
        print(textwrap.shorten(" ".join(cmd), 400), flush=True)
        return subprocess.call(cmd, cwd=where, env=env)
    finally:
        if a.keep:
            print(f"kept {where}")
        else:
            shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
