"""Flash-decoding: paged attention for rows that bring exactly one new token (a pure decode
step, or the decode rows of a mixed step, named through a row index).

Decode is memory-bound: the work is reading each row's K/V once. So:

- one program per (row, kv_head, split) handles *all* query heads of that KV group at once
  (the group is padded to >= 16 rows so ``tl.dot`` runs on tensor cores); each K/V token is
  read from memory once per KV head, not once per query head;
- a row's tokens are cut into ``num_splits`` contiguous ranges (split-KV) when the batch alone
  cannot fill the GPU; each split keeps an fp32 online softmax and writes its partial output
  and log-sum-exp, and a small second kernel combines the splits. With one split the first
  kernel writes the output directly and the reduce launch is skipped;
- tokens are walked in tiles of BLOCK_N; when block_size is a multiple of BLOCK_N a tile lies
  in one block and costs one block-table read.

The split count is a host decision (:func:`choose_num_splits`), made once per step from host
lengths, so nothing here syncs with the device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention.triton_kernels.paging import (
    dot_precision_for,
    load_tile_pages,
    next_power_of_2,
    online_softmax_update,
    tile_mask,
    tile_token_offsets,
    upcast_for,
)

__all__ = [
    "DECODE_SWEEP",
    "DecodeConfig",
    "SplitPolicy",
    "choose_num_splits",
    "default_decode_config",
    "paged_decode",
    "split_length",
]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel (benchmarks sweep them).

    block_n:    tokens per tile (power of two, >= 16).
    num_warps:  warps per program.
    num_stages: software-pipelining depth: K/V tiles in flight per program.
    reduce_num_warps: warps of the split-combining kernel.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    reduce_num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeConfig.block_n: {self.block_n} must be a power of two >= 16")


@functools.cache  # called on every layer call: keep it off the host's launch path
def default_decode_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """A Hopper default: ~16 KiB per K (and V) tile, loaded with 16-byte async copies, and
    two pipeline stages (one tile streams in while one is used): ~64 KiB of shared memory
    per program, so three programs share an SM and keep enough loads in flight to cover HBM
    latency. Measured on the H200 (benchmarks/results/attention-sweep-2026-12-02.json,
    bf16, head_dim 128): 2 stages read K/V at 4.29 TB/s where 3 stages (96 KiB, two
    programs per SM) reach 3.6 TB/s at batch 64 x 4096 tokens, and tie elsewhere.
    (fp32 at head_dim 256 takes 8 warps to keep its tiles in registers.)"""
    d_pad = next_power_of_2(max(head_dim, 16))
    itemsize = torch.empty((), dtype=dtype).element_size()
    block_n = max(16, min(128, 16384 // (d_pad * itemsize)))
    warps = 8 if itemsize * d_pad > 512 else 4
    return DecodeConfig(block_n=block_n, num_warps=warps, num_stages=2)


#: Candidates a GPU sweep times (benchmarks/bench_attention.py --sweep) around the defaults:
#: tile length, warps, and pipeline depth; each compiles for sm_90 (Triton 3.6 and 3.9)
#: without register spills.
DECODE_SWEEP: tuple[DecodeConfig, ...] = tuple(
    DecodeConfig(block_n=bn, num_warps=w, num_stages=s)
    for bn, w, s in (
        (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3),
        (128, 4, 2), (128, 4, 3), (128, 8, 3), (32, 2, 4), (64, 2, 3),
    )
)  # fmt: skip


@dataclass(frozen=True)
class SplitPolicy:
    """How many splits a decode step gets (see :func:`choose_num_splits`).

    programs_per_sm:  aim for this many programs per SM, so each SM has several tiles
                      streaming from memory at once.
    min_split_tokens: never make a split shorter than this; below it the combine step and
                      per-program start-up cost more than the extra parallelism gains.
    max_splits:       upper bound (caps the partial-output buffer).
    """

    programs_per_sm: int = 4
    min_split_tokens: int = 256
    max_splits: int = 128

    def __post_init__(self) -> None:
        if self.programs_per_sm < 1 or self.min_split_tokens < 1 or self.max_splits < 1:
            raise ValueError(f"SplitPolicy: every field must be >= 1, got {self}")


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, policy: SplitPolicy) -> int:
    """Splits per row so that ``batch * num_kv_heads * splits`` programs fill the GPU.

    1 when the batch already gives ``programs_per_sm * num_sms`` programs; otherwise as many
    as the target asks, but no split under ``min_split_tokens`` tokens. Host-only arithmetic.
    """
    base = max(1, batch * num_kv_heads)
    want = (policy.programs_per_sm * num_sms) // base
    by_length = max(1, max_seq_len // policy.min_split_tokens)
    return max(1, min(want, by_length, policy.max_splits))


def split_length(max_seq_len: int, num_splits: int, block_n: int) -> int:
    """Tokens per split: a multiple of ``block_n`` so tiles never straddle two splits."""
    per_split = math.ceil(max(1, max_seq_len) / max(1, num_splits))
    return math.ceil(per_split / block_n) * block_n


@triton.jit
def _decode_row(decode_index_ptr, i, INDIRECT: tl.constexpr):  # type: ignore[no-untyped-def]
    """(batch row, query token) of the i-th decode row."""
    if INDIRECT:
        row = tl.load(decode_index_ptr + 2 * i)
        token = tl.load(decode_index_ptr + 2 * i + 1)
    else:
        row = i
        token = i
    return row, token


# Per-step values are not specialised on: one compiled kernel serves every step.
@triton.jit(do_not_specialize=["split_len", "num_splits", "stride_bt"])
def _decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    decode_index_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    qk_scale,
    split_len,
    num_splits,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    INDIRECT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (kv_head, split, i): tokens [split * split_len, ...) of one row, all query
    heads of one KV group. Pure decode: row i, query token i. INDIRECT (the one-token rows
    of a mixed batch): row and query token are read from decode_index[i]."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    i = tl.program_id(2)
    row, token = _decode_row(decode_index_ptr, i, INDIRECT)
    seq_len = tl.load(seq_lens_ptr + row)
    start = split * split_len
    if start >= seq_len:
        return  # a shorter row needs fewer splits; the reduce kernel skips this one
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    qo_mask = tile_mask(g_mask, d, HEAD_DIM, D_PAD)
    row64 = row.to(tl.int64)
    token64 = token.to(tl.int64)
    q = tl.load(
        q_ptr + token64 * stride_qt + heads[:, None].to(tl.int64) * stride_qh + d[None, :],
        mask=qo_mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table_row = block_tables_ptr + row64 * stride_bt
    head_off = kvh * HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    pages = load_tile_pages(table_row, start, offs_n, end, BLOCK_SIZE, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n_mask = (n0 + offs_n) < end
        tok = tile_token_offsets(pages, n0, offs_n, BLOCK_SIZE, BLOCK_N, NUM_KV_HEADS * HEAD_DIM)
        pages = load_tile_pages(table_row, n0 + BLOCK_N, offs_n, end, BLOCK_SIZE, BLOCK_N)
        kv_off = tok[:, None] + head_off + d[None, :]
        kv_mask = tile_mask(n_mask, d, HEAD_DIM, D_PAD)
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_i, l_i, acc = online_softmax_update(qk, v, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    # Every program that got here saw >= 1 token, so l_i > 0 on every real head.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if DIRECT:
        tl.store(
            out_ptr + token64 * stride_ot + heads[:, None].to(tl.int64) * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=qo_mask,
        )
    else:
        # part_o: fp32 [batch, NUM_HEADS, num_splits, HEAD_DIM];
        # part_lse: fp32 [batch, NUM_HEADS, num_splits], log2 domain.
        part = (i.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=qo_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_safe), mask=g_mask)


@triton.jit(do_not_specialize=["split_len", "num_splits"])
def _combine_splits_kernel(  # type: ignore[no-untyped-def]
    part_o_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    decode_index_ptr,
    out_ptr,
    split_len,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    INDIRECT: tl.constexpr,
):
    """Program (head, i): out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse),
    over the splits the i-th decode row actually used (ceil(seq_len / split_len) of them)."""
    h = tl.program_id(0)
    i = tl.program_id(1)
    row, token = _decode_row(decode_index_ptr, i, INDIRECT)
    seq_len = tl.load(seq_lens_ptr + row)
    used = tl.cdiv(seq_len, split_len)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < used
    part = (i.to(tl.int64) * NUM_HEADS + h) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # masked splits: 2^-inf = 0
    o_mask = tile_mask(s_mask, d, HEAD_DIM, D_PAD)
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=o_mask, other=0.0)
    result = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    dst = out_ptr + token.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh + d
    tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_seq_len: int,
    softmax_scale: float,
    out: torch.Tensor,
    num_splits: int,
    config: DecodeConfig,
    decode_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention; writes and returns ``out``.

    query:        [num_tokens, num_heads, head_dim]; row i's single new token is query row i,
                  or, with ``decode_index``, the token it names.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
    block_tables: int32 [batch, max_blocks]; seq_lens: int32 [batch] (K/V tokens per row,
                  the new one included; >= 1). ``max_seq_len``: host-side maximum over the
                  rows attended.
    out:          [>= batch, num_heads, head_dim], query's dtype, last dim contiguous.
    num_splits:   requested splits per row (rounded so each is a whole number of tiles).
    decode_index: optional int32 [n, 2] of (batch row, query token): attend only these
                  one-token rows (the decode rows of a mixed batch); other rows of ``out``
                  are left untouched.
    Arguments are assumed checked by the caller; nothing here reads device data on the host.
    """
    indirect = decode_index is not None
    batch = decode_index.shape[0] if decode_index is not None else block_tables.shape[0]
    if batch == 0:
        return out
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    d_pad = next_power_of_2(max(head_dim, 16))
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache/v_cache: the decode kernel needs contiguous caches")
    if query.stride(-1) != 1:
        query = query.contiguous()
    split_len = split_length(max_seq_len, num_splits, config.block_n)
    splits = triton.cdiv(max(1, max_seq_len), split_len)
    direct = splits == 1
    if direct:
        part_o = part_lse = out  # unused placeholders (DIRECT is a compile-time branch)
    else:
        f32, device = torch.float32, out.device
        part_o = torch.empty((batch, num_heads, splits, head_dim), dtype=f32, device=device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=f32, device=device)
    _decode_kernel[(kv_heads, splits, batch)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        decode_index if decode_index is not None else seq_lens,  # unused when not INDIRECT
        out,
        part_o,
        part_lse,
        softmax_scale * _LOG2E,
        split_len,
        splits,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        DIRECT=direct,
        INDIRECT=indirect,
        UPCAST=upcast_for(query.dtype),
        DOT_PRECISION=dot_precision_for(query.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not direct:
        _combine_splits_kernel[(num_heads, batch)](
            part_o,
            part_lse,
            seq_lens,
            decode_index if decode_index is not None else seq_lens,
            out,
            split_len,
            splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            SPLITS_PAD=max(2, next_power_of_2(splits)),
            INDIRECT=indirect,
            num_warps=config.reduce_num_warps,
        )
    return out
