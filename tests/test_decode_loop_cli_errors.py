"""``python -m examples.decode_loop`` answers a user's mistake with one ``error:`` line naming
the flag and the fix (exit status 2 for a flag argparse refuses, 1 otherwise), never a
Python traceback, and finds it before the run, not after it."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from attention.errors import InvalidArgumentError
from examples import decode_loop
from examples.decode_loop import main
from examples.model.shape import LlamaShape, shape_for_cache

ROOT = Path(__file__).resolve().parents[1]


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit status and stderr of ``main(argv)`` (argparse's errors exit through SystemExit)."""
    try:
        code = main(["--quiet", *argv])
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--token-budget", "1000000000"], ["--token-budget", "above the maximum 16,777,216"]),
        (["--seed", "99999999999999999999999"], ["--seed", "out of range"]),
        (["--requests", "1000000000"], ["--requests", "above the maximum 100,000"]),
        (["--disk-cache", "DIR", "abc", "--host-cache", "1MiB"], ["--disk-cache", "SIZE 'abc'", "is not a size"]),
        (["--tokens-out", "NOWHERE/x.json"], ["--tokens-out", "does not exist; create it first"]),
        (["--tokens-out", "DIR"], ["--tokens-out", "is a directory"]),
    ],
    ids=["token-budget", "seed", "requests", "disk-cache-size", "tokens-out-no-dir", "tokens-out-a-dir"],
)
def test_a_bad_flag_is_refused_before_the_run(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [a.replace("NOWHERE", str(tmp_path / "missing")).replace("DIR", str(tmp_path)) for a in argv]
    code, err = _fails(argv, capsys)
    assert code == 2
    assert all(w in err for w in words), err
    assert "summary" not in capsys.readouterr().out  # nothing ran


def test_a_disk_cache_the_config_refuses_is_one_line_not_a_pydantic_dump(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, err = _fails(["--disk-cache", str(tmp_path), "1MiB"], capsys)  # no host tier to feed it
    assert code == 1
    assert err.startswith("error: --host-cache / --disk-cache: cache.disk_cache_space:") and err.count("\n") == 1
    assert "validation error" not in err and "pydantic" not in err


def test_disk_cache_size_0_means_no_disk_tier_as_host_cache_0_does(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["--quiet", "--requests", "2", "--host-cache", "1MiB", "--disk-cache", str(tmp_path), "0"]) == 0
    out = capsys.readouterr().out
    assert "host tier:" in out and "disk tier:" not in out


def test_out_of_memory_building_the_cache_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(*args: Any, **kwargs: Any) -> None:  # what torch raises for --host-cache 1TiB
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory\nframe #0")

    monkeypatch.setattr(decode_loop, "engine_for", no_memory)
    code, err = _fails(["--host-cache", "1TiB"], capsys)
    assert code == 1
    assert err.startswith("error: building the cache: [enforce fail") and "--host-cache" in err
    assert err.count("\n") == 1 and "frame #0" not in err


def test_a_library_error_during_the_run_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise InvalidArgumentError("max_tokens: 1000000000 is above the maximum 16777216")

    monkeypatch.setattr(decode_loop, "run_requests", refuse)
    code, err = _fails([], capsys)
    assert code == 1
    assert err == "error: InvalidArgumentError: max_tokens: 1000000000 is above the maximum 16777216\n"


def test_a_closed_stdout_ends_the_run_quietly() -> None:
    """``python -m examples.decode_loop | head -1``: no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.decode_loop", "--requests", "40", "--log-every", "1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith("config:")
    proc.stdout.close()  # what `head -1` does after its line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_workload_past_the_models_positions_is_one_line_before_the_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def short_model(*args: Any, **kwargs: Any) -> LlamaShape:  # a checkpoint of 32 positions, say
        return replace(shape_for_cache(*args, **kwargs), max_positions=32)

    monkeypatch.setattr(decode_loop, "shape_for_cache", short_model)
    code, err = _fails([], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "the model has 32 positions (max_position_embeddings) but request" in err
    assert "summary" not in capsys.readouterr().out
