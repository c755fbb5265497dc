"""Host time of one decode step's plan, by backend and batch size (CPU; no kernel runs).

``MetadataBuilder.plan`` is the step's host work after scheduling: the block tables, lengths
and slots (the builder, the same for every backend), then the backend's own plan. The Triton
backend's is the decode kernel's work partition (``schedule_decode``: rows cut into chunks,
items sorted heaviest first, packed into int32 arrays). It is planned here for an H200's 132
SMs without a GPU: planning launches nothing.

The rows are decode rows (one new token each) of LogNormal(median 2000, sigma 0.6) lengths,
32 query / 8 KV heads, head_dim 128, block 256; each step appends a token to every row, plans,
and commits; medians over 30 steps after 5 of warm-up.

Prints a table and writes benchmarks/results/plan-<date>.json (``--out`` to move it).
Run: python benchmarks/bench_plan.py [--rows 128,256,512,1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by file path: common.py is beside this file
    sys.path.insert(0, str(HERE))

# common puts this checkout first on sys.path: the project is imported from source.
from common import batch_sizes, write_host_results  # noqa: E402

from attention import AttentionBackend, StepCapacity  # noqa: E402
from attention.reference import ReferenceBackend  # noqa: E402
from attention.spec import AttentionSpec  # noqa: E402
from attention.triton_backend import TritonBackend  # noqa: E402
from kvcache import BlockManager, MetadataBuilder, ScheduledRow  # noqa: E402

BLOCK, H200_SMS, STEPS, WARMUP = 256, 132, 30, 5
SPEC = AttentionSpec(32, 8, 128, "bfloat16")


def backends() -> dict[str, AttentionBackend]:
    return {"reference": ReferenceBackend(SPEC), "triton": TritonBackend(SPEC, num_sms=H200_SMS)}


def measure(backend: AttentionBackend, rows: int, seed: int = 0) -> float:
    """Median milliseconds of ``MetadataBuilder.plan`` over decode steps of ``rows`` rows."""
    rng = random.Random(seed)
    lengths = [int(rng.lognormvariate(7.6, 0.6)) + 1 for _ in range(rows)]
    manager = BlockManager(sum(-(-(n + STEPS + WARMUP) // BLOCK) for n in lengths) + 1, BLOCK)
    for seq, n in enumerate(lengths):
        manager.allocate(seq, n)
        manager.mark_computed(seq, n)
    width = max(-(-(n + STEPS + WARMUP) // BLOCK) for n in lengths)
    builder = MetadataBuilder(torch.device("cpu"), capacity=StepCapacity(rows, rows, width), backend=backend)
    step = [ScheduledRow(seq, 1) for seq in range(rows)]
    times = []
    for _ in range(WARMUP + STEPS):
        for seq in range(rows):
            manager.append_slots(seq, 1)
        start = time.perf_counter()
        builder.plan(manager, step)
        times.append(time.perf_counter() - start)
        manager.commit(step)
    return statistics.median(times[WARMUP:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="128,256,512,1024", help="comma-separated batch sizes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = batch_sizes(parser, args.rows)
    torch.set_num_threads(1)
    print(f"host ms of MetadataBuilder.plan per decode step (CPU, one thread; LogNormal rows, block {BLOCK}, "
          f"planned for {H200_SMS} SMs)")  # fmt: skip
    print(f"{'rows':>6} {'reference':>10} {'triton':>8} {'triton us/row':>14}")
    results = []
    for rows in sizes:
        ms = {name: measure(backend, rows) for name, backend in backends().items()}
        results.append({"rows": rows, **{f"{k}_ms": round(v, 4) for k, v in ms.items()}})
        print(f"{rows:>6} {ms['reference']:>10.3f} {ms['triton']:>8.3f} {ms['triton'] / rows * 1e3:>14.2f}")
    out = write_host_results(args.out, "plan", f"python benchmarks/bench_plan.py --rows {args.rows}", results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
