"""Paged decode for multi-head latent attention (DeepSeek's MLA), in the absorbed form.

Each token of a row caches one latent of ``D = R + E`` values (``R`` = kv_lora_rank, the
compressed K/V; ``E`` = qk_rope_head_dim, the rotated shared key) in a cache laid out
``[num_blocks, block_size, 1, D]``. A row's one new token has a query per head, also ``D``
wide (``[W_UK^T q_nope, q_pe]``), and its output is ``softmax(q . latent * scale) @
latent[:, :R]``: every head reads the same latents, so one program takes a tile of
``BLOCK_H`` heads of one row and streams the row's latents once for all of them (the K/V
bytes of MLA are one latent per token, not per head: what makes MLA decode memory-cheap).

Grid ``(head tiles, rows, splits)``: split ``s`` of a row takes the tokens ``[s * chunk,
(s + 1) * chunk)`` (``chunk`` a multiple of ``BLOCK_N``), so long rows spread over more
programs; each split stores its fp32 partial output, running max and sum, and
:func:`mla_decode` merges them (log-sum-exp) with a few torch ops. With one split the
merge is a division.

Memory safety holds for any table: block ids outside ``[0, num_blocks)`` mask their tokens
off (never dereferenced, and out of the softmax), table columns are clamped to the table
width, and a length is clamped to ``table_width * block_size``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.errors import InvalidArgumentError
from attention.triton_kernels.paging import dot_precision_for, next_power_of_2, upcast_for

__all__ = ["mla_decode"]

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [rows, H, D]
    cache_ptr,  # [num_blocks, block_size, 1, D]
    table_ptr,  # int32 [rows, table_width]
    lens_ptr,  # int32 [rows]
    acc_ptr,  # fp32 [rows, splits, H, R]
    ml_ptr,  # fp32 [rows, splits, H, 2]: running max (log2 domain) and sum
    num_heads,
    num_blocks,
    table_width,
    chunk,
    scale_log2,
    stride_qt,
    stride_qh,
    R: tl.constexpr,
    E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    h0 = tl.program_id(0) * BLOCK_H
    row = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    D: tl.constexpr = R + E
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_e = tl.arange(0, BLOCK_E)
    offs_n = tl.arange(0, BLOCK_N)
    head_ok = offs_h < num_heads
    seq_len = tl.minimum(tl.maximum(tl.load(lens_ptr + row), 0), table_width * BLOCK_SIZE)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    q_row = q_ptr + row.to(tl.int64) * stride_qt + offs_h.to(tl.int64)[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=head_ok[:, None] & (offs_r[None, :] < R), other=0.0)
    q_pe = tl.load(q_row + R + offs_e[None, :], mask=head_ok[:, None] & (offs_e[None, :] < E), other=0.0)
    if UPCAST:
        q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table_row = table_ptr + row.to(tl.int64) * table_width
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        in_row = n < end
        col = tl.maximum(tl.minimum(n // BLOCK_SIZE, table_width - 1), 0)
        page = tl.load(table_row + col, mask=in_row, other=-1)
        ok = in_row & (page >= 0) & (page < num_blocks)
        slot = tl.where(ok, page, 0).to(tl.int64) * BLOCK_SIZE + (n % BLOCK_SIZE)
        lat_ptr = cache_ptr + slot[:, None] * D
        c = tl.load(lat_ptr + offs_r[None, :], mask=ok[:, None] & (offs_r[None, :] < R), other=0.0)
        pe = tl.load(lat_ptr + R + offs_e[None, :], mask=ok[:, None] & (offs_e[None, :] < E), other=0.0)
        if UPCAST:
            c, pe = c.to(tl.float32), pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    base = (row.to(tl.int64) * splits + split) * num_heads + offs_h.to(tl.int64)
    tl.store(acc_ptr + base[:, None] * R + offs_r[None, :], acc, mask=head_ok[:, None] & (offs_r[None, :] < R))
    tl.store(ml_ptr + base * 2, m_i, mask=head_ok)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=head_ok)


def mla_decode(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    num_splits: int = 1,
    block_n: int = 32,
    block_h: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Absorbed MLA decode of one new token per row over a paged latent cache.

    query:        [rows, H, R + E] (``[W_UK^T q_nope, q_pe]`` per head), the cache's dtype.
    cache:        [num_blocks, block_size, 1, R + E], the latents (already holding this
                  step's); R = ``kv_lora_rank``.
    block_tables: int32 [rows, table_width]; seq_lens: int32 [rows], the latents each row
                  attends to (its new token's included).
    scale:        the softmax scale (``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).
    num_splits:   programs per row along its tokens (long rows: more parallelism).
    block_n, block_h, num_warps, num_stages: the launch (tokens per tile, heads per program).
    Returns float32 [rows, H, R]: ``softmax(q . latent * scale) @ latent[:, :R]`` per head (a
    row of length 0 gives zeros). Raises InvalidArgumentError for tensors of the wrong shape,
    dtype or device, or sizes outside what the kernel takes.
    """
    if query.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1:
        raise InvalidArgumentError(
            f"query, cache: expected [rows, heads, D] and [num_blocks, block_size, 1, D], got {list(query.shape)} "
            f"and {list(cache.shape)}"
        )
    rows, heads, dim = query.shape
    num_blocks, block_size, _, width = cache.shape
    if width != dim or not 0 < kv_lora_rank < dim:
        raise InvalidArgumentError(
            f"kv_lora_rank: {kv_lora_rank} with a query of {dim} and a latent of {width} channels; the latent is "
            "kv_lora_rank + qk_rope_head_dim wide, as the query"
        )
    if query.dtype != cache.dtype or query.device != cache.device:
        raise InvalidArgumentError(
            f"query: {query.dtype} on {query.device}, but the cache is {cache.dtype} on {cache.device}"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise InvalidArgumentError("block_tables, seq_lens: expected int32 tensors")
    if block_tables.dim() != 2 or block_tables.shape[0] != rows or tuple(seq_lens.shape) != (rows,):
        raise InvalidArgumentError(
            f"block_tables, seq_lens: expected [{rows}, width] and [{rows}], got {list(block_tables.shape)} and "
            f"{list(seq_lens.shape)}"
        )
    if block_size % block_n and block_n % block_size:
        raise InvalidArgumentError(f"block_n: {block_n} and block size {block_size} must divide one another")
    if not 1 <= num_splits <= 1024:
        raise InvalidArgumentError(f"num_splits: {num_splits} is not in [1, 1024]")
    if block_h < 16 or block_n < 16 or block_h & (block_h - 1) or block_n & (block_n - 1):
        raise InvalidArgumentError(f"block_h, block_n: {block_h}, {block_n} must be powers of two, at least 16")
    if query.stride(2) != 1 or not cache.is_contiguous():
        raise InvalidArgumentError("query, cache: the channels must be contiguous (and the cache all of it)")
    rank, rope = kv_lora_rank, dim - kv_lora_rank
    tables = block_tables.contiguous()
    width_cols = tables.shape[1]
    longest = width_cols * block_size
    chunk = -(-longest // num_splits)
    chunk = max(block_n, -(-chunk // block_n) * block_n)
    splits = -(-longest // chunk) if longest else 1
    acc = torch.empty(rows, splits, heads, rank, dtype=torch.float32, device=query.device)
    ml = torch.empty(rows, splits, heads, 2, dtype=torch.float32, device=query.device)
    if rows:
        # Head tiles vary fastest: the programs of one row run side by side and read its
        # latents from L2 after the first, instead of from HBM once per head tile.
        grid = (triton.cdiv(heads, block_h), rows, splits)
        _mla_decode_kernel[grid](
            query, cache, tables, seq_lens, acc, ml,
            heads, num_blocks, width_cols, chunk, scale * _LOG2E, query.stride(0), query.stride(1),
            R=rank, E=rope, BLOCK_R=next_power_of_2(max(rank, 16)), BLOCK_E=next_power_of_2(max(rope, 16)),
            BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_SIZE=block_size, UPCAST=upcast_for(cache.dtype),
            DOT_PRECISION=dot_precision_for(cache.dtype), num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    # Merge the splits: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s (M the largest m_s;
    # a split with no token has m = -inf, l = 0, acc = 0 and weighs 0).
    m, l_sum = ml[..., 0], ml[..., 1]
    top = m.amax(dim=1, keepdim=True)
    weight = torch.exp2(m - torch.where(torch.isinf(top), torch.zeros_like(top), top))
    weight = torch.nan_to_num(weight, nan=0.0)
    total = (weight * l_sum).sum(dim=1)  # [rows, H]
    out = (weight.unsqueeze(-1) * acc).sum(dim=1)
    return out / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
