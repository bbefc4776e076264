"""Scheduling policies: small composable strategies, and presets that combine them.

A phase priority fills a :class:`BatchBuilder` (exported here with its :class:`AddResult`): it is
the API a third-party priority plans a step with.
"""

from __future__ import annotations

from phasesched.policies.budget import TokenBudget as TokenBudget
from phasesched.policies.builder import AddResult as AddResult
from phasesched.policies.builder import BatchBuilder as BatchBuilder
from phasesched.policies.chunking import ChunkContext as ChunkContext
from phasesched.policies.chunking import ChunkSizer as ChunkSizer
from phasesched.policies.chunking import FixedChunk as FixedChunk
from phasesched.policies.chunking import LongPrefillThreshold as LongPrefillThreshold
from phasesched.policies.chunking import NoChunking as NoChunking
from phasesched.policies.chunking import PrefillCandidate as PrefillCandidate
from phasesched.policies.chunking import SLOAdaptiveChunk as SLOAdaptiveChunk
from phasesched.policies.policy import SchedulingPolicy as SchedulingPolicy
from phasesched.policies.preemption import FewestGenerated as FewestGenerated
from phasesched.policies.preemption import LatestArrival as LatestArrival
from phasesched.policies.preemption import LowestPriority as LowestPriority
from phasesched.policies.preemption import PreemptionPolicy as PreemptionPolicy
from phasesched.policies.preemption import VictimOrder as VictimOrder
from phasesched.policies.presets import PolicyOptions as PolicyOptions
from phasesched.policies.priority import DecodeFirst as DecodeFirst
from phasesched.policies.priority import EqualProgress as EqualProgress
from phasesched.policies.priority import PhasePriority as PhasePriority
from phasesched.policies.priority import PrefillFirst as PrefillFirst
from phasesched.policies.queue_order import FCFS as FCFS
from phasesched.policies.queue_order import CacheAwareAging as CacheAwareAging
from phasesched.policies.queue_order import CacheAwareOrder as CacheAwareOrder
from phasesched.policies.queue_order import LongestPrefixMatch as LongestPrefixMatch
from phasesched.policies.queue_order import PriorityOrder as PriorityOrder
from phasesched.policies.queue_order import QueueOrder as QueueOrder
from phasesched.policies.queue_order import ShortestRemainingPrefill as ShortestRemainingPrefill

__all__ = [
    "FCFS",
    "AddResult",
    "BatchBuilder",
    "CacheAwareAging",
    "CacheAwareOrder",
    "ChunkContext",
    "ChunkSizer",
    "DecodeFirst",
    "EqualProgress",
    "FewestGenerated",
    "FixedChunk",
    "LatestArrival",
    "LongPrefillThreshold",
    "LongestPrefixMatch",
    "LowestPriority",
    "NoChunking",
    "PhasePriority",
    "PolicyOptions",
    "PreemptionPolicy",
    "PrefillCandidate",
    "PrefillFirst",
    "PriorityOrder",
    "QueueOrder",
    "SLOAdaptiveChunk",
    "SchedulingPolicy",
    "ShortestRemainingPrefill",
    "TokenBudget",
    "VictimOrder",
]
