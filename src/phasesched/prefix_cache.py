"""The KV manager's prefix cache: which pages hold which hashed prefix, and an LRU of idle ones.

A full page may carry a content hash (see :mod:`phasesched.prefix`). While a table references
it, it is *in use*; when its last reference goes it becomes *idle*: still cached, counted as
free, and evicted (its hash dropped) only when a fresh page is wanted and the plain free pool is
empty, least recently released first. A later request whose page hashes match claims the pages
instead of computing them again.

Every change here has an exact inverse (``unpark``, ``unevict``, ``unregister``, ...), so the
scheduler's journal can undo a failed call: idle pages keep the stamp they were parked with,
and restoring one puts it back in its place in the LRU.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice
from operator import itemgetter

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

    pages: tuple[int, ...]
    hashes: tuple[int, ...]
    stamps: tuple[int, ...]


class PrefixCache:
    """Hash <-> page maps, the idle LRU and the counters (internal to :class:`~phasesched.kv.PagedKVManager`).

    Hash to page is a dict (lookups go by hash); page to hash is an array over the pages, so a
    batch of pages is named, tested and unnamed in a few numpy calls rather than a loop.
    """

    def __init__(self, num_pages: int) -> None:
        self._page_of: dict[int, int] = {}
        self._hash_of = np.zeros(num_pages, dtype=np.int64)  # a named page's hash (0 when unnamed)
        self._named = np.zeros(num_pages, dtype=bool)
        self._num_named = 0
        self._idle: OrderedDict[int, int] = OrderedDict()  # page -> stamp, least recent first
        self._stamp = 0
        self._counts = [0, 0, 0, 0]  # queried, hits, evictions, registered: plain ints on the hot path

    @property
    def stats(self) -> CacheStats:
        """The counters so far."""
        return CacheStats(*self._counts)

    @property
    def num_idle(self) -> int:
        """Cached pages no table references."""
        return len(self._idle)

    @property
    def num_hashed(self) -> int:
        """Pages carrying a hash, idle or in use."""
        return self._num_named

    def idle_pages(self) -> list[int]:
        """Idle pages, least recently released first."""
        return list(self._idle)

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
    def park(self, pages: Iterable[int]) -> None:
        """Pages whose last reference went: idle, most recently released."""
        pages = list(pages)
        stamp = self._stamp
        self._idle.update(zip(pages, range(stamp + 1, stamp + 1 + len(pages)), strict=True))
        self._stamp = stamp + len(pages)

    def hashed_among(self, pages: NDArray[np.int32]) -> NDArray[np.bool_]:
        """Which of ``pages`` carry a hash."""
        named: NDArray[np.bool_] = self._named[pages]
        return named

    def unpark(self, pages: Iterable[int]) -> tuple[int, ...]:
        """Take idle ``pages`` out of the LRU (a claim, or undoing :meth:`park`); return their stamps."""
        return tuple(self._idle.pop(page) for page in pages)

    def repark(self, pages: Sequence[int], stamps: Sequence[int]) -> None:
        """Undo :meth:`unpark`: the pages are idle again, in their old places."""
        if not pages:
            return
        self._idle.update(zip(pages, stamps, strict=True))
        self._idle = OrderedDict(sorted(self._idle.items(), key=itemgetter(1)))  # rare: only on rollback

    def evict(self, count: int) -> Evicted:
        """Drop the ``count`` least recently released idle pages from the cache, for reuse."""
        idle = self._idle
        if count > len(idle):
            msg = f"cannot evict {count} of {len(idle)} idle pages"
            raise KeyError(msg)
        pages = tuple(islice(idle, count))  # least recent first; each map below runs without a Python loop
        stamps = tuple(map(idle.pop, pages))
        index = np.fromiter(pages, dtype=np.int64, count=count)
        hashes = tuple(self._hash_of[index].tolist())
        deque(map(self._page_of.pop, hashes), maxlen=0)
        self._unname(index)
        self._counts[2] += count
        return Evicted(pages, hashes, stamps)

    def unevict(self, evicted: Evicted) -> None:
        """Undo :meth:`evict`: the pages are cached and idle again."""
        self._map(evicted.pages, evicted.hashes)
        self.repark(evicted.pages, evicted.stamps)
        self._count(evictions=-len(evicted.pages))

    def register(self, pages: NDArray[np.int32] | Sequence[int], hashes: Sequence[int]) -> tuple[int, ...]:
        """Name freshly filled pages by their hashes, in order; return those registered.

        A page whose hash is already cached, or met earlier in the same call (the same prefix
        computed twice at once), stays unnamed: the first copy is the one later requests share.
        """
        page_of = self._page_of
        if len(pages) != len(hashes):
            msg = f"{len(pages)} pages but {len(hashes)} hashes"
            raise ValueError(msg)
        if not hashes:
            return ()
        index = np.asarray(pages, dtype=np.int64)
        size = len(page_of)
        new_pages: tuple[int, ...] = ()
        if page_of.keys().isdisjoint(hashes) and not self._named[index].any():
            new_pages = tuple(index.tolist())  # the usual case: every page and hash new, named in one C-level update
            page_of.update(zip(hashes, new_pages, strict=True))
            if len(page_of) == size + len(hashes):
                self._name(index, hashes)
            else:  # a hash twice in the call: take the update back and name them one by one
                for value in hashes:
                    page_of.pop(value, None)
        if len(page_of) == size:
            named = []
            for page, value in zip(index.tolist(), hashes, strict=True):
                if value not in page_of and not self._named[page]:
                    page_of[value] = page
                    self._name(np.array([page]), [value])
                    named.append(page)
            new_pages = tuple(named)
        self._counts[3] += len(new_pages)
        return new_pages

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

    def _map(self, pages: Sequence[int], hashes: Sequence[int]) -> None:
        self._page_of.update(zip(hashes, pages, strict=True))
        self._name(np.fromiter(pages, dtype=np.int64, count=len(pages)), hashes)

    def _name(self, pages: NDArray[np.int64], hashes: Sequence[int]) -> None:
        self._hash_of[pages] = hashes
        self._named[pages] = True
        self._num_named += len(pages)

    def _unname(self, pages: NDArray[np.int64]) -> None:
        self._hash_of[pages] = 0
        self._named[pages] = False
        self._num_named -= len(pages)

    def _count(self, *, queried: int = 0, hits: int = 0, evictions: int = 0, registered: int = 0) -> None:
        counts = self._counts
        counts[0] += queried
        counts[1] += hits
        counts[2] += evictions
        counts[3] += registered
