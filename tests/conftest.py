"""Settings shared by the whole suite.

Hypothesis' default deadline (200 ms per example) and its too-slow health check measure wall
time, so a busy machine fails them at random; tests here assert behaviour, never speed
(``benchmarks/`` measures that). The ``phasesched`` profile drops both, and is loaded for
every run; a test's own ``@settings`` still sets its example count.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("phasesched", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("phasesched")
