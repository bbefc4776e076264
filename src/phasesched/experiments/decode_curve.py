"""The decode curve: inter-token latency against the number of sequences decoding together."""

from __future__ import annotations

import operator
import time
from typing import Any

import attrs
import numpy as np

from phasesched.experiments.context import Column, ExperimentContext, Row, json_object, output_losses
from phasesched.metrics.recorder import GapLog, RequestRecord
from phasesched.sim.builders import fixed
from phasesched.sim.simulator import simulate
from phasesched.validators import typed

__all__ = ["DecodeCurveConfig", "DecodeCurveResult", "run_decode_curve"]


def _counts(values: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(operator.index(v) for v in values)


@attrs.frozen
class DecodeCurveConfig:
    """Sizes of the decode curve.

    Attributes:
        active: Sequence counts measured, 1 to 512 by default (powers of two).
        prompt_len: Every sequence's prompt (1024: a typical chat turn).
        output_len: Tokens each generates (256: the first requests to finish their prefill are
            still decoding when the last one finishes its, even at 512 sequences, so there are
            steps with all of them active; the simulator fast-forwards decodes, so this is cheap).
    """

    active: tuple[int, ...] = attrs.field(default=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), converter=_counts)
    prompt_len: int = attrs.field(default=1024, validator=typed(attrs.validators.gt(0)))
    output_len: int = attrs.field(default=256, validator=typed(attrs.validators.gt(1)))

    @classmethod
    def quick(cls) -> DecodeCurveConfig:
        """A tiny curve for tests."""
        return cls(active=(1, 16), prompt_len=256, output_len=16)


@attrs.frozen(eq=False)
class DecodeCurveResult:
    """Per policy and sequence count: the steady inter-token latency and decode throughput.

    Attributes:
        config: The sizes used.
        policies: Policy names, in row order.
        rows: One per ``(policy, active)``.
        wall_s: Seconds the experiment took.
    """

    config: DecodeCurveConfig
    policies: tuple[str, ...]
    rows: tuple[Row, ...]
    wall_s: float
    name: str = "decode_curve"
    title: str = "Decode curve: inter-token latency vs active sequences (gaps after the last prefill)"

    @property
    def columns(self) -> tuple[Column, ...]:
        """The terminal table's columns."""
        return (
            Column("policy", "policy"),
            Column("active", "active", ",d"),
            Column("steps", "steps", ",d"),
            Column("mean_itl_ms", "mean ITL ms", ",.2f"),
            Column("p99_itl_ms", "p99 ITL ms", ",.2f"),
            Column("decode_tok_s", "decode tok/s", ",.0f"),
            Column("last_ttft_ms", "last TTFT ms"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Config and rows, JSON-ready."""
        return json_object({"experiment": self.name, "config": attrs.asdict(self.config), "rows": self.rows})


def _steady_row(records: tuple[RequestRecord, ...], gaps: GapLog, active: int) -> Row:
    """Statistics of the gaps of steps where all ``active`` sequences decoded, after every prefill."""
    prefilled = max(r.arrival_s + r.ttft_s for r in records)
    after = (gaps.end_s - gaps.gap_s) >= prefilled
    gap_s, end_s = gaps.gap_s[after], gaps.end_s[after]
    # Every sequence in a step ends its gap at the step's end, so gaps per end time = batch size.
    ends, per_step = np.unique(end_s, return_counts=True)
    full = np.isin(end_s, ends[per_step == active])
    gap_s, end_s = gap_s[full], end_s[full]
    if gap_s.size == 0:
        return {"steps": 0, "mean_itl_ms": None, "p99_itl_ms": None, "decode_tok_s": None}
    mean_gap = float(gap_s.mean())
    return {
        "steps": int(np.count_nonzero(per_step == active)),
        "mean_itl_ms": mean_gap * 1e3,
        "p99_itl_ms": float(np.percentile(gap_s, 99)) * 1e3,
        "decode_tok_s": active / mean_gap,
    }


def run_decode_curve(context: ExperimentContext, config: DecodeCurveConfig | None = None) -> DecodeCurveResult:
    """Measure the inter-token latency of ``n`` sequences decoding together, for each ``n``.

    Holds constant: the deployment, the policy, every sequence's prompt and output length (so
    the KV each step reads grows the same way at every point), and arrival (all at t=0). The
    policy's sequence cap is raised to ``n`` so all ``n`` are active, and only gaps that begin
    after the last request's first token, in steps where all ``n`` decoded (token gaps per step
    = ``n``), are counted: the batch's own prefill is excluded, and so is the tail where early
    finishers have left. What remains is the step time of exactly ``n`` decodes, which is what a
    decode-heavy deployment sizes its batch by; ``steps`` says how many such steps there were.

    Args:
        context: Deployment, policies (default ``vllm``), seed and progress.
        config: Sizes; :class:`DecodeCurveConfig` defaults when omitted.

    >>> result = run_decode_curve(ExperimentContext(), DecodeCurveConfig((8,), prompt_len=512, output_len=8))
    >>> result.rows[0]["steps"]   # 8 tokens each: the first from the prefill, then 7 steps of all 8
    7
    """
    config = config or DecodeCurveConfig()
    started = time.perf_counter()
    policies = context.policy_names(("vllm",))
    detached = context.detached()
    tasks = [(detached, name, active, config) for name in policies for active in config.active]
    rows = context.map("decode curve", _point, tasks, costs=[active for _, _, active, _ in tasks])
    return DecodeCurveResult(config, policies, tuple(rows), time.perf_counter() - started)


def _point(context: ExperimentContext, name: str, active: int, config: DecodeCurveConfig) -> Row:
    """One policy with ``active`` sequences (a task for :meth:`ExperimentContext.map`)."""
    policy = context.load(name, max_num_seqs=active)
    workload = fixed(active, config.prompt_len, config.output_len)
    metrics = simulate(workload, policy, context.deployment, keep_requests=True, keep_gaps=True).metrics
    assert metrics.requests is not None
    assert metrics.gaps is not None
    row: Row = {"policy": name, "active": active}
    row.update(_steady_row(metrics.requests, metrics.gaps, active))
    row["last_ttft_ms"] = metrics["max_ttft_ms"]
    row.update(output_losses(metrics))
    return row
