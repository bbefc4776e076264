"""Simulation speed: simulated requests per wall second replaying the Azure conversation trace.

The trace (19,366 requests over 58 minutes) is replayed at its own rate and at 4x, on the
default deployment (H200 + Llama-3-8B), with and without decode fast-forward, and the table
reports wall time, requests per wall second, simulated steps and how many were fast-forwarded,
plus the peak traced Python memory (to show it stays flat as requests finish).
Target: the whole trace in under 20 s.

Usage::

    python benchmarks/sim_speed.py [--trace PATH] [--policy vllm] [--limit N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

from phasesched import load_policy
from phasesched.sim import Poisson, Uniform, load_trace, simulate, synthetic

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def run_case(
    trace_path: Path, policy: str, speedup: float, limit: int | None, *, fast_forward: bool, trace_memory: bool
) -> dict[str, object]:
    workload = load_trace(trace_path)
    if limit:
        workload = workload.head(limit)
    if speedup != 1.0:
        workload = workload.time_scaled(1.0 / speedup)
    if trace_memory:
        tracemalloc.start()
    started = time.perf_counter()
    result = simulate(workload, load_policy(policy), fast_forward=fast_forward)
    wall = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] if trace_memory else None
    if trace_memory:
        tracemalloc.stop()
    return {
        "policy": policy,
        "rate": f"{speedup:g}x",
        "fast_forward": fast_forward,
        "requests": len(workload),
        "wall_s": wall,
        "requests_per_wall_s": len(workload) / wall,
        "steps": result.steps,
        "fast_forwarded_steps": result.fast_forwarded_steps,
        "peak_traced_mb": None if peak is None else peak / 2**20,
        "simulated_s": result.metrics["duration"],
        "median_ttft_ms": result.metrics["median_ttft_ms"],
        "p99_itl_ms": result.metrics["p99_itl_ms"],
    }


def memory_case(num_requests: int, policy: str) -> dict[str, object]:
    """Peak traced memory while simulating ``num_requests`` short requests: flat if nothing is kept per request."""
    workload = synthetic(num_requests, Poisson(100.0), Uniform(32, 512), Uniform(8, 64), seed=0)
    tracemalloc.start()
    started = time.perf_counter()
    result = simulate(workload, load_policy(policy))
    wall = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return {"requests": num_requests, "wall_s": wall, "peak_traced_mb": peak, "completed": result.metrics["completed"]}


def print_table(rows: list[dict[str, object]]) -> None:
    header = (
        f"{'policy':<9}{'rate':>5}{'ff':>4}{'requests':>10}{'wall s':>9}{'req/s':>9}{'steps':>10}"
        f"{'ff steps':>10}{'peak MB':>9}{'TTFT p50':>10}{'ITL p99':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        peak = "-" if r["peak_traced_mb"] is None else f"{r['peak_traced_mb']:.1f}"
        print(
            f"{r['policy']:<9}{r['rate']:>5}{'on' if r['fast_forward'] else 'off':>4}{r['requests']:>10}"
            f"{r['wall_s']:>9.2f}{r['requests_per_wall_s']:>9.0f}{r['steps']:>10}{r['fast_forwarded_steps']:>10}"
            f"{peak:>9}{r['median_ttft_ms']:>10.1f}{r['p99_itl_ms']:>9.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="an Azure-format or generic trace")
    parser.add_argument("--policy", default="vllm")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--no-step-by-step", action="store_true", help="skip the runs without fast-forward")
    parser.add_argument("--memory", action="store_true", help="trace Python memory (slows the runs down)")
    parser.add_argument(
        "--memory-sweep", help="comma-separated request counts: peak memory per count, e.g. 10000,100000"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.memory_sweep:
        sweep = [memory_case(int(n), args.policy) for n in args.memory_sweep.split(",")]
        for row in sweep:
            peak, wall = row["peak_traced_mb"], row["wall_s"]
            print(f"{row['requests']:>8} requests: peak traced memory {peak:.1f} MB, {wall:.1f} s")
        return 0
    rows = []
    for speedup in (1.0, 4.0):
        rows.append(run_case(args.trace, args.policy, speedup, args.limit, fast_forward=True, trace_memory=args.memory))
        if not args.no_step_by_step:
            rows.append(run_case(args.trace, args.policy, speedup, args.limit, fast_forward=False, trace_memory=False))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"python": sys.version, "rows": rows}, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
