"""The Hopper decode kernel as resident programs: each streams several work items through one ring.

The kernel of :mod:`.decode_hopper` (its loop in turn) runs one program per (item, KV head).
A short row's program spends much of its life starting: the item's fields, then its block-table
entry, then the TMA of its first tile, each waiting on the one before (HBM latencies), then
the query's load and split, before its first MMA. The end-to-end burst's decode step
(LogNormal(550) rows, ~5 tiles of 128 fp8 tokens a row) ran at 41 us with every table
pointing at one L2-resident block against 55.6 us from HBM on the H200
(``benchmarks/results/decode-ceiling-h200-2026-12-06.json``), while 64 rows of 4096 tokens
ran near the copy rate: the starts, not the bytes, bound short rows.

Here a launch has a fixed number of programs (``programs``: the SMs times the programs an SM
holds) and program ``p`` takes the units ``u = r * P + p`` of rounds ``r = 0, 1, ..`` (``P
- 1 - p`` on odd rounds, so that with the items ordered heaviest first no program takes the
heaviest of every round), unit ``u`` being item ``u // kv_heads`` of KV head ``u %
kv_heads``. Each program keeps two cursors over its own units: the consumer's, which runs a
unit's tiles as :mod:`.decode_hopper`'s loop in turn does, and the producer's, which issues
the TMA of the tile ``STAGES`` tiles ahead of it, across unit boundaries: the next unit's first
tiles are in flight while this unit's last ones compute. Both cursors skip units without tiles
the same way (:func:`_unit`), so the ring's slots and barrier phases follow one count of tiles
(tile ``c`` of the program in slot ``c % STAGES``, phase ``(c // STAGES) & 1``). A live unit
without tiles (an empty kv range) still writes its output (zeros) or partial (lse -inf).

The work, the partial outputs and the combine are those of :mod:`.decode_hopper` (same items,
same schedule); the grid does not depend on the items, so a CUDA graph replays it for any
lengths. Safety as there: item and table indices are range-checked, bad block ids read block
0 with their tokens masked, kv ranges clamped to the table.
"""

from __future__ import annotations

import functools

import torch

from attention.triton_kernels import decode_hopper
from attention.triton_kernels.decode_hopper import _descriptors, hopper_block_n, launch_form
from attention.triton_kernels.paging import next_power_of_2
from attention.triton_kernels.prefill_hopper import _GLUON

if _GLUON:
    from attention.triton_kernels.decode_hopper import (
        _fold,
        _issue_pv,
        _issue_scores,
        _load_tile,
        _query_layout,
        _stage_tile,
        _tile_softmax,
        _twice,
    )
    from attention.triton_kernels.prefill_hopper import (
        _partition_barrier,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        warpgroup_mma_wait,
    )

__all__ = ["device_sm_count", "launch_decode_hopper_persistent", "persistent_programs"]


if _GLUON:

    @gluon.jit
    def _unit(  # type: ignore[no-untyped-def]
        items_ptr, block_tables_ptr, r, pid, num_programs, num_units, num_table_rows, table_width, stride_bt,
        NUM_KV_HEADS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ):  # fmt: skip
        """Round ``r``'s unit of program ``pid``: (item pointer, live, KV head, kv_start, kv_end,
        first tile's token, tiles, table row pointer, table row ok). Not live (past the units, or
        a padding item): no tiles, nothing written."""
        lane = gl.where(r % 2 == 0, pid, num_programs - 1 - pid)
        u = r * num_programs + lane
        in_range = u < num_units
        u_safe = gl.where(in_range, u, 0)
        item = items_ptr + (u_safe // NUM_KV_HEADS).to(gl.int64) * 10
        kvh = u_safe % NUM_KV_HEADS
        d = gl.load(item, mask=in_range, other=-1)
        live = d >= 0
        kv_start = gl.maximum(gl.load(item + 1, mask=live, other=0), 0)
        kv_end = gl.minimum(gl.load(item + 2, mask=live, other=0), table_width * BLOCK_SIZE)
        table_index = gl.load(item + 4, mask=live, other=-1)
        row_ok = (table_index >= 0) & (table_index < num_table_rows)
        table_row = block_tables_ptr + gl.where(row_ok, table_index, 0).to(gl.int64) * stride_bt
        first = (kv_start // BLOCK_N) * BLOCK_N  # tiles stay aligned: each part inside a block
        n_tiles = gl.where(live, gl.cdiv(gl.maximum(kv_end - first, 0), BLOCK_N), 0)
        return item, live, kvh, kv_start, kv_end, first, n_tiles, table_row, row_ok

    @gluon.jit
    def _skip_issued(  # type: ignore[no-untyped-def]
        items_ptr, block_tables_ptr, pr, pj, p_kvh, p_end, p_first, p_tiles, p_row, p_row_ok, pid, num_programs,
        num_units, rounds, num_table_rows, table_width, stride_bt,
        NUM_KV_HEADS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ):  # fmt: skip
        """The producer's cursor (round ``pr``, tile ``pj`` of that round's unit and the unit's
        fields) moved past units whose tiles are all issued: on the next tile to issue, or at
        ``pr == rounds`` when none is left."""
        while (pr < rounds) & (pj >= p_tiles):
            pr += 1
            pj = 0
            _item, _live, p_kvh, _start, p_end, p_first, p_tiles, p_row, p_row_ok = _unit(
                items_ptr, block_tables_ptr, pr, pid, num_programs, num_units, num_table_rows, table_width, stride_bt,
                NUM_KV_HEADS, BLOCK_N, BLOCK_SIZE,
            )  # fmt: skip
        return pr, pj, p_kvh, p_end, p_first, p_tiles, p_row, p_row_ok

    @gluon.jit(
        do_not_specialize=[
            "num_item_slots", "num_table_rows", "table_width", "num_blocks", "num_q_tokens",
            "num_partial_slots", "stride_bt",
        ]
    )  # fmt: skip
    def _decode_hopper_persistent_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_desc, v_desc, k_half_desc, v_half_desc, k_scale_ptr, v_scale_ptr, block_tables_ptr, items_ptr,
        out_ptr, part_o_ptr, part_lse_ptr, qk_scale, num_item_slots, num_table_rows, table_width, num_blocks,
        num_q_tokens, num_partial_slots, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
        NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_H: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr,
        PART: gl.constexpr, TRIM: gl.constexpr, P_LO: gl.constexpr, FUSE: gl.constexpr,
    ):  # fmt: skip
        """Program ``p`` of a 1-D grid: the units of :func:`_unit` in turn, each as
        :func:`.decode_hopper._decode_hopper_kernel`'s program (KV head, item) with its loop in
        turn (arguments as there; items ``[num_item_slots, 10]``), the ring shared by all."""
        pid = gl.program_id(0)
        num_programs = gl.num_programs(0)
        num_units = num_item_slots * NUM_KV_HEADS
        rounds = gl.cdiv(num_units, num_programs)

        kv_dtype: gl.constexpr = k_desc.dtype
        FP8: gl.constexpr = kv_dtype == gl.float8e4nv
        P_SHIFT: gl.constexpr = 8.0 if FP8 else 0.0  # fp8: P scaled by 2^8 before its e4m3 split
        PARTS: gl.constexpr = BLOCK_N // PART
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 32 if FP8 else 16]
        )
        q_layout: gl.constexpr = _query_layout(BLOCK_H, HEAD_DIM)
        Q_ROWS: gl.constexpr = 2 * BLOCK_H if FP8 else BLOCK_H  # fp8: the query's hi part, then its lo part
        q_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], kv_dtype)
        q_bufs = gl.allocate_shared_memory(kv_dtype, [Q_ROWS, HEAD_DIM], q_smem)
        k_bufs = gl.allocate_shared_memory(kv_dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        if FP8:  # P^T (K-major, as 8-bit operands must be), hi rows then lo rows; V^T per part
            p_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, BLOCK_N], kv_dtype)
            p_bufs = gl.allocate_shared_memory(kv_dtype, [1, 2 * BLOCK_H, BLOCK_N], p_smem)
            v_bufs = gl.allocate_shared_memory(kv_dtype, [STAGES * PARTS, HEAD_DIM, PART], v_desc.layout)
        else:  # P as computed; V tiles as K's
            p_smem16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], kv_dtype)
            p_bufs = gl.allocate_shared_memory(kv_dtype, [1, BLOCK_N, BLOCK_H], p_smem16)
            v_bufs = gl.allocate_shared_memory(kv_dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        TRIM_LOADS: gl.constexpr = TRIM and not (FP8 and PARTS == 1)  # as decode_hopper's loop in turn
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)

        # The producer: the first STAGES tiles of the program's units.
        zero = pid * 0  # (a runtime 0: loop-carried counters must not start as constants)
        _item, _live, p_kvh, _start, p_end, p_first, p_tiles, p_row, p_row_ok = _unit(
            items_ptr, block_tables_ptr, zero, pid, num_programs, num_units, num_table_rows, table_width, stride_bt,
            NUM_KV_HEADS, BLOCK_N, BLOCK_SIZE,
        )  # fmt: skip
        pr, pj, p_kvh, p_end, p_first, p_tiles, p_row, p_row_ok = _skip_issued(
            items_ptr, block_tables_ptr, zero, zero, p_kvh, p_end, p_first, p_tiles, p_row, p_row_ok, pid, num_programs,
            num_units, rounds, num_table_rows, table_width, stride_bt, NUM_KV_HEADS, BLOCK_N, BLOCK_SIZE,
        )  # fmt: skip
        for st in gl.static_range(STAGES):
            if pr < rounds:
                _load_tile(k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, st,
                           p_first + pj * BLOCK_N, p_end, p_row, p_row_ok, table_width, num_blocks, p_kvh, STAGES,
                           BLOCK_N, BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, PART, FP8, True, True, 0,
                           TRIM_LOADS)  # fmt: skip
                pr, pj, p_kvh, p_end, p_first, p_tiles, p_row, p_row_ok = _skip_issued(
                    items_ptr, block_tables_ptr, pr, pj + 1, p_kvh, p_end, p_first, p_tiles, p_row, p_row_ok, pid,
                    num_programs, num_units, rounds, num_table_rows, table_width, stride_bt, NUM_KV_HEADS, BLOCK_N,
                    BLOCK_SIZE,
                )  # fmt: skip

        h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_layout))
        dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        FUSED: gl.constexpr = FUSE and FP8
        FUSED_PV: gl.constexpr = FUSED and P_LO
        wide_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BLOCK_H, 32]
        )
        if FUSED:  # the scores' hi and lo products side by side
            s_zero = gl.zeros([BLOCK_N, 2 * BLOCK_H], gl.float32, wide_layout)
        else:
            s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)
        out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        dd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, out_layout))
        ho = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, out_layout))
        h_s = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, s_layout))
        c = zero  # tiles consumed by this program: slot c % STAGES, phase (c // STAGES) & 1
        for r in range(rounds):
            item, live, kvh, kv_start, kv_end, first, n_tiles, table_row, row_ok = _unit(
                items_ptr, block_tables_ptr, r, pid, num_programs, num_units, num_table_rows, table_width, stride_bt,
                NUM_KV_HEADS, BLOCK_N, BLOCK_SIZE,
            )  # fmt: skip
            if live:
                slot = gl.load(item + 3)
                token = gl.load(item + 5)
                q_len = gl.load(item + 8)
                token_ok = (token >= 0) & (token < num_q_tokens) & (q_len > 0)
                # The group's queries (fp8: each head scaled so its largest element is 224, split
                # hi + lo). The previous unit's MMAs are done and every warp is past them.
                heads = kvh * GROUP + h
                q_rows = token_ok & (h < GROUP)
                q_off = gl.where(token_ok, token, 0).to(gl.int64) * stride_qt + heads.to(gl.int64) * stride_qh
                q = gl.load(q_ptr + q_off[:, None] + dq[None, :], mask=q_rows[:, None], other=0.0)
                if FP8:
                    q = q.to(gl.float32)
                    q_amax = gl.max(gl.abs(q), 1)
                    q_mul = gl.where(q_amax > 0.0, 224.0 / q_amax, 1.0)
                    q = q * q_mul[:, None]
                    q_hi = q.to(kv_dtype)
                    q_bufs.slice(0, BLOCK_H).store(q_hi)
                    q_bufs.slice(BLOCK_H, BLOCK_H).store((q - q_hi.to(gl.float32)).to(kv_dtype))
                    score_scale = qk_scale * gl.load(k_scale_ptr + kvh)
                    col_scale = gl.convert_layout(score_scale / q_mul, gl.SliceLayout(0, s_layout))
                else:
                    q_bufs.store(q)
                    col_scale = gl.full([BLOCK_H], qk_scale, gl.float32, gl.SliceLayout(0, s_layout))
                fence_async_shared()
                _partition_barrier()

                m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
                l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)  # row sums, per thread
                if FUSED_PV:  # O's hi and lo products side by side
                    o = gl.zeros([HEAD_DIM, 2 * BLOCK_H], gl.float32, wide_layout)
                else:
                    o = gl.zeros([HEAD_DIM, BLOCK_H], gl.float32, s_layout)
                for j in range(n_tiles):
                    s_slot = c % STAGES
                    n0 = first + j * BLOCK_N
                    mbarrier.wait(ready.index(s_slot), (c // STAGES) & 1)
                    s = _issue_scores(k_bufs.index(s_slot), q_bufs, s_zero, FP8, FUSED)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                    if FUSED:
                        s = _fold(s, s_layout)
                    p, alpha, m_i, l_part, tile_ok = _tile_softmax(
                        s, n0, m_i, l_part, col_scale, offs_n, kv_start, kv_end, table_row, row_ok, table_width,
                        num_blocks, BLOCK_SIZE, PARTS, PART, P_SHIFT,
                    )  # fmt: skip
                    _stage_tile(p, p_bufs, 0, v_bufs, s_slot, n0, tile_ok, kv_start, kv_end, table_row, row_ok,
                                table_width, num_blocks, BLOCK_N, HEAD_DIM, BLOCK_SIZE, PARTS, PART, FP8,
                                P_LO)  # fmt: skip
                    fence_async_shared()
                    _partition_barrier()
                    if FUSED_PV:  # noqa: SIM108 (a compile-time branch)
                        o = o * _twice(alpha, gl.SliceLayout(0, wide_layout))[None, :]
                    else:
                        o = o * alpha[None, :]
                    o = _issue_pv(o, p_bufs, 0, v_bufs, s_slot, PARTS, PART, FP8, P_LO, FUSED)
                    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                    _partition_barrier()  # every warp is done with the slot and with P
                    if pr < rounds:  # the slot takes the producer's next tile (this unit's or a later one's)
                        _load_tile(k_desc, v_desc, k_half_desc, v_half_desc, k_bufs, v_bufs, ready, s_slot,
                                   p_first + pj * BLOCK_N, p_end, p_row, p_row_ok, table_width, num_blocks, p_kvh,
                                   STAGES, BLOCK_N, BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, PART, FP8, True, True, 0,
                                   TRIM_LOADS)  # fmt: skip
                        pr, pj, p_kvh, p_end, p_first, p_tiles, p_row, p_row_ok = _skip_issued(
                            items_ptr, block_tables_ptr, pr, pj + 1, p_kvh, p_end, p_first, p_tiles, p_row,
                            p_row_ok, pid, num_programs, num_units, rounds, num_table_rows, table_width, stride_bt,
                            NUM_KV_HEADS, BLOCK_N, BLOCK_SIZE,
                        )  # fmt: skip
                    c += 1

                if FUSED_PV:
                    o = _fold(o, s_layout)
                l_i = gl.sum(l_part, 0)
                l_safe = gl.where(l_i > 0.0, l_i, 1.0)
                if FP8:  # noqa: SIM108 (a compile-time branch)
                    o = o * (gl.load(v_scale_ptr + kvh) / l_safe)[None, :]
                else:
                    o = o / l_safe[None, :]
                o = gl.convert_layout(o, out_layout)
                head_o = (kvh * GROUP + ho).to(gl.int64)
                if slot < 0:
                    keep = token_ok & (ho < GROUP)
                    dst = out_ptr + gl.where(token_ok, token, 0).to(gl.int64) * stride_ot + head_o * stride_oh
                    gl.store(dst[None, :] + dd[:, None], o.to(out_ptr.dtype.element_ty), mask=keep[None, :])
                else:
                    slot_ok = (q_len > 0) & (slot < num_partial_slots)
                    part_row = gl.where(slot_ok, slot, 0).to(gl.int64) * NUM_HEADS + head_o
                    keep = slot_ok & (ho < GROUP)
                    gl.store(part_o_ptr + part_row[None, :] * HEAD_DIM + dd[:, None], o, mask=keep[None, :])
                    lse = gl.where(l_i > 0.0, m_i + gl.log2(l_safe) - P_SHIFT, float("-inf"))
                    part_s = gl.where(slot_ok, slot, 0).to(gl.int64) * NUM_HEADS + kvh * GROUP + h_s
                    gl.store(part_lse_ptr + part_s, lse, mask=slot_ok & (h_s < GROUP))


def device_sm_count(device: torch.device) -> int:
    """The SMs of the CUDA ``device`` (1 elsewhere: the interpreter's launches)."""
    if device.type != "cuda":
        return 1
    return _sm_count_of(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _sm_count_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def persistent_programs(num_units: int, num_sms: int, programs_per_sm: int) -> int:
    """Programs of a persistent launch: one per place (``num_sms * programs_per_sm``), no more
    than the units (items x KV heads), at least one."""
    if num_sms < 1 or programs_per_sm < 1:
        raise ValueError(f"num_sms {num_sms} and programs_per_sm {programs_per_sm} must be >= 1")
    return max(1, min(num_units, num_sms * programs_per_sm))


def launch_decode_hopper_persistent(
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
    programs: int,
) -> None:
    """:func:`.decode_hopper.launch_decode_hopper`'s work (its loop in turn) on ``programs``
    resident programs (:func:`persistent_programs`): the first ``grid_items`` items of
    ``items`` for every KV head; arguments as there."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // kv_heads
    block_n = hopper_block_n(k_cache.dtype)
    part, trim, halves = launch_form(block_size, k_cache.dtype, False)
    k_desc, v_desc = _descriptors(k_cache, v_cache, part)
    k_half, v_half = _descriptors(k_cache, v_cache, block_n // 2) if halves else (k_desc, v_desc)
    k_scale, v_scale = scales if scales is not None else (part_lse, part_lse)  # unused for a 16-bit cache
    slots = min(grid_items, items.shape[0])
    _decode_hopper_persistent_kernel[(programs,)](
        query, k_desc, v_desc, k_half, v_half, k_scale, v_scale, block_tables, items, out, part_o, part_lse, qk_scale,
        slots, block_tables.shape[0], block_tables.shape[1], num_blocks, min(query.shape[0], out.shape[0]),
        part_o.shape[0], query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads, GROUP=group, BLOCK_H=max(8, next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_SIZE=block_size, STAGES=stages, PART=part, TRIM=trim,
        P_LO=_p_lo(), FUSE=_fused(), num_warps=4,
    )  # fmt: skip


def _p_lo() -> bool:
    """:data:`.decode_hopper.FP8_P_LO` at launch time (a switch A/B runs may flip)."""
    return bool(decode_hopper.FP8_P_LO)


def _fused() -> bool:
    """:data:`.decode_hopper.FUSED_HI_LO` at launch time (a switch A/B runs may flip)."""
    return bool(decode_hopper.FUSED_HI_LO)

