"""Paged KV block manager: fixed-size pages, per-sequence block tables, reference counts.

The manager hands out *tables* (one per sequence, named by a small integer, its slot) and the
pages in them. Its state is a handful of numpy arrays, so the scheduler can grow every running
sequence by one token, gather FlashInfer's ``kv_indices`` and free finished sequences without a
Python loop over requests. Queries (``can_allocate``) never change state; commits
(``grow_to``, ``extend_many``, ``free``) either succeed entirely or raise :class:`OutOfPagesError` having
changed nothing. Pages carry reference counts so tables can share a prefix; a page returns to the
free pool only when its last reference goes.

With ``enable_prefix_caching``, full pages get content hashes as they fill
(:meth:`PagedKVManager.register`), a new table may start by claiming the cached pages of its
prefix (:meth:`PagedKVManager.claim`), and a hashed page
whose last reference goes stays cached, idle, until a fresh page is wanted and the plain free pool
is empty (see :mod:`phasesched.prefix_cache`). Idle pages count as free. Pages are conserved:
``plain free + referenced + idle cached = num_pages``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError, OutOfPagesError, UnknownTableError
from phasesched.mapped import copy_prefixes, layout, mapped_zeros, pack_rows, unpack_rows
from phasesched.prefix import ROOT_HASH
from phasesched.prefix_cache import CacheStats, Evicted, PrefixCache
from phasesched.validators import INT32_MAX, is_int

__all__ = ["Claim", "FreedTables", "HeldKV", "KVView", "PagedKVManager", "Registration", "Registrations"]

Int32Array = NDArray[np.int32]
_NO_SLOTS: Int32Array = np.empty(0, np.int32)
_NO_PAGES: Int32Array = np.empty(0, np.int32)
_NO_PAGES.flags.writeable = False
_NO_STAMPS: NDArray[np.int64] = np.empty(0, np.int64)
_NO_STAMPS.flags.writeable = False


@attrs.frozen(eq=False)
class FreedTables:
    """What :meth:`PagedKVManager.free_many` freed, so :meth:`PagedKVManager.unfree` can undo it (opaque)."""

    slots: Int32Array
    counts: Int32Array
    pages: Int32Array
    num_released: int
    held: Int32Array
    parked: Int32Array = _NO_PAGES
    """Released pages that stayed cached (idle) rather than returning to the plain pool."""
    hashed: Int32Array | None = None
    """Each table's count of pages offered to the cache, before the free."""


@attrs.frozen(eq=False)
class Claim:
    """Cached pages a table claimed (:meth:`PagedKVManager.claim`), for :meth:`PagedKVManager.unclaim` (opaque)."""

    slot: int
    pages: tuple[int, ...]
    unparked: Int32Array
    stamps: NDArray[np.int64]
    queried: int


@attrs.frozen(eq=False)
class Registration:
    """Pages :meth:`PagedKVManager.register` named, for :meth:`PagedKVManager.unregister` (opaque)."""

    slot: int
    offered: int
    registered: tuple[int, ...]


@attrs.frozen(eq=False)
class Registrations:
    """Pages :meth:`PagedKVManager.register_many` named, for :meth:`PagedKVManager.unregister_many` (opaque)."""

    slots: Int32Array
    offered: Int32Array
    registered: tuple[int, ...]


def _parents(
    page_hashes: list[list[int]], first: list[int], named: list[list[int]], hashes: NDArray[np.int64]
) -> NDArray[np.int64]:
    """The parents' hashes of the pages ``hashes``: ``named[i]``, table ``i``'s pages from ``first[i]`` on, in turn."""
    parents = np.empty(len(hashes), dtype=np.int64)
    parents[1:] = hashes[:-1]  # within a table, each page's parent is the page before
    lengths = np.fromiter(map(len, named), dtype=np.int64, count=len(named))
    starts = (np.cumsum(lengths) - lengths)[lengths > 0]
    parents[starts] = [h[f - 1] if f else ROOT_HASH for h, f, n in zip(page_hashes, first, named, strict=True) if n]
    return parents


def _tail_first(pages: Int32Array, *, several: bool) -> Int32Array:
    """Released pages (tables concatenated in token order) in the order to park them: tails first.

    The idle LRU evicts the page parked first, and a chain whose head is evicted loses the rest
    (a lookup stops at the first miss), so every page goes ahead of its parent, as vLLM frees a
    request's blocks in reverse. A page shared by several of the tables keeps its first place:
    its parent comes before it wherever it appears, so reversing keeps children ahead of parents.
    """
    if several:  # dedupe, keeping the first occurrence of each page
        _, first = np.unique(pages, return_index=True)
        if len(first) < len(pages):
            pages = pages[np.sort(first)]
    return pages[::-1]


def _read_only(array: NDArray[np.int32]) -> NDArray[np.int32]:
    view: NDArray[np.int32] = array.view()
    view.flags.writeable = False
    return view


@attrs.frozen(eq=False)
class HeldKV:
    """The KV a finished request left held for a transfer (see :meth:`phasesched.Scheduler.hold_kv`).

    Attributes:
        request_id: Whose KV it is.
        num_tokens: Tokens whose KV the pages hold (the request's computed tokens when it finished).
        pages: int32 ``[ceil(num_tokens / page_size)]``: the page ids, in token order (read-only).

    """

    request_id: str
    num_tokens: int
    pages: NDArray[np.int32]


class PagedKVManager:
    """Allocates KV pages to sequence tables. See the module docstring for the contract.

    Args:
        num_pages: Pages in the cache.
        page_size: Tokens per page.
        watermark: Fraction of pages kept free when *admitting* new sequences, so running ones
            can still grow (vLLM's watermark). Growing a running sequence may use them.
        enable_prefix_caching: Keep hashed full pages cached after their last reference goes,
            for later tables to :meth:`claim` (vLLM's and SGLang's prefix caching).

    >>> kv = PagedKVManager(num_pages=8, page_size=16)
    >>> slot = kv.open()
    >>> kv.grow_to(slot, 20)          # 20 tokens need 2 pages
    >>> kv.num_free_pages, kv.page_count(slot)
    (6, 2)
    >>> kv.free(slot)
    >>> kv.num_free_pages
    8

    """

    def __init__(
        self, num_pages: int, page_size: int, *, watermark: float = 0.0, enable_prefix_caching: bool = False
    ) -> None:
        if not (is_int(num_pages) and is_int(page_size)) or num_pages <= 0 or page_size <= 0:
            msg = f"num_pages and page_size must be positive, got {num_pages} and {page_size}"
            raise InvalidArgumentError(msg)
        if not isinstance(watermark, (int, float)) or not 0.0 <= watermark < 1.0:
            msg = f"watermark must be in [0, 1), got {watermark}"
            raise InvalidArgumentError(msg)
        self.num_pages = num_pages
        self.page_size = page_size
        self.watermark_pages = int(watermark * num_pages)
        # Free pages form a stack; allocation pops from the top, in one slice.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._num_free = num_pages
        self._refcount = np.zeros(num_pages, dtype=np.int32)
        # Entries past a table's count are never read: a freed or retracted table leaves them as they were.
        self._table = mapped_zeros(8, 8)
        self._count = np.zeros(8, dtype=np.int32)
        self._open = np.zeros(8, dtype=bool)
        self._free_slots: list[int] = list(range(7, -1, -1))
        self._count_view = _read_only(self._count)
        self._hashed = np.zeros(8, dtype=np.int32)  # leading pages of each table offered to the cache
        self._nameable = np.full(8, INT32_MAX, dtype=np.int32)  # pages of each table whose content is known
        self._cache = PrefixCache(num_pages) if enable_prefix_caching else None
        # Without a cache no page is ever shared, so freeing needs no reference counting.
        self._shared = enable_prefix_caching
        # Holds (P/D): a table marked with defer_free survives the free that would end it, as a
        # held table, until release(). Freeing skips the check while none is marked.
        self._deferred = np.zeros(8, dtype=bool)
        self._held = np.zeros(8, dtype=bool)
        self._num_deferred = 0

    def __getstate__(self) -> dict[str, object]:
        """Pickles and copies keep each table's pages, not the reserved space around them (written out in full)."""
        state = self.__dict__.copy()
        state["_table"] = pack_rows(self._table, self._count)
        del state["_count_view"]  # a view: made again from the copy's counts
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._table = unpack_rows(state["_table"])  # type: ignore[arg-type]
        self._count_view = _read_only(self._count)

    # ---------------------------------------------------------------- queries
    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out (the free pool plus idle cached pages, evicted on demand)."""
        return self._num_free + (self._cache.num_idle if self._cache is not None else 0)

    @property
    def num_cached_pages(self) -> int:
        """Idle cached pages (no table references them; a later :meth:`claim` may reuse them)."""
        return self._cache.num_idle if self._cache is not None else 0

    def idle_cached_pages(self) -> list[int]:
        """Idle cached pages, least recently released (first to be evicted) first."""
        return self._cache.idle_pages() if self._cache is not None else []

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on."""
        return self._cache is not None

    @property
    def cache_stats(self) -> CacheStats:
        """Prefix-cache counters (all zero when caching is off)."""
        return self._cache.stats if self._cache is not None else CacheStats()

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one table."""
        return self.num_pages - self.num_free_pages

    @property
    def usage(self) -> float:
        """Fraction of pages in use."""
        return self.num_used_pages / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def pages_to_grow(self, slots: Int32Array, num_tokens: NDArray[np.integer]) -> NDArray[np.int64]:
        """int64 ``[len(slots)]``: pages each table must add to hold ``num_tokens[i]`` tokens (0 if it has them)."""
        size = self.page_size
        need: NDArray[np.int64] = (num_tokens.astype(np.int64) + (size - 1)) // size - self._count[slots]
        return np.maximum(need, 0)

    def can_allocate(self, num_pages: int, *, admission: bool = False) -> bool:
        """Whether ``num_pages`` more pages can be handed out now.

        Args:
            num_pages: Pages wanted.
            admission: Keep the watermark free, as admitting a new sequence must.

        """
        reserve = self.watermark_pages if admission else 0
        return num_pages <= self.num_free_pages - reserve

    def is_open(self, slot: int) -> bool:
        """Whether ``slot`` names an open table."""
        return 0 <= slot < len(self._open) and bool(self._open[slot])

    def page_count(self, slot: int) -> int:
        """Pages in table ``slot``."""
        self._check_open(slot)
        return int(self._count[slot])

    def pages(self, slot: int) -> Int32Array:
        """int32 ``[page_counts[slot]]``: the page ids of table ``slot``, in token order (read-only)."""
        self._check_open(slot)
        return _read_only(self._table[slot, : self._count[slot]])

    def last_pages(self, slots: Int32Array) -> Int32Array:
        """int32 ``[len(slots)]``: the last page of each of these tables (each must hold one)."""
        pages: Int32Array = self._table[slots, self._count[slots] - 1]
        return pages

    @property
    def page_counts(self) -> Int32Array:
        """int32 ``[S]``: pages per slot (read-only; free slots read 0)."""
        return self._count_view

    @property
    def refcounts(self) -> Int32Array:
        """int32 ``[num_pages]``: references per page (read-only; free pages read 0)."""
        return _read_only(self._refcount)

    def freed_by_freeing(self, slots: Int32Array) -> int:
        """Pages that would return to the pool if every table in ``slots`` were freed."""
        if len(slots) == 0:
            return 0
        pages = self.gather(slots, self._count[slots])[1]
        unique, hits = np.unique(pages, return_counts=True)
        return int(np.count_nonzero(self._refcount[unique] == hits))

    def gather(self, slots: Int32Array, num_pages: Int32Array) -> tuple[Int32Array, Int32Array]:
        """FlashInfer's ``(kv_indptr, kv_indices)`` for the first ``num_pages[i]`` pages of each slot.

        Returns:
            ``kv_indptr`` int32 ``[len(slots) + 1]`` and ``kv_indices`` int32
            ``[kv_indptr[-1]]``: slot ``slots[i]``'s pages are
            ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``.

        """
        if len(slots) == 1:  # one table (a request finishing, say): its row's first pages, copied
            count = int(num_pages[0])
            return np.array([0, count], dtype=np.int32), self._table[int(slots[0]), :count].copy()
        indptr = np.zeros(len(slots) + 1, dtype=np.int32)
        np.add.accumulate(num_pages, out=indptr[1:])
        total = int(indptr[-1])
        if total == 0:
            return indptr, np.empty(0, dtype=np.int32)
        # Address each wanted entry of the flattened table directly: its row's start, plus its
        # column (its rank within the slot's run). Cheaper than masking a padded copy of the rows.
        width = self._table.shape[1]
        row_start = (slots.astype(np.int64) * width - indptr[:-1]).repeat(num_pages)
        indices: Int32Array = self._table.ravel()[row_start + np.arange(total, dtype=np.int64)]
        return indptr, indices

    # ---------------------------------------------------------------- commits
    def open(self) -> int:
        """Open an empty table and return its slot."""
        if not self._free_slots:
            self._grow_rows()
        slot = self._free_slots.pop()
        self._open[slot] = True
        self._nameable[slot] = INT32_MAX  # a new table's content is known until limit_naming says otherwise
        return slot

    def next_slots(self, count: int) -> Int32Array:
        """The slots the next ``count`` calls of :meth:`open` return, in order; nothing changes.

        A plan made ahead of its commit (a simulator's run that admits) names its tables by
        them: the free slots, latest freed first, then the rows :meth:`open` adds, in order.
        """
        free = self._free_slots[: -count - 1 : -1]
        rows = len(self._open)
        return np.array(free + list(range(rows, rows + count - len(free))), dtype=np.int32)

    def grow_to(self, slot: int, num_tokens: int) -> None:
        """Make table ``slot`` hold at least ``num_tokens`` tokens' pages.

        Raises:
            OutOfPagesError: Too few free pages; nothing was allocated.

        """
        self._check_open(slot)
        self.grow_many(np.array([slot], dtype=np.int32), np.array([num_tokens], dtype=np.int32))

    def grow_many(self, slots: Int32Array, num_tokens: Int32Array) -> None:
        """Vectorized :meth:`grow_to`: all tables grow, or none does.

        ``slots`` must be distinct open tables (the scheduler guarantees it; it is not rechecked
        here because this is the per-step hot path).
        """
        self.extend_many(slots, self.pages_to_grow(slots, num_tokens))

    def extend_many(self, slots: Int32Array, num_pages: NDArray[np.int64]) -> Evicted | None:
        """Append ``num_pages[i]`` pages to table ``slots[i]``, for distinct open slots; all or nothing.

        Fresh pages come from the free pool; when it runs short, the least recently released
        idle cached pages are evicted for them.

        Returns:
            What was evicted, for :meth:`unevict` after :meth:`retract` (``None`` if nothing was).

        Raises:
            OutOfPagesError: Too few free pages; nothing was allocated.

        """
        total = int(num_pages.sum())
        if total == 0:
            return None
        growing = num_pages > 0
        slots, need = slots[growing], num_pages[growing]
        if total == len(slots):  # one page each: the common case of decodes crossing a boundary
            return self.extend_each(slots)
        if len(slots) == 1:  # one table: an admission's prompt, or one prefill's chunk
            return self._extend_one(int(slots[0]), total)
        last = int(need[-1])
        if total - last == len(slots) - 1:  # one page each, then one table's run: decodes beside a chunk
            return self._extend_each_then_one(slots, last)
        counts = self._count[slots]
        fresh, evicted = self._take_fresh(total, int((counts + need).max()))
        rows, cols = layout(slots, counts, need)  # each slot's new pages go after its last one
        self._table[rows, cols] = fresh
        self._count[slots] = counts + need.astype(np.int32)
        return evicted

    def _extend_one(self, slot: int, num_pages: int) -> Evicted | None:
        """:meth:`extend_many` for one table: its new pages go after its last one, in one slice."""
        count = int(self._count[slot])
        fresh, evicted = self._take_fresh(num_pages, count + num_pages)
        self._table[slot, count : count + num_pages] = fresh
        self._count[slot] = count + num_pages
        return evicted

    def _extend_each_then_one(self, slots: Int32Array, last: int) -> Evicted | None:
        """:meth:`extend_many` with one page for each of ``slots`` but the last, which takes ``last``.

        The pages go where the general layout puts them (in slot order, each table's after its
        last), in two assignments rather than a layout of every page.
        """
        counts = self._count[slots]
        head = len(slots) - 1
        end = int(counts[head]) + last
        fresh, evicted = self._take_fresh(head + last, max(int(counts[:head].max()) + 1, end))
        self._table[slots[:head], counts[:head]] = fresh[:head]
        self._table[int(slots[head]), end - last : end] = fresh[head:]
        counts += 1
        counts[head] = end
        self._count[slots] = counts
        return evicted

    def extend_each(self, slots: Int32Array) -> Evicted | None:
        """:meth:`extend_many` with one page for each of ``slots``: decodes crossing a page boundary."""
        counts = self._count[slots]
        fresh, evicted = self._take_fresh(len(slots), int(counts.max(initial=0)) + 1)
        self._table[slots, counts] = fresh
        self._count[slots] = counts + 1
        return evicted

    def _take_fresh(self, total: int, width: int) -> tuple[Int32Array, Evicted | None]:
        """``total`` fresh pages, referenced once, for tables of up to ``width`` pages; and what was evicted.

        Raises:
            OutOfPagesError: Too few free pages; nothing was taken.

        """
        if total > self.num_free_pages:
            raise OutOfPagesError(total, self.num_free_pages)
        self._ensure_width(width)  # before evicting: the only step here that can fail (memory)
        evicted = self._evict(total - self._num_free) if total > self._num_free else None
        top = self._num_free
        fresh = self._free[top - total : top][::-1]
        self._num_free -= total
        self._refcount[fresh] = 1
        return fresh, evicted

    def retract(self, slots: Int32Array, num_pages: Int32Array) -> None:
        """Shrink table ``slots[i]`` back to its first ``num_pages[i]`` pages (undoes :meth:`extend_many`).

        The pages dropped go back on top of the free pool in the order they were taken, so
        retracting what one ``extend_many`` call (with the same ``slots``) added restores the
        pool exactly. Tables already at or below their count are left alone.
        """
        current = self._count[slots]
        shrink = current > num_pages
        if not np.count_nonzero(shrink):
            return
        slots, keep = slots[shrink], num_pages[shrink].astype(np.int32)
        rows, cols = layout(slots, keep, current[shrink] - keep)
        pages = self._table[rows, cols]
        np.subtract.at(self._refcount, pages, 1)
        released = pages[self._refcount[pages] == 0] if self._shared else pages
        released, _ = self._park(released[::-1])
        top = self._num_free
        self._free[top : top + len(released)] = released
        self._num_free += len(released)
        self._count[slots] = keep
        self._hashed[slots] = np.minimum(self._hashed[slots], keep)

    def unevict(self, evicted: Evicted | None) -> None:
        """Undo the evictions of an :meth:`extend_many` call, once :meth:`retract` has undone its growth."""
        if evicted is None:
            return
        assert self._cache is not None
        self._num_free -= len(evicted.pages)  # retract left them on top of the pool, where eviction put them
        self._cache.unevict(evicted)

    def free(self, slot: int) -> None:
        """Free table ``slot``: pages whose last reference it held return to the pool."""
        self._check_open(slot)
        self.free_many(np.array([slot], dtype=np.int32))

    def free_many(self, slots: Int32Array) -> FreedTables:
        """Vectorized :meth:`free` for distinct open slots; returns what :meth:`unfree` needs to undo it.

        A table marked by :meth:`defer_free` is held instead of freed.
        """
        held = _NO_SLOTS
        if self._num_deferred and len(slots):
            held, slots = self._hold_deferred(slots)
        counts = self._count[slots]
        if len(slots) == 0:
            return FreedTables(slots, counts, np.empty(0, np.int32), 0, held)
        _, pages = self.gather(slots, counts)
        references = self._refcount[pages]  # a copy: what to restore if releasing fails part-way
        try:
            released, parked = self._release(pages, several=len(slots) > 1)
        except BaseException:  # nothing else has changed yet: put the references and holds back
            self._refcount[pages] = references
            self._unhold(held)
            raise
        top = self._num_free
        self._free[top : top + len(released)] = released
        self._num_free += len(released)
        self._count[slots] = 0
        self._open[slots] = False
        self._free_slots.extend(slots.tolist())
        hashed = self._hashed[slots]
        self._hashed[slots] = 0
        return FreedTables(slots, counts, pages, len(released), held, parked, hashed)

    def _release(self, pages: Int32Array, *, several: bool) -> tuple[Int32Array, Int32Array]:
        """Drop one reference to each of ``pages`` (freed tables' pages in token order); park the cached ones released.

        Returns the released pages for the plain pool, and those parked in the cache.
        """
        if self._shared and self._refcount[pages].max(initial=0) > 1:  # shared pages: count every reference
            np.subtract.at(self._refcount, pages, 1)
            released = _tail_first(pages[self._refcount[pages] == 0], several=several)
        elif self._shared:  # no page is shared, so each appears once
            self._refcount[pages] = 0
            released = _tail_first(pages, several=False)
        else:  # every page has one owner, so each appears once and is released
            self._refcount[pages] = 0
            released = pages
        if self._cache is None:
            return released, _NO_PAGES
        return self._park(released)

    def _unhold(self, held: Int32Array) -> None:
        """Undo :meth:`_hold_deferred`: the tables are marked again rather than held."""
        if len(held):
            self._held[held] = False
            self._deferred[held] = True
            self._num_deferred += len(held)

    def unfree(self, freed: FreedTables) -> None:
        """Undo the :meth:`free_many` call that returned ``freed``; nothing else may have changed since."""
        self._unhold(freed.held)
        if not len(freed.slots):
            return
        self._num_free -= freed.num_released  # its pages sit on top of the pool, as it left them
        np.add.at(self._refcount, freed.pages, 1)
        rows, cols = layout(freed.slots, np.zeros(len(freed.slots), np.int32), freed.counts)
        self._table[rows, cols] = freed.pages
        self._count[freed.slots] = freed.counts
        self._open[freed.slots] = True
        del self._free_slots[-len(freed.slots) :]
        if self._cache is not None and freed.hashed is not None:
            self._cache.unpark(freed.parked)  # parked last, so the LRU is as it was
            self._hashed[freed.slots] = freed.hashed

    def close_empty(self, slot: int) -> None:
        """Undo :meth:`open`: close table ``slot``, which must hold no pages, and hand out its slot next."""
        self._open[slot] = False
        self._free_slots.append(slot)

    def reserve(self, tables: int, pages_per_table: int) -> None:
        """Make room for ``tables`` tables of ``pages_per_table`` pages now: growth within them copies nothing.

        The tables' unwritten memory is only address space: a scheduler reserves its batch size
        by its longest request, and no step then widens every table when a long prompt comes
        (3-5 ms each time a 128K prompt among 1,024 requests doubled the width). A reservation
        the system refuses leaves the tables to grow as they would have.

        Raises:
            InvalidArgumentError: ``tables`` or ``pages_per_table`` is not a positive int.
        """
        if not (is_int(tables) and is_int(pages_per_table)) or tables <= 0 or pages_per_table <= 0:
            msg = f"tables and pages_per_table must be positive ints, got {tables!r} and {pages_per_table!r}"
            raise InvalidArgumentError(msg)
        rows, width = self._table.shape
        if tables > rows or pages_per_table > width:
            with contextlib.suppress(MemoryError, OSError, ValueError):
                self._resize_table(max(tables, rows), max(pages_per_table, width))

    # ---------------------------------------------------------------- prefix cache
    def cached_prefix(self, hashes: list[int], max_pages: int) -> int:
        """Leading pages of ``hashes`` (a sequence's page hashes) cached now, at most ``max_pages``."""
        if self._cache is None or max_pages <= 0:
            return 0
        return len(self._cache.lookup(hashes[:max_pages]))

    def claim(self, slot: int, hashes: list[int], num_pages: int, *, queried: int) -> Claim | None:
        """Start empty table ``slot`` with the cached pages of ``hashes[:num_pages]``, shared.

        Claimed pages are referenced, so they cannot be evicted while the table holds them.

        Args:
            slot: An open, empty table.
            hashes: The sequence's page hashes.
            num_pages: How many to claim; :meth:`cached_prefix` must have found at least as many.
            queried: Pages the lookup covered, for the hit counters.

        Returns:
            What :meth:`unclaim` needs, or ``None`` when caching is off.
        """
        if self._cache is None:
            return None
        if num_pages == 0 and not self._count[slot]:  # nothing cached to claim: only the lookup counts
            self._cache.count_lookup(queried, 0)
            return Claim(slot, (), _NO_PAGES, _NO_STAMPS, queried)
        pages = self._cache.lookup(hashes[:num_pages])
        if len(pages) != num_pages or self._count[slot]:
            msg = f"cannot claim {num_pages} cached pages for table {slot}: {len(pages)} are cached"
            raise InvalidArgumentError(msg)
        self._ensure_width(num_pages)  # first: the only step here that can fail (memory)
        index = np.asarray(pages, dtype=np.int32)
        idle = index[self._refcount[index] == 0]
        stamps = self._cache.unpark(idle)
        self._table[slot, :num_pages] = pages
        self._count[slot] = num_pages
        self._hashed[slot] = num_pages
        self._refcount[pages] += 1
        self._cache.count_lookup(queried, num_pages)
        return Claim(slot, tuple(pages), idle, stamps, queried)

    def unclaim(self, claim: Claim | None) -> None:
        """Undo :meth:`claim`: the table is empty again and the pages as they were."""
        if claim is None or self._cache is None:
            return
        pages = list(claim.pages)
        self._refcount[pages] -= 1
        self._count[claim.slot] = 0
        self._hashed[claim.slot] = 0
        self._cache.repark(claim.unparked, claim.stamps)
        self._cache.count_lookup(-claim.queried, -len(pages))

    def uncount_claim(self, claim: Claim | None) -> None:
        """Take a claim's lookup out of the hit counters, as if it never happened (its admission was given back)."""
        if claim is not None and self._cache is not None:
            self._cache.count_lookup(-claim.queried, -len(claim.pages))

    def pages_to_hash(self, slots: Int32Array, num_computed: Int32Array) -> Int32Array:
        """int32 ``[K]``: full pages of each table not yet offered to the cache (all 0 when caching is off).

        Only pages below the table's :meth:`limit_naming` count, so a request whose content is
        unknown past its prompt costs nothing per step.
        """
        if self._cache is None:
            return np.zeros(len(slots), dtype=np.int32)
        full = np.minimum(num_computed // self.page_size, self._nameable[slots])
        due: Int32Array = np.maximum(full - self._hashed[slots], 0).astype(np.int32)
        return due

    def limit_naming(self, slot: int, num_pages: int) -> None:
        """Only table ``slot``'s first ``num_pages`` pages can ever be named (its content is unknown past them)."""
        self._nameable[slot] = min(num_pages, INT32_MAX)

    def register(self, slot: int, hashes: list[int], num_pages: int | None = None) -> Registration:
        """Offer table ``slot``'s next ``num_pages`` full pages to the cache (all of ``hashes`` by default).

        The first ``len(hashes)`` of them are named by ``hashes``, in order; the rest have no
        known content (a length-only request's generated tokens) and stay unnamed. Their
        parents are known only from the table's first page on (see :meth:`parents_to_evict`).
        """
        assert self._cache is not None
        first = int(self._hashed[slot])
        offered = len(hashes) if num_pages is None else num_pages
        hashes = hashes[:offered]
        parents = [ROOT_HASH, *hashes[:-1]] if first == 0 and hashes else None
        registered = self._cache.register(self._table[slot, first : first + len(hashes)], hashes, parents)
        self._hashed[slot] = first + offered
        return Registration(slot, offered, registered)

    def register_many(
        self, slots: Int32Array, page_hashes: list[list[int]], num_pages: NDArray[np.integer]
    ) -> Registrations:
        """Offer the next ``num_pages[i]`` full pages of each table ``slots[i]`` (distinct) to the cache.

        ``page_hashes[i]`` lists table ``slots[i]``'s page hashes from its first page on; the
        pages offered are named by theirs as far as the list goes, and stay unnamed beyond it
        (as :meth:`register` leaves them). Tables are taken in order, so a hash already cached,
        or named earlier in the same call, leaves its page unnamed: the first copy is the one
        later requests share.
        """
        assert self._cache is not None
        first = self._hashed[slots]
        named = [h[f : f + n] for h, f, n in zip(page_hashes, first.tolist(), num_pages.tolist(), strict=True)]
        hashes = list(itertools.chain.from_iterable(named))
        head = len(named) - 1
        if len(hashes) == len(named) and all(named):  # one page each (decodes filling a page): no layout
            pages: Int32Array = self._table[slots, first]
        elif len(hashes) - len(named[-1]) == head and all(named[:head]):  # and one table's run: decodes beside a chunk
            run = int(first[head])
            tail = self._table[int(slots[head]), run : run + len(named[head])]
            pages = np.concatenate([self._table[slots[:head], first[:head]], tail])
        else:
            lengths = np.fromiter(map(len, named), dtype=np.int64, count=len(named))
            rows, cols = layout(slots, first, lengths)
            pages = self._table[rows, cols]
        array = np.fromiter(hashes, dtype=np.int64, count=len(hashes))  # once, for the parents and the names
        parents = _parents(page_hashes, first.tolist(), named, array)
        registered = self._cache.register(pages, hashes, parents, hash_array=array)
        offered = num_pages.astype(np.int32)
        self._hashed[slots] = first + offered
        return Registrations(slots.copy(), offered, registered)

    def parents_to_evict(self, num_pages: int) -> set[int] | None:
        """The parents' hashes of the idle pages that handing out ``num_pages`` more pages now would evict.

        ``None`` when some are not known (pages :meth:`register` offered past a table's first).
        """
        assert self._cache is not None
        return self._cache.parents_to_evict(num_pages - self._num_free)

    def evicts_for(self, num_pages: int) -> bool:
        """Whether handing out ``num_pages`` more pages now would evict idle cached ones."""
        return num_pages > self._num_free

    def names_every_page(self, slots: Int32Array) -> NDArray[np.bool_]:
        """Which tables may have every page named as it fills (no :meth:`limit_naming` cap)."""
        unlimited: NDArray[np.bool_] = self._nameable[slots] == INT32_MAX
        return unlimited

    def offers_next(self, slots: Int32Array, pages: Int32Array) -> bool:
        """Whether page ``pages[i]`` is the next one table ``slots[i]`` would offer to the cache, for every ``i``."""
        return bool((self._hashed[slots] == pages).all())

    def register_next(self, slots: Int32Array, hashes: list[int], parents: list[int]) -> Registrations:
        """Offer the next full page of each table ``slots[i]`` (distinct) to the cache, named ``hashes[i]``.

        :meth:`register_many` for the steady decode step, where each table filled one page;
        ``parents[i]`` is the hash of the page before it.
        """
        assert self._cache is not None
        first = self._hashed[slots]
        registered = self._cache.register(self._table[slots, first], hashes, parents)
        self._hashed[slots] = first + 1
        kept = slots if not slots.flags.writeable else slots.copy()  # a frozen array cannot change under the undo
        return Registrations(kept, np.ones(len(slots), dtype=np.int32), registered)

    def unregister_many(self, registrations: Registrations) -> None:
        """Undo :meth:`register_many`."""
        assert self._cache is not None
        self._cache.unregister(registrations.registered)
        self._hashed[registrations.slots] -= registrations.offered

    def unregister(self, registration: Registration) -> None:
        """Undo :meth:`register`."""
        assert self._cache is not None
        self._cache.unregister(registration.registered)
        self._hashed[registration.slot] -= registration.offered

    def _park(self, pages: Int32Array) -> tuple[Int32Array, Int32Array]:
        """Keep released hashed pages cached (idle), in order; return the others, for the plain pool, and those kept."""
        cache = self._cache
        if cache is None or not cache.num_hashed:
            return pages, _NO_PAGES
        hashed = cache.hashed_among(pages)
        if not hashed.any():
            return pages, _NO_PAGES
        kept: Int32Array = pages[hashed]
        cache.park(kept)
        plain: Int32Array = pages[~hashed]
        return plain, kept

    def _evict(self, count: int) -> Evicted:
        """Drop ``count`` idle cached pages and put them on top of the free pool."""
        assert self._cache is not None
        evicted = self._cache.evict(count)
        top = self._num_free
        self._free[top : top + count] = evicted.pages
        self._num_free += count
        return evicted

    # ---------------------------------------------------------------- holds, for P/D
    def defer_free(self, slot: int) -> None:
        """Mark table ``slot`` so that the next free of it holds its pages instead (vLLM's delayed free).

        A disaggregated prefill worker marks a request's table before the request finishes: its
        pages then outlive the request, unchanged and in place, until :meth:`release` (after
        the decode side has acknowledged the copy).
        """
        self._check_open(slot)
        if self._held[slot]:
            msg = f"KV table {slot} is already held"
            raise UnknownTableError(msg)
        if not self._deferred[slot]:
            self._deferred[slot] = True
            self._num_deferred += 1

    def is_held(self, slot: int) -> bool:
        """Whether ``slot`` is a held table: freed by its owner, its pages kept until :meth:`release`."""
        return 0 <= slot < len(self._held) and bool(self._held[slot])

    @property
    def num_held_tables(self) -> int:
        """Held tables (their pages count as used)."""
        return int(np.count_nonzero(self._held))

    def release(self, slot: int) -> None:
        """Free a held table's pages.

        Raises:
            UnknownTableError: ``slot`` is not a held table.

        """
        if not self.is_held(slot):
            msg = f"KV table {slot} is not held"
            raise UnknownTableError(msg)
        self._held[slot] = False
        self.free_many(np.array([slot], dtype=np.int32))

    def _hold_deferred(self, slots: Int32Array) -> tuple[Int32Array, Int32Array]:
        """Turn the marked tables among ``slots`` into held ones; return them and the rest, to free."""
        marked = self._deferred[slots]
        if not marked.any():
            return _NO_SLOTS, slots
        held = slots[marked]
        self._deferred[held] = False
        self._held[held] = True
        self._num_deferred -= len(held)
        return held, slots[~marked]

    def undefer_free(self, slot: int) -> None:
        """Undo :meth:`defer_free` on a table not freed since."""
        if self._deferred[slot]:
            self._deferred[slot] = False
            self._num_deferred -= 1

    # ---------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Assert the bookkeeping is whole: used + free = total, counts match references."""
        free = self._free[: self._num_free]
        assert len(np.unique(free)) == self._num_free, "a page is free twice"
        assert np.all(self._refcount[free] == 0), "a free page is still referenced"
        if self._cache is not None:
            idle = np.array(self._cache.idle_pages(), dtype=np.int32)
            assert not np.any(self._refcount[idle]), "an idle cached page is referenced"
            assert all(self._cache.is_hashed(int(p)) for p in idle), "an idle page has no hash"
            assert not np.intersect1d(idle, free).size, "a page is both idle and free"
            assert not any(self._cache.is_hashed(int(p)) for p in free), "a free page keeps a hash"
            assert self._num_free + len(idle) + np.count_nonzero(self._refcount) == self.num_pages, "pages lost"
        open_slots = self._open.nonzero()[0].astype(np.int32)
        _, pages = self.gather(open_slots, self._count[open_slots])
        expected = np.bincount(pages, minlength=self.num_pages)
        assert np.array_equal(expected, self._refcount), "reference counts disagree with tables"
        assert self.num_used_pages == np.count_nonzero(self._refcount), "used pages miscounted"
        assert not np.any(self._held & ~self._open), "a held table is not open"
        assert int(self._deferred.sum()) == self._num_deferred, "deferred tables miscounted"

    def _check_open(self, slot: int) -> None:
        if not self.is_open(slot):
            msg = f"KV table {slot} is not open"
            raise UnknownTableError(msg)

    def _grow_rows(self) -> None:
        old = len(self._open)
        if self._table.shape[0] < 2 * old:  # unless reserved already
            self._resize_table(2 * old, self._table.shape[1])
        self._count = np.concatenate([self._count, np.zeros(old, dtype=np.int32)])
        self._count_view = _read_only(self._count)
        self._hashed = np.concatenate([self._hashed, np.zeros(old, dtype=np.int32)])
        self._nameable = np.concatenate([self._nameable, np.full(old, INT32_MAX, dtype=np.int32)])
        self._open = np.concatenate([self._open, np.zeros(old, dtype=bool)])
        self._deferred = np.concatenate([self._deferred, np.zeros(old, dtype=bool)])
        self._held = np.concatenate([self._held, np.zeros(old, dtype=bool)])
        self._free_slots.extend(range(2 * old - 1, old - 1, -1))

    def _ensure_width(self, columns: int) -> None:
        width = self._table.shape[1]
        if columns <= width:
            return
        while width < columns:
            width *= 2
        self._resize_table(self._table.shape[0], width)

    def _resize_table(self, rows: int, columns: int) -> None:
        """Move the tables to a larger array, copying each one's pages only.

        A 128K prompt joining 1,024 tables of 2K tokens widened them in 12-175 ms when every
        entry was filled with a sentinel; copying the pages into lazily mapped memory takes 3 ms.
        """
        table = mapped_zeros(rows, columns)
        copy_prefixes(self._table, table, self._count)
        self._table = table


class KVView:
    """A read-only view of a :class:`PagedKVManager`: what other modules may know of the KV pages.

    :attr:`phasesched.Scheduler.kv` is one. It answers queries (free pages, the watermark, the
    page size, pages a growth needs, prefix-cache counters, a table's pages as read-only arrays)
    and has no method that changes anything, so nothing outside the scheduler opens, grows or
    frees tables behind its back. Tables are still named by slot, as the scheduler's plans name
    them.

    >>> view = KVView(PagedKVManager(num_pages=8, page_size=16))
    >>> view.num_free_pages, view.pages_for(20)
    (8, 2)
    >>> hasattr(view, "free")
    False

    """

    __slots__ = ("_kv", "_sync")

    def __init__(self, kv: PagedKVManager, *, sync: Callable[[], None] | None = None) -> None:
        self._kv = kv
        self._sync = sync
        """Called before reading the prefix cache's names: their owner may name pages lazily."""

    @property
    def num_pages(self) -> int:
        """Pages in the cache."""
        return self._kv.num_pages

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._kv.page_size

    @property
    def watermark_pages(self) -> int:
        """Pages admissions keep free (see :class:`PagedKVManager`)."""
        return self._kv.watermark_pages

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out (the free pool plus idle cached pages)."""
        return self._kv.num_free_pages

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one table (held tables' included)."""
        return self._kv.num_used_pages

    @property
    def num_cached_pages(self) -> int:
        """Idle cached pages."""
        return self._kv.num_cached_pages

    @property
    def num_held_tables(self) -> int:
        """Tables held for a transfer (P/D)."""
        return self._kv.num_held_tables

    @property
    def usage(self) -> float:
        """Fraction of pages in use."""
        return self._kv.usage

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on."""
        return self._kv.prefix_caching

    @property
    def cache_stats(self) -> CacheStats:
        """Prefix-cache counters, in pages (all zero when caching is off)."""
        if self._sync is not None:
            self._sync()
        return self._kv.cache_stats

    @property
    def page_counts(self) -> Int32Array:
        """int32 ``[S]``: pages per slot (read-only; free slots read 0)."""
        return self._kv.page_counts

    @property
    def refcounts(self) -> Int32Array:
        """int32 ``[num_pages]``: references per page (read-only)."""
        return self._kv.refcounts

    def idle_cached_pages(self) -> list[int]:
        """Idle cached pages, first to be evicted first (a copy)."""
        return self._kv.idle_cached_pages()

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return self._kv.pages_for(num_tokens)

    def pages_to_grow(self, slots: Int32Array, num_tokens: NDArray[np.integer]) -> NDArray[np.int64]:
        """int64 ``[len(slots)]``: pages each table must add to hold ``num_tokens[i]`` tokens."""
        return self._kv.pages_to_grow(slots, num_tokens)

    def can_allocate(self, num_pages: int, *, admission: bool = False) -> bool:
        """Whether ``num_pages`` more pages can be handed out now (``admission`` keeps the watermark)."""
        return self._kv.can_allocate(num_pages, admission=admission)

    def pages(self, slot: int) -> Int32Array:
        """int32: table ``slot``'s page ids, in token order (read-only).

        Raises:
            UnknownTableError: ``slot`` is not an open table.

        """
        return self._kv.pages(slot)

    def cached_prefix(self, hashes: list[int], max_pages: int) -> int:
        """Leading pages of ``hashes`` (a sequence's page hashes) cached now, at most ``max_pages``."""
        if self._sync is not None:
            self._sync()
        return self._kv.cached_prefix(hashes, max_pages)

    def freed_by_freeing(self, slots: Int32Array) -> int:
        """Pages that would return to the pool if every table in ``slots`` were freed."""
        return self._kv.freed_by_freeing(slots)
