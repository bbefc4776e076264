"""The scheduler: one loop of three verbs, ``schedule -> execute -> update``.

``schedule(now)`` asks the policy for a selection, checks it, commits it (preemptions,
admissions, KV pages) and returns an immutable :class:`~phasesched.plan.StepPlan`. The engine
runs the plan on an executor and hands the result to ``update(plan, result)``, which advances
every request's computed tokens, appends sampled tokens and retires finished requests. At most
one plan is in flight. Bad input at any of these boundaries raises a typed error and changes
nothing, and both verbs are atomic: if either raises, for any reason (a plugin's bug included),
the scheduler is exactly as it was before the call (see :mod:`phasesched.journal`). A plan the
executor could not run is given back with ``abandon(plan)``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.chunk_run import ChunkRun, chunk_limit, plan_chunk_steps
from phasesched.decode_run import DecodeRun, steps_that_fit
from phasesched.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidPlanError,
    InvalidResultError,
    PlanInFlightError,
    RequestRejectedError,
    UnknownRequestError,
)
from phasesched.executor import StepResult
from phasesched.journal import Journal
from phasesched.kv import Claim, HeldKV, KVView, PagedKVManager
from phasesched.plan import StepPlan, build_step_plan, token_positions
from phasesched.policies.builder import BatchBuilder, checked_chunk
from phasesched.policies.chunking import (
    BUILTIN_CHUNKERS,
    ChunkContext,
    FixedChunk,
    LongPrefillThreshold,
    NoChunking,
    PrefillCandidate,
)
from phasesched.policies.policy import SchedulingPolicy
from phasesched.policies.preemption import PreemptionPolicy
from phasesched.policies.priority import EVERY_DECODE_PRIORITIES, DecodeFirst, EqualProgress, PrefillFirst
from phasesched.policies.queue_order import FCFS, CacheAwareOrder
from phasesched.prefix import ROOT_HASH, block_page_hashes, extend_page_hashes
from phasesched.request import FinishReason, Request, RequestStatus
from phasesched.running import RunningArrays
from phasesched.selection import CheckedSelection, Selection, check_selection
from phasesched.sequence import SequenceState
from phasesched.validators import INT32_MAX, is_int, number, whole
from phasesched.view import SchedulerView
from phasesched.waiting import WaitingQueue

__all__ = ["FinishedRequest", "Scheduler", "SchedulerConfig", "StepOutcome"]

Int32Array = NDArray[np.int32]
_NO_SLOTS: Int32Array = np.empty(0, dtype=np.int32)
_NO_SLOTS.flags.writeable = False


def _expect(value: object, kind: type | tuple[type, ...], error: type[Exception], what: str) -> None:
    if not isinstance(value, kind):
        msg = f"{what} must be a {getattr(kind, '__name__', kind)}, got {value!r}"
        raise error(msg)


def prompt_page_hashes(request: Request, page_size: int) -> list[int]:
    """Chained hashes of a request's full prompt pages: from its token ids, else its trace block hashes."""
    hashes: list[int] = []
    if request.prompt_token_ids is not None:
        extend_page_hashes(hashes, request.prompt_token_ids, page_size, request.prompt_len // page_size)
    elif request.prompt_blocks is not None:
        hashes = block_page_hashes(request.prompt_blocks, page_size, request.prompt_len)
    return hashes


def _frozen(array: Int32Array) -> Int32Array:
    array.flags.writeable = False
    return array


class _SteadyBatch:
    """What the steady all-decode step keeps from one step to the next (internal).

    While the running set is unchanged and every request decodes, each step schedules the same
    slices: request ids, slots, one token each, prompt lengths, and (until a page boundary is
    crossed) the same KV pages. Those arrays are built once, frozen and shared by the plans;
    a step computes only what moves (context lengths, last-page lengths, input ids).
    """

    __slots__ = (
        "all_ids",
        "any_eos",
        "any_stop",
        "eos",
        "groups",
        "id_index",
        "kv_indices",
        "kv_indptr",
        "max_start",
        "next_start",
        "ones",
        "plan",
        "prompt_len",
        "qo_indptr",
        "request_ids",
        "running",
        "some_ids",
        "step",
        "to_length",
        "trues",
        "version",
    )

    def __init__(self, scheduler: Scheduler, start: Int32Array, known: Int32Array) -> None:
        arrays, running, size = scheduler._arrays, scheduler._running, scheduler._kv.page_size  # noqa: SLF001
        n = len(running)
        self.running = running
        self.request_ids: tuple[str, ...] = tuple(arrays.ids[running].tolist())
        self.ones = _frozen(np.ones(n, dtype=np.int32))
        self.trues: NDArray[np.bool_] = np.ones(n, dtype=bool)
        self.trues.flags.writeable = False
        self.qo_indptr = _frozen(np.arange(n + 1, dtype=np.int32))
        self.prompt_len = _frozen(arrays.prompt_len[running])
        self.eos = arrays.eos[running]
        self.any_eos = bool(np.count_nonzero(self.eos >= 0))
        self.any_stop = bool(np.count_nonzero(arrays.has_stop_set[running]))
        has_ids = arrays.has_ids[running]
        self.all_ids = bool(has_ids.all())
        self.some_ids = bool(has_ids.any())
        self.id_index = np.flatnonzero(has_ids)
        self.next_start = _frozen(start.copy())
        self.max_start = int(start.max())
        # Every slice advances one token a step, so which of them start a fresh page in a step
        # depends only on its offset in its page: slices grouped by that offset take turns.
        # ``step`` counts the batch's steps; in step t, group ``-t % page_size`` starts pages.
        offset = start % size
        order = np.argsort(offset, kind="stable").astype(np.int32)
        bounds = np.cumsum(np.bincount(offset, minlength=size))[:-1]
        self.groups: list[NDArray[np.int32]] = np.split(order, bounds)
        self.step = 0
        # Steps until the first request reaches its length limit (its sampled token then finishes it).
        self.to_length = int((arrays.max_known[running] - known).min())
        self.kv_indptr: Int32Array | None = None
        self.kv_indices: Int32Array | None = None
        self.plan: StepPlan | None = None
        self.version = -1


@attrs.frozen
class SchedulerConfig:
    """The deployment the scheduler plans for.

    Attributes:
        num_pages: KV pages in the cache.
        page_size: Tokens per page.
        max_model_len: Longest sequence (prompt plus generated) the model accepts.
        watermark: Fraction of pages admissions leave free for running requests to grow into.

    """

    num_pages: int = attrs.field(validator=whole(gt=0, le=INT32_MAX))
    page_size: int = attrs.field(default=16, validator=whole(gt=0, le=INT32_MAX))
    max_model_len: int = attrs.field(default=32768, validator=whole(gt=0, le=INT32_MAX))
    watermark: float = attrs.field(default=0.0, validator=number(ge=0.0, lt=1.0))


@attrs.frozen
class FinishedRequest:
    """A request that left the scheduler, with what it produced.

    Attributes:
        request_id: Its id.
        status: ``FINISHED``, ``ABORTED`` or ``FAILED``.
        reason: Why it stopped.
        prompt_len: Its prompt length.
        num_generated: Tokens it generated.
        output_token_ids: The generated ids, or ``None`` for a length-only request.
        num_preemptions: How often it was preempted and recomputed.
        error: Why it failed (``FAILED`` only), as given to :meth:`Scheduler.fail`.

    """

    request_id: str
    status: RequestStatus
    reason: FinishReason
    prompt_len: int
    num_generated: int
    output_token_ids: tuple[int, ...] | None
    num_preemptions: int
    error: str | None = None


@attrs.frozen(eq=False)
class StepOutcome:
    """What one ``update()`` did.

    Attributes:
        step_id: The plan's step id.
        request_ids: The plan's slices, in batch order.
        new_token_ids: int32 ``[B]``: the token each slice added, -1 where it added none.
        finished: Requests that finished or were aborted in this update.
        duration_s: The executor's step duration, if it gave one.

    """

    step_id: int
    request_ids: tuple[str, ...]
    new_token_ids: Int32Array
    finished: tuple[FinishedRequest, ...]
    duration_s: float | None


class Scheduler:
    """Decides, step by step, what runs. See the module docstring for the loop.

    Args:
        config: KV geometry and model limit.
        policy: The scheduling policy; defaults to ``SchedulingPolicy()``: decode-first
            with fixed 512-token chunks, the default token budget, FCFS and recompute
            preemption (a stall-free shape; load a preset for a named system).

    """

    def __init__(self, config: SchedulerConfig, policy: SchedulingPolicy | None = None) -> None:
        _expect(config, SchedulerConfig, InvalidArgumentError, "Scheduler's config")
        _expect(policy, (SchedulingPolicy, type(None)), InvalidArgumentError, "Scheduler's policy")
        self.config = config
        self.policy = policy or SchedulingPolicy(name="default")
        self._kv = PagedKVManager(
            config.num_pages,
            config.page_size,
            watermark=config.watermark,
            enable_prefix_caching=self.policy.enable_prefix_caching,
        )
        """The KV manager: internal (the scheduler's journal must see every change); others read :attr:`kv`."""
        self._kv_view = KVView(self._kv)
        self._arrays = RunningArrays()
        self._running: Int32Array = _frozen(np.empty(0, dtype=np.int32))  # admission order
        self._waiting = WaitingQueue()
        self._seqs: dict[str, SequenceState] = {}
        self._in_flight: StepPlan | None = None
        self._next_step = 0
        self._released: list[str] = []
        self._carried_preempted: list[str] = []  # preemptions of an abandoned plan, reported by the next
        self._version = 0  # bumped by every change, so a DecodeRun can tell it is still current
        self._unsteady_at = -1  # the version decode_run() last found unsteady: schedule() asks the policy
        # Steady all-decode steps are built without asking the policy, for the built-in phase
        # priorities that are known (and property-tested) to schedule every decode then.
        self._steady_fast_path = type(self.policy.priority) in EVERY_DECODE_PRIORITIES
        self._chunk_limit = chunk_limit(self.policy)  # None: chunk_run() never applies
        self._steady: _SteadyBatch | None = None  # valid while its version is the scheduler's
        # Waiting requests leave a steady step as it is once the sequence cap is reached, if the
        # policy never preempts for them and its chunk sizer is a built-in one: the priority then
        # asks the chunk sizer about one (a plugin's answer could raise) and finds no seat.
        self._seated_steady = not self.policy.preemption.preempt_for_waiting and type(self.policy.chunker) in {
            NoChunking,
            FixedChunk,
            LongPrefillThreshold,
        }
        # ... also while requests wait, when the step is sure to admit none (_admits_nobody).
        self._may_block_admissions = (
            self._steady_fast_path
            and type(self.policy.chunker) in BUILTIN_CHUNKERS
            and type(self.policy.preemption) is PreemptionPolicy
            and not self.policy.preemption.preempt_for_waiting
            and not isinstance(self.policy.queue_order, CacheAwareOrder)
        )
        order = self.policy.queue_order
        self._rerank = order if isinstance(order, CacheAwareOrder) else None  # checked once: a Protocol check is slow
        self._holds: dict[str, tuple[int, HeldKV]] = {}  # P/D: finished requests' KV, held until released
        self._claims: dict[int, Claim] = {}  # the plan in flight's cached-prefix claims, by slot, for abandon()
        # Slots the last updated general plan left with a prefill under way: while one of them
        # still runs, no step is steady (a slot is only reused by an admission, which a plan
        # commits and its update or abandon settles).
        self._prefilling: Int32Array = _NO_SLOTS

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request, *, precomputed_tokens: int = 0) -> None:
        """Queue a request.

        Args:
            request: The request.
            precomputed_tokens: Leading prompt tokens whose KV arrives with the request, as a
                disaggregated decode worker receives it from a prefill worker: they get pages
                but are not computed here. At least one prompt token must remain, whose
                logits give the first token. Lost (recomputed) if the request is preempted.

        Raises:
            InvalidArgumentError: ``request`` is not a :class:`~phasesched.request.Request`.
            DuplicateRequestError: Its id is already held.
            RequestRejectedError: It can never be served (too long for the model or the KV
                cache, or a prompt the policy could never start).
            InvalidPlanError: The policy's chunk sizer answered out of range, or its queue
                order gave a key that does not compare with the others.

        """
        _expect(request, Request, InvalidArgumentError, "add_request's request")
        if request.request_id in self._seqs:
            msg = f"request {request.request_id!r} is already in the scheduler"
            raise DuplicateRequestError(msg)
        if not is_int(precomputed_tokens) or not 0 <= precomputed_tokens < request.prompt_len:
            raise RequestRejectedError(
                request.request_id,
                f"precomputed_tokens={precomputed_tokens} must be in [0, prompt_len={request.prompt_len})",
            )
        self._check_servable(request)
        outputs: list[int] | None = [] if request.has_token_ids else None
        key = self.policy.queue_order.key(request)
        seq = SequenceState(request, key, outputs=outputs, precomputed=int(precomputed_tokens))
        if request.prompt_token_ids is not None:
            seq.prompt_ids = _frozen(np.asarray(request.prompt_token_ids, dtype=np.int32))
        if self._kv.prefix_caching:
            seq.page_hashes = prompt_page_hashes(request, self._kv.page_size)
        self._waiting.push(seq)  # first: the one step that can refuse (a plugin's incomparable key)
        self._seqs[request.request_id] = seq
        self._version += 1

    def abort(self, request_id: str) -> FinishedRequest | None:
        """Abort a request and free its KV.

        Returns:
            The aborted request's record, or ``None`` when it is part of the plan in flight:
            it is then retired by the next ``update()`` and reported in that outcome.

        Raises:
            UnknownRequestError: No such request is held.

        """
        seq = self._seqs.get(request_id)
        if seq is None:
            msg = f"no request {request_id!r} to abort"
            raise UnknownRequestError(msg)
        self._version += 1
        if self._in_flight is not None and seq.slot >= 0 and np.any(self._in_flight.slots == seq.slot):
            self._arrays.abort_pending[seq.slot] = True
            return None
        return self._end(seq, RequestStatus.ABORTED, FinishReason.ABORTED)

    def fail(self, request_id: str, reason: str) -> FinishedRequest:
        """End a request as failed, because of ``reason``, and free its KV.

        An engine calls this for the requests of a plan whose executor kept failing (after
        :meth:`abandon`); the record's status is ``FAILED``, its reason ``ERROR``, its
        ``error`` the ``reason`` given. Executors learn of it through the next plan's ``released``.

        Raises:
            UnknownRequestError: No such request is held.
            PlanInFlightError: It is part of the plan in flight: ``abandon()`` or ``update()`` that first.

        """
        seq = self._seq(request_id)
        if self._in_flight is not None and seq.slot >= 0 and np.any(self._in_flight.slots == seq.slot):
            msg = f"request {request_id!r} is part of plan {self._in_flight.step_id} in flight; abandon it first"
            raise PlanInFlightError(msg)
        self._version += 1
        return self._end(seq, RequestStatus.FAILED, FinishReason.ERROR, error=str(reason))

    def _end(
        self, seq: SequenceState, status: RequestStatus, reason: FinishReason, error: str | None = None
    ) -> FinishedRequest:
        """End a held request that is not in flight: free its KV or leave the queue, atomically."""
        journal = Journal()
        self._save_scalars(journal)
        try:
            self._drop_carried(seq.request.request_id, journal)
            if seq.slot >= 0:
                self._retire(np.array([seq.slot], np.int32), journal)
            else:
                self._waiting.remove(seq.request.request_id)
                journal.record(functools.partial(self._waiting.push, seq))
            return self._finish_record(seq, status, reason, journal, error=error)
        except BaseException:
            journal.rollback()
            raise

    def _drop_carried(self, request_id: str, journal: Journal) -> None:
        """Forget a carried preemption of a request that ends before a plan reported it.

        An abandoned plan's preemptions are reported by the next plan; a request that ends
        (aborted, failed) in between is reported in ``released`` instead, and only there:
        listing it as preempted too would tell the executor and the metrics about a request
        that is gone.
        """
        carried = self._carried_preempted
        if request_id in carried:
            self._carried_preempted = [r for r in carried if r != request_id]
            journal.record(functools.partial(setattr, self, "_carried_preempted", carried))

    # ------------------------------------------------------------------ the loop
    def schedule(self, now: float = 0.0) -> StepPlan:
        """Plan the next step. An empty plan means there is nothing to run now.

        Atomic: whatever it raises, the scheduler is as it was before the call.

        Raises:
            PlanInFlightError: The previous plan has not been updated (or abandoned) yet.
            InvalidPlanError: The policy proposed an invalid step; nothing changed.
            InvalidArgumentError: ``now`` is not a finite number.

        """
        if self._in_flight is not None:
            msg = f"plan {self._in_flight.step_id} is still in flight; call update() or abandon() first"
            raise PlanInFlightError(msg)
        if now - now != 0:  # NaN and infinities; one subtraction on the hot path
            msg = f"now must be a finite number of seconds, got {now!r}"
            raise InvalidArgumentError(msg)
        journal = Journal()
        try:
            steady_ok = self._steady_fast_path and self._unsteady_at != self._version  # decode_run just said no
            plan = self._steady_plan(journal) if steady_ok else None
            if plan is None:
                plan = self._commit(self._ask_policy(now), journal)
        except BaseException:
            journal.rollback()
            self._steady = None  # it may have moved on with the rolled-back step
            raise
        self._in_flight = plan
        self._version += 1
        steady = self._steady
        if steady is not None and steady.plan is plan:
            steady.version = self._version
        return plan

    def _steady_plan(self, journal: Journal) -> StepPlan | None:
        """The next step built from the steady batch, when every running request decodes and nobody waiting can start.

        The batch's frozen arrays are shared with its previous plans; only context lengths,
        last-page lengths and input ids are computed, and the KV pages gathered again only when
        a slice starts a fresh page. Gives exactly the plan :meth:`_commit` would build for
        :meth:`_steady_step`'s selection (``tests/test_steady_fast_path.py`` holds them together).
        """
        if len(self._waiting) and not (self._waiting_unseated() or self._may_block_admissions):
            return None
        steady = self._steady
        if steady is None or steady.version != self._version or steady.running is not self._running:
            checked = self._steady_step(unseated_waiting=True)
            if checked is None:
                self._steady = None
                return None
            steady = self._steady = _SteadyBatch(self, checked.start, checked.known)
        kv, running, start = self._kv, steady.running, steady.next_start
        size = kv.page_size
        starting = steady.groups[-steady.step % size]  # slices that start a fresh page in this step
        indptr, indices = steady.kv_indptr, steady.kv_indices
        if indptr is None or indices is None:  # the batch's first step: its tables as they stand
            new_pages = kv.pages_to_grow(running, start + 1)
            if int(new_pages.sum()) > kv.num_free_pages:
                return None  # the policy would preempt: let it
            self._extend(running, new_pages, journal)
            indptr, indices = kv.gather(running, kv.page_counts[running])
            steady.kv_indptr, steady.kv_indices = _frozen(indptr), _frozen(indices)
        elif len(starting):
            if len(starting) > kv.num_free_pages:
                return None  # the policy would preempt: let it
            grown = running[starting]
            self._extend(grown, np.ones(len(grown), dtype=np.int64), journal)
            # Each appends one page: insert them after their tables' pages, shift the offsets.
            fresh = kv.gather(grown, kv.page_counts[grown])
            indices = np.insert(indices, indptr[1:][starting], fresh[1][fresh[0][1:] - 1])
            shift = np.zeros(len(indptr), dtype=np.int32)
            shift[starting + 1] = 1
            indptr = indptr + np.cumsum(shift, dtype=np.int32)
            steady.kv_indptr, steady.kv_indices = _frozen(indptr), _frozen(indices)
        steady.step += 1
        kv_len = start + 1
        last_page_len = start % size
        last_page_len += 1
        arrays = self._arrays
        input_ids = _frozen(arrays.last_token[running]) if steady.all_ids else None
        assert steady.kv_indptr is not None
        assert steady.kv_indices is not None
        plan = StepPlan(
            step_id=self._next_step,
            request_ids=steady.request_ids,
            slots=running,
            start=start,
            num_new=steady.ones,
            prompt_len=steady.prompt_len,
            samples=steady.trues,
            qo_indptr=steady.qo_indptr,
            kv_indptr=steady.kv_indptr,
            kv_indices=steady.kv_indices,
            kv_last_page_len=_frozen(last_page_len),
            kv_len=_frozen(kv_len),
            positions=start,
            input_ids=input_ids,
            page_size=size,
            preempted=tuple(self._carried_preempted),
            new_requests=(),
            released=tuple(self._released),
        )
        steady.plan = plan
        self._next_step += 1
        if self._released:
            self._save_scalars(journal)
            self._released = []
        self._carried_preempted = []
        return plan

    def _save_scalars(self, journal: Journal) -> None:
        """Record how to restore the running order and pending releases (before a step retires or admits)."""
        saved = (self._running, list(self._released))

        def restore() -> None:
            self._running, self._released = saved

        journal.record(restore)

    def _ask_policy(self, now: float) -> CheckedSelection:
        """The policy's selection for this step, checked before anything changes."""
        view = SchedulerView(
            now=now,
            budget=self.policy.budget,
            kv=self._kv,
            arrays=self._arrays,
            running=self._running,
            waiting=self._waiting,
            max_model_len=self.config.max_model_len,
            rerank=self._rerank,
        )
        builder = BatchBuilder(view, self.policy.chunker, self.policy.preemption)
        selection: object = self.policy.priority.select(view, builder)  # a plugin may return anything
        if not isinstance(selection, Selection):
            msg = f"{type(self.policy.priority).__name__}.select returned {type(selection).__name__}, not a Selection"
            raise InvalidPlanError(msg)
        return check_selection(
            selection,
            arrays=self._arrays,
            running=self._running,
            waiting=self._waiting,
            kv=self._kv,
            budget=self.policy.budget,
            trusted=self._steady_fast_path,  # a built-in priority returns its builder's selection
        )

    def update(self, plan: StepPlan, result: StepResult) -> StepOutcome:
        """Apply an executor's result to the plan in flight.

        Atomic: whatever it raises, the scheduler is as it was before the call and the plan
        is still in flight.

        Raises:
            InvalidResultError: ``plan`` is not the plan in flight, or ``result`` does not
                match it; nothing was applied.

        """
        if plan is not self._in_flight:
            msg = f"plan {plan.step_id} is not the plan in flight"
            raise InvalidResultError(msg)
        _expect(result, StepResult, InvalidResultError, "update's result")
        result.check_against(plan)
        steady = self._steady
        if steady is not None and steady.plan is plan and steady.version == self._version:
            outcome = self._steady_update(steady, plan, result)
            if outcome is not None:
                return outcome
        journal = Journal()
        try:
            finished = self._apply(plan, result, journal)
        except BaseException:
            journal.rollback()
            raise
        self._prefilling = self._prefills_left(plan)
        self._in_flight = None
        self._version += 1
        new_tokens = np.where(plan.samples, result.token_ids, -1).astype(np.int32)
        return StepOutcome(
            step_id=plan.step_id,
            request_ids=plan.request_ids,
            new_token_ids=new_tokens,
            finished=finished,
            duration_s=result.duration_s,
        )

    def _steady_update(self, steady: _SteadyBatch, plan: StepPlan, result: StepResult) -> StepOutcome | None:
        """Apply a steady plan's result when no request finishes; ``None`` (nothing changed) when one might."""
        tokens = result.token_ids
        if steady.to_length <= 1 or result.finished is not None or steady.any_stop:
            return None
        if steady.any_eos and np.count_nonzero(tokens == steady.eos):
            return None
        arrays, slots, kv_len = self._arrays, plan.slots, plan.kv_len
        last_token = arrays.last_token[slots]  # a copy, for the undo
        journal = Journal()

        def undo() -> None:
            arrays.computed[slots], arrays.known[slots], arrays.last_token[slots] = plan.start, kv_len, last_token

        journal.record(undo)
        try:
            arrays.computed[slots] = kv_len
            arrays.known[slots] = kv_len + 1
            arrays.last_token[slots] = tokens
            if steady.all_ids:
                arrays.tokens.write(slots, kv_len, tokens, max_position=steady.max_start + 1)
            elif steady.some_ids:
                index = steady.id_index
                arrays.tokens.write(slots[index], kv_len[index], tokens[index])
            filled = steady.groups[-steady.step % self._kv.page_size]  # they start a page next step
            if self._kv.prefix_caching and len(filled):  # their last pages filled in this step
                self._register_pages(slots[filled], kv_len[filled], journal)
        except BaseException:
            journal.rollback()
            raise
        steady.next_start = kv_len
        steady.max_start += 1
        steady.to_length -= 1
        self._in_flight = None
        self._version += 1
        steady.version = self._version
        return StepOutcome(
            step_id=plan.step_id,
            request_ids=plan.request_ids,
            new_token_ids=tokens.copy(),
            finished=(),
            duration_s=result.duration_s,
        )

    def _apply(self, plan: StepPlan, result: StepResult, journal: Journal) -> tuple[FinishedRequest, ...]:
        """Record the plan's computed and sampled tokens; retire what finished."""
        arrays, slots = self._arrays, plan.slots
        last_token = arrays.last_token[slots]  # a copy, for the undo

        def undo() -> None:
            # Before the plan, computed was its start, and a slice that samples knew kv_len tokens.
            arrays.computed[slots], arrays.last_token[slots] = plan.start, last_token
            arrays.known[slots[plan.samples]] = plan.kv_len[plan.samples]

        journal.record(undo)
        arrays.computed[slots] = plan.kv_len
        done, reasons = self._record_tokens(plan, result)
        if self._kv.prefix_caching:
            self._register_pages(slots, plan.kv_len, journal)
        if not reasons:
            return ()
        self._save_scalars(journal)
        return self._finish(slots[done], reasons, journal)

    def _prefills_left(self, plan: StepPlan) -> Int32Array:
        """Slots of ``plan``'s unsampled slices whose prefill is still under way once it is applied."""
        partial = np.flatnonzero(~plan.samples)
        if not len(partial):
            return _NO_SLOTS
        arrays, slots, computed = self._arrays, plan.slots[partial], plan.kv_len[partial]
        # _steady_step's test: more than one token left to feed, or the prompt not yet computed.
        under_way = (arrays.known[slots] - computed != 1) | (computed < arrays.prompt_len[slots])
        left: Int32Array = slots[under_way]
        return left

    def abandon(self, plan: StepPlan) -> tuple[FinishedRequest, ...]:
        """Give back the plan in flight, unexecuted: its executor could not run it.

        The plan's requests return to where they stood before it, and no token of it is
        recorded. Those that were running keep the tokens they had computed and give back the
        pages the plan's new tokens took; those the plan admitted return to the waiting queue
        in their old place, unpreempted (a disaggregated request's transferred KV is dropped
        with its pages and recomputed). Requests the plan preempted stay preempted, and
        requests aborted while it was in flight are retired now. Cached prefixes its admissions
        claimed stay cached, and their lookups leave the hit counters (the readmission counts
        them again). The next plan repeats what this one told the executor: its ``preempted``
        and ``released`` carry over (a preempted request that ends before that plan, failed or
        aborted, is only released), and the requests it admitted are released. The plan's
        ``step_id`` is not reused.

        Returns:
            The requests aborted while the plan was in flight, now retired.

        Raises:
            InvalidPlanError: ``plan`` is not the plan in flight; nothing changed.

        """
        if plan is not self._in_flight or plan is None:
            msg = f"plan {getattr(plan, 'step_id', plan)} is not the plan in flight"
            raise InvalidPlanError(msg)
        self._in_flight = None
        self._version += 1
        arrays, slots, journal = self._arrays, plan.slots, Journal()
        aborted = arrays.abort_pending[slots]
        finished = self._finish(slots[aborted], [FinishReason.ABORTED] * int(aborted.sum()), journal)
        new_ids = {request.request_id for request in plan.new_requests}
        admitted = np.array([rid in new_ids for rid in plan.request_ids], dtype=bool) & ~aborted
        kept = ~admitted & ~aborted
        self._kv.retract(slots[kept], -(-plan.start[kept] // self._kv.page_size))
        returned = self._unadmit(slots[admitted])
        self._released = [*plan.released, *returned, *self._released]
        self._carried_preempted = list(plan.preempted)
        return finished

    def _unadmit(self, slots: Int32Array) -> list[str]:
        """Return requests admitted by an abandoned plan to their place in the waiting queue."""
        if not len(slots):
            return []
        seqs: list[SequenceState] = self._arrays.seqs[slots].tolist()
        for slot in slots.tolist():  # the admission looked up and claimed nothing after all
            self._kv.uncount_claim(self._claims.pop(slot, None))
        self._retire(slots, Journal())
        for seq in seqs:
            seq.status = RequestStatus.PREEMPTED if seq.num_preemptions else RequestStatus.WAITING
            seq.precomputed = 0  # its transferred KV went with its pages
            self._waiting.push(seq)
        return [seq.request.request_id for seq in seqs]

    # ------------------------------------------------------------------ steady decoding
    def decode_run(self, max_steps: int) -> DecodeRun | None:
        """The next steps, if they are certain to be identical pure-decode steps (the simulation fast path).

        A simulator uses this to advance many steps in one vectorized computation. It applies
        when the next step is steady (no plan in flight, nothing waiting that could be admitted,
        every running request decoding one token within the budget and KV, under one of the
        built-in phase priorities
        of :data:`~phasesched.policies.priority.EVERY_DECODE_PRIORITIES`) and no running
        request's tokens matter (no token ids, EOS or stop tokens: a simulator makes them up);
        then each step until the first finish schedules exactly the same requests, one token each.

        Returns:
            The run, capped at ``max_steps``, or ``None`` when it does not apply.

        Raises:
            InvalidArgumentError: ``max_steps`` is not an int.
        """
        if not is_int(max_steps):
            msg = f"max_steps must be an int, got {max_steps!r}"
            raise InvalidArgumentError(msg)
        if max_steps < 1 or self._arrays.num_with_tokens or not self._steady_fast_path:
            return None
        step = self._steady_step()
        if step is None:
            self._unsteady_at = self._version
            return None
        arrays, running = self._arrays, self._running
        steps = min(max_steps, int((arrays.max_known[running] - step.known).min()))  # up to the first finish
        held = int(self._kv.page_counts[running].sum())
        steps = steps_that_fit(step.start, held, self._kv.num_free_pages, self._kv.page_size, steps)
        ids = tuple(arrays.ids[running].tolist())
        later = bool(len(self._waiting)) and self._head_blocks(int(step.new_pages.sum()))
        return DecodeRun(ids, running.copy(), step.start + 1, steps, self._version, later)

    def advance(self, run: DecodeRun, num_steps: int) -> tuple[FinishedRequest, ...]:
        """Take ``num_steps`` of ``run``'s steps at once: every request computes and samples ``num_steps`` tokens.

        Returns:
            The requests that finished in the last of the steps (for length).

        Raises:
            InvalidPlanError: The run is stale (the scheduler changed since it was made) or
                ``num_steps`` is outside ``[1, run.max_steps]``; nothing changed.
        """
        if run._version != self._version:  # noqa: SLF001 -- the run's own token
            msg = "this DecodeRun is stale: the scheduler changed after decode_run()"
            raise InvalidPlanError(msg)
        if not is_int(num_steps) or not 1 <= num_steps <= run.max_steps:
            msg = f"num_steps must be in [1, {run.max_steps}], got {num_steps}"
            raise InvalidPlanError(msg)
        journal = Journal()
        try:
            finished = self._advance(run.slots, int(num_steps), journal)
        except BaseException:
            journal.rollback()
            raise
        self._next_step += num_steps
        self._version += 1
        return finished

    def _advance(self, slots: Int32Array, num_steps: int, journal: Journal) -> tuple[FinishedRequest, ...]:
        arrays = self._arrays
        computed = arrays.computed[slots] + num_steps
        self._extend(slots, self._kv.pages_to_grow(slots, computed), journal)
        known = arrays.known[slots] + num_steps

        def undo() -> None:
            arrays.computed[slots], arrays.known[slots] = computed - num_steps, known - num_steps

        journal.record(undo)
        arrays.computed[slots], arrays.known[slots] = computed, known
        done = slots[known >= arrays.max_known[slots]]
        if not len(done):
            return ()
        self._save_scalars(journal)
        return self._finish(done, [FinishReason.LENGTH] * len(done), journal)

    def chunk_run(self, max_steps: int) -> ChunkRun | None:
        """The next steps, if they are certain to be decode-first steps with prefill chunks (a simulation fast path).

        It applies when no plan is in flight, at least one running request is
        part-way through its prefill, no running request's tokens matter (as for
        :meth:`decode_run`), the phase priority is exactly
        :class:`~phasesched.policies.priority.DecodeFirst` and the chunk sizer exactly
        :class:`~phasesched.policies.chunking.FixedChunk` or
        :class:`~phasesched.policies.chunking.LongPrefillThreshold`. Each step then schedules every
        decode (they must leave budget for a chunk), then each ongoing prefill in admission order
        its chunk of the budget left, as the policy would; the run ends at the first step that
        completes a prefill or finishes a decode, and before a step whose pages would not fit.
        Requests may wait if the policy never preempts for them and its queue order does not
        re-rank them: the run then stops before a step that leaves budget over (which the policy
        would offer them), and as every step spends the budget, requests that arrive meanwhile
        change none of them (``ignores_later_arrivals``).

        Returns:
            The run, capped at ``max_steps``, or ``None`` when it does not apply.

        Raises:
            InvalidArgumentError: ``max_steps`` is not an int.
        """
        if not is_int(max_steps):
            msg = f"max_steps must be an int, got {max_steps!r}"
            raise InvalidArgumentError(msg)
        limit, running, arrays = self._chunk_limit, self._running, self._arrays
        # Requests may wait if the steps leave them no token: the policy's admit() then answers
        # NO_TOKENS before anything else, unless they may preempt or a queue order re-ranks them.
        waiting = bool(len(self._waiting))
        if (
            limit is None
            or max_steps < 1
            or self._in_flight is not None
            or not len(running)
            or self._carried_preempted
            or arrays.num_with_tokens
            or (waiting and (self.policy.preemption.preempt_for_waiting or self._rerank is not None))
            # A prefill under way was left so by the last step (update() and advance_chunks() note
            # it); one the last plan gave no tokens is missed, which only costs a step by the policy.
            or not np.count_nonzero(arrays.running[self._prefilling])
        ):
            return None
        computed, known = arrays.computed[running], arrays.known[running]
        decoding = (known - computed == 1) & (computed >= arrays.prompt_len[running])  # BatchBuilder's test
        if np.count_nonzero(decoding) == len(running):
            return None
        decodes = running[decoding]
        tokens_left = self.policy.budget.max_num_batched_tokens - len(decodes)
        if tokens_left < 1:
            return None
        if len(decodes):  # up to the first decode's finish
            max_steps = min(max_steps, int((arrays.max_known[decodes] - known[decoding]).min()))
        kv = self._kv
        free = kv.num_free_pages
        if self._holds and kv.prefix_caching:
            # Held KV may be released while the run lasts (P/D), parking cached pages that stepping
            # could evict for a later step's growth: take only steps that evict nothing.
            free -= kv.num_cached_pages
        steps, growth = plan_chunk_steps(
            decodes,
            computed[decoding],
            running[~decoding],
            computed[~decoding],
            known[~decoding],
            tokens_left=tokens_left,
            chunk_limit=limit,
            page_size=kv.page_size,
            free_pages=free,
            max_steps=max_steps,
            spend_budget=waiting,
        )
        if not steps:
            return None
        growth_array = np.asarray(growth, dtype=np.int64)
        return ChunkRun(tuple(steps), growth_array, len(decodes), self._version, ignores_later_arrivals=waiting)

    def advance_chunks(self, run: ChunkRun, num_steps: int) -> tuple[FinishedRequest, ...]:
        """Take the first ``num_steps`` of ``run``'s steps at once, as ``schedule``/``update`` would one by one.

        Returns:
            The requests that finished in the last of the steps.

        Raises:
            InvalidPlanError: The run is stale (the scheduler changed since it was made) or
                ``num_steps`` is outside ``[1, run.max_steps]``; nothing changed.
        """
        if run._version != self._version:  # noqa: SLF001 -- the run's own token
            msg = "this ChunkRun is stale: the scheduler changed after chunk_run()"
            raise InvalidPlanError(msg)
        if not is_int(num_steps) or not 1 <= num_steps <= run.max_steps:
            msg = f"num_steps must be in [1, {run.max_steps}], got {num_steps}"
            raise InvalidPlanError(msg)
        journal = Journal()
        try:
            finished = self._advance_chunks(run, int(num_steps), journal)
        except BaseException:
            journal.rollback()
            raise
        self._next_step += num_steps
        self._version += 1
        return finished

    def _advance_chunks(self, run: ChunkRun, num_steps: int, journal: Journal) -> tuple[FinishedRequest, ...]:
        """Each step's commit and update, as ``_commit`` and ``_apply`` make them (pages, then tokens, then names)."""
        arrays, kv, steps = self._arrays, self._kv, run.steps[:num_steps]
        first, last, decodes = steps[0], steps[-1], run.num_decodes
        # Usually every step has the same slices (the ongoing prefills that fit are a prefix of them).
        same = all(len(step.slots) == len(first.slots) for step in steps)
        touched = first.slots if same else np.unique(np.concatenate([step.slots for step in steps]))
        saved = (arrays.computed[touched], arrays.known[touched], self._prefilling)

        def undo() -> None:
            arrays.computed[touched], arrays.known[touched], self._prefilling = saved

        journal.record(undo)
        caching = kv.prefix_caching
        if same and not caching:  # the steps' tokens and pages in one go (as advance() takes a decode run's)
            arrays.computed[touched] = last.kv_len
            arrays.known[touched[:decodes]] += num_steps
            arrays.known[touched[decodes:][last.samples[decodes:]]] += 1  # prefills sample only as they complete
        else:
            for step in steps:
                slots = step.slots
                if caching:  # each step's growth may evict cached pages that an earlier step names
                    self._extend(slots, kv.pages_to_grow(slots, step.kv_len), journal)
                arrays.computed[slots] = step.kv_len
                arrays.known[slots[step.samples]] += 1
                if caching:
                    self._register_pages(slots, step.kv_len, journal)
        if not caching:
            self._extend(touched, kv.pages_to_grow(touched, arrays.computed[touched]), journal)
        # As update() leaves it: the slots whose prefill is still under way (a shortcut for _steady_step).
        computed = arrays.computed[touched]
        under_way = (arrays.known[touched] - computed != 1) | (computed < arrays.prompt_len[touched])
        self._prefilling = touched[under_way].astype(np.int32)
        done = last.slots[last.samples & (arrays.known[last.slots] >= arrays.max_known[last.slots])]
        if not len(done):
            return ()
        self._save_scalars(journal)
        return self._finish(done, [FinishReason.LENGTH] * len(done), journal)

    def _waiting_unseated(self) -> bool:
        """Whether no waiting request can be seated in this step (see ``_seated_steady``)."""
        return self._seated_steady and len(self._running) >= self.policy.budget.max_num_seqs

    def _steady_step(self, *, unseated_waiting: bool = False) -> CheckedSelection | None:
        """The next step, when it is certain to be every running request decoding one token.

        That holds when no plan is in flight, nothing waits or nobody waiting can be admitted
        (:meth:`_admits_nobody`), every running request decodes (one generated token left to
        feed), the budget holds them all, KV covers the step, and the phase priority is a
        built-in one known to schedule every decode then (the caller checks
        :data:`~phasesched.policies.priority.EVERY_DECODE_PRIORITIES`). Then the policy's answer
        is known without asking it, and as the selection is built here from the scheduler's own
        state there is nothing to check. With ``unseated_waiting``, requests may wait while no
        seat is free for them, the policy never preempts for them and the chunk sizer is a
        built-in one: the built-in priorities then find no seat and schedule every decode too.
        """
        running = self._running
        if self._in_flight is not None or not len(running):
            return None
        unseated = unseated_waiting and self._waiting_unseated()
        if len(self._waiting) and not (unseated or self._may_block_admissions):
            return None
        arrays, prefilling = self._arrays, self._prefilling
        # The last plan's prefill still under way is the prefill test below, on its slots alone.
        if len(running) > self.policy.budget.max_num_batched_tokens or (
            len(prefilling) and np.count_nonzero(arrays.running[prefilling])
        ):
            return None
        start, known = arrays.computed[running], arrays.known[running]
        if np.count_nonzero(known - start - 1) or np.any(start < arrays.prompt_len[running]):
            return None  # a prefill is under way, if only a prompt's last token
        new_pages = self._kv.pages_to_grow(running, start + 1)
        growth = int(new_pages.sum())
        blocked = not len(self._waiting) or unseated or self._admits_nobody(growth)
        if growth > self._kv.num_free_pages or not blocked:
            return None  # the policy would preempt, or might admit: let it
        selection = Selection(running, np.ones(len(running), dtype=np.int32))
        return CheckedSelection(selection, start, known, new_pages)

    def _admits_nobody(self, decode_pages: int) -> bool:
        """Whether a steady step is certain to admit no waiting request.

        Only asked for the built-in phase priorities and chunk sizers, with waiting requests
        that may not preempt and a queue order that does not re-rank by cached prefixes
        (``_may_block_admissions``). Those priorities admit through
        :meth:`~phasesched.policies.builder.BatchBuilder.admit`, which needs a free seat, a
        token left and room for the request's *whole* prefill beyond the watermark; decode-first
        and equal-progress steps take the decodes' new pages first. The decode-first and
        prefill-first loops stop at the first request the chunk sizer starts but that finds no
        room, and skip at most ``max_declined`` that it declines; equal progress tries at most
        ``max_prompts``. With no prefill under way the built-in sizers start any request except
        a whole-prompt sizer facing a prompt beyond the budget, so the queue's head usually
        decides. Seats, tokens and pages only shrink while decodes run and nothing finishes,
        which lets a decode run carry the answer over its steps.
        """
        priority, budget = self.policy.priority, self.policy.budget
        decode_first = type(priority) is not PrefillFirst
        seats = budget.max_num_seqs - len(self._running)
        tokens = budget.max_num_batched_tokens - (len(self._running) if decode_first else 0)
        if seats <= 0 or tokens <= 0:
            return True
        room = self._kv.num_free_pages - (decode_pages if decode_first else 0) - self._kv.watermark_pages
        equal_progress = isinstance(priority, EqualProgress)
        if isinstance(priority, EqualProgress):
            tried = priority.max_prompts
        else:
            assert isinstance(priority, (DecodeFirst, PrefillFirst))  # _may_block_admissions' promise
            tried = priority.max_declined + 1
        whole_only = type(self.policy.chunker) is NoChunking
        pages_for = self._kv.pages_for
        for seq in itertools.islice(self._waiting.ordered(), tried):
            if pages_for(seq.num_tokens) <= room:
                return False
            if not equal_progress and (not whole_only or seq.num_tokens <= tokens):
                return True  # started, so it finds no room, and the loop stops there
        return True

    def _head_blocks(self, decode_pages: int) -> bool:
        """Whether the FCFS queue's head stops every admission of a steady step (see :class:`DecodeRun`).

        Decode-first and prefill-first try the head first; a built-in sizer other than the
        whole-prompt one starts it when no prefill is under way, and with no room it ends the
        loop, so whatever queues behind it is never looked at.
        """
        priority = self.policy.priority
        if type(priority) not in (DecodeFirst, PrefillFirst) or type(self.policy.queue_order) is not FCFS:
            return False
        if type(self.policy.chunker) is NoChunking:
            return False
        decode_first = type(priority) is DecodeFirst
        room = self._kv.num_free_pages - (decode_pages if decode_first else 0) - self._kv.watermark_pages
        head = next(self._waiting.ordered())
        return self._kv.pages_for(head.num_tokens) > room

    # ------------------------------------------------------------------ introspection
    @property
    def num_running(self) -> int:
        """Requests holding KV."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (new and preempted)."""
        return len(self._waiting)

    @property
    def num_unfinished(self) -> int:
        """Requests held, running or waiting."""
        return len(self._seqs)

    @property
    def plan_in_flight(self) -> StepPlan | None:
        """The plan awaiting ``update()``, if any."""
        return self._in_flight

    @property
    def pending_releases(self) -> tuple[str, ...]:
        """Requests whose end the next plan will report in ``released`` (executors drop their state then)."""
        return tuple(self._released)

    @property
    def kv(self) -> KVView:
        """The KV pages, read-only (free pages, watermark, page size, cache counters, tables)."""
        return self._kv_view

    @property
    def kv_usage(self) -> float:
        """Fraction of KV pages in use."""
        return self._kv.usage

    def running_request_ids(self) -> list[str]:
        """Running requests, in admission order."""
        ids: list[str] = self._arrays.ids[self._running].tolist()
        return ids

    def waiting_request_ids(self) -> Iterator[str]:
        """Waiting requests in queue order, lazily."""
        return (seq.request.request_id for seq in self._waiting.ordered())

    def request(self, request_id: str) -> Request:
        """The held request with this id.

        Raises:
            UnknownRequestError: No such request is held.
        """
        return self._seq(request_id).request

    def status(self, request_id: str) -> RequestStatus:
        """Where a held request stands."""
        return self._seq(request_id).status

    def progress(self, request_id: str) -> tuple[int, int]:
        """``(tokens computed, tokens known)`` of a held request."""
        seq = self._seq(request_id)
        if seq.slot < 0:
            return 0, seq.num_tokens
        return int(self._arrays.computed[seq.slot]), int(self._arrays.known[seq.slot])

    def check_invariants(self) -> None:
        """Assert the internal bookkeeping is whole (tests call this after every step)."""
        self._kv.check_invariants()
        arrays, running = self._arrays, self._running
        assert len(np.unique(running)) == len(running), "a slot runs twice"
        assert int(arrays.running.sum()) == len(running), "running mask and order disagree"
        assert len(running) + len(self._waiting) == len(self._seqs), "a request is lost or counted twice"
        assert len(running) <= self.policy.budget.max_num_seqs, "more running requests than max_num_seqs"
        assert np.all(arrays.computed[running] < arrays.known[running]), "a running request has nothing to compute"
        if self._in_flight is None:
            held = self._kv.page_counts[running]
            assert np.array_equal(held, -(-arrays.computed[running] // self._kv.page_size)), "pages != tokens held"
        for seq in self._seqs.values():
            assert (seq.slot >= 0) == (seq.status is RequestStatus.RUNNING), "slot and status disagree"
        assert self._kv.num_held_tables == len(self._holds), "held KV tables miscounted"
        assert all(self._kv.is_held(slot) for slot, _ in self._holds.values()), "a hold lost its table"

    # ------------------------------------------------------------------ P/D: hold pages until released
    def hold_kv(self, request_id: str) -> None:
        """Keep ``request_id``'s KV pages when it finishes, until :meth:`release_kv` (vLLM's delayed free).

        A disaggregated prefill worker calls this for each request it prefills: when the request
        finishes (its prompt computed), its pages stay in place, counted as used, while the
        decode side copies them; an abort or a preemption still frees them at once.

        Raises:
            UnknownRequestError: No such request is held.

        """
        self._seq(request_id).hold_kv = True

    def held_kv(self, request_id: str) -> HeldKV:
        """The KV a finished request left held.

        Raises:
            UnknownRequestError: ``request_id`` holds no KV here.

        """
        held = self._holds.get(request_id)
        if held is None:
            msg = f"request {request_id!r} holds no KV"
            raise UnknownRequestError(msg)
        return held[1]

    @property
    def held_request_ids(self) -> tuple[str, ...]:
        """Finished requests whose KV is still held."""
        return tuple(self._holds)

    def release_kv(self, request_id: str) -> None:
        """Free the KV pages a finished request left held.

        Raises:
            UnknownRequestError: ``request_id`` holds no KV here.

        """
        held = self._holds.pop(request_id, None)
        if held is None:
            msg = f"request {request_id!r} holds no KV to release"
            raise UnknownRequestError(msg)
        self._kv.release(held[0])
        self._version += 1

    def _hold_finished(self, seqs: list[SequenceState], reasons: list[FinishReason], journal: Journal) -> None:
        """Mark the tables of finishing requests that asked for it, so retiring them holds their pages."""
        for seq, reason in zip(seqs, reasons, strict=True):
            if seq is None or not seq.hold_kv or reason in (FinishReason.ABORTED, FinishReason.ERROR):
                continue
            slot, request_id = seq.slot, seq.request.request_id
            self._kv.defer_free(slot)
            journal.record(functools.partial(self._kv.undefer_free, slot))
            pages = self._kv.pages(slot).copy()
            pages.flags.writeable = False
            self._holds[request_id] = (slot, HeldKV(request_id, int(self._arrays.computed[slot]), pages))
            journal.record(functools.partial(self._holds.pop, request_id))

    # ------------------------------------------------------------------ internals
    def _seq(self, request_id: str) -> SequenceState:
        seq = self._seqs.get(request_id)
        if seq is None:
            msg = f"no request {request_id!r} is held"
            raise UnknownRequestError(msg)
        return seq

    def _check_servable(self, request: Request) -> None:
        """Refuse what could never finish: too long for the model, the KV cache, or a restart after preemption."""
        limit = self.config.max_model_len
        if request.prompt_len > limit:
            raise RequestRejectedError(
                request.request_id, f"prompt of {request.prompt_len} tokens exceeds max_model_len={limit}"
            )
        most_cached = max(request.prompt_len, min(request.max_total_tokens, limit) - 1)
        capacity = self._kv.num_pages - self._kv.watermark_pages
        if self._kv.pages_for(most_cached) > capacity:
            raise RequestRejectedError(
                request.request_id,
                f"it may hold {most_cached} tokens of KV, more than "
                f"the {capacity} usable pages of {self._kv.page_size} tokens",
            )
        # After a preemption it restarts from zero with its generated tokens too: at most
        # ``most_cached`` tokens, which the chunk sizer must be able to start in an empty step.
        restart = PrefillCandidate(request, 0, most_cached, ongoing=False)
        empty = ChunkContext(
            self.policy.budget.max_num_batched_tokens, (), np.empty(0, np.int64), np.empty(0, np.int64)
        )
        if checked_chunk(self.policy.chunker, restart, empty) == 0:
            raise RequestRejectedError(
                request.request_id,
                f"the chunk sizer could never start (or, after a preemption, restart) its up to "
                f"{most_cached} tokens under a budget of {self.policy.budget.max_num_batched_tokens}",
            )

    def _commit(self, checked: CheckedSelection, journal: Journal) -> StepPlan:
        """Apply a checked selection and build its plan, recording every change in ``journal``."""
        selection, arrays = checked.selection, self._arrays
        if selection.preempted or selection.admitted:  # the steady step changes neither
            self._save_scalars(journal)
        preempted = [*self._carried_preempted, *self._preempt(selection.preempted, journal)]
        slots, start, known, num_new = selection.running_slots, checked.start, checked.known, selection.running_tokens
        new_requests: list[Request] = []
        if self._claims:  # the last plan's claims: it was updated or abandoned
            claims = self._claims
            self._claims = {}
            journal.record(functools.partial(setattr, self, "_claims", claims))
        if selection.admitted:  # first, so cached prefixes are claimed before growth may evict them
            admitted, new_requests = self._admit(selection.admitted, checked.admitted_cached, journal)
        self._extend(slots, checked.new_pages, journal)
        if selection.admitted:
            admitted_tokens = np.asarray(selection.admitted_tokens, dtype=np.int32)
            admitted_start = arrays.computed[admitted]  # precomputed (transferred) tokens, usually 0
            self._extend(admitted, self._kv.pages_to_grow(admitted, admitted_start + admitted_tokens), journal)
            slots = np.concatenate([slots, admitted])
            start = np.concatenate([start, admitted_start])
            known = np.concatenate([known, arrays.known[admitted]])
            num_new = np.concatenate([num_new, admitted_tokens])
        kv_len = start + num_new
        kv_indptr, kv_indices = self._kv.gather(slots, self._kv.page_counts[slots])
        plan = build_step_plan(
            step_id=self._next_step,
            request_ids=tuple(arrays.ids[slots].tolist()),
            slots=slots,
            start=start,
            num_new=num_new,
            prompt_len=arrays.prompt_len[slots],
            samples=kv_len == known,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            page_size=self._kv.page_size,
            input_ids=self._input_ids(slots, start, num_new, known),
            preempted=preempted,
            new_requests=new_requests,
            released=self._released,
        )
        self._next_step += 1
        self._released = []
        self._carried_preempted = []
        return plan

    def _extend(self, slots: Int32Array, num_pages: NDArray[np.int64], journal: Journal) -> None:
        if not np.count_nonzero(num_pages):  # most decode steps cross no page boundary
            return
        counts = self._kv.page_counts[slots]  # a copy (fancy indexing), for the undo
        evicted = self._kv.extend_many(slots, num_pages)

        def undo() -> None:
            self._kv.retract(slots, counts)
            self._kv.unevict(evicted)

        journal.record(undo)

    def _preempt(self, victims: tuple[int, ...], journal: Journal) -> list[str]:
        if not victims:
            return []
        slots = np.asarray(victims, dtype=np.int32)
        seqs: list[SequenceState] = self._arrays.seqs[slots].tolist()
        saved = [(seq.status, seq.num_preemptions, seq.precomputed) for seq in seqs]
        self._retire(slots, journal)

        def undo() -> None:
            for seq, (status, preemptions, precomputed) in zip(seqs, saved, strict=True):
                if seq.request.request_id in self._waiting:
                    self._waiting.remove(seq.request.request_id)
                seq.status, seq.num_preemptions, seq.precomputed = status, preemptions, precomputed

        journal.record(undo)
        ids = []
        for seq in seqs:
            seq.status = RequestStatus.PREEMPTED
            seq.num_preemptions += 1
            seq.precomputed = 0  # its transferred KV is gone with its pages
            self._waiting.push(seq)
            ids.append(seq.request.request_id)
        self._released.extend(ids)
        return ids

    def _admit(
        self, request_ids: tuple[str, ...], cached_pages: tuple[int, ...], journal: Journal
    ) -> tuple[Int32Array, list[Request]]:
        slots = np.empty(len(request_ids), dtype=np.int32)
        requests = []
        for i, request_id in enumerate(request_ids):
            seq = self._waiting.remove(request_id)
            journal.record(functools.partial(self._readmit, seq, seq.status))
            slot = self._kv.open()
            journal.record(functools.partial(self._kv.close_empty, slot))
            self._arrays.load(slot, seq, self.config.max_model_len)
            # Recorded at once: the claim below may raise, and a loaded slot reads as running.
            journal.record(functools.partial(self._arrays.unload, np.array([slot], np.int32)))
            if self._kv.prefix_caching:
                self._kv.limit_naming(slot, INT32_MAX if seq.outputs is not None else len(seq.page_hashes))
                if not seq.precomputed:
                    self._claim(slot, seq, cached_pages[i], journal)
            seq.slot, seq.status = slot, RequestStatus.RUNNING
            slots[i] = slot
            requests.append(seq.request)
        if len(slots):
            self._running = _frozen(np.concatenate([self._running, slots]))
        return slots, requests

    def _claim(self, slot: int, seq: SequenceState, num_pages: int, journal: Journal) -> None:
        """Start ``slot`` from the cached pages of its prefix, as checked: its computed tokens begin there."""
        hashes = seq.claimable_hashes(self._kv.page_size)
        claim = self._kv.claim(slot, hashes, num_pages, queried=len(hashes))
        journal.record(functools.partial(self._kv.unclaim, claim))
        if claim is not None:
            self._claims[slot] = claim
            journal.record(functools.partial(self._claims.pop, slot))
        self._arrays.computed[slot] = num_pages * self._kv.page_size

    def _register_pages(self, slots: Int32Array, computed: Int32Array, journal: Journal) -> None:
        """Name the pages that filled in this step by their content hashes, for later requests to claim."""
        kv = self._kv
        due = kv.pages_to_hash(slots, computed)
        index = np.flatnonzero(due)
        if not len(index):
            return
        size, arrays = kv.page_size, self._arrays
        slots, due = slots[index], due[index]
        full: list[int] = (computed[index] // size).tolist()
        seqs: list[SequenceState] = arrays.seqs[slots].tolist()
        has_ids: list[bool] = arrays.has_ids[slots].tolist()
        extended: list[tuple[SequenceState, int]] = []
        one_page: list[int] = []  # slices whose generated tokens filled exactly one page (decodes)
        for i, seq in enumerate(seqs):
            known = len(seq.page_hashes)
            if known < full[i] and has_ids[i]:  # generated tokens: hash as their pages fill
                extended.append((seq, known))
                if known == full[i] - 1:
                    one_page.append(i)
                else:
                    tokens = arrays.tokens.row(int(slots[i]), known * size, full[i] * size)  # the new pages' tokens
                    extend_page_hashes(seq.page_hashes, tokens, size, full[i], offset=known * size)
        if one_page:
            rows = slots[one_page]
            first = (np.asarray(full, dtype=np.int64)[one_page] - 1) * size
            pages: list[list[int]] = arrays.tokens.gather(rows[:, None], first[:, None] + np.arange(size)).tolist()
            for i, tokens in zip(one_page, pages, strict=True):  # extend_page_hashes, one page each
                hashes = seqs[i].page_hashes
                hashes.append(hash((hashes[-1] if hashes else ROOT_HASH, tuple(tokens))))
        if extended:
            journal.record(functools.partial(self._truncate_hashes, extended))
        registrations = kv.register_many(slots, [seq.page_hashes for seq in seqs], due)
        journal.record(functools.partial(kv.unregister_many, registrations))

    @staticmethod
    def _truncate_hashes(extended: list[tuple[SequenceState, int]]) -> None:
        for seq, length in extended:
            del seq.page_hashes[length:]

    def _readmit(self, seq: SequenceState, status: RequestStatus) -> None:
        """Undo an admission's removal from the waiting queue: same key, same place."""
        seq.status = status
        self._waiting.push(seq)

    def _retire(self, slots: Int32Array, journal: Journal) -> None:
        """Free the KV of running ``slots`` and take them off the running set."""
        arrays = self._arrays
        seqs: list[SequenceState] = arrays.seqs[slots].tolist()
        progress = [(seq.outputs, seq.num_generated) for seq in seqs]
        freed = self._kv.free_many(slots)
        journal.record(lambda: self._kv.unfree(freed))
        arrays.unload(slots)
        journal.record(lambda: arrays.reload(slots, seqs, progress))
        self._running = _frozen(self._running[arrays.running[self._running]])

    def _input_ids(
        self, slots: Int32Array, start: Int32Array, num_new: Int32Array, known: Int32Array
    ) -> Int32Array | None:
        arrays = self._arrays
        if not len(slots) or np.count_nonzero(arrays.has_ids[slots]) < len(slots):
            return None
        total = int(num_new.sum())
        if len(slots) == total and np.array_equal(start, known - 1):
            last: Int32Array = arrays.last_token[slots]  # all decodes: each feeds its last token
            return last
        longer = np.flatnonzero(num_new > 1)
        if len(longer) > 16:  # many multi-token slices: one gather of every position
            return arrays.tokens.gather(np.repeat(slots, num_new), token_positions(start, num_new))
        # Few chunks (the usual mixed step): single tokens in one gather, each chunk one row slice.
        ids = np.empty(total, dtype=np.int32)
        first = np.cumsum(num_new) - num_new
        single = num_new == 1
        ids[first[single]] = arrays.tokens.gather(slots[single], start[single])
        rows = arrays.tokens.ids
        for i in longer.tolist():
            begin, length = int(start[i]), int(num_new[i])
            ids[first[i] : first[i] + length] = rows[slots[i], begin : begin + length]
        return ids

    def _record_tokens(self, plan: StepPlan, result: StepResult) -> tuple[NDArray[np.bool_], list[FinishReason]]:
        """Record sampled tokens; return which slices finish, and why, in slice order."""
        arrays, slots, sampled = self._arrays, plan.slots, plan.samples
        s_slots, s_tokens = slots[sampled], result.token_ids[sampled]
        known = arrays.known[s_slots] + 1
        arrays.known[s_slots] = known
        arrays.last_token[s_slots] = s_tokens
        by_length = np.zeros(len(slots), dtype=bool)
        by_length[sampled] = known >= arrays.max_known[s_slots]
        by_stop = np.zeros(len(slots), dtype=bool)
        by_stop[sampled] = s_tokens == arrays.eos[s_slots]
        self._append_token_ids(s_slots, s_tokens, known)
        stop_sets = np.flatnonzero(sampled & arrays.has_stop_set[slots])
        for i in stop_sets.tolist():
            by_stop[i] |= int(result.token_ids[i]) in arrays.stop_sets[int(slots[i])]
        done = by_length | by_stop | arrays.abort_pending[slots]
        if result.finished is not None:
            done |= result.finished
        if not np.count_nonzero(done):
            return done, []
        aborted = arrays.abort_pending[slots[done]]
        reasons = [
            FinishReason.ABORTED
            if a
            else FinishReason.STOP
            if s
            else FinishReason.LENGTH
            if n
            else FinishReason.EXECUTOR
            for a, s, n in zip(aborted.tolist(), by_stop[done].tolist(), by_length[done].tolist(), strict=True)
        ]
        return done, reasons

    def _append_token_ids(self, slots: Int32Array, tokens: Int32Array, known: Int32Array) -> None:
        """Store each sampled token at its position (requests without ids have no row)."""
        with_ids = self._arrays.has_ids[slots]
        if np.count_nonzero(with_ids) < len(slots):
            slots, tokens, known = slots[with_ids], tokens[with_ids], known[with_ids]
        self._arrays.tokens.write(slots, known - 1, tokens)

    def _finish(self, slots: Int32Array, reasons: list[FinishReason], journal: Journal) -> tuple[FinishedRequest, ...]:
        if not len(slots):
            return ()
        seqs: list[SequenceState] = self._arrays.seqs[slots].tolist()
        self._hold_finished(seqs, reasons, journal)  # P/D: before the pages are freed
        self._retire(slots, journal)
        records = []
        for seq, reason in zip(seqs, reasons, strict=True):
            status = RequestStatus.ABORTED if reason is FinishReason.ABORTED else RequestStatus.FINISHED
            records.append(self._finish_record(seq, status, reason, journal))
        return tuple(records)

    def _finish_record(
        self,
        seq: SequenceState,
        status: RequestStatus,
        reason: FinishReason,
        journal: Journal,
        error: str | None = None,
    ) -> FinishedRequest:
        request = seq.request
        del self._seqs[request.request_id]
        journal.record(functools.partial(self._hold, seq, seq.status))
        seq.status = status
        self._released.append(request.request_id)
        outputs = None if seq.outputs is None else tuple(seq.outputs)
        return FinishedRequest(
            request_id=request.request_id,
            status=status,
            reason=reason,
            prompt_len=request.prompt_len,
            num_generated=seq.num_generated,
            output_token_ids=outputs,
            num_preemptions=seq.num_preemptions,
            error=error,
        )

    def _hold(self, seq: SequenceState, status: RequestStatus) -> None:
        """Undo a request's end: hold it again with its old status."""
        seq.status = status
        self._seqs[seq.request.request_id] = seq
