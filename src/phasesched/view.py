"""What a policy may read while planning a step: a read-only view of the scheduler's state."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidPlanError
from phasesched.request import Request
from phasesched.running import RunningArrays, read_only
from phasesched.sequence import SequenceState
from phasesched.waiting import WaitingCandidate, WaitingQueue

if TYPE_CHECKING:
    from phasesched.kv import PagedKVManager
    from phasesched.policies.budget import TokenBudget

__all__ = ["SchedulerView"]

Int32Array = NDArray[np.int32]


class SchedulerView:
    """What a policy may read while planning a step. Arrays are read-only and indexed by slot.

    Per-slot arrays have one entry for each of the scheduler's ``S`` slots (free slots included:
    index them with ``running``); ``running`` lists the ``R`` slots in use.

    Attributes:
        now: The engine's clock at this ``schedule()`` call.
        budget: The step's token and sequence caps.
        page_size: Tokens per KV page.
        free_pages: Free KV pages (idle cached pages included: they are evicted on demand).
        watermark_pages: Pages admissions must leave free.
        max_model_len: The longest sequence (prompt plus generated) the model accepts.
        running: int32 ``[R]``: slots of running requests, in admission order.
        num_computed: int32 ``[S]``: tokens in each slot's cache.
        num_tokens: int32 ``[S]``: tokens known for each slot.
        prompt_len: int32 ``[S]``: prompt length of each slot.
        arrival_time: float64 ``[S]``: arrival time of each slot.
        priority: int64 ``[S]``: priority of each slot (lower is more important).
        page_count: int32 ``[S]``: KV pages held by each slot (free slots hold 0).

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
        reorder: Callable[[Iterable[WaitingCandidate], int], Iterator[WaitingCandidate]] | None = None,
    ) -> None:
        self.now = now
        self.budget = budget
        self.page_size = kv.page_size
        self.free_pages = kv.num_free_pages
        self.watermark_pages = kv.watermark_pages
        self.max_model_len = max_model_len
        self.running = running if not running.flags.writeable else read_only(running)
        self.num_computed: Int32Array = arrays.read_only("computed")
        self.num_tokens: Int32Array = arrays.read_only("known")
        self.prompt_len: Int32Array = arrays.read_only("prompt_len")
        self.arrival_time: NDArray[np.float64] = arrays.read_only("arrival")
        self.priority: NDArray[np.int64] = arrays.read_only("priority")
        self.page_count = kv.page_counts
        self._kv = kv
        self._arrays = arrays
        self._waiting = waiting
        self._reorder = reorder  # the scheduler binds its queue order's rerank: this module needs no policy

    @property
    def num_generated(self) -> Int32Array:
        """int32 ``[S]``: generated tokens of each slot (computed on demand)."""
        return self._arrays.generated

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return len(self._waiting)

    def request(self, slot: int) -> Request:
        """The request running in ``slot``.

        Raises:
            InvalidPlanError: ``slot`` holds no running request (a policy bug).
        """
        seqs = self._arrays.seqs
        seq: SequenceState | None = seqs[slot] if 0 <= slot < len(seqs) else None
        if seq is None:
            msg = f"slot {slot} holds no running request"
            raise InvalidPlanError(msg)
        return seq.request

    def waiting(self) -> Iterator[WaitingCandidate]:
        """Waiting requests in queue order, lazily (re-ranked first by a cache-aware queue order)."""
        candidates = (
            WaitingCandidate(seq.request, seq.num_tokens, seq.num_preemptions, seq.tokens_at_admission(self._kv))
            for seq in self._waiting.ordered()
        )
        return self._reorder(candidates, len(self._waiting)) if self._reorder is not None else candidates

    def freed_by_preempting(self, slots: Int32Array) -> int:
        """KV pages that preempting ``slots`` would return to the pool.

        Args:
            slots: int32 ``[K]``: slots of running requests. Pages they share with each other
                count once; pages shared with a request outside ``slots`` do not count.

        Returns:
            The number of pages that would become free.
        """
        return self._kv.freed_by_freeing(slots)

    def pages_to_grow(self, slots: Int32Array, num_new: NDArray[np.integer[Any]]) -> NDArray[np.int64]:
        """Pages each slot needs to compute ``num_new`` more tokens.

        Args:
            slots: int32 ``[K]``: slots of running requests.
            num_new: int ``[K]``: tokens each of them would compute, beyond its cache.

        Returns:
            int64 ``[K]``: KV pages each one must add (0 when its pages already hold them).
        """
        return self._kv.pages_to_grow(slots, self.num_computed[slots] + num_new)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens occupy."""
        return self._kv.pages_for(num_tokens)
