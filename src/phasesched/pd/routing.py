"""The router's rule, shared by the simulator and the P/D runtime: where a request goes.

One worker that can admit the request now comes first (a worker whose KV is full would queue
it however few requests it runs), then the fewest requests, then the lowest index. Where every
worker has room, as with ample KV, that is plain least-loaded routing.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

__all__ = ["WorkerLoad", "pick_worker"]


@attrs.frozen
class WorkerLoad:
    """What the router knows of one worker when it places a request.

    Attributes:
        index: The worker's index (its rank, in the runtime); ties go to the lowest.
        load: Requests it holds (running, waiting, or about to arrive).
        free_pages: KV pages it could hand out now.
        watermark_pages: Pages its admissions leave free.
        page_size: Tokens per page.

    """

    index: int
    load: int
    free_pages: int
    watermark_pages: int = 0
    page_size: int = 16

    def has_room(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` of KV fit in the free pages an admission may take now."""
        return -(-num_tokens // self.page_size) <= self.free_pages - self.watermark_pages


def pick_worker(workers: Iterable[WorkerLoad], num_tokens: int) -> int:
    """The index of the worker a request needing ``num_tokens`` of KV goes to.

    Raises:
        ValueError: ``workers`` is empty.

    >>> pick_worker([WorkerLoad(0, load=3, free_pages=0), WorkerLoad(1, load=5, free_pages=64)], 100)
    1
    >>> pick_worker([WorkerLoad(0, load=3, free_pages=64), WorkerLoad(1, load=2, free_pages=64)], 100)
    1
    """
    best = min(workers, key=lambda w: (not w.has_room(num_tokens), w.load, w.index), default=None)
    if best is None:
        msg = "no worker to route to"
        raise ValueError(msg)
    return best.index
