# ruff: noqa: INP001 -- a script run by run_check.sh, not a module of a package
"""The offline GPU check of the FlashInfer executor: one run, one JSON report.

Run by ``run_check.sh`` after it installed the project's wheels and the bundle into one target
directory (``--site``) with FlashInfer's JIT disabled. With the real bundle it runs on the GPU;
with a stand-in bundle (manifest ``"kernels": "stand-in"``: the CPU fake of the kernels) the
same sections run on the CPU with tiny models, so CI rehearses the GPU run's layout end to end.

* ``environment`` (preflight, :mod:`preflight`): Python, torch, the GPU, the installed
  distributions and their entry points, and every prebuilt kernel module loaded. Anything
  missing: one line ``CANNOT RUN: ...`` and exit status 2, before any measurement.
* ``correctness``: the kernels alone against the float32 reference; the executor against the
  torch executor, step for step, with a tolerance of :data:`FLOOR_FACTOR` measured rounding
  floors (bf16 and fp16, plain and Llama 3.1 RoPE, Llama-3-8B widths); ``sensitivity``: each
  planted kernel-call bug must fail that comparison; CUDA-graph decodes against eager ones.
* ``timing``: decode steps by batch and context and prefill steps by chunk and prefix (the
  whole step, host preparation, forward, attention, RoPE + append, graphs), with the time
  outside kernels as a share of the step (goal: under 5% at batch 64), the HBM bandwidth a
  decode achieves and the TFLOP/s a prefill achieves against the H200's 4.8 TB/s and 989 TFLOP/s.
* ``profile``: ``phasesched profile`` over a grid, written as ``profile.csv``, which
  ``phasesched bench --cost-model`` must accept.
* ``simulator``: the profiled cost model's and the H200 roofline's predictions of the timed
  steps against their measured times.
* ``pytest``: the GPU tests (the stand-in: the packaging tests, in the same layout).

Writes ``check.json`` (rewritten after every section, so a timeout keeps what was done; its
shape is checked against :data:`SCHEMA`) and ``profile.csv`` under ``--out``. Exit status: 0
all passed, 1 a section failed, 2 the machine or layout cannot run the check.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by a test rather than run: preflight.py and bundle.py sit beside it
    sys.path.insert(0, str(HERE))

import preflight  # noqa: E402

REPO = HERE.parents[2]
EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2
REQUIRED_DTYPES = ("bfloat16", "float16")
"""Dtypes the check runs: every prebuilt module for them (and each model's head dim) must load."""
OVERHEAD_GOAL = {"batch_size": 64, "max_share": 0.05}
"""The executor's own time outside kernels, as a share of a decode step, should stay under this."""
PROFILE_ARGS = (
    "--model", "llama-3-8b", "--dtype", "bfloat16", "--page-size", "16",
    "--prefill-tokens", "0,128,512,2048", "--prefill-prefix", "0,1024",
    "--decode-seqs", "0,1,16,64", "--decode-context", "128,1024",
    "--repeats", "3", "--warmup", "1",
)  # fmt: skip
"""``phasesched profile`` options on the GPU (a 64-point grid on Llama-3-8B shapes)."""
STAND_IN_PROFILE_ARGS = (
    "--page-size", "4", "--prefill-tokens", "0,8", "--prefill-prefix", "0,4",
    "--decode-seqs", "0,2", "--decode-context", "8,16", "--repeats", "1", "--warmup", "0",
)  # fmt: skip
PYTEST_PATHS = ("tests/executors/flashinfer", "tests/executors/torch/test_executor.py")
"""Where the GPU tests live: FlashInfer's, and the torch executor's CUDA test."""
PYTEST_WARNINGS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "UserWarning")
"""Warning categories shown rather than raised (the root ``filterwarnings = ["error"]`` would
otherwise fail a test on any library warning of the GPU image; ``-W`` takes precedence)."""
_HEADROOM_BYTES = 6 << 30  # activations, workspace, graph pools and fragmentation beside the KV cache


def _say(message: str) -> None:
    sys.stdout.write(f"[check] {message}\n")
    sys.stdout.flush()


@dataclass
class Rig:
    """What differs between the GPU run and the CPU stand-in run (everything else is shared)."""

    stand_in: bool
    device: str
    page_size: int
    num_pages: int
    chunked_prompts: tuple[int, ...]
    chunk_size: int
    max_new_tokens: int
    graph_buckets: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    prefill_prefixes: tuple[int, ...]
    timing_pages: int
    repeats: int
    warmup: int
    profile_executor: str
    profile_args: tuple[str, ...]
    pytest_args: tuple[str, ...]
    kernel_heads: tuple[int, int] = (32, 8)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def gpu(cls) -> Rig:
        """The GPU run: Llama shapes, page 16, the real kernels and CUDA graphs."""
        return cls(
            stand_in=False,
            device="cuda",
            page_size=16,
            num_pages=512,
            chunked_prompts=(1, 7, 37, 64, 130, 300, 513),
            chunk_size=64,
            max_new_tokens=8,
            graph_buckets=(1, 2, 4, 8, 16),
            decode_batches=(1, 16, 64, 256),
            decode_contexts=(1024, 4096),
            prefill_tokens=(512, 2048),
            prefill_prefixes=(0, 4096),
            timing_pages=16640,
            repeats=20,
            warmup=5,
            profile_executor="flashinfer",
            profile_args=PROFILE_ARGS,
            pytest_args=("-m", "gpu", *PYTEST_PATHS),
        )

    @classmethod
    def cpu_stand_in(cls) -> Rig:
        """The rehearsal on a CPU: tiny models, page 4, the fake kernels and fake graphs; few repeats."""
        return cls(
            stand_in=True,
            device="cpu",
            page_size=4,
            num_pages=64,
            chunked_prompts=(3, 9, 21, 40),
            chunk_size=8,
            max_new_tokens=4,
            graph_buckets=(1, 2, 4, 8),
            decode_batches=(1, 4),
            decode_contexts=(8, 16),
            prefill_tokens=(8,),
            prefill_prefixes=(0, 8),
            timing_pages=64,
            repeats=2,
            warmup=1,
            profile_executor="flashinfer-standin",
            profile_args=STAND_IN_PROFILE_ARGS,
            pytest_args=(
                "-m",
                "not gpu",
                "-k",
                "entry_point or version_and_py_typed",
                "tests/executors/flashinfer/test_executor.py::TestPackaging",
            ),
            kernel_heads=(8, 2),
        )

    def models(self) -> dict[str, Any]:
        """The correctness section's model configs by case name prefix."""
        import attrs  # noqa: PLC0415

        from phasesched_flashinfer._check import CHECK_MODEL  # noqa: PLC0415
        from phasesched_torch import Llama3RopeScaling, LlamaConfig  # noqa: PLC0415

        base = _stand_in_config() if self.stand_in else CHECK_MODEL
        configs = {
            "executor": base,
            "executor_llama31_rope": attrs.evolve(
                base, rope_scaling=Llama3RopeScaling(original_max_position_embeddings=256)
            ),
        }
        if not self.stand_in:
            configs["executor_llama3.1-8b_2_layers"] = attrs.evolve(LlamaConfig.preset("llama-3.1-8b"), num_layers=2)
        return configs

    def timing_config(self) -> Any:
        """The timing section's model: Llama-3-8B on the GPU."""
        from phasesched_torch import LlamaConfig  # noqa: PLC0415

        return _stand_in_config() if self.stand_in else LlamaConfig.preset("llama-3-8b")

    def head_dims(self) -> tuple[int, ...]:
        """Head dims of every model the check builds (each needs its prebuilt modules)."""
        return tuple(sorted({c.head_dim for c in (*self.models().values(), self.timing_config())}))

    def graph_runtime(self) -> Any:
        """CUDA graphs (``None``: the executor's default) or the stand-in's checking runtime."""
        return importlib.import_module("flashinfer").CpuGraphRuntime() if self.stand_in else None


def _stand_in_config() -> Any:
    from phasesched_torch import LlamaConfig  # noqa: PLC0415

    return LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=128,
        rope_theta=500000.0,
    )


# --- environment (preflight) -----------------------------------------------------------------


def _torch_facts(rig: Rig, problems: list[str]) -> dict[str, Any]:
    try:
        torch = importlib.import_module("torch")
    except Exception as error:  # noqa: BLE001 -- any import failure means the same thing here
        problems.append(f"torch is not importable by {sys.executable} ({type(error).__name__}: {error})")
        return {"torch": None}
    facts: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if rig.stand_in or rig.extra.get("cpu_preflight"):
        return facts | {"gpu": None}
    if not torch.cuda.is_available():
        problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
        return facts | {"gpu": None}
    props = torch.cuda.get_device_properties(0)
    return facts | {
        "gpu": props.name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
    }


def _nvidia_smi() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "not on PATH"
    query = ["--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
    try:
        done = subprocess.run([smi, *query], capture_output=True, text=True, timeout=30, check=False)  # noqa: S603 -- fixed arguments
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"failed: {error}"
    return done.stdout.strip() or done.stderr.strip()


def section_environment(rig: Rig, manifest: dict[str, Any], site: Path) -> dict[str, Any]:
    """Facts about the machine and the layout; ``problems`` lists why the check cannot run (empty: it can)."""
    facts: dict[str, Any] = {
        "mode": "stand-in" if rig.stand_in else "gpu",
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "site": str(site),
        "disable_jit": os.environ.get("FLASHINFER_DISABLE_JIT"),
        "nvidia_smi": _nvidia_smi(),
        "bundle_manifest": {
            k: manifest.get(k) for k in ("kernels", "flashinfer_version", "tvm_ffi_version", "cuda_arch_list", "nvcc")
        },
    }
    problems: list[str] = []
    facts |= _torch_facts(rig, problems)
    facts["distributions"], found = preflight.distributions(site)
    problems += found
    facts["entry_points"], found = preflight.entry_points(REPO)
    problems += found
    try:
        flashinfer = importlib.import_module("flashinfer")
        tvm_ffi = importlib.import_module("tvm_ffi")
    except Exception as error:  # noqa: BLE001 -- any import failure means the same thing here
        problems.append(f"flashinfer is not importable ({type(error).__name__}: {error}); was the bundle installed?")
    else:
        facts["flashinfer"] = {"version": flashinfer.__version__, "path": str(Path(flashinfer.__file__).parent)}
        facts["tvm_ffi"] = getattr(tvm_ffi, "__version__", "?")
        if facts["torch"] is not None and not problems:
            modules = preflight.flashinfer_modules(
                stand_in=rig.stand_in, manifest=manifest, dtypes=REQUIRED_DTYPES, head_dims=rig.head_dims()
            )
            facts["prebuilt_modules"], found = preflight.prebuilt_modules(modules, manifest)
            problems += found
            if not modules:
                problems.append("the bundle lists no prebuilt modules")
    facts["problems"] = problems
    return facts


# --- correctness -----------------------------------------------------------------------------


def _workloads(rig: Rig, vocab_size: int) -> list[Any]:
    from phasesched_flashinfer._check import check_workloads  # noqa: PLC0415

    return check_workloads(
        vocab_size, chunked_prompts=rig.chunked_prompts, chunk_size=rig.chunk_size, max_new_tokens=rig.max_new_tokens
    )


def _executor(rig: Rig, model: Any, kernels: Any, **kwargs: Any) -> Any:
    from phasesched_flashinfer import FlashInferExecutor  # noqa: PLC0415

    return FlashInferExecutor(model, num_pages=rig.num_pages, page_size=rig.page_size, kernels=kernels, **kwargs)


def _lockstep_case(rig: Rig, config: Any, dtype: Any, kernels: Any) -> dict[str, Any]:
    """The executor against the torch executor, tolerance from the measured rounding floor."""
    from phasesched_flashinfer._check import calibrated_lockstep  # noqa: PLC0415
    from phasesched_torch import LlamaModel  # noqa: PLC0415

    model = LlamaModel.random(config, seed=11, dtype=dtype, device=rig.device, std=0.05)
    candidate = _executor(rig, model, kernels)
    report = calibrated_lockstep(
        model, candidate, _workloads(rig, config.vocab_size), num_pages=rig.num_pages, page_size=rig.page_size
    )
    out = report.summary() | {"paths": dict(candidate.backend.path_counts)}
    out["passed"] = report.passed and report.decode_only_steps > 0 and report.mixed_steps > 0
    return out


def _sensitivity(rig: Rig, config: Any, kernels: Any) -> dict[str, Any]:
    """Each planted kernel-call bug must fail the bf16 comparison (the check can fail)."""
    import torch  # noqa: PLC0415

    from phasesched_flashinfer._check import calibrated_lockstep, rounding_floor  # noqa: PLC0415
    from phasesched_flashinfer._planted import PLANTED_BUGS, plant  # noqa: PLC0415
    from phasesched_torch import LlamaModel  # noqa: PLC0415

    model = LlamaModel.random(config, seed=11, dtype=torch.bfloat16, device=rig.device, std=0.05)
    workloads = _workloads(rig, config.vocab_size)
    floor = rounding_floor(model, workloads, num_pages=rig.num_pages, page_size=rig.page_size)
    bugs = {}
    for bug in PLANTED_BUGS:
        candidate = _executor(rig, model, plant(kernels, bug))
        report = calibrated_lockstep(
            model, candidate, workloads, num_pages=rig.num_pages, page_size=rig.page_size, floor=floor
        )
        bugs[bug] = {
            "caught": not report.passed,
            "max_rel_logit_diff": report.max_rel_logit_diff,
            "floors": report.max_rel_logit_diff / floor if floor else math.inf,
        }
    return {"floor": floor, "bugs": bugs, "passed": all(b["caught"] for b in bugs.values())}


def _graphs_vs_eager(rig: Rig, config: Any, kernels: Any) -> dict[str, Any]:
    """CUDA-graph decodes (padded to buckets, replayed) against the eager executor's."""
    import torch  # noqa: PLC0415

    from phasesched_flashinfer._check import FLOOR_FACTOR, lockstep_compare, rounding_floor  # noqa: PLC0415
    from phasesched_torch import LlamaModel  # noqa: PLC0415

    model = LlamaModel.random(config, seed=11, dtype=torch.bfloat16, device=rig.device, std=0.05)
    workloads = _workloads(rig, config.vocab_size)
    floor = rounding_floor(model, workloads, num_pages=rig.num_pages, page_size=rig.page_size)
    eager = _executor(rig, model, kernels)
    graphs = _executor(
        rig, model, kernels, use_cuda_graph=True, graph_batch_sizes=rig.graph_buckets, graph_runtime=rig.graph_runtime()
    )
    report = None
    for requests, policy in workloads:
        report = lockstep_compare(
            eager,
            graphs,
            requests,
            policy,
            num_pages=rig.num_pages,
            page_size=rig.page_size,
            rel_tol=FLOOR_FACTOR * floor,
            report=report,
        )
    assert report is not None
    replays = graphs.graphs.replays
    out = report.summary() | {"floor": floor, "graph_replays": replays, "buckets": list(rig.graph_buckets)}
    out["passed"] = report.passed and replays == report.decode_only_steps > 0
    return out


def section_correctness(rig: Rig) -> dict[str, Any]:
    """Kernels vs the reference; executor vs the torch executor; planted bugs; graphs vs eager."""
    import torch  # noqa: PLC0415

    from phasesched_flashinfer import load_flashinfer  # noqa: PLC0415
    from phasesched_flashinfer._check import FLOOR_FACTOR, attention_kernel_check  # noqa: PLC0415

    kernels = load_flashinfer()
    device = torch.device(rig.device)
    results: dict[str, Any] = {"floor_factor": FLOOR_FACTOR}
    heads = {"num_heads": rig.kernel_heads[0], "num_kv_heads": rig.kernel_heads[1]}
    for name, dtype, atol in (("bf16", torch.bfloat16, 2e-2), ("fp16", torch.float16, 5e-3)):
        diffs = attention_kernel_check(kernels, device=device, dtype=dtype, **heads)
        results[f"kernels_{name}"] = diffs | {"atol": atol, "passed": max(diffs.values()) <= atol}
    models = rig.models()
    cases = [(f"{prefix}_bf16", config, torch.bfloat16) for prefix, config in models.items()]
    cases.insert(1, ("executor_fp16", models["executor"], torch.float16))
    for name, config, dtype in cases:
        results[name] = _guarded(lambda c=config, d=dtype: _lockstep_case(rig, c, d, kernels))
        _free_memory()
    results["sensitivity"] = _guarded(lambda: _sensitivity(rig, models["executor"], kernels))
    results["cuda_graphs_vs_eager_bf16"] = _guarded(lambda: _graphs_vs_eager(rig, models["executor"], kernels))
    results["passed"] = all(r.get("passed", False) for r in results.values() if isinstance(r, dict))
    return results


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one case; a failure is recorded (with its traceback) instead of ending the section."""
    start = time.monotonic()
    try:
        out = fn()
    except Exception as error:  # noqa: BLE001 -- the report names whatever went wrong
        out = {
            "passed": False,
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc()[-4000:],
        }
    out["seconds"] = round(time.monotonic() - start, 2)
    return out


# --- timing ----------------------------------------------------------------------------------


def _free_memory() -> None:
    gc.collect()
    importlib.import_module("torch").cuda.empty_cache()


def kv_pages_that_fit(config: Any, wanted: int, *, page_size: int = 16, dtype_bytes: int = 2) -> int:
    """``wanted`` KV pages, or fewer when the GPU's free memory (less a headroom) holds fewer."""
    import torch  # noqa: PLC0415

    page_bytes = config.num_layers * 2 * page_size * config.num_kv_heads * config.head_dim * dtype_bytes
    free, _ = torch.cuda.mem_get_info()
    return max(0, min(wanted, (free - _HEADROOM_BYTES) // page_bytes - 1))  # - 1: the executor's scratch page


def _timing_row(model: Any, timing: Any) -> dict[str, Any]:
    import attrs  # noqa: PLC0415

    from phasesched_flashinfer._timing import step_accounting  # noqa: PLC0415

    return attrs.asdict(timing) | step_accounting(model, timing)


def _decode_rows(rig: Rig, model: Any, pages: int) -> tuple[list[dict[str, Any]], list[list[int]], int]:
    """Eager decode rows, then graph steps on a graph executor built after the eager one is freed."""
    from phasesched_flashinfer import load_flashinfer  # noqa: PLC0415
    from phasesched_flashinfer._timing import decode_plan, time_decode_step, time_step  # noqa: PLC0415

    kernels = load_flashinfer()
    page = rig.page_size
    shapes = [(b, n) for n in rig.decode_contexts for b in rig.decode_batches if b * -(-n // page) <= pages]
    skipped = [[b, n] for n in rig.decode_contexts for b in rig.decode_batches if (b, n) not in shapes]
    eager = _executor(_with_pages(rig, pages), model, kernels)
    rows = []
    for b, n in shapes:
        plan = decode_plan(b, n, page_size=page, vocab_size=model.config.vocab_size)
        rows.append(_timing_row(model, time_step(eager, plan, repeats=rig.repeats, warmup=rig.warmup)))
    del eager
    _free_memory()
    buckets = tuple(sorted({b for b, _ in shapes}))
    graphs = _executor(
        _with_pages(rig, pages),
        model,
        kernels,
        use_cuda_graph=True,
        graph_batch_sizes=buckets,
        graph_runtime=rig.graph_runtime(),
    )
    for row, (b, n) in zip(rows, shapes, strict=True):
        row["graph_step_s"] = time_decode_step(graphs, batch_size=b, context=n, repeats=rig.repeats, warmup=rig.warmup)
        _say(
            f"decode B={b} ctx={n}: step {row['step_s'] * 1e3:.2f} ms (graphs {row['graph_step_s'] * 1e3:.2f}), "
            f"outside kernels {row['outside_kernels_share']:.1%}, HBM {row['hbm_tb_per_s']:.2f} TB/s"
        )
    replays = graphs.graphs.replays
    del graphs
    _free_memory()
    return rows, skipped, replays


def _with_pages(rig: Rig, pages: int) -> Rig:
    """``rig`` with a cache of ``pages`` pages (the timing model's, cut to the free memory)."""
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(rig, num_pages=pages)


def _prefill_rows(rig: Rig, model: Any, pages: int) -> list[dict[str, Any]]:
    from phasesched_flashinfer import load_flashinfer  # noqa: PLC0415
    from phasesched_flashinfer._timing import prefill_plan, time_step  # noqa: PLC0415

    executor = _executor(_with_pages(rig, pages), model, load_flashinfer())
    rows = []
    for prefix in rig.prefill_prefixes:
        for tokens in rig.prefill_tokens:
            if -(-(prefix + tokens) // rig.page_size) > pages:
                continue
            plan = prefill_plan(tokens, prefix, page_size=rig.page_size, vocab_size=model.config.vocab_size)
            row = _timing_row(model, time_step(executor, plan, repeats=rig.repeats, warmup=rig.warmup))
            rows.append(row | {"prefix": prefix})
            _say(f"prefill {tokens} after {prefix}: step {row['step_s'] * 1e3:.2f} ms, {row['tflops']:.1f} TFLOP/s")
    del executor
    _free_memory()
    return rows


def section_timing(rig: Rig) -> dict[str, Any]:
    """Decode steps by batch and context, prefill steps by chunk and prefix, on the timing model."""
    import torch  # noqa: PLC0415

    from phasesched_torch import LlamaModel  # noqa: PLC0415

    start = time.monotonic()
    config = rig.timing_config()
    model = LlamaModel.random(config, seed=0, dtype=torch.bfloat16, device=rig.device)
    pages = rig.timing_pages if rig.stand_in else kv_pages_that_fit(config, rig.timing_pages, page_size=rig.page_size)
    out: dict[str, Any] = {
        "model": f"{config.num_layers} layers, hidden {config.hidden_size} (random bf16 weights)",
        "num_pages": pages,
        "build_s": round(time.monotonic() - start, 1),
        "peaks": {"hbm_tb_per_s": 4.8, "bf16_tflops": 989.0},
    }
    decode, skipped, replays = _decode_rows(rig, model, pages)
    prefill = _prefill_rows(rig, model, pages)
    goal_rows = [r for r in decode if r["batch_size"] == OVERHEAD_GOAL["batch_size"]]
    share = max((r["outside_kernels_share"] for r in goal_rows), default=None)
    out |= {
        "decode": decode,
        "prefill": prefill,
        "skipped_decode_shapes": skipped,
        "graph_replays": replays,
        "overhead_goal": OVERHEAD_GOAL | {"share": share, "met": share is not None and share < 0.05},
    }
    del model
    out["passed"] = bool(decode) and bool(prefill) and replays > 0
    return out


# --- profile and simulator -------------------------------------------------------------------


def run_cli(arguments: list[str]) -> tuple[int, str]:
    """``phasesched ARGUMENTS`` in this process; its exit status and what it printed."""
    from phasesched.cli import main as cli_main  # noqa: PLC0415

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        status = cli_main(arguments)
    return status, printed.getvalue()


def _register_stand_in(name: str) -> str:
    """The stand-in run profiles the stand-in kernels under ``name``, registered in this process."""
    import torch  # noqa: PLC0415

    from phasesched.registry import EXECUTORS  # noqa: PLC0415
    from phasesched_flashinfer import FlashInferExecutor, load_flashinfer  # noqa: PLC0415
    from phasesched_torch import LlamaModel  # noqa: PLC0415

    def factory(*, num_pages: int, page_size: int = 16, seed: int = 0) -> FlashInferExecutor:
        model = LlamaModel.random(_stand_in_config(), seed=seed, dtype=torch.bfloat16)
        return FlashInferExecutor(model, num_pages=num_pages, page_size=page_size, kernels=load_flashinfer())

    if name in EXECUTORS:
        return "found in the registry"
    EXECUTORS.register(name, factory)
    return "stand-in factory registered in this process"


def section_profile(rig: Rig, out_dir: Path) -> dict[str, Any]:
    """``phasesched profile`` over a grid into profile.csv, then ``phasesched bench --cost-model`` on it."""
    import attrs  # noqa: PLC0415

    from phasesched.costmodel.profiled import ProfiledCostModel, read_profile_csv  # noqa: PLC0415

    start = time.monotonic()
    registration = _register_stand_in(rig.profile_executor) if rig.stand_in else "entry point"
    path = out_dir / "profile.csv"
    arguments = ["profile", "--executor", rig.profile_executor, "--output", str(path), *rig.profile_args, "--quiet"]
    status, printed = run_cli(arguments)
    out: dict[str, Any] = {
        "command": " ".join(["phasesched", *arguments]),
        "registration": registration,
        "returncode": status,
        "output": printed[-2000:],
    }
    if status != 0:
        return out | {"passed": False, "error": printed.strip().splitlines()[-1] if printed.strip() else "no output"}
    points, metadata = read_profile_csv(path)
    ProfiledCostModel.from_csv(path)
    with tempfile.TemporaryDirectory() as scratch:
        # The GPU's profile names its hardware (NVIDIA H200), which bench's default must accept;
        # the CPU stand-in's says cpu, which no preset is (nor gives the KV pages).
        mismatch = ["--allow-profile-mismatch", "--num-pages", "4096"] if rig.stand_in else []
        bench = [
            "bench",
            "decode",
            "--cost-model",
            str(path),
            *mismatch,
            "--quick",
            "--no-plots",
            "--quiet",
            "--output",
            scratch,
        ]
        bench_status, bench_printed = run_cli(bench)
    out |= {
        "csv": path.name,
        "metadata": metadata,
        "points": [attrs.asdict(p) for p in points],
        "bench_command": " ".join(["phasesched", *bench[:-2]]),
        "bench_returncode": bench_status,
        "bench_output": bench_printed[-1000:],
        "seconds": round(time.monotonic() - start, 1),
    }
    measured = all(p.step_time_s > 0 for p in points if p.prefill_tokens or p.decode_seqs)
    out["passed"] = bool(points) and measured and bench_status == 0
    return out


def _shape(row: dict[str, Any]) -> tuple[Any, Any]:
    import numpy as np  # noqa: PLC0415

    b, new = row["batch_size"], row["num_tokens"] // row["batch_size"]
    return np.full(b, new, dtype=np.int64), np.full(b, row["context"], dtype=np.int64)


def section_simulator(rig: Rig, report: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The profiled cost model's and the H200 roofline's predictions of each timed step against its time."""
    from phasesched.costmodel import RooflineCostModel  # noqa: PLC0415
    from phasesched.costmodel.profiled import ProfiledCostModel  # noqa: PLC0415

    timing = report["sections"].get("timing", {})
    rows = [("decode", r) for r in timing.get("decode", [])] + [("prefill", r) for r in timing.get("prefill", [])]
    if not rows or not (out_dir / "profile.csv").is_file():
        return {"passed": False, "error": "needs the timing and profile sections"}
    profiled = ProfiledCostModel.from_csv(out_dir / "profile.csv")
    roofline = RooflineCostModel.from_names("H200", "llama-3-8b")
    steps = []
    for kind, row in rows:
        num_new, kv_len = _shape(row)
        measured = row["step_s"]
        predicted = {"profiled": profiled.step_time(num_new, kv_len), "roofline": roofline.step_time(num_new, kv_len)}
        steps.append(
            {"kind": kind, "batch_size": row["batch_size"], "num_tokens": row["num_tokens"], "context": row["context"]}
            | {"measured_s": measured}
            | {f"{name}_s": value for name, value in predicted.items()}
            | {f"{name}_error": (value - measured) / measured for name, value in predicted.items()}
        )
    summary = {
        name: {
            "median_abs_error": sorted(abs(s[f"{name}_error"]) for s in steps)[len(steps) // 2],
            "max_abs_error": max(abs(s[f"{name}_error"]) for s in steps),
        }
        for name in ("profiled", "roofline")
    }
    finite = all(math.isfinite(s["profiled_s"]) and math.isfinite(s["roofline_s"]) for s in steps)
    note = "stand-in: the roofline prices an H200 and Llama-3-8B, not this CPU model" if rig.stand_in else ""
    return {"steps": steps, "summary": summary, "note": note, "passed": finite}


# --- pytest ----------------------------------------------------------------------------------


def section_pytest(rig: Rig, out_dir: Path, timeout_s: int) -> dict[str, Any]:
    """The GPU tests (the stand-in: packaging tests), as CI would run them, with a JUnit report."""
    warnings = [arg for category in PYTEST_WARNINGS for arg in ("-W", f"default::{category}")]
    python = [sys.executable, *(["-S"] if sys.flags.no_site else [])]  # the interpreter's own layout
    command = [
        *python, "-m", "pytest", *rig.pytest_args, "-q", "-p", "no:cacheprovider", *warnings,
        f"--junitxml={out_dir / 'pytest.xml'}",
    ]  # fmt: skip
    try:
        run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)  # noqa: S603 -- this Python, fixed arguments
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"pytest did not finish in {timeout_s} s"}
    tail = (run.stdout + run.stderr)[-3000:]
    summary = tail.strip().splitlines()[-1] if tail.strip() else ""
    # Nothing may skip: on the GPU a skip means CUDA or flashinfer was not found.
    ran_clean = run.returncode == 0 and re.search(r"\d+ passed", summary) and "skipped" not in summary
    return {
        "command": " ".join(command[1:]),
        "returncode": run.returncode,
        "summary": summary,
        "tail": tail,
        "passed": bool(ran_clean),
    }


# --- report shape ----------------------------------------------------------------------------

_NUM = (int, float)
_TIMING_ROW = {
    "batch_size": int, "context": int, "num_tokens": int, "step_s": _NUM, "prepare_s": _NUM, "forward_s": _NUM,
    "attention_s": _NUM, "rope_append_s": _NUM, "outside_kernels_s": _NUM, "outside_kernels_share": _NUM,
    "hbm_bytes": _NUM, "hbm_tb_per_s": _NUM, "hbm_utilization": _NUM, "attention_hbm_tb_per_s": _NUM,
    "flops": _NUM, "tflops": _NUM, "flops_utilization": _NUM, "attention_tflops": _NUM,
}  # fmt: skip
_LOCKSTEP = {
    "passed": bool, "rel_tol": _NUM, "floor": _NUM, "steps": int, "decode_only_steps": int, "mixed_steps": int,
    "first_decode_only_step": int, "min_decode_context": int, "sampled_tokens": int, "near_tie_share": _NUM,
    "unexplained_mismatches": int, "max_rel_logit_diff": _NUM,
}  # fmt: skip
SCHEMA: dict[str, Any] = {
    "status": str,
    "mode": str,
    "environment": {"python": str, "torch": str, "problems": list, "prebuilt_modules": dict, "entry_points": dict},
    "sections": {
        "correctness": {
            "passed": bool,
            "floor_factor": _NUM,
            "kernels_bf16": {"prefill_max_abs_diff": _NUM, "decode_max_abs_diff": _NUM, "passed": bool},
            "kernels_fp16": {"prefill_max_abs_diff": _NUM, "decode_max_abs_diff": _NUM, "passed": bool},
            "executor_bf16": _LOCKSTEP,
            "executor_fp16": _LOCKSTEP,
            "executor_llama31_rope_bf16": _LOCKSTEP,
            "sensitivity": {"passed": bool, "floor": _NUM, "bugs": dict},
            "cuda_graphs_vs_eager_bf16": _LOCKSTEP | {"graph_replays": int},
        },
        "timing": {
            "passed": bool,
            "decode": [_TIMING_ROW | {"graph_step_s": _NUM}],
            "prefill": [_TIMING_ROW | {"prefix": int}],
            "overhead_goal": {"batch_size": int, "max_share": _NUM, "met": bool},
            "peaks": {"hbm_tb_per_s": _NUM, "bf16_tflops": _NUM},
        },
        "profile": {"passed": bool, "csv": str, "points": list, "bench_returncode": int},
        "simulator": {
            "passed": bool,
            "steps": [
                {"kind": str, "measured_s": _NUM, "profiled_s": _NUM, "roofline_s": _NUM, "profiled_error": _NUM}
            ],
            "summary": {"profiled": {"median_abs_error": _NUM, "max_abs_error": _NUM}, "roofline": dict},
        },
        "pytest": {"passed": bool, "summary": str, "returncode": int},
    },
}
"""The shape every run's ``check.json`` has (GPU and stand-in alike): keys and JSON types."""


def schema_errors(value: Any, schema: Any = SCHEMA, where: str = "check.json") -> list[str]:
    """Where ``value`` departs from ``schema`` (dicts: required keys; a one-item list: every element)."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        errors = []
        for key, sub in schema.items():
            if key not in value:
                errors.append(f"{where}.{key}: missing")
            else:
                errors += schema_errors(value[key], sub, f"{where}.{key}")
        return errors
    if isinstance(schema, list):
        if not isinstance(value, list) or not value:
            return [f"{where}: expected a non-empty list"]
        return [e for i, item in enumerate(value) for e in schema_errors(item, schema[0], f"{where}[{i}]")]
    bad = isinstance(value, bool) and schema is not bool  # JSON true is not a number
    if bad or not isinstance(value, schema):
        expected = "number" if schema == _NUM else schema.__name__
        return [f"{where}: expected {expected}, got {type(value).__name__} {value!r:.40}"]
    return []


# --- driver ----------------------------------------------------------------------------------


def _write(report: dict[str, Any], out_dir: Path) -> None:
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    (out_dir / "check.json").write_text(json.dumps(public, indent=2, default=str) + "\n")


def _run_sections(rig: Rig, args: argparse.Namespace, report: dict[str, Any], deadline: float) -> None:
    out_dir = Path(args.out)
    sections = report["sections"]

    def run(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if time.monotonic() > deadline:
            sections[name] = {"passed": False, "error": "skipped: the check's time budget ran out"}
        else:
            _say(f"section {name} ...")
            sections[name] = _guarded(fn)
            _say(
                f"section {name}: {'ok' if sections[name].get('passed') else 'FAILED'} ({sections[name]['seconds']} s)"
            )
        _write(report, out_dir)
        _free_memory()

    chosen = {
        "correctness": lambda: section_correctness(rig),
        "timing": lambda: section_timing(rig),
        "profile": lambda: section_profile(rig, out_dir),
        "simulator": lambda: section_simulator(rig, report, out_dir),
    }
    for name, fn in chosen.items():
        if name in args.sections:
            run(name, fn)
    if "pytest" in args.sections:
        # Whatever is left before run_check.sh's hard limit, less a margin to write the report.
        remaining = int(args.limit_s - (time.monotonic() - report["_start"]) - 20)
        run("pytest", lambda: section_pytest(rig, out_dir, max(30, remaining)))


SECTIONS = ("correctness", "timing", "profile", "simulator", "pytest")


def main(argv: list[str] | None = None) -> int:
    """Preflight, then the sections; write check.json; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for check.json and profile.csv")
    parser.add_argument("--bundle", default=str(REPO / "gpu_bundle"), help="the bundle folder (for its manifest)")
    parser.add_argument("--site", required=True, help="the directory run_check.sh installed everything into")
    parser.add_argument("--install-log", default=None, help="pip's output from run_check.sh, kept in the report")
    parser.add_argument("--budget-s", type=float, default=270.0, help="start no section after this many seconds")
    parser.add_argument("--limit-s", type=float, default=390.0, help="the hard limit run_check.sh enforces")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--preflight-only", action="store_true", help="stop after the environment section")
    parser.add_argument(
        "--cpu-preflight",
        action="store_true",
        help="the preflight on a CPU machine (build_bundle.sh's last step): all but the GPU itself, then stop",
    )
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    manifest_path = Path(args.bundle) / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    rig = Rig.cpu_stand_in() if manifest.get("kernels") == "stand-in" else Rig.gpu()
    if rig.stand_in:  # tiny CPU models: intra-op threads only contend
        importlib.import_module("torch").set_num_threads(1)
    if args.cpu_preflight:
        rig.extra["cpu_preflight"] = args.preflight_only = True
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": "stand-in" if rig.stand_in else "gpu",
        "sections": {},
        "_start": start,
    }
    if args.install_log and Path(args.install_log).is_file():
        report["install_log"] = Path(args.install_log).read_text()[-2000:]
    report["environment"] = env = section_environment(rig, manifest, Path(args.site))
    if env["problems"]:
        report |= {
            "status": "unusable",
            "error": "; ".join(env["problems"]),
            "seconds": round(time.monotonic() - start, 1),
        }
        _write(report, out_dir)
        _say(f"CANNOT RUN: {report['error']}")
        return EXIT_UNUSABLE
    _say(
        f"{report['mode']}: {env.get('gpu') or 'CPU'}, torch {env['torch']}, flashinfer {env['flashinfer']['version']}"
    )
    _write(report, out_dir)
    if args.preflight_only:
        report["status"] = "preflight passed"
        _write(report, out_dir)
        return EXIT_OK
    _run_sections(rig, args, report, start + args.budget_s)
    failed = [name for name, result in report["sections"].items() if not result.get("passed")]
    report |= {"status": "failed" if failed else "passed", "failed": failed}
    if set(args.sections) == set(SECTIONS):
        report["schema_errors"] = schema_errors(report)
        if report["schema_errors"] and not failed:
            report["status"] = "failed"
    report["seconds"] = round(time.monotonic() - start, 1)
    _write(report, out_dir)
    _say(f"{report['status'].upper()} in {report['seconds']} s" + (f": {', '.join(failed)}" if failed else ""))
    return EXIT_OK if report["status"] == "passed" else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
