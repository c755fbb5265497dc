"""K/V held per sequence by hybrid layer layouts (KV groups) against every layer full, and the
prefix-cache hit rate of both on a shared-prompt workload. Bookkeeping only (CPU, no tensors):
memory is counted as layer-blocks in use (block ids in use times the layers each holds), which
is the K/V bytes up to the bytes of one layer's block.

Layouts (layer counts and windows of the published configs):
- gemma3-27b: 62 layers, five windowed (1024) then one full;
- gemma3-1b:  26 layers, five windowed (512) then one full;
- gemma2-9b:  42 layers, alternating windowed (4096) and full;
- gpt-oss-20b: 24 layers, alternating windowed (128) and full.

Each sequence is prefilled in chunks of ``--chunk`` tokens (each chunk reserved as it is
scheduled, as a chunked-prefill engine does), then decodes 64 tokens; the figure is taken
then. The prefix workload: ``--requests`` requests sharing a ``--system``-token prompt plus 16-200
tokens of their own, admitted one after another (each prefilled and freed before the next),
over a pool with room for every block, then over one with room for ``--tight`` of them.

Run: python benchmarks/bench_hybrid_memory.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
from pathlib import Path
from typing import Any

from kvcache import BlockManager, HybridBlockManager, ScheduledRow, group_layout

LAYOUTS: dict[str, tuple[int, int, tuple[bool, ...]]] = {
    "gemma3-27b": (62, 1024, tuple((i + 1) % 6 != 0 for i in range(62))),
    "gemma3-1b": (26, 512, tuple((i + 1) % 6 != 0 for i in range(26))),
    "gemma2-9b": (42, 4096, tuple(i % 2 == 0 for i in range(42))),
    "gpt-oss-20b": (24, 128, tuple(i % 2 == 0 for i in range(24))),
}
CONTEXTS = (4096, 8192, 32768, 131072)


def run(m: HybridBlockManager | BlockManager, seq: str, prompt: int, decode: int, chunk: int) -> None:
    done = 0
    while done < prompt:
        n = min(chunk, prompt - done)
        if done == 0:
            m.allocate(seq, n)
        else:
            m.append_slots(seq, n)
        m.commit([ScheduledRow(seq, n, done)])
        done += n
    for _ in range(decode):
        m.append_slots(seq, 1)
        m.commit([ScheduledRow(seq, 1)])


def memory_rows(block_size: int, chunk: int) -> list[dict[str, Any]]:
    rows = []
    for name, (layers, window, pattern) in LAYOUTS.items():
        layout = group_layout(layers, window, pattern)
        for context in CONTEXTS:
            blocks = -(-(context + 64) // block_size)
            hybrid = HybridBlockManager(layout, blocks * len(layout.groups), block_size)
            full = BlockManager(blocks, block_size)
            run(hybrid, "s", context, 64, chunk)
            run(full, "s", context, 64, chunk)
            hybrid.check_integrity()
            hybrid_lb = layout.layer_blocks(hybrid.num_used_blocks)
            full_lb = full.allocator.num_used * layers
            rows.append(
                {
                    "layout": name,
                    "context": context,
                    "groups": len(layout.groups),
                    "group_size": layout.group_size,
                    "hybrid_layer_blocks": hybrid_lb,
                    "full_layer_blocks": full_lb,
                    "ratio": hybrid_lb / full_lb,
                    "sequences_that_fit_gain": full_lb / hybrid_lb,
                }
            )
    return rows


def prefix_rows(block_size: int, chunk: int, requests: int, system: int, tight: float) -> list[dict[str, Any]]:
    rng = random.Random(0)
    shared = [rng.randrange(32000) for _ in range(system)]
    prompts = [shared + [rng.randrange(32000) for _ in range(rng.randint(16, 200))] for _ in range(requests)]
    rows = []
    name = "gemma3-27b"
    layers, window, pattern = LAYOUTS[name]
    layout = group_layout(layers, window, pattern)
    per_prompt = -(-max(map(len, prompts)) // block_size)
    for pool in ("roomy", "tight"):
        result: dict[str, Any] = {"layout": name, "pool": pool}
        for kind in ("full", "hybrid"):
            # The hybrid pool's blocks hold 1/len(groups) of the layers: the same bytes hold
            # len(groups) times the block ids.
            ids = per_prompt * requests if pool == "roomy" else int(tight * per_prompt * requests)
            ids = max(ids, per_prompt + 2)
            m: HybridBlockManager | BlockManager
            if kind == "full":
                m = BlockManager(ids, block_size, enable_prefix_caching=True)
            else:
                m = HybridBlockManager(layout, ids * len(layout.groups), block_size, enable_prefix_caching=True)
            hit = queried = 0
            for i, prompt in enumerate(prompts):
                seq = f"r{i}"
                cached = m.allocate(seq, token_ids=prompt)
                hit += cached
                queried += len(prompt)
                done = cached
                while done < len(prompt):
                    n = min(chunk, len(prompt) - done)
                    m.commit([ScheduledRow(seq, n, done)])
                    done += n
                m.free(seq)
            result[f"{kind}_hit_rate"] = hit / queried
            result[f"{kind}_block_ids"] = ids if kind == "full" else ids * len(layout.groups)
        rows.append(result)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--system", type=int, default=2000)
    p.add_argument("--tight", type=float, default=0.05, help="the tight pool / the blocks of every prompt")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    memory = memory_rows(args.block_size, args.chunk)
    prefix = prefix_rows(args.block_size, args.chunk, args.requests, args.system, args.tight)
    print(f"{'layout':12} {'context':>8} {'groups':>6} {'hybrid / full K/V':>18} {'sequences that fit':>19}")
    for r in memory:
        print(
            f"{r['layout']:12} {r['context']:8d} {r['groups']:6d} {r['ratio']:18.3f} "
            f"{r['sequences_that_fit_gain']:18.1f}x"
        )
    for r in prefix:
        print(
            f"prefix hits, {r['layout']}, {r['pool']} pool: every layer full {r['full_hit_rate']:.1%}, "
            f"KV groups {r['hybrid_hit_rate']:.1%}"
        )
    date = datetime.date.today().isoformat()
    doc = {
        "header": {
            "date": date,
            "machine": platform.machine(),
            "python": platform.python_version(),
            "command": "python benchmarks/bench_hybrid_memory.py",
            "args": vars(args),
        },
        "memory": memory,
        "prefix": prefix,
    }
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"hybrid-memory-{date}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
