"""Simulation speed: CPU time per simulated request on the workloads Vidur is compared on.

Every case runs on workers of Llama-3-70B over 2 x A100-80GB (TP 2; the KV left beside the
weights holds about 25K tokens, so queues build up and requests are preempted):

- ``poisson-1k`` / ``poisson-10k``: 1,024-token prompts and 256 output tokens, Poisson at
  1 request/s, under ``vllm``;
- ``sarathi-1k`` / ``sarathi-10k``: the same under ``sarathi`` (512-token chunks and budget);
- ``azure-conv``: the Azure LLM inference conversation trace (19,366 requests over 58 minutes)
  at its own rate, under ``vllm``;
- ``azure-conv-pd``: its first 4,000 requests, replayed at 2 requests/s (a load the pools
  sustain: its own rate overloads them), on a disaggregated deployment: two prefill and two
  decode workers (each as above) joined by a 50 GB/s link, under ``vllm``. A decode worker's
  runs there end where KV lands on it: this case shows how well fast-forward does across pools.
- ``azure-conv-8r``: its first 8,000 requests at 4 requests/s on eight aggregated replicas
  (each as above), under ``vllm``: an arrival cuts only the run of the replica it is routed to.

The table gives CPU seconds (``time.process_time``, so other processes on the machine cost
less than in wall time), milliseconds of CPU per simulated request, steps taken and how many
were fast-forwarded (runs of pure decodes, and runs of decodes beside ongoing prefill chunks,
which Sarathi's 512-token chunks make common), and the runs taken per request. A run costs
about the same however many steps it spans, so this count, set by the workload (how often an
arrival or a finish ends a run), is part of why one case costs more per request than another.
The Poisson workload sits near saturation, and longer simulations of it spend more time with
empty queues, where every arrival ends a run: 1.09 runs per request over 1,000 requests, 1.53
over 30,000. Target: at most 0.5 ms of CPU per request (Vidur 0.0.26 takes about 5 ms on the
same workloads), and 1,000,000 requests (``--scale 1000000``: the Poisson workload under
``vllm``) in under two minutes of CPU.
``--repeat N`` runs the cases N times, round-robin, and reports each case's run with the least
CPU, with the range over the runs: on a shared machine other work only ever adds time (a busy
neighbour made the same run take 0.62 or 1.05 ms per request minutes apart), so the least is
the closest to what the code costs. ``--profile`` adds a cProfile summary per case: the
functions that take the most time, their own and with what they call; and the calls made per
simulated request (Python functions, and C ones such as numpy's), a count that does not depend
on how busy or fast the machine is: on a machine too noisy to time a small change, compare two
versions by it.

Compare two versions by running this script with each on ``PYTHONPATH``, alternately::

    PYTHONPATH=/path/to/old/src python benchmarks/sim_speed.py --json old.json

Usage::

    python benchmarks/sim_speed.py [--cases poisson-1k,sarathi-1k,...] [--trace PATH] [--profile]
        [--top 15] [--scale N] [--repeat N] [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

from phasesched import load_policy
from phasesched.sim import Deployment, Disaggregation, Poisson, Workload, load_trace, simulate, synthetic

REPO = Path(__file__).resolve().parents[1]
TRACE_CANDIDATES = (
    REPO / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv",
    REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv",
    Path("/work/shared/traces/AzureLLMInferenceTrace_conv.csv"),
)
DEPLOYMENT = Deployment(hardware="A100-80GB", model="llama-3-70b", tensor_parallel=2)


def poisson(n: int) -> Callable[[Path | None], Workload]:
    """``n`` requests of 1,024 prompt and 256 output tokens, Poisson at 1 request/s."""
    return lambda _: synthetic(n, Poisson(1.0), 1024, 256, seed=0, name=f"poisson-{n}")


def azure(trace: Path | None) -> Workload:
    """The Azure conversation trace at its own rate."""
    if trace is None:
        msg = "the Azure conversation trace was not found: pass --trace"
        raise SystemExit(msg)
    return load_trace(trace)


def azure_head(n: int, rate: float) -> Callable[[Path | None], Workload]:
    """The Azure conversation trace's first ``n`` requests at ``rate`` requests/s."""
    return lambda trace: azure(trace).head(n).scaled_to_rate(rate)


CASES: dict[str, tuple[str, Callable[[Path | None], Workload]]] = {
    "poisson-1k": ("vllm", poisson(1_000)),
    "poisson-10k": ("vllm", poisson(10_000)),
    "sarathi-1k": ("sarathi", poisson(1_000)),
    "sarathi-10k": ("sarathi", poisson(10_000)),
    "azure-conv": ("vllm", azure),
    "azure-conv-pd": ("vllm", azure_head(4_000, 2.0)),
    "azure-conv-8r": ("vllm", azure_head(8_000, 4.0)),
}
OPTIONS: dict[str, dict[str, object]] = {
    "azure-conv-pd": {"disaggregation": Disaggregation(2, 2)},
    "azure-conv-8r": {"replicas": 8},
}
"""Per case, what else :func:`simulate` is given."""


def run_case(name: str, policy: str, workload: Workload, *, profile: bool, top: int) -> dict[str, object]:
    """Simulate ``workload`` once; CPU and wall time, steps, and a profile summary if asked."""
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:  # one-time work (imports, caches) would land in the first profiled case's count
        simulate(workload.head(2), load_policy(policy), DEPLOYMENT, **OPTIONS.get(name, {}))
        gc.collect()  # and so would finalizers of earlier garbage collected during the run
    cpu, wall = time.process_time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    result = simulate(workload, load_policy(policy), DEPLOYMENT, **OPTIONS.get(name, {}))
    if profiler is not None:
        profiler.disable()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    row: dict[str, object] = {
        "case": name,
        "policy": policy,
        "requests": len(workload),
        "cpu_s": cpu,
        "wall_s": wall,
        "cpu_ms_per_request": 1000.0 * cpu / len(workload),
        "steps": result.steps,
        "fast_forwarded_steps": result.fast_forwarded_steps,
        "runs_per_request": sum(worker.runs for worker in result.workers) / len(workload),
        "completed": result.metrics["completed"],
        "median_ttft_ms": result.metrics["median_ttft_ms"],
        "p99_itl_ms": result.metrics["p99_itl_ms"],
        "profiled": profile,
    }
    if profiler is not None:
        row["profile"] = {order: _top(profiler, order, top) for order in ("tottime", "cumulative")}
        row["calls_per_request"] = pstats.Stats(profiler).total_calls / len(workload)  # type: ignore[attr-defined]
    return row


def least_cpu(runs: list[dict[str, object]]) -> dict[str, object]:
    """The run of a case with the least CPU, with every run's CPU per request (``runs_ms_per_request``)."""
    least = dict(min(runs, key=lambda run: float(run["cpu_s"])))  # type: ignore[arg-type]
    least["runs_ms_per_request"] = [run["cpu_ms_per_request"] for run in runs]
    return least


def _top(profiler: cProfile.Profile, order: str, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs().sort_stats(order).print_stats(top)
    lines = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start:]).rstrip()


def print_table(rows: list[dict[str, object]]) -> None:
    header = (
        f"{'case':<16}{'policy':<9}{'requests':>10}{'CPU s':>9}{'ms/req':>8}{'wall s':>10}"
        f"{'steps':>12}{'ff steps':>12}{'runs/req':>9}{'TTFT p50 s':>11}{'ITL p99 ms':>11}"
    )
    profiled = any(r["profiled"] for r in rows)
    repeated = any(len(r.get("runs_ms_per_request", ())) > 1 for r in rows)  # type: ignore[arg-type]
    if repeated:
        header += f"{'ms/req range':>15}"
    if profiled:
        header += f"{'calls/req':>11}"
    print(DEPLOYMENT.describe())
    print(header)
    print("-" * len(header))
    for r in rows:
        spread: list[float] = r.get("runs_ms_per_request", [])  # type: ignore[assignment]
        span = f"{f'{min(spread):.3f}-{max(spread):.3f}':>15}" if repeated and spread else ""
        calls = f"{r['calls_per_request']:>11,.0f}" if "calls_per_request" in r else ""
        print(
            f"{r['case']:<16}{r['policy']:<9}{r['requests']:>10,}{r['cpu_s']:>9.2f}{r['cpu_ms_per_request']:>8.3f}"
            f"{r['wall_s']:>10.2f}{r['steps']:>12,}{r['fast_forwarded_steps']:>12,}{r['runs_per_request']:>9.2f}"
            f"{r['median_ttft_ms'] / 1000:>11.1f}{r['p99_itl_ms']:>11.1f}{span}{calls}"
        )
    if repeated:
        print("(each case's run with the least CPU; the range is over all its runs)")
    if profiled:
        print("(profiled: CPU times include the profiler's own cost; calls/req does not depend on it)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--trace", type=Path, help="the Azure conversation trace (found by default if staged)")
    parser.add_argument("--profile", action="store_true", help="print where the time goes (slows the runs)")
    parser.add_argument("--top", type=int, default=15, help="functions per profile listing")
    parser.add_argument("--scale", type=int, help="also simulate N Poisson requests under vllm (e.g. 1000000)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case, round-robin; the least CPU is shown")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    trace = args.trace or next((p for p in TRACE_CANDIDATES if p.exists()), None)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases: {', '.join(unknown)}")
    jobs = [(n, *CASES[n]) for n in names]
    if args.scale:
        jobs.append((f"poisson-{args.scale}", "vllm", poisson(args.scale)))
    workloads = {name: make(trace) for name, _, make in jobs}
    runs: dict[str, list[dict[str, object]]] = {name: [] for name, _, _ in jobs}
    for _ in range(args.repeat):  # round-robin: a busy spell spreads over the cases
        for name, policy, _ in jobs:
            runs[name].append(run_case(name, policy, workloads[name], profile=args.profile, top=args.top))
    rows = [least_cpu(case_runs) for case_runs in runs.values()]
    if args.profile:
        for row in rows:
            for order, text in row["profile"].items():  # type: ignore[attr-defined]
                print(f"\n== {row['case']}: top functions by {order}\n{text}")
    print()
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"python": sys.version, "rows": rows}, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
