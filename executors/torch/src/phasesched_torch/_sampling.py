"""Token sampling: greedy, temperature, top-k and top-p, reproducible per request and position.

A draw is inverse-CDF sampling: one uniform number ``u`` per row picks the token where the
cumulative (filtered, renormalised) probability first exceeds ``u``. For a seeded request ``u``
is a pure function of ``(seed, position)``, so a request that is preempted and recomputed
draws the same token at the same position, whatever else shares its batch and whatever device
runs it. Unseeded requests draw ``u`` from the executor's own seeded stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from phasesched import SamplingParams, StepPlan

__all__ = ["RequestSampler", "sample_tokens", "uniform_for"]

_GREEDY = SamplingParams()


def uniform_for(seed: int, position: int) -> float:
    """The uniform number a request seeded with ``seed`` draws for the token at ``position``.

    ``position`` is the index the sampled token takes in its sequence (prompt plus generated).
    """
    return float(np.random.default_rng([seed % 2**64, position]).random())


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """Pick one token per row; rows with ``temperature == 0`` take the arg-max.

    Top-k keeps the ``k`` most likely tokens (0: all), then top-p keeps the smallest prefix of
    those, by probability, whose mass reaches ``p`` (renormalised after top-k, as
    ``transformers``' warpers do). Ties are broken by token id.

    Args:
        logits: float ``[S, V]``.
        temperature: float ``[S]``: 0 for greedy rows.
        top_k: int ``[S]``.
        top_p: float ``[S]`` in ``(0, 1]``.
        uniform: float ``[S]`` in ``[0, 1)``: each row's draw (ignored for greedy rows).

    Returns:
        int64 ``[S]``: token ids.

    >>> logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    >>> sample_tokens(logits, torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), torch.tensor([1.0, 1.0]),
    ...               torch.tensor([0.0, 0.99])).tolist()
    [1, 1]

    """
    tokens = logits.argmax(dim=-1)
    rows = (temperature > 0).nonzero().squeeze(1)
    if rows.numel():
        tokens[rows] = _draw(
            logits[rows].to(torch.float32) / temperature[rows, None].to(torch.float32),
            top_k[rows],
            top_p[rows],
            uniform[rows],
        )
    return tokens


def _draw(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from temperature-scaled logits ``[S, V]`` after top-k/top-p filtering."""
    vocab = scaled.shape[-1]
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(scaled.device)
    keep = rank < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, -math.inf), dim=-1)
    keep &= (torch.cumsum(probs, dim=-1) - probs) < top_p[:, None].to(probs.dtype)
    # Kept tokens form a prefix of the sorted order; float64 keeps the CDF monotone and exact enough.
    cdf = torch.cumsum(probs.masked_fill(~keep, 0.0).to(torch.float64), dim=-1)
    target = uniform.to(torch.float64) * cdf[:, -1]
    index = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    index = torch.minimum(index, keep.sum(dim=-1) - 1)
    return order.gather(1, index[:, None]).squeeze(1)


class RequestSampler:
    """Each request's sampling parameters, kept from ``plan.new_requests`` until ``plan.released``.

    A request the sampler has not seen (a profiler's synthetic plan) samples greedily.

    Args:
        seed: Seeds the stream unseeded, non-greedy requests draw from.

    """

    def __init__(self, seed: int = 0) -> None:
        self._params: dict[str, SamplingParams] = {}
        self._rng = np.random.default_rng(seed)

    def track(self, plan: StepPlan) -> None:
        """Forget released requests, then learn new ones (an id may be released and reused in one plan)."""
        for request_id in plan.released:
            self._params.pop(request_id, None)
        for request in plan.new_requests:
            self._params[request.request_id] = request.sampling

    def params(self, request_id: str) -> SamplingParams:
        """The parameters of ``request_id`` (greedy when unknown)."""
        return self._params.get(request_id, _GREEDY)

    @property
    def num_tracked(self) -> int:
        """Requests whose parameters are held."""
        return len(self._params)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], positions: Sequence[int]) -> torch.Tensor:
        """Pick each row's token.

        Args:
            logits: float32 ``[S, V]``: one row per sampling slice.
            request_ids: ``S`` request ids, row by row.
            positions: ``S`` indices the sampled tokens take in their sequences.

        Returns:
            int64 ``[S]`` token ids, on ``logits``' device.

        """
        params = [self.params(r) for r in request_ids]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)
        uniform = [self._uniform(p, pos) for p, pos in zip(params, positions, strict=True)]
        device = logits.device
        return sample_tokens(
            logits,
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor(uniform, dtype=torch.float64, device=device),
        )

    def _uniform(self, params: SamplingParams, position: int) -> float:
        if params.greedy:
            return 0.0
        if params.seed is None:
            return float(self._rng.random())
        return uniform_for(params.seed, position)
