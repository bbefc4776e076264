"""The P/D router: where each request prefills and decodes, and what happens when that fails.

The router is a plain state machine (no I/O): the runtime feeds it messages, worker statuses
and the time, and sends the messages it returns. It places arrivals on prefill workers and
finished prompts on decode workers by :func:`phasesched.pd.routing.pick_worker`, the
simulator's rule. A request ends exactly once: finished (its tokens as one decode worker
reported them) or failed with a reason. A failed transfer or a worker that stops publishing
its status costs the request an attempt: it is prefilled again elsewhere, up to
``max_attempts``, and the prefill worker holding its pages is told to release them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from phasesched.pd.protocol import (
    Decode,
    Failed,
    Finished,
    Manifest,
    Message,
    Prefill,
    Pull,
    Pulled,
    Release,
    Shutdown,
    TransferFailed,
)
from phasesched.pd.routing import WorkerLoad, pick_worker
from phasesched.request import Request

__all__ = ["RequestOutcome", "RequestState", "Router", "WorkerStatus"]

Outbox = list[tuple[int, Message]]


@attrs.frozen
class WorkerStatus:
    """What a worker publishes about itself, often (its heartbeat: ``seq`` grows while it lives)."""

    seq: int
    free_pages: int
    watermark_pages: int
    page_size: int


class RequestState(enum.Enum):
    """Where a request stands in the router: not yet routed, prefilling, decoding, or ended."""

    PENDING = "pending"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    FAILED = "failed"


@attrs.define
class RequestOutcome:
    """One request's life as the router saw it (wall-clock times in seconds).

    Attributes:
        request: The request.
        state: ``finished`` or ``failed`` at the end of a run.
        attempt: Its last attempt (0 when it never failed).
        errors: Why each failed attempt failed.
        arrival: When it was routed.
        manifest: Its last attempt's manifest (prefill timing, bytes).
        pulled: Its last attempt's transfer timing.
        finished: What its decode worker reported.

    """

    request: Request
    state: RequestState = RequestState.PENDING
    attempt: int = 0
    prefill_rank: int = -1
    decode_rank: int = -1
    errors: list[str] = attrs.Factory(list)
    arrival: float = 0.0
    manifest: Manifest | None = None
    pulled: Pulled | None = None
    finished: Finished | None = None

    @property
    def done(self) -> bool:
        """Whether it ended (finished or failed)."""
        return self.state in (RequestState.FINISHED, RequestState.FAILED)


@attrs.define
class _Liveness:
    seq: int = -1
    changed: float = 0.0


class Router:
    """Routes requests through prefill and decode workers. See the module docstring.

    Args:
        requests: The run's requests; ``arrival_time`` is seconds after ``start``.
        prefill_ranks: Ranks of the prefill workers.
        decode_ranks: Ranks of the decode workers.
        start: The clock's time at the run's start.
        max_attempts: Attempts per request before it fails.
        peer_timeout_s: A worker whose status has not changed for this long is dead.
        eager_send: Order the send when the request is placed (gloo); otherwise the decode
            worker pulls when it admits the request, one pull at a time (NCCL, which ignores tags).

    """

    def __init__(  # noqa: PLR0913 -- the router's knobs
        self,
        requests: Iterable[Request],
        prefill_ranks: Iterable[int],
        decode_ranks: Iterable[int],
        *,
        start: float,
        max_attempts: int = 3,
        peer_timeout_s: float = 5.0,
        eager_send: bool = True,
    ) -> None:
        self.outcomes = {r.request_id: RequestOutcome(r) for r in requests}
        self._arrivals = sorted(self.outcomes.values(), key=lambda o: (o.request.arrival_time, o.request.request_id))
        self._next_arrival = 0
        self.prefill_ranks = tuple(prefill_ranks)
        self.decode_ranks = tuple(decode_ranks)
        self.start = start
        self.max_attempts = max_attempts
        self.peer_timeout_s = peer_timeout_s
        self.dead: set[int] = set()
        self._status: dict[int, WorkerStatus] = {}
        self._liveness = {rank: _Liveness(changed=start) for rank in (*self.prefill_ranks, *self.decode_ranks)}
        self._load = dict.fromkeys(self._liveness, 0)
        self._shutdown_sent = False
        self._tag = 0  # one per transfer: tags never repeat within a pair of ranks
        self.eager_send = eager_send

    # ---------------------------------------------------------------- queries
    @property
    def done(self) -> bool:
        """Whether every request has ended."""
        return all(o.done for o in self.outcomes.values())

    @property
    def alive_ranks(self) -> tuple[int, ...]:
        """Workers not declared dead."""
        return tuple(r for r in self._liveness if r not in self.dead)

    # ---------------------------------------------------------------- inputs
    def tick(self, now: float, statuses: dict[int, WorkerStatus]) -> Outbox:
        """Take in worker statuses, declare silent workers dead, release due arrivals, and shut down when done."""
        out: Outbox = []
        for rank, status in statuses.items():
            live = self._liveness[rank]
            if status.seq != live.seq:
                live.seq, live.changed = status.seq, now
                self._status[rank] = status
        for rank, live in self._liveness.items():
            if rank not in self.dead and now - live.changed > self.peer_timeout_s:
                out += self._declare_dead(rank, now)
        while self._next_arrival < len(self._arrivals):
            outcome = self._arrivals[self._next_arrival]
            if self.start + outcome.request.arrival_time > now:
                break
            self._next_arrival += 1
            outcome.arrival = now
            out += self._to_prefill(outcome, now)
        if self.done and not self._shutdown_sent:
            self._shutdown_sent = True
            out += [(rank, Shutdown()) for rank in self._liveness]
        return out

    def on_message(self, message: Message, now: float) -> Outbox:
        """Apply one worker's message; return what to send."""
        outcome = self.outcomes.get(getattr(message, "request_id", ""))
        if outcome is None:
            return []
        current = getattr(message, "attempt", -1) == outcome.attempt and not outcome.done
        if isinstance(message, Manifest):
            if not current or outcome.state is not RequestState.PREFILL:
                return [(message.src_rank, Release(message.request_id, message.attempt))]
            return self._to_decode(outcome, message, now)
        if not current:
            return []
        if isinstance(message, Pulled):
            outcome.pulled = message
        elif isinstance(message, Finished):
            outcome.finished = message
            self._end(outcome, RequestState.FINISHED)
        elif isinstance(message, TransferFailed):
            return self._retry(outcome, f"attempt {outcome.attempt}: {message.reason}", now)
        elif isinstance(message, Failed):
            outcome.errors.append(f"attempt {outcome.attempt}: {message.reason}")
            self._end(outcome, RequestState.FAILED)
        return []

    # ---------------------------------------------------------------- internals
    def _pick(self, ranks: tuple[int, ...], num_tokens: int) -> int | None:
        alive = [r for r in ranks if r not in self.dead]
        if not alive:
            return None
        loads = []
        for rank in alive:
            status = self._status.get(rank)
            free = status.free_pages if status else 1 << 30
            loads.append(
                WorkerLoad(
                    rank,
                    self._load[rank],
                    free,
                    status.watermark_pages if status else 0,
                    status.page_size if status else 16,
                )
            )
        return pick_worker(loads, num_tokens)

    def _to_prefill(self, outcome: RequestOutcome, now: float) -> Outbox:
        rank = self._pick(self.prefill_ranks, outcome.request.prompt_len)
        if rank is None:
            outcome.errors.append(f"attempt {outcome.attempt}: no live prefill worker")
            self._end(outcome, RequestState.FAILED)
            return []
        outcome.state, outcome.prefill_rank, outcome.decode_rank = RequestState.PREFILL, rank, -1
        outcome.manifest = outcome.pulled = None
        self._load[rank] += 1
        del now
        return [(rank, Prefill(outcome.request, outcome.attempt))]

    def _to_decode(self, outcome: RequestOutcome, manifest: Manifest, now: float) -> Outbox:
        self._load[outcome.prefill_rank] -= 1
        outcome.manifest = manifest
        rank = self._pick(self.decode_ranks, outcome.request.prompt_len)
        if rank is None:
            outcome.state = RequestState.DECODE  # so _retry releases the pages
            return self._retry(outcome, f"attempt {outcome.attempt}: no live decode worker", now)
        outcome.state, outcome.decode_rank = RequestState.DECODE, rank
        self._load[rank] += 1
        self._tag += 1
        request_id, attempt = manifest.request_id, manifest.attempt
        out: Outbox = [(rank, Decode(outcome.request, manifest, self._tag, eager=self.eager_send))]
        if self.eager_send:
            out.append((manifest.src_rank, Pull(request_id, attempt, rank, self._tag, float("inf"))))
        return out

    def _retry(self, outcome: RequestOutcome, reason: str, now: float) -> Outbox:
        """End this attempt (releasing held pages); start the next, or fail the request."""
        out: Outbox = []
        if outcome.state is RequestState.PREFILL:
            self._load[outcome.prefill_rank] -= 1
        if outcome.state is RequestState.DECODE:
            if outcome.decode_rank >= 0:
                self._load[outcome.decode_rank] -= 1
            if outcome.prefill_rank not in self.dead:
                out.append((outcome.prefill_rank, Release(outcome.request.request_id, outcome.attempt)))
        outcome.errors.append(reason)
        outcome.state = RequestState.PENDING
        if outcome.attempt + 1 >= self.max_attempts:
            outcome.errors.append(f"gave up after {self.max_attempts} attempts")
            self._end(outcome, RequestState.FAILED)
            return out
        outcome.attempt += 1
        return out + self._to_prefill(outcome, now)

    def _declare_dead(self, rank: int, now: float) -> Outbox:
        self.dead.add(rank)
        out: Outbox = []
        for outcome in self.outcomes.values():
            if outcome.state is RequestState.PREFILL and outcome.prefill_rank == rank:
                out += self._retry(outcome, f"attempt {outcome.attempt}: prefill worker {rank} stopped answering", now)
            elif outcome.state is RequestState.DECODE and outcome.decode_rank == rank:
                out += self._retry(outcome, f"attempt {outcome.attempt}: decode worker {rank} stopped answering", now)
        return out

    def _end(self, outcome: RequestOutcome, state: RequestState) -> None:
        if outcome.state is RequestState.DECODE and outcome.decode_rank >= 0:
            self._load[outcome.decode_rank] -= 1
        elif outcome.state is RequestState.PREFILL:
            self._load[outcome.prefill_rank] -= 1
        outcome.state = state
