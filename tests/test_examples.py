"""Every example runs, as a user would run it (small sizes to keep CI fast)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_every_example_is_covered() -> None:
    """A new example cannot be added without a test that runs it."""
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == {"engine_loop.py", "replay_trace.py", "disaggregation_what_if.py", "pd_runtime.py"}
    # pd_runtime.py needs phasesched-torch: tests/executors/torch/test_pd.py runs it


def test_replay_trace(tmp_path: Path) -> None:
    """The trace replay prints a row per policy and writes its plot."""
    out = run("replay_trace.py", "--minutes", "1", "--policies", "vllm,sarathi", "--output", str(tmp_path))
    assert "sarathi" in out
    assert (tmp_path / "replay_trace.png").read_bytes().startswith(b"\x89PNG")


def test_disaggregation_what_if() -> None:
    """The what-if compares aggregated replicas with disaggregated pools at each bandwidth."""
    out = run("disaggregation_what_if.py", "--requests", "150", "--bandwidths", "10,100")
    assert "2 aggregated replicas" in out
    assert "1P+1D @ 10 GB/s" in out
    assert "1P+1D @ 100 GB/s" in out


@pytest.mark.skipif(importlib.util.find_spec("phasesched_sjf") is None, reason="examples/custom_policy not installed")
def test_custom_policy_plugin_is_registered() -> None:
    """The example plugin package registers 'sjf' through the entry point and it serves requests."""
    from phasesched import load_policy  # noqa: PLC0415
    from phasesched.sim import fixed, simulate  # noqa: PLC0415

    policy = load_policy("sjf")
    assert policy.name == "sjf"
    assert simulate(fixed(10, 300, 5, rate=50.0), policy).metrics["completed"] == 10


def test_engine_loop_on_the_deterministic_executor() -> None:
    """The engine loop runs as a user would start it without torch: every request finishes."""
    out = run("engine_loop.py", "--executor", "deterministic", "--policy", "vllm")
    assert out.count(" done (length)") == 4
