"""Prefill and decode workers of the P/D runtime: a scheduler, an executor and the protocol.

Each worker is one loop in its own process: take messages, advance transfers, run one step
of its :class:`~phasesched.Scheduler` on its executor, publish its status. The KV pages
themselves move through a :class:`PageTransport` (``phasesched_torch`` provides one over
``torch.distributed``); this module holds the scheduling half and needs no torch.

* A **prefill worker** runs each request with ``max_new_tokens=1`` and :meth:`Scheduler.hold_kv`:
  when the prompt is computed its pages stay held, it publishes a :class:`Manifest`, starts the
  send when the router names the decode worker, and releases the pages on the ``Ack``, a
  ``Nack`` (the decode side's pull failed or timed out), a ``Release`` from the router (the
  decode worker died, or the attempt was given up) or at shutdown (counted: a leak if any).
* A **decode worker** queues each request with ``precomputed_tokens=prompt_len - 1``: its
  scheduler admits it only when the whole prompt's pages fit (the reservation), and in that
  step, before the executor runs, the pages are pulled into the slots the plan gave them. The
  last prompt token is recomputed there, as the simulator assumes: its logits give the first
  token, so the first token comes from a step the decode worker runs (vLLM does the same when
  every prompt token's KV arrived). A failed pull aborts the attempt there and tells the router.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import RequestRejectedError
from phasesched.executor import Executor
from phasesched.pd.protocol import (
    Ack,
    Decode,
    Failed,
    Finished,
    Mailbox,
    Manifest,
    Message,
    Nack,
    Prefill,
    Pull,
    Pulled,
    Release,
    Sending,
    Shutdown,
    TransferFailed,
    worker_id,
)
from phasesched.pd.router import WorkerStatus
from phasesched.plan import StepPlan
from phasesched.request import FinishReason
from phasesched.scheduler import FinishedRequest, Scheduler

__all__ = [
    "DecodeWorker",
    "Faults",
    "Outgoing",
    "PageTransport",
    "PendingTransfer",
    "PrefillWorker",
    "TransferError",
    "TransferRecord",
    "WorkerReport",
]

Int32Array = NDArray[np.int32]


class TransferError(RuntimeError):
    """A page transfer failed: timed out, broke, or arrived with the wrong checksum."""


class PendingTransfer(Protocol):
    """A send or receive in flight."""

    def wait(self, timeout_s: float) -> None:
        """Wait for it to finish. Raises :class:`TransferError` on a timeout or a failure."""


class Outgoing(Protocol):
    """A request's held pages, packed for sending."""

    @property
    def nbytes(self) -> int:
        """Bytes to send."""

    @property
    def checksum(self) -> str:
        """Digest of the bytes."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The packed tensor's shape."""


class PageTransport(Protocol):
    """Moves packed KV pages between workers (``phasesched_torch.TorchPageTransport``)."""

    layout: str
    dtype: str

    def pack(self, pages: Int32Array, *, corrupt: bool = False) -> Outgoing:
        """Copy ``pages`` (token order) out of the cache; ``corrupt`` flips a byte after the checksum (a fault)."""

    def send(self, outgoing: Outgoing, dst: int, tag: int) -> PendingTransfer:
        """Start sending to rank ``dst`` under ``tag``."""

    def receive(self, manifest: Manifest, tag: int) -> PendingTransfer:
        """Post the receive for ``manifest``'s pages from its ``src_rank`` under ``tag``."""

    def unpack(self, pending: PendingTransfer, manifest: Manifest, pages: Int32Array) -> None:
        """Check a completed receive's checksum and write it into ``pages``; raises :class:`TransferError`."""


def _nothing() -> None:
    pass


def _ids(values: Iterable[str]) -> frozenset[str]:
    return frozenset(values)


@attrs.frozen
class Faults:
    """Faults a run injects on purpose (tests and drills). Request ids name the first attempt only.

    Attributes:
        drop_transfer: Prefill workers never send these requests' pages.
        corrupt_transfer: Prefill workers flip a byte of these requests' pages after the checksum.
        kill_rank: This worker kills itself (SIGKILL) after ``kill_after_steps`` non-empty steps.
        kill_after_steps: See ``kill_rank``.
        stall_rank: This worker stops answering (no messages, no status) after ``stall_after_steps`` steps.
        stall_after_steps: See ``stall_rank``.
        stall_s: How long it stays silent.

    """

    drop_transfer: frozenset[str] = attrs.field(default=frozenset(), converter=_ids)
    corrupt_transfer: frozenset[str] = attrs.field(default=frozenset(), converter=_ids)
    kill_rank: int = -1
    kill_after_steps: int = 0
    stall_rank: int = -1
    stall_after_steps: int = 0
    stall_s: float = 0.0


@attrs.frozen
class TransferRecord:
    """One completed pull, as the decode worker measured it."""

    request_id: str
    attempt: int
    nbytes: int
    num_pages: int
    seconds: float


@attrs.frozen
class WorkerReport:
    """What a worker reports when it exits: its end state, for the invariants checked after a run.

    Attributes:
        rank: Its rank.
        role: ``prefill`` or ``decode``.
        steps: Non-empty steps it ran.
        unfinished: Requests its scheduler still held at shutdown (aborted then; none on a live worker).
        held: KV holds still open at shutdown (released then; none on a live worker).
        leaked_pages: Pages still in use after that: a leak if not zero.
        invariant_error: The scheduler's invariant check's message, if it failed.
        transfers: Pulls it completed (decode workers).

    """

    rank: int
    role: str
    steps: int
    unfinished: int
    held: int
    leaked_pages: int
    invariant_error: str | None
    transfers: tuple[TransferRecord, ...] = ()


@attrs.define(eq=False)
class _Hold:
    request_id: str
    attempt: int
    outgoing: Outgoing
    sending: PendingTransfer | None = None


class _Worker:
    """What both roles share: the mailbox, the step, the status, the faults."""

    role = "worker"

    def __init__(  # noqa: PLR0913 -- the worker's parts
        self,
        rank: int,
        scheduler: Scheduler,
        executor: Executor,
        transport: PageTransport,
        mailbox: Mailbox,
        *,
        router_rank: int = 0,
        faults: Faults | None = None,
        transfer_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rank = rank
        self.scheduler = scheduler
        self.executor = executor
        self.transport = transport
        self.mailbox = mailbox
        self.router_rank = router_rank
        self.faults = faults or Faults()
        self.clock = clock
        self.transfer_timeout_s = transfer_timeout_s
        self.steps = 0
        self.status_seq = 0
        self.shutdown = False
        self.heartbeat: Callable[[], None] = _nothing
        """Publishes the status; the runtime sets it, and long waits call it so the worker stays alive."""

    def status(self) -> WorkerStatus:
        """The heartbeat of this worker: bump the sequence, report the KV room."""
        self.status_seq += 1
        kv = self.scheduler.kv
        return WorkerStatus(self.status_seq, kv.num_free_pages, kv.watermark_pages, kv.page_size)

    def handle_all(self, messages: list[Message]) -> None:
        """Apply messages in order."""
        for message in messages:
            if isinstance(message, Shutdown):
                self.shutdown = True
            else:
                self.handle(message)

    def handle(self, message: Message) -> None:
        """Apply one message (per role)."""
        raise NotImplementedError

    def poll(self) -> None:
        """Advance transfers in flight (per role)."""

    def step(self) -> bool:
        """Run one scheduler step if there is work; whether one ran."""
        if not self.scheduler.num_unfinished:
            return False
        now = self.clock()
        plan = self.scheduler.schedule(now)
        if plan.is_empty:
            self.scheduler.update(plan, self.executor.execute(plan))
            return False
        self.before_execute(plan, now)
        result = self.executor.execute(plan)
        outcome = self.scheduler.update(plan, result)
        self.after_update(plan, outcome.finished, self.clock())
        self.steps += 1
        self._inject_faults()
        return True

    def before_execute(self, plan: StepPlan, now: float) -> None:
        """Per role: what happens between scheduling and executing a step."""

    def after_update(self, plan: StepPlan, finished: tuple[FinishedRequest, ...], now: float) -> None:
        """Per role: what happens after a step's update."""

    def report(self) -> WorkerReport:
        """Say what was left at shutdown, abort and release it, and check that no page leaked."""
        scheduler = self.scheduler
        unfinished, held = scheduler.num_unfinished, len(scheduler.held_request_ids)
        if scheduler.plan_in_flight is None:
            for request_id in [*scheduler.running_request_ids(), *scheduler.waiting_request_ids()]:
                scheduler.abort(request_id)
        for request_id in scheduler.held_request_ids:
            scheduler.release_kv(request_id)
        error = None
        try:
            scheduler.check_invariants()
        except AssertionError as exc:
            error = str(exc) or "invariant failed"
        leaked = scheduler.kv.num_used_pages
        return WorkerReport(self.rank, self.role, self.steps, unfinished, held, leaked, error, self.transfers())

    def transfers(self) -> tuple[TransferRecord, ...]:
        """Pulls completed (decode workers)."""
        return ()

    def stall_now(self) -> float:
        """Seconds to stay silent now (a fault), else 0."""
        faults = self.faults
        if faults.stall_rank == self.rank and self.steps == faults.stall_after_steps and faults.stall_s > 0:
            self.faults = attrs.evolve(faults, stall_rank=-1)
            return faults.stall_s
        return 0.0

    def _inject_faults(self) -> None:
        faults = self.faults
        if faults.kill_rank == self.rank and self.steps >= faults.kill_after_steps:
            os.kill(os.getpid(), signal.SIGKILL)


class PrefillWorker(_Worker):
    """Prefills prompts and serves their KV to decode workers. See the module docstring.

    It never times a hold out itself: the decode side's pull has a timeout (then it sends a
    ``Nack``) and the router watches the decode side's liveness (then it sends a ``Release``),
    so a request queued behind others on a busy decode worker keeps its pages here, as
    back-pressure, for as long as it waits.
    """

    role = "prefill"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holds: dict[str, _Hold] = {}
        self._attempts: dict[str, tuple[str, int]] = {}
        self._first_step: dict[str, float] = {}
        self._graveyard: list[Outgoing] = []  # sends given up on: their buffers must outlive the transport

    def handle(self, message: Message) -> None:
        """Prefill, pull, ack, nack and release messages."""
        if isinstance(message, Prefill):
            self._prefill(message)
        elif isinstance(message, Pull):
            self._serve(message)
        elif isinstance(message, Ack):
            self._release(worker_id(message.request_id, message.attempt), acked=True)
        elif isinstance(message, Nack | Release):
            self._release(worker_id(message.request_id, message.attempt))

    def _prefill(self, message: Prefill) -> None:
        request = message.request
        wid = worker_id(request.request_id, message.attempt)
        local = attrs.evolve(request, request_id=wid, max_new_tokens=1, arrival_time=0.0)
        try:
            self.scheduler.add_request(local)
        except RequestRejectedError as error:
            self.mailbox.send(self.router_rank, Failed(request.request_id, message.attempt, self.rank, str(error)))
            return
        self.scheduler.hold_kv(wid)
        self._attempts[wid] = (request.request_id, message.attempt)

    def _serve(self, message: Pull) -> None:
        wid = worker_id(message.request_id, message.attempt)
        hold = self.holds.get(wid)
        if hold is None or hold.sending is not None:
            return  # released already (the decode side times out and says so)
        now = self.clock()
        if now > message.deadline:
            return  # the decode side has given up already: a send now would never be received
        if message.attempt == 0 and message.request_id in self.faults.drop_transfer:
            return  # a dropped transfer: nothing is sent
        try:
            hold.sending = self.transport.send(hold.outgoing, message.dst_rank, message.tag)
        except TransferError:
            return  # the decode worker is gone: it times out or the router releases the pages
        self.mailbox.send(message.dst_rank, Sending(message.request_id, message.attempt, message.tag))

    def _release(self, wid: str, *, acked: bool = False) -> None:
        hold = self.holds.pop(wid, None)
        if hold is None:
            return
        if hold.sending is not None:
            try:
                if not acked:
                    raise TransferError  # noqa: TRY301 -- not known to have arrived: keep its buffer
                hold.sending.wait(self.transfer_timeout_s)  # received already: returns at once
            except TransferError:
                self._graveyard.append(hold.outgoing)
        self.scheduler.release_kv(wid)

    def before_execute(self, plan: StepPlan, now: float) -> None:
        """Note when each prompt's first step starts (its queue time ends)."""
        for request in plan.new_requests:
            self._first_step.setdefault(request.request_id, now)

    def after_update(self, plan: StepPlan, finished: tuple[FinishedRequest, ...], now: float) -> None:
        """Publish the manifest of every prompt just computed; its pages stay held."""
        del plan
        for record in finished:
            wid = record.request_id
            request_id, attempt = self._attempts.pop(wid)
            start = self._first_step.pop(wid, now)
            if record.reason is FinishReason.ABORTED:
                continue
            held = self.scheduler.held_kv(wid)
            corrupt = attempt == 0 and request_id in self.faults.corrupt_transfer
            outgoing = self.transport.pack(held.pages, corrupt=corrupt)
            self.holds[wid] = _Hold(request_id, attempt, outgoing)
            manifest = Manifest(
                request_id=request_id,
                attempt=attempt,
                src_rank=self.rank,
                num_tokens=held.num_tokens,
                num_pages=len(held.pages),
                page_size=self.scheduler.kv.page_size,
                layout=self.transport.layout,
                dtype=self.transport.dtype,
                shape=outgoing.shape,
                nbytes=outgoing.nbytes,
                checksum=outgoing.checksum,
                prefill_start=start,
                prefill_end=now,
            )
            self.mailbox.send(self.router_rank, manifest)


class DecodeWorker(_Worker):
    """Admits transferred requests, pulls their KV and decodes them. See the module docstring.

    A pull may take ``transfer_timeout_s`` (the prefill side's answer included).
    """

    role = "decode"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pull_timeout_s = self.transfer_timeout_s
        self._pending: dict[str, tuple[Manifest, int, bool]] = {}
        self._sending: set[Sending] = set()
        self._first_token: dict[str, float] = {}
        self._failed: set[str] = set()
        self._records: list[TransferRecord] = []
        self._graveyard: list[PendingTransfer] = []  # receives given up on: their buffers must outlive them
        self._later: list[Message] = []  # messages that came while a pull waited for its Sending

    def handle_all(self, messages: list[Message]) -> None:
        """Apply messages in order, those put aside during a pull first."""
        later, self._later = self._later, []
        super().handle_all(later + messages)

    def handle(self, message: Message) -> None:
        """Queue transferred requests; note sends started for them."""
        if isinstance(message, Sending):
            self._sending.add(message)
        if not isinstance(message, Decode):
            return
        manifest, request = message.manifest, message.request
        wid = worker_id(request.request_id, manifest.attempt)
        local = attrs.evolve(request, request_id=wid, arrival_time=0.0)
        try:
            self.scheduler.add_request(local, precomputed_tokens=request.prompt_len - 1)
        except RequestRejectedError as error:
            self.mailbox.send(manifest.src_rank, Nack(request.request_id, manifest.attempt, str(error)))
            self.mailbox.send(self.router_rank, Failed(request.request_id, manifest.attempt, self.rank, str(error)))
            return
        self._pending[wid] = (manifest, message.tag, message.eager)

    def before_execute(self, plan: StepPlan, now: float) -> None:
        """Pull the KV of every request admitted in this step into the pages the plan gave it."""
        del now
        for request in plan.new_requests:
            pending = self._pending.pop(request.request_id, None)
            if pending is not None:  # a readmission after a preemption recomputes instead
                self._pull(plan, request.request_id, *pending)

    def _pull(self, plan: StepPlan, wid: str, manifest: Manifest, tag: int, eager: bool) -> None:
        i = plan.request_ids.index(wid)
        pages = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]]
        request_id, attempt, src = manifest.request_id, manifest.attempt, manifest.src_rank
        start = self.clock()
        try:
            if len(pages) != manifest.num_pages:
                msg = f"{manifest.num_pages} pages sent, {len(pages)} reserved"
                raise TransferError(msg)  # noqa: TRY301 -- one failure path for every cause
            deadline = start + self.pull_timeout_s
            if not eager:
                self.mailbox.send(src, Pull(request_id, attempt, self.rank, tag, deadline))
            self._await_sending(Sending(request_id, attempt, tag), deadline)
            pending = self.transport.receive(manifest, tag)
            try:
                pending.wait(max(deadline - self.clock(), 0.0) + self.pull_timeout_s)
            except TransferError:
                self._graveyard.append(pending)
                raise
            self.transport.unpack(pending, manifest, pages)
        except TransferError as error:
            self.scheduler.abort(wid)  # in the plan: retired, its token dropped, at this step's update
            self._failed.add(wid)
            reason = f"pull by decode worker {self.rank} from prefill worker {src} failed: {error}"
            self.mailbox.send(src, Nack(request_id, attempt, reason))
            self.mailbox.send(self.router_rank, TransferFailed(request_id, attempt, self.rank, reason))
            return
        end = self.clock()
        self.mailbox.send(src, Ack(request_id, attempt))
        self.mailbox.send(self.router_rank, Pulled(request_id, attempt, self.rank, start, end))
        self._records.append(TransferRecord(request_id, attempt, manifest.nbytes, manifest.num_pages, end - start))

    def _await_sending(self, expected: Sending, deadline: float) -> None:
        """Wait in the mailbox for the prefill side's ``Sending``, putting other messages aside."""
        while True:
            if expected in self._sending:
                self._sending.discard(expected)
                return
            if self.clock() >= deadline:
                break
            for message in self.mailbox.receive():
                if isinstance(message, Sending):
                    self._sending.add(message)
                else:
                    self._later.append(message)
            self.heartbeat()
            time.sleep(0.001)
        msg = f"no answer from the prefill worker within {self.pull_timeout_s} s"
        raise TransferError(msg)

    def after_update(self, plan: StepPlan, finished: tuple[FinishedRequest, ...], now: float) -> None:
        """Note first tokens; report finished requests to the router (failed pulls were reported already)."""
        for i in plan.samples.nonzero()[0].tolist():
            self._first_token.setdefault(plan.request_ids[i], now)
        for record in finished:
            wid = record.request_id
            first = self._first_token.pop(wid, now)
            if wid in self._failed:
                self._failed.discard(wid)
                continue
            request_id, _, attempt = wid.rpartition("@")
            self.mailbox.send(
                self.router_rank,
                Finished(
                    request_id=request_id,
                    attempt=int(attempt),
                    rank=self.rank,
                    reason=record.reason.value,
                    output_token_ids=tuple(record.output_token_ids or ()),
                    first_token_time=first,
                    finish_time=now,
                    num_preemptions=record.num_preemptions,
                ),
            )

    def transfers(self) -> tuple[TransferRecord, ...]:
        """Pulls completed."""
        return tuple(self._records)
