"""Command-line options shared by ``bench`` and ``tune``: workloads, deployments, policies, SLOs.

Private to :mod:`phasesched.cli`. Each ``add_*`` function adds a group of options to a parser
and each ``build_*`` function turns the parsed namespace into phasesched's own values, so the
two commands express workloads and deployments the same way.
"""

from __future__ import annotations

import argparse
import ast
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs

from phasesched import __version__
from phasesched.costmodel.batching import decode_batching_from_metadata
from phasesched.costmodel.coverage import GridCoverage
from phasesched.costmodel.hardware import HARDWARE_PRESETS, same_hardware
from phasesched.costmodel.models import MODEL_PRESETS
from phasesched.costmodel.profiled import ProfiledCostModel, read_profile_csv
from phasesched.errors import InvalidArgumentError
from phasesched.sim.arrivals import ArrivalProcess, Gamma, Poisson
from phasesched.sim.builders import synthetic
from phasesched.sim.deployment import Deployment
from phasesched.sim.lengths import Empirical, Fixed, LengthDist, LogNormal, Uniform
from phasesched.sim.traces import load_trace
from phasesched.sim.workload import Workload
from phasesched.slo import SLO

__all__ = [
    "add_deployment_options",
    "add_policy_options",
    "add_workload_options",
    "build_deployment",
    "build_policy_options",
    "build_workloads",
    "coverage_report",
    "key_values",
    "length_dist",
    "parse_slo",
    "positive_int",
    "synthetic_workload",
]


def key_values(pairs: list[str], option: str = "--option") -> dict[str, Any]:
    """``["a=1", "b=x"]`` as ``{"a": 1, "b": "x"}``: Python literals where they parse, strings otherwise."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            msg = f"{option} expects KEY=VALUE, got {pair!r}"
            raise InvalidArgumentError(msg)
        try:
            out[key.strip()] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key.strip()] = text
    return out


def parse_slo(text: str) -> SLO:
    """Argparse type of ``--slo``."""
    try:
        return SLO.parse(text)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def length_dist(text: str) -> LengthDist:
    """``512``, ``fixed:512``, ``uniform:128:2048``, ``lognormal:1024:0.8[:lo:hi]`` or ``trace:FILE:prompt|output``.

    >>> length_dist("uniform:16:64")
    Uniform(lo=16, hi=64)
    """
    kind, _, rest = text.partition(":")
    args = rest.split(":") if rest else []
    try:
        if kind.isdigit():
            return Fixed(int(kind))
        if kind == "fixed":
            return Fixed(int(args[0]))
        if kind == "uniform":
            return Uniform(int(args[0]), int(args[1]))
        if kind == "lognormal":
            bounds = [int(v) for v in args[2:4]]
            return LogNormal(float(args[0]), float(args[1]), *bounds)
        if kind == "trace":
            trace = load_trace(Path(args[0]))
            return Empirical(trace.output_len if args[1:] == ["output"] else trace.prompt_len)
    except (IndexError, ValueError) as error:
        msg = f"bad length distribution {text!r}: {error}"
        raise argparse.ArgumentTypeError(msg) from None
    msg = f"unknown length distribution {text!r}; use N, fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA, trace:FILE"
    raise argparse.ArgumentTypeError(msg)


def add_workload_options(parser: argparse.ArgumentParser, *, arrivals: str | None, limit_help: str) -> None:
    """A trace, or a synthetic open loop (``arrivals``: the default arrival process; ``None``: only when asked for)."""
    group = parser.add_argument_group("workload (a trace, or a synthetic open loop)")
    group.add_argument("--trace", type=Path, metavar="FILE", help="a trace (azure, mooncake, csv, jsonl)")
    group.add_argument("--spread-ticks", action="store_true", help="spread trace requests that share a timestamp")
    group.add_argument("--limit", "--requests", type=positive_int, metavar="N", help=limit_help)
    group.add_argument(
        "--arrivals",
        choices=("poisson", "gamma"),
        default=arrivals,
        help=f"synthetic open-loop arrivals (default {arrivals or 'none: a trace'})",
    )
    group.add_argument("--cv", type=float, default=2.0, help="gamma arrivals' coefficient of variation (default 2)")
    group.add_argument(
        "--prompt-len",
        type=length_dist,
        default="lognormal:1024:0.8:16:16384",
        metavar="DIST",
        help="synthetic prompt lengths: N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:LO:HI], trace:FILE:prompt",
    )
    group.add_argument(
        "--output-len",
        type=length_dist,
        default="lognormal:200:0.8:4:2048",
        metavar="DIST",
        help="synthetic output lengths (same forms; trace:FILE:output samples a trace's)",
    )


def add_policy_options(parser: argparse.ArgumentParser, *, knobs: bool) -> None:
    """``--policy-option`` and, with ``knobs``, its common fields as flags of their own."""
    group = parser.add_argument_group("policy options (for every policy)")
    group.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a PolicyOptions field for every policy (repeatable), e.g. chunk_size=1024 or max_num_seqs=128",
    )
    group.add_argument("--max-num-seqs", type=positive_int, metavar="N", help="sequences a step may carry")
    if knobs:
        group.add_argument("--chunk-size", type=positive_int, metavar="N", help="prefill chunk (tokens)")
        group.add_argument(
            "--token-budget", type=positive_int, metavar="N", help="tokens per step (max_num_batched_tokens)"
        )


_KNOBS = {"max_num_seqs": "max_num_seqs", "chunk_size": "chunk_size", "token_budget": "max_num_batched_tokens"}


def build_policy_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--policy-option`` pairs plus the flags of :func:`add_policy_options`.

    Raises:
        InvalidArgumentError: A flag and a ``--policy-option`` set one field to two values.
    """
    out = key_values(args.policy_option, "--policy-option")
    for flag, field in _KNOBS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if out.get(field, value) != value:
            msg = f"--{flag.replace('_', '-')} {value} and --policy-option {field}={out[field]!r} disagree"
            raise InvalidArgumentError(msg)
        out[field] = value
    return out


def positive_int(text: str) -> int:
    """A positive int, as an argparse type."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        msg = f"expected a positive int, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def add_deployment_options(parser: argparse.ArgumentParser) -> None:
    """Hardware, model, TP, memory and cost model of one worker."""
    group = parser.add_argument_group("deployment (one worker)")
    group.add_argument("--hardware", default="H200", help=f"hardware preset: {', '.join(HARDWARE_PRESETS)}")
    group.add_argument("--model", default="llama-3-8b", help=f"model preset: {', '.join(MODEL_PRESETS)}")
    group.add_argument("--tensor-parallel", "--tp", type=int, default=1, help="GPUs per worker")
    group.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory vLLM may use (default 0.9)"
    )
    group.add_argument("--num-pages", type=int, help="KV pages per worker, instead of what memory gives")
    group.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    group.add_argument(
        "--watermark", type=float, default=0.0, help="share of KV pages admissions leave free (vLLM's; default 0)"
    )
    group.add_argument(
        "--cost-model", type=Path, metavar="FILE.csv", help="price steps with a profiled table instead of the roofline"
    )
    group.add_argument(
        "--allow-profile-mismatch",
        action="store_true",
        help="use a profile recorded on other hardware or another model (the run then takes its names)",
    )


def build_deployment(args: argparse.Namespace) -> Deployment:
    """The worker the options describe; KV capacity is computed (and checked) here."""
    cost, names = None, {"hardware": args.hardware, "model": args.model}
    source = f"roofline ({args.hardware} + {args.model} presets)"
    if args.cost_model is not None:
        _, metadata = read_profile_csv(args.cost_model)
        names = _profile_names(metadata, names, allow=args.allow_profile_mismatch, path=args.cost_model)
        cost = GridCoverage(ProfiledCostModel.from_csv(args.cost_model))
        source = f"profiled table {args.cost_model}"
        if decode_batching_from_metadata(metadata) is None:
            source += " (it records no decode_batching: decodes are read at their mean context)"
    deployment = Deployment(
        tensor_parallel=args.tensor_parallel,
        page_size=args.page_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cost_model=cost,
        num_pages=args.num_pages,
        cost_model_source=source,
        watermark=args.watermark,
        **names,
    )
    deployment.kv_pages()
    return deployment


def coverage_report(deployment: Deployment) -> dict[str, Any] | None:
    """A profiled cost model's out-of-grid counts for results.json (``None`` for the roofline); warns on stderr.

    The counts are complete whatever the backend: tasks on other processes report theirs back
    (:func:`phasesched.experiments.context.map_counting`).
    """
    coverage = deployment.cost_model
    if not isinstance(coverage, GridCoverage):
        return None
    warning = coverage.warning()
    if warning:
        print(f"phasesched: warning: {warning}", file=sys.stderr)  # noqa: T201 -- the CLI's warnings
    return {"predictions": coverage.predictions, "outside_grid": coverage.outside, "warning": warning}


def _profile_names(metadata: dict[str, str], names: dict[str, str], *, allow: bool, path: Path) -> dict[str, str]:
    """The deployment's names, checked against the profile's recorded ones."""
    recorded = {"hardware": metadata.get("hardware") or metadata.get("device"), "model": metadata.get("model")}
    differ = {k: v for k, v in recorded.items() if v is not None and not _same_name(k, v, names[k])}
    if not differ:
        return names
    what = ", ".join(f"{k} {v!r} (the run says {names[k]!r})" for k, v in differ.items())
    if not allow:
        msg = (
            f"profile {path} was recorded with {what}; its step times do not describe the deployment. "
            "Pass matching --hardware/--model, or --allow-profile-mismatch to simulate the profiled setup"
        )
        raise InvalidArgumentError(msg)
    return {**names, **differ}


def _same_name(kind: str, recorded: str, name: str) -> bool:
    """Whether a profile's recorded hardware or model is the run's (a GPU names itself ``NVIDIA H200``)."""
    return same_hardware(recorded, name) if kind == "hardware" else recorded.lower() == name.lower()


def synthetic_workload(args: argparse.Namespace, count: int, rate: float, seed: int) -> Workload:
    """``count`` requests of the synthetic open loop the options describe, at ``rate`` req/s."""
    arrivals: ArrivalProcess = Gamma(rate, args.cv) if args.arrivals == "gamma" else Poisson(rate)
    shape = f"{args.arrivals}{f'(cv={args.cv:g})' if args.arrivals == 'gamma' else ''}"
    return synthetic(count, arrivals, args.prompt_len, args.output_len, seed=seed, name=f"{shape}-n{count}-seed{seed}")


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    """One workload per seed: windows of the trace one after another, or synthetic draws."""
    count = args.limit or 400
    if args.seeds < 1 or count < 2:
        msg = "--seeds must be >= 1 and --limit >= 2"
        raise InvalidArgumentError(msg)
    if args.trace is None:
        return [synthetic_workload(args, count, 1.0, seed) for seed in range(args.seeds)]
    trace = load_trace(args.trace, spread_ticks=args.spread_ticks)
    out = []
    for seed in range(args.seeds):
        start = seed * count
        if start + 2 > len(trace):
            break
        window = trace.window(float(trace.arrival_s[start])).head(count)
        out.append(attrs.evolve(window, name=f"{trace.name}[{start}:{start + len(window)}]"))
    return out


def results_header(args: argparse.Namespace, deployment: Deployment) -> dict[str, Any]:
    """The head every results.json shares: what wrote it, when, from which command, for which deployment."""
    return {
        "phasesched_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": ["phasesched", *args.arguments],
        "deployment": deployment.to_dict(),
    }
