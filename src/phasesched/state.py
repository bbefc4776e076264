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
from typing import TYPE_CHECKING, Any, ClassVar

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
    outputs: list[int] | None = None
    """Generated token ids, for requests that carry ids (synced from the token buffer when it
    stops running; while it runs, the buffer is authoritative)."""
    num_generated: int = 0
    num_preemptions: int = 0
    slot: int = -1
    precomputed: int = 0
    """Leading prompt tokens whose KV arrives with the request (a disaggregated prefill's
    transfer); lost, and recomputed locally, if the request is preempted."""

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt plus generated."""
        return self.request.prompt_len + self.num_generated


@attrs.frozen
class WaitingCandidate:
    """A waiting request as policies see it."""

    request: Request
    num_tokens: int
    """Tokens known: its prompt plus any tokens generated before a preemption."""
    num_preemptions: int
    num_computed: int = 0
    """Tokens whose KV it brings (transferred from a prefill worker); 0 for a plain request."""

    @property
    def remaining(self) -> int:
        """Tokens to compute before it samples."""
        return self.num_tokens - self.num_computed

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


class TokenBuffer:
    """Token ids of running requests, one row per slot, as vLLM's input batch keeps them.

    Recording a step's sampled tokens is one scatter, and a step's input ids one gather, instead
    of a Python loop over per-request lists. Rows and columns grow by doubling as needed.
    """

    def __init__(self) -> None:
        self.ids = np.zeros((8, 64), dtype=np.int32)

    def load(self, slot: int, prompt: tuple[int, ...], outputs: list[int]) -> None:
        """Write a request's prompt and generated tokens into row ``slot``."""
        length = len(prompt) + len(outputs)
        self._ensure(slot + 1, length)
        row = self.ids[slot]
        row[: len(prompt)] = prompt
        row[len(prompt) : length] = outputs

    def write(self, slots: Int32Array, positions: Int32Array, tokens: Int32Array) -> None:
        """Store ``tokens[i]`` at position ``positions[i]`` of row ``slots[i]``."""
        if len(slots):
            self._ensure(int(slots.max()) + 1, int(positions.max()) + 1)
            self.ids[slots, positions] = tokens

    def gather(self, rows: Int32Array, positions: Int32Array) -> Int32Array:
        """The tokens at ``positions[i]`` of row ``rows[i]``."""
        tokens: Int32Array = self.ids[rows, positions]
        return tokens

    def row(self, slot: int, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` of row ``slot``, as a list."""
        tokens: list[int] = self.ids[slot, start:stop].tolist()
        return tokens

    def _ensure(self, rows: int, columns: int) -> None:
        height, width = self.ids.shape
        if rows <= height and columns <= width:
            return
        while height < rows:
            height *= 2
        while width < columns:
            width *= 2
        grown = np.zeros((height, width), dtype=np.int32)
        grown[: self.ids.shape[0], : self.ids.shape[1]] = self.ids
        self.ids = grown


class RunningArrays:
    """Per-slot state of running requests, as parallel numpy arrays that grow on demand.

    Python objects (the request's state, its id, its token list, its stop set) sit in object
    arrays so that a batch of slots can fetch them with one fancy index instead of a loop.
    """

    _NUMERIC: ClassVar[dict[str, tuple[type[np.generic], object]]] = {
        "computed": (np.int32, 0),
        "known": (np.int32, 0),
        "prompt_len": (np.int32, 0),
        "max_known": (np.int32, 0),
        "last_token": (np.int32, _NO_TOKEN),
        "eos": (np.int32, _NO_TOKEN),
        "arrival": (np.float64, 0.0),
        "priority": (np.int64, 0),
        "has_ids": (np.bool_, False),
        "has_stop_set": (np.bool_, False),
        "running": (np.bool_, False),
        "abort_pending": (np.bool_, False),
    }
    _OBJECTS: ClassVar[tuple[str, ...]] = ("seqs", "ids", "stop_sets")

    def __init__(self, capacity: int = 64) -> None:
        self.computed: Int32Array
        """Tokens already in the KV cache."""
        self.known: Int32Array
        """Tokens known (prompt plus generated)."""
        self.prompt_len: Int32Array
        self.max_known: Int32Array
        """Known tokens at which generation stops for length (prompt + max_new, capped by the model)."""
        self.last_token: Int32Array
        self.eos: Int32Array
        self.arrival: NDArray[np.float64]
        self.priority: NDArray[np.int64]
        self.has_ids: NDArray[np.bool_]
        self.has_stop_set: NDArray[np.bool_]
        self.running: NDArray[np.bool_]
        self.abort_pending: NDArray[np.bool_]
        """Aborted while its plan was in flight: retired when that plan's result arrives."""
        self.seqs: NDArray[np.object_]
        self.ids: NDArray[np.object_]
        self.stop_sets: NDArray[np.object_]
        self.tokens = TokenBuffer()
        """Token ids of slots whose requests carry ids."""
        self.num_with_tokens = 0
        """Running requests whose sampled tokens matter (ids, EOS or stop tokens), so a simulator
        cannot make them up."""
        for name, (dtype, fill) in self._NUMERIC.items():
            setattr(self, name, np.full(capacity, fill, dtype=dtype))
        for name in self._OBJECTS:
            setattr(self, name, np.full(capacity, None, dtype=object))
        self._views: dict[str, NDArray[Any]] = {}

    def read_only(self, name: str) -> NDArray[Any]:
        """A read-only view of array ``name``, made once per array (policies get these)."""
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = _read_only(getattr(self, name))
        return view

    @property
    def generated(self) -> Int32Array:
        """Tokens each slot has generated (derived: known minus prompt)."""
        generated: Int32Array = self.known - self.prompt_len
        return generated

    def ensure(self, slot: int) -> None:
        """Grow every array so ``slot`` is a valid index."""
        size = len(self.computed)
        if slot < size:
            return
        new = max(2 * size, slot + 1)
        self._views.clear()
        for name, (dtype, fill) in self._NUMERIC.items():
            grown: NDArray[Any] = np.full(new, fill, dtype=dtype)
            grown[:size] = getattr(self, name)
            setattr(self, name, grown)
        for name in self._OBJECTS:
            grown = np.full(new, None, dtype=object)
            grown[:size] = getattr(self, name)
            setattr(self, name, grown)

    def load(self, slot: int, seq: SequenceState, max_model_len: int) -> None:
        """Fill ``slot`` for a request starting (or restarting) from its precomputed tokens."""
        self.ensure(slot)
        request = seq.request
        self.computed[slot] = seq.precomputed
        self.known[slot] = seq.num_tokens
        self.prompt_len[slot] = request.prompt_len
        self.max_known[slot] = min(request.max_total_tokens, max_model_len)
        prompt, outputs = request.prompt_token_ids, seq.outputs
        if prompt is not None and outputs is not None:
            self.tokens.load(slot, prompt, outputs)
            self.last_token[slot] = outputs[-1] if outputs else prompt[-1]
        else:
            self.last_token[slot] = _NO_TOKEN
        eos = request.eos_token_id
        self.eos[slot] = _NO_TOKEN if eos is None or request.ignore_eos else eos
        self.arrival[slot] = request.arrival_time
        self.priority[slot] = request.priority
        self.has_ids[slot] = prompt is not None
        self.has_stop_set[slot] = bool(request.stop_token_ids)
        self.num_with_tokens += _tokens_matter(slot, self)
        self.running[slot] = True
        self.abort_pending[slot] = False
        self.seqs[slot] = seq
        self.ids[slot] = request.request_id
        self.stop_sets[slot] = request.stop_token_ids

    def unload(self, slots: Int32Array) -> None:
        """Mark ``slots`` as no longer running, copying their progress back to their requests."""
        self.running[slots] = False
        self.num_with_tokens -= int(
            np.count_nonzero(self.has_ids[slots] | self.has_stop_set[slots] | (self.eos[slots] >= 0))
        )
        generated = self.generated[slots].tolist()
        for slot, seq, count in zip(slots.tolist(), self.seqs[slots].tolist(), generated, strict=True):
            if seq.outputs is not None:
                prompt_len = seq.request.prompt_len
                seq.outputs = self.tokens.row(slot, prompt_len, prompt_len + count)
            seq.num_generated = count
            seq.slot = -1
        self.seqs[slots] = None


def _tokens_matter(slot: int, arrays: RunningArrays) -> bool:
    return bool(arrays.has_ids[slot] or arrays.has_stop_set[slot] or arrays.eos[slot] >= 0)


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
        self.running = running if not running.flags.writeable else _read_only(running)
        self.num_computed: Int32Array = arrays.read_only("computed")
        self.num_tokens: Int32Array = arrays.read_only("known")
        self.prompt_len: Int32Array = arrays.read_only("prompt_len")
        self.arrival_time: NDArray[np.float64] = arrays.read_only("arrival")
        self.priority: NDArray[np.int64] = arrays.read_only("priority")
        self.page_count = kv.page_counts
        self._kv = kv
        self._arrays = arrays
        self._waiting = waiting

    @property
    def num_generated(self) -> Int32Array:
        """int32 generated tokens of each slot (computed on demand)."""
        return self._arrays.generated

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return len(self._waiting)

    def request(self, slot: int) -> Request:
        """The request running in ``slot``."""
        seq: SequenceState | None = self._arrays.seqs[slot]
        if seq is None:
            msg = f"slot {slot} holds no running request"
            raise KeyError(msg)
        return seq.request

    def waiting(self) -> Iterator[WaitingCandidate]:
        """Waiting requests in queue order, lazily."""
        for seq in self._waiting.ordered():
            yield WaitingCandidate(seq.request, seq.num_tokens, seq.num_preemptions, seq.precomputed)

    def freed_by_preempting(self, slots: Int32Array) -> int:
        """KV pages that preempting ``slots`` would return to the pool."""
        return self._kv.freed_by_closing(slots)

    def pages_to_grow(self, slots: Int32Array, num_new: NDArray[np.integer[Any]]) -> NDArray[np.int64]:
        """Pages each slot needs to compute ``num_new`` more tokens."""
        # Running requests hold exactly ceil(computed / page_size) pages between steps, so this
        # is never negative.
        size = self.page_size
        grow: NDArray[np.int64] = (self.num_computed[slots] + (num_new + (size - 1))) // size
        grow -= self.page_count[slots]
        return grow

    def pages_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.page_size)
