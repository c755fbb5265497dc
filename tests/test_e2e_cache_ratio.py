"""benchmarks/e2e_cache_ratio.py: the end-to-end attention time over an 8-bit cache against
the bf16 cache, read from bench_e2e runs."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.bench_script import load_bench


def _ratio() -> ModuleType:
    module: ModuleType = load_bench("e2e_cache_ratio")
    return module


def _bench_json(attention: float | None, *, combine: float = 0.1, tokens_per_s: float = 5000.0) -> dict[str, Any]:
    """The part of a bench_e2e JSON the script reads (the burst; a profile unless None)."""
    profile = None
    if attention is not None:
        profile = {
            "ms_per_iteration": {"attention": attention, "gemm": 5.9},
            "attention_ms_per_iteration": {"decode": attention - combine, "combine": combine},
        }
    ours = {
        "tokens_per_s": tokens_per_s,
        "itl_p99_ms": 190.0,
        "compiles_while_serving": {"available": True, "count": 0},
    }
    return {"results": {"workloads": {"burst": {"ours": ours, "profile": profile}}}}


def test_the_bench_command_of_each_cache() -> None:
    mod = _ratio()
    out = Path("/tmp/x.json")
    bf16 = mod.bench_command("bf16", out, None, ["--hopper-decode", "never"])
    assert "--kv-cache-dtype" not in bf16 and bf16[-2:] == ["--hopper-decode", "never"]
    assert bf16[bf16.index("--out") + 1] == str(out) and bf16[bf16.index("--workloads") + 1] == "burst"
    fp8 = mod.bench_command("float8_e4m3", out, 32, [])
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "float8_e4m3" and fp8[fp8.index("--block-size") + 1] == "32"
    with pytest.raises(ValueError, match="'fp4'"):
        mod.bench_command("fp4", out, None, [])


@pytest.mark.parametrize(
    ("bf16", "fp8", "verdict", "ratio"),
    [
        ((2.80, 2.90), (1.60, 1.70), "PASS", 1.65 / 2.85),
        ((2.81, 2.81), (1.80, 1.95), "FAIL", 1.875 / 2.81),
        ((None,), (1.80,), "n/a", None),
    ],
)
def test_the_ratio_of_medians_and_its_verdict(
    tmp_path: Path, bf16: tuple[float | None, ...], fp8: tuple[float | None, ...], verdict: str, ratio: float | None
) -> None:
    mod = _ratio()
    runs = []
    for cache, values in (("bf16", bf16), ("float8_e4m3", fp8)):
        for index, value in enumerate(values, 1):
            path = tmp_path / f"{cache}-{index}.json"
            path.write_text(json.dumps(_bench_json(value)))
            runs.append(mod.read_run(cache, index, path))
    got = mod.ratio_of(runs, "float8_e4m3")
    assert got == pytest.approx(ratio) if ratio is not None else got is None
    line = mod.target_line(got, "float8_e4m3")
    assert line.startswith(f"target e2e_attention_float8_e4m3_vs_bf16: {verdict} ")
    assert "target <= 0.6x" in line
    first = runs[0]
    if first.attention_ms is not None:
        assert first.decode_ms == pytest.approx(first.attention_ms - 0.1) and first.combine_ms == 0.1
    else:
        assert first.decode_ms is None and first.combine_ms is None
    assert first.compiles_while_serving == 0 and first.tokens_per_s == 5000.0
    assert mod.table(runs).count("\n") == len(runs) + 1


def test_runs_alternate_bf16_first_and_a_failed_run_names_its_command(tmp_path: Path) -> None:
    mod = _ratio()
    commands: list[list[str]] = []

    def fake(command: list[str]) -> str:
        commands.append(command)
        cache = command[command.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in command else "bf16"
        Path(command[command.index("--out") + 1]).write_text(json.dumps(_bench_json(2.8 if cache == "bf16" else 1.7)))
        return "  ours: kernels compiled while serving: none\nother line\n"

    runs = mod.measure("int8", 2, 256, ["--eager"], tmp_path, runner=fake)
    assert [(r.cache, r.index) for r in runs] == [("bf16", 1), ("int8", 1), ("bf16", 2), ("int8", 2)]
    assert all(c[-1] == "--eager" and c[c.index("--block-size") + 1] == "256" for c in commands)
    assert mod.ratio_of(runs, "int8") == pytest.approx(1.7 / 2.8)
    with pytest.raises(RuntimeError, match=r"exit 2: .*definitely_not_a_script"):
        mod.run_bench(["python3", "-c", "import sys; sys.exit(2)", "definitely_not_a_script"])


def test_a_tiny_cpu_pair_runs_end_to_end_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real bench_e2e processes (tiny model, CPU): the runs happen, the profile is CUDA
    only, so the ratio reads n/a."""
    pytest.importorskip("transformers")
    mod = _ratio()
    out = tmp_path / "ratio.json"
    runs_dir = tmp_path / "runs"
    code = mod.main(["--pairs", "1", "--out", str(out), "--runs-dir", str(runs_dir), "--", "--tiny", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads(out.read_text())
    assert [run["cache"] for run in doc["runs"]] == ["bf16", "float8_e4m3"]
    assert all(run["tokens_per_s"] > 0 and run["attention_ms"] is None for run in doc["runs"])
    assert doc["ratio"] is None and doc["target"] == {"max_ratio": 0.6, "met": None}
    assert sorted(p.name for p in runs_dir.iterdir()) == ["e2e-bf16-1.json", "e2e-float8_e4m3-1.json"]
    assert "target e2e_attention_float8_e4m3_vs_bf16: n/a" in printed and printed.rstrip().endswith(f"wrote {out}")


@pytest.mark.parametrize("extra", [["--kv-cache-dtype", "int8"], ["--out=x.json"], ["--workloads", "poisson"]])
def test_arguments_the_script_sets_are_refused_after_the_separator(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _ratio().main(["--pairs", "1", "--", *extra])
    assert exit_info.value.code == 2
    assert extra[0].split("=")[0] in capsys.readouterr().err


def test_pairs_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _ratio().main(["--pairs", "0"])
    assert "--pairs 0" in capsys.readouterr().err
