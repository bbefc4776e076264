"""The KV manager's prefix cache: which pages hold which hashed prefix, and an LRU of idle ones.

A full page may carry a content hash (see :mod:`phasesched.prefix`). While a table references
it, it is *in use*; when its last reference goes it becomes *idle*: still cached, counted as
free, and evicted (its hash dropped) only when a fresh page is wanted and the plain free pool is
empty, least recently released first. A later request whose page hashes match claims the pages
instead of computing them again.

Every change here has an exact inverse (``unpark``, ``unevict``, ``unregister``, ...), so the
scheduler's journal can undo a failed call: idle pages keep the stamp they were parked with,
and restoring one puts it back in its place in the LRU.

The LRU and the names are numpy arrays over the pages, so parking, claiming and evicting a
chunk's worth of pages costs a few numpy calls; only the hash -> page dict is touched per page.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs
import numpy as np
from numpy.typing import NDArray

__all__ = ["CacheStats", "Evicted", "PrefixCache"]


@attrs.frozen
class CacheStats:
    """Prefix-cache counters, in pages.

    Attributes:
        queried: Full prompt pages that admissions looked up.
        hits: Of those, pages found cached and claimed instead of computed.
        evictions: Idle cached pages reused for new content.
        registered: Pages that received a hash when they filled.

    """

    queried: int = 0
    hits: int = 0
    evictions: int = 0
    registered: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits per queried page (0 when nothing was queried)."""
        return self.hits / self.queried if self.queried else 0.0


@attrs.frozen(eq=False)
class Evicted:
    """Pages :meth:`PrefixCache.evict` dropped, with what :meth:`PrefixCache.unevict` needs (opaque)."""

    pages: NDArray[np.int32]
    hashes: tuple[int, ...]
    stamps: NDArray[np.int64]


class _IdleQueue:
    """Idle pages in release order (least recent first), as numpy arrays.

    Parking appends ``(page, stamp)`` entries with rising stamps, so the entries stay sorted by
    stamp. Taking a page out (a claim, an eviction) only clears ``stamp_of[page]``: an entry is
    *live* while its page's stamp is its own, so a claim costs no search. Evicting takes the
    first live entries from the head; dead ones are dropped when the arrays are compacted.
    :meth:`restore` (rollbacks only) puts entries back in stamp order.
    """

    def __init__(self, num_pages: int) -> None:
        self.stamp_of = np.zeros(num_pages, dtype=np.int64)  # an idle page's stamp; 0 when not idle
        self.count = 0
        size = 2 * num_pages + 64  # live entries never exceed the pages: compaction always makes room
        self._pages = np.zeros(size, dtype=np.int32)
        self._stamps = np.zeros(size, dtype=np.int64)
        self._head = self._tail = 0
        self._last_stamp = 0
        self._peeked: tuple[int, tuple[NDArray[np.int32], NDArray[np.int64], int]] | None = None
        """The last :meth:`oldest` answer, kept until the queue changes (an eviction asks it twice)."""

    def live(self) -> NDArray[np.int32]:
        """The idle pages, least recently released first."""
        pages, stamps = self._pages[self._head : self._tail], self._stamps[self._head : self._tail]
        live: NDArray[np.int32] = pages[self.stamp_of[pages] == stamps]
        return live

    def push(self, pages: NDArray[np.int32]) -> None:
        """Pages (none idle now, each once) become idle, most recently released, in order."""
        count = len(pages)
        self._peeked = None
        if self._tail + count > len(self._pages):
            self._compact()
        stamps = np.arange(self._last_stamp + 1, self._last_stamp + 1 + count, dtype=np.int64)
        tail = self._tail
        self._pages[tail : tail + count] = pages
        self._stamps[tail : tail + count] = stamps
        self.stamp_of[pages] = stamps
        self._tail = tail + count
        self._last_stamp += count
        self.count += count

    def take(self, pages: NDArray[np.int32]) -> NDArray[np.int64]:
        """Take idle ``pages`` out; return their stamps, for :meth:`restore`."""
        self._peeked = None
        stamps = self.stamp_of[pages]
        if not stamps.all():
            msg = f"pages {pages[stamps == 0].tolist()} are not idle"
            raise KeyError(msg)
        self.stamp_of[pages] = 0
        self.count -= len(pages)
        return stamps

    def oldest(self, count: int) -> tuple[NDArray[np.int32], NDArray[np.int64], int]:
        """The ``count`` least recently released idle pages, their stamps and the entry after the last."""
        if self._peeked is not None and self._peeked[0] == count:
            return self._peeked[1]
        if count > self.count:
            msg = f"cannot evict {count} of {self.count} idle pages"
            raise KeyError(msg)
        head, window = self._head, count
        while True:  # usually once: dead entries (claimed pages) near the head are few
            stop = min(head + window, self._tail)
            pages, stamps = self._pages[head:stop], self._stamps[head:stop]
            live = (self.stamp_of[pages] == stamps).nonzero()[0]
            if len(live) >= count:
                break
            assert stop < self._tail, "an idle page has no entry in the LRU"
            window *= 2
        chosen = live[:count]
        oldest = pages[chosen], stamps[chosen], head + int(chosen[-1]) + 1 if count else head
        self._peeked = count, oldest
        return oldest

    def take_oldest(self, count: int) -> tuple[NDArray[np.int32], NDArray[np.int64]]:
        """Take the ``count`` least recently released idle pages out; return them and their stamps."""
        pages, stamps, self._head = self.oldest(count)
        self._peeked = None
        self.stamp_of[pages] = 0
        self.count -= count
        return pages, stamps

    def restore(self, pages: NDArray[np.int32], stamps: NDArray[np.int64]) -> None:
        """Undo :meth:`take` or :meth:`take_oldest`: the pages are idle again, in their old places."""
        if not len(pages):
            return
        self._peeked = None
        self.stamp_of[pages] = stamps
        self.count += len(pages)
        kept = self._stamps[self._head : self._tail]
        at = np.searchsorted(kept, stamps)
        present = at < len(kept)
        present[present] = kept[at[present]] == stamps[present]
        if present.all():
            return
        # Their entries were passed by an eviction or compacted away: merge them back in stamp order.
        merged_pages = np.concatenate([self._pages[self._head : self._tail], pages[~present]])
        merged_stamps = np.concatenate([kept, stamps[~present]])
        order = np.argsort(merged_stamps, kind="stable")
        self._place(merged_pages[order], merged_stamps[order])

    def _compact(self) -> None:
        """Drop dead entries, moving the live ones to the front."""
        pages, stamps = self._pages[self._head : self._tail], self._stamps[self._head : self._tail]
        live = self.stamp_of[pages] == stamps
        self._place(pages[live], stamps[live])

    def _place(self, pages: NDArray[np.int32], stamps: NDArray[np.int64]) -> None:
        count = len(pages)
        if count + len(self.stamp_of) > len(self._pages):  # keep room to push every page once
            self._pages = np.zeros(2 * (count + len(self.stamp_of)), dtype=np.int32)
            self._stamps = np.zeros(len(self._pages), dtype=np.int64)
        self._pages[:count] = pages
        self._stamps[:count] = stamps
        self._head, self._tail = 0, count


class PrefixCache:
    """Hash <-> page maps, the idle LRU and the counters (internal to :class:`~phasesched.kv.PagedKVManager`).

    Hash to page is a dict (lookups go by hash); page to hash is an array over the pages, so a
    batch of pages is named, tested and unnamed in a few numpy calls rather than a loop.
    """

    def __init__(self, num_pages: int) -> None:
        self._page_of: dict[int, int] = {}
        self._hash_of = np.zeros(num_pages, dtype=np.int64)  # a named page's hash (0 when unnamed)
        self._parent_of = np.zeros(num_pages, dtype=np.int64)  # the hash of the page before it, if known
        self._parent_known = np.zeros(num_pages, dtype=bool)
        self._named = np.zeros(num_pages, dtype=bool)
        self._num_named = 0
        self._idle = _IdleQueue(num_pages)
        self._counts = [0, 0, 0, 0]  # queried, hits, evictions, registered: plain ints on the hot path

    @property
    def stats(self) -> CacheStats:
        """The counters so far."""
        return CacheStats(*self._counts)

    @property
    def num_idle(self) -> int:
        """Cached pages no table references."""
        return self._idle.count

    @property
    def num_hashed(self) -> int:
        """Pages carrying a hash, idle or in use."""
        return self._num_named

    def idle_pages(self) -> list[int]:
        """Idle pages, least recently released first."""
        pages: list[int] = self._idle.live().tolist()
        return pages

    def is_hashed(self, page: int) -> bool:
        """Whether ``page`` carries a hash."""
        return bool(self._named[page])

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Pages holding the longest cached run of ``hashes`` from the start."""
        pages = []
        for value in hashes:
            page = self._page_of.get(value)
            if page is None:
                break
            pages.append(page)
        return pages

    # ---------------------------------------------------------------- changes and their inverses
    def park(self, pages: NDArray[np.int32]) -> None:
        """Pages whose last reference went: idle, most recently released, in order."""
        self._idle.push(pages)

    def hashed_among(self, pages: NDArray[np.int32]) -> NDArray[np.bool_]:
        """Which of ``pages`` carry a hash."""
        named: NDArray[np.bool_] = self._named[pages]
        return named

    def unpark(self, pages: NDArray[np.int32]) -> NDArray[np.int64]:
        """Take idle ``pages`` out of the LRU (a claim, or undoing :meth:`park`); return their stamps."""
        return self._idle.take(pages)

    def repark(self, pages: NDArray[np.int32], stamps: NDArray[np.int64]) -> None:
        """Undo :meth:`unpark`: the pages are idle again, in their old places."""
        self._idle.restore(pages, stamps)

    def evict(self, count: int) -> Evicted:
        """Drop the ``count`` least recently released idle pages from the cache, for reuse."""
        pages, stamps = self._idle.take_oldest(count)  # least recent first
        hashes = tuple(self._hash_of[pages].tolist())
        deque(map(self._page_of.pop, hashes), maxlen=0)  # the one loop per page, in C
        self._unname(pages)
        self._counts[2] += count
        return Evicted(pages, hashes, stamps)

    def parents_to_evict(self, count: int) -> set[int] | None:
        """The parents' hashes of the pages :meth:`evict` would drop for ``count`` now (``None``: some unknown)."""
        pages, _, _ = self._idle.oldest(count)
        if not self._parent_known[pages].all():
            return None
        return set(self._parent_of[pages].tolist())

    def unevict(self, evicted: Evicted) -> None:
        """Undo :meth:`evict`: the pages are cached and idle again."""
        self._page_of.update(zip(evicted.hashes, evicted.pages.tolist(), strict=True))
        self._name(evicted.pages, evicted.hashes)
        self.repark(evicted.pages, evicted.stamps)
        self._count(evictions=-len(evicted.pages))

    def register(
        self,
        pages: NDArray[np.int32] | Sequence[int],
        hashes: Sequence[int],
        parents: NDArray[np.int64] | Sequence[int] | None = None,
        *,
        hash_array: NDArray[np.int64] | None = None,
    ) -> tuple[int, ...]:
        """Name freshly filled pages by their hashes, in order; return those registered.

        A page whose hash is already cached, or met earlier in the same call (the same prefix
        computed twice at once), stays unnamed: the first copy is the one later requests share.
        ``parents`` are the hashes of the pages before them in their sequences, when known
        (:meth:`parents_to_evict` reads them); ``hash_array``, ``hashes`` as an array if the
        caller made one (converting a list costs about as much as the rest of the call).
        """
        if len(pages) != len(hashes):
            msg = f"{len(pages)} pages but {len(hashes)} hashes"
            raise ValueError(msg)
        if not hashes:
            return ()
        index = np.asarray(pages, dtype=np.int64)
        if self._named[index].any():  # a page carries a hash already: it keeps it
            return self._register_each(index, hashes, parents)
        listed = index.tolist()
        # One C-level pass names every page whose hash is new: ``setdefault`` leaves a hash
        # already cached, or met earlier in the call, with its first page, and returns that page.
        kept = list(map(self._page_of.setdefault, hashes, listed))
        if kept == listed:  # the usual case: every hash new
            self._name(index, hashes if hash_array is None else hash_array)
            self._set_parents(index, parents)
            self._counts[3] += len(listed)
            return tuple(listed)
        fresh = np.fromiter(map(int.__eq__, kept, listed), dtype=bool, count=len(listed)).nonzero()[0]
        self._name(index[fresh], (np.asarray(hashes, dtype=np.int64) if hash_array is None else hash_array)[fresh])
        self._set_parents(index[fresh], None if parents is None else np.asarray(parents, dtype=np.int64)[fresh])
        self._counts[3] += len(fresh)
        return tuple(index[fresh].tolist())

    def _register_each(
        self, index: NDArray[np.int64], hashes: Sequence[int], parents: NDArray[np.int64] | Sequence[int] | None
    ) -> tuple[int, ...]:
        """:meth:`register`, page by page, when some pages carry a hash already."""
        page_of, named = self._page_of, []
        for at, (page, value) in enumerate(zip(index.tolist(), hashes, strict=True)):
            if value not in page_of and not self._named[page]:
                page_of[value] = page
                self._name(np.array([page]), [value])
                self._set_parents(np.array([page]), None if parents is None else [parents[at]])
                named.append(page)
        self._counts[3] += len(named)
        return tuple(named)

    def unregister(self, pages: Sequence[int]) -> None:
        """Undo :meth:`register` (the pages are in use, so not idle)."""
        if not pages:
            return
        index = np.fromiter(pages, dtype=np.int64, count=len(pages))
        deque(map(self._page_of.pop, self._hash_of[index].tolist()), maxlen=0)
        self._unname(index)
        self._count(registered=-len(pages))

    def count_lookup(self, queried: int, hits: int) -> None:
        """Count an admission's lookup (negative counts undo one)."""
        self._count(queried=queried, hits=hits)

    def _name(self, pages: NDArray[np.integer], hashes: Sequence[int] | NDArray[np.int64]) -> None:
        self._hash_of[pages] = hashes
        self._named[pages] = True
        self._num_named += len(pages)

    def _set_parents(self, pages: NDArray[np.integer], parents: NDArray[np.int64] | Sequence[int] | None) -> None:
        if parents is None:
            self._parent_known[pages] = False
        else:
            self._parent_of[pages] = parents
            self._parent_known[pages] = True

    def _unname(self, pages: NDArray[np.integer]) -> None:
        self._hash_of[pages] = 0
        self._named[pages] = False
        self._num_named -= len(pages)

    def _count(self, *, queried: int = 0, hits: int = 0, evictions: int = 0, registered: int = 0) -> None:
        counts = self._counts
        counts[0] += queried
        counts[1] += hits
        counts[2] += evictions
        counts[3] += registered
