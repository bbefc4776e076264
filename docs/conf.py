"""Sphinx configuration for the phasesched documentation (MyST Markdown, furo, autodoc)."""

from __future__ import annotations

import sys
from importlib.metadata import version as _version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))  # cli_reference: the CLI page, built from the parser

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

# No intersphinx: the build runs offline (CI has no network), with warnings as errors.
