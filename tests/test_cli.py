"""The kvcache command: exit codes and what it prints."""

from __future__ import annotations

import json
import os
import re
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


# --- output that cannot be written; files that cannot be read; KV groups ------------------------


def _child(code: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports this checkout."""
    from tests.child_env import child_pythonpath

    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT), **(extra_env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["validate", *[str(ROOT / "no-such-dir" / f"bad{i}.yaml") for i in range(20)]], 1),
        (["validate", "tiny-cpu", "no-such-config", "tiny-cpu"], 1),  # the failure is not the first
        (["plan", "tiny-cpu", "--max-seq-len", "769"], 1),
        (["plan", "tiny-cpu"], 0),
        (["validate", "tiny-cpu", "llama3-8b"], 0),
        (["list-configs"], 0),
    ],
)
def test_a_reader_that_leaves_early_changes_no_exit_status(argv: list[str], status: int) -> None:
    """``kvcache validate *.yaml 2>&1 | head -1``: stdout and stderr are a pipe whose reader is
    gone before the first line; the command still checks everything and exits as it would."""
    code = (
        "import os, sys\n"
        "keep = os.dup(1)\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, 1); os.dup2(w, 2)\n"
        "from kvcache.cli import main\n"
        f"code = main({argv!r})\n"
        "os.write(keep, f'status {code}'.encode())\n"
    )
    result = _child(code)
    assert result.stdout == f"status {status}", (result.stdout, result.stderr)


def test_a_full_disk_is_one_line_and_status_1(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux)")
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "kvcache.cli", "validate", "tiny-cpu"], stdout=full, stderr=subprocess.PIPE,
            text=True, cwd=ROOT,
        )
    assert result.returncode == 1
    assert result.stderr == "kvcache: cannot write to stdout: No space left on device; the output is incomplete\n"


def test_a_file_name_the_terminal_cannot_show_is_escaped(tmp_path: Path) -> None:
    config = tmp_path / "\u00e9t\u00e9.yaml"
    config.write_text((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    result = _child(f"import sys; from kvcache.cli import main; sys.exit(main(['validate', {str(config)!r}]))",
                    extra_env={"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    assert "\\xe9t\\xe9.yaml: ok" in result.stdout and "Traceback" not in result.stderr


def test_list_configs_shows_a_file_it_cannot_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from kvcache.config import bundled

    (tmp_path / "a-latin1.yaml").write_bytes(b"# Caf\xe9 config.\nmodel: {}\n")
    (tmp_path / "b-dir.yaml").mkdir()
    if os.path.exists("/dev/zero"):
        (tmp_path / "c-zero.yaml").symlink_to("/dev/zero")
    (tmp_path / "d-good.yaml").write_text("# Fine. More words.\nmodel: {}\n")
    (tmp_path / "e-\x1b[31mred.yaml").write_text("# Red \x1b[31mtext.\n")
    monkeypatch.setattr(bundled, "bundled_config_dir", lambda: tmp_path)
    assert main(["list-configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("a-latin1") and "(unreadable: is not UTF-8 text (byte 0xe9 at line 1)" in lines[0]
    assert lines[1].startswith("b-dir") and "(unreadable: is a directory" in lines[1]
    if os.path.exists("/dev/zero"):
        assert "(unreadable: is a character device, not a regular file" in lines[2]
    assert lines[-2].endswith("  Fine.")
    assert lines[-1] == "'e-\\x1b[31mred'  'Red \\x1b[31mtext.'"


def test_plan_of_kv_groups_fits_what_the_groups_need(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """6 layers (4 windowed), 26 whole-model blocks: 78 block ids of 2 layers each. A sequence of
    1,000 tokens needs 32 ids in the full group and 5 in each windowed one (window 100): 42 fit,
    though 32 whole-model blocks would not."""
    config = tmp_path / "hybrid.yaml"
    config.write_text(
        "model: {num_layers: 6, num_heads: 8, num_kv_heads: 4, head_dim: 128, sliding_window: 100,\n"
        "        window_pattern: [true, true, false, true, true, false]}\n"
        "cache: {block_size: 32, num_blocks: 26, device: cpu}\nattention: {backend: reference}\n"
    )
    assert main(["plan", str(config), "--max-seq-len", "1000"]) == 0
    captured = capsys.readouterr()
    assert "1 at once (42 block ids" in captured.out and captured.err == ""
    # 68 blocks of the full group + 2 x 5 windowed = 78 ids: 2,176 tokens fit, 2,177 do not.
    assert main(["plan", str(config), "--max-seq-len", "2176"]) == 0
    assert main(["plan", str(config), "--max-seq-len", "2177"]) == 1
    err = capsys.readouterr().err
    assert "with KV groups it needs 79 block ids and the cache holds 78" in err and "at most 2,176" in err


def test_plan_escapes_the_disk_dir_and_counts_in_the_singular(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "disk.yaml"
    config.write_text(
        "model: {num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: 16}\n"
        "cache: {block_size: 32, num_blocks: 8, enable_prefix_caching: true, host_cache_space: 1MiB,\n"
        '        disk_cache_space: 1MiB, disk_cache_dir: "/tmp/\\e[31mred"}\n'
    )
    assert main(["plan", str(config), "--max-seq-len", "1"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "files under '/tmp/\\x1b[31mred'" in out
    assert re.search(r"sequences of 1 token +8 at once \(1 block each\)", out), out
