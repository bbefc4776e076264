"""The FlashInfer executor: the torch executor's Llama model with FlashInfer's attention kernels.

Everything but attention is shared with :mod:`phasesched_torch`: weights, projections, norms,
the MLP, the plan checks, sampling, timing. Only the step's attention is swapped, through the
:class:`phasesched_torch.StepAttention` seam: :meth:`FlashInferExecutor.prepare` plans
FlashInfer's wrappers once per step and hands the model a :class:`FlashInferAttention` that
every layer calls. Decode-only steps can also replay CUDA graphs (``use_cuda_graph=True``; off
by default until measured on the target GPU).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Any

import torch

from phasesched import StepPlan
from phasesched.costmodel.batching import DecodeBatching
from phasesched_flashinfer._attention import FlashInferBackend
from phasesched_flashinfer._errors import FlashInferUnavailableError
from phasesched_flashinfer._graphs import DecodeGraphs, GraphRuntime
from phasesched_flashinfer._kernels import FlashInferKernels, load_flashinfer
from phasesched_flashinfer._metadata import StepMetadata, step_metadata
from phasesched_torch import ForwardBatch, LlamaConfig, LlamaModel, TorchExecutor, UnsupportedConfigError, load_model

__all__ = [
    "DEFAULT_GRAPH_BATCH_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "FlashInferExecutor",
    "check_model",
    "create_executor",
    "jit_disabled",
]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes of FlashInfer's paged kernels for this executor (weights, activations and cache)."""
SUPPORTED_HEAD_DIMS = (64, 128, 256)
"""Head dims FlashInfer's fa2 kernels are instantiated for (the offline bundle ships 128 only)."""
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Decode batch sizes captured when CUDA graphs are on; a step pads up to the next one."""
_GQA_TENSOR_CORE_GROUP = 4


def jit_disabled() -> bool:
    """Whether ``FLASHINFER_DISABLE_JIT`` forbids FlashInfer to compile kernels (only prebuilt ones load).

    Exactly FlashInfer's own test (0.7.2, ``flashinfer/jit/core.py``, ``JitSpec.build``:
    ``if os.environ.get("FLASHINFER_DISABLE_JIT"): raise MissingJITCacheError``): any non-empty
    value disables it, ``0`` and ``false`` included; unset or empty leaves it on. The offline
    GPU check sets ``1``.
    """
    return bool(os.environ.get("FLASHINFER_DISABLE_JIT"))


def check_model(model: LlamaModel, *, needs_cuda: bool) -> None:
    """Raise unless FlashInfer's kernels can run ``model`` (before importing FlashInfer).

    Raises:
        UnsupportedConfigError: The dtype or head dim has no FlashInfer kernel here, or the
            model has a sliding window (the kernels would attend past it: not planned yet).
        FlashInferUnavailableError: ``needs_cuda`` and the model is not on a CUDA device, or
            this torch has no CUDA.

    """
    if model.dtype not in SUPPORTED_DTYPES:
        msg = f"FlashInfer's paged kernels run bfloat16 or float16, not {model.dtype}; build the model in one of those"
        raise UnsupportedConfigError(msg)
    head_dim = model.config.head_dim
    if head_dim not in SUPPORTED_HEAD_DIMS:
        msg = f"head_dim {head_dim} has no FlashInfer kernel; supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        raise UnsupportedConfigError(msg)
    if model.config.sliding_window is not None:
        # FlashInfer takes window_left, but this executor does not plan with it yet (nor does the
        # offline bundle carry windowed kernels): refuse here, not at the first step.
        msg = (
            f"{model.config.model_type} with sliding_window={model.config.sliding_window}: the FlashInfer "
            "executor does not run sliding-window attention; use the torch executor"
        )
        raise UnsupportedConfigError(msg)
    if needs_cuda and model.device.type != "cuda":
        msg = f"the FlashInfer executor runs on a CUDA device; the model is on {model.device}"
        raise FlashInferUnavailableError(msg)
    if needs_cuda and not torch.cuda.is_available():
        msg = f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})"
        raise FlashInferUnavailableError(msg)


class FlashInferExecutor(TorchExecutor):
    """Runs step plans on a :class:`phasesched_torch.LlamaModel` with FlashInfer's kernels.

    Mixed prefill + decode steps run one causal ``BatchPrefillWithPagedKVCacheWrapper``;
    decode-only steps run ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores for four or
    more query heads per kv head), or replay a CUDA graph when ``use_cuda_graph`` is set.

    Args:
        model: The model, on a CUDA device in bfloat16 or float16.
        num_pages: Pages the scheduler may use (one more is allocated: the scratch page that
            CUDA-graph padding writes).
        page_size: Tokens per page.
        seed: Seeds unseeded sampling.
        kernels: The ``flashinfer`` module; ``None`` imports it. Tests pass a stand-in, which
            also lifts the CUDA requirement.
        workspace_bytes: FlashInfer's float workspace, shared by every wrapper.
        use_cuda_graph: Capture decode-only steps at ``graph_batch_sizes`` (at construction).
        graph_batch_sizes: Increasing bucket sizes for the graphs.
        decode_tensor_cores: Decode on the tensor-core kernel; ``None``: from 4 query heads per
            kv head, as FlashInfer recommends, and always when FlashInfer's JIT is disabled
            (see ``jit_disabled()``; the offline bundle has no CUDA-core decode module).
            ``False`` with JIT disabled needs that module prebuilt.
        graph_runtime: Captures and replays the decode graphs; ``None``: CUDA graphs. Tests
            pass a stand-in that enforces the graph rules on the CPU.

    Attributes:
        backend: Plans each step's attention; ``backend.path_counts`` counts eager steps by path.
        graphs: The captured decode graphs, or ``None``.
        scratch_page: The page padding rows write (``num_pages``; never planned by a scheduler).

    """

    def __init__(  # noqa: PLR0913 -- keyword-only knobs, each with a default
        self,
        model: LlamaModel,
        *,
        num_pages: int,
        page_size: int = 16,
        seed: int = 0,
        kernels: FlashInferKernels | None = None,
        workspace_bytes: int = 128 << 20,
        use_cuda_graph: bool = False,
        graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES,
        decode_tensor_cores: bool | None = None,
        graph_runtime: GraphRuntime | None = None,
    ) -> None:
        check_model(model, needs_cuda=kernels is None)
        if use_cuda_graph and (not graph_batch_sizes or list(graph_batch_sizes) != sorted(set(graph_batch_sizes))):
            msg = f"graph_batch_sizes must be strictly increasing, got {tuple(graph_batch_sizes)}"
            raise ValueError(msg)
        if use_cuda_graph and graph_batch_sizes[0] < 1:
            raise ValueError("graph batch sizes must be positive")
        kernels = load_flashinfer() if kernels is None else kernels
        # NOTE: one page more than the scheduler's: the scratch page CUDA-graph padding writes.
        # Plans are checked against num_pages, so no plan can reference it.
        super().__init__(model, num_pages=num_pages + 1, page_size=page_size, seed=seed)
        self.num_pages = num_pages
        self.scratch_page = num_pages
        if decode_tensor_cores is None:
            # NOTE: with JIT disabled only prebuilt modules load. The offline bundle prebuilds the
            # fa2 prefill module, which tensor-core decode also runs, but not the CUDA-core decode
            # module, so small GQA groups would otherwise fail at their first decode step.
            decode_tensor_cores = jit_disabled() or model.config.group_size >= _GQA_TENSOR_CORE_GROUP
        self.backend = FlashInferBackend(
            kernels,
            model.config,
            page_size=page_size,
            device=model.device,
            dtype=model.dtype,
            workspace_bytes=workspace_bytes,
            decode_tensor_cores=decode_tensor_cores,
        )
        self.graphs: DecodeGraphs | None = None
        if use_cuda_graph:
            self.graphs = DecodeGraphs(
                self.backend,
                model,
                self.kv_cache,
                batch_sizes=graph_batch_sizes,
                scratch_page=self.scratch_page,
                max_pages=num_pages + graph_batch_sizes[-1],
                runtime=graph_runtime,
            )

    @property
    def decode_batching(self) -> DecodeBatching:
        """How this executor batches decodes, for the profiled cost model (``DeclaresDecodeBatching``).

        FlashInfer's kernels are ragged (each slice reads its own pages): no context padding.
        With CUDA graphs a decode-only step runs padded to the smallest captured batch size
        that holds it, each padding slice one token of context on the scratch page (a step
        whose pages exceed the graph's buffer runs eagerly; the declaration does not model that).
        The profile's ``decode_seqs`` should then be captured sizes, as the GPU grid's are.
        """
        return DecodeBatching(batch_sizes=self.graphs.batch_sizes if self.graphs is not None else ())

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """Plan FlashInfer's attention for a checked, non-empty plan and stage its inputs.

        Returns:
            Token ids and sample rows (int32, on the device) and the step's
            :class:`FlashInferAttention`.

        """
        return self._forward_batch(step_metadata(plan))

    def _forward_batch(self, meta: StepMetadata) -> ForwardBatch:
        attention, dev = self.backend.plan(meta)
        return ForwardBatch(input_ids=dev.input_ids, attention=attention, sample_rows=dev.sample_rows)

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """Run the step, replaying a CUDA graph when one fits; float32 ``[S, vocab_size]``."""
        meta = step_metadata(plan)
        if self.graphs is not None:
            logits = self.graphs.run(meta)
            if logits is not None:
                return logits
        return self.model.forward(self._forward_batch(meta), self.kv_cache)


def create_executor(  # noqa: PLR0913 -- the entry point's keyword-only knobs, each with a default
    *,
    model: str | LlamaConfig | Mapping[str, Any] = "llama-3-8b",
    num_pages: int = 1024,
    page_size: int = 16,
    device: str | torch.device = "cuda",
    dtype: str | torch.dtype = "bfloat16",
    seed: int = 0,
    state_dict: Mapping[str, torch.Tensor] | str | PathLike[str] | None = None,
    num_layers: int | None = None,
    use_cuda_graph: bool = False,
    graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES,
    workspace_bytes: int = 128 << 20,
) -> FlashInferExecutor:
    """Build a :class:`FlashInferExecutor` (the ``flashinfer`` entry point of ``phasesched.executors``).

    The model knobs are :func:`phasesched_torch.create_executor`'s (presets, Hugging Face config
    dicts, checkpoints, ``num_layers``); this one defaults to Llama-3-8B shapes in bfloat16 on
    CUDA, so ``profile_executor(create_executor(...), ...)`` profiles a real-sized model.

    Raises:
        FlashInferUnavailableError: No CUDA, or flashinfer is not importable (checked before
            the weights are built).
        UnsupportedConfigError: The dtype or head dim has no FlashInfer kernel.
        UnknownNameError: An unknown preset or dtype name.

    """
    torch_device = torch.device(device)
    if torch_device.type != "cuda" or not torch.cuda.is_available():
        msg = (
            f"the FlashInfer executor needs a CUDA device; asked for {torch_device}, "
            f"and torch {torch.__version__} has torch.cuda.is_available()={torch.cuda.is_available()}"
        )
        raise FlashInferUnavailableError(msg)
    kernels = load_flashinfer()
    llama = load_model(
        model=model, device=torch_device, dtype=dtype, seed=seed, state_dict=state_dict, num_layers=num_layers
    )
    return FlashInferExecutor(
        llama,
        num_pages=num_pages,
        page_size=page_size,
        seed=seed,
        kernels=kernels,
        workspace_bytes=workspace_bytes,
        use_cuda_graph=use_cuda_graph,
        graph_batch_sizes=graph_batch_sizes,
    )
