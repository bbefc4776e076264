"""Content hashes of full KV pages, chained so a page's hash names its whole prefix.

A page's hash covers its own tokens and its parent's hash, as vLLM's block hashes and SGLang's
radix tree do: two requests share a page only if every token up to the page's end agrees. A page's
hash is Python's ``hash`` of ``(parent hash, its tokens as int32 bytes)``: bytes, because a batch of
pages comes out of the token buffer as bytes in one numpy call (no per-token Python ints), and
hashing them is a C loop. Only full pages are hashed.

**Collisions.** Python's 64-bit tuple hash is not cryptographic. Two different prefixes that
collide would share KV and give a wrong answer, with odds of about ``n**2 / 2**65`` for ``n``
distinct cached pages (about 3e-8 for a million pages); vLLM offered the same trade (its builtin
``hash`` option) before defaulting to SHA-256. Bytes hash differently in every process (unless
``PYTHONHASHSEED`` is set); that is harmless because page hashes never leave the scheduler that
made them, and nothing orders by hash value, so results do not depend on the seed.

Requests replayed from traces carry no token ids, only block hashes (Mooncake's ``hash_ids``, one
per 512-token block): :func:`block_page_hashes` maps those to page hashes, so cache hits are
simulated without tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidRequestError

__all__ = ["ROOT_HASH", "PromptBlocks", "block_page_hashes", "chain_page_hashes", "extend_page_hashes", "page_contents"]

ROOT_HASH = 0
"""The parent hash of a sequence's first page."""


def extend_page_hashes(
    hashes: list[int], tokens: Sequence[int] | NDArray[np.integer], page_size: int, num_pages: int, *, offset: int = 0
) -> None:
    """Append to ``hashes`` (a sequence's page hashes so far) until it names ``num_pages`` full pages.

    ``tokens[i]`` is the sequence's token ``offset + i``; they must cover the pages to hash, from
    token ``len(hashes) * page_size`` (``offset`` at most that) to ``num_pages * page_size``.
    """
    first = len(hashes) * page_size - offset
    count = num_pages - len(hashes)
    if count <= 0:
        return
    data = page_contents(np.asarray(tokens[first : first + count * page_size], dtype=np.int32), page_size)
    chain_page_hashes(hashes, data)


def page_contents(tokens: NDArray[np.int32], page_size: int) -> list[bytes]:
    """Each full page of ``tokens`` (int32, in order) as the bytes its hash covers."""
    pages = np.ascontiguousarray(tokens[: len(tokens) // page_size * page_size])
    contents: list[bytes] = pages.view(np.dtype((np.void, 4 * page_size))).tolist()
    return contents


def chain_page_hashes(hashes: list[int], contents: list[bytes]) -> None:
    """Append the hashes of consecutive pages whose contents are ``contents`` to a sequence's ``hashes``."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for content in contents:
        parent = hash((parent, content))
        hashes.append(parent)


def _block_ids(value: Sequence[int]) -> tuple[int, ...]:
    ids = tuple(value)
    if not all(type(i) is int for i in ids):
        msg = f"block hashes must be ints, got {ids!r}"
        raise InvalidRequestError(msg)
    return ids


@attrs.frozen
class PromptBlocks:
    """A prompt's content named by block hashes instead of tokens (trace replay).

    Attributes:
        block_size: Tokens per block (512 for the Mooncake traces).
        hash_ids: One id per block of the prompt, in order; the last block may be partial.
            Equal ids mean equal content *and* equal prefix (Mooncake's ids are prefix-chained).

    >>> PromptBlocks(512, (7, 8)).hash_ids
    (7, 8)
    """

    block_size: int = attrs.field()
    hash_ids: tuple[int, ...] = attrs.field(converter=_block_ids)

    @block_size.validator
    def _positive(self, _: object, value: int) -> None:
        if type(value) is not int or value <= 0:
            msg = f"block_size must be a positive int, got {value!r}"
            raise InvalidRequestError(msg)


def block_page_hashes(blocks: PromptBlocks, page_size: int, num_tokens: int) -> list[int]:
    """Chained hashes of the full pages among the first ``num_tokens`` tokens of a block-hashed prompt.

    A page is named by the ids of the blocks it overlaps and its offset in the first of them, so
    pages smaller or larger than the trace's blocks both work. Pages past the blocks get none.
    """
    size = blocks.block_size
    ids = blocks.hash_ids
    num_pages = min(num_tokens, len(ids) * size) // page_size
    hashes: list[int] = []
    parent = ROOT_HASH
    for page in range(num_pages):
        first, last = page * page_size, (page + 1) * page_size - 1
        parent = hash((parent, first % size, ids[first // size : last // size + 1]))
        hashes.append(parent)
    return hashes
