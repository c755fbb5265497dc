"""The end-to-end benchmark's code path on CPU: ``--device cpu --tiny`` serves a tiny model
with our engine and with transformers' continuous batching, and writes the JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_serves_both_engines_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.json"
    threads = torch.get_num_threads()
    try:
        doc = _bench().run(["--device", "cpu", "--tiny", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the tiny CPU run uses one thread
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc, default=str))
    results, errors = doc["results"], doc["errors"]
    assert "ours" not in errors and "model.transformers" not in errors, errors
    ours = results["ours"]
    workload = results["workload"]
    assert ours["generated_tokens"] == workload["requests"] * workload["new_tokens"]
    assert ours["preemptions"] == 0 and ours["decode_steps"] > 0
    assert ours["warmup"]["eager_steps"] >= 8, "the eager warm-up steps run on CPU too"
    assert ours["roofline_median_ms"] > 0 and ours["ttft_median_s"] > 0
    assert results["model"]["shared_with_transformers"]
    if "transformers" in errors:  # e.g. an older transformers needing psutil on CPU: recorded, not raised
        assert results["transformers"] is None
    else:
        # Same weights, float32 on both sides: the same greedy tokens for every request.
        assert results["agreement"]["identical_requests"] == workload["requests"], results["agreement"]
        assert results["transformers"]["tokens_per_s"] > 0
    assert "generated tokens/s" in printed and "target throughput_vs_transformers" in printed
    assert printed.rstrip().endswith(f"wrote {out}")
