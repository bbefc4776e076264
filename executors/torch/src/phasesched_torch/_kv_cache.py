"""The paged KV cache's layouts, and writing a step's keys and values into it.

A layer's cache is FlashInfer's: one tensor ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
(NHD; ``[:, 0]`` keys, ``[:, 1]`` values), or HND ``[num_pages, 2, num_kv_heads, page_size, head_dim]``,
or a ``(k_cache, v_cache)`` pair of 4-D tensors. Token ``t`` of slice ``b`` lives in page
``kv_indices[kv_indptr[b] + t // page_size]``, row ``t % page_size``. Keys are stored rotated.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "KVLayout",
    "PagedKVCache",
    "append_paged_kv_cache",
    "cache_geometry",
    "gather_kv",
    "kv_write_slots",
    "write_paged_kv",
]

KVLayout = Literal["NHD", "HND"]
PagedKVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""One layer's cache: a 5-D tensor (``[P, 2, page, Hkv, D]`` NHD or ``[P, 2, Hkv, page, D]``
HND) or a ``(k_cache, v_cache)`` tuple of 4-D tensors."""


def cache_geometry(kv_cache: PagedKVCache, kv_layout: KVLayout = "NHD") -> tuple[int, int, int, int]:
    """``(num_pages, page_size, num_kv_heads, head_dim)`` of one layer's cache.

    Raises:
        ValueError: The cache is not a 5-D tensor or a pair of 4-D tensors.

    """
    keys = kv_cache[0] if isinstance(kv_cache, tuple) else kv_cache[:, 0]
    if keys.dim() != 4 or (isinstance(kv_cache, torch.Tensor) and kv_cache.shape[1] != 2):
        msg = "kv_cache must be [P, 2, page, Hkv, D] (NHD), [P, 2, Hkv, page, D] (HND) or a (K, V) pair"
        raise ValueError(msg)
    num_pages, a, b, head_dim = keys.shape
    page_size, num_kv_heads = (a, b) if kv_layout == "NHD" else (b, a)
    return num_pages, page_size, num_kv_heads, head_dim


def gather_kv(
    kv_cache: PagedKVCache, layout: KVLayout, pages: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``(pages, offsets)`` (int64, any shape): each ``pages.shape + [Hkv, D]``."""
    if isinstance(kv_cache, tuple):
        k_cache, v_cache = kv_cache
        if layout == "NHD":
            return k_cache[pages, offsets], v_cache[pages, offsets]
        return k_cache[pages, :, offsets], v_cache[pages, :, offsets]
    kv = kv_cache[pages, :, offsets] if layout == "NHD" else kv_cache[pages, :, :, offsets]
    return kv[..., 0, :, :], kv[..., 1, :, :]


def kv_write_slots(
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each appended token goes: page ``kv_indices[kv_indptr[b] + pos // page_size]``, row ``pos % page_size``.

    Args:
        batch_indices: int ``[nnz]``: slice of each token.
        positions: int ``[nnz]``: absolute position of each token in its sequence.
        kv_indices: int ``[kv_indptr[-1]]``: page ids.
        kv_indptr: int ``[B + 1]``: page offsets.
        page_size: Tokens per page.

    Returns:
        ``(pages, offsets)``, each int64 ``[nnz]`` on ``kv_indices``' device.

    """
    pos = positions.to(torch.int64)
    start = kv_indptr.to(torch.int64)[batch_indices.to(torch.int64)]
    pages = kv_indices.to(torch.int64)[start + torch.div(pos, page_size, rounding_mode="floor")]
    return pages, pos % page_size


def write_paged_kv(
    kv_cache: PagedKVCache,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
    *,
    kv_layout: KVLayout = "NHD",
) -> None:
    """Store keys and values at ``slots = (pages, offsets)`` in place, cast to the cache's dtype.

    Args:
        kv_cache: One layer's cache (see :data:`PagedKVCache`).
        key: ``[nnz, Hkv, D]``: rotated keys.
        value: ``[nnz, Hkv, D]``.
        slots: ``(pages, offsets)``, each int64 ``[nnz]`` (from :func:`kv_write_slots`).
        kv_layout: ``"NHD"`` or ``"HND"``.

    """
    pages, offsets = slots
    if isinstance(kv_cache, tuple):
        k_cache, v_cache = kv_cache
        if kv_layout == "NHD":
            k_cache[pages, offsets] = key.to(k_cache.dtype)
            v_cache[pages, offsets] = value.to(v_cache.dtype)
        else:
            k_cache[pages, :, offsets] = key.to(k_cache.dtype)
            v_cache[pages, :, offsets] = value.to(v_cache.dtype)
    elif kv_layout == "NHD":
        kv_cache[pages, 0, offsets] = key.to(kv_cache.dtype)
        kv_cache[pages, 1, offsets] = value.to(kv_cache.dtype)
    else:
        kv_cache[pages, 0, :, offsets] = key.to(kv_cache.dtype)
        kv_cache[pages, 1, :, offsets] = value.to(kv_cache.dtype)


def append_paged_kv_cache(  # noqa: PLR0913, PLR0917 -- FlashInfer's append_paged_kv_cache signature
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: KVLayout = "NHD",
) -> None:
    """Append keys and values at their absolute positions (``flashinfer.append_paged_kv_cache``).

    The metadata already counts the appended tokens, as in :func:`paged_attention`.

    Args:
        append_key: ``[nnz, Hkv, D]``: rotated keys.
        append_value: ``[nnz, Hkv, D]``.
        batch_indices: int ``[nnz]``: slice of each token.
        positions: int ``[nnz]``: position of each token in its sequence.
        paged_kv_cache: One layer's cache, written in place.
        kv_indices: int ``[kv_indptr[-1]]``.
        kv_indptr: int ``[B + 1]``.
        kv_last_page_len: int ``[B]``.
        kv_layout: ``"NHD"`` or ``"HND"``.

    Raises:
        ValueError: A position lies outside its slice's cached length.

    """
    page_size = cache_geometry(paged_kv_cache, kv_layout)[1]
    batch = batch_indices.to(torch.int64)
    kv_len = (kv_indptr[1:] - kv_indptr[:-1] - 1).to(torch.int64) * page_size + kv_last_page_len.to(torch.int64)
    if bool(torch.any((positions < 0) | (positions.to(torch.int64) >= kv_len[batch]))):
        raise ValueError("an appended position lies outside its slice's kv length")
    slots = kv_write_slots(batch, positions, kv_indices, kv_indptr, page_size)
    write_paged_kv(paged_kv_cache, append_key, append_value, slots, kv_layout=kv_layout)
