"""Shared Hypothesis strategies: workloads, policies, plugin-like phase priorities, faults."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import attrs
import numpy as np
from hypothesis import strategies as st

from phasesched import PolicyOptions, Request, SchedulingPolicy, Selection, load_policy
from phasesched.policies import DecodeFirst, EqualProgress, PhasePriority, PrefillFirst
from phasesched.policies.builder import AddResult, BatchBuilder
from phasesched.view import SchedulerView

PRESETS = ("vllm", "sarathi", "sglang", "orca", "trtllm-equal-progress", "vllm-priority")
"""Preset names whose policies need no cost model."""

Shape = tuple[int, int, int]
"""A request as ``(prompt_len, max_new_tokens, arrival_step)``."""


def shapes(max_prompt: int = 60, max_output: int = 30, max_arrival: int = 40) -> st.SearchStrategy[Shape]:
    """One request's ``(prompt_len, max_new_tokens, arrival_step)``."""
    return st.tuples(st.integers(1, max_prompt), st.integers(1, max_output), st.integers(0, max_arrival))


def workloads(max_size: int = 8, **bounds: int) -> st.SearchStrategy[list[Shape]]:
    """A few requests, as :func:`shapes`."""
    return st.lists(shapes(**bounds), min_size=1, max_size=max_size)


def request_of(index: int, shape: Shape, *, vocab: int = 50, eos: int | None = None) -> Request:
    """Request ``r{index}`` with token ids ``0 .. prompt_len - 1`` (mod ``vocab``) and priority ``index % 3``."""
    prompt, output, arrival = shape
    return Request(
        f"r{index}",
        prompt_token_ids=[i % vocab for i in range(prompt)],
        max_new_tokens=output,
        arrival_time=float(arrival),
        priority=index % 3,
        eos_token_id=eos,
    )


def preset(name: str, max_model_len: int = 512, chunk_size: int = 16) -> SchedulingPolicy:
    """A preset with a small chunk, so prompts take several steps."""
    return load_policy(name, PolicyOptions(max_model_len=max_model_len, chunk_size=chunk_size))


# --------------------------------------------------------------------------- plugin-like priorities
@attrs.frozen
class PassThrough:
    """A plugin priority that asks a built-in one: the scheduler cannot know that, so it always asks."""

    inner: PhasePriority

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        """Whatever the inner priority selects."""
        return self.inner.select(view, builder)


@attrs.frozen
class CappedDecodes:
    """A plugin that declares ``schedules_every_decode`` but schedules at most ``cap`` decodes (a liar)."""

    cap: int
    schedules_every_decode = True

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        """At most ``cap`` decodes, then ongoing prefills and admissions as decode-first does."""
        decodes = builder.running_decodes()[: self.cap]
        builder.add_running(decodes, np.ones(len(decodes), np.int64))
        for slot in builder.running_prefills().tolist():
            builder.add_prefill_chunk(slot)
        for candidate in view.waiting():
            if builder.admit(candidate) in (AddResult.NO_TOKENS, AddResult.NO_SEQS, AddResult.NO_PAGES):
                break
        return builder.build()


@attrs.frozen
class OldestFirstDecodes:
    """A plugin that declares ``schedules_every_decode`` truthfully but adds decodes oldest-arrival first."""

    schedules_every_decode = True

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        """Decodes by arrival, then decode-first's chunks and admissions."""
        decodes = builder.running_decodes()
        order = decodes[np.argsort(view.arrival_time[decodes], kind="stable")]
        builder.add_running(order, np.ones(len(order), np.int64))
        return DecodeFirst().select(view, builder)


BUILTIN_PRIORITIES: list[PhasePriority] = [
    DecodeFirst(),
    PrefillFirst(),
    PrefillFirst(mix_decodes=True),
    EqualProgress(8),
]


def priorities() -> st.SearchStrategy[PhasePriority]:
    """Built-in priorities and plugin-like ones (wrappers, truthful and lying declarations)."""
    choices: list[PhasePriority] = [
        DecodeFirst(),
        PrefillFirst(),
        PrefillFirst(mix_decodes=True),
        EqualProgress(unit=8),
    ]
    builtins = st.sampled_from(choices)
    return st.one_of(
        builtins,
        builtins.map(PassThrough),
        st.integers(1, 3).map(CappedDecodes),
        st.just(OldestFirstDecodes()),
    )


# --------------------------------------------------------------------------- faults
class InjectedFaultError(Exception):
    """The fault a test injects; nothing in phasesched raises it."""


@attrs.define
class Fault:
    """Raises :class:`InjectedFaultError` on the ``countdown``-th call of whatever it wraps, once."""

    countdown: int
    fired: bool = False
    paused: bool = False
    """While set, calls pass through uncounted (the test's own checks)."""

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Let calls through uncounted inside the block."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def wrap(self, function: Callable[..., object]) -> Callable[..., object]:
        """``function``, failing once when the countdown reaches zero."""

        def wrapped(*args: object, **kwargs: object) -> object:
            if not self.fired and not self.paused:
                self.countdown -= 1
                if self.countdown < 0:
                    self.fired = True
                    msg = "injected"
                    raise InjectedFaultError(msg)
            return function(*args, **kwargs)

        return wrapped
