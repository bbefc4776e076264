"""Running requests as per-slot numpy arrays, and their token ids as one buffer.

The slot is the request's KV table. Keeping per-request state in parallel arrays makes the
steady decode step a few vectorized operations however many requests run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import numpy as np
from numpy.typing import NDArray

from phasesched.mapped import copy_prefixes, mapped_zeros, pack_rows, unpack_rows
from phasesched.prefix import page_contents
from phasesched.sequence import SequenceState

__all__ = ["RunningArrays", "SavedRows", "TokenBuffer", "read_only"]

Int32Array = NDArray[np.int32]
_NO_TOKEN = -1


class TokenBuffer:
    """Token ids of running requests, one row per slot, as vLLM's input batch keeps them.

    Recording a step's sampled tokens is one scatter, and a step's input ids one gather, instead
    of a Python loop over per-request lists. Rows and columns grow by doubling as needed. Growing
    copies only what is still read: with ``row_lengths`` (``row_lengths(n)``: how many leading
    tokens of each of the first ``n`` rows are read from now on), each row's own tokens, so the
    first 16K prompt among 256 short sequences copies about its own row rather than 256 rows of
    16K (a 76 ms step); without it, every column ever written.
    """

    def __init__(self, row_lengths: Callable[[int], NDArray[np.integer[Any]]] | None = None) -> None:
        self.ids = mapped_zeros(8, 64)
        self._written = 0  # columns written so far, in any row: the rest of every row is zeros
        self._rows = 0  # rows loaded so far: the rows below are zeros
        self._row_lengths = row_lengths

    def load(self, slot: int, prompt: tuple[int, ...] | Int32Array, outputs: list[int]) -> None:
        """Write a request's prompt and generated tokens into row ``slot``."""
        length = len(prompt) + len(outputs)
        self._ensure(slot + 1, length)
        self._written = max(self._written, length)
        self._rows = max(self._rows, slot + 1)
        row = self.ids[slot]
        row[: len(prompt)] = prompt
        row[len(prompt) : length] = outputs

    def write(
        self, slots: Int32Array, positions: Int32Array, tokens: Int32Array, *, max_position: int | None = None
    ) -> None:
        """Store ``tokens[i]`` at position ``positions[i]`` of row ``slots[i]``.

        Rows must already exist (a request's row is made when it is loaded); ``max_position``,
        when the caller knows it, spares finding the largest position.
        """
        if len(slots):
            last = int(positions.max()) if max_position is None else max_position
            if last >= self._written:
                if last >= self.ids.shape[1]:
                    self._ensure(int(slots.max()) + 1, last + 1)
                self._written = last + 1
            self.ids[slots, positions] = tokens

    def gather(self, rows: Int32Array, positions: Int32Array) -> Int32Array:
        """The tokens at ``positions[i]`` of row ``rows[i]``."""
        tokens: Int32Array = self.ids[rows, positions]
        return tokens

    def pages(self, rows: Int32Array, pages: Int32Array, page_size: int) -> list[bytes]:
        """The contents of page ``pages[i]`` of row ``rows[i]`` (tokens ``page_size`` apiece), as bytes.

        The bytes :func:`phasesched.prefix.page_contents` gives for the same tokens.
        """
        width = self.ids.shape[1]
        if width % page_size == 0:  # each page is one fixed-width record of its row
            records = self.ids.view(np.dtype((np.void, 4 * page_size))).reshape(len(self.ids), width // page_size)
            contents: list[bytes] = records[rows, pages].tolist()
            return contents
        tokens = self.ids[rows[:, None], pages[:, None] * page_size + np.arange(page_size)]
        return page_contents(tokens.ravel(), page_size)

    def row(self, slot: int, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` of row ``slot``, as a list."""
        tokens: list[int] = self.ids[slot, start:stop].tolist()
        return tokens

    def __getstate__(self) -> dict[str, Any]:
        """Pickles and copies keep the tokens rows hold, not the reserved space around them (written out in full)."""
        state = self.__dict__.copy()
        rows, written = self._rows, self._written
        lengths = np.full(rows, written) if self._row_lengths is None else self._row_lengths(rows)
        state["ids"] = pack_rows(self.ids, np.minimum(lengths, written))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, ids=unpack_rows(state["ids"]))

    def reserve(self, rows: int, columns: int) -> None:
        """Make room for ``rows`` rows of ``columns`` tokens now, so writes within them never grow the buffer.

        Unwritten memory is only address space (see :func:`~phasesched.mapped.mapped_zeros`): a
        scheduler reserves its batch size by its longest request, as vLLM's input batch does,
        and no step copies the buffer when a long prompt comes (each growth for a 128K prompt
        among 1,024 requests took 5-15 ms). A reservation the system refuses leaves the buffer
        to grow as it would have.
        """
        height, width = self.ids.shape
        columns = -(-columns // 64) * 64  # whole pages of any size up to 64 per row (see pages)
        if rows > height or columns > width:
            with contextlib.suppress(MemoryError, OSError, ValueError):
                self._resize(max(rows, height), max(columns, width))

    def _ensure(self, rows: int, columns: int) -> None:
        height, width = self.ids.shape
        if rows <= height and columns <= width:
            return
        while height < rows:
            height *= 2
        while width < columns:
            width *= 2
        self._resize(height, width)

    def _resize(self, height: int, width: int) -> None:
        grown = mapped_zeros(height, width)
        used_rows, used_columns = self._rows, self._written
        if self._row_lengths is None or not used_rows:
            grown[:used_rows, :used_columns] = self.ids[:used_rows, :used_columns]
        else:
            copy_prefixes(self.ids, grown, np.minimum(self._row_lengths(used_rows), used_columns))
        self.ids = grown


class SavedRows(NamedTuple):
    """Slots' rows as :meth:`RunningArrays.save_rows` found them, for :meth:`RunningArrays.restore_rows` (opaque)."""

    slots: Int32Array
    values: dict[str, NDArray[Any]]
    tokens: list[Int32Array]


class RunningArrays:
    """Per-slot state of running requests, as parallel numpy arrays that grow on demand.

    Python objects (the request's state, its id, its token list, its stop set) sit in object
    arrays so that a batch of slots can fetch them with one fancy index instead of a loop.
    """

    _NUMERIC: ClassVar[dict[str, tuple[type[np.generic], object]]] = {
        "computed": (np.int32, 0),
        "known": (np.int32, 0),
        "prompt_len": (np.int32, 0),
        "max_known": (np.int32, 0),
        "last_token": (np.int32, _NO_TOKEN),
        "eos": (np.int32, _NO_TOKEN),
        "arrival": (np.float64, 0.0),
        "priority": (np.int64, 0),
        "has_ids": (np.bool_, False),
        "has_stop_set": (np.bool_, False),
        "running": (np.bool_, False),
        "abort_pending": (np.bool_, False),
    }
    _OBJECTS: ClassVar[tuple[str, ...]] = ("seqs", "ids", "stop_sets")

    def __init__(self, capacity: int = 64) -> None:
        self.computed: Int32Array
        """Tokens already in the KV cache."""
        self.known: Int32Array
        """Tokens known (prompt plus generated)."""
        self.prompt_len: Int32Array
        self.max_known: Int32Array
        """Known tokens at which generation stops for length (prompt + max_new, capped by the model)."""
        self.last_token: Int32Array
        self.eos: Int32Array
        self.arrival: NDArray[np.float64]
        self.priority: NDArray[np.int64]
        self.has_ids: NDArray[np.bool_]
        self.has_stop_set: NDArray[np.bool_]
        self.running: NDArray[np.bool_]
        self.abort_pending: NDArray[np.bool_]
        """Aborted while its plan was in flight: retired when that plan's result arrives."""
        self.seqs: NDArray[np.object_]
        self.ids: NDArray[np.object_]
        self.stop_sets: NDArray[np.object_]
        self.tokens = TokenBuffer(self._token_lengths)
        """Token ids of slots whose requests carry ids."""
        self.num_with_tokens = 0
        """Running requests whose sampled tokens matter (ids, EOS or stop tokens), so a simulator
        cannot make them up."""
        for name, (dtype, fill) in self._NUMERIC.items():
            setattr(self, name, np.full(capacity, fill, dtype=dtype))
        for name in self._OBJECTS:
            setattr(self, name, np.full(capacity, None, dtype=object))
        self._views: dict[str, NDArray[Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Without the cached views: a copy's views must show the copy's arrays, not copies of ours."""
        return {**self.__dict__, "_views": {}}

    def read_only(self, name: str) -> NDArray[Any]:
        """A read-only view of array ``name``, made once per array (policies get these)."""
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = read_only(getattr(self, name))
        return view

    @property
    def generated(self) -> Int32Array:
        """Tokens each slot has generated (derived: known minus prompt)."""
        generated: Int32Array = self.known - self.prompt_len
        return generated

    def _token_lengths(self, rows: int) -> NDArray[np.int32]:
        """Token ids each of the first ``rows`` slots will read: their known tokens (none without ids).

        Rows are read only below ``known``, which every write raises first; a slot unloaded in a
        step that may yet be undone keeps its ``known`` and ``has_ids`` until it is loaded again.
        """
        lengths: NDArray[np.int32] = np.where(self.has_ids[:rows], self.known[:rows], 0)
        return lengths

    def ensure(self, slot: int) -> None:
        """Grow every array so ``slot`` is a valid index."""
        size = len(self.computed)
        if slot < size:
            return
        new = max(2 * size, slot + 1)
        self._views.clear()
        for name, (dtype, fill) in self._NUMERIC.items():
            grown: NDArray[Any] = np.full(new, fill, dtype=dtype)
            grown[:size] = getattr(self, name)
            setattr(self, name, grown)
        for name in self._OBJECTS:
            grown = np.full(new, None, dtype=object)
            grown[:size] = getattr(self, name)
            setattr(self, name, grown)

    def load(self, slot: int, seq: SequenceState, max_model_len: int) -> None:
        """Fill ``slot`` for a request starting (or restarting) from its precomputed tokens."""
        self.ensure(slot)
        request = seq.request
        self.computed[slot] = seq.precomputed
        self.known[slot] = seq.num_tokens
        self.prompt_len[slot] = request.prompt_len
        self.max_known[slot] = min(request.max_total_tokens, max_model_len)
        prompt, outputs = request.prompt_token_ids, seq.outputs
        if prompt is not None and outputs is not None:
            self.tokens.load(slot, prompt if seq.prompt_ids is None else seq.prompt_ids, outputs)
            self.last_token[slot] = outputs[-1] if outputs else prompt[-1]
        else:
            self.last_token[slot] = _NO_TOKEN
        eos = request.eos_token_id
        self.eos[slot] = _NO_TOKEN if eos is None or request.ignore_eos else eos
        self.arrival[slot] = request.arrival_time
        self.priority[slot] = request.priority
        self.has_ids[slot] = prompt is not None
        self.has_stop_set[slot] = bool(request.stop_token_ids)
        self.num_with_tokens += request.tokens_matter
        self.running[slot] = True
        self.abort_pending[slot] = False
        self.seqs[slot] = seq
        self.ids[slot] = request.request_id
        self.stop_sets[slot] = request.stop_token_ids

    def save_rows(self, slots: Int32Array) -> SavedRows:
        """Copy ``slots``' rows, token ids included, so a rollback can put them back after the slots were reused."""
        values = {name: getattr(self, name)[slots] for name in (*self._NUMERIC, *self._OBJECTS)}
        with_ids = slots[self.has_ids[slots]].tolist()
        tokens = [self.tokens.ids[slot, : self.known[slot]].copy() for slot in with_ids]
        return SavedRows(slots, values, tokens)

    def restore_rows(self, saved: SavedRows) -> None:
        """Put back the rows :meth:`save_rows` copied (whatever loaded those slots since has been unloaded)."""
        for name, values in saved.values.items():
            getattr(self, name)[saved.slots] = values
        with_ids = saved.slots[self.has_ids[saved.slots]].tolist()
        for slot, tokens in zip(with_ids, saved.tokens, strict=True):
            self.tokens.load(slot, tokens, [])

    def tokens_matter(self, slots: NDArray[np.integer[Any]]) -> NDArray[np.bool_]:
        """Which slots' sampled tokens matter (token ids, EOS or stop tokens): a simulator cannot make them up."""
        matter: NDArray[np.bool_] = self.has_ids[slots] | self.has_stop_set[slots] | (self.eos[slots] >= 0)
        return matter

    def unload(self, slots: Int32Array) -> None:
        """Mark ``slots`` as no longer running, copying their progress back to their requests."""
        self.running[slots] = False
        if self.num_with_tokens:  # a simulator's requests carry none
            self.num_with_tokens -= int(np.count_nonzero(self.tokens_matter(slots)))
        generated = (self.known[slots] - self.prompt_len[slots]).tolist()
        for slot, seq, count in zip(slots.tolist(), self.seqs[slots].tolist(), generated, strict=True):
            if seq.outputs is not None:
                prompt_len = seq.request.prompt_len
                seq.outputs = self.tokens.row(slot, prompt_len, prompt_len + count)
            seq.num_generated = count
            seq.slot = -1
        self.seqs[slots] = None

    def reload(
        self, slots: Int32Array, seqs: list[SequenceState], progress: list[tuple[list[int] | None, int]]
    ) -> None:
        """Undo :meth:`unload`: ``seqs`` run in ``slots`` again, their ``(outputs, num_generated)`` as before."""
        self.running[slots] = True
        self.num_with_tokens += int(np.count_nonzero(self.tokens_matter(slots)))
        for slot, seq, (outputs, generated) in zip(slots.tolist(), seqs, progress, strict=True):
            self.seqs[slot] = seq
            seq.outputs, seq.num_generated, seq.slot = outputs, generated, slot


def read_only(array: NDArray[Any]) -> NDArray[Any]:
    """A read-only view of ``array`` (the array itself stays writable for its owner)."""
    view: NDArray[Any] = array.view()
    view.flags.writeable = False
    return view
