"""A minimal serving loop around a scheduler and any executor, measured like the simulator.

Requests arrive on a clock; each iteration runs ``schedule -> execute -> update`` and hands the
step to a :class:`~phasesched.metrics.WorkerRecorder`, so real runs report exactly the metrics
and latency budgets simulations do. With :class:`WallClock` the loop sleeps until the next
arrival when idle and timestamps steps with the real time (scheduler overhead included); with
:class:`VirtualClock` time advances by each step's reported duration, which replays a real
executor's measured step times without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Protocol

import attrs

from phasesched.errors import PhaseschedError, RequestRejectedError
from phasesched.executor import Executor
from phasesched.metrics.recorder import MetricsRecorder, Role
from phasesched.metrics.summary import RunMetrics, summarize
from phasesched.request import Request
from phasesched.scheduler import Scheduler

__all__ = ["Clock", "Engine", "StepRecord", "VirtualClock", "WallClock"]


class Clock(Protocol):
    """Where an engine reads time, and how it waits."""

    def now(self) -> float:
        """Seconds since the run started."""
        ...

    def wait_until(self, when: float) -> None:
        """Return once ``now() >= when``."""
        ...

    def step_done(self, duration_s: float | None) -> None:
        """Told after each step with the executor's reported duration."""
        ...


class WallClock:
    """Real time from a monotonic counter; waits sleep."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def now(self) -> float:
        """Seconds since this clock was made."""
        return time.perf_counter() - self._origin

    def wait_until(self, when: float) -> None:
        """Sleep until ``when``."""
        delay = when - self.now()
        if delay > 0:
            time.sleep(delay)

    def step_done(self, duration_s: float | None) -> None:
        """Real time already passed while the step ran."""


class VirtualClock:
    """Time that moves only by reported step durations and jumps to arrivals when idle."""

    def __init__(self) -> None:
        self._now = 0.0

    def now(self) -> float:
        """The virtual time."""
        return self._now

    def wait_until(self, when: float) -> None:
        """Jump forward to ``when``."""
        self._now = max(self._now, when)

    def step_done(self, duration_s: float | None) -> None:
        """Advance by the step's duration (an executor that reports none takes no time)."""
        self._now += duration_s or 0.0


@attrs.frozen
class StepRecord:
    """One executed step: when it ran, what the executor reported, and its shape."""

    start_s: float
    end_s: float
    duration_s: float | None
    num_new: tuple[int, ...]
    kv_len: tuple[int, ...]


class Engine:
    """Serves requests with ``scheduler`` and ``executor`` on ``clock``.

    Args:
        scheduler: Decides each step.
        executor: Runs it.
        clock: Wall time (default) or virtual time.
        keep_requests: Keep a record per finished request in the metrics.
        keep_steps: Keep a :class:`StepRecord` per step (``engine.steps``), for fidelity studies.

    >>> from phasesched import DeterministicExecutor, Request, SchedulerConfig
    >>> engine = Engine(Scheduler(SchedulerConfig(num_pages=64)), DeterministicExecutor(), clock=VirtualClock())
    >>> metrics = engine.run([Request("a", prompt_token_ids=[1, 2, 3], max_new_tokens=4)])
    >>> metrics["completed"], metrics["total_output_tokens"]
    (1, 4)
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        clock: Clock | None = None,
        keep_requests: bool = False,
        keep_steps: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock or WallClock()
        self.recorder = MetricsRecorder(keep_requests=keep_requests)
        self.keep_steps = keep_steps
        self.steps: list[StepRecord] = []
        self._worker = self.recorder.worker(Role.BOTH)

    def run(self, requests: Iterable[Request]) -> RunMetrics:
        """Serve ``requests`` (ordered by ``arrival_time``, on this clock's time) until all finish.

        A request the scheduler rejects (it could never fit) is counted in ``failed``, as
        ``vllm bench serve`` counts failures, and the others are served; other errors (a
        duplicate id, a bad plan or result) propagate.
        """
        pending = _peekable(iter(requests))
        first = last = None
        while pending.peek() is not None or self.scheduler.num_unfinished:
            self._admit_arrivals(pending)
            upcoming = pending.peek()
            start = self.clock.now()
            ran, finished = self._step(start) if self.scheduler.num_unfinished else (False, False)
            if ran:
                first = start if first is None else first
                last = self.clock.now() if finished else last
            elif upcoming is not None:
                self.clock.wait_until(upcoming.arrival_time)
            else:
                msg = f"the policy scheduled nothing while {self.scheduler.num_unfinished} requests wait"
                raise PhaseschedError(msg)
        self._deliver_releases()
        duration = 0.0 if first is None or last is None else last - first
        requests_kept = self.recorder.records if self.recorder.keep_requests else None
        return summarize(self.recorder.counters(), duration, requests_kept)

    def _admit_arrivals(self, pending: _Peekable) -> None:
        now = self.clock.now()
        while (upcoming := pending.peek()) is not None and upcoming.arrival_time <= now:
            request = next(pending)
            try:
                self.scheduler.add_request(request)  # first: a rejected request leaves no timeline behind
            except RequestRejectedError as error:  # it can never run here: count it, serve the rest
                self.recorder.fail(request.request_id, str(error))
                continue
            self.recorder.arrive(request, request.arrival_time)

    def _step(self, start: float) -> tuple[bool, bool]:
        """Run one iteration; return whether it ran anything, and whether anything finished."""
        plan = self.scheduler.schedule(start)
        result = self.executor.execute(plan)  # even an empty plan: it may carry releases
        if plan.is_empty:
            self.scheduler.update(plan, result)
            return False, False
        self.clock.step_done(result.duration_s)
        outcome = self.scheduler.update(plan, result)
        end = self.clock.now()
        self._worker.on_step(plan, outcome, start, end)
        if self.keep_steps:
            self.steps.append(
                StepRecord(start, end, result.duration_s, tuple(plan.num_new.tolist()), tuple(plan.kv_len.tolist()))
            )
        return True, bool(outcome.finished)

    def _deliver_releases(self) -> None:
        """Hand the executor the requests that finished in the last step (an empty plan carries them)."""
        if self.scheduler.pending_releases:
            plan = self.scheduler.schedule(self.clock.now())
            self.scheduler.update(plan, self.executor.execute(plan))


class _Peekable(Iterator[Request]):
    def __init__(self, source: Iterator[Request]) -> None:
        self._source = source
        self._head: Request | None = next(source, None)

    def peek(self) -> Request | None:
        return self._head

    def __next__(self) -> Request:
        if self._head is None:
            raise StopIteration
        head, self._head = self._head, next(self._source, None)
        return head


def _peekable(source: Iterator[Request]) -> _Peekable:
    return _Peekable(source)
