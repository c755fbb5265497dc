"""The Hopper decode kernel's loop in turn with its TMA loads in a warp of their own.

In :mod:`.decode_hopper`'s loop in turn the four warps that run a tile's MMAs and softmax also
refill its ring: after each tile's P V MMAs they synchronise, read the next tile's block-table
entry and issue its TMA, with the barriers the compiler puts around those (five ``BAR.SYNC`` a
tile in all at block 256). Here (``DecodeConfig.hopper_ws_loader``) a loader warp walks the
chunk's tiles on its own: it waits until a ring slot is free (an ``empty`` barrier the MMA
warps arrive on when they are done with it), reads the tile's block id and issues its K and V
boxes, signalling ``ready``; the MMA warps only wait on ``ready``, compute, and arrive on
``empty``. Same items, tiles, trims, V guard, outputs and partials as the loop in turn (the
helpers are :mod:`.decode_hopper`'s), so the combine and the schedules are unchanged.

The loader is a warp of its own (48 registers; Triton pads it to a warpgroup), the MMA warps
up to 232 registers, and :func:`.decode_hopper.launch_decode_hopper` (``ws_loader=True``) caps
the launch at 128 registers a thread (``maxnreg``): two programs an SM, as the loop in turn
(106 KiB of shared memory each at three stages).
"""

from __future__ import annotations

from attention.triton_kernels.prefill_hopper import _GLUON

if _GLUON:
    from attention.triton_kernels.decode_hopper import (
        UNSPECIALIZED_ARGS,
        _allocate_buffers,
        _allocate_max_buf,
        _item_fields,
        _load_tile,
        _loop_state,
        _paired,
        _stage_query,
        _state_layout,
        _store_result,
        _tile_in_turn,
    )
    from attention.triton_kernels.prefill_hopper import (
        _partition_barrier,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
    )

__all__: list[str] = []  # launched by decode_hopper.launch_decode_hopper(ws_loader=True)


if _GLUON:

    @gluon.jit
    def _loader(  # type: ignore[no-untyped-def]
        k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, empty, first, n_tiles, kv_end, table_row,
        row_ok, table_width, num_blocks, kvh, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_KV_HEADS: gl.constexpr, PART: gl.constexpr,
        FP8: gl.constexpr, TRIM_LOADS: gl.constexpr,
    ):  # fmt: skip
        """Tile ``j`` of the chunk into slot ``j % STAGES`` once the MMA warps freed it (the
        first STAGES slots pass: a fresh barrier's previous phase counts as done)."""
        for j in range(n_tiles):
            mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
            _load_tile(k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, j, first, kv_end, table_row,
                       row_ok, table_width, num_blocks, kvh, STAGES, BLOCK_N, BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS,
                       PART, FP8, True, True, 0, TRIM_LOADS)  # fmt: skip

    @gluon.jit
    def _mma_partition(  # type: ignore[no-untyped-def]
        q_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_o_ptr, part_lse_ptr, q_bufs, k_bufs, p_bufs, v_bufs, ready,
        empty, max_buf, qk_scale, kvh, slot, token, token_ok, q_len, first, n_tiles, kv_start, kv_end, table_row,
        row_ok, table_width, num_blocks, num_partial_slots, stride_qt, stride_qh, stride_ot, stride_oh,
        NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr,
        P_LO: gl.constexpr, FUSE: gl.constexpr,
    ):  # fmt: skip
        """The query's staging, then per tile (:func:`.decode_hopper._tile_in_turn`): wait for its
        slot, S MMAs, softmax, P (and the V guard), P V MMAs, release of the slot; then the chunk's
        result."""
        FP8: gl.constexpr = k_bufs.dtype == gl.float8e4nv
        FUSED: gl.constexpr = FUSE and FP8
        PAIRED: gl.constexpr = _paired(BLOCK_H, FUSED)
        s_layout: gl.constexpr = _state_layout(BLOCK_H, FP8, PAIRED, BLOCK_N)
        col_scale = _stage_query(q_ptr, k_scale_ptr, q_bufs, kvh, token, token_ok, qk_scale, stride_qt, stride_qh,
                                 GROUP, BLOCK_H, HEAD_DIM, s_layout, PAIRED)  # fmt: skip
        fence_async_shared()
        _partition_barrier()

        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        s_zero, m_i, l_part, o = _loop_state(BLOCK_N, BLOCK_H, HEAD_DIM, FP8, FUSED, P_LO)
        for j in range(n_tiles):
            s_slot = j % STAGES
            o, m_i, l_part = _tile_in_turn(
                q_bufs, k_bufs, p_bufs, v_bufs, ready, s_slot, (j // STAGES) & 1, first + j * BLOCK_N, o, m_i, l_part,
                s_zero, col_scale, offs_n, kv_start, kv_end, table_row, row_ok, table_width, num_blocks, max_buf,
                BLOCK_N, HEAD_DIM, BLOCK_SIZE, PART, P_LO, FUSED,
            )  # fmt: skip
            _partition_barrier()  # every MMA warp is done with the slot and with P
            mbarrier.arrive(empty.index(s_slot))

        _store_result(o, m_i, l_part, v_scale_ptr, out_ptr, part_o_ptr, part_lse_ptr, kvh, slot, token, token_ok,
                      q_len, num_partial_slots, stride_ot, stride_oh, NUM_HEADS, GROUP, BLOCK_H, HEAD_DIM, FP8,
                      s_layout, PAIRED)  # fmt: skip

    @gluon.jit(do_not_specialize=UNSPECIALIZED_ARGS)
    def _decode_hopper_ws_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_desc, v_desc, k_half_desc, v_half_desc, k_scale_ptr, v_scale_ptr, block_tables_ptr, items_ptr,
        out_ptr, part_o_ptr, part_lse_ptr, qk_scale, num_item_slots, num_table_rows, table_width, num_blocks,
        num_q_tokens, num_partial_slots, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
        NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_H: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr,
        PART: gl.constexpr, TRIM: gl.constexpr, P_LO: gl.constexpr, FUSE: gl.constexpr,
    ):  # fmt: skip
        """Program (kv_head, i), arguments and results as
        :func:`.decode_hopper._decode_hopper_kernel`'s loop in turn, on the partitions of the
        module docstring."""
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
        FP8: gl.constexpr = k_desc.dtype == gl.float8e4nv
        PARTS: gl.constexpr = BLOCK_N // PART
        q_bufs, k_bufs, p_bufs, v_bufs = _allocate_buffers(k_desc, v_desc, BLOCK_H, HEAD_DIM, BLOCK_N, STAGES, PART, 1)
        # (A one-part fp8 tile is not trimmed, as in decode_hopper's loop in turn.)
        TRIM_LOADS: gl.constexpr = TRIM and not (FP8 and PARTS == 1)
        max_buf = _allocate_max_buf(BLOCK_H)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=1)

        gl.warp_specialize(
            [
                (_mma_partition, (q_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_o_ptr, part_lse_ptr, q_bufs, k_bufs,
                                  p_bufs, v_bufs, ready, empty, max_buf, qk_scale, kvh, slot, token, token_ok, q_len,
                                  first, n_tiles, kv_start, kv_end, table_row, row_ok, table_width, num_blocks,
                                  num_partial_slots, stride_qt, stride_qh, stride_ot, stride_oh, NUM_HEADS, GROUP,
                                  BLOCK_H, HEAD_DIM, BLOCK_N, BLOCK_SIZE, STAGES, PART, P_LO, FUSE)),
                (_loader, (k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, empty, first, n_tiles,
                           kv_end, table_row, row_ok, table_width, num_blocks, kvh, STAGES, BLOCK_N, BLOCK_SIZE,
                           HEAD_DIM, NUM_KV_HEADS, PART, FP8, TRIM_LOADS)),
            ],
            [1],  # the loader (the default partition, the kernel's 4 warps, runs the MMAs)
            [48],  # registers per loader thread
        )  # fmt: skip

