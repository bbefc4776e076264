"""A scheduling policy: the five small strategies the scheduler composes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from phasesched.errors import InvalidArgumentError
from phasesched.policies.budget import TokenBudget
from phasesched.policies.chunking import ChunkSizer, FixedChunk
from phasesched.policies.preemption import PreemptionPolicy
from phasesched.policies.priority import DecodeFirst, PhasePriority
from phasesched.policies.queue_order import FCFS, QueueOrder

__all__ = ["SchedulingPolicy"]


def _kind(kind: type) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A validator: an instance of ``kind`` (for a Protocol: an object with its methods)."""

    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind):
            msg = f"SchedulingPolicy.{attribute.name} must be a {kind.__name__}, got {value!r}"
            raise InvalidArgumentError(msg)

    return check


@attrs.frozen
class SchedulingPolicy:
    """Everything that decides a step, as one immutable value.

    Adding a policy means writing one of these strategies (or a preset that combines them),
    never editing the scheduler. Use :func:`attrs.evolve` to vary one part of a preset.

    Attributes:
        name: A label for reports.
        budget: Token and sequence caps per step.
        chunker: Prefill slice length.
        priority: Order of decodes, ongoing prefills and new prompts within a step.
        queue_order: Order of the waiting queue.
        preemption: Victim choice, and whether waiting requests may preempt.
        enable_prefix_caching: Share the KV of equal prompt prefixes (vLLM's
            ``enable_prefix_caching``): a request admitted with a cached prefix computes, and is
            budgeted and chunked for, only the rest (see :doc:`/explanation/prefix-caching`).

    >>> SchedulingPolicy(name="mine").chunker
    FixedChunk(size=512)

    """

    name: str = attrs.field(default="custom", validator=_kind(str))
    budget: TokenBudget = attrs.field(factory=TokenBudget, validator=_kind(TokenBudget))
    chunker: ChunkSizer = attrs.field(factory=FixedChunk, validator=_kind(ChunkSizer))
    priority: PhasePriority = attrs.field(factory=DecodeFirst, validator=_kind(PhasePriority))
    queue_order: QueueOrder = attrs.field(factory=FCFS, validator=_kind(QueueOrder))
    preemption: PreemptionPolicy = attrs.field(factory=PreemptionPolicy, validator=_kind(PreemptionPolicy))
    enable_prefix_caching: bool = attrs.field(default=False, validator=_kind(bool))
