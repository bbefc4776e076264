"""The discrete-event simulator: workloads through real schedulers, with cost-model time.

Each worker owns a :class:`~phasesched.Scheduler` (the same code an engine runs) and a cost
model. Events are kept in a heap: arrivals, step ends, transfers finishing on the KV link and
KV landing on a decode worker. All events at one instant are handled before any idle worker
starts its next step, so a request arriving exactly at a step boundary joins that step. Within
an instant, arrivals come first, then step ends in worker order, then the link, then deliveries
(each kind but step ends in the order queued): a fast-forwarded run's end is queued again when
the run is cut, so queue order alone would let fast-forward and stepping differ. A worker with
no request running or waiting is not asked for a step at all: its plan would be empty, and take
no time.

Aggregated runs have ``replicas`` workers that prefill and decode. Disaggregated runs have a
prefill pool and a decode pool: a prefill worker computes the prompt (its sampled token is not
the user's), the KV crosses a shared link, and a decode worker admits the request with the
prompt's KV in place, as vLLM's disaggregated prefill does (the last prompt token is recomputed
there; its logits give the first token, which is when TTFT ends). The prefill worker keeps the
request's pages until a decode worker admits it, as vLLM's NIXL connector delays freeing the
blocks until the decode side has read them: KV crossing the link or waiting for room on a
decode worker is held somewhere, and a slow link or a full decode pool throttles prefill
admission (back-pressure).

Workers are chosen per request: one with KV room for it first, then the fewest
requests. A request no worker can ever serve (the scheduler raises
:class:`~phasesched.errors.RequestRejectedError`) is counted as failed, as ``vllm bench
serve`` counts failed requests, and the run goes on; in a closed loop its client sends the next.

Between events, a worker whose batch is all decodes takes identical steps; with
``fast_forward`` it takes as many as happen before anything can change its batch in one
vectorized computation (:meth:`phasesched.scheduler.Scheduler.decode_run`), with exactly the times that
stepping one by one would give. A lone worker in an open loop, where nothing but arrivals reaches
it, runs on past finishes while nothing waits: its batch then only shrinks. Likewise, a
decode-first batch with prompts part-way through a chunked prefill takes the steps up to the
next prefill's completion at once
(:meth:`phasesched.scheduler.Scheduler.chunk_run`), each priced as its plan would be. In an open
loop with several workers, a worker's batch changes only through what reaches it: a request
routed to it (an arrival, or KV delivered to a decode worker) or held KV let go on it. Runs
there pass every other event; the routers read a worker mid-run as stepping would have left it,
and a worker something reaches commits only the steps of its run begun by then.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import numpy as np

from phasesched.chunk_run import ChunkRun
from phasesched.costmodel.protocol import CostModel, decode_step_times
from phasesched.decode_run import DecodeRun, segment_bounds
from phasesched.errors import RequestRejectedError
from phasesched.executor import StepResult
from phasesched.kv import KVView
from phasesched.metrics.recorder import MetricsRecorder, Role, WorkerRecorder
from phasesched.metrics.summary import RunMetrics, summarize
from phasesched.pd.routing import WorkerLoad, pick_worker_by
from phasesched.plan import StepPlan
from phasesched.policies.policy import SchedulingPolicy
from phasesched.prefix_cache import CacheStats
from phasesched.request import Request
from phasesched.scheduler import FinishedRequest, Scheduler
from phasesched.sim._checks import non_negative_int, positive_int
from phasesched.sim.closed_loop import ClosedLoop
from phasesched.sim.deployment import Deployment, Disaggregation
from phasesched.sim.executor import SimulatedExecutor
from phasesched.sim.guards import SimulationError, Watchdog, check_clock
from phasesched.sim.link import KVLink
from phasesched.sim.workload import Workload

__all__ = ["SimResult", "Simulator", "WorkerStats", "simulate"]

Progress = Callable[[int, int], None]
"""Called as ``progress(completed, total)`` while a simulation runs."""


def _run_length(ends: np.ndarray, horizon: float) -> int:
    """How many steps of a run start before ``horizon`` (at least one: the run has begun)."""
    return min(1 + int(ends[:-1].searchsorted(horizon, side="left")), len(ends))


class _Event(enum.IntEnum):
    ARRIVAL = 0
    STEP_END = 1
    LINK = 2
    DELIVER = 3


@attrs.frozen
class WorkerStats:
    """What one worker did: its role, steps taken, seconds busy and the runs its fast-forwarded steps made."""

    role: Role
    steps: int
    busy_s: float
    """A fast-forwarded run adds its span at once, so this may differ from stepping's sum in the last bits."""
    runs: int = 0


@attrs.frozen(eq=False)
class SimResult:
    """A simulation's outcome.

    Attributes:
        metrics: The run's metrics (``metrics.values`` uses vLLM's key names).
        workers: Per-worker activity.
        wall_s: Wall-clock seconds the simulation took.
        steps: Model steps simulated (fast-forwarded ones included).
        fast_forwarded_steps: Steps taken inside decode runs and chunk runs.
        prefix_cache: Prefix-cache counters summed over the workers, in tokens (all zero
            when the policy does not cache prefixes).
        stopped_early: The run ended once more requests had missed the goodput targets than
            ``stop_after_missed`` allows; its metrics cover the requests finished by then.
    """

    metrics: RunMetrics
    workers: tuple[WorkerStats, ...]
    wall_s: float
    steps: int
    fast_forwarded_steps: int
    prefix_cache: CacheStats = attrs.field(factory=CacheStats)
    stopped_early: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Metrics plus simulation bookkeeping, JSON-ready."""
        out = self.metrics.to_dict()
        out["errors"] = list(self.metrics.errors)
        out["sim_wall_s"] = self.wall_s
        out["sim_steps"] = self.steps
        out["sim_fast_forwarded_steps"] = self.fast_forwarded_steps
        out["sim_stopped_early"] = self.stopped_early
        cache = self.prefix_cache
        out["prefix_cache_queried_tokens"] = cache.queried
        out["prefix_cache_hit_tokens"] = cache.hits
        out["prefix_cache_hit_rate"] = cache.hit_rate
        out["workers"] = [
            {"role": w.role.value, "steps": w.steps, "busy_s": w.busy_s, "runs": w.runs} for w in self.workers
        ]
        return out


@attrs.define(eq=False)
class _OpenRun:
    """A run taken but not yet committed to its worker's scheduler: what reaches that worker may still cut it."""

    run: DecodeRun | ChunkRun
    start: float
    ends: np.ndarray
    """float64: its steps' end times."""
    event: int
    """The sequence number of its end event, cancelled if a cut ends the run earlier."""

    def pages_added(self, kv: KVView, now: float) -> int:
        """KV pages the run's steps begun by ``now`` have added (a step's pages are allocated as it is planned)."""
        return _pages_added(kv, self.run, _run_length(self.ends, now))


@attrs.frozen
class _Unrecorded:
    """A run's step committed to its worker's scheduler but recorded only when it ends (see :meth:`Simulator._cut`)."""

    run: DecodeRun | ChunkRun
    start: float
    ends: np.ndarray
    """float64 ``[1]``: when the step ends."""
    taken: int
    """The run's steps before it (recorded already)."""
    finished: tuple[FinishedRequest, ...]

    def record(self, recorder: WorkerRecorder) -> None:
        """Record the step, now that it has ended."""
        if isinstance(self.run, ChunkRun):
            recorder.on_chunk_run(self.run, self.start, self.ends, self.finished, taken=self.taken)
        else:
            recorder.on_decode_run(self.run, self.start, self.ends, self.finished)


def _pages_added(kv: KVView, run: DecodeRun | ChunkRun, steps: int) -> int:
    """KV pages the first ``steps`` steps of ``run`` add, before any of them is committed."""
    if isinstance(run, ChunkRun):
        return int(run.growth[steps - 1])
    grown = run.kv_len - 1 + (run.steps_of(steps) if run.passes_finishes else steps)
    return int(kv.pages_to_grow(run.slots, grown).sum())


def _freed_by_last_step(kv: KVView, run: DecodeRun, steps: int) -> int:
    """KV pages the requests finishing in step ``steps`` of ``run`` free after earlier finishes (asked pre-commit)."""
    finishing = run.finish_at == steps
    if not np.count_nonzero(finishing):
        return 0
    grown = int(kv.pages_to_grow(run.slots[finishing], run.kv_len[finishing] - 1 + steps).sum())
    earlier = run.finish_at < steps
    return grown + kv.freed_by_freeing(run.slots[earlier | finishing]) - kv.freed_by_freeing(run.slots[earlier])


@attrs.define(eq=False)
class _Worker:
    index: int
    role: Role
    scheduler: Scheduler
    recorder: WorkerRecorder
    executor: SimulatedExecutor
    busy: bool = False
    plan: StepPlan | None = None
    result: StepResult | None = None
    start: float = 0.0
    steps: int = 0
    fast_forwarded: int = 0
    runs: int = 0
    busy_s: float = 0.0
    finishing: int = 0
    """Requests a decode run in flight has finished ahead of its end: still counted as load."""
    finishing_pages: int = 0
    """Their KV pages: freed ahead of the run's end, still counted as held."""
    finished_earlier: int = 0
    """Requests a run passing finishes finished before its last step: reported (progress) at its end."""
    leaving: list[str] = attrs.Factory(list)
    """Requests a run in flight on a prefill worker has completed ahead of its end: sent on at its end."""
    open_run: _OpenRun | None = None
    """A run in flight whose steps are committed when it ends or something reaching this worker cuts it."""
    unrecorded: _Unrecorded | None = None
    """The last step of a run cut while it was in flight, when the simulation may stop early: recorded when it ends.

    (Where a chunk run may name hashed prompt pages, the cut plans that step instead:
    :meth:`Simulator._cut_to_plain_step`.)
    """

    @property
    def load(self) -> int:
        """Requests the router counts against this worker, as stepping one by one would see them."""
        return self.scheduler.num_unfinished + self.finishing

    @property
    def free_pages(self) -> int:
        """Free KV pages, as stepping one by one would see them."""
        return self.scheduler.kv.num_free_pages - self.finishing_pages

    def routing_load(self, now: float) -> WorkerLoad:
        """What the router sees of this worker at ``now`` (requests already waiting count as load, not as pages).

        Mid-run, that is the pages the run's steps begun by then have taken: only its last step
        finishes requests, so its load holds until it ends.
        """
        kv = self.scheduler.kv
        free = self.free_pages - (0 if self.open_run is None else self.open_run.pages_added(kv, now))
        return WorkerLoad(self.index, self.load, free, kv.watermark_pages, kv.page_size)

    @property
    def cost(self) -> CostModel:
        return self.executor.cost_model


class Simulator:
    """Runs one workload through one policy on one deployment. See the module docstring.

    Args:
        workload: Requests with arrival times, or a closed loop.
        policy: The scheduling policy every worker uses.
        deployment: Each worker's hardware, model and KV.
        replicas: Aggregated workers (ignored when ``disaggregation`` is given).
        disaggregation: Prefill and decode pools, and their link.
        ttft_slo_s: Goodput's TTFT target.
        tpot_slo_s: Goodput's TPOT target.
        keep_requests: Keep a record per finished request in the result.
        keep_gaps: Keep every token gap with its end time (``metrics.gaps``), for window analyses.
        fast_forward: Advance runs of pure-decode steps, and of decode-first steps with prefill
            chunks, in one computation.
        max_decode_run: Longest run taken at once.
        progress: Called with ``(completed, total)`` as requests finish.
        stop_after_missed: End the run as soon as more requests than this are certain to miss
            the goodput targets (finished short of them, failed, or given their first token
            past the TTFT target). A capacity search only asks whether a run attains its
            SLO, and past that many misses nothing the run does later can make it; overloaded
            runs, the slowest to simulate, stop long before their queues drain.

    Raises:
        InvalidArgumentError: ``replicas`` or ``max_decode_run`` is not a positive integer,
            or ``stop_after_missed`` is negative.
    """

    def __init__(  # noqa: PLR0913 -- the simulation's knobs, all keyword-only
        self,
        workload: Workload | ClosedLoop,
        policy: SchedulingPolicy,
        deployment: Deployment | None = None,
        *,
        replicas: int = 1,
        disaggregation: Disaggregation | None = None,
        ttft_slo_s: float | None = None,
        tpot_slo_s: float | None = None,
        keep_requests: bool = False,
        keep_gaps: bool = False,
        fast_forward: bool = True,
        max_decode_run: int = 4096,
        progress: Progress | None = None,
        stop_after_missed: int | None = None,
    ) -> None:
        self.deployment = deployment or Deployment()
        if disaggregation is None:
            positive_int("replicas", replicas)
        positive_int("max_decode_run", max_decode_run)
        self.stop_after_missed = (
            None if stop_after_missed is None else non_negative_int("stop_after_missed", stop_after_missed)
        )
        self.policy = policy
        self.fast_forward = fast_forward
        self.max_decode_run = max_decode_run
        self.progress = progress
        self.recorder = MetricsRecorder(
            ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, keep_requests=keep_requests, keep_gaps=keep_gaps
        )
        self.closed_loop = workload if isinstance(workload, ClosedLoop) else None
        source = workload.as_workload() if isinstance(workload, ClosedLoop) else workload
        self.total = len(source)
        self._requests: Iterator[Request] = source.requests()
        self.workers = self._make_workers(replicas, disaggregation)
        self.link = (
            None
            if disaggregation is None
            else KVLink(disaggregation.link_bandwidth_gbs * 1e9, disaggregation.link_latency_s)
        )
        self._heap: list[tuple[float, _Event, int, int, Any]] = []
        """Events as (time, kind, worker index for a step end, sequence, payload), in the order at
        one instant that the module docstring gives."""
        self._sequence = itertools.count()
        self._link_version = 0
        self._awaiting_decode: dict[str, Request] = {}
        self._held: dict[str, _Worker] = {}
        """Per request between prefill and decode admission: the prefill worker holding its KV."""
        self._unheld: dict[int, _Worker] = {}
        """Prefill workers whose held KV was let go since they last had the chance to start a step."""
        self._arrivals_queue_behind = self.closed_loop is None and self.link is None and len(self.workers) == 1
        """Every arrival lands on the one worker, later than anything it has queued (an open loop
        arrives in time order), so a run whose queue admits nobody arriving later may pass arrivals."""
        self._routed_cuts = self.closed_loop is None and len(self.workers) > 1
        """An open loop's workers share nothing but the routers and the prefill workers' held KV: a
        worker's batch changes only through a request routed to it or KV let go on it, so runs start
        past every event and are cut when one of those reaches their worker (:meth:`_cut`)."""
        self._pools: dict[Role, list[_Worker]] = {}
        for worker in self.workers:
            self._pools.setdefault(worker.role, []).append(worker)
        """The workers of each role, in order: the ones a request of that role is routed among."""
        self._next_arrival = float("inf")
        self._cancelled: set[int] = set()
        """Sequence numbers of run-end events that a cut moved earlier."""
        self._issued = 0
        self._first_arrival: float | None = None
        self._hashed_prompts = False
        """Whether a request whose prompt pages carry hashes has arrived: only their pages are ever named."""
        self._last_finish = 0.0
        self._progress = 0
        """Grows whenever the state changes (an arrival, a step, a transfer landing): the watchdog's pulse."""

    # ---------------------------------------------------------------- running
    def run(self) -> SimResult:
        """Simulate until every request has finished.

        Raises:
            SimulationError: The clock passed :data:`~phasesched.sim.guards.MAX_CLOCK_S`, events
                stopped changing anything, or requests were left unfinished.
        """
        wall = time.perf_counter()
        self._issue_initial()
        watchdog = Watchdog()
        limit = self.stop_after_missed
        while self._heap:
            now = self._heap[0][0]
            check_clock(now)
            touched: dict[int, _Worker] = {}
            while self._heap and self._heap[0][0] == now:
                _, kind, _, sequence, payload = heapq.heappop(self._heap)
                if sequence in self._cancelled:
                    self._cancelled.remove(sequence)
                    continue
                self._handle(kind, payload, now, touched)
                watchdog.event(now, self._progress)
            if limit is not None and self.recorder.missed > limit:
                self._stop_runs(now)
                return self._result(time.perf_counter() - wall, stopped_early=True)
            self._start_all(touched.values(), now)
        left = self._issued - self.recorder.completed - self.recorder.failed
        if left:
            msg = f"the simulation stalled: {left} requests never finished"
            raise SimulationError(msg)
        return self._result(time.perf_counter() - wall)

    def _handle(self, kind: _Event, payload: Any, now: float, touched: dict[int, _Worker]) -> None:
        if kind is _Event.ARRIVAL:
            worker = self._arrive(payload, now)
            if worker is not None:
                touched[worker.index] = worker
            if self.closed_loop is None:
                self._push_next_arrival()
        elif kind is _Event.STEP_END:
            self._step_end(payload, now)
            touched[payload.index] = payload
        elif kind is _Event.LINK:
            if payload == self._link_version:
                self._link_progress(now)
        else:
            worker = self._deliver(payload, now)
            if worker is not None:
                touched[worker.index] = worker

    def _start_all(self, workers: Iterable[_Worker], now: float) -> None:
        """Start every idle worker's next step or run at ``now``.

        Plain steps start first, so their ends are in the heap when runs look for their horizon.
        Prefill workers whose held KV a decode admission let go start theirs among the plain steps.
        """
        runs: list[tuple[_Worker, DecodeRun | ChunkRun]] = []
        # Decode workers first: their admissions let go of held KV, which prefill workers
        # starting at the same instant must see, whatever order the events came in.
        for worker in sorted(workers, key=lambda w: w.role is not Role.DECODE):
            if not worker.busy and _has_nothing_to_run(worker.scheduler):
                continue  # its plan would be empty (a prefill worker whose last request went to transfer)
            run = None if worker.busy or not self.fast_forward else self._fast_run(worker)
            if run is not None:
                if worker.role is Role.DECODE and isinstance(run, ChunkRun):
                    for request_id in run.admitted:  # as for a step's new_requests (_start_step)
                        self._let_go(request_id, now)
                runs.append((worker, run))
            elif not worker.busy:
                self._start_step(worker, now)
        with_runs = {worker.index for worker, _ in runs}  # their runs saw what was let go before them
        while self._unheld:  # prefill workers take no decode runs, and their steps let go of nothing
            unheld, self._unheld = self._unheld, {}
            for worker in unheld.values():
                if not worker.busy and worker.index not in with_runs and not _has_nothing_to_run(worker.scheduler):
                    self._start_step(worker, now)
        self._take_runs(runs, now)

    def _take_runs(self, runs: list[tuple[_Worker, DecodeRun | ChunkRun]], now: float) -> None:
        """Price and take the runs starting at ``now``.

        With routed cuts each is priced a few arrivals' worth ahead and left open. Otherwise each
        ends at its horizon, and runs starting at the same instant can also change each other's
        batches (a finish in a closed loop issues a request anywhere): each is cut where the
        others' would end on their own, which leaves the earliest one as it is and so is consistent.
        """
        if self._routed_cuts:
            for worker, run in runs:
                peers = len(self._pools[worker.role])
                ends = self._step_ends(worker, run, now, now + peers * (self._next_arrival - now))
                self._take_run(worker, run, now, ends, len(ends))
            return
        priced = []
        for worker, run in runs:
            horizon = self._horizon(worker, ignore_arrivals=run.ignores_later_arrivals and self._arrivals_queue_behind)
            ends = self._step_ends(worker, run, now, horizon)
            priced.append((worker, run, horizon, ends, float(ends[_run_length(ends, horizon) - 1])))
        for worker, run, horizon, ends, _ in priced:
            others = [end for other, _, _, _, end in priced if other is not worker]
            self._take_run(worker, run, now, ends, _run_length(ends, min([horizon, *others])))

    def _fast_run(self, worker: _Worker) -> DecodeRun | ChunkRun | None:
        """The worker's next steps if they can be taken at once: pure decodes, or decodes beside prefill chunks."""
        scheduler = worker.scheduler
        # Nothing but arrivals reaches the lone worker. A run stopping at a miss count must stop at
        # the finish that crosses it, which a run passing finishes would record ahead of its time.
        past_finishes = self._arrivals_queue_behind and self.stop_after_missed is None
        return scheduler.decode_run(self.max_decode_run, past_finishes=past_finishes) or scheduler.chunk_run(
            self.max_decode_run
        )

    def _start_step(self, worker: _Worker, now: float) -> None:
        """Schedule and price one step of ``worker`` (an idle one when nobody it holds can run now)."""
        plan = worker.scheduler.schedule(now)
        if worker.role is Role.DECODE:
            for request in plan.new_requests:  # its KV now has pages here: the prefill worker lets go
                self._let_go(request.request_id, now)
        self._run_plan(worker, plan, now)

    def _run_plan(self, worker: _Worker, plan: StepPlan, now: float) -> None:
        """Price ``plan`` and start it at ``now`` (an empty one is updated at once: it takes no time)."""
        result = worker.executor.execute(plan)
        if plan.is_empty:
            worker.scheduler.update(plan, result)
            return
        duration = result.duration_s or 0.0
        self._progress += 1
        worker.plan, worker.result, worker.start, worker.busy = plan, result, now, True
        worker.steps += 1
        worker.busy_s += duration
        self._push(now + duration, _Event.STEP_END, worker)

    def _take_run(self, worker: _Worker, run: DecodeRun | ChunkRun, now: float, ends: np.ndarray, count: int) -> None:
        """Take the first ``count`` steps of ``run``, which end at ``ends``."""
        ends = ends[:count]
        worker.busy, worker.plan = True, None
        event = self._push(float(ends[-1]), _Event.STEP_END, worker)  # finishes are reported then, as stepping would
        # Committed when it ends, or when something reaching its worker cuts it. A run that may be
        # stopped early stays open too: committed now, its steps after the stop would be recorded.
        if self._routed_cuts or self.stop_after_missed is not None:
            worker.open_run = _OpenRun(run, now, ends, event)
        else:
            self._commit(worker, run, now, ends)

    def _cut(self, worker: _Worker, now: float) -> None:
        """Commit the steps of ``worker``'s open run begun by ``now``, before a request or a KV release reaches it.

        The run ends with them, even if what arrives could not change its later steps (a queue
        that admits nobody arriving later): committed whole, it would show the routers the pages
        those steps take before they are taken. A chunk run that may name hashed prompt pages
        before an early stop has its step in flight planned instead (:meth:`_cut_to_plain_step`).
        """
        open_run, worker.open_run = worker.open_run, None
        assert open_run is not None
        ends = open_run.ends[: _run_length(open_run.ends, now)]
        if isinstance(open_run.run, ChunkRun) and self._may_name_pages_before_a_stop(worker):
            self._cut_to_plain_step(worker, open_run, ends)
            return
        if len(ends) < len(open_run.ends):
            self._cancelled.add(open_run.event)
            self._push(float(ends[-1]), _Event.STEP_END, worker)
        # Recorded now, the last step begun would count its tokens, a late first token (a miss) or
        # a finish ahead of its end: stepping records it when it ends, and not if the run stops first.
        self._commit(worker, open_run.run, open_run.start, ends, record_last=self.stop_after_missed is None)

    def _cut_to_plain_step(self, worker: _Worker, open_run: _OpenRun, begun: np.ndarray) -> None:
        """Commit the steps of the run that ended, and plan the one in flight (ending at ``begun[-1]``) as stepping did.

        Where pages carry hashes, a step names the pages it filled when it is updated: committed
        with the run at the cut, the step in flight would name them before a stop that falls
        before its end, and the cache's counters would differ from stepping's.
        """
        self._cancelled.add(open_run.event)
        taken, start = len(begun) - 1, open_run.start
        if taken:  # they finish nobody (only a run's last step does): nothing leaves at their end
            self._commit(worker, open_run.run, open_run.start, begun[:taken])
            start = float(begun[taken - 1])
        plan = worker.scheduler.schedule(start)  # a run admits only in its first step, let go when the run started
        assert not plan.is_empty, "the step in flight had work"
        self._run_plan(worker, plan, start)

    def _may_name_pages_before_a_stop(self, worker: _Worker) -> bool:
        """Whether a step of ``worker`` committed ahead of its end could name prompt pages a stop should not see.

        A decode run's steps never name pages (it applies only where no running request carries
        token ids). Without hashed prompts or the cache, nothing is named; without a miss limit,
        nothing stops early.
        """
        return self.stop_after_missed is not None and self._hashed_prompts and worker.scheduler.kv.prefix_caching

    def _stop_runs(self, now: float) -> None:
        """Leave the open runs as stepping leaves its steps when the run stops at ``now``.

        The steps that ended by then are committed (recorded); the one in flight is planned, as
        stepping planned it (its lookups count), and records nothing.
        """
        for worker in self.workers:
            open_run, worker.open_run = worker.open_run, None
            worker.unrecorded = None  # its step, counted when it began, ends after the stop
            if open_run is None:
                continue
            ended = int(open_run.ends.searchsorted(now, side="right"))
            if ended:
                self._commit(worker, open_run.run, open_run.start, open_run.ends[:ended])
            if ended < _run_length(open_run.ends, now):  # begun before the stop, still running
                begun = open_run.start if not ended else float(open_run.ends[ended - 1])
                self._run_plan(worker, worker.scheduler.schedule(begun), begun)

    def _commit(
        self, worker: _Worker, run: DecodeRun | ChunkRun, start: float, ends: np.ndarray, *, record_last: bool = True
    ) -> None:
        """Apply the steps of ``run`` that end at ``ends`` to the worker's scheduler, recorder and counters.

        Requests finishing in the last of the steps leave when it ends (:meth:`_step_end`);
        those that a run passing finishes finished earlier have left by then, and are reported now.
        Without ``record_last``, the last step is recorded when it ends (:attr:`_Worker.unrecorded`).
        """
        kv, count = worker.scheduler.kv, len(ends)
        if isinstance(run, DecodeRun) and run.passes_finishes:
            assert record_last, "no run passes finishes where the simulation may stop early (_fast_run)"
            self._commit_past_finishes(worker, run, start, ends)
            return
        unfreed = kv.num_free_pages - _pages_added(kv, run, count)
        if isinstance(run, ChunkRun):
            finished = worker.scheduler.advance_chunks(run, count)
            left = worker.recorder.on_chunk_run(run, start, ends, finished) if record_last else None
        else:
            finished = worker.scheduler.advance(run, count)
            left = worker.recorder.on_decode_run(run, start, ends, finished) if record_last else None
        if left is None:
            left = self._record_all_but_last(worker, run, start, ends, finished)
        worker.finishing_pages = kv.num_free_pages - unfreed  # freed early by the finishes
        self._committed(worker, start, ends, left)

    @staticmethod
    def _record_all_but_last(
        worker: _Worker,
        run: DecodeRun | ChunkRun,
        start: float,
        ends: np.ndarray,
        finished: tuple[FinishedRequest, ...],
    ) -> list[str]:
        """Record the steps before the last, which is recorded when it ends; return the requests that leave then."""
        taken = len(ends) - 1
        worker.unrecorded = _Unrecorded(run, float(ends[-2]) if taken else start, ends[taken:], taken, finished)
        if taken:  # only a run's last step finishes requests: these record none
            if isinstance(run, ChunkRun):
                worker.recorder.on_chunk_run(run, start, ends[:taken])
            else:
                worker.recorder.on_decode_run(run, start, ends[:taken])
        return [request.request_id for request in finished]  # as recording will have them leave

    def _commit_past_finishes(self, worker: _Worker, run: DecodeRun, start: float, ends: np.ndarray) -> None:
        count = len(ends)
        worker.finishing_pages = _freed_by_last_step(worker.scheduler.kv, run, count)
        finished = worker.scheduler.advance(run, count)
        left = worker.recorder.on_decode_run(run, start, ends, finished)
        earlier = run.finish_at[run.finish_at < count]
        if len(earlier):  # they left at their own steps' ends; reported, with the rest, at the run's
            self._last_finish = max(self._last_finish, float(ends[int(earlier.max()) - 1]))
            worker.finished_earlier = len(earlier)
        self._committed(worker, start, ends, left[len(earlier) :])  # finishes come in step order

    def _committed(self, worker: _Worker, start: float, ends: np.ndarray, left: list[str]) -> None:
        """Count a commit; ``left`` are the requests its last step completed, which leave when it ends."""
        self._progress += 1
        worker.finishing = len(left)
        if worker.role is Role.PREFILL:
            worker.leaving = left  # their KV is sent when the step that completed them ends
        worker.steps += len(ends)
        worker.fast_forwarded += len(ends)
        worker.runs += 1
        worker.busy_s += float(ends[-1]) - start

    def _step_ends(self, worker: _Worker, run: DecodeRun | ChunkRun, now: float, horizon: float) -> np.ndarray:
        """End times of the run's steps, priced in growing batches until one ends past ``horizon``."""
        if isinstance(run, ChunkRun):
            return self._chunk_step_ends(worker, run, now, horizon)
        if run.passes_finishes:
            return self._segment_step_ends(worker, run, now, horizon)
        priced = min(run.max_steps, 32)
        while True:
            durations = decode_step_times(worker.cost, run.kv_len, priced)
            # Sequential sums, exactly as stepping one by one accumulates the clock.
            ends = np.concatenate(([now], durations)).cumsum()[1:]
            if priced == run.max_steps or ends[-1] >= horizon:
                return ends
            priced = min(run.max_steps, priced * 4)

    @staticmethod
    def _segment_step_ends(worker: _Worker, run: DecodeRun, now: float, horizon: float) -> np.ndarray:
        """End times of a run passing finishes, priced by segment in growing batches until one ends past ``horizon``."""
        parts, end, taken, priced = [], now, 0, 32
        for bound in segment_bounds(run.finish_at, run.max_steps):
            kv_len = run.kv_len[run.finish_at > taken]
            while taken < bound:
                count = min(bound - taken, priced)
                durations = decode_step_times(worker.cost, kv_len + taken, count)
                parts.append(np.concatenate(([end], durations)).cumsum()[1:])  # as stepping accumulates the clock
                end, taken, priced = float(parts[-1][-1]), taken + count, priced * 4
                if end >= horizon:
                    return np.concatenate(parts)
        return np.concatenate(parts)

    @staticmethod
    def _chunk_step_ends(worker: _Worker, run: ChunkRun, now: float, horizon: float) -> np.ndarray:
        """End times of a chunk run's steps, each priced as its plan would be, until one ends at or past ``horizon``."""
        ends, cost = [], worker.cost
        for step in run.steps:
            now += cost.step_time(step.num_new, step.kv_len)  # the clock as stepping advances it
            ends.append(now)
            if now >= horizon:
                break
        return np.array(ends, dtype=np.float64)

    def _end_run(self, worker: _Worker) -> None:
        """The run in flight ends: commit it if open, or record its last step if it was cut before that ended."""
        if worker.open_run is not None:
            open_run, worker.open_run = worker.open_run, None
            self._commit(worker, open_run.run, open_run.start, open_run.ends)
        if worker.unrecorded is not None:
            worker.unrecorded.record(worker.recorder)
            worker.unrecorded = None

    def _step_end(self, worker: _Worker, now: float) -> None:
        if worker.open_run is not None or worker.unrecorded is not None:
            self._end_run(worker)
        finished_in_run, worker.busy, worker.finishing, worker.finishing_pages = worker.finishing, False, 0, 0
        if worker.plan is None:  # a run: recorded when it started; its finishes count now
            if worker.role is Role.PREFILL:
                leaving, worker.leaving = worker.leaving, []
                for request_id in leaving:
                    self._hold(worker, request_id)
                    self._start_transfer(request_id, now)
            elif finished_in_run or worker.finished_earlier:
                if finished_in_run:
                    self._last_finish = max(self._last_finish, now)
                self._left(finished_in_run + worker.finished_earlier, now)
                worker.finished_earlier = 0
            return
        assert worker.result is not None
        outcome = worker.scheduler.update(worker.plan, worker.result)
        left = worker.recorder.on_step(worker.plan, outcome, worker.start, now)
        worker.plan = worker.result = None
        if worker.role is Role.PREFILL:
            for request_id in left:
                self._hold(worker, request_id)
                self._start_transfer(request_id, now)
        elif left:
            self._finished(len(left), now)

    # ---------------------------------------------------------------- requests
    def _issue_initial(self) -> None:
        if self.closed_loop is None:
            self._push_next_arrival()
            return
        for _ in range(min(self.closed_loop.concurrency, self.total)):
            self._issue_closed_loop(0.0)

    def _push_next_arrival(self) -> None:
        request = next(self._requests, None)
        self._next_arrival = float("inf") if request is None else request.arrival_time
        if request is not None:
            self._issued += 1
            self._push(request.arrival_time, _Event.ARRIVAL, request)

    def _issue_closed_loop(self, now: float) -> None:
        request = next(self._requests, None)
        if request is not None:
            self._issued += 1
            self._push(now, _Event.ARRIVAL, attrs.evolve(request, arrival_time=now))

    def _arrive(self, request: Request, now: float) -> _Worker | None:
        """Queue ``request`` on a worker and return it, or ``None`` when it was rejected (failed)."""
        if self._first_arrival is None:
            self._first_arrival = now
        if request.prompt_blocks is not None or request.prompt_token_ids is not None:
            self._hashed_prompts = True
        self._progress += 1
        role = Role.PREFILL if self.link is not None else Role.BOTH
        worker = self._least_loaded(role, request.prompt_len, now)
        if worker.open_run is not None:
            self._cut(worker, now)
        prefill_only = attrs.evolve(request, max_new_tokens=1) if role is Role.PREFILL else request
        try:
            worker.scheduler.add_request(prefill_only)  # first: a rejected request leaves no trace
        except RequestRejectedError as error:  # every worker of the role shares the limits it broke
            self._failed(request.request_id, error, now)
            return None
        if role is Role.PREFILL:
            worker.scheduler.hold_kv(request.request_id)  # its pages outlive the prefill until let go
            self._awaiting_decode[request.request_id] = request
        self.recorder.arrive(request, now)
        return worker

    def _finished(self, count: int, now: float) -> None:
        self._last_finish = max(self._last_finish, now)
        self._left(count, now)

    def _failed(self, request_id: str, error: RequestRejectedError, now: float) -> None:
        """Count a request no worker can serve as failed; it does not stretch the run's duration."""
        self.recorder.fail(request_id, str(error))
        self._left(1, now)

    def _left(self, count: int, now: float) -> None:
        """``count`` requests left the system, finished or failed: report it; a closed loop sends successors."""
        if self.progress is not None:
            self.progress(self.recorder.completed + self.recorder.failed, self.total)
        if self.closed_loop is not None:
            for _ in range(count):
                self._issue_closed_loop(now + self.closed_loop.think_time_s)

    def _least_loaded(self, role: Role, num_tokens: int, now: float) -> _Worker:
        """The worker of ``role`` for a request needing ``num_tokens`` of KV.

        One that can admit it now comes first (a worker whose KV is full would queue it however
        few requests it runs), then the fewest requests. Where every worker has room, as with
        ample KV, that is plain least-loaded routing, so such runs route as they always did.
        """
        pool = self._pools.get(role, [])
        if len(pool) == 1:  # nobody to choose between (a lone worker: every arrival)
            return pool[0]
        workers = self.workers
        loads = [(w.load, w.index) for w in pool]
        return workers[pick_worker_by(loads, lambda index: workers[index].routing_load(now).has_room(num_tokens))]

    # ---------------------------------------------------------------- the KV link
    def _start_transfer(self, request_id: str, now: float) -> None:
        """Send the KV of the whole prompt, as vLLM's prefill worker sends every prompt block.

        The decode worker counts one token fewer as computed: it recomputes the last prompt
        token (overwriting identical KV), because the first token's logits must come from a
        step it runs, as vLLM's scheduler does when every prompt token's KV arrived.
        """
        assert self.link is not None
        request = self._awaiting_decode[request_id]
        self.link.start(request_id, request.prompt_len * self.deployment.kv_bytes_per_token(), now)
        self._reschedule_link()

    def _hold(self, worker: _Worker, request_id: str) -> None:
        """Note that the prompt's KV stays on its prefill worker until a decode worker admits the request.

        The scheduler held the finished prefill's pages (:meth:`Scheduler.hold_kv`).
        """
        self._held[request_id] = worker

    def _let_go(self, request_id: str, now: float) -> None:
        """Free the prefill worker's copy of a request's KV, and let that worker start a step."""
        worker = self._held.pop(request_id, None)  # a readmission after a preemption holds nothing
        if worker is not None:
            if worker.open_run is not None:
                self._cut(worker, now)
            worker.scheduler.release_kv(request_id)
            self._unheld[worker.index] = worker

    def _link_progress(self, now: float) -> None:
        assert self.link is not None
        for request_id, lands in self.link.pop_done(now):
            self._progress += 1
            self._push(lands, _Event.DELIVER, request_id)
        self._reschedule_link()

    def _reschedule_link(self) -> None:
        assert self.link is not None
        self._link_version += 1
        done = self.link.next_done()
        if done != float("inf"):
            self._push(done, _Event.LINK, self._link_version)

    def _deliver(self, request_id: str, now: float) -> _Worker | None:
        """Queue a transferred request on a decode worker, or count it failed if none can serve it."""
        request = self._awaiting_decode.pop(request_id)
        self._progress += 1
        self.recorder.transferred(request_id, now)
        worker = self._least_loaded(Role.DECODE, request.prompt_len, now)
        if worker.open_run is not None:
            self._cut(worker, now)
        try:
            worker.scheduler.add_request(request, precomputed_tokens=request.prompt_len - 1)
        except RequestRejectedError as error:  # too long with its output, say: the prefill was wasted
            self._let_go(request_id, now)
            self._failed(request_id, error, now)
            return None
        return worker

    # ---------------------------------------------------------------- plumbing
    def _push(self, when: float, kind: _Event, payload: Any) -> int:
        """Queue an event; returns its sequence number."""
        sequence = next(self._sequence)
        worker_index = payload.index if kind is _Event.STEP_END else 0
        heapq.heappush(self._heap, (when, kind, worker_index, sequence, payload))
        return sequence

    def _horizon(self, worker: _Worker, *, ignore_arrivals: bool = False) -> float:
        """The earliest pending event that could change ``worker``'s batch.

        With ``ignore_arrivals``, arrivals do not count: the run's queue admits nobody
        who arrives later (:attr:`DecodeRun.ignores_later_arrivals`).
        """
        times = [
            when
            for when, kind, _, _, payload in self._heap
            if not (ignore_arrivals and kind is _Event.ARRIVAL) and self._affects(worker, kind, payload)
        ]
        return min(times, default=float("inf"))

    @staticmethod
    def _affects(worker: _Worker, kind: _Event, payload: Any) -> bool:
        """Whether an event can change ``worker``'s batch, where runs end at such events.

        That is one worker in an open loop, where every arrival is its own, and closed loops,
        where a finish anywhere issues a request anywhere: every event but its own step end.
        """
        return kind is not _Event.STEP_END or payload is not worker

    def _make_workers(self, replicas: int, disaggregation: Disaggregation | None) -> list[_Worker]:
        if disaggregation is None:
            roles = [Role.BOTH] * replicas
        else:
            roles = [Role.PREFILL] * disaggregation.prefill_workers + [Role.DECODE] * disaggregation.decode_workers
        config = self.deployment.scheduler_config()
        executor = SimulatedExecutor(self.deployment.step_cost())
        return [
            _Worker(i, role, Scheduler(config, self.policy), self.recorder.worker(role), executor)
            for i, role in enumerate(roles)
        ]

    def _result(self, wall_s: float, *, stopped_early: bool = False) -> SimResult:
        duration = max(self._last_finish - (self._first_arrival or 0.0), 0.0)
        requests = self.recorder.records if self.recorder.keep_requests else None
        metrics = summarize(self.recorder.counters(), duration, requests, self.recorder.gap_log())
        stats = tuple(WorkerStats(w.role, w.steps, w.busy_s, w.runs) for w in self.workers)
        steps = sum(w.steps for w in self.workers)
        fast = sum(w.fast_forwarded for w in self.workers)
        return SimResult(metrics, stats, wall_s, steps, fast, _cache_tokens(self.workers), stopped_early)


def _cache_tokens(workers: Iterable[_Worker]) -> CacheStats:
    """The workers' prefix-cache counters, summed and in tokens (their pages times the page size)."""
    totals = dict.fromkeys(("queried", "hits", "evictions", "registered"), 0)
    for worker in workers:
        kv = worker.scheduler.kv
        for name in totals:
            totals[name] += getattr(kv.cache_stats, name) * kv.page_size
    return CacheStats(**totals)


def _has_nothing_to_run(scheduler: Scheduler) -> bool:
    """Whether no request runs or waits there, so its next plan is empty whatever the policy.

    An empty step takes no time and changes nothing the run measures; skipping it spares a
    policy call, a plan and an update (half the steps a disaggregated prefill worker planned).
    """
    return not scheduler.num_running and not scheduler.num_waiting


def simulate(
    workload: Workload | ClosedLoop, policy: SchedulingPolicy, deployment: Deployment | None = None, **options: Any
) -> SimResult:
    """Run one simulation; ``options`` are :class:`Simulator`'s keyword arguments.

    >>> from phasesched import load_policy
    >>> from phasesched.sim.builders import fixed
    >>> result = simulate(fixed(8, prompt_len=512, output_len=32), load_policy("vllm"))
    >>> result.metrics["completed"], result.metrics["total_output_tokens"]
    (8, 256)
    """
    return Simulator(workload, policy, deployment, **options).run()
