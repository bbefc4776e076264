"""Run independent simulations side by side: serially, on a local process pool, or on a Ray cluster.

Every simulation is a pure function of its inputs, so the three backends return the same
values in the same order; only the wall time differs. Tasks and results cross process
boundaries by pickling, so a task is a module-level function and its arguments plain values.

>>> map_tasks(pow, [(2, 3), (3, 2)], backend="serial")
[8, 9]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from typing import Any, Literal

from phasesched.errors import InvalidArgumentError

__all__ = ["BACKENDS", "Backend", "default_workers", "map_tasks"]

Backend = Literal["serial", "process", "ray"]
BACKENDS: tuple[Backend, ...] = ("serial", "process", "ray")
"""The backends :func:`map_tasks` knows."""

Progress = Callable[[int, int], None]


def default_workers() -> int:
    """Processes a local pool uses by default: the CPUs this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def map_tasks(  # noqa: PLR0913 -- the function, its inputs and how to run them
    function: Callable[..., Any],
    arguments: Sequence[tuple[Any, ...]],
    *,
    backend: Backend = "process",
    workers: int | None = None,
    address: str | None = None,
    progress: Progress | None = None,
) -> list[Any]:
    """``[function(*a) for a in arguments]``, computed on ``backend``, in input order.

    Args:
        function: A picklable (module-level) function.
        arguments: One tuple of positional arguments per task.
        backend: ``serial`` (this process), ``process`` (a local pool of ``workers``) or
            ``ray`` (the cluster at ``address``, or a local one; needs the ``ray`` extra).
        workers: Pool size (default :func:`default_workers`); 1 runs serially.
        address: A Ray cluster address (``ray://host:10001`` or ``auto``).
        progress: Called with ``(done, total)`` as tasks finish.

    Raises:
        InvalidArgumentError: An unknown backend.
        MissingExtraError: ``ray`` without Ray installed.
    """
    if backend not in BACKENDS:
        msg = f"no backend named {backend!r}; known: {', '.join(BACKENDS)}"
        raise InvalidArgumentError(msg)
    size = workers or default_workers()
    if backend == "ray":
        return _map_ray(function, arguments, address, progress)
    if backend == "serial" or size == 1 or len(arguments) <= 1:
        return _map_serial(function, arguments, progress)
    return _map_pool(function, arguments, min(size, len(arguments)), progress)


def _map_serial(
    function: Callable[..., Any], arguments: Sequence[tuple[Any, ...]], progress: Progress | None
) -> list[Any]:
    out = []
    for done, args in enumerate(arguments, 1):
        out.append(function(*args))
        if progress is not None:
            progress(done, len(arguments))
    return out


def _map_pool(
    function: Callable[..., Any], arguments: Sequence[tuple[Any, ...]], workers: int, progress: Progress | None
) -> list[Any]:
    results: dict[int, Any] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures: dict[Future[Any], int] = {pool.submit(function, *args): i for i, args in enumerate(arguments)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if progress is not None:
                progress(len(results), len(arguments))
    return [results[i] for i in range(len(arguments))]


def _map_ray(
    function: Callable[..., Any], arguments: Sequence[tuple[Any, ...]], address: str | None, progress: Progress | None
) -> list[Any]:
    try:
        import ray  # noqa: PLC0415 -- an optional extra, imported only when asked for
    except ImportError:
        from phasesched.report import MissingExtraError  # noqa: PLC0415 -- avoids an import cycle

        msg = "--backend ray needs Ray: pip install 'phasesched[ray]'"
        raise MissingExtraError(msg) from None
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    remote = ray.remote(function)
    refs = [remote.remote(*args) for args in arguments]
    index = {ref: i for i, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        results[index[ready[0]]] = ray.get(ready[0])
        if progress is not None:
            progress(len(results), len(arguments))
    return [results[i] for i in range(len(arguments))]
