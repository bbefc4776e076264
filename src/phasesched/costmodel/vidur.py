"""Vidur's operator profiles converted into a phasesched profile table.

Vidur (Microsoft, MIT licence) publishes per-operator timings per device, model and TP degree:

* ``mlp.csv``: one row per ``num_tokens`` (tokens in the batch) and
  ``num_tensor_parallel_workers``, with ``time_stats.<op>.median`` in milliseconds **per layer**
  for ``input_layernorm``, ``attn_pre_proj``, ``attn_rope``, ``attn_post_proj``,
  ``post_attention_layernorm``, ``mlp_up_proj``, ``mlp_act``, ``mlp_down_proj`` and ``add``,
  plus ``emb`` (once per step);
* ``attention.csv``: rows with ``is_prefill`` True (``prefill_chunk_size`` query tokens over
  ``kv_cache_size`` cached ones, ``batch_size`` 1) timed as ``time_stats.attn_prefill.median``,
  and rows with ``is_prefill`` False (``batch_size`` decodes of mean context ``kv_cache_size``)
  timed as ``time_stats.attn_decode.median``, also per layer, in milliseconds.

A step of our profile's four features (``prefill_tokens`` P, ``prefill_prefix`` K,
``decode_seqs`` D, ``decode_context`` C) is then priced as Vidur prices it::

    emb(P + D) + layers x (linear ops(P + D) + 2 add(P + D) + prefill_attn(P, K) + decode_attn(D, C))

Each operator is interpolated linearly between Vidur's measured points (the MLP by token
count; attention first along the context, then along the chunk or batch), and the token axis
of the table keeps every token count Vidur measured, so the jumps of its GEMM times at 512,
1024 and 2048 tokens survive (a coarse grid would price a 512-token chunk ~10% too high).
Not included: tensor-parallel all-reduces (``all_reduce.csv``) and CPU overheads, so import
the TP the table was measured at and add ``step_overhead_s`` if the engine's own time matters.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.costmodel.profiled import ProfileFormatError, ProfilePoint

__all__ = ["LAYER_OPS", "AttentionTable", "VidurProfile", "read_vidur"]

LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
)
"""Vidur's per-layer token-wise operators (``add`` comes twice per layer, ``emb`` once per step)."""

Float64Array = NDArray[np.float64]
_DEFAULT_PREFIXES = (0, 1024, 4096, 16384)
_DEFAULT_DECODES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
_DEFAULT_CONTEXTS = (16, 256, 1024, 4096, 16384)


def _median(name: str) -> str:
    return f"time_stats.{name}.median"


def _rows(path: str | os.PathLike[str], tp: int) -> list[dict[str, str]]:
    with Path(path).open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        msg = f"{path}: no rows"
        raise ProfileFormatError(msg)
    if "num_tensor_parallel_workers" in rows[0]:
        rows = [r for r in rows if int(float(r["num_tensor_parallel_workers"])) == tp]
        if not rows:
            msg = f"{path}: no rows for num_tensor_parallel_workers={tp}"
            raise ProfileFormatError(msg)
    return rows


def _column(rows: Sequence[dict[str, str]], name: str, path: str | os.PathLike[str]) -> Float64Array:
    try:
        return np.array([float(r[name]) if r[name] != "" else np.nan for r in rows], dtype=np.float64)
    except KeyError:
        msg = f"{path}: no column {name!r} (Vidur's layout has it)"
        raise ProfileFormatError(msg) from None


def _truthy(value: str) -> bool:
    return value.strip().lower() in {"true", "1"}


@attrs.frozen(eq=False)
class AttentionTable:
    """Attention times on Vidur's scattered (chunk or batch, context) points, interpolated.

    Linear along the context for each measured chunk (or batch) size, then across sizes.

    Attributes:
        outer: The chunk (or batch) sizes measured, ascending.
        inner: Per size, the contexts measured, ascending.
        times: Per size, the times at those contexts (ms per layer).
    """

    outer: Float64Array
    inner: tuple[Float64Array, ...]
    times: tuple[Float64Array, ...]

    @classmethod
    def build(cls, outer: Float64Array, inner: Float64Array, times: Float64Array) -> AttentionTable:
        """From parallel columns of measured points (rows without a time are dropped)."""
        keep = np.isfinite(times)
        outer, inner, times = outer[keep], inner[keep], times[keep]
        values = np.unique(outer)
        inners, outs = [], []
        for value in values:
            mask = outer == value
            order = np.argsort(inner[mask])
            inners.append(inner[mask][order])
            outs.append(times[mask][order])
        return cls(values, tuple(inners), tuple(outs))

    def __call__(self, outer: float, inner: float) -> float:
        """The time (ms per layer) at chunk or batch ``outer`` and context ``inner``."""
        at = [float(np.interp(inner, x, y)) for x, y in zip(self.inner, self.times, strict=True)]
        return float(np.interp(outer, self.outer, at))


@attrs.frozen(eq=False)
class VidurProfile:
    """Vidur's operator times for one model and TP degree, priced per step (see the module docstring).

    Attributes:
        num_layers: The model's layers (Vidur's times are per layer).
        tokens: Token counts the MLP profile measured, ascending.
        linear_ms: Per-layer token-wise time at each of ``tokens`` (ms), ``add`` counted twice.
        embedding_ms: The embedding's time at each of ``tokens`` (ms).
        prefill: Prefill attention by (chunk, cached prefix).
        decode: Decode attention by (batch, mean context).
    """

    num_layers: int
    tokens: Float64Array
    linear_ms: Float64Array
    embedding_ms: Float64Array
    prefill: AttentionTable
    decode: AttentionTable

    def step_time_s(self, prefill_tokens: float, prefix: float, decodes: float, context: float) -> float:
        """Seconds for a step of the four profile features."""
        if prefill_tokens == 0 and decodes == 0:
            return 0.0
        total = prefill_tokens + decodes
        layer = float(np.interp(total, self.tokens, self.linear_ms))
        if prefill_tokens:
            layer += self.prefill(prefill_tokens, prefix)
        if decodes:
            layer += self.decode(decodes, context)
        return (float(np.interp(total, self.tokens, self.embedding_ms)) + self.num_layers * layer) / 1e3

    def points(
        self,
        prefill_tokens: Iterable[int] | None = None,
        prefixes: Iterable[int] = _DEFAULT_PREFIXES,
        decodes: Iterable[int] = _DEFAULT_DECODES,
        contexts: Iterable[int] = _DEFAULT_CONTEXTS,
    ) -> list[ProfilePoint]:
        """The full grid of profile points; the prefill axis defaults to 0 plus every measured token count."""
        tokens = sorted({0, *(int(t) for t in (self.tokens if prefill_tokens is None else prefill_tokens))})
        return [
            ProfilePoint(p, k, d, c, self.step_time_s(p, k, d, c))
            for p in tokens
            for k in prefixes
            for d in decodes
            for c in contexts
        ]


def read_vidur(
    mlp_csv: str | os.PathLike[str], attention_csv: str | os.PathLike[str], *, num_layers: int, tp: int = 1
) -> VidurProfile:
    """Read Vidur's ``mlp.csv`` and ``attention.csv`` for tensor parallelism ``tp``.

    Raises:
        ProfileFormatError: A file without Vidur's columns, or no rows for ``tp``.
    """
    mlp = _rows(mlp_csv, tp)
    order = np.argsort(_column(mlp, "num_tokens", mlp_csv))
    tokens = _column(mlp, "num_tokens", mlp_csv)[order]
    linear = sum(_column(mlp, _median(op), mlp_csv) for op in LAYER_OPS) + 2 * _column(mlp, _median("add"), mlp_csv)
    embedding = _column(mlp, _median("emb"), mlp_csv)
    attention = _rows(attention_csv, tp)
    prefill = [r for r in attention if _truthy(r["is_prefill"])]
    decode = [r for r in attention if not _truthy(r["is_prefill"])]
    if not prefill or not decode:
        msg = f"{attention_csv}: needs both prefill (is_prefill True) and decode rows"
        raise ProfileFormatError(msg)
    return VidurProfile(
        num_layers,
        tokens,
        np.asarray(linear, dtype=np.float64)[order],
        embedding[order],
        AttentionTable.build(
            _column(prefill, "prefill_chunk_size", attention_csv),
            _column(prefill, "kv_cache_size", attention_csv),
            _column(prefill, _median("attn_prefill"), attention_csv),
        ),
        AttentionTable.build(
            _column(decode, "batch_size", attention_csv),
            _column(decode, "kv_cache_size", attention_csv),
            _column(decode, _median("attn_decode"), attention_csv),
        ),
    )
