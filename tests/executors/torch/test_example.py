"""examples/engine_loop.py runs to completion with either executor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "engine_loop.py"


@pytest.mark.parametrize(
    ("choice", "expected"), [("auto", "torch executor"), ("deterministic", "deterministic executor")]
)
def test_engine_loop_example(choice: str, expected: str) -> None:
    """The example exits 0, finishes every request, and names the executor it used."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--executor", choice], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(" done (length)") == 4
    assert expected in done.stdout
