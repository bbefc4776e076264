"""A request's progress while the scheduler holds it (internal; policies see views of it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from phasesched.request import Request, RequestStatus

if TYPE_CHECKING:
    from phasesched.kv import PagedKVManager

__all__ = ["SequenceState"]


@attrs.define(eq=False)
class SequenceState:
    """Progress of one request the scheduler holds (internal; policies see views of it)."""

    request: Request
    queue_key: Any
    status: RequestStatus = RequestStatus.WAITING
    outputs: list[int] | None = None
    """Generated token ids, for requests that carry ids (synced from the token buffer when it
    stops running; while it runs, the buffer is authoritative)."""
    num_generated: int = 0
    num_preemptions: int = 0
    slot: int = -1
    arrival_order: int = -1
    """Its place among requests with equal queue keys, fixed when it is first queued."""
    precomputed: int = 0
    """Leading prompt tokens whose KV arrives with the request (a disaggregated prefill's
    transfer); lost, and recomputed locally, if the request is preempted."""
    hold_kv: bool = False
    """Keep its KV pages held when it finishes, until released (a disaggregated prefill)."""
    prompt_ids: Any = None
    """The prompt's token ids as a read-only int32 array, made once when it is queued (``None``
    for a length-only request): loading it into the token buffer at each admission is a copy."""
    page_hashes: list[int] = attrs.Factory(list)
    """Content hashes of its full pages known so far (prefix caching only): the prompt's from
    the start, generated ones as their pages fill."""

    def claimable_hashes(self, page_size: int) -> list[int]:
        """Hashes of the pages it could claim from the prefix cache on admission.

        At least one token is always left to compute, whose logits give the next token (as
        vLLM does when a whole prompt is cached); a request bringing transferred KV claims nothing.
        """
        if self.precomputed:
            return []
        return self.page_hashes[: (self.num_tokens - 1) // page_size]

    def cached_pages(self, kv: PagedKVManager) -> int:
        """Pages of its prefix it would claim from ``kv``'s prefix cache if admitted now.

        A request without page hashes (length-only, as in a simulation) has nothing to look up.
        """
        if not self.page_hashes:
            return 0
        return kv.cached_prefix(self.claimable_hashes(kv.page_size), self.num_tokens)

    def tokens_at_admission(self, kv: PagedKVManager) -> int:
        """Tokens it would start with if admitted now: transferred, or its cached prefix."""
        return self.precomputed or self.cached_pages(kv) * kv.page_size

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt plus generated."""
        return self.request.prompt_len + self.num_generated
