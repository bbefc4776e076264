"""PNG figures of the experiments, drawn with matplotlib's object API.

matplotlib is imported inside each function, so ``import phasesched`` stays light and a missing
``[bench]`` extra fails only when a figure is asked for, with a message saying how to install
it. Figures are built as :class:`matplotlib.figure.Figure` objects and saved through the Agg
canvas directly: no pyplot, no global backend switch, nothing left open between calls.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from phasesched.experiments.context import CDF_QUANTILES, ExperimentResult, Row
from phasesched.experiments.decode_curve import DecodeCurveResult
from phasesched.experiments.mixed_load import MixedLoadResult
from phasesched.experiments.phase_split import TTFT_PHASES, PhaseSplitResult
from phasesched.experiments.prefill_curve import PrefillCurveResult
from phasesched.experiments.replay import ReplayResult
from phasesched.metrics.recorder import BUDGET_PHASES
from phasesched.report._errors import MissingExtraError

__all__ = [
    "plot_decode_curve",
    "plot_gap_cdf",
    "plot_latency_budgets",
    "plot_phase_split",
    "plot_prefill_curve",
    "plot_replay_cdfs",
    "require_plotting",
    "write_figures",
]

_INSTALL = 'pip install "phasesched[bench]"'
_GAP_FLOOR_MS = 1e-3  # log axes cannot show a zero gap; none is shorter than a microsecond


def require_plotting() -> None:
    """Check that matplotlib is importable, before a long run rather than after it.

    Raises:
        MissingExtraError: It is not; the message says how to install it.
    """
    _figure_class()


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 -- optional dependency, imported when used
    except ImportError as error:
        msg = f"plots need matplotlib, which is not installed: {_INSTALL} (or pass --no-plots)"
        raise MissingExtraError(msg) from error
    return Figure


def _figure(ncols: int = 1) -> tuple[Any, list[Any]]:
    figure = _figure_class()(figsize=(6.0 * ncols, 4.2), layout="constrained")
    axes = figure.subplots(1, ncols, squeeze=False)[0]
    return figure, list(axes)


def _save(figure: Any, path: str | os.PathLike[str], subtitle: str = "") -> Path:
    """Save as PNG; ``subtitle`` (what was simulated: hardware, model, TP, cost model) goes on top."""
    if subtitle:
        figure.suptitle(subtitle, fontsize="small", color="dimgray")
    path = Path(path)
    figure.savefig(path, format="png", dpi=110)
    return path


_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A distinct colour, line style and marker per policy, stable in the given order."""
    return {
        name: {
            "color": f"C{i % 10}",
            "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
            "marker": _MARKERS[i % len(_MARKERS)],
        }
        for i, name in enumerate(dict.fromkeys(names))
    }


def _by_policy(rows: Sequence[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for row in rows:
        out.setdefault(str(row["policy"]), []).append(row)
    return out


def _xy(rows: Sequence[Row], x: str, y: str) -> tuple[list[float], list[float]]:
    """The points of ``rows`` where ``y`` was measured."""
    pairs = [(float(r[x]), float(r[y])) for r in rows if r.get(y) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _length_label(value: int) -> str:
    """``512``, ``1K``, ``32K``: short tick labels for token counts."""
    return f"{value // 1024}K" if value >= 1024 and value % 1024 == 0 else f"{value:,}"


def _log2_axis(axis: Any, values: Sequence[int]) -> None:
    """A base-2 log x axis ticked at the measured values themselves."""
    axis.set_xscale("log", base=2)
    ticks = sorted(set(values))
    axis.set_xticks(ticks, labels=[_length_label(v) for v in ticks])
    axis.minorticks_off()


def plot_prefill_curve(result: PrefillCurveResult, path: str | os.PathLike[str], *, subtitle: str = "") -> Path:
    """TTFT (first and last of the batch) and prefill tokens/s against prompt length, one line per policy."""
    figure, (ttft, rate) = _figure(2)
    styles = _styles([str(r["policy"]) for r in result.rows])
    for policy, rows in _by_policy(result.rows).items():
        style = styles[policy]
        ttft.plot(*_xy(rows, "prompt_len", "first_ttft_ms"), **style, label=f"{policy}: first")
        ttft.plot(
            *_xy(rows, "prompt_len", "max_ttft_ms"),
            **{**style, "alpha": 0.5},
            label=f"{policy}: last of {result.config.batch_size}",
        )
        rate.plot(*_xy(rows, "prompt_len", "prefill_tok_s"), **style, label=policy)
    ttft.set(yscale="log", xlabel="prompt tokens", ylabel="TTFT (ms)", title="Time to first token")
    rate.set(xlabel="prompt tokens", ylabel="prefill tokens/s", title="Prefill throughput")
    rate.set_ylim(bottom=0)
    for axis in (ttft, rate):
        _log2_axis(axis, [int(r["prompt_len"]) for r in result.rows])
        axis.grid(visible=True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    return _save(figure, path, subtitle)


def plot_decode_curve(result: DecodeCurveResult, path: str | os.PathLike[str], *, subtitle: str = "") -> Path:
    """Mean and p99 inter-token latency, and decode tokens/s, against active sequences."""
    figure, (itl, rate) = _figure(2)
    for policy, rows in _by_policy(result.rows).items():
        line = itl.plot(*_xy(rows, "active", "mean_itl_ms"), marker="o", label=f"{policy}: mean")[0]
        itl.plot(
            *_xy(rows, "active", "p99_itl_ms"),
            marker="^",
            linestyle="--",
            color=line.get_color(),
            label=f"{policy}: p99",
        )
        rate.plot(*_xy(rows, "active", "decode_tok_s"), marker="o", label=policy)
    itl.set(
        xlabel="active sequences",
        ylabel="inter-token latency (ms)",
        title=f"ITL at prompt {result.config.prompt_len:,} tokens",
    )
    rate.set(xlabel="active sequences", ylabel="decode tokens/s", title="Decode throughput")
    for axis in (itl, rate):
        _log2_axis(axis, [int(r["active"]) for r in result.rows])
        axis.set_ylim(bottom=0)
        axis.grid(visible=True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    return _save(figure, path, subtitle)


def plot_gap_cdf(result: MixedLoadResult, path: str | os.PathLike[str], *, subtitle: str = "") -> Path:
    """The CDF of token gaps during the long prompt's prefill, one curve per configuration."""
    figure, (axis,) = _figure(1)
    figure.set_size_inches(8.0, 4.8)
    styles = _styles(list(result.window_gaps_s))
    for label, gaps in result.window_gaps_s.items():
        if gaps.size == 0:
            continue
        values = np.maximum(np.sort(gaps) * 1e3, _GAP_FLOOR_MS)
        fractions = np.arange(1, values.size + 1) / values.size
        style = {k: v for k, v in styles[label].items() if k != "marker"}
        axis.step(values, fractions, where="post", label=label, **style)
    axis.set(
        xscale="log",
        xlabel="token gap (ms)",
        ylabel="fraction of gaps",
        ylim=(0.0, 1.02),
        title=f"Token gaps while a {result.config.long_prompt:,}-token prompt prefills "
        f"beside {result.config.num_short} decoding requests",
    )
    axis.grid(visible=True, which="both", alpha=0.3)
    axis.legend(fontsize="small", loc="lower right")
    return _save(figure, path, subtitle)


def plot_latency_budgets(
    budgets_ms: Mapping[str, Mapping[str, float]],
    path: str | os.PathLike[str],
    *,
    title: str,
    phases: Sequence[str] = BUDGET_PHASES,
    subtitle: str = "",
) -> Path:
    """Stacked horizontal bars: where each configuration's latency went, phase by phase (ms)."""
    figure, (axis,) = _figure(1)
    labels = list(budgets_ms)
    figure.set_size_inches(8.0, 1.2 + 0.45 * max(len(labels), 1))
    left = np.zeros(len(labels))
    for phase in phases:
        widths = np.array([budgets_ms[label].get(phase, 0.0) for label in labels])
        if np.any(widths > 0):
            axis.barh(labels, widths, left=left, label=phase.replace("_", " "))
            left += widths
    axis.invert_yaxis()  # first configuration on top, as in the table
    axis.set(xlabel="milliseconds", title=title)
    axis.grid(visible=True, axis="x", alpha=0.3)
    figure.legend(fontsize="small", loc="outside right upper")
    return _save(figure, path, subtitle)


def plot_replay_cdfs(result: ReplayResult, path: str | os.PathLike[str], *, subtitle: str = "") -> Path:
    """TTFT and inter-token-latency CDFs of a replay, one curve per policy."""
    figure, axes = _figure(2)
    fractions = CDF_QUANTILES / 100.0
    styles = _styles(list(result.cdf_ms))
    for axis, key, label in zip(axes, ("ttft", "itl"), ("TTFT", "inter-token latency"), strict=True):
        for policy, cdfs in result.cdf_ms.items():
            values = np.array(cdfs[key], dtype=np.float64)
            finite = np.isfinite(values)
            if np.any(finite):
                style = {k: v for k, v in styles[policy].items() if k != "marker"}
                axis.plot(np.maximum(values[finite], _GAP_FLOOR_MS), fractions[finite], **style, label=policy)
        axis.set(
            xscale="log",
            xlabel=f"{label} (ms)",
            ylabel="fraction of samples",
            ylim=(0.0, 1.02),
            title=f"{label}: {result.workload.name}",
        )
        axis.grid(visible=True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    return _save(figure, path, subtitle)


def plot_phase_split(result: PhaseSplitResult, path: str | os.PathLike[str], *, subtitle: str = "") -> Path:
    """p99 TTFT and p99 ITL per configuration side by side: what a split buys on one side and costs on the other."""
    figure, (ttft, itl) = _figure(2)
    labels = [str(r["label"]) for r in result.rows]
    figure.set_size_inches(12.0, 1.4 + 0.4 * max(len(labels), 1))
    colours = ["C0" if r["kind"] == "disaggregated" else "C1" for r in result.rows]
    for axis, key, name in ((ttft, "p99_ttft_ms", "p99 TTFT"), (itl, "p99_itl_ms", "p99 ITL")):
        axis.barh(labels, [r[key] or 0.0 for r in result.rows], color=colours)
        axis.set(xscale="log", xlabel=f"{name} (ms)", title=f"{name}: disaggregated (blue) vs aggregated (orange)")
        axis.invert_yaxis()
        axis.grid(visible=True, axis="x", which="both", alpha=0.3)
    itl.set_yticklabels([])
    return _save(figure, path, subtitle)


def write_figures(
    results: Sequence[ExperimentResult], out_dir: str | os.PathLike[str], *, subtitle: str = ""
) -> list[Path]:
    """Draw every figure the results support into ``out_dir``; return the files written.

    ``subtitle`` goes on every figure: what was simulated (hardware, model, TP, cost model).

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    out = Path(out_dir)
    paths: list[Path] = []
    for result in results:
        if isinstance(result, PrefillCurveResult):
            paths.append(plot_prefill_curve(result, out / "prefill_curve.png", subtitle=subtitle))
        elif isinstance(result, DecodeCurveResult):
            paths.append(plot_decode_curve(result, out / "decode_curve.png", subtitle=subtitle))
        elif isinstance(result, MixedLoadResult):
            paths.append(plot_gap_cdf(result, out / "mixed_load_gap_cdf.png", subtitle=subtitle))
            title = f"Latency budget of the {result.config.long_prompt:,}-token request"
            budget = out / "mixed_load_budget.png"
            paths.append(plot_latency_budgets(result.budgets_ms, budget, title=title, subtitle=subtitle))
        elif isinstance(result, PhaseSplitResult):
            title = "Mean TTFT budget per request: disaggregated vs aggregated"
            budget = out / "phase_split_budget.png"
            paths.append(
                plot_latency_budgets(result.budgets_ms, budget, title=title, phases=TTFT_PHASES, subtitle=subtitle)
            )
            paths.append(plot_phase_split(result, out / "phase_split_latency.png", subtitle=subtitle))
        elif isinstance(result, ReplayResult):
            paths.append(plot_replay_cdfs(result, out / "replay_cdf.png", subtitle=subtitle))
    return paths
