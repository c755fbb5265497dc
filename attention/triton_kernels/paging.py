"""Helpers shared by the paged-attention kernels: how a token's K/V is found through the block
table, one online-softmax step, and the host-side facts every launcher needs.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (an 8-bit V:
token-major, :mod:`attention.value_layout`). Token ``t`` of a row lives in block
``table[row, t // block_size]`` at offset ``t % block_size``. Every address
is formed in int64 because one layer's cache can exceed 2**31 elements.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attention.dtypes import dtype_info

__all__ = [
    "INTERPRETED",
    "cache_block_stride",
    "dot_precision_for",
    "f16_dots_for",
    "finite_e4m3_operand",
    "finite_operand",
    "in_block_positions",
    "int8_values",
    "interpreter_requested",
    "kernels_interpreted",
    "load_tile_pages",
    "next_power_of_2",
    "online_softmax_update",
    "soft_cap",
    "tile_columns",
    "tile_mask",
    "tile_token_offsets",
    "to_f16_operand",
    "token_major_offsets",
    "token_scale_offsets",
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
    """``tl.dot`` input precision. fp32 caches get "tf32x3": three tensor-core tf32 products
    recover ~fp32 accuracy, where plain tf32 would cut inputs to 10 mantissa bits and "ieee"
    runs on FMA units and spills registers in the prefill tiles. 16-bit inputs ignore it."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def f16_dots_for(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the decode kernels (GQA and MLA) run an fp8 cache's dots in fp16: 16-bit queries.

    On sm_89 and later a pair of float8_e4m3 values becomes fp16 in one instruction
    (``cvt.rn.f16x2.e4m3x2``); the conversion to bf16 takes a longer route. In decode, which
    streams K/V at the HBM limit, those conversions set the time: on the H200
    (benchmarks/results/decode-fp8-2026-12-03.json) an fp8 cache decoded 0.92-1.05x the bf16
    cache's speed with bf16 dots and 1.32-1.55x with fp16 dots at block 256 (64x4096 to
    LogNormal). Prefill, compute-bound, keeps the query's dtype: there fp16 dots were 12-16%
    slower at block 32 and 1-2% slower at block 256 (prefill-fp8-2026-12-03.json).

    fp16 holds every float8_e4m3 / e5m2 value exactly and every bf16 query value of magnitude
    in [2**-14, 65504] exactly (more mantissa than bf16); queries beyond 65504 are clamped to
    it. The scores and the output still accumulate in fp32, and p = exp2(s - m) in [0, 1] is
    rounded to fp16 (finer than bf16) for the P @ V product.
    """
    return cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and query_dtype in (torch.bfloat16, torch.float16)


@triton.jit
def to_f16_operand(x):  # type: ignore[no-untyped-def]
    """``x`` as an fp16 dot operand, clamped to fp16's finite range (see :func:`f16_dots_for`)."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


#: Whether the kernels run in Triton's CPU interpreter, as a compile-time constant.
INTERPRETED: tl.constexpr = tl.constexpr(_INTERPRETED_AT_IMPORT)


@triton.jit
def int8_values(x, query_dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """An int8 cache's V tile as the P @ V operand (exact: |v| <= 127). bf16 for 16-bit
    queries: P is multiplied by the per-token V scales before the product, and bf16 keeps
    fp32's range where fp16 would flush the products of small scales (1e-6 for a V of
    magnitude 1e-4) into its subnormals; bf16 also holds P to the 8 bits int8 V has. fp32 for
    fp32 queries, and under the interpreter (whose bf16 dots are wrong)."""
    if query_dtype == tl.float32 or INTERPRETED:  # noqa: SIM108 (a compile-time branch)
        x = x.to(tl.float32)
    else:
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def finite_operand(x):  # type: ignore[no-untyped-def]
    """``x`` with every NaN and infinity made finite, finite values unchanged. For a value
    tile read unmasked, whose slots past a row's end may hold any bits: a probability of 0
    times NaN would still be NaN.

    fp16 (the operand of an fp8 cache, or an fp16 cache's): clamped to +-65504 by packed min
    and max, which return the non-NaN operand, so NaN becomes -65504 and infinities +-65504.
    Two instructions per pair of values where the select below takes six (a compare, a
    select per half, byte permutes); in fp8 decode the select was 22% of the loop's
    instructions, and with the same launch the clamp decoded 1.10-1.21x faster on KV-bound
    shapes, but for 64x4096 at block 256 (0.94x, a wave effect: ``decode.default_decode_config``)
    (benchmarks/results/decode-fp8-clamp-2026-12-04.json, run 4). Other dtypes: replaced by 0, a
    select (Triton 3.6 compiled a bf16 clamp to the finite range inexactly on the H200,
    1.6e-3 relative error in prefill)."""
    if x.dtype == tl.float16:
        big = tl.full([], 65504.0, tl.float16)  # a float literal would promote the clamp to fp32
        return tl.minimum(tl.maximum(x, -big), big)
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def finite_e4m3_operand(x):  # type: ignore[no-untyped-def]
    """``x``, an fp16 tile converted from float8_e4m3fn, with NaN made finite (65504) and every
    other value unchanged: one packed min per pair of values, half :func:`finite_operand`'s.

    float8_e4m3fn has no infinities and its finite values lie within +-448, so NaN (bytes
    0x7F / 0xFF) is the only value to fix, and ``min(x, 65504)`` returns 65504 for it (min
    returns the non-NaN operand) and ``x`` for everything else. In the fp8 decode loop that
    is 64 instructions a 128-token tile fewer (sm_90, Triton 3.6: 893 -> 833 at block 32,
    955 -> 891 at block 256) and 1-3% faster at block 256 on the H200
    (benchmarks/results/decode-fp8-min-2026-12-04.md). Under the interpreter the fp8 -> fp16
    conversion reads the NaN bytes as +-480, which stay."""
    big = tl.full([], 65504.0, tl.float16)  # a float literal would promote the min to fp32
    return tl.minimum(x, big)


@triton.jit
def soft_cap(s, cap):  # type: ignore[no-untyped-def]
    """``cap * tanh(s / cap)`` in float32 (tanh as ``2 * sigmoid(2x) - 1``, which saturates
    to +-1 instead of overflowing)."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def tile_columns(n0, offs_n, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """Block-table columns (int32 [BLOCK_N]) of tokens ``n0 + offs_n``, for a tile that spans
    blocks (BLOCK_SIZE not a multiple of BLOCK_N); ``n0`` >= 0 is a multiple of BLOCK_N.

    When the tile holds whole blocks (BLOCK_N a multiple of BLOCK_SIZE), ``n0`` is a multiple
    of BLOCK_SIZE too, so a lane's column is one scalar per tile plus a loop-invariant lane
    term: no per-lane division in the loop (a signed ``//`` costs three instructions a lane).
    """
    if BLOCK_N % BLOCK_SIZE == 0:  # noqa: SIM108 (a compile-time branch)
        col = n0 // BLOCK_SIZE + offs_n // BLOCK_SIZE
    else:
        col = (n0 + offs_n) // BLOCK_SIZE
    return col


@triton.jit
def in_block_positions(n0, offs_n, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """Positions within their blocks (int32 [BLOCK_N]) of tokens ``n0 + offs_n``; ``n0`` >= 0
    is a multiple of BLOCK_N.

    A tile inside one block: ``n0 % BLOCK_SIZE + offs_n``. A tile of whole blocks (BLOCK_N a
    multiple of BLOCK_SIZE: block 32 under 64- or 128-token tiles): ``offs_n % BLOCK_SIZE``,
    the same for every tile, so the compiler keeps it out of the loop and each token's address
    costs a multiply-add on its block id. Compiled for sm_90 (Triton 3.6), the decode loop at
    block 32 went from 963 to 893 instructions a tile (fp8) and from 570 to 479 (bf16); on the
    H200 fp8 decode at block 32 ran 1.01-1.06x faster on every benchmark shape but 64x4096
    (0.98x) and bf16 1.00-1.03x (benchmarks/results/decode-block32-variants-2026-12-04.json,
    run 5). Otherwise ``(n0 + offs_n) % BLOCK_SIZE``.
    """
    if BLOCK_SIZE % BLOCK_N == 0:
        pos = (n0 % BLOCK_SIZE) + offs_n
    elif BLOCK_N % BLOCK_SIZE == 0:
        pos = offs_n % BLOCK_SIZE
    else:
        pos = (n0 + offs_n) % BLOCK_SIZE
    return pos


@triton.jit
def load_tile_pages(  # type: ignore[no-untyped-def]
    table_row_ptr, n0, offs_n, limit, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Block ids (int64) of the tile of tokens ``n0 + offs_n`` of one row, where ``limit``
    (> 0) is the number of the row's tokens the caller attends; ``n0`` is a multiple of
    BLOCK_N.

    Tile inside one block (BLOCK_SIZE a multiple of BLOCK_N): a single id, of the block
    holding token ``min(n0, limit - 1)``. The clamp lets a loop prefetch the next tile's id
    unconditionally: one tile past the end it rereads the last real entry, never a PAD_BLOCK
    or the next row. Otherwise: one id per token, and lanes at or past ``limit`` read nothing
    (id 0, their K/V loads are masked off), so padded entries are never dereferenced.

    Loops read the ids of tile i+1 while tile i is in use: with the id loop-carried instead
    of loaded right before its K/V, Triton's pipeliner multi-buffers the K/V copies (it
    single-buffers a load whose address comes from a load in the same iteration).
    """
    if BLOCK_SIZE % BLOCK_N == 0:
        # Clamped at column 0 too: a corrupt (empty or negative) limit must not read before the row.
        pages = tl.load(table_row_ptr + tl.maximum(tl.minimum(n0, limit - 1), 0) // BLOCK_SIZE).to(tl.int64)
    else:
        n = n0 + offs_n
        col = tile_columns(n0, offs_n, BLOCK_SIZE, BLOCK_N)
        pages = tl.load(table_row_ptr + col, mask=n < limit, other=0).to(tl.int64)
    return pages


@triton.jit
def tile_token_offsets(  # type: ignore[no-untyped-def]
    pages,
    n0,
    offs_n,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr,
):
    """int64 [BLOCK_N] element offsets, in a cache whose tokens are TOKEN_STRIDE (= kv_heads
    * head_dim) elements apart within a block and whose blocks are BLOCK_STRIDE elements
    apart (``block_size * TOKEN_STRIDE``, or more for an int8 cache, whose blocks also hold
    their scales: :func:`cache_block_stride`), of tokens ``n0 + offs_n`` given their block ids
    from :func:`load_tile_pages`.

    The strides are compile-time constants, so the compiler knows every token row starts on
    a multiple of 8 elements (head_dim is a multiple of 8) and keeps 16-byte accesses.
    """
    return pages * BLOCK_STRIDE + in_block_positions(n0, offs_n, BLOCK_SIZE, BLOCK_N) * TOKEN_STRIDE


@triton.jit
def token_major_offsets(  # type: ignore[no-untyped-def]
    pages,
    n0,
    offs_n,
    rows,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr,
):
    """int64 [R, BLOCK_N] element offsets of rows ``rows`` (kv_head * head_dim + d, int32 [R])
    of tokens ``n0 + offs_n`` in a token-major V cache (:mod:`attention.value_layout`: each
    block ``[kv_heads, head_dim, BLOCK_SIZE]``, blocks BLOCK_STRIDE elements apart, see
    :func:`tile_token_offsets`), given the tokens' block ids from :func:`load_tile_pages`.

    Tokens are contiguous within a block. The compiler is told so, to keep 16-byte loads: a
    tile inside one block is one run of BLOCK_N tokens starting on a multiple of BLOCK_N;
    otherwise the tile is cut into runs of ``run`` tokens, the largest power of two dividing
    BLOCK_SIZE (below BLOCK_N), each starting on a multiple of ``run`` (block boundaries fall
    on multiples of BLOCK_SIZE, and tiles start on multiples of BLOCK_N).
    """
    tok = pages * BLOCK_STRIDE + in_block_positions(n0, offs_n, BLOCK_SIZE, BLOCK_N)
    off = rows.to(tl.int64)[:, None] * BLOCK_SIZE + tok[None, :]
    if BLOCK_SIZE % BLOCK_N == 0:
        off = tl.max_contiguous(tl.multiple_of(off, [1, BLOCK_N]), [1, BLOCK_N])
    else:
        run: tl.constexpr = BLOCK_SIZE & -BLOCK_SIZE  # a constexpr, < BLOCK_N here (BLOCK_N is a power of two)
        off = tl.max_contiguous(tl.multiple_of(off, [1, run]), [1, run])
    return off


@triton.jit
def token_scale_offsets(  # type: ignore[no-untyped-def]
    pages,
    n0,
    offs_n,
    kv_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr,
):
    """int64 [BLOCK_N] offsets, in fp16 elements from ``LayerCache.k_scale`` / ``v_scale``'s
    first element, of KV head ``kv_head``'s per-token scales of tokens ``n0 + offs_n`` in an
    int8 cache (:mod:`attention.token_scales`: each block's scales ``[kv_heads, BLOCK_SIZE]``
    right after its values, blocks BLOCK_STRIDE bytes apart), given the tokens' block ids from
    :func:`load_tile_pages`. One head's scales of one block are contiguous, so a tile inside
    one block reads its scales in one vector load."""
    base = pages * (BLOCK_STRIDE // 2) + kv_head * BLOCK_SIZE
    return base + in_block_positions(n0, offs_n, BLOCK_SIZE, BLOCK_N)


def cache_block_stride(cache: torch.Tensor) -> int:
    """Elements from one block of a ``[num_blocks, block_size, kv_heads, head_dim]`` K or V
    cache to the next, from its shape and dtype (not its strides, which a one-block tensor
    leaves free): ``block_size * kv_heads * head_dim``, or for an int8 cache the rows that
    also hold the block's scales (:func:`attention.dtypes.DtypeInfo.rows_per_block`)."""
    _, block_size, kv_heads, head_dim = cache.shape
    if cache.dtype == torch.int8:
        return dtype_info("int8").rows_per_block(block_size, head_dim) * kv_heads * head_dim
    return block_size * kv_heads * head_dim


@triton.jit
def tile_mask(  # type: ignore[no-untyped-def]
    row_mask, d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr
):
    """Mask of an [R, D_PAD] tile: rows where ``row_mask`` holds, and the head_dim lanes below
    HEAD_DIM. When HEAD_DIM is a power of two the column test is left out altogether;
    otherwise the compiler is told it is constant over runs of 8 lanes (HEAD_DIM is a
    multiple of 8), so loads stay 16-byte vectors either way."""
    mask = row_mask[:, None]
    if HEAD_DIM != D_PAD:
        mask = mask & tl.max_constancy(d < HEAD_DIM, 8)[None, :]
    return mask


@triton.jit
def online_softmax_update(  # type: ignore[no-untyped-def]
    qk, v, m_i, l_i, acc, qk_scale, v_cols, DOT_PRECISION: tl.constexpr, V_COLS: tl.constexpr
):
    """Fold one key tile into the running softmax state (FlashAttention-2 recurrence).

    qk:  fp32 [M, N] raw scores q.k (masked entries already -inf; every row has at least
         one finite entry in the first tile it sees, so the running max is never -inf twice).
    v:   [N, D] values (masked tokens loaded as 0).
    m_i: fp32 [M] running max of ``qk * qk_scale`` (log2 domain); l_i: fp32 [M] running sum;
    acc: fp32 [M, D] unnormalised output. ``qk_scale`` = softmax_scale * log2(e), so exp2
    replaces exp and the scale folds into one multiply-add per score.
    V_COLS (an int8 cache): ``v_cols`` fp32 [N] holds each key's V scale (0 for keys not
    seen), and P's columns are multiplied by it before P meets the int8 values; otherwise
    ``v_cols`` is unused.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_COLS:
        p = p * v_cols[None, :]
    # The rescaled output is the MMA's accumulator input, so the product adds in place.
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc
