"""The side-by-side harness's phasesched driver (``ps_bench.py``) with prefix caching off.

``scheduler_overhead.py --side-by-side-cache off`` runs this beside vLLM's driver with
``--no-prefix-caching``, to compare the two schedulers without the cost of their prefix caches.
It is started in the harness's ``side_by_side`` folder, whose ``ps_bench`` it imports.
"""

from __future__ import annotations

import sys
from pathlib import Path

from phasesched import PolicyOptions, Scheduler, SchedulerConfig, load_policy

sys.path.insert(0, str(Path.cwd()))
import ps_bench  # the harness's driver, found in the working folder


def build_scheduler(*, max_num_seqs: int, max_num_batched_tokens: int, num_pages: int, page_size: int) -> Scheduler:
    """``ps_bench.build_scheduler`` with ``enable_prefix_caching=False``."""
    config = SchedulerConfig(num_pages=num_pages, page_size=page_size, max_model_len=ps_bench.MAX_MODEL_LEN)
    options = PolicyOptions(
        max_model_len=ps_bench.MAX_MODEL_LEN,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    return Scheduler(config, load_policy("vllm", options))


if __name__ == "__main__":
    ps_bench.build_scheduler = build_scheduler
    ps_bench.main()
