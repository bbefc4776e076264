"""StepPlan -> the int32 arrays FlashInfer's ``plan()``, RoPE and KV-append kernels take.

Plain numpy and torch, no FlashInfer: it runs (and is tested) on any machine. A
:class:`~phasesched.StepPlan` already carries FlashInfer's paged layout (``qo_indptr``,
``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, describing the cache *after* this step's
tokens are appended); this module adds what the kernels need beside it (each row's slice and
absolute position for ``append_paged_kv_cache`` and RoPE, token ids, the rows to sample),
pads decode-only steps to a CUDA-graph batch size, and packs everything into one int32 array
so a step costs one host-to-device copy.

Packed layout (one int32 array, segments in this order; kv_indices last, so a fixed-size
buffer keeps every other segment at a fixed offset whatever the page count)::

    qo_indptr [B+1] | kv_indptr [B+1] | kv_last_page_len [B] | batch_indices [T] |
    positions [T] | input_ids [T] | sample_rows [S] | kv_indices [P]
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from phasesched import StepPlan

__all__ = ["MetadataTensors", "StepMetadata", "pack_metadata", "pad_decode", "pick_bucket", "step_metadata"]

Int32Array = NDArray[np.int32]

_SEGMENTS = (
    "qo_indptr",
    "kv_indptr",
    "kv_last_page_len",
    "batch_indices",
    "positions",
    "input_ids",
    "sample_rows",
    "kv_indices",
)


def _int32(values: NDArray[np.integer] | Sequence[int]) -> Int32Array:
    out: Int32Array = np.ascontiguousarray(values, dtype=np.int32)
    return out


@attrs.frozen(eq=False)
class StepMetadata:
    """One step's kernel inputs as int32 host arrays (``B`` slices, ``T`` rows, ``P`` pages).

    Attributes:
        qo_indptr: ``[B + 1]``: query-row offsets of the slices.
        kv_indptr: ``[B + 1]``: page offsets into ``kv_indices``.
        kv_indices: ``[P]``: page ids, slice by slice.
        kv_last_page_len: ``[B]``: tokens in each slice's last page, in ``[1, page_size]``.
        batch_indices: ``[T]``: the slice of each query row.
        positions: ``[T]``: the absolute position of each query row in its sequence.
        input_ids: ``[T]``: the token id of each row.
        sample_rows: ``[S]``: rows whose logits are wanted, in batch order.
        page_size: Tokens per page.
        num_real: Slices that come from the plan; slices beyond are CUDA-graph padding.

    """

    qo_indptr: Int32Array
    kv_indptr: Int32Array
    kv_indices: Int32Array
    kv_last_page_len: Int32Array
    batch_indices: Int32Array
    positions: Int32Array
    input_ids: Int32Array
    sample_rows: Int32Array
    page_size: int
    num_real: int

    @property
    def batch_size(self) -> int:
        """Slices ``B``, padding included."""
        return len(self.kv_last_page_len)

    @property
    def num_tokens(self) -> int:
        """Query rows ``T``."""
        return len(self.positions)

    @property
    def is_decode_only(self) -> bool:
        """Every slice computes one token, so the decode kernel (q_len 1) serves the step.

        This is about attention shape, not phase: the last token of a prompt is a one-row slice too.
        """
        return self.num_tokens == self.batch_size

    @property
    def kv_len(self) -> Int32Array:
        """``[B]``: tokens in each slice's cache after the step (FlashInfer's ``get_seq_lens``)."""
        pages = np.diff(self.kv_indptr)
        out: Int32Array = np.where(pages > 0, (pages - 1) * self.page_size + self.kv_last_page_len, 0).astype(np.int32)
        return out


def step_metadata(plan: StepPlan) -> StepMetadata:
    """Derive the kernels' inputs from a non-empty plan with token ids.

    Raises:
        ValueError: The plan is empty or carries no ``input_ids``.

    """
    if plan.is_empty or plan.input_ids is None:
        raise ValueError("only a non-empty plan with input_ids has kernel metadata")
    batch_indices = np.repeat(np.arange(plan.batch_size, dtype=np.int32), plan.num_new)
    return StepMetadata(
        qo_indptr=_int32(plan.qo_indptr),
        kv_indptr=_int32(plan.kv_indptr),
        kv_indices=_int32(plan.kv_indices),
        kv_last_page_len=_int32(plan.kv_last_page_len),
        batch_indices=batch_indices,
        positions=_int32(plan.positions),
        input_ids=_int32(plan.input_ids),
        sample_rows=_int32((plan.qo_indptr[1:] - 1)[plan.samples]),
        page_size=plan.page_size,
        num_real=plan.batch_size,
    )


def pad_decode(meta: StepMetadata, batch_size: int, scratch_page: int) -> StepMetadata:
    """Pad a decode-only step to ``batch_size`` slices, for a CUDA graph captured at that size.

    Each padding slice is one token at position 0 in its own one-page context, the
    ``scratch_page``, which the scheduler never hands out: its key and value are written there
    and its output is discarded. Every row is sampled (rows ``0 .. batch_size - 1``), so the
    graph's logits have a fixed shape; the caller keeps the rows it wants.

    Raises:
        ValueError: The step is not decode-only, or has more slices than ``batch_size``.

    """
    if not meta.is_decode_only or meta.batch_size > batch_size:
        msg = f"cannot pad a step of {meta.batch_size} slices and {meta.num_tokens} rows to {batch_size} decodes"
        raise ValueError(msg)
    pad = batch_size - meta.batch_size
    last_page = int(meta.kv_indptr[-1])
    return StepMetadata(
        qo_indptr=np.arange(batch_size + 1, dtype=np.int32),
        kv_indptr=np.concatenate([meta.kv_indptr, last_page + np.arange(1, pad + 1)]).astype(np.int32),
        kv_indices=np.concatenate([meta.kv_indices, np.full(pad, scratch_page)]).astype(np.int32),
        kv_last_page_len=np.concatenate([meta.kv_last_page_len, np.ones(pad)]).astype(np.int32),
        batch_indices=np.arange(batch_size, dtype=np.int32),
        positions=np.concatenate([meta.positions, np.zeros(pad)]).astype(np.int32),
        input_ids=np.concatenate([meta.input_ids, np.zeros(pad)]).astype(np.int32),
        sample_rows=np.arange(batch_size, dtype=np.int32),
        page_size=meta.page_size,
        num_real=meta.num_real,
    )


def pick_bucket(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest of ``buckets`` (increasing) that holds ``batch_size`` slices, or ``None``."""
    index = int(np.searchsorted(np.asarray(buckets), batch_size))
    return int(buckets[index]) if index < len(buckets) else None


def pack_metadata(meta: StepMetadata) -> Int32Array:
    """All of ``meta``'s arrays in one int32 array, in the module docstring's segment order."""
    packed: Int32Array = np.concatenate([getattr(meta, name) for name in _SEGMENTS]).astype(np.int32, copy=False)
    return packed


@attrs.frozen(eq=False)
class MetadataTensors:
    """Views of one packed metadata buffer (host or device), one int32 tensor per segment.

    Views of a buffer reused across steps: valid until the next step is packed into it.
    Attribute shapes are those of :class:`StepMetadata`'s.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    batch_indices: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor
    sample_rows: torch.Tensor
    kv_indices: torch.Tensor

    @classmethod
    def view(cls, buffer: torch.Tensor, meta: StepMetadata) -> MetadataTensors:
        """Slice ``buffer`` (int32, 1-D, holding :func:`pack_metadata` of ``meta`` at its start)."""
        b, t, s, p = meta.batch_size, meta.num_tokens, len(meta.sample_rows), len(meta.kv_indices)
        sizes = (b + 1, b + 1, b, t, t, t, s, p)
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        if buffer.dtype != torch.int32 or buffer.dim() != 1 or buffer.numel() < bounds[-1]:
            msg = f"need a 1-D int32 buffer of at least {bounds[-1]} elements, got {buffer.dtype} {tuple(buffer.shape)}"
            raise ValueError(msg)
        views = [buffer[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]
        return cls(*views)
