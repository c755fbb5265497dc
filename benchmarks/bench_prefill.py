"""Paged prefill on one GPU: our kernels vs flash-attn 2 vs torch SDPA (unpaged).

Shape: bf16, 32 query heads, 8 KV heads, head_dim 128 (Llama-3-8B-like); causal, every token
new. tflops = 4 * batch * heads * head_dim * L^2 / 2 / time.

Backends: ``triton`` at block 32 and 256 (on an sm_90 GPU its steps run on the
warp-specialized Gluon kernel, ``attention.triton_kernels.prefill_hopper``; the rows with
variant ``triton kernel`` time the same backend with ``hopper_prefill=False``), ``flash_attn``
at block 256 (through
``attention.registry.get_backend``; skipped with a note when flash-attn is missing), and
``sdpa``: torch's scaled_dot_product_attention on contiguous, unpaged K/V. Paged caches get
a random permutation of block ids, so no row's pages are contiguous. Before timing, every
(shape, backend) is checked against SDPA on the same data: ``rel_err`` = max |out - sdpa| /
max |sdpa|. Times are medians of ``triton.testing.do_bench`` (warm-up first, L2 flushed
before every run) of one layer call (the step's plan is made once, outside the timing), in two
ways: ``ms`` replays the call captured in a CUDA graph (the GPU's time, as serving engines run
decode), ``eager_ms`` calls the backend from Python (the backend's argument checks and kernel
launches included). ``vs_flash_attn`` = flash-attn's ms / the row's ms. The header also
records the device-to-device copy bandwidth of the run.

``--int8`` adds our kernel over an int8 cache (a scale per token and head,
``attention.token_scales``), checked against SDPA on its dequantized K/V. ``--fp8`` adds our
kernel over an fp8 copy of the cache (unit scales), checked against SDPA on the fp8-rounded
K/V: V token-major as kvcache allocates it (``attention.value_layout``), and V contiguous.

``--sweep`` also times the prefill kernel's candidates (``PREFILL_SWEEP``) and prints the best
per shape, so one GPU run can pick the defaults; ``--sweep-only`` runs the sweep alone. (The
decode benchmark is bench_decode.py.)

Prints the table last and writes benchmarks/results/prefill-<YYYY-MM-DD>.json
({"header": {...}, "rows": [rows], "sweep": [sweep rows]}). Without a CUDA GPU it says so and
exits 2.

Run (from the project root, on the GPU machine):
    python3 benchmarks/bench_prefill.py [--quick] [--fp8] [--int8] [--sweep | --sweep-only] [--out PATH]
        [--warmup-ms 25] [--rep-ms 100]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import common
import torch
import torch.nn.functional as F
from common import DEVICE, DTYPE, HEAD_DIM, HEADS, KV_HEADS, REL_ERR_LIMIT, JsonRow, KernelTimer, fmt

FP8 = torch.float8_e4m3fn
PREFILL_SHAPES = [(8, 4096), (32, 1024), (2, 16384)]
QUICK_PREFILL = [(32, 1024)]
BLOCK_SIZES = (32, 256)

PREFILL_DEFINITIONS = {
    **common.DEFINITIONS,
    "tflops": "prefill: 4 x batch x heads x head_dim x seq_len^2 / 2 / time (causal)",
    "rel_err": "max |out - sdpa| / max |sdpa| on the same data",
}


@dataclass
class Row(JsonRow):
    op: str
    backend: str
    batch: int
    seq_len: int
    block_size: int | None
    ms: float | None = None
    eager_ms: float | None = None
    tflops: float | None = None
    rel_err: float | None = None
    vs_flash_attn: float | None = None
    variant: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---- problems ----------------------------------------------------------------------------


@dataclass
class Problem:
    """Random Q/K/V for ``batch`` rows of ``seq_len`` tokens, every one of them new.

    q: [batch * seq_len, HEADS, HEAD_DIM]; k, v: [batch, seq_len, KV_HEADS, HEAD_DIM].
    """

    batch: int
    seq_len: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @staticmethod
    def make(batch: int, seq_len: int, seed: int = 0) -> Problem:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        shape_kv = (batch, seq_len, KV_HEADS, HEAD_DIM)
        q = torch.randn((batch * seq_len, HEADS, HEAD_DIM), generator=gen, device=DEVICE)
        k = torch.randn(shape_kv, generator=gen, device=DEVICE)
        v = torch.randn(shape_kv, generator=gen, device=DEVICE)
        return Problem(batch, seq_len, q.to(DTYPE), k.to(DTYPE), v.to(DTYPE))

    @property
    def causal_flops(self) -> float:
        return 4.0 * self.batch * HEADS * HEAD_DIM * self.seq_len * self.seq_len / 2

    def paged(self, block_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(k_cache, v_cache, metadata) with the rows' blocks at shuffled ids."""
        from attention import AttentionMetadata

        b, seq = self.batch, self.seq_len
        per_row = -(-seq // block_size)
        num_blocks = b * per_row
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=gen, device=DEVICE)
        tables = perm.view(b, per_row).to(torch.int32)
        pad = per_row * block_size - seq
        caches = []
        for src in (self.k, self.v):
            blocks = F.pad(src, (0, 0, 0, 0, 0, pad)).view(num_blocks, block_size, KV_HEADS, HEAD_DIM)
            cache = torch.empty_like(blocks)
            cache[perm] = blocks  # token block j of the batch lives at block id perm[j]
            caches.append(cache)
        pos = torch.arange(seq, device=DEVICE)
        slots = tables[:, pos // block_size].long() * block_size + pos % block_size
        meta = AttentionMetadata(
            block_tables=tables,
            seq_lens=torch.full((b,), seq, dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=DEVICE) * seq,
            slot_mapping=slots.flatten(),
            positions=pos.repeat(b),
            logits_indices=(torch.arange(b, device=DEVICE) + 1) * seq - 1,
            block_size=block_size,
            seq_lens_host=(seq,) * b,
            query_lens_host=(seq,) * b,
            sampling_rows_host=tuple(range(b)),
        )
        return caches[0], caches[1], meta


def _sdpa_fn(p: Problem) -> Callable[[], torch.Tensor]:
    """Causal SDPA on contiguous [batch, heads, len, dim] K/V; returns [tokens, HEADS, HEAD_DIM].

    Prefill is compute-bound: K/V are repeated to every query head so that SDPA's fused
    kernels (not its O(L^2)-memory math path) always apply.
    """
    q = p.q.view(p.batch, p.seq_len, HEADS, HEAD_DIM).transpose(1, 2)
    k = p.k.transpose(1, 2).contiguous().repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = p.v.transpose(1, 2).contiguous().repeat_interleave(HEADS // KV_HEADS, dim=1)

    def run() -> torch.Tensor:
        # All tokens new, so top-left == bottom-right causal alignment.
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=False)
        return o.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)

    return run


def _attend_fn(
    backend: Any, p: Problem, caches: tuple[torch.Tensor, torch.Tensor, Any], layer: Any = None
) -> Callable[[], torch.Tensor]:
    """One layer call of ``backend`` over ``caches`` (an fp8 cache gets unit scales), or over
    ``layer`` (a LayerCache) with ``caches``' metadata when given."""
    from attention import LayerCache

    k_cache, v_cache, meta = caches
    if layer is None and k_cache.dtype == FP8:
        ones = torch.ones(KV_HEADS, dtype=torch.float32, device=DEVICE)
        layer = LayerCache(k_cache, v_cache, k_scale=ones, v_scale=ones)
    elif layer is None:
        layer = LayerCache(k_cache, v_cache)
    plan = backend.plan(meta)  # once per step, outside the timing
    out = torch.empty_like(p.q)

    def run() -> torch.Tensor:
        return backend.attend(p.q, layer, plan, out=out)

    return run


# ---- measuring ---------------------------------------------------------------------------


def _measure(timer: KernelTimer, row: Row, p: Problem, fn: Callable[[], torch.Tensor], ref: torch.Tensor | None) -> Row:
    """Check ``fn`` against ``ref``, then time it; errors are recorded, not raised."""
    try:
        out = fn()
        torch.cuda.synchronize()
        if ref is not None:
            row.rel_err = common.rel_err(out, ref)
        del out
        row.eager_ms = timer.ms(fn)
        try:
            row.ms = timer.graph_ms(fn)
        except Exception as err:  # a backend that cannot be captured is timed eagerly
            row.ms = row.eager_ms
            row.extra["graph_error"] = common.error_line(err, 200)
        row.tflops = p.causal_flops / (row.ms * 1e-3) / 1e12
    except Exception as err:  # keep going: one failing variant must not end a one-shot run
        label = f"{row.op} {row.backend} b={row.batch} L={row.seq_len} bs={row.block_size} {row.variant or ''}"
        common.record_error(row, err, label)
    return row


def run_main(
    timer: KernelTimer, shapes: list[tuple[int, int]], notes: list[str], fp8: bool = False, int8: bool = False
) -> list[Row]:
    """SDPA, triton at block 32 and 256 and flash-attn at 256 on every (batch, seq_len); with
    ``fp8`` also triton over an fp8 copy of the cache (unit scales), checked against SDPA on
    the fp8-rounded K/V; with ``int8`` over an int8 cache (a scale per token and head),
    checked against SDPA on its dequantized K/V, with its dots in fp16 (the default) and in bf16."""
    from attention.token_scales import dequantize_rows, quantize_rows, quantized_layer
    from attention.triton_backend import TritonBackend
    from attention.value_layout import token_major_view

    flash = common.flash_attn_backend(notes, "rows")
    rows: list[Row] = []
    for batch, seq_len in shapes:
        p = Problem.make(batch, seq_len)
        sdpa = _sdpa_fn(p)
        ref = sdpa()
        print(f"prefill batch={batch} seq_len={seq_len}", flush=True)
        shape_rows = [_measure(timer, Row("prefill", "sdpa", batch, seq_len, None), p, sdpa, ref)]
        for block_size in BLOCK_SIZES:
            caches = p.paged(block_size)
            triton_backend = TritonBackend(common.spec())
            row = Row("prefill", "triton", batch, seq_len, block_size)
            fn = _attend_fn(triton_backend, p, caches)
            shape_rows.append(_measure(timer, row, p, fn, ref))
            plain = TritonBackend(common.spec(), hopper_prefill=False)  # the Triton kernel alone
            row = Row("prefill", "triton", batch, seq_len, block_size, variant="triton kernel")
            shape_rows.append(_measure(timer, row, p, _attend_fn(plain, p, caches), ref))
            if block_size == 256 and flash is not None:
                fa = Row("prefill", "flash_attn", batch, seq_len, block_size)
                shape_rows.append(_measure(timer, fa, p, _attend_fn(flash, p, caches), ref))
            if fp8:
                rounded = Problem(batch, seq_len, p.q, p.k.to(FP8).to(DTYPE), p.v.to(FP8).to(DTYPE))
                ref8 = _sdpa_fn(rounded)()
                v8 = caches[1].to(FP8)
                # V token-major as kvcache allocates an fp8 cache (attention.value_layout), and contiguous.
                for variant, values in (
                    ("fp8 cache", token_major_view(torch.empty_like(v8)).copy_(v8)),
                    ("fp8 cache, V contiguous", v8),
                ):
                    caches8 = (caches[0].to(FP8), values, caches[2])
                    backend8 = TritonBackend(common.spec(fp8=True))
                    row = Row("prefill", "triton", batch, seq_len, block_size, variant=variant)
                    shape_rows.append(_measure(timer, row, p, _attend_fn(backend8, p, caches8), ref8))
                del rounded, ref8, caches8, v8, values
            if int8:
                k_int8, v_int8 = (dequantize_rows(*quantize_rows(x), DTYPE) for x in (p.k, p.v))
                ref_int8 = _sdpa_fn(Problem(batch, seq_len, p.q, k_int8, v_int8))()
                layer8 = quantized_layer(caches[0], caches[1])
                backend_int8 = TritonBackend(common.spec(int8=True))
                row = Row("prefill", "triton", batch, seq_len, block_size, variant="int8 cache")
                shape_rows.append(_measure(timer, row, p, _attend_fn(backend_int8, p, caches, layer8), ref_int8))
                del k_int8, v_int8, ref_int8, layer8
            del caches, fn
        common.set_vs_flash_attn(shape_rows)
        rows += shape_rows
        del p, ref, sdpa
        torch.cuda.empty_cache()
    return rows


def run_sweep(timer: KernelTimer, shapes: list[tuple[int, int]]) -> list[Row]:
    """Time the prefill kernel's launch candidates; prints the best per (shape, block size)."""
    from attention.triton_backend import TritonBackend
    from attention.triton_kernels import PREFILL_SWEEP, default_prefill_config

    rows: list[Row] = []
    best_lines: list[str] = []
    for batch, seq_len in shapes:
        p = Problem.make(batch, seq_len)
        ref = _sdpa_fn(p)()
        for block_size in BLOCK_SIZES:
            caches = p.paged(block_size)
            default_p = default_prefill_config(HEAD_DIM, DTYPE)
            variants: list[tuple[str, Any]] = [(f"default {common.describe(default_p)}", TritonBackend(common.spec()))]
            variants += [(common.describe(c), TritonBackend(common.spec(), prefill_config=c)) for c in PREFILL_SWEEP]
            found: list[Row] = []
            for name, backend in variants:
                row = Row("prefill", "triton", batch, seq_len, block_size, variant=name)
                found.append(_measure(timer, row, p, _attend_fn(backend, p, caches), ref))
            timed = [r for r in found if r.ms is not None and (r.rel_err or 0) < REL_ERR_LIMIT]
            if timed:
                best = min(timed, key=lambda r: r.ms or 0.0)
                base = found[0].ms
                gain = f" ({base / best.ms:.2f}x vs default)" if base and best.ms else ""
                best_lines.append(
                    f"prefill b={batch:<4d} L={seq_len:<6d} bs={block_size:<4d} best "
                    f"{best.ms:.4f} ms{gain}: {best.variant}"
                )
            for r in found:
                print(
                    f"  sweep prefill b={batch} L={seq_len} bs={block_size} "
                    f"{fmt(r.ms, '.4f')} ms  rel_err={fmt(r.rel_err, '.1e')}  {r.variant}",
                    flush=True,
                )
            rows += found
            del caches
        del p, ref
        torch.cuda.empty_cache()
    print("\nsweep: best per shape")
    for line in best_lines:
        print("  " + line)
    return rows


# ---- reporting ---------------------------------------------------------------------------


def print_prefill_table(rows: list[Row]) -> None:
    head = (
        f"{'op':7s} {'backend':10s} {'batch':>5s} {'seq_len':>7s} {'block':>5s} {'ms':>9s} {'eager':>8s} "
        f"{'TFLOP/s':>8s} {'vs_fa':>6s} {'rel_err':>8s}  variant"
    )
    common.print_table(
        head,
        rows,
        lambda r: (
            f"{r.op:7s} {r.backend:10s} {r.batch:5d} {r.seq_len:7d} "
            f"{'-' if r.block_size is None else r.block_size:>5} {fmt(r.ms, '9.4f')} {fmt(r.eager_ms, '8.4f')} "
            f"{fmt(r.tflops, '8.1f')} {fmt(r.vs_flash_attn, '6.2f')} {fmt(r.rel_err, '8.1e')}  {r.variant or ''}"
        ),
    )
    print(
        "(ms: CUDA-graph replay, the GPU time of one call; eager: the same call from Python, host "
        "overhead included; vs_fa = flash-attn ms / this ms, > 1 is faster than flash-attn)"
    )


# ---- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short subset of the shapes")
    parser.add_argument("--sweep", action="store_true", help="also sweep the prefill kernel's launch parameters")
    parser.add_argument("--sweep-only", action="store_true", help="the sweep, without the main rows")
    parser.add_argument("--fp8", action="store_true", help="also time triton over an fp8 cache")
    parser.add_argument("--int8", action="store_true", help="also time triton over an int8 cache (per-token scales)")
    common.add_run_options(parser, "prefill")
    args = parser.parse_args(argv)
    if not common.require_cuda("bench_prefill"):
        return 2
    shapes = QUICK_PREFILL if args.quick else PREFILL_SHAPES
    timer = KernelTimer(args.warmup_ms, args.rep_ms)
    run = common.Run("prefill", args.out, timer, PREFILL_DEFINITIONS)
    rows: list[Row] = []
    sweep: list[Row] = []

    def body() -> None:
        nonlocal rows, sweep
        if not args.sweep_only:
            rows = run_main(timer, shapes, run.notes, fp8=args.fp8, int8=args.int8)
        if args.sweep or args.sweep_only:
            sweep = run_sweep(KernelTimer(min(args.warmup_ms, 10), min(args.rep_ms, 40)), shapes)

    def document() -> dict[str, Any]:
        doc: dict[str, Any] = {"rows": [r.as_json() for r in rows]}
        if sweep:
            doc["sweep"] = [r.as_json() for r in sweep]
        return doc

    run.measure(body, document)
    if rows:
        print_prefill_table(rows)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
