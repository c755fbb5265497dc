"""Metadata safety on the GPU: corrupt metadata never sends our kernels outside their tensors,
and the per-step device check's cost.

Part 1 (run it under compute-sanitizer): for each corruption (block-table entries out of
range, negative or huge; slots out of range; seq_lens past the table; query starts past the
tokens or decreasing), run the Triton backend's cache write, decode and prefill kernels on a
real step whose metadata was corrupted after it was built -- first with no device check (the
kernels alone must stay inside their tensors), then with the check (which must report the
violation and repair it). A NaN block on each side of the cache must stay bit-identical.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/check_metadata_safety.py --safety

Part 2 (--cost): GPU time of the device check for decode steps of 1..256 rows, from CUDA
events around CUDA-graph replays of the check alone, plus the host time of launching it.
Prints a table last and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 32
DEVICE = torch.device("cuda")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _step(rows: list[tuple[int, int]], num_blocks: int) -> tuple[Any, Any, Any, Any]:
    """(manager, builder, metadata, layer) for rows of (context, new) over a NaN-bordered cache."""
    from attention import LayerCache
    from kvcache import BlockManager, MetadataBuilder, ScheduledRow

    manager = BlockManager(num_blocks, BLOCK)
    for i, (c, n) in enumerate(rows):
        manager.allocate(i, c + n)
    builder = MetadataBuilder(DEVICE, device_check=False)
    meta = builder.build(manager, [ScheduledRow(i, n, start=c) for i, (c, n) in enumerate(rows)])
    storage = torch.full(
        (2, num_blocks + 2, BLOCK, KV_HEADS, HEAD_DIM), float("nan"), dtype=torch.float16, device=DEVICE
    )
    storage[:, 1:-1] = 0.5
    layer = LayerCache(storage[0, 1:-1], storage[1, 1:-1])
    return manager, builder, meta, (layer, storage)


CORRUPTIONS: dict[str, Callable[[Any], None]] = {
    "table entry 10**6": lambda m: m.block_tables[0].fill_(10**6),
    "table entry -5": lambda m: m.block_tables[1].fill_(-5),
    "table entry int32 min": lambda m: m.block_tables[:, 0].fill_(-(2**31)),
    "slot past the cache": lambda m: m.slot_mapping.fill_(10**9),
    "slot -5": lambda m: m.slot_mapping.fill_(-5),
    "seq_len past the table": lambda m: m.seq_lens.fill_(2**30),
    "seq_len negative": lambda m: m.seq_lens.fill_(-7),
    "query starts past the tokens": lambda m: m.query_start_loc[1:].fill_(10**6),
    "query starts decreasing": lambda m: m.query_start_loc.copy_(m.query_start_loc.flip(0)),
}


def safety() -> list[dict[str, Any]]:
    from attention import AttentionSpec, get_backend
    from attention.metadata_check import DeviceCheck

    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, dtype="float16")
    backend = get_backend("triton", spec)
    results = []
    for label, rows in (("decode", [(40, 1), (100, 1), (3, 1)]), ("prefill+decode", [(0, 37), (50, 1), (10, 20)])):
        for name, corrupt in CORRUPTIONS.items():
            for checked in (False, True):
                manager, _, meta, (layer, storage) = _step(rows, 16)
                plan = backend.plan(meta)
                corrupt(meta)
                error = ""
                if checked:
                    check = DeviceCheck(DEVICE)
                    check.run(meta, manager.num_blocks)
                    _sync()
                    try:
                        check.raise_if_violated()
                        error = "NOT REPORTED"
                    except Exception as err:  # the expected MetadataError
                        error = type(err).__name__
                border = storage[:, [0, -1]].clone()
                t = meta.num_tokens
                kv = torch.randn(t, KV_HEADS, HEAD_DIM, dtype=torch.float16, device=DEVICE)
                q = torch.randn(t, HEADS, HEAD_DIM, dtype=torch.float16, device=DEVICE)
                backend.write_kv(kv, kv, layer, plan)
                backend.attend(q, layer, plan)
                _sync()
                intact = bool(torch.equal(storage[:, [0, -1]].view(torch.int16), border.view(torch.int16)))
                results.append(
                    {
                        "step": label,
                        "corruption": name,
                        "device_check": checked,
                        "border_intact": intact,
                        "check_result": error,
                    }
                )
                print(f"{label:15s} {name:30s} check={checked!s:5s} border intact={intact} {error}", flush=True)
    return results


def cost() -> list[dict[str, Any]]:
    """GPU microseconds of one device check (graph replay, CUDA events) and host microseconds
    to launch it, for decode steps of n rows of ~1000 tokens."""
    from kvcache import BlockManager, MetadataBuilder, ScheduledRow

    out = []
    for n in (1, 8, 32, 128, 256):
        manager = BlockManager(n * 40 + 8, BLOCK)
        for i in range(n):
            manager.allocate(i, 1000 + i % 32)
        builder = MetadataBuilder(DEVICE, device_check=True)
        meta = builder.build(manager, [ScheduledRow(i, 1) for i in range(n)])
        check = builder._check
        assert check is not None
        for _ in range(3):
            check.run(meta, manager.num_blocks)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                check.run(meta, manager.num_blocks)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / 20)
        host = []
        for _ in range(50):
            t0 = time.perf_counter()
            check.run(meta, manager.num_blocks)
            host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        gpu_us = sorted(times)[len(times) // 2]
        host_us = sorted(host)[len(host) // 2]
        out.append({"rows": n, "gpu_us": gpu_us, "host_launch_us": host_us})
        print(f"device check, {n:3d} decode rows: GPU {gpu_us:6.2f} us, host launch {host_us:6.1f} us", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--safety", action="store_true")
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_metadata_safety: needs a CUDA GPU", file=sys.stderr)
        return 2
    result: dict[str, Any] = {}
    if args.safety:
        result["safety"] = safety()
    if args.cost:
        result["cost"] = cost()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    bad = [r for r in result.get("safety", []) if not r["border_intact"] or r["check_result"] == "NOT REPORTED"]
    print(f"safety cases: {len(result.get('safety', []))}, failed: {len(bad)}")
    for r in bad:
        print("  FAILED", r)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
