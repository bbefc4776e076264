"""Speed checks that used to be test assertions: trace loading, lazy requests, and the plain suite.

Tests assert behaviour (loading is vectorised, iteration is lazy), which holds on any machine;
how *fast* these are depends on the machine and its load, so it is measured here and compared
with a target instead. Each row reports the best of ``--repeats`` runs (the least disturbed by
other processes) against its target:

* ``load <trace>``: :func:`~phasesched.sim.load_trace` on each staged trace (target 0.5 s for
  the 19,366-row Azure conversation trace; the others scale with their rows);
* ``first 3 of 1M``: taking three requests from a million-row workload's iterator (0.1 s);
* ``phasesched bench``: the plain seed suite at full size, in a subprocess (60 s; only with
  ``--suite``, since it takes that long).

Usage::

    python benchmarks/speed_checks.py [--repeats 5] [--suite] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from phasesched.sim import fixed, load_trace

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "data" / "traces"
TARGETS_S = {
    "AzureLLMInferenceTrace_conv.csv": 0.5,
    "AzureLLMInferenceTrace_code.csv": 0.25,
    "conversation_trace.jsonl": 0.5,
}


def best_of(repeats: int, action: Callable[[], object]) -> float:
    """The shortest wall time of ``repeats`` runs of ``action``, in seconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


MILLION = fixed(1_000_000, 16, 16, rate=1000.0)


def first_three() -> None:
    """Take three requests from a million-row workload's iterator (built once, outside the timing)."""
    list(itertools.islice(MILLION.requests(), 3))


def plain_suite() -> None:
    """Run plain ``phasesched bench`` at full size, without figures, into a scratch folder."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "phasesched.cli", "bench", "--no-plots", "--quiet", "--output", out]
        subprocess.run(command, check=True, capture_output=True)  # noqa: S603 -- our own CLI, fixed arguments


def measure(repeats: int, *, suite: bool) -> list[dict[str, object]]:
    """One row per check: its name, best time and target."""
    rows: list[dict[str, object]] = []
    for name, target in TARGETS_S.items():
        path = TRACES / name
        if path.exists():
            rows.append(
                {"check": f"load {name}", "best_s": best_of(repeats, lambda p=path: load_trace(p)), "target_s": target}
            )
    rows.append({"check": "first 3 of 1M requests", "best_s": best_of(repeats, first_three), "target_s": 0.1})
    if suite:
        rows.append({"check": "phasesched bench", "best_s": best_of(1, plain_suite), "target_s": 60.0})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per check; the best is kept")
    parser.add_argument("--suite", action="store_true", help="also time plain `phasesched bench` (about a minute)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = measure(args.repeats, suite=args.suite)
    width = max(len(str(row["check"])) for row in rows)
    print(f"{'check':<{width}}  {'best s':>8}  {'target s':>8}  ok")
    for row in rows:
        ok = "yes" if float(row["best_s"]) <= float(row["target_s"]) else "NO"  # type: ignore[arg-type]
        print(f"{row['check']!s:<{width}}  {row['best_s']:>8.3f}  {row['target_s']:>8.2f}  {ok}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
