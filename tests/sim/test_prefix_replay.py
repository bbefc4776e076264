"""Replaying the Mooncake trace's ``hash_ids``: the simulated prefix-cache hits are the ones the trace implies."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from phasesched import load_policy
from phasesched.policies import PolicyOptions
from phasesched.sim import Deployment, Periodic, load_trace, simulate
from phasesched.sim.shared_prefix import SharedPrefixes, shared_prefix
from phasesched.sim.workload import Workload

TRACE = Path(__file__).parents[2] / "data" / "traces" / "conversation_trace.jsonl"
BLOCK = 512
LONGEST = 1 << 17  # some conversations exceed the default 32768-token context


def page_keys(ids: list[int], prompt_len: int, page: int) -> list[tuple[tuple[int, ...], int]]:
    """Each full prompt page, named independently of phasesched: the block ids up to its last block, and its offset."""
    pages = min(prompt_len, len(ids) * BLOCK) // page
    return [(tuple(ids[: ((k + 1) * page - 1) // BLOCK + 1]), (k * page) % BLOCK) for k in range(pages)]


def infinite_cache_bound(workload: Workload, page: int) -> tuple[int, int]:
    """(queried, hit) tokens if requests ran one after another on an infinite cache.

    A request looks up its full prompt pages but the last token's (it always computes one), and
    hits the leading run of them that an earlier request's prompt held.
    """
    assert workload.blocks is not None
    seen: set[tuple[tuple[int, ...], int]] = set()
    queried = hits = 0
    for i in range(len(workload)):
        ids = list(workload.blocks.row(i).hash_ids)
        length = int(workload.prompt_len[i])
        keys = page_keys(ids, length, page)
        claimable = keys[: (length - 1) // page]
        run = 0
        while run < len(claimable) and claimable[run] in seen:
            run += 1
        queried, hits = queried + len(claimable), hits + run
        seen.update(keys)
    return queried * page, hits * page


@pytest.fixture(scope="module")
def trace() -> Workload:
    """The first 120 requests of Mooncake's conversation trace."""
    return load_trace(TRACE).head(120)


class TestMooncakeReplay:
    def test_trace_keeps_its_block_hashes(self, trace: Workload) -> None:
        """The loader keeps hash_ids as 512-token blocks, one list per request."""
        assert trace.blocks is not None
        assert trace.blocks.block_size == BLOCK
        first = next(trace.requests())
        assert first.prompt_blocks is not None
        assert len(first.prompt_blocks.hash_ids) == -(-first.prompt_len // BLOCK)

    @pytest.mark.parametrize("page", [16, 512])
    def test_hits_equal_the_infinite_cache_bound_when_served_one_by_one(self, trace: Workload, page: int) -> None:
        """Spaced far apart on a cache that never evicts, every repeat of a prefix hits, and nothing else does."""
        spaced = attrs.evolve(trace, arrival_s=np.arange(len(trace)) * 1000.0)
        deployment = Deployment(page_size=page, num_pages=4_000_000 // page, max_model_len=LONGEST)
        result = simulate(spaced, load_policy("vllm", PolicyOptions()), deployment)
        queried, hits = infinite_cache_bound(spaced, page)
        assert result.metrics["completed"] == len(trace)
        assert hits > 0
        assert (result.prefix_cache.queried, result.prefix_cache.hits) == (queried, hits)

    def test_replayed_at_its_own_pace_hits_no_more_than_the_bound(self, trace: Workload) -> None:
        """At the trace's arrival times requests overlap, so some repeats arrive before their prefix is cached."""
        result = simulate(
            trace, load_policy("vllm", PolicyOptions()), Deployment(num_pages=400_000, max_model_len=LONGEST)
        )
        queried, hits = infinite_cache_bound(trace, 16)
        assert result.metrics["num_preemptions"] == 0  # a readmission would look its prefix up again
        assert result.prefix_cache.queried == queried
        assert 0 < result.prefix_cache.hits <= hits
        assert result.to_dict()["prefix_cache_hit_rate"] == pytest.approx(result.prefix_cache.hits / queried)

    def test_without_the_cache_nothing_hits(self, trace: Workload) -> None:
        """With prefix caching off the counters stay zero."""
        off = load_policy("vllm", PolicyOptions(enable_prefix_caching=False))
        result = simulate(trace.head(20), off, Deployment(num_pages=400_000, max_model_len=LONGEST))
        assert result.prefix_cache.hits == result.prefix_cache.queried == 0


class TestSharedPrefixWorkload:
    def test_a_shared_system_prompt_hits_for_every_later_session(self) -> None:
        """Sessions one after another share a 1024-token system prompt: each after the first claims its 64 pages."""
        sharing = SharedPrefixes(system_prompt=1024, turns=1)
        workload = shared_prefix(10, Periodic(0.01), 32, 8, sharing)
        result = simulate(workload, load_policy("vllm", PolicyOptions()), Deployment(num_pages=10_000))
        assert result.prefix_cache.hits == 9 * 1024
        assert result.prefix_cache.queried == 10 * ((1056 - 1) // 16) * 16

    def test_a_second_turn_claims_the_first_turns_prompt(self) -> None:
        """Turn two's prompt holds turn one's whole prompt (66 full pages) as its cached prefix."""
        sharing = SharedPrefixes(system_prompt=1024, share=0.0, turns=2, think_s=1000.0)
        workload = shared_prefix(3, Periodic(0.01), 32, 8, sharing)
        result = simulate(workload, load_policy("vllm", PolicyOptions()), Deployment(num_pages=10_000))
        assert result.prefix_cache.hits == 3 * 1056

    def test_no_sharing_no_hits(self) -> None:
        """Private system prompts and single turns share nothing."""
        workload = shared_prefix(10, Periodic(0.01), 32, 8, SharedPrefixes(share=0.0))
        result = simulate(workload, load_policy("vllm", PolicyOptions()), Deployment(num_pages=10_000))
        assert result.prefix_cache.hits == 0
