"""Paged decode on one GPU: our token-balanced Triton decode vs flash-attn 2.

Shape: bf16, 32 query heads, 8 KV heads, head_dim 128 (Llama-3-8B-like); one new token per
row, the whole row cached. Batches: uniform lengths, and LogNormal lengths (fixed seed) whose
rows differ by 10x or more, where a kernel sized by its longest row idles most of the GPU.
Backends: ``triton`` (the default, an fp8 cache, and an int8 cache with a scale per token and
head) at block 32 and 256, ``flash_attn`` at
block 256 (through ``attention.registry.get_backend``; skipped with a note when flash-attn is
missing).

Every timed call reads its K/V from HBM, not L2: a shape gets ``layers`` independent caches
(>= HBM_BYTES_PER_GRAPH of K/V together, at least 2), one shared block table with shuffled
block ids, and each timing runs one call per layer in turn (L2 is also flushed before each
timing by ``triton.testing.do_bench``); ``ms`` = median time of that sequence / layers. Two
ways: ``ms`` replays the sequence captured in one CUDA graph (the GPU's time, as a serving
engine runs decode), ``eager_ms`` calls the backend from Python (its checks and launches
included). ``tbps`` = K/V bytes read / ``ms``, against the device-to-device copy bandwidth of
the same run (``pct_copy``); ``vs_flash_attn`` = flash-attn's ms / the row's ms.

Before timing, every variant's output for layer 0 is compared with a float32 reference
(``rel_err`` = max |out - ref| / max |ref|). A variant that raises is recorded with its error
and the run goes on (except after a CUDA error that kills the context).

``--sweep`` also times the decode variants (fused combine, DECODE_SWEEP's tiles, a finer and
a coarser chunking policy; variants after ``--budget-s`` seconds are skipped, with a note) and
reports the best per shape; ``--fp8-sweep`` adds fp8-cache variants (the dots in bf16, the
conversion the default's fp16 dots replace; other tiles and pipeline depths); ``--wave-fill``
each cache with near-equal rows cut to fill the launch's waves; ``--query-in-registers`` the
fp8 cache compiled with its query tile kept in registers (``query_in_registers.py``, a Triton
pipeline hook, in a fresh Triton cache); ``--hopper-wgmma`` the fp8 and bf16 caches on the
Gluon kernel of warpgroup MMAs (``attention/triton_kernels/decode_hopper.py``);
``--variants`` keeps only the
added variants whose names contain one of its comma-separated substrings; ``--shapes``
keeps only the named shapes; ``--window`` adds sliding-window decode (16 rows, window 4096,
contexts growing past it) for ours and flash-attn.

Prints the tables last and writes benchmarks/results/decode-<YYYY-MM-DD>.json
({"header": {...}, "decode": [rows], "decode_best": [...], "decode_fp8": [...],
"decode_window": [rows]}). Without a CUDA GPU it says so and exits 2.

Run (from the project root, on the GPU machine):
    python3 benchmarks/bench_decode.py [--quick] [--sweep [--budget-s 270]] [--fp8-sweep] [--wave-fill]
        [--query-in-registers] [--hopper-wgmma] [--variants "3 stages"] [--window] [--shapes 64x4096,32x512]
        [--out PATH]
        [--warmup-ms 25] [--rep-ms 100]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import common
import torch
from common import DEVICE, DTYPE, HEAD_DIM, HEADS, KV_HEADS, REL_ERR_LIMIT, JsonRow, KernelTimer, fmt
from query_in_registers import keep_query_in_registers

FP8 = torch.float8_e4m3fn
UNIFORM = [(1, 1024), (1, 32768), (8, 512), (32, 512), (64, 4096), (128, 2048), (256, 1024), (16, 16384)]
#: (rows, median, sigma, cap): LogNormal lengths, drawn with a fixed seed.
LOGNORMAL = [(64, 2048, 0.8, 16384), (64, 512, 0.8, 16384)]
QUICK_UNIFORM = [(1, 1024), (32, 512), (64, 4096)]
BLOCK_SIZES = (32, 256)
#: K/V bytes one timed sequence reads (over all layers): far above the H200's 60 MB L2.
HBM_BYTES_PER_GRAPH = 400 << 20
SEED = 0

DECODE_DEFINITIONS = {
    **common.DEFINITIONS,
    "tbps": "decode: K/V bytes read (2 x tokens x kv_heads x head_dim x 2) / time",
    "decode_ms": "decode rows: one CUDA graph replaying one call per layer over `layers` distinct "
    "caches (>= 400 MB of K/V, so every call reads HBM), divided by `layers`; eager_ms likewise",
    "decode_rel_err": "decode rows: max |out - ref| / max |ref| against a float32 reference from the cache",
    "chunk_len/items/partials": "decode rows: the triton schedule (tokens per chunk, work items, partial slots)",
}


@dataclass(frozen=True)
class DecodeShape:
    label: str
    lens: tuple[int, ...]

    @property
    def kv_bytes(self) -> int:
        """K/V bytes one call reads: 2 tensors x tokens x kv_heads x head_dim x 2 bytes."""
        return 2 * sum(self.lens) * KV_HEADS * HEAD_DIM * torch.empty((), dtype=DTYPE).element_size()


def decode_shapes(quick: bool, only: str | None = None) -> list[DecodeShape]:
    """The shapes (``quick``: a subset); ``only``: comma-separated labels to keep (``64x4096``,
    ``lognormal64(med=2048,s=0.8,cap=16384)``, or a label's prefix such as ``lognormal64(med=2048``)."""
    shapes = [DecodeShape(f"{b}x{n}", (n,) * b) for b, n in (QUICK_UNIFORM if quick else UNIFORM)]
    for rows, median, sigma, cap in LOGNORMAL[:1] if quick else LOGNORMAL:
        rng = random.Random(SEED)
        lens = tuple(max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(rows))
        shapes.append(DecodeShape(f"lognormal{rows}(med={median},s={sigma},cap={cap})", lens))
    if only:
        wanted = [w.strip() for w in only.split(",") if w.strip()]
        shapes = [s for s in shapes if any(s.label == w or (w.startswith("lognormal") and s.label.startswith(w))
                                           for w in wanted)]  # fmt: skip
        if not shapes:
            raise SystemExit(f"--shapes {only!r}: no shape matches; labels are 64x4096, lognormal64(med=2048, ...")
    return shapes


@dataclass
class DecodeRow(JsonRow):
    shape: str
    backend: str
    variant: str
    block_size: int
    batch: int
    tokens: int
    max_len: int
    layers: int = 0
    ms: float | None = None
    eager_ms: float | None = None
    tbps: float | None = None
    pct_copy: float | None = None
    vs_flash_attn: float | None = None
    rel_err: float | None = None
    chunk_len: int | None = None
    items: int | None = None
    partials: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.ms is not None and self.error is None and (self.rel_err or 0.0) <= REL_ERR_LIMIT


@dataclass(frozen=True)
class Variant:
    """A Triton decode configuration to time: launch parameters and chunking policy."""

    name: str
    config: Any = None  # DecodeConfig | None (None: the per-shape default)
    policy: Any = None  # DecodePolicy | None
    fp8: bool = False  # an fp8 (float8_e4m3) cache instead of bf16
    window: int | None = None
    contiguous_values: bool = False  # an fp8 V stored contiguous instead of token-major
    int8: bool = False  # an int8 cache with per-token scales (attention.token_scales)
    wave_fill: float | None = None  # the default launch for the block size, with this wave fill
    fused_combine: bool = False  # the default launch for the block size, its split rows merged in-kernel

    def backend(self, block_size: int) -> Any:
        from attention.triton_backend import TritonBackend
        from attention.triton_kernels import default_decode_config

        config = self.config
        if self.wave_fill is not None or self.fused_combine:
            kv_dtype = FP8 if self.fp8 else torch.int8 if self.int8 else None
            config = config or default_decode_config(HEAD_DIM, DTYPE, kv_dtype, block_size=block_size)
            if self.wave_fill is not None:
                config = dataclasses.replace(config, wave_fill=self.wave_fill)
            if self.fused_combine:
                config = dataclasses.replace(config, fused_combine=True)
        return TritonBackend(
            common.spec(fp8=self.fp8, window=self.window, int8=self.int8),
            decode_config=config,
            decode_policy=self.policy,
        )


def variants(sweep: bool) -> list[Variant]:
    """The default, and with ``sweep``: the default with the fused combine, DECODE_SWEEP's
    other launch configurations (a shorter and a longer tile), a finer and a coarser
    chunking policy (six in all with the bench's head_dim 128 bf16)."""
    from attention.triton_kernels import DECODE_SWEEP, DecodePolicy, default_decode_config

    default = Variant("default")
    if not sweep:
        return [default]
    base = default_decode_config(HEAD_DIM, DTYPE)
    fused = dataclasses.replace(base, fused_combine=True)
    out = [default, Variant("default + fused_combine", config=fused)]
    for c in DECODE_SWEEP:
        if c not in (base, fused):
            out.append(Variant(common.describe(c), config=c))
    out.append(Variant("policy programs_per_sm=4 balance=1.0", policy=DecodePolicy(programs_per_sm=4, balance=1.0)))
    out.append(Variant("policy programs_per_sm=1 balance=2.5", policy=DecodePolicy(programs_per_sm=1, balance=2.5)))
    return out


#: The fp8-cache variant: decode reads half the bytes (float8_e4m3 K/V, per-KV-head scales;
#: V token-major, as kvcache allocates it: attention.value_layout).
FP8_VARIANT = Variant("fp8 cache", fp8=True)
#: The int8-cache variant: int8 K/V with an fp16 scale per (token, KV head) in each block.
INT8_VARIANT = Variant("int8 cache", int8=True)


def int8_variants() -> list[Variant]:
    """``--fp8-sweep`` also times the int8 cache at other pipeline depths."""
    from attention.triton_kernels import default_decode_config

    base = default_decode_config(HEAD_DIM, DTYPE, torch.int8)
    return [
        Variant("int8 cache, 2 stages", config=dataclasses.replace(base, num_stages=2), int8=True),
        Variant("int8 cache, 4 stages", config=dataclasses.replace(base, num_stages=4), int8=True),
    ]


def wave_fill_variants() -> list[Variant]:
    """``--wave-fill``: each cache's default launch with near-equal rows cut until the
    launch's waves are at least 90% / 95% full (``DecodePolicy.wave_fill``), and the default
    launch with wave fill off (where the default has it on); and the fp8 cache's three-stage
    launch (its block-32 default, three programs an SM) at every block size, with and without
    wave fill (at block 256 the default is four stages, two programs an SM)."""
    from attention.triton_kernels import DecodeConfig

    out = []
    for fill in (0.9, 0.95, 0.0):
        out += [
            Variant(f"wave fill {fill}", wave_fill=fill),
            Variant(f"fp8 cache, wave fill {fill}", fp8=True, wave_fill=fill),
            Variant(f"int8 cache, wave fill {fill}", int8=True, wave_fill=fill),
        ]
    for three_fill in (0.9, None):
        three = DecodeConfig(block_n=128, num_warps=4, num_stages=3, wave_fill=three_fill)
        out.append(Variant(f"fp8 cache, 3 stages, wave fill {three_fill}", config=three, fp8=True))
    return out


def query_register_variants() -> list[Variant]:
    """``--query-in-registers``: the fp8 cache compiled without Triton's ReorderInstructions
    (:mod:`query_in_registers`: the query tile stays in registers instead of being reloaded
    from shared memory every tile), selected by ``maxnreg``: four stages two an SM (the block-256
    default's launch), three stages two an SM (the block-32 default's, at the 223 registers it
    then takes) and three stages capped at 168 registers (three an SM, with spills)."""
    from attention.triton_kernels import DecodeConfig

    return [
        Variant(
            "fp8 cache, query in registers, 4 stages, 2 an SM",
            config=DecodeConfig(block_n=128, num_warps=4, num_stages=4, programs_per_sm=2, maxnreg=255),
            fp8=True,
        ),
        Variant(
            "fp8 cache, query in registers, 3 stages, 2 an SM",
            config=DecodeConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=2, maxnreg=255, wave_fill=0.9),
            fp8=True,
        ),
        Variant(
            "fp8 cache, query in registers, 3 stages, 168 registers",
            config=DecodeConfig(block_n=128, num_warps=4, num_stages=3, maxnreg=168, wave_fill=0.9),
            fp8=True,
        ),
    ]


def hopper_wgmma_variants() -> list[Variant]:
    """``--hopper-wgmma``: the chunks on the Gluon kernel of
    ``attention/triton_kernels/decode_hopper.py`` (the tokens as the warpgroup MMA's M; an fp8
    cache's K and V reach fp8 MMAs as stored), for the fp8 and the bf16 cache: a ring of 2 tiles
    (70 KiB of shared memory, three programs an SM) and of 3 (103 KiB, two an SM), and for fp8
    the 2-tile ring with wave fill too (the block-32 fp8 default's)."""
    from attention.triton_kernels import DecodeConfig

    def config(block_n: int, stages: int, fill: float | None = None) -> Any:
        per_sm = {2: 3, 3: 2}[stages]
        return DecodeConfig(
            block_n=block_n, num_warps=4, num_stages=stages, programs_per_sm=per_sm, hopper_wgmma=True, wave_fill=fill
        )

    return [
        Variant("fp8 cache, hopper wgmma, 2 stages, 3 an SM", config=config(128, 2), fp8=True),
        Variant("fp8 cache, hopper wgmma, 2 stages, 3 an SM, wave fill 0.9", config=config(128, 2, 0.9), fp8=True),
        Variant("fp8 cache, hopper wgmma, 3 stages, 2 an SM", config=config(128, 3), fp8=True),
        Variant("bf16 cache, hopper wgmma, 2 stages, 3 an SM", config=config(64, 2)),
        Variant("bf16 cache, hopper wgmma, 3 stages, 2 an SM", config=config(64, 3)),
    ]


def fp8_variants() -> list[Variant]:
    """``--fp8-sweep``: the fp8 cache with V contiguous (the layout before token-major V) at
    3 and 2 stages, with its dots in the query's dtype (bf16, the conversion the fp16 dots
    replace), each cache's default launch with its split rows merged by the last of their
    programs (``fused_combine``: no second launch), and launches around the fp8 default (tile
    64 / 128 tokens, 4 / 8 warps, 2-4 stages)."""
    from attention.triton_kernels import DecodeConfig, default_decode_config

    base = default_decode_config(HEAD_DIM, DTYPE, FP8)
    out = [
        Variant("fp8 cache, V contiguous", fp8=True, contiguous_values=True),
        Variant(
            "fp8 cache, V contiguous, 2 stages",
            config=dataclasses.replace(base, num_stages=2),
            fp8=True,
            contiguous_values=True,
        ),
        Variant("fp8 cache, bf16 dots", config=dataclasses.replace(base, f16_fp8_dots=False), fp8=True),
        Variant("fp8 cache, fused combine", fused_combine=True, fp8=True),
        Variant("int8 cache, fused combine", fused_combine=True, int8=True),
        Variant("bf16 cache, fused combine", fused_combine=True),
    ]
    for block_n, warps, stages in ((128, 4, 2), (128, 4, 4), (128, 8, 3), (64, 4, 3), (64, 4, 4)):
        config = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages)
        if config != base:
            out.append(Variant(f"fp8 cache, n{block_n} w{warps} s{stages}", config=config, fp8=True))
    return out


# ---- problem -------------------------------------------------------------------------------


@dataclass
class Layers:
    """``layers`` caches of one shape: q [batch, HEADS, HEAD_DIM]; k, v [layers, num_blocks,
    block_size, KV_HEADS, HEAD_DIM]; one metadata (block ids shuffled) for all layers."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: Any
    _fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _v8_token_major: list[torch.Tensor] | None = None
    _int8: list[Any] | None = None

    @property
    def count(self) -> int:
        return int(self.k.shape[0])

    def int8_caches(self) -> list[Any]:
        """One int8 LayerCache per layer (:mod:`attention.token_scales`), holding K/V quantized
        row by row as the cache write would; made once, lazily."""
        from attention.token_scales import quantized_layer

        if self._int8 is None:
            self._int8 = [quantized_layer(self.k[i], self.v[i], index=i) for i in range(self.count)]
        return self._int8

    def layer_caches(self, fp8: bool = False, contiguous_values: bool = False, int8: bool = False) -> list[Any]:
        """One LayerCache per layer (an fp8 copy of K/V with unit scales when ``fp8``, V
        token-major unless ``contiguous_values``; made once, lazily, so bf16 runs never pay
        for it)."""
        from attention import LayerCache
        from attention.value_layout import token_major_view

        if int8:
            return self.int8_caches()
        if not fp8:
            return [LayerCache(self.k[i], self.v[i], index=i) for i in range(self.count)]
        if self._fp8 is None:
            ones = torch.ones(KV_HEADS, dtype=torch.float32, device=DEVICE)
            self._fp8 = (self.k.to(FP8), self.v.to(FP8), ones)
        k8, v8, scale = self._fp8
        if contiguous_values:
            values = [v8[i] for i in range(self.count)]
        else:
            if self._v8_token_major is None:
                memory = torch.empty_like(v8)
                self._v8_token_major = [token_major_view(memory[i]).copy_(v8[i]) for i in range(self.count)]
            values = self._v8_token_major
        return [LayerCache(k8[i], values[i], index=i, k_scale=scale, v_scale=scale) for i in range(self.count)]


def build_layers(shape: DecodeShape, block_size: int) -> Layers:
    from attention import AttentionMetadata

    gen = torch.Generator(device=DEVICE).manual_seed(SEED)
    tables, num_blocks = common.shuffled_block_tables(shape.lens, block_size, SEED)
    count = max(2, math.ceil(HBM_BYTES_PER_GRAPH / shape.kv_bytes))
    cache_shape = (count, num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k = torch.empty(cache_shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    v = torch.empty(cache_shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    q = torch.randn((len(shape.lens), HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    last = [n - 1 for n in shape.lens]
    slots = [int(tables[r, p // block_size]) * block_size + p % block_size for r, p in enumerate(last)]
    b = len(shape.lens)
    meta = AttentionMetadata(
        block_tables=tables.to(DEVICE),
        seq_lens=torch.tensor(shape.lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(last, dtype=torch.int64, device=DEVICE),
        logits_indices=torch.arange(b, dtype=torch.int64, device=DEVICE),
        block_size=block_size,
        seq_lens_host=shape.lens,
        query_lens_host=(1,) * b,
        sampling_rows_host=tuple(range(b)),
    )
    return Layers(q, k, v, meta)


def reference(layers: Layers, fp8: bool = False, window: int | None = None, int8: bool = False) -> torch.Tensor:
    """float32 [batch, HEADS, HEAD_DIM]: layer 0's attention, row by row from the cache (the
    fp8-rounded cache when ``fp8``, the int8 cache's dequantized values when ``int8``; the
    last ``window`` tokens when given)."""
    from attention.token_scales import dequantize_rows, quantize_rows

    q, k0, v0, meta = layers.q, layers.k[0], layers.v[0], layers.meta
    if fp8:
        k0, v0 = k0.to(FP8).to(DTYPE), v0.to(FP8).to(DTYPE)
    if int8:
        k0, v0 = (dequantize_rows(*quantize_rows(x), torch.float32) for x in (k0, v0))
    bs, group = meta.block_size, HEADS // KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    for r, n in enumerate(meta.seq_lens_host):
        blocks = meta.block_tables[r, : -(-n // bs)].long()
        lo = 0 if window is None else max(0, n - window)
        k = k0[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[lo:n].float()
        v = v0[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[lo:n].float()
        s = torch.einsum("kgd,lkd->kgl", q[r].float().view(KV_HEADS, group, HEAD_DIM), k) / math.sqrt(HEAD_DIM)
        out[r] = torch.einsum("kgl,lkd->kgd", torch.softmax(s, dim=-1), v).reshape(HEADS, HEAD_DIM)
    return out


# ---- measuring -----------------------------------------------------------------------------


def _measure(
    timer: KernelTimer,
    row: DecodeRow,
    layers: Layers,
    backend: Any,
    ref: torch.Tensor,
    copy_tbps: float,
    fp8: bool = False,
    contiguous_values: bool = False,
    int8: bool = False,
) -> None:
    """Check layer 0 against ``ref``, then time one call per layer (graph and eager).
    Errors are recorded on the row; a CUDA error that kills the context is re-raised."""
    try:
        plan = backend.plan(layers.meta)  # once per step, outside the timing
        out = torch.empty_like(layers.q)
        caches = layers.layer_caches(fp8, contiguous_values, int8)

        def call(i: int) -> torch.Tensor:
            return backend.attend(layers.q, caches[i], plan, out=out)

        result = call(0)
        torch.cuda.synchronize()
        row.rel_err = common.rel_err(result, ref)
        if not math.isfinite(row.rel_err):
            row.rel_err = float("inf")
        _describe_schedule(row, plan)

        def every_layer() -> None:
            for i in range(layers.count):
                call(i)

        row.layers = layers.count
        row.eager_ms = timer.ms(every_layer) / layers.count
        row.ms = timer.graph_ms(every_layer) / layers.count
        row.tbps = row.extra["kv_bytes"] / (row.ms * 1e-3) / 1e12
        row.pct_copy = 100 * row.tbps / copy_tbps
    except Exception as err:
        common.record_error(row, err, f"{row.shape} {row.backend} bs={row.block_size} {row.variant}")


def _describe_schedule(row: DecodeRow, plan: Any) -> None:
    """Chunk length, items and partial slots of a triton plan's decode schedule."""
    from attention.triton_backend import TritonStepPlan

    if isinstance(plan, TritonStepPlan) and plan.decode:
        schedule = plan.decode[0].schedule
        row.chunk_len, row.items, row.partials = schedule.chunk_len, schedule.num_items, schedule.num_partials


def run_decode(
    shapes: list[DecodeShape],
    *,
    sweep: bool,
    timer: KernelTimer,
    copy_tbps: float,
    notes: list[str],
    budget_s: float,
    fp8_sweep: bool = False,
    wave_fill: bool = False,
    query_in_registers: bool = False,
    hopper_wgmma: bool = False,
    variant_filter: tuple[str, ...] = (),
) -> list[DecodeRow]:
    """Time the default (and with ``sweep`` every variant) at block 32 and 256, and
    flash-attn at 256, on every shape. Sweep variants stop once ``budget_s`` has passed
    (noted); the default and flash-attn rows always run."""
    flash = common.flash_attn_backend(notes, "decode rows")
    chosen = [*variants(sweep), FP8_VARIANT, INT8_VARIANT, *(fp8_variants() + int8_variants() if fp8_sweep else [])]
    chosen += wave_fill_variants() if wave_fill else []
    chosen += query_register_variants() if query_in_registers else []
    chosen += hopper_wgmma_variants() if hopper_wgmma else []
    if variant_filter:  # the default and the fp8 / int8 caches always run (the ratios need them)
        keep = (FP8_VARIANT.name, INT8_VARIANT.name, "default")
        chosen = [v for v in chosen if v.name in keep or any(f in v.name for f in variant_filter)]
    deadline = time.monotonic() + budget_s
    skipped = 0
    rows: list[DecodeRow] = []
    for shape in shapes:
        shape_rows: list[DecodeRow] = []
        for block_size in BLOCK_SIZES:
            print(f"decode {shape.label} block {block_size}", flush=True)
            try:
                layers = build_layers(shape, block_size)
                ref = reference(layers)
                ref8 = reference(layers, fp8=True)
                ref_int8 = reference(layers, int8=True)
            except Exception as err:
                notes.append(f"{shape.label} bs={block_size}: setup failed: {type(err).__name__}: {err}"[:300])
                traceback.print_exc()
                continue
            todo: list[tuple[str, Variant | None]] = [("triton", v) for v in chosen]
            if block_size == 256 and flash is not None:
                todo.insert(0, ("flash_attn", None))
            for backend_name, variant in todo:
                if (
                    variant is not None
                    and variant.name not in ("default", FP8_VARIANT.name, INT8_VARIANT.name, "fp8 cache, bf16 dots")
                    and time.monotonic() > deadline
                ):
                    skipped += 1
                    continue
                row = DecodeRow(
                    shape.label,
                    backend_name,
                    "flash_attn" if variant is None else variant.name,
                    block_size,
                    len(shape.lens),
                    sum(shape.lens),
                    max(shape.lens),
                    extra={"kv_bytes": shape.kv_bytes},
                )
                backend = flash if variant is None else variant.backend(block_size)
                fp8 = variant is not None and variant.fp8
                int8 = variant is not None and variant.int8
                if fp8:
                    row.extra["kv_bytes"] = shape.kv_bytes // 2
                if int8:  # the values and each token's two fp16 scales per KV head (K and V)
                    row.extra["kv_bytes"] = shape.kv_bytes // 2 + sum(shape.lens) * KV_HEADS * 2 * 2
                contiguous = variant is not None and variant.contiguous_values
                expected = ref8 if fp8 else ref_int8 if int8 else ref
                _measure(timer, row, layers, backend, expected, copy_tbps, fp8, contiguous, int8)
                _print_row(row)
                shape_rows.append(row)
            del layers, ref, ref8, ref_int8
            torch.cuda.empty_cache()
        common.set_vs_flash_attn(shape_rows)
        rows += shape_rows
    if skipped:
        notes.append(f"decode sweep: {skipped} variant runs skipped after the {budget_s:.0f} s budget")
    return rows


#: Sliding-window decode: 16 rows, window 4096, contexts growing past it (block 256).
WINDOW, WINDOW_ROWS, WINDOW_LENGTHS = 4096, 16, (2048, 4096, 8192, 16384, 32768)


def run_window(
    timer: KernelTimer, copy_tbps: float, notes: list[str], lengths: tuple[int, ...] = WINDOW_LENGTHS
) -> list[DecodeRow]:
    """Decode time as the context grows past a sliding window: ours (windowed spec) and
    flash-attn (window_size), block 256. Flat times past the window are the point."""
    rows: list[DecodeRow] = []
    flash = common.flash_attn_backend(notes, "decode rows", window=WINDOW)
    ours = Variant("window", window=WINDOW)
    for n in lengths:
        shape = DecodeShape(f"{WINDOW_ROWS}x{n} window {WINDOW}", (n,) * WINDOW_ROWS)
        print(f"decode {shape.label} block 256", flush=True)
        try:
            layers = build_layers(shape, 256)
            ref = reference(layers, window=WINDOW)
        except Exception as err:
            notes.append(f"{shape.label}: setup failed: {type(err).__name__}: {err}"[:300])
            continue
        read = DecodeShape(shape.label, (min(n, WINDOW),) * WINDOW_ROWS).kv_bytes
        shape_rows: list[DecodeRow] = []
        for name, backend in (("flash_attn", flash), ("triton", ours.backend(256))):
            if backend is None:
                continue
            row = DecodeRow(shape.label, name, "window", 256, WINDOW_ROWS, n * WINDOW_ROWS, n, extra={"kv_bytes": read})
            _measure(timer, row, layers, backend, ref, copy_tbps)
            _print_row(row)
            shape_rows.append(row)
        common.set_vs_flash_attn(shape_rows)
        rows += shape_rows
        del layers, ref
        torch.cuda.empty_cache()
    return rows


# ---- reporting -----------------------------------------------------------------------------


def _print_row(r: DecodeRow) -> None:
    print(
        f"  {r.backend:10s} bs={r.block_size:<4d} ms={fmt(r.ms, '.4f')} eager={fmt(r.eager_ms, '.4f')} "
        f"TB/s={fmt(r.tbps, '.2f')} rel_err={fmt(r.rel_err, '.1e')} chunk={r.chunk_len} items={r.items} "
        f"layers={r.layers}  {r.variant}{'  ERROR ' + r.error if r.error else ''}",
        flush=True,
    )


def print_decode_table(rows: list[DecodeRow]) -> None:
    head = (
        f"{'shape':34s} {'backend':10s} {'bs':>4s} {'ms':>8s} {'eager':>8s} {'TB/s':>5s} {'%copy':>5s} "
        f"{'vs_fa':>5s} {'rel_err':>7s} {'chunk':>6s} {'items':>5s}  variant"
    )
    common.print_table(
        head,
        rows,
        lambda r: (
            f"{r.shape:34s} {r.backend:10s} {r.block_size:4d} {fmt(r.ms, '8.4f')} {fmt(r.eager_ms, '8.4f')} "
            f"{fmt(r.tbps, '5.2f')} {fmt(r.pct_copy, '5.1f')} {fmt(r.vs_flash_attn, '5.2f')} "
            f"{fmt(r.rel_err, '7.1e')} {fmt(r.chunk_len, '6d')} {fmt(r.items, '5d')}  {r.variant}"
        ),
    )


def best_per_shape(rows: list[DecodeRow]) -> list[dict[str, Any]]:
    """Per (shape, block size): the default's and the fastest correct variant's figures."""
    out = []
    keys = dict.fromkeys((r.shape, r.block_size) for r in rows if r.backend == "triton")
    for shape, bs in keys:
        mine = [
            r
            for r in rows
            if r.backend == "triton"
            and (r.shape, r.block_size) == (shape, bs)
            and r.ok
            and r.variant not in (FP8_VARIANT.name, INT8_VARIANT.name)
        ]
        default = next((r for r in mine if r.variant == "default"), None)
        best = min(mine, key=lambda r: r.ms or math.inf, default=None)
        out.append(
            {
                "shape": shape,
                "block_size": bs,
                "default_ms": default.ms if default else None,
                "default_vs_fa": default.vs_flash_attn if default else None,
                "best_ms": best.ms if best else None,
                "best_vs_fa": best.vs_flash_attn if best else None,
                "best_pct_copy": best.pct_copy if best else None,
                "best_variant": best.variant if best else None,
            }
        )
    return out


def print_best(best: list[dict[str, Any]], copy_tbps: float) -> None:
    head = (
        f"{'shape':34s} {'bs':>4s} {'default ms':>10s} {'vs_fa':>5s} {'best ms':>9s} {'vs_fa':>5s} {'%copy':>5s}"
        "  best variant"
    )
    print("\ndecode, best per shape" + "\n" + head + "\n" + "-" * len(head))
    for b in best:
        print(
            f"{b['shape']:34s} {b['block_size']:4d} {fmt(b['default_ms'], '10.4f')} "
            f"{fmt(b['default_vs_fa'], '5.2f')} "
            f"{fmt(b['best_ms'], '9.4f')} {fmt(b['best_vs_fa'], '5.2f')} {fmt(b['best_pct_copy'], '5.1f')}  "
            f"{b['best_variant'] or '-'}"
        )
    print(
        f"(ms: CUDA-graph replay per call, K/V from HBM; vs_fa = flash-attn 2 ms at block 256 / this ms, "
        f"> 1 is faster; %copy: K/V read bandwidth / device copy bandwidth {copy_tbps:.2f} TB/s)"
    )


def fp8_speedups(rows: list[DecodeRow], variant: str = FP8_VARIANT.name) -> list[dict[str, Any]]:
    """Per (shape, block size): our default bf16 time over our ``variant`` time (the fp8 or the
    int8 cache; > 1: the 8-bit cache is faster)."""
    out = []
    for r in rows:
        if r.variant != variant or not r.ok:
            continue
        base = next(
            (b for b in rows if b.variant == "default" and (b.shape, b.block_size) == (r.shape, r.block_size) and b.ok),
            None,
        )
        if base is not None and base.ms and r.ms:
            out.append(
                {
                    "shape": r.shape,
                    "block_size": r.block_size,
                    "bf16_ms": base.ms,
                    "fp8_ms": r.ms,
                    "speedup": base.ms / r.ms,
                    "rel_err": r.rel_err,
                }
            )
    return out


def print_fp8(speedups: list[dict[str, Any]], kind: str = "fp8") -> None:
    print(f"\ndecode, {kind} cache vs bf16 cache (ours, same block size)")
    for s in speedups:
        print(
            f"  {s['shape']:34s} bs={s['block_size']:<4d} bf16 {s['bf16_ms']:.4f} ms  {kind} {s['fp8_ms']:.4f} ms  "
            f"x{s['speedup']:.2f}  rel_err {s['rel_err']:.1e}"
        )


# ---- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short subset of the shapes")
    parser.add_argument(
        "--sweep", action="store_true", help="also time the decode variants (combine, tiles, chunking policies)"
    )
    parser.add_argument(
        "--fp8-sweep", action="store_true", help="also time fp8-cache variants (bf16 dots, other tiles)"
    )
    parser.add_argument(
        "--wave-fill", action="store_true", help="also time each cache with near-equal rows cut to fill the waves"
    )
    parser.add_argument(
        "--query-in-registers",
        action="store_true",
        help="also time the fp8 cache compiled with its query kept in registers (query_in_registers.py)",
    )
    parser.add_argument(
        "--hopper-wgmma",
        action="store_true",
        help="also time the fp8 and bf16 caches on the Gluon kernel of warpgroup MMAs (decode_hopper.py)",
    )
    parser.add_argument("--shapes", default=None, help="comma-separated shape labels to keep (e.g. 64x4096,32x512)")
    parser.add_argument(
        "--variants", default="", help="comma-separated substrings: keep only the sweep variants naming one"
    )
    parser.add_argument("--budget-s", type=float, default=270.0, help="seconds after which sweep variants are skipped")
    parser.add_argument("--window", action="store_true", help="also time sliding-window decode past the window")
    parser.add_argument("--window-only", action="store_true", help="time sliding-window decode only")
    parser.add_argument(
        "--window-lengths",
        default=",".join(map(str, WINDOW_LENGTHS)),
        help="contexts of the sliding-window rows (comma-separated tokens)",
    )
    common.add_run_options(parser, "decode")
    args = parser.parse_args(argv)
    if not common.require_cuda("bench_decode"):
        return 2
    run = common.Run("decode", args.out, KernelTimer(args.warmup_ms, args.rep_ms), DECODE_DEFINITIONS)
    decode: list[DecodeRow] = []
    window: list[DecodeRow] = []

    def body() -> None:
        nonlocal decode, window
        # Every timing replays >= 400 MB, so shorter timing windows keep the sweep short.
        timer = KernelTimer(min(args.warmup_ms, 10), min(args.rep_ms, 50))
        if not args.window_only:
            decode = run_decode(
                decode_shapes(args.quick, args.shapes),
                sweep=args.sweep,
                fp8_sweep=args.fp8_sweep,
                wave_fill=args.wave_fill,
                query_in_registers=args.query_in_registers,
                hopper_wgmma=args.hopper_wgmma,
                variant_filter=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
                timer=timer,
                copy_tbps=run.copy_tbps,
                notes=run.notes,
                budget_s=args.budget_s,
            )
            run.notes.append(f"decode part took {time.monotonic() - run.started:.0f} s")
        if args.window or args.window_only:
            lengths = tuple(int(n) for n in args.window_lengths.split(","))
            window = run_window(timer, run.copy_tbps, run.notes, lengths)

    def document() -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if decode:
            doc["decode"] = [r.as_json() for r in decode]
            doc["decode_best"] = best_per_shape(decode)
            doc["decode_fp8"] = fp8_speedups(decode)
            doc["decode_int8"] = fp8_speedups(decode, INT8_VARIANT.name)
        if window:
            doc["decode_window"] = [r.as_json() for r in window]
        return doc

    if args.query_in_registers:
        # Triton 3.6 does not key its cache on the stages hook: compile this run afresh.
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-query-registers-")
        run.notes.append(f"--query-in-registers: Triton cache {os.environ['TRITON_CACHE_DIR']}")
        with keep_query_in_registers():
            run.measure(body, document)
    else:
        run.measure(body, document)
    if window:
        print_decode_table(window)
    if decode:
        print_decode_table(decode)
        print_fp8(fp8_speedups(decode))
        print_fp8(fp8_speedups(decode, INT8_VARIANT.name), "int8")
        print_best(best_per_shape(decode), run.copy_tbps)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
