"""Accelerators as the roofline sees them: peak dense FLOP/s, HBM bandwidth, an NVLink domain.

Numbers are the vendors' datasheet figures; what a real kernel reaches is a fraction of them,
and those fractions (the *efficiencies*) are kept beside the peaks, one per kind of work, so a
cost model can be re-tuned for a different software stack without editing a datasheet.

Sources:
    * H100 SXM5 80GB and H200 SXM 141GB: NVIDIA H100 / H200 Tensor Core GPU datasheets
      (dense BF16 989 TFLOP/s, i.e. 1,979 "with sparsity" halved; HBM3 3.35 TB/s, HBM3e
      4.8 TB/s; 4th-generation NVLink 900 GB/s per GPU, both directions together).
    * A100 80GB SXM: NVIDIA A100 Tensor Core GPU datasheet (dense BF16 312 TFLOP/s, HBM2e
      2,039 GB/s, 3rd-generation NVLink 600 GB/s per GPU, both directions together).
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping

import attrs

from phasesched.errors import InvalidArgumentError, UnknownNameError

__all__ = ["HARDWARE_PRESETS", "Hardware", "hardware_by_name", "same_hardware"]


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        msg = f"{attribute.name} must be positive, got {value}"
        raise InvalidArgumentError(msg)


def _fraction(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 < value <= 1.0:
        msg = f"{attribute.name} must be in (0, 1], got {value}"
        raise InvalidArgumentError(msg)


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        msg = f"{attribute.name} must be non-negative, got {value}"
        raise InvalidArgumentError(msg)


@attrs.frozen
class Hardware:
    """One accelerator: datasheet peaks plus the fractions of them that real kernels reach.

    Attributes:
        name: Preset name (``"H200"``).
        peak_flops: Dense (no sparsity) BF16 tensor-core FLOP/s.
        hbm_bandwidth: HBM bandwidth, bytes/s.
        memory_bytes: HBM capacity in bytes as the driver reports it (``torch.cuda.mem_get_info``'s
            total, which vLLM logs as ``total_gpu_memory``): a little under the datasheet's GB.
        link_bandwidth: NVLink bandwidth per GPU as datasheets quote it, bytes/s, *both
            directions together*; a ring all-reduce streams in one direction, so the cost
            model uses :attr:`link_bandwidth_per_direction`.
        link_latency_s: Seconds of fixed cost per small all-reduce within the NVLink domain
            (launch plus synchronisation; what a 4-byte ``all_reduce_perf`` run reports).
        compute_efficiency: Fraction of ``peak_flops`` that the linear layers' GEMMs reach.
        attention_efficiency: Fraction of ``peak_flops`` that prefill attention kernels reach.
        bandwidth_efficiency: Fraction of ``hbm_bandwidth`` that streaming reads (weights, KV
            pages) reach.
        link_efficiency: Fraction of the per-direction link bandwidth a ring all-reduce reaches
            (nccl-tests' "bus bandwidth" over the link's).

    >>> h200 = hardware_by_name("H200")
    >>> h200.peak_flops / 1e12, h200.hbm_bandwidth / 1e12, h200.link_bandwidth_per_direction / 1e9
    (989.0, 4.8, 450.0)

    """

    name: str
    peak_flops: float = attrs.field(validator=_positive)
    hbm_bandwidth: float = attrs.field(validator=_positive)
    memory_bytes: float = attrs.field(validator=_positive)
    link_bandwidth: float = attrs.field(validator=_positive)
    link_latency_s: float = attrs.field(validator=_non_negative)
    compute_efficiency: float = attrs.field(validator=_fraction)
    attention_efficiency: float = attrs.field(validator=_fraction)
    bandwidth_efficiency: float = attrs.field(validator=_fraction)
    link_efficiency: float = attrs.field(validator=_fraction)

    @property
    def link_bandwidth_per_direction(self) -> float:
        """Bytes/s one GPU can send (or receive) over NVLink — half the datasheet figure."""
        return self.link_bandwidth / 2


# NOTE: the efficiencies are estimates of what a modern serving stack reaches, not
# measurements of one; calibrate them (or use a profiled table) when the numbers matter.
# - GEMMs: cuBLAS reaches roughly 70-75% of the dense BF16 peak on Hopper at the shapes of an
#   8B-70B model's linear layers with a few hundred tokens or more (Hopper runs into its power
#   limit before its peak), and roughly 75-80% on A100.
# - Attention: FlashAttention-2 reaches about 35-45% of peak on H100 and 60-70% on A100;
#   FlashAttention-3 (FlashInfer's default prefill backend on SM90) 60-75% on long sequences.
#   Causal masking and short chunks waste part of each tile, hence 50% on Hopper, 55% on A100.
# - Bandwidth: GEMV-shaped decode kernels and paged-KV decode kernels stream at 75-85% of the
#   HBM peak; 80%.
# - Links: nccl-tests all-reduce bus bandwidth on an 8-GPU NVSwitch node is about 80% of the
#   per-direction NVLink bandwidth (about 360 GB/s of 450 on H100); small-message latency is a
#   few microseconds with vLLM's custom all-reduce and about 10 us with NCCL: 8 us on
#   Hopper, 10 us on A100.
# NOTE: memory is what vLLM logs as total_gpu_memory on each GPU (H100 SXM 79.18 GiB, H200
# 139.81 GiB, A100-SXM4-80GB 79.15 GiB), not the datasheet's 80 / 141 GB: counting 80 GB as
# 80e9 bytes loses 5.9 GB per GPU, which for a 70B model on two A100s is most of the KV cache.
_GIB = 1024**3

_HOPPER_EFFICIENCY = {
    "compute_efficiency": 0.70,
    "attention_efficiency": 0.50,
    "bandwidth_efficiency": 0.80,
    "link_efficiency": 0.80,
    "link_latency_s": 8e-6,
}

H100_SXM = Hardware(
    name="H100-SXM",
    peak_flops=989e12,
    hbm_bandwidth=3.35e12,
    memory_bytes=79.18 * _GIB,
    link_bandwidth=900e9,
    **_HOPPER_EFFICIENCY,
)
"""H100 SXM5 80GB: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 4 at 900 GB/s (datasheet)."""

H200 = Hardware(
    name="H200",
    peak_flops=989e12,
    hbm_bandwidth=4.8e12,
    memory_bytes=139.81 * _GIB,
    link_bandwidth=900e9,
    **_HOPPER_EFFICIENCY,
)
"""H200 SXM 141GB: H100's compute with 4.8 TB/s HBM3e; NVLink 4 at 900 GB/s (datasheet)."""

A100_80GB = Hardware(
    name="A100-80GB",
    peak_flops=312e12,
    hbm_bandwidth=2.039e12,
    memory_bytes=79.15 * _GIB,
    link_bandwidth=600e9,
    link_latency_s=10e-6,
    compute_efficiency=0.75,
    attention_efficiency=0.55,
    bandwidth_efficiency=0.80,
    link_efficiency=0.80,
)
"""A100 80GB SXM: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e, NVLink 3 at 600 GB/s (datasheet)."""

HARDWARE_PRESETS: Mapping[str, Hardware] = types.MappingProxyType({hw.name: hw for hw in (H100_SXM, H200, A100_80GB)})
"""Every hardware preset by name (read-only)."""


def hardware_by_name(name: str) -> Hardware:
    """The preset called ``name`` (case-insensitive).

    Raises:
        UnknownNameError: No preset has that name; the message lists the known ones.

    """
    for known, hardware in HARDWARE_PRESETS.items():
        if known.lower() == name.lower():
            return hardware
    msg = f"no hardware preset named {name!r}; known: {', '.join(HARDWARE_PRESETS)}"
    raise UnknownNameError(msg)


def same_hardware(recorded: str, name: str) -> bool:
    """Whether a profile recorded on ``recorded`` was measured on the hardware called ``name``.

    ``recorded`` is a preset's name, or the name the device gives itself (``NVIDIA H200``, as
    ``phasesched profile`` records it): that matches a preset whose model number (the name
    before its first ``-``) is one of its words. Anything else must be equal, ignoring case.
    """
    if recorded.lower() == name.lower():
        return True
    if not any(known.lower() == name.lower() for known in HARDWARE_PRESETS):
        return False
    return name.split("-", 1)[0].lower() in re.split(r"[\s\-_]+", recorded.lower())
