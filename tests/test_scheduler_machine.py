"""Property tests: the scheduler under random arrivals, budgets, page counts, aborts and preemptions.

After every step: the budget and the sequence cap hold, pages are conserved and owned once,
every plan is internally consistent; at the end every admitted request finishes exactly once
with exactly its tokens, and with no new arrivals nothing waits forever. Half the runs cache
prefixes: prompts then share prefixes (token ids, or trace-style block hashes), and cached pages
are claimed, evicted under pressure and released by preemption, with pages still conserved.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
from hypothesis import HealthCheck, event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from phasesched import (
    DeterministicExecutor,
    FinishReason,
    Request,
    RequestRejectedError,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    StepPlan,
)
from phasesched.policies import (
    CacheAwareAging,
    EqualProgress,
    FewestGenerated,
    FixedChunk,
    LongestPrefixMatch,
    LongPrefillThreshold,
    LowestPriority,
    NoChunking,
    PreemptionPolicy,
    PrefillFirst,
    PriorityOrder,
    ShortestRemainingPrefill,
    TokenBudget,
)
from phasesched.prefix import PromptBlocks
from tests.fakes import expected_tokens

PolicyFactory = Callable[[TokenBudget, int], SchedulingPolicy]

POLICIES: dict[str, PolicyFactory] = {
    "vllm": lambda b, c: SchedulingPolicy(budget=b, chunker=LongPrefillThreshold(c, max_num_partial_prefills=2)),
    "sarathi": lambda b, c: SchedulingPolicy(budget=b, chunker=FixedChunk(c)),
    "no-chunk": lambda b, _: SchedulingPolicy(budget=b, chunker=NoChunking()),
    "prefill-first": lambda b, c: SchedulingPolicy(budget=b, chunker=LongPrefillThreshold(c), priority=PrefillFirst()),
    "mixed-prefill-first": lambda b, c: SchedulingPolicy(
        budget=b, chunker=FixedChunk(c), priority=PrefillFirst(mix_decodes=True)
    ),
    "equal-progress": lambda b, c: SchedulingPolicy(budget=b, chunker=FixedChunk(c), priority=EqualProgress(unit=c)),
    "priority": lambda b, c: SchedulingPolicy(
        budget=b,
        chunker=FixedChunk(c),
        queue_order=PriorityOrder(aging_per_s=0.5),
        preemption=PreemptionPolicy(victims=LowestPriority(), preempt_for_waiting=True),
    ),
    "srpf": lambda b, c: SchedulingPolicy(
        budget=b,
        chunker=FixedChunk(c),
        queue_order=ShortestRemainingPrefill(aging_tokens_per_s=4.0),
        preemption=PreemptionPolicy(victims=FewestGenerated()),
    ),
    "lpm": lambda b, c: SchedulingPolicy(
        budget=b, chunker=FixedChunk(c), queue_order=LongestPrefixMatch(max_queue_depth=4), enable_prefix_caching=True
    ),
    "cache-aware-aging": lambda b, c: SchedulingPolicy(
        budget=b, chunker=FixedChunk(c), queue_order=CacheAwareAging(4.0), enable_prefix_caching=True
    ),
}

PARTIAL_PREFILL_CAPS = {"vllm": 2, "prefill-first": 1}
"""Policies above that cap concurrent partial prefills (LongPrefillThreshold), and their caps."""

EOS = 3


class SchedulerMachine(RuleBasedStateMachine):
    """Drives a scheduler with random work and checks its invariants after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Scheduler
        self.executor = DeterministicExecutor(vocab_size=40)
        self.requests: dict[str, Request] = {}
        self.finished: dict[str, tuple[FinishReason, tuple[int, ...] | None, int]] = {}
        self.aborted: set[str] = set()
        self.pending: StepPlan | None = None
        self.now = 0.0
        self.counter = 0
        self.preemptions = 0

    @initialize(
        policy=st.sampled_from(sorted(POLICIES)),
        page_size=st.integers(1, 8),
        num_pages=st.integers(4, 64),
        tokens=st.integers(4, 64),
        seqs=st.integers(1, 8),
        chunk=st.integers(1, 16),
        watermark=st.sampled_from([0.0, 0.1]),
        caching=st.booleans(),
    )
    def configure(
        self,
        policy: str,
        page_size: int,
        num_pages: int,
        tokens: int,
        seqs: int,
        chunk: int,
        watermark: float,
        caching: bool,
    ) -> None:
        budget = TokenBudget(max_num_batched_tokens=tokens, max_num_seqs=seqs)
        config = SchedulerConfig(num_pages=num_pages, page_size=page_size, max_model_len=96, watermark=watermark)
        chosen = POLICIES[policy](budget, chunk)
        self.scheduler = Scheduler(
            config, attrs.evolve(chosen, enable_prefix_caching=caching or chosen.enable_prefix_caching)
        )
        self.partial_cap = PARTIAL_PREFILL_CAPS.get(policy)

    @rule(
        prompt=st.integers(1, 100),
        max_new=st.integers(1, 12),
        with_ids=st.booleans(),
        priority=st.integers(0, 3),
        eos=st.booleans(),
        stream=st.integers(0, 2),
    )
    def add(self, prompt: int, max_new: int, with_ids: bool, priority: int, eos: bool, stream: int) -> None:
        """A request whose prompt is a prefix of one of three shared streams (so prompts share prefixes)."""
        request_id = f"q{self.counter}"
        self.counter += 1
        request = Request(
            request_id,
            prompt_len=prompt if not with_ids else -1,
            prompt_token_ids=[(i + 7 * stream) % 40 for i in range(prompt)] if with_ids else None,
            prompt_blocks=None
            if with_ids
            else PromptBlocks(8, tuple(100 * stream + b for b in range(-(-prompt // 8)))),
            max_new_tokens=max_new,
            arrival_time=self.now,
            priority=priority,
            eos_token_id=EOS if eos else None,
        )
        before = self.scheduler.num_unfinished
        try:
            self.scheduler.add_request(request)
        except RequestRejectedError:
            assert self.scheduler.num_unfinished == before
            return
        self.requests[request_id] = request

    @precondition(lambda self: self.pending is None)
    @rule()
    def step(self) -> None:
        self.plan_step()
        self.finish_step()

    @precondition(lambda self: self.pending is None)
    @rule()
    def plan_step(self) -> None:
        plan = self.scheduler.schedule(self.now)
        self.check_plan(plan)
        self.pending = plan

    @precondition(lambda self: self.pending is not None)
    @rule()
    def finish_step(self) -> None:
        plan = self.pending
        assert plan is not None
        outcome = self.scheduler.update(plan, self.executor.execute(plan))
        self.pending = None
        self.now += 0.1
        for record in outcome.finished:
            assert record.request_id not in self.finished, "finished twice"
            self.finished[record.request_id] = (record.reason, record.output_token_ids, record.num_generated)

    @precondition(lambda self: bool(self.scheduler.num_unfinished))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        held = [r for r in self.requests if r not in self.finished and r not in self.aborted]
        if not held:
            return
        request_id = data.draw(st.sampled_from(held))
        record = self.scheduler.abort(request_id)
        self.aborted.add(request_id)
        if record is not None:
            self.finished[request_id] = (record.reason, record.output_token_ids, record.num_generated)

    def check_plan(self, plan: StepPlan) -> None:
        budget = self.scheduler.policy.budget
        assert plan.num_tokens <= budget.max_num_batched_tokens
        assert plan.batch_size <= budget.max_num_seqs
        plan.check_layout()
        self.preemptions += len(plan.preempted)
        kv = self.scheduler.kv
        for i, slot in enumerate(plan.slots.tolist()):
            owned = kv.pages(slot)
            segment = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]]
            assert np.array_equal(owned, segment), "a slice reads other pages than its table's"
            writes = segment[int(plan.start[i]) // kv.page_size :]
            assert np.all(kv.refcounts[writes] == 1), "a slice writes into a shared (cached) page"

    @invariant()
    def whole(self) -> None:
        """Bookkeeping is whole; pages are conserved: free (plain + idle cached) + referenced = total."""
        if hasattr(self, "scheduler"):
            self.scheduler.check_invariants()  # the KV manager's conservation and reference counts among them
            stats = self.scheduler.kv.cache_stats
            assert 0 <= stats.hits <= stats.queried

    @invariant()
    def partial_prefills_within_cap(self) -> None:
        """No more requests are part-way through their prefill than the chunk sizer's cap allows."""
        cap = getattr(self, "partial_cap", None)
        if cap is None or self.pending is not None:
            return  # with a plan in flight, its slices have not been counted as computed yet
        partial = 0
        for request_id in self.scheduler.running_request_ids():
            computed, known = self.scheduler.progress(request_id)
            partial += known - computed > 1 or computed < self.requests[request_id].prompt_len
        assert partial <= cap, f"{partial} partial prefills, cap {cap}"

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        self.drain()
        self.report_coverage()

    def drain(self) -> None:
        """Run every request to its end, then check each finished once with exactly its tokens."""
        if self.pending is not None:
            self.finish_step()
        for _ in range(20_000):
            if not self.scheduler.num_unfinished:
                break
            self.step()
        assert self.scheduler.num_unfinished == 0, "a request waited forever"
        assert self.scheduler.kv.num_free_pages == self.scheduler.kv.num_pages, "pages leaked"
        assert set(self.finished) == set(self.requests)
        for request_id, (reason, outputs, generated) in self.finished.items():
            self.check_output(self.requests[request_id], reason, outputs, generated)

    def report_coverage(self) -> None:
        """Tell Hypothesis how much of the cache this run exercised, and steer it toward more."""
        stats = self.scheduler.kv.cache_stats
        caching = self.scheduler.policy.enable_prefix_caching
        event("prefix caching", "on" if caching else "off")
        if caching:
            event("cache hits", "some" if stats.hits else "none")
            event("evictions and preemptions", f"{bool(stats.evictions)} and {bool(self.preemptions)}")
            target(float(min(stats.evictions, self.preemptions)), label="evictions and preemptions, fewer of")
        target(float(self.preemptions), label="preemptions")

    def check_output(
        self, request: Request, reason: FinishReason, outputs: tuple[int, ...] | None, generated: int
    ) -> None:
        expected = expected_tokens(request.prompt_len, request.max_new_tokens, vocab_size=40)
        if request.eos_token_id is not None and EOS in expected:
            expected = expected[: expected.index(EOS) + 1]
        if request.request_id in self.aborted and reason is FinishReason.ABORTED:
            expected = expected[:generated]
        else:
            limit = 96 - request.prompt_len  # max_model_len caps generation
            expected = expected[: max(limit, 1)] if len(expected) > limit else expected
        assert generated == len(expected), (request, reason, generated, expected)
        if outputs is not None:
            assert outputs == expected


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_cache_pressure_through_the_machine() -> None:
    """A directed run of the machine: cached prefixes claimed, evicted under pressure, and preemptions, all checked."""
    machine = SchedulerMachine()
    machine.configure("vllm", page_size=4, num_pages=12, tokens=32, seqs=4, chunk=8, watermark=0.0, caching=True)
    for stream in (0, 1, 2):  # a first turn of each stream runs to the end: its pages stay cached, idle
        machine.add(prompt=24, max_new=4, with_ids=stream != 1, priority=0, eos=False, stream=stream)
        while machine.scheduler.num_unfinished:
            machine.step()
            machine.whole()
    for stream in (2, 1, 0, 2):  # second turns at once, which outgrow the pages there are as they decode
        machine.add(prompt=20, max_new=12, with_ids=stream != 1, priority=0, eos=False, stream=stream)
    for _ in range(6):
        machine.step()
        machine.whole()
        machine.partial_prefills_within_cap()
    machine.drain()
    stats = machine.scheduler.kv.cache_stats
    assert stats.hits > 0
    assert stats.evictions > 0
    assert machine.preemptions > 0
