"""What the phase split and the grid conclude, in words backed by the numbers on screen.

The mixed load has its :func:`~phasesched.experiments.mixed_load.verdict`; these are the
other experiments' counterparts. Each names the best configuration, the runner-up and the
margin, and says when the difference is within noise (:data:`NOISE`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from phasesched.experiments.context import ExperimentResult, Row
from phasesched.experiments.grid import GridResult
from phasesched.experiments.mixed_load import Verdict
from phasesched.experiments.phase_split import PhaseSplitResult
from phasesched.slo import SLO

__all__ = ["NOISE", "conclusion", "grid_conclusion", "phase_split_conclusion", "slo_line"]

NOISE = 0.05
"""Relative differences under this are called within noise (cost-model estimates are good to several percent)."""


def _margin(best: float, other: float) -> str:
    margin = (best - other) / best if best else 0.0
    return f"within noise ({margin:.0%})" if margin < NOISE else f"{margin:.0%} less"


def phase_split_conclusion(result: PhaseSplitResult) -> str:
    """Per GPU count: the configuration with the most goodput per GPU, its runner-up, and both ITLs.

    >>> rows = (
    ...     {"label": "2 replicas", "gpus": 2, "goodput_per_gpu": 3.0, "p99_ttft_ms": 300.0, "p99_itl_ms": 129.0},
    ...     {"label": "1P:1D", "gpus": 2, "goodput_per_gpu": 2.9, "p99_ttft_ms": 420.0, "p99_itl_ms": 8.7},
    ... )
    >>> text = phase_split_conclusion_rows(rows)
    >>> text.startswith("Phase split: on 2 GPUs, 2 replicas serves the most goodput per GPU (3.00 req/s;")
    True
    >>> text.endswith("1P:1D: 2.90 req/s, within noise (3%), p99 TTFT 420 ms, p99 ITL 8.7 ms.")
    True
    """
    return phase_split_conclusion_rows(result.rows)


def phase_split_conclusion_rows(rows: Sequence[Row]) -> str:
    """:func:`phase_split_conclusion` on bare rows."""
    lines = []
    for gpus in sorted({r["gpus"] for r in rows}):
        same = [r for r in rows if r["gpus"] == gpus]
        ranked = sorted(same, key=lambda r: (-(r["goodput_per_gpu"] or 0), r["label"]))
        best = ranked[0]
        text = (
            f"on {gpus} GPUs, {best['label']} serves the most goodput per GPU ({best['goodput_per_gpu']:.2f} req/s; "
            f"p99 TTFT {best['p99_ttft_ms']:,.0f} ms, p99 ITL {best['p99_itl_ms']:,.1f} ms)"
        )
        if len(ranked) > 1:
            second = ranked[1]
            text += (
                f"; {second['label']}: {second['goodput_per_gpu']:.2f} req/s, "
                f"{_margin(best['goodput_per_gpu'], second['goodput_per_gpu'])}, "
                f"p99 TTFT {second['p99_ttft_ms']:,.0f} ms, p99 ITL {second['p99_itl_ms']:,.1f} ms"
            )
        calm = min(same, key=_itl_key)
        if calm is not best and (len(ranked) < 2 or calm is not ranked[1]):
            text += (
                f"; lowest p99 ITL: {calm['label']}, {calm['p99_itl_ms']:,.1f} ms at "
                f"{calm['goodput_per_gpu']:.2f} req/s per GPU"
            )
        lines.append(text + ".")
    return "Phase split: " + "\n  ".join(lines)


def _itl_key(row: Row) -> tuple[float, str]:
    itl = row["p99_itl_ms"]
    return (float("inf") if itl is None else itl, row["label"])


def grid_conclusion(result: GridResult) -> str:
    """How often each policy has the lowest mean end-to-end latency across the cells, ties within noise shared."""
    cells: dict[tuple[int, int, int], list[Row]] = {}
    for row in result.rows:
        cells.setdefault((row["prompt_len"], row["output_len"], row["concurrency"]), []).append(row)
    wins: Counter[str] = Counter()
    ties = 0
    for rows in cells.values():
        best = min(r["mean_e2el_ms"] for r in rows)
        leaders = [r["policy"] for r in rows if r["mean_e2el_ms"] <= best * (1 + NOISE)]
        ties += len(leaders) > 1
        wins.update(leaders)
    if len(result.policies) < 2:
        return f"Grid: one policy ({result.policies[0]}); pass --policy a,b to compare."
    ranking = ", ".join(f"{name} {count}" for name, count in wins.most_common())
    return (
        f"Grid: lowest mean end-to-end latency (or within {NOISE:.0%} of it) in {len(cells)} cells: {ranking}; "
        f"{ties} cells are within noise between two or more policies."
    )


def conclusion(result: ExperimentResult) -> str | None:
    """The conclusion of a phase split or grid result; ``None`` for other experiments."""
    if isinstance(result, PhaseSplitResult):
        return phase_split_conclusion(result)
    if isinstance(result, GridResult):
        return grid_conclusion(result)
    return None


def slo_line(verdict: Verdict, slo: SLO, rows: Sequence[Row] = ()) -> str:
    """The mixed-load verdict against the SLO's ITL targets, and which rows meet them if the winner does not."""
    targets = [(key, ms) for key, ms in slo.run_targets_ms if key.endswith("_itl_ms")]
    if not targets:
        return f"\n  SLO ({slo.describe()}): no ITL target to judge the token gaps against."
    _, target = min(targets, key=lambda t: t[1])
    gap = verdict.winner["p99_gap_ms"]
    label = verdict.winner["label"]
    if gap <= target:
        return f"\n  Against the SLO's ITL target of {target:g} ms: {label}'s p99 gap of {gap:,.1f} ms meets it."
    base = verdict.baseline["prefill_tok_s"]
    meeting = [
        f"{r['label']} ({r['p99_gap_ms']:,.1f} ms, {r['prefill_tok_s'] / base:.0%} prefill, {r['gpus']} GPUs)"
        for r in rows
        if r.get("p99_gap_ms") is not None and r["p99_gap_ms"] <= target and r.get("prefill_tok_s")
    ]
    others = "; ".join(meeting) if meeting else "none does"
    return (
        f"\n  Against the SLO's ITL target of {target:g} ms: {label}'s p99 gap of {gap:,.1f} ms misses it. "
        f"Meeting it: {others}."
    )
