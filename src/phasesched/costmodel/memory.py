"""GPU memory as vLLM divides it: weights, an activation reserve, non-torch memory, and KV cache.

vLLM sizes its KV cache after a profiling forward pass (``gpu_worker.py``, "Memory profiling
takes ..."): it may use ``total_gpu_memory x gpu_memory_utilization``; from that it takes the
weights *as loaded* (embedding and LM head included, each in its stored dtype, vocab-parallel
under tensor parallelism), the PyTorch activation peak of the profiling run, and non-torch
memory (NCCL buffers, cuBLAS workspaces); the rest is KV cache, in whole blocks of
``block_size`` tokens. This module does the same arithmetic with estimates for the two
measured parts:

* **activation peak**: the larger of one forward pass over ``max_num_batched_tokens`` tokens
  and the dummy sampler run over ``max_num_seqs`` rows of logits. The sampler dominates for
  Llama-sized vocabularies: vLLM V1 logs on an H100 report 4.76 GiB for Llama-3.1-8B and
  5.56 GiB for Qwen3-0.6B (vocab 151,936) at 1,024 sequences, about 38.7 bytes per logit
  (:data:`SAMPLER_BYTES_PER_LOGIT`);
* **non-torch memory**: 0.13 GiB on one GPU, 0.55 GiB per GPU with tensor parallelism (NCCL),
  as the same logs report.

Totals are the bytes ``torch.cuda.mem_get_info`` reports (GiB, a little under the marketing
figure), which :class:`~phasesched.costmodel.hardware.Hardware` carries as ``memory_bytes``.

>>> from phasesched.costmodel import hardware_by_name, model_by_name
>>> budget = memory_budget(hardware_by_name("H100-SXM"), model_by_name("llama-3-8b"))
>>> round(budget.kv_cache_bytes / GIB, 1)      # vLLM's log for Llama-3.1-8B on an H100: 51.38 GiB
51.4
"""

from __future__ import annotations

import math

import attrs

from phasesched.costmodel.hardware import Hardware
from phasesched.costmodel.models import ModelSpec

__all__ = [
    "GIB",
    "NON_TORCH_BYTES",
    "NON_TORCH_BYTES_TP",
    "SAMPLER_BYTES_PER_LOGIT",
    "VOCAB_PADDING",
    "MemoryBudget",
    "activation_peak_bytes",
    "memory_budget",
    "serving_defaults",
    "weight_bytes_per_gpu",
]

GIB = 1024**3
"""Bytes in a GiB (GPU memory is counted in binary units)."""

SAMPLER_BYTES_PER_LOGIT = 38.7
"""Activation bytes per (sequence x vocab entry) of vLLM V1's dummy sampler run (fitted; see the module)."""

NON_TORCH_BYTES = 0.13 * GIB
"""Non-torch memory of a single-GPU worker (CUDA context growth, cuBLAS workspaces)."""

NON_TORCH_BYTES_TP = 0.55 * GIB
"""Non-torch memory per GPU of a tensor-parallel worker (NCCL buffers on top)."""

VOCAB_PADDING = 64
"""vLLM pads the vocabulary of its vocab-parallel embedding and LM head to a multiple of this."""


def weight_bytes_per_gpu(model: ModelSpec, tensor_parallel: int = 1) -> float:
    """Bytes one GPU's weight shard occupies, as vLLM loads it.

    Linear layers are split ``tensor_parallel`` ways in the model's weight dtype; the embedding
    and (untied) LM head are vocab-parallel (padded to :data:`VOCAB_PADDING`) in their own
    stored dtype (BF16 in FP8 checkpoints); norms are replicated.
    """
    padded_vocab = math.ceil(model.vocab_size / VOCAB_PADDING) * VOCAB_PADDING
    vocab_rows = math.ceil(padded_vocab / tensor_parallel)
    tables = 1 if model.tie_embeddings else 2
    embedding = tables * vocab_rows * model.hidden_size * model.embedding_bytes_per_param
    linear = model.linear_params / tensor_parallel * model.bytes_per_param
    norms = (2 * model.num_layers + 1) * model.hidden_size * model.embedding_bytes_per_param
    return embedding + linear + norms


def activation_peak_bytes(
    model: ModelSpec, tensor_parallel: int = 1, *, max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024
) -> float:
    """The PyTorch activation peak of vLLM's profiling run (an estimate; see the module docstring).

    The forward pass holds, per token, the residual stream and its normed copy, the QKV output
    and the MLP's gate/up output plus its activation; the sampler holds about
    :data:`SAMPLER_BYTES_PER_LOGIT` bytes per logit of ``max_num_seqs`` full-vocabulary rows.
    """
    heads = (model.num_heads + 2 * model.num_kv_heads) / tensor_parallel * model.head_dim
    per_token = 2 * model.hidden_size + heads + 3 * model.intermediate_size / tensor_parallel
    forward = max_num_batched_tokens * per_token * model.activation_bytes
    sampler = max_num_seqs * model.vocab_size * SAMPLER_BYTES_PER_LOGIT
    return max(forward, sampler)


@attrs.frozen
class MemoryBudget:
    """One GPU's memory, divided as vLLM divides it (bytes).

    Attributes:
        total_bytes: What the GPU reports as its total.
        gpu_memory_utilization: The share vLLM may use.
        weight_bytes: The weight shard.
        activation_bytes: The activation reserve (profiling peak).
        non_torch_bytes: Memory outside PyTorch's allocator.
        kv_bytes_per_token: KV bytes one token occupies on this GPU.

    >>> b = MemoryBudget(80 * GIB, 0.9, 60 * GIB, 4 * GIB, 0, 2**17)
    >>> b.kv_cache_bytes / GIB, b.num_pages(16)
    (8.0, 4096)
    """

    total_bytes: float = attrs.field(validator=attrs.validators.gt(0))
    gpu_memory_utilization: float = attrs.field(validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])
    weight_bytes: float = attrs.field(validator=attrs.validators.ge(0))
    activation_bytes: float = attrs.field(validator=attrs.validators.ge(0))
    non_torch_bytes: float = attrs.field(validator=attrs.validators.ge(0))
    kv_bytes_per_token: int = attrs.field(validator=attrs.validators.gt(0))

    @property
    def requested_bytes(self) -> float:
        """``total_bytes x gpu_memory_utilization``: all vLLM may take."""
        return self.total_bytes * self.gpu_memory_utilization

    @property
    def kv_cache_bytes(self) -> float:
        """What is left for KV cache (negative when the rest does not fit)."""
        return self.requested_bytes - self.weight_bytes - self.activation_bytes - self.non_torch_bytes

    def num_pages(self, page_size: int) -> int:
        """Whole KV pages of ``page_size`` tokens that fit (0 when none does)."""
        return max(0, int(self.kv_cache_bytes // (self.kv_bytes_per_token * page_size)))

    def kv_tokens(self, page_size: int) -> int:
        """Tokens of KV the pages hold (vLLM's "GPU KV cache size: N tokens")."""
        return self.num_pages(page_size) * page_size

    def describe(self) -> str:
        """One line in the words of vLLM's memory-profiling log."""
        gib = {k: v / GIB for k, v in attrs.asdict(self).items() if k.endswith("_bytes")}
        return (
            f"{gib['total_bytes']:.2f} GiB x {self.gpu_memory_utilization:.2f} = {self.requested_bytes / GIB:.2f} GiB: "
            f"weights {gib['weight_bytes']:.2f}, activations {gib['activation_bytes']:.2f}, "
            f"non-torch {gib['non_torch_bytes']:.2f}, KV cache {self.kv_cache_bytes / GIB:.2f} GiB"
        )


def serving_defaults(hardware: Hardware) -> tuple[int, int]:
    """The ``vllm serve`` (V1) defaults of ``(max_num_batched_tokens, max_num_seqs)`` on ``hardware``.

    GPUs of 70 GiB or more other than the A100 get 8192 and 1024; the others 2048 and 256
    (``EngineArgs`` picks them by device memory and name).

    >>> from phasesched.costmodel import hardware_by_name
    >>> serving_defaults(hardware_by_name("H200")), serving_defaults(hardware_by_name("A100-80GB"))
    ((8192, 1024), (2048, 256))
    """
    if hardware.memory_bytes >= 70 * GIB and "a100" not in hardware.name.lower():
        return 8192, 1024
    return 2048, 256


def memory_budget(  # noqa: PLR0913 -- vLLM's memory knobs, all keyword-only
    hardware: Hardware,
    model: ModelSpec,
    tensor_parallel: int = 1,
    *,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    non_torch_bytes: float | None = None,
) -> MemoryBudget:
    """How one GPU of a ``tensor_parallel``-way worker divides its memory.

    ``max_num_batched_tokens`` and ``max_num_seqs`` are what vLLM profiles the activation peak
    with; ``None`` takes :func:`serving_defaults`. ``non_torch_bytes`` defaults to
    :data:`NON_TORCH_BYTES` or, with tensor parallelism, :data:`NON_TORCH_BYTES_TP`.
    """
    tokens, seqs = serving_defaults(hardware)
    if non_torch_bytes is None:
        non_torch_bytes = NON_TORCH_BYTES if tensor_parallel == 1 else NON_TORCH_BYTES_TP
    m = model
    kv_per_token = 2 * m.num_layers * m.kv_heads_per_gpu(tensor_parallel) * m.head_dim * m.kv_bytes_per_element
    return MemoryBudget(
        total_bytes=hardware.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=weight_bytes_per_gpu(model, tensor_parallel),
        activation_bytes=activation_peak_bytes(
            model,
            tensor_parallel,
            max_num_batched_tokens=max_num_batched_tokens or tokens,
            max_num_seqs=max_num_seqs or seqs,
        ),
        non_torch_bytes=non_torch_bytes,
        kv_bytes_per_token=kv_per_token,
    )
