"""The P/D transfer protocol's messages, and the mailbox they travel in.

The protocol (one request, one attempt)::

    router --Prefill--> P           P prefills (its pages are held when the prompt is done)
    P --Manifest--> router          request, pages, layout, dtype, token count, checksum
    router --Decode--> D            D queues the request; its scheduler admits it only with room
    router --Pull--> P              P starts the send to D (torch.distributed isend, under a tag)
    P --Sending--> D                the bytes wait for D's receive (no byte moves before it)
    D: admitted (pages reserved)    D posts the receive: one tensor, pages in token order
    D --Ack--> P, D --Pulled--> router      after the checksum matched; P releases its pages
    D --Finished--> router          the generated tokens, once

The router orders the send as soon as it places the request, so the prefill worker (which
serves sends between its own steps) has usually posted it before the decode worker admits the
request: the pull then costs the decode worker the receive alone, not a wait for a prefill step.

D waits for ``Sending`` in its mailbox, with its own timeout, before it posts the receive, so
a receive is only ever posted for bytes already on their way (gloo closes the connection to a
peer when a receive times out). A failed pull (timeout, checksum) sends ``Nack`` to P and
``TransferFailed`` to the router, which re-prefills the request or fails it with the reason.
Every message names the request's attempt: a late message of an earlier attempt is
recognised and only ever releases pages.

Messages travel through a :class:`Mailbox`: per receiving rank, an ordered queue of keys in a
key-value store that every process reaches (``torch.distributed.TCPStore`` in the runtime; any
object with its five methods in tests).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Protocol

import attrs

from phasesched.request import Request

__all__ = [
    "Ack",
    "Decode",
    "Failed",
    "Finished",
    "KeyValueStore",
    "Mailbox",
    "Manifest",
    "Message",
    "Nack",
    "Prefill",
    "Pull",
    "Pulled",
    "Release",
    "Sending",
    "Shutdown",
    "TransferFailed",
    "worker_id",
]


def worker_id(request_id: str, attempt: int) -> str:
    """The id a worker's scheduler knows an attempt by (so attempts never collide on a worker)."""
    return f"{request_id}@{attempt}"


@attrs.frozen
class Manifest:
    """What a prefill worker publishes when a prompt's KV is ready to be pulled.

    Attributes:
        request_id: The request.
        attempt: Which attempt of it (0 first).
        src_rank: The prefill worker holding the pages.
        num_tokens: Tokens whose KV the pages hold (the whole prompt).
        num_pages: Pages, in token order.
        page_size: Tokens per page.
        layout: The cache layout of each page (``"NHD"``).
        dtype: The KV dtype's name (``"float32"``).
        shape: The shape of the tensor sent: ``[num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]``.
        nbytes: Bytes sent.
        checksum: BLAKE2b hex digest of the bytes sent.
        prefill_start: Wall-clock time the prompt's first step started.
        prefill_end: Wall-clock time its last step ended.

    """

    request_id: str
    attempt: int
    src_rank: int
    num_tokens: int
    num_pages: int
    page_size: int
    layout: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    prefill_start: float
    prefill_end: float


@attrs.frozen
class Prefill:
    """Router to a prefill worker: prefill this attempt of the request."""

    request: Request
    attempt: int


@attrs.frozen
class Decode:
    """Router to a decode worker: queue the request; receive its KV under ``tag`` when admitted.

    ``eager``: the router has told the prefill worker to send already; otherwise the decode
    worker sends the ``Pull`` itself when it admits the request (transports that ignore tags,
    as NCCL does, then receive in the order the sends were posted).
    """

    request: Request
    manifest: Manifest
    tag: int
    eager: bool = True


@attrs.frozen
class Pull:
    """Router (or decode worker) to prefill worker: send the pages to ``dst_rank`` under ``tag``.

    Unless past ``deadline`` (wall clock): the decode worker has given up on them then.
    """

    request_id: str
    attempt: int
    dst_rank: int
    tag: int
    deadline: float


@attrs.frozen
class Sending:
    """Prefill to decode worker: the pages are on their way under ``tag``; post the receive."""

    request_id: str
    attempt: int
    tag: int


@attrs.frozen
class Ack:
    """Decode to prefill worker: the pages arrived whole; release them."""

    request_id: str
    attempt: int


@attrs.frozen
class Nack:
    """Decode to prefill worker: the pull failed; release the pages (the router decides what next)."""

    request_id: str
    attempt: int
    reason: str


@attrs.frozen
class Release:
    """Router to a prefill worker: release this attempt's pages if still held (idempotent)."""

    request_id: str
    attempt: int


@attrs.frozen
class Pulled:
    """Decode worker to router: the KV of this attempt arrived (for the timeline)."""

    request_id: str
    attempt: int
    rank: int
    pull_start: float
    pull_end: float


@attrs.frozen
class TransferFailed:
    """A worker to the router: this attempt's KV did not make it; ``reason`` says why."""

    request_id: str
    attempt: int
    rank: int
    reason: str


@attrs.frozen
class Failed:
    """A worker to the router: this attempt cannot be served at all (a rejection): do not retry."""

    request_id: str
    attempt: int
    rank: int
    reason: str


@attrs.frozen
class Finished:
    """Decode worker to router: the attempt finished; its generated tokens and first-token time."""

    request_id: str
    attempt: int
    rank: int
    reason: str
    output_token_ids: tuple[int, ...]
    first_token_time: float
    finish_time: float
    num_preemptions: int


@attrs.frozen
class Shutdown:
    """Router to every worker: finish up (release, check, report) and exit."""


Message = (
    Prefill
    | Decode
    | Pull
    | Sending
    | Ack
    | Nack
    | Release
    | Pulled
    | TransferFailed
    | Failed
    | Finished
    | Shutdown
    | Manifest
)


class KeyValueStore(Protocol):
    """The part of ``torch.distributed.Store`` the mailbox uses."""

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""

    def get(self, key: str) -> bytes:
        """The value under ``key`` (waits for it up to the store's timeout)."""

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to the counter ``key`` and return the new count."""

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists, without waiting."""

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""


class Mailbox:
    """Ordered message queues in a shared store, one per rank.

    A sender claims the next sequence number of the receiver's queue (an atomic ``add``) and
    writes the message under it; the receiver reads its keys in order and deletes them. A
    sequence number whose message never appears (its sender died between the two writes) is
    skipped after ``gap_timeout_s``.

    Args:
        store: The shared store.
        rank: This process's rank (the queue it reads).
        clock: Seconds, for the gap timeout.
        gap_timeout_s: How long a claimed but unwritten message is waited for.

    """

    def __init__(
        self,
        store: KeyValueStore,
        rank: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        gap_timeout_s: float = 5.0,
    ) -> None:
        self._store = store
        self._rank = rank
        self._head = 0
        self._clock = clock
        self._gap_timeout_s = gap_timeout_s
        self._gap_since: float | None = None

    def send(self, rank: int, message: Message) -> None:
        """Append ``message`` to ``rank``'s queue."""
        number = self._store.add(f"pd/mb/{rank}/tail", 1)
        self._store.set(f"pd/mb/{rank}/{number}", pickle.dumps(message))

    def receive(self, limit: int = 64) -> list[Message]:
        """The next messages to this rank, in order, without waiting (at most ``limit``)."""
        messages: list[Message] = []
        while len(messages) < limit:
            key = f"pd/mb/{self._rank}/{self._head + 1}"
            if not self._store.check([key]):
                if not self._skip_gap():
                    break
                continue
            self._gap_since = None
            data = self._store.get(key)
            self._store.delete_key(key)
            self._head += 1
            messages.append(pickle.loads(data))  # noqa: S301 -- written by this job's own processes
        return messages

    def _skip_gap(self) -> bool:
        """Skip a claimed sequence number whose message has not appeared for ``gap_timeout_s``."""
        tail = self._store.add(f"pd/mb/{self._rank}/tail", 0)
        if tail <= self._head:
            self._gap_since = None
            return False
        now = self._clock()
        if self._gap_since is None:
            self._gap_since = now
            return False
        if now - self._gap_since < self._gap_timeout_s:
            return False
        self._head += 1
        self._gap_since = None
        return True
