"""``phasesched tune``: the command line of :func:`phasesched.tune.run_tune`. Private to :mod:`phasesched.cli`."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs

from phasesched._cli_options import (
    add_deployment_options,
    add_policy_options,
    add_workload_options,
    build_deployment,
    build_policy_options,
    build_workloads,
    coverage_report,
    parse_slo,
    positive_int,
    results_header,
)
from phasesched.errors import InvalidArgumentError
from phasesched.experiments.context import ExperimentContext, distinct_policies
from phasesched.parallel import BACKENDS
from phasesched.report import MissingExtraError, TerminalUI, write_results_json
from phasesched.tune import CapacityConfig, SearchSpace, TuneResult, TuneRun, run_tune

__all__ = ["add_tune"]

_DEFAULT_CHUNKS = (256, 512, 1024, 2048)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) <= 0:
        msg = f"expected comma-separated positive integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return values


_AUTO_SCREEN = 1000
_AUTO_SCREEN_FROM = 4000


def _screen_size(text: str) -> int | str | None:
    if text in {"auto", "off"}:
        return None if text == "off" else text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        msg = f"expected a positive number of requests, auto or off, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _screen(args: argparse.Namespace, requests: int) -> int | None:
    """Requests to screen on: ``--screen``, with ``auto`` resolved against the workload's size."""
    if args.screen == "auto":
        return _AUTO_SCREEN if requests >= _AUTO_SCREEN_FROM else None
    screen: int | None = args.screen
    return screen


def add_tune(commands: Any) -> None:
    """Add ``tune`` to the subcommands."""
    tune = commands.add_parser(
        "tune",
        help="find the policy, chunk, token budget and GPU layout with the most goodput per GPU under an SLO",
        description="Search policy x chunk size x token budget x (aggregated replicas | every P:D split) on "
        "--gpus GPUs; find each configuration's capacity (the highest request rate meeting the SLO, by "
        "bisection); print a ranked table and one recommendation; write results.json and a Pareto plot.",
    )
    tune.add_argument("--gpus", type=int, required=True, help="GPUs in all (workers = GPUs / TP)")
    tune.add_argument(
        "--slo",
        type=parse_slo,
        default=parse_slo("ttft=1s,tpot=50ms"),
        metavar="TARGETS",
        help="e.g. ttft=500ms,tpot=50ms,itl_p99=200ms,attainment=90%% (default ttft=1s,tpot=50ms)",
    )
    search = tune.add_argument_group("search space")
    search.add_argument(
        "--policy", action="append", metavar="NAMES", help="policies (default: every registered one, less aliases)"
    )
    search.add_argument("--chunks", type=_ints, default=_DEFAULT_CHUNKS, metavar="N,N", help="chunk sizes tried")
    search.add_argument(
        "--token-budgets", type=_ints, metavar="N,N", help="token budgets tried (default: each policy's)"
    )
    search.add_argument("--no-split", action="store_true", help="aggregated replicas only")
    search.add_argument("--no-aggregated", action="store_true", help="P:D splits only")
    search.add_argument(
        "--search",
        choices=("grid", "optuna"),
        default="grid",
        help="grid: every candidate; optuna: a TPE study picks --trials of them (the [tune] extra)",
    )
    search.add_argument("--trials", type=int, default=32, help="Optuna trials (default 32)")
    bisect = tune.add_argument_group("capacity search")
    bisect.add_argument("--tolerance", type=float, default=0.05, help="bisection stops within this share (0.05)")
    bisect.add_argument("--max-probes", type=int, default=10, help="simulations per configuration at most")
    bisect.add_argument("--start-rate", type=float, default=2.0, help="first rate tried, req/s per worker")
    bisect.add_argument(
        "--screen",
        type=_screen_size,
        default="auto",
        metavar="N|auto|off",
        help="measure every configuration on the first N requests first, then only the best third (and any near "
        "the best) on all "
        f"of them (auto: {_AUTO_SCREEN} when --limit is {_AUTO_SCREEN_FROM} or more; grid search)",
    )
    bisect.add_argument(
        "--screen-keep",
        type=float,
        default=0.25,
        metavar="SHARE",
        help="configurations within this share of the best screened goodput per GPU are measured fully (0.25)",
    )
    add_policy_options(tune, knobs=False)  # chunk and budget are searched (--chunks, --token-budgets)
    add_workload_options(tune, arrivals="poisson", limit_help="requests per run (a trace's first N; default 400)")
    tune.add_argument("--seeds", type=int, default=1, metavar="N", help="workload seeds (the first is searched)")
    add_deployment_options(tune)
    running = tune.add_argument_group("running")
    running.add_argument("--backend", choices=BACKENDS, default="process", help="where simulations run")
    running.add_argument("--workers", type=int, help="local processes (default: every CPU)")
    running.add_argument("--address", help="Ray cluster address (with --backend ray)")
    running.add_argument("--output", type=Path, metavar="DIR", help="output folder (default tune-results/<time>)")
    running.add_argument("--no-plots", action="store_true", help="write no Pareto plot")
    running.add_argument("--quiet", action="store_true", help="no progress or table; only the recommendation")
    tune.set_defaults(handler=_tune, subparser=tune)


def _tune(args: argparse.Namespace) -> int:
    """Check everything, search, show the table and the recommendation, write results."""
    deployment = build_deployment(args)
    policies = tuple(n.strip() for group in args.policy or [] for n in group.split(",") if n.strip())
    context = ExperimentContext(deployment, policies or distinct_policies(), policy_options=build_policy_options(args))
    context.check_policies()
    workloads = build_workloads(args)
    space = SearchSpace(
        context.policies,
        chunks=args.chunks,
        budgets=args.token_budgets or (None,),
        aggregated=not args.no_aggregated,
        disaggregated=not args.no_split,
    )
    capacity = CapacityConfig(start_rate=args.start_rate, tolerance=args.tolerance, max_probes=args.max_probes)
    if not 0.0 < args.screen_keep < 1.0:
        msg = f"--screen-keep must be in (0, 1), got {args.screen_keep}"
        raise InvalidArgumentError(msg)
    run = TuneRun(
        args.gpus,
        capacity,
        args.backend,
        args.workers,
        args.address,
        search=args.search,
        trials=args.trials,
        screen=_screen(args, len(workloads[0])),
        screen_keep=args.screen_keep,
    )
    out_dir = args.output or Path("tune-results") / datetime.now().astimezone().strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with TerminalUI(quiet=args.quiet) as ui:
        ui.message(f"Simulating: {deployment.describe()}")
        ui.message(f"Workload: {workloads[0]!r}, {len(workloads)} seed(s); SLO: {args.slo.describe()}")
        result = run_tune(attrs.evolve(context, progress=ui), workloads, args.slo, space, run)
        ui.table(result)
    figures = _figures(args, result, out_dir, deployment.describe())
    payload = _payload(args, context, result, figures, time.perf_counter() - started)
    payload["profile_coverage"] = coverage_report(deployment)
    write_results_json(out_dir / "results.json", payload)
    ui.message(result.recommendation, always=True)
    ui.message(
        f"Results: {out_dir / 'results.json'} ({result.simulations} simulations, {result.wall_s:.1f} s)", always=True
    )
    return 0


def _figures(args: argparse.Namespace, result: TuneResult, out_dir: Path, subtitle: str) -> list[Path]:
    if args.no_plots:
        return []
    from phasesched.tune.plot import plot_pareto  # noqa: PLC0415 -- matplotlib only when plotting

    try:
        return [plot_pareto(result, out_dir / "tune_pareto.png", subtitle)]
    except MissingExtraError as error:
        print(f"phasesched: warning: {error}; writing results.json without the Pareto plot", file=sys.stderr)  # noqa: T201
        return []


def _payload(
    args: argparse.Namespace, context: ExperimentContext, result: TuneResult, figures: list[Path], wall_s: float
) -> dict[str, Any]:
    return {
        **results_header(args, context.deployment),
        "workload": {
            "trace": str(args.trace) if args.trace else None,
            "requests": args.limit or 400,
            "seeds": args.seeds,
        },
        "backend": args.backend,
        "tune": result.to_dict(),
        "figures": [p.name for p in figures],
        "wall_s": wall_s,
    }
