"""The KV-transfer link between prefill and decode pools: concurrent transfers share its bandwidth.

A fluid (processor-sharing) model: while ``n`` transfers are moving bytes, each gets
``bandwidth / n``. When a transfer's last byte has moved it still takes the fixed latency to
land. The link answers two questions for the event loop: when does the next transfer finish
moving bytes, and which ones have by a given time.
"""

from __future__ import annotations

import math

from phasesched.errors import InvalidArgumentError

__all__ = ["KVLink"]

_ULPS_OF_SLACK = 4
"""How many units in the last place of the clock a finishing time may be off by (the rounding
of ``clock + remaining / rate`` and of the elapsed time that is then subtracted)."""


class KVLink:
    """Transfers in flight over one shared link.

    Args:
        bandwidth_bytes_per_s: Total bandwidth.
        latency_s: Added to every transfer once its bytes have moved.

    >>> link = KVLink(bandwidth_bytes_per_s=100.0, latency_s=0.5)
    >>> link.start("a", 100.0, now=0.0)
    >>> link.start("b", 100.0, now=0.0)     # both at 50 B/s: done moving at t=2
    >>> link.next_done()
    2.0
    >>> link.pop_done(2.0)
    [('a', 2.5), ('b', 2.5)]
    """

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> None:
        if not bandwidth_bytes_per_s > 0:
            msg = f"bandwidth must be positive, got {bandwidth_bytes_per_s}"
            raise InvalidArgumentError(msg)
        self.bandwidth = bandwidth_bytes_per_s
        self.latency = latency_s
        self._remaining: dict[str, float] = {}
        self._clock = 0.0

    @property
    def active(self) -> int:
        """Transfers still moving bytes."""
        return len(self._remaining)

    def start(self, transfer_id: str, size_bytes: float, now: float) -> None:
        """Begin moving ``size_bytes`` at ``now`` (slowing the transfers already in flight)."""
        self._advance(now)
        self._remaining[transfer_id] = max(size_bytes, 0.0)

    def next_done(self) -> float:
        """When the next transfer finishes moving bytes, if nothing else starts (``inf`` if idle)."""
        if not self._remaining:
            return math.inf
        done = self._clock + min(self._remaining.values()) * len(self._remaining) / self.bandwidth
        # Far from t = 0 a short remainder rounds to the clock itself; the next event must still
        # move time on, or the event loop would meet it at the same instant for ever.
        return max(done, math.nextafter(self._clock, math.inf))

    def pop_done(self, now: float) -> list[tuple[str, float]]:
        """Transfers whose bytes have all moved by ``now``, with the time each lands (after the latency)."""
        self._advance(now)
        # Done: a picosecond's worth of bytes left, or less than the clock can still resolve at
        # ``now`` (a remainder no later event time could tell apart from ``now``).
        share = self.bandwidth / max(len(self._remaining), 1)
        tolerance = max(self.bandwidth * 1e-12, _ULPS_OF_SLACK * math.ulp(now) * share)
        done = [tid for tid, left in self._remaining.items() if left <= tolerance]
        for tid in done:
            del self._remaining[tid]
        return [(tid, now + self.latency) for tid in done]

    def _advance(self, now: float) -> None:
        if self._remaining and now > self._clock:
            moved = (now - self._clock) * self.bandwidth / len(self._remaining)
            for tid in self._remaining:
                self._remaining[tid] -= moved
        self._clock = max(self._clock, now)
