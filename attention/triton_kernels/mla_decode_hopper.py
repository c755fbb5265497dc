"""MLA decode on Hopper (sm_90) for up to 16 heads: a Gluon kernel on warpgroup MMAs.

The computation of :mod:`.mla_balanced` (absorbed MLA over the paged latents, on the same
length-balanced work array and the same merge), for the memory-bound case of DeepSeek-V3 split
over tensor-parallel ranks: at most 16 heads, a 16-bit latent of 512 + 64 channels, blocks of a
multiple of 64 tokens (an fp8 latent under bf16 queries: :mod:`.mla_decode_hopper_fp8_ws`,
launched from here; :mod:`.mla_decode_hopper_fp8` holds its parts and a slower one-warpgroup form).

Why a second kernel: with 16 heads the Triton kernel's dots have 16 rows, so they run as
``mma.sync`` with every warp holding the whole 16 x 576 query in registers (252 registers, two
programs an SM) and one 36-step MMA chain per warp; ncu shows its loop latency as long as the
memory's (``benchmarks/results/mla-decode-ncu-sliced-2026-12-04.md``). Here the latents are the
M side of Hopper's warpgroup MMA and the heads its N (= 16):

- S^T = L Q^T ([64 latents, 16 heads]) is three asynchronous MMAs over the tile's channel
  halves and its rotary part, all operands in shared memory (the query once per segment);
- the softmax runs per head over the tile's latents; P^T goes to shared memory. The row sums
  are kept per thread and summed across the warps once a segment, not every tile: compiled for
  sm_90 (Triton 3.6) a tile's path drops from 678 to 637 instructions and from 11 to 8
  barriers (a cross-warp sum is a shared-memory exchange); timed only on an H100 since (82%
  of the copy rate at 64x4096, 16 heads; benchmarks/results/decode-hopper-h100-2026-12-05.md);
- O^T += L_R^T P^T ([512 channels, 16 heads], two accumulators of 256) reads the same latent
  tile, transposed, as the MMA's A operand;
- a segment's partial output is stored in float16, each head's output and sum scaled by a
  power of two and its max raised to match (the merge's sums are unchanged, the channels keep
  11 significant bits at any size): half the bytes of float32, whose stores had cost 5% of the
  kernel's time on LogNormal rows (~2 segments a program). The merge is launched dependent on
  the kernel (PDL), its programs waiting for the kernel's stores instead of for its end.
  H100, against float32 partials and a plain merge launch in one run: 1.03x on LogNormal-128,
  1.03x on 512 x 512, 1.00x on 64 x 4096, the error against float64 unchanged
  (``benchmarks/results/mla-decode-partials-h100-2026-12-06.md``);
- each tile is three TMA boxes of the cache viewed as ``[num_blocks * block_size, 576]`` (a
  64-latent tile lies in one block), in a ring of two tiles: the next tile streams while this
  one is computed. One program per SM (the ring, the query and P take 180 KiB).

H200, 16 heads (``benchmarks/results/mla-decode-hopper-2026-12-04.json``): 1.02-1.03x the
Triton kernel, 78% / 76% of the copy rate at 64x4096 / LogNormal-128 (83% / 79% timed among
layers). The loop is still serial within a tile (S, softmax, P V, then the next tile's load
into the freed slot). :mod:`.mla_decode_hopper_ring` (``launch_mla_hopper(..., ring=True)``)
refills each channel half as soon as its P V MMA is done, from a ring of two and a half
tiles, and loads across a program's tokens: 0.98-0.99x this kernel's speed on the H200
(``benchmarks/results/mla-decode-ring-2026-12-05.json``), so not the default.
:mod:`.mla_decode_hopper_split` (``launch_mla_hopper(..., split=True)``) halves each tile's
work between two warpgroups and loads from a producer partition: 1.00x on an H100
(``benchmarks/results/mla-decode-split-h100-2026-12-06.md``), so not the default either.

Safety as in :mod:`.mla_balanced`: lengths clamped to the table, block ids outside
``[0, num_blocks)`` read block 0 and mask their latents, latent rows past a token's length are
zeroed in shared memory before P V reads them (stale slots may hold NaN), slots outside the
partial buffers are not stored.
"""

from __future__ import annotations

from typing import Any

import torch

from attention.errors import InvalidArgumentError
from attention.triton_kernels.mla_balanced import (
    MLAWork,
    _mla_balanced_merge_kernel,
    merge_range,
    mla_work_slots,
    partial_dtype,
    program_work,
    segment_latents,
)
from attention.triton_kernels.mla_tiles import token_extent
from attention.triton_kernels.paging import next_power_of_2
from attention.triton_kernels.prefill_hopper import _GLUON, hopper_prefill_possible

if _GLUON:
    from attention.triton_kernels.decode_hopper import _allocate_max_buf
    from attention.triton_kernels.mla_decode_hopper_fp8 import FP8_STAGES, _mla_hopper_fp8_kernel, fp8_descriptors
    from attention.triton_kernels.mla_decode_hopper_fp8_ws import FP8_WS_STAGES, _mla_hopper_fp8_ws_kernel
    from attention.triton_kernels.mla_decode_hopper_ring import HALVES, ROPES, _mla_hopper_ring_kernel
    from attention.triton_kernels.mla_decode_hopper_split import SPLIT_STAGES, _mla_hopper_split_kernel
    from attention.triton_kernels.mla_hopper_stores import (
        finish_segment,
        load_tile,
        merge_split_tokens,
        store_segment,
        tile_softmax,
        zero_latents_from,
        zero_unseen_tokens,
    )
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
    "MLA_HOPPER_BLOCK_N",
    "MLA_HOPPER_HEADS",
    "launch_mla_hopper",
    "mla_decode_hopper_applies",
    "mla_decode_hopper_dtypes_ok",
    "mla_decode_hopper_shape_ok",
]

#: Latents per tile (the warpgroup MMA's M); the work array must be planned with it.
MLA_HOPPER_BLOCK_N = 64
#: Most heads the kernel takes (the MMA's N).
MLA_HOPPER_HEADS = 16
_RANK, _ROPE = 512, 64
_STAGES = 2
#: The two-tile kernel's softmax takes its maxima over a tile's latents behind one barrier
#: (each warp's maxima to shared memory, then every thread reads the four warps'), where Triton
#: 3.6's ``gl.max`` takes two and a second round of shuffles: the same bits. Off: on an H100
#: 0.997-1.003x among layers (benchmarks/results/mla-one-barrier-2026-12-07.md); not yet timed on
#: an H200. A switch for A/B runs.
ONE_BARRIER_MAX = False


def mla_decode_hopper_shape_ok(heads: int, kv_lora_rank: int, rope: int, block_size: int) -> bool:
    """Whether the kernel takes this model shape (the latent's dtype aside): at most 16 heads,
    a latent of 512 + 64 channels, blocks of a multiple of 64 tokens."""
    shape_ok = (kv_lora_rank, rope) == (_RANK, _ROPE) and block_size % MLA_HOPPER_BLOCK_N == 0
    return 0 < heads <= MLA_HOPPER_HEADS and shape_ok


def mla_decode_hopper_dtypes_ok(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernels take these dtypes: a 16-bit latent in the query's dtype, or a
    float8_e4m3fn one under bf16 queries (:mod:`.mla_decode_hopper_fp8_ws`; the query's e4m3 hi +
    lo split holds about bf16's 8 bits, not fp16's 11)."""
    if query_dtype not in (torch.bfloat16, torch.float16):
        return False
    return cache_dtype == query_dtype or (cache_dtype == torch.float8_e4m3fn and query_dtype == torch.bfloat16)


def mla_decode_hopper_applies(query: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether :func:`launch_mla_hopper` takes a call: an sm_90 GPU with Gluon, at most 16 heads,
    a latent of 512 + 64 channels in blocks of a multiple of 64, either 16-bit (the query's
    dtype) or float8_e4m3fn under bf16 queries (:func:`mla_decode_hopper_dtypes_ok`), a
    contiguous query and cache with 16-byte aligned bases."""
    if not hopper_prefill_possible(query.device) or not mla_decode_hopper_dtypes_ok(query.dtype, cache.dtype):
        return False
    rope = query.shape[-1] - kv_lora_rank
    if not mla_decode_hopper_shape_ok(query.shape[1], kv_lora_rank, rope, cache.shape[1]):
        return False
    if not (query.is_contiguous() and cache.is_contiguous()):
        return False
    return query.data_ptr() % 16 == 0 and cache.data_ptr() % 16 == 0


if _GLUON:

    @gluon.jit(do_not_specialize=["num_tokens", "num_slots", "num_rows", "num_blocks", "table_width"])
    def _mla_hopper_kernel(  # type: ignore[no-untyped-def]
        q_desc, qe_desc, c_desc, e_desc, table_ptr, rows_ptr, lens_ptr, work_ptr, acc_ptr, ml_ptr, out_ptr,
        num_tokens, num_slots, num_rows, num_heads, num_blocks, table_width, scale_log2, stride_ot, stride_oh,
        HALF: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr, tail=0, FUSED: gl.constexpr = False,
        BLOCK_TAIL: gl.constexpr = 0, ONE_BARRIER: gl.constexpr = False,
    ):  # fmt: skip
        """Program ``pid`` of the balanced work array: its tokens' tiles within ``[g0, g1)``,
        each segment into a partial slot (or, under ``DIRECT``, a token of one segment into
        ``out``), as :func:`.mla_balanced._mla_balanced_kernel`. A programmatic-dependent launch
        after it (the merge) may start at once (without one, the trigger does nothing).
        ``FUSED``: no merge launch follows; the kernel stores every token's output itself
        (:func:`.mla_hopper_stores.finish_segment`: a token of one segment directly;
        :func:`.mla_hopper_stores.merge_split_tokens`: the last program to count a split
        token's segment merges its slots) and zeros the rows of tokens without latents, each
        with its ``tail`` channels after the first 512 zeroed. ``ONE_BARRIER``: the softmax's
        maxima behind one barrier (:data:`ONE_BARRIER_MAX`)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
        R: gl.constexpr = 2 * HALF
        dtype: gl.constexpr = c_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
        )
        out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        q_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_H, HALF], q_desc.layout)
        qe_buf = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], qe_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_N, HALF], c_desc.layout)
        e_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], e_desc.layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype)
        p_buf = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], p_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        mbarrier.init(q_bar, count=1)
        if ONE_BARRIER:  # noqa: SIM108 (a compile-time branch)
            max_buf = _allocate_max_buf(BLOCK_H)
        else:
            max_buf = 0

        g0, g1, t0, t_stop, first_slot, token_slots = program_work(
            work_ptr, num_tokens, gl.program_id(0), gl.num_programs(0)
        )
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, s_layout))
        head_ok = offs_h < num_heads
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)
        c = 0  # latent tiles this program loaded (the ring position)
        segs = 0  # segments this program ran (the query barrier's phase)
        for t in range(t0, t_stop):
            t_first = gl.load(work_ptr + t)
            seg_start = gl.maximum(g0, t_first)
            seg_end = gl.minimum(g1, gl.load(work_ptr + t + 1))
            if seg_end > seg_start:
                row, seq_len = token_extent(rows_ptr, lens_ptr, t, num_rows, table_width, BLOCK_SIZE)
                start, end = segment_latents(t_first, seg_start, seg_end, seq_len, table_width, BLOCK_SIZE, BLOCK_N)
                n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
                table_row = table_ptr + row.to(gl.int64) * table_width

                # The token's queries (rows of other tokens past num_heads are never stored).
                q_row = t * num_heads
                mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + qe_desc.block_type.nbytes)
                _tma_load(q_desc, [q_row, 0], q_bar, q_bufs.index(0))
                _tma_load(q_desc, [q_row, HALF], q_bar, q_bufs.index(1))
                _tma_load(qe_desc, [q_row, R], q_bar, qe_buf)
                for i in gl.static_range(STAGES):
                    if i < n_tiles:
                        load_tile(c_desc, e_desc, c_bufs, e_bufs, ready, c + i, table_row, start + i * BLOCK_N,
                                   table_width, num_blocks, HALF, STAGES, BLOCK_SIZE)  # fmt: skip
                mbarrier.wait(q_bar, segs & 1)
                m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
                l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_layout)  # row sums, per thread
                o_a = gl.zeros([HALF, BLOCK_H], gl.float32, s_layout)
                o_b = gl.zeros([HALF, BLOCK_H], gl.float32, s_layout)
                for j in range(n_tiles):
                    pos = c + j
                    slot = pos % STAGES
                    n0 = start + j * BLOCK_N
                    mbarrier.wait(ready.index(slot), (pos // STAGES) & 1)
                    lat_a = c_bufs.index(2 * slot)
                    lat_b = c_bufs.index(2 * slot + 1)
                    s = warpgroup_mma(lat_a, q_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    s = warpgroup_mma(lat_b, q_bufs.index(1).permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma(e_bufs.index(slot), qe_buf.permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                    page = gl.load(table_row + gl.minimum(n0 // BLOCK_SIZE, table_width - 1))
                    p, alpha, m_i, l_part, valid = tile_softmax(
                        s, page, n0, end, m_i, l_part, offs_n, num_blocks, scale_log2, max_buf, ONE_BARRIER
                    )  # (l_part: summed over the latents once, after the loop)
                    if valid < BLOCK_N:  # stale latents past the row (or a bad block): zeros for P V
                        zero_latents_from(lat_a, valid, BLOCK_N, HALF)
                        zero_latents_from(lat_b, valid, BLOCK_N, HALF)
                    p_buf.store(p.to(dtype))
                    fence_async_shared()
                    _partition_barrier()
                    o_a = warpgroup_mma(lat_a.permute((1, 0)), p_buf, o_a * alpha[None, :], is_async=True)
                    o_b = warpgroup_mma(lat_b.permute((1, 0)), p_buf, o_b * alpha[None, :], is_async=True)
                    o_a, o_b = warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b))
                    _partition_barrier()  # every warp is done with the slot (and with p_buf)
                    if j + STAGES < n_tiles:
                        load_tile(
                            c_desc, e_desc, c_bufs, e_bufs, ready, pos + STAGES, table_row, n0 + STAGES * BLOCK_N,
                            table_width, num_blocks, HALF, STAGES, BLOCK_SIZE,
                        )  # fmt: skip
                c += n_tiles
                segs += 1

                l_i = gl.sum(l_part, 0)
                slot_id = gl.where(seg_start == g0, first_slot, gl.load(token_slots + 2 * t))
                if FUSED:
                    finish_segment(acc_ptr, ml_ptr, out_ptr, token_slots, t, slot_id, num_slots, num_heads, stride_ot,
                                   stride_oh, tail, offs_h, head_ok, o_a, o_b, m_i, l_i, out_layout, HALF, BLOCK_H,
                                   BLOCK_TAIL)  # fmt: skip
                else:
                    store_segment(acc_ptr, ml_ptr, out_ptr, token_slots, t, slot_id, num_slots, num_heads, stride_ot,
                                  stride_oh, offs_h, head_ok, o_a, o_b, m_i, l_i, out_layout, HALF, DIRECT)  # fmt: skip
        if FUSED:
            merge_split_tokens(acc_ptr, ml_ptr, out_ptr, token_slots, t0, t_stop, num_slots, num_tokens, num_heads,
                               stride_ot, stride_oh, tail, BLOCK_H, 2 * HALF, BLOCK_TAIL)  # fmt: skip
            zero_unseen_tokens(out_ptr, token_slots, num_tokens, num_heads, stride_ot, stride_oh, tail,
                               gl.program_id(0), gl.num_programs(0), BLOCK_H, 2 * HALF, BLOCK_TAIL)  # fmt: skip


def _descriptors(query: torch.Tensor, cache: torch.Tensor) -> tuple[Any, Any, Any, Any]:
    """TMA descriptors: the query as [tokens * heads, 576] rows in boxes of 16 rows (256 and 64
    channels), the cache as [num_blocks * block_size, 576] in boxes of 64 rows."""
    tokens, heads, dim = query.shape
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    dtype = gl.bfloat16 if query.dtype == torch.bfloat16 else gl.float16
    half, n, h = _RANK // 2, MLA_HOPPER_BLOCK_N, MLA_HOPPER_HEADS

    def desc(t: torch.Tensor, rows: int, box: list[int]) -> Any:
        layout = shared_layout(tuple(box), dtype)
        return TensorDescriptor(t, [rows, dim], [dim, 1], box, layout)

    q_rows, c_rows = max(tokens * heads, 1), num_blocks * block_size
    return desc(query, q_rows, [h, half]), desc(query, q_rows, [h, _ROPE]), desc(cache, c_rows, [n, half]), desc(
        cache, c_rows, [n, _ROPE]
    )


def launch_mla_hopper(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    work: MLAWork,
    out: torch.Tensor,
    scale_log2: float,
    *,
    tail: int,
    kv_scale: torch.Tensor | None = None,
    ring: bool = False,
    split: bool = False,
    fp8_one_warpgroup: bool = False,
    skip_unseen: bool = False,
    merge_tokens: tuple[int, int] | None = None,
    fused_merge: bool = False,
) -> None:
    """The kernel and :mod:`.mla_balanced`'s merge on arguments :func:`.mla_decode.mla_attention`
    has checked and :func:`mla_decode_hopper_applies` accepted; ``work`` planned with
    :data:`MLA_HOPPER_BLOCK_N`; ``tail``: channels of ``out`` after the first 512 the merge
    zeroes; ``kv_scale``: an fp8 latent's fp32 [1] scale (the cache is fp8: the partitioned
    kernel of :mod:`.mla_decode_hopper_fp8_ws`, or with ``fp8_one_warpgroup`` the slower
    one-warpgroup kernel of :mod:`.mla_decode_hopper_fp8`, same results, whatever ``ring`` and
    ``split`` say); ``ring``: run the deeper-ring kernel of
    :mod:`.mla_decode_hopper_ring` (same results; 0.98-0.99x this kernel's speed on the H200,
    so not the default); ``split``: the split-warpgroup kernel of :mod:`.mla_decode_hopper_split`
    (same results) for a plan of partial slots (a ``direct`` plan runs this kernel). The partial
    outputs are :func:`.mla_balanced.partial_dtype`'s (float32 for the split kernel) and the
    merge is launched dependent on the kernel; ``skip_unseen``: tokens without latents keep
    their rows of ``out`` (else zeros); ``merge_tokens``: the merge runs on these tokens only
    (:func:`.mla_balanced.merge_range`); ``fused_merge``: the two-tile kernel over a 16-bit
    latent merges in the kernel (``FUSED``, on the counters of a plan made with them) and no
    merge is launched (same results; not with ``skip_unseen`` or ``merge_tokens``, which keep
    the merge launch)."""
    tokens, heads, _ = query.shape
    slots = mla_work_slots(work.programs, tokens, work.direct)
    fp8 = cache.dtype == torch.float8_e4m3fn
    split = split and not work.direct and not fp8  # (a direct plan runs the two-tile kernel)
    ring = ring and not fp8
    fused = fused_merge and work.counters and not (fp8 or split or ring or skip_unseen or merge_tokens is not None)
    # The split kernel's warpgroups each hold half the channels: no common scale, float32.
    acc = torch.empty(slots, heads, _RANK, dtype=torch.float32 if split else partial_dtype(query.dtype, cache.dtype),
                      device=query.device)  # fmt: skip
    ml = torch.empty(slots, heads, 2, dtype=torch.float32, device=query.device)
    rest = (tables, rows, lens, work.data, acc, ml, out, tokens, slots, tables.shape[0], heads, cache.shape[0],
            tables.shape[1], scale_log2, out.stride(0), out.stride(1))  # fmt: skip
    shape = dict(HALF=_RANK // 2, ROPE=_ROPE, BLOCK_H=MLA_HOPPER_HEADS, BLOCK_N=MLA_HOPPER_BLOCK_N,
                 BLOCK_SIZE=cache.shape[1], DIRECT=work.direct)  # fmt: skip
    if fp8:
        if kv_scale is None:
            raise InvalidArgumentError("kv_scale: an fp8 latent cache takes its fp32 [1] scale, got None")
        c_desc, e_desc = fp8_descriptors(cache, _RANK, MLA_HOPPER_BLOCK_N)
        if fp8_one_warpgroup:
            _mla_hopper_fp8_kernel[(work.programs,)](query, c_desc, e_desc, kv_scale, *rest, **shape,
                                                     STAGES=FP8_STAGES, num_warps=4)  # fmt: skip
        else:  # the conversion in a partition of its own
            _mla_hopper_fp8_ws_kernel[(work.programs,)](query, c_desc, e_desc, kv_scale, *rest, **shape,
                                                        STAGES=FP8_WS_STAGES, num_warps=4)  # fmt: skip
    else:
        args = (*_descriptors(query, cache), *rest)
        if split:
            _mla_hopper_split_kernel[(work.programs,)](*args, **shape, STAGES=SPLIT_STAGES, num_warps=4)
        elif ring:
            _mla_hopper_ring_kernel[(work.programs,)](*args, **shape, NH=HALVES, NE=ROPES, num_warps=4)
        elif fused:
            _mla_hopper_kernel[(work.programs,)](*args, **shape, STAGES=_STAGES, tail=tail, FUSED=True,
                                                 BLOCK_TAIL=next_power_of_2(tail) if tail else 0,
                                                 ONE_BARRIER=ONE_BARRIER_MAX, num_warps=4)  # fmt: skip
            return
        else:
            _mla_hopper_kernel[(work.programs,)](*args, **shape, STAGES=_STAGES, ONE_BARRIER=ONE_BARRIER_MAX,
                                                 num_warps=4)  # fmt: skip
    # Launched dependent on the kernel (programmatic dependent launch, sm_90): its programs
    # start while the kernel's last ones run and wait in gdc_wait for its stores.
    first, stop = merge_range(tokens, merge_tokens)
    if stop <= first:
        return
    _mla_balanced_merge_kernel[(stop - first, heads)](
        acc, ml, work.data, out, tokens, work.programs, slots, heads, out.stride(0), out.stride(1), tail, first,
        R=_RANK, BLOCK_R=_RANK, BLOCK_TAIL=next_power_of_2(tail) if tail else 0, DIRECT=work.direct, AFTER_PDL=True,
        SKIP_UNSEEN=skip_unseen, num_warps=4, launch_pdl=True,
    )  # fmt: skip
