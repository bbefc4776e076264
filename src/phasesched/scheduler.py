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
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.chunk_run import ChunkRun, ChunkStep, chunk_limit, plan_chunk_steps, plan_steps_after
from phasesched.decode_run import DecodeRun, segment_bounds, steps_that_fit
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
from phasesched.known_selection import (
    RunningState,
    StepRoom,
    Victims,
    decode_first_selection,
    selection_after_decodes,
)
from phasesched.kv import Claim, HeldKV, KVView, PagedKVManager
from phasesched.plan import StepPlan, build_step_plan, token_positions
from phasesched.policies.builder import BATCH_BLIND_CHUNKERS, BatchBuilder, checked_chunk
from phasesched.policies.chunking import (
    BUILTIN_CHUNKERS,
    ChunkContext,
    FixedChunk,
    LongPrefillThreshold,
    NoChunking,
    PrefillCandidate,
)
from phasesched.policies.policy import SchedulingPolicy
from phasesched.policies.preemption import LatestArrival, PreemptionPolicy
from phasesched.policies.priority import EVERY_DECODE_PRIORITIES, DecodeFirst, EqualProgress, PrefillFirst
from phasesched.policies.queue_order import FCFS, CacheAwareOrder, rerank
from phasesched.prefix import ROOT_HASH, block_page_hashes, extend_page_hashes
from phasesched.request import FinishReason, Phase, Request, RequestStatus, decodes_next, phase_of
from phasesched.running import RunningArrays
from phasesched.selection import CheckedSelection, Selection, check_selection
from phasesched.sequence import SequenceState
from phasesched.validators import INT32_MAX, is_int, number, whole
from phasesched.view import SchedulerView
from phasesched.waiting import WaitingCandidate, WaitingQueue

__all__ = ["FinishedRequest", "Scheduler", "SchedulerConfig", "StepOutcome"]

Int32Array = NDArray[np.int32]
_NO_SLOTS: Int32Array = np.empty(0, dtype=np.int32)
_NO_SLOTS.flags.writeable = False
_NOTHING_ELSE = CheckedSelection(Selection.empty(), _NO_SLOTS, _NO_SLOTS, np.empty(0, dtype=np.int64))


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


_MIXED_CORE_MIN = 64
"""Running requests from which a mixed step builds a fresh decode core (:meth:`Scheduler._mixed_plan`).

Building one costs about as much as the policy's own plan for a few dozen decodes, and pays
only when later steps reuse it; below this the policy plans such a step in full (the same plan).
"""
_RESTARTABLE_KEPT = 4096
"""Request lengths whose restart a batch-blind chunk sizer's answer is kept for (``Scheduler._check_servable``)."""


_RESERVED_ROWS = 8192
"""Requests the token buffer and the KV tables are reserved for, at most (beyond, they grow as needed)."""
_RESERVED_BYTES = 2 << 30
"""Address space reserved for the token buffer, and for the KV tables, at most (see ``Scheduler._reserve_tables``)."""


def _frozen(array: Int32Array) -> Int32Array:
    array.flags.writeable = False
    return array


class _SteadyBatch:
    """What the steady all-decode step keeps from one step to the next (internal).

    While the running set is unchanged and every request decodes, each step schedules the same
    slices: request ids, slots, one token each, prompt lengths, and (until a page boundary is
    crossed) the same KV pages. Those arrays are built once, frozen and shared by the plans;
    a step computes only what moves (context lengths, last-page lengths, input ids), and less
    where the last step left it: last-page lengths repeat every ``page_size`` steps, and the steady
    update has already worked out the next step's context lengths (the known tokens it wrote) and
    input ids (the tokens it sampled), kept in ``fed_*`` while ``next_start`` is ``fed_start``.
    """

    __slots__ = (
        "_arrays",
        "_nameable",
        "_naming",
        "_split",
        "all_ids",
        "any_eos",
        "any_stop",
        "eos",
        "fed_ids",
        "fed_kv_len",
        "fed_start",
        "groups",
        "growth",
        "id_index",
        "kv_indices",
        "kv_indptr",
        "last_fixed",
        "last_page_lens",
        "max_start",
        "member",
        "next_start",
        "ones",
        "plan",
        "prompt_len",
        "qo_indptr",
        "ready",
        "request_ids",
        "running",
        "some_ids",
        "step",
        "to_length",
        "trues",
        "version",
    )

    def __init__(
        self, scheduler: Scheduler, start: Int32Array, known: Int32Array, running: Int32Array | None = None
    ) -> None:
        arrays, size = scheduler._arrays, scheduler._kv.page_size  # noqa: SLF001
        running = scheduler._running if running is None else running  # noqa: SLF001
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
        self.id_index = has_ids.nonzero()[0]
        self.next_start = _frozen(start.copy())
        self.max_start = int(start.max())
        # Every slice advances one token a step, so which of them start a fresh page in a step
        # depends only on its offset in its page: slices grouped by that offset take turns.
        # ``step`` counts the batch's steps; in step t, group ``-t % page_size`` starts pages.
        offset = start % size
        order = np.argsort(offset, kind="stable").astype(np.int32)
        ends = np.cumsum(np.bincount(offset, minlength=size)).tolist()
        self.groups: list[NDArray[np.int32]] = [order[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        self.growth: list[_GroupGrowth | None] = [None] * size  # worked out at a group's first turn
        self._arrays = arrays
        self._nameable = _nameable(scheduler, running)
        self._naming: list[_GroupNaming | None] = [None] * size  # worked out at a group's first turn
        self.step = 0
        # Steps until the first request reaches its length limit (its sampled token then finishes it).
        self.to_length = int((arrays.max_known[running] - known).min())
        self.kv_indptr: Int32Array | None = None
        self.kv_indices: Int32Array | None = None
        # In step t every slice is ``t`` tokens past its start, so its last-page length is the one it
        # had ``page_size`` steps before: step t's array is kept at ``t % page_size``.
        self.last_page_lens: list[Int32Array | None] = [None] * size
        self.fed_start: Int32Array | None = None
        self.fed_kv_len: Int32Array = _NO_SLOTS
        self.fed_ids: Int32Array = _NO_SLOTS
        self.plan: StepPlan | None = None
        self.version = -1
        # As the decode core of mixed steps (see Scheduler._mixed_plan): which slots it holds, and
        # whether its last plan was applied (so ``next_start`` is each decode's computed tokens).
        self.member: NDArray[np.bool_] = np.zeros(len(arrays.running), dtype=bool)
        self.member[running] = True
        self.ready = True
        self.last_fixed: _FixedArrays | None = None
        """Its last mixed plan's arrays that the decodes and the rest fix (see :meth:`fixed_arrays`)."""
        self._split: tuple[Int32Array, NDArray[np.bool_], Int32Array] | None = None
        """The last :meth:`split`: the running slots asked about, which of them it holds, the others."""

    def moving_arrays(self, last_token: Int32Array) -> tuple[Int32Array, Int32Array, Int32Array | None]:
        """The next step's context lengths, last-page lengths and input ids (``None`` unless all are known)."""
        start, size = self.next_start, len(self.last_page_lens)
        turn = self.step % size
        last_page_len = self.last_page_lens[turn]
        if last_page_len is None:
            last_page_len = start % size
            last_page_len += 1
            self.last_page_lens[turn] = _frozen(last_page_len)
        if self.fed_start is start:  # the steady update that set ``start`` worked these out
            return self.fed_kv_len, last_page_len, self.fed_ids if self.all_ids else None
        return _frozen(start + 1), last_page_len, _frozen(last_token[self.running]) if self.all_ids else None

    def members(self, slots: Int32Array) -> NDArray[np.bool_]:
        """Which of ``slots`` the batch holds."""
        if len(slots) and int(slots.max()) >= len(self.member):  # slots opened since it was built
            self.member = np.concatenate([self.member, np.zeros(int(slots.max()) + 1 - len(self.member), bool)])
        held: NDArray[np.bool_] = self.member[slots]
        return held

    def split(self, running: Int32Array) -> tuple[NDArray[np.bool_], Int32Array]:
        """Which of ``running`` the batch holds, and the others, in order (read-only: later steps share them).

        The scheduler replaces its running slots' array whenever they change (it never writes
        into one), and a batch holds the same slots for its whole life, so while mixed steps go
        on beside the same requests the answer is the last one's.
        """
        split = self._split
        if split is not None and split[0] is running:
            return split[1], split[2]
        is_decode = self.members(running)  # a copy (fancy indexing)
        is_decode.flags.writeable = False
        others = _frozen(running[~is_decode])
        self._split = running, is_decode, others
        return is_decode, others

    def fixed_arrays(self, slots: Int32Array, num_new: Int32Array, samples: NDArray[np.bool_]) -> _FixedArrays:
        """A mixed plan's arrays that its rest (``slots`` computing ``num_new``, ``samples``) fixes beside the decodes.

        While one prompt is chunked beside the decodes, step after step has the same rest: its
        arrays are then the last step's, shared. The key is everything they are made of (the
        rest's request ids and prompt lengths too), so no state object is kept alive by it.
        """
        arrays = self._arrays
        ids, prompt_len = tuple(arrays.ids[slots].tolist()), arrays.prompt_len[slots]
        key = (slots.tobytes(), num_new.tobytes(), samples.tobytes(), prompt_len.tobytes(), ids)
        fixed = self.last_fixed
        if fixed is not None and fixed.key == key:
            return fixed
        n = len(self.running)
        qo_indptr = np.empty(n + len(slots) + 1, dtype=np.int32)
        qo_indptr[: n + 1] = self.qo_indptr
        num_new.cumsum(out=qo_indptr[n + 1 :])
        qo_indptr[n + 1 :] += n
        fixed = self.last_fixed = _FixedArrays(
            key,
            _frozen(np.concatenate([self.running, slots])),
            _frozen(np.concatenate([self.ones, num_new])),
            _frozen(np.concatenate([self.prompt_len, prompt_len])),
            _frozen(np.concatenate([self.trues, samples])),  # type: ignore[arg-type]
            _frozen(qo_indptr),
            self.request_ids + ids,
        )
        return fixed

    def pages_for_step(self, kv: PagedKVManager) -> tuple[Int32Array, NDArray[np.int64], Int32Array | None]:
        """The slots that grow in the next step, the pages each takes, and which of the batch they are.

        The batch's first step grows whatever its tables lack (the third item is then ``None``);
        later steps grow the group whose slices start a fresh page, one page each.
        """
        if self.kv_indices is None:
            return self.running, kv.pages_to_grow(self.running, self.next_start + 1), None
        growth = self._growth(kv.page_size)
        return growth.slots, growth.ones, self.groups[-self.step % kv.page_size]

    def _growth(self, page_size: int) -> _GroupGrowth:
        """The growth of the group whose turn it is: the same arrays at each of its turns while the batch lasts."""
        turn = -self.step % page_size
        growth = self.growth[turn]
        if growth is None:
            starting, count = self.groups[turn], len(self.groups[turn])
            shift = np.zeros(len(self.running) + 1, dtype=np.int32)
            shift[starting + 1] = 1
            growth = self.growth[turn] = _GroupGrowth(
                slots=_frozen(self.running[starting]),
                ones=np.ones(count, dtype=np.int64),
                ends=starting + 1,
                offsets=np.arange(count, dtype=np.int32),
                shift=np.cumsum(shift, dtype=np.int32),
            )
        return growth

    def naming(self, turn: int) -> _GroupNaming | None:
        """How group ``turn`` names the pages it fills (``None``: it names none), worked out at its first turn.

        Mixed steps name their pages as they fill, so a batch that serves only as their core never asks.
        """
        if self._nameable is None:
            return None
        naming = self._naming[turn]
        if naming is None:
            group = self.groups[turn]
            named = group[self._nameable[group]]
            slots = _frozen(self.running[named])
            hashes = [seq.page_hashes for seq in self._arrays.seqs[slots].tolist()]
            naming = self._naming[turn] = _GroupNaming(named, slots, hashes)
        return naming

    def grow_tables(self, kv: PagedKVManager, starting: Int32Array | None, rest: Int32Array) -> Int32Array:
        """The step's ``kv_indices``: the batch's tables, once ``pages_for_step``'s pages are added, then ``rest``.

        Keeps ``kv_indptr`` and ``kv_indices`` (a read-only view of the result's head) up to date.
        """
        indptr, indices = self.kv_indptr, self.kv_indices
        if starting is None or indptr is None or indices is None:  # the first step: the tables as they stand
            indptr, head = kv.gather(self.running, kv.page_counts[self.running])
            out = np.concatenate([head, rest])
        elif len(starting):
            # Each appends one page: the new pages go after their tables' pages, the offsets shift.
            growth = self._growth(kv.page_size)
            size, count = len(indices), len(starting)
            at = indptr[growth.ends] + growth.offsets
            out = np.empty(size + count + len(rest), dtype=np.int32)
            kept = np.ones(size + count, dtype=bool)
            kept[at] = False
            out[: size + count][kept] = indices
            out[at] = kv.last_pages(growth.slots)
            out[size + count :] = rest
            indptr = indptr + growth.shift
        else:
            return indices if not len(rest) else _frozen(np.concatenate([indices, rest]))
        _frozen(out)
        self.kv_indptr, self.kv_indices = _frozen(indptr), out[: int(indptr[-1])]
        return out


class _FixedArrays(NamedTuple):
    """The arrays of a mixed plan that its decodes and rest fix (internal; see :meth:`_SteadyBatch.fixed_arrays`)."""

    key: tuple[bytes, bytes, bytes, bytes, tuple[str, ...]]
    """The rest's slots, token counts, samples, prompt lengths and request ids."""
    slots: Int32Array
    num_new: Int32Array
    prompt_len: Int32Array
    samples: NDArray[np.bool_]
    qo_indptr: Int32Array
    request_ids: tuple[str, ...]


class _GroupGrowth(NamedTuple):
    """How a steady group's tables grow at its turns: one page each (internal; see :class:`_SteadyBatch`)."""

    slots: Int32Array
    """The group's tables."""
    ones: NDArray[np.int64]
    ends: Int32Array
    """The ``kv_indptr`` entries where the group's tables end (their places in the batch, plus one)."""
    offsets: Int32Array
    """0, 1, ...: the ``k``-th new page lands ``k`` places further on, past the pages inserted before it."""
    shift: Int32Array
    """How far each ``kv_indptr`` entry moves: how many of the group's tables end at or before it."""


class _SteadyStep(NamedTuple):
    """What a steady step's checks looked up, for the caller to reuse (internal; see :meth:`Scheduler._steady_step`).

    Every running request decodes one token: no selection is built, as no caller needs one.
    """

    start: Int32Array
    """Tokens in each running request's cache, in running order."""
    known: Int32Array
    new_pages: NDArray[np.int64]
    """KV pages each of them needs for the step."""


class _GroupNaming(NamedTuple):
    """What naming one steady group's freshly filled pages needs (internal; see :class:`_SteadyBatch`)."""

    named: NDArray[np.int32]
    """The group's places in the batch whose generated pages are named (token ids known, no naming limit)."""
    slots: Int32Array
    hashes: list[list[int]]
    """Their sequences' page hash lists, extended in place."""


class _Unnamed:
    """A steady group's pages that filled in one step and wait to be named (see :meth:`Scheduler._name_pending`)."""

    __slots__ = ("_parents", "_worked_out", "full", "naming")

    def __init__(self, naming: _GroupNaming, full: Int32Array) -> None:
        self.naming = naming
        self.full = full
        """Each table's full pages then: the page that filled is the last."""
        self._parents: set[int] | None = None
        self._worked_out = False

    def parents(self) -> set[int] | None:
        """The hashes of the pages before those that filled (``None`` if some are not hashed); worked out once."""
        if not self._worked_out:
            lists = self.naming.hashes
            if all(len(hashes) == pages - 1 for hashes, pages in zip(lists, self.full.tolist(), strict=True)):
                self._parents = {hashes[-1] if hashes else ROOT_HASH for hashes in lists}
            self._worked_out = True
        return self._parents


def _nameable(scheduler: Scheduler, running: Int32Array) -> NDArray[np.bool_] | None:
    """Which of a steady batch's slots get their pages named as they fill: fixed while the batch lasts.

    ``None`` when no page will be named: the cache is off, or no sequence has token ids to hash
    (a simulation's length-only requests), so the steady steps skip naming altogether.
    """
    arrays, kv = scheduler._arrays, scheduler._kv  # noqa: SLF001
    if not kv.prefix_caching:
        return None
    nameable = arrays.has_ids[running]
    if not np.count_nonzero(nameable):
        return None
    nameable &= kv.names_every_page(running)
    return nameable


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
        new_token_ids: int32 ``[B]``, read-only: the token each slice added, -1 where it added none.
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
        self._kv_view = KVView(self._kv, sync=self._name_pending)
        self._unnamed: list[_Unnamed] = []
        """Steady groups' pages that filled but are not named yet, oldest first."""
        self._arrays = RunningArrays()
        self._reserve_tables()
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
        # For decode-first with a chunk sizer that never reads the batch and no preemption for
        # waiting requests, a step that preempts nobody is worked out from the state
        # (known_selection), and mixed steps (decodes beside prefill chunks or admissions) keep
        # their decodes' part from step to step: only the rest is planned.
        self._mixed_fast_path = (
            type(self.policy.priority) is DecodeFirst
            and type(self.policy.chunker) in BATCH_BLIND_CHUNKERS
            and type(self.policy.preemption) is PreemptionPolicy
            and not self.policy.preemption.preempt_for_waiting
        )
        self._core: _SteadyBatch | None = None  # the decodes of the mixed plans, while they decode (_mixed_plan)
        self._known: tuple[int, CheckedSelection | None, Int32Array] = (-1, None, _NO_SLOTS)
        """_known_selection()'s selection at a version, with the decodes it found."""
        # Waiting requests leave a steady step as it is once the sequence cap is reached, if the
        # policy never preempts for them and its chunk sizer is a built-in one: the priority then
        # asks the chunk sizer about one (a plugin's answer could raise) and finds no seat.
        self._seated_steady = not self.policy.preemption.preempt_for_waiting and type(self.policy.chunker) in {
            NoChunking,
            FixedChunk,
            LongPrefillThreshold,
        }
        # A batch-blind built-in sizer's answer about a request restarting from zero depends on
        # its length alone (_check_servable asks it at every arrival): kept per length.
        blind = type(self.policy.chunker) in BATCH_BLIND_CHUNKERS
        self._restartable: dict[int, bool] | None = {} if blind else None
        # ... also while requests wait, when the step is sure to admit none (_admits_nobody).
        self._may_block_admissions = (
            self._steady_fast_path
            and type(self.policy.chunker) in BUILTIN_CHUNKERS
            and type(self.policy.preemption) is PreemptionPolicy
            and not self.policy.preemption.preempt_for_waiting
            and not isinstance(self.policy.queue_order, CacheAwareOrder)
        )
        order = self.policy.queue_order  # checked once: a Protocol check is slow
        self._reorder: Callable[[Iterable[WaitingCandidate], int], Iterator[WaitingCandidate]] | None = (
            functools.partial(rerank, order=order) if isinstance(order, CacheAwareOrder) else None
        )
        self._holds: dict[str, tuple[int, HeldKV]] = {}  # P/D: finished requests' KV, held until released
        self._claims: dict[int, Claim] = {}  # the plan in flight's cached-prefix claims, by slot, for abandon()
        # Slots the last updated general plan left with a prefill under way: while one of them
        # still runs, no step is steady (a slot is only reused by an admission, which a plan
        # commits and its update or abandon settles).
        self._prefilling: Int32Array = _NO_SLOTS

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles leave the steady batch and the mixed steps' core behind: caches, rebuilt when next needed.

        Their arrays are handed to plan after plan, frozen so no executor can change them under
        the next step; a copied array is writeable again.
        """
        return {**self.__dict__, "_steady": None, "_core": None}

    def _reserve_tables(self) -> None:
        """Reserve the token buffer and the KV tables for a full batch of the longest requests.

        Only address space until written, capped at :data:`_RESERVED_BYTES` each: a step then
        never copies either to make room for a long prompt, unless held tables (P/D) outnumber
        the batch.
        """
        rows = min(self.policy.budget.max_num_seqs, _RESERVED_ROWS)
        columns = _RESERVED_BYTES // (4 * rows)
        self._arrays.tokens.reserve(rows, min(self.config.max_model_len, columns))
        self._kv.reserve(rows, min(self._kv.pages_for(self.config.max_model_len), columns))

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
        self._name_pending()
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
        self._name_pending()
        seq = self._seqs.get(request_id)
        if seq is None:
            msg = f"no request {request_id!r} to abort"
            raise UnknownRequestError(msg)
        self._version += 1
        if self._in_flight is not None and seq.slot >= 0 and np.any(self._in_flight.slots == seq.slot):
            self._arrays.abort_pending[seq.slot] = True
            self._core = None  # the plan's update retires it: the general update sees to that
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
        self._name_pending()
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
            # While mixed steps keep their decodes beside prefills, or beside waiting requests that
            # may be admitted, the steady path would not apply: the mixed path is tried first.
            core = self._core
            if steady_ok and core is not None and core.ready and core is not self._steady:
                prefilling = len(core.running) < len(self._running)
                steady_ok = not prefilling and (not len(self._waiting) or self._waiting_unseated())
            plan = self._steady_plan(journal) if steady_ok else None
            if plan is None and self._mixed_fast_path:
                plan = self._mixed_plan(now, journal)
            if plan is None:
                self._name_pending()
                checked = self._known_selection() if self._mixed_fast_path else None
                plan = self._commit(self._ask_policy(now) if checked is None else checked, journal)
        except BaseException:
            journal.rollback()
            self._steady = self._core = None  # they may have moved on with the rolled-back step
            raise
        if self._core is not None and self._core.plan is not plan:
            self._core = None  # its decodes moved on without it
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
        :meth:`_steady_step`'s step (``tests/test_steady_fast_path.py`` holds them together).
        """
        if len(self._waiting) and not (self._waiting_unseated() or self._may_block_admissions):
            return None
        steady = self._steady
        if steady is None or steady.version != self._version or steady.running is not self._running:
            self._name_pending()  # a new batch has new groups
            checked = self._steady_step(unseated_waiting=True)
            if checked is None:
                self._steady = None
                return None
            core = self._core
            if core is not None and core.ready and len(core.running) == len(self._running):
                # The mixed steps' decodes are every running request now: their batch goes on.
                core.running = self._running  # the same slots in the same order (every one is a member)
                steady = self._steady = core
            else:
                steady = self._steady = _SteadyBatch(self, checked.start, checked.known)
        kv, running, start = self._kv, steady.running, steady.next_start
        size = kv.page_size
        starting = steady.groups[-steady.step % size] if steady.kv_indices is not None else None
        if starting is None or len(starting):  # most steps start no page
            grown, new_pages, starting = steady.pages_for_step(kv)
            if (len(grown) if starting is not None else int(new_pages.sum())) > kv.num_free_pages:
                return None  # the policy would preempt: let it
            if starting is None:  # the batch's first step: whatever its tables lack
                self._extend(grown, new_pages, journal)
            else:  # a group's turn: one page each
                self._extend(grown, None, journal)
            steady.grow_tables(kv, starting, _NO_SLOTS)
        kv_len, last_page_len, input_ids = steady.moving_arrays(self._arrays.last_token)
        steady.step += 1
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
            kv_last_page_len=last_page_len,
            kv_len=kv_len,
            positions=start,
            input_ids=input_ids,
            page_size=size,
            preempted=tuple(self._carried_preempted),
            new_requests=(),
            released=tuple(self._released),
        )
        steady.plan, steady.ready = plan, False
        self._next_step += 1
        if self._released:
            self._save_scalars(journal)
            self._released = []
        self._carried_preempted = []
        return plan

    def _mixed_plan(self, now: float, journal: Journal) -> StepPlan | None:
        """The next step with every running decode and the policy's chunks and admissions, if they all fit.

        Decode-first schedules every running decode first when the token budget and the free
        pages hold them all, then asks its chunk sizer about the ongoing prefills and admits
        waiting requests (:meth:`DecodeFirst.fill_after_decodes`). The decodes' part of the
        plan is kept from step to step as the steady step keeps it (a :class:`_SteadyBatch`,
        the *core*, while the same requests decode), so only the rest is asked and built.
        ``None`` (nothing changed) when the decodes do not all fit or the rest would preempt:
        the policy then plans the step in full. Gives exactly the plan :meth:`_commit` would
        build for the policy's selection (``tests/test_mixed_fast_path.py`` holds them together).
        """
        self._name_pending()  # admissions claim cached pages: they must find the steady steps' pages named
        core = self._core if self._core is not None and self._core.ready else self._rebuilt_core()
        if core is None:
            return None
        running, arrays, kv = self._running, self._arrays, self._kv
        # Every running request decodes and nobody waiting can be seated (see _seated_steady,
        # which holds for this path's policies): decode-first then adds nothing after the decodes.
        alone = len(core.running) == len(running) and (not len(self._waiting) or self._waiting_unseated())
        is_decode, others = (core.trues, _NO_SLOTS) if len(core.running) == len(running) else core.split(running)
        if len(others) and self._decodes_among(others):  # the others were all prefills: one has completed
            core = self._rebuilt_core()  # and decodes now
            if core is None:
                return None
            is_decode, others = core.split(running)
            alone = len(core.running) == len(running) and (not len(self._waiting) or self._waiting_unseated())
        grown, new_pages, starting = core.pages_for_step(kv)
        growth = len(grown) if starting is not None else int(new_pages.sum())
        budget = self.policy.budget
        if len(core.running) > budget.max_num_batched_tokens or growth > kv.num_free_pages:
            return None  # the policy would take some of them, or preempt
        if alone:
            self._extend(grown, new_pages, journal)
            self._steady = None  # it may be the core: its update is not the steady one now
            return self._mixed_step(core, _NOTHING_ELSE, starting=starting, admitted=_NO_SLOTS, new_requests=[])
        lone = len(others) == 1 and not len(self._waiting) and self._reorder is None
        limit = self._chunk_limit if lone else None  # the sizer's answer is known: see _lone_chunk
        checked = None if limit is None else self._lone_chunk(len(core.running), others, growth, limit)
        if checked is None:
            rest = self._rest_after_decodes(now, core, is_decode, growth)
            if rest is None:
                return None
            checked = check_selection(
                rest, arrays=arrays, running=running, waiting=self._waiting, kv=kv, budget=budget, trusted=True
            )
        admitted, new_requests = self._extend_step(grown, new_pages, checked, journal)
        self._steady = None  # it may be the core: its update is not the steady one now
        return self._mixed_step(core, checked, starting=starting, admitted=admitted, new_requests=new_requests)

    def _rest_after_decodes(
        self, now: float, core: _SteadyBatch, is_decode: NDArray[np.bool_], growth: int
    ) -> Selection | None:
        """Decode-first's chunks and admissions beside the core's decodes (``None``: they would preempt).

        Worked out from the state (:func:`~phasesched.known_selection.selection_after_decodes`),
        or asked of decode-first with the decodes already in its builder when the queue order
        re-ranks the waiting requests.
        """
        priority, budget, kv, running = self.policy.priority, self.policy.budget, self._kv, self._running
        assert isinstance(priority, DecodeFirst)  # _mixed_fast_path's promise
        if self._reorder is None:
            room = StepRoom(
                budget.max_num_batched_tokens - len(core.running),
                budget.max_num_seqs - len(running),
                kv.num_free_pages - growth,
                kv.watermark_pages,
                kv.page_size,
                priority.max_declined,
            )
            return selection_after_decodes(
                self._prefills(running[~is_decode]), self._candidates(), self.policy.chunker, room
            )
        view = self._view(now)
        builder = BatchBuilder(view, self.policy.chunker, self.policy.preemption, is_decode=is_decode)
        builder.take_decodes(core.running, growth)
        priority.fill_after_decodes(view, builder)
        return builder.build_rest()

    def _decodes_among(self, slots: Int32Array) -> bool:
        """Whether any of running ``slots`` decodes next (:func:`~phasesched.request.decodes_next`'s rule)."""
        arrays = self._arrays
        if len(slots) == 1:  # one prefill beside the decodes: the rule on plain ints
            slot = int(slots[0])
            computed = int(arrays.computed[slot])
            left = int(arrays.known[slot]) - computed
            return phase_of(computed, left, int(arrays.prompt_len[slot])) is Phase.DECODE
        known, prompt_len = arrays.known[slots], arrays.prompt_len[slots]
        return bool(np.count_nonzero(decodes_next(arrays.computed[slots], known, prompt_len)))

    def _lone_chunk(self, num_decodes: int, prefill: Int32Array, growth: int, limit: int) -> CheckedSelection | None:
        """The rest of a mixed step when one prefill (``prefill``'s one slot) runs beside the decodes and nobody waits.

        What :meth:`_rest_after_decodes` and ``check_selection`` give then, for a chunk sizer
        whose answer is known (``limit`` is :func:`~phasesched.chunk_run.chunk_limit`'s: an
        ongoing prefill gets ``min(limit, tokens left, budget left)``), with nothing left to
        admit: without the room, the queue's candidates, the sizer's arguments and the checks'
        lookups. ``None`` when the chunk is empty or would not fit: they are asked then.
        """
        arrays, kv, slot = self._arrays, self._kv, int(prefill[0])
        computed, known = int(arrays.computed[slot]), int(arrays.known[slot])
        size = max(0, min(limit, known - computed, self.policy.budget.max_num_batched_tokens - num_decodes))
        pages = max(kv.pages_for(computed + size) - int(kv.page_counts[slot]), 0)
        if not size or pages > kv.num_free_pages - growth:
            return None
        return CheckedSelection(
            Selection.built(prefill, np.array([size], dtype=np.int32), (), ()),
            np.array([computed], dtype=np.int32),
            np.array([known], dtype=np.int32),
            np.array([pages], dtype=np.int64),
        )

    def _prefills(self, slots: Int32Array) -> list[tuple[int, Request, int, int, int]]:
        """Running ``slots`` with prefill work left, as :attr:`~phasesched.known_selection.RunningState.prefills`."""
        if not len(slots):
            return []
        arrays = self._arrays
        return list(
            zip(
                slots.tolist(),
                [seq.request for seq in arrays.seqs[slots].tolist()],
                arrays.computed[slots].tolist(),
                arrays.known[slots].tolist(),
                self._kv.page_counts[slots].tolist(),
                strict=True,
            )
        )

    def _candidates(self) -> Iterator[WaitingCandidate]:
        """The waiting requests in queue order, lazily, as a view without re-ranking gives them to policies."""
        kv = self._kv
        return (
            WaitingCandidate(seq.request, seq.num_tokens, seq.num_preemptions, seq.tokens_at_admission(kv))
            for seq in self._waiting.ordered()
        )

    def _rebuilt_core(self) -> _SteadyBatch | None:
        """A fresh core for the mixed path, kept as ``_core``; ``None`` if nobody decodes or too few run to pay."""
        self._core = self._decode_core() if len(self._running) >= _MIXED_CORE_MIN else None
        return self._core

    def _decode_core(self) -> _SteadyBatch | None:
        """A fresh core of the running decodes, in admission order; ``None`` if nobody decodes."""
        running, arrays = self._running, self._arrays
        if not len(running):
            return None
        start, known = arrays.computed[running], arrays.known[running]
        is_decode = decodes_next(start, known, arrays.prompt_len[running])
        if not np.count_nonzero(is_decode):
            return None
        decodes = _frozen(running[is_decode])
        return _SteadyBatch(self, start[is_decode], known[is_decode], decodes)

    def _extend_step(
        self, grown: Int32Array, new_pages: NDArray[np.int64], checked: CheckedSelection, journal: Journal
    ) -> tuple[Int32Array, list[Request]]:
        """Commit a mixed step's admissions and pages in :meth:`_commit`'s order (the same pages for the same tables).

        Returns:
            The admitted requests' slots and the requests.
        """
        if checked.selection.admitted:
            self._save_scalars(journal)
        self._drop_claims(journal)
        return self._admit_and_grow(
            np.concatenate([grown, checked.selection.running_slots]),
            np.concatenate([new_pages, checked.new_pages]),
            checked,
            journal,
        )

    def _admit_and_grow(
        self, slots: Int32Array, new_pages: NDArray[np.int64], checked: CheckedSelection, journal: Journal
    ) -> tuple[Int32Array, list[Request]]:
        """Admit the selection's requests, then grow table ``slots[i]`` by ``new_pages[i]`` and the admissions' tables.

        Admissions come first, so cached prefixes are claimed before growth may evict them; the
        growth is one call, the running tables' pages first, then the admissions'.

        Returns:
            The admitted requests' slots and the requests.
        """
        selection = checked.selection
        if not selection.admitted:
            self._extend(slots, new_pages, journal)
            return _NO_SLOTS, []
        admitted, new_requests = self._admit(selection.admitted, checked.admitted_cached, journal)
        tokens = np.asarray(selection.admitted_tokens, dtype=np.int32)
        admitted_pages = self._kv.pages_to_grow(admitted, self._arrays.computed[admitted] + tokens)
        self._extend(np.concatenate([slots, admitted]), np.concatenate([new_pages, admitted_pages]), journal)
        return admitted, new_requests

    def _mixed_step(
        self,
        core: _SteadyBatch,
        checked: CheckedSelection,
        *,
        starting: Int32Array | None,
        admitted: Int32Array,
        new_requests: list[Request],
    ) -> StepPlan:
        """The plan of a mixed step: the core's decodes (its kept arrays), then the rest's slices."""
        arrays, kv, selection = self._arrays, self._kv, checked.selection
        slots, start, known, num_new = selection.running_slots, checked.start, checked.known, selection.running_tokens
        if len(admitted):
            tokens = np.asarray(selection.admitted_tokens, dtype=np.int32)
            slots = np.concatenate([slots, admitted])
            start = np.concatenate([start, arrays.computed[admitted]])
            known = np.concatenate([known, arrays.known[admitted]])
            num_new = np.concatenate([num_new, tokens])
        size = kv.page_size
        indptr, indices = kv.gather(slots, kv.page_counts[slots])
        kv_indices = core.grow_tables(kv, starting, indices)
        assert core.kv_indptr is not None
        if len(slots):
            rest_len = start + num_new
            fixed = core.fixed_arrays(slots, num_new, rest_len == known)
            kv_len = np.concatenate([core.next_start + 1, rest_len])
            last_page_len = (kv_len - 1) % size
            last_page_len += 1
            positions, input_ids = self._rest_tokens(core, slots, start, num_new, known)
            start = np.concatenate([core.next_start, start])
            kv_indptr = np.concatenate([core.kv_indptr, indptr[1:] + core.kv_indptr[-1]])
            slots, num_new, prompt_len, samples = fixed.slots, fixed.num_new, fixed.prompt_len, fixed.samples
            qo_indptr, request_ids = fixed.qo_indptr, fixed.request_ids
        else:  # the decodes alone: the steady step's plan
            qo_indptr, request_ids = core.qo_indptr, core.request_ids
            kv_len, last_page_len, input_ids = core.moving_arrays(arrays.last_token)
            slots, start, num_new, prompt_len, samples, kv_indptr, positions = (
                core.running,
                core.next_start,
                core.ones,
                core.prompt_len,
                core.trues,
                core.kv_indptr,
                core.next_start,
            )
        plan = StepPlan(
            step_id=self._next_step,
            request_ids=request_ids,
            slots=slots,
            start=_frozen(start),
            num_new=num_new,
            prompt_len=prompt_len,
            samples=samples,
            qo_indptr=qo_indptr,
            kv_indptr=_frozen(kv_indptr),
            kv_indices=kv_indices,
            kv_last_page_len=_frozen(last_page_len),
            kv_len=_frozen(kv_len),
            positions=_frozen(positions),
            input_ids=None if input_ids is None else _frozen(input_ids),
            page_size=size,
            preempted=tuple(self._carried_preempted),
            new_requests=tuple(new_requests),
            released=tuple(self._released),
        )
        core.step += 1
        core.plan, core.ready = plan, False
        self._next_step += 1
        self._released = []  # nothing raises from here on: the step is committed
        self._carried_preempted = []
        return plan

    def _rest_tokens(
        self, core: _SteadyBatch, slots: Int32Array, start: Int32Array, num_new: Int32Array, known: Int32Array
    ) -> tuple[Int32Array, Int32Array | None]:
        """A mixed step's ``positions`` and ``input_ids``: the core's decodes, then slices ``slots``."""
        arrays, n = self._arrays, len(core.running)
        total = n + int(num_new.sum())
        positions = np.empty(total, dtype=np.int32)
        positions[:n] = core.next_start
        ids = None
        if core.all_ids and np.count_nonzero(arrays.has_ids[slots]) == len(slots):
            ids = np.empty(total, dtype=np.int32)
            np.take(arrays.last_token, core.running, out=ids[:n])
        if len(slots) > 8:  # many slices: vectorized
            positions[n:] = token_positions(start, num_new)
            if ids is not None:
                rest_ids = self._input_ids(slots, start, num_new, known)
                assert rest_ids is not None
                ids[n:] = rest_ids
            return positions, ids
        rows, at = arrays.tokens.ids, n
        for slot, begin, length in zip(slots.tolist(), start.tolist(), num_new.tolist(), strict=True):
            np.add(np.arange(length, dtype=np.int32), begin, out=positions[at : at + length])
            if ids is not None:
                ids[at : at + length] = rows[slot, begin : begin + length]
            at += length
        return positions, ids

    def _view(self, now: float) -> SchedulerView:
        return SchedulerView(
            now=now,
            budget=self.policy.budget,
            kv=self._kv,
            arrays=self._arrays,
            running=self._running,
            waiting=self._waiting,
            max_model_len=self.config.max_model_len,
            reorder=self._reorder,
        )

    def _save_scalars(self, journal: Journal) -> None:
        """Record how to restore the running order and pending releases (before a step retires or admits)."""
        saved = (self._running, list(self._released))

        def restore() -> None:
            self._running, self._released = saved

        journal.record(restore)

    def _known_selection(self) -> CheckedSelection | None:
        """Decode-first's selection for this step worked out from the state (:mod:`phasesched.known_selection`).

        ``None`` when the decodes exceed the token budget, when the step would preempt with
        victims other than the latest arrivals (or for a prefill's chunk), or when a queue order
        re-ranks the waiting requests: the policy is asked then.
        """
        if self._reorder is not None:
            return None
        version, known_selection, _ = self._known
        if version == self._version:  # chunk_run() worked it out for an admitting run, and took none
            return known_selection
        running, arrays, kv = self._running, self._arrays, self._kv
        computed, known = arrays.computed[running], arrays.known[running]
        is_decode = decodes_next(computed, known, arrays.prompt_len[running])
        decodes = running[is_decode]
        prefills = self._prefills(running[~is_decode]) if len(decodes) < len(running) else []
        decode_growth = kv.pages_to_grow(decodes, computed[is_decode] + 1) if len(decodes) else None
        growth = int(decode_growth.sum()) if decode_growth is not None else 0
        free, victims = kv.num_free_pages, None
        if decode_growth is not None and growth > free and type(self.policy.preemption.victims) is LatestArrival:
            ranked = running[LatestArrival.rank(arrays.arrival[running])]  # the decodes preempt
            victims = Victims(decode_growth, ranked, kv.freed_by_freeing)
        budget, priority = self.policy.budget, self.policy.priority
        assert isinstance(priority, DecodeFirst)  # _mixed_fast_path's promise
        room = StepRoom(
            budget.max_num_batched_tokens,
            budget.max_num_seqs - len(running),
            free,
            kv.watermark_pages,
            kv.page_size,
            priority.max_declined,
        )
        selection = decode_first_selection(
            RunningState(decodes, growth, prefills, victims),
            self._candidates(),
            self.policy.chunker,
            room,
        )
        checked = None
        if selection is not None:
            checked = check_selection(
                selection, arrays=arrays, running=running, waiting=self._waiting, kv=kv, budget=budget, trusted=True
            )
        self._known = (self._version, checked, decodes)
        return checked

    def _ask_policy(self, now: float) -> CheckedSelection:
        """The policy's selection for this step, checked before anything changes."""
        view = self._view(now)
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
        self._name_pending()  # mixed and general updates name pages as they fill
        core = self._core
        if core is not None and core.plan is plan:
            outcome = self._mixed_update(core, plan, result)
            if outcome is not None:
                return outcome
        journal = Journal()
        try:
            finished = self._apply(plan, result, journal)
        except BaseException:
            journal.rollback()
            raise
        self._prefilling = self._prefills_left(plan.slots, plan.kv_len, plan.samples)
        core = self._core
        if core is not None and core.plan is plan:  # its decodes each computed one token; none finished
            core.next_start = plan.kv_len[: len(core.running)]
            core.max_start += 1
            core.to_length -= 1
            core.ready = True
        self._in_flight = None
        self._version += 1
        new_tokens = _frozen(np.where(plan.samples, result.token_ids, -1).astype(np.int32))
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
        # The last tokens before this step, for the undo: the plan's input ids, which were gathered
        # from them (nothing changed them since: the batch's version is the scheduler's).
        last_token = plan.input_ids if plan.input_ids is not None else arrays.last_token[slots]
        known = kv_len + 1  # also the next step's context lengths
        journal: Journal | None = None
        try:
            arrays.computed[slots] = kv_len
            arrays.known[slots] = known
            arrays.last_token[slots] = tokens
            if steady.all_ids:
                arrays.tokens.write(slots, kv_len, tokens, max_position=steady.max_start + 1)
            elif steady.some_ids:
                index = steady.id_index
                arrays.tokens.write(slots[index], kv_len[index], tokens[index])
            naming = steady.naming(-steady.step % self._kv.page_size)
            if naming is not None:  # the group that starts a page next step filled its last one now
                journal = Journal()
                self._defer_naming(naming, kv_len, journal)
        except BaseException:
            if journal is not None:
                journal.rollback()
            arrays.computed[slots], arrays.known[slots], arrays.last_token[slots] = plan.start, kv_len, last_token
            raise
        steady.next_start = steady.fed_start = kv_len
        steady.fed_kv_len, steady.fed_ids = _frozen(known), tokens  # a result's token ids are read-only
        steady.max_start += 1
        steady.to_length -= 1
        steady.ready = True
        self._in_flight = None
        self._version += 1
        steady.version = self._version
        return StepOutcome(
            step_id=plan.step_id,
            request_ids=plan.request_ids,
            new_token_ids=tokens,  # read-only, like the plan's arrays
            finished=(),
            duration_s=result.duration_s,
        )

    def _mixed_update(self, core: _SteadyBatch, plan: StepPlan, result: StepResult) -> StepOutcome | None:
        """Apply a mixed plan's result: its decodes as the steady update does, the rest as :meth:`_apply` does.

        ``None`` (nothing changed) when one of the decodes might finish: the general update then
        applies the whole plan.
        """
        n, tokens = len(core.running), result.token_ids
        if core.to_length <= 1 or result.finished is not None or core.any_stop:
            return None
        if core.any_eos and np.count_nonzero(tokens[:n] == core.eos):
            return None
        arrays, slots, kv_len, samples = self._arrays, plan.slots, plan.kv_len, plan.samples
        decodes, rest, rest_len = core.running, slots[n:], kv_len[n:]
        last_token = arrays.last_token[slots]  # a copy, for the undo
        journal = Journal()

        def undo() -> None:  # as _apply's
            arrays.computed[slots], arrays.last_token[slots] = plan.start, last_token
            arrays.known[slots[samples]] = kv_len[samples]

        journal.record(undo)
        try:
            arrays.computed[slots] = kv_len
            decoded = kv_len[:n]
            arrays.known[decodes] = decoded + 1
            arrays.last_token[decodes] = tokens[:n]
            if core.all_ids:
                arrays.tokens.write(decodes, decoded, tokens[:n], max_position=core.max_start + 1)
            elif core.some_ids:
                index = core.id_index
                arrays.tokens.write(decodes[index], decoded[index], tokens[:n][index])
            done, reasons = None, list[FinishReason]()
            if np.count_nonzero(samples[n:]) or np.count_nonzero(arrays.abort_pending[rest]):
                done, reasons = self._record_tokens(rest, samples[n:], tokens[n:], None)
            if self._kv.prefix_caching:
                filled = core.groups[-core.step % self._kv.page_size]  # their last pages filled in this step
                self._register_pages(
                    np.concatenate([decodes[filled], rest]), np.concatenate([decoded[filled], rest_len]), journal
                )
            finished: tuple[FinishedRequest, ...] = ()
            if reasons:
                assert done is not None
                self._save_scalars(journal)
                finished = self._finish(rest[done], reasons, journal)
        except BaseException:
            journal.rollback()
            raise
        self._prefilling = self._prefills_left(rest, rest_len, samples[n:]) if len(rest) else _NO_SLOTS
        core.next_start = decoded
        core.max_start += 1
        core.to_length -= 1
        core.ready = True
        self._in_flight = None
        self._version += 1
        new_tokens = (
            _frozen(np.concatenate([tokens[:n], np.where(samples[n:], tokens[n:], -1)]).astype(np.int32))
            if len(rest)
            else tokens  # read-only, like the plan's arrays
        )
        return StepOutcome(
            step_id=plan.step_id,
            request_ids=plan.request_ids,
            new_token_ids=new_tokens,
            finished=finished,
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
        done, reasons = self._record_tokens(slots, plan.samples, result.token_ids, result.finished)
        if self._kv.prefix_caching:
            self._register_pages(slots, plan.kv_len, journal)
        if not reasons:
            return ()
        self._save_scalars(journal)
        return self._finish(slots[done], reasons, journal)

    def _prefills_left(self, slots: Int32Array, kv_len: Int32Array, samples: NDArray[np.bool_]) -> Int32Array:
        """Slots of a plan's unsampled slices whose prefill is still under way once it is applied."""
        arrays = self._arrays
        if len(slots) <= 8:  # a few slices (a mixed step's rest): one by one
            known, prompt_len = arrays.known, arrays.prompt_len
            few = [
                slot
                for slot, computed, sampled in zip(slots.tolist(), kv_len.tolist(), samples.tolist(), strict=True)
                if not sampled and (known[slot] - computed != 1 or computed < prompt_len[slot])  # not decodes_next
            ]
            return np.array(few, dtype=np.int32) if few else _NO_SLOTS
        partial = (~samples).nonzero()[0]
        if not len(partial):
            return _NO_SLOTS
        slots, computed = slots[partial], kv_len[partial]
        # More than one token left to feed, or the prompt not yet computed.
        under_way = ~decodes_next(computed, arrays.known[slots], arrays.prompt_len[slots])
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
        self._name_pending()
        if plan is not self._in_flight or plan is None:
            msg = f"plan {getattr(plan, 'step_id', plan)} is not the plan in flight"
            raise InvalidPlanError(msg)
        self._in_flight = None
        self._version += 1
        self._core = None  # its decodes did not compute the plan's tokens
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
    def decode_run(self, max_steps: int, *, past_finishes: bool = False) -> DecodeRun | None:
        """The next steps, if they are certain to be identical pure-decode steps (the simulation fast path).

        A simulator uses this to advance many steps in one vectorized computation. It applies
        when the next step is steady (no plan in flight, nothing waiting that could be admitted,
        every running request decoding one token within the budget and KV, under one of the
        built-in phase priorities
        of :data:`~phasesched.policies.priority.EVERY_DECODE_PRIORITIES`) and no running
        request's tokens matter (no token ids, EOS or stop tokens: a simulator makes them up);
        then each step until the first finish schedules exactly the same requests, one token each.

        With ``past_finishes`` and nothing waiting, the run goes on past finishes: each later
        step schedules the requests not yet finished, one token each, as those priorities do when
        nobody waits to take a finished request's place. The caller must then add no request
        while it takes the run.

        Returns:
            The run, capped at ``max_steps``, or ``None`` when it does not apply.

        Raises:
            InvalidArgumentError: ``max_steps`` is not an int.
        """
        self._name_pending()
        if not is_int(max_steps):
            msg = f"max_steps must be an int, got {max_steps!r}"
            raise InvalidArgumentError(msg)
        if max_steps < 1 or self._arrays.num_with_tokens or not self._steady_fast_path or self._carried_preempted:
            return None  # (an abandoned plan's preemptions are reported by the next plan)
        step = self._steady_step()
        if step is None:
            self._unsteady_at = self._version
            return None
        arrays, running, kv = self._arrays, self._running, self._kv
        finish_at = (arrays.max_known[running] - step.known).astype(np.int32)
        waiting, first = bool(len(self._waiting)), int(finish_at.min())
        past = past_finishes and not waiting and int(finish_at.max()) > first and max_steps > first
        steps = min(max_steps, int(finish_at.max()) if past else first)  # up to the first finish, or past them
        held = int(kv.page_counts[running].sum())
        steps = steps_that_fit(
            step.start, held, kv.num_free_pages, kv.page_size, steps, finish_at=finish_at if past else None
        )
        ids = tuple(arrays.ids[running].tolist())
        later = waiting and self._head_blocks(int(step.new_pages.sum()))
        return DecodeRun(
            ids,
            running.copy(),
            step.start + 1,
            steps,
            self._version,
            later,
            finish_at=finish_at,
            passes_finishes=steps > first,
        )

    def advance(self, run: DecodeRun, num_steps: int) -> tuple[FinishedRequest, ...]:
        """Take ``num_steps`` of ``run``'s steps at once: each request computes and samples a token per step it is in.

        Returns:
            The requests that finished in the steps, in the order stepping finishes them.

        Raises:
            InvalidPlanError: The run is stale (the scheduler changed since it was made) or
                ``num_steps`` is outside ``[1, run.max_steps]``; nothing changed.
        """
        stale = run._version != self._version  # noqa: SLF001 -- the run's own token
        return self._fast_forward(
            "DecodeRun", "decode_run", stale, run.max_steps, num_steps, functools.partial(self._advance, run)
        )

    def _advance(self, run: DecodeRun, num_steps: int, journal: Journal) -> tuple[FinishedRequest, ...]:
        """The run's segments in turn: each one's tokens and pages, then the finishes that end it.

        When the steps need no page that an earlier finish frees (the free pool covers them, and
        nothing cached is evicted), their order is not seen: every request's tokens and pages
        are then taken at once, and every finish at once, the later ones freed first, so the
        cache parks their pages in the order stepping would.
        """
        if not (run.passes_finishes and num_steps > int(run.finish_at.min())):  # one segment
            done = self._advance_segment(run.slots, num_steps, journal)
            if not len(done):
                return ()
            return self._finish(done, [FinishReason.LENGTH] * len(done), journal)
        at_once = self._advance_at_once(run, num_steps, journal)
        if at_once is not None:
            return at_once
        finished: tuple[FinishedRequest, ...] = ()
        slots, finish_at, taken = run.slots, run.finish_at, 0
        for bound in segment_bounds(finish_at, num_steps):
            self._released = []  # an earlier segment's finishes: released by the plan of the step after them
            done = self._advance_segment(slots, bound - taken, journal)
            if len(done):
                finished += self._finish(done, [FinishReason.LENGTH] * len(done), journal)
                left = finish_at > bound
                slots, finish_at = slots[left], finish_at[left]
            taken = bound
        return finished

    def _advance_at_once(self, run: DecodeRun, num_steps: int, journal: Journal) -> tuple[FinishedRequest, ...] | None:
        """The first ``num_steps`` of a run passing finishes in one go, if no step needs a page a finish frees."""
        kv, slots = self._kv, run.slots
        steps = run.steps_of(num_steps)
        growth = kv.pages_to_grow(slots, self._arrays.computed[slots] + steps)
        if int(growth.sum()) > kv.num_free_pages - kv.num_cached_pages:
            return None  # stepping would reuse a finished request's pages, or evict cached ones, in its order
        self._decode_tokens(slots, steps, growth, journal)
        ending = (run.finish_at <= num_steps).nonzero()[0]
        in_order = ending[run.finish_at[ending].argsort(kind="stable")]  # as stepping finishes them
        latest_first = ending[(-run.finish_at[ending]).argsort(kind="stable")]  # as their pages must be freed
        records = self._finish(slots[latest_first], [FinishReason.LENGTH] * len(ending), journal)
        by_index = dict(zip(latest_first.tolist(), records, strict=True))
        finished = tuple(by_index[i] for i in in_order.tolist())
        last = run.finish_at[in_order] == num_steps  # only the last step's finishes are still to be released
        self._released = [record.request_id for record, pending in zip(finished, last.tolist(), strict=True) if pending]
        return finished

    def _advance_segment(self, slots: Int32Array, num_steps: int, journal: Journal) -> Int32Array:
        """``num_steps`` identical decode steps of ``slots``; returns those that reached their last token."""
        arrays = self._arrays
        growth = self._kv.pages_to_grow(slots, arrays.computed[slots] + num_steps)
        self._decode_tokens(slots, num_steps, growth, journal)
        done: Int32Array = slots[arrays.known[slots] >= arrays.max_known[slots]]
        return done

    def _decode_tokens(
        self, slots: Int32Array, steps: int | Int32Array, growth: NDArray[np.int64], journal: Journal
    ) -> None:
        """``slots`` each compute and sample ``steps`` tokens (one per decode step), adding ``growth`` pages."""
        arrays = self._arrays
        self._extend(slots, growth, journal)
        computed, known = arrays.computed[slots] + steps, arrays.known[slots] + steps

        def undo() -> None:
            arrays.computed[slots], arrays.known[slots] = computed - steps, known - steps

        journal.record(undo)
        arrays.computed[slots], arrays.known[slots] = computed, known

    def chunk_run(self, max_steps: int) -> ChunkRun | None:
        """The next steps, if they are certain to be decode-first steps with prefill chunks (a simulation fast path).

        It applies when no plan is in flight, at least one running request is part-way through
        its prefill (or the first step admits one, below), no running request's tokens matter
        (as for :meth:`decode_run`), the phase priority is exactly
        :class:`~phasesched.policies.priority.DecodeFirst` and the chunk sizer exactly
        :class:`~phasesched.policies.chunking.FixedChunk` or
        :class:`~phasesched.policies.chunking.LongPrefillThreshold`. Each step then schedules every
        decode (they must leave budget for a chunk), then each ongoing prefill in admission order
        its chunk of the budget left, as the policy would; the run ends at the first step that
        completes a prefill, finishes a decode or leaves a recompute one token short (that token
        is decoded among the decodes), and before a step whose pages would not fit.
        Requests may wait if the policy never preempts for them and its queue order does not
        re-rank them: the run then stops before a step that leaves budget over (which the policy
        would offer them), and as every step spends the budget, requests that arrive meanwhile
        change none of them (``ignores_later_arrivals``).

        Where decode-first's step is worked out from the state (exactly
        :class:`~phasesched.policies.preemption.PreemptionPolicy`, never preempting for waiting
        requests) and admits waiting requests without preempting anyone, the run begins with that
        step (``admitted``), then goes on as above, with the admitted prompts as ongoing
        prefills; it may begin with no prefill under way. Only requests that start from nothing
        are admitted so (nothing transferred or cached, and no tokens that matter). Take
        ``admitted`` as a plan's ``new_requests``: a decode worker admitting a transferred
        prompt lets go of the prefill worker's copy then.

        Returns:
            The run, capped at ``max_steps``, or ``None`` when it does not apply.

        Raises:
            InvalidArgumentError: ``max_steps`` is not an int.
        """
        self._name_pending()
        if not is_int(max_steps):
            msg = f"max_steps must be an int, got {max_steps!r}"
            raise InvalidArgumentError(msg)
        limit, arrays = self._chunk_limit, self._arrays
        # Requests may wait if the steps leave them no token: the policy's admit() then answers
        # NO_TOKENS before anything else, unless they may preempt or a queue order re-ranks them.
        waiting = bool(len(self._waiting))
        if (
            limit is None
            or max_steps < 1
            or self._in_flight is not None
            or self._carried_preempted
            or arrays.num_with_tokens
            or (waiting and (self.policy.preemption.preempt_for_waiting or self._reorder is not None))
        ):
            return None
        # A prefill under way was left so by the last step (update() and advance_chunks() note
        # it); one the last plan gave no tokens is missed, which only costs a step by the policy.
        run = self._chunk_steps(limit, max_steps, waiting=waiting) if len(self._prefilling) else None
        if run is None and waiting and self._mixed_fast_path:
            return self._admitting_run(limit, max_steps)
        return run

    def _chunk_steps(self, limit: int, max_steps: int, *, waiting: bool) -> ChunkRun | None:
        """The chunk run of the running requests alone (nobody admitted), if it applies (see :meth:`chunk_run`)."""
        running, arrays = self._running, self._arrays
        if not len(running) or not np.count_nonzero(arrays.running[self._prefilling]):
            return None
        computed, known = arrays.computed[running], arrays.known[running]
        decoding = decodes_next(computed, known, arrays.prompt_len[running])
        if np.count_nonzero(decoding) == len(running):
            return None
        decodes = running[decoding]
        tokens_left = self.policy.budget.max_num_batched_tokens - len(decodes)
        if tokens_left < 1:
            return None
        if len(decodes):  # up to the first decode's finish
            max_steps = min(max_steps, int((arrays.max_known[decodes] - known[decoding]).min()))
        steps, growth = plan_chunk_steps(
            decodes,
            computed[decoding],
            running[~decoding],
            computed[~decoding],
            known[~decoding],
            arrays.prompt_len[running[~decoding]],
            tokens_left=tokens_left,
            chunk_limit=limit,
            page_size=self._kv.page_size,
            free_pages=self._run_free_pages(),
            max_steps=max_steps,
            spend_budget=waiting,
        )
        if not steps:
            return None
        growth_array = np.asarray(growth, dtype=np.int64)
        return ChunkRun(tuple(steps), growth_array, len(decodes), self._version, ignores_later_arrivals=waiting)

    def _admitting_run(self, limit: int, max_steps: int) -> ChunkRun | None:
        """A chunk run whose first step is decode-first's admitting step, worked out from the state.

        Only requests that start from nothing are admitted so, whose tokens do not matter (as
        for the running requests): nothing precomputed (transferred KV) or cached to claim, whose
        pages the run's page count would have to follow. A preempted request recomputing its
        generated tokens is admitted like a prompt of all its known tokens; the run ends at the
        step that leaves it one token short (it decodes that token among the decodes).
        """
        checked = self._known_selection()
        if checked is None or not checked.selection.admitted or any(checked.admitted_cached):
            return None
        selection, running, arrays, kv = checked.selection, self._running, self._arrays, self._kv
        seqs = [self._seqs[request_id] for request_id in selection.admitted]
        if len(selection.running_slots) < len(running) or any(
            seq.precomputed or seq.request.tokens_matter for seq in seqs
        ):
            return None  # (an admission leaves every running request its slice: decodes, then prefills)
        decodes = self._known[2]  # found with the selection
        num_decodes = len(decodes)
        if num_decodes:  # up to the first decode's finish
            max_steps = min(max_steps, int((arrays.max_known[decodes] - arrays.known[decodes]).min()))
        tokens = np.asarray(selection.admitted_tokens, dtype=np.int32)
        kv_len = np.concatenate([checked.start + selection.running_tokens, tokens])  # admissions start empty
        admitted_known = np.array([seq.num_tokens for seq in seqs], dtype=np.int32)  # a recompute's include its outputs
        step_known = np.concatenate([checked.known, admitted_known])
        admitted_prompt = np.array([seq.request.prompt_len for seq in seqs], dtype=np.int32)
        first = ChunkStep(
            slots=np.concatenate([selection.running_slots, kv.next_slots(len(seqs))]),
            num_new=np.concatenate([selection.running_tokens, tokens]),
            kv_len=kv_len,
            samples=kv_len == step_known,
        )
        first_growth = int(checked.new_pages.sum()) + int((-(-tokens // kv.page_size)).sum())
        waiting = len(self._waiting) > len(seqs)
        steps, growth = plan_steps_after(
            first,
            first_growth,
            step_known,
            np.concatenate([arrays.prompt_len[selection.running_slots], admitted_prompt]),
            num_decodes=num_decodes,
            tokens_left=self.policy.budget.max_num_batched_tokens - num_decodes,
            chunk_limit=limit,
            page_size=kv.page_size,
            free_pages=self._run_free_pages(),  # (the first step fits: decode-first chose it from the state now)
            max_steps=max_steps,
            spend_budget=waiting,
        )
        growth_array = np.asarray(growth, dtype=np.int64)
        return ChunkRun(
            tuple(steps),
            growth_array,
            num_decodes,
            self._version,
            ignores_later_arrivals=waiting,
            admitted=selection.admitted,
        )

    def _run_free_pages(self) -> int:
        """Free pages a run's steps may take."""
        kv = self._kv
        if self._holds and kv.prefix_caching:
            # Held KV may be released while the run lasts (P/D), parking cached pages that stepping
            # could evict for a later step's growth: take only steps that evict nothing.
            return kv.num_free_pages - kv.num_cached_pages
        return kv.num_free_pages

    def advance_chunks(self, run: ChunkRun, num_steps: int) -> tuple[FinishedRequest, ...]:
        """Take the first ``num_steps`` of ``run``'s steps at once, as ``schedule``/``update`` would one by one.

        Returns:
            The requests that finished in the last of the steps.

        Raises:
            InvalidPlanError: The run is stale (the scheduler changed since it was made) or
                ``num_steps`` is outside ``[1, run.max_steps]``; nothing changed.
        """
        stale = run._version != self._version  # noqa: SLF001 -- the run's own token
        return self._fast_forward(
            "ChunkRun", "chunk_run", stale, run.max_steps, num_steps, functools.partial(self._advance_chunks, run)
        )

    def _fast_forward(  # noqa: PLR0913, PLR0917 -- the run's names for the errors, its checks, and what applies it
        self,
        kind: str,
        maker: str,
        stale: bool,
        max_steps: int,
        num_steps: int,
        apply: Callable[[int, Journal], tuple[FinishedRequest, ...]],
    ) -> tuple[FinishedRequest, ...]:
        """Check a fast-forward run, then apply ``num_steps`` of it atomically (``advance``, ``advance_chunks``)."""
        self._name_pending()
        if stale:
            msg = f"this {kind} is stale: the scheduler changed after {maker}()"
            raise InvalidPlanError(msg)
        if not is_int(num_steps) or not 1 <= num_steps <= max_steps:
            msg = f"num_steps must be in [1, {max_steps}], got {num_steps}"
            raise InvalidPlanError(msg)
        self._core = None  # its decodes move on without plans
        journal = Journal()
        try:
            # The steps' plans would have reported the releases pending, and each step's finishes
            # are released by the plan after it: only the last step's stay pending.
            self._save_scalars(journal)
            self._released = []
            finished = apply(int(num_steps), journal)
        except BaseException:
            journal.rollback()
            raise
        self._next_step += num_steps
        self._version += 1
        return finished

    def _advance_chunks(self, run: ChunkRun, num_steps: int, journal: Journal) -> tuple[FinishedRequest, ...]:
        """Each step's commit and update, as ``_commit`` and ``_apply`` make them (pages, then tokens, then names)."""
        if run.admitted:
            self._admit_first(run, journal)
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
        under_way = ~decodes_next(computed, arrays.known[touched], arrays.prompt_len[touched])
        self._prefilling = touched[under_way].astype(np.int32)
        done = last.slots[last.samples & (arrays.known[last.slots] >= arrays.max_known[last.slots])]
        if not len(done):
            return ()
        return self._finish(done, [FinishReason.LENGTH] * len(done), journal)

    def _admit_first(self, run: ChunkRun, journal: Journal) -> None:
        """The admissions of a run's first step, as its commit makes them (into the slots the run named)."""
        admitted, _ = self._admit(run.admitted, (0,) * len(run.admitted), journal)
        self._drop_claims(journal)  # the last plan's and these: no plan is in flight to abandon them
        named = run.steps[0].slots[len(run.steps[0].slots) - len(admitted) :]
        assert admitted.tolist() == named.tolist(), "the run named other slots than its admissions took"

    def _drop_claims(self, journal: Journal) -> None:
        """Forget the last plan's cached-prefix claims: it was updated or abandoned (only ``abandon`` reads them)."""
        if self._claims:
            claims = self._claims
            self._claims = {}
            journal.record(functools.partial(setattr, self, "_claims", claims))

    def _waiting_unseated(self) -> bool:
        """Whether no waiting request can be seated in this step (see ``_seated_steady``)."""
        return self._seated_steady and len(self._running) >= self.policy.budget.max_num_seqs

    def _steady_step(self, *, unseated_waiting: bool = False) -> _SteadyStep | None:
        """The next step, when it is certain to be every running request decoding one token.

        That holds when no plan is in flight, nothing waits or nobody waiting can be admitted
        (:meth:`_admits_nobody`), every running request decodes (one generated token left to
        feed), the budget holds them all, KV covers the step, and the phase priority is a
        built-in one known to schedule every decode then (the caller checks
        :data:`~phasesched.policies.priority.EVERY_DECODE_PRIORITIES`). Then the policy's answer
        is known without asking it (every running request, one token each, in running order),
        and as it comes from the scheduler's own state there is nothing to check. With
        ``unseated_waiting``, requests may wait while no seat is free for them, the policy never
        preempts for them and the chunk sizer is a built-in one: the built-in priorities then
        find no seat and schedule every decode too.
        """
        running = self._running
        if self._in_flight is not None or not len(running):
            return None
        arrays, prefilling = self._arrays, self._prefilling
        # The last plan's prefill still under way is the prefill test below, on its slots alone
        # (first: it is cheaper than asking whether anybody waiting can be admitted).
        if len(running) > self.policy.budget.max_num_batched_tokens or (
            len(prefilling) and np.count_nonzero(arrays.running[prefilling])
        ):
            return None
        unseated = unseated_waiting and self._waiting_unseated()
        # Waiting requests the policy may admit; or certain to be admitted even if every decode
        # takes a page (the most a decode step takes: more room only admits more), said before
        # the running requests' arrays are read.
        if (
            len(self._waiting)
            and not unseated
            and (not self._may_block_admissions or not self._admits_nobody(len(running)))
        ):
            return None
        start, known = arrays.computed[running], arrays.known[running]
        if not decodes_next(start, known, arrays.prompt_len[running]).all():
            return None  # a prefill is under way, if only a prompt's last token
        new_pages = self._kv.pages_to_grow(running, start + 1)
        growth = int(new_pages.sum())
        blocked = not len(self._waiting) or unseated or self._admits_nobody(growth)
        if growth > self._kv.num_free_pages or not blocked:
            return None  # the policy would preempt, or might admit: let it
        return _SteadyStep(start, known, new_pages)

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
        groups = [id(pending.naming) for pending in self._unnamed]
        assert len(set(groups)) == len(groups) <= self._kv.page_size, "pages left unnamed past a turn of the groups"
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
        self._name_pending()
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
        self._name_pending()
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
        known = self._restartable
        startable = None if known is None else known.get(most_cached)
        if startable is None:
            restart = PrefillCandidate(request, 0, most_cached, ongoing=False)
            empty = ChunkContext(
                self.policy.budget.max_num_batched_tokens, (), np.empty(0, np.int64), np.empty(0, np.int64)
            )
            startable = checked_chunk(self.policy.chunker, restart, empty) > 0
            if known is not None:
                if len(known) >= _RESTARTABLE_KEPT:
                    known.clear()
                known[most_cached] = startable
        if not startable:
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
        self._drop_claims(journal)
        admitted, new_requests = self._admit_and_grow(slots, checked.new_pages, checked, journal)
        if len(admitted):
            admitted_tokens = np.asarray(selection.admitted_tokens, dtype=np.int32)
            admitted_start = arrays.computed[admitted]  # precomputed (transferred) tokens, usually 0
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

    def _extend(self, slots: Int32Array, num_pages: NDArray[np.int64] | None, journal: Journal) -> None:
        """Grow table ``slots[i]`` by ``num_pages[i]`` pages (``None``: one page each)."""
        total = len(slots) if num_pages is None else int(num_pages.sum())
        if not total:  # most decode steps cross no page boundary
            return
        if self._unnamed and self._kv.evicts_for(total) and self._pending_meet(self._kv.parents_to_evict(total)):
            self._name_pending()  # a pending page must meet its hash cached, as it would have when it filled
        counts = self._kv.page_counts[slots]  # a copy (fancy indexing), for the undo
        evicted = self._kv.extend_each(slots) if num_pages is None else self._kv.extend_many(slots, num_pages)

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
        # The same call may admit a request into a victim's slot, overwriting its row: a rollback
        # must put the row back (before the retire's own undo reloads the victims).
        rows = self._arrays.save_rows(slots)
        self._retire(slots, journal)

        def undo() -> None:
            for seq, (status, preemptions, precomputed) in zip(seqs, saved, strict=True):
                if seq.request.request_id in self._waiting:
                    self._waiting.remove(seq.request.request_id)
                seq.status, seq.num_preemptions, seq.precomputed = status, preemptions, precomputed
            self._arrays.restore_rows(rows)

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
        if not hashes:  # nothing it could claim (a length-only request): no lookup, nothing to count
            return
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
        index = due.nonzero()[0]
        if not len(index):
            return
        if len(index) < len(slots):
            slots, computed, due = slots[index], computed[index], due[index]
        full = computed // kv.page_size
        lists: list[list[int]] = [seq.page_hashes for seq in self._arrays.seqs[slots].tolist()]
        known = np.fromiter(map(len, lists), dtype=np.int32, count=len(lists))
        has_ids = self._arrays.has_ids[slots]
        last_only = has_ids & (known == full - 1)  # decodes: one page of generated tokens filled
        if last_only.all() and (due == 1).all():  # the steady decode step: one page each, all new
            parents = self._hash_last_pages(slots, full, lists, journal)
            registrations = kv.register_next(slots, [hashes[-1] for hashes in lists], parents)
        else:
            if last_only.any():
                one = last_only.nonzero()[0]
                self._hash_last_pages(slots[one], full[one], [lists[i] for i in one.tolist()], journal)
            self._hash_filled_pages(slots, full, lists, journal)
            registrations = kv.register_many(slots, lists, due)
        journal.record(functools.partial(kv.unregister_many, registrations))

    def _defer_naming(self, naming: _GroupNaming, kv_len: Int32Array, journal: Journal) -> None:
        """Leave a steady group's freshly filled pages to be named later, with others (last thing in a step)."""
        if not len(naming.named):
            return
        if any(pending.naming is naming for pending in self._unnamed):  # its turn came round again: name them all
            self._name_pending()
        self._unnamed.append(_Unnamed(naming, kv_len[naming.named] // self._kv.page_size))
        journal.record(self._unnamed.pop)

    def _pending_meet(self, evicted_parents: set[int] | None) -> bool:
        """Whether a pending page may share the hash of a page about to be evicted: then it must be named first.

        Naming a page asks whether its hash is cached, and evicting pages whose hashes no pending
        page has changes no answer, so pending pages can wait past the eviction. Equal hashes
        mean equal prefixes, so equal parents' hashes (the prefix before the page): pages whose
        parents differ cannot share a hash, barring a hash collision, which sharing cached KV
        by hash already assumes away (see :mod:`phasesched.prefix`). ``None``: a parent is unknown.
        """
        if evicted_parents is None:
            return True
        for pending in self._unnamed:
            parents = pending.parents()
            if parents is None or not evicted_parents.isdisjoint(parents):
                return True
        return False

    def _name_pending(self) -> None:
        """Name the pages the steady steps left unnamed, before anything can look them up or free them.

        Naming is lazy but exact: every read of names (a lookup, a free that parks pages, the
        counters) comes through here first, so what it sees is what naming each page as it
        filled would have left, in the same order. Only steps already applied are pending, so
        a call that rolls back later need not undo this.
        """
        if not self._unnamed:
            return
        entries, size = self._unnamed, self._kv.page_size
        slots = np.concatenate([pending.naming.slots for pending in entries])
        full = np.concatenate([pending.full for pending in entries])
        journal = Journal()
        try:
            if self._kv.offers_next(slots, full - 1):  # distinct tables, each one page on: one batch
                lists = [hashes for pending in entries for hashes in pending.naming.hashes]
                parents = self._hash_last_pages(slots, full, lists, journal)
                self._kv.register_next(slots, [hashes[-1] for hashes in lists], parents)
            else:  # not where the steady batch expected: the general way, step by step
                for pending in entries:
                    self._register_pages(pending.naming.slots, pending.full * size, journal)
        except BaseException:
            journal.rollback()
            raise
        entries.clear()

    def _hash_last_pages(
        self, slots: Int32Array, full: Int32Array, lists: list[list[int]], journal: Journal
    ) -> list[int]:
        """Hash page ``full[i] - 1`` of each slot, the one its tokens just filled (its earlier ones are hashed).

        Returns:
            The hashes of the pages before them (their parents, for the cache).
        """
        contents = self._arrays.tokens.pages(slots, full - 1, self._kv.page_size)
        parents = [hashes[-1] if hashes else ROOT_HASH for hashes in lists]
        for hashes, parent, page in zip(lists, parents, contents, strict=True):
            hashes.append(hash((parent, page)))
        journal.record(functools.partial(self._pop_hashes, lists))
        return parents

    def _hash_filled_pages(self, slots: Int32Array, full: Int32Array, lists: list[list[int]], journal: Journal) -> None:
        """Extend the page hashes of slots whose filled pages hold several generated ones not yet hashed."""
        known = np.fromiter(map(len, lists), dtype=np.int32, count=len(lists))
        behind = (self._arrays.has_ids[slots] & (known < full - 1)).nonzero()[0].tolist()
        if not behind:
            return
        size, tokens = self._kv.page_size, self._arrays.tokens
        extended = [(lists[i], int(known[i])) for i in behind]
        for i, (hashes, length) in zip(behind, extended, strict=True):
            row = tokens.row(int(slots[i]), length * size, int(full[i]) * size)  # the new pages' tokens
            extend_page_hashes(hashes, row, size, int(full[i]), offset=length * size)
        journal.record(functools.partial(self._truncate_hashes, extended))

    @staticmethod
    def _pop_hashes(lists: list[list[int]]) -> None:
        for hashes in lists:
            hashes.pop()

    @staticmethod
    def _truncate_hashes(extended: list[tuple[list[int], int]]) -> None:
        for hashes, length in extended:
            del hashes[length:]

    def _readmit(self, seq: SequenceState, status: RequestStatus) -> None:
        """Undo an admission's removal from the waiting queue: same key, same place."""
        seq.status = status
        self._waiting.push(seq)

    def _retire(self, slots: Int32Array, journal: Journal) -> None:
        """Free the KV of running ``slots`` and take them off the running set."""
        arrays = self._arrays
        if self._core is not None and np.count_nonzero(self._core.members(slots)):
            self._core = None  # one of its decodes leaves
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
        if len(slots) <= 8:  # a few slices (a mixed step's chunks and admissions): a row slice each
            rows = arrays.tokens.ids
            parts = zip(slots.tolist(), start.tolist(), num_new.tolist(), strict=True)
            return np.concatenate([rows[slot, begin : begin + length] for slot, begin, length in parts])
        total = int(num_new.sum())
        if len(slots) == total and np.array_equal(start, known - 1):
            last: Int32Array = arrays.last_token[slots]  # all decodes: each feeds its last token
            return last
        longer = (num_new > 1).nonzero()[0]
        if len(longer) > 16:  # many multi-token slices: one gather of every position
            return arrays.tokens.gather(np.repeat(slots, num_new), token_positions(start, num_new))
        # Few chunks (the usual mixed step): single tokens in one gather, each chunk one row slice.
        ids = np.empty(total, dtype=np.int32)
        first = num_new.cumsum() - num_new
        single = num_new == 1
        ids[first[single]] = arrays.tokens.gather(slots[single], start[single])
        rows = arrays.tokens.ids
        for i in longer.tolist():
            begin, length = int(start[i]), int(num_new[i])
            ids[first[i] : first[i] + length] = rows[slots[i], begin : begin + length]
        return ids

    def _record_tokens(
        self, slots: Int32Array, sampled: NDArray[np.bool_], token_ids: Int32Array, finished: NDArray[np.bool_] | None
    ) -> tuple[NDArray[np.bool_], list[FinishReason]]:
        """Record the sampled tokens of slices ``slots``; return which of them finish, and why, in slice order."""
        if len(slots) <= 8:
            return self._record_few(slots, sampled, token_ids, finished)
        arrays = self._arrays
        s_slots, s_tokens = slots[sampled], token_ids[sampled]
        known = arrays.known[s_slots] + 1
        arrays.known[s_slots] = known
        arrays.last_token[s_slots] = s_tokens
        by_length = np.zeros(len(slots), dtype=bool)
        by_length[sampled] = known >= arrays.max_known[s_slots]
        done = by_length | arrays.abort_pending[slots]
        by_stop = None
        if arrays.num_with_tokens:  # else none has ids to store, an EOS or stop tokens (a simulator's requests)
            by_stop = np.zeros(len(slots), dtype=bool)
            by_stop[sampled] = s_tokens == arrays.eos[s_slots]
            self._append_token_ids(s_slots, s_tokens, known)
            stop_sets = (sampled & arrays.has_stop_set[slots]).nonzero()[0]
            for i in stop_sets.tolist():
                by_stop[i] |= int(token_ids[i]) in arrays.stop_sets[int(slots[i])]
            done |= by_stop
        if finished is not None:
            done |= finished
        if not np.count_nonzero(done):
            return done, []
        aborted = arrays.abort_pending[slots[done]]
        stopped = [False] * len(aborted) if by_stop is None else by_stop[done].tolist()
        reasons = [
            FinishReason.ABORTED
            if a
            else FinishReason.STOP
            if s
            else FinishReason.LENGTH
            if n
            else FinishReason.EXECUTOR
            for a, s, n in zip(aborted.tolist(), stopped, by_length[done].tolist(), strict=True)
        ]
        return done, reasons

    def _record_few(
        self, slots: Int32Array, sampled: NDArray[np.bool_], token_ids: Int32Array, finished: NDArray[np.bool_] | None
    ) -> tuple[NDArray[np.bool_], list[FinishReason]]:
        """:meth:`_record_tokens` for a few slices (a mixed step's rest, a small batch), one by one."""
        arrays = self._arrays
        done = np.zeros(len(slots), dtype=bool)
        reasons: list[FinishReason] = []
        written: list[tuple[int, int, int]] = []
        ends = [False] * len(slots) if finished is None else finished.tolist()
        slices = zip(slots.tolist(), sampled.tolist(), token_ids.tolist(), strict=True)
        for i, (slot, samples, token) in enumerate(slices):
            by_stop = by_length = False
            if samples:
                known = int(arrays.known[slot]) + 1
                arrays.known[slot], arrays.last_token[slot] = known, token
                by_length = known >= arrays.max_known[slot]
                by_stop = token == arrays.eos[slot] or (
                    bool(arrays.has_stop_set[slot]) and token in arrays.stop_sets[slot]
                )
                if arrays.has_ids[slot]:
                    written.append((slot, known - 1, token))
            aborted = bool(arrays.abort_pending[slot])
            if aborted or by_stop or by_length or ends[i]:
                done[i] = True
                reasons.append(
                    FinishReason.ABORTED
                    if aborted
                    else FinishReason.STOP
                    if by_stop
                    else FinishReason.LENGTH
                    if by_length
                    else FinishReason.EXECUTOR
                )
        if written:
            rows, positions, tokens = (np.array(column, dtype=np.int32) for column in zip(*written, strict=True))
            arrays.tokens.write(rows, positions, tokens)
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
