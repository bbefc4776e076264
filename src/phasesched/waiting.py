"""The waiting queue: requests not holding KV, in the order the queue-order policy fixed.

Each request gets its sort key once, when it first arrives; a preempted request re-enters with
the same key and so keeps its place. Iterating in order costs O(k log k) for the first k, so a
deep queue adds nothing to a step that admits a few.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

import attrs

from phasesched.errors import InvalidPlanError
from phasesched.request import Request
from phasesched.sequence import SequenceState

__all__ = ["WaitingCandidate", "WaitingQueue"]


@attrs.frozen
class WaitingCandidate:
    """A waiting request as policies see it."""

    request: Request
    num_tokens: int
    """Tokens known — its prompt plus any tokens generated before a preemption."""
    num_preemptions: int
    num_computed: int = 0
    """Tokens whose KV it brings (transferred from a prefill worker) or would claim from the
    prefix cache if admitted now; 0 for a plain request."""

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
        self._arrivals = itertools.count()
        self._pushes = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def push(self, seq: SequenceState) -> None:
        """Queue ``seq`` under its fixed key; ties go by the order requests were first queued.

        Raises:
            InvalidPlanError: Its key does not compare with the queued keys; nothing changed.
        """
        if seq.arrival_order < 0:  # first time queued; a preempted request keeps its place among equals
            seq.arrival_order = next(self._arrivals)
        # The push count settles ties with a lazily deleted entry of the same request, so the
        # heap never compares the entries' payloads.
        entry = [seq.queue_key, (seq.arrival_order, next(self._pushes)), seq]
        try:
            heapq.heappush(self._heap, entry)
        except Exception as error:  # a plugin's key that does not compare with the others': take it out again
            self._heap = [e for e in self._heap if e is not entry]
            heapq.heapify(self._heap)
            msg = f"queue key {seq.queue_key!r} of {seq.request.request_id!r} does not compare with the others: {error}"
            raise InvalidPlanError(msg) from error
        self._entries[seq.request.request_id] = entry

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
