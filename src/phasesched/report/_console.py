"""What a command-line run shows while it works: a progress bar, tables as results arrive, messages.

On a terminal with rich installed: a transient rich progress bar (one line per task) with the
tables printed above it. Otherwise (output piped to a file, rich missing, or ``quiet``): no
bar, and plain-text tables that read well in a log.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, TextIO

from typing_extensions import Self

from phasesched.experiments.context import ExperimentResult
from phasesched.report._tables import format_table, loss_note, print_table, rich_available

__all__ = ["TerminalUI"]


class TerminalUI:
    """Progress, tables and messages of one CLI run; use it as a context manager around the run.

    Args:
        quiet: Show no progress and no tables, only :meth:`message` lines marked ``always``.
        stream: Where everything goes; standard output by default.
    """

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stdout
        self._console: Any = None
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        if not quiet and rich_available() and self.stream.isatty():
            from rich.console import Console  # noqa: PLC0415 -- optional dependency, imported when used
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

            self._console = Console(file=self.stream)
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self._progress = Progress(*columns, console=self._console, transient=True)

    def __enter__(self) -> Self:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, task: str, completed: int, total: int) -> None:
        """The progress hook (:class:`~phasesched.experiments.ProgressHook`): advance ``task``'s bar."""
        if self._progress is None:
            return
        task_id = self._tasks.get(task)
        if task_id is None:
            task_id = self._tasks[task] = self._progress.add_task(task, total=total)
        self._progress.update(task_id, completed=completed, total=total)
        if completed >= total:  # done: make room for the next task's bar
            self._progress.remove_task(task_id)
            del self._tasks[task]

    def table(self, result: ExperimentResult) -> None:
        """Show ``result``'s table (nothing when quiet), then what it lost, if anything (even when quiet)."""
        if not self.quiet:
            if self._console is not None:
                print_table(result, console=self._console)
            else:
                print(format_table(result), file=self.stream, end="\n\n")
        note = loss_note(result)
        if note is not None:
            self.message(f"Note: {note}", always=True)

    def message(self, text: str, *, always: bool = False) -> None:
        """Print ``text`` as it is (no markup); when quiet, only if ``always``."""
        if self.quiet and not always:
            return
        if self._console is not None:
            self._console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream)
