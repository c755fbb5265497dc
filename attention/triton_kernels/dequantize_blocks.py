"""Dequantize the cache blocks a prefill step reads into a 16-bit scratch cache.

Prefill is compute-bound: over an fp8 cache the attention kernel does the same multiply-adds
as over a 16-bit one, and the Hopper prefill kernel (:mod:`.prefill_hopper`) takes only 16-bit
tiles. So for an 8-bit cache (fp8 with a scale per KV head, int8 with a scale per token and
KV head) the backend first copies the blocks its prefill rows read, dequantized
(``(x.float() * scale).to(dtype)``; for fp8 exactly what the Triton kernels compute on the
fly, for int8 one rounding to ``dtype`` more than their scaled scores), into a contiguous
scratch cache laid out row after row, and runs the 16-bit kernel over it with a block table
that points there (:func:`plan_block_dequant`). Reading the 8-bit blocks and writing them at
16 bits moves three times their bytes once per layer call, while the attention does hundreds
of multiply-adds per byte read. On the H200
(``benchmarks/results/prefill-hopper-fp8-dequant-2026-12-04.json``), copy and kernel together
ran at 0.97-1.06x the bf16 cache's speed at 8x4096 / 32x1024 / 2x16384 for fp8 (the copy is
compact, a row's blocks in order, which the kernel reads faster than scattered blocks), and
0.90-1.03x for int8 (``prefill-int8-dequant-2026-12-05.json``; 0.64-0.71x on the Triton
kernel). The copy is transient memory outside the cache sizing, capped by the backend
(``_DEQUANT_SCRATCH_BYTES``, 1 GiB; larger steps stay on the Triton kernel).

The plan is made on the host from host lengths; the kernel reads block ids from the device
block table, and maps any id outside the cache (or a column outside the table) to block 0.

A CUDA-graph step fixes its launches before its lengths are known, so there the plan takes a
fixed table width and a fixed number of scratch blocks (``plan_block_dequant(width=...)``,
the sources padded with -1), and the copy runs a fixed grid of programs that take the scratch
blocks in turn up to a count read on the device (``dequantize_blocks(count=...)``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention.triton_kernels.paging import next_power_of_2

__all__ = ["BlockDequantPlan", "counted_programs", "dequantize_blocks", "plan_block_dequant"]

_TOKENS = 32  # tokens per program
#: Programs along the scratch blocks of a counted (CUDA-graph) copy, when not given.
_MAX_COUNTED_PROGRAMS = 1024
#: Programs a counted copy keeps on each SM (:func:`counted_programs`).
_COUNTED_PROGRAMS_PER_SM = 4


def counted_programs(sms: int, block_size: int, kv_heads: int) -> int:
    """Programs along the scratch blocks for a counted copy on ``sms`` SMs: about four
    programs an SM in all (each block takes ``kv_heads x ceil(block_size / 32)`` of them). A
    fixed grid sized for the bucket's most blocks would launch mostly programs that find no
    block (a step copies far fewer), each still scheduled."""
    per_block = kv_heads * triton.cdiv(block_size, _TOKENS)
    return max(1, triton.cdiv(_COUNTED_PROGRAMS_PER_SM * sms, per_block))


@dataclass(frozen=True)
class BlockDequantPlan:
    """Which cache blocks to dequantize, and the table of the scratch cache.

    sources: (row, column) of the step's block table for each scratch block, host int32 array
             of 2 x num_blocks entries, row-major (scratch block i holds the block at
             ``block_tables[sources[2i], sources[2i + 1]]``).
    tables:  the scratch cache's block table, host int32 array of ``batch x width`` entries:
             row r's column c is its scratch block, -1 past the row's blocks (and for rows not
             planned).
    """

    sources: array
    tables: array
    num_blocks: int
    batch: int
    width: int


def plan_block_dequant(
    seq_lens: Sequence[int], rows: Sequence[int], block_size: int, width: int | None = None
) -> BlockDequantPlan:
    """The blocks rows ``rows`` read (``ceil(seq_lens[r] / block_size)`` each, host lengths),
    placed row after row in the scratch cache. ``width``: the table's width (a CUDA-graph
    step's fixed one; it must hold every row's blocks), else the most any row reads."""
    counts = {r: -(-max(seq_lens[r], 0) // block_size) for r in rows}
    most = max(counts.values(), default=0)
    if width is not None and width < most:
        raise ValueError(f"width: {width} columns cannot hold a row of {most} blocks")
    width = width or most or 1
    batch = len(seq_lens)
    tables = array("i", [-1]) * (batch * width)
    sources = array("i")
    next_block = 0
    for r, n in counts.items():
        for c in range(n):
            tables[r * width + c] = next_block + c
            sources.extend((r, c))
        next_block += n
    return BlockDequantPlan(sources, tables, next_block, batch, width)


# Per-step sizes are not specialised on (a value of 1 or a multiple of 16 would each compile
# a kernel of its own, in the middle of serving where the warm-up did not meet it).
@triton.jit(do_not_specialize=["num_scratch", "num_rows", "table_width", "stride_bt"])
def _dequantize_blocks_kernel(  # type: ignore[no-untyped-def]
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, sources_ptr, k_out_ptr, v_out_ptr,
    count_ptr, num_scratch, num_blocks, num_rows, table_width, stride_bt, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    TOKENS: tl.constexpr, TOKEN_SCALES: tl.constexpr, COUNTED: tl.constexpr,
):  # fmt: skip
    """Program (i, h, t): tokens ``t * TOKENS ..`` of KV head ``h`` of scratch block ``i``;
    COUNTED: of scratch blocks ``i``, ``i + grid[0]``, ... below ``count_ptr[0]``, clamped to
    the ``num_scratch`` blocks of the output (a fixed grid). K has strides ``stride_k*`` (unit
    along head_dim); V ``stride_v*`` (contiguous or token-major); the output is contiguous
    ``[num_scratch, BLOCK_SIZE, KV_HEADS, HEAD_DIM]``. Scales: one per KV head (fp32
    [KV_HEADS]), or with TOKEN_SCALES one per (token, KV head) at ``scale_ptr + block *
    stride_sb + token * stride_st + head * stride_sh`` (an int8 cache,
    :mod:`attention.token_scales`; K's and V's alike)."""
    first = tl.program_id(0)
    if COUNTED:
        end = tl.minimum(tl.load(count_ptr), num_scratch)
        step = tl.num_programs(0)
    else:  # the program's one block
        end = first + 1
        step = 1
    for i in range(first, end, step):
        _dequantize_one_block(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, sources_ptr, k_out_ptr, v_out_ptr, i,
            num_blocks, num_rows, table_width, stride_bt, stride_kb, stride_kt, stride_kh,
            stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_st, stride_sh,
            BLOCK_SIZE, KV_HEADS, HEAD_DIM, D_PAD, TOKENS, TOKEN_SCALES,
        )  # fmt: skip


@triton.jit
def _dequantize_one_block(  # type: ignore[no-untyped-def]
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, sources_ptr, k_out_ptr, v_out_ptr, i,
    num_blocks, num_rows, table_width, stride_bt, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    TOKENS: tl.constexpr, TOKEN_SCALES: tl.constexpr,
):  # fmt: skip
    """Tokens ``program_id(2) * TOKENS ..`` of KV head ``program_id(1)`` of scratch block ``i``."""
    h = tl.program_id(1)
    i = tl.full((), 0, tl.int64) + i  # int64 offsets (the interpreter's loop index is a Python int)
    row = tl.load(sources_ptr + 2 * i)
    col = tl.load(sources_ptr + 2 * i + 1)
    ok = (row >= 0) & (row < num_rows) & (col >= 0) & (col < table_width)
    src = tl.load(tables_ptr + tl.where(ok, row, 0).to(tl.int64) * stride_bt + tl.where(ok, col, 0))
    src = tl.where(ok & (src >= 0) & (src < num_blocks), src, 0).to(tl.int64)
    t = tl.program_id(2) * TOKENS + tl.arange(0, TOKENS)
    d = tl.arange(0, D_PAD)
    t_ok = t < BLOCK_SIZE
    mask = t_ok[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + src * stride_kb + t[:, None] * stride_kt + h * stride_kh + d[None, :], mask=mask, other=0.0)
    v_off = src * stride_vb + t[:, None] * stride_vt + h * stride_vh + d[None, :] * stride_vd
    v = tl.load(v_ptr + v_off, mask=mask, other=0.0)
    out_off = i * (BLOCK_SIZE * KV_HEADS * HEAD_DIM) + (t[:, None] * KV_HEADS + h) * HEAD_DIM + d[None, :]
    if TOKEN_SCALES:
        s_off = src * stride_sb + t * stride_st + h * stride_sh
        ks = tl.load(k_scale_ptr + s_off, mask=t_ok, other=0.0).to(tl.float32)[:, None]
        vs = tl.load(v_scale_ptr + s_off, mask=t_ok, other=0.0).to(tl.float32)[:, None]
    else:
        ks = tl.load(k_scale_ptr + h)
        vs = tl.load(v_scale_ptr + h)
    tl.store(k_out_ptr + out_off, (k.to(tl.float32) * ks).to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_out_ptr + out_off, (v.to(tl.float32) * vs).to(v_out_ptr.dtype.element_ty), mask=mask)


def dequantize_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    sources: torch.Tensor,
    dtype: torch.dtype,
    count: torch.Tensor | None = None,
    programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks ``sources`` (int32 [n, 2] of (row, column) of ``block_tables``, on the
    device) of an 8-bit cache as two new contiguous ``[n, block_size, kv_heads, head_dim]``
    caches of ``dtype``: fp8 with per-KV-head scales (fp32 [kv_heads]), or int8 with per-token
    scales (fp16 [num_blocks, block_size, kv_heads] views, K's and V's with one set of
    strides: :mod:`attention.token_scales`). K with unit stride along head_dim, V contiguous
    or token-major (:mod:`attention.value_layout`).

    ``count`` (int32 [1], device; a CUDA-graph step's): only the first ``min(count[0], n)``
    sources are copied, by ``programs`` programs along the blocks (default: n, at most
    1024), which take them in turn; the scratch blocks past them are left unwritten."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if k_cache.stride(-1) != 1 or k_cache.stride(2) != head_dim:
        raise ValueError(f"k_cache: expected rows of head_dim contiguous values, got strides {k_cache.stride()}")
    token_scales = k_scale.dim() == 3
    if token_scales and k_scale.stride() != v_scale.stride():
        raise ValueError(f"k_scale, v_scale: expected one layout, got strides {k_scale.stride()}, {v_scale.stride()}")
    n = sources.shape[0]
    if count is not None and (count.dtype != torch.int32 or count.numel() != 1 or count.device != sources.device):
        raise ValueError(f"count: expected one int32 on {sources.device}, got {count.dtype} {tuple(count.shape)}")
    if programs is not None and programs < 1:
        raise ValueError(f"programs: {programs} must be >= 1")
    k_out = torch.empty(n, block_size, kv_heads, head_dim, dtype=dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    if n == 0:
        return k_out, v_out
    along = n if count is None else min(n, programs or _MAX_COUNTED_PROGRAMS)
    grid = (along, kv_heads, triton.cdiv(block_size, _TOKENS))
    scale_strides = k_scale.stride() if token_scales else (0, 0, 0)
    _dequantize_blocks_kernel[grid](
        k_cache, v_cache, k_scale, v_scale, block_tables, sources, k_out, v_out,
        count if count is not None else sources,  # unused unless COUNTED
        n, num_blocks, block_tables.shape[0], block_tables.shape[1], block_tables.stride(0), *k_cache.stride()[:3],
        *v_cache.stride(), *scale_strides,
        BLOCK_SIZE=block_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim, D_PAD=next_power_of_2(max(head_dim, 16)),
        TOKENS=_TOKENS, TOKEN_SCALES=token_scales, COUNTED=count is not None,
    )  # fmt: skip
    return k_out, v_out
