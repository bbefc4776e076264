"""Queue order: which waiting request is considered first.

Each order gives a request a sort key once, when it arrives, and the waiting queue keeps it for
the request's whole life. Aging that grows linearly with waiting time needs no re-sorting:
``score - rate * (now - arrival)`` orders requests exactly as ``score + rate * arrival`` does,
since ``rate * now`` is the same for everyone. A preempted request re-enters under its original
key, so it keeps its place instead of queuing behind requests that arrived after it.

Cache-aware orders (:class:`CacheAwareOrder`) also *re-rank* the queue every step by what the
prefix cache holds now, as SGLang's ``lpm`` does; past ``max_queue_depth`` waiting requests they
fall back to their fixed key, so a deep queue costs no more than FCFS.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import attrs

from phasesched.request import Request
from phasesched.validators import number, whole
from phasesched.waiting import WaitingCandidate

__all__ = [
    "FCFS",
    "CacheAwareAging",
    "CacheAwareOrder",
    "LongestPrefixMatch",
    "PriorityOrder",
    "QueueOrder",
    "ShortestRemainingPrefill",
    "rerank",
]


@runtime_checkable
class QueueOrder(Protocol):
    """Gives each request a fixed, comparable key; smaller keys are served first."""

    def key(self, request: Request) -> Any:
        """The request's place in the waiting queue."""
        ...


@attrs.frozen
class FCFS:
    """First come, first served: by arrival time (ties by submission order)."""

    def key(self, request: Request) -> tuple[float]:
        """Arrival time."""
        return (request.arrival_time,)


@attrs.frozen
class PriorityOrder:
    """Lower ``Request.priority`` first; waiting raises a request by ``aging_per_s`` levels a second.

    With ``aging_per_s = 0`` this is vLLM's priority policy: priority, then arrival.
    """

    aging_per_s: float = attrs.field(default=0.0, validator=number(ge=0.0))

    def key(self, request: Request) -> tuple[float, float]:
        """Aged priority, then arrival."""
        return (request.priority + self.aging_per_s * request.arrival_time, request.arrival_time)


@attrs.frozen
class ShortestRemainingPrefill:
    """Shortest prompt first, aged so long prompts are not starved.

    A request counts ``aging_tokens_per_s`` tokens shorter for every second it has waited, so
    a prompt ``L`` tokens longer than a newcomer waits at most ``L / aging_tokens_per_s``
    seconds longer.
    """

    aging_tokens_per_s: float = attrs.field(default=256.0, validator=number(gt=0.0))

    def key(self, request: Request) -> tuple[float, float]:
        """Aged prompt length, then arrival."""
        return (request.prompt_len + self.aging_tokens_per_s * request.arrival_time, request.arrival_time)


@runtime_checkable
class CacheAwareOrder(QueueOrder, Protocol):
    """A queue order that re-ranks waiting requests each step by their cached prefixes.

    ``key`` still fixes the fallback order (and breaks ties); ``rank`` sorts the queue, stably,
    whenever at most ``max_queue_depth`` requests wait. Candidates' ``num_computed`` is what they
    would claim from the prefix cache if admitted now.
    """

    max_queue_depth: int

    def rank(self, candidate: WaitingCandidate) -> Any:
        """The candidate's place this step; smaller first."""
        ...


@attrs.frozen
class LongestPrefixMatch:
    """SGLang's ``lpm``: the request with the most cached prompt tokens first, FCFS past 128 waiting.

    Serving the best-cached request first keeps its prefix from being evicted by others and
    groups requests that share a prefix. Without prefix caching it is FCFS.
    """

    max_queue_depth: int = attrs.field(default=128, validator=whole(ge=0))

    def key(self, request: Request) -> tuple[float]:
        """Arrival time (the fallback and tie-break)."""
        return (request.arrival_time,)

    def rank(self, candidate: WaitingCandidate) -> int:
        """Cached tokens, most first."""
        return -candidate.num_computed


@attrs.frozen
class CacheAwareAging:
    """Fewest *uncached* prompt tokens first, aged so long prompts are not starved.

    :class:`ShortestRemainingPrefill` by the prefill work a request would really cost now: a
    request counts ``aging_tokens_per_s`` tokens shorter for every second it has waited.
    """

    aging_tokens_per_s: float = attrs.field(default=256.0, validator=number(gt=0.0))
    max_queue_depth: int = attrs.field(default=128, validator=whole(ge=0))

    def key(self, request: Request) -> tuple[float, float]:
        """Aged prompt length, then arrival (the fallback)."""
        return (request.prompt_len + self.aging_tokens_per_s * request.arrival_time, request.arrival_time)

    def rank(self, candidate: WaitingCandidate) -> float:
        """Aged uncached tokens."""
        return candidate.remaining + self.aging_tokens_per_s * candidate.request.arrival_time


def rerank(
    candidates: Iterable[WaitingCandidate], num_waiting: int, order: CacheAwareOrder | None
) -> Iterator[WaitingCandidate]:
    """Waiting ``candidates`` (in queue order) in the order a policy sees them this step.

    A cache-aware ``order`` sorts them, stably, by :meth:`CacheAwareOrder.rank` while at most
    its ``max_queue_depth`` wait; otherwise (and without one) they keep the queue's order.
    Sorting an already re-ranked queue again changes nothing, so a host may re-rank freely.
    """
    if order is not None and num_waiting <= order.max_queue_depth:
        return iter(sorted(candidates, key=order.rank))
    return iter(candidates)
