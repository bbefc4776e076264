"""Prefix caching in the scheduler: cached prefixes are claimed, not computed, and change no output."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasesched import DeterministicExecutor, Request, Scheduler, SchedulerConfig, SchedulingPolicy, load_policy
from phasesched.policies import CacheAwareAging, LongestPrefixMatch, PolicyOptions, QueueOrder
from phasesched.policies.budget import TokenBudget
from phasesched.policies.chunking import FixedChunk
from phasesched.scheduler import prompt_page_hashes
from tests.fakes import Driver, PagedContentExecutor, scheduler_for

SYSTEM = list(range(100, 148))  # a 48-token shared system prompt: three 16-token pages


def cached_policy(*, on: bool = True, chunk: int = 32, budget: int = 64) -> SchedulingPolicy:
    """Decode-first, fixed chunks, a small budget; prefix caching ``on`` or off."""
    return SchedulingPolicy(
        budget=TokenBudget(max_num_batched_tokens=budget, max_num_seqs=8),
        chunker=FixedChunk(chunk),
        enable_prefix_caching=on,
    )


def chat(request_id: str, prompt: list[int], new: int = 4, at: float = 0.0) -> Request:
    """A token-id request."""
    return Request(request_id, prompt_token_ids=prompt, max_new_tokens=new, arrival_time=at)


def run(requests: list[Request], *, on: bool, num_pages: int = 64, **policy: int) -> Driver:
    """Serve ``requests`` one after another (each added once the previous finished) on the content executor."""
    driver = Driver(scheduler_for(cached_policy(on=on, **policy), num_pages=num_pages), PagedContentExecutor())
    for request in requests:
        driver.scheduler.add_request(request)
        driver.run()
        driver.scheduler.check_invariants()
    return driver


class TestClaims:
    def test_a_shared_system_prompt_is_computed_once(self) -> None:
        """The second request starts at the cached pages and computes only the rest."""
        driver = run([chat("a", [*SYSTEM, 1, 2]), chat("b", [*SYSTEM, 3, 4, 5])], on=True)
        first_b = next(p for p in driver.plans if "b" in p.request_ids)
        i = first_b.request_ids.index("b")
        assert (int(first_b.start[i]), int(first_b.num_new[i])) == (48, 3)
        stats = driver.scheduler.kv.cache_stats
        assert (stats.queried, stats.hits) == (3 + 3, 3)

    def test_a_fully_cached_prompt_recomputes_its_last_token(self) -> None:
        """A prompt whose every page is cached still computes its last token, for its logits (as vLLM)."""
        driver = run([chat("a", SYSTEM), chat("b", SYSTEM)], on=True)
        first_b = next(p for p in driver.plans if "b" in p.request_ids)
        i = first_b.request_ids.index("b")
        assert (int(first_b.start[i]), int(first_b.num_new[i])) == (32, 16)

    def test_only_uncached_tokens_count_against_the_budget(self) -> None:
        """A 200-token prompt with 192 cached tokens fits one step of a 64-token budget."""
        long = list(range(1000, 1192))
        driver = run([chat("a", long), chat("b", [*long, 7, 8, 9, 10, 11, 12, 13, 14])], on=True)
        plans = [p for p in driver.plans if "b" in p.request_ids]
        assert int(plans[0].num_new[plans[0].request_ids.index("b")]) == 8
        assert plans[0].samples[plans[0].request_ids.index("b")]

    def test_multi_turn_continuation_hits_generated_pages(self) -> None:
        """A follow-up whose prompt is the first turn plus its answer claims the answer's pages too."""
        first = run([chat("t1", [*SYSTEM, 9], new=40)], on=True)
        answer = list(first.finished["t1"].output_token_ids or ())
        follow = [*SYSTEM, 9, *answer, 77, 78]
        driver = run([chat("t1", [*SYSTEM, 9], new=40), chat("t2", follow)], on=True)
        first_t2 = next(p for p in driver.plans if "t2" in p.request_ids)
        # 48 + 1 + 40 tokens, of which the first 88 are computed (the last sampled one is not): 5 full pages.
        assert int(first_t2.start[first_t2.request_ids.index("t2")]) == 80


class TestSameTokens:
    @given(
        prompts=st.lists(
            st.tuples(st.integers(0, 3), st.integers(0, 60), st.integers(1, 20), st.integers(1, 12)),
            min_size=1,
            max_size=8,
        ),
        pages=st.integers(14, 40),
    )
    @settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
    def test_outputs_match_without_the_cache(self, prompts: list[tuple[int, int, int, int]], pages: int) -> None:
        """Concurrent requests sharing prefixes under KV pressure sample what they would uncached."""
        streams = [[s * 100 + i for i in range(80)] for s in range(4)]
        requests = [
            chat(f"r{i}", [*streams[s][:shared], *range(10_000 + 100 * i, 10_000 + 100 * i + tail)], new=new)
            for i, (s, shared, tail, new) in enumerate(prompts)
        ]
        outputs = []
        for on in (True, False):
            driver = Driver(scheduler_for(cached_policy(on=on), num_pages=pages), PagedContentExecutor())
            for request in requests:
                driver.scheduler.add_request(request)
            while driver.scheduler.num_unfinished:
                driver.step()
                driver.scheduler.check_invariants()
            outputs.append({k: f.output_token_ids for k, f in driver.finished.items()})
            assert driver.scheduler.kv.num_free_pages == pages
        assert outputs[0] == outputs[1]

    def test_eviction_under_pressure_keeps_outputs(self) -> None:
        """With room for little more than one request, cached pages are evicted and outputs still agree."""
        requests = [chat(f"r{i}", [*SYSTEM[: 16 * (i % 3)], *range(500 * i, 500 * i + 40)], new=6) for i in range(6)]
        on, off = run(requests, on=True, num_pages=8), run(requests, on=False, num_pages=8)
        assert on.scheduler.kv.cache_stats.evictions > 0
        assert {k: f.output_token_ids for k, f in on.finished.items()} == {
            k: f.output_token_ids for k, f in off.finished.items()
        }

    def test_a_preempted_request_resumes_from_its_cached_prefix(self) -> None:
        """A request preempted mid-decode is readmitted starting at its cached pages, not at zero."""
        policy = attrs.evolve(cached_policy(), budget=TokenBudget(max_num_batched_tokens=64, max_num_seqs=2))
        driver = Driver(scheduler_for(policy, num_pages=8), PagedContentExecutor())
        driver.scheduler.add_request(chat("a", [*SYSTEM, 1], new=20))
        driver.scheduler.add_request(chat("b", list(range(700, 740)), new=40))
        driver.run()
        assert driver.finished["b"].num_preemptions == 1
        restarts = [
            int(plan.start[i])
            for plan in driver.plans
            for i, rid in enumerate(plan.request_ids)
            if rid in {r.request_id for r in plan.new_requests} and rid == "b"
        ]
        assert restarts == [0, 48], "b restarted from scratch, not from its cached pages"
        uncached = run([chat("a", [*SYSTEM, 1], new=20), chat("b", list(range(700, 740)), new=40)], on=False)
        assert driver.finished["b"].output_token_ids == uncached.finished["b"].output_token_ids


class TestPresets:
    @pytest.mark.parametrize(
        ("name", "on"),
        [
            ("vllm", True),
            ("vllm-priority", True),
            ("sglang", True),
            ("trtllm-equal-progress", True),
            ("sarathi", False),
            ("orca", False),
        ],
    )
    def test_engines_that_cache_by_default_do(self, name: str, on: bool) -> None:
        """vLLM V1, SGLang and TensorRT-LLM (block reuse) cache prefixes by default; the option turns it off."""
        assert load_policy(name, PolicyOptions()).enable_prefix_caching is on
        assert not load_policy(name, PolicyOptions(enable_prefix_caching=False)).enable_prefix_caching


def test_cached_pages_are_never_rewritten() -> None:
    """A claimed page is written once, by the request that computed it first."""
    driver = run([chat("a", [*SYSTEM, 1]), chat("b", [*SYSTEM, 2]), chat("c", [*SYSTEM, 3])], on=True)
    executor = driver.executor
    assert isinstance(executor, PagedContentExecutor)
    shared = [int(p) for p in next(p for p in driver.plans if "c" in p.request_ids).kv_indices[:3]]
    assert all(executor.written[p] == 16 for p in shared)
    assert np.all(np.array(shared) >= 0)


class TestCacheAwareOrders:
    def waiting_order(self, order: QueueOrder, depth_requests: int = 0) -> list[str]:
        """Admission order of three prompts after a warm-up request cached one of them."""
        policy = attrs.evolve(
            cached_policy(budget=512), queue_order=order, budget=TokenBudget(max_num_batched_tokens=512, max_num_seqs=1)
        )
        driver = Driver(scheduler_for(policy, num_pages=64), PagedContentExecutor())
        driver.scheduler.add_request(chat("warm", [*SYSTEM, 1]))
        driver.run()
        prompts = {"cold": list(range(900, 950)), "hot": [*SYSTEM, 2], "long": list(range(400, 600))}
        for i, (rid, prompt) in enumerate(prompts.items()):
            driver.scheduler.add_request(chat(rid, prompt, new=1, at=float(i)))
        for i in range(depth_requests):
            driver.scheduler.add_request(chat(f"pad{i}", list(range(2000 + i, 2010 + i)), new=1, at=10.0 + i))
        driver.run()
        admitted = [r.request_id for p in driver.plans for r in p.new_requests]
        return [rid for rid in admitted if rid in prompts]

    def test_longest_prefix_match_serves_the_best_cached_first(self) -> None:
        """lpm admits the request whose system prompt is cached before older cold ones."""
        assert self.waiting_order(LongestPrefixMatch()) == ["hot", "cold", "long"]

    def test_longest_prefix_match_falls_back_to_fcfs_past_its_depth(self) -> None:
        """Past max_queue_depth waiting requests, lpm is FCFS (SGLang's bound on scheduling cost)."""
        assert self.waiting_order(LongestPrefixMatch(max_queue_depth=3), depth_requests=1) == ["cold", "hot", "long"]

    def test_cache_aware_aging_ranks_by_uncached_tokens(self) -> None:
        """The cached request costs 1 uncached token, the cold one 50 and the long one 200."""
        assert self.waiting_order(CacheAwareAging(aging_tokens_per_s=1.0)) == ["hot", "cold", "long"]

    @pytest.mark.parametrize(("aging", "first"), [(4.0, "old-long"), (0.01, "new-short")])
    def test_aging_lets_an_old_long_cold_request_overtake(self, aging: float, first: str) -> None:
        """A 200-token cold prompt 100 s older than a 10-token one: it goes first once aging outweighs 190 tokens."""
        order = CacheAwareAging(aging_tokens_per_s=aging)
        policy = attrs.evolve(cached_policy(), queue_order=order, budget=TokenBudget(512, max_num_seqs=1))
        driver = Driver(scheduler_for(policy, num_pages=64), PagedContentExecutor())
        driver.scheduler.add_request(chat("new-short", list(range(900, 910)), new=1, at=100.0))
        driver.scheduler.add_request(chat("old-long", list(range(400, 600)), new=1, at=0.0))
        driver.run()
        admitted = [r.request_id for p in driver.plans for r in p.new_requests]
        assert admitted[0] == first


class TestLazyNaming:
    """Steady decode steps name their filled pages in batches; every read must still see them named."""

    @staticmethod
    def decoding(*, steady: bool) -> Scheduler:
        scheduler = Scheduler(
            SchedulerConfig(num_pages=64, page_size=4, max_model_len=256), load_policy("vllm", PolicyOptions())
        )
        scheduler._steady_fast_path = steady  # off: the policy plans, and each page is named as it fills
        for i in range(3):
            scheduler.add_request(Request(f"r{i}", prompt_token_ids=[1000 * i, *range(1, 8)], max_new_tokens=40))
        return scheduler

    def test_a_lookup_between_steady_steps_finds_every_filled_page(self) -> None:
        """A prompt continuing a running request's generated tokens hits them, as with naming as they fill."""
        runs = {steady: self.decoding(steady=steady) for steady in (True, False)}
        executor = DeterministicExecutor(vocab_size=1000)  # the token at position p is p + 1: r0 writes 8, 9, ...
        for step in range(30):
            seen = []
            for scheduler in runs.values():
                plan = scheduler.schedule(float(step))
                scheduler.update(plan, executor.execute(plan))
                probe = prompt_page_hashes(Request("probe", prompt_token_ids=list(range(60)), max_new_tokens=1), 4)
                seen.append((scheduler.kv.cached_prefix(probe, len(probe)), scheduler.kv.cache_stats))
            assert seen[0] == seen[1], f"step {step}"
        assert seen[0][0] >= 6, "the probe should reach r0's generated pages"  # 8 prompt + 17 generated tokens

    def test_pages_left_unnamed_never_outlast_a_turn_of_the_groups(self) -> None:
        scheduler = self.decoding(steady=True)
        executor = DeterministicExecutor(vocab_size=1000)
        for step in range(30):
            plan = scheduler.schedule(float(step))
            scheduler.update(plan, executor.execute(plan))
            scheduler.check_invariants()

    @staticmethod
    def after_a_finished_twin(*, steady: bool, pages: int, fillers: int, new: int) -> tuple[list[object], Scheduler]:
        """``a`` runs alone and finishes (its pages stay cached), then its twin ``b`` decodes beside fillers.

        ``b`` generates ``a``'s tokens (the executor's token depends on the position only), so
        each page it fills has the hash of an idle page of ``a``; on a full cache the steady
        steps evict ``a``'s pages while ``b``'s are waiting to be named. Reads of the cache
        name pending pages, so the run reads only plans until the end.
        """
        scheduler = Scheduler(
            SchedulerConfig(num_pages=pages, page_size=4, max_model_len=256), load_policy("vllm", PolicyOptions())
        )
        scheduler._steady_fast_path = steady
        executor = DeterministicExecutor(vocab_size=1000)
        seen: list[object] = []

        def serve() -> None:
            while scheduler.num_unfinished:
                plan = scheduler.schedule(float(len(seen)))
                scheduler.update(plan, executor.execute(plan))
                seen.append((plan.request_ids, plan.kv_indices.tolist()))

        scheduler.add_request(Request("a", prompt_token_ids=list(range(1, 9)), max_new_tokens=8))
        serve()
        scheduler.add_request(Request("b", prompt_token_ids=list(range(1, 9)), max_new_tokens=new))
        for i in range(fillers):
            scheduler.add_request(Request(f"f{i}", prompt_token_ids=[500 + 10 * i, *range(1, 8)], max_new_tokens=new))
        serve()
        seen.append((scheduler.kv.cache_stats, scheduler.kv.idle_cached_pages()))
        return seen, scheduler

    @pytest.mark.parametrize(("pages", "fillers", "new"), [(12, 2, 12), (12, 1, 24), (16, 3, 16), (20, 4, 32)])
    def test_evicting_a_page_a_pending_one_shares_its_hash_with_names_it_first(
        self, pages: int, fillers: int, new: int
    ) -> None:
        """Steady steps evict without naming their pending pages, except where an evicted hash is theirs.

        Named after that eviction, ``b``'s page would take the name ``a``'s page held when it
        filled (naming as pages fill leaves it unnamed): later hits, evictions and pages differ.
        """
        runs = [
            self.after_a_finished_twin(steady=steady, pages=pages, fillers=fillers, new=new) for steady in (True, False)
        ]
        assert runs[0][0] == runs[1][0]
        runs[0][1].check_invariants()
