"""Attention time of a step verifying draft tokens against a one-token decode step, on one GPU.

Speculative decoding verifies k draft tokens per row: each row brings k + 1 new tokens, causal
among themselves. Shape: bf16, 32 query heads, 8 KV heads, head_dim 128 (Llama-3-8B-like);
batches of 128 rows (uniform 2048 and LogNormal lengths) and 64 x 4096. Per batch:

- ``decode q=1``: the plain decode step (one new token per row), our decode kernel;
- ``verify q=k+1``: the same rows verifying k drafts through our decode kernel (rows of up to
  8 new tokens, every token x head of a KV group in one tile);
- ``verify q=k+1 tree``: the same with a draft-tree mask (a chain, so the output is equal);
- ``verify via prefill``: the same rows through our prefill kernel (``max_decode_query_len=1``,
  what the backend did before multi-token decode rows);
- ``flash_attn`` q=1 and q=k+1 at block 256 (flash-attn's paged kernel; skipped with a note
  when flash-attn is missing).

Timing as in bench_decode.py: K/V read from HBM (enough layers' caches that one timed sequence
reads >= 400 MiB), one call per layer replayed from a CUDA graph, ``triton.testing.do_bench``
median, ms per layer. ``vs_decode`` = the row's ms / the decode q=1 ms of the same backend and
block size (the target: <= 1.25 for 4 drafts at 128 rows). Each variant's layer-0 output is
checked against the reference backend in float32 first (``rel_err``).

Run (from the project root, on the GPU machine):
    source .device-extras/activate.sh && python3 benchmarks/bench_verify.py --out verify.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from typing import Any

import common
import torch
from common import DEVICE, DTYPE, HEAD_DIM, HEADS, KV_HEADS, KernelTimer

SEED = 0
HBM_BYTES_PER_GRAPH = 400 << 20


def shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    rng = random.Random(SEED)
    lognormal = tuple(max(16, min(16384, round(rng.lognormvariate(math.log(2048), 0.8)))) for _ in range(128))
    found = [("128x2048", (2048,) * 128), ("lognormal128(med=2048,s=0.8)", lognormal)]
    return found if quick else [*found, ("64x4096", (4096,) * 64), ("32x512", (512,) * 32)]


@dataclasses.dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor  # [layers, num_blocks, block_size, KV_HEADS, HEAD_DIM]
    v: torch.Tensor
    meta: Any


def build(lens: tuple[int, ...], q_len: int, block_size: int, layers: int | None = None) -> Problem:
    """Rows of ``lens`` tokens (the last ``q_len`` new), shuffled block ids, ``layers`` caches."""
    from attention import AttentionMetadata

    gen = torch.Generator(device=DEVICE).manual_seed(SEED)
    tables, num_blocks = common.shuffled_block_tables(lens, block_size, SEED)
    kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * 2
    count = layers or max(2, math.ceil(HBM_BYTES_PER_GRAPH / kv_bytes))
    shape = (count, num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    v = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    b = len(lens)
    q = torch.randn((b * q_len, HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    positions = [p for n in lens for p in range(n - q_len, n)]
    slots = [
        int(tables[r, p // block_size]) * block_size + p % block_size
        for r, n in enumerate(lens)
        for p in range(n - q_len, n)
    ]
    meta = AttentionMetadata(
        block_tables=tables.to(DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
        logits_indices=torch.arange(q_len - 1, b * q_len, q_len, dtype=torch.int64, device=DEVICE),
        block_size=block_size,
        seq_lens_host=lens,
        query_lens_host=(q_len,) * b,
        sampling_rows_host=tuple(range(b)),
    )
    return Problem(q, k, v, meta)


def chain_masks(meta: Any) -> torch.Tensor:
    """Ancestor masks of a chain (token t sees new tokens 0..t): the causal case as a tree."""
    q_lens = meta.query_lens_host
    return torch.tensor([(1 << (t + 1)) - 1 for q in q_lens for t in range(q)], dtype=torch.int32, device=DEVICE)


def time_variant(timer: KernelTimer, p: Problem, backend: Any, meta: Any, ref: torch.Tensor) -> dict[str, Any]:
    from attention import LayerCache

    plan = backend.plan(meta)
    out = torch.empty_like(p.q)
    caches = [LayerCache(p.k[i], p.v[i], index=0) for i in range(p.k.shape[0])]
    backend.attend(p.q, caches[0], plan, out=out)
    torch.cuda.synchronize()
    err = common.rel_err(out, ref)

    def every_layer() -> None:
        for c in caches:
            backend.attend(p.q, c, plan, out=out)

    ms = timer.graph_ms(every_layer) / len(caches)
    return {"ms": ms, "rel_err": err, "layers": len(caches)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", type=int, default=4, help="draft tokens per row (rows bring drafts + 1)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--sweep", action="store_true", help="also time the verify rows under other decode launch configurations"
    )
    ap.add_argument(
        "--sweep-configs",
        default="32:4:2,32:8:2,64:8:2,16:4:2",
        help="the sweep's decode configurations, block_n:num_warps:num_stages, comma-separated",
    )
    ap.add_argument("--block-sizes", default="32,256", help="cache block sizes, comma-separated")
    common.add_run_options(ap, "verify")
    args = ap.parse_args()
    if not common.require_cuda("bench_verify.py"):
        return 2
    from attention import LayerCache, ReferenceBackend
    from attention.triton_backend import TritonBackend

    timer = KernelTimer(args.warmup_ms, args.rep_ms)
    notes: list[str] = []
    copy_tbps = common.measure_copy_tbps(timer)
    spec = common.spec()
    q_len = args.drafts + 1
    rows: list[dict[str, Any]] = []
    for label, lens in shapes(args.quick):
        for block_size in [int(b) for b in args.block_sizes.split(",")]:
            base = build(lens, 1, block_size)
            verify = build(lens, q_len, block_size, layers=base.k.shape[0])
            verify.k, verify.v = base.k, base.v  # the same caches: only the new tokens differ

            refs = {}
            for name, prob in (("q1", base), ("verify", verify)):
                oracle = ReferenceBackend(dataclasses.replace(spec, dtype="float32"))
                layer = LayerCache(prob.k[0].float(), prob.v[0].float(), index=0)
                refs[name] = oracle.attend(prob.q.float(), layer, oracle.plan(prob.meta))
            tree_meta = dataclasses.replace(verify.meta, tree_masks=chain_masks(verify.meta))
            variants: list[tuple[str, str, Any, Problem, Any, str]] = [
                ("decode q=1", "triton", TritonBackend(spec), base, base.meta, "q1"),
                (f"verify q={q_len}", "triton", TritonBackend(spec), verify, verify.meta, "verify"),
                (f"verify q={q_len} tree", "triton", TritonBackend(spec), verify, tree_meta, "verify"),
                (
                    f"verify q={q_len} via prefill",
                    "triton",
                    TritonBackend(spec, max_decode_query_len=1),
                    verify,
                    verify.meta,
                    "verify",
                ),
            ]
            if args.sweep:
                from attention.triton_kernels import DecodeConfig

                for text in args.sweep_configs.split(","):
                    bn, warps, stages = (int(x) for x in text.split(":"))
                    config = DecodeConfig(block_n=bn, num_warps=warps, num_stages=stages)
                    for rows_q, prob, ref in (("decode q=1", base, "q1"), (f"verify q={q_len}", verify, "verify")):
                        name = f"{rows_q} block_n={bn} warps={warps} stages={stages}"
                        backend = TritonBackend(spec, decode_config=config)
                        variants.append((name, "triton", backend, prob, prob.meta, ref))
            if block_size == 256:
                fa = common.flash_attn_backend(notes, label)
                if fa is not None:
                    variants += [
                        ("decode q=1", "flash_attn", fa, base, base.meta, "q1"),
                        (f"verify q={q_len}", "flash_attn", fa, verify, verify.meta, "verify"),
                    ]
            for name, backend_name, backend, prob, meta, ref in variants:
                row: dict[str, Any] = {"shape": label, "block_size": block_size, "variant": name}
                row["backend"] = backend_name
                try:
                    row.update(time_variant(timer, prob, backend, meta, refs[ref]))
                    kv = 2 * sum(lens) * KV_HEADS * HEAD_DIM * 2
                    row["tbps"] = kv / (row["ms"] * 1e-3) / 1e12
                    row["pct_copy"] = 100 * row["tbps"] / copy_tbps
                except Exception as err:  # recorded, the run goes on
                    row["error"] = common.error_line(err)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del base, verify
            torch.cuda.empty_cache()
    for r in rows:
        one = next(
            (
                x
                for x in rows
                if x["shape"] == r["shape"] and x["block_size"] == r["block_size"] and x["backend"] == r["backend"]
                and x["variant"] == "decode q=1" and "ms" in x
            ),
            None,
        )
        if one and "ms" in r:
            r["vs_decode"] = r["ms"] / one["ms"]
    print(
        f"\n{'shape':<30}{'bs':>5}  {'backend':<11}{'variant':<38}{'ms':>9}{'vs decode':>10}{'% copy':>8}"
        f"{'rel_err':>10}"
    )
    for r in rows:
        lead = f"{r['shape']:<30}{r['block_size']:>5}  {r['backend']:<11}{r['variant']:<38}"
        if "ms" not in r:
            print(f"{lead}  error: {r['error'][:60]}")
            continue
        print(
            f"{lead}{r['ms']:>9.4f}{r.get('vs_decode', float('nan')):>10.2f}{r['pct_copy']:>7.0f}%"
            f"{r['rel_err']:>10.1e}"
        )
    for n in notes:
        print("note:", n)
    if args.out:
        out = {"header": common.header(copy_tbps, notes, {"vs_decode": "ms / the same backend's decode q=1 ms"}),
               "args": vars(args), "rows": rows}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
