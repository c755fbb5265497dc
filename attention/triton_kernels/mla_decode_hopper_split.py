"""MLA decode on Hopper with the latent's channels split between two warpgroups and the loads
in a producer partition of their own: the kernel of :mod:`.mla_decode_hopper` (same schedule,
same results) with its per-tile work halved. Opt-in (``MLALaunch.hopper_split``,
``TritonBackend(hopper_mla_split=True)``): on an H100 it ran at 1.00x the two-tile kernel's
speed (``benchmarks/results/mla-decode-split-h100-2026-12-06.md``); not yet timed on an H200.
Plans of partial slots only (a ``direct`` plan, planned where the slots would pass 64 MB, runs
the two-tile kernel).

Why it was tried: the single-warpgroup kernel holds a latent slot for the whole of a tile's
work (three score MMAs over 576 channels, the softmax, two P V MMAs over 512), one warp per
scheduler, and refills the slot only then. On an H200
(``benchmarks/results/mla-decode-ceiling-h200-2026-12-06.md``) its loads alone run at 94-97%
of the copy rate where the kernel reaches 83-85%. Halving the per-tile work did not close that
gap, so the per-tile compute is not what holds the loop back.

Here, per tile:

- warpgroup 0 computes the partial scores over the latent's first 256 channels and its 64
  rotary ones, warpgroup 1 over channels 256-511 (S^T = L Q^T, [64 latents, 16 heads], MMAs
  from shared memory as before); each stores its partial to shared memory, both meet at a
  named barrier, and each adds the other's (the same sum in both: fp32 addition commutes);
- both run the same online softmax; each stores its own P and runs the P V MMAs of its own
  half of the output (O^T, [256 channels, 16 heads]), then frees the slot (an ``empty``
  barrier counting both);
- a producer partition (4 warps, few registers) walks the program's segments on its own and
  refills each slot as soon as both warpgroups freed it, across the program's tokens, with each
  segment's query in one of two buffers (so a token's first tiles and query are in flight
  while the previous token's last tiles are computed).

Shared memory: the ring of two 64-latent tiles (147 KiB), two query buffers (36 KiB), the
partial scores (2 warpgroups x 2 tiles x 4 KiB) and P (2 x 2 KiB): 201 KiB, one program an SM.
Outputs are stored from the MMA's register layout (a layout change through shared memory would
not fit). Compiled for sm_90 (``tests/test_mla_decode_hopper_split_compile.py``): 68 warpgroup
MMAs a tile as before, no register spills.

Safety as in :mod:`.mla_decode_hopper`: lengths clamped to the table, block ids outside
``[0, num_blocks)`` read block 0 and mask their latents, latent rows past a token's length are
zeroed in shared memory (each warpgroup its own half) before P V reads them, slots outside the
partial buffers are not stored. The producer and the warpgroups walk the same segments with the
same clamps, so every buffer is waited on as often as it is filled, and nothing is in flight
when the program ends.
"""

from __future__ import annotations

from attention.triton_kernels.mla_balanced import program_work
from attention.triton_kernels.prefill_hopper import _GLUON

if _GLUON:
    from attention.triton_kernels.mla_decode_hopper_ring import _segment_extent
    from attention.triton_kernels.mla_hopper_stores import tile_softmax, zero_latents_from
    from attention.triton_kernels.prefill_hopper import (
        _partition_barrier,
        _tma_load,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = ["SPLIT_STAGES"]

#: Latent tiles in the ring.
SPLIT_STAGES = 2

if _GLUON:
    # Named barrier 8: the two warpgroups' partial scores are in shared memory (256 threads).
    # Triton's own partition barriers use the low ids.
    _MEET = gl.constexpr("bar.sync 8, 256; mov.u32 $0, $1;")

    @gluon.jit
    def _meet(token):  # type: ignore[no-untyped-def]
        """Both warpgroups reach here before either goes on (orders shared-memory stores)."""
        return gl.inline_asm_elementwise(_MEET, "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _segment(work_ptr, rows_ptr, lens_ptr, table_ptr, t, g0, g1, num_rows, table_width,  # type: ignore[no-untyped-def]
                 BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """Token ``t``'s segment of the program's range ``[g0, g1)`` (the ring kernel's
        :func:`_segment_extent`): whether it has one, its first tile, its latents ``[start,
        end)``, its tile count and its table row."""
        seg_start, seg_end, start, end, table_row = _segment_extent(
            work_ptr, rows_ptr, lens_ptr, table_ptr, t, g0, g1, num_rows, table_width, BLOCK_SIZE, BLOCK_N
        )  # fmt: skip
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        return seg_end > seg_start, seg_start, start, end, n_tiles, table_row

    @gluon.jit
    def _producer(  # type: ignore[no-untyped-def]
        q_desc, qe_desc, c_desc, e_desc, q_bufs, qe_bufs, c_bufs, e_bufs, q_ready, q_empty, ready, empty,
        table_ptr, rows_ptr, lens_ptr, work_ptr, num_tokens, num_rows, num_heads, num_blocks, table_width,
        HALF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """Each segment's query (once both warpgroups are done with the one two segments back),
        then its tiles, each once both warpgroups freed its slot (block id read before the wait)."""
        g0, g1, t0, t_stop, _slot0, _slots = program_work(work_ptr, num_tokens, gl.program_id(0), gl.num_programs(0))
        c = 0  # tiles loaded (the ring position)
        segs = 0  # segments loaded (the query buffers' position)
        for t in range(t0, t_stop):
            has, _seg_start, start, _end, n_tiles, table_row = _segment(
                work_ptr, rows_ptr, lens_ptr, table_ptr, t, g0, g1, num_rows, table_width, BLOCK_SIZE, BLOCK_N
            )  # fmt: skip
            if has:
                qb = segs % 2
                mbarrier.wait(q_empty.index(qb), ((segs // 2) & 1) ^ 1)  # the first two pass
                bar = q_ready.index(qb)
                mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + qe_desc.block_type.nbytes)
                q_row = t * num_heads  # rows of other tokens past num_heads are never stored
                _tma_load(q_desc, [q_row, 0], bar, q_bufs.index(2 * qb))
                _tma_load(q_desc, [q_row, HALF], bar, q_bufs.index(2 * qb + 1))
                _tma_load(qe_desc, [q_row, 2 * HALF], bar, qe_bufs.index(qb))
                for j in range(n_tiles):
                    pos = c + j
                    slot = pos % STAGES
                    n0 = start + j * BLOCK_N
                    page = gl.load(table_row + gl.minimum(n0 // BLOCK_SIZE, table_width - 1))
                    page = gl.where((page >= 0) & (page < num_blocks), page, 0)
                    first = page * BLOCK_SIZE + n0 % BLOCK_SIZE
                    mbarrier.wait(empty.index(slot), ((pos // STAGES) & 1) ^ 1)  # a fresh slot passes
                    tile_bar = ready.index(slot)
                    mbarrier.expect(tile_bar, 2 * c_desc.block_type.nbytes + e_desc.block_type.nbytes)
                    _tma_load(c_desc, [first, 0], tile_bar, c_bufs.index(2 * slot))
                    _tma_load(c_desc, [first, HALF], tile_bar, c_bufs.index(2 * slot + 1))
                    _tma_load(e_desc, [first, 2 * HALF], tile_bar, e_bufs.index(slot))
                c += n_tiles
                segs += 1

    @gluon.jit
    def _store_half(o, base, head_offs, keep, col0, HALF: gl.constexpr):  # type: ignore[no-untyped-def]
        """Channels ``col0 ..`` of an output held as O^T [HALF, heads] in the MMA's layout to
        ``base + head_offs[head] + channel`` (``head_offs``: int32 [heads] in the layout's column
        slice) where ``keep``; stored from the MMA's layout (no layout change through shared
        memory, which this kernel has none left for) with 32-bit offsets from one base."""
        r = gl.arange(0, HALF, layout=gl.SliceLayout(1, o.type.layout))
        offs = head_offs[None, :] + (col0 + r)[:, None]
        gl.store(base + offs, o.to(base.dtype.element_ty), mask=keep[None, :] & (r < HALF)[:, None])

    @gluon.jit
    def _store_half_slot(  # type: ignore[no-untyped-def]
        acc_ptr, ml_ptr, slot_id, num_slots, num_heads, offs_h, head_ok, o, m_i, l_i,
        HALF: gl.constexpr, WG: gl.constexpr,
    ):  # fmt: skip
        """Warpgroup ``WG``'s half of a segment's partial output into slot ``slot_id`` (nothing
        for a slot outside the buffer); warpgroup 0 also stores the max and sum per head."""
        slot_ok = (slot_id >= 0) & (slot_id < num_slots)
        keep = head_ok & slot_ok
        first = gl.where(slot_ok, slot_id, 0).to(gl.int64) * num_heads
        _store_half(o, acc_ptr + first * (2 * HALF), offs_h * (2 * HALF), keep, WG * HALF, HALF)
        if WG == 0:
            idx = first + offs_h.to(gl.int64)
            gl.store(ml_ptr + idx * 2, m_i, mask=keep)
            gl.store(ml_ptr + idx * 2 + 1, l_i, mask=keep)

    @gluon.jit
    def _consumer(  # type: ignore[no-untyped-def]
        q_bufs, qe_bufs, c_bufs, e_bufs, s_bufs, p_buf, q_ready, q_empty, ready, empty,
        table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr,
        num_tokens, num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2,
        WG: gl.constexpr, HALF: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """Warpgroup ``WG``: per tile its partial scores (channels ``WG * HALF ..``; warpgroup 0
        also the rotary ones), the exchange, the softmax and the P V MMAs of its output half;
        per segment its half of the result."""
        dtype: gl.constexpr = c_bufs.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
        )
        g0, g1, t0, t_stop, first_slot, token_slots = program_work(
            work_ptr, num_tokens, gl.program_id(0), gl.num_programs(0)
        )
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, s_layout))
        head_ok = offs_h < num_heads
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)
        token = gl.full([128], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
        c = 0  # tiles consumed (the ring position)
        segs = 0  # segments consumed (the query buffers' position)
        for t in range(t0, t_stop):
            has, seg_start, start, end, n_tiles, table_row = _segment(
                work_ptr, rows_ptr, lens_ptr, table_ptr, t, g0, g1, num_rows, table_width, BLOCK_SIZE, BLOCK_N
            )  # fmt: skip
            if has:
                qb = segs % 2
                q_mine = q_bufs.index(2 * qb + WG)
                mbarrier.wait(q_ready.index(qb), (segs // 2) & 1)
                m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
                l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)  # row sums, per thread
                o = gl.zeros([HALF, BLOCK_H], gl.float32, s_layout)
                for j in range(n_tiles):
                    pos = c + j
                    slot = pos % STAGES
                    n0 = start + j * BLOCK_N
                    # The tile's block id, read before the wait (its latency off the S -> softmax path).
                    page = gl.load(table_row + gl.minimum(n0 // BLOCK_SIZE, table_width - 1))
                    lat = c_bufs.index(2 * slot + WG)
                    mbarrier.wait(ready.index(slot), (pos // STAGES) & 1)
                    s = warpgroup_mma(lat, q_mine.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    if WG == 0:
                        s = warpgroup_mma(e_bufs.index(slot), qe_bufs.index(qb).permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                    # The exchange: each half's partial scores in shared memory, then the sum.
                    s_bufs.index(2 * (pos % 2) + WG).store(s)
                    token = _meet(token)
                    s = s + s_bufs.index(2 * (pos % 2) + 1 - WG).load(s_layout)
                    p, alpha, m_i, l_part, valid = tile_softmax(
                        s, page, n0, end, m_i, l_part, offs_n, num_blocks, scale_log2
                    )  # (l_part: summed over the latents once, after the loop)
                    if valid < BLOCK_N:  # stale latents past the row (or a bad block): zeros for P V
                        zero_latents_from(lat, valid, BLOCK_N, HALF)
                    p_buf.store(p.to(dtype))
                    fence_async_shared()
                    _partition_barrier()
                    o = warpgroup_mma(lat.permute((1, 0)), p_buf, o * alpha[None, :], is_async=True)
                    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                    _partition_barrier()  # every warp is done with P (and with the slot's half)
                    mbarrier.arrive(empty.index(slot))
                c += n_tiles
                mbarrier.arrive(q_empty.index(qb))  # every S of the segment is done
                segs += 1

                l_i = gl.sum(l_part, 0)
                slot_id = gl.where(seg_start == g0, first_slot, gl.load(token_slots + 2 * t))
                _store_half_slot(acc_ptr, ml_ptr, slot_id, num_slots, num_heads, offs_h, head_ok, o, m_i, l_i, HALF,
                                 WG)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_tokens", "num_slots", "num_rows", "num_blocks", "table_width"])
    def _mla_hopper_split_kernel(  # type: ignore[no-untyped-def]
        q_desc, qe_desc, c_desc, e_desc, table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, out_ptr,
        num_tokens, num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2, stride_ot, stride_oh,
        HALF: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """Program ``pid`` of the balanced work array, as ``_mla_hopper_kernel`` (same
        arguments, same results) for a plan of partial slots only (``DIRECT`` False: ``out``
        and its strides are not used), on the partitions of the module docstring: warpgroup 0
        (the default partition), warpgroup 1 and the producer (4 warps each)."""
        gl.static_assert(not DIRECT, "the split kernel stores partial slots; a direct plan runs the two-tile kernel")
        dtype: gl.constexpr = c_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [4, BLOCK_H, HALF], q_desc.layout)  # 2 segments x 2 halves
        qe_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_H, ROPE], qe_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_N, HALF], c_desc.layout)
        e_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], e_desc.layout)
        s_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        s_bufs = gl.allocate_shared_memory(gl.float32, [4, BLOCK_N, BLOCK_H], s_smem)  # 2 tiles x 2 halves
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype)
        p0 = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], p_layout)
        p1 = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], p_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrive per warpgroup
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)

        gl.warp_specialize(
            [
                (_consumer, (q_bufs, qe_bufs, c_bufs, e_bufs, s_bufs, p0, q_ready, q_empty, ready, empty, table_ptr,
                             rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, num_tokens, num_slots, num_rows, num_heads,
                             num_blocks, table_width, scale_log2, 0, HALF, BLOCK_H, BLOCK_N, BLOCK_SIZE, STAGES)),
                (_consumer, (q_bufs, qe_bufs, c_bufs, e_bufs, s_bufs, p1, q_ready, q_empty, ready, empty, table_ptr,
                             rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, num_tokens, num_slots, num_rows, num_heads,
                             num_blocks, table_width, scale_log2, 1, HALF, BLOCK_H, BLOCK_N, BLOCK_SIZE, STAGES)),
                (_producer, (q_desc, qe_desc, c_desc, e_desc, q_bufs, qe_bufs, c_bufs, e_bufs, q_ready, q_empty,
                             ready, empty, table_ptr, rows_ptr, lens_ptr, work_ptr, num_tokens, num_rows, num_heads,
                             num_blocks, table_width, HALF, BLOCK_N, BLOCK_SIZE, STAGES)),
            ],
            [4, 4],  # warpgroup 1, the producer (the default partition is warpgroup 0)
            [232, 24],  # registers per thread: 2 x 128 x 232 + 128 x 24 <= 64K
        )  # fmt: skip
