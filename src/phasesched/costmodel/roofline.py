"""A roofline cost model: each part of a step is bound by compute or by memory, whichever is slower.

A step has two components whose costs scale differently with the batch:

* **linear layers** (QKV/O projections, MLP, LM head): ``2 x params`` FLOPs per token, but
  the weights are read once per step however many tokens share them, so a small batch is
  bandwidth-bound and a large one compute-bound. The LM head runs for one token per slice
  (engines compute logits only at a slice's last position), not for every prompt token: for
  Llama-3-8B that is 7% fewer FLOPs on a prefill than ``2 x all params x tokens``;
* **attention**: FLOPs grow with (query, key) pairs, causal within a slice (the ``i``-th of
  ``n`` new tokens at context ``L`` sees ``L - n + i + 1`` keys), and bytes grow with the
  context every slice reads plus the KV its new tokens write.

Each component takes ``max(compute, memory)`` at realistic efficiencies, the components run
one after the other, and tensor parallelism adds two all-reduces per layer (after attention
and after the MLP) priced with the ring algorithm. A fixed per-step overhead covers what the
roofline does not see (launches, sampling, host synchronisation).
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.costmodel._batch import check_batch, check_decodes
from phasesched.costmodel.hardware import Hardware, hardware_by_name
from phasesched.costmodel.memory import memory_budget
from phasesched.costmodel.models import ModelSpec, model_by_name
from phasesched.errors import InvalidArgumentError
from phasesched.validators import typed

__all__ = ["DEFAULT_STEP_OVERHEAD_S", "RooflineCostModel", "StepBreakdown", "causal_pairs"]

Float64Array = NDArray[np.float64]
_Real = TypeVar("_Real", float, Float64Array)

DEFAULT_STEP_OVERHEAD_S = 0.5e-3
"""Seconds added to every step.

With CUDA graphs a decode step's launches cost tens of microseconds, but sampling, the logits
copy and the host round trip that starts the next step add a few hundred: serving engines show
roughly 0.3-1 ms between a step's last kernel and the next one's first. 0.5 ms is the middle.
"""


def _hardware_default(name: str) -> Any:
    """An attrs default that copies the named efficiency from the model's :class:`Hardware`."""
    return attrs.Factory(lambda self: getattr(self.hardware, name), takes_self=True)


def _fraction(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 < value <= 1.0:
        msg = f"{attribute.name} must be in (0, 1], got {value}"
        raise InvalidArgumentError(msg)


@attrs.frozen
class StepBreakdown:
    """Where a step's time goes, in seconds; ``total_s`` is what :meth:`~RooflineCostModel.step_time` returns.

    Attributes:
        linear_compute_s: Matmul FLOPs over the GEMM rate.
        linear_memory_s: Weight bytes over the streaming bandwidth.
        attention_compute_s: Causal attention FLOPs over the attention rate.
        attention_memory_s: KV bytes read and written over the streaming bandwidth.
        allreduce_s: Tensor-parallel all-reduces (0 without tensor parallelism).
        overhead_s: The fixed per-step overhead (0 for an empty step).

    """

    linear_compute_s: float
    linear_memory_s: float
    attention_compute_s: float
    attention_memory_s: float
    allreduce_s: float
    overhead_s: float

    @property
    def linear_s(self) -> float:
        """The linear layers' time — the slower of their compute and memory."""
        return max(self.linear_compute_s, self.linear_memory_s)

    @property
    def attention_s(self) -> float:
        """Attention's time — the slower of its compute and memory."""
        return max(self.attention_compute_s, self.attention_memory_s)

    @property
    def total_s(self) -> float:
        """The step's duration (every term is 0 for an empty step, so is this)."""
        return self.linear_s + self.attention_s + self.allreduce_s + self.overhead_s


def causal_pairs(num_new: NDArray[np.integer], kv_len: NDArray[np.integer]) -> NDArray[np.int64]:
    """(query, key) pairs each slice's attention computes.

    The ``i``-th (0-based) of ``n`` new tokens at context ``L`` attends to ``L - n + i + 1``
    keys, so a slice computes ``n * L - n * (n - 1) / 2`` pairs, exactly, in integers.

    Args:
        num_new: int ``[B]``: tokens each slice computes.
        kv_len: int ``[B]``: each slice's context after the step.

    Returns:
        int64 ``[B]``: pairs per slice.

    >>> causal_pairs(np.array([1, 4]), np.array([10, 4])).tolist()   # a decode; a 4-token prompt
    [10, 10]

    """
    new = np.asarray(num_new, dtype=np.int64)
    return new * np.asarray(kv_len, dtype=np.int64) - new * (new - 1) // 2


@attrs.frozen
class _Rates:
    """Per-GPU constants of a :class:`RooflineCostModel`, computed once (step_time is a hot path)."""

    linear_flops_per_token: float
    lm_head_flops: float
    weight_bytes: float
    pair_flops: float
    kv_bytes_per_token: float
    flop_rate: float
    attention_rate: float
    byte_rate: float
    allreduce_s_per_token: float
    allreduce_latency_s: float

    @classmethod
    def of(cls, cost: RooflineCostModel) -> _Rates:
        """The constants of ``cost``."""
        hw, m, p = cost.hardware, cost.model, cost.tensor_parallel
        # Two ring all-reduces per layer (after attention, after the MLP), each moving
        # 2 (p - 1) / p of its tokens x hidden activations over one link direction.
        ring_bytes_per_token = 2 * (p - 1) / p * m.hidden_size * m.activation_bytes
        link_rate = hw.link_bandwidth_per_direction * cost.link_efficiency
        return cls(
            linear_flops_per_token=m.linear_flops_per_token / p,
            lm_head_flops=m.lm_head_flops_per_token / p,
            weight_bytes=m.step_weight_bytes / p,
            pair_flops=m.attention_flops_per_pair / p,
            kv_bytes_per_token=float(cost.kv_bytes_per_token),
            flop_rate=hw.peak_flops * cost.compute_efficiency,
            attention_rate=hw.peak_flops * cost.attention_efficiency,
            byte_rate=hw.hbm_bandwidth * cost.bandwidth_efficiency,
            allreduce_s_per_token=2 * m.num_layers * ring_bytes_per_token / link_rate,
            allreduce_latency_s=2 * m.num_layers * hw.link_latency_s if p > 1 else 0.0,
        )


@attrs.frozen
class RooflineCostModel:
    """Step time from FLOPs and bytes, for one model on ``tensor_parallel`` GPUs of one kind.

    The efficiencies default to the :class:`~phasesched.costmodel.hardware.Hardware`'s (see
    :mod:`phasesched.costmodel.hardware` for the reasoning behind each number); override them
    to calibrate against measurements.

    Attributes:
        hardware: The GPU.
        model: The model.
        tensor_parallel: GPUs the model is sharded over (must divide its query heads).
        compute_efficiency: Fraction of peak FLOP/s the linear layers reach.
        attention_efficiency: Fraction of peak FLOP/s attention reaches.
        bandwidth_efficiency: Fraction of HBM bandwidth that weight and KV streaming reach.
        link_efficiency: Fraction of per-direction NVLink bandwidth a ring all-reduce reaches.
        step_overhead_s: Fixed seconds per (non-empty) step; see :data:`DEFAULT_STEP_OVERHEAD_S`.

    >>> roofline = RooflineCostModel.from_names("H200", "llama-3-8b")
    >>> decode = roofline.step_time(np.ones(1, np.int64), np.array([1024]))
    >>> round(decode * 1e3, 2)   # ms: weight streaming dominates a batch-1 decode
    4.44

    """

    hardware: Hardware
    model: ModelSpec
    tensor_parallel: int = 1
    compute_efficiency: float = attrs.field(default=_hardware_default("compute_efficiency"), validator=_fraction)
    attention_efficiency: float = attrs.field(default=_hardware_default("attention_efficiency"), validator=_fraction)
    bandwidth_efficiency: float = attrs.field(default=_hardware_default("bandwidth_efficiency"), validator=_fraction)
    link_efficiency: float = attrs.field(default=_hardware_default("link_efficiency"), validator=_fraction)
    step_overhead_s: float = attrs.field(default=DEFAULT_STEP_OVERHEAD_S, validator=typed(attrs.validators.ge(0.0)))

    _rates: _Rates = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        self.model.check_tensor_parallel(self.tensor_parallel)
        object.__setattr__(self, "_rates", _Rates.of(self))

    @classmethod
    def from_names(
        cls, hardware: str = "H200", model: str = "llama-3-8b", tensor_parallel: int = 1, **overrides: float
    ) -> RooflineCostModel:
        """Build from preset names; ``overrides`` set efficiencies or ``step_overhead_s``.

        Raises:
            UnknownNameError: A name matches no preset (the message lists the known ones).

        """
        return cls(hardware_by_name(hardware), model_by_name(model), tensor_parallel, **overrides)

    # ------------------------------------------------------------------ per-GPU quantities
    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token of context occupies on each GPU."""
        m = self.model
        return 2 * m.num_layers * m.kv_heads_per_gpu(self.tensor_parallel) * m.head_dim * m.kv_bytes_per_element

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """Tokens of KV that fit on each GPU, as vLLM sizes its cache (vLLM's knob of that name).

        Weights, vLLM's activation reserve and non-torch memory come first
        (:func:`~phasesched.costmodel.memory.memory_budget` with vLLM's serving defaults); the
        rest counts in whole 16-token blocks. Returns 0 when the weights alone do not fit.
        """
        budget = memory_budget(
            self.hardware, self.model, self.tensor_parallel, gpu_memory_utilization=gpu_memory_utilization
        )
        return budget.kv_tokens(16)

    # ------------------------------------------------------------------ the cost model
    def step_time(self, num_new: NDArray[np.integer], kv_len: NDArray[np.integer]) -> float:
        """Seconds for one step (see the module docstring; 0 for an empty step).

        Args:
            num_new: int ``[B]``: tokens each slice computes (``>= 1``).
            kv_len: int ``[B]``: each slice's context after the step (``>= num_new``).

        """
        linear_compute, linear_memory, attention_compute, attention_memory, allreduce, overhead = self._terms(
            num_new, kv_len
        )
        # StepBreakdown.total_s's operations in its order, without making the breakdown.
        return max(linear_compute, linear_memory) + max(attention_compute, attention_memory) + allreduce + overhead

    def breakdown(self, num_new: NDArray[np.integer], kv_len: NDArray[np.integer]) -> StepBreakdown:
        """The step's time split by component (same arguments as :meth:`step_time`)."""
        return StepBreakdown(*self._terms(num_new, kv_len))

    def _terms(self, num_new: NDArray[np.integer], kv_len: NDArray[np.integer]) -> tuple[float, ...]:
        """One step's six :class:`StepBreakdown` terms."""
        new, ctx = check_batch(num_new, kv_len)
        # Python floats of exact integer totals: cheaper than numpy on one-element arrays, and
        # IEEE arithmetic gives the same bits as decode_step_times' array path.
        tokens = int(new.sum())
        # The sum of causal_pairs, in two dot products: sum(n * L) - sum(n * (n - 1)) / 2.
        pairs = int(new @ ctx) - (int(new @ new) - tokens) // 2
        return self._components(  # floats in, floats out
            float(tokens), float(len(new)), float(pairs), float(ctx.sum()), busy=1.0 if len(new) else 0.0
        )

    def decode_step_times(self, kv_len: NDArray[np.integer], num_steps: int) -> Float64Array:
        """Durations of ``num_steps`` pure-decode steps whose contexts grow by one per step.

        One vectorized expression over the steps, equal to
        ``step_time(ones(B), kv_len + j)`` for ``j = 0 .. num_steps - 1``.

        Args:
            kv_len: int ``[B]``: contexts after the first step.
            num_steps: Steps to price.

        Returns:
            float64 ``[num_steps]``: seconds per step.

        """
        ctx = check_decodes(kv_len, num_steps)
        batch = len(ctx)
        # A decode slice (n = 1) computes exactly L pairs, so pairs and context reads coincide.
        context = (int(ctx.sum()) + batch * np.arange(num_steps, dtype=np.int64)).astype(np.float64)
        steps = np.full(num_steps, float(batch), dtype=np.float64)
        busy = np.full(num_steps, 1.0 if batch else 0.0, dtype=np.float64)
        parts = self._components(steps, steps, context, context, busy=busy)
        return self._total(parts)

    # ------------------------------------------------------------------ shared arithmetic
    def _components(
        self, tokens: _Real, slices: _Real, pairs: _Real, context: _Real, *, busy: _Real
    ) -> tuple[_Real, ...]:
        """The six :class:`StepBreakdown` terms for steps given by their totals.

        Works on floats (one step) and on float64 arrays (many), with the same operations in
        the same order, so ``step_time`` and ``decode_step_times`` agree to the last bit.
        ``busy`` is 1.0 for a step with slices and 0.0 for an empty one; multiplying by it
        (exactly) zeroes the per-step terms of an empty step.
        """
        k = self._rates
        # Every slice's last token gets logits (engines compute them for partial prefills too).
        linear_flops = k.linear_flops_per_token * tokens + k.lm_head_flops * slices
        kv_bytes = k.kv_bytes_per_token * (context + tokens)  # read all context, write the new tokens
        allreduce = (k.allreduce_s_per_token * tokens + k.allreduce_latency_s) * busy
        return (
            linear_flops / k.flop_rate,
            k.weight_bytes / k.byte_rate * busy,
            k.pair_flops * pairs / k.attention_rate,
            kv_bytes / k.byte_rate,
            allreduce,
            self.step_overhead_s * busy,
        )

    @staticmethod
    def _total(parts: tuple[Float64Array, ...]) -> Float64Array:
        """The step times from :meth:`_components`' terms."""
        linear_compute, linear_memory, attention_compute, attention_memory, allreduce, overhead = parts
        # Same operation order as StepBreakdown.total_s, so both paths round identically.
        total = np.maximum(linear_compute, linear_memory) + np.maximum(attention_compute, attention_memory)
        return np.asarray(total + allreduce + overhead, dtype=np.float64)
