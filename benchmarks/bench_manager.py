"""Bookkeeping cost of the block manager, in microseconds (CPU; no kernels run).

  decode step: 256 running sequences each append one token, then the step's metadata
               (block tables, lengths, slots) is built;
  admission:   256 prompts of 1000 tokens are checked and allocated.

Prints a table and writes benchmarks/results/manager-<date>.json.
Run: python benchmarks/bench_manager.py [--block-size 32] [--context 1000] [--repeats 50]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvcache import BlockManager, MetadataBuilder, ScheduledRow

RESULTS = Path(__file__).resolve().parent / "results"


def _median_us(run: Callable[[], None], setup: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        setup()
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def bench_decode_step(num_seqs: int, context: int, block_size: int, repeats: int) -> dict[str, float]:
    blocks_per_seq = -(-(context + repeats * 4 + 1) // block_size)
    manager = BlockManager(num_seqs * blocks_per_seq + 16, block_size)
    for seq in range(num_seqs):
        manager.allocate(seq, context)
    builder = MetadataBuilder("cpu")
    rows = [ScheduledRow(seq, 1) for seq in range(num_seqs)]

    def append() -> None:
        for seq in range(num_seqs):
            manager.append_slots(seq, 1)

    def build() -> None:
        builder.build(manager, rows)

    def step() -> None:
        append()
        build()

    append_us = _median_us(append, lambda: None, repeats)
    build_us = _median_us(build, lambda: None, repeats)
    step_us = _median_us(step, lambda: None, repeats)
    manager.check_integrity()
    return {"append_us": append_us, "build_metadata_us": build_us, "step_us": step_us}


def bench_admission(num_seqs: int, prompt: int, block_size: int, repeats: int) -> dict[str, float]:
    manager = BlockManager(num_seqs * -(-prompt // block_size), block_size)

    def reset() -> None:
        for seq in range(num_seqs):
            if seq in manager:
                manager.free(seq)

    def admit() -> None:
        for seq in range(num_seqs):
            if manager.can_allocate(prompt):
                manager.allocate(seq, prompt)

    us = _median_us(admit, reset, repeats)
    assert manager.num_sequences == num_seqs
    return {"admit_us": us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=1000, help="tokens per running sequence / prompt")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    n, bs = args.num_seqs, args.block_size
    decode = bench_decode_step(n, args.context, bs, args.repeats)
    admit = bench_admission(n, args.context, bs, max(5, args.repeats // 5))
    rows = [
        ("decode step: append 1 token x N", decode["append_us"]),
        ("decode step: build metadata", decode["build_metadata_us"]),
        ("decode step: total", decode["step_us"]),
        (f"admit N prompts of {args.context} tokens", admit["admit_us"]),
    ]
    print(f"block manager bookkeeping, N = {n} sequences, block_size {bs}, context {args.context} "
          f"(median of {args.repeats}, one CPU thread)")
    print(f"{'operation':<40} {'total us':>10} {'us/seq':>8}")
    for name, us in rows:
        print(f"{name:<40} {us:>10.0f} {us / n:>8.2f}")

    date = datetime.date.today().isoformat()
    out = args.out or RESULTS / f"manager-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "header": {"date": date, "machine": platform.processor() or platform.machine(),
                   "python": platform.python_version(), "torch": torch.__version__,
                   "command": "python benchmarks/bench_manager.py " + " ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")},
        "rows": [{"op": name, "total_us": round(us, 1), "us_per_seq": round(us / n, 3), "num_seqs": n,
                  "block_size": bs, "context": args.context} for name, us in rows],
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
