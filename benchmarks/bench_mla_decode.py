"""MLA decode (DeepSeek-V3's latent attention, absorbed) on the H200: our paged Triton kernel
(``attention.triton_kernels.mla_decode``) against the copy bandwidth and against a torch
formulation of the same computation over dense, padded latents (two bf16 batched matmuls and
a float32 softmax), same run.

Shapes: DeepSeek-V3's latent (kv_lora_rank 512 + rope 64 = 576 bf16 values per token), 128
heads (one rank) and 16 (eight tensor-parallel ranks), blocks of 64 tokens at shuffled ids;
batches 64 x 4096, 512 x 512 (many short rows) and 128 rows of LogNormal(median 2048, sigma
0.8) lengths (``--batches`` picks some, or adds 2048 x 1024: a step the backend plans ``direct``
at 16 heads). Times are medians of CUDA-graph replays
(``KernelTimer.graph_ms``: L2 flushed before each run, so the latents come from HBM), the
merge included, called as the triton backend calls it (into the bf16 attention output, the
rotary channels zeroed by the merge). Bandwidth: the latent bytes
the step must read (every row's tokens once) over the time, against the device copy bandwidth
of this run. The plans' rows are also timed as ``bench_decode.py`` times GQA decode
(``layers_ms``, "cycled" in the table): one CUDA graph of one call per layer over ``layers``
distinct latent caches (>= 400 MB read per replay, so every call reads HBM), divided by the
layers. The single call pays for the write-back of do_bench's flush, a zero-filled 256 MB
buffer that leaves L2 dirty (about 9 us at 16 heads: results/mla-decode-balanced-2026-12-04.md);
a call among layers finds L2 holding the previous layer's reads.
Launches (heads per program, latents per tile, warps, stages) and split lengths are swept per
shape on the split schedule; the table shows the fastest of them ("best"), the split
schedule's own plan ("split": ``mla_split_count``, ``mla_split_len``) and what the triton
backend runs ("plan": ``default_mla_launch`` on the length-balanced schedule,
``attention.triton_kernels.mla_balanced``, its programs in the splits column, planned
``direct`` when the backend would; at up to 16 heads on an sm_90 GPU the backend runs "hopper"
instead: ``hopper_mla_launch``, the Gluon kernel of ``attention.triton_kernels.mla_decode_hopper``
on its own plan of 64-latent tiles, one program an SM; "ring": the same kernel's deeper-ring form,
``attention.triton_kernels.mla_decode_hopper_ring``, "split": its split-warpgroup form,
``attention.triton_kernels.mla_decode_hopper_split``, and "fused": the two-tile kernel merging split
tokens itself (``hopper_fused_merge``, no merge launch), all opt-in: on an H100 0.98x, 1.00x and
0.94-0.97x the default, ``benchmarks/results/mla-fused-merge-h100-2026-12-06.md``),
and that schedule planned the other way ("direct": tokens of one segment stored by their
program, or "slots": a partial output for every token); all are in the JSON.

``--fp8`` adds the plan's launch over an fp8 copy of the latents (dots in fp16, and in bf16) and,
at 16 heads, the Hopper kernel's fp8 form as the backend launches it ("fp8 hop":
``attention.triton_kernels.mla_decode_hopper_fp8_ws``);
``--plan-only`` skips the sweep.

Run (GPU machine): python3 benchmarks/bench_mla_decode.py [--plan-only] [--fp8] [--batches B,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch
from common import KernelTimer, measure_copy_tbps, require_cuda, shuffled_block_tables

from attention.triton_kernels.mla_balanced import (
    MLAWork,
    min_program_latents,
    mla_direct_store,
    mla_work_programs,
    plan_mla_work,
)
from attention.triton_kernels.mla_decode import (
    MLALaunch,
    default_mla_launch,
    hopper_mla_launch,
    mla_attention,
    mla_split_count,
    mla_split_len,
)

RANK, ROPE, BLOCK = 512, 64, 64
SCALE = (128 + 64) ** -0.5
#: Per head count: the launches and split lengths swept.
LAUNCHES = {
    16: [MLALaunch(16, 32, 4, 3), MLALaunch(16, 64, 4, 2), MLALaunch(16, 64, 4, 3), MLALaunch(16, 64, 8, 3),
         MLALaunch(16, 128, 8, 2), MLALaunch(16, 64, 4, 4)],
    128: [MLALaunch(64, 64, 8, 2), MLALaunch(64, 64, 8, 3), MLALaunch(64, 128, 8, 2), MLALaunch(64, 32, 8, 2)],
}  # fmt: skip
SPLIT_LENS = {16: [512, 1024, 2048], 128: [1024, 4096]}
#: Latent bytes one cycled replay reads over its layers (as bench_decode.HBM_BYTES_PER_GRAPH).
HBM_BYTES_PER_GRAPH = 400 << 20


#: The batches: uniform rows, short rows (many tokens, each a few tiles), LogNormal lengths.
BATCHES = ("64x4096", "512x512", "lognormal-128")
#: Batches run only when named: 2,048 rows, planned direct at 16 heads.
EXTRA_BATCHES = ("2048x1024",)


def lengths(kind: str, seed: int) -> list[int]:
    if kind in ("64x4096", "512x512", "2048x1024"):
        rows, length = kind.split("x")
        return [int(length)] * int(rows)
    rng = random.Random(seed)
    return [max(16, min(16384, int(rng.lognormvariate(math.log(2048), 0.8)))) for _ in range(128)]


def torch_dense(query: torch.Tensor, dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """query [B, H, 576], dense [B, L, 576] -> [B, H, 512]; mask [B, 1, L] (True: a token)."""
    scores = torch.bmm(query, dense.transpose(1, 2)).float() * SCALE
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.bmm(p.to(dense.dtype), dense[..., :RANK])


def measure_batch(
    kind: str, timer: KernelTimer, copy_tbps: float, sms: int, *, plan_only: bool = False, fp8: bool = False
) -> list[dict[str, Any]]:
    """Every launch and split length swept (``plan_only``: none), the plan's choice and torch's
    dense formulation, for both head counts; with ``fp8`` also the plan's launch over an fp8
    copy of the latents (unit scale), its dots in fp16 and in bf16, checked against torch's
    formulation over the fp8-rounded latents (bandwidth counts the fp8 bytes)."""
    lens = lengths(kind, 0)
    host_tables, num_blocks = shuffled_block_tables(lens, BLOCK, seed=1)
    cache = torch.randn(num_blocks, BLOCK, 1, RANK + ROPE, device="cuda").to(torch.bfloat16)
    tables, seq_lens = host_tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    longest = max(lens)
    # Dense copies for torch: every row's latents in order, padded to the longest.
    dense = torch.zeros(len(lens), longest, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    for i, n in enumerate(lens):
        blocks = tables[i, : -(-n // BLOCK)].long()
        dense[i, :n] = cache[blocks].reshape(-1, RANK + ROPE)[:n]
    mask = (torch.arange(longest, device="cuda")[None, :] < seq_lens[:, None])[:, None, :]
    latent_bytes = sum(lens) * (RANK + ROPE) * 2
    # The cycled timing's layers: distinct copies of the cache (the same values, other memory).
    layers = max(2, math.ceil(HBM_BYTES_PER_GRAPH / latent_bytes))
    caches = [cache] + [cache.clone() for _ in range(layers - 1)]
    caches8 = [c.to(torch.float8_e4m3fn) for c in caches] if fp8 else []
    cache8 = caches8[0] if fp8 else None
    dense8 = dense.to(torch.float8_e4m3fn).to(torch.bfloat16) if fp8 else None
    unit = torch.ones(1, dtype=torch.float32, device="cuda")
    rows: list[dict[str, Any]] = []
    row_ids = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    for heads in (128, 16):
        query = torch.randn(len(lens), heads, RANK + ROPE, device="cuda").to(torch.bfloat16)
        # As the triton backend calls it: into the bf16 attention output, rotary channels zeroed.
        out = torch.empty_like(query)
        want = torch_dense(query, dense, mask).float()
        torch_ms = timer.graph_ms(lambda: torch_dense(query, dense, mask))  # noqa: B023 (used in this iteration)
        default = default_mla_launch(heads)
        plan_splits = mla_split_count(len(lens), heads, RANK, default.block_h, tables.shape[1] * BLOCK, sms)
        plan_len = mla_split_len(longest, plan_splits, heads, default.block_n)
        want8 = torch_dense(query, dense8, mask).float() if dense8 is not None else None
        programs = mla_work_programs(heads, default.block_h, default.programs_per_sm, sms)
        rule = mla_direct_store(len(lens), programs, heads, RANK)  # as the triton backend plans it
        works = {
            direct: MLAWork(torch.tensor(plan_mla_work(lens, programs, default.block_n, min_program_latents(heads),
                                                       direct=direct), dtype=torch.int32, device="cuda"),
                            programs, direct)
            for direct in (False, True)
        }  # fmt: skip
        variants = [
            (launch, -(-longest // n), n, False, "") for launch in LAUNCHES[heads] for n in SPLIT_LENS[heads]
        ]
        todo = [] if plan_only else variants
        # The split schedule's own plan, then the balanced schedule the triton backend runs
        # (``splits``: its programs per head tile; ``split_len`` 0).
        todo += [(default, plan_splits, plan_len, False, "split plan"), (default, programs, 0, True, "")]
        # The balanced schedule planned the other way (direct stores or slots for every token).
        todo += [(default, programs, 0, True, "slots" if rule else "direct")]
        # What the backend runs at <= 16 heads on an sm_90 GPU: the Hopper kernel, its own plan.
        hopper = hopper_mla_launch()
        h_programs = mla_work_programs(heads, hopper.block_h, hopper.programs_per_sm, sms)
        h_direct = mla_direct_store(len(lens), h_programs, heads, RANK)
        h_works = {
            counters: MLAWork(torch.tensor(plan_mla_work(lens, h_programs, hopper.block_n, min_program_latents(heads),
                                                         direct=h_direct, counters=counters),
                                           dtype=torch.int32, device="cuda"), h_programs, h_direct, counters)
            for counters in (False, True)  # (the fused merge's plan carries its counters)
        }  # fmt: skip
        if heads <= hopper.block_h:  # the kernel, then its deeper-ring, split-warpgroup and fused-merge forms
            todo += [(hopper, h_programs, 0, True, "hopper"), (hopper_mla_launch(True), h_programs, 0, True, "hopper"),
                     (hopper_mla_launch(split=True), h_programs, 0, True, "hopper"),
                     (hopper_mla_launch(fused_merge=True), h_programs, 0, True, "hopper")]  # fmt: skip
        if fp8:
            todo += [(default, programs, 0, True, name) for name in ("fp8", "fp8 bf16 dots")]
            if heads <= hopper.block_h:  # the Hopper kernel's fp8 form (what the backend runs)
                todo += [(hopper, h_programs, 0, True, "fp8 hopper")]
        for launch, splits, split_len, planned, latent in todo:
            split_plan = latent == "split plan"
            on_hopper = latent in ("hopper", "fp8 hopper")
            direct = h_direct if on_hopper else rule != (latent in ("slots", "direct"))  # those: the other way
            latent = "" if latent in ("split plan", "slots", "direct", "hopper") else latent
            row: dict[str, Any] = {"batch": kind, "heads": heads, **launch.__dict__, "splits": splits,
                                   "split_len": split_len, "plan": planned, "split_plan": split_plan,
                                   "latent": latent or "bf16", "direct": planned and direct,
                                   "as_backend": planned and launch == hopper_mla_launch() if on_hopper
                                   else planned and direct == rule,
                                   "hopper": on_hopper,
                                   "schedule": "balanced" if planned else "split"}  # fmt: skip
            chunk = torch.tensor([split_len], dtype=torch.int32, device="cuda")
            work = h_works[launch.hopper_fused_merge] if on_hopper else works[direct]
            schedule: dict[str, Any] = {"work": work} if planned else {"num_splits": splits, "split_len": chunk}
            extra: dict[str, Any] = {}
            source, expect, nbytes, sources = cache, want, latent_bytes, caches
            if latent and cache8 is not None and want8 is not None:
                source, expect, nbytes, sources = cache8, want8, latent_bytes // 2, caches8
                extra = {"kv_scale": unit, "f16_fp8_dots": latent == "fp8"}

            def run(
                la: MLALaunch = launch, sched: dict[str, Any] = schedule, src: torch.Tensor = source,
                kw: dict[str, Any] = extra,
            ) -> torch.Tensor:  # fmt: skip
                args = {**la.kernel_args(), **({} if "work" in sched else {"unrolled": 0}), **kw}
                return mla_attention(query, src, tables, row_ids, seq_lens, kv_lora_rank=RANK,  # noqa: B023
                                     scale=SCALE, out=out, zero_rest=True, **sched, **args)  # noqa: B023  # fmt: skip

            def every_layer(run: Any = run, srcs: list[torch.Tensor] = sources) -> None:
                for c in srcs:
                    run(src=c)

            try:
                got = run()
                err = float((got.float() - expect).abs().max() / expect.abs().max())
                ms = timer.graph_ms(run)
                tbps = nbytes / (ms * 1e-3) / 1e12
                flops = sum(lens) * heads * 2 * (2 * RANK + ROPE)
                row.update(ms=ms, torch_ms=torch_ms, vs_torch=torch_ms / ms, rel_err=err, tbps=tbps,
                           of_copy=tbps / copy_tbps, tflops=flops / (ms * 1e-3) / 1e12)  # fmt: skip
                if planned or split_plan:  # the plans: also among layers, as bench_decode times
                    layers_ms = timer.graph_ms(every_layer) / len(sources)
                    row.update(layers=len(sources), layers_ms=layers_ms,
                               layers_of_copy=nbytes / (layers_ms * 1e-3) / 1e12 / copy_tbps)  # fmt: skip
            except Exception as e:  # a launch that does not fit (registers, shared memory)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            print(row, flush=True)
    return rows


def _plan_label(row: dict[str, Any]) -> str:
    """The table's label of a balanced-schedule row: "plan" for the backend's plan, "direct" or
    "slots" for the other way of planning it, the latent's name for the fp8 rows."""
    if row["latent"] != "bf16":
        return "fp8 hop" if row.get("hopper") else str(row["latent"])[:7]
    if row.get("hopper"):
        if row.get("hopper_fused_merge"):
            return "fused"
        return "ring" if row.get("hopper_ring") else "split" if row.get("hopper_split") else "hopper"
    if row["as_backend"]:
        return "plan"
    return "direct" if row["direct"] else "slots"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rep-ms", type=int, default=60)
    p.add_argument("--plan-only", action="store_true", help="no launch sweep: the plan's launch only")
    p.add_argument("--fp8", action="store_true", help="also an fp8 latent at the plan's launch (fp16 and bf16 dots)")
    known = (*BATCHES, *EXTRA_BATCHES)
    p.add_argument("--batches", default=",".join(BATCHES), help=f"comma-separated, of {', '.join(known)}")
    args = p.parse_args()
    batches = [b for b in args.batches.split(",") if b]
    unknown = [b for b in batches if b not in known]
    if unknown or not batches:
        p.error(f"--batches: {args.batches!r}; choose among {', '.join(known)}")
    if not require_cuda("bench_mla_decode.py"):
        sys.exit(2)
    timer = KernelTimer(10, args.rep_ms)
    copy_tbps = measure_copy_tbps(timer)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out = [
        row
        for kind in batches
        for row in measure_batch(kind, timer, copy_tbps, sms, plan_only=args.plan_only, fp8=args.fp8)
    ]
    print(f"\n{'batch':14} {'heads':>5} {'':>7} {'launch':>16} {'splits':>6} {'per split':>9} {'ms':>7} {'TB/s':>5} "
          f"{'of copy':>7} {'TFLOP/s':>7} {'vs torch':>8} {'rel err':>8} {'cycled':>7} {'of copy':>7}")  # fmt: skip
    for kind in batches:
        for heads in (128, 16):
            done = [r for r in rows_out if r["batch"] == kind and r["heads"] == heads and "ms" in r]
            bf16 = [r for r in done if r["latent"] == "bf16"]
            splits = [r for r in bf16 if r["schedule"] == "split"]
            picks = [("best", min(splits, key=lambda x: x["ms"]))] if splits else []
            picks += [("split", r) for r in splits if r["split_plan"]]
            picks += [(_plan_label(r), r) for r in done if r["plan"]]
            for label, r in picks:
                launch = f"h{r['block_h']} n{r['block_n']} w{r['num_warps']} s{r['num_stages']}"
                cycled = f"{'-':>7} {'-':>7}"
                if "layers_ms" in r:
                    cycled = f"{r['layers_ms']:7.3f} {r['layers_of_copy']:7.0%}"
                print(
                    f"{kind:14} {heads:5d} {label:>7} {launch:>16} {r['splits']:6d} {r['split_len']:9d} {r['ms']:7.3f} "
                    f"{r['tbps']:5.2f} {r['of_copy']:7.0%} {r['tflops']:7.0f} {r['vs_torch']:7.2f}x "
                    f"{r['rel_err']:8.1e} {cycled}"
                )
    for kind in batches:  # the other forms against the two-tile kernel
        hop = [r for r in rows_out if r["batch"] == kind and r.get("hopper") and "ms" in r and r["latent"] == "bf16"]
        pair = [r for r in hop if not r["hopper_ring"] and not r["hopper_split"] and not r["hopper_fused_merge"]]
        for form in ("ring", "split", "fused_merge"):
            other = [r for r in hop if r[f"hopper_{form}"]]
            if pair and other:
                a, b = pair[0], other[0]
                cycled = ""
                if "layers_ms" in a and "layers_ms" in b:
                    cycled = f", among layers {a['layers_ms'] / b['layers_ms']:.3f}x"
                print(f"{kind}: {form} {a['ms'] / b['ms']:.3f}x the two-tile hopper kernel's speed in one call{cycled}")
        fp8_rows = {r["latent"]: r for r in rows_out if r["batch"] == kind and r["heads"] == 16 and "layers_ms" in r
                    and r["latent"] != "bf16"}  # fmt: skip
        base = [r for r in rows_out if r["batch"] == kind and r["heads"] == 16 and "layers_ms" in r
                and r.get("hopper") and r["latent"] == "bf16" and not r["hopper_ring"] and not r["hopper_split"]
                and not r["hopper_fused_merge"]]
        if base and "fp8 hopper" in fp8_rows:  # speed over the bf16 latent's, among layers
            b8, on_hopper, on_triton = (base[0]["layers_ms"], fp8_rows["fp8 hopper"]["layers_ms"],
                                        fp8_rows["fp8"]["layers_ms"])  # fmt: skip
            print(f"{kind}, 16 heads, among layers: fp8 on the hopper kernel {b8 / on_hopper:.2f}x the bf16 latent's "
                  f"speed, fp8 on the triton kernel {b8 / on_triton:.2f}x")
    doc = {"benchmark": "bench_mla_decode", "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tbps_read_plus_write": copy_tbps,
           "rows": rows_out}  # fmt: skip
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"mla-decode-{doc['date']}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
