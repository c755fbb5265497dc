"""The plan benchmark's code path (benchmarks/bench_plan.py): both backends plan real steps on
the CPU, and it writes one JSON row per batch size."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench() -> Any:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_plan", BENCH / "bench_plan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_main_writes_one_row_per_batch_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench()
    out = tmp_path / "p.json"
    monkeypatch.setattr(sys, "argv", ["bench_plan.py", "--rows", "3,17", "--out", str(out)])
    bench.main()
    doc = json.loads(out.read_text())
    assert [r["rows"] for r in doc["rows"]] == [3, 17]
    assert all(r["reference_ms"] > 0 and r["triton_ms"] > 0 for r in doc["rows"])
    for bad in ("0", "x"):
        monkeypatch.setattr(sys, "argv", ["bench_plan.py", "--rows", bad])
        with pytest.raises(SystemExit):
            bench.main()
