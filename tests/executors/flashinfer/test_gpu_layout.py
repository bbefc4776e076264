"""The GPU machine's layout, rehearsed on the CPU: run_check.sh on a stand-in bundle, in a fresh interpreter.

The interpreter is this test's Python with ``-S`` and only the third-party packages on its path
(this venv's site-packages less the project's own distributions and editable-install hooks), as
on the GPU image, where nothing of the project is installed. ``run_check.sh`` then builds the
project's wheels, installs them with the bundle into a fresh target directory, and runs
``check.py`` with the environment it exports. Planted broken layouts (the old sources-on-PYTHONPATH
layout without entry points, a missing or an unloadable prebuilt module, no tvm-ffi wheel for the
interpreter) must each be refused in one line before any measurement.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("phasesched_flashinfer", reason="install executors/flashinfer")

from tests.fakes import load_script  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
GPU_CHECK = REPO / "executors" / "flashinfer" / "gpu_check"
MODULES = ("batch_prefill_standin_bf16_hd128", "page", "rope")


class Layout:
    """A stand-in bundle, an interpreter that sees no project install, and the site run_check.sh made."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.deps = root / "deps"
        self.python = root / "bin" / "python"
        self.bundle = root / "bundle"
        self.site = root / "site"
        self.deps.mkdir(parents=True)
        sites = [Path(sysconfig.get_paths()["purelib"])]
        sites += [Path(p) for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p) not in sites]
        for site in sites:  # this venv's first, then any it sees beyond (a system torch, say)
            for entry in site.iterdir() if site.is_dir() else ():
                keep = not entry.name.startswith(("phasesched", "_editable_impl_")) and entry.suffix != ".pth"
                if keep and not (self.deps / entry.name).exists():
                    (self.deps / entry.name).symlink_to(entry)
        self.python.parent.mkdir()
        self.python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
        self.python.chmod(0o755)
        modules = [arg for name in MODULES for arg in ("--module", name)]
        bundle_py = [sys.executable, str(GPU_CHECK / "bundle.py")]
        subprocess.run(
            [*bundle_py, "stand-in", "--repo", str(REPO), "--bundle", str(self.bundle), *modules], check=True
        )

    def env(self, **extra: str) -> dict[str, str]:
        """The caller's environment with the project's installs out of sight (no venv, no user site)."""
        env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}}
        return env | {"PYTHON": str(self.python), "PYTHONPATH": str(self.deps)} | extra

    def run_check(
        self, out: Path, *, bundle: Path | None = None, check_args: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """``bash run_check.sh OUT`` as on the GPU machine, on this layout."""
        env = self.env(BUNDLE_DIR=str(bundle or self.bundle), SITE_DIR=str(self.site), CHECK_ARGS=check_args)
        command = ["bash", str(GPU_CHECK / "run_check.sh"), str(out)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False, cwd=REPO)

    def preflight(
        self, site: Path, out: Path, *, pythonpath: tuple[Path, ...] = ()
    ) -> subprocess.CompletedProcess[str]:
        """check.py's preflight alone on ``site``, with the variables run_check.sh exports."""
        path = os.pathsep.join(str(p) for p in (site, *pythonpath, self.deps))
        env = self.env(PYTHONPATH=path, PYTHONNOUSERSITE="1", FLASHINFER_DISABLE_JIT="1", PYTHONUNBUFFERED="1")
        command = [str(self.python), str(GPU_CHECK / "check.py"), "--out", str(out), "--bundle", str(self.bundle)]
        command += ["--site", str(site), "--preflight-only"]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False, cwd=REPO)

    def shadow_site(self, name: str, *, drop: tuple[str, ...] = ()) -> Path:
        """A copy of the installed site (links, but ``flashinfer`` copied) without the entries in ``drop``."""
        site = self.root / name
        site.mkdir()
        for entry in self.site.iterdir():
            if entry.name.startswith(drop):
                continue
            if entry.name == "flashinfer":
                shutil.copytree(entry, site / entry.name)
            else:
                (site / entry.name).symlink_to(entry)
        return site


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    """The layout, with run_check.sh's install done once (its preflight must pass)."""
    layout = Layout(tmp_path_factory.mktemp("gpu-layout"))
    done = layout.run_check(layout.root / "preflight-out", check_args="--preflight-only")
    assert done.returncode == 0, done.stdout + done.stderr
    return layout


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_script(GPU_CHECK / "check.py", "gpu_check_layout_under_test")


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout.strip().splitlines()[-1]


class TestInstall:
    def test_distributions_come_from_the_site_with_their_entry_points(self, layout: Layout) -> None:
        """After run_check.sh the project is three installed distributions with every entry point."""
        report = json.loads((layout.root / "preflight-out" / "check.json").read_text())
        env = report["environment"]
        assert report["status"] == "preflight passed"
        assert set(env["distributions"]) == {"phasesched", "phasesched-torch", "phasesched-flashinfer"}
        assert all(Path(d["location"]).resolve() == layout.site.resolve() for d in env["distributions"].values())
        assert {"sarathi", "vllm", "orca"} <= set(env["entry_points"]["phasesched.policies"])
        assert {"torch", "flashinfer", "sim"} <= set(env["entry_points"]["phasesched.executors"])
        assert all(m["loaded"] for m in env["prebuilt_modules"].values())
        assert set(env["prebuilt_modules"]) == set(MODULES)
        assert (layout.site / "bin" / "phasesched").is_file()

    def test_project_wheels_declare_what_the_build_backend_does(self, layout: Layout) -> None:
        """The stdlib wheels carry the same entry points and requirements as this venv's hatchling installs."""
        wheels = sorted(Path(f"{layout.site}.wheels").glob("*.whl"))
        assert len(wheels) == 3
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
                name = archive.read(f"{info}/METADATA").decode().split("Name: ", 1)[1].split("\n", 1)[0]
                points = archive.read(f"{info}/entry_points.txt").decode()
                requires = {
                    ln
                    for ln in archive.read(f"{info}/METADATA").decode().splitlines()
                    if ln.startswith("Requires-Dist")
                }
            installed = importlib.metadata.distribution(name)
            for point in installed.entry_points:
                assert f"{point.name} = {point.value}" in points, (name, point)
            assert _requirements(requires) == _requirements(installed.requires or ())


def _requirements(lines: Iterable[str]) -> set[str]:
    """Requirements in one spelling (packaging's), whatever the writer's order of specifiers and quotes."""
    from packaging.requirements import Requirement  # noqa: PLC0415

    return {str(Requirement(line.removeprefix("Requires-Dist: "))) for line in lines}


class TestPlantedLayouts:
    def test_sources_on_pythonpath_without_entry_points_are_refused(self, layout: Layout, tmp_path: Path) -> None:
        """The old layout (sources on PYTHONPATH, nothing installed) is refused in one line naming the entry points."""
        site = layout.shadow_site("site-no-dists", drop=("phasesched",))
        sources = (REPO / "src", REPO / "executors" / "torch" / "src", REPO / "executors" / "flashinfer" / "src")
        done = layout.preflight(site, tmp_path, pythonpath=sources)
        assert done.returncode == 2, done.stdout + done.stderr
        line = _last_line(done)
        assert line.startswith("[check] CANNOT RUN: phasesched is not an installed distribution")
        assert "no entry points for phasesched.policies" in line
        assert json.loads((tmp_path / "check.json").read_text())["status"] == "unusable"

    def test_an_unloadable_module_is_refused(self, layout: Layout, tmp_path: Path) -> None:
        """A prebuilt module of the right size that does not load (not a library) is refused, naming it."""
        site = layout.shadow_site("site-bad-so")
        so = site / "flashinfer" / "data" / "aot" / "page" / "page.so"
        so.write_bytes(b"\0" * so.stat().st_size)
        done = layout.preflight(site, tmp_path)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "prebuilt module page does not load (OSError" in _last_line(done)

    def test_a_truncated_module_is_refused_before_loading(self, layout: Layout, tmp_path: Path) -> None:
        """A truncated module (which would kill the loader with SIGBUS) is refused by its manifest size."""
        site = layout.shadow_site("site-short-so")
        so = site / "flashinfer" / "data" / "aot" / "page" / "page.so"
        so.write_bytes(so.read_bytes()[:4096])
        done = layout.preflight(site, tmp_path)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "prebuilt module page is corrupt (4096 bytes, the bundle's manifest says" in _last_line(done)

    def test_a_missing_module_is_refused(self, layout: Layout, tmp_path: Path) -> None:
        """A prebuilt module the bundle lists but does not hold is refused before any measurement."""
        site = layout.shadow_site("site-no-so")
        (site / "flashinfer" / "data" / "aot" / "rope" / "rope.so").unlink()
        done = layout.preflight(site, tmp_path)
        assert done.returncode == 2
        assert "prebuilt module rope is missing" in _last_line(done)

    def test_no_tvm_ffi_wheel_for_this_python_is_refused(self, layout: Layout, tmp_path: Path) -> None:
        """A bundle without an apache-tvm-ffi wheel for the interpreter is refused by run_check.sh at once."""
        bundle = tmp_path / "bundle"
        shutil.copytree(layout.bundle, bundle)
        for wheel in bundle.glob("apache_tvm_ffi-*.whl"):
            wheel.unlink()
        done = layout.run_check(tmp_path / "out", bundle=bundle)
        assert done.returncode == 3
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        assert f"CANNOT RUN: the bundle has no apache-tvm-ffi 0.1.15.post2 wheel for Python {version}" in done.stdout
        assert json.loads((tmp_path / "out" / "check.json").read_text())["status"] == "unusable"


@pytest.mark.slow
class TestStandInRun:
    def test_the_whole_check_passes_with_the_report_schema(self, layout: Layout, check: ModuleType) -> None:
        """run_check.sh runs every section on the stand-in and writes a check.json of the GPU run's shape."""
        out = layout.root / "out"
        done = layout.run_check(out)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        report = json.loads((out / "check.json").read_text())
        assert (report["mode"], report["status"], report["schema_errors"]) == ("stand-in", "passed", [])
        assert check.schema_errors(report) == []
        sensitivity = report["sections"]["correctness"]["sensitivity"]
        assert all(bug["caught"] for bug in sensitivity["bugs"].values())
        assert report["sections"]["correctness"]["cuda_graphs_vs_eager_bf16"]["graph_replays"] > 0
        assert report["sections"]["profile"]["bench_returncode"] == 0
        assert {p.name for p in out.iterdir()} >= {"check.json", "check.log", "profile.csv", "pytest.xml"}
