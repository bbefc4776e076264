"""The benchmark grid: prompt length x output length x concurrency, closed loop."""

from __future__ import annotations

import operator
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
from phasesched.sim.closed_loop import GridPoint, grid_points
from phasesched.sim.simulator import simulate
from phasesched.validators import typed

__all__ = ["GridConfig", "GridResult", "run_grid"]


def _ints(values: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(operator.index(v) for v in values)


@attrs.frozen
class GridConfig:
    """Sizes of the grid.

    Attributes:
        prompts: Prompt lengths (128, 1K, 4K, 16K).
        outputs: Output lengths (32, 256, 1K).
        concurrency: Clients in the closed loop (1, 8, 32: one stream, a moderate batch, a
            busy one; 128 would add little the decode curve does not show, at twice the cost).
        requests_per_client: Requests per client at each point, so every client sends a second
            one after its first (at least ``min_requests`` in all; 2: the 16K-prompt cells with
            32 clients are the grid's costliest, and cost grows with this count).
        min_requests: The fewest requests at a point.
    """

    prompts: tuple[int, ...] = attrs.field(default=(128, 1024, 4096, 16384), converter=_ints)
    outputs: tuple[int, ...] = attrs.field(default=(32, 256, 1024), converter=_ints)
    concurrency: tuple[int, ...] = attrs.field(default=(1, 8, 32), converter=_ints)
    requests_per_client: int = attrs.field(default=2, validator=typed(attrs.validators.gt(0)))
    min_requests: int = attrs.field(default=8, validator=typed(attrs.validators.gt(0)))

    @classmethod
    def quick(cls) -> GridConfig:
        """Four small points for tests."""
        return cls(prompts=(128, 1024), outputs=(16,), concurrency=(1, 4), requests_per_client=2, min_requests=2)

    def points(self) -> list[GridPoint]:
        """Every cell, prompt outermost and concurrency innermost."""
        return list(grid_points(self.prompts, self.outputs, self.concurrency))

    def num_requests(self, point: GridPoint) -> int:
        """Requests sent at ``point``."""
        return max(self.requests_per_client * point.concurrency, self.min_requests)


@attrs.frozen(eq=False)
class GridResult:
    """Per policy and cell: TTFT, ITL, end-to-end latency, prompt and generated throughput.

    Attributes:
        config: The sizes used.
        policies: Policy names, in row order.
        rows: One per ``(policy, cell)``.
        wall_s: Seconds the experiment took.
    """

    config: GridConfig
    policies: tuple[str, ...]
    rows: tuple[Row, ...]
    wall_s: float
    name: str = "grid"
    title: str = "Grid: prompt x output x concurrency (closed loop, fixed lengths)"

    @property
    def columns(self) -> tuple[Column, ...]:
        """The terminal table's columns."""
        return (
            Column("policy", "policy"),
            Column("prompt_len", "prompt", ",d"),
            Column("output_len", "output", ",d"),
            Column("concurrency", "conc", "d"),
            Column("mean_ttft_ms", "mean TTFT ms"),
            Column("median_itl_ms", "median ITL ms", ",.2f"),
            Column("p99_itl_ms", "p99 ITL ms", ",.2f"),
            Column("mean_e2el_ms", "mean E2E ms", ",.0f"),
            Column("input_tok_s", "prompt tok/s", ",.0f"),
            Column("output_tok_s", "gen tok/s", ",.0f"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Config and rows, JSON-ready."""
        return json_object({"experiment": self.name, "config": attrs.asdict(self.config), "rows": self.rows})


def run_grid(context: ExperimentContext, config: GridConfig | None = None) -> GridResult:
    """Run every grid cell as a closed-loop benchmark.

    Holds constant at each cell: the deployment, the policy, every request's prompt and output
    length, and the number of clients (each sends its next request the moment one finishes,
    with no think time), as ``vllm bench serve --max-concurrency`` does. Across cells only those
    three numbers vary, from prefill-dominated (16K in, 32 out) to decode-dominated (128 in, 1K
    out) and from one stream to a busy batch. Reported with ``vllm bench serve``'s meanings:
    TTFT, ITL, end-to-end latency, prompt and generated tokens/s.

    Args:
        context: Deployment, policies (default :data:`~phasesched.experiments.context.REPRESENTATIVE_POLICIES`), seed,
            progress and backend.
        config: Sizes; :class:`GridConfig` defaults when omitted.
    """
    config = config or GridConfig()
    started = time.perf_counter()
    policies = context.policy_names(REPRESENTATIVE_POLICIES)
    detached = context.detached()
    tasks = [(detached, name, point, config) for name in policies for point in config.points()]
    # Prefill steps dominate a cell's cost: the long-prompt, many-client cells start first.
    costs = [config.num_requests(point) * point.prompt_len for _, _, point, _ in tasks]
    rows = context.map("grid", _cell, tasks, costs)
    return GridResult(config, policies, tuple(rows), time.perf_counter() - started)


def _cell(context: ExperimentContext, name: str, point: GridPoint, config: GridConfig) -> Row:
    """One policy at one grid cell (a task for :meth:`ExperimentContext.map`)."""
    loop = attrs.evolve(point.closed_loop(config.num_requests(point)), seed=context.seed)
    metrics = simulate(loop, context.load(name), context.deployment).metrics
    return {
        "policy": name,
        "prompt_len": point.prompt_len,
        "output_len": point.output_len,
        "concurrency": point.concurrency,
        "requests": metrics["completed"],
        "input_tok_s": metrics["input_throughput"],
        "output_tok_s": metrics["output_throughput"],
        **vllm_bench_values(metrics, with_slo=False),
        **output_losses(metrics),
    }
