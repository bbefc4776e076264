"""examples/engine_loop.py with the deterministic executor: every policy, no torch needed."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from phasesched import POLICIES
from tests.fakes import load_script

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine_loop.py"


def _load_example() -> ModuleType:
    return load_script(EXAMPLE, "engine_loop_example")


@pytest.mark.parametrize("policy", POLICIES.names())
def test_every_policy_finishes_every_request(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--policy NAME --executor deterministic`` exits 0, finishes all four requests and names the policy."""
    assert _load_example().main(["--executor", "deterministic", "--policy", policy]) == 0
    out = capsys.readouterr().out
    assert out.count(" done (length)") == 4
    assert f"deterministic executor, {policy} policy" in out


def test_unknown_policy_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """An unregistered policy name is an argparse error that lists the registered ones."""
    with pytest.raises(SystemExit) as exited:
        _load_example().main(["--executor", "deterministic", "--policy", "no-such-policy"])
    assert exited.value.code == 2
    assert "sarathi" in capsys.readouterr().err
