"""benchmarks/profile_decode.py: refused arguments and no GPU (exit 2) on the CPU; on a GPU, a
small profile whose kernels add up to the call and whose output matches the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.bench_script import load_bench


def test_bad_arguments_and_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("profile_decode")
    for bad in (["--caches", "bf16,fp4"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.main(bad)
    if torch.cuda.is_available():
        return
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_small_profile(tmp_path: Path) -> None:
    bench = load_bench("profile_decode")
    out = tmp_path / "p.json"
    argv = ["--shapes", "32x512", "--blocks", "32", "--caches", "bf16,fp8", "--rounds", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["cache"] for r in rows] == ["bf16", "fp8"]
    for row in rows:
        assert row["rel_err"] < 0.05 and row["total_us"] > 0
        assert any("decode" in name for name in row["kernels_us"]), row["kernels_us"]
        assert abs(sum(row["kernels_us"].values()) - row["total_us"]) < 1e-6 * row["total_us"] + 1e-9
