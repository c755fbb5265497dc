"""Prefill / extend: varlen causal attention over paged K/V (FlashAttention-2 style).

Rows bring many new tokens (a prompt, or a chunk of one after cached tokens); the kernel
also takes one-token rows, but the backend sends those to the decode kernel, which reads each
K/V token once per KV head instead of once per query head and wastes no tile rows.
New token i of a row with seq_len s and query_len q sits at position s - q + i and sees
keys 0 .. s - q + i.

Grid: one program per (query tile of BLOCK_M tokens of one row, query head). Which (row,
tile) a program takes comes from a small index built on the host from host-side lengths
(:func:`prefill_tile_index`, once per step), ordered heaviest tile first so the longest
programs start early and the tail of the launch stays short. Within a program the key tiles
left of the diagonal run without any mask; only the last one or two tiles (those crossing
the diagonal) apply the causal mask; tiles right of it are never visited.

For a CUDA graph the grid must not depend on the step's lengths: the index is padded to
:func:`max_prefill_tiles` entries for the bucket's rows and tokens, its real length is staged
beside it, and a fixed number of persistent programs walk the real entries (``PERSISTENT``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention.token_scales import layout_problem
from attention.triton_kernels.paging import (
    cache_block_stride,
    dot_precision_for,
    finite_operand,
    int8_values,
    load_tile_pages,
    next_power_of_2,
    online_softmax_update,
    soft_cap,
    tile_mask,
    tile_token_offsets,
    token_major_offsets,
    token_scale_offsets,
    upcast_for,
)
from attention.value_layout import is_token_major, value_is_readable

__all__ = [
    "PAD_TILE",
    "PREFILL_SWEEP",
    "PrefillConfig",
    "default_prefill_config",
    "max_prefill_tiles",
    "paged_prefill",
    "prefill_tile_index",
]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel (benchmarks sweep them).

    block_m: query tokens per program; block_n: key tokens per inner step (powers of two,
    >= 16); num_warps, num_stages: as in Triton.
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"PrefillConfig.{name}: {v} must be a power of two >= 16")


#: Candidates a GPU sweep times (benchmarks/bench_prefill.py --sweep), for 16-bit head_dim
#: up to 128; each compiles for sm_90 (Triton 3.6 and 3.9) without register spills.
PREFILL_SWEEP: tuple[PrefillConfig, ...] = tuple(
    PrefillConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
    for bm, bn, w, s in (
        (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2),
        (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 128, 8, 3),
        # One warpgroup for a 128-row tile (a stripped kernel ran fastest so on the H200,
        # benchmarks/results/prefill-ceiling-2026-12-04.md); in this kernel 128 x 64 with 3 or
        # 4 stages ran 1.4-1.8x slower than the default and is left out (prefill-sweep-2026-12-04).
        (128, 64, 4, 2), (128, 32, 4, 3),
    )
)  # fmt: skip


@functools.cache  # called on every layer call: keep it off the host's launch path
def default_prefill_config(
    head_dim: int, dtype: torch.dtype, max_query_len: int | None = None, block_size: int | None = None
) -> PrefillConfig:
    """Hopper defaults: the Q tile plus ``num_stages`` K and V tiles fit in shared memory
    (228 KiB per SM) and the accumulators in registers. Checked by compiling for sm_90: the
    16-bit configurations run on warpgroup MMA with 16-byte async copies and no register
    spills; fp32 ("tf32x3" products need about three times the registers) keeps tiles small
    and still spills a little at head_dim 128 and 256 -- it is the accuracy path, not the
    fast one.

    Blocks of fewer than 128 tokens (``block_size``) take key tiles of 32 with one warpgroup
    (128 x 32, 4 warps): a tile then lies in one block (one table entry, contiguous rows). The
    backend passes no ``block_size`` for an fp8 cache, which measured slower so.

    With ``max_query_len`` (the longest row this step) below the tile height, the tile
    shrinks to it (>= 16): short extend rows would otherwise compute mostly masked rows.
    """
    d_pad = next_power_of_2(max(head_dim, 16))
    if dtype == torch.float32:
        block_m, block_n = {64: (64, 32), 128: (64, 16)}.get(max(d_pad, 64), (16, 16))
        config = PrefillConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)
    elif d_pad <= 128:
        # 128 x 128 tiles: fastest of the sweep at 4 of 6 shapes on the H200 (bf16, d=128), up
        # to 1.14x over 128 x 64 (benchmarks/results/attention-sweep-2026-12-02.json).
        config = PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
        if block_size is not None and block_size < 128:
            # 1.04-1.26x over 128 x 128 at block 32 on the H200 (bf16, d=128: 8x4096, 32x1024,
            # 2x16384; benchmarks/results/prefill-sweep-2026-12-04.json).
            config = PrefillConfig(block_m=128, block_n=32, num_warps=4, num_stages=3)
    else:
        config = PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
    if max_query_len is not None and max_query_len < config.block_m:
        block_m = max(16, next_power_of_2(max_query_len))
        # Fewer than 64 rows cannot feed Hopper's warpgroup MMA; 4 warps suffice then.
        warps = config.num_warps if block_m >= 64 else 4
        config = PrefillConfig(block_m, config.block_n, warps, config.num_stages)
    return config


def prefill_tile_index(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_m: int,
    rows: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """``(row, tile)`` for every query tile of BLOCK_M tokens of ``rows`` (default: all),
    heaviest first (host only). A tile's work is the number of keys its last token sees;
    ties keep row order.
    """
    tiles: list[tuple[int, int, int]] = []
    for row in range(len(seq_lens)) if rows is None else rows:
        s, q = seq_lens[row], query_lens[row]
        for tile in range(-(-q // block_m)):
            keys = s - q + min((tile + 1) * block_m, q)
            tiles.append((-keys, row, tile))
    tiles.sort()
    return [(row, tile) for _, row, tile in tiles]


#: Filler of a padded tile index: row -1 computes nothing.
PAD_TILE = (-1, 0)


def max_prefill_tiles(rows: int, tokens: int, block_m: int) -> int:
    """The most (row, tile) entries a step of at most ``rows`` rows and ``tokens`` new
    tokens can have among its prefill rows (rows of >= 2 tokens; at most ``tokens // 2`` of
    them): every such row adds at most one partial tile to ``tokens / block_m`` full ones."""
    return -(-tokens // block_m) + min(rows, tokens // 2)


@triton.jit
def _pages_in_cache(  # type: ignore[no-untyped-def]
    table_row_ptr, n0, offs_n, limit, num_blocks, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """:func:`load_tile_pages`, with any id outside [0, num_blocks) replaced by block 0, so a
    corrupt block table can never send a load outside the cache (the row's output is garbage;
    the device metadata check reports it)."""
    pages = load_tile_pages(table_row_ptr, n0, offs_n, limit, BLOCK_SIZE, BLOCK_N)
    return tl.where((pages >= 0) & (pages < num_blocks), pages, 0)


@triton.jit
def _to_compute(  # type: ignore[no-untyped-def]
    x, scale, DEQUANT: tl.constexpr, UPCAST: tl.constexpr, dtype: tl.constexpr, TOKEN_SCALES: tl.constexpr
):
    """A loaded K/V tile in the dtype the dots take: an fp8 tile times its KV head's scale;
    an int8 tile converted as it is (exact: |v| <= 127; its per-token scales apply to the
    scores and to P); float32 under the interpreter's bf16 workaround (UPCAST, then ``dtype``
    is float32); else as loaded."""
    if DEQUANT:
        x = (x.to(tl.float32) * scale).to(dtype)
    elif UPCAST or TOKEN_SCALES:
        x = x.to(dtype)
    return x


@triton.jit
def _to_values(  # type: ignore[no-untyped-def]
    x, scale, DEQUANT: tl.constexpr, UPCAST: tl.constexpr, dtype: tl.constexpr, TOKEN_SCALES: tl.constexpr
):
    """A loaded V tile as the P @ V operand: as :func:`_to_compute`, except an int8 tile, which
    becomes bf16 for 16-bit queries (``paging.int8_values``: P times the V scales needs bf16's
    range)."""
    # One return (see _unmasked_token_major_values).
    if TOKEN_SCALES:  # noqa: SIM108 (a compile-time branch)
        x = int8_values(x, dtype)
    else:
        x = _to_compute(x, scale, DEQUANT, UPCAST, dtype, TOKEN_SCALES)
    return x


@triton.jit
def _token_scales(  # type: ignore[no-untyped-def]
    k_scale_ptr, v_scale_ptr, pages, n0, offs_n, kv_head, mask, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """An int8 cache's fp16 per-token K and V scales of KV head ``kv_head`` for tokens ``n0 +
    offs_n`` (fp32 [BLOCK_N] each). MASKED: read only where ``mask`` holds (0 elsewhere), so
    the stale (NaN) scales of slots never written are never read."""
    off = token_scale_offsets(pages, n0, offs_n, kv_head, BLOCK_SIZE, BLOCK_N, BLOCK_STRIDE)
    if MASKED:
        ks = tl.load(k_scale_ptr + off, mask=mask, other=0.0)
        vs = tl.load(v_scale_ptr + off, mask=mask, other=0.0)
    else:
        ks = tl.load(k_scale_ptr + off)
        vs = tl.load(v_scale_ptr + off)
    return ks.to(tl.float32), vs.to(tl.float32)


@triton.jit
def _unmasked_token_major_values(  # type: ignore[no-untyped-def]
    v_cache_ptr,
    vt_off,
    d,
    scale,
    dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    DEQUANT: tl.constexpr,
    UPCAST: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
):
    """A token-major V tile (offsets ``vt_off`` [D_PAD, BLOCK_N] from ``token_major_offsets``)
    as the [BLOCK_N, D_PAD] dot operand, for tiles that may reach past a row's end.

    Loaded unmasked along the tokens (a per-token mask would split the 16-byte loads into
    bytes): every block id is inside the cache, and the past-the-end slots' bits, made finite
    (``finite_operand``), meet p = 0. (int8 values are always finite: no select.)"""
    if HEAD_DIM == D_PAD:
        vt = tl.load(v_cache_ptr + vt_off)
    else:
        vt = tl.load(v_cache_ptr + vt_off, mask=(d < HEAD_DIM)[:, None], other=0.0)
    # One return: Triton 3.6 types every return statement it reaches, and a compile-time
    # branch's early return does not stop it reaching the next one.
    if TOKEN_SCALES:  # int8 is finite: past the row's end p * 0 = 0
        vt = int8_values(vt, dtype)
    else:
        vt = finite_operand(_to_compute(vt, scale, DEQUANT, UPCAST, dtype, TOKEN_SCALES))
    return tl.trans(vt)


@triton.jit
def _masked_softmax_update(  # type: ignore[no-untyped-def]
    qk, v, m_i, l_i, acc, qk_scale, v_cols, DOT_PRECISION: tl.constexpr, V_COLS: tl.constexpr
):
    """:func:`online_softmax_update` for tiles where a row may see no key at all (the left
    edge of a sliding window): a row whose running max is still -inf contributes nothing
    instead of NaN. V_COLS: P's columns times ``v_cols`` (an int8 cache's V scales)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_COLS:
        p = p * v_cols[None, :]
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# The block-table width changes every step: do not compile a variant per width.
@triton.jit(do_not_specialize=["stride_bt", "window", "num_blocks", "num_tokens", "table_width", "max_tiles"])
def _prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_index_ptr,
    tile_count_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    qk_scale,
    softcap,
    window,
    num_blocks,
    num_tokens,
    table_width,
    max_tiles,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DEQUANT: tl.constexpr,
    PERSISTENT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
):
    """One work item is (tile-index entry, query head). Without PERSISTENT, program ``pid``
    takes item ``pid`` (the grid is the step's tiles x heads). With PERSISTENT (a fixed grid,
    for CUDA graphs), program ``pid`` takes items ``pid, pid + grid, ...`` below the step's
    ``tile_count[0] x NUM_HEADS`` (read on the device), so the grid can be sized for the
    largest step of a bucket and the programs of a smaller one exit at once."""
    if PERSISTENT:
        # The count comes from the step's plan; entries past the index are never read.
        work = tl.minimum(tl.maximum(tl.load(tile_count_ptr), 0), max_tiles) * NUM_HEADS
        for item in range(tl.program_id(0), work, tl.num_programs(0)):
            _prefill_item(
                item, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                tile_index_ptr, out_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, qk_scale, softcap, window, num_blocks,
                num_tokens, table_width, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh, NUM_HEADS,
                NUM_KV_HEADS, GROUP, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, UPCAST, DOT_PRECISION, HAS_WINDOW,
                DEQUANT, SOFTCAP, SINKS, V_TOKEN_MAJOR, BLOCK_STRIDE, TOKEN_SCALES,
            )  # fmt: skip
    else:
        _prefill_item(
            tl.program_id(0), q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
            query_start_loc_ptr, tile_index_ptr, out_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, qk_scale, softcap,
            window, num_blocks, num_tokens, table_width, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
            NUM_HEADS, NUM_KV_HEADS, GROUP, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, UPCAST, DOT_PRECISION,
            HAS_WINDOW, DEQUANT, SOFTCAP, SINKS, V_TOKEN_MAJOR, BLOCK_STRIDE, TOKEN_SCALES,
        )  # fmt: skip


@triton.jit
def _prefill_item(  # type: ignore[no-untyped-def]
    item,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_index_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    qk_scale,
    softcap,
    window,
    num_blocks,
    num_tokens,
    table_width,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DEQUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
):
    """Item (head, tile): heads vary fastest so the query heads of one KV group run side
    by side and share each K/V tile through L2. With HAS_WINDOW, a query at position p sees
    keys p - window < k <= p, and key tiles wholly left of every query's window are skipped.
    A tile-index entry with row -1 (padding of a fixed grid) computes and writes nothing.
    SOFTCAP: raw scores are capped before the masks, ``softcap * tanh(qk / softcap)``, with
    ``softcap`` the cap divided by the softmax scale (the scale applies after). SINKS: the
    head's sink logit ``sinks[h]`` joins the denominator at the end. V_TOKEN_MAJOR: the V
    cache is token-major (:mod:`attention.value_layout`) and V tiles load as [D_PAD, BLOCK_N].
    Blocks of K and V are BLOCK_STRIDE elements apart. TOKEN_SCALES (an int8 cache,
    :mod:`attention.token_scales`): ``k_scale_ptr`` / ``v_scale_ptr`` are the fp16 per-token
    scales; the raw scores are multiplied by the keys' K scales (before the cap), P's columns
    by their V scales, each read per tile as a [BLOCK_N] vector (masked where a tile may reach
    past the row's end or below the window: stale NaN scales are never read)."""
    h = item % NUM_HEADS
    entry = tile_index_ptr + 2 * (item // NUM_HEADS)  # < 2**31: the index is sized by tokens
    row = tl.load(entry)
    tile = tl.load(entry + 1)
    live = row >= 0
    row = tl.maximum(row, 0)
    q_start = tl.load(query_start_loc_ptr + row)
    # Clamped so that no metadata can index outside the block table or overflow int32: a
    # length in [0, table_width * block_size], a query length in [0, seq_len].
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + row), 0), table_width * BLOCK_SIZE)
    seq_len = tl.where(live, seq_len, 0)
    q_len = tl.minimum(tl.maximum(tl.load(query_start_loc_ptr + row + 1) - q_start, 0), seq_len)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    # Query rows outside the step's tokens are never read or written, whatever the metadata.
    m_mask = (offs_m < q_len) & (q_start + offs_m < num_tokens) & (q_start + offs_m >= 0)
    d = tl.arange(0, D_PAD)
    # Absolute positions; rows past q_len are clamped so they see >= 1 key and stay finite.
    first_pos = seq_len - q_len + tile * BLOCK_M
    pos = tl.minimum(first_pos + tl.arange(0, BLOCK_M), seq_len - 1)
    kv_end = tl.minimum(first_pos + BLOCK_M, seq_len)
    # Key tiles entirely at or left of the first query's position need no causal mask.
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    lo = 0
    mid_start = 0
    if HAS_WINDOW:
        # Tiles before `lo` are outside every query's window; tiles in [lo, mid_start) are
        # partly outside some query's window and take the mask.
        lo = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        last_pos = tl.minimum(first_pos + BLOCK_M - 1, seq_len - 1)
        win_full = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        mid_start = tl.minimum(tl.maximum(lo, win_full), full_end)
        lo = tl.minimum(lo, mid_start)

    q_mask = tile_mask(m_mask, d, HEAD_DIM, D_PAD)
    tok_q = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + tok_q[:, None] * stride_qt + h * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_scale = 1.0
    v_scale = 1.0
    if DEQUANT:
        k_scale = tl.load(k_scale_ptr + h // GROUP)
        v_scale = tl.load(v_scale_ptr + h // GROUP)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table_row = block_tables_ptr + row.to(tl.int64) * stride_bt
    head_off = (h // GROUP) * HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    # With a window, keys below the tile's first query's window are seen by no query of the
    # tile; their blocks may have been released (and reused, or never written: any bits), so
    # they are not even loaded: a masked key times a NaN value would still be NaN. (A
    # token-major V is read unmasked, from block ids inside the cache, and made finite.)
    win_lo = first_pos - window + 1
    if HAS_WINDOW:
        for n0 in range(lo, mid_start, BLOCK_N):
            n = n0 + offs_n
            pages = _pages_in_cache(table_row, n0, offs_n, kv_end, num_blocks, BLOCK_SIZE, BLOCK_N)
            tok = tile_token_offsets(pages, n0, offs_n, BLOCK_SIZE, BLOCK_N, NUM_KV_HEADS * HEAD_DIM, BLOCK_STRIDE)
            kv_off = tok[:, None] + head_off + d[None, :]
            n_mask = (n < kv_end) & (n >= win_lo)
            kv_mask = tile_mask(n_mask, d, HEAD_DIM, D_PAD)
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            k = _to_compute(k, k_scale, DEQUANT, UPCAST, q.dtype, TOKEN_SCALES)
            if V_TOKEN_MAJOR:
                vt_off = token_major_offsets(pages, n0, offs_n, head_off + d, BLOCK_SIZE, BLOCK_N, BLOCK_STRIDE)
                v = _unmasked_token_major_values(
                    v_cache_ptr, vt_off, d, v_scale, q.dtype, HEAD_DIM, D_PAD, DEQUANT, UPCAST, TOKEN_SCALES
                )
            else:
                v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
                v = _to_values(v, v_scale, DEQUANT, UPCAST, q.dtype, TOKEN_SCALES)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            v_cols = qk_scale  # unused unless TOKEN_SCALES
            if TOKEN_SCALES:
                ks, v_cols = _token_scales(
                    k_scale_ptr, v_scale_ptr, pages, n0, offs_n, h // GROUP, n_mask, BLOCK_SIZE, BLOCK_N,
                    BLOCK_STRIDE, True,
                )  # fmt: skip
                qk = qk * ks[None, :]
            if SOFTCAP:
                qk = soft_cap(qk, softcap)
            visible = (n[None, :] <= pos[:, None]) & (n[None, :] > pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            m_i, l_i, acc = _masked_softmax_update(qk, v, m_i, l_i, acc, qk_scale, v_cols, DOT_PRECISION, TOKEN_SCALES)

    # Block ids run one tile ahead (see load_tile_pages), across both loops.
    pages = _pages_in_cache(table_row, mid_start, offs_n, kv_end, num_blocks, BLOCK_SIZE, BLOCK_N)
    for n0 in range(mid_start, full_end, BLOCK_N):
        tok = tile_token_offsets(pages, n0, offs_n, BLOCK_SIZE, BLOCK_N, NUM_KV_HEADS * HEAD_DIM, BLOCK_STRIDE)
        if V_TOKEN_MAJOR:
            vt_off = token_major_offsets(pages, n0, offs_n, head_off + d, BLOCK_SIZE, BLOCK_N, BLOCK_STRIDE)
        v_cols = qk_scale  # unused unless TOKEN_SCALES
        if TOKEN_SCALES:  # every key of a full tile was written: no mask. (Loading them one tile
            # ahead, as decode does, made prefill 6-12% slower on the H200:
            # benchmarks/results/prefill-int8-2026-12-04.json against prefill-int8-first-.)
            ks, v_cols = _token_scales(
                k_scale_ptr, v_scale_ptr, pages, n0, offs_n, h // GROUP, offs_n, BLOCK_SIZE, BLOCK_N, BLOCK_STRIDE,
                False,
            )  # fmt: skip
        pages = _pages_in_cache(table_row, n0 + BLOCK_N, offs_n, kv_end, num_blocks, BLOCK_SIZE, BLOCK_N)
        kv_off = tok[:, None] + head_off + d[None, :]
        if HEAD_DIM == D_PAD:
            k = tl.load(k_cache_ptr + kv_off)
            if V_TOKEN_MAJOR:
                vt = tl.load(v_cache_ptr + vt_off)
            else:
                v = tl.load(v_cache_ptr + kv_off)
        else:
            d_mask = tl.max_constancy(d < HEAD_DIM, 8)[None, :]  # as in tile_mask
            k = tl.load(k_cache_ptr + kv_off, mask=d_mask, other=0.0)
            if V_TOKEN_MAJOR:
                vt = tl.load(v_cache_ptr + vt_off, mask=(d < HEAD_DIM)[:, None], other=0.0)
            else:
                v = tl.load(v_cache_ptr + kv_off, mask=d_mask, other=0.0)
        k = _to_compute(k, k_scale, DEQUANT, UPCAST, q.dtype, TOKEN_SCALES)
        if V_TOKEN_MAJOR:
            v = tl.trans(_to_values(vt, v_scale, DEQUANT, UPCAST, q.dtype, TOKEN_SCALES))
        else:
            v = _to_values(v, v_scale, DEQUANT, UPCAST, q.dtype, TOKEN_SCALES)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if TOKEN_SCALES:
            qk = qk * ks[None, :]
        if SOFTCAP:
            qk = soft_cap(qk, softcap)
        m_i, l_i, acc = online_softmax_update(qk, v, m_i, l_i, acc, qk_scale, v_cols, DOT_PRECISION, TOKEN_SCALES)

    for n0 in range(full_end, kv_end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < kv_end
        if HAS_WINDOW:
            n_mask = n_mask & (n >= win_lo)
        tok = tile_token_offsets(pages, n0, offs_n, BLOCK_SIZE, BLOCK_N, NUM_KV_HEADS * HEAD_DIM, BLOCK_STRIDE)
        if V_TOKEN_MAJOR:
            vt_off = token_major_offsets(pages, n0, offs_n, head_off + d, BLOCK_SIZE, BLOCK_N, BLOCK_STRIDE)
        v_cols = qk_scale  # unused unless TOKEN_SCALES
        if TOKEN_SCALES:
            ks, v_cols = _token_scales(
                k_scale_ptr, v_scale_ptr, pages, n0, offs_n, h // GROUP, n_mask, BLOCK_SIZE, BLOCK_N, BLOCK_STRIDE,
                True,
            )  # fmt: skip
        pages = _pages_in_cache(table_row, n0 + BLOCK_N, offs_n, kv_end, num_blocks, BLOCK_SIZE, BLOCK_N)
        kv_off = tok[:, None] + head_off + d[None, :]
        kv_mask = tile_mask(n_mask, d, HEAD_DIM, D_PAD)
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        k = _to_compute(k, k_scale, DEQUANT, UPCAST, q.dtype, TOKEN_SCALES)
        if V_TOKEN_MAJOR:
            v = _unmasked_token_major_values(
                v_cache_ptr, vt_off, d, v_scale, q.dtype, HEAD_DIM, D_PAD, DEQUANT, UPCAST, TOKEN_SCALES
            )
        else:
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            v = _to_values(v, v_scale, DEQUANT, UPCAST, q.dtype, TOKEN_SCALES)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if TOKEN_SCALES:
            qk = qk * ks[None, :]
        if SOFTCAP:
            qk = soft_cap(qk, softcap)
        if HAS_WINDOW:
            visible = (n[None, :] <= pos[:, None]) & (n[None, :] > pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            m_i, l_i, acc = _masked_softmax_update(qk, v, m_i, l_i, acc, qk_scale, v_cols, DOT_PRECISION, TOKEN_SCALES)
        else:
            qk = tl.where(n[None, :] <= pos[:, None], qk, float("-inf"))
            m_i, l_i, acc = online_softmax_update(qk, v, m_i, l_i, acc, qk_scale, v_cols, DOT_PRECISION, TOKEN_SCALES)

    if SINKS:  # one more term in the denominator: 2^(sink - m), with the max taken over it too
        sink = tl.load(sinks_ptr + h) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_f)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok_q[:, None] * stride_ot + h * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tile_index: torch.Tensor,
    *,
    softmax_scale: float,
    out: torch.Tensor,
    config: PrefillConfig,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tile_count: torch.Tensor | None = None,
    programs: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of every new token; writes and returns ``out``.

    query:           [num_tokens, num_heads, head_dim]; rows query_start_loc[i] ..
                     query_start_loc[i+1]-1 are row i's new tokens.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; k_cache contiguous,
                     v_cache contiguous or token-major (:mod:`attention.value_layout`).
    block_tables:    int32 [batch, max_blocks]; seq_lens int32 [batch];
    query_start_loc: int32 [batch + 1].
    tile_index:      int32 [num_tiles, 2] of (row, tile) from :func:`prefill_tile_index`
                     with the same ``config.block_m``, on the device; an entry with row -1
                     is padding and computes nothing.
    out:             [num_tokens, num_heads, head_dim], query's dtype, last dim contiguous.
    window:          sliding window (a query sees this many keys, itself included); None: all.
    k_scale, v_scale: fp32 [num_kv_heads] dequantization scales of an fp8 cache; for an int8
                     cache (laid out as :func:`attention.token_scales.split_block_memory` lays
                     it out, V token-major) its fp16 [num_blocks, block_size, num_kv_heads]
                     per-token scales; else None.
    tile_count, programs: a fixed grid (CUDA graphs): ``programs`` persistent programs share
                     the first ``tile_count[0]`` entries (int32 [1] on the device; clamped to
                     ``num_tiles``) of a padded ``tile_index``. The launch then depends only
                     on the shapes and ``programs``, never on the step's lengths.
    softcap:         cap scaled scores s to ``softcap * tanh(s / softcap)`` (None: no cap).
    sinks:           fp32 [num_heads] learned sink logits (None: none).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, kv_heads, _ = k_cache.shape
    num_tiles = tile_index.shape[0]
    if (tile_count is None) != (programs is None):
        raise ValueError("tile_count and programs: give both (a fixed grid) or neither")
    if num_tiles == 0:
        return out
    token_scaled = k_cache.dtype == torch.int8
    if token_scaled:
        problem = layout_problem(k_cache, v_cache, k_scale, v_scale)
        if problem is not None:
            raise ValueError(f"{problem}: an int8 cache is read as attention.token_scales lays it out")
    elif not (k_cache.is_contiguous() and value_is_readable(v_cache)):
        raise ValueError(
            f"k_cache/v_cache: the prefill kernel needs a contiguous k_cache and a contiguous or token-major "
            f"v_cache (attention.value_layout), got strides {k_cache.stride()} and {v_cache.stride()}"
        )
    if query.stride(-1) != 1:
        query = query.contiguous()
    grid = num_tiles * num_heads if programs is None else max(1, min(programs, num_tiles * num_heads))
    _prefill_kernel[(grid,)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        tile_index,
        tile_count if tile_count is not None else seq_lens,  # unused unless PERSISTENT
        out,
        k_scale if k_scale is not None else seq_lens,  # unused unless DEQUANT
        v_scale if v_scale is not None else seq_lens,
        sinks if sinks is not None else seq_lens,  # unused unless SINKS
        softmax_scale * _LOG2E,
        (softcap or 1.0) / softmax_scale,  # the cap in raw q.k units
        window or 0,
        k_cache.shape[0],
        query.shape[0],
        block_tables.shape[1],
        num_tiles,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=kv_heads,
        GROUP=num_heads // kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=next_power_of_2(max(head_dim, 16)),
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        UPCAST=upcast_for(query.dtype),
        DOT_PRECISION=dot_precision_for(query.dtype),
        HAS_WINDOW=window is not None,
        DEQUANT=k_scale is not None and not token_scaled,
        PERSISTENT=programs is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        V_TOKEN_MAJOR=token_scaled or is_token_major(v_cache),
        BLOCK_STRIDE=cache_block_stride(k_cache),
        TOKEN_SCALES=token_scaled,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
