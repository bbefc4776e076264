"""The vLLM integration tests need vLLM 0.32 and torch; without them only ``test_needs_vllm.py`` runs, and skips."""

from __future__ import annotations

import importlib.util

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("phasesched_vllm") is not None
if not HAS_VLLM:
    collect_ignore_glob = ["test_[!n]*.py"]  # every test module but test_needs_vllm.py


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the differential tally: workloads compared, identical to the end or stopped at a documented divergence."""
    if not HAS_VLLM:
        return
    from outcomes import OUTCOMES  # noqa: PLC0415 -- only once vLLM is known to be there

    lines = OUTCOMES.lines()
    if lines:
        terminalreporter.section("vLLM differential runs")
        for line in lines:
            terminalreporter.write_line(line)
