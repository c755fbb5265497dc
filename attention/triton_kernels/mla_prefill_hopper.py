"""Decompressed MLA prefill on Hopper (sm_90): a warp-specialized Gluon kernel.

The computation of :mod:`.mla_prefill` (causal varlen attention of decompressed DeepSeek-style
heads: head ``h``'s key is ``[k_nope[h], k_pe]`` with ``k_pe`` shared by every head, its value
``v[h]``), laid out as :mod:`.prefill_hopper` is: persistent programs, a producer warpgroup
loading with TMA, two consumer warpgroups of 64 query rows taking turns at the tensor cores.
What differs:

- S = Q K^T is two asynchronous MMAs into one accumulator, ``q_nope . k_nope`` (``n``
  channels) and ``q_pe . k_pe`` (``e``); the shared ``k_pe`` tile is read from the latents
  (``[Tk, e]`` at their own row stride), never copied per head;
- keys are dense (the rows' decompressed keys one after another), so a key tile is one TMA
  box of ``kv`` viewed as ``[Tk, heads * (n + v)]``;
- rings of 2 key tiles (``k_nope`` + ``k_pe``, 48 KiB at DeepSeek-V3's widths) and 2 value
  tiles (32 KiB) and the Q halves (48 KiB) fill shared memory, so the output is staged in the
  consumer's own ``q_nope`` buffer once its last S is done (``n == v``), stored with TMA, and
  only then is the buffer handed back for the next item's Q.

Only DeepSeek-shaped heads come here (:func:`mla_hopper_applies`: ``n == v`` in {64, 128},
``e`` in {32, 64}, 16-bit tensors TMA can address); everything else runs the Triton kernel.

Safety: the host validated the lengths (:func:`.mla_prefill.mla_prefill`); the kernel still
clamps a row's query length to [0, key length], TMA zero-fills rows past the tensors, keys past
a row's end are masked out of S and their V rows zeroed in shared memory before P V, and only
the row's own query rows are stored.
"""

from __future__ import annotations

from typing import Any

import torch

from attention.triton_kernels.prefill_hopper import _GLUON, hopper_prefill_possible, out_takes_tma, tma_rows_ok

if _GLUON:
    from attention.triton_kernels.prefill_hopper import (
        _PASS_TURN,
        _WAIT_TURN,
        TensorDescriptor,
        _partition_barrier,
        _row_layout,
        _tma_load,
        _tma_store,
        _turn,
        _zero_rows_from,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        shared_layout,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = ["MLA_HOPPER_BLOCK_M", "mla_hopper_applies", "mla_prefill_hopper"]

#: Query rows per item (two consumer warpgroups of 64); the tile index must use it.
MLA_HOPPER_BLOCK_M = 128
_BLOCK_N = 128  # keys per tile
_K_STAGES = 2
_V_STAGES = 2
_LOG2E = 1.4426950408889634


def mla_hopper_applies(query: torch.Tensor, kv: torch.Tensor, key_pe: torch.Tensor, nope: int) -> bool:
    """Whether :func:`mla_prefill_hopper` takes these (already validated) tensors: an sm_90 GPU
    with Gluon, bf16 or fp16, ``n == v`` of 64 or 128 and ``e`` of 32 or 64, heads packed
    (``query [T, H, n + e]`` and ``kv [Tk, H, n + v]`` with unit head strides of their widths)
    and 16-byte aligned rows."""
    if not hopper_prefill_possible(query.device) or query.dtype not in (torch.bfloat16, torch.float16):
        return False
    rope, value = query.shape[2] - nope, kv.shape[2] - nope
    if nope not in (64, 128) or value != nope or rope not in (32, 64):
        return False
    if query.stride(1) != query.shape[2] or kv.stride(1) != kv.shape[2]:
        return False
    return tma_rows_ok(query) and tma_rows_ok(kv) and tma_rows_ok(key_pe)


if _GLUON:

    @gluon.jit
    def _mla_item(  # type: ignore[no-untyped-def]
        item, tile_index_ptr, q_start_ptr, k_start_ptr,
        NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """Work item ``item``: tile-index entry ``item // NUM_HEADS`` for head ``item %
        NUM_HEADS``. Returns (head, tile, q_start, q_len, k_start, k_len, first_pos, kv_end,
        n_tiles): ``first_pos`` the key position of the tile's first query, ``kv_end`` the keys
        its last query sees, at least one key tile."""
        h = item % NUM_HEADS
        entry = tile_index_ptr + 2 * (item // NUM_HEADS)
        row = gl.load(entry)
        tile = gl.load(entry + 1)
        q_start = gl.load(q_start_ptr + row)
        k_start = gl.load(k_start_ptr + row)
        k_len = gl.maximum(gl.load(k_start_ptr + row + 1) - k_start, 0)
        q_len = gl.minimum(gl.maximum(gl.load(q_start_ptr + row + 1) - q_start, 0), k_len)
        first_pos = k_len - q_len + tile * BLOCK_M
        kv_end = gl.minimum(first_pos + BLOCK_M, k_len)
        n_tiles = gl.maximum(gl.cdiv(kv_end, BLOCK_N), 1)
        return h, tile, q_start, q_len, k_start, k_len, first_pos, kv_end, n_tiles

    @gluon.jit
    def _wait_free(empty, pos, STAGES: gl.constexpr):  # type: ignore[no-untyped-def]
        """Wait until both consumers freed ring position ``pos``; returns its slot."""
        slot = pos % STAGES
        mbarrier.wait(empty.index(slot), ((pos // STAGES) & 1) ^ 1)  # a fresh slot passes
        return slot

    @gluon.jit
    def _mla_producer(  # type: ignore[no-untyped-def]
        qn_desc, qp_desc, kn_desc, kp_desc, v_desc, qn0, qp0, qn1, qp1, q_ready, q_empty, kn_bufs, kp_bufs, v_bufs,
        k_ready, k_empty, v_ready, v_empty, tile_index_ptr, q_start_ptr, k_start_ptr, num_items,
        NUM_HEADS: gl.constexpr, NOPE: gl.constexpr, ROPE: gl.constexpr, VDIM: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
    ):  # fmt: skip
        """Per item: the Q halves (``q_nope`` and ``q_pe`` each) once the consumers handed the
        buffers back, K(0), then per key tile j K(j + 1) before V(j)."""
        c = 0  # key tiles loaded so far (the position in both rings)
        for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
            h, tile, q_start, _, k_start, _, _, _, n_tiles = _mla_item(
                item, tile_index_ptr, q_start_ptr, k_start_ptr, NUM_HEADS, BLOCK_M, BLOCK_N
            )
            it = (item - gl.program_id(0)) // gl.num_programs(0)
            mbarrier.wait(q_empty, (it & 1) ^ 1)  # the first item passes
            mbarrier.expect(q_ready, 2 * (qn_desc.block_type.nbytes + qp_desc.block_type.nbytes))
            q_row = q_start + tile * BLOCK_M
            q_col = h * (NOPE + ROPE)
            _tma_load(qn_desc, [q_row, q_col], q_ready, qn0)
            _tma_load(qp_desc, [q_row, q_col + NOPE], q_ready, qp0)
            _tma_load(qn_desc, [q_row + BLOCK_M // 2, q_col], q_ready, qn1)
            _tma_load(qp_desc, [q_row + BLOCK_M // 2, q_col + NOPE], q_ready, qp1)
            kv_col = h * (NOPE + VDIM)
            for j in range(-1, n_tiles):
                if j + 1 < n_tiles:  # K(j + 1): k_nope and the shared k_pe on one barrier
                    slot = _wait_free(k_empty, c + j + 1, K_STAGES)
                    bar = k_ready.index(slot)
                    mbarrier.expect(bar, kn_desc.block_type.nbytes + kp_desc.block_type.nbytes)
                    key = k_start + (j + 1) * BLOCK_N
                    _tma_load(kn_desc, [key, kv_col], bar, kn_bufs.index(slot))
                    _tma_load(kp_desc, [key, 0], bar, kp_bufs.index(slot))
                if j >= 0:  # V(j)
                    slot = _wait_free(v_empty, c + j, V_STAGES)
                    bar = v_ready.index(slot)
                    mbarrier.expect(bar, v_desc.block_type.nbytes)
                    _tma_load(v_desc, [k_start + j * BLOCK_N, kv_col + NOPE], bar, v_bufs.index(slot))
            c += n_tiles

    @gluon.jit
    def _mla_consumer(  # type: ignore[no-untyped-def]
        qn_smem, qp_smem, q_ready, q_empty, kn_bufs, kp_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, out_ptr,
        o_desc, qk_scale, tile_index_ptr, q_start_ptr, k_start_ptr, num_items, num_tokens, stride_ot, stride_oh,
        WG: gl.constexpr, NUM_HEADS: gl.constexpr, VDIM: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, OUT_TMA: gl.constexpr,
    ):  # fmt: skip
        """Query rows ``WG * 64 ..`` of each item: online softmax over the key tiles (S from the
        two dots), then the output staged in ``qn_smem`` and stored (TMA where all 64 rows are
        the row's tokens inside the step and ``OUT_TMA``, masked 16-byte stores otherwise)."""
        HALF_M: gl.constexpr = BLOCK_M // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, VDIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = _row_layout(VDIM, 4)
        dtype: gl.constexpr = qn_smem.dtype
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
        token = gl.full([128], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
        if WG == 1:  # warpgroup 0 issues first
            token = gl.inline_asm_elementwise(
                "bar.arrive 8, 256; mov.u32 $0, $1;", "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1
            )
        c = 0
        for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
            h, tile, q_start, q_len, _, k_len, first_pos, kv_end, n_tiles = _mla_item(
                item, tile_index_ptr, q_start_ptr, k_start_ptr, NUM_HEADS, BLOCK_M, BLOCK_N
            )
            it = (item - gl.program_id(0)) // gl.num_programs(0)
            tail = kv_end - (n_tiles - 1) * BLOCK_N  # keys of the last tile inside the row
            my_first = first_pos + WG * HALF_M
            # Rows past the row's end are clamped to its last key: they see >= 1 key.
            pos = gl.minimum(my_first + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout)), k_len - 1)

            mbarrier.wait(q_ready, it & 1)
            ks = c % K_STAGES
            mbarrier.wait(k_ready.index(ks), (c // K_STAGES) & 1)
            token = _turn(token, _WAIT_TURN)
            s = warpgroup_mma(qn_smem, kn_bufs.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(qp_smem, kp_bufs.index(ks).permute((1, 0)), s, is_async=True)
            token = _turn(token, _PASS_TURN)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.arrive(k_empty.index(ks))
            if my_first + 1 < BLOCK_N:
                s = gl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
            m_i = gl.max(s, 1) * qk_scale
            p_f = gl.exp2(s * qk_scale - m_i[:, None])
            l_i = gl.sum(p_f, 1)
            p = gl.convert_layout(p_f.to(dtype), p_layout)
            acc = gl.zeros([HALF_M, VDIM], gl.float32, o_layout)

            for j in range(1, n_tiles):
                ks = (c + j) % K_STAGES
                vs = (c + j - 1) % V_STAGES
                mbarrier.wait(k_ready.index(ks), ((c + j) // K_STAGES) & 1)
                mbarrier.wait(v_ready.index(vs), ((c + j - 1) // V_STAGES) & 1)
                token = _turn(token, _WAIT_TURN)
                s = warpgroup_mma(qn_smem, kn_bufs.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma(qp_smem, kp_bufs.index(ks).permute((1, 0)), s, is_async=True)
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
                mbarrier.arrive(v_empty.index(vs))
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p = gl.convert_layout(p_f.to(dtype), p_layout)

            vs = (c + n_tiles - 1) % V_STAGES
            mbarrier.wait(v_ready.index(vs), ((c + n_tiles - 1) // V_STAGES) & 1)
            if tail < BLOCK_N:
                _zero_rows_from(v_bufs.index(vs), tail, BLOCK_N, VDIM)
            token = _turn(token, _WAIT_TURN)
            acc = warpgroup_mma(p, v_bufs.index(vs), acc, is_async=True)
            if (WG == 0) | (item + gl.num_programs(0) < num_items):  # warpgroup 1's last turn has no successor
                token = _turn(token, _PASS_TURN)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(vs))
            c += n_tiles

            # The output through this warpgroup's q_nope buffer (its last S is done).
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            qn_smem.store((acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]).to(dtype))
            fence_async_shared()
            _partition_barrier()
            row0 = tile * BLOCK_M + WG * HALF_M
            inside = (row0 + HALF_M <= q_len) & (q_start + row0 >= 0) & (q_start + row0 + HALF_M <= num_tokens)
            if OUT_TMA & inside:
                _tma_store(o_desc, [q_start + row0, h * VDIM], qn_smem)
                tma.store_wait(0)
            else:
                rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, row_layout))
                d = gl.arange(0, VDIM, layout=gl.SliceLayout(0, row_layout))
                keep = (rows < q_len) & (q_start + rows < num_tokens) & (q_start + rows >= 0)
                ptrs = out_ptr + (q_start + rows).to(gl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :]
                gl.store(ptrs, qn_smem.load(row_layout), mask=keep[:, None] & (d < VDIM)[None, :])
            _partition_barrier()
            mbarrier.arrive(q_empty)  # Q buffers free: the next item's Q may load

    @gluon.jit(do_not_specialize=["num_items", "num_tokens"])  # per-step sizes
    def _mla_prefill_hopper_kernel(  # type: ignore[no-untyped-def]
        qn_desc, qp_desc, kn_desc, kp_desc, v_desc, o_desc, out_ptr, q_start_ptr, k_start_ptr, tile_index_ptr,
        qk_scale, num_items, num_tokens, stride_ot, stride_oh,
        NUM_HEADS: gl.constexpr, NOPE: gl.constexpr, ROPE: gl.constexpr, VDIM: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
        OUT_TMA: gl.constexpr,
    ):  # fmt: skip
        """Persistent: program ``pid`` takes items ``pid, pid + grid, ...`` below ``num_items``
        (tile-index entries x heads)."""
        dtype: gl.constexpr = qn_desc.dtype
        qn0 = gl.allocate_shared_memory(dtype, qn_desc.block_type.shape, qn_desc.layout)
        qp0 = gl.allocate_shared_memory(dtype, qp_desc.block_type.shape, qp_desc.layout)
        qn1 = gl.allocate_shared_memory(dtype, qn_desc.block_type.shape, qn_desc.layout)
        qp1 = gl.allocate_shared_memory(dtype, qp_desc.block_type.shape, qp_desc.layout)
        kn_bufs = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, NOPE], kn_desc.layout)
        kp_bufs = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, ROPE], kp_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, VDIM], v_desc.layout)
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
        mbarrier.init(q_bars.index(0), count=1)  # Q loaded (all four boxes)
        mbarrier.init(q_bars.index(1), count=2)  # Q buffers free again: one arrive per consumer

        gl.warp_specialize(
            [
                (_mla_consumer, (qn0, qp0, q_bars.index(0), q_bars.index(1), kn_bufs, kp_bufs, v_bufs, k_ready,
                                 k_empty, v_ready, v_empty, out_ptr, o_desc, qk_scale, tile_index_ptr, q_start_ptr,
                                 k_start_ptr, num_items, num_tokens, stride_ot, stride_oh, 0, NUM_HEADS, VDIM,
                                 BLOCK_M, BLOCK_N, K_STAGES, V_STAGES, OUT_TMA)),
                (_mla_consumer, (qn1, qp1, q_bars.index(0), q_bars.index(1), kn_bufs, kp_bufs, v_bufs, k_ready,
                                 k_empty, v_ready, v_empty, out_ptr, o_desc, qk_scale, tile_index_ptr, q_start_ptr,
                                 k_start_ptr, num_items, num_tokens, stride_ot, stride_oh, 1, NUM_HEADS, VDIM,
                                 BLOCK_M, BLOCK_N, K_STAGES, V_STAGES, OUT_TMA)),
                (_mla_producer, (qn_desc, qp_desc, kn_desc, kp_desc, v_desc, qn0, qp0, qn1, qp1, q_bars.index(0),
                                 q_bars.index(1), kn_bufs, kp_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                 tile_index_ptr, q_start_ptr, k_start_ptr, num_items, NUM_HEADS, NOPE, ROPE, VDIM,
                                 BLOCK_M, BLOCK_N, K_STAGES, V_STAGES)),
            ],
            [4, 4],  # consumer warpgroup 1, producer warpgroup (the default partition is consumer 0)
            [240, 24],
        )  # fmt: skip


def _layout(block: list[int], dtype: torch.dtype) -> Any:
    return shared_layout(tuple(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _mla_descriptors(
    query: torch.Tensor, kv: torch.Tensor, key_pe: torch.Tensor, out: torch.Tensor | None, nope: int
) -> tuple[Any, ...]:
    """TMA descriptors: ``query`` and ``out`` as [tokens, heads * width] rows, ``kv`` as
    [keys, heads * (n + v)], ``key_pe`` as [keys, e] (their own row strides). Without ``out``
    the ``q_nope`` descriptor stands in for it (a kernel storing without TMA never reads it)."""
    tokens, heads, qk_dim = query.shape
    keys, _, kv_dim = kv.shape
    rope, value = qk_dim - nope, kv_dim - nope
    half_m, dt = MLA_HOPPER_BLOCK_M // 2, query.dtype
    q_rows = [tokens, heads * qk_dim]
    qn = TensorDescriptor(query, q_rows, [query.stride(0), 1], [half_m, nope], _layout([half_m, nope], dt))
    qp = TensorDescriptor(query, q_rows, [query.stride(0), 1], [half_m, rope], _layout([half_m, rope], dt))
    kv_rows = [keys, heads * kv_dim]
    kn = TensorDescriptor(kv, kv_rows, [kv.stride(0), 1], [_BLOCK_N, nope], _layout([_BLOCK_N, nope], dt))
    vd = TensorDescriptor(kv, kv_rows, [kv.stride(0), 1], [_BLOCK_N, value], _layout([_BLOCK_N, value], dt))
    kp = TensorDescriptor(key_pe, [keys, rope], [key_pe.stride(0), 1], [_BLOCK_N, rope], _layout([_BLOCK_N, rope], dt))
    od = qn
    if out is not None:
        od = TensorDescriptor(out, [tokens, heads * value], [out.stride(0), 1], [half_m, value],
                              _layout([half_m, value], dt))  # fmt: skip
    return qn, qp, kn, kp, vd, od


def mla_prefill_hopper(
    query: torch.Tensor,
    kv: torch.Tensor,
    key_pe: torch.Tensor,
    q_start: torch.Tensor,
    k_start: torch.Tensor,
    tile_index: torch.Tensor,
    *,
    nope: int,
    scale: float,
    out: torch.Tensor,
    programs: int,
) -> torch.Tensor:
    """Writes and returns ``out`` [T, H, v]. The arguments are :func:`.mla_prefill.mla_prefill`'s
    after its checks: ``q_start`` / ``k_start`` int32 [B + 1] row offsets on the device,
    ``tile_index`` int32 [tiles, 2] of :func:`.prefill.prefill_tile_index` with ``block_m``
    :data:`MLA_HOPPER_BLOCK_M`; the caller checked :func:`mla_hopper_applies`. ``programs``:
    persistent programs (one per SM)."""
    num_tiles, heads = tile_index.shape[0], query.shape[1]
    if num_tiles == 0 or heads == 0:
        return out
    if programs < 1:
        raise ValueError(f"programs: {programs} must be >= 1")
    out_tma = out_takes_tma(out, query.dtype)
    descs = _mla_descriptors(query, kv, key_pe, out if out_tma else None, nope)
    items = num_tiles * heads
    _mla_prefill_hopper_kernel[(min(programs, items),)](
        *descs, out, q_start, k_start, tile_index, scale * _LOG2E, items, query.shape[0], out.stride(0), out.stride(1),
        NUM_HEADS=heads, NOPE=nope, ROPE=query.shape[2] - nope, VDIM=kv.shape[2] - nope,
        BLOCK_M=MLA_HOPPER_BLOCK_M, BLOCK_N=_BLOCK_N, K_STAGES=_K_STAGES, V_STAGES=_V_STAGES, OUT_TMA=out_tma,
        num_warps=4,
    )  # fmt: skip
    return out
