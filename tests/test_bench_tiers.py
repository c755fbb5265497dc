"""The tier benchmark's code path on CPU: ``--device cpu --tiny`` serves multi-turn
conversations over a small pool with and without the host tier and over a roomy pool, and
writes the JSON. In float32 on CPU the three runs give the same tokens."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_tiny_cpu_run_saves_prefill_with_the_same_tokens(tmp_path: Path) -> None:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_tiers", BENCH / "bench_tiers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = tmp_path / "tiers.json"
    threads = torch.get_num_threads()
    try:
        doc = module.run(["--device", "cpu", "--tiny", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc, default=str))
    runs = doc["runs"]
    assert all(r["turns"] == 18 for r in runs.values())
    assert runs["host_tier"]["agreement_with_roomy"]["identical_turns"] == 1.0
    assert runs["no_tier"]["agreement_with_roomy"]["identical_turns"] == 1.0
    host = runs["host_tier"]["host_tier"]
    assert host["hit_blocks"] > 0 and host["offloaded_blocks"] > 0
    assert runs["host_tier"]["tokens_computed"] < runs["no_tier"]["tokens_computed"]
