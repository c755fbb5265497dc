"""Serving a Gemma-3-style model (five windowed layers to one full) with KV groups against one
block table for every layer, in the same cache memory: how many requests run at once, K/V
held, tokens/s. The example engine end to end (scheduler, model runner, triton kernels, CUDA
graphs, overlapped steps).

Model: Gemma-3-1B's published shape (26 layers, hidden 1152, MLP 6912, 4 query heads / 1 KV
head, head_dim 256, vocab 262144, window 512, full layers 5, 11, 17 and 23, q/k norms, a local
rotary base), random bf16 weights (seeded, the same for both runs). With KV groups the 22
windowed layers form groups of 4 beside one group of the 4 full layers (7 groups; one block
id holds 4 layers' K/V).

Workload: ``--requests`` requests arriving at once, prompts LogNormal(median ``--prompt``,
sigma 0.5) capped at 4x the median, ``--new-tokens`` each, greedy, no EOS. The cache is
``--blocks`` whole-model blocks of 256 tokens (the memory both runs get).

Reported per run: generated tokens/s (the loop's wall time: warm-up and graph capture
excluded), the most requests running at once and their mean over steps, K/V held (layer
blocks in use: block ids in use times the layers each holds) mean and peak over steps and
per running request (mean over steps), preemptions, steps; and how many requests' tokens
are identical between the runs (bf16: a different batch composition may round differently).

Run (GPU machine; ../shared/device/stage.sh first):
    source .device-extras/activate.sh && python3 benchmarks/bench_hybrid_serving.py
    python benchmarks/bench_hybrid_serving.py --device cpu --tiny     # the code path in seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from examples.engine import cache_config_for, engine_for
from examples.engine.loop import run_requests
from examples.engine.scheduler import Request, Scheduler, make_preemption
from examples.model import LlamaShape, random_llama

WINDOW_LAYERS_1B = tuple((i + 1) % 6 != 0 for i in range(26))
GEMMA3_1B = LlamaShape(
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_layers=26,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    tie_word_embeddings=True,
    sliding_window=512,
    window_layers=WINDOW_LAYERS_1B,
    norm_offset=True,
    embed_scale=True,
    sandwich_norms=True,
    mlp_activation="gelu_tanh",
    softmax_scale=256**-0.5,
    qk_norm=True,
    local_rope_theta=10_000.0,
)
TINY = LlamaShape(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    sliding_window=64,
    window_layers=(True,) * 5 + (False,),
    qk_norm=True,
)


def workload(n: int, median: int, new_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [max(16, min(4 * median, int(rng.lognormvariate(math.log(median), 0.5)))) for _ in range(n)]
    return [[rng.randrange(vocab) for _ in range(length)] for length in lengths]


def serve(model: Any, shape: LlamaShape, prompts: list[list[int]], args: argparse.Namespace, kv_groups: bool) -> dict:
    config = cache_config_for(
        shape, block_size=args.block_size, dtype=args.dtype, num_blocks=args.blocks, device=args.device,
        backend=args.backend,
    )  # fmt: skip
    engine = engine_for(config, shape, kv_groups=kv_groups)
    requests = [Request(i, p, args.new_tokens) for i, p in enumerate(prompts)]
    running: list[int] = []
    held: list[int] = []
    layers_per_id = engine.cache.num_tensors

    def on_step(step: int, scheduler: Scheduler, elapsed: float, generated: int) -> None:
        running.append(len(scheduler.running))
        held.append(scheduler.manager.allocator.num_used * layers_per_id)

    use_graphs = engine.graphs_allowed and not args.eager
    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=args.token_budget,
        max_running=args.max_running, use_graphs=use_graphs, on_step=on_step,
    )  # fmt: skip
    capacity = engine.cache.num_blocks * engine.cache.num_tensors
    result = {
        "kv_groups": kv_groups,
        "groups": report.kv_groups,
        "layers_per_block_id": engine.cache.num_tensors,
        "block_ids": engine.cache.num_blocks,
        "finished": report.finished,
        "wall_s": report.wall_s,
        "tokens_per_s": report.generated_tokens / report.wall_s,
        "steps": report.steps,
        "preemptions": report.preemptions,
        "max_running": max(running),
        "mean_running": sum(running) / len(running),
        "mean_layer_blocks": sum(held) / len(held),
        "layer_blocks_per_request": statistics.mean(h / r for h, r in zip(held, running, strict=True) if r),
        "peak_layer_blocks": max(held),
        "layer_block_capacity": capacity,
        "graph_replays": report.graph_replays,
        "outputs": [r.output for r in requests],
    }
    del engine, report
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model and workload (the code path in seconds)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=4096, help="median prompt length")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--blocks", type=int, default=160, help="cache size in whole-model blocks")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--backend", default="triton")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shape = GEMMA3_1B
    if args.tiny:
        shape = TINY
        args.requests, args.prompt, args.new_tokens, args.blocks = 12, 200, 24, 24
        args.block_size, args.token_budget, args.max_running = 32, 256, 12
        if args.device == "cpu":
            args.backend, args.dtype = "reference", "float32"
    dtype = getattr(torch, args.dtype)
    model = random_llama(shape, seed=args.seed, dtype=dtype, device=args.device)
    prompts = workload(args.requests, args.prompt, args.new_tokens, shape.vocab_size, args.seed)
    runs = [serve(model, shape, prompts, args, kv_groups) for kv_groups in (True, False)]
    grouped, single = runs
    identical = sum(a == b for a, b in zip(grouped.pop("outputs"), single.pop("outputs"), strict=True))
    print(f"{'':24} {'KV groups':>12} {'one table':>12} {'ratio':>7}")
    for key, label in (
        ("tokens_per_s", "tokens/s"),
        ("max_running", "most running at once"),
        ("mean_running", "mean running"),
        ("mean_layer_blocks", "mean layer blocks held"),
        ("layer_blocks_per_request", "layer blocks / request"),
        ("peak_layer_blocks", "peak layer blocks held"),
        ("preemptions", "preemptions"),
        ("steps", "steps"),
    ):
        a, b = grouped[key], single[key]
        print(f"{label:24} {a:12.1f} {b:12.1f} {a / b if b else float('nan'):7.2f}")
    print(f"identical requests: {identical} / {len(prompts)}; layer-block capacity {grouped['layer_block_capacity']}")
    doc = {
        "benchmark": "bench_hybrid_serving",
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "shape": "tiny" if args.tiny else "gemma3-1b",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs,
        "identical_requests": identical,
    }
    if args.out or not args.tiny:
        out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"hybrid-serving-{doc['date']}.json"
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
