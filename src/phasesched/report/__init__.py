"""Reporting: terminal tables, ``results.json`` and PNG figures of experiment results.

Tables use rich when it is installed and aligned plain text otherwise; figures need matplotlib.
Both are in the ``[bench]`` extra (``pip install "phasesched[bench]"``), not core dependencies,
and neither is imported until it is used, so ``import phasesched`` stays light.
"""

from __future__ import annotations

from phasesched.report._console import TerminalUI as TerminalUI
from phasesched.report._errors import MissingExtraError as MissingExtraError
from phasesched.report._plots import plot_decode_curve as plot_decode_curve
from phasesched.report._plots import plot_gap_cdf as plot_gap_cdf
from phasesched.report._plots import plot_latency_budgets as plot_latency_budgets
from phasesched.report._plots import plot_phase_split as plot_phase_split
from phasesched.report._plots import plot_prefill_curve as plot_prefill_curve
from phasesched.report._plots import plot_replay_cdfs as plot_replay_cdfs
from phasesched.report._plots import require_plotting as require_plotting
from phasesched.report._plots import write_figures as write_figures
from phasesched.report._results import write_results_json as write_results_json
from phasesched.report._tables import format_cell as format_cell
from phasesched.report._tables import format_table as format_table
from phasesched.report._tables import loss_note as loss_note
from phasesched.report._tables import print_table as print_table
from phasesched.report._tables import rich_available as rich_available

__all__ = [
    "MissingExtraError",
    "TerminalUI",
    "format_cell",
    "format_table",
    "loss_note",
    "plot_decode_curve",
    "plot_gap_cdf",
    "plot_latency_budgets",
    "plot_phase_split",
    "plot_prefill_curve",
    "plot_replay_cdfs",
    "print_table",
    "require_plotting",
    "rich_available",
    "write_figures",
    "write_results_json",
]
