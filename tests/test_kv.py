"""The paged KV block manager: query/commit pairs, reference counts, no leaks."""

from __future__ import annotations

import copy
import errno
import itertools
import mmap
import os
import pickle
import random
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule
from numpy.typing import NDArray

import phasesched.kv
import phasesched.running
from phasesched import (
    InvalidArgumentError,
    KVView,
    OutOfPagesError,
    PagedKVManager,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    StepResult,
    mapped,
)
from phasesched.kv import _parents
from phasesched.policies import TokenBudget
from phasesched.prefix import ROOT_HASH, extend_page_hashes
from phasesched.running import TokenBuffer


def page_hashes(tokens: list[int], page_size: int) -> list[int]:
    """Chained hashes of the full pages of ``tokens``."""
    hashes: list[int] = []
    extend_page_hashes(hashes, tokens, page_size, len(tokens) // page_size)
    return hashes


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

    def test_claim_shares_cached_pages(self) -> None:
        """A table claims the cached pages of its prefix; they are shared and counted twice."""
        kv = PagedKVManager(num_pages=8, page_size=4, enable_prefix_caching=True)
        hashes = page_hashes(list(range(10)), 4)
        parent = kv.open()
        kv.grow_to(parent, 10)
        kv.register(parent, hashes)
        child = kv.open()
        assert kv.cached_prefix(hashes, 8) == 2
        kv.claim(child, hashes, 2, queried=2)
        assert list(kv.pages(child)) == list(kv.pages(parent)[:2])
        assert kv.refcounts[kv.pages(parent)[0]] == 2
        kv.free(parent)
        assert (kv.num_used_pages, kv.num_cached_pages) == (2, 0)
        kv.free(child)
        assert (kv.num_free_pages, kv.num_cached_pages) == (8, 2)
        assert kv.cache_stats.hits == 2
        kv.check_invariants()

    def test_idle_pages_are_evicted_least_recent_first(self) -> None:
        """Freed hashed pages stay cached until fresh pages run out; the oldest go first."""
        kv = PagedKVManager(num_pages=4, page_size=2, enable_prefix_caching=True)
        old, new = kv.open(), kv.open()
        for slot, first in ((old, 0), (new, 100)):
            kv.grow_to(slot, 4)
            kv.register(slot, page_hashes(list(range(first, first + 4)), 2))
        kv.free(old)
        kv.free(new)
        assert kv.num_cached_pages == 4
        slot = kv.open()
        kv.grow_to(slot, 4)
        assert kv.cached_prefix(page_hashes([0, 1, 2, 3], 2), 2) == 0
        assert kv.cached_prefix(page_hashes([100, 101, 102, 103], 2), 2) == 2
        assert kv.cache_stats.evictions == 2
        kv.check_invariants()

    def test_eviction_takes_a_freed_chain_from_its_tail(self) -> None:
        """Evicting part of a freed chain drops its last pages, so the rest stays a claimable prefix."""
        kv = PagedKVManager(num_pages=4, page_size=2, enable_prefix_caching=True)
        hashes = page_hashes(list(range(8)), 2)
        slot = kv.open()
        kv.grow_to(slot, 8)
        kv.register(slot, hashes)
        head_first = [int(p) for p in kv.pages(slot)]
        kv.free(slot)
        assert kv.idle_cached_pages() == head_first[::-1]
        kv.grow_to(kv.open(), 2)  # one fresh page: the plain pool is empty, so one idle page goes
        assert kv.cached_prefix(hashes, 4) == 3
        assert kv.idle_cached_pages() == head_first[2::-1]
        kv.check_invariants()

    def test_tables_freed_together_park_children_before_parents(self) -> None:
        """Two tables sharing a prefix, freed in one call: both tails idle ahead of the shared pages."""
        kv = PagedKVManager(num_pages=4, page_size=2, enable_prefix_caching=True)
        streams = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 9, 9]]
        first = kv.open()
        kv.grow_to(first, 6)
        kv.register(first, page_hashes(streams[0], 2))
        second = kv.open()
        kv.claim(second, page_hashes(streams[1], 2), 2, queried=3)
        kv.grow_to(second, 6)
        kv.register(second, page_hashes(streams[1], 2)[2:])  # its first two pages are claimed, named
        shared = [int(p) for p in kv.pages(first)[:2]]
        tails = {int(kv.pages(first)[2]), int(kv.pages(second)[2])}
        kv.free_many(np.array([first, second], np.int32))
        idle = kv.idle_cached_pages()
        assert set(idle[:2]) == tails
        assert idle[2:] == shared[::-1]
        kv.grow_to(kv.open(), 4)  # two fresh pages: both tails go, the shared prefix stays
        assert [kv.cached_prefix(page_hashes(s, 2), 3) for s in streams] == [2, 2]
        kv.check_invariants()

    def test_retract_and_unevict_restore_the_cache(self) -> None:
        """Undoing a growth that evicted puts the evicted pages back in the cache, in their place."""
        kv = PagedKVManager(num_pages=3, page_size=2, enable_prefix_caching=True)
        donor = kv.open()
        kv.grow_to(donor, 6)
        kv.register(donor, page_hashes(list(range(6)), 2))
        kv.free(donor)
        before = (kv.cached_prefix(page_hashes(list(range(6)), 2), 3), kv.num_free_pages, kv.cache_stats)
        slot = kv.open()
        evicted = kv.extend_many(np.array([slot], np.int32), np.array([2], np.int64))
        kv.retract(np.array([slot], np.int32), np.array([0], np.int32))
        kv.unevict(evicted)
        assert (kv.cached_prefix(page_hashes(list(range(6)), 2), 3), kv.num_free_pages, kv.cache_stats) == before
        kv.check_invariants()

    @given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 5)), min_size=1, max_size=8))
    def test_next_slots_are_the_slots_open_returns(self, rounds: list[tuple[int, int]]) -> None:
        """``next_slots(n)`` names the slots the next n ``open()`` calls hand out; asking changes nothing."""
        kv, twin = PagedKVManager(num_pages=4, page_size=4), PagedKVManager(num_pages=4, page_size=4)
        opened: list[int] = []
        for count, freed in rounds:
            named = kv.next_slots(count).tolist()
            opened += [kv.open() for _ in range(count)]
            assert named == opened[len(opened) - count :]
            assert named == [twin.open() for _ in range(count)]  # asking changed nothing
            if freed and opened:
                kv.free_many(np.array(opened[-freed:], np.int32))
                twin.free_many(np.array(opened[-freed:], np.int32))
                del opened[-freed:]
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
    """Random opens (claiming cached prefixes), grows, frees and undone growths, with prefix caching on.

    Sequences are prefixes of a few shared token streams, so tables share pages and freed pages
    stay cached. Pages are conserved (plain free + referenced + idle cached = total), reference
    counts match the tables, and a claimed page holds exactly the tokens its hash names.
    """

    tables = Bundle("tables")
    PAGE = 3

    def __init__(self) -> None:
        super().__init__()
        self.kv = PagedKVManager(num_pages=24, page_size=self.PAGE, enable_prefix_caching=True)
        self.streams = [[s * 1000 + i for i in range(60)] for s in range(3)]
        self.tokens: dict[int, tuple[list[int], int]] = {}  # slot -> (its stream, tokens held)
        self.content: dict[int, tuple[int, ...]] = {}  # page -> tokens written into it
        self.opened = 0

    @rule(target=tables, stream=st.integers(0, 2), fork_at=st.integers(0, 40), tail=st.integers(0, 9))
    def open(self, stream: int, fork_at: int, tail: int) -> int:
        """Open a table for a stream's first ``fork_at`` tokens and a private tail, claiming what is cached."""
        self.opened += 1
        private = range(10**6 * self.opened, 10**6 * self.opened + tail)  # a tail no other table has
        tokens = [*self.streams[stream][:fork_at], *private]
        slot = self.kv.open()
        hashes = page_hashes(tokens, self.PAGE)
        hit = self.kv.cached_prefix(hashes, len(hashes))
        self.kv.claim(slot, hashes, hit, queried=len(hashes))
        for i, page in enumerate(self.kv.pages(slot).tolist()):
            assert self.content[page] == tuple(tokens[i * self.PAGE : (i + 1) * self.PAGE]), "a claim gave wrong KV"
        self.tokens[slot] = (tokens, hit * self.PAGE)
        return slot

    @rule(slot=tables, extra=st.integers(0, 12))
    def grow(self, slot: int, extra: int) -> None:
        """Compute ``extra`` more tokens of a table and register the pages that filled."""
        if slot not in self.tokens:
            return
        tokens, held = self.tokens[slot]
        want = min(held + extra, len(tokens))
        free_before = self.kv.num_free_pages
        try:
            self.kv.grow_to(slot, want)
        except OutOfPagesError:
            assert self.kv.num_free_pages == free_before
            return
        pages = self.kv.pages(slot).tolist()
        due = int(self.kv.pages_to_hash(np.array([slot], np.int32), np.array([want], np.int32))[0])
        first = want // self.PAGE - due
        for i in range(first, first + due):
            self.content[pages[i]] = tuple(tokens[i * self.PAGE : (i + 1) * self.PAGE])
        self.kv.register(slot, page_hashes(tokens, self.PAGE)[first : first + due])
        self.tokens[slot] = (tokens, want)

    @rule(picked=st.sets(tables, min_size=1, max_size=4))
    def one_page_each(self, picked: set[int]) -> None:
        """``extend_each`` adds a page to each table, free ones first, then the oldest idle; undone, nothing changed."""
        kv, slots = self.kv, np.array(sorted(s for s in picked if s in self.tokens), np.int32)
        if not len(slots):
            return
        idle, evictions = kv.idle_cached_pages(), kv.cache_stats.evictions
        free = set(range(kv.num_pages)) - set(np.flatnonzero(kv.refcounts).tolist()) - set(idle)
        before = (kv.num_free_pages, idle, kv.refcounts.tolist())
        counts = kv.page_counts[slots]
        try:
            evicted = kv.extend_each(slots)
        except OutOfPagesError:
            assert (kv.num_free_pages, kv.idle_cached_pages(), kv.refcounts.tolist()) == before
            return
        kv.check_invariants()
        assert kv.page_counts[slots].tolist() == (counts + 1).tolist()
        new = [int(kv.pages(int(s))[-1]) for s in slots]
        assert len(set(new)) == len(new)
        assert all(kv.refcounts[p] == 1 for p in new)
        oldest = idle[: max(len(new) - len(free), 0)]
        assert set(new) == set(oldest) | (set(new) & free)
        assert (kv.idle_cached_pages(), kv.cache_stats.evictions) == (idle[len(oldest) :], evictions + len(oldest))
        kv.retract(slots, counts)
        kv.unevict(evicted)
        assert (kv.num_free_pages, kv.idle_cached_pages(), kv.refcounts.tolist()) == before

    @rule(slot=tables, extra=st.integers(1, 30))
    def undone_growth(self, slot: int, extra: int) -> None:
        """A growth undone (retract, then unevict) leaves the cache exactly as it was."""
        if slot not in self.tokens:
            return
        kv, slots = self.kv, np.array([slot], np.int32)
        before = (kv.num_free_pages, kv.num_cached_pages, kv.cache_stats, kv.refcounts.tolist())
        probes = [kv.cached_prefix(page_hashes(s, self.PAGE), 99) for s in self.streams]
        counts = kv.page_counts[slots]
        try:
            evicted = kv.extend_many(slots, np.array([extra], np.int64))
        except OutOfPagesError:
            return
        kv.retract(slots, counts)
        kv.unevict(evicted)
        assert (kv.num_free_pages, kv.num_cached_pages, kv.cache_stats, kv.refcounts.tolist()) == before
        assert [kv.cached_prefix(page_hashes(s, self.PAGE), 99) for s in self.streams] == probes

    @precondition(lambda self: bool(self.tokens))
    @rule(slot=consumes(tables))
    def close(self, slot: int) -> None:
        """Free a table; its hashed pages stay cached."""
        if slot in self.tokens:
            self.kv.free(slot)
            del self.tokens[slot]

    @invariant()
    def conserved(self) -> None:
        """Pages are conserved and reference counts match the tables."""
        kv = self.kv
        kv.check_invariants()
        assert kv.num_free_pages + kv.num_used_pages == kv.num_pages
        assert kv.num_cached_pages <= kv.num_free_pages


TestKVMachine = KVMachine.TestCase
# Four of the five rules take a table, and closing consumes them: while the bundle is empty,
# Hypothesis rejects those rules' draws, and its filter health check failed about one run in ten.
TestKVMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@given(
    held=st.lists(st.integers(0, 6), min_size=2, max_size=8),
    need=st.lists(st.integers(0, 2), min_size=2, max_size=8),
    run=st.integers(1, 40),
    idle=st.integers(0, 60),
    spare=st.integers(0, 30),
    shuffle=st.randoms(use_true_random=False),
)
@settings(deadline=None, max_examples=150)
def test_extend_many_hands_out_the_pool_in_slot_order(
    held: list[int], need: list[int], run: int, idle: int, spare: int, shuffle: random.Random
) -> None:
    """Every shape of growth takes the pool's top pages, evicting the oldest idle ones first, in slot order.

    The model is the pool as a stack: evicted pages go on top in eviction order, the pages taken
    come off the top, and table ``slots[i]`` gets the next ``need[i]`` of them. Ending ``need``
    with a long run after single pages is the shape of decodes beside a prefill chunk, which
    ``extend_many`` fills without a general layout; the other draws take the general path.
    """
    count = min(len(held), len(need))
    held, need = held[:count], [*need[: count - 1], run]
    kv = PagedKVManager(256, 4, enable_prefix_caching=True)
    opened = [kv.open() for _ in held]
    shuffle.shuffle(opened)  # tables in any order, not only as they were opened
    slots = np.array(opened, np.int32)
    kv.extend_many(slots, np.array(held, np.int64))
    parked = kv.open()  # pages it names, then frees: idle in the cache, evicted oldest first
    kv.extend_many(np.array([parked], np.int32), np.array([idle], np.int64))
    kv.register(parked, [1000 + page for page in range(idle)])
    kv.free(parked)
    kv.extend_many(np.array([kv.open()], np.int32), np.array([max(kv.num_free_pages - idle - spare, 0)], np.int64))
    pool = kv._free[: kv._num_free].tolist()  # bottom to top
    total = sum(need)
    if total > kv.num_free_pages:
        return
    evicting = kv.idle_cached_pages()[: max(total - len(pool), 0)]
    stack = pool + evicting
    taken = stack[len(stack) - total :][::-1]
    before = {int(slot): kv.pages(int(slot)).tolist() for slot in slots}
    kv.extend_many(slots, np.array(need, np.int64))
    at = 0
    for slot, n in zip(slots.tolist(), need, strict=True):
        assert kv.pages(slot).tolist() == before[slot] + taken[at : at + n]
        at += n
    assert kv.cache_stats.evictions == len(evicting)
    kv.check_invariants()


@given(
    first=st.lists(st.integers(0, 3), min_size=2, max_size=6),
    offered=st.lists(st.integers(0, 1), min_size=2, max_size=6),
    run=st.integers(0, 12),
    values=st.integers(1, 40),
    unknown=st.lists(st.integers(0, 2), min_size=6, max_size=6),
)
@settings(deadline=None, max_examples=150)
def test_register_many_names_what_registering_each_table_in_turn_names(
    first: list[int], offered: list[int], run: int, values: int, unknown: list[int]
) -> None:
    """Offering several tables' pages at once names the pages that offering them table by table names.

    Hashes come from a small set, so some repeat within and across tables (the first copy is
    named). Ending ``offered`` with a run after single pages is the shape of decodes beside a
    prefill chunk, which ``register_many`` gathers without a general layout. A table's last
    ``unknown`` pages offered have no hash (content past what is known): they stay unnamed.
    """
    count = min(len(first), len(offered))
    first, offered = first[:count], [*offered[: count - 1], run]
    managers = [PagedKVManager(128, 2, enable_prefix_caching=True) for _ in range(2)]
    hashes = [
        [1 + (7 * table + 3 * page) % values for page in range(f + n)]
        for table, (f, n) in enumerate(zip(first, offered, strict=True))
    ]
    slots = np.zeros(0, np.int32)
    for kv in managers:
        slots = np.array([kv.open() for _ in range(count)], np.int32)
        kv.extend_many(slots, np.array([len(h) for h in hashes], np.int64))
        for slot, known, pages in zip(slots.tolist(), hashes, first, strict=True):
            kv.register(slot, known[:pages])
    cuts = zip(hashes, unknown[:count], first, strict=True)
    hashes = [known[: max(len(known) - cut, done)] for known, cut, done in cuts]
    together, in_turn = managers
    together.register_many(slots, hashes, np.array(offered, np.int64))
    for slot, known, done, pages in zip(slots.tolist(), hashes, first, offered, strict=True):
        in_turn.register(slot, known[done : done + pages], pages)  # the pages offered: those after the ones named
    prefixes = [known[:end] for known in hashes for end in range(1, len(known) + 1)]
    assert together._cache is not None
    assert in_turn._cache is not None
    # The pages each prefix names, not only how many: the same pages must carry the same hashes.
    assert [together._cache.lookup(p) for p in prefixes] == [in_turn._cache.lookup(p) for p in prefixes]
    assert together.cache_stats == in_turn.cache_stats


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


class TestKVView:
    MUTATORS = ("open", "grow_to", "grow_many", "extend_many", "retract", "free", "free_many", "claim", "register")

    def test_the_scheduler_shows_its_pages_read_only(self) -> None:
        """Scheduler.kv answers queries, has no method that changes a table, and gives read-only arrays."""
        policy = SchedulingPolicy(budget=TokenBudget(max_num_batched_tokens=64), enable_prefix_caching=True)
        scheduler = Scheduler(SchedulerConfig(num_pages=16, page_size=4, watermark=0.25), policy)
        scheduler.add_request(Request("a", prompt_token_ids=list(range(10)), max_new_tokens=4))
        plan = scheduler.schedule()
        view, manager = scheduler.kv, scheduler._kv
        assert isinstance(view, KVView)
        assert not [name for name in self.MUTATORS if hasattr(view, name)]
        slot = int(plan.slots[0])
        assert (view.num_free_pages, view.num_used_pages, view.watermark_pages) == (13, 3, 4)
        assert (view.page_size, view.num_pages, view.pages_for(9), view.prefix_caching) == (4, 16, 3, True)
        assert view.pages(slot).tolist() == manager.pages(slot).tolist()
        assert view.pages_to_grow(plan.slots, np.array([13], np.int32)).tolist() == [1]
        assert view.cache_stats == manager.cache_stats
        for array in (view.pages(slot), view.page_counts, view.refcounts):
            with pytest.raises(ValueError, match="read-only"):
                array[0] = 99
        with pytest.raises(AttributeError):
            view.page_size = 8  # type: ignore[misc]


class TestPageHashes:
    @given(
        tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=200),
        page_size=st.sampled_from([1, 3, 4, 16]),
        split=st.integers(0, 12),
    )
    @settings(max_examples=200, deadline=None)
    def test_hashing_in_parts_or_from_the_buffer_gives_the_same_chain(
        self, tokens: list[int], page_size: int, split: int
    ) -> None:
        """Pages hashed at once, in two calls, or page by page from the token buffer name the same chain.

        The buffer path views fixed-width records when its width is a multiple of the page
        size, and gathers otherwise (page sizes 3 and 16 against its 64-wide rows test both).
        """
        full = len(tokens) // page_size
        whole = page_hashes(tokens, page_size)
        first = min(split, full)
        parts: list[int] = []
        extend_page_hashes(parts, tokens[: first * page_size], page_size, first)
        extend_page_hashes(parts, tokens[first * page_size :], page_size, full, offset=first * page_size)
        assert parts == whole
        buffer = TokenBuffer()
        buffer.load(2, tuple(tokens), [])
        one_by_one: list[int] = []
        for page in range(full):
            (content,) = buffer.pages(np.array([2], np.int32), np.array([page], np.int32), page_size)
            one_by_one.append(hash((one_by_one[-1] if one_by_one else ROOT_HASH, content)))
        assert one_by_one == whole

    def test_different_prefixes_name_different_pages(self) -> None:
        """Equal page contents after different prefixes hash apart: a hash names the whole prefix."""
        a = page_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
        b = page_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
        assert a[1] != b[1]
        assert page_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4) == a


@given(
    tables=st.lists(
        st.tuples(st.lists(st.integers(1, 2**62), max_size=6), st.integers(0, 6), st.integers(0, 6)), max_size=5
    )
)
def test_the_parent_of_each_named_page_is_the_page_before_it(tables: list[tuple[list[int], int, int]]) -> None:
    """``register_many``'s parents: the previous page's hash in the same table, the root for a first page."""
    page_hashes = [hashes for hashes, _, _ in tables]
    first = [min(f, len(hashes)) for hashes, f, _ in tables]
    named = [hashes[f : f + n] for (hashes, _, n), f in zip(tables, first, strict=True)]
    flat = [h for run in named for h in run]
    expected = [
        hashes[f + i - 1] if f + i else ROOT_HASH
        for hashes, f, run in zip(page_hashes, first, named, strict=True)
        for i in range(len(run))
    ]
    assert _parents(page_hashes, first, named, np.array(flat, dtype=np.int64)).tolist() == expected


token_ops = st.lists(
    st.one_of(
        st.tuples(st.just("load"), st.integers(0, 40), st.lists(st.integers(0, 99), max_size=300)),
        st.tuples(st.just("write"), st.integers(0, 40), st.integers(0, 700)),
    ),
    max_size=30,
)


@given(ops=token_ops, told_lengths=st.booleans())
def test_the_token_buffer_keeps_every_row_through_growth(
    ops: list[tuple[str, int, object]], told_lengths: bool
) -> None:
    """Loads and writes that widen and lengthen the buffer keep every row.

    Growth copies only the columns written, or, told each row's length (raised before a write,
    as the scheduler raises ``known``), only each row's own tokens.
    """
    rows, lengths = dict[int, list[int]](), dict[int, int]()

    def row_lengths(count: int) -> NDArray[np.int64]:
        return np.array([lengths.get(row, 0) for row in range(count)], dtype=np.int64)

    buffer = TokenBuffer(row_lengths if told_lengths else None)
    for kind, slot, arg in ops:
        if kind == "load":
            assert isinstance(arg, list)
            lengths[slot] = len(arg)
            buffer.load(slot, tuple(arg), [])
            rows[slot] = list(arg)
        elif slot in rows:  # a row is written only once loaded, one token past its end
            assert isinstance(arg, int)
            token = arg % 100
            position = len(rows[slot]) + arg // 100  # past the end: the gap reads as whatever was there
            lengths[slot] = position + 1
            buffer.write(np.array([slot], np.int32), np.array([position], np.int32), np.array([token], np.int32))
            rows[slot] = rows[slot] + [int(buffer.ids[slot, p]) for p in range(len(rows[slot]), position)] + [token]
        for held, tokens in rows.items():
            assert buffer.row(held, 0, len(tokens)) == tokens


def test_the_token_buffer_copies_and_pickles_as_a_plain_array() -> None:
    """Its rows live in memory mapped page by page (see ``mapped.mapped_zeros``), yet copy and pickle by value."""
    buffer = TokenBuffer()
    buffer.load(3, tuple(range(1, 600)), [7, 8])
    twin = copy.deepcopy(buffer)
    unpickled = pickle.loads(pickle.dumps(buffer))  # noqa: S301 -- pickled just above
    buffer.write(np.array([3], np.int32), np.array([601], np.int32), np.array([9], np.int32))
    for other in (twin, unpickled):
        assert other.row(3, 0, 601) == [*range(1, 600), 7, 8]
        assert other.ids.flags.writeable
        other.write(np.array([3], np.int32), np.array([601], np.int32), np.array([5], np.int32))
        assert other.row(3, 601, 602) == [5]
    assert buffer.row(3, 599, 602) == [7, 8, 9]
    assert not buffer.ids[:, 700:].any()  # the rest reads as zeros
    assert not buffer.ids[4:].any()


def test_the_token_buffer_grows_where_the_kernel_refuses_the_no_huge_pages_advice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel built without huge pages answers the advice with EINVAL: the buffer works all the same."""

    class Refusing(mmap.mmap):
        def madvise(self, option: int, start: int = 0, length: int = 0) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(
        mapped, "mmap", types.SimpleNamespace(mmap=Refusing, MADV_NOHUGEPAGE=14, MAP_PRIVATE=mmap.MAP_PRIVATE)
    )
    buffer = TokenBuffer()
    buffer.load(20, tuple(range(1, 3000)), [])  # grows past the first rows and columns
    assert buffer.row(20, 2990, 2999) == list(range(2991, 3000))
    assert not buffer.ids[:20].any()


def test_tables_keep_their_pages_when_a_long_table_widens_them_and_rows_grow() -> None:
    """Widening copies each table's own pages only; freed tables' stale entries are never read."""
    kv = PagedKVManager(num_pages=4096, page_size=16)
    slots = np.array([kv.open() for _ in range(8)], dtype=np.int32)
    kv.extend_many(slots, np.arange(1, 9, dtype=np.int64))
    kv.free_many(slots[::2])  # their entries stay behind, past a count of zero
    kept = {int(slot): kv.pages(int(slot)).tolist() for slot in slots[1::2]}
    long = kv.open()  # a ninth table: the rows double
    kv.extend_many(np.array([long], np.int32), np.array([3000], np.int64))  # far past the width
    reused = kv.open()  # a freed row again: it starts empty, whatever its entries held
    assert kv.page_count(reused) == 0
    kv.grow_to(reused, 16 * 5)
    for slot, pages in kept.items():
        assert kv.pages(slot).tolist() == pages
    everything = [*itertools.chain.from_iterable(kept.values()), *kv.pages(long).tolist(), *kv.pages(reused).tolist()]
    assert len(set(everything)) == len(everything) == 4 + 6 + 8 + 2 + 3000 + 5
    kv.check_invariants()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_writes_its_own_copy_of_the_tables() -> None:
    """The lazily mapped memory is private: a child's writes never reach its parent's tokens or pages."""
    buffer, kv = TokenBuffer(), PagedKVManager(num_pages=64, page_size=16)
    buffer.load(2, (5, 6, 7), [])
    slot = kv.open()
    kv.grow_to(slot, 40)
    pages = kv.pages(slot).tolist()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: scribble over both, say it did, leave at once
        try:
            buffer.write(np.array([2], np.int32), np.array([0], np.int32), np.array([99], np.int32))
            kv.free(slot)
            kv.grow_to(kv.open(), 16 * 60)
            os.write(writer, b"done")
        finally:
            os._exit(0)
    os.close(writer)
    assert os.read(reader, 4) == b"done"
    os.waitpid(pid, 0)
    assert buffer.row(2, 0, 3) == [5, 6, 7]
    assert kv.pages(slot).tolist() == pages
    kv.check_invariants()


class TestReservation:
    """Reserved tables and token rows are there from the start: growth within them copies nothing."""

    def test_tables_grown_within_the_reservation_stay_where_they_are(self) -> None:
        kv = PagedKVManager(num_pages=4096, page_size=16)
        kv.reserve(16, 3000)
        table = kv._table
        slots = [kv.open() for _ in range(16)]
        kv.extend_many(np.array(slots, np.int32), np.array([2900, *[10] * 15], np.int64))
        assert kv._table is table
        kv.free(slots[1])
        kv.extend_many(np.array([slots[0]], np.int32), np.array([150], np.int64))  # past it: grows, pages kept
        assert kv._table is not table
        assert kv.page_count(slots[0]) == 3050
        assert len(set(kv.pages(slots[0]).tolist())) == 3050
        kv.check_invariants()

    def test_a_refused_reservation_leaves_the_tables_to_grow(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def refuse(rows: int, columns: int) -> NDArray[np.int32]:
            raise MemoryError

        kv, buffer = PagedKVManager(num_pages=64, page_size=16), TokenBuffer()
        monkeypatch.setattr(phasesched.kv, "mapped_zeros", refuse)
        monkeypatch.setattr(phasesched.running, "mapped_zeros", refuse)
        kv.reserve(1 << 20, 1 << 20)
        buffer.reserve(1 << 20, 1 << 20)
        monkeypatch.undo()
        assert kv._table.shape == (8, 8)
        kv.grow_to(kv.open(), 16 * 40)
        buffer.load(3, tuple(range(1, 200)), [])
        assert buffer.row(3, 190, 199) == list(range(191, 200))
        kv.check_invariants()

    def test_the_token_buffer_keeps_its_rows_within_the_reservation(self) -> None:
        buffer = TokenBuffer()
        buffer.reserve(4, 1000)
        ids = buffer.ids
        assert ids.shape == (8, 1024)  # whole 64-token blocks, so any page size up to 64 divides a row
        buffer.load(3, tuple(range(1, 1001)), [])
        buffer.write(np.array([3], np.int32), np.array([1000], np.int32), np.array([7], np.int32))
        assert buffer.ids is ids
        assert buffer.row(3, 998, 1001) == [999, 1000, 7]

    @pytest.mark.parametrize(("tables", "pages"), [(0, 4), (4, -1), (2.0, 4), (4, True)])
    def test_a_bad_reservation_is_refused(self, tables: object, pages: object) -> None:
        with pytest.raises(InvalidArgumentError, match="positive ints"):
            PagedKVManager(num_pages=8, page_size=16).reserve(tables, pages)  # type: ignore[arg-type]

    def test_a_scheduler_reserves_a_full_batch_of_its_longest_requests(self) -> None:
        config = SchedulerConfig(num_pages=64, page_size=16, max_model_len=5000)
        scheduler = Scheduler(config, SchedulingPolicy(budget=TokenBudget(max_num_seqs=12)))
        assert scheduler._kv._table.shape == (12, 313)
        assert scheduler._arrays.tokens.ids.shape == (12, 5056)


def test_tables_work_where_no_memory_can_be_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of mappings (``vm.max_map_count``), the arrays come from numpy: a scheduler still works."""

    def no_mappings(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mapped, "mmap", types.SimpleNamespace(mmap=no_mappings, MAP_PRIVATE=mmap.MAP_PRIVATE))
    config = SchedulerConfig(num_pages=64, page_size=16, max_model_len=512)
    scheduler = Scheduler(config, SchedulingPolicy(budget=TokenBudget(max_num_seqs=4)))
    scheduler.add_request(Request("a", prompt_token_ids=list(range(40)), max_new_tokens=3))
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, StepResult(step_id=plan.step_id, token_ids=np.full(plan.batch_size, 9, np.int32)))
    assert plan.input_ids is not None
    assert plan.input_ids.tolist() == list(range(40))
    assert scheduler.kv.page_counts.sum() == 3
