"""Queue order: which waiting request is considered first.

Each order gives a request a sort key once, when it arrives, and the waiting queue keeps it for
the request's whole life. Aging that grows linearly with waiting time needs no re-sorting:
``score - rate * (now - arrival)`` orders requests exactly as ``score + rate * arrival`` does,
since ``rate * now`` is the same for everyone. A preempted request re-enters under its original
key, so it keeps its place instead of queuing behind requests that arrived after it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs

from phasesched.request import Request
from phasesched.validators import number

__all__ = ["FCFS", "PriorityOrder", "QueueOrder", "ShortestRemainingPrefill"]


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
