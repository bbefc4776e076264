"""phasesched-flashinfer: FlashInfer's paged-attention kernels behind phasesched's executor seam.

The same :class:`phasesched.StepPlan` the policies produce drives FlashInfer on an NVIDIA GPU:
the torch executor's Llama model (:mod:`phasesched_torch`) with its attention swapped for
FlashInfer's (plan once per step, run once per layer; RoPE and KV append by FlashInfer too)::

    from phasesched_flashinfer import create_executor
    executor = create_executor(model="llama-3-8b", num_pages=4096, page_size=16)
    result = executor.execute(plan)

It is registered as the ``flashinfer`` plugin of ``phasesched.executors``. Importing this
package never imports ``flashinfer``: that happens when an executor is built, so the metadata
conversion (:func:`step_metadata`) and the CPU tests run anywhere.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from phasesched_flashinfer._attention import FlashInferAttention as FlashInferAttention
from phasesched_flashinfer._attention import FlashInferBackend as FlashInferBackend
from phasesched_flashinfer._attention import MetadataStaging as MetadataStaging
from phasesched_flashinfer._attention import RopeParams as RopeParams
from phasesched_flashinfer._errors import FlashInferUnavailableError as FlashInferUnavailableError
from phasesched_flashinfer._executor import DEFAULT_GRAPH_BATCH_SIZES as DEFAULT_GRAPH_BATCH_SIZES
from phasesched_flashinfer._executor import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from phasesched_flashinfer._executor import SUPPORTED_HEAD_DIMS as SUPPORTED_HEAD_DIMS
from phasesched_flashinfer._executor import FlashInferExecutor as FlashInferExecutor
from phasesched_flashinfer._executor import check_model as check_model
from phasesched_flashinfer._executor import create_executor as create_executor
from phasesched_flashinfer._graphs import CapturedGraph as CapturedGraph
from phasesched_flashinfer._graphs import CudaGraphRuntime as CudaGraphRuntime
from phasesched_flashinfer._graphs import DecodeGraphs as DecodeGraphs
from phasesched_flashinfer._graphs import GraphRuntime as GraphRuntime
from phasesched_flashinfer._graphs import StaleGraphBufferError as StaleGraphBufferError
from phasesched_flashinfer._kernels import DecodeWrapper as DecodeWrapper
from phasesched_flashinfer._kernels import FlashInferKernels as FlashInferKernels
from phasesched_flashinfer._kernels import PrefillWrapper as PrefillWrapper
from phasesched_flashinfer._kernels import load_flashinfer as load_flashinfer
from phasesched_flashinfer._metadata import MetadataTensors as MetadataTensors
from phasesched_flashinfer._metadata import StepMetadata as StepMetadata
from phasesched_flashinfer._metadata import pack_metadata as pack_metadata
from phasesched_flashinfer._metadata import pad_decode as pad_decode
from phasesched_flashinfer._metadata import pick_bucket as pick_bucket
from phasesched_flashinfer._metadata import step_metadata as step_metadata

try:
    __version__ = version("phasesched-flashinfer")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_GRAPH_BATCH_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "CapturedGraph",
    "CudaGraphRuntime",
    "DecodeGraphs",
    "DecodeWrapper",
    "FlashInferAttention",
    "FlashInferBackend",
    "FlashInferExecutor",
    "FlashInferKernels",
    "FlashInferUnavailableError",
    "GraphRuntime",
    "MetadataStaging",
    "MetadataTensors",
    "PrefillWrapper",
    "RopeParams",
    "StaleGraphBufferError",
    "StepMetadata",
    "__version__",
    "check_model",
    "create_executor",
    "load_flashinfer",
    "pack_metadata",
    "pad_decode",
    "pick_bucket",
    "step_metadata",
]
