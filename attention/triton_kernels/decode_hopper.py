"""Decode on Hopper (sm_90) with the tokens as the warpgroup MMA's M: fp8 and 16-bit caches.

The chunk kernel of :mod:`.decode` (same work items, same partial outputs for
:func:`.decode_kernels.decode_combine_kernel`), opt-in through ``DecodeConfig.hopper_wgmma``,
for a float8_e4m3fn cache (per-KV-head scales, V token-major) or a 16-bit cache in the query's
dtype.

Why: the Triton kernel puts the query heads of a KV group (4-16, padded to 16) on the M side
of 16-row ``mma.sync`` dots. For an fp8 cache it converts every K and V byte to fp16 first:
Hopper runs fp8 tensor-core math only in warpgroup MMAs (M = 64), and ``ptxas`` for sm_90 even
emulates an fp8 ``mma.sync`` through fp16 (``F2FP.F16.E4M3.UNPACK_B`` + ``HMMA.16816`` +
``FADD``). Its fp8 loop takes 891 instructions a 128-token tile at block 256 (136
conversions), its 16-bit loop 436 a 64-token tile, and on short rows the kernel is bound by
them (``benchmarks/results/decode-block32-ncu-2026-12-04.md``). Here the tile's tokens are
the MMA's M and the group's heads its N (8 or 16), as in :mod:`.mla_decode_hopper`:

- S^T = K Q^T ([BLOCK_N tokens, BLOCK_H heads]): the K tile as stored is the A operand;
- O^T += V^T P^T ([head_dim, BLOCK_H]): the V tile as stored is the A operand (a token-major
  fp8 V, :mod:`attention.value_layout`, has the reduction, the tokens, contiguous, as 8-bit
  operands must; a 16-bit V is read transposed);
- fp8: the query and P are split into ``hi = e4m3(x)`` and ``lo = e4m3(x - hi)``, stored as
  the first and second half of one operand's rows (twice the heads), and each dot runs once
  over both, its accumulator's halves added after (:data:`FUSED_HI_LO`; or twice, hi and lo
  into one accumulator): ~8 significant bits, a bf16 query's. Groups of up to 4 heads keep a
  head's hi and lo in adjacent rows of an 8-row operand instead (:data:`PAIRED_HI_LO`), the
  softmax on the accumulator's column pairs. The query is scaled
  per head so its largest element is 224 (e4m3's largest is 448), P by 2^8 (its largest is
  1); both factors come out again exactly (the scores' scale, and the lse minus 8). An 8-bit
  B operand must be K-major too, so P is stored transposed;
- the softmax runs per head over the tile's tokens; the row sums are kept per thread and
  reduced once after the loop;
- two loops (constexpr ``OVERLAP``, ``DecodeConfig.hopper_overlap``): each tile's S MMAs,
  softmax and P V MMAs in turn (the default), or overlapped: tile j's S MMAs and softmax while
  tile j-1's P V MMAs run, P in two buffers by tile parity, and a slot's K and V on barriers
  of their own (K refilled after S, V after P V). The overlapped loop is correct on an H100
  and within 1% of the loop in turn (``benchmarks/results/decode-overlap-h100-2026-12-06.md``);
- the loop in turn with its TMA loads in a loader warp of their own (:mod:`.decode_hopper_ws`,
  ``DecodeConfig.hopper_ws_loader``, the backend's launch by default), on these helpers.

Compiled off the device for sm_90 (Triton 3.6; ``benchmarks/results/decode-fp8-wgmma-compile-2026-12-05.md``),
a tile's path through the loop takes 449 instructions (fp8, 128 tokens) and 229 (bf16, 64
tokens) at block 256, 626 and 269 at block 32, where the Triton kernel takes 891 / 436 and
833 / 479. Timed on the H200 (``benchmarks/results/decode-hopper-h200-2026-12-05.md``), it is
0.99-1.20x the Triton kernel's speed in ``benchmarks/bench_decode.py --hopper-wgmma`` and
1.06-1.08x in the end-to-end burst's decode attention (on an H100 0.98-1.07x and 0.98-1.04x),
so :class:`~attention.triton_backend.TritonBackend` runs it by default on sm_90 for a 16-bit
cache, and for fp8 under bf16 queries (launch :func:`.decode.hopper_decode_config`): in long
blocks the end-to-end burst's attention was 1.80 ms against 1.95 on the H200; on an H100 2.36
against 2.32 (``benchmarks/results/stall-e2e-h100-2026-12-05.md``) until the tiles' savings of
2026-12-07, since 2.321 against 2.322 and 1.00-1.10x the Triton kernel's speed on
``bench_decode.py``'s shapes (``benchmarks/results/decode-fp8-gluon-vs-triton-h100-2026-12-07.log``).

Scope (:func:`decode_hopper_applies`): a bf16 or fp16 query with one new token per row,
head_dim 64 or 128, GQA groups of up to 16 heads, no cap, sinks or draft tree; a float8_e4m3fn
cache with a token-major V and tiles of 128 tokens, or a cache in the query's dtype and tiles
of 64 (:func:`hopper_block_n`; 32 KiB of K and V a tile either way at head_dim 128); blocks
of 32 or 64 tokens or a multiple of the tile (a tile is 1, 2 or 4 block-sized parts, each one
TMA box of K and one of V). Everything else runs the Triton kernel.

Trimmed tiles (:data:`TRIM_TILES`, the loop in turn): a chunk's last tile is on average half
past its end, and those tokens' bytes are read for nothing (32 of a 650-token row's ~11 16-bit
tiles: ~5% of its bytes). So a tile's parts that start at or past the chunk's end are not
loaded (blocks of 32 or 64 tokens), and, with :data:`HALF_BOXES` (off), a one-part 16-bit tile
whose tokens end in its first half loads half boxes into its first rows. Rows not loaded keep
stale data: masked in the softmax (K), zeroed by the V guard (V). A one-part fp8 tile (blocks
of 128 tokens or more) is read whole: its V^T half needs a buffer of half the row pitch, and
the forms that viewed the ring's buffers so gave wrong sums on the GPU
(``benchmarks/results/decode-trim-2026-12-06.md``). With :data:`SPLIT_FP8_TILES` (off) such a
tile is loaded as two parts of 64 tokens instead, the form of blocks of 64, so its second part
is skipped past a chunk's end (~9% of the fp8 bytes of the end-to-end burst's decode step,
LogNormal(550) rows): correct on an H100, but 1.011x on that shape and 0.984-0.994x on rows
ending on a tile boundary (``benchmarks/results/decode-split-fp8-h100-2026-12-07.md``).

Safety as in :mod:`.decode_kernels`: item indices, table rows, query tokens and partial
slots are range-checked; block ids outside ``[0, num_blocks)`` read block 0 and mask their
tokens; kv ranges are clamped to the table. V tokens a tile does not attend (past the chunk,
before it, or of a bad block; stale slots may hold NaN, which would survive p = 0) are zeroed
in shared memory before P V reads them, in the parts of a tile that have any.
"""

from __future__ import annotations

from typing import Any

import torch

from attention.triton_kernels.paging import next_power_of_2
from attention.triton_kernels.prefill_hopper import _GLUON, hopper_prefill_possible
from attention.value_layout import is_token_major

if _GLUON:
    from attention.triton_kernels.prefill_hopper import (
        TensorDescriptor,
        _partition_barrier,
        _tma_load,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        shared_layout,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = [
    "decode_hopper_applies",
    "decode_hopper_shape_ok",
    "hopper_block_n",
    "launch_decode_hopper",
    "tile_part",
]

_HEAD_DIMS = (64, 128)
#: The loop in turn does not load a tile's block-sized parts (blocks of 32 / 64 tokens) that
#: start at or past its chunk's end.
TRIM_TILES = True
#: With TRIM_TILES, a one-part 16-bit tile ending in its first half loads half boxes. Off: no gain
#: measured on the H200 (bf16 burst attention 2.81 ms either way, one run), and an eager launch
#: builds two more TMA descriptors (~30 us on a 2-core host). A switch for A/B runs.
HALF_BOXES = False
#: With TRIM_TILES, an fp8 tile in blocks of 128 tokens or more is loaded as two parts of 64
#: tokens (one K box and one V^T box each, as in blocks of 64), so that its second part is not
#: read when the chunk ends in its first. Off: correct on an H100 but 1.011x on the burst's decode
#: shape and 0.984-0.994x on uniform rows (benchmarks/results/decode-split-fp8-h100-2026-12-07.md).
#: A switch for A/B runs (tests/test_decode_hopper.py has a gpu-marked test of it).
SPLIT_FP8_TILES = False
#: fp8: P enters the P V MMAs as e4m3 hi + lo (~8 significant bits, a bf16's). Off: hi only (3
#: bits, as FlashAttention-3's fp8 P), half the P V MMAs and no lo conversion: on an H100 1.006x
#: on the burst's decode shape, 1.035-1.048x on 32 x 512, at 2.3% RMS output difference and a
#: small loss on a real model (benchmarks/results/decode-fp8-p-hi-only-h100-2026-12-07.md): stays on.
FP8_P_LO = True
#: fp8, the loop in turn: the query's (and P's) hi and lo parts stacked as one MMA operand of
#: twice the N (2 x the group's padded heads), so each K (and V) tile is read by one chain of
#: MMAs instead of two; the accumulator's two halves are added in registers (in fp32, where the
#: separate MMAs added the lo products inside the fp8 MMA's accumulator). On an H100: the
#: kernel's own floor (every table entry on one L2-resident block) 1.14-1.27x faster, from HBM
#: 1.008-1.054x (benchmarks/results/decode-fused-hi-lo-h100-2026-12-07.md). Off: hi and lo
#: apart (the overlapped loop always runs them apart).
FUSED_HI_LO = True
#: fp8 with FUSED_HI_LO, groups of up to 4 query heads: the query's hi and lo rows of head h
#: interleaved (rows 2h and 2h + 1) in an operand of 8 rows, so the MMAs' N is 8 rather than
#: 16 (the group padded to 8 heads, hi then lo) (:func:`hopper_block_h`). Each column pair is
#: summed into one column a head (:func:`_head_layout`), the softmax runs once a head, and P^T's
#: hi and lo rows are built from its one p (:func:`_stage_tile`). Compiled for sm_90 (fp8,
#: block 256, group 4, loader warp, Triton 3.6) a tile's common path is 204 instructions
#: against 285 padded (8 byte stores of P^T instead of 16, half the O^T rescale; 243 with the
#: softmax on both columns of each pair, 235 with :func:`_col_max` alone). Off: padded to 8
#: heads as for larger groups.
PAIRED_HI_LO = True
_MAX_GROUP = 16
#: The decode kernels' arguments compiled as plain runtime values (no specialisation on their
#: values: one compile serves every step's sizes).
UNSPECIALIZED_ARGS = (
    "num_item_slots", "num_table_rows", "table_width", "num_blocks", "num_q_tokens", "num_partial_slots", "stride_bt",
)
_FP8_BLOCK_N = 128
_WIDE_BLOCK_N = 64


def hopper_block_n(cache_dtype: torch.dtype) -> int:
    """Tokens per tile (the MMA's M, one or two blocks of 64) for a cache of this dtype: 128
    for an 8-bit cache, 64 for a 16-bit one. Schedules must be made for it."""
    return _FP8_BLOCK_N if cache_dtype.itemsize == 1 else _WIDE_BLOCK_N


def tile_part(block_size: int, block_n: int, split: bool = False) -> int:
    """Tokens of a tile's part, each in one block: the tile for blocks of a multiple of it, else
    the block (32 or 64); ``split``: at most half the tile (:data:`SPLIT_FP8_TILES`)."""
    part = min(block_size, block_n)
    return min(part, block_n // 2) if split else part


def launch_form(
    block_size: int, cache_dtype: torch.dtype, overlap: bool, *, split: bool | None = None,
    half_boxes: bool | None = None,
) -> tuple[int, bool, bool]:
    """(tokens of a tile's part, the kernel's ``TRIM``, whether it loads half boxes) of
    :func:`launch_decode_hopper` over a cache of ``cache_dtype`` in blocks of ``block_size``:
    the loop in turn trims (:data:`TRIM_TILES`) a tile of several parts, an fp8 tile split in two
    (:data:`SPLIT_FP8_TILES`) included, and a one-part 16-bit tile with half boxes
    (:data:`HALF_BOXES`). ``split`` / ``half_boxes``: those switches' values (None: the module's)."""
    block_n = hopper_block_n(cache_dtype)
    fp8 = cache_dtype == torch.float8_e4m3fn
    trimming = TRIM_TILES and not overlap
    split = SPLIT_FP8_TILES if split is None else split
    part = tile_part(block_size, block_n, split=trimming and fp8 and split)
    one_part = part == block_n
    halves = trimming and one_part and not fp8 and (HALF_BOXES if half_boxes is None else half_boxes)
    return part, trimming and (halves or not one_part), halves


def decode_hopper_shape_ok(head_dim: int, group: int, block_size: int, query_len: int, block_n: int) -> bool:
    """Whether the kernel takes this shape with tiles of ``block_n`` tokens: head_dim 64 or
    128, 1-16 query heads per KV head, blocks of 32 or 64 tokens or a positive multiple of the
    tile (each part of a tile inside one block), one new token per row."""
    inside_tile = block_size in (32, 64) and block_n % block_size == 0  # a tile of 2 or 4 blocks
    blocks_ok = inside_tile or (block_size > 0 and block_size % block_n == 0)
    return head_dim in _HEAD_DIMS and 0 < group <= _MAX_GROUP and blocks_ok and query_len == 1


def decode_hopper_applies(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_len: int,
    *,
    block_n: int,
    fused_combine: bool,
    extras: bool,
) -> bool:
    """Whether :func:`launch_decode_hopper` takes a call :func:`.decode.paged_decode` has
    checked, with tiles of ``block_n`` tokens (:func:`hopper_block_n` of the cache's dtype):
    an sm_90 GPU with Gluon; a bf16 / fp16 query with a unit last stride; a contiguous K, and
    either a float8_e4m3fn cache with a token-major V or a contiguous V in the query's dtype,
    16-byte aligned; :func:`decode_hopper_shape_ok`; the separate combine kernel (not
    ``fused_combine``) and none of cap, sinks or draft tree (``extras``; a sliding window is
    the items' kv ranges for one-token rows)."""
    if fused_combine or extras or query.dtype not in (torch.bfloat16, torch.float16) or query.stride(-1) != 1:
        return False
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if not (fp8 or k_cache.dtype == query.dtype) or v_cache.dtype != k_cache.dtype:
        return False
    if block_n != hopper_block_n(k_cache.dtype) or not hopper_prefill_possible(k_cache.device):
        return False
    _, block_size, kv_heads, head_dim = k_cache.shape
    if not decode_hopper_shape_ok(head_dim, query.shape[1] // kv_heads, block_size, query_len, block_n):
        return False
    v_ok = is_token_major(v_cache) if fp8 else v_cache.is_contiguous()
    if not (k_cache.is_contiguous() and v_ok):
        return False
    return k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0


if _GLUON:
    # Triton 3.6 names a shared-memory view of another type ``_reinterpret``; later versions
    # ``reinterpret``.
    if hasattr(gl.shared_memory_descriptor, "reinterpret"):

        @gluon.jit
        def _as_words(buf, shape: gl.constexpr, layout: gl.constexpr):  # type: ignore[no-untyped-def]
            return buf.reinterpret(gl.int32, shape, layout)

    else:

        @gluon.jit
        def _as_words(buf, shape: gl.constexpr, layout: gl.constexpr):  # type: ignore[no-untyped-def]
            return buf._reinterpret(gl.int32, shape, layout)

    @gluon.constexpr_function
    def _query_layout(block_h, head_dim):  # type: ignore[no-untyped-def]
        """A blocked layout of the [block_h, head_dim] query tile that holds each element once
        (up to 8 contiguous channels a thread)."""
        vec = max(1, min(8, block_h * head_dim // 128))
        cols = head_dim // vec
        return gl.BlockedLayout([1, vec], [32 // cols, cols], [4, 1], [1, 0])

    @gluon.jit
    def _tile_page(table_row, n0, row_ok, table_width, num_blocks, BLOCK_SIZE: gl.constexpr):  # type: ignore[no-untyped-def]
        """(block id to read, whether it is the row's) for token(s) ``n0``: the table entry
        clamped to the table; a bad id, or any id of a bad table row, reads block 0."""
        page = gl.load(table_row + gl.minimum(n0 // BLOCK_SIZE, table_width - 1), mask=row_ok, other=-1)
        ok = (page >= 0) & (page < num_blocks)
        return gl.where(ok, page, 0), ok

    @gluon.jit
    def _load_tile(  # type: ignore[no-untyped-def]
        k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, j, first, kv_end, table_row, row_ok,
        table_width, num_blocks, kvh,
        STAGES: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr,
        NUM_KV_HEADS: gl.constexpr, PART: gl.constexpr, FP8: gl.constexpr, LOAD_K: gl.constexpr,
        LOAD_V: gl.constexpr, V_BAR: gl.constexpr, TRIM: gl.constexpr,
    ):  # fmt: skip
        """TMA of tile ``j`` (tokens ``n0 = first + j * BLOCK_N ..``) into ring slot ``j %
        STAGES``: its K (``LOAD_K``) and its V (``LOAD_V``), signalling ``ready[slot]`` (K) and
        ``ready[V_BAR + slot]`` (V; V_BAR 0: one barrier for both, which must then both load),
        one K box and one V box per part of PART tokens (a part lies in one block):
        K rows ``[page * BLOCK_SIZE + t % BLOCK_SIZE, +PART)`` (``t`` the part's first token) at
        columns ``kvh * HEAD_DIM`` of K viewed ``[num_blocks * BLOCK_SIZE, kv_heads * HEAD_DIM]``,
        into the part's rows of the slot's K tile; V likewise into the V tile (16-bit), or (fp8,
        token-major) V^T rows ``(page * kv_heads + kvh) * HEAD_DIM ..`` at columns ``t %
        BLOCK_SIZE`` of V's memory viewed ``[num_blocks * kv_heads * HEAD_DIM, BLOCK_SIZE]``,
        into the part's own V^T buffer.

        ``TRIM`` (one barrier for K and V; not for a one-part fp8 tile): the tokens from
        ``kv_end`` on are not read where whole boxes hold only them: parts starting at or past
        ``kv_end`` are not loaded, and a one-part 16-bit tile ending at most half a tile past its
        first token loads the half boxes (``k_half_desc``, ``v_half_desc``) into its first rows.
        The rows left unloaded keep stale data, which the tile's softmax masks (K) and
        :func:`_stage_tile` zeroes (V)."""
        PARTS: gl.constexpr = BLOCK_N // PART
        slot = j % STAGES
        n0 = first + j * BLOCK_N
        k_bar = ready.index(slot)
        v_bar = ready.index(V_BAR + slot)
        if TRIM and PARTS == 1:  # (a compile-time branch: the half boxes exist only here)
            if n0 + BLOCK_N // 2 >= kv_end:  # the second half holds no token to attend
                mbarrier.expect(k_bar, k_half_desc.block_type.nbytes + v_half_desc.block_type.nbytes)
                page, _ok = _tile_page(table_row, n0, row_ok, table_width, num_blocks, BLOCK_SIZE)
                row = page * BLOCK_SIZE + n0 % BLOCK_SIZE
                _tma_load(k_half_desc, [row, kvh * HEAD_DIM], k_bar, k_bufs.index(slot).slice(0, BLOCK_N // 2))
                _tma_load(v_half_desc, [row, kvh * HEAD_DIM], k_bar, v_bufs.index(slot).slice(0, BLOCK_N // 2))
            else:
                _load_parts(k_desc, v_desc, k_bufs, v_bufs, k_bar, v_bar, slot, n0, kv_end, table_row, row_ok,
                            table_width, num_blocks, kvh, BLOCK_N, BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, PART, FP8,
                            LOAD_K, LOAD_V, V_BAR, False)  # fmt: skip
        else:
            _load_parts(k_desc, v_desc, k_bufs, v_bufs, k_bar, v_bar, slot, n0, kv_end, table_row, row_ok,
                        table_width, num_blocks, kvh, BLOCK_N, BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, PART, FP8,
                        LOAD_K, LOAD_V, V_BAR, TRIM)  # fmt: skip

    @gluon.jit
    def _load_parts(  # type: ignore[no-untyped-def]
        k_desc, v_desc, k_bufs, v_bufs, k_bar, v_bar, slot, n0, kv_end, table_row, row_ok, table_width, num_blocks,
        kvh, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
        PART: gl.constexpr, FP8: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr, V_BAR: gl.constexpr,
        SKIP_PAST_END: gl.constexpr,
    ):  # fmt: skip
        """The K (``LOAD_K``) and V (``LOAD_V``) boxes of the tile at token ``n0``, one each a
        part, into ring slot ``slot`` on ``k_bar`` and ``v_bar`` (V_BAR 0: the same barrier),
        as :func:`_load_tile`; ``SKIP_PAST_END`` (one barrier, both loaded): not the parts that
        start at or past ``kv_end``."""
        PARTS: gl.constexpr = BLOCK_N // PART
        if SKIP_PAST_END:  # (the byte count is a compile-time operand: a branch for each)
            loaded = gl.minimum(gl.maximum(gl.cdiv(kv_end - n0, PART), 1), PARTS)
            for count in gl.static_range(1, PARTS + 1):
                if loaded == count:
                    mbarrier.expect(k_bar, count * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        elif V_BAR == 0:
            mbarrier.expect(k_bar, PARTS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        else:
            if LOAD_K:
                mbarrier.expect(k_bar, PARTS * k_desc.block_type.nbytes)
            if LOAD_V:
                mbarrier.expect(v_bar, PARTS * v_desc.block_type.nbytes)
        for part in gl.static_range(PARTS):
            t = n0 + part * PART
            if SKIP_PAST_END and part > 0:
                if t < kv_end:
                    _load_part(k_desc, v_desc, k_bufs, v_bufs, k_bar, v_bar, slot, part, t, table_row, row_ok,
                               table_width, num_blocks, kvh, BLOCK_N, BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, PART, FP8,
                               LOAD_K, LOAD_V)  # fmt: skip
            else:
                _load_part(k_desc, v_desc, k_bufs, v_bufs, k_bar, v_bar, slot, part, t, table_row, row_ok,
                           table_width, num_blocks, kvh, BLOCK_N, BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, PART, FP8,
                           LOAD_K, LOAD_V)  # fmt: skip

    @gluon.jit
    def _load_part(  # type: ignore[no-untyped-def]
        k_desc, v_desc, k_bufs, v_bufs, k_bar, v_bar, slot, part, t, table_row, row_ok, table_width, num_blocks,
        kvh, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
        PART: gl.constexpr, FP8: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr,
    ):  # fmt: skip
        """One part's K box on ``k_bar`` (``LOAD_K``) and V box on ``v_bar`` (``LOAD_V``):
        tokens ``t ..``, part ``part`` of the tile in ring slot ``slot``."""
        PARTS: gl.constexpr = BLOCK_N // PART
        page, _ok = _tile_page(table_row, t, row_ok, table_width, num_blocks, BLOCK_SIZE)
        row = page * BLOCK_SIZE + t % BLOCK_SIZE
        if LOAD_K:
            k_dst = k_bufs.index(slot) if PARTS == 1 else k_bufs.index(slot).slice(part * PART, PART)
            _tma_load(k_desc, [row, kvh * HEAD_DIM], k_bar, k_dst)
        if LOAD_V:
            if FP8:
                v_dst = v_bufs.index(slot * PARTS + part)
                _tma_load(v_desc, [(page * NUM_KV_HEADS + kvh) * HEAD_DIM, t % BLOCK_SIZE], v_bar, v_dst)
            else:
                v_dst = v_bufs.index(slot) if PARTS == 1 else v_bufs.index(slot).slice(part * PART, PART)
                _tma_load(v_desc, [row, kvh * HEAD_DIM], v_bar, v_dst)

    @gluon.jit
    def _zero_tokens(v_tile, lo, hi, HEAD_DIM: gl.constexpr, PART: gl.constexpr):  # type: ignore[no-untyped-def]
        """Zero the tokens (columns) outside ``[lo, hi)`` of a [HEAD_DIM, PART] fp8 V^T buffer in
        shared memory, four tokens a 32-bit word: the buffer viewed as int32 [HEAD_DIM, PART / 4]
        (the same swizzle of PART-byte rows), each word ANDed with a mask of its kept bytes (byte
        b of word c is token 4c + b)."""
        words: gl.constexpr = PART // 4
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (words // 4), words // 4], [4, 1], [1, 0])
        view = _as_words(v_tile, [HEAD_DIM, words], gl.NVMMASharedLayout.get_default_for([HEAD_DIM, words], gl.int32))
        c4 = gl.arange(0, words, layout=gl.SliceLayout(0, layout)) * 4
        below = gl.minimum(gl.maximum(hi - c4, 0), 4)  # bytes of the word before hi
        before = gl.minimum(gl.maximum(lo - c4, 0), 4)  # bytes of the word before lo
        keep_low = gl.where(below >= 4, -1, (1 << (8 * gl.minimum(below, 3))) - 1)
        drop_low = gl.where(before >= 4, -1, (1 << (8 * gl.minimum(before, 3))) - 1)
        mask = keep_low & ~drop_low
        view.store(view.load(layout) & mask[None, :])

    @gluon.jit
    def _zero_rows(v_tile, n0, kv_start, kv_end, table_row, row_ok, table_width, num_blocks,  # type: ignore[no-untyped-def]
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr):  # fmt: skip
        """Zero the rows (tokens ``n0 + r``) of a [BLOCK_N, HEAD_DIM] 16-bit V tile in shared
        memory that lie outside ``[kv_start, kv_end)`` or in a bad block, two values a 32-bit
        word (the tile viewed as int32 [BLOCK_N, HEAD_DIM / 2], the same swizzle)."""
        words: gl.constexpr = HEAD_DIM // 2
        layout: gl.constexpr = _query_layout(BLOCK_N, words)
        view = _as_words(v_tile, [BLOCK_N, words], gl.NVMMASharedLayout.get_default_for([BLOCK_N, words], gl.int32))
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        _pages, in_block = _tile_page(table_row, n, row_ok, table_width, num_blocks, BLOCK_SIZE)
        keep = (n >= kv_start) & (n < kv_end) & in_block
        v = view.load(layout)
        view.store(gl.where(keep[:, None], v, gl.zeros_like(v)))

    @gluon.jit
    def _col_max(s, max_buf):  # type: ignore[no-untyped-def]
        """The column maxima of ``s`` [BLOCK_N tokens, C] in the MMA accumulator's layout (token
        n = 64 r + 16 w + i in warp w) as [C] in ``SliceLayout(0, s's layout)``: each warp's
        maxima over its tokens (registers, then lanes), stored as row w of ``max_buf`` [4 x C]
        (fp32, shared, flat), one barrier, then every thread reads the four rows it needs. The
        buffer is free again once every warp has passed its next barrier: each reads it before
        its P is staged, which the tile's later barriers wait for. (Triton 3.6's ``gl.max`` over
        the tokens takes two barriers and a second round of shuffles; with this alone, the fp8
        kernel's floor on an H100 at block 256 is 1.03-1.09x faster,
        benchmarks/results/decode-one-barrier-once-2026-12-07.md.)"""
        n: gl.constexpr = s.shape[0]
        c: gl.constexpr = s.shape[1]
        per_warp = gl.max(gl.max(gl.reshape(s, [n // 64, 4, 16, c]), 0), 1)  # [4, C], row w in warp w
        max_buf.store(gl.reshape(per_warp, [4 * c]))
        _partition_barrier()
        col_layout: gl.constexpr = gl.SliceLayout(0, s.type.layout)
        m = max_buf.slice(0, c).load(col_layout)
        for w in gl.static_range(1, 4):
            m = gl.maximum(m, max_buf.slice(w * c, c).load(col_layout))
        return m

    @gluon.jit
    def _allocate_max_buf(COLS: gl.constexpr):  # type: ignore[no-untyped-def]
        """The fp32 shared buffer of :func:`_col_max`: 4 warps' rows of COLS, flat."""
        layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        return gl.allocate_shared_memory(gl.float32, [4 * COLS], layout)

    @gluon.jit
    def _tile_softmax(  # type: ignore[no-untyped-def]
        s, n0, m_i, l_part, col_scale, offs_n, kv_start, kv_end, table_row, row_ok, table_width, num_blocks,
        max_buf, BLOCK_SIZE: gl.constexpr, PARTS: gl.constexpr, PART: gl.constexpr, P_SHIFT: gl.constexpr,
    ):  # fmt: skip
        """The online softmax of a tile's scores ``s`` [BLOCK_N tokens, BLOCK_H heads] (tokens
        ``n0 ..``; those outside ``[kv_start, kv_end)`` or in a bad block masked): returns (p,
        alpha, the new running max, the per-thread row sums rescaled and grown by p, whether
        every block of the tile is the row's); p is ``2^P_SHIFT`` times the probabilities (fp8:
        so e4m3 keeps small ones as normals). The tile's maxima go through ``max_buf``
        (:func:`_col_max`)."""
        n = n0 + offs_n
        if PARTS == 1:
            _page, tile_ok = _tile_page(table_row, n0, row_ok, table_width, num_blocks, BLOCK_SIZE)
            seen = (n >= kv_start) & (n < kv_end) & tile_ok
        else:  # each token's block (the table entries are in L1 after the tile's loads)
            _pages, in_block = _tile_page(table_row, n, row_ok, table_width, num_blocks, BLOCK_SIZE)
            seen = (n >= kv_start) & (n < kv_end) & in_block
            _page, tile_ok = _tile_page(table_row, n0, row_ok, table_width, num_blocks, BLOCK_SIZE)
            for part in gl.static_range(1, PARTS):
                _page, part_ok = _tile_page(table_row, n0 + part * PART, row_ok, table_width, num_blocks,
                                            BLOCK_SIZE)  # fmt: skip
                tile_ok = tile_ok & part_ok
        s = gl.where(seen[:, None], s * col_scale[None, :], float("-inf"))
        m_new = gl.maximum(m_i, _col_max(s, max_buf))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a head with nothing seen yet
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - (m_safe - P_SHIFT)[None, :])
        return p, alpha, m_new, l_part * alpha[None, :] + p, tile_ok

    @gluon.jit
    def _stage_tile(  # type: ignore[no-untyped-def]
        p, p_bufs, p_index, v_bufs, s_slot, n0, tile_ok, kv_start, kv_end, table_row, row_ok,
        table_width, num_blocks, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        PARTS: gl.constexpr, PART: gl.constexpr, FP8: gl.constexpr, P_LO: gl.constexpr,
        PAIRED: gl.constexpr = False,
    ):  # fmt: skip
        """Store a tile's P for its P V MMAs at ``p_bufs[p_index]`` (fp8: P^T split hi and lo, in
        its first and second BLOCK_H rows; ``PAIRED``: head h's hi part in P^T's row 2h, its lo
        part in row 2h + 1; not ``P_LO``: hi only, lo rows zero), and zero the V tokens of ring
        slot ``s_slot`` the tile (tokens ``n0 ..``; ``tile_ok``: all its blocks the row's) does
        not attend (past the chunk, before it, or of a bad block: stale slots may hold NaN, which
        would survive p = 0), in the parts that hold any (and those :func:`_load_tile` left
        unloaded). The caller fences and synchronises the warps before the MMAs read them."""
        if FP8 and PAIRED:
            p_hi = p.to(p_bufs.dtype)
            p_lo = (p - p_hi.to(gl.float32)).to(p_bufs.dtype) if P_LO else gl.zeros_like(p_hi)
            wide: gl.constexpr = _score_layout(2 * p.shape[1], True)
            rows = gl.convert_layout(gl.reshape(gl.join(p_hi, p_lo), [p.shape[0], 2 * p.shape[1]]), wide)
            p_bufs.index(p_index).store(gl.permute(rows, (1, 0)))
        elif FP8:
            heads: gl.constexpr = p.shape[1]
            pair = p_bufs.index(p_index)
            p_hi = p.to(p_bufs.dtype)
            pair.slice(0, heads).store(gl.permute(p_hi, (1, 0)))
            if P_LO:
                pair.slice(heads, heads).store(gl.permute((p - p_hi.to(gl.float32)).to(p_bufs.dtype), (1, 0)))
        else:
            p_bufs.index(p_index).store(p.to(p_bufs.dtype))
        if (n0 < kv_start) | (n0 + BLOCK_N > kv_end) | (tile_ok == 0):
            if FP8:
                for part in gl.static_range(PARTS):  # only the parts that hold such tokens
                    t = n0 + part * PART
                    _page, part_ok = _tile_page(table_row, t, row_ok, table_width, num_blocks, BLOCK_SIZE)
                    if (t < kv_start) | (t + PART > kv_end) | (part_ok == 0):
                        hi = gl.where(part_ok, kv_end - t, 0)
                        _zero_tokens(v_bufs.index(s_slot * PARTS + part), kv_start - t, hi, HEAD_DIM, PART)
            else:
                _zero_rows(v_bufs.index(s_slot), n0, kv_start, kv_end, table_row, row_ok, table_width, num_blocks,
                           BLOCK_N, HEAD_DIM, BLOCK_SIZE)  # fmt: skip

    @gluon.jit
    def _issue_scores(  # type: ignore[no-untyped-def]
        k_tile, q_bufs, s_zero, FP8: gl.constexpr, FUSE: gl.constexpr = False
    ):
        """S^T = K Q^T for a K tile (fp8: the query's hi and lo parts into one accumulator),
        issued asynchronously: 2 commit groups (fp8) or 1; the caller waits. ``FUSE`` (fp8):
        one group, the hi and lo rows stacked as one operand of twice the heads: ``s_zero`` is
        then [BLOCK_N, 2 * BLOCK_H] and the result's halves are the hi and lo products
        (:func:`_fold` adds them), or, paired (:func:`_stage_query`), its columns 2h and 2h + 1
        head h's hi and lo products (:func:`_pair_once` adds them)."""
        if FP8 and not FUSE:
            heads: gl.constexpr = q_bufs.shape[0] // 2
            s = warpgroup_mma(k_tile, q_bufs.slice(0, heads).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(k_tile, q_bufs.slice(heads, heads).permute((1, 0)), s, is_async=True)
        else:  # a 16-bit query, or fp8's hi and lo rows as one operand
            s = warpgroup_mma(k_tile, q_bufs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return s

    @gluon.jit
    def _fold(x, layout: gl.constexpr):  # type: ignore[no-untyped-def]
        """[R, 2H] -> [R, H] in ``layout``: the sum of ``x``'s two halves of columns."""
        halves = gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2])
        return gl.convert_layout(gl.sum(halves, 1), layout)

    @gluon.jit
    def _twice(v, layout: gl.constexpr):  # type: ignore[no-untyped-def]
        """[H] -> [2H] in ``layout``: ``v`` then ``v`` again."""
        pairs = gl.permute(gl.join(v, v), (1, 0))  # [2, H]
        return gl.convert_layout(gl.reshape(pairs, [2 * v.shape[0]]), layout)

    @gluon.jit
    def _pair_once(x, layout: gl.constexpr):  # type: ignore[no-untyped-def]
        """[R, 2H] -> [R, H] in ``layout``: each pair of columns (2h, 2h + 1) summed into column h
        (in registers: the accumulator holds a pair in one thread)."""
        even, odd = gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        return gl.convert_layout(even + odd, layout)

    @gluon.jit
    def _interleave(v, layout: gl.constexpr):  # type: ignore[no-untyped-def]
        """[H] -> [2H] in ``layout``: ``v[h]`` at 2h and 2h + 1."""
        return gl.convert_layout(gl.reshape(gl.join(v, v), [2 * v.shape[0]]), layout)

    @gluon.jit
    def _issue_pv(  # type: ignore[no-untyped-def]
        o, p_bufs, p_index, v_bufs, s_slot, PARTS: gl.constexpr, PART: gl.constexpr, FP8: gl.constexpr,
        P_LO: gl.constexpr, FUSE: gl.constexpr = False,
    ):  # fmt: skip
        """O^T += V^T P^T for the tile in ring slot ``s_slot`` with P at ``p_bufs[p_index]``
        (fp8: hi and lo, or hi only without ``P_LO``, and one MMA a part each), issued
        asynchronously: (2 or 1) * PARTS commit groups (fp8) or 1; the caller waits. ``FUSE``
        (fp8): all of P^T's 2 x BLOCK_H rows (:func:`_stage_tile`: hi then lo, or paired) as one
        operand, PARTS groups, into ``o`` [HEAD_DIM, 2 * BLOCK_H]."""
        if FP8 and FUSE:  # hi and lo rows as one operand: one MMA a part
            for part in gl.static_range(PARTS):
                p_all = p_bufs.index(p_index)
                p_part = p_all if PARTS == 1 else p_all.slice(part * PART, PART, 1)
                o = warpgroup_mma(v_bufs.index(s_slot * PARTS + part), p_part.permute((1, 0)), o, is_async=True)
        elif FP8:
            heads: gl.constexpr = p_bufs.shape[1] // 2
            for hl in gl.static_range(2 if P_LO else 1):  # P's hi and lo parts
                for part in gl.static_range(PARTS):
                    p_all = p_bufs.index(p_index).slice(hl * heads, heads)
                    p_part = p_all if PARTS == 1 else p_all.slice(part * PART, PART, 1)
                    o = warpgroup_mma(v_bufs.index(s_slot * PARTS + part), p_part.permute((1, 0)), o, is_async=True)
        else:
            o = warpgroup_mma(v_bufs.index(s_slot).permute((1, 0)), p_bufs.index(p_index), o, is_async=True)
        return o

    @gluon.jit
    def _stage_query(  # type: ignore[no-untyped-def]
        q_ptr, k_scale_ptr, q_bufs, kvh, token, token_ok, qk_scale, stride_qt, stride_qh, GROUP: gl.constexpr,
        BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr, s_layout: gl.constexpr, PAIRED: gl.constexpr = False,
    ):  # fmt: skip
        """Store the query heads of KV head ``kvh`` at token ``token`` (zeros where not
        ``token_ok`` or past the group) into ``q_bufs`` for the score MMAs, and return the scores'
        per-head scale [BLOCK_H] (log2 units) in ``SliceLayout(0, s_layout)``. fp8 cache (``q_bufs``
        of 2 x BLOCK_H rows): each head scaled so its largest element is 224, split into e4m3 hi
        (the first BLOCK_H rows) and lo (the rest); the scale takes the K scale and undoes the
        head's factor. ``PAIRED`` (fp8): head h's hi in row 2h and lo in row 2h + 1 (the scale
        still one a head). The caller fences and synchronises before the MMAs read them."""
        FP8: gl.constexpr = q_bufs.dtype == gl.float8e4nv
        STEP: gl.constexpr = 2 if FP8 and PAIRED else 1  # query rows a head
        q_layout: gl.constexpr = _query_layout(STEP * BLOCK_H, HEAD_DIM)
        r = gl.arange(0, STEP * BLOCK_H, layout=gl.SliceLayout(1, q_layout))
        dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
        heads = kvh * GROUP + r // STEP
        q_rows = token_ok & (r // STEP < GROUP)
        q_off = gl.where(token_ok, token, 0).to(gl.int64) * stride_qt + heads.to(gl.int64) * stride_qh
        q = gl.load(q_ptr + q_off[:, None] + dq[None, :], mask=q_rows[:, None], other=0.0)
        if FP8:
            q = q.to(gl.float32)
            q_amax = gl.max(gl.abs(q), 1)
            q_mul = gl.where(q_amax > 0.0, 224.0 / q_amax, 1.0)
            q = q * q_mul[:, None]
            # Keep this order: the hi part stored before lo is computed from it. Triton 3.6 (the
            # device's) miscompiled lo computed first for the halves form: two of every four
            # unpacked hi bytes came from an unrelated register, NaN in the output.
            if PAIRED:  # hi in a head's even row, lo in its odd one
                q_hi = q.to(q_bufs.dtype).to(gl.float32)
                q_bufs.store(gl.where((r % 2 == 1)[:, None], q - q_hi, q_hi).to(q_bufs.dtype))
            else:
                q_hi = q.to(q_bufs.dtype)
                q_bufs.slice(0, BLOCK_H).store(q_hi)
                q_bufs.slice(BLOCK_H, BLOCK_H).store((q - q_hi.to(gl.float32)).to(q_bufs.dtype))
            score_scale = qk_scale * gl.load(k_scale_ptr + kvh)
            if PAIRED:  # one column a head: a head's two rows have the same scale
                pairs: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])  # a row pair in one thread
                q_mul = gl.split(gl.reshape(gl.convert_layout(q_mul, pairs), [BLOCK_H, 2]))[0]
            col_scale = gl.convert_layout(score_scale / q_mul, gl.SliceLayout(0, s_layout))
        else:
            q_bufs.store(q)
            col_scale = gl.full([BLOCK_H], qk_scale, gl.float32, gl.SliceLayout(0, s_layout))
        return col_scale

    @gluon.jit
    def _store_result(  # type: ignore[no-untyped-def]
        o, m_i, l_part, v_scale_ptr, out_ptr, part_o_ptr, part_lse_ptr, kvh, slot, token, token_ok, q_len,
        num_partial_slots, stride_ot, stride_oh, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
        BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr, FP8: gl.constexpr, s_layout: gl.constexpr,
        PAIRED: gl.constexpr = False,
    ):  # fmt: skip
        """A chunk's result from O^T [HEAD_DIM, BLOCK_H], the running max and the per-thread row
        sums (``s_layout``): normalised (fp8: times the V scale) into ``out`` at ``token`` when it
        is its row's only chunk (``slot`` < 0), else into partial slot ``slot`` with its
        log2-sum-exp (P's 2^8 factor taken out for fp8), for the combine kernel. ``o`` as the
        loop left it: twice as wide as the state for the fused MMAs' hi and lo halves (added
        here); ``PAIRED``: the columns are 2 x BLOCK_H, head h's hi and lo products in columns 2h
        and 2h + 1, added here into column h (the state's layout, :func:`_state_layout`)."""
        if PAIRED:
            o = _pair_once(o, _head_layout(HEAD_DIM, BLOCK_H))
        elif o.shape[1] != BLOCK_H:
            o = _fold(o, s_layout)
        P_SHIFT: gl.constexpr = 8.0 if FP8 else 0.0
        l_i = gl.sum(l_part, 0)
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        l_o = gl.convert_layout(l_safe, gl.SliceLayout(0, o.type.layout))  # (paired: O's rows are head_dim)
        if FP8:  # noqa: SIM108 (a compile-time branch)
            o = o * (gl.load(v_scale_ptr + kvh) / l_o)[None, :]
        else:
            o = o / l_o[None, :]
        out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        o = gl.convert_layout(o, out_layout)
        dd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, out_layout))
        ho = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, out_layout))
        head_o = (kvh * GROUP + ho).to(gl.int64)
        col_ok = ho < GROUP
        if slot < 0:
            keep = token_ok & col_ok
            dst = out_ptr + gl.where(token_ok, token, 0).to(gl.int64) * stride_ot + head_o * stride_oh
            gl.store(dst[None, :] + dd[:, None], o.to(out_ptr.dtype.element_ty), mask=keep[None, :])
        else:
            slot_ok = (q_len > 0) & (slot < num_partial_slots)
            part_row = gl.where(slot_ok, slot, 0).to(gl.int64) * NUM_HEADS + head_o
            keep = slot_ok & col_ok
            gl.store(part_o_ptr + part_row[None, :] * HEAD_DIM + dd[:, None], o, mask=keep[None, :])
            lse = gl.where(l_i > 0.0, m_i + gl.log2(l_safe) - P_SHIFT, float("-inf"))
            h_s = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, s_layout))
            part_s = gl.where(slot_ok, slot, 0).to(gl.int64) * NUM_HEADS + kvh * GROUP + h_s
            gl.store(part_lse_ptr + part_s, lse, mask=slot_ok & (h_s < GROUP))

    @gluon.jit
    def _item_fields(  # type: ignore[no-untyped-def]
        item, block_tables_ptr, num_table_rows, table_width, num_q_tokens, stride_bt, BLOCK_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """A live item's fields (``item`` points at its row of the schedule's items), range-checked:
        (kv_start, kv_end clamped to the table, partial slot, table row pointer, table row ok,
        query token, token ok, q_len, first tile's token, tiles)."""
        kv_start = gl.maximum(gl.load(item + 1), 0)
        kv_end = gl.minimum(gl.load(item + 2), table_width * BLOCK_SIZE)
        slot = gl.load(item + 3)
        table_index = gl.load(item + 4)
        token = gl.load(item + 5)
        q_len = gl.load(item + 8)
        row_ok = (table_index >= 0) & (table_index < num_table_rows)
        table_row = block_tables_ptr + gl.where(row_ok, table_index, 0).to(gl.int64) * stride_bt
        token_ok = (token >= 0) & (token < num_q_tokens) & (q_len > 0)
        first = (kv_start // BLOCK_N) * BLOCK_N  # tiles stay aligned: each part inside a block
        n_tiles = gl.cdiv(gl.maximum(kv_end - first, 0), BLOCK_N)
        return kv_start, kv_end, slot, table_row, row_ok, token, token_ok, q_len, first, n_tiles

    @gluon.jit
    def _allocate_buffers(  # type: ignore[no-untyped-def]
        k_desc, v_desc, BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        PART: gl.constexpr, P_BUFS: gl.constexpr,
    ):  # fmt: skip
        """Shared memory of a program: the query (fp8: hi rows then lo rows), the K ring, ``P_BUFS``
        P buffers (fp8: P^T, K-major as 8-bit operands must be, hi rows then lo rows; 16-bit: P as
        computed) and the V ring (fp8: V^T per part; 16-bit: tiles as K's)."""
        kv_dtype: gl.constexpr = k_desc.dtype
        FP8: gl.constexpr = kv_dtype == gl.float8e4nv
        PARTS: gl.constexpr = BLOCK_N // PART
        Q_ROWS: gl.constexpr = 2 * BLOCK_H if FP8 else BLOCK_H
        q_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], kv_dtype)
        q_bufs = gl.allocate_shared_memory(kv_dtype, [Q_ROWS, HEAD_DIM], q_smem)
        k_bufs = gl.allocate_shared_memory(kv_dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        if FP8:
            p_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, BLOCK_N], kv_dtype)
            p_bufs = gl.allocate_shared_memory(kv_dtype, [P_BUFS, 2 * BLOCK_H, BLOCK_N], p_smem)
            v_bufs = gl.allocate_shared_memory(kv_dtype, [STAGES * PARTS, HEAD_DIM, PART], v_desc.layout)
        else:
            p_smem16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], kv_dtype)
            p_bufs = gl.allocate_shared_memory(kv_dtype, [P_BUFS, BLOCK_N, BLOCK_H], p_smem16)
            v_bufs = gl.allocate_shared_memory(kv_dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        return q_bufs, k_bufs, p_bufs, v_bufs

    @gluon.constexpr_function
    def _score_layout(block_h, fp8):  # type: ignore[no-untyped-def]
        """The MMA accumulator layout of S^T [tokens, block_h] (and of O^T [head_dim, block_h])."""
        instr_k = 32 if fp8 else 16
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_h, instr_k])

    @gluon.constexpr_function
    def _paired(block_h, fused):  # type: ignore[no-untyped-def]
        """Whether the fused hi / lo MMAs (``fused``) keep head h's hi and lo in columns 2h and
        2h + 1, summed into one column a head by :func:`_pair_once` (under 8 heads, where the
        MMA's N is then 8, not 16; an accumulator of 4 columns does not exist), rather than hi and
        lo in halves added into ``block_h`` columns by :func:`_fold`."""
        return bool(fused) and block_h < 8

    @gluon.constexpr_function
    def _head_layout(rows, block_h):  # type: ignore[no-untyped-def]
        """[rows, 4 heads]: the fp8 accumulator of 8 columns (:func:`_score_layout` of 8) with its
        column pairs (2h, 2h + 1) folded into head h: a row's 4 heads on lanes 0-3 of a quad,
        rows as in the accumulator (rows 8 and 64 apart in a thread's registers, 1-4 on its lanes,
        16 and 32 on its warps). ``rows`` 64 or 128."""
        if block_h != 4 or rows not in (64, 128):
            raise ValueError(f"_head_layout: block_h {block_h}, rows {rows}; the paired form: 4 heads, 64 or 128 rows")
        regs = [[8, 0]] + ([[64, 0]] if rows == 128 else [])
        lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
        return gl.DistributedLinearLayout(regs, lanes, [[16, 0], [32, 0]], [], [rows, block_h])

    @gluon.constexpr_function
    def _state_layout(block_h, fp8, paired, block_n):  # type: ignore[no-untyped-def]
        """The layout of the loop's softmax state, ``block_h`` columns, one a head: the MMA
        accumulator's, or when ``paired`` (:func:`_paired`) its pairs of columns folded into one
        (:func:`_head_layout` of ``block_n`` rows)."""
        if paired:
            return _head_layout(block_n, block_h)
        return _score_layout(block_h, fp8)

    @gluon.jit
    def _loop_state(  # type: ignore[no-untyped-def]
        BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr, FP8: gl.constexpr, FUSED: gl.constexpr,
        P_LO: gl.constexpr,
    ):  # fmt: skip
        """(zero scores, running max, per-thread row sums, O^T) before a chunk's first tile: with
        ``FUSED`` the scores (and, with ``P_LO``, O^T) twice as wide, hi and lo products side by
        side; paired (``FUSED`` under 8 heads, :func:`_paired`) the scores and O^T twice as wide,
        head h in columns 2h and 2h + 1 (the state one column a head, :func:`_state_layout`)."""
        PAIRED: gl.constexpr = _paired(BLOCK_H, FUSED)
        s_layout: gl.constexpr = _state_layout(BLOCK_H, FP8, PAIRED, BLOCK_N)
        wide_layout: gl.constexpr = _score_layout(2 * BLOCK_H, FP8)
        if FUSED:
            s_zero = gl.zeros([BLOCK_N, 2 * BLOCK_H], gl.float32, wide_layout)
        else:
            s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
        l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)
        if FUSED and (P_LO or PAIRED):
            o = gl.zeros([HEAD_DIM, 2 * BLOCK_H], gl.float32, wide_layout)
        else:
            o = gl.zeros([HEAD_DIM, BLOCK_H], gl.float32, s_layout)
        return s_zero, m_i, l_part, o

    @gluon.jit
    def _tile_in_turn(  # type: ignore[no-untyped-def]
        q_bufs, k_bufs, p_bufs, v_bufs, ready, s_slot, phase, n0, o, m_i, l_part, s_zero, col_scale, offs_n,
        kv_start, kv_end, table_row, row_ok, table_width, num_blocks, max_buf, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, PART: gl.constexpr, P_LO: gl.constexpr,
        FUSED: gl.constexpr,
    ):  # fmt: skip
        """One tile of the loop in turn (tokens ``n0 ..`` in ring slot ``s_slot``): wait for its
        K and V (``ready``, ``phase``), S MMAs, softmax, P and the V guard, P V MMAs, waited for;
        returns (o, m_i, l_part). The caller synchronises the warps before the slot is reused."""
        FP8: gl.constexpr = k_bufs.dtype == gl.float8e4nv
        P_SHIFT: gl.constexpr = 8.0 if FP8 else 0.0  # fp8: P scaled by 2^8 before its e4m3 split
        PARTS: gl.constexpr = BLOCK_N // PART
        BLOCK_H: gl.constexpr = q_bufs.shape[0] // 2 if FP8 else q_bufs.shape[0]
        PAIRED: gl.constexpr = _paired(BLOCK_H, FUSED)
        mbarrier.wait(ready.index(s_slot), phase)
        s = _issue_scores(k_bufs.index(s_slot), q_bufs, s_zero, FP8, FUSED)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if PAIRED:
            s = _pair_once(s, _head_layout(BLOCK_N, BLOCK_H))
        elif FUSED:
            s = _fold(s, _score_layout(BLOCK_H, FP8))
        p, alpha, m_i, l_part, tile_ok = _tile_softmax(
            s, n0, m_i, l_part, col_scale, offs_n, kv_start, kv_end, table_row, row_ok, table_width, num_blocks,
            max_buf, BLOCK_SIZE, PARTS, PART, P_SHIFT,
        )  # fmt: skip
        _stage_tile(p, p_bufs, 0, v_bufs, s_slot, n0, tile_ok, kv_start, kv_end, table_row, row_ok, table_width,
                    num_blocks, BLOCK_N, HEAD_DIM, BLOCK_SIZE, PARTS, PART, FP8, P_LO, PAIRED)  # fmt: skip
        fence_async_shared()
        _partition_barrier()
        if FUSED and P_LO and not PAIRED:
            o = o * _twice(alpha, gl.SliceLayout(0, _score_layout(2 * BLOCK_H, FP8)))[None, :]
        elif PAIRED:
            o = o * _interleave(alpha, gl.SliceLayout(0, _score_layout(2 * BLOCK_H, FP8)))[None, :]
        else:
            o = o * alpha[None, :]
        o = _issue_pv(o, p_bufs, 0, v_bufs, s_slot, PARTS, PART, FP8, P_LO, FUSED and (P_LO or PAIRED))
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        return o, m_i, l_part

    @gluon.jit(do_not_specialize=UNSPECIALIZED_ARGS)
    def _decode_hopper_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_desc, v_desc, k_half_desc, v_half_desc, k_scale_ptr, v_scale_ptr, block_tables_ptr, items_ptr,
        out_ptr, part_o_ptr, part_lse_ptr, qk_scale, num_item_slots, num_table_rows, table_width, num_blocks,
        num_q_tokens, num_partial_slots, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
        NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_H: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr,
        PART: gl.constexpr, OVERLAP: gl.constexpr, TRIM: gl.constexpr, P_LO: gl.constexpr, FUSE: gl.constexpr,
    ):  # fmt: skip
        """Program (kv_head, i): item i of the schedule's int32 items [num_item_slots, 10] =
        (d, kv_start, kv_end, partial_slot, table_row, q_token, num_chunks, first_partial,
        q_len, row_end), for the GROUP query heads of kv_head (padded to BLOCK_H, the MMA's N).
        A chunk that is its row's only one (partial_slot < 0) stores its output to ``out``,
        else its normalised output and log2-sum-exp to the partial slot, as the Triton kernel.
        The cache is fp8 when K's descriptor is (then with per-KV-head ``k_scale`` / ``v_scale``),
        else in the query's dtype. A tile is BLOCK_N / PART parts of PART tokens, each in one
        block: one K box into the part's rows of the tile; one V box into the part's rows of
        the V tile (16-bit), or (fp8) one V^T box into a buffer of its own (a [HEAD_DIM, PART]
        box cannot land inside a wider swizzled row), whose P V MMAs read the part's columns of P.
        ``TRIM`` (the loop in turn only): a tile's boxes that hold only tokens past the chunk's
        end are not read (:func:`_load_tile`; ``k_half_desc`` / ``v_half_desc`` the half boxes
        of a one-part tile). ``FUSE`` (fp8, the loop in turn): :data:`FUSED_HI_LO`."""
        kvh = gl.program_id(0)
        i = gl.program_id(1)
        if i >= num_item_slots:
            return
        item = items_ptr + i.to(gl.int64) * 10
        if gl.load(item) < 0:
            return  # padding of a fixed (CUDA-graph) grid
        kv_start, kv_end, slot, table_row, row_ok, token, token_ok, q_len, first, n_tiles = _item_fields(
            item, block_tables_ptr, num_table_rows, table_width, num_q_tokens, stride_bt, BLOCK_SIZE, BLOCK_N
        )

        kv_dtype: gl.constexpr = k_desc.dtype
        FP8: gl.constexpr = kv_dtype == gl.float8e4nv
        P_SHIFT: gl.constexpr = 8.0 if FP8 else 0.0  # fp8: P scaled by 2^8 before its e4m3 split
        PARTS: gl.constexpr = BLOCK_N // PART
        FUSED: gl.constexpr = FUSE and FP8 and not OVERLAP
        PAIRED: gl.constexpr = _paired(BLOCK_H, FUSED)
        s_layout: gl.constexpr = _state_layout(BLOCK_H, FP8, PAIRED, BLOCK_N)
        q_bufs, k_bufs, p_bufs, v_bufs = _allocate_buffers(
            k_desc, v_desc, BLOCK_H, HEAD_DIM, BLOCK_N, STAGES, PART, 2 if OVERLAP else 1
        )
        # In turn: one barrier a slot for its K and V. Overlapped: K's (0 .. STAGES-1) and V's
        # (STAGES ..), since a slot's K is free once S is done, its V only after P V.
        V_BAR: gl.constexpr = STAGES if OVERLAP else 0
        # (A one-part fp8 tile is not trimmed: its V^T half as a [HEAD_DIM, BLOCK_N / 2] view of
        # the ring gave wrong sums on the GPU, benchmarks/results/decode-trim-2026-12-06.md.)
        TRIM_LOADS: gl.constexpr = TRIM and not OVERLAP and not (FP8 and PARTS == 1)
        max_buf = _allocate_max_buf(BLOCK_H)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES + V_BAR, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES + V_BAR):
            mbarrier.init(ready.index(st), count=1)

        for st in gl.static_range(STAGES):
            if st < n_tiles:
                _load_tile(k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, st, first, kv_end,
                           table_row, row_ok, table_width, num_blocks, kvh, STAGES, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
                           NUM_KV_HEADS, PART, FP8, True, True, V_BAR, TRIM_LOADS)  # fmt: skip

        col_scale = _stage_query(q_ptr, k_scale_ptr, q_bufs, kvh, token, token_ok, qk_scale, stride_qt, stride_qh,
                                 GROUP, BLOCK_H, HEAD_DIM, s_layout, PAIRED)  # fmt: skip
        fence_async_shared()
        _partition_barrier()

        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        s_zero, m_i, l_part, o = _loop_state(BLOCK_N, BLOCK_H, HEAD_DIM, FP8, FUSED, P_LO)
        if OVERLAP:
            # Tile j's scores (S MMAs) and softmax run while tile j-1's P V MMAs do: P in two
            # buffers by tile parity. Prologue: tile 0's S and softmax; each step j = 1 ..
            # n_tiles-1 refills the K of tile j-1's slot (S(j-1) is done), issues S(j) then
            # P V(j-1), waits for S(j) only, softmaxes tile j, then waits for P V(j-1),
            # rescales o and refills the slot's V; epilogue: P V(n_tiles-1). A tile's V is
            # waited for before its softmax's V guard (which may zero some of it).
            if n_tiles > 0:
                mbarrier.wait(ready.index(0), 0)
                s = _issue_scores(k_bufs.index(0), q_bufs, s_zero, FP8)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                p, alpha, m_i, l_part, tile_ok = _tile_softmax(
                    s, first, m_i, l_part, col_scale, offs_n, kv_start, kv_end, table_row, row_ok, table_width,
                    num_blocks, max_buf, BLOCK_SIZE, PARTS, PART, P_SHIFT,
                )  # fmt: skip
                mbarrier.wait(ready.index(V_BAR), 0)
                _stage_tile(p, p_bufs, 0, v_bufs, 0, first, tile_ok, kv_start, kv_end, table_row, row_ok, table_width,
                            num_blocks, BLOCK_N, HEAD_DIM, BLOCK_SIZE, PARTS, PART, FP8, P_LO)  # fmt: skip
            for j in range(1, n_tiles):
                fence_async_shared()
                _partition_barrier()  # tile j-1's P and guarded V are visible to the MMAs; S(j-1) done
                s_slot = j % STAGES
                prev_slot = (j - 1) % STAGES
                refill = j - 1 + STAGES < n_tiles
                if refill:
                    _load_tile(k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, j - 1 + STAGES,
                               first, kv_end, table_row, row_ok, table_width, num_blocks, kvh, STAGES, BLOCK_N,
                               BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, PART, FP8, True, False, V_BAR, False)  # fmt: skip
                phase = (j // STAGES) & 1
                mbarrier.wait(ready.index(s_slot), phase)
                s = _issue_scores(k_bufs.index(s_slot), q_bufs, s_zero, FP8)
                o = _issue_pv(o, p_bufs, (j - 1) % 2, v_bufs, prev_slot, PARTS, PART, FP8, P_LO)
                s = warpgroup_mma_wait(num_outstanding=(2 if P_LO else 1) * PARTS if FP8 else 1, deps=(s,))
                n0 = first + j * BLOCK_N
                p, alpha, m_i, l_part, tile_ok = _tile_softmax(
                    s, n0, m_i, l_part, col_scale, offs_n, kv_start, kv_end, table_row, row_ok, table_width,
                    num_blocks, max_buf, BLOCK_SIZE, PARTS, PART, P_SHIFT,
                )  # fmt: skip
                mbarrier.wait(ready.index(V_BAR + s_slot), phase)
                _stage_tile(p, p_bufs, j % 2, v_bufs, s_slot, n0, tile_ok, kv_start, kv_end,
                            table_row, row_ok, table_width, num_blocks, BLOCK_N, HEAD_DIM, BLOCK_SIZE, PARTS, PART,
                            FP8, P_LO)  # fmt: skip
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                o = o * alpha[None, :]
                _partition_barrier()  # every warp is done with tile j-1's V
                if refill:
                    _load_tile(k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, j - 1 + STAGES,
                               first, kv_end, table_row, row_ok, table_width, num_blocks, kvh, STAGES, BLOCK_N,
                               BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, PART, FP8, False, True, V_BAR, False)  # fmt: skip
            if n_tiles > 0:
                fence_async_shared()
                _partition_barrier()
                last = n_tiles - 1
                o = _issue_pv(o, p_bufs, last % 2, v_bufs, last % STAGES, PARTS, PART, FP8,
                              P_LO)  # fmt: skip
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        else:
            for j in range(n_tiles):
                s_slot = j % STAGES
                o, m_i, l_part = _tile_in_turn(
                    q_bufs, k_bufs, p_bufs, v_bufs, ready, s_slot, (j // STAGES) & 1, first + j * BLOCK_N, o, m_i,
                    l_part, s_zero, col_scale, offs_n, kv_start, kv_end, table_row, row_ok, table_width, num_blocks,
                    max_buf, BLOCK_N, HEAD_DIM, BLOCK_SIZE, PART, P_LO, FUSED,
                )  # fmt: skip
                _partition_barrier()  # every warp is done with the slot and with P
                if j + STAGES < n_tiles:
                    _load_tile(k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, j + STAGES, first,
                               kv_end, table_row, row_ok, table_width, num_blocks, kvh, STAGES, BLOCK_N, BLOCK_SIZE,
                               HEAD_DIM, NUM_KV_HEADS, PART, FP8, True, True, 0, TRIM_LOADS)  # fmt: skip

        _store_result(o, m_i, l_part, v_scale_ptr, out_ptr, part_o_ptr, part_lse_ptr, kvh, slot, token, token_ok,
                      q_len, num_partial_slots, stride_ot, stride_oh, NUM_HEADS, GROUP, BLOCK_H, HEAD_DIM, FP8,
                      s_layout, PAIRED)  # fmt: skip

def _descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, part: int) -> tuple[Any, Any]:
    """TMA descriptors: K (and a 16-bit V) as ``[num_blocks * block_size, kv_heads * head_dim]``
    in boxes of [part, head_dim]; a token-major fp8 V's memory as ``[num_blocks * kv_heads *
    head_dim, block_size]`` in boxes of [head_dim, part]. (Boxes of half a tile: ``part`` the
    tile's half.)"""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[k_cache.dtype]

    def rows(t: torch.Tensor) -> Any:
        view = t.view(num_blocks * block_size, kv_heads * head_dim)
        layout = shared_layout((part, head_dim), dtype)
        return TensorDescriptor(view, list(view.shape), [kv_heads * head_dim, 1], [part, head_dim], layout)

    if k_cache.dtype != torch.float8_e4m3fn:
        return rows(k_cache), rows(v_cache)
    v2 = v_cache.permute(0, 2, 3, 1).reshape(num_blocks * kv_heads * head_dim, block_size)  # a view: token-major
    v_layout = shared_layout((head_dim, part), dtype)
    return rows(k_cache), TensorDescriptor(v2, list(v2.shape), [block_size, 1], [head_dim, part], v_layout)


def hopper_block_h(group: int, kv_dtype: torch.dtype, overlap: bool = False) -> int:
    """The kernel's padded head count (BLOCK_H) for ``group`` query heads a KV head: the MMA's
    N is BLOCK_H (16-bit) or 2 x BLOCK_H (fp8: hi and lo rows) and at least 8, so 8 for a
    16-bit cache or the overlapped loop, 4 for fp8 in the loop in turn with the paired rows
    (:data:`PAIRED_HI_LO`); the group's next power of two when larger."""
    paired = kv_dtype == torch.float8_e4m3fn and FUSED_HI_LO and PAIRED_HI_LO and not overlap
    return max(4 if paired else 8, next_power_of_2(group))


def launch_decode_hopper(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    block_tables: torch.Tensor,
    items: torch.Tensor,
    grid_items: int,
    out: torch.Tensor,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    qk_scale: float,
    stages: int,
    overlap: bool = False,
    ws_loader: bool = False,
) -> None:
    """The chunk kernel on arguments :func:`.decode.paged_decode` has checked and
    :func:`decode_hopper_applies` accepted, items made for :func:`hopper_block_n` of the cache;
    ``scales``: an fp8 cache's (k_scale, v_scale), None for a 16-bit one; ``qk_scale`` is
    softmax_scale * log2(e); ``stages``: K/V tiles in flight per program (32 KiB each at
    head_dim 128); ``overlap``: a tile's score MMAs and softmax run while the previous tile's
    P V MMAs do (P in two buffers), else each tile's steps in turn; ``ws_loader`` (not with
    ``overlap``): the loop in turn with its TMA loads in a loader warp
    (:mod:`.decode_hopper_ws`). Split rows are left in ``part_o`` / ``part_lse`` for the
    combine kernel."""
    if overlap and ws_loader:
        raise ValueError(
            "launch_decode_hopper: overlap and ws_loader are both True; the loader warp serves the loop in turn only"
        )
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // kv_heads
    block_n = hopper_block_n(k_cache.dtype)
    part, trim, halves = launch_form(block_size, k_cache.dtype, overlap)
    k_desc, v_desc = _descriptors(k_cache, v_cache, part)
    k_half, v_half = _descriptors(k_cache, v_cache, block_n // 2) if halves else (k_desc, v_desc)
    k_scale, v_scale = scales if scales is not None else (part_lse, part_lse)  # unused for a 16-bit cache
    if ws_loader:  # 256 threads capped at 128 registers: two programs an SM
        from attention.triton_kernels.decode_hopper_ws import _decode_hopper_ws_kernel as kernel

        form: dict[str, Any] = {"maxnreg": 128}
    else:
        kernel, form = _decode_hopper_kernel, {"OVERLAP": overlap}
    kernel[(kv_heads, grid_items)](
        query, k_desc, v_desc, k_half, v_half, k_scale, v_scale, block_tables, items, out, part_o, part_lse, qk_scale,
        items.shape[0], block_tables.shape[0], block_tables.shape[1], num_blocks, min(query.shape[0], out.shape[0]),
        part_o.shape[0], query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads, GROUP=group, BLOCK_H=hopper_block_h(group, k_cache.dtype, overlap),
        HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_SIZE=block_size, STAGES=stages, PART=part, TRIM=trim,
        P_LO=FP8_P_LO, FUSE=FUSED_HI_LO, num_warps=4, **form,
    )  # fmt: skip
