"""Hypothesis strategies for the vLLM differential tests: deployments and workloads."""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from phasesched_vllm.testing import RequestSpec


@attrs.frozen
class Deployment:
    """The vLLM limits a workload runs under."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


@attrs.frozen
class Case:
    """A deployment and a workload that fits it (every request fits the KV cache alone)."""

    deployment: Deployment
    workload: tuple[RequestSpec, ...]


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@st.composite
def cases(
    draw: st.DrawFn,
    *,
    max_requests: int = 10,
    max_prompt: int = 400,
    max_tokens: int = 24,
    priorities: bool = False,
    prefixes: bool = False,
    budgets: tuple[int, ...] = (32, 64, 128, 512),
    seqs: tuple[int, ...] = (2, 3, 8, 32),
) -> Case:
    """A deployment and a workload that often chunks prompts and, when KV is tight, preempts.

    The defaults are small (tight budgets and sequence caps, so every step is contended);
    ``budgets`` and ``seqs`` give larger deployments.
    """
    block_size = draw(st.sampled_from([4, 16]))
    budget = draw(st.sampled_from(budgets))
    max_num_seqs = draw(st.sampled_from([s for s in seqs if s <= budget]))
    specs = draw(
        st.lists(
            st.builds(
                RequestSpec,
                arrival_step=st.integers(0, 12),
                prompt_len=st.integers(1, max_prompt),
                max_tokens=st.integers(1, max_tokens),
                priority=st.integers(0, 3) if priorities else st.just(0),
                prefix=st.integers(0, 3) if prefixes else st.just(0),
            ),
            min_size=1,
            max_size=max_requests,
        )
    )
    largest = max(_blocks(s.prompt_len + s.max_tokens, block_size) for s in specs)
    total = sum(_blocks(s.prompt_len + s.max_tokens, block_size) for s in specs)
    # From "only the largest request fits" (constant preemption) to "everything fits".
    num_blocks = draw(st.integers(largest + 1, max(largest + 1, total + 1)))
    deployment = Deployment(num_blocks, block_size, max_num_seqs, budget)
    return Case(deployment, tuple(sorted(specs, key=lambda s: s.arrival_step)))
