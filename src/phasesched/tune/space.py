"""The search space of ``phasesched tune``: policy x chunk x token budget x GPU layout.

A :class:`Candidate` is one way to serve a workload on a fixed number of GPUs: a registered
policy with optional ``chunk_size`` and ``max_num_batched_tokens`` overrides, on either
aggregated replicas or a prefill:decode split. Its :attr:`~Candidate.label` is what a user
passes back: ``sarathi(chunk=512)`` is ``--policy sarathi --policy-option chunk_size=512``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from phasesched.errors import InvalidArgumentError
from phasesched.sim.deployment import Disaggregation

__all__ = ["Candidate", "Layout", "SearchSpace", "layouts", "policy_label"]


@attrs.frozen(order=True)
class Layout:
    """How the GPUs are used: ``replicas`` aggregated workers, or ``prefill`` + ``decode`` workers.

    Attributes:
        prefill: Prefill-only workers (0: aggregated).
        decode: Decode-only workers (0: aggregated).
        replicas: Aggregated workers (0: disaggregated).
    """

    prefill: int = 0
    decode: int = 0
    replicas: int = 0

    @property
    def workers(self) -> int:
        """Workers in all."""
        return self.replicas or self.prefill + self.decode

    @property
    def label(self) -> str:
        """``"4 replicas"`` or ``"1P:3D"``."""
        return f"{self.replicas} replicas" if self.replicas else f"{self.prefill}P:{self.decode}D"

    def disaggregation(self, link_bandwidth_gbs: float = 50.0) -> Disaggregation | None:
        """The simulator's description of a split; ``None`` for aggregated replicas."""
        if self.replicas:
            return None
        return Disaggregation(self.prefill, self.decode, link_bandwidth_gbs=link_bandwidth_gbs)


def layouts(workers: int, *, aggregated: bool = True, disaggregated: bool = True) -> tuple[Layout, ...]:
    """Aggregated replicas on every worker, and every P:D split of them (P, D >= 1).

    >>> [layout.label for layout in layouts(3)]
    ['3 replicas', '1P:2D', '2P:1D']
    """
    out = [Layout(replicas=workers)] if aggregated else []
    if disaggregated:
        out += [Layout(prefill=p, decode=workers - p) for p in range(1, workers)]
    return tuple(out)


def policy_label(policy: str, chunk: int | None = None, budget: int | None = None) -> str:
    """``sarathi(chunk=512)``, ``vllm(chunk=2048,budget=4096)`` or just ``orca``.

    >>> policy_label("sarathi", 512), policy_label("orca")
    ('sarathi(chunk=512)', 'orca')
    """
    options = [f"chunk={chunk}"] * (chunk is not None) + [f"budget={budget}"] * (budget is not None)
    return f"{policy}({','.join(options)})" if options else policy


@attrs.frozen(order=True)
class Candidate:
    """One configuration to find the capacity of.

    Attributes:
        policy: A registered policy name.
        chunk: ``chunk_size`` override (``None``: the policy's own).
        budget: ``max_num_batched_tokens`` override (``None``: the policy's own).
        layout: The GPU layout.
    """

    policy: str
    chunk: int | None
    budget: int | None
    layout: Layout

    @property
    def policy_label(self) -> str:
        """The policy with its overrides, as :func:`policy_label` writes it."""
        return policy_label(self.policy, self.chunk, self.budget)

    @property
    def label(self) -> str:
        """``"sarathi(chunk=512) on 1P:3D"``."""
        return f"{self.policy_label} on {self.layout.label}"

    def overrides(self) -> dict[str, Any]:
        """The :class:`~phasesched.PolicyOptions` fields this candidate sets."""
        out: dict[str, Any] = {}
        if self.chunk is not None:
            out["chunk_size"] = self.chunk
        if self.budget is not None:
            out["max_num_batched_tokens"] = self.budget
        return out

    def command_line(self) -> str:
        """The ``phasesched bench`` options that select this policy."""
        options = "".join(f" --policy-option {k}={v}" for k, v in self.overrides().items())
        return f"--policy {self.policy}{options}"


def _ints(values: Iterable[int | None]) -> tuple[int | None, ...]:
    return tuple(values)


def _names(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen
class SearchSpace:
    """What ``tune`` searches.

    Attributes:
        policies: Registered policy names.
        chunks: Chunk sizes tried on policies that take one (``None``: the policy's own).
        budgets: Token budgets tried on policies whose budget is not their chunk.
        aggregated: Try aggregated replicas.
        disaggregated: Try every P:D split.
    """

    policies: tuple[str, ...] = attrs.field(converter=_names)
    chunks: tuple[int | None, ...] = attrs.field(default=(None,), converter=_ints)
    budgets: tuple[int | None, ...] = attrs.field(default=(None,), converter=_ints)
    aggregated: bool = True
    disaggregated: bool = True

    def __attrs_post_init__(self) -> None:
        if not self.policies:
            msg = "the search space needs at least one policy"
            raise InvalidArgumentError(msg)
        if not (self.aggregated or self.disaggregated):
            msg = "the search space needs aggregated replicas, P:D splits, or both"
            raise InvalidArgumentError(msg)

    def candidates(self, workers: int, takes: Any) -> list[Candidate]:
        """Every candidate on ``workers`` workers.

        Args:
            workers: Workers the GPUs make (GPUs / tensor parallelism).
            takes: ``takes(policy, field) -> bool``: whether a policy honours a
                :class:`~phasesched.PolicyOptions` field (``chunk_size``,
                ``max_num_batched_tokens``), so overrides it ignores are not tried twice.
        """
        shapes = layouts(workers, aggregated=self.aggregated, disaggregated=self.disaggregated)
        out = []
        for policy in dict.fromkeys(self.policies):
            chunks = self.chunks if takes(policy, "chunk_size") else (None,)
            budgets = self.budgets if takes(policy, "max_num_batched_tokens") else (None,)
            out += [Candidate(policy, c, b, shape) for c in chunks for b in budgets for shape in shapes]
        return out

    @property
    def size_hint(self) -> int:
        """Policies x chunks x budgets (an upper bound before layouts)."""
        return len(self.policies) * len(self.chunks) * len(self.budgets)


def check_counts(values: Sequence[int | None], what: str) -> None:
    """Raise unless every value is ``None`` or positive."""
    for value in values:
        if value is not None and value <= 0:
            msg = f"{what} must be positive, got {value}"
            raise InvalidArgumentError(msg)
