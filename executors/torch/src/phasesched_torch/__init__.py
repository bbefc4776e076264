"""phasesched-torch: the reference PyTorch executor for phasesched.

A Llama-style decoder (Llama, Mistral, Qwen2: :data:`ARCHITECTURES`) whose forward pass is
driven only by a :class:`phasesched.StepPlan`: one forward per step over a mixed ragged batch of
prefill chunks and decodes, a paged KV cache in FlashInfer's NHD layout, and greedy or seeded
temperature / top-k / top-p sampling::

    from phasesched_torch import create_executor
    executor = create_executor(model="tiny", num_pages=256, page_size=16)
    result = executor.execute(plan)

It is registered as the ``torch`` plugin of ``phasesched.executors``, and its
:func:`paged_attention` is the reference a FlashInfer executor is compared against.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from phasesched_torch._attention import PagedAttentionPlan as PagedAttentionPlan
from phasesched_torch._attention import paged_attention as paged_attention
from phasesched_torch._attention import plan_paged_attention as plan_paged_attention
from phasesched_torch._attention import run_paged_attention as run_paged_attention
from phasesched_torch._config import ARCHITECTURES as ARCHITECTURES
from phasesched_torch._config import PRESETS as PRESETS
from phasesched_torch._config import Llama3RopeScaling as Llama3RopeScaling
from phasesched_torch._config import LlamaConfig as LlamaConfig
from phasesched_torch._errors import CheckpointError as CheckpointError
from phasesched_torch._errors import DeviceUnavailableError as DeviceUnavailableError
from phasesched_torch._errors import MissingTensorError as MissingTensorError
from phasesched_torch._errors import PlanNotExecutableError as PlanNotExecutableError
from phasesched_torch._errors import StateDictError as StateDictError
from phasesched_torch._errors import TensorShapeError as TensorShapeError
from phasesched_torch._errors import UnexpectedTensorError as UnexpectedTensorError
from phasesched_torch._errors import UnsupportedArchitectureError as UnsupportedArchitectureError
from phasesched_torch._errors import UnsupportedConfigError as UnsupportedConfigError
from phasesched_torch._executor import StepLogits as StepLogits
from phasesched_torch._executor import TorchExecutor as TorchExecutor
from phasesched_torch._executor import create_executor as create_executor
from phasesched_torch._executor import load_model as load_model
from phasesched_torch._kv_cache import KVLayout as KVLayout
from phasesched_torch._kv_cache import PagedKVCache as PagedKVCache
from phasesched_torch._kv_cache import append_paged_kv_cache as append_paged_kv_cache
from phasesched_torch._kv_cache import cache_geometry as cache_geometry
from phasesched_torch._kv_cache import gather_kv as gather_kv
from phasesched_torch._kv_cache import kv_write_slots as kv_write_slots
from phasesched_torch._kv_cache import write_paged_kv as write_paged_kv
from phasesched_torch._model import ForwardBatch as ForwardBatch
from phasesched_torch._model import LlamaModel as LlamaModel
from phasesched_torch._model import SlidingWindowAttention as SlidingWindowAttention
from phasesched_torch._model import StepAttention as StepAttention
from phasesched_torch._model import TorchAttention as TorchAttention
from phasesched_torch._rope import apply_rope as apply_rope
from phasesched_torch._rope import rope_angles as rope_angles
from phasesched_torch._rope import rope_inv_freq as rope_inv_freq
from phasesched_torch._sampling import RequestSampler as RequestSampler
from phasesched_torch._sampling import sample_tokens as sample_tokens
from phasesched_torch._sampling import uniform_for as uniform_for
from phasesched_torch._weights import LayerWeights as LayerWeights
from phasesched_torch._weights import LlamaWeights as LlamaWeights
from phasesched_torch._weights import check_state_dict as check_state_dict
from phasesched_torch._weights import expected_shapes as expected_shapes
from phasesched_torch._weights import load_safetensors as load_safetensors

try:
    __version__ = version("phasesched-torch")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ARCHITECTURES",
    "PRESETS",
    "CheckpointError",
    "DeviceUnavailableError",
    "ForwardBatch",
    "KVLayout",
    "LayerWeights",
    "Llama3RopeScaling",
    "LlamaConfig",
    "LlamaModel",
    "LlamaWeights",
    "MissingTensorError",
    "PagedAttentionPlan",
    "PagedKVCache",
    "PlanNotExecutableError",
    "RequestSampler",
    "SlidingWindowAttention",
    "StateDictError",
    "StepAttention",
    "StepLogits",
    "TensorShapeError",
    "TorchAttention",
    "TorchExecutor",
    "UnexpectedTensorError",
    "UnsupportedArchitectureError",
    "UnsupportedConfigError",
    "__version__",
    "append_paged_kv_cache",
    "apply_rope",
    "cache_geometry",
    "check_state_dict",
    "create_executor",
    "expected_shapes",
    "gather_kv",
    "kv_write_slots",
    "load_model",
    "load_safetensors",
    "paged_attention",
    "plan_paged_attention",
    "rope_angles",
    "rope_inv_freq",
    "run_paged_attention",
    "sample_tokens",
    "uniform_for",
]
