"""``phasesched tune``: every candidate's capacity under an SLO, ranked, with one recommendation.

Each candidate's capacity is found independently (:func:`~phasesched.tune.capacity.find_capacity`),
so the candidates are mapped over a process pool or Ray (:func:`phasesched.parallel.map_tasks`)
and the answer does not depend on the backend. Candidates are ranked by goodput per GPU at
capacity (requests per second meeting the SLO, over the GPUs used). The top few are then
re-measured on other seeds of the workload, and the recommendation says how far their
capacities moved and whether the winner stayed first.

**Screening.** A steady state needs thousands of requests per simulation, and a full grid has
dozens of candidates: most of the time goes to candidates that are far behind. With
``TuneRun.screen`` set, every candidate is first measured on the workload's first ``screen``
requests at a coarser tolerance, as successive halving would; only the best third of them, and
any others within ``screen_keep`` of the best screened goodput per GPU, are measured on the
whole workload, each bisection starting from its screened capacity. The
others keep their screened numbers, marked as such, below the measured ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from phasesched.errors import InvalidArgumentError
from phasesched.experiments.context import Column, ExperimentContext, Row, coverage_of, json_object, map_counting
from phasesched.parallel import Backend, default_workers
from phasesched.sim.workload import Workload
from phasesched.slo import SLO
from phasesched.tune.capacity import CapacityConfig, Probe, describe_probe, find_capacity
from phasesched.tune.space import Candidate, SearchSpace
from phasesched.tune.study import optuna_search

__all__ = ["STEADY_S", "TuneResult", "TuneRun", "pareto_front", "run_tune"]

STEADY_S = 60.0
"""A workload replayed at the recommended capacity should span at least this long to measure a steady state."""


@attrs.frozen
class TuneRun:
    """How ``tune`` runs, beyond what it searches.

    Attributes:
        gpus: GPUs to use in all.
        capacity: The bisection's settings.
        backend: Where the simulations run (:data:`phasesched.parallel.BACKENDS`).
        workers: Local processes (``None``: every CPU).
        address: Ray cluster address.
        confirm_top: Candidates re-measured on the other seeds.
        search: ``grid`` measures every candidate; ``optuna`` lets a TPE study pick ``trials`` of them.
        trials: Optuna trials (candidates asked for; repeats are measured once).
        seed: The Optuna sampler's seed.
        screen: Requests of the first, screening measurement (``None``: measure every
            candidate on the whole workload).
        screen_keep: Candidates whose screened goodput per GPU is within this share of the
            best go on to the whole workload.
        screen_tolerance: The screening bisection's tolerance.
        screen_share: The best this share of candidates on the screen go on whatever their
            margin (successive halving's keep-a-third), so that one candidate whose short run
            flatters it cannot knock out the rest.
    """

    gpus: int = attrs.field(validator=attrs.validators.gt(0))
    capacity: CapacityConfig = attrs.field(factory=CapacityConfig)
    backend: Backend = "process"
    workers: int | None = None
    address: str | None = None
    confirm_top: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    search: Literal["grid", "optuna"] = "grid"
    trials: int = attrs.field(default=32, validator=attrs.validators.gt(0))
    seed: int = 0
    screen: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))
    screen_keep: float = attrs.field(default=0.25, validator=[attrs.validators.gt(0.0), attrs.validators.lt(1.0)])
    screen_tolerance: float = attrs.field(default=0.15, validator=[attrs.validators.gt(0.0), attrs.validators.lt(1.0)])
    screen_share: float = attrs.field(default=1 / 3, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])


def _capacity_task(
    context: ExperimentContext, candidate: Candidate, workload: Workload, slo: SLO, config: CapacityConfig
) -> tuple[Probe | None, int, bool]:
    found, probes = find_capacity(context, candidate, workload, slo, config)
    return found, len(probes), any(not p.verdict.meets for p in probes)


def pareto_front(rows: Sequence[Row]) -> list[bool]:
    """Per row, whether no other row has at least its goodput per GPU and at most its p99 ITL, one strictly."""

    def key(row: Row) -> tuple[float, float]:
        itl = row["p99_itl_ms"]
        return row["goodput_per_gpu"] or 0.0, float("inf") if itl is None else itl

    keys = [key(r) for r in rows]
    return [k[0] > 0 and not any(o[0] >= k[0] and o[1] <= k[1] and o != k for o in keys) for k in keys]


@attrs.frozen(eq=False)
class TuneResult:
    """The ranked candidates, the seed check and the recommendation.

    Attributes:
        slo: The SLO capacity was measured against.
        gpus: GPUs in all.
        rows: One per candidate, best first.
        seeds: Per confirmed candidate label, its capacity on each seed (seed 0 first).
        recommendation: The answer in words, with its evidence.
        simulations: Simulations run.
        wall_s: Seconds it took.
        screened_on: Requests every candidate was first screened on (``None``: no screening).
    """

    slo: SLO
    gpus: int
    rows: tuple[Row, ...]
    seeds: dict[str, list[float]]
    recommendation: str
    simulations: int
    wall_s: float
    screened_on: int | None = None
    name: str = "tune"
    title: str = "Tune: capacity at the SLO per configuration, best goodput per GPU first"

    @property
    def columns(self) -> tuple[Column, ...]:
        """The terminal table's columns."""
        return (
            Column("rank", "#", "d"),
            Column("policy_label", "policy"),
            Column("layout", "GPUs as"),
            Column("capacity_rps", "req/s at SLO", ",.2f"),
            Column("bound", ""),
            Column("goodput_per_gpu", "goodput/GPU", ",.3f"),
            Column("attainment", "attained", ".1%"),
            Column("p99_ttft_ms", "p99 TTFT ms", ",.0f"),
            Column("p99_itl_ms", "p99 ITL ms", ",.1f"),
            Column("pareto", "Pareto"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready."""
        return json_object(
            {
                "experiment": self.name,
                "slo": self.slo.to_dict(),
                "gpus": self.gpus,
                "rows": self.rows,
                "seed_capacity_rps": self.seeds,
                "recommendation": self.recommendation,
                "simulations": self.simulations,
                "screen_requests": self.screened_on,
            }
        )


def _row(candidate: Candidate, outcome: tuple[Probe | None, bool], gpus_per_worker: int, requests: int) -> Row:
    found, bounded = outcome
    gpus = candidate.layout.workers * gpus_per_worker
    numbers = describe_probe(found)
    attained = numbers["attainment"] or 0.0
    return {
        "label": candidate.label,
        "policy": candidate.policy,
        "chunk": candidate.chunk,
        "budget": candidate.budget,
        "policy_label": candidate.policy_label,
        "layout": candidate.layout.label,
        "prefill_workers": candidate.layout.prefill or None,
        "decode_workers": candidate.layout.decode or None,
        "replicas": candidate.layout.replicas or None,
        "gpus": gpus,
        "goodput_per_gpu": numbers["capacity_rps"] * attained / gpus,
        "command_line": candidate.command_line(),
        **numbers,
        "capacity_found": bounded,
        "requests_measured": requests,
        "screened_out": False,
    }


def _measure(  # noqa: PLR0913, PLR0917 -- one batch of capacity searches and its progress label
    context: ExperimentContext,
    candidates: Sequence[Candidate],
    workload: Workload,
    slo: SLO,
    run: TuneRun,
    task: str,
    *,
    configs: Sequence[CapacityConfig] | None = None,
) -> tuple[list[tuple[Probe | None, bool]], int]:
    quiet = attrs.evolve(context, progress=None)  # the hook stays here; workers get plain values
    configs = configs or [run.capacity] * len(candidates)
    arguments = [(quiet, c, workload, slo, config) for c, config in zip(candidates, configs, strict=True)]
    outcomes = map_counting(
        _capacity_task,
        arguments,
        coverage_of(context),
        backend=run.backend,
        workers=run.workers,
        address=run.address,
        progress=lambda done, total: context.report(task, done, total),
    )
    return [(found, bounded) for found, _, bounded in outcomes], sum(n for _, n, _ in outcomes)


def run_tune(  # noqa: PLR0913 -- what is searched, on what, against what, and how
    context: ExperimentContext,
    workloads: Sequence[Workload],
    slo: SLO,
    space: SearchSpace,
    run: TuneRun,
    *,
    candidates: Sequence[Candidate] | None = None,
) -> TuneResult:
    """Find every candidate's capacity on ``workloads[0]``, rank them, confirm the top on the others.

    Args:
        context: Deployment (one worker: hardware, model, TP), seed and progress.
        workloads: The workload per seed; the first is searched, the rest confirm.
        slo: What capacity is measured against.
        space: What is searched.
        run: GPUs, bisection, backend.
        candidates: Search these instead of ``space``'s full product (an Optuna study's picks, say).
    """
    started = time.perf_counter()
    tp = context.deployment.tensor_parallel
    workers = run.gpus // tp
    if workers < 1:
        msg = f"{run.gpus} GPUs cannot hold one worker of tensor_parallel={tp}"
        raise InvalidArgumentError(msg)
    takes = _takes(context)
    if run.search == "optuna" and candidates is None:
        chosen, found, simulations = _optuna(context, workloads[0], slo, space, run, takes)
        screened: list[Row] = []
        screened_on = None
    else:
        chosen = list(candidates) if candidates is not None else space.candidates(workers, takes)
        chosen, screened, configs, simulations, screened_on = _screen(context, chosen, workloads[0], slo, run)
        found, measured = _measure(context, chosen, workloads[0], slo, run, "tune", configs=configs)
        simulations += measured
    full = len(workloads[0])
    rows = _ranked([_row(c, f, tp, full) for c, f in zip(chosen, found, strict=True)], screened)
    seeds = {row["label"]: [row["capacity_rps"]] for row in rows[: run.confirm_top]}
    if len(workloads) > 1 and rows:
        top = [c for row in rows[: run.confirm_top] for c in chosen if c.label == row["label"]]
        for extra in workloads[1:]:
            again, more = _measure(context, top, extra, slo, run, "confirm on another seed")
            simulations += more
            for candidate, (probe, _) in zip(top, again, strict=True):
                seeds[candidate.label].append(probe.rate if probe is not None else 0.0)
    text = recommend(rows, seeds, slo, run) + _screening_note(screened, rows, run, screened_on) + _cautions(rows, full)
    wall_s = time.perf_counter() - started
    return TuneResult(slo, run.gpus, tuple(rows), seeds, text, simulations, wall_s, screened_on)


def _optuna(  # noqa: PLR0913, PLR0917 -- run_tune's inputs, for the study's branch
    context: ExperimentContext,
    workload: Workload,
    slo: SLO,
    space: SearchSpace,
    run: TuneRun,
    takes: Any,
) -> tuple[list[Candidate], list[tuple[Probe | None, bool]], int]:
    """The candidates an Optuna study picked, their outcomes and the simulations run."""
    counted: list[int] = []

    def measure(batch: Sequence[Candidate]) -> list[tuple[Probe | None, bool]]:
        outcomes, n = _measure(context, batch, workload, slo, run, "tune (optuna)")
        counted.append(n)
        return outcomes

    workers = run.gpus // context.deployment.tensor_parallel
    size = run.workers or default_workers()
    picked = optuna_search(space, workers, takes, measure, trials=run.trials, batch=size, seed=run.seed)
    return list(picked), list(picked.values()), sum(counted)


def _screen(
    context: ExperimentContext, candidates: list[Candidate], workload: Workload, slo: SLO, run: TuneRun
) -> tuple[list[Candidate], list[Row], list[CapacityConfig], int, int | None]:
    """Screen ``candidates`` on the workload's head.

    Returns:
        The candidates to measure fully, the rows of the others, the bisection settings per
        candidate measured, the simulations run and the requests screened on (``None`` when
        nothing was screened: no screen asked, a workload no longer than it, or too few
        candidates to drop any; every candidate then goes on with the run's settings).
    """
    if run.screen is None or run.screen >= len(workload) or len(candidates) <= run.confirm_top:
        return candidates, [], [run.capacity] * len(candidates), 0, None
    head = workload.head(run.screen)
    coarse = attrs.evolve(run, capacity=attrs.evolve(run.capacity, tolerance=run.screen_tolerance))
    found, simulations = _measure(context, candidates, head, slo, coarse, f"screen on {run.screen} requests")
    tp = context.deployment.tensor_parallel
    rows = [_row(c, f, tp, len(head)) for c, f in zip(candidates, found, strict=True)]
    order = sorted(range(len(rows)), key=lambda i: _rank_key(rows[i]))
    best = rows[order[0]]["goodput_per_gpu"]
    bar = best * (1 - run.screen_keep)
    top = max(run.confirm_top, math.ceil(len(rows) * run.screen_share))
    kept = {i for rank, i in enumerate(order) if rank < top or rows[i]["goodput_per_gpu"] >= bar > 0}
    configs = []
    for i in sorted(kept):
        probe = found[i][0]
        start = run.capacity.start_rate if probe is None else probe.rate / candidates[i].layout.workers
        configs.append(attrs.evolve(run.capacity, start_rate=start))
    for i, row in enumerate(rows):
        row["screened_out"] = i not in kept
    return (
        [candidates[i] for i in sorted(kept)],
        [rows[i] for i in order if i not in kept],
        configs,
        simulations,
        len(head),
    )


def _ranked(rows: list[Row], screened: Sequence[Row] = ()) -> list[Row]:
    """Rows best first, with rank, Pareto flag and the lower-bound mark; screened-out rows after, best first.

    Screened-out rows were measured on fewer requests, so they neither outrank a measured row
    nor join the Pareto front.
    """
    rows = sorted(rows, key=_rank_key)
    for rank, (row, pareto) in enumerate(zip(rows, pareto_front(rows), strict=True), 1):
        row["rank"], row["pareto"] = rank, "yes" if pareto else ""
        row["bound"] = "" if row["capacity_found"] else ">="
    behind = sorted(screened, key=_rank_key)
    for rank, row in enumerate(behind, len(rows) + 1):
        row["rank"], row["pareto"] = rank, ""
        row["bound"] = "screened" if row["capacity_found"] else "screened >="
    return rows + behind


def _screening_note(screened: Sequence[Row], rows: Sequence[Row], run: TuneRun, screened_on: int | None) -> str:
    if screened_on is None:
        return ""
    measured = len(rows) - len(screened)
    text = (
        f"\n  Screening: all {len(rows)} configurations were first measured on the first {screened_on} requests; "
        f"the best {measured} there (the top {run.screen_share:.0%}, and any within {run.screen_keep:.0%} of the "
        "best) were measured on the whole workload"
    )
    if not screened:
        return text + "."
    best = max(row["goodput_per_gpu"] for row in screened)
    return text + (
        f", the other {len(screened)} were not (ranked last, marked screened; the best of them had "
        f"{best:.3f} good req/s per GPU on {screened_on} requests)."
    )


def _cautions(rows: Sequence[Row], requests: int) -> str:
    """What limits the evidence: a burst instead of a steady load, or capacities that are lower bounds."""
    text = ""
    if rows and rows[0]["capacity_rps"] > 0:
        span_s = (requests - 1) / rows[0]["capacity_rps"]
        if span_s < STEADY_S:
            text += (
                f"\n  Caution: at {rows[0]['capacity_rps']:.1f} req/s the {requests} requests arrive within "
                f"{span_s:.1f} s, a burst more than a steady load (under {STEADY_S:.0f} s); serve more requests "
                "(--limit) for a steady-state capacity."
            )
    if any(not row["capacity_found"] for row in rows[:2]):
        text += (
            "\n  Caution: the top configurations met the SLO at every rate tried, so their capacity is a lower bound "
            "(raise --max-probes, or serve more requests with --limit so that overload shows)."
        )
    return text


def _rank_key(row: Row) -> tuple[float, float, str]:
    itl = row["p99_itl_ms"]
    return -row["goodput_per_gpu"], float("inf") if itl is None else itl, row["label"]


def _takes(context: ExperimentContext) -> Any:
    """Whether a policy honours an option: building it with two values gives two different policies."""
    cache: dict[tuple[str, str], bool] = {}

    def takes(policy: str, field: str) -> bool:
        if (policy, field) not in cache:
            cache[policy, field] = context.load(policy, **{field: 256}) != context.load(policy, **{field: 4096})
        return cache[policy, field]

    return takes


def recommend(rows: Sequence[Row], seeds: dict[str, list[float]], slo: SLO, run: TuneRun) -> str:
    """The recommendation with its evidence: capacity, latencies, runner-up and margin, seed spread."""
    if not rows or rows[0]["goodput_per_gpu"] <= 0:
        return f"No configuration meets the SLO ({slo.describe()}) at any rate tried on {run.gpus} GPUs."
    best = rows[0]
    lines = [
        f"Recommendation: {best['label']} ({best['command_line']}).",
        (
            f"  It holds {best['capacity_rps']:.2f} req/s on {best['gpus']} GPUs at the SLO "
            f"({slo.describe()}): {best['goodput_per_gpu']:.3f} good req/s per GPU, {best['attainment']:.1%} "
            f"attained, p99 TTFT {best['p99_ttft_ms']:.0f} ms, p99 ITL {best['p99_itl_ms']:.1f} ms."
        ),
    ]
    spread = _spread(seeds.get(best["label"], []))
    if len(rows) > 1:
        second = rows[1]
        margin = 1 - second["goodput_per_gpu"] / best["goodput_per_gpu"]
        noise = max(run.capacity.tolerance, spread)
        verdict = "within noise" if margin <= noise else "a clear margin"
        lines.append(
            f"  Runner-up: {second['label']}, {second['goodput_per_gpu']:.3f} good req/s per GPU "
            f"({margin:.1%} less: {verdict}; the bisection resolves {run.capacity.tolerance:.0%}"
            + (f", seeds move capacity by {spread:.0%})." if len(seeds.get(best["label"], [])) > 1 else ").")
        )
    if len(seeds.get(best["label"], [])) > 1:
        lines.append(_seed_line(best["label"], seeds))
    return "\n".join(lines)


def _spread(values: Sequence[float]) -> float:
    """(max - min) / max of a capacity over seeds (0 for fewer than two)."""
    return (max(values) - min(values)) / max(values) if len(values) > 1 and max(values) > 0 else 0.0


def _seed_line(label: str, seeds: dict[str, list[float]]) -> str:
    n = len(seeds[label])
    wins = sum(1 for i in range(n) if max(seeds, key=lambda k: seeds[k][i]) == label)
    values = ", ".join(f"{v:.2f}" for v in seeds[label])
    return (
        f"  Across {n} seeds its capacity is {values} req/s ({_spread(seeds[label]):.0%} spread); "
        f"it ranks first among the top {len(seeds)} on {wins} of {n} seeds."
    )
