"""Settings shared by the whole suite.

Hypothesis' default deadline (200 ms per example) and its too-slow health check measure wall
time, so a busy machine fails them at random; tests here assert behaviour, never speed
(``benchmarks/`` measures that). The ``phasesched`` profile drops both, and is loaded for
every run; a test's own ``@settings`` still sets its example count.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

import phasesched.scheduler

settings.register_profile("phasesched", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("phasesched")


@pytest.fixture(autouse=True)
def _mixed_cores_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let mixed steps build their decode core however few requests run.

    The library builds one only from ``_MIXED_CORE_MIN`` running requests (below that the step
    is worked out afresh, as cheaply); the suite's workloads are small, and the tests that hold
    the mixed path to the policy's plans must reach it. ``tests/test_mixed_fast_path.py`` also
    runs them with small thresholds, so steps switch between the two paths, and with no core.
    """
    monkeypatch.setattr(phasesched.scheduler, "_MIXED_CORE_MIN", 0)
