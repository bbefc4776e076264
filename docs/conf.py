"""Sphinx configuration for the phasesched documentation (MyST Markdown, furo, autodoc)."""

from __future__ import annotations

import sys
from importlib.metadata import version as _version
from pathlib import Path

# cli_reference: the CLI page, built from the parser; reexports: `phasesched.Scheduler` links to
# `phasesched.scheduler.Scheduler`, where it is documented.
sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "phasesched"
author = "phasesched developers"
copyright = "2026, phasesched developers"
release = _version("phasesched")
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "cli_reference",
    "reexports",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"phasesched {release}"
html_static_path = ["_static"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True}
autodoc_preserve_defaults = False
# attrs classes document their fields in an "Attributes:" section; render those as fields of the
# class instead of separate attribute entries, which autodoc would document a second time.
napoleon_use_ivar = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The executor packages are documented from their __all__; their constants live, with their
# docstrings, in private submodules (docs/_ext/reexports.py).
reexport_packages = ["phasesched_torch", "phasesched_flashinfer"]

# No intersphinx: the build runs offline (CI has no network), with warnings as errors. So every
# reference must resolve, and the only names ignored are ones this documentation cannot hold.
nitpicky = True
nitpick_ignore_regex = [
    # Other projects' names (numpy and its typing internals, torch, attrs, the standard library):
    # without intersphinx they have no target here.
    ("py:.*", r"(numpy|np|torch|attrs|flashinfer)(\..+)?"),
    ("py:.*", r"(os|pathlib|collections\.abc|typing|argparse)\..+"),
    # Private or unexported helpers of the executor packages that public signatures mention.
    ("py:class", r"phasesched_\w+\._\w+\.(_\w+|\w+WrapperFactory)"),
]
nitpick_ignore = [
    # Type aliases and TypeVars: annotations spell them, but they are not documented objects.
    ("py:class", "Int32Array"),
    ("py:class", "NDArray"),
    ("py:class", "Progress"),
    ("py:class", "phasesched.registry.T"),
    # Internal state that appears in a few signatures; policies see it only through views.
    ("py:class", "RunningArrays"),
    ("py:class", "phasesched.sequence.SequenceState"),
]
