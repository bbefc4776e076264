"""Preemption: whom to evict when KV pages or sequence slots run out.

Eviction is by recompute: the victim's pages are freed, it returns to the waiting queue under
its original key, and when it resumes its prompt and the tokens it had generated are prefilled
again. Which running request to evict is a policy (:class:`VictimOrder`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError

if TYPE_CHECKING:
    from phasesched.view import SchedulerView

__all__ = ["FewestGenerated", "LatestArrival", "LowestPriority", "PreemptionPolicy", "VictimOrder"]

Int32Array = NDArray[np.int32]


@runtime_checkable
class VictimOrder(Protocol):
    """Orders running requests from most to least preemptible."""

    def order(self, view: SchedulerView, slots: Int32Array) -> Int32Array:
        """``slots`` re-ordered, best victim first.

        Args:
            view: The scheduler's state; its per-slot arrays are indexed by ``slots``.
            slots: int32 ``[K]``: slots of the running requests that may be preempted.

        Returns:
            int32 ``[K]``: the same slots, best victim first (a permutation of ``slots``).
        """
        ...


@attrs.frozen
class LatestArrival:
    """Evict the most recent arrival first (vLLM's FCFS behaviour: last in, first out)."""

    def order(self, view: SchedulerView, slots: Int32Array) -> Int32Array:
        """Latest arrival first; ties by place in ``slots``, last first.

        The batch builder passes running requests in admission order, so a tie goes to the
        latest admitted, as vLLM pops its running list's tail. Slot numbers are not used: a
        host numbers its slots its own way (phasesched's scheduler reuses freed ones), and the
        victim must not depend on that.

        Returns:
            int32 ``[K]``: ``slots`` (int32 ``[K]``) re-ordered.
        """
        return slots[self.rank(view.arrival_time[slots])]

    @staticmethod
    def rank(arrival_time: NDArray[np.float64]) -> NDArray[np.intp]:
        """Places in ``arrival_time`` (requests in admission order), best victim first.

        Dropping some places leaves the rest in the same order: the victims of successive
        preemptions are this ranking's first, second, ... (the scheduler's known steps rely on it).
        """
        return np.lexsort((-np.arange(len(arrival_time)), -arrival_time))


@attrs.frozen
class LowestPriority:
    """Evict the least important request first (highest priority value), then the latest."""

    def order(self, view: SchedulerView, slots: Int32Array) -> Int32Array:
        """Highest priority value first, then latest arrival.

        Returns:
            int32 ``[K]``: ``slots`` (int32 ``[K]``) re-ordered.
        """
        return slots[np.lexsort((-view.arrival_time[slots], -view.priority[slots]))]


@attrs.frozen
class FewestGenerated:
    """Evict the request that has generated least, so the least finished work is redone."""

    def order(self, view: SchedulerView, slots: Int32Array) -> Int32Array:
        """Fewest generated tokens first, then latest arrival.

        Returns:
            int32 ``[K]``: ``slots`` (int32 ``[K]``) re-ordered.
        """
        return slots[np.lexsort((-view.arrival_time[slots], view.num_generated[slots]))]


def _victim_order(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, VictimOrder):
        msg = f"PreemptionPolicy.{attribute.name} must be a VictimOrder (an object with order()), got {value!r}"
        raise InvalidArgumentError(msg)


def _boolean(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, (bool, np.bool_)):
        msg = f"PreemptionPolicy.{attribute.name} must be a bool, got {value!r}"
        raise InvalidArgumentError(msg)


@attrs.frozen
class PreemptionPolicy:
    """How the scheduler preempts.

    Attributes:
        victims: Which running request goes first.
        preempt_for_waiting: Whether a waiting request may evict running requests it outranks
            (strictly lower ``priority`` value) when the sequence cap or KV memory keeps it out.
            Running requests that run short of KV always preempt.

    """

    victims: VictimOrder = attrs.field(factory=LatestArrival, validator=_victim_order)
    preempt_for_waiting: bool = attrs.field(default=False, validator=_boolean)
