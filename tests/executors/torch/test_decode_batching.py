"""The torch executor's declared decode batching is the layout its attention plan really builds."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from phasesched.costmodel import DecodeBatching
from phasesched.costmodel.batching import decode_batching_of
from phasesched_torch import create_executor, plan_paged_attention
from phasesched_torch._attention import DECODE_BATCHING

PAGE_SIZE = 16


def decode_plan_groups(contexts: list[int]) -> list[tuple[int, int]]:
    """``(rows, padded length)`` of each decode bucket the attention plan forms for these contexts."""
    pages = [-(-c // PAGE_SIZE) for c in contexts]
    kv_indptr = np.concatenate([[0], np.cumsum(pages)])
    last = [c - (p - 1) * PAGE_SIZE for c, p in zip(contexts, pages, strict=True)]
    plan = plan_paged_attention(
        np.arange(len(contexts) + 1), kv_indptr, np.zeros(int(kv_indptr[-1]), dtype=np.int64), last, PAGE_SIZE
    )
    return [(int(g.pages.shape[0]), int(g.pages.shape[1])) for g in plan.row_groups]


class TestTorchDecodeBatching:
    def test_executor_declares_its_attention_layout(self) -> None:
        """TorchExecutor.decode_batching is the object plan_paged_attention buckets with: 3/4 ratio, 64K-token cap."""
        executor = create_executor(model="tiny", num_pages=8, page_size=PAGE_SIZE)
        assert decode_batching_of(executor) is DECODE_BATCHING
        assert DecodeBatching(bucket_ratio=0.75, bucket_tokens=1 << 16) == DECODE_BATCHING

    @given(st.lists(st.integers(1, 40_000), min_size=1, max_size=12))
    def test_padded_tokens_match_the_plan(self, contexts: list[int]) -> None:
        """The declared buckets are the plan's row groups: the cost model reads the padded tokens it gathers."""
        groups = decode_plan_groups(contexts)
        declared = DECODE_BATCHING.buckets(np.array(contexts))
        assert [(len(b), int(np.array(contexts)[b].max())) for b in declared] == groups
        assert sum(rows * length for rows, length in groups) == DECODE_BATCHING.padded_tokens(np.array(contexts))

    def test_uneven_batch_is_padded_within_buckets(self) -> None:
        """A long and two short decodes: the short ones do not pay for the long one; one short pads to the other."""
        assert decode_plan_groups([1000, 100, 90]) == [(1, 1000), (2, 100)]
        assert DECODE_BATCHING.decode_features(np.array([1000, 100, 90])) == (3, 1200 / 3)
