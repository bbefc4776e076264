"""A configuration's capacity: the highest request rate at which it still meets the SLO.

Sarathi-Serve and Vidur-Search define capacity this way and find it by bisection on the rate;
so does :func:`find_capacity`. The workload keeps its arrival pattern and lengths and only its
clock is rescaled (:meth:`~phasesched.sim.workload.Workload.scaled_to_rate`), so burstiness
is the trace's own at every rate. Each probe is one simulation, a pure function of
(workload, candidate, deployment, rate): the same inputs give the same capacity in any process.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from phasesched.experiments.context import ExperimentContext
from phasesched.metrics.summary import RunMetrics
from phasesched.sim.simulator import simulate
from phasesched.sim.workload import Workload
from phasesched.slo import SLO, SLOVerdict
from phasesched.tune.space import Candidate

__all__ = ["CapacityConfig", "Probe", "find_capacity", "probe"]

KEPT_KEYS = (
    "completed",
    "failed",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "num_preemptions",
)
"""Results keys a probe keeps (enough for the ranked table and the evidence)."""


@attrs.frozen
class CapacityConfig:
    """How the bisection runs.

    Attributes:
        start_rate: First rate tried per worker (req/s); doubled or halved until it brackets.
        tolerance: Stop when the bracket is narrower than this fraction of its upper end.
        max_probes: Simulations at most per candidate.
        link_bandwidth_gbs: KV link of P:D splits.
    """

    start_rate: float = attrs.field(default=1.0, validator=attrs.validators.gt(0.0))
    tolerance: float = attrs.field(default=0.05, validator=[attrs.validators.gt(0.0), attrs.validators.lt(1.0)])
    max_probes: int = attrs.field(default=12, validator=attrs.validators.gt(1))
    link_bandwidth_gbs: float = attrs.field(default=50.0, validator=attrs.validators.gt(0.0))


@attrs.frozen
class Probe:
    """One simulation at one rate.

    Attributes:
        rate: Offered request rate (req/s).
        verdict: How the run fared against the SLO.
        values: The kept results keys (``KEPT_KEYS``); of the requests finished so far when
            the run stopped early.
        stopped_early: The run ended once it could no longer meet the SLO.
    """

    rate: float
    verdict: SLOVerdict
    values: dict[str, float]
    stopped_early: bool = False


def probe(context: ExperimentContext, candidate: Candidate, workload: Workload, slo: SLO, rate: float) -> Probe:
    """Serve ``workload`` at ``rate`` with ``candidate`` and judge it against ``slo``.

    The simulation stops as soon as more requests have missed the per-request targets than
    the SLO allows (:meth:`SLO.max_misses`): the verdict is then already "fails", and an
    overloaded run, whose queue only grows, is the costliest to simulate to its end.
    """
    allowed = slo.max_misses(len(workload))
    result = simulate(
        workload.scaled_to_rate(rate),
        context.load(candidate.policy, **candidate.overrides()),
        context.deployment,
        replicas=candidate.layout.replicas or 1,
        disaggregation=candidate.layout.disaggregation(),
        ttft_slo_s=slo.ttft_s,
        tpot_slo_s=slo.tpot_s,
        stop_after_missed=allowed,
    )
    metrics: RunMetrics = result.metrics
    values = {key: float(metrics.values[key]) for key in KEPT_KEYS}
    if result.stopped_early:  # more than ``allowed`` missed: it attains less than the rest
        assert allowed is not None
        bound = (len(workload) - allowed - 1) / len(workload)
        return Probe(rate, SLOVerdict(bound, meets=False), values, stopped_early=True)
    return Probe(rate, slo.judge(metrics.values), values)


def find_capacity(
    context: ExperimentContext, candidate: Candidate, workload: Workload, slo: SLO, config: CapacityConfig
) -> tuple[Probe | None, tuple[Probe, ...]]:
    """Bisect on the rate for the highest one that meets ``slo``.

    Returns:
        The best passing probe (``None`` when even the lowest rate tried fails) and every probe, in order.
    """
    probes: list[Probe] = []

    def run(rate: float) -> Probe:
        probes.append(probe(context, candidate, workload, slo, rate))
        return probes[-1]

    rate = config.start_rate * candidate.layout.workers
    passing = run(rate)
    good: Probe | None = passing if passing.verdict.meets else None
    bad: Probe | None = None if passing.verdict.meets else passing
    while len(probes) < config.max_probes and (good is None or bad is None):  # bracket by doubling or halving
        step = run(rate * 2 if bad is None else rate / 2)
        rate = step.rate
        good, bad = (step, bad) if step.verdict.meets else (good, step)
        if good is None and rate < config.start_rate / 64:
            return None, tuple(probes)
    while good is not None and bad is not None and len(probes) < config.max_probes:
        if bad.rate - good.rate <= config.tolerance * bad.rate:
            break
        step = run(math.sqrt(good.rate * bad.rate))
        good, bad = (step, bad) if step.verdict.meets else (good, step)
    return good, tuple(probes)


def describe_probe(found: Probe | None) -> dict[str, Any]:
    """A probe's numbers for a table row (``None`` values when there is none)."""
    if found is None:
        return {"capacity_rps": 0.0, "attainment": None, **dict.fromkeys(KEPT_KEYS)}
    return {"capacity_rps": found.rate, "attainment": found.verdict.attainment, **found.values}
