"""The keys of ``vllm bench serve``'s result JSON, for experiment rows a vLLM-bench consumer can read.

Every run already carries them in :class:`~phasesched.metrics.summary.RunMetrics` (same names,
same units: seconds for ``duration``, requests/s and tokens/s for throughputs, milliseconds for
latencies); :func:`vllm_bench_values` picks them out for a row. ``request_goodput`` is only
meaningful against an SLO, so it is left out when the run had none (vLLM reports it only with
``--goodput``).
"""

from __future__ import annotations

from phasesched.metrics.summary import RunMetrics

__all__ = ["VLLM_BENCH_KEYS", "vllm_bench_values"]

_LATENCIES = ("ttft", "tpot", "itl", "e2el")
_STATS = ("mean", "median", "std", "p90", "p95", "p99")

VLLM_BENCH_KEYS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{stat}_{name}_ms" for name in _LATENCIES for stat in _STATS),
)
"""What ``vllm bench serve --save-result`` writes for a run (with ``--metric-percentiles 90,95,99``), less goodput."""


def vllm_bench_values(metrics: RunMetrics, *, with_slo: bool) -> dict[str, float]:
    """The run's :data:`VLLM_BENCH_KEYS`, plus ``request_goodput`` when ``with_slo``.

    >>> from phasesched import load_policy
    >>> from phasesched.sim import fixed, simulate
    >>> values = vllm_bench_values(simulate(fixed(4, 256, 8), load_policy("vllm")).metrics, with_slo=False)
    >>> values["completed"], "request_goodput" in values, "p99_tpot_ms" in values
    (4, False, True)
    """
    out = {key: metrics.values[key] for key in VLLM_BENCH_KEYS}
    if with_slo:
        out["request_goodput"] = metrics.values["request_goodput"]
    return out
