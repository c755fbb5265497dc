"""The kvcache command: exit codes and what it prints."""

from __future__ import annotations

import json
import os
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


@pytest.mark.parametrize(
    ("dtype", "words"),
    [
        # 32 layers x 8 heads x 2 (K, V) x (128 values + 4 bytes: a 128-byte row of scales per 32 tokens)
        ("int8", ["67,584 (66.00 KiB)", "fp16 per token and KV head", "2,048 of the 67,584 bytes per token"]),
        ("float8_e4m3", ["65,536 (64.00 KiB)", "fp32 per layer and KV head", "2,048 bytes in all"]),
    ],
)
def test_plan_shows_what_a_scaled_caches_scales_cost(
    dtype: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (ROOT / "configs" / "llama3-8b.yaml").read_text().replace("  dtype: bfloat16", f"  dtype: {dtype}")
    config = tmp_path / "scaled.yaml"
    config.write_text(text.replace("model:\n", "model:\n  dtype: bfloat16\n"))
    assert main(["plan", str(config), "--memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    for w in words:
        assert w in out, (w, out)
    assert "rotated" not in out
    # The same cache with K and V rotated: the same bytes, and the plan says so.
    config.write_text(config.read_text().replace(f"dtype: {dtype}", f"dtype: {dtype}\n  kv_rotation: hadamard"))
    assert main(["plan", str(config), "--memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert all(w in out for w in words) and "K and V stored rotated (cache.kv_rotation: hadamard)" in out, out


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


def test_validate_bundled_names_and_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "tiny-cpu", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "tiny-cpu: ok" in out and "llama3-8b: ok" in out and "all 2 files ok" in out


def test_validate_goes_on_after_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {num_layers: 2\n")
    assert main(["validate", str(broken), "no-such-config", "tiny-cpu", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "tiny-cpu: ok" in captured.out
    assert "not valid YAML" in captured.err and "neither a file nor a bundled config" in captured.err
    assert "is a directory" in captured.err and "3 of 4 file(s) invalid" in captured.err


def test_list_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list-configs"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == sorted(Path(p).stem for p in CONFIGS)
    assert "A tiny model shape that runs on a CPU in seconds" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["plan", "llama3-8b", "--memory", "0B"], ["no block fits", "holds no block of 4.00 MiB", "--memory"]),
        (["plan", "llama3-8b", "--memory", "4MiB"], ["no block fits", "0.9 of free device memory"]),
        (["plan", "qwen2.5-7b", "--memory", "1MiB"], ["no block fits", "the budget 40.00 GiB (of 1.00 MiB free)"]),
        (["plan", "tiny-cpu", "--max-seq-len", "769"],
         ["no sequence of 769 tokens fits", "needs 25 blocks", "holds 24", "at most 768"]),
        (["plan", "tiny-cpu", "--memory", "64KiB"], ["the cache does not fit", "at most 4"]),
    ],
)
def test_plan_that_holds_nothing_exits_1_with_the_reason(argv: list[str], words: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"


def test_plan_that_just_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "tiny-cpu", "--max-seq-len", "768"]) == 0
    assert "1 at once (24 blocks each)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["plan", "tiny-cpu", "--memory", "lots"], ["plan", "tiny-cpu", "--max-seq-len", "0"],
                                  ["plan", "tiny-cpu", "--max-seq-len", "9" * 5000], ["validate"], ["frobnicate"]])
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_cli_commands_import_no_torch() -> None:
    """validate, plan, schema and list-configs stay fast: no torch, no kernel library."""
    code = (
        "import sys, contextlib, io\n"
        "from kvcache.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for argv in (['validate', 'tiny-cpu', 'llama3-8b-flash-attn'],\n"
        "                 ['plan', 'llama3-8b', '--memory', '80GiB'], ['schema'], ['list-configs']):\n"
        "        assert main(argv) == 0, argv\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'flash_attn', 'numpy'))\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_version_and_python_dash_m() -> None:
    from tests.child_env import child_pythonpath

    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT)}
    result = subprocess.run([sys.executable, "-m", "kvcache", "--version"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kvcache ") and len(result.stdout.split()) >= 2
    listing = subprocess.run([sys.executable, "-m", "kvcache", "list-configs"], capture_output=True, text=True, env=env)
    assert listing.returncode == 0 and "tiny-cpu" in listing.stdout


def test_a_reader_that_leaves_early_is_not_an_error() -> None:
    """``kvcache schema | head``: stdout's reader is gone; the command exits 0, silently."""
    from tests.child_env import child_pythonpath

    code = (
        "import os, sys\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
        "from kvcache.cli import main\n"
        "code = main(['schema'])\n"
        "sys.stdout = open(os.devnull, 'w')\n"
        "print(code, file=sys.stderr)\n"
    )
    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.stderr.strip().splitlines()[-1] == "0", result.stderr
    assert "Traceback" not in result.stderr


def test_a_misspelled_bundled_name_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "tiny-cpuu"]) == 1
    assert "did you mean 'tiny-cpu'?" in capsys.readouterr().err


def test_plan_says_when_memory_only_checks_a_fixed_block_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "tiny-cpu", "--memory", "1GiB"]) == 0
    assert "fixes num_blocks (24); --memory only decides whether they fit" in capsys.readouterr().out
