# ruff: noqa: INP001 -- a script beside check.py, not a module of a package
"""The check's preflight: what must hold before any measurement, each failure one short reason.

``check.py`` runs these first and, if any reason comes back, refuses in one line (``CANNOT RUN:
...``) with exit status 2, before it builds a model. They hold the layout ``run_check.sh`` makes
(the project's wheels and the bundle installed into one target directory, nothing else on the
path) to what the check needs:

* :func:`distributions`: ``phasesched``, ``phasesched-torch`` and ``phasesched-flashinfer`` are
  installed distributions, from that directory (not sources on ``PYTHONPATH``, not another copy);
* :func:`entry_points`: every policy and executor the three ``pyproject.toml`` files declare is
  an entry point, and the ones the check uses resolve (``load_policy``, ``EXECUTORS.get``);
* :func:`prebuilt_modules`: every kernel module the check will load, for each dtype and head dim
  it uses, is where FlashInfer looks for it (``flashinfer/data/aot/<name>/<name>.so``) and
  actually loads: through FlashInfer's own loader (``JitSpec.load``, tvm-ffi) on a GPU machine,
  through ``ctypes`` for the stand-in bundle's placeholders; a file whose size or hash is not the
  manifest's is refused before any load.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.metadata
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

PROJECT_FOLDERS = {
    "phasesched": ".",
    "phasesched-torch": "executors/torch",
    "phasesched-flashinfer": "executors/flashinfer",
}
"""Each distribution of the project and its folder in the repository."""
USED_POLICIES = ("sarathi",)
"""Policies the check itself loads."""
USED_EXECUTORS = ("torch", "flashinfer")
"""Executors the check (and its GPU tests) builds through the registry."""


def _under(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def distributions(site: Path) -> tuple[dict[str, Any], list[str]]:
    """Each project distribution's version and location; a reason for each missing or foreign one."""
    facts: dict[str, Any] = {}
    problems = []
    for name in PROJECT_FOLDERS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{name} is not an installed distribution (its entry points cannot exist)")
            continue
        location = Path(str(dist.locate_file("")))
        facts[name] = {"version": dist.version, "location": str(location)}
        if not _under(location, site):
            problems.append(f"{name} {dist.version} is installed at {location}, not from the check's {site}")
    return facts, problems


def declared_entry_points(repo: Path) -> dict[str, set[str]]:
    """The entry points the project's ``pyproject.toml`` files declare, by group."""
    import tomllib  # noqa: PLC0415 -- Python 3.11+, checked by run_check.sh

    declared: dict[str, set[str]] = {}
    for folder in PROJECT_FOLDERS.values():
        project = tomllib.loads((repo / folder / "pyproject.toml").read_text())["project"]
        for group, points in project.get("entry-points", {}).items():
            declared.setdefault(group, set()).update(points)
    return declared


def entry_points(repo: Path) -> tuple[dict[str, Any], list[str]]:
    """The registered entry points by group; a reason for each declared one missing or unusable."""
    declared = declared_entry_points(repo)
    facts: dict[str, Any] = {}
    problems = []
    for group, names in sorted(declared.items()):
        found = {point.name for point in importlib.metadata.entry_points(group=group)}
        facts[group] = sorted(found)
        missing = sorted(names - found)
        if missing:
            problems.append(f"no entry points for {group} {missing} (is the project installed as wheels?)")
    if problems:
        return facts, problems
    phasesched = importlib.import_module("phasesched")
    for name in USED_POLICIES:
        problems += _reason(f"policy {name!r}", lambda n=name: phasesched.load_policy(n, phasesched.PolicyOptions()))
    for name in USED_EXECUTORS:
        problems += _reason(f"executor {name!r}", lambda n=name: phasesched.EXECUTORS.get(n))
    return facts, problems


def _reason(what: str, fn: Callable[[], object]) -> list[str]:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 -- the reason names whatever went wrong
        return [f"{what} does not load ({type(error).__name__}: {error})"]
    return []


def _ctypes_load(path: Path) -> object:
    return ctypes.CDLL(str(path))


def _corruption(path: Path, recorded: dict[str, Any]) -> str | None:
    """Why ``path`` is not the file the manifest recorded (size, then hash), or ``None``.

    Checked before loading: the dynamic loader maps a truncated library and the process dies
    of SIGBUS at the first page past its end, with no message at all.
    """
    size = path.stat().st_size
    if "bytes" in recorded and size != recorded["bytes"]:
        return f"{size} bytes, the bundle's manifest says {recorded['bytes']}"
    if "sha256" in recorded:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != recorded["sha256"]:
            return f"sha256 {digest[:12]}..., the bundle's manifest says {recorded['sha256'][:12]}..."
    return None


def prebuilt_modules(
    modules: Iterable[tuple[str, Path, Callable[[Path], object]]], manifest: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """Load each ``(name, path, loader)``; a reason for each module missing, corrupt or failing to load."""
    facts: dict[str, Any] = {}
    problems = []
    recorded = manifest.get("modules", {})
    for name, path, load in modules:
        entry: dict[str, Any] = {"path": str(path), "loaded": False}
        facts[name] = entry
        if not path.is_file():
            problems.append(f"prebuilt module {name} is missing (no {path}; JIT is disabled)")
            continue
        entry["bytes"] = path.stat().st_size
        corrupt = _corruption(path, recorded.get(name, {}))
        if corrupt is not None:
            entry["error"] = corrupt
            problems.append(f"prebuilt module {name} is corrupt ({corrupt})")
            continue
        try:
            load(path)
        except Exception as error:  # noqa: BLE001 -- the reason names whatever went wrong
            entry["error"] = f"{type(error).__name__}: {error}"
            problems.append(f"prebuilt module {name} does not load ({entry['error']})")
            continue
        entry["loaded"] = True
    return facts, problems


def flashinfer_modules(
    *, stand_in: bool, manifest: dict[str, Any], dtypes: tuple[str, ...], head_dims: tuple[int, ...]
) -> list[tuple[str, Path, Callable[[Path], object]]]:
    """The modules the check will load, where FlashInfer looks for them, and how to load each.

    On a GPU machine these are FlashInfer's own specs for ``dtypes`` and ``head_dims``
    (``bundle.module_specs``), loaded as FlashInfer loads them; for the stand-in bundle, the
    manifest's placeholders under the installed ``flashinfer``, loaded with ``ctypes``.
    """
    if stand_in:
        aot = Path(importlib.import_module("flashinfer").__file__ or "").parent / "data" / "aot"
        return [(name, aot / name / f"{name}.so", _ctypes_load) for name in sorted(manifest.get("modules", {}))]
    from bundle import module_specs  # noqa: PLC0415 -- beside this script; imports flashinfer

    return [(spec.name, Path(spec.aot_path), spec.load) for spec in module_specs(dtypes, head_dims)]
