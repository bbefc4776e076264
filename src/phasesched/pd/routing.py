"""The router's rule, shared by the simulator and the P/D runtime: where a request goes.

One worker that can admit the request now comes first (a worker whose KV is full would queue
it however few requests it runs), then the fewest requests, then the lowest index. Where every
worker has room, as with ample KV, that is plain least-loaded routing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

__all__ = ["WorkerLoad", "pick_worker", "pick_worker_by"]


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
    by_index = {w.index: w for w in workers}
    return pick_worker_by([(w.load, w.index) for w in by_index.values()], lambda i: by_index[i].has_room(num_tokens))


def pick_worker_by(loads: Iterable[tuple[int, int]], has_room: Callable[[int], bool]) -> int:
    """:func:`pick_worker`'s rule when finding a worker's room costs more than its load.

    ``loads`` are ``(load, index)`` pairs. Workers are asked ``has_room(index)`` from the least
    loaded (then lowest index) on, and the first with room is the answer: with ample KV, one
    question instead of one per worker. If none has room, the least loaded is.

    Raises:
        ValueError: ``loads`` is empty.

    >>> pick_worker_by([(3, 0), (5, 1)], has_room=lambda index: index == 1)
    1
    """
    order = sorted(loads)
    if not order:
        msg = "no worker to route to"
        raise ValueError(msg)
    return next((index for _, index in order if has_room(index)), order[0][1])
