"""What a simulated worker is: GPUs, model, KV geometry, and how step time is predicted."""

from __future__ import annotations

import attrs

from phasesched.costmodel.hardware import hardware_by_name
from phasesched.costmodel.memory import MemoryBudget, memory_budget
from phasesched.costmodel.models import model_by_name
from phasesched.costmodel.protocol import CostModel
from phasesched.costmodel.roofline import RooflineCostModel
from phasesched.errors import InvalidArgumentError
from phasesched.scheduler import SchedulerConfig
from phasesched.validators import typed

__all__ = ["Deployment", "Disaggregation"]

_positive = attrs.validators.gt(0)


@attrs.frozen
class Deployment:
    """One worker: ``tensor_parallel`` GPUs of one kind serving one model.

    Attributes:
        hardware: A hardware preset (``H200``, ``H100-SXM``, ``A100-80GB``).
        model: A model preset (``llama-3-8b``, ``llama-3-70b``).
        tensor_parallel: GPUs per worker.
        page_size: Tokens per KV page.
        gpu_memory_utilization: Fraction of GPU memory vLLM may use for weights, activations and KV.
        max_model_len: Longest sequence served.
        cost_model: Overrides the roofline built from ``hardware`` and ``model`` (a profiled table, say).
        num_pages: Overrides the KV capacity derived from memory.
        max_num_batched_tokens: The token budget vLLM profiles its activation reserve with
            (``None``: vLLM's default for the hardware, see
            :func:`~phasesched.costmodel.memory.serving_defaults`).
        max_num_seqs: The sequence cap vLLM profiles its sampler's reserve with (likewise).
        cost_model_source: Where ``cost_model`` comes from, in words (reports name it).
        watermark: Fraction of KV pages admissions leave free for running requests (vLLM's watermark).

    >>> deployment = Deployment()
    >>> deployment.kv_tokens()       # H200 + Llama-3-8B at 0.9: vLLM's "GPU KV cache size"
    868416
    """

    hardware: str = "H200"
    model: str = "llama-3-8b"
    tensor_parallel: int = attrs.field(default=1, validator=typed(attrs.validators.gt(0)))
    page_size: int = attrs.field(default=16, validator=typed(attrs.validators.gt(0)))
    gpu_memory_utilization: float = attrs.field(
        default=0.9, validator=typed(attrs.validators.gt(0.0), attrs.validators.le(1.0))
    )
    max_model_len: int = attrs.field(default=32768, validator=typed(attrs.validators.gt(0)))
    cost_model: CostModel | None = None
    num_pages: int | None = None
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    max_num_seqs: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    cost_model_source: str = ""
    watermark: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])

    def roofline(self) -> RooflineCostModel:
        """The roofline model for this hardware, model and parallelism."""
        return RooflineCostModel.from_names(self.hardware, self.model, self.tensor_parallel)

    def step_cost(self) -> CostModel:
        """The cost model steps are priced with."""
        return self.cost_model if self.cost_model is not None else self.roofline()

    def memory(self) -> MemoryBudget:
        """How each GPU's memory divides into weights, activations, non-torch memory and KV (as vLLM does)."""
        return memory_budget(
            hardware_by_name(self.hardware),
            model_by_name(self.model),
            self.tensor_parallel,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
        )

    def kv_pages(self) -> int:
        """KV pages per worker: what fits beside weights and activations (:meth:`memory`), unless overridden.

        Raises:
            InvalidArgumentError: The weights leave no room for KV.
        """
        if self.num_pages is not None:
            return self.num_pages
        budget = self.memory()
        pages = budget.num_pages(self.page_size)
        if pages <= 0:
            msg = (
                f"{self.model} does not fit on {self.tensor_parallel} x {self.hardware} with room for KV "
                f"({budget.describe()})"
            )
            raise InvalidArgumentError(msg)
        return pages

    def kv_tokens(self) -> int:
        """Tokens of KV each worker holds (pages x page size)."""
        return self.kv_pages() * self.page_size

    def describe(self) -> str:
        """What is simulated, in one line: hardware, model, TP, KV capacity and cost model."""
        kv = f"KV {self.kv_tokens():,} tokens per worker ({self.kv_pages():,} pages of {self.page_size})"
        cost = self.cost_model_source or ("roofline" if self.cost_model is None else type(self.cost_model).__name__)
        gpus = f"{self.hardware} x {self.tensor_parallel} (TP{self.tensor_parallel})"
        return f"{gpus} serving {self.model}; {kv}; cost model: {cost}"

    def to_dict(self) -> dict[str, object]:
        """The ``deployment`` block of ``results.json``."""
        memory = self.memory() if self.num_pages is None else None
        return {
            "hardware": self.hardware,
            "model": self.model,
            "tensor_parallel": self.tensor_parallel,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "page_size": self.page_size,
            "watermark": self.watermark,
            "kv_pages": self.kv_pages(),
            "kv_tokens": self.kv_tokens(),
            "kv_cache_gib": None if memory is None else memory.kv_cache_bytes / 2**30,
            "cost_model": "roofline" if self.cost_model is None else "profiled",
            "cost_model_source": self.cost_model_source or "roofline presets",
        }

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies across the whole model (what a disaggregated transfer moves)."""
        return model_by_name(self.model).kv_bytes_per_token

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler configuration of one worker."""
        return SchedulerConfig(
            num_pages=self.kv_pages(),
            page_size=self.page_size,
            max_model_len=self.max_model_len,
            watermark=self.watermark,
        )


@attrs.frozen
class Disaggregation:
    """Separate prefill and decode pools joined by a KV-transfer link.

    Attributes:
        prefill_workers: Workers that only prefill (P).
        decode_workers: Workers that only decode (D).
        link_bandwidth_gbs: Link bandwidth in GB/s, shared equally by concurrent transfers
            (50: 400 Gb/s InfiniBand; 450: NVLink within a node).
        link_latency_s: Fixed latency added to every transfer.
    """

    prefill_workers: int = attrs.field(default=1, validator=typed(attrs.validators.gt(0)))
    decode_workers: int = attrs.field(default=1, validator=typed(attrs.validators.gt(0)))
    link_bandwidth_gbs: float = attrs.field(default=50.0, validator=typed(attrs.validators.gt(0.0)))
    link_latency_s: float = attrs.field(default=20e-6, validator=typed(attrs.validators.ge(0.0)))
