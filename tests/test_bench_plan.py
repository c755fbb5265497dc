"""The plan benchmark's code path (benchmarks/bench_plan.py): both backends plan real steps on
the CPU, and it writes one JSON row per batch size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.bench_script import load_bench


def test_main_writes_one_row_per_batch_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("bench_plan")
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
