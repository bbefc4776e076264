"""Typed errors of the torch executor.

They derive from phasesched's own family (:class:`phasesched.PhaseschedError`), so an engine that
catches phasesched errors catches these too. A plan the executor cannot run is an
:class:`phasesched.InvalidPlanError`; a checkpoint that does not fit the model names the tensor at
fault, since a 7-billion-parameter state dict is otherwise impossible to debug.
"""

from __future__ import annotations

import pathlib

from phasesched.errors import InvalidPlanError, PhaseschedError, UnsupportedModelError

__all__ = [
    "CheckpointError",
    "DeviceUnavailableError",
    "MissingTensorError",
    "PlanNotExecutableError",
    "StateDictError",
    "TensorShapeError",
    "UnexpectedTensorError",
    "UnsupportedArchitectureError",
    "UnsupportedConfigError",
]


class PlanNotExecutableError(InvalidPlanError):
    """A plan this executor cannot run (pages outside the cache, no token ids, ...); nothing ran."""


class UnsupportedConfigError(UnsupportedModelError):
    """A model configuration this implementation cannot represent (activation, RoPE type, mixed windows)."""


class UnsupportedArchitectureError(UnsupportedConfigError):
    """A model architecture this executor does not implement (Qwen3, Phi-3, Mixtral, ...).

    Attributes:
        architecture: The ``model_type`` or ``architectures`` entry of the config that is refused.

    """

    def __init__(self, architecture: str, supported: tuple[str, ...]) -> None:
        super().__init__(f"architecture {architecture!r} is not supported; supported: {', '.join(supported)}")
        self.architecture = architecture


class CheckpointError(PhaseschedError, ValueError):
    """A model folder or checkpoint file that cannot be read; nothing was built.

    Attributes:
        path: The file or folder at fault.

    """

    def __init__(self, path: pathlib.Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


class DeviceUnavailableError(PhaseschedError, RuntimeError):
    """The requested device does not exist here (CUDA on a CPU-only torch build, a GPU index too high)."""


class StateDictError(PhaseschedError, ValueError):
    """A state dict that does not fit the model; nothing was loaded.

    Attributes:
        tensor: The name of the offending tensor, in ``transformers`` ``LlamaForCausalLM`` naming.

    """

    def __init__(self, tensor: str, message: str) -> None:
        super().__init__(message)
        self.tensor = tensor


class MissingTensorError(StateDictError):
    """The state dict lacks a tensor the model needs."""

    def __init__(self, tensor: str) -> None:
        super().__init__(tensor, f"state dict is missing tensor {tensor!r}")


class UnexpectedTensorError(StateDictError):
    """The state dict holds a tensor the model has no place for (wrong architecture or config)."""

    def __init__(self, tensor: str) -> None:
        super().__init__(tensor, f"state dict has unexpected tensor {tensor!r}")


class TensorShapeError(StateDictError):
    """A tensor's shape disagrees with the model configuration.

    Attributes:
        expected: The shape the configuration implies.
        actual: The shape found.

    """

    def __init__(self, tensor: str, expected: tuple[int, ...], actual: tuple[int, ...]) -> None:
        super().__init__(tensor, f"tensor {tensor!r} has shape {actual}, the config expects {expected}")
        self.expected = expected
        self.actual = actual
