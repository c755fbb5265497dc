"""The tier benchmark's code path on CPU: ``--device cpu --tiny`` serves multi-turn
conversations over a small pool with and without the host tier and over a roomy pool, and
writes the JSON. In float32 on CPU the three runs give the same tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.bench_script import load_bench


def test_tiny_cpu_run_saves_prefill_with_the_same_tokens(tmp_path: Path) -> None:
    module: Any = load_bench("bench_tiers")
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


def test_damaged_disk_files_cost_no_wrong_token(tmp_path: Path) -> None:
    """A tiny host tier over a disk tier, every third block file damaged after it is written:
    the blocks read back from disk and the damaged ones recomputed, every turn's tokens equal the
    roomy run's."""
    module: Any = load_bench("bench_tiers")
    threads = torch.get_num_threads()
    try:
        doc = module.run(
            ["--device", "cpu", "--tiny", "--runs", "roomy,disk_tier", "--corrupt-every", "3",
             "--disk-host-fraction", "0.02", "--disk-dir", str(tmp_path)]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    run = doc["runs"]["disk_tier"]
    disk = run["disk_tier"]
    assert run["files_damaged"] >= 1 and disk["corrupt_blocks"] >= 1  # damaged files were read and refused
    assert disk["hit_blocks"] >= 1 and disk["written_blocks"] >= 3
    assert run["agreement_with_roomy"]["identical_turns"] == 1.0
    assert list(tmp_path.iterdir()) == []  # the run's folder is gone
