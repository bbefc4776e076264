"""CUDA graphs of whole decode-only steps, one per padded batch size (optional, off by default).

A decode step of a small model is launch-bound: dozens of kernels per layer, each a few
microseconds. Capturing the step's forward once per batch-size bucket and replaying it removes
the launch cost. FlashInfer's decode wrapper supports this with ``use_cuda_graph=True`` and
fixed buffers: ``plan()`` (not capturable) still runs on the host every step and writes the new
work partition into buffers the captured kernels read.

Per bucket ``Bp`` there is one static int32 buffer holding the packed metadata (see
:mod:`phasesched_flashinfer._metadata`) with room for ``max_pages`` page ids; a step is padded
to ``Bp`` slices (padding writes only the scratch page), copied into that buffer, planned, and
replayed. A step that is not decode-only, is larger than the largest bucket, or references more
pages than a bucket holds runs eagerly instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from phasesched_flashinfer._attention import BACKEND, KV_LAYOUT, FlashInferAttention, FlashInferBackend
from phasesched_flashinfer._kernels import DecodeWrapper
from phasesched_flashinfer._metadata import MetadataTensors, StepMetadata, pad_decode, pick_bucket
from phasesched_torch import ForwardBatch, LlamaModel

__all__ = ["DecodeGraphs"]

_WARMUP_RUNS = 2


def _empty_decode(page_size: int) -> StepMetadata:
    """A step of no slices: padded, it is all scratch rows (what a graph is captured with)."""
    empty = np.zeros(0, dtype=np.int32)
    zero = np.zeros(1, dtype=np.int32)
    return StepMetadata(zero, zero, empty, empty, empty, empty, empty, empty, page_size, 0)


@attrs.define(eq=False)
class _BucketGraph:
    """One captured decode step of ``batch_size`` slices and its static inputs and output."""

    batch_size: int
    static: torch.Tensor
    wrapper: DecodeWrapper
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class DecodeGraphs:
    """Captured decode steps for each of ``batch_sizes``; replays the smallest that fits a step.

    Args:
        backend: The executor's FlashInfer backend (its kernels, workspace and staging).
        model: The model to capture.
        kv_cache: Its per-layer caches (captured by address: never reallocate them).
        batch_sizes: Increasing bucket sizes.
        scratch_page: A cache page the scheduler never uses; padding rows write there.
        max_pages: Page ids a step may reference (padding included) to replay.

    Attributes:
        replays: Steps served by a graph.

    """

    def __init__(  # noqa: PLR0913 -- keyword-only knobs of the graph set
        self,
        backend: FlashInferBackend,
        model: LlamaModel,
        kv_cache: Sequence[torch.Tensor],
        *,
        batch_sizes: Sequence[int],
        scratch_page: int,
        max_pages: int,
    ) -> None:
        self.backend = backend
        self.model = model
        self.kv_cache = list(kv_cache)
        self.batch_sizes = tuple(batch_sizes)
        self.scratch_page = scratch_page
        self.max_pages = max_pages
        self.replays = 0
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, _BucketGraph] = {}
        with torch.inference_mode():
            for size in sorted(self.batch_sizes, reverse=True):  # largest first: smaller ones reuse its pool
                self._graphs[size] = self._capture(size)

    def _static_buffer(self, batch_size: int) -> torch.Tensor:
        # Segments for Bp decodes: 2 indptrs of Bp + 1, five of Bp (last page lengths, batch
        # indices, positions, token ids, sample rows), then max_pages page ids.
        size = 2 * (batch_size + 1) + 5 * batch_size + self.max_pages
        return torch.zeros(size, dtype=torch.int32, device=self.backend.workspace.device)

    def _prepare(self, size: int, static: torch.Tensor, wrapper: DecodeWrapper, meta: StepMetadata) -> MetadataTensors:
        """Pad ``meta`` to ``size``, copy it into ``static`` and plan ``wrapper`` (host work only)."""
        padded = pad_decode(meta, size, self.scratch_page)
        host, dev = self.backend.staging.upload(padded, static)
        self.backend.plan_decode(wrapper, host, dev)
        return dev

    def _capture(self, size: int) -> _BucketGraph:
        device = self.backend.workspace.device
        static = self._static_buffer(size)
        wrapper = self.backend.kernels.BatchDecodeWithPagedKVCacheWrapper(
            self.backend.workspace,
            KV_LAYOUT,
            use_cuda_graph=True,
            use_tensor_cores=self.backend.decode_tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(self.max_pages, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device),
            backend=BACKEND,
        )
        dev = self._prepare(size, static, wrapper, _empty_decode(self.backend.page_size))
        # The append kernel reads page ids through this view: give it the whole capacity.
        start = static.numel() - self.max_pages
        dev = attrs.evolve(dev, kv_indices=static[start:])
        attention = FlashInferAttention(self.backend.kernels, wrapper, self.backend.rope, dev, self.backend.dtype)
        batch = ForwardBatch(input_ids=dev.input_ids, attention=attention, sample_rows=dev.sample_rows)
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ untyped
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_RUNS):  # allocator, cuBLAS handles, lazy modules: never inside capture
                self.model.forward(batch, self.kv_cache)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model.forward(batch, self.kv_cache)
        return _BucketGraph(size, static, wrapper, graph, logits)

    def run(self, meta: StepMetadata) -> torch.Tensor | None:
        """Replay the step ``meta`` if a graph fits it.

        Returns:
            float32 ``[S, vocab_size]``: logits of ``meta.sample_rows`` (a copy, since the
            next replay overwrites the graph's output), or ``None`` when no graph fits.

        """
        if not meta.is_decode_only:
            return None
        size = pick_bucket(meta.batch_size, self.batch_sizes)
        if size is None or len(meta.kv_indices) + (size - meta.batch_size) > self.max_pages:
            return None
        bucket = self._graphs[size]
        self._prepare(size, bucket.static, bucket.wrapper, meta)
        bucket.graph.replay()
        self.replays += 1
        rows = meta.sample_rows
        if len(rows) == meta.batch_size:  # every slice samples: the common decode step
            return bucket.logits[: meta.batch_size].clone()
        return bucket.logits[torch.from_numpy(rows.astype(np.int64)).to(bucket.logits.device)]
