"""What every experiment shares: the deployment, the policies by registered name, a seed and a progress hook.

An experiment is a function ``run_<name>(context, config) -> result``. The context says *where*
(hardware, model, cost model) and *with what* (policy names); the per-experiment config says *how
big*. Results are frozen values with flat ``rows`` (one dict per measured point, the units in
the key: ``_ms``, ``_tok_s``), the columns a terminal table shows, and ``to_dict()`` for
``results.json``. Policies are looked up by name in :data:`phasesched.POLICIES`, so a
third-party policy installed through the ``phasesched.policies`` entry point takes part in any
experiment exactly as a preset does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched import POLICIES, PolicyOptions, SchedulingPolicy, load_policy
from phasesched.costmodel.coverage import GridCoverage
from phasesched.costmodel.protocol import CostModel
from phasesched.errors import InvalidArgumentError
from phasesched.metrics.summary import RunMetrics
from phasesched.parallel import Backend, map_tasks
from phasesched.sim.deployment import Deployment
from phasesched.validators import typed

__all__ = [
    "CDF_QUANTILES",
    "REPRESENTATIVE_POLICIES",
    "Column",
    "ExperimentContext",
    "ExperimentResult",
    "ProgressHook",
    "Row",
    "coverage_of",
    "distinct_policies",
    "json_object",
    "jsonable",
    "map_counting",
    "ms",
    "output_losses",
    "quantiles_ms",
]

Row = dict[str, Any]
"""One measured point — flat ``{column: number | str | None}``."""

CDF_QUANTILES = np.linspace(0.0, 100.0, 101)
"""Percentiles at which distributions are stored for plots and ``results.json`` (0, 1, ..., 100)."""


class ProgressHook(Protocol):
    """Told how a long run advances, e.g. by the CLI's progress bar.

    ``task`` names what is advancing (an experiment, or one policy of a replay); each task
    reports ``completed`` out of ``total`` units (simulations, or requests in a replay).
    """

    def __call__(self, task: str, completed: int, total: int) -> None:
        """Record that ``task`` has done ``completed`` of ``total`` units."""


@attrs.frozen
class Column:
    """One column of an experiment's terminal table.

    Attributes:
        key: The row key it shows.
        header: Its heading.
        fmt: A format spec for numbers (``",.1f"``); strings are shown as they are.
    """

    key: str
    header: str
    fmt: str = ",.1f"


class ExperimentResult(Protocol):
    """What the report needs from any experiment's result."""

    @property
    def name(self) -> str:
        """A key such as ``"mixed_load"`` (``results.json`` and figure file names use it)."""

    @property
    def title(self) -> str:
        """A one-line heading for the table."""

    @property
    def rows(self) -> tuple[Row, ...]:
        """The measured points."""

    @property
    def columns(self) -> tuple[Column, ...]:
        """What the terminal table shows."""

    @property
    def wall_s(self) -> float:
        """Seconds the experiment took."""

    def to_dict(self) -> dict[str, Any]:
        """Everything worth keeping, JSON-ready."""


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


REPRESENTATIVE_POLICIES = ("vllm", "sarathi", "sglang", "no-chunk")
"""The default policies of the costly experiments (phase split and grid), one per distinct prefill/decode
rule (decode-first with a shared budget, stall-free fixed chunks, prefill-first, no chunking)."""


def distinct_policies() -> tuple[str, ...]:
    """Every registered policy name, less aliases (a name whose policy equals an earlier one's but for its name).

    >>> "no-chunk" in distinct_policies(), "orca" in distinct_policies()   # orca is no-chunk's twin, after it by name
    (True, False)
    """
    seen: list[SchedulingPolicy] = []
    out = []
    options = PolicyOptions(cost_model=Deployment().step_cost())  # one cost model, so SLO-adaptive ones compare
    for name in POLICIES.names():
        try:
            policy = attrs.evolve(load_policy(name, options), name="")
        except Exception:  # noqa: BLE001 -- a plugin that cannot be built here is still compared (and fails there)
            out.append(name)
            continue
        if policy not in seen:
            seen.append(policy)
            out.append(name)
    return tuple(out)


@attrs.frozen
class ExperimentContext:
    """The constants an experiment runs under.

    Attributes:
        deployment: Hardware, model, parallelism and cost model of every worker.
        policies: Registered policy names the user asked for; empty means each experiment's
            default: every registered policy, less aliases, in the prefill curve, mixed load and
            replay; :data:`REPRESENTATIVE_POLICIES` in the costly phase split and grid; ``vllm``
            in the decode curve, whose steady steps no policy changes. Mixed load always compares
            its own chunk sweep and *adds* these.
        seed: Seeds every random workload, so two runs with one seed are identical.
        policy_options: :class:`PolicyOptions` fields given to every policy (``--policy-option``);
            an experiment's own overrides (a chunk sweep's chunk) come on top.
        progress: Told as runs complete (not part of equality).
        backend: Where experiments run their independent simulations
            (:func:`phasesched.parallel.map_tasks`; not part of equality: results do not depend on it).
        workers: Local processes for the ``process`` backend (``None``: every CPU).

    >>> ExperimentContext().policy_names(("vllm",))
    ('vllm',)
    """

    deployment: Deployment = attrs.field(factory=Deployment)
    policies: tuple[str, ...] = attrs.field(default=(), converter=_names)
    seed: int = attrs.field(default=0, validator=typed(attrs.validators.ge(0)))
    policy_options: dict[str, Any] = attrs.field(factory=dict, kw_only=True)
    progress: ProgressHook | None = attrs.field(default=None, eq=False, repr=False)
    backend: Backend = attrs.field(default="serial", eq=False, kw_only=True)
    workers: int | None = attrs.field(default=None, eq=False, kw_only=True)

    def policy_names(self, default: tuple[str, ...] | None = None) -> tuple[str, ...]:
        """The user's policies, or ``default`` (``None``: :func:`distinct_policies`) when none were given."""
        return self.policies or (default if default is not None else distinct_policies())

    def map(
        self,
        task: str,
        function: Any,
        arguments: Sequence[tuple[Any, ...]],
        costs: Sequence[float] | None = None,
    ) -> list[Any]:
        """``[function(*a) for a in arguments]`` on the context's ``backend``, reporting progress as ``task``.

        ``function`` must be a module-level function; pass it :meth:`detached` rather than
        this context, since the progress hook stays in this process. ``costs`` (one rough
        estimate per task, any unit) starts the costliest tasks first, so a pool does not end
        with one worker finishing a long task while the others idle; results still come back
        in input order, and are the same whatever the order.
        """
        order = list(range(len(arguments)))
        if costs is not None:
            if len(costs) != len(arguments):
                msg = f"{len(costs)} costs for {len(arguments)} tasks"
                raise InvalidArgumentError(msg)
            order.sort(key=lambda i: -costs[i])
        results = map_counting(
            function,
            [arguments[i] for i in order],
            coverage_of(self),
            backend=self.backend,
            workers=self.workers,
            progress=lambda done, total: self.report(task, done, total),
        )
        out: list[Any] = [None] * len(arguments)
        for i, result in zip(order, results, strict=True):
            out[i] = result
        return out

    def detached(self) -> ExperimentContext:
        """The context without its progress hook: what a task in another process gets."""
        return attrs.evolve(self, progress=None)

    def check_policies(self) -> None:
        """Resolve every requested name now, before minutes of simulation.

        Raises:
            UnknownNameError: A name no plugin provides; the message lists the known ones.
        """
        for name in self.policies:
            POLICIES.get(name)

    def cost_model(self) -> CostModel:
        """The cost model steps are priced with (and SLO-adaptive policies predict with)."""
        return self.deployment.step_cost()

    def load(self, name: str, **overrides: Any) -> SchedulingPolicy:
        """Build policy ``name`` for this deployment; ``overrides`` are :class:`PolicyOptions` fields.

        Every policy gets the deployment's context length and cost model, so a preset or plugin
        that needs a cost model (``sarathi-slo``) works anywhere.
        """
        options: dict[str, Any] = {"max_model_len": self.deployment.max_model_len, "cost_model": self.cost_model()}
        options.update(self.policy_options)
        options.update(overrides)
        return load_policy(name, PolicyOptions(**options))

    def report(self, task: str, completed: int, total: int) -> None:
        """Forward progress to the hook, if there is one."""
        if self.progress is not None:
            self.progress(task, completed, total)


def coverage_of(context: ExperimentContext) -> GridCoverage | None:
    """The context's profiled cost model if it counts out-of-grid predictions, else ``None``."""
    model = context.deployment.cost_model
    return model if isinstance(model, GridCoverage) else None


def map_counting(
    function: Callable[..., Any], arguments: Sequence[tuple[Any, ...]], coverage: GridCoverage | None, **how: Any
) -> list[Any]:
    """:func:`~phasesched.parallel.map_tasks`, with the out-of-grid predictions every task makes added to ``coverage``.

    A task on another process or Ray worker prices its steps with its own copy of the cost
    model, so its counts would stay there. Each task here reports what it counted (its copy's
    counts after the task less those before) and the counts are added up in this process, in
    input order, so ``coverage`` ends exactly as a serial run leaves it, whatever the backend.
    ``how`` is :func:`~phasesched.parallel.map_tasks`' keyword arguments. ``coverage`` must be
    the object the tasks' arguments price with (the context's ``deployment.cost_model``).
    """
    if coverage is None:
        return map_tasks(function, arguments, **how)
    outcomes = map_tasks(_counted, [((function, args, coverage),) for args in arguments], **how)
    for _, (predictions, outside, seen_max) in outcomes:
        coverage.predictions += predictions
        coverage.outside += outside
        coverage.seen_max = np.maximum(coverage.seen_max, seen_max)
    return [result for result, _ in outcomes]


def _counted(
    bundle: tuple[Callable[..., Any], tuple[Any, ...], GridCoverage],
) -> tuple[Any, tuple[int, int, NDArray[np.float64]]]:
    """Run one task and return its result with the predictions it counted, leaving the counts as they were.

    The function, its arguments and the coverage travel as one value, so the coverage a worker
    unpickles is the object the arguments price with. The counts are put back after the task:
    when the task ran in this process, :func:`map_counting` adds them once, not twice.
    """
    function, args, coverage = bundle
    before = (coverage.predictions, coverage.outside, coverage.seen_max.copy())
    result = function(*args)
    counted = (coverage.predictions - before[0], coverage.outside - before[1], coverage.seen_max.copy())
    coverage.predictions, coverage.outside, coverage.seen_max = before
    return result, counted


def output_losses(metrics: RunMetrics) -> Row:
    """A run's row keys for outputs the context limit cut short: requests and tokens lost.

    >>> from phasesched.metrics import RunMetrics
    >>> output_losses(RunMetrics({"truncated_outputs": 2, "truncated_output_tokens": 70}, {}))
    {'truncated_outputs': 2, 'truncated_output_tokens': 70}
    """
    return {key: metrics[key] for key in ("truncated_outputs", "truncated_output_tokens")}


def ms(seconds: float) -> float | None:
    """Seconds as milliseconds; ``None`` for ``nan`` (an empty distribution)."""
    return None if math.isnan(seconds) else seconds * 1e3


def quantiles_ms(samples_s: NDArray[np.float64]) -> list[float]:
    """The samples' :data:`CDF_QUANTILES` in milliseconds (empty for no samples), for plots and JSON."""
    if samples_s.size == 0:
        return []
    return [float(v) * 1e3 for v in np.percentile(samples_s, CDF_QUANTILES)]


def jsonable(value: Any) -> Any:
    """``value`` with tuples as lists, numpy scalars and arrays as Python values, ``nan``/``inf`` as ``None``."""
    if isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_object(value: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`jsonable` for a mapping, typed as the dict it returns.

    >>> json_object({"gap": float("nan"), "sizes": (1, 2)})
    {'gap': None, 'sizes': [1, 2]}
    """
    out: dict[str, Any] = jsonable(value)
    return out
