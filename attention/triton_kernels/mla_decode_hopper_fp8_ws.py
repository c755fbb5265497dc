"""MLA decode on Hopper over an fp8 latent with the conversion in a partition of its own.

The computation of :mod:`.mla_decode_hopper_fp8` (same schedule, same results), its per-tile
work spread over three partitions that run side by side:

- a loader (4 warps, few registers) walks the program's segments and refills each fp8 slot of
  the ring as soon as both its readers are done with it, across the program's tokens;
- a converter (a warpgroup) turns each tile's 512 channels into fp16 in one of two buffers (the
  one the P V MMAs of two tiles back have finished with), zeroing latents past the token's
  length, then frees the fp8 slot;
- the MMA warpgroup (the default partition) runs the score MMAs on the fp8 slot as loaded
  against the query split hi + lo, frees the slot, runs the softmax, and the P V MMAs on the
  converted buffer once the converter has filled it; per segment it stages the query and stores
  the result: a plan of partial slots from the MMA's register layout; a ``direct`` plan (a token
  of one segment normalized into the output, the others into slots) through the query's
  buffers, free at a segment's end (stored from registers that path spilled, 0.92x the speed).

In :mod:`.mla_decode_hopper_fp8` one warpgroup converts, multiplies and waits for loads in turn;
there the conversion was the largest single part of the loop (H200: 0.04 of 0.109 ms at
64 x 4096, ``benchmarks/results/mla-decode-fp8-hopper-2026-12-06.md``). Here, on an H100 (same
file, among layers, 16 heads): 1.41x / 1.42x / 1.36x the bf16 latent's speed at 64 x 4096 /
LogNormal-128 / 512 x 512, 1.23-1.36x the one-warpgroup kernel's; on direct plans (2,048 x 1,024
and 2,048 LogNormal(1024) rows) 1.40x / 1.43x, 1.25-1.26x the one-warpgroup kernel's
(``benchmarks/results/mla-decode-fp8-direct-h100-2026-12-06.md``); not yet timed on an H200.

Shared memory: the fp8 ring of two tiles (72 KiB), two fp16 buffers of a tile's 512 channels
(128 KiB), the query's hi and lo parts (18 KiB) and P (2 KiB): 220 KiB, one program an SM.
The three partitions walk the same segments with the same clamps, so every buffer is waited on
as often as it is filled.
"""

from __future__ import annotations

from attention.triton_kernels.mla_balanced import program_work
from attention.triton_kernels.prefill_hopper import _GLUON

if _GLUON:
    from attention.triton_kernels.mla_decode_hopper_fp8 import (
        _allocate_buffers,
        _begin_segment,
        _issue_scores,
        _pv,
        _tile_to_f16,
    )
    from attention.triton_kernels.mla_decode_hopper_split import _segment, _store_half_slot
    from attention.triton_kernels.mla_hopper_stores import load_tile_at, table_page, tile_softmax
    from attention.triton_kernels.prefill_hopper import (
        _partition_barrier,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        warpgroup_mma_wait,
    )

__all__ = ["FP8_WS_STAGES"]

#: fp8 tiles in the ring.
FP8_WS_STAGES = 2

if _GLUON:

    @gluon.jit
    def _loader(  # type: ignore[no-untyped-def]
        c_desc, e_desc, c_bufs, e_bufs, ready, empty, table_ptr, rows_ptr, lens_ptr, work_ptr, num_tokens,
        num_rows, num_blocks, table_width, HALF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        STAGES: gl.constexpr,
    ):  # fmt: skip
        """Each tile of the program's segments into the ring, once its slot's readers (the
        score MMAs and the converter) freed it (block id read before the wait)."""
        g0, g1, t0, t_stop, _slot0, _slots = program_work(work_ptr, num_tokens, gl.program_id(0), gl.num_programs(0))
        c = 0  # tiles loaded (the ring position)
        for t in range(t0, t_stop):
            has, _seg_start, start, _end, n_tiles, table_row = _segment(
                work_ptr, rows_ptr, lens_ptr, table_ptr, t, g0, g1, num_rows, table_width, BLOCK_SIZE, BLOCK_N
            )  # fmt: skip
            if has:
                for j in range(n_tiles):
                    pos = c + j
                    n0 = start + j * BLOCK_N
                    page = table_page(table_row, n0, table_width, BLOCK_SIZE)
                    mbarrier.wait(empty.index(pos % STAGES), ((pos // STAGES) & 1) ^ 1)  # a fresh slot passes
                    load_tile_at(c_desc, e_desc, c_bufs, e_bufs, ready, pos, page, n0, num_blocks, HALF, STAGES,
                                 BLOCK_SIZE)  # fmt: skip
                c += n_tiles

    @gluon.jit
    def _converter(  # type: ignore[no-untyped-def]
        c_bufs, h_bufs, ready, empty, h_ready, h_empty, table_ptr, rows_ptr, lens_ptr, work_ptr, num_tokens,
        num_rows, num_blocks, table_width, HALF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        STAGES: gl.constexpr,
    ):  # fmt: skip
        """Each tile's 512 channels into fp16 buffer ``pos % 2`` (once the P V MMAs of two tiles
        back are done with it), latents past the row zeroed; then the fp8 slot is freed."""
        g0, g1, t0, t_stop, _slot0, _slots = program_work(work_ptr, num_tokens, gl.program_id(0), gl.num_programs(0))
        c = 0
        for t in range(t0, t_stop):
            has, _seg_start, start, end, n_tiles, table_row = _segment(
                work_ptr, rows_ptr, lens_ptr, table_ptr, t, g0, g1, num_rows, table_width, BLOCK_SIZE, BLOCK_N
            )  # fmt: skip
            if has:
                for j in range(n_tiles):
                    pos = c + j
                    slot = pos % STAGES
                    hb = pos % 2
                    n0 = start + j * BLOCK_N
                    page = table_page(table_row, n0, table_width, BLOCK_SIZE)
                    valid = gl.where((page >= 0) & (page < num_blocks), end - n0, 0)
                    mbarrier.wait(h_empty.index(hb), ((pos // 2) & 1) ^ 1)  # the first two pass
                    mbarrier.wait(ready.index(slot), (pos // STAGES) & 1)
                    _tile_to_f16(c_bufs.index(2 * slot), h_bufs.index(2 * hb), valid, BLOCK_N, HALF)
                    _tile_to_f16(c_bufs.index(2 * slot + 1), h_bufs.index(2 * hb + 1), valid, BLOCK_N, HALF)
                    fence_async_shared()
                    _partition_barrier()  # every warp's stores are visible to the MMAs; the slot is read
                    mbarrier.arrive(h_ready.index(hb))
                    mbarrier.arrive(empty.index(slot))
                c += n_tiles

    @gluon.jit
    def _store_result(  # type: ignore[no-untyped-def]
        acc_ptr, ml_ptr, out_ptr, token_slots, t, slot_id, num_slots, num_heads, stride_ot, stride_oh, offs_h,
        head_ok, o_a, o_b, m_i, l_i, q_bufs, HALF: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """A segment's result (O^T halves [HALF, heads] in the MMA's layout, scaled): the partial
        output, max and sum into slot ``slot_id`` (nothing outside the buffer); under ``DIRECT``
        a token of one segment (its count in ``token_slots``) normalized into its row of ``out``
        instead, and every output through shared memory (:func:`_store_staged`; stored from the
        MMA's layout the direct path spilled registers, 0.92x the speed)."""
        if DIRECT:
            if gl.load(token_slots + 2 * t + 1) == 1:
                inv = 1.0 / gl.where(l_i > 0, l_i, 1.0)
                out_row = out_ptr + t.to(gl.int64) * stride_ot
                _store_staged(o_a * inv[None, :], out_row, stride_oh, head_ok, q_bufs, HALF)
                _store_staged(o_b * inv[None, :], out_row + HALF, stride_oh, head_ok, q_bufs, HALF)
            else:
                slot_ok = (slot_id >= 0) & (slot_id < num_slots)
                keep = head_ok & slot_ok
                first = gl.where(slot_ok, slot_id, 0).to(gl.int64) * num_heads
                _store_staged(o_a, acc_ptr + first * (2 * HALF), 2 * HALF, keep, q_bufs, HALF)
                _store_staged(o_b, acc_ptr + first * (2 * HALF) + HALF, 2 * HALF, keep, q_bufs, HALF)
                idx = first + offs_h.to(gl.int64)
                gl.store(ml_ptr + idx * 2, m_i, mask=keep)
                gl.store(ml_ptr + idx * 2 + 1, l_i, mask=keep)
        else:  # (from the MMA's layout: through shared memory ran 0.98x here)
            _store_half_slot(acc_ptr, ml_ptr, slot_id, num_slots, num_heads, offs_h, head_ok, o_a, m_i, l_i, HALF, 0)
            _store_half_slot(acc_ptr, ml_ptr, slot_id, num_slots, num_heads, offs_h, head_ok, o_b, m_i, l_i, HALF, 1)

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # (Triton 3.7 on; before, "_reinterpret")

        @gluon.jit
        def _view_as(buf, dtype: gl.constexpr, rows: gl.constexpr, cols: gl.constexpr, layout: gl.constexpr):  # type: ignore[no-untyped-def]
            """``buf``'s bytes as a [rows, cols] buffer of ``dtype`` in ``layout``."""
            return buf.reinterpret(dtype, [rows, cols], layout)

    else:

        @gluon.jit
        def _view_as(buf, dtype: gl.constexpr, rows: gl.constexpr, cols: gl.constexpr, layout: gl.constexpr):  # type: ignore[no-untyped-def]
            """``buf``'s bytes as a [rows, cols] buffer of ``dtype`` in ``layout``."""
            return buf._reinterpret(dtype, [rows, cols], layout)

    @gluon.jit
    def _store_staged(o, base, head_stride, keep, q_bufs, HALF: gl.constexpr):  # type: ignore[no-untyped-def]
        """O^T [HALF, heads] in the MMA's layout to ``base + head * head_stride + channel`` (in
        ``base``'s dtype, 16 or 32 bits) where ``keep`` [heads], through the query's buffers
        (16 KiB, unused between a segment's last score MMA and the next segment's staging), so
        each thread stores 16 contiguous bytes at a time."""
        heads: gl.constexpr = o.type.shape[1]
        dtype: gl.constexpr = base.dtype.element_ty
        stage = _view_as(q_bufs, dtype, HALF, heads, gl.SwizzledSharedLayout(1, 1, 1, [0, 1]))
        stage.store(o.to(dtype))
        _partition_barrier()
        rows: gl.constexpr = 128 // dtype.primitive_bitwidth  # 16 bytes a thread
        wide: gl.constexpr = gl.BlockedLayout([rows, 1], [32, 1], [1, 4], [0, 1])
        channels = gl.arange(0, HALF, layout=gl.SliceLayout(1, wide))
        head_offs = gl.arange(0, heads, layout=gl.SliceLayout(0, wide)) * head_stride
        mask = gl.convert_layout(keep, gl.SliceLayout(0, wide))[None, :] & (channels < HALF)[:, None]
        gl.store(base + head_offs[None, :] + channels[:, None], stage.load(wide), mask=mask)
        _partition_barrier()  # every warp has read the buffer (the next segment's query goes there)

    @gluon.jit
    def _mma_partition(  # type: ignore[no-untyped-def]
        q_ptr, kv_scale_ptr, q_bufs, qe_bufs, c_bufs, e_bufs, h_bufs, p_buf, ready, empty, h_ready, h_empty,
        table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, out_ptr, num_tokens, num_slots, num_rows,
        num_heads, num_blocks, table_width, scale_log2, stride_ot, stride_oh, HALF: gl.constexpr,
        ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        STAGES: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """Per segment the query's staging; per tile the score MMAs on the fp8 slot, its release,
        the softmax and the P V MMAs on the converted channels; per segment its result
        (:func:`_store_result`)."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
        )
        kv_scale = gl.load(kv_scale_ptr)
        g0, g1, t0, t_stop, first_slot, token_slots = program_work(
            work_ptr, num_tokens, gl.program_id(0), gl.num_programs(0)
        )
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, o_layout))
        head_ok = offs_h < num_heads
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)
        c = 0  # tiles consumed (the ring position)
        for t in range(t0, t_stop):
            has, seg_start, start, end, n_tiles, table_row = _segment(
                work_ptr, rows_ptr, lens_ptr, table_ptr, t, g0, g1, num_rows, table_width, BLOCK_SIZE, BLOCK_N
            )  # fmt: skip
            if has:
                # (every score MMA of the previous segment was waited for)
                col, m_i, l_part, o_a, o_b = _begin_segment(
                    q_ptr, t, num_heads, q_bufs, qe_bufs, scale_log2 * kv_scale, HALF, ROPE, BLOCK_H, BLOCK_N, s_layout,
                    o_layout,
                )  # fmt: skip
                for j in range(n_tiles):
                    pos = c + j
                    slot = pos % STAGES
                    hb = pos % 2
                    n0 = start + j * BLOCK_N
                    page = table_page(table_row, n0, table_width, BLOCK_SIZE)
                    mbarrier.wait(ready.index(slot), (pos // STAGES) & 1)
                    s = _issue_scores(c_bufs.index(2 * slot), c_bufs.index(2 * slot + 1), e_bufs.index(slot), q_bufs,
                                      qe_bufs, s_zero)  # fmt: skip
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                    _partition_barrier()  # every warp's score MMAs are done with the slot
                    mbarrier.arrive(empty.index(slot))
                    p, alpha, m_i, l_part, _valid = tile_softmax(
                        s * col[None, :], page, n0, end, m_i, l_part, offs_n, num_blocks, 1.0
                    )  # (l_part: summed over the latents once, after the loop)
                    p_buf.store(p.to(gl.float16))
                    mbarrier.wait(h_ready.index(hb), (pos // 2) & 1)
                    fence_async_shared()
                    _partition_barrier()
                    o_a, o_b = _pv(h_bufs.index(2 * hb), h_bufs.index(2 * hb + 1), p_buf, o_a, o_b, alpha, o_layout)
                    _partition_barrier()  # every warp is done with the fp16 buffer and P
                    mbarrier.arrive(h_empty.index(hb))
                c += n_tiles

                l_i = gl.convert_layout(gl.sum(l_part, 0), gl.SliceLayout(0, o_layout))
                m_o = gl.convert_layout(m_i, gl.SliceLayout(0, o_layout))
                slot_id = gl.where(seg_start == g0, first_slot, gl.load(token_slots + 2 * t))
                _store_result(acc_ptr, ml_ptr, out_ptr, token_slots, t, slot_id, num_slots, num_heads, stride_ot,
                              stride_oh, offs_h, head_ok, o_a * kv_scale, o_b * kv_scale, m_o, l_i, q_bufs, HALF,
                              DIRECT)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_tokens", "num_slots", "num_rows", "num_blocks", "table_width"])
    def _mla_hopper_fp8_ws_kernel(  # type: ignore[no-untyped-def]
        q_ptr, c_desc, e_desc, kv_scale_ptr, table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, out_ptr,
        num_tokens, num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2, stride_ot, stride_oh,
        HALF: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """Program ``pid`` of the balanced work array over an fp8 latent, as
        :func:`.mla_decode_hopper_fp8._mla_hopper_fp8_kernel` (same arguments, same results),
        on the partitions of the module docstring."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
        q_bufs, qe_bufs, c_bufs, e_bufs, h_bufs, p_buf = _allocate_buffers(
            c_desc, e_desc, HALF, ROPE, BLOCK_H, BLOCK_N, STAGES, 2
        )  # (two tiles' channels in fp16: the converter fills one while the MMAs read the other)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        h_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        h_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # the score MMAs and the converter
        for i in gl.static_range(2):
            mbarrier.init(h_ready.index(i), count=1)
            mbarrier.init(h_empty.index(i), count=1)

        if DIRECT:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
            out_args = (out_ptr, stride_ot, stride_oh)
        else:  # (unused: Triton 3.6 fails to lower a partition's argument that nothing reads)
            out_args = (0, 0, 0)
        gl.warp_specialize(
            [
                (_mma_partition, (q_ptr, kv_scale_ptr, q_bufs, qe_bufs, c_bufs, e_bufs, h_bufs, p_buf, ready, empty,
                                  h_ready, h_empty, table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr,
                                  out_args[0], num_tokens, num_slots, num_rows, num_heads, num_blocks, table_width,
                                  scale_log2, out_args[1], out_args[2], HALF, ROPE, BLOCK_H, BLOCK_N, BLOCK_SIZE,
                                  STAGES, DIRECT)),
                (_converter, (c_bufs, h_bufs, ready, empty, h_ready, h_empty, table_ptr, rows_ptr, lens_ptr, work_ptr,
                              num_tokens, num_rows, num_blocks, table_width, HALF, BLOCK_N, BLOCK_SIZE, STAGES)),
                (_loader, (c_desc, e_desc, c_bufs, e_bufs, ready, empty, table_ptr, rows_ptr, lens_ptr, work_ptr,
                           num_tokens, num_rows, num_blocks, table_width, HALF, BLOCK_N, BLOCK_SIZE, STAGES)),
            ],
            [4, 4],  # the converter, the loader (the default partition runs the MMAs)
            [152, 24],  # registers per thread: 128 x (<= 255 + 152 + 24) <= 64K
        )  # fmt: skip
