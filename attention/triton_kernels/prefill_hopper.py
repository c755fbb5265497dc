"""Prefill / extend on Hopper (sm_90): a warp-specialized Gluon kernel.

The same computation as :mod:`.prefill` (causal varlen attention of every new token over
the paged K/V; work items are (query tile, query head) of :func:`.prefill.prefill_tile_index`
with ``block_m`` 128), for the common case only: a 16-bit cache in the query's dtype, no
sliding window, cap or sinks, head_dim 64 or 128, blocks of a multiple of 32 tokens. The
triton backend sends such steps here (:func:`hopper_prefill_applies`), eager and CUDA-graph
alike, and everything else to :func:`.prefill.paged_prefill`. Eager steps over an fp8 cache
come here too, through a 16-bit copy of the blocks they read (:mod:`.dequantize_blocks`).

Why a second kernel: the Triton kernel tops out at 0.66-0.81x of torch SDPA (cuDNN) on dense
K/V on the H200; Triton 3.6 gives no control over warp roles or MMA issue order
(``benchmarks/results/prefill-ceiling-2026-12-04.md``). Gluon (Triton's lower-level
language, ``triton.experimental.gluon``) does, and this kernel is laid out as FlashAttention-3
is (Shah et al., 2024, section 3):

- a producer warpgroup loads each 128-key K and V tile with TMA into two rings of
  shared-memory buffers, 2 K and 3 V slots (``ready`` / ``empty`` mbarriers per slot; a K slot
  is free again once both consumers' S of it is done, a V slot once their P V is). The cache
  is viewed as ``[num_blocks * block_size, kv_heads * head_dim]``; a tile is one 2-D box of it
  when blocks hold a multiple of 128 tokens, else ``128 / g`` boxes of ``g = gcd(block_size,
  128)`` rows (32 or 64), each inside one block, loaded into consecutive rows of the slot on
  the slot's one barrier (:func:`kv_box_rows`);
- two consumer warpgroups each own 64 of the tile's 128 query rows. Each issues S = Q K^T of
  key tile j and P V of tile j - 1 as asynchronous warpgroup MMAs, then computes the softmax of
  tile j while P V runs;
- the two consumers take turns issuing their MMAs (named barriers 8 and 9, "ping-pong"), so
  one's softmax overlaps the other's MMAs;
- each consumer stages its normalized output in shared memory and writes it with one TMA store
  (masked 16-byte stores where rows leave the row's tokens or ``out`` cannot take TMA). Stored
  straight from the accumulator layout, the output had cost 15% of the kernel's time at
  32 x 1024;
- the programs are persistent (one per SM, each taking every ``grid``-th item of the
  heaviest-first index): the producer loads the next item's Q and key tiles while the
  consumers finish the last one. On a fixed grid (CUDA graphs) the real entry count is read
  on the device.

H200, bf16, 32 / 8 heads, head_dim 128, block 256, CUDA-graph replays
(``benchmarks/results/prefill-hopper-rings-2026-12-04.json``): 1.00x / 1.00x / 0.98x torch
SDPA at 8x4096 / 32x1024 / 2x16384, where the Triton kernel reaches 0.77x / 0.68x / 0.77x.
Blocks of 32: see ``benchmarks/results/prefill-hopper-block32-2026-12-04.json``.

Safety, as in :mod:`.prefill`: lengths are clamped to the block table, block ids outside
[0, num_blocks) read block 0, TMA zero-fills query rows outside the step, only the tile's own
rows are stored (a TMA store only for 64 rows that are all the row's tokens inside the step;
TMA also drops rows past the step's last token), and the V rows of a last key tile past the
row's length (stale bits, possibly NaN) are zeroed in shared memory before P V reads them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton

from attention.triton_kernels.paging import kernels_interpreted

try:  # Gluon: Triton >= 3.6 with the NVIDIA backend (earlier Gluon APIs differ)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6)
except ImportError:  # pragma: no cover - older Triton
    _GLUON = False

__all__ = [
    "HOPPER_PREFILL_BLOCK_M",
    "gluon_available",
    "hopper_prefill",
    "hopper_prefill_applies",
    "hopper_prefill_possible",
    "hopper_prefill_shape_ok",
    "kv_box_rows",
]

#: Query rows per program (two consumer warpgroups of 64); the tile index must use it.
HOPPER_PREFILL_BLOCK_M = 128
_BLOCK_N = 128  # keys per tile
# Tiles in flight: 2 K and 3 V tiles (32 KiB each at head_dim 128) + Q and the staged output
# (2 x 16 KiB each) fill the 227 KiB of shared memory. A K slot frees as soon as its S is done,
# so 2 suffice; V waits for P V. Measured against 3 + 3, 3 + 2 and 2 + 2 and one ring of 3
# (benchmarks/results/prefill-hopper-rings-variants-2026-12-04.json).
_K_STAGES = 2
_V_STAGES = 3
_HEAD_DIMS = (64, 128)
_MIN_BOX_ROWS = 32  # the smallest K / V box: a tile is at most 4 boxes (the producer's unrolling)
_LOG2E = 1.4426950408889634


def gluon_available() -> bool:
    """Whether this Triton has Gluon's Hopper warp specialization (and kernels are compiled,
    not interpreted: the interpreter does not run Gluon)."""
    return _GLUON and not kernels_interpreted()


@functools.lru_cache(maxsize=256)
def shared_layout(block: tuple[int, ...], dtype: Any) -> Any:
    """``gl.NVMMASharedLayout.get_default_for(block, dtype)`` (a frozen value), computed once per
    box and Gluon dtype: it costs ~8 us a call on the host, and eager launches build their TMA
    descriptors on every call."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def hopper_prefill_possible(device: torch.device) -> bool:
    """Whether the Hopper kernel can run on ``device`` at all: an sm_90 GPU and a Triton with
    Gluon (compiled kernels)."""
    if not gluon_available() or device.type != "cuda":
        return False
    return _is_sm90(torch.cuda.current_device() if device.index is None else device.index)


def hopper_prefill_shape_ok(head_dim: int, block_size: int) -> bool:
    """Whether the kernel takes this head_dim (64 or 128) and block size (a positive multiple
    of 32: a 128-key tile is then 1, 2 or 4 TMA boxes, :func:`kv_box_rows`)."""
    return head_dim in _HEAD_DIMS and block_size > 0 and block_size % _MIN_BOX_ROWS == 0


def kv_box_rows(block_size: int) -> int:
    """Rows of the K / V TMA box for blocks of ``block_size`` tokens: ``gcd(block_size, 128)``.
    A tile of 128 keys starts at a multiple of 128, so each of its boxes starts at a multiple of
    the box and lies inside one block."""
    return math.gcd(block_size, _BLOCK_N)


def hopper_prefill_applies(
    query: torch.Tensor,
    out: torch.Tensor,
    *,
    cache_dtype: torch.dtype,
    block_size: int,
    tma_caches: bool,
    block_m: int,
    window: int | None,
    quantized: bool,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> bool:
    """Whether :func:`hopper_prefill` serves a layer call: an sm_90 GPU with Gluon, a tile
    index of ``block_m`` 128, no window / cap / sinks / scales, caches in the query's 16-bit
    dtype with blocks of a multiple of 32 tokens that TMA can read (``tma_caches``:
    contiguous, 16-byte aligned), head_dim 64 or 128, and a query / out whose rows TMA and the
    stores can address (unit stride along head_dim, heads packed, 16-byte aligned rows)."""
    if not hopper_prefill_possible(query.device):
        return False
    if block_m != HOPPER_PREFILL_BLOCK_M or window is not None or quantized or softcap is not None:
        return False
    if sinks is not None or query.dtype not in (torch.bfloat16, torch.float16) or cache_dtype != query.dtype:
        return False
    head_dim = query.shape[2]
    if not hopper_prefill_shape_ok(head_dim, block_size) or not tma_caches:
        return False
    if query.stride(1) != head_dim or not tma_rows_ok(query):
        return False
    return out.stride(-1) == 1


if _GLUON:
    # Triton 3.6 names the TMA load / store async_copy_global_to_shared / async_copy_shared_to_global
    # and the partition barrier thread_barrier; later versions async_load / async_store and barrier.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    # Named barriers 8 and 9 order the consumers' MMA issue: warpgroup 0 (threads 0-127)
    # waits on 8 and releases 9; warpgroup 1 the other way round. Triton's own partition
    # barriers use the low ids.
    _WAIT_TURN = gl.constexpr(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.lt.u32 p, t, 128;"
        " @p bar.sync 8, 256; @!p bar.sync 9, 256; mov.u32 $0, $1; }"
    )
    _PASS_TURN = gl.constexpr(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.lt.u32 p, t, 128;"
        " @p bar.arrive 9, 256; @!p bar.arrive 8, 256; mov.u32 $0, $1; }"
    )

    @gluon.jit
    def _turn(token, ASM: gl.constexpr):  # type: ignore[no-untyped-def]
        """Run one of the turn-taking barriers (``token`` orders it among the MMAs)."""
        return gl.inline_asm_elementwise(ASM, "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.constexpr_function
    def _row_layout(head_dim, num_warps):  # type: ignore[no-untyped-def]
        cols = min(head_dim // 8, 32)
        return gl.BlockedLayout([1, 8], [32 // cols, cols], [num_warps, 1], [1, 0])

    @gluon.jit
    def _zero_rows_from(buf, first_bad, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):  # type: ignore[no-untyped-def]
        """Zero rows ``first_bad ..`` of a [BLOCK_N, HEAD_DIM] tile in shared memory (both
        consumers do it: the same zeros, each before its own reads)."""
        layout: gl.constexpr = _row_layout(HEAD_DIM, 4)
        v = buf.load(layout)
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        buf.store(gl.where((rows < first_bad)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()
        _partition_barrier()

    @gluon.jit
    def _page(table_row, n0, table_width, num_blocks, BLOCK_SIZE: gl.constexpr):  # type: ignore[no-untyped-def]
        """The cache row of key ``n0`` of a row: ``page * BLOCK_SIZE + n0 % BLOCK_SIZE`` for the
        block holding it (table index clamped to the table; an id outside [0, num_blocks) reads
        block 0)."""
        page = gl.load(table_row + gl.minimum(n0 // BLOCK_SIZE, table_width - 1))
        page = gl.where((page >= 0) & (page < num_blocks), page, 0)
        return page * BLOCK_SIZE + n0 % BLOCK_SIZE

    @gluon.jit
    def _load_ring(  # type: ignore[no-untyped-def]
        desc, bufs, ready, empty, pos, table_row, n0, col, table_width, num_blocks, STAGES: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """TMA of the [BLOCK_N, HEAD_DIM] tile of keys ``n0 ..`` into ring position ``pos`` once
        both consumers freed that slot: one box, or 2 / 4 boxes of ``desc``'s rows (blocks of 64
        / 32 tokens: each box inside one block) into consecutive rows of the slot, all on the
        slot's barrier. The block ids are read before the wait for the slot."""
        BOX: gl.constexpr = desc.block_type.shape[0]
        BOXES: gl.constexpr = BLOCK_N // BOX
        r0 = _page(table_row, n0, table_width, num_blocks, BLOCK_SIZE)
        if BOXES >= 2:
            r1 = _page(table_row, n0 + BOX, table_width, num_blocks, BLOCK_SIZE)
        if BOXES == 4:
            r2 = _page(table_row, n0 + 2 * BOX, table_width, num_blocks, BLOCK_SIZE)
            r3 = _page(table_row, n0 + 3 * BOX, table_width, num_blocks, BLOCK_SIZE)
        slot = pos % STAGES
        mbarrier.wait(empty.index(slot), ((pos // STAGES) & 1) ^ 1)  # a fresh slot passes
        bar = ready.index(slot)
        buf = bufs.index(slot)
        mbarrier.expect(bar, BOXES * desc.block_type.nbytes)
        if BOXES == 1:
            _tma_load(desc, [r0, col], bar, buf)
        else:
            _tma_load(desc, [r0, col], bar, buf.slice(0, BOX))
            _tma_load(desc, [r1, col], bar, buf.slice(BOX, BOX))
            if BOXES == 4:
                _tma_load(desc, [r2, col], bar, buf.slice(2 * BOX, BOX))
                _tma_load(desc, [r3, col], bar, buf.slice(3 * BOX, BOX))

    @gluon.jit
    def _item(  # type: ignore[no-untyped-def]
        item, tile_index_ptr, seq_lens_ptr, query_start_loc_ptr, table_width,
        NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """Work item ``item``: tile-index entry ``item // NUM_HEADS`` for query head ``item %
        NUM_HEADS`` (heads fastest: a KV group's heads share its tiles through L2). Returns (head,
        row, tile, q_start, seq_len, q_len, first_pos, kv_end, n_tiles), clamped as in the Triton
        kernel: a length in [0, table_width * BLOCK_SIZE], a query length in [0, seq_len], at
        least one key tile (an entry with row -1 loads one and stores nothing)."""
        h = item % NUM_HEADS
        entry = tile_index_ptr + 2 * (item // NUM_HEADS)
        row = gl.load(entry)
        tile = gl.load(entry + 1)
        live = row >= 0
        row = gl.maximum(row, 0)
        q_start = gl.load(query_start_loc_ptr + row)
        seq_len = gl.minimum(gl.maximum(gl.load(seq_lens_ptr + row), 0), table_width * BLOCK_SIZE)
        seq_len = gl.where(live, seq_len, 0)
        q_len = gl.minimum(gl.maximum(gl.load(query_start_loc_ptr + row + 1) - q_start, 0), seq_len)
        first_pos = seq_len - q_len + tile * BLOCK_M
        kv_end = gl.minimum(first_pos + BLOCK_M, seq_len)
        n_tiles = gl.maximum(gl.cdiv(kv_end, BLOCK_N), 1)
        return h, row, tile, q_start, seq_len, q_len, first_pos, kv_end, n_tiles

    @gluon.jit
    def _producer(  # type: ignore[no-untyped-def]
        q_desc, k_desc, v_desc, q_smem0, q_smem1, q_ready, q_empty, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_index_ptr, num_items, stride_bt, table_width,
        num_blocks,
        NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
    ):  # fmt: skip
        """For each of this program's items: its two Q halves once the consumers are done with the
        last item's, then K(0), and per key tile j, K(j + 1) before V(j) (the order the consumers
        read them in), each once both consumers freed its slot."""
        c = 0  # key tiles loaded so far (the position in both rings)
        for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
            h, row, tile, q_start, _, _, _, _, n_tiles = _item(
                item, tile_index_ptr, seq_lens_ptr, query_start_loc_ptr, table_width, NUM_HEADS, BLOCK_SIZE, BLOCK_M,
                BLOCK_N,
            )  # fmt: skip
            it = (item - gl.program_id(0)) // gl.num_programs(0)  # items of this program so far
            mbarrier.wait(q_empty, (it & 1) ^ 1)  # the first item passes
            mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
            q_row = q_start + tile * BLOCK_M  # rows outside the step's tokens read zeros
            _tma_load(q_desc, [q_row, h * HEAD_DIM], q_ready, q_smem0)
            _tma_load(q_desc, [q_row + BLOCK_M // 2, h * HEAD_DIM], q_ready, q_smem1)
            table_row = block_tables_ptr + row.to(gl.int64) * stride_bt
            col = (h // GROUP) * HEAD_DIM
            _load_ring(
                k_desc, k_bufs, k_ready, k_empty, c, table_row, 0, col, table_width, num_blocks, K_STAGES, BLOCK_SIZE,
                BLOCK_N,
            )  # fmt: skip
            for j in range(n_tiles):
                if j + 1 < n_tiles:
                    _load_ring(
                        k_desc, k_bufs, k_ready, k_empty, c + j + 1, table_row, (j + 1) * BLOCK_N, col, table_width,
                        num_blocks, K_STAGES, BLOCK_SIZE, BLOCK_N,
                    )  # fmt: skip
                _load_ring(
                    v_desc, v_bufs, v_ready, v_empty, c + j, table_row, j * BLOCK_N, col, table_width, num_blocks,
                    V_STAGES, BLOCK_SIZE, BLOCK_N,
                )  # fmt: skip
            c += n_tiles

    @gluon.jit
    def _consumer(  # type: ignore[no-untyped-def]
        q_smem, o_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, out_ptr, o_desc,
        qk_scale, tile_index_ptr, seq_lens_ptr, query_start_loc_ptr, num_items, table_width, num_tokens, stride_ot,
        stride_oh,
        WG: gl.constexpr, NUM_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
        OUT_TMA: gl.constexpr,
    ):  # fmt: skip
        """Query rows ``WG * BLOCK_M / 2 ..`` of each of this program's items: online softmax over
        the key tiles (a K slot is freed as soon as its S is done, a V slot once its P V is), then
        the output through ``o_smem``: one TMA store when all 64 rows are the row's tokens inside
        the step (and ``OUT_TMA``), else 16-byte stores masked to those rows."""
        HALF_M: gl.constexpr = BLOCK_M // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = _row_layout(HEAD_DIM, 4)
        dtype: gl.constexpr = q_smem.dtype
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
        token = gl.full([128], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
        if WG == 1:  # warpgroup 0 issues first
            token = gl.inline_asm_elementwise(
                "bar.arrive 8, 256; mov.u32 $0, $1;", "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1
            )
        c = 0  # key tiles consumed so far (the position in both rings)
        for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
            h, _, tile, q_start, seq_len, q_len, first_pos, kv_end, n_tiles = _item(
                item, tile_index_ptr, seq_lens_ptr, query_start_loc_ptr, table_width, NUM_HEADS, BLOCK_SIZE, BLOCK_M,
                BLOCK_N,
            )  # fmt: skip
            it = (item - gl.program_id(0)) // gl.num_programs(0)  # items of this program so far
            tail = kv_end - (n_tiles - 1) * BLOCK_N  # keys of the last tile inside the row
            my_first = first_pos + WG * HALF_M
            # Rows past the row's end are clamped to its last position: they see >= 1 key.
            pos = gl.minimum(my_first + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout)), seq_len - 1)

            # Key tile 0 alone; its P V is issued with tile 1's S.
            mbarrier.wait(q_ready, it & 1)
            ks = c % K_STAGES
            mbarrier.wait(k_ready.index(ks), (c // K_STAGES) & 1)
            token = _turn(token, _WAIT_TURN)
            s = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            token = _turn(token, _PASS_TURN)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.arrive(k_empty.index(ks))
            if my_first + 1 < BLOCK_N:
                s = gl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
            m_i = gl.max(s, 1) * qk_scale
            p_f = gl.exp2(s * qk_scale - m_i[:, None])
            l_i = gl.sum(p_f, 1)
            p = gl.convert_layout(p_f.to(dtype), p_layout)
            acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)

            for j in range(1, n_tiles):
                ks = (c + j) % K_STAGES
                vs = (c + j - 1) % V_STAGES
                mbarrier.wait(k_ready.index(ks), ((c + j) // K_STAGES) & 1)
                mbarrier.wait(v_ready.index(vs), ((c + j - 1) // V_STAGES) & 1)
                token = _turn(token, _WAIT_TURN)
                s = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc = warpgroup_mma(p, v_bufs.index(vs), acc, is_async=True)
                token = _turn(token, _PASS_TURN)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S done; P V still running
                mbarrier.arrive(k_empty.index(ks))
                if (j + 1) * BLOCK_N > my_first + 1:  # the tile crosses the diagonal
                    s = gl.where((j * BLOCK_N + offs_n)[None, :] <= pos[:, None], s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
                alpha = gl.exp2(m_i - m_new)
                p_f = gl.exp2(s * qk_scale - m_new[:, None])
                l_i = l_i * alpha + gl.sum(p_f, 1)
                m_i = m_new
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(v_empty.index(vs))  # V(j - 1) fully read
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p = gl.convert_layout(p_f.to(dtype), p_layout)

            mbarrier.arrive(q_empty)  # every S of the item is done: the next Q may load
            vs = (c + n_tiles - 1) % V_STAGES
            mbarrier.wait(v_ready.index(vs), ((c + n_tiles - 1) // V_STAGES) & 1)
            if tail < BLOCK_N:
                _zero_rows_from(v_bufs.index(vs), tail, BLOCK_N, HEAD_DIM)
            token = _turn(token, _WAIT_TURN)
            acc = warpgroup_mma(p, v_bufs.index(vs), acc, is_async=True)
            # Warpgroup 1's very last turn has no successor.
            if (WG == 0) | (item + gl.num_programs(0) < num_items):
                token = _turn(token, _PASS_TURN)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(vs))
            c += n_tiles

            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            o = (acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]).to(dtype)
            if OUT_TMA:
                tma.store_wait(0)  # the last item's store has read o_smem
            _partition_barrier()
            o_smem.store(o)
            fence_async_shared()
            _partition_barrier()
            row0 = tile * BLOCK_M + WG * HALF_M
            # Query rows outside the step's tokens are never written, whatever the metadata.
            inside = (row0 + HALF_M <= q_len) & (q_start + row0 >= 0) & (q_start + row0 + HALF_M <= num_tokens)
            if OUT_TMA & inside:
                _tma_store(o_desc, [q_start + row0, h * HEAD_DIM], o_smem)
            else:
                rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, row_layout))
                d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, row_layout))
                keep = (rows < q_len) & (q_start + rows < num_tokens) & (q_start + rows >= 0)
                ptrs = out_ptr + (q_start + rows).to(gl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :]
                gl.store(ptrs, o_smem.load(row_layout), mask=keep[:, None] & (d < HEAD_DIM)[None, :])
        if OUT_TMA:
            tma.store_wait(0)  # o_smem outlives the program's last store

    @gluon.jit(do_not_specialize=["num_blocks", "num_tokens", "table_width", "stride_bt", "max_tiles"])
    def _hopper_prefill_kernel(  # type: ignore[no-untyped-def]
        q_desc, k_desc, v_desc, o_desc, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_index_ptr,
        tile_count_ptr, out_ptr, qk_scale, num_blocks, num_tokens, table_width, max_tiles, stride_bt, stride_ot,
        stride_oh,
        NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
        COUNTED: gl.constexpr, OUT_TMA: gl.constexpr,
    ):  # fmt: skip
        """Persistent: program ``pid`` takes items ``pid, pid + grid, ...`` below ``max_tiles x
        NUM_HEADS`` (COUNTED: below ``tile_count[0]`` entries, read on the device and clamped to
        ``max_tiles``, so a fixed grid serves every step of a CUDA-graph bucket). The producer
        loads the next item's Q and key tiles while the consumers finish the last one."""
        if COUNTED:
            num_items = gl.minimum(gl.maximum(gl.load(tile_count_ptr), 0), max_tiles) * NUM_HEADS
        else:
            num_items = max_tiles * NUM_HEADS
        dtype: gl.constexpr = q_desc.dtype
        q_smem0 = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        q_smem1 = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        o_smem0 = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        o_smem1 = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(K_STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(k_empty.index(s), count=2)  # one arrive per consumer
        for s in gl.static_range(V_STAGES):
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(v_empty.index(s), count=2)
        mbarrier.init(q_bars.index(0), count=1)  # Q loaded (both halves)
        mbarrier.init(q_bars.index(1), count=2)  # Q free again: one arrive per consumer

        gl.warp_specialize(
            [
                (_consumer, (q_smem0, o_smem0, q_bars.index(0), q_bars.index(1), k_bufs, v_bufs, k_ready, k_empty,
                             v_ready, v_empty, out_ptr, o_desc, qk_scale, tile_index_ptr, seq_lens_ptr,
                             query_start_loc_ptr, num_items, table_width, num_tokens, stride_ot, stride_oh, 0,
                             NUM_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, K_STAGES, V_STAGES, OUT_TMA)),
                (_consumer, (q_smem1, o_smem1, q_bars.index(0), q_bars.index(1), k_bufs, v_bufs, k_ready, k_empty,
                             v_ready, v_empty, out_ptr, o_desc, qk_scale, tile_index_ptr, seq_lens_ptr,
                             query_start_loc_ptr, num_items, table_width, num_tokens, stride_ot, stride_oh, 1,
                             NUM_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, K_STAGES, V_STAGES, OUT_TMA)),
                (_producer, (q_desc, k_desc, v_desc, q_smem0, q_smem1, q_bars.index(0), q_bars.index(1), k_bufs,
                             v_bufs, k_ready, k_empty, v_ready, v_empty, block_tables_ptr, seq_lens_ptr,
                             query_start_loc_ptr, tile_index_ptr, num_items, stride_bt, table_width, num_blocks,
                             NUM_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, K_STAGES, V_STAGES)),
            ],
            [4, 4],  # consumer warpgroup 1, producer warpgroup (the default partition is consumer 0)
            [240, 24],  # registers per thread: 2 x 128 x 240 + 128 x 24 <= 64K
        )  # fmt: skip


def tma_rows_ok(t: torch.Tensor) -> bool:
    """Whether TMA can address ``t``'s rows: unit stride along the last dim, a 16-byte aligned
    row stride and base."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def out_takes_tma(out: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a kernel can store ``out`` [T, H, width] with TMA: ``dtype``, heads packed
    (head stride = width) and rows TMA can address."""
    return out.dtype == dtype and out.stride(1) == out.shape[2] and tma_rows_ok(out)


def _descriptors(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[Any, Any, Any, Any]:
    """Host TMA descriptors: the query and ``out`` as [tokens, heads * head_dim] rows (their own
    row strides; ``out`` only the query's token count), the caches as [num_blocks * block_size,
    kv_heads * head_dim] in boxes of :func:`kv_box_rows` rows. Without ``out`` the query's
    descriptor stands in for it (a kernel that stores without TMA never reads it)."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    dtype = gl.bfloat16 if query.dtype == torch.bfloat16 else gl.float16
    half_m = HOPPER_PREFILL_BLOCK_M // 2
    q_layout = shared_layout((half_m, head_dim), dtype)
    kv_layout = shared_layout((_BLOCK_N, head_dim), dtype)
    q_desc = TensorDescriptor(query, [num_tokens, num_heads * head_dim], [query.stride(0), 1], [half_m, head_dim],
                              q_layout)  # fmt: skip
    rows, cols = num_blocks * block_size, kv_heads * head_dim
    box = [kv_box_rows(block_size), head_dim]  # (the box's layout is the tile's: the same swizzle)
    k_desc = TensorDescriptor(k_cache, [rows, cols], [cols, 1], box, kv_layout)
    v_desc = TensorDescriptor(v_cache, [rows, cols], [cols, 1], box, kv_layout)
    o_desc = q_desc
    if out is not None:
        o_desc = TensorDescriptor(out, [num_tokens, num_heads * head_dim], [out.stride(0), 1], [half_m, head_dim],
                                  q_layout)  # fmt: skip
    return q_desc, k_desc, v_desc, o_desc


def hopper_prefill(
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
    programs: int,
    tile_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of every new token; writes and returns ``out``. The arguments
    are :func:`.prefill.paged_prefill`'s (``tile_index`` built with ``block_m``
    :data:`HOPPER_PREFILL_BLOCK_M`); the caller checked :func:`hopper_prefill_applies`.

    programs:   persistent programs (one per SM is the fastest: a program fills an SM's shared
                memory); the grid is ``min(programs, items)`` without ``tile_count``.
    tile_count: int32 [1] on the device: only its first entries (clamped to the index) are work,
                and the grid is ``programs`` whatever the step (CUDA graphs).
    """
    num_tiles = tile_index.shape[0]
    if num_tiles == 0:
        return out
    if programs < 1:
        raise ValueError(f"programs: {programs} must be >= 1")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    out_tma = out_takes_tma(out, query.dtype)
    q_desc, k_desc, v_desc, o_desc = _descriptors(query, k_cache, v_cache, out if out_tma else None)
    grid = programs if tile_count is not None else min(programs, num_tiles * num_heads)
    _hopper_prefill_kernel[(grid,)](
        q_desc, k_desc, v_desc, o_desc, block_tables, seq_lens, query_start_loc, tile_index,
        tile_count if tile_count is not None else seq_lens, out,
        softmax_scale * _LOG2E, num_blocks, query.shape[0], block_tables.shape[1], num_tiles, block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=HOPPER_PREFILL_BLOCK_M, BLOCK_N=_BLOCK_N, K_STAGES=_K_STAGES, V_STAGES=_V_STAGES,
        COUNTED=tile_count is not None, OUT_TMA=out_tma, num_warps=4,
    )  # fmt: skip
    return out
