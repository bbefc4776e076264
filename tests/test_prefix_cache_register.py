"""``PrefixCache.register`` against its rule applied page by page.

Naming a batch of freshly filled pages takes one C-level pass over the hash -> page dict; the
rule it must keep reads simplest page by page: a page is named by its hash unless the hash is
already cached or met earlier in the same call (the first copy is the one later requests
share), and a page that carries a hash keeps it. Small hash and page ranges make every case
common: repeated hashes within a call, hashes cached by earlier calls, pages named twice.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched.prefix_cache import PrefixCache

NUM_PAGES = 16


def model_register(page_of: dict[int, int], named: dict[int, int], pages: list[int], hashes: list[int]) -> list[int]:
    """The rule, page by page: returns the pages named."""
    registered = []
    for page, value in zip(pages, hashes, strict=True):
        if value not in page_of and page not in named:
            page_of[value] = page
            named[page] = value
            registered.append(page)
    return registered


@st.composite
def batches(draw: st.DrawFn) -> list[tuple[list[int], list[int], bool]]:
    """Calls of distinct pages with hashes from a small range, some with parents."""
    calls = []
    for _ in range(draw(st.integers(1, 8))):
        pages = draw(st.lists(st.integers(0, NUM_PAGES - 1), unique=True, max_size=6))
        hashes = draw(st.lists(st.integers(1, 12), min_size=len(pages), max_size=len(pages)))
        calls.append((pages, hashes, draw(st.booleans())))
    return calls


@settings(max_examples=300, deadline=None)
@given(batches())
def test_register_names_what_the_page_by_page_rule_names(calls: list[tuple[list[int], list[int], bool]]) -> None:
    cache = PrefixCache(NUM_PAGES)
    page_of: dict[int, int] = {}
    named: dict[int, int] = {}
    parent_of: dict[int, int] = {}
    for pages, hashes, with_parents in calls:
        parents = [value + 100 for value in hashes] if with_parents else None
        expected = model_register(page_of, named, pages, hashes)
        got = cache.register(np.array(pages, dtype=np.int32), hashes, parents)
        assert list(got) == expected
        for page in expected:
            if parents is not None:
                parent_of[page] = named[page] + 100
            else:
                parent_of.pop(page, None)
        for value in range(1, 13):
            assert cache.lookup([value]) == ([page_of[value]] if value in page_of else [])
        assert {p for p in range(NUM_PAGES) if cache.is_hashed(p)} == set(named)
        assert cache.num_hashed == len(named)
        assert cache.stats.registered == len(named)
    for page, parent in parent_of.items():  # parents are known exactly for pages registered with them
        assert cache._parent_known[page]
        assert cache._parent_of[page] == parent
    for page in set(named) - set(parent_of):
        assert not cache._parent_known[page]


def test_a_hash_met_twice_in_one_call_names_its_first_page_only() -> None:
    cache = PrefixCache(8)
    assert cache.register(np.array([0, 1, 2], dtype=np.int32), [7, 8, 7]) == (0, 1)
    assert cache.lookup([7, 8]) == [0, 1]
    assert not cache.is_hashed(2)


def test_a_cached_hash_keeps_its_page() -> None:
    cache = PrefixCache(8)
    cache.register(np.array([0], dtype=np.int32), [7])
    assert cache.register(np.array([3, 4], dtype=np.int32), [9, 7]) == (3,)
    assert cache.lookup([7]) == [0]
    assert cache.lookup([9]) == [3]


class CacheModel:
    """The cache's naming rule with eager eviction: live entries only, idle pages in release order."""

    def __init__(self) -> None:
        self.page_of: dict[int, int] = {}
        self.named: dict[int, int] = {}
        self.idle: list[int] = []

    def evict(self, count: int) -> list[int]:
        pages, self.idle = self.idle[:count], self.idle[count:]
        for page in pages:
            del self.page_of[self.named.pop(page)]
        return pages

    def lookup(self, hashes: list[int]) -> list[int]:
        pages = []
        for value in hashes:
            if value not in self.page_of:
                break
            pages.append(self.page_of[value])
        return pages


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_naming_claims_and_evictions_with_rollbacks_follow_the_model(data: st.DataObject) -> None:
    """Pages named, released, claimed back and evicted (some evictions rolled back), against a dict model."""
    cache, model = PrefixCache(NUM_PAGES), CacheModel()
    in_use: set[int] = set()  # named pages some table still references
    for _ in range(data.draw(st.integers(1, 40))):
        kind = data.draw(st.sampled_from(["register", "park", "claim", "evict", "evict_undone"]))
        if kind == "register":
            free = sorted(set(range(NUM_PAGES)) - set(model.named) - in_use)
            pages = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=5)) if free else []
            hashes = data.draw(st.lists(st.integers(1, 6), min_size=len(pages), max_size=len(pages)))
            expected = model_register(model.page_of, model.named, pages, hashes)
            assert list(cache.register(np.array(pages, dtype=np.int32), hashes)) == expected
            in_use.update(expected)
        elif kind == "park" and in_use:
            pages = data.draw(st.lists(st.sampled_from(sorted(in_use)), unique=True, min_size=1))
            cache.park(np.array(pages, dtype=np.int32))
            model.idle += pages
            in_use.difference_update(pages)
        elif kind == "claim" and model.idle:
            pages = data.draw(st.lists(st.sampled_from(model.idle), unique=True, min_size=1))
            cache.unpark(np.array(pages, dtype=np.int32))
            model.idle = [page for page in model.idle if page not in pages]
            in_use.update(pages)
        elif kind.startswith("evict") and model.idle:
            count = data.draw(st.integers(1, len(model.idle)))
            if kind == "evict_undone":  # a rolled-back step: the pages come back, cached and idle
                cache.unevict(cache.evict(count))
            else:
                assert cache.evict(count).pages.tolist() == model.evict(count)
        for value in range(1, 7):
            assert cache.lookup([value]) == model.lookup([value])
        assert cache.lookup(list(range(1, 7))) == model.lookup(list(range(1, 7)))
        assert {page for page in range(NUM_PAGES) if cache.is_hashed(page)} == set(model.named)
        assert cache.idle_pages() == model.idle


def test_a_hash_evicted_then_computed_again_is_named_on_its_new_page_once() -> None:
    cache = PrefixCache(4)
    cache.register(np.array([0], dtype=np.int32), [7])
    cache.park(np.array([0], dtype=np.int32))
    cache.evict(1)
    assert cache.lookup([7]) == []
    assert cache.register(np.array([2, 3], dtype=np.int32), [7, 7]) == (2,)
    assert cache.lookup([7]) == [2]


def test_an_evicted_page_filled_again_with_its_old_content_is_not_the_first_copy() -> None:
    """Page 0 held hash 7 and was evicted; a call names page 1 then page 0 with 7: page 1 is the first copy."""
    cache = PrefixCache(4)
    cache.register(np.array([0], dtype=np.int32), [7])
    cache.park(np.array([0], dtype=np.int32))
    cache.evict(1)
    assert cache.register(np.array([1, 0], dtype=np.int32), [7, 7]) == (1,)
    assert cache.lookup([7]) == [1]
    assert not cache.is_hashed(0)
