"""The mixed-step fast path (decodes kept from step to step beside chunks and admissions) plans as the policy does.

Two schedulers run the same requests and events in lockstep: one as configured, which takes the
steady and mixed fast paths where they apply, and one whose priority sits behind a plugin wrapper,
so it asks the policy and checks its selection in full every step. Every plan (each metadata array
with its dtype), every outcome and every finished record must be the same, through aborts (queued
and in flight), abandoned plans, executor-reported finishes, EOS and stop tokens, prefix-cache hits,
transferred (precomputed) prompts and preemptions.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import attrs
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import phasesched.scheduler
from phasesched import (
    DeterministicExecutor,
    PolicyOptions,
    Request,
    RequestRejectedError,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    Selection,
    StepPlan,
    StepResult,
    load_policy,
)
from phasesched.policies import DecodeFirst, FixedChunk, LongestPrefixMatch
from phasesched.policies.builder import AddResult, BatchBuilder
from phasesched.request import decodes_next
from tests.strategies import PassThrough

ARRAYS = (
    "slots",
    "start",
    "num_new",
    "prompt_len",
    "samples",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "kv_len",
    "positions",
)
VOCAB = 23


def plan_shape(plan: StepPlan) -> tuple[object, ...]:
    """Everything a plan says, arrays with their dtypes."""
    arrays = tuple((name, getattr(plan, name).dtype.str, getattr(plan, name).tolist()) for name in ARRAYS)
    ids = None if plan.input_ids is None else (plan.input_ids.dtype.str, plan.input_ids.tolist())
    return (
        plan.step_id,
        plan.request_ids,
        arrays,
        ids,
        plan.page_size,
        plan.preempted,
        tuple(r.request_id for r in plan.new_requests),
        plan.released,
    )


@attrs.frozen
class Arrival:
    """One request of a workload."""

    step: int
    prompt_len: int
    max_new_tokens: int
    with_ids: bool
    shared_prefix: int
    eos: bool
    stop: bool
    precomputed: int
    arrival_time: float = 0.0


NOW = st.just(0.0)
"""Every request arriving at 0 (victims then go by their places in the running order alone)."""
PROMPT_LENS = st.integers(1, 48)


@st.composite
def arrivals(
    draw: st.DrawFn, arrival_times: st.SearchStrategy[float] = NOW, prompt_lens: st.SearchStrategy[int] = PROMPT_LENS
) -> Arrival:
    prompt_len = draw(prompt_lens)
    return Arrival(
        arrival_time=draw(arrival_times),
        step=draw(st.integers(0, 20)),
        prompt_len=prompt_len,
        max_new_tokens=draw(st.integers(1, 24)),
        with_ids=draw(st.booleans()) or draw(st.booleans()),
        shared_prefix=draw(st.integers(0, prompt_len)),
        eos=draw(st.integers(0, 4)) == 0,
        stop=draw(st.integers(0, 5)) == 0,
        precomputed=draw(st.integers(0, prompt_len - 1)) if draw(st.integers(0, 5)) == 0 else 0,
    )


def request_of(index: int, arrival: Arrival) -> Request:
    """Request ``r{index}``: its prompt shares ``shared_prefix`` leading tokens with every other one."""
    if not arrival.with_ids:
        return Request(
            f"r{index}",
            prompt_len=arrival.prompt_len,
            max_new_tokens=arrival.max_new_tokens,
            arrival_time=arrival.arrival_time,
        )
    prompt = [i % VOCAB if i < arrival.shared_prefix else (index * 7 + i) % VOCAB for i in range(arrival.prompt_len)]
    return Request(
        f"r{index}",
        prompt_token_ids=prompt,
        max_new_tokens=arrival.max_new_tokens,
        arrival_time=arrival.arrival_time,
        eos_token_id=5 if arrival.eos else None,
        stop_token_ids=(7,) if arrival.stop else (),
    )


@attrs.frozen
class Events:
    """What happens around each step (drawn per step)."""

    abort_queued: bool
    abort_in_flight: bool
    abandon: bool
    executor_finish: bool
    pick: int


events = st.builds(
    Events,
    abort_queued=st.integers(0, 24).map(lambda v: v == 0),
    abort_in_flight=st.integers(0, 24).map(lambda v: v == 0),
    abandon=st.integers(0, 24).map(lambda v: v == 0),
    executor_finish=st.integers(0, 24).map(lambda v: v == 0),
    pick=st.integers(0, 1000),
)


@st.composite
def policies(draw: st.DrawFn) -> SchedulingPolicy:
    """Decode-first presets (the mixed path's policies) with small budgets, chunks and caches."""
    name = draw(st.sampled_from(("vllm", "sarathi", "orca")))
    options = PolicyOptions(
        max_model_len=256,
        chunk_size=draw(st.sampled_from((4, 8, 16))),
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.sampled_from((3, 8, 24, 64))),
        enable_prefix_caching=draw(st.booleans()),
    )
    policy = load_policy(name, options)
    if draw(st.booleans()):  # a fixed chunk beside the preset's own sizer
        policy = attrs.evolve(policy, chunker=FixedChunk(draw(st.integers(1, 12))))
    if draw(st.booleans()):  # few declines before the step stops looking (vllm's partial-prefill caps decline)
        policy = attrs.evolve(policy, priority=DecodeFirst(max_declined=draw(st.integers(0, 2))))
    return policy


class Twin:
    """A scheduler and its record of everything it said."""

    def __init__(self, policy: SchedulingPolicy, pages: int, watermark: float) -> None:
        config = SchedulerConfig(num_pages=pages, page_size=4, max_model_len=256, watermark=watermark)
        self.scheduler = Scheduler(config, policy)
        self.seen: list[object] = []

    def held(self) -> list[str]:
        return [*self.scheduler.running_request_ids(), *self.scheduler.waiting_request_ids()]


def run(policy: SchedulingPolicy, workload: list[Arrival], steps: list[Events], pages: int, watermark: float) -> None:
    """Run the twins in lockstep and hold every plan, outcome and record of the two together."""
    fast = Twin(policy, pages, watermark)
    slow = Twin(attrs.evolve(policy, priority=PassThrough(policy.priority)), pages, watermark)
    executor = DeterministicExecutor(vocab_size=VOCAB)
    pending = sorted(enumerate(workload), key=lambda item: item[1].step)
    for step, event in enumerate(steps):
        while pending and pending[0][1].step <= step:
            index, arrival = pending.pop(0)
            for twin in (fast, slow):
                with contextlib.suppress(RequestRejectedError):  # too big for this cache: both skip it
                    twin.scheduler.add_request(request_of(index, arrival), precomputed_tokens=arrival.precomputed)
        assert fast.held() == slow.held()
        if event.abort_queued and fast.held():
            victim = fast.held()[event.pick % len(fast.held())]
            assert fast.scheduler.abort(victim) == slow.scheduler.abort(victim)
        plans = [twin.scheduler.schedule(float(step)) for twin in (fast, slow)]
        assert plan_shape(plans[0]) == plan_shape(plans[1])
        plan = plans[0]
        if event.abort_in_flight and plan.request_ids:
            victim = plan.request_ids[event.pick % len(plan.request_ids)]
            assert fast.scheduler.abort(victim) == slow.scheduler.abort(victim)
        if event.abandon:
            assert fast.scheduler.abandon(plans[0]) == slow.scheduler.abandon(plans[1])
            continue
        result = executor.execute(plan)
        if event.executor_finish and plan.batch_size:
            finished = np.zeros(plan.batch_size, dtype=bool)
            finished[event.pick % plan.batch_size] = True
            result = StepResult(step_id=plan.step_id, token_ids=result.token_ids, finished=finished)
        outcomes = [twin.scheduler.update(p, result) for twin, p in ((fast, plans[0]), (slow, plans[1]))]
        a, b = outcomes
        assert (a.step_id, a.request_ids, a.new_token_ids.dtype.str, a.new_token_ids.tolist(), a.finished) == (
            b.step_id,
            b.request_ids,
            b.new_token_ids.dtype.str,
            b.new_token_ids.tolist(),
            b.finished,
        )
        for twin in (fast, slow):
            twin.scheduler.check_invariants()
        assert fast.scheduler.kv.cache_stats == slow.scheduler.kv.cache_stats
        check_completions(fast.scheduler)


def check_completions(scheduler: Scheduler) -> None:
    """The mixed path's check for a prefill that completed is the phase rule, for one slot and for several.

    A wrong answer there rarely shows in the plans (a core rebuilt a step early plans the same
    step), so it is held to the rule directly.
    """
    arrays, running = scheduler._arrays, scheduler._running
    rule = decodes_next(arrays.computed[running], arrays.known[running], arrays.prompt_len[running])
    for slot, decodes in zip(running.tolist(), rule.tolist(), strict=True):
        assert scheduler._decodes_among(np.array([slot], dtype=np.int32)) == decodes
    if len(running) > 1:
        assert scheduler._decodes_among(running) == bool(rule.any())


def decoding_beside_a_long_prompt(
    policy: SchedulingPolicy, *, decodes: int, prompt_len: int
) -> tuple[Scheduler, DeterministicExecutor]:
    """A scheduler whose ``decodes`` short requests decode (``d0``, ...) while ``long`` waits."""
    scheduler = Scheduler(SchedulerConfig(num_pages=128, page_size=4), policy)
    executor = DeterministicExecutor()
    for i in range(decodes):
        scheduler.add_request(Request(f"d{i}", prompt_token_ids=[i, 1, 2], max_new_tokens=40))
    plan = scheduler.schedule()
    scheduler.update(plan, executor.execute(plan))
    scheduler.add_request(Request("long", prompt_token_ids=list(range(prompt_len)), max_new_tokens=2))
    return scheduler, executor


SETTINGS = settings(deadline=None, max_examples=250, suppress_health_check=[HealthCheck.too_slow])
NO_CORE = 1 << 30
"""A ``_MIXED_CORE_MIN`` no workload here reaches."""


@st.composite
def crowded_policies(draw: st.DrawFn) -> SchedulingPolicy:
    """:func:`policies` seating several requests, with a token budget that holds every decode: only pages bind."""
    policy = draw(policies())
    budget = attrs.evolve(
        policy.budget,
        max_num_batched_tokens=draw(st.sampled_from((16, 24))),
        max_num_seqs=draw(st.sampled_from((4, 8))),
    )
    return attrs.evolve(policy, budget=budget)


class TestPreemptingSteps:
    """Decode-first steps whose decodes' pages do not all fit: worked out from the state, victims included."""

    @given(
        policy=crowded_policies(),
        # Arrival times out of step with the order requests come in, and ties: the victims go by
        # arrival, then by place in the running order (where preempted requests come back last).
        # Short prompts of few lengths: many decodes start pages in the same steps, and victims
        # holding a page or two (or only pages others share) free too few for one to be enough; a
        # longer one is still prefilling when the latest arrival is preempted.
        workload=st.lists(
            arrivals(st.sampled_from((0.0, 1.0, 2.0, 3.5)), st.sampled_from((1, 3, 4, 5, 8, 30))),
            min_size=4,
            max_size=14,
        ),
        steps=st.lists(events, min_size=20, max_size=80),
        pages=st.integers(6, 24),
        core_min=st.sampled_from((0, NO_CORE)),
    )
    @settings(SETTINGS, max_examples=400)
    def test_plans_match_the_policy_asked_in_full(
        self, policy: SchedulingPolicy, workload: list[Arrival], steps: list[Events], pages: int, core_min: int
    ) -> None:
        """With few pages, preemptions are frequent, and the two schedulers still say the same."""
        with mock.patch.object(phasesched.scheduler, "_MIXED_CORE_MIN", core_min):
            run(policy, workload, steps, pages, 0.0)

    def test_a_preempting_step_is_not_asked_of_the_policy(self) -> None:
        """Decodes short of pages preempt the latest arrival, even one already in the step, without the builder."""
        policy = load_policy("vllm", PolicyOptions(max_num_batched_tokens=16, max_num_seqs=8))
        fast, slow = (
            Scheduler(SchedulerConfig(num_pages=7, page_size=4), p)
            for p in (policy, attrs.evolve(policy, priority=PassThrough(policy.priority)))
        )
        executor = DeterministicExecutor()

        def step(*, asked: bool = True) -> StepPlan:
            """A step of both; with ``asked=False`` the first must plan it without its policy."""
            refused = mock.patch.object(Scheduler, "_ask_policy", side_effect=AssertionError("asked"))
            with contextlib.nullcontext() if asked else refused:
                plan = fast.schedule()
            other = slow.schedule()
            assert plan_shape(plan) == plan_shape(other)
            for scheduler, planned in ((fast, plan), (slow, other)):
                scheduler.update(planned, executor.execute(planned))
            return plan

        # a2 arrived last but is admitted first: it leads the decodes, so when a0 finds no page,
        # a2 is the victim though the step had already taken it (a0 takes the page a2 gave back).
        for scheduler in (fast, slow):
            scheduler.add_request(Request("a2", prompt_token_ids=[1, 2, 3], max_new_tokens=20, arrival_time=2.0))
        step()
        for scheduler in (fast, slow):
            for name, arrival in (("a0", 0.0), ("a1", 1.0)):
                scheduler.add_request(
                    Request(name, prompt_token_ids=[1, 2, 3], max_new_tokens=20, arrival_time=arrival)
                )
        with mock.patch.object(phasesched.scheduler, "_MIXED_CORE_MIN", NO_CORE):
            plans = [step(asked=False) for _ in range(12)]
        preempting = [plan for plan in plans if plan.preempted]
        assert [(plan.preempted, plan.request_ids) for plan in preempting] == [
            (("a2",), ("a0", "a1")),
            (("a1",), ("a0",)),
        ]

    @staticmethod
    def lockstep(
        policy: SchedulingPolicy, pages: int, arrivals: dict[int, list[Request]], steps: int
    ) -> list[StepPlan]:
        """Two schedulers in lockstep, the second asking its policy: every plan the same; the first's plans."""
        fast, slow = (
            Scheduler(SchedulerConfig(num_pages=pages, page_size=4), p)
            for p in (policy, attrs.evolve(policy, priority=PassThrough(policy.priority)))
        )
        executor, plans = DeterministicExecutor(), []
        with mock.patch.object(phasesched.scheduler, "_MIXED_CORE_MIN", NO_CORE):
            for step in range(steps):
                for request in arrivals.get(step, []):
                    for scheduler in (fast, slow):
                        scheduler.add_request(request)
                plan, other = fast.schedule(), slow.schedule()
                assert plan_shape(plan) == plan_shape(other), step
                for scheduler, planned in ((fast, plan), (slow, other)):
                    scheduler.update(planned, executor.execute(planned))
                plans.append(plan)
        return plans

    def test_victims_sharing_pages_free_them_together(self) -> None:
        """The second victim frees the prompt pages it shares with the first: neither alone would have."""
        policy = load_policy(
            "vllm", PolicyOptions(max_num_batched_tokens=24, max_num_seqs=8, enable_prefix_caching=True)
        )
        first = [Request(f"x{i}", prompt_token_ids=[100 + i] * 3, max_new_tokens=20) for i in range(5)]
        first.append(Request("y", prompt_token_ids=[*range(1, 9), 50], max_new_tokens=20, arrival_time=2.0))
        later = [Request("z", prompt_token_ids=[*range(1, 9), 60], max_new_tokens=20, arrival_time=3.0)]
        plans = self.lockstep(policy, 11, {0: first, 1: later}, 30)
        assert ("z", "y") in [plan.preempted for plan in plans]

    def test_a_victim_in_the_step_gives_its_token_back(self) -> None:
        """A victim taken out of the step returns its token to the budget: the ongoing chunk after it is the larger."""
        options = PolicyOptions(max_num_batched_tokens=5, max_num_seqs=8)
        policy = attrs.evolve(load_policy("vllm", options), chunker=FixedChunk(4))
        arrivals = {
            0: [Request("a", prompt_len=1, max_new_tokens=30, arrival_time=2.0)],
            1: [
                Request("b", prompt_len=3, max_new_tokens=30, arrival_time=0.0),
                Request("p", prompt_len=20, max_new_tokens=3, arrival_time=1.0),
            ],
        }
        plans = self.lockstep(policy, 8, arrivals, 40)
        preempting = [plan for plan in plans if plan.preempted == ("a",)]
        assert preempting
        assert dict(zip(preempting[0].request_ids, preempting[0].num_new.tolist(), strict=True))["p"] == 4


class TestMixedFastPath:
    @given(
        policy=policies(),
        workload=st.lists(arrivals(), min_size=2, max_size=14),
        steps=st.lists(events, min_size=20, max_size=80),
        pages=st.integers(12, 80),
        watermark=st.sampled_from((0.0, 0.1)),
        core_min=st.sampled_from((0, 0, 2, 4, NO_CORE, NO_CORE, NO_CORE)),
    )
    @settings(SETTINGS, max_examples=500)
    def test_plans_match_the_policy_asked_in_full(
        self,
        policy: SchedulingPolicy,
        workload: list[Arrival],
        steps: list[Events],
        pages: int,
        watermark: float,
        core_min: int,
    ) -> None:
        """With aborts, abandons, executor finishes, stop tokens and the prefix cache, both schedulers say the same.

        ``core_min`` above 0 makes steps switch between the mixed path and the policy's as the
        running set crosses the size from which mixed steps build a decode core; at ``NO_CORE``
        no step has one, so decode-first's steps are all worked out from the state.
        """
        with mock.patch.object(phasesched.scheduler, "_MIXED_CORE_MIN", core_min):
            run(policy, workload, steps, pages, watermark)

    def test_the_policy_is_not_asked_for_a_known_step(self) -> None:
        """Admissions beside a few decodes are worked out without the builder; a re-ranking queue order is asked."""
        options = PolicyOptions(max_num_batched_tokens=16, max_num_seqs=8)
        vllm = load_policy("vllm", options)
        for policy, asked in (
            (load_policy("sarathi", options), False),
            (vllm, False),
            (load_policy("vllm-priority", options), True),  # waiting requests may preempt
            (attrs.evolve(vllm, queue_order=LongestPrefixMatch()), True),  # the queue is re-ranked
        ):
            scheduler, _ = decoding_beside_a_long_prompt(policy, decodes=3, prompt_len=30)
            with (
                mock.patch.object(phasesched.scheduler, "_MIXED_CORE_MIN", NO_CORE),
                mock.patch.object(Scheduler, "_ask_policy", side_effect=AssertionError("asked")) as ask,
            ):
                try:
                    plan = scheduler.schedule()
                except AssertionError:
                    plan = None
            assert ask.called == asked, policy
            if plan is not None:
                assert plan.request_ids == ("d0", "d1", "d2", "long")
                assert plan.num_new.tolist() == [1, 1, 1, 13]

    def test_the_mixed_path_is_taken(self) -> None:
        """A long prompt chunked beside running decodes is planned by the mixed path, its decodes kept."""
        policy = load_policy("vllm", PolicyOptions(max_num_batched_tokens=16, max_num_seqs=8))
        scheduler, executor = decoding_beside_a_long_prompt(policy, decodes=4, prompt_len=60)
        cores = []
        for _ in range(4):
            plan = scheduler.schedule()
            assert plan.request_ids[:4] == ("d0", "d1", "d2", "d3")
            assert plan.request_ids[4:] == ("long",)
            cores.append(scheduler._core)  # the path under test
            scheduler.update(plan, executor.execute(plan))
        assert cores[0] is not None
        assert all(core is cores[0] for core in cores)  # one core, kept from step to step

    def test_few_decodes_build_no_core(self) -> None:
        """Below ``_MIXED_CORE_MIN`` running requests, mixed steps build no core (each is worked out afresh)."""
        policy = load_policy("vllm", PolicyOptions(max_num_batched_tokens=16, max_num_seqs=8))
        scheduler = Scheduler(SchedulerConfig(num_pages=128, page_size=4), policy)
        executor = DeterministicExecutor()
        with mock.patch.object(phasesched.scheduler, "_MIXED_CORE_MIN", 6):
            for i in range(4):
                scheduler.add_request(Request(f"d{i}", prompt_token_ids=[i, 1, 2], max_new_tokens=40))
            scheduler.add_request(Request("long", prompt_token_ids=list(range(60)), max_new_tokens=2))
            for _ in range(4):
                plan = scheduler.schedule()
                assert scheduler._core is None
                scheduler.update(plan, executor.execute(plan))
            for i in range(5, 8):
                scheduler.add_request(Request(f"d{i}", prompt_token_ids=[i, 1, 2], max_new_tokens=40))
            scheduler.add_request(Request("long2", prompt_token_ids=list(range(60)), max_new_tokens=2))
            cores = []
            for _ in range(4):  # once six or more run, the mixed path takes the steps and keeps a core
                running = scheduler.num_running
                plan = scheduler.schedule()
                assert running >= 6 or scheduler._core is None
                cores.append(scheduler._core)
                scheduler.update(plan, executor.execute(plan))
            assert any(core is not None for core in cores)

    def test_subclasses_and_plugins_are_asked_in_full(self) -> None:
        """Only decode-first itself, with a chunk sizer that never reads the batch, takes the mixed path."""

        @attrs.frozen
        class Mine(DecodeFirst):
            pass

        base = load_policy("vllm")
        for policy in (attrs.evolve(base, priority=Mine()), attrs.evolve(base, priority=PassThrough(DecodeFirst()))):
            assert not Scheduler(SchedulerConfig(num_pages=64), policy)._mixed_fast_path
        assert Scheduler(SchedulerConfig(num_pages=64), base)._mixed_fast_path


def prefill_states(draw: st.DrawFn) -> tuple[Scheduler, int]:
    """A scheduler part-way through some prompts (FixedChunk(3) steps), and a chunk size to ask for."""
    pages = draw(st.integers(8, 40))
    policy = load_policy("sarathi", PolicyOptions(chunk_size=3, max_num_seqs=6, max_num_batched_tokens=12))
    scheduler = Scheduler(SchedulerConfig(num_pages=pages, page_size=4, max_model_len=256), policy)
    executor = DeterministicExecutor(vocab_size=VOCAB)
    for i, arrival in enumerate(draw(st.lists(arrivals(), min_size=1, max_size=8))):
        with contextlib.suppress(RequestRejectedError):
            scheduler.add_request(request_of(i, arrival))
    for _ in range(draw(st.integers(0, 12))):
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))
    for i, arrival in enumerate(draw(st.lists(arrivals(), max_size=4)), start=100):  # they wait
        with contextlib.suppress(RequestRejectedError):
            scheduler.add_request(request_of(i, arrival))
    return scheduler, draw(st.integers(1, 20))


def selection_shape(selection: Selection) -> tuple[object, ...]:
    """A selection as comparable values."""
    return (
        selection.running_slots.tolist(),
        selection.running_tokens.tolist(),
        selection.admitted,
        selection.admitted_tokens,
        selection.preempted,
    )


class TestPrefillChunkOfOneSlot:
    @given(data=st.data(), decodes_first=st.booleans())
    @settings(SETTINGS, max_examples=200)
    def test_a_chunk_is_added_as_add_running_adds_it(self, data: st.DataObject, decodes_first: bool) -> None:
        """``add_prefill_chunk`` (one slot, without arrays when it fits) leaves the builder as ``add_running`` does."""
        scheduler, size = data.draw(st.composite(prefill_states)())
        chunker = FixedChunk(size)
        view = scheduler._view(0.0)
        for slot in BatchBuilder(view, chunker, scheduler.policy.preemption).running_prefills().tolist():
            one, many = (BatchBuilder(view, chunker, scheduler.policy.preemption) for _ in range(2))
            if decodes_first:
                one.add_decodes()
                many.add_decodes()
            result = one.add_prefill_chunk(slot)
            tokens = min(size, int(view.num_tokens[slot] - view.num_computed[slot]), many.tokens_left)
            added = many.add_running(np.array([slot], np.int32), np.array([tokens], np.int64)) if tokens else 0
            assert (result is AddResult.ADDED) == bool(added)
            for builder in (one, many):  # what admissions see next
                for candidate in view.waiting():
                    if builder.admit(candidate) is not AddResult.ADDED:
                        break
            assert selection_shape(one.build()) == selection_shape(many.build())
            assert (one.tokens_left, one.pages_left, one.seq_room) == (many.tokens_left, many.pages_left, many.seq_room)
