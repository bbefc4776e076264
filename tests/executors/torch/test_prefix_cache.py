"""The torch executor with prefix caching: shared KV pages give exactly the tokens computed afresh."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import attrs  # noqa: E402

from phasesched import Request, SchedulingPolicy  # noqa: E402
from phasesched.policies import FixedChunk, TokenBudget  # noqa: E402
from phasesched_torch import create_executor  # noqa: E402
from tests.executors.torch.helpers import EngineRun, random_prompts, run_engine  # noqa: E402

PAGE = 4


def policy(*, cache: bool, seqs: int = 8) -> SchedulingPolicy:
    """Decode-first with small chunks, so prompts span several steps; prefix caching on or off."""
    return SchedulingPolicy(
        budget=TokenBudget(max_num_batched_tokens=24, max_num_seqs=seqs),
        chunker=FixedChunk(12),
        enable_prefix_caching=cache,
    )


def both(requests: list[Request], *, num_pages: int, seqs: int = 8) -> tuple[EngineRun, EngineRun]:
    """Serve ``requests`` with and without the cache, each on a fresh executor with the same weights."""
    runs = []
    for cache in (True, False):
        executor = create_executor(model="tiny", num_pages=num_pages, page_size=PAGE, seed=3)
        runs.append(run_engine(executor, policy(cache=cache, seqs=seqs), requests, num_pages=num_pages, page_size=PAGE))
    return runs[0], runs[1]


def cached_starts(run: EngineRun) -> list[int]:
    """Where admitted slices started (a positive start is a cache hit)."""
    news = [(plan, {r.request_id for r in plan.new_requests}) for plan in run.plans]
    return [int(p.start[i]) for p, ids in news for i, rid in enumerate(p.request_ids) if rid in ids and p.start[i] > 0]


def resumed_starts(run: EngineRun) -> list[int]:
    """Where requests readmitted after a preemption started again (positive: from a cached prefix)."""
    preempted: set[str] = set()
    starts = []
    for plan in run.plans:
        new = {r.request_id for r in plan.new_requests}
        starts += [int(plan.start[i]) for i, rid in enumerate(plan.request_ids) if rid in new and rid in preempted]
        preempted.update(plan.preempted)
    return starts


class TestSameTokens:
    def test_shared_system_prompt(self) -> None:
        """Requests arriving after one another with one system prompt: hits, and the same greedy tokens."""
        system, tails = random_prompts([21], 512, seed=1)[0], random_prompts([3, 5, 7, 2], 512, seed=2)
        requests = [
            Request(f"r{i}", prompt_token_ids=[*system, *tail], max_new_tokens=6, arrival_time=float(i))
            for i, tail in enumerate(tails)
        ]
        on, off = both(requests, num_pages=64, seqs=1)
        assert cached_starts(on), "no request started from the cache"
        assert on.outputs() == off.outputs()

    def test_multi_turn_continuation(self) -> None:
        """A second turn whose prompt holds the first turn's answer claims its pages and matches."""
        prompt = random_prompts([14], 512, seed=4)[0]
        first = both([Request("t1", prompt_token_ids=prompt, max_new_tokens=12)], num_pages=32)[1]
        follow = [*prompt, *first.outputs()["t1"], 5, 6, 7]
        requests = [
            Request("t1", prompt_token_ids=prompt, max_new_tokens=12),
            Request("t2", prompt_token_ids=follow, max_new_tokens=8, arrival_time=1.0),
        ]
        on, off = both(requests, num_pages=32, seqs=1)
        assert max(cached_starts(on)) >= 24
        assert on.outputs() == off.outputs()

    def test_eviction_and_preemption_under_pressure(self) -> None:
        """Few pages: cached pages are evicted, requests preempted and resumed from their cached prefix."""
        system = random_prompts([16], 512, seed=5)[0]
        tails = random_prompts([4, 9, 6, 3, 8, 5], 512, seed=6)
        requests = [
            Request(f"r{i}", prompt_token_ids=[*system[: 4 * (i % 5)], *tail], max_new_tokens=10)
            for i, tail in enumerate(tails)
        ]
        on, off = both(requests, num_pages=14)
        assert on.num_preemptions > 0
        assert on.cache_stats.evictions > 0
        assert on.cache_stats.hits > 0
        assert cached_starts(on)
        assert any(start > 0 for start in resumed_starts(on)), "no preempted request resumed from the cache"
        assert on.outputs() == off.outputs()


def test_cache_policy_evolves() -> None:
    """The option is part of the policy value."""
    assert attrs.evolve(policy(cache=False), enable_prefix_caching=True).enable_prefix_caching
