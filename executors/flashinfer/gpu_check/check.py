# ruff: noqa: INP001 -- a script run by run_check.sh, not a module of a package
"""The offline GPU check of the FlashInfer executor: one run, one JSON report.

Run by ``run_check.sh`` on a GPU machine after the prebuilt bundle is installed (``--no-index``,
``FLASHINFER_DISABLE_JIT=1``). Sections, each timed and recorded even when another fails:

* ``environment``: Python, torch (must be the image's CUDA build; never installed here),
  the GPU, flashinfer and tvm-ffi as installed, and whether every prebuilt module of the
  bundle's manifest sits where ``JitSpec.try_load`` looks.
* ``correctness``: the kernels alone against the float32 reference; the executor against the
  torch reference executor on the same GPU, step for step on mixed prefill + decode batches
  (bf16 and fp16, plain and Llama 3.1 RoPE, Llama-3-8B widths); CUDA-graph decodes against eager.
* ``decode_timing``: one decode step at batch 1/16/64/256: the whole step, the forward, the
  attention kernels and RoPE + KV append (device events), the host's plan, graphs on and off
  (one Llama-3-8B executor at a time, so it fits an 80 GB H100 as well as an H200).
* ``profile``: ``phasesched profile --executor flashinfer`` run in-process over a small grid,
  writing the profiled cost model's CSV (the executor is registered here when no entry point
  is installed, as under run_check.sh's ``PYTHONPATH``).
* ``pytest``: the GPU tests (``-m gpu`` in ``tests/executors/flashinfer``: conformance and
  comparisons, and the torch executor's CUDA test), library warnings shown, not raised.

Writes ``check.json`` (rewritten after every section, so a timeout keeps what was done) and
``profile.csv`` under ``--out``. Exit status: 0 all passed, 1 a section failed, 2 the machine
cannot run the check at all (no CUDA torch, no flashinfer); the reason is printed and in the JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2


def _say(message: str) -> None:
    sys.stdout.write(f"[check] {message}\n")
    sys.stdout.flush()


# --- environment -----------------------------------------------------------------------------


def _torch_facts(problems: list[str]) -> dict[str, Any]:
    try:
        torch = importlib.import_module("torch")
    except Exception as error:  # noqa: BLE001 -- any import failure means the same thing here
        problems.append(
            f"torch is not importable by {sys.executable} ({type(error).__name__}: {error}); "
            "the check needs the image's CUDA build of torch and never installs one"
        )
        return {"torch": None}
    facts: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
        return facts
    props = torch.cuda.get_device_properties(0)
    return facts | {
        "gpu": props.name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
    }


def _flashinfer_facts(manifest: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    try:
        flashinfer = importlib.import_module("flashinfer")
        tvm_ffi = importlib.import_module("tvm_ffi")
    except Exception as error:  # noqa: BLE001 -- any import failure means the same thing here
        problems.append(f"flashinfer is not importable ({type(error).__name__}: {error}); was the bundle installed?")
        return {"flashinfer": None}
    facts = {
        "flashinfer": flashinfer.__version__,
        "flashinfer_path": str(Path(flashinfer.__file__).parent),
        "tvm_ffi": getattr(tvm_ffi, "__version__", "?"),
        "disable_jit": os.environ.get("FLASHINFER_DISABLE_JIT"),
    }
    try:
        from bundle import module_specs  # noqa: PLC0415 -- beside this script

        # The lookup JitSpec.try_load does: each module the executor loads resolves to a prebuilt .so.
        prebuilt = {spec.name: spec.is_aot for spec in module_specs()}
    except Exception as error:  # noqa: BLE001 -- the report names whatever went wrong
        problems.append(f"cannot list flashinfer's modules ({type(error).__name__}: {error})")
        return facts
    missing = sorted({n for n, ok in prebuilt.items() if not ok} | (set(manifest.get("modules", {})) - set(prebuilt)))
    if missing:
        problems.append(f"prebuilt modules missing (JIT is disabled): {missing}")
    return facts | {"prebuilt_modules": prebuilt}


def section_environment(bundle: Path) -> dict[str, Any]:
    """Facts about the machine; ``problems`` lists why the check cannot run here (empty: it can)."""
    manifest_path = bundle / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    facts: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "bundle_manifest": {
            k: manifest.get(k)
            for k in ("flashinfer_version", "tvm_ffi_version", "cuda_arch_list", "nvcc", "built_at", "bundle_bytes")
        },
    }
    smi = shutil.which("nvidia-smi")
    if smi is None:
        facts["nvidia_smi"] = "not on PATH"
    else:
        query = ["--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
        try:
            done = subprocess.run([smi, *query], capture_output=True, text=True, timeout=30, check=False)  # noqa: S603 -- fixed arguments
            facts["nvidia_smi"] = done.stdout.strip() or done.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            facts["nvidia_smi"] = f"failed: {error}"
    problems: list[str] = []
    facts |= _torch_facts(problems)
    if facts["torch"] is not None:
        facts |= _flashinfer_facts(manifest, problems)
    facts["problems"] = problems
    return facts


# --- measurements ----------------------------------------------------------------------------


def _lockstep(  # noqa: PLR0913 -- keyword-only knobs of one case
    config: Any, dtype: Any, *, rel_tol: float, prompts: tuple[int, ...], num_pages: int, graphs: bool = False
) -> dict[str, Any]:
    """Lockstep of the FlashInfer executor against the torch reference (or of graphs against eager)."""
    import attrs  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from phasesched import PolicyOptions, Request, load_policy  # noqa: PLC0415
    from phasesched_flashinfer import FlashInferExecutor  # noqa: PLC0415
    from phasesched_flashinfer._check import free_running_outputs, lockstep_compare  # noqa: PLC0415
    from phasesched_torch import LlamaModel, TorchExecutor  # noqa: PLC0415

    model = LlamaModel.random(config, seed=11, dtype=dtype, device="cuda", std=0.05)
    rng = np.random.default_rng(0)
    requests = [
        Request(f"r{i}", prompt_token_ids=rng.integers(0, config.vocab_size, n).tolist(), max_new_tokens=12)
        for i, n in enumerate(prompts)
    ]
    policy = load_policy("sarathi", PolicyOptions(chunk_size=128))

    def flashinfer(**kwargs: Any) -> Any:
        return FlashInferExecutor(model, num_pages=num_pages, page_size=16, **kwargs)

    reference = flashinfer() if graphs else TorchExecutor(model, num_pages=num_pages, page_size=16)
    candidate = flashinfer(use_cuda_graph=True, graph_batch_sizes=(1, 2, 4, 8, 16)) if graphs else flashinfer()
    report = lockstep_compare(
        reference, candidate, requests, policy, num_pages=num_pages, page_size=16, rel_tol=rel_tol
    )
    out = attrs.asdict(report) | {"passed": report.passed, "paths": dict(candidate.backend.path_counts)}
    if graphs:
        out["graph_replays"] = candidate.graphs.replays
        out["passed"] = out["passed"] and candidate.graphs.replays > 0
    else:  # free-running: each executor drives its own loop (informational: one near tie diverges a sequence)
        ref_out = free_running_outputs(
            TorchExecutor(model, num_pages=num_pages, page_size=16), requests, policy, num_pages=num_pages, page_size=16
        )
        cand_out = free_running_outputs(flashinfer(), requests, policy, num_pages=num_pages, page_size=16)
        same = [rid for rid in ref_out if ref_out[rid] == cand_out.get(rid)]
        out["free_running_identical_requests"] = f"{len(same)}/{len(ref_out)}"
    return out


def section_correctness() -> dict[str, Any]:
    """Kernels vs the reference; executor vs the torch executor; graphs vs eager."""
    import attrs  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from phasesched_flashinfer import load_flashinfer  # noqa: PLC0415
    from phasesched_flashinfer._check import CHECK_MODEL, attention_kernel_check  # noqa: PLC0415
    from phasesched_torch import Llama3RopeScaling, LlamaConfig  # noqa: PLC0415

    kernels = load_flashinfer()
    results: dict[str, Any] = {}
    for name, dtype, atol in (("bf16", torch.bfloat16, 2e-2), ("fp16", torch.float16, 5e-3)):
        diffs = attention_kernel_check(kernels, device=torch.device("cuda"), dtype=dtype)
        results[f"kernels_{name}"] = diffs | {"atol": atol, "passed": max(diffs.values()) <= atol}
    prompts = (1, 7, 37, 64, 130, 300, 513, 1000)
    llama31 = attrs.evolve(CHECK_MODEL, rope_scaling=Llama3RopeScaling(original_max_position_embeddings=256))
    llama8b_2l = attrs.evolve(LlamaConfig.preset("llama-3.1-8b"), num_layers=2)
    bf16, fp16 = torch.bfloat16, torch.float16
    cases = (  # name, model, dtype, relative logit tolerance, prompt lengths, graphs vs eager
        ("executor_bf16", CHECK_MODEL, bf16, 3e-2, prompts, False),
        ("executor_fp16", CHECK_MODEL, fp16, 1e-2, prompts, False),
        ("executor_llama31_rope_bf16", llama31, bf16, 3e-2, prompts, False),
        ("executor_llama3.1-8b_2_layers_bf16", llama8b_2l, bf16, 3e-2, prompts[:6], False),
        ("cuda_graphs_vs_eager_bf16", CHECK_MODEL, bf16, 1e-2, prompts, True),
    )
    for name, config, dtype, rel_tol, lengths, graphs in cases:
        results[name] = _guarded(
            lambda: _lockstep(config, dtype, rel_tol=rel_tol, prompts=lengths, num_pages=512, graphs=graphs)  # noqa: B023 -- called at once
        )
        torch.cuda.empty_cache()
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


DECODE_BATCH_SIZES = (1, 16, 64, 256)
"""Decode batches the timing section measures (each at ``--context`` tokens per slice)."""
PROFILE_ARGS = (
    "--model", "llama-3-8b", "--dtype", "bfloat16", "--page-size", "16",
    "--prefill-tokens", "0,128,512,2048", "--prefill-prefix", "0,1024",
    "--decode-seqs", "0,1,16,64", "--decode-context", "128,1024",
    "--repeats", "3", "--warmup", "1",
)  # fmt: skip
"""``phasesched profile`` options of the profile section (a 64-point grid on Llama-3-8B shapes)."""
PYTEST_PATHS = ("tests/executors/flashinfer", "tests/executors/torch/test_executor.py")
"""Where the GPU tests live: FlashInfer's, and the torch executor's CUDA test (its other test
modules need optional packages, transformers for one, that a skip would wrongly flag here)."""
PYTEST_WARNINGS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "UserWarning")
"""Warning categories shown rather than raised: the root pyproject's ``filterwarnings = ["error"]``
would otherwise fail a test on any library warning of the GPU image (``-W`` takes precedence)."""
_HEADROOM_BYTES = 6 << 30  # activations, workspace, graph pools and fragmentation beside the KV cache


def _free_cuda() -> None:
    import gc  # noqa: PLC0415

    gc.collect()
    importlib.import_module("torch").cuda.empty_cache()


def kv_pages_that_fit(config: Any, wanted: int, *, page_size: int = 16, dtype_bytes: int = 2) -> int:
    """``wanted`` KV pages, or fewer when the GPU's free memory (less a headroom) holds fewer."""
    import torch  # noqa: PLC0415

    page_bytes = config.num_layers * 2 * page_size * config.num_kv_heads * config.head_dim * dtype_bytes
    free, _ = torch.cuda.mem_get_info()
    return max(0, min(wanted, (free - _HEADROOM_BYTES) // page_bytes - 1))  # - 1: the executor's scratch page


def section_decode_timing(num_pages: int, context: int) -> dict[str, Any]:
    """One decode step at batch 1/16/64/256 (Llama-3-8B, bf16): attention kernels vs the whole step.

    The eager executor is timed first and freed before the CUDA-graph one is built on the same
    weights: two caches of 16,640 pages (32.5 GiB each) beside 16 GB of weights would not fit an
    80 GB H100. The cache is also cut to what the free memory holds; a batch whose pages do not
    fit then is skipped (and named).
    """
    import attrs  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from phasesched_flashinfer import FlashInferExecutor  # noqa: PLC0415
    from phasesched_flashinfer._check import time_decode, time_decode_step  # noqa: PLC0415
    from phasesched_torch import LlamaConfig, LlamaModel  # noqa: PLC0415

    start = time.monotonic()
    config = LlamaConfig.preset("llama-3-8b")
    model = LlamaModel.random(config, seed=0, dtype=torch.bfloat16, device="cuda")
    pages = kv_pages_that_fit(config, num_pages)
    sizes = tuple(b for b in DECODE_BATCH_SIZES if b * -(-context // 16) <= pages)
    out: dict[str, Any] = {
        "model": "llama-3-8b (random bf16 weights, 32 layers)",
        "context": context,
        "num_pages": pages,
        "build_s": round(time.monotonic() - start, 1),
        "skipped_batch_sizes": [b for b in DECODE_BATCH_SIZES if b not in sizes],
    }
    if not sizes:
        return out | {"passed": False, "error": f"{pages} KV pages fit in GPU memory: not one decode batch"}
    eager = FlashInferExecutor(model, num_pages=pages, page_size=16)
    timings = {b: time_decode(eager, batch_size=b, context=context, repeats=20, warmup=5) for b in sizes}
    del eager
    _free_cuda()
    graphs = FlashInferExecutor(model, num_pages=pages, page_size=16, use_cuda_graph=True, graph_batch_sizes=sizes)
    rows = []
    for batch_size in sizes:
        graph_s = time_decode_step(graphs, batch_size=batch_size, context=context, repeats=20, warmup=5)
        timing = attrs.evolve(timings[batch_size], graph_step_s=graph_s)
        rows.append(attrs.asdict(timing) | {"attention_fraction": round(timing.attention_fraction, 4)})
        _say(
            f"decode B={batch_size}: step {timing.step_s * 1e3:.2f} ms, attention {timing.attention_s * 1e3:.3f} ms, "
            f"graphs {graph_s * 1e3:.2f} ms"
        )
    replays = graphs.graphs.replays if graphs.graphs is not None else 0
    del graphs, model
    return out | {"rows": rows, "graph_replays": replays, "passed": replays > 0 and not out["skipped_batch_sizes"]}


def ensure_registered(name: str = "flashinfer") -> str:
    """Make ``name`` a registered executor; say how it was found.

    run_check.sh puts the sources on ``PYTHONPATH`` (nothing is pip-installed), so no
    distribution metadata, hence no entry point, exists for the executors: register the
    FlashInfer factory in-process then, as a notebook would.
    """
    from phasesched.registry import EXECUTORS  # noqa: PLC0415

    if name in EXECUTORS:
        return "found in the registry"
    from phasesched_flashinfer import create_executor  # noqa: PLC0415

    EXECUTORS.register(name, create_executor)
    return "registered by check.py (no entry point: the packages are on PYTHONPATH, not installed)"


def run_cli(arguments: list[str]) -> tuple[int, str]:
    """``phasesched ARGUMENTS`` in this process; its exit status and what it printed."""
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    from phasesched.cli import main as cli_main  # noqa: PLC0415

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        status = cli_main(arguments)
    return status, printed.getvalue()


def section_profile(
    out_dir: Path, *, executor: str = "flashinfer", options: tuple[str, ...] = PROFILE_ARGS
) -> dict[str, Any]:
    """``phasesched profile --executor flashinfer`` over a small grid: the profiled cost model's CSV."""
    import attrs  # noqa: PLC0415

    from phasesched.costmodel.profiled import ProfiledCostModel, read_profile_csv  # noqa: PLC0415

    start = time.monotonic()
    registration = ensure_registered(executor)
    path = out_dir / "profile.csv"
    arguments = ["profile", "--executor", executor, "--output", str(path), *options, "--quiet"]
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
    ProfiledCostModel.from_csv(path)  # the file must read back as a cost model
    return out | {
        "csv": path.name,
        "metadata": metadata,
        "points": [attrs.asdict(p) for p in points],
        "seconds": round(time.monotonic() - start, 1),
        "passed": bool(points) and all(p.step_time_s > 0 for p in points if p.prefill_tokens or p.decode_seqs),
    }


def section_pytest(out_dir: Path, timeout_s: int, paths: tuple[str, ...] = PYTEST_PATHS) -> dict[str, Any]:
    """The GPU tests, as CI would run them, with a JUnit report."""
    warnings = [arg for category in PYTEST_WARNINGS for arg in ("-W", f"default::{category}")]
    command = [
        sys.executable, "-m", "pytest", *paths, "-m", "gpu", "-q", "-p", "no:cacheprovider", *warnings,
        f"--junitxml={out_dir / 'pytest.xml'}",
    ]  # fmt: skip
    try:
        run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)  # noqa: S603 -- this Python, fixed arguments
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"pytest did not finish in {timeout_s} s"}
    tail = (run.stdout + run.stderr)[-3000:]
    summary = tail.strip().splitlines()[-1] if tail.strip() else ""
    # On the GPU nothing may skip: a skip here means CUDA or flashinfer was not found.
    ran_clean = run.returncode == 0 and re.search(r"\d+ passed", summary) and "skipped" not in summary
    return {
        "command": " ".join(command[1:]),
        "returncode": run.returncode,
        "summary": summary,
        "tail": tail,
        "passed": bool(ran_clean),
    }


# --- driver ----------------------------------------------------------------------------------


def _write(report: dict[str, Any], out_dir: Path) -> None:
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    (out_dir / "check.json").write_text(json.dumps(public, indent=2, default=str) + "\n")


def _run_sections(args: argparse.Namespace, report: dict[str, Any], deadline: float) -> None:
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

    if "correctness" in args.sections:
        run("correctness", section_correctness)
        _free_cuda()
    if "decode_timing" in args.sections:
        run("decode_timing", lambda: section_decode_timing(args.num_pages, args.context))
        _free_cuda()
    if "profile" in args.sections:
        run("profile", lambda: section_profile(out_dir))
        _free_cuda()
    if "pytest" in args.sections:
        # Whatever is left before run_check.sh's hard limit, less a margin to write the report.
        remaining = int(args.limit_s - (time.monotonic() - report["_start"]) - 20)
        run("pytest", lambda: section_pytest(out_dir, max(30, remaining)))


def main(argv: list[str] | None = None) -> int:
    """Run the sections; write check.json; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for check.json and profile.csv")
    parser.add_argument("--bundle", default=str(REPO / "gpu_bundle"), help="the bundle folder (for its manifest)")
    parser.add_argument("--install-log", default=None, help="pip's output from run_check.sh, kept in the report")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no section after this many seconds")
    parser.add_argument("--limit-s", type=float, default=420.0, help="the hard limit run_check.sh enforces")
    parser.add_argument(
        "--num-pages",
        type=int,
        default=16640,
        help="KV pages of the decode timing's Llama-3-8B executor (2 MiB each; fewer if free memory holds fewer)",
    )
    parser.add_argument("--context", type=int, default=1024, help="KV tokens per slice in the decode timing")
    parser.add_argument(
        "--sections", nargs="+", default=["correctness", "decode_timing", "profile", "pytest"],
        choices=["correctness", "decode_timing", "profile", "pytest"],
    )  # fmt: skip
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sections": {}}
    report["_start"] = start
    if args.install_log and Path(args.install_log).is_file():
        report["install_log"] = Path(args.install_log).read_text()[-2000:]
    report["environment"] = section_environment(Path(args.bundle))
    problems = report["environment"]["problems"]
    if problems:
        report |= {"status": "unusable", "error": "; ".join(problems), "seconds": round(time.monotonic() - start, 1)}
        _write(report, out_dir)
        _say(f"CANNOT RUN: {report['error']}")
        return EXIT_UNUSABLE
    env = report["environment"]
    _say(
        f"{env['gpu']} (sm{''.join(map(str, env['capability']))}), torch {env['torch']}, flashinfer {env['flashinfer']}"
    )
    _write(report, out_dir)
    _run_sections(args, report, start + args.budget_s)
    failed = [name for name, result in report["sections"].items() if not result.get("passed")]
    report |= {
        "status": "failed" if failed else "passed",
        "failed": failed,
        "seconds": round(time.monotonic() - start, 1),
    }
    _write(report, out_dir)
    _say(f"{report['status'].upper()} in {report['seconds']} s" + (f": {', '.join(failed)}" if failed else ""))
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
