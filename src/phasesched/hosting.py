"""Policies hosted by any engine: the view a policy reads, and one call that returns its proposal.

A :class:`~phasesched.policies.SchedulingPolicy` never needs phasesched's own
:class:`~phasesched.scheduler.Scheduler`. A host (our scheduler, or another engine's scheduler
such as the vLLM adapter in ``integrations/vllm``) describes its state as a :class:`PolicyView`,
calls :func:`propose`, and gets back a :class:`~phasesched.selection.Selection` that has been
checked against that same view: which running requests compute how many tokens, which waiting
requests are admitted with how many, and which running requests are preempted. The host then
applies it with its own KV manager and request objects.

**Prefix caching.** A host with a prefix cache describes each waiting request with the tokens
it would claim from that cache if admitted now (:attr:`WaitingCandidate.num_computed
<phasesched.waiting.WaitingCandidate.num_computed>`), as phasesched's scheduler does: the
policies then count only uncached tokens against the budget and the chunk, and :func:`propose`
re-ranks the queue by the policy's cache-aware order (:class:`~phasesched.policies.CacheAwareOrder`)
itself, so a host only lists its waiting requests in the order's fixed key order.

:class:`ArrayView` is a ready-made view over plain arrays, for hosts that keep their state
elsewhere: slot ``i`` is the ``i``-th running request.

>>> import numpy as np
>>> from phasesched import Request, load_policy
>>> from phasesched.waiting import WaitingCandidate
>>> policy = load_policy("vllm")
>>> view = ArrayView(
...     budget=policy.budget, page_size=16, free_pages=10,
...     num_computed=np.array([20], np.int32), num_tokens=np.array([21], np.int32),
...     prompt_len=np.array([20], np.int32), requests=[Request("a", prompt_len=20)],
...     waiting=lambda: iter([WaitingCandidate(Request("b", prompt_len=30), 30, 0)]),
... )
>>> selection = propose(policy, view)
>>> selection.running_tokens.tolist(), selection.admitted, selection.admitted_tokens
([1], ('b',), (30,))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidPlanError
from phasesched.policies.builder import BatchBuilder
from phasesched.policies.queue_order import CacheAwareOrder, rerank
from phasesched.request import Request
from phasesched.selection import Selection
from phasesched.waiting import WaitingCandidate

if TYPE_CHECKING:
    from phasesched.policies.budget import TokenBudget
    from phasesched.policies.policy import SchedulingPolicy
    from phasesched.view import SchedulerView

__all__ = ["ArrayView", "PolicyView", "check_proposal", "propose"]

Int32Array = NDArray[np.int32]


@runtime_checkable
class PolicyView(Protocol):
    """What a policy may read while planning a step, whoever hosts it.

    :class:`~phasesched.view.SchedulerView` (phasesched's scheduler) and :class:`ArrayView`
    (other engines) implement it. Per-slot arrays have one entry per slot and are read-only;
    ``running`` lists the slots in use, in admission order.
    """

    now: float
    budget: TokenBudget
    page_size: int
    free_pages: int
    watermark_pages: int
    max_model_len: int
    running: Int32Array
    num_computed: Int32Array
    num_tokens: Int32Array
    prompt_len: Int32Array
    arrival_time: NDArray[np.float64]
    priority: NDArray[np.int64]
    page_count: Int32Array

    @property
    def num_generated(self) -> Int32Array:
        """int32 ``[S]``: generated tokens of each slot."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests waiting."""
        ...

    def request(self, slot: int) -> Request:
        """The request running in ``slot``."""
        ...

    def waiting(self) -> Iterator[WaitingCandidate]:
        """Waiting requests in queue order, lazily."""
        ...

    def freed_by_preempting(self, slots: Int32Array) -> int:
        """KV pages that preempting ``slots`` (int32 ``[K]``) would return to the pool."""
        ...

    def pages_to_grow(self, slots: Int32Array, num_new: NDArray[np.integer[Any]]) -> NDArray[np.int64]:
        """int64 ``[K]``: pages each of ``slots`` must add to compute ``num_new`` more tokens."""
        ...

    def pages_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens occupy."""
        ...


def _read_only(values: Sequence[Any] | NDArray[Any], dtype: type[np.generic]) -> NDArray[Any]:
    array = np.array(values, dtype=dtype)
    array.flags.writeable = False
    return array


class ArrayView:
    """A :class:`PolicyView` over plain arrays, for a host that keeps its own request state.

    Slot ``i`` is the host's ``i``-th running request, in admission order. Pages are counted
    the simple way (a running request holds its own pages; preempting it frees them) unless the
    host passes ``freed_by_preempting`` to account for shared (prefix-cached) pages. With a
    prefix cache, ``waiting`` gives each candidate's cached tokens as its ``num_computed``
    (see the module docstring).

    Args:
        budget: The step's token and sequence caps.
        page_size: Tokens per KV page (block).
        free_pages: KV pages free now.
        num_computed: int ``[S]``: tokens in each running request's cache.
        num_tokens: int ``[S]``: tokens known for each (prompt plus generated).
        prompt_len: int ``[S]``: prompt lengths.
        requests: The ``S`` running requests, as phasesched requests.
        waiting: Called once per :meth:`waiting` call: the waiting requests in queue order,
            each with the tokens it would claim from the host's prefix cache as ``num_computed``.
        num_waiting: How many requests wait (``-1``: count ``waiting()``).
        page_count: int ``[S]``: pages each holds (default: enough for its computed tokens).
        arrival_time: float ``[S]`` (default: the requests' own).
        priority: int ``[S]`` (default: the requests' own).
        now: The host's clock.
        watermark_pages: Pages admissions must leave free.
        max_model_len: Longest sequence the model accepts.
        freed_by_preempting: The host's own page accounting for preemptions.

    """

    def __init__(  # noqa: PLR0913 -- the host's state, passed explicitly and by keyword
        self,
        *,
        budget: TokenBudget,
        page_size: int,
        free_pages: int,
        num_computed: Sequence[int] | NDArray[np.integer[Any]],
        num_tokens: Sequence[int] | NDArray[np.integer[Any]],
        prompt_len: Sequence[int] | NDArray[np.integer[Any]],
        requests: Sequence[Request],
        waiting: Callable[[], Iterator[WaitingCandidate]] = lambda: iter(()),
        num_waiting: int = -1,
        page_count: Sequence[int] | NDArray[np.integer[Any]] | None = None,
        arrival_time: Sequence[float] | NDArray[np.floating[Any]] | None = None,
        priority: Sequence[int] | NDArray[np.integer[Any]] | None = None,
        now: float = 0.0,
        watermark_pages: int = 0,
        max_model_len: int = 1 << 30,
        freed_by_preempting: Callable[[Int32Array], int] | None = None,
    ) -> None:
        self.now = now
        self.budget = budget
        self.page_size = page_size
        self.free_pages = free_pages
        self.watermark_pages = watermark_pages
        self.max_model_len = max_model_len
        self._requests = list(requests)
        size = len(self._requests)
        self.running: Int32Array = _read_only(np.arange(size), np.int32)
        self.num_computed: Int32Array = _read_only(num_computed, np.int32)
        self.num_tokens: Int32Array = _read_only(num_tokens, np.int32)
        self.prompt_len: Int32Array = _read_only(prompt_len, np.int32)
        if page_count is None:
            page_count = -(-self.num_computed // page_size)
        self.page_count: Int32Array = _read_only(page_count, np.int32)
        if arrival_time is None:
            arrival_time = [r.arrival_time for r in self._requests]
        self.arrival_time: NDArray[np.float64] = _read_only(arrival_time, np.float64)
        if priority is None:
            priority = [r.priority for r in self._requests]
        self.priority: NDArray[np.int64] = _read_only(priority, np.int64)
        for name in ("num_computed", "num_tokens", "prompt_len", "page_count", "arrival_time", "priority"):
            if len(getattr(self, name)) != size:
                msg = f"{name} has {len(getattr(self, name))} entries for {size} running requests"
                raise InvalidPlanError(msg)
        self._waiting = waiting
        self._num_waiting = num_waiting
        self._freed = freed_by_preempting

    @property
    def num_generated(self) -> Int32Array:
        """int32 ``[S]``: generated tokens of each slot (computed on demand)."""
        generated: Int32Array = self.num_tokens - self.prompt_len
        return generated

    @property
    def num_waiting(self) -> int:
        """Requests waiting."""
        if self._num_waiting < 0:
            self._num_waiting = sum(1 for _ in self._waiting())
        return self._num_waiting

    def request(self, slot: int) -> Request:
        """The request running in ``slot``."""
        return self._requests[slot]

    def waiting(self) -> Iterator[WaitingCandidate]:
        """Waiting requests in queue order, lazily."""
        return self._waiting()

    def freed_by_preempting(self, slots: Int32Array) -> int:
        """KV pages that preempting ``slots`` would return (the host's count, else their own pages)."""
        if self._freed is not None:
            return self._freed(slots)
        return int(self.page_count[np.unique(slots)].sum())

    def pages_to_grow(self, slots: Int32Array, num_new: NDArray[np.integer[Any]]) -> NDArray[np.int64]:
        """int64 ``[K]``: pages each of ``slots`` must add to compute ``num_new`` more tokens."""
        needed = -(-(self.num_computed[slots].astype(np.int64) + num_new) // self.page_size)
        grow: NDArray[np.int64] = np.maximum(needed - self.page_count[slots], 0)
        return grow

    def pages_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.page_size)


def propose(policy: SchedulingPolicy, view: PolicyView) -> Selection:
    """Ask ``policy`` for one step over ``view``, and check the answer against the view.

    This is the whole policy API a host needs: it builds the batch builder, runs the policy's
    phase priority, and returns a selection that :func:`check_proposal` accepted. Nothing in
    the host changes; applying the selection is the host's job.

    A cache-aware queue order re-ranks the view's waiting requests here, as the scheduler's
    own view does, so every host gets the order phasesched's scheduler would commit.

    Raises:
        InvalidPlanError: The policy (a plugin, perhaps) proposed a step the view cannot hold.

    """
    order = policy.queue_order
    if isinstance(order, CacheAwareOrder):
        view = cast("PolicyView", _Reranked(view, order))
    # The builder and the built-in priorities are annotated with phasesched's own view; they
    # read only what PolicyView declares.
    scheduler_view = cast("SchedulerView", view)
    builder = BatchBuilder(scheduler_view, policy.chunker, policy.preemption)
    selection: object = policy.priority.select(scheduler_view, builder)
    if not isinstance(selection, Selection):
        msg = f"{type(policy.priority).__name__}.select returned {type(selection).__name__}, not a Selection"
        raise InvalidPlanError(msg)
    check_proposal(selection, view)
    return selection


class _Reranked:
    """``view`` whose waiting requests a cache-aware order re-ranks (re-ranking twice changes nothing)."""

    def __init__(self, view: PolicyView, order: CacheAwareOrder) -> None:
        self._view, self._order = view, order

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)

    def waiting(self) -> Iterator[WaitingCandidate]:
        """The view's waiting requests, re-ranked."""
        view = self._view
        return rerank(view.waiting(), view.num_waiting, self._order)


def check_proposal(selection: Selection, view: PolicyView) -> None:
    """Raise :class:`~phasesched.errors.InvalidPlanError` unless ``selection`` fits ``view``.

    The host-independent twin of :func:`phasesched.selection.check_selection`: every slot is
    running and appears once, each request gets between one token and what it has left, the
    budget and sequence cap hold, admissions are waiting requests, and the KV pages the step
    needs are free once the proposed preemptions free theirs.
    """
    slots, tokens, preempted = selection.running_slots, selection.running_tokens, selection.preempted
    _require(len(slots) == len(tokens), "running_slots and running_tokens differ in length")
    _require(len(selection.admitted) == len(selection.admitted_tokens), "admitted and admitted_tokens differ")
    everyone = np.concatenate([slots, np.asarray(preempted, np.int32)])
    size = len(view.num_computed)
    if len(everyone):
        _require(int(everyone.min()) >= 0 and int(everyone.max()) < size, "a slot holds no running request")
        _require(bool(np.isin(everyone, view.running).all()), "a slot holds no running request")
        _require(len(np.unique(everyone)) == len(everyone), "a running request is scheduled or preempted twice")
    left = view.num_tokens[slots] - view.num_computed[slots]
    _require(not len(tokens) or int(tokens.min()) > 0, "every scheduled request must compute at least one token")
    _require(not np.count_nonzero(tokens > left), "a request is given more tokens than it has left to compute")
    admitted_pages = _check_admitted(selection, view) if selection.admitted else 0
    num_running = len(view.running) - len(preempted) + len(selection.admitted)
    _require(num_running <= view.budget.max_num_seqs, f"{num_running} running sequences exceed max_num_seqs")
    _require(selection.num_tokens <= view.budget.max_num_batched_tokens, "the step exceeds max_num_batched_tokens")
    need = int(view.pages_to_grow(slots, tokens.astype(np.int64)).sum()) + admitted_pages
    available = view.free_pages + (view.freed_by_preempting(np.asarray(preempted, np.int32)) if preempted else 0)
    _require(need <= available, f"the step needs {need} KV pages, {available} would be free")


def _check_admitted(selection: Selection, view: PolicyView) -> int:
    _require(len(set(selection.admitted)) == len(selection.admitted), "a waiting request is admitted twice")
    wanted = dict(zip(selection.admitted, selection.admitted_tokens, strict=True))
    pages = 0
    for candidate in view.waiting():
        num = wanted.pop(candidate.request_id, None)
        if num is None:
            continue
        _require(0 < num <= candidate.remaining, f"admitted {candidate.request_id!r} given {num} tokens")
        pages += view.pages_for(candidate.num_computed + num)
        if not wanted:
            break
    _require(not wanted, f"admitted requests {sorted(wanted)} are not waiting")
    return pages


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidPlanError(message)


if TYPE_CHECKING:

    def _both_views_are_policy_views(native: SchedulerView, foreign: ArrayView) -> tuple[PolicyView, PolicyView]:
        """Never called: mypy checks here that both views implement the protocol."""
        return native, foreign
