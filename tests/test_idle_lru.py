"""The prefix cache's idle LRU (numpy arrays, lazy deletion) against an ordered-dict model of it.

The LRU is parked, claimed from and evicted in calls, some of which are rolled back newest
first as the scheduler's journal does; after every call it must hold the model's pages in the
model's order (least recently released first). Few pages and many calls make the arrays
compact often, so entries dropped by a compaction or passed by an eviction must come back when
a rollback restores them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched.prefix_cache import _IdleQueue

NUM_PAGES = 12


class Model:
    """The LRU as an ordered dict of page -> stamp, least recent first (the implementation before numpy)."""

    def __init__(self) -> None:
        self.idle: OrderedDict[int, int] = OrderedDict()
        self.stamp = 0

    def push(self, pages: list[int]) -> None:
        for page in pages:
            self.stamp += 1
            self.idle[page] = self.stamp

    def take(self, pages: list[int]) -> list[int]:
        return [self.idle.pop(page) for page in pages]

    def take_oldest(self, count: int) -> tuple[list[int], list[int]]:
        pages = list(self.idle)[:count]
        return pages, self.take(pages)

    def restore(self, pages: list[int], stamps: list[int]) -> None:
        self.idle.update(zip(pages, stamps, strict=True))
        self.idle = OrderedDict(sorted(self.idle.items(), key=lambda item: item[1]))


Op = tuple[str, int]
ops = st.lists(st.tuples(st.sampled_from(["push", "take", "evict", "peek"]), st.integers(0, 3)), min_size=1, max_size=4)
calls = st.lists(st.tuples(ops, st.booleans()), min_size=1, max_size=60)


def apply(op: Op, queue: _IdleQueue, model: Model, rng: np.random.Generator) -> Callable[[], None] | None:
    """Apply one operation to both; return the undo of both (``None`` if it did nothing)."""
    kind, amount = op
    idle = list(model.idle)
    if kind == "peek":  # what an eviction would take (the queue keeps the answer until it changes)
        count = min(amount, len(idle))
        if count:
            assert queue.oldest(count)[0].tolist() == idle[:count]
        return None
    if kind == "push":
        busy = sorted(set(range(NUM_PAGES)) - set(idle))
        pages = [int(p) for p in rng.permutation(busy)[: min(amount, len(busy))]]
        if not pages:
            return None
        queue.push(np.array(pages, dtype=np.int32))
        model.push(pages)

        def unpush() -> None:  # kv.unfree's undo of a park
            queue.take(np.array(pages, dtype=np.int32))
            model.take(pages)

        return unpush
    if kind == "take":
        pages = [int(p) for p in rng.permutation(idle)[: min(amount, len(idle))]]
        if not pages:
            return None
        taken, stamps = np.array(pages, dtype=np.int32), queue.take(np.array(pages, dtype=np.int32))
        assert stamps.tolist() == model.take(pages)
    else:
        count = min(amount, len(idle))
        if not count:
            return None
        taken, stamps = queue.take_oldest(count)
        pages, model_stamps = model.take_oldest(count)
        assert (taken.tolist(), stamps.tolist()) == (pages, model_stamps)

    def restore() -> None:  # unclaim's or unevict's undo
        queue.restore(taken, stamps)
        model.restore(pages, stamps.tolist())

    return restore


@given(calls=calls, seed=st.integers(0, 2**16))
@settings(max_examples=1000, deadline=None)
def test_the_idle_lru_keeps_the_models_order_through_rollbacks(calls: list[tuple[list[Op], bool]], seed: int) -> None:
    queue, model, rng = _IdleQueue(NUM_PAGES), Model(), np.random.default_rng(seed)
    for call, rolled_back in calls:
        undo = [u for u in (apply(op, queue, model, rng) for op in call) if u is not None]
        if rolled_back:
            for step in reversed(undo):
                step()
        assert queue.live().tolist() == list(model.idle)
        assert queue.count == len(model.idle)
        assert (queue.stamp_of > 0).sum() == queue.count


def test_a_rollback_brings_back_entries_a_compaction_dropped() -> None:
    """A claim rolled back after pushes compacted its entry away still returns to its old place."""
    queue = _IdleQueue(2)
    queue.push(np.array([0, 1], dtype=np.int32))
    stamps = queue.take(np.array([0], dtype=np.int32))
    for _ in range(200):  # enough pushes of page 1 to compact the arrays, dropping page 0's dead entry
        queue.take(np.array([1], dtype=np.int32))
        queue.push(np.array([1], dtype=np.int32))
    queue.restore(np.array([0], dtype=np.int32), stamps)
    assert queue.live().tolist() == [0, 1]
    assert queue.take_oldest(1)[0].tolist() == [0]
