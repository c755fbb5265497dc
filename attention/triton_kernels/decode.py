"""Paged decode attention, balanced by tokens: launch parameters, workspace, launcher.

A decode step attends rows that bring one new token, or a few (up to 8: a row verifying
draft tokens), causal among themselves or under a per-token ancestor mask (a draft tree). :func:`~.decode_schedule.
schedule_decode` cuts every row into chunks of one length (long rows get more chunks), and
the kernel (:mod:`.decode_kernels`) runs one program per (chunk, KV head), all query heads of
the KV group at once. Rows of one chunk write their output directly; rows of several write
fp32 partials that a small combine kernel (or, with ``DecodeConfig.fused_combine``, the
last chunk program of the row) merges. With no split row there is a single launch.

CUDA graphs, per bucket of B rows: persistent buffers rows int32 [B, 5] and items int32
[max_decode_items(B, ...), 10], a workspace of max_decode_partials(B, ...) slots and B counter
rows, all allocated once; every step's schedule made with ``max_items=max_decode_items(B,
...)``, ``max_rows=B`` and the config's block_n, and copied into the buffers with
:func:`decode_metadata` (``rows_out`` / ``items_out``). A launch captured with any such
schedule replays right for every later one: grids and compile-time constants depend only on
(B, heads, SMs, policy, config), and the step's work is read from the buffers. Nothing here
allocates or reads device data on the host.

Decode is memory-bound: the work is reading each row's K/V once. Tiles of BLOCK_N tokens lie
in one block when ``block_size % block_n == 0`` (one table read per tile), the next tile's
block ids are prefetched (loop-carried, so Triton multi-buffers the K/V copies), cache
strides are compile-time constants (16-byte loads) and addresses are int64.
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass

import torch

from attention.checks import same_device
from attention.token_scales import layout_problem
from attention.triton_kernels.decode_hopper import decode_hopper_applies, hopper_block_n, launch_decode_hopper
from attention.triton_kernels.decode_kernels import decode_combine_kernel, decode_items_kernel
from attention.triton_kernels.decode_schedule import ITEM_FIELDS, ROW_FIELDS, DecodeSchedule
from attention.triton_kernels.paging import (
    cache_block_stride,
    dot_precision_for,
    f16_dots_for,
    next_power_of_2,
    upcast_for,
)
from attention.value_layout import is_token_major, value_is_readable

__all__ = [
    "DECODE_SWEEP",
    "FP8_KV_DTYPES",
    "TOKEN_SCALED_KV_DTYPES",
    "DecodeConfig",
    "DecodeWorkspace",
    "allocate_decode_workspace",
    "check_decode_launch",
    "decode_metadata",
    "default_decode_config",
    "hopper_decode_config",
    "one_token_slot_share",
    "paged_decode",
]

_LOG2E = 1.4426950408889634
#: Partials merged per step of the combine loop (a [32, head_dim] fp32 tile).
_MERGE_CHUNKS = 32
_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: KV-cache dtypes read with per-KV-head dequantisation scales.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: KV-cache dtypes read with a scale per (token, KV head) stored in each block
#: (:mod:`attention.token_scales`).
TOKEN_SCALED_KV_DTYPES = (torch.int8,)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels (benchmarks sweep them).

    block_n:    tokens per tile (power of two, >= 16); schedules must be made for it.
    num_warps:  warps per chunk program; num_stages: K/V tiles in flight per program.
    fused_combine: merge split rows inside the chunk kernel (atomic arrival counter, no
                second launch) instead of a separate combine kernel.
    combine_num_warps: warps of the combine kernel.
    f16_fp8_dots: with an fp8 cache and 16-bit queries, run the dots in fp16
                (``paging.f16_dots_for``); False: in the query's dtype (the slower conversion
                to bf16, kept for comparison).
    programs_per_sm: the programs of this launch an SM holds at once, when that is fewer
                than the chunking policy assumes (its registers and shared memory decide):
                a backend without a given policy then schedules for this many
                (``DecodePolicy.programs_per_sm``). None: the policy's.
    wave_fill:  likewise ``DecodePolicy.wave_fill`` for a backend without a given policy
                (None: the policy's).
    slot_share: likewise ``DecodePolicy.slot_share`` (None: the policy's).
    maxnreg:    registers per thread the chunk kernel may use (Triton's ``maxnreg``, in
                [32, 255]); ptxas spills past it. None: the compiler's choice. A cap can keep
                one more program an SM (``programs_per_sm``) at the price of spills.
    hopper_wgmma: run the chunks with the Gluon kernel of :mod:`.decode_hopper` (the tokens as
                the warpgroup MMA's M; an fp8 cache's K and V reach its fp8 MMAs as stored)
                where it applies (sm_90, its shapes; else the Triton kernel runs). block_n must
                be its tile, ``hopper_block_n`` of the cache's dtype: 128 for float8_e4m3fn, 64
                for a 16-bit cache. num_stages is its ring of K/V tiles (32 KiB each at
                head_dim 128: 2 stages fit 3 programs an SM, 3 fit 2, 4 fit 1). Off in a
                config made here; :func:`hopper_decode_config` is the backend's launch of it.
    hopper_overlap: with hopper_wgmma, the kernel's loop runs a tile's score MMAs and softmax
                while the previous tile's P V MMAs run (P in two buffers: 2 KiB more shared
                memory for fp8 at up to 8 heads a group, 4 KiB at 16), instead of each tile's steps in turn. A ring
                slot's K is then refilled once its S MMAs are done and its V once its P V
                MMAs are (a barrier each), so the ring prefetches as far ahead as in turn.
                Off by default: correct on an H100 and within 1% of the loop in turn on
                every shape (benchmarks/results/decode-overlap-h100-2026-12-06.md; GPU tests
                in tests/test_decode_hopper.py, variants in ``bench_decode.py --hopper-wgmma``).
    hopper_ws_loader: with hopper_wgmma (its loop in turn, not hopper_overlap), the chunks'
                TMA loads in a warp of their own (:mod:`.decode_hopper_ws`): the MMA warps
                wait for tiles and release slots on barriers, without the refill's block-table
                reads, loads and synchronisations in their loop.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    fused_combine: bool = False
    combine_num_warps: int = 4
    f16_fp8_dots: bool = True
    programs_per_sm: int | None = None
    wave_fill: float | None = None
    maxnreg: int | None = None
    hopper_wgmma: bool = False
    slot_share: float | None = None
    hopper_overlap: bool = False
    hopper_ws_loader: bool = False

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeConfig.block_n: {self.block_n} must be a power of two >= 16")
        for name in ("num_warps", "combine_num_warps"):
            warps = getattr(self, name)
            if type(warps) is not int or warps not in (1, 2, 4, 8, 16):
                raise ValueError(f"DecodeConfig.{name}: {warps!r} must be 1, 2, 4, 8 or 16 (a power of two)")
        if self.programs_per_sm is not None and self.programs_per_sm < 1:
            raise ValueError(f"DecodeConfig.programs_per_sm: {self.programs_per_sm} must be >= 1 (or None)")
        if self.wave_fill is not None and not 0.0 <= self.wave_fill <= 1.0:
            raise ValueError(f"DecodeConfig.wave_fill: {self.wave_fill} must be in [0, 1] (or None)")
        if self.slot_share is not None and not 0.0 <= self.slot_share <= 4.0:
            raise ValueError(f"DecodeConfig.slot_share: {self.slot_share} must be in [0, 4] (or None)")
        if self.maxnreg is not None and (type(self.maxnreg) is not int or not 32 <= self.maxnreg <= 255):
            raise ValueError(f"DecodeConfig.maxnreg: {self.maxnreg!r} must be an int in [32, 255] (or None)")
        if self.hopper_wgmma and self.block_n not in (64, 128):
            raise ValueError(
                f"DecodeConfig.block_n: {self.block_n} with hopper_wgmma; the Hopper kernel's tiles are 128 tokens "
                f"for an fp8 cache and 64 for a 16-bit one (hopper_block_n)"
            )
        if self.hopper_wgmma and not 2 <= self.num_stages <= 4:
            raise ValueError(f"DecodeConfig.num_stages: {self.num_stages} with hopper_wgmma must be 2, 3 or 4")
        if self.hopper_ws_loader and (self.hopper_overlap or not self.hopper_wgmma):
            raise ValueError(
                "DecodeConfig.hopper_ws_loader: True needs hopper_wgmma=True and hopper_overlap=False (the loader warp "
                "serves the Hopper kernel's loop in turn)"
            )


@functools.cache  # called on every layer call: keep it off the host's launch path
def default_decode_config(
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    query_len: int = 1,
    block_size: int | None = None,
) -> DecodeConfig:
    """A Hopper default: ~16 KiB per K (and V) tile with 16-byte loads and two pipeline
    stages. Measured on the H200 for the previous decode kernel, whose loop this one keeps
    (benchmarks/results/attention-sweep-2026-12-02.json, bf16, head_dim 128): 2 stages read
    K/V at 4.29 TB/s where 3 stages reach 3.6 TB/s at 64 x 4096 tokens. Compiled ahead of
    time for sm_90 (triton 3.9), bf16 head_dim 128 takes 38 KiB of shared memory and 72
    registers, no spills. An fp8 cache (``kv_dtype``) halves the bytes per token, so its tiles
    hold twice the tokens. fp32 at head_dim 256 takes 8 warps to keep its tiles in registers.

    Launches for rows of several new tokens (``query_len`` > 1, verifying drafts) take ~32 KiB
    tiles: their taller tile of tokens x heads does twice the math per K/V byte, and longer
    tiles keep more bytes in flight per program (benchmarks/results/verify-sweep-bs32-2026-12-03.json
    and -bs256-: 5 new tokens at 128 x 2048, 128 tokens a tile 1.21x / 1.10x the one-token step at
    blocks 32 / 256 against 1.47x / 1.26x with 64; no other tile, warp or stage count did better).

    An fp8 cache (its dots in fp16, its V token-major as kvcache allocates it,
    :mod:`attention.value_layout`) takes three stages at every block size: with twice the
    tokens per byte, a program has more latency to hide per tile. Measured on the H200
    (benchmarks/results/decode-fp8-vmajor-2026-12-03.json, 3 against 2 stages): at block
    256, 64x4096 in 154 us against 181, 16x16384 in 171 against 235, LogNormal(2048) in 113
    against 133; at block 32, 173 against 194, 192 against 248, 127 against 141. (With a
    contiguous fp8 V, 2 stages were as good or better at block 256.)

    An fp8 cache whose tiles lie inside one block (``block_size`` a multiple of the tile, e.g.
    256) takes four stages, and its programs_per_sm is 2: 96 KiB of tiles in flight, two
    programs an SM. Three stages (72 KiB, 156 registers) fit three an SM, and 64 rows x 4096
    tokens then make 512 programs for 396 places: 1.29 waves, the last one mostly idle. On
    the H200 (benchmarks/results/decode-fp8-clamp-2026-12-04.json, run 4), against the bf16
    cache at block 256: 1.73x / 1.77x / 1.71x / 1.76x / 1.77x (64x4096, 128x2048, 256x1024,
    16x16384, LogNormal 2048) where three stages give 1.43x / 1.83x / 1.84x / 1.77x / 1.81x;
    at block 32, four stages lost on every shape but 64x4096 (1.37-1.55x against 1.45-1.69x).
    With the one-instruction V guard (``paging.finite_e4m3_operand``), three stages at block 256
    beat four by 3-6% on every shape but 64x4096 (1.42x against 1.78x) and 16x16384 (equal)
    (benchmarks/results/decode-fp8-min-2026-12-04.md); four stay, since a CUDA-graph bucket
    fixes its launch before the step's lengths are known and the wave loss is the larger.

    Where an fp8 cache's tiles span blocks (block 32), near-equal rows that make between one
    and two waves of programs are cut until the waves are 90% full (``wave_fill``, see
    :class:`~.decode_schedule.DecodePolicy`): 64 rows x 4096 tokens, 512 programs for 396
    places, in 0.164 ms against 0.190 (benchmarks/results/decode-wave-fill-2026-12-05.json).
    Four stages scheduled for 2 programs an SM did better on that one shape (1.60x the bf16
    cache against 1.53x) but lost 4-14% on every other block-32 shape.

    One-token launches schedule chunks of at least a slot's share of the step
    (``DecodePolicy.slot_share``): 1.0 for a one-byte cache, 0.75 for a 16-bit one. Rows that
    short do not split: with many more programs than places, splitting them only adds
    programs and partials. On an H100 (benchmarks/results/decode-slot-share-h100-2026-12-05.md and
    its JSONs),
    128 rows of LogNormal(550) tokens (the end-to-end burst's decode step): the fp8 cache at
    block 256 in 74.5 us against 83.9 with no share (the bf16 cache's speed 1.77x against
    1.57x), at block 32 79.0 against 82.6; the bf16 cache 1-2% faster at 0.75 and 4% slower at
    1.0 (block 256); every other shape timed (32x512, 64x4096, 128x2048, 16x16384, 128x640,
    LogNormal(2048)) within 1%. End to end (the burst, 128 rows) fp8 decode attention took 2.55
    ms an iteration against 2.69.

    An int8 cache (per-token scales, V token-major) has fp8's bytes per token and takes the
    same tiles and three stages. On the H200 (benchmarks/results/decode-int8-2026-12-04.json),
    over the bench's shapes, 2 stages ran 1.05x / 1.01x and 4 stages 0.94x / 0.97x the speed
    of 3 at block 32 / 256 (geometric means), 2 winning 16x16384 and losing 64x4096 at block
    32: not enough to differ from fp8.
    """
    d_pad = next_power_of_2(max(head_dim, 16))
    itemsize = torch.empty((), dtype=kv_dtype or dtype).element_size()
    tile_bytes = 16384 if query_len <= 1 else 32768
    block_n = max(16, min(128, tile_bytes // (d_pad * itemsize)))
    q_itemsize = torch.empty((), dtype=dtype).element_size()
    warps = 8 if q_itemsize * d_pad > 512 else 4
    one_byte = kv_dtype in FP8_KV_DTYPES or kv_dtype in TOKEN_SCALED_KV_DTYPES
    stages = 3 if one_byte and query_len <= 1 else 2
    share = one_token_slot_share(kv_dtype) if query_len <= 1 else None
    if kv_dtype in FP8_KV_DTYPES and query_len <= 1 and block_size is not None and block_size % block_n == 0:
        return DecodeConfig(block_n=block_n, num_warps=warps, num_stages=4, programs_per_sm=2, slot_share=share)
    if kv_dtype in FP8_KV_DTYPES and query_len <= 1:
        return DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, wave_fill=0.9, slot_share=share)
    return DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, slot_share=share)


def one_token_slot_share(kv_dtype: torch.dtype | None) -> float:
    """The slot share (``DecodePolicy.slot_share``) of one-token launches over a cache of
    ``kv_dtype`` (None: the query's): 1.0 for a one-byte cache, 0.75 for a 16-bit one (see
    :func:`default_decode_config`)."""
    return 1.0 if kv_dtype in FP8_KV_DTYPES or kv_dtype in TOKEN_SCALED_KV_DTYPES else 0.75


def hopper_decode_config(kv_dtype: torch.dtype, overlap: bool = False, ws_loader: bool = True) -> DecodeConfig:
    """The launch of one-token rows on the Hopper kernel (:mod:`.decode_hopper`) over a cache
    of ``kv_dtype`` (float8_e4m3fn, or bf16 / fp16: the query's): its tile
    (:func:`~.decode_hopper.hopper_block_n`), a ring of three tiles (103 KiB of shared
    memory at head_dim 128) and two programs an SM; ``overlap``: its overlapped loop
    (``DecodeConfig.hopper_overlap``; 1-4 KiB more shared memory for the second P buffer);
    ``ws_loader``: the loop in turn's TMA loads in a loader warp (``DecodeConfig.hopper_ws_loader``;
    not with ``overlap``). On an H100 (``benchmarks/results/decode-ws-loader-h100-2026-12-07.md``)
    the loader warp ran the kernel's own floor (every table entry on one L2-resident block)
    1.05-1.20x faster over fp8 and 1.01-1.24x over bf16, from HBM 0.97-1.03x.
    :class:`~attention.triton_backend.TritonBackend` takes it by default where the kernel runs
    (an sm_90 GPU) for a 16-bit cache, and for an fp8 one under bf16 queries; elsewhere
    :func:`paged_decode` runs the Triton kernel with the same tiles.

    On the H200 (benchmarks/results/decode-hopper-h200-2026-12-05.md) this launch ran
    bench_decode.py's shapes at 0.99-1.20x the speed of the Triton launches (bf16 32x512 at
    1.12-1.14x flash-attn's, the Triton kernel at 0.93-0.96x), and the end-to-end burst's
    decode attention at 2.81 ms an iteration against 2.97 (bf16: the default since) and 1.80
    against 1.95 (fp8, block 256). On an H100 after per-step sizes stopped being specialised on
    (benchmarks/results/stall-e2e-h100-2026-12-05.md) the fp8 burst ran 2.36 ms against 2.32 at
    block 256 and 2.35 against 2.42 at block 32, so fp8 in long blocks then stayed on the Triton
    kernel there; since the kernel's per-tile savings (an H100 at block 256: 1.00-1.10x the Triton
    kernel's speed, the burst 2.321 against 2.322 ms,
    benchmarks/results/decode-fp8-gluon-vs-triton-h100-2026-12-07.md) it takes fp8 at every block
    size on every sm_90 GPU.

    Measured before on H100 SXMs (benchmarks/results/decode-hopper-h100-2026-12-05.md), against
    :func:`default_decode_config`'s Triton launches in the same run:

    - bench_decode.py (CUDA-graph replay, K/V from HBM, 32 query / 8 KV heads, head_dim 128,
      blocks 32 and 256; 32x512, 64x4096, 128x2048, 16x16384, LogNormal(2048)): the fp8
      cache at 1.00-1.07x their speed, the bf16 cache at 0.99-1.05x;
    - the end-to-end burst (bench_e2e.py, Llama-3-8B shapes, 128 rows, CUDA graphs): decode
      attention (chunks and combine) 4.31 ms an iteration against 4.20 (bf16 cache) and 2.71
      against 2.69 (fp8), before the slot share (below). A ring of two tiles (three programs
      an SM) did no better there (4.33 against 4.20, 2.72 against 2.68) and up to 3% worse in
      bench_decode (64x4096).

    Its rows are chunked with :func:`default_decode_config`'s slot share (1.0 over fp8, 0.75
    over a 16-bit cache), which the figures above predate. With it
    (benchmarks/results/decode-hopper-slot-share-h100-2026-12-05.md, H100): fp8 at block 32
    1.00-1.07x the Triton launches' speed on every shape and 1.04x end to end; at block 256
    0.98-1.06x and 0.98x end to end; bf16 0.99-1.05x and 1.02x end to end.
    """
    return DecodeConfig(
        block_n=hopper_block_n(kv_dtype), num_warps=4, num_stages=3, programs_per_sm=2, hopper_wgmma=True,
        slot_share=one_token_slot_share(kv_dtype), hopper_overlap=overlap, hopper_ws_loader=ws_loader and not overlap,
    )  # fmt: skip


#: Launch candidates a GPU sweep times around the default (bf16, head_dim 128): the two
#: combine modes, a shorter tile with a deeper pipeline, a longer tile.
DECODE_SWEEP: tuple[DecodeConfig, ...] = (
    DecodeConfig(block_n=64, num_warps=4, num_stages=2),
    DecodeConfig(block_n=64, num_warps=4, num_stages=2, fused_combine=True),
    DecodeConfig(block_n=32, num_warps=4, num_stages=3),
    DecodeConfig(block_n=128, num_warps=4, num_stages=2),
)


@dataclass(frozen=True)
class DecodeWorkspace:
    """Preallocated buffers of the decode kernels (fixed addresses, for CUDA graphs).

    part_o:   fp32 [max_partials, num_heads, head_dim]: one chunk's normalised output.
    part_lse: fp32 [max_partials, num_heads]: its log2-sum-exp (-inf for an empty chunk).
    counters: int32 [max_rows, num_kv_heads]: fused-combine arrivals per (row, KV head);
              zero between launches (each launch leaves them zero; after an aborted launch
              call :meth:`reset`).
    """

    part_o: torch.Tensor
    part_lse: torch.Tensor
    counters: torch.Tensor

    @property
    def max_partials(self) -> int:
        return int(self.part_o.shape[0])

    def reset(self) -> None:
        self.counters.zero_()


def allocate_decode_workspace(
    *,
    max_rows: int,
    max_partials: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str,
) -> DecodeWorkspace:
    """Workspace for schedules of at most ``max_rows`` rows (``schedule.grid_rows``) and
    ``max_partials`` partial slots (``max_decode_partials`` for a graph bucket, or
    ``schedule.num_partials``). At least one slot and row are allocated so every pointer
    handed to the kernels is real."""
    for name, v in (("max_rows", max_rows), ("max_partials", max_partials)):
        if v < 0:
            raise ValueError(f"{name}: {v} must be >= 0")
    slots, rows = max(1, max_partials), max(1, max_rows)
    f32 = torch.float32
    return DecodeWorkspace(
        part_o=torch.empty((slots, num_heads, head_dim), dtype=f32, device=device),
        part_lse=torch.empty((slots, num_heads), dtype=f32, device=device),
        counters=torch.zeros((rows, num_kv_heads), dtype=torch.int32, device=device),
    )


def _host_int32(values: array, fields: int) -> torch.Tensor:
    if not len(values):  # frombuffer refuses an empty buffer
        return torch.empty((0, fields), dtype=torch.int32)
    assert values.itemsize == 4, f"array('i') has {values.itemsize}-byte items on this platform"
    return torch.frombuffer(values, dtype=torch.int32).view(-1, fields)


def _copy_into(name: str, host: torch.Tensor, dst: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``host`` onto ``device``: into ``dst[:len(host)]`` when given (persistent buffers),
    else a new tensor; one non-blocking copy from pinned memory on CUDA."""
    # Pinned for an asynchronous copy; on CPU a copy, so nothing aliases the schedule's arrays.
    host = host.pin_memory() if device.type == "cuda" else host.clone()
    if dst is None:
        return host.to(device, non_blocking=True)
    fields = host.shape[1]
    if dst.dtype != torch.int32 or dst.dim() != 2 or dst.shape[1] != fields or dst.shape[0] < host.shape[0]:
        raise ValueError(
            f"{name}: expected int32 [>= {host.shape[0]}, {fields}], got {dst.dtype} {tuple(dst.shape)}; "
            f"allocate it for the largest bucket"
        )
    if not same_device(dst.device, device):
        raise ValueError(f"{name}: on {dst.device}, expected {device}")
    dst[: host.shape[0]].copy_(host, non_blocking=True)
    return dst


def decode_metadata(
    schedule: DecodeSchedule,
    device: torch.device | str,
    *,
    rows_out: torch.Tensor | None = None,
    items_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule's arrays on ``device``: (rows int32 [grid_rows, 5], items int32
    [grid_items, 10]), or written into the first rows of the persistent buffers ``rows_out`` /
    ``items_out`` (which are returned). Never waits for the device."""
    device = torch.device(device)
    rows = _copy_into("rows_out", _host_int32(schedule.rows, ROW_FIELDS), rows_out, device)
    items = _copy_into("items_out", _host_int32(schedule.items, ITEM_FIELDS), items_out, device)
    return rows, items


def _check_int32_table(name: str, t: torch.Tensor, fields: int, need: int, device: torch.device) -> None:
    if t.dtype != torch.int32 or t.dim() != 2 or t.shape[1] != fields or not t.is_contiguous():
        raise ValueError(f"{name}: expected contiguous int32 [n, {fields}], got {t.dtype} {tuple(t.shape)}")
    if t.shape[0] < need:
        raise ValueError(f"{name}: {t.shape[0]} entries, the schedule's grid needs {need}; use decode_metadata")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (the cache's device)")


def _check_hopper_tile(query: torch.Tensor, k_cache: torch.Tensor, config: DecodeConfig) -> None:
    """A ``hopper_wgmma`` launch over a cache the Hopper kernel takes (fp8 e4m3 or the 16-bit
    query's dtype) must use its tile (``hopper_block_n``); raises ValueError naming it."""
    takes = query.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype in (torch.float8_e4m3fn, query.dtype)
    tile = hopper_block_n(k_cache.dtype)
    if takes and config.block_n != tile:
        raise ValueError(
            f"config.block_n: {config.block_n} with hopper_wgmma over a {k_cache.dtype} cache; the Hopper kernel's "
            f"tiles are {tile} tokens there: pass block_n={tile} (and make the schedule with it)"
        )


def check_decode_launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    items: torch.Tensor,
    schedule: DecodeSchedule,
    workspace: DecodeWorkspace,
    out: torch.Tensor,
    config: DecodeConfig,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    tree_masks: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """The host checks of :func:`paged_decode` (same arguments; ``scales`` = (k_scale,
    v_scale)): shapes, dtypes, devices and the schedule's maxima against the tensors. O(1),
    no sync; raises ValueError naming the argument. A caller that runs these once for a
    step (every layer passes tensors of the same shapes) may launch with ``check=False``."""
    if tree_masks is not None and (
        tree_masks.dtype != torch.int32 or tree_masks.dim() != 1 or tree_masks.device != k_cache.device
    ):
        raise ValueError(
            f"tree_masks: expected int32 [num_tokens] on {k_cache.device}, got {tree_masks.dtype} "
            f"{tuple(tree_masks.shape)} on {tree_masks.device}"
        )
    if tree_masks is not None and tree_masks.shape[0] < min(query.shape[0], out.shape[0]):
        raise ValueError(
            f"tree_masks: {tree_masks.shape[0]} entries for {min(query.shape[0], out.shape[0])} query tokens; "
            "give one per token of the query"
        )
    if tree_masks is not None and window:
        raise ValueError("tree_masks: not with a sliding window (a tree token's position is its depth, not its index)")
    if window is not None and window < 1:
        raise ValueError(f"window: {window} must be >= 1 (or None)")
    if query.dtype not in _QUERY_DTYPES:
        raise ValueError(f"query: dtype {query.dtype} is not one of {_QUERY_DTYPES}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache: expected two [num_blocks, block_size, kv_heads, head_dim] tensors of one "
            f"shape and dtype, got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    token_scaled = k_cache.dtype in TOKEN_SCALED_KV_DTYPES
    if token_scaled:
        problem = layout_problem(k_cache, v_cache, scales[0], scales[1])
        if problem is not None:
            raise ValueError(f"{problem}: an int8 cache is read as attention.token_scales lays it out")
    elif not (k_cache.is_contiguous() and value_is_readable(v_cache)):
        raise ValueError(
            f"k_cache/v_cache: the decode kernel needs a contiguous k_cache and a contiguous or token-major "
            f"v_cache (attention.value_layout), got strides {k_cache.stride()} and {v_cache.stride()}"
        )
    _, _, kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    if query.dim() != 3 or query.shape[2] != head_dim or num_heads % kv_heads:
        raise ValueError(
            f"query: expected [tokens, a multiple of {kv_heads} heads, {head_dim}], got {tuple(query.shape)}"
        )
    if out.shape[1:] != query.shape[1:] or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out: expected [tokens, {num_heads}, {head_dim}] {query.dtype} with unit stride on the last dim, "
            f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    fp8 = k_cache.dtype in FP8_KV_DTYPES
    if not (fp8 or token_scaled) and k_cache.dtype != query.dtype:
        raise ValueError(
            f"k_cache: dtype {k_cache.dtype} differs from the query's {query.dtype} (or is not fp8 or int8)"
        )
    for name, s in zip(("k_scale", "v_scale"), scales, strict=True):
        if token_scaled:
            continue  # checked with the layout above
        bad = s is None or s.dtype != torch.float32 or tuple(s.shape) != (kv_heads,) or s.device != k_cache.device
        if fp8 and bad:
            got = "None" if s is None else f"{s.dtype} {tuple(s.shape)} on {s.device}"
            raise ValueError(f"{name}: an fp8 cache needs fp32 [{kv_heads}] scales on {k_cache.device}, got {got}")
        if not fp8 and s is not None:
            raise ValueError(
                f"{name}: given for a {k_cache.dtype} cache; scales apply only to fp8 caches (and int8's own)"
            )
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables: expected int32 [rows, >= 1 blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    for name, t in (("query", query), ("out", out), ("block_tables", block_tables)):
        if t.device != k_cache.device:
            raise ValueError(f"{name}: on {t.device}, expected {k_cache.device} (the cache's device)")
    _check_int32_table("items", items, ITEM_FIELDS, schedule.grid_items, k_cache.device)
    _check_int32_table("rows", rows, ROW_FIELDS, schedule.grid_rows, k_cache.device)
    if config.hopper_wgmma:
        _check_hopper_tile(query, k_cache, config)
    if schedule.chunk_len % config.block_n:
        raise ValueError(
            f"schedule: chunk_len {schedule.chunk_len} is not a multiple of config.block_n {config.block_n}; "
            f"make the schedule with block_n={config.block_n}"
        )
    if schedule.max_table_row >= block_tables.shape[0]:
        raise ValueError(
            f"schedule: names table row {schedule.max_table_row}, block_tables has {block_tables.shape[0]}"
        )
    if schedule.max_q_token >= min(query.shape[0], out.shape[0]):
        raise ValueError(
            f"schedule: names query token {schedule.max_q_token}, query has {query.shape[0]} and out {out.shape[0]}"
        )
    ws = workspace
    if ws.part_o.shape[1:] != (num_heads, head_dim) or ws.part_lse.shape[1:] != (num_heads,):
        raise ValueError(
            f"workspace: made for {tuple(ws.part_o.shape[1:])} heads x head_dim, the query has {(num_heads, head_dim)}"
        )
    if schedule.num_partials > ws.max_partials:
        raise ValueError(
            f"workspace: {ws.max_partials} partial slots, the schedule uses {schedule.num_partials}; "
            f"allocate max_decode_partials(...) slots"
        )
    if ws.counters.shape != (ws.counters.shape[0], kv_heads) or ws.counters.shape[0] < schedule.grid_rows:
        raise ValueError(
            f"workspace.counters: {tuple(ws.counters.shape)}, expected [>= {schedule.grid_rows}, {kv_heads}]"
        )


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    items: torch.Tensor,
    schedule: DecodeSchedule,
    workspace: DecodeWorkspace,
    *,
    softmax_scale: float,
    out: torch.Tensor,
    config: DecodeConfig,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check: bool = True,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    tree_masks: torch.Tensor | None = None,
    combine: bool = True,
) -> torch.Tensor:
    """Decode attention of the schedule's rows; writes their tokens of ``out``, returns it.

    query:        [num_tokens, num_heads, head_dim] fp16/bf16/fp32 (any strides but a unit
                  last one is fastest); row d's queries are tokens ``q_tokens[d]`` ..
                  ``q_tokens[d] + q_lens[d] - 1``.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], k_cache contiguous,
                  v_cache contiguous or token-major (:mod:`attention.value_layout`), the
                  query's dtype, or fp8 (FP8_KV_DTYPES) with ``k_scale`` / ``v_scale``: fp32
                  [num_kv_heads] dequantisation scales (K = k_scale[h] * k_fp8), or int8
                  laid out as :func:`attention.token_scales.split_block_memory` lays it out
                  (V token-major, block stride past the values) with ``k_scale`` /
                  ``v_scale``: its fp16 [num_blocks, block_size, num_kv_heads] per-token
                  scales (K[b, t, h] = k_scale[b, t, h] * k_int8[b, t, h]).
    block_tables: int32 [table_rows, max_blocks]; row d reads table row ``table_rows[d]``
                  (a persistent table may have more rows than the step).
    rows, items:  int32 [>= grid_rows, 5] and [>= grid_items, 10] from :func:`decode_metadata`.
    schedule:     the host schedule those were made from (grid sizes; made for
                  ``config.block_n``). workspace: from :func:`allocate_decode_workspace`.
    out:          [>= num_tokens, num_heads, head_dim], the query's dtype, unit last stride;
                  tokens no row names are left untouched.
    softcap:      cap scaled scores s to ``softcap * tanh(s / softcap)`` (None: no cap).
    sinks:        fp32 [num_heads] learned sink logits (None: none).
    window:       the sliding window the schedule's ranges were made for (None: none); rows
                  of several new tokens need it for each token's own lower bound.
    tree_masks:   int32 [num_tokens]: per new token of a multi-token row, the bitmask of the
                  row's new tokens it sees (bit j: the row's j-th new token; its own bit set);
                  None: causal. Not with a window.
    combine:      False: the caller knows no row of ``schedule`` splits (``num_partials``
                  0; ValueError otherwise), and the combine kernel is not launched even on
                  a fixed grid (a CUDA graph captured for such steps).
    check:        run :func:`check_decode_launch` first (~20-40 us of Python). Pass False
                  only for arguments of shapes already checked (e.g. every layer after the
                  first of a step): the kernels then still stay inside their tensors
                  whatever the device metadata says, but host-side sizes are trusted.
    Nothing syncs with the device.
    """
    if check:
        scales = (k_scale, v_scale)
        check_decode_launch(
            query, k_cache, v_cache, block_tables, rows, items, schedule, workspace, out, config, scales,
            tree_masks, window,
        )  # fmt: skip
    if not combine and schedule.num_partials:
        raise ValueError(
            f"combine: False, but the schedule splits rows ({schedule.num_partials} partial slots); "
            f"launch with combine=True"
        )
    if schedule.grid_items == 0:
        return out
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    d_pad = next_power_of_2(max(head_dim, 16))
    scaled = k_cache.dtype in FP8_KV_DTYPES
    token_scaled = k_cache.dtype in TOKEN_SCALED_KV_DTYPES
    ws = workspace
    num_q_tokens = min(query.shape[0], out.shape[0])
    g_pad = next_power_of_2(group)
    extras = softcap is not None or sinks is not None or tree_masks is not None
    if config.hopper_wgmma and decode_hopper_applies(
        query, k_cache, v_cache, schedule.query_len, block_n=config.block_n, fused_combine=config.fused_combine,
        extras=extras,
    ):  # fmt: skip
        launch_decode_hopper(
            query, k_cache, v_cache, (k_scale, v_scale) if k_scale is not None and v_scale is not None else None,
            block_tables, items, schedule.grid_items, out, ws.part_o, ws.part_lse, softmax_scale * _LOG2E,
            config.num_stages, overlap=config.hopper_overlap, ws_loader=config.hopper_ws_loader,
        )  # fmt: skip
    else:
        decode_items_kernel[(kv_heads, schedule.grid_items)](
            query,
            k_cache,
            v_cache,
            k_scale if k_scale is not None else ws.part_lse,  # unused unless KV_SCALED
            v_scale if v_scale is not None else ws.part_lse,
            sinks if sinks is not None else ws.part_lse,  # unused unless SINKS
            tree_masks if tree_masks is not None else ws.counters,  # unused unless TREE
            block_tables,
            items,
            out,
            ws.part_o,
            ws.part_lse,
            ws.counters,
            softmax_scale * _LOG2E,
            (softcap or 1.0) * _LOG2E,  # the scores' log2 units
            window or 0,
            items.shape[0],
            block_tables.shape[0],
            block_tables.shape[1],
            num_blocks,
            num_q_tokens,
            ws.max_partials,
            ws.counters.shape[0],
            query.stride(0),
            query.stride(1),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=kv_heads,
            GROUP=group,
            G_PAD=g_pad,
            Q_PAD=schedule.query_len,
            M_PAD=max(16, schedule.query_len * g_pad),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            BLOCK_SIZE=block_size,
            BLOCK_N=config.block_n,
            BLOCK_STRIDE=cache_block_stride(k_cache),
            KV_SCALED=scaled,
            TOKEN_SCALES=token_scaled,
            F16_DOTS=config.f16_fp8_dots and f16_dots_for(query.dtype, k_cache.dtype),
            UPCAST=upcast_for(query.dtype),
            DOT_PRECISION=dot_precision_for(query.dtype),
            FUSED_COMBINE=config.fused_combine,
            MERGE_CHUNKS=_MERGE_CHUNKS,
            SOFTCAP=softcap is not None,
            SINKS=sinks is not None,
            TREE=tree_masks is not None and schedule.query_len > 1,
            V_TOKEN_MAJOR=token_scaled or is_token_major(v_cache),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **({} if config.maxnreg is None else {"maxnreg": config.maxnreg}),
        )
    if combine and schedule.needs_combine and not config.fused_combine:
        decode_combine_kernel[(num_heads, schedule.grid_rows)](
            rows,
            ws.part_o,
            ws.part_lse,
            sinks if sinks is not None else ws.part_lse,
            out,
            rows.shape[0],
            num_q_tokens,
            ws.max_partials,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            MERGE_CHUNKS=_MERGE_CHUNKS,
            SINKS=sinks is not None,
            Q_PAD=schedule.query_len,
            num_warps=config.combine_num_warps,
        )
    return out
