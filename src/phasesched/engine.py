"""A minimal serving loop around a scheduler and any executor, measured like the simulator.

Requests arrive on a clock; each iteration runs ``schedule -> execute -> update`` and hands the
step to a :class:`~phasesched.metrics.WorkerRecorder`, so real runs report exactly the metrics
and latency budgets simulations do. With :class:`WallClock` the loop sleeps until the next
arrival when idle and timestamps steps with the real time (scheduler overhead included); with
:class:`VirtualClock` time advances by each step's reported duration, which replays a real
executor's measured step times without waiting.

When the executor raises on a plan, the engine gives the plan back (``Scheduler.abandon``) and
follows its :class:`FailurePolicy`: retry a bounded number of times, then fail that plan's
requests (counted in ``failed``, with the reason) and keep serving the rest.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Protocol

import attrs

from phasesched.errors import InvalidArgumentError, PhaseschedError, PlanInFlightError, RequestRejectedError
from phasesched.executor import Executor
from phasesched.metrics.recorder import MetricsRecorder, Role
from phasesched.metrics.summary import RunMetrics, summarize
from phasesched.plan import StepPlan
from phasesched.request import Request
from phasesched.scheduler import FinishedRequest, Scheduler
from phasesched.validators import whole

__all__ = ["Clock", "Engine", "FailurePolicy", "StepRecord", "VirtualClock", "WallClock"]


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
class FailurePolicy:
    """What an :class:`Engine` does when its executor raises on a plan.

    The plan is given back (:meth:`~phasesched.scheduler.Scheduler.abandon`: no token of it is
    recorded) and the loop goes on, so the next step retries the same work. After
    ``max_retries`` failures in a row, the requests of the plan that failed last are ended as
    failed (:meth:`~phasesched.scheduler.Scheduler.fail`), with the error as the reason: they
    count in ``failed`` and their error among the run's ``errors``, and the others are served.
    A success resets the count.

    Attributes:
        max_retries: Consecutive failures retried before a plan's requests are failed; 0
            fails them at the first error.
        retry_on: Exceptions counted as executor failures. Anything else the executor raises
            propagates, after the plan has been given back (the scheduler stays usable).

    >>> FailurePolicy().max_retries
    2
    """

    max_retries: int = attrs.field(default=2, validator=whole(ge=0))
    retry_on: tuple[type[Exception], ...] = (Exception,)


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
        keep_requests: Keep a record per finished request in the metrics, and each one's
            :class:`~phasesched.scheduler.FinishedRequest` in ``engine.finished``.
        keep_steps: Keep a :class:`StepRecord` per step (``engine.steps``), for fidelity studies.
        failure: What to do when the executor raises (:class:`FailurePolicy`).

    >>> from phasesched import DeterministicExecutor, Request, SchedulerConfig
    >>> engine = Engine(Scheduler(SchedulerConfig(num_pages=64)), DeterministicExecutor(), clock=VirtualClock())
    >>> metrics = engine.run([Request("a", prompt_token_ids=[1, 2, 3], max_new_tokens=4)])
    >>> metrics["completed"], metrics["total_output_tokens"]
    (1, 4)
    """

    def __init__(  # noqa: PLR0913 -- keyword-only options after the two parts
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        clock: Clock | None = None,
        keep_requests: bool = False,
        keep_steps: bool = False,
        failure: FailurePolicy | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock or WallClock()
        self.recorder = MetricsRecorder(keep_requests=keep_requests)
        self.keep_steps = keep_steps
        self.failure = failure or FailurePolicy()
        self.steps: list[StepRecord] = []
        self.finished: dict[str, FinishedRequest] = {}
        """Every request that ended (completed, aborted or failed), by id; kept with ``keep_requests``."""
        self._worker = self.recorder.worker(Role.BOTH)
        self._failures = 0  # consecutive executor failures

    def run(self, requests: Iterable[Request]) -> RunMetrics:
        """Serve ``requests`` until all finish; they must come in ``arrival_time`` order, on this clock's time.

        A request the scheduler rejects (it could never fit) is counted in ``failed``, as
        ``vllm bench serve`` counts failures, and the others are served. Executor errors follow
        the engine's :class:`FailurePolicy`. Requests the scheduler already holds, waiting, when
        the run starts are served and measured from their own ``arrival_time``.

        Raises:
            InvalidArgumentError: A request arrives before the one given ahead of it (arrivals
                are not sorted: the engine would admit it late and inflate its TTFT, so it
                stops instead; the requests admitted so far stay in the scheduler); or the
                scheduler already runs requests this engine did not start, whose timelines it
                cannot know.
            PlanInFlightError: The scheduler has a plan in flight.
            PhaseschedError: Other errors (a duplicate id, a bad plan, a policy that schedules
                nothing while requests wait) propagate.
        """
        self._adopt_held()
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
            elif self.scheduler.num_unfinished:  # none when the last arrival was rejected
                msg = f"the policy scheduled nothing while {self.scheduler.num_unfinished} requests wait"
                raise PhaseschedError(msg)
        self._deliver_releases()
        duration = 0.0 if first is None or last is None else last - first
        requests_kept = self.recorder.records if self.recorder.keep_requests else None
        return summarize(self.recorder.counters(), duration, requests_kept)

    def _adopt_held(self) -> None:
        """Start the timelines of requests the scheduler held before this run (waiting ones only)."""
        scheduler = self.scheduler
        if scheduler.plan_in_flight is not None:
            msg = f"the scheduler has plan {scheduler.plan_in_flight.step_id} in flight; update or abandon it first"
            raise PlanInFlightError(msg)
        strangers = [r for r in scheduler.running_request_ids() if not self.recorder.is_live(r)]
        if strangers:
            msg = (
                f"the scheduler already runs {len(strangers)} requests this engine did not start "
                f"({', '.join(strangers[:3])}...); finish or abort them before Engine.run"
            )
            raise InvalidArgumentError(msg)
        for request_id in list(scheduler.waiting_request_ids()):
            if not self.recorder.is_live(request_id):
                request = scheduler.request(request_id)
                self.recorder.arrive(request, request.arrival_time)

    def _admit_arrivals(self, pending: _Peekable) -> None:
        now = self.clock.now()
        while (upcoming := pending.peek()) is not None and upcoming.arrival_time <= now:
            request = next(pending)
            ahead = pending.previous
            if ahead is not None and request.arrival_time < ahead.arrival_time:
                msg = (
                    f"requests must come in arrival_time order: {request.request_id!r} arrives at "
                    f"{request.arrival_time} s, after {ahead.request_id!r} at {ahead.arrival_time} s"
                )
                raise InvalidArgumentError(msg)
            pending.previous = request
            try:
                self.scheduler.add_request(request)  # first: a rejected request leaves no timeline behind
            except RequestRejectedError as error:  # it can never run here: count it, serve the rest
                self.recorder.fail(request.request_id, str(error))
                continue
            self.recorder.arrive(request, request.arrival_time)

    def _step(self, start: float) -> tuple[bool, bool]:
        """Run one iteration; return whether it ran anything, and whether anything finished."""
        plan = self.scheduler.schedule(start)
        try:
            result = self.executor.execute(plan)  # even an empty plan: it may carry releases
            if not plan.is_empty:
                self.clock.step_done(result.duration_s)
            outcome = self.scheduler.update(plan, result)
        except self.failure.retry_on as error:
            return not plan.is_empty, self._failed(plan, error)  # a failed step took its time too
        except BaseException:
            if self.scheduler.plan_in_flight is plan:
                self.scheduler.abandon(plan)
            raise
        self._failures = 0
        if plan.is_empty:
            return False, False
        end = self.clock.now()
        self._worker.on_step(plan, outcome, start, end)
        if self.recorder.keep_requests:
            self.finished.update((record.request_id, record) for record in outcome.finished)
        if self.keep_steps:
            self.steps.append(
                StepRecord(start, end, result.duration_s, tuple(plan.num_new.tolist()), tuple(plan.kv_len.tolist()))
            )
        return True, bool(outcome.finished)

    def _failed(self, plan: StepPlan, error: Exception) -> bool:
        """Give back a plan the executor failed on; past the retries, fail its requests. Return whether any ended."""
        if self.scheduler.plan_in_flight is plan:  # a result update() refused leaves it in flight too
            self.scheduler.abandon(plan)  # the engine aborts nothing, so no request ends here
        self._failures += 1
        if self._failures <= self.failure.max_retries:
            return False
        self._failures = 0
        tries = self.failure.max_retries + 1
        reason = f"the executor failed {tries} times in a row, last on step {plan.step_id}: {error!r}"
        for request_id in plan.request_ids:
            record = self.scheduler.fail(request_id, reason)
            self._worker.fail(request_id, reason)
            if self.recorder.keep_requests:
                self.finished[request_id] = record
        return bool(plan.request_ids)

    def _deliver_releases(self) -> None:
        """Hand the executor the requests that finished in the last step (an empty plan carries them).

        An executor that keeps failing on it keeps them: they go with the next run's first plan.
        """
        for _ in range(self.failure.max_retries + 1):
            if not self.scheduler.pending_releases:
                return
            plan = self.scheduler.schedule(self.clock.now())
            try:
                self.scheduler.update(plan, self.executor.execute(plan))
            except self.failure.retry_on:
                self.scheduler.abandon(plan)


class _Peekable(Iterator[Request]):
    def __init__(self, source: Iterator[Request]) -> None:
        self._source = source
        self._head: Request | None = next(source, None)
        self.previous: Request | None = None
        """The request taken before the head, to check the order."""

    def peek(self) -> Request | None:
        return self._head

    def __next__(self) -> Request:
        if self._head is None:
            raise StopIteration
        head, self._head = self._head, next(self._source, None)
        return head


def _peekable(source: Iterator[Request]) -> _Peekable:
    return _Peekable(source)
