"""The kvcache command: exit codes and what it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(str(p) for p in (ROOT / "configs").glob("*.yaml"))


def test_validate_all_shipped_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", *CONFIGS]) == 0
    assert capsys.readouterr().out.count(": ok") == len(CONFIGS)


def test_validate_bad_block_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    text = (ROOT / "configs" / "tiny-cpu.yaml").read_text().replace("block_size: 32", "block_size: 48")
    bad.write_text(text)
    assert main(["validate", str(bad), CONFIGS[0]]) == 1
    err = capsys.readouterr().err
    assert "cache.block_size" in err and "48" in err and "32" in err and "1 of 2 file(s) invalid" in err


def test_validate_flash_attn_block_32(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "fa.yaml"
    text = (ROOT / "configs" / "llama3-8b-flash-attn.yaml").read_text().replace("block_size: 256", "block_size: 32")
    bad.write_text(text)
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "cache.block_size" in err and "256" in err


def test_plan_llama3_8b_on_80gib(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(ROOT / "configs" / "llama3-8b.yaml"), "--memory", "80GiB", "--max-seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    # 128 KiB per token (32 layers x 8 heads x 128 dims x 2 bytes x K,V); 0.9 x 80 GiB = 72 GiB
    assert "4,194,304" in out  # bytes per block: 32 tokens x 128 KiB
    assert "18,432" in out  # blocks: 72 GiB / 4 MiB
    assert "589,824 tokens" in out
    assert "72 at once" in out  # 18432 blocks / 256 blocks per 8192-token sequence


def test_plan_needs_memory_for_a_fractional_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(ROOT / "configs" / "llama3-8b.yaml")]) == 1
    assert "--memory" in capsys.readouterr().err


def test_schema_is_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["properties"]) == {"model", "cache", "attention"}


def test_console_script_exits_non_zero_without_a_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "validate", str(missing)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "no such file" in result.stderr and "Traceback" not in result.stderr
