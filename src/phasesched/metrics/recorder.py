"""Per-request timelines and latency budgets, recorded step by step for real runs and simulations.

Every moment of a request's life is charged to exactly one phase, so the budget sums to its
end-to-end latency by construction:

* ``queue``: from arrival to the start of its first step;
* ``prefill``: the steps that computed its prompt (or, after a preemption, recomputed it);
* ``interference``: waiting between its prefill chunks while other work ran;
* ``transfer``: moving its KV from a prefill worker to a decode worker (disaggregated only);
* ``first_decode``: on a decode worker, from the KV's arrival to its first token;
* ``decode``: every gap between two of its tokens (stalls, recomputation after a late
  preemption and all).

So TTFT = queue + prefill + interference + transfer + first decode, and the end-to-end latency
is TTFT plus the sum of the inter-token latencies. Finished requests are folded into streaming
distributions; only requests still running are kept.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.metrics.distribution import Distribution
from phasesched.request import FinishReason

if TYPE_CHECKING:
    from phasesched.chunk_run import ChunkRun
    from phasesched.decode_run import DecodeRun
    from phasesched.plan import StepPlan
    from phasesched.request import Request
    from phasesched.scheduler import FinishedRequest, StepOutcome

__all__ = [
    "BUDGET_PHASES",
    "MAX_ERRORS",
    "GapLog",
    "LatencyBudget",
    "MetricsRecorder",
    "RequestRecord",
    "Role",
    "RunCounters",
    "WorkerRecorder",
]

BUDGET_PHASES = ("queue", "prefill", "interference", "transfer", "first_decode", "decode")
"""The phases a request's latency is charged to, in the order they happen."""

MAX_ERRORS = 10
"""Failure messages a run keeps, the first ones only; enough to say why, and memory stays flat."""


class Role(enum.Enum):
    """What a worker does with the requests it runs."""

    BOTH = "both"
    """Aggregated — prefill and decode on the same worker; its first token is the user's."""
    PREFILL = "prefill"
    """Disaggregated prefill — its sampled token is not emitted; the request moves on."""
    DECODE = "decode"
    """Disaggregated decode — requests arrive with their KV; its first sample is the first token."""


@attrs.frozen
class LatencyBudget:
    """Where one request's end-to-end latency went, in seconds (see the module docstring)."""

    queue_s: float
    prefill_s: float
    interference_s: float
    transfer_s: float
    first_decode_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        """The sum of the phases — the request's end-to-end latency."""
        return (
            self.queue_s + self.prefill_s + self.interference_s + self.transfer_s + self.first_decode_s + self.decode_s
        )

    def as_dict(self) -> dict[str, float]:
        """``{phase: seconds}`` in :data:`BUDGET_PHASES` order."""
        return {phase: getattr(self, f"{phase}_s") for phase in BUDGET_PHASES}


@attrs.frozen(eq=False)
class RunCounters:
    """Totals a :class:`MetricsRecorder` has gathered, for :func:`~phasesched.metrics.summary.summarize`."""

    completed: int
    good: int
    input_tokens: int
    output_tokens: int
    preemptions: int
    budget_totals: dict[str, float]
    distributions: dict[str, Distribution]
    failed: int = 0
    errors: tuple[str, ...] = ()
    truncated: int = 0
    """Completed requests whose output the context limit cut short of ``max_new_tokens``."""
    truncated_tokens: int = 0
    """Output tokens those requests asked for and did not get."""


@attrs.frozen
class RequestRecord:
    """One finished request's measurements (kept only when a run asks for them).

    Attributes:
        request_id: Its id.
        arrival_s: When it arrived.
        prompt_len: Prompt tokens.
        output_len: Tokens it generated.
        ttft_s: Time to first token.
        e2el_s: End-to-end latency (arrival to last token).
        tpot_s: Mean time per output token after the first (``nan`` for a single token).
        num_preemptions: Times it was preempted.
        budget: Where its latency went.
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    ttft_s: float
    e2el_s: float
    tpot_s: float
    num_preemptions: int
    budget: LatencyBudget


@attrs.frozen(eq=False)
class GapLog:
    """Every token gap with the time it ended, for analyses over a time window.

    Attributes:
        end_s: float64 ``[G]``: when the gap ended (the later token's time).
        gap_s: float64 ``[G]``: the gap's length; it began at ``end_s - gap_s``.
    """

    end_s: NDArray[np.float64]
    gap_s: NDArray[np.float64]

    def overlapping(self, start: float, stop: float) -> NDArray[np.float64]:
        """Gaps that overlap the interval ``[start, stop]`` (those an event in it could have stretched).

        Returns:
            float64 ``[K]``: the lengths (``gap_s``) of those gaps, in log order, ``K <= G``.
        """
        keep = (self.end_s >= start) & (self.end_s - self.gap_s <= stop)
        gaps: NDArray[np.float64] = self.gap_s[keep]
        return gaps


@attrs.define(eq=False)
class _Timeline:
    """A live request's clock (internal)."""

    request_id: str
    arrival: float
    prompt_len: int
    last_accounted: float
    requested: int = 0
    """Tokens it asked for (``max_new_tokens``)."""
    scheduled: bool = False
    first_token: float = float("nan")
    late: bool = False
    """Its first token came after its TTFT target: it misses the goodput targets, finished or not."""
    tokens: int = 0
    preemptions: int = 0
    phases: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(BUDGET_PHASES, 0.0))

    def charge(self, phase: str, until: float) -> None:
        self.phases[phase] += until - self.last_accounted
        self.last_accounted = until


class MetricsRecorder:
    """Collects request timelines from one or more workers and folds finished ones into totals.

    Args:
        ttft_slo_s: Goodput's TTFT target (a request's own ``SLO`` overrides it).
        tpot_slo_s: Goodput's TPOT target (likewise).
        keep_requests: Keep a :class:`RequestRecord` per finished request (tests, plots).
    """

    def __init__(
        self,
        *,
        ttft_slo_s: float | None = None,
        tpot_slo_s: float | None = None,
        keep_requests: bool = False,
        keep_gaps: bool = False,
    ) -> None:
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.keep_requests = keep_requests
        self.keep_gaps = keep_gaps
        self._gap_parts: list[tuple[NDArray[np.float64], NDArray[np.float64]]] = []
        self.records: list[RequestRecord] = []
        self.distributions = {name: Distribution() for name in ("ttft", "tpot", "itl", "e2el")}
        self.budget_totals = dict.fromkeys(BUDGET_PHASES, 0.0)
        self.completed = 0
        self.good = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.preemptions = 0
        self.truncated = 0
        self.truncated_tokens = 0
        self.failed = 0
        self.errors: list[str] = []
        self._live: dict[str, _Timeline] = {}
        self._slos: dict[str, tuple[float | None, float | None]] = {}
        self._late = 0
        """Live requests whose first token missed their TTFT target."""

    def worker(self, role: Role = Role.BOTH) -> WorkerRecorder:
        """A recorder for one worker's steps, feeding this one."""
        return WorkerRecorder(self, role)

    def arrive(self, request: Request, time: float) -> None:
        """A request entered the system at ``time``."""
        self._live[request.request_id] = _Timeline(
            request.request_id, time, request.prompt_len, time, requested=request.max_new_tokens
        )
        if request.slo is not None:
            self._slos[request.request_id] = (request.slo.ttft_s, request.slo.tpot_s)

    def fail(self, request_id: str, error: str) -> None:
        """The request can never be served (the scheduler rejected it): count it as failed.

        As in ``vllm bench serve``, a failed request adds to ``failed`` and to no latency or
        token total, so one unservable request does not end or skew the run. ``error`` is kept
        among the first :data:`MAX_ERRORS` messages.
        """
        timeline = self._live.pop(request_id, None)
        self._late -= timeline is not None and timeline.late
        self._slos.pop(request_id, None)
        self.failed += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error)

    @property
    def missed(self) -> int:
        """Requests certain to miss the goodput targets, whatever the run does next.

        Those that finished short of them or failed, and those still running whose first
        token came too late.
        """
        return self.completed - self.good + self.failed + self._late

    def _first_token(self, timeline: _Timeline, end: float) -> None:
        """The request's first token came at ``end``: note it if it missed the TTFT target."""
        timeline.first_token = end
        ttft_slo = self._slos.get(timeline.request_id, (self.ttft_slo_s, None))[0]
        if not timeline.late and not _meets_ttft(end - timeline.arrival, ttft_slo):
            timeline.late = True
            self._late += 1

    def transferred(self, request_id: str, end: float) -> None:
        """The request's KV reached its decode worker at ``end``."""
        self._live[request_id].charge("transfer", end)

    def counters(self) -> RunCounters:
        """Totals so far, for :func:`phasesched.metrics.summary.summarize`."""
        return RunCounters(
            completed=self.completed,
            good=self.good,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            preemptions=self.preemptions,
            budget_totals=dict(self.budget_totals),
            distributions=self.distributions,
            failed=self.failed,
            errors=tuple(self.errors),
            truncated=self.truncated,
            truncated_tokens=self.truncated_tokens,
        )

    def gap_log(self) -> GapLog | None:
        """Every token gap recorded, with its end time (``None`` unless ``keep_gaps``)."""
        if not self.keep_gaps:
            return None
        if not self._gap_parts:
            return GapLog(np.empty(0), np.empty(0))
        return GapLog(np.concatenate([e for e, _ in self._gap_parts]), np.concatenate([g for _, g in self._gap_parts]))

    def _gaps(
        self, ends: NDArray[np.float64], gaps: NDArray[np.float64], counts: NDArray[np.int64] | None = None
    ) -> None:
        """Record token gaps (each ``counts[i]`` times) into the ITL distribution, and the log if kept."""
        self.distributions["itl"].add_many(gaps, counts)
        if self.keep_gaps:
            if counts is not None:
                ends, gaps = np.repeat(ends, counts), np.repeat(gaps, counts)
            self._gap_parts.append((np.broadcast_to(ends, gaps.shape).astype(np.float64), gaps.astype(np.float64)))

    def is_live(self, request_id: str) -> bool:
        """Whether ``request_id`` has arrived and not yet finished or failed."""
        return request_id in self._live

    @property
    def num_live(self) -> int:
        """Requests arrived but not finished."""
        return len(self._live)

    def _timeline(self, request_id: str) -> _Timeline:
        return self._live[request_id]

    def _finish(self, timeline: _Timeline, end: float, reason: FinishReason) -> None:
        """Fold a finished request into the totals; stopped by length short of its ask, the context cut it."""
        del self._live[timeline.request_id]
        self._late -= timeline.late
        if reason is FinishReason.LENGTH and timeline.tokens < timeline.requested:
            self.truncated += 1
            self.truncated_tokens += timeline.requested - timeline.tokens
        ttft = timeline.first_token - timeline.arrival
        e2el = end - timeline.arrival
        tpot = (e2el - ttft) / (timeline.tokens - 1) if timeline.tokens > 1 else float("nan")
        self.distributions["ttft"].add(ttft)
        self.distributions["e2el"].add(e2el)
        if timeline.tokens > 1:
            self.distributions["tpot"].add(tpot)
        for phase, seconds in timeline.phases.items():
            self.budget_totals[phase] += seconds
        self.completed += 1
        self.input_tokens += timeline.prompt_len
        self.output_tokens += timeline.tokens
        self.preemptions += timeline.preemptions
        self.good += self._meets_slo(timeline.request_id, ttft, tpot)
        if self.keep_requests:
            budget = LatencyBudget(*(timeline.phases[p] for p in BUDGET_PHASES))
            self.records.append(
                RequestRecord(
                    timeline.request_id,
                    timeline.arrival,
                    timeline.prompt_len,
                    timeline.tokens,
                    ttft,
                    e2el,
                    tpot,
                    timeline.preemptions,
                    budget,
                )
            )

    def _meets_slo(self, request_id: str, ttft: float, tpot: float) -> bool:
        ttft_slo, tpot_slo = self._slos.pop(request_id, (self.ttft_slo_s, self.tpot_slo_s))
        ok_ttft = _meets_ttft(ttft, ttft_slo)
        ok_tpot = tpot_slo is None or not tpot > tpot_slo  # a single-token request has no TPOT
        return ok_ttft and ok_tpot


def _meets_ttft(ttft: float, target: float | None) -> bool:
    """One test for goodput at the finish and for a late first token before it (they must agree)."""
    return target is None or ttft <= target


class WorkerRecorder:
    """Turns one worker's steps into timeline updates: vectorized for decodes, per request otherwise.

    Per-slot arrays (indexed by the worker scheduler's slots) hold the decode-phase clocks, so a
    step of a thousand decodes is a handful of numpy operations.
    """

    def __init__(self, parent: MetricsRecorder, role: Role) -> None:
        self.parent, self.role = parent, role
        self._slot_of: dict[str, int] = {}
        self._timelines = np.full(64, None, dtype=object)
        self._last_token = np.zeros(64)
        self._decode_s = np.zeros(64)
        self._tokens = np.zeros(64, dtype=np.int64)
        self._has_first = np.zeros(64, dtype=bool)

    def on_step(self, plan: StepPlan, outcome: StepOutcome, start: float, end: float) -> list[str]:
        """Record a step that ran from ``start`` to ``end``; return requests that left this worker.

        On a prefill worker, requests whose prefill completed leave (to be transferred); elsewhere,
        finished requests leave and are folded into the totals.
        """
        for request_id in plan.preempted:
            self._unload(request_id).preemptions += 1
        if plan.new_requests:
            self._load_new(plan)
        self._slices(plan.slots, outcome.new_token_ids >= 0, start, end)
        return self._leave(outcome.finished, end)

    def on_chunk_run(
        self,
        run: ChunkRun,
        start: float,
        ends: NDArray[np.float64],
        finished: Iterable[FinishedRequest] = (),
        *,
        taken: int = 0,
    ) -> list[str]:
        """Record ``len(ends)`` steps of ``run`` taken at once from ``start``, as :meth:`on_step` would each.

        ``finished`` are the requests the last step finished; they leave, as from :meth:`on_step`.
        ``taken``: the run's steps recorded before these (a step may be recorded apart, when it ends).
        """
        times, count = [start, *ends.tolist()], run.num_decodes
        if run.admitted and not taken:  # its first step's admissions: their slots end that step's slices
            first = run.steps[0].slots
            self._load(run.admitted, first[len(first) - len(run.admitted) :].tolist())
        decodes = run.steps[0].slots[:count]
        if not count or np.count_nonzero(self._has_first[decodes]) < count:
            count = 0  # a decode without a first token (a prompt's last token, or a decode worker's first)
        elif count:  # a token each step: as on_decode_run records them
            self._decode_run_tokens(decodes, ends)
        for j, step in enumerate(run.steps[taken : taken + len(ends)]):
            self._slices(step.slots[count:], step.samples[count:], times[j], times[j + 1])
        return self._leave(finished, times[-1])

    def on_decode_run(
        self, run: DecodeRun, start: float, ends: NDArray[np.float64], finished: Iterable[FinishedRequest] = ()
    ) -> list[str]:
        """Record ``len(ends)`` steps of ``run`` taken at once from ``start``; step ``j`` ended at ``ends[j]``.

        ``finished`` are the requests the steps finished, in order; each leaves, as from
        :meth:`on_step`, when its last step ends.
        """
        if run.passes_finishes and len(ends) > int(run.finish_at.min()):
            return self._segmented_run(run, start, ends, finished)
        slots, last = run.slots, float(ends[-1])
        has_first = self._has_first[slots]
        if np.count_nonzero(has_first) < len(slots):  # step 0 is a prompt's last token, or a decode worker's first
            self._early_run(slots[~has_first], start, float(ends[0]), last, len(ends))
            slots = slots[has_first]
        self._decode_run_tokens(slots, ends, len(run.slots))
        return self._leave(finished, last)

    def _segmented_run(
        self, run: DecodeRun, start: float, ends: NDArray[np.float64], finished: Iterable[FinishedRequest]
    ) -> list[str]:
        """:meth:`on_decode_run` for steps that pass finishes: each request's tokens stop at its own last step."""
        taken = run.steps_of(len(ends))
        slots, steps, last = run.slots, taken, ends[taken - 1]  # each request's steps and last token
        has_first = self._has_first[slots]
        if np.count_nonzero(has_first) < len(slots):  # step 0 is a prompt's last token, or a decode worker's first
            early = ~has_first
            self._early_run(slots[early], start, float(ends[0]), last[early], steps[early])
            slots, steps, last = slots[has_first], steps[has_first], last[has_first]
        self.parent._gaps(ends[:1], ends[0] - self._last_token[slots])  # noqa: SLF001 -- one recorder family
        if len(ends) > 1:  # step j's gap, once for each request still in it
            in_step = len(taken) - np.searchsorted(np.sort(taken), np.arange(1, len(ends)), side="right")
            self.parent._gaps(ends[1:], np.diff(ends), in_step)  # noqa: SLF001
        self._decode_s[slots] += last - self._last_token[slots]
        self._last_token[slots] = last
        self._tokens[slots] += steps
        step_of = dict(zip(run.request_ids, taken.tolist(), strict=True))
        left = []
        for request in finished:  # each leaves when its last step ends
            left += self._leave((request,), float(ends[step_of[request.request_id] - 1]))
        return left

    def _early_run(
        self,
        slots: NDArray[np.int32],
        start: float,
        first_end: float,
        last: float | NDArray[np.float64],
        steps: int | NDArray[np.int32],
    ) -> None:
        """Run requests whose first step (ending at ``first_end``) gives their first token; their later tokens."""
        for slot in slots.tolist():
            self._early_slice(slot, sampled=True, start=start, end=first_end)
        self._decode_s[slots] += last - first_end
        self._tokens[slots] += steps - 1
        self._last_token[slots] = last

    def _decode_run_tokens(self, slots: NDArray[np.int32], ends: NDArray[np.float64], width: int = 0) -> None:
        """A token for each of ``slots`` (with first tokens) at each of ``ends``; ``width`` slices share later gaps."""
        last = float(ends[-1])
        self.parent._gaps(ends[:1], ends[0] - self._last_token[slots])  # noqa: SLF001 -- one recorder family
        if len(ends) > 1:
            self.parent._gaps(ends[1:], np.diff(ends), np.full(len(ends) - 1, width or len(slots)))  # noqa: SLF001
        self._decode_s[slots] += last - self._last_token[slots]
        self._last_token[slots] = last
        self._tokens[slots] += len(ends)

    def fail(self, request_id: str, error: str) -> None:
        """The request failed on this worker (its steps kept failing): drop its timeline, count it as failed."""
        if request_id in self._slot_of:
            self._unload(request_id)
        self.parent.fail(request_id, error)

    # ---------------------------------------------------------------- internals
    def _slices(self, slots: NDArray[np.int32], sampled: NDArray[np.bool_], start: float, end: float) -> None:
        """A step's slices, which ran from ``start`` to ``end``; ``sampled`` says which gave a token."""
        has_first = self._has_first[slots]
        decoding = sampled & has_first
        if np.count_nonzero(decoding):
            self._decode_tokens(slots[decoding], end)
        for i in (~has_first).nonzero()[0].tolist():  # (np.flatnonzero costs ten Python calls here)
            self._early_slice(int(slots[i]), sampled=bool(sampled[i]), start=start, end=end)

    def _decode_tokens(self, slots: NDArray[np.int32], end: float) -> None:
        gaps = end - self._last_token[slots]
        self.parent._gaps(np.array([end]), gaps)  # noqa: SLF001 -- one recorder family
        self._decode_s[slots] += gaps
        self._last_token[slots] = end
        self._tokens[slots] += 1

    def _early_slice(self, slot: int, *, sampled: bool, start: float, end: float) -> None:
        """A slice of a request without a first token yet: prefill work, or a decode worker's first token."""
        timeline: _Timeline = self._timelines[slot]
        if self.role is Role.DECODE:
            if sampled:
                timeline.charge("first_decode", end)
                self._first_token(slot, timeline, end)
            return
        timeline.charge("interference" if timeline.scheduled else "queue", start)
        timeline.scheduled = True
        timeline.charge("prefill", end)
        if sampled and self.role is Role.BOTH:
            self._first_token(slot, timeline, end)

    def _first_token(self, slot: int, timeline: _Timeline, end: float) -> None:
        self.parent._first_token(timeline, end)  # noqa: SLF001 -- one recorder family
        self._has_first[slot] = True
        self._last_token[slot] = end
        self._tokens[slot] = 1

    def _load_new(self, plan: StepPlan) -> None:
        index = {rid: i for i, rid in enumerate(plan.request_ids)}
        ids = [request.request_id for request in plan.new_requests]
        self._load(ids, [int(plan.slots[index[request_id]]) for request_id in ids])

    def _load(self, request_ids: Iterable[str], slots: Iterable[int]) -> None:
        """Requests the scheduler admitted into ``slots``: their timelines go on here."""
        for request_id, slot in zip(request_ids, slots, strict=True):
            timeline = self.parent._timeline(request_id)  # noqa: SLF001 -- one recorder family
            self._ensure(slot)
            self._slot_of[request_id] = slot
            self._timelines[slot] = timeline
            first = timeline.tokens > 0
            self._has_first[slot] = first
            self._tokens[slot] = timeline.tokens
            self._decode_s[slot] = timeline.phases["decode"]
            self._last_token[slot] = timeline.last_accounted if first else 0.0

    def _unload(self, request_id: str) -> _Timeline:
        slot = self._slot_of.pop(request_id)
        timeline: _Timeline = self._timelines[slot]
        if self._has_first[slot]:
            timeline.tokens = int(self._tokens[slot])
            timeline.phases["decode"] = float(self._decode_s[slot])
            timeline.last_accounted = float(self._last_token[slot])
        self._timelines[slot] = None
        self._has_first[slot] = False
        return timeline

    def _leave(self, finished: Iterable[FinishedRequest], end: float) -> list[str]:
        left = []
        for request in finished:
            timeline = self._unload(request.request_id)
            if self.role is not Role.PREFILL:
                self.parent._finish(timeline, end, request.reason)  # noqa: SLF001 -- one recorder family
            left.append(request.request_id)
        return left

    def _ensure(self, slot: int) -> None:
        size = len(self._timelines)
        if slot < size:
            return
        new = max(2 * size, slot + 1)
        self._timelines = np.concatenate([self._timelines, np.full(new - size, None, dtype=object)])
        self._last_token = np.concatenate([self._last_token, np.zeros(new - size)])
        self._decode_s = np.concatenate([self._decode_s, np.zeros(new - size)])
        self._tokens = np.concatenate([self._tokens, np.zeros(new - size, dtype=np.int64)])
        self._has_first = np.concatenate([self._has_first, np.zeros(new - size, dtype=bool)])
