"""Synthetic workloads whose prompts share prefixes: system prompts and multi-turn chat sessions.

Requests stay length-only (fast to simulate); what they share is written as block hashes
(:class:`~phasesched.sim.block_hashes.BlockHashes`), as the Mooncake traces do, so a policy with
prefix caching gets the hits the workload implies. A prompt is a row of *segments*: a system
prompt (shared by many sessions, or private), then, turn after turn, the user's message and the
model's previous answer. A block's id names every segment up to the block's end, so equal ids
mean an equal prefix.
"""

from __future__ import annotations

import attrs
import numpy as np

from phasesched.sim._checks import sample_count
from phasesched.sim._streams import as_dist, seed_streams
from phasesched.sim.arrivals import ArrivalProcess
from phasesched.sim.block_hashes import BlockHashes
from phasesched.sim.lengths import LengthDist
from phasesched.sim.workload import Workload
from phasesched.validators import number, whole

__all__ = ["SharedPrefixes", "shared_prefix"]

Segment = tuple[int, int]  # (segment id, tokens)


@attrs.frozen
class SharedPrefixes:
    """How the sessions of a :func:`shared_prefix` workload share their prompts.

    Attributes:
        system_prompt: Tokens of each system prompt.
        num_system_prompts: Distinct shared system prompts; a session picks one uniformly.
        share: Fraction of sessions that use a shared system prompt; the others get a private one.
        turns: Requests per session; turn ``k``'s prompt is the system prompt, then every earlier
            turn's message and answer, then its own message.
        think_s: Seconds between a session's turns (open loop: a turn may arrive before the
            previous answer is done, and then finds less of it cached).
        block_size: Tokens per named block (the page size is best, or a divisor of it).

    """

    system_prompt: int = attrs.field(default=1024, validator=whole(ge=0))
    num_system_prompts: int = attrs.field(default=1, validator=whole(gt=0))
    share: float = attrs.field(default=1.0, validator=number(ge=0.0, le=1.0))
    turns: int = attrs.field(default=1, validator=whole(gt=0))
    think_s: float = attrs.field(default=10.0, validator=number(ge=0.0))
    block_size: int = attrs.field(default=16, validator=whole(gt=0))


def _block_ids(segments: list[Segment], length: int, block: int) -> list[int]:
    """One id per block of a prompt made of ``segments``: a hash of every segment up to the block's end."""
    ids, done, start, k = [], [], 0, 0
    for end in range(block, length + block, block):
        end = min(end, length)  # noqa: PLW2901 -- the last block may be partial
        while k < len(segments) and start + segments[k][1] <= end:
            done.append(segments[k])
            start += segments[k][1]
            k += 1
        partial = (segments[k][0], end - start) if k < len(segments) and end > start else None
        ids.append(hash((tuple(done), partial)))
    return ids


def shared_prefix(  # noqa: PLR0913 -- the workload's ingredients plus seed and label
    num_sessions: int,
    arrivals: ArrivalProcess,
    message: int | LengthDist,
    output: int | LengthDist,
    sharing: SharedPrefixes | None = None,
    *,
    seed: int = 0,
    name: str | None = None,
) -> Workload:
    """Chat sessions sharing system prompts, each of ``sharing.turns`` requests, as block-hashed requests.

    Args:
        num_sessions: Sessions; their first turns arrive by ``arrivals``.
        arrivals: When sessions start.
        message: Tokens of each user message.
        output: Tokens of each answer (also the answer's share of the next turn's prompt).
        sharing: How prompts are shared (a 1024-token system prompt for all, one turn, by default).
        seed: Seeds arrivals, messages and answers.
        name: Label.

    Returns:
        ``num_sessions * turns`` requests in arrival order, with ``blocks``.

    >>> from phasesched.sim import Poisson
    >>> w = shared_prefix(4, Poisson(1.0), 32, 8, SharedPrefixes(system_prompt=64, turns=2))
    >>> len(w), int(w.prompt_len.min()) >= 64 + 32, w.blocks is not None
    (8, True, True)
    """
    sharing = sharing or SharedPrefixes()
    sessions, turns = sample_count(num_sessions), sharing.turns
    arrival_rng, message_rng, output_rng = seed_streams(seed)
    starts = arrivals.sample(arrival_rng, sessions)
    messages = as_dist(message).sample(message_rng, sessions * turns).reshape(sessions, turns)
    answers = as_dist(output).sample(output_rng, sessions * turns).reshape(sessions, turns)
    shared = arrival_rng.random(sessions) < sharing.share
    which = arrival_rng.integers(0, sharing.num_system_prompts, sessions)
    times, prompts, outputs, block_lists = [], [], [], []
    for s in range(sessions):
        system = -1 - int(which[s]) if shared[s] else 1 + s * (2 * turns + 1)  # shared ids < 0, private > 0
        segments: list[Segment] = [(system, sharing.system_prompt)] if sharing.system_prompt else []
        for t in range(turns):
            base = 1 + s * (2 * turns + 1) + 1 + 2 * t
            segments.append((base, int(messages[s, t])))
            length = sum(n for _, n in segments)
            times.append(float(starts[s]) + t * sharing.think_s)
            prompts.append(length)
            outputs.append(int(answers[s, t]))
            block_lists.append(_block_ids(segments, length, sharing.block_size))
            segments.append((base + 1, int(answers[s, t])))
    order = np.argsort(np.asarray(times), kind="stable")
    label = name or f"shared-prefix-n{sessions}x{turns}-seed{seed}"
    return Workload(
        label,
        np.asarray(times)[order],
        np.asarray(prompts)[order],
        np.asarray(outputs)[order],
        blocks=BlockHashes.from_lists(sharing.block_size, [block_lists[i] for i in order.tolist()]),
    )
