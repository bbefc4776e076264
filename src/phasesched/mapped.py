"""int32 tables whose memory is mapped as it is written: the token buffer and the KV page tables.

Both are a row per running request, as long as the longest one, and mostly empty. What is
never written stays unmapped, so a table sized for one 128K prompt among a thousand short
ones costs about the short ones' memory, a scheduler can reserve a full batch of its longest
requests up front (address space, not memory), growing copies only the rows' used prefixes,
and a pickle or copy carries those prefixes (:func:`pack_rows`) rather than the reserved space.
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

__all__ = ["PackedRows", "copy_prefixes", "layout", "mapped_zeros", "pack_rows", "unpack_rows"]

Int32Array = NDArray[np.int32]


def mapped_zeros(rows: int, columns: int) -> Int32Array:
    """An int32 ``rows x columns`` array of zeros whose memory is mapped 4 KiB at a time, as it is written.

    ``np.zeros`` asks Linux for huge pages on arrays this large, so writing a row's first
    entries maps and zeroes the 2 MiB around them: the array then takes about its whole size
    in memory, and growing the token buffer (a copy into a fresh one) took 41 ms when a 16K
    prompt joined 256 short sequences, against about 1 ms here. Where no mapping can be made
    (Windows, or ``vm.max_map_count`` reached), numpy's ``zeros``.
    """
    count = rows * columns
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: no transparent huge pages to keep away from
        return np.zeros((rows, columns), dtype=np.int32)
    # Anonymous (fd -1): zeroed by the kernel, page by page, on first touch. Private: a forked
    # process gets its own copy, as with any other array, where the default (shared) would
    # let a child's scheduler write into its parent's tables.
    try:
        memory = mmap.mmap(-1, 4 * count, flags=mmap.MAP_PRIVATE)
    except OSError:  # out of mappings (vm.max_map_count) or address space: numpy's own memory, or MemoryError
        return np.zeros((rows, columns), dtype=np.int32)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; it matters where huge pages are on for every mapping
        with contextlib.suppress(OSError):  # a kernel built without huge pages refuses the advice
            memory.madvise(mmap.MADV_NOHUGEPAGE)
    zeros: Int32Array = np.frombuffer(memory, dtype=np.int32, count=count).reshape(rows, columns)
    return zeros


def copy_prefixes(source: Int32Array, target: Int32Array, lengths: NDArray[np.integer[Any]]) -> None:
    """Copy the first ``lengths[i]`` entries of each row ``i``: nine rows in ten as one block, the longest alone."""
    if not len(lengths):
        return
    at = (len(lengths) - 1) * 9 // 10
    block = int(np.partition(lengths, at)[at])
    target[: len(lengths), :block] = source[: len(lengths), :block]
    for row in (lengths > block).nonzero()[0].tolist():
        target[row, block : lengths[row]] = source[row, block : lengths[row]]


class PackedRows(NamedTuple):
    """The used prefixes of an array's rows, end to end, and the array's shape: what a pickle or copy keeps."""

    shape: tuple[int, int]
    lengths: NDArray[np.int64]
    entries: Int32Array


def pack_rows(array: Int32Array, lengths: NDArray[np.integer[Any]]) -> PackedRows:
    """Row ``i``'s first ``lengths[i]`` entries, for :func:`unpack_rows`: a reserved array pickles as what it holds."""
    counts: NDArray[np.int64] = np.asarray(lengths, dtype=np.int64)
    rows, columns = _prefixes(counts)
    return PackedRows((array.shape[0], array.shape[1]), counts, array[rows, columns])


def unpack_rows(packed: PackedRows) -> Int32Array:
    """A fresh :func:`mapped_zeros` array of the packed shape holding the packed rows."""
    array = mapped_zeros(*packed.shape)
    rows, columns = _prefixes(packed.lengths)
    array[rows, columns] = packed.entries
    return array


def layout(
    rows: NDArray[np.integer[Any]], first: NDArray[np.integer[Any]], count: NDArray[np.integer[Any]]
) -> tuple[NDArray[np.integer[Any]], NDArray[np.integer[Any]]]:
    """Row and column of ``count[i]`` entries of row ``rows[i]``, from column ``first[i]`` on, in order."""
    total = int(count.sum())
    starts = count.cumsum() - count  # (array methods: numpy's function wrappers cost a microsecond a call)
    columns = first.repeat(count) + (np.arange(total) - starts.repeat(count))
    return rows.repeat(count), columns


def _prefixes(lengths: NDArray[np.int64]) -> tuple[NDArray[np.integer[Any]], NDArray[np.integer[Any]]]:
    """Row and column of each entry of rows holding ``lengths[i]`` entries from column 0."""
    return layout(np.arange(len(lengths), dtype=np.int64), np.zeros(len(lengths), dtype=np.int64), lengths)
