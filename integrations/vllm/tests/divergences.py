"""The adapter's documented, deliberate divergences from vLLM's scheduler, recognised at the step they start.

A differential run compares two step-by-step traces. The first step where they differ must be
one of these kinds, else the test fails; once a run has diverged, the rest of it is not
compared (both runs still go to completion, so the adapter cannot livelock unnoticed). Each
kind is documented in ``docs/how-to/vllm.md`` and shown on a fixed workload in
``test_divergences.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from phasesched_vllm.testing import RequestSpec, StepRecord


class Divergence(enum.Enum):
    """Why the adapter's step differs from vLLM's."""

    SELF_PREEMPTION = "self-preemption"
    """Priority scheduling: when the request vLLM is scheduling is itself the least important
    and gets preempted, vLLM stops scheduling running requests for the step; phasesched goes on
    with the rest."""
    PREEMPT_FOR_WAITING = "preempt-for-waiting"
    """``vllm-priority``: a waiting request evicts running requests it outranks when the
    sequence cap or KV memory keeps it out; vLLM V1 makes it wait."""
    SAME_STEP_PREFIX_HIT = "same-step-prefix-hit"
    """Prefix caching: a request admitted in the same step as another with the same prefix
    reuses its blocks in vLLM (which allocates while it plans); the adapter's policy plans the
    step before any allocation, so it counts the second request's prefix as uncached."""


def _index(request_id: str) -> int:
    return int(request_id.removeprefix("r"))


def _waiting_priority(step: int, history: Sequence[StepRecord], workload: Sequence[RequestSpec]) -> int | None:
    """The best priority among requests that had arrived, not finished, and were not running before ``step``."""
    finished = {r for record in history[:step] for r in record.finished}
    started = {r for record in history[:step] for r, _ in record.scheduled}
    preempted_last = {r for record in history[:step] for r in record.preempted}
    waiting = [
        spec.priority
        for i, spec in enumerate(workload)
        if spec.arrival_step <= step
        and f"r{i}" not in finished
        and (f"r{i}" not in started or f"r{i}" in preempted_last)
    ]
    return min(waiting, default=None)


def classify(
    native: StepRecord,
    adapted: StepRecord,
    workload: Sequence[RequestSpec],
    allowed: frozenset[Divergence],
    history: Sequence[StepRecord] = (),
) -> Divergence | None:
    """The documented divergence that explains the first differing step, if one of ``allowed`` does.

    ``history`` is the (common) run before that step.
    """
    a, b = dict(native.scheduled), dict(adapted.scheduled)
    if (
        Divergence.SELF_PREEMPTION in allowed
        and native.preempted
        and native.preempted == adapted.preempted
        and not native.new | native.resumed
        and native.new | native.resumed == adapted.new | adapted.resumed
        and a.items() < b.items()
    ):
        return Divergence.SELF_PREEMPTION
    extra = adapted.preempted - native.preempted
    admitted = adapted.new | adapted.resumed
    if Divergence.PREEMPT_FOR_WAITING in allowed and extra:
        # The victims are outranked by a request admitted in the step or, when an ongoing
        # prefill then took the budget (phasesched reserves seats before it counts tokens),
        # by one still waiting.
        best = min((workload[_index(r)].priority for r in admitted), default=None)
        if best is None:
            best = _waiting_priority(len(history), history, workload)
        if best is not None and all(workload[_index(r)].priority > best for r in extra):
            return Divergence.PREEMPT_FOR_WAITING
    if Divergence.SAME_STEP_PREFIX_HIT in allowed:
        groups = [workload[_index(r)].prefix for r in native.new | native.resumed]
        shared = {g for g in groups if g and groups.count(g) > 1}
        involved = (native.new ^ adapted.new) | (native.resumed ^ adapted.resumed)
        involved |= {r for r in a.keys() & b.keys() if a[r] != b[r]} | (native.finished ^ adapted.finished)
        if shared and involved and any(workload[_index(r)].prefix in shared for r in involved):
            return Divergence.SAME_STEP_PREFIX_HIT
    return None
