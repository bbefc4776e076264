"""Torch executor tests run single-threaded: tiny models gain nothing from intra-op threads, and
on a shared two-core machine every OpenMP barrier can stall for a scheduler timeslice."""

from __future__ import annotations

try:
    import torch
except ImportError:  # the test modules skip themselves
    pass
else:
    torch.set_num_threads(1)
