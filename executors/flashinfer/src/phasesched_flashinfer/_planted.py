"""Planted kernel-call bugs: the ``flashinfer`` module with one call made the wrong way.

A comparison that passes a known bug proves nothing, so the offline GPU check (and the CPU
suite, on the stand-in) runs its lockstep against the torch executor once per bug below and
requires each run to *fail*. Every bug is a plausible mistake in how an executor calls
FlashInfer, injected by rewriting the arguments on their way to the real (or stand-in) kernels:

* ``decode_kv_len_minus_one``: decode attends to ``kv_len - 1`` tokens (its own key missing).
* ``last_page_len_full``: every slice's last page is taken as full (``last_page_len = page_size``).
* ``causal_top_left``: the causal mask aligned top-left: a prefill slice's query ``i`` sees keys
  ``0..i`` instead of ``prefix + i`` (planned as a slice whose cache holds only its new tokens).
* ``swapped_kv``: ``append_paged_kv_cache`` given the values as keys and the keys as values.
* ``stale_page_table``: each wrapper is planned with the page table of its previous step.

:func:`plant` wraps a kernels module; everything it does not rewrite passes through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from phasesched_flashinfer._kernels import FlashInferKernels

__all__ = ["PLANTED_BUGS", "plant"]

PLANTED_BUGS = (
    "decode_kv_len_minus_one",
    "last_page_len_full",
    "causal_top_left",
    "swapped_kv",
    "stale_page_table",
)
"""The bugs :func:`plant` knows, in the order the check runs them."""


def _truncate(
    indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, page_size: int, kv_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paged layout of each slice's first ``kv_len`` tokens (host indptr/last, indices on their device)."""
    pages = -(-kv_len // page_size)
    keep = torch.cat([torch.arange(int(indptr[b]), int(indptr[b]) + int(pages[b])) for b in range(len(last))])
    new_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).to(torch.int32)
    new_last = (kv_len - (pages - 1) * page_size).to(torch.int32)
    return new_indptr, indices[keep.to(indices.device)].contiguous(), new_last


def _kv_len(indptr: torch.Tensor, last: torch.Tensor, page_size: int) -> torch.Tensor:
    return (indptr[1:] - indptr[:-1] - 1).long() * page_size + last.long()


class _Wrapper:
    """A prefill or decode wrapper whose ``plan()`` arguments one bug rewrites."""

    def __init__(self, inner: Any, bug: str, *, decode: bool) -> None:
        self._inner = inner
        self._bug = bug
        self._decode = decode
        self._previous_indices: torch.Tensor | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def plan(self, *positional: Any, **kwargs: Any) -> None:
        """Rewrite the layout per the bug, then plan the real wrapper."""
        args = list(positional)
        if self._decode:
            indptr, indices, last = args[0], args[1], args[2]
            page_size = int(args[6])
        else:
            indptr, indices, last = args[1], args[2], args[3]
            page_size = int(args[7])
        indptr, indices, last = self._rewrite(args, indptr, indices, last, page_size)
        if self._decode:
            args[0], args[1], args[2] = indptr, indices, last
        else:
            args[1], args[2], args[3] = indptr, indices, last
        self._inner.plan(*args, **kwargs)

    def _rewrite(
        self, args: list[Any], indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, page_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bug = self._bug
        if bug == "decode_kv_len_minus_one" and self._decode:
            kv_len = (_kv_len(indptr, last, page_size) - 1).clamp_min(1)
            return _truncate(indptr, indices, last, page_size, kv_len)
        if bug == "last_page_len_full":
            return indptr, indices, torch.full_like(last, page_size)
        if bug == "causal_top_left" and not self._decode:
            q_len = (args[0][1:] - args[0][:-1]).long()
            return _truncate(indptr, indices, last, page_size, q_len)
        if bug == "stale_page_table":
            current = indices.clone()
            previous, self._previous_indices = self._previous_indices, current
            if previous is not None:
                n = min(len(previous), len(current))
                indices = torch.cat([previous[:n], current[n:]])
        return indptr, indices, last


class _Kernels:
    """The kernels module with one bug planted (see the module docstring)."""

    def __init__(self, kernels: FlashInferKernels, bug: str) -> None:
        self._kernels = kernels
        self._bug = bug

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernels, name)

    def BatchPrefillWithPagedKVCacheWrapper(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 -- FlashInfer's name
        """The real prefill wrapper behind a bug's rewrite of its plan."""
        return _Wrapper(self._kernels.BatchPrefillWithPagedKVCacheWrapper(*args, **kwargs), self._bug, decode=False)

    def BatchDecodeWithPagedKVCacheWrapper(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 -- FlashInfer's name
        """The real decode wrapper behind a bug's rewrite of its plan."""
        return _Wrapper(self._kernels.BatchDecodeWithPagedKVCacheWrapper(*args, **kwargs), self._bug, decode=True)

    def append_paged_kv_cache(self, append_key: torch.Tensor, append_value: torch.Tensor, *args: Any) -> None:
        """The real append, with keys and values exchanged under ``swapped_kv``."""
        if self._bug == "swapped_kv":
            append_key, append_value = append_value, append_key
        self._kernels.append_paged_kv_cache(append_key, append_value, *args)


def plant(kernels: FlashInferKernels, bug: str) -> FlashInferKernels:
    """``kernels`` with ``bug`` (one of :data:`PLANTED_BUGS`) planted in how it is called.

    Raises:
        ValueError: ``bug`` is not a known bug.

    """
    if bug not in PLANTED_BUGS:
        msg = f"unknown planted bug {bug!r}; known: {', '.join(PLANTED_BUGS)}"
        raise ValueError(msg)
    buggy: FlashInferKernels = _Kernels(kernels, bug)
    return buggy
