"""The P/D runtime's torch side: KV pages over ``torch.distributed``, worker processes, a launcher.

Every process is one rank of a ``torchrun``-style job (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``): ranks ``0 .. P-1`` prefill, ranks ``P .. P+D-1`` decode, and
rank 0 also routes (:class:`phasesched.pd.Router`) and hosts the job's ``TCPStore``, through
which control messages travel (:class:`phasesched.pd.Mailbox`). KV pages travel as one tensor
per request over the process group: gloo on CPU, NCCL on GPUs, the same code.

Run it with ``python -m phasesched_torch.pd`` (which starts the ranks itself) or under
``torchrun``; see :doc:`/explanation/disaggregation`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import attrs
import numpy as np
import torch
import torch.distributed as dist
from numpy.typing import NDArray
from torch._C._distributed_c10d import PrefixStore, TCPStore

from phasesched import Request, Scheduler, SchedulerConfig, SchedulingPolicy
from phasesched.pd import DecodeWorker, Faults, Mailbox, PrefillWorker, Router, TransferError, WorkerStatus
from phasesched.pd.protocol import Failed, Finished, KeyValueStore, Manifest, Message, Pulled, TransferFailed
from phasesched.pd.worker import WorkerReport
from phasesched.policies.budget import TokenBudget
from phasesched.policies.chunking import FixedChunk
from phasesched_torch._executor import TorchExecutor, create_executor

__all__ = [
    "PDRunConfig",
    "PDRunResult",
    "RequestSpec",
    "TorchPageTransport",
    "launch",
    "make_requests",
    "run_aggregated",
    "run_rank",
]

_ROUTER_MESSAGES = (Manifest, Pulled, TransferFailed, Failed, Finished)


# ---------------------------------------------------------------------------- transport
def checksum(tensor: torch.Tensor) -> str:
    """BLAKE2b hex digest of a tensor's bytes (copied to the host first)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


@attrs.frozen(eq=False)
class _Packed:
    tensor: torch.Tensor
    checksum: str

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


@attrs.frozen(eq=False)
class _Work:
    work: dist.Work
    buffer: torch.Tensor

    def wait(self, timeout_s: float) -> None:
        try:
            self.work.wait(timeout=dt.timedelta(seconds=timeout_s))
        except RuntimeError as error:  # gloo and NCCL report timeouts and broken peers so
            raise TransferError(str(error).splitlines()[0][:200]) from error


class TorchPageTransport:
    """Moves a request's KV pages between ranks of the default process group.

    The pages of every layer are packed into one tensor ``[num_layers, num_pages, 2,
    page_size, num_kv_heads, head_dim]`` (NHD pages, token order), sent with ``isend`` and
    received with ``irecv`` under a per-pull tag, then scattered into the receiver's pages.

    Args:
        kv_cache: The executor's cache, one NHD tensor per layer.

    """

    layout = "NHD"

    def __init__(self, kv_cache: Sequence[torch.Tensor]) -> None:
        self.kv_cache = list(kv_cache)
        self._dtype = self.kv_cache[0].dtype
        self.dtype = str(self._dtype).removeprefix("torch.")
        self.device = self.kv_cache[0].device

    def _index(self, pages: NDArray[np.int32]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(pages, dtype=np.int64), device=self.device)

    def pack(self, pages: NDArray[np.int32], *, corrupt: bool = False) -> _Packed:
        """Copy ``pages`` of every layer into one tensor; ``corrupt`` changes one value after the checksum."""
        index = self._index(pages)
        tensor = torch.stack([layer.index_select(0, index) for layer in self.kv_cache]).contiguous()
        digest = checksum(tensor)
        if corrupt:
            tensor.view(-1)[0] += 1.0
        return _Packed(tensor, digest)

    def send(self, outgoing: object, dst: int, tag: int) -> _Work:
        """Start sending a packed tensor to ``dst``.

        Raises:
            TransferError: The peer is gone.

        """
        packed = cast("_Packed", outgoing)
        try:
            work = dist.isend(packed.tensor, dst, tag=tag)
        except RuntimeError as error:
            raise TransferError(str(error).splitlines()[0][:200]) from error
        assert work is not None
        return _Work(work, packed.tensor)

    def receive(self, manifest: Manifest, tag: int) -> _Work:
        """Post the receive of ``manifest``'s pages.

        Raises:
            TransferError: The manifest's layout or dtype is not this cache's, or the peer is gone.

        """
        if manifest.layout != self.layout or manifest.dtype != self.dtype:
            msg = f"pages in {manifest.layout}/{manifest.dtype}, the cache is {self.layout}/{self.dtype}"
            raise TransferError(msg)
        buffer = torch.empty(manifest.shape, dtype=self._dtype, device=self.device)
        try:
            work = dist.irecv(buffer, manifest.src_rank, tag=tag)
        except RuntimeError as error:
            raise TransferError(str(error).splitlines()[0][:200]) from error
        assert work is not None
        return _Work(work, buffer)

    def unpack(self, pending: object, manifest: Manifest, pages: NDArray[np.int32]) -> None:
        """Check the received bytes against the manifest's checksum, then write them into ``pages``.

        Raises:
            TransferError: The checksum does not match; nothing was written.

        """
        buffer = cast("_Work", pending).buffer
        if checksum(buffer) != manifest.checksum:
            msg = f"checksum mismatch for request {manifest.request_id!r} ({manifest.nbytes} bytes)"
            raise TransferError(msg)
        index = self._index(pages)
        for layer, received in zip(self.kv_cache, buffer, strict=True):
            layer[index] = received


# ---------------------------------------------------------------------------- configuration
@attrs.frozen
class RequestSpec:
    """One request of a run: its prompt length, output length and arrival (seconds after the start)."""

    prompt_len: int
    max_new_tokens: int = 8
    arrival_time: float = 0.0


def _specs(values: Sequence[Any]) -> tuple[RequestSpec, ...]:
    return tuple(v if isinstance(v, RequestSpec) else RequestSpec(**v) for v in values)


def _faults(value: Faults | Mapping[str, Any]) -> Faults:
    return value if isinstance(value, Faults) else Faults(**value)


@attrs.frozen
class PDRunConfig:
    """A P/D run: workers, model, KV, policy, requests, timeouts and injected faults.

    Attributes:
        num_prefill: Prefill workers (ranks ``0 .. num_prefill - 1``; rank 0 also routes).
        num_decode: Decode workers (the ranks after them).
        model: A ``phasesched_torch`` preset (``tiny``).
        seed: Weights (every rank builds the same model) and prompt tokens.
        page_size: Tokens per KV page.
        prefill_pages: KV pages per prefill worker.
        decode_pages: KV pages per decode worker (few: decode-side preemption).
        chunk_size: Prefill chunk (chunked prefill on the prefill side).
        max_num_batched_tokens: Token budget per step.
        requests: The workload.
        transfer_timeout_s: How long a pull may take.
        peer_timeout_s: A worker silent this long is declared dead.
        max_attempts: Attempts per request.
        run_timeout_s: Every rank exits after this long, whatever happens.
        backend: ``gloo`` (CPU) or ``nccl`` (GPUs).
        eager_send: The router orders each send when it places the request (never with NCCL,
            which ignores tags: decode workers then pull one at a time, in admission order).
        faults: Faults to inject.

    """

    num_prefill: int = 1
    num_decode: int = 1
    model: str = "tiny"
    seed: int = 0
    page_size: int = 4
    prefill_pages: int = 256
    decode_pages: int = 256
    chunk_size: int = 16
    max_num_batched_tokens: int = 64
    requests: tuple[RequestSpec, ...] = attrs.field(default=(RequestSpec(8),), converter=_specs)
    transfer_timeout_s: float = 2.0
    peer_timeout_s: float = 5.0
    max_attempts: int = 3
    run_timeout_s: float = 60.0
    backend: str = "gloo"
    eager_send: bool = True
    faults: Faults = attrs.field(factory=Faults, converter=_faults)

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.num_prefill + self.num_decode

    def to_json(self) -> str:
        """The config as JSON (what the launcher hands each rank)."""
        data = attrs.asdict(self)
        data["faults"] = {k: sorted(v) if isinstance(v, frozenset) else v for k, v in data["faults"].items()}
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> PDRunConfig:
        """The config from :meth:`to_json`."""
        return cls(**json.loads(text))

    def policy(self) -> SchedulingPolicy:
        """Every worker's policy: fixed chunks of ``chunk_size`` under the token budget."""
        return SchedulingPolicy(
            name="pd",
            budget=TokenBudget(max_num_batched_tokens=self.max_num_batched_tokens),
            chunker=FixedChunk(self.chunk_size),
        )


def make_requests(config: PDRunConfig, vocab_size: int = 512) -> list[Request]:
    """The run's requests: seeded random prompts, greedy, lengths fixed (EOS ignored)."""
    requests = []
    for i, spec in enumerate(config.requests):
        rng = np.random.default_rng((config.seed, i))
        tokens = rng.integers(1, vocab_size, spec.prompt_len).tolist()
        requests.append(
            Request(
                f"r{i}",
                prompt_token_ids=tokens,
                max_new_tokens=spec.max_new_tokens,
                ignore_eos=True,
                arrival_time=spec.arrival_time,
            )
        )
    return requests


def _executor(config: PDRunConfig, num_pages: int, device: torch.device) -> TorchExecutor:
    return create_executor(
        model=config.model, num_pages=num_pages, page_size=config.page_size, device=device, seed=config.seed
    )


def run_aggregated(config: PDRunConfig, num_pages: int | None = None) -> dict[str, tuple[int, ...]]:
    """Serve the run's requests on one aggregated worker in this process: the reference tokens."""
    pages = num_pages or config.prefill_pages
    executor = _executor(config, pages, torch.device("cpu"))
    scheduler = Scheduler(SchedulerConfig(num_pages=pages, page_size=config.page_size), config.policy())
    for request in make_requests(config, executor.model.config.vocab_size):
        scheduler.add_request(request)
    outputs: dict[str, tuple[int, ...]] = {}
    while scheduler.num_unfinished:
        plan = scheduler.schedule()
        for record in scheduler.update(plan, executor.execute(plan)).finished:
            outputs[record.request_id] = tuple(record.output_token_ids or ())
    return outputs


# ---------------------------------------------------------------------------- one rank
def _init(config: PDRunConfig, rank: int, addr: str, port: int) -> TCPStore:
    timeout = dt.timedelta(seconds=config.run_timeout_s)
    store = TCPStore(addr, port, config.world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(
        config.backend, store=PrefixStore("pg", store), rank=rank, world_size=config.world_size, timeout=timeout
    )
    return store


def _statuses(store: TCPStore, ranks: Sequence[int]) -> dict[int, WorkerStatus]:
    out = {}
    for rank in ranks:
        key = f"pd/status/{rank}"
        if store.check([key]):
            out[rank] = pickle.loads(store.get(key))  # noqa: S301 -- this job's own ranks wrote it
    return out


def _route(router: Router, messages: list[Message], store: TCPStore, mailbox: Mailbox, world: int) -> list[Message]:
    """Give the router its messages and the statuses, send what it answers; return the worker's messages."""
    outbox = []
    for message in messages:
        if isinstance(message, _ROUTER_MESSAGES):
            outbox += router.on_message(message, time.time())
    outbox += router.tick(time.time(), _statuses(store, range(world)))
    for dst, message in outbox:
        mailbox.send(dst, message)
    return [m for m in messages if not isinstance(m, _ROUTER_MESSAGES)]


def run_rank(config: PDRunConfig, rank: int, addr: str, port: int, output: str | None = None) -> int:
    """Run one rank until the router says it is over (or ``run_timeout_s``); return its exit code."""
    store = _init(config, rank, addr, port)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if config.backend == "nccl" else "cpu")
    is_prefill = rank < config.num_prefill
    executor = _executor(config, config.prefill_pages if is_prefill else config.decode_pages, device)
    scheduler = Scheduler(SchedulerConfig(num_pages=executor.num_pages, page_size=config.page_size), config.policy())
    mailbox = Mailbox(cast("KeyValueStore", store), rank)
    role = PrefillWorker if is_prefill else DecodeWorker
    worker = role(
        rank,
        scheduler,
        executor,
        TorchPageTransport(executor.kv_cache),
        mailbox,
        faults=config.faults,
        transfer_timeout_s=config.transfer_timeout_s,
    )
    kv_store = cast("KeyValueStore", store)
    last_status = 0.0

    def heartbeat() -> None:
        nonlocal last_status
        if time.monotonic() - last_status > 0.02:
            kv_store.set(f"pd/status/{rank}", pickle.dumps(worker.status()))
            last_status = time.monotonic()

    worker.heartbeat = heartbeat
    store.set(f"pd/ready/{rank}", "1")
    router = None
    if rank == 0:
        requests = make_requests(config, executor.model.config.vocab_size)
        store.wait([f"pd/ready/{r}" for r in range(config.world_size)])  # the run starts when every rank can answer
        store.set("pd/start", "1")
        router = Router(
            requests,
            range(config.num_prefill),
            range(config.num_prefill, config.world_size),
            start=time.time(),
            max_attempts=config.max_attempts,
            peer_timeout_s=config.peer_timeout_s,
            eager_send=config.eager_send and config.backend != "nccl",
        )
    else:
        store.wait(["pd/start"])
    deadline = time.monotonic() + config.run_timeout_s
    while time.monotonic() < deadline:
        messages = mailbox.receive()
        if router is not None:
            messages = _route(router, messages, store, mailbox, config.world_size)
        worker.handle_all(messages)
        if worker.shutdown:
            break
        worker.poll()
        stepped = worker.step()
        heartbeat()
        stall = worker.stall_now()
        if stall:
            time.sleep(stall)
        elif not stepped:
            time.sleep(0.001)
    report = worker.report()
    cast("KeyValueStore", store).set(f"pd/bye/{rank}", pickle.dumps(report))
    if router is not None:
        _finish_router(store, router, config, report, output)
    return 0 if worker.shutdown else 2


def _finish_router(
    store: TCPStore, router: Router, config: PDRunConfig, report: WorkerReport, output: str | None
) -> None:
    """Collect every rank's report (waiting a while for them), then write the run's results."""
    reports: dict[int, WorkerReport] = {0: report}
    grace = time.monotonic() + config.peer_timeout_s + 2.0  # a rank declared dead may only be slow
    while len(reports) < config.world_size and time.monotonic() < grace:
        for rank in range(1, config.world_size):
            key = f"pd/bye/{rank}"
            if rank not in reports and store.check([key]):
                reports[rank] = pickle.loads(store.get(key))  # noqa: S301 -- this job's own ranks wrote it
        time.sleep(0.01)
    if output is not None:
        result = PDRunResult.from_router(router, reports, config)
        Path(output).write_text(json.dumps(result.to_dict(), indent=1))


# ---------------------------------------------------------------------------- results
@attrs.frozen
class PDRunResult:
    """What a P/D run produced: one record per request, one report per rank that reported.

    Attributes:
        requests: Per request: ``state``, ``attempt``, ``errors``, ``output_token_ids``, and wall-clock
            ``arrival``, ``prefill_start``, ``prefill_end``, ``pull_start``, ``pull_end``, ``first_token``,
            ``finish``; ``nbytes`` and ``num_pages`` moved.
        workers: Per rank that reported: its :class:`~phasesched.pd.WorkerReport` as a dict.
        dead: Ranks the router declared dead.
        exit_codes: Per rank, its process's exit code (filled by :func:`launch`).

    """

    requests: dict[str, dict[str, Any]]
    workers: dict[int, dict[str, Any]]
    dead: tuple[int, ...]
    exit_codes: dict[int, int] = attrs.field(factory=dict)

    @classmethod
    def from_router(cls, router: Router, reports: Mapping[int, WorkerReport], config: PDRunConfig) -> PDRunResult:
        """Gather the router's outcomes and the ranks' reports."""
        del config
        requests = {}
        for request_id, o in router.outcomes.items():
            m, p, f = o.manifest, o.pulled, o.finished
            requests[request_id] = {
                "state": o.state.value,
                "attempt": o.attempt,
                "errors": list(o.errors),
                "prompt_len": o.request.prompt_len,
                "output_token_ids": list(f.output_token_ids) if f else None,
                "arrival": o.arrival,
                "prefill_start": m.prefill_start if m else None,
                "prefill_end": m.prefill_end if m else None,
                "pull_start": p.pull_start if p else None,
                "pull_end": p.pull_end if p else None,
                "first_token": f.first_token_time if f else None,
                "finish": f.finish_time if f else None,
                "nbytes": m.nbytes if m else None,
                "num_pages": m.num_pages if m else None,
                "num_preemptions": f.num_preemptions if f else None,
            }
        workers = {rank: attrs.asdict(r) for rank, r in reports.items()}
        return cls(requests, workers, tuple(sorted(router.dead)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PDRunResult:
        """Read :meth:`to_dict`'s output back."""
        return cls(
            dict(data["requests"]),
            {int(k): v for k, v in data["workers"].items()},
            tuple(data["dead"]),
            {int(k): v for k, v in data.get("exit_codes", {}).items()},
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return attrs.asdict(self)


# ---------------------------------------------------------------------------- launcher
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait(proc: subprocess.Popen[bytes], end: float) -> int:
    """The process's exit code, or -999 if it is still running at ``end`` (the caller kills it)."""
    try:
        return proc.wait(timeout=max(end - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        return -999


def launch(config: PDRunConfig, *, timeout_s: float | None = None, quiet: bool = True) -> PDRunResult:
    """Run ``config`` as ``world_size`` local processes, torchrun-style, and return its results.

    Every process started is waited for until ``timeout_s`` (default ``run_timeout_s + 15``),
    then killed if still running: none outlives the call.

    Raises:
        RuntimeError: Rank 0 wrote no results (it crashed or was killed).

    """
    timeout = timeout_s if timeout_s is not None else config.run_timeout_s + 15.0
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "result.json"
        config_path = Path(tmp) / "config.json"
        config_path.write_text(config.to_json())
        procs = []
        for rank in range(config.world_size):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(config.world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            command = [sys.executable, "-m", "phasesched_torch.pd", "--config", str(config_path)]
            if rank == 0:
                command += ["--output", str(output)]
            sink = subprocess.DEVNULL if quiet else None
            procs.append(subprocess.Popen(command, env=env, stdout=sink, stderr=sink))  # noqa: S603 -- our own module
        end = time.monotonic() + timeout
        try:
            codes = {rank: _wait(proc, end) for rank, proc in enumerate(procs)}
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)
        if not output.exists():
            msg = f"rank 0 wrote no results; exit codes {codes}"
            raise RuntimeError(msg)
        result = PDRunResult.from_dict(json.loads(output.read_text()))
    return attrs.evolve(result, exit_codes=codes)
