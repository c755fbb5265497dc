"""The scheduler benchmark's code path (benchmarks/bench_scheduler.py): it times the three host
calls of every step, restores them afterwards, and writes its JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from examples.engine.scheduler import Scheduler
from kvcache import MetadataBuilder
from tests.bench_script import load_bench


def test_timed_calls_time_each_call_and_restore_the_methods() -> None:
    bench = load_bench("bench_scheduler")
    originals = (Scheduler.schedule, Scheduler.finish_step, MetadataBuilder.plan)
    result = bench.measure(8)
    assert set(result) == {"schedule", "plan", "finish_step"} and all(v > 0 for v in result.values())
    assert (Scheduler.schedule, Scheduler.finish_step, MetadataBuilder.plan) == originals


def test_main_writes_one_row_per_batch_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("bench_scheduler")
    out = tmp_path / "s.json"
    monkeypatch.setattr(sys, "argv", ["bench_scheduler.py", "--rows", "4,6", "--out", str(out)])
    bench.main()
    doc = json.loads(out.read_text())
    assert [r["rows"] for r in doc["rows"]] == [4, 6]
    assert all(r["total_ms"] >= r["schedule_ms"] > 0 for r in doc["rows"])
    monkeypatch.setattr(sys, "argv", ["bench_scheduler.py", "--rows", "0"])
    with pytest.raises(SystemExit):
        bench.main()
