"""Plain `phasesched bench`: the suite's wall and CPU time, serial vs a process pool, and the same results both ways.

Each experiment runs once per backend, alternating, so both see the same machine load. CPU
time counts this process and the pool's workers (``resource.RUSAGE_CHILDREN``), so it says
what the suite costs whatever else shares the machine; wall time says what a user waits.

    python benchmarks/bench_suite.py [--workers 2] [--quick]
"""

from __future__ import annotations

import argparse
import resource
import time

from phasesched.experiments.context import ExperimentContext
from phasesched.experiments.suite import SUITE, SuiteOptions, run_experiment


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the quick sizes (a smoke run)")
    args = parser.parse_args()
    options = SuiteOptions(quick=args.quick)
    totals = {"serial": [0.0, 0.0], "process": [0.0, 0.0]}
    for name in SUITE:
        outputs = {}
        for backend in ("serial", "process"):
            context = ExperimentContext(backend=backend, workers=args.workers)
            wall, cpu = time.perf_counter(), _cpu_s()
            result = run_experiment(name, context, options)
            wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
            totals[backend][0] += wall
            totals[backend][1] += cpu
            outputs[backend] = {k: v for k, v in result.to_dict().items() if k != "wall_s"}
            print(f"{name:12s} {backend:8s} {wall:6.1f} s wall {cpu:6.1f} s CPU")
        print(f"{name:12s} same results: {outputs['serial'] == outputs['process']}")
    (serial_wall, serial_cpu), (pool_wall, pool_cpu) = totals["serial"], totals["process"]
    print(
        f"suite: serial {serial_wall:.1f} s wall ({serial_cpu:.1f} s CPU), {args.workers} processes "
        f"{pool_wall:.1f} s wall ({pool_cpu:.1f} s CPU): {serial_wall / pool_wall:.2f}x"
    )


if __name__ == "__main__":
    main()
