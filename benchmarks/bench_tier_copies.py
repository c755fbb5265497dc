"""Block copies between the device cache and a pinned host pool, as the host tier moves them.

A block is every layer's K and V of its tokens: ``2 * num_layers`` rows, one every
``num_blocks`` rows of the device cache, back to back in the host pool. Two ways to move a batch
of blocks (random, distinct device blocks; consecutive host blocks):

- ``staged``: a gather kernel into a staging tensor on the device (``torch.stack``), then one
  copy; loads copy into a staging tensor, then scatter with ``index_copy_``;
- ``pitched``: one ``cudaMemcpy2DAsync`` per block (:mod:`kvcache.memory.pitched_copy`), on the
  copy engines alone.

Each is timed with CUDA events on a high-priority side stream, as the tier runs it, on an idle
GPU and while the compute stream runs a chain of large matmuls (a step holding every SM), and
compared with the pinned copy bandwidth of one contiguous 1 GiB buffer measured in the same
run. Every variant's result is checked bit for bit first.

Run (from the project root, on the GPU machine; ../shared/device/stage.sh first):
    source .device-extras/activate.sh && python3 benchmarks/bench_tier_copies.py --out copies.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_tiers import pinned_bandwidth  # noqa: E402
from common import package_version  # noqa: E402

from kvcache.memory.pitched_copy import copy_rows, pitched_copies_available  # noqa: E402

#: name -> (layers, KV heads, head_dim). A row is one layer's K or V of a block: 32 tokens in
#: bf16 make 64 KiB rows for the 8B shape (4 MiB blocks) and 12 KiB rows for SmolLM2's.
SHAPES = {
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (30, 3, 64),
    "rows-8k": (32, 1, 128),
    "rows-16k": (32, 2, 128),
    "rows-32k": (32, 4, 128),
    "rows-128k": (32, 16, 128),
}
BLOCK_SIZE = 32


class Pool:
    """A device cache and a pinned host pool of one shape."""

    def __init__(self, layers: int, heads: int, dim: int, num_blocks: int, host_blocks: int):
        self.storage = torch.randn(layers, 2, num_blocks, BLOCK_SIZE, heads, dim, device="cuda").to(torch.bfloat16)
        self.host = torch.empty(host_blocks, layers, 2, BLOCK_SIZE, heads, dim, dtype=torch.bfloat16, pin_memory=True)
        self.device_rows = self.storage.flatten(0, 1)
        self.host_rows = self.host.flatten(1, 2)
        self.block_bytes = self.host[0].numel() * self.host.element_size()

    def to_host(self, pitched: bool, blocks: list[int], stream: torch.cuda.Stream) -> None:
        n = len(blocks)
        if pitched:
            for h, b in enumerate(blocks):
                copy_rows(self.host_rows[h], self.device_rows[:, b], stream)
        else:
            staged = torch.stack([self.storage[:, :, b] for b in blocks])
            self.host[:n].copy_(staged, non_blocking=True)

    def to_device(self, pitched: bool, blocks: list[int], stream: torch.cuda.Stream) -> None:
        n = len(blocks)
        if pitched:
            for h, b in enumerate(blocks):
                copy_rows(self.device_rows[:, b], self.host_rows[h], stream)
        else:
            staged = torch.empty((n, *self.host.shape[1:]), dtype=self.host.dtype, device="cuda")
            index = torch.tensor(blocks, device="cuda")
            staged.copy_(self.host[:n], non_blocking=True)
            self.storage.index_copy_(2, index, staged.movedim(0, 2))


def check(pool: Pool, pitched: bool, blocks: list[int], stream: torch.cuda.Stream) -> None:
    """Both directions bit for bit (the round trip lands in other device blocks)."""
    n = len(blocks)
    with torch.cuda.stream(stream):
        pool.to_host(pitched, blocks, stream)
    stream.synchronize()
    if not torch.equal(pool.host[:n], pool.storage[:, :, blocks].movedim(2, 0).cpu()):
        raise SystemExit(f"{'pitched' if pitched else 'staged'} to_host: wrong bytes")
    targets = [b + 1 for b in blocks]
    with torch.cuda.stream(stream):
        pool.to_device(pitched, targets, stream)
    stream.synchronize()
    if not torch.equal(pool.storage[:, :, targets].movedim(2, 0).cpu(), pool.host[:n]):
        raise SystemExit(f"{'pitched' if pitched else 'staged'} to_device: wrong bytes")


def busy_work(size: int = 8192, count: int = 12) -> Callable[[], None]:
    """Queues ``count`` bf16 matmuls of ``size`` cubed on the compute stream (every SM, ~1 ms each)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16) / size**0.5
    out = torch.empty_like(a)

    def run() -> None:
        for _ in range(count):
            torch.matmul(a, a, out=out)

    return run


def time_copies(
    copy: Callable[[], None], stream: torch.cuda.Stream, busy: Callable[[], None] | None, reps: int
) -> float:
    """Median seconds of ``copy`` on ``stream``, with ``busy`` queued first on the compute stream."""
    times = []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        if busy is not None:
            busy()
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            begin.record(stream)
            copy()
            done.record(stream)
        done.synchronize()
        if i >= 2:
            times.append(begin.elapsed_time(done) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64", help="blocks per copy batch")
    ap.add_argument("--shapes", default="llama3-8b,smollm2-135m", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not pitched_copies_available():
        raise SystemExit("needs CUDA and cudaMemcpy2DAsync from torch's runtime")
    batches = [int(x) for x in args.batches.split(",")]
    pinned = pinned_bandwidth("cuda")
    stream = torch.cuda.Stream(priority=-1)
    busy = busy_work()
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        layers, heads, dim = SHAPES[shape]
        pool = Pool(layers, heads, dim, num_blocks=1024, host_blocks=max(batches))
        gen = torch.Generator().manual_seed(0)
        for n in batches:
            blocks = (torch.randperm(1023, generator=gen)[:n]).tolist()  # b + 1 stays in the pool
            for pitched in (False, True):
                check(pool, pitched, blocks, stream)
                for direction in ("to_host", "to_device"):
                    fn = pool.to_host if direction == "to_host" else pool.to_device

                    def copy(fn=fn, pitched=pitched, blocks=blocks) -> None:  # type: ignore[no-untyped-def]
                        fn(pitched, blocks, stream)

                    for load in ("idle", "busy"):
                        seconds = time_copies(copy, stream, busy if load == "busy" else None, args.reps)
                        gbps = n * pool.block_bytes / seconds / 1e9
                        peak = pinned["d2h_gb_per_s" if direction == "to_host" else "h2d_gb_per_s"]
                        rows.append(
                            {
                                "shape": shape,
                                "blocks": n,
                                "block_bytes": pool.block_bytes,
                                "path": "pitched" if pitched else "staged",
                                "direction": direction,
                                "gpu": load,
                                "seconds": seconds,
                                "gb_per_s": gbps,
                                "of_pinned": gbps / peak,
                            }
                        )
        del pool
        torch.cuda.empty_cache()
    print(
        f"pinned copy (1 GiB): host->device {pinned['h2d_gb_per_s']:.1f} GB/s, "
        f"device->host {pinned['d2h_gb_per_s']:.1f} GB/s"
    )
    print(
        f"{'shape':<14}{'blocks':>7}  {'direction':<10}{'gpu':<6}"
        f"{'staged GB/s':>12}{'pitched GB/s':>13}{'staged %':>9}{'pitched %':>10}"
    )
    for r in rows:
        if r["path"] != "staged":
            continue
        p = next(
            x
            for x in rows
            if x["path"] == "pitched" and all(x[k] == r[k] for k in ("shape", "blocks", "direction", "gpu"))
        )
        print(
            f"{r['shape']:<14}{r['blocks']:>7}  {r['direction']:<10}{r['gpu']:<6}{r['gb_per_s']:>12.1f}"
            f"{p['gb_per_s']:>13.1f}{100 * r['of_pinned']:>8.0f}%{100 * p['of_pinned']:>9.0f}%"
        )
    if args.out:
        header = {
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": package_version("triton"),
            "command": " ".join(sys.argv),
            "pinned_copy": pinned,
        }
        Path(args.out).write_text(json.dumps({"header": header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
