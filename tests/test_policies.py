"""Behaviour of each policy: chunking, phase priority, queue order, preemption, presets."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from phasesched import (
    POLICIES,
    PolicyOptions,
    Request,
    SchedulingPolicy,
    Selection,
    UnknownNameError,
    load_policy,
)
from phasesched.policies import (
    DecodeFirst,
    EqualProgress,
    FewestGenerated,
    FixedChunk,
    LatestArrival,
    LongPrefillThreshold,
    LowestPriority,
    NoChunking,
    PreemptionPolicy,
    PrefillFirst,
    PriorityOrder,
    ShortestRemainingPrefill,
    SLOAdaptiveChunk,
    TokenBudget,
    VictimOrder,
)
from tests.fakes import Driver, make_requests, scheduler_for, tokens_by_request


def decoding_driver(policy: SchedulingPolicy, num_decodes: int, *, num_pages: int = 4096) -> Driver:
    """A driver whose scheduler has ``num_decodes`` short requests already decoding."""
    driver = Driver(scheduler_for(policy, num_pages=num_pages))
    for request in make_requests([8] * num_decodes, max_new_tokens=1000, prefix="d"):
        driver.scheduler.add_request(request)
    while any(p.phase.name == "PREFILL" for p in driver.step().pieces):
        pass
    return driver


class TestChunking:
    def test_fixed_chunk_takes_eight_steps_beside_decodes(self) -> None:
        """A 4,096-token prompt with 512-token chunks takes 8 steps; decodes beside it get a token every step."""
        policy = SchedulingPolicy(budget=TokenBudget(2048, 64), chunker=FixedChunk(512), priority=DecodeFirst())
        driver = decoding_driver(policy, 16)
        driver.scheduler.add_request(Request("long", prompt_len=4096, max_new_tokens=4))
        steps = 0
        while True:
            plan = driver.step()
            tokens = tokens_by_request(plan)
            assert all(tokens[f"d{i}"] == 1 for i in range(16)), "a decode missed a step"
            assert tokens["long"] == 512
            steps += 1
            if plan.samples[plan.request_ids.index("long")]:
                break
        assert steps == 8

    def test_no_chunking_runs_whole_prompt_in_one_step(self) -> None:
        """Without chunking the prompt runs whole, in one step, beside the decodes."""
        policy = SchedulingPolicy(budget=TokenBudget(8192, 64), chunker=NoChunking())
        driver = decoding_driver(policy, 4)
        driver.scheduler.add_request(Request("long", prompt_len=4096, max_new_tokens=4))
        assert tokens_by_request(driver.step())["long"] == 4096

    def test_no_chunking_waits_when_budget_is_short(self) -> None:
        """A whole prompt that does not fit the budget left after decodes waits for a later step."""
        policy = SchedulingPolicy(budget=TokenBudget(4096, 64), chunker=NoChunking())
        driver = decoding_driver(policy, 8)
        driver.scheduler.add_request(Request("long", prompt_len=4090, max_new_tokens=2))  # 4,090 + 8 > 4,096
        assert "long" not in driver.step().request_ids

    def test_long_prefill_threshold_caps_partial_prefills(self) -> None:
        """With one partial prefill allowed, a second long prompt waits while the first is part-way."""
        chunker = LongPrefillThreshold(long_prefill_token_threshold=256, max_num_partial_prefills=1)
        driver = Driver(scheduler_for(SchedulingPolicy(budget=TokenBudget(4096, 64), chunker=chunker)))
        for request in make_requests([1000, 1000], with_ids=False):
            driver.scheduler.add_request(request)
        for _ in range(3):
            plan = driver.step()
            assert tokens_by_request(plan) == {"r0": 256}

    def test_short_prompt_overtakes_long_partial(self) -> None:
        """With room for two partial prefills but one long one, a short prompt runs beside the long one."""
        chunker = LongPrefillThreshold(
            long_prefill_token_threshold=64, max_num_partial_prefills=2, max_long_partial_prefills=1
        )
        driver = Driver(scheduler_for(SchedulingPolicy(budget=TokenBudget(4096, 64), chunker=chunker)))
        for request in make_requests([1000, 1000, 40], with_ids=False):
            driver.scheduler.add_request(request)
        assert tokens_by_request(driver.step()) == {"r0": 64, "r2": 40}

    def test_slo_adaptive_shrinks_chunk_as_decodes_grow(self) -> None:
        """The SLO-adaptive chunk is the largest whose predicted step meets the target, smaller with more decodes."""

        @attrs.frozen
        class Linear:
            def step_time(self, num_new: np.ndarray, kv_len: np.ndarray) -> float:
                return 1e-3 + 1e-5 * float(np.sum(num_new)) + 1e-7 * float(np.sum(kv_len))

        cost = Linear()
        chunker = SLOAdaptiveChunk(cost, tbt_target_s=0.01, granularity=16)
        sizes = []
        for decodes in (1, 32, 128):
            driver = decoding_driver(SchedulingPolicy(budget=TokenBudget(8192, 256), chunker=chunker), decodes)
            driver.scheduler.add_request(Request("long", prompt_len=8000, max_new_tokens=2))
            plan = driver.step()
            assert cost.step_time(plan.num_new, plan.kv_len) <= 0.01
            size = tokens_by_request(plan)["long"]
            bigger = np.append(plan.num_new, 16)
            assert cost.step_time(bigger, np.append(plan.kv_len, size + 16)) > 0.01, "a larger chunk would also fit"
            sizes.append(size)
        assert sizes[0] > sizes[1] > sizes[2] > 0

    def test_slo_adaptive_still_progresses_when_decodes_miss_target(self) -> None:
        """When decodes alone exceed the target, a minimum chunk still runs so prompts are not starved."""

        @attrs.frozen
        class Slow:
            def step_time(self, num_new: np.ndarray, kv_len: np.ndarray) -> float:
                return 1.0

        driver = Driver(scheduler_for(SchedulingPolicy(chunker=SLOAdaptiveChunk(Slow(), 0.01, min_chunk=32))))
        driver.scheduler.add_request(Request("p", prompt_len=100, max_new_tokens=1))
        assert tokens_by_request(driver.step()) == {"p": 32}


class TestPhasePriority:
    def test_prefill_first_stalls_decodes_decode_first_does_not(self) -> None:
        """Prefill-first runs a waiting prompt without the decodes; decode-first keeps every decode going."""
        for priority, stalls in ((PrefillFirst(), True), (DecodeFirst(), False)):
            policy = SchedulingPolicy(budget=TokenBudget(8192, 64), chunker=FixedChunk(2048), priority=priority)
            driver = decoding_driver(policy, 8)
            driver.scheduler.add_request(Request("long", prompt_len=4096, max_new_tokens=2))
            plan = driver.step()
            decodes = [rid for rid in plan.request_ids if rid.startswith("d")]
            assert "long" in plan.request_ids
            assert (not decodes) is stalls

    def test_prefill_first_mixing_lets_decodes_ride_along(self) -> None:
        """With mixing on, decodes fill the budget the prefill leaves."""
        policy = SchedulingPolicy(
            budget=TokenBudget(8192, 64), chunker=FixedChunk(2048), priority=PrefillFirst(mix_decodes=True)
        )
        driver = decoding_driver(policy, 8)
        driver.scheduler.add_request(Request("long", prompt_len=4096, max_new_tokens=2))
        assert len(driver.step().request_ids) == 9

    def test_decode_first_continues_chunks_before_new_prompts(self) -> None:
        """An ongoing chunked prefill is served before a newer prompt."""
        policy = SchedulingPolicy(budget=TokenBudget(600, 64), chunker=FixedChunk(512))
        driver = Driver(scheduler_for(policy))
        driver.scheduler.add_request(Request("a", prompt_len=2000, max_new_tokens=2))
        driver.step()
        driver.scheduler.add_request(Request("b", prompt_len=2000, max_new_tokens=2, arrival_time=1.0))
        assert tokens_by_request(driver.step()) == {"a": 512, "b": 88}

    def test_equal_progress_advances_prompts_together(self) -> None:
        """Equal-progress deals the budget across prompts in units instead of finishing one first."""
        policy = SchedulingPolicy(budget=TokenBudget(1024, 64), priority=EqualProgress(unit=64))
        driver = Driver(scheduler_for(policy, num_pages=1024))
        for request in make_requests([2000, 2000, 2000, 2000], with_ids=False):
            driver.scheduler.add_request(request)
        assert tokens_by_request(driver.step()) == {f"r{i}": 256 for i in range(4)}
        assert tokens_by_request(driver.step()) == {f"r{i}": 256 for i in range(4)}


class TestQueueOrder:
    def order_of(self, policy: SchedulingPolicy, requests: list[Request]) -> list[str]:
        scheduler = scheduler_for(policy)
        for request in requests:
            scheduler.add_request(request)
        return list(scheduler.waiting_request_ids())

    def test_fcfs_orders_by_arrival(self) -> None:
        """FCFS serves the earliest arrival first, whatever the submission order."""
        requests = [Request(n, prompt_len=4, arrival_time=t) for n, t in (("late", 2.0), ("early", 1.0))]
        assert self.order_of(SchedulingPolicy(), requests) == ["early", "late"]

    def test_priority_orders_by_priority_then_arrival(self) -> None:
        """Lower priority values come first; ties go by arrival."""
        requests = [
            Request("a", prompt_len=4, priority=1, arrival_time=0.0),
            Request("b", prompt_len=4, priority=0, arrival_time=5.0),
            Request("c", prompt_len=4, priority=1, arrival_time=-0.0 + 1.0),
        ]
        assert self.order_of(SchedulingPolicy(queue_order=PriorityOrder()), requests) == ["b", "a", "c"]

    def test_priority_aging_lets_old_requests_overtake(self) -> None:
        """With aging, a low-priority request that waited long enough is served first."""
        requests = [
            Request("old", prompt_len=4, priority=3, arrival_time=0.0),
            Request("new", prompt_len=4, priority=0, arrival_time=10.0),
        ]
        assert self.order_of(SchedulingPolicy(queue_order=PriorityOrder(aging_per_s=1.0)), requests) == ["old", "new"]
        assert self.order_of(SchedulingPolicy(queue_order=PriorityOrder(aging_per_s=0.1)), requests) == ["new", "old"]

    def test_shortest_remaining_prefill_with_aging(self) -> None:
        """Shortest prompt first, unless a long one has waited longer than its extra length over the aging rate."""
        requests = [
            Request("long", prompt_len=3000, arrival_time=0.0),
            Request("short", prompt_len=10, arrival_time=1.0),
        ]
        srpf = ShortestRemainingPrefill(aging_tokens_per_s=256.0)
        assert self.order_of(SchedulingPolicy(queue_order=srpf), requests) == ["short", "long"]
        late = [requests[0], attrs.evolve(requests[1], arrival_time=20.0)]
        assert self.order_of(SchedulingPolicy(queue_order=srpf), late) == ["long", "short"]

    def test_preempted_request_keeps_its_place(self) -> None:
        """A preempted request re-enters the queue ahead of requests that arrived after it."""
        policy = SchedulingPolicy(budget=TokenBudget(64, 8), chunker=FixedChunk(64))
        driver = Driver(scheduler_for(policy, num_pages=6, page_size=4))
        driver.scheduler.add_request(Request("a", prompt_len=8, max_new_tokens=12, arrival_time=0.0))
        driver.scheduler.add_request(Request("b", prompt_len=8, max_new_tokens=12, arrival_time=1.0))
        preempted = None
        for _ in range(20):
            plan = driver.step()
            if plan.preempted:
                preempted = plan.preempted
                break
        assert preempted == ("b",)
        driver.scheduler.add_request(Request("c", prompt_len=4, max_new_tokens=1, arrival_time=2.0))
        assert list(driver.scheduler.waiting_request_ids()) == ["b", "c"]


class TestPreemption:
    def run_until_preemption(
        self,
        victims: VictimOrder,
        requests: list[Request],
        late: Request | None = None,
    ) -> tuple[str, ...]:
        policy = SchedulingPolicy(
            budget=TokenBudget(256, 8), chunker=FixedChunk(256), preemption=PreemptionPolicy(victims=victims)
        )
        driver = Driver(scheduler_for(policy, num_pages=9, page_size=4))
        for request in requests:
            driver.scheduler.add_request(request)
        for step in range(40):
            if step == 3 and late is not None:
                driver.scheduler.add_request(late)
            plan = driver.step()
            driver.scheduler.check_invariants()
            if plan.preempted:
                return plan.preempted
        pytest.fail("no preemption happened")

    def requests(self) -> list[Request]:
        return [
            Request("a", prompt_len=4, max_new_tokens=25, arrival_time=0.0, priority=2),
            Request("b", prompt_len=8, max_new_tokens=25, arrival_time=1.0, priority=0),
            Request("c", prompt_len=4, max_new_tokens=25, arrival_time=2.0, priority=1),
        ]

    def test_latest_arrival_victim(self) -> None:
        """LatestArrival evicts the most recent request."""
        assert self.run_until_preemption(LatestArrival(), self.requests()) == ("c",)

    def test_lowest_priority_victim(self) -> None:
        """LowestPriority evicts the request with the largest priority value."""
        assert self.run_until_preemption(LowestPriority(), self.requests()) == ("a",)

    def test_fewest_generated_victim(self) -> None:
        """FewestGenerated evicts the request that has produced least, not the latest arrival."""
        a, b, c = self.requests()
        assert self.run_until_preemption(FewestGenerated(), [b, c], late=a) == ("a",)
        assert self.run_until_preemption(LatestArrival(), [b, c], late=a) == ("c",)

    def test_no_admissions_in_a_step_that_preempted_for_memory(self) -> None:
        """When running requests had to be preempted for KV, the freed pages do not go to newcomers that step."""
        shortest_first = ShortestRemainingPrefill(aging_tokens_per_s=0.001)  # the newcomer is first in line
        policy = SchedulingPolicy(budget=TokenBudget(256, 8), chunker=FixedChunk(256), queue_order=shortest_first)
        driver = Driver(scheduler_for(policy, num_pages=9, page_size=4))
        for request in self.requests():
            driver.scheduler.add_request(request)
        for step in range(40):
            newcomer_due = driver.scheduler.kv.num_free_pages == 0 and "tiny" not in driver.finished
            if newcomer_due and "tiny" not in driver.scheduler.waiting_request_ids():
                driver.scheduler.add_request(Request("tiny", prompt_len=2, max_new_tokens=1, arrival_time=step))
            tiny_waits = "tiny" in driver.scheduler.waiting_request_ids()
            plan = driver.step()
            if plan.preempted and tiny_waits:
                assert plan.new_requests == ()
                return
        pytest.fail("no preemption happened while a newcomer waited")

    def test_priority_request_preempts_when_sequence_cap_binds(self) -> None:
        """A more important waiting request evicts a less important running one when max_num_seqs is reached."""
        preemption = PreemptionPolicy(victims=LowestPriority(), preempt_for_waiting=True)
        policy = SchedulingPolicy(budget=TokenBudget(512, 2), queue_order=PriorityOrder(), preemption=preemption)
        driver = Driver(scheduler_for(policy))
        driver.scheduler.add_request(Request("low", prompt_len=8, max_new_tokens=50, priority=5))
        driver.scheduler.add_request(Request("mid", prompt_len=8, max_new_tokens=50, priority=3))
        driver.step()
        driver.scheduler.add_request(Request("vip", prompt_len=8, max_new_tokens=5, priority=0, arrival_time=1.0))
        plan = driver.step()
        assert plan.preempted == ("low",)
        assert "vip" in plan.request_ids
        assert driver.scheduler.status("low").name == "PREEMPTED"

    def test_without_permission_waiting_requests_do_not_preempt(self) -> None:
        """FCFS-style preemption never evicts a running request for a waiting one."""
        policy = SchedulingPolicy(budget=TokenBudget(512, 2), queue_order=PriorityOrder())
        driver = Driver(scheduler_for(policy))
        driver.scheduler.add_request(Request("low", prompt_len=8, max_new_tokens=50, priority=5))
        driver.scheduler.add_request(Request("mid", prompt_len=8, max_new_tokens=50, priority=3))
        driver.step()
        driver.scheduler.add_request(Request("vip", prompt_len=8, max_new_tokens=5, priority=0))
        plan = driver.step()
        assert not plan.preempted
        assert "vip" not in plan.request_ids

    def test_recompute_gives_identical_tokens(self) -> None:
        """A preempted request resumes by recomputing prompt and generated tokens, and its output is unchanged."""
        policy = SchedulingPolicy(budget=TokenBudget(64, 8), chunker=FixedChunk(16))
        driver = Driver(scheduler_for(policy, num_pages=8, page_size=4))
        for request in make_requests([10, 10, 10], max_new_tokens=10):
            driver.scheduler.add_request(request)
        driver.run()
        assert any(plan.preempted for plan in driver.plans)
        for i in range(3):
            assert driver.finished[f"r{i}"].output_token_ids == tuple(range(10, 20))
        recomputed = [p for plan in driver.plans for p in plan.pieces if p.phase.name == "PREFILL" and p.end > 10]
        assert recomputed, "the resumed request prefilled its generated tokens again"


class TestPresets:
    @pytest.mark.parametrize(
        "name", ["vllm", "vllm-priority", "sarathi", "sglang", "orca", "no-chunk", "trtllm-equal-progress"]
    )
    def test_presets_load_and_serve(self, name: str) -> None:
        """Every preset is registered through its entry point and serves a small workload to completion."""
        policy = load_policy(name, PolicyOptions(max_model_len=4096))
        assert isinstance(policy, SchedulingPolicy)
        driver = Driver(scheduler_for(policy, max_model_len=4096))
        for request in make_requests([5, 700, 3000, 12], max_new_tokens=6):
            driver.scheduler.add_request(request)
        driver.run()
        assert len(driver.finished) == 4

    def test_preset_shapes(self) -> None:
        """Presets combine the strategies their docstrings describe."""
        assert load_policy("sarathi").budget.max_num_batched_tokens == 512
        assert isinstance(load_policy("sglang").priority, PrefillFirst)
        assert isinstance(load_policy("orca").chunker, NoChunking)
        assert isinstance(load_policy("trtllm-equal-progress").priority, EqualProgress)
        assert load_policy("sarathi", PolicyOptions(chunk_size=256)).chunker == FixedChunk(256)

    def test_slo_preset_needs_a_cost_model(self) -> None:
        """The SLO-adaptive preset says what it is missing."""
        with pytest.raises(ValueError, match="cost model"):
            load_policy("sarathi-slo")

    def test_unknown_policy_lists_known_names(self) -> None:
        """An unknown name lists every registered policy."""
        with pytest.raises(UnknownNameError, match="sarathi"):
            load_policy("nope")

    def test_every_preset_is_documented(self) -> None:
        """Each registered preset says what it reproduces."""
        for name in POLICIES.names():
            assert (POLICIES.get(name).__doc__ or "").strip(), name


class TestQueuePlaces:
    def test_preempted_request_keeps_its_place_among_equal_keys(self) -> None:
        """Requests that arrived together keep their order: a preempted one does not go behind its peers."""
        policy = SchedulingPolicy(budget=TokenBudget(64, 2), chunker=FixedChunk(64))
        driver = Driver(scheduler_for(policy, num_pages=7, page_size=4))
        for name in "ABCD":
            driver.scheduler.add_request(Request(name, prompt_len=4, max_new_tokens=20))
        for _ in range(30):
            plan = driver.step()
            if plan.preempted:
                break
        assert plan.preempted == ("B",)
        assert list(driver.scheduler.waiting_request_ids()) == ["B", "C", "D"]

    def test_waiting_requests_do_not_preempt_for_a_chunk_they_would_decline(self) -> None:
        """A priority request the chunk sizer turns down (partial-prefill cap) evicts nobody."""
        chunker = LongPrefillThreshold(long_prefill_token_threshold=16, max_num_partial_prefills=1)
        preemption = PreemptionPolicy(victims=LowestPriority(), preempt_for_waiting=True)
        policy = SchedulingPolicy(
            budget=TokenBudget(64, 2), chunker=chunker, queue_order=PriorityOrder(), preemption=preemption
        )
        driver = Driver(scheduler_for(policy))
        driver.scheduler.add_request(Request("vip", prompt_len=200, max_new_tokens=5, priority=0))
        driver.scheduler.add_request(Request("low", prompt_len=4, max_new_tokens=60, priority=5))
        driver.step()
        driver.scheduler.add_request(Request("mid", prompt_len=200, max_new_tokens=5, priority=3, arrival_time=1.0))
        for _ in range(5):  # vip is part-way through its prefill: mid would be a second partial one
            plan = driver.step()
            assert not plan.preempted
            assert "mid" not in plan.request_ids


class TestLastPromptToken:
    def test_prefill_first_does_not_hold_back_a_prompts_last_token(self) -> None:
        """A prompt one token past a chunk boundary finishes its prefill next step, though new prompts keep arriving."""
        chunker = LongPrefillThreshold(long_prefill_token_threshold=64, max_num_partial_prefills=1)
        policy = SchedulingPolicy(budget=TokenBudget(64, 8), chunker=chunker, priority=PrefillFirst())
        driver = Driver(scheduler_for(policy, num_pages=4000))
        driver.scheduler.add_request(Request("a", prompt_len=129, max_new_tokens=4))
        for t in range(3):
            driver.scheduler.add_request(Request(f"w{t}", prompt_len=200, max_new_tokens=4, arrival_time=t + 0.5))
            plan = driver.step(float(t))
        assert tokens_by_request(plan)["a"] == 1
        assert plan.samples[plan.request_ids.index("a")], "the last prompt token samples the first output"
        assert plan.pieces[plan.request_ids.index("a")].phase.name == "PREFILL"


class TestPreemptionForWaiting:
    @staticmethod
    def policy(budget: TokenBudget | None = None) -> SchedulingPolicy:
        """Priority order, two seats unless told, and waiting requests may evict the running ones they outrank."""
        preemption = PreemptionPolicy(victims=LowestPriority(), preempt_for_waiting=True)
        return SchedulingPolicy(
            budget=budget or TokenBudget(64, 2),
            chunker=FixedChunk(64),
            queue_order=PriorityOrder(),
            preemption=preemption,
        )

    def test_nobody_is_evicted_for_an_admission_that_still_cannot_happen(self) -> None:
        """A priority request whose pages preemption could not free evicts nobody (it would waste their work)."""
        driver = Driver(scheduler_for(self.policy(), num_pages=6, page_size=4))
        driver.scheduler.add_request(Request("lo", prompt_len=4, max_new_tokens=4, priority=5))
        driver.scheduler.add_request(Request("hi0", prompt_len=8, max_new_tokens=4, priority=0))
        driver.step()
        driver.step()
        driver.scheduler.add_request(Request("hi", prompt_len=20, max_new_tokens=1, priority=3, arrival_time=1.0))
        plan = driver.step(1.0)  # evicting "lo" frees a seat and 2 pages; "hi" needs 5 of them
        assert plan.preempted == ()
        assert set(plan.request_ids) == {"lo", "hi0"}

    def test_the_decodes_next_pages_are_not_counted_as_room(self) -> None:
        """Under decode-first, the page a running decode is about to take is not room an admission can have."""
        driver = Driver(scheduler_for(self.policy(budget=TokenBudget(64, 8)), num_pages=16, page_size=4))
        driver.scheduler.add_request(Request("A", prompt_len=12, max_new_tokens=30, priority=0))  # next token: page 4
        driver.scheduler.add_request(Request("V", prompt_len=47, max_new_tokens=10, priority=5))  # 12 pages
        driver.step()
        assert driver.scheduler.kv.num_free_pages == 1
        driver.scheduler.add_request(Request("C", prompt_len=52, max_new_tokens=4, priority=0, arrival_time=1.0))
        plan = driver.step(1.0)  # evicting V frees 12 pages, but A's decode takes the free one: C needs 13
        assert plan.preempted == ()
        assert set(plan.request_ids) == {"A", "V"}

    def test_a_seat_is_freed_when_that_is_enough(self) -> None:
        """When the sequence cap alone binds, the outranked request is preempted and the priority one runs."""
        driver = Driver(scheduler_for(self.policy(), num_pages=100, page_size=4))
        driver.scheduler.add_request(Request("lo1", prompt_len=4, max_new_tokens=50, priority=5))
        driver.scheduler.add_request(Request("lo2", prompt_len=4, max_new_tokens=50, priority=5, arrival_time=0.1))
        driver.step()
        driver.step()
        driver.scheduler.add_request(Request("hi", prompt_len=4, max_new_tokens=5, priority=0, arrival_time=1.0))
        plan = driver.step(1.0)
        assert plan.preempted == ("lo2",)
        assert "hi" in plan.request_ids


class TestBuiltSelections:
    def test_a_built_selection_is_what_the_converting_constructor_makes_and_stays_read_only(self) -> None:
        """A batch builder's selection skips the conversions but holds the same values, its arrays read-only."""
        slots, tokens = np.array([3, 1], np.int32), np.array([1, 7], np.int32)
        built = Selection.built(slots, tokens, ("a",), (5,), (2,))
        converted = Selection(slots, tokens, ("a",), (5,), (2,))
        for field in attrs.fields(Selection):
            assert np.array_equal(getattr(built, field.name), getattr(converted, field.name))
        assert not built.running_slots.flags.writeable
        assert not built.running_tokens.flags.writeable
