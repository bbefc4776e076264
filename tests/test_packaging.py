"""Packaging: version from metadata, typed, and no torch on import."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import phasesched


def test_version_comes_from_metadata() -> None:
    """__version__ is the installed distribution's version."""
    assert phasesched.__version__ == metadata.version("phasesched")


def test_ships_py_typed() -> None:
    """The package is marked as typed."""
    assert (Path(phasesched.__file__).parent / "py.typed").is_file()


def test_import_does_not_import_torch() -> None:
    """Importing phasesched (and its simulator) never imports torch or flashinfer."""
    code = (
        "import sys, phasesched, phasesched.policies; import phasesched.sim; "
        "bad = [m for m in ('torch', 'flashinfer', 'matplotlib') if m in sys.modules]; print(bad); "
        "sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_names_are_documented() -> None:
    """Every name exported by phasesched has a docstring."""
    for name in phasesched.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(phasesched, name)
        assert (getattr(obj, "__doc__", None) or "").strip(), name
