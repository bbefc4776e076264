"""Step plans: FlashInfer-layout metadata, immutability, and layout checks."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched import Phase, Request, SchedulingPolicy
from phasesched.plan import StepPlan, token_positions
from phasesched.policies import FixedChunk, TokenBudget
from tests.fakes import Driver, make_requests, scheduler_for


def mixed_plan() -> StepPlan:
    """One 6-token decode-ready request beside a 10-token prompt chunked at 5, page size 4."""
    policy = SchedulingPolicy(budget=TokenBudget(64, 8), chunker=FixedChunk(5))
    driver = Driver(scheduler_for(policy, num_pages=16, page_size=4))
    driver.scheduler.add_request(Request("a", prompt_token_ids=[10, 11, 12, 13, 14], max_new_tokens=4))
    driver.step()
    driver.scheduler.add_request(Request("b", prompt_token_ids=list(range(20, 30)), max_new_tokens=4))
    return driver.scheduler.schedule()


class TestStepPlan:
    def test_metadata_by_hand(self) -> None:
        """qo_indptr, kv_indptr, last-page lengths, positions and input ids match a hand computation."""
        plan = mixed_plan()
        assert plan.request_ids == ("a", "b")
        assert plan.start.tolist() == [5, 0]
        assert plan.num_new.tolist() == [1, 5]
        assert plan.qo_indptr.tolist() == [0, 1, 6]
        assert plan.kv_len.tolist() == [6, 5]
        assert plan.kv_indptr.tolist() == [0, 2, 4]
        assert plan.kv_last_page_len.tolist() == [2, 1]
        assert plan.positions.tolist() == [5, 0, 1, 2, 3, 4]
        assert plan.input_ids is not None
        assert plan.input_ids.tolist() == [5, 20, 21, 22, 23, 24]
        assert plan.samples.tolist() == [True, False]
        assert [p.phase for p in plan.pieces] == [Phase.DECODE, Phase.PREFILL]
        assert plan.num_decodes == 1
        assert plan.num_prefill_tokens == 5
        assert len(set(plan.kv_indices.tolist())) == 4
        plan.check_layout()

    def test_arrays_are_read_only(self) -> None:
        """A plan's arrays cannot be written, so an executor cannot change what the scheduler planned."""
        plan = mixed_plan()
        for array in (plan.slots, plan.qo_indptr, plan.kv_indices, plan.positions, plan.input_ids):
            assert array is not None
            with pytest.raises(ValueError):
                array[0] = 99

    def test_length_only_requests_have_no_input_ids(self) -> None:
        """When a request carries no token ids, the plan's input_ids is None."""
        scheduler = scheduler_for(SchedulingPolicy())
        for request in make_requests([3], with_ids=False):
            scheduler.add_request(request)
        assert scheduler.schedule().input_ids is None

    @pytest.mark.parametrize(
        ("field", "value", "match"),
        [
            ("qo_indptr", np.array([0, 1, 5], np.int32), "qo_indptr"),
            ("kv_indptr", np.array([0, 1, 4], np.int32), "kv_indptr"),
            ("kv_last_page_len", np.array([3, 1], np.int32), "kv_last_page_len"),
            ("positions", np.array([5, 0, 1, 2, 3, 9], np.int32), "positions"),
            ("request_ids", ("a", "a"), "twice"),
            ("kv_indices", np.array([0, 1, 1, 2], np.int32), "used by another"),
            ("num_new", np.array([0, 5], np.int32), "at least one"),
        ],
    )
    def test_check_layout_finds_inconsistencies(self, field: str, value: Any, match: str) -> None:
        """check_layout() names the array that disagrees with the others."""
        plan = attrs.evolve(mixed_plan(), **{field: value})
        with pytest.raises(ValueError, match=match):
            plan.check_layout()


@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), page=st.integers(1, 8), chunk=st.integers(1, 16))
@settings(deadline=None, max_examples=60)
def test_metadata_reconstructs_every_sequence(lengths: list[int], page: int, chunk: int) -> None:
    """Reading each slice's tokens back through the plan's page tables gives its positions in order."""
    policy = SchedulingPolicy(budget=TokenBudget(32, 8), chunker=FixedChunk(chunk))
    driver = Driver(scheduler_for(policy, num_pages=512, page_size=page))
    for request in make_requests(lengths, max_new_tokens=3):
        driver.scheduler.add_request(request)
    cache: dict[tuple[int, int], int] = {}  # (page, row) -> position written there
    for _ in range(200):
        if not driver.scheduler.num_unfinished:
            break
        plan = driver.scheduler.schedule()
        plan.check_layout()
        for i in range(plan.batch_size):
            pages = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]]
            rows = plan.positions[plan.qo_indptr[i] : plan.qo_indptr[i + 1]]
            for pos in rows.tolist():
                cache[(int(pages[pos // page]), pos % page)] = pos
            readable = [cache.get((int(pages[t // page]), t % page)) for t in range(int(plan.kv_len[i]))]
            assert readable == list(range(int(plan.kv_len[i])))
        driver.scheduler.update(plan, driver.executor.execute(plan))
    assert not driver.scheduler.num_unfinished


@given(
    st.lists(st.tuples(st.integers(0, 5_000), st.integers(1, 300)), min_size=1, max_size=40),
    st.sampled_from([np.int32, np.int64]),
)
def test_token_positions_count_up_from_each_start(slices: list[tuple[int, int]], dtype: type[np.integer]) -> None:
    """Each slice's positions are its start, start + 1, ...; int32 whatever the starts' dtype."""
    start = np.array([s for s, _ in slices], dtype=dtype)
    num_new = np.array([n for _, n in slices], dtype=np.int32)
    positions = token_positions(start, num_new)
    assert positions.dtype == np.int32
    assert positions.tolist() == [p for s, n in slices for p in range(s, s + n)]
