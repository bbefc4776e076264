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

Capture and replay go through a :class:`GraphRuntime`: :class:`CudaGraphRuntime` on a GPU, or a
stand-in that enforces the same rules on the CPU. Both check, at every replay, that the
buffers a graph was captured on (its static metadata, the decode wrapper's fixed buffers, the
KV caches) are still the same allocations: a graph replays fixed addresses, so a buffer
reallocated after capture would be read stale, silently, on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import attrs
import numpy as np
import torch

from phasesched_flashinfer._attention import BACKEND, KV_LAYOUT, FlashInferAttention, FlashInferBackend
from phasesched_flashinfer._kernels import DecodeWrapper
from phasesched_flashinfer._metadata import MetadataTensors, StepMetadata, pad_decode, pick_bucket
from phasesched_torch import ForwardBatch, LlamaModel

__all__ = [
    "CapturedGraph",
    "CudaGraphRuntime",
    "DecodeGraphs",
    "GraphRuntime",
    "StaleGraphBufferError",
    "buffer_addresses",
    "check_addresses",
]

_WARMUP_RUNS = 2


class StaleGraphBufferError(RuntimeError):
    """A buffer a graph was captured on was reallocated before a replay (the replay would read stale memory)."""


def buffer_addresses(buffers: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each buffer's address and shape: what a captured graph holds on to."""
    return {name: (t.data_ptr(), tuple(t.shape)) for name, t in buffers.items()}


def check_addresses(captured: Mapping[str, tuple[int, tuple[int, ...]]], buffers: Mapping[str, torch.Tensor]) -> None:
    """Raise unless ``buffers`` are the allocations (address and shape) a graph was captured on.

    Raises:
        StaleGraphBufferError: A buffer is missing, new, moved or reshaped since the capture.

    """
    now = buffer_addresses(buffers)
    if now != captured:
        moved = sorted(name for name in captured.keys() | now.keys() if captured.get(name) != now.get(name))
        msg = f"buffers reallocated since the graph was captured (a replay would read stale memory): {moved}"
        raise StaleGraphBufferError(msg)


class CapturedGraph(Protocol):
    """One captured step: replay it, read its output."""

    @property
    def output(self) -> torch.Tensor:
        """The tensor the captured step wrote its result into (rewritten by every replay)."""
        ...

    def replay(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Run the captured step again, on ``buffers`` (which must be the capture's allocations)."""
        ...


class GraphRuntime(Protocol):
    """How decode steps are captured: CUDA graphs on a GPU; tests pass a checking stand-in."""

    def capture(self, step: Callable[[], torch.Tensor], buffers: Mapping[str, torch.Tensor]) -> CapturedGraph:
        """Warm ``step`` up, capture it, and remember ``buffers``' allocations for every replay."""
        ...


@attrs.define(eq=False)
class _CudaGraph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    addresses: dict[str, tuple[int, tuple[int, ...]]]

    def replay(self, buffers: Mapping[str, torch.Tensor]) -> None:
        check_addresses(self.addresses, buffers)
        self.graph.replay()


class CudaGraphRuntime:
    """CUDA graphs sharing one memory pool (capture the largest bucket first; smaller ones reuse it).

    Args:
        device: The GPU.

    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, step: Callable[[], torch.Tensor], buffers: Mapping[str, torch.Tensor]) -> CapturedGraph:
        """Warm ``step`` up on a side stream, then capture it into a graph."""
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ untyped
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_RUNS):  # allocator, cuBLAS handles, lazy modules: never inside capture
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = step()
        return _CudaGraph(graph, output, buffer_addresses(buffers))


def _empty_decode(page_size: int) -> StepMetadata:
    """A step of no slices: padded, it is all scratch rows (what a graph is captured with)."""
    empty = np.zeros(0, dtype=np.int32)
    zero = np.zeros(1, dtype=np.int32)
    return StepMetadata(zero, zero, empty, empty, empty, empty, empty, empty, page_size, 0)


@attrs.define(eq=False)
class _BucketGraph:
    """One captured decode step of ``batch_size`` slices, its static inputs and its wrapper's fixed buffers."""

    batch_size: int
    static: torch.Tensor
    wrapper: DecodeWrapper
    wrapper_buffers: dict[str, torch.Tensor]
    graph: CapturedGraph | None = None

    def buffers(self, kv_cache: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every allocation the captured step reads or writes outside its own pool."""
        caches = {f"kv_cache[{i}]": cache for i, cache in enumerate(kv_cache)}
        return {"static": self.static, **self.wrapper_buffers, **caches}


class DecodeGraphs:
    """Captured decode steps for each of ``batch_sizes``; replays the smallest that fits a step.

    Args:
        backend: The executor's FlashInfer backend (its kernels, workspace and staging).
        model: The model to capture.
        kv_cache: Its per-layer caches (captured by address: never reallocate them).
        batch_sizes: Increasing bucket sizes.
        scratch_page: A cache page the scheduler never uses; padding rows write there.
        max_pages: Page ids a step may reference (padding included) to replay.
        runtime: Captures and replays; ``None``: CUDA graphs on the backend's device.

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
        runtime: GraphRuntime | None = None,
    ) -> None:
        self.backend = backend
        self.model = model
        self.kv_cache = list(kv_cache)
        self.batch_sizes = tuple(batch_sizes)
        self.scratch_page = scratch_page
        self.max_pages = max_pages
        self.replays = 0
        self.runtime = CudaGraphRuntime(backend.workspace.device) if runtime is None else runtime
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
        fixed = {
            "paged_kv_indptr_buffer": torch.zeros(size + 1, dtype=torch.int32, device=device),
            "paged_kv_indices_buffer": torch.zeros(self.max_pages, dtype=torch.int32, device=device),
            "paged_kv_last_page_len_buffer": torch.zeros(size, dtype=torch.int32, device=device),
        }
        wrapper = self.backend.kernels.BatchDecodeWithPagedKVCacheWrapper(
            self.backend.workspace,
            KV_LAYOUT,
            use_cuda_graph=True,
            use_tensor_cores=self.backend.decode_tensor_cores,
            backend=BACKEND,
            **fixed,
        )
        bucket = _BucketGraph(size, static, wrapper, fixed)
        dev = self._prepare(size, static, wrapper, _empty_decode(self.backend.page_size))
        # The append kernel reads page ids through this view: give it the whole capacity.
        start = static.numel() - self.max_pages
        dev = attrs.evolve(dev, kv_indices=static[start:])
        attention = FlashInferAttention(self.backend.kernels, wrapper, self.backend.rope, dev, self.backend.dtype)
        batch = ForwardBatch(input_ids=dev.input_ids, attention=attention, sample_rows=dev.sample_rows)
        bucket.graph = self.runtime.capture(
            lambda: self.model.forward(batch, self.kv_cache), bucket.buffers(self.kv_cache)
        )
        return bucket

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
        assert bucket.graph is not None
        self._prepare(size, bucket.static, bucket.wrapper, meta)
        bucket.graph.replay(bucket.buffers(self.kv_cache))
        self.replays += 1
        rows, logits = meta.sample_rows, bucket.graph.output
        if len(rows) == meta.batch_size:  # every slice samples: the common decode step
            return logits[: meta.batch_size].clone()
        return logits[torch.from_numpy(rows.astype(np.int64)).to(logits.device)]
