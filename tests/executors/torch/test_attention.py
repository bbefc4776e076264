"""Paged attention and KV append against dense references (torch SDPA, and plain einsum math)."""

from __future__ import annotations

import math
from unittest import mock

import pytest

pytest.importorskip("torch")
import attrs
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched_torch import _attention as attention_module
from phasesched_torch import (
    append_paged_kv_cache,
    paged_attention,
    plan_paged_attention,
    run_paged_attention,
)

LN2 = math.log(2.0)


SHORT = ((5, 9), (1, 6), (7, 7))
LONG = ((20, 45), (1, 30), (1, 17), (1, 3), (9, 12), (1, 1), (3, 40), (1, 28))
"""(q_len, kv_len) per slice: a few short slices, and long ones around a window of a few tokens."""


@attrs.frozen
class Case:
    """A random batch: slices with (q_len, kv_len), pages scattered through a larger cache."""

    page_size: int
    kv_heads: int
    group: int
    head_dim: int
    lengths: tuple[tuple[int, int], ...]  # (q_len, kv_len) per slice
    seed: int

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group


@st.composite
def slice_lengths(draw: st.DrawFn) -> tuple[int, int]:
    kv_len = draw(st.integers(1, 48))
    q_len = draw(st.one_of(st.just(1), st.just(kv_len), st.integers(1, kv_len)))  # decode, whole prompt, a chunk
    return q_len, kv_len


@st.composite
def cases(draw: st.DrawFn) -> Case:
    return Case(
        page_size=draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16])),
        kv_heads=draw(st.sampled_from([1, 2, 4])),
        group=draw(st.sampled_from([1, 2, 3, 4])),
        head_dim=draw(st.sampled_from([4, 8, 16, 64])),
        lengths=tuple(draw(st.lists(slice_lengths(), min_size=1, max_size=5))),
        seed=draw(st.integers(0, 2**16)),
    )


@attrs.frozen(eq=False)
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    cache: torch.Tensor  # [P, 2, page, Hkv, D]
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray

    @property
    def meta(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len


def build(case: Case, dtype: torch.dtype = torch.float32) -> Batch:
    """Random queries and cache; each slice's pages are a random, non-contiguous set of page ids."""
    rng = np.random.default_rng(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    q_lens = np.array([q for q, _ in case.lengths])
    kv_lens = np.array([kv for _, kv in case.lengths])
    pages = -(-kv_lens // case.page_size)
    num_pages = int(pages.sum()) + 3
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = rng.permutation(num_pages)[: int(pages.sum())].astype(np.int32)
    cache = torch.randn(num_pages, 2, case.page_size, case.kv_heads, case.head_dim, generator=gen).to(dtype)
    q = torch.randn(int(q_lens.sum()), case.q_heads, case.head_dim, generator=gen).to(dtype)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    last = ((kv_lens - 1) % case.page_size + 1).astype(np.int32)
    return Batch(q, cache, qo_indptr, kv_indptr, kv_indices, last)


def dense_kv(batch: Batch, b: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``b``'s keys and values gathered densely: each ``[kv_len, Hkv, D]``."""
    pages = torch.from_numpy(batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]].astype(np.int64))
    hkv, d = batch.cache.shape[3:]
    k = batch.cache[pages, 0].reshape(-1, hkv, d)[:kv_len]
    v = batch.cache[pages, 1].reshape(-1, hkv, d)[:kv_len]
    return k, v


def sdpa_reference(batch: Batch, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slice, torch SDPA in float64 with a bottom-right causal mask, and the base-2 LSE."""
    outs, lses = [], []
    for b, (q_len, kv_len) in enumerate(case.lengths):
        k, v = dense_kv(batch, b, kv_len)
        q = batch.q[batch.qo_indptr[b] : batch.qo_indptr[b + 1]].double().transpose(0, 1)  # [Hq, L, D]
        k = k.double().repeat_interleave(case.group, dim=1).transpose(0, 1)
        v = v.double().repeat_interleave(case.group, dim=1).transpose(0, 1)
        mask = torch.arange(kv_len)[None, :] <= (torch.arange(q_len) + kv_len - q_len)[:, None]
        outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0].transpose(0, 1))
        scores = (q @ k.transpose(1, 2) / math.sqrt(case.head_dim)).masked_fill(~mask, -math.inf)
        lses.append(torch.logsumexp(scores, dim=-1).transpose(0, 1) / LN2)
    return torch.cat(outs), torch.cat(lses)


class TestPagedAttention:
    @settings(max_examples=80, deadline=None)
    @given(case=cases())
    def test_matches_sdpa(self, case: Case) -> None:
        """Every slice's output and LSE equal SDPA on its densely gathered context."""
        batch = build(case)
        out, lse = paged_attention(batch.q, batch.cache, *batch.meta)
        ref_out, ref_lse = sdpa_reference(batch, case)
        assert out.dtype == torch.float32
        assert lse.shape == (batch.q.shape[0], case.q_heads)
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)

    @settings(max_examples=25, deadline=None)
    @given(case=cases(), gather=st.integers(1, 40), scores=st.integers(1, 60))
    def test_memory_caps_do_not_change_results(self, case: Case, gather: int, scores: int) -> None:
        """Small buckets for decodes and small query blocks for prefills give the same numbers."""
        batch = build(case)
        expected, expected_lse = paged_attention(batch.q, batch.cache, *batch.meta)
        with (
            mock.patch.object(attention_module, "_MAX_GATHER_TOKENS", gather),
            mock.patch.object(attention_module, "_MAX_SCORES", scores),
        ):
            plan = plan_paged_attention(*batch.meta, case.page_size)
            out, lse = run_paged_attention(plan, batch.q, batch.cache)
        singles = sum(1 for q, _ in case.lengths if q == 1)
        assert len(plan.row_groups) >= (singles > 0)
        # Other buckets and blocks sum the same terms in another order: fp32 results may differ by
        # a few ulps (1.1e-6 was seen on one draw), which assert_close's fp32 defaults allow.
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(lse, expected_lse)

    @settings(max_examples=15, deadline=None)
    @given(case=cases())
    def test_layouts_agree(self, case: Case) -> None:
        """NHD, HND and (K, V) tuple caches holding the same tokens give bit-identical results."""
        batch = build(case)
        nhd, _ = paged_attention(batch.q, batch.cache, *batch.meta)
        hnd_cache = batch.cache.transpose(2, 3).contiguous()
        hnd, _ = paged_attention(batch.q, hnd_cache, *batch.meta, kv_layout="HND")
        pair, _ = paged_attention(batch.q, (batch.cache[:, 0], batch.cache[:, 1]), *batch.meta)
        pair_hnd, _ = paged_attention(batch.q, (hnd_cache[:, 0], hnd_cache[:, 1]), *batch.meta, kv_layout="HND")
        for other in (hnd, pair, pair_hnd):
            assert torch.equal(nhd, other)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_precision_inputs(self, dtype: torch.dtype) -> None:
        """Half-precision q and cache: output in that dtype, within FlashInfer's bf16 tolerance of fp32."""
        case = Case(page_size=16, kv_heads=2, group=4, head_dim=64, lengths=((37, 37), (1, 200), (12, 80)), seed=3)
        batch = build(case, dtype)
        out, _ = paged_attention(batch.q, batch.cache, *batch.meta)
        ref, _ = sdpa_reference(batch, case)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)

    @pytest.mark.parametrize(
        ("causal", "window_left", "soft_cap", "lengths"),
        [
            (False, -1, 0.0, SHORT),
            (True, 3, 0.0, SHORT),
            (True, -1, 5.0, SHORT),
            (False, 2, 1.5, SHORT),
            (True, 0, 0.0, LONG),
            (True, 6, 0.0, LONG),
            (True, 15, 0.0, LONG),
            (False, 6, 0.0, LONG),
        ],
    )
    def test_mask_options(
        self, causal: bool, window_left: int, soft_cap: float, lengths: tuple[tuple[int, int], ...]
    ) -> None:
        """Non-causal, sliding-window (around short and long contexts) and soft-capped attention match a dense one."""
        case = Case(page_size=4, kv_heads=2, group=2, head_dim=8, lengths=lengths, seed=11)
        batch = build(case)
        out, lse = paged_attention(
            batch.q,
            batch.cache,
            *batch.meta,
            causal=causal,
            window_left=window_left,
            logits_soft_cap=soft_cap,
            sm_scale=0.3,
        )
        for b, (q_len, kv_len) in enumerate(case.lengths):
            k, v = dense_kv(batch, b, kv_len)
            q = batch.q[batch.qo_indptr[b] : batch.qo_indptr[b + 1]].double()
            s = torch.einsum("qhd,khd->hqk", q, k.double().repeat_interleave(2, dim=1)) * 0.3
            if soft_cap:
                s = soft_cap * torch.tanh(s / soft_cap)
            qpos = torch.arange(q_len)[:, None] + kv_len - q_len
            kpos = torch.arange(kv_len)[None, :]
            ok = torch.ones(q_len, kv_len, dtype=torch.bool)
            if causal:
                ok &= kpos <= qpos
            if window_left >= 0:
                ok &= kpos >= qpos - window_left
            s = s.masked_fill(~ok, -math.inf)
            expected = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double().repeat_interleave(2, dim=1))
            rows = slice(batch.qo_indptr[b], batch.qo_indptr[b + 1])
            torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[rows].double(), (torch.logsumexp(s, -1) / LN2).T, atol=1e-5, rtol=1e-5)

    def test_window_bounds_the_gathered_keys(self) -> None:
        """With a sliding window, decodes and prefill blocks gather only the keys inside it, whatever the context."""
        case = Case(page_size=4, kv_heads=2, group=2, head_dim=8, lengths=LONG, seed=11)
        batch = build(case)
        plan = plan_paged_attention(*batch.meta, case.page_size, window_left=5)
        assert plan.window_left == 5
        assert all(group.pages.shape[1] <= 6 for group in plan.row_groups)
        assert all(block.pages.shape[0] <= block.q_end - block.q_start + 5 for block in plan.blocks)

    def test_empty_batch(self) -> None:
        """A batch with no slices gives empty outputs."""
        q = torch.empty(0, 4, 8)
        out, lse = paged_attention(q, torch.zeros(2, 2, 4, 2, 8), [0], [0], [], np.empty(0, np.int32))
        assert out.shape == (0, 4, 8)
        assert lse.shape == (0, 4)

    @pytest.mark.parametrize(
        ("qo", "kv", "last", "message"),
        [
            ([0, 5], [0, 1], [4], "kv_len >= q_len"),
            ([0, 1], [0, 1], [0], "kv_last_page_len"),
            ([0, 1], [0, 1], [5], "kv_last_page_len"),
            ([0, 1, 2], [0, 1], [1], "entries"),
            ([0, 1], [0, 0], [1], "no KV pages"),
            ([0, 1], [0, 3], [1], "within kv_indices"),
            ([0, 1], [0, 1], [1], "non-negative"),
        ],
    )
    def test_rejects_inconsistent_metadata(self, qo: list[int], kv: list[int], last: list[int], message: str) -> None:
        """Metadata that cannot describe a cache raises ValueError before any compute."""
        q = torch.randn(qo[-1], 2, 8)
        pages = [-1, 2] if message == "non-negative" else [1, 2]
        with pytest.raises(ValueError, match=message):
            paged_attention(q, torch.zeros(4, 2, 4, 2, 8), qo, kv, pages, last)

    def test_run_rejects_a_cache_too_small_for_the_plan(self) -> None:
        """A plan that reads page 7 cannot run against a 4-page cache."""
        plan = plan_paged_attention([0, 1], [0, 1], [7], [1], 4)
        with pytest.raises(ValueError, match="page 7"):
            run_paged_attention(plan, torch.randn(1, 2, 8), torch.zeros(4, 2, 4, 2, 8))


class TestAppend:
    @settings(max_examples=30, deadline=None)
    @given(case=cases())
    def test_appends_at_absolute_positions(self, case: Case) -> None:
        """Each slice's last q_len tokens land at page kv_indices[pos // page], row pos % page; nothing else changes."""
        batch = build(case)
        cache = batch.cache.clone()
        q_lens = np.diff(batch.qo_indptr)
        kv_lens = np.array([kv for _, kv in case.lengths])
        batch_idx = np.repeat(np.arange(len(q_lens)), q_lens)
        positions = np.concatenate([np.arange(kv - q, kv) for q, kv in zip(q_lens, kv_lens, strict=True)])
        gen = torch.Generator().manual_seed(case.seed + 1)
        keys = torch.randn(len(positions), case.kv_heads, case.head_dim, generator=gen)
        values = torch.randn(len(positions), case.kv_heads, case.head_dim, generator=gen)
        append_paged_kv_cache(
            keys,
            values,
            torch.from_numpy(batch_idx),
            torch.from_numpy(positions),
            cache,
            torch.from_numpy(batch.kv_indices),
            torch.from_numpy(batch.kv_indptr),
            torch.from_numpy(batch.kv_last_page_len),
        )
        expected = batch.cache.clone()
        for row, (b, pos) in enumerate(zip(batch_idx.tolist(), positions.tolist(), strict=True)):
            page = batch.kv_indices[batch.kv_indptr[b] + pos // case.page_size]
            expected[page, 0, pos % case.page_size] = keys[row]
            expected[page, 1, pos % case.page_size] = values[row]
        assert torch.equal(cache, expected)

    def test_rejects_position_past_kv_len(self) -> None:
        """Appending at a position the metadata does not cover raises ValueError."""
        cache = torch.zeros(4, 2, 4, 1, 8)
        with pytest.raises(ValueError, match="outside"):
            append_paged_kv_cache(
                torch.zeros(1, 1, 8),
                torch.zeros(1, 1, 8),
                torch.tensor([0]),
                torch.tensor([3]),
                cache,
                torch.tensor([2]),
                torch.tensor([0, 1]),
                torch.tensor([3]),
            )
