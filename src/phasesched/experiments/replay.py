"""Trace replay: one recorded (or generated) workload through several policies."""

from __future__ import annotations

import time
from typing import Any

import attrs
import numpy as np

from phasesched.errors import InvalidArgumentError
from phasesched.experiments.bench_keys import vllm_bench_values
from phasesched.experiments.context import (
    CDF_QUANTILES,
    Column,
    ExperimentContext,
    Row,
    json_object,
    output_losses,
)
from phasesched.sim.simulator import simulate
from phasesched.sim.workload import Workload
from phasesched.validators import typed

__all__ = ["DEFAULT_POLICIES", "ReplayConfig", "ReplayResult", "clipped_prompt_tokens", "prepare_trace", "run_replay"]

DEFAULT_POLICIES = ("vllm", "sarathi", "sglang", "no-chunk")
"""Compared when the context names no policies — the presets with distinct prefill/decode rules."""


@attrs.frozen(eq=False)
class ReplayConfig:
    """What is replayed.

    Attributes:
        trace: The workload (from :func:`~phasesched.sim.load_trace`, say).
        rate: Replay at this mean rate (req/s), gaps rescaled uniformly; ``None`` keeps the trace's.
        limit: Replay only the first ``limit`` requests; ``None`` replays them all.
        ttft_slo_s: Goodput's TTFT target, if any.
        tpot_slo_s: Goodput's TPOT target, if any.
        replicas: Aggregated workers serving the trace (a router sends each request to one).
    """

    trace: Workload
    rate: float | None = None
    limit: int | None = attrs.field(default=None, validator=typed(attrs.validators.optional(attrs.validators.gt(0))))
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    replicas: int = attrs.field(default=1, validator=typed(attrs.validators.gt(0)))

    def to_dict(self) -> dict[str, Any]:
        """The replay's settings, JSON-ready (the trace by name and size)."""
        return {
            "trace": self.trace.name,
            "trace_requests": len(self.trace),
            "rate": self.rate,
            "limit": self.limit,
            "ttft_slo_s": self.ttft_slo_s,
            "tpot_slo_s": self.tpot_slo_s,
            "replicas": self.replicas,
        }


@attrs.frozen(eq=False)
class ReplayResult:
    """Per policy: the ``vllm bench serve`` summary of the replay, prefix-cache use, and TTFT/ITL distributions.

    Each row also holds ``prefix_hit_rate`` (cached prompt tokens per prompt token looked up at
    admission; 0 with the cache off) and ``cached_tokens`` (prompt tokens claimed from the cache
    instead of computed), summed over the deployment's workers.

    Attributes:
        config: What was replayed.
        workload: The workload actually served (limited, rescaled, prompts clipped).
        clipped: Requests whose prompt was cut to fit the deployment's ``max_model_len``.
        clipped_tokens: The prompt tokens those cuts removed.
        policies: Policy names, in row order.
        rows: One per policy.
        cdf_ms: Per policy, ``{"ttft": [...], "itl": [...]}``: milliseconds at percentiles 0..100.
        wall_s: Seconds the experiment took.
    """

    config: ReplayConfig
    workload: Workload
    clipped: int
    policies: tuple[str, ...]
    rows: tuple[Row, ...]
    cdf_ms: dict[str, dict[str, list[float]]]
    wall_s: float
    clipped_tokens: int = 0
    name: str = "replay"

    @property
    def title(self) -> str:
        """The table heading, naming the trace and rate."""
        rate = self.workload.rate
        title = f"Replay of {self.workload.name}: {len(self.workload):,} requests at {rate:,.2f} req/s"
        if self.config.replicas > 1:
            title += f" on {self.config.replicas} replicas"
        if self.clipped:
            title += f" ({self.clipped:,} prompts clipped to fit, {self.clipped_tokens:,} prompt tokens cut)"
        return title

    @property
    def columns(self) -> tuple[Column, ...]:
        """The terminal table's columns."""
        return (
            Column("policy", "policy"),
            Column("completed", "done", ",d"),
            Column("failed", "failed", ",d"),
            Column("mean_ttft_ms", "mean TTFT ms"),
            Column("p99_ttft_ms", "p99 TTFT ms"),
            Column("median_itl_ms", "median ITL ms", ",.2f"),
            Column("p99_itl_ms", "p99 ITL ms", ",.2f"),
            Column("mean_e2el_ms", "mean E2E ms", ",.0f"),
            Column("input_tok_s", "prompt tok/s", ",.0f"),
            Column("output_tok_s", "gen tok/s", ",.0f"),
            Column("preemptions", "preempt", ",d"),
            Column("prefix_hit_rate", "cache hit rate", ".3f"),
            Column("cached_tokens", "cached tokens", ",d"),
            Column("truncated_outputs", "cut outputs", ",d"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Settings, rows and CDFs, JSON-ready."""
        return json_object(
            {
                "experiment": self.name,
                "config": self.config.to_dict(),
                "served_requests": len(self.workload),
                "served_rate": self.workload.rate,
                "clipped_prompts": self.clipped,
                "clipped_prompt_tokens": self.clipped_tokens,
                "rows": self.rows,
                "cdf_ms": self.cdf_ms,
            }
        )


def prepare_trace(config: ReplayConfig, max_model_len: int) -> tuple[Workload, int]:
    """The workload to serve: the first ``limit`` rows, at ``rate``, prompts clipped to fit.

    A prompt longer than the context cannot be served at all (the scheduler rejects it), so it
    is cut to ``max_model_len - 1`` tokens, leaving room for one generated token; the count of
    such rows is returned so the report can say how many there were.
    """
    workload = config.trace if config.limit is None else config.trace.head(config.limit)
    if config.rate is not None:
        workload = workload.scaled_to_rate(config.rate)
    clipped = int(np.count_nonzero(workload.prompt_len > max_model_len - 1))
    return workload.clip_lengths(max_prompt=max_model_len - 1), clipped


def clipped_prompt_tokens(workload: Workload, max_model_len: int) -> int:
    """Prompt tokens :func:`prepare_trace` cuts from ``workload`` to fit ``max_model_len``."""
    return int(np.maximum(workload.prompt_len - (max_model_len - 1), 0).sum())


def run_replay(context: ExperimentContext, config: ReplayConfig) -> ReplayResult:
    """Replay a trace through each policy.

    Holds constant: the deployment, the requests (arrival times, prompt and output lengths
    exactly as recorded, after the optional limit, rate rescaling and prompt clipping) and the
    SLOs. Only the policy varies, so differences are the scheduling's alone.

    Args:
        context: Deployment, policies (default :data:`DEFAULT_POLICIES`), seed and progress;
            progress is reported per request, one task per policy.
        config: The trace and how to replay it.

    Raises:
        InvalidArgumentError: The trace is empty, or ``rate`` is given for a trace without one.
    """
    started = time.perf_counter()
    workload, clipped = prepare_trace(config, context.deployment.max_model_len)
    if len(workload) == 0:
        msg = f"trace {config.trace.name!r} has no requests to replay"
        raise InvalidArgumentError(msg)
    policies = context.policy_names(DEFAULT_POLICIES)
    rows: list[Row] = []
    cdfs: dict[str, dict[str, list[float]]] = {}
    for name in policies:
        task = f"replay {name}"
        context.report(task, 0, len(workload))
        result = simulate(
            workload,
            context.load(name),
            context.deployment,
            replicas=config.replicas,
            ttft_slo_s=config.ttft_slo_s,
            tpot_slo_s=config.tpot_slo_s,
            progress=lambda done, total, t=task: context.report(t, done, total),
        )
        metrics = result.metrics
        rows.append(
            {
                "policy": name,
                "gpus": config.replicas * context.deployment.tensor_parallel,
                "completed": metrics["completed"],
                "failed": metrics["failed"],
                "errors": list(metrics.errors),
                "mean_ttft_ms": metrics["mean_ttft_ms"],
                "p99_ttft_ms": metrics["p99_ttft_ms"],
                "median_itl_ms": metrics["median_itl_ms"],
                "p99_itl_ms": metrics["p99_itl_ms"],
                "mean_e2el_ms": metrics["mean_e2el_ms"],
                "input_tok_s": metrics["input_throughput"],
                "output_tok_s": metrics["output_throughput"],
                "preemptions": metrics["num_preemptions"],
                "prefix_hit_rate": result.prefix_cache.hit_rate,
                "cached_tokens": result.prefix_cache.hits,
                **output_losses(metrics),
                "sim_wall_s": result.wall_s,
                **vllm_bench_values(metrics, with_slo=config.ttft_slo_s is not None or config.tpot_slo_s is not None),
            }
        )
        cdfs[name] = {
            key: [float(v) * 1e3 for v in metrics.distributions[key].percentiles(CDF_QUANTILES)]
            for key in ("ttft", "itl")
        }
    served = config.trace if config.limit is None else config.trace.head(config.limit)
    cut = clipped_prompt_tokens(served, context.deployment.max_model_len)
    return ReplayResult(config, workload, clipped, policies, tuple(rows), cdfs, time.perf_counter() - started, cut)
