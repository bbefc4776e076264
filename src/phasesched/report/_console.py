"""What a command-line run shows while it works: a progress bar, tables as results arrive, messages.

On a terminal with rich installed: a transient rich progress bar (one line per task) with the
tables printed above it. Otherwise (output piped to a file, or rich missing): no bar, plain-text
tables that read well in a log, and a progress line every half minute for a task that lasts
that long (an hour-long ``tune`` in a log file still says how far it is). ``quiet`` shows none.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
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
        log_every_s: Without a progress bar, how often a running task's progress is printed.
        clock: Seconds, for those lines (``time.monotonic``; tests pass their own).
    """

    def __init__(
        self,
        *,
        quiet: bool = False,
        stream: TextIO | None = None,
        log_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stdout
        self.log_every_s = log_every_s
        self._clock = clock
        self._console: Any = None
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        self._logged: dict[str, tuple[float, float]] = {}
        """Per task without a bar: when it started and when its progress was last printed."""
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
            if not self.quiet:
                self._log(task, completed, total)
            return
        task_id = self._tasks.get(task)
        if task_id is None:
            task_id = self._tasks[task] = self._progress.add_task(task, total=total)
        self._progress.update(task_id, completed=completed, total=total)
        if completed >= total:  # done: make room for the next task's bar
            self._progress.remove_task(task_id)
            del self._tasks[task]

    def _log(self, task: str, completed: int, total: int) -> None:
        """Print ``task``'s progress if its last line is ``log_every_s`` old, and its end if it printed any."""
        now = self._clock()
        started, last = self._logged.setdefault(task, (now, now))
        done = completed >= total
        if now - last >= self.log_every_s or (done and last > started):
            print(f"{task}: {completed:,}/{total:,} ({_elapsed(now - started)})", file=self.stream, flush=True)
            self._logged[task] = (started, now)
        if done:
            del self._logged[task]

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


def _elapsed(seconds: float) -> str:
    """``1h02m05s``, ``12m05s`` or ``45s``."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
