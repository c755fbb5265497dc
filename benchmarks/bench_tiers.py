"""Multi-turn chat over a small device pool, with and without the prefix cache's host tier.

Workload: ``--conversations`` conversations of ``--turns`` turns over one shared system
prompt of ``--system`` tokens. Each turn's prompt is the previous turn's prompt, the model's
reply to it (``--new-tokens`` greedy tokens) and a new user message (``--user`` tokens, seeded
random ids); the next turn of a conversation is submitted a think time (exponential, mean
``--think-s``, seeded) after its previous turn finishes. Conversations start together. The device pool holds
``--pool-fraction`` of the working set (the system prompt plus every conversation's last
context), so by a conversation's next turn most of its history has been evicted.

Runs, each on a fresh engine with the same weights:
- ``no_tier``: the evicted history is recomputed;
- ``host_tier``: evicted cached blocks go to pinned host memory (``--host-fraction`` of the
  working set) and come back on a hit;
- ``disk_tier``: a small host tier (``--disk-host-fraction``) over a disk tier
  (``--disk-fraction``, files under ``--disk-dir`` or a temporary folder); with
  ``--corrupt-every N``, every Nth block file is damaged right after it is written (one byte
  flipped): such a block must be recomputed, never served;
- ``roomy``: a pool holding the whole working set (every hit on the device): the reference the
  tiered runs' tokens are compared with.

Reported per run: time to first token (median, p90) from each turn's submission, turns/s,
tokens run through the model (prefill, recomputation after preemption, decode), prefix hits,
host tier hits / offloads / drops, bytes moved and the copies' GPU time, against the pinned
host<->device copy bandwidth measured in the same run.
Tokens: the fraction of turns whose greedy tokens equal the roomy run's (and of all tokens).

Run (from the project root, on the GPU machine; ../shared/device/stage.sh first):
    source .device-extras/activate.sh && python3 benchmarks/bench_tiers.py --out tiers.json
    python benchmarks/bench_tiers.py --device cpu --tiny       # the same code path, tiny model, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import heapq
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_e2e import LLAMA3_8B, TINY, Timer, percentile, sync  # noqa: E402
from common import package_version  # noqa: E402

from attention import StepCapacity  # noqa: E402
from attention.checks import cdiv  # noqa: E402
from attention.dtypes import torch_dtype  # noqa: E402
from examples.engine import cache_config_for, engine_for  # noqa: E402
from examples.engine.loop import StepPipeline  # noqa: E402
from examples.engine.runner import LaunchedStep, ModelRunner  # noqa: E402
from examples.engine.scheduler import Request, Scheduler, StepBatch, make_preemption  # noqa: E402
from examples.model import Llama, LlamaShape, random_llama  # noqa: E402
from kvcache import AnyBlockManager, BlockManager, BlockStored, HostPrefixTier, KVEvent, collect_stats  # noqa: E402


def pinned_bandwidth(device: str) -> dict[str, float]:
    """Host<->device copy bandwidth of one pinned 1 GiB buffer (median of 5), GB/s each way."""
    if not device.startswith("cuda"):
        return {}
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in {"h2d_gb_per_s": (dev, host), "d2h_gb_per_s": (host, dev)}.items():
        timer, times = Timer(device), []
        for i in range(7):
            timer.start()
            dst.copy_(src, non_blocking=True)
            t = timer.stop()
            if i >= 2:
                times.append(t)
        out[name] = n / statistics.median(times) / 1e9
    return out


class Conversations:
    """The closed-loop multi-turn workload: the next turn of a conversation once its last ends."""

    def __init__(self, args: argparse.Namespace, vocab: int):
        self.rng = random.Random(args.seed)
        self.turns, self.user, self.new_tokens = args.turns, args.user, args.new_tokens
        self.vocab = vocab
        system = self._ids(args.system)
        self.first = [system + self._ids(args.user) for _ in range(args.conversations)]
        self.users = [[self._ids(args.user) for _ in range(args.turns)] for _ in range(args.conversations)]

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def request(self, conv: int, turn: int, prev: Request | None) -> Request:
        prompt = self.first[conv] if prev is None else prev.prompt + prev.output + self.users[conv][turn]
        return Request(conv * self.turns + turn, list(prompt), self.new_tokens)

    def working_set_tokens(self, system: int) -> int:
        last = system + self.turns * (self.user + self.new_tokens)
        return system + len(self.first) * (last - system)


def build(
    model: Llama,
    args: argparse.Namespace,
    num_blocks: int,
    host_bytes: int,
    disk_bytes: int = 0,
    disk_dir: str | None = None,
) -> ModelRunner:
    config = cache_config_for(
        model.shape,
        block_size=args.block_size,
        dtype=args.dtype,
        num_blocks=num_blocks,
        device=args.device,
        backend=args.backend,
        prefix_caching=True,
        host_cache_space=host_bytes,
        disk_cache_space=disk_bytes,
        disk_cache_dir=disk_dir if disk_bytes else None,
    )
    engine = engine_for(config, model.shape)
    longest = args.system + args.turns * (args.user + args.new_tokens)
    capacity = StepCapacity(
        max_rows=args.max_running, max_tokens=args.token_budget, max_blocks_per_seq=cdiv(longest, args.block_size)
    )
    runner = ModelRunner(
        model, engine.cache, engine.manager, engine.backend, capacity, use_graphs=args.graphs and engine.graphs_allowed
    )
    runner.warmup(eager=True)
    return runner


def tiered(manager: AnyBlockManager) -> BlockManager:
    """The runner's manager, with its tiers: this benchmark's model has no KV groups (a
    :class:`~kvcache.HybridBlockManager` has no tiers)."""
    if not isinstance(manager, BlockManager):
        raise TypeError(f"bench_tiers needs one block table per sequence, got {type(manager).__name__}")
    return manager


def serve(runner: ModelRunner, convs: Conversations, args: argparse.Namespace) -> dict[str, Any]:
    manager = tiered(runner.manager)
    scheduler = Scheduler(
        manager, [], make_preemption("recompute", manager, runner.cache),
        token_budget=args.token_budget, max_running=args.max_running,
    )  # fmt: skip
    submitted: dict[int, float] = {}
    first_token: dict[int, float] = {}
    outputs: dict[int, list[int]] = {}
    t0 = time.perf_counter()

    def record(batch: StepBatch, launched: LaunchedStep, tokens: list[int]) -> None:
        now = time.perf_counter() - t0
        for i in launched.plan.metadata.sampling_rows_host:
            first_token.setdefault(batch.requests[i].req_id, now)

    pipeline = StepPipeline(runner, scheduler, overlap=args.overlap, on_result=record)
    think = random.Random(args.seed + 1)
    # (due time, tie-break, request): first turns at 0, later ones a think time after the last.
    pending: list[tuple[float, int, Request]] = [(0.0, c, convs.request(c, 0, None)) for c in range(len(convs.first))]
    seen_finished = 0
    step = computed = 0
    sync(args.device)
    t0 = time.perf_counter()
    while pending or not scheduler.done:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            due, _, req = heapq.heappop(pending)
            submitted[req.req_id] = due
            scheduler.submit(req)
        batch = scheduler.schedule(step)
        if batch is None:
            if pipeline.busy:
                pipeline.drain()
            elif pending:
                time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
            else:
                break
        else:
            pipeline.submit(batch)
            computed += len(batch.token_ids)
            step += 1
        for req in scheduler.finished[seen_finished:]:
            outputs[req.req_id] = list(req.output)
            conv, turn = divmod(req.req_id, convs.turns)
            if turn + 1 < convs.turns:
                due = time.perf_counter() - t0 + (think.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0)
                heapq.heappush(pending, (due, req.req_id, convs.request(conv, turn + 1, req)))
        seen_finished = len(scheduler.finished)
    pipeline.drain()
    for req in scheduler.finished[seen_finished:]:
        outputs[req.req_id] = list(req.output)
    sync(args.device)
    wall = time.perf_counter() - t0
    manager.check_integrity()
    ttft = [first_token[r] - submitted[r] for r in submitted if r in first_token]
    stats = collect_stats(manager)
    out: dict[str, Any] = {
        "turns": len(outputs),
        "wall_s": wall,
        "turns_per_s": len(outputs) / wall,
        "ttft_median_s": statistics.median(ttft) if ttft else None,
        "ttft_p90_s": percentile(ttft, 90),
        "tokens_computed": computed,
        "prefix_hit_tokens": stats.prefix_cache_hits,
        "preemptions": scheduler.num_preemptions,
        "num_blocks": manager.num_blocks,
        "outputs": outputs,
    }
    tier = manager.lower_tier
    if isinstance(tier, HostPrefixTier):
        tier.synchronize()
        h = tier.stats()
        out["host_tier"] = {
            "copy_path": {
                "offloads": "pitched" if tier.pitched_offloads else "staged",
                "loads": "pitched" if tier.pitched_loads else "staged",
            },
            "blocks_total": h.blocks_total,
            "hit_blocks": h.hit_blocks,
            "offloaded_blocks": h.offloaded_blocks,
            "dropped_blocks": h.dropped_blocks,
            "bytes_to_host": h.bytes_to_host,
            "bytes_to_device": h.bytes_to_device,
            "copy_seconds": h.copy_seconds,
            "copy_gb_per_s": (h.bytes_to_host + h.bytes_to_device) / h.copy_seconds / 1e9 if h.copy_seconds else None,
            "to_host_gb_per_s": h.bytes_to_host / h.to_host_seconds / 1e9 if h.to_host_seconds else None,
            "to_device_gb_per_s": h.bytes_to_device / h.to_device_seconds / 1e9 if h.to_device_seconds else None,
        }
        if h.disk is not None:
            out["disk_tier"] = dataclasses.asdict(h.disk)
    return out


class Corrupter:
    """Damages every ``every``-th block file the disk tier writes, right after it is written
    (a KV-event callback): one payload byte flipped."""

    def __init__(self, runner: ModelRunner, every: int):
        self.every, self.seen, self.damaged = every, 0, 0
        tier = runner.manager.lower_tier
        assert isinstance(tier, HostPrefixTier) and tier.disk is not None
        self.disk = tier.disk
        tiered(runner.manager).kv_events.subscribe(self, replay=False)

    def __call__(self, event: KVEvent) -> None:
        if not isinstance(event, BlockStored) or event.tier != "disk":
            return
        self.seen += 1
        if self.seen % self.every:
            return
        self.disk.flush()  # the file is written by the tier's background thread
        path = self.disk.folder / (event.digest.hex() + ".kv")
        with open(path, "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 0xFF]))
        self.damaged += 1


def agreement(ours: dict[int, list[int]], ref: dict[int, list[int]]) -> dict[str, float]:
    same_turns = sum(ours.get(k) == v for k, v in ref.items())
    same_tokens = sum(a == b for k, v in ref.items() for a, b in zip(ours.get(k, []), v, strict=False))
    total = max(sum(map(len, ref.values())), 1)
    return {"identical_turns": same_turns / max(len(ref), 1), "identical_tokens": same_tokens / total}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke run)")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=2048, help="shared system prompt tokens")
    p.add_argument("--user", type=int, default=128, help="tokens per user message")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--think-s", type=float, default=1.0, help="mean user think time between turns (exponential)")
    p.add_argument("--pool-fraction", type=float, default=0.25, help="device pool / working set")
    p.add_argument("--host-fraction", type=float, default=1.5, help="host tier / working set")
    p.add_argument("--disk-host-fraction", type=float, default=0.1, help="the disk_tier run's host tier / working set")
    p.add_argument("--disk-fraction", type=float, default=1.5, help="disk tier / working set")
    p.add_argument("--disk-dir", default=None, help="folder of the block files (default: a temporary folder)")
    p.add_argument("--corrupt-every", type=int, default=0, help="damage every Nth block file written (0: none)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--backend", default=None)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--sequential", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="roomy,no_tier,host_tier")
    p.add_argument("--out", default=None)
    return p


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    args.backend = args.backend or ("triton" if on_cuda else "reference")
    args.dtype = "bfloat16" if on_cuda else "float32"
    args.graphs = on_cuda and not args.eager
    args.overlap = not args.sequential
    shape: LlamaShape = TINY if args.tiny else LLAMA3_8B
    if args.tiny:
        args.conversations, args.turns, args.system, args.user, args.new_tokens = 6, 3, 64, 16, 8
        args.think_s = 0.01
        args.token_budget, args.max_running = 128, 4
    if not on_cuda:
        torch.set_num_threads(1)
    model = random_llama(shape, seed=args.seed, dtype=torch_dtype(args.dtype), device=args.device)
    convs = Conversations(args, shape.vocab_size)
    working = convs.working_set_tokens(args.system)
    bs = args.block_size
    longest = args.system + args.turns * (args.user + args.new_tokens)
    per_block = 2 * shape.num_layers * bs * shape.num_kv_heads * shape.head_dim * torch_dtype(args.dtype).itemsize
    floor = cdiv(longest, bs) + 2  # the longest turn must fit (the scheduler preempts the rest)
    small = max(int(args.pool_fraction * cdiv(working, bs)), floor)
    host_bytes = int(args.host_fraction * cdiv(working, bs)) * per_block
    disk_host_bytes = max(1, int(args.disk_host_fraction * cdiv(working, bs))) * per_block
    disk_bytes = int(args.disk_fraction * cdiv(working, bs)) * (per_block + 4096)  # files have headers
    sizes = {
        "roomy": (cdiv(working, bs) + args.max_running * 2 + 8, 0, 0),
        "no_tier": (small, 0, 0),
        "host_tier": (small, host_bytes, 0),
        "disk_tier": (small, disk_host_bytes, disk_bytes),
    }
    header = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "shape": "tiny" if args.tiny else "llama3-8b",
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "working_set_tokens": working,
        "bytes_per_block": per_block,
        "pinned_copy_before": pinned_bandwidth(args.device),
    }
    results: dict[str, Any] = {"header": header, "runs": {}}
    for name in args.runs.split(","):
        num_blocks, host_bytes, disk_bytes = sizes[name]
        print(
            f"{name}: {num_blocks} device blocks, host tier {host_bytes / 2**30:.2f} GiB, "
            f"disk tier {disk_bytes / 2**30:.2f} GiB",
            flush=True,
        )
        with tempfile.TemporaryDirectory(dir=args.disk_dir) as folder:
            runner = build(model, args, num_blocks, host_bytes, disk_bytes, folder)
            corrupter = Corrupter(runner, args.corrupt_every) if disk_bytes and args.corrupt_every > 0 else None
            results["runs"][name] = serve(runner, convs, args)
            if corrupter is not None:
                results["runs"][name]["files_damaged"] = corrupter.damaged
            del runner, corrupter
        if on_cuda:
            torch.cuda.empty_cache()
    # The yardstick: the better of two measurements, before and after the runs (one 1 GiB copy
    # sometimes comes in well under the link's speed).
    header["pinned_copy_after"] = after = pinned_bandwidth(args.device)
    pinned = header["pinned_copy"] = {k: max(v, after[k]) for k, v in header["pinned_copy_before"].items()}
    ref = results["runs"].get("roomy", {}).get("outputs")
    for r in results["runs"].values():
        h = r.get("host_tier")
        if h and pinned:
            h["to_host_of_pinned"] = h["to_host_gb_per_s"] / pinned["d2h_gb_per_s"] if h["to_host_gb_per_s"] else None
            h["to_device_of_pinned"] = (
                h["to_device_gb_per_s"] / pinned["h2d_gb_per_s"] if h["to_device_gb_per_s"] else None
            )
        if ref is not None:
            r["agreement_with_roomy"] = agreement(r["outputs"], ref)
    no, tiered = results["runs"].get("no_tier"), results["runs"].get("host_tier")
    if no and tiered and no["ttft_median_s"] and tiered["ttft_median_s"]:
        results["ttft_median_ratio_no_tier_over_tier"] = no["ttft_median_s"] / tiered["ttft_median_s"]
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return results


def table(results: dict[str, Any]) -> str:
    lines = [f"{'run':10} {'blocks':>7} {'TTFT med ms':>12} {'p90 ms':>8} {'turns/s':>8} {'computed tok':>12} "
             f"{'host hit/off/drop':>18} {'copy GB/s':>10} {'same turns':>10}"]  # fmt: skip
    notes: list[str] = []
    for name, r in results["runs"].items():
        h = r.get("host_tier")
        host = f"{h['hit_blocks']}/{h['offloaded_blocks']}/{h['dropped_blocks']}" if h else "-"
        gbps = f"{h['copy_gb_per_s']:.1f}" if h and h["copy_gb_per_s"] else "-"
        same = r.get("agreement_with_roomy", {}).get("identical_turns")
        if r.get("disk_tier"):
            d = r["disk_tier"]
            notes.append(
                f"{name}: disk tier {d['hit_blocks']} blocks read back, {d['written_blocks']} written, "
                f"{d['corrupt_blocks']} damaged files detected and recomputed ({r.get('files_damaged', 0)} damaged)"
            )
        if h and h.get("to_host_of_pinned") and h.get("to_device_of_pinned"):
            notes.append(
                f"{name}: copies device->host {h['to_host_gb_per_s']:.1f} GB/s "
                f"({h['to_host_of_pinned']:.0%} of pinned), "
                f"host->device {h['to_device_gb_per_s']:.1f} GB/s ({h['to_device_of_pinned']:.0%}); "
                f"copy paths {h['copy_path']}"
            )
        lines.append(
            f"{name:10} {r['num_blocks']:7d} {r['ttft_median_s'] * 1e3:12.1f} {(r['ttft_p90_s'] or 0) * 1e3:8.1f} "
            f"{r['turns_per_s']:8.2f} {r['tokens_computed']:12d} {host:>18} {gbps:>10} "
            f"{'-' if same is None else f'{same:.0%}':>10}"
        )
    lines += notes
    pinned = results["header"]["pinned_copy"]
    if pinned:
        lines.append(
            f"pinned copy (1 GiB, the better of before and after the runs): host->device "
            f"{pinned['h2d_gb_per_s']:.1f} GB/s, device->host {pinned['d2h_gb_per_s']:.1f} GB/s"
        )
    ratio = results.get("ttft_median_ratio_no_tier_over_tier")
    if ratio:
        lines.append(f"TTFT median, no tier / host tier: {ratio:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    run()
