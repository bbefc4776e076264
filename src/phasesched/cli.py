"""The ``phasesched`` command: benchmarks, trace statistics, executor profiles.

::

    phasesched bench                       # the seed suite on H200 + Llama-3-8B, under a minute
    phasesched bench mixed --policy my-plugin-policy
    phasesched bench replay --trace conv.csv --policy vllm,sarathi --rate 8
    phasesched trace stats FILE
    phasesched profile --executor torch --output profile.csv
    phasesched policies

Exit status: 0 on success; 2 for a usage error (argparse's convention); 1 for bad input that
phasesched refuses (a :class:`~phasesched.errors.PhaseschedError`: a malformed or non-text trace,
an unknown policy, whose message lists the known ones, ...) or a file that cannot be read or
written (an ``OSError``), with a one-line ``phasesched: error: ...`` on standard error. Anything
else is a bug in phasesched or a plugin, not the user's mistake: it is not caught, so Python
prints its full traceback (and exits with 1).
Optional dependencies (matplotlib, rich, an executor's torch) are imported only when used, so
``phasesched --help`` answers at once and works without them.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs

from phasesched import EXECUTORS, POLICIES, __version__
from phasesched._cli_options import (
    add_deployment_options,
    add_policy_options,
    add_workload_options,
    build_deployment,
    build_policy_options,
    coverage_report,
    key_values,
    parse_slo,
    results_header,
    synthetic_workload,
)
from phasesched._cli_tune import add_tune
from phasesched.costmodel.batching import METADATA_KEY, RAGGED
from phasesched.costmodel.models import model_by_name
from phasesched.costmodel.profiled import write_profile_csv
from phasesched.costmodel.profiling import ProfileGrid, Profiler, device_name_of
from phasesched.costmodel.vidur import read_vidur
from phasesched.errors import InvalidArgumentError, PhaseschedError
from phasesched.experiments.conclusions import conclusion, slo_line
from phasesched.experiments.context import ExperimentContext, ExperimentResult, distinct_policies, jsonable
from phasesched.experiments.mixed_load import MixedLoadResult, Verdict
from phasesched.experiments.suite import SuiteOptions, run_experiment, suite_names
from phasesched.parallel import BACKENDS
from phasesched.report import MissingExtraError, TerminalUI, require_plotting, write_figures, write_results_json
from phasesched.sim.trace_stats import trace_stats
from phasesched.sim.traces import load_trace
from phasesched.sim.workload import Workload

__all__ = ["EXPERIMENTS", "build_parser", "main"]

EXPERIMENTS = ("prefill", "decode", "mixed", "phase-split", "grid", "replay", "prefix-cache")
"""``bench <experiment>`` choices — :data:`phasesched.experiments.suite.EXPERIMENTS` (a test keeps them equal)."""

_RESULTS_ROOT = Path("bench-results")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (``sys.argv[1:]`` by default) and return the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(arguments)
        problem = _usage_problem(args)
        if problem:
            args.subparser.error(problem)
    except SystemExit as stop:  # --help and --version exit with 0, usage errors with 2
        return stop.code if isinstance(stop.code, int) else 2
    args.arguments = arguments
    try:
        status: int = args.handler(args)
    except BrokenPipeError:  # output piped into `head` and closed: nothing left to tell anyone
        return 1
    except (PhaseschedError, OSError) as error:  # the user's input or files; anything else is a bug: traceback
        print(f"phasesched: error: {error}", file=sys.stderr)  # noqa: T201 -- the CLI's error channel
        return 1
    return status


def _usage_problem(args: argparse.Namespace) -> str | None:
    """A usage error argparse cannot express by itself, or ``None``."""
    if args.command == "bench":
        return _bench_usage_problem(args)
    if args.command == "profile" and args.action == "import-vidur":
        missing = [f"--{k}" for k in ("mlp", "attention", "model", "hardware") if getattr(args, k) is None]
        return f"profile import-vidur needs {', '.join(missing)}" if missing else None
    if args.command == "profile" and args.executor is None:
        return "profile needs --executor NAME (or the import-vidur action)"
    return None


def _bench_usage_problem(args: argparse.Namespace) -> str | None:
    if args.trace is not None and args.arrivals is not None:
        return "give --trace FILE or a synthetic workload (--arrivals), not both"
    if args.arrivals is not None and args.rate is None:
        return "a synthetic workload (--arrivals) needs --rate R"
    if args.experiment == "replay" and args.trace is None and args.arrivals is None:
        return "bench replay needs --trace FILE or a synthetic workload (--arrivals poisson|gamma --rate R)"
    return None


# ------------------------------------------------------------------------------------ parsing
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``phasesched`` and every subcommand."""
    parser = argparse.ArgumentParser(
        prog="phasesched",
        description="Prefill/decode scheduling policies for LLM inference: simulate, compare, profile.",
    )
    parser.add_argument("--version", action="version", version=f"phasesched {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench(commands)
    _add_trace(commands)
    _add_profile(commands)
    add_tune(commands)
    policies = commands.add_parser("policies", help="list the registered scheduling policies")
    policies.set_defaults(handler=_policies, subparser=policies)
    return parser


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            msg = f"expected a positive {kind.__name__}, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        msg = f"expected comma-separated names, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return names


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _names(text))
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="run the benchmark suite or one experiment on the simulator",
        description="Run the seed suite (prefill, decode, mixed, phase-split, grid; plus replay with --trace) "
        "or one experiment, print tables, and write results.json and PNG figures to the output folder.",
    )
    bench.add_argument("experiment", nargs="?", choices=EXPERIMENTS, help="one experiment (default: the suite)")
    add_deployment_options(bench)
    bench.add_argument(
        "--policy",
        type=_names,
        action="append",
        metavar="NAMES",
        help="registered policy names, comma-separated (repeatable), or 'all'; the curves, phase split, grid "
        "and replay run these (default: every registered one, or vllm, sarathi, sglang and no-chunk in the costly "
        "phase split and grid), mixed load adds them to its comparison",
    )
    bench.add_argument(
        "--slo",
        type=parse_slo,
        metavar="TARGETS",
        help="e.g. ttft=500ms,tpot=50ms,itl_p99=100ms: goodput's targets in the phase split and replay, "
        "and what the verdicts are judged against",
    )
    add_policy_options(bench, knobs=True)
    add_workload_options(
        bench,
        arrivals=None,
        limit_help="replay a trace's first N requests, or N synthetic ones (default: the whole trace; 400 synthetic)",
    )
    bench.add_argument(
        "--rate",
        type=_positive(float),
        help="req/s: the replay's rate (a trace rescaled, or the synthetic arrivals') and the phase split's",
    )
    bench.add_argument(
        "--replicas", type=_positive(int), default=1, help="aggregated workers the replay runs on (default 1)"
    )
    bench.add_argument("--seed", type=int, default=0, help="seed of every random workload (default 0)")
    bench.add_argument("--output", type=Path, metavar="DIR", help="output folder (default bench-results/<timestamp>)")
    bench.add_argument(
        "--quick", action="store_true", help="tiny sizes, for smoke tests (a replay serves 64 requests unless --limit)"
    )
    bench.add_argument(
        "--no-plots",
        action="store_true",
        help="write no PNG figures (without matplotlib they are left out anyway, with a warning)",
    )
    bench.add_argument("--quiet", action="store_true", help="no progress bar or tables; only the verdict and paths")
    bench.add_argument(
        "--backend", choices=BACKENDS, default="process", help="where independent simulations run (default process)"
    )
    bench.add_argument("--workers", type=_positive(int), help="local processes (default: every CPU)")
    bench.set_defaults(handler=_bench, subparser=bench)


def _add_trace(commands: Any) -> None:
    trace = commands.add_parser("trace", help="inspect request traces")
    actions = trace.add_subparsers(dest="action", required=True, metavar="ACTION")
    stats = actions.add_parser("stats", help="rate, burstiness and length distributions of a trace file")
    stats.add_argument("file", type=Path, metavar="FILE")
    stats.add_argument(
        "--format",
        choices=("azure", "mooncake", "csv", "jsonl"),
        help="the trace format (default: detected from the first line)",
    )
    stats.add_argument("--spread-ticks", action="store_true", help="spread requests that share a timestamp")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(handler=_trace_stats, subparser=stats)


def _add_profile(commands: Any) -> None:
    profile = commands.add_parser(
        "profile",
        help="measure an executor's step times into a profile CSV",
        description="Time a registered executor on a grid of synthetic steps and write the CSV that "
        "`phasesched bench --cost-model FILE.csv` (ProfiledCostModel.from_csv) reads.",
    )
    profile.add_argument(
        "action",
        nargs="?",
        choices=("import-vidur",),
        help="import-vidur: convert Vidur's mlp.csv and attention.csv instead of measuring",
    )
    profile.add_argument("--executor", metavar="NAME", help="a registered executor (e.g. torch); required to measure")
    profile.add_argument("--output", required=True, type=Path, metavar="FILE.csv", help="the profile to write")
    profile.add_argument("--model", help="the executor's model (torch: a preset such as tiny)")
    profile.add_argument("--device", help="the executor's device (torch: cpu, cuda, cuda:1)")
    profile.add_argument("--dtype", help="the executor's dtype (torch: float32, bfloat16, float16)")
    profile.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another keyword for the executor factory (repeatable), e.g. num_layers=2",
    )
    profile.add_argument(
        "--grid",
        choices=("default", "gpu"),
        default="default",
        help="default: a small grid for a CPU model; gpu: one for an 8B-70B model on a GPU",
    )
    vidur = profile.add_argument_group("import-vidur (Vidur's profiling data, MIT; see phasesched.costmodel.vidur)")
    vidur.add_argument("--mlp", type=Path, metavar="FILE", help="Vidur's mlp.csv for the device and model")
    vidur.add_argument("--attention", type=Path, metavar="FILE", help="Vidur's attention.csv for the device and model")
    vidur.add_argument(
        "--hardware", help="the device the files were measured on, recorded in the profile (e.g. A100-80GB)"
    )
    vidur.add_argument("--tensor-parallel", "--tp", type=_positive(int), default=1, help="the TP degree to import")
    for axis in ("prefill-tokens", "prefill-prefix", "decode-seqs", "decode-context"):
        profile.add_argument(f"--{axis}", type=_ints, metavar="N,N,...", help=f"override the grid's {axis} values")
    profile.add_argument("--page-size", type=_positive(int), default=16, help="tokens per KV page (default 16)")
    profile.add_argument("--num-pages", type=_positive(int), help="KV pages (default: what the largest step needs)")
    profile.add_argument("--repeats", type=_positive(int), default=5, help="timed runs per point (median kept)")
    profile.add_argument("--warmup", type=int, default=1, help="untimed runs per point first")
    profile.add_argument(
        "--passes",
        type=_positive(int),
        default=1,
        help="passes over the grid (median over all runs; with 2+, decode-only steps are retimed between "
        "prefill sizes and the run-to-run spread is recorded)",
    )
    profile.add_argument(
        "--decode-settle",
        type=int,
        default=4,
        help="untimed runs of a decode-only step before each time it is timed (default 4: right after a "
        "larger step, small decode steps can run slower for a few steps)",
    )
    profile.add_argument("--seed", type=int, default=0, help="seed of weights and token ids")
    profile.add_argument("--quiet", action="store_true", help="no progress bar")
    profile.set_defaults(handler=_profile, subparser=profile)


# ------------------------------------------------------------------------------------ bench
def _bench(args: argparse.Namespace) -> int:
    """Run the experiments, show tables, write results.json and figures, end with the verdict."""
    policies = tuple(name for group in args.policy or () for name in group)
    if "all" in policies:  # every registered policy, less aliases, in place of "all"
        policies = tuple(dict.fromkeys(n for p in policies for n in (distinct_policies() if p == "all" else (p,))))
    policy_options = build_policy_options(args)
    deployment = build_deployment(args)
    context = ExperimentContext(
        deployment, policies, args.seed, policy_options=policy_options, backend=args.backend, workers=args.workers
    )
    context.check_policies()  # everything that can fail on bad input fails before the first run
    plots = _can_plot(args.no_plots)
    options = _suite_options(args)
    names = suite_names(args.experiment, options)
    out_dir = args.output or _RESULTS_ROOT / datetime.now().astimezone().strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: list[ExperimentResult] = []
    with TerminalUI(quiet=args.quiet) as ui:
        ui.message(f"Simulating: {context.deployment.describe()}")
        context = attrs.evolve(context, progress=ui)
        for name in names:
            results.append(run_experiment(name, context, options))
            ui.table(results[-1])
            said = conclusion(results[-1])
            if said is not None:
                ui.message(said + "\n")
    figures = write_figures(results, out_dir, subtitle=context.deployment.describe()) if plots else []
    wall_s = time.perf_counter() - started
    mixed = next((r for r in results if isinstance(r, MixedLoadResult)), None)
    verdict = mixed.verdict() if mixed is not None else None
    if mixed is not None and verdict is not None and args.slo is not None:
        verdict = attrs.evolve(verdict, text=verdict.text + slo_line(verdict, args.slo, mixed.rows))
    payload = _payload(args, context, results, verdict=verdict, figures=figures, wall_s=wall_s)
    coverage = coverage_report(deployment)
    if coverage is not None:
        payload["settings"]["profile_coverage"] = coverage
    write_results_json(out_dir / "results.json", payload)
    _summary(ui, verdict, figures, out_dir, wall_s)
    return 0


def _can_plot(no_plots: bool) -> bool:
    """Whether to draw figures: without matplotlib, warn and go on, since results.json is the main output."""
    if no_plots:
        return False
    try:
        require_plotting()
    except MissingExtraError as error:
        print(f"phasesched: warning: {error}; writing results.json without figures", file=sys.stderr)  # noqa: T201
        return False
    return True


def _suite_options(args: argparse.Namespace) -> SuiteOptions:
    """What the suite needs beyond the context; the trace is read (and checked) before anything runs."""
    trace: Workload | None = None
    if args.arrivals is not None:
        trace = synthetic_workload(args, args.limit or 400, args.rate, args.seed)
    elif args.trace is not None:
        trace = load_trace(args.trace, spread_ticks=args.spread_ticks)
    return SuiteOptions(
        quick=args.quick, rate=args.rate, trace=trace, limit=args.limit, slo=args.slo, replicas=args.replicas
    )


def _payload(  # noqa: PLR0913 -- the parts of one results file
    args: argparse.Namespace,
    context: ExperimentContext,
    results: list[ExperimentResult],
    *,
    verdict: Verdict | None,
    figures: list[Path],
    wall_s: float,
) -> dict[str, Any]:
    return {
        **results_header(args, context.deployment),
        "settings": {
            "hardware": args.hardware,
            "model": args.model,
            "tensor_parallel": args.tensor_parallel,
            "cost_model": str(args.cost_model) if args.cost_model else "roofline",
            "policy_options": jsonable(context.policy_options),
            "kv_pages": context.deployment.kv_pages(),
            "page_size": context.deployment.page_size,
            "policies": list(context.policies),
            "seed": args.seed,
            "slo": None if args.slo is None else args.slo.to_dict(),
            "quick": args.quick,
            "rate": args.rate,
            "trace": str(args.trace) if args.trace else None,
            "limit": args.limit,
            "spread_ticks": args.spread_ticks,
            "synthetic": None if args.arrivals is None else _synthetic_settings(args),
            "replicas": args.replicas,
        },
        "experiments": {r.name: {**r.to_dict(), "wall_s": r.wall_s} for r in results},
        "verdict": verdict.to_dict() if verdict is not None else None,
        "conclusions": {r.name: text for r in results if (text := conclusion(r)) is not None},
        "figures": [p.name for p in figures],
        "wall_s": wall_s,
    }


def _synthetic_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The synthetic workload's recipe, as results.json records it."""
    return {
        "arrivals": args.arrivals,
        "cv": args.cv if args.arrivals == "gamma" else None,
        "rate": args.rate,
        "requests": args.limit or 400,
        "prompt_len": repr(args.prompt_len),
        "output_len": repr(args.output_len),
    }


def _summary(ui: TerminalUI, verdict: Verdict | None, figures: list[Path], out_dir: Path, wall_s: float) -> None:
    if verdict is not None:
        ui.message(verdict.text, always=True)
    if figures:
        ui.message("Figures: " + ", ".join(str(p) for p in figures), always=True)
    ui.message(f"Results: {out_dir / 'results.json'} ({wall_s:.1f} s)", always=True)


# ------------------------------------------------------------------------------------ trace, policies
def _trace_stats(args: argparse.Namespace) -> int:
    """Print a trace's statistics, as the staged traces' README computes them."""
    stats = trace_stats(load_trace(args.file, format=args.format, spread_ticks=args.spread_ticks))
    text = json.dumps(jsonable(stats.to_dict()), indent=2) if args.json else stats.format_table()
    print(text)  # noqa: T201 -- the command's output
    return 0


def _policies(args: argparse.Namespace) -> int:  # noqa: ARG001 -- every handler takes the namespace
    for name in POLICIES.names():
        doc = inspect.getdoc(POLICIES.get(name)) or ""
        print(f"{name:24s} {_plain_text(doc.splitlines()[0]) if doc else ''}")  # noqa: T201 -- the command's output
    return 0


_ROLE = re.compile(r":(?:[\w-]+:)+`([^`]*)`")


def _role_text(match: re.Match[str]) -> str:
    """What Sphinx shows for a role: its title, or its target (only the last name after ``~``)."""
    target = match.group(1).lstrip("!")
    title, sep, _ = target.partition(" <")
    if sep:
        return title
    return target[1:].rsplit(".", 1)[-1] if target.startswith("~") else target


def _plain_text(text: str) -> str:
    """Docstring markup as a terminal shows it: ``:func:`~a.b``` as ``b``, literals without backticks.

    >>> _plain_text("Alias of :func:`orca`; see :class:`~phasesched.Scheduler` and ``sjf``.")
    'Alias of orca; see Scheduler and sjf.'
    """
    return _ROLE.sub(_role_text, text).replace("``", "").replace("`", "")


# ------------------------------------------------------------------------------------ profile
def _profile(args: argparse.Namespace) -> int:
    """Build the executor, time it on the grid, write the profile CSV with its metadata."""
    if args.action == "import-vidur":
        return _import_vidur(args)
    grid = _profile_grid(args)
    num_pages = args.num_pages or grid.max_pages(args.page_size)
    executor, options = _executor(args, num_pages)
    profiler = Profiler(
        executor,
        num_pages=num_pages,
        page_size=args.page_size,
        grid=grid,
        seed=args.seed,
        decode_settle=args.decode_settle,
    )
    with TerminalUI(quiet=args.quiet) as ui:
        for number in range(1, args.passes + 1):
            profiler.run_pass(
                repeats=args.repeats,
                warmup=args.warmup if number == 1 else 0,
                revisit_decodes=args.passes > 1,
                progress=functools.partial(ui, f"profile pass {number}/{args.passes}"),
            )
    hardware = device_name_of(executor)
    metadata = {
        "executor": args.executor,
        **{key: str(value) for key, value in options.items()},
        **({"hardware": hardware} if hardware else {}),  # where the times were measured
        "repeats": str(args.repeats),
        "warmup": str(args.warmup),
        "passes": str(args.passes),
        "grid": "; ".join(f"{k}={' '.join(map(str, v))}" for k, v in _grid_axes(grid).items()),
        "phasesched": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    profiler.write_csv(args.output, metadata)
    points = profiler.points()
    fastest, slowest = (f(p.step_time_s for p in points) * 1e3 for f in (min, max))
    print(f"wrote {len(points)} points to {args.output} (steps of {fastest:.3f} to {slowest:.3f} ms)")  # noqa: T201
    if profiler.decode_batching is None:
        print(  # noqa: T201
            f"note: executor {args.executor!r} declares no decode batching; the profile reads a step's "
            "decodes at their mean context (right for a ragged kernel)"
        )
    return 0


def _import_vidur(args: argparse.Namespace) -> int:
    """Convert Vidur's operator profiles into our profile CSV, recording the device and model."""
    spec = model_by_name(args.model)
    profile = read_vidur(args.mlp, args.attention, num_layers=spec.num_layers, tp=args.tensor_parallel)
    overrides = {k: getattr(args, k.replace("-", "_")) for k in ("prefill-prefix", "decode-seqs", "decode-context")}
    points = profile.points(args.prefill_tokens, **_vidur_axes(overrides))
    metadata = {
        "source": "vidur",
        "hardware": args.hardware,
        "model": spec.name,
        "tensor_parallel": str(args.tensor_parallel),
        "mlp": str(args.mlp),
        "attention": str(args.attention),
        # Vidur prices a batch of decodes by their mean context, as a ragged kernel runs them.
        METADATA_KEY: RAGGED.to_metadata(),
        "phasesched": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_profile_csv(args.output, points, metadata)
    fastest, slowest = (f(p.step_time_s for p in points if p.step_time_s > 0) * 1e3 for f in (min, max))
    print(f"wrote {len(points)} points to {args.output} (steps of {fastest:.3f} to {slowest:.3f} ms)")  # noqa: T201
    return 0


def _vidur_axes(overrides: dict[str, tuple[int, ...] | None]) -> dict[str, tuple[int, ...]]:
    names = {"prefill-prefix": "prefixes", "decode-seqs": "decodes", "decode-context": "contexts"}
    return {names[k]: v for k, v in overrides.items() if v}


def _grid_axes(grid: ProfileGrid) -> dict[str, tuple[int, ...]]:
    return {k: getattr(grid, k) for k in ("prefill_tokens", "prefill_prefix", "decode_seqs", "decode_context")}


def _profile_grid(args: argparse.Namespace) -> ProfileGrid:
    """The preset grid with any axes the command line overrides."""
    grid = ProfileGrid.gpu_default() if args.grid == "gpu" else ProfileGrid()
    overrides = {k: getattr(args, k) for k in _grid_axes(grid) if getattr(args, k) is not None}
    return attrs.evolve(grid, **overrides)


def _executor(args: argparse.Namespace, num_pages: int) -> tuple[Any, dict[str, Any]]:
    """``EXECUTORS.get(name)(**options)`` with the options its factory takes.

    Options the user gave (``--model``, ``--device``, ``--dtype``, ``--option``) must be accepted;
    the KV geometry and seed are passed only to a factory that takes them (the simulated
    executor has no KV, for instance).
    """
    factory = EXECUTORS.get(args.executor)
    given = {k: v for k in ("model", "device", "dtype") if (v := getattr(args, k)) is not None}
    given.update(key_values(args.option))
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    refused = [k for k in given if k not in params and not takes_any]
    if refused:
        msg = (
            f"executor {args.executor!r} does not take {', '.join(refused)}; it takes: {', '.join(params) or 'nothing'}"
        )
        raise InvalidArgumentError(msg)
    implied = {"num_pages": num_pages, "page_size": args.page_size, "seed": args.seed}
    options = {k: v for k, v in implied.items() if takes_any or k in params} | given
    # The metadata records the factory's own defaults too, so the file says how it was measured.
    defaults = {k: p.default for k, p in params.items() if isinstance(p.default, (str, int, float, bool))}
    return factory(**options), defaults | options


if __name__ == "__main__":  # pragma: no cover -- `python -m phasesched.cli`
    sys.exit(main())
