"""Sphinx configuration for the fastattn documentation site.

Sphinx + numpydoc + pydata-sphinx-theme is what NumPy, SciPy and scikit-learn use, so the
site reads like theirs and the docstrings follow their numpydoc convention; MyST-Parser
lets the existing Markdown pages (semantics, performance, hardening) join the site as
they are.

Build (tools/check_docs.sh runs both, with warnings as errors):

    python -P -m sphinx -W --keep-going -b html docs <tmp>/html
    python -P -m sphinx -W --keep-going -b doctest docs <tmp>/doctest

This file puts nothing on sys.path on purpose: the API reference and the doctests are
built from the fastattn that Python imports, the installed package in CI (PYTHONPATH=.
for a source tree with the extension built in place).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pathlib
import types
from typing import Any

import fastattn

project = "fastattn"
author = "the fastattn developers"
copyright = "the fastattn developers"  # noqa: A001 (Sphinx's name)
release = fastattn.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# api.md is the plain-text reference that tools/gen_api_docs.py writes for readers of the
# repository; the site has its own, built from the same docstrings (api/).
# guide.md (the user guide moved out of the README) links to files outside docs/ by
# their absolute repository URLs.
exclude_patterns = ["_build", "api.md", "requirements.txt"]

# MyST: ```{doctest} fences in the Markdown pages, $…$ maths, anchors for the
# headings so that pages can link to each other's sections.
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# autodoc / autosummary: the API pages list names explicitly (docs/api/*.rst), so
# autosummary makes tables only and writes no stub files into the source tree.
autosummary_generate = False
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types, readably
autodoc_preserve_defaults = True
# The optional peers some public modules import (torch_compat imports torch, fastattn.dask
# imports dask): mocked only where they are not installed, so the reference still builds
# from the docstrings; the doctests never call them.
autodoc_mock_imports = [
    m for m in ("torch", "dask", "distributed", "jax", "transformers") if importlib.util.find_spec(m) is None
]

# numpydoc: members are listed by autodoc's :members:, not by numpydoc's own tables
# (which would need autosummary stubs).
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# numpydoc checks that a docstring has Parameters (for every argument), Returns and
# Examples, and -W turns a gap into a failed build.  The check covers the names listed
# here, which have all three; add a name once its docstring does (issue 45 item 2: the
# rest still carry their reference in prose).  Properties and the rest are not checked.
NUMPYDOC_VALIDATED = [
    "fastattn.scaled_dot_product_attention",
    "fastattn.scaled_dot_product_attention_backward",
    "fastattn.varlen_attention",
    "fastattn.merge_attention_states",
    "fastattn.attention_weights",
    "fastattn.KVCache",
    "fastattn.KVCache.append",
    "fastattn.KVCache.attend",
    "fastattn.attention_with_kvcache",
    "fastattn.quantize_kv",
    "fastattn.show_config",
    "fastattn.get_num_threads",
    "fastattn.set_num_threads",
    "fastattn.get_isa",
    "fastattn.set_isa",
    "fastattn.get_float32_matmul_precision",
    "fastattn.set_float32_matmul_precision",
    "fastattn.get_tiles",
    "fastattn.set_tiles",
    "fastattn.additive_attention",
    "fastattn.lsh_attention",
    "fastattn.sinusoidal_positions",
    "fastattn.rotary_cos_sin",
    "fastattn.apply_rotary",
    "fastattn.plot_attention_weights",
    "fastattn.MultiHeadAttention",
    "fastattn.MultiHeadAttention.__call__",
    "fastattn.MultiHeadAttention.state_dict",
    "fastattn.MultiHeadAttention.load_state_dict",
    "fastattn.MultiHeadAttention.from_torch",
    "fastattn.KVCache.crop",
    "fastattn.KVCache.reorder_cache",
    "fastattn.KVCache.get_seq_length",
    "fastattn.KVCache.reset",
    "fastattn.dot_product_attention",
    "fastattn.jax_compat.dot_product_attention",
    "fastattn.flash_compat.flash_attn_func",
    "fastattn.flash_compat.flash_attn_qkvpacked_func",
    "fastattn.flash_compat.flash_attn_kvpacked_func",
    "fastattn.flash_compat.flash_attn_varlen_func",
    "fastattn.flash_compat.flash_attn_varlen_qkvpacked_func",
    "fastattn.flash_compat.flash_attn_varlen_kvpacked_func",
    "fastattn.flash_compat.flash_attn_with_kvcache",
    "fastattn.reference.scaled_dot_product_attention",
    "fastattn.reference.varlen_attention",
    "fastattn.reference.additive_attention",
    "fastattn.reference.lsh_attention",
    "fastattn.reference.sinusoidal_positions",
    "fastattn.reference.rotary_cos_sin",
    "fastattn.reference.apply_rotary",
    "fastattn.reference.attention_weights",
    "fastattn.sparse.strided_pattern",
    "fastattn.sparse.fixed_pattern",
    "fastattn.sparse.local_global_pattern",
    "fastattn.sparse.to_dense",
    "fastattn.torch_compat.scaled_dot_product_attention",
    "fastattn.hf.register",
    "fastattn.hf.attention_forward",
    "fastattn.cuda.is_built",
    "fastattn.cuda.is_available",
    "fastattn.cuda.build_info",
    "fastattn.cuda.scaled_dot_product_attention",
    "fastattn.cuda.to_device",
    "fastattn.cuda.synchronize",
    "fastattn.cuda.DeviceArray",
    "fastattn.cuda.DeviceArray.get",
    "fastattn.dask.scaled_dot_product_attention",
    "fastattn.dask.varlen_attention",
    "fastattn.KVCache.batch",
    "fastattn.KVCache.num_kv_heads",
    "fastattn.KVCache.max_len",
    "fastattn.KVCache.capacity",
    "fastattn.KVCache.head_dim",
    "fastattn.KVCache.value_dim",
    "fastattn.KVCache.dtype",
    "fastattn.KVCache.lengths",
    "fastattn.KVCache.nbytes",
    "fastattn.KVCache.k",
    "fastattn.KVCache.v",
    "fastattn.MultiHeadAttention.kv_dim",
]
numpydoc_validation_checks = {"PR01", "PR02", "RT01", "EX01"}
numpydoc_validation_exclude = {"^(?!(" + "|".join(n.replace(".", r"\.") for n in NUMPYDOC_VALIDATED) + ")$)"}

# Doctests: every Examples section and every ```{doctest} block in the pages runs under
# `-b doctest`; one that fails fails the build.
doctest_global_setup = "import numpy as np\nimport fastattn\n"
doctest_default_flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.DONT_ACCEPT_TRUE_FOR_1

html_theme = "pydata_sphinx_theme"
html_title = f"fastattn {release}"
html_theme_options = {
    "github_url": "https://github.com/fastattn/fastattn",
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_static_path: list[str] = []


# Every public name must be on an API page: the modules' __all__ against the pages' text.
PUBLIC_MODULES = [
    "fastattn",
    "fastattn.torch_compat",
    "fastattn.flash_compat",
    "fastattn.jax_compat",
    "fastattn.hf",
    "fastattn.dask",
    "fastattn.cuda",
    "fastattn.reference",
    "fastattn.sparse",
]


def _check_api_pages(app: Any) -> None:
    from sphinx.util import logging

    log = logging.getLogger("fastattn.docs")
    api = pathlib.Path(app.srcdir) / "api"
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(api.glob("*.rst")))
    for modname in PUBLIC_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:  # an optional peer missing (mocked for autodoc)
            log.info("not checking %s's names: %s", modname, e)
            continue
        for name in getattr(mod, "__all__", []):
            if name == "__version__" or isinstance(getattr(mod, name, None), types.ModuleType):
                continue
            if f"{modname}.{name}" not in text:
                log.warning("%s.%s is public (in __all__) but on no page under docs/api/", modname, name)


def setup(app: Any) -> None:
    app.connect("builder-inited", _check_api_pages)
