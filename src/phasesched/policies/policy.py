"""A scheduling policy: the five small strategies the scheduler composes."""

from __future__ import annotations

import attrs

from phasesched.policies.budget import TokenBudget
from phasesched.policies.chunking import ChunkSizer, FixedChunk
from phasesched.policies.preemption import PreemptionPolicy
from phasesched.policies.priority import DecodeFirst, PhasePriority
from phasesched.policies.queue_order import FCFS, QueueOrder

__all__ = ["SchedulingPolicy"]


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

    >>> SchedulingPolicy(name="mine").chunker
    FixedChunk(size=512)

    """

    name: str = "custom"
    budget: TokenBudget = attrs.field(factory=TokenBudget)
    chunker: ChunkSizer = attrs.field(factory=FixedChunk)
    priority: PhasePriority = attrs.field(factory=DecodeFirst)
    queue_order: QueueOrder = attrs.field(factory=FCFS)
    preemption: PreemptionPolicy = attrs.field(factory=PreemptionPolicy)
