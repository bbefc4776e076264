"""Paged attention over a FlashInfer-layout cache, in plain PyTorch.

This is the numerical reference the FlashInfer executor is checked against, so its inputs are
exactly FlashInfer's: ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len`` (int,
metadata *after* this step's tokens are appended) and a cache of shape
``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD; ``[:, 0]`` keys, ``[:, 1]`` values),
or HND, or a ``(k_cache, v_cache)`` tuple. Slice ``b``'s queries are the *last*
``q_len_b`` tokens of its ``kv_len_b`` cached tokens, so causality is relative to absolute
positions. The math is float32 whatever the input dtype.

Like FlashInfer, the work is split into a plan and a run: :func:`plan_paged_attention` turns
the host metadata into gather indices and masks once per step, and :func:`run_paged_attention`
applies them to each layer's queries and cache. Single-query slices (decodes) are batched,
padded to the longest context in a bucket; multi-query slices (prefill chunks) run one block
of query rows at a time. No Python loop runs per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from phasesched.costmodel.batching import DecodeBatching
from phasesched_torch._kv_cache import KVLayout, PagedKVCache, cache_geometry, gather_kv

__all__ = ["DECODE_BATCHING", "PagedAttentionPlan", "paged_attention", "plan_paged_attention", "run_paged_attention"]

IndexLike = torch.Tensor | NDArray[np.integer[Any]] | Sequence[int]
"""Integer metadata: a tensor (CPU preferred), a numpy array or a list."""

# Memory caps on the float32 temporaries: gathered context tokens per decode bucket, and
# score elements per head per prefill block (1 << 22 is 16 MiB a head).
_MAX_GATHER_TOKENS = 1 << 16
_MAX_SCORES = 1 << 22

DECODE_BATCHING = DecodeBatching(bucket_ratio=0.75, bucket_tokens=_MAX_GATHER_TOKENS)
"""How single-query slices are batched: buckets of contexts within a quarter of their longest,
padded to it, at most ``_MAX_GATHER_TOKENS`` gathered tokens a bucket. :func:`plan_paged_attention`
forms its buckets with this object, so the cost model's reading of a step (``phasesched
profile`` records it) is the executor's own layout, not a copy of it."""


@attrs.frozen(eq=False)
class _RowGroup:
    """Single-query slices batched and padded to the longest context among them.

    Attributes:
        rows: int64 ``[N]``: query row of each slice.
        pages: int64 ``[N, L]``: page of each context token (padding points at a real page).
        offsets: int64 ``[N, L]``: row of each context token within its page.
        mask: bool ``[N, L]``: which context tokens each query may attend to.

    """

    rows: torch.Tensor
    pages: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor


@attrs.frozen(eq=False)
class _QueryBlock:
    """Consecutive query rows ``[q_start, q_end)`` of one slice against its context.

    Attributes:
        q_start: First query row.
        q_end: One past the last query row.
        pages: int64 ``[L]``: page of each context token the block may see.
        offsets: int64 ``[L]``: row of each context token within its page.
        mask: bool ``[q_end - q_start, L]``: causal (and window) visibility.

    """

    q_start: int
    q_end: int
    pages: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor


@attrs.frozen(eq=False)
class PagedAttentionPlan:
    """Gather indices and masks for one step's attention, reused by every layer.

    Build it with :func:`plan_paged_attention`; run it with :func:`run_paged_attention`.

    Attributes:
        num_rows: Query rows ``T`` the plan covers (``qo_indptr[-1]``).
        page_size: Tokens per page.
        max_page: The largest page id referenced (-1 when none), checked against the cache.
        sm_scale: Softmax scale, or ``None`` for ``1 / sqrt(head_dim)``.
        logits_soft_cap: ``cap * tanh(s / cap)`` on the scores when positive.
        row_groups: Batched single-query slices.
        blocks: Query blocks of multi-query slices.
        window_left: The sliding window the masks apply: keys at most this many positions
            before the query (-1: none).

    """

    num_rows: int
    page_size: int
    max_page: int
    sm_scale: float | None
    logits_soft_cap: float
    row_groups: tuple[_RowGroup, ...]
    blocks: tuple[_QueryBlock, ...]
    window_left: int = -1

    def scale(self, head_dim: int) -> float:
        """The softmax scale for heads of ``head_dim``."""
        return 1.0 / math.sqrt(head_dim) if self.sm_scale is None else self.sm_scale


@attrs.frozen(eq=False)
class _HostMeta:
    """The metadata as int64 host arrays, with per-slice lengths derived."""

    qo_indptr: NDArray[np.int64]
    kv_indptr: NDArray[np.int64]
    kv_indices: NDArray[np.int64]
    q_len: NDArray[np.int64]
    kv_len: NDArray[np.int64]
    num_pages: NDArray[np.int64]
    page_size: int

    def token_pages(self, slices: NDArray[np.int64], kpos: NDArray[np.int64]) -> NDArray[np.int64]:
        """Page of context position ``kpos[i, j]`` of slice ``slices[i]`` (clamped into its table)."""
        column = np.minimum(kpos // self.page_size, np.maximum(self.num_pages[slices] - 1, 0)[:, None])
        return self.kv_indices[self.kv_indptr[slices][:, None] + column]


def _host(array: IndexLike) -> NDArray[np.int64]:
    if isinstance(array, torch.Tensor):
        return array.detach().to("cpu", torch.int64).numpy()
    return np.asarray(array, dtype=np.int64)


def _host_meta(  # noqa: PLR0913 -- FlashInfer's four metadata arrays, plus the geometry
    qo_indptr: IndexLike,
    kv_indptr: IndexLike,
    kv_indices: IndexLike,
    kv_last_page_len: IndexLike,
    *,
    page_size: int,
    causal: bool,
) -> _HostMeta:
    """Check the metadata's consistency and derive lengths. Raises ``ValueError``."""
    qo, kvp, idx, last = _host(qo_indptr), _host(kv_indptr), _host(kv_indices), _host(kv_last_page_len)
    batch = len(last)
    if qo.shape != (batch + 1,) or kvp.shape != (batch + 1,):
        msg = f"qo_indptr {qo.shape} and kv_indptr {kvp.shape} must have {batch + 1} entries"
        raise ValueError(msg)
    q_len, num_pages = np.diff(qo), np.diff(kvp)
    if np.any(q_len < 0) or np.any(num_pages < 0) or kvp[-1] > len(idx) or (batch and (qo[0] or kvp[0])):
        raise ValueError("indptr arrays must start at 0, never decrease, and stay within kv_indices")
    if np.any((q_len > 0) & (num_pages == 0)):
        raise ValueError("a slice with queries has no KV pages")
    if np.any(idx[: kvp[-1]] < 0):  # torch would wrap a negative page id around to the cache's end
        raise ValueError("kv_indices must be non-negative")
    has_pages = num_pages > 0
    if np.any(has_pages & ((last < 1) | (last > page_size))):
        msg = f"kv_last_page_len must lie in [1, {page_size}]"
        raise ValueError(msg)
    kv_len = np.where(has_pages, (num_pages - 1) * page_size + last, 0)
    if causal and np.any(kv_len < q_len):
        raise ValueError("causal attention needs kv_len >= q_len for every slice")
    return _HostMeta(qo, kvp, idx, q_len, kv_len, num_pages, page_size)


def _visible(kpos: NDArray[np.int64], qpos: NDArray[np.int64], causal: bool, window_left: int) -> NDArray[np.bool_]:
    """Which key positions each query position sees (broadcasting ``qpos`` against ``kpos``)."""
    ok = np.ones(np.broadcast_shapes(kpos.shape, qpos.shape), dtype=bool)
    if causal:
        ok &= kpos <= qpos
    if window_left >= 0:
        ok &= kpos >= qpos - window_left
    return ok


def _row_groups(meta: _HostMeta, causal: bool, window_left: int, device: torch.device) -> list[_RowGroup]:
    """Bucket single-query slices, longest visible context first, so each bucket pads little.

    A bucket holds rows within a quarter of its longest context (and within the memory cap), so
    its padded work stays close to the sum of its contexts, as a paged kernel's does: a short
    decode beside a long one does not pay for the long one's context. With a sliding window a
    row gathers only the window's keys, the last ``window_left + 1`` of its context.
    """
    single = np.flatnonzero(meta.q_len == 1)
    span = meta.kv_len if window_left < 0 else np.minimum(meta.kv_len, window_left + 1)
    groups = []
    for bucket in DECODE_BATCHING.buckets(span[single]):
        chunk = single[bucket]
        longest = int(span[chunk[0]])
        lengths = meta.kv_len[chunk][:, None]
        first = np.maximum(lengths - longest, 0)  # 0 without a window: every context from its start
        kpos = first + np.arange(longest, dtype=np.int64)[None, :]
        mask = (kpos < lengths) & _visible(kpos, lengths - 1, causal, window_left)
        pages = meta.token_pages(chunk, kpos)
        groups.append(
            _RowGroup(
                rows=torch.from_numpy(meta.qo_indptr[chunk]).to(device),
                pages=torch.from_numpy(pages).to(device),
                offsets=torch.from_numpy(np.broadcast_to(kpos % meta.page_size, pages.shape).copy()).to(device),
                mask=torch.from_numpy(mask).to(device),
            )
        )
    return groups


def _query_blocks(meta: _HostMeta, causal: bool, window_left: int, device: torch.device) -> list[_QueryBlock]:
    """Split each multi-query slice into blocks of rows whose scores fit the memory cap."""
    blocks = []
    for s in np.flatnonzero(meta.q_len > 1).tolist():
        kv_len, q_len, q0 = int(meta.kv_len[s]), int(meta.q_len[s]), int(meta.qo_indptr[s])
        kpos = np.arange(kv_len, dtype=np.int64)
        pages = torch.from_numpy(meta.token_pages(np.array([s]), kpos[None, :])[0]).to(device)
        offsets = torch.from_numpy(kpos % meta.page_size).to(device)
        qpos_all = np.arange(kv_len - q_len, kv_len, dtype=np.int64)
        step = max(1, _MAX_SCORES // max(kv_len, 1))
        for a in range(0, q_len, step):
            qpos = qpos_all[a : a + step]
            end = int(qpos[-1]) + 1 if causal else kv_len  # causal rows never see past their last position
            begin = max(int(qpos[0]) - window_left, 0) if window_left >= 0 else 0  # nor before their window
            mask = _visible(kpos[None, begin:end], qpos[:, None], causal, window_left)
            blocks.append(
                _QueryBlock(
                    q0 + a, q0 + a + len(qpos), pages[begin:end], offsets[begin:end], torch.from_numpy(mask).to(device)
                )
            )
    return blocks


def plan_paged_attention(  # noqa: PLR0913 -- FlashInfer's plan() arguments
    qo_indptr: IndexLike,
    kv_indptr: IndexLike,
    kv_indices: IndexLike,
    kv_last_page_len: IndexLike,
    page_size: int,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    device: torch.device | str = "cpu",
) -> PagedAttentionPlan:
    """Precompute one step's gather indices and masks (FlashInfer's ``plan``).

    Pass host (CPU or numpy) metadata: the plan reads it on the host, and device metadata
    would force a synchronisation.

    Args:
        qo_indptr: int ``[B + 1]``: query rows of slice ``b`` are ``qo_indptr[b]:qo_indptr[b + 1]``.
        kv_indptr: int ``[B + 1]``: pages of slice ``b`` are ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``.
        kv_indices: int ``[kv_indptr[-1]]``: page ids, in token order.
        kv_last_page_len: int ``[B]``: tokens in each slice's last page, in ``[1, page_size]``.
        page_size: Tokens per page.
        causal: Mask keys after each query's absolute position.
        sm_scale: Softmax scale; ``None`` means ``1 / sqrt(head_dim)``.
        window_left: Sliding window: keys more than this many positions back are masked (-1: none).
        logits_soft_cap: Apply ``cap * tanh(s / cap)`` to the scores when positive.
        device: Where the indices and masks live (the cache's device).

    Returns:
        The plan, valid for any layer whose cache has this page geometry.

    Raises:
        ValueError: The metadata is inconsistent (lengths, last-page lengths, ``kv_len < q_len``).

    """
    meta = _host_meta(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size=page_size, causal=causal)
    dev = torch.device(device)
    used = meta.kv_indices[: int(meta.kv_indptr[-1])]
    return PagedAttentionPlan(
        num_rows=int(meta.qo_indptr[-1]),
        page_size=page_size,
        max_page=int(used.max(initial=-1)),
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        row_groups=tuple(_row_groups(meta, causal, window_left, dev)),
        blocks=tuple(_query_blocks(meta, causal, window_left, dev)),
        window_left=max(window_left, -1),
    )


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, plan: PagedAttentionPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention in float32 for ``N`` independent problems.

    Args:
        q: float32 ``[N, Hkv, G, Lq, D]``: queries grouped by the kv head they read.
        k: ``[N, L, Hkv, D]``: keys, any float dtype.
        v: ``[N, L, Hkv, D]``: values.
        mask: bool, broadcastable to ``[N, Hkv, G, Lq, L]``.
        plan: Supplies the softmax scale and the logit soft cap.

    Returns:
        ``(out, lse)``: float32 ``[N, Hkv, G, Lq, D]`` and natural-log ``[N, Hkv, G, Lq]``;
        a fully masked row gives zeros and ``-inf``.

    """
    keys = k.to(torch.float32).permute(0, 2, 3, 1).unsqueeze(2)  # [N, Hkv, 1, D, L]
    values = v.to(torch.float32).permute(0, 2, 1, 3).unsqueeze(2)  # [N, Hkv, 1, L, D]
    scores = torch.matmul(q, keys) * plan.scale(q.shape[-1])
    soft_cap = plan.logits_soft_cap
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)
    return torch.matmul(probs, values), lse


def run_paged_attention(
    plan: PagedAttentionPlan, q: torch.Tensor, kv_cache: PagedKVCache, *, kv_layout: KVLayout = "NHD"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend every query row to its slice's cached context (FlashInfer's ``run``).

    Args:
        plan: From :func:`plan_paged_attention`, on this cache's device.
        q: ``[T, Hq, D]``: queries, already rotated; ``Hq`` a multiple of ``Hkv``.
        kv_cache: One layer's cache (see :data:`PagedKVCache`), this step's keys already written.
        kv_layout: ``"NHD"`` or ``"HND"``.

    Returns:
        ``(out, lse)``: ``out`` ``[T, Hq, D]`` in ``q.dtype``; ``lse`` float32 ``[T, Hq]`` in
        base 2 (FlashInfer's default), ``-inf`` for rows that see no key.

    Raises:
        ValueError: ``q`` or the cache disagree with the plan (rows, page size, heads, pages).

    """
    num_pages, page_size, kv_heads, head_dim = cache_geometry(kv_cache, kv_layout)
    rows, q_heads = q.shape[0], q.shape[1]
    if rows != plan.num_rows or page_size != plan.page_size or q_heads % kv_heads or q.shape[2] != head_dim:
        msg = (
            f"q {tuple(q.shape)} and cache (page {page_size}, {kv_heads} kv heads, dim {head_dim}) "
            f"do not fit a plan for {plan.num_rows} rows and page {plan.page_size}"
        )
        raise ValueError(msg)
    if plan.max_page >= num_pages:
        msg = f"the plan reads page {plan.max_page}, the cache has {num_pages}"
        raise ValueError(msg)
    group = q_heads // kv_heads
    out = torch.zeros_like(q)
    lse = torch.full((rows, q_heads), -math.inf, dtype=torch.float32, device=q.device)
    for rg in plan.row_groups:
        k, v = gather_kv(kv_cache, kv_layout, rg.pages, rg.offsets)
        qg = q[rg.rows].to(torch.float32).view(-1, kv_heads, group, 1, head_dim)
        o, m = _attend(qg, k, v, rg.mask[:, None, None, None, :], plan)
        out[rg.rows] = o.reshape(-1, q_heads, head_dim).to(q.dtype)
        lse[rg.rows] = m.reshape(-1, q_heads)
    for block in plan.blocks:
        k, v = gather_kv(kv_cache, kv_layout, block.pages, block.offsets)
        qb = q[block.q_start : block.q_end].to(torch.float32)
        qg = qb.view(-1, kv_heads, group, head_dim).permute(1, 2, 0, 3).unsqueeze(0)
        o, m = _attend(qg, k.unsqueeze(0), v.unsqueeze(0), block.mask, plan)
        out[block.q_start : block.q_end] = o[0].permute(2, 0, 1, 3).reshape(-1, q_heads, head_dim).to(q.dtype)
        lse[block.q_start : block.q_end] = m[0].permute(2, 0, 1).reshape(-1, q_heads)
    return out, lse / math.log(2.0)


def paged_attention(  # noqa: PLR0913, PLR0917 -- the reference signature, argument for argument
    q: torch.Tensor,
    kv_cache: PagedKVCache,
    qo_indptr: IndexLike,
    kv_indptr: IndexLike,
    kv_indices: IndexLike,
    kv_last_page_len: IndexLike,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    kv_layout: KVLayout = "NHD",
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched paged attention: plan and run in one call (``ref_paged_attention``'s contract).

    See :func:`plan_paged_attention` for the metadata and :func:`run_paged_attention` for
    shapes. Prefer the two-step form when several layers share one step's metadata.

    Returns:
        ``(out, lse)``: ``out`` ``[T, Hq, D]`` in ``q.dtype``, ``lse`` float32 ``[T, Hq]`` base 2.

    >>> q = torch.randn(3, 4, 8)
    >>> cache = torch.randn(2, 2, 4, 2, 8)            # 2 pages of 4 tokens, 2 kv heads
    >>> out, lse = paged_attention(q, cache, [0, 2, 3], [0, 1, 2], [1, 0], [2, 4])
    >>> out.shape, lse.shape
    (torch.Size([3, 4, 8]), torch.Size([3, 4]))

    """
    page_size = cache_geometry(kv_cache, kv_layout)[1]
    plan = plan_paged_attention(
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        page_size,
        causal=causal,
        sm_scale=sm_scale,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        device=q.device,
    )
    return run_paged_attention(plan, q, kv_cache, kv_layout=kv_layout)
