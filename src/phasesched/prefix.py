"""Content hashes of full KV pages, chained so a page's hash names its whole prefix.

A page's hash covers its own tokens and its parent's hash, as vLLM's block hashes and SGLang's
radix tree do: two requests share a page only if every token up to the page's end agrees. Hashing
costs one Python ``hash`` of a small tuple per full page, and only full pages are hashed.

**Collisions.** Python's 64-bit tuple hash is not cryptographic. Two different prefixes that
collide would share KV and give a wrong answer, with odds of about ``n**2 / 2**65`` for ``n``
distinct cached pages (about 3e-8 for a million pages); vLLM offered the same trade (its builtin
``hash`` option) before defaulting to SHA-256. Token-id requests are only hashed inside one
process, so ``PYTHONHASHSEED`` does not matter here (ints and tuples of ints hash the same
in every process anyway).

Requests replayed from traces carry no token ids, only block hashes (Mooncake's ``hash_ids``, one
per 512-token block): :func:`block_page_hashes` maps those to page hashes, so cache hits are
simulated without tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from phasesched.errors import InvalidRequestError

__all__ = ["ROOT_HASH", "PromptBlocks", "block_page_hashes", "extend_page_hashes"]

ROOT_HASH = 0
"""The parent hash of a sequence's first page."""


def extend_page_hashes(
    hashes: list[int], tokens: Sequence[int], page_size: int, num_pages: int, *, offset: int = 0
) -> None:
    """Append to ``hashes`` (a sequence's page hashes so far) until it names ``num_pages`` full pages.

    ``tokens[i]`` is the sequence's token ``offset + i``; they must cover the pages to hash, from
    token ``len(hashes) * page_size`` (``offset`` at most that) to ``num_pages * page_size``.
    """
    parent = hashes[-1] if hashes else ROOT_HASH
    for page in range(len(hashes), num_pages):
        first = page * page_size - offset
        parent = hash((parent, tuple(tokens[first : first + page_size])))
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
