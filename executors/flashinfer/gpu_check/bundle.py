# ruff: noqa: INP001 -- a script run by build_bundle.sh, not a module of a package
"""Wheel surgery and ahead-of-time kernel builds for the offline FlashInfer bundle.

``build_bundle.sh`` drives it; each subcommand is one step, so a failed step can be rerun alone:

* ``trim``: unpack the stock flashinfer-python wheel and drop the CUDA sources of op families
  the executor never builds (every sub-directory of ``flashinfer/data/csrc`` but ``generated``).
  The attention, page and RoPE sources are top-level files there, and their Jinja templates
  are read even when a module is prebuilt, so those stay.
* ``aot``: compile exactly the modules the executor loads (see :func:`module_specs`) with nvcc
  on this machine, which needs no GPU, and copy each ``.so`` to
  ``flashinfer/data/aot/<name>/<name>.so`` inside the unpacked wheel: ``JitSpec.try_load``
  loads that path before it would compile anything.
* ``pack``: zip the tree back into a wheel with a correct ``RECORD``.
* ``verify``: in a ``pip install --target`` of the packed wheel, with JIT disabled, check that
  every module resolves to its prebuilt ``.so`` (and, given ``--load``, that the ``.so`` loads).
* ``project-wheels``: wheels of the project's own packages (``phasesched``, ``phasesched-torch``,
  ``phasesched-flashinfer``) from the working tree, with the standard library alone: no
  network, no build backend, so ``run_check.sh`` builds them on the GPU machine from the tree it
  was sent and installs them like the FlashInfer wheel (real distributions, so the policies'
  and executors' entry points exist), never from stale copies.
* ``stand-in``: a bundle for rehearsing the check on a CPU: a ``flashinfer`` wheel holding the
  test suite's CPU stand-in of the kernels and loadable placeholder ``.so`` files where the
  prebuilt modules go, a placeholder ``apache-tvm-ffi`` wheel, and a manifest saying
  ``"kernels": "stand-in"`` (``check.py`` then runs on the CPU, with tiny models).

The module list is the single source of truth for what the GPU check may run: fa2 batch
prefill (which the decode wrapper also runs, with ``use_tensor_cores=True``) for each dtype and
head dim, plus the dtype-generic ``page`` (``append_paged_kv_cache``) and ``rope`` modules.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PROJECT_PACKAGES = (".", "executors/torch", "executors/flashinfer")
"""The project's distributions, by their folder in the repository (each has a pyproject.toml)."""
STAND_IN_FAKE = "tests/executors/flashinfer/fake_flashinfer.py"
"""The CPU stand-in of FlashInfer's kernels the stand-in bundle carries as its ``flashinfer``."""

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (128,)


def _log(message: str) -> None:
    sys.stderr.write(f"[bundle] {message}\n")
    sys.stderr.flush()


def module_specs(dtypes: tuple[str, ...] = DTYPES, head_dims: tuple[int, ...] = HEAD_DIMS) -> list[Any]:
    """The JitSpecs of every module the executor loads (flashinfer must be importable)."""
    import torch  # noqa: PLC0415 -- only this subcommand needs torch and flashinfer
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module  # noqa: PLC0415
    from flashinfer.jit.page import gen_page_module  # noqa: PLC0415
    from flashinfer.jit.rope import gen_rope_module  # noqa: PLC0415

    # Arguments as BatchPrefillWithPagedKVCacheWrapper.plan passes them for backend="fa2", causal,
    # pos_encoding_mode="NONE" (0), int32 indices, no sliding window, no soft cap, no fp16 QK
    # reduction (FlashInfer's generators take these flags positionally).
    no_window, no_soft_cap, no_fp16_qk = False, False, False
    specs = [
        _gen_batch_prefill_primary_module(
            "fa2", dtype, dtype, dtype, torch.int32, hd, hd, 0, no_window, no_soft_cap, no_fp16_qk
        )
        for dtype in (getattr(torch, name) for name in dtypes)
        for hd in head_dims
    ]
    return [*specs, gen_page_module(), gen_rope_module()]


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cmd_trim(args: argparse.Namespace) -> None:
    """Unpack the wheel into ``--tree`` and drop the unused CUDA source families."""
    tree = Path(args.tree)
    if tree.exists():
        shutil.rmtree(tree)
    with zipfile.ZipFile(args.wheel) as wheel:
        wheel.extractall(tree)
    csrc = tree / "flashinfer" / "data" / "csrc"
    before = _dir_size(tree)
    for child in sorted(csrc.iterdir()):
        if child.is_dir() and child.name != "generated":
            shutil.rmtree(child)
    _log(f"trimmed {args.wheel}: {before / 2**20:.1f} MiB -> {_dir_size(tree) / 2**20:.1f} MiB unpacked")


def cmd_aot(args: argparse.Namespace) -> None:
    """Compile the modules and copy each ``.so`` into the unpacked wheel's ``data/aot``."""
    from flashinfer.jit import env as jit_env  # noqa: PLC0415
    from flashinfer.jit.core import build_jit_specs  # noqa: PLC0415

    tree = Path(args.tree).resolve()
    if not Path(jit_env.__file__).resolve().is_relative_to(tree):
        msg = f"flashinfer is imported from {jit_env.__file__}, not from the unpacked wheel {tree}"
        raise SystemExit(msg)
    specs = module_specs()
    _log("modules: " + ", ".join(s.name for s in specs))
    start = time.monotonic()
    build_jit_specs(specs, verbose=args.verbose, skip_prebuilt=False)
    seconds = time.monotonic() - start
    built = {}
    for spec in specs:
        target = tree / "flashinfer" / "data" / "aot" / spec.name / f"{spec.name}.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, target)
        built[spec.name] = {"bytes": target.stat().st_size, "sha256": _sha256(target)}
    Path(args.report).write_text(json.dumps({"build_seconds": seconds, "modules": built}, indent=2) + "\n")
    _log(f"built {len(specs)} modules in {seconds:.0f} s")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def cmd_pack(args: argparse.Namespace) -> None:
    """Zip the tree into ``--out`` (a wheel file name) with a freshly computed RECORD."""
    tree = Path(args.tree)
    (dist_info,) = tree.glob("*.dist-info")
    record_name = f"{dist_info.name}/RECORD"
    files = sorted(p for p in tree.rglob("*") if p.is_file() and p.relative_to(tree).as_posix() != record_name)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as wheel:
        for path in files:
            name = path.relative_to(tree).as_posix()
            data = path.read_bytes()
            wheel.writestr(name, data)
            rows.append(f"{name},{_record_hash(data)},{len(data)}")
        rows.append(f"{record_name},,")
        wheel.writestr(record_name, "\n".join(rows) + "\n")
    _log(f"packed {out} ({out.stat().st_size / 2**20:.1f} MiB, {len(files)} files)")


def cmd_manifest(args: argparse.Namespace) -> None:
    """Write ``manifest.json``: versions, modules, file hashes, build time."""
    bundle = Path(args.bundle)
    aot = json.loads(Path(args.aot_report).read_text())
    wheels = sorted(bundle.glob("*.whl"))
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in wheels}
    manifest = {
        "flashinfer_version": args.flashinfer_version,
        "tvm_ffi_version": args.tvm_ffi_version,
        "cuda_arch_list": os.environ.get("FLASHINFER_CUDA_ARCH_LIST", ""),
        "nvcc": args.nvcc_version,
        "dtypes": list(DTYPES),
        "head_dims": list(HEAD_DIMS),
        "modules": aot["modules"],
        "module_build_seconds": round(aot["build_seconds"], 1),
        "bundle_build_seconds": round(float(args.total_seconds), 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
        "bundle_bytes": sum(p.stat().st_size for p in wheels),
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    _log(f"manifest: {len(files)} wheels, {manifest['bundle_bytes'] / 2**20:.1f} MiB")


def cmd_verify(args: argparse.Namespace) -> None:
    """Check, in an installed copy, that every module resolves to a prebuilt ``.so``."""
    if os.environ.get("FLASHINFER_DISABLE_JIT") != "1":
        raise SystemExit("verify must run with FLASHINFER_DISABLE_JIT=1")
    import flashinfer  # noqa: PLC0415

    site = Path(args.site).resolve()
    if not Path(flashinfer.__file__).resolve().is_relative_to(site):
        msg = f"flashinfer imported from {flashinfer.__file__}, expected under {site}"
        raise SystemExit(msg)
    report: dict[str, Any] = {"flashinfer": flashinfer.__version__, "modules": {}}
    ok = True
    for spec in module_specs():
        entry: dict[str, Any] = {"aot": spec.is_aot, "path": str(spec.aot_path)}
        ok &= spec.is_aot
        if args.load and spec.is_aot:
            try:
                module = spec.load(spec.aot_path)
                entry["loaded"] = True
                entry["module"] = type(module).__name__
            except Exception as error:  # noqa: BLE001 -- the report names whatever went wrong
                entry["loaded"] = False
                entry["error"] = f"{type(error).__name__}: {error}"
                ok = False
        report["modules"][spec.name] = entry
    if args.load:
        report["runtime_getters"] = _runtime_getters()
        ok &= all(v == "loaded" for v in report["runtime_getters"].values())
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    if not ok:
        raise SystemExit("some modules are not prebuilt (or do not load)")


def _runtime_getters() -> dict[str, str]:
    """Resolve each module through the getters the wrappers call at plan/run time (not the specs)."""
    import torch  # noqa: PLC0415
    from flashinfer.page import get_page_module  # noqa: PLC0415
    from flashinfer.prefill import get_batch_prefill_module  # noqa: PLC0415
    from flashinfer.rope import get_rope_module  # noqa: PLC0415

    getters = {"page": get_page_module, "rope": get_rope_module}
    for name in DTYPES:
        dtype = getattr(torch, name)
        for hd in HEAD_DIMS:
            flags = (0, False, False, False)  # pos_encoding NONE, no window, no soft cap, no fp16 QK
            args = ("fa2", dtype, dtype, dtype, torch.int32, hd, hd, *flags)
            getters[f"batch_prefill_fa2_{name}_hd{hd}"] = lambda args=args: get_batch_prefill_module(*args)
    return {name: _try_load(getter) for name, getter in getters.items()}


def _try_load(getter: Any) -> str:
    try:
        getter()
    except Exception as error:  # noqa: BLE001 -- the report names whatever went wrong
        return f"{type(error).__name__}: {error}"
    return "loaded"


def write_wheel(  # noqa: PLR0913 -- the parts of one wheel
    out_dir: Path,
    name: str,
    version: str,
    files: Mapping[str, bytes],
    *,
    metadata: tuple[str, ...] = (),
    entry_points: Mapping[str, Mapping[str, str]] | None = None,
    tag: str = "py3-none-any",
) -> Path:
    """A wheel (PEP 427) of ``files`` (archive path -> content) with METADATA, WHEEL, entry points, RECORD."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *metadata, ""]
    ).encode()
    contents[f"{info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: phasesched-gpu-check\nRoot-Is-Purelib: true\nTag: {tag}\n"
    ).encode()
    if entry_points:
        sections = [
            f"[{group}]\n" + "".join(f"{key} = {target}\n" for key, target in sorted(points.items()))
            for group, points in sorted(entry_points.items())
        ]
        contents[f"{info}/entry_points.txt"] = "\n".join(sections).encode()
    path = out_dir / f"{dist}-{version}-{tag}.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [f"{arc},{_record_hash(data)},{len(data)}" for arc, data in sorted(contents.items())]
    rows.append(f"{info}/RECORD,,")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for arc, data in sorted(contents.items()):
            wheel.writestr(arc, data)
        wheel.writestr(f"{info}/RECORD", "\n".join(rows) + "\n")
    return path


def _metadata_lines(project: Mapping[str, Any]) -> tuple[str, ...]:
    lines = [f"Requires-Python: {project['requires-python']}"] if "requires-python" in project else []
    lines += [f"Requires-Dist: {req}" for req in project.get("dependencies", [])]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f"Requires-Dist: {req}; extra == '{extra}'" for req in requirements]  # hatchling's quotes
    return tuple(lines)


def project_wheel(folder: Path, out_dir: Path) -> Path:
    """The wheel of the distribution whose ``pyproject.toml`` is in ``folder`` (hatchling's layout).

    The packages are those ``[tool.hatch.build.targets.wheel] packages`` names, every file under
    them but bytecode; the metadata and entry points are ``[project]``'s.
    """
    import tomllib  # noqa: PLC0415 -- Python 3.11+, which the GPU image (3.12) has

    pyproject = tomllib.loads((folder / "pyproject.toml").read_text())
    project = pyproject["project"]
    files: dict[str, bytes] = {}
    for package in pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]:
        root = folder / package
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files[f"{root.name}/{path.relative_to(root).as_posix()}"] = path.read_bytes()
    entry_points = {group: dict(points) for group, points in project.get("entry-points", {}).items()}
    if "scripts" in project:
        entry_points["console_scripts"] = dict(project["scripts"])
    return write_wheel(
        out_dir,
        project["name"],
        project["version"],
        files,
        metadata=_metadata_lines(project),
        entry_points=entry_points,
    )


def cmd_project_wheels(args: argparse.Namespace) -> None:
    """Write the project's wheels into ``--out`` (replacing any there)."""
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    for folder in PROJECT_PACKAGES:
        _log(f"wheel {project_wheel(Path(args.repo) / folder, out).name}")


def _loadable_placeholder() -> bytes:
    """A real shared library that loads without a GPU: this Python's ``_ctypes`` extension."""
    import _ctypes  # noqa: PLC0415

    return Path(_ctypes.__file__).read_bytes()


def cmd_stand_in(args: argparse.Namespace) -> None:
    """Write a stand-in bundle into ``--bundle``: CPU kernels, placeholder modules and tvm-ffi, a manifest."""
    bundle, repo = Path(args.bundle), Path(args.repo)
    bundle.mkdir(parents=True, exist_ok=True)
    for old in bundle.glob("*.whl"):
        old.unlink()
    version, tvm_version = "0.7.2.post1", "0.1.15.post2"
    placeholder = _loadable_placeholder()
    files = {
        "flashinfer/__init__.py": (
            '"""CPU stand-in of flashinfer for rehearsing the GPU check (phasesched\'s test fake)."""\n\n'
            "from flashinfer._standin import *  # noqa: F403\n"
            "from flashinfer._standin import CpuGraphRuntime\n\n"
            f'__version__ = "{version}+standin"\n'
        ).encode(),
        "flashinfer/_standin.py": (repo / STAND_IN_FAKE).read_bytes(),
    }
    files |= {f"flashinfer/data/aot/{name}/{name}.so": placeholder for name in args.module}
    write_wheel(bundle, "flashinfer-python", version, files)
    doc = '"""Placeholder of apache-tvm-ffi (stand-in bundle)."""'
    tvm = {"tvm_ffi/__init__.py": f'{doc}\n\n__version__ = "{tvm_version}"\n'.encode()}
    write_wheel(bundle, "apache-tvm-ffi", tvm_version, tvm)
    manifest = {
        "kernels": "stand-in",
        "flashinfer_version": version,
        "tvm_ffi_version": tvm_version,
        "cuda_arch_list": "",
        "nvcc": None,
        "dtypes": list(DTYPES),
        "head_dims": list(HEAD_DIMS),
        "modules": {name: {"bytes": len(placeholder)} for name in args.module},
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "bundle_bytes": sum(p.stat().st_size for p in bundle.glob("*.whl")),
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    _log(f"stand-in bundle in {bundle}: {len(args.module)} placeholder modules")


def main(argv: list[str] | None = None) -> None:
    """Parse the subcommand and run it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    trim = sub.add_parser("trim")
    trim.add_argument("--wheel", required=True)
    trim.add_argument("--tree", required=True)
    aot = sub.add_parser("aot")
    aot.add_argument("--tree", required=True)
    aot.add_argument("--report", required=True)
    aot.add_argument("--verbose", action="store_true")
    pack = sub.add_parser("pack")
    pack.add_argument("--tree", required=True)
    pack.add_argument("--out", required=True)
    manifest = sub.add_parser("manifest")
    for option in ("--bundle", "--aot-report", "--flashinfer-version", "--tvm-ffi-version", "--nvcc-version"):
        manifest.add_argument(option, required=True)
    manifest.add_argument("--total-seconds", required=True)
    verify = sub.add_parser("verify")
    verify.add_argument("--site", required=True)
    verify.add_argument("--load", action="store_true", help="also load each .so (needs libcuda.so.1, a stub will do)")
    wheels = sub.add_parser("project-wheels")
    wheels.add_argument("--repo", required=True, help="the repository root")
    wheels.add_argument("--out", required=True, help="folder for the wheels (emptied first)")
    stand_in = sub.add_parser("stand-in")
    stand_in.add_argument("--repo", required=True, help="the repository root")
    stand_in.add_argument("--bundle", required=True, help="folder for the stand-in bundle")
    stand_in.add_argument("--module", action="append", default=[], help="a module name to place (repeatable)")
    args = parser.parse_args(argv)
    commands = {
        "trim": cmd_trim,
        "aot": cmd_aot,
        "pack": cmd_pack,
        "manifest": cmd_manifest,
        "verify": cmd_verify,
        "project-wheels": cmd_project_wheels,
        "stand-in": cmd_stand_in,
    }
    commands[args.command](args)


if __name__ == "__main__":
    main()
