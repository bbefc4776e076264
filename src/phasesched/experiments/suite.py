"""The seed suite: every experiment by name, at full size or quick, as ``phasesched bench`` runs them.

Sizes of the full suite (each config's defaults; see their docstrings for why), measured on a
2-core machine at about 10-15 s of simulation in all for H200 + Llama-3-8B:

* prefill curve: 9 prompt lengths (128..32K), batches of 8, one output token;
* decode curve: 10 sequence counts (1..512), prompt 1024, 256 output tokens;
* mixed load: 32 short requests (512 in, 1024 out) and one 16K prompt at 0.5 s, under 8
  configurations (no chunking, chunks 256..4096, SLO-adaptive, 1P+1D disaggregation) plus any
  policies given;
* phase split: 200 Poisson requests at 12 req/s under 1:1, 1:2, 1:3, 2:2 and 2, 3, 4 replicas;
* grid: prompts 128/1K/4K/16K x outputs 32/256/1K x concurrency 1/8/32, 2 requests per client.

Simulation is cheap where decodes run alone (they are fast-forwarded) and costs a scheduler
step per model step wherever prefills and arrivals interleave, so the phase split, with its
Poisson arrivals on up to four workers, is the most expensive part.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs

from phasesched.errors import InvalidArgumentError
from phasesched.experiments.context import ExperimentContext, ExperimentResult
from phasesched.experiments.decode_curve import DecodeCurveConfig, run_decode_curve
from phasesched.experiments.grid import GridConfig, run_grid
from phasesched.experiments.mixed_load import MixedLoadConfig, run_mixed_load
from phasesched.experiments.phase_split import PhaseSplitConfig, run_phase_split
from phasesched.experiments.prefill_curve import PrefillCurveConfig, run_prefill_curve
from phasesched.experiments.prefix_cache import PrefixCacheConfig, run_prefix_cache
from phasesched.experiments.replay import ReplayConfig, run_replay
from phasesched.sim.traces import load_trace
from phasesched.sim.workload import Workload
from phasesched.slo import SLO
from phasesched.validators import typed

__all__ = [
    "EXPERIMENTS",
    "MOONCAKE_TRACE",
    "QUICK_REPLAY_LIMIT",
    "SUITE",
    "SuiteOptions",
    "run_experiment",
    "shipped_trace",
    "suite_names",
]

SUITE = ("prefill", "decode", "mixed", "phase-split", "grid")
"""What plain ``phasesched bench`` runs, in order (plus ``replay`` when a trace is given)."""

EXPERIMENTS = (*SUITE, "replay", "prefix-cache")
"""Every experiment name ``phasesched bench <experiment>`` accepts."""

QUICK_REPLAY_LIMIT = 64
"""Requests a quick replay serves when no limit is given."""

MOONCAKE_TRACE = Path("data", "traces", "conversation_trace.jsonl")
"""Mooncake's conversation trace (with ``hash_ids``), where a source checkout ships it."""


def shipped_trace(relative: Path = MOONCAKE_TRACE) -> Path | None:
    """A trace the repository ships: under the working directory or the checkout this package runs from.

    The traces are not in the wheel, so an installed package finds them only when run from a
    checkout (or beside one); ``None`` when neither has the file.
    """
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        if (root / relative).is_file():
            return root / relative
    return None


@attrs.frozen(eq=False)
class SuiteOptions:
    """What the command line may change beyond the context.

    Attributes:
        quick: Run each experiment's ``quick()`` sizes (for tests and smoke checks); a replay
            then serves the first :data:`QUICK_REPLAY_LIMIT` requests unless ``limit`` says otherwise.
        rate: Arrival rate (req/s) for the phase split's Poisson workload and for a replay.
        trace: The workload a replay serves.
        limit: Replay only the first ``limit`` requests of the trace.
        default_trace: Whether the prefix-cache experiment, given no ``trace``, also serves the
            shipped Mooncake conversation trace (:func:`shipped_trace`) when it is there.
        slo: Goodput's targets in the phase split and the replay (``--slo``), instead of their defaults.
        replicas: Aggregated workers the replay runs on.
    """

    quick: bool = False
    rate: float | None = None
    trace: Workload | None = None
    limit: int | None = None
    slo: SLO | None = None
    default_trace: bool = True
    replicas: int = attrs.field(default=1, validator=typed(attrs.validators.gt(0)))


def suite_names(experiment: str | None, options: SuiteOptions) -> tuple[str, ...]:
    """The experiments to run: ``experiment`` alone, or the suite (with ``replay`` if there is a trace).

    Raises:
        InvalidArgumentError: An unknown name, or ``replay`` without a trace.
    """
    if experiment is None:
        return SUITE + (("replay",) if options.trace is not None else ())
    if experiment not in EXPERIMENTS:
        msg = f"no experiment named {experiment!r}; known: {', '.join(EXPERIMENTS)}"
        raise InvalidArgumentError(msg)
    if experiment == "replay" and options.trace is None:
        msg = "the replay experiment needs a trace"
        raise InvalidArgumentError(msg)
    return (experiment,)


def _prefill(context: ExperimentContext, options: SuiteOptions) -> ExperimentResult:
    return run_prefill_curve(context, PrefillCurveConfig.quick() if options.quick else None)


def _decode(context: ExperimentContext, options: SuiteOptions) -> ExperimentResult:
    return run_decode_curve(context, DecodeCurveConfig.quick() if options.quick else None)


def _mixed(context: ExperimentContext, options: SuiteOptions) -> ExperimentResult:
    return run_mixed_load(context, MixedLoadConfig.quick() if options.quick else None)


def _phase_split(context: ExperimentContext, options: SuiteOptions) -> ExperimentResult:
    config = PhaseSplitConfig.quick() if options.quick else PhaseSplitConfig()
    if options.rate is not None:
        config = attrs.evolve(config, rate=options.rate)
    if options.slo is not None:  # the per-request targets; run-level ones are judged on the rows
        config = attrs.evolve(config, ttft_slo_s=options.slo.ttft_s or 3600.0, tpot_slo_s=options.slo.tpot_s or 3600.0)
    return run_phase_split(context, config)


def _grid(context: ExperimentContext, options: SuiteOptions) -> ExperimentResult:
    return run_grid(context, GridConfig.quick() if options.quick else None)


def _replay(context: ExperimentContext, options: SuiteOptions) -> ExperimentResult:
    if options.trace is None:
        msg = "the replay experiment needs a trace"
        raise InvalidArgumentError(msg)
    limit = options.limit if options.limit is not None or not options.quick else QUICK_REPLAY_LIMIT
    slo = options.slo
    targets = {} if slo is None else {"ttft_slo_s": slo.ttft_s, "tpot_slo_s": slo.tpot_s}
    config = ReplayConfig(options.trace, rate=options.rate, limit=limit, replicas=options.replicas, **targets)
    return run_replay(context, config)


def _prefix_cache(context: ExperimentContext, options: SuiteOptions) -> ExperimentResult:
    config = PrefixCacheConfig.quick() if options.quick else PrefixCacheConfig()
    trace = options.trace
    if trace is None and options.default_trace and (path := shipped_trace()) is not None:
        trace = load_trace(path, name="mooncake-conversation")
    if trace is not None:
        config = attrs.evolve(config, trace=trace, trace_limit=options.limit or config.trace_limit)
    return run_prefix_cache(context, config)


_RUNNERS: dict[str, Callable[[ExperimentContext, SuiteOptions], ExperimentResult]] = {
    "prefill": _prefill,
    "decode": _decode,
    "mixed": _mixed,
    "phase-split": _phase_split,
    "grid": _grid,
    "replay": _replay,
    "prefix-cache": _prefix_cache,
}


def run_experiment(name: str, context: ExperimentContext, options: SuiteOptions | None = None) -> ExperimentResult:
    """Run the experiment called ``name`` (one of :data:`EXPERIMENTS`).

    Raises:
        InvalidArgumentError: An unknown name, or ``replay`` without a trace.

    >>> run_experiment("prefill", ExperimentContext(), SuiteOptions(quick=True)).name
    'prefill_curve'
    """
    runner = _RUNNERS.get(name)
    if runner is None:
        msg = f"no experiment named {name!r}; known: {', '.join(EXPERIMENTS)}"
        raise InvalidArgumentError(msg)
    return runner(context, options or SuiteOptions())
