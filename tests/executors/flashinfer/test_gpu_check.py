"""gpu_check/check.py on the CPU: the profile section through the CLI, the pytest command, the schema, KV sizing."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("phasesched_flashinfer", reason="install executors/flashinfer")

from phasesched.costmodel.profiled import ProfiledCostModel  # noqa: E402
from phasesched.registry import EXECUTORS  # noqa: E402
from phasesched_flashinfer import FlashInferExecutor  # noqa: E402
from phasesched_torch import LlamaConfig, LlamaModel  # noqa: E402
from tests.executors.flashinfer.helpers import CPU_MODEL, fake_executor  # noqa: E402
from tests.fakes import load_script  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
CHECK = REPO / "executors" / "flashinfer" / "gpu_check" / "check.py"
SMALL_GRID = (
    "--page-size", "4", "--prefill-tokens", "0,8", "--prefill-prefix", "0,4",
    "--decode-seqs", "0,2", "--decode-context", "8,16", "--repeats", "1", "--warmup", "0",
)  # fmt: skip


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_script(CHECK, "gpu_check_under_test")


def fake_factory(*, num_pages: int, page_size: int = 16, seed: int = 0) -> FlashInferExecutor:
    """An executor factory as the CLI calls it, on the CPU stand-in for flashinfer."""
    model = LlamaModel.random(CPU_MODEL, seed=seed, dtype=torch.bfloat16)
    return fake_executor(model, num_pages=num_pages, page_size=page_size)


class TestProfileSection:
    def test_writes_the_csv_through_the_cli_and_bench_reads_it(self, check: ModuleType, tmp_path: Path) -> None:
        """``phasesched profile`` runs in-process, and ``phasesched bench --cost-model`` accepts its CSV."""
        EXECUTORS.register("fake-flashinfer", fake_factory)
        rig = dataclasses.replace(check.Rig.cpu_stand_in(), profile_executor="fake-flashinfer")
        try:
            result = check.section_profile(rig, tmp_path)
        finally:
            EXECUTORS.unregister("fake-flashinfer")
        assert result["passed"], result
        assert result["registration"] == "found in the registry"
        assert result["command"].startswith("phasesched profile --executor fake-flashinfer --output ")
        assert result["metadata"]["executor"] == "fake-flashinfer"
        assert result["points"]
        assert result["bench_returncode"] == 0
        assert result["bench_command"].startswith("phasesched bench decode --cost-model ")
        ProfiledCostModel.from_csv(tmp_path / "profile.csv")

    def test_the_gpu_run_uses_the_entry_point(self, check: ModuleType, tmp_path: Path) -> None:
        """On the GPU the real name reaches create_executor through its entry point (here: no CUDA, a clear error)."""
        rig = dataclasses.replace(check.Rig.gpu(), profile_args=SMALL_GRID)
        result = check.section_profile(rig, tmp_path)
        assert result["registration"] == "entry point"
        assert not result["passed"]
        assert result["returncode"] == 1
        assert "needs a CUDA device" in result["error"]
        assert "--model llama-3-8b" not in result["command"]  # the options given replace the default grid
        assert not (tmp_path / "profile.csv").exists()


class TestPytestSection:
    def test_command(self, check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Both executors' GPU tests run, with library warnings shown instead of raised."""
        seen: dict[str, Any] = {}

        def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
            seen["command"], seen["cwd"] = command, kwargs["cwd"]
            return subprocess.CompletedProcess(command, 0, "3 passed, 400 deselected in 9.0s\n", "")

        monkeypatch.setattr(check.subprocess, "run", fake_run)
        result = check.section_pytest(check.Rig.gpu(), tmp_path, 60)
        assert result["passed"], result
        command = seen["command"]
        assert command[command.index("-m", 3) + 1] == "gpu"
        assert {"tests/executors/flashinfer", "tests/executors/torch/test_executor.py"} <= set(command)
        for category in ("DeprecationWarning", "UserWarning", "FutureWarning"):
            assert f"default::{category}" in command
        assert all(command[i - 1] == "-W" for i, arg in enumerate(command) if arg.startswith("default::"))

    def test_warning_flags_override_the_error_filter(self, check: ModuleType, tmp_path: Path) -> None:
        """With the root pyproject (filterwarnings = error), the section's -W flags let a library warning pass."""
        (tmp_path / "test_warns.py").write_text(
            "import warnings\n\n\ndef test_warns():\n"
            "    warnings.warn('old API', DeprecationWarning, stacklevel=1)\n"
            "    warnings.warn('heads up', UserWarning, stacklevel=1)\n"
        )
        flags = [arg for category in check.PYTEST_WARNINGS for arg in ("-W", f"default::{category}")]
        command = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path)]
        command += [str(tmp_path / "test_warns.py"), "-q", "-p", "no:cacheprovider", *flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "1 passed, 2 warnings" in done.stdout


class TestReportSchema:
    def test_names_what_is_missing_or_mistyped(self, check: ModuleType) -> None:
        """The schema check names each missing key, wrong type, empty row list, and a bool posing as a number."""
        schema = {"a": int, "b": {"c": (int, float)}, "rows": [{"x": str}]}
        assert check.schema_errors({"a": 1, "b": {"c": 0.5}, "rows": [{"x": "y"}]}, schema) == []
        errors = check.schema_errors({"a": "1", "b": {"c": True}, "rows": []}, schema)
        assert errors == [
            "check.json.a: expected int, got str '1'",
            "check.json.b.c: expected number, got bool True",
            "check.json.rows: expected a non-empty list",
        ]
        assert check.schema_errors({}, schema)[0] == "check.json.a: missing"

    def test_every_section_is_in_the_schema(self, check: ModuleType) -> None:
        """Each section the check runs has its shape declared."""
        assert set(check.SCHEMA["sections"]) == set(check.SECTIONS)


class TestKvSizing:
    @pytest.mark.parametrize(
        ("free_gib", "expected"),
        [
            (124.0, 16640),  # H200 after the 8B weights: as asked
            (63.0, 16640),  # H100 80 GB after the weights: still fits (one cache at a time)
            (10.0, 2047),  # 4 GiB over the headroom: 2048 pages of 2 MiB, less the scratch page
            (4.0, 0),
        ],
    )
    def test_pages_that_fit(
        self, check: ModuleType, monkeypatch: pytest.MonkeyPatch, free_gib: float, expected: int
    ) -> None:
        """The timing's cache is cut to the free memory less a headroom; Llama-3-8B pages are 2 MiB."""
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(free_gib * 2**30), 80 * 2**30))
        assert check.kv_pages_that_fit(LlamaConfig.preset("llama-3-8b"), 16640) == expected
