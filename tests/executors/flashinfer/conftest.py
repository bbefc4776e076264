"""FlashInfer executor tests run single-threaded on the CPU (tiny models gain nothing from
intra-op threads, and the machine is shared); the GPU tests skip without CUDA and flashinfer."""

from __future__ import annotations

try:
    import torch
except ImportError:  # the test modules skip themselves
    pass
else:
    torch.set_num_threads(1)
