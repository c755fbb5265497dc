"""How often an fp8 KV cache changes the example model's greedy tokens.

The same random-weight Llama-shaped model (bf16 compute) serves the same requests twice, once
with a bf16 cache and once with a float8_e4m3 cache (per-layer, per-KV-head scales from
``cache.kv_scale``), and the generated tokens are compared position by position. After a
request's first differing token its continuation differs anyway, so the report gives both the
share of equal tokens and the share of requests that never differ.

    python3 benchmarks/fp8_agreement.py [--device cuda] [--backend triton] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch


def serve(kv_dtype: str, args: argparse.Namespace) -> list[list[int]]:
    from examples.engine.loop import run_requests
    from examples.engine.scheduler import make_preemption
    from examples.engine.workload import make_workload
    from examples.model import random_llama, shape_for_cache
    from kvcache import allocate_kv_cache, backend_for, manager_for, parse_config

    config = parse_config(
        f"model: {{num_layers: {args.layers}, num_heads: 16, num_kv_heads: 4, head_dim: 64, dtype: bfloat16}}\n"
        f"cache: {{block_size: {args.block_size}, dtype: {kv_dtype}, num_blocks: {args.blocks}, "
        f"device: {args.device}, kv_scale: {args.kv_scale}}}\n"
        f"attention: {{backend: {args.backend}}}\n"
    )
    cache = allocate_kv_cache(config)
    manager = manager_for(config, cache)
    backend = backend_for(config, cache.device.type).backend
    shape = shape_for_cache(config.model, vocab_size=512)
    model = random_llama(shape, seed=0, dtype=torch.bfloat16, device=cache.device)
    requests = make_workload("default", args.requests, seed=1, block_size=args.block_size, vocab_size=512)
    run_requests(
        model,
        requests,
        manager=manager,
        cache=cache,
        backend=backend,
        preemption=make_preemption("recompute", manager, cache),
        token_budget=256,
        max_running=16,
    )
    return [list(r.output) for r in requests]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-scale", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    bf16 = serve("bfloat16", args)
    fp8 = serve("float8_e4m3", args)
    total = sum(len(a) for a in bf16)
    equal = sum(x == y for a, b in zip(bf16, fp8, strict=True) for x, y in zip(a, b, strict=True))
    untouched = sum(a == b for a, b in zip(bf16, fp8, strict=True))
    result: dict[str, Any] = {
        "device": args.device,
        "backend": args.backend,
        "requests": len(bf16),
        "generated_tokens": total,
        "equal_tokens": equal,
        "token_agreement": equal / total,
        "identical_requests": untouched,
    }
    print(
        f"fp8 vs bf16 cache: {equal}/{total} generated tokens equal ({equal / total:.1%}); "
        f"{untouched}/{len(bf16)} requests identical"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
