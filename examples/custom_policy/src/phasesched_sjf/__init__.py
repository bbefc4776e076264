"""Shortest-job-first with aging, as a phasesched policy plugin.

A job's size is what it will cost: its prompt plus the tokens it asks for. Serving small jobs
first minimises mean latency, but a pure SJF order starves large jobs under load; aging counts
every second of waiting as ``aging_tokens_per_s`` tokens off the job's size. The key is fixed
when the request arrives (aging is linear in waiting time, so ordering by
``size + rate * arrival`` is the same as ordering by ``size - rate * waited`` at any instant),
which is what phasesched's waiting queue needs.
"""

from __future__ import annotations

import attrs

from phasesched import PolicyOptions, Request, SchedulingPolicy
from phasesched.policies import presets

__all__ = ["ShortestJobFirst", "sjf"]


@attrs.frozen
class ShortestJobFirst:
    """Order waiting requests by prompt plus requested output, aged by waiting time.

    >>> order = ShortestJobFirst(aging_tokens_per_s=100.0)
    >>> small = Request("small", prompt_len=10, max_new_tokens=10, arrival_time=5.0)
    >>> big = Request("big", prompt_len=500, max_new_tokens=100, arrival_time=0.0)
    >>> order.key(small) < order.key(big)        # 20 + 500 < 600 + 0
    True
    """

    aging_tokens_per_s: float = attrs.field(default=100.0, validator=attrs.validators.gt(0.0))

    def key(self, request: Request) -> tuple[float, float]:
        """Aged job size, then arrival."""
        size = request.prompt_len + request.max_new_tokens
        return (size + self.aging_tokens_per_s * request.arrival_time, request.arrival_time)


def sjf(options: PolicyOptions) -> SchedulingPolicy:
    """The ``sjf`` preset: vLLM's decode-first shared budget, with a shortest-job-first queue."""
    return attrs.evolve(presets.vllm(options), name="sjf", queue_order=ShortestJobFirst())
