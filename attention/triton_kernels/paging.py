"""Helpers shared by the paged-attention kernels: how a token's K/V is found through the block
table, one online-softmax step, and the host-side facts every launcher needs.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a
row lives in block ``table[row, t // block_size]`` at offset ``t % block_size``. Every address
is formed in int64 because one layer's cache can exceed 2**31 elements.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = [
    "dot_precision_for",
    "interpreter_requested",
    "kernels_interpreted",
    "kv_token_offsets",
    "next_power_of_2",
    "online_softmax_update",
    "tile_mask",
    "upcast_for",
]

_TRUTHY = frozenset({"1", "true", "on", "yes"})


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the CPU interpreter *now*."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUTHY


# Triton picks interpreter or compiler when a kernel is decorated, i.e. when the kernel
# modules are imported (they import this module first), so this records what they got.
_INTERPRETED_AT_IMPORT = interpreter_requested()


def kernels_interpreted() -> bool:
    """Whether the kernels in this package were decorated for the CPU interpreter."""
    return _INTERPRETED_AT_IMPORT


def upcast_for(dtype: torch.dtype) -> bool:
    """Whether kernels must convert loaded values to float32 before any arithmetic.

    Only bf16 under the interpreter: it holds bf16 as raw 16-bit integers, so bf16 math and
    ``tl.dot`` on it are wrong there. On the GPU, 16-bit operands feed the tensor cores as
    they are (fp32 accumulation), which is both faster and what the tests check.
    """
    return _INTERPRETED_AT_IMPORT and dtype == torch.bfloat16


def dot_precision_for(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 ("ieee") for fp32 caches, since the default
    tf32 would cut fp32 inputs to 10 mantissa bits; 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def kv_token_offsets(  # type: ignore[no-untyped-def]
    table_row_ptr,
    n0,
    offs_n,
    n_mask,
    stride_kb,
    stride_kt,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """int64 [BLOCK_N] element offsets of tokens ``n0 + offs_n`` of one row in the cache.

    ``n0`` is a multiple of BLOCK_N. When BLOCK_SIZE is a multiple of BLOCK_N the whole tile
    sits in one block: one table entry is read and the tile's tokens are contiguous. Otherwise
    each token reads its own entry; lanes outside ``n_mask`` (past the row's length) never
    read the table, so PAD_BLOCK entries are never dereferenced. MASKED=False promises every
    lane is inside the row.
    """
    if BLOCK_SIZE % BLOCK_N == 0:
        # n0 < row length, so this entry is a real block.
        page = tl.load(table_row_ptr + n0 // BLOCK_SIZE).to(tl.int64)
        offsets = page * stride_kb + ((n0 % BLOCK_SIZE) + offs_n).to(tl.int64) * stride_kt
    else:
        n = n0 + offs_n
        if MASKED:
            pages = tl.load(table_row_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
        else:
            pages = tl.load(table_row_ptr + n // BLOCK_SIZE)
        offsets = pages.to(tl.int64) * stride_kb + (n % BLOCK_SIZE).to(tl.int64) * stride_kt
    return offsets


@triton.jit
def tile_mask(  # type: ignore[no-untyped-def]
    row_mask, d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr
):
    """Mask of an [R, D_PAD] tile: rows where ``row_mask`` holds, and the head_dim lanes below
    HEAD_DIM. When HEAD_DIM is a power of two the column test is left out altogether, so
    the mask is constant along head_dim and loads stay 16-byte vectors."""
    mask = row_mask[:, None]
    if HEAD_DIM != D_PAD:
        mask = mask & (d[None, :] < HEAD_DIM)
    return mask


@triton.jit
def online_softmax_update(  # type: ignore[no-untyped-def]
    qk, v, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr
):
    """Fold one key tile into the running softmax state (FlashAttention-2 recurrence).

    qk:  fp32 [M, N] raw scores q.k (masked entries already -inf; every row has at least
         one finite entry in the first tile it sees, so the running max is never -inf twice).
    v:   [N, D] values (masked tokens loaded as 0).
    m_i: fp32 [M] running max of ``qk * qk_scale`` (log2 domain); l_i: fp32 [M] running sum;
    acc: fp32 [M, D] unnormalised output. ``qk_scale`` = softmax_scale * log2(e), so exp2
    replaces exp and the scale folds into one multiply-add per score.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # The rescaled output is the MMA's accumulator input, so the product adds in place.
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc
