"""Vidur's mlp.csv and attention.csv layout, converted into our profile table (hand-made files, no data shipped)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phasesched.cli import main
from phasesched.costmodel import ProfiledCostModel, read_profile_csv
from phasesched.costmodel.profiled import ProfileFormatError
from phasesched.costmodel.vidur import LAYER_OPS, read_vidur

STATS = ("min", "max", "mean", "median", "std")


def _op_columns(name: str, median: float) -> dict[str, float]:
    return {f"time_stats.{name}.{stat}": median * (1.1 if stat == "max" else 1.0) for stat in STATS}


def write_mlp(path: Path, tokens: list[int]) -> None:
    """Each layer op takes 0.001 ms per token (add: 0.0005), the embedding 0.01 ms flat; one TP2 row to ignore."""
    header = [f"time_stats.{op}.{s}" for op in ("emb", *LAYER_OPS, "add") for s in STATS]
    header += ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tokens"]
    header += ["num_tensor_parallel_workers"]
    lines = [",".join(header)]
    for tp in (1, 2):
        for n in tokens:
            row: dict[str, float] = _op_columns("emb", 0.01)
            for op in LAYER_OPS:
                row |= _op_columns(op, 0.001 * n * tp)
            row |= _op_columns("add", 0.0005 * n)
            values = [row[h] for h in header[: len(row)]] + [32, 8, 4096, 14336, 128256, "True", n, tp]
            lines.append(",".join(str(v) for v in values))
    path.write_text("\n".join(lines) + "\n")


def write_attention(path: Path) -> None:
    """Prefill: 0.0001 ms per (chunk token x (kv + chunk)); decode: 0.00001 ms per (sequence x context)."""
    header = (
        "n_embd,n_q_head,n_kv_head,block_size,num_tensor_parallel_workers,max_model_len,batch_size,"
        "prefill_chunk_size,kv_cache_size,is_prefill,attention_backend,"
        "time_stats.attn_prefill.median,time_stats.attn_decode.median,time_stats.attn_kv_cache_save.median"
    )
    prefill = [
        f"4096,32,8,16,1,16384,1,{chunk},{kv},True,FLASHINFER,{1e-4 * chunk * (kv + chunk)},,0.01"
        for chunk in (64, 512, 2048)
        for kv in (0, 1024, 8192)
    ]
    decode = [
        f"4096,32,8,16,1,16384,{batch},0,{kv},False,FLASHINFER,,{1e-5 * batch * kv},0.01"
        for batch in (1, 16, 256)
        for kv in (128, 4096, 16384)
    ]
    lines = [header, *prefill, *decode]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def vidur_files(tmp_path: Path) -> tuple[Path, Path]:
    mlp, attention = tmp_path / "mlp.csv", tmp_path / "attention.csv"
    write_mlp(mlp, [1, 256, 496, 512, 528, 1024, 2048, 4096])
    write_attention(attention)
    return mlp, attention


class TestVidur:
    def test_step_is_priced_as_vidur_prices_it(self, vidur_files: tuple[Path, Path]) -> None:
        """emb + layers x (8 ops + 2 adds + prefill attention + decode attention), at measured points exactly."""
        profile = read_vidur(*vidur_files, num_layers=32, tp=1)
        linear = 8 * 0.001 * 528 + 2 * 0.0005 * 528  # P + D = 512 + 16 tokens
        prefill = 1e-4 * 512 * (1024 + 512)
        decode = 1e-5 * 16 * 4096
        expected_ms = 0.01 + 32 * (linear + prefill + decode)
        assert profile.step_time_s(512, 1024, 16, 4096) == pytest.approx(expected_ms / 1e3)

    def test_interpolates_between_measured_points(self, vidur_files: tuple[Path, Path]) -> None:
        """Between kv 1024 and 8192 the prefill attention is linear in kv."""
        profile = read_vidur(*vidur_files, num_layers=1, tp=1)
        low, high = profile.step_time_s(512, 1024, 0, 16), profile.step_time_s(512, 8192, 0, 16)
        assert profile.step_time_s(512, 4608, 0, 16) == pytest.approx((low + high) / 2)

    def test_grid_keeps_every_measured_token_count(self, vidur_files: tuple[Path, Path]) -> None:
        """The prefill axis holds 496, 512 and 528, so a jump at 512 is not smoothed away."""
        points = read_vidur(*vidur_files, num_layers=32).points()
        assert {496, 512, 528} <= {p.prefill_tokens for p in points}
        ProfiledCostModel(points)  # a full grid

    def test_missing_column_is_a_format_error(self, tmp_path: Path, vidur_files: tuple[Path, Path]) -> None:
        """A file without Vidur's columns is refused with the column's name."""
        bad = tmp_path / "bad.csv"
        bad.write_text("num_tokens,num_tensor_parallel_workers\n1,1\n")
        with pytest.raises(ProfileFormatError, match="time_stats"):
            read_vidur(bad, vidur_files[1], num_layers=32)

    def test_command(self, tmp_path: Path, vidur_files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
        """`phasesched profile import-vidur` writes a profile that bench accepts for the recorded setup."""
        mlp, attention = vidur_files
        out = tmp_path / "profile.csv"
        args = ["--mlp", str(mlp), "--attention", str(attention), "--model", "llama-3-8b", "--hardware", "A100-80GB"]
        assert main(["profile", "import-vidur", *args, "--output", str(out)]) == 0
        assert "wrote" in capsys.readouterr().out
        _, metadata = read_profile_csv(out)
        assert (metadata["source"], metadata["hardware"], metadata["model"]) == ("vidur", "A100-80GB", "llama-3-8b")
        results = tmp_path / "bench"
        bench = ["bench", "prefill", "--quick", "--no-plots", "--quiet", "--output", str(results)]
        assert main([*bench, "--hardware", "A100-80GB", "--cost-model", str(out)]) == 0
        deployment = json.loads((results / "results.json").read_text())["deployment"]
        assert deployment["cost_model_source"] == f"profiled table {out}"

    def test_import_needs_its_files(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Without --mlp and friends it is a usage error naming what is missing."""
        assert main(["profile", "import-vidur", "--output", "x.csv"]) == 2
        assert "needs --mlp, --attention, --model, --hardware" in capsys.readouterr().err
