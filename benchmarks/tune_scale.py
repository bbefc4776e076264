"""`phasesched tune` on the Azure conversation trace with 4 GPUs: serial vs a 2-process pool.

Prints the wall time of each, their ratio, and whether both gave the same ranked table and
recommendation (they must: every capacity search is a pure function of its inputs).

    python benchmarks/tune_scale.py [--limit 200] [--chunks 512,2048] [--max-probes 7]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from phasesched.experiments.context import ExperimentContext, distinct_policies
from phasesched.sim.traces import load_trace
from phasesched.slo import SLO
from phasesched.tune import CapacityConfig, SearchSpace, TuneRun, run_tune

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=200, help="trace requests per simulation")
    parser.add_argument("--chunks", default="512,2048")
    parser.add_argument("--max-probes", type=int, default=7)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--slo", default="ttft=1s,tpot=50ms")
    args = parser.parse_args()
    workload = load_trace(TRACE).head(args.limit)
    space = SearchSpace(distinct_policies(), chunks=tuple(int(c) for c in args.chunks.split(",")))
    capacity = CapacityConfig(start_rate=2.0, max_probes=args.max_probes)
    slo = SLO.parse(args.slo)
    outcomes = {}
    for backend, workers in (("serial", 1), ("process", 2)):
        started = time.perf_counter()
        result = run_tune(ExperimentContext(), [workload], slo, space, TuneRun(args.gpus, capacity, backend, workers))
        outcomes[backend] = (time.perf_counter() - started, result)
        print(f"{backend:8s} workers={workers}: {outcomes[backend][0]:7.1f} s, {result.simulations} simulations")
    (serial_s, serial), (pooled_s, pooled) = outcomes["serial"], outcomes["process"]
    print(f"speed-up with 2 processes: {serial_s / pooled_s:.2f}x")
    same = serial.recommendation == pooled.recommendation
    print(f"same table: {serial.rows == pooled.rows}; same recommendation: {same}")
    print(serial.recommendation)


if __name__ == "__main__":
    main()
