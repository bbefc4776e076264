"""Mixed load: short requests decoding when one long prompt arrives, under each way of scheduling it.

The seed question of phasesched: a 16K-token prompt arrives while 32 chats stream tokens. No
chunking prefills it in one step and every chat stalls for the whole prefill; small chunks keep
the chats flowing but re-read the prompt's KV every chunk and take more steps, so the prompt's
prefill slows; disaggregation moves the prefill to another GPU. This experiment measures both
sides of that trade for each configuration, and :func:`verdict` names the configuration that
protects interactive progress best while keeping prefill throughput.
"""

from __future__ import annotations

import operator
import time
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError
from phasesched.experiments.context import Column, ExperimentContext, Row, json_object, ms, output_losses, quantiles_ms
from phasesched.metrics.summary import RunMetrics
from phasesched.sim.builders import mixed_load
from phasesched.sim.deployment import Disaggregation
from phasesched.sim.simulator import simulate
from phasesched.sim.workload import Workload
from phasesched.validators import typed

__all__ = [
    "BASELINE",
    "MixedLoadConfig",
    "MixedLoadResult",
    "Setup",
    "Verdict",
    "decode_step_s",
    "run_mixed_load",
    "setups",
    "verdict",
]

BASELINE = "no-chunk"
"""The label (and policy) every configuration's prefill throughput is compared with."""

NOISE = 0.05
"""Relative difference under which two p99 gaps are called within noise of each other.

The simulation is deterministic, but its inputs are not exact: the cost model's efficiencies
are estimates good to several percent, and a p99 over a few hundred gaps moves by a step or
two with the arrival time. Differences under 5% are not a ranking.
"""

NEAR_MISS = 0.05
"""How far under the throughput floor (a fraction of no chunking's throughput) a configuration is
still named in the verdict, when its gaps beat the winner's: the floor is a rule of thumb, not a cliff."""


def _sizes(values: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(operator.index(v) for v in values)


@attrs.frozen
class MixedLoadConfig:
    """Sizes of the mixed-load experiment.

    Attributes:
        num_short: Short requests, all arriving at t=0 (32: a busy interactive batch).
        short_prompt: Their prompt length.
        short_output: Their output length (1024: they are still decoding long after the
            long prompt's prefill ends, under every configuration; fast-forwarded, so cheap).
        long_prompt: The long prompt (16K).
        long_arrival_s: When it arrives (0.5 s: the short requests are in steady decode).
        chunk_sizes: Fixed chunk sizes compared (``sarathi`` with ``chunk_size``).
        tbt_factor: The SLO-adaptive time-between-tokens target, as a multiple of the short
            batch's decode step.
        disaggregation: The disaggregated configuration, or ``None`` to leave it out.
        min_prefill_fraction: The verdict keeps configurations whose long-prompt prefill
            throughput is at least this fraction of no chunking's.
    """

    num_short: int = attrs.field(default=32, validator=typed(attrs.validators.gt(0)))
    short_prompt: int = attrs.field(default=512, validator=typed(attrs.validators.gt(0)))
    short_output: int = attrs.field(default=1024, validator=typed(attrs.validators.gt(1)))
    long_prompt: int = attrs.field(default=16384, validator=typed(attrs.validators.gt(0)))
    long_arrival_s: float = attrs.field(default=0.5, validator=typed(attrs.validators.ge(0.0)))
    chunk_sizes: tuple[int, ...] = attrs.field(default=(256, 512, 1024, 2048, 4096), converter=_sizes)
    tbt_factor: float = attrs.field(default=2.5, validator=typed(attrs.validators.gt(0.0)))
    disaggregation: Disaggregation | None = attrs.field(factory=Disaggregation)
    min_prefill_fraction: float = attrs.field(
        default=0.9, validator=typed(attrs.validators.gt(0.0), attrs.validators.le(1.0))
    )

    @classmethod
    def quick(cls) -> MixedLoadConfig:
        """A small version for tests: 4 short requests, a 4K prompt, two chunk sizes."""
        return cls(
            num_short=4,
            short_prompt=128,
            short_output=256,
            long_prompt=4096,
            long_arrival_s=0.1,
            chunk_sizes=(256, 2048),
        )


@attrs.frozen
class Setup:
    """One configuration compared: a labelled policy, its option overrides and its workers.

    Attributes:
        label: Row label: a registered policy name a user can pass back to ``--policy``, with
            its overrides (``sarathi(chunk=512)`` is ``--policy sarathi --policy-option
            chunk_size=512``) and its layout when disaggregated (``no-chunk on 1P:1D``).
        policy: Registered policy name.
        options: :class:`~phasesched.PolicyOptions` overrides.
        disaggregation: Prefill/decode pools, or ``None`` for one aggregated GPU.
    """

    label: str
    policy: str
    options: dict[str, Any] = attrs.field(factory=dict, eq=False)
    disaggregation: Disaggregation | None = None

    @property
    def workers(self) -> int:
        """Workers it runs on (each is ``tensor_parallel`` GPUs of the deployment)."""
        if self.disaggregation is None:
            return 1
        return self.disaggregation.prefill_workers + self.disaggregation.decode_workers


@attrs.frozen(eq=False)
class MixedLoadResult:
    """Per configuration: token gaps during the long prefill, its TTFT and prefill throughput.

    Attributes:
        config: The sizes used.
        tbt_target_s: The SLO-adaptive target used.
        rows: One per configuration, in comparison order; ``prefill_vs_baseline`` is the
            long-prompt prefill throughput over no chunking's.
        window_gaps_s: Per label, float64 ``[G]``: every token gap that overlapped the long
            prompt's prefill window ``[arrival, arrival + TTFT]``, seconds.
        budgets_ms: Per label, the long request's latency budget (``{phase: ms}``).
        wall_s: Seconds the experiment took.
    """

    config: MixedLoadConfig
    tbt_target_s: float
    rows: tuple[Row, ...]
    window_gaps_s: dict[str, NDArray[np.float64]]
    budgets_ms: dict[str, dict[str, float]]
    wall_s: float
    name: str = "mixed_load"
    title: str = "Mixed load: token gaps while a long prompt prefills beside decoding requests"

    @property
    def columns(self) -> tuple[Column, ...]:
        """The terminal table's columns."""
        return (
            Column("label", "config"),
            Column("gpus", "GPUs", "d"),
            Column("p95_gap_ms", "p95 gap ms"),
            Column("p99_gap_ms", "p99 gap ms"),
            Column("max_gap_ms", "max gap ms"),
            Column("long_ttft_ms", "long TTFT ms"),
            Column("prefill_tok_s", "prefill tok/s", ",.0f"),
            Column("prefill_vs_baseline", "vs no-chunk", ".1%"),
            Column("mean_itl_ms", "mean ITL ms", ",.2f"),
            Column("p99_itl_ms", "p99 ITL ms", ",.2f"),
        )

    def verdict(self) -> Verdict:
        """:func:`verdict` at the configured fraction."""
        return verdict(
            self.rows, min_prefill_fraction=self.config.min_prefill_fraction, long_prompt=self.config.long_prompt
        )

    def to_dict(self) -> dict[str, Any]:
        """Config, rows, gap CDFs (ms at percentiles 0..100), budgets and the verdict, JSON-ready."""
        return json_object(
            {
                "experiment": self.name,
                "config": attrs.asdict(self.config),
                "tbt_target_ms": self.tbt_target_s * 1e3,
                "rows": self.rows,
                "window_gap_cdf_ms": {label: quantiles_ms(g) for label, g in self.window_gaps_s.items()},
                "long_request_budget_ms": self.budgets_ms,
                "verdict": self.verdict().to_dict(),
            }
        )


def setups(context: ExperimentContext, config: MixedLoadConfig, tbt_target_s: float) -> list[Setup]:
    """The configurations compared: the standard set, then the context's policies (default: every registered one).

    Fixed chunks use ``sarathi``, whose token budget equals its chunk: a step never carries
    more than ``chunk`` tokens, decodes included, so the chunk size is the only knob. (``vllm``
    with ``chunk_size`` caps the long prompt's slice but keeps its 8192-token budget, so its
    steps can still carry several slices.) The disaggregated configuration runs ``no-chunk`` on
    its workers: prefill workers have no decodes to protect.
    """
    out = [Setup(BASELINE, "no-chunk")]
    out += [Setup(f"sarathi(chunk={size})", "sarathi", {"chunk_size": size}) for size in config.chunk_sizes]
    out.append(Setup("sarathi-slo", "sarathi-slo", {"tbt_target_s": tbt_target_s}))
    if config.disaggregation is not None:
        d = config.disaggregation
        out.append(Setup(f"no-chunk on {d.prefill_workers}P:{d.decode_workers}D", "no-chunk", disaggregation=d))
    labels = {s.label for s in out}
    seen = [_unnamed(context, s) for s in out if s.disaggregation is None]
    for name in context.policy_names():
        setup = Setup(name, name)
        if name in labels or (not context.policies and _unnamed(context, setup) in seen):
            continue  # a default that only repeats a row already there (sarathi is sarathi(chunk=512))
        out.append(setup)
    return out


def _unnamed(context: ExperimentContext, setup: Setup) -> object:
    """The setup's policy with its name blanked, to spot presets that repeat a row."""
    return attrs.evolve(context.load(setup.policy, **setup.options), name="")


def decode_step_s(context: ExperimentContext, config: MixedLoadConfig) -> float:
    """The predicted step of the short batch decoding alone (contexts just past their prompts)."""
    contexts = np.full(config.num_short, config.short_prompt + 1, dtype=np.int64)
    return context.cost_model().step_time(np.ones(config.num_short, dtype=np.int64), contexts)


def run_mixed_load(context: ExperimentContext, config: MixedLoadConfig | None = None) -> MixedLoadResult:
    """Run the mixed load under every configuration of :func:`setups`.

    Holds constant: the deployment, the workload (``num_short`` identical short requests decoding
    from t=0, one ``long_prompt``-token request with a single output token at
    ``long_arrival_s``) and the measurement window (the long prompt's arrival to its first
    token). Only the scheduling varies: no chunking, each fixed chunk size, the SLO-adaptive
    chunk (target ``tbt_factor`` x the short batch's decode step), disaggregation (note: **two**
    GPUs, one prefill and one decode worker), and any policies the context names. Reported: the
    p95/p99/max token gap of the short requests during the window, the long prompt's TTFT and
    prefill throughput (prompt tokens over its prefill plus interference time, from its latency
    budget), and the run's overall inter-token latency.

    Args:
        context: Deployment, extra policies, seed and progress.
        config: Sizes; :class:`MixedLoadConfig` defaults when omitted.
    """
    config = config or MixedLoadConfig()
    started = time.perf_counter()
    tbt_target = config.tbt_factor * decode_step_s(context, config)
    workload = mixed_load(
        config.num_short,
        config.short_prompt,
        config.short_output,
        config.long_prompt,
        config.long_arrival_s,
        seed=context.seed,
    )
    plan = setups(context, config, tbt_target)
    rows: list[Row] = []
    gaps: dict[str, NDArray[np.float64]] = {}
    budgets: dict[str, dict[str, float]] = {}
    detached = context.detached()
    tasks = [(detached, setup, workload, f"r{config.num_short}") for setup in plan]
    # Small chunks take the most steps; the unchunked and disaggregated runs the fewest.
    costs = [1.0 / (setup.options.get("chunk_size") or config.long_prompt) for setup in plan]
    for setup, (row, window, budget) in zip(plan, context.map("mixed load", _run_setup, tasks, costs), strict=True):
        rows.append(row)
        gaps[setup.label], budgets[setup.label] = window, budget
    _relative_to_baseline(rows)
    return MixedLoadResult(config, tbt_target, tuple(rows), gaps, budgets, time.perf_counter() - started)


def _run_setup(
    context: ExperimentContext, setup: Setup, workload: Workload, long_id: str
) -> tuple[Row, NDArray[np.float64], dict[str, float]]:
    """One configuration's run, measured (a task for :meth:`ExperimentContext.map`)."""
    result = simulate(
        workload,
        context.load(setup.policy, **setup.options),
        context.deployment,
        disaggregation=setup.disaggregation,
        keep_requests=True,
        keep_gaps=True,
    )
    return _measure(setup, setup.workers * context.deployment.tensor_parallel, result.metrics, long_id)


def _measure(
    setup: Setup, gpus: int, metrics: RunMetrics, long_id: str
) -> tuple[Row, NDArray[np.float64], dict[str, float]]:
    """The row, the window's gaps and the long request's budget (ms) of one configuration's run."""
    assert metrics.requests is not None
    assert metrics.gaps is not None
    long = next(r for r in metrics.requests if r.request_id == long_id)
    window = metrics.gaps.overlapping(long.arrival_s, long.arrival_s + long.ttft_s)
    busy_s = long.budget.prefill_s + long.budget.interference_s
    row: Row = {
        "label": setup.label,
        "policy": setup.policy,
        "chunk": setup.options.get("chunk_size"),
        "gpus": gpus,
        "gaps": int(window.size),
        "p95_gap_ms": ms(float(np.percentile(window, 95))) if window.size else None,
        "p99_gap_ms": ms(float(np.percentile(window, 99))) if window.size else None,
        "max_gap_ms": ms(float(window.max())) if window.size else None,
        "long_ttft_ms": long.ttft_s * 1e3,
        "prefill_tok_s": long.prompt_len / busy_s if busy_s > 0 else None,
        "mean_itl_ms": metrics["mean_itl_ms"],
        "p99_itl_ms": metrics["p99_itl_ms"],
        **output_losses(metrics),
    }
    return row, window, {phase: s * 1e3 for phase, s in long.budget.as_dict().items()}


def _relative_to_baseline(rows: list[Row]) -> None:
    base = next((r["prefill_tok_s"] for r in rows if r["label"] == BASELINE), None)
    for row in rows:
        value = row["prefill_tok_s"]
        row["prefill_vs_baseline"] = value / base if value is not None and base else None


@attrs.frozen
class Verdict:
    """Which configuration protects interactive progress while keeping prefill throughput.

    Attributes:
        winner: The chosen configuration's row.
        baseline: No chunking's row.
        min_prefill_fraction: The throughput floor, as a fraction of the baseline's.
        more_gpus: The best-gap configuration that uses more GPUs than the baseline (it is not
            eligible, since it buys its gaps with hardware), if it beats the winner's gap.
        text: The verdict in words.
        runner_up: The next eligible configuration by p99 gap, if any.
        near_misses: Configurations on as many GPUs with a lower p99 gap than the winner's whose
            prefill throughput is under the floor by less than ``NEAR_MISS``.
    """

    winner: Row
    baseline: Row
    min_prefill_fraction: float
    more_gpus: Row | None
    text: str
    runner_up: Row | None = None
    near_misses: tuple[Row, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the winner's and baseline's labels and numbers, and the text."""
        return json_object(
            {
                "winner": self.winner,
                "baseline": self.baseline,
                "min_prefill_fraction": self.min_prefill_fraction,
                "more_gpus": self.more_gpus,
                "runner_up": self.runner_up,
                "near_misses": self.near_misses,
                "text": self.text,
            }
        )


def _gap_key(row: Row) -> tuple[float, float, str]:
    """Lowest p99 gap first; ties go to the higher prefill throughput, then the label."""
    return (row["p99_gap_ms"], -(row["prefill_tok_s"] or 0.0), row["label"])


def verdict(
    rows: tuple[Row, ...] | list[Row], *, min_prefill_fraction: float = 0.9, long_prompt: int | None = None
) -> Verdict:
    """Name the configuration with the lowest p99 token gap among those that keep prefill throughput.

    Eligible: configurations on as many GPUs as no chunking whose long-prompt prefill throughput
    is at least ``min_prefill_fraction`` of no chunking's (no chunking itself always is).

    Args:
        rows: :class:`MixedLoadResult` rows (``label``, ``gpus``, ``p99_gap_ms``, ``prefill_tok_s``).
        min_prefill_fraction: The throughput floor.
        long_prompt: The long prompt's length, for the text.

    Raises:
        InvalidArgumentError: There is no no-chunk row or it has no gaps or throughput to compare with.

    >>> rows = [
    ...     {"label": "no-chunk", "gpus": 1, "p99_gap_ms": 470.0, "prefill_tok_s": 34000.0},
    ...     {"label": "sarathi(chunk=256)", "gpus": 1, "p99_gap_ms": 10.0, "prefill_tok_s": 28000.0},
    ...     {"label": "sarathi(chunk=512)", "gpus": 1, "p99_gap_ms": 19.0, "prefill_tok_s": 31000.0},
    ... ]
    >>> v = verdict(rows)
    >>> v.winner["label"], [r["label"] for r in v.near_misses]
    ('sarathi(chunk=512)', [])
    """
    base = next((r for r in rows if r["label"] == BASELINE), None)
    if base is None or base["p99_gap_ms"] is None or not base["prefill_tok_s"]:
        msg = f"the verdict needs a {BASELINE!r} row with token gaps and prefill throughput"
        raise InvalidArgumentError(msg)
    floor = min_prefill_fraction * base["prefill_tok_s"]
    measured = [r for r in rows if r["p99_gap_ms"] is not None and r["prefill_tok_s"] is not None]
    eligible = [r for r in measured if r["gpus"] <= base["gpus"] and r["prefill_tok_s"] >= floor]
    ranked = sorted(eligible, key=_gap_key)
    winner, runner_up = ranked[0], (ranked[1] if len(ranked) > 1 else None)
    extra = [r for r in measured if r["gpus"] > base["gpus"] and r["p99_gap_ms"] < winner["p99_gap_ms"]]
    more_gpus = min(extra, key=_gap_key) if extra else None
    near_floor = (min_prefill_fraction - NEAR_MISS) * base["prefill_tok_s"]
    near = tuple(
        sorted(
            (
                r
                for r in measured
                if r["gpus"] <= base["gpus"]
                and near_floor <= r["prefill_tok_s"] < floor
                and r["p99_gap_ms"] < winner["p99_gap_ms"]
            ),
            key=_gap_key,
        )
    )
    text = _verdict_text(winner, base, min_prefill_fraction, more_gpus, long_prompt)
    text += _runner_up_text(winner, runner_up, base) + _near_miss_text(near, base, min_prefill_fraction)
    return Verdict(winner, base, min_prefill_fraction, more_gpus, text, runner_up, near)


def _runner_up_text(winner: Row, runner_up: Row | None, base: Row) -> str:
    if runner_up is None:
        return ""
    margin = (runner_up["p99_gap_ms"] - winner["p99_gap_ms"]) / max(runner_up["p99_gap_ms"], 1e-9)
    call = f"within noise ({NOISE:.0%}) of each other" if margin < NOISE else f"{margin:.0%} lower for the winner"
    return (
        f"\n  Runner-up: {runner_up['label']}, p99 gap {runner_up['p99_gap_ms']:,.1f} ms at "
        f"{runner_up['prefill_tok_s'] / base['prefill_tok_s']:.0%} prefill throughput ({call})."
    )


def _near_miss_text(near: tuple[Row, ...], base: Row, fraction: float) -> str:
    return "".join(
        f"\n  Just under the {fraction:.0%} floor: {r['label']} reaches a p99 gap of {r['p99_gap_ms']:,.1f} ms "
        f"at {r['prefill_tok_s'] / base['prefill_tok_s']:.1%} prefill throughput."
        for r in near
    )


def _verdict_text(winner: Row, base: Row, fraction: float, more_gpus: Row | None, long_prompt: int | None) -> str:
    prompt = f"the {long_prompt:,}-token" if long_prompt else "the long"
    share = winner["prefill_tok_s"] / base["prefill_tok_s"]
    lower = base["p99_gap_ms"] / max(winner["p99_gap_ms"], 1e-9)
    lines = [
        f"Verdict: {winner['label']} protects interactive progress best while keeping prefill throughput.",
        (
            f"  p99 token gap during {prompt} prefill: {winner['p99_gap_ms']:,.1f} ms"
            f" (no-chunk: {base['p99_gap_ms']:,.1f} ms, {lower:,.1f}x lower)"
        ),
        (
            f"  long-prompt prefill throughput: {winner['prefill_tok_s']:,.0f} tok/s = {share:.0%} of no-chunk's"
            f" {base['prefill_tok_s']:,.0f} tok/s (eligible: at least {fraction:.0%}, same GPU count)"
        ),
    ]
    if winner["label"] == BASELINE:
        lines[0] = "Verdict: no configuration beats no-chunk's token gaps within the throughput floor."
    if more_gpus is not None:
        lines.append(
            f"  {more_gpus['label']} reaches a p99 gap of {more_gpus['p99_gap_ms']:,.1f} ms"
            f" at {more_gpus['prefill_tok_s'] / base['prefill_tok_s']:.0%} prefill throughput,"
            f" but on {more_gpus['gpus']} GPUs."
        )
    return "\n".join(lines)
