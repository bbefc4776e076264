"""Per-request block hashes of a workload, for replaying prefix-cache hits without token ids.

The Mooncake traces name each 512-token block of a prompt by a ``hash_id``: equal ids mean an
equal prefix up to that block's end. :class:`BlockHashes` keeps those lists for a whole workload
as two flat arrays (CSR, like FlashInfer's ``kv_indptr``/``kv_indices``), so 100,000 rows cost a
few megabytes, and hands out one :class:`~phasesched.prefix.PromptBlocks` per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.prefix import PromptBlocks

__all__ = ["BlockHashes"]

IntArray = NDArray[np.int64]


def _read_only(values: IntArray) -> IntArray:
    array: IntArray = np.array(values, dtype=np.int64)
    array.flags.writeable = False
    return array


@attrs.frozen(eq=False)
class BlockHashes:
    """Block hash ids of every request of a workload.

    Attributes:
        block_size: Tokens per block (512 for the Mooncake traces).
        indptr: int64 ``[N + 1]``: request ``i``'s ids are ``ids[indptr[i]:indptr[i + 1]]``.
        ids: int64 ``[M]``: the ids, request after request.

    >>> blocks = BlockHashes.from_lists(512, [[0, 1], [0, 2, 3]])
    >>> len(blocks), blocks.row(1).hash_ids
    (2, (0, 2, 3))
    """

    block_size: int
    indptr: IntArray = attrs.field(converter=_read_only)
    ids: IntArray = attrs.field(converter=_read_only)

    def __attrs_post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size <= 0:
            msg = f"block_size must be a positive int, got {self.block_size!r}"
            raise ValueError(msg)
        ok = self.indptr.ndim == 1 and len(self.indptr) >= 1 and self.indptr[0] == 0
        if not ok or self.indptr[-1] != len(self.ids) or np.any(np.diff(self.indptr) < 0):
            msg = "indptr must start at 0, never decrease and end at len(ids)"
            raise ValueError(msg)

    @classmethod
    def from_lists(cls, block_size: int, lists: Sequence[Sequence[int]]) -> BlockHashes:
        """From one list of ids per request."""
        lengths = np.array([len(ids) for ids in lists], dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum(lengths)])
        flat = np.fromiter((int(i) for ids in lists for i in ids), dtype=np.int64, count=int(lengths.sum()))
        return cls(block_size, indptr, flat)

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def row(self, i: int) -> PromptBlocks:
        """Request ``i``'s blocks."""
        return PromptBlocks(self.block_size, tuple(self.ids[self.indptr[i] : self.indptr[i + 1]].tolist()))

    def take(self, index: IntArray | slice) -> BlockHashes:
        """The rows ``index`` names, in that order."""
        rows = np.arange(len(self))[index]
        lists = [self.ids[self.indptr[i] : self.indptr[i + 1]].tolist() for i in rows.tolist()]
        return BlockHashes.from_lists(self.block_size, lists)
