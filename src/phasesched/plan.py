"""The step plan: the only thing an executor sees, built once per step, immutable.

A plan lists the scheduled slices (request, phase, token range) and carries the paged-attention
metadata in FlashInfer's layout, so a GPU executor passes the arrays straight to
``BatchPrefillWithPagedKVCacheWrapper.plan`` and a CPU executor indexes its cache with them.
All arrays are read-only numpy arrays built with vectorized operations.

Layout (``B`` slices, ``T`` query tokens, FlashInfer's conventions): slice ``i`` computes tokens
``start[i] .. start[i] + num_new[i] - 1`` of its request; its query rows are
``qo_indptr[i]:qo_indptr[i + 1]``; after this step's tokens are written its cache holds
``kv_len[i] = start[i] + num_new[i]`` tokens in pages
``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``, the last of which holds ``kv_last_page_len[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidPlanError
from phasesched.request import Phase, Request

__all__ = ["ScheduledPiece", "StepPlan", "build_step_plan"]

Int32Array = NDArray[np.int32]
BoolArray = NDArray[np.bool_]


def _frozen_array(array: NDArray[np.generic]) -> NDArray[np.generic]:
    array.flags.writeable = False
    return array


@attrs.frozen
class ScheduledPiece:
    """One request's slice of a step: tokens ``[start, end)`` in ``phase``."""

    request_id: str
    phase: Phase
    start: int
    end: int
    samples: bool
    """Whether the slice reaches the request's last known token, so a new token is sampled."""

    @property
    def num_tokens(self) -> int:
        """Tokens computed by this slice."""
        return self.end - self.start


@attrs.frozen(eq=False)
class StepPlan:
    """What to run in one model step. Build it with :func:`build_step_plan`.

    Attributes:
        step_id: Increases by one per plan; a result must name its plan's id.
        request_ids: ``B`` request ids, one per slice, in batch order.
        slots: int32 ``[B]``: each request's KV table (its row in the scheduler's arrays).
        start: int32 ``[B]``: tokens already in the cache before this step.
        num_new: int32 ``[B]``: tokens this step computes (query length).
        prompt_len: int32 ``[B]``: prompt length (a slice is prefill while it computes prompt
            or recomputed tokens).
        samples: bool ``[B]``: the slice ends at the request's last known token, so the
            executor samples one new token for it.
        qo_indptr: int32 ``[B + 1]``: query row offsets.
        kv_indptr: int32 ``[B + 1]``: page offsets into ``kv_indices``.
        kv_indices: int32 ``[kv_indptr[-1]]``: page ids.
        kv_last_page_len: int32 ``[B]``: tokens in each slice's last page, in ``[1, page_size]``.
        kv_len: int32 ``[B]``: tokens in each slice's cache after this step, ``start + num_new``
            (FlashInfer's ``seq_lens``).
        positions: int32 ``[T]``: absolute position of every query token.
        input_ids: int32 ``[T]`` token ids to feed, or ``None`` when a request is length-only.
        page_size: Tokens per KV page.
        preempted: Requests preempted (pages freed) while planning this step.
        new_requests: Requests scheduled for the first time since admission or resumption.
        released: Requests whose per-request executor state may be dropped (finished, aborted,
            preempted) since the previous plan.

    """

    step_id: int
    request_ids: tuple[str, ...]
    slots: Int32Array
    start: Int32Array
    num_new: Int32Array
    prompt_len: Int32Array
    samples: BoolArray
    qo_indptr: Int32Array
    kv_indptr: Int32Array
    kv_indices: Int32Array
    kv_last_page_len: Int32Array
    kv_len: Int32Array
    positions: Int32Array
    input_ids: Int32Array | None
    page_size: int
    preempted: tuple[str, ...] = ()
    new_requests: tuple[Request, ...] = ()
    released: tuple[str, ...] = ()

    @property
    def batch_size(self) -> int:
        """Slices in the step (``B``)."""
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        """Query tokens in the step (``T``)."""
        return int(self.qo_indptr[-1])

    @property
    def is_decode(self) -> BoolArray:
        """Bool ``[B]``: which slices are decodes (see :func:`phasesched.request.phase_of`)."""
        decode: BoolArray = (self.num_new == 1) & (self.start >= self.prompt_len)
        return decode

    @property
    def num_decodes(self) -> int:
        """Decode slices in the step."""
        return int(np.count_nonzero(self.is_decode))

    @property
    def num_prefill_tokens(self) -> int:
        """Query tokens that belong to prefill slices."""
        return self.num_tokens - self.num_decodes

    @property
    def is_empty(self) -> bool:
        """Whether nothing is scheduled (an idle step)."""
        return not self.request_ids

    @property
    def pieces(self) -> tuple[ScheduledPiece, ...]:
        """The slices as objects, for reading and logging (not for hot paths)."""
        decode = self.is_decode
        return tuple(
            ScheduledPiece(rid, Phase.DECODE if d else Phase.PREFILL, int(s), int(s + n), bool(smp))
            for rid, d, s, n, smp in zip(self.request_ids, decode, self.start, self.num_new, self.samples, strict=True)
        )

    def check_layout(self) -> None:
        """Raise :class:`~phasesched.errors.InvalidPlanError` if the metadata arrays disagree with one another.

        The scheduler builds consistent plans; executors call this on plans of other origin.
        """
        b = self.batch_size
        shapes = {
            "slots": self.slots,
            "start": self.start,
            "num_new": self.num_new,
            "prompt_len": self.prompt_len,
            "samples": self.samples,
            "kv_last_page_len": self.kv_last_page_len,
        }
        for name, array in shapes.items():
            _expect(array.shape == (b,), f"{name} has shape {array.shape}, expected ({b},)")
        _expect(len(set(self.request_ids)) == b, "a request appears twice in one plan")
        _expect(bool(np.all(self.num_new > 0)), "every slice must compute at least one token")
        _expect(np.array_equal(self.kv_len, self.start + self.num_new), "kv_len disagrees with start and num_new")
        _expect(np.array_equal(self.qo_indptr, _indptr(self.num_new)), "qo_indptr disagrees with num_new")
        pages = -(-self.kv_len // self.page_size)
        _expect(np.array_equal(self.kv_indptr, _indptr(pages)), "kv_indptr disagrees with kv lengths")
        _expect(len(self.kv_indices) == int(self.kv_indptr[-1]), "kv_indices length disagrees with kv_indptr")
        # A page may be shared (a forked prefix) only while no slice writes into it this step.
        written = _written_pages(self)
        uses = np.bincount(self.kv_indices, minlength=1) if len(self.kv_indices) else np.zeros(1, np.int64)
        _expect(bool(np.all(uses[written] == 1)), "a KV page written this step is used by another slice")
        last = (self.kv_len - 1) % self.page_size + 1
        _expect(np.array_equal(self.kv_last_page_len, last), "kv_last_page_len disagrees with kv lengths")
        _expect(
            np.array_equal(self.positions, token_positions(self.start, self.num_new)),
            "positions disagree with start and num_new",
        )
        if self.input_ids is not None:
            _expect(self.input_ids.shape == (self.num_tokens,), "input_ids must have one id per query token")


def _written_pages(plan: StepPlan) -> Int32Array:
    first = plan.kv_indptr[:-1] + plan.start // plan.page_size
    count = plan.kv_indptr[1:] - first
    offsets = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    written: Int32Array = plan.kv_indices[np.repeat(first, count) + offsets]
    return written


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidPlanError(message)


def _indptr(lengths: NDArray[np.integer]) -> Int32Array:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    lengths.cumsum(out=out[1:])
    return out


def token_positions(start: Int32Array, num_new: Int32Array) -> Int32Array:
    """int32 ``[T]``: absolute positions ``start[i] .. start[i] + num_new[i] - 1`` for each slice."""
    total = int(num_new.sum())
    if total == len(num_new):  # all decodes: one token each, at its start
        return start.astype(np.int32, copy=True)
    first_row = num_new.cumsum(dtype=np.int32)  # int32 throughout: no conversion at the end
    first_row -= num_new
    positions: Int32Array = (start - first_row).repeat(num_new).astype(np.int32, copy=False)
    positions += np.arange(total, dtype=np.int32)
    return positions


def build_step_plan(  # noqa: PLR0913 -- one keyword per metadata array, all required
    *,
    step_id: int,
    request_ids: tuple[str, ...],
    slots: Int32Array,
    start: Int32Array,
    num_new: Int32Array,
    prompt_len: Int32Array,
    samples: BoolArray,
    kv_indptr: Int32Array,
    kv_indices: Int32Array,
    page_size: int,
    input_ids: Int32Array | None = None,
    preempted: Sequence[str] = (),
    new_requests: Sequence[Request] = (),
    released: Sequence[str] = (),
) -> StepPlan:
    """Derive the remaining metadata (``qo_indptr``, last-page lengths, positions) and freeze.

    ``kv_indptr``/``kv_indices`` come from :meth:`phasesched.kv.PagedKVManager.gather` for
    ``ceil((start + num_new) / page_size)`` pages per slice. The arrays are frozen in place (made
    read-only, not copied), so pass arrays nothing writes to afterwards.

    Args:
        step_id: The plan's id, one more than the previous plan's.
        request_ids: ``B`` request ids, one per slice, in batch order.
        slots: int32 ``[B]``: each slice's KV table.
        start: int32 ``[B]``: tokens already in each slice's cache.
        num_new: int32 ``[B]``: tokens each slice computes, ``>= 1``.
        prompt_len: int32 ``[B]``: each request's prompt length.
        samples: bool ``[B]``: slices that end at their request's last known token.
        kv_indptr: int32 ``[B + 1]``: page offsets into ``kv_indices``.
        kv_indices: int32 ``[kv_indptr[-1]]``: page ids.
        page_size: Tokens per KV page.
        input_ids: int32 ``[T]`` (``T = num_new.sum()``) token ids to feed, or ``None`` when a
            request is length-only.
        preempted: Requests preempted while planning this step.
        new_requests: Requests scheduled for the first time since admission or resumption.
        released: Requests whose executor state may be dropped since the previous plan.

    Returns:
        The plan, with ``qo_indptr`` int32 ``[B + 1]``, ``kv_last_page_len`` and ``kv_len``
        int32 ``[B]`` and ``positions`` int32 ``[T]`` derived.
    """
    kv_len = start + num_new
    arrays: dict[str, NDArray[np.generic]] = {
        "slots": slots,
        "start": start,
        "num_new": num_new,
        "prompt_len": prompt_len,
        "samples": samples,
        "qo_indptr": _indptr(num_new),
        "kv_indptr": kv_indptr,
        "kv_indices": kv_indices,
        "kv_last_page_len": ((kv_len - 1) % page_size + 1).astype(np.int32),
        "kv_len": kv_len.astype(np.int32, copy=False),
        "positions": token_positions(start, num_new),
    }
    frozen = {name: _frozen_array(array) for name, array in arrays.items()}
    return StepPlan(
        step_id=step_id,
        request_ids=request_ids,
        input_ids=None if input_ids is None else _frozen_array(input_ids),  # type: ignore[arg-type]
        page_size=page_size,
        preempted=tuple(preempted),
        new_requests=tuple(new_requests),
        released=tuple(released),
        **frozen,  # type: ignore[arg-type]
    )
