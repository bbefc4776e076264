"""A tally of differential runs: how many matched vLLM to the end, how many stopped at which divergence."""

from __future__ import annotations

from collections import Counter


class Outcomes:
    """Counts per test of ``identical`` runs and of each documented divergence, and the steps compared."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.steps: Counter[str] = Counter()

    def record(self, test: str, outcome: str, steps: int) -> None:
        """Count one run of ``test`` that ended as ``outcome`` after ``steps`` identical steps."""
        self.counts[test, outcome] += 1
        self.steps[test] += steps

    def lines(self) -> list[str]:
        """One line per test: runs, identical runs, divergences by kind, identical steps compared."""
        tests = sorted({test for test, _ in self.counts})
        out = []
        for test in tests:
            kinds = {o: n for (t, o), n in self.counts.items() if t == test}
            total = sum(kinds.values())
            detail = ", ".join(f"{o}: {n}" for o, n in sorted(kinds.items()))
            out.append(f"{test}: {total} workloads ({detail}); {self.steps[test]} identical steps")
        return out


OUTCOMES = Outcomes()
