"""The raw link: ``torch.distributed`` send/recv of plain tensors between two ranks, timed.

What the P/D runtime's transfers are compared with (their protocol overhead), and what the
simulator's KV link is given (bandwidth and latency fitted to these samples). Run as two
processes by :func:`measure_link`; each sample is a ping-pong: rank 0 sends ``nbytes`` and
waits for a 1-element answer, so a sample is one one-way transfer plus one tiny message.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import torch
import torch.distributed as dist

__all__ = ["LinkFit", "fit_link", "measure_link"]


@attrs.frozen
class LinkFit:
    """A link's fitted time per transfer: ``latency_s + nbytes / bandwidth_bytes_per_s``."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def time(self, nbytes: float) -> float:
        """Predicted seconds to move ``nbytes``."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


def fit_link(samples: Sequence[tuple[int, float]]) -> LinkFit:
    """Fit ``time = latency + bytes / bandwidth`` to the median time of each size (latency >= 0).

    Medians, because a shared machine's samples have long tails. Where noise makes the fitted
    slope non-positive, the bandwidth is the largest size over its median time.
    """
    sizes = sorted({n for n, _ in samples})
    medians = np.array([np.median([t for m, t in samples if m == n]) for n in sizes])
    x = np.array(sizes, dtype=np.float64)
    if len(sizes) < 2:
        return LinkFit(0.0, float(x[-1] / medians[-1]))
    slope, intercept = np.polyfit(x, medians, 1)
    if slope <= 0:
        return LinkFit(max(float(medians[0]), 0.0), float(x[-1] / medians[-1]))
    return LinkFit(max(float(intercept), 0.0), 1.0 / float(slope))


def _rank_main(rank: int, sizes: list[int], repeats: int, output: str | None) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=dt.timedelta(seconds=60))
    ack = torch.zeros(1)
    samples: list[tuple[int, float]] = []
    for nbytes in sizes:
        tensor = torch.ones(max(nbytes // 4, 1))
        for i in range(repeats + 1):  # the first is a warm-up
            if rank == 0:
                start = time.perf_counter()
                dist.send(tensor, 1)
                dist.recv(ack, 1)
                if i:
                    samples.append((tensor.numel() * 4, time.perf_counter() - start))
            else:
                dist.recv(tensor, 0)
                dist.send(ack, 0)
    if output is not None:
        Path(output).write_text(json.dumps(samples))
    dist.destroy_process_group()


def measure_link(sizes: Sequence[int], *, repeats: int = 5, timeout_s: float = 120.0) -> list[tuple[int, float]]:
    """Ping-pong ``repeats`` times per size between two local gloo processes; ``(nbytes, seconds)`` samples.

    Raises:
        RuntimeError: The processes failed or ran past ``timeout_s`` (they are killed).

    """
    from phasesched_torch._pd import _free_port  # noqa: PLC0415 -- shared helper, avoids an import cycle

    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "link.json"
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            command = [sys.executable, "-m", "phasesched_torch._pd_link", json.dumps(list(sizes)), str(repeats)]
            if rank == 0:
                command.append(str(output))
            procs.append(subprocess.Popen(command, env=env))  # noqa: S603 -- our own module
        try:
            codes = [proc.wait(timeout=timeout_s) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=5)
        if any(codes) or not output.exists():
            msg = f"the link benchmark failed: exit codes {codes}"
            raise RuntimeError(msg)
        return [(int(n), float(t)) for n, t in json.loads(output.read_text())]


if __name__ == "__main__":
    _rank_main(
        int(os.environ["RANK"]), json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
    )
