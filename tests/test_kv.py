"""The paged KV block manager: query/commit pairs, reference counts, no leaks."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from phasesched import OutOfPagesError, PagedKVManager


class TestPagedKVManager:
    def test_grow_allocates_ceil_pages(self) -> None:
        """A table holding n tokens owns ceil(n / page_size) pages."""
        kv = PagedKVManager(num_pages=10, page_size=4)
        slot = kv.open()
        kv.grow_to(slot, 9)
        assert kv.page_count(slot) == 3
        kv.grow_to(slot, 12)
        assert kv.page_count(slot) == 3
        kv.grow_to(slot, 13)
        assert kv.page_count(slot) == 4

    def test_out_of_pages_changes_nothing(self) -> None:
        """A failed commit leaves every table and the free pool as they were."""
        kv = PagedKVManager(num_pages=4, page_size=2)
        a, b = kv.open(), kv.open()
        kv.grow_to(a, 4)
        with pytest.raises(OutOfPagesError) as caught:
            kv.grow_many(np.array([a, b], np.int32), np.array([6, 4], np.int32))
        assert caught.value.requested == 3
        assert caught.value.available == 2
        assert kv.page_count(a) == 2
        assert kv.page_count(b) == 0
        assert kv.num_free_pages == 2
        kv.check_invariants()

    def test_watermark_applies_to_admission_only(self) -> None:
        """Admissions keep the watermark free; running sequences may use it."""
        kv = PagedKVManager(num_pages=10, page_size=1, watermark=0.2)
        assert kv.watermark_pages == 2
        assert kv.can_allocate(8, admission=True)
        assert not kv.can_allocate(9, admission=True)
        assert kv.can_allocate(10)

    def test_fork_shares_full_pages_only(self) -> None:
        """A fork shares whole pages of the prefix and counts the extra references."""
        kv = PagedKVManager(num_pages=8, page_size=4)
        parent = kv.open()
        kv.grow_to(parent, 10)
        child = kv.fork(parent, 10)
        assert kv.page_count(child) == 2
        assert list(kv.pages(child)) == list(kv.pages(parent)[:2])
        assert kv.refcounts[kv.pages(parent)[0]] == 2
        kv.free(parent)
        assert kv.num_used_pages == 2
        kv.free(child)
        assert kv.num_free_pages == 8
        kv.check_invariants()

    def test_free_twice_raises(self) -> None:
        """Freeing a freed table is an error, so pages are never freed twice."""
        kv = PagedKVManager(num_pages=4, page_size=4)
        slot = kv.open()
        kv.free(slot)
        with pytest.raises(KeyError):
            kv.free(slot)

    def test_gather_matches_tables(self) -> None:
        """gather() concatenates each slot's first pages in order."""
        kv = PagedKVManager(num_pages=32, page_size=2)
        slots = [kv.open() for _ in range(3)]
        for slot, n in zip(slots, [5, 1, 8], strict=True):
            kv.grow_to(slot, n)
        indptr, indices = kv.gather(np.array(slots, np.int32), np.array([3, 1, 2], np.int32))
        assert indptr.tolist() == [0, 3, 4, 6]
        expected = [*kv.pages(slots[0]), *kv.pages(slots[1]), *kv.pages(slots[2])[:2]]
        assert indices.tolist() == [int(p) for p in expected]

    def test_tables_grow_past_initial_capacity(self) -> None:
        """Rows and columns grow on demand without losing pages."""
        kv = PagedKVManager(num_pages=4096, page_size=1)
        slots = [kv.open() for _ in range(40)]
        for slot in slots:
            kv.grow_to(slot, 50)
        assert all(kv.page_count(s) == 50 for s in slots)
        kv.check_invariants()

    @pytest.mark.parametrize(("pages", "size", "watermark"), [(0, 4, 0.0), (4, 0, 0.0), (4, 4, 1.0), (4, 4, -0.1)])
    def test_rejects_bad_geometry(self, pages: int, size: int, watermark: float) -> None:
        """Non-positive sizes and a watermark outside [0, 1) are rejected."""
        with pytest.raises(ValueError):
            PagedKVManager(pages, size, watermark=watermark)


class KVMachine(RuleBasedStateMachine):
    """Random opens, grows, forks and frees: pages are conserved and never owned twice."""

    tables = Bundle("tables")

    def __init__(self) -> None:
        super().__init__()
        self.kv = PagedKVManager(num_pages=48, page_size=3)
        self.tokens: dict[int, int] = {}

    @rule(target=tables)
    def open(self) -> int:
        slot = self.kv.open()
        self.tokens[slot] = 0
        return slot

    @rule(slot=tables, extra=st.integers(0, 20))
    def grow(self, slot: int, extra: int) -> None:
        if slot not in self.tokens:
            return
        free_before = self.kv.num_free_pages
        count_before = self.kv.page_count(slot)
        want = self.tokens[slot] + extra
        try:
            self.kv.grow_to(slot, want)
        except OutOfPagesError:
            assert self.kv.num_free_pages == free_before
            assert self.kv.page_count(slot) == count_before
            return
        self.tokens[slot] = want
        assert self.kv.page_count(slot) >= -(-want // 3)

    @rule(target=tables, slot=tables, upto=st.integers(0, 30))
    def fork(self, slot: int, upto: int) -> int:
        if slot not in self.tokens:
            return cast("int", self.open())  # rule() types the method's result as int | MultipleResults[int]
        child = self.kv.fork(slot, min(upto, self.tokens[slot]))
        self.tokens[child] = self.kv.page_count(child) * 3
        return child

    @precondition(lambda self: bool(self.tokens))
    @rule(slot=consumes(tables))
    def close(self, slot: int) -> None:
        if slot in self.tokens:
            self.kv.free(slot)
            del self.tokens[slot]

    @invariant()
    def conserved(self) -> None:
        self.kv.check_invariants()
        assert self.kv.num_free_pages + self.kv.num_used_pages == self.kv.num_pages


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=12))
@settings(deadline=None, max_examples=50)
def test_grow_many_equals_grow_one_by_one(lengths: list[int]) -> None:
    """Vectorized growth allocates exactly what growing each table alone would."""
    one, many = PagedKVManager(512, 4), PagedKVManager(512, 4)
    slots_one = [one.open() for _ in lengths]
    slots_many = np.array([many.open() for _ in lengths], np.int32)
    for slot, n in zip(slots_one, lengths, strict=True):
        one.grow_to(slot, n)
    many.grow_many(slots_many, np.array(lengths, np.int32))
    assert [one.page_count(s) for s in slots_one] == [many.page_count(int(s)) for s in slots_many]
    assert one.num_free_pages == many.num_free_pages
    many.check_invariants()
