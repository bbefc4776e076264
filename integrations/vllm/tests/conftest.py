"""The vLLM integration tests need vLLM 0.32 (and torch); without them the whole folder is skipped."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter tests need vLLM (integrations/vllm/ci.sh builds a venv)")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the differential tally: workloads compared, identical to the end or stopped at a documented divergence."""
    from outcomes import OUTCOMES  # noqa: PLC0415 -- only once vLLM is known to be there

    lines = OUTCOMES.lines()
    if lines:
        terminalreporter.section("vLLM differential runs")
        for line in lines:
            terminalreporter.write_line(line)
