"""The Pareto plot of ``phasesched tune``: goodput per GPU against p99 ITL at each candidate's capacity."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from phasesched.report import require_plotting
from phasesched.tune.search import TuneResult

__all__ = ["plot_pareto"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def plot_pareto(result: TuneResult, path: str | os.PathLike[str], subtitle: str) -> Path:
    """Scatter every candidate that meets the SLO (colour: policy, marker: layout), the front joined by a line.

    ``subtitle`` names what was simulated (hardware, model, TP, cost model).
    """
    require_plotting()
    from matplotlib import colormaps  # noqa: PLC0415 -- optional dependency, imported when used
    from matplotlib.figure import Figure  # noqa: PLC0415 -- idem

    figure: Any = Figure(figsize=(8, 5.5), layout="constrained")
    axes = figure.subplots()
    rows = [r for r in result.rows if r["goodput_per_gpu"] > 0 and r["p99_itl_ms"] is not None]
    policies = list(dict.fromkeys(r["policy_label"] for r in rows))
    shapes = list(dict.fromkeys(r["layout"] for r in rows))
    colours = colormaps["tab20"]
    for row in rows:
        index = policies.index(row["policy_label"])
        colour = colours(index % 20)
        marker = _MARKERS[shapes.index(row["layout"]) % len(_MARKERS)]
        axes.scatter(row["p99_itl_ms"], row["goodput_per_gpu"], color=colour, marker=marker, s=36)
    front = sorted((r["p99_itl_ms"], r["goodput_per_gpu"]) for r in rows if r["pareto"])
    if front:
        axes.plot(*zip(*front, strict=True), color="black", linewidth=1, linestyle="--", label="Pareto front")
    if rows:
        best = result.rows[0]
        axes.annotate(
            f"recommended: {best['label']}",
            (best["p99_itl_ms"], best["goodput_per_gpu"]),
            fontsize=8,
            xytext=(8, -12),
            textcoords="offset points",
        )
    for index, name in enumerate(policies):
        axes.scatter([], [], color=colours(index % 20), label=name)
    for index, name in enumerate(shapes):
        axes.scatter([], [], color="grey", marker=_MARKERS[index % len(_MARKERS)], label=name)
    axes.set_xscale("log")
    axes.set_xlabel("p99 ITL at capacity (ms)")
    axes.set_ylabel("goodput per GPU at capacity (req/s)")
    axes.legend(fontsize=7, ncols=2)
    figure.suptitle(f"tune on {result.gpus} GPUs: {result.slo.describe()}", fontsize=10)
    axes.set_title(subtitle, fontsize=8)
    out = Path(path)
    figure.savefig(out, dpi=120)
    return out
