"""A CPU stand-in for the slice of ``flashinfer`` the executor calls, with FlashInfer's semantics.

It lets the CPU suite run the executor's plumbing end to end: argument order, dtypes and
devices of every metadata tensor, one plan per step, one run per layer, which wrapper serves
which step. Each call checks its inputs the way flashinfer-python 0.7.2 does (or stricter:
host metadata for ``plan()`` must be CPU int32, as the executor promises, to avoid device
syncs) and records what it saw. The math follows the FlashInfer notes' reference, written
here from the notes rather than taken from ``phasesched_torch`` (RoPE frequencies, the KV slot
formula); attention itself is the reference ``paged_attention``, whose contract is FlashInfer's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import pytest

pytest.importorskip("torch")
import torch

from phasesched_flashinfer._graphs import buffer_addresses, check_addresses
from phasesched_torch import paged_attention

CALLS: Counter[str] = Counter()
"""Calls by name, across every fake wrapper (reset it in a test before counting)."""
_CAPTURING = [False]
"""Whether a :class:`CpuGraphRuntime` is capturing (``plan()`` is not capturable, as in FlashInfer)."""


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _host_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _expect(
            t.device.type == "cpu" and t.dtype == torch.int32,
            f"{name} must be a CPU int32 tensor, got {t.dtype} on {t.device}",
        )


def _device_int32(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _expect(
            t.device == device and t.dtype == torch.int32,
            f"{name} must be int32 on {device}, got {t.dtype} on {t.device}",
        )
        _expect(t.is_contiguous(), f"{name} must be contiguous")


class _Planned:
    """What a plan() saw, copied (the executor reuses its staging buffers every step)."""

    def __init__(
        self,
        qo: torch.Tensor,
        kvp: torch.Tensor,
        idx: torch.Tensor,
        last: torch.Tensor,
        heads: tuple[int, int, int, int],
        dtype: torch.dtype,
        causal: bool,
    ) -> None:
        self.qo, self.kvp, self.idx, self.last = qo.clone(), kvp.clone(), idx.cpu().clone(), last.clone()
        self.heads, self.dtype, self.causal = heads, dtype, causal

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        hq, hkv, d, page = self.heads
        _expect(q.dtype == self.dtype, f"q is {q.dtype}, the plan is for {self.dtype}")
        _expect(q.shape == (int(self.qo[-1]), hq, d), f"q {tuple(q.shape)} does not fit the plan")
        _expect(
            cache.shape[1:] == (2, page, hkv, d) and cache.dtype == self.dtype,
            f"cache {tuple(cache.shape)} {cache.dtype}",
        )
        out, _ = paged_attention(q, cache, self.qo, self.kvp, self.idx, self.last, causal=self.causal)
        return out


def flashinfer_rounding(planned: _Planned, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Attention with FlashInfer's fa2 rounding, for measuring what it costs against the tolerance.

    As the FlashInfer notes describe the kernels: scores in float32, ``exp2`` of the
    max-subtracted scores, the probabilities rounded to ``q``'s dtype before the PV product
    (accumulated in float32), and the row sum (from the unrounded probabilities) divided out at
    the end. The plain stand-in computes in float32 throughout.
    """
    hq, hkv, d, page = planned.heads
    group = hq // hkv
    qo, kvp, idx, last = (t.long() for t in (planned.qo, planned.kvp, planned.idx, planned.last))
    out = torch.empty_like(q)
    for b in range(len(last)):
        q0, q1 = int(qo[b]), int(qo[b + 1])
        pages = idx[kvp[b] : kvp[b + 1]]
        n = (len(pages) - 1) * page + int(last[b])
        k = cache[pages, 0].reshape(-1, hkv, d)[:n].float().repeat_interleave(group, 1)
        v = cache[pages, 1].reshape(-1, hkv, d)[:n].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) / math.sqrt(d)
        query_pos = torch.arange(q1 - q0) + (n - (q1 - q0))
        scores = scores.masked_fill(torch.arange(n)[None, :] > query_pos[:, None], -math.inf)
        probs = torch.exp2((scores - scores.amax(-1, keepdim=True)) * math.log2(math.e))
        pv = torch.einsum("hqk,khd->qhd", probs.to(q.dtype).float(), v)
        out[q0:q1] = (pv / probs.sum(-1).transpose(0, 1)[..., None]).to(q.dtype)
    return out


class BatchPrefillWithPagedKVCacheWrapper:
    """Fake of ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` (eager mode only)."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", *, backend: str = "auto") -> None:
        _expect(float_workspace_buffer.dtype == torch.uint8, "the workspace is a uint8 buffer")
        _expect(kv_layout == "NHD" and backend == "fa2", f"the executor pins NHD and fa2, got {kv_layout}, {backend}")
        self.workspace = float_workspace_buffer
        self._planned: _Planned | None = None

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        *,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
    ) -> None:
        _expect(not _CAPTURING[0], "plan() cannot run inside a CUDA graph capture")
        _host_int32(qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr, paged_kv_last_page_len=paged_kv_last_page_len)
        _expect(paged_kv_indices.dtype == torch.int32, "paged_kv_indices must be int32")
        _expect(
            pos_encoding_mode == "NONE" and kv_data_type == q_data_type,
            "RoPE is applied outside; q and kv share a dtype",
        )
        CALLS["prefill.plan"] += 1
        heads = (num_qo_heads, num_kv_heads, head_dim_qk, page_size)
        self._planned = _Planned(
            qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, heads, q_data_type, causal
        )

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        _expect(self._planned is not None, "run() before plan()")
        assert self._planned is not None
        CALLS["prefill.run"] += 1
        return self._planned.run(q, paged_kv_cache)


class BatchDecodeWithPagedKVCacheWrapper:
    """Fake of ``flashinfer.BatchDecodeWithPagedKVCacheWrapper``, eager or in CUDA-graph mode.

    In graph mode, as in FlashInfer, the batch size is fixed by the buffers given at
    construction, ``plan()`` copies the step's layout into them, and ``run()`` reads them when
    it runs (a replayed graph's kernel reads the buffers then), never the tensors ``plan()`` saw.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        *,
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        _expect(float_workspace_buffer.dtype == torch.uint8, "the workspace is a uint8 buffer")
        _expect(kv_layout == "NHD" and backend == "fa2", f"the executor pins NHD and fa2, got {kv_layout}, {backend}")
        self.use_tensor_cores = use_tensor_cores
        self.use_cuda_graph = use_cuda_graph
        self._fixed: dict[str, torch.Tensor] = {}
        if use_cuda_graph:
            fixed = {
                "indptr": paged_kv_indptr_buffer,
                "indices": paged_kv_indices_buffer,
                "last_page_len": paged_kv_last_page_len_buffer,
            }
            for name, buffer in fixed.items():
                _expect(buffer is not None, f"graph mode needs a fixed {name} buffer")
                assert buffer is not None
                _device_int32(float_workspace_buffer.device, **{name: buffer})
                self._fixed[name] = buffer
            _expect(len(self._fixed["indptr"]) == len(self._fixed["last_page_len"]) + 1, "indptr holds B + 1 entries")
        self._addresses = buffer_addresses(self._fixed)
        self._planned: _Planned | None = None

    @property
    def fixed_batch_size(self) -> int:
        """The batch size a graph-mode wrapper serves (its buffers fix it)."""
        return len(self._fixed["last_page_len"])

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
    ) -> None:
        _expect(not _CAPTURING[0], "plan() cannot run inside a CUDA graph capture")
        _host_int32(indptr=indptr, last_page_len=last_page_len)
        _expect(indices.dtype == torch.int32, "indices must be int32")
        _expect(
            pos_encoding_mode == "NONE" and kv_data_type == q_data_type,
            "RoPE is applied outside; q and kv share a dtype",
        )
        CALLS["decode.plan"] += 1
        heads = (num_qo_heads, num_kv_heads, head_dim, page_size)
        batch = len(last_page_len)
        if self.use_cuda_graph:
            check_addresses(self._addresses, self._fixed)
            _expect(batch == self.fixed_batch_size, f"a {batch}-slice step on a graph of {self.fixed_batch_size}")
            _expect(len(indices) <= len(self._fixed["indices"]), "more page ids than the fixed buffer holds")
            self._fixed["indptr"].copy_(indptr)
            self._fixed["last_page_len"].copy_(last_page_len)
            self._fixed["indices"][: len(indices)].copy_(indices)
            self._heads, self._dtype = heads, q_data_type
            return
        qo = torch.arange(batch + 1, dtype=torch.int32)
        self._planned = _Planned(qo, indptr, indices, last_page_len, heads, q_data_type, True)

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        CALLS["decode.run"] += 1
        if self.use_cuda_graph:
            check_addresses(self._addresses, self._fixed)
            batch = self.fixed_batch_size
            _expect(q.shape[0] == batch, f"q has {q.shape[0]} rows; the graph's batch is {batch}")
            indptr = self._fixed["indptr"].cpu()
            indices = self._fixed["indices"][: int(indptr[-1])]
            qo = torch.arange(batch + 1, dtype=torch.int32)
            planned = _Planned(qo, indptr, indices, self._fixed["last_page_len"].cpu(), self._heads, self._dtype, True)
            return planned.run(q, paged_kv_cache)
        _expect(self._planned is not None, "run() before plan()")
        assert self._planned is not None
        return self._planned.run(q, paged_kv_cache)


class _CpuGraph:
    """One "captured" step: a replay checks the buffers' allocations and reruns the captured closure."""

    def __init__(
        self, step: Callable[[], torch.Tensor], output: torch.Tensor, buffers: Mapping[str, torch.Tensor]
    ) -> None:
        self._step = step
        self.output = output
        self._addresses = buffer_addresses(buffers)
        self.replays = 0

    def replay(self, buffers: Mapping[str, torch.Tensor]) -> None:
        check_addresses(self._addresses, buffers)
        # The closure reads what it captured (token ids, metadata views, the wrapper): like a
        # graph's kernels, it sees new inputs only if they were written into those buffers.
        _CAPTURING[0] = True
        try:
            result = self._step()
        finally:
            _CAPTURING[0] = False
        _expect(result.shape == self.output.shape, "a replay's output changed shape")
        self.output.copy_(result)
        self.replays += 1


class CpuGraphRuntime:
    """Stand-in for CUDA graphs on the CPU, enforcing their rules.

    A capture runs the step (twice to warm up, once captured) with ``plan()`` forbidden; a
    replay refuses buffers reallocated since the capture
    (:class:`~phasesched_flashinfer.StaleGraphBufferError`), reruns the captured closure, and
    writes its result into the captured output tensor.
    """

    def __init__(self) -> None:
        self.graphs: list[_CpuGraph] = []

    def capture(self, step: Callable[[], torch.Tensor], buffers: Mapping[str, torch.Tensor]) -> _CpuGraph:
        _CAPTURING[0] = True
        try:
            for _ in range(2):
                step()
            output = step()
        finally:
            _CAPTURING[0] = False
        graph = _CpuGraph(step, output, buffers)
        self.graphs.append(graph)
        return graph


def _rotate_inplace(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """rotate_half RoPE (not interleaved) over the full head dim, in fp32, cast back in place."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    half = x.shape[-1] // 2
    xf = x.to(torch.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))


def _check_rope_inputs(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor) -> None:
    _expect(
        q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == pos_ids.shape[0],
        "q [T,Hq,D], k [T,Hkv,D], pos [T]",
    )
    _expect(q.stride(-1) == 1 and k.stride(-1) == 1, "the last dim must be contiguous")
    _expect(pos_ids.device == q.device and pos_ids.dtype in {torch.int32, torch.int64}, "pos_ids: int on q's device")


def apply_rope_pos_ids_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> None:
    """Angle = (pos / rope_scale) * rope_theta^(-2i / rotary_dim) (the FlashInfer notes, section 3)."""
    _check_rope_inputs(q, k, pos_ids)
    _expect(rotary_dim is None and not interleave, "the executor rotates the full head, rotate-half form")
    CALLS["rope"] += 1
    d = q.shape[-1]
    inv_freq = rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d) / rope_scale
    _rotate_inplace(q, pos_ids, inv_freq)
    _rotate_inplace(k, pos_ids, inv_freq)


def apply_llama31_rope_pos_ids_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
) -> None:
    """s = clamp((L f / 2pi - low) / (high - low), 0, 1); f' = (1 - s) f / rope_scale + s f."""
    _check_rope_inputs(q, k, pos_ids)
    _expect(rotary_dim is None and not interleave, "the executor rotates the full head, rotate-half form")
    CALLS["rope_llama31"] += 1
    d = q.shape[-1]
    freq = rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    smooth = ((old_context_len * freq / (2 * math.pi) - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(
        0, 1
    )
    inv_freq = (1 - smooth) * freq / rope_scale + smooth * freq
    _rotate_inplace(q, pos_ids, inv_freq)
    _rotate_inplace(k, pos_ids, inv_freq)


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    """Token ``positions[i]`` of slice ``b``: page ``kv_indices[kv_indptr[b] + pos // page]``, row ``pos % page``."""
    device = append_key.device
    _device_int32(
        device,
        batch_indices=batch_indices,
        positions=positions,
        kv_indices=kv_indices,
        kv_indptr=kv_indptr,
        kv_last_page_len=kv_last_page_len,
    )
    _expect(kv_layout == "NHD" and paged_kv_cache.dim() == 5, "a 5-D NHD cache")
    _expect(append_key.stride(-1) == 1 and append_value.stride(-1) == 1, "the last dim must be contiguous")
    CALLS["append"] += 1
    page = paged_kv_cache.shape[2]
    b, pos = batch_indices.long(), positions.long()
    kv_len = (kv_indptr[1:] - kv_indptr[:-1] - 1).long() * page + kv_last_page_len.long()
    _expect(bool(torch.all(pos < kv_len[b])), "the metadata must already count the appended tokens")
    pages = kv_indices.long()[kv_indptr.long()[b] + pos // page]
    paged_kv_cache[pages, 0, pos % page] = append_key.to(paged_kv_cache.dtype)
    paged_kv_cache[pages, 1, pos % page] = append_value.to(paged_kv_cache.dtype)
