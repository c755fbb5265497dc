"""MLA prefill (DeepSeek-V3's latent attention) on the H200: absorbed against decompressed, and
our decompressed kernel against torch SDPA on the same decompressed K/V, same run.

Shapes: DeepSeek-V3's attention (qk_nope 128 + rope 64, v 128, kv_lora_rank 512), 128 heads
(one rank) and 16 (eight tensor-parallel ranks); causal prompts 8 x 4096, 2 x 16384 and 32 x
1024 (no cached tokens, so SDPA's ``is_causal`` is the same mask), bf16. Variants:

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on dense [B, H, T, d] K/V
  (its own choice of backend; cuDNN or flash on the H200), the target's reference;
- ``kernel``: :func:`attention.triton_kernels.mla_prefill.mla_prefill`'s Triton kernel on the
  same K/V (the fastest of a few launches; all are in the JSON);
- ``hopper``: the same call with its defaults, which on an sm_90 GPU runs the Gluon kernel
  (:mod:`attention.triton_kernels.mla_prefill_hopper`);
- ``decompressed``: what a prefill step runs: the rows' latents gathered from a paged cache
  (blocks of 64 at shuffled ids), ``kv_b_proj`` on them, then ``mla_prefill`` with its
  defaults (the Gluon kernel where it applies);
- ``absorbed``: :func:`attention.triton_kernels.mla_decode.mla_attention`, every new token
  streaming its prefix's latents (the decode kernel's form; run on the smaller shapes only).

Then extend rows (8 rows of 8 to 256 new tokens over 4,096 cached): the whole decompressed path
against the absorbed kernel (plus ``W_UV``), where the crossover lies.

Times are medians of ``triton.testing.do_bench`` (L2 flushed before each run). TFLOP/s count
the causal attention's multiply-adds of the decompressed form, ``2 * H * (n + e + v)`` per
visible (query, key) pair, for every variant, so a slower form shows as fewer TFLOP/s.

Run (GPU machine): python3 benchmarks/bench_mla_prefill.py [--default-only] [--rep-ms 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch
from common import KernelTimer, require_cuda, shuffled_block_tables

from attention.triton_kernels.mla_decode import causal_queries, default_mla_launch, mla_attention
from attention.triton_kernels.mla_prefill import MLAPrefillConfig, default_mla_prefill_config, mla_prefill
from attention.triton_kernels.mla_prefill_hopper import mla_hopper_applies

RANK, ROPE, NOPE, VALUE, BLOCK = 512, 64, 128, 128, 64
SCALE = (NOPE + ROPE) ** -0.5
SHAPES = [(8, 4096), (2, 16384), (32, 1024)]
CONFIGS = [
    MLAPrefillConfig(128, 64, 8, 2),
    MLAPrefillConfig(128, 64, 8, 3),
    MLAPrefillConfig(128, 32, 8, 3),
    MLAPrefillConfig(128, 128, 8, 2),
    MLAPrefillConfig(64, 64, 4, 3),
    # One warpgroup for a 128-row tile (results/prefill-ceiling-2026-12-04.md).
    MLAPrefillConfig(128, 64, 4, 3),
    MLAPrefillConfig(128, 64, 4, 2),
    MLAPrefillConfig(128, 32, 4, 3),
]


def measure(batch: int, tokens: int, heads: int, timer: KernelTimer, configs: list[MLAPrefillConfig]) -> dict[str, Any]:
    """Every variant on one shape; returns the row (milliseconds, TFLOP/s, errors)."""
    dev, bf16 = "cuda", torch.bfloat16
    total = batch * tokens
    flops = 2 * heads * (NOPE + ROPE + VALUE) * batch * tokens * (tokens + 1) / 2
    gen = torch.Generator(device=dev).manual_seed(0)
    latents = torch.randn(total, RANK + ROPE, device=dev, generator=gen).to(bf16)
    w_kv = (torch.randn(heads * (NOPE + VALUE), RANK, device=dev, generator=gen) * RANK**-0.5).to(bf16)
    query = torch.randn(total, heads, NOPE + ROPE, device=dev, generator=gen).to(bf16)
    kv = (latents[:, :RANK] @ w_kv.T).view(total, heads, NOPE + VALUE)
    key_pe = latents[:, RANK:]
    lens = [tokens] * batch
    row: dict[str, Any] = {"batch": batch, "tokens": tokens, "heads": heads, "tflop": flops / 1e12}

    # torch SDPA on dense [B, H, T, d] tensors (the copies are made outside the timing).
    q4 = query.view(batch, tokens, heads, -1).transpose(1, 2).contiguous()
    k4 = torch.cat((kv[..., :NOPE], key_pe[:, None, :].expand(total, heads, ROPE)), dim=-1)
    k4 = k4.view(batch, tokens, heads, -1).transpose(1, 2).contiguous()
    v4 = kv[..., NOPE:].reshape(batch, tokens, heads, VALUE).transpose(1, 2).contiguous()

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=SCALE)

    want = sdpa().transpose(1, 2).reshape(total, heads, VALUE).float()
    row["sdpa_ms"] = timer.ms(sdpa)

    kernel_rows: list[dict[str, Any]] = []
    for cfg in configs:

        def kernel(c: MLAPrefillConfig = cfg) -> torch.Tensor:
            return mla_prefill(query, kv, key_pe, lens, lens, qk_nope_head_dim=NOPE, scale=SCALE, config=c)

        try:
            err = float((kernel().float() - want).abs().max() / want.abs().max())
            kernel_rows.append({"config": list(cfg.__dict__.values()), "ms": timer.ms(kernel), "rel_err": err})
        except Exception as e:  # a launch that does not fit (registers, shared memory)
            kernel_rows.append({"config": list(cfg.__dict__.values()), "error": str(e).splitlines()[0][:200]})
    row["kernel_launches"] = kernel_rows
    best = min((r for r in kernel_rows if "ms" in r), key=lambda r: r["ms"])
    row.update(kernel_ms=best["ms"], kernel_config=best["config"], kernel_rel_err=best["rel_err"])

    def hopper() -> torch.Tensor:
        return mla_prefill(query, kv, key_pe, lens, lens, qk_nope_head_dim=NOPE, scale=SCALE)

    if mla_hopper_applies(query, kv, key_pe, NOPE):
        row["hopper_rel_err"] = float((hopper().float() - want).abs().max() / want.abs().max())
        row["hopper_ms"] = timer.ms(hopper)

    # The whole decompressed path over a paged cache: gather, up-project, attend.
    host_tables, num_blocks = shuffled_block_tables(lens, BLOCK, seed=1)
    cache = torch.empty(num_blocks, BLOCK, RANK + ROPE, device=dev, dtype=bf16)
    slots = (host_tables.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(batch, -1)[:, :tokens]
    slots = slots.reshape(-1).to(dev)
    cache.view(-1, RANK + ROPE)[slots] = latents

    def decompressed() -> torch.Tensor:
        gathered = cache.view(-1, RANK + ROPE).index_select(0, slots)
        up = (gathered[:, :RANK] @ w_kv.T).view(total, heads, NOPE + VALUE)
        return mla_prefill(query, up, gathered[:, RANK:], lens, lens, qk_nope_head_dim=NOPE, scale=SCALE)

    row["decompressed_rel_err"] = float((decompressed().float() - want).abs().max() / want.abs().max())
    row["decompressed_ms"] = timer.ms(decompressed)

    # Absorbed: every token streams its prefix's latents (only where it finishes quickly).
    if heads * total * tokens <= 128 * 32 * 1024 * 1024:
        tables = host_tables.to(dev)
        token_rows, token_lens = (torch.tensor(x, dtype=torch.int32, device=dev) for x in causal_queries(lens, lens))
        w_uk = w_kv.view(heads, NOPE + VALUE, RANK)[:, :NOPE]
        q_abs = torch.cat((torch.einsum("thn,hnr->thr", query[..., :NOPE], w_uk), query[..., NOPE:]), dim=-1)
        paged = cache.view(num_blocks, BLOCK, 1, RANK + ROPE)

        # The split schedule (no balanced work plan), so no unrolled segments.
        launch_args: dict[str, Any] = {**default_mla_launch(heads).kernel_args(), "unrolled": 0}

        def absorbed() -> torch.Tensor:
            return mla_attention(q_abs, paged, tables, token_rows, token_lens, kv_lora_rank=RANK, scale=SCALE,
                                 **launch_args)  # fmt: skip

        row["absorbed_ms"] = timer.ms(absorbed)
    for name in ("sdpa", "kernel", "hopper", "decompressed", "absorbed"):
        if f"{name}_ms" in row:
            row[f"{name}_tflops"] = flops / (row[f"{name}_ms"] * 1e-3) / 1e12
    row["kernel_vs_sdpa"] = row["sdpa_ms"] / row["kernel_ms"]
    if "hopper_ms" in row:
        row["hopper_vs_sdpa"] = row["sdpa_ms"] / row["hopper_ms"]
    row["decompressed_vs_sdpa"] = row["sdpa_ms"] / row["decompressed_ms"]
    print({k: v for k, v in row.items() if k != "kernel_launches"}, flush=True)
    return row


def measure_extend(new: int, heads: int, timer: KernelTimer) -> dict[str, Any]:
    """8 rows of ``new`` tokens over 4,096 cached ones: the whole decompressed path (gather,
    ``kv_b_proj``, kernel) against the absorbed kernel, to place the crossover
    (``AttentionBackend.latent_prefill_min_tokens``)."""
    dev, bf16, rows, cached = "cuda", torch.bfloat16, 8, 4096
    key_lens, query_lens = [cached + new] * rows, [new] * rows
    gen = torch.Generator(device=dev).manual_seed(0)
    host_tables, num_blocks = shuffled_block_tables(key_lens, BLOCK, seed=1)
    cache = torch.randn(num_blocks, BLOCK, RANK + ROPE, device=dev, generator=gen).to(bf16)
    w_kv = (torch.randn(heads * (NOPE + VALUE), RANK, device=dev, generator=gen) * RANK**-0.5).to(bf16)
    query = torch.randn(rows * new, heads, NOPE + ROPE, device=dev, generator=gen).to(bf16)
    width = host_tables.shape[1] * BLOCK
    slots = (host_tables.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(rows, width)[:, : cached + new]
    slots = slots.reshape(-1).to(dev)

    def decompressed() -> torch.Tensor:
        gathered = cache.view(-1, RANK + ROPE).index_select(0, slots)
        up = (gathered[:, :RANK] @ w_kv.T).view(-1, heads, NOPE + VALUE)
        return mla_prefill(query, up, gathered[:, RANK:], query_lens, key_lens, qk_nope_head_dim=NOPE, scale=SCALE)

    tables = host_tables.to(dev)
    token_rows, token_lens = (
        torch.tensor(x, dtype=torch.int32, device=dev) for x in causal_queries(key_lens, query_lens)
    )
    w_uk = w_kv.view(heads, NOPE + VALUE, RANK)[:, :NOPE]
    q_abs = torch.cat((torch.einsum("thn,hnr->thr", query[..., :NOPE], w_uk), query[..., NOPE:]), dim=-1)
    paged = cache.view(num_blocks, BLOCK, 1, RANK + ROPE)
    launch_args: dict[str, Any] = {**default_mla_launch(heads).kernel_args(), "unrolled": 0}

    def absorbed() -> torch.Tensor:
        latent = mla_attention(q_abs, paged, tables, token_rows, token_lens, kv_lora_rank=RANK, scale=SCALE,
                               **launch_args)  # fmt: skip
        w_uv = w_kv.view(heads, NOPE + VALUE, RANK)[:, NOPE:]
        return torch.einsum("thr,hvr->thv", latent.to(bf16), w_uv)

    err = float((decompressed().float() - absorbed().float()).abs().max() / absorbed().float().abs().max())
    row = {"rows": rows, "cached": cached, "new": new, "heads": heads, "decompressed_ms": timer.ms(decompressed),
           "absorbed_ms": timer.ms(absorbed), "rel_diff": err}  # fmt: skip
    row["decompressed_speedup"] = row["absorbed_ms"] / row["decompressed_ms"]
    print(row, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--default-only", action="store_true", help="the Triton kernel at its default launch only")
    args = p.parse_args()
    if not require_cuda("bench_mla_prefill.py"):
        sys.exit(2)
    timer = KernelTimer(10, args.rep_ms)
    configs = [default_mla_prefill_config(torch.bfloat16)] if args.default_only else CONFIGS
    rows = [measure(b, t, h, timer, configs) for h in (128, 16) for b, t in SHAPES]
    extend = [measure_extend(n, h, timer) for h in (128, 16) for n in (8, 16, 32, 64, 128, 256)]
    print(f"\n{'shape':>9} {'heads':>5} {'sdpa TF/s':>9} {'triton':>7} {'vs sdpa':>7} {'hopper':>7} {'vs sdpa':>7} "
          f"{'decomp.':>7} {'vs sdpa':>7} {'absorbed':>8} {'triton launch':>16}")  # fmt: skip
    for r in rows:
        absorbed = f"{r['absorbed_tflops']:8.0f}" if "absorbed_tflops" in r else f"{'-':>8}"
        hopper = f"{r['hopper_tflops']:7.0f} {r['hopper_vs_sdpa']:6.2f}x" if "hopper_ms" in r else f"{'-':>7} {'-':>7}"
        print(
            f"{r['batch']:>3}x{r['tokens']:<5} {r['heads']:5d} {r['sdpa_tflops']:9.0f} {r['kernel_tflops']:7.0f} "
            f"{r['kernel_vs_sdpa']:6.2f}x {hopper} {r['decompressed_tflops']:7.0f} {r['decompressed_vs_sdpa']:6.2f}x "
            f"{absorbed} {r['kernel_config']!s:>16}"
        )
    print(f"\n{'extend rows':>22} {'heads':>5} {'decompressed ms':>15} {'absorbed ms':>11} {'speedup':>7}")
    for r in extend:
        shape = f"{r['rows']} x ({r['cached']} + {r['new']})"
        print(f"{shape:>22} {r['heads']:5d} {r['decompressed_ms']:15.3f} {r['absorbed_ms']:11.3f} "
              f"{r['decompressed_speedup']:6.2f}x")  # fmt: skip
    doc = {"benchmark": "bench_mla_prefill", "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "extend": extend}  # fmt: skip
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"mla-prefill-{doc['date']}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
