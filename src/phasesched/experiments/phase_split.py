"""Phase split: disaggregated prefill:decode ratios against aggregated replicas on as many GPUs."""

from __future__ import annotations

import time
from typing import Any

import attrs

from phasesched.experiments.bench_keys import vllm_bench_values
from phasesched.experiments.context import (
    REPRESENTATIVE_POLICIES,
    Column,
    ExperimentContext,
    Row,
    json_object,
    output_losses,
)
from phasesched.metrics.summary import RunMetrics
from phasesched.sim.arrivals import Poisson
from phasesched.sim.builders import synthetic
from phasesched.sim.deployment import Disaggregation
from phasesched.sim.lengths import LogNormal
from phasesched.sim.simulator import simulate
from phasesched.sim.workload import Workload
from phasesched.validators import typed

__all__ = ["TTFT_PHASES", "PhaseSplitConfig", "PhaseSplitResult", "run_phase_split"]

TTFT_PHASES = ("queue", "prefill", "interference", "transfer", "first_decode")
"""The latency-budget phases that make up TTFT (the budget plot stacks them)."""


def _ratios(values: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    return tuple((int(p), int(d)) for p, d in values)


@attrs.frozen
class PhaseSplitConfig:
    """Sizes of the phase-split experiment.

    Attributes:
        num_requests: Requests in the Poisson workload (200: about 17 s of traffic, thousands of
            token gaps per p99 ITL; with a run per policy and layout, this experiment is the
            suite's costliest and its size sets the suite's time).
        rate: Arrivals per second (12: about 35K prompt tokens/s, which saturates one
            prefill worker of H200 + Llama-3-8B, so the ratio matters).
        prompt_median: Median prompt (log-normal, sigma 0.8, clipped to 64..16384).
        output_median: Median output (log-normal, sigma 0.6, clipped to 8..1024).
        ratios: ``(prefill workers, decode workers)`` compared.
        link_bandwidth_gbs: KV link bandwidth between the pools.
        link_latency_s: Fixed latency of every KV transfer (20 us: an RDMA write across a
            switch; raise it to model a slower fabric or a connector's handshake).
        ttft_slo_s: Goodput's TTFT target.
        tpot_slo_s: Goodput's TPOT target.
        aggregated: Also run aggregated replicas with each ratio's GPU count.
    """

    num_requests: int = attrs.field(default=200, validator=typed(attrs.validators.gt(0)))
    rate: float = attrs.field(default=12.0, validator=typed(attrs.validators.gt(0.0)))
    prompt_median: int = attrs.field(default=2048, validator=typed(attrs.validators.gt(0)))
    output_median: int = attrs.field(default=256, validator=typed(attrs.validators.gt(0)))
    ratios: tuple[tuple[int, int], ...] = attrs.field(default=((1, 1), (1, 2), (1, 3), (2, 2)), converter=_ratios)
    link_bandwidth_gbs: float = attrs.field(default=50.0, validator=typed(attrs.validators.gt(0.0)))
    link_latency_s: float = attrs.field(default=20e-6, validator=typed(attrs.validators.ge(0.0)))
    ttft_slo_s: float = attrs.field(default=1.0, validator=typed(attrs.validators.gt(0.0)))
    tpot_slo_s: float = attrs.field(default=0.025, validator=typed(attrs.validators.gt(0.0)))
    aggregated: bool = True

    @classmethod
    def quick(cls) -> PhaseSplitConfig:
        """A small version for tests."""
        return cls(num_requests=24, rate=8.0, prompt_median=512, output_median=32, ratios=((1, 1), (1, 2)))

    def workload(self, seed: int) -> Workload:
        """The Poisson workload every configuration serves (the same for one seed)."""
        prompt = LogNormal(self.prompt_median, 0.8, lo=64, hi=16384)
        output = LogNormal(self.output_median, 0.6, lo=8, hi=1024)
        return synthetic(self.num_requests, Poisson(self.rate), prompt, output, seed=seed, name="phase-split")


@attrs.frozen(eq=False)
class PhaseSplitResult:
    """Per configuration: TTFT with its transfer part, ITL, throughput and goodput per GPU.

    Attributes:
        config: The sizes used.
        policies: Policy names, in row order.
        rows: One per ``(policy, configuration)``.
        budgets_ms: Per row label, the mean TTFT budget (``{phase: ms}`` over :data:`TTFT_PHASES`).
        wall_s: Seconds the experiment took.
    """

    config: PhaseSplitConfig
    policies: tuple[str, ...]
    rows: tuple[Row, ...]
    budgets_ms: dict[str, dict[str, float]]
    wall_s: float
    name: str = "phase_split"
    title: str = "Phase split: disaggregated P:D vs aggregated replicas on the same GPUs (Poisson load)"

    @property
    def columns(self) -> tuple[Column, ...]:
        """The terminal table's columns."""
        return (
            Column("label", "config"),
            Column("gpus", "GPUs", "d"),
            Column("mean_ttft_ms", "mean TTFT ms"),
            Column("p99_ttft_ms", "p99 TTFT ms"),
            Column("mean_transfer_ms", "transfer ms", ",.2f"),
            Column("mean_itl_ms", "mean ITL ms", ",.2f"),
            Column("p99_itl_ms", "p99 ITL ms", ",.2f"),
            Column("output_tok_s_per_gpu", "out tok/s/GPU", ",.0f"),
            Column("goodput_per_gpu", "goodput/GPU", ",.2f"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Config, rows and TTFT budgets, JSON-ready."""
        return json_object(
            {
                "experiment": self.name,
                "config": attrs.asdict(self.config),
                "rows": self.rows,
                "ttft_budget_ms": self.budgets_ms,
            }
        )


@attrs.frozen
class _Layout:
    label: str
    workers: int
    replicas: int
    disaggregation: Disaggregation | None


def _layouts(config: PhaseSplitConfig) -> list[_Layout]:
    link = (config.link_bandwidth_gbs, config.link_latency_s)
    out = [_Layout(f"{p}P:{d}D", p + d, 1, Disaggregation(p, d, *link)) for p, d in config.ratios]
    if config.aggregated:
        out += [_Layout(f"{n} replicas", n, n, None) for n in sorted({p + d for p, d in config.ratios})]
    return out


def _row(policy: str, layout: _Layout, gpus: int, metrics: RunMetrics) -> Row:
    d = layout.disaggregation
    return {
        "policy": policy,
        "label": layout.label,
        "kind": "aggregated" if d is None else "disaggregated",
        "prefill_workers": None if d is None else d.prefill_workers,
        "decode_workers": None if d is None else d.decode_workers,
        "gpus": gpus,
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "mean_ttft_ms": metrics["mean_ttft_ms"],
        "p99_ttft_ms": metrics["p99_ttft_ms"],
        "mean_transfer_ms": metrics["mean_transfer_ms"],
        "transfer_share_of_ttft": metrics["mean_transfer_ms"] / metrics["mean_ttft_ms"],
        "mean_itl_ms": metrics["mean_itl_ms"],
        "p99_itl_ms": metrics["p99_itl_ms"],
        "mean_tpot_ms": metrics["mean_tpot_ms"],
        "output_tok_s_per_gpu": metrics["output_throughput"] / gpus,
        "total_tok_s_per_gpu": metrics["total_token_throughput"] / gpus,
        "goodput_per_gpu": metrics["request_goodput"] / gpus,
        **vllm_bench_values(metrics, with_slo=True),
        **output_losses(metrics),
    }


def run_phase_split(context: ExperimentContext, config: PhaseSplitConfig | None = None) -> PhaseSplitResult:
    """Serve one Poisson workload on each P:D split and on aggregated replicas with the same GPU count.

    Holds constant: the deployment of every worker, the policy, the workload (seeded Poisson
    arrivals at ``rate``, log-normal lengths) and the SLOs goodput is counted against. Varies
    how the GPUs are used: ``P`` prefill workers and ``D`` decode workers joined by a KV link
    (TTFT then includes the KV transfer, reported from the latency budget), or ``P + D``
    aggregated replicas that each prefill and decode. Per-GPU throughput and goodput make
    configurations of different sizes comparable.

    Args:
        context: Deployment, policies (default :data:`~phasesched.experiments.context.REPRESENTATIVE_POLICIES`), seed,
            progress and backend.
        config: Sizes; :class:`PhaseSplitConfig` defaults when omitted.
    """
    config = config or PhaseSplitConfig()
    started = time.perf_counter()
    workload = config.workload(context.seed)
    policies = context.policy_names(REPRESENTATIVE_POLICIES)
    layouts = _layouts(config)
    detached = context.detached()
    tasks = [(detached, name, layout, workload, config) for name in policies for layout in layouts]
    rows: list[Row] = []
    budgets: dict[str, dict[str, float]] = {}
    # A P:D split takes about 1.5x an aggregated layout's time to simulate: the costliest runs start first.
    costs = [2 if layout.disaggregation is None else 3 for _, _, layout, _, _ in tasks]
    for row, budget in context.map("phase split", _serve, tasks, costs):
        if len(policies) > 1:
            row["label"] = f"{row['policy']} {row['label']}"
        rows.append(row)
        budgets[row["label"]] = budget
    return PhaseSplitResult(config, policies, tuple(rows), budgets, time.perf_counter() - started)


def _serve(
    context: ExperimentContext, name: str, layout: _Layout, workload: Workload, config: PhaseSplitConfig
) -> tuple[Row, dict[str, float]]:
    """One policy on one layout: its row and TTFT budget (a task for :meth:`ExperimentContext.map`)."""
    metrics = simulate(
        workload,
        context.load(name),
        context.deployment,
        replicas=layout.replicas,
        disaggregation=layout.disaggregation,
        ttft_slo_s=config.ttft_slo_s,
        tpot_slo_s=config.tpot_slo_s,
    ).metrics
    row = _row(name, layout, layout.workers * context.deployment.tensor_parallel, metrics)
    return row, {phase: metrics[f"mean_{phase}_ms"] for phase in TTFT_PHASES}
