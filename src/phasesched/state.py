"""The scheduler's mutable state, and the read-only view policies plan against.

Running requests live in per-slot numpy arrays (the slot is the request's KV table), so the
steady decode step is a few vectorized operations however many requests run. Waiting requests
live in a heap ordered by a key the queue-order policy fixes once, when the request first
arrives; a preempted request re-enters with the same key and so keeps its place.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.request import Request, RequestStatus

if TYPE_CHECKING:
    from phasesched.kv import PagedKVManager
    from phasesched.policies.budget import TokenBudget

__all__ = ["RunningArrays", "SchedulerView", "SequenceState", "WaitingCandidate", "WaitingQueue"]

Int32Array = NDArray[np.int32]
_NO_TOKEN = -1


@attrs.define(eq=False)
class SequenceState:
    """Progress of one request the scheduler holds (internal; policies see views of it)."""

    request: Request
    queue_key: Any
    status: RequestStatus = RequestStatus.WAITING
    tokens: list[int] | None = None
    """Prompt plus generated token ids, when the request carries ids."""
    num_generated: int = 0
    num_preemptions: int = 0
    slot: int = -1

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt plus generated."""
        return self.request.prompt_len + self.num_generated


@attrs.frozen
class WaitingCandidate:
    """A waiting request as policies see it; it holds no KV, so its computed count is 0."""

    request: Request
    num_tokens: int
    """Tokens to compute before it samples: its prompt plus any tokens generated before a preemption."""
    num_preemptions: int

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id


class WaitingQueue:
    """A heap of waiting requests with lazy deletion and non-destructive in-order iteration."""

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        self._entries: dict[str, list[Any]] = {}
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def push(self, seq: SequenceState) -> None:
        """Queue ``seq`` under its fixed key (ties broken by insertion order)."""
        entry = [seq.queue_key, next(self._counter), seq]
        self._entries[seq.request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, request_id: str) -> SequenceState:
        """Take a request out of the queue, wherever it stands."""
        entry = self._entries.pop(request_id)
        seq: SequenceState = entry[2]
        entry[2] = None  # lazily deleted; skipped and dropped when it surfaces
        self._drop_dead_top()
        return seq

    def get(self, request_id: str) -> SequenceState | None:
        """The waiting request with this id, if any."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry[2]

    def ordered(self) -> Iterator[SequenceState]:
        """Yield waiting requests best-first without changing the queue.

        Costs O(k log k) for the first k yielded, so a deep queue adds nothing to a step that
        admits few requests.
        """
        heap = self._heap
        frontier = [(heap[0][0], heap[0][1], 0)] if heap else []
        while frontier:
            _, _, index = heapq.heappop(frontier)
            seq = heap[index][2]
            if seq is not None:
                yield seq
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], heap[child][1], child))

    def _drop_dead_top(self) -> None:
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        if len(heap) > 64 and len(heap) > 2 * len(self._entries):  # compact when mostly dead
            self._heap = [entry for entry in heap if entry[2] is not None]
            heapq.heapify(self._heap)


class RunningArrays:
    """Per-slot state of running requests, as parallel numpy arrays that grow on demand."""

    _INT_FIELDS = ("computed", "known", "prompt_len", "max_known", "generated", "last_token", "eos")

    def __init__(self, capacity: int = 64) -> None:
        self.computed = np.zeros(capacity, dtype=np.int32)
        """Tokens already in the KV cache."""
        self.known = np.zeros(capacity, dtype=np.int32)
        """Tokens known (prompt plus generated)."""
        self.prompt_len = np.zeros(capacity, dtype=np.int32)
        self.max_known = np.zeros(capacity, dtype=np.int32)
        """Known tokens at which generation stops for length (prompt + max_new, capped by the model)."""
        self.generated = np.zeros(capacity, dtype=np.int32)
        self.last_token = np.full(capacity, _NO_TOKEN, dtype=np.int32)
        self.eos = np.full(capacity, _NO_TOKEN, dtype=np.int32)
        self.arrival = np.zeros(capacity, dtype=np.float64)
        self.priority = np.zeros(capacity, dtype=np.int64)
        self.has_ids = np.zeros(capacity, dtype=bool)
        self.has_stop_set = np.zeros(capacity, dtype=bool)
        self.running = np.zeros(capacity, dtype=bool)
        self.abort_pending = np.zeros(capacity, dtype=bool)
        """Aborted while its plan was in flight: retired when that plan's result arrives."""
        self.seqs: list[SequenceState | None] = [None] * capacity
        self.ids: list[str] = [""] * capacity

    def ensure(self, slot: int) -> None:
        """Grow every array so ``slot`` is a valid index."""
        size = len(self.computed)
        if slot < size:
            return
        new = max(2 * size, slot + 1)
        for name in (*self._INT_FIELDS, "arrival", "priority", "has_ids", "has_stop_set", "running", "abort_pending"):
            old = getattr(self, name)
            grown = np.zeros(new, dtype=old.dtype)
            grown[:size] = old
            if name in ("last_token", "eos"):
                grown[size:] = _NO_TOKEN
            setattr(self, name, grown)
        self.seqs.extend([None] * (new - size))
        self.ids.extend([""] * (new - size))

    def load(self, slot: int, seq: SequenceState, max_model_len: int) -> None:
        """Fill ``slot`` for a request starting (or restarting) from zero computed tokens."""
        self.ensure(slot)
        request = seq.request
        self.computed[slot] = 0
        self.known[slot] = seq.num_tokens
        self.prompt_len[slot] = request.prompt_len
        self.max_known[slot] = min(request.max_total_tokens, max_model_len)
        self.generated[slot] = seq.num_generated
        self.last_token[slot] = seq.tokens[-1] if seq.tokens else _NO_TOKEN
        eos = request.eos_token_id
        self.eos[slot] = _NO_TOKEN if eos is None or request.ignore_eos else eos
        self.arrival[slot] = request.arrival_time
        self.priority[slot] = request.priority
        self.has_ids[slot] = seq.tokens is not None
        self.has_stop_set[slot] = bool(request.stop_token_ids)
        self.running[slot] = True
        self.abort_pending[slot] = False
        self.seqs[slot] = seq
        self.ids[slot] = request.request_id

    def unload(self, slots: Int32Array) -> None:
        """Mark ``slots`` as no longer running, copying their progress back to their requests."""
        self.running[slots] = False
        for slot, generated in zip(slots.tolist(), self.generated[slots].tolist(), strict=True):
            seq = self.seqs[slot]
            assert seq is not None
            seq.num_generated = generated
            seq.slot = -1
            self.seqs[slot] = None


def _read_only(array: NDArray[Any]) -> NDArray[Any]:
    view: NDArray[Any] = array.view()
    view.flags.writeable = False
    return view


class SchedulerView:
    """What a policy may read while planning a step. Arrays are read-only and indexed by slot.

    Attributes:
        now: The engine's clock at this ``schedule()`` call.
        budget: The step's token and sequence caps.
        page_size: Tokens per KV page.
        free_pages: Free KV pages.
        watermark_pages: Pages admissions must leave free.
        max_model_len: The longest sequence (prompt plus generated) the model accepts.
        running: int32 slots of running requests, in admission order.
        num_computed: int32 tokens in each slot's cache.
        num_tokens: int32 tokens known for each slot.
        prompt_len: int32 prompt length of each slot.
        num_generated: int32 generated tokens of each slot.
        arrival_time: float64 arrival time of each slot.
        priority: int64 priority of each slot (lower is more important).
        page_count: int32 KV pages held by each slot.

    """

    def __init__(  # noqa: PLR0913 -- a view over the scheduler's parts, passed explicitly
        self,
        *,
        now: float,
        budget: TokenBudget,
        kv: PagedKVManager,
        arrays: RunningArrays,
        running: Int32Array,
        waiting: WaitingQueue,
        max_model_len: int,
    ) -> None:
        self.now = now
        self.budget = budget
        self.page_size = kv.page_size
        self.free_pages = kv.num_free_pages
        self.watermark_pages = kv.watermark_pages
        self.max_model_len = max_model_len
        self.running = _read_only(running)
        self.num_computed = _read_only(arrays.computed)
        self.num_tokens = _read_only(arrays.known)
        self.prompt_len = _read_only(arrays.prompt_len)
        self.num_generated = _read_only(arrays.generated)
        self.arrival_time = _read_only(arrays.arrival)
        self.priority = _read_only(arrays.priority)
        self.page_count = kv.page_counts
        self._kv = kv
        self._arrays = arrays
        self._waiting = waiting

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return len(self._waiting)

    def request(self, slot: int) -> Request:
        """The request running in ``slot``."""
        seq = self._arrays.seqs[slot]
        if seq is None:
            msg = f"slot {slot} holds no running request"
            raise KeyError(msg)
        return seq.request

    def waiting(self) -> Iterator[WaitingCandidate]:
        """Waiting requests in queue order, lazily."""
        for seq in self._waiting.ordered():
            yield WaitingCandidate(seq.request, seq.num_tokens, seq.num_preemptions)

    def freed_by_preempting(self, slots: Int32Array) -> int:
        """KV pages that preempting ``slots`` would return to the pool."""
        return self._kv.freed_by_closing(slots)

    def pages_to_grow(self, slots: Int32Array, num_new: NDArray[np.integer[Any]]) -> NDArray[np.int64]:
        """Pages each slot needs to compute ``num_new`` more tokens."""
        total = self.num_computed[slots].astype(np.int64) + num_new
        return np.maximum(-(-total // self.page_size) - self.page_count[slots], 0)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.page_size)
