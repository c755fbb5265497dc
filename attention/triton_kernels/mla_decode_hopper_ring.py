"""MLA decode on Hopper with a deeper load ring: the kernel of :mod:`.mla_decode_hopper`
restructured so that the copy engine never waits on a whole tile's compute.

Opt-in (``launch_mla_hopper(..., ring=True)``, ``MLALaunch.hopper_ring``): timed on the H200
against the kernel it would replace, it ran at 0.99x its speed on 64 x 4096 and 0.98x on
LogNormal-128 at 16 heads (``benchmarks/results/mla-decode-ring-2026-12-05.json``,
``benchmarks/bench_mla_decode.py --plan-only``), so the memory latency the model below
blames is not what holds the two-tile kernel back.

Why: :mod:`.mla_decode_hopper` refills a whole 73 KiB tile slot only after both P V MMAs of
the tile in it, with a ring of two tiles, so a tile's load waits for a tile's compute. A model
of its measured ~2.6-2.8 us a tile (against ~2.2 us at the copy rate) is
``(compute + memory latency + transfer) / lookahead`` with a lookahead of 2 tiles. This kernel
deepens the lookahead in the same shared memory:

- each tile's two channel halves ([64, 256] each) are separate entries of a ring of
  :data:`HALVES` (5) buffers, two and a half tiles. A half is refilled as soon as its own
  P V MMA has read it (``warpgroup_mma_wait(1)`` after the first, 0 after the second), so
  the next loads leave while the tile's second MMA still runs;
- the rotary part ([64, 64]) rides with the first half into a ring of :data:`ROPES` (3);
  the half that carries tile ``k``'s rotary part is issued when tile ``k - 3``'s second half
  is free, by then its S has long been computed (a ring of 2 would overwrite tile ``k - 2``'s
  rotary part before its S);
- loads run ahead across the program's tokens: a load cursor walks the segments of the
  program's range on its own, so a token's first tiles are in flight while the previous
  token's last tiles are computed; the next token's query is loaded as soon as the last S
  that reads the current one is done.

Per tile ``k`` of the program (its tiles counted over all its segments): halves ``2k`` and
``2k + 1`` in buffers ``(2k) % 5`` and ``(2k + 1) % 5``, each buffer's barrier completing
once per use (phase ``(h // 5) & 1`` for half ``h``); after the first P V MMA, half
``2k + 5`` (the second half of tile ``k + 2``) goes into the first buffer; after the second,
half ``2k + 6`` (the first half and the rotary part of tile ``k + 3``) into the second.

Shared memory: 5 x 32 KiB of halves, 3 x 8 KiB of rotary parts, 18 KiB of query, 2 KiB of P
and the output's layout change: 220 KiB, one program an SM.

Safety as in :mod:`.mla_decode_hopper`: lengths clamped to the table, block ids outside
``[0, num_blocks)`` read block 0 and mask their latents, latent rows past a token's length
are zeroed in shared memory before P V reads them (stale slots may hold NaN), slots outside
the partial buffers are not stored. The load cursor and the compute loop walk the same
segments with the same clamps, so every buffer is waited on as often as it is filled, and
nothing is in flight when the program ends.
"""

from __future__ import annotations

from attention.triton_kernels.mla_balanced import program_work, segment_latents
from attention.triton_kernels.mla_tiles import token_extent
from attention.triton_kernels.prefill_hopper import _GLUON

if _GLUON:
    from attention.triton_kernels.mla_hopper_stores import store_segment, zero_latents_from
    from attention.triton_kernels.prefill_hopper import (
        _page,
        _partition_barrier,
        _tma_load,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = ["HALVES", "ROPES"]

#: Channel-half buffers of the latent ring (two and a half tiles).
HALVES = 5
#: Rotary-part buffers (one rides with each tile's first half).
ROPES = 3


if _GLUON:

    @gluon.jit
    def _segment_extent(  # type: ignore[no-untyped-def]
        work_ptr, rows_ptr, lens_ptr, table_ptr, t, g0, g1, num_rows, table_width,
        BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """Token ``t``'s segment of the range ``[g0, g1)``: its tiles ``[seg_start, seg_end)``
        of the step (none where ``seg_end <= seg_start``), its latents ``[start, end)``
        (clamped as :func:`.mla_balanced.segment_latents` clamps them) and its table row."""
        t_first = gl.load(work_ptr + t)
        seg_start = gl.maximum(g0, t_first)
        seg_end = gl.minimum(g1, gl.load(work_ptr + t + 1))
        row, seq_len = token_extent(rows_ptr, lens_ptr, t, num_rows, table_width, BLOCK_SIZE)
        start, end = segment_latents(t_first, seg_start, seg_end, seq_len, table_width, BLOCK_SIZE, BLOCK_N)
        return seg_start, seg_end, start, end, table_ptr + row.to(gl.int64) * table_width

    @gluon.jit
    def _next_busy_token(  # type: ignore[no-untyped-def]
        work_ptr, rows_ptr, lens_ptr, table_ptr, t, t_stop, g0, g1, num_rows, table_width,
        BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """The first token ``u`` in ``[t, t_stop)`` whose segment has latents (``t_stop`` when
        none), with its latents ``[start, end)`` and table row."""
        u = t
        start = 0
        end = 0
        table_row = table_ptr
        searching = u < t_stop
        while searching:
            _, _, start, end, table_row = _segment_extent(
                work_ptr, rows_ptr, lens_ptr, table_ptr, u, g0, g1, num_rows, table_width, BLOCK_SIZE, BLOCK_N
            )  # fmt: skip
            found = end > start
            u = gl.where(found, u, u + 1)
            searching = (not found) & (u < t_stop)
        return u, start, end, table_row

    @gluon.jit
    def _load_first_half(  # type: ignore[no-untyped-def]
        c_desc, e_desc, c_bufs, e_bufs, ready, h, first,
        HALF: gl.constexpr, HALVES_: gl.constexpr, ROPES_: gl.constexpr,
    ):  # fmt: skip
        """Half ``h`` (even: tile ``h // 2``'s channels ``[0, HALF)``) and that tile's rotary
        part, from cache row ``first``, on the half's barrier."""
        bar = ready.index(h % HALVES_)
        mbarrier.expect(bar, c_desc.block_type.nbytes + e_desc.block_type.nbytes)
        _tma_load(c_desc, [first, 0], bar, c_bufs.index(h % HALVES_))
        _tma_load(e_desc, [first, 2 * HALF], bar, e_bufs.index((h // 2) % ROPES_))

    @gluon.jit
    def _load_second_half(c_desc, c_bufs, ready, h, first, HALF: gl.constexpr, HALVES_: gl.constexpr):  # type: ignore[no-untyped-def]
        """Half ``h`` (odd: tile ``h // 2``'s channels ``[HALF, 2 HALF)``) from cache row
        ``first``."""
        bar = ready.index(h % HALVES_)
        mbarrier.expect(bar, c_desc.block_type.nbytes)
        _tma_load(c_desc, [first, HALF], bar, c_bufs.index(h % HALVES_))

    @gluon.jit
    def _load_query(q_desc, qe_desc, q_bufs, qe_buf, q_bar, t, num_heads, HALF: gl.constexpr):  # type: ignore[no-untyped-def]
        """Token ``t``'s queries (rows ``t * num_heads ..`` of the [tokens * heads, 576] view;
        rows of other tokens past ``num_heads`` are read but never stored)."""
        q_row = t * num_heads
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + qe_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, 0], q_bar, q_bufs.index(0))
        _tma_load(q_desc, [q_row, HALF], q_bar, q_bufs.index(1))
        _tma_load(qe_desc, [q_row, 2 * HALF], q_bar, qe_buf)

    @gluon.jit(do_not_specialize=["num_tokens", "num_slots", "num_rows", "num_blocks", "table_width"])
    def _mla_hopper_ring_kernel(  # type: ignore[no-untyped-def]
        q_desc, qe_desc, c_desc, e_desc, table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, out_ptr,
        num_tokens, num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2, stride_ot, stride_oh,
        HALF: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr, NH: gl.constexpr, NE: gl.constexpr,
    ):  # fmt: skip
        """Program ``pid`` of the balanced work array, as ``_mla_hopper_kernel`` (same
        arguments, same results), on the ring described in the module docstring: ``NH``
        (:data:`HALVES`) half buffers and ``NE`` (:data:`ROPES`) rotary buffers."""
        gl.static_assert(NH == 5, "the refills after each P V MMA assume a ring of 5 halves")
        gl.static_assert(NE >= 3, "a tile's rotary part is refilled 3 tiles later")
        dtype: gl.constexpr = c_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
        )
        out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        q_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_H, HALF], q_desc.layout)
        qe_buf = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], qe_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [NH, BLOCK_N, HALF], c_desc.layout)
        e_bufs = gl.allocate_shared_memory(dtype, [NE, BLOCK_N, ROPE], e_desc.layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype)
        p_buf = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], p_layout)
        ready = gl.allocate_shared_memory(gl.int64, [NH, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        for i in gl.static_range(NH):
            mbarrier.init(ready.index(i), count=1)
        mbarrier.init(q_bar, count=1)

        g0, g1, t0, t_stop, first_slot, token_slots = program_work(
            work_ptr, num_tokens, gl.program_id(0), gl.num_programs(0)
        )
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, s_layout))
        head_ok = offs_h < num_heads
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)

        # The load cursor: the token whose tile loads next (t_stop: none left), that tile's
        # first latent, its segment's end, its table row and the tile's row in the cache (read
        # from the table when the cursor moves, so the read's latency passes before the TMA
        # that needs it).
        lt, ln0, lend, lrow = _next_busy_token(
            work_ptr, rows_ptr, lens_ptr, table_ptr, t0, t_stop, g0, g1, num_rows, table_width, BLOCK_SIZE, BLOCK_N
        )  # fmt: skip
        lfirst = 0
        if lt < t_stop:  # (an idle program's table row may not exist: nothing is read)
            lfirst = _page(lrow, ln0, table_width, num_blocks, BLOCK_SIZE)
            _load_query(q_desc, qe_desc, q_bufs, qe_buf, q_bar, lt, num_heads, HALF)
        for h in gl.static_range(NH):  # halves 0 .. 4: tiles 0 and 1, tile 2's first half
            if lt < t_stop:
                if h % 2 == 0:
                    _load_first_half(c_desc, e_desc, c_bufs, e_bufs, ready, h, lfirst, HALF, NH, NE)
                else:
                    _load_second_half(c_desc, c_bufs, ready, h, lfirst, HALF, NH)
                    ln0 += BLOCK_N
                    if ln0 >= lend:
                        lt, ln0, lend, lrow = _next_busy_token(
                            work_ptr, rows_ptr, lens_ptr, table_ptr, lt + 1, t_stop, g0, g1, num_rows, table_width,
                            BLOCK_SIZE, BLOCK_N,
                        )  # fmt: skip
                    if lt < t_stop:
                        lfirst = _page(lrow, ln0, table_width, num_blocks, BLOCK_SIZE)

        k = 0  # tiles this program computed (tile k: halves 2k and 2k + 1)
        segs = 0  # segments with latents this program ran (the query barrier's phase)
        for t in range(t0, t_stop):
            seg_start, seg_end, start, end, table_row = _segment_extent(
                work_ptr, rows_ptr, lens_ptr, table_ptr, t, g0, g1, num_rows, table_width, BLOCK_SIZE, BLOCK_N
            )  # fmt: skip
            if seg_end > seg_start:
                n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
                # The next token with latents, whose query loads once this one's last S is done
                # (found here, where its loads overlap the wait for the first tile).
                q_next, _, _, _ = _next_busy_token(
                    work_ptr, rows_ptr, lens_ptr, table_ptr, t + 1, t_stop, g0, g1, num_rows, table_width,
                    BLOCK_SIZE, BLOCK_N,
                )  # fmt: skip
                m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
                l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(0, s_layout))
                o_a = gl.zeros([HALF, BLOCK_H], gl.float32, s_layout)
                o_b = gl.zeros([HALF, BLOCK_H], gl.float32, s_layout)
                if n_tiles > 0:
                    mbarrier.wait(q_bar, segs & 1)
                for j in range(n_tiles):
                    ha = 2 * k
                    hb = ha + 1
                    lat_a = c_bufs.index(ha % NH)
                    lat_b = c_bufs.index(hb % NH)
                    # The tile's block id, read before the waits (its latency off the S -> softmax path).
                    n0 = start + j * BLOCK_N
                    page = gl.load(table_row + gl.minimum(n0 // BLOCK_SIZE, table_width - 1))
                    mbarrier.wait(ready.index(ha % NH), (ha // NH) & 1)
                    s = warpgroup_mma(lat_a, q_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    s = warpgroup_mma(e_bufs.index(k % NE), qe_buf.permute((1, 0)), s, is_async=True)
                    mbarrier.wait(ready.index(hb % NH), (hb // NH) & 1)
                    s = warpgroup_mma(lat_b, q_bufs.index(1).permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                    page_ok = (page >= 0) & (page < num_blocks)
                    valid = gl.where(page_ok, end - n0, 0)  # latents of the tile inside the row
                    s = gl.where((offs_n < valid)[:, None], s * scale_log2, float("-inf"))
                    m_new = gl.maximum(m_i, gl.max(s, 0))
                    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = gl.exp2(m_i - m_safe)
                    p = gl.exp2(s - m_safe[None, :])
                    l_i = l_i * alpha + gl.sum(p, 0)
                    m_i = m_new
                    if valid < BLOCK_N:  # stale latents past the row (or a bad block): zeros for P V
                        zero_latents_from(lat_a, valid, BLOCK_N, HALF)
                        zero_latents_from(lat_b, valid, BLOCK_N, HALF)
                    p_buf.store(p.to(dtype))
                    fence_async_shared()
                    _partition_barrier()  # P is whole, and every warp's S has read the query
                    if (j == n_tiles - 1) & (q_next < t_stop):  # the next query, while this P V runs
                        _load_query(q_desc, qe_desc, q_bufs, qe_buf, q_bar, q_next, num_heads, HALF)
                    o_a = warpgroup_mma(lat_a.permute((1, 0)), p_buf, o_a * alpha[None, :], is_async=True)
                    o_b = warpgroup_mma(lat_b.permute((1, 0)), p_buf, o_b * alpha[None, :], is_async=True)
                    o_a = warpgroup_mma_wait(num_outstanding=1, deps=(o_a,))
                    _partition_barrier()  # every warp is done with the first half
                    if lt < t_stop:  # half 2k + 5: the second half of tile k + 2
                        _load_second_half(c_desc, c_bufs, ready, ha + NH, lfirst, HALF, NH)
                        ln0 += BLOCK_N
                        if ln0 >= lend:
                            lt, ln0, lend, lrow = _next_busy_token(
                                work_ptr, rows_ptr, lens_ptr, table_ptr, lt + 1, t_stop, g0, g1, num_rows,
                                table_width, BLOCK_SIZE, BLOCK_N,
                            )  # fmt: skip
                        if lt < t_stop:  # (read while the second P V runs)
                            lfirst = _page(lrow, ln0, table_width, num_blocks, BLOCK_SIZE)
                    o_b = warpgroup_mma_wait(num_outstanding=0, deps=(o_b,))
                    _partition_barrier()  # every warp is done with the second half (and with P)
                    if lt < t_stop:  # half 2k + 6: the first half and rotary part of tile k + 3
                        _load_first_half(c_desc, e_desc, c_bufs, e_bufs, ready, hb + NH, lfirst, HALF, NH, NE)
                    k += 1
                segs += gl.where(n_tiles > 0, 1, 0)

                slot_id = gl.where(seg_start == g0, first_slot, gl.load(token_slots + 2 * t))
                store_segment(acc_ptr, ml_ptr, out_ptr, token_slots, t, slot_id, num_slots, num_heads, stride_ot,
                              stride_oh, offs_h, head_ok, o_a, o_b, m_i, l_i, out_layout, HALF, DIRECT)  # fmt: skip
