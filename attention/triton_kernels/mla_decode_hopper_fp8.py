"""MLA decode on Hopper (sm_90) over an fp8 latent: the two-tile Gluon kernel's loop on e4m3 bytes.

The kernel of :mod:`.mla_decode_hopper` (the balanced work array, 64-latent tiles as the
warpgroup MMA's M, up to 16 heads as its N, one program an SM) for a float8_e4m3fn latent of
512 + 64 channels under bf16 queries. Half the bytes of a bf16 latent stream through a TMA
ring of fp8 tiles; the tensor cores take them in two ways:

- the scores: S^T = L Q^T is an fp8 MMA over the tile as loaded (its channels, the reduction,
  are contiguous, as an 8-bit operand must have them) against the query split into
  ``hi = e4m3(q * m)`` and ``lo = e4m3(q * m - hi)`` per head (``m`` puts the head's largest
  element at 224), two MMAs into one accumulator: about a bf16 query's 8 significant bits, as
  the GQA Hopper kernel's fp8 scores (:mod:`.decode_hopper`), hence bf16 queries only (fp16
  queries, 11 bits, keep the Triton kernel's fp16 dots);
- the output: O^T += L_R^T P^T reads the tile transposed (the latents, its reduction, are not
  contiguous), which Hopper's MMAs take only from a 16-bit operand: each thread turns its part
  of the tile's first 512 channels into fp16 (exact, ``cvt.rn.f16x2.e4m3x2``, one instruction a
  pair) in a buffer of its own while the score MMAs run, zeroing latents past the token's
  length (stale slots may hold NaN). The fp8 slot is refilled as soon as the scores and the
  conversion are done with it.

Opt-in (``launch_mla_hopper(..., fp8_one_warpgroup=True)``): the backend runs
:mod:`.mla_decode_hopper_fp8_ws`, which puts the conversion in a warpgroup of its own (1.23-1.36x
this kernel's speed on an H100) and uses this module's parts. H100,
16 heads, among layers (``benchmarks/results/mla-decode-fp8-hopper-2026-12-06.md``): 1.13x /
1.08x / 1.02x the bf16 latent's speed on :mod:`.mla_decode_hopper` at 64 x 4096 / LogNormal-128 /
512 x 512, where the Triton kernel's fp8 path ran 0.85-0.90x; on the H200 an earlier form (16-row
conversion steps) ran 0.76-0.78x (the Triton kernel 0.64x). The conversion is what holds it back:
the one warpgroup converts, multiplies and loads in turn (0.04 of 0.109 ms at 64 x 4096 on the
H200), and two fp8 tiles in flight are few bytes for the H200's latency.

The latent's scale (``kv_scale``: stored value times scale is the latent) multiplies the
scores and the output; partial outputs (float32, :func:`.mla_balanced.partial_dtype`), the merge
and its dependent launch are :mod:`.mla_decode_hopper`'s. Safety as there: lengths clamped to
the table, block ids outside ``[0, num_blocks)`` read block 0 and mask their latents, slots
outside the partial buffers are not stored.
"""

from __future__ import annotations

from typing import Any

import torch

from attention.triton_kernels.mla_balanced import program_work, segment_latents
from attention.triton_kernels.mla_tiles import token_extent
from attention.triton_kernels.prefill_hopper import _GLUON

if _GLUON:
    from attention.triton_kernels.mla_hopper_stores import (
        load_tile,
        load_tile_at,
        store_segment,
        table_page,
        tile_softmax,
    )
    from attention.triton_kernels.prefill_hopper import (
        TensorDescriptor,
        _partition_barrier,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        shared_layout,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = ["fp8_descriptors"]

#: fp8 tiles in flight per program (36 KiB each).
FP8_STAGES = 2


if _GLUON:

    @gluon.jit
    def _tile_to_f16(src, dst, valid, BLOCK_N: gl.constexpr, WIDTH: gl.constexpr):  # type: ignore[no-untyped-def]
        """A [BLOCK_N, WIDTH] fp8 tile in shared memory into ``dst`` as fp16 (exact), rows
        ``valid ..`` zeroed: 32 rows at a time, each thread converting 16-byte runs of a row.
        The conversion is latency-bound (one warp per scheduler): 32-row steps ran 1.03-1.08x
        faster than 16-row ones on an H100; whole halves spill."""
        ROWS: gl.constexpr = 32
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (WIDTH // 16), WIDTH // 16], [4, 1], [1, 0])
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        for r0 in gl.static_range(0, BLOCK_N, ROWS):
            x = src.slice(r0, ROWS, 0).load(layout).to(gl.float16)
            dst.slice(r0, ROWS, 0).store(gl.where((r0 + rows < valid)[:, None], x, gl.zeros_like(x)))

    @gluon.jit
    def _split_part(q, mul, hi_buf, lo_buf):  # type: ignore[no-untyped-def]
        """``q * mul`` (fp32, rows scaled) as e4m3 hi and lo parts into two shared buffers."""
        q = q * mul[:, None]
        hi = q.to(hi_buf.dtype)
        hi_buf.store(hi)
        lo_buf.store((q - hi.to(gl.float32)).to(lo_buf.dtype))

    @gluon.jit
    def _stage_query(  # type: ignore[no-untyped-def]
        q_ptr, t, num_heads, q_bufs, qe_bufs, scale_log2, HALF: gl.constexpr, ROPE: gl.constexpr,
        BLOCK_H: gl.constexpr, col_layout: gl.constexpr,
    ):  # fmt: skip
        """Token ``t``'s queries into shared memory for the score MMAs: each head times ``m``
        (its largest element to 224), split into e4m3 hi and lo parts: ``q_bufs`` [4, BLOCK_H,
        HALF] (channel half 0 hi, lo; half 1 hi, lo), ``qe_bufs`` [2, BLOCK_H, ROPE] (rows past
        the heads: zeros). Returns ``scale_log2 / m`` per head, the scores' factor, in ``col_layout``."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
        head_ok = (h < num_heads)[:, None]
        rows = q_ptr + (t.to(gl.int64) * num_heads + h.to(gl.int64))[:, None] * (2 * HALF + ROPE)
        ch = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))[None, :]
        ce = gl.arange(0, ROPE, layout=gl.SliceLayout(0, layout))[None, :]
        q_a = gl.load(rows + ch, mask=head_ok, other=0.0).to(gl.float32)
        q_b = gl.load(rows + HALF + ch, mask=head_ok, other=0.0).to(gl.float32)
        q_e = gl.load(rows + 2 * HALF + ce, mask=head_ok, other=0.0).to(gl.float32)
        most = gl.maximum(gl.maximum(gl.max(gl.abs(q_a), 1), gl.max(gl.abs(q_b), 1)), gl.max(gl.abs(q_e), 1))
        mul = gl.where(most > 0.0, 224.0 / most, 1.0)
        _split_part(q_a, mul, q_bufs.index(0), q_bufs.index(1))
        _split_part(q_b, mul, q_bufs.index(2), q_bufs.index(3))
        _split_part(q_e, mul, qe_bufs.index(0), qe_bufs.index(1))
        return gl.convert_layout(scale_log2 / mul, col_layout)

    @gluon.jit
    def _issue_scores(lat_a, lat_b, lat_e, q_bufs, qe_bufs, s_zero):  # type: ignore[no-untyped-def]
        """S^T = L Q^T for an fp8 tile (its two channel halves and the rotary part), each part
        against the query's hi and lo parts into one accumulator, issued asynchronously."""
        s = warpgroup_mma(lat_a, q_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(lat_a, q_bufs.index(1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(lat_b, q_bufs.index(2).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(lat_b, q_bufs.index(3).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(lat_e, qe_bufs.index(0).permute((1, 0)), s, is_async=True)
        return warpgroup_mma(lat_e, qe_bufs.index(1).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _allocate_buffers(  # type: ignore[no-untyped-def]
        c_desc, e_desc, HALF: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, FP16_TILES: gl.constexpr,
    ):  # fmt: skip
        """The fp8 kernels' shared buffers: the query's hi and lo parts ([4, BLOCK_H, HALF]: half
        0 hi, lo, half 1 hi, lo; [2, BLOCK_H, ROPE]), the ring of ``STAGES`` fp8 tiles (two
        channel halves and the rotary part each), ``FP16_TILES`` tiles' channel halves in fp16
        and P (fp16 [BLOCK_N, BLOCK_H])."""
        f8: gl.constexpr = c_desc.dtype
        q_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], f8)
        qe_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], f8)
        q_bufs = gl.allocate_shared_memory(f8, [4, BLOCK_H, HALF], q_smem)
        qe_bufs = gl.allocate_shared_memory(f8, [2, BLOCK_H, ROPE], qe_smem)
        c_bufs = gl.allocate_shared_memory(f8, [2 * STAGES, BLOCK_N, HALF], c_desc.layout)
        e_bufs = gl.allocate_shared_memory(f8, [STAGES, BLOCK_N, ROPE], e_desc.layout)
        h_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.float16)
        h_bufs = gl.allocate_shared_memory(gl.float16, [2 * FP16_TILES, BLOCK_N, HALF], h_smem)
        p_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.float16)
        p_buf = gl.allocate_shared_memory(gl.float16, [BLOCK_N, BLOCK_H], p_smem)
        return q_bufs, qe_bufs, c_bufs, e_bufs, h_bufs, p_buf

    @gluon.jit
    def _begin_segment(  # type: ignore[no-untyped-def]
        q_ptr, t, num_heads, q_bufs, qe_bufs, scale_log2, HALF: gl.constexpr, ROPE: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
    ):  # fmt: skip
        """Token ``t``'s query staged for the score MMAs (:func:`_stage_query`, visible to them on
        return; every score MMA of the previous segment must be done) and the segment's fresh
        state: (the scores' factor per head, running max, per-thread row sums, the two output
        halves O^T [HALF, heads])."""
        col = _stage_query(q_ptr, t, num_heads, q_bufs, qe_bufs, scale_log2, HALF, ROPE, BLOCK_H,
                           gl.SliceLayout(0, s_layout))  # fmt: skip
        fence_async_shared()
        _partition_barrier()
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
        l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)
        o_a = gl.zeros([HALF, BLOCK_H], gl.float32, o_layout)
        o_b = gl.zeros([HALF, BLOCK_H], gl.float32, o_layout)
        return col, m_i, l_part, o_a, o_b

    @gluon.jit
    def _pv(h_a, h_b, p_buf, o_a, o_b, alpha, o_layout: gl.constexpr):  # type: ignore[no-untyped-def]
        """O^T = O^T * alpha + L^T P^T over the fp16 channel halves ``h_a``, ``h_b`` ([BLOCK_N,
        HALF] in shared memory, read transposed) and P ``p_buf``, waited for."""
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))
        o_a = warpgroup_mma(h_a.permute((1, 0)), p_buf, o_a * alpha_o[None, :], is_async=True)
        o_b = warpgroup_mma(h_b.permute((1, 0)), p_buf, o_b * alpha_o[None, :], is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b))

    @gluon.jit(do_not_specialize=["num_tokens", "num_slots", "num_rows", "num_blocks", "table_width"])
    def _mla_hopper_fp8_kernel(  # type: ignore[no-untyped-def]
        q_ptr, c_desc, e_desc, kv_scale_ptr, table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, out_ptr,
        num_tokens, num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2, stride_ot, stride_oh,
        HALF: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """Program ``pid`` of the balanced work array over an fp8 latent, as
        :func:`.mla_decode_hopper._mla_hopper_kernel` (module docstring: what differs)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
        )
        out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        q_bufs, qe_bufs, c_bufs, e_bufs, h_bufs, p_buf = _allocate_buffers(
            c_desc, e_desc, HALF, ROPE, BLOCK_H, BLOCK_N, STAGES, 1
        )  # (one tile's channels in fp16)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)

        kv_scale = gl.load(kv_scale_ptr)
        g0, g1, t0, t_stop, first_slot, token_slots = program_work(
            work_ptr, num_tokens, gl.program_id(0), gl.num_programs(0)
        )
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, s_layout))
        head_ok = offs_h < num_heads
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)
        c = 0  # latent tiles this program loaded (the ring position)
        for t in range(t0, t_stop):
            t_first = gl.load(work_ptr + t)
            seg_start = gl.maximum(g0, t_first)
            seg_end = gl.minimum(g1, gl.load(work_ptr + t + 1))
            if seg_end > seg_start:
                row, seq_len = token_extent(rows_ptr, lens_ptr, t, num_rows, table_width, BLOCK_SIZE)
                start, end = segment_latents(t_first, seg_start, seg_end, seq_len, table_width, BLOCK_SIZE, BLOCK_N)
                n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
                table_row = table_ptr + row.to(gl.int64) * table_width
                for i in gl.static_range(STAGES):
                    if i < n_tiles:
                        load_tile(c_desc, e_desc, c_bufs, e_bufs, ready, c + i, table_row, start + i * BLOCK_N,
                                   table_width, num_blocks, HALF, STAGES, BLOCK_SIZE)  # fmt: skip
                # (every warp is past the previous segment's MMAs: its last tile's barrier)
                col, m_i, l_part, o_a, o_b = _begin_segment(
                    q_ptr, t, num_heads, q_bufs, qe_bufs, scale_log2 * kv_scale, HALF, ROPE, BLOCK_H, BLOCK_N, s_layout,
                    o_layout,
                )  # fmt: skip
                for j in range(n_tiles):
                    pos = c + j
                    slot = pos % STAGES
                    n0 = start + j * BLOCK_N
                    # Block ids read before the wait: this tile's, and the one its slot loads next.
                    page = table_page(table_row, n0, table_width, BLOCK_SIZE)
                    ahead = table_page(table_row, n0 + STAGES * BLOCK_N, table_width, BLOCK_SIZE)
                    valid = gl.where((page >= 0) & (page < num_blocks), end - n0, 0)
                    mbarrier.wait(ready.index(slot), (pos // STAGES) & 1)
                    lat_a = c_bufs.index(2 * slot)
                    lat_b = c_bufs.index(2 * slot + 1)
                    # The scores on the fp8 tile while the threads convert its channels for P V.
                    s = _issue_scores(lat_a, lat_b, e_bufs.index(slot), q_bufs, qe_bufs, s_zero)
                    _tile_to_f16(lat_a, h_bufs.index(0), valid, BLOCK_N, HALF)
                    _tile_to_f16(lat_b, h_bufs.index(1), valid, BLOCK_N, HALF)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                    fence_async_shared()
                    _partition_barrier()  # the fp8 slot is free; the fp16 channels are visible
                    if j + STAGES < n_tiles:
                        load_tile_at(c_desc, e_desc, c_bufs, e_bufs, ready, pos + STAGES, ahead, n0 + STAGES * BLOCK_N,
                                     num_blocks, HALF, STAGES, BLOCK_SIZE)  # fmt: skip
                    p, alpha, m_i, l_part, valid = tile_softmax(
                        s * col[None, :], page, n0, end, m_i, l_part, offs_n, num_blocks, 1.0
                    )  # (l_part: summed over the latents once, after the loop)
                    p_buf.store(p.to(gl.float16))
                    fence_async_shared()
                    _partition_barrier()
                    o_a, o_b = _pv(h_bufs.index(0), h_bufs.index(1), p_buf, o_a, o_b, alpha, o_layout)
                    _partition_barrier()  # every warp is done with the fp16 channels and p_buf
                c += n_tiles

                l_i = gl.sum(l_part, 0)
                o_a = gl.convert_layout(o_a * kv_scale, s_layout)
                o_b = gl.convert_layout(o_b * kv_scale, s_layout)
                slot_id = gl.where(seg_start == g0, first_slot, gl.load(token_slots + 2 * t))
                store_segment(acc_ptr, ml_ptr, out_ptr, token_slots, t, slot_id, num_slots, num_heads, stride_ot,
                              stride_oh, offs_h, head_ok, o_a, o_b, m_i, l_i, out_layout, HALF, DIRECT)  # fmt: skip


def fp8_descriptors(cache: torch.Tensor, rank: int, block_n: int) -> tuple[Any, Any]:
    """TMA descriptors of an fp8 latent cache viewed as [num_blocks * block_size, rank + rope]:
    boxes of ``block_n`` rows by half the rank's channels, and by the rotary channels."""
    num_blocks, block_size, _, dim = cache.shape
    rows = num_blocks * block_size

    def desc(box: list[int]) -> Any:
        layout = shared_layout(tuple(box), gl.float8e4nv)
        return TensorDescriptor(cache, [rows, dim], [dim, 1], box, layout)

    return desc([block_n, rank // 2]), desc([block_n, dim - rank])
