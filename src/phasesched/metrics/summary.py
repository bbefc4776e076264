"""Run-level results, with the key names of ``vllm bench serve`` so they drop into its dashboards."""

from __future__ import annotations

import math
from typing import Any

import attrs

from phasesched.metrics.distribution import Distribution
from phasesched.metrics.recorder import BUDGET_PHASES, GapLog, RequestRecord, RunCounters

__all__ = ["PERCENTILES", "RunMetrics", "summarize"]

PERCENTILES = (50, 90, 95, 99)
"""Percentiles reported for every latency (p50 is reported as ``median_``, as vLLM does)."""


@attrs.frozen(eq=False)
class RunMetrics:
    """One run's results.

    Attributes:
        values: Flat ``{key: number}`` with ``vllm bench serve`` names (see :func:`summarize`).
        distributions: The ``ttft``, ``tpot``, ``itl`` and ``e2el`` samples, in seconds (the
            ``itl`` samples are the token gaps: every wait of an active sequence between two
            of its tokens).
        requests: Per-request records, when the run kept them.
        gaps: Every token gap with its end time, when the run kept them.
        errors: Why requests failed: the first
            :data:`~phasesched.metrics.recorder.MAX_ERRORS` messages (``values["failed"]`` counts them all).
    """

    values: dict[str, float]
    distributions: dict[str, Distribution]
    requests: tuple[RequestRecord, ...] | None = None
    gaps: GapLog | None = None
    errors: tuple[str, ...] = ()

    def __getitem__(self, key: str) -> float:
        return self.values[key]

    def to_dict(self) -> dict[str, Any]:
        """The values, JSON-ready (``nan`` becomes ``None``)."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.values.items()}


def summarize(
    counters: RunCounters,
    duration_s: float,
    requests: list[RequestRecord] | None = None,
    gaps: GapLog | None = None,
) -> RunMetrics:
    """Turn totals into the flat result dict.

    Keys: ``duration``, ``completed``, ``failed`` (requests rejected as unservable, counted in
    nothing else), ``total_input_tokens``, ``total_output_tokens``,
    ``request_throughput``, ``request_goodput``, ``input_throughput`` (prompt tokens/s),
    ``output_throughput`` (generated tokens/s), ``total_token_throughput``, ``num_preemptions``,
    ``truncated_outputs`` (completed requests whose output was cut short of ``max_new_tokens``
    to fit ``max_model_len``) and ``truncated_output_tokens`` (the output tokens they lost);
    for each of ``ttft``, ``tpot``, ``itl``, ``e2el``: ``mean_``, ``std_``, ``median_``,
    ``p90_``, ``p95_``, ``p99_`` and ``max_`` + name + ``_ms``; and the mean latency budget
    per request, ``mean_<phase>_ms`` for each phase of
    :data:`~phasesched.metrics.recorder.BUDGET_PHASES`.
    """
    per_second = 1.0 / duration_s if duration_s > 0 else math.nan
    values: dict[str, float] = {
        "duration": duration_s,
        "completed": counters.completed,
        "failed": counters.failed,
        "total_input_tokens": counters.input_tokens,
        "total_output_tokens": counters.output_tokens,
        "request_throughput": counters.completed * per_second,
        "request_goodput": counters.good * per_second,
        "input_throughput": counters.input_tokens * per_second,
        "output_throughput": counters.output_tokens * per_second,
        "total_token_throughput": (counters.input_tokens + counters.output_tokens) * per_second,
        "num_preemptions": counters.preemptions,
        "truncated_outputs": counters.truncated,
        "truncated_output_tokens": counters.truncated_tokens,
    }
    for name, distribution in counters.distributions.items():
        stats = distribution.summary(scale=1e3, percentiles=PERCENTILES)
        for stat, value in stats.items():
            values[f"{'median' if stat == 'p50' else stat}_{name}_ms"] = value
    done = max(counters.completed, 1)
    for phase in BUDGET_PHASES:
        values[f"mean_{phase}_ms"] = counters.budget_totals[phase] / done * 1e3
    kept = None if requests is None else tuple(requests)
    return RunMetrics(values, counters.distributions, kept, gaps, counters.errors)
