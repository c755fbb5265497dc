"""The block manager's bookkeeping cost and what paging buys (CPU; no kernels run).

  decode step:    256 running sequences each append one token, then the step's metadata
                  (block tables, lengths, slots) is built, in microseconds;
  admission:      256 prompts of 1000 tokens are checked and allocated, in microseconds;
  shared prefix:  requests sharing one long system prompt, with prefix caching: hit rate and
                  prefill tokens saved;
  fragmentation:  a trace of 1,000 requests with long-tailed (log-normal) prompt and output
                  lengths run through continuous batching: the share of allocated KV slots
                  that hold no token, against reserving each request's maximum length up front.

Prints tables and writes benchmarks/results/manager-<date>.json.
Run: python benchmarks/bench_manager.py [--block-size 32] [--context 1000] [--repeats 50]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcache import BlockManager, MetadataBuilder, ScheduledRow, collect_stats

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


def bench_shared_prefix(num_requests: int, system_len: int, block_size: int) -> dict[str, float]:
    """Requests = one system prompt + a short user part each; finished requests free their
    blocks, which stay cached. Hit rate and prefill tokens saved come from the manager."""
    rng = random.Random(0)
    system = [rng.randrange(32000) for _ in range(system_len)]
    manager = BlockManager(4 * -(-system_len // block_size) + 64, block_size, enable_prefix_caching=True)
    prompt_tokens = 0
    start = time.perf_counter()
    for i in range(num_requests):
        prompt = system + [rng.randrange(32000) for _ in range(rng.randint(16, 200))]
        prompt_tokens += len(prompt)
        manager.allocate(i, token_ids=prompt)
        manager.mark_computed(i, len(prompt))
        manager.free(i)
    elapsed_us = (time.perf_counter() - start) * 1e6
    stats = collect_stats(manager)
    manager.check_integrity()
    return {
        "requests": num_requests,
        "system_prompt_tokens": system_len,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": stats.prefix_cache_hits,
        "hit_rate": stats.prefix_hit_rate,
        "prefill_tokens_saved": stats.prefix_cache_hits,
        "prefill_tokens_computed": prompt_tokens - stats.prefix_cache_hits,
        "us_per_request": elapsed_us / num_requests,
    }


@dataclass(frozen=True)
class TraceRequest:
    arrival: int
    prompt: int
    output: int


def lognormal_trace(n: int, seed: int, max_len: int) -> list[TraceRequest]:
    """Long-tailed lengths: prompt ~ LogNormal(median 512, sigma 1.0), output ~ LogNormal(
    median 128, sigma 1.0), each clipped so prompt + output <= max_len; Poisson arrivals of
    ~2 requests per step."""
    rng = random.Random(seed)
    out, step = [], 0
    for _ in range(n):
        prompt = int(min(max(8, rng.lognormvariate(math.log(512), 1.0)), max_len // 2))
        output = int(min(max(1, rng.lognormvariate(math.log(128), 1.0)), max_len - prompt))
        out.append(TraceRequest(step, prompt, output))
        step += int(rng.expovariate(2.0))
    return out


def bench_fragmentation(trace: list[TraceRequest], block_size: int, num_blocks: int, max_len: int) -> dict[str, float]:
    """Continuous batching over ``trace`` (prefill at admission, one token per step after).
    Sums, over steps, tokens held vs slots allocated; the two baselines reserve contiguous
    memory per running request: ``max_len`` (the model's maximum) or prompt + output (the
    request's own maximum, known only to an oracle)."""
    manager = BlockManager(num_blocks, block_size)
    pending = sorted(trace, key=lambda r: r.arrival)
    running: dict[int, tuple[TraceRequest, int]] = {}  # id -> (request, tokens now)
    tokens_sum = slots_sum = max_len_sum = oracle_sum = 0
    step = nxt = 0
    while nxt < len(pending) or running:
        while nxt < len(pending) and pending[nxt].arrival <= step and manager.can_allocate(pending[nxt].prompt):
            manager.allocate(nxt, pending[nxt].prompt)
            running[nxt] = (pending[nxt], pending[nxt].prompt)
            nxt += 1
        for rid in list(running):
            req, held = running[rid]
            if held - req.prompt + 1 >= req.output:
                manager.free(rid)
                del running[rid]
            elif manager.can_append(rid, 1):
                manager.append_slots(rid, 1)
                running[rid] = (req, held + 1)
        if running:
            tokens_sum += sum(held for _, held in running.values())
            slots_sum += manager.allocator.num_used * block_size
            max_len_sum += len(running) * max_len
            oracle_sum += sum(req.prompt + req.output for req, _ in running.values())
        step += 1
    manager.check_integrity()
    return {
        "block_size": block_size,
        "steps": step,
        "paged_waste": 1 - tokens_sum / slots_sum,
        "contiguous_max_len_waste": 1 - tokens_sum / max_len_sum,
        "contiguous_oracle_waste": 1 - tokens_sum / oracle_sum,
    }


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

    shared = bench_shared_prefix(num_requests=200, system_len=2000, block_size=bs)
    print(f"\nshared prefix: {shared['requests']} requests, a {shared['system_prompt_tokens']}-token system prompt "
          f"+ 16-200 tokens each, prefix caching on, block_size {bs}")
    print(f"  hit rate {shared['hit_rate']:.1%} of prompt tokens; prefill tokens saved "
          f"{shared['prefill_tokens_saved']:,} of {shared['prompt_tokens']:,}; "
          f"bookkeeping {shared['us_per_request']:.0f} us per request")

    max_len = 8192
    trace = lognormal_trace(1000, seed=0, max_len=max_len)
    frag = [bench_fragmentation(trace, size, num_blocks=(1 << 18) // size, max_len=max_len) for size in (32, 256)]
    print(f"\nfragmentation: 1,000 requests, prompt ~ LogNormal(median 512, sigma 1), output ~ LogNormal("
          f"median 128, sigma 1), max_len {max_len}, pool of 262,144 token slots")
    print(f"{'block_size':>10} {'paged: empty slots':>20} {'reserve max_len':>16} {'reserve own max':>16}")
    for row in frag:
        print(f"{row['block_size']:>10} {row['paged_waste']:>20.2%} {row['contiguous_max_len_waste']:>16.2%} "
              f"{row['contiguous_oracle_waste']:>16.2%}")

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
        "shared_prefix": shared,
        "fragmentation": {"trace": "1000 requests; prompt LogNormal(median 512, sigma 1.0), output LogNormal("
                                   "median 128, sigma 1.0), clipped to max_len 8192; seed 0",
                          "rows": frag},
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
