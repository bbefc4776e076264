"""How an executor lays out a step's decodes, and so what their cost scales with.

A profile times uniform steps: ``decode_seqs`` decodes that all have context ``decode_context``.
A real step's decodes have different contexts, and what the profiled time at which context
matches that step depends on the executor's kernel:

* a **ragged** kernel (FlashInfer's paged decode and prefill kernels) reads every slice's own
  context, so its attention work follows the *sum* of the contexts: the step costs what a
  uniform step at the **mean** context costs;
* a **padded** kernel pads every decode to the step's **longest** context, so it costs what a
  uniform step at that context costs;
* a **bucketed** kernel (the torch reference executor) sorts the decodes by context and pads
  each bucket of similar contexts to its own longest: it costs what a uniform step at the
  *mean padded* context costs.

:class:`DecodeBatching` states which, as two numbers: decodes share a bucket while their
contexts stay within ``bucket_ratio`` of the bucket's longest (``1``: only equal contexts,
i.e. ragged; ``0``: every context, i.e. padded to the longest) and while the bucket holds at
most ``bucket_tokens`` padded tokens. A CUDA-graph executor also pads a decode-only step's
*batch* to the next captured size (``batch_sizes``). The effective features of a step are
then ``decode_seqs`` = the padded batch and ``decode_context`` = padded tokens over padded
batch (:meth:`DecodeBatching.decode_features`).

An executor declares its layout through :class:`DeclaresDecodeBatching` (a
``decode_batching`` attribute); ``phasesched profile`` records it in the profile's metadata
(``# decode_batching: ...``) and :class:`~phasesched.costmodel.profiled.ProfiledCostModel`
prices steps with it. Undeclared, a step is read at its mean context (ragged), which is what
every profile written before the declaration existed was read with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError

__all__ = [
    "METADATA_KEY",
    "RAGGED",
    "DeclaresDecodeBatching",
    "DecodeBatching",
    "decode_batching_from_metadata",
    "decode_batching_of",
]

Int64Array = NDArray[np.int64]

METADATA_KEY = "decode_batching"
"""The profile CSV's metadata key that records the layout (``# decode_batching: ...``)."""

_NEVER = np.iinfo(np.int64).max


def _ratio(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (0.0 <= value <= 1.0):
        msg = f"{attribute.name} must lie in [0, 1], got {value}"
        raise InvalidArgumentError(msg)


def _optional_positive(_: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        msg = f"{attribute.name} must be a positive int or None, got {value!r}"
        raise InvalidArgumentError(msg)


def _batch_sizes(_: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]) -> None:
    if list(value) != sorted(set(value)) or (value and value[0] < 1):
        msg = f"{attribute.name} must be strictly increasing positive sizes, got {value}"
        raise InvalidArgumentError(msg)


def _int_tuple(values: object) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        msg = f"batch_sizes must be integers, got {values!r}"
        raise InvalidArgumentError(msg) from None


@attrs.frozen
class DecodeBatching:
    """How an executor batches a step's decode slices (see the module docstring).

    Attributes:
        bucket_ratio: Decodes, sorted by context, share a bucket while their context is at
            least this fraction of the bucket's longest; each bucket is padded to its longest.
            ``1.0``: ragged (no padding; the step is read at its mean context). ``0.0`` with no
            ``bucket_tokens``: every decode padded to the step's longest context.
        bucket_tokens: At most ``max(1, bucket_tokens // longest)`` decodes a bucket (a memory
            cap on the padded gather), or ``None`` for no cap.
        batch_sizes: A decode-only step of ``n`` decodes runs padded to the smallest of these
            that holds ``n`` (CUDA graphs captured at those sizes), each padding slice one token
            of context; larger steps run unpadded. Empty: never padded.

    >>> contexts = np.array([100, 90, 40, 30])
    >>> RAGGED.decode_features(contexts)            # (decode_seqs, decode_context): the mean
    (4, 65.0)
    >>> DecodeBatching.longest().decode_features(contexts)
    (4, 100.0)
    >>> DecodeBatching(bucket_ratio=0.75).decode_features(contexts)   # buckets [100, 90], [40, 30]
    (4, 70.0)
    >>> DecodeBatching(batch_sizes=(1, 8)).decode_features(contexts)  # 4 padding slices of 1 token
    (8, 33.0)

    """

    bucket_ratio: float = attrs.field(default=1.0, converter=float, validator=_ratio)
    bucket_tokens: int | None = attrs.field(default=None, validator=_optional_positive)
    batch_sizes: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple, validator=_batch_sizes)

    @classmethod
    def longest(cls) -> DecodeBatching:
        """Every decode padded to the step's longest context."""
        return cls(bucket_ratio=0.0)

    @property
    def is_ragged(self) -> bool:
        """Whether nothing is padded, so a step is read at its mean context and its real batch size."""
        return self.bucket_ratio >= 1.0 and not self.batch_sizes

    # ------------------------------------------------------------------------- the layout
    def buckets(self, contexts: NDArray[np.integer]) -> list[NDArray[np.intp]]:
        """The buckets the executor forms: indices into ``contexts``, longest context first.

        Decodes are sorted by context, longest first (ties in their order); a bucket starts at
        the longest not yet placed and takes the following ones while they are similar (see
        ``bucket_ratio``) and fit ``bucket_tokens``.

        Args:
            contexts: int ``[N]``: each decode's context (KV length after the step).

        Returns:
            The buckets, each an int array of indices into ``contexts``; together a partition.

        """
        ctx = np.asarray(contexts, dtype=np.int64)
        order = np.argsort(-ctx, kind="stable")
        buckets = []
        start = 0
        while start < len(order):
            size, _ = self._bucket(ctx[order], start)
            buckets.append(order[start : start + size])
            start += size
        return buckets

    def _bucket(self, desc: Int64Array, start: int) -> tuple[int, int]:
        """The size of the bucket ``desc[start]`` leads, and the steps before that size may change.

        ``desc`` holds contexts sorted longest first; every step, each grows by one.
        """
        longest = int(desc[start])
        cap = len(desc) - start if self.bucket_tokens is None else max(1, self.bucket_tokens // max(longest, 1))
        candidates = desc[start : start + cap]
        similar = candidates >= self.bucket_ratio * longest
        size = len(candidates) if similar.all() else max(1, int(np.argmin(similar)))
        horizon = _NEVER
        if size < len(candidates) and self.bucket_ratio < 1.0:
            # The next context joins once it is within the ratio: c + j >= ratio * (longest + j).
            # One step early at worst (float rounding); recomputing early changes nothing.
            gap = self.bucket_ratio * longest - int(candidates[size])
            horizon = max(1, math.ceil(gap / (1.0 - self.bucket_ratio)) - 1)
        if self.bucket_tokens is not None and self.bucket_tokens // max(longest, 1) >= size:
            # The cap shrinks as the leader grows; the bucket changes once it falls below size.
            horizon = min(horizon, max(1, self.bucket_tokens // size + 1 - longest))
        return size, horizon

    def padded_tokens(self, contexts: NDArray[np.integer]) -> int:
        """Context tokens the executor reads for these decodes: each bucket's size times its longest.

        >>> DecodeBatching(bucket_ratio=0.75).padded_tokens(np.array([30, 100, 40, 90]))
        280
        """
        ctx = np.asarray(contexts, dtype=np.int64)
        if self.bucket_ratio >= 1.0:  # only equal contexts share a bucket: nothing is padded
            return int(ctx.sum())
        if self.bucket_ratio <= 0.0 and self.bucket_tokens is None:
            return int(ctx.max(initial=0)) * len(ctx)
        return self._padded_run(np.sort(ctx)[::-1], 1)[0]

    def _padded_run(self, desc: Int64Array, num_steps: int) -> list[int]:
        """Padded tokens of ``num_steps`` consecutive steps (contexts ``desc + j``), exactly.

        Between two changes of the partition every bucket keeps its rows, so the padded total
        grows by ``len(desc)`` a step; the partition is recomputed only where one may change.
        """
        totals: list[int] = []
        while len(totals) < num_steps:
            grown = desc + len(totals)
            total, horizon, start = 0, _NEVER, 0
            while start < len(grown):
                size, bucket_horizon = self._bucket(grown, start)
                total += size * int(grown[start])
                horizon = min(horizon, bucket_horizon)
                start += size
            run = min(num_steps - len(totals), horizon)
            totals.extend(total + len(desc) * j for j in range(run))
        return totals

    def padded_batch(self, num_decodes: int, *, decode_only: bool) -> int:
        """The batch a step of ``num_decodes`` decodes runs as (see ``batch_sizes``)."""
        if not decode_only or not self.batch_sizes or num_decodes > self.batch_sizes[-1] or num_decodes == 0:
            return num_decodes
        return self.batch_sizes[int(np.searchsorted(np.asarray(self.batch_sizes), num_decodes))]

    # ------------------------------------------------------------------------ the features
    def decode_features(self, contexts: NDArray[np.integer], *, decode_only: bool = True) -> tuple[int, float]:
        """``(decode_seqs, decode_context)``: the uniform profiled step these decodes cost like.

        Args:
            contexts: int ``[N]``: the step's decode contexts.
            decode_only: Whether the step has no prefill slice (only such steps are batch-padded).

        """
        ctx = np.asarray(contexts, dtype=np.int64)
        if len(ctx) == 0:
            return 0, 0.0
        batch = self.padded_batch(len(ctx), decode_only=decode_only)
        # Integer token totals divided once, as decode_step_times does, so both round alike.
        return batch, float(self.padded_tokens(ctx) + (batch - len(ctx))) / batch

    def decode_run_features(self, contexts: NDArray[np.integer], num_steps: int) -> tuple[int, NDArray[np.float64]]:
        """``decode_seqs`` and float64 ``[num_steps]`` ``decode_context`` of decode-only steps ``contexts + j``.

        Equal, step for step, to :meth:`decode_features` of ``contexts + j``.
        """
        ctx = np.asarray(contexts, dtype=np.int64)
        if len(ctx) == 0:
            return 0, np.zeros(num_steps, dtype=np.float64)
        batch = self.padded_batch(len(ctx), decode_only=True)
        steps = np.arange(num_steps, dtype=np.int64)
        if self.bucket_ratio >= 1.0:
            totals = int(ctx.sum()) + len(ctx) * steps
        elif self.bucket_ratio <= 0.0 and self.bucket_tokens is None:
            totals = len(ctx) * (int(ctx.max()) + steps)
        else:
            totals = np.array(self._padded_run(np.sort(ctx)[::-1], num_steps), dtype=np.int64)
        return batch, (totals + (batch - len(ctx))).astype(np.float64) / batch

    # ------------------------------------------------------------------------- the metadata
    def to_metadata(self) -> str:
        """The ``# decode_batching:`` value that :func:`decode_batching_from_metadata` reads back.

        >>> DecodeBatching(bucket_ratio=0.75, bucket_tokens=65536).to_metadata()
        'bucket_ratio=0.75 bucket_tokens=65536 batch_sizes='
        """
        tokens = "" if self.bucket_tokens is None else str(self.bucket_tokens)
        sizes = ",".join(map(str, self.batch_sizes))
        return f"bucket_ratio={self.bucket_ratio!r} bucket_tokens={tokens} batch_sizes={sizes}"

    @classmethod
    def from_metadata(cls, text: str) -> DecodeBatching:
        """Parse :meth:`to_metadata`'s form; raises :class:`InvalidArgumentError` on anything else."""
        fields = dict(item.partition("=")[::2] for item in text.split())
        if set(fields) != {"bucket_ratio", "bucket_tokens", "batch_sizes"}:
            msg = f"decode_batching {text!r}: expected 'bucket_ratio=R bucket_tokens=N|empty batch_sizes=N,N,...|empty'"
            raise InvalidArgumentError(msg)
        try:
            return cls(
                bucket_ratio=float(fields["bucket_ratio"]),
                bucket_tokens=int(fields["bucket_tokens"]) if fields["bucket_tokens"] else None,
                batch_sizes=tuple(int(v) for v in fields["batch_sizes"].split(",") if v),
            )
        except ValueError:
            msg = f"decode_batching {text!r}: a value is not a number"
            raise InvalidArgumentError(msg) from None


RAGGED = DecodeBatching()
"""The layout of a ragged kernel (nothing padded), whose decodes cost like a uniform step at their mean context."""


@runtime_checkable
class DeclaresDecodeBatching(Protocol):
    """An executor (or cost model) that states how it batches decodes.

    ``phasesched profile`` records the declaration, and the profiled cost model reads steps
    with it. An executor that does not declare one is profiled as :data:`RAGGED`.
    """

    @property
    def decode_batching(self) -> DecodeBatching:
        """How this executor batches a step's decodes."""
        ...


def decode_batching_of(executor: object) -> DecodeBatching | None:
    """The executor's declared :class:`DecodeBatching`, or ``None`` when it declares none.

    Raises:
        InvalidArgumentError: The executor's ``decode_batching`` is not a :class:`DecodeBatching`.

    """
    if not isinstance(executor, DeclaresDecodeBatching):
        return None
    declared: object = executor.decode_batching  # a plugin's claim, checked at run time
    if not isinstance(declared, DecodeBatching):
        msg = f"{type(executor).__name__}.decode_batching must be a DecodeBatching, got {type(declared).__name__}"
        raise InvalidArgumentError(msg)
    return declared


def decode_batching_from_metadata(metadata: Mapping[str, str]) -> DecodeBatching | None:
    """The layout a profile's metadata records, or ``None`` for a profile that records none.

    A profile without the key was written before executors declared their layout; read it as
    :data:`RAGGED` (the mean context), which is how it was always read.

    Raises:
        InvalidArgumentError: The recorded value does not parse.

    """
    text = metadata.get(METADATA_KEY)
    return None if text is None else DecodeBatching.from_metadata(text)
